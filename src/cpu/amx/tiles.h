/* The one AMX tile configuration every AMX kernel here uses: eight tiles of
 * 16 rows x 64 bytes (palette 1), loaded by a kernel set's begin and released
 * by its end (kernels.h, gemm.h). A tile's K dimension is then 32 bf16, so a
 * step takes 16 pairs. Included by files built with -mamx-tile. */
#ifndef ATTN_CPU_AMX_TILES_H
#define ATTN_CPU_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>

typedef struct attn__amx_config {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} attn__amx_config;

/* Static storage: GCC does not count ldtilecfg as reading its operand, and drops stores to a stack copy. */
static const attn__amx_config attn__amx_every_tile_16x64 __attribute__((aligned(64))) = {
    .palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

static inline void attn__amx_begin(void) { _tile_loadconfig(&attn__amx_every_tile_16x64); }
static inline void attn__amx_end(void) { _tile_release(); }

#endif
