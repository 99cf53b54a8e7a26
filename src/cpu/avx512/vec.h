/* Vector helpers the AVX-512 kernel files share (attention.c, decode.c).
 * Compiled only with the AVX-512 flags. */
#ifndef ATTN_CPU_AVX512_VEC_H
#define ATTN_CPU_AVX512_VEC_H

#include <immintrin.h>
#include <stdint.h>

/* e^x for a vector: 2^(x log2 e) with 2^f on f in [-1/2, 1/2] by a degree-6
 * polynomial (about 1 ulp) and vscalefps for 2^n. x <= 88 (softmax arguments
 * are <= 0); -inf gives +0 exactly, NaN stays NaN. Results below 2^-125 are 0:
 * on Intel cores an instruction whose result underflows to a subnormal (or to
 * zero through one) takes a microcode assist of ~100 cycles, and a masked
 * logit (-inf) would pay it in every lane; the lanes are left out instead
 * (-inf's t - n is NaN there, and never seen). */
static inline __m512 exp512(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ); /* NaN too */
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f); /* ln2^6 / 6! ... ln2 / 1! */
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

/* Sixteen horizontal reductions at once, in 15 shuffle pairs: lane k of the
 * result reduces v[(k % 4) * 4 + k / 4] (a 4 x 4 transpose, its own inverse). */
#define REDUCE16(name, op)                                                                                    \
  static inline __m512 name(const __m512 v[16]) {                                                            \
    __m512 w[8], x[4], y[2];                                                                                  \
    for (int i = 0; i < 8; i++)                                                                               \
      w[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE)); \
    for (int i = 0; i < 4; i++)                                                                               \
      x[i] = op(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88), _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD)); \
    for (int i = 0; i < 2; i++)                                                                               \
      y[i] = op(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE)); \
    return op(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));                     \
  }
REDUCE16(reduce16_max, _mm512_max_ps)
REDUCE16(reduce16_add, _mm512_add_ps)
#define SLOT(r) (((r) % 4) * 4 + (r) / 4) /* input slot whose reduction lands in lane r */

/* Lanes [0, n) of a zmm, n clamped to 0..16. */
static inline __mmask16 lanes16(int64_t n) {
  return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

#endif
