#ifndef ATTN_CPU_VMATH_H
#define ATTN_CPU_VMATH_H

#include <stdint.h>
#include <string.h>

/* Vectorisable float math for the kernels: tanh, and x -> cap * tanh(x / cap).
 *
 * libm's tanhf is a scalar call per logit (about five times the cost of the
 * attention itself); this one is written as straight-line loops that the
 * compiler vectorises at whatever width the including file is built for:
 *   |x| < 1/4:  the odd Taylor series to x^13 (next term < 1e-11 relative);
 *   otherwise:  (1 - e) / (1 + e) with e = exp(-2|x|), where 1 - e >= 0.39 keeps
 *               the cancellation small; exp is 2^n * p(f), p of degree 6.
 * About 2.6e-7 relative error (tanhf: 1.6e-7); tanh(+-inf) = +-1, NaN stays NaN.
 * Both branches are computed for every element, each in its own loop, and
 * chosen between on the bits: a float compare, or float arithmetic moved into a
 * branch, may trap, so compilers would not vectorise a loop holding either. */

/* |x| as bits (non-negative floats order as integers; above 0x7f800000: NaN). */
static inline uint32_t attn__abs_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  return b & 0x7fffffffu;
}

/* tanh(a) for 0 <= a < 1/4: a + a^3 (c3 + a^2 (c5 + ...)). */
static inline float attn__tanh_small(float x) {
  const uint32_t ab = attn__abs_bits(x);
  float a;
  memcpy(&a, &ab, sizeof a);
  const float z = a * a;
  float t = 21844.0f / 6081075.0f;
  t = t * z - 1382.0f / 155925.0f;
  t = t * z + 62.0f / 2835.0f;
  t = t * z - 17.0f / 315.0f;
  t = t * z + 2.0f / 15.0f;
  t = t * z - 1.0f / 3.0f;
  return a + a * z * t;
}

/* tanh(a) for a >= 1/4: e = 2^(-2a log2 e), a clamped to 43.5 (NaN too) so that
 * 2^n stays a normal float; tanh is 1 in float there. */
static inline float attn__tanh_large(float x) {
  const uint32_t ab = attn__abs_bits(x), cb = ab < 0x422e0000u ? ab : 0x422e0000u;
  float a;
  memcpy(&a, &cb, sizeof a);
  const float u = -2.0f * 1.44269504088896341f * a; /* in [-125.6, 0] */
  const float n = (u + 12582912.0f) - 12582912.0f;  /* round to nearest */
  const float f = u - n;
  float q = 1.5403530393381606e-4f;
  q = q * f + 1.3333558146428443e-3f;
  q = q * f + 9.6181291076284772e-3f;
  q = q * f + 5.5504108664821580e-2f;
  q = q * f + 2.4022650695910071e-1f;
  q = q * f + 6.9314718055994531e-1f;
  q = q * f + 1.0f;
  const int32_t bits = ((int32_t)n + 127) * (1 << 23); /* 2^n, n in [-126, 0] */
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  const float e = q * scale;
  return (1.0f - e) / (1.0f + e);
}

/* tanh(x) from its two branches: the one |x| picks, x's sign, NaN kept. */
static inline float attn__tanh_pick(float x, float small, float large) {
  uint32_t xb, sb, lb;
  memcpy(&xb, &x, sizeof xb);
  memcpy(&sb, &small, sizeof sb);
  memcpy(&lb, &large, sizeof lb);
  const uint32_t ab = xb & 0x7fffffffu;
  uint32_t rb = (ab < 0x3e800000u ? sb : lb) | (xb & 0x80000000u);
  rb = ab > 0x7f800000u ? xb : rb;
  float r;
  memcpy(&r, &rb, sizeof r);
  return r;
}

static inline float attn__tanhf(float x) { return attn__tanh_pick(x, attn__tanh_small(x), attn__tanh_large(x)); }

/* S[e] = cap * tanh(S[e] / cap) for e < n; slope, when not NULL, gets 1 - tanh^2
 * (the derivative, for the backward). In chunks of 64 on the stack. */
static inline void attn__cap_tanh(float *S, float *slope, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t e0 = 0; e0 < n; e0 += 64) {
    const int m = n - e0 < 64 ? (int)(n - e0) : 64;
    float *s = S + e0, x[64], lo[64], hi[64];
    for (int i = 0; i < m; i++) x[i] = s[i] * inv;
    for (int i = 0; i < m; i++) lo[i] = attn__tanh_small(x[i]);
    for (int i = 0; i < m; i++) hi[i] = attn__tanh_large(x[i]);
    for (int i = 0; i < m; i++) {
      const float th = attn__tanh_pick(x[i], lo[i], hi[i]);
      s[i] = cap * th;
      if (slope) slope[e0 + i] = 1.0f - th * th;
    }
  }
}

#endif
