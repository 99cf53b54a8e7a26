/* attn-mpi-bench: times attn_mpi_sdpa (and its backward) under mpirun.
 *   mpirun -np P attn-mpi-bench --seq N [--batch B] [--heads H] [--kv-heads G] [--dim D]
 *          [--causal] [--strategy ring|zigzag|ulysses|auto|none|link] [--threads T] [--backward]
 *          [--repeat R] [--json]
 * Every rank holds its shard of random f32 q, k, v (ZIGZAG: its two chunks;
 * else N / P tokens each, the first N % P ranks one more). A step starts
 * after a barrier and ends when the slowest rank is done (the max over ranks
 * of each step's time); the median of R steps is reported with the useful
 * GFLOP/s of the whole sequence (4 B Hq N^2 D forward, causal half of it;
 * the backward counts 2.5 times the forward's). --strategy none calls
 * attn_sdpa and attn_sdpa_backward on each rank's own shard alone, no
 * communication: with -np 1 the whole sequence (the single-process baseline;
 * run it with mpirun's --bind-to none for T > 1), with -np P the rate a rank
 * computes one ring block at while the others do too (the cost model's F;
 * GFLOP/s then counts the P blocks). --strategy link times the link alone:
 * every rank sends one ring block (K and V of its shard, f32) to the next
 * rank and receives one from the previous (MPI_Sendrecv), and the rate is
 * the block's bytes over the median step (the cost model's link bandwidth). */
#include "attn_mpi.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static int fail(int rank, const char *msg) {
  if (rank == 0) fprintf(stderr, "attn-mpi-bench: %s\n", msg);
  MPI_Finalize();
  return 2;
}

int main(int argc, char **argv) {
  int level, rank, P; /* SERIALIZED: libattn_mpi's helper thread moves the ring's blocks during the computation */
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &level);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  int64_t N = 4096, B = 1, H = 8, G = 0, D = 64;
  int causal = 0, threads = 1, backward = 0, repeat = 5, json = 0;
  attn_mpi_strategy strategy = ATTN_MPI_AUTO;
  int single = 0, link = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--causal")) causal = 1;
    else if (!strcmp(a, "--backward")) backward = 1;
    else if (!strcmp(a, "--json")) json = 1;
    else if (v && !strcmp(a, "--seq")) N = atoll(v), i++;
    else if (v && !strcmp(a, "--batch")) B = atoll(v), i++;
    else if (v && !strcmp(a, "--heads")) H = atoll(v), i++;
    else if (v && !strcmp(a, "--kv-heads")) G = atoll(v), i++;
    else if (v && !strcmp(a, "--dim")) D = atoll(v), i++;
    else if (v && !strcmp(a, "--threads")) threads = atoi(v), i++;
    else if (v && !strcmp(a, "--repeat")) repeat = atoi(v), i++;
    else if (v && !strcmp(a, "--strategy")) {
      strategy = !strcmp(v, "ring")      ? ATTN_MPI_RING
                 : !strcmp(v, "zigzag")  ? ATTN_MPI_ZIGZAG
                 : !strcmp(v, "ulysses") ? ATTN_MPI_ULYSSES
                 : !strcmp(v, "auto")    ? ATTN_MPI_AUTO
                 : !strcmp(v, "none")    ? ATTN_MPI_RING
                 : !strcmp(v, "link")    ? ATTN_MPI_RING
                                         : (attn_mpi_strategy)-1;
      single = !strcmp(v, "none"), link = !strcmp(v, "link");
      if ((int)strategy < 0) return fail(rank, "--strategy takes ring, zigzag, ulysses, auto, none or link");
      i++;
    } else {
      char m[160];
      snprintf(m, sizeof m, "unknown or incomplete argument '%s' (see the comment at the top of tools/mpi_bench.c)", a);
      return fail(rank, m);
    }
  }
  if (!G) G = H;
  if (N < 1 || B < 1 || H < 1 || G < 1 || H % G || D < 1 || repeat < 1 || threads < 1 || N > ((int64_t)1 << 24))
    return fail(rank, "sizes must be positive (heads a multiple of kv-heads, seq <= 2^24)");
  int64_t rg[4] = {0, 0, 0, 0};
  attn_mpi_shard_range(strategy, N, P, rank, rg);
  const int64_t n = rg[1] - rg[0] + rg[3] - rg[2];
  const size_t link_bytes = link ? (size_t)(2 * B * G * n * D) * 4 : 0; /* K and V of the shard, f32 */
  if (link_bytes > (size_t)INT32_MAX) return fail(rank, "--strategy link: a block passes 2 GiB");
  char *link_buf = link ? calloc(2, link_bytes) : NULL;
  if (link && !link_buf) return fail(rank, "out of memory");
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx) != ATTN_OK || attn_ctx_set_threads(ctx, threads) != ATTN_OK) return fail(rank, "context");
  const int64_t sq[4] = {B, H, n, D}, skv[4] = {B, G, n, D}, sl[3] = {B, H, n};
  attn_tensor q, k, v, out, lse, dq, dk, dv, g;
  if (attn_tensor_alloc(ctx, &q, ATTN_F32, 4, sq) || attn_tensor_alloc(ctx, &k, ATTN_F32, 4, skv) ||
      attn_tensor_alloc(ctx, &v, ATTN_F32, 4, skv) || attn_tensor_alloc(ctx, &out, ATTN_F32, 4, sq) ||
      attn_tensor_alloc(ctx, &lse, ATTN_F32, 3, sl) || attn_tensor_alloc(ctx, &dq, ATTN_F32, 4, sq) ||
      attn_tensor_alloc(ctx, &dk, ATTN_F32, 4, skv) || attn_tensor_alloc(ctx, &dv, ATTN_F32, 4, skv) ||
      attn_tensor_alloc(ctx, &g, ATTN_F32, 4, sq))
    return fail(rank, "out of memory");
  uint64_t s = 0x9e3779b97f4a7c15ull * (uint64_t)(rank + 1);
  attn_tensor *fill[4] = {&q, &k, &v, &g};
  for (int t = 0; t < 4; t++)
    for (int64_t i = 0, count = attn_tensor_numel(fill[t]); i < count; i++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      ((float *)fill[t]->data)[i] = (float)((double)(s >> 40) / (double)(1 << 24) - 0.5);
    }
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.causal = causal ? ATTN_CAUSAL_TOP_LEFT : ATTN_CAUSAL_NONE;
  double *times = calloc((size_t)repeat, sizeof *times);
  for (int r = -1; r < repeat; r++) { /* one warm-up step */
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    if (link) /* one message, as the ring sends a block (each message pays a handshake) */
      MPI_Sendrecv(link_buf, (int)link_bytes, MPI_BYTE, (rank + 1) % P, 1, link_buf + link_bytes, (int)link_bytes,
                   MPI_BYTE, (rank - 1 + P) % P, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    attn_status st = link     ? ATTN_OK
                     : single ? attn_sdpa(ctx, &out, &lse, NULL, &q, &k, &v, &o)
                            : attn_mpi_sdpa(ctx, MPI_COMM_WORLD, strategy, &out, &lse, &q, &k, &v, &o);
    if (!st && backward && !link)
      st = single ? attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, &g, &q, &k, &v, &out, &lse, &o)
                  : attn_mpi_sdpa_backward(ctx, MPI_COMM_WORLD, strategy, &dq, &dk, &dv, NULL, &g, &q, &k, &v, &out,
                                           &lse, &o);
    if (st) {
      if (rank == 0) fprintf(stderr, "attn-mpi-bench: %s\n", attn_ctx_error(ctx));
      MPI_Finalize();
      return 1;
    }
    double dt = MPI_Wtime() - t0, worst;
    MPI_Allreduce(&dt, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (r >= 0) times[r] = worst;
  }
  qsort(times, (size_t)repeat, sizeof *times, cmp);
  const double med = times[repeat / 2];
  /* single with P ranks: P blocks of n tokens (n the largest shard) */
  const double tokens2 = single && P > 1 ? (double)P * (double)n * (double)n : (double)N * (double)N;
  const double flops = 4.0 * (double)B * (double)H * tokens2 * (double)D * (causal ? 0.5 : 1.0) * (backward ? 3.5 : 1.0);
  if (rank == 0 && link) {
    const double bytes = (double)link_bytes;
    if (json)
      printf("{\"op\": \"link\", \"ranks\": %d, \"seq\": %lld, \"batch\": %lld, \"kv_heads\": %lld, \"dim\": %lld, "
             "\"bytes\": %.0f, \"median_s\": %.6g, \"min_s\": %.6g, \"gbytes\": %.4g}\n",
             P, (long long)N, (long long)B, (long long)G, (long long)D, bytes, med, times[0], bytes / med * 1e-9);
    else
      printf("%d ranks, a ring block of %.1f MB (N %lld): median %.4f s (min %.4f), %.3f GB/s a link\n", P, bytes * 1e-6,
             (long long)N, med, times[0], bytes / med * 1e-9);
  } else if (rank == 0) {
    const attn_mpi_strategy ran = strategy == ATTN_MPI_AUTO ? attn_mpi_auto_strategy(G, P, &o) : strategy;
    const char *name = single ? "none" : attn_mpi_strategy_name(ran);
    if (json)
      printf("{\"op\": \"mpi_sdpa\", \"ranks\": %d, \"threads\": %d, \"strategy\": \"%s\", \"seq\": %lld, \"batch\": %lld, "
             "\"heads\": %lld, \"kv_heads\": %lld, \"dim\": %lld, \"causal\": %d, \"backward\": %d, \"median_s\": %.6g, "
             "\"min_s\": %.6g, \"gflops\": %.4g}\n",
             P, threads, name, (long long)N, (long long)B, (long long)H, (long long)G,
             (long long)D, causal, backward, med, times[0], flops / med * 1e-9);
    else
      printf("%d ranks x %d threads, %s, N %lld B %lld H %lld/%lld D %lld%s%s: median %.4f s (min %.4f), %.1f GFLOP/s\n",
             P, threads, name, (long long)N, (long long)B, (long long)H, (long long)G,
             (long long)D, causal ? " causal" : "", backward ? " fwd+bwd" : "", med, times[0], flops / med * 1e-9);
  }
  free(times), free(link_buf);
  attn_tensor *all[9] = {&q, &k, &v, &out, &lse, &dq, &dk, &dv, &g};
  for (int t = 0; t < 9; t++) attn_tensor_free(all[t]);
  attn_ctx_destroy(ctx);
  MPI_Finalize();
  return 0;
}
