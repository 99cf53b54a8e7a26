/* libFuzzer harness for the safetensors reader and the layer built on it, fed
 * from memory (attn__safetensors_open_mem runs the file reader's code).
 * Whatever the bytes: a known status and a message on failure; on success
 * every tensor the handle lists either is refused by get with a dtype or rank
 * error or can be read whole. Then layers are created from the handle with
 * several head counts (grouped-query ones too), under no prefix and under the
 * prefix of any tensor named like an output projection (every family's); a
 * layer holds no more elements than the input has bytes, and runs a tiny
 * forward. attn_mha_create_from_tensors runs on the detected naming and on
 * name maps made of the file's own tensor names (Linear and Conv1D). */
#include "io/io.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static attn_ctx *ctx;

static void need(int cond, const char *what) {
  if (cond) return;
  fprintf(stderr, "fuzz_safetensors: %s (message: '%s')\n", what, attn_ctx_error(ctx));
  abort();
}

static void cleanup(void) { attn_ctx_destroy(ctx); }

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  need(attn_ctx_create(&ctx) == ATTN_OK, "cannot create a context");
  need(attn_ctx_set_threads(ctx, 1) == ATTN_OK, "threads");
  atexit(cleanup);
  return 0;
}

static int known_status(attn_status st) { return st >= ATTN_OK && st <= ATTN_E_UNSUPPORTED; }

/* B = 1 rows of N tokens of F features, filled with a fixed pattern. */
static attn_tensor input(float **buf, int64_t N, int64_t F) {
  int64_t s[3] = {1, N, F};
  *buf = malloc(sizeof(float) * (size_t)(N * F + 1));
  need(*buf != NULL, "out of memory");
  for (int64_t i = 0; i < N * F; i++) (*buf)[i] = (float)sin(0.7 * (double)i);
  return attn_tensor_view(*buf, ATTN_F32, 3, s);
}

static void layer(const attn_safetensors *st, const char *prefix, int64_t H, int64_t Hk, size_t size) {
  attn_mha *m = NULL;
  attn_status s = attn_mha_create_from_safetensors_handle(ctx, &m, st, prefix, H, Hk);
  need(known_status(s), "create: unknown status");
  if (s) {
    need(m == NULL && attn_ctx_error(ctx)[0], "create failed without a message, or left a layer");
    return;
  }
  int64_t held = 0;
  for (int p = 0; p < ATTN_MHA_O_BIAS + 1; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, m, (attn_mha_param)p) == ATTN_OK) held += attn_tensor_numel(&t);
  }
  /* every parameter came from a tensor of at least 2 bytes per element */
  need(held > 0 && (uint64_t)held * 2 <= size, "the layer holds more than the file can justify");
  const attn_mha_config *c = attn_mha_get_config(m);
  const int self = c->kdim == c->embed_dim && c->vdim == c->embed_dim;
  float *xq, *xk = NULL, *xv = NULL, *y;
  attn_tensor q = input(&xq, 2, c->embed_dim), out = input(&y, 2, c->embed_dim), k, v;
  if (!self) {
    k = input(&xk, 3, c->kdim);
    v = input(&xv, 3, c->vdim);
  }
  attn_mha_opts o;
  attn_mha_opts_init(&o);
  o.attn.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
  s = attn_mha_forward(ctx, m, &out, NULL, &q, self ? NULL : &k, self ? NULL : &v, &o);
  need(s == ATTN_OK, "a layer made from the file cannot run");
  free(xq);
  free(xk);
  free(xv);
  free(y);
  attn_mha_destroy(m);
}

/* The general loader on whatever the file holds: the detected naming, and a
 * name map made of the file's own first tensor names (q, k, v packed in the
 * first, o the second, then biases and norms), with and without Conv1D. It
 * must give a known status, and a layer only when it says OK. */
static void from_tensors(const attn_safetensors *st, const char *prefix) {
  static const int64_t likes[][4] = {{1, 0, 0, ATTN_NORM_RMS}, {2, 1, 0, ATTN_NORM_LAYER}, {4, 2, 3, ATTN_NORM_RMS}};
  const int64_t n = attn_safetensors_count(st);
  for (size_t i = 0; i < sizeof likes / sizeof likes[0]; i++) {
    attn_mha_config like;
    attn_mha_config_init(&like, 0, likes[i][0]);
    like.num_kv_heads = likes[i][1];
    like.head_dim = likes[i][2];
    like.qk_norm_kind = (attn_norm_kind)likes[i][3];
    for (int map = 0; map < 3; map++) {
      attn_mha_names names;
      memset(&names, 0, sizeof names);
      names.size = sizeof names;
      if (map) {
        if (n < 2) break;
        names.conv1d = map == 2;
        const char *a = attn_safetensors_name(st, 0), *b = attn_safetensors_name(st, 1);
        const char *c = n > 2 ? attn_safetensors_name(st, 2) : NULL, *d = n > 3 ? attn_safetensors_name(st, 3) : NULL;
        names.name[ATTN_MHA_Q_WEIGHT] = names.name[ATTN_MHA_K_WEIGHT] = names.name[ATTN_MHA_V_WEIGHT] = a;
        names.name[ATTN_MHA_O_WEIGHT] = b;
        names.name[ATTN_MHA_Q_BIAS] = names.name[ATTN_MHA_K_BIAS] = names.name[ATTN_MHA_V_BIAS] = c;
        names.name[ATTN_MHA_Q_NORM_WEIGHT] = names.name[ATTN_MHA_K_NORM_WEIGHT] = NULL;
        names.name[ATTN_MHA_O_BIAS] = d;
      }
      attn_mha *m = NULL;
      const attn_status s = attn_mha_create_from_tensors(ctx, &m, st, map ? "" : prefix, map ? &names : NULL, &like);
      need(known_status(s), "create_from_tensors: unknown status");
      need(s == ATTN_OK ? m != NULL : (m == NULL && attn_ctx_error(ctx)[0]),
           "create_from_tensors: a layer on failure, none on success, or no message");
      attn_mha_destroy(m);
    }
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  attn_safetensors *st = NULL;
  attn_status s = attn__safetensors_open_mem(ctx, &st, data, size, "fuzz.safetensors");
  need(known_status(s), "open: unknown status");
  if (s) {
    need(st == NULL && attn_ctx_error(ctx)[0], "open failed without a message, or left a handle");
    return 0;
  }
  char prefix[256] = "";
  int have_prefix = 0;
  static const char *const outs[] = {"out_proj.weight", "o_proj.weight",  "output.dense.weight", "dense.weight",
                                     "c_proj.weight",   "out_lin.weight", "o.weight"};
  for (int64_t i = 0; i < attn_safetensors_count(st); i++) {
    const char *name = attn_safetensors_name(st, i);
    need(name != NULL, "a listed tensor has no name");
    attn_tensor t;
    s = attn_safetensors_get(ctx, &t, st, name);
    need(s == ATTN_OK || s == ATTN_E_DTYPE || s == ATTN_E_UNSUPPORTED, "get: a listed tensor is neither read nor refused");
    if (s == ATTN_OK) {
      const int64_t n = attn_tensor_numel(&t);
      const size_t es = attn_dtype_size(t.dtype);
      need(n >= 0 && (uint64_t)n * es <= size, "a tensor larger than the input");
      need(n == 0 || ((uintptr_t)t.data % es) == 0, "a misaligned view");
      unsigned acc = 0;
      for (int64_t b = 0; b < n * (int64_t)es; b++) acc += ((const unsigned char *)t.data)[b];
      (void)acc;
    }
    const size_t len = strlen(name);
    for (size_t k = 0; k < sizeof outs / sizeof outs[0] && !have_prefix; k++) {
      const size_t ol = strlen(outs[k]);
      if (len > ol && len - ol < sizeof prefix && !strcmp(name + len - ol, outs[k])) {
        memcpy(prefix, name, len - ol);
        prefix[len - ol] = '\0';
        have_prefix = 1;
      }
    }
  }
  static const int64_t heads[][2] = {{1, 0}, {2, 0}, {3, 0}, {4, 0}, {8, 0}, {2, 1}, {4, 2}, {8, 2}};
  for (size_t h = 0; h < sizeof heads / sizeof heads[0]; h++) {
    layer(st, "", heads[h][0], heads[h][1], size);
    if (have_prefix) layer(st, prefix, heads[h][0], heads[h][1], size);
  }
  from_tensors(st, have_prefix ? prefix : "");
  attn_mha_naming nm;
  s = attn_mha_detect_naming(ctx, &nm, st, "");
  need(s == ATTN_OK ? nm != ATTN_MHA_NAMING_NONE : (s == ATTN_E_NOT_FOUND && nm == ATTN_MHA_NAMING_NONE),
       "detect_naming");
  attn_safetensors_close(st);
  return 0;
}
