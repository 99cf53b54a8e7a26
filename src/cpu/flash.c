/* The blocked ("flash") attention framework for fp32 on the CPU.
 *
 * For each (batch, kv head): pack K transposed into key blocks of NR (and V
 * into rows if it is not unit-stride), then every tile of MR query rows of
 * every query head in the group streams over the key blocks with an online
 * softmax, so no Nq x Nk matrix exists unless weights are asked for. Tiles
 * are independent, so results do not depend on the thread count. */
#include "../internal.h"
#include "kernels.h"

#include <stdlib.h>

typedef struct scratch {
  float *Q, *S, *O, *m, *l, *alpha;
} scratch;

static int scratch_alloc(scratch *s, int64_t mr, int64_t nr, int64_t D, int64_t Dv) {
  s->Q = attn__aligned_alloc((size_t)(mr * D) * sizeof(float));
  s->S = attn__aligned_alloc((size_t)(mr * nr) * sizeof(float));
  s->O = attn__aligned_alloc((size_t)(mr * (Dv > 0 ? Dv : 1)) * sizeof(float));
  s->m = attn__aligned_alloc((size_t)(3 * mr) * sizeof(float));
  s->l = s->m ? s->m + mr : NULL;
  s->alpha = s->m ? s->m + 2 * mr : NULL;
  return s->Q && s->S && s->O && s->m;
}

static void scratch_free(scratch *s) {
  attn__aligned_free(s->Q);
  attn__aligned_free(s->S);
  attn__aligned_free(s->O);
  attn__aligned_free(s->m);
}

/* Sets masked logits of one tile to -inf: causal bound, key padding, mask, and keys past Nk. */
static void mask_tile(const attn__sdpa *p, float *S, int nr, int64_t b, int64_t h, int64_t i0, int rows, int64_t j0) {
  for (int r = 0; r < rows; r++) {
    const int64_t i = i0 + r, kend = attn__causal_end(p->causal, i, p->Nq, p->Nk);
    float *s = S + (int64_t)r * nr;
    for (int jj = 0; jj < nr; jj++) {
      const int64_t j = j0 + jj;
      if (j >= kend) s[jj] = -INFINITY;
      else if (p->has_kpm || p->has_mask) {
        if (p->has_mask && (p->mask_mode == ATTN_MASK_ADDITIVE || p->mask_mode == ATTN_MASK_SEED)) {
          /* float arithmetic, as an fp32 framework would add the mask */
          double verdict = attn__mask_logit(p, b, h, i, j, 0.0);
          if (verdict == -INFINITY) s[jj] = -INFINITY;
          else s[jj] += (float)(p->mask_mode == ATTN_MASK_SEED ? (float)verdict : verdict);
        } else if (attn__mask_logit(p, b, h, i, j, 0.0) == -INFINITY) {
          s[jj] = -INFINITY;
        }
      }
    }
  }
}

/* First key block past every key any row of the tile can see. */
static int64_t tile_key_end(const attn__sdpa *p, int64_t i0, int rows) {
  return attn__causal_end(p->causal, i0 + rows - 1, p->Nq, p->Nk);
}

// One tile: rows i0..i0+rows of query head h against the packed keys of its kv head.
static void run_tile(const attn__cpu_kernels *kn, const attn__sdpa *p, scratch *s, const float *Kt, const float *V,
                     int64_t ldv, int64_t b, int64_t h, int64_t i0, int rows) {
  const int mr = kn->mr, nr = kn->nr;
  const int64_t D = p->D, Dv = p->Dv;
  const attn_tensor *q = &p->q;
  const float *qd = q->data;
  const float scale = (float)p->scale;
  for (int r = 0; r < mr; r++) {
    float *dst = s->Q + (int64_t)r * D;
    if (r < rows) {
      const float *src = qd + b * q->strides[0] + h * q->strides[1] + (i0 + r) * q->strides[2];
      for (int64_t d = 0; d < D; d++) dst[d] = src[d * q->strides[3]] * scale;
    } else {
      memset(dst, 0, (size_t)D * sizeof(float));
    }
    s->m[r] = -INFINITY;
    s->l[r] = 0;
  }
  memset(s->O, 0, (size_t)(mr * Dv) * sizeof(float));

  const int64_t kend = tile_key_end(p, i0, rows);
  for (int64_t j0 = 0; j0 < kend; j0 += nr) {
    kn->qk(s->S, s->Q, Kt + j0 * D, D);
    mask_tile(p, s->S, nr, b, h, i0, rows, j0);
    kn->softmax(s->S, s->m, s->l, s->alpha);
    const int64_t nk = p->Nk - j0 < nr ? p->Nk - j0 : nr;
    kn->pv(s->O, s->alpha, s->S, V + j0 * ldv, ldv, Dv, nk);
  }

  const attn_tensor *o = &p->out;
  float *od = o->data;
  for (int r = 0; r < rows; r++) {
    const float l = s->l[r];
    const float inv = l == 0 ? 0.0f : 1.0f / l; /* l = 0 only when every key is masked */
    float *dst = od + b * o->strides[0] + h * o->strides[1] + (i0 + r) * o->strides[2];
    for (int64_t c = 0; c < Dv; c++) dst[c * o->strides[3]] = s->O[r * Dv + c] * inv;
    if (p->lse) {
      const attn_tensor *lt = p->lse;
      ((float *)lt->data)[b * lt->strides[0] + h * lt->strides[1] + (i0 + r) * lt->strides[2]] =
          l == 0 ? -INFINITY : s->m[r] + logf(l);
    }
  }

  if (p->weights) {
    /* Second pass: the normalised probabilities need the final max and sum. */
    const attn_tensor *w = p->weights;
    float *wd = w->data;
    for (int64_t j0 = 0; j0 < p->Nk; j0 += nr) {
      const int64_t nk = p->Nk - j0 < nr ? p->Nk - j0 : nr;
      if (j0 < kend) {
        kn->qk(s->S, s->Q, Kt + j0 * D, D);
        mask_tile(p, s->S, nr, b, h, i0, rows, j0);
      }
      for (int r = 0; r < rows; r++) {
        float *dst = wd + b * w->strides[0] + h * w->strides[1] + (i0 + r) * w->strides[2];
        const float l = s->l[r], mx = s->m[r];
        for (int64_t jj = 0; jj < nk; jj++) {
          float x = j0 < kend ? s->S[r * nr + jj] : -INFINITY;
          dst[(j0 + jj) * w->strides[3]] = (l == 0 || x == -INFINITY) ? 0.0f : expf(x - mx) / l;
        }
      }
    }
  }
}

// Kt is (nblocks, D, NR) and, when V is not unit-stride, Vp is (Nk, Dv): one kv head's keys and values.
static void pack_block(const attn__sdpa *p, int nr, float *Kt, int64_t b, int64_t g, int64_t blk) {
  const attn_tensor *k = &p->k;
  const float *kd = (const float *)k->data + b * k->strides[0] + g * k->strides[1];
  float *dst = Kt + blk * nr * p->D;
  for (int jj = 0; jj < nr; jj++) {
    const int64_t j = blk * nr + jj;
    if (j < p->Nk) {
      const float *src = kd + j * k->strides[2];
      for (int64_t d = 0; d < p->D; d++) dst[d * nr + jj] = src[d * k->strides[3]];
    } else {
      for (int64_t d = 0; d < p->D; d++) dst[d * nr + jj] = 0;
    }
  }
}

attn_status attn__sdpa_run_c(attn_ctx *ctx, const attn__sdpa *p) {
  const attn__cpu_kernels *kn = &attn__kernels_c;
  const int mr = kn->mr, nr = kn->nr;
  if (p->B == 0 || p->Hq == 0 || p->Nq == 0) return ATTN_OK;
  const int64_t nblocks = (p->Nk + nr - 1) / nr;
  const int64_t ntiles = (p->Nq + mr - 1) / mr;
  const int v_unit = p->v.strides[3] == 1 || p->Dv <= 1;
  float *Kt = attn__aligned_alloc((size_t)(nblocks * nr * p->D) * sizeof(float));
  float *Vp = v_unit ? NULL : attn__aligned_alloc((size_t)(p->Nk * p->Dv) * sizeof(float));
  if (!Kt || (!v_unit && !Vp)) {
    attn__aligned_free(Kt);
    attn__aligned_free(Vp);
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa: cannot allocate packed keys for Nk = %lld", (long long)p->Nk);
  }
  int failed = 0;
  const int64_t items = p->group * ntiles;
#pragma omp parallel num_threads(attn__threads(ctx))
  {
    scratch s;
    int ok = scratch_alloc(&s, mr, nr, p->D, p->Dv);
    if (!ok) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp barrier
    for (int64_t bg = 0; bg < p->B * p->Hk && !failed; bg++) {
      const int64_t b = bg / p->Hk, g = bg % p->Hk;
#pragma omp for schedule(static)
      for (int64_t blk = 0; blk < nblocks; blk++) pack_block(p, nr, Kt, b, g, blk);
      const float *V;
      int64_t ldv;
      if (v_unit) {
        V = (const float *)p->v.data + b * p->v.strides[0] + g * p->v.strides[1];
        ldv = p->v.strides[2];
      } else {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < p->Nk; j++) {
          const float *src = (const float *)p->v.data + b * p->v.strides[0] + g * p->v.strides[1] + j * p->v.strides[2];
          for (int64_t c = 0; c < p->Dv; c++) Vp[j * p->Dv + c] = src[c * p->v.strides[3]];
        }
        V = Vp;
        ldv = p->Dv;
      }
      /* Last tiles first: under a causal mask they carry the most keys. */
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < items; it++) {
        const int64_t t = ntiles - 1 - it % ntiles, h = g * p->group + it / ntiles;
        const int64_t i0 = t * mr;
        const int rows = (int)(p->Nq - i0 < mr ? p->Nq - i0 : mr);
        run_tile(kn, p, &s, Kt, V, ldv, b, h, i0, rows);
      }
    }
    if (ok) scratch_free(&s);
  }
  attn__aligned_free(Kt);
  attn__aligned_free(Vp);
  if (failed) return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa: cannot allocate per-thread tiles");
  return ATTN_OK;
}
