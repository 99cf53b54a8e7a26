/* attn: the command line tool. Its flags are a contract that scripts rely on.
 *
 *   attn sdpa --q Q.npy --k K.npy --v V.npy --out O.npy [options]
 *   attn mha  --params P.safetensors --heads H --query X.npy --out O.npy [options]
 *   attn demo
 *   attn version
 *
 * Errors: one line on stderr, exit 1 (bad data) or 2 (bad command line), and
 * no output file left behind. */
#include "cli.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int cli_fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("attn: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  return code;
}

static int in_list(const char *s, const char *const *list) {
  for (; list && *list; list++)
    if (!strcmp(s, *list)) return 1;
  return 0;
}

int cli_parse(cli_args *a, int argc, char **argv, const char *const *known, const char *const *switches) {
  memset(a, 0, sizeof *a);
  for (int i = 0; i < argc; i++) {
    const char *arg = argv[i];
    if (strncmp(arg, "--", 2) != 0) return cli_fail(CLI_EXIT_USAGE, "unexpected argument '%s'", arg);
    const char *eq = strchr(arg, '=');
    size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
    if (len >= sizeof a->name[0]) return cli_fail(CLI_EXIT_USAGE, "unknown flag '%s'", arg);
    char name[sizeof a->name[0]];
    memcpy(name, arg, len);
    name[len] = '\0';
    const int is_switch = in_list(name, switches), is_known = in_list(name, known);
    if (!is_switch && !is_known) return cli_fail(CLI_EXIT_USAGE, "unknown flag '%s' (see 'attn help')", name);
    const char *value = NULL;
    if (eq) value = eq + 1;
    else if (is_known) {
      if (i + 1 >= argc) return cli_fail(CLI_EXIT_USAGE, "%s needs a value", name);
      value = argv[++i];
    }
    /* --causal alone is a switch, --causal=bottom-right picks the alignment */
    if (value && is_switch && strcmp(name, "--causal") != 0) return cli_fail(CLI_EXIT_USAGE, "%s takes no value", name);
    if (cli_get(a, name)) return cli_fail(CLI_EXIT_USAGE, "%s given twice", name);
    if (a->n == CLI_MAX_FLAGS) return cli_fail(CLI_EXIT_USAGE, "too many flags");
    memcpy(a->name[a->n], name, len + 1);
    a->value[a->n] = value;
    a->n++;
  }
  return 0;
}

const char *cli_get(cli_args *a, const char *name) {
  for (int i = 0; i < a->n; i++)
    if (!strcmp(a->name[i], name)) return a->value[i] ? a->value[i] : "";
  return NULL;
}

int cli_has(cli_args *a, const char *name) { return cli_get(a, name) != NULL; }

int cli_int(cli_args *a, const char *name, long long lo, long long hi, long long *out) {
  const char *s = cli_get(a, name);
  if (!s) return 0;
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi)
    return cli_fail(CLI_EXIT_USAGE, "%s wants an integer in %lld..%lld, got '%s'", name, lo, hi, s);
  *out = v;
  return 0;
}

int cli_double(cli_args *a, const char *name, double *out) {
  const char *s = cli_get(a, name);
  if (!s) return 0;
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || end == s || *end) return cli_fail(CLI_EXIT_USAGE, "%s wants a number, got '%s'", name, s);
  *out = v;
  return 0;
}

double cli_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- arrays ------------------------------------------------------------------- */
/* Loads an .npy file; float64 becomes float32 when to_f32. */
static int load_array(attn_ctx *ctx, attn_tensor *t, const char *path, const char *flag, int to_f32) {
  attn_status st = attn_npy_read(ctx, t, path);
  if (st) return cli_fail(CLI_EXIT_FAIL, "%s: %s", flag, attn_ctx_error(ctx));
  if (!to_f32 || t->dtype == ATTN_F32) return 0;
  int r = 0;
  attn_tensor f;
  if (t->dtype != ATTN_F64) {
    r = cli_fail(CLI_EXIT_FAIL, "%s %s: dtype %s; want float32 or float64", flag, path, attn_dtype_name(t->dtype));
  } else if (attn_tensor_alloc(ctx, &f, ATTN_F32, t->rank, t->shape)) {
    r = cli_fail(CLI_EXIT_FAIL, "%s: %s", flag, attn_ctx_error(ctx));
  } else {
    const int64_t n = attn_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) ((float *)f.data)[i] = (float)((const double *)t->data)[i];
  }
  attn_tensor_free(t);
  if (!r) *t = f;
  return r;
}

static int want_rank(const attn_tensor *t, int rank, const char *flag, const char *layout) {
  if (t->rank != rank) return cli_fail(CLI_EXIT_FAIL, "%s must have rank %d %s, got rank %d", flag, rank, layout, t->rank);
  return 0;
}

/* Output files written so far, removed again if a later step fails. */
typedef struct outputs {
  int n;
  const char *path[4];
} outputs;

static int write_output(attn_ctx *ctx, outputs *o, const char *path, const attn_tensor *t, const char *flag) {
  if (attn_npy_write(ctx, path, t)) {
    for (int i = 0; i < o->n; i++) unlink(o->path[i]);
    return cli_fail(CLI_EXIT_FAIL, "%s: %s", flag, attn_ctx_error(ctx));
  }
  o->path[o->n++] = path;
  return 0;
}

static int parse_mask_mode(const char *s, attn_mask_mode *mode) {
  if (!strcmp(s, "keep")) *mode = ATTN_MASK_KEEP;
  else if (!strcmp(s, "masked")) *mode = ATTN_MASK_MASKED;
  else if (!strcmp(s, "additive")) *mode = ATTN_MASK_ADDITIVE;
  else if (!strcmp(s, "seed")) *mode = ATTN_MASK_SEED;
  else return cli_fail(CLI_EXIT_USAGE, "--mask-mode wants keep, masked, additive or seed, got '%s'", s);
  return 0;
}

static int parse_causal(cli_args *a, attn_causal *c) {
  const char *s = cli_get(a, "--causal");
  *c = ATTN_CAUSAL_NONE;
  if (!s) return 0;
  if (!*s || !strcmp(s, "top-left")) *c = ATTN_CAUSAL_TOP_LEFT;
  else if (!strcmp(s, "bottom-right")) *c = ATTN_CAUSAL_BOTTOM_RIGHT;
  else return cli_fail(CLI_EXIT_USAGE, "--causal wants nothing, =top-left or =bottom-right, got '%s'", s);
  return 0;
}

/* The mask mode: --mask-mode if given, else the call's rule for bool masks, additive for float. */
static int mask_mode_for(cli_args *a, const attn_tensor *mask, attn_mask_mode bool_default, attn_mask_mode *mode) {
  const char *s = cli_get(a, "--mask-mode");
  if (s) return parse_mask_mode(s, mode);
  *mode = (mask->dtype == ATTN_BOOL || mask->dtype == ATTN_U8) ? bool_default : ATTN_MASK_ADDITIVE;
  return 0;
}

static int setup_ctx(attn_ctx **ctx, cli_args *a) {
  long long threads = 0;
  int r = cli_int(a, "--threads", 0, 4096, &threads);
  if (r) return r;
  if (attn_ctx_create(ctx)) return cli_fail(CLI_EXIT_FAIL, "out of memory");
  attn_ctx_set_threads(*ctx, (int)threads);
  return 0;
}

/* ---- attn sdpa ---------------------------------------------------------------- */
static int cmd_sdpa(int argc, char **argv) {
  static const char *const known[] = {"--q", "--k", "--v", "--out", "--mask", "--mask-mode", "--scale",
                                      "--weights-out", "--threads", NULL};
  static const char *const switches[] = {"--causal", NULL};
  cli_args a;
  int r = cli_parse(&a, argc, argv, known, switches);
  if (r) return r;
  const char *need[] = {"--q", "--k", "--v", "--out"};
  for (int i = 0; i < 4; i++)
    if (!cli_get(&a, need[i]) || !*cli_get(&a, need[i])) return cli_fail(CLI_EXIT_USAGE, "sdpa needs %s", need[i]);
  attn_causal causal;
  double scale = NAN;
  if ((r = parse_causal(&a, &causal)) || (r = cli_double(&a, "--scale", &scale))) return r;
  if (cli_has(&a, "--mask-mode") && !cli_has(&a, "--mask"))
    return cli_fail(CLI_EXIT_USAGE, "--mask-mode needs --mask");
  attn_ctx *ctx = NULL;
  if ((r = setup_ctx(&ctx, &a))) return r;
  attn_tensor q = {0}, k = {0}, v = {0}, mask = {0}, out = {0}, w = {0};
  outputs outs = {0};
  if ((r = load_array(ctx, &q, cli_get(&a, "--q"), "--q", 1)) || (r = want_rank(&q, 4, "--q", "[B, H, Nq, D]")) ||
      (r = load_array(ctx, &k, cli_get(&a, "--k"), "--k", 1)) || (r = want_rank(&k, 4, "--k", "[B, Hk, Nk, D]")) ||
      (r = load_array(ctx, &v, cli_get(&a, "--v"), "--v", 1)) || (r = want_rank(&v, 4, "--v", "[B, Hk, Nk, Dv]")))
    goto done;
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.scale = scale;
  o.causal = causal;
  if (cli_has(&a, "--mask")) {
    if ((r = load_array(ctx, &mask, cli_get(&a, "--mask"), "--mask", 0)) ||
        (r = mask_mode_for(&a, &mask, ATTN_MASK_KEEP, &o.mask_mode)))
      goto done;
    o.mask = &mask;
  }
  int64_t oshape[4] = {q.shape[0], q.shape[1], q.shape[2], v.shape[3]};
  if (attn_tensor_alloc(ctx, &out, ATTN_F32, 4, oshape)) {
    r = cli_fail(CLI_EXIT_FAIL, "%s", attn_ctx_error(ctx));
    goto done;
  }
  if (cli_has(&a, "--weights-out")) {
    int64_t wshape[4] = {q.shape[0], q.shape[1], q.shape[2], k.shape[2]};
    if (attn_tensor_alloc(ctx, &w, ATTN_F32, 4, wshape)) {
      r = cli_fail(CLI_EXIT_FAIL, "%s", attn_ctx_error(ctx));
      goto done;
    }
    o.weights = &w;
  }
  if (attn_sdpa(ctx, &out, &q, &k, &v, &o)) {
    r = cli_fail(CLI_EXIT_FAIL, "sdpa: %s", attn_ctx_error(ctx));
    goto done;
  }
  if ((r = write_output(ctx, &outs, cli_get(&a, "--out"), &out, "--out"))) goto done;
  if (o.weights && (r = write_output(ctx, &outs, cli_get(&a, "--weights-out"), &w, "--weights-out"))) goto done;
done:
  attn_tensor_free(&q); attn_tensor_free(&k); attn_tensor_free(&v);
  attn_tensor_free(&mask); attn_tensor_free(&out); attn_tensor_free(&w);
  attn_ctx_destroy(ctx);
  return r;
}

/* ---- attn mha ----------------------------------------------------------------- */
static int cmd_mha(int argc, char **argv) {
  static const char *const known[] = {"--params", "--prefix", "--heads", "--kv-heads", "--query", "--key",
                                      "--value", "--out", "--mask", "--mask-mode", "--key-padding",
                                      "--weights-out", "--threads", NULL};
  static const char *const switches[] = {"--causal", "--average-weights", NULL};
  cli_args a;
  int r = cli_parse(&a, argc, argv, known, switches);
  if (r) return r;
  const char *need[] = {"--params", "--heads", "--query", "--out"};
  for (int i = 0; i < 4; i++)
    if (!cli_get(&a, need[i]) || !*cli_get(&a, need[i])) return cli_fail(CLI_EXIT_USAGE, "mha needs %s", need[i]);
  if (cli_has(&a, "--key") != cli_has(&a, "--value")) return cli_fail(CLI_EXIT_USAGE, "give both --key and --value, or neither");
  if (cli_has(&a, "--mask-mode") && !cli_has(&a, "--mask")) return cli_fail(CLI_EXIT_USAGE, "--mask-mode needs --mask");
  if (cli_has(&a, "--average-weights") && !cli_has(&a, "--weights-out"))
    return cli_fail(CLI_EXIT_USAGE, "--average-weights needs --weights-out");
  long long heads = 0, kv_heads = 0;
  attn_causal causal;
  if ((r = cli_int(&a, "--heads", 1, 1 << 20, &heads)) || (r = cli_int(&a, "--kv-heads", 1, 1 << 20, &kv_heads)) ||
      (r = parse_causal(&a, &causal)))
    return r;
  attn_ctx *ctx = NULL;
  if ((r = setup_ctx(&ctx, &a))) return r;
  attn_mha *mha = NULL;
  attn_tensor x = {0}, key = {0}, value = {0}, mask = {0}, kpm = {0}, out = {0}, w = {0};
  outputs outs = {0};
  const char *prefix = cli_get(&a, "--prefix");
  if (attn_mha_create_from_safetensors(ctx, &mha, cli_get(&a, "--params"), prefix ? prefix : "", heads, kv_heads)) {
    r = cli_fail(CLI_EXIT_FAIL, "--params: %s", attn_ctx_error(ctx));
    goto done;
  }
  if ((r = load_array(ctx, &x, cli_get(&a, "--query"), "--query", 1)) || (r = want_rank(&x, 3, "--query", "[B, N, E]")))
    goto done;
  const int cross = cli_has(&a, "--key");
  if (cross && ((r = load_array(ctx, &key, cli_get(&a, "--key"), "--key", 1)) ||
                (r = want_rank(&key, 3, "--key", "[B, Nk, kdim]")) ||
                (r = load_array(ctx, &value, cli_get(&a, "--value"), "--value", 1)) ||
                (r = want_rank(&value, 3, "--value", "[B, Nk, vdim]"))))
    goto done;
  const int64_t B = x.shape[0], Nq = x.shape[1], Nk = cross ? key.shape[1] : Nq;
  attn_mha_opts o;
  attn_mha_opts_init(&o);
  o.causal = causal;
  if (cli_has(&a, "--mask")) {
    if ((r = load_array(ctx, &mask, cli_get(&a, "--mask"), "--mask", 0)) ||
        (r = mask_mode_for(&a, &mask, ATTN_MASK_MASKED, &o.mask_mode)))
      goto done;
    /* nn.MultiheadAttention's 3-D mask is [B*H, Nq, Nk]: view it as [B, H, Nq, Nk] */
    if (mask.rank == 3 && mask.shape[0] == B * heads && heads > 1) {
      mask.rank = 4;
      mask.shape[3] = mask.shape[2]; mask.strides[3] = mask.strides[2];
      mask.shape[2] = mask.shape[1]; mask.strides[2] = mask.strides[1];
      mask.shape[1] = heads; mask.strides[1] = mask.strides[0];
      mask.shape[0] = B; mask.strides[0] = mask.strides[0] * heads;
    }
    o.mask = &mask;
  }
  if (cli_has(&a, "--key-padding")) {
    if ((r = load_array(ctx, &kpm, cli_get(&a, "--key-padding"), "--key-padding", 0))) goto done;
    o.key_padding = &kpm;
  }
  const attn_mha_config *cfg = attn_mha_get_config(mha);
  int64_t oshape[3] = {B, Nq, cfg->embed_dim};
  if (attn_tensor_alloc(ctx, &out, ATTN_F32, 3, oshape)) {
    r = cli_fail(CLI_EXIT_FAIL, "%s", attn_ctx_error(ctx));
    goto done;
  }
  if (cli_has(&a, "--weights-out")) {
    o.average_weights = cli_has(&a, "--average-weights");
    int64_t ws4[4] = {B, heads, Nq, Nk}, ws3[3] = {B, Nq, Nk};
    if (attn_tensor_alloc(ctx, &w, ATTN_F32, o.average_weights ? 3 : 4, o.average_weights ? ws3 : ws4)) {
      r = cli_fail(CLI_EXIT_FAIL, "%s", attn_ctx_error(ctx));
      goto done;
    }
    o.weights = &w;
  }
  if (attn_mha_forward(ctx, mha, &out, &x, cross ? &key : NULL, cross ? &value : NULL, &o)) {
    r = cli_fail(CLI_EXIT_FAIL, "mha: %s", attn_ctx_error(ctx));
    goto done;
  }
  if ((r = write_output(ctx, &outs, cli_get(&a, "--out"), &out, "--out"))) goto done;
  if (o.weights && (r = write_output(ctx, &outs, cli_get(&a, "--weights-out"), &w, "--weights-out"))) goto done;
done:
  attn_tensor_free(&x); attn_tensor_free(&key); attn_tensor_free(&value); attn_tensor_free(&mask);
  attn_tensor_free(&kpm); attn_tensor_free(&out); attn_tensor_free(&w);
  attn_mha_destroy(mha);
  attn_ctx_destroy(ctx);
  return r;
}

static void usage(FILE *f) {
  fputs("usage: attn <command> [flags]\n"
        "  attn demo                         the seed's layer on a built-in example\n"
        "  attn sdpa --q Q.npy --k K.npy --v V.npy --out O.npy\n"
        "            [--mask M.npy --mask-mode keep|masked|additive|seed] [--causal | --causal=bottom-right]\n"
        "            [--scale S] [--weights-out W.npy] [--threads N]\n"
        "  attn mha  --params P.safetensors [--prefix PFX] --heads H [--kv-heads G] --query X.npy\n"
        "            [--key K.npy --value V.npy] --out O.npy [--mask M.npy --mask-mode ...]\n"
        "            [--key-padding KP.npy] [--causal] [--weights-out W.npy] [--average-weights] [--threads N]\n"
        "  attn bench sdpa --batch B --heads H [--kv-heads G] --seq N [--kv-seq M] --dim D [--causal]\n"
        "            [--threads T] [--repeat R] [--kernel K] [--json]\n"
        "  attn bench mha --batch B --seq N --embed E --heads H [--threads T] [--repeat R] [--json]\n"
        "  attn version\n"
        "Arrays are .npy (float32; float64 is converted). q/k/v are [B, H, N, D]; mha inputs are [B, N, E].\n"
        "A bool mask means keep (sdpa) or masked (mha) unless --mask-mode says otherwise; a float mask is additive.\n",
        f);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return CLI_EXIT_USAGE;
  }
  const char *cmd = argv[1];
  if (!strcmp(cmd, "sdpa")) return cmd_sdpa(argc - 2, argv + 2);
  if (!strcmp(cmd, "mha")) return cmd_mha(argc - 2, argv + 2);
  if (!strcmp(cmd, "demo")) return cmd_demo(argc - 2, argv + 2);
  if (!strcmp(cmd, "bench")) return cmd_bench(argc - 2, argv + 2);
  if (!strcmp(cmd, "version") || !strcmp(cmd, "--version")) {
    printf("attn %s (kernel: %s)\n", attn_version_string(), attn_kernel_name(attn_ctx_kernel(NULL)));
    return 0;
  }
  if (!strcmp(cmd, "help") || !strcmp(cmd, "--help") || !strcmp(cmd, "-h")) {
    usage(stdout);
    return 0;
  }
  return cli_fail(CLI_EXIT_USAGE, "unknown command '%s' (see 'attn help')", cmd);
}
