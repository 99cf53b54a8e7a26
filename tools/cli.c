/* The command line's shared helpers: flags, one-line errors, the arrays and
 * options that several commands read the same way. Calls only the library. */
#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
int cli_load_array(attn_ctx *ctx, attn_tensor *t, const char *path, const char *flag, int to_f32) {
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

int cli_want_rank(const attn_tensor *t, int rank, const char *flag, const char *layout) {
  if (t->rank != rank) return cli_fail(CLI_EXIT_FAIL, "%s must have rank %d %s, got rank %d", flag, rank, layout, t->rank);
  return 0;
}

int cli_parse_mask_mode(const char *s, attn_mask_mode *mode) {
  if (!strcmp(s, "keep")) *mode = ATTN_MASK_KEEP;
  else if (!strcmp(s, "masked")) *mode = ATTN_MASK_MASKED;
  else if (!strcmp(s, "additive")) *mode = ATTN_MASK_ADDITIVE;
  else if (!strcmp(s, "seed")) *mode = ATTN_MASK_SEED;
  else return cli_fail(CLI_EXIT_USAGE, "--mask-mode wants keep, masked, additive or seed, got '%s'", cli_show(s));
  return 0;
}

int cli_parse_causal(cli_args *a, attn_causal *c) {
  const char *s = cli_get(a, "--causal");
  *c = ATTN_CAUSAL_NONE;
  if (!s) return 0;
  if (!*s || !strcmp(s, "top-left")) *c = ATTN_CAUSAL_TOP_LEFT;
  else if (!strcmp(s, "bottom-right")) *c = ATTN_CAUSAL_BOTTOM_RIGHT;
  else return cli_fail(CLI_EXIT_USAGE, "--causal wants nothing, =top-left or =bottom-right, got '%s'", cli_show(s));
  return 0;
}

/* --dropout P (in [0, 1]) and --seed S (needs --dropout; default 0). */
int cli_parse_dropout(cli_args *a, double *p, uint64_t *seed) {
  *p = 0;
  *seed = 0;
  int r;
  if (cli_has(a, "--seed") && !cli_has(a, "--dropout")) return cli_fail(CLI_EXIT_USAGE, "--seed needs --dropout");
  if ((r = cli_double(a, "--dropout", p))) return r;
  if (!(*p >= 0 && *p <= 1))
    return cli_fail(CLI_EXIT_USAGE, "--dropout wants a probability in [0, 1], got '%s'", cli_show(cli_get(a, "--dropout")));
  return cli_u64(a, "--seed", seed);
}

/* The mask mode: --mask-mode if given, else the call's rule for bool masks, additive for float. */
int cli_mask_mode_for(cli_args *a, const attn_tensor *mask, attn_mask_mode bool_default, attn_mask_mode *mode) {
  const char *s = cli_get(a, "--mask-mode");
  if (s) return cli_parse_mask_mode(s, mode);
  *mode = (mask->dtype == ATTN_BOOL || mask->dtype == ATTN_U8) ? bool_default : ATTN_MASK_ADDITIVE;
  return 0;
}

int cli_precision(const char *name) {
  for (int k = ATTN_PRECISION_DEFAULT; k <= ATTN_PRECISION_F16; k++)
    if (!strcmp(name, attn_precision_name((attn_precision)k))) return k;
  return cli_fail(CLI_EXIT_USAGE, "--precision wants default, fp32, bf16 or f16, got '%s'", cli_show(name)), -1;
}

int cli_setup_ctx(attn_ctx **ctx, cli_args *a) {
  long long threads = 0;
  int r = cli_int(a, "--threads", 0, 4096, &threads);
  if (r) return r;
  const char *ps = cli_get(a, "--precision");
  const int precision = ps ? cli_precision(ps) : ATTN_PRECISION_DEFAULT;
  if (precision < 0) return CLI_EXIT_USAGE;
  if (attn_ctx_create(ctx)) return cli_fail(CLI_EXIT_FAIL, "out of memory");
  attn_ctx_set_threads(*ctx, (int)threads);
  if (ps) attn_ctx_set_precision(*ctx, (attn_precision)precision);
  return 0;
}

int cli_alloc_f32(attn_ctx *ctx, attn_tensor *t, int rank, const int64_t *shape) {
  if (attn_tensor_alloc(ctx, t, ATTN_F32, rank, shape)) return cli_fail(CLI_EXIT_FAIL, "%s", attn_ctx_error(ctx));
  return 0;
}

/* --window W, --chunk C (>= 0, 0 = off) and --softcap C (finite, >= 0, 0 = off): checked before any file is read. */
int cli_parse_band_softcap(cli_args *a, int64_t *window, int64_t *chunk, double *softcap) {
  long long w = 0, c = 0;
  int r;
  *softcap = 0;
  if ((r = cli_int(a, "--window", 0, (long long)1 << 62, &w)) || (r = cli_int(a, "--chunk", 0, (long long)1 << 62, &c)) ||
      (r = cli_double(a, "--softcap", softcap)))
    return r;
  if (!(*softcap >= 0) || !isfinite(*softcap))
    return cli_fail(CLI_EXIT_USAGE, "--softcap wants a finite number >= 0 (0 = off), got '%s'", cli_show(cli_get(a, "--softcap")));
  *window = (int64_t)w, *chunk = (int64_t)c;
  return 0;
}

/* A number from s up to the next ':' or the end; *s moves past it. */
static int rope_field(const char **s, double *v) {
  char *end;
  if (!**s) return 0;
  *v = strtod(*s, &end);
  if (end == *s || (*end && *end != ':') || !isfinite(*v)) return 0;
  *s = *end ? end + 1 : end;
  return 1;
}

/* A comma-separated list of numbers from s up to the next ':' or the end, at most cap of them, into v;
 * *s moves past it. Returns the count, or -1. */
static int rope_list(const char **s, double *v, int cap) {
  int n = 0;
  for (;;) {
    char *end;
    if (n == cap) return -1;
    v[n] = strtod(*s, &end);
    if (end == *s || !isfinite(v[n])) return -1;
    n++;
    *s = end;
    if (*end == ',') {
      (*s)++;
      continue;
    }
    if (*end == ':') (*s)++;
    else if (*end) return -1;
    return n;
  }
}

/* longrope:F:P:S1,...:L1,... (after "longrope:" at s): the factor, the pretraining context and one
 * short and one long factor per rotary pair (as many of each; the library checks they cover r/2). */
static int rope_longrope(const char *s, const char *spec, attn_rope_opts *o) {
  double f[2];
  int n_short, n_long;
  if (!rope_field(&s, &f[0]) || !rope_field(&s, &f[1]) || !*s ||
      (n_short = rope_list(&s, o->short_factor, ATTN_ROPE_MAX_PAIRS)) < 0 || !*s ||
      (n_long = rope_list(&s, o->long_factor, ATTN_ROPE_MAX_PAIRS)) < 0 || *s)
    return cli_fail(CLI_EXIT_USAGE, "--rope-scaling wants longrope:F:P:S1,S2,...:L1,L2,... (at most %d factors each), "
                    "got '%s'", ATTN_ROPE_MAX_PAIRS, cli_show(spec));
  if (n_short != n_long)
    return cli_fail(CLI_EXIT_USAGE, "--rope-scaling: longrope gives %d short factors and %d long ones, in '%s'", n_short,
                    n_long, cli_show(spec));
  if (!(f[1] >= 1 && f[1] < 1e15) || f[1] != floor(f[1]))
    return cli_fail(CLI_EXIT_USAGE, "--rope-scaling: the pretraining context must be a positive integer, in '%s'",
                    cli_show(spec));
  o->scaling = ATTN_ROPE_LONGROPE;
  o->factor = f[0];
  o->original_max_position = (int64_t)f[1];
  return 0;
}

int cli_parse_rope(cli_args *a, attn_rope_opts *o, int *on) {
  static const char *const rope_flags[] = {"--rope-dim", "--rope-interleaved", "--rope-scaling", NULL};
  attn_rope_opts_init(o);
  *on = cli_has(a, "--rope");
  if (!*on) {
    for (int i = 0; rope_flags[i]; i++)
      if (cli_has(a, rope_flags[i])) return cli_fail(CLI_EXIT_USAGE, "%s needs --rope THETA", rope_flags[i]);
    return 0;
  }
  long long dim = 0;
  int r;
  if ((r = cli_double(a, "--rope", &o->theta)) || (r = cli_int(a, "--rope-dim", 2, (long long)1 << 24, &dim))) return r;
  if (!(o->theta > 1)) return cli_fail(CLI_EXIT_USAGE, "--rope wants a base theta > 1, got '%s'", cli_show(cli_get(a, "--rope")));
  o->rotary_dim = dim;
  if (cli_has(a, "--rope-interleaved")) o->layout = ATTN_ROPE_INTERLEAVED;
  const char *spec = cli_get(a, "--rope-scaling");
  if (!spec) return 0;
  if (!strncmp(spec, "longrope:", 9)) return rope_longrope(spec + 9, spec, o);
  static const struct {
    const char *name;
    attn_rope_scaling scaling;
    int fields; /* after the type: factor, then [low, high], then P */
  } kinds[] = {{"linear", ATTN_ROPE_LINEAR, 1}, {"dynamic", ATTN_ROPE_DYNAMIC, 2}, {"llama3", ATTN_ROPE_LLAMA3, 4},
               {"yarn", ATTN_ROPE_YARN, 2}};
  for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
    const size_t n = strlen(kinds[k].name);
    if (strncmp(spec, kinds[k].name, n) || (spec[n] != ':')) continue;
    const char *s = spec + n + 1;
    double f[4] = {0, 0, 0, 0};
    int got = 0;
    while (got < kinds[k].fields && rope_field(&s, &f[got])) got++;
    if (got != kinds[k].fields || *s) break;
    o->scaling = kinds[k].scaling;
    o->factor = f[0];
    if (kinds[k].fields == 4) o->low_freq_factor = f[1], o->high_freq_factor = f[2];
    const double P = f[kinds[k].fields - 1];
    if (kinds[k].fields > 1) {
      if (!(P >= 1 && P < 1e15) || P != floor(P))
        return cli_fail(CLI_EXIT_USAGE, "--rope-scaling: the pretraining context must be a positive integer, in '%s'", cli_show(spec));
      o->original_max_position = (int64_t)P;
    }
    return 0;
  }
  return cli_fail(CLI_EXIT_USAGE,
                  "--rope-scaling wants linear:F, dynamic:F:P, llama3:F:LOW:HIGH:P, yarn:F:P or "
                  "longrope:F:P:S1,...:L1,..., got '%s'", cli_show(spec));
}

int cli_load_positions(attn_ctx *ctx, cli_args *a, int64_t B, int64_t N, int64_t **pos) {
  *pos = NULL;
  attn_tensor t = {0};
  int r = cli_load_array(ctx, &t, cli_get(a, "--positions"), "--positions", 0);
  if (r) return r;
  const int rows = t.rank == 2;
  if (!((t.rank == 2 && t.shape[0] == B && t.shape[1] == N) || (t.rank == 1 && t.shape[0] == N)) ||
      (t.dtype != ATTN_F64 && t.dtype != ATTN_F32)) {
    r = cli_fail(CLI_EXIT_FAIL, "--positions must hold integers, [B, N] = [%lld, %lld] or [N]", (long long)B, (long long)N);
    attn_tensor_free(&t);
    return r;
  }
  int64_t *p = malloc((size_t)(B * N > 0 ? B * N : 1) * sizeof *p);
  if (!p) {
    attn_tensor_free(&t);
    return cli_fail(CLI_EXIT_FAIL, "out of memory");
  }
  for (int64_t b = 0; b < B; b++)
    for (int64_t n = 0; n < N; n++) {
      const int64_t off = (rows ? b * t.strides[0] : 0) + n * t.strides[rows];
      const double v = t.dtype == ATTN_F64 ? ((const double *)t.data)[off] : ((const float *)t.data)[off];
      if (!(v >= 0 && v <= 9007199254740992.0) || v != floor(v)) {
        free(p);
        attn_tensor_free(&t);
        return cli_fail(CLI_EXIT_FAIL, "--positions: entry (%lld, %lld) is %g, not an integer >= 0", (long long)b, (long long)n, v);
      }
      p[b * N + n] = (int64_t)v;
    }
  attn_tensor_free(&t);
  *pos = p;
  return 0;
}

int cli_load_offsets(attn_ctx *ctx, cli_args *a, const char *flag, int64_t **cu, int64_t *n) {
  *cu = NULL, *n = 0;
  attn_tensor t = {0};
  int r = cli_load_array(ctx, &t, cli_get(a, flag), flag, 0);
  if (r) return r;
  if (t.rank != 1 || t.shape[0] < 1 || (t.dtype != ATTN_F64 && t.dtype != ATTN_F32)) {
    attn_tensor_free(&t);
    return cli_fail(CLI_EXIT_FAIL, "%s must hold num_seqs + 1 integer offsets (int32 or int64, rank 1)", flag);
  }
  int64_t *p = malloc((size_t)t.shape[0] * sizeof *p);
  if (!p) {
    attn_tensor_free(&t);
    return cli_fail(CLI_EXIT_FAIL, "out of memory");
  }
  for (int64_t e = 0; e < t.shape[0]; e++) {
    const int64_t off = e * t.strides[0];
    const double v = t.dtype == ATTN_F64 ? ((const double *)t.data)[off] : ((const float *)t.data)[off];
    if (!(v >= 0 && v <= 9007199254740992.0) || v != floor(v)) {
      free(p);
      attn_tensor_free(&t);
      return cli_fail(CLI_EXIT_FAIL, "%s: entry %lld is %g, not an integer >= 0", flag, (long long)e, v);
    }
    p[e] = (int64_t)v;
  }
  *n = t.shape[0];
  attn_tensor_free(&t);
  *cu = p;
  return 0;
}

/* --alibi: the paper's slopes for heads query heads; --sinks S.npy: f32 [heads] (the call checks the length). */
int cli_load_head_options(attn_ctx *ctx, cli_args *a, int64_t heads, attn_tensor *slopes, attn_tensor *sinks) {
  int r;
  if (cli_has(a, "--alibi")) {
    if ((r = cli_alloc_f32(ctx, slopes, 1, &heads))) return r;
    if (attn_alibi_slopes(slopes->data, heads)) return cli_fail(CLI_EXIT_FAIL, "--alibi: no slopes for %lld heads", (long long)heads);
  }
  if (cli_has(a, "--sinks") &&
      ((r = cli_load_array(ctx, sinks, cli_get(a, "--sinks"), "--sinks", 1)) || (r = cli_want_rank(sinks, 1, "--sinks", "[H]"))))
    return r;
  return 0;
}
