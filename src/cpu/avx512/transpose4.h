/* The transpose at the heart of the AVX-512 GEMM kernels' packing (gemm.c,
 * gemm_bf16.c): four rows of 16 32-bit elements (floats, or bf16 pairs) are
 * stored column by column, 4 elements (one per row) every r elements.
 * Compiled only with the AVX-512 flags. */
#ifndef ATTN_CPU_AVX512_TRANSPOSE4_H
#define ATTN_CPU_AVX512_TRANSPOSE4_H

#include <immintrin.h>

/* P[c * r + i] = row i's element c, for rows i < 4 and columns c < 16 (P any
 * alignment): a 4 x 4 transpose inside each 128-bit lane, then sixteen
 * 4-element stores. */
static inline void attn__store_4x16_transposed(void *P, int r, __m512 r0, __m512 r1, __m512 r2, __m512 r3) {
  const __m512d t0 = _mm512_castps_pd(_mm512_unpacklo_ps(r0, r1)), t1 = _mm512_castps_pd(_mm512_unpackhi_ps(r0, r1));
  const __m512d t2 = _mm512_castps_pd(_mm512_unpacklo_ps(r2, r3)), t3 = _mm512_castps_pd(_mm512_unpackhi_ps(r2, r3));
  /* u[j], lane l: the four rows' element 4 l + j */
  const __m512 u[4] = {_mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2)), _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2)),
                       _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3)), _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3))};
  float *p = P;
#pragma GCC unroll 4
  for (int j = 0; j < 4; j++) {
    _mm_storeu_ps(p + (0 + j) * r, _mm512_castps512_ps128(u[j]));
    _mm_storeu_ps(p + (4 + j) * r, _mm512_extractf32x4_ps(u[j], 1));
    _mm_storeu_ps(p + (8 + j) * r, _mm512_extractf32x4_ps(u[j], 2));
    _mm_storeu_ps(p + (12 + j) * r, _mm512_extractf32x4_ps(u[j], 3));
  }
}

#endif
