/* The paged KV cache: every storage dtype (and mixed key/value ones), block
 * sizes 1, 16, 64, 100 (not a divisor of the decode's blocks of keys), 128 and
 * 256, GQA and sequences of mixed lengths, each attended on every kernel and
 * 1-3 threads (bitwise the same for each) against a linear attn_kv_cache
 * holding the same tokens (bitwise for prefills, for blocks of a multiple of
 * 128 tokens and for runs of blocks; within 1e-6 where the decode's blocks of
 * keys are cut at a block boundary) and against the float64 oracle on the
 * stored values; token-by-token decoding; fork and copy-on-write, truncate
 * then append, freeing, pool exhaustion (nothing changes), NaN in every free
 * block and every unused slot (never reaching a result), the allocator's runs
 * (sequences growing together keep theirs) and a crowded pool whose blocks
 * are dealt out one apart between NaN fillers, and hostile arguments.
 * Optional argument: one kernel's name (else all; 77 if this CPU lacks it). */
#include "testutil.h"

static const attn_kernel kernels[6] = {ATTN_KERNEL_REF, ATTN_KERNEL_C, ATTN_KERNEL_AVX2, ATTN_KERNEL_AVX512,
                                       ATTN_KERNEL_AVX512_BF16, ATTN_KERNEL_AMX};
static const char *only; /* the kernel asked for, or NULL */

/* A linear cache and a paged one fed the same tokens. */
typedef struct pair {
  attn_kv_cache *lin;
  attn_paged_kv_cache *pg;
  int64_t B, Hk, D, Dv, seq[8];
} pair;

/* Fills every block of the pool with NaN tokens, then frees them: blocks
 * taken later hold NaN wherever the cache has not written. */
static void poison_pool(attn_ctx *ctx, attn_paged_kv_cache *pg) {
  const attn_paged_kv_config *c = attn_paged_kv_get_config(pg);
  const int64_t n = c->num_blocks * c->block_tokens;
  const int64_t ks[4] = {1, c->kv_heads, n, c->head_dim}, vs[4] = {1, c->kv_heads, n, c->v_head_dim};
  float *k = malloc(sizeof(float) * (size_t)(c->kv_heads * n * c->head_dim));
  float *v = malloc(sizeof(float) * (size_t)(c->kv_heads * n * c->v_head_dim));
  tu_poison_f32(k, c->kv_heads * n * c->head_dim);
  tu_poison_f32(v, c->kv_heads * n * c->v_head_dim);
  attn_tensor tk = attn_tensor_view(k, ATTN_F32, 4, ks), tv = attn_tensor_view(v, ATTN_F32, 4, vs);
  int64_t s;
  CHECK_OK(ctx, attn_paged_kv_seq_new(ctx, pg, &s));
  CHECK_OK(ctx, attn_paged_kv_append(ctx, pg, 1, &s, &tk, &tv, NULL));
  CHECK(attn_paged_kv_free_blocks(pg) == 0, "the poisoning sequence fills the pool");
  CHECK_OK(ctx, attn_paged_kv_seq_free(ctx, pg, s));
  CHECK(attn_paged_kv_free_blocks(pg) == c->num_blocks, "freeing returns every block");
  free(k), free(v);
}

/* scatter: the rows' blocks dealt out one apart, the blocks between them held by one-token filler
 * sequences of NaN until pair_free (a crowded pool, where the allocator keeps no runs: every block
 * boundary cuts the decode's keys, and a read past a block lands on a filler's NaN). */
static void pair_make(attn_ctx *ctx, pair *p, attn_kv_dtype kt, attn_kv_dtype vt, int64_t B, int64_t Hk, int64_t D,
                      int64_t Dv, int64_t capacity, int64_t bt, int scatter) {
  p->B = B, p->Hk = Hk, p->D = D, p->Dv = Dv;
  attn_kv_cache_config lc;
  attn_kv_cache_config_init(&lc, B, capacity, Hk, D);
  lc.v_head_dim = Dv, lc.k_dtype = kt, lc.v_dtype = vt;
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &p->lin, &lc));
  attn_paged_kv_config pc;
  /* room for every row at capacity, plus the block each may waste, plus spares */
  const int64_t need = B * ((capacity + bt - 1) / bt + 1) + 3;
  attn_paged_kv_config_init(&pc, scatter ? 2 * need : need, bt, Hk, D);
  pc.v_head_dim = Dv, pc.k_dtype = kt, pc.v_dtype = vt, pc.max_seqs = scatter ? 2 * need + 16 : 16;
  CHECK_OK(ctx, attn_paged_kv_create(ctx, &p->pg, &pc));
  poison_pool(ctx, p->pg);
  if (scatter) { /* a filler on every block, then the even blocks' fillers freed */
    const int64_t n = 2 * need, ks[4] = {n, Hk, 1, D}, vs[4] = {n, Hk, 1, Dv};
    int64_t *fill = malloc(sizeof(int64_t) * (size_t)n);
    float *k = malloc(sizeof(float) * (size_t)(n * Hk * D)), *v = malloc(sizeof(float) * (size_t)(n * Hk * Dv));
    tu_poison_f32(k, n * Hk * D), tu_poison_f32(v, n * Hk * Dv);
    attn_tensor tk = attn_tensor_view(k, ATTN_F32, 4, ks), tv = attn_tensor_view(v, ATTN_F32, 4, vs);
    for (int64_t i = 0; i < n; i++) CHECK_OK(ctx, attn_paged_kv_seq_new(ctx, p->pg, &fill[i]));
    CHECK_OK(ctx, attn_paged_kv_append(ctx, p->pg, n, fill, &tk, &tv, NULL));
    CHECK(attn_paged_kv_free_blocks(p->pg) == 0, "the fillers fill the pool");
    for (int64_t i = 0; i < n; i++) {
      const int32_t *t;
      CHECK(attn_paged_kv_block_table(p->pg, fill[i], &t) == 1, "a filler holds one block");
      if (t[0] % 2 == 0) CHECK_OK(ctx, attn_paged_kv_seq_free(ctx, p->pg, fill[i]));
    }
    CHECK(attn_paged_kv_free_blocks(p->pg) == need, "the even blocks are free");
    free(fill), free(k), free(v);
  }
  for (int64_t b = 0; b < B; b++) {
    int64_t waste; /* a sequence made and freed first: ids need not be 0..B-1 */
    if (b == 1) CHECK_OK(ctx, attn_paged_kv_seq_new(ctx, p->pg, &waste));
    CHECK_OK(ctx, attn_paged_kv_seq_new(ctx, p->pg, &p->seq[b]));
    if (b == 1) CHECK_OK(ctx, attn_paged_kv_seq_free(ctx, p->pg, waste));
  }
}

/* Runs of blocks that follow one another in seq's table. */
static int64_t runs_of(const attn_paged_kv_cache *pg, int64_t seq) {
  const int32_t *t;
  const int64_t n = attn_paged_kv_block_table(pg, seq, &t);
  int64_t runs = n > 0;
  for (int64_t i = 1; i < n; i++) runs += t[i] != t[i - 1] + 1;
  return runs;
}

static void pair_free(pair *p) {
  attn_kv_cache_destroy(p->lin);
  attn_paged_kv_destroy(p->pg);
}

/* Appends n_new[b] random tokens (of n) to row b of both caches; nan: the tokens are NaN. */
static void pair_append(attn_ctx *ctx, pair *p, const int64_t *n_new, tu_rng *r, int nan) {
  int64_t n = 0;
  for (int64_t b = 0; b < p->B; b++) n = n_new[b] > n ? n_new[b] : n;
  const int64_t ks[4] = {p->B, p->Hk, n, p->D}, vs[4] = {p->B, p->Hk, n, p->Dv};
  const int64_t nk = p->B * p->Hk * n * p->D, nv = p->B * p->Hk * n * p->Dv;
  float *k = malloc(sizeof(float) * (size_t)(nk + 1)), *v = malloc(sizeof(float) * (size_t)(nv + 1));
  tu_fill_f32(r, k, nk, 1.5);
  tu_fill_f32(r, v, nv, 1.5);
  if (nan) tu_poison_f32(k, nk), tu_poison_f32(v, nv);
  attn_tensor tk = attn_tensor_view(k, ATTN_F32, 4, ks), tv = attn_tensor_view(v, ATTN_F32, 4, vs);
  CHECK_OK(ctx, attn_kv_cache_append(ctx, p->lin, &tk, &tv, n_new));
  CHECK_OK(ctx, attn_paged_kv_append(ctx, p->pg, p->B, p->seq, &tk, &tv, n_new));
  free(k), free(v);
}

/* Fills row b of both caches to len[b]: a first chunk, NaN tokens truncated
 * away (the unused slots of each last block then hold NaN), then the rest in
 * a few appends of mixed sizes. */
static void pair_fill(attn_ctx *ctx, pair *p, const int64_t *len, tu_rng *r) {
  int64_t n_new[8], have[8] = {0};
  for (int64_t b = 0; b < p->B; b++) n_new[b] = len[b] / 2;
  pair_append(ctx, p, n_new, r, 0);
  for (int64_t b = 0; b < p->B; b++) have[b] = n_new[b], n_new[b] = 5;
  pair_append(ctx, p, n_new, r, 1);
  for (int64_t b = 0; b < p->B; b++) {
    CHECK_OK(ctx, attn_kv_cache_truncate(ctx, p->lin, b, have[b]));
    CHECK_OK(ctx, attn_paged_kv_seq_truncate(ctx, p->pg, p->seq[b], have[b]));
  }
  for (int step = 0; step < 3; step++) {
    for (int64_t b = 0; b < p->B; b++) n_new[b] = step < 2 ? (len[b] - have[b]) / 3 : len[b] - have[b];
    pair_append(ctx, p, n_new, r, 0);
    for (int64_t b = 0; b < p->B; b++) have[b] += n_new[b];
  }
  pair_append(ctx, p, (int64_t[8]){3, 3, 3, 3, 3, 3, 3, 3}, r, 1); /* NaN past every length once more */
  for (int64_t b = 0; b < p->B; b++) {
    CHECK_OK(ctx, attn_kv_cache_truncate(ctx, p->lin, b, len[b]));
    CHECK_OK(ctx, attn_paged_kv_seq_truncate(ctx, p->pg, p->seq[b], len[b]));
    CHECK(attn_paged_kv_seq_length(p->pg, p->seq[b]) == len[b], "row %lld holds %lld tokens, want %lld", (long long)b,
          (long long)attn_paged_kv_seq_length(p->pg, p->seq[b]), (long long)len[b]);
  }
}

/* Row b of the linear cache's keys (kind 0) or values as f32 [Hk, len, F]: the values it stores. */
static float *stored_f32(attn_ctx *ctx, const attn_kv_cache *cache, int kind, int64_t b) {
  const attn_kv_cache_config *c = attn_kv_cache_get_config(cache);
  const attn_kv_dtype dt = kind ? c->v_dtype : c->k_dtype;
  const int64_t F = kind ? c->v_head_dim : c->head_dim;
  attn_tensor vk, vv;
  CHECK_OK(ctx, attn_kv_cache_view(ctx, &vk, &vv, cache, b));
  const attn_tensor *t = kind ? &vv : &vk;
  const int64_t Hk = t->shape[1], len = t->shape[2];
  float *x = malloc(sizeof(float) * (size_t)(Hk * len * F + 1));
  for (int64_t g = 0; g < Hk; g++)
    for (int64_t j = 0; j < len; j++) {
      float *dst = x + (g * len + j) * F;
      const int64_t o = g * t->strides[1] + j * t->strides[2];
      if (dt == ATTN_KV_Q8_0 || dt == ATTN_KV_Q4_0) CHECK_OK(ctx, attn_kv_dequantize(ctx, dt, dst, (uint8_t *)t->data + o, F));
      else
        for (int64_t f = 0; f < F; f++)
          dst[f] = dt == ATTN_KV_F32   ? ((float *)t->data)[o + f]
                   : dt == ATTN_KV_F16 ? tu_f16_to_f32(((uint16_t *)t->data)[o + f])
                                       : tu_bf16_to_f32(((uint16_t *)t->data)[o + f]);
    }
  return x;
}

/* The decode reads blocks of 128 keys (decode.c's ATTN__DEC_NB), cut where a
 * sequence's pages stop following one another in the pool: with blocks of a
 * multiple of 128 tokens (or pages taken in runs) and no window, the cuts fall
 * where a linear cache's do, and the results are bitwise the same. */
#define DEC_NB 128
/* Steps of more rows than this a kv head (Nq times the group; internal.h's ATTN__DEC_MAX_ROWS) are
 * prefills: each sequence gathered whole, no blocks, so paged and linear agree bitwise. */
#define DEC_MAX_ROWS 64

/* Attends Nq queries (Hq heads) on both caches on every kernel and 1-3
 * threads: the paged results the same for every thread count, bitwise the
 * linear ones' (out and lse) when exact (else within 1e-6 rel L2 of them),
 * and within 1e-6 (rel L2) of the oracle on the stored values. */
static void pair_check(attn_ctx *ctx, pair *p, int64_t Hq, int64_t Nq, const attn_sdpa_opts *o, tu_rng *r,
                       const char *what, int exact) {
  const int64_t B = p->B, D = p->D, Dv = p->Dv, no = B * Hq * Nq * Dv, nl = B * Hq * Nq;
  const int64_t qs[4] = {B, Hq, Nq, D}, os[4] = {B, Hq, Nq, Dv};
  float *q = malloc(sizeof(float) * (size_t)(B * Hq * Nq * D));
  tu_fill_f32(r, q, B * Hq * Nq * D, 1.0);
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, qs);
  double *ref = malloc(sizeof(double) * (size_t)no), *ref_lse = malloc(sizeof(double) * (size_t)nl);
  for (int64_t b = 0; b < B; b++) {
    const int64_t len = attn_kv_cache_length(p->lin, b);
    float *kb = stored_f32(ctx, p->lin, 0, b), *vb = stored_f32(ctx, p->lin, 1, b);
    const int64_t q1[4] = {1, Hq, Nq, D}, k1[4] = {1, p->Hk, len, D}, v1[4] = {1, p->Hk, len, Dv}, o1[4] = {1, Hq, Nq, Dv};
    attn_tensor tqb = attn_tensor_view(q + b * Hq * Nq * D, ATTN_F32, 4, q1);
    attn_tensor tkb = attn_tensor_view(kb, ATTN_F32, 4, k1), tvb = attn_tensor_view(vb, ATTN_F32, 4, v1);
    attn_tensor tr = attn_tensor_view(ref + b * Hq * Nq * Dv, ATTN_F64, 4, o1);
    attn_tensor trl = attn_tensor_view(ref_lse + b * Hq * Nq, ATTN_F64, 3, o1);
    attn_sdpa_opts ro = *o;
    ro.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
    CHECK_OK(ctx, attn_sdpa_ref(ctx, &tr, &trl, NULL, &tqb, &tkb, &tvb, &ro));
    free(kb), free(vb);
  }
  float *lo = malloc(sizeof(float) * (size_t)no), *po = malloc(sizeof(float) * (size_t)no);
  float *ll = malloc(sizeof(float) * (size_t)nl), *pl = malloc(sizeof(float) * (size_t)nl);
  float *first = malloc(sizeof(float) * (size_t)no);
  attn_tensor tlo = attn_tensor_view(lo, ATTN_F32, 4, os), tpo = attn_tensor_view(po, ATTN_F32, 4, os);
  attn_tensor tll = attn_tensor_view(ll, ATTN_F32, 3, os), tpl = attn_tensor_view(pl, ATTN_F32, 3, os);
  const attn_paged_kv_config *pc = attn_paged_kv_get_config(p->pg);
  for (int ki = 0; ki < 6; ki++) {
    if (only && strcmp(only, attn_kernel_name(kernels[ki]))) continue;
    if (!attn_kernel_supported(kernels[ki])) continue;
    attn_ctx_set_kernel(ctx, kernels[ki]);
    for (int threads = 1; threads <= 3; threads++) {
      attn_ctx_set_threads(ctx, threads);
      tu_poison_f32(lo, no), tu_poison_f32(po, no), tu_poison_f32(ll, nl), tu_poison_f32(pl, nl);
      CHECK_OK(ctx, attn_kv_cache_attend(ctx, p->lin, &tlo, &tll, &tq, o));
      CHECK_OK(ctx, attn_paged_kv_attend(ctx, p->pg, &tpo, &tpl, &tq, B, p->seq, o));
      double *got = tu_to_f64(&tpo), *lin = tu_to_f64(&tlo);
      if (exact || kernels[ki] == ATTN_KERNEL_REF || Nq * Hq / p->Hk > DEC_MAX_ROWS) /* the oracle and prefills: no blocks */
        CHECK(memcmp(lo, po, sizeof(float) * (size_t)no) == 0 && memcmp(ll, pl, sizeof(float) * (size_t)nl) == 0,
              "%s: k %s v %s, block %lld, Hq %lld Hk %lld Nq %lld, kernel %s threads %d: paged differs from linear", what,
              attn_kv_dtype_name(pc->k_dtype), attn_kv_dtype_name(pc->v_dtype), (long long)pc->block_tokens,
              (long long)Hq, (long long)p->Hk, (long long)Nq, attn_kernel_name(kernels[ki]), threads);
      else {
        double lse_diff = 0;
        for (int64_t i = 0; i < nl; i++)
          if (!(fabs(pl[i] - ll[i]) <= lse_diff)) lse_diff = fabs(pl[i] - ll[i]);
        const double diff = tu_rel_l2(got, lin, no);
        CHECK(diff <= 1e-6 && lse_diff <= 1e-5,
              "%s: k %s v %s, block %lld, Nq %lld, kernel %s threads %d: paged %.3g (rel L2; lse %.3g) from linear",
              what, attn_kv_dtype_name(pc->k_dtype), attn_kv_dtype_name(pc->v_dtype), (long long)pc->block_tokens,
              (long long)Nq, attn_kernel_name(kernels[ki]), threads, diff, lse_diff);
      }
      if (threads == 1) memcpy(first, po, sizeof(float) * (size_t)no);
      else
        CHECK(memcmp(first, po, sizeof(float) * (size_t)no) == 0, "%s: block %lld, kernel %s: %d threads differ from 1",
              what, (long long)pc->block_tokens, attn_kernel_name(kernels[ki]), threads);
      free(lin);
      const double err = tu_rel_l2(got, ref, no);
      double lse_err = 0;
      for (int64_t i = 0; i < nl; i++)
        if (!(fabs(pl[i] - ref_lse[i]) <= lse_err)) lse_err = fabs(pl[i] - ref_lse[i]); /* NaN sticks */
      CHECK(err <= 1e-6 && tu_count_nan(got, no) == 0 && lse_err <= 1e-5,
            "%s: k %s v %s, block %lld, Nq %lld, kernel %s threads %d: rel L2 %.3g, lse off by %.3g against the oracle",
            what, attn_kv_dtype_name(pc->k_dtype), attn_kv_dtype_name(pc->v_dtype), (long long)pc->block_tokens,
            (long long)Nq, attn_kernel_name(kernels[ki]), threads, err, lse_err);
      free(got);
    }
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  attn_ctx_set_threads(ctx, 0);
  free(q), free(ref), free(ref_lse), free(lo), free(po), free(ll), free(pl), free(first);
}

/* Every dtype pair and block size; decode steps (Nq 1, 2 with GQA 4: 4 and
 * 8 rows) and a prefill (Nq 6: 24 rows), over sequences of mixed lengths. */
static void against_linear(void) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  const attn_kv_dtype dts[][2] = {{ATTN_KV_F32, ATTN_KV_F32},   {ATTN_KV_F16, ATTN_KV_F16},
                                  {ATTN_KV_BF16, ATTN_KV_BF16}, {ATTN_KV_Q8_0, ATTN_KV_Q8_0},
                                  {ATTN_KV_Q4_0, ATTN_KV_Q4_0}, {ATTN_KV_Q8_0, ATTN_KV_Q4_0},
                                  {ATTN_KV_F16, ATTN_KV_Q8_0},  {ATTN_KV_Q4_0, ATTN_KV_BF16}};
  const int64_t blocks[6] = {1, 16, 64, 100, 128, 256};
  const int64_t len[3] = {2100, 37, 300}; /* past a decode chunk (2048 keys), short, between */
  tu_rng r = {77};
  attn_sdpa_opts plain, win, chunked;
  attn_sdpa_opts_init(&plain);
  attn_sdpa_opts_init(&win);
  attn_sdpa_opts_init(&chunked);
  win.window = 200, win.softcap = 5.0;
  chunked.chunk = 700; /* the long row's queries read from key 2100 - 2100 % 700 = 1400 on */
  for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++)
    for (int bi = 0; bi < 6; bi++) {
      const int wide = (int)(di + (size_t)bi) % 2; /* D 128 with Dv 64, or D = Dv = 64 */
      pair p;
      pair_make(ctx, &p, dts[di][0], dts[di][1], 3, 2, wide ? 128 : 64, 64, 2110, blocks[bi], (di + (size_t)bi) % 2 == 0);
      pair_fill(ctx, &p, len, &r);
      for (int64_t row = 0; row < 3 && (di + (size_t)bi) % 2 == 0; row++) {
        const int32_t *t;
        CHECK(runs_of(p.pg, p.seq[row]) == attn_paged_kv_block_table(p.pg, p.seq[row], &t),
              "block %lld, row %lld: a crowded pool scatters the blocks", (long long)blocks[bi], (long long)row);
      }
      /* (a window or a chunk starts the decode's blocks at its first key, not at a multiple of 128) */
      const int exact = blocks[bi] % DEC_NB == 0, banded = (di + (size_t)bi) % 3;
      pair_check(ctx, &p, 8, 1, &plain, &r, "decode", exact);
      pair_check(ctx, &p, 8, 2, banded == 0 ? &win : banded == 1 ? &chunked : &plain, &r,
                 banded == 0 ? "decode Nq 2, window" : banded == 1 ? "decode Nq 2, chunk" : "decode Nq 2",
                 exact && banded == 2);
      if (bi == 1 || bi == 3) {
        pair_check(ctx, &p, 4, 6, &plain, &r, "decode, 12 rows a kv head", exact); /* two groups of the kernels' rows */
        pair_check(ctx, &p, 4, 40, &plain, &r, "prefill", exact);
      }
      pair_free(&p);
    }
  attn_ctx_destroy(ctx);
}

/* 1 when got (n floats) is want's within 1e-6 rel L2: a paged cache's
 * decode, cut where its pages part, against a linear cache's. */
static int near(const float *want, const float *got, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) num += ((double)got[i] - want[i]) * ((double)got[i] - want[i]), den += (double)want[i] * want[i];
  return num <= 1e-12 * den;
}

/* Token by token, as a decoder runs: append one token to each row still
 * growing, attend, compare (on the kernel AUTO picks; bitwise with blocks of
 * 128 tokens, else within 1e-6). */
static void token_by_token(void) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  tu_rng r = {5};
  const attn_kv_dtype dts[3][2] = {{ATTN_KV_F32, ATTN_KV_F32}, {ATTN_KV_Q8_0, ATTN_KV_Q4_0}, {ATTN_KV_F16, ATTN_KV_F16}};
  for (int di = 0; di < 3; di++) {
    pair p;
    const int64_t bt = di == 0 ? 128 : di == 1 ? 7 : 16;
    pair_make(ctx, &p, dts[di][0], dts[di][1], 3, 2, 64, 64, 300, bt, di == 1);
    const int64_t target[3] = {290, 40, 150};
    const int64_t qs[4] = {3, 4, 1, 64};
    float q[3 * 4 * 64], lo[3 * 4 * 64], po[3 * 4 * 64];
    attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, qs), tlo = attn_tensor_view(lo, ATTN_F32, 4, qs);
    attn_tensor tpo = attn_tensor_view(po, ATTN_F32, 4, qs);
    int same = 1;
    for (int64_t t = 0; t < 290; t++) {
      int64_t n_new[3];
      for (int b = 0; b < 3; b++) n_new[b] = t < target[b];
      pair_append(ctx, &p, n_new, &r, 0);
      tu_fill_f32(&r, q, 3 * 4 * 64, 1.0);
      CHECK_OK(ctx, attn_kv_cache_attend(ctx, p.lin, &tlo, NULL, &tq, NULL));
      CHECK_OK(ctx, attn_paged_kv_attend(ctx, p.pg, &tpo, NULL, &tq, 3, p.seq, NULL));
      same &= bt % DEC_NB == 0 ? memcmp(lo, po, sizeof lo) == 0 : near(lo, po, 3 * 4 * 64);
    }
    CHECK(same, "token by token (k %s, v %s): paged differs from linear", attn_kv_dtype_name(dts[di][0]),
          attn_kv_dtype_name(dts[di][1]));
    pair_free(&p);
  }
  attn_ctx_destroy(ctx);
}

/* k, v of n random tokens [1, Hk, n, D] for one sequence (data owned by the caller). */
static void one_seq_tokens(tu_rng *r, float *k, float *v, attn_tensor *tk, attn_tensor *tv, int64_t Hk, int64_t n,
                           int64_t D) {
  const int64_t s[4] = {1, Hk, n, D};
  tu_fill_f32(r, k, Hk * n * D, 1.0);
  tu_fill_f32(r, v, Hk * n * D, 1.0);
  *tk = attn_tensor_view(k, ATTN_F32, 4, s);
  *tv = attn_tensor_view(v, ATTN_F32, 4, s);
}

/* out [1, Hq, 1, D] of sequence s for query q. */
static void attend_one(attn_ctx *ctx, attn_paged_kv_cache *pg, int64_t s, const float *q, float *out, int64_t Hq,
                       int64_t D) {
  const int64_t qs[4] = {1, Hq, 1, D};
  attn_tensor tq = attn_tensor_view((void *)q, ATTN_F32, 4, qs), to = attn_tensor_view(out, ATTN_F32, 4, qs);
  CHECK_OK(ctx, attn_paged_kv_attend(ctx, pg, &to, NULL, &tq, 1, &s, NULL));
}

/* Fork and copy-on-write, truncate, free, and exhaustion, against a linear
 * cache whose rows hold each sequence's tokens. */
static void sharing(void) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  tu_rng r = {11};
  const int64_t Hk = 2, Hq = 4, D = 32, bt = 16;
  attn_paged_kv_config pc;
  attn_paged_kv_config_init(&pc, 12, bt, Hk, D);
  attn_paged_kv_cache *pg;
  CHECK_OK(ctx, attn_paged_kv_create(ctx, &pg, &pc));
  poison_pool(ctx, pg);
  attn_kv_cache_config lc;
  attn_kv_cache_config_init(&lc, 1, 128, Hk, D);
  attn_kv_cache *la, *lb; /* the parent's tokens, the child's */
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &la, &lc));
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &lb, &lc));
  float k[2 * 64 * 32], v[2 * 64 * 32], q[4 * 32], got[4 * 32], want[4 * 32], before[4 * 32];
  attn_tensor tk, tv;
  const int64_t qs[4] = {1, Hq, 1, D};
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, qs), tw = attn_tensor_view(want, ATTN_F32, 4, qs);
  tu_fill_f32(&r, q, Hq * D, 1.0);

  int64_t a, b;
  CHECK_OK(ctx, attn_paged_kv_seq_new(ctx, pg, &a));
  one_seq_tokens(&r, k, v, &tk, &tv, Hk, 40, D); /* a prompt of 40: blocks 16 + 16 + 8 */
  CHECK_OK(ctx, attn_paged_kv_append(ctx, pg, 1, &a, &tk, &tv, NULL));
  CHECK_OK(ctx, attn_kv_cache_append(ctx, la, &tk, &tv, NULL));
  CHECK_OK(ctx, attn_kv_cache_append(ctx, lb, &tk, &tv, NULL));
  CHECK(attn_paged_kv_free_blocks(pg) == 12 - 3, "40 tokens take 3 blocks; %lld free", (long long)attn_paged_kv_free_blocks(pg));
  { /* token 35 of kv head 1 lies in the third block, slot 3, as appended (f32) */
    const int32_t *t;
    attn_tensor bk, bv;
    CHECK(attn_paged_kv_block_table(pg, a, &t) == 3, "a table of 3 blocks");
    CHECK_OK(ctx, attn_paged_kv_block_view(ctx, &bk, &bv, pg, t[2]));
    CHECK(bk.shape[2] == bt && memcmp((float *)bk.data + bk.strides[1] + 3 * bk.strides[2], k + (1 * 40 + 35) * D,
                                      sizeof(float) * (size_t)D) == 0 &&
              memcmp((float *)bv.data + bv.strides[1] + 3 * bv.strides[2], v + (1 * 40 + 35) * D,
                     sizeof(float) * (size_t)D) == 0,
          "a block's view holds its tokens");
    CHECK_ERR(ctx, attn_paged_kv_block_view(ctx, &bk, &bv, pg, 12), ATTN_E_INVALID, "outside");
  }
  { /* a fresh pool hands out blocks in a run, even after the poisoning sequence was freed: read
     * as one run, the decode's blocks are a linear cache's, and so are the results, bitwise */
    const int32_t *t;
    CHECK(attn_paged_kv_block_table(pg, a, &t) == 3 && t[1] == t[0] + 1 && t[2] == t[0] + 2, "blocks in a run");
    attend_one(ctx, pg, a, q, got, Hq, D);
    CHECK_OK(ctx, attn_kv_cache_attend(ctx, la, &tw, NULL, &tq, NULL));
    CHECK(memcmp(want, got, sizeof got) == 0, "a run of blocks attends bitwise as a linear cache");
  }
  CHECK_OK(ctx, attn_paged_kv_seq_fork(ctx, pg, &b, a));
  CHECK(attn_paged_kv_free_blocks(pg) == 12 - 3 && attn_paged_kv_seq_length(pg, b) == 40,
        "a fork shares its parent's blocks: %lld free", (long long)attn_paged_kv_free_blocks(pg));
  const int32_t *ta, *tb;
  CHECK(attn_paged_kv_block_table(pg, a, &ta) == 3 && attn_paged_kv_block_table(pg, b, &tb) == 3 &&
            memcmp(ta, tb, 3 * sizeof(int32_t)) == 0,
        "the child's table is the parent's");
  attend_one(ctx, pg, a, q, before, Hq, D);
  attend_one(ctx, pg, b, q, got, Hq, D);
  CHECK(memcmp(before, got, sizeof got) == 0, "a fork attends as its parent");

  /* the child appends 5 tokens into the shared, partly filled block: it is copied */
  one_seq_tokens(&r, k, v, &tk, &tv, Hk, 5, D);
  CHECK_OK(ctx, attn_paged_kv_append(ctx, pg, 1, &b, &tk, &tv, NULL));
  CHECK_OK(ctx, attn_kv_cache_append(ctx, lb, &tk, &tv, NULL));
  CHECK(attn_paged_kv_free_blocks(pg) == 12 - 4, "copy on write takes one block: %lld free",
        (long long)attn_paged_kv_free_blocks(pg));
  CHECK(attn_paged_kv_block_table(pg, a, &ta) == 3 && attn_paged_kv_block_table(pg, b, &tb) == 3 && ta[0] == tb[0] &&
            ta[1] == tb[1] && ta[2] != tb[2],
        "after copy on write the full blocks stay shared, the last one is the child's own");
  attend_one(ctx, pg, a, q, got, Hq, D);
  CHECK(memcmp(before, got, sizeof got) == 0, "the parent's result is unchanged after the child appends");
  attend_one(ctx, pg, b, q, got, Hq, D);
  CHECK_OK(ctx, attn_kv_cache_attend(ctx, lb, &tw, NULL, &tq, NULL));
  CHECK(near(want, got, Hq * D), "the child's result is a linear cache's of prompt + its tokens");

  /* the parent appends its own 30 tokens: its last block is its own now (no copy), then a new one */
  one_seq_tokens(&r, k, v, &tk, &tv, Hk, 30, D);
  CHECK_OK(ctx, attn_paged_kv_append(ctx, pg, 1, &a, &tk, &tv, NULL));
  CHECK_OK(ctx, attn_kv_cache_append(ctx, la, &tk, &tv, NULL));
  CHECK(attn_paged_kv_free_blocks(pg) == 12 - 6, "70 tokens: the parent holds 5 blocks, 2 of them shared; %lld free",
        (long long)attn_paged_kv_free_blocks(pg));
  attend_one(ctx, pg, a, q, got, Hq, D);
  CHECK_OK(ctx, attn_kv_cache_attend(ctx, la, &tw, NULL, &tq, NULL));
  CHECK(near(want, got, Hq * D), "the parent's result is a linear cache's");
  attend_one(ctx, pg, b, q, got, Hq, D);
  CHECK_OK(ctx, attn_kv_cache_attend(ctx, lb, &tw, NULL, &tq, NULL));
  CHECK(near(want, got, Hq * D), "the child's result is unchanged by the parent's append");

  /* truncate the parent into the shared prefix: its own blocks go back, shared ones stay */
  CHECK_OK(ctx, attn_paged_kv_seq_truncate(ctx, pg, a, 20));
  CHECK_OK(ctx, attn_kv_cache_truncate(ctx, la, 0, 20));
  CHECK(attn_paged_kv_free_blocks(pg) == 12 - 3, "truncated to 20: blocks 0, 1 shared, the child's last; %lld free",
        (long long)attn_paged_kv_free_blocks(pg));
  /* re-append into block 1, which the child shares: copied first */
  one_seq_tokens(&r, k, v, &tk, &tv, Hk, 7, D);
  CHECK_OK(ctx, attn_paged_kv_append(ctx, pg, 1, &a, &tk, &tv, NULL));
  CHECK_OK(ctx, attn_kv_cache_append(ctx, la, &tk, &tv, NULL));
  CHECK(attn_paged_kv_free_blocks(pg) == 12 - 4, "re-append copies the shared block: %lld free",
        (long long)attn_paged_kv_free_blocks(pg));
  attend_one(ctx, pg, a, q, got, Hq, D);
  CHECK_OK(ctx, attn_kv_cache_attend(ctx, la, &tw, NULL, &tq, NULL));
  CHECK(near(want, got, Hq * D), "truncate then append: a linear cache's result");
  attend_one(ctx, pg, b, q, got, Hq, D);
  CHECK_OK(ctx, attn_kv_cache_attend(ctx, lb, &tw, NULL, &tq, NULL));
  CHECK(near(want, got, Hq * D), "the child's result survives the parent's truncate and append");

  /* a fork at a block boundary: appending takes a new block, copies nothing */
  int64_t c;
  CHECK_OK(ctx, attn_paged_kv_seq_truncate(ctx, pg, a, 16));
  CHECK_OK(ctx, attn_paged_kv_seq_fork(ctx, pg, &c, a));
  const int64_t free_before = attn_paged_kv_free_blocks(pg);
  one_seq_tokens(&r, k, v, &tk, &tv, Hk, 1, D);
  CHECK_OK(ctx, attn_paged_kv_append(ctx, pg, 1, &c, &tk, &tv, NULL));
  CHECK(attn_paged_kv_free_blocks(pg) == free_before - 1, "a fork at a boundary takes one new block");

  /* exhaustion: three sequences want more blocks than are left; nothing changes */
  const int64_t seqs[3] = {a, b, c};
  int64_t lens[3];
  float outs[3][4 * 32];
  for (int i = 0; i < 3; i++) lens[i] = attn_paged_kv_seq_length(pg, seqs[i]), attend_one(ctx, pg, seqs[i], q, outs[i], Hq, D);
  const int64_t free_now = attn_paged_kv_free_blocks(pg);
  const int64_t ks3[4] = {3, Hk, 64, D};
  float *k3 = malloc(sizeof(float) * 3 * 2 * 64 * 32), *v3 = malloc(sizeof(float) * 3 * 2 * 64 * 32);
  tu_fill_f32(&r, k3, 3 * Hk * 64 * D, 1.0);
  tu_fill_f32(&r, v3, 3 * Hk * 64 * D, 1.0);
  attn_tensor tk3 = attn_tensor_view(k3, ATTN_F32, 4, ks3), tv3 = attn_tensor_view(v3, ATTN_F32, 4, ks3);
  CHECK_ERR(ctx, attn_paged_kv_append(ctx, pg, 3, seqs, &tk3, &tv3, NULL), ATTN_E_NOMEM, "nothing appended");
  int unchanged = attn_paged_kv_free_blocks(pg) == free_now;
  for (int i = 0; i < 3; i++) {
    attend_one(ctx, pg, seqs[i], q, got, Hq, D);
    unchanged &= attn_paged_kv_seq_length(pg, seqs[i]) == lens[i] && memcmp(got, outs[i], sizeof got) == 0;
  }
  CHECK(unchanged, "a refused append leaves every sequence and the pool as they were");
  /* what fits still goes in */
  const int64_t n_new[3] = {0, 0, 2};
  CHECK_OK(ctx, attn_paged_kv_append(ctx, pg, 3, seqs, &tk3, &tv3, n_new));
  CHECK(attn_paged_kv_seq_length(pg, c) == lens[2] + 2, "a small append after a refused one");

  /* freeing returns every block once its last holder goes */
  CHECK_OK(ctx, attn_paged_kv_seq_free(ctx, pg, a));
  CHECK_OK(ctx, attn_paged_kv_seq_free(ctx, pg, c));
  CHECK(attn_paged_kv_free_blocks(pg) == 12 - 3, "the child keeps its 3 blocks: %lld free",
        (long long)attn_paged_kv_free_blocks(pg));
  CHECK_OK(ctx, attn_paged_kv_seq_free(ctx, pg, b));
  CHECK(attn_paged_kv_free_blocks(pg) == 12, "all freed: %lld free", (long long)attn_paged_kv_free_blocks(pg));
  free(k3), free(v3);
  attn_kv_cache_destroy(la);
  attn_kv_cache_destroy(lb);
  attn_paged_kv_destroy(pg);
  attn_ctx_destroy(ctx);
}

/* Three holders of one partly filled block append together: two copies are
 * made (the last holder keeps the block), so a pool with just two free blocks
 * takes the append; each sequence then attends as a linear cache's row. */
static void shared_append(void) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  tu_rng r = {3};
  pair p;
  pair_make(ctx, &p, ATTN_KV_F32, ATTN_KV_F32, 3, 1, 32, 32, 8, 4, 0);
  attn_paged_kv_destroy(p.pg); /* a pool of exactly 3 blocks instead */
  attn_paged_kv_config pc;
  attn_paged_kv_config_init(&pc, 3, 4, 1, 32);
  CHECK_OK(ctx, attn_paged_kv_create(ctx, &p.pg, &pc));
  poison_pool(ctx, p.pg);
  CHECK_OK(ctx, attn_paged_kv_seq_new(ctx, p.pg, &p.seq[0]));
  const int64_t s[4] = {1, 1, 2, 32};
  float k[64], v[64];
  tu_fill_f32(&r, k, 64, 1.0), tu_fill_f32(&r, v, 64, 1.0);
  attn_tensor tk = attn_tensor_view(k, ATTN_F32, 4, s), tv = attn_tensor_view(v, ATTN_F32, 4, s);
  CHECK_OK(ctx, attn_paged_kv_append(ctx, p.pg, 1, p.seq, &tk, &tv, NULL));
  { /* the linear rows: the prompt each */
    const int64_t s3[4] = {3, 1, 2, 32};
    float k3[192], v3[192];
    for (int b = 0; b < 3; b++) memcpy(k3 + 64 * b, k, sizeof k), memcpy(v3 + 64 * b, v, sizeof v);
    attn_tensor tk3 = attn_tensor_view(k3, ATTN_F32, 4, s3), tv3 = attn_tensor_view(v3, ATTN_F32, 4, s3);
    CHECK_OK(ctx, attn_kv_cache_append(ctx, p.lin, &tk3, &tv3, NULL));
  }
  CHECK_OK(ctx, attn_paged_kv_seq_fork(ctx, p.pg, &p.seq[1], p.seq[0]));
  CHECK_OK(ctx, attn_paged_kv_seq_fork(ctx, p.pg, &p.seq[2], p.seq[0]));
  CHECK(attn_paged_kv_free_blocks(p.pg) == 2, "three holders of one block");
  pair_append(ctx, &p, (int64_t[3]){1, 2, 1}, &r, 0);
  CHECK(attn_paged_kv_free_blocks(p.pg) == 0, "two copies made, the last holder kept the block: %lld free",
        (long long)attn_paged_kv_free_blocks(p.pg));
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  pair_check(ctx, &p, 2, 1, &o, &r, "shared append", 0);
  pair_free(&p);
  attn_ctx_destroy(ctx);
}

/* The pool's allocator: sequences growing together take runs of blocks (each
 * row's next block is the one after its last), a new sequence starts a run in
 * the largest free extent, and a pool with no free run left still hands out
 * every free block. */
static void runs(void) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  attn_paged_kv_config c;
  attn_paged_kv_config_init(&c, 64, 4, 1, 32);
  attn_paged_kv_cache *pg;
  CHECK_OK(ctx, attn_paged_kv_create(ctx, &pg, &c));
  int64_t seq[5];
  for (int i = 0; i < 4; i++) CHECK_OK(ctx, attn_paged_kv_seq_new(ctx, pg, &seq[i]));
  float k[4 * 4 * 32] = {0};
  const int64_t s4[4] = {4, 1, 4, 32}, s1[4] = {1, 1, 1, 32};
  attn_tensor t4 = attn_tensor_view(k, ATTN_F32, 4, s4), t1 = attn_tensor_view(k, ATTN_F32, 4, s1);
  for (int round = 0; round < 12; round++) CHECK_OK(ctx, attn_paged_kv_append(ctx, pg, 4, seq, &t4, &t4, NULL));
  for (int i = 0; i < 4; i++) {
    const int32_t *t;
    CHECK(attn_paged_kv_block_table(pg, seq[i], &t) == 12 && runs_of(pg, seq[i]) == 1,
          "row %d grew with the others, a block a round: its 12 blocks are one run (%lld runs)", i,
          (long long)runs_of(pg, seq[i]));
  }
  CHECK(attn_paged_kv_free_blocks(pg) == 16, "48 of 64 blocks taken");
  /* row 0 takes the rest a token at a time: its run meets row 2's, then the free blocks are scattered */
  int64_t tokens = 48;
  while (attn_paged_kv_free_blocks(pg) > 0 || tokens % 4) {
    CHECK_OK(ctx, attn_paged_kv_append(ctx, pg, 1, seq, &t1, &t1, NULL));
    tokens++;
  }
  CHECK(tokens == 48 + 64 && attn_paged_kv_seq_length(pg, seq[0]) == 112, "row 0 took every free block");
  CHECK_ERR(ctx, attn_paged_kv_append(ctx, pg, 1, seq, &t1, &t1, NULL), ATTN_E_NOMEM, "free blocks");
  CHECK(runs_of(pg, seq[0]) > 1, "row 0's blocks are in several runs");
  /* freed, row 1's run comes back whole to the next sequence */
  const int32_t *t;
  CHECK(attn_paged_kv_block_table(pg, seq[1], &t) == 12, "row 1 holds 12 blocks");
  const int32_t first = t[0];
  CHECK_OK(ctx, attn_paged_kv_seq_free(ctx, pg, seq[1]));
  CHECK_OK(ctx, attn_paged_kv_seq_new(ctx, pg, &seq[4]));
  const int64_t s12[4] = {1, 1, 48, 32};
  float k48[48 * 32] = {0};
  attn_tensor t12 = attn_tensor_view(k48, ATTN_F32, 4, s12);
  CHECK_OK(ctx, attn_paged_kv_append(ctx, pg, 1, &seq[4], &t12, &t12, NULL));
  CHECK(runs_of(pg, seq[4]) == 1 && attn_paged_kv_block_table(pg, seq[4], &t) == 12 && t[0] == first,
        "a new sequence takes the freed run");
  attn_paged_kv_destroy(pg);
  attn_ctx_destroy(ctx);
}

static void hostile(void) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  attn_paged_kv_config pc;
  attn_paged_kv_cache *pg = NULL;
  attn_paged_kv_config_init(&pc, -1, 16, 2, 32);
  CHECK_ERR(ctx, attn_paged_kv_create(ctx, &pg, &pc), ATTN_E_INVALID, "at least 1");
  attn_paged_kv_config_init(&pc, 4, 0, 2, 32);
  CHECK_ERR(ctx, attn_paged_kv_create(ctx, &pg, &pc), ATTN_E_INVALID, "at least 1");
  attn_paged_kv_config_init(&pc, (int64_t)1 << 40, 16, 2, 32);
  CHECK_ERR(ctx, attn_paged_kv_create(ctx, &pg, &pc), ATTN_E_NOMEM, "2^31");
  attn_paged_kv_config_init(&pc, (int64_t)1 << 30, (int64_t)1 << 30, (int64_t)1 << 20, 32);
  CHECK_ERR(ctx, attn_paged_kv_create(ctx, &pg, &pc), ATTN_E_NOMEM, "cannot be addressed");
  attn_paged_kv_config_init(&pc, 4, 16, 2, 32);
  pc.max_seqs = (int64_t)1 << 62;
  CHECK_ERR(ctx, attn_paged_kv_create(ctx, &pg, &pc), ATTN_E_NOMEM, "cannot be addressed");
  attn_paged_kv_config_init(&pc, 4, 16, 2, 48);
  pc.k_dtype = ATTN_KV_Q8_0;
  CHECK_ERR(ctx, attn_paged_kv_create(ctx, &pg, &pc), ATTN_E_INVALID, "multiple of 32");
  pc.k_dtype = (attn_kv_dtype)42;
  CHECK_ERR(ctx, attn_paged_kv_create(ctx, &pg, &pc), ATTN_E_DTYPE, "attn_kv_dtype");
  CHECK_ERR(ctx, attn_paged_kv_create(ctx, NULL, &pc), ATTN_E_INVALID, "null");
  CHECK_ERR(ctx, attn_paged_kv_create(ctx, &pg, NULL), ATTN_E_INVALID, "null");
  pc.size = 3;
  CHECK(attn_paged_kv_create(ctx, &pg, &pc) != ATTN_OK && pg == NULL, "a config of size 3 is refused");
  CHECK(attn_paged_kv_create(NULL, &pg, &pc) == ATTN_E_INVALID, "a NULL context is refused");

  attn_paged_kv_config_init(&pc, 4, 16, 2, 32);
  pc.max_seqs = 2;
  CHECK_OK(ctx, attn_paged_kv_create(ctx, &pg, &pc));
  CHECK(attn_paged_kv_get_config(pg)->v_head_dim == 32 && attn_paged_kv_get_config(pg)->k_dtype == ATTN_KV_F32,
        "config resolved");
  int64_t s0, s1, s2;
  CHECK_OK(ctx, attn_paged_kv_seq_new(ctx, pg, &s0));
  CHECK_OK(ctx, attn_paged_kv_seq_new(ctx, pg, &s1));
  CHECK_ERR(ctx, attn_paged_kv_seq_new(ctx, pg, &s2), ATTN_E_NOMEM, "max_seqs");
  CHECK_ERR(ctx, attn_paged_kv_seq_fork(ctx, pg, &s2, s0), ATTN_E_NOMEM, "max_seqs");
  CHECK_ERR(ctx, attn_paged_kv_seq_new(ctx, pg, NULL), ATTN_E_INVALID, "null");
  CHECK_OK(ctx, attn_paged_kv_seq_free(ctx, pg, s1));
  CHECK_ERR(ctx, attn_paged_kv_seq_free(ctx, pg, s1), ATTN_E_INVALID, "not live");
  CHECK_ERR(ctx, attn_paged_kv_seq_free(ctx, pg, -1), ATTN_E_INVALID, "outside");
  CHECK_ERR(ctx, attn_paged_kv_seq_free(ctx, pg, 2), ATTN_E_INVALID, "outside");
  CHECK_ERR(ctx, attn_paged_kv_seq_truncate(ctx, pg, s0, 1), ATTN_E_INVALID, "cannot keep");
  CHECK_ERR(ctx, attn_paged_kv_seq_truncate(ctx, pg, s0, -1), ATTN_E_INVALID, "cannot keep");
  CHECK_ERR(ctx, attn_paged_kv_seq_fork(ctx, pg, &s2, s1), ATTN_E_INVALID, "not live");
  CHECK(attn_paged_kv_seq_length(pg, s1) == -1 && attn_paged_kv_seq_length(pg, 99) == -1 &&
            attn_paged_kv_seq_length(NULL, 0) == -1 && attn_paged_kv_block_table(pg, s1, NULL) == -1,
        "lengths of ids that are not live");

  float k[2 * 3 * 32] = {0}, q[4 * 32] = {0}, o[4 * 32];
  const int64_t ks[4] = {1, 2, 3, 32}, bad[4] = {1, 2, 3, 31}, qs[4] = {1, 4, 1, 32};
  attn_tensor tk = attn_tensor_view(k, ATTN_F32, 4, ks), tb = attn_tensor_view(k, ATTN_F32, 4, bad);
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, qs), to = attn_tensor_view(o, ATTN_F32, 4, qs);
  const int64_t freed = s1, twice[2] = {s0, s0}, neg = -4, over = 4;
  CHECK_ERR(ctx, attn_paged_kv_append(ctx, pg, 1, &freed, &tk, &tk, NULL), ATTN_E_INVALID, "not live");
  CHECK_ERR(ctx, attn_paged_kv_append(ctx, pg, 2, twice, &tk, &tk, NULL), ATTN_E_INVALID, "twice");
  { /* many sequences, one listed twice: found through the map of ids */
    attn_paged_kv_config big;
    attn_paged_kv_config_init(&big, 4, 16, 2, 32);
    big.max_seqs = 100;
    attn_paged_kv_cache *many;
    CHECK_OK(ctx, attn_paged_kv_create(ctx, &many, &big));
    int64_t ids[41];
    for (int i = 0; i < 40; i++) CHECK_OK(ctx, attn_paged_kv_seq_new(ctx, many, &ids[i]));
    ids[40] = ids[17];
    const int64_t s41[4] = {41, 2, 0, 32};
    attn_tensor e = attn_tensor_view(k, ATTN_F32, 4, s41);
    CHECK_ERR(ctx, attn_paged_kv_append(ctx, many, 41, ids, &e, &e, NULL), ATTN_E_INVALID, "seqs[17] and seqs[40]");
    e.shape[0] = 40;
    CHECK_OK(ctx, attn_paged_kv_append(ctx, many, 40, ids, &e, &e, NULL));
    attn_paged_kv_destroy(many);
  }
  CHECK_ERR(ctx, attn_paged_kv_append(ctx, pg, 1, NULL, &tk, &tk, NULL), ATTN_E_INVALID, "NULL");
  CHECK_ERR(ctx, attn_paged_kv_append(ctx, pg, -1, &s0, &tk, &tk, NULL), ATTN_E_INVALID, "nseq");
  CHECK_ERR(ctx, attn_paged_kv_append(ctx, pg, 1, &s0, &tb, &tb, NULL), ATTN_E_SHAPE, "want");
  CHECK_ERR(ctx, attn_paged_kv_append(ctx, pg, 1, &s0, &tk, &tk, &neg), ATTN_E_INVALID, "outside");
  CHECK_ERR(ctx, attn_paged_kv_append(ctx, pg, 1, &s0, &tk, &tk, &over), ATTN_E_INVALID, "outside");
  CHECK_ERR(ctx, attn_paged_kv_append(ctx, NULL, 1, &s0, &tk, &tk, NULL), ATTN_E_INVALID, "null");
  CHECK(attn_paged_kv_seq_length(pg, s0) == 0 && attn_paged_kv_free_blocks(pg) == 4, "refused appends change nothing");
  CHECK_ERR(ctx, attn_paged_kv_attend(ctx, pg, &to, NULL, &tq, 1, &freed, NULL), ATTN_E_INVALID, "not live");
  CHECK_ERR(ctx, attn_paged_kv_attend(ctx, pg, &to, NULL, &tq, 2, twice, NULL), ATTN_E_INVALID, "twice");
  CHECK_ERR(ctx, attn_paged_kv_attend(ctx, NULL, &to, NULL, &tq, 1, &s0, NULL), ATTN_E_INVALID, "NULL");
  CHECK_ERR(ctx, attn_paged_kv_attend(ctx, pg, &to, NULL, &tk, 1, &s0, NULL), ATTN_E_SHAPE, "must be");
  attn_sdpa_opts so;
  attn_sdpa_opts_init(&so);
  so.dropout_p = 0.5;
  CHECK_ERR(ctx, attn_paged_kv_attend(ctx, pg, &to, NULL, &tq, 1, &s0, &so), ATTN_E_INVALID, "dropout");
  /* an empty sequence sees nothing: zeros */
  CHECK_OK(ctx, attn_paged_kv_attend(ctx, pg, &to, NULL, &tq, 1, &s0, NULL));
  int zeros = 1;
  for (int i = 0; i < 4 * 32; i++) zeros &= o[i] == 0;
  CHECK(zeros, "an empty sequence attends to zeros");
  CHECK_ERR(ctx, attn_paged_kv_attend(ctx, pg, &to, NULL, &tq, 0, NULL, NULL), ATTN_E_SHAPE, "nseq");
  attn_paged_kv_destroy(pg);
  attn_paged_kv_destroy(NULL);
  attn_ctx_destroy(ctx);
}

int main(int argc, char **argv) {
  only = argc > 1 ? argv[1] : NULL;
  if (only) tu_kernel_or_skip(only); /* 77 when this CPU lacks it */
  hostile();
  runs();
  sharing();
  shared_append();
  token_by_token();
  against_linear();
  return tu_finish("test_paged_kv");
}
