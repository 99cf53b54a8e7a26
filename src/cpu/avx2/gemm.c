/* AVX2 + FMA fp32 GEMM microkernel (the contract is in gemm.h).
 *
 * Tile: MR = 6 rows x NR = 16 columns of C, held in 12 ymm accumulators (two
 * per row), plus two ymm for the B row and one for the broadcast (15 of 16).
 *   Packed A micro-panel: kc x 6 floats, k-major: Ap[k * 6 + i] = A[i][k].
 *   Packed B micro-panel: kc x 16 floats, k-major: Bp[k * 16 + j] = B[j][k],
 *   64-byte aligned (aligned loads).
 *   Each step k: load Bp[k][0..7] and Bp[k][8..15], then for each row i
 *   broadcast Ap[k][i] and issue two FMAs. Every accumulator is one chain of
 *   vfmadd231ps in k order.
 * Edges: the kernel only ever sees full 6 x 16 tiles; the framework (gemm.c)
 * zero-pads the packed panels and runs tiles cut by C's edge on a private copy.
 * init (NULL or 16 floats) seeds every row's accumulators instead of C. */
#include "../gemm.h"

#include <immintrin.h>

#define MR 6
#define NR 16

static void ukr_avx2(int64_t kc, const float *Ap, const float *Bp, float *C, int64_t ldc, const float *init) {
  __m256 c[MR][2];
  if (init) {
    const __m256 i0 = _mm256_loadu_ps(init), i1 = _mm256_loadu_ps(init + 8);
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
      c[i][0] = i0;
      c[i][1] = i1;
    }
  } else {
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
      c[i][0] = _mm256_loadu_ps(C + i * ldc);
      c[i][1] = _mm256_loadu_ps(C + i * ldc + 8);
    }
  }
  for (int64_t k = 0; k < kc; k++) {
    const __m256 b0 = _mm256_load_ps(Bp), b1 = _mm256_load_ps(Bp + 8);
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
      const __m256 a = _mm256_broadcast_ss(Ap + i);
      c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
      c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
    }
    Ap += MR;
    Bp += NR;
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; i++) {
    _mm256_storeu_ps(C + i * ldc, c[i][0]);
    _mm256_storeu_ps(C + i * ldc + 8, c[i][1]);
  }
}

/* Packing, per 8 steps: a group of 4 rows goes through a 4 x 4 transpose
 * inside each 128-bit lane (eight 4-float stores, each the 4 rows at one
 * step); a pair of rows through one interleave (eight 2-float stores). */
static inline void pack_rows4(const float *x, int64_t ld, int r, float *p) {
  const __m256 r0 = _mm256_loadu_ps(x), r1 = _mm256_loadu_ps(x + ld);
  const __m256 r2 = _mm256_loadu_ps(x + 2 * ld), r3 = _mm256_loadu_ps(x + 3 * ld);
  const __m256d t0 = _mm256_castps_pd(_mm256_unpacklo_ps(r0, r1)), t1 = _mm256_castps_pd(_mm256_unpackhi_ps(r0, r1));
  const __m256d t2 = _mm256_castps_pd(_mm256_unpacklo_ps(r2, r3)), t3 = _mm256_castps_pd(_mm256_unpackhi_ps(r2, r3));
  /* u[j], lane l: the 4 rows at step 4 l + j */
  const __m256 u[4] = {_mm256_castpd_ps(_mm256_unpacklo_pd(t0, t2)), _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t2)),
                       _mm256_castpd_ps(_mm256_unpacklo_pd(t1, t3)), _mm256_castpd_ps(_mm256_unpackhi_pd(t1, t3))};
#pragma GCC unroll 4
  for (int j = 0; j < 4; j++) {
    _mm_storeu_ps(p + j * r, _mm256_castps256_ps128(u[j]));
    _mm_storeu_ps(p + (4 + j) * r, _mm256_extractf128_ps(u[j], 1));
  }
}

static inline void pack_rows2(const float *x, int64_t ld, int r, float *p) {
  const __m256 r0 = _mm256_loadu_ps(x), r1 = _mm256_loadu_ps(x + ld);
  /* lo: steps 0, 1 | 4, 5; hi: steps 2, 3 | 6, 7 (each a pair of rows) */
  const __m256 lo = _mm256_unpacklo_ps(r0, r1), hi = _mm256_unpackhi_ps(r0, r1);
  const __m128 l0 = _mm256_castps256_ps128(lo), l1 = _mm256_extractf128_ps(lo, 1);
  const __m128 h0 = _mm256_castps256_ps128(hi), h1 = _mm256_extractf128_ps(hi, 1);
  _mm_storel_pi((__m64 *)(p + 0 * r), l0);
  _mm_storeh_pi((__m64 *)(p + 1 * r), l0);
  _mm_storel_pi((__m64 *)(p + 2 * r), h0);
  _mm_storeh_pi((__m64 *)(p + 3 * r), h0);
  _mm_storel_pi((__m64 *)(p + 4 * r), l1);
  _mm_storeh_pi((__m64 *)(p + 5 * r), l1);
  _mm_storel_pi((__m64 *)(p + 6 * r), h1);
  _mm_storeh_pi((__m64 *)(p + 7 * r), h1);
}

static inline void pack(const float *X, int64_t ld, int64_t kc, int r, float *P) {
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8) {
    int g = 0;
    for (; g + 4 <= r; g += 4) pack_rows4(X + g * ld + k, ld, r, P + k * r + g);
    for (; g + 2 <= r; g += 2) pack_rows2(X + g * ld + k, ld, r, P + k * r + g);
  }
  for (; k < kc; k++)
    for (int i = 0; i < r; i++) P[k * r + i] = X[i * ld + k];
}

static void pack_a_avx2(const float *X, int64_t ld, int64_t kc, float *P) { pack(X, ld, kc, MR, P); }
static void pack_b_avx2(const float *X, int64_t ld, int64_t kc, float *P) { pack(X, ld, kc, NR, P); }

/* kc = 256: the B micro-panel is 16 KiB (L1); mc = 192: the A block is 192 KiB (L2);
 * nc = 512: the B block is 512 KiB (L2/L3). */
const attn__sgemm_kernel attn__sgemm_kernel_avx2 = {"avx2", MR, NR, 256, 32 * MR, 512, ukr_avx2, pack_a_avx2, pack_b_avx2};
