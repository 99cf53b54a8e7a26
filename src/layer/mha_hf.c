/* Layer L of a Hugging Face checkpoint, as saved: config.json shapes the layer
 * and gives its options; the weights (one safetensors file, or a sharded
 * checkpoint's model.safetensors.index.json) hold its tensors under the
 * family's own prefix, which is found by trying each family's in turn. */
#include "mha_internal.h"
#include "../io/file.h"
#include "../io/io.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define HF_MAX_SHARDS 8 /* files one layer's tensors may be spread over */

/* Where each family keeps layer L's attention, as transformers saves it
 * (a task model's wrapper prefix first, then the bare model's). */
static const char *const layer_prefixes[] = {
    "model.layers.%lld.self_attn.",                 /* Llama, Mistral, Qwen, Gemma, OLMo 2 */
    "layers.%lld.self_attn.",
    "model.language_model.layers.%lld.self_attn.",  /* Gemma 3 multimodal, current */
    "language_model.model.layers.%lld.self_attn.",  /* and older */
    "bert.encoder.layer.%lld.attention.",           /* BERT */
    "roberta.encoder.layer.%lld.attention.",        /* RoBERTa */
    "vit.encoder.layer.%lld.attention.",            /* ViT */
    "encoder.layer.%lld.attention.",                /* the bare BERT, RoBERTa, ViT */
    "distilbert.transformer.layer.%lld.attention.", /* DistilBERT */
    "transformer.layer.%lld.attention.",
    "transformer.h.%lld.attn.",                     /* GPT-2 */
    "h.%lld.attn.",
    "encoder.block.%lld.layer.0.SelfAttention.",    /* T5: the encoder's self-attention */
    "block.%lld.layer.0.SelfAttention.",
    NULL};

static int ends_with(const char *s, const char *tail) {
  const size_t n = strlen(s), t = strlen(tail);
  return n >= t && !strcmp(s + n - t, tail);
}

/* dir of index_path + "/" + file, into out (cap bytes); 0 when it does not fit. */
static int shard_path(char *out, size_t cap, const char *index_path, const char *file) {
  const char *slash = strrchr(index_path, '/');
  const int dir = slash ? (int)(slash - index_path) + 1 : 0;
  const int n = snprintf(out, cap, "%.*s%s", dir, index_path, file);
  return n > 0 && (size_t)n < cap;
}

/* The shards holding tensors under prefix, opened and chained into *st (NULL
 * when the index has none there). */
static attn_status open_shards(attn_ctx *ctx, attn_safetensors **st, const attn__hf_index *x, const char *index_path,
                               const char *prefix, char *first_path, size_t first_cap) {
  *st = NULL;
  const char *files[HF_MAX_SHARDS];
  int nfiles = 0;
  const size_t plen = strlen(prefix);
  for (int64_t i = 0; i < x->n; i++) {
    if (strncmp(x->name[i], prefix, plen)) continue;
    int seen = 0;
    for (int f = 0; f < nfiles; f++) seen |= !strcmp(files[f], x->file[i]);
    if (seen) continue;
    if (nfiles == HF_MAX_SHARDS)
      return attn__io_fail(ctx, ATTN_E_FORMAT, "index", index_path, "the tensors under '%s' span more than %d files",
                           prefix, HF_MAX_SHARDS);
    files[nfiles++] = x->file[i];
  }
  for (int f = 0; f < nfiles; f++) {
    char path[4096];
    if (!shard_path(path, sizeof path, index_path, files[f]))
      return attn__io_fail(ctx, ATTN_E_INVALID, "index", index_path, "a shard's path is too long");
    attn_safetensors *s;
    attn_status r = attn_safetensors_open(ctx, &s, path);
    if (r) {
      attn_safetensors_close(*st);
      *st = NULL;
      return r;
    }
    if (*st) attn__safetensors_chain(*st, s);
    else {
      *st = s;
      snprintf(first_path, first_cap, "%s", path);
    }
  }
  return ATTN_OK;
}

/* ---- the layer ---------------------------------------------------------------- */
static int model_is(const attn_hf_config *c, const char *const *list) {
  for (; *list; list++)
    if (!strcmp(c->model_type, *list)) return 1;
  return 0;
}

/* The layer's shape and QK-norm from the config, and its options for layer L. */
static void layer_from_config(attn_hf_layer *info, attn_mha_config *like) {
  static const char *const plus_one[] = {"gemma3", "gemma3_text", NULL};
  const attn_hf_config *c = &info->config;
  const int64_t L = info->layer;
  attn_mha_config_init(like, c->hidden_size, c->num_heads);
  like->num_kv_heads = c->num_kv_heads;
  like->head_dim = c->head_dim;
  static const char *const layer_normed[] = {"cohere", "cohere2", "phi", "stablelm", NULL};
  like->qk_norm_kind = model_is(c, plus_one) ? ATTN_NORM_RMS_PLUS_ONE : model_is(c, layer_normed) ? ATTN_NORM_LAYER
                                                                                                 : ATTN_NORM_RMS;
  if (!isnan(c->norm_eps) && c->norm_eps > 0) like->qk_norm_eps = c->norm_eps;
  like->clip_qkv = c->clip_qkv;
  info->scale = c->scale;
  if (c->scale_inverse_layer) info->scale = (isnan(c->scale) ? 1.0 / sqrt((double)c->head_dim) : c->scale) / (double)(L + 1);
  info->softcap = c->softcap;
  const int sliding = c->sliding_window > 0 && L < ATTN_HF_MAX_LAYERS && c->sliding[L];
  info->window = sliding ? c->sliding_window : 0;
  info->chunk = c->attention_chunk > 0 && L < ATTN_HF_MAX_LAYERS && c->chunked[L] ? c->attention_chunk : 0;
  info->has_rope = c->rope && !(L < ATTN_HF_MAX_LAYERS && c->nope[L]);
  if (c->rope) info->rope = sliding ? c->rope_local : c->rope_global;
}

/* StableLM's qk_layernorm: a LayerNorm without bias per head, saved one tensor per head
 * (q_layernorm.norms.{h}.weight, [D] each: H of them for q, Hk for k), which no name map
 * stacks. The layer m (loaded without them) is made again with each head its own weights
 * ([H, D], [Hk, D]), its parameters copied, and those rows read in; every tensor is checked
 * first, and a norm past the last head is refused rather than ignored. */
static attn_status stacked_head_norms(attn_ctx *ctx, attn_mha **m, const attn_safetensors *st, const char *prefix,
                                      const attn_mha_config *like) {
  const char *path = attn__safetensors_path(st);
  static const char *const which[2] = {"q_layernorm", "k_layernorm"};
  const attn_mha *old = *m;
  const int64_t D = old->head_dim, heads[2] = {old->cfg.num_heads, old->kv_dim / old->head_dim};
  char name[512];
  attn__st_info in;
  for (int t = 0; t < 2; t++)
    for (int64_t h = 0; h <= heads[t]; h++) {
      if (snprintf(name, sizeof name, "%s%s.norms.%lld.weight", prefix, which[t], (long long)h) >= (int)sizeof name)
        return attn__fail(ctx, ATTN_E_INVALID, "parameter prefix is too long");
      const int here = attn__safetensors_info(st, name, &in);
      if (h == heads[t] && here)
        return attn__fail(ctx, ATTN_E_SHAPE, "%s: %s is past the layer's %lld %s heads", path, name,
                          (long long)heads[t], t ? "kv" : "query");
      if (h == heads[t]) break;
      if (!here)
        return attn__fail(ctx, ATTN_E_NOT_FOUND, "%s: missing tensor '%s' (qk_layernorm: one norm per head)", path,
                          name);
      if (!in.known || !attn__is_float(in.dtype) || in.rank != 1 || in.shape[0] != D)
        return attn__fail(ctx, ATTN_E_SHAPE, "%s: %s must be a float vector of head_dim %lld entries", path, name,
                          (long long)D);
    }
  attn_mha_config cfg = old->cfg;
  cfg.qk_norm = ATTN_QK_NORM_EACH_HEAD;
  cfg.qk_norm_kind = ATTN_NORM_LAYER;
  cfg.qk_norm_eps = like->qk_norm_eps;
  attn_mha *n;
  attn_status s = attn_mha_create(ctx, &n, &cfg);
  if (s) return s;
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++)
    if (old->param[p] && n->param[p])
      memcpy(n->param[p], old->param[p], sizeof(float) * (size_t)attn__mha_param_numel(old, p));
  static const int norm_param[2] = {ATTN_MHA_Q_NORM_WEIGHT, ATTN_MHA_K_NORM_WEIGHT};
  static const int bias_param[2] = {ATTN_MHA_Q_NORM_BIAS, ATTN_MHA_K_NORM_BIAS}; /* bias=False: zeros */
  for (int t = 0; t < 2 && !s; t++) {
    if (n->param[bias_param[t]])
      memset(n->param[bias_param[t]], 0, sizeof(float) * (size_t)attn__mha_param_numel(n, bias_param[t]));
    for (int64_t h = 0; h < heads[t] && !s; h++) {
      snprintf(name, sizeof name, "%s%s.norms.%lld.weight", prefix, which[t], (long long)h);
      attn_tensor v;
      void *own = NULL;
      if ((s = attn__safetensors_read(ctx, st, name, &v, &own))) break;
      for (int64_t e = 0; e < D; e++)
        n->param[norm_param[t]][h * D + e] = (float)attn__load(v.data, v.dtype, e * v.strides[0]);
      attn__aligned_free(own);
    }
  }
  if (s) {
    attn_mha_destroy(n);
    return s;
  }
  attn_mha_destroy(*m);
  *m = n;
  return ATTN_OK;
}

/* What the config says and the tensors must agree with. */
static attn_status check_against_config(attn_ctx *ctx, const attn_hf_layer *info, const attn_mha *m,
                                        const char *config_path) {
  static const char *const qk_normed[] = {"qwen3",   "qwen3_moe", "gemma3", "gemma3_text", "olmo2", "olmo3",
                                          "olmoe",   "exaone4",   "apertus", "dots1",      NULL};
  static const char *const with_sinks[] = {"gpt_oss", NULL};
  const attn_hf_config *c = &info->config;
  const attn_mha_config *g = &m->cfg;
  if (g->embed_dim != c->hidden_size)
    return attn__io_fail(ctx, ATTN_E_SHAPE, "config", config_path,
                         "hidden_size is %lld but layer %lld's output projection under '%s' has %lld rows",
                         (long long)c->hidden_size, (long long)info->layer, info->prefix, (long long)g->embed_dim);
  if (c->attention_bias >= 0 && c->attention_bias != (g->bias != 0))
    return attn__io_fail(ctx, ATTN_E_SHAPE, "config", config_path,
                         "attention_bias is %s but the tensors under '%s' have %s q/k/v biases",
                         c->attention_bias ? "true" : "false", info->prefix, g->bias ? "" : "no");
  if (model_is(c, with_sinks) && !g->sinks)
    return attn__io_fail(ctx, ATTN_E_SHAPE, "config", config_path,
                         "model_type '%s' has learned attention sinks, but there is no sinks tensor under '%s'",
                         c->model_type, info->prefix);
  const char *q_norm = attn_mha_param_name(info->naming, ATTN_MHA_Q_NORM_WEIGHT);
  if ((model_is(c, qk_normed) || c->qk_norm) && !g->qk_norm)
    return attn__io_fail(ctx, ATTN_E_SHAPE, "config", config_path,
                         "model_type '%s' norms q and k, but there is no %s under '%s'", c->model_type,
                         q_norm ? q_norm : "QK-norm weight", info->prefix);
  return ATTN_OK;
}

attn_status attn_mha_create_from_hf(attn_ctx *ctx, attn_mha **out, attn_hf_layer *info, const char *config_path,
                                    const char *weights_path, int64_t layer) {
  ATTN__ENTER(ctx);
  if (!out || !info || !config_path || !weights_path)
    return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_create_from_hf: null argument");
  *out = NULL;
  memset(info, 0, sizeof *info);
  info->size = sizeof *info;
  info->layer = layer;
  attn_status st = attn_hf_config_read(ctx, &info->config, config_path);
  if (st) return st;
  const attn_hf_config *c = &info->config;
  if (layer < 0 || (c->num_layers > 0 && layer >= c->num_layers))
    return attn__io_fail(ctx, ATTN_E_INVALID, "config", config_path, "layer %lld: the model has %lld layers (0..%lld)",
                         (long long)layer, (long long)c->num_layers, (long long)c->num_layers - 1);
  if (layer >= ATTN_HF_MAX_LAYERS)
    return attn__fail(ctx, ATTN_E_INVALID, "layer %lld: at most %d layers are read", (long long)layer,
                      ATTN_HF_MAX_LAYERS);
  attn_mha_config like;
  layer_from_config(info, &like);

  const int sharded = ends_with(weights_path, ".json");
  attn__hf_index x = {0};
  attn_safetensors *whole = NULL;
  if (sharded) st = attn__hf_index_read(ctx, &x, weights_path);
  else {
    st = attn_safetensors_open(ctx, &whole, weights_path);
    if (!st) snprintf(info->weights_file, sizeof info->weights_file, "%s", weights_path);
  }
  for (int t = 0; !st && layer_prefixes[t] && info->naming == ATTN_MHA_NAMING_NONE; t++) {
    char prefix[sizeof info->prefix];
    snprintf(prefix, sizeof prefix, layer_prefixes[t], (long long)layer);
    attn_safetensors *shards = NULL;
    const attn_safetensors *st_here = whole;
    if (sharded) {
      if ((st = open_shards(ctx, &shards, &x, weights_path, prefix, info->weights_file, sizeof info->weights_file)))
        break;
      if (!shards) continue;
      st_here = shards;
    }
    attn_mha_naming nm = ATTN_MHA_NAMING_NONE;
    if (!attn_mha_detect_naming(ctx, &nm, st_here, prefix) && nm != ATTN_MHA_NAMING_NONE) {
      info->naming = nm;
      snprintf(info->prefix, sizeof info->prefix, "%s", prefix);
      st = attn_mha_create_from_tensors(ctx, out, st_here, prefix, NULL, &like);
      if (!st && c->qk_norm && !strcmp(c->model_type, "stablelm") && !(*out)->cfg.qk_norm)
        st = stacked_head_norms(ctx, out, st_here, prefix, &like);
      if (!st) st = check_against_config(ctx, info, *out, config_path);
    }
    attn_safetensors_close(shards);
  }
  if (!st && info->naming == ATTN_MHA_NAMING_NONE)
    st = attn__io_fail(ctx, ATTN_E_NOT_FOUND, sharded ? "index" : "safetensors", weights_path,
                       "no attention parameters of layer %lld under any known prefix (e.g. '%s', '%s'); "
                       "load it with attn_mha_create_from_tensors and its prefix",
                       (long long)layer, "model.layers.N.self_attn.", "encoder.layer.N.attention.");
  attn_safetensors_close(whole);
  attn__hf_index_free(&x);
  if (st) {
    attn_mha_destroy(*out);
    *out = NULL;
  } else {
    ctx->msg[0] = '\0'; /* a family tried and not found is no error */
  }
  return st;
}

void attn_hf_layer_opts(const attn_hf_layer *info, attn_mha_opts *opts) {
  if (!info || !opts) return;
  opts->attn.scale = info->scale;
  opts->attn.softcap = info->softcap;
  opts->attn.window = info->window;
  opts->attn.chunk = info->chunk;
  opts->rope = info->has_rope ? &info->rope : NULL;
}
