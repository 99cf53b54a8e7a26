/* The one place a kernel choice becomes the kernel sets a context's calls run. */
#include "../internal.h"
#include "../cpu/gemm.h"
#include "../cpu/kernels.h"

void attn__dispatch_fill(attn__dispatch *d, attn_kernel kernel, unsigned supported, int decode_enabled) {
  if (kernel == ATTN_KERNEL_AUTO || !((supported >> kernel) & 1)) {
    kernel = ATTN_KERNEL_C;
    if ((supported >> ATTN_KERNEL_AVX2) & 1) kernel = ATTN_KERNEL_AVX2;
    if ((supported >> ATTN_KERNEL_AVX512) & 1) kernel = ATTN_KERNEL_AVX512;
  }
  d->kernel = kernel;
  d->attention = &attn__kernels_c;
  d->decode = &attn__decode_kernels_c;
  d->gemm = &attn__sgemm_kernel_c;
#ifdef ATTN_HAVE_X86_KERNELS
  if (kernel == ATTN_KERNEL_AVX2) {
    d->attention = &attn__kernels_avx2;
    d->decode = &attn__decode_kernels_avx2;
    d->gemm = &attn__sgemm_kernel_avx2;
  } else if (kernel == ATTN_KERNEL_AVX512) {
    d->attention = &attn__kernels_avx512;
    d->decode = &attn__decode_kernels_avx512;
    d->gemm = &attn__sgemm_kernel_avx512;
  }
#endif
  d->decode_enabled = decode_enabled != 0;
}
