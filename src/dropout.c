/* Dropout decisions: the public attn_dropout_keep over Philox-4x32-10 (see dropout.h
 * for the counter layout every kernel shares). */
#include "internal.h"
#include "dropout.h"

/* p outside [0, 1) or NaN keeps every entry (the SDPA calls reject such p before
 * asking); p = 0 keeps every entry. Indices are truncated to 32 bits. */
int attn_dropout_keep(uint64_t seed, double p, int64_t b, int64_t h, int64_t i, int64_t j) {
  const uint32_t threshold = attn__dropout_threshold(p);
  if (threshold == 0) return 1;
  uint32_t ctr[4], u[4];
  attn__dropout_counter(ctr, b, h, i, j);
  attn__philox4x32(u, ctr, seed);
  return u[(uint64_t)j & 3] >= threshold;
}
