/* Training the multi-head attention layer: attn_mha_forward_save and attn_mha_backward.
 *
 * The forward (mha.c) computes, row by row (PyTorch Linear: y = x W^T + b),
 *   Q = x_q Wq^T + bq     K = x_k Wk^T + bk     V = x_v Wv^T + bv   (Q: H*D columns, K, V: Hk*D)
 *   Q, K = RoPE(norm(Q)), RoPE(norm(K))  (each step only when the layer has it)
 *   A = SDPA(Q, K, V) head by head               out = A Wo^T + bo
 * and keeps x_q, x_k, x_v, Q, K, V, A and SDPA's log-sum-exp. From dout:
 *   dA = dout Wo          dWo = dout^T A          dbo = sum of dout's rows
 *   dQ, dK, dV            SDPA's backward on the head views (mask, key padding,
 *                         causal and dropout as in the forward: the dropout mask
 *                         is regenerated from its seed, never stored), then
 *                         RoPE transposed, then the norm's backward (from the
 *                         q and k saved before it), which gives its parameters'
 *                         gradients
 *   dWq = dQ^T x_q        dbq = sum of dQ's rows  dx_q = dQ Wq        (k, v alike)
 * After self-attention the input gradient is dx = dQ Wq + dK Wk + dV Wv, taken
 * as one product [dQ dK dV] . [Wq; Wk; Wv] (so one chain of sums, in a fixed
 * order, for every element).
 *
 * Each product is written as C = A . B^T, the one form of the fast GEMM
 * (attn__sgemm_nt), after transposing an operand into scratch: O(N E) extra
 * memory, no Nq x Nk buffer anywhere (SDPA's backward recomputes its scores).
 * With ATTN_KERNEL_REF on the context every step runs in double instead (plain
 * loops and attn_sdpa_backward_ref), from the double copies the forward saved.
 * Every gradient element is summed by one thread in one fixed order, so the
 * results are bitwise the same for any thread count.
 *
 * Lifetimes: the saved state owns copies of everything it needs, the
 * tensors of the forward's attention options included (compact: what the
 * caller broadcast stays broadcast). The backward also reads the layer's
 * current parameters, which must be those the forward used. */
#include "mha_internal.h"

#include <stdio.h>
#include <stdlib.h>

attn_status attn_mha_forward_save(attn_ctx *ctx, attn_mha *mha, attn_tensor *out, attn_tensor *weights,
                                  attn_mha_saved **saved, const attn_tensor *query, const attn_tensor *key,
                                  const attn_tensor *value, const attn_mha_opts *opts) {
  ATTN__ENTER(ctx);
  if (!saved) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_forward_save: saved is NULL");
  return attn__mha_forward(ctx, mha, out, weights, saved, query, key, value, opts);
}

void attn_mha_saved_free(attn_mha_saved *saved) {
  if (!saved) return;
  for (int i = 0; i < saved->n_owned; i++) attn__aligned_free(saved->owned[i]);
  free(saved->rope_pos);
  free(saved->cu_seqlens);
  free(saved);
}

/* ---- the path's arithmetic: float (the fast GEMM) or double (plain loops) ---- */
typedef struct path {
  int ref; /* 1: double, else float */
  const attn_ctx *ctx; /* its GEMM kernel and threads */
  int threads;
  size_t es;
} path;

/* rows x cols of the path's type; NULL (then reported as out of memory) also
 * when the size overflows, which the forward's checks make unreachable. */
static void *scratch(const path *p, int64_t rows, int64_t cols) {
  size_t bytes;
  return attn__alloc_size(rows, cols, 1, p->es, &bytes) ? NULL : attn__aligned_alloc(bytes);
}

static double get(const path *p, const void *buf, int64_t i) {
  return p->ref ? ((const double *)buf)[i] : ((const float *)buf)[i];
}

/* dst [cols, rows] = the transpose of src [rows, cols] (rows ld apart). */
static void transpose(const path *p, void *dst, const void *src, int64_t rows, int64_t cols, int64_t ld) {
  enum { T = 32 }; /* tiles, so that both sides stream through the cache */
  for (int64_t r0 = 0; r0 < rows; r0 += T)
    for (int64_t c0 = 0; c0 < cols; c0 += T) {
      const int64_t r1 = r0 + T < rows ? r0 + T : rows, c1 = c0 + T < cols ? c0 + T : cols;
      if (p->ref) {
        const double *s = src;
        double *d = dst;
        for (int64_t r = r0; r < r1; r++)
          for (int64_t c = c0; c < c1; c++) d[c * rows + r] = s[r * ld + c];
      } else {
        const float *s = src;
        float *d = dst;
        for (int64_t r = r0; r < r1; r++)
          for (int64_t c = c0; c < c1; c++) d[c * rows + r] = s[r * ld + c];
      }
    }
}

/* Weight W [rows, cols] (float) transposed into columns off .. off + rows of dst (ld apart). */
static void transpose_weight(const path *p, void *dst, int64_t ld, int64_t off, const float *W, int64_t rows,
                             int64_t cols) {
  for (int64_t c = 0; c < cols; c++)
    for (int64_t r = 0; r < rows; r++) {
      if (p->ref) ((double *)dst)[c * ld + off + r] = W[r * cols + c];
      else ((float *)dst)[c * ld + off + r] = W[r * cols + c];
    }
}

/* C (M, N) = A (M, K) . B (N, K)^T, rows lda, ldb, ldc apart. */
static void gemm_nt(const path *p, int64_t M, int64_t N, int64_t K, const void *A, int64_t lda, const void *B,
                    int64_t ldb, void *C, int64_t ldc) {
  if (!p->ref) {
    attn__sgemm_nt(p->ctx, M, N, K, A, lda, B, ldb, C, ldc, NULL);
    return;
  }
  const double *a = A, *b = B;
  double *c = C;
#pragma omp parallel for schedule(static) num_threads(p->threads)
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < N; j++) {
      double acc = 0;
      for (int64_t k = 0; k < K; k++) acc += a[i * lda + k] * b[j * ldb + k];
      c[i * ldc + j] = acc;
    }
}

/* dst [B*N, F] contiguous, the path's type = the [B, N, F] view t (f32 or f64). */
static void gather_rows(const path *p, void *dst, const attn_tensor *t) {
  const int64_t B = t->shape[0], N = t->shape[1], F = t->shape[2];
  for (int64_t b = 0; b < B; b++)
    for (int64_t n = 0; n < N; n++)
      for (int64_t f = 0; f < F; f++) {
        const double x = attn__load(t->data, t->dtype, b * t->strides[0] + n * t->strides[1] + f * t->strides[2]);
        const int64_t i = (b * N + n) * F + f;
        if (p->ref) ((double *)dst)[i] = x;
        else ((float *)dst)[i] = (float)x;
      }
}

/* The [B, N, F] view t (f32 or f64) = src [B*N, F] (the path's type); src NULL: zeros. */
static void scatter_rows(const path *p, attn_tensor *t, const void *src) {
  const int64_t B = t->shape[0], N = t->shape[1], F = t->shape[2];
  for (int64_t b = 0; b < B; b++)
    for (int64_t n = 0; n < N; n++)
      for (int64_t f = 0; f < F; f++)
        attn__store(t->data, t->dtype, b * t->strides[0] + n * t->strides[1] + f * t->strides[2],
                    src ? get(p, src, (b * N + n) * F + f) : 0.0);
}

/* One input x [rows, fin] feeding n stacked projections (weights which[0 .. n),
 * fout output columns in all), whose output gradient is dy [rows, fout] (rows
 * ldy apart): the weight and bias gradients into grads (unless NULL), and
 * dx = dy . [W_0; W_1; ...] into dx [rows, fin] (unless NULL). */
static attn_status input_backward(attn_ctx *ctx, const path *p, const attn_mha *mha, attn_mha *grads,
                                  const int *which, int n, int64_t rows, int64_t fin, const void *x, const void *dy,
                                  int64_t ldy, int64_t fout, void *dx) {
  if (grads) {
    int64_t most = 0; /* the largest single weight, for the double path's staging */
    for (int m = 0; m < n; m++) most = mha->rows[which[m]] > most ? mha->rows[which[m]] : most;
    void *xT = scratch(p, fin, rows), *dyT = scratch(p, fout, rows);
    double *stage = p->ref ? scratch(p, most, fin) : NULL; /* the double path: es is sizeof(double) */
    if (!xT || !dyT || (p->ref && !stage)) {
      attn__aligned_free(xT);
      attn__aligned_free(dyT);
      attn__aligned_free(stage);
      return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_backward: cannot allocate scratch for the weight gradients");
    }
    transpose(p, xT, x, rows, fin, fin);
    transpose(p, dyT, dy, rows, fout, ldy);
    int64_t off = 0;
    for (int m = 0; m < n; m++) {
      const int w = which[m];
      const int64_t fo = mha->rows[w];
      const void *g = (const char *)dyT + (size_t)(off * rows) * p->es; /* [fo, rows] */
      float *gw = grads->param[w];
      if (p->ref) {
        gemm_nt(p, fo, fin, rows, g, rows, xT, rows, stage, fin);
        for (int64_t i = 0; i < fo * fin; i++) gw[i] = (float)stage[i];
      } else {
        gemm_nt(p, fo, fin, rows, g, rows, xT, rows, gw, fin);
      }
      float *gb = grads->param[w + 1]; /* the bias follows its weight in attn_mha_param */
      if (gb)
        for (int64_t o = 0; o < fo; o++) {
          double s = 0;
          for (int64_t r = 0; r < rows; r++) s += get(p, g, o * rows + r);
          gb[o] = (float)s;
        }
      off += fo;
    }
    attn__aligned_free(xT);
    attn__aligned_free(dyT);
    attn__aligned_free(stage);
  }
  if (dx) {
    void *WT = scratch(p, fin, fout); /* WT[f, j] = [W_0; W_1; ...][j, f] */
    if (!WT) return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_backward: cannot allocate scratch for the input gradient");
    int64_t off = 0;
    for (int m = 0; m < n; m++) {
      transpose_weight(p, WT, fout, off, mha->param[which[m]], mha->rows[which[m]], fin);
      off += mha->rows[which[m]];
    }
    gemm_nt(p, rows, fin, fout, dy, ldy, WT, fout, dx, fin);
    attn__aligned_free(WT);
  }
  return ATTN_OK;
}

/* Zeroes grads' QK-norm parameters and sinks (present ones): their gradient
 * when there were no keys (every output row 0, whatever q, k and the sinks). */
static void zero_attention_grads(attn_mha *grads) {
  for (int i = ATTN_MHA_Q_NORM_WEIGHT; i < ATTN_MHA_NUM_PARAMS; i++)
    if (grads->param[i])
      memset(grads->param[i], 0, (size_t)attn__mha_param_numel(grads, i) * sizeof(float));
}

/* dQ [M, H*D] (rows ldq apart) and dK [Mk, Hk*D] (ldk), the gradients of the
 * normed q and k, turned in place into those of q and k before the norm;
 * the norm parameters' gradients into grads (unless NULL). */
static attn_status qk_norm_backward(attn_ctx *ctx, const attn_mha *mha, attn_mha *grads, const attn_mha_saved *saved,
                                    int ref, void *dQ, int64_t ldq, void *dK, int64_t ldk) {
  const attn_mha_config *c = &mha->cfg;
  const int64_t B = saved->B, Nq = saved->Nq, Nk = saved->Nk, H = c->num_heads, Hk = c->num_kv_heads;
  const int layer = c->qk_norm_kind == ATTN_NORM_LAYER;
  const int weight[2] = {ATTN_MHA_Q_NORM_WEIGHT, ATTN_MHA_K_NORM_WEIGHT};
  void *const d[2] = {dQ, dK}, *const x[2] = {(void *)saved->qx, (void *)saved->kx};
  const int64_t N[2] = {Nq, Nk}, heads[2] = {H, Hk}, ld[2] = {ldq, ldk};
  for (int i = 0; i < 2; i++) {
    attn_tensor dv = attn__mha_norm_view(mha, d[i], ref, B, N[i], heads[i], ld[i]);
    attn_tensor xv = attn__mha_norm_view(mha, x[i], ref, B, N[i], heads[i], heads[i] * mha->head_dim);
    attn_tensor w = attn__mha_param(mha, weight[i]), gw, gb;
    if (grads) {
      gw = attn__mha_param(grads, weight[i]);
      if (layer) gb = attn__mha_param(grads, weight[i] + 1); /* the bias follows its weight */
    }
    attn_status st = attn_head_norm_backward(ctx, &dv, grads ? &gw : NULL, grads && layer ? &gb : NULL, &dv, &xv, &w,
                                             c->qk_norm_kind, c->qk_norm_eps);
    if (st) return st;
  }
  return ATTN_OK;
}

/* dQ [M, qd] (ldq apart), dK and dV [Mk, kv] (ldkv apart) zeroed where mask (attn__mha_clip's) is 0. */
static void clip_backward(const path *p, const uint8_t *mask, void *dQ, int64_t ldq, void *dK, void *dV, int64_t ldkv,
                          int64_t M, int64_t Mk, int64_t qd, int64_t kv) {
  void *const d[3] = {dQ, dK, dV};
  const int64_t rows[3] = {M, Mk, Mk}, cols[3] = {qd, kv, kv}, ld[3] = {ldq, ldkv, ldkv};
  for (int i = 0; i < 3; i++) {
    for (int64_t r = 0; r < rows[i]; r++)
      for (int64_t c = 0; c < cols[i]; c++)
        if (!mask[r * cols[i] + c]) {
          if (p->ref) ((double *)d[i])[r * ld[i] + c] = 0;
          else ((float *)d[i])[r * ld[i] + c] = 0;
        }
    mask += rows[i] * cols[i];
  }
}

/* ---- argument checks ---------------------------------------------------------- */
static int same_config(const attn_mha_config *a, const attn_mha_config *b) {
  return a->embed_dim == b->embed_dim && a->num_heads == b->num_heads && a->num_kv_heads == b->num_kv_heads &&
         a->kdim == b->kdim && a->vdim == b->vdim && !a->bias == !b->bias && a->head_dim == b->head_dim &&
         a->out_bias == b->out_bias && a->sinks == b->sinks && a->qk_norm == b->qk_norm &&
         (!a->qk_norm || (a->qk_norm_kind == b->qk_norm_kind && a->qk_norm_eps == b->qk_norm_eps)) &&
         a->clip_qkv == b->clip_qkv;
}

static void fmt_config(char *buf, size_t n, const attn_mha_config *c) {
  static const char *const scope[] = {"none", "per head", "whole", "each head"}, *const kind[] = {"rms", "rms+1", "layer"};
  snprintf(buf, n,
           "embed_dim %lld, heads %lld, kv heads %lld, head_dim %lld, kdim %lld, vdim %lld, bias %s, out bias %s, "
           "qk-norm %s %s eps %g, sinks %s, clip_qkv %g",
           (long long)c->embed_dim, (long long)c->num_heads, (long long)c->num_kv_heads, (long long)c->head_dim,
           (long long)c->kdim, (long long)c->vdim, c->bias ? "on" : "off", c->out_bias ? "on" : "off",
           scope[c->qk_norm], c->qk_norm ? kind[c->qk_norm_kind] : "", c->qk_norm_eps, c->sinks ? "on" : "off",
           c->clip_qkv);
}

/* A [B, N, F] tensor of the backward: dout (an input) or a gradient (written, so no stride 0). */
static attn_status check_rows(attn_ctx *ctx, const attn_tensor *t, const char *what, int64_t B, int64_t N, int64_t F,
                              int ref, int written) {
  attn_status st = attn__check_tensor(ctx, t, what, 3);
  if (st) return st;
  if (t->dtype != ATTN_F32 && !(ref && t->dtype == ATTN_F64))
    return attn__fail(ctx, ATTN_E_DTYPE, "%s must be f32%s, got %s", what, ref ? " or f64" : "",
                      attn_dtype_name(t->dtype));
  if (t->shape[0] != B || t->shape[1] != N || t->shape[2] != F)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s is [%lld, %lld, %lld]; want [%lld, %lld, %lld]", what,
                      (long long)t->shape[0], (long long)t->shape[1], (long long)t->shape[2], (long long)B,
                      (long long)N, (long long)F);
  return written ? attn__check_writable(ctx, t, what) : ATTN_OK;
}

/* ---- the backward ----------------------------------------------------------------- */
attn_status attn_mha_backward(attn_ctx *ctx, attn_mha *mha, attn_tensor *dquery, attn_tensor *dkey, attn_tensor *dvalue,
                              attn_mha *grads, const attn_mha_saved *saved, const attn_tensor *dout) {
  ATTN__ENTER(ctx);
  if (!mha) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_backward: layer is NULL");
  if (!saved)
    return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_backward: saved is NULL (make it with attn_mha_forward_save)");
  const attn_mha_config *c = &mha->cfg;
  char ca[256], cb[256];
  if (!same_config(c, &saved->cfg)) {
    fmt_config(ca, sizeof ca, &saved->cfg);
    fmt_config(cb, sizeof cb, c);
    return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_backward: saved comes from a layer with %s; this one has %s", ca, cb);
  }
  const attn_kernel kern = attn_ctx_kernel(ctx);
  const int ref = kern == ATTN_KERNEL_REF;
  if (ref != saved->ref)
    return attn__fail(ctx, ATTN_E_INVALID,
                      "attn_mha_backward: saved comes from a %s forward but the context now runs %s; use the same "
                      "precision for both",
                      saved->ref ? "float64 (ATTN_KERNEL_REF)" : "fp32", attn_kernel_name(kern));
  if (grads) {
    if (grads == mha)
      return attn__fail(ctx, ATTN_E_INVALID,
                        "attn_mha_backward: grads must be another layer than mha (the backward reads mha's parameters)");
    if (!same_config(&grads->cfg, c)) {
      fmt_config(ca, sizeof ca, &grads->cfg);
      fmt_config(cb, sizeof cb, c);
      return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_backward: grads has %s; the layer has %s", ca, cb);
    }
  }
  const int64_t B = saved->B, Nq = saved->Nq, Nk = saved->Nk, E = c->embed_dim, kd = c->kdim, vd = c->vdim;
  const int64_t H = c->num_heads, Hk = c->num_kv_heads, D = mha->head_dim, qd = mha->q_dim, kv = mha->kv_dim;
  attn_status st;
  if ((st = check_rows(ctx, dout, "dout", B, Nq, E, ref, 0))) return st;
  if (saved->self && (dkey || dvalue))
    return attn__fail(ctx, ATTN_E_INVALID,
                      "attn_mha_backward: after self-attention dquery gets the whole input gradient; dkey and dvalue "
                      "must be NULL");
  if ((dquery && (st = check_rows(ctx, dquery, "dquery", B, Nq, E, ref, 1))) ||
      (dkey && (st = check_rows(ctx, dkey, "dkey", B, Nk, kd, ref, 1))) ||
      (dvalue && (st = check_rows(ctx, dvalue, "dvalue", B, Nk, vd, ref, 1))))
    return st;
  if (!grads && !dquery && !dkey && !dvalue) return ATTN_OK; /* nothing asked */

  const path p = {ref, ctx, attn__threads(ctx), ref ? sizeof(double) : sizeof(float)};
  const int64_t M = B * Nq, Mk = B * Nk;
  if (M == 0) { /* no output rows: every gradient is zero */
    if (grads)
      for (int i = 0; i < ATTN_MHA_NUM_PARAMS; i++)
        if (grads->param[i]) memset(grads->param[i], 0, (size_t)attn__mha_param_numel(grads, i) * sizeof(float));
    if (dquery) scatter_rows(&p, dquery, NULL);
    if (dkey) scatter_rows(&p, dkey, NULL);
    if (dvalue) scatter_rows(&p, dvalue, NULL);
    return ATTN_OK;
  }

  const attn_dtype dt = ref ? ATTN_F64 : ATTN_F32;
  const int self = saved->self;
  /* dQ, dK, dV: after self-attention side by side in one [M, qd + 2 kv] buffer, as
   * [dQ dK dV] for the stacked product; else each on its own. */
  const int64_t ldq = self ? qd + 2 * kv : qd, ldkv = self ? qd + 2 * kv : kv;
  int64_t nx = M * E; /* the largest input gradient */
  if (Mk * kd > nx) nx = Mk * kd;
  if (Mk * vd > nx) nx = Mk * vd;
  void *dO = scratch(&p, M, E), *dA = scratch(&p, M, qd), *dX = scratch(&p, nx, 1);
  void *dQ = scratch(&p, M, ldq), *dK = NULL, *dV = NULL;
  if (self) {
    dK = dQ ? (char *)dQ + (size_t)qd * p.es : NULL;
    dV = dQ ? (char *)dQ + (size_t)(qd + kv) * p.es : NULL;
  } else {
    dK = scratch(&p, Mk, kv);
    dV = scratch(&p, Mk, kv);
  }
  if (!dO || !dA || !dX || !dQ || !dK || !dV) {
    st = attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_backward: cannot allocate the gradients' buffers");
    goto done;
  }
  gather_rows(&p, dO, dout);

  /* out = A Wo^T + bo */
  static const int wo[1] = {ATTN_MHA_O_WEIGHT};
  if ((st = input_backward(ctx, &p, mha, grads, wo, 1, M, qd, saved->a, dO, E, E, dA))) goto done;

  /* A = SDPA(Q, K, V) */
  if (Nk == 0) { /* no keys: A was zero whatever Q was */
    memset(dQ, 0, (size_t)(M * ldq) * p.es);
    if (grads) zero_attention_grads(grads);
  } else {
    attn_tensor qh = attn__heads_view((void *)saved->q, dt, B, Nq, H, D, saved->ldq);
    attn_tensor kh = attn__heads_view((void *)saved->k, dt, B, Nk, Hk, D, saved->ldkv);
    attn_tensor vh = attn__heads_view((void *)saved->v, dt, B, Nk, Hk, D, saved->ldkv);
    attn_tensor oh = attn__heads_view((void *)saved->a, dt, B, Nq, H, D, qd);
    attn_tensor dah = attn__heads_view(dA, dt, B, Nq, H, D, qd);
    attn_tensor dqh = attn__heads_view(dQ, dt, B, Nq, H, D, ldq);
    attn_tensor dkh = attn__heads_view(dK, dt, B, Nk, Hk, D, ldkv), dvh = attn__heads_view(dV, dt, B, Nk, Hk, D, ldkv);
    int64_t ls[3] = {B, H, Nq};
    attn_tensor lse = attn_tensor_view((void *)saved->lse, dt, 3, ls);
    /* the layer's learned sinks: their gradient; sinks the caller passed are constants */
    attn_tensor *dsinks = grads && c->sinks ? &grads->sinks : NULL;
    st = ref ? attn_sdpa_backward_ref(ctx, &dqh, &dkh, &dvh, NULL, dsinks, &dah, &qh, &kh, &vh, &oh, &lse, &saved->attn)
             : attn_sdpa_backward(ctx, &dqh, &dkh, &dvh, NULL, dsinks, &dah, &qh, &kh, &vh, &oh, &lse, &saved->attn);
    /* q and k were rotated after their projections: their gradients turn back (R^T) */
    if (!st && saved->has_rope) st = attn__mha_rope(ctx, &saved->rope, saved->rope_pos, 1, ref, &dqh, &dkh);
    /* and before that clamped (clip_qkv): no gradient where a value met a bound from beyond */
    if (!st && c->clip_qkv > 0) clip_backward(&p, saved->clipped, dQ, ldq, dK, dV, ldkv, M, Mk, qd, kv);
    /* and before that normed: dQ, dK through the norm, in place */
    if (!st && c->qk_norm) st = qk_norm_backward(ctx, mha, grads, saved, ref, dQ, ldq, dK, ldkv);
    if (st) {
      char msg[ATTN__MSG_LEN];
      snprintf(msg, sizeof msg, "%s", attn_ctx_error(ctx));
      st = attn__fail(ctx, st, "attn_mha_backward: attention: %s", msg);
      goto done;
    }
  }

  /* Q, K, V = the input projections */
  if (self) {
    static const int wqkv[3] = {ATTN_MHA_Q_WEIGHT, ATTN_MHA_K_WEIGHT, ATTN_MHA_V_WEIGHT};
    if ((st = input_backward(ctx, &p, mha, grads, wqkv, 3, M, E, saved->xq, dQ, ldq, qd + 2 * kv, dquery ? dX : NULL)))
      goto done;
    if (dquery) scatter_rows(&p, dquery, dX);
  } else {
    static const int wq[1] = {ATTN_MHA_Q_WEIGHT}, wk[1] = {ATTN_MHA_K_WEIGHT}, wv[1] = {ATTN_MHA_V_WEIGHT};
    if ((st = input_backward(ctx, &p, mha, grads, wq, 1, M, E, saved->xq, dQ, ldq, qd, dquery ? dX : NULL))) goto done;
    if (dquery) scatter_rows(&p, dquery, dX);
    if ((st = input_backward(ctx, &p, mha, grads, wk, 1, Mk, kd, saved->xk, dK, ldkv, kv, dkey ? dX : NULL))) goto done;
    if (dkey) scatter_rows(&p, dkey, dX);
    if ((st = input_backward(ctx, &p, mha, grads, wv, 1, Mk, vd, saved->xv, dV, ldkv, kv, dvalue ? dX : NULL)))
      goto done;
    if (dvalue) scatter_rows(&p, dvalue, dX);
  }
done:
  attn__aligned_free(dO);
  attn__aligned_free(dA);
  attn__aligned_free(dX);
  attn__aligned_free(dQ);
  if (!self) {
    attn__aligned_free(dK);
    attn__aligned_free(dV);
  }
  return st;
}
