/* The microkernel contract between the fp32 GEMM framework (gemm.c) and each
 * instruction set's register-blocked kernel (gemm.c's portable one,
 * avx2/gemm.c, avx512/gemm.c).
 *
 * The framework computes C = A . B^T (+ bias) by packing, for one depth block
 * of kc steps (k0 <= k < k0 + kc):
 *   a micro-panel of A: mr rows of A, k-major:   Ap[k * mr + i] = A[i][k0 + k]
 *   a micro-panel of B: nr rows of B, k-major:   Bp[k * nr + j] = B[j][k0 + k]
 * Both are 64-byte aligned and contiguous; rows past the edge of A or B are
 * packed as zeros. The kernel then updates one full mr x nr tile of C:
 *   acc[i][j] = init ? init[j] : C[i * ldc + j]
 *   for k = 0 .. kc-1:  acc[i][j] = fma(Ap[k * mr + i], Bp[k * nr + j], acc[i][j])  (in this order)
 *   C[i * ldc + j] = acc[i][j]
 * The SIMD kernels round once per step (a fused multiply-add); the portable
 * kernel multiplies then adds (or whatever one fixed sequence its compiler
 * makes of that loop). init (when not NULL) holds nr floats, any alignment.
 * C is any float pointer with ldc >= nr; the kernel reads and writes exactly
 * the mr x nr tile, so tiles cut by the edge of C are run by the framework on
 * a private mr x nr copy.
 *
 * So every element of C is one chain of kc (over all depth blocks: K) updates
 * in k order, starting from the bias or zero: the result does not depend on
 * the blocking, the thread count or where the tile sits. */
#ifndef ATTN_CPU_GEMM_H
#define ATTN_CPU_GEMM_H

#include <stdint.h>

typedef void (*attn__sgemm_ukr_fn)(int64_t kc, const float *Ap, const float *Bp, float *C, int64_t ldc,
                                   const float *init);

/* Packs one full micro-panel: r rows of X (ld floats apart) over kc steps into
 * P[k * r + i] = X[i * ld + k] (P 64-byte aligned), r being the kernel's mr
 * (pack_a) or nr (pack_b). NULL: the framework's portable loop. */
typedef void (*attn__sgemm_pack_fn)(const float *X, int64_t ld, int64_t kc, float *P);

typedef struct attn__sgemm_kernel {
  const char *name;
  int mr, nr;           /* tile of C; nr <= 64, mr <= 32 */
  int kc, mc, nc;       /* blocking: depth (B micro-panel in L1), rows of A per block (L2), columns of B per block (L3);
                           mc is a multiple of mr, nc of nr */
  attn__sgemm_ukr_fn ukr;
  attn__sgemm_pack_fn pack_a, pack_b;
} attn__sgemm_kernel;

/* The portable kernel (gemm.c): plain loops the compiler vectorises. */
extern const attn__sgemm_kernel attn__sgemm_kernel_c;
#ifdef ATTN_HAVE_X86_KERNELS
/* 6 x 16 tile in ymm accumulators (avx2/gemm.c). */
extern const attn__sgemm_kernel attn__sgemm_kernel_avx2;
/* 12 x 32 tile in zmm accumulators (avx512/gemm.c). */
extern const attn__sgemm_kernel attn__sgemm_kernel_avx512;
#endif

#endif
