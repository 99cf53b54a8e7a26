/* attn bench: the pieces every operation shares (tools/bench/common.c); one
 * file per operation beside it (sdpa.c, mha.c, decode.c).
 *
 * How fast, against what limit, with how much memory, and how exact.
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
 * kernel (attn_ctx_set_decode(ctx, 0)) and a full recompute of all L rows (no cache), and
 * for an f16/bf16 cache its speed-up over the same cache in f32, the two timed
 * step by step in turn (the median ratio of 20 pairs).
 *
 * Exit: 0 done, 1 out of memory or a library error, 2 a bad command line. */
#ifndef ATTN_BENCH_COMMON_H
#define ATTN_BENCH_COMMON_H

#include "cli.h"

#include <stdint.h>

/* ---- inputs ---- */
/* Uniform on the odd multiples of 2^-24 in (-1, 1), never exactly zero, from a
 * fixed-seed generator: the same numbers on every machine. */
float bench_uniform(uint64_t *s);
/* n such values times scale, from seed. */
void bench_fill(float *x, int64_t n, uint64_t seed, float scale);

/* ---- timing ---- */
typedef int (*bench_fn)(void *arg); /* 0, or an attn_status */

typedef struct timing {
  double median_s, min_s;
  long long repeats;
  int warmups;
} timing;

#define BENCH_MAX_REPEATS 1000000LL

/* qsort's comparison of doubles, ascending. */
int bench_cmp_double(const void *a, const void *b);
/* Warm-up (a second run when the first was quick), then repeat runs.
 * repeat 0: enough runs for about a second, at least 3. Returns 0 or a status. */
int bench_time_runs(bench_fn fn, void *arg, long long repeat, timing *t);
/* The fewest runs bench_time_runs makes: the warm-up, then R or (unasked) at least 3. */
double bench_min_runs(long long repeat);

/* ---- limits of the machine ---- */
typedef enum peak_isa { PEAK_SCALAR, PEAK_AVX2, PEAK_AVX512, PEAK_AVX512_BF16, PEAK_AMX_BF16 } peak_isa;
/* GFLOP/s of threads threads doing fp32 FMAs with the widest FMA this CPU runs (*isa). */
double bench_measure_peak(int threads, peak_isa *isa);
/* GFLOP/s of threads threads on the unit of kernel's bf16 tiles and GEMM:
 * tdpbf16ps (AMX, 16384 flops per instruction) for ATTN_KERNEL_AMX, else
 * vdpbf16ps (4 flops per fp32 lane); *isa says which. 0 where the CPU or
 * build lacks it. */
double bench_measure_bf16_peak(int threads, attn_kernel kernel, peak_isa *isa);
/* The process's peak resident set so far, MiB. */
double bench_peak_rss_mib(void);

/* ---- the command line; each returns 0 or an exit code after printing ---- */
/* Refuses (exit 1) a case whose arrays alone would not fit in this machine's memory. */
int bench_check_fits(double bytes);
/* Refuses (exit 2) a case whose timed runs would do more than --max-gflop GFLOP (gflop). */
int bench_check_work(cli_args *a, const char *op, double gflop);
/* A required positive integer flag in [1, hi]. */
int bench_need_int(cli_args *a, const char *op, const char *name, long long hi, long long *out);
/* The context every case runs on: --threads and --kernel applied. */
int bench_ctx(cli_args *a, attn_ctx **ctx);

/* ---- the report ---- */
/* The oracle runs at roughly 1 GFLOP/s: above this, check a subset (or skip). */
#ifndef ORACLE_MAX_FLOP
#define ORACLE_MAX_FLOP 3e9
#endif
/* The backward's oracle (float64 forward + backward, threaded): one head of N = 2048, D = 64 fits. */
#ifndef ORACLE_BWD_MAX_FLOP
#define ORACLE_BWD_MAX_FLOP 6e9
#endif

/* JSON numbers: non-finite values are null. last: no comma after it. */
void bench_json_num(const char *key, double x, int last);

/* Everything one case of sdpa or mha reports. */
typedef struct report {
  const char *op;
  long long batch, heads, kv_heads, seq, kv_seq, dim, embed;
  const char *causal; /* "none", "top-left", "bottom-right" */
  int threads;
  const char *kernel;
  const char *dtype, *precision; /* of q, k, v (and the layer's parameters); the context's policy */
  const char *tiles;              /* what the forward ran on: "fp32", "bf16" */
  const char *backward_tiles;     /* what the backward ran on: "fp32", "bf16" (--backward) */
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

/* --dtype (f32, f16, bf16; default f32) and --precision (attn_precision's
 * names; default: the context's), both optional. */
int bench_dtype(cli_args *a, attn_dtype *dt);
int bench_precision(cli_args *a, attn_ctx *ctx);
/* One line of text, or one JSON object with --json. */
void bench_print_report(const report *r, int json);

#endif
