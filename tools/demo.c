/* attn demo: the seed's multi-head self-attention layer on a built-in, fixed-seed
 * example — shapes, one head's attention weights, timing, and agreement with
 * the float64 oracle. */
#include "cli.h"
#include "commands.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const demo_tokens[] = {"the", "cat", "sat", "on", "the", "mat", "because", "it", "was", "tired"};
#define DEMO_N 10
#define DEMO_E 32
#define DEMO_H 4

/* A tiny deterministic generator: the demo prints the same numbers everywhere. */
static double demo_uniform(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return (double)(*s >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

static double rel_l2(const float *a, const double *b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static int demo_fail(attn_ctx *ctx, const char *what) {
  return cli_fail(CLI_EXIT_FAIL, "demo: %s: %s", what, attn_ctx_error(ctx));
}

int cmd_demo(int argc, char **argv) {
  static const char *const known[] = {"--threads", NULL};
  cli_args a;
  int r = cli_parse(&a, argc, argv, known, NULL);
  if (r) return r;
  long long threads = 0;
  if ((r = cli_int(&a, "--threads", 0, 4096, &threads))) return r;
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx)) return cli_fail(CLI_EXIT_FAIL, "out of memory");
  attn_ctx_set_threads(ctx, (int)threads);

  /* The seed's module: MultiHeadSelfAttention(embed_size=32, num_heads=4),
   * parameters drawn like nn.Linear's default, U(-1/sqrt(E), 1/sqrt(E)). */
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, DEMO_E, DEMO_H);
  attn_mha *mha;
  if (attn_mha_create(ctx, &mha, &cfg)) return demo_fail(ctx, "create");
  uint64_t seed = 20240601;
  const double bound = 1.0 / sqrt((double)DEMO_E);
  static const char *const seed_names[] = {"wq.weight", "wq.bias", "wk.weight", "wk.bias",
                                           "wv.weight", "wv.bias", "dense.weight", "dense.bias"};
  float wbuf[DEMO_E * DEMO_E];
  for (int p = 0; p < 8; p++) {
    int64_t shape[2] = {DEMO_E, DEMO_E};
    const int is_bias = p % 2;
    for (int i = 0; i < (is_bias ? DEMO_E : DEMO_E * DEMO_E); i++) wbuf[i] = (float)(bound * demo_uniform(&seed));
    attn_tensor t = attn_tensor_view(wbuf, ATTN_F32, is_bias ? 1 : 2, shape);
    if (attn_mha_set_param(ctx, mha, seed_names[p], &t)) return demo_fail(ctx, "set_param");
  }

  /* Token embeddings: one fixed vector per distinct word plus a sinusoidal position. */
  static float x[DEMO_N * DEMO_E];
  for (int n = 0; n < DEMO_N; n++) {
    uint64_t ws = 1469598103934665603ull;
    for (const char *c = demo_tokens[n]; *c; c++) ws = (ws ^ (uint8_t)*c) * 1099511628211ull;
    for (int e = 0; e < DEMO_E; e++) {
      const double freq = pow(10000.0, -(double)(e / 2 * 2) / DEMO_E);
      const double pos = e % 2 ? cos(n * freq) : sin(n * freq);
      x[n * DEMO_E + e] = (float)(demo_uniform(&ws) + 0.5 * pos);
    }
  }
  int64_t xs[3] = {1, DEMO_N, DEMO_E}, ws4[4] = {1, DEMO_H, DEMO_N, DEMO_N};
  static float out[DEMO_N * DEMO_E], w[DEMO_H * DEMO_N * DEMO_N];
  static double out_ref[DEMO_N * DEMO_E], w_ref[DEMO_H * DEMO_N * DEMO_N];
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 3, xs), to = attn_tensor_view(out, ATTN_F32, 3, xs);
  attn_tensor tw = attn_tensor_view(w, ATTN_F32, 4, ws4);
  attn_tensor tor = attn_tensor_view(out_ref, ATTN_F64, 3, xs), twr = attn_tensor_view(w_ref, ATTN_F64, 4, ws4);
  attn_mha_opts o;
  attn_mha_opts_init(&o);

  const int reps = 201;
  double times[201];
  for (int i = 0; i < reps; i++) {
    double t0 = cli_now();
    if (attn_mha_forward(ctx, mha, &to, &tw, &tx, NULL, NULL, &o)) return demo_fail(ctx, "forward");
    times[i] = cli_now() - t0;
  }
  qsort(times, reps, sizeof times[0], cmp_double);
  const attn_kernel fast = attn_ctx_kernel(ctx);
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_REF);
  double t0 = cli_now();
  if (attn_mha_forward(ctx, mha, &tor, &twr, &tx, NULL, NULL, &o)) return demo_fail(ctx, "oracle");
  const double t_ref = cli_now() - t0;

  printf("libattn %s: the seed's MultiHeadSelfAttention(embed_size=%d, num_heads=%d)\n", attn_version_string(), DEMO_E,
         DEMO_H);
  printf("  input   x        [B=1, N=%d, E=%d]  (\"", DEMO_N, DEMO_E);
  for (int n = 0; n < DEMO_N; n++) printf("%s%s", n ? " " : "", demo_tokens[n]);
  printf("\")\n  output  out      [1, %d, %d]\n  weights per head [1, %d, %d, %d]\n\n", DEMO_N, DEMO_E, DEMO_H, DEMO_N,
         DEMO_N);
  printf("attention weights of head 0 (row: query token, column: key token; each row sums to 1)\n%9s", "");
  for (int j = 0; j < DEMO_N; j++) printf(" %6.6s", demo_tokens[j]);
  printf("\n");
  for (int i = 0; i < DEMO_N; i++) {
    printf("%9.9s", demo_tokens[i]);
    double rs = 0;
    for (int j = 0; j < DEMO_N; j++) {
      printf(" %6.3f", w[i * DEMO_N + j]);
      rs += w[i * DEMO_N + j];
    }
    printf("   sum %.4f\n", rs);
  }
  printf("\nout[0, 0, :6] = ");
  for (int e = 0; e < 6; e++) printf("%s%.5f", e ? " " : "", out[e]);
  printf("\n\ntiming: %s kernel %.1f us (median of %d, %d threads); float64 oracle %.1f us\n", attn_kernel_name(fast),
         times[reps / 2] * 1e6, reps, attn_ctx_threads(ctx), t_ref * 1e6);
  const double e_out = rel_l2(out, out_ref, DEMO_N * DEMO_E), e_w = rel_l2(w, w_ref, DEMO_H * DEMO_N * DEMO_N);
  printf("agreement with the float64 oracle (relative L2): output %.2e, weights %.2e  [%s]\n", e_out, e_w,
         e_out <= 1e-5 && e_w <= 1e-5 ? "ok, <= 1e-5" : "FAILED");
  attn_mha_destroy(mha);
  attn_ctx_destroy(ctx);
  return e_out <= 1e-5 && e_w <= 1e-5 ? 0 : CLI_EXIT_FAIL;
}
