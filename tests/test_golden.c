/* Golden cases made by PyTorch (scripts/make_goldens.py): every case under
 * golden/ (listed in golden/INDEX) runs through the fp32 path and the float64
 * oracle and is compared with PyTorch's float64 result: out, weights and lse
 * (the gradients of cases with backward=1 are checked by test_backward). SDPA
 * cases may set the options of recent models: window, softcap, dropout_p and
 * dropout_seed in case.txt, ALiBi slopes and sinks as alibi.npy and sinks.npy.
 * A case.txt key this file does not know fails the case, so that no option of
 * a golden is silently ignored.
 *
 * Run with the working directory tests/. Tolerances, relative L2:
 *   fp32 kernels (default kernel)            1e-5
 *   oracle with f32 outputs (ATTN_KERNEL_REF) 1e-6
 *   oracle with f64 outputs                   1e-12 (same float32 inputs, both in double) */
#include "testutil.h"

#define TOL_FP32 1e-5
#define TOL_REF32 1e-6
#define TOL_REF64 1e-12

/* ---- the manifest: key=value lines ---------------------------------------- */
enum { MAN_MAX = 32, MAN_KEY = 64, MAN_VAL = 256 };
typedef struct {
  int n;
  char key[MAN_MAX][MAN_KEY];
  char val[MAN_MAX][MAN_VAL];
} manifest;

static void strip(char *s) {
  size_t n = strlen(s);
  while (n > 0 && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ' || s[n - 1] == '\t')) s[--n] = '\0';
}

/* Copies at most cap - 1 bytes of src, always terminating. */
static void copy_str(char *dst, size_t cap, const char *src) {
  size_t n = strlen(src);
  if (n >= cap) n = cap - 1;
  memcpy(dst, src, n);
  dst[n] = '\0';
}

static int manifest_read(manifest *m, const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  char line[512];
  m->n = 0;
  while (fgets(line, sizeof line, f)) {
    strip(line);
    char *eq = strchr(line, '=');
    if (!eq || line[0] == '#' || m->n == MAN_MAX) continue;
    *eq = '\0';
    copy_str(m->key[m->n], MAN_KEY, line);
    copy_str(m->val[m->n], MAN_VAL, eq + 1);
    m->n++;
  }
  fclose(f);
  return 1;
}

static const char *mget(const manifest *m, const char *key, const char *dflt) {
  for (int i = 0; i < m->n; i++)
    if (strcmp(m->key[i], key) == 0) return m->val[i];
  return dflt;
}

static int64_t mget_int(const manifest *m, const char *key, int64_t dflt) {
  const char *v = mget(m, key, NULL);
  return v && *v ? strtoll(v, NULL, 10) : dflt;
}

static double mget_double(const manifest *m, const char *key, double dflt) {
  const char *v = mget(m, key, NULL);
  return v && *v ? strtod(v, NULL) : dflt;
}

static uint64_t mget_u64(const manifest *m, const char *key, uint64_t dflt) {
  const char *v = mget(m, key, NULL);
  return v && *v ? strtoull(v, NULL, 10) : dflt;
}

/* Fails the case for a key the runner of its kind does not read. */
static void check_keys(const char *cas, const manifest *m, const char *const *known) {
  for (int i = 0; i < m->n; i++) {
    int found = 0;
    for (int k = 0; known[k] && !found; k++) found = strcmp(m->key[i], known[k]) == 0;
    CHECK(found, "%s: case.txt key '%s' is not read by test_golden", cas, m->key[i]);
  }
}

static const char *const SDPA_KEYS[] = {"kind", "causal", "mask_mode", "scale", "gqa", "backward", "window",
                                        "softcap", "dropout_p", "dropout_seed", NULL};
static const char *const MHA_KEYS[] = {"kind", "naming", "embed_dim", "heads", "kdim", "vdim", "bias", "prefix",
                                       "causal", "mask_mode", "average_weights", "self", NULL};

static attn_causal parse_causal(const char *s) {
  if (strcmp(s, "top_left") == 0) return ATTN_CAUSAL_TOP_LEFT;
  if (strcmp(s, "bottom_right") == 0) return ATTN_CAUSAL_BOTTOM_RIGHT;
  return ATTN_CAUSAL_NONE;
}

/* -1 for "none" (no mask is passed). */
static int parse_mask_mode(const char *s) {
  if (strcmp(s, "keep") == 0) return ATTN_MASK_KEEP;
  if (strcmp(s, "masked") == 0) return ATTN_MASK_MASKED;
  if (strcmp(s, "additive") == 0) return ATTN_MASK_ADDITIVE;
  if (strcmp(s, "seed") == 0) return ATTN_MASK_SEED;
  return -1;
}

/* ---- loading and comparing --------------------------------------------------- */
static int file_exists(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f) fclose(f);
  return f != NULL;
}

static void tfree(attn_tensor *t) {
  if (t->data) attn_tensor_free(t);
  memset(t, 0, sizeof *t);
}

/* Reads golden/<cas>/<file>.npy into t; 0 if absent (and then fails the
 * check when required) or unreadable. */
static int load_npy(attn_ctx *ctx, const char *cas, const char *file, attn_tensor *t, int required) {
  char path[512];
  snprintf(path, sizeof path, "golden/%s/%s.npy", cas, file);
  memset(t, 0, sizeof *t);
  if (!file_exists(path)) {
    CHECK(!required, "%s: missing %s", cas, path);
    return 0;
  }
  attn_status st = attn_npy_read(ctx, t, path);
  CHECK(st == ATTN_OK, "%s: attn_npy_read(%s) -> %s: %s", cas, path, attn_strerror(st), attn_ctx_error(ctx));
  if (st != ATTN_OK) memset(t, 0, sizeof *t);
  return st == ATTN_OK;
}

/* Makes t a contiguous f32 tensor (the inputs were saved as float32 already). */
static int ensure_f32(attn_ctx *ctx, const char *cas, attn_tensor *t) {
  if (!t->data || t->dtype == ATTN_F32) return 1;
  CHECK(t->rank <= 4, "%s: rank %d input", cas, t->rank);
  if (t->rank > 4) return 0;
  attn_tensor c;
  attn_status st = attn_tensor_alloc(ctx, &c, ATTN_F32, t->rank, t->shape);
  CHECK(st == ATTN_OK, "%s: alloc: %s", cas, attn_ctx_error(ctx));
  if (st != ATTN_OK) return 0;
  double *d = tu_to_f64(t);
  int64_t n = attn_tensor_numel(t);
  for (int64_t i = 0; i < n; i++) ((float *)c.data)[i] = (float)d[i];
  free(d);
  tfree(t);
  *t = c;
  return 1;
}

/* A NaN-filled contiguous output shaped like the golden. */
static int alloc_like(attn_ctx *ctx, const char *cas, attn_tensor *out, attn_dtype dtype, const attn_tensor *like) {
  attn_status st = attn_tensor_alloc(ctx, out, dtype, like->rank, like->shape);
  CHECK(st == ATTN_OK, "%s: alloc: %s", cas, attn_ctx_error(ctx));
  if (st != ATTN_OK) {
    memset(out, 0, sizeof *out);
    return 0;
  }
  int64_t n = attn_tensor_numel(out);
  if (dtype == ATTN_F32) {
    tu_poison_f32(out->data, n);
  } else {
    for (int64_t i = 0; i < n; i++) ((double *)out->data)[i] = NAN;
  }
  return 1;
}

static void compare(const char *cas, const char *pass, const char *what, const attn_tensor *got,
                    const attn_tensor *want, double tol) {
  int same = got->rank == want->rank;
  for (int i = 0; same && i < got->rank; i++) same = got->shape[i] == want->shape[i];
  CHECK(same, "%s [%s] %s: shape differs from the golden", cas, pass, what);
  if (!same || want->rank > 4) return;
  int64_t n = attn_tensor_numel(want);
  double *a = tu_to_f64(got), *b = tu_to_f64(want);
  double err = tu_rel_l2(a, b, n);
  int nans = tu_count_nan(a, n);
  CHECK(err <= tol, "%s [%s] %s: rel L2 error %.3g > %.0e (%d NaN of %lld)", cas, pass, what, err, tol, nans,
        (long long)n);
  free(a);
  free(b);
}

static int status_ok(attn_ctx *ctx, attn_status st, const char *cas, const char *pass, const char *call) {
  CHECK(st == ATTN_OK, "%s [%s] %s -> %s: %s", cas, pass, call, attn_strerror(st), attn_ctx_error(ctx));
  return st == ATTN_OK;
}

/* ---- kind=sdpa ------------------------------------------------------------------ */
typedef struct {
  const char *name;
  attn_kernel kernel;
  attn_dtype out_dtype;
  int oracle_call; /* attn_sdpa_ref rather than attn_sdpa */
  int with_weights;
  double tol;
} pass_spec;

static const pass_spec PASSES[] = {
    {"fp32", ATTN_KERNEL_AUTO, ATTN_F32, 0, 1, TOL_FP32},
    {"fp32, no weights", ATTN_KERNEL_AUTO, ATTN_F32, 0, 0, TOL_FP32},
    {"ref, f32 out", ATTN_KERNEL_REF, ATTN_F32, 0, 1, TOL_REF32},
    {"ref, f64 out", ATTN_KERNEL_REF, ATTN_F64, 1, 1, TOL_REF64},
};
#define NUM_PASSES ((int)(sizeof PASSES / sizeof PASSES[0]))

static void run_sdpa_case(attn_ctx *ctx, const char *cas, const manifest *m) {
  check_keys(cas, m, SDPA_KEYS);
  attn_tensor q, k, v, mask, pad, gout, gw, glse, alibi, sinks;
  int ok = load_npy(ctx, cas, "q", &q, 1) & load_npy(ctx, cas, "k", &k, 1) & load_npy(ctx, cas, "v", &v, 1) &
           load_npy(ctx, cas, "out", &gout, 1) & load_npy(ctx, cas, "weights", &gw, 1);
  load_npy(ctx, cas, "lse", &glse, 0);
  int mode = parse_mask_mode(mget(m, "mask_mode", "none"));
  int has_mask = load_npy(ctx, cas, "mask", &mask, mode >= 0);
  int has_pad = load_npy(ctx, cas, "key_padding", &pad, 0);
  int has_alibi = load_npy(ctx, cas, "alibi", &alibi, 0), has_sinks = load_npy(ctx, cas, "sinks", &sinks, 0);
  ok = ok && ensure_f32(ctx, cas, &q) && ensure_f32(ctx, cas, &k) && ensure_f32(ctx, cas, &v);
  if (ok && has_alibi) ok = ensure_f32(ctx, cas, &alibi);
  if (ok && has_sinks) ok = ensure_f32(ctx, cas, &sinks);
  if (ok && mode >= 0) ok = has_mask;

  const char *scale_s = mget(m, "scale", "default");
  double scale = strcmp(scale_s, "default") == 0 ? NAN : strtod(scale_s, NULL);

  for (int p = 0; ok && p < NUM_PASSES; p++) {
    const pass_spec *ps = &PASSES[p];
    attn_tensor out, w, lse;
    memset(&w, 0, sizeof w);
    memset(&lse, 0, sizeof lse);
    if (!status_ok(ctx, attn_ctx_set_kernel(ctx, ps->kernel), cas, ps->name, "attn_ctx_set_kernel")) break;
    if (!alloc_like(ctx, cas, &out, ps->out_dtype, &gout)) break;
    int want_w = ps->with_weights && alloc_like(ctx, cas, &w, ps->out_dtype, &gw);
    /* lse on every pass: without weights, a few query rows take the decode kernel */
    int want_lse = glse.data && alloc_like(ctx, cas, &lse, ps->out_dtype, &glse);

    attn_sdpa_opts o;
    attn_sdpa_opts_init(&o);
    o.scale = scale;
    o.causal = parse_causal(mget(m, "causal", "none"));
    o.window = mget_int(m, "window", 0);
    o.softcap = mget_double(m, "softcap", 0);
    o.dropout_p = mget_double(m, "dropout_p", 0);
    o.dropout_seed = mget_u64(m, "dropout_seed", 0);
    if (has_alibi) o.alibi_slopes = &alibi;
    if (has_sinks) o.sinks = &sinks;
    if (mode >= 0) {
      o.mask = &mask;
      o.mask_mode = (attn_mask_mode)mode;
    }
    if (has_pad) o.key_padding = &pad;

    attn_status st = ps->oracle_call
                         ? attn_sdpa_ref(ctx, &out, want_lse ? &lse : NULL, want_w ? &w : NULL, &q, &k, &v, &o)
                         : attn_sdpa(ctx, &out, want_lse ? &lse : NULL, want_w ? &w : NULL, &q, &k, &v, &o);
    if (status_ok(ctx, st, cas, ps->name, ps->oracle_call ? "attn_sdpa_ref" : "attn_sdpa")) {
      compare(cas, ps->name, "out", &out, &gout, ps->tol);
      if (want_w) compare(cas, ps->name, "weights", &w, &gw, ps->tol);
      if (want_lse) compare(cas, ps->name, "lse", &lse, &glse, ps->tol);
    }
    tfree(&out);
    tfree(&w);
    tfree(&lse);
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  tfree(&q), tfree(&k), tfree(&v), tfree(&mask), tfree(&pad), tfree(&gout), tfree(&gw), tfree(&glse);
  tfree(&alibi), tfree(&sinks);
}

/* ---- kind=mha ------------------------------------------------------------------- */
static void run_mha_case(attn_ctx *ctx, const char *cas, const manifest *m) {
  check_keys(cas, m, MHA_KEYS);
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, mget_int(m, "embed_dim", 0), mget_int(m, "heads", 0));
  cfg.kdim = mget_int(m, "kdim", 0);
  cfg.vdim = mget_int(m, "vdim", 0);
  cfg.bias = (int)mget_int(m, "bias", 1);

  attn_mha *mha = NULL;
  attn_status st = attn_mha_create(ctx, &mha, &cfg);
  if (!status_ok(ctx, st, cas, "setup", "attn_mha_create")) return;
  char path[512];
  snprintf(path, sizeof path, "golden/%s/params.safetensors", cas);
  const char *prefix = mget(m, "prefix", "");
  st = attn_mha_load_safetensors(ctx, mha, path, prefix);
  int ok = status_ok(ctx, st, cas, "setup", "attn_mha_load_safetensors");

  attn_tensor x, key, value, mask, pad, gout, gw;
  int self = (int)mget_int(m, "self", 1);
  ok &= load_npy(ctx, cas, "x", &x, 1) & load_npy(ctx, cas, "out", &gout, 1) & load_npy(ctx, cas, "weights", &gw, 1);
  int has_kv = load_npy(ctx, cas, "key", &key, !self) & load_npy(ctx, cas, "value", &value, !self);
  int mode = parse_mask_mode(mget(m, "mask_mode", "none"));
  int has_mask = load_npy(ctx, cas, "mask", &mask, mode >= 0);
  int has_pad = load_npy(ctx, cas, "key_padding", &pad, 0);
  ok = ok && ensure_f32(ctx, cas, &x);
  if (ok && has_kv) ok = ensure_f32(ctx, cas, &key) && ensure_f32(ctx, cas, &value);
  if (ok && !self) ok = has_kv;
  if (ok && mode >= 0) ok = has_mask;

  for (int p = 0; ok && p < NUM_PASSES; p++) {
    const pass_spec *ps = &PASSES[p];
    attn_tensor out, w;
    memset(&w, 0, sizeof w);
    if (!status_ok(ctx, attn_ctx_set_kernel(ctx, ps->kernel), cas, ps->name, "attn_ctx_set_kernel")) break;
    if (!alloc_like(ctx, cas, &out, ps->out_dtype, &gout)) break;
    int want_w = ps->with_weights && alloc_like(ctx, cas, &w, ps->out_dtype, &gw);

    attn_mha_opts o;
    attn_mha_opts_init(&o);
    o.attn.causal = parse_causal(mget(m, "causal", "none"));
    if (mode >= 0) {
      o.attn.mask = &mask;
      o.attn.mask_mode = (attn_mask_mode)mode;
    }
    if (has_pad) o.attn.key_padding = &pad;
    o.average_weights = (int)mget_int(m, "average_weights", 0);

    st = attn_mha_forward(ctx, mha, &out, want_w ? &w : NULL, &x, has_kv ? &key : NULL, has_kv ? &value : NULL, &o);
    if (status_ok(ctx, st, cas, ps->name, "attn_mha_forward")) {
      compare(cas, ps->name, "out", &out, &gout, ps->tol);
      if (want_w) compare(cas, ps->name, "weights", &w, &gw, ps->tol);
    }
    tfree(&out);
    tfree(&w);
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  tfree(&x), tfree(&key), tfree(&value), tfree(&mask), tfree(&pad), tfree(&gout), tfree(&gw);
  attn_mha_destroy(mha);
}

int main(void) {
  /* ctest runs this again with ATTN_KERNEL set: a kernel this CPU lacks is a skip */
  tu_kernel_or_skip(getenv("ATTN_KERNEL"));
  attn_ctx *ctx = NULL;
  CHECK_OK(ctx, attn_ctx_create(&ctx));
  if (!ctx) return tu_finish("test_golden");

  FILE *index = fopen("golden/INDEX", "r");
  CHECK(index != NULL, "cannot open golden/INDEX (run from tests/; make it with scripts/make_goldens.py)");
  int cases = 0;
  char line[256];
  while (index && fgets(line, sizeof line, index)) {
    strip(line);
    if (!line[0] || line[0] == '#') continue;
    char path[512];
    snprintf(path, sizeof path, "golden/%s/case.txt", line);
    manifest m;
    if (!manifest_read(&m, path)) {
      CHECK(0, "%s: cannot read %s", line, path);
      continue;
    }
    int before = tu_failures;
    const char *kind = mget(&m, "kind", "");
    if (strcmp(kind, "sdpa") == 0) run_sdpa_case(ctx, line, &m);
    else if (strcmp(kind, "mha") == 0) run_mha_case(ctx, line, &m);
    else CHECK(0, "%s: unknown kind '%s'", line, kind);
    printf("  %-24s %s\n", line, tu_failures == before ? "ok" : "FAILED");
    cases++;
  }
  if (index) fclose(index);
  CHECK(cases > 0, "no golden cases listed in golden/INDEX");
  printf("%d golden cases\n", cases);
  attn_ctx_destroy(ctx);
  return tu_finish("test_golden");
}
