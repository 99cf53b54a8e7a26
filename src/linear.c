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

static void gather(float *dst, const attn_tensor *t) {
  const float *src = t->data;
  const int64_t rows = t->shape[0], cols = t->shape[1];
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < cols; j++) dst[i * cols + j] = src[i * t->strides[0] + j * t->strides[1]];
}

static attn_status check_f32(attn_ctx *ctx, const attn_tensor *t, const char *what, int rank) {
  attn_status st = attn__check_tensor(ctx, t, what, rank);
  if (st) return st;
  if (t->dtype != ATTN_F32)
    return attn__fail(ctx, ATTN_E_DTYPE, "%s is %s; attn_linear takes f32 only", what, attn_dtype_name(t->dtype));
  return ATTN_OK;
}

attn_status attn_linear(attn_ctx *ctx, attn_tensor *out, const attn_tensor *x, const attn_tensor *weight,
                        const attn_tensor *bias) {
  ATTN__ENTER(ctx);
  attn_status st;
  if ((st = check_f32(ctx, x, "attn_linear: x", 2)) || (st = check_f32(ctx, weight, "attn_linear: weight", 2)) ||
      (st = check_f32(ctx, out, "attn_linear: out", 2)) || (bias && (st = check_f32(ctx, bias, "attn_linear: bias", 1))))
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

  /* Views the GEMM cannot take in place get contiguous copies in the
   * workspace; sizes saturate (broadcast views need no memory behind them),
   * so an impossible copy is refused before anything is allocated. */
  const int64_t ldx = in_place_ld(x), ldw = in_place_ld(weight), ldo = in_place_ld(out);
  const int bias_copy = bias && N > 1 && bias->strides[0] != 1;
  size_t bx = 0, bw = 0, bo = 0, bb = 0;
  if ((ldx < 0 && attn__alloc_size(M, K, 1, sizeof(float), &bx)) ||
      (ldw < 0 && attn__alloc_size(N, K, 1, sizeof(float), &bw)) ||
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
  const float *A = x->data, *B = weight->data, *b = bias ? bias->data : NULL;
  float *C = out->data;
  if (ldx < 0) {
    float *copy = attn__carve(&cursor, bx);
    gather(copy, x);
    A = copy;
  }
  if (ldw < 0) {
    float *copy = attn__carve(&cursor, bw);
    gather(copy, weight);
    B = copy;
  }
  if (bias_copy) {
    float *copy = attn__carve(&cursor, bb);
    for (int64_t j = 0; j < N; j++) copy[j] = b[j * bias->strides[0]];
    b = copy;
  }
  if (ldo < 0) C = attn__carve(&cursor, bo);
  attn__sgemm_nt(ctx, M, N, K, A, ldx < 0 ? K : ldx, B, ldw < 0 ? K : ldw, C, ldo < 0 ? N : ldo, b);
  if (ldo < 0) /* in row order, so rows that overlap end as the last one written */
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++) ((float *)out->data)[i * out->strides[0] + j * out->strides[1]] = C[i * N + j];
  return ATTN_OK;
}
