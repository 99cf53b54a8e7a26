/* Dropout's random numbers: Philox-4x32-10, a counter-based generator
 * (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
 * SC 2011). Internal header, prefix attn__.
 *
 * The decision for entry (b, h, i, j) of the [B, Hq, Nq, Nk] probabilities:
 *   key     = (seed & 0xffffffff, seed >> 32)
 *   counter = (j >> 2, i, h, b), each truncated to 32 bits (counter word 0 first)
 *   u       = word (j & 3) of philox4x32_10(counter, key)
 *   dropped when u < attn__dropout_threshold(p) = floor(p * 2^32)
 * so one call gives the decisions of four neighbouring keys j = 4c .. 4c+3 of a
 * row, and any kernel, thread or machine regenerates the same mask. */
#ifndef ATTN_DROPOUT_H
#define ATTN_DROPOUT_H

#include <stdint.h>

#define ATTN__PHILOX_M0 0xD2511F53u
#define ATTN__PHILOX_M1 0xCD9E8D57u
#define ATTN__PHILOX_W0 0x9E3779B9u /* golden ratio */
#define ATTN__PHILOX_W1 0xBB67AE85u /* sqrt(3) - 1 */

/* Philox-4x32-10: out = the 10-round bijection of ctr under the key (low, high words of seed). */
static inline void attn__philox4x32(uint32_t out[4], const uint32_t ctr[4], uint64_t seed) {
  uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int round = 0; round < 10; round++) {
    if (round > 0) {
      k0 += ATTN__PHILOX_W0;
      k1 += ATTN__PHILOX_W1;
    }
    const uint64_t p0 = (uint64_t)ATTN__PHILOX_M0 * c0, p1 = (uint64_t)ATTN__PHILOX_M1 * c2;
    const uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    const uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

/* floor(p * 2^32) for p in [0, 1): a word u is dropped when u < this.
 * p <= 0, NaN, or p >= 1 give 0 (p = 1, which drops everything, is attn_dropout_keep's
 * case before it asks for a threshold). */
static inline uint32_t attn__dropout_threshold(double p) {
  if (!(p > 0) || !(p < 1)) return 0;
  return (uint32_t)(p * 4294967296.0); /* < 2^32 since p < 1; the conversion truncates */
}

/* The counter of the block of four keys j0 = 4c .. 4c+3 of row (b, h, i). */
static inline void attn__dropout_counter(uint32_t ctr[4], int64_t b, int64_t h, int64_t i, int64_t j) {
  ctr[0] = (uint32_t)((uint64_t)j >> 2);
  ctr[1] = (uint32_t)(uint64_t)i;
  ctr[2] = (uint32_t)(uint64_t)h;
  ctr[3] = (uint32_t)(uint64_t)b;
}

/* The fast path: keep flags (1/0) of keys 4c .. 4c+3 of row (b, h, i), with
 * threshold from attn__dropout_threshold. j4 is any of the four keys. */
static inline void attn__dropout_keep4(uint8_t keep[4], uint64_t seed, uint32_t threshold, int64_t b, int64_t h,
                                       int64_t i, int64_t j4) {
  uint32_t ctr[4], u[4];
  attn__dropout_counter(ctr, b, h, i, j4);
  attn__philox4x32(u, ctr, seed);
  for (int w = 0; w < 4; w++) keep[w] = u[w] >= threshold;
}

#endif
