/* attn bench: how fast, against what limit, with how much memory, and how exact.
 *
 *   attn bench sdpa --batch B --heads H [--kv-heads G] --seq N [--kv-seq M] --dim D [--causal] [--window W]
 *                   [--backward] [--threads T] [--repeat R] [--kernel auto|c|avx2|avx512|ref] [--json]
 *   attn bench mha  --batch B --seq N --embed E --heads H [--threads T] [--repeat R] [--kernel ...] [--json]
 *   attn bench decode --batch B --kv-seq L --heads H [--kv-heads G] --dim D [--seq Nq] [--dtype f32|f16|bf16]
 *                   [--compare] [--threads T] [--repeat R] [--kernel ...] [--json]
 *
 * One case per run. Inputs are fresh fixed-seed uniform values in (-1, 1) (never
 * zero). The case runs once or twice to warm up, then R times (default: enough
 * runs for about a second, at least 3); the median is reported.
 *
 * --backward: also times attn_sdpa_backward alone (on the out and lse of a
 * forward with lse) and the forward with lse followed by the backward, each
 * the same way; their flops are 2.5x and 3.5x the forward's (dS = P o (dP - Dd),
 * dV, dP, dQ, dK: five products where the forward has two, plus recomputing the
 * scores). Their oracle is attn_sdpa_backward_ref fed by attn_sdpa_ref (exact
 * out and lse) on all of the problem, or on batch 0's first kv head with its
 * group of query heads (all rows, all keys, so dk and dv are complete), or is
 * skipped with a note; the error is the largest relative L2 of dq, dk and dv.
 * Peak RSS then covers the backward, and the io bytes add dout, dq, dk, dv, lse.
 *
 * Flops count what attention has to do, not what a kernel chooses to do:
 *   sdpa: 4 * D * (visible (query, key) pairs), summed over batch and query heads;
 *         under --causal only the pairs with j <= i (top-left, PyTorch is_causal); under --window W only those in the window
 *         are visible, counted exactly row by row.
 *   mha:  the attention's flops as above plus the four projections, 2*B*N*E*E each.
 * The peak is this machine's fp32 FMA rate for the same thread count, measured
 * in the same run by the code below (many independent FMA chains in registers).
 * Memory: the process's peak resident set (getrusage) after the timed runs, and
 * the bytes of the inputs and outputs for comparison. Accuracy: the relative L2
 * error against the float64 oracle, on all of the problem or a stated subset.
 *
 * decode: Nq new tokens (default 1) per batch row against a cache of L keys and
 * values stored in --dtype, bottom-right causal. Reported: GB/s of cache read
 * (2 * B * Hk * L * D * element size per step) and its fraction of this
 * machine's read bandwidth for the same thread count: 20 steps each followed
 * by a pass that reads 512 MiB (sum_pass), the median of their ratios. A cache under 256 MiB is cycled through copies so every
 * step reads memory. --compare also times the same step through the blocked
 * kernel (ATTN_DECODE=0) and a full recompute of all L rows (no cache), and
 * for an f16/bf16 cache its speed-up over the same cache in f32, the two timed
 * step by step in turn (the median ratio of 20 pairs).
 *
 * Exit: 0 done, 1 out of memory or a library error, 2 a bad command line. */
#include "cli.h"
#include "internal.h" /* half-precision rounding of the inputs */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* ---- inputs ------------------------------------------------------------------ */
/* splitmix64: a fixed-seed generator, the same numbers on every machine. */
static uint64_t rng_next(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Uniform on the odd multiples of 2^-24 in (-1, 1): never exactly zero. */
static float rng_uniform(uint64_t *s) {
  const uint64_t u = rng_next(s) >> 41; /* 23 bits */
  return (float)(((double)u + 0.5) * (2.0 / 8388608.0) - 1.0);
}

static void fill(float *x, int64_t n, uint64_t seed, float scale) {
  uint64_t s = seed;
  for (int64_t i = 0; i < n; i++) x[i] = scale * rng_uniform(&s);
}

/* ---- timing -------------------------------------------------------------------- */
typedef int (*bench_fn)(void *arg); /* 0, or an attn_status */

typedef struct timing {
  double median_s, min_s;
  long long repeats;
  int warmups;
} timing;

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

#define BENCH_TARGET_S 1.0
#define BENCH_MAX_REPEATS 1000000LL

/* Warm-up (a second run when the first was quick), then repeat runs.
 * repeat 0: enough runs for about BENCH_TARGET_S, at least 3. Returns 0 or a status. */
static int time_runs(bench_fn fn, void *arg, long long repeat, timing *t) {
  memset(t, 0, sizeof *t);
  double t0 = cli_now();
  int st = fn(arg);
  if (st) return st;
  double one = cli_now() - t0;
  t->warmups = 1;
  if (one < 0.25) {
    t0 = cli_now();
    if ((st = fn(arg))) return st;
    one = cli_now() - t0;
    t->warmups = 2;
  }
  long long r = repeat;
  if (r <= 0) {
    const double want = one > 0 ? ceil(BENCH_TARGET_S / one) : (double)BENCH_MAX_REPEATS;
    r = want < 3 ? 3 : (want > (double)BENCH_MAX_REPEATS ? BENCH_MAX_REPEATS : (long long)want);
  }
  double *times = malloc((size_t)r * sizeof *times);
  if (!times) return ATTN_E_NOMEM;
  for (long long i = 0; i < r; i++) {
    t0 = cli_now();
    if ((st = fn(arg))) {
      free(times);
      return st;
    }
    times[i] = cli_now() - t0;
  }
  qsort(times, (size_t)r, sizeof *times, cmp_double);
  t->median_s = r % 2 ? times[r / 2] : 0.5 * (times[r / 2 - 1] + times[r / 2]);
  t->min_s = times[0];
  t->repeats = r;
  free(times);
  return 0;
}

/* ---- the FMA peak ---------------------------------------------------------------- */
/* Each thread runs NACC independent multiply-add chains c = c * a + b in
 * registers (a just below 1, so the chains converge and never overflow or go
 * subnormal); enough chains to cover the FMA latency on every port. The
 * returned sum keeps the compiler from dropping the work. */
#define STEP16(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12) F(13) F(14) F(15)
#define STEP12(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)

#if defined(__x86_64__)
#define PEAK512_ACC 16
__attribute__((target("avx512f"))) static float fma_chains_avx512(long long iters, float a, float b) {
  const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
#define DECL(i) __m512 c##i = _mm512_set1_ps(1.0f + 0.001f * (float)(i));
  STEP16(DECL)
#undef DECL
  for (long long n = 0; n < iters; n++) {
#define STEP(i) c##i = _mm512_fmadd_ps(c##i, va, vb);
    STEP16(STEP)
#undef STEP
  }
  __m512 s = _mm512_setzero_ps();
#define SUM(i) s = _mm512_add_ps(s, c##i);
  STEP16(SUM)
#undef SUM
  return _mm512_reduce_add_ps(s);
}

#define PEAK256_ACC 12
__attribute__((target("avx2,fma"))) static float fma_chains_avx2(long long iters, float a, float b) {
  const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
#define DECL(i) __m256 c##i = _mm256_set1_ps(1.0f + 0.001f * (float)(i));
  STEP12(DECL)
#undef DECL
  for (long long n = 0; n < iters; n++) {
#define STEP(i) c##i = _mm256_fmadd_ps(c##i, va, vb);
    STEP12(STEP)
#undef STEP
  }
  __m256 s = _mm256_setzero_ps();
#define SUM(i) s = _mm256_add_ps(s, c##i);
  STEP12(SUM)
#undef SUM
  float f[8];
  _mm256_storeu_ps(f, s);
  return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7];
}
#endif

#define PEAK_SCALAR_ACC 12
static float fma_chains_scalar(long long iters, float a, float b) {
#define DECL(i) float c##i = 1.0f + 0.001f * (float)(i);
  STEP12(DECL)
#undef DECL
  for (long long n = 0; n < iters; n++) {
#define STEP(i) c##i = c##i * a + b;
    STEP12(STEP)
#undef STEP
  }
  float s = 0;
#define SUM(i) s += c##i;
  STEP12(SUM)
#undef SUM
  return s;
}

typedef enum peak_isa { PEAK_SCALAR, PEAK_AVX2, PEAK_AVX512 } peak_isa;
static const char *const peak_isa_name[] = {"scalar", "avx2+fma", "avx512f"};

/* The widest FMA this CPU runs: what the library's dispatcher says, and on x86
 * also the compiler's CPU check (which also asks the OS), so a build of the
 * library without its x86 kernels still measures the machine's real limit. */
static peak_isa choose_peak_isa(void) {
#if defined(__x86_64__)
  int avx512 = attn_kernel_supported(ATTN_KERNEL_AVX512), avx2 = attn_kernel_supported(ATTN_KERNEL_AVX2);
#if defined(__GNUC__)
  __builtin_cpu_init();
  avx512 = avx512 || __builtin_cpu_supports("avx512f");
  avx2 = avx2 || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
#endif
  if (avx512) return PEAK_AVX512;
  if (avx2) return PEAK_AVX2;
#endif
  return PEAK_SCALAR;
}

static volatile float peak_sink;

/* One timed pass: every thread runs iters steps; returns the elapsed seconds. */
static double peak_pass(peak_isa isa, int threads, long long iters) {
  volatile float va = 0.999999f, vb = 1e-6f;
  const float a = va, b = vb;
  float sink = 0;
  const double t0 = cli_now();
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : sink)
#else
  (void)threads;
#endif
  {
    float r;
#if defined(__x86_64__)
    if (isa == PEAK_AVX512) r = fma_chains_avx512(iters, a, b);
    else if (isa == PEAK_AVX2) r = fma_chains_avx2(iters, a, b);
    else
#endif
      r = fma_chains_scalar(iters, a, b);
    sink += r;
  }
  const double dt = cli_now() - t0;
  peak_sink = sink;
  return dt;
}

/* GFLOP/s of threads threads doing fp32 FMAs: ~0.2 s passes, the best of 3. */
static double measure_peak(int threads, peak_isa *isa_out) {
  const peak_isa isa = choose_peak_isa();
  *isa_out = isa;
  const int lanes = isa == PEAK_AVX512 ? 16 : isa == PEAK_AVX2 ? 8 : 1;
#if defined(__x86_64__)
  const int acc = isa == PEAK_AVX512 ? PEAK512_ACC : isa == PEAK_AVX2 ? PEAK256_ACC : PEAK_SCALAR_ACC;
#else
  const int acc = PEAK_SCALAR_ACC;
#endif
  long long iters = 20000;
  double dt = peak_pass(isa, threads, iters);
  while (dt < 0.02 && iters < (1LL << 40)) { /* calibrate on a pass long enough to time */
    iters *= 4;
    dt = peak_pass(isa, threads, iters);
  }
  iters = (long long)((double)iters * 0.2 / (dt > 0 ? dt : 1e-9));
  if (iters < 1) iters = 1;
  double best = 0;
  for (int k = 0; k < 3; k++) {
    dt = peak_pass(isa, threads, iters);
    const double g = 2.0 * lanes * acc * (double)iters * threads / dt * 1e-9;
    if (g > best) best = g;
  }
  return best;
}

/* ---- shared pieces ------------------------------------------------------------------ */
static double peak_rss_mib(void) {
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru)) return NAN;
  return (double)ru.ru_maxrss / 1024.0; /* KiB on Linux */
}

/* Refuses (exit 1) a case whose arrays alone would not fit in this machine's
 * memory: allocation would succeed lazily and the first touch be killed. */
static int check_fits(double bytes) {
  double phys = INFINITY;
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) phys = (double)pages * (double)page;
#endif
  if (bytes > 4e18 || bytes > 0.9 * phys)
    return cli_fail(CLI_EXIT_FAIL, "out of memory: the inputs and outputs need %.1f GiB, this machine has %.1f GiB",
                    bytes / 1073741824.0, phys / 1073741824.0);
  return 0;
}

/* JSON numbers: non-finite values are null. */
static void json_num(const char *key, double x, int last) {
  if (isfinite(x)) printf("\"%s\":%.6g%s", key, x, last ? "" : ",");
  else printf("\"%s\":null%s", key, last ? "" : ",");
}

/* The oracle runs at roughly 1 GFLOP/s: above this, check a subset (or skip). */
#ifndef ORACLE_MAX_FLOP
#define ORACLE_MAX_FLOP 3e9
#endif
/* The backward's oracle (float64 forward + backward, threaded): one head of N = 2048, D = 64 fits. */
#ifndef ORACLE_BWD_MAX_FLOP
#define ORACLE_BWD_MAX_FLOP 6e9
#endif

static int parse_kernel(const char *s, attn_kernel *k) {
  static const struct { const char *name; attn_kernel k; } names[] = {
      {"auto", ATTN_KERNEL_AUTO}, {"c", ATTN_KERNEL_C}, {"avx2", ATTN_KERNEL_AVX2},
      {"avx512", ATTN_KERNEL_AVX512}, {"ref", ATTN_KERNEL_REF}};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (!strcmp(s, names[i].name)) {
      *k = names[i].k;
      return 0;
    }
  return cli_fail(CLI_EXIT_USAGE, "--kernel wants auto, c, avx2, avx512 or ref, got '%s'", cli_show(s));
}

/* The context every case runs on: --threads and --kernel applied. */
static int bench_ctx(cli_args *a, attn_ctx **ctx) {
  long long threads = 0;
  attn_kernel kern = ATTN_KERNEL_AUTO;
  int r;
  if ((r = cli_int(a, "--threads", 0, 4096, &threads))) return r;
  if (cli_has(a, "--kernel") && (r = parse_kernel(cli_get(a, "--kernel"), &kern))) return r;
  if (attn_ctx_create(ctx)) return cli_fail(CLI_EXIT_FAIL, "out of memory");
  attn_ctx_set_threads(*ctx, (int)threads);
  if (attn_ctx_set_kernel(*ctx, kern)) {
    r = cli_fail(CLI_EXIT_USAGE, "--kernel %s: %s", cli_get(a, "--kernel"), attn_ctx_error(*ctx));
    attn_ctx_destroy(*ctx);
    *ctx = NULL;
    return r;
  }
  return 0;
}

/* The compute bound: memory is checked (check_fits), and so is the work, so
 * that a typo cannot start hours of arithmetic. The default, 1e5 GFLOP, is
 * about four minutes at 400 GFLOP/s (two AVX-512 cores at their peak) and
 * above every case of scripts/bench_grid.py. */
#define BENCH_MAX_GFLOP 1e5

/* Refuses (exit 2) a case whose runs would do more than --max-gflop GFLOP in
 * all (gflop: the fewest runs the timing makes; the oracle, on a bounded
 * subset, is not counted). */
static int check_work(cli_args *a, const char *op, double gflop) {
  double max = BENCH_MAX_GFLOP;
  int r = cli_double(a, "--max-gflop", &max);
  if (r) return r;
  if (!(max > 0))
    return cli_fail(CLI_EXIT_USAGE, "--max-gflop wants a number > 0, got '%s'", cli_show(cli_get(a, "--max-gflop")));
  if (gflop > max)
    return cli_fail(CLI_EXIT_USAGE, "bench %s: about %.3g GFLOP of timed runs, over the limit of %.3g GFLOP; "
                    "--max-gflop %.3g (or inf) runs it anyway", op, gflop, max, gflop * 1.01);
  return 0;
}

/* The fewest runs time_runs makes: the warm-up, then R or (unasked) at least 3. */
static double min_runs(long long repeat) { return (double)(repeat > 0 ? repeat : 3) + 1; }

/* A required positive integer flag. */
static int need_int(cli_args *a, const char *op, const char *name, long long hi, long long *out) {
  if (!cli_has(a, name)) return cli_fail(CLI_EXIT_USAGE, "bench %s needs %s", op, name);
  return cli_int(a, name, 1, hi, out);
}

/* Everything one case reports. */
typedef struct report {
  const char *op;
  long long batch, heads, kv_heads, seq, kv_seq, dim, embed;
  const char *causal; /* "none", "top-left", "bottom-right" */
  int threads;
  const char *kernel;
  timing t;
  double gflop, attn_gflop, proj_gflop;
  double peak_gflops;
  peak_isa isa;
  double rss_mib, io_mib;
  double oracle_err, oracle_s;
  char subset[160];
  /* --backward */
  int backward;
  timing tb, tfb;                 /* the backward alone; forward (with lse) + backward */
  double bwd_err[3], bwd_oracle_err, bwd_oracle_s; /* dq, dk, dv; their largest */
  char bwd_subset[200];
} report;

/* Flops of the backward and of forward + backward, in units of the forward's. */
#define BWD_FLOP_FACTOR 2.5
#define FWD_BWD_FLOP_FACTOR 3.5

static void print_report(const report *r, int json) {
  const double gflops = r->gflop / r->t.median_s, frac = gflops / r->peak_gflops;
  if (json) {
    printf("{\"op\":\"%s\",\"batch\":%lld,\"heads\":%lld,\"kv_heads\":%lld,\"seq\":%lld,\"kv_seq\":%lld,\"dim\":%lld,",
           r->op, r->batch, r->heads, r->kv_heads, r->seq, r->kv_seq, r->dim);
    if (r->embed) printf("\"embed\":%lld,", r->embed);
    printf("\"causal\":%s,\"causal_align\":\"%s\",\"threads\":%d,\"kernel\":\"%s\",",
           strcmp(r->causal, "none") ? "true" : "false", r->causal, r->threads, r->kernel);
    json_num("median_s", r->t.median_s, 0);
    json_num("min_s", r->t.min_s, 0);
    printf("\"repeats\":%lld,\"warmups\":%d,", r->t.repeats, r->t.warmups);
    json_num("gflop", r->gflop, 0);
    json_num("attn_gflop", r->attn_gflop, 0);
    json_num("proj_gflop", r->proj_gflop, 0);
    json_num("gflops", gflops, 0);
    json_num("peak_gflops", r->peak_gflops, 0);
    printf("\"peak_isa\":\"%s\",", peak_isa_name[r->isa]);
    json_num("fraction_of_peak", frac, 0);
    json_num("peak_rss_mib", r->rss_mib, 0);
    json_num("io_mib", r->io_mib, 0);
    json_num("oracle_rel_l2", r->oracle_err, 0);
    json_num("oracle_s", r->oracle_s, 0);
    printf("\"oracle_subset\":\"%s\"", r->subset);
    if (r->backward) {
      const double bg = BWD_FLOP_FACTOR * r->gflop, fbg = FWD_BWD_FLOP_FACTOR * r->gflop;
      printf(",\"backward\":true,");
      json_num("backward_median_s", r->tb.median_s, 0);
      json_num("backward_min_s", r->tb.min_s, 0);
      printf("\"backward_repeats\":%lld,", r->tb.repeats);
      json_num("backward_gflop", bg, 0);
      json_num("backward_gflops", bg / r->tb.median_s, 0);
      json_num("backward_fraction_of_peak", bg / r->tb.median_s / r->peak_gflops, 0);
      json_num("fwd_bwd_median_s", r->tfb.median_s, 0);
      json_num("fwd_bwd_min_s", r->tfb.min_s, 0);
      printf("\"fwd_bwd_repeats\":%lld,", r->tfb.repeats);
      json_num("fwd_bwd_gflop", fbg, 0);
      json_num("fwd_bwd_gflops", fbg / r->tfb.median_s, 0);
      json_num("fwd_bwd_fraction_of_peak", fbg / r->tfb.median_s / r->peak_gflops, 0);
      json_num("backward_oracle_rel_l2", r->bwd_oracle_err, 0);
      json_num("backward_oracle_dq_rel_l2", r->bwd_err[0], 0);
      json_num("backward_oracle_dk_rel_l2", r->bwd_err[1], 0);
      json_num("backward_oracle_dv_rel_l2", r->bwd_err[2], 0);
      json_num("backward_oracle_s", r->bwd_oracle_s, 0);
      printf("\"backward_oracle_subset\":\"%s\"", r->bwd_subset);
    }
    printf("}\n");
  } else {
    if (!strcmp(r->op, "sdpa"))
      printf("sdpa B=%lld Hq=%lld Hk=%lld Nq=%lld Nk=%lld D=%lld causal=%s", r->batch, r->heads, r->kv_heads, r->seq,
             r->kv_seq, r->dim, r->causal);
    else
      printf("mha B=%lld N=%lld E=%lld H=%lld (D=%lld)", r->batch, r->seq, r->embed, r->heads, r->dim);
    printf(" | kernel %s, %d threads | median %.4g ms of %lld (min %.4g ms) | %.2f GFLOP/s", r->kernel, r->threads,
           r->t.median_s * 1e3, r->t.repeats, r->t.min_s * 1e3, gflops);
    if (r->proj_gflop > 0)
      printf(" (%.4g GFLOP: attention %.4g + projections %.4g)", r->gflop, r->attn_gflop, r->proj_gflop);
    else
      printf(" (%.4g GFLOP, visible pairs only)", r->gflop);
    printf(" | %.1f%% of measured peak %.1f GFLOP/s (%s FMA, %d threads)", 100 * frac, r->peak_gflops,
           peak_isa_name[r->isa], r->threads);
    printf(" | peak RSS %.1f MiB (inputs+outputs %.1f MiB)", r->rss_mib, r->io_mib);
    if (isfinite(r->oracle_err)) printf(" | oracle rel L2 %.2e on %s", r->oracle_err, r->subset);
    else printf(" | oracle: %s", r->subset);
    if (r->backward) {
      const double bg = BWD_FLOP_FACTOR * r->gflop, fbg = FWD_BWD_FLOP_FACTOR * r->gflop;
      printf("\n  backward: median %.4g ms of %lld (min %.4g ms) | %.2f GFLOP/s (%.4g GFLOP = %.1fx forward) | "
             "%.1f%% of peak", r->tb.median_s * 1e3, r->tb.repeats, r->tb.min_s * 1e3, bg / r->tb.median_s, bg,
             BWD_FLOP_FACTOR, 100 * bg / r->tb.median_s / r->peak_gflops);
      printf("\n  forward+backward: median %.4g ms of %lld (min %.4g ms) | %.2f GFLOP/s (%.4g GFLOP = %.1fx forward) | "
             "%.1f%% of peak", r->tfb.median_s * 1e3, r->tfb.repeats, r->tfb.min_s * 1e3, fbg / r->tfb.median_s, fbg,
             FWD_BWD_FLOP_FACTOR, 100 * fbg / r->tfb.median_s / r->peak_gflops);
      if (isfinite(r->bwd_oracle_err))
        printf("\n  backward oracle rel L2: dq %.2e, dk %.2e, dv %.2e on %s", r->bwd_err[0], r->bwd_err[1],
               r->bwd_err[2], r->bwd_subset);
      else
        printf("\n  backward oracle: %s", r->bwd_subset);
    }
    printf("\n");
  }
  fflush(stdout);
}

/* ---- attn bench sdpa ------------------------------------------------------------------ */
typedef struct sdpa_case {
  attn_ctx *ctx;
  attn_tensor q, k, v, out;
  attn_sdpa_opts o;
  attn_tensor lse, dout, dq, dk, dv; /* --backward */
  attn_tensor kpm; /* --padding: [B, Nk] */
} sdpa_case;

static int run_sdpa(void *arg) {
  sdpa_case *c = arg;
  return attn_sdpa(c->ctx, &c->out, NULL, NULL, &c->q, &c->k, &c->v, &c->o);
}

static int run_sdpa_backward(void *arg) {
  sdpa_case *c = arg;
  return attn_sdpa_backward(c->ctx, &c->dq, &c->dk, &c->dv, NULL, NULL, &c->dout, &c->q, &c->k, &c->v, &c->out, &c->lse,
                            &c->o);
}

static int run_sdpa_fwd_bwd(void *arg) {
  sdpa_case *c = arg;
  int st = attn_sdpa(c->ctx, &c->out, &c->lse, NULL, &c->q, &c->k, &c->v, &c->o);
  return st ? st : run_sdpa_backward(c);
}

/* Keys query row i sees: [0, end). */
static int64_t causal_end(attn_causal c, int64_t i, int64_t Nq, int64_t Nk) {
  int64_t e;
  if (c == ATTN_CAUSAL_TOP_LEFT) e = i + 1;
  else if (c == ATTN_CAUSAL_BOTTOM_RIGHT) e = i + 1 + Nk - Nq;
  else return Nk;
  return e < 0 ? 0 : (e > Nk ? Nk : e);
}

/* A view of rows [r0, r0 + n) of (batch 0, head 0) of a [B, H, N, D] tensor. */
static attn_tensor head0_rows(const attn_tensor *t, int64_t r0, int64_t n) {
  attn_tensor s = *t;
  s.data = (float *)t->data + r0 * t->strides[2];
  s.shape[0] = 1;
  s.shape[1] = 1;
  s.shape[2] = n;
  return s;
}

static int sdpa_oracle(sdpa_case *c, report *rep, double pairs_per_head) {
  const int64_t B = c->q.shape[0], Hq = c->q.shape[1], Nq = c->q.shape[2], D = c->q.shape[3];
  const int64_t Nk = c->k.shape[2], Dv = c->v.shape[3];
  const double full_flop = 2.0 * (double)(D + Dv) * pairs_per_head * (double)(B * Hq);
  attn_sdpa_opts o = c->o;
  attn_tensor q = c->q, k = c->k, v = c->v, kp;
  int64_t r0 = 0, n = Nq, heads = B * Hq;
  if (full_flop <= ORACLE_MAX_FLOP) {
    snprintf(rep->subset, sizeof rep->subset, "all");
  } else {
    /* One head's last rows; each keeps exactly the keys it sees in the full problem. */
    n = Nq < 64 ? Nq : 64;
    heads = 1;
    const char *how = "";
    if (o.causal == ATTN_CAUSAL_TOP_LEFT) {
      if (Nq == Nk) {
        r0 = Nq - n; /* row r of the subset is row Nq - n + r: bottom-right sees j <= r + Nk - n = i */
        o.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
        how = ", causal as bottom-right on the subset";
      } else {
        r0 = 0; /* the first rows see j <= i under top-left in any problem */
      }
    } else {
      r0 = Nq - n; /* non-causal: any rows; bottom-right: the offset Nk - Nq is kept */
    }
    q = head0_rows(&c->q, r0, n);
    k = head0_rows(&c->k, 0, Nk);
    v = head0_rows(&c->v, 0, Nk);
    if (o.key_padding) { /* batch 0's row of it */
      kp = *o.key_padding;
      kp.shape[0] = 1;
      o.key_padding = &kp;
    }
    snprintf(rep->subset, sizeof rep->subset, "batch 0 head 0 query rows %lld..%lld of %lld, all %lld keys%s",
             (long long)r0, (long long)(r0 + n - 1), (long long)Nq, (long long)Nk, how);
  }
  attn_tensor ref;
  int64_t rs[4] = {q.shape[0], q.shape[1], n, Dv};
  if (attn_tensor_alloc(c->ctx, &ref, ATTN_F64, 4, rs)) return cli_fail(CLI_EXIT_FAIL, "oracle: out of memory");
  const double t0 = cli_now();
  if (attn_sdpa_ref(c->ctx, &ref, NULL, NULL, &q, &k, &v, &o)) {
    attn_tensor_free(&ref);
    return cli_fail(CLI_EXIT_FAIL, "oracle: %s", attn_ctx_error(c->ctx));
  }
  rep->oracle_s = cli_now() - t0;
  /* out is contiguous [B, Hq, Nq, Dv]: the checked heads' rows, one block of n rows per head */
  double num = 0, den = 0;
  for (int64_t h = 0; h < heads; h++) {
    const float *o32 = (const float *)c->out.data + (h * Nq + r0) * Dv;
    const double *o64 = (const double *)ref.data + h * n * Dv;
    for (int64_t i = 0; i < n * Dv; i++) {
      num += (o32[i] - o64[i]) * (o32[i] - o64[i]);
      den += o64[i] * o64[i];
    }
  }
  rep->oracle_err = den > 0 ? sqrt(num / den) : sqrt(num);
  attn_tensor_free(&ref);
  return 0;
}

/* Relative L2 of n floats against n doubles. */
static double rel_l2(const float *x, const double *y, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The backward's oracle: the float64 forward (exact out and lse), then the float64
 * backward, on everything or on batch 0's kv head 0 with its query heads. */
static int sdpa_backward_oracle(sdpa_case *c, report *rep, double pairs_per_head) {
  const int64_t B = c->q.shape[0], Hq = c->q.shape[1], Nq = c->q.shape[2], D = c->q.shape[3];
  const int64_t Hk = c->k.shape[1], Nk = c->k.shape[2], Dv = c->v.shape[3], group = Hq / Hk;
  const double head_flop = 2.0 * (double)(D + Dv) * pairs_per_head * FWD_BWD_FLOP_FACTOR; /* forward + backward */
  attn_tensor q = c->q, k = c->k, v = c->v, dout = c->dout;
  rep->bwd_oracle_err = rep->bwd_err[0] = rep->bwd_err[1] = rep->bwd_err[2] = rep->bwd_oracle_s = NAN;
  if (head_flop * (double)(B * Hq) <= ORACLE_BWD_MAX_FLOP) {
    snprintf(rep->bwd_subset, sizeof rep->bwd_subset, "all");
  } else if (head_flop * (double)group <= ORACLE_BWD_MAX_FLOP) {
    /* contiguous [B, H, N, D]: batch 0's first heads are the tensors' first elements */
    q.shape[0] = k.shape[0] = v.shape[0] = dout.shape[0] = 1;
    q.shape[1] = dout.shape[1] = group;
    k.shape[1] = v.shape[1] = 1;
    if (group == 1)
      snprintf(rep->bwd_subset, sizeof rep->bwd_subset, "batch 0 head 0 (all %lld query rows, all %lld keys)",
               (long long)Nq, (long long)Nk);
    else
      snprintf(rep->bwd_subset, sizeof rep->bwd_subset,
               "batch 0 kv head 0 with query heads 0..%lld (all %lld query rows, all %lld keys)",
               (long long)(group - 1), (long long)Nq, (long long)Nk);
  } else {
    snprintf(rep->bwd_subset, sizeof rep->bwd_subset,
             "skipped (even one kv head needs ~%.0f GFLOP of float64 forward+backward)",
             head_flop * (double)group * 1e-9);
    return 0;
  }
  const int64_t b = q.shape[0], hq = q.shape[1], hk = k.shape[1];
  int64_t os[4] = {b, hq, Nq, Dv}, ls[3] = {b, hq, Nq}, qs[4] = {b, hq, Nq, D}, ks[4] = {b, hk, Nk, D},
          vs[4] = {b, hk, Nk, Dv};
  attn_tensor out = {0}, lse = {0}, dq = {0}, dk = {0}, dv = {0};
  int r = 0;
  if (attn_tensor_alloc(c->ctx, &out, ATTN_F64, 4, os) || attn_tensor_alloc(c->ctx, &lse, ATTN_F64, 3, ls) ||
      attn_tensor_alloc(c->ctx, &dq, ATTN_F64, 4, qs) || attn_tensor_alloc(c->ctx, &dk, ATTN_F64, 4, ks) ||
      attn_tensor_alloc(c->ctx, &dv, ATTN_F64, 4, vs)) {
    r = cli_fail(CLI_EXIT_FAIL, "backward oracle: out of memory");
    goto done;
  }
  attn_sdpa_opts ob = c->o, o;
  attn_tensor kp;
  if (ob.key_padding && b < B) { /* batch 0's row of it */
    kp = *ob.key_padding;
    kp.shape[0] = b;
    ob.key_padding = &kp;
  }
  o = ob;
  const double t0 = cli_now();
  if (attn_sdpa_ref(c->ctx, &out, &lse, NULL, &q, &k, &v, &o) ||
      attn_sdpa_backward_ref(c->ctx, &dq, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &ob)) {
    r = cli_fail(CLI_EXIT_FAIL, "backward oracle: %s", attn_ctx_error(c->ctx));
    goto done;
  }
  rep->bwd_oracle_s = cli_now() - t0;
  rep->bwd_err[0] = rel_l2(c->dq.data, dq.data, attn_tensor_numel(&dq));
  rep->bwd_err[1] = rel_l2(c->dk.data, dk.data, attn_tensor_numel(&dk));
  rep->bwd_err[2] = rel_l2(c->dv.data, dv.data, attn_tensor_numel(&dv));
  rep->bwd_oracle_err = fmax(rep->bwd_err[0], fmax(rep->bwd_err[1], rep->bwd_err[2]));
done:
  attn_tensor_free(&out); attn_tensor_free(&lse);
  attn_tensor_free(&dq); attn_tensor_free(&dk); attn_tensor_free(&dv);
  return r;
}

static int bench_sdpa(int argc, char **argv) {
  static const char *const known[] = {"--batch", "--heads", "--kv-heads", "--seq", "--kv-seq", "--dim",
                                      "--threads", "--repeat", "--kernel", "--window", "--max-gflop",
                                      "--padding", NULL};
  static const char *const switches[] = {"--causal", "--json", "--backward", NULL};
  cli_args a;
  int r = cli_parse(&a, argc, argv, known, switches);
  if (r) return r;
  const int backward = cli_has(&a, "--backward");
  double padding = 0; /* the fraction of each row's keys, at its end, hidden by key_padding */
  if ((r = cli_double(&a, "--padding", &padding))) return r;
  if (!(padding >= 0 && padding < 1))
    return cli_fail(CLI_EXIT_USAGE, "--padding wants a fraction in [0, 1), got '%s'", cli_show(cli_get(&a, "--padding")));
  long long B, H, G = 0, N, M = 0, D, repeat = 0, window = 0;
  if ((r = need_int(&a, "sdpa", "--batch", 1 << 20, &B)) || (r = need_int(&a, "sdpa", "--heads", 1 << 16, &H)) ||
      (r = need_int(&a, "sdpa", "--seq", 1 << 24, &N)) || (r = need_int(&a, "sdpa", "--dim", 1 << 16, &D)) ||
      (r = cli_int(&a, "--kv-heads", 1, 1 << 16, &G)) || (r = cli_int(&a, "--kv-seq", 1, 1 << 24, &M)) ||
      (r = cli_int(&a, "--repeat", 1, BENCH_MAX_REPEATS, &repeat)) || (r = cli_int(&a, "--window", 0, 1 << 24, &window)))
    return r;
  if (!G) G = H;
  if (!M) M = N;
  if (H % G) return cli_fail(CLI_EXIT_USAGE, "--heads (%lld) must be a multiple of --kv-heads (%lld)", H, G);
  attn_causal causal = ATTN_CAUSAL_NONE;
  const char *cs = cli_get(&a, "--causal");
  if (cs) {
    if (!*cs || !strcmp(cs, "top-left")) causal = ATTN_CAUSAL_TOP_LEFT;
    else if (!strcmp(cs, "bottom-right")) causal = ATTN_CAUSAL_BOTTOM_RIGHT;
    else return cli_fail(CLI_EXIT_USAGE, "--causal wants nothing, =top-left or =bottom-right, got '%s'", cli_show(cs));
  }
  if (window > 0 && causal == ATTN_CAUSAL_NONE) causal = ATTN_CAUSAL_TOP_LEFT; /* as the library reads a window */
  const int64_t kept = M - (int64_t)(padding * (double)M); /* keys [0, kept) of each row are not padding */
  double pairs = 0; /* visible (query, key) pairs of one head */
  for (int64_t i = 0; i < N; i++) {
    const int64_t qpos = causal == ATTN_CAUSAL_BOTTOM_RIGHT ? i + M - N : i;
    const int64_t end = causal_end(causal, i, N, M) < kept ? causal_end(causal, i, N, M) : kept;
    const int64_t begin = window > 0 && qpos - window + 1 > 0 ? qpos - window + 1 : 0; /* the window's first key */
    pairs += end > begin ? (double)(end - begin) : 0;
  }
  const double fwd_gflop = 4.0 * (double)D * pairs * (double)(B * H) * 1e-9;
  /* --backward also times forward + backward and the backward alone */
  if ((r = check_work(&a, "sdpa",
                      fwd_gflop * (backward ? 1 + FWD_BWD_FLOP_FACTOR + BWD_FLOP_FACTOR : 1) * min_runs(repeat))))
    return r;
  const double qn = (double)B * H * N * D, kn = (double)B * G * M * D;
  /* q, k, v, out; with --backward also dout, dq, dk, dv and lse */
  const double io_bytes = 4.0 * (2 * qn + 2 * kn) * (backward ? 2 : 1) + (backward ? 4.0 * B * H * N : 0);
  if ((r = check_fits(io_bytes))) return r;
  attn_ctx *ctx;
  if ((r = bench_ctx(&a, &ctx))) return r;

  sdpa_case c;
  memset(&c, 0, sizeof c);
  c.ctx = ctx;
  report rep;
  memset(&rep, 0, sizeof rep);
  int64_t qs[4] = {B, H, N, D}, ks[4] = {B, G, M, D};
  if (attn_tensor_alloc(ctx, &c.q, ATTN_F32, 4, qs) || attn_tensor_alloc(ctx, &c.k, ATTN_F32, 4, ks) ||
      attn_tensor_alloc(ctx, &c.v, ATTN_F32, 4, ks) || attn_tensor_alloc(ctx, &c.out, ATTN_F32, 4, qs)) {
    r = cli_fail(CLI_EXIT_FAIL, "out of memory: %s", attn_ctx_error(ctx));
    goto done;
  }
  fill(c.q.data, attn_tensor_numel(&c.q), 1, 1.0f);
  fill(c.k.data, attn_tensor_numel(&c.k), 2, 1.0f);
  fill(c.v.data, attn_tensor_numel(&c.v), 3, 1.0f);
  fill(c.out.data, attn_tensor_numel(&c.out), 4, 1.0f); /* a kernel that skips rows cannot look right */
  attn_sdpa_opts_init(&c.o);
  c.o.causal = causal;
  c.o.window = window;
  if (kept < M) {
    /* padded keys hold NaN, as the unused tail of a buffer may: hidden keys are never read, and the oracle check says so */
    int64_t ps[2] = {B, M};
    if (attn_tensor_alloc(ctx, &c.kpm, ATTN_BOOL, 2, ps)) {
      r = cli_fail(CLI_EXIT_FAIL, "out of memory: %s", attn_ctx_error(ctx));
      goto done;
    }
    for (int64_t e = 0; e < B * M; e++) ((uint8_t *)c.kpm.data)[e] = e % M >= kept;
    for (int64_t row = 0; row < B * G; row++)
      for (int64_t j = kept; j < M; j++)
        for (int64_t d = 0; d < D; d++)
          ((float *)c.k.data)[(row * M + j) * D + d] = ((float *)c.v.data)[(row * M + j) * D + d] = NAN;
    c.o.key_padding = &c.kpm;
  }
  if (backward) {
    int64_t ls[3] = {B, H, N};
    if (attn_tensor_alloc(ctx, &c.lse, ATTN_F32, 3, ls) || attn_tensor_alloc(ctx, &c.dout, ATTN_F32, 4, qs) ||
        attn_tensor_alloc(ctx, &c.dq, ATTN_F32, 4, qs) || attn_tensor_alloc(ctx, &c.dk, ATTN_F32, 4, ks) ||
        attn_tensor_alloc(ctx, &c.dv, ATTN_F32, 4, ks)) {
      r = cli_fail(CLI_EXIT_FAIL, "out of memory: %s", attn_ctx_error(ctx));
      goto done;
    }
    fill(c.dout.data, attn_tensor_numel(&c.dout), 5, 1.0f);
    fill(c.dq.data, attn_tensor_numel(&c.dq), 6, 1.0f); /* as out: a skipped row cannot look right */
  }

  if ((r = time_runs(run_sdpa, &c, repeat, &rep.t))) {
    r = cli_fail(CLI_EXIT_FAIL, "sdpa: %s", r == ATTN_E_NOMEM && !*attn_ctx_error(ctx) ? "out of memory"
                                                                                        : attn_ctx_error(ctx));
    goto done;
  }
  /* forward (with lse) + backward first: it leaves the out and lse the backward alone then reads */
  if (backward && ((r = time_runs(run_sdpa_fwd_bwd, &c, repeat, &rep.tfb)) ||
                   (r = time_runs(run_sdpa_backward, &c, repeat, &rep.tb)))) {
    r = cli_fail(CLI_EXIT_FAIL, "sdpa backward: %s", r == ATTN_E_NOMEM && !*attn_ctx_error(ctx)
                                                           ? "out of memory" : attn_ctx_error(ctx));
    goto done;
  }
  rep.backward = backward;
  rep.rss_mib = peak_rss_mib();
  rep.io_mib = io_bytes / 1048576.0;
  rep.op = "sdpa";
  rep.batch = B; rep.heads = H; rep.kv_heads = G; rep.seq = N; rep.kv_seq = M; rep.dim = D;
  rep.causal = causal == ATTN_CAUSAL_NONE ? "none" : causal == ATTN_CAUSAL_TOP_LEFT ? "top-left" : "bottom-right";
  rep.threads = attn_ctx_threads(ctx);
  rep.kernel = attn_kernel_name(attn_ctx_kernel(ctx));
  rep.attn_gflop = rep.gflop = fwd_gflop;
  rep.peak_gflops = measure_peak(rep.threads, &rep.isa);
  if ((r = sdpa_oracle(&c, &rep, pairs))) goto done;
  if (backward && (r = sdpa_backward_oracle(&c, &rep, pairs))) goto done;
  print_report(&rep, cli_has(&a, "--json"));
done:
  attn_tensor_free(&c.q); attn_tensor_free(&c.k); attn_tensor_free(&c.v); attn_tensor_free(&c.out);
  attn_tensor_free(&c.lse); attn_tensor_free(&c.dout); attn_tensor_free(&c.dq); attn_tensor_free(&c.dk);
  attn_tensor_free(&c.dv); attn_tensor_free(&c.kpm);
  attn_ctx_destroy(ctx);
  return r;
}

/* ---- attn bench mha ----------------------------------------------------------------- */
typedef struct mha_case {
  attn_ctx *ctx;
  attn_mha *mha;
  attn_tensor x, out;
} mha_case;

static int run_mha(void *arg) {
  mha_case *c = arg;
  return attn_mha_forward(c->ctx, c->mha, &c->out, NULL, &c->x, NULL, NULL, NULL);
}

/* The float64 layer on all batches, on batch 0, or on batch 0's last query rows
 * (queries from those rows, keys and values from every row: the same outputs as
 * self-attention gives those rows), whichever is the largest that stays cheap. */
static int mha_oracle(mha_case *c, report *rep) {
  const int64_t B = c->x.shape[0], N = c->x.shape[1], E = c->x.shape[2];
  const double per_batch = 4.0 * N * N * E + 8.0 * N * E * E;
  const int64_t n = N < 64 ? N : 64;
  const double rows_flop = 2.0 * n * E * E * 2 + 4.0 * N * E * E + 4.0 * n * N * E;
  int64_t b = B, r0 = 0, rows = N;
  int cross = 0;
  if (per_batch * (double)B <= ORACLE_MAX_FLOP) {
    snprintf(rep->subset, sizeof rep->subset, "all");
  } else if (per_batch <= ORACLE_MAX_FLOP) {
    b = 1;
    snprintf(rep->subset, sizeof rep->subset, "batch 0 (all %lld rows)", (long long)N);
  } else if (rows_flop <= ORACLE_MAX_FLOP) {
    b = 1;
    r0 = N - n;
    rows = n;
    cross = 1;
    snprintf(rep->subset, sizeof rep->subset, "batch 0 query rows %lld..%lld of %lld (keys and values from all rows)",
             (long long)r0, (long long)(N - 1), (long long)N);
  } else {
    rep->oracle_err = NAN;
    rep->oracle_s = NAN;
    snprintf(rep->subset, sizeof rep->subset, "skipped (even 64 rows need ~%.0f GFLOP of float64, ~%.0f s at ~1 GFLOP/s)",
             rows_flop * 1e-9, rows_flop * 1e-9);
    return 0;
  }
  attn_ctx *rctx;
  if (attn_ctx_create(&rctx)) return cli_fail(CLI_EXIT_FAIL, "oracle: out of memory");
  attn_ctx_set_threads(rctx, attn_ctx_threads(c->ctx));
  attn_ctx_set_kernel(rctx, ATTN_KERNEL_REF);
  attn_tensor xs = c->x, kv = c->x, ref;
  xs.shape[0] = kv.shape[0] = b;
  xs.data = (float *)c->x.data + r0 * E;
  xs.shape[1] = rows;
  int64_t os[3] = {b, rows, E};
  int ret = 0;
  if (attn_tensor_alloc(rctx, &ref, ATTN_F64, 3, os)) {
    attn_ctx_destroy(rctx);
    return cli_fail(CLI_EXIT_FAIL, "oracle: out of memory");
  }
  const double t0 = cli_now();
  if (attn_mha_forward(rctx, c->mha, &ref, NULL, &xs, cross ? &kv : NULL, cross ? &kv : NULL, NULL)) {
    ret = cli_fail(CLI_EXIT_FAIL, "oracle: %s", attn_ctx_error(rctx));
  } else {
    rep->oracle_s = cli_now() - t0;
    double num = 0, den = 0;
    for (int64_t bb = 0; bb < b; bb++)
      for (int64_t i = 0; i < rows; i++)
        for (int64_t e = 0; e < E; e++) {
          const double x = ((const float *)c->out.data)[(bb * N + r0 + i) * E + e];
          const double y = ((const double *)ref.data)[(bb * rows + i) * E + e];
          num += (x - y) * (x - y);
          den += y * y;
        }
    rep->oracle_err = den > 0 ? sqrt(num / den) : sqrt(num);
  }
  attn_tensor_free(&ref);
  attn_ctx_destroy(rctx);
  return ret;
}

static int bench_mha(int argc, char **argv) {
  static const char *const known[] = {"--batch", "--seq", "--embed", "--heads", "--threads", "--repeat", "--kernel",
                                      "--max-gflop", NULL};
  static const char *const switches[] = {"--json", "--backward", NULL};
  cli_args a;
  int r = cli_parse(&a, argc, argv, known, switches);
  if (r) return r;
  if (cli_has(&a, "--backward")) return cli_fail(CLI_EXIT_USAGE, "bench mha --backward: not implemented yet");
  long long B, N, E, H, repeat = 0;
  if ((r = need_int(&a, "mha", "--batch", 1 << 20, &B)) || (r = need_int(&a, "mha", "--seq", 1 << 24, &N)) ||
      (r = need_int(&a, "mha", "--embed", 1 << 20, &E)) || (r = need_int(&a, "mha", "--heads", 1 << 16, &H)) ||
      (r = cli_int(&a, "--repeat", 1, BENCH_MAX_REPEATS, &repeat)))
    return r;
  if (E % H) return cli_fail(CLI_EXIT_USAGE, "--embed (%lld) must be a multiple of --heads (%lld)", E, H);
  const double attn_gflop = 4.0 * (double)B * H * N * N * (double)(E / H) * 1e-9;
  const double proj_gflop = 4 * 2.0 * (double)B * N * E * E * 1e-9;
  if ((r = check_work(&a, "mha", (attn_gflop + proj_gflop) * min_runs(repeat)))) return r;
  if ((r = check_fits(4.0 * (6.0 * B * N * E + 4.0 * E * E)))) return r;
  attn_ctx *ctx;
  if ((r = bench_ctx(&a, &ctx))) return r;

  mha_case c;
  memset(&c, 0, sizeof c);
  c.ctx = ctx;
  report rep;
  memset(&rep, 0, sizeof rep);
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, E, H); /* with biases, as nn.MultiheadAttention */
  if (attn_mha_create(ctx, &c.mha, &cfg)) {
    r = cli_fail(CLI_EXIT_FAIL, "mha: %s", attn_ctx_error(ctx));
    goto done;
  }
  double param_bytes = 0;
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, c.mha, (attn_mha_param)p)) continue;                   /* no such bias */
    fill(t.data, attn_tensor_numel(&t), 100 + (uint64_t)p, (float)(1.0 / sqrt((double)E))); /* nn.Linear's range */
    param_bytes += 4.0 * (double)attn_tensor_numel(&t);
  }
  int64_t xs[3] = {B, N, E};
  if (attn_tensor_alloc(ctx, &c.x, ATTN_F32, 3, xs) || attn_tensor_alloc(ctx, &c.out, ATTN_F32, 3, xs)) {
    r = cli_fail(CLI_EXIT_FAIL, "out of memory: %s", attn_ctx_error(ctx));
    goto done;
  }
  fill(c.x.data, attn_tensor_numel(&c.x), 1, 1.0f);
  fill(c.out.data, attn_tensor_numel(&c.out), 4, 1.0f);

  if ((r = time_runs(run_mha, &c, repeat, &rep.t))) {
    r = cli_fail(CLI_EXIT_FAIL, "mha: %s", r == ATTN_E_NOMEM && !*attn_ctx_error(ctx) ? "out of memory"
                                                                                      : attn_ctx_error(ctx));
    goto done;
  }
  rep.rss_mib = peak_rss_mib();
  rep.io_mib = (2.0 * 4.0 * (double)B * N * E + param_bytes) / 1048576.0; /* x, out and the parameters */
  rep.op = "mha";
  rep.batch = B; rep.heads = H; rep.kv_heads = H; rep.seq = N; rep.kv_seq = N; rep.dim = E / H; rep.embed = E;
  rep.causal = "none";
  rep.threads = attn_ctx_threads(ctx);
  rep.kernel = attn_kernel_name(attn_ctx_kernel(ctx));
  rep.attn_gflop = attn_gflop;
  rep.proj_gflop = proj_gflop;
  rep.gflop = rep.attn_gflop + rep.proj_gflop;
  rep.peak_gflops = measure_peak(rep.threads, &rep.isa);
  if ((r = mha_oracle(&c, &rep))) goto done;
  print_report(&rep, cli_has(&a, "--json"));
done:
  attn_tensor_free(&c.x); attn_tensor_free(&c.out);
  attn_mha_destroy(c.mha);
  attn_ctx_destroy(ctx);
  return r;
}

/* ---- attn bench decode ---------------------------------------------------------------- */
/* The read-bandwidth yardstick the decode kernel is held to: threads threads
 * each sum their share of an array of floats (eight running vector sums, so
 * the adds keep up with the loads). It must stream K and V once, nothing else. */
static double sum_pass(const float *x, size_t n, int threads) {
  double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
#ifdef _OPENMP
    const size_t t = (size_t)omp_get_thread_num(), nt = (size_t)omp_get_num_threads();
#else
    const size_t t = 0, nt = 1;
#endif
    const size_t lo = n / nt * t, hi = t + 1 == nt ? n : n / nt * (t + 1);
    typedef float v4 __attribute__((vector_size(16)));
    v4 s[8];
    memset(s, 0, sizeof s);
    for (size_t i = lo; i + 32 <= hi; i += 32)
      for (int k = 0; k < 8; k++) {
        v4 xv;
        memcpy(&xv, x + i + 4 * k, sizeof xv);
        s[k] += xv;
      }
    for (int k = 1; k < 8; k++) s[0] += s[k];
    total = s[0][0] + s[0][1] + s[0][2] + s[0][3];
  }
  return total;
}

/* A 512 MiB array for sum_pass, faulted in by the threads that read it. */
#define READ_BW_BYTES ((size_t)512 << 20)
static float *read_bw_array(int threads) {
  const size_t n = READ_BW_BYTES / sizeof(float);
  float *x = malloc(READ_BW_BYTES);
  if (!x) return NULL;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (size_t i = 0; i < n; i++) x[i] = (float)(i & 1023) * 1e-3f;
  return x;
}

/* GB/s of one pass over the array. */
static double read_pass_gbs(const float *x, int threads, double *sink) {
  const double t0 = cli_now();
  *sink += sum_pass(x, READ_BW_BYTES / sizeof(float), threads);
  return (double)READ_BW_BYTES / (cli_now() - t0) * 1e-9;
}

/* Caches smaller than this are cycled through copies, so that each timed step
 * reads from memory as a real model's many layers would, not from L3. */
#define DECODE_COLD_BYTES ((double)(256 << 20))
#define DECODE_MAX_COPIES 16
#define DECODE_PAIRS 20 /* decoding steps each followed by a read pass */

typedef struct decode_case {
  attn_ctx *ctx;
  attn_tensor q, out, k[DECODE_MAX_COPIES], v[DECODE_MAX_COPIES];
  int copies, next;
  attn_sdpa_opts o;
} decode_case;

static int run_decode(void *arg) {
  decode_case *c = arg;
  const int i = c->next;
  c->next = (c->next + 1) % c->copies;
  return attn_sdpa(c->ctx, &c->out, NULL, NULL, &c->q, &c->k[i], &c->v[i], &c->o);
}

/* Fills a tensor of f32, f16 or bf16 with fixed-seed uniform values in (-1, 1). */
static void fill_typed(attn_tensor *t, uint64_t seed) {
  const int64_t n = attn_tensor_numel(t);
  uint64_t s = seed;
  for (int64_t i = 0; i < n; i++) {
    const float x = rng_uniform(&s);
    if (t->dtype == ATTN_F32) ((float *)t->data)[i] = x;
    else ((uint16_t *)t->data)[i] = t->dtype == ATTN_F16 ? attn__f32_to_f16(x) : attn__f32_to_bf16(x);
  }
}

/* The oracle on batch 0's first kv head and its query heads: every key. */
static double decode_oracle(decode_case *c, int64_t group) {
  attn_tensor q = c->q, k = c->k[0], v = c->v[0], out = c->out;
  q.shape[0] = k.shape[0] = v.shape[0] = out.shape[0] = 1;
  q.shape[1] = out.shape[1] = group;
  k.shape[1] = v.shape[1] = 1;
  const int64_t n = group * out.shape[2] * out.shape[3];
  double *ref = malloc((size_t)n * sizeof(double));
  if (!ref) return NAN;
  const int64_t rs[4] = {1, group, out.shape[2], out.shape[3]};
  attn_tensor tr = attn_tensor_view(ref, ATTN_F64, 4, rs);
  double err = NAN;
  if (attn_sdpa_ref(c->ctx, &tr, NULL, NULL, &q, &k, &v, &c->o) == ATTN_OK) {
    double num = 0, den = 0;
    for (int64_t h = 0; h < group; h++)
      for (int64_t i = 0; i < out.shape[2]; i++)
        for (int64_t d = 0; d < out.shape[3]; d++) {
          const double x = ((const float *)out.data)[h * out.strides[1] + i * out.strides[2] + d],
                       y = ref[(h * out.shape[2] + i) * out.shape[3] + d];
          num += (x - y) * (x - y), den += y * y;
        }
    err = sqrt(num / (den > 0 ? den : 1));
  }
  free(ref);
  return err;
}

/* The same steps over an f32 copy of c's cache, in turn with c's own: the
 * median of the pairs' time ratios (f32 over dt), so the machine's drift
 * cancels. 0 or an exit code. */
static int half_speedup(decode_case *c, attn_dtype dt, double *speedup) {
  decode_case f = *c;
  f.next = 0;
  int bad = 0, r = 0;
  for (int i = 0; i < c->copies; i++) memset(&f.k[i], 0, sizeof f.k[i]), memset(&f.v[i], 0, sizeof f.v[i]);
  for (int i = 0; i < c->copies && !bad; i++) {
    bad = attn_tensor_alloc(c->ctx, &f.k[i], ATTN_F32, 4, c->k[i].shape) ||
          attn_tensor_alloc(c->ctx, &f.v[i], ATTN_F32, 4, c->v[i].shape);
    for (int64_t e = 0; !bad && e < attn_tensor_numel(&c->k[i]); e++) {
      ((float *)f.k[i].data)[e] = (float)attn__load(c->k[i].data, dt, e);
      ((float *)f.v[i].data)[e] = (float)attn__load(c->v[i].data, dt, e);
    }
  }
  double ratios[DECODE_PAIRS];
  if (bad) r = cli_fail(CLI_EXIT_FAIL, "out of memory for the f32 copy of the cache");
  for (int i = -1; !r && i < DECODE_PAIRS; i++) { /* i = -1 warms both */
    double t0 = cli_now();
    if (run_decode(c)) r = 1;
    const double th = cli_now() - t0;
    t0 = cli_now();
    if (run_decode(&f)) r = 1;
    if (i >= 0) ratios[i] = (cli_now() - t0) / th;
  }
  if (r == 1) r = cli_fail(CLI_EXIT_FAIL, "decode: %s", attn_ctx_error(c->ctx));
  if (!r) {
    qsort(ratios, DECODE_PAIRS, sizeof ratios[0], cmp_double);
    *speedup = 0.5 * (ratios[DECODE_PAIRS / 2 - 1] + ratios[DECODE_PAIRS / 2]);
  }
  for (int i = 0; i < c->copies; i++) attn_tensor_free(&f.k[i]), attn_tensor_free(&f.v[i]);
  return r;
}

static int bench_decode(int argc, char **argv) {
  static const char *const known[] = {"--batch", "--kv-seq", "--heads", "--kv-heads", "--dim", "--seq", "--dtype",
                                      "--threads", "--repeat", "--kernel", "--max-gflop", NULL};
  static const char *const switches[] = {"--json", "--compare", NULL};
  cli_args a;
  int r = cli_parse(&a, argc, argv, known, switches);
  if (r) return r;
  long long B, L, H, G = 0, D, N = 1, repeat = 0;
  if ((r = need_int(&a, "decode", "--batch", 1 << 20, &B)) || (r = need_int(&a, "decode", "--kv-seq", 1 << 26, &L)) ||
      (r = need_int(&a, "decode", "--heads", 1 << 16, &H)) || (r = need_int(&a, "decode", "--dim", 1 << 16, &D)) ||
      (r = cli_int(&a, "--kv-heads", 1, 1 << 16, &G)) || (r = cli_int(&a, "--seq", 1, 1 << 16, &N)) ||
      (r = cli_int(&a, "--repeat", 1, BENCH_MAX_REPEATS, &repeat)))
    return r;
  if (!G) G = H;
  if (H % G) return cli_fail(CLI_EXIT_USAGE, "--heads (%lld) must be a multiple of --kv-heads (%lld)", H, G);
  attn_dtype dt = ATTN_F32;
  const char *ds = cli_get(&a, "--dtype");
  if (ds) {
    if (!strcmp(ds, "f32")) dt = ATTN_F32;
    else if (!strcmp(ds, "f16")) dt = ATTN_F16;
    else if (!strcmp(ds, "bf16")) dt = ATTN_BF16;
    else return cli_fail(CLI_EXIT_USAGE, "--dtype wants f32, f16 or bf16, got '%s'", cli_show(ds));
  }
  {
    /* the timed steps, one more for the oracle, the paired passes; --compare: the blocked kernel's
     * timed steps, the f32 cache's 2 x 21 steps in turn, and a full recompute of L rows (L <= 8192) */
    const int compare = cli_has(&a, "--compare");
    const double step = 4.0 * (double)B * H * N * L * D * 1e-9, full = 2.0 * (double)B * H * L * L * D * 1e-9;
    double steps = min_runs(repeat) + 1 + DECODE_PAIRS, extra = 0;
    if (compare) steps += min_runs(repeat) + (dt != ATTN_F32 ? 2 * (DECODE_PAIRS + 1) : 0);
    if (compare && L <= 8192) extra = full * min_runs(repeat < 3 ? repeat : 3);
    if ((r = check_work(&a, "decode", step * steps + extra))) return r;
  }
  const double cache_bytes = 2.0 * (double)B * G * L * D * (double)attn_dtype_size(dt);
  int copies = cache_bytes >= DECODE_COLD_BYTES ? 1 : (int)ceil(DECODE_COLD_BYTES / cache_bytes);
  if (copies > DECODE_MAX_COPIES) copies = DECODE_MAX_COPIES;
  if ((r = check_fits(copies * cache_bytes + 8.0 * B * H * N * D))) return r;
  attn_ctx *ctx;
  if ((r = bench_ctx(&a, &ctx))) return r;
  decode_case c;
  memset(&c, 0, sizeof c);
  c.ctx = ctx;
  c.copies = copies;
  const int64_t qs[4] = {B, H, N, D}, ks[4] = {B, G, L, D};
  int bad = attn_tensor_alloc(ctx, &c.q, ATTN_F32, 4, qs) || attn_tensor_alloc(ctx, &c.out, ATTN_F32, 4, qs);
  for (int i = 0; i < copies && !bad; i++)
    bad = attn_tensor_alloc(ctx, &c.k[i], dt, 4, ks) || attn_tensor_alloc(ctx, &c.v[i], dt, 4, ks);
  double step_s = NAN, blocked_s = NAN, full_s = NAN, err = NAN, read_gbs = NAN, fraction = NAN, speedup = NAN;
  timing t, tb, tf;
  memset(&tb, 0, sizeof tb), memset(&tf, 0, sizeof tf);
  if (bad) {
    r = cli_fail(CLI_EXIT_FAIL, "out of memory: %s", attn_ctx_error(ctx));
    goto done;
  }
  fill_typed(&c.q, 1);
  fill_typed(&c.out, 4);
  for (int i = 0; i < copies; i++) fill_typed(&c.k[i], 2 + 2 * (uint64_t)i), fill_typed(&c.v[i], 3 + 2 * (uint64_t)i);
  attn_sdpa_opts_init(&c.o);
  c.o.causal = ATTN_CAUSAL_BOTTOM_RIGHT; /* the new tokens are the cache's last */
  if ((r = time_runs(run_decode, &c, repeat, &t))) {
    r = cli_fail(CLI_EXIT_FAIL, "decode: %s", attn_ctx_error(ctx));
    goto done;
  }
  step_s = t.median_s;
  c.next = 0; /* the oracle reads copy 0: the output must be copy 0's */
  if ((r = run_decode(&c))) {
    r = cli_fail(CLI_EXIT_FAIL, "decode: %s", attn_ctx_error(ctx));
    goto done;
  }
  err = decode_oracle(&c, H / G);
  if (cli_has(&a, "--compare") && dt != ATTN_F32 && (r = half_speedup(&c, dt, &speedup))) goto done;
  if (cli_has(&a, "--compare")) {
    /* the same step through the blocked (prefill) kernel, and without a cache: all L rows again */
    attn_ctx *bctx;
    setenv("ATTN_DECODE", "0", 1);
    const int made = attn_ctx_create(&bctx) == ATTN_OK;
    unsetenv("ATTN_DECODE");
    if (!made) {
      r = cli_fail(CLI_EXIT_FAIL, "out of memory");
      goto done;
    }
    attn_ctx_set_threads(bctx, attn_ctx_threads(ctx));
    attn_ctx_set_kernel(bctx, attn_ctx_kernel(ctx));
    c.ctx = bctx;
    r = time_runs(run_decode, &c, repeat, &tb);
    blocked_s = tb.median_s;
    decode_case f = c;
    attn_tensor fq, fo;
    memset(&fq, 0, sizeof fq), memset(&fo, 0, sizeof fo);
    const int64_t fs[4] = {B, H, L, D};
    /* (a full recompute is quadratic in L: only where it takes seconds, not hours) */
    if (!r && L <= 8192 && !attn_tensor_alloc(ctx, &fq, ATTN_F32, 4, fs) && !attn_tensor_alloc(ctx, &fo, ATTN_F32, 4, fs)) {
      fill_typed(&fq, 5);
      f.q = fq, f.out = fo, f.copies = 1, f.next = 0, f.ctx = ctx;
      r = time_runs(run_decode, &f, repeat < 3 ? repeat : 3, &tf);
      full_s = tf.median_s;
    }
    attn_tensor_free(&fq), attn_tensor_free(&fo);
    c.ctx = ctx;
    attn_ctx_destroy(bctx);
    if (r) {
      r = cli_fail(CLI_EXIT_FAIL, "decode --compare: %s", attn_ctx_error(ctx));
      goto done;
    }
  }
  {
    /* The machine's read bandwidth drifts from moment to moment on a shared
     * host, so each decoding step is paired with a read pass right after it:
     * the fraction is the median of the pairs' ratios; read_gbs their best pass. */
    const int threads = attn_ctx_threads(ctx);
    float *bw = read_bw_array(threads);
    if (!bw) {
      r = cli_fail(CLI_EXIT_FAIL, "out of memory for the read-bandwidth array");
      goto done;
    }
    double sink = 0, ratios[DECODE_PAIRS];
    read_gbs = 0;
    read_pass_gbs(bw, threads, &sink); /* warm */
    for (int i = 0; i < DECODE_PAIRS; i++) {
      const double t0 = cli_now();
      if ((r = run_decode(&c))) {
        free(bw);
        r = cli_fail(CLI_EXIT_FAIL, "decode: %s", attn_ctx_error(ctx));
        goto done;
      }
      const double step = cli_now() - t0, g = read_pass_gbs(bw, threads, &sink);
      if (g > read_gbs) read_gbs = g;
      ratios[i] = cache_bytes / step * 1e-9 / g;
    }
    free(bw);
    qsort(ratios, DECODE_PAIRS, sizeof ratios[0], cmp_double);
    fraction = 0.5 * (ratios[DECODE_PAIRS / 2 - 1] + ratios[DECODE_PAIRS / 2]) + (sink == -1.0 ? 1 : 0);
  }
  {
    const double gbs = cache_bytes / step_s * 1e-9;
    const int threads = attn_ctx_threads(ctx);
    const char *kernel = attn_kernel_name(attn_ctx_kernel(ctx));
    if (cli_has(&a, "--json")) {
      printf("{\"op\":\"decode\",\"batch\":%lld,\"kv_seq\":%lld,\"heads\":%lld,\"kv_heads\":%lld,\"dim\":%lld,"
             "\"seq\":%lld,\"dtype\":\"%s\",\"threads\":%d,\"kernel\":\"%s\",\"cache_copies\":%d,",
             B, L, H, G, D, N, attn_dtype_name(dt), threads, kernel, copies);
      json_num("median_s", step_s, 0);
      json_num("min_s", t.min_s, 0);
      printf("\"repeats\":%lld,", t.repeats);
      json_num("cache_bytes", cache_bytes, 0);
      json_num("read_gbs", gbs, 0);
      json_num("measured_read_gbs", read_gbs, 0);
      json_num("fraction_of_read_bw", fraction, 0);
      json_num("blocked_kernel_s", blocked_s, 0);
      json_num("full_recompute_s", full_s, 0);
      json_num("speedup_over_f32", speedup, 0);
      json_num("oracle_rel_l2", err, 1);
      printf("}\n");
    } else {
      printf("decode B=%lld L=%lld Hq=%lld Hk=%lld D=%lld Nq=%lld %s | kernel %s, %d threads | median %.4g ms of %lld "
             "(min %.4g ms) | cache %.1f MiB read at %.2f GB/s | %.1f%% of the read bandwidth measured beside it "
             "(median of %d paired passes; best pass %.2f GB/s)",
             B, L, H, G, D, N, attn_dtype_name(dt), kernel, threads, step_s * 1e3, t.repeats, t.min_s * 1e3,
             cache_bytes / 1048576.0, gbs, 100 * fraction, DECODE_PAIRS, read_gbs);
      if (copies > 1) printf(" (%d copies cycled, so each step reads memory)", copies);
      printf(" | oracle rel L2 %.2e on batch 0, kv head 0", err);
      if (isfinite(blocked_s))
        printf("\n  same step through the blocked kernel: %.4g ms (decode %.2fx faster)", blocked_s * 1e3, blocked_s / step_s);
      if (isfinite(speedup)) printf("\n  %s cache against the same cache in f32, step by step in turn: %.2fx faster",
                                    attn_dtype_name(dt), speedup);
      if (isfinite(full_s))
        printf("; full recompute of all %lld rows: %.4g ms (%.1fx)", L, full_s * 1e3, full_s / step_s);
      printf("\n");
    }
  }
done:
  attn_tensor_free(&c.q), attn_tensor_free(&c.out);
  for (int i = 0; i < copies; i++) attn_tensor_free(&c.k[i]), attn_tensor_free(&c.v[i]);
  attn_ctx_destroy(ctx);
  return r;
}

int cmd_bench(int argc, char **argv) {
  if (argc < 1)
    return cli_fail(CLI_EXIT_USAGE, "bench needs an operation: 'attn bench sdpa ...', 'attn bench mha ...' or 'attn bench decode ...'");
  if (!strcmp(argv[0], "sdpa")) return bench_sdpa(argc - 1, argv + 1);
  if (!strcmp(argv[0], "mha")) return bench_mha(argc - 1, argv + 1);
  if (!strcmp(argv[0], "decode")) return bench_decode(argc - 1, argv + 1);
  return cli_fail(CLI_EXIT_USAGE, "bench: unknown operation '%s'; want sdpa, mha or decode", cli_show(argv[0]));
}
