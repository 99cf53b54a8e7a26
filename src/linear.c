/* attn_linear: the layer's projections as a call of their own (PyTorch Linear). */
#include "internal.h"

/* The row stride at which the GEMM reads (or writes) the rank-2 view t in
 * place: rows of unit stride, each at least a row past the last. -1: t must
 * go through a contiguous copy (a transposed, broadcast, reversed or
 * overlapping view; CBLAS takes none of those either). */
static int64_t in_place_ld(const attn_tensor *t) {
  const int64_t rows = t->shape[0], cols = t->shape[1];
  if (cols > 1 && t->strides[1] != 1) return -1;
  if (rows <= 1) return cols;
  return t->strides[0] >= cols && t->strides[0] > 0 ? t->strides[0] : -1;
}

/* dst = t's elements in row order, contiguous, as dt: f32 widens any float
 * dtype attn_linear takes; bf16 copies bf16 and rounds f32 (nearest even). */
static void gather(void *dst, attn_dtype dt, const attn_tensor *t) {
  const int64_t rows = t->shape[0], cols = t->shape[1];
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < cols; j++) {
      const int64_t off = i * t->strides[0] + j * t->strides[1];
      if (dt == ATTN_F32)
        ((float *)dst)[i * cols + j] = attn__load_f32(t->data, t->dtype, off);
      else
        ((uint16_t *)dst)[i * cols + j] = t->dtype == ATTN_BF16 ? ((const uint16_t *)t->data)[off]
                                                                : attn__f32_to_bf16(((const float *)t->data)[off]);
    }
}

/* x and weight: f32, f16 or bf16; out: f32; bias: any float dtype. */
static attn_status check_dtype(attn_ctx *ctx, const attn_tensor *t, const char *what, int rank, int halves,
                               int any_float) {
  attn_status st = attn__check_tensor(ctx, t, what, rank);
  if (st) return st;
  const attn_dtype dt = t->dtype;
  const int ok = dt == ATTN_F32 || (halves && (dt == ATTN_F16 || dt == ATTN_BF16)) || (any_float && attn__is_float(dt));
  if (!ok)
    return attn__fail(ctx, ATTN_E_DTYPE, "%s is %s; attn_linear takes %s", what, attn_dtype_name(dt),
                      any_float ? "any float dtype" : halves ? "f32, f16 or bf16" : "f32 only");
  return ATTN_OK;
}

/* attn.h's rule for attn_linear's products: 1 for bf16 products (the
 * context's bf16 GEMM), 0 for the fp32 GEMM on widened operands. */
static int bf16_products(const attn_ctx *ctx, attn_dtype xt, attn_dtype wt) {
  const attn__dispatch *d = &ctx->dispatch;
  if (!d->gemm_bf16 || d->precision == ATTN_PRECISION_FP32 || xt == ATTN_F16 || wt == ATTN_F16) return 0;
  return d->precision == ATTN_PRECISION_BF16 || (xt == ATTN_BF16 && wt == ATTN_BF16);
}

attn_status attn_linear(attn_ctx *ctx, attn_tensor *out, const attn_tensor *x, const attn_tensor *weight,
                        const attn_tensor *bias) {
  ATTN__ENTER(ctx);
  attn_status st;
  if ((st = check_dtype(ctx, x, "attn_linear: x", 2, 1, 0)) ||
      (st = check_dtype(ctx, weight, "attn_linear: weight", 2, 1, 0)) ||
      (st = check_dtype(ctx, out, "attn_linear: out", 2, 0, 0)) ||
      (bias && (st = check_dtype(ctx, bias, "attn_linear: bias", 1, 0, 1))))
    return st;
  const int64_t M = x->shape[0], K = x->shape[1], N = weight->shape[0];
  if (weight->shape[1] != K)
    return attn__fail(ctx, ATTN_E_SHAPE, "attn_linear: x is [%lld, %lld], so weight must be [N, %lld]; got [%lld, %lld]",
                      (long long)M, (long long)K, (long long)K, (long long)N, (long long)weight->shape[1]);
  if (out->shape[0] != M || out->shape[1] != N)
    return attn__fail(ctx, ATTN_E_SHAPE, "attn_linear: out must be [%lld, %lld] (x's rows, weight's rows); got [%lld, %lld]",
                      (long long)M, (long long)N, (long long)out->shape[0], (long long)out->shape[1]);
  if (bias && bias->shape[0] != N)
    return attn__fail(ctx, ATTN_E_SHAPE, "attn_linear: bias must be [%lld] (weight's rows); got [%lld]", (long long)N,
                      (long long)bias->shape[0]);
  if ((st = attn__check_writable(ctx, out, "attn_linear: out"))) return st;
  if (M == 0 || N == 0) return ATTN_OK;

  /* The bf16 GEMM reads f32 and bf16 in place; the fp32 one reads f32 only,
   * so it gets halves widened into copies. Views neither can take in place
   * get contiguous copies in the workspace (bf16 ones for bf16 products:
   * the GEMM would round them all the same); sizes saturate (broadcast views
   * need no memory behind them), so an impossible copy is refused before
   * anything is allocated. */
  const int half = bf16_products(ctx, x->dtype, weight->dtype);
  const attn_dtype ct = half ? ATTN_BF16 : ATTN_F32; /* the copies' dtype */
  const size_t ces = attn_dtype_size(ct);
  const int64_t ldx = half || x->dtype == ATTN_F32 ? in_place_ld(x) : -1;
  const int64_t ldw = half || weight->dtype == ATTN_F32 ? in_place_ld(weight) : -1;
  const int64_t ldo = in_place_ld(out);
  const int bias_copy = bias && ((N > 1 && bias->strides[0] != 1) || bias->dtype != ATTN_F32);
  size_t bx = 0, bw = 0, bo = 0, bb = 0;
  if ((ldx < 0 && attn__alloc_size(M, K, 1, ces, &bx)) || (ldw < 0 && attn__alloc_size(N, K, 1, ces, &bw)) ||
      (ldo < 0 && attn__alloc_size(M, N, 1, sizeof(float), &bo)) ||
      (bias_copy && attn__alloc_size(N, 1, 1, sizeof(float), &bb)))
    return attn__fail(ctx, ATTN_E_NOMEM,
                      "attn_linear: x [%lld, %lld], weight [%lld, %lld]: the contiguous copies of the strided views are "
                      "too large to allocate",
                      (long long)M, (long long)K, (long long)N, (long long)K);
  const size_t total = attn__carve_size(bx) + attn__carve_size(bw) + attn__carve_size(bo) + attn__carve_size(bb);
  char *cursor = NULL;
  if (total) {
    cursor = attn__workspace(ctx, total);
    if (!cursor)
      return attn__fail(ctx, ATTN_E_NOMEM, "attn_linear: cannot allocate %zu bytes for copies of the strided views", total);
  }
  const void *A = x->data, *B = weight->data;
  attn_dtype at = x->dtype, bt = weight->dtype;
  const float *b = bias ? bias->data : NULL;
  float *C = out->data;
  if (ldx < 0) {
    void *copy = attn__carve(&cursor, bx);
    gather(copy, ct, x);
    A = copy, at = ct;
  }
  if (ldw < 0) {
    void *copy = attn__carve(&cursor, bw);
    gather(copy, ct, weight);
    B = copy, bt = ct;
  }
  if (bias_copy) {
    float *copy = attn__carve(&cursor, bb);
    for (int64_t j = 0; j < N; j++) copy[j] = (float)attn__load(bias->data, bias->dtype, j * bias->strides[0]);
    b = copy;
  }
  if (ldo < 0) C = attn__carve(&cursor, bo);
  /* under F16, f32 and f16 operands as f16 (rounding an f16's widened value changes nothing); bf16 never */
  const int f16 = !half && ctx->dispatch.precision == ATTN_PRECISION_F16 && x->dtype != ATTN_BF16 &&
                  weight->dtype != ATTN_BF16;
  if (half)
    attn__bgemm_nt(ctx, M, N, K, A, at, ldx < 0 ? K : ldx, B, bt, ldw < 0 ? K : ldw, C, ldo < 0 ? N : ldo, b);
  else if (f16)
    attn__f16gemm_nt(ctx, M, N, K, A, ldx < 0 ? K : ldx, B, ldw < 0 ? K : ldw, C, ldo < 0 ? N : ldo, b);
  else
    attn__sgemm_nt(ctx, M, N, K, A, ldx < 0 ? K : ldx, B, ldw < 0 ? K : ldw, C, ldo < 0 ? N : ldo, b);
  if (ldo < 0) /* in row order, so rows that overlap end as the last one written */
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++) ((float *)out->data)[i * out->strides[0] + j * out->strides[1]] = C[i * N + j];
  return ATTN_OK;
}
