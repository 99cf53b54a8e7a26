/* The layer's real-checkpoint shapes: head_dim != E / H, out_bias apart from
 * bias, and QK-norm (per head or over the whole projection; RMS, Gemma's
 * 1 + w, LayerNorm). Creation, parameter views and the configs refused; then
 * random cases (GQA, cross-attention, RoPE, causal) on every kernel this CPU
 * has and 1-3 threads, with poisoned outputs: the forward against a float64
 * reference written here (projections, norm, RoPE, SDPA, out projection), the
 * backward (inputs and every parameter) against central differences of that
 * reference and against the REF path, and the cached step token by token
 * against the reference's causal forward. Argument: the number of cases. */
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
  /* Cohere-like: LayerNorm with each head's own weights [H, D], [Hk, D], and its biases alike */
  attn_mha_config_init(&c, 12, 4);
  c.num_kv_heads = 2;
  c.qk_norm = ATTN_QK_NORM_EACH_HEAD;
  c.qk_norm_kind = ATTN_NORM_LAYER;
  if ((m = make(ctx, &c))) {
    float *wq = expect_param(ctx, m, ATTN_MHA_Q_NORM_WEIGHT, 4, 3), *wk = expect_param(ctx, m, ATTN_MHA_K_NORM_WEIGHT, 2, 3);
    float *bk = expect_param(ctx, m, ATTN_MHA_K_NORM_BIAS, 2, 3);
    int start = wq && wk && bk;
    for (int i = 0; start && i < 12; i++) start &= wq[i] == 1.0f && (i >= 6 || (wk[i] == 1.0f && bk[i] == 0.0f));
    CHECK(start, "EACH_HEAD: every head's weights 1 and biases 0");
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
  const double bad_clip[] = {-1.0, NAN, INFINITY};
  for (int i = 0; i < 3; i++) {
    c.clip_qkv = bad_clip[i];
    CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "clip_qkv");
  }
  c.clip_qkv = 0;
  c.out_bias = 2;
  CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "out_bias");
  c.out_bias = -1;
  c.qk_norm = 4;
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


/* ---- an independent float64 reference of the layer ------------------------------- */
/* One case: the layer's config and the call's sizes and options. */
typedef struct lcase {
  int64_t E, H, Hk, D, kdim, vdim; /* kdim = vdim = E unless cross */
  int bias, out_bias, qk_norm, cross, rope, causal;
  attn_norm_kind kind;
  double eps;
  double clip; /* clip_qkv; 0 = none */
  int64_t B, Nq, Nk;
} lcase;

static void describe(char *buf, size_t n, const lcase *c) {
  snprintf(buf, n, "E%lld H%lld Hk%lld D%lld kdim%lld vdim%lld bias%d out_bias%d norm%d kind%d cross%d rope%d causal%d "
           "clip%g B%lld Nq%lld Nk%lld", (long long)c->E, (long long)c->H, (long long)c->Hk, (long long)c->D,
           (long long)c->kdim, (long long)c->vdim, c->bias, c->out_bias, c->qk_norm, (int)c->kind, c->cross, c->rope,
           c->causal, c->clip, (long long)c->B, (long long)c->Nq, (long long)c->Nk);
}

/* y [rows, nout] = x [rows, nin] . W [nout, nin]^T + b (b may be NULL) */
static void ref_linear(double *y, const double *x, const double *W, const double *b, int64_t rows, int64_t nout,
                       int64_t nin) {
  for (int64_t r = 0; r < rows; r++)
    for (int64_t o = 0; o < nout; o++) {
      double acc = b ? b[o] : 0;
      for (int64_t k = 0; k < nin; k++) acc += x[r * nin + k] * W[o * nin + k];
      y[r * nout + o] = acc;
    }
}

/* x [F] normed in place by kind: RMS x/rms*w, RMS_PLUS_ONE x/rms*(1+w), LAYER (x-mean)/sd*w+b */
static void ref_norm(double *x, int64_t F, const double *w, const double *b, attn_norm_kind kind, double eps) {
  double mean = 0, var = 0;
  if (kind == ATTN_NORM_LAYER) {
    for (int64_t f = 0; f < F; f++) mean += x[f];
    mean /= (double)F;
  }
  for (int64_t f = 0; f < F; f++) var += (x[f] - mean) * (x[f] - mean);
  const double inv = 1 / sqrt(var / (double)F + eps);
  for (int64_t f = 0; f < F; f++)
    x[f] = (x[f] - mean) * inv * (kind == ATTN_NORM_RMS_PLUS_ONE ? 1 + w[f] : w[f]) + (b ? b[f] : 0);
}

/* Rotates the D features of one head at position pos: pairs (i, i + D/2), theta 10000 (GPT-NeoX layout). */
static void ref_rope(double *x, int64_t D, int64_t pos) {
  for (int64_t i = 0; i < D / 2; i++) {
    const double a = (double)pos * pow(10000.0, -2.0 * (double)i / (double)D), c = cos(a), s = sin(a);
    const double x1 = x[i], x2 = x[i + D / 2];
    x[i] = x1 * c - x2 * s;
    x[i + D / 2] = x2 * c + x1 * s;
  }
}

/* x [n] clamped to [-clip, clip] (clip_qkv; 0: untouched) */
static int64_t ref_clipped; /* values the reference clamped: the clip_qkv cases must meet the bound */
static void ref_clip(double *x, int64_t n, double clip) {
  for (int64_t i = 0; clip > 0 && i < n; i++) {
    ref_clipped += x[i] < -clip || x[i] > clip;
    x[i] = x[i] < -clip ? -clip : x[i] > clip ? clip : x[i];
  }
}

/* rows [rows, heads*D]: QK-norm (as the case says), clip_qkv, then RoPE at position (row % N). */
static void ref_norm_rope(const lcase *c, double *rows, int64_t nrows, int64_t N, int64_t heads, const double *w,
                          const double *b) {
  for (int64_t r = 0; r < nrows; r++) {
    double *x = rows + r * heads * c->D;
    if (c->qk_norm == ATTN_QK_NORM_WHOLE) ref_norm(x, heads * c->D, w, b, c->kind, c->eps);
    else if (c->qk_norm == ATTN_QK_NORM_PER_HEAD)
      for (int64_t h = 0; h < heads; h++) ref_norm(x + h * c->D, c->D, w, b, c->kind, c->eps);
    else if (c->qk_norm == ATTN_QK_NORM_EACH_HEAD) /* head h's own row of [heads, D] */
      for (int64_t h = 0; h < heads; h++) ref_norm(x + h * c->D, c->D, w + h * c->D, b ? b + h * c->D : NULL, c->kind, c->eps);
    ref_clip(x, heads * c->D, c->clip);
    if (c->rope)
      for (int64_t h = 0; h < heads; h++) ref_rope(x + h * c->D, c->D, r % N);
  }
}

/* out [B, Nq, E] of the layer with parameters P (NULL: absent) on inputs xq [B, Nq, E],
 * xk [B, Nk, kdim], xv [B, Nk, vdim], and (unless NULL) the attention weights
 * w [B, H, Nq, Nk]; every step in double, written from the formulas. */
static void ref_layer_w(const lcase *c, double *const P[ATTN_MHA_NUM_PARAMS], const double *xq, const double *xk,
                        const double *xv, double *out, double *w) {
  const int64_t B = c->B, Nq = c->Nq, Nk = c->Nk, H = c->H, Hk = c->Hk, D = c->D, qd = H * D, kv = Hk * D;
  double *q = malloc(sizeof(double) * (size_t)(B * Nq * qd)), *k = malloc(sizeof(double) * (size_t)(B * Nk * kv + 1));
  double *v = malloc(sizeof(double) * (size_t)(B * Nk * kv + 1)), *a = malloc(sizeof(double) * (size_t)(B * Nq * qd));
  double *p = malloc(sizeof(double) * (size_t)(Nk + 1));
  ref_linear(q, xq, P[ATTN_MHA_Q_WEIGHT], P[ATTN_MHA_Q_BIAS], B * Nq, qd, c->E);
  ref_linear(k, xk, P[ATTN_MHA_K_WEIGHT], P[ATTN_MHA_K_BIAS], B * Nk, kv, c->kdim);
  ref_linear(v, xv, P[ATTN_MHA_V_WEIGHT], P[ATTN_MHA_V_BIAS], B * Nk, kv, c->vdim);
  ref_clip(v, B * Nk * kv, c->clip);
  ref_norm_rope(c, q, B * Nq, Nq, H, P[ATTN_MHA_Q_NORM_WEIGHT], P[ATTN_MHA_Q_NORM_BIAS]);
  ref_norm_rope(c, k, B * Nk, Nk, Hk, P[ATTN_MHA_K_NORM_WEIGHT], P[ATTN_MHA_K_NORM_BIAS]);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t g = h / (H / Hk); /* the kv head this query head reads */
      for (int64_t i = 0; i < Nq; i++) {
        const double *qi = q + (b * Nq + i) * qd + h * D;
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < Nk; j++) {
          double s = 0;
          for (int64_t d = 0; d < D; d++) s += qi[d] * k[(b * Nk + j) * kv + g * D + d];
          p[j] = c->causal && j > i ? -INFINITY : s / sqrt((double)D);
          mx = fmax(mx, p[j]);
        }
        for (int64_t j = 0; j < Nk; j++) sum += p[j] = exp(p[j] - mx);
        for (int64_t j = 0; w && j < Nk; j++) w[((b * H + h) * Nq + i) * Nk + j] = p[j] / sum;
        for (int64_t d = 0; d < D; d++) {
          double acc = 0;
          for (int64_t j = 0; j < Nk; j++) acc += p[j] / sum * v[(b * Nk + j) * kv + g * D + d];
          a[(b * Nq + i) * qd + h * D + d] = acc;
        }
      }
    }
  ref_linear(out, a, P[ATTN_MHA_O_WEIGHT], P[ATTN_MHA_O_BIAS], B * Nq, c->E, qd);
  free(q), free(k), free(v), free(a), free(p);
}

static void ref_layer(const lcase *c, double *const P[ATTN_MHA_NUM_PARAMS], const double *xq, const double *xk,
                      const double *xv, double *out) {
  ref_layer_w(c, P, xq, xk, xv, out, NULL);
}

/* The layer of case c, every parameter random (norm weights around their identity). */
static attn_mha *case_layer(attn_ctx *ctx, const lcase *c, tu_rng *r) {
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, c->E, c->H);
  cfg.num_kv_heads = c->Hk;
  cfg.head_dim = c->D;
  cfg.kdim = c->kdim;
  cfg.vdim = c->vdim;
  cfg.bias = c->bias;
  cfg.out_bias = c->out_bias;
  cfg.qk_norm = c->qk_norm;
  cfg.qk_norm_kind = c->kind;
  cfg.qk_norm_eps = c->eps;
  cfg.clip_qkv = c->clip;
  attn_mha *m = make(ctx, &cfg);
  for (int p = 0; m && p < ATTN_MHA_NUM_PARAMS; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, m, (attn_mha_param)p)) continue;
    float *d = t.data;
    const int64_t n = attn_tensor_numel(&t);
    const int norm_weight = p == ATTN_MHA_Q_NORM_WEIGHT || p == ATTN_MHA_K_NORM_WEIGHT;
    for (int64_t i = 0; i < n; i++)
      d[i] = (float)((norm_weight && c->kind != ATTN_NORM_RMS_PLUS_ONE ? 1.0 : 0.0) + 0.5 * tu_uniform(r));
  }
  return m;
}

/* The layer's parameters as doubles (NULL where absent); free with free_params. */
static void params_f64(attn_ctx *ctx, attn_mha *m, double *P[ATTN_MHA_NUM_PARAMS]) {
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    attn_tensor t;
    P[p] = NULL;
    if (attn_mha_param_view(ctx, &t, m, (attn_mha_param)p)) continue;
    P[p] = tu_to_f64(&t);
  }
}

static void free_params(double *P[ATTN_MHA_NUM_PARAMS]) {
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) free(P[p]);
}

static int64_t param_numel(attn_ctx *ctx, attn_mha *m, int p) {
  attn_tensor t;
  return attn_mha_param_view(ctx, &t, m, (attn_mha_param)p) ? 0 : attn_tensor_numel(&t);
}

static double rel_l2(const double *a, const double *b, int64_t n) {
  return tu_count_nan(a, n) ? INFINITY : tu_rel_l2(a, b, n);
}

/* ||a - b|| / max(||b||, floor): a gradient that is zero in exact arithmetic
 * (k's bias, and LayerNorm's k bias without RoPE: a shift every score of a
 * query shares) is measured against the case's gradient scale instead. */
static double err_floor(const double *a, const double *b, int64_t n, double floor) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return tu_count_nan(a, n) ? INFINITY : sqrt(num) / fmax(sqrt(den), floor);
}

static const attn_kernel kernels[] = {ATTN_KERNEL_REF, ATTN_KERNEL_C, ATTN_KERNEL_AVX2, ATTN_KERNEL_AVX512,
                                      ATTN_KERNEL_AVX512_BF16, ATTN_KERNEL_AMX};

/* The case's inputs: random rows in float (as the layer takes them) and the same in double. */
typedef struct inputs {
  float *q, *k, *v;
  double *qd, *kd, *vd;
  attn_tensor tq, tk, tv;
} inputs;

static void make_inputs(inputs *in, const lcase *c, tu_rng *r) {
  const int64_t nq = c->B * c->Nq * c->E, nk = c->B * c->Nk * c->kdim, nv = c->B * c->Nk * c->vdim;
  const int64_t sq[3] = {c->B, c->Nq, c->E}, sk[3] = {c->B, c->Nk, c->kdim}, sv[3] = {c->B, c->Nk, c->vdim};
  in->q = malloc(sizeof(float) * (size_t)nq), in->k = malloc(sizeof(float) * (size_t)(nk + 1));
  in->v = malloc(sizeof(float) * (size_t)(nv + 1));
  tu_fill_f32(r, in->q, nq, 1), tu_fill_f32(r, in->k, nk, 1), tu_fill_f32(r, in->v, nv, 1);
  in->tq = attn_tensor_view(in->q, ATTN_F32, 3, sq);
  in->tk = attn_tensor_view(in->k, ATTN_F32, 3, sk);
  in->tv = attn_tensor_view(in->v, ATTN_F32, 3, sv);
  if (!c->cross) { /* self-attention: the layer gets key = value = NULL */
    in->tk = in->tv = in->tq;
  }
  in->qd = tu_to_f64(&in->tq), in->kd = tu_to_f64(&in->tk), in->vd = tu_to_f64(&in->tv);
}

static void free_inputs(inputs *in) {
  free(in->q), free(in->k), free(in->v), free(in->qd), free(in->kd), free(in->vd);
}

static attn_mha_opts case_opts(const lcase *c, attn_rope_opts *rope) {
  attn_mha_opts o;
  attn_mha_opts_init(&o);
  o.attn.causal = c->causal ? ATTN_CAUSAL_TOP_LEFT : ATTN_CAUSAL_NONE;
  attn_rope_opts_init(rope);
  if (c->rope) o.rope = rope;
  return o;
}

/* ---- forward: every kernel, 1-3 threads, against ref_layer --------------------------- */
static void forward_case(attn_ctx *ctx, const lcase *c, uint64_t seed) {
  char desc[256];
  describe(desc, sizeof desc, c);
  tu_rng r = {seed};
  attn_mha *m = case_layer(ctx, c, &r);
  if (!m) return;
  inputs in;
  make_inputs(&in, c, &r);
  double *P[ATTN_MHA_NUM_PARAMS];
  params_f64(ctx, m, P);
  const int64_t n = c->B * c->Nq * c->E, so[3] = {c->B, c->Nq, c->E};
  const int64_t nw = c->B * c->H * c->Nq * c->Nk, sw[4] = {c->B, c->H, c->Nq, c->Nk};
  double *want = malloc(sizeof(double) * (size_t)n), *wantw = malloc(sizeof(double) * (size_t)(nw + 1));
  ref_layer_w(c, P, in.qd, in.kd, in.vd, want, wantw);
  float *out = malloc(sizeof(float) * (size_t)n), *w = malloc(sizeof(float) * (size_t)(nw + 1));
  double *out64 = malloc(sizeof(double) * (size_t)n), *w64 = malloc(sizeof(double) * (size_t)(nw + 1));
  attn_rope_opts rope;
  const attn_mha_opts o = case_opts(c, &rope);
  for (size_t ki = 0; ki < sizeof kernels / sizeof kernels[0]; ki++) {
    if (!attn_kernel_supported(kernels[ki])) continue;
    attn_ctx_set_kernel(ctx, kernels[ki]);
    const int ref = kernels[ki] == ATTN_KERNEL_REF;
    for (int threads = 1; threads <= 3; threads++) {
      attn_ctx_set_threads(ctx, threads);
      attn_tensor to = ref ? attn_tensor_view(out64, ATTN_F64, 3, so) : attn_tensor_view(out, ATTN_F32, 3, so);
      attn_tensor tw = ref ? attn_tensor_view(w64, ATTN_F64, 4, sw) : attn_tensor_view(w, ATTN_F32, 4, sw);
      for (int64_t i = 0; i < n; i++) out[i] = NAN, out64[i] = NAN;
      for (int64_t i = 0; i < nw; i++) w[i] = NAN, w64[i] = NAN;
      const int with_w = threads == 2; /* the weights per head, on one of the thread counts */
      CHECK_OK(ctx, attn_mha_forward(ctx, m, &to, with_w ? &tw : NULL, &in.tq, c->cross ? &in.tk : NULL,
                                     c->cross ? &in.tv : NULL, &o));
      double *got = tu_to_f64(&to), *gotw = tu_to_f64(&tw);
      const double e = rel_l2(got, want, n), ew = with_w ? rel_l2(gotw, wantw, nw) : 0;
      CHECK(e <= (ref ? 1e-12 : 2e-5) && ew <= (ref ? 1e-12 : 2e-5),
            "forward %s, %s kernel, %d threads: rel L2 %.3g, weights %.3g", desc, attn_kernel_name(kernels[ki]),
            threads, e, ew);
      free(got), free(gotw);
    }
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  attn_ctx_set_threads(ctx, 0);
  free_params(P);
  free_inputs(&in);
  free(want), free(out), free(out64), free(wantw), free(w), free(w64);
  attn_mha_destroy(m);
}

/* ---- backward: against central differences of ref_layer, and the REF path --------------- */
/* L = sum(g * out) in double through ref_layer. */
static double ref_loss(const lcase *c, double *const P[ATTN_MHA_NUM_PARAMS], const inputs *in, const double *g,
                       double *scratch) {
  ref_layer(c, P, in->qd, c->cross ? in->kd : in->qd, c->cross ? in->vd : in->qd, scratch);
  double L = 0;
  for (int64_t i = 0; i < c->B * c->Nq * c->E; i++) L += g[i] * scratch[i];
  return L;
}

/* dL/dx_i by central differences, x being any of the reference's doubles. */
static double central(const lcase *c, double *const P[ATTN_MHA_NUM_PARAMS], inputs *in, const double *g,
                      double *scratch, double *x) {
  const double h = 2e-6, keep = *x;
  *x = keep + h;
  const double lp = ref_loss(c, P, in, g, scratch);
  *x = keep - h;
  const double lm = ref_loss(c, P, in, g, scratch);
  *x = keep;
  return (lp - lm) / (2 * h);
}

static void backward_case(attn_ctx *ctx, const lcase *c, uint64_t seed) {
  char desc[256];
  describe(desc, sizeof desc, c);
  tu_rng r = {seed};
  attn_mha *m = case_layer(ctx, c, &r), *grads = case_layer(ctx, c, &r);
  if (!m || !grads) {
    attn_mha_destroy(m), attn_mha_destroy(grads);
    return;
  }
  inputs in;
  make_inputs(&in, c, &r);
  double *P[ATTN_MHA_NUM_PARAMS];
  params_f64(ctx, m, P);
  const int64_t n = c->B * c->Nq * c->E, so[3] = {c->B, c->Nq, c->E};
  const int64_t nin[3] = {n, c->B * c->Nk * c->kdim, c->B * c->Nk * c->vdim};
  double *g = malloc(sizeof(double) * (size_t)n), *scratch = malloc(sizeof(double) * (size_t)n);
  float *gf = malloc(sizeof(float) * (size_t)n);
  for (int64_t i = 0; i < n; i++) gf[i] = (float)tu_uniform(&r), g[i] = gf[i];
  /* the reference gradients: every parameter element and every input element */
  double *fdP[ATTN_MHA_NUM_PARAMS] = {0}, *fdX[3];
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    if (!P[p]) continue;
    const int64_t np = param_numel(ctx, m, p);
    fdP[p] = malloc(sizeof(double) * (size_t)np);
    for (int64_t i = 0; i < np; i++) fdP[p][i] = central(c, P, &in, g, scratch, &P[p][i]);
  }
  double scale = 0; /* the L2 norm of every parameter's gradient */
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++)
    for (int64_t i = 0; fdP[p] && i < param_numel(ctx, m, p); i++) scale += fdP[p][i] * fdP[p][i];
  const double floor = 0.05 * sqrt(scale);
  double *xs[3] = {in.qd, in.kd, in.vd};
  for (int i = 0; i < 3; i++) {
    fdX[i] = malloc(sizeof(double) * (size_t)(nin[i] + 1));
    if (i && !c->cross) continue;
    for (int64_t e = 0; e < nin[i]; e++) fdX[i][e] = central(c, P, &in, g, scratch, &xs[i][e]);
  }
  attn_rope_opts rope;
  const attn_mha_opts o = case_opts(c, &rope);
  const int64_t sk[3] = {c->B, c->Nk, c->kdim}, sv[3] = {c->B, c->Nk, c->vdim};
  double *refP[ATTN_MHA_NUM_PARAMS] = {0}, *refX[3] = {0}; /* the REF path's gradients (kernels[0]) */
  for (size_t ki = 0; ki < sizeof kernels / sizeof kernels[0]; ki++) {
    if (!attn_kernel_supported(kernels[ki])) continue;
    attn_ctx_set_kernel(ctx, kernels[ki]);
    const int ref = kernels[ki] == ATTN_KERNEL_REF;
    const attn_dtype dt = ref ? ATTN_F64 : ATTN_F32;
    const size_t es = ref ? sizeof(double) : sizeof(float);
    void *out = malloc(es * (size_t)n), *dout = malloc(es * (size_t)n);
    void *dx[3] = {malloc(es * (size_t)nin[0]), malloc(es * (size_t)(nin[1] + 1)), malloc(es * (size_t)(nin[2] + 1))};
    for (int64_t i = 0; i < n; i++) {
      if (ref) ((double *)dout)[i] = g[i];
      else ((float *)dout)[i] = gf[i];
    }
    attn_tensor to = attn_tensor_view(out, dt, 3, so), tg = attn_tensor_view(dout, dt, 3, so);
    attn_tensor tdx[3] = {attn_tensor_view(dx[0], dt, 3, so), attn_tensor_view(dx[1], dt, 3, sk),
                          attn_tensor_view(dx[2], dt, 3, sv)};
    for (int threads = 1; threads <= 3; threads++) {
      attn_ctx_set_threads(ctx, threads);
      for (int i = 0; i < 3; i++) memset(dx[i], 0xff, es * (size_t)nin[i]); /* NaN in f32 and f64 */
      for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
        attn_tensor t;
        if (!attn_mha_param_view(ctx, &t, grads, (attn_mha_param)p)) tu_poison_f32(t.data, attn_tensor_numel(&t));
      }
      attn_mha_saved *sv_state = NULL;
      CHECK_OK(ctx, attn_mha_forward_save(ctx, m, &to, NULL, &sv_state, &in.tq, c->cross ? &in.tk : NULL,
                                          c->cross ? &in.tv : NULL, &o));
      CHECK_OK(ctx, attn_mha_backward(ctx, m, &tdx[0], c->cross ? &tdx[1] : NULL, c->cross ? &tdx[2] : NULL, grads,
                                      sv_state, &tg));
      attn_mha_saved_free(sv_state);
      /* fp32 products and the norm's division by a small rms: looser than the double path */
      const double tol = ref ? 1e-5 : 2e-4;
      for (int i = 0; i < (c->cross ? 3 : 1); i++) {
        double *got = tu_to_f64(&tdx[i]);
        const double e = rel_l2(got, fdX[i], nin[i]), er = ref || !refX[i] ? 0 : rel_l2(got, refX[i], nin[i]);
        CHECK(e <= tol && er <= 1e-4, "backward %s, %s, %d threads: d%s rel L2 %.3g (central differences), %.3g (REF)",
              desc, attn_kernel_name(kernels[ki]), threads, i == 0 ? "query" : i == 1 ? "key" : "value", e, er);
        if (ref && threads == 1) refX[i] = got;
        else free(got);
      }
      for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
        attn_tensor t;
        const int has = attn_mha_param_view(ctx, &t, grads, (attn_mha_param)p) == ATTN_OK;
        CHECK(has == (P[p] != NULL), "%s: grads has parameter %d iff the layer does", desc, p);
        if (!has || !P[p]) continue;
        double *got = tu_to_f64(&t);
        const int64_t np = attn_tensor_numel(&t);
        const double e = err_floor(got, fdP[p], np, floor), er = ref || !refP[p] ? 0 : err_floor(got, refP[p], np, floor);
        CHECK(e <= tol && er <= 1e-4, "backward %s, %s, %d threads: parameter %d rel L2 %.3g (central differences), "
              "%.3g (REF)", desc, attn_kernel_name(kernels[ki]), threads, p, e, er);
        if (ref && threads == 1) refP[p] = got;
        else free(got);
      }
    }
    free(out), free(dout), free(dx[0]), free(dx[1]), free(dx[2]);
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  attn_ctx_set_threads(ctx, 0);
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) free(fdP[p]), free(refP[p]);
  for (int i = 0; i < 3; i++) free(fdX[i]), free(refX[i]);
  free_params(P);
  free_inputs(&in);
  free(g), free(gf), free(scratch);
  attn_mha_destroy(m), attn_mha_destroy(grads);
}

/* ---- the cached step: token by token (and in chunks) equals the causal forward ------------ */
static void cached_case(attn_ctx *ctx, const lcase *c, uint64_t seed) {
  char desc[256];
  describe(desc, sizeof desc, c);
  tu_rng r = {seed};
  attn_mha *m = case_layer(ctx, c, &r);
  if (!m) return;
  inputs in;
  make_inputs(&in, c, &r);
  double *P[ATTN_MHA_NUM_PARAMS];
  params_f64(ctx, m, P);
  const int64_t T = c->Nq, n = c->B * T * c->E;
  double *want = malloc(sizeof(double) * (size_t)n);
  ref_layer(c, P, in.qd, in.qd, in.qd, want); /* causal self-attention (the case says causal, rope) */
  float *inc = malloc(sizeof(float) * (size_t)n);
  attn_rope_opts rope;
  attn_rope_opts_init(&rope);
  for (size_t ki = 1; ki < sizeof kernels / sizeof kernels[0]; ki++) { /* the cached step is fp32 only */
    if (!attn_kernel_supported(kernels[ki])) continue;
    attn_ctx_set_kernel(ctx, kernels[ki]);
    for (int threads = 1; threads <= 3; threads++) {
      attn_ctx_set_threads(ctx, threads);
      attn_kv_cache_config kc;
      attn_kv_cache_config_init(&kc, c->B, T, c->Hk, c->D);
      if (c->rope) kc.rope = &rope;
      attn_kv_cache *cache = NULL;
      CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &kc));
      if (!cache) continue;
      tu_poison_f32(inc, n);
      const int64_t step = threads == 3 ? 2 : 1; /* token by token, and two at a time */
      for (int64_t t0 = 0; t0 < T; t0 += step) {
        const int64_t len = t0 + step <= T ? step : T - t0;
        const int64_t s3[3] = {c->B, len, c->E};
        attn_tensor x = attn_tensor_view(in.q + t0 * c->E, ATTN_F32, 3, s3);
        attn_tensor y = attn_tensor_view(inc + t0 * c->E, ATTN_F32, 3, s3);
        x.strides[0] = y.strides[0] = T * c->E;
        CHECK_OK(ctx, attn_mha_forward_cached(ctx, m, cache, &y, &x, NULL));
      }
      const int64_t s3[3] = {c->B, T, c->E};
      attn_tensor ti = attn_tensor_view(inc, ATTN_F32, 3, s3);
      double *got = tu_to_f64(&ti);
      const double e = rel_l2(got, want, n);
      CHECK(e <= 2e-5, "cached %s, %s, %d threads, %lld a step: rel L2 %.3g", desc, attn_kernel_name(kernels[ki]),
            threads, (long long)step, e);
      free(got);
      attn_kv_cache_destroy(cache);
    }
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  attn_ctx_set_threads(ctx, 0);
  free_params(P);
  free_inputs(&in);
  free(want), free(inc);
  attn_mha_destroy(m);
}

/* A random case; every QK-norm scope and kind, head_dim != E / H, GQA, out_bias 0, RoPE, cross-attention. */
static lcase random_case(tu_rng *r, int i) {
  lcase c;
  memset(&c, 0, sizeof c);
  c.Hk = tu_int(r, 1, 2);
  c.H = c.Hk * tu_int(r, 1, 2);
  c.D = 2 * tu_int(r, 1, 3);           /* even, for RoPE */
  /* usually != H * D; at least 2 input features: from one, a row of q or k
   * only scales, which the norm undoes, so its gradient is 0 and fp32's
   * rounding has nothing to be relative to */
  c.E = c.H * c.D + tu_int(r, -3, 3);
  if (c.E < 2) c.E = 2 + tu_int(r, 0, 2);
  c.qk_norm = i % 4;                   /* none, per head, whole, each head its own */
  c.kind = (attn_norm_kind)((i / 4) % 3);
  c.eps = i % 2 ? 1e-6 : 1e-2;
  c.bias = (int)tu_int(r, 0, 1);
  c.out_bias = (int)tu_int(r, -1, 1);
  c.cross = i % 4 == 3;
  c.kdim = c.cross ? tu_int(r, 2, 6) : c.E;
  c.vdim = c.cross ? tu_int(r, 1, 6) : c.E;
  c.rope = i % 5 != 4;
  c.B = tu_int(r, 1, 2);
  c.Nq = tu_int(r, 1, 4);
  c.Nk = c.cross ? tu_int(r, 1, 4) : c.Nq;
  c.causal = !c.cross && tu_int(r, 0, 1);
  /* clip_qkv on every third case, low enough that some of q, k and v meet it */
  tu_rng own = {500 + (uint64_t)i}; /* a draw of its own: the other cases' draws stay as they were */
  c.clip = i % 3 == 1 ? 0.25 + 0.5 * (tu_uniform(&own) + 1) : 0;
  return c;
}

static void compute_cases(attn_ctx *ctx, int cases) {
  tu_rng r = {77};
  for (int i = 0; i < cases; i++) {
    lcase c = random_case(&r, i);
    forward_case(ctx, &c, 900 + (uint64_t)i);
    backward_case(ctx, &c, 1900 + (uint64_t)i);
    if (!c.cross) {
      lcase cc = c;
      cc.causal = 1;
      cc.Nq = cc.Nk = tu_int(&r, 2, 7);
      cached_case(ctx, &cc, 2900 + (uint64_t)i);
    }
  }
  CHECK(ref_clipped > 0, "the clip_qkv cases clamped %lld values of q, k and v", (long long)ref_clipped);
}

/* A saved state, grads or a cache of another shape than the layer: clear statuses. */
static void mismatches(attn_ctx *ctx) {
  lcase c = {.E = 6, .H = 2, .Hk = 1, .D = 4, .kdim = 6, .vdim = 6, .bias = 1, .out_bias = 0,
             .qk_norm = ATTN_QK_NORM_PER_HEAD, .kind = ATTN_NORM_LAYER, .eps = 1e-6, .B = 1, .Nq = 3, .Nk = 3};
  tu_rng r = {5};
  attn_mha *m = case_layer(ctx, &c, &r);
  lcase other = c;
  other.qk_norm = ATTN_QK_NORM_WHOLE;
  attn_mha *g_scope = case_layer(ctx, &other, &r);
  other = c;
  other.D = 3;
  attn_mha *g_dim = case_layer(ctx, &other, &r);
  other = c;
  other.kind = ATTN_NORM_RMS;
  attn_mha *g_kind = case_layer(ctx, &other, &r);
  if (!m || !g_scope || !g_dim || !g_kind) return;
  inputs in;
  make_inputs(&in, &c, &r);
  float out[18], dq[18];
  const int64_t so[3] = {1, 3, 6};
  attn_tensor to = attn_tensor_view(out, ATTN_F32, 3, so), tdq = attn_tensor_view(dq, ATTN_F32, 3, so);
  attn_mha_saved *sv = NULL;
  CHECK_OK(ctx, attn_mha_forward_save(ctx, m, &to, NULL, &sv, &in.tq, NULL, NULL, NULL));
  CHECK_ERR(ctx, attn_mha_backward(ctx, m, &tdq, NULL, NULL, g_scope, sv, &to), ATTN_E_INVALID, "qk-norm whole");
  CHECK_ERR(ctx, attn_mha_backward(ctx, m, &tdq, NULL, NULL, g_dim, sv, &to), ATTN_E_INVALID, "head_dim 3");
  CHECK_ERR(ctx, attn_mha_backward(ctx, m, &tdq, NULL, NULL, g_kind, sv, &to), ATTN_E_INVALID, "rms");
  CHECK_ERR(ctx, attn_mha_backward(ctx, g_dim, &tdq, NULL, NULL, NULL, sv, &to), ATTN_E_INVALID, "saved");
  attn_mha_saved_free(sv);
  /* a cache of E / H = 3 features a head, not the layer's D = 4 */
  attn_kv_cache_config kc;
  attn_kv_cache_config_init(&kc, 1, 4, 1, 3);
  attn_kv_cache *cache = NULL;
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &kc));
  if (cache) CHECK_ERR(ctx, attn_mha_forward_cached(ctx, m, cache, &to, &in.tq, NULL), ATTN_E_SHAPE, "head dim 4");
  attn_kv_cache_destroy(cache);
  free_inputs(&in);
  attn_mha_destroy(m), attn_mha_destroy(g_scope), attn_mha_destroy(g_dim), attn_mha_destroy(g_kind);
}

/* Cross-attention over no keys: the output is the out bias alone, and every
 * gradient is zero, the norm parameters' included (none left poisoned). */
static void no_keys(attn_ctx *ctx) {
  lcase c = {.E = 5, .H = 2, .Hk = 1, .D = 4, .kdim = 3, .vdim = 2, .bias = 1, .out_bias = 1, .cross = 1,
             .qk_norm = ATTN_QK_NORM_WHOLE, .kind = ATTN_NORM_LAYER, .eps = 1e-6, .B = 2, .Nq = 3, .Nk = 0};
  tu_rng r = {8};
  attn_mha *m = case_layer(ctx, &c, &r), *g = case_layer(ctx, &c, &r);
  if (!m || !g) return;
  inputs in;
  make_inputs(&in, &c, &r);
  float out[30], dq[30];
  const int64_t so[3] = {2, 3, 5};
  attn_tensor to = attn_tensor_view(out, ATTN_F32, 3, so), tdq = attn_tensor_view(dq, ATTN_F32, 3, so);
  attn_mha_saved *sv = NULL;
  CHECK_OK(ctx, attn_mha_forward_save(ctx, m, &to, NULL, &sv, &in.tq, &in.tk, &in.tv, NULL));
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    attn_tensor t;
    if (!attn_mha_param_view(ctx, &t, g, (attn_mha_param)p)) tu_poison_f32(t.data, attn_tensor_numel(&t));
  }
  CHECK_OK(ctx, attn_mha_backward(ctx, m, &tdq, NULL, NULL, g, sv, &to));
  attn_mha_saved_free(sv);
  for (int p = ATTN_MHA_Q_NORM_WEIGHT; p <= ATTN_MHA_K_NORM_BIAS; p++) {
    attn_tensor t;
    CHECK_OK(ctx, attn_mha_param_view(ctx, &t, g, (attn_mha_param)p));
    int zero = 1;
    for (int64_t i = 0; i < attn_tensor_numel(&t); i++) zero &= ((float *)t.data)[i] == 0.0f;
    CHECK(zero, "no keys: norm parameter %d's gradient is 0", p);
  }
  int zero = 1;
  for (int i = 0; i < 30; i++) zero &= dq[i] == 0.0f;
  CHECK(zero, "no keys: dquery is 0");
  free_inputs(&in);
  attn_mha_destroy(m), attn_mha_destroy(g);
}

/* clip_qkv at its bounds: identity projections and one key, so out = clamp(x) and dx = dout where
 * -c <= x <= c (ends included, as torch.clamp) and 0 beyond (the q and k paths add only rounding:
 * one key's softmax is constant); every kernel, REF on doubles. */
static void clip_bounds(attn_ctx *ctx) {
  enum { E = 6 };
  const double c = 0.75, x[E] = {0.75, -0.75, 0.7499999, 0.7500001, -2.0, 3.0}, pass[E] = {1, 1, 1, 0, 0, 0};
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, E, 1);
  cfg.bias = 0;
  cfg.clip_qkv = c;
  attn_mha *m = make(ctx, &cfg), *g = make(ctx, &cfg);
  for (int p = 0; m && p < ATTN_MHA_NUM_PARAMS; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, m, (attn_mha_param)p)) continue;
    float *w = t.data;
    for (int64_t i = 0; i < attn_tensor_numel(&t); i++) w[i] = i % (E + 1) == 0 ? 1.0f : 0.0f; /* [E, E]: I */
  }
  const int64_t sh[3] = {1, 1, E};
  for (size_t ki = 0; m && g && ki < sizeof kernels / sizeof kernels[0]; ki++) {
    if (!attn_kernel_supported(kernels[ki])) continue;
    attn_ctx_set_kernel(ctx, kernels[ki]);
    const int ref = kernels[ki] == ATTN_KERNEL_REF;
    const attn_dtype dt = ref ? ATTN_F64 : ATTN_F32;
    double xd[E], outd[E], doutd[E], dxd[E];
    float xf[E], outf[E], doutf[E], dxf[E];
    for (int i = 0; i < E; i++) xf[i] = (float)(xd[i] = x[i]), doutf[i] = (float)(doutd[i] = i + 1);
    tu_poison_f32(outf, E), tu_poison_f32(dxf, E);
    memset(outd, 0xff, sizeof outd), memset(dxd, 0xff, sizeof dxd); /* NaN */
    attn_tensor tx = attn_tensor_view(ref ? (void *)xd : (void *)xf, dt, 3, sh);
    attn_tensor to = attn_tensor_view(ref ? (void *)outd : (void *)outf, dt, 3, sh);
    attn_tensor tg = attn_tensor_view(ref ? (void *)doutd : (void *)doutf, dt, 3, sh);
    attn_tensor td = attn_tensor_view(ref ? (void *)dxd : (void *)dxf, dt, 3, sh);
    attn_mha_saved *sv = NULL;
    CHECK_OK(ctx, attn_mha_forward_save(ctx, m, &to, NULL, &sv, &tx, NULL, NULL, NULL));
    CHECK_OK(ctx, attn_mha_backward(ctx, m, &td, NULL, NULL, g, sv, &tg));
    attn_mha_saved_free(sv);
    for (int i = 0; i < E; i++) {
      const double want = x[i] < -c ? -c : x[i] > c ? c : x[i], wdx = pass[i] ? (double)(i + 1) : 0.0;
      const double got = ref ? outd[i] : (double)outf[i], gdx = ref ? dxd[i] : (double)dxf[i];
      CHECK(got == (ref ? want : (double)(float)want), "clip_qkv %s: out[%d] = %.9g, want %.9g",
            attn_kernel_name(kernels[ki]), i, got, want);
      CHECK(fabs(gdx - wdx) <= 1e-5, "clip_qkv %s: dx[%d] = %.9g, want %.9g", attn_kernel_name(kernels[ki]), i, gdx, wdx);
    }
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  attn_mha_destroy(m), attn_mha_destroy(g);
}

int main(int argc, char **argv) {
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx)) return 1;
  for (size_t ki = 0; ki < sizeof kernels / sizeof kernels[0]; ki++)
    if (!attn_kernel_supported(kernels[ki])) printf("this CPU or build lacks the %s kernel: not run\n", attn_kernel_name(kernels[ki]));
  create_and_views(ctx);
  refused_configs(ctx);
  mismatches(ctx);
  no_keys(ctx);
  clip_bounds(ctx);
  compute_cases(ctx, argc > 1 ? atoi(argv[1]) : 48);
  attn_ctx_destroy(ctx);
  return tu_finish("test_mha_qknorm");
}
