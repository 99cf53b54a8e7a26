/* The float64 oracle for scaled dot-product attention.
 *
 * Deliberately plain: one query row at a time, the whole row of logits in
 * double, a two-pass softmax, then the weighted sum of values. Every fast
 * kernel and backend is tested against this file; keep it obviously right
 * rather than fast. */
#include "internal.h"
#include "logit.h"

#include <stdlib.h>

/* NaN wins: a NaN logit must reach the output rather than be skipped. */
static double max_propagating_nan(double m, double x) { return (isnan(x) || x > m) ? x : m; }

// logits is (Nk), one query row: fills it, softmaxes it in place (then drops out), writes out/weights/lse.
static void ref_row(const attn__sdpa *p, int64_t b, int64_t h, int64_t i, double *logits) {
  const int64_t g = h / p->group;
  const attn_tensor *v = &p->v, *o = &p->out;

  /* A sink joins the softmax as one more logit that no value goes with. */
  const double sink = attn__sink(p, h);
  double m = sink;
  int64_t visible = 0;
  const int64_t nk = attn__key_rows(p, b);
  for (int64_t j = 0; j < nk; j++) {
    const double x = attn__ref_logit(p, b, h, i, j);
    logits[j] = x;
    if (x != -INFINITY) visible++;
    m = max_propagating_nan(m, x);
  }

  double sum = 0;
  if (visible) {
    if (sink != -INFINITY) sum = exp(sink - m);
    for (int64_t j = 0; j < nk; j++) {
      logits[j] = exp(logits[j] - m);
      sum += logits[j];
    }
    for (int64_t j = 0; j < nk; j++) logits[j] /= sum;
  } else {
    /* Every key masked: the documented answer is zeros, not 0/0. */
    for (int64_t j = 0; j < nk; j++) logits[j] = 0;
  }
  if (p->dropout_p > 0) {
    /* Dropout on the probabilities: w / (1 - p) kept, w * 0 dropped, so a NaN weight stays
     * NaN even when dropped (as in PyTorch), and p = 1 gives zeros; lse stays that of the softmax. */
    for (int64_t j = 0; j < nk; j++)
      logits[j] = attn__dropout_kept(p, b, h, i, j) ? logits[j] / (1 - p->dropout_p) : logits[j] * 0.0;
  }

  const int64_t ooff = attn__qoff(p, o, b, h, i);
  for (int64_t c = 0; c < p->Dv; c++) {
    double acc = 0;
    for (int64_t j = 0; j < nk; j++) {
      if (logits[j] == 0) continue; /* exact zeros add nothing; also keeps 0 * inf from a masked row */
      acc += logits[j] * attn__load(v->data, v->dtype, attn__koff(p, v, b, g, j) + c * v->strides[3]);
    }
    attn__store(o->data, o->dtype, ooff + c * o->strides[3], acc);
  }
  if (p->weights) {
    const attn_tensor *w = p->weights;
    const int64_t woff = b * w->strides[0] + h * w->strides[1] + i * w->strides[2];
    for (int64_t j = 0; j < p->Nk; j++) attn__store(w->data, w->dtype, woff + j * w->strides[3], logits[j]);
  }
  if (p->lse) {
    const attn_tensor *l = p->lse;
    attn__store(l->data, l->dtype, attn__qoff(p, l, b, h, i),
                visible ? m + log(sum) : sink); /* every key masked: only the sink (or nothing) */
  }
}

attn_status attn__sdpa_run_ref(attn_ctx *ctx, const attn__sdpa *p) {
  const int64_t rows = p->B * p->Hq * p->Nq;
  if (rows == 0) return ATTN_OK;
  int failed = 0;
#pragma omp parallel num_threads(attn__threads(ctx))
  {
    double *logits = attn__aligned_alloc(attn__bytes(p->Nk, 1, 1, sizeof(double)));
    if (!logits) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 16)
    for (int64_t r = 0; r < rows; r++) {
      if (!logits) continue;
      /* rows (batch, head, row of dim 2); a packed batch's row belongs to a sequence */
      int64_t i;
      const int64_t h = (r / p->Nq) % p->Hq, b = attn__row_seq(p, r % p->Nq + (r / (p->Nq * p->Hq)) * p->Nq, &i);
      ref_row(p, b, h, i, logits);
    }
    attn__aligned_free(logits);
  }
  if (failed) return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa_ref: cannot allocate a row of %lld logits", (long long)p->Nk);
  return ATTN_OK;
}
