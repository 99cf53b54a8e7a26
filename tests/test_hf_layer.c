/* attn_mha_create_from_hf: layer L of a checkpoint written here as the Hub
 * keeps them (config.json and one safetensors file, or shards and their
 * index), with every other layer's tensors beside it as decoys; the options of
 * layer L; and hostile indexes and configs that contradict the tensors. The
 * layers of transformers' own saved models are checked in the conformance
 * suite (python/tests). */
#include "testutil.h"

#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>

static char tdir[512];
static tu_rng rng = {7};

static void path_of(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", tdir, name); }

static void write_text(const char *name, const char *text) {
  char p[700];
  path_of(p, sizeof p, name);
  FILE *f = fopen(p, "wb");
  if (!f) {
    CHECK(0, "cannot write %s", p);
    return;
  }
  fputs(text, f);
  fclose(f);
}

/* A set of named f32 tensors filled with distinct random values. */
#define MAX_T 64
typedef struct {
  int n;
  char name[MAX_T][96];
  attn_tensor t[MAX_T];
} tset;

static attn_tensor *add(attn_ctx *ctx, tset *s, const char *name, int rank, int64_t d0, int64_t d1) {
  const int64_t shape[2] = {d0, d1};
  snprintf(s->name[s->n], sizeof s->name[0], "%s", name);
  attn_tensor *t = &s->t[s->n++];
  CHECK_OK(ctx, attn_tensor_alloc(ctx, t, ATTN_F32, rank, shape));
  float *p = t->data;
  for (int64_t i = 0; i < attn_tensor_numel(t); i++) p[i] = (float)tu_uniform(&rng);
  return t;
}

static const attn_tensor *find(const tset *s, const char *name) {
  for (int i = 0; i < s->n; i++)
    if (!strcmp(s->name[i], name)) return &s->t[i];
  return NULL;
}

/* Writes the tensors whose index has bit (i % 2) in mask set ... or all (which < 0), to file. */
static void write_set(attn_ctx *ctx, const tset *s, const char *file, const int *pick, int want) {
  const char *names[MAX_T];
  attn_tensor ts[MAX_T];
  int n = 0;
  for (int i = 0; i < s->n; i++)
    if (!pick || pick[i] == want) names[n] = s->name[i], ts[n] = s->t[i], n++;
  char p[700];
  path_of(p, sizeof p, file);
  CHECK_OK(ctx, attn_safetensors_write(ctx, p, n, names, ts));
}

static void free_set(tset *s) {
  for (int i = 0; i < s->n; i++) attn_tensor_free(&s->t[i]);
  s->n = 0;
}

/* Llama-style tensors of layers 0..L-1 (E, H, Hk, D; optional biases and
 * q_norm/k_norm [D]), and decoys outside the attention. */
static void llama_tensors(attn_ctx *ctx, tset *s, int L, int64_t E, int64_t H, int64_t Hk, int64_t D, int bias,
                          int qk_norm) {
  add(ctx, s, "model.embed_tokens.weight", 2, 11, E);
  for (int l = 0; l < L; l++) {
    char n[96];
    static const char *const proj[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
    for (int p = 0; p < 4; p++) {
      const int64_t rows = p == 0 ? H * D : p == 3 ? E : Hk * D, cols = p == 3 ? H * D : E;
      snprintf(n, sizeof n, "model.layers.%d.self_attn.%s.weight", l, proj[p]);
      add(ctx, s, n, 2, rows, cols);
      if (bias && p < 3) {
        snprintf(n, sizeof n, "model.layers.%d.self_attn.%s.bias", l, proj[p]);
        add(ctx, s, n, 1, rows, 0);
      }
    }
    if (qk_norm) {
      snprintf(n, sizeof n, "model.layers.%d.self_attn.q_norm.weight", l);
      add(ctx, s, n, 1, D, 0);
      snprintf(n, sizeof n, "model.layers.%d.self_attn.k_norm.weight", l);
      add(ctx, s, n, 1, D, 0);
    }
    snprintf(n, sizeof n, "model.layers.%d.mlp.up_proj.weight", l);
    add(ctx, s, n, 2, 2 * E, E);
  }
}

/* Every parameter of m equals the file's tensor of layer l, bitwise. */
static void check_params(attn_ctx *ctx, attn_mha *m, const tset *s, int l, int bias, int qk_norm, const char *what) {
  static const struct {
    attn_mha_param p;
    const char *name;
  } map[] = {{ATTN_MHA_Q_WEIGHT, "q_proj.weight"}, {ATTN_MHA_K_WEIGHT, "k_proj.weight"},
             {ATTN_MHA_V_WEIGHT, "v_proj.weight"}, {ATTN_MHA_O_WEIGHT, "o_proj.weight"},
             {ATTN_MHA_Q_BIAS, "q_proj.bias"},     {ATTN_MHA_K_BIAS, "k_proj.bias"},
             {ATTN_MHA_V_BIAS, "v_proj.bias"},     {ATTN_MHA_Q_NORM_WEIGHT, "q_norm.weight"},
             {ATTN_MHA_K_NORM_WEIGHT, "k_norm.weight"}};
  for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
    const int is_bias = map[i].p == ATTN_MHA_Q_BIAS || map[i].p == ATTN_MHA_K_BIAS || map[i].p == ATTN_MHA_V_BIAS;
    const int is_norm = map[i].p == ATTN_MHA_Q_NORM_WEIGHT || map[i].p == ATTN_MHA_K_NORM_WEIGHT;
    if ((is_bias && !bias) || (is_norm && !qk_norm)) continue;
    char n[96];
    snprintf(n, sizeof n, "model.layers.%d.self_attn.%s", l, map[i].name);
    const attn_tensor *want = find(s, n);
    attn_tensor got;
    CHECK_OK(ctx, attn_mha_param_view(ctx, &got, m, map[i].p));
    if (!want || attn_tensor_numel(&got) != attn_tensor_numel(want)) {
      CHECK(0, "%s: %s has %lld elements", what, n, (long long)attn_tensor_numel(&got));
      continue;
    }
    CHECK(!memcmp(got.data, want->data, (size_t)attn_tensor_numel(want) * sizeof(float)), "%s: %s loaded as saved", what,
          n);
  }
  attn_tensor ob;
  CHECK(attn_mha_param_view(ctx, &ob, m, ATTN_MHA_O_BIAS) == ATTN_E_NOT_FOUND, "%s: no o bias", what);
}

static attn_status load(attn_ctx *ctx, attn_mha **m, attn_hf_layer *info, const char *config, const char *weights,
                        int64_t layer) {
  char c[700], w[700];
  path_of(c, sizeof c, config);
  path_of(w, sizeof w, weights);
  return attn_mha_create_from_hf(ctx, m, info, c, w, layer);
}

static void expect_fail(attn_ctx *ctx, const char *config, const char *weights, int64_t layer, attn_status want,
                        const char *needle, int line) {
  attn_mha *m = (attn_mha *)&m; /* poisoned: must come back NULL */
  attn_hf_layer info;
  const attn_status st = load(ctx, &m, &info, config, weights, layer);
  CHECK(st == want, "line %d: status %d, want %d (%s)", line, (int)st, (int)want, attn_ctx_error(ctx));
  CHECK(m == NULL, "line %d: no layer on failure", line);
  if (needle)
    CHECK(strstr(attn_ctx_error(ctx), needle) != NULL, "line %d: message '%s' lacks '%s'", line, attn_ctx_error(ctx),
          needle);
}

static void test_llama_single_and_sharded(attn_ctx *ctx) {
  const int64_t E = 32, H = 4, Hk = 2, D = 8;
  tset s = {0};
  llama_tensors(ctx, &s, 3, E, H, Hk, D, 0, 0);
  write_text("llama.json", "{\"model_type\": \"llama\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                           " \"num_key_value_heads\": 2, \"num_hidden_layers\": 3, \"rope_theta\": 50000.0,"
                           " \"max_position_embeddings\": 64, \"attention_bias\": false, \"rms_norm_eps\": 1e-5}");
  write_set(ctx, &s, "llama.safetensors", NULL, 0);
  for (int l = 0; l < 3; l++) {
    attn_mha *m = NULL;
    attn_hf_layer info;
    memset(&info, 0xcd, sizeof info);
    CHECK_OK(ctx, load(ctx, &m, &info, "llama.json", "llama.safetensors", l));
    if (!m) continue;
    char want_prefix[64];
    snprintf(want_prefix, sizeof want_prefix, "model.layers.%d.self_attn.", l);
    CHECK(info.naming == ATTN_MHA_NAMING_LLAMA && !strcmp(info.prefix, want_prefix) && info.layer == l,
          "layer %d found under '%s'", l, info.prefix);
    const attn_mha_config *c = attn_mha_get_config(m);
    CHECK(c->embed_dim == E && c->num_heads == H && c->num_kv_heads == Hk && !c->bias && !c->qk_norm, "llama: shape");
    CHECK(info.has_rope && info.rope.theta == 50000 && info.window == 0 && info.softcap == 0 && isnan(info.scale),
          "llama: options");
    check_params(ctx, m, &s, l, 0, 0, "llama single file");
    attn_mha_opts o;
    attn_mha_opts_init(&o);
    attn_hf_layer_opts(&info, &o);
    CHECK(o.rope == &info.rope && isnan(o.attn.scale) && o.attn.window == 0, "llama: opts");
    attn_mha_destroy(m);
  }

  /* Sharded: layer 1's q and k in one shard, v and o in the other (a layer
   * straddling two files, as the Hub's shards do); layer 0 and 2 elsewhere. */
  int pick[MAX_T];
  for (int i = 0; i < s.n; i++) {
    const char *n = s.name[i];
    pick[i] = strstr(n, "layers.1.") ? (strstr(n, "v_proj") || strstr(n, "o_proj")) : strstr(n, "layers.2.") != NULL;
  }
  write_set(ctx, &s, "model-00001-of-00002.safetensors", pick, 0);
  write_set(ctx, &s, "model-00002-of-00002.safetensors", pick, 1);
  char idx[8192];
  int off = snprintf(idx, sizeof idx, "{\"metadata\": {\"total_size\": 1234}, \"weight_map\": {");
  for (int i = 0; i < s.n; i++)
    off += snprintf(idx + off, sizeof idx - (size_t)off, "%s\"%s\": \"model-0000%d-of-00002.safetensors\"", i ? ", " : "",
                    s.name[i], pick[i] + 1);
  snprintf(idx + off, sizeof idx - (size_t)off, "}}");
  write_text("model.safetensors.index.json", idx);
  for (int l = 0; l < 3; l++) {
    attn_mha *m = NULL;
    attn_hf_layer info;
    CHECK_OK(ctx, load(ctx, &m, &info, "llama.json", "model.safetensors.index.json", l));
    if (!m) continue;
    check_params(ctx, m, &s, l, 0, 0, "llama sharded");
    CHECK(strstr(info.weights_file, l == 2 ? "00002" : "00001") != NULL, "layer %d read from %s", l, info.weights_file);
    attn_mha_destroy(m);
  }

  /* hostile or broken indexes */
  write_text("bad1.index.json", "{\"weight_map\": {\"model.layers.0.self_attn.q_proj.weight\": \"../x.safetensors\"}}");
  expect_fail(ctx, "llama.json", "bad1.index.json", 0, ATTN_E_FORMAT, "not a file name", __LINE__);
  write_text("bad2.index.json", "{\"weight_map\": {\"model.layers.0.self_attn.q_proj.weight\": \"/etc/passwd\"}}");
  expect_fail(ctx, "llama.json", "bad2.index.json", 0, ATTN_E_FORMAT, "not a file name", __LINE__);
  write_text("bad3.index.json", "{\"metadata\": {}}");
  expect_fail(ctx, "llama.json", "bad3.index.json", 0, ATTN_E_FORMAT, "weight_map", __LINE__);
  write_text("bad4.index.json", "[1, 2]");
  expect_fail(ctx, "llama.json", "bad4.index.json", 0, ATTN_E_FORMAT, "not a JSON object", __LINE__);
  write_text("bad5.index.json", "{\"weight_map\": {\"model.layers.0.self_attn.q_proj.weight\": 7}}");
  expect_fail(ctx, "llama.json", "bad5.index.json", 0, ATTN_E_FORMAT, NULL, __LINE__);
  write_text("bad6.index.json", "{\"weight_map\": {\"model.layers.0.self_attn.q_proj.weight\": \"missing.safetensors\"}}");
  expect_fail(ctx, "llama.json", "bad6.index.json", 0, ATTN_E_IO, "missing.safetensors", __LINE__);
  write_text("bad7.index.json", "{\"weight_map\": {\"x\": \"a.safetensors\"}, \"weight_map\"");
  expect_fail(ctx, "llama.json", "bad7.index.json", 0, ATTN_E_FORMAT, NULL, __LINE__);
  /* an index that does not list layer 1 */
  write_text("bad8.index.json", "{\"weight_map\": {\"model.embed_tokens.weight\": \"model-00001-of-00002.safetensors\"}}");
  expect_fail(ctx, "llama.json", "bad8.index.json", 1, ATTN_E_NOT_FOUND, "layer 1", __LINE__);

  /* configs that contradict the tensors, or ask for a layer that is not there */
  expect_fail(ctx, "llama.json", "llama.safetensors", 3, ATTN_E_INVALID, "3 layers", __LINE__);
  expect_fail(ctx, "llama.json", "llama.safetensors", -1, ATTN_E_INVALID, NULL, __LINE__);
  write_text("llama_bias.json", "{\"model_type\": \"llama\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                                " \"num_key_value_heads\": 2, \"num_hidden_layers\": 3, \"attention_bias\": true}");
  expect_fail(ctx, "llama_bias.json", "llama.safetensors", 0, ATTN_E_SHAPE, "attention_bias", __LINE__);
  write_text("llama_e.json", "{\"model_type\": \"llama\", \"hidden_size\": 64, \"num_attention_heads\": 4,"
                             " \"num_key_value_heads\": 2, \"num_hidden_layers\": 3, \"head_dim\": 8}");
  expect_fail(ctx, "llama_e.json", "llama.safetensors", 0, ATTN_E_SHAPE, "hidden_size", __LINE__);
  write_text("llama_kv.json", "{\"model_type\": \"llama\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                              " \"num_key_value_heads\": 4, \"num_hidden_layers\": 3}");
  expect_fail(ctx, "llama_kv.json", "llama.safetensors", 0, ATTN_E_SHAPE, NULL, __LINE__);
  write_text("qwen3_claim.json", "{\"model_type\": \"qwen3\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                                 " \"num_key_value_heads\": 2, \"num_hidden_layers\": 3, \"head_dim\": 8}");
  expect_fail(ctx, "qwen3_claim.json", "llama.safetensors", 0, ATTN_E_SHAPE, "q_norm", __LINE__);
  write_text("longrope.json", "{\"model_type\": \"phi3\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                              " \"num_hidden_layers\": 3, \"rope_scaling\": {\"type\": \"longrope\"}}");
  expect_fail(ctx, "longrope.json", "llama.safetensors", 0, ATTN_E_FORMAT, "short_factor and long_factor", __LINE__);
  expect_fail(ctx, "llama.json", "nowhere.safetensors", 0, ATTN_E_IO, NULL, __LINE__);
  /* SmolLM3: a layer without RoPE */
  write_text("smollm3.json", "{\"model_type\": \"smollm3\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                             " \"num_key_value_heads\": 2, \"num_hidden_layers\": 3, \"rope_theta\": 5000000.0,"
                             " \"no_rope_layers\": [1, 0, 1]}");
  for (int l = 0; l < 3; l++) {
    attn_mha *m = NULL;
    attn_hf_layer info;
    CHECK_OK(ctx, load(ctx, &m, &info, "smollm3.json", "llama.safetensors", l));
    attn_mha_opts o;
    attn_mha_opts_init(&o);
    attn_hf_layer_opts(&info, &o);
    CHECK(info.has_rope == (l != 1) && (o.rope != NULL) == (l != 1), "smollm3 layer %d: RoPE %d", l, info.has_rope);
    attn_mha_destroy(m);
  }
  free_set(&s);
}

/* Qwen3: head_dim apart from E / H, QK-norm per head; Gemma 3: 1 + weight. */
static void test_qk_norm_families(attn_ctx *ctx) {
  const int64_t E = 32, H = 4, Hk = 2, D = 16;
  tset s = {0};
  llama_tensors(ctx, &s, 2, E, H, Hk, D, 0, 1);
  write_set(ctx, &s, "qwen3.safetensors", NULL, 0);
  write_text("qwen3.json", "{\"model_type\": \"qwen3\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                           " \"num_key_value_heads\": 2, \"head_dim\": 16, \"num_hidden_layers\": 2,"
                           " \"rms_norm_eps\": 1e-5, \"rope_theta\": 1000000.0, \"attention_bias\": false}");
  write_text("gemma3.json", "{\"model_type\": \"gemma3_text\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                            " \"num_key_value_heads\": 2, \"head_dim\": 16, \"num_hidden_layers\": 2,"
                            " \"rms_norm_eps\": 1e-6, \"query_pre_attn_scalar\": 64, \"sliding_window\": 8,"
                            " \"layer_types\": [\"sliding_attention\", \"full_attention\"],"
                            " \"rope_theta\": 1000000.0, \"rope_local_base_freq\": 10000.0}");
  for (int g = 0; g < 2; g++)
    for (int l = 0; l < 2; l++) {
      attn_mha *m = NULL;
      attn_hf_layer info;
      CHECK_OK(ctx, load(ctx, &m, &info, g ? "gemma3.json" : "qwen3.json", "qwen3.safetensors", l));
      if (!m) continue;
      const attn_mha_config *c = attn_mha_get_config(m);
      CHECK(c->head_dim == D && c->qk_norm == ATTN_QK_NORM_PER_HEAD &&
                c->qk_norm_kind == (g ? ATTN_NORM_RMS_PLUS_ONE : ATTN_NORM_RMS) && c->qk_norm_eps == (g ? 1e-6 : 1e-5),
            "%s layer %d: head_dim %lld, qk-norm %d kind %d eps %g", g ? "gemma3" : "qwen3", l, (long long)c->head_dim,
            c->qk_norm, (int)c->qk_norm_kind, c->qk_norm_eps);
      check_params(ctx, m, &s, l, 0, 1, g ? "gemma3" : "qwen3");
      if (g) {
        CHECK(info.scale == 0.125 && info.window == (l == 0 ? 8 : 0) &&
                  info.rope.theta == (l == 0 ? 10000.0 : 1000000.0),
              "gemma3 layer %d: scale %g, window %lld, theta %g", l, info.scale, (long long)info.window, info.rope.theta);
      } else {
        CHECK(isnan(info.scale) && info.window == 0 && info.rope.theta == 1e6, "qwen3 options");
      }
      attn_mha_destroy(m);
    }
  free_set(&s);
}

/* GPT-2: the fused Conv1D c_attn; scale_attn_by_inverse_layer_idx divides layer L's scale by L + 1. */
static void test_gpt2(attn_ctx *ctx) {
  const int64_t E = 16;
  tset s = {0};
  for (int l = 0; l < 2; l++) {
    char n[96];
    snprintf(n, sizeof n, "h.%d.attn.c_attn.weight", l);
    add(ctx, &s, n, 2, E, 3 * E);
    snprintf(n, sizeof n, "h.%d.attn.c_attn.bias", l);
    add(ctx, &s, n, 1, 3 * E, 0);
    snprintf(n, sizeof n, "h.%d.attn.c_proj.weight", l);
    add(ctx, &s, n, 2, E, E);
    snprintf(n, sizeof n, "h.%d.attn.c_proj.bias", l);
    add(ctx, &s, n, 1, E, 0);
  }
  write_set(ctx, &s, "gpt2.safetensors", NULL, 0);
  write_text("gpt2.json", "{\"model_type\": \"gpt2\", \"n_embd\": 16, \"n_head\": 2, \"n_layer\": 2,"
                          " \"scale_attn_by_inverse_layer_idx\": true, \"layer_norm_epsilon\": 1e-05}");
  attn_mha *m = NULL;
  attn_hf_layer info;
  CHECK_OK(ctx, load(ctx, &m, &info, "gpt2.json", "gpt2.safetensors", 1));
  if (m) {
    CHECK(info.naming == ATTN_MHA_NAMING_GPT2 && !strcmp(info.prefix, "h.1.attn.") && !info.has_rope,
          "gpt2: found under '%s'", info.prefix);
    CHECK(fabs(info.scale - 1.0 / sqrt(8.0) / 2.0) < 1e-15, "gpt2 layer 1 scale %g", info.scale);
    /* W_k[o][i] = c_attn.weight[i][E + o] */
    const attn_tensor *ca = find(&s, "h.1.attn.c_attn.weight");
    attn_tensor wk;
    CHECK_OK(ctx, attn_mha_param_view(ctx, &wk, m, ATTN_MHA_K_WEIGHT));
    int same = 1;
    for (int64_t o = 0; o < E; o++)
      for (int64_t i = 0; i < E; i++)
        same &= ((const float *)wk.data)[o * E + i] == ((const float *)ca->data)[i * 3 * E + E + o];
    CHECK(same, "gpt2: k weight is c_attn's middle columns, transposed");
    attn_mha_destroy(m);
  }
  /* a caller built against 0.2's attn.h: its attn_mha_names had no SINKS entry (conv1d sat one slot earlier) */
  struct {
    size_t size;
    const char *name[ATTN_MHA_SINKS];
    int conv1d;
  } old = {sizeof old, {"c_attn.weight", "c_attn.bias", "c_attn.weight", "c_attn.bias", "c_attn.weight",
                        "c_attn.bias", "c_proj.weight", "c_proj.bias"}, 1};
  char gp[700];
  path_of(gp, sizeof gp, "gpt2.safetensors");
  attn_safetensors *st = NULL;
  CHECK_OK(ctx, attn_safetensors_open(ctx, &st, gp));
  attn_mha_config like;
  attn_mha_config_init(&like, 0, 2);
  attn_mha *m02 = NULL, *mnow = NULL;
  CHECK_OK(ctx, attn_mha_create_from_tensors(ctx, &m02, st, "h.1.attn.", (const attn_mha_names *)(void *)&old, &like));
  CHECK_OK(ctx, attn_mha_create_from_tensors(ctx, &mnow, st, "h.1.attn.", NULL, &like));
  if (m02 && mnow) {
    attn_tensor a, b;
    CHECK_OK(ctx, attn_mha_param_view(ctx, &a, m02, ATTN_MHA_K_WEIGHT));
    CHECK_OK(ctx, attn_mha_param_view(ctx, &b, mnow, ATTN_MHA_K_WEIGHT));
    CHECK(!memcmp(a.data, b.data, sizeof(float) * (size_t)(E * E)) && !attn_mha_get_config(m02)->sinks,
          "0.2's attn_mha_names: conv1d read where it was written");
  }
  attn_mha_destroy(m02);
  attn_mha_destroy(mnow);
  attn_safetensors_close(st);
  write_text("gpt2_noscale.json", "{\"model_type\": \"gpt2\", \"n_embd\": 16, \"n_head\": 2, \"n_layer\": 2,"
                                  " \"scale_attn_weights\": false}");
  CHECK_OK(ctx, load(ctx, &m, &info, "gpt2_noscale.json", "gpt2.safetensors", 0));
  CHECK(info.scale == 1.0, "gpt2 scale_attn_weights false: scale 1");
  attn_mha_destroy(m);
  free_set(&s);
}

/* gpt-oss, its config as the Hub keeps it (rope_scaling, its MoE's
 * quantization_config): learned sinks (self_attn.sinks [H]) loaded as a
 * parameter, every projection with a bias, sliding and full layers by
 * layer_types, YaRN with truncate false. A gpt_oss config without sinks tensors, and sinks of the
 * wrong shape, are refused. */
static void test_gpt_oss(attn_ctx *ctx) {
  const int64_t E = 32, H = 4, Hk = 2, D = 16;
  tset s = {0};
  llama_tensors(ctx, &s, 2, E, H, Hk, D, 1, 0);
  write_set(ctx, &s, "gpt_oss_nosinks.safetensors", NULL, 0);
  for (int l = 0; l < 2; l++) {
    char n[96];
    snprintf(n, sizeof n, "model.layers.%d.self_attn.o_proj.bias", l);
    add(ctx, &s, n, 1, E, 0);
    snprintf(n, sizeof n, "model.layers.%d.self_attn.sinks", l);
    add(ctx, &s, n, 1, H, 0);
  }
  write_set(ctx, &s, "gpt_oss.safetensors", NULL, 0);
  write_text("gpt_oss.json",
             "{\"model_type\": \"gpt_oss\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
             " \"num_key_value_heads\": 2, \"head_dim\": 16, \"num_hidden_layers\": 2, \"attention_bias\": true,"
             " \"sliding_window\": 8, \"layer_types\": [\"sliding_attention\", \"full_attention\"],"
             " \"max_position_embeddings\": 131072, \"rope_theta\": 150000, \"rope_scaling\": {\"beta_fast\": 32.0,"
             " \"beta_slow\": 1.0, \"factor\": 32.0, \"original_max_position_embeddings\": 4096, \"rope_type\": \"yarn\","
             " \"truncate\": false}, \"quantization_config\": {\"quant_method\": \"mxfp4\"}}");
  for (int l = 0; l < 2; l++) {
    attn_mha *m = NULL;
    attn_hf_layer info;
    CHECK_OK(ctx, load(ctx, &m, &info, "gpt_oss.json", "gpt_oss.safetensors", l));
    if (!m) continue;
    const attn_mha_config *c = attn_mha_get_config(m);
    CHECK(c->sinks == 1 && c->bias && c->out_bias && c->head_dim == D && c->num_kv_heads == Hk, "gpt_oss: shape");
    CHECK(info.window == (l == 0 ? 8 : 0) && isnan(info.scale) && info.has_rope &&
              info.rope.scaling == ATTN_ROPE_YARN && info.rope.yarn_truncate == 0 && info.rope.factor == 32 &&
              info.rope.original_max_position == 4096 && info.rope.theta == 150000,
          "gpt_oss layer %d: window %lld, rope scaling %d truncate %d", l, (long long)info.window,
          (int)info.rope.scaling, info.rope.yarn_truncate);
    static const struct {
      attn_mha_param p;
      const char *name;
    } map[] = {{ATTN_MHA_SINKS, "sinks"}, {ATTN_MHA_O_BIAS, "o_proj.bias"}, {ATTN_MHA_Q_WEIGHT, "q_proj.weight"}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
      char n[96];
      snprintf(n, sizeof n, "model.layers.%d.self_attn.%s", l, map[i].name);
      const attn_tensor *want = find(&s, n);
      attn_tensor got;
      CHECK_OK(ctx, attn_mha_param_view(ctx, &got, m, map[i].p));
      CHECK(want && attn_tensor_numel(&got) == attn_tensor_numel(want) &&
                !memcmp(got.data, want->data, sizeof(float) * (size_t)attn_tensor_numel(want)),
            "gpt_oss layer %d: %s loaded as saved", l, n);
    }
    attn_mha_destroy(m);
  }
  write_text("gpt_oss_bias_o.json", "{\"model_type\": \"gpt_oss\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                                    " \"num_key_value_heads\": 2, \"head_dim\": 16, \"num_hidden_layers\": 2}");
  expect_fail(ctx, "gpt_oss_bias_o.json", "gpt_oss_nosinks.safetensors", 1, ATTN_E_SHAPE, "sinks", __LINE__);
  /* sinks of another length, or not a vector */
  free_set(&s);
  llama_tensors(ctx, &s, 1, E, H, Hk, D, 1, 0);
  add(ctx, &s, "model.layers.0.self_attn.sinks", 1, H + 1, 0);
  write_set(ctx, &s, "gpt_oss_bad.safetensors", NULL, 0);
  expect_fail(ctx, "gpt_oss_bias_o.json", "gpt_oss_bad.safetensors", 0, ATTN_E_SHAPE, "one per query head", __LINE__);
  free_set(&s);
  llama_tensors(ctx, &s, 1, E, H, Hk, D, 1, 0);
  add(ctx, &s, "model.layers.0.self_attn.sinks", 2, H, 1);
  write_set(ctx, &s, "gpt_oss_bad2.safetensors", NULL, 0);
  expect_fail(ctx, "gpt_oss_bias_o.json", "gpt_oss_bad2.safetensors", 0, ATTN_E_SHAPE, "vector", __LINE__);
  free_set(&s);
}

/* Phi-3 as the Hub keeps it: q, k and v packed in qkv_proj (GQA), longrope
 * with its factor lists and a top-level original_max_position_embeddings,
 * partial rotary. Factor lists of the wrong length, and PhiMoE's mscales, are
 * refused. */
static void test_phi3(attn_ctx *ctx) {
  const int64_t E = 32, H = 4, Hk = 2, D = 8;
  tset s = {0};
  add(ctx, &s, "model.embed_tokens.weight", 2, 11, E);
  for (int l = 0; l < 2; l++) {
    char n[96];
    snprintf(n, sizeof n, "model.layers.%d.self_attn.qkv_proj.weight", l);
    add(ctx, &s, n, 2, (H + 2 * Hk) * D, E);
    snprintf(n, sizeof n, "model.layers.%d.self_attn.o_proj.weight", l);
    add(ctx, &s, n, 2, E, H * D);
  }
  write_set(ctx, &s, "phi3.safetensors", NULL, 0);
  /* partial_rotary_factor 0.5 of head_dim 8: 4 rotary dims, 2 pairs */
  write_text("phi3.json", "{\"model_type\": \"phi3\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                          " \"num_key_value_heads\": 2, \"num_hidden_layers\": 2, \"partial_rotary_factor\": 0.5,"
                          " \"max_position_embeddings\": 131072, \"original_max_position_embeddings\": 4096,"
                          " \"rope_theta\": 10000.0, \"sliding_window\": 262144, \"rope_scaling\": {\"type\": \"longrope\","
                          " \"short_factor\": [1.0, 1.5], \"long_factor\": [3.0, 40.5]}}");
  attn_mha *m = NULL;
  attn_hf_layer info;
  CHECK_OK(ctx, load(ctx, &m, &info, "phi3.json", "phi3.safetensors", 1));
  if (m) {
    const attn_mha_config *c = attn_mha_get_config(m);
    CHECK(info.naming == ATTN_MHA_NAMING_PHI3 && c->num_kv_heads == Hk && c->head_dim == D && !c->bias &&
              !c->out_bias, "phi3: naming %d, shape", (int)info.naming);
    const attn_rope_opts *r = &info.rope;
    CHECK(info.has_rope && r->scaling == ATTN_ROPE_LONGROPE && r->rotary_dim == 4 && r->original_max_position == 4096 &&
              r->factor == 32 && r->short_factor[1] == 1.5 && r->long_factor[1] == 40.5 && isnan(r->attention_factor),
          "phi3: longrope read (scaling %d, rotary %lld, P %lld, factor %g)", (int)r->scaling, (long long)r->rotary_dim,
          (long long)r->original_max_position, r->factor);
    /* W_k = qkv_proj's rows H*D .. H*D + Hk*D */
    const attn_tensor *qkv = find(&s, "model.layers.1.self_attn.qkv_proj.weight");
    attn_tensor wk;
    CHECK_OK(ctx, attn_mha_param_view(ctx, &wk, m, ATTN_MHA_K_WEIGHT));
    CHECK(!memcmp(wk.data, (const float *)qkv->data + H * D * E, sizeof(float) * (size_t)(Hk * D * E)),
          "phi3: k weight is qkv_proj's middle rows");
    attn_mha_destroy(m);
  }
  write_text("phi3_bad.json", "{\"model_type\": \"phi3\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                              " \"num_key_value_heads\": 2, \"num_hidden_layers\": 2, \"partial_rotary_factor\": 0.5,"
                              " \"original_max_position_embeddings\": 4096, \"rope_scaling\": {\"type\": \"longrope\","
                              " \"short_factor\": [1.0, 1.5, 2.0], \"long_factor\": [3.0, 4.0, 5.0]}}");
  expect_fail(ctx, "phi3_bad.json", "phi3.safetensors", 0, ATTN_E_FORMAT, "2 pairs", __LINE__);
  write_text("phi3_bad2.json", "{\"model_type\": \"phi3\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                               " \"num_hidden_layers\": 2, \"rope_scaling\": {\"type\": \"longrope\","
                               " \"short_factor\": [1.0, 1.5], \"long_factor\": [3.0]}}");
  expect_fail(ctx, "phi3_bad2.json", "phi3.safetensors", 0, ATTN_E_FORMAT, "one length", __LINE__);
  write_text("phi3_bad3.json", "{\"model_type\": \"phi3\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                               " \"num_hidden_layers\": 2, \"rope_scaling\": {\"type\": \"longrope\","
                               " \"short_factor\": [1.0, -1.5], \"long_factor\": [3.0, 4.0]}}");
  expect_fail(ctx, "phi3_bad3.json", "phi3.safetensors", 0, ATTN_E_FORMAT, "finite and > 0", __LINE__);
  write_text("phimoe.json", "{\"model_type\": \"phimoe\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                            " \"num_hidden_layers\": 2, \"rope_scaling\": {\"type\": \"longrope\", \"long_mscale\": 1.2,"
                            " \"short_factor\": [1.0, 1.5], \"long_factor\": [3.0, 4.0]}}");
  expect_fail(ctx, "phimoe.json", "phi3.safetensors", 0, ATTN_E_UNSUPPORTED, "long_mscale", __LINE__);
  free_set(&s);
}

/* Phi-1/1.5/2 as saved: q/k/v_proj beside dense (not Llama's o_proj), every
 * projection biased, and with qk_layernorm a LayerNorm with biases over each
 * head's D features, shared by the heads (q_layernorm, k_layernorm). A Llama
 * file (q_proj with o_proj) is still Llama's; with qk_layernorm said and the
 * norms missing, the layer is refused rather than loaded unnormed. */
/* OLMo's clip_qkv: read from config.json into the layer (the file cannot tell it); null is none. */
static void test_olmo_clip(attn_ctx *ctx) {
  tset s = {0};
  const char *lin[4] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  for (int i = 0; i < 4; i++) {
    char n[96];
    snprintf(n, sizeof n, "model.layers.0.self_attn.%s.weight", lin[i]);
    add(ctx, &s, n, 2, 32, 32);
  }
  write_set(ctx, &s, "olmo.safetensors", NULL, 0);
  static const struct { const char *said; double clip; } cases[] = {{"8.0", 8.0}, {"null", 0}};
  for (int i = 0; i < 2; i++) {
    char json[192];
    snprintf(json, sizeof json, "{\"model_type\": \"olmo\", \"hidden_size\": 32, \"num_attention_heads\": 4, "
             "\"num_hidden_layers\": 1, \"clip_qkv\": %s}", cases[i].said);
    write_text("olmo.json", json);
    attn_mha *m = NULL;
    attn_hf_layer info;
    CHECK_OK(ctx, load(ctx, &m, &info, "olmo.json", "olmo.safetensors", 0));
    if (m)
      CHECK(attn_mha_get_config(m)->clip_qkv == cases[i].clip && !attn_mha_get_config(m)->bias,
            "olmo: clip_qkv %s read as %g", cases[i].said, attn_mha_get_config(m)->clip_qkv);
    attn_mha_destroy(m);
  }
  free_set(&s);
}

static void test_phi(attn_ctx *ctx) {
  const int64_t E = 32, D = 8; /* 4 heads */
  tset s = {0};
  const char *lin[4] = {"q_proj", "k_proj", "v_proj", "dense"};
  for (int i = 0; i < 4; i++) {
    char n[96];
    snprintf(n, sizeof n, "model.layers.0.self_attn.%s.weight", lin[i]);
    add(ctx, &s, n, 2, E, E);
    snprintf(n, sizeof n, "model.layers.0.self_attn.%s.bias", lin[i]);
    add(ctx, &s, n, 1, E, 0);
  }
  write_set(ctx, &s, "phi_plain.safetensors", NULL, 0);
  const char *norms[4] = {"q_layernorm.weight", "q_layernorm.bias", "k_layernorm.weight", "k_layernorm.bias"};
  for (int i = 0; i < 4; i++) {
    char n[96];
    snprintf(n, sizeof n, "model.layers.0.self_attn.%s", norms[i]);
    add(ctx, &s, n, 1, D, 0);
  }
  write_set(ctx, &s, "phi_qkln.safetensors", NULL, 0);
  write_text("phi_qkln.json", "{\"model_type\": \"phi\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                              " \"num_hidden_layers\": 1, \"layer_norm_eps\": 1e-5, \"qk_layernorm\": true}");
  write_text("phi_plain.json", "{\"model_type\": \"phi\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                               " \"num_hidden_layers\": 1, \"layer_norm_eps\": 1e-5}");
  attn_mha *m = NULL;
  attn_hf_layer info;
  CHECK_OK(ctx, load(ctx, &m, &info, "phi_qkln.json", "phi_qkln.safetensors", 0));
  if (m) {
    const attn_mha_config *c = attn_mha_get_config(m);
    CHECK(info.naming == ATTN_MHA_NAMING_PHI && c->bias && c->out_bias && c->qk_norm == ATTN_QK_NORM_PER_HEAD &&
              c->qk_norm_kind == ATTN_NORM_LAYER && c->qk_norm_eps == 1e-5 && info.rope.rotary_dim == D / 2,
          "phi: naming %d, qk_norm %d kind %d eps %g, rotary %lld", (int)info.naming, c->qk_norm, (int)c->qk_norm_kind,
          c->qk_norm_eps, (long long)info.rope.rotary_dim);
    static const struct { attn_mha_param p; const char *name; } map[] = {
        {ATTN_MHA_O_WEIGHT, "dense.weight"},           {ATTN_MHA_O_BIAS, "dense.bias"},
        {ATTN_MHA_Q_NORM_WEIGHT, "q_layernorm.weight"}, {ATTN_MHA_Q_NORM_BIAS, "q_layernorm.bias"},
        {ATTN_MHA_K_NORM_WEIGHT, "k_layernorm.weight"}, {ATTN_MHA_K_NORM_BIAS, "k_layernorm.bias"}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
      char n[96];
      snprintf(n, sizeof n, "model.layers.0.self_attn.%s", map[i].name);
      const attn_tensor *want = find(&s, n);
      attn_tensor got;
      CHECK_OK(ctx, attn_mha_param_view(ctx, &got, m, map[i].p));
      CHECK(want && attn_tensor_numel(&got) == attn_tensor_numel(want) &&
                !memcmp(got.data, want->data, sizeof(float) * (size_t)attn_tensor_numel(want)),
            "phi: %s read as saved", map[i].name);
    }
    attn_mha_destroy(m);
  }
  CHECK_OK(ctx, load(ctx, &m, &info, "phi_plain.json", "phi_plain.safetensors", 0));
  if (m) {
    CHECK(info.naming == ATTN_MHA_NAMING_PHI && attn_mha_get_config(m)->qk_norm == ATTN_QK_NORM_NONE,
          "phi without qk_layernorm");
    attn_mha_destroy(m);
  }
  expect_fail(ctx, "phi_qkln.json", "phi_plain.safetensors", 0, ATTN_E_SHAPE, "q_layernorm.weight", __LINE__);
  free_set(&s);
}

/* StableLM with qk_layernorm: a LayerNorm (no bias) per head, saved one tensor per head
 * (q_layernorm.norms.{h}.weight), read as each head's own weights ([H, D], [Hk, D]). A head's
 * norm missing, one past the last head, or of another length is refused. */
static void test_stablelm_norms(attn_ctx *ctx) {
  const int64_t E = 32, H = 4, Hk = 2, D = 8;
  tset s = {0};
  llama_tensors(ctx, &s, 1, E, H, Hk, D, 0, 0);
  const int first = s.n;
  for (int t = 0; t < 2; t++)
    for (int64_t h = 0; h < (t ? Hk : H) + (t == 1); h++) { /* k's last one is past Hk: a decoy */
      char n[96];
      snprintf(n, sizeof n, "model.layers.0.self_attn.%s.norms.%lld.weight", t ? "k_layernorm" : "q_layernorm",
               (long long)h);
      add(ctx, &s, n, 1, D, 0);
    }
  int pick[MAX_T] = {0};
  pick[s.n - 1] = 1;
  write_set(ctx, &s, "stablelm_qkln.safetensors", pick, 0);
  write_set(ctx, &s, "stablelm_past.safetensors", NULL, 0);
  pick[first + 2] = 1; /* q's head 2 */
  write_set(ctx, &s, "stablelm_missing.safetensors", pick, 0);
  write_text("stablelm_qkln.json", "{\"model_type\": \"stablelm\", \"hidden_size\": 32, \"num_attention_heads\": 4,"
                                   " \"num_key_value_heads\": 2, \"num_hidden_layers\": 1, \"layer_norm_eps\": 1e-4,"
                                   " \"qk_layernorm\": true}");
  attn_mha *m = NULL;
  attn_hf_layer info;
  CHECK_OK(ctx, load(ctx, &m, &info, "stablelm_qkln.json", "stablelm_qkln.safetensors", 0));
  if (m) {
    const attn_mha_config *c = attn_mha_get_config(m);
    CHECK(c->qk_norm == ATTN_QK_NORM_EACH_HEAD && c->qk_norm_kind == ATTN_NORM_LAYER && c->qk_norm_eps == 1e-4 &&
              c->num_kv_heads == Hk && info.rope.rotary_dim == D / 4,
          "stablelm: qk_norm %d kind %d eps %g", c->qk_norm, (int)c->qk_norm_kind, c->qk_norm_eps);
    attn_tensor w[2], b[2];
    CHECK_OK(ctx, attn_mha_param_view(ctx, &w[0], m, ATTN_MHA_Q_NORM_WEIGHT));
    CHECK_OK(ctx, attn_mha_param_view(ctx, &w[1], m, ATTN_MHA_K_NORM_WEIGHT));
    CHECK_OK(ctx, attn_mha_param_view(ctx, &b[0], m, ATTN_MHA_Q_NORM_BIAS));
    CHECK_OK(ctx, attn_mha_param_view(ctx, &b[1], m, ATTN_MHA_K_NORM_BIAS));
    for (int t = 0; t < 2; t++) {
      const int64_t heads = t ? Hk : H;
      CHECK(w[t].rank == 2 && w[t].shape[0] == heads && w[t].shape[1] == D, "stablelm: norm %d is [heads, D]", t);
      for (int64_t h = 0; h < heads; h++) {
        const attn_tensor *want = &s.t[first + (t ? H : 0) + h];
        CHECK(!memcmp((const float *)w[t].data + h * D, want->data, sizeof(float) * (size_t)D),
              "stablelm: %s head %lld's norm read as saved", t ? "k" : "q", (long long)h);
      }
      int zero = 1;
      for (int64_t e = 0; e < attn_tensor_numel(&b[t]); e++) zero &= ((const float *)b[t].data)[e] == 0.0f;
      CHECK(zero, "stablelm: no norm biases (bias=False)");
    }
    const attn_tensor *qw = find(&s, "model.layers.0.self_attn.q_proj.weight");
    attn_tensor got;
    CHECK_OK(ctx, attn_mha_param_view(ctx, &got, m, ATTN_MHA_Q_WEIGHT));
    CHECK(!memcmp(got.data, qw->data, sizeof(float) * (size_t)(H * D * E)), "stablelm: q weight kept");
    attn_mha_destroy(m);
  }
  expect_fail(ctx, "stablelm_qkln.json", "stablelm_past.safetensors", 0, ATTN_E_SHAPE, "k_layernorm.norms.2", __LINE__);
  expect_fail(ctx, "stablelm_qkln.json", "stablelm_missing.safetensors", 0, ATTN_E_NOT_FOUND, "q_layernorm.norms.2",
              __LINE__);
  free_set(&s);
  llama_tensors(ctx, &s, 1, E, H, Hk, D, 0, 0);
  for (int64_t h = 0; h < H + Hk; h++) {
    char n[96];
    snprintf(n, sizeof n, "model.layers.0.self_attn.%s.norms.%lld.weight", h < H ? "q_layernorm" : "k_layernorm",
             (long long)(h < H ? h : h - H));
    add(ctx, &s, n, 1, h == H + 1 ? D + 1 : D, 0); /* k's head 1 one entry long */
  }
  write_set(ctx, &s, "stablelm_len.safetensors", NULL, 0);
  expect_fail(ctx, "stablelm_qkln.json", "stablelm_len.safetensors", 0, ATTN_E_SHAPE, "head_dim 8", __LINE__);
  free_set(&s);
}

int main(void) {
  const char *env = getenv("ATTN_TEST_TMP");
  snprintf(tdir, sizeof tdir, "%s/test_hf_layer_%ld", env && env[0] ? env : "/tmp", (long)getpid());
  if (mkdir(tdir, 0777) != 0) {
    fprintf(stderr, "cannot create %s: %s\n", tdir, strerror(errno));
    return 1;
  }
  attn_ctx *ctx = NULL;
  if (attn_ctx_create(&ctx) != ATTN_OK) return 1;
  test_llama_single_and_sharded(ctx);
  test_qk_norm_families(ctx);
  test_gpt2(ctx);
  test_gpt_oss(ctx);
  test_phi3(ctx);
  test_phi(ctx);
  test_olmo_clip(ctx);
  test_stablelm_norms(ctx);
  attn_ctx_destroy(ctx);
  char cmd[700];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tdir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tdir);
  return tu_finish("test_hf_layer");
}
