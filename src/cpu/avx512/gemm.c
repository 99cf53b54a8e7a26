/* AVX-512 fp32 GEMM microkernel (the contract is in gemm.h).
 *
 * Tile: MR = 12 rows x NR = 32 columns of C, held in 24 zmm accumulators
 * (two per row), plus two zmm for the B row and one for the broadcast.
 *   Packed A micro-panel: kc x 12 floats, k-major: Ap[k * 12 + i] = A[i][k].
 *   Packed B micro-panel: kc x 32 floats, k-major: Bp[k * 32 + j] = B[j][k],
 *   64-byte aligned (aligned loads).
 *   Each step k: load Bp[k][0..15] and Bp[k][16..31], then for each row i
 *   broadcast Ap[k][i] and issue two FMAs. Every accumulator is one chain of
 *   vfmadd231ps in k order.
 * Edges: the kernel only ever sees full 12 x 32 tiles; the framework (gemm.c)
 * zero-pads the packed panels and runs tiles cut by C's edge on a private copy.
 * init (NULL or 32 floats) seeds every row's accumulators instead of C. */
#include "../gemm.h"
#include "transpose4.h"

#include <immintrin.h>

#define MR 12
#define NR 32

static void ukr_avx512(int64_t kc, const float *Ap, const float *Bp, float *C, int64_t ldc, const float *init) {
  __m512 c[MR][2];
  if (init) {
    const __m512 i0 = _mm512_loadu_ps(init), i1 = _mm512_loadu_ps(init + 16);
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
      c[i][0] = i0;
      c[i][1] = i1;
    }
  } else {
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
      c[i][0] = _mm512_loadu_ps(C + i * ldc);
      c[i][1] = _mm512_loadu_ps(C + i * ldc + 16);
    }
  }
  for (int64_t k = 0; k < kc; k++) {
    const __m512 b0 = _mm512_load_ps(Bp), b1 = _mm512_load_ps(Bp + 16);
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
      const __m512 a = _mm512_set1_ps(Ap[i]);
      c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
      c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
    }
    Ap += MR;
    Bp += NR;
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; i++) {
    _mm512_storeu_ps(C + i * ldc, c[i][0]);
    _mm512_storeu_ps(C + i * ldc + 16, c[i][1]);
  }
}

/* Packing a micro-panel of r rows (r a multiple of 4): per group of 4 rows and
 * 16 steps, four row loads and a transposed store (transpose4.h). */
static inline void pack4(const float *X, int64_t ld, int64_t kc, int r, float *P) {
  int64_t k = 0;
  for (; k + 16 <= kc; k += 16)
    for (int g = 0; g < r; g += 4) {
      const float *x = X + g * ld + k;
      attn__store_4x16_transposed(P + k * r + g, r, _mm512_loadu_ps(x), _mm512_loadu_ps(x + ld),
                                  _mm512_loadu_ps(x + 2 * ld), _mm512_loadu_ps(x + 3 * ld));
    }
  for (; k < kc; k++)
    for (int i = 0; i < r; i++) P[k * r + i] = X[i * ld + k];
}

static void pack_a_avx512(const float *X, int64_t ld, int64_t kc, float *P) { pack4(X, ld, kc, MR, P); }
static void pack_b_avx512(const float *X, int64_t ld, int64_t kc, float *P) { pack4(X, ld, kc, NR, P); }

/* kc = 256: the B micro-panel is 32 KiB (L1); mc = 192: the A block is 192 KiB (L2);
 * nc = 512: the B block is 512 KiB (L2/L3). */
const attn__sgemm_kernel attn__sgemm_kernel_avx512 = {"avx512", MR, NR, 256, (192 / MR) * MR, 512, ukr_avx512,
                                                      pack_a_avx512, pack_b_avx512};
