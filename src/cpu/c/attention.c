/* Portable C microkernels: the contract of kernels.h with plain loops over
 * fixed tile sizes, which compilers vectorise well enough. Builds anywhere. */
#include "../kernels.h"

#include <math.h>

#define MR 8
#define NR 16

static void qk_c(float *S, const float *Q, const float *Kt, int64_t D, int64_t nkeys) {
  (void)nkeys; /* the whole block: the loops are too short to be worth cutting */
  float acc[MR][NR] = {{0}};
  for (int64_t d = 0; d < D; d++) {
    const float *kr = Kt + d * NR;
    for (int r = 0; r < MR; r++) {
      const float qv = Q[r * D + d];
      for (int j = 0; j < NR; j++) acc[r][j] += qv * kr[j];
    }
  }
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NR; j++) S[r * NR + j] = acc[r][j];
}

static void softmax_c(float *S, float *m, float *l, float *alpha) {
  for (int r = 0; r < MR; r++) {
    float *s = S + r * NR;
    float mx = m[r];
    for (int j = 0; j < NR; j++)
      if (isnan(s[j]) || s[j] > mx) mx = s[j];
    if (isnan(m[r])) mx = m[r];
    if (mx == -INFINITY) {
      for (int j = 0; j < NR; j++) s[j] = 0;
      alpha[r] = 1;
      continue;
    }
    float sum = 0;
    for (int j = 0; j < NR; j++) {
      s[j] = expf(s[j] - mx);
      sum += s[j];
    }
    alpha[r] = expf(m[r] - mx);
    l[r] = l[r] * alpha[r] + sum;
    m[r] = mx;
  }
}

static void pv_c(float *O, const float *alpha, const float *P, const float *V, int64_t ldv, int64_t Dv,
                 int64_t nkeys, int sparse) {
  (void)sparse; /* zeros are skipped either way: the branch costs nothing here */
  for (int r = 0; r < MR; r++) {
    float *o = O + r * Dv;
    const float a = alpha[r];
    for (int64_t c = 0; c < Dv; c++) o[c] *= a;
    for (int64_t j = 0; j < nkeys; j++) {
      const float pj = P[r * NR + j];
      if (pj == 0) continue; /* masked keys: their values never reach the output */
      const float *vr = V + j * ldv;
      for (int64_t c = 0; c < Dv; c++) o[c] += pj * vr[c];
    }
  }
}

static void exp_shift_c(float *S, const float *shift) {
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NR; j++) S[r * NR + j] = shift[r] == -INFINITY ? 0.0f : expf(S[r * NR + j] - shift[r]);
}

static void ds_c(const float *P, float *dP, const float *Dd) {
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NR; j++) {
      const float pv = P[r * NR + j];
      dP[r * NR + j] = pv == 0 ? 0.0f : pv * (dP[r * NR + j] - Dd[r]);
    }
}

static void pt_acc_c(float *Out, int64_t ldo, const float *P, const float *X, int64_t ldx, int64_t C) {
  for (int j = 0; j < NR; j++) {
    float *o = Out + j * ldo;
    for (int r = 0; r < MR; r++) {
      const float pj = P[r * NR + j];
      const float *x = X + r * ldx;
      for (int64_t c = 0; c < C; c++) o[c] += pj * x[c];
    }
  }
}

_Static_assert(NR <= ATTN__MAX_NR, "the framework keeps a row of NR keys on the stack");
const attn__cpu_kernels attn__kernels_c = {"c", MR, NR, qk_c, softmax_c, pv_c, exp_shift_c, ds_c, pt_acc_c, NULL, NULL, NULL};

#define DEC_NAME(x) x##_c
#include "../decode_generic.inc"
