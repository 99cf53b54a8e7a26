/* The multi-head layer: the fp32 path against the float64 path over random
 * configurations (GQA, kdim/vdim, bias, masks, weights per head or averaged,
 * strided inputs, thread counts), the parameter namings, and loading from
 * safetensors. */
#include "testutil.h"

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *tmpdir(void) {
  const char *d = getenv("ATTN_TEST_TMP");
  return d ? d : "/tmp";
}

/* Fills every parameter of m with random values; returns them in PyTorch's names too. */
static void randomize(attn_ctx *ctx, attn_mha *m, tu_rng *r) {
  for (int p = 0; p < TU_MHA_PROJ_PARAMS; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, m, (attn_mha_param)p)) continue;
    tu_fill_f32(r, t.data, attn_tensor_numel(&t), 0.4);
  }
}

static void random_layer_case(attn_ctx *ctx, uint64_t seed) {
  tu_rng r = {seed};
  const int64_t H = tu_int(&r, 1, 4), Hk_div = tu_int(&r, 0, 1) ? H : 1, D = tu_int(&r, 1, 12), E = H * D;
  attn_mha_config c;
  attn_mha_config_init(&c, E, H);
  c.num_kv_heads = (H % 2 == 0 && tu_int(&r, 0, 1)) ? H / 2 : Hk_div;
  const int cross = (int)tu_int(&r, 0, 1);
  if (cross && tu_int(&r, 0, 1)) {
    c.kdim = tu_int(&r, 1, 20);
    c.vdim = tu_int(&r, 1, 20);
  }
  c.bias = (int)tu_int(&r, 0, 1);
  attn_mha *m;
  CHECK_OK(ctx, attn_mha_create(ctx, &m, &c));
  randomize(ctx, m, &r);
  const int64_t B = tu_int(&r, 1, 3), Nq = tu_int(&r, 1, 20), Nk = cross ? tu_int(&r, 1, 20) : Nq;
  const int64_t kd = c.kdim ? c.kdim : E, vd = c.vdim ? c.vdim : E;
  /* batch_first = False data: a [N, B, E] buffer viewed as [B, N, E] */
  const int seq_first = (int)tu_int(&r, 0, 1);
  float *xq = malloc(sizeof(float) * (size_t)(B * Nq * E)), *xk = malloc(sizeof(float) * (size_t)(B * Nk * kd));
  float *xv = malloc(sizeof(float) * (size_t)(B * Nk * vd));
  tu_fill_f32(&r, xq, B * Nq * E, 1);
  tu_fill_f32(&r, xk, B * Nk * kd, 1);
  tu_fill_f32(&r, xv, B * Nk * vd, 1);
  int64_t sq[3] = {B, Nq, E}, sk[3] = {B, Nk, kd}, sv[3] = {B, Nk, vd};
  attn_tensor tq = attn_tensor_view(xq, ATTN_F32, 3, sq), tk = attn_tensor_view(xk, ATTN_F32, 3, sk);
  attn_tensor tv = attn_tensor_view(xv, ATTN_F32, 3, sv);
  if (seq_first) {
    tq.strides[0] = E; tq.strides[1] = B * E;
    tk.strides[0] = kd; tk.strides[1] = B * kd;
    tv.strides[0] = vd; tv.strides[1] = B * vd;
  }
  attn_mha_opts o;
  attn_mha_opts_init(&o);
  o.attn.causal = (attn_causal)tu_int(&r, 0, 2);
  uint8_t *mask = malloc((size_t)(Nq * Nk)), *kpm = malloc((size_t)(B * Nk));
  int64_t ms[2] = {Nq, Nk}, ks[2] = {B, Nk};
  attn_tensor tm = attn_tensor_view(mask, ATTN_BOOL, 2, ms), tkp = attn_tensor_view(kpm, ATTN_BOOL, 2, ks);
  for (int64_t i = 0; i < Nq * Nk; i++) mask[i] = tu_int(&r, 0, 4) == 0;
  for (int64_t i = 0; i < B * Nk; i++) kpm[i] = tu_int(&r, 0, 5) == 0;
  if (tu_int(&r, 0, 1)) o.attn.mask = &tm;
  if (tu_int(&r, 0, 1)) o.attn.key_padding = &tkp;
  const int want_w = (int)tu_int(&r, 0, 2);
  o.average_weights = want_w == 2;
  const int64_t nw = o.average_weights ? B * Nq * Nk : B * H * Nq * Nk;
  int64_t w4[4] = {B, H, Nq, Nk}, w3[3] = {B, Nq, Nk};

  double *ref = malloc(sizeof(double) * (size_t)(B * Nq * E)), *wref = malloc(sizeof(double) * (size_t)(nw + 1));
  attn_tensor tr = attn_tensor_view(ref, ATTN_F64, 3, sq);
  attn_tensor twr = attn_tensor_view(wref, ATTN_F64, o.average_weights ? 3 : 4, o.average_weights ? w3 : w4);
  const attn_tensor *kk = cross ? &tk : NULL, *vv = cross ? &tv : NULL;
  attn_mha_opts oref = o;
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_REF);
  CHECK_OK(ctx, attn_mha_forward(ctx, m, &tr, want_w ? &twr : NULL, &tq, kk, vv, &oref));
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);

  float *out = malloc(sizeof(float) * (size_t)(B * Nq * E)), *w = malloc(sizeof(float) * (size_t)(nw + 1));
  float *first = malloc(sizeof(float) * (size_t)(B * Nq * E));
  for (int threads = 1; threads <= 3; threads++) {
    attn_ctx_set_threads(ctx, threads);
    attn_tensor to = attn_tensor_view(out, ATTN_F32, 3, sq);
    attn_tensor tw = attn_tensor_view(w, ATTN_F32, o.average_weights ? 3 : 4, o.average_weights ? w3 : w4);
    tu_poison_f32(out, B * Nq * E);
    tu_poison_f32(w, nw);
    attn_mha_opts of = o;
    CHECK_OK(ctx, attn_mha_forward(ctx, m, &to, want_w ? &tw : NULL, &tq, kk, vv, &of));
    double *got = tu_to_f64(&to);
    const double e = tu_rel_l2(got, ref, B * Nq * E);
    CHECK(e <= 1e-5 && tu_count_nan(got, B * Nq * E) == 0,
          "seed %llu (E=%lld H=%lld Hk=%lld cross=%d bias=%d threads=%d): out rel err %.3g", (unsigned long long)seed,
          (long long)E, (long long)H, (long long)c.num_kv_heads, cross, c.bias, threads, e);
    if (want_w) {
      double *gw = tu_to_f64(&tw);
      const double ew = tu_rel_l2(gw, wref, nw);
      CHECK(ew <= 1e-5 && tu_count_nan(gw, nw) == 0, "seed %llu: weights rel err %.3g", (unsigned long long)seed, ew);
      free(gw);
    }
    if (threads == 1) memcpy(first, out, sizeof(float) * (size_t)(B * Nq * E));
    else CHECK(!memcmp(first, out, sizeof(float) * (size_t)(B * Nq * E)), "seed %llu: threads %d changed the bits",
               (unsigned long long)seed, threads);
    free(got);
  }
  attn_ctx_set_threads(ctx, 0);
  free(xq); free(xk); free(xv); free(mask); free(kpm); free(ref); free(wref); free(out); free(w); free(first);
  attn_mha_destroy(m);
}

/* The same numbers under every naming give the same layer. */
static void namings(attn_ctx *ctx) {
  enum { E = 12, H = 3, B = 2, N = 6 };
  tu_rng r = {42};
  float wq[E * E], wk[E * E], wv[E * E], wo[E * E], bq[E], bk[E], bv[E], bo[E], packed[3 * E * E], pb[3 * E];
  tu_fill_f32(&r, wq, E * E, 0.5); tu_fill_f32(&r, wk, E * E, 0.5); tu_fill_f32(&r, wv, E * E, 0.5);
  tu_fill_f32(&r, wo, E * E, 0.5); tu_fill_f32(&r, bq, E, 0.5); tu_fill_f32(&r, bk, E, 0.5);
  tu_fill_f32(&r, bv, E, 0.5); tu_fill_f32(&r, bo, E, 0.5);
  memcpy(packed, wq, sizeof wq); memcpy(packed + E * E, wk, sizeof wk); memcpy(packed + 2 * E * E, wv, sizeof wv);
  memcpy(pb, bq, sizeof bq); memcpy(pb + E, bk, sizeof bk); memcpy(pb + 2 * E, bv, sizeof bv);
  int64_t sw[2] = {E, E}, sb[1] = {E}, sp[2] = {3 * E, E}, spb[1] = {3 * E};
  attn_tensor Wq = attn_tensor_view(wq, ATTN_F32, 2, sw), Wk = attn_tensor_view(wk, ATTN_F32, 2, sw);
  attn_tensor Wv = attn_tensor_view(wv, ATTN_F32, 2, sw), Wo = attn_tensor_view(wo, ATTN_F32, 2, sw);
  attn_tensor Bq = attn_tensor_view(bq, ATTN_F32, 1, sb), Bk = attn_tensor_view(bk, ATTN_F32, 1, sb);
  attn_tensor Bv = attn_tensor_view(bv, ATTN_F32, 1, sb), Bo = attn_tensor_view(bo, ATTN_F32, 1, sb);
  attn_tensor P = attn_tensor_view(packed, ATTN_F32, 2, sp), PB = attn_tensor_view(pb, ATTN_F32, 1, spb);

  const char *seed_names[] = {"wq.weight", "wq.bias", "wk.weight", "wk.bias", "wv.weight", "wv.bias", "dense.weight", "dense.bias"};
  const char *llama_names[] = {"q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
                               "v_proj.weight", "v_proj.bias", "o_proj.weight", "o_proj.bias"};
  const attn_tensor *vals[] = {&Wq, &Bq, &Wk, &Bk, &Wv, &Bv, &Wo, &Bo};
  float x[B * N * E], outs[5][B * N * E];
  tu_fill_f32(&r, x, B * N * E, 1);
  int64_t sx[3] = {B, N, E};
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 3, sx);
  attn_mha_config c;
  attn_mha_config_init(&c, E, H);
  char path[512];
  for (int variant = 0; variant < 5; variant++) {
    attn_mha *m;
    CHECK_OK(ctx, attn_mha_create(ctx, &m, &c));
    if (variant == 0)
      for (int i = 0; i < 8; i++) CHECK_OK(ctx, attn_mha_set_param(ctx, m, seed_names[i], vals[i]));
    if (variant == 1) {
      CHECK_OK(ctx, attn_mha_set_param(ctx, m, "in_proj_weight", &P));
      CHECK_OK(ctx, attn_mha_set_param(ctx, m, "in_proj_bias", &PB));
      CHECK_OK(ctx, attn_mha_set_param(ctx, m, "out_proj.weight", &Wo));
      CHECK_OK(ctx, attn_mha_set_param(ctx, m, "out_proj.bias", &Bo));
    }
    if (variant == 2) {
      CHECK_OK(ctx, attn_mha_set_param(ctx, m, "q_proj_weight", &Wq));
      CHECK_OK(ctx, attn_mha_set_param(ctx, m, "k_proj_weight", &Wk));
      CHECK_OK(ctx, attn_mha_set_param(ctx, m, "v_proj_weight", &Wv));
      CHECK_OK(ctx, attn_mha_set_param(ctx, m, "in_proj_bias", &PB));
      CHECK_OK(ctx, attn_mha_set_param(ctx, m, "out_proj.weight", &Wo));
      CHECK_OK(ctx, attn_mha_set_param(ctx, m, "out_proj.bias", &Bo));
    }
    if (variant == 3) {
      /* through a safetensors file with a prefix and an unrelated tensor beside it */
      const char *names[10];
      attn_tensor ts[10];
      char nb[9][64];
      for (int i = 0; i < 8; i++) {
        snprintf(nb[i], sizeof nb[i], "model.layers.0.attn.%s", llama_names[i]);
        names[i] = nb[i];
        ts[i] = *vals[i];
      }
      names[8] = "model.embed.weight";
      ts[8] = Wq;
      snprintf(path, sizeof path, "%s/test_mha_llama_%ld.safetensors", tmpdir(), (long)getpid());
      CHECK_OK(ctx, attn_safetensors_write(ctx, path, 9, names, ts));
      CHECK_OK(ctx, attn_mha_load_safetensors(ctx, m, path, "model.layers.0.attn."));
      attn_mha *m2;
      CHECK_OK(ctx, attn_mha_create_from_safetensors(ctx, &m2, path, "model.layers.0.attn.", H, 0));
      CHECK(m2 && attn_mha_get_config(m2)->embed_dim == E && attn_mha_get_config(m2)->bias == 1, "inferred config");
      attn_mha_destroy(m2);
      CHECK(attn_mha_load_safetensors(ctx, m, path, "wrong.") == ATTN_E_NOT_FOUND && strstr(attn_ctx_error(ctx), "wrong."),
            "a wrong prefix names itself: %s", attn_ctx_error(ctx));
    }
    if (variant == 4) {
      /* PyTorch's packed naming, in f64 in the file */
      double pd[3 * E * E], pbd[3 * E], wod[E * E], bod[E];
      for (int i = 0; i < 3 * E * E; i++) pd[i] = packed[i];
      for (int i = 0; i < 3 * E; i++) pbd[i] = pb[i];
      for (int i = 0; i < E * E; i++) wod[i] = wo[i];
      for (int i = 0; i < E; i++) bod[i] = bo[i];
      attn_tensor ts[4] = {attn_tensor_view(pd, ATTN_F64, 2, sp), attn_tensor_view(pbd, ATTN_F64, 1, spb),
                           attn_tensor_view(wod, ATTN_F64, 2, sw), attn_tensor_view(bod, ATTN_F64, 1, sb)};
      const char *names[4] = {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"};
      snprintf(path, sizeof path, "%s/test_mha_torch_%ld.safetensors", tmpdir(), (long)getpid());
      CHECK_OK(ctx, attn_safetensors_write(ctx, path, 4, names, ts));
      CHECK_OK(ctx, attn_mha_load_safetensors(ctx, m, path, NULL));
      /* a file missing a tensor is a clear error */
      CHECK_OK(ctx, attn_safetensors_write(ctx, path, 3, names, ts));
      CHECK(attn_mha_load_safetensors(ctx, m, path, "") == ATTN_E_NOT_FOUND && strstr(attn_ctx_error(ctx), "out_proj.bias"),
            "missing tensor: %s", attn_ctx_error(ctx));
      CHECK_OK(ctx, attn_safetensors_write(ctx, path, 4, names, ts));
      CHECK_OK(ctx, attn_mha_load_safetensors(ctx, m, path, NULL));
    }
    attn_tensor to = attn_tensor_view(outs[variant], ATTN_F32, 3, sx);
    CHECK_OK(ctx, attn_mha_forward(ctx, m, &to, NULL, &tx, NULL, NULL, NULL));
    if (variant) CHECK(!memcmp(outs[0], outs[variant], sizeof outs[0]), "naming variant %d differs", variant);
    attn_mha_destroy(m);
  }
}

/* The address space this process holds now, in bytes (0 if unknown). */
static uint64_t address_space(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  unsigned long long pages = 0;
  if (f) {
    if (fscanf(f, "%llu", &pages) != 1) pages = 0;
    fclose(f);
  }
  return (uint64_t)pages * (uint64_t)sysconf(_SC_PAGESIZE);
}

/* Runs fn in a child whose address space may grow by at most `room` bytes,
 * so that a large allocation fails there (or aborts, under ASan) instead of
 * happening; returns the child's exit status, or -1 if it did not exit. */
static int run_limited(int (*fn)(void), uint64_t room) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    const uint64_t now = address_space();
    if (now) {
      struct rlimit rl = {(rlim_t)(now + room), (rlim_t)(now + room)};
      setrlimit(RLIMIT_AS, &rl);
    }
    _exit(fn());
  }
  int ws = 0;
  if (pid < 0 || waitpid(pid, &ws, 0) != pid) return -1;
  return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

static char hostile_path[512];

/* The hardening issue's 33 KB file: 64 x 64 q and o weights, and k and v weights
 * of shape [0, 2^24] that once made the layer allocate and zero 8 GiB. */
static void write_hostile(attn_ctx *ctx, int64_t krows, int64_t kcols) {
  static float w[64 * 64];
  int64_t sw[2] = {64, 64}, sk[2] = {krows, kcols};
  attn_tensor ts[4] = {attn_tensor_view(w, ATTN_F32, 2, sw), attn_tensor_view(w, ATTN_F32, 2, sk),
                       attn_tensor_view(w, ATTN_F32, 2, sk), attn_tensor_view(w, ATTN_F32, 2, sw)};
  const char *names[4] = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"};
  snprintf(hostile_path, sizeof hostile_path, "%s/test_mha_hostile_%ld.safetensors", tmpdir(), (long)getpid());
  CHECK_OK(ctx, attn_safetensors_write(ctx, hostile_path, 4, names, ts));
}

/* 0: refused at once with a shape error naming the k weight. */
static int create_hostile(void) {
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx)) return 3;
  attn_mha *m = NULL;
  const attn_status st = attn_mha_create_from_safetensors(ctx, &m, hostile_path, "", 4, 0);
  const int ok = st == ATTN_E_SHAPE && m == NULL && strstr(attn_ctx_error(ctx), "k_proj.weight");
  if (!ok) fprintf(stderr, "hostile file: %s: %s\n", attn_strerror(st), attn_ctx_error(ctx));
  attn_mha_destroy(m);
  attn_ctx_destroy(ctx);
  return ok ? 0 : 1;
}

static void hostile_files(attn_ctx *ctx) {
  write_hostile(ctx, 0, (int64_t)1 << 24);
  struct stat sb;
  CHECK(stat(hostile_path, &sb) == 0 && sb.st_size < 34 * 1024, "the hostile file is small");
  /* 256 MiB of room: the 8 GiB of parameters cannot be allocated, let alone zeroed */
  CHECK(run_limited(create_hostile, (uint64_t)256 << 20) == 0, "a 33 KB file made the layer allocate");
  /* kdim (or vdim) 0 from a file would mean "= E" in a config: refused */
  write_hostile(ctx, 64, 0);
  attn_mha *m = NULL;
  CHECK_ERR(ctx, attn_mha_create_from_safetensors(ctx, &m, hostile_path, "", 4, 0), ATTN_E_SHAPE, "kdim");
  CHECK(m == NULL, "no layer on failure");
  remove(hostile_path);
}

static int same_params(attn_ctx *ctx, attn_mha *a, attn_mha *b) {
  for (int p = 0; p < TU_MHA_PROJ_PARAMS; p++) {
    attn_tensor ta, tb;
    const int ha = attn_mha_param_view(ctx, &ta, a, (attn_mha_param)p) == ATTN_OK;
    const int hb = attn_mha_param_view(ctx, &tb, b, (attn_mha_param)p) == ATTN_OK;
    if (ha != hb) return 0;
    if (ha && (attn_tensor_numel(&ta) != attn_tensor_numel(&tb) ||
               memcmp(ta.data, tb.data, sizeof(float) * (size_t)attn_tensor_numel(&ta))))
      return 0;
  }
  return 1;
}

/* Loading from an open handle, the namings the library reports, and a load
 * that checks every shape before writing any parameter. */
static void handle_api(attn_ctx *ctx) {
  enum { E = 8, H = 4, HK = 2, KV = HK * (E / H), KD = 5, VD = 3 };
  tu_rng r = {7};
  static float buf[4096];
  tu_fill_f32(&r, buf, 4096, 0.5);
  char path[512];
  snprintf(path, sizeof path, "%s/test_mha_handle_%ld.safetensors", tmpdir(), (long)getpid());
  /* nn.MultiheadAttention with kdim/vdim: separate weights, packed biases; GQA rows */
  int64_t sq[2] = {E, E}, sk[2] = {KV, KD}, sv[2] = {KV, VD}, sb[1] = {E + 2 * KV}, so[1] = {E};
  attn_tensor ts[7] = {attn_tensor_view(buf, ATTN_F32, 2, sq), attn_tensor_view(buf + 100, ATTN_F32, 2, sk),
                       attn_tensor_view(buf + 200, ATTN_F32, 2, sv), attn_tensor_view(buf + 300, ATTN_F32, 1, sb),
                       attn_tensor_view(buf + 400, ATTN_F32, 2, sq), attn_tensor_view(buf + 500, ATTN_F32, 1, so),
                       attn_tensor_view(buf + 600, ATTN_F32, 2, sq)};
  const char *names[7] = {"l.q_proj_weight", "l.k_proj_weight", "l.v_proj_weight", "l.in_proj_bias",
                          "l.out_proj.weight", "l.out_proj.bias", "other.weight"};
  CHECK_OK(ctx, attn_safetensors_write(ctx, path, 7, names, ts));
  attn_safetensors *st = NULL;
  CHECK_OK(ctx, attn_safetensors_open(ctx, &st, path));
  if (!st) return;
  attn_mha_naming nm = ATTN_MHA_NAMING_LLAMA;
  CHECK_OK(ctx, attn_mha_detect_naming(ctx, &nm, st, "l."));
  CHECK(nm == ATTN_MHA_NAMING_TORCH_SEPARATE, "naming %d", (int)nm);
  CHECK_ERR(ctx, attn_mha_detect_naming(ctx, &nm, st, "m."), ATTN_E_NOT_FOUND, "m.");
  CHECK(nm == ATTN_MHA_NAMING_NONE, "no naming under a wrong prefix");
  CHECK_ERR(ctx, attn_mha_detect_naming(ctx, &nm, NULL, "l."), ATTN_E_INVALID, "NULL");
  attn_mha *a = NULL, *b = NULL, *c = NULL;
  CHECK_OK(ctx, attn_mha_create_from_safetensors_handle(ctx, &a, st, "l.", H, HK));
  CHECK_OK(ctx, attn_mha_create_from_safetensors(ctx, &b, path, "l.", H, HK));
  if (a && b) {
    const attn_mha_config *cf = attn_mha_get_config(a);
    CHECK(cf->embed_dim == E && cf->kdim == KD && cf->vdim == VD && cf->num_kv_heads == HK && cf->bias,
          "config from the file");
    CHECK(same_params(ctx, a, b), "handle and path give the same layer");
    attn_tensor t;
    CHECK_OK(ctx, attn_mha_param_view(ctx, &t, a, ATTN_MHA_V_BIAS));
    CHECK(!memcmp(t.data, buf + 300 + E + KV, sizeof(float) * KV), "v bias from the packed in_proj_bias");
    CHECK_OK(ctx, attn_mha_create(ctx, &c, cf));
    CHECK_OK(ctx, attn_mha_load_safetensors_handle(ctx, c, st, "l."));
    CHECK(c && same_params(ctx, a, c), "load from a handle");
  }
  attn_mha_destroy(b);
  b = NULL;
  /* the handle is still the caller's */
  attn_tensor t;
  CHECK_OK(ctx, attn_safetensors_get(ctx, &t, st, "other.weight"));
  attn_safetensors_close(st);
  CHECK_ERR(ctx, attn_mha_create_from_safetensors_handle(ctx, &b, NULL, "", 1, 0), ATTN_E_INVALID, "NULL");
  CHECK(b == NULL, "out is NULL on failure");

  /* a bad shape late in the file leaves the layer as it was */
  names[4] = "l.out_proj.weight";
  int64_t sbad[2] = {E, E + 1};
  ts[4] = attn_tensor_view(buf + 400, ATTN_F32, 2, sbad);
  CHECK_OK(ctx, attn_safetensors_write(ctx, path, 6, names, ts));
  if (c) {
    attn_tensor q;
    CHECK_OK(ctx, attn_mha_param_view(ctx, &q, c, ATTN_MHA_Q_WEIGHT));
    float *w = q.data;
    for (int i = 0; i < E * E; i++) w[i] = 42;
    CHECK_ERR(ctx, attn_mha_load_safetensors(ctx, c, path, "l."), ATTN_E_SHAPE, "out_proj.weight");
    int untouched = 1;
    for (int i = 0; i < E * E; i++) untouched &= w[i] == 42;
    CHECK(untouched, "a failed load wrote the q weight");
  }
  CHECK_ERR(ctx, attn_mha_create_from_safetensors(ctx, &b, path, "l.", H, HK), ATTN_E_SHAPE, "out_proj.weight");

  /* every naming's names */
  CHECK(!strcmp(attn_mha_param_name(ATTN_MHA_NAMING_LLAMA, ATTN_MHA_K_BIAS), "k_proj.bias"), "llama k bias");
  CHECK(!strcmp(attn_mha_param_name(ATTN_MHA_NAMING_SEED, ATTN_MHA_O_WEIGHT), "dense.weight"), "seed out weight");
  CHECK(!strcmp(attn_mha_param_name(ATTN_MHA_NAMING_TORCH_PACKED, ATTN_MHA_V_WEIGHT), "in_proj_weight"), "packed");
  CHECK(!strcmp(attn_mha_param_name(ATTN_MHA_NAMING_TORCH_SEPARATE, ATTN_MHA_K_BIAS), "in_proj_bias"), "separate");
  CHECK(attn_mha_param_name(ATTN_MHA_NAMING_NONE, ATTN_MHA_Q_WEIGHT) == NULL, "NONE has no names");
  CHECK(!strcmp(attn_mha_param_name(ATTN_MHA_NAMING_PHI3, ATTN_MHA_K_WEIGHT), "qkv_proj.weight"), "phi3 packed");
  CHECK(!strcmp(attn_mha_param_name(ATTN_MHA_NAMING_LLAMA, ATTN_MHA_SINKS), "sinks"), "llama sinks");
  CHECK(attn_mha_param_name(ATTN_MHA_NAMING_BERT, ATTN_MHA_SINKS) == NULL, "BERT has no sinks");
  CHECK(attn_mha_param_name((attn_mha_naming)13, ATTN_MHA_Q_WEIGHT) == NULL, "naming out of range");
  CHECK(!strcmp(attn_mha_param_name(ATTN_MHA_NAMING_PHI, ATTN_MHA_O_BIAS), "dense.bias") &&
            !strcmp(attn_mha_param_name(ATTN_MHA_NAMING_PHI, ATTN_MHA_K_NORM_BIAS), "k_layernorm.bias"),
        "phi: dense, k_layernorm");
  CHECK(attn_mha_param_name(ATTN_MHA_NAMING_CUSTOM, ATTN_MHA_Q_WEIGHT) == NULL, "CUSTOM has no static names");
  CHECK(attn_mha_param_name(ATTN_MHA_NAMING_LLAMA, ATTN_MHA_NUM_PARAMS) == NULL, "parameter out of range");
  attn_mha_destroy(a);
  attn_mha_destroy(b);
  attn_mha_destroy(c);
  remove(path);
}

/* Broadcast (stride 0) inputs claim as many positions as int64 allows; the
 * layer's buffers for them would pass 2^63 bytes and must be refused, not
 * wrapped around into a small allocation. */
static void huge_broadcast(attn_ctx *ctx) {
  enum { E = 64 };
  attn_mha_config c;
  attn_mha_config_init(&c, E, 1);
  c.kdim = c.vdim = 1;
  attn_mha *m;
  CHECK_OK(ctx, attn_mha_create(ctx, &m, &c));
  static float q[2 * E], o[2 * E], one[1] = {1};
  int64_t sq[3] = {1, 2, E}, sk[3] = {1, (int64_t)1 << 58, 1};
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 3, sq), to = attn_tensor_view(o, ATTN_F32, 3, sq);
  attn_tensor tk = attn_tensor_view(one, ATTN_F32, 3, sk);
  tk.strides[0] = tk.strides[1] = tk.strides[2] = 0;
  /* 2^58 keys x 64 projected features x 4 bytes = 2^66 */
  CHECK_ERR(ctx, attn_mha_forward(ctx, m, &to, NULL, &tq, &tk, &tk, NULL), ATTN_E_NOMEM, "too large");
  attn_mha_saved *sv = NULL;
  CHECK_ERR(ctx, attn_mha_forward_save(ctx, m, &to, NULL, &sv, &tq, &tk, &tk, NULL), ATTN_E_NOMEM, "too large");
  CHECK(sv == NULL, "no saved state on failure");
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_REF);
  CHECK_ERR(ctx, attn_mha_forward(ctx, m, &to, NULL, &tq, &tk, &tk, NULL), ATTN_E_NOMEM, "too large");
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  attn_mha_destroy(m);

  /* one decoding step of 2^60 broadcast tokens: [B * n, E + 2 Hk D] passes int64 */
  attn_mha_config_init(&c, 4, 1);
  CHECK_OK(ctx, attn_mha_create(ctx, &m, &c));
  attn_kv_cache_config kc;
  attn_kv_cache_config_init(&kc, 1, 16, 1, 4);
  attn_kv_cache *cache;
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &kc));
  int64_t sx[3] = {1, (int64_t)1 << 60, 4};
  attn_tensor tx = attn_tensor_view(one, ATTN_F32, 3, sx);
  tx.strides[0] = tx.strides[1] = tx.strides[2] = 0;
  /* an output of 2^60 rows can only be a broadcast view, refused as an output before any size is computed */
  attn_tensor ty = tx;
  CHECK_ERR(ctx, attn_mha_forward_cached(ctx, m, cache, &ty, &tx, NULL), ATTN_E_INVALID, "cannot broadcast");
  CHECK(attn_kv_cache_length(cache, 0) == 0, "nothing appended");
  attn_kv_cache_destroy(cache);
  attn_mha_destroy(m);
}

/* Learned sinks (config.sinks): the layer's SINKS parameter reaches every
 * forward as attn_sdpa_opts.sinks does, so a layer holding them gives the bits
 * of the same layer without them given those values in the options (plain,
 * saved, cached step; weights too). The options' own sinks are then refused,
 * and a layer without sinks has no such parameter. */
static void learned_sinks(attn_ctx *ctx) {
  enum { E = 16, H = 4, HK = 2, D = E / H, B = 2, N = 7 };
  tu_rng r = {31};
  attn_mha_config c;
  attn_mha_config_init(&c, E, H);
  c.num_kv_heads = HK;
  attn_mha *plain, *learned, *grads;
  CHECK_OK(ctx, attn_mha_create(ctx, &plain, &c));
  c.sinks = 2;
  CHECK_ERR(ctx, attn_mha_create(ctx, &learned, &c), ATTN_E_INVALID, "sinks must be 0 or 1");
  c.sinks = 1;
  CHECK_OK(ctx, attn_mha_create(ctx, &learned, &c));
  randomize(ctx, plain, &r);
  for (int p = 0; p < TU_MHA_PROJ_PARAMS; p++) {
    attn_tensor a, b;
    if (attn_mha_param_view(ctx, &a, plain, (attn_mha_param)p)) continue;
    CHECK_OK(ctx, attn_mha_param_view(ctx, &b, learned, (attn_mha_param)p));
    memcpy(b.data, a.data, sizeof(float) * (size_t)attn_tensor_numel(&a));
  }
  attn_tensor ts;
  CHECK_OK(ctx, attn_mha_param_view(ctx, &ts, learned, ATTN_MHA_SINKS));
  CHECK(ts.rank == 1 && ts.shape[0] == H && ts.dtype == ATTN_F32, "SINKS is f32 [H]");
  float *sk = ts.data;
  CHECK(sk[0] == 0 && sk[H - 1] == 0, "sinks start at zero");
  for (int h = 0; h < H; h++) sk[h] = (float)(1.5 * tu_uniform(&r));
  CHECK_ERR(ctx, attn_mha_param_view(ctx, &ts, plain, ATTN_MHA_SINKS), ATTN_E_NOT_FOUND, "without sinks");
  CHECK_ERR(ctx, attn_mha_set_param(ctx, plain, "sinks", &ts), ATTN_E_INVALID, "without sinks");
  CHECK_OK(ctx, attn_mha_param_view(ctx, &ts, learned, ATTN_MHA_SINKS));

  static float x[B * N * E], o1[B * N * E], o2[B * N * E], w1[B * H * N * N], w2[B * H * N * N];
  tu_fill_f32(&r, x, B * N * E, 1);
  int64_t sx[3] = {B, N, E}, sw[4] = {B, H, N, N};
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 3, sx);
  attn_tensor t1 = attn_tensor_view(o1, ATTN_F32, 3, sx), t2 = attn_tensor_view(o2, ATTN_F32, 3, sx);
  attn_tensor tw1 = attn_tensor_view(w1, ATTN_F32, 4, sw), tw2 = attn_tensor_view(w2, ATTN_F32, 4, sw);
  attn_mha_opts given, own;
  attn_mha_opts_init(&given);
  attn_mha_opts_init(&own);
  given.attn.causal = own.attn.causal = ATTN_CAUSAL_TOP_LEFT;
  given.attn.window = own.attn.window = 4;
  given.attn.sinks = &ts;
  tu_poison_f32(o2, B * N * E);
  tu_poison_f32(w2, B * H * N * N);
  CHECK_OK(ctx, attn_mha_forward(ctx, plain, &t1, &tw1, &tx, NULL, NULL, &given));
  CHECK_OK(ctx, attn_mha_forward(ctx, learned, &t2, &tw2, &tx, NULL, NULL, &own));
  CHECK(!memcmp(o1, o2, sizeof o1) && !memcmp(w1, w2, sizeof w1), "learned sinks: not the options' sinks' bits");
  attn_mha_saved *sv = NULL;
  tu_poison_f32(o2, B * N * E);
  CHECK_OK(ctx, attn_mha_forward_save(ctx, learned, &t2, NULL, &sv, &tx, NULL, NULL, NULL));
  CHECK_OK(ctx, attn_mha_forward(ctx, plain, &t1, NULL, &tx, NULL, NULL, NULL));
  CHECK(memcmp(o1, o2, sizeof o1), "learned sinks left the output unchanged");
  given.attn.causal = ATTN_CAUSAL_NONE;
  given.attn.window = 0;
  CHECK_OK(ctx, attn_mha_forward(ctx, plain, &t1, NULL, &tx, NULL, NULL, &given));
  CHECK(!memcmp(o1, o2, sizeof o1), "forward_save with no options: not the sinks' bits");
  /* the backward's grads must hold the sinks too */
  CHECK_OK(ctx, attn_mha_create(ctx, &grads, attn_mha_get_config(plain)));
  CHECK_ERR(ctx, attn_mha_backward(ctx, learned, &t1, NULL, NULL, grads, sv, &tx), ATTN_E_INVALID, "sinks on");
  attn_mha_saved_free(sv);
  attn_mha_destroy(grads);
  CHECK_ERR(ctx, attn_mha_forward(ctx, learned, &t2, NULL, &tx, NULL, NULL, &given), ATTN_E_INVALID,
            "holds its own");

  /* the cached step, token by token, in two caches */
  attn_kv_cache_config kc;
  attn_kv_cache_config_init(&kc, B, N, HK, D);
  attn_kv_cache *c1, *c2;
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &c1, &kc));
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &c2, &kc));
  int same = 1;
  for (int n = 0; n < N; n++) {
    int64_t s1[3] = {B, 1, E};
    attn_tensor xn = attn_tensor_view(x + n * E, ATTN_F32, 3, s1), y1 = attn_tensor_view(o1, ATTN_F32, 3, s1),
                y2 = attn_tensor_view(o2, ATTN_F32, 3, s1);
    xn.strides[0] = y1.strides[0] = y2.strides[0] = N * E;
    CHECK_OK(ctx, attn_mha_forward_cached(ctx, plain, c1, &y1, &xn, &given));
    CHECK_OK(ctx, attn_mha_forward_cached(ctx, learned, c2, &y2, &xn, NULL));
    same = same && !memcmp(o1, o2, sizeof(float) * E) && !memcmp(o1 + N * E, o2 + N * E, sizeof(float) * E);
  }
  CHECK(same, "cached step: learned sinks not the options' sinks' bits");
  CHECK_ERR(ctx, attn_mha_forward_cached(ctx, learned, c2, &t2, &tx, &given), ATTN_E_INVALID, "holds its own");
  attn_kv_cache_destroy(c1);
  attn_kv_cache_destroy(c2);
  attn_mha_destroy(plain);
  attn_mha_destroy(learned);
}

int main(int argc, char **argv) {
  /* ctest runs this again with ATTN_KERNEL set: a kernel this CPU lacks is a skip */
  tu_kernel_or_skip(getenv("ATTN_KERNEL"));
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx)) return 1;
  const int cases = argc > 1 ? atoi(argv[1]) : 150;
  hostile_files(ctx);
  handle_api(ctx);
  huge_broadcast(ctx);
  namings(ctx);
  learned_sinks(ctx);
  for (int i = 0; i < cases; i++) random_layer_case(ctx, 5000 + (uint64_t)i);
  attn_ctx_destroy(ctx);
  return tu_finish("test_mha");
}
