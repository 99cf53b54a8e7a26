/* Concurrency: four POSIX threads, each with its own context (set to 2 OpenMP
 * threads, so the library's parallel regions run inside every one of them) and
 * its own buffers, run at once, several times over:
 *   attn_sdpa (weights, lse, sinks), attn_sdpa_backward (with sinks_grad),
 *   attn_mha_forward, attn_mha_forward_save + attn_mha_backward, and a KV
 *   cache (create, append, attend through the decode kernel's split-KV chunks,
 *   truncate, append, attend).
 * Every result must be bitwise what a single-threaded run gives (the library
 * promises results that do not depend on the thread count).
 *
 * Built with -DATTN_TSAN=ON (clang, ThreadSanitizer, libomp with Archer) this
 * is the test that finds data races between contexts and inside the library's
 * OpenMP regions: the ctest's TSAN_OPTIONS make any report fail it.
 * Usage: test_threads [iterations per thread, default 3] */
#include "testutil.h"

#include <pthread.h>

enum { NTHREADS = 4, OMP_THREADS = 2 };

/* Every output of one run, in one growing float buffer, in a fixed order. */
typedef struct results {
  float *v;
  size_t n, cap;
  int failed;        /* a call returned an error */
  char what[256];    /* the first error */
} results;

static void res_fail(results *r, const char *call, attn_ctx *ctx, attn_status st) {
  if (!r->failed) snprintf(r->what, sizeof r->what, "%s -> %s: %s", call, attn_strerror(st), attn_ctx_error(ctx));
  r->failed = 1;
}

static void res_add(results *r, const float *x, int64_t n) {
  if (r->n + (size_t)n > r->cap) {
    size_t cap = r->cap ? r->cap : 4096;
    while (cap < r->n + (size_t)n) cap *= 2;
    float *p = realloc(r->v, cap * sizeof(float));
    if (!p) {
      r->failed = 1;
      snprintf(r->what, sizeof r->what, "out of memory");
      return;
    }
    r->v = p;
    r->cap = cap;
  }
  memcpy(r->v + r->n, x, (size_t)n * sizeof(float));
  r->n += (size_t)n;
}

static void res_add_tensor(results *r, const attn_tensor *t) { res_add(r, t->data, attn_tensor_numel(t)); }

#define RUN(r, ctx, call)                                  \
  do {                                                     \
    attn_status st_ = (call);                              \
    if (st_ != ATTN_OK) {                                  \
      res_fail(r, #call, ctx, st_);                        \
      goto done;                                           \
    }                                                      \
  } while (0)

static float *rnd(tu_rng *g, int64_t n, double amp) {
  float *x = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
  if (x) tu_fill_f32(g, x, n, amp);
  return x;
}

/* ---- the workload ------------------------------------------------------------------ */
/* SDPA: GQA 4/2, causal, sinks; large enough for several key blocks per head. */
enum { SB = 2, SHQ = 4, SHK = 2, SN = 160, SD = 32 };
/* The layer: GQA, self-attention. */
enum { MB = 2, MN = 128, ME = 96, MH = 4, MHK = 2 };
/* The cache: long enough for two decode chunks (2048 keys each), f16 storage. */
enum { CB = 2, CHQ = 4, CHK = 2, CD = 64, CCAP = 2600, CFIRST = 2500 };

static void run_sdpa(attn_ctx *ctx, tu_rng *g, results *r) {
  const int64_t qs[4] = {SB, SHQ, SN, SD}, ks[4] = {SB, SHK, SN, SD}, ws[4] = {SB, SHQ, SN, SN}, ls[3] = {SB, SHQ, SN};
  const int64_t nq = SB * SHQ * SN * SD, nk = SB * SHK * SN * SD;
  float *q = rnd(g, nq, 1), *k = rnd(g, nk, 1), *v = rnd(g, nk, 1), *dout = rnd(g, nq, 1), *sinks = rnd(g, SHQ, 1);
  float *out = calloc((size_t)nq, sizeof(float)), *w = calloc((size_t)(SB * SHQ * SN * SN), sizeof(float));
  float *lse = calloc((size_t)(SB * SHQ * SN), sizeof(float)), *dq = calloc((size_t)nq, sizeof(float));
  float *dk = calloc((size_t)nk, sizeof(float)), *dv = calloc((size_t)nk, sizeof(float)), *ds = calloc(SHQ, sizeof(float));
  if (!q || !k || !v || !dout || !sinks || !out || !w || !lse || !dq || !dk || !dv || !ds) {
    r->failed = 1;
    snprintf(r->what, sizeof r->what, "out of memory");
    goto done;
  }
  {
    const int64_t hs[1] = {SHQ};
    attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, qs), tk = attn_tensor_view(k, ATTN_F32, 4, ks);
    attn_tensor tv = attn_tensor_view(v, ATTN_F32, 4, ks), to = attn_tensor_view(out, ATTN_F32, 4, qs);
    attn_tensor tw = attn_tensor_view(w, ATTN_F32, 4, ws), tl = attn_tensor_view(lse, ATTN_F32, 3, ls);
    attn_tensor tg = attn_tensor_view(dout, ATTN_F32, 4, qs), tdq = attn_tensor_view(dq, ATTN_F32, 4, qs);
    attn_tensor tdk = attn_tensor_view(dk, ATTN_F32, 4, ks), tdv = attn_tensor_view(dv, ATTN_F32, 4, ks);
    attn_tensor tsk = attn_tensor_view(sinks, ATTN_F32, 1, hs), tds = attn_tensor_view(ds, ATTN_F32, 1, hs);
    attn_sdpa_opts o;
    attn_sdpa_opts_init(&o);
    o.causal = ATTN_CAUSAL_TOP_LEFT;
    o.sinks = &tsk;
    RUN(r, ctx, attn_sdpa(ctx, &to, &tl, &tw, &tq, &tk, &tv, &o));
    res_add_tensor(r, &to);
    res_add_tensor(r, &tw);
    res_add_tensor(r, &tl);
    RUN(r, ctx, attn_sdpa_backward(ctx, &tdq, &tdk, &tdv, NULL, &tds, &tg, &tq, &tk, &tv, &to, &tl, &o));
    res_add_tensor(r, &tdq);
    res_add_tensor(r, &tdk);
    res_add_tensor(r, &tdv);
    res_add_tensor(r, &tds);
  }
done:
  free(q), free(k), free(v), free(dout), free(sinks), free(out), free(w), free(lse), free(dq), free(dk), free(dv);
  free(ds);
}

static void fill_params(attn_ctx *ctx, attn_mha *m, tu_rng *g) {
  for (int p = 0; p < TU_MHA_PROJ_PARAMS; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, m, (attn_mha_param)p) == ATTN_OK)
      tu_fill_f32(g, t.data, attn_tensor_numel(&t), 0.2);
  }
}

static void emit_params(attn_ctx *ctx, attn_mha *m, results *r) {
  for (int p = 0; p < TU_MHA_PROJ_PARAMS; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, m, (attn_mha_param)p) == ATTN_OK) res_add_tensor(r, &t);
  }
}

static void run_mha(attn_ctx *ctx, tu_rng *g, results *r) {
  const int64_t xs[3] = {MB, MN, ME};
  attn_mha *m = NULL, *grads = NULL;
  attn_mha_saved *sv = NULL;
  float *x = rnd(g, MB * MN * ME, 1), *dout = rnd(g, MB * MN * ME, 1);
  float *out = calloc(MB * MN * ME, sizeof(float)), *out2 = calloc(MB * MN * ME, sizeof(float));
  float *dx = calloc(MB * MN * ME, sizeof(float));
  if (!x || !dout || !out || !out2 || !dx) {
    r->failed = 1;
    snprintf(r->what, sizeof r->what, "out of memory");
    goto done;
  }
  {
    attn_mha_config cfg;
    attn_mha_config_init(&cfg, ME, MH);
    cfg.num_kv_heads = MHK;
    cfg.bias = 1;
    RUN(r, ctx, attn_mha_create(ctx, &m, &cfg));
    RUN(r, ctx, attn_mha_create(ctx, &grads, &cfg));
    fill_params(ctx, m, g);
    attn_tensor tx = attn_tensor_view(x, ATTN_F32, 3, xs), to = attn_tensor_view(out, ATTN_F32, 3, xs);
    attn_tensor to2 = attn_tensor_view(out2, ATTN_F32, 3, xs), tg = attn_tensor_view(dout, ATTN_F32, 3, xs);
    attn_tensor tdx = attn_tensor_view(dx, ATTN_F32, 3, xs);
    attn_mha_opts o;
    attn_mha_opts_init(&o);
    o.attn.causal = ATTN_CAUSAL_TOP_LEFT;
    RUN(r, ctx, attn_mha_forward(ctx, m, &to, NULL, &tx, NULL, NULL, &o));
    res_add_tensor(r, &to);
    RUN(r, ctx, attn_mha_forward_save(ctx, m, &to2, NULL, &sv, &tx, NULL, NULL, &o));
    res_add_tensor(r, &to2);
    RUN(r, ctx, attn_mha_backward(ctx, m, &tdx, NULL, NULL, grads, sv, &tg));
    res_add_tensor(r, &tdx);
    emit_params(ctx, grads, r);
  }
done:
  attn_mha_saved_free(sv);
  attn_mha_destroy(m);
  attn_mha_destroy(grads);
  free(x), free(dout), free(out), free(out2), free(dx);
}

/* Appends n tokens of random k/v to every row, then attends with the last nq of them. */
static int cache_step(attn_ctx *ctx, attn_kv_cache *c, tu_rng *g, int64_t n, int64_t nq, results *r) {
  const int64_t ks[4] = {CB, CHK, n, CD}, qs[4] = {CB, CHQ, nq, CD}, ls[3] = {CB, CHQ, nq};
  float *k = rnd(g, CB * CHK * n * CD, 1), *v = rnd(g, CB * CHK * n * CD, 1), *q = rnd(g, CB * CHQ * nq * CD, 1);
  float *out = calloc((size_t)(CB * CHQ * nq * CD), sizeof(float)), *lse = calloc((size_t)(CB * CHQ * nq), sizeof(float));
  int ok = 0;
  if (!k || !v || !q || !out || !lse) {
    r->failed = 1;
    snprintf(r->what, sizeof r->what, "out of memory");
    goto done;
  }
  {
    attn_tensor tk = attn_tensor_view(k, ATTN_F32, 4, ks), tv = attn_tensor_view(v, ATTN_F32, 4, ks);
    attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, qs), to = attn_tensor_view(out, ATTN_F32, 4, qs);
    attn_tensor tl = attn_tensor_view(lse, ATTN_F32, 3, ls);
    attn_sdpa_opts o;
    attn_sdpa_opts_init(&o);
    RUN(r, ctx, attn_kv_cache_append(ctx, c, &tk, &tv, NULL));
    RUN(r, ctx, attn_kv_cache_attend(ctx, c, &to, &tl, &tq, &o));
    res_add_tensor(r, &to);
    res_add_tensor(r, &tl);
    ok = 1;
  }
done:
  free(k), free(v), free(q), free(out), free(lse);
  return ok;
}

static void run_cache(attn_ctx *ctx, tu_rng *g, results *r) {
  attn_kv_cache_config cfg;
  attn_kv_cache_config_init(&cfg, CB, CCAP, CHK, CD);
  cfg.dtype = ATTN_F16;
  attn_kv_cache *c = NULL;
  RUN(r, ctx, attn_kv_cache_create(ctx, &c, &cfg));
  if (!cache_step(ctx, c, g, CFIRST, 1, r)) goto done; /* one query over 2500 keys: two chunks */
  if (!cache_step(ctx, c, g, 1, 1, r)) goto done;
  RUN(r, ctx, attn_kv_cache_truncate(ctx, c, -1, 1000));
  RUN(r, ctx, attn_kv_cache_truncate(ctx, c, 1, 700));
  if (!cache_step(ctx, c, g, 3, 3, r)) goto done;
  const float lens[2] = {(float)attn_kv_cache_length(c, 0), (float)attn_kv_cache_length(c, 1)};
  res_add(r, lens, 2);
done:
  attn_kv_cache_destroy(c);
}

/* One run of the whole workload on ctx, inputs drawn from seed. */
static void workload(attn_ctx *ctx, uint64_t seed, results *r) {
  tu_rng g = {seed};
  run_sdpa(ctx, &g, r);
  if (!r->failed) run_mha(ctx, &g, r);
  if (!r->failed) run_cache(ctx, &g, r);
}

/* ---- the threads ------------------------------------------------------------------- */
typedef struct job {
  int id, iterations;
  const results *want; /* the single-threaded run of this job's seed */
  int mismatches;      /* runs whose results differ from want */
  size_t first_diff;   /* index of the first differing value in the first such run */
  char error[320];     /* the first failed call, if any */
} job;

static uint64_t seed_of(int id) { return 0x5eed0000u + (uint64_t)id * 7919u; }

static void *worker(void *arg) {
  job *j = arg;
  attn_ctx *ctx = NULL;
  attn_status st = attn_ctx_create(&ctx);
  if (st == ATTN_OK) st = attn_ctx_set_threads(ctx, OMP_THREADS);
  if (st != ATTN_OK) {
    snprintf(j->error, sizeof j->error, "context: %s", attn_strerror(st));
    attn_ctx_destroy(ctx);
    return NULL;
  }
  for (int it = 0; it < j->iterations && !j->error[0]; it++) {
    results r;
    memset(&r, 0, sizeof r);
    workload(ctx, seed_of(j->id), &r);
    if (r.failed) {
      snprintf(j->error, sizeof j->error, "iteration %d: %s", it, r.what);
    } else if (r.n != j->want->n || memcmp(r.v, j->want->v, r.n * sizeof(float)) != 0) {
      if (!j->mismatches) {
        size_t i = 0;
        while (i < r.n && i < j->want->n && !memcmp(&r.v[i], &j->want->v[i], sizeof(float))) i++;
        j->first_diff = i;
      }
      j->mismatches++;
    }
    free(r.v);
  }
  attn_ctx_destroy(ctx);
  return NULL;
}

int main(int argc, char **argv) {
  const int iterations = argc > 1 ? atoi(argv[1]) : 3;
  /* the reference: one thread, one OpenMP thread, each seed in turn */
  results want[NTHREADS];
  memset(want, 0, sizeof want);
  attn_ctx *ctx = NULL;
  CHECK_OK(ctx, attn_ctx_create(&ctx));
  if (!ctx) return tu_finish("test_threads");
  CHECK_OK(ctx, attn_ctx_set_threads(ctx, 1));
  printf("kernel %s; %d threads x %d OpenMP threads, %d iterations each\n", attn_kernel_name(attn_ctx_kernel(ctx)),
         NTHREADS, OMP_THREADS, iterations);
  for (int t = 0; t < NTHREADS; t++) {
    workload(ctx, seed_of(t), &want[t]);
    CHECK(!want[t].failed, "single-threaded run %d: %s", t, want[t].what);
    int nonfinite = 0;
    for (size_t i = 0; i < want[t].n; i++) nonfinite += !isfinite(want[t].v[i]);
    CHECK(nonfinite == 0 && want[t].n > 0, "single-threaded run %d: %d of %zu values not finite", t, nonfinite,
          want[t].n);
  }
  attn_ctx_destroy(ctx);
  if (tu_failures) return tu_finish("test_threads");
  CHECK(memcmp(want[0].v, want[1].v, want[0].n * sizeof(float)) != 0, "two seeds gave the same results");

  job jobs[NTHREADS];
  pthread_t tid[NTHREADS];
  int started[NTHREADS];
  for (int t = 0; t < NTHREADS; t++) {
    memset(&jobs[t], 0, sizeof jobs[t]);
    jobs[t].id = t;
    jobs[t].iterations = iterations;
    jobs[t].want = &want[t];
    started[t] = pthread_create(&tid[t], NULL, worker, &jobs[t]) == 0;
    CHECK(started[t], "pthread_create %d", t);
  }
  for (int t = 0; t < NTHREADS; t++) {
    if (!started[t]) continue;
    pthread_join(tid[t], NULL);
    CHECK(!jobs[t].error[0], "thread %d: %s", t, jobs[t].error);
    CHECK(jobs[t].mismatches == 0, "thread %d: %d of %d runs differ from the single-threaded run (first at value %zu of %zu)",
          t, jobs[t].mismatches, iterations, jobs[t].first_diff, want[t].n);
    printf("thread %d: %d runs of %zu values, %s\n", t, iterations, want[t].n,
           jobs[t].mismatches || jobs[t].error[0] ? "FAILED" : "bitwise equal to the single-threaded run");
  }
  for (int t = 0; t < NTHREADS; t++) free(want[t].v);
  return tu_finish("test_threads");
}
