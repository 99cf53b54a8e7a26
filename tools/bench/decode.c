/* attn bench decode: new tokens against a key-value cache, measured against
 * this machine's read bandwidth (see common.h for what is reported). The
 * cache is plain [B, Hk, L, D] tensors through attn_sdpa, or (--cache, or
 * any block format: --dtype / --k-dtype / --v-dtype q8_0 or q4_0, or
 * --lengths) an attn_kv_cache through attn_kv_cache_attend, or (--paged
 * BLOCK_TOKENS) an attn_paged_kv_cache through attn_paged_kv_attend. Rows may
 * hold different numbers of tokens (--lengths L1,L2,...): the bytes read are
 * then their sum's. */
#define _DEFAULT_SOURCE /* MADV_HUGEPAGE on glibc */
#include "common.h"
#include "commands.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h> /* sysconf */

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

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

/* The last-level cache's bytes: sysconf where the C library knows it, else
 * Linux's sysfs (cpu0's level-3 cache); 0 when neither says. */
static double llc_bytes(void) {
#ifdef _SC_LEVEL3_CACHE_SIZE
  const long s = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (s > 0) return (double)s;
#endif
  FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
  if (!f) return 0;
  long v = 0;
  char unit = 0;
  const int n = fscanf(f, "%9ld%c", &v, &unit);
  fclose(f);
  if (n < 1 || v <= 0) return 0;
  return (double)v * (unit == 'K' ? 1024.0 : unit == 'M' ? 1048576.0 : 1.0);
}

/* Bytes that do not fit the last-level cache: twice it, at least floor (and
 * at most 4 GiB, whatever the system claims). Some VMs have an L3 of 480 MiB,
 * which holds a 256 MiB cache or read pass in part. */
static double past_llc(double floor) {
  const double b = 2.0 * llc_bytes();
  return b < floor ? floor : b > 4294967296.0 ? 4294967296.0 : b;
}

/* An array for sum_pass (past_llc of 512 MiB, in whole MiB), faulted in by the
 * threads that read it, in huge pages where the kernel gives them on request,
 * as libattn's KV caches are: with 4 KiB pages the page walks, not the memory,
 * can set the pace. */
static float *read_bw_array(int threads, size_t *bytes) {
  *bytes = (size_t)(past_llc(512.0 * 1048576.0) / 1048576.0) << 20;
  const size_t n = *bytes / sizeof(float);
  void *p = NULL;
  if (posix_memalign(&p, (size_t)2 << 20, *bytes)) return NULL;
  float *x = p;
#ifdef MADV_HUGEPAGE
  (void)madvise(x, *bytes, MADV_HUGEPAGE);
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
  for (size_t i = 0; i < n; i++) x[i] = (float)(i & 1023) * 1e-3f;
  return x;
}

/* GB/s of one pass over the array's bytes. */
static double read_pass_gbs(const float *x, size_t bytes, int threads, double *sink) {
  const double t0 = cli_now();
  *sink += sum_pass(x, bytes / sizeof(float), threads);
  return (double)bytes / (cli_now() - t0) * 1e-9;
}

/* Caches smaller than past_llc(256 MiB) are cycled through copies, so that
 * each timed step reads from memory as a real model's many layers would, not
 * from L3. */
#define DECODE_MAX_COPIES 32
#define DECODE_PAIRS 20 /* decoding steps each followed by a read pass */

typedef struct decode_case {
  attn_ctx *ctx;
  attn_tensor q, out, k[DECODE_MAX_COPIES], v[DECODE_MAX_COPIES];
  attn_kv_cache *cache[DECODE_MAX_COPIES]; /* set: the step is attn_kv_cache_attend on these instead */
  attn_paged_kv_cache *paged[DECODE_MAX_COPIES]; /* set: attn_paged_kv_attend on these, sequences seqs */
  int64_t *seqs;
  int copies, next;
  attn_sdpa_opts o;
} decode_case;

static int run_decode(void *arg) {
  decode_case *c = arg;
  const int i = c->next;
  c->next = (c->next + 1) % c->copies;
  if (c->paged[0]) return attn_paged_kv_attend(c->ctx, c->paged[i], &c->out, NULL, &c->q, c->q.shape[0], c->seqs, NULL);
  if (c->cache[0]) return attn_kv_cache_attend(c->ctx, c->cache[i], &c->out, NULL, &c->q, NULL);
  return attn_sdpa(c->ctx, &c->out, NULL, NULL, &c->q, &c->k[i], &c->v[i], &c->o);
}

/* Fills cache, or paged's sequences seqs (B rows, Hk kv heads, len[b] tokens
 * of D, L the longest) with fixed-seed uniform values in (-1, 1), appended 256
 * tokens at a time: every row in turn for a linear cache; a paged one's
 * sequences one after the other (each a prefill of its own, so that each
 * takes a run of blocks, as a prompt appended at once does), or, with
 * interleaved (bt: its block size), all growing together by bt tokens a
 * round, as in a serving loop that appends one token per sequence per step:
 * the pool's allocator then keeps each row's blocks in runs where it has room
 * (paged_kv.c), and deals them out one apart in a crowded pool (--scatter). */
static attn_status fill_rows(attn_ctx *ctx, attn_kv_cache *cache, attn_paged_kv_cache *paged, const int64_t *seqs,
                             int64_t B, int64_t Hk, const int64_t *len, int64_t L, int64_t D, uint64_t seed,
                             int64_t chunk);

/* --scatter: a one-token filler sequence on every block of the pool, then the
 * fillers of the even blocks freed, so that no two free blocks follow one
 * another: the allocator then keeps no runs, and rows growing together take
 * blocks one apart, in turn (a crowded pool, the worst case of a block table). */
static attn_status crowd_pool(attn_ctx *ctx, attn_paged_kv_cache *pool) {
  const attn_paged_kv_config *pc = attn_paged_kv_get_config(pool);
  const int64_t n = pc->num_blocks, s4[4] = {n, pc->kv_heads, 1, pc->head_dim};
  int64_t *fill = malloc(sizeof(int64_t) * (size_t)n);
  attn_tensor t;
  memset(&t, 0, sizeof t);
  attn_status st = fill ? attn_tensor_alloc(ctx, &t, ATTN_F32, 4, s4) : ATTN_E_NOMEM;
  for (int64_t i = 0; i < n && !st; i++) st = attn_paged_kv_seq_new(ctx, pool, &fill[i]);
  if (!st) st = attn_paged_kv_append(ctx, pool, n, fill, &t, &t, NULL);
  for (int64_t i = 0; i < n && !st; i++) {
    const int32_t *blk;
    if (attn_paged_kv_block_table(pool, fill[i], &blk) == 1 && blk[0] % 2 == 0) st = attn_paged_kv_seq_free(ctx, pool, fill[i]);
  }
  attn_tensor_free(&t);
  free(fill);
  return st;
}
static attn_status fill_cache(attn_ctx *ctx, attn_kv_cache *cache, attn_paged_kv_cache *paged, const int64_t *seqs,
                              int64_t B, int64_t Hk, const int64_t *len, int64_t L, int64_t D, uint64_t seed,
                              int64_t interleaved_bt) {
  if (!paged) return fill_rows(ctx, cache, NULL, seqs, B, Hk, len, L, D, seed, 256);
  if (interleaved_bt) return fill_rows(ctx, NULL, paged, seqs, B, Hk, len, L, D, seed, interleaved_bt);
  attn_status st = ATTN_OK;
  for (int64_t b = 0; b < B && !st; b++)
    st = fill_rows(ctx, NULL, paged, seqs + b, 1, Hk, len + b, len[b], D, seed + 7 * (uint64_t)b, 256);
  return st;
}

static attn_status fill_rows(attn_ctx *ctx, attn_kv_cache *cache, attn_paged_kv_cache *paged, const int64_t *seqs,
                             int64_t B, int64_t Hk, const int64_t *len, int64_t L, int64_t D, uint64_t seed,
                             int64_t chunk) {
  const int64_t n = L < chunk ? L : chunk, s4[4] = {B, Hk, n, D};
  attn_tensor k, v;
  memset(&k, 0, sizeof k), memset(&v, 0, sizeof v);
  attn_status st = attn_tensor_alloc(ctx, &k, ATTN_F32, 4, s4);
  if (!st) st = attn_tensor_alloc(ctx, &v, ATTN_F32, 4, s4);
  int64_t *n_new = malloc(sizeof(int64_t) * (size_t)B);
  if (!st && !n_new) st = ATTN_E_NOMEM;
  uint64_t s = seed;
  for (int64_t at = 0; !st && at < L; at += n) {
    const int64_t m = L - at < n ? L - at : n;
    for (int64_t i = 0; i < B * Hk * n * D; i++) ((float *)k.data)[i] = bench_uniform(&s), ((float *)v.data)[i] = bench_uniform(&s);
    for (int64_t b = 0; b < B; b++) n_new[b] = len[b] - at < 0 ? 0 : len[b] - at < m ? len[b] - at : m;
    attn_tensor kk = k, vv = v;
    kk.shape[2] = vv.shape[2] = m;
    st = cache ? attn_kv_cache_append(ctx, cache, &kk, &vv, n_new) : attn_paged_kv_append(ctx, paged, B, seqs, &kk, &vv, n_new);
  }
  free(n_new);
  attn_tensor_free(&k), attn_tensor_free(&v);
  return st;
}

/* *k, *v (allocated here) = batch 0, kv head 0 of cache as f32 [1, 1, L, D], decoded. */
static attn_status cache_head_f32(attn_ctx *ctx, attn_tensor *k, attn_tensor *v, const attn_kv_cache *cache) {
  const attn_kv_cache_config *cfg = attn_kv_cache_get_config(cache);
  const int64_t L = attn_kv_cache_length(cache, 0), D = cfg->head_dim, s4[4] = {1, 1, L, D};
  attn_tensor vk, vv;
  attn_status st = attn_kv_cache_view(ctx, &vk, &vv, cache, 0);
  memset(k, 0, sizeof *k), memset(v, 0, sizeof *v);
  if (!st) st = attn_tensor_alloc(ctx, k, ATTN_F32, 4, s4);
  if (!st) st = attn_tensor_alloc(ctx, v, ATTN_F32, 4, s4);
  const attn_kv_dtype kinds[2] = {cfg->k_dtype, cfg->v_dtype};
  attn_tensor *from[2] = {&vk, &vv}, *to[2] = {k, v};
  for (int kind = 0; kind < 2 && !st; kind++) {
    attn_tensor src = *from[kind];
    src.shape[1] = 1; /* kv head 0 */
    if (kinds[kind] == ATTN_KV_Q8_0 || kinds[kind] == ATTN_KV_Q4_0) {
      for (int64_t j = 0; j < L && !st; j++)
        st = attn_kv_dequantize(ctx, kinds[kind], (float *)to[kind]->data + j * D,
                                (const uint8_t *)src.data + j * src.strides[2], D);
    } else {
      st = attn_tensor_copy(ctx, to[kind], &src);
    }
  }
  if (st) attn_tensor_free(k), attn_tensor_free(v);
  return st;
}

/* cache_head_f32 for sequence seq of a paged cache, read through its block table. */
static attn_status paged_head_f32(attn_ctx *ctx, attn_tensor *k, attn_tensor *v, const attn_paged_kv_cache *cache,
                                  int64_t seq) {
  const attn_paged_kv_config *cfg = attn_paged_kv_get_config(cache);
  const int64_t L = attn_paged_kv_seq_length(cache, seq), D = cfg->head_dim, s4[4] = {1, 1, L, D};
  const int32_t *table;
  attn_paged_kv_block_table(cache, seq, &table);
  memset(k, 0, sizeof *k), memset(v, 0, sizeof *v);
  attn_status st = attn_tensor_alloc(ctx, k, ATTN_F32, 4, s4);
  if (!st) st = attn_tensor_alloc(ctx, v, ATTN_F32, 4, s4);
  const attn_kv_dtype kinds[2] = {cfg->k_dtype, cfg->v_dtype};
  attn_tensor *to[2] = {k, v};
  for (int64_t j = 0; j < L && !st; j++) {
    attn_tensor bk, bv;
    if ((st = attn_paged_kv_block_view(ctx, &bk, &bv, cache, table[j / cfg->block_tokens]))) break;
    const attn_tensor *from[2] = {&bk, &bv};
    for (int kind = 0; kind < 2 && !st; kind++) {
      const attn_tensor *f = from[kind];
      const int64_t o = (j % cfg->block_tokens) * f->strides[2]; /* kv head 0 */
      float *dst = (float *)to[kind]->data + j * D;
      if (kinds[kind] == ATTN_KV_Q8_0 || kinds[kind] == ATTN_KV_Q4_0)
        st = attn_kv_dequantize(ctx, kinds[kind], dst, (const uint8_t *)f->data + o, D);
      else {
        const int64_t one = D;
        attn_tensor row = attn_tensor_view((char *)f->data + o * (int64_t)attn_dtype_size(f->dtype), f->dtype, 1, &one);
        attn_tensor out = attn_tensor_view(dst, ATTN_F32, 1, &one);
        st = attn_tensor_copy(ctx, &out, &row);
      }
    }
  }
  if (st) attn_tensor_free(k), attn_tensor_free(v);
  return st;
}

/* --lengths L1,L2,...: B positive lengths of at most 2^26 into len; 0 or an exit code. */
static int parse_lengths(const char *s, int64_t B, int64_t *len) {
  const char *p = s;
  for (int64_t b = 0; b < B; b++) {
    char *end;
    const long long x = strtoll(p, &end, 10);
    if (end == p || x < 1 || x > (1 << 26) || (*end != ',' && *end != '\0') || (*end == '\0' && b + 1 < B) ||
        (*end == ',' && b + 1 == B))
      return cli_fail(CLI_EXIT_USAGE, "--lengths wants %lld comma-separated lengths in 1..%d (one per --batch row), got '%s'",
                      (long long)B, 1 << 26, cli_show(s));
    len[b] = x;
    p = end + 1;
  }
  return 0;
}

/* --dtype, --k-dtype, --v-dtype's name as a storage kind; 0 if unknown. */
static attn_kv_dtype kv_kind(const char *s) {
  static const char *const names[] = {"f32", "f16", "bf16", "q8_0", "q4_0"};
  static const attn_kv_dtype kinds[] = {ATTN_KV_F32, ATTN_KV_F16, ATTN_KV_BF16, ATTN_KV_Q8_0, ATTN_KV_Q4_0};
  for (int i = 0; i < 5; i++)
    if (!strcmp(s, names[i])) return kinds[i];
  return ATTN_KV_AS_DTYPE;
}

/* Fills a tensor of f32, f16 or bf16 with fixed-seed uniform values in (-1, 1);
 * halves are rounded from f32 a block at a time, so a cache of gigabytes needs no f32 twin. */
static attn_status fill_typed(attn_ctx *ctx, attn_tensor *t, uint64_t seed) {
  const int64_t n = attn_tensor_numel(t);
  uint64_t s = seed;
  if (t->dtype == ATTN_F32) {
    for (int64_t i = 0; i < n; i++) ((float *)t->data)[i] = bench_uniform(&s);
    return ATTN_OK;
  }
  float block[4096];
  for (int64_t i = 0; i < n; i += 4096) {
    const int64_t m = n - i < 4096 ? n - i : 4096;
    for (int64_t e = 0; e < m; e++) block[e] = bench_uniform(&s);
    attn_tensor from = attn_tensor_view(block, ATTN_F32, 1, &m),
                to = attn_tensor_view((char *)t->data + i * (int64_t)attn_dtype_size(t->dtype), t->dtype, 1, &m);
    const attn_status st = attn_tensor_copy(ctx, &to, &from);
    if (st) return st;
  }
  return ATTN_OK;
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
    bad = bad || attn_tensor_copy(c->ctx, &f.k[i], &c->k[i]) || attn_tensor_copy(c->ctx, &f.v[i], &c->v[i]);
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
    qsort(ratios, DECODE_PAIRS, sizeof ratios[0], bench_cmp_double);
    *speedup = 0.5 * (ratios[DECODE_PAIRS / 2 - 1] + ratios[DECODE_PAIRS / 2]);
  }
  for (int i = 0; i < c->copies; i++) attn_tensor_free(&f.k[i]), attn_tensor_free(&f.v[i]);
  return r;
}

int cmd_bench_decode(int argc, char **argv) {
  static const char *const known[] = {"--batch", "--kv-seq", "--heads", "--kv-heads", "--dim", "--seq", "--dtype",
                                      "--k-dtype", "--v-dtype", "--threads", "--repeat", "--kernel", "--max-gflop",
                                      "--paged", "--lengths", "--q-dtype", NULL};
  static const char *const switches[] = {"--json", "--compare", "--cache", "--interleaved", "--scatter", NULL};
  cli_args a;
  int r = cli_parse(&a, argc, argv, known, switches);
  if (r) return r;
  long long B, L = 0, H, G = 0, D, N = 1, repeat = 0, paged_bt = 0;
  const char *lengths_s = cli_get(&a, "--lengths");
  if (lengths_s && cli_get(&a, "--kv-seq"))
    return cli_fail(CLI_EXIT_USAGE, "give --kv-seq (every row's length) or --lengths (each row's), not both");
  if ((r = bench_need_int(&a, "decode", "--batch", 1 << 20, &B)) ||
      (!lengths_s && (r = bench_need_int(&a, "decode", "--kv-seq", 1 << 26, &L))) ||
      (r = cli_int(&a, "--paged", 1, 1 << 16, &paged_bt)) ||
      (r = bench_need_int(&a, "decode", "--heads", 1 << 16, &H)) || (r = bench_need_int(&a, "decode", "--dim", 1 << 16, &D)) ||
      (r = cli_int(&a, "--kv-heads", 1, 1 << 16, &G)) || (r = cli_int(&a, "--seq", 1, 1 << 16, &N)) ||
      (r = cli_int(&a, "--repeat", 1, BENCH_MAX_REPEATS, &repeat)))
    return r;
  if (!G) G = H;
  if (H % G) return cli_fail(CLI_EXIT_USAGE, "--heads (%lld) must be a multiple of --kv-heads (%lld)", H, G);
  /* storage of keys and values: --dtype for both, --k-dtype / --v-dtype each */
  attn_kv_dtype kinds[2] = {ATTN_KV_F32, ATTN_KV_F32};
  const char *const opt_names[3] = {"--dtype", "--k-dtype", "--v-dtype"};
  for (int i = 0; i < 3; i++) {
    const char *ds = cli_get(&a, opt_names[i]);
    if (!ds) continue;
    const attn_kv_dtype kd = kv_kind(ds);
    if (!kd) return cli_fail(CLI_EXIT_USAGE, "%s wants f32, f16, bf16, q8_0 or q4_0, got '%s'", opt_names[i], cli_show(ds));
    if (i != 2) kinds[0] = kd;
    if (i != 1) kinds[1] = kd;
  }
  /* the queries' dtype (out stays f32): --q-dtype, f32 unless given */
  attn_dtype qdt = ATTN_F32;
  if (cli_get(&a, "--q-dtype")) {
    const char *qs_ = cli_get(&a, "--q-dtype");
    qdt = !strcmp(qs_, "f32") ? ATTN_F32 : !strcmp(qs_, "f16") ? ATTN_F16 : !strcmp(qs_, "bf16") ? ATTN_BF16 : ATTN_F64;
    if (qdt == ATTN_F64) return cli_fail(CLI_EXIT_USAGE, "--q-dtype wants f32, f16 or bf16, got '%s'", cli_show(qs_));
  }
  const int blocks = kinds[0] >= ATTN_KV_Q8_0 || kinds[1] >= ATTN_KV_Q8_0;
  const int paged = paged_bt > 0;
  const int use_cache = blocks || kinds[0] != kinds[1] || cli_has(&a, "--cache") || lengths_s || paged;
  if (blocks && D % 32) return cli_fail(CLI_EXIT_USAGE, "q8_0 and q4_0 take --dim a multiple of 32, got %lld", D);
  if ((cli_has(&a, "--interleaved") || cli_has(&a, "--scatter")) && !paged)
    return cli_fail(CLI_EXIT_USAGE, "--interleaved and --scatter need --paged");
  const int scatter = cli_has(&a, "--scatter");
  if (use_cache && cli_has(&a, "--compare"))
    return cli_fail(CLI_EXIT_USAGE,
                    "--compare runs on plain tensors: not with --cache, --paged, --lengths, --k-dtype/--v-dtype or q8_0/q4_0");
  /* each row's length: --lengths, else --kv-seq for all */
  int64_t *len = malloc(sizeof(int64_t) * (size_t)B), total = 0;
  if (!len) return cli_fail(CLI_EXIT_FAIL, "out of memory");
  if (lengths_s && (r = parse_lengths(lengths_s, B, len))) {
    free(len);
    return r;
  }
  for (int64_t b = 0; b < B; b++) {
    if (!lengths_s) len[b] = L;
    L = len[b] > L ? len[b] : L;
    total += len[b];
  }
  /* the plain tensors' dtype (the kinds share it then) */
  const attn_dtype dt = kinds[0] == ATTN_KV_F16 ? ATTN_F16 : kinds[0] == ATTN_KV_BF16 ? ATTN_BF16 : ATTN_F32;
  {
    /* the timed steps, one more for the oracle, the paired passes; --compare: the blocked kernel's
     * timed steps, the f32 cache's 2 x 21 steps in turn, and a full recompute of L rows (L <= 8192) */
    const int compare = cli_has(&a, "--compare");
    const double step = 4.0 * (double)total * H * N * D * 1e-9, full = 2.0 * (double)B * H * L * L * D * 1e-9;
    double steps = bench_min_runs(repeat) + 1 + DECODE_PAIRS, extra = 0;
    if (compare) steps += bench_min_runs(repeat) + (dt != ATTN_F32 ? 2 * (DECODE_PAIRS + 1) : 0);
    if (compare && L <= 8192) extra = full * bench_min_runs(repeat < 3 ? repeat : 3);
    if ((r = bench_check_work(&a, "decode", step * steps + extra))) {
      free(len);
      return r;
    }
  }
  /* the bytes a step reads: each row's tokens (a linear cache's capacity past them is not read) */
  const double cache_bytes = (double)total * G * (double)(attn_kv_dtype_bytes(kinds[0], D) + attn_kv_dtype_bytes(kinds[1], D));
  const double cold = past_llc(256.0 * 1048576.0);
  int copies = cache_bytes >= cold ? 1 : (int)ceil(cold / cache_bytes);
  if (copies > DECODE_MAX_COPIES) copies = DECODE_MAX_COPIES;
  /* a linear cache holds every row at the longest length; a paged one its blocks */
  const double held = paged ? cache_bytes + (double)B * G * paged_bt * (double)(attn_kv_dtype_bytes(kinds[0], D) +
                                                                                attn_kv_dtype_bytes(kinds[1], D))
                      : use_cache ? (double)B * G * L * (double)(attn_kv_dtype_bytes(kinds[0], D) + attn_kv_dtype_bytes(kinds[1], D))
                                  : cache_bytes;
  attn_ctx *ctx;
  if ((r = bench_check_fits(copies * held + 8.0 * B * H * N * D)) || (r = bench_ctx(&a, &ctx))) {
    free(len);
    return r;
  }
  decode_case c;
  memset(&c, 0, sizeof c);
  c.ctx = ctx;
  c.copies = copies;
  c.seqs = malloc(sizeof(int64_t) * (size_t)B);
  const int64_t qs[4] = {B, H, N, D}, ks[4] = {B, G, L, D};
  int bad = !c.seqs || attn_tensor_alloc(ctx, &c.q, qdt, 4, qs) || attn_tensor_alloc(ctx, &c.out, ATTN_F32, 4, qs);
  for (int i = 0; i < copies && !bad; i++) {
    if (!use_cache) {
      bad = attn_tensor_alloc(ctx, &c.k[i], dt, 4, ks) || attn_tensor_alloc(ctx, &c.v[i], dt, 4, ks);
      continue;
    }
    if (paged) { /* a pool of exactly the blocks the rows need (--scatter: twice that, half of it held by fillers) */
      int64_t blocks_needed = 0;
      for (int64_t b = 0; b < B; b++) blocks_needed += (len[b] + paged_bt - 1) / paged_bt;
      attn_paged_kv_config pc;
      attn_paged_kv_config_init(&pc, scatter ? 2 * blocks_needed : blocks_needed, paged_bt, G, D);
      pc.k_dtype = kinds[0], pc.v_dtype = kinds[1], pc.max_seqs = scatter ? B + 2 * blocks_needed : B;
      bad = attn_paged_kv_create(ctx, &c.paged[i], &pc) != ATTN_OK || (scatter && crowd_pool(ctx, c.paged[i]) != ATTN_OK);
      for (int64_t b = 0; b < B && !bad; b++) bad = attn_paged_kv_seq_new(ctx, c.paged[i], &c.seqs[b]) != ATTN_OK;
      continue;
    }
    attn_kv_cache_config cfg;
    attn_kv_cache_config_init(&cfg, B, L, G, D);
    cfg.k_dtype = kinds[0], cfg.v_dtype = kinds[1];
    bad = attn_kv_cache_create(ctx, &c.cache[i], &cfg) != ATTN_OK;
  }
  double step_s = NAN, blocked_s = NAN, full_s = NAN, err = NAN, read_gbs = NAN, fraction = NAN, speedup = NAN;
  timing t, tb, tf;
  memset(&tb, 0, sizeof tb), memset(&tf, 0, sizeof tf);
  if (bad) {
    r = cli_fail(CLI_EXIT_FAIL, "out of memory: %s", attn_ctx_error(ctx));
    goto done;
  }
  bad = fill_typed(ctx, &c.q, 1) || fill_typed(ctx, &c.out, 4);
  for (int i = 0; i < copies && !bad; i++)
    bad = use_cache ? fill_cache(ctx, c.cache[i], c.paged[i], c.seqs, B, G, len, L, D, 2 + 2 * (uint64_t)i,
                                     cli_has(&a, "--interleaved") || scatter ? paged_bt : 0) != ATTN_OK
                    : fill_typed(ctx, &c.k[i], 2 + 2 * (uint64_t)i) || fill_typed(ctx, &c.v[i], 3 + 2 * (uint64_t)i);
  if (bad) {
    r = cli_fail(CLI_EXIT_FAIL, "decode: %s", attn_ctx_error(ctx));
    goto done;
  }
  attn_sdpa_opts_init(&c.o);
  c.o.causal = ATTN_CAUSAL_BOTTOM_RIGHT; /* the new tokens are the cache's last */
  if ((r = bench_time_runs(run_decode, &c, repeat, &t))) {
    r = cli_fail(CLI_EXIT_FAIL, "decode: %s", attn_ctx_error(ctx));
    goto done;
  }
  step_s = t.median_s;
  c.next = 0; /* the oracle reads copy 0: the output must be copy 0's */
  if ((r = run_decode(&c))) {
    r = cli_fail(CLI_EXIT_FAIL, "decode: %s", attn_ctx_error(ctx));
    goto done;
  }
  if (use_cache) { /* the oracle on the cache's keys and values as stored (decoded) */
    decode_case oc = c;
    if ((paged ? paged_head_f32(ctx, &oc.k[0], &oc.v[0], c.paged[0], c.seqs[0])
               : cache_head_f32(ctx, &oc.k[0], &oc.v[0], c.cache[0])) == ATTN_OK) {
      err = decode_oracle(&oc, H / G);
      attn_tensor_free(&oc.k[0]), attn_tensor_free(&oc.v[0]);
    }
  } else {
    err = decode_oracle(&c, H / G);
  }
  if (cli_has(&a, "--compare") && dt != ATTN_F32 && (r = half_speedup(&c, dt, &speedup))) goto done;
  if (cli_has(&a, "--compare")) {
    /* the same step through the blocked (prefill) kernel, and without a cache: all L rows again */
    attn_ctx *bctx;
    const int made = attn_ctx_create(&bctx) == ATTN_OK;
    if (!made) {
      r = cli_fail(CLI_EXIT_FAIL, "out of memory");
      goto done;
    }
    attn_ctx_set_threads(bctx, attn_ctx_threads(ctx));
    attn_ctx_set_kernel(bctx, attn_ctx_kernel(ctx));
    attn_ctx_set_decode(bctx, 0);
    c.ctx = bctx;
    r = bench_time_runs(run_decode, &c, repeat, &tb);
    blocked_s = tb.median_s;
    decode_case f = c;
    attn_tensor fq, fo;
    memset(&fq, 0, sizeof fq), memset(&fo, 0, sizeof fo);
    const int64_t fs[4] = {B, H, L, D};
    /* (a full recompute is quadratic in L: only where it takes seconds, not hours) */
    if (!r && L <= 8192 && !attn_tensor_alloc(ctx, &fq, ATTN_F32, 4, fs) && !attn_tensor_alloc(ctx, &fo, ATTN_F32, 4, fs)) {
      (void)fill_typed(ctx, &fq, 5); /* f32: cannot fail */
      f.q = fq, f.out = fo, f.copies = 1, f.next = 0, f.ctx = ctx;
      r = bench_time_runs(run_decode, &f, repeat < 3 ? repeat : 3, &tf);
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
    size_t bw_bytes = 0;
    float *bw = read_bw_array(threads, &bw_bytes);
    if (!bw) {
      r = cli_fail(CLI_EXIT_FAIL, "out of memory for the read-bandwidth array");
      goto done;
    }
    double sink = 0, ratios[DECODE_PAIRS];
    read_gbs = 0;
    read_pass_gbs(bw, bw_bytes, threads, &sink); /* warm */
    for (int i = 0; i < DECODE_PAIRS; i++) {
      const double t0 = cli_now();
      if ((r = run_decode(&c))) {
        free(bw);
        r = cli_fail(CLI_EXIT_FAIL, "decode: %s", attn_ctx_error(ctx));
        goto done;
      }
      const double step = cli_now() - t0, g = read_pass_gbs(bw, bw_bytes, threads, &sink);
      if (g > read_gbs) read_gbs = g;
      ratios[i] = cache_bytes / step * 1e-9 / g;
    }
    free(bw);
    qsort(ratios, DECODE_PAIRS, sizeof ratios[0], bench_cmp_double);
    fraction = 0.5 * (ratios[DECODE_PAIRS / 2 - 1] + ratios[DECODE_PAIRS / 2]) + (sink == -1.0 ? 1 : 0);
  }
  {
    const double gbs = cache_bytes / step_s * 1e-9;
    const int threads = attn_ctx_threads(ctx);
    const char *kernel = attn_kernel_name(attn_ctx_kernel(ctx));
    if (cli_has(&a, "--json")) {
      printf("{\"op\":\"decode\",\"batch\":%lld,\"kv_seq\":%lld,\"heads\":%lld,\"kv_heads\":%lld,\"dim\":%lld,"
             "\"seq\":%lld,\"dtype\":\"%s\",\"k_dtype\":\"%s\",\"v_dtype\":\"%s\",\"kv_cache\":%s,"
             "\"threads\":%d,\"kernel\":\"%s\",\"cache_copies\":%d,\"llc_bytes\":%.0f,\"paged_block_tokens\":%lld,"
             "\"kv_tokens\":%lld,\"q_dtype\":\"%s\",",
             B, L, H, G, D, N, attn_kv_dtype_name(kinds[0]), attn_kv_dtype_name(kinds[0]), attn_kv_dtype_name(kinds[1]),
             use_cache ? "true" : "false", threads, kernel, copies, llc_bytes(), paged_bt, (long long)total,
             attn_dtype_name(qdt));
      bench_json_num("median_s", step_s, 0);
      bench_json_num("min_s", t.min_s, 0);
      printf("\"repeats\":%lld,", t.repeats);
      bench_json_num("cache_bytes", cache_bytes, 0);
      bench_json_num("read_gbs", gbs, 0);
      bench_json_num("measured_read_gbs", read_gbs, 0);
      bench_json_num("fraction_of_read_bw", fraction, 0);
      bench_json_num("blocked_kernel_s", blocked_s, 0);
      bench_json_num("full_recompute_s", full_s, 0);
      bench_json_num("speedup_over_f32", speedup, 0);
      bench_json_num("oracle_rel_l2", err, 1);
      printf("}\n");
    } else {
      char kinds_s[64], cache_kind[160];
      if (paged) snprintf(cache_kind, sizeof cache_kind, " (attn_paged_kv_cache, blocks of %lld tokens)", paged_bt);
      else snprintf(cache_kind, sizeof cache_kind, "%s", use_cache ? " (attn_kv_cache)" : "");
      if (lengths_s) {
        const size_t u = strlen(cache_kind);
        snprintf(cache_kind + u, sizeof cache_kind - u, " rows of mixed lengths (%lld tokens in all, longest L)",
                 (long long)total);
      }
      snprintf(kinds_s, sizeof kinds_s, kinds[0] == kinds[1] ? "%s%s" : "k %s v %s", attn_kv_dtype_name(kinds[0]),
               kinds[0] == kinds[1] ? "" : attn_kv_dtype_name(kinds[1]));
      printf("decode B=%lld L=%lld Hq=%lld Hk=%lld D=%lld Nq=%lld %s%s | kernel %s, %d threads | median %.4g ms of %lld "
             "(min %.4g ms) | cache %.1f MiB read at %.2f GB/s | %.1f%% of the read bandwidth measured beside it "
             "(median of %d paired passes; best pass %.2f GB/s)",
             B, L, H, G, D, N, kinds_s, cache_kind, kernel, threads, step_s * 1e3, t.repeats, t.min_s * 1e3,
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
  for (int i = 0; i < copies; i++) {
    attn_tensor_free(&c.k[i]), attn_tensor_free(&c.v[i]);
    attn_kv_cache_destroy(c.cache[i]), attn_paged_kv_destroy(c.paged[i]);
  }
  free(c.seqs);
  free(len);
  attn_ctx_destroy(ctx);
  return r;
}
