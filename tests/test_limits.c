/* Hostile sizes and arguments: shapes that describe huge or empty problems
 * (broadcast views need no memory behind them), windows and scales at the
 * edge of their types, a NULL context. Each call must return quickly with a
 * status, never hang, overflow a size or crash. An alarm turns a hang into a
 * failure. */
#include "testutil.h"

#include "attn_dlpack.h"

#include <signal.h>
#include <unistd.h>

static void on_alarm(int sig) {
  (void)sig;
  static const char msg[] = "test_limits: a call did not return within its time limit\n";
  if (write(2, msg, sizeof msg - 1) < 0) _exit(3);
  _exit(3);
}

/* Every stride 0: one element stands for the whole shape. */
static attn_tensor broadcast(void *data, attn_dtype dt, int rank, const int64_t *shape) {
  attn_tensor t = attn_tensor_view(data, dt, rank, shape);
  for (int i = 0; i < rank; i++) t.strides[i] = 0;
  return t;
}

static const attn_kernel kernels[] = {ATTN_KERNEL_REF, ATTN_KERNEL_C, ATTN_KERNEL_AVX2, ATTN_KERNEL_AVX512};

/* A backward with no query rows and no keys over 2^40 batches returns at once
 * (it used to walk B x Hk empty passes), as the forward does. */
static void empty_problems(attn_ctx *ctx) {
  const int64_t B = (int64_t)1 << 40;
  const int64_t s4[4] = {B, 1, 0, 4}, s3[3] = {B, 1, 0};
  attn_tensor q = attn_tensor_view(NULL, ATTN_F32, 4, s4), lse = attn_tensor_view(NULL, ATTN_F32, 3, s3);
  attn_tensor dq = q, dk = q, dv = q, out = q, dout = q;
  for (size_t ki = 0; ki < sizeof kernels / sizeof kernels[0]; ki++) {
    if (!attn_kernel_supported(kernels[ki])) continue;
    attn_ctx_set_kernel(ctx, kernels[ki]);
    alarm(20);
    CHECK_OK(ctx, attn_sdpa(ctx, &out, NULL, NULL, &q, &q, &q, NULL));
    CHECK_OK(ctx, attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, &dout, &q, &q, &q, &out, &lse, NULL));
    alarm(0);
  }
  /* broadcast q, k, v of 2^40 batches whose output has no elements (Dv = 0): nothing to compute */
  float one = 1;
  const int64_t sq[4] = {B, 2, 3, 4}, sv[4] = {B, 2, 3, 0};
  attn_tensor bq = broadcast(&one, ATTN_F32, 4, sq), bv = broadcast(&one, ATTN_F32, 4, sv);
  attn_tensor bo = attn_tensor_view(NULL, ATTN_F32, 4, sv);
  for (size_t ki = 0; ki < sizeof kernels / sizeof kernels[0]; ki++) {
    if (!attn_kernel_supported(kernels[ki])) continue;
    attn_ctx_set_kernel(ctx, kernels[ki]);
    alarm(20);
    CHECK_OK(ctx, attn_sdpa(ctx, &bo, NULL, NULL, &bq, &bq, &bv, NULL));
    alarm(0);
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
}

/* Keys broadcast along a sequence of 2^60: the packed keys, the decode
 * partials and the oracle's row of logits would take more bytes than a size_t
 * counts (they used to wrap into a small allocation, then overflow it). */
static void huge_broadcast_keys(attn_ctx *ctx, attn_ctx *blocked) {
  float x[4] = {1, 2, 3, 4}, o[4];
  const int64_t sq[4] = {1, 1, 1, 4}, sk[4] = {1, 1, (int64_t)1 << 60, 4};
  attn_tensor q = attn_tensor_view(x, ATTN_F32, 4, sq), out = attn_tensor_view(o, ATTN_F32, 4, sq);
  attn_tensor k = broadcast(x, ATTN_F32, 4, sk);
  attn_ctx *ctxs[2] = {ctx, blocked};
  for (int c = 0; c < 2; c++)
    for (size_t ki = 0; ki < sizeof kernels / sizeof kernels[0]; ki++) {
      if (!attn_kernel_supported(kernels[ki])) continue;
      attn_ctx_set_kernel(ctxs[c], kernels[ki]);
      alarm(20);
      CHECK_ERR(ctxs[c], attn_sdpa(ctxs[c], &out, NULL, NULL, &q, &k, &k, NULL), ATTN_E_NOMEM, "");
      alarm(0);
    }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  attn_ctx_set_kernel(blocked, ATTN_KERNEL_AUTO);
}

/* A window past every position changes nothing, INT64_MAX included (i' - window used to overflow). */
static void huge_window(attn_ctx *ctx) {
  enum { Nq = 9, Nk = 5, D = 8 };
  float q[Nq * D], k[Nk * D], v[Nk * D], a[Nq * D], b[Nq * D];
  tu_rng r = {11};
  tu_fill_f32(&r, q, Nq * D, 1), tu_fill_f32(&r, k, Nk * D, 1), tu_fill_f32(&r, v, Nk * D, 1);
  const int64_t sq[4] = {1, 1, Nq, D}, sk[4] = {1, 1, Nk, D};
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, sq), tk = attn_tensor_view(k, ATTN_F32, 4, sk);
  attn_tensor tv = attn_tensor_view(v, ATTN_F32, 4, sk), ta = attn_tensor_view(a, ATTN_F32, 4, sq);
  attn_tensor tb = attn_tensor_view(b, ATTN_F32, 4, sq);
  for (size_t ki = 0; ki < sizeof kernels / sizeof kernels[0]; ki++) {
    if (!attn_kernel_supported(kernels[ki])) continue;
    attn_ctx_set_kernel(ctx, kernels[ki]);
    for (int causal = ATTN_CAUSAL_TOP_LEFT; causal <= ATTN_CAUSAL_BOTTOM_RIGHT; causal++) {
      attn_sdpa_opts o;
      attn_sdpa_opts_init(&o);
      o.causal = (attn_causal)causal;
      tu_poison_f32(a, Nq * D);
      CHECK_OK(ctx, attn_sdpa(ctx, &ta, NULL, NULL, &tq, &tk, &tv, &o));
      o.window = INT64_MAX;
      tu_poison_f32(b, Nq * D);
      CHECK_OK(ctx, attn_sdpa(ctx, &tb, NULL, NULL, &tq, &tk, &tv, &o));
      CHECK(!memcmp(a, b, sizeof a), "kernel %s causal %d: window INT64_MAX must equal no window",
            attn_kernel_name(kernels[ki]), causal);
      /* and the backward reads the window too */
      float lse[Nq], g[Nq * D], dq[Nq * D], dk[Nk * D], dv[Nk * D];
      const int64_t sl[3] = {1, 1, Nq};
      attn_tensor tl = attn_tensor_view(lse, ATTN_F32, 3, sl), tg = attn_tensor_view(g, ATTN_F32, 4, sq);
      attn_tensor tdq = attn_tensor_view(dq, ATTN_F32, 4, sq), tdk = attn_tensor_view(dk, ATTN_F32, 4, sk);
      attn_tensor tdv = attn_tensor_view(dv, ATTN_F32, 4, sk);
      tu_fill_f32(&r, g, Nq * D, 1);
      CHECK_OK(ctx, attn_sdpa(ctx, &tb, &tl, NULL, &tq, &tk, &tv, &o));
      CHECK_OK(ctx, attn_sdpa_backward(ctx, &tdq, &tdk, &tdv, NULL, NULL, &tg, &tq, &tk, &tv, &tb, &tl, &o));
    }
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
}

/* A scale float32 cannot hold is refused by the fp32 kernels (every logit would
 * be Inf or NaN); the float64 oracle takes it. */
static void huge_scale(attn_ctx *ctx) {
  float x[4] = {0.5f, -0.25f, 0.125f, 1}, o[4];
  const int64_t s[4] = {1, 1, 1, 4};
  attn_tensor t = attn_tensor_view(x, ATTN_F32, 4, s), to = attn_tensor_view(o, ATTN_F32, 4, s);
  attn_sdpa_opts opt;
  attn_sdpa_opts_init(&opt);
  opt.scale = 1e308;
  for (size_t ki = 1; ki < sizeof kernels / sizeof kernels[0]; ki++) {
    if (!attn_kernel_supported(kernels[ki])) continue;
    attn_ctx_set_kernel(ctx, kernels[ki]);
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &t, &t, &t, &opt), ATTN_E_INVALID, "overflows float32");
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &to, NULL, NULL, &t, &t, &t, &opt));
  CHECK(o[0] == x[0], "one key: the oracle gives its value whatever the scale (%g)", o[0]);
  opt.scale = 1e-320; /* subnormal, finite: fine */
  CHECK_OK(ctx, attn_sdpa(ctx, &to, NULL, NULL, &t, &t, &t, &opt));
}

/* Head dims past ATTN_MAX_HEAD_DIM are refused before any per-thread scratch is sized from them. */
static void huge_head_dim(attn_ctx *ctx) {
  float x = 1, o[1];
  const int64_t s[4] = {1, 1, 1, ATTN_MAX_HEAD_DIM + 1}, so[4] = {1, 1, 1, 1};
  attn_tensor q = broadcast(&x, ATTN_F32, 4, s), v = attn_tensor_view(&x, ATTN_F32, 4, so);
  attn_tensor out = attn_tensor_view(o, ATTN_F32, 4, so);
  CHECK_ERR(ctx, attn_sdpa(ctx, &out, NULL, NULL, &q, &q, &v, NULL), ATTN_E_SHAPE, "ATTN_MAX_HEAD_DIM");
}

/* Outputs that alias themselves through a zero stride are refused by the layer and the cache too. */
static void broadcast_outputs(attn_ctx *ctx) {
  attn_mha_config mc;
  attn_mha_config_init(&mc, 4, 1);
  attn_mha *mha = NULL;
  CHECK_OK(ctx, attn_mha_create(ctx, &mha, &mc));
  float x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, y[8], w[4];
  const int64_t sx[3] = {1, 2, 4}, sw[3] = {1, 2, 2};
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 3, sx), ty = attn_tensor_view(y, ATTN_F32, 3, sx);
  attn_tensor tw = attn_tensor_view(w, ATTN_F32, 3, sw);
  attn_tensor by = ty, bw = tw;
  by.strides[1] = 0;
  bw.strides[2] = 0;
  CHECK_ERR(ctx, attn_mha_forward(ctx, mha, &by, NULL, &tx, NULL, NULL, NULL), ATTN_E_INVALID, "cannot broadcast");
  attn_mha_opts o;
  attn_mha_opts_init(&o);
  o.average_weights = 1;
  CHECK_ERR(ctx, attn_mha_forward(ctx, mha, &ty, &bw, &tx, NULL, NULL, &o), ATTN_E_INVALID, "cannot broadcast");
  attn_kv_cache_config kc;
  attn_kv_cache_config_init(&kc, 1, 8, 1, 4);
  attn_kv_cache *cache = NULL;
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &kc));
  CHECK_ERR(ctx, attn_mha_forward_cached(ctx, mha, cache, &by, &tx, NULL), ATTN_E_INVALID, "cannot broadcast");
  const int64_t s4[4] = {1, 1, 2, 4};
  attn_tensor q = attn_tensor_view(x, ATTN_F32, 4, s4), out = attn_tensor_view(y, ATTN_F32, 4, s4);
  CHECK_OK(ctx, attn_kv_cache_append(ctx, cache, &q, &q, NULL));
  out.strides[2] = 0;
  CHECK_ERR(ctx, attn_kv_cache_attend(ctx, cache, &out, NULL, &q, NULL), ATTN_E_INVALID, "cannot broadcast");
  attn_kv_cache_destroy(cache);
  attn_mha_destroy(mha);
}

/* A NULL context is refused, not dereferenced, by every call that takes one;
 * every other argument is valid, so the context is the only fault. */
static void null_context(attn_ctx *ctx) {
  float x[4] = {1, 2, 3, 4}, o[4], l[1], big[64];
  const int64_t s[4] = {1, 1, 1, 4}, s3[3] = {1, 1, 1}, sx[3] = {1, 1, 4};
  attn_tensor t = attn_tensor_view(x, ATTN_F32, 4, s), to = attn_tensor_view(o, ATTN_F32, 4, s);
  attn_tensor tl = attn_tensor_view(l, ATTN_F32, 3, s3), tx = attn_tensor_view(x, ATTN_F32, 3, sx);
  attn_tensor ty = attn_tensor_view(big, ATTN_F32, 3, sx), tmp;
#define NULL_CTX(call) CHECK((call) == ATTN_E_INVALID, "%s with a NULL context", #call)
  NULL_CTX(attn_ctx_set_threads(NULL, 1));
  NULL_CTX(attn_ctx_set_kernel(NULL, ATTN_KERNEL_AUTO));
  NULL_CTX(attn_tensor_alloc(NULL, &tmp, ATTN_F32, 4, s));
  NULL_CTX(attn_sdpa(NULL, &to, NULL, NULL, &t, &t, &t, NULL));
  NULL_CTX(attn_sdpa_ref(NULL, &to, NULL, NULL, &t, &t, &t, NULL));
  NULL_CTX(attn_sdpa_backward(NULL, &to, &to, &to, NULL, NULL, &t, &t, &t, &t, &t, &tl, NULL));
  NULL_CTX(attn_sdpa_backward_ref(NULL, &to, &to, &to, NULL, NULL, &t, &t, &t, &t, &t, &tl, NULL));
  attn_kv_cache_config kc;
  attn_kv_cache_config_init(&kc, 1, 8, 1, 4);
  attn_kv_cache *cache = NULL;
  NULL_CTX(attn_kv_cache_create(NULL, &cache, &kc));
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &kc));
  attn_tensor kv, vv;
  NULL_CTX(attn_kv_cache_append(NULL, cache, &t, &t, NULL));
  NULL_CTX(attn_kv_cache_attend(NULL, cache, &to, NULL, &t, NULL));
  NULL_CTX(attn_kv_cache_truncate(NULL, cache, 0, 0));
  NULL_CTX(attn_kv_cache_copy_row(NULL, cache, 0, 0));
  NULL_CTX(attn_kv_cache_view(NULL, &kv, &vv, cache, 0));
  attn_mha_config mc;
  attn_mha_config_init(&mc, 4, 1);
  attn_mha *mha = NULL;
  NULL_CTX(attn_mha_create(NULL, &mha, &mc));
  CHECK_OK(ctx, attn_mha_create(ctx, &mha, &mc));
  attn_tensor w;
  NULL_CTX(attn_mha_param_view(NULL, &w, mha, ATTN_MHA_Q_WEIGHT));
  CHECK_OK(ctx, attn_mha_param_view(ctx, &w, mha, ATTN_MHA_Q_WEIGHT));
  NULL_CTX(attn_mha_set_param(NULL, mha, "q_proj.weight", &w));
  NULL_CTX(attn_mha_forward(NULL, mha, &ty, NULL, &tx, NULL, NULL, NULL));
  NULL_CTX(attn_mha_forward_cached(NULL, mha, cache, &ty, &tx, NULL));
  attn_mha_saved *saved = NULL;
  NULL_CTX(attn_mha_forward_save(NULL, mha, &ty, NULL, &saved, &tx, NULL, NULL, NULL));
  CHECK_OK(ctx, attn_mha_forward_save(ctx, mha, &ty, NULL, &saved, &tx, NULL, NULL, NULL));
  NULL_CTX(attn_mha_backward(NULL, mha, NULL, NULL, NULL, mha, saved, &ty));
  /* files: a real one, so only the context is wrong */
  char path[512];
  const char *dir = getenv("ATTN_TEST_TMP");
  snprintf(path, sizeof path, "%s/limits_null_ctx.safetensors", dir ? dir : "/tmp");
  char npy[520];
  snprintf(npy, sizeof npy, "%s.npy", path);
  const char *names[4] = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"};
  attn_tensor ws[4] = {w, w, w, w};
  CHECK_OK(ctx, attn_safetensors_write(ctx, path, 4, names, ws));
  NULL_CTX(attn_safetensors_write(NULL, path, 4, names, ws));
  NULL_CTX(attn_npy_write(NULL, npy, &t));
  CHECK_OK(ctx, attn_npy_write(ctx, npy, &t));
  NULL_CTX(attn_npy_read(NULL, &tmp, npy));
  attn_safetensors *st = NULL;
  NULL_CTX(attn_safetensors_open(NULL, &st, path));
  CHECK_OK(ctx, attn_safetensors_open(ctx, &st, path));
  NULL_CTX(attn_safetensors_get(NULL, &tmp, st, "q_proj.weight"));
  attn_mha_naming nm;
  NULL_CTX(attn_mha_detect_naming(NULL, &nm, st, ""));
  NULL_CTX(attn_mha_load_safetensors_handle(NULL, mha, st, ""));
  attn_mha *made = NULL;
  NULL_CTX(attn_mha_create_from_safetensors_handle(NULL, &made, st, "", 1, 0));
  NULL_CTX(attn_mha_load_safetensors(NULL, mha, path, ""));
  NULL_CTX(attn_mha_create_from_safetensors(NULL, &made, path, "", 1, 0));
  attn_dl_tensor dl;
  int64_t shp[ATTN_MAX_RANK], str[ATTN_MAX_RANK];
  NULL_CTX(attn_tensor_to_dlpack(NULL, &dl, shp, str, &t));
  CHECK_OK(ctx, attn_tensor_to_dlpack(ctx, &dl, shp, str, &t));
  NULL_CTX(attn_tensor_from_dlpack(NULL, &tmp, &dl));
#undef NULL_CTX
  attn_safetensors_close(st);
  attn_mha_saved_free(saved);
  attn_mha_destroy(mha);
  attn_kv_cache_destroy(cache);
  remove(path);
  remove(npy);
}

int main(void) {
  signal(SIGALRM, on_alarm);
  attn_ctx *ctx, *blocked;
  attn_ctx_create(&ctx);
  attn_ctx_create(&blocked);
  CHECK_OK(blocked, attn_ctx_set_decode(blocked, 0));
  attn_ctx_set_threads(ctx, 2);
  empty_problems(ctx);
  huge_broadcast_keys(ctx, blocked);
  huge_window(ctx);
  huge_scale(ctx);
  huge_head_dim(ctx);
  broadcast_outputs(ctx);
  null_context(ctx);
  attn_ctx_destroy(blocked);
  attn_ctx_destroy(ctx);
  return tu_finish("test_limits");
}
