/* The scheduler (schedule.h): one OpenMP region per call. */
#include "schedule.h"

#include <stdio.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

int attn__threads_for(const attn_ctx *ctx, double flops) { return flops < 1e6 ? 1 : attn__threads(ctx); }

static void record(attn_ctx *ctx, const char *what, const long long args[4], int threads, const attn__job *job) {
  attn__plan *pl = &ctx->last_plan;
  pl->what = what;
  memcpy(pl->args, args, sizeof pl->args);
  pl->threads = threads;
  pl->rounds = job->rounds;
  pl->nphases = job->nphases < ATTN__PLAN_PHASES ? job->nphases : ATTN__PLAN_PHASES;
  for (int k = 0; k < pl->nphases; k++) { /* the first round is the largest: the others hold as many kv heads or fewer */
    pl->name[k] = job->phases[k].name;
    pl->items[k] = job->rounds ? job->phases[k].items(job->arg, 0) : 0;
    pl->on_demand[k] = job->phases[k].on_demand;
  }
}

/* "attn_sdpa forward (...) on 2 threads, 1 round: pack_k 32 items (static ranges); ..." */
void attn__plan_format(const attn__plan *pl, char *d, size_t n) {
  d[0] = '\0';
  if (!pl->what) return;
  size_t used = (size_t)snprintf(d, n, pl->what, pl->args[0], pl->args[1], pl->args[2], pl->args[3]);
  if (used < n)
    used += (size_t)snprintf(d + used, n - used, " on %d thread%s, %lld round%s:", pl->threads,
                             pl->threads == 1 ? "" : "s", (long long)pl->rounds, pl->rounds == 1 ? "" : "s");
  int shown = 0;
  for (int k = 0; k < pl->nphases && used < n; k++) {
    if (!pl->items[k]) continue;
    used += (size_t)snprintf(d + used, n - used, "%s %s %lld item%s%s (%s)", shown++ ? ";" : "", pl->name[k],
                             (long long)pl->items[k], pl->items[k] == 1 ? "" : "s", pl->rounds > 1 ? " per round" : "",
                             pl->on_demand[k] ? "on demand" : "static ranges");
  }
}

/* Items [first, last) of a static phase for thread t of T: contiguous, sizes differing by one at most. */
static void static_range(int64_t items, int t, int T, int64_t *first, int64_t *last) {
  *first = items * t / T;
  *last = items * (t + 1) / T;
}

attn_status attn__schedule(attn_ctx *ctx, const char *what, const long long args[4], int threads, const attn__job *job) {
  threads = threads < 1 ? 1 : threads;
  record(ctx, what, args, threads, job);
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
        if (items == 0) continue; /* every thread sees the same count: no barrier is owed */
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
  if (failed) return attn__fail(ctx, ATTN_E_NOMEM, "cannot allocate %zu bytes of scratch per thread", job->scratch_bytes);
  return ATTN_OK;
}
