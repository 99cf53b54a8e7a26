/* AMX-BF16 GEMM microkernel: bf16 products summed in fp32 (the contract,
 * attn__bgemm_kernel, is in gemm.h). Compiled with the AVX-512 flags,
 * -mavx512bf16, -mamx-tile and -mamx-bf16; dispatched only where the CPU has
 * AMX and the OS granted the tile state (cpu.c).
 *
 * Tile: MR = 32 rows x NR = 32 columns of C in four 16 x 16 fp32 tiles
 * (tmm0-3); per step of 16 pairs, two A tiles (tmm4, tmm5: rows 0-15 and
 * 16-31, read row by row from the a_rows panel) and two B tiles (tmm6, tmm7:
 * columns 0-15 and 16-31 of the k-major panel, which is already a B tile's
 * layout), each used twice: one tile load per tdpbf16ps.
 * The bias starts the C tiles through a load with stride 0 (one row, sixteen times). */
#include "../gemm.h"

#include "tiles.h"

#include <immintrin.h>
#include <string.h>

#define MR 32
#define NR 32
#define KP_ALIGN 16 /* pairs per tile step */


static void ukr_amx(int64_t kp, const uint16_t *Ap, const uint16_t *Bp, float *C, int64_t ldc, const float *init) {
  const int64_t sc = ldc * 4, sa = kp * 4; /* bytes between rows of C and of A's panel */
  if (init) {
    _tile_loadd(0, init, 0);
    _tile_loadd(1, init + 16, 0);
    _tile_loadd(2, init, 0);
    _tile_loadd(3, init + 16, 0);
  } else {
    _tile_loadd(0, C, sc);
    _tile_loadd(1, C + 16, sc);
    _tile_loadd(2, C + 16 * ldc, sc);
    _tile_loadd(3, C + 16 * ldc + 16, sc);
  }
  const uint16_t *a1 = Ap + 2 * 16 * kp;
  for (int64_t t = 0; t < kp; t += KP_ALIGN) {
    const uint16_t *b = Bp + 2 * t * NR;
    _tile_loadd(4, Ap + 2 * t, sa);
    _tile_loadd(6, b, NR * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + 32, NR * 4);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + 2 * t, sa);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, C, sc);
  _tile_stored(1, C + 16, sc);
  _tile_stored(2, C + 16 * ldc, sc);
  _tile_stored(3, C + 16 * ldc + 16, sc);
}

/* 32 consecutive elements of a row (f32 rounded to nearest even, or bf16) as 32 bf16. */
static inline __m512i load_row32(const void *x, attn_dtype dt) {
  if (dt == ATTN_BF16) return _mm512_loadu_si512(x);
  const float *f = x;
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(f + 16), _mm512_loadu_ps(f));
}

/* MR rows, each its kc steps as bf16 then zeros up to kpp pairs (gemm.h's a_rows). */
static void pack_a_amx(const void *X, attn_dtype dt, int64_t ld, int64_t kc, uint16_t *P) {
  const int64_t kpp = ((kc + 1) / 2 + KP_ALIGN - 1) / KP_ALIGN * KP_ALIGN;
  const size_t es = dt == ATTN_BF16 ? 2 : 4;
  for (int i = 0; i < MR; i++) {
    const char *x = (const char *)X + (size_t)(i * ld) * es;
    uint16_t *p = P + 2 * kpp * i;
    int64_t k = 0;
    for (; k + 32 <= kc; k += 32) _mm512_storeu_si512(p + k, load_row32(x + (size_t)k * es, dt));
    for (; k < kc; k++)
      p[k] = dt == ATTN_BF16 ? ((const uint16_t *)x)[k] : attn__f32_to_bf16(((const float *)x)[k]);
    for (; k < 2 * kpp; k++) p[k] = 0;
  }
}

/* kc = 512 steps (256 pairs): A's micro-panel 32 KiB, B's 32 KiB (L1); mc =
 * 128 rows (the A block 128 KiB, L2), nc = 512 columns. B's packing is the
 * AVX512-BF16 kernel's (the same 32 columns, the same k-major pairs). */
const attn__bgemm_kernel attn__bgemm_kernel_amx = {"amx", MR, NR, 512, 128, 512, ukr_amx, pack_a_amx,
                                                   attn__bgemm_pack_b32_avx512bf16, KP_ALIGN, 1, attn__amx_begin, attn__amx_end};
