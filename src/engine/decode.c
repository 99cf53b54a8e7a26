/* Decoding: a few query rows per kv head against a long cache of keys.
 *
 * Here the cost is reading K and V, so nothing is packed: each K and V row is
 * read once, in place, by every query row of its kv head (the GQA group times
 * Nq rows together), and halves are widened block by block in L1. The keys of
 * each (batch, kv head) are cut into chunks of ATTN__DEC_CHUNK, a fixed size,
 * so that a head can be spread over every thread (split-KV); each chunk leaves
 * an unnormalised partial (O, m, l), and the partials are merged with their
 * log-sum-exp in chunk order. As the cut does not depend on the thread count,
 * neither do the results. K and V may also be a KV cache's blocks (quant.h:
 * q8_0, q4_0): their strides then count bytes, and the kernels dequantize
 * them in registers. */
#include "../internal.h"
#include "../logit.h"
#include "../cpu/kernels.h"
#include "../quant.h"
#include "schedule.h"

#include <stdio.h>
#include <stdlib.h>

/* Keys per chunk. With blocks of ATTN__DEC_NB = 128 keys, 2048 measured best
 * (of chunks 128 to 4096 and blocks 32 to 512; L = 32768, H 32/8, D 128, Zen 5):
 * long runs of K rows, then of V rows, keep the hardware prefetchers streaming,
 * and 8 kv heads of 8192 keys still make 32 pieces for the threads. */
#ifndef ATTN__DEC_CHUNK
#define ATTN__DEC_CHUNK 2048
#endif

/* The matrix unit for a decode (kernels.h's dec_qk, and dec_pv where the values are bf16 too), where the
 * kernel has one and q and k are bf16 (as the bf16 policy takes them: not under FP32) with a D it takes,
 * for a kv head of at least ATTN__DEC_TILE_ROWS rows. It keeps the vectors' accuracy: bf16 products are
 * exact and the tiles sum them in fp32 (in the unit's order, a subnormal bf16 counting as zero), and
 * p.v takes each P as three bf16 terms. All-bf16 steps then stay on the decode up to
 * ATTN__DEC_BF16_TILE_ROWS rows, past the bf16 tiles' ATTN__DEC_BF16_ROWS. GQA 32/8, 8192 keys, D 128,
 * bf16 q, k and v, model 207 Xeon, the cache cycled, ms, before (the vectors up to 24 rows, the blocked
 * tiles past) / this: 8 rows 1.9-2.1 / 1.8-2.0, 16 rows 3.1-4.6 / 2.0-2.8, 32 rows 5.5-6.2 / 3.0-3.3,
 * 64 rows 5.5-7.6 / 4.8-5.1. At 4 rows the vectors stream faster (24 against 18 GB/s). */
#ifndef ATTN__DEC_TILE_ROWS
#define ATTN__DEC_TILE_ROWS 8
#endif
#define ATTN__DEC_BF16_TILE_ROWS 64 /* internal.h */
static const attn__half_kernels *dec_tiles(const attn__dispatch *d, const attn__sdpa *p) {
  const attn__half_kernels *h = attn__dispatch_half(d, p);
  if (!h || !h->dec_qk || p->q.dtype != ATTN_BF16 || p->k.dtype != ATTN_BF16) return NULL;
  if (p->D % 32 || p->D > ATTN__DEC_TILE_D || p->k.strides[3] != 1) return NULL;
  return p->Nq * p->group >= ATTN__DEC_TILE_ROWS ? h : NULL;
}

/* Up to 64 rows a kv head the decode beats the blocked forward, which packs all of K and V on every call
 * (GQA 32/8, 8192 keys, D 128: 12 rows 5.0 ms against 12.3, 64 rows 14.8 against 26.1; the two meet at
 * 128-256 rows), and the f16 tiles (four products each) as well; the bf16 tiles pass it at 24-32 rows
 * (2.1 against 5.0 ms at 12, 4.1 against 4.8 at 24, 5.2 against 4.9 at 32: BENCHMARKS.md). A problem the
 * decode takes is fp32 on its inputs as stored, as attn.h's policy says of decode-sized ones. */
int attn__decode_fits(const attn__dispatch *d, const attn__sdpa *p) {
  const attn__half_kernels *tiles = attn__dispatch_half(d, p);
  const int64_t most = !tiles || tiles == d->half_f16 ? ATTN__DEC_MAX_ROWS
                       : dec_tiles(d, p)                ? ATTN__DEC_BF16_TILE_ROWS
                                                        : ATTN__DEC_BF16_ROWS;
  return p->Nq * p->group <= most && !p->weights && p->dropout_p == 0;
}

typedef struct dec_scratch {
  float *Q, *S, *Mb, *Kc, *Vc, *O, *m, *l;
  uint16_t *Qp, *Vp; /* the rows, and a block of values, as a matrix unit's operands (dec_tiles) */
} dec_scratch;

/* A thread's buffers, carved from its scratch (the struct sits at its start). */
static size_t dec_layout(dec_scratch *into, int64_t R, int64_t D, int64_t Dv) {
  const size_t q = attn__carve_size((size_t)(R * D) * sizeof(float));
  const size_t sz = attn__carve_size((size_t)(R * ATTN__DEC_NB) * sizeof(float));
  const size_t kc = attn__carve_size((size_t)(ATTN__DEC_NB * D) * sizeof(float));
  const size_t vc = attn__carve_size((size_t)(ATTN__DEC_NB * (Dv > 0 ? Dv : 1)) * sizeof(float));
  const size_t o = attn__carve_size((size_t)(R * (Dv > 0 ? Dv : 1)) * sizeof(float));
  const size_t st = attn__carve_size((size_t)R * sizeof(float));
  const size_t qp = attn__carve_size((size_t)((R + 15) / 16 * 16 * D) * sizeof(uint16_t));
  const size_t vp = attn__carve_size((size_t)(ATTN__DEC_NB * ((Dv + 31) / 32 * 32)) * sizeof(uint16_t));
  const size_t head = attn__carve_size(sizeof(dec_scratch));
  if (into) {
    char *b = (char *)into + head;
    into->Q = attn__carve(&b, q), into->S = attn__carve(&b, sz), into->Mb = attn__carve(&b, sz);
    into->Kc = attn__carve(&b, kc), into->Vc = attn__carve(&b, vc);
    into->O = attn__carve(&b, o), into->m = attn__carve(&b, st), into->l = attn__carve(&b, st);
    into->Qp = attn__carve(&b, qp), into->Vp = attn__carve(&b, vp);
  }
  return head + q + 2 * sz + kc + vc + o + 2 * st + qp + vp;
}

/* Row r of a kv head's rows: query head g * group + r / Nq, query row r % Nq. */
static int64_t row_head(const attn__sdpa *p, int64_t g, int64_t r) { return g * p->group + r / p->Nq; }

/* The logits of block [j0, j0 + n) for the R rows of kv head (b, g), whose
 * dot products S holds: each query head's Nq rows are one tile of logit.h's.
 * Mb is scratch of S's shape. Returns nonzero when some key is hidden from
 * some row (its logit is then -inf, whatever q.k gave). */
static int block_logits(const attn__sdpa *p, float *S, float *Mb, int64_t b, int64_t g, int64_t j0, int n) {
  int sparse = 0;
  for (int64_t hs = 0; hs < p->group; hs++) {
    const int64_t off = hs * p->Nq * ATTN__DEC_NB;
    const attn__tile_mask tm = attn__mask_tile(p, Mb + off, ATTN__DEC_NB, n, b, g * p->group + hs, 0, (int)p->Nq, j0);
    if (tm == ATTN__TILE_CLOSED) {
      for (int64_t r = 0; r < p->Nq; r++)
        for (int jj = 0; jj < n; jj++) S[off + r * ATTN__DEC_NB + jj] = -INFINITY;
      sparse = 1;
      continue;
    }
    attn__logit_tile(p, S + off, NULL, ATTN__DEC_NB, (int)p->Nq, n, tm, Mb + off);
    sparse |= tm == ATTN__TILE_MIXED;
  }
  return sparse;
}

/* Keys of a paged cache's batch b from j0 (at most n) whose blocks follow one
 * another in the pool: they lie evenly spaced, as a linear cache's do (a kv
 * head's blocks sit side by side: see paged_kv.c), and are read in place. */
static int64_t contiguous_keys(const attn__sdpa *p, int64_t b, int64_t j0, int64_t n) {
  const int32_t *t = p->block_table + b * p->table_stride;
  const int64_t first = j0 / p->block_tokens;
  int64_t end = (first + 1) * p->block_tokens; /* past the run of blocks so far */
  while (end < j0 + n && t[end / p->block_tokens] == t[first] + end / p->block_tokens - first) end += p->block_tokens;
  return end - j0 < n ? end - j0 : n;
}

/* Block of n keys from key j0 of kv head (b, g) of t, as rows the kernels
 * read: in place when they take its dtype and it has unit stride, else widened
 * (or dequantized) into buf as f32. *ld and *dt get the row distance (bytes
 * for blocks) and the element type. The n rows are evenly spaced (a paged
 * cache's blocks are cut where its pages stop following one another). */
static const void *key_rows(const attn__decode_kernels *dk, const attn__sdpa *p, const attn_tensor *t, int64_t b,
                            int64_t g, int64_t j0, int n, int64_t F, float *buf, int64_t *ld, attn_dtype *dt) {
  const int64_t off = attn__kv_row(p, t, b, g, j0);
  const int quant = attn__is_quant(t->dtype);
  const size_t es = quant ? 1 : attn_dtype_size(t->dtype);
  if (((dk->dtypes >> t->dtype) & 1) && (t->strides[3] == 1 || F == 1 || quant)) {
    *ld = t->strides[2];
    *dt = t->dtype;
    return (const char *)t->data + (size_t)off * es;
  }
  *dt = ATTN_F32;
  for (int jj = 0; jj < n; jj++) {
    const int64_t ro = off + jj * t->strides[2];
    if (quant) attn__dequantize_row(t->dtype, buf + jj * F, (const uint8_t *)t->data + ro, F); /* a kernel without blocks */
    else if (t->strides[3] == 1) dk->widen(buf + jj * F, (const char *)t->data + (size_t)ro * es, t->dtype, F);
    else
      attn__widen_strided(buf + jj * F, t->data, t->dtype, ro, t->strides[3], F);
  }
  *ld = F;
  return buf;
}

/* Asks for rows [j0, j0 + n) of kv head (b, g) of t ahead of use. A block of K
 * then a block of V breaks the stride the hardware prefetchers follow: without
 * asking ahead, one core reads at half speed (the kernels ask for the rows
 * they read in place themselves, key by key; this is for rows widened or
 * gathered here). */
static void prefetch_rows(const attn__sdpa *p, const attn_tensor *t, int64_t b, int64_t g, int64_t j0, int n,
                          int64_t F) {
  const int quant = attn__is_quant(t->dtype);
  const size_t es = quant ? 1 : attn_dtype_size(t->dtype), row = quant ? attn__row_bytes(t->dtype, F) : (size_t)F * es;
  for (int jj = 0; jj < n; jj++) {
    const char *r = (const char *)t->data + (size_t)attn__kv_row(p, t, b, g, j0 + jj) * es;
    for (size_t off = 0; off < row; off += 64) __builtin_prefetch(r + off, 0, 3);
  }
}

/* Where the kernels' read-ahead goes on after a call whose keys end at key
 * next (of [.., hi)) of a paged cache: when key next starts a page that does
 * not follow the call's last one in the pool, that page's first row in t
 * (kernels.h's Knext, Vnext); NULL when the rows go on in place, or when the
 * kernels read a widened copy of them. */
static const void *next_run(const attn__sdpa *p, const attn_tensor *t, int in_place, int64_t b, int64_t g,
                            int64_t next, int64_t hi) {
  if (!p->block_table || !in_place || next >= hi || next % p->block_tokens) return NULL;
  const int64_t e = b * p->table_stride + next / p->block_tokens;
  if (p->block_table[e] == p->block_table[e - 1] + 1) return NULL;
  const size_t es = attn__is_quant(t->dtype) ? 1 : attn_dtype_size(t->dtype);
  return (const char *)t->data + (size_t)attn__kv_row(p, t, b, g, next) * es;
}

// Qp (kernels.h's dec_qk) = the R rows of kv head (b, g), bf16 as stored, by groups of 16 rows and steps of 32 of D.
static void pack_rows_for_tiles(const attn__sdpa *p, uint16_t *Qp, int64_t b, int64_t g) {
  const int64_t R = p->Nq * p->group, D = p->D, steps = D / 32;
  const attn_tensor *q = &p->q;
  const uint16_t *src = q->data;
  for (int64_t r = 0; r < (R + 15) / 16 * 16; r++) {
    const int64_t t = r / 16, n = r % 16;
    const int64_t off = r < R ? b * q->strides[0] + row_head(p, g, r) * q->strides[1] + (r % p->Nq) * q->strides[2] : 0;
    for (int64_t d = 0; d < D; d++)
      Qp[((t * steps + d / 32) * 16 + (d % 32) / 2) * 32 + 2 * n + d % 2] = r < R ? src[off + d * q->strides[3]] : 0;
  }
}

// One chunk [k0, k1) of kv head (b, g) for its R rows; the partial goes to part: (R, Dv) then m (R), l (R).
// tiles (dec_tiles): q.k on its dec_qk for blocks whose keys are read in place, p.v on its dec_pv where it takes them.
static void run_chunk(const attn__decode_kernels *dk, const attn__half_kernels *tiles, const attn__sdpa *p,
                      dec_scratch *s, int64_t b, int64_t g, int64_t k0, int64_t k1, float *part) {
  const int64_t R = p->Nq * p->group, D = p->D, Dv = p->Dv;
  const attn_tensor *q = &p->q;
  const float scale = (float)p->scale;
  /* the keys some row of this head can see */
  int64_t lo = k1, hi = k0;
  for (int64_t i = 0; i < p->Nq; i++) {
    const int64_t a = attn__key_begin(p, b, i), e = attn__key_end(p, b, i);
    if (a < lo) lo = a;
    if (e > hi) hi = e;
  }
  lo = lo < k0 ? k0 : lo;
  hi = hi > k1 ? k1 : hi;
  for (int64_t r = 0; r < R; r++) {
    const int64_t off = b * q->strides[0] + row_head(p, g, r) * q->strides[1] + (r % p->Nq) * q->strides[2];
    attn__widen_strided(s->Q + r * D, q->data, q->dtype, off, q->strides[3], D);
    for (int64_t d = 0; d < D; d++) s->Q[r * D + d] *= scale;
    s->m[r] = -INFINITY;
    s->l[r] = 0;
  }
  memset(s->O, 0, (size_t)(R * Dv) * sizeof(float));
  if (tiles) pack_rows_for_tiles(p, s->Qp, b, g);
  const int64_t groups = (R + ATTN__DEC_MAX_ROWS_K - 1) / ATTN__DEC_MAX_ROWS_K;
  for (int64_t j0 = lo, n; j0 < hi; j0 += n) {
    n = hi - j0 < ATTN__DEC_NB ? hi - j0 : ATTN__DEC_NB;
    if (p->block_table) n = contiguous_keys(p, b, j0, n); /* cut where the pages stop following one another */
    int64_t ldk, ldv;
    attn_dtype kt, vt;
    const void *K = key_rows(dk, p, &p->k, b, g, j0, (int)n, D, s->Kc, &ldk, &kt);
    const void *V = key_rows(dk, p, &p->v, b, g, j0, (int)n, Dv, s->Vc, &ldv, &vt);
    const int64_t next = j0 + n;
    if (next < hi && (K == s->Kc || V == s->Vc)) { /* the kernels prefetch rows they read in place, not these */
      const int nn = (int)(hi - next < ATTN__DEC_NB ? hi - next : ATTN__DEC_NB);
      prefetch_rows(p, &p->k, b, g, next, nn, D);
      prefetch_rows(p, &p->v, b, g, next, nn, Dv);
    }
    /* the kernels take ATTN__DEC_MAX_ROWS_K rows a call: more rows go in groups of about equal size, the
     * block's keys read from memory by the first and from L1 or L2 by the others */
    const void *kn = next_run(p, &p->k, K != s->Kc, b, g, next, hi), *vn = next_run(p, &p->v, V != s->Vc, b, g, next, hi);
    if (tiles && kt == ATTN_BF16)
      tiles->dec_qk(s->S, s->Qp, (int)R, K, ldk, (int)n, D, scale);
    else
      for (int64_t grp = 0; grp < groups; grp++) {
        const int64_t r0 = R * grp / groups, r1 = R * (grp + 1) / groups;
        dk->qk(s->S + r0 * ATTN__DEC_NB, s->Q + r0 * D, (int)(r1 - r0), K, ldk, (int)n, D, kt, kn);
      }
    const int sparse = block_logits(p, s->S, s->Mb, b, g, j0, (int)n);
    /* p.v on the tiles too where they take the values, unless a value that some row's P = 0 must not
     * meet is Inf or NaN (a tile multiplies every key's value); the vectors then take the softmax step
     * alone (Dv 0) */
    const int tiles_pv = tiles && tiles->dec_pv && vt == ATTN_BF16 && Dv % 32 == 0 && Dv <= ATTN__DEC_TILE_D &&
                         R <= ATTN__DEC_MAX_ROWS && !(tiles->dec_pack_v(s->Vp, V, ldv, (int)n, Dv) && sparse);
    const int64_t dv = tiles_pv ? 0 : Dv;
    float m_before[ATTN__DEC_MAX_ROWS], alpha[ATTN__DEC_MAX_ROWS];
    if (tiles_pv) memcpy(m_before, s->m, (size_t)R * sizeof(float));
    for (int64_t grp = 0; grp < groups; grp++) {
      const int64_t r0 = R * grp / groups, r1 = R * (grp + 1) / groups;
      dk->pv(s->O + r0 * dv, s->m + r0, s->l + r0, s->S + r0 * ATTN__DEC_NB, (int)(r1 - r0), V, ldv, (int)n, dv, vt,
             sparse, vn);
    }
    if (tiles_pv) {
      for (int64_t r = 0; r < R; r++) alpha[r] = s->m[r] == -INFINITY ? 1.0f : expf(m_before[r] - s->m[r]);
      tiles->dec_pv(s->O, alpha, s->S, (int)R, s->Vp, (int)n, Dv);
    }
  }
  memcpy(part, s->O, (size_t)(R * Dv) * sizeof(float));
  memcpy(part + R * Dv, s->m, (size_t)R * sizeof(float));
  memcpy(part + R * (Dv + 1), s->l, (size_t)R * sizeof(float));
}

// Merges the chunks' partials of row r of (b, g) in chunk order; writes out and lse.
static void merge_row(const attn__sdpa *p, const float *parts, int64_t nchunks, int64_t stride, int64_t b, int64_t g,
                      int64_t r) {
  const int64_t R = p->Nq * p->group, Dv = p->Dv, h = row_head(p, g, r), i = r % p->Nq;
  const float sink = attn__sink(p, h); /* a key with no value */
  float M = sink;
  for (int64_t c = 0; c < nchunks; c++) {
    const float mc = parts[c * stride + R * Dv + r];
    if (isnan(mc) || mc > M) M = mc;
  }
  const attn_tensor *o = &p->out;
  const int64_t off = b * o->strides[0] + h * o->strides[1] + i * o->strides[2];
  /* out summed over the chunks in chunk order from 0, then scaled: in place in
   * an f32 out, else by blocks of columns in floats and then rounded */
  const int f32 = o->dtype == ATTN_F32;
  float *dst = f32 ? (float *)o->data + off : NULL;
  float L = sink == -INFINITY ? 0.0f : expf(sink - M);
  for (int64_t c0 = 0; c0 < Dv || c0 == 0; c0 += 64) {
    const int64_t n = f32 ? Dv : (Dv - c0 < 64 ? Dv - c0 : 64);
    float acc[64];
    float *to = f32 ? dst : acc;
    const int64_t st = f32 ? o->strides[3] : 1, base = f32 ? 0 : c0;
    for (int64_t cc = 0; cc < n; cc++) to[cc * st] = 0.0f;
    for (int64_t c = 0; c < nchunks && M != -INFINITY; c++) {
      const float *pc = parts + c * stride;
      const float mc = pc[R * Dv + r];
      if (mc == -INFINITY) continue; /* a chunk this row sees nothing of */
      const float w = expf(mc - M);
      if (c0 == 0) L += pc[R * (Dv + 1) + r] * w;
      for (int64_t cc = 0; cc < n; cc++) to[cc * st] += pc[r * Dv + base + cc] * w;
    }
    const float inv = L == 0 ? 0.0f : 1.0f / L; /* L = 0 only when every key is masked and there is no sink */
    for (int64_t cc = 0; cc < n; cc++) {
      if (f32) dst[cc * st] *= inv;
      else attn__store_f32(o->data, o->dtype, off + (c0 + cc) * o->strides[3], acc[cc] * inv);
    }
    if (f32) break; /* every column at once */
  }
  if (p->lse) {
    const attn_tensor *lt = p->lse;
    ((float *)lt->data)[b * lt->strides[0] + h * lt->strides[1] + i * lt->strides[2]] =
        L == 0 ? -INFINITY : M + logf(L);
  }
}

/* The decode's work list: every (batch, kv head) cut into chunks of
 * ATTN__DEC_CHUNK keys (as many chunks as the longest row needs; a shorter
 * row's extra chunks see nothing and cost nothing), the chunks dealt on
 * demand; then the merges, one item per query row, each in chunk order. */
typedef struct dec_job {
  const attn__sdpa *p;
  const attn__decode_kernels *dk;
  const attn__half_kernels *tiles; /* dec_tiles' */
  int64_t pairs, nchunks, stride, R;
  float *parts;
} dec_job;

static int64_t chunk_items(const void *arg, int64_t round) {
  (void)round;
  const dec_job *j = arg;
  return j->pairs * j->nchunks;
}

static void chunk_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)round;
  const dec_job *j = arg;
  const attn__sdpa *p = j->p;
  if (j->tiles && j->tiles->begin) j->tiles->begin();
  for (int64_t it = first; it < last; it++) {
    const int64_t bg = it / j->nchunks, c = it % j->nchunks, b = bg / p->Hk;
    const int64_t nk = attn__keys(p, b);
    const int64_t k0 = c * ATTN__DEC_CHUNK, k1 = k0 + ATTN__DEC_CHUNK < nk ? k0 + ATTN__DEC_CHUNK : nk;
    run_chunk(j->dk, j->tiles, p, scratch, b, bg % p->Hk, k0, k1 > k0 ? k1 : k0, j->parts + it * j->stride);
  }
  if (j->tiles && j->tiles->end) j->tiles->end();
}

static int64_t merge_items(const void *arg, int64_t round) {
  (void)round;
  const dec_job *j = arg;
  return j->pairs * j->R;
}

static void merge_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)scratch, (void)round;
  const dec_job *j = arg;
  const attn__sdpa *p = j->p;
  for (int64_t w = first; w < last; w++)
    merge_row(p, j->parts + (w / j->R) * j->nchunks * j->stride, j->nchunks, j->stride, (w / j->R) / p->Hk,
              (w / j->R) % p->Hk, w % j->R);
}

static void dec_scratch_init(const void *arg, void *scratch) {
  const dec_job *j = arg;
  dec_layout(scratch, j->R, j->p->D, j->p->Dv);
}

attn_status attn__sdpa_run_decode(attn_ctx *ctx, const attn__sdpa *p) {
  dec_job j = {p, ctx->dispatch.decode, dec_tiles(&ctx->dispatch, p), p->B * p->Hk, 0, 0, p->Nq * p->group, NULL};
  j.nchunks = p->Nk > 0 ? (p->Nk + ATTN__DEC_CHUNK - 1) / ATTN__DEC_CHUNK : 1;
  j.stride = j.R * (p->Dv + 2); /* floats of one chunk's partial */
  const size_t part_bytes = attn__bytes(j.pairs, j.nchunks, j.stride, sizeof(float)); /* saturates: see attn__bytes */
  j.parts = attn__workspace(ctx, attn__carve_size(part_bytes));
  if (!j.parts) return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa: cannot allocate %zu bytes of decode partials", part_bytes);
  /* A step's time is mostly its reads: each K or V value read counts as 4 multiply-adds beside the R
   * it takes. Counting the multiply-adds alone kept one thread for 8 kv heads of 512 keys at D 64 (65 us
   * on one thread of the Xeon of BENCHMARKS.md, 34 on two); this way two threads start at 100-200
   * keys a kv head, where they start to pay (R 1 and 4, D 64 and 128, f32 and f16 caches). */
  const double values = (double)j.pairs * (double)p->Nk * (double)(p->D + p->Dv);
  const int threads = attn__threads_for(ctx, values * (double)(j.R + 4));
  static const attn__phase phases[] = {{"kv_chunks", chunk_items, chunk_run, 1}, {"merge_rows", merge_items, merge_run, 0}};
  const attn__job job = {&j, 1, phases, 2, dec_layout(NULL, j.R, p->D, p->Dv), dec_scratch_init};
  const long long args[4] = {(long long)p->B, (long long)p->Hk, (long long)j.nchunks, (long long)j.R};
  if (j.tiles)
    return attn__schedule(ctx, "attn_sdpa decode (%lld rows x %lld kv heads, %lld chunks of " ATTN__STR(ATTN__DEC_CHUNK)
                          " keys each, %lld query rows per kv head, q.k on the tiles)", args, threads, &job);
  return attn__schedule(ctx, "attn_sdpa decode (%lld rows x %lld kv heads, %lld chunks of " ATTN__STR(ATTN__DEC_CHUNK)
                        " keys each, %lld query rows per kv head)", args, threads, &job);
}
