/* The decode microkernels alone (kernels.h's attn__decode_kernels: qk, then
 * the softmax step and p.v), on 16 blocks of 128 keys that stay in L2, timed
 * in this thread's CPU time (best of 15 trials), so that the machine's other
 * load moves the figures less than it moves a whole step's wall time. The
 * unit beside the nanoseconds is a zmm FMA at full rate, measured here: at
 * rows x (D + Dv) / 16 FMAs per key, that is the floor.
 *   gcc -O2 -fopenmp -DATTN_STATIC -DATTN_HAVE_X86_KERNELS -Iinclude -Ibuild/include -Isrc \
 *       dev/decode_kernel_bench.c build/libattn.a -lm -o /tmp/dkb
 *   /tmp/dkb q8_0 4 [D] [kernel: avx512 | avx512_l2 | avx2 | c]
 * With DKB_BLOCKS set (below), also each block's qk then its pv in turn, as a decode step runs them.        (dtype f32, f16, q8_0, q4_0; rows 1..8; D = Dv, 32..256) */
#include "cpu/kernels.h"
#include "quant.h"

#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Seconds per zmm FMA at full rate: twelve independent chains. */
__attribute__((target("avx512f"))) static double fma_seconds(void) {
  __m512 a0 = _mm512_set1_ps(0), a1 = _mm512_set1_ps(1), a2 = _mm512_set1_ps(2), a3 = _mm512_set1_ps(3);
  __m512 a4 = _mm512_set1_ps(4), a5 = _mm512_set1_ps(5), a6 = _mm512_set1_ps(6), a7 = _mm512_set1_ps(7);
  __m512 a8 = _mm512_set1_ps(8), a9 = _mm512_set1_ps(9), a10 = _mm512_set1_ps(10), a11 = _mm512_set1_ps(11);
  const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(0.001f);
  double best = 1e9;
  for (int t = 0; t < 5; t++) {
    const double t0 = now();
    for (long i = 0; i < 2000000; i++) {
      a0 = _mm512_fmadd_ps(a0, b, c), a1 = _mm512_fmadd_ps(a1, b, c), a2 = _mm512_fmadd_ps(a2, b, c);
      a3 = _mm512_fmadd_ps(a3, b, c), a4 = _mm512_fmadd_ps(a4, b, c), a5 = _mm512_fmadd_ps(a5, b, c);
      a6 = _mm512_fmadd_ps(a6, b, c), a7 = _mm512_fmadd_ps(a7, b, c), a8 = _mm512_fmadd_ps(a8, b, c);
      a9 = _mm512_fmadd_ps(a9, b, c), a10 = _mm512_fmadd_ps(a10, b, c), a11 = _mm512_fmadd_ps(a11, b, c);
    }
    const double d = now() - t0;
    if (d < best) best = d;
  }
  const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                 _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)),
                                               _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11))));
  if (_mm512_reduce_add_ps(s) == 12345.0f) puts("");
  return best / (2000000.0 * 12);
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s f32|f16|q8_0|q4_0 rows [D] [avx512|avx512_l2|avx2|c]\n", argv[0]);
    return 2;
  }
  const attn_dtype dt = !strcmp(argv[1], "q8_0")  ? ATTN__Q8_0
                        : !strcmp(argv[1], "q4_0") ? ATTN__Q4_0
                        : !strcmp(argv[1], "f16")  ? ATTN_F16
                                                   : ATTN_F32;
  /* DKB_BLOCKS=N: N blocks of 128 keys instead of 16, each timed once: with N = 2048 the keys stream from
   * past L2 (in q8_0, 71 MB: from the L3 on a Xeon whose L3 is 480 MiB), as a decode step reads them */
  const int NB = getenv("DKB_BLOCKS") ? atoi(getenv("DKB_BLOCKS")) : 16, reps = NB > 16 ? 1 : 30;
  if (NB < 1) {
    fprintf(stderr, "DKB_BLOCKS: at least 1\n");
    return 2;
  }
  const int rows = atoi(argv[2]);
  const int64_t D = argc > 3 ? atoll(argv[3]) : 128;
  const char *kn = argc > 4 ? argv[4] : "avx512";
  const attn__decode_kernels *dk = !strcmp(kn, "c")      ? &attn__decode_kernels_c
                                   : !strcmp(kn, "avx2") ? &attn__decode_kernels_avx2
                                   : !strcmp(kn, "avx512_l2") ? &attn__decode_kernels_avx512_l2
                                                         : &attn__decode_kernels_avx512;
  if (rows < 1 || rows > 8 || D < 32 || D > 256 || D % 32) {
    fprintf(stderr, "rows 1..8, D 32..256 in steps of 32\n");
    return 2;
  }
  const size_t rb = attn__row_bytes(dt, D), n = rb * 128 * NB;
  uint8_t *K = aligned_alloc(64, n + 64), *V = aligned_alloc(64, n + 64);
  for (size_t i = 0; i < n; i++) K[i] = (uint8_t)(i * 37 + 11), V[i] = (uint8_t)(i * 53 + 7);
  if (attn__is_quant(dt)) /* scales of 2^-3 (f16 0x3000): finite sums */
    for (size_t j = 0; j < n / attn__qblock_bytes(dt); j++) {
      const size_t o = j * attn__qblock_bytes(dt);
      K[o] = V[o] = 0x00, K[o + 1] = V[o + 1] = 0x30;
    }
  else if (dt == ATTN_F16)
    for (size_t i = 0; i < n / 2; i++) ((uint16_t *)K)[i] = ((uint16_t *)V)[i] = (uint16_t)(0x3000 + i % 512);
  else
    for (size_t i = 0; i < n / 4; i++) ((float *)K)[i] = ((float *)V)[i] = (float)(i % 13) * 0.01f;
  static float Q[8 * 256], S0[8 * ATTN__DEC_NB], S[8 * ATTN__DEC_NB], O[8 * 256]; /* Q, O: rows x D; S: rows x 128 */
  float m[8], l[8];
  for (int i = 0; i < 8 * 256; i++) Q[i] = (float)(i % 7) * 0.01f;
  for (int i = 0; i < 8 * ATTN__DEC_NB; i++) S0[i] = 0.01f * (float)(i % 17);
  const int64_t ld = attn__is_quant(dt) ? (int64_t)rb : D;
  double bq = 1e9, bp = 1e9, bi = 1e9;
  for (int trial = 0; trial < 15; trial++) {
    const double t0 = now();
    for (int r = 0; r < reps; r++)
      for (int b = 0; b < NB; b++) dk->qk(S, Q, rows, K + rb * 128 * b, ld, 128, D, dt, NULL);
    const double t1 = now();
    for (int r = 0; r < reps; r++) {
      for (int i = 0; i < rows; i++) m[i] = -INFINITY, l[i] = 0;
      for (int b = 0; b < NB; b++) {
        memcpy(S, S0, sizeof S0);
        dk->pv(O, m, l, S, rows, V + rb * 128 * b, ld, 128, D, dt, 0, NULL);
      }
    }
    const double t2 = now();
    if (t1 - t0 < bq) bq = t1 - t0;
    if (t2 - t1 < bp) bp = t2 - t1;
    if (getenv("DKB_BLOCKS")) { /* also as decode.c calls them: each block's qk, then its pv */
      for (int i = 0; i < rows; i++) m[i] = -INFINITY, l[i] = 0;
      for (int b = 0; b < NB; b++) {
        dk->qk(S, Q, rows, K + rb * 128 * b, ld, 128, D, dt, NULL);
        memcpy(S, S0, sizeof S0);
        dk->pv(O, m, l, S, rows, V + rb * 128 * b, ld, 128, D, dt, 0, NULL);
      }
      const double t3 = now();
      if (t3 - t2 < bi) bi = t3 - t2;
    }
  }
  if (getenv("DKB_BLOCKS")) printf("in turn: %.2f ns/key\n", bi / ((double)NB * 128) * 1e9);
  const double keys = (double)reps * NB * 128, f = fma_seconds();
  printf("%s %s rows %d D %lld: qk %.2f ns/key, softmax+pv %.2f ns/key (%.1f + %.1f zmm FMA times of %.3f ns; "
         "the FMAs alone: %lld + %lld)\n",
         kn, argv[1], rows, (long long)D, bq / keys * 1e9, bp / keys * 1e9, bq / keys / f, bp / keys / f, f * 1e9,
         (long long)(rows * D / 16), (long long)(rows * D / 16));
  free(K), free(V);
  return O[0] == 12345.0f;
}
