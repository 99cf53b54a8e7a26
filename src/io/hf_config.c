/* Hugging Face config.json: the attention's shape and options, read with the
 * strict JSON reader (json.h) from a hostile file: a size cap, every value's
 * type and range checked, unknown keys skipped, and what libattn lacks
 * refused by name (attn.h says which names mean what). */
#include "internal.h"
#include "file.h"
#include "io.h"
#include "json.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define HF_CONFIG_CAP ((int64_t)16 << 20)

enum { UNSET = -1 };

/* One RoPE object (rope_scaling, rope_parameters or one of its layer types), as said. */
typedef struct hf_rope {
  int present;
  char type[32];
  double theta, factor, low, high, beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, partial;
  double original_max;
  int truncate; /* YaRN's: 1 unless the file says false */
  int nshort, nlong; /* longrope's factors: -1 not given */
  double shortf[ATTN_ROPE_MAX_PAIRS], longf[ATTN_ROPE_MAX_PAIRS];
} hf_rope;

/* What the file said, before defaults (NAN / UNSET: not said). */
typedef struct hf_raw {
  char model_type[64];
  int64_t hidden, heads, kv_heads, head_dim, layers, sliding_window, max_window_layers, max_pos, pattern, rotary_dim;
  double theta, partial, local_base, qpas, softcap, eps, multiplier;
  double original_max; /* Phi-3 keeps original_max_position_embeddings beside rope_scaling */
  int attention_bias, use_sliding, scale_attn_weights, scale_inverse_layer, relative_bias;
  hf_rope scaling, global, local;
  int64_t ntypes;
  unsigned char types[ATTN_HF_MAX_LAYERS]; /* 0: full_attention, 1: sliding_attention, 2: chunked_attention */
  int64_t chunk;                           /* attention_chunk_size (UNSET: not given or null) */
  int64_t nrope, nope_interval;            /* no_rope_layers' length (UNSET: not given), its interval */
  unsigned char use_rope[ATTN_HF_MAX_LAYERS]; /* no_rope_layers: 1 RoPE, 0 none */
  int pattern_text;                        /* sliding_window_pattern given as a string (EXAONE 4's "LLLG") */
  int use_qk_norm;                         /* Cohere's LayerNorm of q and k (Llama 4's weightless norm) */
  int qk_layernorm;                        /* Phi's and StableLM's LayerNorm of q and k (Persimmon's) */
  double clip_qkv;                         /* OLMo's clamp of q, k and v; NAN when absent or null */
  char lacking[48];                        /* the first key that asks for what libattn lacks, or "" */
} hf_raw;

static void rope_unset(hf_rope *r) {
  memset(r, 0, sizeof *r);
  r->theta = r->factor = r->low = r->high = r->beta_fast = r->beta_slow = NAN;
  r->attention_factor = r->mscale = r->mscale_all_dim = r->partial = r->original_max = NAN;
  r->truncate = 1;
  r->nshort = r->nlong = -1;
}

static int key_is(const char *k, const char *w) { return !strcmp(k, w); }

/* The literal w next, after white space (moved past), or 0. */
static int lit(attn__json *j, const char *w) {
  attn__json_peek(j);
  return attn__json_literal(j, w);
}

/* A number, or null (left as NAN). */
static attn_status num_or_null(attn__json *j, double *v) {
  if (attn__json_peek(j) == 'n') {
    if (!lit(j, "null")) return attn__json_fail(j, "expected a number or null");
    return ATTN_OK;
  }
  return attn__json_double(j, v);
}

/* An integer in 0..2^40 (sizes, counts, windows), or null (left UNSET). */
static attn_status int_or_null(attn__json *j, const char *key, int64_t *v) {
  double x = NAN;
  attn_status st = num_or_null(j, &x);
  if (st || isnan(x)) return st;
  if (x != floor(x) || x < 0 || x > 1099511627776.0)
    return attn__json_fail(j, "%s must be a non-negative integer, got %g", key, x);
  *v = (int64_t)x;
  return ATTN_OK;
}

static attn_status boolean(attn__json *j, const char *key, int *v) {
  if (lit(j, "true")) *v = 1;
  else if (lit(j, "false")) *v = 0;
  else if (!lit(j, "null")) return attn__json_fail(j, "%s must be true or false", key);
  return ATTN_OK;
}

/* A string into buf (cap bytes, NUL-terminated; longer ones are refused), or null (""). */
static attn_status short_string(attn__json *j, const char *key, char *buf, size_t cap) {
  if (lit(j, "null")) {
    buf[0] = '\0';
    return ATTN_OK;
  }
  char *s = NULL;
  size_t n = 0;
  attn_status st = attn__json_string(j, &s, &n);
  if (st) return st;
  if (n >= cap || strlen(s) != n) {
    free(s);
    return attn__json_fail(j, "%s: a string of %zu bytes (at most %zu, no NUL)", key, n, cap - 1);
  }
  memcpy(buf, s, n + 1);
  free(s);
  return ATTN_OK;
}

/* longrope's list of numbers, one per rotary pair. */
typedef struct factors {
  const char *key;
  double *out;
  int *n;
} factors;

static attn_status factor_item(attn__json *j, int64_t i, void *arg) {
  const factors *f = arg;
  if (i == ATTN_ROPE_MAX_PAIRS)
    return attn__io_fail(j->ctx, ATTN_E_UNSUPPORTED, j->kind, j->path, "%s: more than %d rotary pairs", f->key,
                         ATTN_ROPE_MAX_PAIRS);
  attn_status st = attn__json_double(j, &f->out[i]);
  if (st) return st;
  if (!(f->out[i] > 0) || !isfinite(f->out[i]))
    return attn__json_fail(j, "%s[%lld] is %g; the factors must be finite and > 0", f->key, (long long)i, f->out[i]);
  *f->n = (int)i + 1;
  return ATTN_OK;
}

static attn_status factor_list(attn__json *j, const char *key, double *out, int *n) {
  if (lit(j, "null")) return ATTN_OK;
  factors f = {key, out, n};
  *n = 0;
  return attn__json_each_item(j, factor_item, &f);
}

static attn_status rope_key(attn__json *j, const char *k, void *arg) {
  hf_rope *r = arg;
  if (key_is(k, "rope_type") || key_is(k, "type")) return short_string(j, k, r->type, sizeof r->type);
  if (key_is(k, "rope_theta")) return num_or_null(j, &r->theta);
  if (key_is(k, "factor")) return num_or_null(j, &r->factor);
  if (key_is(k, "low_freq_factor")) return num_or_null(j, &r->low);
  if (key_is(k, "high_freq_factor")) return num_or_null(j, &r->high);
  if (key_is(k, "beta_fast")) return num_or_null(j, &r->beta_fast);
  if (key_is(k, "beta_slow")) return num_or_null(j, &r->beta_slow);
  if (key_is(k, "attention_factor")) return num_or_null(j, &r->attention_factor);
  if (key_is(k, "mscale")) return num_or_null(j, &r->mscale);
  if (key_is(k, "mscale_all_dim")) return num_or_null(j, &r->mscale_all_dim);
  if (key_is(k, "partial_rotary_factor")) return num_or_null(j, &r->partial);
  if (key_is(k, "original_max_position_embeddings")) return num_or_null(j, &r->original_max);
  if (key_is(k, "truncate")) return boolean(j, k, &r->truncate);
  if (key_is(k, "short_factor")) return factor_list(j, k, r->shortf, &r->nshort);
  if (key_is(k, "long_factor")) return factor_list(j, k, r->longf, &r->nlong);
  if (key_is(k, "short_mscale") || key_is(k, "long_mscale"))
    return attn__io_fail(j->ctx, ATTN_E_UNSUPPORTED, j->kind, j->path, "RoPE %s (PhiMoE's) is not supported", k);
  return attn__json_skip(j, 1);
}

static attn_status rope_object(attn__json *j, hf_rope *r) {
  if (lit(j, "null")) return ATTN_OK;
  r->present = 1;
  return attn__json_each_key(j, rope_key, r, 1);
}

/* rope_parameters: one RoPE object, or one per layer type. */
static attn_status rope_parameters_key(attn__json *j, const char *k, void *arg) {
  hf_raw *r = arg;
  if (key_is(k, "full_attention")) return rope_object(j, &r->global);
  if (key_is(k, "sliding_attention")) return rope_object(j, &r->local);
  return rope_key(j, k, &r->global);
}

static attn_status layer_type(attn__json *j, int64_t i, void *arg) {
  hf_raw *r = arg;
  char t[32];
  attn_status st = short_string(j, "layer_types", t, sizeof t);
  if (st) return st;
  if (i >= ATTN_HF_MAX_LAYERS)
    return attn__io_fail(j->ctx, ATTN_E_UNSUPPORTED, j->kind, j->path, "layer_types: more than %d layers",
                         ATTN_HF_MAX_LAYERS);
  if (!strcmp(t, "full_attention")) r->types[i] = 0;
  else if (!strcmp(t, "sliding_attention")) r->types[i] = 1;
  else if (!strcmp(t, "chunked_attention")) r->types[i] = 2;
  else {
    char shown[40];
    attn__sanitize(shown, sizeof shown, t, strlen(t));
    return attn__io_fail(j->ctx, ATTN_E_UNSUPPORTED, j->kind, j->path, "layer_types[%lld] = '%s' is not supported",
                         (long long)i, shown);
  }
  r->ntypes = i + 1;
  return ATTN_OK;
}

static attn_status layer_types(attn__json *j, hf_raw *r) {
  if (lit(j, "null")) return ATTN_OK;
  r->ntypes = 0;
  return attn__json_each_item(j, layer_type, r);
}

/* SmolLM3's and Llama 4's no_rope_layers: one 0 or 1 per layer (1: the layer takes RoPE). */
static attn_status rope_layer(attn__json *j, int64_t i, void *arg) {
  hf_raw *r = arg;
  double v;
  attn_status st = attn__json_double(j, &v);
  if (st) return st;
  if (v != 0 && v != 1) return attn__json_fail(j, "no_rope_layers[%lld] is %g; want 0 or 1", (long long)i, v);
  if (i >= ATTN_HF_MAX_LAYERS)
    return attn__io_fail(j->ctx, ATTN_E_UNSUPPORTED, j->kind, j->path, "no_rope_layers: more than %d layers",
                         ATTN_HF_MAX_LAYERS);
  r->use_rope[i] = (unsigned char)v;
  r->nrope = i + 1;
  return ATTN_OK;
}

static attn_status rope_layers(attn__json *j, hf_raw *r) {
  if (lit(j, "null")) return ATTN_OK;
  r->nrope = 0;
  return attn__json_each_item(j, rope_layer, r);
}

/* A key whose true, non-zero or non-null value asks for what libattn lacks: remembered, and
 * refused once the whole file is read (so that a family's own refusal, found by its
 * model_type, which may come later, is the one reported). */
static attn_status lacking(attn__json *j, hf_raw *r, const char *k) {
  if (lit(j, "null") || lit(j, "false")) return ATTN_OK;
  const int c = attn__json_peek(j);
  if (c == '-' || (c >= '0' && c <= '9')) {
    double x = NAN;
    attn_status st = attn__json_double(j, &x);
    if (st || x == 0) return st; /* 0: off */
  } else {
    attn_status st = attn__json_skip(j, 1);
    if (st) return st;
  }
  if (!r->lacking[0]) snprintf(r->lacking, sizeof r->lacking, "%s", k);
  return ATTN_OK;
}

/* sliding_window_pattern: a period (Gemma 3, Cohere 2, EXAONE 4), or EXAONE 4's string, which
 * transformers leaves to layer_types. */
static attn_status pattern(attn__json *j, hf_raw *r) {
  if (attn__json_peek(j) == '"') {
    r->pattern_text = 1;
    return attn__json_skip(j, 1);
  }
  return int_or_null(j, "sliding_window_pattern", &r->pattern);
}

static attn_status top_key(attn__json *j, const char *k, void *arg) {
  hf_raw *r = arg;
  if (key_is(k, "model_type")) return short_string(j, k, r->model_type, sizeof r->model_type);
  if (key_is(k, "hidden_size") || key_is(k, "n_embd") || key_is(k, "d_model") || key_is(k, "dim"))
    return int_or_null(j, k, &r->hidden);
  if (key_is(k, "num_attention_heads") || key_is(k, "n_head") || key_is(k, "num_heads") || key_is(k, "n_heads"))
    return int_or_null(j, k, &r->heads);
  if (key_is(k, "num_key_value_heads")) return int_or_null(j, k, &r->kv_heads);
  if (key_is(k, "head_dim") || key_is(k, "d_kv")) return int_or_null(j, k, &r->head_dim);
  if (key_is(k, "num_hidden_layers") || key_is(k, "n_layer") || key_is(k, "num_layers") || key_is(k, "n_layers"))
    return int_or_null(j, k, &r->layers);
  if (key_is(k, "max_position_embeddings") || key_is(k, "n_positions")) return int_or_null(j, k, &r->max_pos);
  if (key_is(k, "original_max_position_embeddings")) return num_or_null(j, &r->original_max);
  if (key_is(k, "rope_theta") || key_is(k, "rotary_emb_base")) return num_or_null(j, &r->theta);
  if (key_is(k, "partial_rotary_factor") || key_is(k, "rotary_pct")) return num_or_null(j, &r->partial);
  if (key_is(k, "rotary_dim")) return int_or_null(j, k, &r->rotary_dim);
  if (key_is(k, "rope_local_base_freq")) return num_or_null(j, &r->local_base);
  if (key_is(k, "rope_scaling")) return rope_object(j, &r->scaling);
  if (key_is(k, "rope_parameters")) {
    if (lit(j, "null")) return ATTN_OK;
    r->global.present = 1;
    return attn__json_each_key(j, rope_parameters_key, r, 1);
  }
  if (key_is(k, "sliding_window")) return int_or_null(j, k, &r->sliding_window);
  if (key_is(k, "no_rope_layers")) return rope_layers(j, r);
  if (key_is(k, "no_rope_layer_interval")) return int_or_null(j, k, &r->nope_interval);
  if (key_is(k, "use_qk_norm")) return boolean(j, k, &r->use_qk_norm);
  if (key_is(k, "qk_layernorm")) return boolean(j, k, &r->qk_layernorm);
  if (key_is(k, "clip_qkv")) return num_or_null(j, &r->clip_qkv);
  if (key_is(k, "attention_chunk_size")) return int_or_null(j, k, &r->chunk);
  if (key_is(k, "attn_temperature_tuning") ||
      key_is(k, "kv_lora_rank") || key_is(k, "q_lora_rank") ||
      key_is(k, "key_multiplier") || key_is(k, "llama_4_scaling_beta") || key_is(k, "use_bidirectional_attention"))
    return lacking(j, r, k);
  if (key_is(k, "layer_types")) return layer_types(j, r);
  if (key_is(k, "use_sliding_window")) return boolean(j, k, &r->use_sliding);
  if (key_is(k, "max_window_layers")) return int_or_null(j, k, &r->max_window_layers);
  if (key_is(k, "sliding_window_pattern")) return pattern(j, r);
  if (key_is(k, "attn_logit_softcapping")) return num_or_null(j, &r->softcap);
  if (key_is(k, "query_pre_attn_scalar")) return num_or_null(j, &r->qpas);
  if (key_is(k, "attention_multiplier")) return num_or_null(j, &r->multiplier);
  if (key_is(k, "attention_bias")) return boolean(j, k, &r->attention_bias);
  if (key_is(k, "scale_attn_weights")) return boolean(j, k, &r->scale_attn_weights);
  if (key_is(k, "relative_attention_num_buckets")) {
    r->relative_bias = 1;
    return attn__json_skip(j, 1);
  }
  if (key_is(k, "scale_attn_by_inverse_layer_idx")) return boolean(j, k, &r->scale_inverse_layer);
  if (key_is(k, "rms_norm_eps") || key_is(k, "layer_norm_eps") || key_is(k, "layer_norm_epsilon")) return num_or_null(j, &r->eps);
  if (key_is(k, "position_embedding_type")) {
    char t[32];
    attn_status st = short_string(j, k, t, sizeof t);
    if (!st && t[0] && strcmp(t, "absolute"))
      return attn__io_fail(j->ctx, ATTN_E_UNSUPPORTED, j->kind, j->path,
                           "position_embedding_type '%.20s' is not supported (only absolute)", t);
    return st;
  }
  if (key_is(k, "alibi")) {
    int a = 0;
    attn_status st = boolean(j, k, &a);
    if (!st && a)
      return attn__io_fail(j->ctx, ATTN_E_UNSUPPORTED, j->kind, j->path,
                           "alibi = true is not read from configs (attn_sdpa_opts.alibi_slopes takes it)");
    return st;
  }
  return attn__json_skip(j, 1);
}

static int family(const char *t, const char *const *list) {
  for (; *list; list++)
    if (!strcmp(t, *list)) return 1;
  return 0;
}

/* rope opts from one object (its theta falling back to the config's), scaling names checked. */
static attn_status rope_opts_of(attn__json *j, attn_rope_opts *o, const hf_rope *r, const hf_raw *top,
                                const char *which) {
  const double theta = top->theta;
  const int64_t max_pos = top->max_pos;
  attn_rope_opts_init(o);
  o->theta = !isnan(r->theta) ? r->theta : !isnan(theta) ? theta : 10000.0;
  const char *t = r->type;
  if (!t[0] || !strcmp(t, "default")) o->scaling = ATTN_ROPE_DEFAULT;
  else if (!strcmp(t, "linear")) o->scaling = ATTN_ROPE_LINEAR;
  else if (!strcmp(t, "dynamic")) o->scaling = ATTN_ROPE_DYNAMIC;
  else if (!strcmp(t, "llama3")) o->scaling = ATTN_ROPE_LLAMA3;
  else if (!strcmp(t, "yarn")) o->scaling = ATTN_ROPE_YARN;
  else if (!strcmp(t, "longrope") || !strcmp(t, "su")) o->scaling = ATTN_ROPE_LONGROPE; /* "su": Phi-3's first name */
  else {
    char shown[40];
    attn__sanitize(shown, sizeof shown, t, strlen(t));
    return attn__io_fail(j->ctx, ATTN_E_UNSUPPORTED, j->kind, j->path, "%s rope_type '%s' is not supported", which, shown);
  }
  if (!isnan(r->factor)) o->factor = r->factor;
  if (!isnan(r->low)) o->low_freq_factor = r->low;
  if (!isnan(r->high)) o->high_freq_factor = r->high;
  if (!isnan(r->beta_fast)) o->beta_fast = r->beta_fast;
  if (!isnan(r->beta_slow)) o->beta_slow = r->beta_slow;
  o->yarn_truncate = r->truncate;
  const double om = !isnan(r->original_max) ? r->original_max : !isnan(top->original_max) ? top->original_max
                                                                                          : (double)max_pos;
  o->original_max_position = om > 0 && om < 1e15 ? (int64_t)om : 0;
  if (o->scaling == ATTN_ROPE_LONGROPE) {
    if (r->nshort < 0 || r->nlong < 0 || r->nshort != r->nlong)
      return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path,
                           "%s longrope needs short_factor and long_factor of one length (got %d and %d entries)",
                           which, r->nshort, r->nlong);
    memcpy(o->short_factor, r->shortf, sizeof(double) * (size_t)r->nshort);
    memcpy(o->long_factor, r->longf, sizeof(double) * (size_t)r->nlong);
    /* Phi-3 gives no factor: the context's growth, as transformers takes it */
    if (isnan(r->factor) && max_pos > 0 && o->original_max_position > 0)
      o->factor = (double)max_pos / (double)o->original_max_position;
  }
  if (!isnan(r->attention_factor)) {
    o->attention_factor = r->attention_factor;
  } else if (!isnan(r->mscale) && !isnan(r->mscale_all_dim) && o->factor > 1) {
    /* DeepSeek's form: the ratio of two scaled log factors */
    o->attention_factor = (0.1 * r->mscale * log(o->factor) + 1) / (0.1 * r->mscale_all_dim * log(o->factor) + 1);
  }
  return ATTN_OK;
}

/* What transformers assumes of a family where its config is silent, and its RoPE layout. */
typedef struct family_facts {
  const char *type;
  double theta;    /* rope_theta when absent; 0: 10000 */
  double partial;  /* partial_rotary_factor when absent; 0: 1 */
  int interleaved; /* pairs (2i, 2i + 1): rotate_half over even and odd dims */
} family_facts;

static const family_facts *facts_of(const char *type) {
  static const family_facts facts[] = {
      {"cohere", 5e5, 0, 1},      {"cohere2", 0, 0, 1},       {"glm", 0, 0.5, 1},        {"glm4", 0, 0.5, 1},
      {"helium", 1e5, 0, 1},      {"ernie4_5", 5e5, 0, 1},    {"gptj", 0, 0, 1},         {"llama4", 5e5, 0, 1},
      {"llama4_text", 5e5, 0, 1},
      {"stablelm", 0, 0.25, 0},   {"persimmon", 0, 0.5, 0},   {"phi", 0, 0.5, 0},        {"nemotron", 0, 0.5, 0},
      {"gpt_neox", 0, 0.25, 0},   {"olmo3", 5e5, 0, 0},       {"apertus", 1.2e7, 0, 0},  {"mixtral", 1e6, 0, 0},
      {"smollm3", 2e6, 0, 0},     {"gpt_oss", 1.5e5, 0, 0},   {"bitnet", 5e5, 0, 0},     {"exaone", 5e5, 0, 0},
      {NULL, 0, 0, 0}};
  for (const family_facts *f = facts; f->type; f++)
    if (!strcmp(type, f->type)) return f;
  return NULL;
}

/* What a key that asks for what libattn lacks means. */
static const char *lacking_what(const char *k) {
  if (key_is(k, "use_qk_norm")) return "Llama 4's QK-norm without weights, after RoPE";
  if (key_is(k, "attention_chunk_size")) return "chunked attention outside Llama 4";
  if (key_is(k, "attn_temperature_tuning")) return "Llama 4's temperature on NoPE layers";
  if (key_is(k, "clip_qkv")) return "a clamp of q, k and v outside OLMo and OLMoE";
  if (key_is(k, "qk_layernorm")) return "Persimmon's LayerNorm of q and k, beside its fused query_key_value";
  if (key_is(k, "kv_lora_rank") || key_is(k, "q_lora_rank")) return "DeepSeek's multi-head latent attention";
  if (key_is(k, "key_multiplier")) return "Falcon-H1's multiplier of the keys";
  if (key_is(k, "llama_4_scaling_beta")) return "Ministral 3's query scale growing with the position";
  if (key_is(k, "use_bidirectional_attention")) return "bidirectional attention, whose window looks both ways";
  return "a feature of another attention";
}

static attn_status finish(attn__json *j, attn_hf_config *out, hf_raw *r) {
  static const char *const rope_families[] = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe",
                                              "gemma", "gemma2", "gemma3", "gemma3_text", "phi", "phi3", "gpt_neox",
                                              "gptj", "olmo", "olmo2", "granite", "stablelm", "cohere", "starcoder2",
                                              "persimmon", "internlm2", "deepseek_v2", "smollm3", "gpt_oss", "cohere2",
                                              "glm", "glm4", "helium", "ernie4_5", "olmo3", "olmoe", "exaone4",
                                              "apertus", "seed_oss", "arcee", "dots1", "nemotron", "ministral",
                                              "granitemoe", "llama4", "llama4_text", NULL};
  /* families whose attention differs from the one libattn computes in a way no key states */
  static const char *const other_attention[][2] = {
      {"hunyuan_v1_dense", "its QK-norm after RoPE"}, {"hunyuan_v1_moe", "its QK-norm after RoPE"},
      {"bitnet", "a norm of the attention's output before o_proj"}, {"doge", "its dynamic mask"},
      {"qwen3_next", "its gated output"}, {"jetmoe", "its mixture of attention heads"},
      {"deepseek_v2", "multi-head latent attention"}, {"deepseek_v3", "multi-head latent attention"},
      {"kimi_k2", "multi-head latent attention"}, {"falcon_h1", "its multiplier of the keys"}, {NULL, NULL}};
  memset(out, 0, sizeof *out);
  out->size = sizeof *out;
  memcpy(out->model_type, r->model_type, sizeof out->model_type);
  char shown[40];
  attn__sanitize(shown, sizeof shown, r->model_type, strlen(r->model_type));
  for (int i = 0; other_attention[i][0]; i++)
    if (!strcmp(r->model_type, other_attention[i][0]))
      return attn__io_fail(j->ctx, ATTN_E_UNSUPPORTED, j->kind, j->path, "model_type '%s' (%s) is not supported", shown,
                           other_attention[i][1]);
  const int cohere = !strcmp(r->model_type, "cohere") || !strcmp(r->model_type, "cohere2");
  const int layernormed = !strcmp(r->model_type, "phi") || !strcmp(r->model_type, "stablelm");
  if (r->use_qk_norm == 1 && !cohere && !r->lacking[0]) snprintf(r->lacking, sizeof r->lacking, "use_qk_norm");
  if (r->qk_layernorm == 1 && !layernormed && !r->lacking[0]) snprintf(r->lacking, sizeof r->lacking, "qk_layernorm");
  const int clipped = !strcmp(r->model_type, "olmo") || !strcmp(r->model_type, "olmoe");
  if (!isnan(r->clip_qkv) && !clipped && !r->lacking[0]) snprintf(r->lacking, sizeof r->lacking, "clip_qkv");
  const int llama4 = !strcmp(r->model_type, "llama4") || !strcmp(r->model_type, "llama4_text");
  if (r->chunk > 0 && !llama4 && !r->lacking[0]) snprintf(r->lacking, sizeof r->lacking, "attention_chunk_size");
  for (int64_t l = 0; l < r->ntypes && !llama4; l++)
    if (r->types[l] == 2)
      return attn__io_fail(j->ctx, ATTN_E_UNSUPPORTED, j->kind, j->path,
                           "layer_types[%lld] = 'chunked_attention' is not supported outside Llama 4", (long long)l);
  if (r->lacking[0])
    return attn__io_fail(j->ctx, ATTN_E_UNSUPPORTED, j->kind, j->path, "%s (%s) is not supported", r->lacking,
                         lacking_what(r->lacking));
  out->qk_norm = (cohere && r->use_qk_norm == 1) || (layernormed && r->qk_layernorm == 1);
  if (!isnan(r->clip_qkv) && (!(r->clip_qkv > 0) || !isfinite(r->clip_qkv)))
    return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path, "clip_qkv must be null or finite and > 0, got %g",
                         r->clip_qkv);
  out->clip_qkv = isnan(r->clip_qkv) ? 0 : r->clip_qkv;
  const family_facts *facts = facts_of(r->model_type);
  if (facts && isnan(r->theta) && facts->theta > 0) r->theta = facts->theta;
  if (facts && isnan(r->partial) && r->rotary_dim <= 0 && facts->partial > 0) r->partial = facts->partial;
  if (!strcmp(r->model_type, "cohere2")) r->head_dim = UNSET; /* transformers sets hidden / heads whatever is said */
  if (r->hidden < 1 || r->heads < 1)
    return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path,
                         "the config names no hidden size and head count (hidden_size/n_embd/d_model, "
                         "num_attention_heads/n_head/num_heads)");
  out->hidden_size = r->hidden, out->num_heads = r->heads;
  out->num_kv_heads = r->kv_heads > 0 ? r->kv_heads : r->heads;
  if (r->head_dim <= 0 && r->hidden % r->heads)
    return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path, "hidden size %lld does not divide by %lld heads",
                         (long long)r->hidden, (long long)r->heads);
  out->head_dim = r->head_dim > 0 ? r->head_dim : r->hidden / r->heads;
  if (out->num_heads % out->num_kv_heads)
    return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path, "%lld heads do not divide by %lld kv heads",
                         (long long)out->num_heads, (long long)out->num_kv_heads);
  out->num_layers = r->layers > 0 ? r->layers : 0;
  if (out->num_layers > ATTN_HF_MAX_LAYERS)
    return attn__io_fail(j->ctx, ATTN_E_UNSUPPORTED, j->kind, j->path, "%lld layers: more than %d",
                         (long long)out->num_layers, ATTN_HF_MAX_LAYERS);
  out->scale = !isnan(r->qpas) ? (r->qpas > 0 ? 1.0 / sqrt(r->qpas) : NAN)
             : !isnan(r->multiplier) ? r->multiplier
             : !strcmp(r->model_type, "t5") || r->scale_attn_weights == 0 ? 1.0
             : !strncmp(r->model_type, "granite", 7) ? 1.0 /* Granite's attention_multiplier when unsaid */
             : NAN;
  out->scale_inverse_layer = r->scale_inverse_layer == 1;
  out->relative_bias = r->relative_bias == 1;
  if (!isnan(r->qpas) && !(r->qpas > 0))
    return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path, "query_pre_attn_scalar must be > 0");
  out->softcap = !isnan(r->softcap) ? r->softcap : 0;
  if (!(out->softcap >= 0) || !isfinite(out->softcap))
    return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path, "attn_logit_softcapping must be >= 0");
  out->attention_bias = r->attention_bias;
  out->norm_eps = r->eps;
  /* sliding layers */
  const int64_t L = out->num_layers;
  if (r->sliding_window > 0) {
    out->sliding_window = r->sliding_window;
    for (int64_t l = 0; l < L; l++) {
      int s;
      /* without layer_types, each family's rule as transformers applies it */
      const char *t = r->model_type;
      if (r->ntypes > 0) s = l < r->ntypes && r->types[l] == 1;
      else if (!strcmp(t, "gemma2")) s = l % 2 == 0;
      else if (!strcmp(t, "gemma3") || !strcmp(t, "gemma3_text") || !strcmp(t, "cohere2") || !strcmp(t, "exaone4") ||
               !strcmp(t, "olmo3")) {
        if (r->pattern_text)
          return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path,
                               "sliding_window_pattern is a string and there are no layer_types to say which layers slide");
        const int64_t period = !strcmp(t, "olmo3") ? 4 : r->pattern > 0 ? r->pattern : t[0] == 'g' ? 6 : 4;
        s = (l + 1) % period != 0;
      } else if (!strcmp(t, "qwen2") || !strcmp(t, "qwen3")) s = r->use_sliding == 1 && l >= r->max_window_layers;
      else if (!strcmp(t, "qwen2_moe")) s = r->use_sliding == 1 && l % 2 == 0 && l < r->max_window_layers;
      else if (!strcmp(t, "qwen3_moe")) s = r->use_sliding == 1;
      else if (!strcmp(t, "dots1")) s = l >= r->max_window_layers;
      else s = r->use_sliding != 0; /* Mistral and the like: every layer, unless said otherwise */
      out->sliding[l] = (unsigned char)s;
    }
    if (r->ntypes > 0 && r->ntypes != L)
      return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path, "layer_types has %lld entries for %lld layers",
                           (long long)r->ntypes, (long long)L);
  }
  /* RoPE */
  out->rope = r->global.present || r->scaling.present || !isnan(r->theta) || family(r->model_type, rope_families);
  if (out->rope) {
    attn_status st;
    const hf_rope *g = r->global.present ? &r->global : &r->scaling;
    if ((st = rope_opts_of(j, &out->rope_global, g, r, "rope"))) return st;
    if (r->local.present) {
      if ((st = rope_opts_of(j, &out->rope_local, &r->local, r, "sliding_attention"))) return st;
    } else if (!strcmp(r->model_type, "olmo3")) { /* rope_scaling is the full layers' alone */
      attn_rope_opts_init(&out->rope_local);
      out->rope_local.theta = !isnan(r->theta) ? r->theta : 5e5;
    } else {
      out->rope_local = out->rope_global;
      if (!isnan(r->local_base)) { /* Gemma 3: its own base, no scaling, on the sliding layers */
        attn_rope_opts_init(&out->rope_local);
        out->rope_local.theta = r->local_base;
      }
    }
    const double partial = !isnan(g->partial) ? g->partial : r->partial;
    int64_t rd = 0;
    if (r->rotary_dim > 0) rd = r->rotary_dim;
    else if (!isnan(partial)) {
      if (!(partial > 0 && partial <= 1)) /* also keeps the product below in int64_t's range */
        return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path, "partial_rotary_factor %g: want a fraction in (0, 1]",
                             partial);
      rd = (int64_t)((double)out->head_dim * partial);
    }
    if (rd && (rd > out->head_dim || rd % 2 || rd < 2))
      return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path, "rotary dims %lld of head_dim %lld: want even, 2..head_dim",
                           (long long)rd, (long long)out->head_dim);
    out->rope_global.rotary_dim = out->rope_local.rotary_dim = rd == out->head_dim ? 0 : rd;
    const hf_rope *lr[2] = {g, r->local.present ? &r->local : g};
    for (int i = 0; i < 2; i++)
      if ((i ? out->rope_local : out->rope_global).scaling == ATTN_ROPE_LONGROPE &&
          lr[i]->nshort != (rd ? rd : out->head_dim) / 2)
        return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path,
                             "longrope's short_factor and long_factor have %d entries; %lld rotary dims make %lld pairs",
                             lr[i]->nshort, (long long)(rd ? rd : out->head_dim), (long long)((rd ? rd : out->head_dim) / 2));
    if (facts && facts->interleaved) out->rope_global.layout = out->rope_local.layout = ATTN_ROPE_INTERLEAVED;
    /* NoPE layers: SmolLM3's and Llama 4's list, or their default, every interval-th layer (an empty
     * list is Llama 4's default too) */
    if (llama4 && r->nrope == 0) r->nrope = UNSET;
    if (r->nrope >= 0 && L > 0 && r->nrope != L)
      return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path, "no_rope_layers has %lld entries for %lld layers",
                           (long long)r->nrope, (long long)L);
    const int64_t every = r->nope_interval > 0 ? r->nope_interval : 4;
    for (int64_t l = 0; l < (L > 0 ? L : r->nrope); l++)
      out->nope[l] = r->nrope >= 0 ? !r->use_rope[l] : (!strcmp(r->model_type, "smollm3") || llama4) && (l + 1) % every == 0;
    /* Cohere 2 and EXAONE 4 (with a window) rotate their sliding layers only */
    if (!strcmp(r->model_type, "cohere2") || (!strcmp(r->model_type, "exaone4") && out->sliding_window > 0))
      for (int64_t l = 0; l < L; l++) out->nope[l] |= !out->sliding[l];
  }
  /* Llama 4's chunked layers: layer_types' "chunked_attention", or its rule, the RoPE layers */
  int typed_chunks = 0;
  for (int64_t l = 0; l < r->ntypes; l++) typed_chunks |= r->types[l] == 2;
  if ((llama4 && r->chunk == 0) || (typed_chunks && r->chunk <= 0))
    return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path,
                         "%s: attention_chunk_size is %s", typed_chunks ? "layer_types has chunked_attention layers"
                                                                        : "chunked attention",
                         r->chunk == 0 ? "0" : "not given");
  if (r->chunk > 0) {
    if (r->ntypes > 0 && r->ntypes != L)
      return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path, "layer_types has %lld entries for %lld layers",
                           (long long)r->ntypes, (long long)L);
    out->attention_chunk = r->chunk;
    for (int64_t l = 0; l < L; l++) out->chunked[l] = r->ntypes > 0 ? r->types[l] == 2 : out->rope && !out->nope[l];
  }
  return ATTN_OK;
}

attn_status attn_hf_config_parse(attn_ctx *ctx, attn_hf_config *out, const char *json, size_t len, const char *name) {
  ATTN__ENTER(ctx);
  if (!out || (!json && len)) return attn__fail(ctx, ATTN_E_INVALID, "attn_hf_config_parse: null argument");
  const char *path = name ? name : "(buffer)";
  if ((int64_t)len > HF_CONFIG_CAP)
    return attn__io_fail(ctx, ATTN_E_FORMAT, "config", path, "%zu bytes: more than a config's %lld", len,
                         (long long)HF_CONFIG_CAP);
  hf_raw *r = malloc(sizeof *r);
  if (!r) return attn__fail(ctx, ATTN_E_NOMEM, "attn_hf_config_parse: out of memory");
  memset(r, 0, sizeof *r);
  r->hidden = r->heads = r->kv_heads = r->head_dim = r->layers = r->sliding_window = UNSET;
  r->max_window_layers = r->max_pos = r->pattern = r->rotary_dim = r->chunk = UNSET;
  r->theta = r->partial = r->local_base = r->qpas = r->softcap = r->eps = r->multiplier = r->original_max = NAN;
  r->clip_qkv = NAN;
  r->attention_bias = r->use_sliding = r->scale_attn_weights = r->scale_inverse_layer = UNSET;
  r->nrope = r->nope_interval = r->use_qk_norm = r->qk_layernorm = UNSET;
  rope_unset(&r->scaling), rope_unset(&r->global), rope_unset(&r->local);
  const unsigned char *b = (const unsigned char *)json;
  attn__json j = {b, b, b + len, ctx, path, "config", "JSON"};
  if (len >= 3 && b[0] == 0xef && b[1] == 0xbb && b[2] == 0xbf) j.p += 3; /* a UTF-8 byte order mark */
  attn_status st = attn__json_peek(&j) == '{' ? attn__json_each_key(&j, top_key, r, 0) : attn__json_fail(&j, "the config is not a JSON object");
  if (!st && attn__json_peek(&j) != -1) st = attn__json_fail(&j, "characters after the config object");
  if (!st) st = finish(&j, out, r);
  free(r);
  return st;
}

attn_status attn_hf_config_read(attn_ctx *ctx, attn_hf_config *out, const char *path) {
  ATTN__ENTER(ctx);
  if (!out || !path) return attn__fail(ctx, ATTN_E_INVALID, "attn_hf_config_read: null argument");
  unsigned char *buf;
  size_t len;
  attn_status st = attn__read_small_file(ctx, "config", path, HF_CONFIG_CAP, &buf, &len);
  if (st) return st;
  st = attn_hf_config_parse(ctx, out, (const char *)buf, len, path);
  free(buf);
  return st;
}
