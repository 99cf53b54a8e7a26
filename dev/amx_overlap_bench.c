/* Whether the AMX tiles and AVX-512 run side by side: sixteen tdpbf16ps on
 * tiles already loaded (a D = 128 q.k block's products, or a p.v block's), and
 * a softmax-sized piece of vector work (16 rows of 64 floats through the
 * exponential's arithmetic: one FMA and a reduce, five polynomial FMAs, a
 * scalef and a sum per 16 values, as softmax_round does), each alone, then
 * both: the products issued first and the vector work after them (what a
 * FlashAttention-3 schedule would do: the next block's q.k while this block's
 * softmax runs), and one product issued before each row of the vector work.
 * Timed in this thread's CPU time, the four in turn over 15 rounds (best of
 * each), as this host's matrix unit changes speed from minute to minute.
 * If the units overlapped, "both" would cost about the larger of the two; on
 * the model-207 Xeon of BENCHMARKS.md it costs their sum, whichever order.
 *   gcc -O2 -mamx-tile -mamx-bf16 -mavx512f -mavx512dq -mavx512bw -Isrc dev/amx_overlap_bench.c -o /tmp/amxov && /tmp/amxov
 * Linux only (the tile state is asked for with arch_prctl); exits 2 without AMX. */
#include "cpu/amx/tiles.h"

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

enum { CALLS = 20000, ROUNDS = 15, VARIANTS = 4 };
static uint16_t A[16 * 32] __attribute__((aligned(64))), B[16 * 32] __attribute__((aligned(64)));
static float S[16 * 64] __attribute__((aligned(64)));
static uint16_t P[16 * 64] __attribute__((aligned(64)));

/* One row of the vector work: 2^(x c - m) for 64 values, summed and stored as bf16 pairs' bits. */
static inline __attribute__((always_inline)) __m512 row_work(int r, __m512 sum) {
  const __m512 c = _mm512_set1_ps(0.18f), m = _mm512_set1_ps(1.5f);
  for (int v = 0; v < 4; v++) {
    const __m512 t = _mm512_fmsub_ps(_mm512_load_ps(S + r * 64 + 16 * v), c, m);
    const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(0.0018775767f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0089893406f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0558263175f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2401536107f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931530833f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999999404f));
    p = _mm512_maskz_scalef_ps(normal, p, t);
    sum = _mm512_add_ps(sum, p);
    _mm256_store_si256((__m256i *)(P + r * 64 + 16 * v), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16)));
  }
  return sum;
}

#define DP(c, b) _tile_dpbf16ps(c, 4, b)
/* the sixteen products: C tiles 0-3 four times each, B tiles 5 and 6 */
#define SIXTEEN DP(0, 5); DP(1, 6); DP(2, 5); DP(3, 6); DP(0, 5); DP(1, 6); DP(2, 5); DP(3, 6); \
                DP(0, 5); DP(1, 6); DP(2, 5); DP(3, 6); DP(0, 5); DP(1, 6); DP(2, 5); DP(3, 6);

static float run(int variant) {
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < CALLS; i++) {
    switch (variant) {
      case 0: /* vector work alone */
        for (int r = 0; r < 16; r++) sum = row_work(r, sum);
        break;
      case 1: /* products alone */
        SIXTEEN
        break;
      case 2: /* products issued, then the vector work */
        SIXTEEN
        for (int r = 0; r < 16; r++) sum = row_work(r, sum);
        break;
      default: /* one product before each row */
        DP(0, 5); sum = row_work(0, sum); DP(1, 6); sum = row_work(1, sum);
        DP(2, 5); sum = row_work(2, sum); DP(3, 6); sum = row_work(3, sum);
        DP(0, 5); sum = row_work(4, sum); DP(1, 6); sum = row_work(5, sum);
        DP(2, 5); sum = row_work(6, sum); DP(3, 6); sum = row_work(7, sum);
        DP(0, 5); sum = row_work(8, sum); DP(1, 6); sum = row_work(9, sum);
        DP(2, 5); sum = row_work(10, sum); DP(3, 6); sum = row_work(11, sum);
        DP(0, 5); sum = row_work(12, sum); DP(1, 6); sum = row_work(13, sum);
        DP(2, 5); sum = row_work(14, sum); DP(3, 6); sum = row_work(15, sum);
        break;
    }
  }
  _tile_stored(0, S, 64 * 4); /* the products' results are used */
  return _mm512_reduce_add_ps(sum);
}

int main(void) {
  if (!__builtin_cpu_supports("avx512f") || syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) != 0) {
    printf("skipped: no AMX tile state for this process\n");
    return 2;
  }
  unsigned a, b, c, d;
  __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  if (!((d >> 22) & 1)) { /* AMX-BF16 */
    printf("skipped: no AMX-BF16\n");
    return 2;
  }
  attn__amx_begin(); /* the library's configuration: eight tiles of 16 rows x 64 bytes */
  for (int e = 0; e < 16 * 32; e++) A[e] = (uint16_t)(0x3c00 + (e & 63)), B[e] = (uint16_t)(0x3c00 + (e * 7 & 63));
  for (int e = 0; e < 16 * 64; e++) S[e] = (float)(e % 97) * 0.25f - 12.0f;
  _tile_loadd(4, A, 64);
  _tile_loadd(5, B, 64);
  _tile_loadd(6, B, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  double best[VARIANTS];
  float sink = 0;
  for (int v = 0; v < VARIANTS; v++) best[v] = 1e30;
  for (int round = 0; round < ROUNDS; round++)
    for (int v = 0; v < VARIANTS; v++) {
      const double t0 = now();
      sink += run(v);
      const double dt = now() - t0;
      best[v] = dt < best[v] ? dt : best[v];
    }
  attn__amx_end();
  const double vec = best[0] / CALLS * 1e9, tiles = best[1] / CALLS * 1e9;
  printf("vector work alone %.1f ns, 16 tdpbf16ps alone %.1f ns (%.2f ns each)\n", vec, tiles, tiles / 16);
  printf("products then vector work %.1f ns, one product a row %.1f ns; sum of the two alone %.1f, larger %.1f\n",
         best[2] / CALLS * 1e9, best[3] / CALLS * 1e9, vec + tiles, vec > tiles ? vec : tiles);
  return sink == 12345.0f; /* keeps the work */
}
