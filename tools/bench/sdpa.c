/* attn bench sdpa: the fused attention forward, and with --backward its
 * backward alone and forward + backward, each against the float64 oracle. */
#include "common.h"
#include "commands.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct sdpa_case {
  attn_ctx *ctx;
  attn_tensor q, k, v, out;
  attn_sdpa_opts o;
  attn_tensor lse, dout, dq, dk, dv; /* --backward */
  attn_tensor kpm; /* --padding: [B, Nk] */
} sdpa_case;

static int run_sdpa(void *arg) {
  sdpa_case *c = arg;
  return attn_sdpa(c->ctx, &c->out, NULL, NULL, &c->q, &c->k, &c->v, &c->o);
}

static int run_sdpa_backward(void *arg) {
  sdpa_case *c = arg;
  return attn_sdpa_backward(c->ctx, &c->dq, &c->dk, &c->dv, NULL, NULL, &c->dout, &c->q, &c->k, &c->v, &c->out, &c->lse,
                            &c->o);
}

static int run_sdpa_fwd_bwd(void *arg) {
  sdpa_case *c = arg;
  int st = attn_sdpa(c->ctx, &c->out, &c->lse, NULL, &c->q, &c->k, &c->v, &c->o);
  return st ? st : run_sdpa_backward(c);
}

/* Keys query row i sees: [0, end). */
static int64_t causal_end(attn_causal c, int64_t i, int64_t Nq, int64_t Nk) {
  int64_t e;
  if (c == ATTN_CAUSAL_TOP_LEFT) e = i + 1;
  else if (c == ATTN_CAUSAL_BOTTOM_RIGHT) e = i + 1 + Nk - Nq;
  else return Nk;
  return e < 0 ? 0 : (e > Nk ? Nk : e);
}

/* A view of rows [r0, r0 + n) of (batch 0, head 0) of a [B, H, N, D] tensor. */
static attn_tensor head0_rows(const attn_tensor *t, int64_t r0, int64_t n) {
  attn_tensor s = *t;
  s.data = (char *)t->data + r0 * t->strides[2] * (int64_t)attn_dtype_size(t->dtype);
  s.shape[0] = 1;
  s.shape[1] = 1;
  s.shape[2] = n;
  return s;
}

static int sdpa_oracle(sdpa_case *c, report *rep, double pairs_per_head) {
  const int64_t B = c->q.shape[0], Hq = c->q.shape[1], Nq = c->q.shape[2], D = c->q.shape[3];
  const int64_t Nk = c->k.shape[2], Dv = c->v.shape[3];
  const double full_flop = 2.0 * (double)(D + Dv) * pairs_per_head * (double)(B * Hq);
  attn_sdpa_opts o = c->o;
  attn_tensor q = c->q, k = c->k, v = c->v, kp;
  int64_t r0 = 0, n = Nq, heads = B * Hq;
  if (full_flop <= ORACLE_MAX_FLOP) {
    snprintf(rep->subset, sizeof rep->subset, "all");
  } else {
    /* One head's last rows; each keeps exactly the keys it sees in the full problem. */
    n = Nq < 64 ? Nq : 64;
    heads = 1;
    const char *how = "";
    if (o.causal == ATTN_CAUSAL_TOP_LEFT) {
      if (Nq == Nk) {
        r0 = Nq - n; /* row r of the subset is row Nq - n + r: bottom-right sees j <= r + Nk - n = i */
        o.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
        how = ", causal as bottom-right on the subset";
      } else {
        r0 = 0; /* the first rows see j <= i under top-left in any problem */
      }
    } else {
      r0 = Nq - n; /* non-causal: any rows; bottom-right: the offset Nk - Nq is kept */
    }
    q = head0_rows(&c->q, r0, n);
    k = head0_rows(&c->k, 0, Nk);
    v = head0_rows(&c->v, 0, Nk);
    if (o.key_padding) { /* batch 0's row of it */
      kp = *o.key_padding;
      kp.shape[0] = 1;
      o.key_padding = &kp;
    }
    snprintf(rep->subset, sizeof rep->subset, "batch 0 head 0 query rows %lld..%lld of %lld, all %lld keys%s",
             (long long)r0, (long long)(r0 + n - 1), (long long)Nq, (long long)Nk, how);
  }
  attn_tensor ref;
  int64_t rs[4] = {q.shape[0], q.shape[1], n, Dv};
  if (attn_tensor_alloc(c->ctx, &ref, ATTN_F64, 4, rs)) return cli_fail(CLI_EXIT_FAIL, "oracle: out of memory");
  const double t0 = cli_now();
  if (attn_sdpa_ref(c->ctx, &ref, NULL, NULL, &q, &k, &v, &o)) {
    attn_tensor_free(&ref);
    return cli_fail(CLI_EXIT_FAIL, "oracle: %s", attn_ctx_error(c->ctx));
  }
  rep->oracle_s = cli_now() - t0;
  /* out is contiguous [B, Hq, Nq, Dv]: the checked heads' rows, one block of n rows per head */
  double num = 0, den = 0;
  for (int64_t h = 0; h < heads; h++) {
    const float *o32 = (const float *)c->out.data + (h * Nq + r0) * Dv;
    const double *o64 = (const double *)ref.data + h * n * Dv;
    for (int64_t i = 0; i < n * Dv; i++) {
      num += (o32[i] - o64[i]) * (o32[i] - o64[i]);
      den += o64[i] * o64[i];
    }
  }
  rep->oracle_err = den > 0 ? sqrt(num / den) : sqrt(num);
  attn_tensor_free(&ref);
  return 0;
}

/* Relative L2 of n floats against n doubles. */
static double rel_l2(const float *x, const double *y, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The backward's oracle: the float64 forward (exact out and lse), then the float64
 * backward, on everything or on batch 0's kv head 0 with its query heads. */
static int sdpa_backward_oracle(sdpa_case *c, report *rep, double pairs_per_head) {
  const int64_t B = c->q.shape[0], Hq = c->q.shape[1], Nq = c->q.shape[2], D = c->q.shape[3];
  const int64_t Hk = c->k.shape[1], Nk = c->k.shape[2], Dv = c->v.shape[3], group = Hq / Hk;
  const double head_flop = 2.0 * (double)(D + Dv) * pairs_per_head * FWD_BWD_FLOP_FACTOR; /* forward + backward */
  attn_tensor q = c->q, k = c->k, v = c->v, dout = c->dout;
  rep->bwd_oracle_err = rep->bwd_err[0] = rep->bwd_err[1] = rep->bwd_err[2] = rep->bwd_oracle_s = NAN;
  if (head_flop * (double)(B * Hq) <= ORACLE_BWD_MAX_FLOP) {
    snprintf(rep->bwd_subset, sizeof rep->bwd_subset, "all");
  } else if (head_flop * (double)group <= ORACLE_BWD_MAX_FLOP) {
    /* contiguous [B, H, N, D]: batch 0's first heads are the tensors' first elements */
    q.shape[0] = k.shape[0] = v.shape[0] = dout.shape[0] = 1;
    q.shape[1] = dout.shape[1] = group;
    k.shape[1] = v.shape[1] = 1;
    if (group == 1)
      snprintf(rep->bwd_subset, sizeof rep->bwd_subset, "batch 0 head 0 (all %lld query rows, all %lld keys)",
               (long long)Nq, (long long)Nk);
    else
      snprintf(rep->bwd_subset, sizeof rep->bwd_subset,
               "batch 0 kv head 0 with query heads 0..%lld (all %lld query rows, all %lld keys)",
               (long long)(group - 1), (long long)Nq, (long long)Nk);
  } else {
    snprintf(rep->bwd_subset, sizeof rep->bwd_subset,
             "skipped (even one kv head needs ~%.0f GFLOP of float64 forward+backward)",
             head_flop * (double)group * 1e-9);
    return 0;
  }
  const int64_t b = q.shape[0], hq = q.shape[1], hk = k.shape[1];
  int64_t os[4] = {b, hq, Nq, Dv}, ls[3] = {b, hq, Nq}, qs[4] = {b, hq, Nq, D}, ks[4] = {b, hk, Nk, D},
          vs[4] = {b, hk, Nk, Dv};
  attn_tensor out = {0}, lse = {0}, dq = {0}, dk = {0}, dv = {0};
  int r = 0;
  if (attn_tensor_alloc(c->ctx, &out, ATTN_F64, 4, os) || attn_tensor_alloc(c->ctx, &lse, ATTN_F64, 3, ls) ||
      attn_tensor_alloc(c->ctx, &dq, ATTN_F64, 4, qs) || attn_tensor_alloc(c->ctx, &dk, ATTN_F64, 4, ks) ||
      attn_tensor_alloc(c->ctx, &dv, ATTN_F64, 4, vs)) {
    r = cli_fail(CLI_EXIT_FAIL, "backward oracle: out of memory");
    goto done;
  }
  attn_sdpa_opts ob = c->o, o;
  attn_tensor kp;
  if (ob.key_padding && b < B) { /* batch 0's row of it */
    kp = *ob.key_padding;
    kp.shape[0] = b;
    ob.key_padding = &kp;
  }
  o = ob;
  const double t0 = cli_now();
  if (attn_sdpa_ref(c->ctx, &out, &lse, NULL, &q, &k, &v, &o) ||
      attn_sdpa_backward_ref(c->ctx, &dq, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &ob)) {
    r = cli_fail(CLI_EXIT_FAIL, "backward oracle: %s", attn_ctx_error(c->ctx));
    goto done;
  }
  rep->bwd_oracle_s = cli_now() - t0;
  rep->bwd_err[0] = rel_l2(c->dq.data, dq.data, attn_tensor_numel(&dq));
  rep->bwd_err[1] = rel_l2(c->dk.data, dk.data, attn_tensor_numel(&dk));
  rep->bwd_err[2] = rel_l2(c->dv.data, dv.data, attn_tensor_numel(&dv));
  rep->bwd_oracle_err = fmax(rep->bwd_err[0], fmax(rep->bwd_err[1], rep->bwd_err[2]));
done:
  attn_tensor_free(&out); attn_tensor_free(&lse);
  attn_tensor_free(&dq); attn_tensor_free(&dk); attn_tensor_free(&dv);
  return r;
}

/* q, k and v replaced by the same values rounded to dt (nothing to do for f32): the oracle reads them as stored. */
static int bench_round_inputs(attn_ctx *ctx, attn_tensor *q, attn_tensor *k, attn_tensor *v, attn_dtype dt) {
  attn_tensor *in[3] = {q, k, v};
  for (int i = 0; i < 3 && dt != ATTN_F32; i++) {
    attn_tensor h = {0};
    if (attn_tensor_alloc(ctx, &h, dt, 4, in[i]->shape) || attn_tensor_copy(ctx, &h, in[i])) {
      attn_tensor_free(&h);
      return cli_fail(CLI_EXIT_FAIL, "out of memory: %s", attn_ctx_error(ctx));
    }
    attn_tensor_free(in[i]);
    *in[i] = h;
  }
  return 0;
}

/* What the last forward (backward) ran on, from the context's plan. */
static const char *bench_forward_tiles(attn_ctx *ctx) {
  const char *plan = attn_ctx_plan(ctx);
  return strstr(plan, "(bf16 hi + lo)") ? "f16 split" : strstr(plan, "bf16 tiles") ? "bf16" : "fp32";
}
static const char *bench_backward_tiles(attn_ctx *ctx) {
  const char *plan = attn_ctx_plan(ctx);
  return strstr(plan, "attn_sdpa_backward, f16 tiles (bf16 hi + lo)") ? "f16 split"
         : strstr(plan, "attn_sdpa_backward, bf16 tiles")              ? "bf16"
                                                                       : "fp32";
}

/* --lengths L1,L2,...: a packed batch of sequences of those lengths (self-attention, Nq = Nk each), or
 * with --padded the same batch padded to the longest, with key_padding hiding each row's padding. The
 * flops are the sequences' own either way (4 D times each one's visible pairs), so GFLOP/s compare.
 * --dtype rounds q, k and v to f16 or bf16 (the oracle reads them as stored); --backward also times
 * the backward alone, after a forward that keeps lse. */
#define LENGTHS_MAX 256

/* One sequence's rows of a packed ([1, H, total, F] from row r0) or padded ([B, H, N, F], batch r0) tensor. */
static attn_tensor seq_rows(const attn_tensor *t, int padded, int64_t r0, int64_t n) {
  attn_tensor s = *t;
  const int64_t off = padded ? r0 * t->strides[0] : r0 * t->strides[2];
  s.data = (char *)t->data + off * (int64_t)attn_dtype_size(t->dtype);
  s.shape[0] = 1;
  s.shape[2] = n;
  return s;
}

/* The largest relative L2 over the n-row [1, H, n, F] f32 views got against the float64 want. */
static double seq_rel_l2(const attn_tensor *got, const attn_tensor *want) {
  const int64_t H = got->shape[1], n = got->shape[2], F = got->shape[3];
  double num = 0, den = 0;
  for (int64_t h = 0; h < H; h++)
    for (int64_t i = 0; i < n; i++)
      for (int64_t d = 0; d < F; d++) {
        const double x = ((const float *)got->data)[h * got->strides[1] + i * got->strides[2] + d];
        const double y = ((const double *)want->data)[(h * n + i) * F + d];
        num += (x - y) * (x - y), den += y * y;
      }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The forward (err[0]) and with backward the dq, dk, dv (err[1..3]) of sequence s (rows r0.., n of them)
 * against the float64 oracle on that sequence alone. */
static int varlen_oracle(sdpa_case *c, int padded, int64_t r0, int64_t n, int backward, double err[4]) {
  attn_ctx *ctx = c->ctx;
  const int64_t H = c->q.shape[1], G = c->k.shape[1], D = c->q.shape[3];
  attn_tensor q = seq_rows(&c->q, padded, r0, n), k = seq_rows(&c->k, padded, r0, n), v = seq_rows(&c->v, padded, r0, n);
  attn_tensor o = seq_rows(&c->out, padded, r0, n);
  attn_sdpa_opts oo;
  attn_sdpa_opts_init(&oo);
  oo.causal = c->o.causal;
  int64_t qs[4] = {1, H, n, D}, ks[4] = {1, G, n, D}, ls[3] = {1, H, n};
  attn_tensor ref = {0}, lse = {0}, dq = {0}, dk = {0}, dv = {0};
  int r = 0;
  if (attn_tensor_alloc(ctx, &ref, ATTN_F64, 4, qs) || (backward && attn_tensor_alloc(ctx, &lse, ATTN_F64, 3, ls)) ||
      (backward && attn_tensor_alloc(ctx, &dq, ATTN_F64, 4, qs)) || (backward && attn_tensor_alloc(ctx, &dk, ATTN_F64, 4, ks)) ||
      (backward && attn_tensor_alloc(ctx, &dv, ATTN_F64, 4, ks))) {
    r = cli_fail(CLI_EXIT_FAIL, "oracle: out of memory");
    goto done;
  }
  if (attn_sdpa_ref(ctx, &ref, backward ? &lse : NULL, NULL, &q, &k, &v, &oo)) {
    r = cli_fail(CLI_EXIT_FAIL, "oracle: %s", attn_ctx_error(ctx));
    goto done;
  }
  err[0] = seq_rel_l2(&o, &ref);
  if (backward) {
    attn_tensor g = seq_rows(&c->dout, padded, r0, n);
    if (attn_sdpa_backward_ref(ctx, &dq, &dk, &dv, NULL, NULL, &g, &q, &k, &v, &ref, &lse, &oo)) {
      r = cli_fail(CLI_EXIT_FAIL, "backward oracle: %s", attn_ctx_error(ctx));
      goto done;
    }
    attn_tensor gq = seq_rows(&c->dq, padded, r0, n), gk = seq_rows(&c->dk, padded, r0, n),
                gv = seq_rows(&c->dv, padded, r0, n);
    err[1] = seq_rel_l2(&gq, &dq), err[2] = seq_rel_l2(&gk, &dk), err[3] = seq_rel_l2(&gv, &dv);
  }
done:
  attn_tensor_free(&ref); attn_tensor_free(&lse);
  attn_tensor_free(&dq); attn_tensor_free(&dk); attn_tensor_free(&dv);
  return r;
}

static int bench_lengths(cli_args *a) {
  static const char *const refused[] = {"--batch", "--seq", "--kv-seq", "--padding", "--window", "--chunk", NULL};
  for (int i = 0; refused[i]; i++)
    if (cli_has(a, refused[i])) return cli_fail(CLI_EXIT_USAGE, "--lengths takes no %s", refused[i]);
  int64_t len[LENGTHS_MAX], cu[LENGTHS_MAX + 1] = {0}, S = 0, Lmax = 0;
  const char *p = cli_get(a, "--lengths");
  while (p && *p) { /* comma-separated integers >= 0 */
    char *end;
    const long long x = strtoll(p, &end, 10);
    if (end == p || x < 0 || x > (1 << 24) || (*end && *end != ',') || S == LENGTHS_MAX)
      return cli_fail(CLI_EXIT_USAGE, "--lengths wants up to %d comma-separated lengths in [0, 2^24], got '%s'",
                      LENGTHS_MAX, cli_show(cli_get(a, "--lengths")));
    len[S] = x, cu[S + 1] = cu[S] + x, Lmax = x > Lmax ? x : Lmax, S++;
    p = *end ? end + 1 : end;
  }
  if (!S) return cli_fail(CLI_EXIT_USAGE, "--lengths wants at least one length");
  long long H, G = 0, D, repeat = 0;
  int r;
  if ((r = bench_need_int(a, "sdpa", "--heads", 1 << 16, &H)) || (r = bench_need_int(a, "sdpa", "--dim", 1 << 16, &D)) ||
      (r = cli_int(a, "--kv-heads", 1, 1 << 16, &G)) || (r = cli_int(a, "--repeat", 1, BENCH_MAX_REPEATS, &repeat)))
    return r;
  if (!G) G = H;
  if (H % G) return cli_fail(CLI_EXIT_USAGE, "--heads (%lld) must be a multiple of --kv-heads (%lld)", H, G);
  attn_dtype dt;
  if ((r = bench_dtype(a, &dt))) return r;
  const char *cs = cli_get(a, "--causal");
  attn_causal causal = ATTN_CAUSAL_NONE;
  if (cs) {
    if (!*cs || !strcmp(cs, "top-left")) causal = ATTN_CAUSAL_TOP_LEFT;
    else if (!strcmp(cs, "bottom-right")) causal = ATTN_CAUSAL_BOTTOM_RIGHT;
    else return cli_fail(CLI_EXIT_USAGE, "--causal wants nothing, =top-left or =bottom-right, got '%s'", cli_show(cs));
  }
  const int padded = cli_has(a, "--padded"), backward = cli_has(a, "--backward");
  double pairs = 0; /* Nq = Nk: both alignments see L (L + 1) / 2 pairs */
  for (int64_t s = 0; s < S; s++) pairs += causal ? (double)len[s] * (double)(len[s] + 1) / 2 : (double)len[s] * len[s];
  const double gflop = 4.0 * (double)D * pairs * (double)H * 1e-9;
  const int64_t B = padded ? S : 1, N = padded ? Lmax : cu[S];
  if ((r = bench_check_work(a, "sdpa", gflop * (backward ? 1 + FWD_BWD_FLOP_FACTOR + BWD_FLOP_FACTOR : 1) *
                                           bench_min_runs(repeat))))
    return r;
  if ((r = bench_check_fits(4.0 * (double)B * (double)N * (double)D * (double)(2 * H + 2 * G) * (backward ? 2 : 1))))
    return r;
  attn_ctx *ctx;
  if ((r = bench_ctx(a, &ctx))) return r;
  if ((r = bench_precision(a, ctx))) {
    attn_ctx_destroy(ctx);
    return r;
  }
  sdpa_case c;
  memset(&c, 0, sizeof c);
  c.ctx = ctx;
  int64_t qs[4] = {B, H, N, D}, ks[4] = {B, G, N, D}, ps[2] = {B, N}, ls[3] = {B, H, N};
  if (attn_tensor_alloc(ctx, &c.q, ATTN_F32, 4, qs) || attn_tensor_alloc(ctx, &c.k, ATTN_F32, 4, ks) ||
      attn_tensor_alloc(ctx, &c.v, ATTN_F32, 4, ks) || attn_tensor_alloc(ctx, &c.out, ATTN_F32, 4, qs) ||
      (padded && attn_tensor_alloc(ctx, &c.kpm, ATTN_BOOL, 2, ps)) ||
      (backward && (attn_tensor_alloc(ctx, &c.lse, ATTN_F32, 3, ls) || attn_tensor_alloc(ctx, &c.dout, ATTN_F32, 4, qs) ||
                    attn_tensor_alloc(ctx, &c.dq, ATTN_F32, 4, qs) || attn_tensor_alloc(ctx, &c.dk, ATTN_F32, 4, ks) ||
                    attn_tensor_alloc(ctx, &c.dv, ATTN_F32, 4, ks)))) {
    r = cli_fail(CLI_EXIT_FAIL, "out of memory: %s", attn_ctx_error(ctx));
    goto done;
  }
  bench_fill(c.q.data, attn_tensor_numel(&c.q), 1, 1.0f);
  bench_fill(c.k.data, attn_tensor_numel(&c.k), 2, 1.0f);
  bench_fill(c.v.data, attn_tensor_numel(&c.v), 3, 1.0f);
  bench_fill(c.out.data, attn_tensor_numel(&c.out), 4, 1.0f);
  if (backward) {
    bench_fill(c.dout.data, attn_tensor_numel(&c.dout), 5, 1.0f);
    bench_fill(c.dq.data, attn_tensor_numel(&c.dq), 6, 1.0f); /* a skipped row cannot look right */
    for (int64_t e = 0; padded && e < B * H * N; e++) /* a padding row's loss is masked: its gradient is 0 */
      if (e % N >= len[e / (H * N)]) memset((float *)c.dout.data + e * D, 0, (size_t)D * sizeof(float));
  }
  if ((r = bench_round_inputs(ctx, &c.q, &c.k, &c.v, dt))) goto done;
  attn_sdpa_opts_init(&c.o);
  c.o.causal = causal;
  if (padded) {
    for (int64_t e = 0; e < B * N; e++) ((uint8_t *)c.kpm.data)[e] = e % N >= len[e / N];
    c.o.key_padding = &c.kpm;
  } else {
    c.o.cu_seqlens_q = cu;
    c.o.num_seqs = S;
  }
  timing t, tb = {0};
  if ((r = bench_time_runs(run_sdpa, &c, repeat, &t))) {
    r = cli_fail(CLI_EXIT_FAIL, "sdpa: %s", attn_ctx_error(ctx));
    goto done;
  }
  const char *tiles = bench_forward_tiles(ctx);
  const char *bwd_tiles = "fp32";
  if (backward) {
    if (attn_sdpa(ctx, &c.out, &c.lse, NULL, &c.q, &c.k, &c.v, &c.o) || (r = bench_time_runs(run_sdpa_backward, &c, repeat, &tb))) {
      r = cli_fail(CLI_EXIT_FAIL, "sdpa backward: %s", attn_ctx_error(ctx));
      goto done;
    }
    bwd_tiles = bench_backward_tiles(ctx);
  }
  /* the oracle on one sequence (the longest of at most 256 rows, else the shortest), alone */
  int64_t so = -1;
  for (int64_t s = 0; s < S; s++)
    if (len[s] && (so < 0 || (len[s] <= 256 ? len[s] > len[so] || len[so] > 256 : len[s] < len[so]))) so = s;
  double err[4] = {NAN, NAN, NAN, NAN};
  if (so >= 0 && (r = varlen_oracle(&c, padded, padded ? so : cu[so], len[so], backward, err))) goto done;
  peak_isa isa;
  const int threads = attn_ctx_threads(ctx);
  const double peak = strcmp(tiles, "fp32") ? bench_measure_bf16_peak(threads, attn_ctx_kernel(ctx), &isa)
                                            : bench_measure_peak(threads, &isa);
  const double gfs = gflop / t.median_s, bgfs = backward ? gflop * BWD_FLOP_FACTOR / tb.median_s : NAN;
  const double bwd_err = fmax(err[1], fmax(err[2], err[3]));
  if (cli_has(a, "--json")) {
    printf("{\"op\":\"sdpa\",\"mode\":\"%s\",\"lengths\":\"%s\",\"heads\":%lld,\"kv_heads\":%lld,\"dim\":%lld,"
           "\"causal\":\"%s\",\"threads\":%d,\"kernel\":\"%s\",\"dtype\":\"%s\",\"tiles\":\"%s\",",
           padded ? "padded" : "packed", cli_get(a, "--lengths"), H, G, D, causal ? (cs && !strcmp(cs, "bottom-right") ? "bottom-right" : "top-left") : "none",
           threads, attn_kernel_name(attn_ctx_kernel(ctx)), attn_dtype_name(dt), tiles);
    bench_json_num("gflop", gflop, 0);
    bench_json_num("median_s", t.median_s, 0);
    bench_json_num("gflops", gfs, 0);
    bench_json_num("peak_gflops", peak, 0);
    if (backward) {
      printf("\"backward_tiles\":\"%s\",", bwd_tiles);
      bench_json_num("backward_median_s", tb.median_s, 0);
      bench_json_num("backward_gflops", bgfs, 0);
      bench_json_num("backward_oracle_rel_l2", bwd_err, 0);
    }
    bench_json_num("oracle_rel_l2", err[0], 1);
    printf("}\n");
  } else {
    printf("sdpa %s batch of %lld sequences (lengths %s; %lld rows %s), H=%lld Hk=%lld D=%lld causal=%s, %s inputs, "
           "%d threads, kernel %s (%s tiles)\n", padded ? "padded" : "packed", (long long)S, cli_get(a, "--lengths"), (long long)(B * N),
           padded ? "with padding" : "in all", H, G, D, causal ? "yes" : "no", attn_dtype_name(dt), threads,
           attn_kernel_name(attn_ctx_kernel(ctx)), tiles);
    printf("  %.3f GFLOP (the sequences' own), median %.4f s over %lld runs: %.1f GFLOP/s (%.0f%% of the %s peak "
           "%.1f)\n", gflop, t.median_s, t.repeats, gfs, 100 * gfs / peak, strcmp(tiles, "fp32") ? "bf16" : "fp32", peak);
    if (backward)
      printf("  backward (%s tiles): median %.4f s over %lld runs: %.1f GFLOP/s (%.1f x the forward's flops)\n", bwd_tiles,
             tb.median_s, tb.repeats, bgfs, BWD_FLOP_FACTOR);
    if (so >= 0) {
      printf("  oracle: sequence %lld (%lld rows) rel L2 %.2e", (long long)so, (long long)len[so], err[0]);
      if (backward) printf("; backward dq %.2e, dk %.2e, dv %.2e", err[1], err[2], err[3]);
      printf("\n");
    }
  }
done:
  attn_tensor_free(&c.q); attn_tensor_free(&c.k); attn_tensor_free(&c.v); attn_tensor_free(&c.out);
  attn_tensor_free(&c.kpm); attn_tensor_free(&c.lse); attn_tensor_free(&c.dout);
  attn_tensor_free(&c.dq); attn_tensor_free(&c.dk); attn_tensor_free(&c.dv);
  attn_ctx_destroy(ctx);
  return r;
}

int cmd_bench_sdpa(int argc, char **argv) {
  static const char *const known[] = {"--batch", "--heads", "--kv-heads", "--seq", "--kv-seq", "--dim",
                                      "--threads", "--repeat", "--kernel", "--window", "--chunk", "--max-gflop",
                                      "--padding", "--dtype", "--precision", "--lengths", NULL};
  static const char *const switches[] = {"--causal", "--json", "--backward", "--padded", NULL};
  cli_args a;
  int r = cli_parse(&a, argc, argv, known, switches);
  if (r) return r;
  if (cli_has(&a, "--lengths")) return bench_lengths(&a);
  if (cli_has(&a, "--padded")) return cli_fail(CLI_EXIT_USAGE, "--padded needs --lengths");
  const int backward = cli_has(&a, "--backward");
  attn_dtype dt;
  if ((r = bench_dtype(&a, &dt))) return r;
  double padding = 0; /* the fraction of each row's keys, at its end, hidden by key_padding */
  if ((r = cli_double(&a, "--padding", &padding))) return r;
  if (!(padding >= 0 && padding < 1))
    return cli_fail(CLI_EXIT_USAGE, "--padding wants a fraction in [0, 1), got '%s'", cli_show(cli_get(&a, "--padding")));
  long long B, H, G = 0, N, M = 0, D, repeat = 0, window = 0, chunk = 0;
  if ((r = bench_need_int(&a, "sdpa", "--batch", 1 << 20, &B)) || (r = bench_need_int(&a, "sdpa", "--heads", 1 << 16, &H)) ||
      (r = bench_need_int(&a, "sdpa", "--seq", 1 << 24, &N)) || (r = bench_need_int(&a, "sdpa", "--dim", 1 << 16, &D)) ||
      (r = cli_int(&a, "--kv-heads", 1, 1 << 16, &G)) || (r = cli_int(&a, "--kv-seq", 1, 1 << 24, &M)) ||
      (r = cli_int(&a, "--repeat", 1, BENCH_MAX_REPEATS, &repeat)) || (r = cli_int(&a, "--window", 0, 1 << 24, &window)) ||
      (r = cli_int(&a, "--chunk", 0, 1 << 24, &chunk)))
    return r;
  if (!G) G = H;
  if (!M) M = N;
  if (H % G) return cli_fail(CLI_EXIT_USAGE, "--heads (%lld) must be a multiple of --kv-heads (%lld)", H, G);
  attn_causal causal = ATTN_CAUSAL_NONE;
  const char *cs = cli_get(&a, "--causal");
  if (cs) {
    if (!*cs || !strcmp(cs, "top-left")) causal = ATTN_CAUSAL_TOP_LEFT;
    else if (!strcmp(cs, "bottom-right")) causal = ATTN_CAUSAL_BOTTOM_RIGHT;
    else return cli_fail(CLI_EXIT_USAGE, "--causal wants nothing, =top-left or =bottom-right, got '%s'", cli_show(cs));
  }
  if ((window > 0 || chunk > 0) && causal == ATTN_CAUSAL_NONE) causal = ATTN_CAUSAL_TOP_LEFT; /* as the library reads them */
  const int64_t kept = M - (int64_t)(padding * (double)M); /* keys [0, kept) of each row are not padding */
  double pairs = 0; /* visible (query, key) pairs of one head */
  for (int64_t i = 0; i < N; i++) {
    const int64_t qpos = causal == ATTN_CAUSAL_BOTTOM_RIGHT ? i + M - N : i;
    const int64_t end = causal_end(causal, i, N, M) < kept ? causal_end(causal, i, N, M) : kept;
    int64_t begin = window > 0 && qpos - window + 1 > 0 ? qpos - window + 1 : 0; /* the window's first key */
    if (chunk > 0 && qpos >= 0 && qpos - qpos % chunk > begin) begin = qpos - qpos % chunk; /* the chunk's */
    pairs += end > begin ? (double)(end - begin) : 0;
  }
  const double fwd_gflop = 4.0 * (double)D * pairs * (double)(B * H) * 1e-9;
  /* --backward also times forward + backward and the backward alone */
  if ((r = bench_check_work(&a, "sdpa",
                      fwd_gflop * (backward ? 1 + FWD_BWD_FLOP_FACTOR + BWD_FLOP_FACTOR : 1) * bench_min_runs(repeat))))
    return r;
  const double qn = (double)B * H * N * D, kn = (double)B * G * M * D;
  /* q, k, v, out; with --backward also dout, dq, dk, dv and lse */
  const double io_bytes = ((double)attn_dtype_size(dt) * (qn + 2 * kn) + 4.0 * qn) * (backward ? 2 : 1) +
                          (backward ? 4.0 * B * H * N : 0);
  if ((r = bench_check_fits(io_bytes))) return r;
  attn_ctx *ctx;
  if ((r = bench_ctx(&a, &ctx))) return r;
  if ((r = bench_precision(&a, ctx))) {
    attn_ctx_destroy(ctx);
    return r;
  }

  sdpa_case c;
  memset(&c, 0, sizeof c);
  c.ctx = ctx;
  report rep;
  memset(&rep, 0, sizeof rep);
  int64_t qs[4] = {B, H, N, D}, ks[4] = {B, G, M, D};
  if (attn_tensor_alloc(ctx, &c.q, ATTN_F32, 4, qs) || attn_tensor_alloc(ctx, &c.k, ATTN_F32, 4, ks) ||
      attn_tensor_alloc(ctx, &c.v, ATTN_F32, 4, ks) || attn_tensor_alloc(ctx, &c.out, ATTN_F32, 4, qs)) {
    r = cli_fail(CLI_EXIT_FAIL, "out of memory: %s", attn_ctx_error(ctx));
    goto done;
  }
  bench_fill(c.q.data, attn_tensor_numel(&c.q), 1, 1.0f);
  bench_fill(c.k.data, attn_tensor_numel(&c.k), 2, 1.0f);
  bench_fill(c.v.data, attn_tensor_numel(&c.v), 3, 1.0f);
  bench_fill(c.out.data, attn_tensor_numel(&c.out), 4, 1.0f); /* a kernel that skips rows cannot look right */
  attn_sdpa_opts_init(&c.o);
  c.o.causal = causal;
  c.o.window = window;
  c.o.chunk = chunk;
  if (kept < M) {
    /* padded keys hold NaN, as the unused tail of a buffer may: hidden keys are never read, and the oracle check says so */
    int64_t ps[2] = {B, M};
    if (attn_tensor_alloc(ctx, &c.kpm, ATTN_BOOL, 2, ps)) {
      r = cli_fail(CLI_EXIT_FAIL, "out of memory: %s", attn_ctx_error(ctx));
      goto done;
    }
    for (int64_t e = 0; e < B * M; e++) ((uint8_t *)c.kpm.data)[e] = e % M >= kept;
    for (int64_t row = 0; row < B * G; row++)
      for (int64_t j = kept; j < M; j++)
        for (int64_t d = 0; d < D; d++)
          ((float *)c.k.data)[(row * M + j) * D + d] = ((float *)c.v.data)[(row * M + j) * D + d] = NAN;
    c.o.key_padding = &c.kpm;
  }
  if ((r = bench_round_inputs(ctx, &c.q, &c.k, &c.v, dt))) goto done;
  if (backward) {
    int64_t ls[3] = {B, H, N};
    if (attn_tensor_alloc(ctx, &c.lse, ATTN_F32, 3, ls) || attn_tensor_alloc(ctx, &c.dout, ATTN_F32, 4, qs) ||
        attn_tensor_alloc(ctx, &c.dq, ATTN_F32, 4, qs) || attn_tensor_alloc(ctx, &c.dk, ATTN_F32, 4, ks) ||
        attn_tensor_alloc(ctx, &c.dv, ATTN_F32, 4, ks)) {
      r = cli_fail(CLI_EXIT_FAIL, "out of memory: %s", attn_ctx_error(ctx));
      goto done;
    }
    bench_fill(c.dout.data, attn_tensor_numel(&c.dout), 5, 1.0f);
    bench_fill(c.dq.data, attn_tensor_numel(&c.dq), 6, 1.0f); /* as out: a skipped row cannot look right */
  }

  if ((r = bench_time_runs(run_sdpa, &c, repeat, &rep.t))) {
    r = cli_fail(CLI_EXIT_FAIL, "sdpa: %s", r == ATTN_E_NOMEM && !*attn_ctx_error(ctx) ? "out of memory"
                                                                                        : attn_ctx_error(ctx));
    goto done;
  }
  rep.tiles = bench_forward_tiles(ctx);
  /* forward (with lse) + backward first: it leaves the out and lse the backward alone then reads */
  if (backward && ((r = bench_time_runs(run_sdpa_fwd_bwd, &c, repeat, &rep.tfb)) ||
                   (r = bench_time_runs(run_sdpa_backward, &c, repeat, &rep.tb)))) {
    r = cli_fail(CLI_EXIT_FAIL, "sdpa backward: %s", r == ATTN_E_NOMEM && !*attn_ctx_error(ctx)
                                                           ? "out of memory" : attn_ctx_error(ctx));
    goto done;
  }
  rep.backward = backward;
  rep.backward_tiles = backward ? bench_backward_tiles(ctx) : "fp32";
  rep.rss_mib = bench_peak_rss_mib();
  rep.io_mib = io_bytes / 1048576.0;
  rep.op = "sdpa";
  rep.batch = B; rep.heads = H; rep.kv_heads = G; rep.seq = N; rep.kv_seq = M; rep.dim = D;
  rep.causal = causal == ATTN_CAUSAL_NONE ? "none" : causal == ATTN_CAUSAL_TOP_LEFT ? "top-left" : "bottom-right";
  rep.threads = attn_ctx_threads(ctx);
  rep.kernel = attn_kernel_name(attn_ctx_kernel(ctx));
  rep.attn_gflop = rep.gflop = fwd_gflop;
  rep.dtype = attn_dtype_name(dt);
  rep.precision = attn_precision_name(attn_ctx_precision(ctx));
  rep.peak_gflops = bench_measure_peak(rep.threads, &rep.isa);
  if (strcmp(rep.tiles, "fp32") != 0) { /* the unit the tiles ran on */
    rep.peak_gflops = bench_measure_bf16_peak(rep.threads, attn_ctx_kernel(ctx), &rep.isa);
  }
  if ((r = sdpa_oracle(&c, &rep, pairs))) goto done;
  if (backward && (r = sdpa_backward_oracle(&c, &rep, pairs))) goto done;
  bench_print_report(&rep, cli_has(&a, "--json"));
done:
  attn_tensor_free(&c.q); attn_tensor_free(&c.k); attn_tensor_free(&c.v); attn_tensor_free(&c.out);
  attn_tensor_free(&c.lse); attn_tensor_free(&c.dout); attn_tensor_free(&c.dq); attn_tensor_free(&c.dk);
  attn_tensor_free(&c.dv); attn_tensor_free(&c.kpm);
  attn_ctx_destroy(ctx);
  return r;
}
