/* What the structure-aware harnesses (fuzz_sdpa.c, fuzz_mha.c, fuzz_paged.c,
 * fuzz_kv.c) share: the input read one choice at a time, a value generator
 * seeded by the input, the kernels this CPU has, the failure report (what the
 * input chose, then the operations run), and the KV caches' storage rounding. */
#ifndef ATTN_FUZZ_COMMON_H
#define ATTN_FUZZ_COMMON_H

#include "attn.h"

#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct fuzz_reader {
  const uint8_t *p;
  size_t n, at;
} fuzz_reader;

/* A choice in [0, n): one byte of the input (two when n > 256), 0 once it runs out. */
static inline int64_t fuzz_pick(fuzz_reader *r, int64_t n) {
  if (n <= 1) return 0;
  uint32_t x = r->at < r->n ? r->p[r->at++] : 0;
  if (n > 256) x = x << 8 | (r->at < r->n ? r->p[r->at++] : 0);
  return (int64_t)(x % (uint32_t)n);
}

/* The values: splitmix64 seeded by a hash of the whole input, uniform in [-1, 1). */
static uint64_t fuzz_rng_state;
static inline void fuzz_seed(const uint8_t *data, size_t size) {
  uint64_t h = 1469598103934665603u;
  for (size_t i = 0; i < size; i++) h = (h ^ data[i]) * 1099511628211u;
  fuzz_rng_state = h;
}
static inline double fuzz_uniform(void) {
  uint64_t z = (fuzz_rng_state += 0x9e3779b97f4a7c15u);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
  z ^= z >> 31;
  return (double)(z >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

/* The fast kernels this CPU (and build) runs, found once (LLVMFuzzerInitialize: fuzz_init). */
static attn_kernel fuzz_kernel[8];
static int fuzz_kernel_count;
static const char *fuzz_name = "fuzz";

static inline void fuzz_init(const char *name) {
  static const attn_kernel all[] = {ATTN_KERNEL_C, ATTN_KERNEL_AVX2, ATTN_KERNEL_AVX512, ATTN_KERNEL_AVX512_BF16,
                                    ATTN_KERNEL_AMX};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    if (attn_kernel_supported(all[i])) fuzz_kernel[fuzz_kernel_count++] = all[i];
  fuzz_name = name;
}

/* The report: the harness's name, then what the input chose and did, appended as it goes (and written to
 * stderr as it goes when FUZZ_SHOW is set: a sanitizer's report cuts the harness's own short). */
static char fuzz_report[3072];
static size_t fuzz_report_len;

static inline void fuzz_report_clear(void) {
  if (fuzz_report_len && getenv("FUZZ_SHOW")) fputc('\n', stderr);
  fuzz_report_len = 0, fuzz_report[0] = '\0';
}

static inline void fuzz_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline void fuzz_log(const char *fmt, ...) {
  if (fuzz_report_len + 1 >= sizeof fuzz_report) return;
  static int show = -1;
  if (show < 0) show = getenv("FUZZ_SHOW") != NULL;
  va_list ap;
  va_start(ap, fmt);
  const int n = vsnprintf(fuzz_report + fuzz_report_len, sizeof fuzz_report - fuzz_report_len, fmt, ap);
  va_end(ap);
  if (show) fprintf(stderr, "%s", fuzz_report + fuzz_report_len);
  const size_t room = sizeof fuzz_report - fuzz_report_len - 1; /* vsnprintf stops there */
  if (n > 0) fuzz_report_len += (size_t)n < room ? (size_t)n : room;
}

/* A failed check: the message, the report and the context's last error, then abort (libFuzzer saves the input). */
static inline void fuzz_need(int cond, attn_ctx *ctx, const char *msg) {
  if (cond) return;
  fprintf(stderr, "%s: %s\n  case: %s\n  message: '%s'\n", fuzz_name, msg, fuzz_report, ctx ? attn_ctx_error(ctx) : "");
  abort();
}

/* ---- KV caches (fuzz_paged.c, fuzz_kv.c) ---- */
static inline int fuzz_is_quant(attn_kv_dtype dt) { return dt == ATTN_KV_Q8_0 || dt == ATTN_KV_Q4_0; }

/* x[0..n) (n <= 128) as the storage kind dt gives it back: rounded to a half, or through
 * attn_kv_quantize and attn_kv_dequantize (the cache's own encoder). */
static inline void fuzz_as_stored(attn_ctx *ctx, attn_kv_dtype dt, float *x, int64_t n) {
  if (dt == ATTN_KV_F16 || dt == ATTN_KV_BF16) {
    uint16_t h[128];
    attn_tensor t32 = attn_tensor_view(x, ATTN_F32, 1, &n),
                t16 = attn_tensor_view(h, dt == ATTN_KV_F16 ? ATTN_F16 : ATTN_BF16, 1, &n);
    fuzz_need(attn_tensor_copy(ctx, &t16, &t32) == ATTN_OK && attn_tensor_copy(ctx, &t32, &t16) == ATTN_OK, ctx,
              "rounding through a half");
  } else if (fuzz_is_quant(dt)) {
    uint8_t b[128 / 32 * 34];
    fuzz_need(attn_kv_quantize(ctx, dt, b, x, n) == ATTN_OK && attn_kv_dequantize(ctx, dt, x, b, n) == ATTN_OK, ctx,
              "quantizing a token");
  }
}

/* ||a - r|| / (||r|| + 0.1 sqrt(n)) over the finite entries; an infinity must match, NaN fails. The floor (a
 * tenth of the values' size) keeps a sum that cancels, or an lse near 0, from asking fp32 for more than its
 * rounding of the terms. */
static inline double fuzz_rel_l2(const float *a, const double *r, int64_t n, const char *name, attn_ctx *ctx) {
  double d = 0, s = 0;
  for (int64_t i = 0; i < n; i++) {
    if (isinf(r[i])) {
      fuzz_need(a[i] == r[i], ctx, name);
      continue;
    }
    fuzz_need(isfinite(a[i]), ctx, name);
    d += (a[i] - r[i]) * (a[i] - r[i]);
    s += r[i] * r[i];
  }
  return sqrt(d) / (sqrt(s) + 0.1 * sqrt((double)n));
}

/* One attend step over a cache (fuzz_paged.c, fuzz_kv.c): B rows of Hq = G Hk query heads and Nq
 * queries (mostly decode-sized, now and then a prefill), the options a cache takes (window, softcap,
 * scale, ALiBi, sinks, chunk), q random, out and lse NaN, twice (the second for another thread count). */
typedef struct fuzz_step {
  int64_t B, G, Hq, Nq, D, Dv;
  attn_sdpa_opts o;
  float slopes[64], sinks[64];
  attn_tensor ts, tsk, tq, to, tl, to2, tl2;
  float *q, *out, *lse;
} fuzz_step;

static inline void fuzz_step_draw(fuzz_reader *r, fuzz_step *s, int64_t B, int64_t Hk, int64_t D, int64_t Dv) {
  memset(s, 0, sizeof *s);
  s->B = B, s->D = D, s->Dv = Dv;
  s->G = 1 + fuzz_pick(r, 4), s->Hq = Hk * s->G, s->Nq = fuzz_pick(r, 3) ? 1 + fuzz_pick(r, 3) : 1 + fuzz_pick(r, 40);
  attn_sdpa_opts_init(&s->o);
  if (fuzz_pick(r, 3) == 0) s->o.window = 1 + fuzz_pick(r, 60);
  if (fuzz_pick(r, 4) == 0) s->o.softcap = 1 + (double)fuzz_pick(r, 20);
  if (fuzz_pick(r, 4) == 0) s->o.scale = 0.05 + 0.02 * (double)fuzz_pick(r, 30);
  s->ts = attn_tensor_view(s->slopes, ATTN_F32, 1, &s->Hq), s->tsk = attn_tensor_view(s->sinks, ATTN_F32, 1, &s->Hq);
  for (int64_t h = 0; h < s->Hq; h++)
    s->slopes[h] = (float)(0.3 * fuzz_uniform()), s->sinks[h] = (float)(2 * fuzz_uniform());
  if (fuzz_pick(r, 4) == 0) s->o.alibi_slopes = &s->ts;
  if (fuzz_pick(r, 4) == 0) s->o.sinks = &s->tsk;
  if (fuzz_pick(r, 4) == 0) s->o.chunk = 1 + fuzz_pick(r, 300); /* Llama 4's chunks */
  const int64_t sq[4] = {B, s->Hq, s->Nq, D}, so[4] = {B, s->Hq, s->Nq, Dv}, sl[3] = {B, s->Hq, s->Nq};
  const int64_t nq = B * s->Hq * s->Nq * D, nout = B * s->Hq * s->Nq * Dv, nlse = B * s->Hq * s->Nq;
  s->q = malloc(sizeof(float) * (size_t)nq + 1);
  s->out = malloc(sizeof(float) * (size_t)nout * 2 + 1), s->lse = malloc(sizeof(float) * (size_t)nlse * 2 + 1);
  for (int64_t i = 0; i < nq; i++) s->q[i] = (float)fuzz_uniform();
  for (int64_t i = 0; i < nout * 2; i++) s->out[i] = NAN;
  for (int64_t i = 0; i < nlse * 2; i++) s->lse[i] = NAN;
  s->tq = attn_tensor_view(s->q, ATTN_F32, 4, sq);
  s->to = attn_tensor_view(s->out, ATTN_F32, 4, so), s->to2 = attn_tensor_view(s->out + nout, ATTN_F32, 4, so);
  s->tl = attn_tensor_view(s->lse, ATTN_F32, 3, sl), s->tl2 = attn_tensor_view(s->lse + nlse, ATTN_F32, 3, sl);
}

/* The two runs (to/tl, to2/tl2) hold the same bits. */
static inline void fuzz_step_same_bits(const fuzz_step *s, attn_ctx *ctx) {
  const int64_t nout = s->B * s->Hq * s->Nq * s->Dv, nlse = s->B * s->Hq * s->Nq;
  fuzz_need(memcmp(s->out, s->out + nout, sizeof(float) * (size_t)nout) == 0 &&
                memcmp(s->lse, s->lse + nlse, sizeof(float) * (size_t)nlse) == 0,
            ctx, "out or lse differs between thread counts");
}

/* Row b of the step against the float64 oracle (bottom-right causal) over k [1, Hk, L, D] and v [1, Hk, L, Dv]
 * (the tokens as stored); q1 (NULL: row b of q) is the row's queries [1, Hq, Nq, D] as the cache takes them. */
static inline void fuzz_step_check_row(const fuzz_step *s, attn_ctx *ctx, int64_t b, const attn_tensor *q1,
                                       const attn_tensor *k, const attn_tensor *v) {
  const int64_t Hq = s->Hq, Nq = s->Nq, sq[4] = {1, Hq, Nq, s->D}, so[4] = {1, Hq, Nq, s->Dv}, sl[3] = {1, Hq, Nq};
  double *ro = malloc(sizeof(double) * (size_t)(Hq * Nq * s->Dv) + 1);
  double *rl = malloc(sizeof(double) * (size_t)(Hq * Nq) + 1);
  const attn_tensor qb = attn_tensor_view(s->q + b * Hq * Nq * s->D, ATTN_F32, 4, sq);
  attn_tensor oo = attn_tensor_view(ro, ATTN_F64, 4, so), ll = attn_tensor_view(rl, ATTN_F64, 3, sl);
  attn_sdpa_opts ob = s->o;
  ob.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
  fuzz_need(attn_sdpa_ref(ctx, &oo, &ll, NULL, q1 ? q1 : &qb, k, v, &ob) == ATTN_OK, ctx, "the oracle failed");
  const double eo = fuzz_rel_l2(s->out + b * Hq * Nq * s->Dv, ro, Hq * Nq * s->Dv, "out: an infinity or NaN", ctx);
  const double el = fuzz_rel_l2(s->lse + b * Hq * Nq, rl, Hq * Nq, "lse: an infinity or NaN", ctx);
  char msg[160];
  snprintf(msg, sizeof msg, "row %lld (%lld tokens): out %.3g, lse %.3g from the oracle (rel L2)", (long long)b,
           (long long)k->shape[2], eo, el);
  fuzz_need(eo <= 5e-5 && el <= 5e-5, ctx, msg);
  free(ro), free(rl);
}

static inline void fuzz_step_free(fuzz_step *s) { free(s->q), free(s->out), free(s->lse); }

#endif
