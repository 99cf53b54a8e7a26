/* The paged KV cache (attn.h): a pool of blocks of block_tokens tokens, each
 * sequence a table of block ids, blocks shared between forks by reference
 * counts. A decoding step is one call of the decode framework over every
 * sequence, which follows the tables (attn__sdpa.block_table) and reads the
 * blocks in place; a prefill gathers each sequence into a contiguous buffer
 * and goes through attn_sdpa, as kv_cache.c does for its rows. */
#include "internal.h"
#include "logit.h"
#include "opts.h"
#include "quant.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct paged_seq {
  int live;
  int64_t len;     /* tokens */
  int64_t cap;     /* entries blocks can hold */
  int32_t *blocks; /* [ceil(len / block_tokens)] pool block ids */
} paged_seq;

struct attn_paged_kv_cache {
  attn_paged_kv_config cfg; /* Dv and the dtypes resolved */
  attn_dtype kt, vt;        /* storage: a float dtype or quant.h's ATTN__Q8_0, ATTN__Q4_0 */
  size_t krow, vrow;        /* bytes of one token's row of one kv head */
  /* [Hk, num_blocks, block_tokens, krow or vrow bytes]: a kv head's blocks
   * side by side, so that a sequence whose blocks were taken in a run reads as
   * one stream, and the decode kernels' prefetch past a block's last row
   * (they ask for rows ahead of those they read) lands on the next block */
  void *k, *v;
  int32_t *ref;             /* [num_blocks] sequences holding each block; 0 = free */
  int64_t nfree;
  /* take_block's state: set when its last scan of the pool found no free run of
   * CROWDED blocks, so that it takes any free block, from cursor on, until a
   * block is freed (a scan per block of a crowded pool would cost O(blocks^2)) */
  int crowded;
  int64_t cursor;
  paged_seq *seqs; /* [max_seqs] */
};

void attn_paged_kv_config_init(attn_paged_kv_config *cfg, int64_t num_blocks, int64_t block_tokens, int64_t kv_heads,
                               int64_t head_dim) {
  if (!cfg) return;
  memset(cfg, 0, sizeof *cfg);
  cfg->size = sizeof *cfg;
  cfg->num_blocks = num_blocks;
  cfg->block_tokens = block_tokens;
  cfg->kv_heads = kv_heads;
  cfg->head_dim = head_dim;
  cfg->k_dtype = cfg->v_dtype = ATTN_KV_F32;
  cfg->max_seqs = 256;
}

void attn_paged_kv_destroy(attn_paged_kv_cache *cache) {
  if (!cache) return;
  attn__aligned_free(cache->k);
  attn__aligned_free(cache->v);
  free(cache->ref);
  if (cache->seqs)
    for (int64_t s = 0; s < cache->cfg.max_seqs; s++) free(cache->seqs[s].blocks);
  free(cache->seqs);
  free(cache);
}

attn_status attn_paged_kv_create(attn_ctx *ctx, attn_paged_kv_cache **out, const attn_paged_kv_config *cfg) {
  ATTN__ENTER(ctx);
  if (!out || !cfg) return attn__fail(ctx, ATTN_E_INVALID, "attn_paged_kv_create: null argument");
  *out = NULL;
  attn_paged_kv_config c;
  attn_paged_kv_config_init(&c, 0, 0, 0, 0);
  attn_status st = attn__read_sized(ctx, &c, sizeof c, cfg, "cfg", "attn_paged_kv_config_init");
  if (st) return st;
  if (!c.v_head_dim) c.v_head_dim = c.head_dim;
  if (c.num_blocks < 1 || c.block_tokens < 1 || c.kv_heads < 1 || c.head_dim < 1 || c.v_head_dim < 1 ||
      c.max_seqs < 1)
    return attn__fail(ctx, ATTN_E_INVALID,
                      "attn_paged_kv_create: num_blocks (%lld), block_tokens (%lld), kv_heads (%lld), head dims (%lld, "
                      "%lld) and max_seqs (%lld) must be at least 1",
                      (long long)c.num_blocks, (long long)c.block_tokens, (long long)c.kv_heads,
                      (long long)c.head_dim, (long long)c.v_head_dim, (long long)c.max_seqs);
  if (c.head_dim > ATTN_MAX_HEAD_DIM || c.v_head_dim > ATTN_MAX_HEAD_DIM)
    return attn__fail(ctx, ATTN_E_SHAPE, "attn_paged_kv_create: head dims %lld, %lld pass ATTN_MAX_HEAD_DIM (%lld)",
                      (long long)c.head_dim, (long long)c.v_head_dim, (long long)ATTN_MAX_HEAD_DIM);
  if (c.num_blocks > INT32_MAX)
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_paged_kv_create: num_blocks %lld passes 2^31 - 1 (block ids are int32)",
                      (long long)c.num_blocks);
  attn_kv_dtype asked[2] = {c.k_dtype, c.v_dtype};
  const int64_t dims[2] = {c.head_dim, c.v_head_dim};
  attn_dtype kinds[2];
  if ((st = attn__kv_storage(ctx, "attn_paged_kv_create", asked, ATTN_F32, dims, kinds))) return st;
  c.k_dtype = asked[0], c.v_dtype = asked[1];
  const size_t krow = attn__row_bytes(kinds[0], c.head_dim), vrow = attn__row_bytes(kinds[1], c.v_head_dim);
  /* every size checked before anything is allocated */
  size_t nk, nv, tables;
  int64_t rows;
  if (attn__mul_overflows(c.num_blocks, c.kv_heads, &rows) || attn__mul_overflows(rows, c.block_tokens, &rows) ||
      attn__alloc_size(rows, (int64_t)krow, 1, 1, &nk) || attn__alloc_size(rows, (int64_t)vrow, 1, 1, &nv) ||
      attn__alloc_size(c.max_seqs, 1, 1, sizeof(paged_seq), &tables) || nk + nv > ATTN__SIZE_LIMIT)
    return attn__fail(ctx, ATTN_E_NOMEM,
                      "attn_paged_kv_create: a pool of %lld blocks of %lld tokens x %lld kv heads (or %lld sequences) "
                      "cannot be addressed",
                      (long long)c.num_blocks, (long long)c.block_tokens, (long long)c.kv_heads,
                      (long long)c.max_seqs);
  attn_paged_kv_cache *pc = calloc(1, sizeof *pc);
  if (pc) {
    pc->cfg = c;
    pc->kt = kinds[0], pc->vt = kinds[1];
    pc->krow = krow, pc->vrow = vrow;
    pc->k = attn__huge_alloc(nk);
    pc->v = attn__huge_alloc(nv);
    pc->ref = calloc((size_t)c.num_blocks, sizeof(int32_t));
    pc->seqs = calloc((size_t)c.max_seqs, sizeof(paged_seq));
  }
  if (!pc || !pc->k || !pc->v || !pc->ref || !pc->seqs) {
    attn_paged_kv_destroy(pc);
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_paged_kv_create: cannot allocate a pool of %zu + %zu bytes", nk, nv);
  }
  pc->nfree = c.num_blocks;
  *out = pc;
  return ATTN_OK;
}

const attn_paged_kv_config *attn_paged_kv_get_config(const attn_paged_kv_cache *cache) {
  return cache ? &cache->cfg : NULL;
}

static int live(const attn_paged_kv_cache *c, int64_t seq) {
  return c && seq >= 0 && seq < c->cfg.max_seqs && c->seqs[seq].live;
}

static attn_status bad_seq(attn_ctx *ctx, const attn_paged_kv_cache *c, int64_t seq, const char *fn) {
  if (seq < 0 || seq >= c->cfg.max_seqs)
    return attn__fail(ctx, ATTN_E_INVALID, "%s: sequence %lld is outside 0..%lld", fn, (long long)seq,
                      (long long)c->cfg.max_seqs - 1);
  return attn__fail(ctx, ATTN_E_INVALID, "%s: sequence %lld is not live (never made, or freed)", fn, (long long)seq);
}

/* Blocks holding len tokens. */
static int64_t blocks_for(const attn_paged_kv_cache *c, int64_t len) {
  return (len + c->cfg.block_tokens - 1) / c->cfg.block_tokens;
}

int64_t attn_paged_kv_seq_length(const attn_paged_kv_cache *cache, int64_t seq) {
  return live(cache, seq) ? cache->seqs[seq].len : -1;
}

int64_t attn_paged_kv_free_blocks(const attn_paged_kv_cache *cache) { return cache ? cache->nfree : 0; }

int64_t attn_paged_kv_block_table(const attn_paged_kv_cache *cache, int64_t seq, const int32_t **blocks) {
  if (blocks) *blocks = NULL;
  if (!live(cache, seq)) return -1;
  if (blocks) *blocks = cache->seqs[seq].blocks;
  return blocks_for(cache, cache->seqs[seq].len);
}

/* A free slot of the sequence table, or -1. */
static int64_t free_slot(const attn_paged_kv_cache *c) {
  for (int64_t s = 0; s < c->cfg.max_seqs; s++)
    if (!c->seqs[s].live) return s;
  return -1;
}

attn_status attn_paged_kv_seq_new(attn_ctx *ctx, attn_paged_kv_cache *cache, int64_t *seq) {
  ATTN__ENTER(ctx);
  if (!cache || !seq) return attn__fail(ctx, ATTN_E_INVALID, "attn_paged_kv_seq_new: null argument");
  const int64_t s = free_slot(cache);
  if (s < 0)
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_paged_kv_seq_new: all %lld sequences (max_seqs) are live",
                      (long long)cache->cfg.max_seqs);
  cache->seqs[s].live = 1;
  cache->seqs[s].len = 0;
  *seq = s;
  return ATTN_OK;
}

/* Drops sequence s's hold on its blocks from entry `from` on. */
static void release_from(attn_paged_kv_cache *c, paged_seq *s, int64_t from) {
  const int64_t had = c->nfree;
  for (int64_t i = blocks_for(c, s->len) - 1; i >= from; i--) c->nfree += --c->ref[s->blocks[i]] == 0;
  if (c->nfree > had) c->crowded = 0;
}

attn_status attn_paged_kv_seq_free(attn_ctx *ctx, attn_paged_kv_cache *cache, int64_t seq) {
  ATTN__ENTER(ctx);
  if (!cache) return attn__fail(ctx, ATTN_E_INVALID, "attn_paged_kv_seq_free: cache is NULL");
  if (!live(cache, seq)) return bad_seq(ctx, cache, seq, "attn_paged_kv_seq_free");
  paged_seq *s = &cache->seqs[seq];
  release_from(cache, s, 0);
  s->live = 0;
  s->len = 0;
  return ATTN_OK;
}

/* Room for at least n entries in s's table (the blocks themselves untouched). */
static int reserve(paged_seq *s, int64_t n) {
  if (n <= s->cap) return 1;
  int64_t cap = s->cap ? s->cap : 4;
  while (cap < n) cap *= 2;
  int32_t *b = realloc(s->blocks, (size_t)cap * sizeof(int32_t));
  if (!b) return 0;
  s->blocks = b, s->cap = cap;
  return 1;
}

attn_status attn_paged_kv_seq_fork(attn_ctx *ctx, attn_paged_kv_cache *cache, int64_t *child, int64_t parent) {
  ATTN__ENTER(ctx);
  if (!cache || !child) return attn__fail(ctx, ATTN_E_INVALID, "attn_paged_kv_seq_fork: null argument");
  if (!live(cache, parent)) return bad_seq(ctx, cache, parent, "attn_paged_kv_seq_fork");
  const int64_t s = free_slot(cache);
  if (s < 0)
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_paged_kv_seq_fork: all %lld sequences (max_seqs) are live",
                      (long long)cache->cfg.max_seqs);
  const paged_seq *p = &cache->seqs[parent];
  paged_seq *d = &cache->seqs[s];
  const int64_t nb = blocks_for(cache, p->len);
  if (!reserve(d, nb)) return attn__fail(ctx, ATTN_E_NOMEM, "attn_paged_kv_seq_fork: out of memory for a block table");
  for (int64_t i = 0; i < nb; i++) d->blocks[i] = p->blocks[i], cache->ref[p->blocks[i]]++;
  d->len = p->len;
  d->live = 1;
  *child = s;
  return ATTN_OK;
}

attn_status attn_paged_kv_seq_truncate(attn_ctx *ctx, attn_paged_kv_cache *cache, int64_t seq, int64_t length) {
  ATTN__ENTER(ctx);
  if (!cache) return attn__fail(ctx, ATTN_E_INVALID, "attn_paged_kv_seq_truncate: cache is NULL");
  if (!live(cache, seq)) return bad_seq(ctx, cache, seq, "attn_paged_kv_seq_truncate");
  paged_seq *s = &cache->seqs[seq];
  if (length < 0 || length > s->len)
    return attn__fail(ctx, ATTN_E_INVALID, "attn_paged_kv_seq_truncate: sequence %lld holds %lld tokens; cannot keep %lld",
                      (long long)seq, (long long)s->len, (long long)length);
  release_from(cache, s, blocks_for(cache, length));
  s->len = length;
  return ATTN_OK;
}

/* Whether block b is the last of a live sequence's, which may grow into the blocks after it. */
static int ends_a_sequence(const attn_paged_kv_cache *c, int64_t b) {
  for (int64_t s = 0; s < c->cfg.max_seqs; s++) {
    const paged_seq *q = &c->seqs[s];
    if (q->live && q->len > 0 && q->blocks[blocks_for(c, q->len) - 1] == b) return 1;
  }
  return 0;
}

/* A free block for a sequence whose last block is prev (-1: none) and which
 * takes `want` blocks in this append, this one included (the caller counted
 * that they are free). The block after prev when it is free, so that a
 * sequence's blocks stay a run, which the decode reads as one stream (blocks
 * scattered over the pool decoded 1.2-1.4x slower, BENCHMARKS.md). Else a new
 * run starts: for several blocks (a prompt), at the start of the smallest free
 * extent that holds them all; for one (a sequence growing a token at a time),
 * in the largest free extent, at its middle when a live sequence ends just
 * before it (half of it is left for that one to grow into), else at its first
 * block. Prompts appended in turn thus lie end to end, and sequences that grow
 * together, a token a step, take runs of blocks rather than every other
 * sequence's next one. The search costs a pass over the pool's reference
 * counts (and the sequences), once per new run; in a crowded pool (crowded
 * above) any free block will do. */
#define CROWDED 8
static int32_t take_block(attn_paged_kv_cache *c, int64_t prev, int64_t want) {
  const int64_t n = c->cfg.num_blocks;
  int64_t b = prev >= 0 && prev + 1 < n && c->ref[prev + 1] == 0 ? prev + 1 : -1;
  if (b < 0 && !c->crowded) {
    int64_t first = 0, len = 0, fit = -1, fit_len = INT64_MAX;
    for (int64_t i = 0; i < n; i++) {
      if (c->ref[i]) continue;
      int64_t e = i + 1;
      while (e < n && c->ref[e] == 0) e++;
      if (e - i > len) first = i, len = e - i;
      if (e - i >= want && e - i < fit_len) fit = i, fit_len = e - i;
      i = e;
    }
    if (want > 1 && fit >= 0) b = fit;
    else b = first > 0 && ends_a_sequence(c, first - 1) ? first + len / 2 : first;
    c->crowded = len < CROWDED;
  } else if (b < 0) {
    while (c->ref[c->cursor]) c->cursor = (c->cursor + 1) % n;
    b = c->cursor;
  }
  c->ref[b] = 1;
  c->nfree--;
  return (int32_t)b;
}

/* Where token slot `slot` of kv head g of pool block blk starts, for kind (0 keys, 1 values). */
static uint8_t *slot_at(const attn_paged_kv_cache *c, int kind, int64_t blk, int64_t g, int64_t slot) {
  const size_t row = kind ? c->vrow : c->krow;
  return (uint8_t *)(kind ? c->v : c->k) + (size_t)((g * c->cfg.num_blocks + blk) * c->cfg.block_tokens + slot) * row;
}

static attn_status check_new(attn_ctx *ctx, const attn_paged_kv_cache *c, const attn_tensor *t, const char *what,
                             int64_t nseq, int64_t F, int64_t n) {
  attn_status st = attn__check_tensor(ctx, t, what, 4);
  if (st) return st;
  if (!attn__is_float(t->dtype))
    return attn__fail(ctx, ATTN_E_DTYPE, "attn_paged_kv_append: %s must be a float dtype, got %s", what,
                      attn_dtype_name(t->dtype));
  if (t->shape[0] != nseq || t->shape[1] != c->cfg.kv_heads || t->shape[2] != n || t->shape[3] != F)
    return attn__fail(ctx, ATTN_E_SHAPE,
                      "attn_paged_kv_append: %s is [%lld, %lld, %lld, %lld]; want [nseq, Hk, n, %s] = [%lld, %lld, %lld, "
                      "%lld]",
                      what, (long long)t->shape[0], (long long)t->shape[1], (long long)t->shape[2],
                      (long long)t->shape[3], what[0] == 'k' ? "D" : "Dv", (long long)nseq,
                      (long long)c->cfg.kv_heads, (long long)n, (long long)F);
  return ATTN_OK;
}

/* Checks that seqs[0..nseq) are live and distinct. */
static attn_status check_seqs(attn_ctx *ctx, const attn_paged_kv_cache *c, int64_t nseq, const int64_t *seqs,
                              const char *fn) {
  if (nseq < 0 || nseq > c->cfg.max_seqs)
    return attn__fail(ctx, ATTN_E_INVALID, "%s: nseq = %lld is outside 0..%lld (max_seqs)", fn, (long long)nseq,
                      (long long)c->cfg.max_seqs);
  if (nseq && !seqs) return attn__fail(ctx, ATTN_E_INVALID, "%s: seqs is NULL", fn);
  for (int64_t i = 0; i < nseq; i++)
    if (!live(c, seqs[i])) return bad_seq(ctx, c, seqs[i], fn);
  /* distinct: by pairs for a few, else through a map of the ids (the cache is
   * not written here: attends may share it) */
  int64_t *at = nseq > 32 ? malloc((size_t)c->cfg.max_seqs * sizeof(int64_t)) : NULL;
  if (nseq > 32 && !at) return attn__fail(ctx, ATTN_E_NOMEM, "%s: out of memory", fn);
  if (at)
    for (int64_t i = 0; i < nseq; i++) at[seqs[i]] = -1;
  for (int64_t i = 0; i < nseq; i++) {
    int64_t j = -1;
    if (at) j = at[seqs[i]], at[seqs[i]] = i;
    else
      for (int64_t k = 0; k < i && j < 0; k++) j = seqs[k] == seqs[i] ? k : -1;
    if (j >= 0) {
      free(at);
      return attn__fail(ctx, ATTN_E_INVALID, "%s: sequence %lld is listed twice (seqs[%lld] and seqs[%lld])", fn,
                        (long long)seqs[i], (long long)j, (long long)i);
    }
  }
  free(at);
  return ATTN_OK;
}

/* Token j of sequence i of src ([nseq, Hk, n, F], any float dtype) for kv head
 * g into dst, a row of storage dt. row: scratch of F floats. */
static void store_token(uint8_t *dst, attn_dtype dt, const attn_tensor *src, float *row, int64_t i, int64_t g,
                        int64_t j) {
  const int64_t F = src->shape[3];
  const int64_t so = i * src->strides[0] + g * src->strides[1] + j * src->strides[2];
  if (dt == ATTN_F32 && src->dtype == ATTN_F32 && src->strides[3] == 1) {
    memcpy(dst, (const float *)src->data + so, (size_t)F * sizeof(float));
    return;
  }
  if (attn__is_quant(dt)) { /* quantized as the token is appended */
    for (int64_t f = 0; f < F; f++) row[f] = (float)attn__load(src->data, src->dtype, so + f * src->strides[3]);
    attn__quantize_row(dt, dst, row, F);
    return;
  }
  for (int64_t f = 0; f < F; f++) attn__store(dst, dt, f, attn__load(src->data, src->dtype, so + f * src->strides[3]));
}

attn_status attn_paged_kv_append(attn_ctx *ctx, attn_paged_kv_cache *cache, int64_t nseq, const int64_t *seqs,
                                 const attn_tensor *k, const attn_tensor *v, const int64_t *n_new) {
  ATTN__ENTER(ctx);
  static const char fn[] = "attn_paged_kv_append";
  if (!cache || !k || !v) return attn__fail(ctx, ATTN_E_INVALID, "%s: null argument", fn);
  const attn_paged_kv_config *c = &cache->cfg;
  attn_status st;
  if ((st = check_seqs(ctx, cache, nseq, seqs, fn))) return st;
  const int64_t n = k->rank == 4 ? k->shape[2] : -1;
  if ((st = check_new(ctx, cache, k, "k", nseq, c->head_dim, n)) ||
      (st = check_new(ctx, cache, v, "v", nseq, c->v_head_dim, n)))
    return st;
  /* every sequence is checked, and the blocks it needs counted, before any is written */
  int64_t need = 0;
  for (int64_t i = 0; i < nseq; i++) {
    const int64_t m = n_new ? n_new[i] : n;
    if (m < 0 || m > n)
      return attn__fail(ctx, ATTN_E_INVALID, "%s: n_new[%lld] = %lld is outside 0..%lld", fn, (long long)i,
                        (long long)m, (long long)n);
    const paged_seq *s = &cache->seqs[seqs[i]];
    if (m > INT64_MAX / 2 - s->len)
      return attn__fail(ctx, ATTN_E_NOMEM, "%s: sequence %lld cannot grow by %lld tokens", fn, (long long)seqs[i],
                        (long long)m);
    const int64_t had = blocks_for(cache, s->len);
    need += blocks_for(cache, s->len + m) - had;
    /* copy-on-write: tokens going into a shared, partly filled last block.
     * Holders of one block appending together copy it in turn, the last one
     * (when every holder appends) keeping it: candidate k copies if k < ref. */
    if (m > 0 && s->len % c->block_tokens && cache->ref[s->blocks[had - 1]] > 1) {
      const int32_t last = s->blocks[had - 1];
      int64_t before = 0;
      for (int64_t j = 0; j < i; j++) {
        const paged_seq *t = &cache->seqs[seqs[j]];
        const int64_t mj = n_new ? n_new[j] : n;
        before += mj > 0 && t->len % c->block_tokens && t->blocks[blocks_for(cache, t->len) - 1] == last;
      }
      need += before + 1 < cache->ref[last];
    }
  }
  if (need > cache->nfree)
    return attn__fail(ctx, ATTN_E_NOMEM,
                      "%s: the pool has %lld free blocks of %lld tokens; this append needs %lld (nothing appended)", fn,
                      (long long)cache->nfree, (long long)c->block_tokens, (long long)need);
  for (int64_t i = 0; i < nseq; i++) { /* tables grown first: a failure here leaves the tokens as they were */
    paged_seq *s = &cache->seqs[seqs[i]];
    if (!reserve(s, blocks_for(cache, s->len + (n_new ? n_new[i] : n))))
      return attn__fail(ctx, ATTN_E_NOMEM, "%s: out of memory for a block table (nothing appended)", fn);
  }
  const int64_t F = c->head_dim > c->v_head_dim ? c->head_dim : c->v_head_dim;
  float *row = malloc((size_t)F * sizeof(float)); /* a token's row, on its way into blocks */
  if (!row) return attn__fail(ctx, ATTN_E_NOMEM, "%s: out of memory", fn);
  const size_t kblock = (size_t)c->block_tokens * cache->krow, vblock = (size_t)c->block_tokens * cache->vrow;
  for (int64_t i = 0; i < nseq; i++) {
    paged_seq *s = &cache->seqs[seqs[i]];
    const int64_t m = n_new ? n_new[i] : n, had = blocks_for(cache, s->len);
    if (m == 0) continue;
    if (s->len % c->block_tokens && cache->ref[s->blocks[had - 1]] > 1) {
      const int64_t want = blocks_for(cache, s->len + m) - had + 1; /* the copy and the new blocks after it */
      const int32_t old = s->blocks[had - 1], nb = take_block(cache, had > 1 ? s->blocks[had - 2] : -1, want);
      for (int64_t g = 0; g < c->kv_heads; g++) {
        memcpy(slot_at(cache, 0, nb, g, 0), slot_at(cache, 0, old, g, 0), kblock);
        memcpy(slot_at(cache, 1, nb, g, 0), slot_at(cache, 1, old, g, 0), vblock);
      }
      cache->ref[old]--; /* still > 0: another sequence holds it */
      s->blocks[had - 1] = nb;
    }
    const int64_t end = blocks_for(cache, s->len + m);
    for (int64_t b = had; b < end; b++) s->blocks[b] = take_block(cache, b ? s->blocks[b - 1] : -1, end - b);
    for (int64_t j = 0; j < m; j++) {
      const int64_t pos = s->len + j, blk = s->blocks[pos / c->block_tokens], slot = pos % c->block_tokens;
      for (int64_t g = 0; g < c->kv_heads; g++) {
        store_token(slot_at(cache, 0, blk, g, slot), cache->kt, k, row, i, g, j);
        store_token(slot_at(cache, 1, blk, g, slot), cache->vt, v, row, i, g, j);
      }
    }
    s->len += m;
  }
  free(row);
  return ATTN_OK;
}

/* A pool as a tensor the decode framework reads through a block table: the
 * pool blocks step by strides[0], kv heads by [1], tokens by [2] (elements of
 * a float dtype, or bytes of a block format, whose shape[3] is then F). */
static attn_tensor pool_view(const attn_paged_kv_cache *c, int kind, int64_t nseq, int64_t longest) {
  const attn_dtype dt = kind ? c->vt : c->kt;
  const int64_t F = kind ? c->cfg.v_head_dim : c->cfg.head_dim;
  const int64_t row = attn__is_quant(dt) ? (int64_t)attn__row_bytes(dt, F) : F;
  attn_tensor t;
  memset(&t, 0, sizeof t);
  t.dtype = dt;
  t.data = kind ? c->v : c->k;
  t.rank = 4;
  t.shape[0] = nseq, t.shape[1] = c->cfg.kv_heads, t.shape[2] = longest, t.shape[3] = F;
  t.strides[3] = 1, t.strides[2] = row, t.strides[0] = c->cfg.block_tokens * row;
  t.strides[1] = c->cfg.num_blocks * t.strides[0];
  return t;
}

attn_status attn_paged_kv_block_view(attn_ctx *ctx, attn_tensor *k, attn_tensor *v, const attn_paged_kv_cache *cache,
                                     int64_t block) {
  ATTN__ENTER(ctx);
  if (!cache || !k || !v) return attn__fail(ctx, ATTN_E_INVALID, "attn_paged_kv_block_view: null argument");
  if (block < 0 || block >= cache->cfg.num_blocks)
    return attn__fail(ctx, ATTN_E_INVALID, "attn_paged_kv_block_view: block %lld is outside 0..%lld", (long long)block,
                      (long long)cache->cfg.num_blocks - 1);
  attn_tensor *t[2] = {k, v};
  for (int kind = 0; kind < 2; kind++) {
    *t[kind] = pool_view(cache, kind, 1, cache->cfg.block_tokens);
    const attn_dtype dt = t[kind]->dtype;
    if (attn__is_quant(dt)) t[kind]->dtype = ATTN_U8, t[kind]->shape[3] = t[kind]->strides[2];
    t[kind]->data = slot_at(cache, kind, block, 0, 0);
  }
  return ATTN_OK;
}

/* The keys (kind 0) or values of nseq sequences of up to longest tokens as attn__sdpa_prepare checks
 * them: an f32 [nseq, Hk, longest, F] contiguous tensor (it reads shapes, not data). */
static attn_tensor checked_view(const attn_paged_kv_cache *cache, int kind, int64_t nseq, int64_t longest) {
  attn_tensor t = pool_view(cache, kind, nseq, longest);
  t.dtype = ATTN_F32;
  t.strides[3] = 1, t.strides[2] = t.shape[3], t.strides[1] = t.shape[2] * t.shape[3];
  t.strides[0] = t.shape[1] * t.strides[1];
  return t;
}

/* Every sequence in one decode call when the step is decode-sized and the
 * fp32 kernels run; ATTN_E_UNSUPPORTED (nothing done) otherwise. */
static attn_status attend_batch(attn_ctx *ctx, const attn_paged_kv_cache *cache, attn_tensor *out, attn_tensor *lse,
                                const attn_tensor *q, int64_t nseq, const int64_t *seqs, const attn_sdpa_opts *o) {
  if (ctx->dispatch.kernel == ATTN_KERNEL_REF || !ctx->dispatch.decode_enabled) return ATTN_E_UNSUPPORTED;
  int64_t longest = 0;
  for (int64_t i = 0; i < nseq; i++) longest = cache->seqs[seqs[i]].len > longest ? cache->seqs[seqs[i]].len : longest;
  attn_tensor ks = checked_view(cache, 0, nseq, longest), vs = checked_view(cache, 1, nseq, longest);
  attn__sdpa p;
  attn_status st = attn__sdpa_prepare(ctx, &p, out, lse, NULL, q, &ks, &vs, o, 1);
  if (st) {
    char msg[ATTN__MSG_LEN];
    snprintf(msg, sizeof msg, "%s", attn_ctx_error(ctx));
    return attn__fail(ctx, st, "attn_paged_kv_attend: %s", msg);
  }
  p.k = pool_view(cache, 0, nseq, longest); /* the storage's dtypes decide which tiles would run */
  p.v = pool_view(cache, 1, nseq, longest);
  if (!attn__decode_fits(&ctx->dispatch, &p)) return ATTN_E_UNSUPPORTED;
  if (p.Hq == 0 || p.Nq == 0 || nseq == 0) return ATTN_OK;
  /* the sequences' lengths and tables, in the order of seqs, as the rows of the batch */
  const int64_t width = blocks_for(cache, longest) > 0 ? blocks_for(cache, longest) : 1;
  int64_t *len = malloc((size_t)nseq * sizeof(int64_t));
  int32_t *table = malloc((size_t)(nseq * width) * sizeof(int32_t));
  if (!len || !table) {
    free(len), free(table);
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_paged_kv_attend: out of memory for the block tables");
  }
  for (int64_t i = 0; i < nseq; i++) {
    const paged_seq *s = &cache->seqs[seqs[i]];
    len[i] = s->len;
    const int64_t nb = blocks_for(cache, s->len);
    if (nb) memcpy(table + i * width, s->blocks, (size_t)nb * sizeof(int32_t));
    for (int64_t e = nb; e < width; e++) table[i * width + e] = 0; /* never read: past the length */
  }
  p.kv_len = len;
  p.block_table = table;
  p.table_stride = width;
  p.block_tokens = cache->cfg.block_tokens;
  st = attn__sdpa_run_decode(ctx, &p);
  free(len);
  free(table);
  return st;
}

/* *out = sequence s's keys (kind 0) or values (1) gathered as a [1, Hk, len, F]
 * tensor (allocated here) of dtype dt: the storage dtype, or f32 (dequantized
 * or widened). */
static attn_status gather(attn_ctx *ctx, attn_tensor *out, const attn_paged_kv_cache *cache, int kind,
                          const paged_seq *s, attn_dtype dt) {
  const attn_dtype st_dt = kind ? cache->vt : cache->kt;
  const int64_t F = kind ? cache->cfg.v_head_dim : cache->cfg.head_dim, bt = cache->cfg.block_tokens;
  const int64_t shape[4] = {1, cache->cfg.kv_heads, s->len, F};
  attn_status st = attn_tensor_alloc(ctx, out, dt, 4, shape);
  if (st) return st;
  const size_t row = kind ? cache->vrow : cache->krow;
  for (int64_t g = 0; g < shape[1]; g++)
    for (int64_t j = 0; j < s->len; j++) {
      const uint8_t *src = slot_at(cache, kind, s->blocks[j / bt], g, j % bt);
      const int64_t at = (g * s->len + j) * F;
      if (dt == st_dt) memcpy((char *)out->data + (size_t)at * attn_dtype_size(dt), src, row);
      else if (attn__is_quant(st_dt)) attn__dequantize_row(st_dt, (float *)out->data + at, src, F);
      else
        for (int64_t f = 0; f < F; f++) ((float *)out->data)[at + f] = (float)attn__load(src, st_dt, f);
    }
  return ATTN_OK;
}

/* Sequence s (q, out and lse its entries) on the kernels, its keys and values read where its block
 * table puts them: the blocked forward gathers them a key block at a time as it packs them
 * (forward.c), a block format's dequantized, so no copy of the sequence is made. */
static attn_status attend_seq(attn_ctx *ctx, const attn_paged_kv_cache *cache, attn_tensor *out, attn_tensor *lse,
                              const attn_tensor *q, const paged_seq *s, const attn_sdpa_opts *o) {
  attn_tensor ks = checked_view(cache, 0, 1, s->len), vs = checked_view(cache, 1, 1, s->len);
  attn__sdpa p;
  attn_status st = attn__sdpa_prepare(ctx, &p, out, lse, NULL, q, &ks, &vs, o, 1);
  if (st) return st;
  p.k = pool_view(cache, 0, 1, s->len);
  p.v = pool_view(cache, 1, 1, s->len);
  p.block_table = s->blocks;
  p.table_stride = blocks_for(cache, s->len);
  p.block_tokens = cache->cfg.block_tokens;
  return attn__sdpa_dispatch(ctx, &p);
}

/* Sequence by sequence: on the kernels in place, or through the oracle on gathered keys and values. */
static attn_status attend_rows(attn_ctx *ctx, const attn_paged_kv_cache *cache, attn_tensor *out, attn_tensor *lse,
                               const attn_tensor *q, int64_t nseq, const int64_t *seqs, const attn_sdpa_opts *o) {
  /* the storage dtype when keys and values share a float one (as kv_cache.c
   * attends its rows), else f32 */
  const int f32 = attn__is_quant(cache->kt) || attn__is_quant(cache->vt) || cache->kt != cache->vt;
  const attn_dtype dt = f32 ? ATTN_F32 : cache->kt;
  attn_status st;
  for (int64_t b = 0; b < nseq; b++) {
    attn_tensor qb = attn__batch_entry(q, b), ob = attn__batch_entry(out, b), kb, vb, lb, *lbp = NULL;
    const paged_seq *s = &cache->seqs[seqs[b]];
    if (lse) lb = attn__batch_entry(lse, b), lbp = &lb;
    if (ctx->dispatch.kernel != ATTN_KERNEL_REF) {
      if ((st = attend_seq(ctx, cache, &ob, lbp, &qb, s, o))) {
        char msg[ATTN__MSG_LEN];
        snprintf(msg, sizeof msg, "%s", attn_ctx_error(ctx));
        return attn__fail(ctx, st, "attn_paged_kv_attend: sequence %lld: %s", (long long)seqs[b], msg);
      }
      continue;
    }
    if ((st = gather(ctx, &kb, cache, 0, s, dt))) return st;
    if ((st = gather(ctx, &vb, cache, 1, s, dt))) {
      attn_tensor_free(&kb);
      return st;
    }
    st = attn_sdpa(ctx, &ob, lbp, NULL, &qb, &kb, &vb, o);
    attn_tensor_free(&kb), attn_tensor_free(&vb);
    if (st) {
      char msg[ATTN__MSG_LEN];
      snprintf(msg, sizeof msg, "%s", attn_ctx_error(ctx));
      return attn__fail(ctx, st, "attn_paged_kv_attend: sequence %lld: %s", (long long)seqs[b], msg);
    }
  }
  return ATTN_OK;
}

attn_status attn_paged_kv_attend(attn_ctx *ctx, attn_paged_kv_cache *cache, attn_tensor *out, attn_tensor *lse,
                                 const attn_tensor *q, int64_t nseq, const int64_t *seqs, const attn_sdpa_opts *opts) {
  ATTN__ENTER(ctx);
  static const char fn[] = "attn_paged_kv_attend";
  if (!cache) return attn__fail(ctx, ATTN_E_INVALID, "%s: cache is NULL", fn);
  attn_status st;
  if ((st = check_seqs(ctx, cache, nseq, seqs, fn))) return st;
  if ((st = attn__check_tensor(ctx, q, "q", 4)) || (st = attn__check_tensor(ctx, out, "out", 4)) ||
      (st = attn__check_writable(ctx, out, "out")))
    return st;
  const attn_paged_kv_config *c = &cache->cfg;
  if (q->shape[0] != nseq || q->shape[3] != c->head_dim)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: q is [%lld, %lld, %lld, %lld]; want [nseq, Hq, Nq, D] with nseq = %lld, D = %lld",
                      fn, (long long)q->shape[0], (long long)q->shape[1], (long long)q->shape[2],
                      (long long)q->shape[3], (long long)nseq, (long long)c->head_dim);
  if (out->shape[0] != nseq)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: out has batch %lld; nseq is %lld", fn, (long long)out->shape[0],
                      (long long)nseq);
  if (lse && ((st = attn__check_tensor(ctx, lse, "lse", 3)) || (st = attn__check_writable(ctx, lse, "lse")) ||
              lse->shape[0] != nseq))
    return st ? st : attn__fail(ctx, ATTN_E_SHAPE, "%s: lse has batch %lld; nseq is %lld", fn,
                                (long long)lse->shape[0], (long long)nseq);
  attn_sdpa_opts o;
  if ((st = attn__cached_opts(ctx, &o, opts, fn))) return st;
  if ((st = attend_batch(ctx, cache, out, lse, q, nseq, seqs, &o)) != ATTN_E_UNSUPPORTED) return st;
  ctx->msg[0] = '\0';
  return attend_rows(ctx, cache, out, lse, q, nseq, seqs, &o);
}
