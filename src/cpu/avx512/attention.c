/* AVX-512 microkernels for the contract in kernels.h (compiled with
 * -mavx512f -mavx512dq -mavx512bw -mavx512vl; called only when the CPU has them).
 *
 * Tile: MR = 6 query rows x NR = 64 keys (four zmm per row), the best of
 * 12x32, 12x64, 12x96, 8x64, 6x64 and 4x64 measured at D = 64 and 128.
 *   qk: in passes of 32 keys, 12 zmm accumulators; per d, two loads of Kt and
 *       12 FMAs with the query element broadcast from memory.
 *   pv: output columns in chunks of 64 (masked at the tail), 24 accumulators,
 *       so O is loaded and rescaled once per 64 keys; per key, four loads of V
 *       and 24 FMAs with P broadcast from memory.
 *   softmax: row statistics kept in vector lanes (sixteen horizontal
 *       reductions in one shuffle tree), and a vectorised exp (degree-6
 *       polynomial for 2^f, vscalefps for 2^n: about 1 ulp, exact 0 for
 *       -inf, NaN kept). */
#include "../kernels.h"
#include "vec.h"
#ifdef ATTN_TILE_P_ROUNDED_TO_BF16
#include "split.h"
#endif

#include <immintrin.h>
#include <math.h>

#ifndef MR
#define MR 6
#endif
#ifndef NR
#define NR 64
#endif
/* amx/tiles16.c builds this file again as the 16-row set under the AMX tiles
 * (ATTN_TILE_SET and its name). The decode microkernels are in decode.c. */
#ifndef ATTN_TILE_SET
#define ATTN_TILE_SET attn__kernels_avx512
#define ATTN_TILE_SET_NAME "avx512"
#endif
#define NV (NR / 16) /* zmm per row of a tile */
#if MR > 16 || NR % 32
#error "row statistics sit in the lanes of one zmm; qk works in passes of 32 keys"
#endif
#define PW (MR <= 6 ? 4 : MR <= 12 ? 2 : 1) /* zmm of X per row that pt_acc keeps in registers */
#ifndef CW
#define CW 4 /* zmm per chunk of output columns in pv */
#endif

#if defined(ATTN_TILE_P_ROUNDED_TO_BF16) && !defined(ATTN_TILE_FULL_EXP)
/* e^(scale x - m), m_l2e = m log2 e, for probabilities that are rounded to
 * bf16 (2^-9) before p.v (the AMX tiles' set): 9 vector operations, not 11. The
 * argument is one FMA (relative error up to |m| 2^-23 in the result: 1e-5 at
 * |m| = 100), 2^f on f in [0, 1) a degree-5 minimax polynomial (1e-7: a degree-4
 * one, 2.7e-6, turned enough roundings of P to bf16 the other way to fail
 * test_half's check of the rounding policy), and vscalefps takes floor(t)
 * itself. Zeros and NaN as exp512's. */
static inline __m512 exp_minus(__m512 x, __m512 m, __m512 m_l2e, float scale) {
  (void)m;
  const __m512 t = _mm512_fmsub_ps(x, _mm512_set1_ps(scale * 1.44269504088896341f), m_l2e);
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ); /* NaN too */
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); /* t - floor(t) */
  __m512 p = _mm512_set1_ps(0.0018775766948238015f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.008989340625703335f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05582631751894951f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24015361070632935f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931530833244324f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999999403953552f));
  return _mm512_maskz_scalef_ps(normal, p, t);
}
#else
/* Where the scale is deferred to the softmax (softmax_round) it is not 1; elsewhere x - m as one rounding. */
static inline __m512 exp_minus(__m512 x, __m512 m, __m512 m_l2e, float scale) {
  (void)m_l2e;
  return exp512(_mm512_fmsub_ps(x, _mm512_set1_ps(scale), m));
}
#endif

/* In passes of 32 keys: 24 accumulators stay in registers whatever NR is. */
static void qk_avx512(float *S, const float *Q, const float *Kt, int64_t D, int64_t nkeys) {
  for (int v0 = 0; v0 < NV; v0 += 2) {
    if (16 * v0 >= nkeys) { /* past the last key: nothing to compute, but finite */
      for (int r = 0; r < MR; r++)
        for (int v = v0; v < v0 + 2; v++) _mm512_store_ps(S + r * NR + 16 * v, _mm512_setzero_ps());
      continue;
    }
    __m512 a[MR][2];
    for (int r = 0; r < MR; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
      const __m512 k0 = _mm512_load_ps(Kt + d * NR + 16 * v0), k1 = _mm512_load_ps(Kt + d * NR + 16 * v0 + 16);
      for (int r = 0; r < MR; r++) {
        const __m512 qv = _mm512_set1_ps(Q[r * D + d]);
        a[r][0] = _mm512_fmadd_ps(qv, k0, a[r][0]);
        a[r][1] = _mm512_fmadd_ps(qv, k1, a[r][1]);
      }
    }
    for (int r = 0; r < MR; r++) {
      _mm512_store_ps(S + r * NR + 16 * v0, a[r][0]);
      _mm512_store_ps(S + r * NR + 16 * v0 + 16, a[r][1]);
    }
  }
}

#define LAZY_MAX 8.0f
#define LAZY_MAX_EXP 2980.9579870417283f /* e^LAZY_MAX */
#ifdef ATTN_TILE_P_ROUNDED_TO_BF16
/* Row r of P as pv_blocks' A tiles read it: rounded to bf16 (TERMS 1), or to f16 and then split into
 * bf16 hi and lo planes, the lo plane MR x NR after the hi one (TERMS 2: kernels.h's split). */
static inline __attribute__((always_inline)) void store_p_row(uint16_t *Pb, int r, const __m512 *p, const int TERMS) {
  for (int v = 0; v < NV; v += 2) {
    __m512 p0 = p[v], p1 = p[v + 1];
    if (TERMS == 2) p0 = through_f16(p0), p1 = through_f16(p1);
    const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
    _mm512_store_si512(Pb + r * NR + 16 * v, hi);
    if (TERMS == 2) _mm512_store_si512(Pb + MR * NR + r * NR + 16 * v, lo_terms(hi, p0, p1));
  }
}

/* softmax_t's step with Pb in one pass over S, for the common tile: every row's m is finite and stays
 * where it is, P = exp(scale x - m) made without first finding the tile's maximum. The row's sum says
 * whether that was right: at most e^LAZY_MAX, no P passed it (and none was NaN). Returns 0, having
 * written only Pb, when some row's sum is more; the two passes then run on the same formula, and move
 * m where the tile's maximum passed it by more than LAZY_MAX. */
static inline __attribute__((always_inline)) int softmax_one_pass(const float *S, float *m, float *l, float *alpha,
                                                                  float scale, uint16_t *Pb, const int TERMS) {
  const __mmask16 rows = (__mmask16)((1u << MR) - 1);
  const __m512 mold = _mm512_load_ps(m);
  if (_mm512_fpclass_ps_mask(mold, 0x99) & rows) return 0; /* NaN or +-inf */
  float shl[16];
  _mm512_storeu_ps(shl, _mm512_mul_ps(mold, _mm512_set1_ps(1.44269504088896341f)));
  __m512 sums[16];
  for (int r = MR; r < 16; r++) sums[SLOT(r)] = _mm512_setzero_ps();
  for (int r = 0; r < MR; r++) {
    const float *s = S + r * NR;
    const __m512 mv = _mm512_set1_ps(m[r]), mvl = _mm512_set1_ps(shl[r]); /* row r's m: exp_minus takes either */
    __m512 sum = _mm512_setzero_ps(), p[NV];
    for (int v = 0; v < NV; v++) {
      p[v] = exp_minus(_mm512_load_ps(s + 16 * v), mv, mvl, scale);
      sum = _mm512_add_ps(sum, p[v]);
    }
    store_p_row(Pb, r, p, TERMS);
    sums[SLOT(r)] = sum;
  }
  const __m512 tile_sum = reduce16_add(sums);
  if ((_mm512_cmp_ps_mask(tile_sum, _mm512_set1_ps(LAZY_MAX_EXP), _CMP_LE_OQ) & rows) != rows) return 0;
  _mm512_store_ps(l, _mm512_add_ps(_mm512_load_ps(l), tile_sum));
  _mm512_store_ps(alpha, _mm512_set1_ps(1.0f));
  return 1;
}
#endif

/* Row statistics live in lanes: row r of the tile is lane r of m, l, alpha.
 * The step on scale * S (scale > 0, so the raw maximum scales to the scaled
 * one); P goes to S, or with Pb (the AMX sets and the AVX512-BF16 forward's) straight into Pb's
 * rows of NR as pv's A tiles read them (store_p_row: bf16, or f16's two planes). */
static inline __attribute__((always_inline)) void softmax_t(float *S, float *m, float *l, float *alpha, float scale,
                                                            uint16_t *Pb, const int TERMS) {
#ifdef ATTN_TILE_P_ROUNDED_TO_BF16
  if (Pb && softmax_one_pass(S, m, l, alpha, scale, Pb, TERMS)) return;
#endif
  __m512 part[16];
  for (int r = MR; r < 16; r++) part[SLOT(r)] = _mm512_set1_ps(-INFINITY);
  for (int r = 0; r < MR; r++) {
    __m512 mx = _mm512_load_ps(S + r * NR);
    for (int v = 1; v < NV; v++) mx = _mm512_max_ps(mx, _mm512_load_ps(S + r * NR + 16 * v));
    part[SLOT(r)] = mx;
  }
  const __m512 mold = _mm512_load_ps(m), tile_max = _mm512_mul_ps(reduce16_max(part), _mm512_set1_ps(scale));
  __m512 mnew = _mm512_max_ps(mold, tile_max);
  /* NaN wins: max skips it, and a row with nothing else visible would lose it */
  mnew = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mold, mold, _CMP_UNORD_Q), mnew, mold);
#ifdef ATTN_TILE_P_ROUNDED_TO_BF16
  /* With Pb, m stays put while the tile's maximum is within LAZY_MAX of it (P is then at most e^LAZY_MAX,
   * which fp32 sums and bf16 hold as well as 1): alpha is then exactly 1, and p.v skips rescaling O,
   * which it otherwise did for most key blocks of a row's first thousand keys. */
  if (Pb) mnew = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(tile_max, _mm512_add_ps(mold, _mm512_set1_ps(LAZY_MAX)),
                                                         _CMP_LE_OQ), mnew, mold);
#endif
  __mmask16 empty = _mm512_cmp_ps_mask(mnew, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
  for (int r = 0; r < MR; r++)
    if ((empty >> r) & 1)
      for (int v = 0; v < NV; v++) {
        const __m512 x = _mm512_load_ps(S + r * NR + 16 * v);
        if (_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q)) {
          mnew = _mm512_mask_blend_ps((__mmask16)(1u << r), mnew, _mm512_set1_ps(NAN));
          empty &= (__mmask16) ~(1u << r);
        }
      }
  /* rows without a visible key yet: shift by 0, so exp(-inf - 0) = 0 rather than NaN */
  const __m512 shift = _mm512_mask_blend_ps(empty, mnew, _mm512_setzero_ps());
  const __m512 a = _mm512_mask_blend_ps(empty, exp512(_mm512_sub_ps(mold, mnew)), _mm512_set1_ps(1.0f));
  float sh[16], shl[16];
  _mm512_storeu_ps(sh, shift);
  _mm512_storeu_ps(shl, _mm512_mul_ps(shift, _mm512_set1_ps(1.44269504088896341f)));
  __m512 sums[16];
  for (int r = MR; r < 16; r++) sums[SLOT(r)] = _mm512_setzero_ps();
  for (int r = 0; r < MR; r++) {
    float *s = S + r * NR;
    const __m512 mv = _mm512_set1_ps(sh[r]), mvl = _mm512_set1_ps(shl[r]);
    __m512 sum = _mm512_setzero_ps(), p[NV];
    for (int v = 0; v < NV; v++) {
      p[v] = exp_minus(_mm512_load_ps(s + 16 * v), mv, mvl, scale);
      if (!Pb) _mm512_store_ps(s + 16 * v, p[v]);
      sum = _mm512_add_ps(sum, p[v]);
    }
#ifdef ATTN_TILE_P_ROUNDED_TO_BF16
    if (Pb) store_p_row(Pb, r, p, TERMS);
#endif
    sums[SLOT(r)] = sum;
  }
  _mm512_store_ps(l, _mm512_fmadd_ps(_mm512_load_ps(l), a, reduce16_add(sums)));
  _mm512_store_ps(alpha, a);
  _mm512_store_ps(m, _mm512_mask_blend_ps(empty, mnew, mold));
}

static void softmax_avx512(float *S, float *m, float *l, float *alpha) { softmax_t(S, m, l, alpha, 1.0f, NULL, 1); }

#ifdef ATTN_TILE_P_ROUNDED_TO_BF16
void ATTN_SOFTMAX_ROUND(uint16_t *Pb, float *S, float scale, float *m, float *l, float *alpha) {
  softmax_t(S, m, l, alpha, scale, Pb, 1);
}
#ifdef ATTN_SOFTMAX_ROUND_F16
void ATTN_SOFTMAX_ROUND_F16(uint16_t *Pb, float *S, float scale, float *m, float *l, float *alpha) {
  softmax_t(S, m, l, alpha, scale, Pb, 2);
}
#endif
#endif

/* Columns [c0, c0 + 16 W) of O, W zmm (the last one masked at Dv), one function for each W. The loops
 * over rows and zmm are unrolled by pragma: without it GCC kept the accumulators on the stack as well and
 * stored them on every key. SPARSE: a zero P adds nothing (its V row may be a hidden key's Inf); the
 * masked FMA costs one compare per row and key, paid only by tiles with hidden keys. */
#define EACH_W(W) _Pragma("GCC unroll 4") for (int w = 0; w < (W); w++)
#define EACH_ROW _Pragma("GCC unroll 16") for (int r = 0; r < MR; r++)
#define PV_COLS(W)                                                                                       \
  static inline __attribute__((always_inline)) void pv_cols_##W##_t(                                     \
      float *O, const float *alpha, const float *P, const float *V, int64_t ldv, int64_t Dv,             \
      int64_t nkeys, int64_t c0, const int SPARSE) {                                                     \
    __mmask16 mk[W];                                                                                     \
    EACH_W(W) mk[w] = lanes16(Dv - c0 - 16 * w);                                                         \
    __m512 o[MR][W];                                                                                     \
    EACH_ROW {                                                                                           \
      const __m512 a = _mm512_set1_ps(alpha[r]);                                                         \
      EACH_W(W) o[r][w] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk[w], O + r * Dv + c0 + 16 * w), a);      \
    }                                                                                                    \
    for (int64_t j = 0; j < nkeys; j++) {                                                                \
      const float *vr = V + j * ldv + c0;                                                                \
      __m512 vv[W];                                                                                      \
      EACH_W(W) vv[w] = _mm512_maskz_loadu_ps(mk[w], vr + 16 * w);                                       \
      EACH_ROW {                                                                                         \
        const __m512 p = _mm512_set1_ps(P[r * NR + j]);                                                  \
        if (SPARSE) { /* NaN counts as nonzero: it propagates */                                         \
          const __mmask16 nz = _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_NEQ_UQ);                  \
          EACH_W(W) o[r][w] = _mm512_mask3_fmadd_ps(p, vv[w], o[r][w], nz);                              \
        } else {                                                                                         \
          EACH_W(W) o[r][w] = _mm512_fmadd_ps(p, vv[w], o[r][w]);                                        \
        }                                                                                                \
      }                                                                                                  \
    }                                                                                                    \
    EACH_ROW EACH_W(W) _mm512_mask_storeu_ps(O + r * Dv + c0 + 16 * w, mk[w], o[r][w]);                  \
  }                                                                                                      \
  static void pv_cols_##W(float *O, const float *alpha, const float *P, const float *V, int64_t ldv,     \
                          int64_t Dv, int64_t nkeys, int64_t c0, int sparse) {                           \
    if (sparse) pv_cols_##W##_t(O, alpha, P, V, ldv, Dv, nkeys, c0, 1);                                  \
    else pv_cols_##W##_t(O, alpha, P, V, ldv, Dv, nkeys, c0, 0);                                         \
  }
PV_COLS(1)
#if CW >= 2
PV_COLS(2)
#endif
#if CW >= 3
PV_COLS(3)
#endif
#if CW >= 4
PV_COLS(4)
#endif
typedef void (*pv_fn)(float *, const float *, const float *, const float *, int64_t, int64_t, int64_t, int64_t, int);
static const pv_fn pv_width[] = {NULL, pv_cols_1,
#if CW >= 2
                                 pv_cols_2,
#endif
#if CW >= 3
                                 pv_cols_3,
#endif
#if CW >= 4
                                 pv_cols_4,
#endif
};
_Static_assert(sizeof pv_width / sizeof pv_width[0] == CW + 1, "a function for each width up to CW (at most 4)");

/* Chunks of CW zmm of columns, then one of as many zmm as the rest of Dv needs: a Dv of 32, 80 or 96 runs
 * no FMA on columns past it (one chunk of 4 did: half of D 32's p.v, 3 of 8 zmm at D 80). Each column's
 * sum is the same whatever its chunk, so results do not change. */
static void pv_avx512(float *O, const float *alpha, const float *P, const float *V, int64_t ldv, int64_t Dv,
                      int64_t nkeys, int sparse) {
  int64_t c0 = 0;
  for (; c0 + 16 * CW <= Dv; c0 += 16 * CW) pv_width[CW](O, alpha, P, V, ldv, Dv, nkeys, c0, sparse);
  if (c0 < Dv) pv_width[(Dv - c0 + 15) / 16](O, alpha, P, V, ldv, Dv, nkeys, c0, sparse);
}

static void exp_shift_avx512(float *S, const float *shift) {
  for (int r = 0; r < MR; r++) {
    float *s = S + r * NR;
    if (shift[r] == -INFINITY) {
      for (int v = 0; v < NV; v++) _mm512_store_ps(s + 16 * v, _mm512_setzero_ps());
      continue;
    }
    /* the softmax's exponential: under AMX's tiles P and dS are rounded to bf16 next */
    const __m512 mv = _mm512_set1_ps(shift[r]), mvl = _mm512_set1_ps(shift[r] * 1.44269504088896341f);
    for (int v = 0; v < NV; v++) _mm512_store_ps(s + 16 * v, exp_minus(_mm512_load_ps(s + 16 * v), mv, mvl, 1.0f));
  }
}

static void ds_avx512(const float *P, float *dP, const float *Dd) {
  for (int r = 0; r < MR; r++) {
    const __m512 dd = _mm512_set1_ps(Dd[r]);
    for (int v = 0; v < NV; v++) {
      const __m512 pv = _mm512_load_ps(P + r * NR + 16 * v);
      const __m512 d = _mm512_mul_ps(pv, _mm512_sub_ps(_mm512_load_ps(dP + r * NR + 16 * v), dd));
      _mm512_store_ps(dP + r * NR + 16 * v, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(pv, _mm512_setzero_ps(), _CMP_NEQ_UQ), d));
    }
  }
}

/* Columns [c0, c0 + 16 W) of Out: the MR rows of X for them stay in registers while every key row of Out
 * streams past. One function for each W, unrolled as p.v's, so that a C of 32 or 80 runs no FMA past C. */
#define PT_ACC_COLS(W)                                                                                   \
  static void pt_acc_cols_##W(float *Out, int64_t ldo, const float *P, const float *X, int64_t ldx,      \
                              int64_t C, int64_t c0) {                                                   \
    __mmask16 mk[W];                                                                                     \
    EACH_W(W) mk[w] = lanes16(C - c0 - 16 * w);                                                          \
    __m512 x[MR][W];                                                                                     \
    EACH_ROW EACH_W(W) x[r][w] = _mm512_maskz_loadu_ps(mk[w], X + r * ldx + c0 + 16 * w);                \
    for (int j = 0; j < NR; j++) {                                                                       \
      float *o = Out + j * ldo + c0;                                                                     \
      __m512 acc[W];                                                                                     \
      EACH_W(W) acc[w] = _mm512_maskz_loadu_ps(mk[w], o + 16 * w);                                       \
      EACH_ROW {                                                                                         \
        const __m512 pv = _mm512_set1_ps(P[r * NR + j]);                                                 \
        EACH_W(W) acc[w] = _mm512_fmadd_ps(pv, x[r][w], acc[w]);                                         \
      }                                                                                                  \
      EACH_W(W) _mm512_mask_storeu_ps(o + 16 * w, mk[w], acc[w]);                                        \
    }                                                                                                    \
  }
PT_ACC_COLS(1)
#if PW >= 2
PT_ACC_COLS(2)
#endif
#if PW >= 3
PT_ACC_COLS(3)
#endif
#if PW >= 4
PT_ACC_COLS(4)
#endif
typedef void (*pt_acc_fn)(float *, int64_t, const float *, const float *, int64_t, int64_t, int64_t);
static const pt_acc_fn pt_acc_width[] = {NULL, pt_acc_cols_1,
#if PW >= 2
                                         pt_acc_cols_2,
#endif
#if PW >= 3
                                         pt_acc_cols_3,
#endif
#if PW >= 4
                                         pt_acc_cols_4,
#endif
};
_Static_assert(sizeof pt_acc_width / sizeof pt_acc_width[0] == PW + 1, "a function for each width up to PW");

static void pt_acc_avx512(float *Out, int64_t ldo, const float *P, const float *X, int64_t ldx, int64_t C) {
  int64_t c0 = 0;
  for (; c0 + 16 * PW <= C; c0 += 16 * PW) pt_acc_width[PW](Out, ldo, P, X, ldx, C, c0);
  if (c0 < C) pt_acc_width[(C - c0 + 15) / 16](Out, ldo, P, X, ldx, C, c0);
}

/* r[i][c] becomes r[c][i]: pairs of rows interleaved by 32-bit, then 64-bit lanes, then 128-bit quarters twice. */
static void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  for (int i = 0; i < 16; i += 4)
    for (int k = 0; k < 2; k++) {
      const __m512d a = _mm512_castps_pd(t[i + k]), b = _mm512_castps_pd(t[i + k + 2]);
      r[i + 2 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[i + 2 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  /* lanes 4q..4q+3 of r[i] now hold column c = i % 4 + 4 q' of rows 4 (i / 4) .. + 3 (q' = the lane's quarter) */
  for (int h = 0; h < 2; h++)
    for (int k = 0; k < 4; k++) {
      t[8 * h + k] = _mm512_shuffle_f32x4(r[8 * h + k], r[8 * h + 4 + k], 0x88);
      t[8 * h + 4 + k] = _mm512_shuffle_f32x4(r[8 * h + k], r[8 * h + 4 + k], 0xdd);
    }
  for (int k = 0; k < 8; k++) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);
  }
}

/* Kt[f][j] = rows[j * ld + f] for f < F, j < n, and 0 for n <= j < NR: sixteen keys by sixteen features a step,
 * turned in registers (the portable gather reads one strided float at a time). */
static void pack_t_avx512(float *Kt, const float *rows, int64_t ld, int n, int64_t F) {
  for (int64_t f0 = 0; f0 < F; f0 += 16) {
    const int fm = F - f0 < 16 ? (int)(F - f0) : 16;
    const __mmask16 km = lanes16(fm);
    for (int j0 = 0; j0 < NR; j0 += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; i++)
        r[i] = j0 + i < n ? _mm512_maskz_loadu_ps(km, rows + (j0 + i) * ld + f0) : _mm512_setzero_ps();
      transpose16(r);
      for (int f = 0; f < fm; f++) _mm512_storeu_ps(Kt + (f0 + f) * NR + j0, r[f]);
    }
  }
}

/* Two rows of 16-bit values interleaved: 32 pairs a step, by one two-source permute for each half. */
static int pack_pairs_avx512(uint16_t *dst, const uint16_t *r0, const uint16_t *r1, int64_t n) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                      36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const __m512i ex = _mm512_set1_epi16(0x7f80);
  __mmask32 inf_nan = 0;
  for (int64_t c = 0; c < n; c += 32) {
    const int64_t left = n - c;
    const __mmask32 m = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1);
    const __m512i a = _mm512_maskz_loadu_epi16(m, r0 + c), b = _mm512_maskz_loadu_epi16(m, r1 + c);
    inf_nan |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(a, ex), ex) | _mm512_cmpeq_epi16_mask(_mm512_and_si512(b, ex), ex);
    const int64_t first = left >= 16 ? 32 : 2 * left, second = left >= 32 ? 32 : left > 16 ? 2 * (left - 16) : 0;
    _mm512_mask_storeu_epi16(dst + 2 * c, first >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << first) - 1),
                             _mm512_permutex2var_epi16(a, lo, b));
    if (second)
      _mm512_mask_storeu_epi16(dst + 2 * c + 32, second >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << second) - 1),
                               _mm512_permutex2var_epi16(a, hi, b));
  }
  return inf_nan != 0;
}

#ifdef ATTN_TILE_P_ROUNDED_TO_BF16
/* kernels.h's split_f16: hi the round to nearest even as attn__f32_to_bf16's (every f16 is a normal
 * float, so the instruction's flushing of subnormals never applies), lo the exact rest; an f32 value is
 * first rounded to f16 as attn__round_to_f16 rounds it (to nearest even, Inf past 65504). */
static void split_f16_avx512(uint16_t *hi, uint16_t *lo, const void *src, int is_f16, int64_t n) {
  for (int64_t c = 0; c < n; c += 32) {
    const __mmask32 m = n - c >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (n - c)) - 1);
    __m512 x0, x1;
    if (is_f16) {
      const __m512i h = _mm512_maskz_loadu_epi16(m, (const uint16_t *)src + c);
      x0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), x1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    } else {
      const float *f = (const float *)src + c;
      x0 = through_f16(_mm512_maskz_loadu_ps((__mmask16)m, f));
      x1 = through_f16(_mm512_maskz_loadu_ps((__mmask16)(m >> 16), f + 16));
    }
    const __m512i hv = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
    _mm512_mask_storeu_epi16(hi + c, m, hv);
    _mm512_mask_storeu_epi16(lo + c, m, lo_terms(hv, x0, x1));
  }
}
#define SPLIT_F16 split_f16_avx512
#else
#define SPLIT_F16 NULL
#endif

_Static_assert(NR <= ATTN__MAX_NR, "the framework keeps a row of NR keys on the stack");
_Static_assert(NR % 16 == 0, "pack_t turns sixteen keys at a time");
const attn__cpu_kernels ATTN_TILE_SET = {ATTN_TILE_SET_NAME, MR, NR, qk_avx512, softmax_avx512, pv_avx512,
                                         exp_shift_avx512, ds_avx512, pt_acc_avx512, pack_t_avx512,
                                         pack_pairs_avx512, SPLIT_F16};

