/* attn: the command line tool. Its flags are a contract that scripts rely on.
 *
 *   attn sdpa --q Q.npy --k K.npy --v V.npy --out O.npy [options]
 *             [--grad-out G.npy --dq-out DQ.npy --dk-out DK.npy --dv-out DV.npy --mask-grad-out DM.npy]
 *   attn mha  --params P.safetensors --heads H --query X.npy --out O.npy [options]
 *             [--grad-out G.npy --grads-out GRADS.safetensors]
 *   attn map  --params P.safetensors --heads H --query X.npy --png OUT.png [--tokens T.txt]  (tools/map.c)
 *   attn map  --weights W.npy --png OUT.png [--tokens T.txt]
 *   attn bench sdpa|mha|decode ...  (tools/bench.c)
 *   attn demo
 *   attn version
 *   attn help [COMMAND], attn COMMAND --help
 *
 * Errors: one line on stderr, exit 1 (bad data) or 2 (bad command line). The
 * outputs are staged (tools/outputs.c): a failed command changes no file it
 * did not create. */
#include "cli.h"
#include "internal.h" /* half-precision rounding for --kv-dtype */

#include <ctype.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Escapes one byte of an error message: the line must stay one line whatever a
 * path or a library message holds (a newline, a terminal escape, stray UTF-8). */
static size_t escape_byte(char *dst, unsigned char c) {
  if (c >= 0x20 && c < 0x7f) {
    dst[0] = (char)c;
    return 1;
  }
  if (c == '\n') return (size_t)sprintf(dst, "\\n");
  if (c == '\r') return (size_t)sprintf(dst, "\\r");
  if (c == '\t') return (size_t)sprintf(dst, "\\t");
  return (size_t)sprintf(dst, "\\x%02x", c);
}

#define CLI_MSG_MAX 1024

int cli_fail(int code, const char *fmt, ...) {
  char msg[CLI_MSG_MAX], line[4 * CLI_MSG_MAX + 8];
  va_list ap;
  va_start(ap, fmt);
  const int n = vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  size_t j = 0;
  for (const char *p = n > 0 ? msg : ""; *p; p++) j += escape_byte(line + j, (unsigned char)*p);
  if (n >= (int)sizeof msg) j += (size_t)sprintf(line + j, "...");
  line[j] = '\0';
  fprintf(stderr, "attn: %s\n", line);
  return code;
}

/* Four buffers in turn: one message may show up to four values. */
const char *cli_show(const char *s) {
  static char buf[4][CLI_SHOW_MAX + 4];
  static int next;
  char *b = buf[next];
  next = (next + 1) % 4;
  const size_t n = strlen(s);
  if (n <= CLI_SHOW_MAX) return s;
  memcpy(b, s, CLI_SHOW_MAX);
  memcpy(b + CLI_SHOW_MAX, "...", 4);
  return b;
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
    if (strncmp(arg, "--", 2) != 0) return cli_fail(CLI_EXIT_USAGE, "unexpected argument '%s'", cli_show(arg));
    const char *eq = strchr(arg, '=');
    size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
    if (len >= sizeof a->name[0]) return cli_fail(CLI_EXIT_USAGE, "unknown flag '%s'", cli_show(arg));
    char name[sizeof a->name[0]];
    memcpy(name, arg, len);
    name[len] = '\0';
    const int is_switch = in_list(name, switches), is_known = in_list(name, known);
    if (!is_switch && !is_known) return cli_fail(CLI_EXIT_USAGE, "unknown flag '%s' (see 'attn help')", cli_show(name));
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
    return cli_fail(CLI_EXIT_USAGE, "%s wants an integer in %lld..%lld, got '%s'", name, lo, hi, cli_show(s));
  *out = v;
  return 0;
}

int cli_double(cli_args *a, const char *name, double *out) {
  const char *s = cli_get(a, name);
  if (!s) return 0;
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  /* ERANGE also flags an underflow (1e-320 is a subnormal): only an overflow is refused */
  if ((errno && fabs(v) > 1.0) || end == s || *end)
    return cli_fail(CLI_EXIT_USAGE, "%s wants a number, got '%s'", name, cli_show(s));
  *out = v;
  return 0;
}

int cli_u64(cli_args *a, const char *name, uint64_t *out) {
  const char *s = cli_get(a, name);
  if (!s) return 0;
  char *end;
  errno = 0;
  const unsigned long long v = isdigit((unsigned char)*s) ? strtoull(s, &end, 10) : 0;
  if (!isdigit((unsigned char)*s) || errno || *end || v > UINT64_MAX)
    return cli_fail(CLI_EXIT_USAGE, "%s wants an unsigned 64-bit integer, got '%s'", name, cli_show(s));
  *out = (uint64_t)v;
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
    r = cli_fail(CLI_EXIT_FAIL, "%s '%s': dtype %s; want float32 or float64", flag, cli_show(path), attn_dtype_name(t->dtype));
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

/* Writes t as .npy into a staged temporary for flag's output (renamed into place by cli_outputs_commit). */
static int write_output(attn_ctx *ctx, cli_outputs *o, const char *flag, const attn_tensor *t) {
  const char *tmp = cli_outputs_stage(o, flag);
  if (!tmp) return CLI_EXIT_FAIL;
  if (attn_npy_write(ctx, tmp, t)) return cli_fail(CLI_EXIT_FAIL, "%s: %s", flag, attn_ctx_error(ctx));
  return 0;
}

static int write_safetensors_output(attn_ctx *ctx, cli_outputs *o, const char *flag, int64_t count,
                                    const char *const *names, const attn_tensor *t) {
  const char *tmp = cli_outputs_stage(o, flag);
  if (!tmp) return CLI_EXIT_FAIL;
  if (attn_safetensors_write(ctx, tmp, count, names, t)) return cli_fail(CLI_EXIT_FAIL, "%s: %s", flag, attn_ctx_error(ctx));
  return 0;
}

static int parse_mask_mode(const char *s, attn_mask_mode *mode) {
  if (!strcmp(s, "keep")) *mode = ATTN_MASK_KEEP;
  else if (!strcmp(s, "masked")) *mode = ATTN_MASK_MASKED;
  else if (!strcmp(s, "additive")) *mode = ATTN_MASK_ADDITIVE;
  else if (!strcmp(s, "seed")) *mode = ATTN_MASK_SEED;
  else return cli_fail(CLI_EXIT_USAGE, "--mask-mode wants keep, masked, additive or seed, got '%s'", cli_show(s));
  return 0;
}

static int parse_causal(cli_args *a, attn_causal *c) {
  const char *s = cli_get(a, "--causal");
  *c = ATTN_CAUSAL_NONE;
  if (!s) return 0;
  if (!*s || !strcmp(s, "top-left")) *c = ATTN_CAUSAL_TOP_LEFT;
  else if (!strcmp(s, "bottom-right")) *c = ATTN_CAUSAL_BOTTOM_RIGHT;
  else return cli_fail(CLI_EXIT_USAGE, "--causal wants nothing, =top-left or =bottom-right, got '%s'", cli_show(s));
  return 0;
}

/* --dropout P (in [0, 1)) and --seed S (needs --dropout; default 0). */
static int parse_dropout(cli_args *a, double *p, uint64_t *seed) {
  *p = 0;
  *seed = 0;
  int r;
  if (cli_has(a, "--seed") && !cli_has(a, "--dropout")) return cli_fail(CLI_EXIT_USAGE, "--seed needs --dropout");
  if ((r = cli_double(a, "--dropout", p))) return r;
  if (!(*p >= 0 && *p < 1))
    return cli_fail(CLI_EXIT_USAGE, "--dropout wants a probability in [0, 1), got '%s'", cli_show(cli_get(a, "--dropout")));
  return cli_u64(a, "--seed", seed);
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

static int alloc_f32(attn_ctx *ctx, attn_tensor *t, int rank, const int64_t *shape) {
  if (attn_tensor_alloc(ctx, t, ATTN_F32, rank, shape)) return cli_fail(CLI_EXIT_FAIL, "%s", attn_ctx_error(ctx));
  return 0;
}

/* --window W (>= 0, 0 = off) and --softcap C (finite, >= 0, 0 = off): checked before any file is read. */
static int parse_window_softcap(cli_args *a, int64_t *window, double *softcap) {
  long long w = 0;
  int r;
  *softcap = 0;
  if ((r = cli_int(a, "--window", 0, (long long)1 << 62, &w)) || (r = cli_double(a, "--softcap", softcap))) return r;
  if (!(*softcap >= 0) || !isfinite(*softcap))
    return cli_fail(CLI_EXIT_USAGE, "--softcap wants a finite number >= 0 (0 = off), got '%s'", cli_show(cli_get(a, "--softcap")));
  *window = (int64_t)w;
  return 0;
}

/* --alibi: the paper's slopes for heads query heads; --sinks S.npy: f32 [heads] (the call checks the length). */
static int load_head_options(attn_ctx *ctx, cli_args *a, int64_t heads, attn_tensor *slopes, attn_tensor *sinks) {
  int r;
  if (cli_has(a, "--alibi")) {
    if ((r = alloc_f32(ctx, slopes, 1, &heads))) return r;
    if (attn_alibi_slopes(slopes->data, heads)) return cli_fail(CLI_EXIT_FAIL, "--alibi: no slopes for %lld heads", (long long)heads);
  }
  if (cli_has(a, "--sinks") &&
      ((r = load_array(ctx, sinks, cli_get(a, "--sinks"), "--sinks", 1)) || (r = want_rank(sinks, 1, "--sinks", "[H]"))))
    return r;
  return 0;
}

/* ---- attn sdpa ---------------------------------------------------------------- */
/* The gradient of a mask that broadcast to [B, Hq, Nq, Nk]: mg (contiguous
 * [B, Hq, Nq, Nk]) summed over the dimensions the mask broadcast along, into
 * dm (f32, the mask's own shape). Sums run in double, in a fixed order. */
static int reduce_mask_grad(attn_ctx *ctx, attn_tensor *dm, const attn_tensor *mg, const attn_tensor *mask) {
  int r = alloc_f32(ctx, dm, mask->rank, mask->shape);
  if (r) return r;
  const int64_t n = attn_tensor_numel(dm);
  double *acc = calloc(n > 0 ? (size_t)n : 1, sizeof *acc);
  if (!acc) return cli_fail(CLI_EXIT_FAIL, "out of memory");
  int64_t cs[ATTN_MAX_RANK], st[4];
  for (int d = mask->rank - 1; d >= 0; d--) cs[d] = d == mask->rank - 1 ? 1 : cs[d + 1] * mask->shape[d + 1];
  const int off = 4 - mask->rank; /* right-aligned, as numpy broadcasts */
  for (int d = 0; d < 4; d++) st[d] = (d < off || mask->shape[d - off] == 1) ? 0 : cs[d - off];
  const float *g = mg->data;
  for (int64_t b = 0; b < mg->shape[0]; b++)
    for (int64_t h = 0; h < mg->shape[1]; h++)
      for (int64_t i = 0; i < mg->shape[2]; i++) {
        double *row = acc + b * st[0] + h * st[1] + i * st[2];
        for (int64_t j = 0; j < mg->shape[3]; j++) row[j * st[3]] += *g++;
      }
  for (int64_t e = 0; e < n; e++) ((float *)dm->data)[e] = (float)acc[e];
  free(acc);
  return 0;
}

/* --kv-dtype f32|f16|bf16: k and v rounded to that type before attention. The
 * forward then reads them stored as halves; the backward (f32 only) reads the
 * rounded values in f32, which is the same function. */
static int kv_dtype(attn_ctx *ctx, cli_args *a, attn_tensor *k, attn_tensor *v, int backward) {
  const char *s = cli_get(a, "--kv-dtype");
  if (!s || !strcmp(s, "f32")) return 0;
  attn_dtype dt;
  if (!strcmp(s, "f16")) dt = ATTN_F16;
  else if (!strcmp(s, "bf16")) dt = ATTN_BF16;
  else return cli_fail(CLI_EXIT_USAGE, "--kv-dtype wants f32, f16 or bf16, got '%s'", cli_show(s));
  attn_tensor *t[2] = {k, v};
  for (int i = 0; i < 2; i++) {
    attn_tensor h;
    if (attn_tensor_alloc(ctx, &h, dt, 4, t[i]->shape)) return cli_fail(CLI_EXIT_FAIL, "out of memory");
    const int64_t n = attn_tensor_numel(t[i]);
    float *f = t[i]->data; /* load_array gives contiguous f32 */
    for (int64_t e = 0; e < n; e++) {
      attn__store(h.data, dt, e, f[e]);
      if (backward) f[e] = (float)attn__load(h.data, dt, e);
    }
    if (backward) {
      attn_tensor_free(&h);
    } else {
      attn_tensor_free(t[i]);
      *t[i] = h;
    }
  }
  return 0;
}

static int cmd_sdpa(int argc, char **argv) {
  static const char *const known[] = {"--q", "--k", "--v", "--out", "--mask", "--mask-mode", "--scale",
                                      "--weights-out", "--threads", "--key-padding", "--grad-out", "--dq-out",
                                      "--dk-out", "--dv-out", "--mask-grad-out", "--dropout", "--seed",
                                      "--window", "--softcap", "--sinks", "--sinks-grad-out", "--kv-dtype", NULL};
  static const char *const switches[] = {"--causal", "--alibi", NULL};
  static const char *const out_flags[] = {"--out", "--weights-out", "--dq-out", "--dk-out", "--dv-out",
                                          "--mask-grad-out", "--sinks-grad-out", NULL};
  static const char *const in_flags[] = {"--q", "--k", "--v", "--mask", "--key-padding", "--grad-out", "--sinks", NULL};
  cli_args a;
  int r = cli_parse(&a, argc, argv, known, switches);
  if (r) return r;
  const char *need[] = {"--q", "--k", "--v", "--out"};
  for (int i = 0; i < 4; i++)
    if (!cli_get(&a, need[i]) || !*cli_get(&a, need[i])) return cli_fail(CLI_EXIT_USAGE, "sdpa needs %s", need[i]);
  attn_causal causal;
  double scale = NAN, dropout = 0;
  uint64_t seed = 0;
  int64_t window = 0;
  double softcap = 0;
  if ((r = parse_causal(&a, &causal)) || (r = cli_double(&a, "--scale", &scale)) ||
      (r = parse_dropout(&a, &dropout, &seed)) || (r = parse_window_softcap(&a, &window, &softcap)))
    return r;
  /* the fp32 kernels scale in float: a larger scale (or inf, or NaN, the default's marker) is no scale */
  if (cli_has(&a, "--scale") && !(fabs(scale) <= FLT_MAX))
    return cli_fail(CLI_EXIT_USAGE, "--scale wants a number finite in float32 (|S| <= %.4g), got '%s'", (double)FLT_MAX,
                    cli_show(cli_get(&a, "--scale")));
  attn_mask_mode mode_flag = ATTN_MASK_KEEP;
  if (cli_has(&a, "--mask-mode")) {
    if (!cli_has(&a, "--mask")) return cli_fail(CLI_EXIT_USAGE, "--mask-mode needs --mask");
    if ((r = parse_mask_mode(cli_get(&a, "--mask-mode"), &mode_flag))) return r;
  }
  /* the backward: --grad-out G with at least one gradient output, and none without it */
  const int want_dq = cli_has(&a, "--dq-out"), want_dk = cli_has(&a, "--dk-out"), want_dv = cli_has(&a, "--dv-out");
  const int want_dm = cli_has(&a, "--mask-grad-out"), want_ds = cli_has(&a, "--sinks-grad-out");
  const int backward = cli_has(&a, "--grad-out");
  if (backward && !want_dq && !want_dk && !want_dv && !want_dm && !want_ds)
    return cli_fail(CLI_EXIT_USAGE,
                    "--grad-out needs at least one of --dq-out, --dk-out, --dv-out, --mask-grad-out, --sinks-grad-out");
  if (!backward && (want_dq || want_dk || want_dv || want_dm || want_ds))
    return cli_fail(CLI_EXIT_USAGE, "%s needs --grad-out",
                    want_dq ? "--dq-out" : want_dk ? "--dk-out" : want_dv ? "--dv-out" : want_dm ? "--mask-grad-out"
                                                                                                 : "--sinks-grad-out");
  if (want_ds && !cli_has(&a, "--sinks")) return cli_fail(CLI_EXIT_USAGE, "--sinks-grad-out needs --sinks");
  if (backward && !*cli_get(&a, "--grad-out")) return cli_fail(CLI_EXIT_USAGE, "--grad-out needs a file name");
  if (want_dm && !cli_has(&a, "--mask")) return cli_fail(CLI_EXIT_USAGE, "--mask-grad-out needs --mask");
  if (want_dm && cli_has(&a, "--mask-mode") && mode_flag != ATTN_MASK_ADDITIVE)
    return cli_fail(CLI_EXIT_USAGE, "--mask-grad-out needs an additive mask, not --mask-mode %s",
                    cli_show(cli_get(&a, "--mask-mode")));
  attn_ctx *ctx = NULL;
  if ((r = setup_ctx(&ctx, &a))) return r;
  attn_tensor q = {0}, k = {0}, v = {0}, mask = {0}, kpm = {0}, out = {0}, w = {0};
  attn_tensor *wp = NULL; /* &w once --weights-out asks for it */
  attn_tensor g = {0}, lse = {0}, dq = {0}, dk = {0}, dv = {0}, mg = {0}, dm = {0};
  attn_tensor slopes = {0}, sinks = {0}, ds = {0};
  cli_outputs outs;
  if ((r = cli_outputs_plan(&outs, &a, out_flags, in_flags))) goto done;
  if ((r = load_array(ctx, &q, cli_get(&a, "--q"), "--q", 1)) || (r = want_rank(&q, 4, "--q", "[B, H, Nq, D]")) ||
      (r = load_array(ctx, &k, cli_get(&a, "--k"), "--k", 1)) || (r = want_rank(&k, 4, "--k", "[B, Hk, Nk, D]")) ||
      (r = load_array(ctx, &v, cli_get(&a, "--v"), "--v", 1)) || (r = want_rank(&v, 4, "--v", "[B, Hk, Nk, Dv]")) ||
      (r = kv_dtype(ctx, &a, &k, &v, backward)))
    goto done;
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.scale = scale;
  o.causal = causal;
  o.dropout_p = dropout;
  o.dropout_seed = seed;
  o.window = window;
  o.softcap = softcap;
  if ((r = load_head_options(ctx, &a, q.shape[1], &slopes, &sinks))) goto done;
  o.alibi_slopes = cli_has(&a, "--alibi") ? &slopes : NULL;
  o.sinks = cli_has(&a, "--sinks") ? &sinks : NULL;
  if (cli_has(&a, "--mask")) {
    if ((r = load_array(ctx, &mask, cli_get(&a, "--mask"), "--mask", 0)) ||
        (r = mask_mode_for(&a, &mask, ATTN_MASK_KEEP, &o.mask_mode)))
      goto done;
    if (want_dm && o.mask_mode != ATTN_MASK_ADDITIVE) {
      r = cli_fail(CLI_EXIT_FAIL, "--mask-grad-out needs an additive (float) mask; '%s' is %s", cli_show(cli_get(&a, "--mask")),
                   attn_dtype_name(mask.dtype));
      goto done;
    }
    o.mask = &mask;
  }
  if (cli_has(&a, "--key-padding")) {
    if ((r = load_array(ctx, &kpm, cli_get(&a, "--key-padding"), "--key-padding", 0))) goto done;
    o.key_padding = &kpm;
  }
  if (backward && ((r = load_array(ctx, &g, cli_get(&a, "--grad-out"), "--grad-out", 1)) ||
                   (r = want_rank(&g, 4, "--grad-out", "[B, H, Nq, Dv]"))))
    goto done;
  int64_t oshape[4] = {q.shape[0], q.shape[1], q.shape[2], v.shape[3]};
  if ((r = alloc_f32(ctx, &out, 4, oshape))) goto done;
  if (cli_has(&a, "--weights-out")) {
    int64_t wshape[4] = {q.shape[0], q.shape[1], q.shape[2], k.shape[2]};
    if ((r = alloc_f32(ctx, &w, 4, wshape))) goto done;
    wp = &w;
  }
  if (backward && (r = alloc_f32(ctx, &lse, 3, q.shape))) goto done;
  if (attn_sdpa(ctx, &out, backward ? &lse : NULL, wp, &q, &k, &v, &o)) {
    r = cli_fail(CLI_EXIT_FAIL, "sdpa: %s", attn_ctx_error(ctx));
    goto done;
  }
  if (backward) {
    /* the forward has checked the shapes: every gradient is computed, the asked-for ones written */
    int64_t mshape[4] = {q.shape[0], q.shape[1], q.shape[2], k.shape[2]};
    if ((r = alloc_f32(ctx, &dq, 4, q.shape)) || (r = alloc_f32(ctx, &dk, 4, k.shape)) ||
        (r = alloc_f32(ctx, &dv, 4, v.shape)) || (want_dm && (r = alloc_f32(ctx, &mg, 4, mshape))) ||
        (want_ds && (r = alloc_f32(ctx, &ds, 1, sinks.shape))))
      goto done;
    if (attn_sdpa_backward(ctx, &dq, &dk, &dv, want_dm ? &mg : NULL, want_ds ? &ds : NULL, &g, &q, &k, &v, &out, &lse,
                           &o)) {
      r = cli_fail(CLI_EXIT_FAIL, "sdpa backward: %s", attn_ctx_error(ctx));
      goto done;
    }
    if (want_dm && (r = reduce_mask_grad(ctx, &dm, &mg, &mask))) goto done;
  }
  if ((r = write_output(ctx, &outs, "--out", &out)) || (wp && (r = write_output(ctx, &outs, "--weights-out", &w))) ||
      (want_dq && (r = write_output(ctx, &outs, "--dq-out", &dq))) ||
      (want_dk && (r = write_output(ctx, &outs, "--dk-out", &dk))) ||
      (want_dv && (r = write_output(ctx, &outs, "--dv-out", &dv))) ||
      (want_dm && (r = write_output(ctx, &outs, "--mask-grad-out", &dm))) ||
      (want_ds && (r = write_output(ctx, &outs, "--sinks-grad-out", &ds))) || (r = cli_outputs_commit(&outs)))
    goto done;
done:
  cli_outputs_free(&outs);
  attn_tensor_free(&q); attn_tensor_free(&k); attn_tensor_free(&v); attn_tensor_free(&mask);
  attn_tensor_free(&kpm); attn_tensor_free(&out); attn_tensor_free(&w); attn_tensor_free(&g);
  attn_tensor_free(&lse); attn_tensor_free(&dq); attn_tensor_free(&dk); attn_tensor_free(&dv);
  attn_tensor_free(&mg); attn_tensor_free(&dm);
  attn_tensor_free(&slopes); attn_tensor_free(&sinks); attn_tensor_free(&ds);
  attn_ctx_destroy(ctx);
  return r;
}

/* ---- attn mha ----------------------------------------------------------------- */
/* The parameter naming of a safetensors file, as the library detects it. */
typedef attn_mha_naming naming;

/* The file's name of parameter p under naming nm; NULL where PyTorch packs it
 * into in_proj_weight / in_proj_bias (collect_param_grads adds those whole). */
static const char *single_name(naming nm, int p) {
  const char *name = attn_mha_param_name(nm, (attn_mha_param)p);
  return name && strncmp(name, "in_proj_", 8) ? name : NULL;
}

static char *join(const char *a, const char *b) {
  const size_t la = strlen(a), lb = strlen(b);
  char *s = malloc(la + lb + 1);
  if (s) {
    memcpy(s, a, la);
    memcpy(s + la, b, lb + 1);
  }
  return s;
}

static int detect_naming(attn_ctx *ctx, const attn_safetensors *st, const char *prefix, naming *nm) {
  if (attn_mha_detect_naming(ctx, nm, st, prefix)) return cli_fail(CLI_EXIT_FAIL, "--params: %s", attn_ctx_error(ctx));
  return 0;
}

/* The tensors of the gradients file: names and f32 tensors, some owned (packed copies). */
#define GRADS_MAX (ATTN_MHA_NUM_PARAMS + 3)
typedef struct grad_file {
  int n;
  char *name[GRADS_MAX];
  attn_tensor t[GRADS_MAX];
  int owned[GRADS_MAX];
} grad_file;

static void grad_file_free(grad_file *f) {
  for (int i = 0; i < f->n; i++) {
    free(f->name[i]);
    if (f->owned[i]) attn_tensor_free(&f->t[i]);
  }
  f->n = 0;
}

static int grad_add(grad_file *f, const char *prefix, const char *name, const attn_tensor *t, int owned) {
  if (f->n == GRADS_MAX || !(f->name[f->n] = join(prefix, name))) return cli_fail(CLI_EXIT_FAIL, "out of memory");
  f->t[f->n] = *t;
  f->owned[f->n] = owned;
  f->n++;
  return 0;
}

/* PyTorch's packed in_proj_weight / in_proj_bias: the q, k and v rows in turn. */
static int grad_add_packed(attn_ctx *ctx, grad_file *f, attn_mha *grads, const char *prefix, const char *name,
                           int bias) {
  attn_tensor part[3], t;
  int64_t shape[2] = {0, 0};
  for (int i = 0; i < 3; i++) {
    if (attn_mha_param_view(ctx, &part[i], grads, (attn_mha_param)(2 * i + bias)))
      return cli_fail(CLI_EXIT_FAIL, "mha gradients: %s", attn_ctx_error(ctx));
    shape[0] += part[i].shape[0];
    shape[1] = bias ? 0 : part[i].shape[1];
  }
  int r = alloc_f32(ctx, &t, bias ? 1 : 2, shape);
  if (r) return r;
  float *dst = t.data;
  for (int i = 0; i < 3; i++) {
    const int64_t n = attn_tensor_numel(&part[i]);
    memcpy(dst, part[i].data, (size_t)n * sizeof *dst);
    dst += n;
  }
  if ((r = grad_add(f, prefix, name, &t, 1))) attn_tensor_free(&t);
  return r;
}

/* Every parameter's gradient under the name the file used, prefix included. */
static int collect_param_grads(attn_ctx *ctx, grad_file *f, attn_mha *grads, naming nm, const char *prefix) {
  const int bias = attn_mha_get_config(grads)->bias;
  int r;
  if (nm == ATTN_MHA_NAMING_TORCH_PACKED && (r = grad_add_packed(ctx, f, grads, prefix, "in_proj_weight", 0))) return r;
  if ((nm == ATTN_MHA_NAMING_TORCH_PACKED || nm == ATTN_MHA_NAMING_TORCH_SEPARATE) && bias &&
      (r = grad_add_packed(ctx, f, grads, prefix, "in_proj_bias", 1)))
    return r;
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    const char *name = single_name(nm, p);
    if (!name || (p % 2 == 1 && !bias)) continue;
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, grads, (attn_mha_param)p))
      return cli_fail(CLI_EXIT_FAIL, "mha gradients: %s", attn_ctx_error(ctx));
    if ((r = grad_add(f, prefix, name, &t, 0))) return r;
  }
  return 0;
}

static int cmd_mha(int argc, char **argv) {
  static const char *const known[] = {"--params", "--prefix", "--heads", "--kv-heads", "--query", "--key",
                                      "--value", "--out", "--mask", "--mask-mode", "--key-padding",
                                      "--weights-out", "--threads", "--grad-out", "--grads-out", "--dropout",
                                      "--seed", "--window", "--softcap", "--sinks", NULL};
  static const char *const switches[] = {"--causal", "--average-weights", "--alibi", NULL};
  static const char *const out_flags[] = {"--out", "--weights-out", "--grads-out", NULL};
  static const char *const in_flags[] = {"--params", "--query", "--key", "--value", "--mask", "--key-padding",
                                         "--grad-out", "--sinks", NULL};
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
  if (cli_has(&a, "--grad-out") != cli_has(&a, "--grads-out"))
    return cli_fail(CLI_EXIT_USAGE, "give both --grad-out and --grads-out, or neither");
  const int train = cli_has(&a, "--grad-out");
  if (train && !*cli_get(&a, "--grad-out")) return cli_fail(CLI_EXIT_USAGE, "--grad-out needs a file name");
  long long heads = 0, kv_heads = 0;
  attn_causal causal;
  int64_t window = 0;
  double dropout = 0, softcap = 0;
  uint64_t seed = 0;
  if ((r = cli_int(&a, "--heads", 1, 1 << 20, &heads)) || (r = cli_int(&a, "--kv-heads", 1, 1 << 20, &kv_heads)) ||
      (r = parse_causal(&a, &causal)) || (r = parse_dropout(&a, &dropout, &seed)) ||
      (r = parse_window_softcap(&a, &window, &softcap)))
    return r;
  attn_ctx *ctx = NULL;
  if ((r = setup_ctx(&ctx, &a))) return r;
  attn_mha *mha = NULL, *grads = NULL;
  attn_mha_saved *saved = NULL;
  attn_tensor x = {0}, key = {0}, value = {0}, mask = {0}, kpm = {0}, out = {0}, w = {0};
  attn_tensor *wp = NULL; /* &w once --weights-out asks for it */
  attn_tensor g = {0}, dx = {0}, dkey = {0}, dvalue = {0}, slopes = {0}, sinks = {0};
  grad_file gf = {0};
  cli_outputs outs;
  const char *prefix = cli_get(&a, "--prefix");
  if (!prefix) prefix = "";
  if ((r = cli_outputs_plan(&outs, &a, out_flags, in_flags))) goto done;
  /* one open file for the layer and the names of its gradients */
  attn_safetensors *params = NULL;
  naming nm = ATTN_MHA_NAMING_NONE;
  if (attn_safetensors_open(ctx, &params, cli_get(&a, "--params")) ||
      attn_mha_create_from_safetensors_handle(ctx, &mha, params, prefix, heads, kv_heads)) {
    r = cli_fail(CLI_EXIT_FAIL, "--params: %s", attn_ctx_error(ctx));
    attn_safetensors_close(params);
    goto done;
  }
  r = detect_naming(ctx, params, prefix, &nm);
  attn_safetensors_close(params);
  if (r) goto done;
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
  o.attn.causal = causal;
  o.attn.dropout_p = dropout;
  o.attn.dropout_seed = seed;
  o.attn.window = window;
  o.attn.softcap = softcap;
  if ((r = load_head_options(ctx, &a, heads, &slopes, &sinks))) goto done;
  o.attn.alibi_slopes = cli_has(&a, "--alibi") ? &slopes : NULL;
  o.attn.sinks = cli_has(&a, "--sinks") ? &sinks : NULL;
  if (cli_has(&a, "--mask")) {
    if ((r = load_array(ctx, &mask, cli_get(&a, "--mask"), "--mask", 0)) ||
        (r = mask_mode_for(&a, &mask, ATTN_MASK_MASKED, &o.attn.mask_mode)))
      goto done;
    /* nn.MultiheadAttention's 3-D mask is [B*H, Nq, Nk]: view it as [B, H, Nq, Nk] */
    if (mask.rank == 3 && mask.shape[0] == B * heads && heads > 1) {
      mask.rank = 4;
      mask.shape[3] = mask.shape[2]; mask.strides[3] = mask.strides[2];
      mask.shape[2] = mask.shape[1]; mask.strides[2] = mask.strides[1];
      mask.shape[1] = heads; mask.strides[1] = mask.strides[0];
      mask.shape[0] = B; mask.strides[0] = mask.strides[0] * heads;
    }
    o.attn.mask = &mask;
  }
  if (cli_has(&a, "--key-padding")) {
    if ((r = load_array(ctx, &kpm, cli_get(&a, "--key-padding"), "--key-padding", 0))) goto done;
    o.attn.key_padding = &kpm;
  }
  if (train && ((r = load_array(ctx, &g, cli_get(&a, "--grad-out"), "--grad-out", 1)) ||
                (r = want_rank(&g, 3, "--grad-out", "[B, Nq, E]"))))
    goto done;
  const attn_mha_config *cfg = attn_mha_get_config(mha);
  int64_t oshape[3] = {B, Nq, cfg->embed_dim};
  if ((r = alloc_f32(ctx, &out, 3, oshape))) goto done;
  if (train && (g.shape[0] != B || g.shape[1] != Nq || g.shape[2] != cfg->embed_dim)) {
    r = cli_fail(CLI_EXIT_FAIL, "--grad-out is [%lld, %lld, %lld]; want the output's shape [B, Nq, E] = [%lld, %lld, %lld]",
                 (long long)g.shape[0], (long long)g.shape[1], (long long)g.shape[2], (long long)B, (long long)Nq,
                 (long long)cfg->embed_dim);
    goto done;
  }
  if (cli_has(&a, "--weights-out")) {
    o.average_weights = cli_has(&a, "--average-weights");
    int64_t ws4[4] = {B, heads, Nq, Nk}, ws3[3] = {B, Nq, Nk};
    if ((r = alloc_f32(ctx, &w, o.average_weights ? 3 : 4, o.average_weights ? ws3 : ws4))) goto done;
    wp = &w;
  }
  if (!train) {
    if (attn_mha_forward(ctx, mha, &out, wp, &x, cross ? &key : NULL, cross ? &value : NULL, &o)) {
      r = cli_fail(CLI_EXIT_FAIL, "mha: %s", attn_ctx_error(ctx));
      goto done;
    }
  } else {
    if (attn_mha_forward_save(ctx, mha, &out, wp, &saved, &x, cross ? &key : NULL, cross ? &value : NULL, &o)) {
      r = cli_fail(CLI_EXIT_FAIL, "mha: %s", attn_ctx_error(ctx));
      goto done;
    }
    if ((r = alloc_f32(ctx, &dx, 3, x.shape)) ||
        (cross && ((r = alloc_f32(ctx, &dkey, 3, key.shape)) || (r = alloc_f32(ctx, &dvalue, 3, value.shape)))))
      goto done;
    if (attn_mha_create(ctx, &grads, cfg)) {
      r = cli_fail(CLI_EXIT_FAIL, "mha gradients: %s", attn_ctx_error(ctx));
      goto done;
    }
    if (attn_mha_backward(ctx, mha, &dx, cross ? &dkey : NULL, cross ? &dvalue : NULL, grads, saved, &g)) {
      r = cli_fail(CLI_EXIT_FAIL, "mha backward: %s", attn_ctx_error(ctx));
      goto done;
    }
    if ((r = collect_param_grads(ctx, &gf, grads, nm, prefix)) || (r = grad_add(&gf, "", "query", &dx, 0)) ||
        (cross && ((r = grad_add(&gf, "", "key", &dkey, 0)) || (r = grad_add(&gf, "", "value", &dvalue, 0)))))
      goto done;
  }
  if ((r = write_output(ctx, &outs, "--out", &out)) || (wp && (r = write_output(ctx, &outs, "--weights-out", &w))) ||
      (train && (r = write_safetensors_output(ctx, &outs, "--grads-out", gf.n, (const char *const *)gf.name, gf.t))) ||
      (r = cli_outputs_commit(&outs)))
    goto done;
done:
  cli_outputs_free(&outs);
  grad_file_free(&gf);
  attn_tensor_free(&x); attn_tensor_free(&key); attn_tensor_free(&value); attn_tensor_free(&mask);
  attn_tensor_free(&kpm); attn_tensor_free(&out); attn_tensor_free(&w); attn_tensor_free(&g);
  attn_tensor_free(&dx); attn_tensor_free(&dkey); attn_tensor_free(&dvalue);
  attn_tensor_free(&slopes); attn_tensor_free(&sinks);
  attn_mha_saved_free(saved);
  attn_mha_destroy(grads);
  attn_mha_destroy(mha);
  attn_ctx_destroy(ctx);
  return r;
}

/* ---- usage ------------------------------------------------------------------- */
/* One entry per command (bench: per operation); `attn help` prints them all,
 * `attn CMD --help` its own with the notes on outputs and exit codes. */
static const struct {
  const char *cmd, *op, *text;
} usages[] = {
    {"demo", NULL, "  attn demo                         the seed's layer on a built-in example\n"},
    {"sdpa", NULL,
     "  attn sdpa --q Q.npy --k K.npy --v V.npy --out O.npy\n"
     "            [--mask M.npy --mask-mode keep|masked|additive|seed] [--key-padding KP.npy]\n"
     "            [--causal | --causal=bottom-right] [--scale S] [--weights-out W.npy] [--threads N]\n"
     "            [--dropout P [--seed S]] [--window W] [--softcap C] [--alibi] [--sinks S.npy]\n"
     "            [--kv-dtype f32|f16|bf16]\n"
     "            [--grad-out G.npy [--dq-out DQ.npy] [--dk-out DK.npy] [--dv-out DV.npy] [--mask-grad-out DM.npy]\n"
     "             [--sinks-grad-out DS.npy]]\n"},
    {"mha", NULL,
     "  attn mha  --params P.safetensors [--prefix PFX] --heads H [--kv-heads G] --query X.npy\n"
     "            [--key K.npy --value V.npy] --out O.npy [--mask M.npy --mask-mode ...]\n"
     "            [--key-padding KP.npy] [--causal] [--weights-out W.npy] [--average-weights] [--threads N]\n"
     "            [--dropout P [--seed S]] [--window W] [--softcap C] [--alibi] [--sinks S.npy]\n"
     "            [--grad-out G.npy --grads-out GRADS.safetensors]\n"},
    {"map", NULL,
     "  attn map  --params P.safetensors --heads H --query X.npy [--key K.npy [--value V.npy]] --png OUT.png\n"
     "            [--tokens T.txt] [--key-tokens T.txt] [--batch I] [--causal] [--prefix PFX] [--kv-heads G]\n"
     "  attn map  --weights W.npy --png OUT.png [--tokens T.txt] [--key-tokens T.txt] [--batch I]\n"
     "            every head's attention weights as heatmaps in a PNG (one token per line in T.txt)\n"},
    {"bench", "sdpa",
     "  attn bench sdpa --batch B --heads H [--kv-heads G] --seq N [--kv-seq M] --dim D [--causal] [--window W]\n"
     "            [--padding F] [--backward] [--threads T] [--repeat R] [--kernel K] [--max-gflop F] [--json]\n"
     "            (--padding F: the last fraction F of every row's keys is key padding, and holds NaN)\n"},
    {"bench", "mha",
     "  attn bench mha --batch B --seq N --embed E --heads H [--threads T] [--repeat R] [--kernel K]\n"
     "            [--max-gflop F] [--json]\n"},
    {"bench", "decode",
     "  attn bench decode --batch B --kv-seq L --heads H [--kv-heads G] --dim D [--seq Nq]\n"
     "            [--dtype f32|f16|bf16] [--compare] [--threads T] [--repeat R] [--kernel K] [--max-gflop F] [--json]\n"},
    {"version", NULL, "  attn version\n"},
    {"help", NULL, "  attn help [COMMAND]               this text, or one command's (as attn COMMAND --help)\n"},
};

static const char notes_data[] =
    "Arrays are .npy (float32; float64 is converted). q/k/v are [B, H, N, D]; mha inputs are [B, N, E].\n"
    "A bool mask means keep (sdpa) or masked (mha) unless --mask-mode says otherwise; a float mask is additive.\n"
    "--grad-out G gives the gradients of sum(out * G): sdpa writes the ones asked for (--mask-grad-out: an\n"
    "additive mask's, in the mask's shape); mha writes every parameter's under the file's own names (with\n"
    "the prefix) and the inputs' as query (key, value) into one safetensors file.\n"
    "--dropout P: training-mode dropout on the attention probabilities (seed S, default 0).\n"
    "--window W: query i' sees keys i'-W < j <= i' (causal implied); --softcap C: logits C*tanh(logits/C);\n"
    "--alibi: the ALiBi paper's slopes per query head; --sinks S.npy: one sink logit per query head [H].\n"
    "--kv-dtype: k and v rounded to f16 or bf16 (and read stored so) before attention.\n";
static const char notes_outputs[] =
    "Outputs are written to temporary files beside them and renamed into place only when every one was\n"
    "written: a failed command changes no existing file. An output may not name an input; a symbolic link\n"
    "as an output is followed (the file it points to is replaced, the link stays).\n"
    "Exit status: 0 done, 1 bad data or a failed run, 2 a bad command line; errors are one line on stderr.\n";
static const char notes_bench[] =
    "bench refuses a case whose timed runs would take more than --max-gflop F GFLOP (default 1e5, a few\n"
    "minutes on two cores); --max-gflop inf lifts the bound.\n";

/* Every entry of cmd (op NULL: all of its operations); 0 if there is none. */
static int print_usage(FILE *f, const char *cmd, const char *op) {
  int found = 0;
  for (size_t i = 0; i < sizeof usages / sizeof usages[0]; i++)
    if (!strcmp(usages[i].cmd, cmd) && (!op || !usages[i].op || !strcmp(usages[i].op, op))) {
      if (!found) fputs("usage:\n", f);
      fputs(usages[i].text, f);
      found = 1;
    }
  if (found && (!strcmp(cmd, "sdpa") || !strcmp(cmd, "mha"))) fputs(notes_data, f);
  if (found && (!strcmp(cmd, "sdpa") || !strcmp(cmd, "mha") || !strcmp(cmd, "map"))) fputs(notes_outputs, f);
  if (found && !strcmp(cmd, "bench")) fputs(notes_bench, f);
  return found;
}

static void usage(FILE *f) {
  fputs("usage: attn <command> [flags]     (attn <command> --help: that command alone)\n", f);
  for (size_t i = 0; i < sizeof usages / sizeof usages[0]; i++) fputs(usages[i].text, f);
  fputs(notes_data, f);
  fputs(notes_outputs, f);
  fputs(notes_bench, f);
}

static int is_help(const char *s) { return !strcmp(s, "--help") || !strcmp(s, "-h"); }

int attn_cli_main(int argc, char **argv) {
  if (argc < 2) return cli_fail(CLI_EXIT_USAGE, "no command given (see 'attn help')");
  const char *cmd = argv[1];
  if (!strcmp(cmd, "help") || is_help(cmd)) {
    if (argc < 3) {
      usage(stdout);
      return 0;
    }
    if (!print_usage(stdout, argv[2], argc > 3 ? argv[3] : NULL))
      return cli_fail(CLI_EXIT_USAGE, "help: no command '%s' (see 'attn help')", cli_show(argv[2]));
    return 0;
  }
  /* --help or -h anywhere after the command wins over every other flag */
  for (int i = 2; i < argc; i++)
    if (is_help(argv[i])) {
      const char *op = !strcmp(cmd, "bench") && i > 2 ? argv[2] : NULL;
      if (print_usage(stdout, cmd, op) || print_usage(stdout, cmd, NULL)) return 0;
      break; /* an unknown command is refused below */
    }
  if (!strcmp(cmd, "sdpa")) return cmd_sdpa(argc - 2, argv + 2);
  if (!strcmp(cmd, "mha")) return cmd_mha(argc - 2, argv + 2);
  if (!strcmp(cmd, "demo")) return cmd_demo(argc - 2, argv + 2);
  if (!strcmp(cmd, "bench")) return cmd_bench(argc - 2, argv + 2);
  if (!strcmp(cmd, "map")) return cmd_map(argc - 2, argv + 2);
  if (!strcmp(cmd, "version") || !strcmp(cmd, "--version")) {
    if (argc > 2) return cli_fail(CLI_EXIT_USAGE, "version takes no arguments, got '%s'", cli_show(argv[2]));
    printf("attn %s (kernel: %s)\n", attn_version_string(), attn_kernel_name(attn_ctx_kernel(NULL)));
    return 0;
  }
  return cli_fail(CLI_EXIT_USAGE, "unknown command '%s' (see 'attn help')", cli_show(cmd));
}
