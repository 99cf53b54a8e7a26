/* Scaled dot-product attention: argument checks and dispatch to a kernel. */
#include "internal.h"
#include "logit.h"
#include "opts.h"

#include <float.h>
#include <stdio.h>

void attn_sdpa_opts_init(attn_sdpa_opts *opts) {
  if (!opts) return;
  memset(opts, 0, sizeof *opts);
  opts->size = sizeof *opts;
  opts->scale = NAN;
  opts->mask_mode = ATTN_MASK_KEEP;
}

static int dims_equal(const attn_tensor *t, int64_t a, int64_t b, int64_t c, int64_t d) {
  return t->shape[0] == a && t->shape[1] == b && t->shape[2] == c && t->shape[3] == d;
}

/* f32_only (the fp32 kernels): outputs f32, inputs f32, f16 or bf16 (widened as they
 * are packed). Otherwise (the oracle): outputs f32 or f64, inputs any float.
 * out (out = 2) may also be f16 or bf16 on either: the f32 result, rounded. */
static attn_status check_float_dtype(attn_ctx *ctx, const attn_tensor *t, const char *what, int f32_only, int out) {
  const attn_dtype dt = t->dtype;
  const int half = dt == ATTN_F16 || dt == ATTN_BF16;
  const int ok = out ? (dt == ATTN_F32 || (!f32_only && dt == ATTN_F64) || (out == 2 && half))
                     : (attn__is_float(dt) && (!f32_only || dt != ATTN_F64));
  if (ok) return ATTN_OK;
  return attn__fail(ctx, ATTN_E_DTYPE, "%s has dtype %s; this call takes %s", what, attn_dtype_name(dt),
                    out == 2 ? (f32_only ? "f32, f16 or bf16" : "f32, f64, f16 or bf16")
                    : out    ? (f32_only ? "f32" : "f32 or f64")
                             : (f32_only ? "f32, f16 or bf16" : "f32, f64, f16 or bf16"));
}

/* The fp32 backward reads its inputs in place: f32 (halves were widened before, f64 is refused). */
static attn_status check_f32(attn_ctx *ctx, const attn_tensor *t, const char *what) {
  if (t->dtype == ATTN_F32) return ATTN_OK;
  return attn__fail(ctx, ATTN_E_DTYPE, "%s has dtype %s; the backward pass takes f32, f16 or bf16", what,
                    attn_dtype_name(t->dtype));
}

/* An f32 [Hq] option (ALiBi slopes, sinks, their gradient), or NULL. */
attn_status attn__check_head_vector(attn_ctx *ctx, const attn_tensor *t, const char *what, int64_t Hq, int out) {
  if (!t) return ATTN_OK;
  attn_status st = attn__check_tensor(ctx, t, what, 1);
  if (st) return st;
  if (t->dtype != ATTN_F32 && !(out == 2 && t->dtype == ATTN_F64))
    return attn__fail(ctx, ATTN_E_DTYPE, "%s must be f32%s, got %s", what, out == 2 ? " or f64" : "",
                      attn_dtype_name(t->dtype));
  if (t->shape[0] != Hq)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s has %lld entries; want one per query head (%lld)", what,
                      (long long)t->shape[0], (long long)Hq);
  return out ? attn__check_writable(ctx, t, what) : ATTN_OK;
}

void attn__format_shape(char *buf, size_t n, const attn_tensor *t) {
  size_t used = 0;
  used += (size_t)snprintf(buf, n, "[");
  for (int i = 0; i < t->rank && used < n; i++)
    used += (size_t)snprintf(buf + used, n - used, i ? ", %lld" : "%lld", (long long)t->shape[i]);
  if (used < n) snprintf(buf + used, n - used, "]");
}

/* A packed batch's offsets cu[0..n]: 0 first, non-decreasing, `total` last.
 * Read in order, each entry checked before the next is compared with it, so
 * no hostile value (negative, past the total, overflowing a difference) gets
 * through to the kernels. */
static attn_status check_cu_seqlens(attn_ctx *ctx, const int64_t *cu, int64_t n, int64_t total, const char *what,
                                    const char *dim) {
  if (cu[0] != 0)
    return attn__fail(ctx, ATTN_E_INVALID, "%s[0] is %lld; must be 0", what, (long long)cu[0]);
  for (int64_t s = 1; s <= n; s++) {
    if (cu[s] < cu[s - 1] || cu[s] > total)
      return attn__fail(ctx, ATTN_E_INVALID, "%s[%lld] is %lld; entries must be non-decreasing from %s[%lld] = %lld "
                        "and at most %s = %lld", what, (long long)s, (long long)cu[s], what, (long long)(s - 1),
                        (long long)cu[s - 1], dim, (long long)total);
  }
  if (cu[n] != total)
    return attn__fail(ctx, ATTN_E_INVALID, "%s[%lld] (the last entry) is %lld; must be %s = %lld", what, (long long)n,
                      (long long)cu[n], dim, (long long)total);
  return ATTN_OK;
}

attn_status attn__check_cu_seqlens(attn_ctx *ctx, const attn_sdpa_opts *o, int64_t B, int64_t Nq, int64_t Nk) {
  attn_status st;
  if (!o->cu_seqlens_q) {
    if (o->cu_seqlens_k || o->num_seqs != 0)
      return attn__fail(ctx, ATTN_E_INVALID, "%s needs cu_seqlens_q (a packed batch)",
                        o->cu_seqlens_k ? "cu_seqlens_k" : "num_seqs != 0");
    return ATTN_OK;
  }
  if (o->num_seqs < 0 || o->num_seqs >= INT64_MAX / 2)
    return attn__fail(ctx, ATTN_E_INVALID, "num_seqs must be >= 0 with cu_seqlens_q, got %lld", (long long)o->num_seqs);
  if (B != 1)
    return attn__fail(ctx, ATTN_E_SHAPE, "a packed batch (cu_seqlens_q) takes q [1, Hq, total_q, D]; q has B = %lld",
                      (long long)B);
  if ((st = check_cu_seqlens(ctx, o->cu_seqlens_q, o->num_seqs, Nq, "cu_seqlens_q", "total_q (q's dim 2)")))
    return st;
  if (o->cu_seqlens_k &&
      (st = check_cu_seqlens(ctx, o->cu_seqlens_k, o->num_seqs, Nk, "cu_seqlens_k", "total_k (k's dim 2)")))
    return st;
  if (!o->cu_seqlens_k && Nk != Nq)
    return attn__fail(ctx, ATTN_E_SHAPE, "without cu_seqlens_k the keys are packed as the queries: total_k = %lld "
                      "must be total_q = %lld", (long long)Nk, (long long)Nq);
  return ATTN_OK;
}

/* The packed batch's options (attn_sdpa_opts.cu_seqlens_q): p's shapes are
 * already checked; they are those of one batch entry holding every sequence. */
static attn_status prepare_varlen(attn_ctx *ctx, attn__sdpa *p, const attn_sdpa_opts *o, const attn_tensor *weights) {
  attn_status st = attn__check_cu_seqlens(ctx, o, p->B, p->Nq, p->Nk);
  if (st || !o->cu_seqlens_q) return st;
  if (o->mask || o->key_padding)
    return attn__fail(ctx, ATTN_E_UNSUPPORTED, "a packed batch (cu_seqlens_q) takes no %s: it stores no padding to "
                      "mask, and each sequence's keys are its own", o->mask ? "mask" : "key_padding");
  if (weights)
    return attn__fail(ctx, ATTN_E_UNSUPPORTED, "a packed batch (cu_seqlens_q) has no weights output: run the "
                      "sequence alone for its weights");
  if (o->q_offset || o->k_offset)
    return attn__fail(ctx, ATTN_E_UNSUPPORTED, "a packed batch (cu_seqlens_q) takes no q_offset or k_offset: each "
                      "sequence counts its positions from its own start");
  p->cu_q = o->cu_seqlens_q;
  p->cu_k = o->cu_seqlens_k ? o->cu_seqlens_k : o->cu_seqlens_q;
  p->nseq = o->num_seqs;
  return ATTN_OK;
}

attn_status attn__sdpa_prepare(attn_ctx *ctx, attn__sdpa *p, attn_tensor *out, attn_tensor *lse, attn_tensor *weights,
                               const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                               const attn_sdpa_opts *opts, int f32_only) {
  attn_status st;
  memset(p, 0, sizeof *p);
  if ((st = attn__check_tensor(ctx, q, "q", 4)) || (st = attn__check_tensor(ctx, k, "k", 4)) ||
      (st = attn__check_tensor(ctx, v, "v", 4)) || (st = attn__check_tensor(ctx, out, "out", 4)))
    return st;
  if ((st = check_float_dtype(ctx, q, "q", f32_only, 0)) || (st = check_float_dtype(ctx, k, "k", f32_only, 0)) ||
      (st = check_float_dtype(ctx, v, "v", f32_only, 0)) || (st = check_float_dtype(ctx, out, "out", f32_only, 2)))
    return st;
  p->B = q->shape[0]; p->Hq = q->shape[1]; p->Nq = q->shape[2]; p->D = q->shape[3];
  p->Hk = k->shape[1]; p->Nk = k->shape[2]; p->Dv = v->shape[3];
  char sa[96], sb[96]; /* shapes are formatted only for a message */
  if (k->shape[0] != p->B || k->shape[3] != p->D) {
    attn__format_shape(sa, sizeof sa, k), attn__format_shape(sb, sizeof sb, q);
    return attn__fail(ctx, ATTN_E_SHAPE, "k %s does not match q %s: want [B, Hk, Nk, D] = [%lld, Hk, Nk, %lld]", sa, sb,
                      (long long)p->B, (long long)p->D);
  }
  if (!dims_equal(v, p->B, p->Hk, p->Nk, p->Dv)) {
    attn__format_shape(sa, sizeof sa, v), attn__format_shape(sb, sizeof sb, k);
    return attn__fail(ctx, ATTN_E_SHAPE, "v %s does not match k %s: want [B, Hk, Nk, Dv]", sa, sb);
  }
  if (!dims_equal(out, p->B, p->Hq, p->Nq, p->Dv)) {
    attn__format_shape(sa, sizeof sa, out);
    return attn__fail(ctx, ATTN_E_SHAPE, "out %s must be [B, Hq, Nq, Dv] = [%lld, %lld, %lld, %lld]", sa,
                      (long long)p->B, (long long)p->Hq, (long long)p->Nq, (long long)p->Dv);
  }
  if (p->D < 1) return attn__fail(ctx, ATTN_E_SHAPE, "head dim D of q and k must be at least 1, got %lld", (long long)p->D);
  if (p->D > ATTN_MAX_HEAD_DIM || p->Dv > ATTN_MAX_HEAD_DIM)
    return attn__fail(ctx, ATTN_E_SHAPE, "head dims D = %lld and Dv = %lld must be at most %lld (ATTN_MAX_HEAD_DIM)",
                      (long long)p->D, (long long)p->Dv, (long long)ATTN_MAX_HEAD_DIM);
  if (p->Hk < 1 || p->Hq % p->Hk != 0)
    return attn__fail(ctx, ATTN_E_SHAPE, "query heads (%lld) must be a multiple of key/value heads (%lld)",
                      (long long)p->Hq, (long long)p->Hk);
  p->group = p->Hq / p->Hk;
  if ((st = attn__check_writable(ctx, out, "out"))) return st;
  p->q = *q; p->k = *k; p->v = *v; p->out = *out;

  attn_sdpa_opts given; /* a caller's older, shorter struct gets the defaults for the rest */
  if ((st = attn__read_sdpa_opts(ctx, &given, opts, "opts"))) return st;
  opts = &given;
  if ((st = prepare_varlen(ctx, p, opts, weights))) return st;
  if ((st = attn__logit_prepare(ctx, p, opts, f32_only))) return st;
  if (weights) {
    attn_tensor *w = weights;
    if ((st = attn__check_tensor(ctx, w, "weights", 4)) || (st = check_float_dtype(ctx, w, "weights", f32_only, 1)) ||
        (st = attn__check_writable(ctx, w, "weights")))
      return st;
    if (!dims_equal(w, p->B, p->Hq, p->Nq, p->Nk))
      return attn__fail(ctx, ATTN_E_SHAPE, "weights must be [B, Hq, Nq, Nk] = [%lld, %lld, %lld, %lld]",
                        (long long)p->B, (long long)p->Hq, (long long)p->Nq, (long long)p->Nk);
    p->weights = w;
  }
  if (lse) {
    attn_tensor *l = lse;
    if ((st = attn__check_tensor(ctx, l, "lse", 3)) || (st = check_float_dtype(ctx, l, "lse", f32_only, 1)) ||
        (st = attn__check_writable(ctx, l, "lse")))
      return st;
    if (l->shape[0] != p->B || l->shape[1] != p->Hq || l->shape[2] != p->Nq)
      return attn__fail(ctx, ATTN_E_SHAPE, "lse must be [B, Hq, Nq] = [%lld, %lld, %lld]", (long long)p->B,
                        (long long)p->Hq, (long long)p->Nq);
    p->lse = l;
  }
  if (!isfinite(opts->dropout_p) || opts->dropout_p < 0 || opts->dropout_p > 1)
    return attn__fail(ctx, ATTN_E_INVALID, "dropout_p must be in [0, 1], got %g", opts->dropout_p);
  p->dropout_p = opts->dropout_p;
  p->dropout_seed = opts->dropout_seed;
  return ATTN_OK;
}

/* A tensor of the backward of exactly [a, b, c, d]: an input (any float dtype) or, when grad,
 * a gradient output (f32 or f64, writable; grad 2: f32, f16 or bf16). f32_only: f32 either way. */
static attn_status check_bwd4(attn_ctx *ctx, const attn_tensor *t, const char *what, const char *want, int64_t a,
                              int64_t b, int64_t c, int64_t d, int f32_only, int grad) {
  attn_status st;
  if ((st = attn__check_tensor(ctx, t, what, 4)) || (st = check_float_dtype(ctx, t, what, f32_only != 0, grad))) return st;
  if (!dims_equal(t, a, b, c, d)) {
    char s[96];
    attn__format_shape(s, sizeof s, t);
    return attn__fail(ctx, ATTN_E_SHAPE, "%s %s must be %s = [%lld, %lld, %lld, %lld]", what, s, want, (long long)a,
                      (long long)b, (long long)c, (long long)d);
  }
  return grad ? attn__check_writable(ctx, t, what) : ATTN_OK;
}

attn_status attn__sdpa_backward_prepare(attn_ctx *ctx, attn__sdpa *p, attn_tensor *dq, attn_tensor *dk, attn_tensor *dv,
                                        attn_tensor *mask_grad, attn_tensor *sinks_grad, const attn_tensor *dout,
                                        const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                                        const attn_tensor *out, const attn_tensor *lse, const attn_sdpa_opts *opts,
                                        int f32_only) {
  attn_status st;
  memset(p, 0, sizeof *p);
  /* out is an input here; attn__sdpa_prepare only reads the view it is given. */
  if ((st = attn__check_tensor(ctx, out, "out", 4))) return st;
  attn_tensor out_view = *out;
  /* The forward's optional outputs play no part in the backward. */
  if ((st = attn__sdpa_prepare(ctx, p, &out_view, NULL, NULL, q, k, v, opts, f32_only))) return st;
  if (mask_grad) {
    attn_tensor *g = mask_grad;
    if (!p->has_mask || p->mask_mode != ATTN_MASK_ADDITIVE)
      return attn__fail(ctx, ATTN_E_INVALID, "mask_grad needs an additive mask (mask_mode ATTN_MASK_ADDITIVE)%s",
                        p->has_mask ? "" : "; no mask was given");
    if ((st = attn__check_tensor(ctx, g, "mask_grad", 4)) ||
        (st = check_float_dtype(ctx, g, "mask_grad", f32_only, 1)) || (st = attn__check_writable(ctx, g, "mask_grad")))
      return st;
    if (!dims_equal(g, p->B, p->Hq, p->Nq, p->Nk)) {
      char sg[96];
      attn__format_shape(sg, sizeof sg, g);
      return attn__fail(ctx, ATTN_E_SHAPE, "mask_grad %s must be [B, Hq, Nq, Nk] = [%lld, %lld, %lld, %lld]", sg,
                        (long long)p->B, (long long)p->Hq, (long long)p->Nq, (long long)p->Nk);
    }
    p->mask_grad = g;
  }
  if (sinks_grad) {
    if (!p->sinks) return attn__fail(ctx, ATTN_E_INVALID, "sinks_grad needs sinks");
    if ((st = attn__check_head_vector(ctx, sinks_grad, "sinks_grad", p->Hq, f32_only ? 1 : 2))) return st;
    p->sinks_grad = sinks_grad;
  }
  if ((st = check_bwd4(ctx, dout, "dout", "[B, Hq, Nq, Dv]", p->B, p->Hq, p->Nq, p->Dv, f32_only, 0))) return st;
  if ((st = attn__check_tensor(ctx, lse, "lse", 3)) || (st = check_float_dtype(ctx, lse, "lse", f32_only, 0)))
    return st;
  if (lse->shape[0] != p->B || lse->shape[1] != p->Hq || lse->shape[2] != p->Nq) {
    char s[96];
    attn__format_shape(s, sizeof s, lse);
    return attn__fail(ctx, ATTN_E_SHAPE, "lse %s must be [B, Hq, Nq] = [%lld, %lld, %lld] (the forward's lse)", s,
                      (long long)p->B, (long long)p->Hq, (long long)p->Nq);
  }
  if (f32_only == 1 && ((st = check_f32(ctx, q, "q")) || (st = check_f32(ctx, k, "k")) || (st = check_f32(ctx, v, "v")) ||
                        (st = check_f32(ctx, dout, "dout")) || (st = check_f32(ctx, lse, "lse"))))
    return st;
  if (f32_only == 2 && (st = check_f32(ctx, lse, "lse"))) return st;
  const int grad = f32_only == 2 ? 2 : 1;
  if ((st = check_bwd4(ctx, dq, "dq", "[B, Hq, Nq, D]", p->B, p->Hq, p->Nq, p->D, f32_only, grad)) ||
      (st = check_bwd4(ctx, dk, "dk", "[B, Hk, Nk, D]", p->B, p->Hk, p->Nk, p->D, f32_only, grad)) ||
      (st = check_bwd4(ctx, dv, "dv", "[B, Hk, Nk, Dv]", p->B, p->Hk, p->Nk, p->Dv, f32_only, grad)))
    return st;
  return ATTN_OK;
}

/* Nothing to write: broadcast (stride 0) inputs may describe a huge problem
 * whose outputs are all empty, which must cost nothing. */
static int nothing_to_write(const attn__sdpa *p) {
  return attn_tensor_numel(&p->out) == 0 && (!p->weights || attn_tensor_numel(p->weights) == 0) &&
         (!p->lse || attn_tensor_numel(p->lse) == 0);
}

/* Which framework runs a validated forward: the oracle, the decode kernel (a
 * few query rows per kv head, streaming K and V once), or the blocked one. */
attn_status attn__sdpa_dispatch(attn_ctx *ctx, const attn__sdpa *p) {
  if (ctx->dispatch.kernel == ATTN_KERNEL_REF) return attn__sdpa_run_ref(ctx, p);
  if (p->B == 0 || p->Hq == 0 || p->Nq == 0) return ATTN_OK;
  /* a packed batch takes the blocked framework, whose tiles start at each sequence's first row */
  if (ctx->dispatch.decode_enabled && !p->cu_q && attn__decode_fits(&ctx->dispatch, p)) return attn__sdpa_run_decode(ctx, p);
  return attn__sdpa_run_blocked(ctx, p);
}

attn_status attn_sdpa(attn_ctx *ctx, attn_tensor *out, attn_tensor *lse, attn_tensor *weights, const attn_tensor *q,
                      const attn_tensor *k, const attn_tensor *v, const attn_sdpa_opts *opts) {
  ATTN__ENTER(ctx);
  attn_kernel kern = attn_ctx_kernel(ctx);
  attn__sdpa p;
  attn_status st = attn__sdpa_prepare(ctx, &p, out, lse, weights, q, k, v, opts, kern != ATTN_KERNEL_REF);
  if (st || nothing_to_write(&p)) return st;
  return attn__sdpa_dispatch(ctx, &p);
}

attn_status attn_sdpa_ref(attn_ctx *ctx, attn_tensor *out, attn_tensor *lse, attn_tensor *weights, const attn_tensor *q,
                          const attn_tensor *k, const attn_tensor *v, const attn_sdpa_opts *opts) {
  ATTN__ENTER(ctx);
  attn__sdpa p;
  attn_status st = attn__sdpa_prepare(ctx, &p, out, lse, weights, q, k, v, opts, 0);
  if (st || nothing_to_write(&p)) return st;
  return attn__sdpa_run_ref(ctx, &p);
}

/* The oracle writes f32 or f64 gradients: f16/bf16 ones are computed in f32
 * copies and rounded into place once every step has succeeded. */
static attn_status backward_ref_rounded(attn_ctx *ctx, attn_tensor *dq, attn_tensor *dk, attn_tensor *dv,
                                        attn_tensor *mask_grad, attn_tensor *sinks_grad, const attn_tensor *dout,
                                        const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                                        const attn_tensor *out, const attn_tensor *lse, const attn_sdpa_opts *opts) {
  static const char *const names[3] = {"dq", "dk", "dv"};
  attn_tensor *grads[3] = {dq, dk, dv}, *use[3] = {dq, dk, dv}, gw[3];
  attn_status st = ATTN_OK;
  for (int i = 0; i < 3; i++) gw[i].data = NULL;
  for (int i = 0; i < 3 && !st; i++) {
    if (!grads[i] || (grads[i]->dtype != ATTN_F16 && grads[i]->dtype != ATTN_BF16)) continue;
    if (!(st = attn__check_tensor(ctx, grads[i], names[i], 4)) && !(st = attn__check_writable(ctx, grads[i], names[i])))
      st = attn_tensor_alloc(ctx, &gw[i], ATTN_F32, 4, grads[i]->shape);
    use[i] = &gw[i];
  }
  if (!st) st = attn_sdpa_backward(ctx, use[0], use[1], use[2], mask_grad, sinks_grad, dout, q, k, v, out, lse, opts);
  for (int i = 0; i < 3 && !st; i++)
    if (gw[i].data) st = attn_tensor_copy(ctx, grads[i], &gw[i]);
  for (int i = 0; i < 3; i++)
    if (gw[i].data) attn_tensor_free(&gw[i]);
  return st;
}

attn_status attn_sdpa_backward(attn_ctx *ctx, attn_tensor *dq, attn_tensor *dk, attn_tensor *dv, attn_tensor *mask_grad,
                               attn_tensor *sinks_grad, const attn_tensor *dout, const attn_tensor *q,
                               const attn_tensor *k, const attn_tensor *v, const attn_tensor *out,
                               const attn_tensor *lse, const attn_sdpa_opts *opts) {
  ATTN__ENTER(ctx);
  const int ref = ctx->dispatch.kernel == ATTN_KERNEL_REF;
  const attn_tensor *in[8] = {dout, q, k, v, out, dq, dk, dv};
  int halves = 0, half_grads = 0;
  for (int i = 0; i < 8; i++) {
    const int half = in[i] && (in[i]->dtype == ATTN_F16 || in[i]->dtype == ATTN_BF16);
    halves |= half;
    half_grads |= half && i >= 5;
  }
  attn__sdpa p;
  if (halves && !ref) { /* the half tiles where they take the problem (dispatch.c), else fp32 on the widened values */
    attn_status st =
        attn__sdpa_backward_prepare(ctx, &p, dq, dk, dv, mask_grad, sinks_grad, dout, q, k, v, out, lse, opts, 2);
    if (st) return st;
    return attn__sdpa_backward_run_blocked(ctx, &p, dq, dk, dv, dout, out, lse);
  }
  if (ref && half_grads)
    return backward_ref_rounded(ctx, dq, dk, dv, mask_grad, sinks_grad, dout, q, k, v, out, lse, opts);
  attn_status st =
      attn__sdpa_backward_prepare(ctx, &p, dq, dk, dv, mask_grad, sinks_grad, dout, q, k, v, out, lse, opts, !ref);
  if (st) return st;
  if (ref) return attn__sdpa_backward_run_ref(ctx, &p, dq, dk, dv, dout, out, lse);
  return attn__sdpa_backward_run_blocked(ctx, &p, dq, dk, dv, dout, out, lse);
}

attn_status attn_alibi_slopes(float *slopes, int64_t heads) {
  if (!slopes || heads < 1) return ATTN_E_INVALID;
  int64_t n = 1;
  while (n * 2 <= heads) n *= 2;
  for (int64_t h = 0; h < n && h < heads; h++) slopes[h] = (float)exp2(-8.0 * (double)(h + 1) / (double)n);
  /* the rest: slopes 1, 3, 5, ... (odd exponents) of 2n heads */
  for (int64_t h = n; h < heads; h++) slopes[h] = (float)exp2(-8.0 * (double)(2 * (h - n) + 1) / (double)(2 * n));
  return ATTN_OK;
}
