/* The blocked ("flash") attention framework for fp32 on the CPU.
 *
 * For each (batch, kv head): pack K transposed into key blocks of NR (and V
 * into rows if it is not unit-stride), then every tile of MR query rows of
 * every query head in the group streams over the key blocks with an online
 * softmax, so no Nq x Nk matrix exists unless weights are asked for. Tiles
 * are independent, so results do not depend on the thread count. */
#include "../internal.h"
#include "kernels.h"
#include "softcap.h"

#include <stdlib.h>

/* Tiles of query rows that share each key block while it is in L1: fewer
 * passes over K and V through L2. A tile's arithmetic does not depend on how
 * many tiles share a block, so results do not either. */
#define QB_MAX 4

typedef struct tile_state {
  float *Q, *O, *m, *l, *alpha;
  int64_t i0, kend, kbeg; /* keys [kbeg, kend) hold every key a row of the tile may see */
  int rows;
} tile_state;

typedef struct scratch {
  tile_state t[QB_MAX];
  float *S, *Mb;
  float *base; /* one allocation behind everything above */
} scratch;

/* Carves a thread's tiles out of one allocation, each piece 64-byte aligned. */
static int scratch_alloc(scratch *s, int64_t mr, int64_t nr, int64_t D, int64_t Dv) {
  memset(s, 0, sizeof *s);
  const int64_t up = 16; /* floats per 64 bytes */
  const int64_t q = (mr * D + up - 1) / up * up, o = (mr * (Dv > 0 ? Dv : 1) + up - 1) / up * up;
  const int64_t st = 3 * ATTN__STAT_LANES, tile = (mr * nr + up - 1) / up * up;
  float *b = attn__aligned_alloc((size_t)(2 * tile + QB_MAX * (q + o + st)) * sizeof(float));
  if (!b) return 0;
  s->base = b;
  s->S = b;
  s->Mb = b + tile;
  b += 2 * tile;
  for (int t = 0; t < QB_MAX; t++, b += q + o + st) {
    tile_state *ts = &s->t[t];
    ts->Q = b;
    ts->O = b + q;
    ts->m = b + q + o;
    ts->l = ts->m + ATTN__STAT_LANES;
    ts->alpha = ts->m + 2 * ATTN__STAT_LANES;
  }
  return 1;
}

static void scratch_free(scratch *s) { attn__aligned_free(s->base); }

/* Rows i0..i0+rows of head h against keys j0..j0+nr: the causal bound, the
 * window, keys past Nk, key padding and the mask, decided before any
 * arithmetic so that a fully masked tile costs no FMAs. Row i sees keys
 * [window_begin(i), causal_end(i)), both bounds rising with i: the first row
 * has the earliest end, the last row the latest begin. ALiBi's bias is added
 * here too, so a tile with ALiBi is never OPEN. Keys past Nk are -inf in Mb
 * but do not make a tile MIXED: no kernel reads their values. */
attn__tile_mask attn__mask_tile(const attn__sdpa *p, float *Mb, int nr, int64_t b, int64_t h, int64_t i0, int rows,
                                int64_t j0) {
  const int64_t kend_first = attn__causal_end(p->causal, i0, p->Nq, p->Nk);
  const int64_t kbeg_last = attn__window_begin(p, i0 + rows - 1);
  const int keys = p->Nk - j0 < nr ? (int)(p->Nk - j0) : nr; /* keys of the block that exist */
  /* key padding alone is the same for every row: read once per tile, and a
   * block it leaves whole is as if there were none */
  float kp_row[ATTN__MAX_NR];
  const int kp_only = p->has_kpm && !p->has_mask;
  int kp_none = 0;
  if (kp_only) {
    attn__mask_row(p, b, h, i0, j0, keys, kp_row);
    kp_none = keys == nr;
    for (int jj = 0; jj < keys; jj++) kp_none &= kp_row[jj] == 0.0f;
  }
  const int plain = !p->has_mask && (!p->has_kpm || kp_none) && !p->alibi;
  if (plain && j0 + nr <= kend_first && j0 >= kbeg_last) return ATTN__TILE_OPEN;
  const float slope = p->alibi ? attn__head_value(p->alibi, h) : 0.0f;
  int64_t visible = 0;
  int hidden = 0;
  for (int r = 0; r < rows; r++) {
    const int64_t i = i0 + r, kend = attn__causal_end(p->causal, i, p->Nq, p->Nk), kbeg = attn__window_begin(p, i);
    float *mb = Mb + (int64_t)r * nr;
    /* keys [lo, hi) of the tile pass the causal bound and the window */
    const int hi = kend - j0 <= 0 ? 0 : kend - j0 >= nr ? nr : (int)(kend - j0);
    const int lo = kbeg - j0 <= 0 ? 0 : kbeg - j0 >= hi ? hi : (int)(kbeg - j0);
    hidden |= lo > 0 || hi < keys;
    if (!p->has_mask && !p->has_kpm) {
      for (int jj = 0; jj < nr; jj++) mb[jj] = jj >= lo && jj < hi ? 0.0f : -INFINITY;
      visible += hi - lo;
    } else {
      for (int jj = 0; jj < lo; jj++) mb[jj] = -INFINITY;
      if (kp_only) memcpy(mb + lo, kp_row + lo, (size_t)(hi - lo) * sizeof(float));
      else attn__mask_row(p, b, h, i, j0 + lo, hi - lo, mb + lo);
      for (int jj = hi; jj < nr; jj++) mb[jj] = -INFINITY;
      int shown = 0;
      for (int jj = lo; jj < hi; jj++) shown += mb[jj] != -INFINITY;
      visible += shown;
      hidden |= shown < hi - lo;
    }
    if (p->alibi) { /* slope * (j - i'), exact in float for positions below 2^24 */
      const int64_t qp = attn__qpos(p, i);
      for (int jj = lo; jj < hi; jj++) mb[jj] += slope * (float)(j0 + jj - qp);
    }
  }
  return !visible ? ATTN__TILE_CLOSED : hidden ? ATTN__TILE_MIXED : ATTN__TILE_ADD;
}


/* S = Q.Kt for one key block with the block's mask applied; rows past `rows` are masked too. */
static attn__tile_mask logits_tile(const attn__cpu_kernels *kn, const attn__sdpa *p, scratch *s, const tile_state *ts,
                             const float *Kt, int64_t b, int64_t h, int64_t j0) {
  const int mr = kn->mr, nr = kn->nr;
  const attn__tile_mask tm = attn__mask_tile(p, s->Mb, nr, b, h, ts->i0, ts->rows, j0);
  if (tm == ATTN__TILE_CLOSED) return tm;
  /* keys past the tile's last visible one (Nk, or the causal bound of its last row) need no dot products */
  kn->qk(s->S, ts->Q, Kt + j0 * p->D, p->D, ts->kend - j0 < nr ? ts->kend - j0 : nr);
  /* the cap before the bias and the masks are added */
  if (p->softcap > 0) attn__softcap_tile(s->S, NULL, (int64_t)ts->rows * nr, (float)p->softcap);
  if (tm != ATTN__TILE_OPEN) attn__apply_tile_mask(s->S, s->Mb, (int64_t)ts->rows * nr);
  for (int64_t e = (int64_t)ts->rows * nr; e < (int64_t)mr * nr; e++) s->S[e] = -INFINITY;
  return tm;
}

/* Loads the tile's queries (scaled) and clears its running statistics. */
static void tile_begin(const attn__cpu_kernels *kn, const attn__sdpa *p, tile_state *ts, int64_t b, int64_t h,
                       int64_t i0, int rows) {
  const int mr = kn->mr;
  const int64_t D = p->D;
  const attn_tensor *q = &p->q;
  const float scale = (float)p->scale;
  ts->i0 = i0;
  ts->rows = rows;
  ts->kend = attn__causal_end(p->causal, i0 + rows - 1, p->Nq, p->Nk); /* the last row sees the most */
  ts->kbeg = attn__window_begin(p, i0);                                  /* the first row the earliest */
  for (int r = 0; r < mr; r++) {
    float *dst = ts->Q + (int64_t)r * D;
    if (r < rows) {
      const int64_t off = b * q->strides[0] + h * q->strides[1] + (i0 + r) * q->strides[2];
      for (int64_t d = 0; d < D; d++) dst[d] = attn__load_f32(q->data, q->dtype, off + d * q->strides[3]) * scale;
    } else {
      memset(dst, 0, (size_t)D * sizeof(float));
    }
  }
  /* A sink starts each row's softmax as a logit already seen: m = sink and
   * l = exp(sink - m) = 1. The kernels' online step takes a finite start, and
   * tile_end's lse = m + log(l) and the weights' exp(s - m) / l then count it. */
  const float sink = p->sinks ? attn__head_value(p->sinks, h) : -INFINITY;
  for (int r = 0; r < ATTN__STAT_LANES; r++) {
    ts->m[r] = p->sinks && r < rows ? sink : -INFINITY;
    ts->l[r] = p->sinks && r < rows ? 1.0f : 0.0f;
  }
  memset(ts->O, 0, (size_t)(mr * p->Dv) * sizeof(float));
}

/* Normalises the tile's output rows and writes them, with the log-sum-exp. */
static void tile_end(const attn__sdpa *p, const tile_state *ts, int64_t b, int64_t h) {
  const int64_t Dv = p->Dv;
  const attn_tensor *o = &p->out;
  float *od = o->data;
  for (int r = 0; r < ts->rows; r++) {
    const float l = ts->l[r];
    const float inv = l == 0 ? 0.0f : 1.0f / l; /* l = 0 only when every key is masked */
    float *dst = od + b * o->strides[0] + h * o->strides[1] + (ts->i0 + r) * o->strides[2];
    for (int64_t c = 0; c < Dv; c++) dst[c * o->strides[3]] = ts->O[r * Dv + c] * inv;
    if (p->lse) {
      const attn_tensor *lt = p->lse;
      ((float *)lt->data)[b * lt->strides[0] + h * lt->strides[1] + (ts->i0 + r) * lt->strides[2]] =
          l == 0 ? -INFINITY : ts->m[r] + logf(l);
    }
  }
}

/* Second pass for requested weights: the normalised probabilities need the final max and sum. */
static void tile_weights(const attn__cpu_kernels *kn, const attn__sdpa *p, scratch *s, const tile_state *ts,
                         const float *Kt, int64_t b, int64_t h) {
  const int nr = kn->nr;
  const attn_tensor *w = p->weights;
  float *wd = w->data;
  for (int64_t j0 = 0; j0 < p->Nk; j0 += nr) {
    const int64_t nk = p->Nk - j0 < nr ? p->Nk - j0 : nr;
    const int open = j0 < ts->kend && j0 + nr > ts->kbeg && logits_tile(kn, p, s, ts, Kt, b, h, j0) != ATTN__TILE_CLOSED;
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
              attn_dropout_keep(p->dropout_seed, p->dropout_p, b, h, ts->i0 + r, j0 + jj) ? (float)(1.0 / (1.0 - p->dropout_p)) : 0.0f;
      }
    }
  }
}

/* Dropout on one tile of probabilities (after the softmax statistics took them whole). */
static void dropout_tile(const attn__sdpa *p, float *P, int nr, int64_t b, int64_t h, int64_t i0, int rows,
                         int64_t j0) {
  const float keep_scale = (float)(1.0 / (1.0 - p->dropout_p));
  for (int r = 0; r < rows; r++)
    for (int jj = 0; jj < nr && j0 + jj < p->Nk; jj++)
      P[r * nr + jj] *= attn_dropout_keep(p->dropout_seed, p->dropout_p, b, h, i0 + r, j0 + jj) ? keep_scale : 0.0f;
}

// Query block: `count` tiles of MR rows from row i0 of head h, against the packed keys of its kv head.
static void run_block(const attn__cpu_kernels *kn, const attn__sdpa *p, scratch *s, const float *Kt, const float *V,
                      int64_t ldv, int64_t b, int64_t h, int64_t i0, int count) {
  const int mr = kn->mr, nr = kn->nr;
  int64_t kmax = 0, kmin = p->Nk;
  for (int t = 0; t < count; t++) {
    const int64_t r0 = i0 + (int64_t)t * mr;
    tile_begin(kn, p, &s->t[t], b, h, r0, (int)(p->Nq - r0 < mr ? p->Nq - r0 : mr));
    if (s->t[t].kend > kmax) kmax = s->t[t].kend;
    if (s->t[t].kbeg < kmin) kmin = s->t[t].kbeg;
  }
  /* a window: key blocks wholly before every row's window are never visited, so the cost is O(N W) */
  for (int64_t j0 = kmin / nr * nr; j0 < kmax; j0 += nr) {
    for (int t = 0; t < count; t++) {
      tile_state *ts = &s->t[t];
      if (j0 >= ts->kend || j0 + nr <= ts->kbeg) continue;
      const attn__tile_mask tm = logits_tile(kn, p, s, ts, Kt, b, h, j0);
      if (tm == ATTN__TILE_CLOSED) continue;
      const int64_t nk = ts->kend - j0 < nr ? ts->kend - j0 : nr; /* P is 0 past the tile's last visible key */
      kn->softmax(s->S, ts->m, ts->l, ts->alpha);
      if (p->dropout_p > 0) dropout_tile(p, s->S, nr, b, h, ts->i0, ts->rows, j0);
      kn->pv(ts->O, ts->alpha, s->S, V + j0 * ldv, ldv, p->Dv, nk, tm == ATTN__TILE_MIXED);
    }
  }
  for (int t = 0; t < count; t++) {
    tile_end(p, &s->t[t], b, h);
    if (p->weights) tile_weights(kn, p, s, &s->t[t], Kt, b, h);
  }
}

void attn__pack_block_t(float *dst, const attn_tensor *t, int64_t b, int64_t g, int64_t blk, int nr, int64_t Nk,
                        int64_t F) {
  const int64_t base = b * t->strides[0] + g * t->strides[1] + blk * nr * t->strides[2];
  float *o = dst + blk * nr * F;
  const int n = Nk - blk * nr < nr ? (int)(Nk - blk * nr) : nr;
  /* writes run along the packed rows: the reads' nr rows stay in L1 across f */
  for (int64_t f = 0; f < F; f++) {
    if (t->dtype == ATTN_F32) {
      const float *src = (const float *)t->data + base + f * t->strides[3];
      for (int jj = 0; jj < n; jj++) o[f * nr + jj] = src[jj * t->strides[2]];
    } else {
      for (int jj = 0; jj < n; jj++)
        o[f * nr + jj] = attn__load_f32(t->data, t->dtype, base + jj * t->strides[2] + f * t->strides[3]);
    }
    for (int jj = n; jj < nr; jj++) o[f * nr + jj] = 0.0f;
  }
}

/* Packed keys (and values) of this many bytes per round at most: enough kv
 * heads per round to keep every thread busy at small N, few enough to stay
 * far below the inputs' size at large N. */
#define PACK_BUDGET ((int64_t)8 << 20)

attn_status attn__sdpa_run_cpu(attn_ctx *ctx, const attn__sdpa *p, attn_kernel isa) {
  const attn__cpu_kernels *kn = ctx->dispatch.attention;
  const int mr = kn->mr, nr = kn->nr;
  if (p->B == 0 || p->Hq == 0 || p->Nq == 0) return ATTN_OK;
  if (ctx->dispatch.decode_enabled && attn__decode_fits(p)) return attn__sdpa_run_decode(ctx, p, isa);
  const int64_t nblocks = (p->Nk + nr - 1) / nr, ntiles = (p->Nq + mr - 1) / mr;
  const int v_unit = p->v.dtype == ATTN_F32 && (p->v.strides[3] == 1 || p->Dv <= 1); /* else packed as f32 */
  /* one kv head's packed keys and values: a broadcast k or v may claim more than memory holds */
  if (attn__bytes(nblocks, nr, p->D, sizeof(float)) + attn__bytes(p->Nk, p->Dv, 1, sizeof(float)) > ATTN__SIZE_LIMIT)
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa: Nk = %lld keys of %lld + %lld floats are too many to pack",
                      (long long)p->Nk, (long long)p->D, (long long)p->Dv);
  const int64_t kt_size = nblocks * nr * p->D, vp_size = v_unit ? 0 : p->Nk * p->Dv;
  const int64_t pairs = p->B * p->Hk;
  int64_t per_round = PACK_BUDGET / (int64_t)sizeof(float) / (kt_size + vp_size + 1);
  per_round = per_round < 1 ? 1 : per_round > pairs ? pairs : per_round;
  /* A problem of a few microseconds is not worth waking a second thread. */
  const double work = (double)p->B * (double)p->Hq * (double)p->Nq * (double)p->Nk * (double)(p->D + p->Dv);
  const int threads = work < 1e6 ? 1 : attn__threads(ctx);
  /* As many tiles per query block as still leave every thread a few blocks. */
  int qb = QB_MAX;
  while (qb > 1 && per_round * p->group * ((ntiles + qb - 1) / qb) < 4 * threads) qb /= 2;
  const int64_t nqblk = (ntiles + qb - 1) / qb, per_pair = p->group * nqblk;
  const size_t kt_bytes = attn__bytes(per_round, kt_size, 1, sizeof(float));
  const size_t vp_bytes = attn__bytes(per_round, vp_size, 1, sizeof(float));
  char *ws = attn__workspace(ctx, attn__carve_size(kt_bytes) + attn__carve_size(vp_bytes));
  if (!ws) return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa: cannot allocate packed keys for Nk = %lld", (long long)p->Nk);
  float *Kt = attn__carve(&ws, kt_bytes);
  float *Vp = v_unit ? NULL : attn__carve(&ws, vp_bytes);
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    scratch s;
    const int ok = scratch_alloc(&s, mr, nr, p->D, p->Dv);
    if (!ok) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp barrier
    for (int64_t first = 0; first < pairs && !failed; first += per_round) {
      const int64_t n = pairs - first < per_round ? pairs - first : per_round;
#pragma omp for schedule(static)
      for (int64_t w = 0; w < n * nblocks; w++) {
        const int64_t bg = first + w / nblocks;
        attn__pack_block_t(Kt + (w / nblocks) * kt_size, &p->k, bg / p->Hk, bg % p->Hk, w % nblocks, nr, p->Nk, p->D);
      }
      if (!v_unit) {
#pragma omp for schedule(static)
        for (int64_t w = 0; w < n * p->Nk; w++) {
          const int64_t bg = first + w / p->Nk, j = w % p->Nk;
          const int64_t off = (bg / p->Hk) * p->v.strides[0] + (bg % p->Hk) * p->v.strides[1] + j * p->v.strides[2];
          float *dst = Vp + (w / p->Nk) * vp_size + j * p->Dv;
          for (int64_t c = 0; c < p->Dv; c++) dst[c] = attn__load_f32(p->v.data, p->v.dtype, off + c * p->v.strides[3]);
        }
      }
      /* From the last block down: under a causal mask the last blocks carry
       * the most keys. Handed out on demand, so a thread that the OS (or a
       * busy neighbour) holds back does not stall the others at the barrier. */
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < n * per_pair; it++) {
        const int64_t slot = it / per_pair, rest = it % per_pair, bg = first + slot;
        const int64_t b = bg / p->Hk, g = bg % p->Hk;
        const int64_t blk = nqblk - 1 - rest % nqblk, h = g * p->group + rest / nqblk;
        const float *V = v_unit ? (const float *)p->v.data + b * p->v.strides[0] + g * p->v.strides[1]
                                : Vp + slot * vp_size;
        const int64_t ldv = v_unit ? p->v.strides[2] : p->Dv, left = ntiles - blk * qb;
        run_block(kn, p, &s, Kt + slot * kt_size, V, ldv, b, h, blk * qb * mr, (int)(left < qb ? left : qb));
      }
    }
    scratch_free(&s);
  }
  if (failed) return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa: cannot allocate per-thread tiles");
  return ATTN_OK;
}
