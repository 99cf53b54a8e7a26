/* The multi-head layer, one decoding step at a time: project the new tokens,
 * append their keys and values to the cache, attend over the whole cache,
 * project out. Only the new tokens' rows are ever projected. */
#include "mha_internal.h"

#include <stdio.h>
#include <stdlib.h>

attn_status attn_mha_forward_cached(attn_ctx *ctx, attn_mha *mha, attn_kv_cache *cache, attn_tensor *out,
                                    const attn_tensor *x, const attn_mha_opts *opts) {
  ATTN__ENTER(ctx);
  if (!mha || !cache) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_forward_cached: layer or cache is NULL");
  attn_status st;
  if ((st = attn__check_tensor(ctx, x, "x", 3)) || (st = attn__check_tensor(ctx, out, "out", 3)) ||
      (st = attn__check_writable(ctx, out, "out")))
    return st;
  const attn_mha_config *c = &mha->cfg;
  const attn_kv_cache_config *kc = attn_kv_cache_get_config(cache);
  const int64_t E = c->embed_dim, H = c->num_heads, Hk = c->num_kv_heads, D = mha->head_dim, qd = mha->q_dim,
                kv = mha->kv_dim;
  const int64_t B = x->shape[0], n = x->shape[1];
  if (x->dtype != ATTN_F32 || out->dtype != ATTN_F32)
    return attn__fail(ctx, ATTN_E_DTYPE, "attn_mha_forward_cached: x and out must be f32, got %s and %s",
                      attn_dtype_name(x->dtype), attn_dtype_name(out->dtype));
  if (c->kdim != E || c->vdim != E)
    return attn__fail(ctx, ATTN_E_UNSUPPORTED, "attn_mha_forward_cached: self-attention only (kdim = vdim = E)");
  if (x->shape[2] != E || out->shape[0] != B || out->shape[1] != n || out->shape[2] != E)
    return attn__fail(ctx, ATTN_E_SHAPE, "attn_mha_forward_cached: x and out must both be [B, n, E] with E = %lld",
                      (long long)E);
  if (kc->batch != B || kc->kv_heads != Hk || kc->head_dim != D || kc->v_head_dim != D)
    return attn__fail(ctx, ATTN_E_SHAPE,
                      "attn_mha_forward_cached: the cache (batch %lld, kv heads %lld, dims %lld/%lld) does not fit this "
                      "layer and input (batch %lld, kv heads %lld, head dim %lld)",
                      (long long)kc->batch, (long long)kc->kv_heads, (long long)kc->head_dim,
                      (long long)kc->v_head_dim, (long long)B, (long long)Hk, (long long)D);
  attn_mha_opts given;
  attn_sdpa_opts so; /* refused before anything is appended */
  if ((st = attn__read_mha_opts(ctx, &given, opts, mha)) ||
      (st = attn__cached_opts(ctx, &so, &given.attn, "attn_mha_forward_cached")))
    return st;
  if (given.rope)
    return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_forward_cached: opts.rope is not taken here: the cache rotates "
                                           "keys and queries at their positions (attn_kv_cache_config.rope)");
  const int64_t ld = qd + 2 * kv;
  size_t nX, nQKV, nA; /* a broadcast x may claim more tokens than a buffer can hold */
  if (attn__alloc_size(B, n, E, sizeof(float), &nX) || attn__alloc_size(B, n, ld, sizeof(float), &nQKV) ||
      attn__alloc_size(B, n, qd, sizeof(float), &nA))
    return attn__fail(ctx, ATTN_E_NOMEM,
                      "attn_mha_forward_cached: the buffers for %lld x %lld new tokens are too large to allocate",
                      (long long)B, (long long)n);
  const int64_t M = B * n;
  float *X = attn__aligned_alloc(nX);
  float *QKV = attn__aligned_alloc(nQKV);
  float *A = attn__aligned_alloc(nA);
  float *Y = attn__aligned_alloc(nX);
  if (!X || !QKV || !A || !Y) {
    st = attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward_cached: cannot allocate activations");
    goto done;
  }
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < n; t++)
      for (int64_t e = 0; e < E; e++)
        X[(b * n + t) * E + e] = ((const float *)x->data)[b * x->strides[0] + t * x->strides[1] + e * x->strides[2]];
  attn__mha_qkv(ctx, QKV, X, mha, M);
  char msg[ATTN__MSG_LEN];
  /* QK-norm before the cache: it keeps keys normed, and rotates them (and the queries) itself */
  if (c->qk_norm && (st = attn__mha_qk_norm(ctx, mha, 0, QKV, ld, QKV + qd, ld, B, n, n))) {
    snprintf(msg, sizeof msg, "%s", attn_ctx_error(ctx));
    st = attn__fail(ctx, st, "attn_mha_forward_cached: QK-norm: %s", msg);
    goto done;
  }
  if (c->clip_qkv > 0) attn__mha_clip(mha, 0, QKV, ld, QKV + qd, QKV + qd + kv, ld, M, M, NULL);
  attn_tensor qh = attn__heads_view(QKV, ATTN_F32, B, n, H, D, ld);
  attn_tensor kh = attn__heads_view(QKV + qd, ATTN_F32, B, n, Hk, D, ld);
  attn_tensor vh = attn__heads_view(QKV + qd + kv, ATTN_F32, B, n, Hk, D, ld);
  attn_tensor ah = attn__heads_view(A, ATTN_F32, B, n, H, D, qd);
  if ((st = attn_kv_cache_append(ctx, cache, &kh, &vh, NULL))) {
    snprintf(msg, sizeof msg, "%s", attn_ctx_error(ctx));
    st = attn__fail(ctx, st, "attn_mha_forward_cached: %s", msg);
    goto done;
  }
  if ((st = attn_kv_cache_attend(ctx, cache, &ah, NULL, &qh, &so))) {
    snprintf(msg, sizeof msg, "%s", attn_ctx_error(ctx));
    /* the step failed: take its tokens back out so the cache is as it was */
    for (int64_t b = 0; b < B; b++) attn_kv_cache_truncate(ctx, cache, b, attn_kv_cache_length(cache, b) - n);
    st = attn__fail(ctx, st, "attn_mha_forward_cached: %s", msg);
    goto done;
  }
  st = attn__mha_out(ctx, out, A, mha, B, n, Y);
done:
  attn__aligned_free(X);
  attn__aligned_free(QKV);
  attn__aligned_free(A);
  attn__aligned_free(Y);
  return st;
}
