/* The layer's parameters by name: attn_mha_set_param, and the safetensors
 * loaders, which detect a checkpoint family's naming (or take a caller's) and
 * read each tensor as saved.
 *
 * Every naming is an attn_mha_names: a tensor name per parameter (names that
 * repeat are one tensor holding the q, k, v rows in turn) and whether weights
 * are stored [in, out] (Conv1D). One code path serves them all: a plan (each
 * parameter's Linear-layout shape, and whether the layer holds it) is checked
 * against the file's headers before anything is written or allocated, then
 * each tensor is read once and its rows copied out. */
#include "mha_internal.h"
#include "../io/io.h"
#include "../opts.h"

#include <stdio.h>
#include <stdlib.h>

#define NP ATTN_MHA_NUM_PARAMS
/* attn_mha_create's bound on E, kdim and vdim, here also on H*D and Hk*D: a
 * file's shapes are never trusted further, and products of two stay in int64. */
#define DIM_MAX ((int64_t)1 << 24)

/* ---- namings -------------------------------------------------------------------- */
/* The tensor each naming keeps each parameter in (NULL: it has none). */
static const char *const naming_names[][NP] = {
    [ATTN_MHA_NAMING_SEED] = {"wq.weight", "wq.bias", "wk.weight", "wk.bias", "wv.weight", "wv.bias", "dense.weight",
                              "dense.bias"},
    [ATTN_MHA_NAMING_TORCH_PACKED] = {"in_proj_weight", "in_proj_bias", "in_proj_weight", "in_proj_bias",
                                      "in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias",
                                      [ATTN_MHA_SINKS] = "sinks"},
    [ATTN_MHA_NAMING_TORCH_SEPARATE] = {"q_proj_weight", "in_proj_bias", "k_proj_weight", "in_proj_bias",
                                        "v_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias",
                                        [ATTN_MHA_SINKS] = "sinks"},
    [ATTN_MHA_NAMING_LLAMA] = {"q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight",
                               "v_proj.bias", "o_proj.weight", "o_proj.bias", "q_norm.weight", "q_norm.bias",
                               "k_norm.weight", "k_norm.bias", "sinks"},
    [ATTN_MHA_NAMING_BERT] = {"self.query.weight", "self.query.bias", "self.key.weight", "self.key.bias",
                              "self.value.weight", "self.value.bias", "output.dense.weight", "output.dense.bias"},
    [ATTN_MHA_NAMING_VIT] = {"attention.query.weight", "attention.query.bias", "attention.key.weight",
                             "attention.key.bias", "attention.value.weight", "attention.value.bias",
                             "output.dense.weight", "output.dense.bias"},
    [ATTN_MHA_NAMING_DISTILBERT] = {"q_lin.weight", "q_lin.bias", "k_lin.weight", "k_lin.bias", "v_lin.weight",
                                    "v_lin.bias", "out_lin.weight", "out_lin.bias"},
    [ATTN_MHA_NAMING_GPT2] = {"c_attn.weight", "c_attn.bias", "c_attn.weight", "c_attn.bias", "c_attn.weight",
                              "c_attn.bias", "c_proj.weight", "c_proj.bias"},
    [ATTN_MHA_NAMING_T5] = {"q.weight", NULL, "k.weight", NULL, "v.weight", NULL, "o.weight", NULL},
    [ATTN_MHA_NAMING_PHI3] = {"qkv_proj.weight", NULL, "qkv_proj.weight", NULL, "qkv_proj.weight", NULL,
                              "o_proj.weight", NULL},
    [ATTN_MHA_NAMING_PHI] = {"q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight",
                             "v_proj.bias", "dense.weight", "dense.bias", "q_layernorm.weight", "q_layernorm.bias",
                             "k_layernorm.weight", "k_layernorm.bias"},
};
#define LAST_NAMING ATTN_MHA_NAMING_PHI /* CUSTOM, before it, has no names here */

static const char *const param_what[NP] = {"q weight", "q bias", "k weight", "k bias", "v weight", "v bias",
                                           "o weight", "o bias", "q norm weight", "q norm bias", "k norm weight",
                                           "k norm bias", "sinks"};

const char *attn_mha_param_name(attn_mha_naming naming, attn_mha_param which) {
  if ((int)naming <= ATTN_MHA_NAMING_NONE || naming > LAST_NAMING || (int)which < 0 || which >= NP) return NULL;
  return naming_names[naming][which];
}

/* A family's naming as a name map. */
static void naming_map(attn_mha_names *lay, attn_mha_naming nm) {
  memset(lay, 0, sizeof *lay);
  lay->size = sizeof *lay;
  for (int p = 0; p < NP; p++) lay->name[p] = naming_names[nm][p];
  lay->conv1d = nm == ATTN_MHA_NAMING_GPT2;
}

static int is_weight(int p) {
  return p == ATTN_MHA_Q_WEIGHT || p == ATTN_MHA_K_WEIGHT || p == ATTN_MHA_V_WEIGHT || p == ATTN_MHA_O_WEIGHT;
}
/* Parameters may share a tensor only within a class: q/k/v weights, or q/k/v biases. */
static int pack_class(int p) {
  if (p == ATTN_MHA_Q_WEIGHT || p == ATTN_MHA_K_WEIGHT || p == ATTN_MHA_V_WEIGHT) return 1;
  if (p == ATTN_MHA_Q_BIAS || p == ATTN_MHA_K_BIAS || p == ATTN_MHA_V_BIAS) return 2;
  return 0;
}
static int same_name(const char *a, const char *b) { return a && b && !strcmp(a, b); }

/* The parameters sharing p's tensor (p included), as a bit mask. */
static unsigned members(const attn_mha_names *lay, int p) {
  unsigned m = 1u << p;
  for (int q = 0; q < NP; q++)
    if (q != p && same_name(lay->name[p], lay->name[q])) m |= 1u << q;
  return m;
}
/* Whether p is the first parameter of its tensor (each tensor is handled once). */
static int first_of(const attn_mha_names *lay, int p) {
  for (int q = 0; q < p; q++)
    if (same_name(lay->name[p], lay->name[q])) return 0;
  return 1;
}

/* ---- plans ---------------------------------------------------------------------- */
/* What a layer holds: each parameter's shape in Linear layout (cols 0: a vector). */
typedef struct plan {
  int64_t rows[NP], cols[NP];
  int has[NP];
} plan;

static void plan_of_layer(const attn_mha *m, plan *pl) {
  for (int p = 0; p < NP; p++) {
    pl->rows[p] = m->rows[p];
    pl->cols[p] = m->cols[p];
    pl->has[p] = m->param[p] != NULL;
  }
}

/* The stored shape of the tensor holding the parameters in mask: their rows
 * stacked in q, k, v order, [in, out] for Conv1D weights. -1 when packed
 * weights differ in columns (they cannot share one tensor). */
static int group_shape(const plan *pl, unsigned mask, int conv1d, int *rank, int64_t shape[2]) {
  int64_t rows = 0, cols = -1;
  for (int p = 0; p < NP; p++) {
    if (!(mask >> p & 1)) continue;
    if (cols >= 0 && pl->cols[p] != cols) return -1;
    cols = pl->cols[p];
    rows += pl->rows[p];
  }
  *rank = cols ? 2 : 1;
  shape[0] = cols && conv1d ? cols : rows;
  shape[1] = cols && conv1d ? rows : cols;
  return 0;
}

/* Copies the parameters in mask out of t (float, shaped as group_shape says):
 * each member's rows in turn, Conv1D's [in, out] read through swapped strides. */
static void copy_group(attn_mha *m, unsigned mask, int conv1d, const attn_tensor *t) {
  int64_t s0 = t->strides[0], s1 = t->rank == 2 ? t->strides[1] : 0;
  if (t->rank == 2 && conv1d) {
    const int64_t s = s0;
    s0 = s1;
    s1 = s;
  }
  int64_t row0 = 0;
  for (int p = 0; p < NP; p++) {
    if (!(mask >> p & 1)) continue;
    const int64_t rows = m->rows[p], cols = m->cols[p];
    float *dst = m->param[p];
    for (int64_t r = 0; r < rows; r++) {
      if (cols) {
        for (int64_t c = 0; c < cols; c++)
          dst[r * cols + c] = (float)attn__load(t->data, t->dtype, (row0 + r) * s0 + c * s1);
      } else {
        dst[r] = (float)attn__load(t->data, t->dtype, (row0 + r) * s0);
      }
    }
    row0 += rows;
  }
}

static void fmt_shape(char *buf, size_t cap, int rank, const int64_t *shape) {
  size_t n = (size_t)snprintf(buf, cap, "[");
  for (int i = 0; i < rank && i < ATTN_MAX_RANK && n < cap; i++)
    n += (size_t)snprintf(buf + n, cap - n, i ? ", %lld" : "%lld", (long long)shape[i]);
  if (n < cap) snprintf(buf + n, cap - n, "%s]", rank > ATTN_MAX_RANK ? ", ..." : "");
}

static void fmt_plan(char *buf, size_t cap, const plan *pl) {
  snprintf(buf, cap, "embed_dim %lld, H*D %lld, Hk*D %lld, kdim %lld, vdim %lld",
           (long long)pl->rows[ATTN_MHA_O_WEIGHT], (long long)pl->rows[ATTN_MHA_Q_WEIGHT],
           (long long)pl->rows[ATTN_MHA_K_WEIGHT], (long long)pl->cols[ATTN_MHA_K_WEIGHT],
           (long long)pl->cols[ATTN_MHA_V_WEIGHT]);
}

/* ---- set_param ------------------------------------------------------------------ */
/* One parameter name's tensor against the layer: t must be shaped as the
 * members' group (packed, transposed for Conv1D), then is copied in. */
static attn_status set_group(attn_ctx *ctx, attn_mha *m, unsigned mask, int conv1d, const attn_tensor *t,
                             const char *name) {
  plan pl;
  plan_of_layer(m, &pl);
  for (int p = 0; p < NP; p++) {
    if (!(mask >> p & 1) || pl.has[p]) continue;
    if (p == ATTN_MHA_SINKS)
      return attn__fail(ctx, ATTN_E_INVALID, "%s: the layer was created without sinks (config.sinks)", name);
    if (p >= ATTN_MHA_Q_NORM_WEIGHT)
      return attn__fail(ctx, ATTN_E_INVALID, "%s: the layer has no %s (%s)", name, param_what[p],
                        p % 2 ? "qk_norm_kind is not LAYER" : "created without QK-norm");
    return attn__fail(ctx, ATTN_E_INVALID, "%s: the layer was created without bias (%s)", name, param_what[p]);
  }
  int rank;
  int64_t shape[2];
  if (group_shape(&pl, mask, conv1d, &rank, shape))
    return attn__fail(ctx, ATTN_E_SHAPE,
                      "%s packs the q, k and v weights, which needs kdim = vdim = embed_dim; this layer has kdim "
                      "%lld, vdim %lld, embed_dim %lld (set q/k/v weights one by one)",
                      name, (long long)m->cfg.kdim, (long long)m->cfg.vdim, (long long)m->cfg.embed_dim);
  if (t->rank != rank || t->shape[0] != shape[0] || (rank == 2 && t->shape[1] != shape[1])) {
    char want[64], got[128], dims[192];
    fmt_shape(want, sizeof want, rank, shape);
    fmt_shape(got, sizeof got, t->rank, t->shape);
    fmt_plan(dims, sizeof dims, &pl);
    return attn__fail(ctx, ATTN_E_SHAPE, "%s must be %s%s for this layer (%s), got %s", name, want,
                      conv1d && rank == 2 ? " (Conv1D: [in, out])" : "", dims, got);
  }
  copy_group(m, mask, conv1d, t);
  return ATTN_OK;
}

attn_status attn_mha_set_param(attn_ctx *ctx, attn_mha *mha, const char *name, const attn_tensor *value) {
  ATTN__ENTER(ctx);
  if (!mha || !name || !value) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_set_param: null argument");
  attn_status st = attn__check_tensor(ctx, value, name, -1);
  if (st) return st;
  if (!attn__is_float(value->dtype))
    return attn__fail(ctx, ATTN_E_DTYPE, "%s has dtype %s; parameters must be f32, f64, f16 or bf16", name,
                      attn_dtype_name(value->dtype));
  /* the first naming that uses the name decides; no name means two things */
  for (int nm = ATTN_MHA_NAMING_SEED; nm <= LAST_NAMING; nm++) {
    for (int p = 0; p < NP; p++) {
      if (!same_name(naming_names[nm][p], name)) continue;
      attn_mha_names lay;
      naming_map(&lay, (attn_mha_naming)nm);
      return set_group(ctx, mha, members(&lay, p), lay.conv1d, value, name);
    }
  }
  return attn__fail(ctx, ATTN_E_NOT_FOUND, "unknown parameter name '%s'", name);
}

/* ---- safetensors -------------------------------------------------------------- */
/* prefix + name into full (cap bytes); 0 when it does not fit. */
static int full_name(char *full, size_t cap, const char *prefix, const char *name) {
  return snprintf(full, cap, "%s%s", prefix, name) < (int)cap;
}

/* What the file says of prefix + name, reading no data; 0 if absent. */
static int st_info(const attn_safetensors *st, const char *prefix, const char *name, attn__st_info *info) {
  char full[512];
  return name && full_name(full, sizeof full, prefix, name) && attn__safetensors_info(st, full, info);
}

/* The first naming, in enum order, whose q and o weights the file both holds
 * (Llama's q_proj with o_proj, Phi's with dense), else the first whose q weight
 * it holds (so that a missing o weight is reported as that), or NONE. T5's
 * generic q.weight comes after every longer name but Phi-3's qkv_proj.weight,
 * which no other family has. */
static attn_mha_naming detect(const attn_safetensors *st, const char *prefix) {
  attn__st_info info;
  attn_mha_naming q_only = ATTN_MHA_NAMING_NONE;
  for (int nm = ATTN_MHA_NAMING_SEED; nm <= LAST_NAMING; nm++) {
    if (!st_info(st, prefix, naming_names[nm][ATTN_MHA_Q_WEIGHT], &info)) continue;
    if (st_info(st, prefix, naming_names[nm][ATTN_MHA_O_WEIGHT], &info)) return (attn_mha_naming)nm;
    if (q_only == ATTN_MHA_NAMING_NONE) q_only = (attn_mha_naming)nm;
  }
  return q_only;
}

/* The longest name any naming uses, for the prefix length check. */
static size_t longest_name(const attn_mha_names *lay) {
  size_t n = 0;
  for (int p = 0; p < NP; p++)
    if (lay->name[p] && strlen(lay->name[p]) > n) n = strlen(lay->name[p]);
  return n;
}

/* attn_mha_names as 0.2 declared it, before the sinks joined the parameters. */
typedef struct names_v02 {
  size_t size;
  const char *name[ATTN_MHA_SINKS];
  int conv1d;
} names_v02;

/* Checks the arguments every safetensors call shares and resolves the name
 * map: the caller's names (checked), or the detected family's. */
static attn_status resolve(attn_ctx *ctx, const attn_safetensors *st, const char **prefix,
                           const attn_mha_names *names, attn_mha_names *lay, attn_mha_naming *nm, const char *fn) {
  if (!st) return attn__fail(ctx, ATTN_E_INVALID, "%s: the safetensors handle is NULL", fn);
  if (!*prefix) *prefix = "";
  if (names) {
    memset(lay, 0, sizeof *lay);
    names_v02 old;
    memcpy(&old.size, names, sizeof old.size);
    if (old.size == sizeof old) { /* built against 0.2's attn.h: conv1d sits where SINKS's name now is */
      memcpy(&old, names, sizeof old);
      memcpy(lay->name, old.name, sizeof old.name);
      lay->conv1d = old.conv1d;
    } else {
      attn_status s = attn__read_sized(ctx, lay, sizeof *lay, names, "names", "names.size = sizeof(attn_mha_names)");
      if (s) return s;
    }
    lay->size = sizeof *lay;
    for (int p = 0; p < NP; p++) {
      if (is_weight(p) && !lay->name[p])
        return attn__fail(ctx, ATTN_E_INVALID, "%s: names gives no tensor for the %s (every weight is required)", fn,
                          param_what[p]);
      for (int q = 0; q < p; q++)
        if (same_name(lay->name[p], lay->name[q]) && (!pack_class(p) || pack_class(p) != pack_class(q)))
          return attn__fail(ctx, ATTN_E_INVALID,
                            "%s: names gives '%s' to both the %s and the %s; only q, k and v weights (or biases) "
                            "may share a packed tensor",
                            fn, lay->name[p], param_what[q], param_what[p]);
    }
    *nm = ATTN_MHA_NAMING_CUSTOM;
  } else {
    *nm = detect(st, *prefix);
    if (*nm == ATTN_MHA_NAMING_NONE) {
      char list[512];
      size_t n = 0;
      for (int f = ATTN_MHA_NAMING_SEED; f <= LAST_NAMING && n < sizeof list; f++) {
        const char *q = naming_names[f][ATTN_MHA_Q_WEIGHT];
        int named = !q;
        for (int e = ATTN_MHA_NAMING_SEED; e < f; e++) named |= same_name(q, naming_names[e][ATTN_MHA_Q_WEIGHT]);
        if (!named) n += (size_t)snprintf(list + n, sizeof list - n, "%s%s", f > 1 ? ", " : "", q);
      }
      return attn__fail(ctx, ATTN_E_NOT_FOUND, "%s: no attention parameters under prefix '%s' (looked for %s)",
                        attn__safetensors_path(st), *prefix, list);
    }
    naming_map(lay, *nm);
  }
  char full[512];
  if (strlen(*prefix) + longest_name(lay) >= sizeof full)
    return attn__fail(ctx, ATTN_E_INVALID, "%s: parameter prefix is too long (%zu bytes)", fn, strlen(*prefix));
  return ATTN_OK;
}

attn_status attn_mha_detect_naming(attn_ctx *ctx, attn_mha_naming *naming, const attn_safetensors *st,
                                   const char *prefix) {
  ATTN__ENTER(ctx);
  if (!naming) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_detect_naming: naming is NULL");
  *naming = ATTN_MHA_NAMING_NONE;
  attn_mha_names lay;
  return resolve(ctx, st, &prefix, NULL, &lay, naming, "attn_mha_detect_naming");
}

/* Norm biases are the only optional parameters: a LAYER norm saved without
 * them (bias=False) has zeros there. */
static int optional_param(int p) { return p == ATTN_MHA_Q_NORM_BIAS || p == ATTN_MHA_K_NORM_BIAS; }

/* Every tensor the name map gives, against the plan, reading no data: a
 * parameter the layer holds must be there (dtype float, exactly the group's
 * shape), one it lacks must not. Nothing is written before this passes, and
 * then each parameter's element count equals its tensor's in the file, so
 * what a layer holds is bounded by the bytes the file really has. */
static attn_status check_file(attn_ctx *ctx, const attn_safetensors *st, const char *prefix,
                              const attn_mha_names *lay, const plan *pl) {
  const char *path = attn__safetensors_path(st);
  for (int p = 0; p < NP; p++) {
    const char *name = lay->name[p];
    if (!first_of(lay, p)) continue;
    if (!name) {
      if (pl->has[p] && !optional_param(p))
        return attn__fail(ctx, ATTN_E_NOT_FOUND, "%s: the layer has the %s but the naming gives no tensor for it", path,
                          param_what[p]);
      continue;
    }
    attn__st_info in;
    const int present = st_info(st, prefix, name, &in);
    if (!pl->has[p]) {
      if (!present) continue;
      if (p == ATTN_MHA_Q_NORM_BIAS || p == ATTN_MHA_K_NORM_BIAS)
        return attn__fail(ctx, ATTN_E_INVALID,
                          "%s: has '%s%s', a QK-norm bias, which only qk_norm_kind ATTN_NORM_LAYER takes", path,
                          prefix, name);
      if (p == ATTN_MHA_SINKS)
        return attn__fail(ctx, ATTN_E_INVALID, "%s: has '%s%s' but the layer was created without sinks", path,
                          prefix, name);
      if (p >= ATTN_MHA_Q_NORM_WEIGHT)
        return attn__fail(ctx, ATTN_E_INVALID, "%s: has '%s%s' but the layer has no QK-norm", path, prefix, name);
      return attn__fail(ctx, ATTN_E_INVALID, "%s: has '%s%s' but the layer was created with bias off (%s)", path,
                        prefix, name, param_what[p]);
    }
    if (!present) {
      if (optional_param(p)) continue;
      return attn__fail(ctx, ATTN_E_NOT_FOUND, "%s: missing tensor '%s%s'", path, prefix, name);
    }
    if (!in.known || !attn__is_float(in.dtype))
      return attn__fail(ctx, ATTN_E_DTYPE, "%s: %s%s has dtype %s; parameters must be F32, F64, F16 or BF16", path,
                        prefix, name, in.dtype_name);
    int rank;
    int64_t shape[2];
    char dims[192];
    fmt_plan(dims, sizeof dims, pl);
    if (group_shape(pl, members(lay, p), lay->conv1d, &rank, shape))
      return attn__fail(ctx, ATTN_E_SHAPE,
                        "%s: %s%s packs the q, k and v weights, which needs kdim = vdim = embed_dim; this layer has "
                        "%s",
                        path, prefix, name, dims);
    if (in.rank == rank && in.shape[0] == shape[0] && (rank == 1 || in.shape[1] == shape[1])) continue;
    char want[64], got[128];
    fmt_shape(want, sizeof want, rank, shape);
    fmt_shape(got, sizeof got, in.rank, in.shape);
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: %s%s is %s; a layer of %s needs %s%s", path, prefix, name, got, dims,
                      want, lay->conv1d && rank == 2 ? " (Conv1D: [in, out])" : "");
  }
  return ATTN_OK;
}

/* Checks the file against the layer, then reads each tensor once (into a
 * temporary, converted, freed) and copies its parameters in. */
static attn_status load_into(attn_ctx *ctx, attn_mha *m, const attn_safetensors *st, const char *prefix,
                             const attn_mha_names *lay) {
  plan pl;
  plan_of_layer(m, &pl);
  attn_status s = check_file(ctx, st, prefix, lay, &pl);
  if (s) return s;
  for (int p = 0; p < NP; p++) {
    if (!first_of(lay, p) || !pl.has[p]) continue;
    const unsigned mask = members(lay, p);
    attn__st_info in;
    if (!st_info(st, prefix, lay->name[p], &in)) { /* an optional parameter the file lacks: its default */
      memset(m->param[p], 0, sizeof(float) * (size_t)attn__mha_param_numel(m, p));
      continue;
    }
    char full[512];
    if (!full_name(full, sizeof full, prefix, lay->name[p]))
      return attn__fail(ctx, ATTN_E_INVALID, "parameter prefix is too long");
    attn_tensor t;
    void *own = NULL;
    if ((s = attn__safetensors_read(ctx, st, full, &t, &own))) return s;
    copy_group(m, mask, lay->conv1d, &t);
    attn__aligned_free(own);
  }
  return ATTN_OK;
}

static attn_status load_handle(attn_ctx *ctx, attn_mha *mha, const attn_safetensors *st, const char *prefix,
                               const attn_mha_names *names, const char *fn) {
  if (!mha) return attn__fail(ctx, ATTN_E_INVALID, "%s: layer is NULL", fn);
  attn_mha_names lay;
  attn_mha_naming nm;
  attn_status s = resolve(ctx, st, &prefix, names, &lay, &nm, fn);
  if (s) return s;
  return load_into(ctx, mha, st, prefix, &lay);
}

attn_status attn_mha_load_tensors(attn_ctx *ctx, attn_mha *mha, const attn_safetensors *st, const char *prefix,
                                  const attn_mha_names *names) {
  ATTN__ENTER(ctx);
  return load_handle(ctx, mha, st, prefix, names, "attn_mha_load_tensors");
}

attn_status attn_mha_load_safetensors_handle(attn_ctx *ctx, attn_mha *mha, const attn_safetensors *st,
                                             const char *prefix) {
  ATTN__ENTER(ctx);
  return load_handle(ctx, mha, st, prefix, NULL, "attn_mha_load_safetensors_handle");
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

/* ---- creating a layer from a file's shapes --------------------------------------- */
/* A projection weight's shape in Linear layout ([out, in]; a Conv1D [in, out]
 * swapped): rows are the whole tensor's when packed. Refuses a weight that is
 * absent, not a matrix, empty, or hostile. */
static attn_status weight_dims(attn_ctx *ctx, const attn_safetensors *st, const char *prefix,
                               const attn_mha_names *lay, int p, int64_t *rows, int64_t *cols) {
  const char *path = attn__safetensors_path(st), *name = lay->name[p];
  attn__st_info in;
  if (!st_info(st, prefix, name, &in))
    return attn__fail(ctx, ATTN_E_NOT_FOUND, "%s: missing tensor '%s%s' (the %s)", path, prefix, name,
                      param_what[p]);
  if (in.rank != 2)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: %s%s has rank %d; a projection weight is a matrix", path, prefix, name,
                      in.rank);
  *rows = lay->conv1d ? in.shape[1] : in.shape[0];
  *cols = lay->conv1d ? in.shape[0] : in.shape[1];
  static const char *const in_what[NP] = {[ATTN_MHA_Q_WEIGHT] = "embed_dim", [ATTN_MHA_K_WEIGHT] = "kdim",
                                          [ATTN_MHA_V_WEIGHT] = "vdim", [ATTN_MHA_O_WEIGHT] = "H*D"};
  /* a kdim of 0 would mean "= embed_dim" in a config */
  if (*cols < 1)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: %s%s has no input features (%s 0)", path, prefix, name, in_what[p]);
  if (*rows < 1)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: %s%s has no output features (0 rows)", path, prefix, name);
  if (*rows > 3 * DIM_MAX || *cols > DIM_MAX)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: %s%s is [%lld, %lld]: a dimension past 2^24 (corrupt or hostile?)",
                      path, prefix, name, (long long)in.shape[0], (long long)in.shape[1]);
  return ATTN_OK;
}

/* The length of a 1-D tensor (the QK-norm's, the sinks), or -1 when absent. */
static attn_status vector_len(attn_ctx *ctx, const attn_safetensors *st, const char *prefix, const char *name,
                              int64_t *len) {
  attn__st_info in;
  *len = -1;
  if (!st_info(st, prefix, name, &in)) return ATTN_OK;
  if (in.rank != 1)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: %s%s has rank %d; a norm weight or the sinks are a vector",
                      attn__safetensors_path(st), prefix, name, in.rank);
  *len = in.shape[0];
  return ATTN_OK;
}

/* A QK-norm weight's length, or -1 when absent; [H, D] (a weight per head) gives H * D and *heads = H. */
static attn_status norm_len(attn_ctx *ctx, const attn_safetensors *st, const char *prefix, const char *name,
                            int64_t *len, int64_t *heads) {
  attn__st_info in;
  *len = *heads = -1;
  if (!st_info(st, prefix, name, &in)) return ATTN_OK;
  if (in.rank == 2 && in.shape[0] > 0 && in.shape[1] > 0 && in.shape[0] <= DIM_MAX &&
      in.shape[1] <= DIM_MAX) {
    *heads = in.shape[0];
    *len = in.shape[0] * in.shape[1];
    return ATTN_OK;
  }
  return vector_len(ctx, st, prefix, name, len);
}

static int present(const attn_safetensors *st, const char *prefix, const attn_mha_names *lay, int p) {
  attn__st_info in;
  return st_info(st, prefix, lay->name[p], &in);
}

/* The layer's configuration read off the tensors' shapes (and like's head
 * counts, head_dim and QK-norm kind), and its plan, for check_file. */
static attn_status infer(attn_ctx *ctx, const attn_safetensors *st, const char *prefix, const attn_mha_names *lay,
                         const attn_mha_config *like, attn_mha_config *cfg, plan *pl) {
  const char *path = attn__safetensors_path(st);
  int64_t r[NP] = {0}, c[NP] = {0};
  attn_status s;
  static const int weights[4] = {ATTN_MHA_Q_WEIGHT, ATTN_MHA_K_WEIGHT, ATTN_MHA_V_WEIGHT, ATTN_MHA_O_WEIGHT};
  for (int i = 0; i < 4; i++)
    if ((s = weight_dims(ctx, st, prefix, lay, weights[i], &r[weights[i]], &c[weights[i]]))) return s;
  const unsigned mq = members(lay, ATTN_MHA_Q_WEIGHT), mk = members(lay, ATTN_MHA_K_WEIGHT),
                 mv = members(lay, ATTN_MHA_V_WEIGHT);
  const int64_t E = r[ATTN_MHA_O_WEIGHT];
  /* H*D: the q weight's rows, or o's columns when q is packed */
  const int64_t qd = mq == 1u << ATTN_MHA_Q_WEIGHT ? r[ATTN_MHA_Q_WEIGHT] : c[ATTN_MHA_O_WEIGHT];
  int64_t kv;
  if (mk == 1u << ATTN_MHA_K_WEIGHT) {
    kv = r[ATTN_MHA_K_WEIGHT];
  } else if (mv == 1u << ATTN_MHA_V_WEIGHT) {
    kv = r[ATTN_MHA_V_WEIGHT];
  } else { /* k and v share a tensor, maybe with q: the rows left after q's, halved */
    const int64_t rest = r[ATTN_MHA_K_WEIGHT] - (mk >> ATTN_MHA_Q_WEIGHT & 1 ? qd : 0);
    if (rest < 2 || rest % 2)
      return attn__fail(ctx, ATTN_E_SHAPE,
                        "%s: %s%s has %lld rows (Linear layout), which is not the q's %lld plus two equal k and v "
                        "parts",
                        path, prefix, lay->name[ATTN_MHA_K_WEIGHT], (long long)r[ATTN_MHA_K_WEIGHT], (long long)qd);
    kv = rest / 2;
  }
  if (E > DIM_MAX || qd > DIM_MAX || kv > DIM_MAX)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: under '%s' embed_dim %lld, H*D %lld or Hk*D %lld is past 2^24", path,
                      prefix, (long long)E, (long long)qd, (long long)kv);
  const int64_t H = like->num_heads, Hk = like->num_kv_heads ? like->num_kv_heads : H;
  if (H < 1 || H > DIM_MAX || Hk < 1 || H % Hk)
    return attn__fail(ctx, ATTN_E_INVALID,
                      "num_heads (%lld) must be in [1, 2^24] and a multiple of num_kv_heads (%lld; 0 = num_heads)",
                      (long long)H, (long long)like->num_kv_heads);
  const char *qname = lay->name[ATTN_MHA_Q_WEIGHT], *kname = lay->name[ATTN_MHA_K_WEIGHT];
  int64_t D = like->head_dim;
  if (D < 0 || D > DIM_MAX)
    return attn__fail(ctx, ATTN_E_INVALID, "head_dim %lld is out of range", (long long)D);
  if (D == 0) {
    if (qd % H)
      return attn__fail(ctx, ATTN_E_SHAPE, "%s: %s%s has %lld rows (H*D), not divisible by num_heads %lld", path,
                        prefix, qname, (long long)qd, (long long)H);
    D = qd / H;
  } else if (qd != H * D) {
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: %s%s has %lld rows; num_heads %lld x head_dim %lld needs %lld", path,
                      prefix, qname, (long long)qd, (long long)H, (long long)D, (long long)(H * D));
  }
  if (kv != Hk * D)
    return attn__fail(ctx, ATTN_E_SHAPE,
                      "%s: %s%s gives %lld k rows; num_kv_heads %lld x head_dim %lld needs %lld (num_kv_heads %lld "
                      "would fit)",
                      path, prefix, kname, (long long)kv, (long long)Hk, (long long)D, (long long)(Hk * D),
                      (long long)(kv % D ? 0 : kv / D));
  /* q, k and v share one bias flag in the layer: all three or none */
  const int hb[3] = {present(st, prefix, lay, ATTN_MHA_Q_BIAS), present(st, prefix, lay, ATTN_MHA_K_BIAS),
                     present(st, prefix, lay, ATTN_MHA_V_BIAS)};
  const int bias = hb[0] && hb[1] && hb[2];
  if (!bias && (hb[0] || hb[1] || hb[2])) {
    const int miss = !hb[0] ? ATTN_MHA_Q_BIAS : !hb[1] ? ATTN_MHA_K_BIAS : ATTN_MHA_V_BIAS;
    return attn__fail(ctx, ATTN_E_UNSUPPORTED,
                      "%s: under '%s' some of the q, k, v projections have a bias but the %s ('%s') is missing; the "
                      "layer takes all three or none",
                      path, prefix, param_what[miss], lay->name[miss] ? lay->name[miss] : "no name given");
  }
  const int out_bias = present(st, prefix, lay, ATTN_MHA_O_BIAS);
  /* QK-norm: the weights' shape says its scope, [D] per head, [H*D] and [Hk*D] whole, [H, D] and
   * [Hk, D] each head its own */
  int64_t nq, nk, hq, hk;
  if ((s = norm_len(ctx, st, prefix, lay->name[ATTN_MHA_Q_NORM_WEIGHT], &nq, &hq)) ||
      (s = norm_len(ctx, st, prefix, lay->name[ATTN_MHA_K_NORM_WEIGHT], &nk, &hk)))
    return s;
  int qk_norm = ATTN_QK_NORM_NONE;
  if ((nq < 0) != (nk < 0)) {
    const int miss = nq < 0 ? ATTN_MHA_Q_NORM_WEIGHT : ATTN_MHA_K_NORM_WEIGHT;
    return attn__fail(ctx, ATTN_E_UNSUPPORTED, "%s: under '%s' the %s ('%s') is missing; the layer norms q and k both",
                      path, prefix, param_what[miss], lay->name[miss] ? lay->name[miss] : "no name given");
  }
  if (nq >= 0) {
    if (hq < 0 && hk < 0 && nq == D && nk == D) qk_norm = ATTN_QK_NORM_PER_HEAD;
    else if (hq < 0 && hk < 0 && nq == qd && nk == kv) qk_norm = ATTN_QK_NORM_WHOLE;
    else if (hq == H && hk == Hk && nq == qd && nk == kv) qk_norm = ATTN_QK_NORM_EACH_HEAD;
    else
      return attn__fail(ctx, ATTN_E_SHAPE,
                        "%s: %s%s has %lld and %s%s %lld entries; QK-norm needs [D] = [%lld] for both (per head), "
                        "[H*D] = [%lld] and [Hk*D] = [%lld] (whole), or [H, D] = [%lld, %lld] and [Hk, D] = [%lld, %lld] "
                        "(each head its own)",
                        path, prefix, lay->name[ATTN_MHA_Q_NORM_WEIGHT], (long long)nq, prefix,
                        lay->name[ATTN_MHA_K_NORM_WEIGHT], (long long)nk, (long long)D, (long long)qd, (long long)kv,
                        (long long)H, (long long)D, (long long)Hk, (long long)D);
  } else {
    for (int p = ATTN_MHA_Q_NORM_BIAS; p <= ATTN_MHA_K_NORM_BIAS; p += 2)
      if (present(st, prefix, lay, p))
        return attn__fail(ctx, ATTN_E_INVALID, "%s: has '%s%s', a QK-norm bias, but no QK-norm weights", path,
                          prefix, lay->name[p]);
  }
  const int norm_bias = qk_norm && like->qk_norm_kind == ATTN_NORM_LAYER;
  /* learned sinks: one per query head */
  int64_t ns;
  if ((s = vector_len(ctx, st, prefix, lay->name[ATTN_MHA_SINKS], &ns))) return s;
  if (ns >= 0 && ns != H)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: %s%s is [%lld]; the sinks are one per query head: [%lld]", path, prefix,
                      lay->name[ATTN_MHA_SINKS], (long long)ns, (long long)H);

  attn_mha_config_init(cfg, E, H);
  cfg->num_kv_heads = like->num_kv_heads;
  cfg->kdim = c[ATTN_MHA_K_WEIGHT];
  cfg->vdim = c[ATTN_MHA_V_WEIGHT];
  cfg->bias = bias;
  cfg->out_bias = out_bias;
  cfg->head_dim = H * D == E ? 0 : D;
  cfg->qk_norm = qk_norm;
  cfg->qk_norm_kind = like->qk_norm_kind;
  cfg->qk_norm_eps = like->qk_norm_eps;
  cfg->sinks = ns >= 0;
  cfg->clip_qkv = like->clip_qkv; /* not in the file: the config's */

  /* the plan the layer will have, for check_file before any allocation */
  const int each = qk_norm == ATTN_QK_NORM_EACH_HEAD;
  const int64_t nl = qk_norm == ATTN_QK_NORM_WHOLE ? qd : each ? H : D;
  const int64_t nlk = qk_norm == ATTN_QK_NORM_WHOLE ? kv : each ? Hk : D, nd = each ? D : 0;
  const int64_t rows[NP] = {qd, qd, kv, kv, kv, kv, E, E, nl, nl, nlk, nlk, H};
  const int64_t cols[NP] = {E, 0, cfg->kdim, 0, cfg->vdim, 0, qd, 0, nd, nd, nd, nd, 0};
  const int has[NP] = {1, bias, 1, bias, 1, bias, 1, out_bias, qk_norm != 0, norm_bias, qk_norm != 0, norm_bias,
                       cfg->sinks};
  for (int p = 0; p < NP; p++) {
    pl->rows[p] = rows[p];
    pl->cols[p] = cols[p];
    pl->has[p] = has[p];
  }
  return ATTN_OK;
}

static attn_status create_from(attn_ctx *ctx, attn_mha **out, const attn_safetensors *st, const char *prefix,
                               const attn_mha_names *names, const attn_mha_config *like, const char *fn) {
  if (!out) return attn__fail(ctx, ATTN_E_INVALID, "%s: out is NULL", fn);
  *out = NULL;
  attn_mha_config lk;
  attn_mha_config_init(&lk, 0, 0);
  attn_status s;
  if (!like) return attn__fail(ctx, ATTN_E_INVALID, "%s: like is NULL, and num_heads is required", fn);
  if ((s = attn__read_sized(ctx, &lk, sizeof lk, like, "like", "attn_mha_config_init"))) return s;
  attn_mha_names lay;
  attn_mha_naming nm;
  if ((s = resolve(ctx, st, &prefix, names, &lay, &nm, fn))) return s;
  attn_mha_config cfg;
  plan pl;
  if ((s = infer(ctx, st, prefix, &lay, &lk, &cfg, &pl)) || (s = check_file(ctx, st, prefix, &lay, &pl))) return s;
  attn_mha *m;
  if ((s = attn_mha_create(ctx, &m, &cfg))) return s;
  if ((s = load_into(ctx, m, st, prefix, &lay))) {
    attn_mha_destroy(m);
    return s;
  }
  *out = m;
  return ATTN_OK;
}

attn_status attn_mha_create_from_tensors(attn_ctx *ctx, attn_mha **out, const attn_safetensors *st,
                                         const char *prefix, const attn_mha_names *names,
                                         const attn_mha_config *like) {
  ATTN__ENTER(ctx);
  return create_from(ctx, out, st, prefix, names, like, "attn_mha_create_from_tensors");
}

attn_status attn_mha_create_from_safetensors_handle(attn_ctx *ctx, attn_mha **out, const attn_safetensors *st,
                                                    const char *prefix, int64_t num_heads, int64_t num_kv_heads) {
  ATTN__ENTER(ctx);
  attn_mha_config like;
  attn_mha_config_init(&like, 0, num_heads);
  like.num_kv_heads = num_kv_heads;
  return create_from(ctx, out, st, prefix, NULL, &like, "attn_mha_create_from_safetensors_handle");
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
