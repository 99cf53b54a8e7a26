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

#include "attn.h"
#include "../half.h"

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

/* ---- the bf16 variant: bf16 products summed in fp32 --------------------------
 * The same framework (engine/gemm.c) and the same properties, with A and B
 * read as bf16: bf16 inputs as they are, f32 ones rounded to nearest even
 * (attn__f32_to_bf16). A depth block is always an even number of steps, and
 * both operands are packed as pairs of consecutive steps, the layout
 * vdpbf16ps reads (one 32-bit lane = one pair), for pairs t = 0 .. kp-1 of a
 * block (kp = ceil(kc / 2)):
 *   Ap[(t * mr + i) * 2 + e] = bf16(A[i][k0 + 2t + e])
 *   Bp[(t * nr + j) * 2 + e] = bf16(B[j][k0 + 2t + e])
 * An odd K's last pair has a zero upper half, rows past the edge are zeros;
 * both 64-byte aligned. The kernel updates one full mr x nr tile of C:
 *   acc[i][j] = init ? init[j] : C[i * ldc + j]
 *   for t = 0 .. kp-1:  acc[i][j] = dot2(acc[i][j], Ap pair (t, i), Bp pair (t, j))   (in this order)
 *   C[i * ldc + j] = acc[i][j]
 * where dot2 is the instruction's fixed sequence for one lane (vdpbf16ps: the
 * two products are exact in fp32; each is added with fp32 rounding; bf16
 * subnormals count as zero). So every element of C is again one chain in k
 * order from the bias or zero, whatever the blocking or thread count.
 *
 * A matrix unit's kernel (AMX) may ask for two more things:
 *   kp_align: a block's pairs are padded with zero pairs to kpp, a multiple
 *             of kp_align (tiles take 16 pairs a step); the kernel is called
 *             with kpp. Zero pairs add exact zeros, so C does not change.
 *   a_rows:   A's micro-panels row by row, as a tile's rows are read:
 *               Ap[(i * kpp + t) * 2 + e] = bf16(A[i][k0 + 2t + e])
 *             (B's stay k-major: that is already a tile's layout).
 * and begin/end, run by each thread around its calls of ukr (NULL: none):
 * the tile configuration lives from one to the other. A tile's sums run in an
 * order of the unit's own, fixed for the kernel, so C is again the same
 * whatever the blocking or thread count. */
typedef void (*attn__bgemm_ukr_fn)(int64_t kp, const uint16_t *Ap, const uint16_t *Bp, float *C, int64_t ldc,
                                   const float *init);
/* Packs one full micro-panel of r rows (the kernel's mr or nr) of X, an f32
 * or bf16 matrix (ld elements apart), over kc steps (odd kc: the last pair's
 * upper half 0), as above. NULL: the framework's portable loop. */
typedef void (*attn__bgemm_pack_fn)(const void *X, attn_dtype dt, int64_t ld, int64_t kc, uint16_t *P);

typedef struct attn__bgemm_kernel {
  const char *name;
  int mr, nr;     /* tile of C; nr <= 64, mr <= 32 */
  int kc, mc, nc; /* blocking as attn__sgemm_kernel's; kc counts steps (not pairs) and is even */
  attn__bgemm_ukr_fn ukr;
  attn__bgemm_pack_fn pack_a, pack_b; /* pack_a packs kpp pairs a row when a_rows is set */
  int kp_align, a_rows;               /* 0: 1 and k-major, as above */
  void (*begin)(void);
  void (*end)(void);
} attn__bgemm_kernel;

/* The portable packing of one micro-panel of r rows into pairs (the contract
 * above), rows past `rows` zero: shared by the framework (edge panels) and
 * the kernels' own pack functions, which inline it under their instruction
 * set's flags so that the rounding vectorises. */
static inline void attn__bgemm_pack_pairs(const void *X, attn_dtype dt, int64_t ld, int64_t rows, int64_t kc, int r,
                                          uint16_t *restrict P) {
  const int64_t kp = (kc + 1) / 2, even = kc & ~(int64_t)1;
  for (int i = 0; i < r; i++) {
    uint16_t *p = P + 2 * i;
    if (i >= rows) {
      for (int64_t t = 0; t < kp; t++) p[2 * t * r] = p[2 * t * r + 1] = 0;
    } else if (dt == ATTN_BF16) {
      const uint16_t *x = (const uint16_t *)X + i * ld;
      for (int64_t k = 0; k < even; k += 2) {
        p[k * r] = x[k];
        p[k * r + 1] = x[k + 1];
      }
      if (kc & 1) p[even * r] = x[even], p[even * r + 1] = 0;
    } else {
      const float *x = (const float *)X + i * ld;
      for (int64_t k = 0; k < even; k += 2) {
        p[k * r] = attn__f32_to_bf16(x[k]);
        p[k * r + 1] = attn__f32_to_bf16(x[k + 1]);
      }
      if (kc & 1) p[even * r] = attn__f32_to_bf16(x[even]), p[even * r + 1] = 0;
    }
  }
}

#ifdef ATTN_HAVE_X86_KERNELS
/* 6 x 16 tile in ymm accumulators (avx2/gemm.c). */
extern const attn__sgemm_kernel attn__sgemm_kernel_avx2;
/* 12 x 32 tile in zmm accumulators (avx512/gemm.c). */
extern const attn__sgemm_kernel attn__sgemm_kernel_avx512;
/* 12 x 32 tile of vdpbf16ps accumulators (avx512/gemm_bf16.c; AVX512-BF16 CPUs only). */
extern const attn__bgemm_kernel attn__bgemm_kernel_avx512bf16;
/* Its packing of a B micro-panel of 32 rows (the AMX kernel's too). */
void attn__bgemm_pack_b32_avx512bf16(const void *X, attn_dtype dt, int64_t ld, int64_t kc, uint16_t *P);
#endif
#ifdef ATTN_HAVE_AMX
/* 32 x 32 tile in four AMX tiles (amx/gemm_amx.c; AMX-BF16 CPUs only). */
extern const attn__bgemm_kernel attn__bgemm_kernel_amx;
#endif

#endif
