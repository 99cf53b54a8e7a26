/* The half backward's tile work on AVX-512 (kernels.h's pairs and t_out) for
 * 16 x 64 tiles, shared by the AMX set and the AVX512-BF16 one: the same
 * layouts, only pt_acc's products differ. Compiled with the AVX-512 flags and
 * -mavx512bf16. */
#ifndef ATTN_CPU_AVX512_BWD_TILES_H
#define ATTN_CPU_AVX512_BWD_TILES_H

#include "../kernels.h"
#include "split.h"
#include "transpose4.h"

#include <immintrin.h>

#define BWD_MR 16
#define BWD_NR 64

static inline __mmask16 bwd_lanes16(int64_t n) {
  return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* word 2i of the permuted vector is row 2t's key i, word 2i + 1 row 2t + 1's */
static inline __m512i interleave_rows(__m512i x) {
  const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(inter, x);
}

/* Xp's hi pairs and, with TERMS 2, its lo pairs ATTN__BWD_MAX_ROWS / 2 pair rows further (X rounded to
 * f16 first, as round_p rounds P). */
static inline __attribute__((always_inline)) void attn__pairs_16x64(uint32_t *Xp, const float *X, const int TERMS) {
  for (int t = 0; t < BWD_MR / 2; t++)
    for (int v = 0; v < BWD_NR / 16; v++) {
      __m512 x0 = _mm512_load_ps(X + 2 * t * BWD_NR + 16 * v);
      __m512 x1 = _mm512_load_ps(X + (2 * t + 1) * BWD_NR + 16 * v);
      if (TERMS == 2) {
        x0 = through_f16(x0);
        x1 = through_f16(x1);
      }
      const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
      _mm512_store_si512(Xp + t * BWD_NR + 16 * v, interleave_rows(hi));
      if (TERMS == 2) {
        const __m512i lo = lo_terms(hi, x0, x1);
        _mm512_store_si512(Xp + (ATTN__BWD_MAX_ROWS / 2 + t) * BWD_NR + 16 * v, interleave_rows(lo));
      }
    }
}

/* C a multiple of 4. Whole groups of 16 keys: four rows of T (four channels) turned at a time by transpose4.h; the last
 * nk % 16 keys one gather per output row (column j of T, 16 channels at a time). */
static void attn__t_out_16x64(float *Out, int64_t ldo, const float *T, int64_t C, int64_t nk, float scale) {
  const __m512 sv = _mm512_set1_ps(scale);
  int64_t j0 = 0;
  for (; j0 + 16 <= nk && ldo <= INT32_MAX; j0 += 16)
    for (int64_t c = 0; c < C; c += 4) {
      const float *t = T + c * BWD_NR + j0;
      attn__store_4x16_transposed(
          Out + j0 * ldo + c, (int)ldo, _mm512_mul_ps(_mm512_loadu_ps(t), sv),
          _mm512_mul_ps(_mm512_loadu_ps(t + BWD_NR), sv), _mm512_mul_ps(_mm512_loadu_ps(t + 2 * BWD_NR), sv),
          _mm512_mul_ps(_mm512_loadu_ps(t + 3 * BWD_NR), sv));
    }
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(BWD_NR));
  for (int64_t j = j0; j < nk; j++)
    for (int64_t c0 = 0; c0 < C; c0 += 16) {
      const __mmask16 mk = bwd_lanes16(C - c0);
      const __m512 x = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk, idx, T + c0 * BWD_NR + j, 4);
      _mm512_mask_storeu_ps(Out + j * ldo + c0, mk, _mm512_mul_ps(x, sv));
    }
}

#undef BWD_MR
#undef BWD_NR

#endif
