/* Half precision widened to float, inline: the packing loops and the
 * microkernels convert element by element, and these vectorise. */
#ifndef ATTN_HALF_H
#define ATTN_HALF_H

#include <stdint.h>
#include <string.h>

/* Exact, without branches (so loops of it vectorise): the f16's exponent and
 * mantissa bits placed in a float's, times 2^112 (the exponent biases' gap),
 * give every finite value, subnormals included; Inf and NaN are set apart. */
static inline float attn__f16_to_f32(uint16_t h) {
  const uint32_t em = (uint32_t)(h & 0x7fff) << 13, sign = (uint32_t)(h & 0x8000) << 16;
  float f;
  memcpy(&f, &em, 4);
  f *= 0x1p112f;
  uint32_t u;
  memcpy(&u, &f, 4);
  u = em >= (0x7c00u << 13) ? (em | 0x7f800000u) : u;
  u |= sign;
  memcpy(&f, &u, 4);
  return f;
}
static inline float attn__bf16_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* f to the nearest f16 (ties to even): overflow to Inf, subnormals exact, NaN stays a quiet NaN with
 * its payload's top bits (as vcvtps2ph); in core.c. */
uint16_t attn__f32_to_f16(float f);

/* To nearest even; NaN stays a (quiet) NaN. Inline: the bf16 tiles' packing rounds f32 inputs with it. */
static inline uint16_t attn__f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u; /* a select, not a branch: loops of it vectorise */
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1)) >> 16, quiet = (u >> 16) | 0x40;
  return (uint16_t)(nan ? quiet : rounded);
}

/* f to the nearest f16 (ties to even) and back, as attn__f16_to_f32(attn__f32_to_f16(f)) but
 * inline and without branches, so that packing loops vectorise: 10 fraction bits in f16's normal
 * range, multiples of 2^-24 below it (adding and taking away 0.5f rounds there), Inf past 65504;
 * NaN stays NaN. */
static inline float attn__round_to_f16(float f) {
  uint32_t u, sub_bits;
  memcpy(&u, &f, 4);
  const uint32_t sign = u & 0x80000000u, a = u & 0x7fffffffu;
  uint32_t normal = (a + 0xfffu + ((a >> 13) & 1u)) & ~0x1fffu;
  normal = normal > 0x477fe000u ? 0x7f800000u : normal;
  float af, sub;
  memcpy(&af, &a, 4);
  sub = (af + 0.5f) - 0.5f;
  memcpy(&sub_bits, &sub, 4);
  uint32_t r = a < 0x38800000u ? sub_bits : normal;
  r = a > 0x7f800000u ? u : r | sign;
  memcpy(&f, &r, 4);
  return f;
}

/* A value of f16 as the two bf16 terms of the half tiles' split (cpu/kernels.h): hi = bf16(x),
 * lo = x - hi, exact (an f16's 11 bits leave at most 3 for lo, within bf16's exponent range). */
static inline void attn__split_half_value(float x, uint16_t *hi, uint16_t *lo) {
  *hi = attn__f32_to_bf16(x);
  *lo = attn__f32_to_bf16(x - attn__bf16_to_f32(*hi));
}
static inline void attn__split_f16(uint16_t h, uint16_t *hi, uint16_t *lo) {
  attn__split_half_value(attn__f16_to_f32(h), hi, lo);
}

/* hi[e], lo[e] for e < n: the split of elements off, off + stride, ... of an f16 buffer (is_f16) or of
 * an f32 one rounded to f16 first; one loop per case, so that each vectorises. */
static inline void attn__split_row(uint16_t *restrict hi, uint16_t *restrict lo, const void *src, int is_f16,
                                   int64_t off, int64_t stride, int64_t n) {
  if (is_f16) {
    const uint16_t *s = (const uint16_t *)src + off;
    for (int64_t e = 0; e < n; e++) attn__split_half_value(attn__f16_to_f32(s[e * stride]), &hi[e], &lo[e]);
  } else {
    const float *s = (const float *)src + off;
    for (int64_t e = 0; e < n; e++) attn__split_half_value(attn__round_to_f16(s[e * stride]), &hi[e], &lo[e]);
  }
}

#endif
