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

#include <immintrin.h>
#include <math.h>

#ifndef MR
#define MR 6
#endif
#ifndef NR
#define NR 64
#endif
/* amx/tiles16.c builds this file again as the 16-row set under the AMX tiles
 * (ATTN_TILE_SET, its name, and ATTN_TILES_ONLY: no decode kernels). */
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

/* e^x for a vector: 2^(x log2 e) with 2^f on f in [-1/2, 1/2] by a degree-6
 * polynomial (about 1 ulp) and vscalefps for 2^n. x <= 88 (softmax arguments
 * are <= 0); -inf gives +0 exactly, NaN stays NaN. Results below 2^-125 are 0:
 * on Intel cores an instruction whose result underflows to a subnormal (or to
 * zero through one) takes a microcode assist of ~100 cycles, and a masked
 * logit (-inf) would pay it in every lane; the lanes are left out instead
 * (-inf's t - n is NaN there, and never seen). */
static inline __m512 exp512(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ); /* NaN too */
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f); /* ln2^6 / 6! ... ln2 / 1! */
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

#ifdef ATTN_TILE_P_ROUNDED_TO_BF16
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
static inline __m512 exp_minus(__m512 x, __m512 m, __m512 m_l2e, float scale) {
  (void)m_l2e, (void)scale; /* 1: only the AMX set defers the scale */
  return exp512(_mm512_sub_ps(x, m));
}
#endif

/* Sixteen horizontal reductions at once, in 15 shuffle pairs: lane k of the
 * result reduces v[(k % 4) * 4 + k / 4] (a 4 x 4 transpose, its own inverse). */
#define REDUCE16(name, op)                                                                                    \
  static inline __m512 name(const __m512 v[16]) {                                                            \
    __m512 w[8], x[4], y[2];                                                                                  \
    for (int i = 0; i < 8; i++)                                                                               \
      w[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE)); \
    for (int i = 0; i < 4; i++)                                                                               \
      x[i] = op(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88), _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD)); \
    for (int i = 0; i < 2; i++)                                                                               \
      y[i] = op(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE)); \
    return op(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));                     \
  }
REDUCE16(reduce16_max, _mm512_max_ps)
REDUCE16(reduce16_add, _mm512_add_ps)
#define SLOT(r) (((r) % 4) * 4 + (r) / 4) /* input slot whose reduction lands in lane r */

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
/* softmax_t's step with Pb in one pass over S, for the common tile: every row's m is finite and stays
 * where it is, P = exp(scale x - m) made without first finding the tile's maximum. The row's sum says
 * whether that was right: at most e^LAZY_MAX, no P passed it (and none was NaN). Returns 0, having
 * written only Pb, when some row's sum is more; the two passes then run on the same formula, and move
 * m where the tile's maximum passed it by more than LAZY_MAX. */
static inline __attribute__((always_inline)) int softmax_one_pass(const float *S, float *m, float *l, float *alpha,
                                                                  float scale, uint16_t *Pb) {
  const __mmask16 rows = (__mmask16)((1u << MR) - 1);
  const __m512 mold = _mm512_load_ps(m);
  if (_mm512_fpclass_ps_mask(mold, 0x99) & rows) return 0; /* NaN or +-inf */
  float shl[16];
  _mm512_storeu_ps(shl, _mm512_mul_ps(mold, _mm512_set1_ps(1.44269504088896341f)));
  __m512 sums[16];
  for (int r = MR; r < 16; r++) sums[SLOT(r)] = _mm512_setzero_ps();
  for (int r = 0; r < MR; r++) {
    const float *s = S + r * NR;
    const __m512 mvl = _mm512_set1_ps(shl[r]);
    __m512 sum = _mm512_setzero_ps(), p[NV];
    for (int v = 0; v < NV; v++) {
      p[v] = exp_minus(_mm512_load_ps(s + 16 * v), mold, mvl, scale);
      sum = _mm512_add_ps(sum, p[v]);
    }
    for (int v = 0; v < NV; v += 2)
      _mm512_store_si512(Pb + r * NR + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(p[v + 1], p[v]));
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
 * one); P goes to S, or with Pb (the AMX set only) rounded to bf16 straight
 * into Pb's rows of NR, as pv's A tiles read them. */
static inline __attribute__((always_inline)) void softmax_t(float *S, float *m, float *l, float *alpha, float scale,
                                                            uint16_t *Pb) {
#ifdef ATTN_TILE_P_ROUNDED_TO_BF16
  if (Pb && softmax_one_pass(S, m, l, alpha, scale, Pb)) return;
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
    for (int v = 0; Pb && v < NV; v += 2)
      _mm512_store_si512(Pb + r * NR + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(p[v + 1], p[v]));
#endif
    sums[SLOT(r)] = sum;
  }
  _mm512_store_ps(l, _mm512_fmadd_ps(_mm512_load_ps(l), a, reduce16_add(sums)));
  _mm512_store_ps(alpha, a);
  _mm512_store_ps(m, _mm512_mask_blend_ps(empty, mnew, mold));
}

static void softmax_avx512(float *S, float *m, float *l, float *alpha) { softmax_t(S, m, l, alpha, 1.0f, NULL); }

#ifdef ATTN_TILE_P_ROUNDED_TO_BF16
void ATTN_SOFTMAX_ROUND(uint16_t *Pb, float *S, float scale, float *m, float *l, float *alpha) {
  softmax_t(S, m, l, alpha, scale, Pb);
}
#endif

/* Lanes [0, n) of a zmm, n clamped to 0..16. */
static inline __mmask16 lanes16(int64_t n) {
  return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

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

_Static_assert(NR <= ATTN__MAX_NR, "the framework keeps a row of NR keys on the stack");
_Static_assert(NR % 16 == 0, "pack_t turns sixteen keys at a time");
const attn__cpu_kernels ATTN_TILE_SET = {ATTN_TILE_SET_NAME, MR, NR, qk_avx512, softmax_avx512, pv_avx512,
                                         exp_shift_avx512, ds_avx512, pt_acc_avx512, pack_t_avx512};

#ifndef ATTN_TILES_ONLY

/* ---- decode (kernels.h's attn__decode_kernels) ----------------------------------
 * K and V are read where they lie, in f32, f16 (vcvtph2ps) or bf16 (a shift),
 * widened in registers. qk: the query rows of a group times as many keys as
 * make sixteen dot products, one accumulator each, one shuffle tree for all.
 * pv: each V row is loaded (and widened) once per 64 columns for up to six
 * query rows, whose outputs stay in registers across the block. A KV cache's
 * blocks (q8_0, q4_0) have their own qk and pv (below), by whole blocks: each
 * block of K or V widened once into d * q for all the rows of the call (up to
 * eight), q4_0 by a table lookup (vpermps), so that the FMAs the rows need, not
 * the dequantization, set the pace. */
/* The read-ahead's cache level (a lab knob, as DEC_PF_BYTES). On the Xeon of
 * BENCHMARKS.md, _MM_HINT_T1 (to L2) took f16 steps 8-10% faster and f32 3%;
 * not measured on Zen 5, where T0 was tuned, so T0 stays. */
#ifndef DEC_PF_HINT
#define DEC_PF_HINT _MM_HINT_T0
#endif
#define DEC_NAME(x) x##_avx512
#define DEC_OWN_QK_PV
#include "../decode_generic.inc"

static inline __attribute__((always_inline)) __m512 load_wide(const void *p, int64_t off, __mmask16 m, attn_dtype dt) {
  if (dt == ATTN_F16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + off));
  if (dt == ATTN_BF16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + off)), 16));
  return _mm512_maskz_loadu_ps(m, (const float *)p + off);
}

/* Columns [c, c + 16) of the row at off (elements; bytes for blocks) of p, as
 * floats; c a multiple of 16, and for blocks m all or nothing (D % 32 == 0). */
static inline __attribute__((always_inline)) __m512 load_kv(const void *p, int64_t off, int64_t c, __mmask16 m,
                                                            attn_dtype dt) {
  if (!attn__is_quant(dt)) return load_wide(p, off + c, m, dt);
  if (!m) return _mm512_setzero_ps(); /* past Dv: nothing there to read */
  const uint8_t *blk = (const uint8_t *)p + off + (size_t)(c / ATTN__QK) * attn__qblock_bytes(dt);
  const int upper = (int)(c / 16) & 1; /* the block's second 16 values */
  __m512i qi;
  if (dt == ATTN__Q8_0) {
    qi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2 + 16 * upper)));
  } else { /* element i in byte i's low nibble, i + 16 in its high one */
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)));
    qi = _mm512_sub_epi32(_mm512_and_si512(upper ? _mm512_srli_epi32(bytes, 4) : bytes, _mm512_set1_epi32(15)),
                          _mm512_set1_epi32(8));
  }
  uint16_t h; /* the block's f16 scale, converted by the hardware (F16C comes with AVX-512) */
  memcpy(&h, blk, 2);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(qi), _mm512_set1_ps(_cvtsh_ss(h)));
}

/* Bytes of a row of F values, and bytes per unit of its row distance. */
static inline size_t row_bytes_of(attn_dtype dt, int64_t F) { return attn__row_bytes(dt, F); }
static inline size_t ld_unit(attn_dtype dt) { return attn__is_quant(dt) ? 1 : dt == ATTN_F32 ? 4 : 2; }

/* ---- a KV cache's blocks (q8_0, q4_0), block by block ----
 * Each 32-value block of a K or V row is widened once, into two zmm of
 * d * q (d its f16 scale), and that pair serves every query row of the call.
 * q4_0 needs no integer arithmetic: vpermps looks each nibble (the low four
 * bits of a 32-bit lane) up in a 16-entry table d * (n - 8), built once per
 * block. The values are those the generic load_kv produced (d * (float)q, in
 * the same order of operations), so results are bitwise what they were. */
static inline __attribute__((always_inline)) void widen_block(const uint8_t *blk, attn_dtype dt, __m512 *lo,
                                                              __m512 *hi) {
  uint16_t h;
  memcpy(&h, blk, 2);
  const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)h)); /* the scale, in every lane */
  if (dt == ATTN__Q8_0) {
    *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)))), d);
    *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)))), d);
  } else { /* byte i: element i in its low nibble, i + 16 in its high one */
    const __m512 table = _mm512_mul_ps(
        _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), d);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)));
    *lo = _mm512_permutexvar_ps(b, table); /* vpermps reads bits 3:0 of each index: the low nibble */
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
  }
}

/* The RR x KG dot products of keys [j0, j0 + KG) (acc[j * RR + r]) reduced in
 * one shuffle tree, lane r * KG + j holding row r's key j, so that each row's
 * run of keys is one masked store into S (keys past nkeys are not stored). */
static inline __attribute__((always_inline)) void store_dots(float *S, const __m512 acc[16], const int RR,
                                                             const int KG, int j0, int nkeys) {
  __m512 v[16];
  for (int e = 0; e < 16; e++) v[SLOT(e)] = e < RR * KG ? acc[(e % KG) * RR + e / KG] : _mm512_setzero_ps();
  const __m512 dots = reduce16_add(v);
  const __mmask16 keys = lanes16(nkeys - j0) & (__mmask16)((1u << KG) - 1);
  for (int r = 0; r < RR; r++) /* lane r * KG + j to S[r][j0 + j]; the base stays inside S, as r * KG < ATTN__DEC_NB */
    _mm512_mask_storeu_ps(S + r * ATTN__DEC_NB + j0 - r * KG, (__mmask16)(keys << (r * KG)), dots);
}

/* RR rows (1..4) against KG = 16 / RR keys at a time, as dec_qk_rows, in steps
 * of a block: each key's block is widened once for the RR rows, and each half
 * of a row's query block loaded once for the KG keys. The rows pf ahead are
 * asked for block by block, between the FMAs, rather than in a loop of their own. */
static inline __attribute__((always_inline)) void dec_qk_qrows(float *S, const float *Q, const int RR,
                                                               const uint8_t *K, int64_t ldk, int nkeys, int64_t D,
                                                               attn_dtype dt, const void *Knext) {
  const int KG = 16 / RR;
  const size_t bb = attn__qblock_bytes(dt), bytes = attn__row_bytes(dt, D);
  const int64_t pf = pf_rows_avx512((int64_t)bytes);
  for (int j0 = 0; j0 < nkeys; j0 += KG) {
    const uint8_t *row[16]; /* keys past nkeys repeat the last one: their dot products are not stored */
    const char *ahead[16];
    for (int j = 0; j < KG; j++) {
      row[j] = K + (int64_t)(j0 + j < nkeys ? j0 + j : nkeys - 1) * ldk;
      ahead[j] = attn__dec_ahead(K, j0 + j + pf, nkeys, ldk, Knext);
    }
    __m512 acc[16];
    for (int e = 0; e < 16; e++) acc[e] = _mm512_setzero_ps();
    for (int64_t c = 0, o = 0; c < D; c += ATTN__QK, o += (int64_t)bb) {
      for (int j = 0; j < KG; j++) _mm_prefetch(ahead[j] + o, DEC_PF_HINT);
      if (KG >= 8) { /* 1-2 rows: the block's queries stay in registers, each key's block is used at once */
        const __m512 q0[2] = {_mm512_loadu_ps(Q + c), _mm512_loadu_ps(Q + (RR - 1) * D + c)};
        const __m512 q1[2] = {_mm512_loadu_ps(Q + c + 16), _mm512_loadu_ps(Q + (RR - 1) * D + c + 16)};
        for (int j = 0; j < KG; j++) {
          __m512 lo, hi;
          widen_block(row[j] + o, dt, &lo, &hi);
          for (int r = 0; r < RR; r++) acc[j * RR + r] = _mm512_fmadd_ps(q0[r], lo, acc[j * RR + r]);
          for (int r = 0; r < RR; r++) acc[j * RR + r] = _mm512_fmadd_ps(q1[r], hi, acc[j * RR + r]);
        }
      } else { /* 3-4 rows: the KG (4-5) keys' blocks widened first, then each query half loaded once for them */
        __m512 lo[5], hi[5];
        for (int j = 0; j < KG; j++) widen_block(row[j] + o, dt, &lo[j], &hi[j]);
        for (int r = 0; r < RR; r++) {
          const __m512 q = _mm512_loadu_ps(Q + r * D + c);
          for (int j = 0; j < KG; j++) acc[j * RR + r] = _mm512_fmadd_ps(q, lo[j], acc[j * RR + r]);
        }
        for (int r = 0; r < RR; r++) {
          const __m512 q = _mm512_loadu_ps(Q + r * D + c + 16);
          for (int j = 0; j < KG; j++) acc[j * RR + r] = _mm512_fmadd_ps(q, hi[j], acc[j * RR + r]);
        }
      }
    }
    store_dots(S, acc, RR, KG, j0, nkeys);
  }
}

/* One pass of dec_pv_qrows: columns [c0, c0 + 32 NB) of RR rows (1..8) of O,
 * O = O * alpha + P V, RR x 2 NB <= 16 accumulators; each key's NB blocks are
 * widened once for all RR rows. NB, PF (the first pass asks for the rows
 * ahead, whole) and SPARSE (a zero P adds nothing, by a masked FMA) are
 * constants, so the key loop has no branch. */
static inline __attribute__((always_inline)) void dec_pv_qpass(float *O, const float *alpha, const float *P,
                                                               const int RR, const int NB, const uint8_t *V,
                                                               int64_t ldv, int nkeys, int64_t Dv, int64_t c0,
                                                               attn_dtype dt, const int SPARSE, const int PF,
                                                               const void *Vnext) {
  const size_t bb = attn__qblock_bytes(dt), bytes = attn__row_bytes(dt, Dv);
  const int64_t pf = pf_rows_avx512((int64_t)bytes);
  __m512 o[8][8];
  for (int r = 0; r < RR; r++) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int w = 0; w < 2 * NB; w++) o[r][w] = _mm512_mul_ps(_mm512_loadu_ps(O + r * Dv + c0 + 16 * w), a);
  }
  const uint8_t *vb = V + (c0 / ATTN__QK) * (int64_t)bb;
  for (int j = 0; j < nkeys; j++, vb += ldv) {
    if (PF) {
      const char *a = attn__dec_ahead(V, j + pf, nkeys, ldv, Vnext);
      for (size_t off = 0; off < bytes; off += 64) _mm_prefetch(a + off, DEC_PF_HINT);
    }
    __m512 vv[8];
    for (int b = 0; b < NB; b++) widen_block(vb + b * (int64_t)bb, dt, &vv[2 * b], &vv[2 * b + 1]);
    for (int r = 0; r < RR; r++) {
      const __m512 p = _mm512_set1_ps(P[r * ATTN__DEC_NB + j]);
      if (SPARSE) { /* NaN counts as nonzero: it propagates */
        const __mmask16 nz = _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_NEQ_UQ);
        for (int w = 0; w < 2 * NB; w++) o[r][w] = _mm512_mask3_fmadd_ps(p, vv[w], o[r][w], nz);
      } else {
        for (int w = 0; w < 2 * NB; w++) o[r][w] = _mm512_fmadd_ps(p, vv[w], o[r][w]);
      }
    }
  }
  for (int r = 0; r < RR; r++)
    for (int w = 0; w < 2 * NB; w++) _mm512_storeu_ps(O + r * Dv + c0 + 16 * w, o[r][w]);
}

/* O (RR rows) = O * alpha + P V over V's blocks: passes of NB blocks (32
 * columns each), then single blocks for what is left of Dv (a multiple of 32):
 * no row group is split, so no block is widened twice. */
static inline __attribute__((always_inline)) void dec_pv_qrows(float *O, const float *alpha, const float *P,
                                                               const int RR, const int NB, const uint8_t *V,
                                                               int64_t ldv, int nkeys, int64_t Dv, attn_dtype dt,
                                                               const int SPARSE, const void *Vnext) {
  int64_t c0 = 0;
  for (; c0 + ATTN__QK * NB <= Dv; c0 += ATTN__QK * NB)
    if (c0 == 0) dec_pv_qpass(O, alpha, P, RR, NB, V, ldv, nkeys, Dv, c0, dt, SPARSE, 1, Vnext);
    else dec_pv_qpass(O, alpha, P, RR, NB, V, ldv, nkeys, Dv, c0, dt, SPARSE, 0, Vnext);
  for (; c0 < Dv; c0 += ATTN__QK)
    if (c0 == 0) dec_pv_qpass(O, alpha, P, RR, 1, V, ldv, nkeys, Dv, c0, dt, SPARSE, 1, Vnext);
    else dec_pv_qpass(O, alpha, P, RR, 1, V, ldv, nkeys, Dv, c0, dt, SPARSE, 0, Vnext);
}

// rows 1..8 at once; blocks per pass: 4 (128 columns) for 1-2 rows, 2 for 3-4, 1 for 5-8.
static inline __attribute__((always_inline)) void dec_pv_qgroup(float *O, const float *a, const float *P, int rows,
                                                                const void *V, int64_t ldv, int nkeys, int64_t Dv,
                                                                attn_dtype dt, const int SPARSE, const void *Vnext) {
  switch (rows) {
    case 1: dec_pv_qrows(O, a, P, 1, 4, V, ldv, nkeys, Dv, dt, SPARSE, Vnext); break;
    case 2: dec_pv_qrows(O, a, P, 2, 4, V, ldv, nkeys, Dv, dt, SPARSE, Vnext); break;
    case 3: dec_pv_qrows(O, a, P, 3, 2, V, ldv, nkeys, Dv, dt, SPARSE, Vnext); break;
    case 4: dec_pv_qrows(O, a, P, 4, 2, V, ldv, nkeys, Dv, dt, SPARSE, Vnext); break;
    case 5: dec_pv_qrows(O, a, P, 5, 1, V, ldv, nkeys, Dv, dt, SPARSE, Vnext); break;
    case 6: dec_pv_qrows(O, a, P, 6, 1, V, ldv, nkeys, Dv, dt, SPARSE, Vnext); break;
    case 7: dec_pv_qrows(O, a, P, 7, 1, V, ldv, nkeys, Dv, dt, SPARSE, Vnext); break;
    default: dec_pv_qrows(O, a, P, 8, 1, V, ldv, nkeys, Dv, dt, SPARSE, Vnext); break;
  }
}

/* RR rows (1..8) against KG = 16 / RR keys at a time: the RR x KG dot products
 * fill the sixteen accumulators, so each K element is loaded (and widened)
 * once for every row of the group, and one shuffle tree reduces them all.
 * Each step of 16 columns asks for the same line pf rows ahead (halves: every
 * other step, a line holding 32 of them). */
static inline __attribute__((always_inline)) void dec_qk_rows(float *S, const float *Q, const int RR, const void *K,
                                                              int64_t ldk, int nkeys, int64_t D, attn_dtype dt, const void *Knext) {
  const int KG = 16 / RR;
  const size_t es = ld_unit(dt);
  const int64_t pf = pf_rows_avx512((int64_t)row_bytes_of(dt, D));
  for (int j0 = 0; j0 < nkeys; j0 += KG) {
    int64_t row[16]; /* keys past nkeys repeat the last one: their dot products are not stored */
    const char *ahead[16];
    for (int j = 0; j < KG; j++) {
      row[j] = (int64_t)(j0 + j < nkeys ? j0 + j : nkeys - 1) * ldk;
      ahead[j] = attn__dec_ahead(K, j0 + j + pf, nkeys, ldk * (int64_t)es, Knext);
    }
    __m512 acc[16];
    for (int e = 0; e < 16; e++) acc[e] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) {
      const __mmask16 m = lanes16(D - c);
      if (es == 4 || !(c & 16))
        for (int j = 0; j < KG; j++) _mm_prefetch(ahead[j] + c * (int64_t)es, DEC_PF_HINT);
      __m512 kv[16];
      for (int j = 0; j < KG; j++) kv[j] = load_kv(K, row[j], c, m, dt);
      for (int r = 0; r < RR; r++) {
        const __m512 qv = _mm512_maskz_loadu_ps(m, Q + r * D + c);
        for (int j = 0; j < KG; j++) acc[j * RR + r] = _mm512_fmadd_ps(qv, kv[j], acc[j * RR + r]);
      }
    }
    store_dots(S, acc, RR, KG, j0, nkeys);
  }
}

static inline __attribute__((always_inline)) void dec_qk_t(float *S, const float *Q, int rows, const void *K,
                                                           int64_t ldk, int nkeys, int64_t D, attn_dtype dt, const void *Knext) {
  for (int r0 = 0; r0 < rows; r0 += 8) {
    const int rr = rows - r0 < 8 ? rows - r0 : 8;
    float *s = S + r0 * ATTN__DEC_NB;
    const float *q = Q + r0 * D;
    switch (rr) { /* a constant row count keeps the accumulators in registers */
      case 1: dec_qk_rows(s, q, 1, K, ldk, nkeys, D, dt, Knext); break;
      case 2: dec_qk_rows(s, q, 2, K, ldk, nkeys, D, dt, Knext); break;
      case 3: dec_qk_rows(s, q, 3, K, ldk, nkeys, D, dt, Knext); break;
      case 4: dec_qk_rows(s, q, 4, K, ldk, nkeys, D, dt, Knext); break;
      case 5: dec_qk_rows(s, q, 5, K, ldk, nkeys, D, dt, Knext); break;
      case 6: dec_qk_rows(s, q, 6, K, ldk, nkeys, D, dt, Knext); break;
      case 7: dec_qk_rows(s, q, 7, K, ldk, nkeys, D, dt, Knext); break;
      default: dec_qk_rows(s, q, 8, K, ldk, nkeys, D, dt, Knext); break;
    }
  }
}

// rows RR (1..6) of O against P for n keys of V: O = O * alpha + P V.
// SPARSE: a zero P adds nothing (a hidden key's V row may hold Inf), at a compare per row and key.
static inline __attribute__((always_inline)) void dec_pv_rows(float *O, const float *alpha, const float *P, int RR,
                                                              const void *V, int64_t ldv, int nkeys, int64_t Dv,
                                                              attn_dtype dt, const int SPARSE, const void *Vnext) {
  for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
    __mmask16 mk[4];
    for (int w = 0; w < 4; w++) mk[w] = lanes16(Dv - c0 - 16 * w);
    __m512 o[6][4];
    for (int r = 0; r < RR; r++) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int w = 0; w < 4; w++) o[r][w] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk[w], O + r * Dv + c0 + 16 * w), a);
    }
    for (int j = 0; j < nkeys; j++) {
      if (c0 == 0) {
        const size_t es = ld_unit(dt), bytes = row_bytes_of(dt, Dv);
        const char *pr = attn__dec_ahead(V, j + pf_rows_avx512((int64_t)bytes), nkeys, ldv * (int64_t)es, Vnext);
        for (size_t off = 0; off < bytes; off += 64) _mm_prefetch(pr + off, DEC_PF_HINT);
      }
      __m512 vv[4];
      for (int w = 0; w < 4; w++) vv[w] = load_kv(V, j * ldv, c0 + 16 * w, mk[w], dt);
      for (int r = 0; r < RR; r++) {
        const __m512 p = _mm512_set1_ps(P[r * ATTN__DEC_NB + j]);
        if (SPARSE) {
          const __mmask16 nz = _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_NEQ_UQ);
          for (int w = 0; w < 4; w++) o[r][w] = _mm512_mask3_fmadd_ps(p, vv[w], o[r][w], nz);
        } else {
          for (int w = 0; w < 4; w++) o[r][w] = _mm512_fmadd_ps(p, vv[w], o[r][w]);
        }
      }
    }
    for (int r = 0; r < RR; r++)
      for (int w = 0; w < 4; w++) _mm512_mask_storeu_ps(O + r * Dv + c0 + 16 * w, mk[w], o[r][w]);
  }
}

// rr (1..6) rows: a constant row count keeps the outputs in registers.
static inline __attribute__((always_inline)) void dec_pv_group(float *o, const float *a, const float *P, int rr,
                                                               const void *V, int64_t ldv, int nkeys, int64_t Dv,
                                                               attn_dtype dt, const int SPARSE, const void *Vnext) {
  switch (rr) {
    case 1: dec_pv_rows(o, a, P, 1, V, ldv, nkeys, Dv, dt, SPARSE, Vnext); break;
    case 2: dec_pv_rows(o, a, P, 2, V, ldv, nkeys, Dv, dt, SPARSE, Vnext); break;
    case 3: dec_pv_rows(o, a, P, 3, V, ldv, nkeys, Dv, dt, SPARSE, Vnext); break;
    case 4: dec_pv_rows(o, a, P, 4, V, ldv, nkeys, Dv, dt, SPARSE, Vnext); break;
    case 5: dec_pv_rows(o, a, P, 5, V, ldv, nkeys, Dv, dt, SPARSE, Vnext); break;
    default: dec_pv_rows(o, a, P, 6, V, ldv, nkeys, Dv, dt, SPARSE, Vnext); break;
  }
}

static inline __attribute__((always_inline)) void dec_pv_t(float *O, float *m, float *l, float *S, int rows,
                                                           const void *V, int64_t ldv, int nkeys, int64_t Dv,
                                                           attn_dtype dt, int sparse, const void *Vnext) {
  float alpha[ATTN__DEC_MAX_ROWS_K];
  for (int r = 0; r < rows; r++) { /* the softmax step, one row at a time */
    float *s = S + r * ATTN__DEC_NB;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int j = 0; j < nkeys; j += 16) {
      const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes16(nkeys - j), s + j);
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      mx = _mm512_max_ps(mx, x);
    }
    float mnew = _mm512_reduce_max_ps(mx);
    if (m[r] > mnew) mnew = m[r];
    if (nan || isnan(m[r])) mnew = NAN; /* NaN wins */
    if (mnew == -INFINITY) { /* nothing visible yet */
      for (int j = 0; j < nkeys; j++) s[j] = 0;
      alpha[r] = 1;
      continue;
    }
    alpha[r] = expf(m[r] - mnew);
    const __m512 mv = _mm512_set1_ps(mnew);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < nkeys; j += 16) {
      const __mmask16 k = lanes16(nkeys - j);
      const __m512 p = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mv)));
      _mm512_mask_storeu_ps(s + j, k, p);
      sum = _mm512_add_ps(sum, p);
    }
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    m[r] = mnew;
  }
  if (attn__is_quant(dt)) { /* blocks: all rows of a call at once (at most 8) */
    for (int r0 = 0; r0 < rows; r0 += 8) {
      const int rr = rows - r0 < 8 ? rows - r0 : 8;
      if (sparse) dec_pv_qgroup(O + r0 * Dv, alpha + r0, S + r0 * ATTN__DEC_NB, rr, V, ldv, nkeys, Dv, dt, 1, Vnext);
      else dec_pv_qgroup(O + r0 * Dv, alpha + r0, S + r0 * ATTN__DEC_NB, rr, V, ldv, nkeys, Dv, dt, 0, Vnext);
    }
    return;
  }
  for (int r0 = 0; r0 < rows; r0 += 6) {
    const int rr = rows - r0 < 6 ? rows - r0 : 6;
    float *o = O + r0 * Dv;
    const float *a = alpha + r0, *P = S + r0 * ATTN__DEC_NB;
    if (sparse) dec_pv_group(o, a, P, rr, V, ldv, nkeys, Dv, dt, 1, Vnext);
    else dec_pv_group(o, a, P, rr, V, ldv, nkeys, Dv, dt, 0, Vnext);
  }
}

static inline __attribute__((always_inline)) void dec_qk_q(float *S, const float *Q, int rows, const void *K,
                                                           int64_t ldk, int nkeys, int64_t D, attn_dtype dt, const void *Knext) {
  for (int r0 = 0; r0 < rows; r0 += 8) {
    const int rr = rows - r0 < 8 ? rows - r0 : 8;
    float *s = S + r0 * ATTN__DEC_NB;
    const float *q = Q + r0 * D;
    switch (rr) { /* a constant row count keeps the accumulators in registers */
      case 1: dec_qk_qrows(s, q, 1, K, ldk, nkeys, D, dt, Knext); break;
      case 2: dec_qk_qrows(s, q, 2, K, ldk, nkeys, D, dt, Knext); break;
      case 3: dec_qk_qrows(s, q, 3, K, ldk, nkeys, D, dt, Knext); break;
      case 4: dec_qk_qrows(s, q, 4, K, ldk, nkeys, D, dt, Knext); break;
      /* 5-8 rows (2-3 keys a pass): by 16 columns, as dec_qk_rows, measured faster on Zen 5 */
      default: dec_qk_t(s, q, rr, K, ldk, nkeys, D, dt, Knext); break;
    }
  }
}

static void dec_qk_wide(float *S, const float *Q, int rows, const void *K, int64_t ldk, int nkeys, int64_t D,
                        attn_dtype dt, const void *Knext) {
  if (dt == ATTN_F16) dec_qk_t(S, Q, rows, K, ldk, nkeys, D, ATTN_F16, Knext);
  else if (dt == ATTN_BF16) dec_qk_t(S, Q, rows, K, ldk, nkeys, D, ATTN_BF16, Knext);
  else if (dt == ATTN__Q8_0) dec_qk_q(S, Q, rows, K, ldk, nkeys, D, ATTN__Q8_0, Knext);
  else if (dt == ATTN__Q4_0) dec_qk_q(S, Q, rows, K, ldk, nkeys, D, ATTN__Q4_0, Knext);
  else dec_qk_t(S, Q, rows, K, ldk, nkeys, D, ATTN_F32, Knext);
}

static void dec_pv_wide(float *O, float *m, float *l, float *S, int rows, const void *V, int64_t ldv, int nkeys,
                        int64_t Dv, attn_dtype dt, int sparse, const void *Vnext) {
  if (dt == ATTN_F16) dec_pv_t(O, m, l, S, rows, V, ldv, nkeys, Dv, ATTN_F16, sparse, Vnext);
  else if (dt == ATTN_BF16) dec_pv_t(O, m, l, S, rows, V, ldv, nkeys, Dv, ATTN_BF16, sparse, Vnext);
  else if (dt == ATTN__Q8_0) dec_pv_t(O, m, l, S, rows, V, ldv, nkeys, Dv, ATTN__Q8_0, sparse, Vnext);
  else if (dt == ATTN__Q4_0) dec_pv_t(O, m, l, S, rows, V, ldv, nkeys, Dv, ATTN__Q4_0, sparse, Vnext);
  else dec_pv_t(O, m, l, S, rows, V, ldv, nkeys, Dv, ATTN_F32, sparse, Vnext);
}

const attn__decode_kernels attn__decode_kernels_avx512 = {(1u << ATTN_F32) | (1u << ATTN_F16) | (1u << ATTN_BF16) |
                                                              (1u << ATTN__Q8_0) | (1u << ATTN__Q4_0),
                                                          dec_qk_wide, dec_pv_wide, widen_avx512};
#endif /* ATTN_TILES_ONLY */
