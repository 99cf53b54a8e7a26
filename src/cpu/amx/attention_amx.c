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
 *   pv: A = P rounded to bf16, 16 rows of 64 keys (two tiles, tmm4 and tmm7,
 *       loaded once a call); B = Vh, pairs of keys by 16 output columns; O,
 *       rescaled by alpha on AVX-512 (rarely: kernels.h's softmax_round lets m
 *       trail), is loaded as the C tiles, 32 columns at a time on tiles 0-1
 *       and 2-3 in turn.
 *   softmax_round (tiles16.c): the 16-row set's softmax on AVX-512 writing P
 *       as bf16 rows for pv's A tiles, the scale folded into its exponent.
 *   pv_blocks: p.v of several such blocks for 64 of O's columns, the sums kept
 *       in C tiles 0-3 from block to block (O loaded and stored once a call).
 * The f16 set (TERMS 2 below) takes the same steps on the split operands:
 * softmax_round writes P rounded to f16 as two bf16 planes, and each product
 * of qk, pv and pv_blocks is four tile products.
 * Every tile is configured 16 rows x 64 bytes by begin (once per work item,
 * not per call: ldtilecfg clears the tiles and costs as much as a step), so
 * q and k come padded to whole steps of 16 pairs (d2_align) and Dv must be a
 * multiple of 16; other Dv are widened to fp32 (vdpbf16ps is slower than
 * fp32 FMAs on these CPUs). The fp32 parts (softmax, the rescale) are the
 * 16-row AVX-512 set's.
 *
 * A tile reads whole rows, so the keys of a block the call must not read
 * (at or past nkeys: past the packed buffer's end, or hidden with NaN/Inf in
 * V) are zeroed in a copy of that block's values, and with `sparse` (P = 0
 * for keys hidden from some rows) a block whose values hold Inf or NaN goes
 * to the vector loop, which skips zero probabilities one row at a time:
 * in a tile they would meet as 0 * Inf = NaN. */
#include "../kernels.h"

#include "tiles.h"
#include "../avx512/split.h"
#include "../avx512/transpose4.h"
#include "../avx512/bwd_tiles.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define MR 16
#define NR 64
#define NV (NR / 16)
#define CHUNK 64 /* output columns per pass of pv: four C tiles */


/* op (a tile load or store) on C tiles 0-3 for nt groups of 16 of O's columns from o, rows so bytes apart */
#define C_TILES(op, o, so, nt)                  \
  do {                                          \
    op(0, (o), (so));                           \
    if ((nt) > 1) op(1, (o) + 16, (so));        \
    if ((nt) > 2) op(2, (o) + 32, (so));        \
    if ((nt) > 3) op(3, (o) + 48, (so));        \
  } while (0)
/* C tiles 0-3 += A tile A . the B tiles of nt groups of 16 columns from v (pair rows bs bytes apart),
 * through B tiles 6 and 7 in turn */
#define PV_B_TILES(A, v, bs, nt)                                            \
  do {                                                                      \
    _tile_loadd(6, (v), (bs));                                              \
    _tile_dpbf16ps(0, A, 6);                                                \
    if ((nt) > 1) { _tile_loadd(7, (v) + 16, (bs)); _tile_dpbf16ps(1, A, 7); } \
    if ((nt) > 2) { _tile_loadd(6, (v) + 32, (bs)); _tile_dpbf16ps(2, A, 6); } \
    if ((nt) > 3) { _tile_loadd(7, (v) + 48, (bs)); _tile_dpbf16ps(3, A, 7); } \
  } while (0)

static inline __mmask16 lanes16(int64_t n) {
  return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* TERMS = 1: bf16 operands. TERMS = 2: f16 ones, each x as hi + lo, two bf16
 * (hi = bf16(x), lo = x - hi: an f16's 11 bits leave at most 3 for lo, so the
 * split is exact), every packed row its hi pairs then its lo pairs; a
 * product is the four exact bf16 products summed in fp32, so the dot
 * products are f16's exact products summed in fp32 (kernels.h's terms). */
static inline __attribute__((always_inline)) void qk_t(float *S, const uint16_t *Qh, const uint16_t *Kh, int64_t D2,
                                                       int64_t nkeys, float scale, const int TERMS) {
  const int wide = nkeys > 32; /* the second 32 keys: otherwise zeros */
  const int64_t sq = TERMS * D2 * 4, sk = TERMS * NR * 4; /* bytes between rows of Qh and of Kh */
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t t0 = 0; t0 < D2; t0 += 16) {
    const uint16_t *kb = Kh + 2 * TERMS * t0 * NR;
    _tile_loadd(4, Qh + 2 * t0, sq);
    if (TERMS == 1) {
      _tile_loadd(5, kb, sk);
      _tile_loadd(6, kb + 32, sk);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      if (wide) {
        _tile_loadd(5, kb + 64, sk);
        _tile_loadd(6, kb + 96, sk);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 6);
      }
    } else {
      /* each B tile of K's hi and lo terms loaded once, for both of q's terms (hi.hi then lo.hi,
       * hi.lo then lo.lo): a C tile's two products in a row wait on each other no longer than
       * products on four tiles in turn, and half the tile loads go */
      _tile_loadd(5, Qh + 2 * (D2 + t0), sq);
#define QK_BOTH(C, B, b)                                                                   \
  _tile_loadd(B, (b), sk);                                                                 \
  _tile_dpbf16ps(C, 4, B);                                                                 \
  _tile_dpbf16ps(C, 5, B);
      for (int term = 0; term < 2; term++) {
        const uint16_t *kt = kb + term * 2 * NR;
        QK_BOTH(0, 6, kt)
        QK_BOTH(1, 7, kt + 32)
        if (wide) {
          QK_BOTH(2, 6, kt + 64)
          QK_BOTH(3, 7, kt + 96)
        }
      }
#undef QK_BOTH
    }
  }
  _tile_stored(0, S, NR * 4);
  _tile_stored(1, S + 16, NR * 4);
  _tile_stored(2, S + 32, NR * 4);
  _tile_stored(3, S + 48, NR * 4);
  /* columns past nkeys: finite (0), whatever their keys held (nothing to do for a whole block unscaled: dO.v) */
  if (scale == 1.0f && nkeys >= NR) return;
  const __m512 sv = _mm512_set1_ps(scale);
  for (int v = 0; v < NV; v++) {
    const __mmask16 live = lanes16(nkeys - 16 * v);
    for (int r = 0; r < MR; r++) {
      float *s = S + r * NR + 16 * v;
      _mm512_store_ps(s, _mm512_maskz_mul_ps(live, _mm512_load_ps(s), sv));
    }
  }
}

static void qk_amx(float *S, const uint16_t *Qh, const uint16_t *Kh, int64_t D2, int64_t nkeys, float scale) {
  qk_t(S, Qh, Kh, D2, nkeys, scale, 1);
}
static void qk_amx_f16(float *S, const uint16_t *Qh, const uint16_t *Kh, int64_t D2, int64_t nkeys, float scale) {
  qk_t(S, Qh, Kh, D2, nkeys, scale, 2);
}

/* Sixteen rows of 16 floats, turned: r[c] gets column c (4 x 4 blocks of 4 x 4 within 128-bit lanes, then
 * the lanes). */
static inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  /* u[4 g + c]: rows 4g..4g+3 of columns c, c + 4, c + 8, c + 12, one per lane */
  for (int g = 0; g < 4; g++) {
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 2]), d = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; c++) {
    const __m512 a = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), b = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 a2 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD), b2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(a, b, 0x88);
    r[c + 8] = _mm512_shuffle_f32x4(a, b, 0xDD);
    r[c + 4] = _mm512_shuffle_f32x4(a2, b2, 0x88);
    r[c + 12] = _mm512_shuffle_f32x4(a2, b2, 0xDD);
  }
}

/* How far ahead of the rows it reads a decode tile asks for more (the decode's vectors: 8 KiB, into L2
 * on Intel). The rows there may be past the block, or the pool's next page elsewhere: a prefetch does
 * not fault. */
#define DEC_AHEAD 8192

/* kernels.h's dec_qk: S^T = K . Q^T, 16 keys at a time, the keys' rows the A tiles where they lie (tile 4)
 * and the packed rows' groups (up to four: 64 rows) the B tiles (5 and 6 in turn) into C tiles 0-3; each
 * 16 x 16 block of S^T is stored, turned on AVX-512 and scaled into S. A last group of fewer than 16
 * keys is taken as the 16 keys that end at nkeys (it recomputes a few), or, under 16 keys in all, from
 * a zeroed copy: a tile reads 16 whole rows. */
static void dec_qk_amx(float *S, const uint16_t *Qp, int rows, const uint16_t *K, int64_t ldk, int nkeys, int64_t D,
                       float scale) {
  const int64_t steps = D / 32;
  const int groups = (rows + 15) / 16;
  float st[4][16 * 16] __attribute__((aligned(64)));
  uint16_t few[16 * ATTN__DEC_TILE_D] __attribute__((aligned(64)));
  const __m512 sv = _mm512_set1_ps(scale);
  for (int g0 = 0; g0 < rows; g0 += 64) { /* more than 64 rows: again for the next 64 */
    const int ng = groups - g0 / 16 < 4 ? groups - g0 / 16 : 4;
    const uint16_t *qp = Qp + (int64_t)(g0 / 16) * steps * 512;
    for (int j0 = 0; j0 < nkeys; j0 += 16) {
      const uint16_t *a = K;
      int64_t lda = ldk, at = j0; /* the first key of the tile */
      if (nkeys < 16) {
        memset(few, 0, sizeof(uint16_t) * 16 * (size_t)D);
        for (int j = 0; j < nkeys; j++) memcpy(few + j * D, K + j * ldk, sizeof(uint16_t) * (size_t)D);
        a = few, lda = D, at = 0;
      } else if (j0 + 16 > nkeys) {
        at = nkeys - 16;
      }
      if (g0 == 0) /* ask for the rows DEC_AHEAD bytes on (as the decode's vectors do; past the block too) */
        for (int j = 0; j < 16; j++)
          for (int64_t c = 0; c < D; c += 32) _mm_prefetch((const char *)(K + (at + j) * ldk + c) + DEC_AHEAD, _MM_HINT_T1);
      _tile_zero(0);
      if (ng > 1) _tile_zero(1);
      if (ng > 2) _tile_zero(2);
      if (ng > 3) _tile_zero(3);
      for (int64_t s = 0; s < steps; s++) {
        _tile_loadd(4, a + at * lda + 32 * s, lda * 2);
        _tile_loadd(5, qp + s * 512, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (ng > 1) { _tile_loadd(6, qp + (steps + s) * 512, 64); _tile_dpbf16ps(1, 4, 6); }
        if (ng > 2) { _tile_loadd(5, qp + (2 * steps + s) * 512, 64); _tile_dpbf16ps(2, 4, 5); }
        if (ng > 3) { _tile_loadd(6, qp + (3 * steps + s) * 512, 64); _tile_dpbf16ps(3, 4, 6); }
      }
      _tile_stored(0, st[0], 64);
      if (ng > 1) _tile_stored(1, st[1], 64);
      if (ng > 2) _tile_stored(2, st[2], 64);
      if (ng > 3) _tile_stored(3, st[3], 64);
      for (int g = 0; g < ng; g++) {
        __m512 r[16];
        for (int k = 0; k < 16; k++) r[k] = _mm512_load_ps(st[g] + 16 * k);
        transpose16(r); /* r[n]: row n's 16 keys */
        const int r0 = g0 + 16 * g, nr = rows - r0 < 16 ? rows - r0 : 16;
        for (int n = 0; n < nr; n++) _mm512_storeu_ps(S + (int64_t)(r0 + n) * ATTN__DEC_NB + at, _mm512_mul_ps(r[n], sv));
      }
    }
  }
}

/* kernels.h's dec_pack_v. Pair row i of 32 keys ks interleaves keys 32 ks + 2i and + 1 with
 * vpunpck[lh]wd, which pair within 128-bit lanes: the low words of group 2z hold columns
 * 32z + 8l + (0..3) of lane l, group 2z + 1 columns 32z + 8l + (4..7); dec_pv puts them back in order. */
static int dec_pack_v_amx(uint16_t *Vp, const uint16_t *V, int64_t ldv, int nkeys, int64_t Dv) {
  const int64_t groups = Dv / 16;
  const __m512i e = _mm512_set1_epi16(0x7f80);
  __mmask32 bad = 0;
  for (int ks = 0; ks * 32 < nkeys; ks++)
    for (int i = 0; i < 16; i++) {
      const int k0 = 32 * ks + 2 * i, k1 = k0 + 1;
      for (int64_t z = 0; z < Dv / 32; z++) {
        if (z % 2 == 0) {
          _mm_prefetch((const char *)(V + k0 * ldv + 32 * z) + DEC_AHEAD, _MM_HINT_T1);
          _mm_prefetch((const char *)(V + k1 * ldv + 32 * z) + DEC_AHEAD, _MM_HINT_T1);
        }
        const __m512i a = k0 < nkeys ? _mm512_loadu_si512(V + k0 * ldv + 32 * z) : _mm512_setzero_si512();
        const __m512i b = k1 < nkeys ? _mm512_loadu_si512(V + k1 * ldv + 32 * z) : _mm512_setzero_si512();
        bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(a, e), e) | _mm512_cmpeq_epi16_mask(_mm512_and_si512(b, e), e);
        _mm512_store_si512(Vp + ((ks * groups + 2 * z) * 16 + i) * 32, _mm512_unpacklo_epi16(a, b));
        _mm512_store_si512(Vp + ((ks * groups + 2 * z + 1) * 16 + i) * 32, _mm512_unpackhi_epi16(a, b));
      }
    }
  return bad != 0;
}

/* kernels.h's dec_pv: per 16 rows, P's three bf16 terms (hi = bf16(P), mid = bf16(P - hi), lo =
 * bf16(P - hi - mid): P to 24 bits) as A tiles 4-6, the packed values' groups through B tile 7 into C
 * tiles 0-3 (64 columns a pass); the sums then go to O in column order, O * alpha + sums. */
static void dec_pv_amx(float *O, const float *alpha, const float *P, int rows, const uint16_t *Vp, int nkeys,
                       int64_t Dv) {
  const int64_t groups = Dv / 16;
  const int steps = (nkeys + 31) / 32;
  uint16_t pa[ATTN__DEC_NB / 32][3][16 * 32] __attribute__((aligned(64)));
  float st[4][16 * 16] __attribute__((aligned(64)));
  const __m512i in_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i in_hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r0 = 0; r0 < rows; r0 += 16) {
    const int nr = rows - r0 < 16 ? rows - r0 : 16;
    for (int ks = 0; ks < steps; ks++)
      for (int n = 0; n < 16; n++) {
        __m512 x[2];
        for (int h = 0; h < 2; h++) {
          const __mmask16 live = n < nr ? lanes16(nkeys - 32 * ks - 16 * h) : 0;
          x[h] = _mm512_maskz_loadu_ps(live, P + (int64_t)(r0 + n) * ATTN__DEC_NB + 32 * ks + 16 * h);
        }
        for (int t = 0; t < 3; t++) {
          const __m512bh b = _mm512_cvtne2ps_pbh(x[1], x[0]);
          _mm512_store_si512(pa[ks][t] + 32 * n, (__m512i)b);
          if (t == 2) break;
          const __m512i w = (__m512i)b; /* x -= the term, exactly */
          x[0] = _mm512_sub_ps(x[0], _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16)));
          x[1] = _mm512_sub_ps(x[1], _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16)));
        }
      }
    for (int64_t g0 = 0; g0 < groups; g0 += 4) { /* Dv a multiple of 32: groups come in pairs */
      const int ng = groups - g0 < 4 ? (int)(groups - g0) : 4;
      _tile_zero(0);
      _tile_zero(1);
      if (ng > 2) {
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int ks = 0; ks < steps; ks++) {
        _tile_loadd(4, pa[ks][0], 64);
        _tile_loadd(5, pa[ks][1], 64);
        _tile_loadd(6, pa[ks][2], 64);
        const uint16_t *vb = Vp + (ks * groups + g0) * 512;
#define PV_GROUP(c)                   \
  _tile_loadd(7, vb + (c) * 512, 64); \
  _tile_dpbf16ps(c, 4, 7);            \
  _tile_dpbf16ps(c, 5, 7);            \
  _tile_dpbf16ps(c, 6, 7)
        PV_GROUP(0);
        PV_GROUP(1);
        if (ng > 2) {
          PV_GROUP(2);
          PV_GROUP(3);
        }
#undef PV_GROUP
      }
      _tile_stored(0, st[0], 64);
      _tile_stored(1, st[1], 64);
      if (ng > 2) {
        _tile_stored(2, st[2], 64);
        _tile_stored(3, st[3], 64);
      }
      for (int n = 0; n < nr; n++) {
        float *o = O + (int64_t)(r0 + n) * Dv + 16 * g0;
        const __m512 a = _mm512_set1_ps(alpha[r0 + n]);
        for (int c = 0; c < ng; c += 2) {
          const __m512 lo = _mm512_load_ps(st[c] + 16 * n), hi = _mm512_load_ps(st[c + 1] + 16 * n);
          float *oc = o + 16 * c;
          _mm512_storeu_ps(oc, _mm512_fmadd_ps(_mm512_loadu_ps(oc), a, _mm512_permutex2var_ps(lo, in_lo, hi)));
          _mm512_storeu_ps(oc + 16, _mm512_fmadd_ps(_mm512_loadu_ps(oc + 16), a, _mm512_permutex2var_ps(lo, in_hi, hi)));
        }
      }
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

/* Key j's values for 16 columns from a pair row (the lower half of each pair: even keys). */
static inline __m512 pair_half(const uint32_t *row, __mmask16 mk, int64_t j) {
  const __m512i x = _mm512_maskz_loadu_epi32(mk, row);
  return _mm512_castsi512_ps(j & 1 ? _mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)) : _mm512_slli_epi32(x, 16));
}

/* O[r][c0 + c] for c < cols, one row at a time on AVX-512, skipping keys whose
 * rounded probability is 0 (their values may be Inf or NaN). pb: the rounded
 * probabilities (TERMS planes of MR x NR bf16, summed); V's rows ld pairs apart,
 * with terms 2 each row's lo pairs cols after its hi ones. */
static void pv_rows(float *O, const uint16_t *pb, const uint32_t *V, int64_t ld, int64_t Dv, int64_t nkeys,
                    int64_t cols, int terms) {
  for (int r = 0; r < MR; r++)
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 mk = lanes16(cols - c);
      __m512 o = _mm512_maskz_loadu_ps(mk, O + r * Dv + c);
      for (int64_t j = 0; j < nkeys; j++) {
        float p = attn__bf16_to_f32(pb[r * NR + j]);
        if (terms == 2) p += attn__bf16_to_f32(pb[MR * NR + r * NR + j]);
        if (!(fabsf(p) >= 0x1p-126f)) continue; /* 0, or a subnormal the tiles read as 0 */
        const uint32_t *row = V + (j / 2) * ld + c;
        __m512 v = pair_half(row, mk, j);
        if (terms == 2) v = _mm512_add_ps(v, pair_half(row + cols, mk, j)); /* hi + lo: exact */
        o = _mm512_fmadd_ps(_mm512_set1_ps(p), v, o);
      }
      _mm512_mask_storeu_ps(O + r * Dv + c, mk, o);
    }
}

/* P rounded as the inputs' type for p.v: bf16 (TERMS 1) or f16 (TERMS 2, as hi + lo bf16 planes). */
static inline __attribute__((always_inline)) void round_p(uint16_t *pb, const float *P, int64_t nkeys, const int TERMS) {
  const uint64_t live = nkeys >= NR ? ~0ull : (1ull << nkeys) - 1;
  for (int r = 0; r < MR; r++)
    for (int v = 0; v < NV; v += 2) {
      __m512 p0 = _mm512_load_ps(P + r * NR + 16 * v), p1 = _mm512_load_ps(P + r * NR + 16 * v + 16);
      if (TERMS == 2) { /* to f16 and back: round to nearest even, as PyTorch rounds P to f16 */
        p0 = through_f16(p0);
        p1 = through_f16(p1);
      }
      const __mmask32 in = (__mmask32)(live >> (16 * v));
      const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
      _mm512_store_si512(pb + r * NR + 16 * v, _mm512_maskz_mov_epi16(in, hi));
      if (TERMS == 2) {
        const __m512i lo = lo_terms(hi, p0, p1);
        _mm512_store_si512(pb + MR * NR + r * NR + 16 * v, _mm512_maskz_mov_epi16(in, lo));
      }
    }
}

/* pv on P already rounded: pb, the A tiles (TERMS planes of MR x NR, row-major), 0 past nkeys. */
static inline __attribute__((always_inline)) void pv_pb(float *O, const float *alpha, const uint16_t *pb,
                                                        const uint16_t *Vh, int64_t Dv, int64_t nkeys, int sparse,
                                                        const int TERMS) {
  const int wide = nkeys > 32;
  const int64_t npairs = (nkeys + 1) / 2;
  const uint32_t *V = (const uint32_t *)Vh;
  /* alpha is exactly 1 on every row once the running maxima settle: O stays as the tiles left it */
  const int rescale = _mm512_cmp_ps_mask(_mm512_load_ps(alpha), _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0;
  if (TERMS == 1) { /* keys 0-31 from tmm4, 32-63 from tmm7, for every chunk */
    _tile_loadd(4, pb, NR * 2);
    if (wide) _tile_loadd(7, pb + 32, NR * 2);
  }
  for (int64_t c0 = 0; c0 < Dv; c0 += CHUNK) {
    const int64_t cols = Dv - c0 < CHUNK ? Dv - c0 : CHUNK;
    for (int r = 0; r < MR && rescale; r++) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int64_t c = 0; c < cols; c += 16) {
        float *o = O + r * Dv + c0 + c;
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), a));
      }
    }
    /* the block's values for these columns as the B tiles read them: in place (kernels.h's group:
     * rows TERMS cols pairs apart, lo cols pairs after hi), or a copy without the keys not to be
     * read (rows CHUNK apart, lo NR / 2 rows after hi) */
    const uint32_t *src = V + attn__vh_at(Dv, TERMS, NR, 0, c0), *src_lo = src + cols;
    int64_t ld = TERMS * cols;
    uint32_t vb[TERMS * NR / 2 * CHUNK] __attribute__((aligned(64)));
    if (sparse && any_nonfinite(src, ld, npairs, cols)) {
      pv_rows(O + c0, pb, src, ld, Dv, nkeys, cols, TERMS);
      continue;
    }
    if (nkeys < NR) {
      for (int term = 0; term < TERMS; term++)
        for (int64_t j2 = 0; j2 < NR / 2; j2++)
          for (int64_t c = 0; c < CHUNK; c += 16) {
            __m512i x = _mm512_maskz_loadu_epi32(j2 < npairs ? lanes16(cols - c) : 0, src + term * cols + j2 * ld + c);
            if (2 * j2 + 1 == nkeys) x = _mm512_and_si512(x, _mm512_set1_epi32(0xffff)); /* the lone key's partner */
            _mm512_store_si512(vb + (term * NR / 2 + j2) * CHUNK + c, x);
          }
      src = vb, src_lo = vb + NR / 2 * CHUNK, ld = CHUNK;
    }
    const int64_t bs = ld * 4; /* bytes between pair rows */
    float *o = O + c0;
    const int nt = (int)(cols / 16);
    if (TERMS == 1) {
      /* columns 0-31 of the chunk in C tiles 0 and 1, 32-63 in 2 and 3: one pair's stores drain while
       * the other's products run (one set of four waited on its own stores: 1.25x slower at Dv 64 and
       * 128 in the lab) */
      const uint32_t *h = src + 16 * ld;
#define PV_HALF(C0, C1, c, two)                                                   \
  _tile_loadd(C0, o + (c), Dv * 4);                                               \
  if (two) _tile_loadd(C1, o + (c) + 16, Dv * 4);                                 \
  _tile_loadd(5, src + (c), bs);                                                  \
  _tile_dpbf16ps(C0, 4, 5);                                                       \
  if (two) { _tile_loadd(6, src + (c) + 16, bs); _tile_dpbf16ps(C1, 4, 6); }       \
  if (wide) {                                                                     \
    _tile_loadd(5, h + (c), bs);                                                  \
    _tile_dpbf16ps(C0, 7, 5);                                                     \
    if (two) { _tile_loadd(6, h + (c) + 16, bs); _tile_dpbf16ps(C1, 7, 6); }       \
  }                                                                               \
  _tile_stored(C0, o + (c), Dv * 4);                                              \
  if (two) _tile_stored(C1, o + (c) + 16, Dv * 4);
      PV_HALF(0, 1, 0, nt > 1)
      if (nt > 2) { PV_HALF(2, 3, 32, nt > 3) }
#undef PV_HALF
      continue;
    }
    C_TILES(_tile_loadd, o, Dv * 4, nt);
    for (int ks = 0; ks < 1 + wide; ks++) { /* 32 keys a step, four passes (hi.hi, hi.lo, lo.hi, lo.lo) */
      const uint32_t *h = src + 16 * ks * ld, *l = src_lo + 16 * ks * ld;
      _tile_loadd(4, pb + 32 * ks, NR * 2);
      _tile_loadd(5, pb + MR * NR + 32 * ks, NR * 2);
      PV_B_TILES(4, h, bs, nt);
      PV_B_TILES(4, l, bs, nt);
      PV_B_TILES(5, h, bs, nt);
      PV_B_TILES(5, l, bs, nt);
    }
    C_TILES(_tile_stored, o, Dv * 4, nt);
  }
}

static inline __attribute__((always_inline)) void pv_t(float *O, const float *alpha, const float *P,
                                                       const uint16_t *Vh, int64_t Dv, int64_t nkeys, int sparse,
                                                       const int TERMS) {
  uint16_t pb[TERMS * MR * NR] __attribute__((aligned(64)));
  round_p(pb, P, nkeys, TERMS);
  pv_pb(O, alpha, pb, Vh, Dv, nkeys, sparse, TERMS);
}

static void pv_amx(float *O, const float *alpha, const float *P, const uint16_t *Vh, int64_t Dv, int64_t nkeys,
                   int sparse) {
  pv_t(O, alpha, P, Vh, Dv, nkeys, sparse, 1);
}
static void pv_amx_f16(float *O, const float *alpha, const float *P, const uint16_t *Vh, int64_t Dv, int64_t nkeys,
                       int sparse) {
  pv_t(O, alpha, P, Vh, Dv, nkeys, sparse, 2);
}
/* pv_blocks' step before block b, for O's columns [0, cols) from o: the first block loads the C
 * tiles; a block whose alpha is not 1 has them stored, O rescaled on AVX-512, and loaded again. */
static inline __attribute__((always_inline)) void c_tiles_before(float *o, int64_t Dv, int64_t cols, int b,
                                                                 const float *alpha) {
  const int nt = (int)(cols / 16);
  const int rescale = _mm512_cmp_ps_mask(_mm512_load_ps(alpha), _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0;
  if (rescale && b > 0) C_TILES(_tile_stored, o, Dv * 4, nt);
  for (int r = 0; r < MR && rescale; r++) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int64_t c = 0; c < cols; c += 16) _mm512_storeu_ps(o + r * Dv + c, _mm512_mul_ps(_mm512_loadu_ps(o + r * Dv + c), a));
  }
  if (rescale || b == 0) C_TILES(_tile_loadd, o, Dv * 4, nt);
}

/* kernels.h's pv_blocks: O's columns [c0, c0 + 64) in C tiles 0-3 through all n blocks (A tiles 4-5
 * the block's P, keys 0-31 and 32-63; B tiles 6-7 its values), stored once at the end, or before a
 * block whose alpha is not 1 (rare: softmax_round lets m trail), whose rescale runs on AVX-512. Each C
 * tile takes its products in pv_pb's order (keys 0-31, then 32-63, block by block), and fp32 goes
 * through memory unchanged, so O is bitwise pv_pb's on each block in turn. Against pv_pb a block at a
 * time: 4 C tiles loaded and stored per call instead of per block (a tile store costs about a
 * tdpbf16ps and does not overlap them). */
static void pv_blocks_amx(float *O, int64_t Dv, int64_t c0, int n, const uint16_t *const *Pb,
                          const float *const *alpha, const uint16_t *const *Vh) {
  const int64_t cols = Dv - c0 < CHUNK ? Dv - c0 : CHUNK, bs = cols * 4;
  const int nt = (int)(cols / 16);
  float *o = O + c0;
  for (int b = 0; b < n; b++) {
    c_tiles_before(o, Dv, cols, b, alpha[b]);
    const uint32_t *v = (const uint32_t *)Vh[b] + attn__vh_at(Dv, 1, NR, 0, c0), *h = v + 16 * cols; /* pair rows 0-15, 16-31 */
    _tile_loadd(4, Pb[b], NR * 2);
    _tile_loadd(5, Pb[b] + 32, NR * 2);
    PV_B_TILES(4, v, bs, nt);
    PV_B_TILES(5, h, bs, nt);
  }
  if (n > 0) C_TILES(_tile_stored, o, Dv * 4, nt);
}

/* pv_blocks for the f16 split: each block's P as its hi and lo planes (softmax_round's two), its values
 * as kernels.h's hi and lo pair rows, pv_pb's four passes per 32 keys (A tiles 4-5 the P planes, B tiles
 * 6-7 the values) on the C tiles that stay from block to block; bitwise pv_pb's on each block in turn. */
static void pv_blocks_amx_f16(float *O, int64_t Dv, int64_t c0, int n, const uint16_t *const *Pb,
                              const float *const *alpha, const uint16_t *const *Vh) {
  const int64_t cols = Dv - c0 < CHUNK ? Dv - c0 : CHUNK, ld = 2 * cols, bs = ld * 4;
  const int nt = (int)(cols / 16);
  float *o = O + c0;
  for (int b = 0; b < n; b++) {
    c_tiles_before(o, Dv, cols, b, alpha[b]);
    const uint32_t *src = (const uint32_t *)Vh[b] + attn__vh_at(Dv, 2, NR, 0, c0);
    for (int ks = 0; ks < 2; ks++) {
      const uint32_t *h = src + 16 * ks * ld, *l = h + cols;
      _tile_loadd(4, Pb[b] + 32 * ks, NR * 2);
      _tile_loadd(5, Pb[b] + MR * NR + 32 * ks, NR * 2);
      PV_B_TILES(4, h, bs, nt);
      PV_B_TILES(4, l, bs, nt);
      PV_B_TILES(5, h, bs, nt);
      PV_B_TILES(5, l, bs, nt);
    }
  }
  if (n > 0) C_TILES(_tile_stored, o, Dv * 4, nt);
}

_Static_assert(CHUNK == ATTN__PV_COLS, "pv_blocks takes kernels.h's column groups");
_Static_assert(NR <= ATTN__MAX_NR, "the framework keeps a row of NR keys on the stack");
/* The backward's transposed products (kernels.h's pairs and pt_acc): OutT (C, NR) +=
 * XT (C, rows) . bf16(P) (rows, NR). pairs turns a tile of P into the B tiles' rows, bf16
 * pairs of rows (2t, 2t + 1), one vpermw a 16-key group, as the tile is made (on AVX-512,
 * beside the rest of its vector work: a 128-row pt_acc that converted its own P took 1.2 us
 * in the lab against 0.55 for its tiles and 0.27 for the conversion apart); XT's rows are
 * already the A tiles' (32 rows of the sum per step). OutT is the C tiles, 32 rows by 32
 * keys at a time (pt_acc_amx). */
static void pairs_amx(uint32_t *Xp, const float *X) { attn__pairs_16x64(Xp, X, 1); }
static void pairs_amx_f16(uint32_t *Xp, const float *X) { attn__pairs_16x64(Xp, X, 2); }

static inline __attribute__((always_inline)) void pt_acc_t(float *OutT, int64_t C, const uint32_t *pp, int64_t rows,
                                                           const uint16_t *XT, int64_t ldx, const int TERMS) {
  const int64_t steps = rows / 32, sa = ldx * 2, so = NR * 4;
  const uint32_t *pl = pp + ATTN__BWD_MAX_ROWS / 2 * NR; /* TERMS 2: the lo planes */
  const uint16_t *xl = XT + C * ldx;
  /* 2 x 2: 32 rows of OutT by 32 keys in C tiles 0-3, A tiles 4-5 (the rows), B tiles 6-7 (the keys):
   * four loads for four products (TERMS 2: ten for sixteen, every pair of terms) */
  for (int64_t c0 = 0; c0 < C; c0 += 32)
    for (int kb = 0; kb < NV; kb += 2) {
      const int two = C - c0 >= 32;
      float *o = OutT + c0 * NR + 16 * kb;
      const uint16_t *a = XT + c0 * ldx, *al = xl + c0 * ldx;
      _tile_loadd(0, o, so);
      _tile_loadd(1, o + 16, so);
      if (two) { _tile_loadd(2, o + 16 * NR, so); _tile_loadd(3, o + 16 * NR + 16, so); }
      for (int64_t s = 0; s < steps; s++) {
        const int64_t bo = 16 * s * NR + 16 * kb;
        if (TERMS == 1) {
          _tile_loadd(6, pp + bo, so);
          _tile_loadd(4, a + 32 * s, sa);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, pp + bo + 16, so);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, a + 16 * ldx + 32 * s, sa);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          continue;
        }
#define PT_A(x) _tile_loadd(4, (x) + 32 * s, sa); if (two) _tile_loadd(5, (x) + 16 * ldx + 32 * s, sa);
#define PT_B(b) _tile_loadd(6, (b) + bo, so); _tile_loadd(7, (b) + bo + 16, so);
#define PT_DP                                                         \
  _tile_dpbf16ps(0, 4, 6);                                            \
  _tile_dpbf16ps(1, 4, 7);                                            \
  if (two) { _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
        PT_A(a) PT_B(pp) PT_DP  /* hi . hi */
        PT_B(pl) PT_DP          /* hi . lo */
        PT_A(al) PT_DP          /* lo . lo */
        PT_B(pp) PT_DP          /* lo . hi */
#undef PT_A
#undef PT_B
#undef PT_DP
      }
      _tile_stored(0, o, so);
      _tile_stored(1, o + 16, so);
      if (two) { _tile_stored(2, o + 16 * NR, so); _tile_stored(3, o + 16 * NR + 16, so); }
    }
}

static void pt_acc_amx(float *OutT, int64_t C, const uint32_t *pp, int64_t rows, const uint16_t *XT, int64_t ldx) {
  pt_acc_t(OutT, C, pp, rows, XT, ldx, 1);
}
static void pt_acc_amx_f16(float *OutT, int64_t C, const uint32_t *pp, int64_t rows, const uint16_t *XT, int64_t ldx) {
  pt_acc_t(OutT, C, pp, rows, XT, ldx, 2);
}

const attn__half_kernels attn__half_kernels_amx = {"amx", &attn__kernels_avx512_16, MR, NR, 16, 16, 1,
                                                   attn__amx_begin, attn__amx_end, qk_amx, pv_amx, attn__softmax_round_amx16,
                                                   pv_blocks_amx, pairs_amx, pt_acc_amx, attn__t_out_16x64, dec_qk_amx,
                                                   dec_pack_v_amx, dec_pv_amx};
const attn__half_kernels attn__half_kernels_amx_f16 = {"amx f16 split", &attn__kernels_avx512_16, MR, NR, 16, 16, 2,
                                                       attn__amx_begin, attn__amx_end, qk_amx_f16, pv_amx_f16,
                                                       attn__softmax_round_amx16_f16, pv_blocks_amx_f16,
                                                       pairs_amx_f16, pt_acc_amx_f16, attn__t_out_16x64, NULL, NULL, NULL};
