/* The layer's parameters by name: attn_mha_set_param, and the safetensors
 * loaders, which detect a checkpoint family's naming (or take a caller's) and
 * read each tensor as saved. */
#include "mha_internal.h"
#include "../io/io.h"

#include <stdio.h>
#include <stdlib.h>
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
  ATTN__ENTER(ctx);
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

/* ---- safetensors -------------------------------------------------------------- */
/* The tensor each naming keeps each parameter in. PyTorch packs the q, k and v
 * rows into in_proj_weight and in_proj_bias, so those names repeat. */
static const char *const naming_names[][ATTN_MHA_NUM_PARAMS] = {
    [ATTN_MHA_NAMING_SEED] = {"wq.weight", "wq.bias", "wk.weight", "wk.bias", "wv.weight", "wv.bias", "dense.weight",
                              "dense.bias"},
    [ATTN_MHA_NAMING_TORCH_PACKED] = {"in_proj_weight", "in_proj_bias", "in_proj_weight", "in_proj_bias",
                                      "in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"},
    [ATTN_MHA_NAMING_TORCH_SEPARATE] = {"q_proj_weight", "in_proj_bias", "k_proj_weight", "in_proj_bias",
                                        "v_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"},
    [ATTN_MHA_NAMING_LLAMA] = {"q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight",
                               "v_proj.bias", "o_proj.weight", "o_proj.bias"},
};

const char *attn_mha_param_name(attn_mha_naming naming, attn_mha_param which) {
  if ((int)naming <= ATTN_MHA_NAMING_NONE || naming > ATTN_MHA_NAMING_LLAMA || (int)which < 0 ||
      which >= ATTN_MHA_NUM_PARAMS)
    return NULL;
  return naming_names[naming][which];
}

/* prefix + name into full (cap bytes); 0 when it does not fit. */
static int full_name(char *full, size_t cap, const char *prefix, const char *name) {
  return snprintf(full, cap, "%s%s", prefix, name) < (int)cap;
}

/* What the file says of prefix + name, reading no data; 0 if absent. */
static int st_info(const attn_safetensors *st, const char *prefix, const char *name, attn__st_info *info) {
  char full[512];
  return full_name(full, sizeof full, prefix, name) && attn__safetensors_info(st, full, info);
}

/* The first naming whose tell-tale tensor the file holds, or NONE. */
static attn_mha_naming detect(const attn_safetensors *st, const char *prefix) {
  static const struct {
    const char *name;
    attn_mha_naming naming;
  } probe[] = {{"in_proj_weight", ATTN_MHA_NAMING_TORCH_PACKED},
               {"q_proj_weight", ATTN_MHA_NAMING_TORCH_SEPARATE},
               {"wq.weight", ATTN_MHA_NAMING_SEED},
               {"q_proj.weight", ATTN_MHA_NAMING_LLAMA}};
  attn__st_info info;
  for (size_t i = 0; i < sizeof probe / sizeof probe[0]; i++)
    if (st_info(st, prefix, probe[i].name, &info)) return probe[i].naming;
  return ATTN_MHA_NAMING_NONE;
}

/* Checks the arguments every safetensors call shares and finds the naming. */
static attn_status st_naming(attn_ctx *ctx, const attn_safetensors *st, const char **prefix, attn_mha_naming *nm,
                             const char *fn) {
  if (!st) return attn__fail(ctx, ATTN_E_INVALID, "%s: the safetensors handle is NULL", fn);
  if (!*prefix) *prefix = "";
  char full[512];
  if (!full_name(full, sizeof full, *prefix, "out_proj.weight"))
    return attn__fail(ctx, ATTN_E_INVALID, "%s: parameter prefix is too long (%zu bytes)", fn, strlen(*prefix));
  *nm = detect(st, *prefix);
  if (*nm == ATTN_MHA_NAMING_NONE)
    return attn__fail(ctx, ATTN_E_NOT_FOUND,
                      "%s: no attention parameters under prefix '%s' (looked for in_proj_weight, q_proj_weight, "
                      "wq.weight, q_proj.weight)",
                      attn__safetensors_path(st), *prefix);
  return ATTN_OK;
}

attn_status attn_mha_detect_naming(attn_ctx *ctx, attn_mha_naming *naming, const attn_safetensors *st,
                                   const char *prefix) {
  ATTN__ENTER(ctx);
  if (!naming) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_detect_naming: naming is NULL");
  *naming = ATTN_MHA_NAMING_NONE;
  return st_naming(ctx, st, &prefix, naming, "attn_mha_detect_naming");
}

/* The sizes of the layer a file's parameters must fit. */
typedef struct st_dims {
  int64_t E, kv, kdim, vdim; /* kv = Hk * D rows in the k and v projections */
  int bias;
} st_dims;

static void fmt_dims(char *buf, size_t n, const st_dims *d) {
  snprintf(buf, n, "embed_dim %lld, %lld k/v rows (kv heads x head dim), kdim %lld, vdim %lld", (long long)d->E,
           (long long)d->kv, (long long)d->kdim, (long long)d->vdim);
}

/* One of the file's tensors against the shape the layer needs: present (unless
 * optional; *present says), a float dtype, exactly [rows, cols] ([rows] if cols is 0). */
static attn_status want_shape(attn_ctx *ctx, const attn_safetensors *st, const char *prefix, const char *name,
                              const st_dims *d, int64_t rows, int64_t cols, int optional, int *present) {
  attn__st_info in;
  const char *path = attn__safetensors_path(st);
  *present = st_info(st, prefix, name, &in);
  if (!*present)
    return optional ? ATTN_OK : attn__fail(ctx, ATTN_E_NOT_FOUND, "%s: missing tensor '%s%s'", path, prefix, name);
  if (!in.known || !attn__is_float(in.dtype))
    return attn__fail(ctx, ATTN_E_DTYPE, "%s: %s%s has dtype %s; parameters must be F32, F64, F16 or BF16", path,
                      prefix, name, in.dtype_name);
  if (in.rank == (cols ? 2 : 1) && in.shape[0] == rows && (!cols || in.shape[1] == cols)) return ATTN_OK;
  char want[48], got[96] = "", dims[160];
  if (cols) snprintf(want, sizeof want, "[%lld, %lld]", (long long)rows, (long long)cols);
  else snprintf(want, sizeof want, "[%lld]", (long long)rows);
  size_t n = 0;
  for (int i = 0; i < in.rank && i < ATTN_MAX_RANK && n < sizeof got; i++)
    n += (size_t)snprintf(got + n, sizeof got - n, i ? ", %lld" : "%lld", (long long)in.shape[i]);
  fmt_dims(dims, sizeof dims, d);
  return attn__fail(ctx, ATTN_E_SHAPE, "%s: %s%s is [%s]%s; a layer of %s needs %s", path, prefix, name, got,
                    in.rank > ATTN_MAX_RANK ? "..." : "", dims, want);
}

/* Every tensor a load reads, checked before anything is allocated or written:
 * each parameter's element count then equals its tensor's in the file, so
 * what a layer holds is bounded by the bytes the file really has. */
static attn_status check_params(attn_ctx *ctx, const attn_safetensors *st, const char *prefix, attn_mha_naming nm,
                                const st_dims *d) {
  const int64_t rows[ATTN_MHA_NUM_PARAMS] = {d->E, d->E, d->kv, d->kv, d->kv, d->kv, d->E, d->E};
  const int64_t cols[ATTN_MHA_NUM_PARAMS] = {d->E, 0, d->kdim, 0, d->vdim, 0, d->E, 0};
  attn_status s;
  int present;
  for (int p = 0; p < ATTN__MHA_PROJ_PARAMS; p++) {
    const char *name = naming_names[nm][p];
    const int is_bias = p % 2 == 1;
    int64_t r = rows[p], c = cols[p];
    if (!strcmp(name, "in_proj_weight") || !strcmp(name, "in_proj_bias")) {
      if (p != ATTN_MHA_Q_WEIGHT && p != ATTN_MHA_Q_BIAS) continue; /* the q, k and v rows in one tensor */
      r = d->E + 2 * d->kv;
    }
    if ((s = want_shape(ctx, st, prefix, name, d, r, c, is_bias && !d->bias, &present))) return s;
    if (is_bias && !d->bias && present)
      return attn__fail(ctx, ATTN_E_INVALID, "%s: has '%s%s' but the layer was created with bias off",
                        attn__safetensors_path(st), prefix, name);
  }
  return ATTN_OK;
}

/* Copies the checked tensors in, one at a time (each read, converted, freed). */
static attn_status load_params(attn_ctx *ctx, attn_mha *mha, const attn_safetensors *st, const char *prefix,
                               attn_mha_naming nm) {
  for (int p = 0; p < ATTN__MHA_PROJ_PARAMS; p++) {
    const char *name = naming_names[nm][p];
    if (p % 2 == 1 && !mha->cfg.bias) continue;
    int seen = 0; /* a packed tensor, already loaded whole */
    for (int q = 0; q < p; q++) seen |= !strcmp(naming_names[nm][q], name);
    if (seen) continue;
    char full[512];
    if (!full_name(full, sizeof full, prefix, name))
      return attn__fail(ctx, ATTN_E_INVALID, "parameter prefix is too long");
    attn_tensor t;
    void *own = NULL;
    attn_status s = attn__safetensors_read(ctx, st, full, &t, &own);
    if (!s && (s = attn_mha_set_param(ctx, mha, name, &t))) {
      char msg[ATTN__MSG_LEN];
      snprintf(msg, sizeof msg, "%s", attn_ctx_error(ctx));
      s = attn__fail(ctx, s, "%s: %s", attn__safetensors_path(st), msg);
    }
    attn__aligned_free(own);
    if (s) return s;
  }
  return ATTN_OK;
}

attn_status attn_mha_load_safetensors_handle(attn_ctx *ctx, attn_mha *mha, const attn_safetensors *st,
                                             const char *prefix) {
  ATTN__ENTER(ctx);
  if (!mha) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_load_safetensors_handle: layer is NULL");
  attn_mha_naming nm;
  attn_status s = st_naming(ctx, st, &prefix, &nm, "attn_mha_load_safetensors_handle");
  if (s) return s;
  const attn_mha_config *c = &mha->cfg;
  const st_dims d = {c->embed_dim, mha->kv_dim, c->kdim, c->vdim, c->bias};
  if ((nm == ATTN_MHA_NAMING_TORCH_PACKED) && (c->kdim != c->embed_dim || c->vdim != c->embed_dim))
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: %sin_proj_weight needs kdim = vdim = embed_dim; this layer has %lld, %lld, %lld",
                      attn__safetensors_path(st), prefix, (long long)c->kdim, (long long)c->vdim, (long long)c->embed_dim);
  if ((s = check_params(ctx, st, prefix, nm, &d))) return s;
  return load_params(ctx, mha, st, prefix, nm);
}

attn_status attn_mha_load_safetensors(attn_ctx *ctx, attn_mha *mha, const char *path, const char *prefix) {
  ATTN__ENTER(ctx);
  if (!mha || !path) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_load_safetensors: null argument");
  attn_safetensors *st;
  attn_status s = attn_safetensors_open(ctx, &st, path);
  if (s) return s;
  s = attn_mha_load_safetensors_handle(ctx, mha, st, prefix);
  attn_safetensors_close(st);
  return s;
}

/* The columns of a k or v projection weight: the layer's kdim or vdim. */
static attn_status weight_cols(attn_ctx *ctx, const attn_safetensors *st, const char *prefix, const char *name,
                               const char *what, int64_t *cols) {
  attn__st_info in;
  if (!st_info(st, prefix, name, &in))
    return attn__fail(ctx, ATTN_E_NOT_FOUND, "%s: missing tensor '%s%s'", attn__safetensors_path(st), prefix, name);
  if (in.rank != 2)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: %s%s has rank %d; a projection weight is a matrix",
                      attn__safetensors_path(st), prefix, name, in.rank);
  /* 0 would mean "= embed_dim" in a config */
  if (in.shape[1] < 1)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: %s%s has no columns (%s 0)", attn__safetensors_path(st), prefix, name,
                      what);
  *cols = in.shape[1];
  return ATTN_OK;
}

attn_status attn_mha_create_from_safetensors_handle(attn_ctx *ctx, attn_mha **out, const attn_safetensors *st,
                                                    const char *prefix, int64_t num_heads, int64_t num_kv_heads) {
  ATTN__ENTER(ctx);
  const char *fn = "attn_mha_create_from_safetensors_handle";
  if (!out) return attn__fail(ctx, ATTN_E_INVALID, "%s: out is NULL", fn);
  *out = NULL;
  attn_mha_naming nm;
  attn_status s = st_naming(ctx, st, &prefix, &nm, fn);
  if (s) return s;
  const char *path = attn__safetensors_path(st);
  attn__st_info ow;
  const char *oname = naming_names[nm][ATTN_MHA_O_WEIGHT];
  if (!st_info(st, prefix, oname, &ow))
    return attn__fail(ctx, ATTN_E_NOT_FOUND, "%s: missing tensor '%s%s'", path, prefix, oname);
  if (ow.rank != 2 || ow.shape[0] != ow.shape[1] || ow.shape[0] <= 0)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: %s%s must be a square [E, E] matrix with E >= 1", path, prefix, oname);
  const int64_t E = ow.shape[0], H = num_heads, Hk = num_kv_heads ? num_kv_heads : num_heads;
  /* the head arithmetic first: the k and v shapes below depend on it */
  if (H <= 0 || Hk <= 0)
    return attn__fail(ctx, ATTN_E_INVALID, "num_heads (%lld) and num_kv_heads (%lld) must be positive", (long long)H,
                      (long long)num_kv_heads);
  if (E % H)
    return attn__fail(ctx, ATTN_E_INVALID, "%s: embed_dim %lld (from %s%s) is not divisible by num_heads %lld", path,
                      (long long)E, prefix, oname, (long long)H);
  if (H % Hk)
    return attn__fail(ctx, ATTN_E_INVALID, "num_heads %lld is not a multiple of num_kv_heads %lld", (long long)H,
                      (long long)Hk);
  st_dims d = {E, Hk * (E / H), E, E, 0};
  if (nm != ATTN_MHA_NAMING_TORCH_PACKED &&
      ((s = weight_cols(ctx, st, prefix, naming_names[nm][ATTN_MHA_K_WEIGHT], "kdim", &d.kdim)) ||
       (s = weight_cols(ctx, st, prefix, naming_names[nm][ATTN_MHA_V_WEIGHT], "vdim", &d.vdim))))
    return s;
  attn__st_info bo;
  d.bias = st_info(st, prefix, naming_names[nm][ATTN_MHA_O_BIAS], &bo);
  if ((s = check_params(ctx, st, prefix, nm, &d))) return s;
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, E, H);
  cfg.num_kv_heads = num_kv_heads;
  cfg.kdim = d.kdim;
  cfg.vdim = d.vdim;
  cfg.bias = d.bias;
  attn_mha *m;
  if ((s = attn_mha_create(ctx, &m, &cfg))) return s;
  if ((s = load_params(ctx, m, st, prefix, nm))) {
    attn_mha_destroy(m);
    return s;
  }
  *out = m;
  return ATTN_OK;
}

attn_status attn_mha_create_from_safetensors(attn_ctx *ctx, attn_mha **out, const char *path, const char *prefix,
                                             int64_t num_heads, int64_t num_kv_heads) {
  ATTN__ENTER(ctx);
  if (!out || !path) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_create_from_safetensors: null argument");
  *out = NULL;
  attn_safetensors *st;
  attn_status s = attn_safetensors_open(ctx, &st, path);
  if (s) return s;
  s = attn_mha_create_from_safetensors_handle(ctx, out, st, prefix, num_heads, num_kv_heads);
  attn_safetensors_close(st);
  return s;
}
