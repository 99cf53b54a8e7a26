/* fp32 GEMM for the layer's projections: C = A . B^T + bias (PyTorch Linear).
 *
 * BLIS-style: for each block of nc columns of C and kc steps of depth, B's
 * rows are packed into k-major micro-panels of nr (the block of B stays in
 * L2/L3, one micro-panel in L1); for each block of mc rows, A's rows are packed
 * into k-major micro-panels of mr (the block stays in L2); a register-blocked
 * microkernel (gemm.h states its contract) then updates each mr x nr tile of C
 * over those kc steps. Tiles cut by the edge of C run on a private copy.
 *
 * Threads split C into a grid of rectangles (whole tiles, never the depth):
 * each thread packs what its rectangle needs into its own buffers, so there are
 * no barriers, and each element of C is the same chain of K multiply-adds in k
 * order whatever the thread count, the blocking or the tile's position. So the
 * result is bitwise the same for any thread count (for a given kernel).
 *
 * The bf16 variant (attn__bgemm_nt, gemm.h's attn__bgemm_kernel) runs on the
 * same blocking and threads; only the packing (bf16 pairs along k, depth
 * blocks of an even number of steps) and the microkernel differ. */
#include "../internal.h"
#include "../cpu/gemm.h"
#include "../cpu/kernels.h"

#ifdef ATTN_HAVE_CBLAS
#include <cblas.h>
#endif

#include <stdlib.h>

/* ---- the portable microkernel ------------------------------------------------ */
/* Plain loops over a fixed tile, which compilers vectorise: 2 x 24 where x86-64's
 * baseline gives 16 xmm registers (12 of them accumulators), 4 x 16 where SIMD
 * registers are 32 (AArch64's NEON, ...). */
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__) || defined(_M_IX86)
#define C_MR 2
#define C_NR 24
#else
#define C_MR 4
#define C_NR 16
#endif

static void ukr_c(int64_t kc, const float *restrict Ap, const float *restrict Bp, float *restrict C, int64_t ldc,
                  const float *restrict init) {
  float acc[C_MR][C_NR];
  for (int i = 0; i < C_MR; i++)
    for (int j = 0; j < C_NR; j++) acc[i][j] = init ? init[j] : C[i * ldc + j];
  for (int64_t k = 0; k < kc; k++) {
    const float *a = Ap + k * C_MR, *b = Bp + k * C_NR;
    for (int i = 0; i < C_MR; i++) {
      const float ai = a[i];
      for (int j = 0; j < C_NR; j++) acc[i][j] += ai * b[j];
    }
  }
  for (int i = 0; i < C_MR; i++)
    for (int j = 0; j < C_NR; j++) C[i * ldc + j] = acc[i][j];
}

const attn__sgemm_kernel attn__sgemm_kernel_c = {"c", C_MR, C_NR, 256, (128 / C_MR) * C_MR, (512 / C_NR) * C_NR,
                                                 ukr_c, NULL, NULL};

#define MAX_MR 32
#define MAX_NR 64

/* ---- packing ------------------------------------------------------------------- */
/* rows x kc of X (ld apart) into ceil(rows / r) k-major micro-panels of r rows, zero-padded. */
static void pack_panels(const float *restrict X, int64_t ld, int64_t rows, int64_t kc, int r, float *restrict P,
                        attn__sgemm_pack_fn fast) {
  for (int64_t p = 0; p < rows; p += r, P += (int64_t)r * kc) {
    const int64_t h = rows - p < r ? rows - p : r;
    const float *x = X + p * ld;
    if (h == r && fast) {
      fast(x, ld, kc, P);
    } else if (h == r) {
      /* four k at a time: each row's reads stay contiguous, writes a few lines apart */
      int64_t k = 0;
      for (; k + 4 <= kc; k += 4)
        for (int i = 0; i < r; i++) {
          const float *s = x + i * ld + k;
          P[(k + 0) * r + i] = s[0];
          P[(k + 1) * r + i] = s[1];
          P[(k + 2) * r + i] = s[2];
          P[(k + 3) * r + i] = s[3];
        }
      for (; k < kc; k++)
        for (int i = 0; i < r; i++) P[k * r + i] = x[i * ld + k];
    } else {
      for (int64_t k = 0; k < kc; k++) {
        int i = 0;
        for (; i < h; i++) P[k * r + i] = x[i * ld + k];
        for (; i < r; i++) P[k * r + i] = 0.0f;
      }
    }
  }
}

/* ---- one thread's rectangle of C ------------------------------------------------ */
/* The product, and the kernel that computes it: kd (fp32: A and B f32) or
 * kb (bf16 products: A and B each f32 or bf16). */
typedef struct gemm_args {
  const attn__sgemm_kernel *kd;
  const attn__bgemm_kernel *kb;
  int mr, nr, kc, mc, nc; /* the kernel's */
  int64_t K;
  const void *A, *B;
  attn_dtype at, bt;
  const float *bias;
  int64_t lda, ldb, ldc;
  float *C;
  /* fp32 kernel, attn__f16gemm_nt: the packed operands rounded to f16 by this set's narrow and widen back
   * (the ISA's vcvtps2ph where it has one: the portable rounding cost the f16 layer 6%); NULL: as packed */
  const attn__decode_kernels *round_f16;
} gemm_args;

static const float zeros[MAX_NR];

/* Steps a packed micro-panel holds per row for a depth block of kc: bf16
 * pairs round an odd kc up, and a matrix unit's kernel pads to whole steps. */
static int64_t packed_depth(const gemm_args *g, int64_t kc) {
  if (!g->kb) return kc;
  const int64_t align = g->kb->kp_align > 1 ? g->kb->kp_align : 1;
  return ((kc + 1) / 2 + align - 1) / align * align * 2;
}

/* The portable packing of one micro-panel of r rows, row by row (gemm.h's
 * a_rows), kpp pairs a row: rows past `rows` and pairs past kc zero. */
static void pack_rows_pairs(const void *X, attn_dtype dt, int64_t ld, int64_t rows, int64_t kc, int r, int64_t kpp,
                            uint16_t *restrict P) {
  for (int i = 0; i < r; i++) {
    uint16_t *p = P + 2 * kpp * i;
    int64_t k = 0;
    for (; i < rows && k < kc; k++)
      p[k] = dt == ATTN_BF16 ? ((const uint16_t *)X)[i * ld + k] : attn__f32_to_bf16(((const float *)X)[i * ld + k]);
    for (; k < 2 * kpp; k++) p[k] = 0;
  }
}
static size_t packed_size(const gemm_args *g) { return g->kb ? sizeof(uint16_t) : sizeof(float); }

/* rows x kc of operand X (A or B, as dt) from row row0 and step k0 into
 * ceil(rows / r) micro-panels at P, as the kernel reads them. */
static void pack_operand(const gemm_args *g, const void *X, attn_dtype dt, int64_t ld, int64_t row0, int64_t rows,
                         int64_t k0, int64_t kc, int r, void *P, int is_a) {
  if (!g->kb) {
    pack_panels((const float *)X + row0 * ld + k0, ld, rows, kc, r, P, is_a ? g->kd->pack_a : g->kd->pack_b);
    /* once per packed element, against kc * (the other operand's columns) multiply-adds on it */
    float *p = P;
    uint16_t h[256];
    for (int64_t e = 0, n = (rows + r - 1) / r * r * kc; g->round_f16 && e < n; e += 256) {
      const int64_t c = n - e < 256 ? n - e : 256;
      g->round_f16->narrow(h, ATTN_F16, p + e, c, 1.0f);
      g->round_f16->widen(p + e, h, ATTN_F16, c);
    }
    return;
  }
  const attn__bgemm_pack_fn fast = is_a ? g->kb->pack_a : g->kb->pack_b;
  const size_t es = attn_dtype_size(dt);
  const int64_t depth = packed_depth(g, kc), kp = (kc + 1) / 2;
  uint16_t *p = P;
  for (int64_t q = 0; q < rows; q += r, p += r * depth) {
    const void *x = (const char *)X + (size_t)((row0 + q) * ld + k0) * es;
    const int64_t h = rows - q < r ? rows - q : r;
    if (is_a && g->kb->a_rows) {
      if (h == r && fast) fast(x, dt, ld, kc, p);
      else pack_rows_pairs(x, dt, ld, h, kc, r, depth / 2, p);
      continue;
    }
    if (h == r && fast)
      fast(x, dt, ld, kc, p);
    else
      attn__bgemm_pack_pairs(x, dt, ld, h, kc, r, p);
    memset(p + 2 * kp * r, 0, (size_t)(depth / 2 - kp) * (size_t)r * 4); /* the zero pairs of a padded block */
  }
}

/* Rows [m0, m1) and columns [n0, n1) of C, blocked by (mc, nc, kc) with buffers
 * Abuf (ceil(mc / mr) * mr * kc packed elements) and Bbuf (ceil(nc / nr) * nr * kc);
 * kcb is even for bf16 products unless it is all of an odd K. */
static void gemm_rect(const gemm_args *g, int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t mcb, int64_t ncb,
                      int64_t kcb, void *Abuf, void *Bbuf) {
  const int mr = g->mr, nr = g->nr;
  const size_t es = packed_size(g);
  _Alignas(64) float tile[MAX_MR * MAX_NR];
  _Alignas(64) float binit[MAX_NR];
  memset(tile, 0, sizeof tile); /* the lanes of an edge tile past C's edge: computed, never stored */
  if (g->kb && g->kb->begin) g->kb->begin();
  for (int64_t jc = n0; jc < n1; jc += ncb) {
    const int64_t nc = n1 - jc < ncb ? n1 - jc : ncb;
    for (int64_t pc = 0; pc < g->K; pc += kcb) {
      const int64_t kc = g->K - pc < kcb ? g->K - pc : kcb, kstride = packed_depth(g, kc);
      pack_operand(g, g->B, g->bt, g->ldb, jc, nc, pc, kc, nr, Bbuf, 0);
      for (int64_t ic = m0; ic < m1; ic += mcb) {
        const int64_t mc = m1 - ic < mcb ? m1 - ic : mcb;
        pack_operand(g, g->A, g->at, g->lda, ic, mc, pc, kc, mr, Abuf, 1);
        for (int64_t jr = 0; jr < nc; jr += nr) {
          const int64_t w = nc - jr < nr ? nc - jr : nr;
          const void *Bp = (const char *)Bbuf + (size_t)(jr * kstride) * es;
          const float *init = NULL;
          if (pc == 0) {
            if (!g->bias) {
              init = zeros;
            } else if (w == nr) {
              init = g->bias + jc + jr;
            } else {
              for (int j = 0; j < nr; j++) binit[j] = j < w ? g->bias[jc + jr + j] : 0.0f;
              init = binit;
            }
          }
          for (int64_t ir = 0; ir < mc; ir += mr) {
            const int64_t h = mc - ir < mr ? mc - ir : mr;
            const void *Ap = (const char *)Abuf + (size_t)(ir * kstride) * es;
            float *c = g->C + (ic + ir) * g->ldc + jc + jr, *dst = c;
            int64_t ldd = g->ldc;
            if (h < mr || w < nr) { /* cut by C's edge: on the private tile */
              if (!init)
                for (int64_t i = 0; i < h; i++) memcpy(tile + i * nr, c + i * g->ldc, (size_t)w * sizeof(float));
              dst = tile;
              ldd = nr;
            }
            if (g->kb)
              g->kb->ukr(kstride / 2, Ap, Bp, dst, ldd, init);
            else
              g->kd->ukr(kc, Ap, Bp, dst, ldd, init);
            if (dst == tile)
              for (int64_t i = 0; i < h; i++) memcpy(c + i * g->ldc, tile + i * nr, (size_t)w * sizeof(float));
          }
        }
      }
    }
  }
  if (g->kb && g->kb->end) g->kb->end();
}

/* Without heap buffers (allocation failed): the same arithmetic, one tile of
 * rows and columns at a time, with buffers on the stack (an even depth block). */
#define FALLBACK_KC 128

static void gemm_rect_small(const gemm_args *g, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  _Alignas(64) float abuf[MAX_MR * FALLBACK_KC];
  _Alignas(64) float bbuf[MAX_NR * FALLBACK_KC];
  gemm_rect(g, m0, m1, n0, n1, g->mr, g->nr, FALLBACK_KC, abuf, bbuf);
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* The grid of tm x tn rectangles for t threads: the factorisation of t with the
 * least work (multiply-adds plus packing) for the busiest thread. */
static void choose_grid(int t, int64_t M, int64_t N, int64_t K, const gemm_args *g, int *tm, int *tn) {
  const int64_t MT = ceil_div(M, g->mr), NT = ceil_div(N, g->nr);
  double best = -1;
  *tm = 1;
  *tn = 1;
  for (int a = 1; a <= t; a++) {
    if (t % a) continue;
    const int b = t / a;
    const double rows = (double)(ceil_div(MT, a) * g->mr), cols = (double)(ceil_div(NT, b) * g->nr);
    /* tens of flops a cycle against a packed element or so a cycle; A is packed once per block of nc columns */
    const double cost = rows * cols * (double)K / 16.0 + (rows * (double)ceil_div((int64_t)cols, g->nc) + cols) * (double)K;
    if (best < 0 || cost < best) {
      best = cost;
      *tm = a;
      *tn = b;
    }
  }
}

/* C [M, N] = bias (or zeros): a product over no depth. */
static void fill_bias(int64_t M, int64_t N, float *C, int64_t ldc, const float *bias) {
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < N; j++) C[i * ldc + j] = bias ? bias[j] : 0.0f;
}

/* g's product (M, N > 0, K > 0) on ctx's threads, each on its own rectangle of whole tiles. */
static void gemm_run(const attn_ctx *ctx, const gemm_args *g, int64_t M, int64_t N) {
  const int64_t K = g->K;
  int threads = attn__threads(ctx);
  const int64_t mcmax = g->mc > g->mr ? g->mc / g->mr * g->mr : g->mr;
  const int64_t ncmax = g->nc > g->nr ? g->nc / g->nr * g->nr : g->nr;
  if (threads < 1) threads = 1;
  /* small products are not worth waking threads for (nor a thread per tile) */
  const double flops = 2.0 * (double)M * (double)N * (double)K;
  int64_t tmax = (int64_t)(flops / 4e6) + 1;
  if (tmax > ceil_div(M, g->mr) * ceil_div(N, g->nr)) tmax = ceil_div(M, g->mr) * ceil_div(N, g->nr);
  if (threads > tmax) threads = (int)tmax;
  int tm, tn;
  choose_grid(threads, M, N, K, g, &tm, &tn);
  const int64_t MT = ceil_div(M, g->mr), NT = ceil_div(N, g->nr);
  const int64_t rt = ceil_div(MT, tm), ct = ceil_div(NT, tn); /* tiles per rectangle */
  const int64_t kcb = K < g->kc ? K : g->kc, kstride = packed_depth(g, kcb);
  const size_t es = packed_size(g);
  const int nrect = tm * tn;

#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int r = 0; r < nrect; r++) {
    const int64_t m0 = (r / tn) * rt * g->mr, n0 = (r % tn) * ct * g->nr;
    const int64_t m1 = m0 + rt * g->mr < M ? m0 + rt * g->mr : M, n1 = n0 + ct * g->nr < N ? n0 + ct * g->nr : N;
    if (m0 < m1 && n0 < n1) {
      const int64_t mcb = m1 - m0 < mcmax ? ceil_div(m1 - m0, g->mr) * g->mr : mcmax;
      const int64_t ncb = n1 - n0 < ncmax ? ceil_div(n1 - n0, g->nr) * g->nr : ncmax;
      void *abuf = attn__aligned_alloc((size_t)(mcb * kstride) * es);
      void *bbuf = attn__aligned_alloc((size_t)(ncb * kstride) * es);
      if (abuf && bbuf)
        gemm_rect(g, m0, m1, n0, n1, mcb, ncb, kcb, abuf, bbuf);
      else
        gemm_rect_small(g, m0, m1, n0, n1);
      attn__aligned_free(abuf);
      attn__aligned_free(bbuf);
    }
  }
}

#ifdef ATTN_HAVE_CBLAS
/* CBLAS takes int sizes and leading dimensions no shorter than the rows. */
static int cblas_fits(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  const int64_t most = 2147483647;
  return M <= most && N <= most && K <= most && lda >= K && lda <= most && ldb >= K && ldb <= most && ldc >= N &&
         ldc <= most;
}
#endif

/* The fp32 GEMM on our kernels (K may be 0), packed operands rounded to f16 when round_f16 (gemm_args). */
static void sgemm_ours(const attn_ctx *ctx, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                       const float *B, int64_t ldb, float *C, int64_t ldc, const float *bias,
                       const attn__decode_kernels *round_f16) {
  if (K <= 0) {
    fill_bias(M, N, C, ldc, bias);
    return;
  }
  const attn__sgemm_kernel *kd = ctx->dispatch.gemm;
  const gemm_args g = {kd, NULL, kd->mr, kd->nr, kd->kc, kd->mc, kd->nc, K, A, B, ATTN_F32, ATTN_F32,
                       bias, lda, ldb, ldc, C, round_f16};
  gemm_run(ctx, &g, M, N);
}

void attn__sgemm_nt(const attn_ctx *ctx, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                    int64_t ldb, float *C, int64_t ldc, const float *bias) {
  if (M <= 0 || N <= 0) return;
#ifdef ATTN_HAVE_CBLAS
  /* -DATTN_WITH_CBLAS=ON: the BLAS does the fast paths (its own threads and
   * rounding order); the portable kernel stays ours, for comparison. */
  if (ctx->dispatch.gemm != &attn__sgemm_kernel_c && K > 0 && cblas_fits(M, N, K, lda, ldb, ldc)) {
    fill_bias(M, N, C, ldc, bias);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)N, (int)K, 1.0f, A, (int)lda, B, (int)ldb,
                bias ? 1.0f : 0.0f, C, (int)ldc);
    return;
  }
#endif
  sgemm_ours(ctx, M, N, K, A, lda, B, ldb, C, ldc, bias, NULL);
}

void attn__f16gemm_nt(const attn_ctx *ctx, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                      const float *B, int64_t ldb, float *C, int64_t ldc, const float *bias) {
  /* never a BLAS: it cannot round */
  if (M > 0 && N > 0) sgemm_ours(ctx, M, N, K, A, lda, B, ldb, C, ldc, bias, ctx->dispatch.decode);
}

void attn__bgemm_nt(const attn_ctx *ctx, int64_t M, int64_t N, int64_t K, const void *A, attn_dtype at, int64_t lda,
                    const void *B, attn_dtype bt, int64_t ldb, float *C, int64_t ldc, const float *bias) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    fill_bias(M, N, C, ldc, bias);
    return;
  }
  const attn__bgemm_kernel *kb = ctx->dispatch.gemm_bf16;
  const gemm_args g = {NULL, kb, kb->mr, kb->nr, kb->kc, kb->mc, kb->nc, K, A, B, at, bt, bias, lda, ldb, ldc, C, 0};
  gemm_run(ctx, &g, M, N);
}

void attn__project_nt(const attn_ctx *ctx, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                      const float *B, int64_t ldb, float *C, int64_t ldc, const float *bias) {
  if (ctx->dispatch.precision == ATTN_PRECISION_BF16 && ctx->dispatch.gemm_bf16)
    attn__bgemm_nt(ctx, M, N, K, A, ATTN_F32, lda, B, ATTN_F32, ldb, C, ldc, bias);
  else if (ctx->dispatch.precision == ATTN_PRECISION_F16)
    attn__f16gemm_nt(ctx, M, N, K, A, lda, B, ldb, C, ldc, bias);
  else
    attn__sgemm_nt(ctx, M, N, K, A, lda, B, ldb, C, ldc, bias);
}
