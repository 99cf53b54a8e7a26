/* libFuzzer harness: attention against the float64 oracle, on problems the
 * input's bytes pick. The bytes choose a kernel this CPU has, 1 to 3 threads,
 * the decode kernel on or off, the precision policy and the dtype of q, k and
 * v, the sizes (empty ones, odd head dims, GQA, Nq != Nk, several tiles),
 * batch-first views, the causal alignment, a window, chunks, a mask (its mode, dtype
 * and broadcast shape), key padding, softcap, ALiBi, sinks, dropout, the
 * scale, shard offsets, a packed batch, the optional outputs and the backward
 * pass; the values come from a generator seeded by the bytes. Then:
 *   - attn_sdpa and attn_sdpa_ref agree on the status (and a failure has a
 *     message); the same for the backward and its oracle;
 *   - the call under test sees NaN or Inf in k and v at every key hidden from
 *     all of its rows (causal bound, window, chunk, key padding, mask), the oracle
 *     clean inputs; outputs hold NaN before the call;
 *   - out, lse, weights, dq, dk, dv, the mask's and the sinks' gradients are
 *     within the path's bound of the oracle's (relative L2 with a floor for
 *     sums that cancel; fp32: 5e-5 forward, 1e-4 backward; on the bf16 or f16
 *     tiles test_half's 1e-2 or 2e-3 forward, and 3e-2 backward where out,
 *     dout, P or dS are rounded to a half), -inf where the oracle's is (the
 *     oracle's backward takes the out and lse under test);
 *   - another thread count gives the same bits;
 *   - a packed batch: each sequence's out, lse, dq, dk and dv bitwise those of
 *     the sequence run alone (decode off).
 * Inputs that would take long (more than a few million multiply-adds) shrink. */
#include "attn.h"
#include "fuzz_common.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { MAX_SEQS = 5 };

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  fuzz_init("fuzz_sdpa");
  return 0;
}

typedef struct fcase {
  attn_kernel kernel;
  int threads, threads2, decode;
  attn_precision precision;
  attn_dtype dt; /* q, k and v */
  int64_t B, Hq, Hk, Nq, Nk, D, Dv;
  int q_batch_first, kv_batch_first, out_batch_first;
  attn_causal causal;
  int64_t window, chunk;
  int mask_kind; /* 0 none, else 1 + attn_mask_mode */
  attn_dtype mask_dt;
  int mask_rank;
  int mask_full[4]; /* per dimension of the mask: that of [B, Hq, Nq, Nk] (1), or 1 (0: broadcast) */
  int kpm;
  attn_dtype kpm_dt;
  int64_t kp_len[2];
  double softcap, dropout, scale, amp;
  int alibi, sinks;
  uint64_t seed;
  int64_t q_off, k_off, h_off;
  int64_t nseq, cu_q[MAX_SEQS + 1], cu_k[MAX_SEQS + 1];
  int want_lse, want_weights, backward, want_mask_grad, want_sinks_grad;
  attn_dtype out_dt, grad_dt; /* out, and dq, dk, dv: f32 or a half */
} fcase;

static void split(fuzz_reader *r, int64_t total, int64_t nseq, int64_t *cu) {
  cu[0] = 0;
  for (int64_t s = 1; s < nseq; s++) cu[s] = cu[s - 1] + fuzz_pick(r, total - cu[s - 1] + 1);
  cu[nseq] = total;
}

static void read_case(fuzz_reader *r, fcase *c) {
  memset(c, 0, sizeof *c);
  c->kernel = fuzz_kernel[fuzz_pick(r, fuzz_kernel_count)];
  c->threads = 1 + (int)fuzz_pick(r, 3);
  c->threads2 = 1 + c->threads % 3;
  c->decode = (int)fuzz_pick(r, 2);
  static const attn_precision precs[] = {ATTN_PRECISION_DEFAULT, ATTN_PRECISION_FP32, ATTN_PRECISION_BF16,
                                         ATTN_PRECISION_F16};
  c->precision = precs[fuzz_pick(r, 4)];
  static const attn_dtype dts[] = {ATTN_F32, ATTN_F32, ATTN_BF16, ATTN_F16};
  c->dt = dts[fuzz_pick(r, 4)];
  const int big = fuzz_pick(r, 6) == 0;
  c->B = 1 + fuzz_pick(r, 2);
  c->Hk = 1 + fuzz_pick(r, big ? 2 : 3);
  c->Hq = c->Hk * (1 + fuzz_pick(r, 4));
  c->Nq = fuzz_pick(r, big ? 160 : 40);
  c->Nk = fuzz_pick(r, big ? 300 : 80);
  c->D = fuzz_pick(r, 2) ? 16 * (1 + fuzz_pick(r, 8)) : 1 + fuzz_pick(r, 100);
  c->Dv = fuzz_pick(r, 2) ? c->D : fuzz_pick(r, 2) ? 16 * (1 + fuzz_pick(r, 8)) : 1 + fuzz_pick(r, 100);
  c->q_batch_first = (int)fuzz_pick(r, 2);
  c->kv_batch_first = (int)fuzz_pick(r, 2);
  c->out_batch_first = (int)fuzz_pick(r, 2);
  c->causal = (attn_causal)fuzz_pick(r, 3);
  c->window = fuzz_pick(r, 3) == 0 ? 1 + fuzz_pick(r, c->Nk + 3) : 0;
  c->mask_kind = (int)fuzz_pick(r, 5);
  if (c->mask_kind) {
    const attn_mask_mode mode = (attn_mask_mode)(c->mask_kind - 1);
    static const attn_dtype bools[] = {ATTN_BOOL, ATTN_U8}, floats[] = {ATTN_F32, ATTN_F32, ATTN_F16, ATTN_BF16,
                                                                         ATTN_F64};
    c->mask_dt = mode == ATTN_MASK_KEEP || mode == ATTN_MASK_MASKED ? bools[fuzz_pick(r, 2)] : floats[fuzz_pick(r, 5)];
    c->mask_rank = 2 + (int)fuzz_pick(r, 3);
    for (int i = 0; i < c->mask_rank; i++) c->mask_full[i] = fuzz_pick(r, 3) != 0;
  }
  c->kpm = fuzz_pick(r, 3) == 0;
  c->kpm_dt = fuzz_pick(r, 2) ? ATTN_BOOL : ATTN_U8;
  c->kp_len[0] = fuzz_pick(r, c->Nk + 1);
  c->kp_len[1] = fuzz_pick(r, c->Nk + 1);
  static const double caps[] = {0.5, 2, 5, 30};
  c->softcap = fuzz_pick(r, 3) == 0 ? caps[fuzz_pick(r, 4)] : 0;
  c->alibi = fuzz_pick(r, 3) == 0;
  c->sinks = fuzz_pick(r, 3) == 0;
  static const double ps[] = {0.1, 0.5, 0.9};
  c->dropout = fuzz_pick(r, 4) == 0 ? ps[fuzz_pick(r, 3)] : 0;
  c->seed = (uint64_t)fuzz_pick(r, 256) << 32 | (uint64_t)fuzz_pick(r, 256);
  c->scale = fuzz_pick(r, 3) == 0 ? 0.05 + 0.01 * (double)fuzz_pick(r, 60) : NAN;
  static const double amps[] = {0.3, 1, 3};
  c->amp = amps[fuzz_pick(r, 3)];
  if (fuzz_pick(r, 4) == 0) c->q_off = fuzz_pick(r, 50), c->k_off = fuzz_pick(r, 50);
  if (fuzz_pick(r, 4) == 0) c->h_off = fuzz_pick(r, 5);
  c->want_lse = (int)fuzz_pick(r, 2);
  c->want_weights = (int)fuzz_pick(r, 2);
  c->backward = (int)fuzz_pick(r, 2);
  c->want_mask_grad = (int)fuzz_pick(r, 2);
  c->want_sinks_grad = (int)fuzz_pick(r, 2);
  static const attn_dtype outs[] = {ATTN_F32, ATTN_F32, ATTN_F16, ATTN_BF16};
  c->out_dt = outs[fuzz_pick(r, 4)];
  c->grad_dt = outs[fuzz_pick(r, 4)];
  if (fuzz_pick(r, 5) == 0) { /* a packed batch; now and then with what it refuses */
    c->B = 1;
    c->nseq = 1 + fuzz_pick(r, MAX_SEQS);
    split(r, c->Nq, c->nseq, c->cu_q);
    if (fuzz_pick(r, 2)) split(r, c->Nk, c->nseq, c->cu_k);
    else c->Nk = c->Nq, memcpy(c->cu_k, c->cu_q, sizeof c->cu_q);
    if (fuzz_pick(r, 8)) {
      c->mask_kind = c->kpm = c->want_weights = 0;
      c->q_off = c->k_off = c->h_off = 0;
    }
  }
  c->chunk = fuzz_pick(r, 3) == 0 ? 1 + fuzz_pick(r, c->Nk + 3) : 0; /* drawn last: older inputs keep their cases */
  /* shrink what would be slow: the oracle's multiply-adds, and the weights */
  while (c->B * c->Hq * c->Nq * c->Nk * (c->D + c->Dv) > 4000000 && c->Nk > 1) c->Nk /= 2;
  if (c->nseq && c->cu_k[c->nseq] != c->Nk) split(r, c->Nk, c->nseq, c->cu_k);
  if (c->kp_len[0] > c->Nk) c->kp_len[0] = c->Nk;
  if (c->kp_len[1] > c->Nk) c->kp_len[1] = c->Nk;
  if (c->window > c->Nk + 3) c->window = c->Nk + 3;
}

/* ---- tensors ------------------------------------------------------------------- */
typedef struct pool {
  void *p[512];
  int n;
} pool;

static void *grab(pool *pl, size_t bytes) {
  if (pl->n == 512) abort();
  void *p = calloc(1, bytes ? bytes : 1);
  if (!p) abort();
  return pl->p[pl->n++] = p;
}

/* A rank-4 tensor [s0, s1, s2, s3], contiguous or held as [s0, s2, s1, s3] (batch-first). */
static attn_tensor make4(pool *pl, const int64_t s[4], attn_dtype dt, int batch_first) {
  void *data = grab(pl, (size_t)(s[0] * s[1] * s[2] * s[3]) * attn_dtype_size(dt));
  if (!batch_first) return attn_tensor_view(data, dt, 4, s);
  const int64_t bf[4] = {s[0], s[2], s[1], s[3]};
  static const int perm[4] = {0, 2, 1, 3};
  attn_tensor base = attn_tensor_view(data, dt, 4, bf), t;
  if (attn_tensor_permute(&t, &base, perm) != ATTN_OK) abort();
  return t;
}

static attn_tensor make_f64(pool *pl, int rank, const int64_t *s) {
  int64_t n = 1;
  for (int i = 0; i < rank; i++) n *= s[i];
  return attn_tensor_view(grab(pl, (size_t)n * 8), ATTN_F64, rank, s);
}

static int64_t numel(const attn_tensor *t) { return attn_tensor_numel(t); }

static void copy(attn_ctx *ctx, attn_tensor *dst, const attn_tensor *src) {
  fuzz_need(attn_tensor_copy(ctx, dst, src) == ATTN_OK, ctx, "attn_tensor_copy failed");
}

/* Every byte of t's buffer (a whole buffer seen through any view) set to NaN. */
static void poison(attn_tensor *t) {
  const int64_t n = numel(t);
  if (t->dtype == ATTN_F32)
    for (int64_t i = 0; i < n; i++) ((float *)t->data)[i] = NAN;
  else if (t->dtype == ATTN_F64)
    for (int64_t i = 0; i < n; i++) ((double *)t->data)[i] = NAN;
  else if (t->dtype == ATTN_F16 || t->dtype == ATTN_BF16)
    for (int64_t i = 0; i < n; i++) ((uint16_t *)t->data)[i] = t->dtype == ATTN_F16 ? 0x7e00 : 0x7fc0;
}

/* t (any dtype and strides) as a contiguous double array. */
static double *as_f64(attn_ctx *ctx, pool *pl, const attn_tensor *t) {
  attn_tensor d = make_f64(pl, t->rank, t->shape);
  copy(ctx, &d, t);
  return d.data;
}

/* Within bound of the oracle: ||a - r|| <= tol (||r|| + floor sqrt(n)) over the finite entries, and
 * the same infinities; NaN only where the oracle has NaN. */
static void close_to(const double *a, const double *r, int64_t n, double tol, double floor, const char *name,
                     attn_ctx *ctx) {
  double diff = 0, ref = 0;
  for (int64_t i = 0; i < n; i++) {
    char msg[160];
    if (isnan(r[i]) || isinf(r[i])) {
      snprintf(msg, sizeof msg, "%s[%lld] is %g where the oracle's is %g", name, (long long)i, a[i], r[i]);
      fuzz_need(isnan(r[i]) ? isnan(a[i]) : a[i] == r[i], ctx, msg);
      continue;
    }
    snprintf(msg, sizeof msg, "%s[%lld] is %g where the oracle's is %g", name, (long long)i, a[i], r[i]);
    fuzz_need(isfinite(a[i]), ctx, msg);
    diff += (a[i] - r[i]) * (a[i] - r[i]);
    ref += r[i] * r[i];
  }
  const double lim = tol * (sqrt(ref) + floor * sqrt((double)n));
  if (sqrt(diff) <= lim) return;
  char msg[200];
  snprintf(msg, sizeof msg, "%s: L2 distance %.3g from the oracle's (norm %.3g), bound %.3g", name, sqrt(diff),
           sqrt(ref), lim);
  fuzz_need(0, ctx, msg);
}

/* a and b hold the same bits (why: between thread counts, or a packed sequence and the sequence alone). */
static void same_bits(const attn_tensor *a, const attn_tensor *b, const char *name, const char *why, attn_ctx *ctx) {
  const size_t es = attn_dtype_size(a->dtype);
  for (int64_t i = 0, n = numel(a); i < n; i++) {
    if (memcmp((const char *)a->data + i * es, (const char *)b->data + i * es, es) == 0) continue;
    char msg[200];
    snprintf(msg, sizeof msg, "%s[%lld] differs %s: %.9g and %.9g", name, (long long)i, why,
             a->dtype == ATTN_F32 ? ((const float *)a->data)[i] : 0.0,
             a->dtype == ATTN_F32 ? ((const float *)b->data)[i] : 0.0);
    fuzz_need(0, ctx, msg);
  }
}

/* ---- which keys no row sees ------------------------------------------------------ */
/* m: the mask's values as f64 (any broadcast shape of rank <= 4) */
static double mask_at(const attn_tensor *m, int64_t b, int64_t h, int64_t i, int64_t j) {
  const int64_t idx[4] = {b, h, i, j};
  int64_t off = 0;
  for (int d = 0; d < m->rank; d++) {
    const int64_t x = idx[4 - m->rank + d];
    off += (m->shape[d] == 1 ? 0 : x) * m->strides[d];
  }
  return ((const double *)m->data)[off];
}

/* Whether row i of (b, h) sees key j, the header's words written out again: the
 * causal bound, window and chunk on positions (bottom-right alignment, shard offsets),
 * key padding, and the mask (mask64 is the mask's values in double). */
static int sees(const fcase *c, const attn_tensor *mask64, const uint8_t *kp, int64_t b, int64_t h, int64_t i,
                int64_t j, int64_t nq, int64_t nk) {
  (void)h;
  const int64_t ip = i + (c->causal == ATTN_CAUSAL_BOTTOM_RIGHT ? nk - nq : 0) + c->q_off, jp = j + c->k_off;
  if ((c->causal != ATTN_CAUSAL_NONE || c->window || c->chunk) && jp > ip) return 0;
  if (c->window && jp <= ip - c->window) return 0;
  if (c->chunk && jp / c->chunk != ip / c->chunk) return 0; /* jp <= ip here, both >= 0 */
  if (kp && kp[b * c->Nk + j]) return 0;
  if (mask64) {
    const double m = mask_at(mask64, b, h, i, j);
    const attn_mask_mode mode = (attn_mask_mode)(c->mask_kind - 1);
    if (mode == ATTN_MASK_KEEP && m == 0) return 0;
    if (mode == ATTN_MASK_MASKED && m != 0) return 0;
    if (mode == ATTN_MASK_ADDITIVE && m == -INFINITY) return 0;
  }
  return 1;
}

/* k and v (double, contiguous [B, Hk, Nk, *]) with NaN, +Inf or -Inf in every key no row of its group sees. */
static void poison_hidden(const fcase *c, const attn_tensor *mask64, const uint8_t *kp, double *k, double *v) {
  const int64_t G = c->Hq / c->Hk, nseq = c->nseq ? c->nseq : 1;
  int kind = 0;
  for (int64_t b = 0; b < c->B; b++)
    for (int64_t g = 0; g < c->Hk; g++)
      for (int64_t s = 0; s < nseq; s++) {
        const int64_t q0 = c->nseq ? c->cu_q[s] : 0, q1 = c->nseq ? c->cu_q[s + 1] : c->Nq;
        const int64_t k0 = c->nseq ? c->cu_k[s] : 0, k1 = c->nseq ? c->cu_k[s + 1] : c->Nk;
        for (int64_t j = k0; j < k1; j++) {
          int seen = 0;
          for (int64_t h = g * G; h < (g + 1) * G && !seen; h++)
            for (int64_t i = q0; i < q1 && !seen; i++)
              seen = sees(c, mask64, kp, b, h, i - q0, j - k0, q1 - q0, k1 - k0);
          if (seen) continue;
          const double bad = kind == 0 ? NAN : kind == 1 ? INFINITY : -INFINITY;
          kind = (kind + 1) % 3;
          for (int64_t d = 0; d < c->D; d++) k[((b * c->Hk + g) * c->Nk + j) * c->D + d] = bad;
          for (int64_t d = 0; d < c->Dv; d++) v[((b * c->Hk + g) * c->Nk + j) * c->Dv + d] = bad;
        }
      }
}

/* ---- one case ------------------------------------------------------------------- */
static void fill(attn_tensor *t64, double amp) {
  for (int64_t i = 0, n = numel(t64); i < n; i++) ((double *)t64->data)[i] = amp * fuzz_uniform();
}

/* t64's values rounded to dt and back (the values a bf16 or f16 tile sees). */
static void round_through(attn_ctx *ctx, pool *pl, attn_tensor *t64, attn_dtype dt) {
  int64_t n = numel(t64);
  attn_tensor h = attn_tensor_view(grab(pl, (size_t)n * 2), dt, 1, &n), flat = attn_tensor_view(t64->data,
                                                                                                 ATTN_F64, 1, &n);
  copy(ctx, &h, &flat);
  copy(ctx, &flat, &h);
}

static attn_tensor slice(const attn_tensor *t, int dim, int64_t start, int64_t count) {
  attn_tensor s = *t;
  s.data = (char *)t->data + (size_t)(start * t->strides[dim]) * attn_dtype_size(t->dtype);
  s.shape[dim] = count;
  return s;
}

/* t's elements in a new contiguous tensor of its dtype (for bitwise comparisons). */
static attn_tensor gather(attn_ctx *ctx, pool *pl, const attn_tensor *t) {
  attn_tensor g = attn_tensor_view(grab(pl, (size_t)numel(t) * attn_dtype_size(t->dtype)), t->dtype, t->rank,
                                   t->shape);
  copy(ctx, &g, t);
  return g;
}

typedef struct fwd_out {
  attn_tensor out, lse, weights;
} fwd_out;

static void new_fwd(pool *pl, const fcase *c, fwd_out *f) {
  const int64_t so[4] = {c->B, c->Hq, c->Nq, c->Dv}, sl[3] = {c->B, c->Hq, c->Nq},
                sw[4] = {c->B, c->Hq, c->Nq, c->Nk};
  f->out = make4(pl, so, c->out_dt, c->out_batch_first);
  f->lse = attn_tensor_view(grab(pl, (size_t)(c->B * c->Hq * c->Nq) * 4), ATTN_F32, 3, sl);
  f->weights = attn_tensor_view(grab(pl, (size_t)(c->B * c->Hq * c->Nq * c->Nk) * 4), ATTN_F32, 4, sw);
  poison(&f->out), poison(&f->lse), poison(&f->weights);
}

typedef struct bwd_out {
  attn_tensor dq, dk, dv, mask_grad, sinks_grad;
} bwd_out;

static void new_bwd(pool *pl, const fcase *c, bwd_out *g) {
  const int64_t sq[4] = {c->B, c->Hq, c->Nq, c->D}, sk[4] = {c->B, c->Hk, c->Nk, c->D},
                sv[4] = {c->B, c->Hk, c->Nk, c->Dv}, sw[4] = {c->B, c->Hq, c->Nq, c->Nk};
  g->dq = make4(pl, sq, c->grad_dt, c->q_batch_first);
  g->dk = make4(pl, sk, c->grad_dt, c->kv_batch_first);
  g->dv = make4(pl, sv, c->grad_dt, c->kv_batch_first);
  g->mask_grad = attn_tensor_view(grab(pl, (size_t)(sw[0] * sw[1] * sw[2] * sw[3]) * 4), ATTN_F32, 4, sw);
  g->sinks_grad = attn_tensor_view(grab(pl, (size_t)c->Hq * 4), ATTN_F32, 1, &c->Hq);
  poison(&g->dq), poison(&g->dk), poison(&g->dv), poison(&g->mask_grad), poison(&g->sinks_grad);
}

static attn_status forward(attn_ctx *ctx, const fcase *c, fwd_out *f, const attn_tensor *q, const attn_tensor *k,
                           const attn_tensor *v, const attn_sdpa_opts *o) {
  return attn_sdpa(ctx, &f->out, c->want_lse || c->backward ? &f->lse : NULL, c->want_weights ? &f->weights : NULL,
                   q, k, v, o);
}

static attn_status backward(attn_ctx *ctx, const fcase *c, bwd_out *g, const attn_tensor *dout, const attn_tensor *q,
                            const attn_tensor *k, const attn_tensor *v, const fwd_out *f, const attn_sdpa_opts *o) {
  return attn_sdpa_backward(ctx, &g->dq, &g->dk, &g->dv, c->want_mask_grad ? &g->mask_grad : NULL,
                            c->want_sinks_grad ? &g->sinks_grad : NULL, dout, q, k, v, &f->out, &f->lse, o);
}

static void same_status(attn_status st, attn_status st_ref, attn_ctx *ctx, const char *call) {
  char msg[160];
  snprintf(msg, sizeof msg, "%s: status %s, the oracle's %s", call, attn_strerror(st), attn_strerror(st_ref));
  fuzz_need(st == st_ref, ctx, msg);
}

#define THREADS "between thread counts"
#define ALONE "between a packed sequence and the sequence alone"

static void run(attn_ctx *ctx, pool *pl, const fcase *c) {
  const int64_t sq[4] = {c->B, c->Hq, c->Nq, c->D}, sk[4] = {c->B, c->Hk, c->Nk, c->D},
                sv[4] = {c->B, c->Hk, c->Nk, c->Dv}, so[4] = {c->B, c->Hq, c->Nq, c->Dv};
  attn_tensor q64 = make_f64(pl, 4, sq), k64 = make_f64(pl, 4, sk), v64 = make_f64(pl, 4, sv);
  fill(&q64, c->amp), fill(&k64, c->amp), fill(&v64, c->amp);
  const attn_dtype tile_dt = c->dt != ATTN_F32                         ? c->dt
                             : c->precision == ATTN_PRECISION_BF16 ? ATTN_BF16
                             : c->precision == ATTN_PRECISION_F16  ? ATTN_F16
                                                                   : ATTN_F32;
  if (tile_dt != ATTN_F32) /* f32 inputs a tile would round: already its values, so the oracle sees what it sees */
    round_through(ctx, pl, &q64, tile_dt), round_through(ctx, pl, &k64, tile_dt), round_through(ctx, pl, &v64, tile_dt);

  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.scale = c->scale;
  o.causal = c->causal;
  o.window = c->window;
  o.chunk = c->chunk;
  o.softcap = c->softcap;
  o.dropout_p = c->dropout;
  o.dropout_seed = c->seed;
  o.q_offset = c->q_off, o.k_offset = c->k_off, o.head_offset = c->h_off;
  attn_tensor mask, mask64 = {0}, kpm, alibi, sinks;
  if (c->mask_kind) {
    const int64_t full[4] = {c->B, c->Hq, c->Nq, c->Nk};
    int64_t ms[4];
    for (int i = 0; i < c->mask_rank; i++) ms[i] = c->mask_full[i] ? full[4 - c->mask_rank + i] : 1;
    mask64 = make_f64(pl, c->mask_rank, ms);
    const attn_mask_mode mode = (attn_mask_mode)(c->mask_kind - 1);
    /* the seed's mask * -1e9 as a bias of up to -2: a row it masks whole is uniform in fp32 (s - 1e9 rounds
     * to -1e9) but keeps its logits in the oracle's double, so 0/1 values would test rounding, not the kernels */
    for (int64_t i = 0, n = numel(&mask64); i < n; i++) {
      const double u = fuzz_uniform();
      ((double *)mask64.data)[i] = mode == ATTN_MASK_KEEP     ? u > -0.4
                                   : mode == ATTN_MASK_MASKED ? u < -0.4
                                   : mode == ATTN_MASK_SEED   ? (u + 1) * 1e-9
                                   : u < -0.5                 ? -INFINITY
                                                              : 2 * fuzz_uniform();
    }
    mask = attn_tensor_view(grab(pl, (size_t)numel(&mask64) * attn_dtype_size(c->mask_dt)), c->mask_dt,
                            c->mask_rank, ms);
    copy(ctx, &mask, &mask64);
    copy(ctx, &mask64, &mask); /* the values the call reads (f16, bf16 masks rounded) */
    o.mask = &mask;
    o.mask_mode = mode;
  }
  uint8_t *kp = NULL;
  if (c->kpm) {
    const int64_t s2[2] = {c->B, c->Nk};
    kp = grab(pl, (size_t)(c->B * c->Nk));
    for (int64_t b = 0; b < c->B; b++)
      for (int64_t j = 0; j < c->Nk; j++) kp[b * c->Nk + j] = j >= c->kp_len[b];
    kpm = attn_tensor_view(kp, c->kpm_dt, 2, s2);
    o.key_padding = &kpm;
  }
  if (c->alibi) {
    alibi = attn_tensor_view(grab(pl, (size_t)c->Hq * 4), ATTN_F32, 1, &c->Hq);
    for (int64_t h = 0; h < c->Hq; h++) ((float *)alibi.data)[h] = (float)(0.5 * fuzz_uniform());
    o.alibi_slopes = &alibi;
  }
  if (c->sinks) {
    sinks = attn_tensor_view(grab(pl, (size_t)c->Hq * 4), ATTN_F32, 1, &c->Hq);
    for (int64_t h = 0; h < c->Hq; h++) ((float *)sinks.data)[h] = (float)(3 * fuzz_uniform());
    o.sinks = &sinks;
  }
  if (c->nseq) o.cu_seqlens_q = c->cu_q, o.cu_seqlens_k = c->cu_k, o.num_seqs = c->nseq;

  /* the inputs: clean for the oracle, hidden keys poisoned for the call under test */
  attn_tensor q = make4(pl, sq, c->dt, c->q_batch_first);
  attn_tensor k = make4(pl, sk, c->dt, c->kv_batch_first), v = make4(pl, sv, c->dt, c->kv_batch_first);
  attn_tensor kp_ = make4(pl, sk, c->dt, c->kv_batch_first), vp = make4(pl, sv, c->dt, c->kv_batch_first);
  copy(ctx, &q, &q64), copy(ctx, &k, &k64), copy(ctx, &v, &v64);
  poison_hidden(c, c->mask_kind ? &mask64 : NULL, kp, k64.data, v64.data);
  copy(ctx, &kp_, &k64), copy(ctx, &vp, &v64);

  fwd_out f, f2;
  new_fwd(pl, c, &f);
  const attn_status st = forward(ctx, c, &f, &q, &kp_, &vp, &o);
  fuzz_need(st == ATTN_OK || attn_ctx_error(ctx)[0] != '\0', ctx, "attn_sdpa failed without a message");
  const int64_t sl[3] = {c->B, c->Hq, c->Nq}, sw[4] = {c->B, c->Hq, c->Nq, c->Nk};
  attn_tensor out_r = make_f64(pl, 4, so), lse_r = make_f64(pl, 3, sl), w_r = make_f64(pl, 4, sw);
  const attn_status st_r = attn_sdpa_ref(ctx, &out_r, c->want_lse || c->backward ? &lse_r : NULL,
                                         c->want_weights ? &w_r : NULL, &q, &k, &v, &o);
  same_status(st, st_r, ctx, "attn_sdpa");
  if (st != ATTN_OK) return;

  const int bf16_tiles = c->kernel == ATTN_KERNEL_AVX512_BF16 || c->kernel == ATTN_KERNEL_AMX;
  const int half_fwd = (bf16_tiles && tile_dt == ATTN_BF16 && c->precision != ATTN_PRECISION_FP32) ||
                       (c->kernel == ATTN_KERNEL_AMX && tile_dt == ATTN_F16 && c->precision != ATTN_PRECISION_FP32);
  /* out's bound: the path's, or the rounding to a half out (2^-8, 2^-11 relative) where larger */
  const double round_out = c->out_dt == ATTN_BF16 ? 4e-3 : c->out_dt == ATTN_F16 ? 1e-3 : 0;
  /* fp32: logits err by about 1e-7 of sum |q_d k_d| scale, up to 1e-5 at the largest sizes and scales drawn */
  const double tol_path = !half_fwd ? 5e-5 : tile_dt == ATTN_BF16 ? 1e-2 : 2e-3;
  const double tol_out = tol_path > round_out ? tol_path : round_out;
  const int64_t n_out = numel(&out_r), n_lse = numel(&lse_r), n_w = numel(&w_r);
  close_to(as_f64(ctx, pl, &f.out), out_r.data, n_out, tol_out, 0.1 * c->amp, "out", ctx);
  if (c->want_lse || c->backward) close_to(as_f64(ctx, pl, &f.lse), lse_r.data, n_lse, 5e-5, 0.1, "lse", ctx);
  if (c->want_weights)
    close_to(as_f64(ctx, pl, &f.weights), w_r.data, n_w, 5e-5, 1e-3 / (1 - c->dropout), "weights", ctx);

  /* another thread count, the same bits */
  attn_ctx_set_threads(ctx, c->threads2);
  new_fwd(pl, c, &f2);
  fuzz_need(forward(ctx, c, &f2, &q, &kp_, &vp, &o) == ATTN_OK, ctx, "attn_sdpa failed on another thread count");
  same_bits(&f.out, &f2.out, "out", THREADS, ctx);
  if (c->want_lse || c->backward) same_bits(&f.lse, &f2.lse, "lse", THREADS, ctx);
  if (c->want_weights) same_bits(&f.weights, &f2.weights, "weights", THREADS, ctx);
  attn_ctx_set_threads(ctx, c->threads);

  bwd_out g, g2, gr;
  int bwd_ok = 0;
  attn_tensor dout = attn_tensor_view(grab(pl, (size_t)numel(&out_r) * 4), ATTN_F32, 4, so);
  if (c->backward) {
    for (int64_t i = 0; i < n_out; i++) ((float *)dout.data)[i] = (float)fuzz_uniform();
    new_bwd(pl, c, &g);
    const attn_status sb = backward(ctx, c, &g, &dout, &q, &kp_, &vp, &f, &o);
    fuzz_need(sb == ATTN_OK || attn_ctx_error(ctx)[0] != '\0', ctx, "attn_sdpa_backward failed without a message");
    gr.dq = make_f64(pl, 4, sq), gr.dk = make_f64(pl, 4, sk), gr.dv = make_f64(pl, 4, sv);
    gr.mask_grad = make_f64(pl, 4, sw), gr.sinks_grad = make_f64(pl, 1, &c->Hq);
    const attn_status sb_r = attn_sdpa_backward_ref(ctx, &gr.dq, &gr.dk, &gr.dv,
                                                    c->want_mask_grad ? &gr.mask_grad : NULL,
                                                    c->want_sinks_grad ? &gr.sinks_grad : NULL, &dout, &q, &k, &v,
                                                    &f.out, &f.lse, &o);
    same_status(sb, sb_r, ctx, "attn_sdpa_backward");
    bwd_ok = sb == ATTN_OK;
    if (bwd_ok) {
      /* The backward takes Dd_i = dout_i . out_i from the out it is given, the oracle from its own
       * probabilities, so dS = P (dP - Dd) carries out's rounding where dP - Dd cancels (a row with
       * one visible key has dS = 0 exactly; fp32 gives rounding noise there), and dq, dk, dmask and
       * dsinks sum that noise over keys or rows. The floors below are such sums' sizes (a random
       * walk of terms of the inputs' size, 1/(1-p) with dropout), times 0.1, and times 1 on the
       * paths that round out, dout, P or dS to a half (a half out, half tiles forward or
       * backward), whose bound is 3e-2; the fp32 paths' is 1e-4, or a half gradient's rounding. */
      const int half_bwd = c->precision != ATTN_PRECISION_FP32 &&
                           ((bf16_tiles && c->dt == ATTN_BF16) || (c->kernel == ATTN_KERNEL_AMX && c->dt == ATTN_F16));
      const int loose = half_bwd || half_fwd || c->out_dt != ATTN_F32;
      const double round_g = c->grad_dt == ATTN_BF16 ? 4e-3 : c->grad_dt == ATTN_F16 ? 1e-3 : 0;
      const double tol = loose ? 3e-2 : 1e-4 > round_g ? 1e-4 : round_g;
      const double unit = (loose ? 1 : 0.1) / (1 - c->dropout), term = c->amp * sqrt((double)c->Dv);
      const double rows = sqrt((double)(c->B * c->Nq * (c->Hq / c->Hk))), keys = sqrt((double)c->Nk);
      close_to(as_f64(ctx, pl, &g.dq), gr.dq.data, numel(&gr.dq), tol, unit * keys * term * c->amp, "dq", ctx);
      close_to(as_f64(ctx, pl, &g.dk), gr.dk.data, numel(&gr.dk), tol, unit * rows * term * c->amp, "dk", ctx);
      close_to(as_f64(ctx, pl, &g.dv), gr.dv.data, numel(&gr.dv), tol, unit * rows, "dv", ctx);
      if (c->want_mask_grad)
        close_to(as_f64(ctx, pl, &g.mask_grad), gr.mask_grad.data, numel(&gr.mask_grad), tol, unit * term,
                 "mask_grad", ctx);
      if (c->want_sinks_grad)
        close_to(as_f64(ctx, pl, &g.sinks_grad), gr.sinks_grad.data, c->Hq, tol, unit * rows * term, "sinks_grad",
                 ctx);
      attn_ctx_set_threads(ctx, c->threads2);
      new_bwd(pl, c, &g2);
      fuzz_need(backward(ctx, c, &g2, &dout, &q, &kp_, &vp, &f, &o) == ATTN_OK, ctx,
           "attn_sdpa_backward failed on another thread count");
      same_bits(&g.dq, &g2.dq, "dq", THREADS, ctx);
      same_bits(&g.dk, &g2.dk, "dk", THREADS, ctx);
      same_bits(&g.dv, &g2.dv, "dv", THREADS, ctx);
      if (c->want_mask_grad) same_bits(&g.mask_grad, &g2.mask_grad, "mask_grad", THREADS, ctx);
      if (c->want_sinks_grad) same_bits(&g.sinks_grad, &g2.sinks_grad, "sinks_grad", THREADS, ctx);
      attn_ctx_set_threads(ctx, c->threads);
    }
  }

  if (!c->nseq) return;
  /* a packed batch: each sequence as if run alone (dropout's entries are the sequence's index: the first only) */
  attn_ctx_set_decode(ctx, 0);
  attn_sdpa_opts alone = o;
  alone.cu_seqlens_q = alone.cu_seqlens_k = NULL, alone.num_seqs = 0;
  for (int64_t s = 0; s < c->nseq && (s == 0 || c->dropout == 0); s++) {
    fcase cs = *c;
    cs.nseq = 0, cs.Nq = c->cu_q[s + 1] - c->cu_q[s], cs.Nk = c->cu_k[s + 1] - c->cu_k[s];
    const attn_tensor qs = slice(&q, 2, c->cu_q[s], cs.Nq), ks = slice(&kp_, 2, c->cu_k[s], cs.Nk),
                      vs = slice(&vp, 2, c->cu_k[s], cs.Nk);
    fwd_out fs;
    new_fwd(pl, &cs, &fs);
    fuzz_need(forward(ctx, &cs, &fs, &qs, &ks, &vs, &alone) == ATTN_OK, ctx, "a packed batch's sequence alone failed");
    attn_tensor po = slice(&f.out, 2, c->cu_q[s], cs.Nq), pl_ = slice(&f.lse, 2, c->cu_q[s], cs.Nq);
    attn_tensor a = gather(ctx, pl, &po), b = gather(ctx, pl, &fs.out);
    same_bits(&a, &b, "out", ALONE, ctx);
    if (cs.want_lse || cs.backward) {
      attn_tensor al = gather(ctx, pl, &pl_);
      same_bits(&al, &fs.lse, "lse", ALONE, ctx);
    }
    if (!bwd_ok) continue;
    bwd_out gs;
    new_bwd(pl, &cs, &gs);
    const attn_tensor douts = slice(&dout, 2, c->cu_q[s], cs.Nq);
    cs.want_mask_grad = cs.want_sinks_grad = 0;
    fwd_out fin = {.out = po, .lse = pl_};
    fuzz_need(backward(ctx, &cs, &gs, &douts, &qs, &ks, &vs, &fin, &alone) == ATTN_OK, ctx,
         "a packed batch's sequence's backward alone failed");
    attn_tensor pdq = slice(&g.dq, 2, c->cu_q[s], cs.Nq), pdk = slice(&g.dk, 2, c->cu_k[s], cs.Nk),
                pdv = slice(&g.dv, 2, c->cu_k[s], cs.Nk);
    attn_tensor x1 = gather(ctx, pl, &pdq), y1 = gather(ctx, pl, &gs.dq);
    same_bits(&x1, &y1, "dq", ALONE, ctx);
    attn_tensor x2 = gather(ctx, pl, &pdk), y2 = gather(ctx, pl, &gs.dk);
    same_bits(&x2, &y2, "dk", ALONE, ctx);
    attn_tensor x3 = gather(ctx, pl, &pdv), y3 = gather(ctx, pl, &gs.dv);
    same_bits(&x3, &y3, "dv", ALONE, ctx);
  }
}

#undef THREADS
#undef ALONE

static void describe(const fcase *c) {
  fuzz_report_clear();
  fuzz_log("kernel %s threads %d/%d decode %d precision %s dtype %s B%lld Hq%lld Hk%lld Nq%lld Nk%lld D%lld "
           "Dv%lld bf %d%d%d causal %d window %lld chunk %lld mask %d (%s, rank %d, full %d%d%d%d) kpm %d (%lld %lld) "
           "softcap %g alibi %d sinks %d dropout %g scale %g amp %g offsets %lld %lld %lld lse %d weights %d "
           "backward %d mask_grad %d sinks_grad %d out %s grads %s",
           attn_kernel_name(c->kernel), c->threads, c->threads2, c->decode, attn_precision_name(c->precision),
           attn_dtype_name(c->dt), (long long)c->B, (long long)c->Hq, (long long)c->Hk, (long long)c->Nq,
           (long long)c->Nk, (long long)c->D, (long long)c->Dv, c->q_batch_first, c->kv_batch_first,
           c->out_batch_first, (int)c->causal, (long long)c->window, (long long)c->chunk, c->mask_kind,
           attn_dtype_name(c->mask_dt), c->mask_rank, c->mask_full[0], c->mask_full[1], c->mask_full[2],
           c->mask_full[3], c->kpm, (long long)c->kp_len[0], (long long)c->kp_len[1], c->softcap, c->alibi,
           c->sinks, c->dropout, c->scale, c->amp, (long long)c->q_off, (long long)c->k_off,
           (long long)c->h_off, c->want_lse, c->want_weights, c->backward, c->want_mask_grad,
           c->want_sinks_grad, attn_dtype_name(c->out_dt), attn_dtype_name(c->grad_dt));
  for (int64_t s = 0; s < c->nseq; s++)
    fuzz_log("%s%lld/%lld", s ? " " : " packed ", (long long)(c->cu_q[s + 1] - c->cu_q[s]),
             (long long)(c->cu_k[s + 1] - c->cu_k[s]));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!fuzz_kernel_count) return 0;
  fuzz_reader r = {data, size, 0};
  fcase c;
  read_case(&r, &c);
  fuzz_seed(data, size);
  describe(&c);
  attn_ctx *ctx;
  fuzz_need(attn_ctx_create(&ctx) == ATTN_OK, NULL, "cannot create a context");
  fuzz_need(attn_ctx_set_kernel(ctx, c.kernel) == ATTN_OK && attn_ctx_set_threads(ctx, c.threads) == ATTN_OK &&
           attn_ctx_set_decode(ctx, c.decode) == ATTN_OK && attn_ctx_set_precision(ctx, c.precision) == ATTN_OK,
       ctx, "cannot set up the context");
  pool pl = {0};
  run(ctx, &pl, &c);
  for (int i = 0; i < pl.n; i++) free(pl.p[i]);
  attn_ctx_destroy(ctx);
  return 0;
}
