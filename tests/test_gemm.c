/* attn__sgemm_nt (C = A . B^T + bias, fp32) against a float64 reference, for
 * every instruction set this CPU runs and 1, 2 and 3 threads: sizes of 1, odd
 * sizes, sizes around the tiles and blocks of each kernel, row strides longer
 * than the rows, with and without bias. Also: C's elements past each row are
 * never written, A's and B's past each row never read (they hold NaN), and the
 * result is bitwise the same for every thread count. */
#include "internal.h"
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
    attn_ctx_set_kernel(ctx, isas[ki]);
    for (int t = 0; t < 3; t++) {
      const int threads = t + 1;
      tu_poison_f32(C[t].p, nc);
      attn_ctx_set_threads(ctx, threads);
      attn__sgemm_nt(ctx, M, N, K, A.p, lda, B.p, ldb, C[t].p, ldc, bp);
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

int main(void) {
  attn_kernel isas[3];
  int nisa = 0;
  isas[nisa++] = ATTN_KERNEL_C;
  if (attn_kernel_supported(ATTN_KERNEL_AVX2)) isas[nisa++] = ATTN_KERNEL_AVX2;
  if (attn_kernel_supported(ATTN_KERNEL_AVX512)) isas[nisa++] = ATTN_KERNEL_AVX512;
  printf("test_gemm: isas");
  for (int i = 0; i < nisa; i++) printf(" %s", isa_name(isas[i]));
  for (int k = ATTN_KERNEL_AVX2; k <= ATTN_KERNEL_AVX512; k++)
    if (!attn_kernel_supported((attn_kernel)k)) printf(" (%s: not supported here: skipped)", isa_name((attn_kernel)k));
  printf("\n");

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
