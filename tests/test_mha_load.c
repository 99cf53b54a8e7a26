/* Loading the layer from every checkpoint family's naming: files written in
 * each family's names and layout under a realistic prefix, in F32, F16, BF16
 * and F64, beside other layers' tensors and unrelated ones. Each case checks
 * the detected naming, the sizes read off the shapes, every parameter bitwise
 * (after the dtype's exact widening; Conv1D transposed), the forward against
 * a layer set by hand, loading into an existing layer and attn_mha_set_param
 * by the family's names. Then the refusals: missing and misshapen tensors,
 * hostile dims, a norm bias without LAYER, bad name maps. */
#include "testutil.h"

#include <unistd.h>

#define NP ATTN_MHA_NUM_PARAMS

static const char *tmpdir(void) {
  const char *d = getenv("ATTN_TEST_TMP");
  return d ? d : "/tmp";
}

/* ---- values exactly representable in each dtype ----------------------------------- */
static size_t dsize(attn_dtype dt) { return dt == ATTN_F64 ? 8 : dt == ATTN_F32 ? 4 : 2; }

static float f16_value(uint16_t h) { /* normals only: what the generator makes */
  const int e = (h >> 10) & 31, m = h & 1023;
  const double v = ldexp(1.0 + m / 1024.0, e - 15);
  return (float)(h >> 15 ? -v : v);
}
static float bf16_value(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* One random element in dtype dt at raw (its bytes); returns what the loader
 * must make of it: the exact widening (F64 rounded to f32). */
static float random_elem(tu_rng *r, attn_dtype dt, void *raw) {
  const uint16_t sign = (uint16_t)(tu_next(r) & 1);
  switch (dt) {
    case ATTN_F16: {
      const uint16_t h = (uint16_t)(sign << 15 | (uint16_t)tu_int(r, 9, 16) << 10 | (uint16_t)(tu_next(r) & 1023));
      memcpy(raw, &h, 2);
      return f16_value(h);
    }
    case ATTN_BF16: {
      const uint16_t b = (uint16_t)(sign << 15 | (uint16_t)tu_int(r, 120, 127) << 7 | (uint16_t)(tu_next(r) & 127));
      memcpy(raw, &b, 2);
      return bf16_value(b);
    }
    case ATTN_F64: {
      const double d = 0.5 * tu_uniform(r);
      memcpy(raw, &d, 8);
      return (float)d;
    }
    default: {
      const float f = (float)(0.5 * tu_uniform(r));
      memcpy(raw, &f, 4);
      return f;
    }
  }
}

/* ---- a case ---------------------------------------------------------------------- */
typedef struct lcase {
  const char *label;
  attn_mha_naming naming; /* CUSTOM: names below */
  const char *prefix;     /* holds ".3." (the layer), replaced by ".2." and ".4." for decoys */
  int64_t E, H, Hk, D, kdim, vdim; /* kdim/vdim 0 = E */
  int bias, out_bias, qk_norm;
  attn_norm_kind kind;
  int norm_bias;      /* the file holds LAYER norm biases */
  int give_head_dim;  /* like->head_dim = D (else read off the shapes) */
  const char *custom[NP];
  int conv1d;
} lcase;

/* The layer a case describes, as attn_mha_create takes it. */
static attn_mha_config case_config(const lcase *c) {
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, c->E, c->H);
  cfg.num_kv_heads = c->Hk;
  cfg.kdim = c->kdim;
  cfg.vdim = c->vdim;
  cfg.bias = c->bias;
  cfg.out_bias = c->out_bias;
  cfg.head_dim = c->D;
  cfg.qk_norm = c->qk_norm;
  cfg.qk_norm_kind = c->kind;
  return cfg;
}

static void case_names(const lcase *c, attn_mha_names *n) {
  memset(n, 0, sizeof *n);
  n->size = sizeof *n;
  for (int p = 0; p < NP; p++)
    n->name[p] = c->naming == ATTN_MHA_NAMING_CUSTOM ? c->custom[p] : attn_mha_param_name(c->naming, (attn_mha_param)p);
  n->conv1d = c->naming == ATTN_MHA_NAMING_CUSTOM ? c->conv1d : c->naming == ATTN_MHA_NAMING_GPT2;
}

/* One layer's parameters: raw elements in the file's dtype (Linear layout) and the floats they load as. */
typedef struct params {
  int has[NP];
  int64_t rows[NP], cols[NP];
  unsigned char *raw[NP];
  float *val[NP];
} params;

static void make_params(params *ps, const attn_mha *shape_of, attn_dtype dt, tu_rng *r) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  memset(ps, 0, sizeof *ps);
  for (int p = 0; p < NP; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, (attn_mha *)shape_of, (attn_mha_param)p)) continue;
    ps->has[p] = 1;
    ps->rows[p] = t.shape[0];
    ps->cols[p] = t.rank == 2 ? t.shape[1] : 0;
    const int64_t n = attn_tensor_numel(&t);
    ps->raw[p] = malloc((size_t)n * dsize(dt));
    ps->val[p] = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) ps->val[p][i] = random_elem(r, dt, ps->raw[p] + (size_t)i * dsize(dt));
  }
  attn_ctx_destroy(ctx);
}

static void free_params(params *ps) {
  for (int p = 0; p < NP; p++) {
    free(ps->raw[p]);
    free(ps->val[p]);
  }
}

/* The tensors of one layer in a name map's layout, appended to a file's list:
 * packed members' rows stacked, Conv1D weights stored [in, out]. */
typedef struct filelist {
  int n;
  const char *names[64];
  char namebuf[64][256];
  attn_tensor t[64];
  void *bufs[64];
} filelist;

static void add_tensor(filelist *f, const char *name, attn_tensor t, void *buf) {
  snprintf(f->namebuf[f->n], sizeof f->namebuf[f->n], "%s", name);
  f->names[f->n] = f->namebuf[f->n];
  f->t[f->n] = t;
  f->bufs[f->n] = buf;
  f->n++;
}

static void add_layer(filelist *f, const params *ps, const attn_mha_names *lay, const char *prefix, attn_dtype dt,
                      unsigned skip_mask) {
  const size_t es = dsize(dt);
  for (int p = 0; p < NP; p++) {
    if (!ps->has[p] || !lay->name[p] || (skip_mask >> p & 1)) continue;
    int first = 1;
    for (int q = 0; q < p; q++) first &= !(lay->name[q] && !strcmp(lay->name[q], lay->name[p]));
    if (!first) continue;
    int64_t total = 0, cols = ps->cols[p];
    for (int q = p; q < NP; q++)
      if (ps->has[q] && lay->name[q] && !strcmp(lay->name[q], lay->name[p])) total += ps->rows[q];
    unsigned char *buf = malloc((size_t)(total * (cols ? cols : 1)) * es);
    int64_t row0 = 0;
    for (int q = p; q < NP; q++) {
      if (!ps->has[q] || !lay->name[q] || strcmp(lay->name[q], lay->name[p])) continue;
      for (int64_t rr = 0; rr < ps->rows[q]; rr++)
        for (int64_t cc = 0; cc < (cols ? cols : 1); cc++) {
          const int64_t o = row0 + rr; /* the stored row in Linear layout */
          const int64_t at = cols ? (lay->conv1d ? cc * total + o : o * cols + cc) : o;
          memcpy(buf + (size_t)at * es, ps->raw[q] + (size_t)(rr * (cols ? cols : 1) + cc) * es, es);
        }
      row0 += ps->rows[q];
    }
    int64_t shape[2];
    int rank = cols ? 2 : 1;
    shape[0] = cols && lay->conv1d ? cols : total;
    shape[1] = cols && lay->conv1d ? total : cols;
    char name[160];
    snprintf(name, sizeof name, "%s%s", prefix, lay->name[p]);
    add_tensor(f, name, attn_tensor_view(buf, dt, rank, shape), buf);
  }
}

/* An unrelated tensor of any shape and dtype. */
static void add_other(filelist *f, const char *name, attn_dtype dt, int rank, int64_t a, int64_t b) {
  int64_t shape[2] = {a, b};
  void *buf = calloc((size_t)(a * (rank == 2 ? b : 1)) + 1, 8);
  add_tensor(f, name, attn_tensor_view(buf, dt, rank, shape), buf);
}

static void free_list(filelist *f) {
  for (int i = 0; i < f->n; i++) free(f->bufs[i]);
  f->n = 0;
}

static void swap_layer(char *out, size_t cap, const char *prefix, char digit) {
  snprintf(out, cap, "%s", prefix);
  char *at = strstr(out, ".3.");
  if (at) at[1] = digit;
  else if (!strncmp(out, "3.", 2)) out[0] = digit;
}

/* Whether layer m holds exactly ps (bitwise), and lacks what ps lacks. */
static int holds(attn_ctx *ctx, attn_mha *m, const params *ps, const char *what) {
  int ok = 1;
  for (int p = 0; p < NP; p++) {
    attn_tensor t;
    const int has = attn_mha_param_view(ctx, &t, m, (attn_mha_param)p) == ATTN_OK;
    if (has != ps->has[p]) {
      fprintf(stderr, "%s: parameter %d is %s\n", what, p, has ? "there but should not be" : "missing");
      ok = 0;
      continue;
    }
    if (!has) continue;
    const int64_t n = attn_tensor_numel(&t);
    if (n != ps->rows[p] * (ps->cols[p] ? ps->cols[p] : 1) || memcmp(t.data, ps->val[p], sizeof(float) * (size_t)n)) {
      fprintf(stderr, "%s: parameter %d differs\n", what, p);
      ok = 0;
    }
  }
  return ok;
}

/* A layer of the case's configuration with ps set by hand (param views). */
static attn_mha *by_hand(attn_ctx *ctx, const lcase *c, const params *ps) {
  attn_mha_config cfg = case_config(c);
  attn_mha *m = NULL;
  CHECK_OK(ctx, attn_mha_create(ctx, &m, &cfg));
  if (!m) return NULL;
  for (int p = 0; p < NP; p++) {
    attn_tensor t;
    if (!ps->has[p] || attn_mha_param_view(ctx, &t, m, (attn_mha_param)p)) continue;
    memcpy(t.data, ps->val[p], sizeof(float) * (size_t)attn_tensor_numel(&t));
  }
  return m;
}

/* A layer of the case's configuration whose every parameter is NaN: a load must overwrite all. */
static attn_mha *poisoned(attn_ctx *ctx, const lcase *c) {
  attn_mha_config cfg = case_config(c);
  attn_mha *m = NULL;
  CHECK_OK(ctx, attn_mha_create(ctx, &m, &cfg));
  for (int p = 0; m && p < NP; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, m, (attn_mha_param)p) == ATTN_OK) tu_poison_f32(t.data, attn_tensor_numel(&t));
  }
  return m;
}

/* The forwards of a and b on the same random input, bitwise. */
static void same_forward(attn_ctx *ctx, attn_mha *a, attn_mha *b, const lcase *c, tu_rng *r, const char *what) {
  const int64_t B = 2, N = 5, E = c->E, kd = c->kdim ? c->kdim : E, vd = c->vdim ? c->vdim : E;
  const int cross = kd != E || vd != E;
  float *x = malloc(sizeof(float) * (size_t)(B * N * E)), *k = malloc(sizeof(float) * (size_t)(B * N * kd));
  float *v = malloc(sizeof(float) * (size_t)(B * N * vd));
  float *ya = malloc(sizeof(float) * (size_t)(B * N * E)), *yb = malloc(sizeof(float) * (size_t)(B * N * E));
  tu_fill_f32(r, x, B * N * E, 1);
  tu_fill_f32(r, k, B * N * kd, 1);
  tu_fill_f32(r, v, B * N * vd, 1);
  tu_poison_f32(ya, B * N * E);
  tu_poison_f32(yb, B * N * E);
  int64_t sx[3] = {B, N, E}, sk[3] = {B, N, kd}, sv[3] = {B, N, vd};
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 3, sx), tk = attn_tensor_view(k, ATTN_F32, 3, sk);
  attn_tensor tv = attn_tensor_view(v, ATTN_F32, 3, sv), ta = attn_tensor_view(ya, ATTN_F32, 3, sx);
  attn_tensor tb = attn_tensor_view(yb, ATTN_F32, 3, sx);
  attn_mha_opts o;
  attn_mha_opts_init(&o);
  o.attn.causal = ATTN_CAUSAL_TOP_LEFT;
  CHECK_OK(ctx, attn_mha_forward(ctx, a, &ta, NULL, &tx, cross ? &tk : NULL, cross ? &tv : NULL, &o));
  CHECK_OK(ctx, attn_mha_forward(ctx, b, &tb, NULL, &tx, cross ? &tk : NULL, cross ? &tv : NULL, &o));
  int finite = 1;
  for (int64_t i = 0; i < B * N * E; i++) finite &= isfinite(ya[i]);
  CHECK(finite && !memcmp(ya, yb, sizeof(float) * (size_t)(B * N * E)), "%s: the loaded layer's forward differs", what);
  free(x);
  free(k);
  free(v);
  free(ya);
  free(yb);
}

static void run_case(attn_ctx *ctx, const lcase *c, attn_dtype dt, uint64_t seed) {
  char what[160], path[512];
  snprintf(what, sizeof what, "%s in %s", c->label, attn_dtype_name(dt));
  tu_rng r = {seed};
  attn_mha_config cfg = case_config(c);
  attn_mha *shape = NULL;
  CHECK_OK(ctx, attn_mha_create(ctx, &shape, &cfg));
  if (!shape) return;
  params ps, d2, d4;
  make_params(&ps, shape, dt, &r);
  make_params(&d2, shape, dt, &r);
  make_params(&d4, shape, dt, &r);
  if (!c->norm_bias) ps.has[ATTN_MHA_Q_NORM_BIAS] = ps.has[ATTN_MHA_K_NORM_BIAS] = 0;
  attn_mha_destroy(shape);
  attn_mha_names lay;
  case_names(c, &lay);

  /* the layer between its neighbours, and tensors of no layer */
  filelist *f = calloc(1, sizeof *f);
  char p2[160], p4[160];
  swap_layer(p2, sizeof p2, c->prefix, '2');
  swap_layer(p4, sizeof p4, c->prefix, '4');
  add_other(f, "embeddings.word_embeddings.weight", ATTN_F32, 2, 11, c->E);
  add_layer(f, &d2, &lay, p2, dt, 0);
  add_layer(f, &ps, &lay, c->prefix, dt, 0);
  add_layer(f, &d4, &lay, p4, dt, 0);
  char other[180];
  snprintf(other, sizeof other, "%srelative_attention_bias.weight", c->prefix); /* T5's, under the prefix */
  add_other(f, other, ATTN_F32, 2, 32, c->H);
  snprintf(other, sizeof other, "%sbias", c->prefix); /* GPT-2's old causal-mask buffer */
  add_other(f, other, ATTN_U8, 2, 4, 4);
  add_other(f, "pooler.dense.weight", dt, 2, 3, 3);
  snprintf(path, sizeof path, "%s/test_mha_load_%ld.safetensors", tmpdir(), (long)getpid());
  CHECK_OK(ctx, attn_safetensors_write(ctx, path, f->n, f->names, f->t));
  free_list(f);
  free(f);
  attn_safetensors *st = NULL;
  CHECK_OK(ctx, attn_safetensors_open(ctx, &st, path));
  if (!st) goto out;

  const int custom = c->naming == ATTN_MHA_NAMING_CUSTOM;
  if (!custom) {
    attn_mha_naming nm = ATTN_MHA_NAMING_NONE;
    CHECK_OK(ctx, attn_mha_detect_naming(ctx, &nm, st, c->prefix));
    CHECK(nm == c->naming, "%s: detected naming %d, want %d", what, (int)nm, (int)c->naming);
  }
  attn_mha_config like;
  attn_mha_config_init(&like, 0, c->H);
  like.num_kv_heads = c->Hk;
  like.head_dim = c->give_head_dim ? c->D : 0;
  like.qk_norm_kind = c->kind;
  attn_mha *m = NULL;
  CHECK_OK(ctx, attn_mha_create_from_tensors(ctx, &m, st, c->prefix, custom ? &lay : NULL, &like));
  if (m) {
    const attn_mha_config *g = attn_mha_get_config(m);
    const int64_t kd = c->kdim ? c->kdim : c->E, vd = c->vdim ? c->vdim : c->E;
    CHECK(g->embed_dim == c->E && g->num_heads == c->H && g->num_kv_heads == (c->Hk ? c->Hk : c->H) &&
              g->head_dim == c->D && g->kdim == kd && g->vdim == vd && g->bias == c->bias &&
              g->out_bias == c->out_bias && g->qk_norm == c->qk_norm,
          "%s: sizes read: E %lld H %lld Hk %lld D %lld kdim %lld vdim %lld bias %d out_bias %d qk_norm %d", what,
          (long long)g->embed_dim, (long long)g->num_heads, (long long)g->num_kv_heads, (long long)g->head_dim,
          (long long)g->kdim, (long long)g->vdim, g->bias, g->out_bias, g->qk_norm);
    /* a LAYER norm saved without biases loads them as zeros */
    params want = ps;
    float zeros[64] = {0};
    if (c->qk_norm && c->kind == ATTN_NORM_LAYER && !c->norm_bias) {
      want.has[ATTN_MHA_Q_NORM_BIAS] = want.has[ATTN_MHA_K_NORM_BIAS] = 1;
      want.val[ATTN_MHA_Q_NORM_BIAS] = want.val[ATTN_MHA_K_NORM_BIAS] = zeros;
    }
    CHECK(holds(ctx, m, &want, what), "%s: create_from_tensors' parameters", what);
    attn_mha *h = by_hand(ctx, c, &want);
    if (h) same_forward(ctx, m, h, c, &r, what);
    /* into an existing layer: by the name map, and by the detected naming */
    attn_mha *l = poisoned(ctx, c);
    CHECK_OK(ctx, attn_mha_load_tensors(ctx, l, st, c->prefix, custom ? &lay : NULL));
    CHECK(l && holds(ctx, l, &want, what), "%s: attn_mha_load_tensors", what);
    attn_mha_destroy(l);
    if (!custom) {
      l = poisoned(ctx, c);
      CHECK_OK(ctx, attn_mha_load_safetensors_handle(ctx, l, st, c->prefix));
      CHECK(l && holds(ctx, l, &want, what), "%s: attn_mha_load_safetensors_handle", what);
      attn_mha_destroy(l);
      /* each tensor by its own name through attn_mha_set_param */
      l = poisoned(ctx, c);
      for (int p = 0; l && p < NP; p++) {
        if (!ps.has[p] || !lay.name[p]) continue;
        char full[200];
        snprintf(full, sizeof full, "%s%s", c->prefix, lay.name[p]);
        attn_tensor t;
        CHECK_OK(ctx, attn_safetensors_get(ctx, &t, st, full));
        CHECK_OK(ctx, attn_mha_set_param(ctx, l, lay.name[p], &t));
      }
      if (l && c->qk_norm && c->kind == ATTN_NORM_LAYER && !c->norm_bias)
        for (int p = ATTN_MHA_Q_NORM_BIAS; p <= ATTN_MHA_K_NORM_BIAS; p += 2) {
          attn_tensor t;
          CHECK_OK(ctx, attn_mha_param_view(ctx, &t, l, (attn_mha_param)p));
          memset(t.data, 0, sizeof(float) * (size_t)attn_tensor_numel(&t));
        }
      CHECK(l && holds(ctx, l, &want, what), "%s: attn_mha_set_param by the family's names", what);
      attn_mha_destroy(l);
      /* the older wrapper: RMS QK-norm and head_dim from the shapes */
      if (c->kind != ATTN_NORM_LAYER && !c->give_head_dim) {
        attn_mha *w = NULL;
        CHECK_OK(ctx, attn_mha_create_from_safetensors(ctx, &w, path, c->prefix, c->H, c->Hk));
        if (w && c->kind == ATTN_NORM_RMS) CHECK(holds(ctx, w, &want, what), "%s: create_from_safetensors", what);
        attn_mha_destroy(w);
      }
    }
    attn_mha_destroy(h);
    attn_mha_destroy(m);
  }
  attn_safetensors_close(st);
out:
  remove(path);
  free_params(&ps);
  free_params(&d2);
  free_params(&d4);
}

static const lcase cases[] = {
    {.label = "seed", .naming = ATTN_MHA_NAMING_SEED, .prefix = "layers.3.attn.", .E = 8, .H = 2, .D = 4,
     .bias = 1, .out_bias = 1},
    {.label = "torch packed", .naming = ATTN_MHA_NAMING_TORCH_PACKED, .prefix = "encoder.layers.3.self_attn.", .E = 8,
     .H = 4, .Hk = 2, .D = 2, .bias = 1, .out_bias = 1},
    {.label = "torch separate", .naming = ATTN_MHA_NAMING_TORCH_SEPARATE, .prefix = "decoder.layers.3.cross_attn.",
     .E = 6, .H = 2, .D = 3, .kdim = 5, .vdim = 3, .bias = 1, .out_bias = 1},
    {.label = "llama gqa", .naming = ATTN_MHA_NAMING_LLAMA, .prefix = "model.layers.3.self_attn.", .E = 16, .H = 4,
     .Hk = 2, .D = 4},
    {.label = "qwen2", .naming = ATTN_MHA_NAMING_LLAMA, .prefix = "model.layers.3.self_attn.", .E = 12, .H = 4,
     .Hk = 1, .D = 3, .bias = 1, .out_bias = 0},
    {.label = "qwen3 (head_dim, per-head RMS QK-norm)", .naming = ATTN_MHA_NAMING_LLAMA,
     .prefix = "model.layers.3.self_attn.", .E = 12, .H = 4, .Hk = 2, .D = 5, .qk_norm = ATTN_QK_NORM_PER_HEAD},
    {.label = "gemma3 (RMS_PLUS_ONE, head_dim given)", .naming = ATTN_MHA_NAMING_LLAMA,
     .prefix = "language_model.model.layers.3.self_attn.", .E = 8, .H = 2, .Hk = 1, .D = 6,
     .qk_norm = ATTN_QK_NORM_PER_HEAD, .kind = ATTN_NORM_RMS_PLUS_ONE, .give_head_dim = 1},
    {.label = "olmo2 (whole QK-norm)", .naming = ATTN_MHA_NAMING_LLAMA, .prefix = "model.layers.3.self_attn.",
     .E = 8, .H = 4, .Hk = 2, .D = 2, .qk_norm = ATTN_QK_NORM_WHOLE},
    {.label = "layer-norm QK-norm with biases", .naming = ATTN_MHA_NAMING_LLAMA, .prefix = "blocks.3.attn.",
     .E = 8, .H = 2, .D = 4, .bias = 1, .out_bias = 1, .qk_norm = ATTN_QK_NORM_PER_HEAD, .kind = ATTN_NORM_LAYER,
     .norm_bias = 1},
    {.label = "layer-norm QK-norm without biases", .naming = ATTN_MHA_NAMING_LLAMA, .prefix = "blocks.3.attn.",
     .E = 8, .H = 2, .D = 4, .qk_norm = ATTN_QK_NORM_WHOLE, .kind = ATTN_NORM_LAYER},
    {.label = "bert", .naming = ATTN_MHA_NAMING_BERT, .prefix = "encoder.layer.3.attention.", .E = 12, .H = 3,
     .D = 4, .bias = 1, .out_bias = 1},
    {.label = "roberta", .naming = ATTN_MHA_NAMING_BERT, .prefix = "roberta.encoder.layer.3.attention.", .E = 8,
     .H = 2, .D = 4, .bias = 1, .out_bias = 1},
    {.label = "vit", .naming = ATTN_MHA_NAMING_VIT, .prefix = "vit.encoder.layer.3.attention.", .E = 12, .H = 3,
     .D = 4, .bias = 1, .out_bias = 1},
    {.label = "distilbert", .naming = ATTN_MHA_NAMING_DISTILBERT, .prefix = "transformer.layer.3.attention.", .E = 8,
     .H = 2, .D = 4, .bias = 1, .out_bias = 1},
    {.label = "gpt2", .naming = ATTN_MHA_NAMING_GPT2, .prefix = "h.3.attn.", .E = 12, .H = 3, .D = 4, .bias = 1,
     .out_bias = 1},
    {.label = "gpt2 (transformer.)", .naming = ATTN_MHA_NAMING_GPT2, .prefix = "transformer.h.3.attn.", .E = 6,
     .H = 2, .D = 3, .bias = 1, .out_bias = 1},
    {.label = "t5", .naming = ATTN_MHA_NAMING_T5, .prefix = "encoder.block.3.layer.0.SelfAttention.", .E = 8,
     .H = 2, .D = 4},
    {.label = "t5 (d_kv: inner dim != d_model)", .naming = ATTN_MHA_NAMING_T5,
     .prefix = "decoder.block.3.layer.0.SelfAttention.", .E = 8, .H = 2, .D = 6},
    {.label = "custom packed qkv", .naming = ATTN_MHA_NAMING_CUSTOM, .prefix = "blocks.3.attn.", .E = 8, .H = 4,
     .Hk = 2, .D = 2, .bias = 1, .out_bias = 0,
     .custom = {"wqkv.weight", "wqkv.bias", "wqkv.weight", "wqkv.bias", "wqkv.weight", "wqkv.bias", "proj.weight"}},
    {.label = "custom conv1d, kv packed", .naming = ATTN_MHA_NAMING_CUSTOM, .prefix = "3.mixer.", .E = 6, .H = 2,
     .D = 4, .conv1d = 1, .qk_norm = ATTN_QK_NORM_PER_HEAD,
     .custom = {"q.w", NULL, "kv.w", NULL, "kv.w", NULL, "out.w", NULL, "qn", NULL, "kn", NULL}},
};

/* ---- refusals ---------------------------------------------------------------------- */
static char err_path[512];

static void write_list(attn_ctx *ctx, int n, const char *const *names, const int64_t (*shapes)[2],
                       const int *ranks) {
  static float zeros[4096];
  attn_tensor t[16];
  for (int i = 0; i < n; i++) t[i] = attn_tensor_view(zeros, ATTN_F32, ranks[i], shapes[i]);
  CHECK_OK(ctx, attn_safetensors_write(ctx, err_path, n, names, t));
}

static attn_status create_err(attn_ctx *ctx, const attn_mha_names *names, int64_t H, int64_t Hk, int64_t D,
                              attn_norm_kind kind) {
  attn_safetensors *st = NULL;
  attn_status s = attn_safetensors_open(ctx, &st, err_path);
  if (s) return s;
  attn_mha_config like;
  attn_mha_config_init(&like, 0, H);
  like.num_kv_heads = Hk;
  like.head_dim = D;
  like.qk_norm_kind = kind;
  attn_mha *m = (attn_mha *)&like; /* must come back NULL */
  s = attn_mha_create_from_tensors(ctx, &m, st, "l.3.", names, &like);
  CHECK(m == NULL || s == ATTN_OK, "a refused create left a layer");
  if (s == ATTN_OK) attn_mha_destroy(m);
  attn_safetensors_close(st);
  return s;
}

static void refusals(attn_ctx *ctx) {
  snprintf(err_path, sizeof err_path, "%s/test_mha_load_err_%ld.safetensors", tmpdir(), (long)getpid());
  const char *ll[8] = {"l.3.q_proj.weight", "l.3.k_proj.weight", "l.3.v_proj.weight", "l.3.o_proj.weight",
                       "l.3.q_norm.weight", "l.3.k_norm.weight", "l.3.q_norm.bias", "l.3.k_norm.bias"};
  int64_t sh[8][2] = {{8, 8}, {4, 8}, {4, 8}, {8, 8}, {4, 0}, {4, 0}, {4, 0}, {4, 0}};
  const int rk[8] = {2, 2, 2, 2, 1, 1, 1, 1};
  /* a good file first: the rest differ from it in one thing */
  write_list(ctx, 4, ll, (const int64_t(*)[2])sh, rk);
  CHECK_OK(ctx, create_err(ctx, NULL, 2, 1, 0, ATTN_NORM_RMS));
  /* missing weight */
  const char *nov[3] = {ll[0], ll[1], ll[3]};
  int64_t shv[3][2] = {{8, 8}, {4, 8}, {8, 8}};
  write_list(ctx, 3, nov, (const int64_t(*)[2])shv, rk);
  CHECK_ERR(ctx, create_err(ctx, NULL, 2, 1, 0, ATTN_NORM_RMS), ATTN_E_NOT_FOUND, "l.3.v_proj.weight");
  /* inconsistent shapes: o's columns, v's rows, kv heads */
  sh[3][1] = 6;
  write_list(ctx, 4, ll, (const int64_t(*)[2])sh, rk);
  CHECK_ERR(ctx, create_err(ctx, NULL, 2, 1, 0, ATTN_NORM_RMS), ATTN_E_SHAPE, "o_proj.weight");
  sh[3][1] = 8;
  sh[2][0] = 8;
  write_list(ctx, 4, ll, (const int64_t(*)[2])sh, rk);
  CHECK_ERR(ctx, create_err(ctx, NULL, 2, 1, 0, ATTN_NORM_RMS), ATTN_E_SHAPE, "v_proj.weight");
  sh[2][0] = 4;
  write_list(ctx, 4, ll, (const int64_t(*)[2])sh, rk);
  CHECK_ERR(ctx, create_err(ctx, NULL, 2, 2, 0, ATTN_NORM_RMS), ATTN_E_SHAPE, "num_kv_heads 1 would fit");
  /* q rows not divisible by H; a head_dim the rows do not have */
  CHECK_ERR(ctx, create_err(ctx, NULL, 3, 1, 0, ATTN_NORM_RMS), ATTN_E_SHAPE, "not divisible by num_heads 3");
  CHECK_ERR(ctx, create_err(ctx, NULL, 2, 1, 3, ATTN_NORM_RMS), ATTN_E_SHAPE, "head_dim 3");
  /* QK-norm: a bias without LAYER; one norm without the other; a scope of neither shape */
  write_list(ctx, 7, ll, (const int64_t(*)[2])sh, rk);
  CHECK_ERR(ctx, create_err(ctx, NULL, 2, 1, 0, ATTN_NORM_RMS), ATTN_E_INVALID, "l.3.q_norm.bias");
  CHECK_OK(ctx, create_err(ctx, NULL, 2, 1, 0, ATTN_NORM_LAYER));
  write_list(ctx, 5, ll, (const int64_t(*)[2])sh, rk);
  CHECK_ERR(ctx, create_err(ctx, NULL, 2, 1, 0, ATTN_NORM_RMS), ATTN_E_UNSUPPORTED, "k_norm.weight");
  sh[4][0] = 3;
  write_list(ctx, 6, ll, (const int64_t(*)[2])sh, rk);
  CHECK_ERR(ctx, create_err(ctx, NULL, 2, 1, 0, ATTN_NORM_RMS), ATTN_E_SHAPE, "q_norm.weight");
  sh[4][0] = 4;
  /* some of q, k, v with a bias, not all */
  const char *qb[6] = {ll[0], ll[1], ll[2], ll[3], "l.3.q_proj.bias", "l.3.k_proj.bias"};
  int64_t shb[6][2] = {{8, 8}, {4, 8}, {4, 8}, {8, 8}, {8, 0}, {4, 0}};
  const int rkb[6] = {2, 2, 2, 2, 1, 1};
  write_list(ctx, 6, qb, (const int64_t(*)[2])shb, rkb);
  CHECK_ERR(ctx, create_err(ctx, NULL, 2, 1, 0, ATTN_NORM_RMS), ATTN_E_UNSUPPORTED, "v_proj.bias");
  /* a name map naming a tensor the file lacks; maps that cannot be */
  write_list(ctx, 4, ll, (const int64_t(*)[2])sh, rk);
  attn_mha_names nm;
  memset(&nm, 0, sizeof nm);
  nm.size = sizeof nm;
  nm.name[ATTN_MHA_Q_WEIGHT] = "q_proj.weight";
  nm.name[ATTN_MHA_K_WEIGHT] = "k_proj.weight";
  nm.name[ATTN_MHA_V_WEIGHT] = "v_proj.weight";
  nm.name[ATTN_MHA_O_WEIGHT] = "o_proj.weight";
  CHECK_OK(ctx, create_err(ctx, &nm, 2, 1, 0, ATTN_NORM_RMS));
  nm.name[ATTN_MHA_O_WEIGHT] = "out.weight";
  CHECK_ERR(ctx, create_err(ctx, &nm, 2, 1, 0, ATTN_NORM_RMS), ATTN_E_NOT_FOUND, "l.3.out.weight");
  nm.name[ATTN_MHA_O_WEIGHT] = "q_proj.weight";
  CHECK_ERR(ctx, create_err(ctx, &nm, 2, 1, 0, ATTN_NORM_RMS), ATTN_E_INVALID, "packed");
  nm.name[ATTN_MHA_O_WEIGHT] = NULL;
  CHECK_ERR(ctx, create_err(ctx, &nm, 2, 1, 0, ATTN_NORM_RMS), ATTN_E_INVALID, "o weight");
  nm.name[ATTN_MHA_O_WEIGHT] = "o_proj.weight";
  nm.size = 0;
  CHECK_ERR(ctx, create_err(ctx, &nm, 2, 1, 0, ATTN_NORM_RMS), ATTN_E_INVALID, "names.size");
  /* hostile dims: no element, but sizes that would allocate terabytes */
  int64_t hs[4][2] = {{8, 8}, {4, 8}, {4, 8}, {(int64_t)1 << 40, 0}};
  write_list(ctx, 4, ll, (const int64_t(*)[2])hs, rk);
  CHECK_ERR(ctx, create_err(ctx, NULL, 2, 1, 0, ATTN_NORM_RMS), ATTN_E_SHAPE, "o_proj.weight");
  hs[3][0] = 0;
  hs[3][1] = (int64_t)1 << 40;
  write_list(ctx, 4, ll, (const int64_t(*)[2])hs, rk);
  CHECK_ERR(ctx, create_err(ctx, NULL, 2, 1, 0, ATTN_NORM_RMS), ATTN_E_SHAPE, "o_proj.weight");
  int64_t hq[4][2] = {{0, (int64_t)1 << 40}, {4, 8}, {4, 8}, {8, 8}};
  write_list(ctx, 4, ll, (const int64_t(*)[2])hq, rk);
  CHECK_ERR(ctx, create_err(ctx, NULL, 2, 1, 0, ATTN_NORM_RMS), ATTN_E_SHAPE, "q_proj.weight");
  write_list(ctx, 4, ll, (const int64_t(*)[2])sh, rk);
  CHECK_ERR(ctx, create_err(ctx, NULL, (int64_t)1 << 40, 0, 0, ATTN_NORM_RMS), ATTN_E_INVALID, "num_heads");
  CHECK_ERR(ctx, create_err(ctx, NULL, 2, 1, (int64_t)1 << 40, ATTN_NORM_RMS), ATTN_E_INVALID, "head_dim");
  CHECK_ERR(ctx, create_err(ctx, NULL, 0, 0, 0, ATTN_NORM_RMS), ATTN_E_INVALID, "num_heads");
  /* a GPT-2 c_attn whose columns are not q's plus two equal parts */
  const char *g[2] = {"l.3.c_attn.weight", "l.3.c_proj.weight"};
  int64_t gs[2][2] = {{8, 23}, {8, 8}};
  write_list(ctx, 2, g, (const int64_t(*)[2])gs, rk);
  CHECK_ERR(ctx, create_err(ctx, NULL, 2, 0, 0, ATTN_NORM_RMS), ATTN_E_SHAPE, "c_attn.weight");
  /* a dtype that is not a float */
  {
    static unsigned char u8[64];
    int64_t s2[2] = {8, 8}, s4[2] = {4, 8};
    attn_tensor t[4] = {attn_tensor_view(u8, ATTN_U8, 2, s2), attn_tensor_view(u8, ATTN_U8, 2, s4),
                        attn_tensor_view(u8, ATTN_U8, 2, s4), attn_tensor_view(u8, ATTN_U8, 2, s2)};
    CHECK_OK(ctx, attn_safetensors_write(ctx, err_path, 4, ll, t));
    CHECK_ERR(ctx, create_err(ctx, NULL, 2, 1, 0, ATTN_NORM_RMS), ATTN_E_DTYPE, "U8");
  }

  /* loading into an existing layer: a misshapen tensor late in the file changes nothing */
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, 8, 2);
  cfg.num_kv_heads = 1;
  cfg.bias = 0;
  attn_mha *m = NULL;
  CHECK_OK(ctx, attn_mha_create(ctx, &m, &cfg));
  sh[3][1] = 7;
  write_list(ctx, 4, ll, (const int64_t(*)[2])sh, rk);
  sh[3][1] = 8;
  attn_safetensors *st = NULL;
  CHECK_OK(ctx, attn_safetensors_open(ctx, &st, err_path));
  if (m && st) {
    attn_tensor q;
    CHECK_OK(ctx, attn_mha_param_view(ctx, &q, m, ATTN_MHA_Q_WEIGHT));
    float *w = q.data;
    for (int i = 0; i < 64; i++) w[i] = 42;
    CHECK_ERR(ctx, attn_mha_load_tensors(ctx, m, st, "l.3.", NULL), ATTN_E_SHAPE, "o_proj.weight");
    int untouched = 1;
    for (int i = 0; i < 64; i++) untouched &= w[i] == 42;
    CHECK(untouched, "a refused load wrote the q weight");
    CHECK_ERR(ctx, attn_mha_load_tensors(ctx, m, st, "l.9.", NULL), ATTN_E_NOT_FOUND, "l.9.");
    CHECK_ERR(ctx, attn_mha_load_tensors(ctx, NULL, st, "l.3.", NULL), ATTN_E_INVALID, "NULL");
    CHECK(attn_mha_load_tensors(NULL, m, st, "l.3.", NULL) == ATTN_E_INVALID, "NULL context");
  }
  attn_safetensors_close(st);
  st = NULL;
  /* a norm the layer lacks, and a layer's norm the file lacks */
  write_list(ctx, 6, ll, (const int64_t(*)[2])sh, rk);
  CHECK_OK(ctx, attn_safetensors_open(ctx, &st, err_path));
  if (m && st) CHECK_ERR(ctx, attn_mha_load_tensors(ctx, m, st, "l.3.", NULL), ATTN_E_INVALID, "q_norm.weight");
  attn_safetensors_close(st);
  attn_mha_destroy(m);
  m = NULL;
  cfg.qk_norm = ATTN_QK_NORM_PER_HEAD;
  CHECK_OK(ctx, attn_mha_create(ctx, &m, &cfg));
  write_list(ctx, 4, ll, (const int64_t(*)[2])sh, rk);
  CHECK_OK(ctx, attn_safetensors_open(ctx, &st, err_path));
  if (m && st) CHECK_ERR(ctx, attn_mha_load_tensors(ctx, m, st, "l.3.", NULL), ATTN_E_NOT_FOUND, "q_norm.weight");
  attn_safetensors_close(st);
  /* set_param: a Conv1D tensor in Linear layout is refused; a norm the layer lacks */
  {
    static float z[256];
    int64_t s1[2] = {8, 16}, s2[2] = {16, 8}, s3[1] = {4};
    attn_tensor ok = attn_tensor_view(z, ATTN_F32, 2, s1), bad = attn_tensor_view(z, ATTN_F32, 2, s2);
    attn_tensor nb = attn_tensor_view(z, ATTN_F32, 1, s3);
    if (m) {
      CHECK_OK(ctx, attn_mha_set_param(ctx, m, "c_attn.weight", &ok));
      CHECK_ERR(ctx, attn_mha_set_param(ctx, m, "c_attn.weight", &bad), ATTN_E_SHAPE, "Conv1D");
      CHECK_OK(ctx, attn_mha_set_param(ctx, m, "k_norm.weight", &nb));
      CHECK_ERR(ctx, attn_mha_set_param(ctx, m, "k_norm.bias", &nb), ATTN_E_INVALID, "k norm bias");
    }
  }
  attn_mha_destroy(m);
  remove(err_path);
}

/* Detection never takes one family for another under its own prefix. */
static void detection(attn_ctx *ctx) {
  snprintf(err_path, sizeof err_path, "%s/test_mha_load_det_%ld.safetensors", tmpdir(), (long)getpid());
  /* a ViT layer, whose attention.attention.* would read as BERT's under the wrong prefix */
  const char *n[6] = {"vit.encoder.layer.0.attention.attention.query.weight",
                      "vit.encoder.layer.0.attention.output.dense.weight",
                      "encoder.layer.0.attention.self.query.weight",
                      "t.layer.0.attention.q_lin.weight", "h.0.attn.c_attn.weight", "h.0.mlp.c_proj.weight"};
  int64_t s[6][2] = {{4, 4}, {4, 4}, {4, 4}, {4, 4}, {4, 12}, {4, 4}};
  const int rk[6] = {2, 2, 2, 2, 2, 2};
  write_list(ctx, 6, n, (const int64_t(*)[2])s, rk);
  attn_safetensors *st = NULL;
  CHECK_OK(ctx, attn_safetensors_open(ctx, &st, err_path));
  if (st) {
    static const struct {
      const char *prefix;
      attn_mha_naming want;
    } probe[] = {{"vit.encoder.layer.0.attention.", ATTN_MHA_NAMING_VIT},
                 {"encoder.layer.0.attention.", ATTN_MHA_NAMING_BERT},
                 {"t.layer.0.attention.", ATTN_MHA_NAMING_DISTILBERT},
                 {"h.0.attn.", ATTN_MHA_NAMING_GPT2},
                 {"h.0.mlp.", ATTN_MHA_NAMING_NONE},
                 {"vit.encoder.layer.0.", ATTN_MHA_NAMING_NONE}};
    for (size_t i = 0; i < sizeof probe / sizeof probe[0]; i++) {
      attn_mha_naming nm = ATTN_MHA_NAMING_SEED;
      const attn_status s1 = attn_mha_detect_naming(ctx, &nm, st, probe[i].prefix);
      CHECK(nm == probe[i].want && (s1 == ATTN_OK) == (probe[i].want != ATTN_MHA_NAMING_NONE),
            "under '%s' detected %d, want %d", probe[i].prefix, (int)nm, (int)probe[i].want);
    }
    attn_safetensors_close(st);
  }
  remove(err_path);
  /* the names each naming reports */
  CHECK(!strcmp(attn_mha_param_name(ATTN_MHA_NAMING_GPT2, ATTN_MHA_K_WEIGHT), "c_attn.weight"), "gpt2 k");
  CHECK(!strcmp(attn_mha_param_name(ATTN_MHA_NAMING_GPT2, ATTN_MHA_O_BIAS), "c_proj.bias"), "gpt2 o bias");
  CHECK(!strcmp(attn_mha_param_name(ATTN_MHA_NAMING_BERT, ATTN_MHA_V_BIAS), "self.value.bias"), "bert v bias");
  CHECK(!strcmp(attn_mha_param_name(ATTN_MHA_NAMING_VIT, ATTN_MHA_O_WEIGHT), "output.dense.weight"), "vit o");
  CHECK(!strcmp(attn_mha_param_name(ATTN_MHA_NAMING_DISTILBERT, ATTN_MHA_O_WEIGHT), "out_lin.weight"), "distil o");
  CHECK(!strcmp(attn_mha_param_name(ATTN_MHA_NAMING_T5, ATTN_MHA_V_WEIGHT), "v.weight"), "t5 v");
  CHECK(attn_mha_param_name(ATTN_MHA_NAMING_T5, ATTN_MHA_Q_BIAS) == NULL, "t5 has no biases");
  CHECK(!strcmp(attn_mha_param_name(ATTN_MHA_NAMING_LLAMA, ATTN_MHA_K_NORM_WEIGHT), "k_norm.weight"), "llama k norm");
  CHECK(attn_mha_param_name(ATTN_MHA_NAMING_BERT, ATTN_MHA_Q_NORM_WEIGHT) == NULL, "bert has no QK-norm");
}

int main(void) {
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx)) return 2;
  static const attn_dtype dts[4] = {ATTN_F32, ATTN_F16, ATTN_BF16, ATTN_F64};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    for (int d = 0; d < 4; d++) run_case(ctx, &cases[i], dts[d], 1000 + 10 * i + (uint64_t)d);
  refusals(ctx);
  detection(ctx);
  attn_ctx_destroy(ctx);
  return tu_finish("test_mha_load");
}
