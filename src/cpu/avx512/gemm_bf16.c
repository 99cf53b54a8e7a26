/* AVX512-BF16 GEMM microkernel: bf16 products summed in fp32 (the contract,
 * attn__bgemm_kernel, is in gemm.h). Compiled with the AVX-512 flags and
 * -mavx512bf16; dispatched only on CPUs that have it.
 *
 * Tile: MR = 12 rows x NR = 32 columns of C in 24 zmm accumulators (two per
 * row), as the fp32 kernel's, but each step takes a pair of k:
 *   Packed A micro-panel: kp x 12 pairs: 32-bit lane (t, i) = A[i][2t], A[i][2t+1].
 *   Packed B micro-panel: kp x 32 pairs: 32-bit lane (t, j) = B[j][2t], B[j][2t+1],
 *   64-byte aligned (aligned loads).
 *   Each pair step t: load B's 32 pairs (two zmm), then for each row i
 *   broadcast A's pair (t, i) and issue two vdpbf16ps: twice the products of
 *   an fp32 FMA per instruction. Every accumulator is one chain of vdpbf16ps
 *   in k order.
 * Packing converts f32 to bf16 (nearest even, NaN kept: attn__f32_to_bf16's
 * rounding, in vector form) while it transposes. */
#include "../gemm.h"
#include "transpose4.h"

#include <immintrin.h>

#define MR 12
#define NR 32

static inline __m512i broadcast_pair(const uint16_t *p) {
  int32_t v;
  memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

static void ukr_avx512bf16(int64_t kp, const uint16_t *Ap, const uint16_t *Bp, float *C, int64_t ldc,
                           const float *init) {
  __m512 c[MR][2];
  if (init) {
    const __m512 i0 = _mm512_loadu_ps(init), i1 = _mm512_loadu_ps(init + 16);
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
      c[i][0] = i0;
      c[i][1] = i1;
    }
  } else {
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
      c[i][0] = _mm512_loadu_ps(C + i * ldc);
      c[i][1] = _mm512_loadu_ps(C + i * ldc + 16);
    }
  }
  for (int64_t t = 0; t < kp; t++) {
    const __m512bh b0 = (__m512bh)_mm512_load_si512(Bp), b1 = (__m512bh)_mm512_load_si512(Bp + 32);
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
      const __m512bh a = (__m512bh)broadcast_pair(Ap + 2 * i);
      c[i][0] = _mm512_dpbf16_ps(c[i][0], a, b0);
      c[i][1] = _mm512_dpbf16_ps(c[i][1], a, b1);
    }
    Ap += 2 * MR;
    Bp += 2 * NR;
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; i++) {
    _mm512_storeu_ps(C + i * ldc, c[i][0]);
    _mm512_storeu_ps(C + i * ldc + 16, c[i][1]);
  }
}

/* 16 floats as bf16 in the upper half of each 32-bit lane: attn__f32_to_bf16. */
static inline __m512i round_bf16_hi(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_mask_mov_epi32(up, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x00400000)));
}

/* 32 consecutive elements of a row (f32 or bf16) as 16 bf16 pairs. */
static inline __m512 load_pairs(const void *x, attn_dtype dt) {
  if (dt == ATTN_BF16) return _mm512_castsi512_ps(_mm512_loadu_si512(x));
  const float *f = x;
  /* the upper halves of both vectors' lanes, in order */
  const __m512i hi = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25,
                                      23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_castsi512_ps(
      _mm512_permutex2var_epi16(round_bf16_hi(_mm512_loadu_ps(f)), hi, round_bf16_hi(_mm512_loadu_ps(f + 16))));
}

/* A micro-panel of r rows (a multiple of 4): per group of 4 rows and 32
 * steps, four rows of 16 pairs, stored transposed; the last kc % 32 steps by
 * the portable loop (from an even step, so pairs stay aligned). */
static inline void pack_pairs4(const void *X, attn_dtype dt, int64_t ld, int64_t kc, int r, uint16_t *P) {
  const size_t es = dt == ATTN_BF16 ? 2 : 4;
  const char *x0 = X;
  int64_t k = 0;
  for (; k + 32 <= kc; k += 32)
    for (int g = 0; g < r; g += 4) {
      const char *x = x0 + (size_t)(g * ld + k) * es;
      const size_t row = (size_t)ld * es;
      attn__store_4x16_transposed(P + k * r + 2 * g, r, load_pairs(x, dt), load_pairs(x + row, dt),
                                  load_pairs(x + 2 * row, dt), load_pairs(x + 3 * row, dt));
    }
  if (k < kc) attn__bgemm_pack_pairs(x0 + (size_t)k * es, dt, ld, r, kc - k, r, P + k * r);
}

static void pack_a_avx512bf16(const void *X, attn_dtype dt, int64_t ld, int64_t kc, uint16_t *P) {
  pack_pairs4(X, dt, ld, kc, MR, P);
}
void attn__bgemm_pack_b32_avx512bf16(const void *X, attn_dtype dt, int64_t ld, int64_t kc, uint16_t *P) {
  pack_pairs4(X, dt, ld, kc, NR, P);
}

/* kc = 512 steps (256 pairs): the B micro-panel is 32 KiB (L1), as the fp32
 * kernel's at half the bytes per step; mc = 192: the A block 192 KiB (L2);
 * nc = 512: the B block 512 KiB (L2/L3). */
const attn__bgemm_kernel attn__bgemm_kernel_avx512bf16 = {"avx512bf16", MR, NR, 512, (192 / MR) * MR, 512,
                                                         ukr_avx512bf16, pack_a_avx512bf16,
                                                         attn__bgemm_pack_b32_avx512bf16, 0, 0, NULL, NULL};
