/* The API's contract outside the arithmetic: versions, statuses, contexts,
 * tensor helpers, every error path of attn_sdpa (a status, a message,
 * and outputs left untouched), and the sizes options and configs carry. */
#include "testutil.h"

static void versions_and_statuses(void) {
  CHECK(attn_version() == ATTN_VERSION_HEX, "runtime version %x vs header %x", attn_version(), ATTN_VERSION_HEX);
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", ATTN_VERSION_MAJOR, ATTN_VERSION_MINOR, ATTN_VERSION_PATCH);
  CHECK(!strcmp(attn_version_string(), want), "version string %s", attn_version_string());
  for (int s = ATTN_OK; s <= ATTN_E_UNSUPPORTED; s++)
    CHECK(attn_strerror((attn_status)s)[0] != '\0' && strcmp(attn_strerror((attn_status)s), "unknown status"),
          "status %d has no message", s);
  CHECK(!strcmp(attn_strerror((attn_status)1234), "unknown status"), "unknown status text");
  CHECK(attn_dtype_size(ATTN_F32) == 4 && attn_dtype_size(ATTN_F64) == 8 && attn_dtype_size(ATTN_BF16) == 2 &&
            attn_dtype_size(ATTN_BOOL) == 1,
        "dtype sizes");
}

static void contexts(void) {
  attn_ctx *ctx;
  CHECK(attn_ctx_create(NULL) == ATTN_E_INVALID, "create(NULL)");
  CHECK_OK(NULL, attn_ctx_create(&ctx));
  CHECK(attn_ctx_error(ctx)[0] == '\0', "a new context has no message");
  CHECK_ERR(ctx, attn_ctx_set_threads(ctx, -1), ATTN_E_INVALID, "thread");
  CHECK_OK(ctx, attn_ctx_set_threads(ctx, 3));
  CHECK(attn_ctx_threads(ctx) == 3, "threads %d", attn_ctx_threads(ctx));
  CHECK(attn_ctx_error(ctx)[0] == '\0', "a successful call clears the message");
  CHECK_ERR(ctx, attn_ctx_set_kernel(ctx, (attn_kernel)77), ATTN_E_INVALID, "kernel");
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_REF));
  CHECK(attn_ctx_kernel(ctx) == ATTN_KERNEL_REF, "kernel set");
  CHECK(!strcmp(attn_kernel_name(ATTN_KERNEL_C), "c") && !strcmp(attn_kernel_name(ATTN_KERNEL_REF), "ref"),
        "kernel names");
  /* ATTN_KERNEL, read when a context is created, picks the path of a context
   * left on AUTO; unknown or unsupported names are ignored */
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO));
  const attn_kernel automatic = attn_ctx_kernel(ctx);
  CHECK(automatic != ATTN_KERNEL_AUTO && automatic != ATTN_KERNEL_REF && attn_kernel_supported(automatic),
        "AUTO resolves to a supported fast kernel, got %s", attn_kernel_name(automatic));
  CHECK(attn_ctx_kernel(NULL) == automatic, "no context: the automatic choice, got %s",
        attn_kernel_name(attn_ctx_kernel(NULL)));
  for (int k = ATTN_KERNEL_REF; k <= ATTN_KERNEL_AMX; k++) {
    setenv("ATTN_KERNEL", attn_kernel_name((attn_kernel)k), 1);
    attn_ctx *env_ctx;
    CHECK_OK(NULL, attn_ctx_create(&env_ctx));
    const attn_kernel got = attn_ctx_kernel(env_ctx);
    if (attn_kernel_supported((attn_kernel)k)) CHECK((int)got == k, "ATTN_KERNEL=%s gave %s", attn_kernel_name((attn_kernel)k), attn_kernel_name(got));
    else {
      CHECK(got == automatic, "unsupported ATTN_KERNEL=%s must fall back", attn_kernel_name((attn_kernel)k));
      CHECK_ERR(ctx, attn_ctx_set_kernel(ctx, (attn_kernel)k), ATTN_E_UNSUPPORTED, "not supported");
    }
    /* a kernel set explicitly wins over the environment; AUTO returns to it */
    CHECK_OK(env_ctx, attn_ctx_set_kernel(env_ctx, ATTN_KERNEL_C));
    CHECK(attn_ctx_kernel(env_ctx) == ATTN_KERNEL_C, "set kernel under ATTN_KERNEL=%s", attn_kernel_name((attn_kernel)k));
    CHECK_OK(env_ctx, attn_ctx_set_kernel(env_ctx, ATTN_KERNEL_AUTO));
    CHECK(attn_ctx_kernel(env_ctx) == got, "AUTO again under ATTN_KERNEL=%s", attn_kernel_name((attn_kernel)k));
    CHECK(attn_ctx_kernel(ctx) == automatic, "a context made before setenv keeps its kernel");
    attn_ctx_destroy(env_ctx);
  }
  setenv("ATTN_KERNEL", "nonsense", 1);
  attn_ctx *env_ctx;
  CHECK_OK(NULL, attn_ctx_create(&env_ctx));
  CHECK(attn_ctx_kernel(env_ctx) == automatic, "an unknown ATTN_KERNEL is ignored");
  attn_ctx_destroy(env_ctx);
  unsetenv("ATTN_KERNEL");

  /* the decode switch: on by default, off when ATTN_DECODE=0 at create */
  CHECK(attn_ctx_decode(ctx) == 1 && attn_ctx_decode(NULL) == 1, "decode on by default");
  CHECK_OK(ctx, attn_ctx_set_decode(ctx, 0));
  CHECK(attn_ctx_decode(ctx) == 0, "decode switched off");
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_C));
  CHECK(attn_ctx_decode(ctx) == 0, "a kernel change keeps the decode switch");
  CHECK_OK(ctx, attn_ctx_set_decode(ctx, 1));
  CHECK(attn_ctx_decode(ctx) == 1 && attn_ctx_kernel(ctx) == ATTN_KERNEL_C, "decode switched on, kernel kept");
  CHECK(attn_ctx_set_decode(NULL, 0) == ATTN_E_INVALID, "set_decode(NULL)");
  setenv("ATTN_DECODE", "0", 1);
  CHECK_OK(NULL, attn_ctx_create(&env_ctx));
  unsetenv("ATTN_DECODE");
  CHECK(attn_ctx_decode(env_ctx) == 0, "ATTN_DECODE=0 at create turns decode off");
  CHECK_OK(env_ctx, attn_ctx_set_decode(env_ctx, 1));
  CHECK(attn_ctx_decode(env_ctx) == 1, "set_decode overrides ATTN_DECODE");
  attn_ctx_destroy(env_ctx);
  attn_ctx_destroy(ctx);
  attn_ctx_destroy(NULL);
}

static void tensors(void) {
  float buf[2 * 3 * 4];
  int64_t s[3] = {2, 3, 4};
  attn_tensor t = attn_tensor_view(buf, ATTN_F32, 3, s), p;
  CHECK(t.strides[0] == 12 && t.strides[1] == 4 && t.strides[2] == 1, "contiguous strides");
  CHECK(attn_tensor_numel(&t) == 24, "numel");
  int perm[3] = {0, 2, 1};
  CHECK(attn_tensor_permute(&p, &t, perm) == ATTN_OK && p.shape[1] == 4 && p.strides[1] == 1 && p.strides[2] == 4,
        "permute");
  int bad[3] = {0, 0, 1};
  CHECK(attn_tensor_permute(&p, &t, bad) == ATTN_E_INVALID, "a repeated axis is refused");
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  attn_tensor a;
  int64_t huge[2] = {INT64_MAX / 2, 4};
  CHECK_ERR(ctx, attn_tensor_alloc(ctx, &a, ATTN_F32, 2, huge), ATTN_E_SHAPE, "large");
  int64_t neg[1] = {-1};
  CHECK_ERR(ctx, attn_tensor_alloc(ctx, &a, ATTN_F32, 1, neg), ATTN_E_SHAPE, "shape");
  CHECK_ERR(ctx, attn_tensor_alloc(ctx, &a, ATTN_F32, 9, s), ATTN_E_INVALID, "rank");
  CHECK_OK(ctx, attn_tensor_alloc(ctx, &a, ATTN_F64, 3, s));
  CHECK(((uintptr_t)a.data & 63) == 0 && ((double *)a.data)[23] == 0, "aligned and zeroed");
  attn_tensor_free(&a);
  CHECK(a.data == NULL, "free clears the pointer");
  attn_ctx_destroy(ctx);
}

/* Every way to call attn_sdpa wrongly. */
static void sdpa_errors(void) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  enum { B = 2, H = 4, N = 5, D = 8 };
  static float q[B * H * N * D], k[B * H * N * D], v[B * H * N * D], out[B * H * N * D], w[B * H * N * N];
  static float lse[B * H * N];
  tu_rng r = {5};
  tu_fill_f32(&r, q, B * H * N * D, 1);
  tu_fill_f32(&r, k, B * H * N * D, 1);
  tu_fill_f32(&r, v, B * H * N * D, 1);
  int64_t s[4] = {B, H, N, D};
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, s), tk = tq, tv = tq, to = attn_tensor_view(out, ATTN_F32, 4, s);
  tk.data = k;
  tv.data = v;
  tu_poison_f32(out, B * H * N * D);
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  const attn_kernel kernels[] = {ATTN_KERNEL_REF, ATTN_KERNEL_C};
  for (int ki = 0; ki < 2; ki++) {
    attn_ctx_set_kernel(ctx, kernels[ki]);
    CHECK_ERR(ctx, attn_sdpa(ctx, NULL, NULL, NULL, &tq, &tk, &tv, &o), ATTN_E_INVALID, "out");
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, NULL, &tv, &o), ATTN_E_INVALID, "k");
    attn_tensor t3 = tq;
    t3.rank = 3;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &t3, &tk, &tv, &o), ATTN_E_SHAPE, "rank");
    attn_tensor nul = tq;
    nul.data = NULL;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &nul, &tk, &tv, &o), ATTN_E_INVALID, "NULL");
    attn_tensor neg = tq;
    neg.shape[2] = -3;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &neg, &tk, &tv, &o), ATTN_E_SHAPE, "negative");
    attn_tensor kd = tk;
    kd.shape[3] = D - 1;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &kd, &tv, &o), ATTN_E_SHAPE, "k");
    attn_tensor kb = tk;
    kb.shape[0] = 1;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &kb, &tv, &o), ATTN_E_SHAPE, "k");
    attn_tensor vn = tv;
    vn.shape[2] = N - 1;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &vn, &o), ATTN_E_SHAPE, "v");
    attn_tensor kh = tk, vh = tv;
    kh.shape[1] = vh.shape[1] = 3; /* 4 query heads over 3 kv heads */
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &kh, &vh, &o), ATTN_E_SHAPE, "multiple");
    attn_tensor ob = to;
    ob.shape[3] = D + 1;
    CHECK_ERR(ctx, attn_sdpa(ctx, &ob, NULL, NULL, &tq, &tk, &tv, &o), ATTN_E_SHAPE, "out");
    attn_tensor os = to;
    os.strides[2] = 0;
    CHECK_ERR(ctx, attn_sdpa(ctx, &os, NULL, NULL, &tq, &tk, &tv, &o), ATTN_E_INVALID, "stride 0");
    attn_tensor qd = tq;
    qd.dtype = ATTN_BOOL;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &qd, &tk, &tv, &o), ATTN_E_DTYPE, "dtype");
    attn_tensor q0 = tq, k0 = tk;
    q0.shape[3] = k0.shape[3] = 0;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &q0, &k0, &tv, &o), ATTN_E_SHAPE, "at least 1");

    attn_sdpa_opts bad = o;
    bad.scale = INFINITY;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &tv, &bad), ATTN_E_INVALID, "scale");
    bad = o;
    bad.causal = (attn_causal)9;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &tv, &bad), ATTN_E_INVALID, "causal");

    /* masks */
    static uint8_t mb[B * H * N * N];
    int64_t ms[3] = {3, N, N};
    attn_tensor m = attn_tensor_view(mb, ATTN_BOOL, 3, ms); /* 3 does not broadcast to H = 4 */
    bad = o;
    bad.mask = &m;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &tv, &bad), ATTN_E_SHAPE, "broadcast");
    int64_t m5s[5] = {1, 1, 1, N, N};
    attn_tensor m5 = attn_tensor_view(mb, ATTN_BOOL, 5, m5s);
    bad.mask = &m5;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &tv, &bad), ATTN_E_SHAPE, "at most 4");
    int64_t m2s[2] = {N, N};
    attn_tensor mf = attn_tensor_view(w, ATTN_F32, 2, m2s);
    bad.mask = &mf;
    bad.mask_mode = ATTN_MASK_KEEP;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &tv, &bad), ATTN_E_DTYPE, "bool");
    attn_tensor mbool = attn_tensor_view(mb, ATTN_BOOL, 2, m2s);
    bad.mask = &mbool;
    bad.mask_mode = ATTN_MASK_ADDITIVE;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &tv, &bad), ATTN_E_DTYPE, "float");
    bad.mask_mode = (attn_mask_mode)17;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &tv, &bad), ATTN_E_INVALID, "mask mode");

    /* key padding */
    int64_t ks[2] = {B, N + 1};
    attn_tensor kp = attn_tensor_view(mb, ATTN_BOOL, 2, ks);
    bad = o;
    bad.key_padding = &kp;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &tv, &bad), ATTN_E_SHAPE, "key_padding");
    int64_t kfs[2] = {B, N};
    attn_tensor kpf = attn_tensor_view(w, ATTN_F32, 2, kfs);
    bad.key_padding = &kpf;
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &tv, &bad), ATTN_E_DTYPE, "key_padding");

    /* optional outputs */
    int64_t wbad[4] = {B, H, N, N + 1}, lbad[3] = {B, H, N + 1};
    attn_tensor tw = attn_tensor_view(w, ATTN_F32, 4, wbad), tl = attn_tensor_view(lse, ATTN_F32, 3, lbad);
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, &tw, &tq, &tk, &tv, &o), ATTN_E_SHAPE, "weights");
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, &tl, NULL, &tq, &tk, &tv, &o), ATTN_E_SHAPE, "lse");
  }
  int untouched = 1;
  for (int i = 0; i < B * H * N * D; i++) untouched &= isnan(out[i]) != 0;
  CHECK(untouched, "a refused call must leave its output untouched");
  /* f64 inputs: the oracle takes them, the fp32 kernel does not */
  static double qd64[B * H * N * D];
  attn_tensor t64 = attn_tensor_view(qd64, ATTN_F64, 4, s);
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_C);
  CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &t64, &tk, &tv, &o), ATTN_E_DTYPE, "f32");
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &to, NULL, NULL, &t64, &tk, &tv, &o));
  /* zero-size problems are fine and touch nothing */
  attn_tensor qe = tq, oe = to;
  qe.shape[2] = oe.shape[2] = 0;
  CHECK_OK(ctx, attn_sdpa(ctx, &oe, NULL, NULL, &qe, &tk, &tv, &o));
  attn_ctx_destroy(ctx);
}

static void mha_errors(void) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  attn_mha *m = NULL;
  attn_mha_config c;
  attn_mha_config_init(&c, 10, 3);
  CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "divisible");
  attn_mha_config_init(&c, 0, 1);
  CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "positive");
  attn_mha_config_init(&c, 8, 0);
  CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "positive");
  attn_mha_config_init(&c, 8, 4);
  c.num_kv_heads = 3;
  CHECK_ERR(ctx, attn_mha_create(ctx, &m, &c), ATTN_E_INVALID, "multiple");
  CHECK(m == NULL, "no layer after a failed create");
  attn_mha_config_init(&c, 8, 2);
  c.kdim = 6;
  CHECK_OK(ctx, attn_mha_create(ctx, &m, &c));
  float wbuf[64] = {0};
  int64_t s88[2] = {8, 8}, s86[2] = {8, 6}, s7[1] = {7};
  attn_tensor w88 = attn_tensor_view(wbuf, ATTN_F32, 2, s88), w86 = attn_tensor_view(wbuf, ATTN_F32, 2, s86);
  attn_tensor b7 = attn_tensor_view(wbuf, ATTN_F32, 1, s7);
  CHECK_OK(ctx, attn_mha_set_param(ctx, m, "wq.weight", &w88));
  CHECK_OK(ctx, attn_mha_set_param(ctx, m, "k_proj_weight", &w86));
  CHECK_ERR(ctx, attn_mha_set_param(ctx, m, "wk.weight", &w88), ATTN_E_SHAPE, "wk.weight");
  CHECK_ERR(ctx, attn_mha_set_param(ctx, m, "wq.bias", &b7), ATTN_E_SHAPE, "wq.bias");
  CHECK_ERR(ctx, attn_mha_set_param(ctx, m, "in_proj_weight", &w88), ATTN_E_SHAPE, "kdim");
  CHECK_ERR(ctx, attn_mha_set_param(ctx, m, "nonsense", &w88), ATTN_E_NOT_FOUND, "nonsense");
  float x[2 * 4 * 8] = {0}, y[2 * 3 * 8];
  int64_t xs[3] = {2, 3, 8}, ks[3] = {2, 4, 8}, ks6[3] = {2, 4, 6};
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 3, xs), ty = attn_tensor_view(y, ATTN_F32, 3, xs);
  attn_tensor tk8 = attn_tensor_view(x, ATTN_F32, 3, ks), tk6 = attn_tensor_view(x, ATTN_F32, 3, ks6);
  CHECK_ERR(ctx, attn_mha_forward(ctx, m, &ty, NULL, &tx, NULL, NULL, NULL), ATTN_E_INVALID, "self-attention");
  CHECK_ERR(ctx, attn_mha_forward(ctx, m, &ty, NULL, &tx, &tk8, &tk8, NULL), ATTN_E_SHAPE, "key");
  CHECK_ERR(ctx, attn_mha_forward(ctx, m, &ty, NULL, &tx, &tk6, NULL, NULL), ATTN_E_INVALID, "both");
  attn_tensor v3 = tk8;
  v3.shape[1] = 3;
  CHECK_ERR(ctx, attn_mha_forward(ctx, m, &ty, NULL, &tx, &tk6, &v3, NULL), ATTN_E_SHAPE, "positions");
  attn_tensor yb = ty;
  yb.shape[2] = 7;
  CHECK_ERR(ctx, attn_mha_forward(ctx, m, &yb, NULL, &tx, &tk6, &tk8, NULL), ATTN_E_SHAPE, "out");
  attn_tensor tw;
  float wb[2 * 2 * 3 * 4];
  int64_t wsb[4] = {2, 2, 3, 5};
  tw = attn_tensor_view(wb, ATTN_F32, 4, wsb);
  attn_mha_opts o;
  attn_mha_opts_init(&o);
  CHECK_ERR(ctx, attn_mha_forward(ctx, m, &ty, &tw, &tx, &tk6, &tk8, &o), ATTN_E_SHAPE, "weights");
  o.average_weights = 1;
  CHECK_ERR(ctx, attn_mha_forward(ctx, m, &ty, &tw, &tx, &tk6, &tk8, &o), ATTN_E_SHAPE, "rank");
  CHECK_OK(ctx, attn_mha_forward(ctx, m, &ty, NULL, &tx, &tk6, &tk8, NULL));
  attn_tensor pv;
  CHECK_OK(ctx, attn_mha_param_view(ctx, &pv, m, ATTN_MHA_K_WEIGHT));
  CHECK(pv.shape[0] == 8 && pv.shape[1] == 6, "k weight view [%lld, %lld]", (long long)pv.shape[0],
        (long long)pv.shape[1]);
  attn_mha_destroy(m);
  attn_mha_config_init(&c, 8, 2);
  c.bias = 0;
  CHECK_OK(ctx, attn_mha_create(ctx, &m, &c));
  CHECK_ERR(ctx, attn_mha_param_view(ctx, &pv, m, ATTN_MHA_Q_BIAS), ATTN_E_NOT_FOUND, "bias");
  int64_t s8[1] = {8};
  attn_tensor b8 = attn_tensor_view(wbuf, ATTN_F32, 1, s8);
  CHECK_ERR(ctx, attn_mha_set_param(ctx, m, "wq.bias", &b8), ATTN_E_INVALID, "without bias");
  attn_mha_destroy(m);
  attn_ctx_destroy(ctx);
}

/* The context's workspace: held after a call, released by attn_ctx_trim, and
 * a call after the trim (or on a context that holds a larger one) gives the
 * same bits. */
static void workspace(void) {
  attn_ctx *ctx = NULL;
  CHECK_OK(NULL, attn_ctx_create(&ctx));
  CHECK(attn_ctx_workspace_bytes(ctx) == 0, "a new context holds no workspace");
  const int64_t big[4] = {1, 2, 1024, 64}, small[4] = {1, 2, 96, 64};
  attn_tensor q, k, v, o1, o2, o3;
  CHECK_OK(ctx, attn_tensor_alloc(ctx, &q, ATTN_F32, 4, big));
  CHECK_OK(ctx, attn_tensor_alloc(ctx, &k, ATTN_F32, 4, big));
  CHECK_OK(ctx, attn_tensor_alloc(ctx, &v, ATTN_F32, 4, big));
  CHECK_OK(ctx, attn_tensor_alloc(ctx, &o1, ATTN_F32, 4, big));
  CHECK_OK(ctx, attn_tensor_alloc(ctx, &o2, ATTN_F32, 4, big));
  CHECK_OK(ctx, attn_tensor_alloc(ctx, &o3, ATTN_F32, 4, small));
  tu_rng r = {7};
  tu_fill_f32(&r, q.data, attn_tensor_numel(&q), 1.0);
  tu_fill_f32(&r, k.data, attn_tensor_numel(&k), 1.0);
  tu_fill_f32(&r, v.data, attn_tensor_numel(&v), 1.0);
  tu_poison_f32(o1.data, attn_tensor_numel(&o1));
  tu_poison_f32(o2.data, attn_tensor_numel(&o2));
  attn_sdpa_opts opts;
  attn_sdpa_opts_init(&opts);
  CHECK_OK(ctx, attn_sdpa(ctx, &o1, NULL, NULL, &q, &k, &v, &opts));
  const size_t held = attn_ctx_workspace_bytes(ctx);
  CHECK(held >= (size_t)(2 * 1024 * 64 * 4 / 2), "workspace of %zu bytes holds a head's packed keys", held);
  /* a smaller problem reuses it and leaves it as it is */
  attn_tensor qs = q, ks = k, vs = v;
  qs.shape[2] = ks.shape[2] = vs.shape[2] = 96;
  CHECK_OK(ctx, attn_sdpa(ctx, &o3, NULL, NULL, &qs, &ks, &vs, &opts));
  CHECK(attn_ctx_workspace_bytes(ctx) == held, "a smaller call keeps the workspace");
  attn_ctx_trim(ctx);
  CHECK(attn_ctx_workspace_bytes(ctx) == 0, "trim releases the workspace");
  CHECK_OK(ctx, attn_sdpa(ctx, &o2, NULL, NULL, &q, &k, &v, &opts));
  CHECK(!memcmp(o1.data, o2.data, (size_t)attn_tensor_numel(&o1) * sizeof(float)), "same bits after a trim");
  attn_ctx_trim(NULL); /* harmless */
  attn_tensor *all[] = {&q, &k, &v, &o1, &o2, &o3};
  for (int i = 0; i < 6; i++) attn_tensor_free(all[i]);
  attn_ctx_destroy(ctx); /* frees the workspace: the leak checker sees it */
}

/* attn_tensor_copy: every dtype pair on values all of them hold exactly, then
 * the roundings (ties to even, f64 to a half in one rounding), and the refusals. */
static const attn_dtype copy_dtypes[] = {ATTN_F32, ATTN_F64, ATTN_F16, ATTN_BF16, ATTN_BOOL, ATTN_U8};

/* The bytes of v (one of 0, 1, 3, 200) in dt, written out by hand; a bool holds 0 or 1. */
static void copy_encode(unsigned char *p, attn_dtype dt, int v) {
  static const uint16_t f16[] = {0x0000, 0x3c00, 0x4200, 0x5a40}, bf16[] = {0x0000, 0x3f80, 0x4040, 0x4348};
  const int i = v == 0 ? 0 : v == 1 ? 1 : v == 3 ? 2 : 3;
  switch (dt) {
    case ATTN_F32: { const float f = (float)v; memcpy(p, &f, 4); break; }
    case ATTN_F64: { const double d = v; memcpy(p, &d, 8); break; }
    case ATTN_F16: memcpy(p, &f16[i], 2); break;
    case ATTN_BF16: memcpy(p, &bf16[i], 2); break;
    case ATTN_BOOL: *p = v != 0; break;
    case ATTN_U8: *p = (unsigned char)v; break;
  }
}

static uint16_t copy_one_half(attn_ctx *ctx, attn_dtype to, attn_dtype from, double x) {
  unsigned char in[8];
  uint16_t out = 0xdead;
  if (from == ATTN_F32) { const float f = (float)x; memcpy(in, &f, 4); }
  else memcpy(in, &x, 8);
  const int64_t one = 1;
  attn_tensor s = attn_tensor_view(in, from, 1, &one), d = attn_tensor_view(&out, to, 1, &one);
  CHECK_OK(ctx, attn_tensor_copy(ctx, &d, &s));
  return out;
}

/* n values of src (dtype from) copied to dtype to twice: contiguous (a row at a time) and from every other
 * slot of a spread copy (element by element). Returns how many results differ in their bytes, the first
 * at *first (-1: none). */
static int64_t rows_against_elements(attn_ctx *ctx, attn_dtype to, attn_dtype from, const void *src, int64_t n,
                                     int64_t *first) {
  const size_t fs = attn_dtype_size(from), ts = attn_dtype_size(to);
  unsigned char *spread = malloc(2 * (size_t)n * fs), *by_rows = malloc((size_t)n * ts), *by_elems = malloc((size_t)n * ts);
  int64_t bad = 0;
  *first = -1;
  CHECK(spread && by_rows && by_elems, "allocation");
  if (spread && by_rows && by_elems) {
    memset(spread, 0, 2 * (size_t)n * fs);
    for (int64_t i = 0; i < n; i++) memcpy(spread + 2 * (size_t)i * fs, (const unsigned char *)src + (size_t)i * fs, fs);
    memset(by_rows, 0xee, (size_t)n * ts), memset(by_elems, 0x55, (size_t)n * ts);
    const int64_t two = 2 * n;
    attn_tensor s1 = attn_tensor_view((void *)src, from, 1, &n), d1 = attn_tensor_view(by_rows, to, 1, &n);
    attn_tensor s2 = attn_tensor_view(spread, from, 1, &two), d2 = attn_tensor_view(by_elems, to, 1, &n);
    s2.shape[0] = n, s2.strides[0] = 2;
    CHECK_OK(ctx, attn_tensor_copy(ctx, &d1, &s1));
    CHECK_OK(ctx, attn_tensor_copy(ctx, &d2, &s2));
    for (int64_t i = 0; i < n; i++)
      if (memcmp(by_rows + (size_t)i * ts, by_elems + (size_t)i * ts, ts)) bad++, *first = *first < 0 ? i : *first;
  }
  free(spread), free(by_rows), free(by_elems);
  return bad;
}

/* f32 <-> f16/bf16 with unit innermost strides go a row at a time through the kernel set's vector
 * conversions; a stride of 2 takes the element path. The two agree bit for bit: every f16 and bf16
 * pattern widened, and 2^22 f32 patterns (random bits, then every exponent with edge mantissas,
 * signalling and quiet NaNs, subnormals, ties) narrowed, on every kernel this CPU runs. */
static void copy_rows_as_elements(void) {
  enum { NF = 1 << 22 };
  uint32_t *f = malloc(sizeof(uint32_t) * NF);
  uint16_t *h = malloc(sizeof(uint16_t) * 65536);
  CHECK(f && h, "allocation");
  if (!f || !h) return;
  tu_rng r = {12345};
  for (int64_t i = 0; i < NF; i++) f[i] = (uint32_t)tu_next(&r);
  int64_t e = 0;
  for (uint32_t x = 0; x < 256 && e < NF; x++) /* each exponent: mantissas at the ends, around a tie, both signs */
    for (uint32_t m = 0; m < 16; m++) {
      const uint32_t mant[16] = {0, 1, 2, 0x7fffff, 0x7ffffe, 0x400000, 0x400001, 0x3fffff, 0x8000, 0x8001, 0x7fff,
                                 0x18000, 0x1000, 0x1001, 0xfff, 0x3000};
      f[e++] = x << 23 | mant[m], f[e++] = 0x80000000u | x << 23 | mant[m];
    }
  for (int i = 1; i <= 64; i++) f[e++] = (uint32_t)i; /* the smallest subnormals */
  for (int i = 0; i < 65536; i++) h[i] = (uint16_t)i;
  attn_ctx *ctx;
  CHECK_OK(NULL, attn_ctx_create(&ctx));
  for (int kern = ATTN_KERNEL_REF; kern <= ATTN_KERNEL_AMX; kern++) {
    if (attn_ctx_set_kernel(ctx, (attn_kernel)kern) != ATTN_OK) continue;
    for (int b = 0; b < 2; b++) {
      const attn_dtype half = b ? ATTN_BF16 : ATTN_F16;
      int64_t first;
      int64_t bad = rows_against_elements(ctx, half, ATTN_F32, f, NF, &first);
      CHECK(!bad, "%s: f32 -> %s by rows differs from by elements at %lld values (first 0x%08x)",
            attn_kernel_name((attn_kernel)kern), attn_dtype_name(half), (long long)bad, first < 0 ? 0 : f[first]);
      bad = rows_against_elements(ctx, ATTN_F32, half, h, 65536, &first);
      CHECK(!bad, "%s: %s -> f32 by rows differs from by elements at %lld patterns (first 0x%04llx)",
            attn_kernel_name((attn_kernel)kern), attn_dtype_name(half), (long long)bad, (long long)first);
    }
  }
  attn_ctx_destroy(ctx);
  free(f), free(h);
}

static void tensor_copy(void) {
  attn_ctx *ctx;
  CHECK_OK(NULL, attn_ctx_create(&ctx));
  static const int vals[4] = {0, 1, 3, 200};
  /* src: a [2, 4] view with a stride of 2 along its rows' elements (every other slot of a [2, 8] buffer);
   * dst: the transpose of a contiguous [4, 2], so both sides walk strided memory */
  for (size_t a = 0; a < sizeof copy_dtypes / sizeof copy_dtypes[0]; a++)
    for (size_t b = 0; b < sizeof copy_dtypes / sizeof copy_dtypes[0]; b++) {
      const attn_dtype from = copy_dtypes[a], to = copy_dtypes[b];
      const size_t fs = attn_dtype_size(from), ts = attn_dtype_size(to);
      unsigned char src[16 * 8], dst[8 * 8], want[8 * 8];
      memset(src, 0x55, sizeof src);
      memset(dst, 0xee, sizeof dst);
      for (int r = 0; r < 2; r++)
        for (int c = 0; c < 4; c++) {
          const int v = vals[(r + c) % 4], got = from == ATTN_BOOL && v ? 1 : v;
          copy_encode(src + (size_t)(r * 8 + 2 * c) * fs, from, v);
          copy_encode(want + (size_t)(c * 2 + r) * ts, to, to == ATTN_BOOL && got ? 1 : got);
        }
      const int64_t s8[2] = {2, 8}, d42[2] = {4, 2};
      attn_tensor s = attn_tensor_view(src, from, 2, s8), d = attn_tensor_view(dst, to, 2, d42);
      s.shape[1] = 4;
      s.strides[1] = 2;
      const int perm[2] = {1, 0};
      CHECK(attn_tensor_permute(&d, &d, perm) == ATTN_OK, "permute");
      CHECK_OK(ctx, attn_tensor_copy(ctx, &d, &s));
      CHECK(!memcmp(dst, want, 8 * ts), "copy %s -> %s", attn_dtype_name(from), attn_dtype_name(to));
    }
  {
    /* same dtype with unit innermost strides goes row by row: rows of 5 in padded rows of 7, the
     * outer dimension broadcast (stride 0) and the middle one reversed; the bits as they are */
    uint32_t src[2 * 7], dst[3 * 2 * 6];
    for (int i = 0; i < 14; i++) src[i] = 0x7fc00000u + (uint32_t)i; /* NaNs with payloads */
    memset(dst, 0xee, sizeof dst);
    const int64_t shape[3] = {3, 2, 5};
    attn_tensor s = attn_tensor_view(src, ATTN_F32, 3, shape), d = attn_tensor_view(dst, ATTN_F32, 3, shape);
    s.strides[0] = 0, s.strides[1] = -7, s.data = src + 7;
    d.strides[1] = 6, d.strides[0] = 12;
    CHECK_OK(ctx, attn_tensor_copy(ctx, &d, &s));
    int ok = 1;
    for (int a = 0; a < 3; a++)
      for (int b = 0; b < 2; b++)
        for (int c = 0; c < 6; c++)
          ok &= dst[a * 12 + b * 6 + c] == (c < 5 ? src[(1 - b) * 7 + c] : 0xeeeeeeeeu);
    CHECK(ok, "same-dtype row copy: broadcast, reversed and padded rows, NaN payloads kept");
  }
  /* ties go to the even neighbour; f64 rounds to a half once (through f32 it would tie at 1 + 2^-11 and go down) */
  CHECK(copy_one_half(ctx, ATTN_F16, ATTN_F32, 1 + ldexp(1, -11)) == 0x3c00, "f16 tie down to even");
  CHECK(copy_one_half(ctx, ATTN_F16, ATTN_F32, 1 + 3 * ldexp(1, -11)) == 0x3c02, "f16 tie up to even");
  CHECK(copy_one_half(ctx, ATTN_F16, ATTN_F32, 3 * ldexp(1, -25)) == 0x0002, "f16 subnormal tie up to even");
  CHECK(copy_one_half(ctx, ATTN_F16, ATTN_F32, ldexp(1, -25)) == 0x0000, "f16 tie to zero");
  CHECK(copy_one_half(ctx, ATTN_F16, ATTN_F32, 65520) == 0x7c00, "f16 overflows to inf");
  CHECK(copy_one_half(ctx, ATTN_F16, ATTN_F32, -65504) == 0xfbff, "f16 largest");
  CHECK(copy_one_half(ctx, ATTN_F16, ATTN_F64, 1 + ldexp(1, -11) + ldexp(1, -40)) == 0x3c01, "f64 to f16 in one rounding");
  CHECK(copy_one_half(ctx, ATTN_F16, ATTN_F64, 1 + ldexp(1, -11)) == 0x3c00, "f64 to f16 tie");
  CHECK(copy_one_half(ctx, ATTN_BF16, ATTN_F32, 1 + ldexp(1, -8)) == 0x3f80, "bf16 tie down to even");
  CHECK(copy_one_half(ctx, ATTN_BF16, ATTN_F32, 1 + 3 * ldexp(1, -8)) == 0x3f82, "bf16 tie up to even");
  CHECK(copy_one_half(ctx, ATTN_BF16, ATTN_F64, 1 + ldexp(1, -8) + ldexp(1, -30)) == 0x3f81, "f64 to bf16 in one rounding");
  CHECK(copy_one_half(ctx, ATTN_BF16, ATTN_F64, -(1 + ldexp(1, -8) - ldexp(1, -30))) == 0xbf80, "f64 to bf16 below a tie");
  {
    /* f64 -> f32 ties; f16/bf16 -> f32 exact; NaN and -0 to bool; u8 rounds to even, in range */
    const double d[3] = {1 + ldexp(1, -24), 1 + 3 * ldexp(1, -24), 0.1};
    float f[3];
    const int64_t n3 = 3;
    attn_tensor s = attn_tensor_view((void *)d, ATTN_F64, 1, &n3), t = attn_tensor_view(f, ATTN_F32, 1, &n3);
    CHECK_OK(ctx, attn_tensor_copy(ctx, &t, &s));
    CHECK(f[0] == 1.0f && f[1] == 1 + ldexp(1, -22) && f[2] == 0.1f, "f64 -> f32 ties to even");
    const uint16_t h[2] = {0x3555, 0x3eab};
    const int64_t n1 = 1;
    attn_tensor hs = attn_tensor_view((void *)&h[0], ATTN_F16, 1, &n1), bs = attn_tensor_view((void *)&h[1], ATTN_BF16, 1, &n1);
    t.shape[0] = 1;
    CHECK_OK(ctx, attn_tensor_copy(ctx, &t, &hs));
    CHECK(f[0] == 0.333251953125f, "f16 0x3555 -> %.9g", (double)f[0]);
    CHECK_OK(ctx, attn_tensor_copy(ctx, &t, &bs));
    CHECK(f[0] == 0.333984375f, "bf16 0x3eab -> %.9g", (double)f[0]);
    const float fb[4] = {0.0f, -0.0f, 0.5f, NAN};
    unsigned char bo[4] = {9, 9, 9, 9};
    const int64_t n4 = 4;
    attn_tensor fs4 = attn_tensor_view((void *)fb, ATTN_F32, 1, &n4), b4 = attn_tensor_view(bo, ATTN_BOOL, 1, &n4);
    CHECK_OK(ctx, attn_tensor_copy(ctx, &b4, &fs4));
    CHECK(bo[0] == 0 && bo[1] == 0 && bo[2] == 1 && bo[3] == 1, "bool: zero false, NaN true");
    const float fu[4] = {2.5f, 3.5f, 254.6f, -0.4f};
    attn_tensor fu4 = attn_tensor_view((void *)fu, ATTN_F32, 1, &n4), u4 = attn_tensor_view(bo, ATTN_U8, 1, &n4);
    CHECK_OK(ctx, attn_tensor_copy(ctx, &u4, &fu4));
    CHECK(bo[0] == 2 && bo[1] == 4 && bo[2] == 255 && bo[3] == 0, "u8 rounds to even: %d %d %d %d", bo[0], bo[1], bo[2], bo[3]);
    const float bad[4] = {1, 2, 255.5f, 4};
    attn_tensor bad4 = attn_tensor_view((void *)bad, ATTN_F32, 1, &n4);
    memset(bo, 7, 4);
    CHECK_ERR(ctx, attn_tensor_copy(ctx, &u4, &bad4), ATTN_E_INVALID, "0..255");
    CHECK(bo[0] == 7 && bo[3] == 7, "a refused u8 copy writes nothing");
  }
  {
    /* refusals: another shape, a broadcasting dst, overlap with src */
    float x[8] = {0}, y[8] = {0};
    const int64_t s24[2] = {2, 4}, s42[2] = {4, 2}, s8 = 8;
    attn_tensor a = attn_tensor_view(x, ATTN_F32, 2, s24), b = attn_tensor_view(y, ATTN_F32, 2, s42);
    CHECK_ERR(ctx, attn_tensor_copy(ctx, &b, &a), ATTN_E_SHAPE, "shape");
    attn_tensor c = attn_tensor_view(y, ATTN_F32, 1, &s8);
    CHECK_ERR(ctx, attn_tensor_copy(ctx, &c, &a), ATTN_E_SHAPE, "shape");
    b = attn_tensor_view(y, ATTN_F32, 2, s24);
    b.strides[0] = 0;
    CHECK_ERR(ctx, attn_tensor_copy(ctx, &b, &a), ATTN_E_INVALID, "stride 0");
    CHECK_ERR(ctx, attn_tensor_copy(ctx, &a, &a), ATTN_E_INVALID, "overlaps");
    attn_tensor lo = attn_tensor_view(x, ATTN_F32, 1, &s8), hi = lo;
    lo.shape[0] = hi.shape[0] = 4;
    hi.data = x + 3;
    CHECK_ERR(ctx, attn_tensor_copy(ctx, &hi, &lo), ATTN_E_INVALID, "overlaps");
    hi.data = x + 4;
    CHECK_OK(ctx, attn_tensor_copy(ctx, &hi, &lo));
    CHECK(attn_tensor_copy(NULL, &hi, &lo) == ATTN_E_INVALID, "a NULL context");
    CHECK_ERR(ctx, attn_tensor_copy(ctx, NULL, &lo), ATTN_E_INVALID, "NULL");
  }
  attn_ctx_destroy(ctx);
}

/* Options and configs carry their size: a caller built against an older
 * attn.h passes a shorter struct, whose missing fields take their defaults
 * (whatever lies past its end is never read); a size of 0 is refused. An
 * "older version" here is today's struct cut short before a field: the bytes
 * past the cut hold values the library would refuse or that would change the
 * result, so reading them would fail the comparison. */
static void sized_structs(void) {
  attn_ctx *ctx;
  CHECK_OK(NULL, attn_ctx_create(&ctx));
  enum { B = 1, H = 2, N = 4, D = 4, E = H * D };
  float q[B * H * N * D], out[B * H * N * D], out_ref[B * H * N * D];
  tu_rng r = {11};
  tu_fill_f32(&r, q, B * H * N * D, 1);
  int64_t s4[4] = {B, H, N, D};
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, s4), to = attn_tensor_view(out, ATTN_F32, 4, s4);
  attn_tensor tr = attn_tensor_view(out_ref, ATTN_F32, 4, s4);

  /* attn_sdpa_opts before window, softcap, ALiBi and sinks existed */
  attn_sdpa_opts full, old;
  attn_sdpa_opts_init(&full);
  full.causal = ATTN_CAUSAL_TOP_LEFT;
  full.scale = 0.5;
  CHECK_OK(ctx, attn_sdpa(ctx, &tr, NULL, NULL, &tq, &tq, &tq, &full));
  CHECK(full.size == sizeof full, "attn_sdpa_opts_init sets size %zu, want %zu", full.size, sizeof full);
  old = full;
  old.size = offsetof(attn_sdpa_opts, window);
  old.window = -1;        /* refused if read */
  old.softcap = NAN;      /* refused if read */
  old.alibi_slopes = &tq; /* the wrong shape: refused if read */
  old.sinks = &tq;
  CHECK_OK(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tq, &tq, &old));
  CHECK(!memcmp(out, out_ref, sizeof out),
        "an older attn_sdpa_opts: the fields past its size must take their defaults");
  old.size = 0;
  CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tq, &tq, &old), ATTN_E_INVALID,
            "opts.size is 0: initialise with attn_sdpa_opts_init");
  const size_t bad_sizes[3] = {4, offsetof(attn_sdpa_opts, window) + 1, sizeof(attn_sdpa_opts) + 8};
  for (int i = 0; i < 3; i++) {
    old.size = bad_sizes[i];
    CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tq, &tq, &old), ATTN_E_INVALID, "opts.size");
  }

  /* attn_mha_config before bias existed: the layer gets the default, biases on */
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, E, H);
  CHECK(cfg.size == sizeof cfg, "attn_mha_config_init sets size");
  cfg.size = offsetof(attn_mha_config, bias);
  cfg.bias = 0;
  attn_mha *m = NULL;
  CHECK_OK(ctx, attn_mha_create(ctx, &m, &cfg));
  attn_tensor pv;
  if (m) {
    CHECK_OK(ctx, attn_mha_param_view(ctx, &pv, m, ATTN_MHA_Q_BIAS));
    CHECK(attn_mha_get_config(m)->size == sizeof cfg && attn_mha_get_config(m)->bias == 1,
          "the layer's config: size %zu, bias %d", attn_mha_get_config(m)->size, attn_mha_get_config(m)->bias);
    for (int p = 0; p < TU_MHA_PROJ_PARAMS; p++)
      if (attn_mha_param_view(ctx, &pv, m, (attn_mha_param)p) == ATTN_OK)
        tu_fill_f32(&r, pv.data, attn_tensor_numel(&pv), 0.5);
  }
  attn_mha *m0 = NULL;
  cfg.size = 0;
  CHECK_ERR(ctx, attn_mha_create(ctx, &m0, &cfg), ATTN_E_INVALID,
            "cfg.size is 0: initialise with attn_mha_config_init");

  /* attn_kv_cache_config before dtype existed: f32 storage */
  attn_kv_cache_config kc;
  attn_kv_cache_config_init(&kc, 1, 8, H, D);
  CHECK(kc.size == sizeof kc, "attn_kv_cache_config_init sets size");
  kc.size = offsetof(attn_kv_cache_config, dtype);
  kc.dtype = (attn_dtype)77;
  attn_kv_cache *cache = NULL;
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &kc));
  if (cache) {
    CHECK(attn_kv_cache_get_config(cache)->dtype == ATTN_F32 && attn_kv_cache_get_config(cache)->size == sizeof kc,
          "an older attn_kv_cache_config: f32 storage");
    old.size = 0;
    CHECK_ERR(ctx, attn_kv_cache_attend(ctx, cache, &to, NULL, &tq, &old), ATTN_E_INVALID,
              "opts.size is 0: initialise with attn_sdpa_opts_init");
  }
  attn_kv_cache_destroy(cache);
  kc.size = 0;
  CHECK_ERR(ctx, attn_kv_cache_create(ctx, &cache, &kc), ATTN_E_INVALID,
            "cfg.size is 0: initialise with attn_kv_cache_config_init");

  /* attn_mha_opts whose attn is an older, shorter attn_sdpa_opts: average_weights
   * follows it at once, where the caller's compiler put it */
  if (m) {
    float x[B * N * E], y[B * N * E], y_ref[B * N * E], w[B * N * N], w_ref[B * N * N];
    tu_fill_f32(&r, x, B * N * E, 1);
    int64_t s3[3] = {B, N, E}, sw[3] = {B, N, N};
    attn_tensor tx = attn_tensor_view(x, ATTN_F32, 3, s3), ty = attn_tensor_view(y, ATTN_F32, 3, s3);
    attn_tensor tyr = attn_tensor_view(y_ref, ATTN_F32, 3, s3);
    attn_tensor tw = attn_tensor_view(w, ATTN_F32, 3, sw), twr = attn_tensor_view(w_ref, ATTN_F32, 3, sw);
    attn_mha_opts mo;
    attn_mha_opts_init(&mo);
    CHECK(mo.size == sizeof mo && mo.attn.size == sizeof mo.attn, "attn_mha_opts_init sets both sizes");
    mo.attn.causal = ATTN_CAUSAL_TOP_LEFT;
    mo.average_weights = 1;
    CHECK_OK(ctx, attn_mha_forward(ctx, m, &tyr, &twr, &tx, NULL, NULL, &mo));
    const size_t at = offsetof(attn_mha_opts, attn), old_attn = offsetof(attn_sdpa_opts, window);
    _Alignas(attn_mha_opts) unsigned char older[sizeof(attn_mha_opts)];
    memset(older, 0, sizeof older); /* past the caller's struct: what a misplaced read would take as a field */
    attn_sdpa_opts a = mo.attn;
    a.size = old_attn;
    const int avg = 1;
    const size_t older_size = (at + old_attn + sizeof avg + 7) / 8 * 8;
    memcpy(older, &older_size, sizeof older_size);
    memcpy(older + at, &a, old_attn);
    memcpy(older + at + old_attn, &avg, sizeof avg);
    CHECK_OK(ctx, attn_mha_forward(ctx, m, &ty, &tw, &tx, NULL, NULL, (const attn_mha_opts *)(void *)older));
    CHECK(!memcmp(y, y_ref, sizeof y) && !memcmp(w, w_ref, sizeof w),
          "attn_mha_opts with an older attn: out and averaged weights must be those of today's struct");
    mo.size = 0;
    CHECK_ERR(ctx, attn_mha_forward(ctx, m, &ty, NULL, &tx, NULL, NULL, &mo), ATTN_E_INVALID,
              "opts.size is 0: initialise with attn_mha_opts_init");
    mo.size = sizeof mo;
    mo.attn.size = 0;
    CHECK_ERR(ctx, attn_mha_forward(ctx, m, &ty, NULL, &tx, NULL, NULL, &mo), ATTN_E_INVALID,
              "opts.attn.size is 0: initialise with attn_mha_opts_init");
  }
  attn_mha_destroy(m);
  attn_ctx_destroy(ctx);
}

int main(void) {
  versions_and_statuses();
  contexts();
  tensors();
  tensor_copy();
  copy_rows_as_elements();
  sdpa_errors();
  mha_errors();
  workspace();
  sized_structs();
  return tu_finish("test_api");
}
