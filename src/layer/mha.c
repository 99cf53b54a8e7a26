/* The multi-head attention layer: projections, head split, SDPA, merge, output projection.
 *
 * Heads are split and merged by strides, not copies: the projected Q of
 * [B, N, H*D] is viewed as [B, H, N, D], and SDPA writes straight into a
 * [B, N, H*D] buffer viewed the same way. */
#include "../internal.h"

#include <stdio.h>
#include <stdlib.h>

struct attn_mha {
  attn_mha_config cfg;
  int64_t head_dim, kv_dim; /* D = E / H; kv_dim = Hk * D */
  float *param[ATTN_MHA_NUM_PARAMS]; /* views into store */
  float *store;
  int64_t rows[ATTN_MHA_NUM_PARAMS], cols[ATTN_MHA_NUM_PARAMS]; /* cols 0: a vector */
};

static const char *param_label[ATTN_MHA_NUM_PARAMS] = {"q weight", "q bias", "k weight", "k bias",
                                                       "v weight", "v bias", "out weight", "out bias"};

void attn_mha_config_init(attn_mha_config *cfg, int64_t embed_dim, int64_t num_heads) {
  if (!cfg) return;
  memset(cfg, 0, sizeof *cfg);
  cfg->embed_dim = embed_dim;
  cfg->num_heads = num_heads;
  cfg->bias = 1;
}

void attn_mha_opts_init(attn_mha_opts *opts) {
  if (!opts) return;
  memset(opts, 0, sizeof *opts);
  opts->mask_mode = ATTN_MASK_MASKED;
}

attn_status attn_mha_create(attn_ctx *ctx, attn_mha **out, const attn_mha_config *cfg) {
  attn__clear(ctx);
  if (!out || !cfg) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_create: null argument");
  *out = NULL;
  attn_mha_config c = *cfg;
  if (c.num_kv_heads == 0) c.num_kv_heads = c.num_heads;
  if (c.kdim == 0) c.kdim = c.embed_dim;
  if (c.vdim == 0) c.vdim = c.embed_dim;
  if (c.embed_dim <= 0 || c.num_heads <= 0 || c.num_kv_heads < 0 || c.kdim < 0 || c.vdim < 0)
    return attn__fail(ctx, ATTN_E_INVALID, "embed_dim (%lld) and num_heads (%lld) must be positive", (long long)c.embed_dim,
                      (long long)c.num_heads);
  if (c.embed_dim % c.num_heads)
    return attn__fail(ctx, ATTN_E_INVALID, "embed_dim %lld is not divisible by num_heads %lld", (long long)c.embed_dim,
                      (long long)c.num_heads);
  if (c.num_heads % c.num_kv_heads)
    return attn__fail(ctx, ATTN_E_INVALID, "num_heads %lld is not a multiple of num_kv_heads %lld", (long long)c.num_heads,
                      (long long)c.num_kv_heads);
  if (c.embed_dim > ((int64_t)1 << 24) || c.kdim > ((int64_t)1 << 24) || c.vdim > ((int64_t)1 << 24))
    return attn__fail(ctx, ATTN_E_INVALID, "embed_dim, kdim and vdim must be at most 2^24");
  attn_mha *m = calloc(1, sizeof *m);
  if (!m) return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_create: out of memory");
  m->cfg = c;
  m->head_dim = c.embed_dim / c.num_heads;
  m->kv_dim = c.num_kv_heads * m->head_dim;
  const int64_t E = c.embed_dim;
  int64_t r[ATTN_MHA_NUM_PARAMS] = {E, E, m->kv_dim, m->kv_dim, m->kv_dim, m->kv_dim, E, E};
  int64_t k[ATTN_MHA_NUM_PARAMS] = {E, 0, c.kdim, 0, c.vdim, 0, E, 0};
  /* One allocation, the q, k, v weights (and biases) back to back: with kdim =
   * vdim = E they form PyTorch's packed [E + 2 Hk D, E] in_proj, and
   * self-attention projects with one GEMM. */
  static const int order[ATTN_MHA_NUM_PARAMS] = {ATTN_MHA_Q_WEIGHT, ATTN_MHA_K_WEIGHT, ATTN_MHA_V_WEIGHT,
                                                 ATTN_MHA_Q_BIAS,   ATTN_MHA_K_BIAS,   ATTN_MHA_V_BIAS,
                                                 ATTN_MHA_O_WEIGHT, ATTN_MHA_O_BIAS};
  int64_t total = 0;
  for (int i = 0; i < ATTN_MHA_NUM_PARAMS; i++) {
    m->rows[i] = r[i];
    m->cols[i] = k[i];
    if (k[i] || c.bias) total += r[i] * (k[i] ? k[i] : 1);
  }
  m->store = attn__aligned_alloc((size_t)total * sizeof(float));
  if (!m->store) {
    attn_mha_destroy(m);
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_create: cannot allocate parameters");
  }
  memset(m->store, 0, (size_t)total * sizeof(float));
  float *next = m->store;
  for (int o = 0; o < ATTN_MHA_NUM_PARAMS; o++) {
    const int i = order[o];
    if (!k[i] && !c.bias) continue;
    m->param[i] = next;
    next += r[i] * (k[i] ? k[i] : 1);
  }
  *out = m;
  return ATTN_OK;
}

void attn_mha_destroy(attn_mha *mha) {
  if (!mha) return;
  attn__aligned_free(mha->store);
  free(mha);
}

const attn_mha_config *attn_mha_get_config(const attn_mha *mha) { return mha ? &mha->cfg : NULL; }

static attn_tensor param_tensor(attn_mha *m, int which) {
  int64_t shape[2] = {m->rows[which], m->cols[which]};
  return attn_tensor_view(m->param[which], ATTN_F32, m->cols[which] ? 2 : 1, shape);
}

attn_status attn_mha_param_view(attn_ctx *ctx, attn_mha *mha, attn_mha_param which, attn_tensor *out) {
  attn__clear(ctx);
  if (!mha || !out) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_param_view: null argument");
  if ((int)which < 0 || which >= ATTN_MHA_NUM_PARAMS)
    return attn__fail(ctx, ATTN_E_INVALID, "unknown parameter %d", (int)which);
  if (!mha->param[which]) return attn__fail(ctx, ATTN_E_NOT_FOUND, "the layer has no %s (bias off)", param_label[which]);
  *out = param_tensor(mha, which);
  return ATTN_OK;
}

/* Copies rows [row0, row0 + rows) of a float tensor of rank 1 or 2 into parameter which. */
static attn_status copy_param(attn_ctx *ctx, attn_mha *m, int which, const attn_tensor *t, int64_t row0,
                              const char *name) {
  if (!m->param[which])
    return attn__fail(ctx, ATTN_E_INVALID, "%s: the layer was created without bias", name);
  const int64_t rows = m->rows[which], cols = m->cols[which];
  float *dst = m->param[which];
  for (int64_t r = 0; r < rows; r++) {
    if (cols) {
      for (int64_t c = 0; c < cols; c++)
        dst[r * cols + c] = (float)attn__load(t->data, t->dtype, (row0 + r) * t->strides[0] + c * t->strides[1]);
    } else {
      dst[r] = (float)attn__load(t->data, t->dtype, (row0 + r) * t->strides[0]);
    }
  }
  return ATTN_OK;
}

typedef struct name_map {
  const char *name;
  int which;
} name_map;

/* Every single-parameter name this layer answers to. */
static const name_map names[] = {
    {"wq.weight", ATTN_MHA_Q_WEIGHT},      {"wq.bias", ATTN_MHA_Q_BIAS},        {"wk.weight", ATTN_MHA_K_WEIGHT},
    {"wk.bias", ATTN_MHA_K_BIAS},          {"wv.weight", ATTN_MHA_V_WEIGHT},    {"wv.bias", ATTN_MHA_V_BIAS},
    {"dense.weight", ATTN_MHA_O_WEIGHT},   {"dense.bias", ATTN_MHA_O_BIAS},     {"q_proj_weight", ATTN_MHA_Q_WEIGHT},
    {"k_proj_weight", ATTN_MHA_K_WEIGHT},  {"v_proj_weight", ATTN_MHA_V_WEIGHT}, {"out_proj.weight", ATTN_MHA_O_WEIGHT},
    {"out_proj.bias", ATTN_MHA_O_BIAS},    {"q_proj.weight", ATTN_MHA_Q_WEIGHT}, {"q_proj.bias", ATTN_MHA_Q_BIAS},
    {"k_proj.weight", ATTN_MHA_K_WEIGHT},  {"k_proj.bias", ATTN_MHA_K_BIAS},    {"v_proj.weight", ATTN_MHA_V_WEIGHT},
    {"v_proj.bias", ATTN_MHA_V_BIAS},      {"o_proj.weight", ATTN_MHA_O_WEIGHT}, {"o_proj.bias", ATTN_MHA_O_BIAS},
};

attn_status attn_mha_set_param(attn_ctx *ctx, attn_mha *mha, const char *name, const attn_tensor *value) {
  attn__clear(ctx);
  if (!mha || !name || !value) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_set_param: null argument");
  attn_status st = attn__check_tensor(ctx, value, name, -1);
  if (st) return st;
  if (!attn__is_float(value->dtype))
    return attn__fail(ctx, ATTN_E_DTYPE, "%s has dtype %s; parameters must be f32, f64, f16 or bf16", name,
                      attn_dtype_name(value->dtype));
  const int64_t E = mha->cfg.embed_dim, kv = mha->kv_dim;
  if (!strcmp(name, "in_proj_weight") || !strcmp(name, "in_proj_bias")) {
    const int is_w = name[8] == 'w';
    if (is_w && (mha->cfg.kdim != E || mha->cfg.vdim != E))
      return attn__fail(ctx, ATTN_E_SHAPE, "in_proj_weight needs kdim = vdim = embed_dim; use q/k/v_proj_weight");
    const int want_rank = is_w ? 2 : 1;
    if (value->rank != want_rank || value->shape[0] != E + 2 * kv || (is_w && value->shape[1] != E))
      return attn__fail(ctx, ATTN_E_SHAPE, "%s must be [%lld%s] for embed_dim %lld and %lld kv heads", name,
                        (long long)(E + 2 * kv), is_w ? ", E" : "", (long long)E, (long long)mha->cfg.num_kv_heads);
    const int q = is_w ? ATTN_MHA_Q_WEIGHT : ATTN_MHA_Q_BIAS;
    if ((st = copy_param(ctx, mha, q, value, 0, name)) || (st = copy_param(ctx, mha, q + 2, value, E, name)) ||
        (st = copy_param(ctx, mha, q + 4, value, E + kv, name)))
      return st;
    return ATTN_OK;
  }
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    if (strcmp(name, names[i].name)) continue;
    const int w = names[i].which;
    const int64_t rows = mha->rows[w], cols = mha->cols[w];
    const int bad = cols ? (value->rank != 2 || value->shape[0] != rows || value->shape[1] != cols)
                         : (value->rank != 1 || value->shape[0] != rows);
    if (bad) {
      if (cols)
        return attn__fail(ctx, ATTN_E_SHAPE, "%s must be [%lld, %lld], got rank %d [%lld%s]", name, (long long)rows,
                          (long long)cols, value->rank, (long long)(value->rank ? value->shape[0] : 0),
                          value->rank > 1 ? ", ..." : "");
      return attn__fail(ctx, ATTN_E_SHAPE, "%s must be [%lld]", name, (long long)rows);
    }
    return copy_param(ctx, mha, w, value, 0, name);
  }
  return attn__fail(ctx, ATTN_E_NOT_FOUND, "unknown parameter name '%s'", name);
}

/* ---- safetensors: naming detection ------------------------------------------- */
typedef enum naming { NAMING_NONE, NAMING_SEED, NAMING_TORCH_PACKED, NAMING_TORCH_SEPARATE, NAMING_LLAMA } naming;

static const char *naming_names[][8] = {
    [NAMING_SEED] = {"wq.weight", "wq.bias", "wk.weight", "wk.bias", "wv.weight", "wv.bias", "dense.weight", "dense.bias"},
    [NAMING_TORCH_PACKED] = {"in_proj_weight", "in_proj_bias", NULL, NULL, NULL, NULL, "out_proj.weight", "out_proj.bias"},
    [NAMING_TORCH_SEPARATE] = {"q_proj_weight", "in_proj_bias", "k_proj_weight", NULL, "v_proj_weight", NULL,
                               "out_proj.weight", "out_proj.bias"},
    [NAMING_LLAMA] = {"q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
                      "o_proj.weight", "o_proj.bias"},
};

static attn_status st_find(attn_ctx *ctx, const attn_safetensors *st, const char *prefix, const char *name,
                           attn_tensor *t) {
  char full[512];
  if (snprintf(full, sizeof full, "%s%s", prefix, name) >= (int)sizeof full)
    return attn__fail(ctx, ATTN_E_INVALID, "parameter prefix is too long");
  return attn_safetensors_get(ctx, st, full, t);
}

static int st_has(const attn_safetensors *st, const char *prefix, const char *name) {
  attn_tensor t;
  return st_find(NULL, st, prefix, name, &t) == ATTN_OK;
}

static naming detect_naming(const attn_safetensors *st, const char *prefix) {
  if (st_has(st, prefix, "in_proj_weight")) return NAMING_TORCH_PACKED;
  if (st_has(st, prefix, "q_proj_weight")) return NAMING_TORCH_SEPARATE;
  if (st_has(st, prefix, "wq.weight")) return NAMING_SEED;
  if (st_has(st, prefix, "q_proj.weight")) return NAMING_LLAMA;
  return NAMING_NONE;
}

static attn_status load_params(attn_ctx *ctx, attn_mha *mha, const attn_safetensors *st, const char *prefix,
                               naming nm, const char *path) {
  for (int i = 0; i < ATTN_MHA_NUM_PARAMS; i++) {
    const char *name = naming_names[nm][i];
    if (!name) continue;
    const int is_bias = i % 2 == 1;
    attn_tensor t;
    attn_status s = st_find(ctx, st, prefix, name, &t);
    if (s == ATTN_E_NOT_FOUND) {
      if (is_bias && !mha->cfg.bias) continue;
      return attn__fail(ctx, ATTN_E_NOT_FOUND, "%s: missing tensor '%s%s'", path, prefix, name);
    }
    if (s) return s;
    if (is_bias && !mha->cfg.bias)
      return attn__fail(ctx, ATTN_E_INVALID, "%s: has '%s%s' but the layer was created with bias off", path, prefix,
                        name);
    if ((s = attn_mha_set_param(ctx, mha, name, &t))) {
      char msg[ATTN__MSG_LEN];
      snprintf(msg, sizeof msg, "%s", attn_ctx_error(ctx));
      return attn__fail(ctx, s, "%s: %s", path, msg);
    }
  }
  return ATTN_OK;
}

attn_status attn_mha_load_safetensors(attn_ctx *ctx, attn_mha *mha, const char *path, const char *prefix) {
  attn__clear(ctx);
  if (!mha || !path) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_load_safetensors: null argument");
  if (!prefix) prefix = "";
  attn_safetensors *st;
  attn_status s = attn_safetensors_open(ctx, &st, path);
  if (s) return s;
  naming nm = detect_naming(st, prefix);
  if (nm == NAMING_NONE)
    s = attn__fail(ctx, ATTN_E_NOT_FOUND,
                   "%s: no attention parameters under prefix '%s' (looked for in_proj_weight, q_proj_weight, "
                   "wq.weight, q_proj.weight)",
                   path, prefix);
  else
    s = load_params(ctx, mha, st, prefix, nm, path);
  attn_safetensors_close(st);
  return s;
}

attn_status attn_mha_create_from_safetensors(attn_ctx *ctx, attn_mha **out, const char *path, const char *prefix,
                                             int64_t num_heads, int64_t num_kv_heads) {
  attn__clear(ctx);
  if (!out || !path) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_create_from_safetensors: null argument");
  *out = NULL;
  if (!prefix) prefix = "";
  attn_safetensors *st;
  attn_status s = attn_safetensors_open(ctx, &st, path);
  if (s) return s;
  naming nm = detect_naming(st, prefix);
  attn_tensor ow, kw, vw;
  attn_mha_config cfg;
  attn_mha *m = NULL;
  if (nm == NAMING_NONE) {
    s = attn__fail(ctx, ATTN_E_NOT_FOUND,
                   "%s: no attention parameters under prefix '%s' (looked for in_proj_weight, q_proj_weight, "
                   "wq.weight, q_proj.weight)",
                   path, prefix);
    goto done;
  }
  if ((s = st_find(ctx, st, prefix, naming_names[nm][ATTN_MHA_O_WEIGHT], &ow))) goto done;
  if (ow.rank != 2 || ow.shape[0] != ow.shape[1] || ow.shape[0] <= 0) {
    s = attn__fail(ctx, ATTN_E_SHAPE, "%s: %s%s must be a square [E, E] matrix", path, prefix,
                   naming_names[nm][ATTN_MHA_O_WEIGHT]);
    goto done;
  }
  attn_mha_config_init(&cfg, ow.shape[0], num_heads);
  cfg.num_kv_heads = num_kv_heads;
  if (nm != NAMING_TORCH_PACKED) {
    if ((s = st_find(ctx, st, prefix, naming_names[nm][ATTN_MHA_K_WEIGHT], &kw)) ||
        (s = st_find(ctx, st, prefix, naming_names[nm][ATTN_MHA_V_WEIGHT], &vw)))
      goto done;
    if (kw.rank != 2 || vw.rank != 2) {
      s = attn__fail(ctx, ATTN_E_SHAPE, "%s: key and value projection weights must be matrices", path);
      goto done;
    }
    cfg.kdim = kw.shape[1];
    cfg.vdim = vw.shape[1];
  }
  cfg.bias = st_has(st, prefix, naming_names[nm][ATTN_MHA_O_BIAS]);
  if ((s = attn_mha_create(ctx, &m, &cfg))) goto done;
  if ((s = load_params(ctx, m, st, prefix, nm, path))) {
    attn_mha_destroy(m);
    m = NULL;
  }
done:
  attn_safetensors_close(st);
  *out = m;
  return s;
}

/* ---- forward ---------------------------------------------------------------- */
static attn_status check_input(attn_ctx *ctx, const attn_tensor *t, const char *what, int64_t B, int64_t feat,
                               int f64_ok) {
  attn_status st = attn__check_tensor(ctx, t, what, 3);
  if (st) return st;
  if (t->dtype != ATTN_F32 && !(f64_ok && t->dtype == ATTN_F64))
    return attn__fail(ctx, ATTN_E_DTYPE, "%s must be f32, got %s", what, attn_dtype_name(t->dtype));
  if ((B >= 0 && t->shape[0] != B) || t->shape[2] != feat)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s is [%lld, %lld, %lld]; want [B, N, %lld]%s", what, (long long)t->shape[0],
                      (long long)t->shape[1], (long long)t->shape[2], (long long)feat,
                      B >= 0 ? " with the query's batch" : "");
  return ATTN_OK;
}

/* Gathers a [B, N, F] f32 view into contiguous rows unless it already is. */
static const float *rows_of(const attn_tensor *t, float **owned) {
  const int64_t B = t->shape[0], N = t->shape[1], F = t->shape[2];
  *owned = NULL;
  if (t->strides[2] == 1 && t->strides[1] == F && (t->strides[0] == N * F || B == 1)) return t->data;
  float *c = attn__aligned_alloc((size_t)(B * N * F) * sizeof(float));
  if (!c) return NULL;
  const float *s = t->data;
  for (int64_t b = 0; b < B; b++)
    for (int64_t n = 0; n < N; n++)
      for (int64_t f = 0; f < F; f++) c[(b * N + n) * F + f] = s[b * t->strides[0] + n * t->strides[1] + f * t->strides[2]];
  *owned = c;
  return c;
}

/* [B, N, ld] rows (the first H*D columns) viewed as [B, H, N, D]. */
static attn_tensor heads_view_ld(void *data, attn_dtype dt, int64_t B, int64_t N, int64_t H, int64_t D, int64_t ld) {
  attn_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dt;
  t.rank = 4;
  t.shape[0] = B; t.shape[1] = H; t.shape[2] = N; t.shape[3] = D;
  t.strides[0] = N * ld; t.strides[1] = D; t.strides[2] = ld; t.strides[3] = 1;
  return t;
}

static attn_tensor heads_view(void *data, attn_dtype dt, int64_t B, int64_t N, int64_t H, int64_t D) {
  return heads_view_ld(data, dt, B, N, H, D, H * D);
}

/* y is (M, N) contiguous doubles = x (M, K) . W^T + b, all read as given. */
static void linear_ref(int threads, double *y, const attn_tensor *x, int64_t M, const float *W, const float *b,
                       int64_t N, int64_t K) {
  const int64_t Nx = x->shape[1];
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < M; r++) {
    const int64_t bb = r / Nx, n = r % Nx;
    for (int64_t o = 0; o < N; o++) {
      double acc = b ? b[o] : 0.0;
      for (int64_t kk = 0; kk < K; kk++)
        acc += attn__load(x->data, x->dtype, bb * x->strides[0] + n * x->strides[1] + kk * x->strides[2]) *
               (double)W[o * K + kk];
      y[r * N + o] = acc;
    }
  }
}

/* Averages per-head weights [B, H, Nq, Nk] into out [B, Nq, Nk] (f32 or f64). */
static void average_heads(attn_tensor *out, const attn_tensor *w) {
  const int64_t B = w->shape[0], H = w->shape[1], Nq = w->shape[2], Nk = w->shape[3];
  for (int64_t b = 0; b < B; b++)
    for (int64_t i = 0; i < Nq; i++)
      for (int64_t j = 0; j < Nk; j++) {
        double s = 0;
        for (int64_t h = 0; h < H; h++)
          s += attn__load(w->data, w->dtype, b * w->strides[0] + h * w->strides[1] + i * w->strides[2] + j * w->strides[3]);
        attn__store(out->data, out->dtype, b * out->strides[0] + i * out->strides[1] + j * out->strides[2], s / (double)H);
      }
}

attn_status attn_mha_forward(attn_ctx *ctx, attn_mha *mha, attn_tensor *out, const attn_tensor *query,
                             const attn_tensor *key, const attn_tensor *value, const attn_mha_opts *opts) {
  attn__clear(ctx);
  if (!mha) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_forward: layer is NULL");
  const attn_kernel kern = attn_ctx_kernel(ctx);
  const int ref = kern == ATTN_KERNEL_REF;
  const attn_mha_config *c = &mha->cfg;
  const int64_t E = c->embed_dim, H = c->num_heads, Hk = c->num_kv_heads, D = mha->head_dim;
  attn_status st;
  if ((st = check_input(ctx, query, "query", -1, E, ref))) return st;
  const int64_t B = query->shape[0], Nq = query->shape[1];
  if (!key != !value) return attn__fail(ctx, ATTN_E_INVALID, "give both key and value, or neither (self-attention)");
  if (!key) {
    if (c->kdim != E || c->vdim != E)
      return attn__fail(ctx, ATTN_E_INVALID, "self-attention needs kdim = vdim = embed_dim; pass key and value");
    key = value = query;
  }
  if ((st = check_input(ctx, key, "key", B, c->kdim, ref)) || (st = check_input(ctx, value, "value", B, c->vdim, ref)))
    return st;
  const int64_t Nk = key->shape[1];
  if (value->shape[1] != Nk)
    return attn__fail(ctx, ATTN_E_SHAPE, "key has %lld positions but value has %lld", (long long)Nk,
                      (long long)value->shape[1]);
  if ((st = attn__check_tensor(ctx, out, "out", 3))) return st;
  if (out->dtype != ATTN_F32 && !(ref && out->dtype == ATTN_F64))
    return attn__fail(ctx, ATTN_E_DTYPE, "out must be f32, got %s", attn_dtype_name(out->dtype));
  if (out->shape[0] != B || out->shape[1] != Nq || out->shape[2] != E)
    return attn__fail(ctx, ATTN_E_SHAPE, "out must be [B, Nq, E] = [%lld, %lld, %lld]", (long long)B, (long long)Nq,
                      (long long)E);
  attn_mha_opts defaults;
  if (!opts) {
    attn_mha_opts_init(&defaults);
    opts = &defaults;
  }
  if (opts->weights) {
    const attn_tensor *w = opts->weights;
    const int want = opts->average_weights ? 3 : 4;
    if ((st = attn__check_tensor(ctx, w, "weights", want))) return st;
    const int ok = opts->average_weights
                       ? (w->shape[0] == B && w->shape[1] == Nq && w->shape[2] == Nk)
                       : (w->shape[0] == B && w->shape[1] == H && w->shape[2] == Nq && w->shape[3] == Nk);
    if (!ok)
      return attn__fail(ctx, ATTN_E_SHAPE, "weights must be %s = [%lld, %lld%s, %lld]",
                        opts->average_weights ? "[B, Nq, Nk]" : "[B, H, Nq, Nk]", (long long)B,
                        (long long)(opts->average_weights ? Nq : H), opts->average_weights ? "" : ", Nq", (long long)Nk);
    if (w->dtype != ATTN_F32 && !(ref && w->dtype == ATTN_F64))
      return attn__fail(ctx, ATTN_E_DTYPE, "weights must be f32, got %s", attn_dtype_name(w->dtype));
  }
  if (B == 0 || Nq == 0) return ATTN_OK;

  const attn_dtype dt = ref ? ATTN_F64 : ATTN_F32;
  const size_t es = ref ? sizeof(double) : sizeof(float);
  const int64_t kv = mha->kv_dim;
  /* Self-attention in fp32: q, k, v in one GEMM against the packed weights. */
  const int fused = !ref && key == query && value == query && c->kdim == E && c->vdim == E;
  void *Q = attn__aligned_alloc((size_t)(B * Nq * (fused ? E + 2 * kv : E)) * es), *A = attn__aligned_alloc((size_t)(B * Nq * E) * es);
  void *K = fused ? Q : attn__aligned_alloc((size_t)(B * Nk * kv) * es);
  void *V = fused ? Q : attn__aligned_alloc((size_t)(B * Nk * kv) * es);
  attn_tensor wbuf = {0};
  int have_wbuf = 0;
  float *own_q = NULL, *own_k = NULL, *own_v = NULL;
  st = ATTN_OK;
  if (!Q || !K || !V || !A) {
    st = attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward: cannot allocate activations");
    goto done;
  }
  const float *const *P = (const float *const *)mha->param;
  if (fused) {
    const float *xq = rows_of(query, &own_q);
    if (!xq) {
      st = attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward: cannot allocate a copy of the inputs");
      goto done;
    }
    attn__sgemm_nt(attn__threads(ctx), kern, B * Nq, E + 2 * kv, E, xq, E, P[ATTN_MHA_Q_WEIGHT], E, Q, E + 2 * kv,
                   P[ATTN_MHA_Q_BIAS]);
  } else if (ref) {
    linear_ref(attn__threads(ctx), Q, query, B * Nq, P[ATTN_MHA_Q_WEIGHT], P[ATTN_MHA_Q_BIAS], E, E);
    linear_ref(attn__threads(ctx), K, key, B * Nk, P[ATTN_MHA_K_WEIGHT], P[ATTN_MHA_K_BIAS], kv, c->kdim);
    linear_ref(attn__threads(ctx), V, value, B * Nk, P[ATTN_MHA_V_WEIGHT], P[ATTN_MHA_V_BIAS], kv, c->vdim);
  } else {
    const int th = attn__threads(ctx);
    const float *xq = rows_of(query, &own_q);
    const float *xk = key == query ? xq : rows_of(key, &own_k);
    const float *xv = value == query ? xq : (value == key ? xk : rows_of(value, &own_v));
    if (!xq || !xk || !xv) {
      st = attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward: cannot allocate a copy of the inputs");
      goto done;
    }
    attn__sgemm_nt(th, kern, B * Nq, E, E, xq, E, P[ATTN_MHA_Q_WEIGHT], E, Q, E, P[ATTN_MHA_Q_BIAS]);
    attn__sgemm_nt(th, kern, B * Nk, kv, c->kdim, xk, c->kdim, P[ATTN_MHA_K_WEIGHT], c->kdim, K, kv, P[ATTN_MHA_K_BIAS]);
    attn__sgemm_nt(th, kern, B * Nk, kv, c->vdim, xv, c->vdim, P[ATTN_MHA_V_WEIGHT], c->vdim, V, kv, P[ATTN_MHA_V_BIAS]);
  }

  attn_tensor qh = heads_view(Q, dt, B, Nq, H, D), kh = heads_view(K, dt, B, Nk, Hk, D);
  attn_tensor vh = heads_view(V, dt, B, Nk, Hk, D), ah = heads_view(A, dt, B, Nq, H, D);
  if (fused) {
    qh = heads_view_ld(Q, dt, B, Nq, H, D, E + 2 * kv);
    kh = heads_view_ld((float *)Q + E, dt, B, Nk, Hk, D, E + 2 * kv);
    vh = heads_view_ld((float *)Q + E + kv, dt, B, Nk, Hk, D, E + 2 * kv);
  }
  attn_sdpa_opts so;
  attn_sdpa_opts_init(&so);
  so.causal = opts->causal;
  so.mask = opts->mask;
  so.mask_mode = opts->mask_mode;
  so.key_padding = opts->key_padding;
  if (opts->weights && opts->average_weights) {
    int64_t ws[4] = {B, H, Nq, Nk};
    if ((st = attn_tensor_alloc(ctx, &wbuf, dt, 4, ws))) goto done;
    have_wbuf = 1;
    so.weights = &wbuf;
  } else {
    so.weights = opts->weights;
  }
  st = ref ? attn_sdpa_ref(ctx, &ah, &qh, &kh, &vh, &so) : attn_sdpa(ctx, &ah, &qh, &kh, &vh, &so);
  if (st) goto done;
  if (have_wbuf) average_heads(opts->weights, &wbuf);

  const float *Wo = P[ATTN_MHA_O_WEIGHT], *bo = P[ATTN_MHA_O_BIAS];
  if (ref) {
    attn_tensor a3 = {0};
    a3.data = A; a3.dtype = ATTN_F64; a3.rank = 3;
    a3.shape[0] = B; a3.shape[1] = Nq; a3.shape[2] = E;
    a3.strides[0] = Nq * E; a3.strides[1] = E; a3.strides[2] = 1;
    double *y = Q; /* Q is no longer needed */
    linear_ref(attn__threads(ctx), y, &a3, B * Nq, Wo, bo, E, E);
    for (int64_t b = 0; b < B; b++)
      for (int64_t n = 0; n < Nq; n++)
        for (int64_t e = 0; e < E; e++)
          attn__store(out->data, out->dtype, b * out->strides[0] + n * out->strides[1] + e * out->strides[2],
                      y[(b * Nq + n) * E + e]);
  } else {
    const int contiguous = out->strides[2] == 1 && out->strides[1] == E && (out->strides[0] == Nq * E || B == 1);
    float *y = contiguous ? out->data : Q;
    attn__sgemm_nt(attn__threads(ctx), kern, B * Nq, E, E, A, E, Wo, E, y, E, bo);
    if (!contiguous)
      for (int64_t b = 0; b < B; b++)
        for (int64_t n = 0; n < Nq; n++)
          for (int64_t e = 0; e < E; e++)
            ((float *)out->data)[b * out->strides[0] + n * out->strides[1] + e * out->strides[2]] = y[(b * Nq + n) * E + e];
  }
done:
  if (have_wbuf) attn_tensor_free(&wbuf);
  attn__aligned_free(own_q);
  attn__aligned_free(own_k);
  attn__aligned_free(own_v);
  if (K != Q) attn__aligned_free(K);
  if (V != Q) attn__aligned_free(V);
  attn__aligned_free(Q);
  attn__aligned_free(A);
  return st;
}
