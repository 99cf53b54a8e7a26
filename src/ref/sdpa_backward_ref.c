/* The float64 oracle for the backward pass of scaled dot-product attention.
 *
 * For query row i of head h (kv head g = h / group), with the forward's lse_i:
 *   s_ij  = scale * q_i . k_j + mask_ij      (-inf where masked or beyond causal)
 *   P_ij  = exp(s_ij - lse_i)                the softmax
 *   M_ij  = keep(b, h, i, j) / (1 - p)       dropout (1 without)
 *   A_ij  = P_ij M_ij                        what multiplies v: out_i = sum_j A_ij v_j
 *   dA_ij = dO_i . v_j
 *   Dd_i  = sum_j A_ij dA_ij                 (= dO_i . out_i, recomputed here in double)
 *   dS_ij = P_ij (M_ij dA_ij - Dd_i)         the gradient of the logit s_ij
 *   dq_i  = scale * sum_j dS_ij k_j          dmask_ij = dS_ij (additive masks)
 *   dk_j  = scale * sum_{h in g, i} dS_ij q_i
 *   dv_j  = sum_{h in g, i} A_ij dO_i
 * Options change only which logits are visible and their values (logit.h),
 * except that dq and dk take dS_ij * C_ij, with C_ij the derivative of s_ij
 * by the raw scaled q.k (attn__ref_logit_slope; dmask stays dS_ij: the mask
 * is added last). A sink is in lse, so P
 * already excludes its share; dsink_h = -sum_{b, i} exp(sink_h - lse_i) Dd_i.
 * Rows whose lse is -inf (every key masked) have zero gradients. An entry with
 * P_ij = 0 contributes nothing, so a masked key's Inf never reaches a gradient.
 *
 * Deliberately plain, like sdpa_ref.c: two passes that recompute the entries
 * in double, the first over query rows (dq, dmask, Dd), the second over keys
 * (dk, dv), so every gradient element is summed by one thread in one fixed
 * order and the result does not depend on the thread count. `out` is only
 * checked: Dd comes from the oracle's own probabilities. */
#include "internal.h"
#include "logit.h"

#include <stdlib.h>

typedef struct bwd_args {
  const attn__sdpa *p;
  const attn_tensor *dout, *lse;
  attn_tensor *dq, *dk, *dv;
  double *Dd; /* [B, Hq, Nq] contiguous: Dd_i of each row, written by pass 1 */
} bwd_args;

/* One entry (i, j) of a row: P, M and dA (dA only where A = P M is nonzero, else 0),
 * C the logit's slope by the raw scaled q.k (1 where P is 0). */
typedef struct bwd_entry {
  double P, M, dA, C;
} bwd_entry;

static double load_lse(const attn__sdpa *p, const attn_tensor *l, int64_t b, int64_t h, int64_t i) {
  return attn__load(l->data, l->dtype, attn__qoff(p, l, b, h, i));
}

/* Row (b, h, i)'s index into Dd, laid out as [B, Hq, Nq] (a packed batch: [1, Hq, total_q]). */
static int64_t dd_index(const attn__sdpa *p, int64_t b, int64_t h, int64_t i) {
  return p->cu_q ? h * p->Nq + p->cu_q[b] + i : (b * p->Hq + h) * p->Nq + i;
}

static bwd_entry entry_at(const bwd_args *a, int64_t b, int64_t h, int64_t i, int64_t j, double lse_i) {
  const attn__sdpa *p = a->p;
  const int64_t g = h / p->group;
  bwd_entry e = {0, 1, 0, 1};
  double slope;
  const double s = attn__ref_logit_slope(p, b, h, i, j, &slope);
  e.P = s == -INFINITY ? 0 : exp(s - lse_i);
  if (e.P != 0) e.C = slope;
  if (p->dropout_p > 0) e.M = attn__dropout_kept(p, b, h, i, j) ? 1 / (1 - p->dropout_p) : 0;
  if (e.P * e.M != 0) {
    const attn_tensor *o = a->dout, *v = &p->v;
    const int64_t ooff = attn__qoff(p, o, b, h, i), voff = attn__koff(p, v, b, g, j);
    double dot = 0;
    for (int64_t c = 0; c < p->Dv; c++)
      dot += attn__load(o->data, o->dtype, ooff + c * o->strides[3]) *
             attn__load(v->data, v->dtype, voff + c * v->strides[3]);
    e.dA = dot;
  }
  return e;
}

static double entry_dS(const bwd_entry *e, double Dd_i) { return e->P == 0 ? 0 : e->P * (e->M * e->dA - Dd_i); }

// Pass 1, query row (b, h, i): dq_i, dmask_i and Dd_i. row is (Nk) entries of scratch, acc is (D).
static void row_pass(const bwd_args *a, int64_t b, int64_t h, int64_t i, bwd_entry *row, double *acc) {
  const attn__sdpa *p = a->p;
  const int64_t g = h / p->group, r = dd_index(p, b, h, i), nk = attn__key_rows(p, b);
  const double lse_i = load_lse(p, a->lse, b, h, i);
  const int live = lse_i != -INFINITY;
  double Dd = 0;
  for (int64_t j = 0; live && j < nk; j++) {
    row[j] = entry_at(a, b, h, i, j, lse_i);
    const double A = row[j].P * row[j].M;
    if (A != 0) Dd += A * row[j].dA;
  }
  a->Dd[r] = Dd;

  for (int64_t d = 0; d < p->D; d++) acc[d] = 0;
  const attn_tensor *k = &p->k, *mg = p->mask_grad;
  for (int64_t j = 0; j < nk; j++) {
    double dS = live ? entry_dS(&row[j], Dd) : 0;
    if (mg)
      attn__store(mg->data, mg->dtype,
                  b * mg->strides[0] + h * mg->strides[1] + i * mg->strides[2] + j * mg->strides[3], dS);
    if (dS == 0) continue;
    dS *= row[j].C; /* through the cap to the raw logit */
    const int64_t koff = attn__koff(p, k, b, g, j);
    for (int64_t d = 0; d < p->D; d++) acc[d] += dS * attn__load(k->data, k->dtype, koff + d * k->strides[3]);
  }
  const attn_tensor *dq = a->dq;
  const int64_t qoff = attn__qoff(p, dq, b, h, i);
  for (int64_t d = 0; d < p->D; d++) attn__store(dq->data, dq->dtype, qoff + d * dq->strides[3], p->scale * acc[d]);
}

// Pass 2, key j of kv head g: dk_j and dv_j over every query row of the group's heads. acc_k is (D), acc_v (Dv).
static void key_pass(const bwd_args *a, int64_t b, int64_t g, int64_t j, double *acc_k, double *acc_v) {
  const attn__sdpa *p = a->p;
  const attn_tensor *q = &p->q, *o = a->dout;
  for (int64_t d = 0; d < p->D; d++) acc_k[d] = 0;
  for (int64_t c = 0; c < p->Dv; c++) acc_v[c] = 0;
  for (int64_t h = g * p->group; h < (g + 1) * p->group; h++) {
    for (int64_t i = 0; i < attn__queries(p, b); i++) {
      const double lse_i = load_lse(p, a->lse, b, h, i);
      if (lse_i == -INFINITY) continue;
      const bwd_entry e = entry_at(a, b, h, i, j, lse_i);
      const double A = e.P * e.M, dS = entry_dS(&e, a->Dd[dd_index(p, b, h, i)]) * e.C;
      if (A != 0) {
        const int64_t ooff = attn__qoff(p, o, b, h, i);
        for (int64_t c = 0; c < p->Dv; c++) acc_v[c] += A * attn__load(o->data, o->dtype, ooff + c * o->strides[3]);
      }
      if (dS != 0) {
        const int64_t qoff = attn__qoff(p, q, b, h, i);
        for (int64_t d = 0; d < p->D; d++) acc_k[d] += dS * attn__load(q->data, q->dtype, qoff + d * q->strides[3]);
      }
    }
  }
  const attn_tensor *dk = a->dk, *dv = a->dv;
  const int64_t koff = attn__koff(p, dk, b, g, j), voff = attn__koff(p, dv, b, g, j);
  for (int64_t d = 0; d < p->D; d++) attn__store(dk->data, dk->dtype, koff + d * dk->strides[3], p->scale * acc_k[d]);
  for (int64_t c = 0; c < p->Dv; c++) attn__store(dv->data, dv->dtype, voff + c * dv->strides[3], acc_v[c]);
}

attn_status attn__sdpa_backward_run_ref(attn_ctx *ctx, const attn__sdpa *p, attn_tensor *dq, attn_tensor *dk,
                                        attn_tensor *dv, const attn_tensor *dout, const attn_tensor *out,
                                        const attn_tensor *lse) {
  const int64_t rows = p->B * p->Hq * p->Nq, keys = p->B * p->Hk * p->Nk;
  bwd_args a = {p, dout, lse, dq, dk, dv, NULL};
  a.Dd = attn__aligned_alloc(attn__bytes(rows, 1, 1, sizeof(double)));
  if (!a.Dd) return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa_backward_ref: cannot allocate %lld row sums", (long long)rows);
  const int threads = attn__threads(ctx);
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    bwd_entry *row = attn__aligned_alloc(attn__bytes(p->Nk, 1, 1, sizeof *row));
    double *acc = attn__aligned_alloc(attn__bytes(p->D + p->Dv + 1, 1, 1, sizeof(double)));
    if (!row || !acc) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 16)
    for (int64_t r = 0; r < rows; r++) {
      if (!row || !acc) continue;
      int64_t i;
      const int64_t h = (r / p->Nq) % p->Hq, b = attn__row_seq(p, r % p->Nq + (r / (p->Nq * p->Hq)) * p->Nq, &i);
      row_pass(&a, b, h, i, row, acc);
    }
    /* the implicit barrier: every Dd is written before pass 2 reads it */
#pragma omp for schedule(dynamic, 16)
    for (int64_t c = 0; c < keys; c++) {
      if (!row || !acc) continue;
      int64_t j;
      const int64_t g = (c / p->Nk) % p->Hk, b = attn__key_seq(p, c % p->Nk + (c / (p->Nk * p->Hk)) * p->Nk, &j);
      key_pass(&a, b, g, j, acc, acc + p->D);
    }
    attn__aligned_free(row);
    attn__aligned_free(acc);
  }
  if (!failed && p->sinks_grad) {
    /* serially, in (b, i) order: the same sum whatever the thread count */
    for (int64_t h = 0; h < p->Hq; h++) {
      const double sink = attn__head_value(p->sinks, h);
      double acc = 0;
      for (int64_t b = 0; b < attn__seqs(p); b++)
        for (int64_t i = 0; i < attn__queries(p, b); i++) {
          const double lse_i = load_lse(p, lse, b, h, i), Dd = a.Dd[dd_index(p, b, h, i)];
          if (lse_i != -INFINITY && Dd != 0) acc -= exp(sink - lse_i) * Dd;
        }
      attn__store(p->sinks_grad->data, p->sinks_grad->dtype, h * p->sinks_grad->strides[0], acc);
    }
  }
  attn__aligned_free(a.Dd);
  if (failed)
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa_backward_ref: cannot allocate a row of %lld entries", (long long)p->Nk);
  return ATTN_OK;
}

attn_status attn_sdpa_backward_ref(attn_ctx *ctx, attn_tensor *dq, attn_tensor *dk, attn_tensor *dv,
                                   attn_tensor *mask_grad, attn_tensor *sinks_grad, const attn_tensor *dout,
                                   const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                                   const attn_tensor *out, const attn_tensor *lse, const attn_sdpa_opts *opts) {
  ATTN__ENTER(ctx);
  attn__sdpa p;
  attn_status st =
      attn__sdpa_backward_prepare(ctx, &p, dq, dk, dv, mask_grad, sinks_grad, dout, q, k, v, out, lse, opts, 0);
  if (st) return st;
  return attn__sdpa_backward_run_ref(ctx, &p, dq, dk, dv, dout, out, lse);
}
