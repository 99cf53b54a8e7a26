/* AVX-512 decode microkernels (kernels.h's attn__decode_kernels), compiled
 * with the AVX-512 flags; the blocked tiles are in attention.c.
 *
 * K and V are read where they lie, in f32, f16 (vcvtph2ps) or bf16 (a shift),
 * widened in registers. qk: the query rows of a group times as many keys as
 * make sixteen dot products, one accumulator each, one shuffle tree for all.
 * pv: each V row is loaded (and widened) once per 64 columns for up to six
 * query rows, whose outputs stay in registers across the block. A KV cache's
 * blocks (q8_0, q4_0) have their own qk and pv (below), by whole blocks: each
 * block of K or V widened once into d * q for all the rows of the call (up to
 * eight), q4_0 by a table lookup (vpermps), so that the FMAs the rows need, not
 * the dequantization, set the pace. */
#include "../kernels.h"
#include "vec.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

/* The read-ahead's cache level: L1 (T0) here, tuned on Zen 5; decode_l2.c
 * builds this file again with L2 (T1), which dispatch.c takes on Intel CPUs,
 * where it measured 2-9% faster f32, f16 and bf16 steps, and decode_l2_blocks8.c
 * with L2 and DEC_QK_BLOCK_ROWS 8 for Zen 4 (f32 1.3x; BENCHMARKS.md). */
#ifndef DEC_PF_HINT
#define DEC_PF_HINT _MM_HINT_T0
#endif
#ifndef ATTN_DECODE_SET
#define ATTN_DECODE_SET attn__decode_kernels_avx512
#endif
/* f32 rows asked for a second time, this many rows ahead and into L1, beside
 * the read-ahead above: 0 here; 4 in decode_l2_blocks8.c, where one Zen 4
 * thread's f32 step took 0.89x the time with it (BENCHMARKS.md). */
#ifndef DEC_PF_NEAR_ROWS
#define DEC_PF_NEAR_ROWS 0
#endif
#define DEC_NAME(x) x##_avx512
#define DEC_OWN_QK_PV
#include "../decode_generic.inc"

/* Masked loads; a mask the compiler knows to be whole (the columns before the
 * tail: see dec_qk_rows) gives a plain load, which the FMAs can take as an
 * operand. */
#define FULL_MASK(m) (__builtin_constant_p(m) && (m) == (__mmask16)0xFFFF)
static inline __attribute__((always_inline)) __m512 load_ps(__mmask16 m, const float *p) {
  return FULL_MASK(m) ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}
static inline __attribute__((always_inline)) __m256i load_16x16(__mmask16 m, const uint16_t *p) {
  return FULL_MASK(m) ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(m, p);
}
static inline __attribute__((always_inline)) void store_ps(float *p, __mmask16 m, __m512 x) {
  if (FULL_MASK(m)) _mm512_storeu_ps(p, x);
  else _mm512_mask_storeu_ps(p, m, x);
}

static inline __attribute__((always_inline)) __m512 load_wide(const void *p, int64_t off, __mmask16 m, attn_dtype dt) {
  if (dt == ATTN_F16) return _mm512_cvtph_ps(load_16x16(m, (const uint16_t *)p + off));
  if (dt == ATTN_BF16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_16x16(m, (const uint16_t *)p + off)), 16));
  return load_ps(m, (const float *)p + off);
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

/* RR rows (1..8) against KG = 16 / RR keys at a time, as dec_qk_rows, in steps
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
    const char *ahead[16], *ahead_l1[16];
    for (int j = 0; j < KG; j++) {
      row[j] = (int64_t)(j0 + j < nkeys ? j0 + j : nkeys - 1) * ldk;
      ahead[j] = attn__dec_ahead(K, j0 + j + pf, nkeys, ldk * (int64_t)es, Knext);
      ahead_l1[j] = attn__dec_ahead(K, j0 + j + DEC_PF_NEAR_ROWS, nkeys, ldk * (int64_t)es, Knext);
    }
    __m512 acc[16];
    for (int e = 0; e < 16; e++) acc[e] = _mm512_setzero_ps();
    int64_t c = 0;
#define QK_COLUMNS(m)                                                                                 \
  do {                                                                                                \
    if (es == 4 || !(c & 16))                                                                         \
      for (int j = 0; j < KG; j++) _mm_prefetch(ahead[j] + c * (int64_t)es, DEC_PF_HINT);            \
    if (DEC_PF_NEAR_ROWS && dt == ATTN_F32)                                                           \
      for (int j = 0; j < KG; j++) _mm_prefetch(ahead_l1[j] + c * (int64_t)es, _MM_HINT_T0);        \
    __m512 kv[16];                                                                                    \
    for (int j = 0; j < KG; j++) kv[j] = load_kv(K, row[j], c, (m), dt);                              \
    for (int r = 0; r < RR; r++) {                                                                    \
      const __m512 qv = load_ps((m), Q + r * D + c);                                                  \
      for (int j = 0; j < KG; j++) acc[j * RR + r] = _mm512_fmadd_ps(qv, kv[j], acc[j * RR + r]);     \
    }                                                                                                 \
  } while (0)
    if (RR <= 4) /* whole columns with plain loads (at 5-8 rows the masked ones measured faster) */
      for (; c + 16 <= D; c += 16) QK_COLUMNS((__mmask16)0xFFFF);
    for (; c < D; c += 16) QK_COLUMNS(lanes16(D - c));
#undef QK_COLUMNS
    store_dots(S, acc, RR, KG, j0, nkeys);
  }
}

/* A KV cache's blocks go by whole blocks for 1 to DEC_QK_BLOCK_ROWS rows
 * (dec_qk_qrows), more rows (2-3 keys a pass) by 16 columns, as every other
 * type (dec_qk_rows): 4 here, as 5-8 rows measured faster by columns on Zen 5;
 * decode_l2_blocks8.c takes all 8 by blocks (Zen 4). Both give the same bits. */
#ifndef DEC_QK_BLOCK_ROWS
#define DEC_QK_BLOCK_ROWS 4
#endif
#define QK_GROUP(RR)                                                                                   \
  (attn__is_quant(dt) && (RR) <= DEC_QK_BLOCK_ROWS ? dec_qk_qrows(s, q, (RR), K, ldk, nkeys, D, dt, Knext) \
                                                   : dec_qk_rows(s, q, (RR), K, ldk, nkeys, D, dt, Knext))
static inline __attribute__((always_inline)) void dec_qk_t(float *S, const float *Q, int rows, const void *K,
                                                           int64_t ldk, int nkeys, int64_t D, attn_dtype dt, const void *Knext) {
  for (int r0 = 0; r0 < rows; r0 += 8) {
    const int rr = rows - r0 < 8 ? rows - r0 : 8;
    float *s = S + r0 * ATTN__DEC_NB;
    const float *q = Q + r0 * D;
    switch (rr) { /* a constant row count keeps the accumulators in registers */
      case 1: QK_GROUP(1); break;
      case 2: QK_GROUP(2); break;
      case 3: QK_GROUP(3); break;
      case 4: QK_GROUP(4); break;
      case 5: QK_GROUP(5); break;
      case 6: QK_GROUP(6); break;
      case 7: QK_GROUP(7); break;
      default: QK_GROUP(8); break;
    }
  }
}
#undef QK_GROUP

// rows RR (1..6) of O against P for n keys of V: O = O * alpha + P V.
// SPARSE: a zero P adds nothing (a hidden key's V row may hold Inf), at a compare per row and key.
/* Columns [c0, c0 + 64) of dec_pv_rows, masks m0..m3 for its four zmm. */
static inline __attribute__((always_inline)) void dec_pv_cols(float *O, const float *alpha, const float *P, int RR,
                                                              const void *V, int64_t ldv, int nkeys, int64_t Dv,
                                                              int64_t c0, __mmask16 m0, __mmask16 m1, __mmask16 m2,
                                                              __mmask16 m3, attn_dtype dt, const int SPARSE,
                                                              const void *Vnext) {
  const __mmask16 mk[4] = {m0, m1, m2, m3};
  __m512 o[6][4];
  for (int r = 0; r < RR; r++) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int w = 0; w < 4; w++) o[r][w] = _mm512_mul_ps(load_ps(mk[w], O + r * Dv + c0 + 16 * w), a);
  }
  for (int j = 0; j < nkeys; j++) {
    if (c0 == 0) {
      const size_t es = ld_unit(dt), bytes = row_bytes_of(dt, Dv);
      const char *pr = attn__dec_ahead(V, j + pf_rows_avx512((int64_t)bytes), nkeys, ldv * (int64_t)es, Vnext);
      for (size_t off = 0; off < bytes; off += 64) _mm_prefetch(pr + off, DEC_PF_HINT);
      if (DEC_PF_NEAR_ROWS && dt == ATTN_F32) {
        const char *ahead_l1 = attn__dec_ahead(V, j + DEC_PF_NEAR_ROWS, nkeys, ldv * (int64_t)es, Vnext);
        for (size_t off = 0; off < bytes; off += 64) _mm_prefetch(ahead_l1 + off, _MM_HINT_T0);
      }
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
    for (int w = 0; w < 4; w++) store_ps(O + r * Dv + c0 + 16 * w, mk[w], o[r][w]);
}

static inline __attribute__((always_inline)) void dec_pv_rows(float *O, const float *alpha, const float *P, int RR,
                                                              const void *V, int64_t ldv, int nkeys, int64_t Dv,
                                                              attn_dtype dt, const int SPARSE, const void *Vnext) {
  int64_t c0 = 0;
  for (; c0 + 64 <= Dv; c0 += 64) /* whole columns: plain loads */
    dec_pv_cols(O, alpha, P, RR, V, ldv, nkeys, Dv, c0, 0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF, dt, SPARSE, Vnext);
  if (c0 < Dv)
    dec_pv_cols(O, alpha, P, RR, V, ldv, nkeys, Dv, c0, lanes16(Dv - c0), lanes16(Dv - c0 - 16),
                lanes16(Dv - c0 - 32), lanes16(Dv - c0 - 48), dt, SPARSE, Vnext);
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

static void dec_qk_wide(float *S, const float *Q, int rows, const void *K, int64_t ldk, int nkeys, int64_t D,
                        attn_dtype dt, const void *Knext) {
  if (dt == ATTN_F16) dec_qk_t(S, Q, rows, K, ldk, nkeys, D, ATTN_F16, Knext);
  else if (dt == ATTN_BF16) dec_qk_t(S, Q, rows, K, ldk, nkeys, D, ATTN_BF16, Knext);
  else if (dt == ATTN__Q8_0) dec_qk_t(S, Q, rows, K, ldk, nkeys, D, ATTN__Q8_0, Knext);
  else if (dt == ATTN__Q4_0) dec_qk_t(S, Q, rows, K, ldk, nkeys, D, ATTN__Q4_0, Knext);
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

const attn__decode_kernels ATTN_DECODE_SET = {(1u << ATTN_F32) | (1u << ATTN_F16) | (1u << ATTN_BF16) |
                                                              (1u << ATTN__Q8_0) | (1u << ATTN__Q4_0),
                                                          dec_qk_wide, dec_pv_wide, widen_avx512, narrow_avx512};
