/* Small helpers shared by the tests: a seeded RNG, error metrics, checks that count. */
#ifndef ATTN_TESTUTIL_H
#define ATTN_TESTUTIL_H
/* The projections' eight parameters (Q_WEIGHT .. O_BIAS), before QK-norm's. */
#define TU_MHA_PROJ_PARAMS (ATTN_MHA_O_BIAS + 1)

#include "attn.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int tu_failures = 0, tu_checks = 0;

#define CHECK(cond, ...)                                            \
  do {                                                              \
    tu_checks++;                                                    \
    if (!(cond)) {                                                  \
      tu_failures++;                                                \
      fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                 \
      fputc('\n', stderr);                                          \
    }                                                               \
  } while (0)

/* Checks a call's status, printing the context's message on failure. */
#define CHECK_OK(ctx, call)                                                              \
  do {                                                                                   \
    attn_status tu_st_ = (call);                                                         \
    CHECK(tu_st_ == ATTN_OK, "%s -> %s: %s", #call, attn_strerror(tu_st_), attn_ctx_error(ctx)); \
  } while (0)

/* Expects status want with a non-empty message mentioning needle. */
#define CHECK_ERR(ctx, call, want, needle)                                                              \
  do {                                                                                                  \
    attn_status st_ = (call);                                                                           \
    const char *m_ = attn_ctx_error(ctx);                                                               \
    CHECK(st_ == (want) && m_[0] && strstr(m_, needle), "%s -> %s (%s), want %s mentioning '%s'", #call, \
          attn_strerror(st_), m_, attn_strerror(want), needle);                                         \
  } while (0)

/* Owns the zeroed buffers behind one case's views; exits 2 when full or out of memory. */
#define TU_ARENA_MAX 128
typedef struct arena {
  void *p[TU_ARENA_MAX];
  int n;
} arena;

static inline void *arena_alloc(arena *a, size_t bytes) {
  if (a->n == TU_ARENA_MAX) {
    fprintf(stderr, "arena full\n");
    exit(2);
  }
  void *p = calloc(1, bytes ? bytes : 1);
  if (!p) exit(2);
  a->p[a->n++] = p;
  return p;
}

static inline void arena_free(arena *a) {
  for (int i = 0; i < a->n; i++) free(a->p[i]);
  a->n = 0;
}

/* Element offset of (a, b, c, d) in a rank-4 view. */
static inline int64_t off4(const attn_tensor *t, int64_t a, int64_t b, int64_t c, int64_t d) {
  return a * t->strides[0] + b * t->strides[1] + c * t->strides[2] + d * t->strides[3];
}

/* ctest reports a test that exits with this code as skipped (SKIP_RETURN_CODE). */
#define TU_SKIP 77

/* The kernel named by name ("c", "avx2", ...; NULL or "" = AUTO). A kernel this
 * CPU or build lacks ends the program as skipped, never as passed; an unknown
 * name is an error (exit 2). */
static inline attn_kernel tu_kernel_or_skip(const char *name) {
  if (!name || !*name) return ATTN_KERNEL_AUTO;
  for (int k = ATTN_KERNEL_REF; k <= ATTN_KERNEL_AMX; k++) {
    if (strcmp(name, attn_kernel_name((attn_kernel)k)) != 0) continue;
    if (!attn_kernel_supported((attn_kernel)k)) {
      printf("skipped: this CPU or build lacks the %s kernel\n", name);
      exit(TU_SKIP);
    }
    return (attn_kernel)k;
  }
  fprintf(stderr, "unknown kernel '%s'\n", name);
  exit(2);
}

/* Ends a test program: the exit status says whether every check passed. */
static inline int tu_finish(const char *name) {
  printf("%s: %d checks, %d failed\n", name, tu_checks, tu_failures);
  return tu_failures ? 1 : 0;
}

/* splitmix64: a fixed seed gives the same stream on every machine. */
typedef struct { uint64_t s; } tu_rng;
static inline uint64_t tu_next(tu_rng *r) {
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
/* uniform in [-1, 1) */
static inline double tu_uniform(tu_rng *r) { return (double)(tu_next(r) >> 11) * (2.0 / 9007199254740992.0) - 1.0; }
static inline int64_t tu_int(tu_rng *r, int64_t lo, int64_t hi) { return lo + (int64_t)(tu_next(r) % (uint64_t)(hi - lo + 1)); }

static inline void tu_fill_f32(tu_rng *r, float *x, int64_t n, double amp) {
  for (int64_t i = 0; i < n; i++) x[i] = (float)(amp * tu_uniform(r));
}
/* A value no kernel would compute: catches elements never written. */
static inline void tu_poison_f32(float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) x[i] = NAN;
}

/* Relative L2 error of a (strided f32/f64 tensor) against b (contiguous double). */
static inline double tu_rel_l2(const double *a, const double *b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    double d = a[i] - b[i];
    num += d * d;
    den += b[i] * b[i];
  }
  if (den == 0) return sqrt(num);
  return sqrt(num / den);
}

/* Copies any float tensor of rank <= 4 into contiguous doubles. */
static inline double *tu_to_f64(const attn_tensor *t) {
  int64_t n = attn_tensor_numel(t);
  double *o = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  int64_t sh[4] = {1, 1, 1, 1}, st[4] = {0, 0, 0, 0};
  int off = 4 - t->rank;
  for (int i = 0; i < t->rank; i++) { sh[off + i] = t->shape[i]; st[off + i] = t->strides[i]; }
  int64_t idx = 0;
  for (int64_t a = 0; a < sh[0]; a++)
    for (int64_t b = 0; b < sh[1]; b++)
      for (int64_t c = 0; c < sh[2]; c++)
        for (int64_t d = 0; d < sh[3]; d++) {
          int64_t e = a * st[0] + b * st[1] + c * st[2] + d * st[3];
          double v;
          switch (t->dtype) {
            case ATTN_F32: v = ((const float *)t->data)[e]; break;
            case ATTN_F64: v = ((const double *)t->data)[e]; break;
            default: v = ((const uint8_t *)t->data)[e]; break;
          }
          o[idx++] = v;
        }
  return o;
}

/* ---- half precision, the test's own (tests may not use the library's internals) ----
 * IEEE binary16 and bfloat16 from float by round to nearest, ties to even, as
 * the library stores halves: NaN stays NaN, too large becomes Inf, and values
 * below the smallest normal half become subnormals or zero. */
static inline uint16_t tu_f32_to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;
  const int e = (int)(a >> 23) - 127;     /* f = 1.m * 2^e (float subnormals are far below any half) */
  if (e > 15) return sign | 0x7c00u;      /* Inf, or beyond the largest half */
  if (e < -25) return sign;               /* below half the smallest subnormal */
  const uint32_t m = (a & 0x7fffffu) | 0x800000u; /* 24 bits with the leading one */
  /* keep 11 bits of a normal half; a subnormal's unit is 2^-24, so it keeps fewer */
  const int drop = e >= -14 ? 13 : 13 + (-14 - e);
  uint32_t q = m >> drop;
  const uint32_t rest = m & ((1u << drop) - 1), half = 1u << (drop - 1);
  if (rest > half || (rest == half && (q & 1))) q++;
  /* exponent field + mantissa with its leading one: a carry out of the mantissa
   * moves into the exponent (up to Inf); a subnormal is q itself */
  return sign | (uint16_t)(e >= -14 ? ((uint32_t)(e + 14) << 10) + q : q);
}

static inline float tu_f16_to_f32(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  float v;
  if (e == 0x1f) v = m ? NAN : INFINITY;
  else if (e == 0) v = ldexpf((float)m, -24);     /* subnormal: m units of 2^-24 */
  else v = ldexpf((float)(m | 0x400), e - 25);    /* 1.m * 2^(e - 15) */
  return (h & 0x8000) ? -v : v;
}

/* bfloat16 is a float's top half: round the bottom half away, to even on a tie. */
static inline uint16_t tu_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline float tu_bf16_to_f32(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* x rounded through dt (f32, f16 or bf16): what a tensor of that dtype holds. */
static inline float tu_round_through(float x, attn_dtype dt) {
  if (dt == ATTN_F16) return tu_f16_to_f32(tu_f32_to_f16(x));
  if (dt == ATTN_BF16) return tu_bf16_to_f32(tu_f32_to_bf16(x));
  return x;
}

/* Element i of an f32, f16 or bf16 buffer set to x (rounded to float first). */
static inline void tu_store_float(void *data, attn_dtype dt, int64_t i, double x) {
  if (dt == ATTN_F16) ((uint16_t *)data)[i] = tu_f32_to_f16((float)x);
  else if (dt == ATTN_BF16) ((uint16_t *)data)[i] = tu_f32_to_bf16((float)x);
  else ((float *)data)[i] = (float)x;
}

static inline int tu_count_nan(const double *x, int64_t n) {
  int c = 0;
  for (int64_t i = 0; i < n; i++) c += isnan(x[i]) != 0;
  return c;
}

#endif
