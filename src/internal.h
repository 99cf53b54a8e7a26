/* Internal declarations shared by the library's files. Prefix attn__. */
#ifndef ATTN_INTERNAL_H
#define ATTN_INTERNAL_H

#include "attn.h"
#include "half.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#define ATTN__MSG_LEN 512
#define ATTN__STR2(x) #x
#define ATTN__STR(x) ATTN__STR2(x) /* a macro's value as a string */

/* What a context's calls run, resolved once (attn__dispatch_fill) when the
 * context is made and whenever its kernel or decode switch changes, so that no
 * call asks the environment or looks a kernel up. */
typedef struct attn__dispatch {
  attn_kernel kernel;                             /* never AUTO */
  const struct attn__cpu_kernels *attention;      /* the blocked kernel's tiles (src/cpu/kernels.h) */
  const struct attn__decode_kernels *decode;      /* the decode kernel's blocks (src/cpu/kernels.h) */
  const struct attn__sgemm_kernel *gemm;          /* the projections' GEMM (src/cpu/gemm.h) */
  const struct attn__bgemm_kernel *gemm_bf16;     /* its bf16-product variant, or NULL (src/cpu/gemm.h) */
  const struct attn__half_kernels *half;          /* bf16 tiles of the blocked kernel, or NULL (src/cpu/kernels.h) */
  const struct attn__half_kernels *half_next;     /* the tiles for shapes `half` does not take, or NULL */
  const struct attn__half_kernels *half_f16;      /* f16 inputs' tiles (bf16 hi + lo terms), or NULL */
  const struct attn__half_kernels *half_backward; /* bf16 inputs' backward tiles (kernels.h's pt_acc), or NULL */
  int decode_enabled;                             /* 0: decode-sized problems go through the blocked kernel */
  attn_precision precision;                       /* the policy of attn.h's attn_precision */
} attn__dispatch;

#define ATTN__KERNEL_LAST ATTN_KERNEL_AMX
#define ATTN__PRECISION_LAST ATTN_PRECISION_F16

/* The table for kernel (AUTO: the fastest in supported, bit k for kernel k;
 * the portable sets serve REF, whose projections run in fp32) and the decode switch.
 * supported may also hold attn__cpu_decode_tuning's bits, which tune the decode. */
#define ATTN__CPU_READ_AHEAD_L2 (1u << 31)
#define ATTN__CPU_QK_BLOCK_ROWS_8 (1u << 30)
void attn__dispatch_fill(attn__dispatch *d, attn_kernel kernel, unsigned supported, int decode_enabled,
                         attn_precision precision);

/* What attn__schedule ran last (engine/schedule.c formats it for attn_ctx_plan). */
#define ATTN__PLAN_PHASES 8
typedef struct attn__plan {
  const char *what; /* a format of up to four long long args; NULL before any call */
  long long args[4];
  int threads, nphases;
  int64_t rounds;
  const char *name[ATTN__PLAN_PHASES];
  int64_t items[ATTN__PLAN_PHASES];
  int on_demand[ATTN__PLAN_PHASES];
} attn__plan;
void attn__plan_format(const attn__plan *plan, char *dst, size_t n);

struct attn_ctx {
  int threads;          /* 0 = OpenMP default */
  attn_kernel kernel;   /* as set (AUTO allowed) */
  attn_kernel env_kernel; /* ATTN_KERNEL when the context was made (a supported name), else AUTO */
  unsigned supported;   /* bit k: kernel k runs here; asked once, as CPUID is slow in a VM */
  int decode;           /* as set: attn_ctx_set_decode, or ATTN_DECODE=0 at create */
  attn_precision precision; /* as set: attn_ctx_set_precision, or ATTN_PRECISION at create */
  attn__dispatch dispatch; /* kernel (or env_kernel for AUTO) and decode, resolved */
  char msg[ATTN__MSG_LEN];
  attn__plan last_plan;       /* the work list of the last scheduled call, as numbers */
  char plan[2 * ATTN__MSG_LEN]; /* ... formatted by attn_ctx_plan */
  void *work;           /* workspace: see attn__workspace */
  size_t work_bytes;     /* its size; also says how it was made (attn_ctx_trim) */
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

/* Records a printf-style message on ctx (if any) and returns status: the
 * library's own calls fail through the public attn_ctx_fail (attn.h). */
#define attn__fail attn_ctx_fail

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

/* Element off of an f32, f16 or bf16 output set to x (rounded to nearest even for halves). */
static inline void attn__store_f32(void *data, attn_dtype dt, int64_t off, float x) {
  if (dt == ATTN_F32) ((float *)data)[off] = x;
  else if (dt == ATTN_BF16) ((uint16_t *)data)[off] = attn__f32_to_bf16(x);
  else ((uint16_t *)data)[off] = attn__f32_to_f16(x);
}

/* Element off of an f32, f16 or bf16 tensor, as f32: how the fp32 kernels widen halves. */
static inline float attn__load_f32(const void *data, attn_dtype dt, int64_t off) {
  if (dt == ATTN_F32) return ((const float *)data)[off];
  if (dt == ATTN_BF16) return attn__bf16_to_f32(((const uint16_t *)data)[off]);
  return attn__f16_to_f32(((const uint16_t *)data)[off]);
}

/* dst[0..n) = elements off, off + stride, ... of an f32, f16 or bf16 buffer, widened:
 * the packing loops' conversion, one loop per dtype so that each vectorises. */
static inline void attn__widen_strided(float *restrict dst, const void *src, attn_dtype dt, int64_t off, int64_t stride,
                                       int64_t n) {
  if (dt == ATTN_F32) {
    const float *s = (const float *)src + off;
    for (int64_t e = 0; e < n; e++) dst[e] = s[e * stride];
  } else if (dt == ATTN_BF16) {
    const uint16_t *s = (const uint16_t *)src + off;
    for (int64_t e = 0; e < n; e++) dst[e] = attn__bf16_to_f32(s[e * stride]);
  } else {
    const uint16_t *s = (const uint16_t *)src + off;
    for (int64_t e = 0; e < n; e++) dst[e] = attn__f16_to_f32(s[e * stride]);
  }
}

/* Elements off, off + stride, ... of an f32, f16 or bf16 output = src[0..n) * scale (rounded to nearest
 * even for halves): the write-out loops' conversion, one loop per dtype so that each vectorises. */
static inline void attn__narrow_strided(void *dst, attn_dtype dt, int64_t off, int64_t stride, const float *restrict src,
                                        int64_t n, float scale) {
  if (dt == ATTN_F32) {
    float *d = (float *)dst + off;
    if (stride == 1)
      for (int64_t e = 0; e < n; e++) d[e] = src[e] * scale;
    else
      for (int64_t e = 0; e < n; e++) d[e * stride] = src[e] * scale;
  } else if (dt == ATTN_BF16) {
    uint16_t *d = (uint16_t *)dst + off;
    for (int64_t e = 0; e < n; e++) d[e * stride] = attn__f32_to_bf16(src[e] * scale);
  } else {
    uint16_t *d = (uint16_t *)dst + off;
    for (int64_t e = 0; e < n; e++) d[e * stride] = attn__f32_to_f16(src[e] * scale);
  }
}

static inline int attn__is_float(attn_dtype dt) {
  return dt == ATTN_F32 || dt == ATTN_F64 || dt == ATTN_F16 || dt == ATTN_BF16;
}

/* "[2, 3, 4]" into buf, for messages. */
void attn__format_shape(char *buf, size_t n, const attn_tensor *t);
/* An f32 [Hq] option (ALiBi slopes, sinks, their gradient), or NULL; out: written to. */
/* A packed batch's offsets in o (cu_seqlens_q/_k, num_seqs; nothing to check
 * when cu_seqlens_q is NULL) against q's batch B and the totals Nq, Nk:
 * every entry read in order and checked before it is used (sdpa.c). */
attn_status attn__check_cu_seqlens(attn_ctx *ctx, const attn_sdpa_opts *o, int64_t B, int64_t Nq, int64_t Nk);
/* t (NULL: none) f32 [Hq]; out: 0 an input, 1 an output, 2 an output that may be f64 too (the oracle's). */
attn_status attn__check_head_vector(attn_ctx *ctx, const attn_tensor *t, const char *what, int64_t Hq, int out);
/* Checks a tensor argument: non-null data (unless empty), rank, sane shape. */
attn_status attn__check_tensor(attn_ctx *ctx, const attn_tensor *t, const char *what, int rank);
/* The bytes [lo, hi) a non-empty tensor's elements lie in (for overlap checks). */
void attn__extent(const attn_tensor *t, uintptr_t *lo, uintptr_t *hi);
/* An output must not alias itself through a zero stride (threads would write one element at once). */
attn_status attn__check_writable(attn_ctx *ctx, const attn_tensor *t, const char *what);

/* ---- SDPA problem, validated once and shared by every kernel ----------------- */
/* The problem, with its logit options: defined in logit.h, where what a logit
 * is is defined (the files that read its fields include that). */
typedef struct attn__sdpa attn__sdpa;

/* Validates arguments and fills p; lse and weights (the forward's optional
 * outputs) may be NULL. float_only: q/k/v/out must be f32. */
attn_status attn__sdpa_prepare(attn_ctx *ctx, attn__sdpa *p, attn_tensor *out, attn_tensor *lse, attn_tensor *weights,
                               const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                               const attn_sdpa_opts *opts, int f32_only);

/* Checks the backward's arguments (q/k/v/out/opts as attn__sdpa_prepare, then
 * the optional mask_grad and sinks_grad, dq, dk, dv, dout, lse) and fills p.
 * f32_only 1: every tensor must be f32; 2: q, k, v, dout and out f32, f16 or bf16,
 * dq, dk and dv f32, f16 or bf16, lse f32 (the blocked backward's own checks). */
attn_status attn__sdpa_backward_prepare(attn_ctx *ctx, attn__sdpa *p, attn_tensor *dq, attn_tensor *dk, attn_tensor *dv,
                                        attn_tensor *mask_grad, attn_tensor *sinks_grad, const attn_tensor *dout,
                                        const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                                        const attn_tensor *out, const attn_tensor *lse, const attn_sdpa_opts *opts,
                                        int f32_only);

/* Nonzero when the CPU and OS support the instruction set of kernel isa. */
int attn__cpu_has(attn_kernel isa);
/* The decode's tuning for this CPU (vendor and family): ATTN__CPU_READ_AHEAD_L2 (Intel, AMD before
 * Zen 5) and ATTN__CPU_QK_BLOCK_ROWS_8 (Zen 4: decode_l2_blocks8.c, key blocks whole for 8 rows and
 * f32 rows read ahead into L1 too), or 0 (Zen 5, and anything else). */
unsigned attn__cpu_decode_tuning(void);

/* Runs a validated forward on the framework that suits it (sdpa.c). */
attn_status attn__sdpa_dispatch(attn_ctx *ctx, const attn__sdpa *p);
/* Kernels: p is validated. */
attn_status attn__sdpa_run_ref(attn_ctx *ctx, const attn__sdpa *p);
attn_status attn__sdpa_run_blocked(attn_ctx *ctx, const attn__sdpa *p);
/* The float64 backward oracle (src/ref/sdpa_backward_ref.c); p from attn__sdpa_backward_prepare.
 * dq/dk/dv (and p->mask_grad) are overwritten, f32 or f64; the inputs any float dtype. */
attn_status attn__sdpa_backward_run_ref(attn_ctx *ctx, const attn__sdpa *p, attn_tensor *dq, attn_tensor *dk,
                                        attn_tensor *dv, const attn_tensor *dout, const attn_tensor *out,
                                        const attn_tensor *lse);
/* The blocked backward (src/engine/backward.c): fp32, or the half tiles of
 * attn__dispatch_half_backward with f32/f16/bf16 gradients; shapes already checked. */
attn_status attn__sdpa_backward_run_blocked(attn_ctx *ctx, const attn__sdpa *p, attn_tensor *dq,
                                        attn_tensor *dk, attn_tensor *dv, const attn_tensor *dout,
                                        const attn_tensor *out, const attn_tensor *lse);

/* The decode kernel (src/engine/decode.c): few query rows per kv head (Nq times
 * the GQA group at most ATTN__DEC_MAX_ROWS, or ATTN__DEC_BF16_ROWS where the
 * blocked forward would take the bf16 tiles, which pass it sooner, or
 * decode.c's ATTN__DEC_BF16_TILE_ROWS where it runs on AMX tiles itself), no
 * weights, no dropout. */
#define ATTN__DEC_MAX_ROWS 64
#define ATTN__DEC_BF16_ROWS 24
int attn__decode_fits(const attn__dispatch *d, const attn__sdpa *p);
attn_status attn__sdpa_run_decode(attn_ctx *ctx, const attn__sdpa *p);

/* C = A . B^T + bias, fp32; C is (M, N), A is (M, K), B is (N, K), bias is (N) or NULL,
 * rows lda, ldb, ldc apart. Runs ctx's GEMM kernel on ctx's threads; bitwise
 * the same for any thread count. */
void attn__sgemm_nt(const attn_ctx *ctx, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                    int64_t ldb, float *C, int64_t ldc, const float *bias);

/* C = A . B^T + bias as attn__sgemm_nt, with bf16 products summed in fp32:
 * A and B each f32 (rounded to bf16, nearest even) or bf16, rows lda, ldb
 * elements apart. Only where ctx->dispatch.gemm_bf16 is not NULL; bitwise the
 * same for any thread count. */
void attn__bgemm_nt(const attn_ctx *ctx, int64_t M, int64_t N, int64_t K, const void *A, attn_dtype at, int64_t lda,
                    const void *B, attn_dtype bt, int64_t ldb, float *C, int64_t ldc, const float *bias);

/* attn__sgemm_nt with A and B rounded to f16 (nearest even) as they are packed:
 * f16 products, exact in fp32, summed in fp32 (ATTN_PRECISION_F16). */
void attn__f16gemm_nt(const attn_ctx *ctx, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                      const float *B, int64_t ldb, float *C, int64_t ldc, const float *bias);

/* The layer's projections (f32 operands, as attn__sgemm_nt): the bf16 GEMM
 * under ATTN_PRECISION_BF16 where the context has it, the f16-rounding one
 * under ATTN_PRECISION_F16, else the fp32 one. */
void attn__project_nt(const attn_ctx *ctx, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                      const float *B, int64_t ldb, float *C, int64_t ldc, const float *bias);

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

/* Batch entry b of t as a batch of one (a view: same data, strides, dtype). */
static inline attn_tensor attn__batch_entry(const attn_tensor *t, int64_t b) {
  attn_tensor v = *t;
  v.shape[0] = 1;
  v.data = (char *)t->data + (size_t)(b * t->strides[0]) * attn_dtype_size(t->dtype);
  return v;
}

void *attn__aligned_alloc(size_t bytes);
/* attn__aligned_alloc in whole 2 MiB pages, asked to be huge pages where the
 * kernel gives them on request (Linux THP "madvise"), for memory that is
 * filled from its start and streamed through (a paged KV pool, a linear
 * cache's long heads: with 4 KiB pages the page walks miss the caches;
 * measured 8% on a decoding step over scattered blocks on Zen 5, 22% on a
 * linear f32 step in a Xeon VM, whose walks are nested). Not for memory used
 * sparsely: a touched huge page is 2 MiB resident. Freed by attn__aligned_free. */
void *attn__huge_alloc(size_t bytes);
void attn__aligned_free(void *p);

#endif
