/* The blocked ("flash") attention framework for fp32 on the CPU.
 *
 * For each (batch, kv head): pack K transposed into key blocks of NR (and V
 * into rows if it is not unit-stride), then every tile of MR query rows of
 * every query head in the group streams over the key blocks with an online
 * softmax, so no Nq x Nk matrix exists unless weights are asked for. Tiles
 * are independent, so results do not depend on the thread count.
 * With half tiles (attn__dispatch_half: bf16 products, fp32 sums) q, k and v
 * are packed as bf16 pairs instead, and only the tiles' qk and pv change. */
#include "../internal.h"
#include "../logit.h"
#include "../cpu/kernels.h"
#include "../quant.h"
#include "schedule.h"

#include <stdio.h>
#include <stdlib.h>

/* Tiles of query rows that share each key block while it is in L1: fewer
 * passes over K and V. QB_NEAR while a kv head's K and V fit in L2_SHARE;
 * past that every pass streams them from L3 or memory, and QB_FAR tiles a
 * pass measured 1.1-1.25x faster (the Intel Xeon with AMX of BENCHMARKS.md,
 * 2 threads, D 64-256, N 2048-16384) and level at N 512-2048 D 64. A tile's
 * arithmetic does not depend on how many tiles share a block, so results do
 * not either. */
#define QB_NEAR 4
#define QB_FAR 16
#define QB_MAX QB_FAR
#define L2_SHARE ((int64_t)1 << 20)
/* Key blocks of OPEN tiles whose p.v waits for pv_blocks (kernels.h): O's columns then pass
 * through the matrix unit once per PV_BLOCKS blocks instead of once per block (the Intel Xeon
 * with AMX of BENCHMARKS.md, bf16 D 128: 2 and 4 measured alike, 8 slower; 4 kept). */
#define PV_BLOCKS 4

typedef struct tile_state {
  float *Q, *O, *m, *l, *alpha;
  uint16_t *Qh; /* the half tiles' queries, as bf16 pairs, where Q would be */
  int64_t i0, kend, kbeg; /* keys [kbeg, kend) hold every key a row of the tile may see */
  int rows;
} tile_state;

typedef struct scratch {
  tile_state t[QB_MAX];
  float *S, *Mb;
  /* With pv_blocks: each tile's OPEN key blocks whose p.v is still to run, their P and alpha as
   * softmax_round left them (slot k of tile t at Pq + (t PV_BLOCKS + k) terms MR NR, and aq likewise by
   * ATTN__STAT_LANES) and their values */
  uint16_t *Pq;
  float *aq;
  const uint16_t *vq[QB_MAX][PV_BLOCKS];
  int nq[QB_MAX];
  void *gather; /* a KV cache's key block, as rows the packs read (gather_rows), or NULL */
  float *base; /* one allocation behind everything above */
} fwd_scratch;

/* A thread's tiles, carved from its scratch (the struct sits at its start). */
/* qrow: floats a tile's query row takes (D, or the half tiles' padded pairs and terms). */
/* queued: 0, or the half tiles' terms when the tiles queue blocks for pv_blocks (their Pq, a bf16 plane
 * of P per term, and aq: PV_BLOCKS slots a tile). */
/* gather: floats for gather_rows (0 when the keys and values are read in place). */
static size_t scratch_bytes(int64_t mr, int64_t nr, int64_t qrow, int64_t Dv, int queued, int64_t gather) {
  const int64_t up = 16; /* floats per 64 bytes */
  const int64_t q = (mr * qrow + up - 1) / up * up, o = (mr * (Dv > 0 ? Dv : 1) + up - 1) / up * up;
  const int64_t st = 3 * ATTN__STAT_LANES, tile = (mr * nr + up - 1) / up * up;
  const int64_t queue = queued ? QB_MAX * PV_BLOCKS * (queued * tile / 2 + ATTN__STAT_LANES) : 0; /* bf16: half a tile */
  return attn__carve_size(sizeof(fwd_scratch)) + (size_t)(2 * tile + QB_MAX * (q + o + st) + queue + gather) * sizeof(float);
}

static void scratch_carve(fwd_scratch *s, int64_t mr, int64_t nr, int64_t qrow, int64_t Dv, int queued, int64_t gather) {
  const int64_t up = 16;
  const int64_t q = (mr * qrow + up - 1) / up * up, o = (mr * (Dv > 0 ? Dv : 1) + up - 1) / up * up;
  const int64_t st = 3 * ATTN__STAT_LANES, tile = (mr * nr + up - 1) / up * up;
  float *b = (float *)((char *)s + attn__carve_size(sizeof(fwd_scratch)));
  s->base = b;
  s->S = b;
  s->Mb = b + tile;
  b += 2 * tile;
  s->Pq = NULL, s->aq = NULL;
  if (queued) {
    s->aq = b;
    b += QB_MAX * PV_BLOCKS * ATTN__STAT_LANES;
    s->Pq = (uint16_t *)b;
    b += QB_MAX * PV_BLOCKS * queued * tile / 2;
  }
  for (int t = 0; t < QB_MAX; t++) s->nq[t] = 0;
  for (int t = 0; t < QB_MAX; t++, b += q + o + st) {
    tile_state *ts = &s->t[t];
    ts->Q = b;
    ts->Qh = (uint16_t *)b; /* terms x 2 D2 halves a row: qrow floats */
    ts->O = b + q;
    ts->m = b + q + o;
    ts->l = ts->m + ATTN__STAT_LANES;
    ts->alpha = ts->m + 2 * ATTN__STAT_LANES;
  }
  s->gather = gather ? b : NULL;
}

/* The forward's work list: per round, `per_round` kv heads (b, g) are packed
 * (K transposed into key blocks, V into rows when it is not unit-stride f32;
 * with half tiles both as bf16 pairs), then every query block of every query
 * head of those kv heads is an item. Packed sizes are in bytes per kv head
 * (of the longest sequence, in a packed batch).
 * A packed batch's kv heads (sequence b, kv head g) differ in their items:
 * off[phase][bg] counts the items of the kv heads before bg (prefix sums);
 * otherwise every kv head has per[phase] items. */
enum { PH_K, PH_V, PH_TILES, PH_N };
typedef struct fwd_job {
  const attn__sdpa *p;
  const attn__cpu_kernels *kn;
  const attn__half_kernels *hk; /* NULL: fp32 tiles */
  void (*widen)(float *dst, const void *src, attn_dtype dt, int64_t n); /* the kernel set's, in registers */
  attn__narrow_fn narrow;                                                /* and its write-out */
  int64_t pairs, per_round, kt_bytes, vp_bytes, D2;
  int qb, v_unit, terms; /* terms: the half tiles' (kernels.h), 1 without them */
  int64_t gather; /* floats of a thread's scratch for gather_rows; 0: K and V are read in place */
  int fused; /* OPEN tiles take hk's softmax_round and pv_blocks, the scale deferred to the softmax */
  int64_t per[PH_N];
  int64_t *off[PH_N]; /* [pairs + 1] each, or NULL */
  char *Kp, *Vp;
  /* With fused tiles and nothing but a band (causal, window) to hide keys: per kv head of a round,
   * vbad_stride bytes, one per packed pair row of values, 1 where a value is Inf or NaN (band_block) */
  uint8_t *Vbad;
  int64_t vbad_stride;
} fwd_job;

/* Items of phase ph before kv head bg. */
static int64_t items_before(const fwd_job *j, int ph, int64_t bg) {
  return j->off[ph] ? j->off[ph][bg] : bg * j->per[ph];
}

/* The kv head of item w of phase ph (counted over every kv head), and *local, its index among the head's items. */
static int64_t item_pair(const fwd_job *j, int ph, int64_t w, int64_t *local) {
  const int64_t bg = j->off[ph] ? attn__seq_at(j->off[ph], j->pairs, w) : w / j->per[ph];
  *local = w - items_before(j, ph, bg);
  return bg;
}

/* Whether the tile sees every key of block j0 that exists, and the block is cut only by the end of
 * the keys: no mask, key padding or ALiBi term, no row's band ends or begins inside it, and no key
 * row is stored past the keys (kv_len: pack_v_run zeroes the values past the stored rows only). */
static int tail_block(const attn__sdpa *p, const tile_state *ts, int64_t b, int64_t j0, int nr) {
  const int64_t nk = attn__keys(p, b);
  return !p->has_mask && !p->has_kpm && !p->alibi && j0 + nr > nk && attn__key_rows(p, b) == nk &&
         j0 >= attn__key_begin(p, b, ts->i0 + ts->rows - 1) && attn__key_end(p, b, ts->i0) >= nk;
}

/* Whether a tile whose band hides some of block j0's keys from some of its rows may take the fused
 * kernels all the same: the band is all that hides keys, and none of the block's packed values is Inf or
 * NaN, since pv_blocks multiplies every key's value, a hidden key's by its probability of 0. Rows that see
 * no key yet keep m = -inf and P = 0 in the softmax, as in the unfused step. */
static int band_block(const fwd_job *j, const uint8_t *vbad, int64_t j0, int nr) {
  if (!vbad) return 0;
  uint8_t any = 0;
  for (int k = 0; k < nr / 2; k++) any |= vbad[j0 / 2 + k];
  return !any;
}

/* S = Q.Kt for one key block with the block's mask applied; rows past `rows` are masked too.
 * raw (NULL: never): set when S holds the unscaled products of a tile that the fused kernels take: an
 * OPEN one, the sequence's last block when only the end of the keys cuts it (its missing keys' logits
 * -inf, and their packed values 0: pack_v_run), or a block that only a band cuts (band_block: the
 * diagonal block of a causal tile, a window's edges); the fused kernels then read the rows past `rows` as 0,
 * so that their running maxima are finite and the one-pass softmax holds for the live rows too (each
 * row's products and softmax are its own). */
/* vbad: the kv head's flags (fwd_job's Vbad), or NULL. */
static attn__tile_mask logits_tile(const fwd_job *j, fwd_scratch *s, const tile_state *ts, const char *Kp,
                                   const uint8_t *vbad, int64_t b, int64_t h, int64_t j0, int *raw) {
  const attn__sdpa *p = j->p;
  const int mr = j->kn->mr, nr = j->kn->nr;
  const attn__tile_mask tm = attn__mask_tile(p, s->Mb, nr, nr, b, h, ts->i0, ts->rows, j0);
  if (tm == ATTN__TILE_CLOSED) return tm;
  const int unscaled = raw && j->fused &&
                       (tm == ATTN__TILE_OPEN || (tm == ATTN__TILE_ADD && tail_block(p, ts, b, j0, nr)) ||
                        (tm == ATTN__TILE_MIXED && band_block(j, vbad, j0, nr)));
  if (raw) *raw = unscaled;
  /* keys past the tile's last visible one (Nk, or the band's end of its last row) need no dot products */
  const int64_t nk = ts->kend - j0 < nr ? ts->kend - j0 : nr;
  if (j->hk)
    j->hk->qk(s->S, ts->Qh, (const uint16_t *)Kp + j0 * 2 * j->D2 * j->terms, j->D2, nk,
              unscaled ? 1.0f : (float)p->scale);
  else j->kn->qk(s->S, ts->Q, (const float *)Kp + j0 * p->D, p->D, nk);
  attn__logit_tile(p, s->S, NULL, nr, ts->rows, nr, tm, s->Mb);
  for (int64_t e = (int64_t)ts->rows * nr; e < (int64_t)mr * nr; e++) s->S[e] = unscaled ? 0.0f : -INFINITY;
  return tm;
}

/* dst[0..n) = elements off, off + stride, ... of an f32 or bf16 buffer as bf16
 * (f32 rounded to nearest even), then zeros up to dst[pad): one loop per case, so each vectorises. */
static void load_bf16(uint16_t *restrict dst, const void *src, attn_dtype dt, int64_t off, int64_t stride, int64_t n,
                      int64_t pad) {
  if (dt == ATTN_BF16 && stride == 1) {
    memcpy(dst, (const uint16_t *)src + off, (size_t)n * 2);
  } else if (dt == ATTN_BF16) {
    const uint16_t *s = (const uint16_t *)src + off;
    for (int64_t e = 0; e < n; e++) dst[e] = s[e * stride];
  } else {
    const float *s = (const float *)src + off;
    for (int64_t e = 0; e < n; e++) dst[e] = attn__f32_to_bf16(s[e * stride]);
  }
  for (int64_t e = n; e < pad; e++) dst[e] = 0;
}

static inline uint16_t bf16_at(const void *src, attn_dtype dt, int64_t off) {
  return dt == ATTN_BF16 ? ((const uint16_t *)src)[off] : attn__f32_to_bf16(((const float *)src)[off]);
}

/* Element off of an f16 buffer (or an f32 one, rounded to f16 under ATTN_PRECISION_F16) as the two
 * terms of kernels.h's split: hi = bf16(x), lo = x - hi (exact). */
static inline void split_at(const void *src, attn_dtype dt, int64_t off, uint16_t *hi, uint16_t *lo) {
  if (dt == ATTN_F16) attn__split_f16(((const uint16_t *)src)[off], hi, lo);
  else attn__split_half_value(attn__round_to_f16(((const float *)src)[off]), hi, lo);
}

/* load_bf16 for f16 elements (or f32 ones, rounded to f16 under ATTN_PRECISION_F16) as the two terms of
 * kernels.h's split: hi terms at dst, lo terms at dst + pad, zeros past n in both. */
static void load_split(const attn__cpu_kernels *kn, uint16_t *restrict dst, const void *src, attn_dtype dt, int64_t off,
                       int64_t stride, int64_t n, int64_t pad) {
  if (kn->split_f16 && stride == 1)
    kn->split_f16(dst, dst + pad, (const char *)src + off * (int64_t)attn_dtype_size(dt), dt == ATTN_F16, n);
  else attn__split_row(dst, dst + pad, src, dt == ATTN_F16, off, stride, n);
  for (int64_t e = n; e < pad; e++) dst[e] = dst[pad + e] = 0;
}

/* Loads the tile's queries (scaled; as bf16 pairs, unscaled, for half tiles) and clears its running statistics. */
static void tile_begin(const fwd_job *j, tile_state *ts, int64_t b, int64_t h, int64_t i0, int rows) {
  const attn__sdpa *p = j->p;
  const int mr = j->kn->mr;
  const int64_t D = p->D;
  const attn_tensor *q = &p->q;
  const float scale = (float)p->scale;
  ts->i0 = i0;
  ts->rows = rows;
  ts->kend = attn__key_end(p, b, i0 + rows - 1); /* the last row's band ends last */
  ts->kbeg = attn__key_begin(p, b, i0);        /* the first row's starts first */
  for (int r = 0; r < mr && j->hk; r++) {
    const int64_t off = attn__qoff(p, q, b, h, i0 + r), n = r < rows ? D : 0;
    uint16_t *dst = ts->Qh + (int64_t)r * 2 * j->D2 * j->terms;
    if (j->terms == 2) load_split(j->kn, dst, q->data, q->dtype, off, q->strides[3], n, 2 * j->D2);
    else load_bf16(dst, q->data, q->dtype, off, q->strides[3], n, 2 * j->D2);
  }
  for (int r = 0; r < mr && !j->hk; r++) {
    float *dst = ts->Q + (int64_t)r * D;
    if (r < rows) {
      const int64_t off = attn__qoff(p, q, b, h, i0 + r);
      if (q->strides[3] == 1) /* the kernel set's vector conversion: f16's portable one was 2% of a call */
        j->widen(dst, (const char *)q->data + off * (int64_t)attn_dtype_size(q->dtype), q->dtype, D);
      else
        attn__widen_strided(dst, q->data, q->dtype, off, q->strides[3], D);
      for (int64_t d = 0; d < D; d++) dst[d] *= scale;
    } else {
      memset(dst, 0, (size_t)D * sizeof(float));
    }
  }
  /* A sink starts each row's softmax as a logit already seen: m = sink and
   * l = exp(sink - m) = 1. The kernels' online step takes a finite start, and
   * tile_end's lse = m + log(l) and the weights' exp(s - m) / l then count it. */
  const float sink = attn__sink(p, h);
  for (int r = 0; r < ATTN__STAT_LANES; r++) {
    ts->m[r] = p->sinks && r < rows ? sink : -INFINITY;
    ts->l[r] = p->sinks && r < rows ? 1.0f : 0.0f;
  }
  memset(ts->O, 0, (size_t)(mr * p->Dv) * sizeof(float));
}

/* Normalises the tile's output rows and writes them, with the log-sum-exp. */
static void tile_end(const fwd_job *j, const tile_state *ts, int64_t b, int64_t h) {
  const attn__sdpa *p = j->p;
  const int64_t Dv = p->Dv;
  const attn_tensor *o = &p->out;
  const int vector = o->strides[3] == 1; /* the kernel set's narrow takes it */
  for (int r = 0; r < ts->rows; r++) {
    const float l = ts->l[r];
    const float inv = l == 0 ? 0.0f : 1.0f / l; /* l = 0 only when every key is masked */
    /* out in f32, or in the inputs' half type: the f32 value, rounded */
    const int64_t at = attn__qoff(p, o, b, h, ts->i0 + r);
    if (vector) j->narrow((char *)o->data + at * (int64_t)attn_dtype_size(o->dtype), o->dtype, ts->O + r * Dv, Dv, inv);
    else attn__narrow_strided(o->data, o->dtype, at, o->strides[3], ts->O + r * Dv, Dv, inv);
    if (p->lse) {
      const attn_tensor *lt = p->lse;
      ((float *)lt->data)[attn__qoff(p, lt, b, h, ts->i0 + r)] =
          l == 0 ? -INFINITY : ts->m[r] + logf(l);
    }
  }
}

/* Second pass for requested weights: the normalised probabilities need the final max and sum. */
static void tile_weights(const fwd_job *j, fwd_scratch *s, const tile_state *ts, const char *Kp, int64_t b,
                         int64_t h) {
  const attn__sdpa *p = j->p;
  const int nr = j->kn->nr;
  const attn_tensor *w = p->weights;
  float *wd = w->data;
  for (int64_t j0 = 0; j0 < p->Nk; j0 += nr) {
    const int64_t nk = p->Nk - j0 < nr ? p->Nk - j0 : nr;
    const int open = j0 < ts->kend && j0 + nr > ts->kbeg && logits_tile(j, s, ts, Kp, NULL, b, h, j0, NULL) != ATTN__TILE_CLOSED;
    for (int r = 0; r < ts->rows; r++) {
      float *dst = wd + b * w->strides[0] + h * w->strides[1] + (ts->i0 + r) * w->strides[2];
      const float l = ts->l[r], mx = ts->m[r];
      for (int64_t jj = 0; jj < nk; jj++) {
        const float x = open ? s->S[r * nr + jj] : -INFINITY;
        dst[(j0 + jj) * w->strides[3]] = (l == 0 || x == -INFINITY) ? 0.0f : expf(x - mx) / l;
      }
    }
    if (p->dropout_p > 0) { /* the weights applied to v: after dropout */
      for (int r = 0; r < ts->rows; r++) {
        float *dst = wd + b * w->strides[0] + h * w->strides[1] + (ts->i0 + r) * w->strides[2];
        for (int64_t jj = 0; jj < nk; jj++)
          dst[(j0 + jj) * w->strides[3]] *=
              attn__dropout_kept(p, b, h, ts->i0 + r, j0 + jj) ? attn__dropout_scale(p) : 0.0f;
      }
    }
  }
}

/* Dropout on one tile of probabilities (after the softmax statistics took them whole). */
static void dropout_tile(const attn__sdpa *p, float *P, int nr, int64_t b, int64_t h, int64_t i0, int rows,
                         int64_t j0) {
  const float keep_scale = attn__dropout_scale(p);
  const int64_t nk = attn__key_rows(p, b);
  for (int r = 0; r < rows; r++)
    for (int jj = 0; jj < nr && j0 + jj < nk; jj++)
      P[r * nr + jj] *= attn__dropout_kept(p, b, h, i0 + r, j0 + jj) ? keep_scale : 0.0f;
}

/* The queued blocks' p.v for tiles [t0, t1), column group by column group: the group's values
 * stay in L1 from one tile to the next. */
static void flush_queued(const fwd_job *j, fwd_scratch *s, int t0, int t1) {
  if (!j->fused) return;
  const int64_t Dv = j->p->Dv, tile = (int64_t)j->kn->mr * j->kn->nr;
  for (int64_t c0 = 0; c0 < Dv; c0 += ATTN__PV_COLS)
    for (int t = t0; t < t1; t++) {
      const int n = s->nq[t];
      const uint16_t *P[PV_BLOCKS];
      const float *a[PV_BLOCKS];
      for (int k = 0; k < n; k++) {
        P[k] = s->Pq + (t * PV_BLOCKS + k) * tile * j->terms;
        a[k] = s->aq + (t * PV_BLOCKS + k) * ATTN__STAT_LANES;
      }
      if (n) j->hk->pv_blocks(s->t[t].O, Dv, c0, n, P, a, s->vq[t]);
    }
  for (int t = t0; t < t1; t++) s->nq[t] = 0;
}

// Query block: `count` tiles of MR rows from row i0 of head h, against the packed keys of its kv head.
static void run_block(const fwd_job *j, fwd_scratch *s, const char *Kp, const void *V, int64_t ldv,
                      const uint8_t *vbad, int64_t b, int64_t h, int64_t i0, int count) {
  const attn__sdpa *p = j->p;
  const attn__cpu_kernels *kn = j->kn;
  const int mr = kn->mr, nr = kn->nr;
  const int64_t nq = attn__queries(p, b);
  int64_t kmax = 0, kmin = attn__key_rows(p, b);
  if (j->hk && j->hk->begin) j->hk->begin();
  for (int t = 0; t < count; t++) {
    const int64_t r0 = i0 + (int64_t)t * mr;
    tile_begin(j, &s->t[t], b, h, r0, (int)(nq - r0 < mr ? nq - r0 : mr));
    if (s->t[t].kend > kmax) kmax = s->t[t].kend;
    if (s->t[t].kbeg < kmin) kmin = s->t[t].kbeg;
  }
  /* key blocks wholly before every row's band are never visited: a narrow band costs O(N x its width) */
  for (int64_t j0 = kmin / nr * nr; j0 < kmax; j0 += nr) {
    for (int t = 0; t < count; t++) {
      tile_state *ts = &s->t[t];
      if (j0 >= ts->kend || j0 + nr <= ts->kbeg) continue;
      int raw;
      const attn__tile_mask tm = logits_tile(j, s, ts, Kp, vbad, b, h, j0, &raw);
      if (tm == ATTN__TILE_CLOSED) continue;
      if (raw) { /* queued for pv_blocks, in key order */
        const int k = s->nq[t]++;
        j->hk->softmax_round(s->Pq + (t * PV_BLOCKS + k) * mr * nr * j->terms, s->S, (float)p->scale, ts->m, ts->l,
                             s->aq + (t * PV_BLOCKS + k) * ATTN__STAT_LANES);
        s->vq[t][k] = (const uint16_t *)V + j0 * p->Dv * j->terms;
        continue;
      }
      if (s->nq[t]) flush_queued(j, s, t, t + 1); /* this block's p.v comes after theirs */
      const int64_t nk = ts->kend - j0 < nr ? ts->kend - j0 : nr; /* P is 0 past the tile's last visible key */
      kn->softmax(s->S, ts->m, ts->l, ts->alpha);
      if (p->dropout_p > 0) dropout_tile(p, s->S, nr, b, h, ts->i0, ts->rows, j0);
      if (j->hk)
        j->hk->pv(ts->O, ts->alpha, s->S, (const uint16_t *)V + j0 * p->Dv * j->terms, p->Dv, nk, tm == ATTN__TILE_MIXED);
      else kn->pv(ts->O, ts->alpha, s->S, (const float *)V + j0 * ldv, ldv, p->Dv, nk, tm == ATTN__TILE_MIXED);
    }
    for (int t = 0; t < count; t++) /* a tile adds at most one block a pass: every queue has room for the next */
      if (s->nq[t] == PV_BLOCKS) {
        flush_queued(j, s, 0, count);
        break;
      }
  }
  flush_queued(j, s, 0, count);
  for (int t = 0; t < count; t++) {
    tile_end(j, &s->t[t], b, h);
    if (p->weights) tile_weights(j, s, &s->t[t], Kp, b, h);
  }
  if (j->hk && j->hk->end) j->hk->end();
}

void attn__pack_block_t(const attn__cpu_kernels *kn, float *dst, const attn_tensor *t, int64_t head, int64_t blk,
                        int64_t Nk, int64_t F) {
  const int nr = kn->nr;
  const int64_t base = head + blk * nr * t->strides[2];
  float *o = dst + blk * nr * F;
  const int n = Nk - blk * nr < nr ? (int)(Nk - blk * nr) : nr;
  if (kn->pack_t && t->dtype == ATTN_F32 && t->strides[3] == 1) {
    kn->pack_t(o, (const float *)t->data + base, t->strides[2], n, F);
    return;
  }
  /* writes run along the packed rows: the reads' nr rows stay in L1 across f */
  for (int64_t f = 0; f < F; f++) {
    attn__widen_strided(o + f * nr, t->data, t->dtype, base + f * t->strides[3], t->strides[2], n);
    for (int jj = n; jj < nr; jj++) o[f * nr + jj] = 0.0f;
  }
}

/* attn__pack_block_t for f16/bf16 keys with unit-stride rows: each key's row
 * widened by the kernel set's vector conversion (in chunks), then written to
 * its column of Kt; the strided gather of attn__pack_block_t widens one
 * element at a time in portable code. */
static void pack_block_widened(float *dst, const attn_tensor *t, int64_t head, int64_t blk, int nr, int64_t Nk,
                               int64_t F, void (*widen)(float *, const void *, attn_dtype, int64_t)) {
  enum { CHUNK = 256 };
  float row[CHUNK];
  float *o = dst + blk * nr * F;
  const int n = Nk - blk * nr < nr ? (int)(Nk - blk * nr) : nr;
  const size_t es = attn_dtype_size(t->dtype);
  for (int jj = 0; jj < nr; jj++) {
    const int64_t off = head + (blk * nr + jj) * t->strides[2];
    for (int64_t f0 = 0; f0 < F; f0 += CHUNK) {
      const int64_t m = F - f0 < CHUNK ? F - f0 : CHUNK;
      if (jj < n) widen(row, (const char *)t->data + (off + f0) * (int64_t)es, t->dtype, m);
      for (int64_t f = 0; f < m; f++) o[(f0 + f) * nr + jj] = jj < n ? row[f] : 0.0f;
    }
  }
}

/* Kh block blk (D2, NR) of the kv head whose key 0 is at element head, as bf16 pairs (kernels.h's half tiles),
 * zero past key Nk; with two terms (f16 keys) each row of NR hi pairs is followed by its NR lo pairs. */
void attn__pack_block_pairs(const attn__cpu_kernels *kn, uint16_t *dst, const attn_tensor *t, int64_t head,
                            int64_t blk, int64_t Nk, int64_t D, int64_t D2, int terms) {
  const int nr = kn->nr;
  uint32_t *o = (uint32_t *)(dst + blk * nr * 2 * D2 * terms);
  const int n = Nk - blk * nr < nr ? (int)(Nk - blk * nr) : nr;
  const int64_t sd = t->strides[3], row = (int64_t)nr * terms; /* pairs between rows of the block */
  const int64_t first = head + blk * nr * t->strides[2]; /* the block's key 0 */
  if (kn->pack_t && terms == 1 && t->dtype == ATTN_BF16 && sd == 1 && D % 2 == 0 && first % 2 == 0 &&
      t->strides[2] % 2 == 0 && ((uintptr_t)t->data & 3) == 0) {
    /* a key's pairs are 32-bit words of its row: the same turn as fp32's (bits moved, never computed on) */
    kn->pack_t((float *)o, (const float *)((const uint16_t *)t->data + first), t->strides[2] / 2, n, D / 2);
    if (D2 > D / 2) memset(o + (D / 2) * row, 0, (size_t)((D2 - D / 2) * row) * sizeof(uint32_t));
    return;
  }
  for (int jj = 0; jj < nr; jj++) {
    const int64_t off = head + (blk * nr + jj) * t->strides[2];
    if (jj >= n) {
      for (int64_t p = 0; p < D2; p++)
        for (int term = 0; term < terms; term++) o[p * row + term * nr + jj] = 0;
    } else if (terms == 2 && kn->split_f16 && sd == 1) { /* f16, or f32 rounded to f16 */
      enum { PAIRS = 128 }; /* the row's split, a chunk of pairs at a time */
      uint32_t h[PAIRS], l[PAIRS];
      for (int64_t p0 = 0; p0 < D2; p0 += PAIRS) {
        const int64_t np = D2 - p0 < PAIRS ? D2 - p0 : PAIRS, left = D - 2 * p0 > 0 ? D - 2 * p0 : 0;
        const int64_t live = left < 2 * np ? left : 2 * np; /* values of D in this chunk; zeros after them */
        if (live > 0)
          kn->split_f16((uint16_t *)h, (uint16_t *)l, (const char *)t->data + (off + 2 * p0) * (int64_t)attn_dtype_size(t->dtype),
                        t->dtype == ATTN_F16, live);
        memset((uint16_t *)h + live, 0, (size_t)(2 * np - live) * sizeof(uint16_t));
        memset((uint16_t *)l + live, 0, (size_t)(2 * np - live) * sizeof(uint16_t));
        for (int64_t p = 0; p < np; p++) o[(p0 + p) * row + jj] = h[p], o[(p0 + p) * row + nr + jj] = l[p];
      }
    } else if (terms == 2) {
      for (int64_t p = 0; p < D2; p++) {
        uint16_t h[2] = {0, 0}, l[2] = {0, 0};
        if (2 * p < D) split_at(t->data, t->dtype, off + 2 * p * sd, &h[0], &l[0]);
        if (2 * p + 1 < D) split_at(t->data, t->dtype, off + (2 * p + 1) * sd, &h[1], &l[1]);
        o[p * row + jj] = h[0] | (uint32_t)h[1] << 16;
        o[p * row + nr + jj] = l[0] | (uint32_t)l[1] << 16;
      }
    } else if (t->dtype == ATTN_BF16 && sd == 1) { /* a key's pairs are 32-bit words of its row */
      const uint16_t *r = (const uint16_t *)t->data + off;
      for (int64_t p = 0; p < D / 2; p++) memcpy(&o[p * row + jj], r + 2 * p, 4);
      if (D & 1) o[(D / 2) * row + jj] = r[D - 1];
      for (int64_t p = (D + 1) / 2; p < D2; p++) o[p * row + jj] = 0; /* the zero pairs of a padded D2 */
    } else {
      for (int64_t p = 0; p < D2; p++) {
        const uint32_t lo = 2 * p < D ? bf16_at(t->data, t->dtype, off + 2 * p * sd) : 0;
        const uint32_t hi = 2 * p + 1 < D ? bf16_at(t->data, t->dtype, off + (2 * p + 1) * sd) : 0;
        o[p * row + jj] = lo | hi << 16;
      }
    }
  }
}

/* Packed keys (and values) of this many bytes per round at most: enough kv
 * heads per round to keep every thread busy at small N, few enough to stay
 * far below the inputs' size at large N. */
#define PACK_BUDGET ((int64_t)8 << 20)

static int64_t round_items(const fwd_job *j, int ph, int64_t round) {
  const int64_t first = round * j->per_round, end = j->pairs - first < j->per_round ? j->pairs : first + j->per_round;
  return items_before(j, ph, end) - items_before(j, ph, first);
}

static int64_t pack_k_items(const void *arg, int64_t round) { return round_items(arg, PH_K, round); }

/* Whether t is a KV cache's storage, which the packs do not read as a view: a block format (q8_0,
 * q4_0: strides in bytes) or a paged cache's pool (p->block_table). Such keys and values are gathered
 * a key block at a time, so no copy of the cache is made. */
static int kv_gathered(const attn__sdpa *p, const attn_tensor *t) { return p->block_table || attn__is_quant(t->dtype); }

/* Rows [j0, j0 + n) of kv head (b, g) of such a t, as a [1, 1, n, F] view of buf: a block format
 * dequantized to f32, a float one copied as stored (a cache's rows have unit stride). */
static attn_tensor gather_rows(const attn__sdpa *p, const attn_tensor *t, int64_t b, int64_t g, int64_t j0, int64_t n,
                               int64_t F, void *buf) {
  const int quant = attn__is_quant(t->dtype);
  attn_tensor rows;
  memset(&rows, 0, sizeof rows);
  rows.data = buf, rows.dtype = quant ? ATTN_F32 : t->dtype, rows.rank = 4;
  rows.shape[0] = rows.shape[1] = 1, rows.shape[2] = n, rows.shape[3] = F;
  rows.strides[0] = rows.strides[1] = n * F, rows.strides[2] = F, rows.strides[3] = 1;
  const size_t es = quant ? 1 : attn_dtype_size(t->dtype);
  for (int64_t jj = 0; jj < n; jj++) {
    const char *src = (const char *)t->data + (size_t)attn__kv_row(p, t, b, g, j0 + jj) * es;
    if (quant) attn__dequantize_row(t->dtype, (float *)buf + jj * F, (const uint8_t *)src, F);
    else memcpy((char *)buf + (size_t)(jj * F) * es, src, (size_t)F * es);
  }
  return rows;
}

/* Key block blk of the kv head of t whose key 0 is at element head (nk keys) into its place in dst,
 * one kv head's Kp. */
static void pack_k_block(const fwd_job *j, void *dst, const attn_tensor *t, int64_t head, int64_t blk, int64_t nk) {
  const attn__sdpa *p = j->p;
  if (j->hk)
    attn__pack_block_pairs(j->kn, dst, t, head, blk, nk, p->D, j->D2, j->terms);
  else if (t->dtype != ATTN_F32 && t->strides[3] == 1)
    pack_block_widened(dst, t, head, blk, j->kn->nr, nk, p->D, j->widen);
  else
    attn__pack_block_t(j->kn, dst, t, head, blk, nk, p->D);
}

// Kp[slot] (nblocks, D, NR) floats, or (nblocks, D2, NR) bf16 pairs: item = a key block of a kv head.
static void pack_k_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  const fwd_job *j = arg;
  const attn__sdpa *p = j->p;
  const int64_t w0 = items_before(j, PH_K, round * j->per_round);
  for (int64_t w = first; w < last; w++) {
    int64_t blk;
    const int64_t bg = item_pair(j, PH_K, w0 + w, &blk), b = bg / p->Hk;
    const int64_t head = attn__koff(p, &p->k, b, bg % p->Hk, 0), nk = attn__key_rows(p, b);
    char *dst = j->Kp + (bg - round * j->per_round) * j->kt_bytes;
    if (!kv_gathered(p, &p->k)) {
      pack_k_block(j, dst, &p->k, head, blk, nk);
      continue;
    }
    const int64_t nr = j->kn->nr, j0 = blk * nr, n = nk - j0 < nr ? nk - j0 : nr;
    const int64_t blk_bytes = j->hk ? nr * 2 * j->D2 * j->terms * 2 : nr * p->D * (int64_t)sizeof(float);
    const attn_tensor rows = gather_rows(p, &p->k, b, bg % p->Hk, j0, n, p->D, ((fwd_scratch *)scratch)->gather);
    pack_k_block(j, dst + blk * blk_bytes, &rows, 0, 0, n);
  }
}

static int64_t pack_v_items(const void *arg, int64_t round) { return round_items(arg, PH_V, round); }

/* Key block blk of the kv head of v whose key 0 is at element head (nk keys) as Vh pairs (kernels.h)
 * at dst, zero past key row nk; bad (or NULL) gets a byte per pair row: 1 where a value is Inf or NaN
 * (fwd_job's Vbad). */
static void pack_v_block(const fwd_job *j, uint16_t *dst, uint8_t *bad, const attn_tensor *v, int64_t head, int64_t blk,
                         int64_t nk) {
  const attn__sdpa *p = j->p;
  const int64_t hp = j->kn->nr / 2, first = blk * hp; /* pair rows of a key block; its first */
  const int64_t n2 = (nk + 1) / 2 - first < hp ? (nk + 1) / 2 - first : hp;
  const int64_t sd = v->strides[3], s2 = v->strides[2];
  for (int64_t row = 0; row < hp; row++) {
    const int64_t j2 = first + row, off = head + 2 * j2 * s2;
    const int second = 2 * j2 + 1 < nk;
    uint16_t inf_nan = 0; /* an exponent of all ones */
    for (int64_t c0 = 0; c0 < p->Dv; c0 += ATTN__PV_COLS) {
      const int64_t cw = attn__vh_cols(p->Dv, c0), o0 = off + c0 * sd;
      uint16_t *o = dst + 2 * attn__vh_at(p->Dv, j->terms, j->kn->nr, row, c0);
      if (row >= n2) { /* past the last pair row: zeros, which pv_blocks reads (with P = 0) for a tail block */
        memset(o, 0, (size_t)(j->terms * cw) * 2 * sizeof(uint16_t));
      } else if (j->terms == 2 && j->kn->split_f16 && j->kn->pack_pairs && sd == 1) { /* f16, or f32 rounded */
        uint16_t h[2][ATTN__PV_COLS], l[2][ATTN__PV_COLS];
        const size_t es = attn_dtype_size(v->dtype);
        const char *r0 = (const char *)v->data + o0 * (int64_t)es;
        j->kn->split_f16(h[0], l[0], r0, v->dtype == ATTN_F16, cw);
        if (second) j->kn->split_f16(h[1], l[1], r0 + s2 * (int64_t)es, v->dtype == ATTN_F16, cw);
        else memset(h[1], 0, sizeof h[1]), memset(l[1], 0, sizeof l[1]);
        inf_nan |= (uint16_t)j->kn->pack_pairs(o, h[0], h[1], cw); /* Inf or NaN shows in the hi term */
        j->kn->pack_pairs(o + 2 * cw, l[0], l[1], cw);
        continue;
      } else if (j->terms == 2) { /* the group's cw hi pairs, then its cw lo pairs */
        uint16_t *lo = o + 2 * cw;
        for (int64_t c = 0; c < cw; c++) {
          split_at(v->data, v->dtype, o0 + c * sd, &o[2 * c], &lo[2 * c]);
          if (second) split_at(v->data, v->dtype, o0 + s2 + c * sd, &o[2 * c + 1], &lo[2 * c + 1]);
          else o[2 * c + 1] = lo[2 * c + 1] = 0;
        }
      } else if (v->dtype == ATTN_BF16 && sd == 1 && second) {
        const uint16_t *r0 = (const uint16_t *)v->data + o0, *r1 = r0 + s2;
        if (j->kn->pack_pairs) {
          inf_nan |= (uint16_t)j->kn->pack_pairs(o, r0, r1, cw);
          continue;
        }
        for (int64_t c = 0; c < cw; c++) o[2 * c] = r0[c], o[2 * c + 1] = r1[c];
      } else {
        for (int64_t c = 0; c < cw; c++) {
          o[2 * c] = bf16_at(v->data, v->dtype, o0 + c * sd);
          o[2 * c + 1] = second ? bf16_at(v->data, v->dtype, o0 + s2 + c * sd) : 0;
        }
      }
      for (int64_t e = 0; bad && e < 2 * cw; e++) inf_nan |= (uint16_t)((o[e] & 0x7f80) == 0x7f80);
    }
    if (bad) bad[row] = (uint8_t)inf_nan;
  }
}

// Vp[slot] (Nk, Dv) f32 rows, item = a key of a kv head; half tiles: key blocks of pairs (kernels.h's Vh), item = a key block.
static void pack_v_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  const fwd_job *j = arg;
  const attn__sdpa *p = j->p;
  const attn_tensor *v = &p->v;
  const int64_t w0 = items_before(j, PH_V, round * j->per_round);
  for (int64_t w = first; w < last && j->hk; w++) {
    int64_t blk;
    const int64_t bg = item_pair(j, PH_V, w0 + w, &blk), b = bg / p->Hk, slot = bg - round * j->per_round;
    uint16_t *dst = (uint16_t *)(j->Vp + slot * j->vp_bytes) + blk * j->kn->nr * p->Dv * j->terms;
    uint8_t *bad = j->Vbad ? j->Vbad + slot * j->vbad_stride + blk * (j->kn->nr / 2) : NULL;
    const int64_t g = bg % p->Hk, nk = attn__key_rows(p, b);
    if (!kv_gathered(p, v)) {
      pack_v_block(j, dst, bad, v, attn__koff(p, v, b, g, 0), blk, nk);
      continue;
    }
    const int64_t nr = j->kn->nr, j0 = blk * nr, n = nk - j0 < nr ? nk - j0 : nr;
    const attn_tensor rows = gather_rows(p, v, b, g, j0, n, p->Dv, ((fwd_scratch *)scratch)->gather);
    pack_v_block(j, dst, bad, &rows, 0, 0, n);
  }
  for (int64_t w = first; w < last && !j->hk; w++) {
    int64_t jk;
    const int64_t bg = item_pair(j, PH_V, w0 + w, &jk), b = bg / p->Hk;
    const int64_t off = attn__koff(p, v, b, bg % p->Hk, jk);
    float *dst = (float *)(j->Vp + (bg - round * j->per_round) * j->vp_bytes) + jk * p->Dv;
    if (kv_gathered(p, v)) {
      const int quant = attn__is_quant(v->dtype);
      const char *src = (const char *)v->data + (size_t)attn__kv_row(p, v, b, bg % p->Hk, jk) * (quant ? 1 : attn_dtype_size(v->dtype));
      if (quant) attn__dequantize_row(v->dtype, dst, (const uint8_t *)src, p->Dv);
      else j->widen(dst, src, v->dtype, p->Dv);
    } else if (v->strides[3] == 1)
      j->widen(dst, (const char *)v->data + off * (int64_t)attn_dtype_size(v->dtype), v->dtype, p->Dv);
    else
      attn__widen_strided(dst, v->data, v->dtype, off, v->strides[3], p->Dv);
  }
}

static int64_t tiles_items(const void *arg, int64_t round) { return round_items(arg, PH_TILES, round); }

/* Query blocks of batch b: blocks of qb tiles of MR rows. */
static int64_t query_blocks(const fwd_job *j, int64_t b) {
  const int64_t tiles = (attn__queries(j->p, b) + j->kn->mr - 1) / j->kn->mr;
  return (tiles + j->qb - 1) / j->qb;
}

/* From the last query block down: under a causal mask the last blocks carry the most keys. */
static void tiles_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  const fwd_job *j = arg;
  const attn__sdpa *p = j->p;
  fwd_scratch *s = scratch;
  const int64_t w0 = items_before(j, PH_TILES, round * j->per_round);
  for (int64_t it = first; it < last; it++) {
    int64_t rest;
    const int64_t bg = item_pair(j, PH_TILES, w0 + it, &rest), slot = bg - round * j->per_round;
    const int64_t b = bg / p->Hk, g = bg % p->Hk, nqblk = query_blocks(j, b);
    const int64_t ntiles = (attn__queries(p, b) + j->kn->mr - 1) / j->kn->mr;
    const int64_t blk = nqblk - 1 - rest % nqblk, h = g * p->group + rest / nqblk;
    const void *V = j->v_unit ? (const void *)((const float *)p->v.data + attn__koff(p, &p->v, b, g, 0))
                        : j->Vp ? (const void *)(j->Vp + slot * j->vp_bytes)
                                : NULL; /* no keys in any sequence: nothing packed, nothing read */
    const int64_t ldv = j->v_unit ? p->v.strides[2] : p->Dv, left = ntiles - blk * j->qb;
    const uint8_t *vbad = j->Vbad ? j->Vbad + slot * j->vbad_stride : NULL;
    run_block(j, s, j->Kp + slot * j->kt_bytes, V, ldv, vbad, b, h, blk * j->qb * j->kn->mr,
              (int)(left < j->qb ? left : j->qb));
  }
}

static int64_t query_row(const fwd_job *j) {
  return j->hk ? j->D2 * j->terms : j->p->D;
}

static void fwd_scratch_init(const void *arg, void *scratch) {
  const fwd_job *j = arg;
  scratch_carve(scratch, j->kn->mr, j->kn->nr, query_row(j), j->p->Dv, j->fused ? j->terms : 0, j->gather);
}

/* Items of phase ph for kv head bg. */
static int64_t pair_items(const fwd_job *j, int ph, int64_t bg) {
  const attn__sdpa *p = j->p;
  const int64_t b = bg / p->Hk, nk = attn__key_rows(p, b);
  switch (ph) {
    case PH_K: return (nk + j->kn->nr - 1) / j->kn->nr;
    case PH_V: return j->hk ? (nk + j->kn->nr - 1) / j->kn->nr : j->v_unit ? 0 : nk;
    default: return p->group * query_blocks(j, b);
  }
}

attn_status attn__sdpa_run_blocked(attn_ctx *ctx, const attn__sdpa *p) {
  const attn__half_kernels *hk = attn__dispatch_half(&ctx->dispatch, p);
  const attn__cpu_kernels *kn = hk ? hk->base : ctx->dispatch.attention;
  const int mr = kn->mr, nr = kn->nr;
  if (p->B == 0 || p->Hq == 0 || p->Nq == 0) return ATTN_OK;
  fwd_job j;
  memset(&j, 0, sizeof j);
  j.p = p, j.kn = kn, j.hk = hk, j.widen = ctx->dispatch.decode->widen, j.narrow = ctx->dispatch.decode->narrow, j.D2 = (p->D + 1) / 2;
  if (hk && hk->d2_align > 1) j.D2 = (j.D2 + hk->d2_align - 1) / hk->d2_align * hk->d2_align; /* zero pairs */
  j.terms = hk ? hk->terms : 1;
  /* dropout and the cap change P or the logits between the steps the fused kernels join */
  j.fused = hk && hk->softmax_round && hk->pv_blocks && p->dropout_p == 0 && !(p->softcap > 0);
  /* the longest sequence sizes the packed buffers; its work, the scheduler's choices */
  const int64_t nseq = attn__seqs(p);
  int64_t Nk = p->Nk, Nq = p->Nq;
  double work = (double)p->B * (double)p->Nq * (double)p->Nk;
  if (p->cu_q) {
    Nk = Nq = 0, work = 0;
    for (int64_t b = 0; b < nseq; b++) {
      const int64_t nq = attn__queries(p, b), nk = attn__key_rows(p, b);
      Nq = nq > Nq ? nq : Nq, Nk = nk > Nk ? nk : Nk;
      work += (double)nq * (double)nk;
    }
  }
  const int64_t nblocks = (Nk + nr - 1) / nr, ntiles = (Nq + mr - 1) / mr;
  j.v_unit = !hk && p->v.dtype == ATTN_F32 && (p->v.strides[3] == 1 || p->Dv <= 1) && !kv_gathered(p, &p->v);
  if (kv_gathered(p, &p->k) || kv_gathered(p, &p->v)) j.gather = (int64_t)nr * (p->D > p->Dv ? p->D : p->Dv);
  /* one kv head's packed keys and values: a broadcast k or v may claim more than memory holds */
  if (attn__bytes(nblocks, nr, p->D + 1, sizeof(float)) + attn__bytes(Nk + 1, p->Dv, 1, sizeof(float)) >
      ATTN__SIZE_LIMIT)
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa: Nk = %lld keys of %lld + %lld floats are too many to pack",
                      (long long)Nk, (long long)p->D, (long long)p->Dv);
  if (hk) {
    j.kt_bytes = nblocks * nr * 2 * j.D2 * 2 * j.terms;
    j.vp_bytes = nblocks * nr * p->Dv * 2 * j.terms; /* whole key blocks: a group's rows are NR / 2 apart */
  } else {
    j.kt_bytes = nblocks * nr * p->D * (int64_t)sizeof(float);
    j.vp_bytes = j.v_unit ? 0 : Nk * p->Dv * (int64_t)sizeof(float);
  }
  j.pairs = nseq * p->Hk;
  j.per_round = PACK_BUDGET / (j.kt_bytes + j.vp_bytes + 1);
  j.per_round = j.per_round < 1 ? 1 : j.per_round > j.pairs ? j.pairs : j.per_round;
  const int threads = attn__threads_for(ctx, work * (double)p->Hq * (double)(p->D + p->Dv));
  j.qb = (double)Nk * (double)(p->D + p->Dv) * (hk ? 2 : 4) > (double)L2_SHARE ? QB_FAR : QB_NEAR;
  /* As many tiles per query block as still leave every thread a few blocks
   * (a block's arithmetic does not depend on how many tiles share it). */
  while (j.qb > 1 && j.per_round * p->group * ((ntiles + j.qb - 1) / j.qb) < 4 * threads) j.qb /= 2;
  const size_t kt_bytes = attn__bytes(j.per_round, j.kt_bytes, 1, 1);
  const size_t vp_bytes = attn__bytes(j.per_round, j.vp_bytes, 1, 1);
  const size_t off_bytes = p->cu_q ? attn__bytes(j.pairs + 1, PH_N, 1, sizeof(int64_t)) : 0;
  const int band_only = j.fused && !p->has_mask && !p->has_kpm && !p->alibi;
  j.vbad_stride = nblocks * nr / 2;
  const size_t vbad_bytes = band_only ? attn__bytes(j.per_round, j.vbad_stride, 1, 1) : 0;
  char *ws = attn__workspace(ctx, attn__carve_size(kt_bytes) + attn__carve_size(vp_bytes) + attn__carve_size(off_bytes) +
                                      attn__carve_size(vbad_bytes));
  if (!ws) return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa: cannot allocate packed keys for Nk = %lld", (long long)Nk);
  j.Kp = attn__carve(&ws, kt_bytes);
  j.Vp = j.vp_bytes ? attn__carve(&ws, vp_bytes) : NULL;
  j.Vbad = vbad_bytes ? attn__carve(&ws, vbad_bytes) : NULL;
  if (p->cu_q) {
    int64_t *off = attn__carve(&ws, off_bytes);
    for (int ph = 0; ph < PH_N; ph++) {
      int64_t *o = off + ph * (j.pairs + 1);
      o[0] = 0;
      for (int64_t bg = 0; bg < j.pairs; bg++) o[bg + 1] = o[bg] + pair_items(&j, ph, bg);
      j.off[ph] = o;
    }
  } else {
    for (int ph = 0; ph < PH_N; ph++) j.per[ph] = pair_items(&j, ph, 0);
  }
  static const attn__phase phases[] = {{"pack_k", pack_k_items, pack_k_run, 0},
                                       {"pack_v", pack_v_items, pack_v_run, 0},
                                       {"query_blocks", tiles_items, tiles_run, 1}};
  const attn__job job = {&j, (j.pairs + j.per_round - 1) / j.per_round, phases, 3,
                         scratch_bytes(mr, nr, query_row(&j), p->Dv, j.fused ? j.terms : 0, j.gather), fwd_scratch_init};
  const long long args[4] = {(long long)j.per_round, (long long)j.qb, (long long)mr, (long long)nseq};
  const char *fmt =
      p->cu_q ? (hk ? (j.terms == 2 ? "attn_sdpa forward, f16 tiles (bf16 hi + lo), packed batch (%lld kv heads per round, "
                                      "query blocks of %lld x %lld rows, %lld sequences)"
                                    : "attn_sdpa forward, bf16 tiles, packed batch (%lld kv heads per round, query "
                                      "blocks of %lld x %lld rows, %lld sequences)")
                    : "attn_sdpa forward, packed batch (%lld kv heads per round, query blocks of %lld x %lld rows, "
                      "%lld sequences)")
      : hk ? (j.terms == 2 ? "attn_sdpa forward, f16 tiles (bf16 hi + lo) (%lld kv heads per round, query blocks of "
                             "%lld x %lld rows)"
                           : "attn_sdpa forward, bf16 tiles (%lld kv heads per round, query blocks of %lld x %lld rows)")
           : "attn_sdpa forward (%lld kv heads per round, query blocks of %lld x %lld rows)";
  return attn__schedule(ctx, fmt, args, threads, &job);
}
