/* Decoding: a few query rows per kv head against a long cache of keys.
 *
 * Here the cost is reading K and V, so nothing is packed: each K and V row is
 * read once, in place, by every query row of its kv head (the GQA group times
 * Nq rows together), and halves are widened block by block in L1. The keys of
 * each (batch, kv head) are cut into chunks of ATTN__DEC_CHUNK, a fixed size,
 * so that a head can be spread over every thread (split-KV); each chunk leaves
 * an unnormalised partial (O, m, l), and the partials are merged with their
 * log-sum-exp in chunk order. As the cut does not depend on the thread count,
 * neither do the results. */
#include "../internal.h"
#include "kernels.h"

#include <stdlib.h>

/* Keys per chunk. With blocks of ATTN__DEC_NB = 128 keys, 2048 measured best
 * (of chunks 128 to 4096 and blocks 32 to 512; L = 32768, H 32/8, D 128, Zen 5):
 * long runs of K rows, then of V rows, keep the hardware prefetchers streaming,
 * and 8 kv heads of 8192 keys still make 32 pieces for the threads. */
#ifndef ATTN__DEC_CHUNK
#define ATTN__DEC_CHUNK 2048
#endif

int attn__decode_fits(const attn__sdpa *p) {
  return p->Nq * p->group <= ATTN__DEC_MAX_ROWS && !p->weights && p->dropout_p == 0;
}

typedef struct dec_scratch {
  float *Q, *S, *Kc, *Vc, *O, *m, *l;
  void *base;
} dec_scratch;

static int dec_alloc(dec_scratch *s, int64_t R, int64_t D, int64_t Dv) {
  memset(s, 0, sizeof *s);
  const size_t q = attn__carve_size((size_t)(R * D) * sizeof(float));
  const size_t sz = attn__carve_size((size_t)(R * ATTN__DEC_NB) * sizeof(float));
  const size_t kc = attn__carve_size((size_t)(ATTN__DEC_NB * D) * sizeof(float));
  const size_t vc = attn__carve_size((size_t)(ATTN__DEC_NB * (Dv > 0 ? Dv : 1)) * sizeof(float));
  const size_t o = attn__carve_size((size_t)(R * (Dv > 0 ? Dv : 1)) * sizeof(float));
  const size_t st = attn__carve_size((size_t)R * sizeof(float));
  char *b = attn__aligned_alloc(q + sz + kc + vc + o + 2 * st);
  s->base = b;
  if (!b) return 0;
  s->Q = attn__carve(&b, q), s->S = attn__carve(&b, sz), s->Kc = attn__carve(&b, kc), s->Vc = attn__carve(&b, vc);
  s->O = attn__carve(&b, o), s->m = attn__carve(&b, st), s->l = attn__carve(&b, st);
  return 1;
}

/* Row r of a kv head's rows: query head g * group + r / Nq, query row r % Nq. */
static int64_t row_head(const attn__sdpa *p, int64_t g, int64_t r) { return g * p->group + r / p->Nq; }

/* Rows i of one (b, g) and keys [j0, j0 + n): masks, bounds, softcap and ALiBi
 * on S, by internal.h's definition. Returns nonzero when some key is hidden
 * from some row (its logit is then -inf, whatever q.k gave). */
static int fix_block(const attn__sdpa *p, float *S, int64_t R, int64_t b, int64_t g, int64_t j0, int n) {
  const int mods = p->has_mask || p->has_kpm || p->softcap > 0 || p->alibi;
  int hidden = 0;
  for (int64_t r = 0; r < R; r++) {
    const int64_t h = row_head(p, g, r), i = r % p->Nq;
    const int64_t lo = attn__window_begin(p, i), hi = attn__causal_end(p->causal, i, p->Nq, p->Nk);
    if (!mods && j0 >= lo && j0 + n <= hi) continue;
    float *s = S + r * ATTN__DEC_NB;
    for (int jj = 0; jj < n; jj++) {
      const int64_t j = j0 + jj;
      const double term = j < lo || j >= hi ? -INFINITY : attn__mask_term(p, b, h, i, j);
      if (term == -INFINITY) {
        s[jj] = -INFINITY;
        hidden = 1;
      } else {
        s[jj] = (float)(attn__logit_mods(p, h, i, j, s[jj]) + term);
      }
    }
  }
  return hidden;
}

/* Block of n keys from key j0 of kv head (b, g) of t, as rows the kernels
 * read: in place when they take its dtype and it has unit stride, else widened
 * into buf as f32. *ld and *dt get the row distance and the element type. */
static const void *key_rows(const attn__decode_kernels *dk, const attn_tensor *t, int64_t b, int64_t g, int64_t j0,
                            int n, int64_t F, float *buf, int64_t *ld, attn_dtype *dt) {
  const int64_t off = b * t->strides[0] + g * t->strides[1] + j0 * t->strides[2];
  const size_t es = attn_dtype_size(t->dtype);
  if (((dk->dtypes >> t->dtype) & 1) && (t->strides[3] == 1 || F == 1)) {
    *ld = t->strides[2];
    *dt = t->dtype;
    return (const char *)t->data + (size_t)off * es;
  }
  *dt = ATTN_F32;
  for (int jj = 0; jj < n; jj++) {
    const int64_t ro = off + jj * t->strides[2];
    if (t->strides[3] == 1) dk->widen(buf + jj * F, (const char *)t->data + (size_t)ro * es, t->dtype, F);
    else
      for (int64_t f = 0; f < F; f++) buf[jj * F + f] = attn__load_f32(t->data, t->dtype, ro + f * t->strides[3]);
  }
  *ld = F;
  return buf;
}

/* Asks for rows [j0, j0 + n) of kv head (b, g) of t ahead of use. A block of K
 * then a block of V breaks the stride the hardware prefetchers follow: without
 * asking ahead, one core reads at half speed (the kernels ask for the rows
 * they read in place themselves, key by key; this is for rows widened here). */
static void prefetch_rows(const attn_tensor *t, int64_t b, int64_t g, int64_t j0, int n, int64_t F) {
  const size_t es = attn_dtype_size(t->dtype), row = (size_t)F * es;
  const char *base = (const char *)t->data + (size_t)(b * t->strides[0] + g * t->strides[1]) * es;
  for (int jj = 0; jj < n; jj++) {
    const char *r = base + (size_t)((j0 + jj) * t->strides[2]) * es;
    for (size_t off = 0; off < row; off += 64) __builtin_prefetch(r + off, 0, 3);
  }
}

// One chunk [k0, k1) of kv head (b, g) for its R rows; the partial goes to part: (R, Dv) then m (R), l (R).
static void run_chunk(const attn__decode_kernels *dk, const attn__sdpa *p, dec_scratch *s, int64_t b, int64_t g,
                      int64_t k0, int64_t k1, float *part) {
  const int64_t R = p->Nq * p->group, D = p->D, Dv = p->Dv;
  const attn_tensor *q = &p->q;
  const float scale = (float)p->scale;
  /* the keys some row of this head can see */
  int64_t lo = k1, hi = k0;
  for (int64_t i = 0; i < p->Nq; i++) {
    const int64_t a = attn__window_begin(p, i), e = attn__causal_end(p->causal, i, p->Nq, p->Nk);
    if (a < lo) lo = a;
    if (e > hi) hi = e;
  }
  lo = lo < k0 ? k0 : lo;
  hi = hi > k1 ? k1 : hi;
  for (int64_t r = 0; r < R; r++) {
    const int64_t off = b * q->strides[0] + row_head(p, g, r) * q->strides[1] + (r % p->Nq) * q->strides[2];
    for (int64_t d = 0; d < D; d++) s->Q[r * D + d] = attn__load_f32(q->data, q->dtype, off + d * q->strides[3]) * scale;
    s->m[r] = -INFINITY;
    s->l[r] = 0;
  }
  memset(s->O, 0, (size_t)(R * Dv) * sizeof(float));
  for (int64_t j0 = lo; j0 < hi; j0 += ATTN__DEC_NB) {
    const int n = (int)(hi - j0 < ATTN__DEC_NB ? hi - j0 : ATTN__DEC_NB);
    int64_t ldk, ldv;
    attn_dtype kt, vt;
    const void *K = key_rows(dk, &p->k, b, g, j0, n, D, s->Kc, &ldk, &kt);
    const void *V = key_rows(dk, &p->v, b, g, j0, n, Dv, s->Vc, &ldv, &vt);
    const int64_t next = j0 + ATTN__DEC_NB;
    if (next < hi && (K == s->Kc || V == s->Vc)) { /* the kernels prefetch rows they read in place, not these */
      const int nn = (int)(hi - next < ATTN__DEC_NB ? hi - next : ATTN__DEC_NB);
      prefetch_rows(&p->k, b, g, next, nn, D);
      prefetch_rows(&p->v, b, g, next, nn, Dv);
    }
    dk->qk(s->S, s->Q, (int)R, K, ldk, n, D, kt);
    const int sparse = fix_block(p, s->S, R, b, g, j0, n);
    dk->pv(s->O, s->m, s->l, s->S, (int)R, V, ldv, n, Dv, vt, sparse);
  }
  memcpy(part, s->O, (size_t)(R * Dv) * sizeof(float));
  memcpy(part + R * Dv, s->m, (size_t)R * sizeof(float));
  memcpy(part + R * (Dv + 1), s->l, (size_t)R * sizeof(float));
}

// Merges the chunks' partials of row r of (b, g) in chunk order; writes out and lse.
static void merge_row(const attn__sdpa *p, const float *parts, int64_t nchunks, int64_t stride, int64_t b, int64_t g,
                      int64_t r) {
  const int64_t R = p->Nq * p->group, Dv = p->Dv, h = row_head(p, g, r), i = r % p->Nq;
  float M = p->sinks ? attn__head_value(p->sinks, h) : -INFINITY; /* the sink: a key with no value */
  for (int64_t c = 0; c < nchunks; c++) {
    const float mc = parts[c * stride + R * Dv + r];
    if (isnan(mc) || mc > M) M = mc;
  }
  const attn_tensor *o = &p->out;
  float *dst = (float *)o->data + b * o->strides[0] + h * o->strides[1] + i * o->strides[2];
  float L = p->sinks ? expf(attn__head_value(p->sinks, h) - M) : 0.0f;
  for (int64_t cc = 0; cc < Dv; cc++) dst[cc * o->strides[3]] = 0.0f;
  if (M != -INFINITY) {
    for (int64_t c = 0; c < nchunks; c++) {
      const float *pc = parts + c * stride;
      const float mc = pc[R * Dv + r];
      if (mc == -INFINITY) continue; /* a chunk this row sees nothing of */
      const float w = expf(mc - M);
      L += pc[R * (Dv + 1) + r] * w;
      for (int64_t cc = 0; cc < Dv; cc++) dst[cc * o->strides[3]] += pc[r * Dv + cc] * w;
    }
  }
  const float inv = L == 0 ? 0.0f : 1.0f / L; /* L = 0 only when every key is masked and there is no sink */
  for (int64_t cc = 0; cc < Dv; cc++) dst[cc * o->strides[3]] *= inv;
  if (p->lse) {
    const attn_tensor *lt = p->lse;
    ((float *)lt->data)[b * lt->strides[0] + h * lt->strides[1] + i * lt->strides[2]] =
        L == 0 ? -INFINITY : M + logf(L);
  }
}

attn_status attn__sdpa_run_decode(attn_ctx *ctx, const attn__sdpa *p, attn_kernel isa) {
  const attn__decode_kernels *dk = ctx->dispatch.decode;
  const int64_t R = p->Nq * p->group, pairs = p->B * p->Hk;
  const int64_t nchunks = p->Nk > 0 ? (p->Nk + ATTN__DEC_CHUNK - 1) / ATTN__DEC_CHUNK : 1;
  const int64_t stride = R * (p->Dv + 2); /* floats of one chunk's partial */
  const size_t part_bytes = attn__bytes(pairs, nchunks, stride, sizeof(float)); /* saturates: see attn__bytes */
  float *parts = attn__workspace(ctx, attn__carve_size(part_bytes));
  if (!parts) return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa: cannot allocate %zu bytes of decode partials", part_bytes);
  const double work = (double)pairs * (double)R * (double)p->Nk * (double)(p->D + p->Dv);
  const int threads = work < 1e6 ? 1 : attn__threads(ctx);
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    dec_scratch s;
    if (!dec_alloc(&s, R, p->D, p->Dv)) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp barrier
    if (!failed) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < pairs * nchunks; it++) {
        const int64_t bg = it / nchunks, c = it % nchunks;
        const int64_t k0 = c * ATTN__DEC_CHUNK, k1 = k0 + ATTN__DEC_CHUNK < p->Nk ? k0 + ATTN__DEC_CHUNK : p->Nk;
        run_chunk(dk, p, &s, bg / p->Hk, bg % p->Hk, k0, k1, parts + it * stride);
      }
#pragma omp for schedule(static)
      for (int64_t w = 0; w < pairs * R; w++)
        merge_row(p, parts + (w / R) * nchunks * stride, nchunks, stride, (w / R) / p->Hk, (w / R) % p->Hk, w % R);
    }
    attn__aligned_free(s.base);
  }
  if (failed) return attn__fail(ctx, ATTN_E_NOMEM, "attn_sdpa: cannot allocate decode scratch");
  return ATTN_OK;
}
