/* fp32 GEMM for the layer's projections: C = A . B^T + bias (PyTorch Linear).
 * Blocked so that a block of B stays in cache while rows of A stream past it;
 * the inner loop runs over K, contiguous in both A and B. */
#include "../internal.h"

#define GEMM_NB 64   /* columns of C (rows of B) per block */
#define GEMM_KB 256  /* depth per block */

// C is (M, N) ldc apart, A is (M, K) lda apart, B is (N, K) ldb apart, bias is (N) or NULL.
void attn__sgemm_nt(int threads, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                    int64_t ldb, float *C, int64_t ldc, const float *bias) {
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2) if (M * N * K > 32768)
  for (int64_t i0 = 0; i0 < M; i0 += 4) {
    for (int64_t n0 = 0; n0 < N; n0 += GEMM_NB) {
      const int64_t i1 = i0 + 4 < M ? i0 + 4 : M, n1 = n0 + GEMM_NB < N ? n0 + GEMM_NB : N;
      for (int64_t i = i0; i < i1; i++)
        for (int64_t n = n0; n < n1; n++) C[i * ldc + n] = bias ? bias[n] : 0.0f;
      for (int64_t k0 = 0; k0 < K; k0 += GEMM_KB) {
        const int64_t k1 = k0 + GEMM_KB < K ? k0 + GEMM_KB : K;
        for (int64_t i = i0; i < i1; i++) {
          const float *a = A + i * lda;
          for (int64_t n = n0; n < n1; n++) {
            const float *b = B + n * ldb;
            /* eight partial sums: a fixed order, so results do not depend on threads */
            float s[8] = {0};
            int64_t k = k0;
            for (; k + 8 <= k1; k += 8)
              for (int u = 0; u < 8; u++) s[u] += a[k + u] * b[k + u];
            float t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
            for (; k < k1; k++) t += a[k] * b[k];
            C[i * ldc + n] += t;
          }
        }
      }
    }
  }
}
