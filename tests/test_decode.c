/* Decoding and half-precision inputs: the decode kernel (few query rows, keys
 * streamed in place, split-KV chunks merged by log-sum-exp) and the blocked
 * kernel with f16/bf16 q, k, v, each against the float64 oracle run on the
 * same (rounded) inputs, on every kernel and several thread counts, with
 * poisoned outputs; results must not depend on the thread count. */
#include "testutil.h"
#ifdef ATTN_HAVE_X86_KERNELS
#include "cpu/kernels.h"
#include "quant.h"
#endif

typedef struct dcase {
  int64_t B, Hq, Hk, Nq, Nk, D, Dv;
  attn_causal causal;
  attn_dtype dt;
  int batch_first; /* q, k, v laid out [B, N, H, D] in memory */
  int kpm, mask, lse;
  int64_t window;
  double softcap;
  int alibi;
  int64_t chunk;
} dcase;

/* A [B, H, N, F] view of fresh random data in dt (rounded through dt). */
static attn_tensor make_input(tu_rng *r, int64_t B, int64_t H, int64_t N, int64_t F, attn_dtype dt, int batch_first) {
  const int64_t n = B * H * N * F;
  const size_t es = attn_dtype_size(dt);
  attn_tensor t;
  memset(&t, 0, sizeof t);
  t.data = malloc((size_t)(n > 0 ? n : 1) * es);
  t.dtype = dt;
  t.rank = 4;
  t.shape[0] = B, t.shape[1] = H, t.shape[2] = N, t.shape[3] = F;
  t.strides[3] = 1;
  if (batch_first) t.strides[1] = F, t.strides[2] = H * F;
  else t.strides[2] = F, t.strides[1] = N * F;
  t.strides[0] = H * N * F;
  for (int64_t i = 0; i < n; i++) tu_store_float(t.data, dt, i, tu_uniform(r) * 1.5);
  return t;
}

static attn_tensor make_f32(int64_t rank, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < rank; i++) n *= shape[i];
  float *d = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
  tu_poison_f32(d, n);
  return attn_tensor_view(d, ATTN_F32, (int)rank, shape);
}

static double max_abs_diff_lse(const float *a, const double *b, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; i++) {
    if (isinf(b[i]) && a[i] == b[i]) continue;
    const double d = fabs(a[i] - b[i]) / fmax(1.0, fabs(b[i])); /* relative beyond 1: ALiBi logits reach hundreds */
    if (!(d <= m)) m = d; /* NaN wins */
  }
  return m;
}

/* Every kernel and thread count on one case, against the oracle; decode toggles the decode kernel. */
static void run_case(const dcase *c, uint64_t seed, int decode) {
  tu_rng r = {seed};
  attn_tensor q = make_input(&r, c->B, c->Hq, c->Nq, c->D, c->dt, c->batch_first);
  attn_tensor k = make_input(&r, c->B, c->Hk, c->Nk, c->D, c->dt, c->batch_first);
  attn_tensor v = make_input(&r, c->B, c->Hk, c->Nk, c->Dv, c->dt, c->batch_first);
  const int64_t os[4] = {c->B, c->Hq, c->Nq, c->Dv}, ls[3] = {c->B, c->Hq, c->Nq}, ks[2] = {c->B, c->Nk};
  const int64_t ms[2] = {c->Nq, c->Nk}, hs[1] = {c->Hq};
  const int64_t n_out = c->B * c->Hq * c->Nq * c->Dv, n_lse = c->B * c->Hq * c->Nq;
  uint8_t *kpm = malloc((size_t)(c->B * c->Nk + 1)), *mask = malloc((size_t)(c->Nq * c->Nk + 1));
  for (int64_t i = 0; i < c->B * c->Nk; i++) kpm[i] = tu_int(&r, 0, 9) == 0;
  for (int64_t i = 0; i < c->Nq * c->Nk; i++) mask[i] = tu_int(&r, 0, 4) != 0; /* keep */
  attn_tensor tk = attn_tensor_view(kpm, ATTN_BOOL, 2, ks), tm = attn_tensor_view(mask, ATTN_BOOL, 2, ms);
  float slopes[64];
  attn_alibi_slopes(slopes, c->Hq);
  attn_tensor ta = attn_tensor_view(slopes, ATTN_F32, 1, hs);
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.causal = c->causal;
  o.window = c->window;
  o.chunk = c->chunk;
  o.softcap = c->softcap;
  if (c->alibi) o.alibi_slopes = &ta;
  if (c->kpm) o.key_padding = &tk;
  if (c->mask) o.mask = &tm;

  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  double *ref = malloc((size_t)(n_out + 1) * sizeof(double)), *ref_lse = malloc((size_t)(n_lse + 1) * sizeof(double));
  attn_tensor tro = attn_tensor_view(ref, ATTN_F64, 4, os), trl = attn_tensor_view(ref_lse, ATTN_F64, 3, ls);
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &tro, &trl, NULL, &q, &k, &v, &o));

  char what[200];
  snprintf(what, sizeof what, "B%lld Hq%lld Hk%lld Nq%lld Nk%lld D%lld Dv%lld causal%d %s bf%d kpm%d mask%d W%lld cap%g alibi%d C%lld %s",
           (long long)c->B, (long long)c->Hq, (long long)c->Hk, (long long)c->Nq, (long long)c->Nk, (long long)c->D,
           (long long)c->Dv, (int)c->causal, attn_dtype_name(c->dt), c->batch_first, c->kpm, c->mask,
           (long long)c->window, c->softcap, c->alibi, (long long)c->chunk, decode ? "decode" : "blocked");
  const attn_kernel kernels[3] = {ATTN_KERNEL_C, ATTN_KERNEL_AVX2, ATTN_KERNEL_AVX512};
  /* fp32 logits of size x carry errors of x * 6e-8: ALiBi without causal reaches hundreds */
  const double tol = c->alibi ? 1e-5 : c->softcap > 0 ? 3e-6 : 2e-6;
  for (int ki = 0; ki < 3; ki++) {
    if (!attn_kernel_supported(kernels[ki])) continue;
    attn_ctx_set_kernel(ctx, kernels[ki]);
    CHECK_OK(ctx, attn_ctx_set_decode(ctx, decode));
    float *first = NULL;
    for (int threads = 1; threads <= 3; threads++) {
      attn_ctx_set_threads(ctx, threads);
      attn_tensor out = make_f32(4, os), lse = make_f32(3, ls);
      CHECK_OK(ctx, attn_sdpa(ctx, &out, c->lse ? &lse : NULL, NULL, &q, &k, &v, &o));
      /* the decode kernel takes up to 64 rows a kv head where no half tiles would run (none on these kernels) */
      const int want_decode = decode && c->Nq * (c->Hq / c->Hk) <= 64;
      CHECK((strstr(attn_ctx_plan(ctx), "attn_sdpa decode") != NULL) == want_decode, "%s kernel %s: plan %s",
            what, attn_kernel_name(kernels[ki]), attn_ctx_plan(ctx));
      double *got = tu_to_f64(&out);
      const double err = tu_rel_l2(got, ref, n_out);
      CHECK(err <= tol, "%s kernel %s threads %d: rel L2 %.3g", what, attn_kernel_name(kernels[ki]), threads, err);
      if (c->lse) {
        const double le = max_abs_diff_lse(lse.data, ref_lse, n_lse);
        CHECK(le <= 1e-5, "%s kernel %s: lse off by %.3g", what, attn_kernel_name(kernels[ki]), le);
      }
      if (!first) first = out.data;
      else {
        CHECK(memcmp(first, out.data, (size_t)n_out * sizeof(float)) == 0, "%s kernel %s: threads %d differ from 1",
              what, attn_kernel_name(kernels[ki]), threads);
        free(out.data);
      }
      free(got);
      free(lse.data);
    }
    free(first);
  }
  attn_ctx_destroy(ctx);
  free(q.data), free(k.data), free(v.data), free(kpm), free(mask), free(ref), free(ref_lse);
}

/* Shapes around the decode kernel's block (128 keys) and chunk (2048 keys). */
static void decode_cases(void) {
  const dcase cases[] = {
      /* B  Hq  Hk  Nq  Nk   D   Dv  causal                      dtype      bf kpm mask lse W  cap alibi */
      {1, 8, 8, 1, 1, 64, 64, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_F32, 0, 0, 0, 1, 0, 0, 0, 0},
      {1, 8, 8, 1, 1500, 128, 128, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_F32, 0, 0, 0, 1, 0, 0, 0, 0},
      {1, 4, 2, 2, 4500, 64, 64, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_F32, 1, 1, 0, 1, 0, 0, 0, 0},
      {1, 8, 8, 1, 2049, 32, 32, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_F16, 0, 0, 0, 1, 0, 0, 0, 0},
      {1, 8, 2, 1, 4200, 64, 64, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_BF16, 0, 0, 0, 1, 3000, 4.0, 1, 0},
      {2, 8, 2, 1, 1037, 64, 64, ATTN_CAUSAL_NONE, ATTN_F32, 1, 1, 0, 1, 0, 0, 0, 0},
      {1, 8, 2, 2, 531, 80, 48, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_F32, 0, 0, 1, 1, 0, 0, 0, 0},
      {2, 4, 1, 2, 97, 16, 16, ATTN_CAUSAL_TOP_LEFT, ATTN_F32, 1, 1, 0, 1, 0, 0, 0, 0},
      {1, 8, 8, 3, 700, 128, 128, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_F16, 0, 0, 0, 1, 0, 0, 0, 0},
      {1, 32, 8, 1, 1100, 128, 128, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_BF16, 1, 0, 0, 1, 0, 0, 0, 0},
      {2, 4, 4, 1, 600, 33, 33, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_F16, 1, 1, 0, 0, 0, 0, 0, 0},
      /* the options */
      {1, 8, 4, 2, 900, 64, 64, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_F32, 0, 0, 0, 1, 1, 0, 0, 0},
      {1, 8, 4, 2, 900, 64, 64, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_F32, 0, 0, 0, 1, 100, 0, 0, 0},
      {1, 8, 4, 1, 900, 64, 64, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_F16, 0, 1, 0, 1, 2000, 0, 0, 0},
      {1, 8, 8, 1, 777, 64, 64, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_F32, 0, 0, 0, 1, 0, 5.0, 0, 0},
      {1, 12, 4, 2, 640, 64, 64, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_BF16, 0, 0, 1, 1, 300, 8.0, 1, 0},
      {2, 8, 8, 1, 513, 64, 64, ATTN_CAUSAL_NONE, ATTN_F32, 1, 1, 0, 1, 0, 0, 1, 0},
      /* more rows a kv head than the kernels take a call (8): groups of rows over each block of keys */
      {1, 32, 8, 3, 700, 128, 128, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_F32, 0, 0, 0, 1, 0, 0, 0, 0},
      {1, 16, 2, 2, 900, 64, 64, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_F16, 1, 1, 0, 1, 0, 0, 0, 0},
      {2, 8, 1, 8, 1100, 64, 48, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_BF16, 0, 0, 1, 1, 300, 5.0, 1, 0},
      {1, 4, 4, 20, 2100, 32, 32, ATTN_CAUSAL_TOP_LEFT, ATTN_F32, 0, 0, 0, 1, 0, 0, 0, 0},
      {1, 8, 2, 9, 530, 80, 80, ATTN_CAUSAL_NONE, ATTN_F32, 1, 0, 1, 1, 0, 0, 0, 0},
      {1, 4, 1, 17, 300, 64, 64, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_F32, 0, 0, 0, 1, 0, 0, 0, 0}, /* 68 rows: blocked */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    run_case(&cases[i], 1000 + i, 1);
    run_case(&cases[i], 1000 + i, 0); /* the same problem through the blocked kernel */
  }
  /* chunks (Llama 4): a row reads its own chunk's keys only, a window inside it or across its start */
  static const struct { size_t base; int64_t chunk; } chunked[] = {{1, 512}, {2, 1000}, {4, 1024}, {11, 256}, {12, 64},
                                                                   {14, 333}, {16, 640}, {19, 100}, {22, 128}};
  for (size_t i = 0; i < sizeof chunked / sizeof chunked[0]; i++) {
    dcase c = cases[chunked[i].base];
    c.chunk = chunked[i].chunk;
    run_case(&c, 3000 + i, 1);
    run_case(&c, 3000 + i, 0);
  }
}

/* Half-precision inputs on problems only the blocked kernel takes. */
static void blocked_halves(void) {
  const dcase cases[] = {
      {1, 4, 2, 70, 130, 64, 64, ATTN_CAUSAL_TOP_LEFT, ATTN_F16, 1, 0, 1, 1, 0, 0, 0, 0},
      {2, 2, 2, 45, 45, 40, 24, ATTN_CAUSAL_NONE, ATTN_BF16, 0, 1, 0, 1, 0, 0, 0, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i], 2000 + i, 1);
}

/* The decode kernel reads the whole cache once per group: a k/v of f64 is refused, not read. */
static void refusals(void) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  double d[64] = {0};
  float f[64] = {0};
  const int64_t s[4] = {1, 1, 1, 8};
  attn_tensor q = attn_tensor_view(f, ATTN_F32, 4, s), k = attn_tensor_view(d, ATTN_F64, 4, s);
  attn_tensor out = attn_tensor_view(f + 16, ATTN_F32, 4, s);
  CHECK(attn_sdpa(ctx, &out, NULL, NULL, &q, &k, &q, NULL) == ATTN_E_DTYPE, "f64 k accepted by the fp32 kernels");
  attn_tensor dq = attn_tensor_view(f + 32, ATTN_F32, 4, s);
  const int64_t ls[3] = {1, 1, 1};
  attn_tensor lse = attn_tensor_view(f + 48, ATTN_F32, 3, ls);
  /* f16/bf16 inputs are widened for the backward (test_half); f64 ones are refused */
  CHECK(attn_sdpa_backward(ctx, &dq, &dq, &dq, NULL, NULL, &q, &k, &q, &q, &q, &lse, NULL) == ATTN_E_DTYPE,
        "f64 q accepted by the fp32 backward");
  attn_ctx_destroy(ctx);
}

/* The decode kernel's edge cases: a row with every key masked gives zeros and
 * lse -inf; NaN in one query row stays in that row although the rows of a
 * group share every K and V load; Nk = 0 is a row with nothing to see. */
static void edges(int blocked) {
  enum { Hq = 4, Hk = 2, Nk = 40, D = 16 };
  float q[2 * Hq * D], k[2 * Hk * Nk * D], v[2 * Hk * Nk * D], out[2 * Hq * D], lse[2 * Hq];
  tu_rng r = {5};
  tu_fill_f32(&r, q, 2 * Hq * D, 1);
  tu_fill_f32(&r, k, 2 * Hk * Nk * D, 1);
  tu_fill_f32(&r, v, 2 * Hk * Nk * D, 1);
  uint8_t kpm[2 * Nk];
  for (int j = 0; j < 2 * Nk; j++) kpm[j] = j < Nk; /* batch 0: every key padded */
  const int64_t qs[4] = {2, Hq, 1, D}, ks[4] = {2, Hk, Nk, D}, ps[2] = {2, Nk}, ls[3] = {2, Hq, 1};
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, qs), tk = attn_tensor_view(k, ATTN_F32, 4, ks);
  attn_tensor tv = attn_tensor_view(v, ATTN_F32, 4, ks), to = attn_tensor_view(out, ATTN_F32, 4, qs);
  attn_tensor tp = attn_tensor_view(kpm, ATTN_BOOL, 2, ps), tl = attn_tensor_view(lse, ATTN_F32, 3, ls);
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  CHECK_OK(ctx, attn_ctx_set_decode(ctx, !blocked));
  const attn_kernel kernels[3] = {ATTN_KERNEL_C, ATTN_KERNEL_AVX2, ATTN_KERNEL_AVX512};
  for (int ki = 0; ki < 3; ki++) {
    if (!attn_kernel_supported(kernels[ki])) continue;
    attn_ctx_set_kernel(ctx, kernels[ki]);
    attn_sdpa_opts o;
    attn_sdpa_opts_init(&o);
    o.key_padding = &tp;
    tu_poison_f32(out, 2 * Hq * D);
    tu_poison_f32(lse, 2 * Hq);
    q[Hq * D + D + 3] = NAN; /* batch 1, head 1 */
    CHECK_OK(ctx, attn_sdpa(ctx, &to, &tl, NULL, &tq, &tk, &tv, &o));
    int zeros = 1, nan_row = 1, finite = 1;
    for (int e = 0; e < Hq * D; e++) zeros &= out[e] == 0;
    for (int h = 0; h < Hq; h++) zeros &= isinf(lse[h]) && lse[h] < 0;
    for (int h = 0; h < Hq; h++)
      for (int d = 0; d < D; d++) {
        const float x = out[(Hq + h) * D + d];
        if (h == 1) nan_row &= isnan(x) != 0;
        else finite &= isfinite(x) != 0;
      }
    CHECK(zeros, "kernel %s%s: a fully masked decode row must give zeros and lse -inf", attn_kernel_name(kernels[ki]),
          blocked ? " (blocked)" : "");
    CHECK(nan_row && finite, "kernel %s%s: NaN must stay in its row", attn_kernel_name(kernels[ki]),
          blocked ? " (blocked)" : "");
    q[Hq * D + D + 3] = 0.5f;
    attn_tensor empty_k = tk, empty_v = tv;
    empty_k.shape[2] = empty_v.shape[2] = 0;
    o.key_padding = NULL;
    tu_poison_f32(out, 2 * Hq * D);
    CHECK_OK(ctx, attn_sdpa(ctx, &to, &tl, NULL, &tq, &empty_k, &empty_v, &o));
    zeros = 1;
    for (int e = 0; e < 2 * Hq * D; e++) zeros &= out[e] == 0;
    CHECK(zeros && isinf(lse[0]), "kernel %s: Nk = 0 must give zeros", attn_kernel_name(kernels[ki]));
  }
  attn_ctx_destroy(ctx);
}

/* The AVX-512 decode microkernels are built three times: reading ahead into
 * L1, into L2, and into L2 with a KV cache's key blocks widened whole for up
 * to 8 rows and f32 rows read ahead into L1 too (dispatch.c takes the one for this CPU's vendor and family, and the
 * cases above test it against the oracle): the others must give the same bits,
 * for every row count a call takes. */
static void decode_sets(void) {
#ifdef ATTN_HAVE_X86_KERNELS
  if (!attn_kernel_supported(ATTN_KERNEL_AVX512)) {
    printf("decode sets: no AVX-512 here: skipped\n");
    return;
  }
  const attn__decode_kernels *sets[3] = {&attn__decode_kernels_avx512, &attn__decode_kernels_avx512_l2,
                                         &attn__decode_kernels_avx512_l2_blocks8};
  const char *set_names[3] = {"L1", "L2", "Zen 4's (L2, key blocks for 8 rows, f32 also into L1)"};
  enum { NK = 100, D = 96, ROWS = 8 };
  const attn_dtype types[5] = {ATTN_F32, ATTN_F16, ATTN_BF16, ATTN__Q8_0, ATTN__Q4_0};
  const char *names[5] = {"f32", "f16", "bf16", "q8_0", "q4_0"};
  tu_rng r = {77};
  int cases = 0;
  for (int ti = 0; ti < 5; ti++) {
    const attn_dtype dt = types[ti];
    const int quant = attn__is_quant(dt);
    const size_t row = quant ? attn__row_bytes(dt, D) : (size_t)D * attn_dtype_size(dt);
    unsigned char *K = malloc(NK * row), *V = malloc(NK * row);
    if (!K || !V) {
      CHECK(0, "decode sets: out of memory");
      free(K), free(V);
      return;
    }
    float src[D];
    for (int j = 0; j < NK; j++)
      for (int kv = 0; kv < 2; kv++) {
        unsigned char *dst = (kv ? V : K) + j * row;
        tu_fill_f32(&r, src, D, 1.0);
        if (quant) attn__quantize_row(dt, dst, src, D);
        else
          for (int d = 0; d < D; d++) tu_store_float(dst, dt, d, src[d]);
      }
    const int64_t ld = quant ? (int64_t)row : D;
    for (int rows = 1; rows <= ROWS; rows++) {
      float Q[ROWS * D], S[3][ROWS * ATTN__DEC_NB], O[3][ROWS * D], m[3][ROWS], l[3][ROWS];
      tu_fill_f32(&r, Q, rows * D, 0.3);
      for (int t = 0; t < 3; t++) {
        const attn__decode_kernels *dk = sets[t];
        tu_poison_f32(S[t], ROWS * ATTN__DEC_NB);
        for (int i = 0; i < rows * D; i++) O[t][i] = 0;
        for (int i = 0; i < rows; i++) m[t][i] = -INFINITY, l[t][i] = 0;
        dk->qk(S[t], Q, rows, K, ld, NK, D, dt, NULL);
        dk->pv(O[t], m[t], l[t], S[t], rows, V, ld, NK, D, dt, 0, NULL);
      }
      double norm = 0;
      for (int i = 0; i < rows * D; i++) norm += (double)O[0][i] * O[0][i];
      CHECK(norm > 0 && isfinite(norm), "decode sets: %s, %d rows: no output", names[ti], rows);
      for (int t = 1; t < 3; t++) {
        int same = memcmp(O[0], O[t], (size_t)rows * D * sizeof(float)) == 0 &&
                   memcmp(m[0], m[t], (size_t)rows * sizeof(float)) == 0 &&
                   memcmp(l[0], l[t], (size_t)rows * sizeof(float)) == 0;
        for (int i = 0; i < rows; i++)
          same &= memcmp(S[0] + i * ATTN__DEC_NB, S[t] + i * ATTN__DEC_NB, NK * sizeof(float)) == 0;
        CHECK(same, "decode sets %s and %s differ: %s, %d rows", set_names[0], set_names[t], names[ti], rows);
        cases++;
      }
    }
    free(K), free(V);
  }
  printf("decode sets: the L1, L2 and Zen 4 builds bitwise equal on %d cases\n", cases);
#else
  printf("decode sets: no x86 kernels in this build: skipped\n");
#endif
}

int main(void) {
  for (int k = ATTN_KERNEL_C; k <= ATTN_KERNEL_AVX512; k++)
    printf("kernel %-6s %s\n", attn_kernel_name((attn_kernel)k),
           attn_kernel_supported((attn_kernel)k) ? "tested" : "not supported here: skipped");
  edges(0); /* the decode kernel */
  edges(1); /* the same rows through the blocked kernel */
  decode_cases();
  blocked_halves();
  refusals();
  decode_sets();
  return tu_finish("test_decode");
}
