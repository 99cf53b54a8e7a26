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
#include "kernels.h"
#include "softcap.h"

#include <stdlib.h>

typedef struct bwd_scratch {
  float *S, *dP, *Mb, *dK, *dV, *dQ, *ones;
  float *Cf; /* (MR, NR) softcap: 1 - tanh^2 of each raw logit, the cap's slope */
  float *base;
} bwd_scratch;

static int bwd_alloc(bwd_scratch *s, int mr, int nr, int64_t D, int64_t Dv) {
  memset(s, 0, sizeof *s);
  const int64_t up = 16, Dp = D > 0 ? D : 1, Dvp = Dv > 0 ? Dv : 1;
  float **bufs[] = {&s->S, &s->dP, &s->Mb, &s->dK, &s->dV, &s->dQ, &s->ones, &s->Cf};
  const int64_t sizes[] = {mr * nr, mr * nr, mr * nr, nr * Dp, nr * Dvp, mr * Dp, ATTN__STAT_LANES, mr * nr};
  int64_t total = 0;
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) total += (sizes[i] + up - 1) / up * up;
  float *b = s->base = attn__aligned_alloc((size_t)total * sizeof(float));
  if (!b) return 0;
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
    *bufs[i] = b;
    b += (sizes[i] + up - 1) / up * up;
  }
  for (int i = 0; i < ATTN__STAT_LANES; i++) s->ones[i] = 1.0f;
  return 1;
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
  const attn__tile_mask tm = attn__mask_tile(p, s->Mb, nr, b, h, i0, rows, j0);
  if (tm == ATTN__TILE_CLOSED) return tm;
  const bwd_rows *R = &a->rows[hs];
  const float *Q = R->Q + i0 * p->D, *dO = R->dO + i0 * p->Dv;
  const int64_t blk = j0 / nr, nk = p->Nk - j0 < nr ? p->Nk - j0 : nr;
  kn->qk(s->S, Q, a->Kt + blk * nr * p->D, p->D, nk);
  if (p->softcap > 0) attn__softcap_tile(s->S, s->Cf, (int64_t)mr * nr, (float)p->softcap); /* keep the slope for dS */
  if (tm != ATTN__TILE_OPEN) attn__apply_tile_mask(s->S, s->Mb, (int64_t)rows * nr);
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
  /* dq and dk need the gradient of the raw logit: through the cap (the mask's is above).
   * A hidden key's slope may be NaN (its q.k was); its dS stays exactly 0. */
  if (p->softcap > 0)
    for (int e = 0; e < mr * nr; e++)
      if (s->dP[e] != 0) s->dP[e] *= s->Cf[e];
  return tm;
}

/* First query row that can see key j0 under the causal bound (all rows without one). */
static int64_t first_row_seeing(const attn__sdpa *p, int64_t j0) {
  if (p->causal == ATTN_CAUSAL_NONE) return 0;
  const int64_t shift = p->causal == ATTN_CAUSAL_BOTTOM_RIGHT ? p->Nk - p->Nq : 0;
  const int64_t i = j0 - shift; /* row i sees j0 when j0 <= i + shift */
  return i < 0 ? 0 : i;
}

/* Last query row (exclusive) that can see a key below j1 under the window (Nq without one):
 * row i sees key j only when j > i' - window, i.e. i' < j + window. */
static int64_t rows_seeing_end(const attn__sdpa *p, int64_t j1) {
  if (p->window <= 0) return p->Nq;
  const int64_t shift = p->causal == ATTN_CAUSAL_BOTTOM_RIGHT ? p->Nk - p->Nq : 0;
  const int64_t e = j1 - 1 + p->window - shift; /* rows i <= j1 - 1 + window - 1 - shift see key j1 - 1 */
  return e < 0 ? 0 : e > p->Nq ? p->Nq : e;
}

/* Work items per kv head: enough for a few threads, few enough to keep the
 * partial dQ buffers (CHUNKS x group x Nq x D floats) small. */
#define CHUNKS 4

// Chunk c of kv head (b, g): every key block blk with blk % CHUNKS == c.
// Writes those blocks' dk and dv rows, and adds dS.K into the chunk's dQ partials dQc [group][nqp][D].
static void pass_chunk(const bwd_args *a, bwd_scratch *s, attn_tensor *dk, attn_tensor *dv, float *dQc, int64_t nqp,
                       int64_t b, int64_t g, int64_t c) {
  const attn__sdpa *p = a->p;
  const int mr = a->kn->mr, nr = a->kn->nr;
  const int64_t nblk = (p->Nk + nr - 1) / nr;
  memset(dQc, 0, (size_t)(p->group * nqp * p->D) * sizeof(float));
  for (int64_t blk = c; blk < nblk; blk += CHUNKS) {
    const int64_t j0 = blk * nr, nk = p->Nk - j0 < nr ? p->Nk - j0 : nr;
    memset(s->dK, 0, (size_t)(nr * p->D) * sizeof(float));
    memset(s->dV, 0, (size_t)(nr * p->Dv) * sizeof(float));
    const int64_t t0 = first_row_seeing(p, j0) / mr, iend = rows_seeing_end(p, j0 + nk);
    for (int64_t hs = 0; hs < p->group; hs++) {
      const int64_t h = g * p->group + hs;
      const bwd_rows *R = &a->rows[hs];
      for (int64_t t = t0; t * mr < iend; t++) {
        const attn__tile_mask tm = bwd_scores(a, s, b, h, hs, t, j0, p->mask_grad != NULL);
        if (tm == ATTN__TILE_CLOSED) continue;
        /* hidden entries are exact zeros in A and dS, times finite dO and Q rows; the
         * K rows of hidden keys are another matter: pv runs sparse there */
        a->kn->pt_acc(s->dV, p->Dv, s->S, R->dO + t * mr * p->Dv, p->Dv, p->Dv);
        a->kn->pt_acc(s->dK, p->D, s->dP, R->Q + t * mr * p->D, p->D, p->D);
        a->kn->pv(dQc + (hs * nqp + t * mr) * p->D, s->ones, s->dP, a->Kr + j0 * a->ldk, a->ldk, p->D, nk,
                  tm == ATTN__TILE_MIXED);
      }
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
    const double sink = attn__head_value(p->sinks, h);
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

attn_status attn__sdpa_backward_run_cpu(attn_ctx *ctx, const attn__sdpa *p, attn_kernel isa, attn_tensor *dq,
                                        attn_tensor *dk, attn_tensor *dv, const attn_tensor *dout,
                                        const attn_tensor *out, const attn_tensor *lse) {
  /* Without a query row or a key nothing flows back: every gradient is zero, at
   * the cost of the gradients' own elements, not of B x Hk empty passes. */
  if (p->B == 0 || p->Hq == 0 || p->Nq == 0 || p->Nk == 0) {
    zero_f32(dq), zero_f32(dk), zero_f32(dv);
    if (p->mask_grad) zero_f32(p->mask_grad);
    if (p->sinks_grad) zero_f32(p->sinks_grad);
    return ATTN_OK;
  }
  const attn__cpu_kernels *kn = ctx->dispatch.attention;
  const int mr = kn->mr, nr = kn->nr, threads = attn__threads(ctx);
  const int64_t nblk = (p->Nk + nr - 1) / nr, ntiles = (p->Nq + mr - 1) / mr, nqp = ntiles * mr;
  const int k_unit = p->k.strides[3] == 1;
  const int64_t per_head = nqp * (p->D + p->Dv + 2);
  /* saturating sizes: broadcast views may claim more than memory holds (attn__workspace refuses those) */
  const size_t kt_bytes = attn__bytes(nblk, nr, p->D, sizeof(float));
  const size_t vt_bytes = attn__bytes(nblk, nr, p->Dv > 0 ? p->Dv : 1, sizeof(float));
  const size_t kr_bytes = k_unit ? 0 : attn__bytes(p->Nk, p->D, 1, sizeof(float));
  const size_t rows_bytes = attn__bytes(p->group, nqp, p->D + p->Dv + 2, sizeof(float));
  const size_t dqp_bytes = attn__bytes(CHUNKS * p->group, nqp, p->D > 0 ? p->D : 1, sizeof(float));
  char *work = attn__workspace(ctx, attn__carve_size(kt_bytes) + attn__carve_size(vt_bytes) + attn__carve_size(kr_bytes) +
                                        attn__carve_size(rows_bytes) + attn__carve_size(dqp_bytes));
  bwd_rows *rows = calloc((size_t)p->group, sizeof *rows);
  if (!work || !rows) {
    free(rows);
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa_backward: cannot allocate packed keys, values and queries");
  }
  float *Kt = attn__carve(&work, kt_bytes), *Vt = attn__carve(&work, vt_bytes);
  float *Kr = k_unit ? NULL : attn__carve(&work, kr_bytes);
  float *Rows = attn__carve(&work, rows_bytes), *dQp = attn__carve(&work, dqp_bytes);
  for (int64_t hs = 0; hs < p->group; hs++) {
    float *base = Rows + hs * per_head;
    rows[hs].Q = base;
    rows[hs].dO = base + nqp * p->D;
    rows[hs].lse = base + nqp * (p->D + p->Dv);
    rows[hs].Dd = rows[hs].lse + nqp;
  }
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    bwd_scratch s;
    const int ok = bwd_alloc(&s, mr, nr, p->D, p->Dv);
    if (!ok) {
#pragma omp atomic write
      failed = 1;
    }
    /* every thread reads the same verdict: all of them, or none, enter the loops below */
#pragma omp barrier
    if (p->mask_grad && !failed) { /* pass A writes the visible tiles only */
      const attn_tensor *mg = p->mask_grad;
#pragma omp for schedule(static)
      for (int64_t row = 0; row < p->B * p->Hq * p->Nq; row++) {
        const int64_t i = row % p->Nq, h = (row / p->Nq) % p->Hq, b = row / (p->Nq * p->Hq);
        float *m = (float *)mg->data + b * mg->strides[0] + h * mg->strides[1] + i * mg->strides[2];
        for (int64_t j = 0; j < p->Nk; j++) m[j * mg->strides[3]] = 0.0f;
      }
    }
    for (int64_t bg = 0; bg < p->B * p->Hk && !failed; bg++) {
      const int64_t b = bg / p->Hk, g = bg % p->Hk;
#pragma omp for schedule(static)
      for (int64_t blk = 0; blk < nblk; blk++) {
        attn__pack_block_t(Kt, &p->k, b, g, blk, nr, p->Nk, p->D);
        attn__pack_block_t(Vt, &p->v, b, g, blk, nr, p->Nk, p->Dv);
      }
#pragma omp for schedule(static)
      for (int64_t w = 0; w < p->group * nqp; w++)
        pack_row(p, &rows[w / nqp], dout, out, lse, b, g * p->group + w / nqp, w % nqp);
      const float *Krow;
      int64_t ldk;
      if (k_unit) {
        Krow = (const float *)p->k.data + b * p->k.strides[0] + g * p->k.strides[1];
        ldk = p->k.strides[2];
      } else {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < p->Nk; j++)
          for (int64_t d = 0; d < p->D; d++)
            Kr[j * p->D + d] = ((const float *)p->k.data)[b * p->k.strides[0] + g * p->k.strides[1] +
                                                          j * p->k.strides[2] + d * p->k.strides[3]];
        Krow = Kr;
        ldk = p->D;
      }
      const bwd_args a = {p, kn, rows, Kt, Vt, Krow, ldk};
      /* on demand, as in the forward: work items are large, stalls are costly */
#pragma omp for schedule(dynamic, 1)
      for (int64_t c = 0; c < CHUNKS; c++) pass_chunk(&a, &s, dk, dv, dQp + c * p->group * nqp * p->D, nqp, b, g, c);
      const float scale = (float)p->scale;
#pragma omp for schedule(static)
      for (int64_t w = 0; w < p->group * p->Nq; w++) {
        const int64_t hs = w / p->Nq, i = w % p->Nq, h = g * p->group + hs;
        float *qd = (float *)dq->data + b * dq->strides[0] + h * dq->strides[1] + i * dq->strides[2];
        for (int64_t d = 0; d < p->D; d++) {
          float acc = 0; /* chunk order: fixed */
          for (int64_t c = 0; c < CHUNKS; c++) acc += dQp[((c * p->group + hs) * nqp + i) * p->D + d];
          qd[d * dq->strides[3]] = acc * scale;
        }
      }
    }
    attn__aligned_free(s.base);
  }
  free(rows);
  if (failed) return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa_backward: cannot allocate per-thread tiles");
  if (p->sinks_grad) sinks_grad(p, dout, out, lse);
  return ATTN_OK;
}
