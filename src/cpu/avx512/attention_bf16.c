/* AVX512-BF16 tiles for kernels.h's attn__half_kernels (compiled with the
 * AVX-512 flags and -mavx512bf16; called only when the CPU has it).
 *
 * vdpbf16ps multiplies 16 lanes of bf16 pairs and adds both products to fp32
 * lanes: twice the products of an fp32 FMA per instruction, and on Zen 4/5 at
 * the same issue rate. Both products are exact in fp32 (8-bit mantissas), so
 * the only roundings are the fp32 sums', as in PyTorch's bf16 GEMMs. Inputs
 * that are bf16 subnormals count as zero (the instruction's DAZ).
 * The tile is the fp32 set's (MR = 6 rows x NR = 64 keys), whose softmax it shares.
 *   qk: one pass over the 64 keys, 24 accumulators (or 32 keys, 12, for a
 *       short last block); per pair of dims, four loads of Kh and 24
 *       vdpbf16ps with each query pair broadcast once.
 *   pv: P rounded to bf16 pairs once per tile; output columns in chunks of 64,
 *       24 accumulators; per pair of keys, four loads of Vh and 24 vdpbf16ps. */
#include "../kernels.h"
#include "bwd_tiles.h"

#include <immintrin.h>
#include <string.h>

#define MR 6
#define NR 64
#define NV (NR / 16)
#define CW 4 /* zmm of output columns per chunk in pv */

static inline __m512 dot2(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* PW zmm of keys per pass (2 or 4), ROWS (at most MR) rows: ROWS x PW accumulators in registers. */
static inline __attribute__((always_inline)) void qk_pass(float *S, const uint32_t *q, const uint16_t *Kh, int64_t D2,
                                                          int v0, const int PW, const int ROWS, __m512 sv) {
  __m512 a[MR][4];
  for (int r = 0; r < ROWS; r++)
    for (int w = 0; w < PW; w++) a[r][w] = _mm512_setzero_ps();
  for (int64_t t = 0; t < D2; t++) {
    const uint16_t *kr = Kh + 2 * (t * NR + 16 * v0);
    __m512i k[4];
    for (int w = 0; w < PW; w++) k[w] = _mm512_load_si512(kr + 32 * w);
    for (int r = 0; r < ROWS; r++) {
      const __m512i qv = _mm512_set1_epi32((int)q[r * D2 + t]);
      for (int w = 0; w < PW; w++) a[r][w] = dot2(a[r][w], qv, k[w]);
    }
  }
  for (int r = 0; r < ROWS; r++)
    for (int w = 0; w < PW; w++) _mm512_store_ps(S + r * NR + 16 * (v0 + w), _mm512_mul_ps(a[r][w], sv));
}

/* ROWS rows of a tile from row 0 of S and q. */
static inline __attribute__((always_inline)) void qk_rows(float *S, const uint32_t *q, const uint16_t *Kh, int64_t D2,
                                                          int64_t nkeys, const int ROWS, __m512 sv) {
  if (nkeys > 32) { /* one pass over every key: each query pair is broadcast once */
    qk_pass(S, q, Kh, D2, 0, 4, ROWS, sv);
    return;
  }
  qk_pass(S, q, Kh, D2, 0, 2, ROWS, sv);
  for (int r = 0; r < ROWS; r++) /* past the last key: nothing to compute, but finite */
    for (int v = 2; v < NV; v++) _mm512_store_ps(S + r * NR + 16 * v, _mm512_setzero_ps());
}

static void qk_bf16(float *S, const uint16_t *Qh, const uint16_t *Kh, int64_t D2, int64_t nkeys, float scale) {
  qk_rows(S, (const uint32_t *)Qh, Kh, D2, nkeys, MR, _mm512_set1_ps(scale));
}

static inline __mmask16 lanes16(int64_t n) {
  return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* SPARSE: a pair's half whose probability is zero (or a bf16 subnormal, which
 * the instruction reads as zero) takes its V half as 0 too, per row, so a hidden
 * key's Inf or NaN never meets it (0 * Inf would be NaN). */
static inline __attribute__((always_inline)) void pv_bf16_t(float *O, const float *alpha, const float *P,
                                                            const uint16_t *Vh, int64_t Dv, int64_t nkeys,
                                                            const int SPARSE, const int ROWS) {
  /* P as bf16 pairs, row r's pair j2 at pb[r][j2]; a lone last key's partner is 0 */
  uint32_t pb[MR][NR / 2] __attribute__((aligned(64)));
  uint32_t keep[SPARSE ? MR : 1][NR / 2] __attribute__((aligned(64)));
  const int64_t npairs = (nkeys + 1) / 2;
  const uint64_t live = nkeys >= NR ? ~0ull : (1ull << nkeys) - 1; /* bit j: key j is read */
  for (int r = 0; r < ROWS; r++)
    for (int v = 0; v < NV; v += 2) {
      const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(P + r * NR + 16 * v + 16),
                                                     _mm512_load_ps(P + r * NR + 16 * v));
      const __mmask32 in = (__mmask32)(live >> (16 * v)); /* bf16 lanes 16v .. 16v + 31 */
      _mm512_store_si512(&pb[r][8 * v], _mm512_maskz_mov_epi16(in, b));
      if (SPARSE) /* all ones where the exponent is nonzero (normal, Inf or NaN) */
        _mm512_store_si512(&keep[r][8 * v],
                           _mm512_movm_epi16(_mm512_test_epi16_mask(b, _mm512_set1_epi16(0x7f80)) & in));
    }
  /* the lone last key of an odd count: its partner's V half is not to be read */
  const __m512i odd_keep = _mm512_set1_epi32(0x0000ffff);
  for (int64_t c0 = 0; c0 < Dv; c0 += 16 * CW) {
    __mmask16 mk[CW];
    for (int w = 0; w < CW; w++) mk[w] = lanes16(Dv - c0 - 16 * w);
    __m512 o[MR][CW];
    for (int r = 0; r < ROWS; r++) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int w = 0; w < CW; w++) o[r][w] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk[w], O + r * Dv + c0 + 16 * w), a);
    }
    for (int64_t j2 = 0; j2 < npairs; j2++) {
      const uint16_t *vr = Vh + 2 * attn__vh_at(Dv, 1, NR, j2, c0);
      __m512i vv[CW];
      for (int w = 0; w < CW; w++) vv[w] = _mm512_maskz_loadu_epi32(mk[w], vr + 32 * w);
      if (2 * j2 + 1 == nkeys)
        for (int w = 0; w < CW; w++) vv[w] = _mm512_and_si512(vv[w], odd_keep);
      for (int r = 0; r < ROWS; r++) {
        const __m512i p = _mm512_set1_epi32((int)pb[r][j2]);
        if (SPARSE) {
          const __m512i kp = _mm512_set1_epi32((int)keep[r][j2]);
          for (int w = 0; w < CW; w++) o[r][w] = dot2(o[r][w], p, _mm512_and_si512(vv[w], kp));
        } else {
          for (int w = 0; w < CW; w++) o[r][w] = dot2(o[r][w], p, vv[w]);
        }
      }
    }
    for (int r = 0; r < ROWS; r++)
      for (int w = 0; w < CW; w++) _mm512_mask_storeu_ps(O + r * Dv + c0 + 16 * w, mk[w], o[r][w]);
  }
}

_Static_assert(16 * CW == ATTN__PV_COLS, "a chunk of pv's columns is one group of the packed Vh");

static void pv_bf16(float *O, const float *alpha, const float *P, const uint16_t *Vh, int64_t Dv, int64_t nkeys,
                    int sparse) {
  if (sparse) pv_bf16_t(O, alpha, P, Vh, Dv, nkeys, 1, MR);
  else pv_bf16_t(O, alpha, P, Vh, Dv, nkeys, 0, MR);
}

/* kernels.h's pv_blocks: O's columns [c0, c0 + 64) stay in the 24 accumulators through all n blocks, each
 * block's P already bf16 (softmax_round's), each block rescaling them by its alpha (exactly 1 for most:
 * softmax_round lets m trail). Every key's value is multiplied (a hidden key's by P = 0; zeros past the
 * last key), as the contract allows. */
static void pv_blocks_bf16(float *O, int64_t Dv, int64_t c0, int n, const uint16_t *const *Pb,
                           const float *const *alpha, const uint16_t *const *Vh) {
  const int64_t cols = attn__vh_cols(Dv, c0);
  __mmask16 mk[CW];
#pragma GCC unroll 8
  for (int w = 0; w < CW; w++) mk[w] = lanes16(cols - 16 * w);
  __m512 o[MR][CW];
#pragma GCC unroll 8
  for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
    for (int w = 0; w < CW; w++) o[r][w] = _mm512_maskz_loadu_ps(mk[w], O + r * Dv + c0 + 16 * w);
  for (int b = 0; b < n; b++) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) { /* a branch on alpha = 1 cost more: GCC then kept o on the stack */
      const __m512 a = _mm512_set1_ps(alpha[b][r]);
#pragma GCC unroll 8
      for (int w = 0; w < CW; w++) o[r][w] = _mm512_mul_ps(o[r][w], a);
    }
    const uint32_t *pb = (const uint32_t *)Pb[b];
    for (int64_t j2 = 0; j2 < NR / 2; j2++) {
      const uint16_t *vr = Vh[b] + 2 * attn__vh_at(Dv, 1, NR, j2, c0);
      __m512i vv[CW];
#pragma GCC unroll 8
      for (int w = 0; w < CW; w++) vv[w] = _mm512_maskz_loadu_epi32(mk[w], vr + 32 * w);
#pragma GCC unroll 8
      for (int r = 0; r < MR; r++) {
        const __m512i p = _mm512_set1_epi32((int)pb[r * (NR / 2) + j2]);
#pragma GCC unroll 8
        for (int w = 0; w < CW; w++) o[r][w] = dot2(o[r][w], p, vv[w]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
    for (int w = 0; w < CW; w++) _mm512_mask_storeu_ps(O + r * Dv + c0 + 16 * w, mk[w], o[r][w]);
}

/* On tiles6_bf16.c's fp32 set: its softmax writes P rounded to bf16 (softmax_round) for pv_blocks. */
const attn__half_kernels attn__half_kernels_avx512bf16 = {
    "avx512bf16", &attn__kernels_avx512_6p, MR, NR, 1, 1, 1, NULL, NULL, qk_bf16, pv_bf16,
    attn__softmax_round_avx512bf16, pv_blocks_bf16, NULL, NULL, NULL, NULL, NULL, NULL};

/* ---- the backward's set: 16-row tiles (the backward's groups of ATTN__BWD_MAX_ROWS rows take whole
 * tiles, 6-row ones would not), on amx/tiles16.c's fp32 set, which it shares with the AMX tiles, as it
 * shares their bf16 pairs and write-out (bwd_tiles.h). qk and pv run the 6-row code above on rows 0-5,
 * 6-11 and 12-15 of a tile, so each keeps its 24 (or 16) accumulators in registers. */

static void qk_bf16_16(float *S, const uint16_t *Qh, const uint16_t *Kh, int64_t D2, int64_t nkeys, float scale) {
  const uint32_t *q = (const uint32_t *)Qh;
  const __m512 sv = _mm512_set1_ps(scale);
  qk_rows(S, q, Kh, D2, nkeys, 6, sv);
  qk_rows(S + 6 * NR, q + 6 * D2, Kh, D2, nkeys, 6, sv);
  qk_rows(S + 12 * NR, q + 12 * D2, Kh, D2, nkeys, 4, sv);
}

static void pv_bf16_16(float *O, const float *alpha, const float *P, const uint16_t *Vh, int64_t Dv, int64_t nkeys,
                       int sparse) {
  if (sparse) {
    pv_bf16_t(O, alpha, P, Vh, Dv, nkeys, 1, 6);
    pv_bf16_t(O + 6 * Dv, alpha + 6, P + 6 * NR, Vh, Dv, nkeys, 1, 6);
    pv_bf16_t(O + 12 * Dv, alpha + 12, P + 12 * NR, Vh, Dv, nkeys, 1, 4);
  } else {
    pv_bf16_t(O, alpha, P, Vh, Dv, nkeys, 0, 6);
    pv_bf16_t(O + 6 * Dv, alpha + 6, P + 6 * NR, Vh, Dv, nkeys, 0, 6);
    pv_bf16_t(O + 12 * Dv, alpha + 12, P + 12 * NR, Vh, Dv, nkeys, 0, 4);
  }
}

static void pairs_bf16_16(uint32_t *Xp, const float *X) { attn__pairs_16x64(Xp, X, 1); }

/* ROWS rows of OutT from row 0: per pair of the sum's rows, the four 16-key vectors of P's pair row
 * and one broadcast of each OutT row's pair of XT (lane j then adds both rows' products for key j). */
static inline __attribute__((always_inline)) void pt_rows(float *OutT, const uint32_t *Pp, int64_t rows,
                                                          const uint16_t *XT, int64_t ldx, const int ROWS) {
  __m512 a[6][NV];
  for (int c = 0; c < ROWS; c++)
    for (int w = 0; w < NV; w++) a[c][w] = _mm512_load_ps(OutT + c * NR + 16 * w);
  for (int64_t t = 0; t < rows / 2; t++) {
    __m512i p[NV];
    for (int w = 0; w < NV; w++) p[w] = _mm512_load_si512(Pp + t * NR + 16 * w);
    for (int c = 0; c < ROWS; c++) {
      uint32_t x;
      memcpy(&x, XT + c * ldx + 2 * t, sizeof x);
      const __m512i xv = _mm512_set1_epi32((int)x);
      for (int w = 0; w < NV; w++) a[c][w] = dot2(a[c][w], xv, p[w]);
    }
  }
  for (int c = 0; c < ROWS; c++)
    for (int w = 0; w < NV; w++) _mm512_store_ps(OutT + c * NR + 16 * w, a[c][w]);
}

/* kernels.h's pt_acc; C a multiple of 16 (dv_align). */
static void pt_acc_bf16_16(float *OutT, int64_t C, const uint32_t *Pp, int64_t rows, const uint16_t *XT,
                           int64_t ldx) {
  for (int64_t c0 = 0; c0 < C; c0 += 16) {
    pt_rows(OutT + c0 * NR, Pp, rows, XT + c0 * ldx, ldx, 6);
    pt_rows(OutT + (c0 + 6) * NR, Pp, rows, XT + (c0 + 6) * ldx, ldx, 6);
    pt_rows(OutT + (c0 + 12) * NR, Pp, rows, XT + (c0 + 12) * ldx, ldx, 4);
  }
}

const attn__half_kernels attn__half_kernels_avx512bf16_16 = {
    "avx512bf16 16x64", &attn__kernels_avx512_16, 16, NR, 1, 16, 1, NULL, NULL, qk_bf16_16, pv_bf16_16, NULL, NULL,
    pairs_bf16_16, pt_acc_bf16_16, attn__t_out_16x64, NULL, NULL, NULL};
