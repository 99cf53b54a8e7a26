/* The layer's real-checkpoint shapes: head_dim != E / H, out_bias apart from
 * bias, and QK-norm (per head or over the whole projection; RMS, Gemma's
 * 1 + w, LayerNorm). Creation and parameter views, and the configs refused. */
#include "testutil.h"

/* Creates a layer from c, expecting success. */
static attn_mha *make(attn_ctx *ctx, const attn_mha_config *c) {
  attn_mha *m = NULL;
  CHECK_OK(ctx, attn_mha_create(ctx, &m, c));
  return m;
}

/* Parameter which of m has shape [rows] (cols 0) or [rows, cols]; returns its data. */
static float *expect_param(attn_ctx *ctx, attn_mha *m, attn_mha_param which, int64_t rows, int64_t cols) {
  attn_tensor t;
  CHECK_OK(ctx, attn_mha_param_view(ctx, &t, m, which));
  if (t.data == NULL) return NULL;
  const int ok = cols ? (t.rank == 2 && t.shape[0] == rows && t.shape[1] == cols) : (t.rank == 1 && t.shape[0] == rows);
  CHECK(ok, "param %d: rank %d [%lld, %lld], want [%lld, %lld]", (int)which, t.rank, (long long)t.shape[0],
        (long long)(t.rank > 1 ? t.shape[1] : 0), (long long)rows, (long long)cols);
  return t.data;
}

static void expect_absent(attn_ctx *ctx, attn_mha *m, attn_mha_param which) {
  attn_tensor t;
  CHECK_ERR(ctx, attn_mha_param_view(ctx, &t, m, which), ATTN_E_NOT_FOUND, "no");
}

static void create_and_views(attn_ctx *ctx) {
  /* Qwen3-like: E 24, 4 heads of 8 (H*D = 32 != E), 2 kv heads, q/k/v biases, no o bias, per-head RMS */
  attn_mha_config c;
  attn_mha_config_init(&c, 24, 4);
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.out_bias = 0;
  c.qk_norm = ATTN_QK_NORM_PER_HEAD;
  attn_mha *m = make(ctx, &c);
  if (m) {
    const attn_mha_config *g = attn_mha_get_config(m);
    CHECK(g->head_dim == 8 && g->out_bias == 0 && g->qk_norm == ATTN_QK_NORM_PER_HEAD && g->bias == 1,
          "config kept: head_dim %lld out_bias %d", (long long)g->head_dim, g->out_bias);
    float *wq = expect_param(ctx, m, ATTN_MHA_Q_WEIGHT, 32, 24);
    float *wk = expect_param(ctx, m, ATTN_MHA_K_WEIGHT, 16, 24);
    float *wv = expect_param(ctx, m, ATTN_MHA_V_WEIGHT, 16, 24);
    CHECK(wk == wq + 32 * 24 && wv == wk + 16 * 24, "q, k, v weights packed back to back");
    float *bq = expect_param(ctx, m, ATTN_MHA_Q_BIAS, 32, 0);
    float *bk = expect_param(ctx, m, ATTN_MHA_K_BIAS, 16, 0);
    CHECK(bk == bq + 32, "q, k, v biases packed");
    expect_param(ctx, m, ATTN_MHA_V_BIAS, 16, 0);
    expect_param(ctx, m, ATTN_MHA_O_WEIGHT, 24, 32);
    expect_absent(ctx, m, ATTN_MHA_O_BIAS);
    float *nq = expect_param(ctx, m, ATTN_MHA_Q_NORM_WEIGHT, 8, 0), *nk = expect_param(ctx, m, ATTN_MHA_K_NORM_WEIGHT, 8, 0);
    int ones = 1;
    for (int i = 0; i < 8 && nq && nk; i++) ones &= nq[i] == 1.0f && nk[i] == 1.0f;
    CHECK(ones, "RMS weights start at 1");
    expect_absent(ctx, m, ATTN_MHA_Q_NORM_BIAS);
    expect_absent(ctx, m, ATTN_MHA_K_NORM_BIAS);
    attn_mha_destroy(m);
  }
  /* OLMo 2-like: whole-projection norm, no biases at all */
  attn_mha_config_init(&c, 16, 4);
  c.num_kv_heads = 2;
  c.bias = 0;
  c.qk_norm = ATTN_QK_NORM_WHOLE;
  if ((m = make(ctx, &c))) {
    CHECK(attn_mha_get_config(m)->out_bias == 0 && attn_mha_get_config(m)->head_dim == 4, "out_bias -1 follows bias");
    expect_param(ctx, m, ATTN_MHA_Q_NORM_WEIGHT, 16, 0);
    expect_param(ctx, m, ATTN_MHA_K_NORM_WEIGHT, 8, 0);
    for (int p = ATTN_MHA_Q_BIAS; p <= ATTN_MHA_O_BIAS; p += 2) expect_absent(ctx, m, (attn_mha_param)p);
    attn_mha_destroy(m);
  }
  /* Gemma 3-like: 1 + w starts at w = 0; LayerNorm with biases; o bias without q/k/v ones */
  attn_mha_config_init(&c, 8, 2);
  c.head_dim = 6;
  c.bias = 0;
  c.out_bias = 1;
  c.qk_norm = ATTN_QK_NORM_PER_HEAD;
  c.qk_norm_kind = ATTN_NORM_RMS_PLUS_ONE;
  if ((m = make(ctx, &c))) {
    float *nq = expect_param(ctx, m, ATTN_MHA_Q_NORM_WEIGHT, 6, 0);
    CHECK(nq && nq[0] == 0.0f && nq[5] == 0.0f, "RMS_PLUS_ONE weights start at 0");
    expect_param(ctx, m, ATTN_MHA_O_BIAS, 8, 0);
    expect_absent(ctx, m, ATTN_MHA_Q_BIAS);
    attn_mha_destroy(m);
  }
  c.qk_norm_kind = ATTN_NORM_LAYER;
  c.qk_norm = ATTN_QK_NORM_WHOLE;
  if ((m = make(ctx, &c))) {
    float *w = expect_param(ctx, m, ATTN_MHA_K_NORM_WEIGHT, 12, 0), *b = expect_param(ctx, m, ATTN_MHA_K_NORM_BIAS, 12, 0);
    CHECK(w && b && w[11] == 1.0f && b[11] == 0.0f, "LAYER: weight 1, bias 0");
    expect_param(ctx, m, ATTN_MHA_Q_NORM_BIAS, 12, 0);
    attn_mha_destroy(m);
  }
}

static void refused_configs(attn_ctx *ctx) {
  attn_mha_config c;
  attn_mha *m = (attn_mha *)&c; /* must come back NULL */
  attn_mha_config_init(&c, 10, 4);
  CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "divisible");
  CHECK(m == NULL, "no layer on failure");
  c.head_dim = 3; /* E need not divide by H once head_dim is given */
  m = make(ctx, &c);
  attn_mha_destroy(m);
  c.head_dim = -1;
  CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "head_dim");
  c.head_dim = ((int64_t)1 << 24) + 1;
  CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "head_dim");
  c.head_dim = (int64_t)1 << 62; /* H * D would overflow int64 */
  CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "head_dim");
  c.head_dim = (int64_t)1 << 23; /* 4 heads of 2^23: 2^25 features */
  CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "2^24");
  c.num_heads = (int64_t)1 << 40;
  c.head_dim = 1;
  CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "2^24");
  attn_mha_config_init(&c, 8, 2);
  c.out_bias = 2;
  CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "out_bias");
  c.out_bias = -1;
  c.qk_norm = 3;
  CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "qk_norm");
  c.qk_norm = ATTN_QK_NORM_PER_HEAD;
  c.qk_norm_kind = (attn_norm_kind)7;
  CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "qk_norm_kind");
  c.qk_norm_kind = ATTN_NORM_RMS;
  const double bad_eps[] = {0.0, -1e-6, NAN, INFINITY};
  for (int i = 0; i < 4; i++) {
    c.qk_norm_eps = bad_eps[i];
    CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "qk_norm_eps");
  }
  CHECK(m == NULL, "no layer on failure");
  /* eps is not read without QK-norm */
  c.qk_norm = ATTN_QK_NORM_NONE;
  m = make(ctx, &c);
  attn_mha_destroy(m);
  /* a caller built before head_dim existed gets E / H, out_bias as bias, no QK-norm */
  attn_mha_config_init(&c, 8, 2);
  c.size = offsetof(attn_mha_config, head_dim);
  c.bias = 0;
  c.head_dim = 99; /* beyond the old size: not read */
  if ((m = make(ctx, &c))) {
    CHECK(attn_mha_get_config(m)->head_dim == 4 && attn_mha_get_config(m)->out_bias == 0 &&
              attn_mha_get_config(m)->qk_norm == 0, "an old config's defaults");
    expect_absent(ctx, m, ATTN_MHA_Q_NORM_WEIGHT);
    attn_mha_destroy(m);
  }
}

int main(void) {
  tu_kernel_or_skip(getenv("ATTN_KERNEL"));
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx)) return 1;
  create_and_views(ctx);
  refused_configs(ctx);
  attn_ctx_destroy(ctx);
  return tu_finish("test_mha_qknorm");
}
