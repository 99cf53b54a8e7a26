/* The scheduler: every framework's work as a list of items, dealt to the
 * context's threads in one parallel region per call.
 *
 * A job is a sequence of phases (pack, compute, reduce...), repeated for each
 * of `rounds` rounds (a round: as many kv heads as the packing budget holds).
 * Every item of a phase is done before the next phase starts. A phase's run
 * takes a range [first, last) of its items and never creates threads; items
 * write disjoint memory, and every reduction over items is a later phase that
 * sums in a fixed order, so no result depends on how items were dealt. */
#ifndef ATTN_ENGINE_SCHEDULE_H
#define ATTN_ENGINE_SCHEDULE_H

#include "../internal.h"

typedef struct attn__phase {
  const char *name;
  /* items of this phase in round `round` (may be 0) */
  int64_t (*items)(const void *job, int64_t round);
  /* does items [first, last); scratch is the calling thread's own */
  void (*run)(const void *job, void *scratch, int64_t round, int64_t first, int64_t last);
  /* 1: dealt one item at a time to whichever thread is free (items of uneven
   * cost, or a thread held back by the OS); 0: equal contiguous ranges */
  int on_demand;
} attn__phase;

typedef struct attn__job {
  const void *arg;            /* what every phase reads */
  int64_t rounds;
  const attn__phase *phases;
  int nphases;
  size_t scratch_bytes;       /* per thread, 64-byte aligned; 0 for none */
  /* fills a thread's scratch once, before its first item (may be NULL) */
  void (*scratch_init)(const void *arg, void *scratch);
} attn__job;

/* Runs job on `threads` threads (1: in the calling thread) and records its
 * work list in ctx for attn_ctx_plan: what (a printf format of up to four
 * long long arguments, args) and each phase's items in the first round, kept
 * as numbers and formatted only when asked for, since a decoding step may take
 * a few microseconds. NOMEM when a thread's scratch cannot be had. */
attn_status attn__schedule(attn_ctx *ctx, const char *what, const long long args[4], int threads, const attn__job *job);

/* Threads worth waking for `flops` of work: below about a million, one. */
int attn__threads_for(const attn_ctx *ctx, double flops);

#endif
