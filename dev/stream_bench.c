/* How fast this machine streams memory in the f32 decode's access patterns,
 * with none of the decode's work but its FMAs: the ceiling a decoding step
 * can reach here, against the plain read pass that `attn bench decode` quotes
 * as the read bandwidth. Each pattern reads the same 640 MiB (in 2 MiB pages
 * where the kernel gives them, as KV caches are), split between the threads:
 *   plain        one add per 64 bytes, in order (the bench's read pass)
 *   fma4         four FMAs per 64 bytes, in order: the 4-row step's arithmetic per byte
 *   kv           fma4 over K and V blocks of 64 KiB in turn, as the decode walks a chunk
 *   kv+ahead     kv, each line asked for 8 KiB ahead into L2 (the decode's read-ahead)
 *   kv+ahead+pv2 kv+ahead, each V block read a second time from cache (p.v's second
 *                pass over Dv 128 at 4 rows)
 *   qk           K read as q.k reads it: 4 rows of 512 bytes, 16 columns of each in turn
 *   qk+ahead     qk with the read-ahead
 *   gcc -O2 -march=native -fopenmp dev/stream_bench.c -o /tmp/stream_bench
 *   OMP_NUM_THREADS=2 /tmp/stream_bench [rounds]
 * GB/s are medians of 5 passes; each round prints every pattern once. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#define BLOCK_FLOATS 16384 /* 64 KiB: 128 keys of D 128 */
#define AHEAD_FLOATS 2048  /* 8 KiB */
#define ROW_FLOATS 128

/* Eight accumulators in registers: four rows' FMAs on 32 floats (two zmm),
 * one chain per row and half. */
#define ACC_DECL                                                                          \
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
  const __m512 q0 = _mm512_set1_ps(1.0f), q1 = _mm512_set1_ps(1.001f), q2 = _mm512_set1_ps(1.002f), \
               q3 = _mm512_set1_ps(1.003f)
#define ACC_SUM _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)), \
                                                   _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7))))
#define FMA4_HALF(v, b0, b1, b2, b3)                                                      \
  (b0 = _mm512_fmadd_ps(q0, v, b0), b1 = _mm512_fmadd_ps(q1, v, b1), b2 = _mm512_fmadd_ps(q2, v, b2), \
   b3 = _mm512_fmadd_ps(q3, v, b3))

/* n floats at x in order; ahead: each line asked for AHEAD_FLOATS on, into L2. */
static float run_block(const float *x, size_t n, int ahead) {
  ACC_DECL;
  for (size_t i = 0; i < n; i += 32) {
    if (ahead) {
      _mm_prefetch((const char *)(x + i + AHEAD_FLOATS), _MM_HINT_T1);
      _mm_prefetch((const char *)(x + i + AHEAD_FLOATS + 16), _MM_HINT_T1);
    }
    const __m512 v0 = _mm512_load_ps(x + i), v1 = _mm512_load_ps(x + i + 16);
    FMA4_HALF(v0, a0, a1, a2, a3);
    FMA4_HALF(v1, a4, a5, a6, a7);
  }
  return ACC_SUM;
}

/* n floats of K rows, four rows at a time, 16 columns of each row in turn. */
static float run_qk_order(const float *x, size_t n, int ahead) {
  ACC_DECL;
  for (size_t r0 = 0; r0 < n; r0 += 4 * ROW_FLOATS)
    for (int col = 0; col < ROW_FLOATS; col += 16)
      for (int j = 0; j < 4; j += 2) {
        const float *p = x + r0 + (size_t)j * ROW_FLOATS + col;
        if (ahead) {
          _mm_prefetch((const char *)(p + AHEAD_FLOATS), _MM_HINT_T1);
          _mm_prefetch((const char *)(p + ROW_FLOATS + AHEAD_FLOATS), _MM_HINT_T1);
        }
        const __m512 v0 = _mm512_load_ps(p), v1 = _mm512_load_ps(p + ROW_FLOATS);
        FMA4_HALF(v0, a0, a1, a2, a3);
        FMA4_HALF(v1, a4, a5, a6, a7);
      }
  return ACC_SUM;
}

enum { PLAIN, FMA4, KV, KV_AHEAD, KV_AHEAD_PV2, QK, QK_AHEAD, PATTERNS };
static const char *const names[PATTERNS] = {"plain", "fma4", "kv", "kv+ahead", "kv+ahead+pv2", "qk", "qk+ahead"};

static float pass(const float *x, size_t n, int pattern) {
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const size_t t = (size_t)omp_get_thread_num(), T = (size_t)omp_get_num_threads();
    const size_t lo = n * t / T / (2 * BLOCK_FLOATS) * (2 * BLOCK_FLOATS);
    const size_t hi = n * (t + 1) / T / (2 * BLOCK_FLOATS) * (2 * BLOCK_FLOATS);
    if (pattern == PLAIN) {
      __m512 a[8];
      for (int r = 0; r < 8; r++) a[r] = _mm512_setzero_ps();
      for (size_t i = lo; i < hi; i += 128)
        for (int r = 0; r < 8; r++) a[r] = _mm512_add_ps(a[r], _mm512_load_ps(x + i + 16 * r));
      for (int r = 1; r < 8; r++) a[0] = _mm512_add_ps(a[0], a[r]);
      total += _mm512_reduce_add_ps(a[0]);
    } else if (pattern == FMA4) {
      total += run_block(x + lo, hi - lo, 0);
    } else if (pattern == QK || pattern == QK_AHEAD) {
      total += run_qk_order(x + lo, hi - lo, pattern == QK_AHEAD);
    } else { /* the first half of the thread's range is K, the second V */
      const size_t half = (hi - lo) / 2;
      const float *K = x + lo, *V = x + lo + half;
      for (size_t o = 0; o < half; o += BLOCK_FLOATS) {
        total += run_block(K + o, BLOCK_FLOATS, pattern != KV);
        total += run_block(V + o, BLOCK_FLOATS, pattern != KV);
        if (pattern == KV_AHEAD_PV2) total += run_block(V + o, BLOCK_FLOATS, 0);
      }
    }
  }
  return total;
}

static int by_value(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 3;
  const size_t bytes = (size_t)640 << 20, n = bytes / sizeof(float);
  float *x = NULL;
  if (posix_memalign((void **)&x, (size_t)2 << 20, bytes)) return 1;
  (void)madvise(x, bytes, MADV_HUGEPAGE);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++) x[i] = (float)(i & 1023) * 1e-3f;
  printf("%d threads, %zu MiB; GB/s (fraction of plain)\n", omp_get_max_threads(), bytes >> 20);
  double sink = 0;
  for (int round = 0; round < rounds; round++) {
    double plain = 0;
    for (int p = 0; p < PATTERNS; p++) {
      double t[5];
      for (int k = 0; k < 5; k++) {
        const double t0 = omp_get_wtime();
        sink += pass(x, n, p);
        t[k] = omp_get_wtime() - t0;
      }
      qsort(t, 5, sizeof t[0], by_value);
      const double gbs = (double)bytes / t[2] * 1e-9;
      if (p == PLAIN) plain = gbs;
      printf("%s %.1f (%.2f)%s", names[p], gbs, gbs / plain, p + 1 < PATTERNS ? " | " : "\n");
    }
  }
  free(x);
  return sink == 0.125; /* keeps the passes */
}
