/* The half-precision tiles alone (kernels.h's attn__half_kernels: qk, the
 * base's softmax, pv) on one tile whose operands stay in L1, each call timed
 * in a loop of its own and then the three in turn, in this thread's CPU time
 * (best of 7 trials); then, for a set with backward tiles, the backward's own
 * calls: pairs of one tile, pt_acc over a group of ATTN__BWD_MAX_ROWS rows,
 * the base's exp_shift and ds on one tile, and t_out of a key block; and for a set with the fused pair
 * (softmax_round, pv_blocks on one block: what OPEN tiles take) those two and the three in turn. It says where a
 * tile's time goes; that the tiles are
 * right is test_half's business (tests/test_half.c amx|avx512bf16).
 *   gcc -O2 -fopenmp -DATTN_STATIC -DATTN_HAVE_X86_KERNELS -DATTN_HAVE_AMX -Iinclude -Ibuild/include -Isrc \
 *       dev/half_tile_bench.c build/libattn.a -lm -o /tmp/htb
 *   /tmp/htb [amx | amx_f16 | avx512bf16] [D]        (D = Dv, a multiple of 32; default amx 64) */
#include "cpu/kernels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

enum { CALLS = 20000, TRIALS = 7 };

typedef struct tile {
  const attn__half_kernels *h;
  uint16_t *Q, *K, *V;
  float *S, *O, *OutT, *Out;
  uint32_t *Pp;
  uint16_t *XT, *Pb;
  float m[ATTN__STAT_LANES] __attribute__((aligned(64))), l[ATTN__STAT_LANES] __attribute__((aligned(64)));
  float alpha[ATTN__STAT_LANES] __attribute__((aligned(64)));
  int64_t D;
} tile;

static void run(tile *t, int which) {
  const attn__half_kernels *h = t->h;
  const int64_t D2 = t->D / 2;
  for (int i = 0; i < CALLS; i++) {
    if (which == 0 || which == 3) h->qk(t->S, t->Q, t->K, D2, h->nr, 0.125f);
    if (which == 1 || which == 3) h->base->softmax(t->S, t->m, t->l, t->alpha);
    if (which == 2 || which == 3) h->pv(t->O, t->alpha, t->S, t->V, t->D, h->nr, 0);
    if (which == 4) h->pt_acc(t->OutT, t->D, t->Pp, ATTN__BWD_MAX_ROWS, t->XT, ATTN__BWD_MAX_ROWS + 32);
    if (which == 8) h->pairs(t->Pp, t->S);
    if (which == 5) h->base->exp_shift(t->S, t->m);
    if (which == 6) h->base->ds(t->S, t->O, t->l);
    if (which == 7) h->t_out(t->Out, t->D, t->OutT, t->D, h->nr, 0.5f);
    if (which == 11) h->qk(t->S, t->Q, t->K, D2, h->nr, 1.0f);
    if (which == 9 || which == 11) h->softmax_round(t->Pb, t->S, 0.125f, t->m, t->l, t->alpha);
    if (which == 10 || which == 11) { /* one block through pv_blocks */
      const uint16_t *pb = t->Pb, *v = t->V;
      const float *a = t->alpha;
      for (int64_t c0 = 0; c0 < t->D; c0 += ATTN__PV_COLS) h->pv_blocks(t->O, t->D, c0, 1, &pb, &a, &v);
    }
  }
}

int main(int argc, char **argv) {
  const char *name = argc > 1 ? argv[1] : "amx";
  const int64_t D = argc > 2 ? atoll(argv[2]) : 64;
  tile t;
  memset(&t, 0, sizeof t);
  attn_kernel need = ATTN_KERNEL_AVX512_BF16;
#ifdef ATTN_HAVE_AMX
  if (!strcmp(name, "amx")) t.h = &attn__half_kernels_amx, need = ATTN_KERNEL_AMX;
  if (!strcmp(name, "amx_f16")) t.h = &attn__half_kernels_amx_f16, need = ATTN_KERNEL_AMX;
#endif
  if (!strcmp(name, "avx512bf16")) t.h = &attn__half_kernels_avx512bf16;
  if (!t.h || D < 32 || D > 512 || D % 32) {
    fprintf(stderr, "usage: %s [amx | amx_f16 | avx512bf16] [D, a multiple of 32 up to 512]\n", argv[0]);
    return 2;
  }
  if (!attn_kernel_supported(need)) { /* also asks Linux for the tile state */
    printf("skipped: this CPU lacks %s\n", attn_kernel_name(need));
    return 0;
  }
  const int mr = t.h->mr, nr = t.h->nr, terms = t.h->terms;
  t.D = D;
  t.Q = aligned_alloc(64, (size_t)(mr * D * 2 * terms));
  t.K = aligned_alloc(64, (size_t)(nr * D * 2 * terms));
  t.V = aligned_alloc(64, (size_t)(nr * D * 2 * terms));
  t.S = aligned_alloc(64, (size_t)(mr * nr * 4));
  t.O = aligned_alloc(64, (size_t)(mr * D * 4));
  /* bf16 values near 1 (0x3f80) and a little less: finite logits, a settled running max */
  for (int64_t e = 0; e < mr * D * terms; e++) t.Q[e] = (uint16_t)(0x3c00 + (e & 63));
  for (int64_t e = 0; e < nr * D * terms; e++) t.K[e] = (uint16_t)(0x3c00 + (e * 7 & 63));
  for (int64_t e = 0; e < nr * D * terms; e++) t.V[e] = (uint16_t)(0x3f00 + (e & 31));
  memset(t.O, 0, (size_t)(mr * D * 4));
  const int64_t G = ATTN__BWD_MAX_ROWS;
  t.Pp = aligned_alloc(64, (size_t)(G / 2 * nr * 4 * terms)); /* terms 2: the lo pairs after the hi ones */
  t.OutT = aligned_alloc(64, (size_t)(D * nr * 4));
  t.Out = aligned_alloc(64, (size_t)(D * nr * 4));
  t.XT = aligned_alloc(64, (size_t)(D * (G + 32) * 2 * terms));
  for (int64_t e = 0; e < G / 2 * nr * terms; e++) t.Pp[e] = 0x3c003c00u + (uint32_t)(e % 61);
  for (int64_t e = 0; e < D * (G + 32) * terms; e++) t.XT[e] = (uint16_t)(0x3c00 + (e & 63));
  memset(t.OutT, 0, (size_t)(D * nr * 4));
  t.Pb = aligned_alloc(64, (size_t)(mr * nr * 2 * terms)); /* terms 2: softmax_round's lo plane after the hi one */
  for (int64_t e = 0; e < mr * nr * terms; e++) t.Pb[e] = (uint16_t)(0x3c00 + (e & 63));
  for (int r = 0; r < ATTN__STAT_LANES; r++) t.m[r] = -INFINITY, t.l[r] = 0, t.alpha[r] = 1;
  if (t.h->begin) t.h->begin();
  static const char *what[12] = {"qk", "softmax", "pv", "all three", "pt_acc", "exp_shift", "ds", "t_out", "pairs",
                                 "softmax_round", "pv_blocks", "fused three"};
  double ns[12];
  for (int w = 0; w < 12; w++) {
    if ((w >= 4 && w < 9 && !t.h->pt_acc) || (w >= 9 && !t.h->softmax_round)) continue;
    double best = 1e30;
    for (int k = 0; k < TRIALS; k++) {
      const double t0 = now();
      run(&t, w);
      const double dt = now() - t0;
      best = dt < best ? dt : best;
    }
    ns[w] = best / CALLS * 1e9;
  }
  if (t.h->end) t.h->end();
  const double flops = 4.0 * mr * nr * (double)D;
  printf("%s, %d x %d tile, D = Dv = %lld:", t.h->name, mr, nr, (long long)D);
  for (int w = 0; w < 4; w++) printf(" %s %.1f ns%s", what[w], ns[w], w < 3 ? "," : "");
  printf(" (%.0f GFLOP/s on one core)\n", flops / ns[3]);
  if (t.h->softmax_round)
    printf("fused (OPEN tiles): qk unscaled, softmax_round %.1f ns, pv_blocks (1 block) %.1f ns, the three %.1f ns (%.0f GFLOP/s)\n",
           ns[9], ns[10], ns[11], flops / ns[11]);
  if (t.h->pt_acc)
    printf("backward: pairs %.1f ns, pt_acc (%lld rows) %.1f ns, exp_shift %.1f ns, ds %.1f ns, t_out %.1f ns\n", ns[8],
           (long long)G, ns[4], ns[5], ns[6], ns[7]);
  free(t.Q), free(t.K), free(t.V), free(t.S), free(t.O), free(t.Pp), free(t.OutT), free(t.Out), free(t.XT), free(t.Pb);
  return 0;
}
