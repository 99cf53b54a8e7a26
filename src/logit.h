/* What a logit is: the one definition that the oracle, the blocked forward and
 * backward, and the decode kernel all read.
 *
 * The logit of query row i of head h (batch b) for key j is
 *   x = scale * q.k  ->  softcap: cap * tanh(x / cap)  ->  + ALiBi: slope_h * (j - i')
 *     ->  + the mask's term (an additive mask, or the seed's mask * -1e9)
 * unless the key is hidden from the row. A key is hidden when
 *   - it lies outside the row's band [attn__key_begin, attn__key_end): the
 *     row's keys (Nk, or kv_len[b] for a batch of rows of different lengths),
 *     the causal bound, the sliding window and the row's chunk;
 *   - key_padding[b, j] is true;
 *   - a KEEP mask is false there, a MASKED mask true, or the mask's term is -inf.
 * A hidden key's logit is -inf by substitution, never by adding -inf to a
 * computed one, and its value row never meets its zero probability: whatever
 * its K and V hold (NaN, Inf: uninitialised padding, the unused tail of a
 * buffer), it reaches no output, weight, lse or gradient.
 *
 * Who owns what. This file (and logit.c) owns the options: their checks,
 * positions, the band, the mask's terms, the cap and its slope, ALiBi, and the
 * classification of a tile of logits (attn__mask_tile). The frameworks in
 * src/cpu own which keys exist in memory (packing, chunks) and call
 * attn__mask_tile then attn__logit_tile after the microkernel's dot products;
 * microkernels own dot products, exponentials and accumulation only, and read
 * no option. A new option is a field of attn_sdpa_opts, its check and its
 * line here, a CLI flag and a Python keyword. */
#ifndef ATTN_LOGIT_H
#define ATTN_LOGIT_H

#include "internal.h"
#include "cpu/vmath.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* ---- the problem ------------------------------------------------------------
 * Validated once (sdpa.c, then attn__logit_prepare) and shared by every
 * kernel. Each view is rank 4 with explicit strides (masks broadcast with
 * stride 0). */
struct attn__sdpa {
  int64_t B, Hq, Hk, Nq, Nk, D, Dv, group;
  double scale;
  attn_causal causal;
  attn_tensor q, k, v, out;
  int has_mask;
  attn_tensor mask; /* [B, Hq, Nq, Nk] view */
  attn_mask_mode mask_mode;
  int has_kpm;
  attn_tensor kpm;  /* [B, 1, 1, Nk] view: stride[3] on keys, stride[0] on batch */
  attn_tensor *weights; /* [B, Hq, Nq, Nk] or NULL */
  attn_tensor *lse;     /* [B, Hq, Nq] or NULL */
  double dropout_p;     /* in [0, 1]; 0 = no dropout, 1 = every entry dropped (see dropout.h for the mask) */
  uint64_t dropout_seed;
  attn_tensor *mask_grad; /* backward only: [B, Hq, Nq, Nk] dS of an additive mask, or NULL */
  int64_t window;         /* > 0: keys i' - window < j <= i' (causal is then never NONE) */
  int64_t chunk;          /* > 0: keys of i''s chunk of that many global positions (causal then never NONE) */
  double softcap;         /* > 0: s = softcap * tanh(s / softcap) */
  const attn_tensor *alibi; /* f32 [Hq] slopes or NULL */
  const attn_tensor *sinks; /* f32 [Hq] or NULL */
  attn_tensor *sinks_grad;  /* backward only: f32 [Hq] or NULL */
  const int64_t *kv_len;    /* [B] keys of each batch (<= Nk), or NULL for Nk: a batch of rows of
                             * different lengths, read by the decode kernel only (see logit.h) */
  /* A paged KV cache (paged_kv.c), read by the decode framework and gathered
   * a key block at a time by the blocked forward (forward.c): when
   * block_table is set, key j of batch b lies in pool block
   * block_table[b * table_stride + j / block_tokens], slot j % block_tokens;
   * k's and v's strides[0] then step from one pool block to the next (their
   * strides[1] and [2] within a block), and must be block_tokens * strides[2]:
   * the rows of blocks that follow one another in the pool are then evenly
   * spaced, and the decode framework reads such runs as one. NULL: the linear
   * layout. */
  const int32_t *block_table;
  int64_t table_stride, block_tokens;
  /* A packed variable-length batch (attn_sdpa_opts.cu_seqlens_q): B = 1, Nq
   * and Nk are the totals, and "batch" b below is sequence b of nseq, whose
   * rows start at cu_q[b] and keys at cu_k[b] along dim 2. NULL: off. */
  const int64_t *cu_q, *cu_k;
  int64_t nseq;
  /* attn_sdpa_opts.q_offset, k_offset: global positions of row 0 and key 0 (a shard);
   * head_offset: the global index of head 0 (a head shard), for dropout. */
  int64_t q_offset, k_offset, head_offset;
};

/* Fills p's logit options from opts (scale, causal, window, softcap, ALiBi,
 * sinks, mask, key padding), checking each against p's shapes (B, Hq, Nq, Nk,
 * D already set). f32_only: the problem runs on the fp32 kernels. */
attn_status attn__logit_prepare(attn_ctx *ctx, attn__sdpa *p, const attn_sdpa_opts *opts, int f32_only);

/* ---- sequences ------------------------------------------------------------------
 * Batch entries, or the sequences of a packed batch: everything below takes
 * b as either, and i, j as positions within it. */
static inline int64_t attn__seqs(const attn__sdpa *p) { return p->cu_q ? p->nseq : p->B; }

/* Query rows of batch b. */
static inline int64_t attn__queries(const attn__sdpa *p, int64_t b) {
  return p->cu_q ? p->cu_q[b + 1] - p->cu_q[b] : p->Nq;
}

/* Key rows stored for batch b (a KV cache's kv_len may say fewer exist). */
static inline int64_t attn__key_rows(const attn__sdpa *p, int64_t b) {
  return p->cu_k ? p->cu_k[b + 1] - p->cu_k[b] : p->Nk;
}

/* Element offset of query row i of head h of batch b in a view indexed like
 * q (q, out, dout, dq; lse too, its dims 0-2 being q's). */
static inline int64_t attn__qoff(const attn__sdpa *p, const attn_tensor *t, int64_t b, int64_t h, int64_t i) {
  return (p->cu_q ? (p->cu_q[b] + i) * t->strides[2] : b * t->strides[0] + i * t->strides[2]) + h * t->strides[1];
}

/* Element offset of key j of kv head g of batch b in a view indexed like k (k, v, dk, dv). */
static inline int64_t attn__koff(const attn__sdpa *p, const attn_tensor *t, int64_t b, int64_t g, int64_t j) {
  return (p->cu_k ? (p->cu_k[b] + j) * t->strides[2] : b * t->strides[0] + j * t->strides[2]) + g * t->strides[1];
}

/* Offset of key j's row of kv head g of batch b in a KV cache's k or v (elements; bytes for a
 * block format's), through the block table when p reads a paged cache. */
static inline int64_t attn__kv_row(const attn__sdpa *p, const attn_tensor *t, int64_t b, int64_t g, int64_t j) {
  if (!p->block_table) return attn__koff(p, t, b, g, j);
  const int64_t page = p->block_table[b * p->table_stride + j / p->block_tokens];
  return page * t->strides[0] + g * t->strides[1] + (j % p->block_tokens) * t->strides[2];
}

/* The batch (b) and row within it (*i) of row r of dim 2 of a q-like view:
 * the sequence holding row r of a packed batch (found by bisection), else
 * r's own batch of rows Nq apart. Rows' order is the same either way. */
static inline int64_t attn__seq_at(const int64_t *cu, int64_t nseq, int64_t r) {
  int64_t lo = 0, hi = nseq; /* the last s with cu[s] <= r; r < cu[nseq], so cu[s + 1] > r */
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (cu[mid] <= r) lo = mid;
    else hi = mid;
  }
  return lo;
}

static inline int64_t attn__row_seq(const attn__sdpa *p, int64_t r, int64_t *i) {
  if (!p->cu_q) {
    *i = r % p->Nq;
    return r / p->Nq;
  }
  const int64_t s = attn__seq_at(p->cu_q, p->nseq, r);
  *i = r - p->cu_q[s];
  return s;
}

/* attn__row_seq for key rows (dim 2 of a k-like view). */
static inline int64_t attn__key_seq(const attn__sdpa *p, int64_t r, int64_t *j) {
  if (!p->cu_k) {
    *j = r % p->Nk;
    return r / p->Nk;
  }
  const int64_t s = attn__seq_at(p->cu_k, p->nseq, r);
  *j = r - p->cu_k[s];
  return s;
}

/* ---- positions and the band ------------------------------------------------- */
/* Keys that exist for batch b. */
static inline int64_t attn__keys(const attn__sdpa *p, int64_t b) {
  return p->kv_len ? p->kv_len[b] : attn__key_rows(p, b);
}

/* Query row i's position among its keys (the causal alignment in use; a
 * shard's rows and keys counted from their global offsets). */
static inline int64_t attn__qpos(const attn__sdpa *p, int64_t b, int64_t i) {
  const int64_t shift = p->q_offset - p->k_offset;
  return shift + (p->causal == ATTN_CAUSAL_BOTTOM_RIGHT ? i + attn__keys(p, b) - attn__queries(p, b) : i);
}

/* What a kept probability is multiplied by: 1 / (1 - p); 0 at p = 1, where nothing is kept. */
static inline float attn__dropout_scale(const attn__sdpa *p) {
  return p->dropout_p < 1 ? (float)(1.0 / (1.0 - p->dropout_p)) : 0.0f;
}

/* Dropout's decision for (b, h, i, j), at the shard's global positions. */
static inline int attn__dropout_kept(const attn__sdpa *p, int64_t b, int64_t h, int64_t i, int64_t j) {
  return attn_dropout_keep(p->dropout_seed, p->dropout_p, b, p->head_offset + h, p->q_offset + i, p->k_offset + j);
}

/* The end (exclusive) of row i's band: the causal bound, or the row's keys. */
static inline int64_t attn__key_end(const attn__sdpa *p, int64_t b, int64_t i) {
  const int64_t nk = attn__keys(p, b);
  if (p->causal == ATTN_CAUSAL_NONE) return nk;
  const int64_t e = attn__qpos(p, b, i) + 1;
  return e < 0 ? 0 : (e > nk ? nk : e);
}

/* floor(a / n) for n > 0: positions before key 0 (rows of a causal bound
 * that see nothing) stay in chunks of their own. */
static inline int64_t attn__floor_div(int64_t a, int64_t n) {
  return a >= 0 ? a / n : -((-a + n - 1) / n);
}

/* The first key of the chunk holding position pos (a key index: global
 * position k_offset + pos), so chunks are counted from the sequence's start. */
static inline int64_t attn__chunk_start(const attn__sdpa *p, int64_t pos) {
  return attn__floor_div(pos + p->k_offset, p->chunk) * p->chunk - p->k_offset;
}

/* The start of row i's band: the later of the sliding window's first key and
 * the first key of the row's chunk, or 0. */
static inline int64_t attn__key_begin(const attn__sdpa *p, int64_t b, int64_t i) {
  if (p->window <= 0 && p->chunk <= 0) return 0;
  const int64_t pos = attn__qpos(p, b, i);
  int64_t s = p->window > 0 ? pos - p->window + 1 : 0;
  if (p->chunk > 0) {
    const int64_t c = attn__chunk_start(p, pos);
    if (c > s) s = c;
  }
  return s < 0 ? 0 : s;
}

static inline int attn__in_band(const attn__sdpa *p, int64_t b, int64_t i, int64_t j) {
  return j >= attn__key_begin(p, b, i) && j < attn__key_end(p, b, i);
}

/* The first query row whose band can hold key j (rows' bands only move right). */
static inline int64_t attn__first_row_seeing(const attn__sdpa *p, int64_t b, int64_t j) {
  if (p->causal == ATTN_CAUSAL_NONE) return 0;
  const int64_t i = j - attn__qpos(p, b, 0); /* row i's band ends past j when i' >= j */
  return i < 0 ? 0 : i;
}

/* The end (exclusive) of the query rows whose band can hold a key below j1. */
static inline int64_t attn__rows_seeing_end(const attn__sdpa *p, int64_t b, int64_t j1) {
  const int64_t nq = attn__queries(p, b);
  int64_t e = nq;
  if (p->window > 0) {
    const int64_t w = j1 - 1 + p->window - attn__qpos(p, b, 0); /* key j1 - 1 needs i' < j1 - 1 + window */
    if (w < e) e = w;
  }
  if (p->chunk > 0) {
    /* key j1 - 1 needs i' before the end of its chunk */
    const int64_t c = attn__chunk_start(p, j1 - 1) + p->chunk - attn__qpos(p, b, 0);
    if (c < e) e = c;
  }
  return e < 0 ? 0 : e;
}

/* ---- the terms: softcap, ALiBi, masks --------------------------------------- */
/* Element h of an f32 [Hq] option tensor (slopes, sinks). */
static inline float attn__head_value(const attn_tensor *t, int64_t h) {
  return ((const float *)t->data)[h * t->strides[0]];
}

/* A sink's logit for head h (joins each row's softmax with no value), or -inf. */
static inline float attn__sink(const attn__sdpa *p, int64_t h) {
  return p->sinks ? attn__head_value(p->sinks, h) : -INFINITY;
}

/* ALiBi's term slope_h * (j - i'). Both factors are floats (positions below
 * 2^24), so the product in double rounds to the float product exactly: the
 * kernels' float form and the oracle's agree. */
static inline double attn__alibi_term(const attn__sdpa *p, int64_t b, int64_t h, int64_t i, int64_t j) {
  return p->alibi ? (double)attn__head_value(p->alibi, h) * (double)(float)(j - attn__qpos(p, b, i)) : 0.0;
}

/* What the key padding and the mask say of (b, h, i, j): -inf when they hide
 * the key, else the term they add to its logit (0 for bool masks). In double. */
static inline double attn__mask_term(const attn__sdpa *p, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (p->has_kpm) {
    const attn_tensor *m = &p->kpm;
    if (attn__load(m->data, m->dtype, b * m->strides[0] + j * m->strides[3]) != 0) return -INFINITY;
  }
  if (!p->has_mask) return 0;
  const attn_tensor *m = &p->mask;
  const double mv = attn__load(m->data, m->dtype,
                               b * m->strides[0] + h * m->strides[1] + i * m->strides[2] + j * m->strides[3]);
  switch (p->mask_mode) {
    case ATTN_MASK_KEEP: return mv == 0 ? -INFINITY : 0;
    case ATTN_MASK_MASKED: return mv != 0 ? -INFINITY : 0;
    case ATTN_MASK_ADDITIVE: return mv;
    case ATTN_MASK_SEED: return mv * -1e9;
  }
  return 0;
}

/* attn__mask_term for keys j0..j0+n of row (b, h, i), as floats into dst: the
 * same definition read a row at a time, with the common dtypes read directly. */
static inline void attn__mask_row(const attn__sdpa *p, int64_t b, int64_t h, int64_t i, int64_t j0, int n, float *dst) {
  for (int jj = 0; jj < n; jj++) dst[jj] = 0.0f;
  if (p->has_kpm) { /* bool or u8, checked by attn__logit_prepare */
    const attn_tensor *m = &p->kpm;
    const uint8_t *d = (const uint8_t *)m->data + b * m->strides[0] + j0 * m->strides[3];
    const int64_t s = m->strides[3];
    for (int jj = 0; jj < n; jj++) dst[jj] = d[jj * s] ? -INFINITY : 0.0f;
  }
  if (!p->has_mask) return;
  const attn_tensor *m = &p->mask;
  const int64_t off = b * m->strides[0] + h * m->strides[1] + i * m->strides[2] + j0 * m->strides[3], s = m->strides[3];
  if (p->mask_mode == ATTN_MASK_KEEP || p->mask_mode == ATTN_MASK_MASKED) { /* bool or u8 */
    const uint8_t *d = (const uint8_t *)m->data + off;
    const int keep = p->mask_mode == ATTN_MASK_KEEP;
    for (int jj = 0; jj < n; jj++)
      if ((d[jj * s] != 0) != keep) dst[jj] = -INFINITY;
  } else if (p->mask_mode == ATTN_MASK_ADDITIVE && m->dtype == ATTN_F32) {
    const float *d = (const float *)m->data + off;
    for (int jj = 0; jj < n; jj++)
      if (dst[jj] != -INFINITY) dst[jj] = d[jj * s];
  } else {
    for (int jj = 0; jj < n; jj++)
      if (dst[jj] != -INFINITY) dst[jj] = (float)attn__mask_term(p, b, h, i, j0 + jj);
  }
}

/* ---- the oracle's logit, in double ------------------------------------------- */
/* The logit of (b, h, i, j) in double, by the definition above: -inf for a
 * hidden key, whose q.k is never computed. *slope (when not NULL) gets the
 * derivative of the logit by the raw scaled q.k: the cap's 1 - tanh^2, else 1.
 * Shared by the forward and the backward oracles so that both see exactly the
 * same scores. */
static inline double attn__ref_logit_slope(const attn__sdpa *p, int64_t b, int64_t h, int64_t i, int64_t j,
                                           double *slope) {
  if (slope) *slope = 1;
  if (!attn__in_band(p, b, i, j)) return -INFINITY;
  const double term = attn__mask_term(p, b, h, i, j);
  if (term == -INFINITY) return -INFINITY;
  const attn_tensor *q = &p->q, *k = &p->k;
  const int64_t qoff = attn__qoff(p, q, b, h, i), koff = attn__koff(p, k, b, h / p->group, j);
  double dot = 0;
  for (int64_t d = 0; d < p->D; d++)
    dot += attn__load(q->data, q->dtype, qoff + d * q->strides[3]) * attn__load(k->data, k->dtype, koff + d * k->strides[3]);
  double x = dot * p->scale;
  if (p->softcap > 0) {
    const double t = tanh(x / p->softcap);
    x = p->softcap * t;
    if (slope) *slope = 1 - t * t;
  }
  return x + attn__alibi_term(p, b, h, i, j) + term;
}

static inline double attn__ref_logit(const attn__sdpa *p, int64_t b, int64_t h, int64_t i, int64_t j) {
  return attn__ref_logit_slope(p, b, h, i, j, NULL);
}

/* ---- tiles of logits, for the kernels ----------------------------------------- */
/* What a tile's mask does:
 *   OPEN    every logit visible, nothing to add: Mb unused
 *   CLOSED  every logit hidden: skip the tile
 *   ADD     every logit of an existing key visible; Mb holds the terms to add (ALiBi, an additive mask)
 *   MIXED   some logits of existing keys hidden: Mb holds -inf there (substituted, not added)
 *           and the terms elsewhere; pv must then run sparse. */
typedef enum attn__tile_mask { ATTN__TILE_OPEN, ATTN__TILE_CLOSED, ATTN__TILE_ADD, ATTN__TILE_MIXED } attn__tile_mask;

/* Rows i0..i0+rows of head h (batch b) against keys j0..j0+nr: the band, keys
 * past the row's keys, key padding and the mask, decided before any
 * arithmetic so that a fully masked tile costs no FMAs, with ALiBi's term.
 * Mb is (rows, nr) with rows ld floats apart (ld >= 2); written unless the tile is OPEN.
 * Keys past the row's keys are -inf in Mb but do not make a tile MIXED: no
 * framework hands their values to a kernel (logit.c).
 * When the band is all there is (attn__band_only), Mb's row r holds instead
 * the row's visible keys [lo, hi) of the tile (attn__row_band), and
 * attn__logit_tile hides the rest itself: a causal tile's logits then cost
 * two short fills a row, not a pass over the tile's mask and one over S. */
attn__tile_mask attn__mask_tile(const attn__sdpa *p, float *Mb, int64_t ld, int nr, int64_t b, int64_t h, int64_t i0,
                                int rows, int64_t j0);

static inline int attn__band_only(const attn__sdpa *p) { return !p->has_mask && !p->has_kpm && !p->alibi; }

/* A band-only tile's row r in Mb: the first two words of the row, as integers. */
typedef struct attn__row_band {
  int32_t lo, hi;
} attn__row_band;
static inline attn__row_band *attn__band_at(float *Mb, int64_t ld, int r) { return (attn__row_band *)(Mb + r * ld); }

/* Mb's verdict on n logits of a row: a hidden one becomes -inf whatever q.k
 * gave (NaN from a poisoned key included), the others get their term. */
static inline void attn__apply_row_mask(float *restrict S, const float *restrict Mb, int64_t n) {
  /* a select on the bits (-inf has one pattern): gcc leaves the float form as branches */
  for (int64_t e = 0; e < n; e++) {
    const float sum = S[e] + Mb[e];
    uint32_t m, x;
    memcpy(&m, &Mb[e], 4);
    memcpy(&x, &sum, 4);
    const uint32_t hidden = 0u - (uint32_t)(m == 0xff800000u);
    x = (x & ~hidden) | (m & hidden);
    memcpy(&S[e], &x, 4);
  }
}

/* The logits of a tile after the dot products: S (rows, n), rows ld floats
 * apart, holds scale * q.k; Mb and tm come from attn__mask_tile (same ld).
 * Applies the cap, then the terms and the hidden set. slope (rows, n) at ld,
 * or NULL, gets the cap's derivative (1 - tanh^2) for the backward; it is
 * left unwritten without a cap. */
static inline void attn__logit_tile(const attn__sdpa *p, float *S, float *slope, int64_t ld, int rows, int n,
                                    attn__tile_mask tm, const float *Mb) {
  const int whole = ld == n; /* one run over the tile, else row by row */
  if (p->softcap > 0) {
    if (whole) attn__cap_tanh(S, slope, (int64_t)rows * n, (float)p->softcap);
    else
      for (int r = 0; r < rows; r++) attn__cap_tanh(S + r * ld, slope ? slope + r * ld : NULL, n, (float)p->softcap);
  }
  if (tm == ATTN__TILE_OPEN) return;
  if (attn__band_only(p)) { /* -inf substituted outside [lo, hi): a hidden key's NaN from q.k included */
    for (int r = 0; r < rows; r++) {
      const attn__row_band band = *(const attn__row_band *)(Mb + r * ld);
      float *s = S + r * ld;
      for (int jj = 0; jj < band.lo; jj++) s[jj] = -INFINITY;
      for (int jj = band.hi; jj < n; jj++) s[jj] = -INFINITY;
    }
    return;
  }
  if (whole) attn__apply_row_mask(S, Mb, (int64_t)rows * n);
  else
    for (int r = 0; r < rows; r++) attn__apply_row_mask(S + r * ld, Mb + r * ld, n);
}

/* Whether the tile needed the cap's slope: dS then goes through it. */
static inline int attn__logit_has_slope(const attn__sdpa *p) { return p->softcap > 0; }

#endif
