/* The blocked backward pass for fp32 on the CPU (FlashAttention's, made deterministic).
 *
 * Scores are recomputed tile by tile from q, k and the forward's log-sum-exp:
 *   P = exp(S - lse), A = P * M (M: dropout's keep/(1-p), else 1),
 *   dP = dO . V^T * M, dS = P * (dP - Dd) with Dd = rowsum(dO * O).
 * Key blocks are dealt to a fixed number of chunks (block b to chunk b mod C),
 * one work item each: a chunk walks its key blocks, accumulating dV += A^T dO
 * and dK += dS^T Q*scale for the block, and dS K into the chunk's own partial
 * dQ. The partials are then summed in chunk order. So every gradient element
 * is summed in one fixed order whatever the thread count (bitwise the same
 * results), no two threads add into the same memory, and there is no second
 * pass recomputing the scores. C does not depend on the threads.
 *
 * bf16 q, k and v on a kernel set with backward tiles (kernels.h's pt_acc;
 * attn__dispatch_half_backward) take the same path on the half tiles, as
 * PyTorch computes its bf16 backward: q.k and dO.v on bf16 pairs, P and dS in
 * fp32 (the same logit, exp_shift and ds as fp32), then dV, dK and dQ with P
 * and dS rounded to bf16, every sum in fp32. A query "tile" is then a group
 * of ATTN__BWD_MAX_ROWS rows (16-row tiles inside), because dV^T += dO^T P and
 * dK^T += Q^T dS sum over a group's rows: q and dO are packed once more,
 * transposed (QT, dOT), and dK, dV are kept transposed per key block and
 * turned when written out. dQ's dS.K is pv's product on K packed as pairs of
 * keys. f16 q, k and v take the same path on the f16 tiles (kernels.h's terms:
 * every packed operand twice, hi and lo, and P, dS and dO rounded to f16). */
#include "../internal.h"
#include "../logit.h"
#include "../cpu/kernels.h"
#include "schedule.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct bwd_scratch {
  float *S, *dP, *Mb, *dK, *dV, *dQ, *ones;
  uint32_t *Pp, *dSp; /* the half path: a query group's P and dS as bf16 pairs of rows (kernels.h's pairs) */
  float *Cf; /* (MR, NR) the logit's slope by its raw q.k (logit.h), where it is not 1 */
  float *base;
} bwd_scratch;

/* Key blocks of a chunk that the half path takes together: each query group's rows (q, dO, both
 * turned, and dQ: 2 KiB a row at D 128) are then read once for BWD_SUPER blocks rather than once a
 * block, from L2 rather than L3, while the blocks' dK and dV (BWD_SUPER x 64 KiB at D 128) stay in L2.
 * Every gradient element is summed in the same order either way. */
#define BWD_SUPER 4
/* Half of a 48 KiB L1 data cache (Intel's since Ice Lake, AMD's since Zen 5). */
#define BWD_L1_HALF (24 * 1024)

/* A thread's buffers, carved from its scratch (the struct sits at its start). */
static size_t bwd_scratch_layout(bwd_scratch *into, int mr, int nr, int64_t D, int64_t Dv, int64_t pair_rows,
                                 int terms) {
  const int64_t up = 16, Dp = D > 0 ? D : 1, Dvp = Dv > 0 ? Dv : 1;
  bwd_scratch sizing, *s = into ? into : &sizing; /* NULL: only the size is wanted */
  float *b = into ? (float *)((char *)into + attn__carve_size(sizeof *s)) : NULL;
  float *pp = NULL, *dsp = NULL;
  float **bufs[] = {&s->S, &s->dP, &s->Mb, &s->dK, &s->dV, &s->dQ, &s->ones, &s->Cf, &pp, &dsp};
  /* the half path keeps dK and dV for a super block, and S, dP, Mb and Cf for a query group's tiles */
  const int64_t kb = pair_rows ? BWD_SUPER : 1, tr = pair_rows ? 2 * pair_rows : mr;
  const int64_t sizes[] = {tr * nr, tr * nr, tr * nr, kb * nr * Dp, kb * nr * Dvp, mr * Dp, ATTN__STAT_LANES, tr * nr,
                           terms * pair_rows * nr, terms * pair_rows * nr};
  int64_t total = 0;
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    if (into) *bufs[i] = b + total;
    total += (sizes[i] + up - 1) / up * up;
  }
  if (into) {
    s->Pp = (uint32_t *)pp, s->dSp = (uint32_t *)dsp;
    s->base = b;
    for (int i = 0; i < ATTN__STAT_LANES; i++) s->ones[i] = 1.0f;
  }
  return attn__carve_size(sizeof *s) + (size_t)total * sizeof(float);
}

/* One query head's rows, packed once per kv head so that every (tile, key
 * block) pair reads them in place: scaled q, dO, lse and Dd = rowsum(dO * O).
 * Rows past Nq (up to a whole tile) are zero, with lse -inf. */
typedef struct bwd_rows {
  float *Q, *dO, *lse, *Dd;
  /* the half path instead of Q and dO: bf16 pairs (nqp, D2), (nqp, Dv2) and transposed (D, nqp), (Dv, nqp);
   * with two terms (f16) each row twice, as kernels.h's terms: (nqp, 2 D2), (nqp, 2 Dv2), (2 D, nqp), (2 Dv, nqp) */
  uint16_t *Qh, *dOh, *QT, *dOT;
} bwd_rows;

/* Everything one pass needs about the problem beyond p. */
typedef struct bwd_args {
  const attn__sdpa *p;
  const attn__cpu_kernels *kn;
  const bwd_rows *rows;       /* [group] for the kv head at hand */
  const float *Kt, *Vt, *Kr;  /* one kv head: Kt (nblk, D, NR), Vt (nblk, Dv, NR), K rows ldk apart */
  int64_t ldk;
  /* the half path: Kt, Vt and Kr hold Kh (nblk, D2, NR) and Vh (nblk, Dv2, NR) as bf16
   * pairs, and K as pairs of keys (ceil(Nk / 2), D), each row twice with two terms */
  const attn__half_kernels *hk;
  int64_t D2, Dv2, nqp;
  attn__narrow_fn narrow; /* the decode kernel set's */
} bwd_args;

/* A tile's buffers for bwd_probs and bwd_dscores: S, dP, the mask's Mb and the cap's slope Cf, each (MR, NR). */
typedef struct bwd_tile {
  float *S, *dP, *Mb, *Cf;
} bwd_tile;

/* For the tile of query rows i0.. of query head h (slot hs in the group) against key block j0, in two
 * steps (the half path takes each for `step` tiles of a query group in turn: pass_item_half):
 * bwd_probs: T->S becomes P (q.k, the logit, exp against lse). Returns the tile's class: CLOSED when
 *   the block is entirely masked for this tile (nothing to add, nor a bwd_dscores), MIXED when some of
 *   its keys are hidden from some rows (dS and A are exactly 0 there).
 * bwd_dscores: T->S becomes A = P * M and T->dP becomes dS. */
static attn__tile_mask bwd_probs(const bwd_args *a, const bwd_tile *T, int64_t b, int64_t h, int64_t hs, int64_t i0,
                                 int64_t j0) {
  const attn__sdpa *p = a->p;
  const attn__cpu_kernels *kn = a->kn;
  const int mr = kn->mr, nr = kn->nr;
  const int64_t nq = attn__queries(p, b);
  if (i0 >= nq) return ATTN__TILE_CLOSED; /* a group's padding */
  const int rows = (int)(nq - i0 < mr ? nq - i0 : mr);
  const attn__tile_mask tm = attn__mask_tile(p, T->Mb, nr, nr, b, h, i0, rows, j0);
  if (tm == ATTN__TILE_CLOSED) return tm;
  const bwd_rows *R = &a->rows[hs];
  const int64_t blk = j0 / nr, nk = attn__key_rows(p, b) - j0 < nr ? attn__key_rows(p, b) - j0 : nr;
  if (a->hk)
    a->hk->qk(T->S, R->Qh + i0 * 2 * a->D2 * a->hk->terms, (const uint16_t *)a->Kt + blk * nr * 2 * a->D2 * a->hk->terms,
              a->D2, nk, (float)p->scale);
  else
    kn->qk(T->S, R->Q + i0 * p->D, a->Kt + blk * nr * p->D, p->D, nk);
  attn__logit_tile(p, T->S, T->Cf, nr, rows, nr, tm, T->Mb); /* keeps the slope for dS */
  kn->exp_shift(T->S, R->lse + i0); /* padded rows have lse -inf: P = 0 */
  return tm;
}

static void bwd_dscores(const bwd_args *a, const bwd_tile *T, int64_t b, int64_t h, int64_t hs, int64_t i0, int64_t j0,
                        int write_mask_grad) {
  const attn__sdpa *p = a->p;
  float *S = T->S, *dP = T->dP;
  const attn__cpu_kernels *kn = a->kn;
  const int mr = kn->mr, nr = kn->nr;
  const int64_t nq = attn__queries(p, b);
  const int rows = (int)(nq - i0 < mr ? nq - i0 : mr);
  const bwd_rows *R = &a->rows[hs];
  const int64_t blk = j0 / nr, nk = attn__key_rows(p, b) - j0 < nr ? attn__key_rows(p, b) - j0 : nr;
  if (a->hk)
    a->hk->qk(dP, R->dOh + i0 * 2 * a->Dv2 * a->hk->terms,
              (const uint16_t *)a->Vt + blk * nr * 2 * a->Dv2 * a->hk->terms, a->Dv2, nk, 1.0f);
  else
    kn->qk(dP, R->dO + i0 * p->Dv, a->Vt + blk * nr * p->Dv, p->Dv, nk);
  if (p->dropout_p > 0) { /* dP * M before dS; A = P * M after */
    const float keep_scale = attn__dropout_scale(p);
    float *M = T->Mb; /* free again: the mask is in S */
    for (int r = 0; r < mr; r++)
      for (int jj = 0; jj < nr; jj++)
        M[r * nr + jj] = r < rows && jj < nk && attn__dropout_kept(p, b, h, i0 + r, j0 + jj)
                             ? keep_scale : 0.0f;
    for (int e = 0; e < mr * nr; e++) dP[e] *= M[e];
    kn->ds(S, dP, R->Dd + i0);
    for (int e = 0; e < mr * nr; e++) S[e] *= M[e];
  } else {
    kn->ds(S, dP, R->Dd + i0);
  }
  if (write_mask_grad) {
    const attn_tensor *mg = p->mask_grad;
    for (int r = 0; r < rows; r++) {
      float *m = (float *)mg->data + attn__qoff(p, mg, b, h, i0 + r);
      for (int64_t jj = 0; jj < nk; jj++) m[(j0 + jj) * mg->strides[3]] = dP[r * nr + jj];
    }
  }
  /* dq and dk need the gradient of the raw logit (the mask's is above). A
   * hidden key's slope may be NaN (its q.k was); its dS stays exactly 0. */
  if (attn__logit_has_slope(p))
    for (int e = 0; e < rows * nr; e++)
      if (dP[e] != 0) dP[e] *= T->Cf[e];
}

// Item (c, r) of kv head (b, g): key blocks blk = c, c + C, ... against the query tiles t = r, r + R, ...
// of every query head of the group. Writes those blocks' dk and dv rows (into split r's partials dKr, dVr
// [Nk][D], [Nk][Dv] when R > 1, else into dk, dv), and adds dS.K into chunk c's dQ partials dQc [group][nqp][D]
// (tiles of split r only: every item writes memory of its own).
static void pass_item(const bwd_args *a, bwd_scratch *s, attn_tensor *dk, attn_tensor *dv, float *dQc, float *dKr,
                      float *dVr, int64_t nqp, int64_t b, int64_t g, int64_t c, int64_t C, int64_t r, int64_t R) {
  const attn__sdpa *p = a->p;
  const int mr = a->kn->mr, nr = a->kn->nr;
  const int64_t Nk = attn__key_rows(p, b), nblk = (Nk + nr - 1) / nr;
  for (int64_t hs = 0; hs < p->group; hs++)
    for (int64_t t = r; t * mr < nqp; t += R) memset(dQc + (hs * nqp + t * mr) * p->D, 0, (size_t)(mr * p->D) * sizeof(float));
  for (int64_t blk = c; blk < nblk; blk += C) {
    const int64_t j0 = blk * nr, nk = Nk - j0 < nr ? Nk - j0 : nr;
    memset(s->dK, 0, (size_t)(nr * p->D) * sizeof(float));
    memset(s->dV, 0, (size_t)(nr * p->Dv) * sizeof(float));
    int64_t t0 = attn__first_row_seeing(p, b, j0) / mr;
    const int64_t iend = attn__rows_seeing_end(p, b, j0 + nk);
    t0 += ((r - t0) % R + R) % R; /* the first tile of split r from t0 */
    for (int64_t hs = 0; hs < p->group; hs++) {
      const int64_t h = g * p->group + hs;
      const bwd_rows *Rw = &a->rows[hs];
      for (int64_t t = t0; t * mr < iend; t += R) {
        const bwd_tile T = {s->S, s->dP, s->Mb, s->Cf};
        const attn__tile_mask tm = bwd_probs(a, &T, b, h, hs, t * mr, j0);
        if (tm == ATTN__TILE_CLOSED) continue;
        bwd_dscores(a, &T, b, h, hs, t * mr, j0, p->mask_grad != NULL);
        /* hidden entries are exact zeros in A and dS, times finite dO and Q rows; the
         * K rows of hidden keys are another matter: pv runs sparse there */
        a->kn->pt_acc(s->dV, p->Dv, s->S, Rw->dO + t * mr * p->Dv, p->Dv, p->Dv);
        a->kn->pt_acc(s->dK, p->D, s->dP, Rw->Q + t * mr * p->D, p->D, p->D);
        a->kn->pv(dQc + (hs * nqp + t * mr) * p->D, s->ones, s->dP, a->Kr + j0 * a->ldk, a->ldk, p->D, nk,
                  tm == ATTN__TILE_MIXED);
      }
    }
    if (R > 1) {
      memcpy(dKr + j0 * p->D, s->dK, (size_t)(nk * p->D) * sizeof(float));
      memcpy(dVr + j0 * p->Dv, s->dV, (size_t)(nk * p->Dv) * sizeof(float));
      continue;
    }
    for (int64_t jj = 0; jj < nk; jj++) {
      attn__narrow_strided(dk->data, dk->dtype, attn__koff(p, dk, b, g, j0 + jj), dk->strides[3], s->dK + jj * p->D,
                           p->D, 1.0f);
      attn__narrow_strided(dv->data, dv->dtype, attn__koff(p, dv, b, g, j0 + jj), dv->strides[3], s->dV + jj * p->Dv,
                           p->Dv, 1.0f);
    }
  }
}

/* The half path's QT and dOT rows: nqp entries and 64 bytes more, so that a row's transposed
 * writes (one per column, 2 nqp bytes apart) do not all fall in one L1 set when nqp is a
 * multiple of 2048. */
static int64_t t_ld(int64_t nqp) { return nqp + 32; }

/* Keys j < nk of a gradient t (f32, f16 or bf16) from offset off = scale * T[c * nr + j], T a key block
 * kept turned (C, nr). A head's keys are strides[2] apart, packed batch or not. */
static void write_turned(const attn__half_kernels *hk, attn__narrow_fn narrow, const attn_tensor *t, int64_t off,
                         const float *T, int64_t C, int64_t nk, int nr, float scale) {
  if (t->dtype == ATTN_F32 && t->strides[3] == 1) {
    hk->t_out((float *)t->data + off, t->strides[2], T, C, nk, scale);
    return;
  }
  if (t->strides[3] == 1) { /* halves: turned in f32 by t_out, 16 keys by up to 256 columns, then rounded row by row */
    enum { KEYS = 16, COLS = 256 };
    float buf[KEYS * COLS];
    for (int64_t j0 = 0; j0 < nk; j0 += KEYS) {
      const int64_t m = nk - j0 < KEYS ? nk - j0 : KEYS;
      for (int64_t c0 = 0; c0 < C; c0 += COLS) {
        const int64_t cw = C - c0 < COLS ? C - c0 : COLS;
        hk->t_out(buf, cw, T + c0 * nr + j0, cw, m, scale);
        for (int64_t jj = 0; jj < m; jj++) {
          const int64_t at = off + (j0 + jj) * t->strides[2] + c0;
          narrow((uint16_t *)t->data + at, t->dtype, buf + jj * cw, cw, 1.0f);
        }
      }
    }
    return;
  }
  for (int64_t jj = 0; jj < nk; jj++)
    for (int64_t c = 0; c < C; c++)
      attn__store_f32(t->data, t->dtype, off + jj * t->strides[2] + c * t->strides[3], T[c * nr + jj] * scale);
}

/* pass_item on the half tiles: query groups (ATTN__BWD_MAX_ROWS rows) in place of tiles, dK and dV kept
 * transposed, (D, NR) and (Dv, NR), in s->dK and s->dV, and dK's scale applied as a block is written.
 * The chunk's blocks go BWD_SUPER at a time, each query group meeting all of them in turn: a block's
 * dK and dV still sum the groups in order, and a row's dQ the blocks in order. */
static void pass_item_half(const bwd_args *a, bwd_scratch *s, attn_tensor *dk, attn_tensor *dv, float *dQc, float *dKr,
                           float *dVr, int64_t b, int64_t g, int64_t c, int64_t C, int64_t r, int64_t R) {
  const attn__sdpa *p = a->p;
  const attn__half_kernels *hk = a->hk;
  const int mr = a->kn->mr, nr = a->kn->nr, qg = ATTN__BWD_MAX_ROWS;
  const int64_t Nk = attn__key_rows(p, b), nblk = (Nk + nr - 1) / nr, nqp = a->nqp, D = p->D, Dv = p->Dv;
  const float scale = (float)p->scale;
  /* A group's tiles go through the steps of a block (P, then dS and its pairs, then dS.K) `step` tiles
   * at a time. Where the block's three operands (K and V as pairs, K as pairs of keys) fit in half of
   * L1 they stay there from tile to tile anyway, and a tile at a time keeps its own S and dP (4 KiB
   * each) in L1 from step to step: bf16 at D 64. Larger, the whole group takes each step in turn, so
   * that the step's operand stays in L1 across the tiles while S and dP (the group's: 32 KiB each) come
   * from L2 (bf16 at D 128: a tile at a time measured 0.88x). Sums run in the same order either way. */
  const int64_t operand_bytes = 3 * (int64_t)nr * (D > Dv ? D : Dv) * 2 * hk->terms;
  const int step = operand_bytes <= BWD_L1_HALF ? 1 : qg / mr;
  for (int64_t hs = 0; hs < p->group; hs++)
    for (int64_t t = r; t * qg < nqp; t += R) memset(dQc + (hs * nqp + t * qg) * D, 0, (size_t)(qg * D) * sizeof(float));
  for (int64_t blk0 = c; blk0 < nblk; blk0 += BWD_SUPER * C) {
    int64_t t0[BWD_SUPER], iend[BWD_SUPER], tmin = INT64_MAX, imax = 0;
    int nb = 0;
    for (int64_t blk = blk0; blk < nblk && nb < BWD_SUPER; blk += C, nb++) {
      const int64_t j0 = blk * nr, nk = Nk - j0 < nr ? Nk - j0 : nr;
      memset(s->dK + nb * nr * D, 0, (size_t)(nr * D) * sizeof(float));
      memset(s->dV + nb * nr * Dv, 0, (size_t)(nr * Dv) * sizeof(float));
      t0[nb] = attn__first_row_seeing(p, b, j0) / qg;
      t0[nb] += ((r - t0[nb]) % R + R) % R; /* the first group of split r from there */
      iend[nb] = attn__rows_seeing_end(p, b, j0 + nk);
      tmin = t0[nb] < tmin ? t0[nb] : tmin;
      imax = iend[nb] > imax ? iend[nb] : imax;
    }
    for (int64_t hs = 0; hs < p->group; hs++) {
      const int64_t h = g * p->group + hs;
      const bwd_rows *Rw = &a->rows[hs];
      for (int64_t t = tmin; t * qg < imax; t += R)
        for (int k = 0; k < nb; k++) {
          if (t < t0[k] || t * qg >= iend[k]) continue;
          const int64_t blk = blk0 + k * C, j0 = blk * nr, nk = Nk - j0 < nr ? Nk - j0 : nr;
          const uint16_t *Kv = (const uint16_t *)(a->Kr + blk * (nr / 2) * D * hk->terms);
          int open = 0;
          for (int s0 = 0; s0 < qg / mr; s0 += step) {
            attn__tile_mask tm[ATTN__BWD_MAX_ROWS]; /* step tiles: at most a row each */
            bwd_tile T[ATTN__BWD_MAX_ROWS];
            for (int sub = s0; sub < s0 + step; sub++) {
              const int64_t i0 = t * qg + sub * mr, e = (int64_t)(sub - s0) * mr * nr;
              T[sub - s0] = (bwd_tile){s->S + e, s->dP + e, s->Mb + e, s->Cf + e};
              tm[sub - s0] = i0 < iend[k] ? bwd_probs(a, &T[sub - s0], b, h, hs, i0, j0) : ATTN__TILE_CLOSED;
              open |= tm[sub - s0] != ATTN__TILE_CLOSED;
            }
            for (int sub = s0; sub < s0 + step; sub++) {
              uint32_t *Pp = s->Pp + sub * (mr / 2) * nr, *dSp = s->dSp + sub * (mr / 2) * nr;
              if (tm[sub - s0] == ATTN__TILE_CLOSED) { /* zeros in the group's sums (each term's plane) */
                for (int term = 0; term < hk->terms; term++) {
                  memset(Pp + term * (qg / 2) * nr, 0, (size_t)(mr / 2 * nr) * sizeof(uint32_t));
                  memset(dSp + term * (qg / 2) * nr, 0, (size_t)(mr / 2 * nr) * sizeof(uint32_t));
                }
                continue;
              }
              bwd_dscores(a, &T[sub - s0], b, h, hs, t * qg + sub * mr, j0, p->mask_grad != NULL);
              hk->pairs(Pp, T[sub - s0].S);
              hk->pairs(dSp, T[sub - s0].dP);
            }
            for (int sub = s0; sub < s0 + step; sub++)
              if (tm[sub - s0] != ATTN__TILE_CLOSED)
                hk->pv(dQc + (hs * nqp + t * qg + sub * mr) * D, s->ones, T[sub - s0].dP, Kv, D, nk,
                       tm[sub - s0] == ATTN__TILE_MIXED);
          }
          if (!open) continue;
          hk->pt_acc(s->dV + k * nr * Dv, Dv, s->Pp, qg, Rw->dOT + t * qg, t_ld(nqp));
          hk->pt_acc(s->dK + k * nr * D, D, s->dSp, qg, Rw->QT + t * qg, t_ld(nqp));
        }
    }
    for (int k = 0; k < nb; k++) {
      const int64_t j0 = (blk0 + k * C) * nr, nk = Nk - j0 < nr ? Nk - j0 : nr;
      const float *dKb = s->dK + k * nr * D, *dVb = s->dV + k * nr * Dv;
      if (R > 1) {
        hk->t_out(dKr + j0 * D, D, dKb, D, nk, scale);
        hk->t_out(dVr + j0 * Dv, Dv, dVb, Dv, nk, 1.0f);
        continue;
      }
      write_turned(hk, a->narrow, dk, attn__koff(p, dk, b, g, j0), dKb, D, nk, nr, scale);
      write_turned(hk, a->narrow, dv, attn__koff(p, dv, b, g, j0), dVb, Dv, nk, nr, 1.0f);
    }
  }
}

/* sum_c x[c] * t[off + c * strides[3]] for c < n, in double: eight running sums (lane c % 8), then added
 * in lane order, a fixed order that vectorises (one chain of n dependent adds did not: it was most of the
 * backward's packing time) */
static double dot_double(const float *x, const attn_tensor *t, int64_t off, int64_t n) {
  double lane[8] = {0};
  float buf[64]; /* t's elements widened, 64 at a time (a multiple of 8: each c keeps its lane) */
  for (int64_t c0 = 0; c0 < n; c0 += 64) {
    const int64_t m = n - c0 < 64 ? n - c0 : 64;
    const float *y = buf;
    if (t->dtype == ATTN_F32 && t->strides[3] == 1) y = (const float *)t->data + off + c0;
    else attn__widen_strided(buf, t->data, t->dtype, off + c0 * t->strides[3], t->strides[3], m);
    int64_t c = 0;
    for (; c + 8 <= m; c += 8)
      for (int e = 0; e < 8; e++) lane[e] += (double)x[c0 + c + e] * y[c + e];
    for (; c < m; c++) lane[c % 8] += (double)x[c0 + c] * y[c];
  }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

/* Packs query row i of head h into slot R: scaled q, dO, lse, and Dd in double. */
static void pack_row(const attn__sdpa *p, const bwd_rows *R, const attn_tensor *dout, const attn_tensor *out,
                     const attn_tensor *lse, int64_t b, int64_t h, int64_t i) {
  float *qd = R->Q + i * p->D, *od = R->dO + i * p->Dv;
  if (i >= attn__queries(p, b)) {
    memset(qd, 0, (size_t)p->D * sizeof(float));
    memset(od, 0, (size_t)p->Dv * sizeof(float));
    R->lse[i] = -INFINITY;
    R->Dd[i] = 0;
    return;
  }
  const attn_tensor *q = &p->q;
  const float scale = (float)p->scale;
  /* f16 and bf16 inputs are widened here, as they are read */
  attn__widen_strided(qd, q->data, q->dtype, attn__qoff(p, q, b, h, i), q->strides[3], p->D);
  for (int64_t d = 0; d < p->D; d++) qd[d] *= scale;
  attn__widen_strided(od, dout->data, dout->dtype, attn__qoff(p, dout, b, h, i), dout->strides[3], p->Dv);
  R->lse[i] = ((const float *)lse->data)[attn__qoff(p, lse, b, h, i)];
  R->Dd[i] = (float)dot_double(od, out, attn__qoff(p, out, b, h, i), p->Dv); /* subtracted from every dP of the row */
}

/* pack_row for the half path: q as bf16 pairs, dO rounded to bf16 the same way (turn_rows then
 * transposes both into QT and dOT), lse, and Dd in double from that dO and out as given. Rows past Nq:
 * zeros, lse -inf.
 * terms 2 (f16 q): q split into hi + lo (exact), dO rounded to f16 and split, as kernels.h's terms. */
static void pack_row_half(const attn__cpu_kernels *kn, const attn__sdpa *p, const bwd_rows *R, int64_t D2, int64_t Dv2,
                          int terms, const attn_tensor *dout, const attn_tensor *out, const attn_tensor *lse, int64_t b, int64_t h,
                          int64_t i) {
  uint16_t *qh = R->Qh + i * 2 * D2 * terms, *oh = R->dOh + i * 2 * Dv2 * terms;
  memset(qh, 0, (size_t)(2 * D2 * terms) * sizeof(uint16_t));
  memset(oh, 0, (size_t)(2 * Dv2 * terms) * sizeof(uint16_t));
  if (i >= attn__queries(p, b)) {
    R->lse[i] = -INFINITY;
    R->Dd[i] = 0;
    return;
  }
  const attn_tensor *q = &p->q;
  const int64_t sq = q->strides[3];
  const uint16_t *qs = (const uint16_t *)q->data + attn__qoff(p, q, b, h, i); /* bf16 or f16 (the dispatch's condition) */
  if (terms == 2 && kn->split_f16 && sq == 1) {
    kn->split_f16(qh, qh + 2 * D2, qs, 1, p->D);
  } else if (terms == 2) {
    attn__split_row(qh, qh + 2 * D2, qs, 1, 0, sq, p->D);
  } else if (sq == 1) {
    memcpy(qh, qs, (size_t)p->D * sizeof(uint16_t));
  } else {
    for (int64_t d = 0; d < p->D; d++) qh[d] = qs[d * sq];
  }
  const int64_t go = attn__qoff(p, dout, b, h, i), oo = attn__qoff(p, out, b, h, i);
  double dd = 0;
  float g[64]; /* dO, 64 columns at a time: widened, rounded to the inputs' type as the products see it, and back */
  const int as_stored = terms == 1 && dout->dtype == ATTN_BF16 && dout->strides[3] == 1; /* bf16 already */
  /* f16 or f32 dO split on the kernel set's vectors (bitwise attn__split_row's); the f16 value is hi + lo */
  const int split_vec = terms == 2 && kn->split_f16 && dout->strides[3] == 1 &&
                        (dout->dtype == ATTN_F16 || dout->dtype == ATTN_F32);
  for (int64_t c0 = 0; c0 < p->Dv; c0 += 64) {
    const int64_t n = p->Dv - c0 < 64 ? p->Dv - c0 : 64;
    if (split_vec) {
      kn->split_f16(oh + c0, oh + 2 * Dv2 + c0, (const char *)dout->data + (go + c0) * (int64_t)attn_dtype_size(dout->dtype),
                    dout->dtype == ATTN_F16, n);
      for (int64_t c = 0; c < n; c++) g[c] = attn__bf16_to_f32(oh[c0 + c]) + attn__bf16_to_f32(oh[2 * Dv2 + c0 + c]);
    } else if (as_stored) {
      memcpy(oh + c0, (const uint16_t *)dout->data + go + c0, (size_t)n * sizeof(uint16_t));
      for (int64_t c = 0; c < n; c++) g[c] = attn__bf16_to_f32(oh[c0 + c]);
    } else {
      attn__widen_strided(g, dout->data, dout->dtype, go + c0 * dout->strides[3], dout->strides[3], n);
      for (int64_t c = 0; c < n && terms == 2; c++) {
        g[c] = attn__round_to_f16(g[c]);
        attn__split_half_value(g[c], &oh[c0 + c], &oh[2 * Dv2 + c0 + c]);
      }
      for (int64_t c = 0; c < n && terms == 1; c++) {
        oh[c0 + c] = attn__f32_to_bf16(g[c]);
        g[c] = attn__bf16_to_f32(oh[c0 + c]);
      }
    }
    /* from the dO the products see: sum_j P dP = Dd holds for it, and dS sums to 0 over a row */
    dd += dot_double(g, out, oo + c0 * out->strides[3], n);
  }
  R->lse[i] = ((const float *)lse->data)[attn__qoff(p, lse, b, h, i)];
  R->Dd[i] = (float)dd;
}

/* QT and dOT columns [i0, i0 + n) from rows i0.. of Qh and dOh (the hi terms, then with terms 2 the lo
 * ones): a block of rows at a time, so each row of QT and dOT gets n entries side by side. */
static void turn_rows(const bwd_rows *R, int64_t D, int64_t Dv, int64_t D2, int64_t Dv2, int64_t nqp, int terms,
                      int64_t i0, int n) {
  const int64_t ld = t_ld(nqp), qrow = 2 * D2 * terms, orow = 2 * Dv2 * terms;
  for (int term = 0; term < terms; term++) {
    for (int64_t d = 0; d < D; d++) {
      const uint16_t *src = R->Qh + i0 * qrow + term * 2 * D2 + d;
      uint16_t *dst = R->QT + (term * D + d) * ld + i0;
      for (int ii = 0; ii < n; ii++) dst[ii] = src[ii * qrow];
    }
    for (int64_t c = 0; c < Dv; c++) {
      const uint16_t *src = R->dOh + i0 * orow + term * 2 * Dv2 + c;
      uint16_t *dst = R->dOT + (term * Dv + c) * ld + i0;
      for (int ii = 0; ii < n; ii++) dst[ii] = src[ii * orow];
    }
  }
}

/* dsink_h = -sum_{b, i} exp(sink_h - lse_i) Dd_i with Dd_i = dO_i . out_i: one
 * serial pass in double, in (b, i) order, so no thread count changes the sum.
 * O(B Hq Nq Dv), small beside the pass above. */
static void sinks_grad(const attn__sdpa *p, const attn_tensor *dout, const attn_tensor *out, const attn_tensor *lse) {
  const attn_tensor *sg = p->sinks_grad;
  for (int64_t h = 0; h < p->Hq; h++) {
    const double sink = attn__sink(p, h);
    double acc = 0;
    for (int64_t b = 0; b < attn__seqs(p); b++)
      for (int64_t i = 0; i < attn__queries(p, b); i++) {
        const float l = ((const float *)lse->data)[attn__qoff(p, lse, b, h, i)];
        if (l == -INFINITY) continue; /* nothing to renormalise */
        const int64_t go = attn__qoff(p, dout, b, h, i), oo = attn__qoff(p, out, b, h, i);
        double dd = 0;
        for (int64_t c = 0; c < p->Dv; c++)
          dd += (double)attn__load_f32(dout->data, dout->dtype, go + c * dout->strides[3]) *
                attn__load_f32(out->data, out->dtype, oo + c * out->strides[3]);
        if (dd != 0) acc -= exp(sink - (double)l) * dd;
      }
    ((float *)sg->data)[h * sg->strides[0]] = (float)acc;
  }
}

/* Zeros every element of an f32, f16 or bf16 output (a no-op for an empty one, whatever its shape). */
static void zero_output(attn_tensor *t) {
  const int64_t n = attn_tensor_numel(t);
  if (n <= 0) return;
  int64_t idx[ATTN_MAX_RANK] = {0}, off = 0;
  for (int64_t e = 0; e < n; e++) {
    attn__store_f32(t->data, t->dtype, off, 0.0f);
    for (int i = t->rank - 1; i >= 0; i--) {
      if (++idx[i] < t->shape[i]) {
        off += t->strides[i];
        break;
      }
      off -= t->strides[i] * (t->shape[i] - 1);
      idx[i] = 0;
    }
  }
}

/* The backward's work list. Each kv head (b, g) is a grid of C key chunks by
 * R query splits: item (c, r) takes key blocks c, c + C, ... against query
 * tiles r, r + R, ... (interleaved, so a causal mask leaves the items nearly
 * even). dQ sums over chunks and dK, dV over splits, each in a later phase in
 * index order. C and R come from the shape alone (4 items per kv head with
 * 8 kv heads or more, else enough for 64 threads, at most 8 x 8 per head), so
 * no thread count changes a sum. Kv heads are packed in rounds.
 * In a packed batch each sequence's C and R are those it would have alone
 * (B = 1), so its gradients are summed as they would be alone; per-slot
 * buffers are sized for the largest, and off[phase][bg] counts the items of
 * the kv heads before bg. */
#ifndef GRID_ITEMS
#define GRID_ITEMS 64
#endif
#define GRID_MAX 8
#ifndef PACK_BUDGET
#define PACK_BUDGET ((int64_t)2 << 20)
#endif

/* One batch's (or sequence's) shape in tiles, blocks, chunks and splits. */
typedef struct bwd_geom {
  int64_t nq, nk, nblk, ntiles, nqp, C, R;
} bwd_geom;

enum { PH_KV, PH_ROWS, PH_KR, PH_GRID, PH_DQ, PH_DKV, PH_N };

typedef struct bwd_job {
  const attn__sdpa *p;
  const attn__cpu_kernels *kn;
  attn__narrow_fn narrow; /* the decode kernel set's: gradients written out in the ISA's vectors */
  const attn__half_kernels *hk; /* NULL: fp32 */
  int64_t D2, Dv2;              /* the half path's pairs of q and k, of dO and v (padded) */
  attn_tensor *dq, *dk, *dv;
  const attn_tensor *dout, *out, *lse;
  int64_t pairs, per_round, grid_pairs, nqp_max;
  int k_unit;
  /* per slot of a round: */
  int64_t kt_size, vt_size, kr_size, rows_size, dq_size, dk_size, dv_size;
  float *Kt, *Vt, *Kr, *Rows, *dQp, *dKp, *dVp;
  bwd_rows *rows; /* [per_round][group]: views into Rows */
  int64_t per[PH_N];
  int64_t *off[PH_N]; /* a packed batch's prefix sums ([pairs + 1] each), else NULL */
} bwd_job;

/* Query rows per tile of the work grid: the kernels' tile, or the half path's group. */
static int grid_rows(const bwd_job *j) { return j->hk ? ATTN__BWD_MAX_ROWS : j->kn->mr; }

static bwd_geom geom(const bwd_job *j, int64_t b) {
  const attn__sdpa *p = j->p;
  const int mr = grid_rows(j), nr = j->kn->nr;
  bwd_geom e;
  e.nq = attn__queries(p, b), e.nk = attn__key_rows(p, b);
  e.nblk = (e.nk + nr - 1) / nr, e.ntiles = (e.nq + mr - 1) / mr, e.nqp = e.ntiles * mr;
  /* items per kv head: 4 (0.1's chunks) with 8 kv heads or more, else
   * enough for GRID_ITEMS threads; chunks first, query splits only where
   * chunks cannot make the items (their dK, dV partials cost more) */
  const int64_t need = j->grid_pairs >= 8 ? 4 : (GRID_ITEMS + j->grid_pairs - 1) / j->grid_pairs;
  e.C = need < GRID_MAX ? need : GRID_MAX;
  e.C = e.C < e.nblk ? e.C : e.nblk;
  if (e.C == 0 || e.ntiles == 0) { /* no keys or no rows: nothing flows; the sums write zeros */
    e.C = e.R = 0;
    return e;
  }
  e.R = need > e.C ? (need + e.C - 1) / e.C : 1;
  e.R = e.R < GRID_MAX ? e.R : GRID_MAX;
  e.R = e.R < e.ntiles ? e.R : e.ntiles;
  return e;
}

/* Items of phase ph for kv head bg. */
/* Query rows a pack_rows item takes: the half path's transposed copies are written a block of rows at a time. */
static int rows_per_item(const bwd_job *j) { return j->hk ? 16 : 1; }

static int64_t pair_items(const bwd_job *j, int ph, int64_t bg) {
  const bwd_geom e = geom(j, bg / j->p->Hk);
  switch (ph) {
    case PH_KV: return e.nblk;
    case PH_ROWS: return j->p->group * e.nqp / rows_per_item(j);
    case PH_KR: return j->k_unit || j->hk ? 0 : e.nk;
    case PH_GRID: return e.C * e.R;
    case PH_DQ: return j->p->group * e.nq;
    default: return e.R > 1 || e.C * e.R == 0 ? e.nk : 0;
  }
}

static int64_t items_before(const bwd_job *j, int ph, int64_t bg) {
  return j->off[ph] ? j->off[ph][bg] : bg * j->per[ph];
}

/* The kv head of item w of phase ph in round `round`, and *local, its index among the head's items. */
static int64_t item_pair(const bwd_job *j, int ph, int64_t round, int64_t w, int64_t *local) {
  w += items_before(j, ph, round * j->per_round);
  const int64_t bg = j->off[ph] ? attn__seq_at(j->off[ph], j->pairs, w) : w / j->per[ph];
  *local = w - items_before(j, ph, bg);
  return bg;
}

static int64_t round_items(const bwd_job *j, int ph, int64_t round) {
  const int64_t first = round * j->per_round, end = j->pairs - first < j->per_round ? j->pairs : first + j->per_round;
  return items_before(j, ph, end) - items_before(j, ph, first);
}

static bwd_rows slot_row(const bwd_job *j, int64_t slot, int64_t hs) { return j->rows[slot * j->p->group + hs]; }

static int64_t zero_mask_grad_items(const void *arg, int64_t round) {
  const bwd_job *j = arg;
  return round == 0 && j->p->mask_grad ? j->p->B * j->p->Hq * j->p->Nq : 0;
}

/* mask_grad's rows: the passes write the visible tiles only (no packed batch has a mask) */
static void zero_mask_grad_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)scratch, (void)round;
  const bwd_job *j = arg;
  const attn__sdpa *p = j->p;
  const attn_tensor *mg = p->mask_grad;
  for (int64_t row = first; row < last; row++) {
    const int64_t i = row % p->Nq, h = (row / p->Nq) % p->Hq, b = row / (p->Nq * p->Hq);
    float *m = (float *)mg->data + b * mg->strides[0] + h * mg->strides[1] + i * mg->strides[2];
    for (int64_t jk = 0; jk < p->Nk; jk++) m[jk * mg->strides[3]] = 0.0f;
  }
}

static int64_t pack_kv_items(const void *arg, int64_t round) { return round_items(arg, PH_KV, round); }

static void pack_kv_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)scratch;
  const bwd_job *j = arg;
  const attn__sdpa *p = j->p;
  for (int64_t w = first; w < last; w++) {
    int64_t blk;
    const int64_t bg = item_pair(j, PH_KV, round, w, &blk), slot = bg - round * j->per_round;
    const int64_t b = bg / p->Hk, g = bg % p->Hk, nk = attn__key_rows(p, b);
    if (j->hk) {
      const int nr = j->kn->nr, terms = j->hk->terms;
      attn__pack_block_pairs(j->kn, (uint16_t *)(j->Kt + slot * j->kt_size), &p->k, attn__koff(p, &p->k, b, g, 0), blk,
                             nk, p->D, j->D2, terms);
      attn__pack_block_pairs(j->kn, (uint16_t *)(j->Vt + slot * j->vt_size), &p->v, attn__koff(p, &p->v, b, g, 0), blk,
                             nk, p->Dv, j->Dv2, terms);
      /* K as pv's values for dS.K (kernels.h's Vh with D columns), zero past Nk */
      uint16_t *kv = (uint16_t *)(j->Kr + slot * j->kr_size) + blk * nr * p->D * terms;
      const uint16_t *kd = p->k.data; /* bf16 or f16 (the dispatch's condition) */
      for (int jj = 0; jj < nr; jj++) {
        const int64_t key = blk * nr + jj, off = key < nk ? attn__koff(p, &p->k, b, g, key) : 0;
        for (int64_t c0 = 0; c0 < p->D; c0 += ATTN__PV_COLS) {
          const int64_t cw = attn__vh_cols(p->D, c0);
          uint16_t *o = kv + 2 * attn__vh_at(p->D, terms, nr, jj / 2, c0) + (jj & 1);
          if (terms == 2 && j->kn->split_f16 && p->k.strides[3] == 1 && key < nk) { /* on vectors, then interleaved */
            uint16_t hi[ATTN__PV_COLS], lo[ATTN__PV_COLS];
            j->kn->split_f16(hi, lo, kd + off + c0, 1, cw);
            for (int64_t d = 0; d < cw; d++) o[2 * d] = hi[d], o[2 * (cw + d)] = lo[d];
            continue;
          }
          for (int64_t d = 0; d < cw; d++) {
            const uint16_t x = key < nk ? kd[off + (c0 + d) * p->k.strides[3]] : 0;
            if (terms == 2) attn__split_f16(x, &o[2 * d], &o[2 * (cw + d)]);
            else o[2 * d] = x;
          }
        }
      }
      continue;
    }
    attn__pack_block_t(j->kn, j->Kt + slot * j->kt_size, &p->k, attn__koff(p, &p->k, b, g, 0), blk, nk, p->D);
    attn__pack_block_t(j->kn, j->Vt + slot * j->vt_size, &p->v, attn__koff(p, &p->v, b, g, 0), blk, nk, p->Dv);
  }
}

static int64_t pack_rows_items(const void *arg, int64_t round) { return round_items(arg, PH_ROWS, round); }

static void pack_rows_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)scratch;
  const bwd_job *j = arg;
  const attn__sdpa *p = j->p;
  int64_t nqp = 0, geom_bg = -1;
  for (int64_t w = first; w < last; w++) {
    int64_t local;
    const int64_t bg = item_pair(j, PH_ROWS, round, w, &local), slot = bg - round * j->per_round;
    if (bg != geom_bg) nqp = geom(j, bg / p->Hk).nqp, geom_bg = bg;
    const int rpi = rows_per_item(j); /* divides nqp, a whole number of grid_rows */
    const int64_t hs = local / (nqp / rpi), i = local % (nqp / rpi) * rpi;
    const bwd_rows R = slot_row(j, slot, hs);
    if (j->hk) {
      for (int ii = 0; ii < rpi; ii++)
        pack_row_half(j->kn, p, &R, j->D2, j->Dv2, j->hk->terms, j->dout, j->out, j->lse, bg / p->Hk,
                      (bg % p->Hk) * p->group + hs, i + ii);
      turn_rows(&R, p->D, p->Dv, j->D2, j->Dv2, nqp, j->hk->terms, i, rpi);
    } else
      pack_row(p, &R, j->dout, j->out, j->lse, bg / p->Hk, (bg % p->Hk) * p->group + hs, i);
  }
}

static int64_t pack_kr_items(const void *arg, int64_t round) { return round_items(arg, PH_KR, round); }

/* K as unit-stride rows, for dQ's dS.K when k is not */
static void pack_kr_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)scratch;
  const bwd_job *j = arg;
  const attn__sdpa *p = j->p;
  for (int64_t w = first; w < last; w++) {
    int64_t jk;
    const int64_t bg = item_pair(j, PH_KR, round, w, &jk), slot = bg - round * j->per_round;
    const int64_t off = attn__koff(p, &p->k, bg / p->Hk, bg % p->Hk, jk);
    attn__widen_strided(j->Kr + slot * j->kr_size + jk * p->D, p->k.data, p->k.dtype, off, p->k.strides[3], p->D);
  }
}

static int64_t grid_items(const void *arg, int64_t round) { return round_items(arg, PH_GRID, round); }

static void grid_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  const bwd_job *j = arg;
  const attn__sdpa *p = j->p;
  for (int64_t it = first; it < last; it++) {
    int64_t local;
    const int64_t bg = item_pair(j, PH_GRID, round, it, &local), slot = bg - round * j->per_round;
    const int64_t b = bg / p->Hk, g = bg % p->Hk;
    const bwd_geom e = geom(j, b);
    const int64_t c = local / e.R, r = local % e.R;
    const float *Kr;
    int64_t ldk;
    if (j->k_unit) {
      Kr = (const float *)p->k.data + attn__koff(p, &p->k, b, g, 0);
      ldk = p->k.strides[2];
    } else {
      Kr = j->Kr + slot * j->kr_size;
      ldk = p->D;
    }
    if (j->hk) Kr = j->Kr + slot * j->kr_size;
    const bwd_args a = {p, j->kn, j->rows + slot * p->group, j->Kt + slot * j->kt_size, j->Vt + slot * j->vt_size,
                        Kr, ldk, j->hk, j->D2, j->Dv2, e.nqp, j->narrow};
    float *dQc = j->dQp + slot * j->dq_size + c * p->group * e.nqp * p->D;
    float *dKr = e.R > 1 ? j->dKp + slot * j->dk_size + r * e.nk * p->D : NULL;
    float *dVr = e.R > 1 ? j->dVp + slot * j->dv_size + r * e.nk * p->Dv : NULL;
    if (j->hk) {
      if (j->hk->begin) j->hk->begin();
      pass_item_half(&a, scratch, j->dk, j->dv, dQc, dKr, dVr, b, g, c, e.C, r, e.R);
      if (j->hk->end) j->hk->end();
    } else {
      pass_item(&a, scratch, j->dk, j->dv, dQc, dKr, dVr, e.nqp, b, g, c, e.C, r, e.R);
    }
  }
}

/* t's n elements from off (strides[3] apart) = scale * sum_{r < R} part[r * stride + c], added in r
 * order (64 columns at a time, so that the sums vectorise; each element still adds r = 0, 1, ...) */
static void sum_parts(attn__narrow_fn narrow, const attn_tensor *t, int64_t off, const float *part, int64_t stride,
                      int64_t R, int64_t n, float scale) {
  int64_t c0 = 0;
  if (t->dtype == ATTN_F32 && t->strides[3] == 1) /* 16 columns at a time, the sums in registers */
    for (float *d = (float *)t->data + off; c0 + 16 <= n; c0 += 16) {
      float acc[16] = {0};
      for (int64_t r = 0; r < R; r++)
        for (int e = 0; e < 16; e++) acc[e] += part[r * stride + c0 + e];
      for (int e = 0; e < 16; e++) d[c0 + e] = acc[e] * scale;
    }
  for (; c0 < n; c0 += 64) {
    const int m = n - c0 < 64 ? (int)(n - c0) : 64;
    float acc[64] = {0};
    for (int64_t r = 0; r < R; r++)
      for (int e = 0; e < m; e++) acc[e] += part[r * stride + c0 + e];
    if (t->strides[3] == 1)
      narrow((char *)t->data + (off + c0) * (int64_t)attn_dtype_size(t->dtype), t->dtype, acc, m, scale);
    else
      attn__narrow_strided(t->data, t->dtype, off + c0 * t->strides[3], t->strides[3], acc, m, scale);
  }
}

static int64_t reduce_dq_items(const void *arg, int64_t round) { return round_items(arg, PH_DQ, round); }

/* dq = scale * the chunks' partials, summed in chunk order */
static void reduce_dq_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)scratch;
  const bwd_job *j = arg;
  const attn__sdpa *p = j->p;
  const float scale = (float)p->scale;
  const int64_t D = p->D;
  const attn_tensor *dq = j->dq;
  const int64_t sd = dq->strides[3];
  bwd_geom e = {0};
  for (int64_t w = first, geom_b = -1; w < last; w++) {
    int64_t local;
    const int64_t bg = item_pair(j, PH_DQ, round, w, &local), slot = bg - round * j->per_round;
    const int64_t b = bg / p->Hk;
    if (b != geom_b) e = geom(j, b), geom_b = b;
    const int64_t hs = local / e.nq, i = local % e.nq, h = (bg % p->Hk) * p->group + hs;
    const int64_t C = e.C, cstride = p->group * e.nqp * D;
    const float *part = j->dQp + slot * j->dq_size + (hs * e.nqp + i) * D;
    const int64_t qo = attn__qoff(p, dq, b, h, i);
    if (C == 0) { /* no keys: no gradient (a plain 0, not 0 * scale) */
      for (int64_t d = 0; d < D; d++) attn__store_f32(dq->data, dq->dtype, qo + d * sd, 0.0f);
      continue;
    }
    sum_parts(j->narrow, dq, qo, part, cstride, C, D, scale);
  }
}

static int64_t reduce_dkv_items(const void *arg, int64_t round) { return round_items(arg, PH_DKV, round); }

/* dk, dv = the splits' partials, summed in split order (zeros for keys no row sees) */
static void reduce_dkv_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)scratch;
  const bwd_job *j = arg;
  const attn__sdpa *p = j->p;
  bwd_geom e = {0};
  for (int64_t w = first, geom_b = -1; w < last; w++) {
    int64_t jk;
    const int64_t bg = item_pair(j, PH_DKV, round, w, &jk), slot = bg - round * j->per_round;
    const int64_t b = bg / p->Hk, g = bg % p->Hk;
    if (b != geom_b) e = geom(j, b), geom_b = b;
    const int64_t R = e.R; /* 0: no item ran, zeros */
    const attn_tensor *dk = j->dk, *dv = j->dv;
    const int64_t ko = attn__koff(p, dk, b, g, jk), vo = attn__koff(p, dv, b, g, jk);
    const float *pk = j->dKp + slot * j->dk_size + jk * p->D, *pv = j->dVp + slot * j->dv_size + jk * p->Dv;
    sum_parts(j->narrow, dk, ko, pk, e.nk * p->D, R, p->D, 1.0f);
    sum_parts(j->narrow, dv, vo, pv, e.nk * p->Dv, R, p->Dv, 1.0f);
  }
}

static void bwd_scratch_init(const void *arg, void *scratch) {
  const bwd_job *j = arg;
  bwd_scratch_layout(scratch, j->kn->mr, j->kn->nr, j->p->D, j->p->Dv, j->hk ? ATTN__BWD_MAX_ROWS / 2 : 0,
                     j->hk ? j->hk->terms : 1);
}

attn_status attn__sdpa_backward_run_blocked(attn_ctx *ctx, const attn__sdpa *p, attn_tensor *dq, attn_tensor *dk,
                                        attn_tensor *dv, const attn_tensor *dout, const attn_tensor *out,
                                        const attn_tensor *lse) {
  /* Without a query row or a key nothing flows back: every gradient is zero, at
   * the cost of the gradients' own elements, not of B x Hk empty passes. */
  if (p->B == 0 || p->Hq == 0 || p->Nq == 0 || p->Nk == 0) {
    zero_output(dq), zero_output(dk), zero_output(dv);
    if (p->mask_grad) zero_output(p->mask_grad);
    if (p->sinks_grad) zero_output(p->sinks_grad);
    return ATTN_OK;
  }
  const attn__half_kernels *hk = attn__dispatch_half_backward(&ctx->dispatch, p);
  const attn__cpu_kernels *kn = hk ? hk->base : ctx->dispatch.attention;
  const int nr = kn->nr;
  bwd_job j;
  memset(&j, 0, sizeof j);
  j.hk = hk;
  if (hk) { /* pairs, padded to the tiles' steps */
    j.D2 = ((p->D + 1) / 2 + hk->d2_align - 1) / hk->d2_align * hk->d2_align;
    j.Dv2 = ((p->Dv + 1) / 2 + hk->d2_align - 1) / hk->d2_align * hk->d2_align;
  }
  j.p = p, j.kn = kn, j.narrow = ctx->dispatch.decode->narrow;
  j.dq = dq, j.dk = dk, j.dv = dv, j.dout = dout, j.out = out, j.lse = lse;
  const int64_t nseq = attn__seqs(p);
  j.pairs = nseq * p->Hk;
  j.grid_pairs = p->cu_q ? p->Hk : j.pairs; /* a sequence's grid is the one it has alone */
  j.k_unit = p->k.strides[3] == 1 && p->k.dtype == ATTN_F32; /* K's rows read in place by dS.K */
  /* the per-slot buffers hold the largest sequence's (every batch's, without a packed batch) */
  int64_t nk_max = 0, nblk_max = 0, nqp_max = 0, cn_max = 0, rk_max = 0, cr_max = 1;
  for (int64_t b = 0; b < (p->cu_q ? nseq : 1); b++) {
    const bwd_geom e = geom(&j, b);
    nk_max = e.nk > nk_max ? e.nk : nk_max;
    nblk_max = e.nblk > nblk_max ? e.nblk : nblk_max;
    nqp_max = e.nqp > nqp_max ? e.nqp : nqp_max;
    cn_max = e.C * e.nqp > cn_max ? e.C * e.nqp : cn_max;
    rk_max = e.R > 1 && e.R * e.nk > rk_max ? e.R * e.nk : rk_max;
    cr_max = e.C * e.R > cr_max ? e.C * e.R : cr_max;
  }
  j.nqp_max = nqp_max;
  const int64_t Dp = p->D > 0 ? p->D : 1;
  /* per query head: Q, dO, lse, Dd as floats, or (half) Qh, dOh, QT, dOT as bf16 (a pair per float, each
   * twice with two terms), lse, Dd */
  const int64_t terms = hk ? hk->terms : 1;
  const int64_t row_floats = hk ? terms * (j.D2 + j.Dv2 + (p->D + p->Dv + 1) / 2) + 2 : p->D + p->Dv + 2;
  const int64_t t_pad = hk ? terms * (p->D + p->Dv) * (t_ld(0) / 2) : 0; /* QT's and dOT's extra floats */
  j.kt_size = nblk_max * nr * (hk ? terms * j.D2 : p->D);
  j.vt_size = nblk_max * nr * (hk ? terms * j.Dv2 : p->Dv > 0 ? p->Dv : 1);
  j.kr_size = hk ? terms * nblk_max * nr * p->D / 2 : j.k_unit ? 0 : nk_max * p->D;
  j.rows_size = p->group * (nqp_max * row_floats + t_pad);
  const size_t packed = attn__bytes(1, j.kt_size + j.vt_size + j.kr_size + j.rows_size, 1, sizeof(float));
  j.dq_size = cn_max * p->group * Dp;
  j.dk_size = rk_max * p->D;
  j.dv_size = rk_max * p->Dv;
  /* saturating sizes: broadcast views may claim more than memory holds (attn__workspace refuses those) */
  const size_t per_pair = packed + attn__bytes(1, j.dq_size + j.dk_size + j.dv_size, 1, sizeof(float));
  /* kv heads per round: enough items for twice the threads, or what fits
   * PACK_BUDGET if that is more, so that on few threads what a round packs is
   * still in cache when its items read it (rounds change no sum) */
  const int64_t threads = attn__threads(ctx);
  const int64_t for_threads = (2 * threads + cr_max - 1) / cr_max;
  const int64_t fit = per_pair >= (size_t)PACK_BUDGET ? 1 : (int64_t)((size_t)PACK_BUDGET / (per_pair ? per_pair : 1));
  j.per_round = for_threads > fit ? for_threads : fit;
  j.per_round = j.per_round < 1 ? 1 : j.per_round > j.pairs ? j.pairs : j.per_round;
  const int64_t n = j.per_round;
  const size_t kt_b = attn__bytes(n, j.kt_size, 1, sizeof(float)), vt_b = attn__bytes(n, j.vt_size, 1, sizeof(float));
  const size_t kr_b = attn__bytes(n, j.kr_size, 1, sizeof(float)), rows_b = attn__bytes(n, j.rows_size, 1, sizeof(float));
  const size_t dq_b = attn__bytes(n, j.dq_size, 1, sizeof(float));
  const size_t dk_b = attn__bytes(n, j.dk_size, 1, sizeof(float));
  const size_t dv_b = attn__bytes(n, j.dv_size, 1, sizeof(float));
  const size_t rv_b = attn__bytes(n, p->group, 1, sizeof(bwd_rows));
  const size_t off_b = p->cu_q ? attn__bytes(j.pairs + 1, PH_N, 1, sizeof(int64_t)) : 0;
  char *work = attn__workspace(ctx, attn__carve_size(kt_b) + attn__carve_size(vt_b) + attn__carve_size(kr_b) +
                                        attn__carve_size(rows_b) + attn__carve_size(dq_b) + attn__carve_size(dk_b) +
                                        attn__carve_size(dv_b) + attn__carve_size(rv_b) + attn__carve_size(off_b));
  if (!work) return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa_backward: cannot allocate packed keys, values and queries");
  j.Kt = attn__carve(&work, kt_b), j.Vt = attn__carve(&work, vt_b), j.Kr = attn__carve(&work, kr_b);
  j.Rows = attn__carve(&work, rows_b), j.dQp = attn__carve(&work, dq_b);
  j.dKp = attn__carve(&work, dk_b), j.dVp = attn__carve(&work, dv_b);
  j.rows = attn__carve(&work, rv_b);
  for (int64_t e = 0; e < n * p->group; e++) { /* slot e / group, query head e % group of its kv head */
    float *base = j.Rows + (e / p->group) * j.rows_size + (e % p->group) * (nqp_max * row_floats + t_pad);
    if (hk) { /* nqp_max is a whole number of groups: even */
      uint16_t *h16 = (uint16_t *)base, *qt = h16 + nqp_max * 2 * terms * (j.D2 + j.Dv2);
      float *stats = base + nqp_max * (row_floats - 2) + t_pad;
      j.rows[e] = (bwd_rows){NULL, NULL, stats, stats + nqp_max, h16, h16 + nqp_max * 2 * terms * j.D2, qt,
                             qt + terms * p->D * t_ld(nqp_max)};
    } else {
      j.rows[e] = (bwd_rows){base, base + nqp_max * p->D, base + nqp_max * (p->D + p->Dv),
                             base + nqp_max * (p->D + p->Dv + 1), NULL, NULL, NULL, NULL};
    }
  }
  if (p->cu_q) {
    int64_t *off = attn__carve(&work, off_b);
    for (int ph = 0; ph < PH_N; ph++) {
      int64_t *o = off + ph * (j.pairs + 1);
      o[0] = 0;
      for (int64_t bg = 0; bg < j.pairs; bg++) o[bg + 1] = o[bg] + pair_items(&j, ph, bg);
      j.off[ph] = o;
    }
  } else {
    for (int ph = 0; ph < PH_N; ph++) j.per[ph] = pair_items(&j, ph, 0);
  }
  static const attn__phase phases[] = {
      {"zero_mask_grad", zero_mask_grad_items, zero_mask_grad_run, 0}, {"pack_kv", pack_kv_items, pack_kv_run, 0},
      {"pack_rows", pack_rows_items, pack_rows_run, 0},                {"pack_k_rows", pack_kr_items, pack_kr_run, 0},
      {"key_chunks_x_query_splits", grid_items, grid_run, 1},         {"sum_dq", reduce_dq_items, reduce_dq_run, 0},
      {"sum_dk_dv", reduce_dkv_items, reduce_dkv_run, 0}};
  const attn__job job = {&j, (j.pairs + n - 1) / n, phases, (int)(sizeof phases / sizeof phases[0]),
                         bwd_scratch_layout(NULL, kn->mr, nr, p->D, p->Dv, hk ? ATTN__BWD_MAX_ROWS / 2 : 0, (int)terms),
                         bwd_scratch_init};
  const bwd_geom e0 = geom(&j, 0);
  const long long args[4] = {(long long)n, (long long)e0.C, (long long)e0.R, (long long)nseq};
  /* the plan names the tiles: "bf16 tiles", "f16 tiles (bf16 hi + lo)", or none (fp32) */
  static const char *const plans[2][3] = {
      {"attn_sdpa_backward (%lld kv heads per round, %lld key chunks x %lld query splits each)",
       "attn_sdpa_backward, bf16 tiles (%lld kv heads per round, %lld key chunks x %lld query splits each)",
       "attn_sdpa_backward, f16 tiles (bf16 hi + lo) (%lld kv heads per round, %lld key chunks x %lld query splits "
       "each)"},
      {"attn_sdpa_backward, packed batch (%lld kv heads per round, the first sequence's %lld key chunks x %lld query "
       "splits, %lld sequences)",
       "attn_sdpa_backward, bf16 tiles, packed batch (%lld kv heads per round, the first sequence's %lld key chunks x "
       "%lld query splits, %lld sequences)",
       "attn_sdpa_backward, f16 tiles (bf16 hi + lo), packed batch (%lld kv heads per round, the first sequence's %lld "
       "key chunks x %lld query splits, %lld sequences)"}};
  attn_status st = attn__schedule(ctx, plans[p->cu_q != NULL][hk ? (int)terms : 0], args, (int)threads, &job);
  if (st) return st;
  if (p->sinks_grad) sinks_grad(p, dout, out, lse);
  return ATTN_OK;
}
