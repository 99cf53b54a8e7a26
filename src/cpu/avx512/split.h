/* f16 values as two bf16 terms on AVX-512 (kernels.h's split: hi = bf16(x),
 * lo = x - hi, exact for an f16 x), for the AMX f16 tiles and the 16-row
 * softmax under them. Compiled only with the AVX-512 flags and -mavx512bf16. */
#ifndef ATTN_CPU_AVX512_SPLIT_H
#define ATTN_CPU_AVX512_SPLIT_H

#include <immintrin.h>

/* x rounded to f16 (nearest even) and back: as PyTorch rounds P and dS for their f16 products. */
static inline __m512 through_f16(__m512 x) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* The lo terms of f16 values x0, x1 (16 each) whose hi terms are hi = cvtne2ps_pbh(x1, x0): x - hi, exact. */
static inline __m512i lo_terms(__m512i hi, __m512 x0, __m512 x1) {
  const __m512 h0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hi)), 16));
  const __m512 h1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hi, 1)), 16));
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, h1), _mm512_sub_ps(x0, h0));
}

#endif
