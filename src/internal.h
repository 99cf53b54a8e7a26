/* Internal declarations shared by the library's files. Prefix attn__. */
#ifndef ATTN_INTERNAL_H
#define ATTN_INTERNAL_H

#include "attn.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#define ATTN__MSG_LEN 512

struct attn_ctx {
  int threads;          /* 0 = OpenMP default */
  attn_kernel kernel;   /* as set; AUTO resolved at call time */
  unsigned supported;   /* bit k: kernel k runs here; asked once, as CPUID is slow in a VM */
  char msg[ATTN__MSG_LEN];
  void *work;           /* workspace: see attn__workspace */
  size_t work_bytes;     /* its size; also says how it was made (attn_ctx_trim) */
  int no_decode;        /* ATTN_DECODE=0: never the decode kernel */
};

/* ctx's workspace of at least bytes (64-byte aligned), or NULL when out of
 * memory. Its contents are undefined; it stays valid until the next call that
 * asks for a workspace, so a call takes it once and carves its buffers out of
 * it (attn__carve). */
void *attn__workspace(attn_ctx *ctx, size_t bytes);
/* What attn__carve needs for a block of bytes (add these up for attn__workspace). */
static inline size_t attn__carve_size(size_t bytes) { return (bytes + 63) / 64 * 64; }
/* The next 64-byte aligned block of bytes at *cursor; advances the cursor. */
static inline void *attn__carve(char **cursor, size_t bytes) {
  void *p = *cursor;
  *cursor += attn__carve_size(bytes);
  return p;
}

/* Records a printf-style message on ctx (if any) and returns status. */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
attn_status attn__fail(attn_ctx *ctx, attn_status status, const char *fmt, ...);

/* The first statement of every public call that takes a context: a NULL
 * context is refused (there is nowhere to put a message), else the last
 * message is cleared. */
#define ATTN__ENTER(ctx)                  \
  do {                                    \
    if (!(ctx)) return ATTN_E_INVALID;    \
    (ctx)->msg[0] = '\0';                 \
  } while (0)

/* The thread count to hand OpenMP: at least 1. */
int attn__threads(const attn_ctx *ctx);

/* ---- half-precision conversion (round to nearest even) --------------------- */
float attn__f16_to_f32(uint16_t h);
uint16_t attn__f32_to_f16(float f);
static inline float attn__bf16_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
uint16_t attn__f32_to_bf16(float f);

/* Element (at element offset off) of a float or bool tensor, as double. */
static inline double attn__load(const void *data, attn_dtype dt, int64_t off) {
  switch (dt) {
    case ATTN_F32: return ((const float *)data)[off];
    case ATTN_F64: return ((const double *)data)[off];
    case ATTN_F16: return attn__f16_to_f32(((const uint16_t *)data)[off]);
    case ATTN_BF16: return attn__bf16_to_f32(((const uint16_t *)data)[off]);
    case ATTN_BOOL: return ((const uint8_t *)data)[off] != 0;
    case ATTN_U8: return ((const uint8_t *)data)[off];
  }
  return NAN;
}

static inline void attn__store(void *data, attn_dtype dt, int64_t off, double x) {
  switch (dt) {
    case ATTN_F32: ((float *)data)[off] = (float)x; break;
    case ATTN_F64: ((double *)data)[off] = x; break;
    case ATTN_F16: ((uint16_t *)data)[off] = attn__f32_to_f16((float)x); break;
    case ATTN_BF16: ((uint16_t *)data)[off] = attn__f32_to_bf16((float)x); break;
    case ATTN_BOOL: ((uint8_t *)data)[off] = x != 0; break;
    case ATTN_U8: ((uint8_t *)data)[off] = (uint8_t)x; break;
  }
}

/* Element off of an f32, f16 or bf16 tensor, as f32: how the fp32 kernels widen halves. */
static inline float attn__load_f32(const void *data, attn_dtype dt, int64_t off) {
  if (dt == ATTN_F32) return ((const float *)data)[off];
  if (dt == ATTN_BF16) return attn__bf16_to_f32(((const uint16_t *)data)[off]);
  return attn__f16_to_f32(((const uint16_t *)data)[off]);
}

static inline int attn__is_float(attn_dtype dt) {
  return dt == ATTN_F32 || dt == ATTN_F64 || dt == ATTN_F16 || dt == ATTN_BF16;
}

/* Checks a tensor argument: non-null data (unless empty), rank, sane shape. */
attn_status attn__check_tensor(attn_ctx *ctx, const attn_tensor *t, const char *what, int rank);
/* An output must not alias itself through a zero stride (threads would write one element at once). */
attn_status attn__check_writable(attn_ctx *ctx, const attn_tensor *t, const char *what);

/* ---- SDPA problem, validated once and shared by every kernel ----------------- */
/* Each view is rank 4 with explicit strides (masks broadcast with stride 0). */
typedef struct attn__sdpa {
  int64_t B, Hq, Hk, Nq, Nk, D, Dv, group;
  double scale;
  attn_causal causal;
  attn_tensor q, k, v, out;
  int has_mask;
  attn_tensor mask; /* [B, Hq, Nq, Nk] view */
  attn_mask_mode mask_mode;
  int has_kpm;
  attn_tensor kpm;  /* [B, 1, 1, Nk] view: stride[3] on keys, stride[0] on batch */
  attn_tensor *weights; /* [B, Hq, Nq, Nk] or NULL */
  attn_tensor *lse;     /* [B, Hq, Nq] or NULL */
  double dropout_p;     /* in [0, 1); 0 = no dropout (see dropout.h for the mask) */
  uint64_t dropout_seed;
  attn_tensor *mask_grad; /* backward only: [B, Hq, Nq, Nk] dS of an additive mask, or NULL */
  int64_t window;         /* > 0: keys i' - window < j <= i' (causal is then never NONE) */
  double softcap;         /* > 0: s = softcap * tanh(s / softcap) */
  const attn_tensor *alibi; /* f32 [Hq] slopes or NULL */
  const attn_tensor *sinks; /* f32 [Hq] or NULL */
  attn_tensor *sinks_grad;  /* backward only: f32 [Hq] or NULL */
} attn__sdpa;

/* Validates arguments and fills p; lse and weights (the forward's optional
 * outputs) may be NULL. float_only: q/k/v/out must be f32. */
attn_status attn__sdpa_prepare(attn_ctx *ctx, attn__sdpa *p, attn_tensor *out, attn_tensor *lse, attn_tensor *weights,
                               const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                               const attn_sdpa_opts *opts, int f32_only);

/* Checks the backward's arguments (q/k/v/out/opts as attn__sdpa_prepare, then
 * the optional mask_grad and sinks_grad, dq, dk, dv, dout, lse) and fills p.
 * f32_only: every tensor must be f32. */
attn_status attn__sdpa_backward_prepare(attn_ctx *ctx, attn__sdpa *p, attn_tensor *dq, attn_tensor *dk, attn_tensor *dv,
                                        attn_tensor *mask_grad, attn_tensor *sinks_grad, const attn_tensor *dout,
                                        const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                                        const attn_tensor *out, const attn_tensor *lse, const attn_sdpa_opts *opts,
                                        int f32_only);

/* Nonzero when the CPU and OS support the instruction set of kernel isa. */
int attn__cpu_has(attn_kernel isa);

/* Kernels: p is validated. */
attn_status attn__sdpa_run_ref(attn_ctx *ctx, const attn__sdpa *p);
attn_status attn__sdpa_run_cpu(attn_ctx *ctx, const attn__sdpa *p, attn_kernel isa);
/* The float64 backward oracle (src/ref/sdpa_backward_ref.c); p from attn__sdpa_backward_prepare.
 * dq/dk/dv (and p->mask_grad) are overwritten, f32 or f64; the inputs any float dtype. */
attn_status attn__sdpa_backward_run_ref(attn_ctx *ctx, const attn__sdpa *p, attn_tensor *dq, attn_tensor *dk,
                                        attn_tensor *dv, const attn_tensor *dout, const attn_tensor *out,
                                        const attn_tensor *lse);
/* The fp32 backward (src/cpu/flash_backward.c); shapes already checked. */
attn_status attn__sdpa_backward_run_cpu(attn_ctx *ctx, const attn__sdpa *p, attn_kernel isa, attn_tensor *dq,
                                        attn_tensor *dk, attn_tensor *dv, const attn_tensor *dout,
                                        const attn_tensor *out, const attn_tensor *lse);

/* The decode kernel (src/cpu/decode.c): few query rows per kv head (Nq times
 * the GQA group at most ATTN__DEC_MAX_ROWS), no weights, no dropout. */
#define ATTN__DEC_MAX_ROWS 8
int attn__decode_fits(const attn__sdpa *p);
attn_status attn__sdpa_run_decode(attn_ctx *ctx, const attn__sdpa *p, attn_kernel isa);

/* Last key index query row i may see under causal (exclusive bound), or Nk. */
static inline int64_t attn__causal_end(attn_causal c, int64_t i, int64_t Nq, int64_t Nk) {
  int64_t e;
  if (c == ATTN_CAUSAL_TOP_LEFT) e = i + 1;
  else if (c == ATTN_CAUSAL_BOTTOM_RIGHT) e = i + 1 + Nk - Nq;
  else return Nk;
  return e < 0 ? 0 : (e > Nk ? Nk : e);
}

/* Query row i's position among the keys (the causal alignment in use). */
static inline int64_t attn__qpos(const attn__sdpa *p, int64_t i) {
  return p->causal == ATTN_CAUSAL_BOTTOM_RIGHT ? i + p->Nk - p->Nq : i;
}

/* First key index query row i may see under the sliding window, or 0. */
static inline int64_t attn__window_begin(const attn__sdpa *p, int64_t i) {
  if (p->window <= 0) return 0;
  const int64_t s = attn__qpos(p, i) - p->window + 1;
  return s < 0 ? 0 : s;
}

/* Element h of an f32 [Hq] option tensor (slopes, sinks). */
static inline float attn__head_value(const attn_tensor *t, int64_t h) {
  return ((const float *)t->data)[h * t->strides[0]];
}

/* ---- the logit and the hidden set: one definition for every kernel ---------------
 * The logit of query row i of head h (batch b) for key j is
 *   scale * q.k  ->  softcap  ->  + ALiBi  ->  + the mask's term
 * unless the key is hidden from that row. A key is hidden when
 *   - j lies outside [attn__window_begin(i), attn__causal_end(i)) (causal bound, window),
 *   - key_padding[b, j] is true,
 *   - a KEEP mask is false there, a MASKED mask true, or an ADDITIVE (or SEED) mask adds -inf.
 * A hidden key's logit is -inf by substitution, never by adding -inf to a
 * computed one, and its value row is never multiplied by its zero probability:
 * whatever its K and V hold (NaN, Inf: uninitialised padding, the unused tail
 * of a buffer), it reaches no output, weight, lse or gradient. */

/* Nonzero when key j lies within row i's causal bound and window. */
static inline int attn__in_band(const attn__sdpa *p, int64_t i, int64_t j) {
  return j >= attn__window_begin(p, i) && j < attn__causal_end(p->causal, i, p->Nq, p->Nk);
}

/* What the key padding and the mask say of (b, h, i, j): -inf when they hide
 * the key, else the term they add to its logit (0 for bool masks). In double. */
static inline double attn__mask_term(const attn__sdpa *p, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (p->has_kpm) {
    const attn_tensor *m = &p->kpm;
    if (attn__load(m->data, m->dtype, b * m->strides[0] + j * m->strides[3]) != 0) return -INFINITY;
  }
  if (!p->has_mask) return 0;
  const attn_tensor *m = &p->mask;
  const double mv = attn__load(m->data, m->dtype,
                               b * m->strides[0] + h * m->strides[1] + i * m->strides[2] + j * m->strides[3]);
  switch (p->mask_mode) {
    case ATTN_MASK_KEEP: return mv == 0 ? -INFINITY : 0;
    case ATTN_MASK_MASKED: return mv != 0 ? -INFINITY : 0;
    case ATTN_MASK_ADDITIVE: return mv;
    case ATTN_MASK_SEED: return mv * -1e9;
  }
  return 0;
}

/* attn__mask_term for keys j0..j0+n of row (b, h, i), as floats into dst: the
 * same definition read a row at a time, with the common dtypes read directly
 * (the blocked kernels' form; test_hidden holds it to the oracle's). */
static inline void attn__mask_row(const attn__sdpa *p, int64_t b, int64_t h, int64_t i, int64_t j0, int n, float *dst) {
  for (int jj = 0; jj < n; jj++) dst[jj] = 0.0f;
  if (p->has_kpm) { /* bool or u8, checked by attn__sdpa_prepare */
    const attn_tensor *m = &p->kpm;
    const uint8_t *d = (const uint8_t *)m->data + b * m->strides[0] + j0 * m->strides[3];
    const int64_t s = m->strides[3];
    for (int jj = 0; jj < n; jj++) dst[jj] = d[jj * s] ? -INFINITY : 0.0f;
  }
  if (!p->has_mask) return;
  const attn_tensor *m = &p->mask;
  const int64_t off = b * m->strides[0] + h * m->strides[1] + i * m->strides[2] + j0 * m->strides[3], s = m->strides[3];
  if (p->mask_mode == ATTN_MASK_KEEP || p->mask_mode == ATTN_MASK_MASKED) { /* bool or u8 */
    const uint8_t *d = (const uint8_t *)m->data + off;
    const int keep = p->mask_mode == ATTN_MASK_KEEP;
    for (int jj = 0; jj < n; jj++)
      if ((d[jj * s] != 0) != keep) dst[jj] = -INFINITY;
  } else if (p->mask_mode == ATTN_MASK_ADDITIVE && m->dtype == ATTN_F32) {
    const float *d = (const float *)m->data + off;
    for (int jj = 0; jj < n; jj++)
      if (dst[jj] != -INFINITY) dst[jj] = d[jj * s];
  } else {
    for (int jj = 0; jj < n; jj++)
      if (dst[jj] != -INFINITY) dst[jj] = (float)attn__mask_term(p, b, h, i, j0 + jj);
  }
}

/* Softcap then ALiBi on a scaled logit x of (h, i, j): every kernel's and the
 * oracle's logit passes through this before the mask's term (in x's precision). */
static inline double attn__logit_mods(const attn__sdpa *p, int64_t h, int64_t i, int64_t j, double x) {
  if (p->softcap > 0) x = p->softcap * tanh(x / p->softcap);
  if (p->alibi) x += (double)attn__head_value(p->alibi, h) * (double)(j - attn__qpos(p, i));
  return x;
}

/* C = A . B^T + bias, fp32; C is (M, N), A is (M, K), B is (N, K), bias is (N) or NULL.
 * isa: ATTN_KERNEL_C, _AVX2 or _AVX512 (already checked as supported). */
void attn__sgemm_nt(int threads, attn_kernel isa, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                    int64_t ldb, float *C, int64_t ldc, const float *bias);

/* The oracle's logit for (b, h, i, j) in double, by the definition above:
 * -inf for a hidden key, whose q.k is never computed. Shared by the forward
 * and the backward oracles so that both see exactly the same scores. */
static inline double attn__ref_logit(const attn__sdpa *p, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (!attn__in_band(p, i, j)) return -INFINITY;
  const double term = attn__mask_term(p, b, h, i, j);
  if (term == -INFINITY) return -INFINITY;
  const attn_tensor *q = &p->q, *k = &p->k;
  const int64_t qoff = b * q->strides[0] + h * q->strides[1] + i * q->strides[2];
  const int64_t koff = b * k->strides[0] + (h / p->group) * k->strides[1] + j * k->strides[2];
  double dot = 0;
  for (int64_t d = 0; d < p->D; d++)
    dot += attn__load(q->data, q->dtype, qoff + d * q->strides[3]) * attn__load(k->data, k->dtype, koff + d * k->strides[3]);
  return attn__logit_mods(p, h, i, j, dot * p->scale) + term;
}

/* Size helpers that refuse overflow: 0 on success. */
int attn__mul_overflows(int64_t a, int64_t b, int64_t *out);
/* es times the product of shape's dimensions, each 0 counted as 1: the bytes
 * a C-contiguous tensor's strides must span, so that even an empty tensor has
 * representable strides. 1 when a dimension is negative or it passes INT64_MAX. */
int attn__span_bytes(int rank, const int64_t *shape, int64_t es, int64_t *out);

/* No allocation is asked for more bytes than this; attn__aligned_alloc and
 * attn__workspace refuse it, so a size that saturates here is out of memory. */
#define ATTN__SIZE_LIMIT ((size_t)1 << 60)

/* a * b * c elements of es bytes (all >= 0), saturating just past
 * ATTN__SIZE_LIMIT: a few such sizes may be added without wrapping, and the
 * allocation they ask for then fails cleanly. Sizes from shapes go through
 * this, since shapes of broadcast (stride 0) views need no memory behind them. */
static inline size_t attn__bytes(int64_t a, int64_t b, int64_t c, size_t es) {
  const size_t over = ATTN__SIZE_LIMIT + 1, f[4] = {(size_t)a, (size_t)b, (size_t)c, es};
  if (a < 0 || b < 0 || c < 0) return over;
  size_t n = 1;
  for (int i = 0; i < 4; i++) {
    if (f[i] == 0) return 0;
    if (n > ATTN__SIZE_LIMIT / f[i]) return over;
    n *= f[i];
  }
  return n;
}

/* attn__bytes as a checked size: 1 (and *bytes past the limit) when no allocation can hold it. */
static inline int attn__alloc_size(int64_t a, int64_t b, int64_t c, size_t es, size_t *bytes) {
  *bytes = attn__bytes(a, b, c, es);
  return *bytes > ATTN__SIZE_LIMIT;
}

void *attn__aligned_alloc(size_t bytes);
void attn__aligned_free(void *p);

#endif
