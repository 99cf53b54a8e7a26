/* The microkernel contract between the attention frameworks (the blocked
 * forward and backward, the decode) and each instruction set's kernels.
 *
 * A framework owns which keys exist and where they lie (packing, chunks, a
 * row's length), the logit (logit.h: the band, masks, cap, ALiBi, and the
 * classification of each tile as open, closed, with terms, or mixed), the
 * merges of partial results, and the work list its threads share
 * (engine/schedule.h). A kernel set owns the arithmetic on one tile: dot
 * products, exponentials, accumulation. It reads no option; the one thing it
 * is told of hidden keys is `sparse` (some probabilities are exact zeros
 * whose value rows must not be read into a result).
 * A tile is MR query rows against NR keys:
 *   S is (MR, NR)  logits, row-major, NR floats per row
 *   Q is (MR, D)   pre-scaled queries, row-major, D floats per row (rows past Nq are zero)
 *   Kt is (D, NR)  one key block, transposed: Kt[d * NR + j] = k[j][d] (keys past Nk are zero)
 *   V is (nkeys, Dv) value rows, ldv floats apart, unit stride within a row
 *   O is (MR, Dv)  the running output of the tile, row-major, Dv floats per row
 * m, l and alpha each hold ATTN__STAT_LANES floats, 64-byte aligned, so a
 * kernel may keep row statistics in vector lanes (lanes past MR are its own).
 * Kernels take no locks and know nothing of threads: the framework hands each
 * thread its own S, O and row statistics. */
#ifndef ATTN_CPU_KERNELS_H
#define ATTN_CPU_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attn.h"
#include "../half.h"

#define ATTN__STAT_LANES 64
#define ATTN__MAX_NR 128 /* keys per tile (NR) of any kernel set, at most */

typedef struct attn__cpu_kernels {
  const char *name;
  int mr, nr;
  /* S = Q . Kt for the first nkeys keys (1..NR); a kernel may compute more, and
   * writes finite values (0) to the columns it skips. */
  void (*qk)(float *S, const float *Q, const float *Kt, int64_t D, int64_t nkeys);
  /* Online-softmax step for MR rows of S (masked logits are -inf):
   *   m_new = max(m, max_j S[r][j])  (NaN propagates);  alpha[r] = exp(m - m_new);
   *   S[r][j] = exp(S[r][j] - m_new);  l[r] = l[r] * alpha[r] + sum_j S[r][j];  m = m_new.
   * A row still without a visible key (m_new = -inf) gets P = 0, alpha = 1. */
  void (*softmax)(float *S, float *m, float *l, float *alpha);
  /* O[r][:] = O[r][:] * alpha[r] + sum_{j < nkeys} P[r][j] * V[j][:]. With sparse
   * set, some P[r][j] are exactly 0 for keys hidden from row r, whose V rows
   * may hold Inf or NaN: such a term adds nothing (never 0 * Inf = NaN). Without
   * it every key is visible to every row and a kernel may multiply freely. */
  void (*pv)(float *O, const float *alpha, const float *P, const float *V, int64_t ldv, int64_t Dv, int64_t nkeys,
             int sparse);
  /* Backward pass: S[r][j] = exp(S[r][j] - shift[r]); a row whose shift is -inf becomes 0. */
  void (*exp_shift)(float *S, const float *shift);
  /* Backward pass: dP[r][j] = P[r][j] * (dP[r][j] - Dd[r]) (dS over dP), exactly 0 where P is 0. */
  void (*ds)(const float *P, float *dP, const float *Dd);
  /* Backward pass, transposed accumulate: Out[j][c] += sum_{r < MR} P[r][j] * X[r][c]
   * for j < NR, c < C; Out rows ldo apart, X rows ldx apart (unit stride within rows). */
  void (*pt_acc)(float *Out, int64_t ldo, const float *P, const float *X, int64_t ldx, int64_t C);
  /* Packing, optional (NULL: attn__pack_block_t's portable gather): Kt[f][j] = rows[j * ld + f] for f < F,
   * j < n (n <= NR f32 rows, unit stride), and 0 for n <= j < NR. */
  void (*pack_t)(float *Kt, const float *rows, int64_t ld, int n, int64_t F);
  /* Packing, optional (NULL: a portable loop): dst[2c] = r0[c], dst[2c + 1] = r1[c] for c < n, 16-bit
   * values (the half tiles' V pairs: bits moved, never computed on); returns nonzero when one of those 2n
   * has an exponent of all ones (bf16 Inf or NaN). */
  int (*pack_pairs)(uint16_t *dst, const uint16_t *r0, const uint16_t *r1, int64_t n);
  /* Packing, optional (NULL: half.h's attn__split_row): hi[e], lo[e] for e < n, the split of the f16
   * values src[e] (is_f16), or of the f32 ones rounded to f16, into two bf16 terms (the f16 tiles' hi + lo
   * below), unit stride; bitwise attn__split_row's (NaN stays NaN). */
  void (*split_f16)(uint16_t *hi, uint16_t *lo, const void *src, int is_f16, int64_t n);
} attn__cpu_kernels;

/* Half-precision tiles: bf16 products accumulated in fp32 (vdpbf16ps and the
 * like), on the same MR x NR tile and the same fp32 softmax as `base`. The
 * framework packs every operand as bf16 pairs along the sum's index (with
 * terms = 2, below, each row twice), D2 pairs of q and k padded with zero
 * pairs to a multiple of d2_align:
 *   Qh is (MR, D2) pairs:  Qh[2 (r D2 + t) + e] = q[r][2t + e], unscaled; rows
 *                          past Nq and an odd D's last pair's upper half are 0
 *   Kh is (D2, NR) pairs:  Kh[2 (t NR + j) + e] = k[j][2t + e]; keys past Nk are 0
 *   Vh is a key block's NR / 2 pair rows of v[2 j2 + e][c], 64-byte aligned,
 *                          in groups of ATTN__PV_COLS columns (fewer in Dv's last):
 *                          group c0's pair row j2 at attn__vh_at(Dv, terms, NR, j2,
 *                          c0), its columns side by side (so a tile of a group's
 *                          rows is not confined to a few of L1's sets, as rows of a
 *                          whole Dv of 128, 512 bytes apart, were); keys past Nk are 0
 * qk: S = scale * (Q . K) for the first nkeys keys (columns past them finite).
 * pv: O[r][:] = O[r][:] * alpha[r] + sum_{j < nkeys} bf16(P[r][j]) * V[j][:]:
 *     the probabilities are rounded to bf16 as PyTorch rounds them for P.V.
 *     Keys at or past nkeys are never read into O, nor (with sparse) keys whose
 *     P is 0, as in attn__cpu_kernels.pv (their V may hold Inf or NaN).
 * terms = 2 (f16 inputs on a bf16 unit): each element x is packed as two bf16,
 * hi = bf16(x) and lo = x - hi (exact: f16 has 11 bits), and each packed row
 * holds its hi pairs, then its lo pairs: Qh is (MR, 2 D2), Kh (D2, 2 NR), a
 * Vh group's rows 2 w, the lo pair of element (row, t) at (row, t + the row's
 * hi count). A product sums the four bf16 products, exact in fp32, so q.k and
 * p.v are f16's exact products summed in fp32; pv rounds P to f16 (as PyTorch
 * rounds P to the inputs' type) before splitting it the same way. */
typedef struct attn__half_kernels {
  const char *name;
  const struct attn__cpu_kernels *base; /* softmax, exp_shift */
  int mr, nr; /* the tile it was written for: base's, or this set is not used */
  int d2_align; /* the framework pads D2 (pairs) with zero pairs to a multiple of this: any D is taken */
  int dv_align; /* the shapes it takes: Dv a multiple of this (others go to the next set) */
  int terms;             /* 1: bf16 inputs; 2: f16 inputs, each x as hi + lo (above) */
  /* begin, before a thread's run of qk and pv calls on one work item, and end,
   * after it (NULL: nothing to do): a matrix unit's per-thread state (AMX's
   * tile configuration) lives from one to the other, and nothing between them
   * but these kernels touches it. */
  void (*begin)(void);
  void (*end)(void);
  void (*qk)(float *S, const uint16_t *Qh, const uint16_t *Kh, int64_t D2, int64_t nkeys, float scale);
  void (*pv)(float *O, const float *alpha, const float *P, const uint16_t *Vh, int64_t Dv, int64_t nkeys, int sparse);
  /* Optional (NULL: base's softmax, then pv), for a tile with nothing but scale between its
   * dot products and the softmax, whose logits are finite or -inf (a key hidden from the row, or past the
   * last one) and whose packed values are finite at every key hidden from some row (0 past the last
   * key): a hidden key's P is then 0 and adds nothing, though pv_blocks multiplies every key's value.
   * The rows' maxima follow the base softmax's rule: a row that has seen no finite logit keeps m = -inf
   * and P = 0. (The framework, forward.c, decides which tiles qualify.)
   * softmax_round: base's softmax step on scale * S (scale > 0), with P rounded as pv rounds it written
   *   to Pb (MR, NR) bf16, 64-byte aligned (terms 2: P rounded to f16, its hi plane then its lo plane
   *   MR x NR further, as pv's split), instead of S (S is left as it was or clobbered), except
   *   that m may trail the running maximum by up to 8 (m moves only when a tile's maximum passes it by
   *   more: P <= e^8, and alpha is exactly 1 for most tiles); l and P are exp(. - m) for that m, so
   *   lse = m + log(l) and P / l are the same function either way;
   * pv_blocks: pv on n such blocks in turn (O = O * alpha[b] + Pb[b] . Vh[b] over all NR keys, b = 0..n-1,
   *   each Pb and alpha as softmax_round left them), for O's columns [c0, c0 + ATTN__PV_COLS) (fewer at
   *   Dv's end; c0 a multiple of ATTN__PV_COLS): the sums may stay in the unit from block to block, so
   *   O's columns are read and written once per call, not once per block. The framework calls it for
   *   every c0 of a tile; the result is pv's on each block in turn, whatever n.
   * One pass over S fewer, and none over P. */
  void (*softmax_round)(uint16_t *Pb, float *S, float scale, float *m, float *l, float *alpha);
  void (*pv_blocks)(float *O, int64_t Dv, int64_t c0, int n, const uint16_t *const *Pb, const float *const *alpha,
                    const uint16_t *const *Vh);
  /* The backward's transposed products (NULL: the set has no backward).
   * pairs: one tile X (MR, NR) fp32 (64-byte aligned) as MR / 2 rows of bf16 pairs,
   *   Xp[t * NR + j] = bf16(X[2t][j]) | bf16(X[2t + 1][j]) << 16, rounded as pv rounds P;
   * pt_acc: OutT[c][j] += sum_{r < rows} XT[c * ldx + r] * P[r][j]  for c < C, j < NR,
   *   P's rows as pairs made so (rows / 2, NR); OutT (C, NR) fp32, row-major; XT (C,
   *   rows) bf16, rows ldx apart. rows is a multiple of ATTN__BWD_ROWS_ALIGN and at most
   *   ATTN__BWD_MAX_ROWS; C a multiple of dv_align. Every XT entry and every P entry is
   *   finite (hidden entries are exact zeros).
   * terms = 2: pairs rounds X to f16 and writes the hi terms as above and the lo terms
   *   ATTN__BWD_MAX_ROWS / 2 pair rows after them; XT's lo terms are C rows (C * ldx)
   *   after its hi ones; a product is again the four exact bf16 products. */
  void (*pairs)(uint32_t *Xp, const float *X);
  void (*pt_acc)(float *OutT, int64_t C, const uint32_t *Pp, int64_t rows, const uint16_t *XT, int64_t ldx);
  /* The backward's write-out of such a block, turned: Out[j * ldo + c] = scale * T[c * NR + j] for
   * j < nk, c < C (unit stride within Out's rows). */
  void (*t_out)(float *Out, int64_t ldo, const float *T, int64_t C, int64_t nk, float scale);
  /* Optional (NULL: the decode's vectors): a decode block's q.k on the matrix unit (engine/decode.c),
   * between begin and end, for bf16 q and keys:
   *   S[r][j] = scale * q[r] . K[j] for r < rows, j < nkeys (S as the decode contract's, below; columns
   *   from nkeys to the next multiple of 16 may be written too); K (nkeys, D) bf16 read in place, rows
   *   ldk elements apart; D a multiple of 32 and at most ATTN__DEC_TILE_D; Qp the rows packed as the
   *   tiles' second operand, by groups of 16 rows and steps of 32 of D:
   *   Qp[((t * (D / 32) + s) * 16 + i) * 32 + 2 * n + e] = q[16 t + n][32 s + 2 i + e], zero past rows. */
  void (*dec_qk)(float *S, const uint16_t *Qp, int rows, const uint16_t *K, int64_t ldk, int nkeys, int64_t D,
                 float scale);
  /* Optional (NULL: the decode's vectors), with dec_qk: a decode block's p.v on the matrix unit.
   * dec_pack_v: Vp = the block's nkeys (<= ATTN__DEC_NB) bf16 value rows (ldv elements apart, Dv a
   *   multiple of 32 and at most ATTN__DEC_TILE_D) as the tiles' second operand, zero past nkeys, in
   *   ATTN__DEC_NB * Dv bf16 of Vp (64-byte aligned); returns nonzero when some value is Inf or NaN.
   * dec_pv: O (rows, Dv) = O * alpha[r] + P . V over those keys, P (rows, ATTN__DEC_NB) the softmax's
   *   fp32 probabilities (the decode's pv with Dv = 0: kernels.h's decode contract), each split into
   *   three bf16 terms so that every product is exact and summed in fp32: the vectors' accuracy. Every
   *   key's value meets its P, so a block whose values hold Inf or NaN where P may be 0 (sparse) must
   *   not come here. */
  int (*dec_pack_v)(uint16_t *Vp, const uint16_t *V, int64_t ldv, int nkeys, int64_t Dv);
  void (*dec_pv)(float *O, const float *alpha, const float *P, int rows, const uint16_t *Vp, int nkeys, int64_t Dv);
} attn__half_kernels;
#define ATTN__DEC_TILE_D 256 /* dec_qk's largest D */
#define ATTN__PV_COLS 64 /* O's columns per pv_blocks call, and per group of a packed Vh */

/* The columns of a packed Vh's group from column c0 (a multiple of ATTN__PV_COLS). */
static inline int64_t attn__vh_cols(int64_t Dv, int64_t c0) { return Dv - c0 < ATTN__PV_COLS ? Dv - c0 : ATTN__PV_COLS; }
/* Where pair row j2 of that group starts in a packed Vh key block, in pairs from the block's start:
 * the group's w = attn__vh_cols columns' hi pairs, then with terms = 2 its w lo pairs; rows terms * w
 * pairs apart. The groups before c0 are whole. */
static inline int64_t attn__vh_at(int64_t Dv, int terms, int nr, int64_t j2, int64_t c0) {
  return terms * ((int64_t)(nr / 2) * c0 + j2 * attn__vh_cols(Dv, c0));
}
#define ATTN__BWD_ROWS_ALIGN 32
#define ATTN__BWD_MAX_ROWS 128
/* The half tiles a blocked forward of p runs on, or NULL for fp32 ones (engine/dispatch.c). */
struct attn__dispatch;
struct attn__sdpa;
const attn__half_kernels *attn__dispatch_half(const struct attn__dispatch *d, const struct attn__sdpa *p);
/* The half tiles its backward runs on (bf16 q, k and v), or NULL: the inputs are widened and the backward is fp32. */
const attn__half_kernels *attn__dispatch_half_backward(const struct attn__dispatch *d, const struct attn__sdpa *p);
/* Kh block blk (D2, NR) of a [B, H, N, D] view whose key 0 of the head is at element head, as bf16 pairs
 * (the half tiles' layout above, NR = kn->nr), zero past key Nk and past D; bf16 rows go through kn's
 * pack_t where it has one (engine/forward.c). */
void attn__pack_block_pairs(const attn__cpu_kernels *kn, uint16_t *dst, const attn_tensor *t, int64_t head,
                            int64_t blk, int64_t Nk, int64_t D, int64_t D2, int terms);

extern const attn__cpu_kernels attn__kernels_c;
#ifdef ATTN_HAVE_X86_KERNELS
extern const attn__cpu_kernels attn__kernels_avx2;
extern const attn__cpu_kernels attn__kernels_avx512;
extern const attn__half_kernels attn__half_kernels_avx512bf16;
/* The 6-row fp32 set under the AVX512-BF16 tiles' forward, P rounded to bf16 (avx512/tiles6_bf16.c). */
extern const attn__cpu_kernels attn__kernels_avx512_6p;
void attn__softmax_round_avx512bf16(uint16_t *Pb, float *S, float scale, float *m, float *l, float *alpha);
/* The 16-row fp32 set (amx/tiles16.c) under the AMX tiles and the AVX512-BF16 backward's. */
extern const attn__cpu_kernels attn__kernels_avx512_16;
extern const attn__half_kernels attn__half_kernels_avx512bf16_16;
void attn__softmax_round_amx16(uint16_t *Pb, float *S, float scale, float *m, float *l, float *alpha);
void attn__softmax_round_amx16_f16(uint16_t *Pb, float *S, float scale, float *m, float *l, float *alpha);
#endif
#ifdef ATTN_HAVE_AMX
/* AMX-BF16 tiles (amx/attention_amx.c) on the 16-row fp32 base. */
extern const attn__half_kernels attn__half_kernels_amx;
extern const attn__half_kernels attn__half_kernels_amx_f16;
#endif
/* The decode contract (decode.c streams the keys and values of a few query
 * rows in place, unpacked; see there). A block is at most ATTN__DEC_NB keys:
 *   S is (rows, ATTN__DEC_NB)  logits, ATTN__DEC_NB floats per row
 *   Q is (rows, D)             pre-scaled queries
 *   K is (nkeys, D), V (nkeys, Dv): rows ldk / ldv elements apart, unit stride
 *   O is (rows, Dv)            the running output; m, l: (rows) row statistics */
#ifndef ATTN__DEC_NB /* see decode.c's ATTN__DEC_CHUNK */
#define ATTN__DEC_NB 128
#endif
#define ATTN__DEC_MAX_ROWS_K 8 /* rows per call at most: decode.c calls again for more (internal.h's ATTN__DEC_MAX_ROWS) */
typedef void (*attn__narrow_fn)(void *dst, attn_dtype dt, const float *src, int64_t n, float scale);
typedef struct attn__decode_kernels {
  /* Element types qk and pv read K and V in (bit k: attn_dtype k), widening
   * in registers; the framework widens any other type into f32 rows first.
   * quant.h's ATTN__Q8_0 and ATTN__Q4_0 (a KV cache's blocks) are types too:
   * rows of D / 32 blocks, ldk and ldv then counted in bytes; D, Dv multiples of 32. */
  unsigned dtypes;
  /* S[r][j] = Q[r] . K[j] for r < rows, j < nkeys (other columns untouched).
   * Knext: where the rows past nkeys go on (the next run of a paged cache's
   * blocks), for the read-ahead alone; NULL: in place, ldk after ldk. */
  void (*qk)(float *S, const float *Q, int rows, const void *K, int64_t ldk, int nkeys, int64_t D, attn_dtype kt,
             const void *Knext);
  /* The online-softmax step of kernels.h's softmax on columns j < nkeys of each
   * row (masked logits are -inf; a row with nothing visible yet gets P = 0),
   * then O[r][:] = O[r][:] * alpha[r] + sum_j P[r][j] V[j][:]. S becomes P.
   * sparse: as in attn__cpu_kernels.pv, some keys are hidden from some rows
   * and their V rows must not reach O. Dv = 0: the softmax step alone (O is
   * not touched; alpha[r] is exp(m before - m after), 1 where m stays -inf). */
  void (*pv)(float *O, float *m, float *l, float *S, int rows, const void *V, int64_t ldv, int nkeys, int64_t Dv,
             attn_dtype vt, int sparse, const void *Vnext); /* Vnext: as qk's Knext */
  /* dst[0..n) = src[0..n) widened to f32 from f32, f16 or bf16 (contiguous). */
  void (*widen)(float *dst, const void *src, attn_dtype dt, int64_t n);
  /* dst[0..n) = src[0..n) * scale as f32, f16 or bf16 (contiguous), rounded as attn__store_f32 rounds:
   * the write-out of outputs and gradients in the ISA's vectors. */
  attn__narrow_fn narrow;
} attn__decode_kernels;

/* Where the read-ahead finds row j of a call's n rows, ld bytes apart from
 * base, when they go on at next (NULL: in place). */
static inline const char *attn__dec_ahead(const void *base, int64_t j, int n, int64_t ld, const void *next) {
  return next && j >= n ? (const char *)next + (j - n) * ld : (const char *)base + j * ld;
}

extern const attn__decode_kernels attn__decode_kernels_c;
#ifdef ATTN_HAVE_X86_KERNELS
extern const attn__decode_kernels attn__decode_kernels_avx2;
extern const attn__decode_kernels attn__decode_kernels_avx512;
extern const attn__decode_kernels attn__decode_kernels_avx512_l2; /* the same, reading ahead into L2 (Intel) */
/* and with a KV cache's key blocks widened whole for up to 8 rows and f32 rows read ahead into L1 too
 * (Zen 4); every set gives the same bits */
extern const attn__decode_kernels attn__decode_kernels_avx512_l2_blocks8;
#endif

/* Packs key block blk of one kv head of a [B, Hk, N, F] view (f32, f16 or
 * bf16, widened to f32), transposed, as
 * Kt is laid out: dst[blk][f][jj] for f < F, jj < kn->nr, zero past row Nk (engine/forward.c).
 * base: the element offset of the kv head's key 0 (logit.h's attn__koff). */
void attn__pack_block_t(const attn__cpu_kernels *kn, float *dst, const attn_tensor *t, int64_t base, int64_t blk,
                        int64_t Nk, int64_t F);

#endif
