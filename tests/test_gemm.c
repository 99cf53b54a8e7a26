/* attn_linear (out = x . weight^T + bias, fp32) against a float64 reference,
 * on the kernel named by argv[1] (c, avx2, avx512; ctest runs each, a kernel
 * this CPU lacks is a skip) or on every kernel this CPU runs, and 1, 2 and 3
 * threads: sizes of 1, odd sizes, sizes around the tiles and blocks of each
 * kernel, row strides longer than the rows, with and without bias. Also:
 * out's elements past each row are never written, x's and weight's past each
 * row never read (they hold NaN), and the result is bitwise the same for every
 * thread count. Strided views (transposed, reversed, every other element) give
 * bitwise what their contiguous copies give; bad arguments are refused. */
#include "testutil.h"

typedef struct gcase {
  int64_t M, N, K;
  int64_t pa, pb, pc; /* lda - K, ldb - K, ldc - N */
  int bias;
} gcase;

/* Exact-size buffers (so that ASan sees a read past the last row), offset by
 * one float from malloc's alignment. */
typedef struct fbuf {
  float *base, *p;
  int64_t n;
} fbuf;

static fbuf fbuf_new(int64_t n) {
  fbuf b;
  b.n = n;
  b.base = malloc((size_t)(n + 1) * sizeof(float));
  b.p = b.base ? b.base + 1 : NULL;
  return b;
}

/* rows of len floats ld apart: the rows random in [-1, 1], the gaps NaN */
static void fill_rows(tu_rng *r, float *x, int64_t rows, int64_t len, int64_t ld) {
  for (int64_t i = 0; i < rows; i++) {
    tu_fill_f32(r, x + i * ld, len, 1.0);
    if (i + 1 < rows) tu_poison_f32(x + i * ld + len, ld - len);
  }
}

static const char *isa_name(attn_kernel k) { return attn_kernel_name(k); }

/* A rank-2 f32 view of rows x cols at data, rows ld apart, unit stride within a row. */
static attn_tensor rows_view(float *data, int64_t rows, int64_t cols, int64_t ld) {
  const int64_t shape[2] = {rows, cols};
  attn_tensor t = attn_tensor_view(data, ATTN_F32, 2, shape);
  t.strides[0] = ld;
  return t;
}

static void run_case(tu_rng *rng, const gcase *c, const attn_kernel *isas, int nisa) {
  const int64_t M = c->M, N = c->N, K = c->K;
  const int64_t lda = K + c->pa, ldb = K + c->pb, ldc = N + c->pc;
  const int64_t na = (M - 1) * lda + K, nb = (N - 1) * ldb + K, nc = (M - 1) * ldc + N;
  fbuf A = fbuf_new(na > 0 ? na : 1), B = fbuf_new(nb > 0 ? nb : 1), bias = fbuf_new(N);
  fbuf C[3];
  for (int t = 0; t < 3; t++) C[t] = fbuf_new(nc);
  double *ref = malloc((size_t)(M * N) * sizeof(double)), *got = malloc((size_t)(M * N) * sizeof(double));
  int ok = A.base && B.base && bias.base && C[0].base && C[1].base && C[2].base && ref && got;
  CHECK(ok, "allocation for %lldx%lldx%lld", (long long)M, (long long)N, (long long)K);
  if (!ok) goto done;
  fill_rows(rng, A.p, M, K, lda);
  fill_rows(rng, B.p, N, K, ldb);
  tu_fill_f32(rng, bias.p, N, 1.0);
  const float *bp = c->bias ? bias.p : NULL;

  for (int64_t i = 0; i < M; i++) {
    const float *a = A.p + i * lda;
    for (int64_t j = 0; j < N; j++) {
      const float *b = B.p + j * ldb;
      double s = bp ? (double)bp[j] : 0.0;
      for (int64_t k = 0; k < K; k++) s += (double)a[k] * (double)b[k];
      ref[i * N + j] = s;
    }
  }

  for (int ki = 0; ki < nisa; ki++) {
    attn_ctx *ctx;
    attn_ctx_create(&ctx);
    CHECK_OK(ctx, attn_ctx_set_kernel(ctx, isas[ki]));
    for (int t = 0; t < 3; t++) {
      const int threads = t + 1;
      tu_poison_f32(C[t].p, nc);
      attn_ctx_set_threads(ctx, threads);
      attn_tensor x = rows_view(A.p, M, K, lda), w = rows_view(B.p, N, K, ldb), out = rows_view(C[t].p, M, N, ldc);
      const int64_t bs[1] = {N};
      attn_tensor tb = attn_tensor_view(bias.p, ATTN_F32, 1, bs);
      CHECK_OK(ctx, attn_linear(ctx, &out, &x, &w, bp ? &tb : NULL));
      int nan_in = 0, written_out = 0;
      for (int64_t i = 0; i < M; i++) {
        for (int64_t j = 0; j < N; j++) {
          got[i * N + j] = C[t].p[i * ldc + j];
          nan_in += isnan(got[i * N + j]) != 0;
        }
        if (i + 1 < M)
          for (int64_t j = N; j < ldc; j++) written_out += !isnan(C[t].p[i * ldc + j]);
      }
      const double err = tu_rel_l2(got, ref, M * N);
      CHECK(nan_in == 0 && written_out == 0 && err <= 1e-5,
            "%s threads=%d M=%lld N=%lld K=%lld lda=%lld ldb=%lld ldc=%lld bias=%d: rel L2 %.3g, %d NaN, %d written past rows",
            isa_name(isas[ki]), threads, (long long)M, (long long)N, (long long)K, (long long)lda, (long long)ldb,
            (long long)ldc, c->bias, err, nan_in, written_out);
      if (t > 0)
        CHECK(memcmp(C[t].p, C[0].p, (size_t)nc * sizeof(float)) == 0,
              "%s M=%lld N=%lld K=%lld: threads=%d differs bitwise from threads=1", isa_name(isas[ki]), (long long)M,
              (long long)N, (long long)K, threads);
    }
    attn_ctx_destroy(ctx);
  }
done:
  free(A.base);
  free(B.base);
  free(bias.base);
  for (int t = 0; t < 3; t++) free(C[t].base);
  free(ref);
  free(got);
}

/* One strided form of a contiguous operand, for strided_views. */
typedef enum variant { X_TRANSPOSED, X_REVERSED, X_BROADCAST, W_EVERY_OTHER, W_TRANSPOSED, OUT_TRANSPOSED,
                       OUT_EVERY_OTHER, BIAS_STRIDED, NUM_VARIANTS } variant;
static const char *const variant_names[NUM_VARIANTS] = {"x transposed", "x reversed", "x broadcast rows",
                                                        "weight every other", "weight transposed", "out transposed",
                                                        "out every other", "bias stride 3"};

/* Each variant computes what the contiguous views compute, bit for bit: the
 * copies the strided views go through hold the same numbers. Padding between
 * the elements of a view is NaN (read, it would show; written, it would change). */
static void strided_views(attn_kernel isa, int64_t M, int64_t N, int64_t K, uint64_t seed) {
  tu_rng r = {seed};
  float *x = malloc((size_t)(M * K) * sizeof(float)), *w = malloc((size_t)(N * K) * sizeof(float));
  float *bias = malloc((size_t)N * sizeof(float)), *want = malloc((size_t)(M * N) * sizeof(float));
  float *xs = malloc((size_t)(M * K) * sizeof(float)), *ws = malloc((size_t)(2 * N * K) * sizeof(float));
  float *os = malloc((size_t)(2 * M * N) * sizeof(float)), *bs = malloc((size_t)(3 * N) * sizeof(float));
  float *xb = malloc((size_t)(M * K) * sizeof(float)), *want_b = malloc((size_t)(M * N) * sizeof(float));
  tu_fill_f32(&r, x, M * K, 1.0);
  tu_fill_f32(&r, w, N * K, 1.0);
  tu_fill_f32(&r, bias, N, 1.0);
  for (int64_t i = 0; i < M; i++) memcpy(xb + i * K, x, (size_t)K * sizeof(float)); /* row 0 repeated */
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, isa));
  const int64_t sx[2] = {M, K}, sw[2] = {N, K}, so[2] = {M, N}, sb[1] = {N};
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 2, sx), tw = attn_tensor_view(w, ATTN_F32, 2, sw);
  attn_tensor tb = attn_tensor_view(bias, ATTN_F32, 1, sb), to = attn_tensor_view(want, ATTN_F32, 2, so);
  attn_tensor txb = attn_tensor_view(xb, ATTN_F32, 2, sx), tob = attn_tensor_view(want_b, ATTN_F32, 2, so);
  CHECK_OK(ctx, attn_linear(ctx, &to, &tx, &tw, &tb));
  CHECK_OK(ctx, attn_linear(ctx, &tob, &txb, &tw, &tb));
  for (int v = 0; v < NUM_VARIANTS; v++)
    for (int threads = 1; threads <= 3; threads += 2) {
      attn_ctx_set_threads(ctx, threads);
      attn_tensor vx = tx, vw = tw, vo = to, vb = tb;
      const float *expect = v == X_BROADCAST ? want_b : want;
      tu_poison_f32(os, 2 * M * N);
      vo.data = os;
      switch ((variant)v) {
        case X_TRANSPOSED: /* stored [K, M] */
          for (int64_t i = 0; i < M; i++)
            for (int64_t k = 0; k < K; k++) xs[k * M + i] = x[i * K + k];
          vx.data = xs, vx.strides[0] = 1, vx.strides[1] = M;
          break;
        case X_REVERSED: /* rows stored last to first */
          for (int64_t i = 0; i < M; i++) memcpy(xs + (M - 1 - i) * K, x + i * K, (size_t)K * sizeof(float));
          vx.data = xs + (M - 1) * K, vx.strides[0] = -K;
          break;
        case X_BROADCAST: vx.strides[0] = 0; break;
        case W_EVERY_OTHER:
          for (int64_t e = 0; e < N * K; e++) ws[2 * e] = w[e], ws[2 * e + 1] = NAN;
          vw.data = ws, vw.strides[0] = 2 * K, vw.strides[1] = 2;
          break;
        case W_TRANSPOSED: /* stored [K, N] */
          for (int64_t n = 0; n < N; n++)
            for (int64_t k = 0; k < K; k++) ws[k * N + n] = w[n * K + k];
          vw.data = ws, vw.strides[0] = 1, vw.strides[1] = N;
          break;
        case OUT_TRANSPOSED: vo.strides[0] = 1, vo.strides[1] = M; break;
        case OUT_EVERY_OTHER: vo.strides[0] = 2 * N, vo.strides[1] = 2; break;
        case BIAS_STRIDED:
          for (int64_t n = 0; n < N; n++) bs[3 * n] = bias[n], bs[3 * n + 1] = bs[3 * n + 2] = NAN;
          vb.data = bs, vb.strides[0] = 3;
          break;
        case NUM_VARIANTS: break;
      }
      CHECK_OK(ctx, attn_linear(ctx, &vo, &vx, &vw, &vb));
      int64_t differ = 0, stray = 0;
      for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
          const float got = os[i * vo.strides[0] + j * vo.strides[1]];
          differ += memcmp(&got, &expect[i * N + j], sizeof got) != 0;
        }
      if (v == OUT_EVERY_OTHER)
        for (int64_t e = 0; e < M * N; e++) stray += !isnan(os[2 * e + 1]);
      CHECK(differ == 0 && stray == 0, "%s %s M=%lld N=%lld K=%lld threads=%d: %lld elements differ from the contiguous "
            "views', %lld written between elements", isa_name(isa), variant_names[v], (long long)M, (long long)N,
            (long long)K, threads, (long long)differ, (long long)stray);
    }
  attn_ctx_destroy(ctx);
  free(x), free(w), free(bias), free(want), free(xs), free(ws), free(os), free(bs), free(xb), free(want_b);
}

/* A context on the float64 oracle runs the portable fp32 kernel: bitwise the C kernel's result. */
static void ref_context(void) {
  enum { M = 19, N = 29, K = 41 };
  static float x[M * K], w[N * K], a[M * N], b[M * N];
  tu_rng r = {77};
  tu_fill_f32(&r, x, M * K, 1.0);
  tu_fill_f32(&r, w, N * K, 1.0);
  const int64_t sx[2] = {M, K}, sw[2] = {N, K}, so[2] = {M, N};
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 2, sx), tw = attn_tensor_view(w, ATTN_F32, 2, sw);
  attn_tensor ta = attn_tensor_view(a, ATTN_F32, 2, so), tb = attn_tensor_view(b, ATTN_F32, 2, so);
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_C));
  CHECK_OK(ctx, attn_linear(ctx, &ta, &tx, &tw, NULL));
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_REF));
  CHECK_OK(ctx, attn_linear(ctx, &tb, &tx, &tw, NULL));
  CHECK(memcmp(a, b, sizeof a) == 0, "a REF context must run the portable fp32 kernel");
  attn_ctx_destroy(ctx);
}

/* Every refusal names what is wrong and leaves out untouched. */
static void refusals(void) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  float x[12] = {0}, w[12] = {0}, o[12], bias[4] = {0};
  double d[12] = {0};
  const int64_t s23[2] = {2, 3}, s43[2] = {4, 3}, s24[2] = {2, 4}, s4[1] = {4}, s3[1] = {3}, s3d[3] = {2, 3, 1};
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 2, s23), tw = attn_tensor_view(w, ATTN_F32, 2, s43);
  attn_tensor to = attn_tensor_view(o, ATTN_F32, 2, s24), tb = attn_tensor_view(bias, ATTN_F32, 1, s4);
  tu_poison_f32(o, 12);
  CHECK(attn_linear(NULL, &to, &tx, &tw, &tb) == ATTN_E_INVALID, "a NULL context");
  CHECK_ERR(ctx, attn_linear(ctx, NULL, &tx, &tw, &tb), ATTN_E_INVALID, "out is NULL");
  CHECK_ERR(ctx, attn_linear(ctx, &to, NULL, &tw, &tb), ATTN_E_INVALID, "x is NULL");
  CHECK_ERR(ctx, attn_linear(ctx, &to, &tx, NULL, &tb), ATTN_E_INVALID, "weight is NULL");
  attn_tensor bad = attn_tensor_view(x, ATTN_F32, 3, s3d);
  CHECK_ERR(ctx, attn_linear(ctx, &to, &bad, &tw, &tb), ATTN_E_SHAPE, "x must have rank 2");
  CHECK_ERR(ctx, attn_linear(ctx, &to, &tx, &tw, &tx), ATTN_E_SHAPE, "bias must have rank 1");
  bad = attn_tensor_view(d, ATTN_F64, 2, s23);
  CHECK_ERR(ctx, attn_linear(ctx, &to, &bad, &tw, &tb), ATTN_E_DTYPE, "x is f64");
  bad = attn_tensor_view(d, ATTN_F64, 2, s24);
  CHECK_ERR(ctx, attn_linear(ctx, &bad, &tx, &tw, &tb), ATTN_E_DTYPE, "out is f64");
  bad = attn_tensor_view(d, ATTN_BOOL, 1, s4);
  CHECK_ERR(ctx, attn_linear(ctx, &to, &tx, &tw, &bad), ATTN_E_DTYPE, "bias is bool");
  bad = attn_tensor_view(d, ATTN_U8, 2, s23);
  CHECK_ERR(ctx, attn_linear(ctx, &to, &tx, &bad, &tb), ATTN_E_DTYPE, "weight is u8");
  bad = attn_tensor_view(d, ATTN_BF16, 2, s24);
  CHECK_ERR(ctx, attn_linear(ctx, &bad, &tx, &tw, &tb), ATTN_E_DTYPE, "out is bf16");
  bad = attn_tensor_view(w, ATTN_F32, 2, s24); /* [4, 2]: K differs */
  bad.shape[0] = 4, bad.shape[1] = 2;
  CHECK_ERR(ctx, attn_linear(ctx, &to, &tx, &bad, &tb), ATTN_E_SHAPE, "weight must be [N, 3]");
  bad = attn_tensor_view(o, ATTN_F32, 2, s23);
  CHECK_ERR(ctx, attn_linear(ctx, &bad, &tx, &tw, &tb), ATTN_E_SHAPE, "out must be [2, 4]");
  bad = attn_tensor_view(bias, ATTN_F32, 1, s3);
  CHECK_ERR(ctx, attn_linear(ctx, &to, &tx, &tw, &bad), ATTN_E_SHAPE, "bias must be [4]");
  bad = to;
  bad.strides[0] = 0; /* two rows on one */
  CHECK_ERR(ctx, attn_linear(ctx, &bad, &tx, &tw, &tb), ATTN_E_INVALID, "stride 0");
  bad = tx;
  bad.data = NULL;
  CHECK_ERR(ctx, attn_linear(ctx, &to, &bad, &tw, &tb), ATTN_E_INVALID, "NULL data");
  int untouched = 1;
  for (int e = 0; e < 12; e++) untouched &= isnan(o[e]) != 0;
  CHECK(untouched, "a refused call wrote out");
  /* broadcast views claiming 2^62 elements: their copies are refused before any allocation */
  const int64_t huge = (int64_t)1 << 31;
  attn_tensor hx = tx, hw = tw, ho = to;
  hx.shape[0] = huge, hx.shape[1] = huge, hx.strides[0] = 0, hx.strides[1] = 0;
  hw.shape[1] = huge, hw.strides[1] = 0;
  ho.shape[0] = huge, ho.shape[1] = 4, ho.strides[0] = 4, ho.strides[1] = 1;
  ho.data = o;
  CHECK_ERR(ctx, attn_linear(ctx, &ho, &hx, &hw, NULL), ATTN_E_NOMEM, "too large");
  CHECK(attn_ctx_workspace_bytes(ctx) == 0, "the refused copy allocated %zu bytes", attn_ctx_workspace_bytes(ctx));
  /* empty problems succeed and write nothing */
  attn_tensor ex = tx, eo = to;
  ex.shape[0] = eo.shape[0] = 0;
  CHECK_OK(ctx, attn_linear(ctx, &eo, &ex, &tw, &tb));
  attn_ctx_destroy(ctx);
}

int main(int argc, char **argv) {
  attn_kernel isas[3];
  int nisa = 0;
  if (argc > 1) {
    isas[nisa++] = tu_kernel_or_skip(argv[1]);
    if (isas[0] == ATTN_KERNEL_AUTO || isas[0] == ATTN_KERNEL_REF) {
      fprintf(stderr, "test_gemm: name an fp32 kernel (c, avx2, avx512)\n");
      return 2;
    }
  } else {
    isas[nisa++] = ATTN_KERNEL_C;
    if (attn_kernel_supported(ATTN_KERNEL_AVX2)) isas[nisa++] = ATTN_KERNEL_AVX2;
    if (attn_kernel_supported(ATTN_KERNEL_AVX512)) isas[nisa++] = ATTN_KERNEL_AVX512;
  }
  printf("test_gemm: isas");
  for (int i = 0; i < nisa; i++) printf(" %s", isa_name(isas[i]));
  for (int k = ATTN_KERNEL_AVX2; argc <= 1 && k <= ATTN_KERNEL_AVX512; k++)
    if (!attn_kernel_supported((attn_kernel)k)) printf(" (%s: not supported here: skipped)", isa_name((attn_kernel)k));
  printf("\n");

  refusals();
  ref_context();
  static const int64_t shapes[][3] = {{1, 1, 1}, {7, 17, 9}, {37, 97, 65}, {130, 70, 300}, {5, 3, 0}};
  for (int ki = 0; ki < nisa; ki++)
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
      strided_views(isas[ki], shapes[i][0], shapes[i][1], shapes[i][2], 500 + i);

  tu_rng rng = {20240611};
  /* fixed cases: degenerate sizes, the tiles (C 2x24 / 4x16, AVX2 6x16, AVX-512
   * 12x32) and blocks (kc 256, mc 128..192, nc 512) +-1, threads splitting M or N */
  static const gcase fixed[] = {
      {1, 1, 1, 0, 0, 0, 0},       {1, 1, 1, 3, 2, 1, 1},      {1, 1, 7, 0, 0, 0, 1},      {1, 37, 1, 0, 1, 2, 0},
      {5, 1, 3, 1, 0, 0, 1},       {3, 5, 0, 0, 0, 2, 1},      {3, 5, 0, 0, 0, 0, 0},      {2, 24, 16, 0, 0, 0, 1},
      {4, 16, 17, 0, 0, 0, 0},     {6, 16, 8, 0, 0, 0, 1},     {7, 17, 9, 1, 1, 1, 1},     {5, 15, 31, 0, 0, 0, 0},
      {12, 32, 64, 0, 0, 0, 1},    {11, 31, 63, 0, 0, 0, 0},   {13, 33, 65, 0, 0, 0, 1},   {24, 64, 255, 0, 0, 0, 1},
      {25, 65, 256, 5, 3, 7, 0},   {23, 63, 257, 1, 2, 3, 1},  {36, 96, 511, 0, 0, 0, 1},  {37, 97, 513, 2, 0, 1, 0},
      {191, 511, 255, 0, 0, 0, 1}, {192, 512, 256, 0, 0, 0, 0}, {193, 513, 257, 3, 1, 2, 1}, {129, 47, 300, 0, 0, 0, 1},
      {13, 2000, 300, 0, 0, 0, 1}, {2000, 13, 300, 1, 1, 1, 0}, {97, 1000, 64, 0, 0, 0, 1}, {300, 47, 600, 4, 4, 4, 1},
      {385, 100, 1030, 0, 0, 0, 1}, {1, 700, 600, 0, 0, 0, 1},  {700, 1, 600, 0, 0, 0, 0},  {48, 1025, 100, 0, 0, 3, 1},
  };
  for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) run_case(&rng, &fixed[i], isas, nisa);

  /* random sizes, mostly small, some large enough for the threads to split */
  for (int i = 0; i < 40; i++) {
    gcase c;
    const int big = i % 4 == 0;
    c.M = tu_int(&rng, 1, big ? 400 : 60);
    c.N = tu_int(&rng, 1, big ? 600 : 80);
    c.K = tu_int(&rng, 1, big ? 700 : 300);
    c.pa = tu_int(&rng, 0, 1) ? tu_int(&rng, 1, 9) : 0;
    c.pb = tu_int(&rng, 0, 1) ? tu_int(&rng, 1, 9) : 0;
    c.pc = tu_int(&rng, 0, 1) ? tu_int(&rng, 1, 9) : 0;
    c.bias = (int)tu_int(&rng, 0, 1);
    run_case(&rng, &c, isas, nisa);
  }

  /* the projections of an E = 512 layer over 2048 tokens */
  static const gcase proj[] = {{2048, 512, 512, 0, 0, 0, 1}, {200, 320, 1100, 16, 16, 16, 0}};
  for (size_t i = 0; i < sizeof proj / sizeof proj[0]; i++) run_case(&rng, &proj[i], isas, nisa);

  return tu_finish("test_gemm");
}
