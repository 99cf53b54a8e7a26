/* AVX2 + FMA microkernels for the contract in kernels.h (compiled with
 * -mavx2 -mfma -mf16c; called only when the CPU has them).
 *
 * Tile: MR = 6 query rows x NR = 16 keys (two ymm per row): 12 accumulators
 * in qk and pv, leaving registers for the loaded keys/values. exp builds 2^n
 * in the exponent bits, so inputs below -87.3 (and -inf) are forced to 0. */
#include "../kernels.h"

#include <immintrin.h>
#include <math.h>

#define MR 6
#define NR 16

static inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  /* below the smallest normal exponent: exactly 0 (and -inf gives 0, not 1e-38) */
  const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(lo, x); /* NaN stays in x: max returns the second operand on NaN */
  x = _mm256_min_ps(_mm256_set1_ps(88.37626f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  /* n in [-126, 127] after the clamps: (n + 127) << 23 is a valid exponent */
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline float hmax256(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

static inline float hsum256(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

static void qk_avx2(float *S, const float *Q, const float *Kt, int64_t D, int64_t nkeys) {
  (void)nkeys; /* NR = 16: one pass, nothing to skip */
  __m256 a[MR][2];
  for (int r = 0; r < MR; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d++) {
    const __m256 k0 = _mm256_load_ps(Kt + d * NR), k1 = _mm256_load_ps(Kt + d * NR + 8);
    for (int r = 0; r < MR; r++) {
      const __m256 qv = _mm256_broadcast_ss(Q + r * D + d);
      a[r][0] = _mm256_fmadd_ps(qv, k0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(qv, k1, a[r][1]);
    }
  }
  for (int r = 0; r < MR; r++) {
    _mm256_store_ps(S + r * NR, a[r][0]);
    _mm256_store_ps(S + r * NR + 8, a[r][1]);
  }
}

static void softmax_avx2(float *S, float *m, float *l, float *alpha) {
  float mnew[8], mo[8];
  for (int r = 0; r < MR; r++) {
    const __m256 s0 = _mm256_load_ps(S + r * NR), s1 = _mm256_load_ps(S + r * NR + 8);
    float mx = hmax256(_mm256_max_ps(s0, s1));
    /* max may skip a NaN; that only matters when nothing else is visible,
     * since otherwise exp(NaN - max) carries the NaN on */
    if (mx == -INFINITY &&
        _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(s0, s0, _CMP_UNORD_Q), _mm256_cmp_ps(s1, s1, _CMP_UNORD_Q))))
      mx = NAN;
    mnew[r] = (isnan(m[r]) || m[r] > mx) && !isnan(mx) ? m[r] : mx;
    mo[r] = m[r];
  }
  for (int r = MR; r < 8; r++) mnew[r] = mo[r] = 0;
  const __m256 mn = _mm256_loadu_ps(mnew);
  const __m256 empty = _mm256_cmp_ps(mn, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
  const __m256 av = _mm256_blendv_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(mo), mn)), _mm256_set1_ps(1.0f), empty);
  float al[8];
  _mm256_storeu_ps(al, av);
  for (int r = 0; r < MR; r++) {
    float *s = S + r * NR;
    alpha[r] = al[r];
    if (mnew[r] == -INFINITY) {
      _mm256_store_ps(s, _mm256_setzero_ps());
      _mm256_store_ps(s + 8, _mm256_setzero_ps());
      continue;
    }
    const __m256 mv = _mm256_set1_ps(mnew[r]);
    const __m256 p0 = exp256(_mm256_sub_ps(_mm256_load_ps(s), mv));
    const __m256 p1 = exp256(_mm256_sub_ps(_mm256_load_ps(s + 8), mv));
    _mm256_store_ps(s, p0);
    _mm256_store_ps(s + 8, p1);
    l[r] = l[r] * al[r] + hsum256(_mm256_add_ps(p0, p1));
    m[r] = mnew[r];
  }
}

/* Lanes [0, n) of a ymm: a mask for maskload/maskstore at the tail of a row. */
static inline __m256i lanes(int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n > 8 ? 8 : n < 0 ? 0 : n)), idx);
}

/* SPARSE: a zero P adds nothing (its V row may be a hidden key's Inf). The
 * mask costs a compare per row and key, so only tiles with hidden keys pay it. */
static inline __attribute__((always_inline)) void pv_avx2_t(float *O, const float *alpha, const float *P,
                                                            const float *V, int64_t ldv, int64_t Dv, int64_t nkeys,
                                                            const int SPARSE) {
  for (int64_t c0 = 0; c0 < Dv; c0 += 16) {
    const int64_t left = Dv - c0;
    const __m256i m0 = lanes(left), m1 = lanes(left - 8);
    __m256 o[MR][2];
    for (int r = 0; r < MR; r++) {
      const __m256 a = _mm256_set1_ps(alpha[r]);
      o[r][0] = _mm256_mul_ps(_mm256_maskload_ps(O + r * Dv + c0, m0), a);
      o[r][1] = _mm256_mul_ps(_mm256_maskload_ps(O + r * Dv + c0 + 8, m1), a);
    }
    for (int64_t j = 0; j < nkeys; j++) {
      const float *vr = V + j * ldv + c0;
      const __m256 v0 = _mm256_maskload_ps(vr, m0), v1 = _mm256_maskload_ps(vr + 8, m1);
      for (int r = 0; r < MR; r++) {
        const __m256 p = _mm256_broadcast_ss(P + r * NR + j);
        if (SPARSE) { /* o + p * v where p != 0 (NaN counts: it propagates), else o */
          const __m256 nz = _mm256_cmp_ps(p, _mm256_setzero_ps(), _CMP_NEQ_UQ);
          o[r][0] = _mm256_blendv_ps(o[r][0], _mm256_fmadd_ps(p, v0, o[r][0]), nz);
          o[r][1] = _mm256_blendv_ps(o[r][1], _mm256_fmadd_ps(p, v1, o[r][1]), nz);
        } else {
          o[r][0] = _mm256_fmadd_ps(p, v0, o[r][0]);
          o[r][1] = _mm256_fmadd_ps(p, v1, o[r][1]);
        }
      }
    }
    for (int r = 0; r < MR; r++) {
      _mm256_maskstore_ps(O + r * Dv + c0, m0, o[r][0]);
      _mm256_maskstore_ps(O + r * Dv + c0 + 8, m1, o[r][1]);
    }
  }
}

static void pv_avx2(float *O, const float *alpha, const float *P, const float *V, int64_t ldv, int64_t Dv,
                    int64_t nkeys, int sparse) {
  if (sparse) pv_avx2_t(O, alpha, P, V, ldv, Dv, nkeys, 1);
  else pv_avx2_t(O, alpha, P, V, ldv, Dv, nkeys, 0);
}

static void exp_shift_avx2(float *S, const float *shift) {
  for (int r = 0; r < MR; r++) {
    float *s = S + r * NR;
    const __m256 mv = _mm256_set1_ps(shift[r]);
    for (int v = 0; v < NR; v += 8)
      _mm256_store_ps(s + v, shift[r] == -INFINITY ? _mm256_setzero_ps() : exp256(_mm256_sub_ps(_mm256_load_ps(s + v), mv)));
  }
}

static void ds_avx2(const float *P, float *dP, const float *Dd) {
  for (int r = 0; r < MR; r++) {
    const __m256 dd = _mm256_set1_ps(Dd[r]);
    for (int v = 0; v < NR; v += 8) {
      const __m256 pv = _mm256_load_ps(P + r * NR + v);
      const __m256 d = _mm256_mul_ps(pv, _mm256_sub_ps(_mm256_load_ps(dP + r * NR + v), dd));
      _mm256_store_ps(dP + r * NR + v, _mm256_and_ps(_mm256_cmp_ps(pv, _mm256_setzero_ps(), _CMP_NEQ_UQ), d));
    }
  }
}

/* The MR rows of X for 16 columns stay in 12 registers while every key row of Out streams past. */
static void pt_acc_avx2(float *Out, int64_t ldo, const float *P, const float *X, int64_t ldx, int64_t C) {
  for (int64_t c0 = 0; c0 < C; c0 += 16) {
    const __m256i m0 = lanes(C - c0), m1 = lanes(C - c0 - 8);
    __m256 x[MR][2];
    for (int r = 0; r < MR; r++) {
      x[r][0] = _mm256_maskload_ps(X + r * ldx + c0, m0);
      x[r][1] = _mm256_maskload_ps(X + r * ldx + c0 + 8, m1);
    }
    for (int j = 0; j < NR; j++) {
      float *o = Out + j * ldo + c0;
      __m256 a0 = _mm256_maskload_ps(o, m0), a1 = _mm256_maskload_ps(o + 8, m1);
      for (int r = 0; r < MR; r++) {
        const __m256 pv = _mm256_broadcast_ss(P + r * NR + j);
        a0 = _mm256_fmadd_ps(pv, x[r][0], a0);
        a1 = _mm256_fmadd_ps(pv, x[r][1], a1);
      }
      _mm256_maskstore_ps(o, m0, a0);
      _mm256_maskstore_ps(o + 8, m1, a1);
    }
  }
}

_Static_assert(NR <= ATTN__MAX_NR, "the framework keeps a row of NR keys on the stack");
const attn__cpu_kernels attn__kernels_avx2 = {"avx2", MR, NR, qk_avx2, softmax_avx2, pv_avx2, exp_shift_avx2, ds_avx2, pt_acc_avx2, NULL, NULL, NULL};

#define DEC_NAME(x) x##_avx2
#include "../decode_generic.inc"
