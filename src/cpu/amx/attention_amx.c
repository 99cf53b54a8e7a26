/* AMX-BF16 tiles for kernels.h's attn__half_kernels (compiled with the
 * AVX-512 flags, -mavx512bf16, -mamx-tile and -mamx-bf16; called only when
 * the CPU has AMX and the OS granted this process the tile state, see
 * cpu.c).
 *
 * One tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 one (the second
 * as 16 rows of bf16 pairs) into 16 x 16 fp32 sums: 16 K of products per
 * instruction against 32 for a vdpbf16ps. Products are exact in fp32, sums
 * fp32 (in an order of the unit's own), bf16 subnormal inputs count as zero.
 * The packed operands (kernels.h) are already the tiles' layouts:
 *   qk: A = Qh, 16 rows of D2 pairs; B = Kh, D2 rows of NR keys' pairs; four
 *       16-key C tiles (tmm0-3) per 64 keys, D / 32 steps.
 *   pv: A = P rounded to bf16, 16 rows of 64 keys (two tiles, tmm4 and tmm7);
 *       B = Vh, pairs of keys by 16 output columns; O, rescaled by alpha on
 *       AVX-512, is loaded as the C tiles, 64 columns at a time.
 * Every tile is configured 16 rows x 64 bytes by begin (once per work item,
 * not per call: ldtilecfg clears the tiles and costs as much as a step), so
 * D must be a multiple of 32 and Dv of 16; other shapes take the AVX512-BF16
 * tiles. The fp32 parts (softmax, the rescale) are the 16-row AVX-512 set's.
 *
 * A tile reads whole rows, so the keys of a block the call must not read
 * (at or past nkeys: past the packed buffer's end, or hidden with NaN/Inf in
 * V) are zeroed in a copy of that block's values, and with `sparse` (P = 0
 * for keys hidden from some rows) a block whose values hold Inf or NaN goes
 * to the vector loop, which skips zero probabilities one row at a time:
 * in a tile they would meet as 0 * Inf = NaN. */
#include "../kernels.h"

#include <immintrin.h>

#define MR 16
#define NR 64
#define NV (NR / 16)
#define CHUNK 64 /* output columns per pass of pv: four C tiles */

typedef struct tile_config {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

/* Static: GCC does not count ldtilecfg as reading its operand, and drops stores to a stack copy. */
static const tile_config every_tile_16x64 __attribute__((aligned(64))) = {
    .palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

static void amx_begin(void) { _tile_loadconfig(&every_tile_16x64); }

static void amx_end(void) { _tile_release(); }

static inline __mmask16 lanes16(int64_t n) {
  return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

static void qk_amx(float *S, const uint16_t *Qh, const uint16_t *Kh, int64_t D2, int64_t nkeys, float scale) {
  const int wide = nkeys > 32; /* the second 32 keys: otherwise zeros */
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t t0 = 0; t0 < D2; t0 += 16) {
    const uint16_t *kb = Kh + 2 * t0 * NR;
    _tile_loadd(4, Qh + 2 * t0, D2 * 4);
    _tile_loadd(5, kb, NR * 4);
    _tile_loadd(6, kb + 32, NR * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    if (wide) {
      _tile_loadd(5, kb + 64, NR * 4);
      _tile_loadd(6, kb + 96, NR * 4);
      _tile_dpbf16ps(2, 4, 5);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, S, NR * 4);
  _tile_stored(1, S + 16, NR * 4);
  _tile_stored(2, S + 32, NR * 4);
  _tile_stored(3, S + 48, NR * 4);
  /* columns past nkeys: finite (0), whatever their keys held */
  const __m512 sv = _mm512_set1_ps(scale);
  for (int v = 0; v < NV; v++) {
    const __mmask16 live = lanes16(nkeys - 16 * v);
    for (int r = 0; r < MR; r++) {
      float *s = S + r * NR + 16 * v;
      _mm512_store_ps(s, _mm512_maskz_mul_ps(live, _mm512_load_ps(s), sv));
    }
  }
}

/* True when any bf16 of pair rows [0, npairs) of a (., ld) pair block, columns [0, cols), is Inf or NaN. */
static int any_nonfinite(const uint32_t *V, int64_t ld, int64_t npairs, int64_t cols) {
  const __m512i e = _mm512_set1_epi16(0x7f80);
  __mmask32 hit = 0;
  for (int64_t j2 = 0; j2 < npairs; j2++)
    for (int64_t c = 0; c < cols; c += 16) {
      const __m512i x = _mm512_maskz_loadu_epi32(lanes16(cols - c), V + j2 * ld + c);
      hit |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(x, e), e);
    }
  return hit != 0;
}

/* O[r][c0 + c] for c < cols, one row at a time on AVX-512, skipping keys whose
 * rounded probability is 0 (their values may be Inf or NaN). */
static void pv_rows(float *O, const uint16_t *pb, const uint32_t *V, int64_t Dv, int64_t nkeys, int64_t cols) {
  for (int r = 0; r < MR; r++)
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 mk = lanes16(cols - c);
      __m512 o = _mm512_maskz_loadu_ps(mk, O + r * Dv + c);
      for (int64_t j = 0; j < nkeys; j++) {
        const uint32_t pbits = (uint32_t)pb[r * NR + j] << 16;
        if ((pbits & 0x7f800000u) == 0) continue; /* 0, or a subnormal the tiles read as 0 */
        float p;
        memcpy(&p, &pbits, sizeof p);
        const __m512i x = _mm512_maskz_loadu_epi32(mk, V + (j / 2) * Dv + c);
        const __m512i w = j & 1 ? _mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)) : _mm512_slli_epi32(x, 16);
        o = _mm512_fmadd_ps(_mm512_set1_ps(p), _mm512_castsi512_ps(w), o);
      }
      _mm512_mask_storeu_ps(O + r * Dv + c, mk, o);
    }
}

static void pv_amx(float *O, const float *alpha, const float *P, const uint16_t *Vh, int64_t Dv, int64_t nkeys,
                   int sparse) {
  /* P as bf16, row-major: the A tiles. Keys past nkeys are 0. */
  uint16_t pb[MR * NR] __attribute__((aligned(64)));
  const uint64_t live = nkeys >= NR ? ~0ull : (1ull << nkeys) - 1;
  for (int r = 0; r < MR; r++)
    for (int v = 0; v < NV; v += 2) {
      const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(P + r * NR + 16 * v + 16),
                                                     _mm512_load_ps(P + r * NR + 16 * v));
      _mm512_store_si512(pb + r * NR + 16 * v, _mm512_maskz_mov_epi16((__mmask32)(live >> (16 * v)), b));
    }
  const int wide = nkeys > 32;
  const int64_t npairs = (nkeys + 1) / 2;
  const uint32_t *V = (const uint32_t *)Vh;
  _tile_loadd(4, pb, NR * 2);
  if (wide) _tile_loadd(7, pb + 32, NR * 2);
  /* alpha is exactly 1 on every row once the running maxima settle: O stays as the tiles left it */
  const int rescale = _mm512_cmp_ps_mask(_mm512_load_ps(alpha), _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0;
  for (int64_t c0 = 0; c0 < Dv; c0 += CHUNK) {
    const int64_t cols = Dv - c0 < CHUNK ? Dv - c0 : CHUNK;
    for (int r = 0; r < MR && rescale; r++) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int64_t c = 0; c < cols; c += 16) {
        float *o = O + r * Dv + c0 + c;
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), a));
      }
    }
    /* the block's values for these columns as the B tiles read them: in place, or a copy without unread keys */
    const uint32_t *src = V + c0;
    int64_t ld = Dv;
    uint32_t vb[NR / 2 * CHUNK] __attribute__((aligned(64)));
    if (sparse && any_nonfinite(src, ld, npairs, cols)) {
      pv_rows(O + c0, pb, src, Dv, nkeys, cols);
      continue;
    }
    if (nkeys < NR) {
      for (int64_t j2 = 0; j2 < NR / 2; j2++)
        for (int64_t c = 0; c < CHUNK; c += 16) {
          __m512i x = _mm512_maskz_loadu_epi32(j2 < npairs ? lanes16(cols - c) : 0, src + j2 * ld + c);
          if (2 * j2 + 1 == nkeys) x = _mm512_and_si512(x, _mm512_set1_epi32(0xffff)); /* the lone key's partner */
          _mm512_store_si512(vb + j2 * CHUNK + c, x);
        }
      src = vb, ld = CHUNK;
    }
    const int64_t bs = ld * 4; /* bytes between pair rows */
    const uint32_t *hi = src + 16 * ld; /* keys 32..63 */
    float *o = O + c0;
    const int nt = (int)(cols / 16);
    /* the four column tiles' products are independent: each 32 keys' step goes over all of them in turn */
    _tile_loadd(0, o, Dv * 4);
    if (nt > 1) _tile_loadd(1, o + 16, Dv * 4);
    if (nt > 2) _tile_loadd(2, o + 32, Dv * 4);
    if (nt > 3) _tile_loadd(3, o + 48, Dv * 4);
    _tile_loadd(5, src, bs);
    _tile_dpbf16ps(0, 4, 5);
    if (nt > 1) { _tile_loadd(6, src + 16, bs); _tile_dpbf16ps(1, 4, 6); }
    if (nt > 2) { _tile_loadd(5, src + 32, bs); _tile_dpbf16ps(2, 4, 5); }
    if (nt > 3) { _tile_loadd(6, src + 48, bs); _tile_dpbf16ps(3, 4, 6); }
    if (wide) {
      _tile_loadd(5, hi, bs);
      _tile_dpbf16ps(0, 7, 5);
      if (nt > 1) { _tile_loadd(6, hi + 16, bs); _tile_dpbf16ps(1, 7, 6); }
      if (nt > 2) { _tile_loadd(5, hi + 32, bs); _tile_dpbf16ps(2, 7, 5); }
      if (nt > 3) { _tile_loadd(6, hi + 48, bs); _tile_dpbf16ps(3, 7, 6); }
    }
    _tile_stored(0, o, Dv * 4);
    if (nt > 1) _tile_stored(1, o + 16, Dv * 4);
    if (nt > 2) _tile_stored(2, o + 32, Dv * 4);
    if (nt > 3) _tile_stored(3, o + 48, Dv * 4);
  }
}

_Static_assert(NR <= ATTN__MAX_NR, "the framework keeps a row of NR keys on the stack");
const attn__half_kernels attn__half_kernels_amx = {"amx", &attn__kernels_avx512_16, MR, NR, 32, 16,
                                                   amx_begin, amx_end, qk_amx, pv_amx};
