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
 * pass recomputing the scores. C does not depend on the threads. */
#include "../internal.h"
#include "../logit.h"
#include "../cpu/kernels.h"
#include "schedule.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct bwd_scratch {
  float *S, *dP, *Mb, *dK, *dV, *dQ, *ones;
  float *Cf; /* (MR, NR) the logit's slope by its raw q.k (logit.h), where it is not 1 */
  float *base;
} bwd_scratch;

/* A thread's buffers, carved from its scratch (the struct sits at its start). */
static size_t bwd_scratch_layout(bwd_scratch *into, int mr, int nr, int64_t D, int64_t Dv) {
  const int64_t up = 16, Dp = D > 0 ? D : 1, Dvp = Dv > 0 ? Dv : 1;
  bwd_scratch sizing, *s = into ? into : &sizing; /* NULL: only the size is wanted */
  float *b = into ? (float *)((char *)into + attn__carve_size(sizeof *s)) : NULL;
  float **bufs[] = {&s->S, &s->dP, &s->Mb, &s->dK, &s->dV, &s->dQ, &s->ones, &s->Cf};
  const int64_t sizes[] = {mr * nr, mr * nr, mr * nr, nr * Dp, nr * Dvp, mr * Dp, ATTN__STAT_LANES, mr * nr};
  int64_t total = 0;
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    if (into) *bufs[i] = b + total;
    total += (sizes[i] + up - 1) / up * up;
  }
  if (into) {
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
} bwd_rows;

/* Everything one pass needs about the problem beyond p. */
typedef struct bwd_args {
  const attn__sdpa *p;
  const attn__cpu_kernels *kn;
  const bwd_rows *rows;       /* [group] for the kv head at hand */
  const float *Kt, *Vt, *Kr;  /* one kv head: Kt (nblk, D, NR), Vt (nblk, Dv, NR), K rows ldk apart */
  int64_t ldk;
} bwd_args;

/* For query tile t of query head h (slot hs in the group) against key block j0:
 * s->S becomes A = P * M and s->dP becomes dS. Returns the tile's class: CLOSED
 * when the block is entirely masked for this tile (nothing to add), MIXED when
 * some of its keys are hidden from some rows (dS and A are exactly 0 there). */
static attn__tile_mask bwd_scores(const bwd_args *a, bwd_scratch *s, int64_t b, int64_t h, int64_t hs, int64_t t, int64_t j0,
                      int write_mask_grad) {
  const attn__sdpa *p = a->p;
  const attn__cpu_kernels *kn = a->kn;
  const int mr = kn->mr, nr = kn->nr;
  const int64_t i0 = t * mr;
  const int rows = (int)(p->Nq - i0 < mr ? p->Nq - i0 : mr);
  const attn__tile_mask tm = attn__mask_tile(p, s->Mb, nr, nr, b, h, i0, rows, j0);
  if (tm == ATTN__TILE_CLOSED) return tm;
  const bwd_rows *R = &a->rows[hs];
  const float *Q = R->Q + i0 * p->D, *dO = R->dO + i0 * p->Dv;
  const int64_t blk = j0 / nr, nk = p->Nk - j0 < nr ? p->Nk - j0 : nr;
  kn->qk(s->S, Q, a->Kt + blk * nr * p->D, p->D, nk);
  attn__logit_tile(p, s->S, s->Cf, nr, rows, nr, tm, s->Mb); /* keeps the slope for dS */
  kn->exp_shift(s->S, R->lse + i0); /* padded rows have lse -inf: P = 0 */
  kn->qk(s->dP, dO, a->Vt + blk * nr * p->Dv, p->Dv, nk);
  if (p->dropout_p > 0) { /* dP * M before dS; A = P * M after */
    const float keep_scale = (float)(1.0 / (1.0 - p->dropout_p));
    float *M = s->Mb; /* free again: the mask is in S */
    for (int r = 0; r < mr; r++)
      for (int jj = 0; jj < nr; jj++)
        M[r * nr + jj] = r < rows && jj < nk && attn_dropout_keep(p->dropout_seed, p->dropout_p, b, h, i0 + r, j0 + jj)
                             ? keep_scale : 0.0f;
    for (int e = 0; e < mr * nr; e++) s->dP[e] *= M[e];
    kn->ds(s->S, s->dP, R->Dd + i0);
    for (int e = 0; e < mr * nr; e++) s->S[e] *= M[e];
  } else {
    kn->ds(s->S, s->dP, R->Dd + i0);
  }
  if (write_mask_grad) {
    const attn_tensor *mg = p->mask_grad;
    for (int r = 0; r < rows; r++) {
      float *m = (float *)mg->data + b * mg->strides[0] + h * mg->strides[1] + (i0 + r) * mg->strides[2];
      for (int64_t jj = 0; jj < nk; jj++) m[(j0 + jj) * mg->strides[3]] = s->dP[r * nr + jj];
    }
  }
  /* dq and dk need the gradient of the raw logit (the mask's is above). A
   * hidden key's slope may be NaN (its q.k was); its dS stays exactly 0. */
  if (attn__logit_has_slope(p))
    for (int e = 0; e < rows * nr; e++)
      if (s->dP[e] != 0) s->dP[e] *= s->Cf[e];
  return tm;
}

// Item (c, r) of kv head (b, g): key blocks blk = c, c + C, ... against the query tiles t = r, r + R, ...
// of every query head of the group. Writes those blocks' dk and dv rows (into split r's partials dKr, dVr
// [Nk][D], [Nk][Dv] when R > 1, else into dk, dv), and adds dS.K into chunk c's dQ partials dQc [group][nqp][D]
// (tiles of split r only: every item writes memory of its own).
static void pass_item(const bwd_args *a, bwd_scratch *s, attn_tensor *dk, attn_tensor *dv, float *dQc, float *dKr,
                      float *dVr, int64_t nqp, int64_t b, int64_t g, int64_t c, int64_t C, int64_t r, int64_t R) {
  const attn__sdpa *p = a->p;
  const int mr = a->kn->mr, nr = a->kn->nr;
  const int64_t nblk = (p->Nk + nr - 1) / nr;
  for (int64_t hs = 0; hs < p->group; hs++)
    for (int64_t t = r; t * mr < nqp; t += R) memset(dQc + (hs * nqp + t * mr) * p->D, 0, (size_t)(mr * p->D) * sizeof(float));
  for (int64_t blk = c; blk < nblk; blk += C) {
    const int64_t j0 = blk * nr, nk = p->Nk - j0 < nr ? p->Nk - j0 : nr;
    memset(s->dK, 0, (size_t)(nr * p->D) * sizeof(float));
    memset(s->dV, 0, (size_t)(nr * p->Dv) * sizeof(float));
    int64_t t0 = attn__first_row_seeing(p, b, j0) / mr;
    const int64_t iend = attn__rows_seeing_end(p, b, j0 + nk);
    t0 += ((r - t0) % R + R) % R; /* the first tile of split r from t0 */
    for (int64_t hs = 0; hs < p->group; hs++) {
      const int64_t h = g * p->group + hs;
      const bwd_rows *Rw = &a->rows[hs];
      for (int64_t t = t0; t * mr < iend; t += R) {
        const attn__tile_mask tm = bwd_scores(a, s, b, h, hs, t, j0, p->mask_grad != NULL);
        if (tm == ATTN__TILE_CLOSED) continue;
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
      float *kd = (float *)dk->data + b * dk->strides[0] + g * dk->strides[1] + (j0 + jj) * dk->strides[2];
      float *vd = (float *)dv->data + b * dv->strides[0] + g * dv->strides[1] + (j0 + jj) * dv->strides[2];
      for (int64_t d = 0; d < p->D; d++) kd[d * dk->strides[3]] = s->dK[jj * p->D + d];
      for (int64_t e = 0; e < p->Dv; e++) vd[e * dv->strides[3]] = s->dV[jj * p->Dv + e];
    }
  }
}

/* Packs query row i of head h into slot R: scaled q, dO, lse, and Dd in double. */
static void pack_row(const attn__sdpa *p, const bwd_rows *R, const attn_tensor *dout, const attn_tensor *out,
                     const attn_tensor *lse, int64_t b, int64_t h, int64_t i) {
  float *qd = R->Q + i * p->D, *od = R->dO + i * p->Dv;
  if (i >= p->Nq) {
    memset(qd, 0, (size_t)p->D * sizeof(float));
    memset(od, 0, (size_t)p->Dv * sizeof(float));
    R->lse[i] = -INFINITY;
    R->Dd[i] = 0;
    return;
  }
  const attn_tensor *q = &p->q;
  const float scale = (float)p->scale;
  const float *qs = (const float *)q->data + b * q->strides[0] + h * q->strides[1] + i * q->strides[2];
  const float *gs = (const float *)dout->data + b * dout->strides[0] + h * dout->strides[1] + i * dout->strides[2];
  const float *os = (const float *)out->data + b * out->strides[0] + h * out->strides[1] + i * out->strides[2];
  double dd = 0;
  for (int64_t d = 0; d < p->D; d++) qd[d] = qs[d * q->strides[3]] * scale;
  for (int64_t c = 0; c < p->Dv; c++) {
    od[c] = gs[c * dout->strides[3]];
    dd += (double)od[c] * os[c * out->strides[3]];
  }
  R->lse[i] = ((const float *)lse->data)[b * lse->strides[0] + h * lse->strides[1] + i * lse->strides[2]];
  R->Dd[i] = (float)dd; /* subtracted from every dP of the row: summed in double */
}

/* dsink_h = -sum_{b, i} exp(sink_h - lse_i) Dd_i with Dd_i = dO_i . out_i: one
 * serial pass in double, in (b, i) order, so no thread count changes the sum.
 * O(B Hq Nq Dv), small beside the pass above. */
static void sinks_grad(const attn__sdpa *p, const attn_tensor *dout, const attn_tensor *out, const attn_tensor *lse) {
  const attn_tensor *sg = p->sinks_grad;
  for (int64_t h = 0; h < p->Hq; h++) {
    const double sink = attn__sink(p, h);
    double acc = 0;
    for (int64_t b = 0; b < p->B; b++)
      for (int64_t i = 0; i < p->Nq; i++) {
        const float l = ((const float *)lse->data)[b * lse->strides[0] + h * lse->strides[1] + i * lse->strides[2]];
        if (l == -INFINITY) continue; /* nothing to renormalise */
        const float *gs = (const float *)dout->data + b * dout->strides[0] + h * dout->strides[1] + i * dout->strides[2];
        const float *os = (const float *)out->data + b * out->strides[0] + h * out->strides[1] + i * out->strides[2];
        double dd = 0;
        for (int64_t c = 0; c < p->Dv; c++) dd += (double)gs[c * dout->strides[3]] * os[c * out->strides[3]];
        if (dd != 0) acc -= exp(sink - (double)l) * dd;
      }
    ((float *)sg->data)[h * sg->strides[0]] = (float)acc;
  }
}

/* Zeros every element of an f32 output (a no-op for an empty one, whatever its shape). */
static void zero_f32(attn_tensor *t) {
  const int64_t n = attn_tensor_numel(t);
  if (n <= 0) return;
  int64_t idx[ATTN_MAX_RANK] = {0}, off = 0;
  float *d = t->data;
  for (int64_t e = 0; e < n; e++) {
    d[off] = 0.0f;
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
 * no thread count changes a sum. Kv heads are packed in rounds. */
#ifndef GRID_ITEMS
#define GRID_ITEMS 64
#endif
#define GRID_MAX 8
#ifndef PACK_BUDGET
#define PACK_BUDGET ((int64_t)2 << 20)
#endif

typedef struct bwd_job {
  const attn__sdpa *p;
  const attn__cpu_kernels *kn;
  attn_tensor *dq, *dk, *dv;
  const attn_tensor *dout, *out, *lse;
  int64_t nblk, ntiles, nqp, pairs, per_round, C, R;
  int k_unit;
  /* per slot of a round: */
  int64_t kt_size, vt_size, kr_size, rows_size, dq_size, dkv_size;
  float *Kt, *Vt, *Kr, *Rows, *dQp, *dKp, *dVp;
  bwd_rows *rows; /* [per_round][group]: views into Rows */
} bwd_job;

static int64_t bwd_round_pairs(const bwd_job *j, int64_t round) {
  const int64_t first = round * j->per_round;
  return j->pairs - first < j->per_round ? j->pairs - first : j->per_round;
}

static bwd_rows slot_row(const bwd_job *j, int64_t slot, int64_t hs) { return j->rows[slot * j->p->group + hs]; }

static int64_t zero_mask_grad_items(const void *arg, int64_t round) {
  const bwd_job *j = arg;
  return round == 0 && j->p->mask_grad ? j->p->B * j->p->Hq * j->p->Nq : 0;
}

/* mask_grad's rows: the passes write the visible tiles only */
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

static int64_t pack_kv_items(const void *arg, int64_t round) {
  const bwd_job *j = arg;
  return bwd_round_pairs(j, round) * j->nblk;
}

static void pack_kv_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)scratch;
  const bwd_job *j = arg;
  const attn__sdpa *p = j->p;
  for (int64_t w = first; w < last; w++) {
    const int64_t slot = w / j->nblk, blk = w % j->nblk, bg = round * j->per_round + slot;
    attn__pack_block_t(j->Kt + slot * j->kt_size, &p->k, bg / p->Hk, bg % p->Hk, blk, j->kn->nr, p->Nk, p->D);
    attn__pack_block_t(j->Vt + slot * j->vt_size, &p->v, bg / p->Hk, bg % p->Hk, blk, j->kn->nr, p->Nk, p->Dv);
  }
}

static int64_t pack_rows_items(const void *arg, int64_t round) {
  const bwd_job *j = arg;
  return bwd_round_pairs(j, round) * j->p->group * j->nqp;
}

static void pack_rows_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)scratch;
  const bwd_job *j = arg;
  const attn__sdpa *p = j->p;
  const int64_t per_slot = p->group * j->nqp;
  for (int64_t w = first; w < last; w++) {
    const int64_t slot = w / per_slot, hs = (w % per_slot) / j->nqp, i = w % j->nqp;
    const int64_t bg = round * j->per_round + slot;
    const bwd_rows R = slot_row(j, slot, hs);
    pack_row(p, &R, j->dout, j->out, j->lse, bg / p->Hk, (bg % p->Hk) * p->group + hs, i);
  }
}

static int64_t pack_kr_items(const void *arg, int64_t round) {
  const bwd_job *j = arg;
  return j->k_unit ? 0 : bwd_round_pairs(j, round) * j->p->Nk;
}

/* K as unit-stride rows, for dQ's dS.K when k is not */
static void pack_kr_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)scratch;
  const bwd_job *j = arg;
  const attn__sdpa *p = j->p;
  for (int64_t w = first; w < last; w++) {
    const int64_t slot = w / p->Nk, jk = w % p->Nk, bg = round * j->per_round + slot;
    const int64_t off = (bg / p->Hk) * p->k.strides[0] + (bg % p->Hk) * p->k.strides[1] + jk * p->k.strides[2];
    attn__widen_strided(j->Kr + slot * j->kr_size + jk * p->D, p->k.data, p->k.dtype, off, p->k.strides[3], p->D);
  }
}

static int64_t grid_items(const void *arg, int64_t round) {
  const bwd_job *j = arg;
  return bwd_round_pairs(j, round) * j->C * j->R;
}

static void grid_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  const bwd_job *j = arg;
  const attn__sdpa *p = j->p;
  for (int64_t it = first; it < last; it++) {
    const int64_t slot = it / (j->C * j->R), c = (it / j->R) % j->C, r = it % j->R;
    const int64_t bg = round * j->per_round + slot, b = bg / p->Hk, g = bg % p->Hk;
    const float *Kr;
    int64_t ldk;
    if (j->k_unit) {
      Kr = (const float *)p->k.data + b * p->k.strides[0] + g * p->k.strides[1];
      ldk = p->k.strides[2];
    } else {
      Kr = j->Kr + slot * j->kr_size;
      ldk = p->D;
    }
    const bwd_args a = {p, j->kn, j->rows + slot * p->group, j->Kt + slot * j->kt_size, j->Vt + slot * j->vt_size, Kr, ldk};
    float *dQc = j->dQp + slot * j->dq_size + c * p->group * j->nqp * p->D;
    float *dKr = j->R > 1 ? j->dKp + (slot * j->R + r) * p->Nk * p->D : NULL;
    float *dVr = j->R > 1 ? j->dVp + (slot * j->R + r) * p->Nk * p->Dv : NULL;
    pass_item(&a, scratch, j->dk, j->dv, dQc, dKr, dVr, j->nqp, b, g, c, j->C, r, j->R);
  }
}

static int64_t reduce_dq_items(const void *arg, int64_t round) {
  const bwd_job *j = arg;
  return bwd_round_pairs(j, round) * j->p->group * j->p->Nq;
}

/* dq = scale * the chunks' partials, summed in chunk order (64 columns at a
 * time, so that the sums vectorise; each element still adds c = 0, 1, ...) */
static void reduce_dq_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)scratch;
  const bwd_job *j = arg;
  const attn__sdpa *p = j->p;
  const float scale = (float)p->scale;
  const int64_t per_slot = p->group * p->Nq, D = p->D, C = j->C, cstride = p->group * j->nqp * D;
  const attn_tensor *dq = j->dq;
  const int64_t sd = dq->strides[3];
  for (int64_t w = first; w < last; w++) {
    const int64_t slot = w / per_slot, hs = (w % per_slot) / p->Nq, i = w % p->Nq;
    const int64_t bg = round * j->per_round + slot, b = bg / p->Hk, h = (bg % p->Hk) * p->group + hs;
    const float *part = j->dQp + slot * j->dq_size + (hs * j->nqp + i) * D;
    float *qd = (float *)dq->data + b * dq->strides[0] + h * dq->strides[1] + i * dq->strides[2];
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int n = D - d0 < 64 ? (int)(D - d0) : 64;
      float acc[64] = {0};
      for (int64_t c = 0; c < C; c++) {
        const float *pc = part + c * cstride + d0;
        for (int e = 0; e < n; e++) acc[e] += pc[e];
      }
      for (int e = 0; e < n; e++) qd[(d0 + e) * sd] = acc[e] * scale;
    }
  }
}

static int64_t reduce_dkv_items(const void *arg, int64_t round) {
  const bwd_job *j = arg;
  return j->R > 1 ? bwd_round_pairs(j, round) * j->p->Nk : 0;
}

/* dk, dv = the splits' partials, summed in split order */
static void reduce_dkv_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)scratch;
  const bwd_job *j = arg;
  const attn__sdpa *p = j->p;
  for (int64_t w = first; w < last; w++) {
    const int64_t slot = w / p->Nk, jk = w % p->Nk, bg = round * j->per_round + slot, b = bg / p->Hk, g = bg % p->Hk;
    const attn_tensor *dk = j->dk, *dv = j->dv;
    float *kd = (float *)dk->data + b * dk->strides[0] + g * dk->strides[1] + jk * dk->strides[2];
    float *vd = (float *)dv->data + b * dv->strides[0] + g * dv->strides[1] + jk * dv->strides[2];
    const float *pk = j->dKp + (slot * j->R * p->Nk + jk) * p->D, *pv = j->dVp + (slot * j->R * p->Nk + jk) * p->Dv;
    for (int64_t d = 0; d < p->D; d++) {
      float acc = 0;
      for (int64_t r = 0; r < j->R; r++) acc += pk[r * p->Nk * p->D + d];
      kd[d * dk->strides[3]] = acc;
    }
    for (int64_t e = 0; e < p->Dv; e++) {
      float acc = 0;
      for (int64_t r = 0; r < j->R; r++) acc += pv[r * p->Nk * p->Dv + e];
      vd[e * dv->strides[3]] = acc;
    }
  }
}

static void bwd_scratch_init(const void *arg, void *scratch) {
  const bwd_job *j = arg;
  bwd_scratch_layout(scratch, j->kn->mr, j->kn->nr, j->p->D, j->p->Dv);
}

attn_status attn__sdpa_backward_run_blocked(attn_ctx *ctx, const attn__sdpa *p, attn_tensor *dq, attn_tensor *dk,
                                        attn_tensor *dv, const attn_tensor *dout, const attn_tensor *out,
                                        const attn_tensor *lse) {
  /* Without a query row or a key nothing flows back: every gradient is zero, at
   * the cost of the gradients' own elements, not of B x Hk empty passes. */
  if (p->B == 0 || p->Hq == 0 || p->Nq == 0 || p->Nk == 0) {
    zero_f32(dq), zero_f32(dk), zero_f32(dv);
    if (p->mask_grad) zero_f32(p->mask_grad);
    if (p->sinks_grad) zero_f32(p->sinks_grad);
    return ATTN_OK;
  }
  const attn__cpu_kernels *kn = ctx->dispatch.attention;
  const int mr = kn->mr, nr = kn->nr;
  bwd_job j;
  memset(&j, 0, sizeof j);
  j.p = p, j.kn = kn, j.dq = dq, j.dk = dk, j.dv = dv, j.dout = dout, j.out = out, j.lse = lse;
  j.nblk = (p->Nk + nr - 1) / nr;
  j.ntiles = (p->Nq + mr - 1) / mr;
  j.nqp = j.ntiles * mr;
  j.pairs = p->B * p->Hk;
  j.k_unit = p->k.strides[3] == 1;
  const int64_t Dp = p->D > 0 ? p->D : 1;
  j.kt_size = j.nblk * nr * p->D;
  j.vt_size = j.nblk * nr * (p->Dv > 0 ? p->Dv : 1);
  j.kr_size = j.k_unit ? 0 : p->Nk * p->D;
  j.rows_size = p->group * j.nqp * (p->D + p->Dv + 2);
  /* items per kv head: 4 (0.1's chunks) with 8 kv heads or more, else
   * enough for GRID_ITEMS threads; chunks first, query splits only where
   * chunks cannot make the items (their dK, dV partials cost more) */
  const int64_t need = j.pairs >= 8 ? 4 : (GRID_ITEMS + j.pairs - 1) / j.pairs;
  j.C = need < GRID_MAX ? need : GRID_MAX;
  j.C = j.C < j.nblk ? j.C : j.nblk;
  j.R = need > j.C ? (need + j.C - 1) / j.C : 1;
  j.R = j.R < GRID_MAX ? j.R : GRID_MAX;
  j.R = j.R < j.ntiles ? j.R : j.ntiles;
  const size_t packed = attn__bytes(1, j.kt_size + j.vt_size + j.kr_size + j.rows_size, 1, sizeof(float));
  j.dq_size = j.C * p->group * j.nqp * Dp;
  j.dkv_size = j.R > 1 ? j.R * p->Nk * (p->D + p->Dv) : 0;
  /* saturating sizes: broadcast views may claim more than memory holds (attn__workspace refuses those) */
  const size_t per_pair = packed + attn__bytes(1, j.dq_size + j.dkv_size, 1, sizeof(float));
  /* kv heads per round: enough items for twice the threads, or what fits
   * PACK_BUDGET if that is more, so that on few threads what a round packs is
   * still in cache when its items read it (rounds change no sum) */
  const int64_t threads = attn__threads(ctx);
  const int64_t for_threads = (2 * threads + j.C * j.R - 1) / (j.C * j.R);
  const int64_t fit = per_pair >= (size_t)PACK_BUDGET ? 1 : (int64_t)((size_t)PACK_BUDGET / (per_pair ? per_pair : 1));
  j.per_round = for_threads > fit ? for_threads : fit;
  j.per_round = j.per_round < 1 ? 1 : j.per_round > j.pairs ? j.pairs : j.per_round;
  const int64_t n = j.per_round;
  const size_t kt_b = attn__bytes(n, j.kt_size, 1, sizeof(float)), vt_b = attn__bytes(n, j.vt_size, 1, sizeof(float));
  const size_t kr_b = attn__bytes(n, j.kr_size, 1, sizeof(float)), rows_b = attn__bytes(n, j.rows_size, 1, sizeof(float));
  const size_t dq_b = attn__bytes(n, j.dq_size, 1, sizeof(float));
  const size_t dk_b = attn__bytes(n, j.R > 1 ? j.R * p->Nk : 0, p->D, sizeof(float));
  const size_t dv_b = attn__bytes(n, j.R > 1 ? j.R * p->Nk : 0, p->Dv, sizeof(float));
  const size_t rv_b = attn__bytes(n, p->group, 1, sizeof(bwd_rows));
  char *work = attn__workspace(ctx, attn__carve_size(kt_b) + attn__carve_size(vt_b) + attn__carve_size(kr_b) +
                                        attn__carve_size(rows_b) + attn__carve_size(dq_b) + attn__carve_size(dk_b) +
                                        attn__carve_size(dv_b) + attn__carve_size(rv_b));
  if (!work) return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa_backward: cannot allocate packed keys, values and queries");
  j.Kt = attn__carve(&work, kt_b), j.Vt = attn__carve(&work, vt_b), j.Kr = attn__carve(&work, kr_b);
  j.Rows = attn__carve(&work, rows_b), j.dQp = attn__carve(&work, dq_b);
  j.dKp = attn__carve(&work, dk_b), j.dVp = attn__carve(&work, dv_b);
  j.rows = attn__carve(&work, rv_b);
  for (int64_t e = 0; e < n * p->group; e++) { /* slot e / group, query head e % group of its kv head */
    float *base = j.Rows + (e / p->group) * j.rows_size + (e % p->group) * j.nqp * (p->D + p->Dv + 2);
    j.rows[e] = (bwd_rows){base, base + j.nqp * p->D, base + j.nqp * (p->D + p->Dv), base + j.nqp * (p->D + p->Dv + 1)};
  }
  static const attn__phase phases[] = {
      {"zero_mask_grad", zero_mask_grad_items, zero_mask_grad_run, 0}, {"pack_kv", pack_kv_items, pack_kv_run, 0},
      {"pack_rows", pack_rows_items, pack_rows_run, 0},                {"pack_k_rows", pack_kr_items, pack_kr_run, 0},
      {"key_chunks_x_query_splits", grid_items, grid_run, 1},         {"sum_dq", reduce_dq_items, reduce_dq_run, 0},
      {"sum_dk_dv", reduce_dkv_items, reduce_dkv_run, 0}};
  const attn__job job = {&j, (j.pairs + n - 1) / n, phases, (int)(sizeof phases / sizeof phases[0]),
                         bwd_scratch_layout(NULL, mr, nr, p->D, p->Dv), bwd_scratch_init};
  const long long args[4] = {(long long)n, (long long)j.C, (long long)j.R, 0};
  attn_status st = attn__schedule(ctx, "attn_sdpa_backward (%lld kv heads per round, %lld key chunks x %lld query splits each)",
                                  args, (int)threads, &job);
  if (st) return st;
  if (p->sinks_grad) sinks_grad(p, dout, out, lse);
  return ATTN_OK;
}
