/* The scheduler (schedule.h): one OpenMP region per call. */
#include "schedule.h"

#include <stdio.h>

#ifdef _OPENMP
#include <omp.h>
#endif

int attn__threads_for(const attn_ctx *ctx, double flops) { return flops < 1e6 ? 1 : attn__threads(ctx); }

/* "forward on 2 threads, 1 round: pack_k 32 static, tiles 96 on demand" */
static void describe(attn_ctx *ctx, const char *what, int threads, const attn__job *job) {
  char *d = ctx->plan;
  const size_t n = sizeof ctx->plan;
  size_t used = (size_t)snprintf(d, n, "%s on %d thread%s, %lld round%s:", what, threads, threads == 1 ? "" : "s",
                                  (long long)job->rounds, job->rounds == 1 ? "" : "s");
  int shown = 0;
  for (int k = 0; k < job->nphases && used < n; k++) {
    const attn__phase *ph = &job->phases[k];
    int64_t total = 0, most = 0;
    for (int64_t r = 0; r < job->rounds; r++) {
      const int64_t items = ph->items(job->arg, r);
      total += items;
      most = items > most ? items : most;
    }
    if (!total) continue;
    used += (size_t)snprintf(d + used, n - used, "%s %s %lld item%s%s (%s)", shown++ ? ";" : "", ph->name,
                             (long long)most, most == 1 ? "" : "s", job->rounds > 1 ? " per round" : "",
                             ph->on_demand ? "on demand" : "static ranges");
  }
}

/* Items [first, last) of a static phase for thread t of T: contiguous, sizes differing by one at most. */
static void static_range(int64_t items, int t, int T, int64_t *first, int64_t *last) {
  *first = items * t / T;
  *last = items * (t + 1) / T;
}

attn_status attn__schedule(attn_ctx *ctx, const char *what, int threads, const attn__job *job) {
  threads = threads < 1 ? 1 : threads;
  describe(ctx, what, threads, job);
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    void *scratch = job->scratch_bytes ? attn__aligned_alloc(job->scratch_bytes) : NULL;
    if (job->scratch_bytes && !scratch) {
#pragma omp atomic write
      failed = 1;
    } else if (scratch && job->scratch_init) {
      job->scratch_init(job->arg, scratch);
    }
    /* every thread reads the same verdict: all of them, or none, enter the phases */
#pragma omp barrier
    int t = 0, T = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    T = omp_get_num_threads();
#endif
    for (int64_t round = 0; round < job->rounds && !failed; round++)
      for (int k = 0; k < job->nphases; k++) {
        const attn__phase *ph = &job->phases[k];
        const int64_t items = ph->items(job->arg, round);
        if (ph->on_demand) {
#pragma omp for schedule(dynamic, 1)
          for (int64_t it = 0; it < items; it++) ph->run(job->arg, scratch, round, it, it + 1);
        } else {
          int64_t first, last;
          static_range(items, t, T, &first, &last);
          if (first < last) ph->run(job->arg, scratch, round, first, last);
#pragma omp barrier
        }
      }
    attn__aligned_free(scratch);
  }
  if (failed) return attn__fail(ctx, ATTN_E_NOMEM, "%s: cannot allocate %zu bytes of scratch per thread", what,
                                job->scratch_bytes);
  return ATTN_OK;
}
