/* A lab for one idea not taken: q8_0 decode dot products (q . k over a
 * KV cache's 32-value blocks) on AMX-INT8 instead of the AVX-512 decode qk,
 * which widens every block to fp32 and spends most of its time on vector
 * uops (dev/decode_kernel_bench.c).
 *
 * The variant: each query row's block of 32 values becomes four int8 terms
 * over a power-of-two scale 2^e (max |q| / 2^e in [64, 128)): a_1 = rint(x),
 * then a_t = rint of the remainder times 128, so the terms carry the query to
 * 2^-28 of its largest value, and tdpbssd's int32 sums are exact. The A tiles
 * are the cache's own bytes (16 keys' blocks, ldk apart: nothing is widened
 * or copied); the B tile is the query terms, column t * 4 + r for row r and
 * term t. Each block's scale differs per key, so every block has a C tile of
 * its own, stored after one tdpbssd of K = 32, and the AVX-512 then does
 * S += d_k * (float(C) * w) per block and sums the terms.
 *
 * Measured (Intel Xeon, lscpu family 6 model 207, AMX-INT8; one thread, 16
 * blocks of 128 keys in L2; rows 4, D 128; `dev/decode_amx_int8_lab 4 128`):
 * accurate (rel L2 5e-8 against a float64 reference, AVX-512 8e-8), but
 * 22-37 ns a key against 16-21 for the AVX-512 qk (two runs minutes apart,
 * 2026-12-06, the host's AMX rate moving 2x between them; rows 1:
 * 27 against 12); the tiles alone (-DTILES_ONLY) take 11-17 ns a key: one
 * tdpbssd and one tile store per block of each 16 keys, which do not
 * overlap, and the AVX-512 work after them (a scale per key and block, the
 * terms' sum) costs about what widening the blocks did. Not taken: the
 * per-block scales of K leave each C tile one product to sum before its
 * store. (For V the scales could fold into P, so C tiles would sum 64 keys a
 * product; not tried: P would need its own int8 terms per 32 columns.)
 *   gcc -O2 -fopenmp -DATTN_STATIC -DATTN_HAVE_X86_KERNELS -Iinclude -Ibuild/include -Isrc \
 *       dev/decode_amx_int8_lab.c build/libattn.a -lm -o /tmp/decode_amx_int8_lab
 *   /tmp/decode_amx_int8_lab [rows 1..4] [D, a multiple of 32, at most 256] */
#include "cpu/amx/tiles.h"
#include "cpu/kernels.h"
#include "internal.h"
#include "quant.h"

#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define AMX_INT8 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,amx-tile,amx-int8")))

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* tiles 0-3: C (16 keys x 16 int32); 4-5: A (16 keys x 32 int8); 6-7: B (8 groups of 4 x 16 columns) */
static const attn__amx_config config __attribute__((aligned(64))) = {
    .palette = 1, .colsb = {64, 64, 64, 64, 32, 32, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 8, 8}};

enum { NB = 128, MAX_D = 256, TERMS = 4, BLOCKS = 16 };
static int8_t Bq[MAX_D / 32][8][64] __attribute__((aligned(64))); /* [block][group][column * 4 + e] */
static float W[MAX_D / 32][16] __attribute__((aligned(64)));      /* [block][column]: the term's weight */

/* Q (rows, D) as the B tiles' int8 terms and their weights. */
static void split_q(const float *Q, int rows, int64_t D) {
  memset(Bq, 0, sizeof Bq);
  memset(W, 0, sizeof W);
  for (int64_t b = 0; b < D / 32; b++)
    for (int r = 0; r < rows; r++) {
      float mx = 0, x[32];
      for (int i = 0; i < 32; i++) mx = fmaxf(mx, fabsf(Q[r * D + b * 32 + i]));
      int e = 0;
      if (mx > 0) {
        frexpf(mx, &e);
        e -= 7;
      }
      for (int i = 0; i < 32; i++) x[i] = ldexpf(Q[r * D + b * 32 + i], -e);
      for (int t = 0; t < TERMS; t++) {
        for (int i = 0; i < 32; i++) {
          const float a = rintf(x[i]);
          Bq[b][i / 4][(t * 4 + r) * 4 + i % 4] = (int8_t)a;
          x[i] = (x[i] - a) * 128.0f; /* exact: x - a has x's exponent at most */
        }
        W[b][t * 4 + r] = ldexpf(1.0f, e - 7 * t);
      }
    }
}

/* S[r][j] (rows ATTN__DEC_NB apart) = Q[r] . K[j] for the query split_q last took, nkeys a multiple of 16. */
AMX_INT8 static void qk_int8(float *S, const uint8_t *K, int64_t ldk, int nkeys, int64_t D, int rows) {
  const int nb = (int)(D / 32);
  int32_t C[4][16][16] __attribute__((aligned(64)));
  float dk[16][8] __attribute__((aligned(32)));
  for (int j0 = 0; j0 < nkeys; j0 += 16) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int b0 = 0; b0 < nb; b0 += 4) {
      const int n4 = nb - b0 < 4 ? nb - b0 : 4;
      for (int q = 0; q < n4; q++) {
        const uint8_t *a = K + j0 * ldk + (b0 + q) * 34 + 2;
        switch (q) { /* tile numbers are immediates */
          case 0: _tile_zero(0); _tile_loadd(4, a, ldk); _tile_loadd(6, Bq[b0], 64); _tile_dpbssd(0, 4, 6); break;
          case 1: _tile_zero(1); _tile_loadd(5, a, ldk); _tile_loadd(7, Bq[b0 + 1], 64); _tile_dpbssd(1, 5, 7); break;
          case 2: _tile_zero(2); _tile_loadd(4, a, ldk); _tile_loadd(6, Bq[b0 + 2], 64); _tile_dpbssd(2, 4, 6); break;
          default: _tile_zero(3); _tile_loadd(5, a, ldk); _tile_loadd(7, Bq[b0 + 3], 64); _tile_dpbssd(3, 5, 7);
        }
      }
#ifndef TILES_ONLY
      for (int j = 0; j < 16; j++) {
        uint16_t h[8] = {0};
        for (int q = 0; q < n4; q++) memcpy(&h[q], K + (j0 + j) * ldk + (b0 + q) * 34, 2);
        _mm256_store_ps(dk[j], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)));
      }
#endif
      _tile_stored(0, C[0], 64);
      if (n4 > 1) _tile_stored(1, C[1], 64);
      if (n4 > 2) _tile_stored(2, C[2], 64);
      if (n4 > 3) _tile_stored(3, C[3], 64);
#ifndef TILES_ONLY
      for (int q = 0; q < n4; q++) {
        const __m512 w = _mm512_load_ps(W[b0 + q]);
        for (int j = 0; j < 16; j++)
          acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(C[q][j])), w),
                                   _mm512_set1_ps(dk[j][q]), acc[j]);
      }
#endif
    }
    float St[16][4] __attribute__((aligned(16)));
    for (int j = 0; j < 16; j++) { /* the four terms of row r are lanes r, r + 4, r + 8, r + 12 */
      __m512 x = _mm512_add_ps(acc[j], _mm512_shuffle_f32x4(acc[j], acc[j], 0x4E));
      x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));
      _mm_store_ps(St[j], _mm512_castps512_ps128(x));
    }
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < 16; j++) S[r * ATTN__DEC_NB + j0 + j] = St[j][r];
  }
}

AMX_INT8 int main(int argc, char **argv) {
  const int rows = argc > 1 ? atoi(argv[1]) : 4;
  const int64_t D = argc > 2 ? atoi(argv[2]) : 128;
  if (rows < 1 || rows > 4 || D < 32 || D > MAX_D || D % 32) {
    fprintf(stderr, "usage: %s [rows 1..4] [D: 32..%d, a multiple of 32]\n", argv[0], MAX_D);
    return 2;
  }
  if (!attn__cpu_has(ATTN_KERNEL_AMX) || !__builtin_cpu_supports("amx-int8")) {
    fprintf(stderr, "this CPU (or OS) lacks AMX-INT8\n");
    return 77;
  }
  const int64_t ldk = D / 32 * 34;
  uint8_t *K = malloc((size_t)(BLOCKS * NB * ldk));
  float *row = malloc(sizeof(float) * (size_t)D), *Q = malloc(sizeof(float) * (size_t)(rows * D));
  static float S_avx512[8 * ATTN__DEC_NB], S_amx[8 * ATTN__DEC_NB];
  srand(1);
  for (int j = 0; j < BLOCKS * NB; j++) {
    for (int64_t i = 0; i < D; i++) row[i] = (float)rand() / (float)RAND_MAX * 2 - 1;
    attn__quantize_row(ATTN__Q8_0, K + j * ldk, row, D);
  }
  for (int64_t i = 0; i < rows * D; i++) Q[i] = ((float)rand() / (float)RAND_MAX * 2 - 1) * 0.1f;
  const attn__decode_kernels *dk = &attn__decode_kernels_avx512_l2;
  _tile_loadconfig(&config);
  split_q(Q, rows, D);
  double e_avx512 = 0, e_amx = 0, norm = 0;
  for (int b = 0; b < BLOCKS; b++) {
    dk->qk(S_avx512, Q, rows, K + b * NB * ldk, ldk, NB, D, ATTN__Q8_0, NULL);
    qk_int8(S_amx, K + b * NB * ldk, ldk, NB, D, rows);
    for (int j = 0; j < NB; j++) {
      attn__dequantize_row(ATTN__Q8_0, row, K + (b * NB + j) * ldk, D);
      for (int r = 0; r < rows; r++) {
        double s = 0;
        for (int64_t i = 0; i < D; i++) s += (double)Q[r * D + i] * row[i];
        const double d1 = S_avx512[r * ATTN__DEC_NB + j] - s, d2 = S_amx[r * ATTN__DEC_NB + j] - s;
        e_avx512 += d1 * d1, e_amx += d2 * d2, norm += s * s;
      }
    }
  }
  printf("rel L2 against float64: avx512 %.2e, amx-int8 %.2e\n", sqrt(e_avx512 / norm), sqrt(e_amx / norm));
  for (int rep = 0; rep < 3; rep++) {
    double best_avx512 = 1e9, best_amx = 1e9;
    for (int trial = 0; trial < 15; trial++) {
      const double t0 = now();
      for (int b = 0; b < BLOCKS; b++) dk->qk(S_avx512, Q, rows, K + b * NB * ldk, ldk, NB, D, ATTN__Q8_0, NULL);
      const double t1 = now();
      split_q(Q, rows, D);
      for (int b = 0; b < BLOCKS; b++) qk_int8(S_amx, K + b * NB * ldk, ldk, NB, D, rows);
      const double t2 = now();
      best_avx512 = fmin(best_avx512, t1 - t0), best_amx = fmin(best_amx, t2 - t1);
    }
    printf("rows %d D %ld: avx512 qk %.2f ns a key, amx-int8 qk %.2f ns a key\n", rows, (long)D,
           best_avx512 / (BLOCKS * NB) * 1e9, best_amx / (BLOCKS * NB) * 1e9);
  }
  _tile_release();
  free(K), free(row), free(Q);
  return 0;
}
