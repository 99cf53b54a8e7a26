/* The bf16 GEMM (bf16 products summed in fp32) behind attn_linear and the
 * layer's projections under ATTN_PRECISION_BF16.
 *
 *   test_gemm_bf16 gemm [avx512bf16|amx]
 *                         that kernel's bf16 GEMM through attn_linear (skipped
 *                         where the CPU lacks it): against a float64 product
 *                         of the bf16-rounded operands, bound GEMM_BOUND (the
 *                         products are exact, so only the fp32 sums round);
 *                         sizes of 1, odd, primes, around the tiles (12 x 32,
 *                         32 x 32) and the blocks (kc 512, mc 192 or 128, nc 512), rows
 *                         longer than the operands' (gaps NaN: never read),
 *                         out prefilled with NaN (every element written,
 *                         nothing past a row), with and without bias, f32 and
 *                         bf16 operands, 1 and 3 threads bitwise the same;
 *                         strided views bitwise their contiguous copies'.
 *   test_gemm_bf16 rules  on every kernel here: which products attn_linear
 *                         runs for each dtype of x and weight (f32, f16,
 *                         bf16) under each precision: bitwise the fp32 GEMM's,
 *                         the bf16 GEMM's or (F16) the f16-rounding one's
 *                         result, and within the bound of the matching float64
 *                         reference; bias of any float dtype; F16's rounding
 *                         of f32 operands at f16's edges (overflow, ties,
 *                         subnormals, NaN).
 *   test_gemm_bf16 layer [avx512bf16|amx]
 *                         the layer under BF16, then F16 (skipped without that
 *                         kernel): bitwise what attn_linear + attn_sdpa +
 *                         attn_linear give under that policy (so the
 *                         projections took bf16 or f16 products), within
 *                         LAYER_BOUND (LAYER_BOUND_F16) of the float64 layer
 *                         on rounded inputs and weights (self and cross
 *                         attention, forward_save, the cached step), and
 *                         under DEFAULT and FP32 bitwise the fp32 composition. */
#include "testutil.h"

/* rel L2 of the bf16 GEMM against float64 on the same bf16 operands: the
 * products are exact in fp32, so this is the fp32 summation's error
 * (~sqrt(K) 2^-24 for K <= ~1100 random terms, with a wide margin). */
#define GEMM_BOUND 1e-5
/* rel L2 of the layer under BF16 against the float64 layer on bf16-rounded x
 * and weights. What remains rounds to bf16 inside the layer: the projections
 * q, k, v and the attention output (each 2^-9 relative) before the products
 * that read them, and the probabilities for p.v (the bf16 tiles' own bound,
 * test_half's 1e-2). Measured: 0.9e-3 to 1.5e-3 on these cases. */
#define LAYER_BOUND 1e-2
/* and under F16 (f16 rounds 2^-11 relative), on f16-rounded x and weights: measured 1.1e-4 to 1.7e-4 */
#define LAYER_BOUND_F16 1e-3

/* The kernel whose bf16 GEMM gemm and layer test (argv[2]: avx512bf16, amx). */
static attn_kernel bf16_kernel = ATTN_KERNEL_AVX512_BF16;

/* ---- operands --------------------------------------------------------------------- */
/* rows x cols of dtype dt, rows ld apart, in an exact-size buffer (ASan sees
 * a read past the last row); the gaps between rows hold NaN. */
typedef struct mat {
  void *data;
  attn_dtype dt;
  int64_t rows, cols, ld;
} mat;

static mat mat_new(tu_rng *r, attn_dtype dt, int64_t rows, int64_t cols, int64_t ld) {
  mat m = {NULL, dt, rows, cols, ld};
  const int64_t n = rows > 0 && cols > 0 ? (rows - 1) * ld + cols : 1;
  m.data = malloc((size_t)n * attn_dtype_size(dt));
  if (!m.data) exit(2);
  for (int64_t e = 0; e < n; e++) tu_store_float(m.data, dt, e, NAN);
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < cols; j++) tu_store_float(m.data, dt, i * ld + j, tu_uniform(r));
  return m;
}

/* element (i, j) as stored */
static double mat_at(const mat *m, int64_t i, int64_t j) {
  const int64_t e = i * m->ld + j;
  switch (m->dt) {
    case ATTN_F32: return ((const float *)m->data)[e];
    case ATTN_F16: return tu_f16_to_f32(((const uint16_t *)m->data)[e]);
    case ATTN_BF16: return tu_bf16_to_f32(((const uint16_t *)m->data)[e]);
    default: return NAN;
  }
}

static attn_tensor mat_view(const mat *m) {
  const int64_t s[2] = {m->rows, m->cols};
  attn_tensor t = attn_tensor_view(m->data, m->dt, 2, s);
  t.strides[0] = m->ld;
  return t;
}

/* The same values as a contiguous f32 matrix (halves widened exactly). */
static mat mat_widened(const mat *m) {
  mat w = {malloc((size_t)(m->rows * m->cols + 1) * sizeof(float)), ATTN_F32, m->rows, m->cols, m->cols};
  if (!w.data) exit(2);
  for (int64_t i = 0; i < m->rows; i++)
    for (int64_t j = 0; j < m->cols; j++) ((float *)w.data)[i * m->cols + j] = (float)mat_at(m, i, j);
  return w;
}

static double round_bf16(double x) { return tu_bf16_to_f32(tu_f32_to_bf16((float)x)); }
static double round_f16(double x) { return tu_f16_to_f32(tu_f32_to_f16((float)x)); }

/* ref [M, N] = x . w^T + bias in float64, on the operands rounded to bf16 when `rounded` (to f16 when
 * it is 2) */
static void reference(double *ref, const mat *x, const mat *w, const float *bias, int rounded) {
  for (int64_t i = 0; i < x->rows; i++)
    for (int64_t j = 0; j < w->rows; j++) {
      double s = bias ? bias[j] : 0.0;
      for (int64_t k = 0; k < x->cols; k++) {
        const double a = mat_at(x, i, k), b = mat_at(w, j, k);
        s += rounded == 2 ? round_f16(a) * round_f16(b) : rounded ? round_bf16(a) * round_bf16(b) : a * b;
      }
      ref[i * w->rows + j] = s;
    }
}

static attn_ctx *context(attn_kernel k, attn_precision p) {
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx)) exit(2);
  if (attn_ctx_set_kernel(ctx, k) || attn_ctx_set_precision(ctx, p)) exit(2);
  return ctx;
}

/* ---- gemm: the bf16 GEMM's accuracy and properties ---------------------------------- */
typedef struct gcase {
  int64_t M, N, K;
  int64_t pa, pb, pc; /* lda - K, ldb - K, ldc - N */
  int bias;
  attn_dtype xt, wt;
} gcase;

static void gemm_case(tu_rng *rng, const gcase *c) {
  const int64_t M = c->M, N = c->N, K = c->K, ldc = N + c->pc, nc = (M - 1) * ldc + N;
  mat x = mat_new(rng, c->xt, M, K, K + c->pa), w = mat_new(rng, c->wt, N, K, K + c->pb);
  float *bias = malloc((size_t)N * sizeof(float)), *C[2];
  double *ref = malloc((size_t)(M * N) * sizeof(double)), *got = malloc((size_t)(M * N) * sizeof(double));
  C[0] = malloc((size_t)nc * sizeof(float));
  C[1] = malloc((size_t)nc * sizeof(float));
  if (!bias || !ref || !got || !C[0] || !C[1]) exit(2);
  tu_fill_f32(rng, bias, N, 1.0);
  const float *bp = c->bias ? bias : NULL;
  reference(ref, &x, &w, bp, 1);
  /* both bf16: DEFAULT runs the bf16 GEMM; otherwise BF16 asks for it */
  const attn_precision prec = c->xt == ATTN_BF16 && c->wt == ATTN_BF16 ? ATTN_PRECISION_DEFAULT : ATTN_PRECISION_BF16;
  attn_ctx *ctx = context(bf16_kernel, prec);
  const int64_t bs[1] = {N}, os[2] = {M, N};
  const attn_tensor tx = mat_view(&x), tw = mat_view(&w), tb = attn_tensor_view(bias, ATTN_F32, 1, bs);
  char what[200];
  snprintf(what, sizeof what, "M=%lld N=%lld K=%lld lda=%lld ldb=%lld ldc=%lld bias=%d x %s weight %s", (long long)M,
           (long long)N, (long long)K, (long long)x.ld, (long long)w.ld, (long long)ldc, c->bias,
           attn_dtype_name(c->xt), attn_dtype_name(c->wt));
  for (int t = 0; t < 2; t++) {
    const int threads = t ? 3 : 1;
    attn_ctx_set_threads(ctx, threads);
    tu_poison_f32(C[t], nc);
    attn_tensor out = attn_tensor_view(C[t], ATTN_F32, 2, os);
    out.strides[0] = ldc;
    CHECK_OK(ctx, attn_linear(ctx, &out, &tx, &tw, bp ? &tb : NULL));
    int nan_in = 0, written_out = 0;
    for (int64_t i = 0; i < M; i++) {
      for (int64_t j = 0; j < N; j++) nan_in += isnan(got[i * N + j] = C[t][i * ldc + j]) != 0;
      if (i + 1 < M)
        for (int64_t j = N; j < ldc; j++) written_out += !isnan(C[t][i * ldc + j]);
    }
    const double err = tu_rel_l2(got, ref, M * N);
    CHECK(nan_in == 0 && written_out == 0 && err <= GEMM_BOUND,
          "%s threads=%d: rel L2 %.3g (bound %g), %d NaN, %d written past rows", what, threads, err, GEMM_BOUND, nan_in,
          written_out);
  }
  CHECK(memcmp(C[0], C[1], (size_t)nc * sizeof(float)) == 0, "%s: 3 threads differ bitwise from 1", what);
  attn_ctx_destroy(ctx);
  free(x.data), free(w.data), free(bias), free(ref), free(got), free(C[0]), free(C[1]);
}

/* Transposed, every-other-element and reversed views (gathered into copies
 * first) give bitwise what contiguous views of the same values give. */
static void gemm_strided(tu_rng *rng, int64_t M, int64_t N, int64_t K, attn_dtype dt) {
  const size_t es = attn_dtype_size(dt);
  mat x = mat_new(rng, dt, M, K, K), w = mat_new(rng, dt, N, K, K);
  float *bias = malloc((size_t)N * sizeof(float)), *want = malloc((size_t)(M * N) * sizeof(float));
  float *os = malloc((size_t)(2 * M * N) * sizeof(float)), *bs = malloc((size_t)(3 * N) * sizeof(float));
  char *xs = malloc((size_t)(M * K) * es), *ws = malloc((size_t)(2 * N * K) * es);
  if (!bias || !want || !os || !bs || !xs || !ws) exit(2);
  tu_fill_f32(rng, bias, N, 1.0);
  attn_ctx *ctx = context(bf16_kernel, dt == ATTN_BF16 ? ATTN_PRECISION_DEFAULT : ATTN_PRECISION_BF16);
  const int64_t sb[1] = {N}, so[2] = {M, N};
  const attn_tensor tx = mat_view(&x), tw = mat_view(&w), tb = attn_tensor_view(bias, ATTN_F32, 1, sb);
  attn_tensor to = attn_tensor_view(want, ATTN_F32, 2, so);
  CHECK_OK(ctx, attn_linear(ctx, &to, &tx, &tw, &tb));
  for (int v = 0; v < 4; v++) {
    attn_tensor vx = tx, vw = tw, vo = to, vb = tb;
    tu_poison_f32(os, 2 * M * N);
    vo.data = os;
    if (v == 0) { /* x stored [K, M] */
      for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k++)
          memcpy(xs + (size_t)(k * M + i) * es, (char *)x.data + (size_t)(i * K + k) * es, es);
      vx.data = xs, vx.strides[0] = 1, vx.strides[1] = M;
    } else if (v == 1) { /* weight's elements every other one, the gaps NaN */
      for (int64_t e = 0; e < N * K; e++) {
        memcpy(ws + (size_t)(2 * e) * es, (char *)w.data + (size_t)e * es, es);
        tu_store_float(ws, dt, 2 * e + 1, NAN);
      }
      vw.data = ws, vw.strides[0] = 2 * K, vw.strides[1] = 2;
    } else if (v == 2) { /* x's rows last to first, out transposed */
      for (int64_t i = 0; i < M; i++)
        memcpy(xs + (size_t)((M - 1 - i) * K) * es, (char *)x.data + (size_t)(i * K) * es, (size_t)K * es);
      vx.data = xs + (size_t)((M - 1) * K) * es, vx.strides[0] = -K;
      vo.strides[0] = 1, vo.strides[1] = M;
    } else { /* bias every third element, out every other */
      for (int64_t n = 0; n < N; n++) bs[3 * n] = bias[n], bs[3 * n + 1] = bs[3 * n + 2] = NAN;
      vb.data = bs, vb.strides[0] = 3;
      vo.strides[0] = 2 * N, vo.strides[1] = 2;
    }
    attn_ctx_set_threads(ctx, v % 2 ? 3 : 1);
    CHECK_OK(ctx, attn_linear(ctx, &vo, &vx, &vw, &vb));
    int64_t differ = 0;
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++)
        differ += memcmp(&os[i * vo.strides[0] + j * vo.strides[1]], &want[i * N + j], sizeof(float)) != 0;
    CHECK(differ == 0, "%s view %d M=%lld N=%lld K=%lld: %lld elements differ from the contiguous views'",
          attn_dtype_name(dt), v, (long long)M, (long long)N, (long long)K, (long long)differ);
  }
  attn_ctx_destroy(ctx);
  free(x.data), free(w.data), free(bias), free(want), free(os), free(bs), free(xs), free(ws);
}

static void gemm_tests(void) {
  tu_rng rng = {20261203};
  const attn_dtype F = ATTN_F32, H = ATTN_BF16;
  /* edges of the 12 x 32 tile and of the blocks (kc 512 steps, mc 192, nc 512), K odd and prime */
  static const int64_t fixed[][3] = {
      {1, 1, 1},     {1, 1, 2},      {1, 37, 3},     {5, 1, 7},       {3, 5, 0},       {7, 17, 31},
      {12, 32, 64},  {11, 31, 63},   {13, 33, 65},   {24, 64, 2},     {37, 97, 1024},  {29, 61, 1023},
      {191, 511, 511}, {192, 512, 512}, {193, 513, 513}, {97, 130, 1025}, {2000, 13, 301}, {13, 2000, 300},
      {1, 700, 601}, {700, 1, 600},  {61, 67, 509},  {200, 100, 1031},
      /* and of AMX's 32 x 32 tile, its 16-pair steps and mc 128 */
      {32, 32, 32},  {31, 33, 33},   {33, 31, 34},   {127, 65, 97},   {128, 96, 510},  {129, 95, 1057}};
  for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
    const gcase c = {fixed[i][0], fixed[i][1], fixed[i][2], (int64_t)(i % 3), (int64_t)(i % 2) * 5, (int64_t)(i % 4),
                     (int)(i % 2), i % 4 == 1 ? H : F, i % 4 == 1 || i % 4 == 2 ? H : F};
    gemm_case(&rng, &c);
  }
  for (int i = 0; i < 40; i++) {
    const int big = i % 5 == 0;
    gcase c;
    c.M = tu_int(&rng, 1, big ? 400 : 70);
    c.N = tu_int(&rng, 1, big ? 600 : 90);
    c.K = tu_int(&rng, 1, big ? 1100 : 300);
    c.pa = tu_int(&rng, 0, 1) ? tu_int(&rng, 1, 9) : 0;
    c.pb = tu_int(&rng, 0, 1) ? tu_int(&rng, 1, 9) : 0;
    c.pc = tu_int(&rng, 0, 1) ? tu_int(&rng, 1, 9) : 0;
    c.bias = (int)tu_int(&rng, 0, 1);
    c.xt = tu_int(&rng, 0, 1) ? H : F;
    c.wt = tu_int(&rng, 0, 1) ? H : F;
    gemm_case(&rng, &c);
  }
  static const int64_t views[][3] = {{1, 1, 1}, {7, 17, 9}, {37, 97, 65}, {130, 70, 601}};
  for (size_t i = 0; i < sizeof views / sizeof views[0]; i++) {
    gemm_strided(&rng, views[i][0], views[i][1], views[i][2], F);
    gemm_strided(&rng, views[i][0], views[i][1], views[i][2], H);
  }
}

/* ---- rules: which products attn_linear runs ----------------------------------------- */
/* out for x, w and bias (any float dtype) on ctx, into got [M, N]. */
static void linear_into(attn_ctx *ctx, float *got, const mat *x, const mat *w, const attn_tensor *bias) {
  const int64_t so[2] = {x->rows, w->rows};
  attn_tensor out = attn_tensor_view(got, ATTN_F32, 2, so), tx = mat_view(x), tw = mat_view(w);
  tu_poison_f32(got, x->rows * w->rows);
  CHECK_OK(ctx, attn_linear(ctx, &out, &tx, &tw, bias));
}

/* F16's rounding of f32 operands at its edges, through attn_linear: x [n, n] holding one value a row on
 * its diagonal, weight the identity, so out's diagonal is each value as F16 rounds it: to nearest even
 * (ties too), Inf past 65504, multiples of 2^-24 below f16's normal range, NaN kept. Against the
 * library's own f32 -> f16 conversion (attn_tensor_copy) and the test's. */
static void f16_rounding_edges(void) {
  static const float v[] = {65504.0f, 65519.99f, 65520.0f, -65520.0f, 1e30f, INFINITY, -INFINITY, NAN,
                            0x1p-14f, 0x1.ffcp-15f, 0x1.ffep-15f, 0x1p-24f, 0x1p-25f, 0x1.8p-25f, 0x3p-26f,
                            1e-8f, 1.0f / 3, 2049.0f, 2051.0f, -2053.0f, 1.00048828125f, 0x1.0018p0f};
  enum { n = sizeof v / sizeof v[0] };
  static float x[n * n], w[n * n], out[n * n];
  static uint16_t xh[n * n];
  for (int i = 0; i < n * n; i++) x[i] = 0, w[i] = 0;
  for (int i = 0; i < n; i++) x[i * n + i] = v[i], w[i * n + i] = 1;
  const int64_t s[2] = {n, n};
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 2, s), tw = attn_tensor_view(w, ATTN_F32, 2, s);
  attn_tensor to = attn_tensor_view(out, ATTN_F32, 2, s), th = attn_tensor_view(xh, ATTN_F16, 2, s);
  attn_ctx *ctx = context(ATTN_KERNEL_C, ATTN_PRECISION_F16);
  CHECK_OK(ctx, attn_tensor_copy(ctx, &th, &tx));
  for (int k = ATTN_KERNEL_C; k <= ATTN_KERNEL_AMX; k++) {
    if (!attn_kernel_supported((attn_kernel)k)) continue;
    CHECK_OK(ctx, attn_ctx_set_kernel(ctx, (attn_kernel)k));
    tu_poison_f32(out, n * n);
    CHECK_OK(ctx, attn_linear(ctx, &to, &tx, &tw, NULL));
    for (int i = 0; i < n; i++) {
      const float want = tu_f16_to_f32(tu_f32_to_f16(v[i])), lib = tu_f16_to_f32(xh[i * n + i]), got = out[i * n + i];
      const int same = (isnan(want) && isnan(got)) || memcmp(&want, &got, 4) == 0;
      const int lib_same = (isnan(lib) && isnan(got)) || memcmp(&lib, &got, 4) == 0;
      CHECK(same && lib_same, "%s: F16 rounds %a to %a; f16 holds %a (attn_tensor_copy: %a)",
            attn_kernel_name((attn_kernel)k), (double)v[i], (double)got, (double)want, (double)lib);
    }
  }
  attn_ctx_destroy(ctx);
}

static void rules(void) {
  enum { M = 23, N = 45, K = 300 };
  static const attn_dtype dts[3] = {ATTN_F32, ATTN_F16, ATTN_BF16};
  static const attn_dtype bias_dts[4] = {ATTN_F32, ATTN_F64, ATTN_F16, ATTN_BF16};
  const int have_bf16 = attn_kernel_supported(ATTN_KERNEL_AVX512_BF16);
  if (!have_bf16) printf("test_gemm_bf16 rules: no AVX512-BF16 here: only the fp32 rules checked\n");
  static float got[M * N], want_fp32[M * N], want_bf16[M * N], want_f16[M * N], bias32[N];
  static double ref_exact[M * N], ref_rounded[M * N], ref_f16[M * N], gotd[M * N], bias_store[N];
  tu_rng rng = {4242};
  int n_bias = 0;
  for (int xi = 0; xi < 3; xi++)
    for (int wi = 0; wi < 3; wi++) {
      const mat x = mat_new(&rng, dts[xi], M, K, K), w = mat_new(&rng, dts[wi], N, K, K);
      const mat xf = mat_widened(&x), wf = mat_widened(&w);
      /* the same values rounded to f16 and stored so: what F16 must compute on f32 and f16 operands */
      mat xh = {malloc((size_t)(M * K) * 2), ATTN_F16, M, K, K}, wh = {malloc((size_t)(N * K) * 2), ATTN_F16, N, K, K};
      if (!xh.data || !wh.data) exit(2);
      for (int64_t e = 0; e < M * K; e++) ((uint16_t *)xh.data)[e] = tu_f32_to_f16(((const float *)xf.data)[e]);
      for (int64_t e = 0; e < N * K; e++) ((uint16_t *)wh.data)[e] = tu_f32_to_f16(((const float *)wf.data)[e]);
      /* a bias of each float dtype in turn: its values as f32 (f64 ones rounded) are what is added */
      const attn_dtype bt = bias_dts[n_bias++ % 4];
      for (int64_t j = 0; j < N; j++) {
        if (bt == ATTN_F64) bias_store[j] = tu_uniform(&rng);
        else tu_store_float(bias_store, bt, j, tu_uniform(&rng));
        bias32[j] = (float)(bt == ATTN_F64 ? bias_store[j]
                                           : bt == ATTN_F32 ? ((float *)bias_store)[j]
                                           : bt == ATTN_F16 ? tu_f16_to_f32(((uint16_t *)bias_store)[j])
                                                            : tu_bf16_to_f32(((uint16_t *)bias_store)[j]));
      }
      const int64_t sb[1] = {N};
      const attn_tensor tb = attn_tensor_view(bias_store, bt, 1, sb), tb32 = attn_tensor_view(bias32, ATTN_F32, 1, sb);
      reference(ref_exact, &x, &w, bias32, 0);
      reference(ref_rounded, &x, &w, bias32, 1);
      reference(ref_f16, &x, &w, bias32, 2);
      for (int k = ATTN_KERNEL_C; k <= ATTN_KERNEL_AMX; k++) {
        if (!attn_kernel_supported((attn_kernel)k)) continue;
        /* the two candidates: the fp32 GEMM on the widened values, the bf16 one on them rounded */
        attn_ctx *c32 = context((attn_kernel)k, ATTN_PRECISION_FP32);
        linear_into(c32, want_fp32, &xf, &wf, &tb32);
        attn_ctx_destroy(c32);
        if (k >= ATTN_KERNEL_AVX512_BF16) { /* this kernel's own bf16 GEMM (each sums in its own order) */
          attn_ctx *c16 = context((attn_kernel)k, ATTN_PRECISION_BF16);
          linear_into(c16, want_bf16, &xf, &wf, &tb32);
          attn_ctx_destroy(c16);
        }
        /* and f16 products: the operands stored as f16 (widened exactly), under F16 */
        attn_ctx *ch = context((attn_kernel)k, ATTN_PRECISION_F16);
        linear_into(ch, want_f16, &xh, &wh, &tb32);
        attn_ctx_destroy(ch);
        for (int p = ATTN_PRECISION_DEFAULT; p <= ATTN_PRECISION_F16; p++) {
          const int f16 = dts[xi] == ATTN_F16 || dts[wi] == ATTN_F16;
          const int both_bf16 = dts[xi] == ATTN_BF16 && dts[wi] == ATTN_BF16;
          const int expect_bf16 = k >= ATTN_KERNEL_AVX512_BF16 && p != ATTN_PRECISION_FP32 && !f16 &&
                                  (p == ATTN_PRECISION_BF16 || both_bf16);
          /* F16 rounds f32 and f16 operands (the latter to themselves), never bf16 ones */
          const int expect_f16 = p == ATTN_PRECISION_F16 && dts[xi] != ATTN_BF16 && dts[wi] != ATTN_BF16;
          attn_ctx *ctx = context((attn_kernel)k, (attn_precision)p);
          attn_ctx_set_threads(ctx, 1 + (xi + wi) % 3);
          linear_into(ctx, got, &x, &w, &tb);
          attn_ctx_destroy(ctx);
          const float *want = expect_bf16 ? want_bf16 : expect_f16 ? want_f16 : want_fp32;
          for (int64_t e = 0; e < M * N; e++) gotd[e] = got[e];
          const double err = tu_rel_l2(gotd, expect_bf16 ? ref_rounded : expect_f16 ? ref_f16 : ref_exact, M * N);
          const double other = tu_rel_l2(gotd, expect_bf16 || expect_f16 ? ref_exact : ref_rounded, M * N);
          char what[160];
          snprintf(what, sizeof what, "kernel %s precision %s x %s weight %s bias %s (%s products expected)",
                   attn_kernel_name((attn_kernel)k), attn_precision_name((attn_precision)p), attn_dtype_name(dts[xi]),
                   attn_dtype_name(dts[wi]), attn_dtype_name(bt), expect_bf16 ? "bf16" : expect_f16 ? "f16" : "fp32");
          CHECK(memcmp(got, want, sizeof got) == 0, "%s: not bitwise the expected GEMM's result", what);
          CHECK(err <= GEMM_BOUND, "%s: rel L2 %.3g against its float64 reference", what, err);
          /* bf16 operands are their own rounding, f16 ones too for f16 products: then the references agree */
          if (!both_bf16 && !(expect_f16 && dts[xi] == ATTN_F16 && dts[wi] == ATTN_F16))
            CHECK(other > (expect_f16 ? 10 : 100) * GEMM_BOUND, /* f16 rounds 8x finer than bf16 */
                  "%s: rel L2 %.3g against the other reference: the paths look alike", what, other);
        }
      }
      if (have_bf16)
        CHECK(memcmp(want_fp32, want_bf16, sizeof want_fp32) != 0, "the fp32 and bf16 GEMMs must differ somewhere");
      free(x.data), free(w.data), free(xf.data), free(wf.data), free(xh.data), free(wh.data);
    }
}

/* ---- layer: the multi-head layer under BF16 (and F16) ---------------------------------- */
static attn_precision layer_prec = ATTN_PRECISION_BF16; /* the half policy the layer cases run under */
static double round_layer(double x) { return layer_prec == ATTN_PRECISION_F16 ? round_f16(x) : round_bf16(x); }
static double layer_bound(void) { return layer_prec == ATTN_PRECISION_F16 ? LAYER_BOUND_F16 : LAYER_BOUND; }

typedef struct lcase {
  int64_t E, H, Hk, kdim, vdim, B, Nq, Nk;
  int self;
} lcase;

static void fill_params(attn_ctx *ctx, attn_mha *m, tu_rng *r, double amp) {
  for (int p = 0; p < TU_MHA_PROJ_PARAMS; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, m, (attn_mha_param)p)) continue;
    tu_fill_f32(r, t.data, attn_tensor_numel(&t), amp);
  }
}

/* dst's parameters = src's, the weights rounded to bf16 or f16 (layer_prec; biases as they are). */
static void copy_params_rounded(attn_ctx *ctx, attn_mha *dst, attn_mha *src) {
  for (int p = 0; p < TU_MHA_PROJ_PARAMS; p++) {
    attn_tensor s, d;
    if (attn_mha_param_view(ctx, &s, src, (attn_mha_param)p) || attn_mha_param_view(ctx, &d, dst, (attn_mha_param)p))
      continue;
    for (int64_t e = 0; e < attn_tensor_numel(&s); e++) {
      const float v = ((float *)s.data)[e];
      ((float *)d.data)[e] = s.rank == 2 ? (float)round_layer(v) : v;
    }
  }
}

static attn_tensor t3(float *data, int64_t a, int64_t b, int64_t c) {
  const int64_t s[3] = {a, b, c};
  return attn_tensor_view(data, ATTN_F32, 3, s);
}

static float *rounded_copy(const float *x, int64_t n) {
  float *r = malloc((size_t)(n ? n : 1) * sizeof(float));
  if (!r) exit(2);
  for (int64_t e = 0; e < n; e++) r[e] = (float)round_layer(x[e]);
  return r;
}

static float *param(attn_ctx *ctx, attn_mha *m, attn_mha_param p) {
  attn_tensor t;
  return attn_mha_param_view(ctx, &t, m, p) ? NULL : t.data;
}

static double rel_l2_f32(const float *got, const double *want, int64_t n) {
  double num = 0, den = 0;
  for (int64_t e = 0; e < n; e++) {
    const double d = (double)got[e] - want[e];
    num += isnan(d) ? INFINITY : d * d;
    den += want[e] * want[e];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The layer's forward composed of public calls on ctx: out [B, Nq, E] =
 * linear(sdpa(linear(q), linear(k), linear(v)), Wo, bo). */
static void composed(attn_ctx *ctx, float *out, attn_mha *m, const lcase *c, const float *xq, const float *xk,
                     const float *xv) {
  const int64_t E = c->E, D = E / c->H, kv = c->Hk * D, Mq = c->B * c->Nq, Mk = c->B * c->Nk;
  float *Q = malloc((size_t)(Mq * E) * sizeof(float)), *K = malloc((size_t)(Mk * kv) * sizeof(float));
  float *V = malloc((size_t)(Mk * kv) * sizeof(float)), *A = malloc((size_t)(Mq * E) * sizeof(float));
  if (!Q || !K || !V || !A) exit(2);
  const struct { const float *x; int64_t rows, in, outn; attn_mha_param w, b; float *y; } lin[3] = {
      {xq, Mq, E, E, ATTN_MHA_Q_WEIGHT, ATTN_MHA_Q_BIAS, Q},
      {xk, Mk, c->kdim, kv, ATTN_MHA_K_WEIGHT, ATTN_MHA_K_BIAS, K},
      {xv, Mk, c->vdim, kv, ATTN_MHA_V_WEIGHT, ATTN_MHA_V_BIAS, V}};
  for (int i = 0; i < 3; i++) {
    const int64_t sx[2] = {lin[i].rows, lin[i].in}, sw[2] = {lin[i].outn, lin[i].in}, sy[2] = {lin[i].rows, lin[i].outn};
    const int64_t sb[1] = {lin[i].outn};
    attn_tensor tx = attn_tensor_view((void *)lin[i].x, ATTN_F32, 2, sx);
    attn_tensor tw = attn_tensor_view(param(ctx, m, lin[i].w), ATTN_F32, 2, sw);
    attn_tensor tb = attn_tensor_view(param(ctx, m, lin[i].b), ATTN_F32, 1, sb);
    attn_tensor ty = attn_tensor_view(lin[i].y, ATTN_F32, 2, sy);
    CHECK_OK(ctx, attn_linear(ctx, &ty, &tx, &tw, &tb));
  }
  if (attn_ctx_precision(ctx) == layer_prec) { /* q's projection: half products, not the fp32 GEMM's */
    double *rounded = malloc((size_t)(Mq * E) * sizeof(double)), *exact = malloc((size_t)(Mq * E) * sizeof(double));
    if (!rounded || !exact) exit(2);
    const mat x = {(void *)xq, ATTN_F32, Mq, E, E}, w = {param(ctx, m, ATTN_MHA_Q_WEIGHT), ATTN_F32, E, E, E};
    reference(rounded, &x, &w, param(ctx, m, ATTN_MHA_Q_BIAS), layer_prec == ATTN_PRECISION_F16 ? 2 : 1);
    reference(exact, &x, &w, param(ctx, m, ATTN_MHA_Q_BIAS), 0);
    const double err = rel_l2_f32(Q, rounded, Mq * E), other = rel_l2_f32(Q, exact, Mq * E);
    CHECK(err <= GEMM_BOUND && other > (layer_prec == ATTN_PRECISION_F16 ? 10 : 100) * GEMM_BOUND,
          "q's projection under %s: rel L2 %.3g against float64 on rounded operands, %.3g on the f32 ones",
          attn_precision_name(layer_prec), err, other);
    free(rounded), free(exact);
  }
  /* [B, N, H*D] rows viewed as [B, H, N, D] */
  const int64_t sq[4] = {c->B, c->H, c->Nq, D}, sk[4] = {c->B, c->Hk, c->Nk, D};
  attn_tensor q = attn_tensor_view(Q, ATTN_F32, 4, sq), a = attn_tensor_view(A, ATTN_F32, 4, sq);
  attn_tensor k = attn_tensor_view(K, ATTN_F32, 4, sk), v = attn_tensor_view(V, ATTN_F32, 4, sk);
  q.strides[0] = a.strides[0] = c->Nq * E, q.strides[1] = a.strides[1] = D, q.strides[2] = a.strides[2] = E;
  k.strides[0] = v.strides[0] = c->Nk * kv, k.strides[1] = v.strides[1] = D, k.strides[2] = v.strides[2] = kv;
  CHECK_OK(ctx, attn_sdpa(ctx, &a, NULL, NULL, &q, &k, &v, NULL));
  const int64_t sa[2] = {Mq, E}, sb[1] = {E};
  attn_tensor ta = attn_tensor_view(A, ATTN_F32, 2, sa);
  attn_tensor tw = attn_tensor_view(param(ctx, m, ATTN_MHA_O_WEIGHT), ATTN_F32, 2, sa);
  tw.shape[0] = E;
  attn_tensor tb = attn_tensor_view(param(ctx, m, ATTN_MHA_O_BIAS), ATTN_F32, 1, sb);
  attn_tensor to = attn_tensor_view(out, ATTN_F32, 2, sa);
  CHECK_OK(ctx, attn_linear(ctx, &to, &ta, &tw, &tb));
  free(Q), free(K), free(V), free(A);
}

static void layer_case(const lcase *c, uint64_t seed) {
  tu_rng rng = {seed};
  const int64_t E = c->E, Mq = c->B * c->Nq, Mk = c->B * c->Nk;
  attn_ctx *ctx = context(bf16_kernel, layer_prec);
  attn_ctx *oracle = context(ATTN_KERNEL_REF, ATTN_PRECISION_DEFAULT);
  attn_ctx_set_threads(ctx, 3);
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, E, c->H);
  cfg.num_kv_heads = c->Hk;
  cfg.kdim = c->self ? 0 : c->kdim;
  cfg.vdim = c->self ? 0 : c->vdim;
  attn_mha *m, *mr;
  CHECK_OK(ctx, attn_mha_create(ctx, &m, &cfg));
  CHECK_OK(ctx, attn_mha_create(ctx, &mr, &cfg));
  fill_params(ctx, m, &rng, 1.0 / sqrt((double)E));
  copy_params_rounded(ctx, mr, m);
  const int64_t nq = Mq * E, nk = Mk * c->kdim, nv = Mk * c->vdim;
  float *xq = malloc((size_t)nq * sizeof(float)), *xk = malloc((size_t)nk * sizeof(float));
  float *xv = malloc((size_t)nv * sizeof(float));
  float *out = malloc((size_t)nq * sizeof(float)), *out2 = malloc((size_t)nq * sizeof(float));
  float *comp = malloc((size_t)nq * sizeof(float));
  double *ref = malloc((size_t)nq * sizeof(double));
  if (!xq || !xk || !xv || !out || !out2 || !comp || !ref) exit(2);
  tu_fill_f32(&rng, xq, nq, 1.0);
  tu_fill_f32(&rng, xk, nk, 1.0);
  tu_fill_f32(&rng, xv, nv, 1.0);
  float *rq = rounded_copy(xq, nq), *rk = rounded_copy(xk, nk), *rv = rounded_copy(xv, nv);
  attn_tensor tq = t3(xq, c->B, c->Nq, E), tk = t3(xk, c->B, c->Nk, c->kdim), tv = t3(xv, c->B, c->Nk, c->vdim);
  attn_tensor rtq = t3(rq, c->B, c->Nq, E), rtk = t3(rk, c->B, c->Nk, c->kdim), rtv = t3(rv, c->B, c->Nk, c->vdim);
  attn_tensor to = t3(out, c->B, c->Nq, E), to2 = t3(out2, c->B, c->Nq, E);
  const int64_t so[3] = {c->B, c->Nq, E};
  attn_tensor tref = attn_tensor_view(ref, ATTN_F64, 3, so);
  const attn_tensor *K = c->self ? NULL : &tk, *V = c->self ? NULL : &tv;
  char what[160];
  snprintf(what, sizeof what, "%s E=%lld H=%lld Hk=%lld kdim=%lld vdim=%lld B=%lld Nq=%lld Nk=%lld",
           c->self ? "self" : "cross", (long long)E, (long long)c->H, (long long)c->Hk, (long long)c->kdim,
           (long long)c->vdim, (long long)c->B, (long long)c->Nq, (long long)c->Nk);

  /* BF16 (F16): the float64 layer on rounded x and weights, and the composition of half linear + sdpa */
  const char *pn = attn_precision_name(layer_prec);
  CHECK_OK(oracle, attn_mha_forward(oracle, mr, &tref, NULL, &rtq, c->self ? NULL : &rtk, c->self ? NULL : &rtv, NULL));
  tu_poison_f32(out, nq);
  CHECK_OK(ctx, attn_mha_forward(ctx, m, &to, NULL, &tq, K, V, NULL));
  const double err = rel_l2_f32(out, ref, nq);
  printf("layer %s under %s: rel L2 %.3g against the float64 layer on rounded x and weights\n", what, pn, err);
  CHECK(err <= layer_bound(), "%s: rel L2 %.3g under %s (bound %g)", what, err, pn, layer_bound());
  composed(ctx, comp, m, c, xq, c->self ? xq : xk, c->self ? xq : xv);
  CHECK(memcmp(out, comp, (size_t)nq * sizeof(float)) == 0, "%s: under %s not bitwise half linear + sdpa + linear",
        what, pn);
  /* forward_save computes the same, and the (fp32) backward runs on what it saved */
  attn_mha_saved *sv = NULL;
  tu_poison_f32(out2, nq);
  CHECK_OK(ctx, attn_mha_forward_save(ctx, m, &to2, NULL, &sv, &tq, K, V, NULL));
  CHECK(memcmp(out, out2, (size_t)nq * sizeof(float)) == 0, "%s: forward_save differs from forward under %s", what, pn);
  attn_mha *grads;
  CHECK_OK(ctx, attn_mha_create(ctx, &grads, &cfg));
  float *dx = malloc((size_t)nq * sizeof(float));
  attn_tensor tdx = t3(dx, c->B, c->Nq, E);
  CHECK_OK(ctx, attn_mha_backward(ctx, m, c->self ? &tdx : NULL, NULL, NULL, grads, sv, &to));
  int finite = 1;
  for (int64_t e = 0; c->self && e < nq; e++) finite &= isfinite(dx[e]) != 0;
  CHECK(finite, "%s: the backward after a %s forward gave non-finite gradients", what, pn);
  attn_mha_saved_free(sv);
  attn_mha_destroy(grads);
  free(dx);

  /* DEFAULT and FP32: bitwise the fp32 composition (self-attention's fused
   * projection on the portable kernel, which no BLAS replaces) */
  for (int p = ATTN_PRECISION_DEFAULT; p <= ATTN_PRECISION_FP32; p++) {
    attn_ctx *cf = context(c->self ? ATTN_KERNEL_C : bf16_kernel, (attn_precision)p);
    attn_ctx_set_threads(cf, 2);
    tu_poison_f32(out, nq);
    CHECK_OK(cf, attn_mha_forward(cf, m, &to, NULL, &tq, K, V, NULL));
    composed(cf, comp, m, c, xq, c->self ? xq : xk, c->self ? xq : xv);
    CHECK(memcmp(out, comp, (size_t)nq * sizeof(float)) == 0, "%s: under %s not bitwise fp32 linear + sdpa + linear",
          what, attn_precision_name((attn_precision)p));
    if (p == ATTN_PRECISION_DEFAULT) memcpy(out2, out, (size_t)nq * sizeof(float));
    else CHECK(memcmp(out, out2, (size_t)nq * sizeof(float)) == 0, "%s: DEFAULT and FP32 differ", what);
    attn_ctx_destroy(cf);
  }
  free(xq), free(xk), free(xv), free(rq), free(rk), free(rv), free(out), free(out2), free(comp), free(ref);
  attn_mha_destroy(m);
  attn_mha_destroy(mr);
  attn_ctx_destroy(ctx);
  attn_ctx_destroy(oracle);
}

/* The cached step under BF16 (F16), token blocks of 5 then 1: each step's out
 * against the float64 causal layer on rounded inputs at those positions. */
static void layer_cached(void) {
  enum { E = 64, H = 4, B = 2, N = 16 };
  tu_rng rng = {99};
  attn_ctx *ctx = context(bf16_kernel, layer_prec);
  attn_ctx *oracle = context(ATTN_KERNEL_REF, ATTN_PRECISION_DEFAULT);
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, E, H);
  attn_mha *m, *mr;
  CHECK_OK(ctx, attn_mha_create(ctx, &m, &cfg));
  CHECK_OK(ctx, attn_mha_create(ctx, &mr, &cfg));
  fill_params(ctx, m, &rng, 1.0 / sqrt((double)E));
  copy_params_rounded(ctx, mr, m);
  static float x[B * N * E], step_out[B * N * E], got[B * N * E];
  static double ref[B * N * E];
  tu_fill_f32(&rng, x, B * N * E, 1.0);
  float *rx = rounded_copy(x, B * N * E);
  attn_tensor trx = t3(rx, B, N, E);
  const int64_t so[3] = {B, N, E};
  attn_tensor tref = attn_tensor_view(ref, ATTN_F64, 3, so);
  attn_mha_opts o;
  attn_mha_opts_init(&o);
  o.attn.causal = ATTN_CAUSAL_TOP_LEFT;
  CHECK_OK(oracle, attn_mha_forward(oracle, mr, &tref, NULL, &trx, NULL, NULL, &o));
  attn_kv_cache_config kc;
  attn_kv_cache_config_init(&kc, B, N, H, E / H);
  attn_kv_cache *cache;
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &kc));
  for (int64_t t0 = 0; t0 < N;) {
    const int64_t n = t0 == 0 ? 5 : 1;
    attn_tensor tx = t3(x + t0 * E, B, n, E), ts = t3(step_out, B, n, E);
    tx.strides[0] = N * E;
    tu_poison_f32(step_out, B * n * E);
    CHECK_OK(ctx, attn_mha_forward_cached(ctx, m, cache, &ts, &tx, NULL));
    for (int64_t b = 0; b < B; b++) memcpy(got + (b * N + t0) * E, step_out + b * n * E, (size_t)(n * E) * sizeof(float));
    t0 += n;
  }
  const double err = rel_l2_f32(got, ref, B * N * E);
  printf("layer cached steps under %s: rel L2 %.3g against the float64 causal layer on rounded x and weights\n",
         attn_precision_name(layer_prec), err);
  CHECK(err <= layer_bound(), "cached steps under %s: rel L2 %.3g (bound %g)", attn_precision_name(layer_prec), err,
        layer_bound());
  attn_kv_cache_destroy(cache);
  free(rx);
  attn_mha_destroy(m);
  attn_mha_destroy(mr);
  attn_ctx_destroy(ctx);
  attn_ctx_destroy(oracle);
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "";
  const char *kname = argc > 2 ? argv[2] : "avx512bf16";
  if (!strcmp(mode, "gemm")) {
    bf16_kernel = tu_kernel_or_skip(kname);
    gemm_tests();
  } else if (!strcmp(mode, "rules")) {
    rules();
    f16_rounding_edges();
  } else if (!strcmp(mode, "layer")) {
    bf16_kernel = tu_kernel_or_skip(kname);
    static const lcase cases[] = {{64, 4, 4, 64, 64, 2, 37, 37, 1},  /* self: one fused projection */
                                  {48, 3, 1, 20, 36, 2, 19, 45, 0},  /* cross, GQA, kdim != vdim != E */
                                  {128, 2, 2, 128, 128, 1, 130, 130, 1}};
    for (int lp = 0; lp < 2; lp++) {
      layer_prec = lp ? ATTN_PRECISION_F16 : ATTN_PRECISION_BF16;
      for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) layer_case(&cases[i], 300 + i);
      layer_cached();
    }
  } else {
    fprintf(stderr, "usage: test_gemm_bf16 gemm|rules|layer [avx512bf16|amx]\n");
    return 2;
  }
  return tu_finish("test_gemm_bf16");
}
