/* The KV cache's block formats (q8_0, q4_0; see attn.h's attn_kv_dtype), as
 * the cache and the decode kernels read them: blocks of ATTN__QK values, an
 * f16 scale then the quants. Their storage codes extend attn_dtype past its
 * public values, internally only (the kernels' dtype bits). */
#ifndef ATTN_QUANT_H
#define ATTN_QUANT_H

#include "attn.h"
#include "half.h"

#include <stddef.h>
#include <stdint.h>

#define ATTN__QK 32
#define ATTN__Q8_0 ((attn_dtype)8)
#define ATTN__Q4_0 ((attn_dtype)9)

static inline int attn__is_quant(attn_dtype dt) { return dt == ATTN__Q8_0 || dt == ATTN__Q4_0; }

/* Bytes of one block of ATTN__QK values. */
static inline size_t attn__qblock_bytes(attn_dtype dt) { return dt == ATTN__Q8_0 ? 2 + 32 : 2 + 16; }

/* Bytes of a row of F values of storage dt (float or block). */
static inline size_t attn__row_bytes(attn_dtype dt, int64_t F) {
  if (attn__is_quant(dt)) return (size_t)(F / ATTN__QK) * attn__qblock_bytes(dt);
  return (size_t)F * (dt == ATTN_F32 ? 4u : 2u);
}

/* A block's scale: its first two bytes, an f16 (little-endian, as ggml's; hosts are). */
static inline float attn__qscale(const uint8_t *blk) {
  uint16_t h;
  memcpy(&h, blk, 2);
  return attn__f16_to_f32(h);
}

/* dst (attn__row_bytes(dt, n) bytes) = src (n floats, n a multiple of ATTN__QK) encoded; and back. */
void attn__quantize_row(attn_dtype dt, uint8_t *dst, const float *src, int64_t n);
void attn__dequantize_row(attn_dtype dt, float *dst, const uint8_t *src, int64_t n);

/* A cache's K and V storage (kv_cache.c, for both caches): kinds[0..1] (in:
 * asked, ATTN_KV_AS_DTYPE meaning as_dtype; out: the public kinds resolved)
 * and storage[0..1] (out: their codes), each checked against its head dim
 * dims[0..1] (a block kind needs a multiple of ATTN__QK). Errors name fn. */
attn_status attn__kv_storage(attn_ctx *ctx, const char *fn, attn_kv_dtype kinds[2], attn_dtype as_dtype,
                             const int64_t dims[2], attn_dtype storage[2]);

#endif
