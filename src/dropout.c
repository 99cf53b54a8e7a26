/* Dropout decisions: the public attn_dropout_keep over Philox-4x32-10 (see dropout.h
 * for the counter layout every kernel shares). */
#include "internal.h"
#include "dropout.h"

/* p >= 1 drops every entry (PyTorch's dropout at p = 1 gives zeros); p <= 0 or NaN keeps
 * every entry (the SDPA calls reject p outside [0, 1] before asking). Indices are truncated
 * to 32 bits. */
int attn_dropout_keep(uint64_t seed, double p, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (p >= 1) return 0;
  const uint32_t threshold = attn__dropout_threshold(p);
  if (threshold == 0) return 1;
  uint32_t ctr[4], u[4];
  attn__dropout_counter(ctr, b, h, i, j);
  attn__philox4x32(u, ctr, seed);
  return u[(uint64_t)j & 3] >= threshold;
}
