/* attn bench mha: the multi-head attention layer forward (projections
 * included) against the float64 layer (on the f32 inputs as given, so
 * --precision bf16 shows its rounding in the error). --dtype bf16|f16: a
 * model in that type, as the layer holds one: x and every parameter rounded
 * to it (the layer stores f32, which holds them exactly), and the bf16 or
 * f16 precision policy unless --precision says otherwise. */
#include "common.h"
#include "commands.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct mha_case {
  attn_ctx *ctx;
  attn_mha *mha;
  attn_tensor x, out;
} mha_case;

static int run_mha(void *arg) {
  mha_case *c = arg;
  return attn_mha_forward(c->ctx, c->mha, &c->out, NULL, &c->x, NULL, NULL, NULL);
}

/* The float64 layer on all batches, on batch 0, or on batch 0's last query rows
 * (queries from those rows, keys and values from every row: the same outputs as
 * self-attention gives those rows), whichever is the largest that stays cheap. */
static int mha_oracle(mha_case *c, report *rep) {
  const int64_t B = c->x.shape[0], N = c->x.shape[1], E = c->x.shape[2];
  const double per_batch = 4.0 * N * N * E + 8.0 * N * E * E;
  const int64_t n = N < 64 ? N : 64;
  const double rows_flop = 2.0 * n * E * E * 2 + 4.0 * N * E * E + 4.0 * n * N * E;
  int64_t b = B, r0 = 0, rows = N;
  int cross = 0;
  if (per_batch * (double)B <= ORACLE_MAX_FLOP) {
    snprintf(rep->subset, sizeof rep->subset, "all");
  } else if (per_batch <= ORACLE_MAX_FLOP) {
    b = 1;
    snprintf(rep->subset, sizeof rep->subset, "batch 0 (all %lld rows)", (long long)N);
  } else if (rows_flop <= ORACLE_MAX_FLOP) {
    b = 1;
    r0 = N - n;
    rows = n;
    cross = 1;
    snprintf(rep->subset, sizeof rep->subset, "batch 0 query rows %lld..%lld of %lld (keys and values from all rows)",
             (long long)r0, (long long)(N - 1), (long long)N);
  } else {
    rep->oracle_err = NAN;
    rep->oracle_s = NAN;
    snprintf(rep->subset, sizeof rep->subset, "skipped (even 64 rows need ~%.0f GFLOP of float64, ~%.0f s at ~1 GFLOP/s)",
             rows_flop * 1e-9, rows_flop * 1e-9);
    return 0;
  }
  attn_ctx *rctx;
  if (attn_ctx_create(&rctx)) return cli_fail(CLI_EXIT_FAIL, "oracle: out of memory");
  attn_ctx_set_threads(rctx, attn_ctx_threads(c->ctx));
  attn_ctx_set_kernel(rctx, ATTN_KERNEL_REF);
  attn_tensor xs = c->x, kv = c->x, ref;
  xs.shape[0] = kv.shape[0] = b;
  xs.data = (float *)c->x.data + r0 * E;
  xs.shape[1] = rows;
  int64_t os[3] = {b, rows, E};
  int ret = 0;
  if (attn_tensor_alloc(rctx, &ref, ATTN_F64, 3, os)) {
    attn_ctx_destroy(rctx);
    return cli_fail(CLI_EXIT_FAIL, "oracle: out of memory");
  }
  const double t0 = cli_now();
  if (attn_mha_forward(rctx, c->mha, &ref, NULL, &xs, cross ? &kv : NULL, cross ? &kv : NULL, NULL)) {
    ret = cli_fail(CLI_EXIT_FAIL, "oracle: %s", attn_ctx_error(rctx));
  } else {
    rep->oracle_s = cli_now() - t0;
    double num = 0, den = 0;
    for (int64_t bb = 0; bb < b; bb++)
      for (int64_t i = 0; i < rows; i++)
        for (int64_t e = 0; e < E; e++) {
          const double x = ((const float *)c->out.data)[(bb * N + r0 + i) * E + e];
          const double y = ((const double *)ref.data)[(bb * rows + i) * E + e];
          num += (x - y) * (x - y);
          den += y * y;
        }
    rep->oracle_err = den > 0 ? sqrt(num / den) : sqrt(num);
  }
  attn_tensor_free(&ref);
  attn_ctx_destroy(rctx);
  return ret;
}

/* t's f32 values rounded to dt (nearest even) and back: what a model stored in dt holds. */
static int round_through(attn_ctx *ctx, attn_tensor *t, attn_dtype dt) {
  attn_tensor h;
  if (attn_tensor_alloc(ctx, &h, dt, t->rank, t->shape)) return cli_fail(CLI_EXIT_FAIL, "out of memory");
  const int bad = attn_tensor_copy(ctx, &h, t) || attn_tensor_copy(ctx, t, &h);
  attn_tensor_free(&h);
  return bad ? cli_fail(CLI_EXIT_FAIL, "mha: %s", attn_ctx_error(ctx)) : 0;
}

int cmd_bench_mha(int argc, char **argv) {
  static const char *const known[] = {"--batch", "--seq", "--embed", "--heads", "--threads", "--repeat", "--kernel",
                                      "--max-gflop", "--precision", "--dtype", NULL};
  static const char *const switches[] = {"--json", "--backward", NULL};
  cli_args a;
  int r = cli_parse(&a, argc, argv, known, switches);
  if (r) return r;
  if (cli_has(&a, "--backward")) return cli_fail(CLI_EXIT_USAGE, "bench mha --backward: not implemented yet");
  long long B, N, E, H, repeat = 0;
  if ((r = bench_need_int(&a, "mha", "--batch", 1 << 20, &B)) || (r = bench_need_int(&a, "mha", "--seq", 1 << 24, &N)) ||
      (r = bench_need_int(&a, "mha", "--embed", 1 << 20, &E)) || (r = bench_need_int(&a, "mha", "--heads", 1 << 16, &H)) ||
      (r = cli_int(&a, "--repeat", 1, BENCH_MAX_REPEATS, &repeat)))
    return r;
  if (E % H) return cli_fail(CLI_EXIT_USAGE, "--embed (%lld) must be a multiple of --heads (%lld)", E, H);
  const double attn_gflop = 4.0 * (double)B * H * N * N * (double)(E / H) * 1e-9;
  const double proj_gflop = 4 * 2.0 * (double)B * N * E * E * 1e-9;
  if ((r = bench_check_work(&a, "mha", (attn_gflop + proj_gflop) * bench_min_runs(repeat)))) return r;
  if ((r = bench_check_fits(4.0 * (6.0 * B * N * E + 4.0 * E * E)))) return r;
  attn_ctx *ctx;
  if ((r = bench_ctx(&a, &ctx))) return r;
  attn_dtype dt;
  if ((r = bench_dtype(&a, &dt)) ||
      (dt != ATTN_F32 && !cli_has(&a, "--precision") &&
       attn_ctx_set_precision(ctx, dt == ATTN_BF16 ? ATTN_PRECISION_BF16 : ATTN_PRECISION_F16)) ||
      (r = bench_precision(&a, ctx))) {
    attn_ctx_destroy(ctx);
    return r ? r : 1;
  }

  mha_case c;
  memset(&c, 0, sizeof c);
  c.ctx = ctx;
  report rep;
  memset(&rep, 0, sizeof rep);
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, E, H); /* with biases, as nn.MultiheadAttention */
  if (attn_mha_create(ctx, &c.mha, &cfg)) {
    r = cli_fail(CLI_EXIT_FAIL, "mha: %s", attn_ctx_error(ctx));
    goto done;
  }
  double param_bytes = 0;
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, c.mha, (attn_mha_param)p)) continue; /* no such bias */
    bench_fill(t.data, attn_tensor_numel(&t), 100 + (uint64_t)p, (float)(1.0 / sqrt((double)E))); /* nn.Linear's range */
    if (dt != ATTN_F32 && (r = round_through(ctx, &t, dt))) goto done;
    param_bytes += 4.0 * (double)attn_tensor_numel(&t);
  }
  int64_t xs[3] = {B, N, E};
  if (attn_tensor_alloc(ctx, &c.x, ATTN_F32, 3, xs) || attn_tensor_alloc(ctx, &c.out, ATTN_F32, 3, xs)) {
    r = cli_fail(CLI_EXIT_FAIL, "out of memory: %s", attn_ctx_error(ctx));
    goto done;
  }
  bench_fill(c.x.data, attn_tensor_numel(&c.x), 1, 1.0f);
  if (dt != ATTN_F32 && (r = round_through(ctx, &c.x, dt))) goto done;
  bench_fill(c.out.data, attn_tensor_numel(&c.out), 4, 1.0f);

  if ((r = bench_time_runs(run_mha, &c, repeat, &rep.t))) {
    r = cli_fail(CLI_EXIT_FAIL, "mha: %s", r == ATTN_E_NOMEM && !*attn_ctx_error(ctx) ? "out of memory"
                                                                                      : attn_ctx_error(ctx));
    goto done;
  }
  rep.rss_mib = bench_peak_rss_mib();
  rep.io_mib = (2.0 * 4.0 * (double)B * N * E + param_bytes) / 1048576.0; /* x, out and the parameters */
  rep.op = "mha";
  rep.batch = B; rep.heads = H; rep.kv_heads = H; rep.seq = N; rep.kv_seq = N; rep.dim = E / H; rep.embed = E;
  rep.causal = "none";
  rep.threads = attn_ctx_threads(ctx);
  rep.kernel = attn_kernel_name(attn_ctx_kernel(ctx));
  rep.attn_gflop = attn_gflop;
  rep.proj_gflop = proj_gflop;
  rep.gflop = rep.attn_gflop + rep.proj_gflop;
  rep.dtype = attn_dtype_name(dt);
  rep.precision = attn_precision_name(attn_ctx_precision(ctx));
  rep.tiles = strstr(attn_ctx_plan(ctx), "(bf16 hi + lo)") ? "f16 split"
                : strstr(attn_ctx_plan(ctx), "bf16 tiles")   ? "bf16"
                                                             : "fp32"; /* what the attention ran on */
  rep.peak_gflops = bench_measure_peak(rep.threads, &rep.isa);
  if (!strcmp(rep.tiles, "bf16")) { /* the projections and the attention ran on the bf16 unit (f16: fp32 GEMMs) */
    rep.peak_gflops = bench_measure_bf16_peak(rep.threads, attn_ctx_kernel(ctx), &rep.isa);
  }
  if ((r = mha_oracle(&c, &rep))) goto done;
  bench_print_report(&rep, cli_has(&a, "--json"));
done:
  attn_tensor_free(&c.x); attn_tensor_free(&c.out);
  attn_mha_destroy(c.mha);
  attn_ctx_destroy(ctx);
  return r;
}
