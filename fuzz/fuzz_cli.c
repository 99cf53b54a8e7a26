/* libFuzzer harness for the attn command line (tools/main.c and the command files): the input is an
 * argument list, tokens separated by NUL bytes, the first one the command.
 * Each run happens in a private directory of small valid fixtures (q/k/v
 * arrays, a layer's parameters, weights, tokens, a pre-existing "precious"
 * output, a symbolic link to it, a subdirectory), and afterwards the tool's
 * promises are checked, trapping on a violation:
 *   - the exit status is 0, 1 or 2;
 *   - a failure prints exactly one line, "attn: ...", on stderr; a success none;
 *   - a fixture changes only when the command succeeded and named it (or a
 *     link to it) as an output; the link stays a link;
 *   - no temporary file is left, and a failed command leaves no new file.
 * Inputs that could reach outside the directory (an absolute path, "..") are
 * not run, nor bench and demo (slow by design) unless asking for --help, nor
 * more than 4 threads. The private directory (its path printed at start) is
 * the current one only while the tool runs: a sanitizer's report there
 * leaves libFuzzer's crash input in it. */
#define _XOPEN_SOURCE 700 /* realpath */
#include "cli.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_TOKENS 40

static char work[PATH_MAX]; /* the private directory */
static int home = -1;       /* the directory the fuzzer started in */
static FILE *err_file;      /* the tool's stderr, captured */
static int out_null = -1;

/* ---- fixtures ------------------------------------------------------------------ */
typedef struct fixture {
  const char *name;
  unsigned char *bytes;
  size_t n;
} fixture;

static fixture fixtures[16];
static int nfix;

static void die(const char *what) {
  fprintf(stderr, "fuzz_cli: %s\n", what);
  abort();
}

static unsigned char *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 1024, len = 0;
  unsigned char *b = malloc(cap);
  size_t r;
  while (b && (r = fread(b + len, 1, cap - len, f)) > 0)
    if ((len += r) == cap) b = realloc(b, cap *= 2);
  fclose(f);
  *n = len;
  return b;
}

static void npy(attn_ctx *ctx, const char *name, attn_dtype dt, int rank, const int64_t *shape, unsigned seed) {
  attn_tensor t;
  if (attn_tensor_alloc(ctx, &t, dt, rank, shape)) die("alloc");
  for (int64_t i = 0; i < attn_tensor_numel(&t); i++) {
    seed = seed * 1103515245u + 12345u;
    const float x = (float)((seed >> 9) % 2001) / 1000.0f - 1.0f;
    if (dt == ATTN_F32) ((float *)t.data)[i] = x;
    else ((unsigned char *)t.data)[i] = (unsigned char)(x > 0.5f);
  }
  if (attn_npy_write(ctx, name, &t)) die(attn_ctx_error(ctx));
  attn_tensor_free(&t);
}

/* Kept as they were made: every run is checked against these bytes. */
static void remember(const char *name) {
  fixture *f = &fixtures[nfix++];
  f->name = name;
  if (!(f->bytes = slurp(name, &f->n))) die(name);
}

static void make_fixtures(void) {
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx)) die("ctx");
  const int64_t qs[4] = {1, 2, 3, 4}, ms[2] = {3, 3}, kp[2] = {1, 3}, hs[1] = {2}, xs[3] = {1, 3, 8}, ws[4] = {1, 2, 3, 3};
  npy(ctx, "q.npy", ATTN_F32, 4, qs, 1);
  npy(ctx, "k.npy", ATTN_F32, 4, qs, 2);
  npy(ctx, "v.npy", ATTN_F32, 4, qs, 3);
  npy(ctx, "g.npy", ATTN_F32, 4, qs, 4);
  npy(ctx, "mask.npy", ATTN_F32, 2, ms, 5);
  npy(ctx, "kp.npy", ATTN_BOOL, 2, kp, 6);
  npy(ctx, "sinks.npy", ATTN_F32, 1, hs, 7);
  npy(ctx, "x.npy", ATTN_F32, 3, xs, 8);
  npy(ctx, "gx.npy", ATTN_F32, 3, xs, 9);
  npy(ctx, "w.npy", ATTN_F32, 4, ws, 10);
  npy(ctx, "precious.npy", ATTN_F32, 4, qs, 11);
  if (mkdir("sub", 0777)) die("mkdir sub");
  npy(ctx, "sub/s.npy", ATTN_F32, 4, qs, 12);
  /* the seed's naming, E = 8 (heads 1, 2, 4 or 8) */
  static const char *const names[] = {"wq.weight", "wq.bias", "wk.weight", "wk.bias",
                                      "wv.weight", "wv.bias", "dense.weight", "dense.bias"};
  attn_tensor p[8];
  const int64_t mat[2] = {8, 8}, vec[1] = {8};
  for (int i = 0; i < 8; i++) {
    if (attn_tensor_alloc(ctx, &p[i], ATTN_F32, i % 2 ? 1 : 2, i % 2 ? vec : mat)) die("alloc");
    for (int64_t e = 0; e < attn_tensor_numel(&p[i]); e++) ((float *)p[i].data)[e] = (float)((e * 7 + i) % 11) / 20.0f - 0.25f;
  }
  if (attn_safetensors_write(ctx, "params.safetensors", 8, names, p)) die(attn_ctx_error(ctx));
  for (int i = 0; i < 8; i++) attn_tensor_free(&p[i]);
  attn_ctx_destroy(ctx);
  FILE *f = fopen("tok.txt", "w");
  if (!f || fputs("the\ncat\nsat\n", f) < 0 || fclose(f)) die("tok.txt");
  if (symlink("precious.npy", "link.npy")) die("symlink");
  static const char *const all[] = {"q.npy", "k.npy", "v.npy", "g.npy", "mask.npy", "kp.npy", "sinks.npy", "x.npy",
                                    "gx.npy", "w.npy", "precious.npy", "sub/s.npy", "params.safetensors", "tok.txt"};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) remember(all[i]);
}

static int is_fixture(const char *path) {
  if (!strcmp(path, "link.npy") || !strcmp(path, "sub")) return 1;
  for (int i = 0; i < nfix; i++)
    if (!strcmp(fixtures[i].name, path)) return 1;
  return 0;
}

static void remove_work(void) {
  if (home < 0 || !work[0] || chdir(work)) return;
  for (int i = 0; i < nfix; i++) unlink(fixtures[i].name);
  unlink("link.npy");
  rmdir("sub");
  if (fchdir(home) == 0) rmdir(work);
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  setenv("OMP_THREAD_LIMIT", "4", 1);
  setenv("OMP_WAIT_POLICY", "passive", 1);
  const char *tmp = getenv("TMPDIR");
  snprintf(work, sizeof work, "%s/fuzz_cli.XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(work)) die("mkdtemp");
  if ((home = open(".", O_RDONLY | O_DIRECTORY)) < 0 || chdir(work)) die("chdir");
  make_fixtures();
  if (fchdir(home)) die("fchdir");
  if (!(err_file = tmpfile()) || (out_null = open("/dev/null", O_WRONLY)) < 0) die("tmpfile");
  fprintf(stderr, "fuzz_cli: fixtures in %s\n", work);
  atexit(remove_work);
  return 0;
}

/* ---- one run ------------------------------------------------------------------- */
/* Whether tokens stay inside the private directory and the run stays quick. */
static int acceptable(int n, char **tok) {
  int help = 0;
  for (int i = 0; i < n; i++) {
    const char *t = tok[i];
    if (t[0] == '/' || strstr(t, "..") || strstr(t, "=/")) return 0;
    help |= !strcmp(t, "--help") || !strcmp(t, "-h");
    const char *threads = !strcmp(t, "--threads") ? (i + 1 < n ? tok[i + 1] : "") : !strncmp(t, "--threads=", 10) ? t + 10 : NULL;
    if (threads && (strlen(threads) > 1 || *threads > '4')) return 0;
  }
  if (n > 0 && (!strcmp(tok[0], "bench") || !strcmp(tok[0], "demo")) && !help) return 0;
  return 1;
}

/* The values given to output flags (as --flag V or --flag=V). */
static int named_as_output(int n, char **tok, const char *fixture_real) {
  static const char *const outs[] = {"--out", "--weights-out", "--dq-out", "--dk-out", "--dv-out", "--mask-grad-out",
                                     "--sinks-grad-out", "--grads-out", "--png", NULL};
  for (int i = 1; i < n; i++)
    for (int o = 0; outs[o]; o++) {
      const size_t len = strlen(outs[o]);
      const char *v = NULL;
      if (!strcmp(tok[i], outs[o]) && i + 1 < n) v = tok[i + 1];
      else if (!strncmp(tok[i], outs[o], len) && tok[i][len] == '=') v = tok[i] + len + 1;
      char real[PATH_MAX];
      if (v && realpath(v, real) && !strcmp(real, fixture_real)) return 1;
    }
  return 0;
}

static void violation(const char *what, const char *detail, int n, char **tok) {
  if (fchdir(home)) perror("fchdir"); /* libFuzzer writes the crash's input here */
  fprintf(stderr, "fuzz_cli: %s: %s\n  attn", what, detail);
  for (int i = 0; i < n; i++) fprintf(stderr, " '%s'", tok[i]);
  fputc('\n', stderr);
  __builtin_trap();
}

/* Checks the directory after a run (cwd is the private one) and puts the fixtures back. */
static void check_files(int rc, int n, char **tok) {
  struct stat sb;
  if (lstat("link.npy", &sb) || !S_ISLNK(sb.st_mode)) violation("the link is no longer a link", "link.npy", n, tok);
  for (int i = 0; i < nfix; i++) {
    size_t len = 0;
    unsigned char *now = slurp(fixtures[i].name, &len);
    const int same = now && len == fixtures[i].n && !memcmp(now, fixtures[i].bytes, len);
    free(now);
    if (same) continue;
    char real[PATH_MAX];
    if (rc != 0 || !realpath(fixtures[i].name, real) || !named_as_output(n, tok, real))
      violation("a file changed that the command did not write", fixtures[i].name, n, tok);
    FILE *f = fopen(fixtures[i].name, "wb");
    if (!f || fwrite(fixtures[i].bytes, 1, fixtures[i].n, f) != fixtures[i].n || fclose(f)) die("restore");
  }
  static const char *const dirs[] = {".", "sub"};
  for (int d = 0; d < 2; d++) {
    DIR *dir = opendir(dirs[d]);
    if (!dir) die("opendir");
    for (struct dirent *e; (e = readdir(dir));) {
      if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
      char path[PATH_MAX];
      snprintf(path, sizeof path, "%s%s%s", d ? dirs[d] : "", d ? "/" : "", e->d_name);
      if (is_fixture(path)) continue;
      char real[PATH_MAX]; /* the temporaries' names (tools/outputs.c, src/io/file.c), unless an output's */
      if (!strncmp(e->d_name, ".attn.tmp.", 10) && !(realpath(path, real) && named_as_output(n, tok, real)))
        violation("a temporary file was left", path, n, tok);
      if (rc != 0) violation("a failed command left a new file", path, n, tok);
      if (unlink(path)) violation("an output that is not a file", path, n, tok);
    }
    closedir(dir);
  }
}

static void check_stderr(int rc, int n, char **tok) {
  char buf[8192];
  rewind(err_file);
  const size_t len = fread(buf, 1, sizeof buf - 1, err_file);
  buf[len] = '\0';
  if (rc == 0 && len) violation("a success wrote to stderr", buf, n, tok);
  if (rc == 0) return;
  const char *nl = memchr(buf, '\n', len);
  if (len < 7 || strncmp(buf, "attn: ", 6) || !nl || nl != buf + len - 1 || memchr(buf, '\0', len))
    violation("a failure's stderr is not one 'attn: ' line", buf, n, tok);
}

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size);
int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size) {
  /* tokens: the input split at NUL bytes (a final NUL optional) */
  char *copy = malloc(size + 1), *tok[MAX_TOKENS + 1], *argv[MAX_TOKENS + 2];
  if (!copy) return -1;
  memcpy(copy, data, size);
  copy[size] = '\0';
  int n = 0;
  for (size_t i = 0; i < size && n < MAX_TOKENS;) {
    tok[n++] = copy + i;
    i += strlen(copy + i) + 1;
  }
  if (!acceptable(n, tok)) {
    free(copy);
    return -1;
  }
  argv[0] = "attn";
  for (int i = 0; i < n; i++) argv[i + 1] = tok[i];
  argv[n + 1] = NULL;

  fflush(stdout);
  fflush(stderr);
  const int saved_out = dup(1), saved_err = dup(2);
  if (saved_out < 0 || saved_err < 0 || ftruncate(fileno(err_file), 0) || dup2(fileno(err_file), 2) < 0 ||
      dup2(out_null, 1) < 0 || chdir(work))
    die("redirect");
  rewind(err_file);
  const int rc = attn_cli_main(n + 1, argv);
  fflush(stdout);
  fflush(stderr);
  dup2(saved_out, 1);
  dup2(saved_err, 2);
  close(saved_out);
  close(saved_err);

  if (rc < 0 || rc > 2) {
    char s[32];
    snprintf(s, sizeof s, "%d", rc);
    violation("exit status not 0, 1 or 2", s, n, tok);
  }
  if (getenv("FUZZ_CLI_VERBOSE")) { /* what each input did, to check the seeds */
    char buf[512];
    rewind(err_file);
    buf[fread(buf, 1, sizeof buf - 1, err_file)] = '\0';
    fprintf(stderr, "fuzz_cli: %s -> %d %s", n ? tok[0] : "(none)", rc, *buf ? buf : "\n");
  }
  check_stderr(rc, n, tok);
  check_files(rc, n, tok);
  if (fchdir(home)) die("fchdir");
  free(copy);
  return 0;
}
