/* attn bench: what every operation shares — inputs, timing, the machine's FMA
 * peak, the limits a case is held to, and the report (see common.h). */
#include "common.h"

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
float bench_uniform(uint64_t *s) {
  const uint64_t u = rng_next(s) >> 41; /* 23 bits */
  return (float)(((double)u + 0.5) * (2.0 / 8388608.0) - 1.0);
}

void bench_fill(float *x, int64_t n, uint64_t seed, float scale) {
  uint64_t s = seed;
  for (int64_t i = 0; i < n; i++) x[i] = scale * bench_uniform(&s);
}

/* ---- timing -------------------------------------------------------------------- */
int bench_cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

#define BENCH_TARGET_S 1.0

/* Warm-up (a second run when the first was quick), then repeat runs.
 * repeat 0: enough runs for about BENCH_TARGET_S, at least 3. Returns 0 or a status. */
int bench_time_runs(bench_fn fn, void *arg, long long repeat, timing *t) {
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
  qsort(times, (size_t)r, sizeof *times, bench_cmp_double);
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

/* vdpbf16ps: 16 lanes of two bf16 products added to fp32, 4 flops per lane. */
__attribute__((target("avx512f,avx512bf16"))) static float bf16_dot_chains(long long iters, float a) {
  const __m512bh va = _mm512_cvtne2ps_pbh(_mm512_set1_ps(a), _mm512_set1_ps(a));
#define DECL(i) __m512 c##i = _mm512_set1_ps(1.0f + 0.001f * (float)(i));
  STEP16(DECL)
#undef DECL
  for (long long n = 0; n < iters; n++) {
#define STEP(i) c##i = _mm512_dpbf16_ps(c##i, va, va);
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

/* tdpbf16ps: 16 x 16 fp32 sums of 32 products each; six independent tiles a step */
#define AMX_TDP_FLOPS 16384.0
#define AMX_TDP_PER_STEP 6
#if defined(__x86_64__) && defined(ATTN_HAVE_AMX)
/* tdpbf16ps: six independent 16 x 16 fp32 tiles, each += (16 x 32 bf16) x (32 x 16 bf16), 16384 flops. */
typedef struct amx_config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} amx_config;
static const amx_config amx_all_16x64 __attribute__((aligned(64))) = {
    .palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 16}};
__attribute__((target("amx-tile,amx-bf16"))) static float amx_dot_tiles(long long iters) {
  static const uint16_t ones[16 * 32] __attribute__((aligned(64))) = {0};
  float out[16 * 16] __attribute__((aligned(64)));
  _tile_loadconfig(&amx_all_16x64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  for (long long n = 0; n < iters; n++) {
    _tile_dpbf16ps(0, 6, 7); _tile_dpbf16ps(1, 6, 7); _tile_dpbf16ps(2, 6, 7);
    _tile_dpbf16ps(3, 6, 7); _tile_dpbf16ps(4, 6, 7); _tile_dpbf16ps(5, 6, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}
#endif

static const char *const peak_isa_name[] = {"scalar", "avx2+fma", "avx512f", "avx512bf16", "amx_bf16"};

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
#ifdef ATTN_HAVE_AMX
    if (isa == PEAK_AMX_BF16) r = amx_dot_tiles(iters);
    else
#endif
    if (isa == PEAK_AVX512_BF16) r = bf16_dot_chains(iters, b);
    else if (isa == PEAK_AVX512) r = fma_chains_avx512(iters, a, b);
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
static double measure_peak(int threads, peak_isa isa) {
  /* flops per lane and step: an FMA's 2, vdpbf16ps's 4 */
  const int lanes = isa == PEAK_AVX512_BF16 ? 32 : isa == PEAK_AVX512 ? 16 : isa == PEAK_AVX2 ? 8 : 1;
#if defined(__x86_64__)
  const int acc = isa >= PEAK_AVX512 ? PEAK512_ACC : isa == PEAK_AVX2 ? PEAK256_ACC : PEAK_SCALAR_ACC;
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
    const double per_step = isa == PEAK_AMX_BF16 ? AMX_TDP_FLOPS * AMX_TDP_PER_STEP : 2.0 * lanes * acc;
    const double g = per_step * (double)iters * threads / dt * 1e-9;
    if (g > best) best = g;
  }
  return best;
}

double bench_measure_peak(int threads, peak_isa *isa_out) {
  *isa_out = choose_peak_isa();
  return measure_peak(threads, *isa_out);
}

double bench_measure_bf16_peak(int threads, attn_kernel kernel, peak_isa *isa) {
#if defined(__x86_64__)
  *isa = kernel == ATTN_KERNEL_AMX ? PEAK_AMX_BF16 : PEAK_AVX512_BF16;
#ifndef ATTN_HAVE_AMX
  if (*isa == PEAK_AMX_BF16) return 0;
#endif
  if (!attn_kernel_supported(kernel == ATTN_KERNEL_AMX ? ATTN_KERNEL_AMX : ATTN_KERNEL_AVX512_BF16)) return 0;
  return measure_peak(threads, *isa); /* attn_kernel_supported asked Linux for the tile state */
#else
  (void)threads, (void)kernel;
  *isa = PEAK_AVX512_BF16;
  return 0;
#endif
}

/* ---- limits and the command line ------------------------------------------------------ */
double bench_peak_rss_mib(void) {
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru)) return NAN;
  return (double)ru.ru_maxrss / 1024.0; /* KiB on Linux */
}

/* Refuses (exit 1) a case whose arrays alone would not fit in this machine's
 * memory: allocation would succeed lazily and the first touch be killed. */
int bench_check_fits(double bytes) {
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
void bench_json_num(const char *key, double x, int last) {
  if (isfinite(x)) printf("\"%s\":%.6g%s", key, x, last ? "" : ",");
  else printf("\"%s\":null%s", key, last ? "" : ",");
}

static int parse_kernel(const char *s, attn_kernel *k) {
  for (int i = ATTN_KERNEL_AUTO; i <= ATTN_KERNEL_AMX; i++)
    if (!strcmp(s, attn_kernel_name((attn_kernel)i))) {
      *k = (attn_kernel)i;
      return 0;
    }
  return cli_fail(CLI_EXIT_USAGE, "--kernel wants auto, c, avx2, avx512, avx512bf16, amx or ref, got '%s'", cli_show(s));
}

/* The context every case runs on: --threads and --kernel applied. */
int bench_ctx(cli_args *a, attn_ctx **ctx) {
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

/* The compute bound: memory is checked (bench_check_fits), and so is the work, so
 * that a typo cannot start hours of arithmetic. The default, 1e5 GFLOP, is
 * about four minutes at 400 GFLOP/s (two AVX-512 cores at their peak) and
 * above every case of scripts/bench_grid.py. */
#define BENCH_MAX_GFLOP 1e5

/* Refuses (exit 2) a case whose runs would do more than --max-gflop GFLOP in
 * all (gflop: the fewest runs the timing makes; the oracle, on a bounded
 * subset, is not counted). */
int bench_check_work(cli_args *a, const char *op, double gflop) {
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

/* The fewest runs bench_time_runs makes: the warm-up, then R or (unasked) at least 3. */
double bench_min_runs(long long repeat) { return (double)(repeat > 0 ? repeat : 3) + 1; }

/* A required positive integer flag. */
int bench_need_int(cli_args *a, const char *op, const char *name, long long hi, long long *out) {
  if (!cli_has(a, name)) return cli_fail(CLI_EXIT_USAGE, "bench %s needs %s", op, name);
  return cli_int(a, name, 1, hi, out);
}

int bench_dtype(cli_args *a, attn_dtype *dt) {
  const char *ds = cli_get(a, "--dtype");
  *dt = ATTN_F32;
  if (!ds || !strcmp(ds, "f32")) return 0;
  if (!strcmp(ds, "f16")) *dt = ATTN_F16;
  else if (!strcmp(ds, "bf16")) *dt = ATTN_BF16;
  else return cli_fail(CLI_EXIT_USAGE, "--dtype wants f32, f16 or bf16, got '%s'", cli_show(ds));
  return 0;
}

int bench_precision(cli_args *a, attn_ctx *ctx) {
  const char *ps = cli_get(a, "--precision");
  if (!ps) return 0;
  const int k = cli_precision(ps);
  if (k < 0) return CLI_EXIT_USAGE;
  return attn_ctx_set_precision(ctx, (attn_precision)k) ? 1 : 0;
}

/* ---- the report ------------------------------------------------------------------------ */
void bench_print_report(const report *r, int json) {
  const double gflops = r->gflop / r->t.median_s, frac = gflops / r->peak_gflops;
  if (json) {
    printf("{\"op\":\"%s\",\"batch\":%lld,\"heads\":%lld,\"kv_heads\":%lld,\"seq\":%lld,\"kv_seq\":%lld,\"dim\":%lld,",
           r->op, r->batch, r->heads, r->kv_heads, r->seq, r->kv_seq, r->dim);
    if (r->embed) printf("\"embed\":%lld,", r->embed);
    printf("\"causal\":%s,\"causal_align\":\"%s\",\"threads\":%d,\"kernel\":\"%s\",",
           strcmp(r->causal, "none") ? "true" : "false", r->causal, r->threads, r->kernel);
    if (r->dtype) printf("\"dtype\":\"%s\",\"precision\":\"%s\",\"tiles\":\"%s\",", r->dtype, r->precision, r->tiles);
    bench_json_num("median_s", r->t.median_s, 0);
    bench_json_num("min_s", r->t.min_s, 0);
    printf("\"repeats\":%lld,\"warmups\":%d,", r->t.repeats, r->t.warmups);
    bench_json_num("gflop", r->gflop, 0);
    bench_json_num("attn_gflop", r->attn_gflop, 0);
    bench_json_num("proj_gflop", r->proj_gflop, 0);
    bench_json_num("gflops", gflops, 0);
    bench_json_num("peak_gflops", r->peak_gflops, 0);
    printf("\"peak_isa\":\"%s\",", peak_isa_name[r->isa]);
    bench_json_num("fraction_of_peak", frac, 0);
    bench_json_num("peak_rss_mib", r->rss_mib, 0);
    bench_json_num("io_mib", r->io_mib, 0);
    bench_json_num("oracle_rel_l2", r->oracle_err, 0);
    bench_json_num("oracle_s", r->oracle_s, 0);
    printf("\"oracle_subset\":\"%s\"", r->subset);
    if (r->backward) {
      const double bg = BWD_FLOP_FACTOR * r->gflop, fbg = FWD_BWD_FLOP_FACTOR * r->gflop;
      printf(",\"backward\":true,\"backward_tiles\":\"%s\",", r->backward_tiles ? r->backward_tiles : "fp32");
      bench_json_num("backward_median_s", r->tb.median_s, 0);
      bench_json_num("backward_min_s", r->tb.min_s, 0);
      printf("\"backward_repeats\":%lld,", r->tb.repeats);
      bench_json_num("backward_gflop", bg, 0);
      bench_json_num("backward_gflops", bg / r->tb.median_s, 0);
      bench_json_num("backward_fraction_of_peak", bg / r->tb.median_s / r->peak_gflops, 0);
      bench_json_num("fwd_bwd_median_s", r->tfb.median_s, 0);
      bench_json_num("fwd_bwd_min_s", r->tfb.min_s, 0);
      printf("\"fwd_bwd_repeats\":%lld,", r->tfb.repeats);
      bench_json_num("fwd_bwd_gflop", fbg, 0);
      bench_json_num("fwd_bwd_gflops", fbg / r->tfb.median_s, 0);
      bench_json_num("fwd_bwd_fraction_of_peak", fbg / r->tfb.median_s / r->peak_gflops, 0);
      bench_json_num("backward_oracle_rel_l2", r->bwd_oracle_err, 0);
      bench_json_num("backward_oracle_dq_rel_l2", r->bwd_err[0], 0);
      bench_json_num("backward_oracle_dk_rel_l2", r->bwd_err[1], 0);
      bench_json_num("backward_oracle_dv_rel_l2", r->bwd_err[2], 0);
      bench_json_num("backward_oracle_s", r->bwd_oracle_s, 0);
      printf("\"backward_oracle_subset\":\"%s\"", r->bwd_subset);
    }
    printf("}\n");
  } else {
    if (!strcmp(r->op, "sdpa"))
      printf("sdpa B=%lld Hq=%lld Hk=%lld Nq=%lld Nk=%lld D=%lld causal=%s", r->batch, r->heads, r->kv_heads, r->seq,
             r->kv_seq, r->dim, r->causal);
    else
      printf("mha B=%lld N=%lld E=%lld H=%lld (D=%lld)", r->batch, r->seq, r->embed, r->heads, r->dim);
    if (r->dtype) printf(" | %s inputs, precision %s, %s tiles", r->dtype, r->precision, r->tiles);
    printf(" | kernel %s, %d threads | median %.4g ms of %lld (min %.4g ms) | %.2f GFLOP/s", r->kernel, r->threads,
           r->t.median_s * 1e3, r->t.repeats, r->t.min_s * 1e3, gflops);
    if (r->proj_gflop > 0)
      printf(" (%.4g GFLOP: attention %.4g + projections %.4g)", r->gflop, r->attn_gflop, r->proj_gflop);
    else
      printf(" (%.4g GFLOP, visible pairs only)", r->gflop);
    printf(" | %.1f%% of measured peak %.1f GFLOP/s (%s, %d threads)", 100 * frac, r->peak_gflops,
           peak_isa_name[r->isa], r->threads);
    printf(" | peak RSS %.1f MiB (inputs+outputs %.1f MiB)", r->rss_mib, r->io_mib);
    if (isfinite(r->oracle_err)) printf(" | oracle rel L2 %.2e on %s", r->oracle_err, r->subset);
    else printf(" | oracle: %s", r->subset);
    if (r->backward) {
      const double bg = BWD_FLOP_FACTOR * r->gflop, fbg = FWD_BWD_FLOP_FACTOR * r->gflop;
      printf("\n  backward (%s tiles): median %.4g ms of %lld (min %.4g ms) | %.2f GFLOP/s (%.4g GFLOP = %.1fx forward) | "
             "%.1f%% of peak", r->backward_tiles ? r->backward_tiles : "fp32", r->tb.median_s * 1e3, r->tb.repeats, r->tb.min_s * 1e3, bg / r->tb.median_s, bg,
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
