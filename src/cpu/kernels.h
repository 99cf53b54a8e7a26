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
} attn__cpu_kernels;

extern const attn__cpu_kernels attn__kernels_c;
#ifdef ATTN_HAVE_X86_KERNELS
extern const attn__cpu_kernels attn__kernels_avx2;
extern const attn__cpu_kernels attn__kernels_avx512;
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
#define ATTN__DEC_MAX_ROWS_K 8 /* rows per call at most (internal.h's ATTN__DEC_MAX_ROWS) */
typedef struct attn__decode_kernels {
  /* Element types qk and pv read K and V in (bit k: attn_dtype k), widening
   * in registers; the framework widens any other type into f32 rows first. */
  unsigned dtypes;
  /* S[r][j] = Q[r] . K[j] for r < rows, j < nkeys (other columns untouched). */
  void (*qk)(float *S, const float *Q, int rows, const void *K, int64_t ldk, int nkeys, int64_t D, attn_dtype kt);
  /* The online-softmax step of kernels.h's softmax on columns j < nkeys of each
   * row (masked logits are -inf; a row with nothing visible yet gets P = 0),
   * then O[r][:] = O[r][:] * alpha[r] + sum_j P[r][j] V[j][:]. S becomes P.
   * sparse: as in attn__cpu_kernels.pv, some keys are hidden from some rows
   * and their V rows must not reach O. */
  void (*pv)(float *O, float *m, float *l, float *S, int rows, const void *V, int64_t ldv, int nkeys, int64_t Dv,
             attn_dtype vt, int sparse);
  /* dst[0..n) = src[0..n) widened to f32 from f32, f16 or bf16 (contiguous). */
  void (*widen)(float *dst, const void *src, attn_dtype dt, int64_t n);
} attn__decode_kernels;

extern const attn__decode_kernels attn__decode_kernels_c;
#ifdef ATTN_HAVE_X86_KERNELS
extern const attn__decode_kernels attn__decode_kernels_avx2;
extern const attn__decode_kernels attn__decode_kernels_avx512;
#endif

/* Packs key block blk of kv head (b, g) of a [B, Hk, N, F] view (f32, f16 or
 * bf16, widened to f32), transposed, as
 * Kt is laid out: dst[blk][f][jj] for f < F, jj < nr, zero past row Nk (engine/forward.c). */
void attn__pack_block_t(float *dst, const attn_tensor *t, int64_t b, int64_t g, int64_t blk, int nr, int64_t Nk,
                        int64_t F);

#endif
