/* The one place a kernel choice becomes the kernel sets a context's calls run. */
#include "../internal.h"
#include "../cpu/gemm.h"
#include "../cpu/kernels.h"
#include "../logit.h"

void attn__dispatch_fill(attn__dispatch *d, attn_kernel kernel, unsigned supported, int decode_enabled,
                         attn_precision precision) {
  if (kernel == ATTN_KERNEL_AUTO || !((supported >> kernel) & 1)) {
    kernel = ATTN_KERNEL_C;
    if ((supported >> ATTN_KERNEL_AVX2) & 1) kernel = ATTN_KERNEL_AVX2;
    if ((supported >> ATTN_KERNEL_AVX512) & 1) kernel = ATTN_KERNEL_AVX512;
    if ((supported >> ATTN_KERNEL_AVX512_BF16) & 1) kernel = ATTN_KERNEL_AVX512_BF16;
  }
  d->kernel = kernel;
  d->attention = &attn__kernels_c;
  d->decode = &attn__decode_kernels_c;
  d->gemm = &attn__sgemm_kernel_c;
  d->half = NULL;
  d->gemm_bf16 = NULL;
#ifdef ATTN_HAVE_X86_KERNELS
  if (kernel == ATTN_KERNEL_AVX2) {
    d->attention = &attn__kernels_avx2;
    d->decode = &attn__decode_kernels_avx2;
    d->gemm = &attn__sgemm_kernel_avx2;
  } else if (kernel == ATTN_KERNEL_AVX512 || kernel == ATTN_KERNEL_AVX512_BF16) {
    d->attention = &attn__kernels_avx512;
    d->decode = &attn__decode_kernels_avx512;
    d->gemm = &attn__sgemm_kernel_avx512;
    const attn__half_kernels *h = &attn__half_kernels_avx512bf16;
    if (kernel == ATTN_KERNEL_AVX512_BF16 && h->mr == h->base->mr && h->nr == h->base->nr) d->half = h;
    if (kernel == ATTN_KERNEL_AVX512_BF16) d->gemm_bf16 = &attn__bgemm_kernel_avx512bf16;
  }
#endif
  d->decode_enabled = decode_enabled != 0;
  d->precision = precision;
}

/* The policy of attn.h's attn_precision, for the blocked forward: bf16 tiles
 * when the kernel has them and q, k and v are bf16 (or, under BF16, f32 or bf16). */
const attn__half_kernels *attn__dispatch_half(const attn__dispatch *d, const attn__sdpa *p) {
  if (!d->half || d->precision == ATTN_PRECISION_FP32) return NULL;
  const attn_dtype dt[3] = {p->q.dtype, p->k.dtype, p->v.dtype};
  for (int i = 0; i < 3; i++)
    if (dt[i] != ATTN_BF16 && !(d->precision == ATTN_PRECISION_BF16 && dt[i] == ATTN_F32)) return NULL;
  return d->half;
}
