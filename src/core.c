/* Contexts, status, tensors and argument checks. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS on glibc */
#include "internal.h"
#include "cpu/kernels.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#define ATTN__HAVE_MMAP 1
#if !defined(MAP_ANONYMOUS) && defined(MAP_ANON)
#define MAP_ANONYMOUS MAP_ANON
#endif
#endif


unsigned attn_version(void) { return ATTN_VERSION_HEX; }

const char *attn_version_string(void) {
  return ATTN__STR(ATTN_VERSION_MAJOR) "." ATTN__STR(ATTN_VERSION_MINOR) "." ATTN__STR(ATTN_VERSION_PATCH);
}

const char *attn_strerror(attn_status status) {
  switch (status) {
    case ATTN_OK: return "success";
    case ATTN_E_INVALID: return "invalid argument";
    case ATTN_E_SHAPE: return "shape mismatch";
    case ATTN_E_DTYPE: return "unsupported dtype";
    case ATTN_E_NOMEM: return "out of memory";
    case ATTN_E_IO: return "i/o error";
    case ATTN_E_FORMAT: return "malformed file";
    case ATTN_E_NOT_FOUND: return "not found";
    case ATTN_E_UNSUPPORTED: return "not supported";
  }
  return "unknown status";
}

attn_status attn_ctx_fail(attn_ctx *ctx, attn_status status, const char *fmt, ...) {
  if (ctx) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->msg, sizeof ctx->msg, fmt, ap);
    va_end(ap);
  }
  return status;
}

/* Bit k: kernel k runs on this CPU and build (CPUID, slow in a VM: once per
 * context); and the decode's tuning bits. */
_Static_assert(ATTN__KERNEL_LAST < 30, "the decode's tuning bits sit above the kernel bits");
static unsigned supported_kernels(void) {
  unsigned supported = attn__cpu_decode_tuning();
  for (int k = ATTN_KERNEL_AUTO; k <= ATTN__KERNEL_LAST; k++)
    if (attn_kernel_supported((attn_kernel)k)) supported |= 1u << k;
  return supported;
}

static void refresh_dispatch(attn_ctx *c) {
  const attn_kernel wanted = c->kernel != ATTN_KERNEL_AUTO ? c->kernel : c->env_kernel;
  attn__dispatch_fill(&c->dispatch, wanted, c->supported, c->decode, c->precision);
}

attn_status attn_ctx_create(attn_ctx **out) {
  if (!out) return ATTN_E_INVALID;
  attn_ctx *c = calloc(1, sizeof *c);
  *out = c;
  if (!c) return ATTN_E_NOMEM;
  c->supported = supported_kernels();
  /* The environment is read here only: getenv is not safe beside a setenv in
   * another thread, and a context's choice should not change under it. An
   * unknown or unsupported ATTN_KERNEL leaves the automatic choice. */
  const char *env = getenv("ATTN_KERNEL");
  c->env_kernel = ATTN_KERNEL_AUTO;
  for (int k = ATTN_KERNEL_REF; env && k <= ATTN__KERNEL_LAST; k++)
    if (!strcmp(env, attn_kernel_name((attn_kernel)k)) && ((c->supported >> k) & 1)) c->env_kernel = (attn_kernel)k;
  const char *dec = getenv("ATTN_DECODE");
  c->decode = !(dec && strcmp(dec, "0") == 0);
  const char *prec = getenv("ATTN_PRECISION");
  for (int k = ATTN_PRECISION_DEFAULT; prec && k <= ATTN__PRECISION_LAST; k++)
    if (!strcmp(prec, attn_precision_name((attn_precision)k))) c->precision = (attn_precision)k;
  refresh_dispatch(c);
  return ATTN_OK;
}

/* Workspaces this large are mapped from the system rather than taken from
 * malloc: a block freed to glibc's heap stays resident, so growing through
 * malloc would keep the old workspace beside the new one at the peak. */
#define WORKSPACE_MAP_MIN ((size_t)1 << 20)

void attn_ctx_trim(attn_ctx *ctx) {
  if (!ctx || !ctx->work) return;
#ifdef ATTN__HAVE_MMAP
  if (ctx->work_bytes >= WORKSPACE_MAP_MIN) munmap(ctx->work, ctx->work_bytes);
  else
#endif
    attn__aligned_free(ctx->work);
  ctx->work = NULL;
  ctx->work_bytes = 0;
}

size_t attn_ctx_workspace_bytes(const attn_ctx *ctx) { return ctx ? ctx->work_bytes : 0; }

void *attn__workspace(attn_ctx *ctx, size_t bytes) {
  if (bytes > ATTN__SIZE_LIMIT) return NULL;
  if (bytes == 0) bytes = 64;
  if (ctx->work && ctx->work_bytes >= bytes) return ctx->work;
  attn_ctx_trim(ctx); /* before the new one: never both at once */
  bytes = (bytes + 4095) / 4096 * 4096;
  void *w;
#ifdef ATTN__HAVE_MMAP
  if (bytes >= WORKSPACE_MAP_MIN) {
    w = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (w == MAP_FAILED) w = NULL;
  } else
#endif
    w = attn__aligned_alloc(bytes);
  if (!w) return NULL;
  ctx->work = w;
  ctx->work_bytes = bytes;
  return w;
}

void attn_ctx_destroy(attn_ctx *ctx) {
  attn_ctx_trim(ctx);
  free(ctx);
}

attn_status attn_ctx_set_threads(attn_ctx *ctx, int threads) {
  ATTN__ENTER(ctx);
  if (threads < 0 || threads > 4096)
    return attn__fail(ctx, ATTN_E_INVALID, "thread count %d is out of range 0..4096", threads);
  ctx->threads = threads;
  return ATTN_OK;
}

int attn_ctx_threads(const attn_ctx *ctx) { return attn__threads(ctx); }

int attn__threads(const attn_ctx *ctx) {
  if (ctx && ctx->threads > 0) return ctx->threads;
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

attn_status attn_ctx_set_kernel(attn_ctx *ctx, attn_kernel kernel) {
  ATTN__ENTER(ctx);
  if ((int)kernel < ATTN_KERNEL_AUTO || kernel > ATTN__KERNEL_LAST)
    return attn__fail(ctx, ATTN_E_INVALID, "unknown kernel %d", (int)kernel);
  if (!((ctx->supported >> kernel) & 1))
    return attn__fail(ctx, ATTN_E_UNSUPPORTED, "kernel %s is not supported by this CPU or build", attn_kernel_name(kernel));
  ctx->kernel = kernel;
  refresh_dispatch(ctx);
  return ATTN_OK;
}

attn_status attn_ctx_set_decode(attn_ctx *ctx, int enabled) {
  ATTN__ENTER(ctx);
  ctx->decode = enabled != 0;
  refresh_dispatch(ctx);
  return ATTN_OK;
}

int attn_ctx_decode(const attn_ctx *ctx) { return ctx ? ctx->dispatch.decode_enabled : 1; }

attn_status attn_ctx_set_precision(attn_ctx *ctx, attn_precision precision) {
  ATTN__ENTER(ctx);
  if ((int)precision < ATTN_PRECISION_DEFAULT || precision > ATTN__PRECISION_LAST)
    return attn__fail(ctx, ATTN_E_INVALID, "unknown precision %d", (int)precision);
  ctx->precision = precision;
  refresh_dispatch(ctx);
  return ATTN_OK;
}

attn_precision attn_ctx_precision(const attn_ctx *ctx) { return ctx ? ctx->dispatch.precision : ATTN_PRECISION_DEFAULT; }

const char *attn_precision_name(attn_precision precision) {
  switch (precision) {
    case ATTN_PRECISION_DEFAULT: return "default";
    case ATTN_PRECISION_FP32: return "fp32";
    case ATTN_PRECISION_BF16: return "bf16";
    case ATTN_PRECISION_F16: return "f16";
  }
  return "unknown";
}

const char *attn_kernel_name(attn_kernel kernel) {
  switch (kernel) {
    case ATTN_KERNEL_AUTO: return "auto";
    case ATTN_KERNEL_REF: return "ref";
    case ATTN_KERNEL_C: return "c";
    case ATTN_KERNEL_AVX2: return "avx2";
    case ATTN_KERNEL_AVX512: return "avx512";
    case ATTN_KERNEL_AVX512_BF16: return "avx512bf16";
    case ATTN_KERNEL_AMX: return "amx";
  }
  return "unknown";
}

int attn_kernel_supported(attn_kernel kernel) {
  switch (kernel) {
    case ATTN_KERNEL_AUTO: case ATTN_KERNEL_REF: case ATTN_KERNEL_C: return 1;
    case ATTN_KERNEL_AVX2: case ATTN_KERNEL_AVX512: case ATTN_KERNEL_AVX512_BF16: case ATTN_KERNEL_AMX:
#ifdef ATTN_HAVE_X86_KERNELS
      return attn__cpu_has(kernel);
#else
      return 0;
#endif
  }
  return 0;
}

attn_kernel attn_ctx_kernel(const attn_ctx *ctx) {
  if (ctx) return ctx->dispatch.kernel;
  attn__dispatch d;
  attn__dispatch_fill(&d, ATTN_KERNEL_AUTO, supported_kernels(), 1, ATTN_PRECISION_DEFAULT);
  return d.kernel;
}

const char *attn_ctx_error(const attn_ctx *ctx) { return ctx ? ctx->msg : ""; }

const char *attn_ctx_plan(attn_ctx *ctx) {
  if (!ctx) return "";
  attn__plan_format(&ctx->last_plan, ctx->plan, sizeof ctx->plan);
  return ctx->plan;
}

/* ---- tensors ----------------------------------------------------------------- */
size_t attn_dtype_size(attn_dtype dtype) {
  switch (dtype) {
    case ATTN_F32: return 4;
    case ATTN_F64: return 8;
    case ATTN_F16: case ATTN_BF16: return 2;
    case ATTN_BOOL: case ATTN_U8: return 1;
  }
  return 0;
}

const char *attn_dtype_name(attn_dtype dtype) {
  switch (dtype) {
    case ATTN_F32: return "f32";
    case ATTN_F64: return "f64";
    case ATTN_F16: return "f16";
    case ATTN_BF16: return "bf16";
    case ATTN_BOOL: return "bool";
    case ATTN_U8: return "u8";
  }
  return "unknown";
}

attn_tensor attn_tensor_view(void *data, attn_dtype dtype, int rank, const int64_t *shape) {
  attn_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dtype;
  if (rank < 0 || rank > ATTN_MAX_RANK) rank = -1; /* caught by every checked call */
  t.rank = rank;
  /* A 0 counts as 1, as in numpy. Past INT64_MAX, which only a tensor with no
   * element (or one too large to exist) can reach, the stride is 0: never
   * used to address anything, and checked calls refuse such views anyway. */
  int64_t s = 1;
  int over = 0;
  for (int i = rank - 1; i >= 0; i--) {
    t.shape[i] = shape[i];
    t.strides[i] = over ? 0 : s;
    if (!over && attn__mul_overflows(s, shape[i] > 0 ? shape[i] : 1, &s)) over = 1;
  }
  return t;
}

attn_status attn_tensor_permute(attn_tensor *out, const attn_tensor *t, const int *perm) {
  if (!out || !t || !perm || t->rank < 0 || t->rank > ATTN_MAX_RANK) return ATTN_E_INVALID;
  attn_tensor r = *t;
  int seen[ATTN_MAX_RANK] = {0};
  for (int i = 0; i < t->rank; i++) {
    if (perm[i] < 0 || perm[i] >= t->rank || seen[perm[i]]) return ATTN_E_INVALID;
    seen[perm[i]] = 1;
    r.shape[i] = t->shape[perm[i]];
    r.strides[i] = t->strides[perm[i]];
  }
  *out = r;
  return ATTN_OK;
}

int attn__mul_overflows(int64_t a, int64_t b, int64_t *out) {
  if (a < 0 || b < 0) return 1;
  if (a != 0 && b > INT64_MAX / a) return 1;
  *out = a * b;
  return 0;
}

int attn__span_bytes(int rank, const int64_t *shape, int64_t es, int64_t *out) {
  int64_t n = es;
  for (int i = 0; i < rank; i++)
    if (shape[i] < 0 || attn__mul_overflows(n, shape[i] > 0 ? shape[i] : 1, &n)) return 1;
  *out = n;
  return 0;
}

int64_t attn_tensor_numel(const attn_tensor *t) {
  if (!t || t->rank < 0 || t->rank > ATTN_MAX_RANK) return -1;
  int64_t n = 1;
  for (int i = 0; i < t->rank; i++)
    if (attn__mul_overflows(n, t->shape[i], &n)) return -1;
  return n;
}

void *attn__aligned_alloc(size_t bytes) {
  void *p = NULL;
  if (bytes > ATTN__SIZE_LIMIT) return NULL;
  if (bytes == 0) bytes = 64;
  if (posix_memalign(&p, 64, (bytes + 63) / 64 * 64)) return NULL;
  return p;
}

#define HUGE_PAGE ((size_t)2 << 20)

void *attn__huge_alloc(size_t bytes) {
#if defined(ATTN__HAVE_MMAP) && defined(MADV_HUGEPAGE)
  if (bytes >= 2 * HUGE_PAGE && bytes <= ATTN__SIZE_LIMIT) {
    void *p = NULL;
    const size_t whole = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    if (posix_memalign(&p, HUGE_PAGE, whole)) return NULL;
    (void)madvise(p, whole, MADV_HUGEPAGE); /* a hint: without huge pages the memory is the same */
    return p;
  }
#endif
  return attn__aligned_alloc(bytes);
}

void attn__aligned_free(void *p) { free(p); }

attn_status attn_tensor_alloc(attn_ctx *ctx, attn_tensor *out, attn_dtype dtype, int rank, const int64_t *shape) {
  ATTN__ENTER(ctx);
  if (!out || (rank > 0 && !shape)) return attn__fail(ctx, ATTN_E_INVALID, "attn_tensor_alloc: null argument");
  if (rank < 0 || rank > ATTN_MAX_RANK)
    return attn__fail(ctx, ATTN_E_INVALID, "attn_tensor_alloc: rank %d is out of range 0..%d", rank, ATTN_MAX_RANK);
  size_t es = attn_dtype_size(dtype);
  if (!es) return attn__fail(ctx, ATTN_E_DTYPE, "attn_tensor_alloc: unknown dtype %d", (int)dtype);
  int64_t n = 1, span;
  for (int i = 0; i < rank; i++)
    if (shape[i] < 0 || attn__mul_overflows(n, shape[i], &n))
      return attn__fail(ctx, ATTN_E_SHAPE, "attn_tensor_alloc: bad or too large shape");
  if (attn__span_bytes(rank, shape, (int64_t)es, &span))
    return attn__fail(ctx, ATTN_E_SHAPE, "attn_tensor_alloc: shape too large for its strides to fit in int64");
  if (attn__mul_overflows(n, (int64_t)es, &n) || (uint64_t)n > SIZE_MAX / 2)
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_tensor_alloc: tensor too large");
  void *d = attn__aligned_alloc((size_t)n);
  if (!d) return attn__fail(ctx, ATTN_E_NOMEM, "attn_tensor_alloc: cannot allocate %lld bytes", (long long)n);
  memset(d, 0, (size_t)n);
  *out = attn_tensor_view(d, dtype, rank, shape);
  return ATTN_OK;
}

void attn_tensor_free(attn_tensor *t) {
  if (!t) return;
  attn__aligned_free(t->data);
  t->data = NULL;
}

/* ---- attn_tensor_copy ------------------------------------------------------------ */
/* x narrowed to f32 with round-to-odd (an inexact result keeps its last bit
 * set): then rounding that to f16 or bf16 is the correct rounding of x, where
 * a plain (float)x would round twice. */
static float copy__narrow_odd(double x) {
  float f = (float)x;
  if ((double)f == x || isnan(x) || isinf(f)) return f;
  uint32_t u;
  memcpy(&u, &f, 4);
  if (!(u & 1)) u = fabs(x) > fabs((double)f) ? u + 1 : u - 1; /* the odd neighbour, toward x */
  memcpy(&f, &u, 4);
  return f;
}

static double copy__load(const char *p, attn_dtype dt) {
  switch (dt) {
    case ATTN_F32: { float f; memcpy(&f, p, 4); return f; }
    case ATTN_F64: { double d; memcpy(&d, p, 8); return d; }
    case ATTN_F16: case ATTN_BF16: {
      uint16_t h;
      memcpy(&h, p, 2);
      return dt == ATTN_F16 ? attn__f16_to_f32(h) : attn__bf16_to_f32(h);
    }
    case ATTN_BOOL: return *(const uint8_t *)p != 0;
    case ATTN_U8: return *(const uint8_t *)p;
  }
  return NAN;
}

static void copy__store(char *p, attn_dtype dt, double x) {
  switch (dt) {
    case ATTN_F32: { const float f = (float)x; memcpy(p, &f, 4); break; }
    case ATTN_F64: memcpy(p, &x, 8); break;
    case ATTN_F16: case ATTN_BF16: {
      const float f = copy__narrow_odd(x);
      const uint16_t h = dt == ATTN_F16 ? attn__f32_to_f16(f) : attn__f32_to_bf16(f);
      memcpy(p, &h, 2);
      break;
    }
    case ATTN_BOOL: *(uint8_t *)p = x != 0; break;
    case ATTN_U8: *(uint8_t *)p = (uint8_t)rint(x); break; /* in range: checked before any store */
  }
}

/* The byte range [lo, hi) that t's elements occupy (t checked, not empty). */
void attn__extent(const attn_tensor *t, uintptr_t *lo, uintptr_t *hi) {
  int64_t neg = 0, pos = 0;
  for (int i = 0; i < t->rank; i++) {
    const int64_t reach = (t->shape[i] - 1) * t->strides[i];
    if (reach < 0) neg += reach;
    else pos += reach;
  }
  const int64_t es = (int64_t)attn_dtype_size(t->dtype);
  *lo = (uintptr_t)t->data + (uintptr_t)(intptr_t)(neg * es);
  *hi = (uintptr_t)t->data + (uintptr_t)((pos + 1) * es);
}

/* Calls visit(src element, dst element) for every index, last dimension fastest. */
static int copy__walk(const attn_tensor *dst, const attn_tensor *src, int (*visit)(char *, const char *, attn_dtype, attn_dtype)) {
  const int rank = src->rank;
  const int64_t ds = (int64_t)attn_dtype_size(dst->dtype), ss = (int64_t)attn_dtype_size(src->dtype);
  int64_t idx[ATTN_MAX_RANK] = {0};
  char *d = dst->data;
  const char *s = src->data;
  for (;;) {
    if (visit(d, s, dst->dtype, src->dtype)) return 1;
    int i = rank - 1;
    for (; i >= 0; i--) {
      if (++idx[i] < src->shape[i]) {
        d += dst->strides[i] * ds;
        s += src->strides[i] * ss;
        break;
      }
      d -= (src->shape[i] - 1) * dst->strides[i] * ds;
      s -= (src->shape[i] - 1) * src->strides[i] * ss;
      idx[i] = 0;
    }
    if (i < 0) return 0;
  }
}

/* One row of n elements with unit strides: the same dtype as memcpy (the bits as they are, NaN payloads
 * too); f32 to f16/bf16 and back through the kernel set's vector conversions, whose roundings are
 * copy__element's bit for bit (test_api compares the two on every f16/bf16 and on 2^22 f32 bit patterns)
 * and which run about ten times faster than an element at a time through double. */
static void copy__row(const attn__decode_kernels *dec, void *d, attn_dtype dt, const void *s, attn_dtype st,
                      int64_t n) {
  if (dt == st) {
    memcpy(d, s, (size_t)n * attn_dtype_size(dt));
  } else if (st == ATTN_F32) {
    dec->narrow(d, dt, s, n, 1.0f); /* x * 1 quiets a signalling NaN, as the element path's double does */
  } else {
    dec->widen(d, s, st, n);
    uint32_t *u = d; /* a signalling NaN quieted, as copy__element's double does (F16C's vcvtph2ps does too) */
#pragma omp simd
    for (int64_t i = 0; i < n; i++) u[i] |= (u[i] & 0x7fffffffu) > 0x7f800000u ? 0x00400000u : 0u;
  }
}

/* Whether copy__row takes rows of this pair of dtypes. */
static int copy__by_rows(attn_dtype dt, attn_dtype st) {
  const int half_d = dt == ATTN_F16 || dt == ATTN_BF16, half_s = st == ATTN_F16 || st == ATTN_BF16;
  return dt == st || (st == ATTN_F32 && half_d) || (dt == ATTN_F32 && half_s);
}

/* Unit innermost strides on both sides: copy__row a row. */
static void copy__rows(const attn__decode_kernels *dec, const attn_tensor *dst, const attn_tensor *src) {
  const int outer = src->rank - 1;
  const int64_t ds = (int64_t)attn_dtype_size(dst->dtype), ss = (int64_t)attn_dtype_size(src->dtype);
  int64_t idx[ATTN_MAX_RANK] = {0};
  for (;;) {
    int64_t d = 0, s = 0;
    for (int i = 0; i < outer; i++) d += idx[i] * dst->strides[i], s += idx[i] * src->strides[i];
    copy__row(dec, (char *)dst->data + d * ds, dst->dtype, (const char *)src->data + s * ss, src->dtype,
              src->shape[outer]);
    int i = outer - 1;
    for (; i >= 0 && ++idx[i] == src->shape[i]; i--) idx[i] = 0;
    if (i < 0) return;
  }
}

static int copy__out_of_u8(char *d, const char *s, attn_dtype dt, attn_dtype st) {
  (void)d, (void)dt;
  const double x = rint(copy__load(s, st));
  return !(x >= 0 && x <= 255);
}

static int copy__element(char *d, const char *s, attn_dtype dt, attn_dtype st) {
  copy__store(d, dt, copy__load(s, st));
  return 0;
}

attn_status attn_tensor_copy(attn_ctx *ctx, attn_tensor *dst, const attn_tensor *src) {
  ATTN__ENTER(ctx);
  attn_status st;
  if ((st = attn__check_tensor(ctx, src, "attn_tensor_copy: src", -1)) ||
      (st = attn__check_tensor(ctx, dst, "attn_tensor_copy: dst", -1)) ||
      (st = attn__check_writable(ctx, dst, "attn_tensor_copy: dst")))
    return st;
  int same = dst->rank == src->rank;
  for (int i = 0; same && i < src->rank; i++) same = dst->shape[i] == src->shape[i];
  if (!same) return attn__fail(ctx, ATTN_E_SHAPE, "attn_tensor_copy: dst and src have different shapes");
  if (attn_tensor_numel(src) == 0) return ATTN_OK;
  uintptr_t slo, shi, dlo, dhi;
  attn__extent(src, &slo, &shi);
  attn__extent(dst, &dlo, &dhi);
  if (slo < dhi && dlo < shi) return attn__fail(ctx, ATTN_E_INVALID, "attn_tensor_copy: dst overlaps src");
  if (dst->dtype == ATTN_U8 && attn__is_float(src->dtype) && copy__walk(dst, src, copy__out_of_u8))
    return attn__fail(ctx, ATTN_E_INVALID, "attn_tensor_copy: a value of src rounds outside u8's 0..255 (or is NaN)");
  if (copy__by_rows(dst->dtype, src->dtype) && src->rank > 0 && src->strides[src->rank - 1] == 1 &&
      dst->strides[dst->rank - 1] == 1)
    copy__rows(ctx->dispatch.decode, dst, src);
  else
    copy__walk(dst, src, copy__element);
  return ATTN_OK;
}
/* ---- end of attn_tensor_copy ---------------------------------------------------- */

attn_status attn__check_writable(attn_ctx *ctx, const attn_tensor *t, const char *what) {
  if (attn_tensor_numel(t) == 0) return ATTN_OK;
  for (int i = 0; i < t->rank; i++)
    if (t->shape[i] > 1 && t->strides[i] == 0)
      return attn__fail(ctx, ATTN_E_INVALID, "%s has stride 0 in dimension %d: outputs cannot broadcast", what, i);
  return ATTN_OK;
}

attn_status attn__check_tensor(attn_ctx *ctx, const attn_tensor *t, const char *what, int rank) {
  if (!t) return attn__fail(ctx, ATTN_E_INVALID, "%s is NULL", what);
  if (rank >= 0 && t->rank != rank)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s must have rank %d, got %d", what, rank, t->rank);
  if (t->rank < 0 || t->rank > ATTN_MAX_RANK)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s has rank %d, out of range 0..%d", what, t->rank, ATTN_MAX_RANK);
  if (!attn_dtype_size(t->dtype)) return attn__fail(ctx, ATTN_E_DTYPE, "%s has unknown dtype %d", what, (int)t->dtype);
  int64_t n = 1;
  for (int i = 0; i < t->rank; i++) {
    if (t->shape[i] < 0 || attn__mul_overflows(n, t->shape[i], &n))
      return attn__fail(ctx, ATTN_E_SHAPE, "%s has a negative or too large shape", what);
  }
  /* Kernels form offsets as index * stride in int64 and then in bytes: the
   * farthest element must be reachable without overflow. Counted for empty
   * views too, since code may multiply a dimension by its stride regardless. */
  int64_t reach = 0, step;
  for (int i = 0; i < t->rank; i++) {
    if (t->shape[i] <= 1) continue;
    if (t->strides[i] == INT64_MIN ||
        attn__mul_overflows(t->shape[i] - 1, t->strides[i] < 0 ? -t->strides[i] : t->strides[i], &step) ||
        step > INT64_MAX - reach) {
      reach = -1;
      break;
    }
    reach += step;
  }
  if (reach < 0 || reach == INT64_MAX || attn__mul_overflows(reach + 1, (int64_t)attn_dtype_size(t->dtype), &step))
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: its shape and strides reach past 2^63 bytes (the extent overflows int64)",
                      what);
  if (n > 0 && !t->data) return attn__fail(ctx, ATTN_E_INVALID, "%s has NULL data", what);
  return ATTN_OK;
}

/* ---- half precision ------------------------------------------------------------ */
uint16_t attn__f32_to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00 | (uint16_t)((a >> 13) & 0x3ff); /* nan stays nan */
  if (a >= 0x477ff000u) return sign | 0x7c00;                                /* rounds to inf */
  if (a < 0x38800000u) {                                                     /* subnormal or zero */
    if (a < 0x33000000u) return sign;                                        /* below half the tiniest */
    uint32_t man = (a & 0x7fffff) | 0x800000;
    int shift = 126 - (int)(a >> 23);                                        /* 14..24 */
    uint32_t q = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) q++;
    return sign | (uint16_t)q;
  }
  uint32_t q = ((a >> 13) - (112u << 10)), rem = a & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (q & 1))) q++;
  return sign | (uint16_t)q;
}

