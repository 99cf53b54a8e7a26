/* Packed variable-length batches (attn_sdpa_opts.cu_seqlens_q/_k): on one
 * kernel (argv[1]: c, avx2, avx512, avx512bf16; a kernel this CPU lacks is a
 * skip), random packed batches with empty sequences, lengths off the tile
 * sizes, Nq != Nk per sequence, GQA and every option:
 *   - forward and backward against the float64 oracle, outputs poisoned first;
 *   - each sequence bitwise equal to attn_sdpa / attn_sdpa_backward on that
 *     sequence alone (with dropout: alone at its index, the sequences before
 *     it empty, since dropout's entry is (sequence, h, i, j));
 *   - 1, 2 and 3 threads bitwise equal;
 *   - the oracle's packed dropout equal to its padded batch's;
 *   - bad offsets and unsupported options refused. */
#include "testutil.h"

#include <stddef.h>

#define MAXSEQ 6

typedef struct vcase {
  int64_t nseq, Hq, Hk, D, Dv;
  int64_t cq[MAXSEQ + 1], ck[MAXSEQ + 1];
  int sep_k; /* cu_seqlens_k given (else keys packed as the queries) */
  attn_dtype dt;
  int causal, half_tiles, with_sinks, with_alibi;
  int64_t window;
  double softcap, scale, dropout;
  int64_t chunk;
} vcase;

static attn_tensor tensor4(arena *a, attn_dtype dt, int64_t s0, int64_t s1, int64_t s2, int64_t s3) {
  attn_tensor t;
  memset(&t, 0, sizeof t);
  t.dtype = dt;
  t.rank = 4;
  t.shape[0] = s0, t.shape[1] = s1, t.shape[2] = s2, t.shape[3] = s3;
  t.strides[3] = 1, t.strides[2] = s3, t.strides[1] = s2 * s3, t.strides[0] = s1 * s2 * s3;
  t.data = arena_alloc(a, (size_t)(s0 * s1 * s2 * s3) * attn_dtype_size(dt) + 1);
  return t;
}

static attn_tensor tensor3(arena *a, int64_t s0, int64_t s1, int64_t s2) {
  attn_tensor t;
  memset(&t, 0, sizeof t);
  t.dtype = ATTN_F32;
  t.rank = 3;
  t.shape[0] = s0, t.shape[1] = s1, t.shape[2] = s2;
  t.strides[2] = 1, t.strides[1] = s2, t.strides[0] = s1 * s2;
  t.data = arena_alloc(a, (size_t)(s0 * s1 * s2) * sizeof(float) + 1);
  return t;
}

static void fill(tu_rng *r, attn_tensor *t) {
  const int64_t n = attn_tensor_numel(t);
  for (int64_t e = 0; e < n; e++) {
    const float x = (float)tu_uniform(r);
    if (t->dtype == ATTN_F32) ((float *)t->data)[e] = x;
    else if (t->dtype == ATTN_BF16) ((uint16_t *)t->data)[e] = tu_f32_to_bf16(x);
    else ((uint16_t *)t->data)[e] = tu_f32_to_f16(x);
  }
}

static void poison(attn_tensor *t) { tu_poison_f32(t->data, attn_tensor_numel(t)); }

/* Rows r0..r0+n of dim 2 of a contiguous view: the view of one sequence. */
static attn_tensor rows_of(const attn_tensor *t, int64_t r0, int64_t n) {
  attn_tensor v = *t;
  v.data = (char *)t->data + (size_t)(r0 * t->strides[2]) * attn_dtype_size(t->dtype);
  v.shape[2] = n;
  return v;
}

/* Bitwise equality of two f32 views of the same shape (NaN bits included). */
static int same_bits(const attn_tensor *a, const attn_tensor *b) {
  int64_t sh[4] = {1, 1, 1, 1}, sa[4] = {0}, sb[4] = {0};
  const int off = 4 - a->rank;
  for (int i = 0; i < a->rank; i++) sh[off + i] = a->shape[i], sa[off + i] = a->strides[i], sb[off + i] = b->strides[i];
  for (int64_t i0 = 0; i0 < sh[0]; i0++)
    for (int64_t i1 = 0; i1 < sh[1]; i1++)
      for (int64_t i2 = 0; i2 < sh[2]; i2++)
        for (int64_t i3 = 0; i3 < sh[3]; i3++) {
          const float x = ((const float *)a->data)[i0 * sa[0] + i1 * sa[1] + i2 * sa[2] + i3 * sa[3]];
          const float y = ((const float *)b->data)[i0 * sb[0] + i1 * sb[1] + i2 * sb[2] + i3 * sb[3]];
          if (memcmp(&x, &y, 4) != 0) return 0;
        }
  return 1;
}

/* Relative L2 error, with equal infinities (lse of rows that see no key) as
 * no error, and a floor under the norm: a gradient that is 0 but for
 * rounding (a row of one visible key) is not compared digit by digit. */
/* Relative L2 error, against at least floor_norm (and 1e-3 a value). */
static double rel_err_floor(const attn_tensor *got, const attn_tensor *want, double floor_norm) {
  double *a = tu_to_f64(got), *b = tu_to_f64(want);
  const int64_t n = attn_tensor_numel(got);
  double num = 0, den = 0;
  for (int64_t e = 0; e < n; e++) {
    if (a[e] == b[e]) continue;
    if (!isfinite(a[e]) || !isfinite(b[e])) num = INFINITY;
    else num += (a[e] - b[e]) * (a[e] - b[e]), den += b[e] * b[e];
  }
  free(a), free(b);
  return sqrt(num) / fmax(fmax(sqrt(den), floor_norm), 1e-3 * sqrt((double)(n > 0 ? n : 1)));
}

static double rel_err(const attn_tensor *got, const attn_tensor *want) { return rel_err_floor(got, want, 0); }

static double norm_of(const attn_tensor *t) {
  double *a = tu_to_f64(t), s = 0;
  const int64_t n = attn_tensor_numel(t);
  for (int64_t e = 0; e < n; e++) s += isfinite(a[e]) ? a[e] * a[e] : 0;
  free(a);
  return sqrt(s);
}

static void describe(const vcase *c, char *buf, size_t n) {
  int used = snprintf(buf, n, "seqs=%lld Hq=%lld Hk=%lld D=%lld Dv=%lld dt=%s causal=%d window=%lld chunk=%lld "
                      "softcap=%g alibi=%d sinks=%d dropout=%g half=%d q/k:", (long long)c->nseq, (long long)c->Hq,
                      (long long)c->Hk, (long long)c->D, (long long)c->Dv, attn_dtype_name(c->dt), c->causal,
                      (long long)c->window, (long long)c->chunk, c->softcap, c->with_alibi, c->with_sinks, c->dropout, c->half_tiles);
  for (int64_t s = 0; s < c->nseq && used > 0 && (size_t)used < n; s++)
    used += snprintf(buf + used, n - (size_t)used, " %lld/%lld", (long long)(c->cq[s + 1] - c->cq[s]),
                     (long long)(c->ck[s + 1] - c->ck[s]));
}

static vcase random_case(tu_rng *r, int bf16_kernel) {
  vcase c;
  memset(&c, 0, sizeof c);
  c.nseq = tu_int(r, 1, MAXSEQ);
  c.Hk = tu_int(r, 1, 2);
  c.Hq = c.Hk * tu_int(r, 1, 3);
  static const int64_t dims[] = {8, 16, 32, 33, 64};
  c.D = dims[tu_int(r, 0, 4)];
  c.Dv = tu_int(r, 0, 3) ? c.D : dims[tu_int(r, 0, 4)];
  c.sep_k = (int)tu_int(r, 0, 1);
  for (int64_t s = 0; s < c.nseq; s++) {
    /* empty sequences, single rows, lengths off every tile size */
    const int64_t kind = tu_int(r, 0, 5);
    const int64_t nq = kind == 0 ? 0 : kind == 1 ? 1 : tu_int(r, 2, 90);
    const int64_t nk = c.sep_k ? (tu_int(r, 0, 5) == 0 ? 0 : tu_int(r, 1, 90)) : nq;
    c.cq[s + 1] = c.cq[s] + nq;
    c.ck[s + 1] = c.ck[s] + nk;
  }
  const int64_t pick = tu_int(r, 0, 5);
  c.dt = pick == 0 ? ATTN_BF16 : pick == 1 ? ATTN_F16 : ATTN_F32;
  if (bf16_kernel) c.dt = ATTN_BF16, c.half_tiles = (int)tu_int(r, 0, 1);
  c.causal = (int)tu_int(r, 0, 2);
  c.window = tu_int(r, 0, 3) == 0 ? tu_int(r, 1, 40) : 0;
  c.softcap = tu_int(r, 0, 3) == 0 ? 5.0 : 0;
  c.with_alibi = tu_int(r, 0, 3) == 0;
  c.with_sinks = tu_int(r, 0, 3) == 0;
  c.scale = tu_int(r, 0, 2) == 0 ? 0.3 : NAN;
  c.dropout = tu_int(r, 0, 3) == 0 ? 0.2 : 0;
  c.chunk = tu_int(r, 0, 3) == 0 ? tu_int(r, 1, 50) : 0;
  return c;
}

typedef struct bufs {
  attn_tensor q, k, v, out, lse, dout, dq, dk, dv;
  attn_tensor slopes, sinks;
  attn_sdpa_opts o;
} bufs;

static void make_opts(const vcase *c, bufs *b, arena *a) {
  attn_sdpa_opts_init(&b->o);
  b->o.causal = (attn_causal)c->causal;
  b->o.window = c->window;
  b->o.chunk = c->chunk;
  b->o.softcap = c->softcap;
  b->o.scale = c->scale;
  b->o.dropout_p = c->dropout;
  b->o.dropout_seed = 1234;
  memset(&b->slopes, 0, sizeof b->slopes);
  b->slopes.dtype = ATTN_F32, b->slopes.rank = 1, b->slopes.shape[0] = c->Hq, b->slopes.strides[0] = 1;
  b->slopes.data = arena_alloc(a, (size_t)c->Hq * sizeof(float));
  attn_alibi_slopes(b->slopes.data, c->Hq);
  b->sinks = b->slopes;
  b->sinks.data = arena_alloc(a, (size_t)c->Hq * sizeof(float));
  for (int64_t h = 0; h < c->Hq; h++) ((float *)b->sinks.data)[h] = (float)(0.5 * (double)h - 0.3);
  b->o.alibi_slopes = c->with_alibi ? &b->slopes : NULL;
  b->o.sinks = c->with_sinks ? &b->sinks : NULL;
}

static void run_case(attn_ctx *ctx, attn_kernel kern, const vcase *c, uint64_t seed) {
  char desc[512];
  describe(c, desc, sizeof desc);
  arena a = {{0}, 0};
  tu_rng r = {seed};
  const int64_t TQ = c->cq[c->nseq], TK = c->ck[c->nseq];
  bufs b;
  b.q = tensor4(&a, c->dt, 1, c->Hq, TQ, c->D);
  b.k = tensor4(&a, c->dt, 1, c->Hk, TK, c->D);
  b.v = tensor4(&a, c->dt, 1, c->Hk, TK, c->Dv);
  fill(&r, &b.q), fill(&r, &b.k), fill(&r, &b.v);
  b.out = tensor4(&a, ATTN_F32, 1, c->Hq, TQ, c->Dv);
  b.lse = tensor3(&a, 1, c->Hq, TQ);
  make_opts(c, &b, &a);
  b.o.cu_seqlens_q = c->cq;
  b.o.cu_seqlens_k = c->sep_k ? c->ck : NULL;
  b.o.num_seqs = c->nseq;
  attn_ctx_set_kernel(ctx, kern);
  attn_ctx_set_precision(ctx, c->half_tiles ? ATTN_PRECISION_BF16 : ATTN_PRECISION_DEFAULT);
  attn_ctx_set_threads(ctx, 1);

  /* forward against the oracle */
  poison(&b.out), poison(&b.lse);
  CHECK_OK(ctx, attn_sdpa(ctx, &b.out, &b.lse, NULL, &b.q, &b.k, &b.v, &b.o));
  attn_tensor ro = tensor4(&a, ATTN_F64, 1, c->Hq, TQ, c->Dv), rl = ro;
  rl.rank = 3, rl.shape[2] = TQ, rl.strides[2] = 1, rl.shape[1] = c->Hq, rl.strides[1] = TQ, rl.strides[0] = c->Hq * TQ;
  rl.data = arena_alloc(&a, (size_t)(c->Hq * TQ) * sizeof(double) + 1);
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &ro, &rl, NULL, &b.q, &b.k, &b.v, &b.o));
  /* bf16 inputs take the bf16 tiles on a kernel with them, unless the policy is fp32; f16 inputs
   * AMX's f16 tiles (P rounded to f16) where they take the shape */
  const int half = (c->half_tiles || (c->dt == ATTN_BF16 && kern >= ATTN_KERNEL_AVX512_BF16)) &&
                   !(kern == ATTN_KERNEL_AMX && c->Dv % 16); /* AMX widens the shapes its tiles do not take */
  const int f16_tiles = c->dt == ATTN_F16 && strstr(attn_ctx_plan(ctx), "(bf16 hi + lo)") != NULL;
  CHECK(f16_tiles == (c->dt == ATTN_F16 && kern == ATTN_KERNEL_AMX && c->Dv % 16 == 0),
        "f16 tiles %s (%s): %s", f16_tiles ? "ran" : "did not run", desc, attn_ctx_plan(ctx));
  const double tol = half ? 3e-2 : f16_tiles ? 2e-3 : 2e-5;
  double e = rel_err(&b.out, &ro);
  CHECK(e < tol, "forward out vs oracle: %.3g (%s, seed %llu)", e, desc, (unsigned long long)seed);
  e = rel_err(&b.lse, &rl);
  CHECK(e < tol, "forward lse vs oracle: %.3g (%s)", e, desc);

  /* backward against the oracle: the bf16 backward tiles (AMX's or AVX512-BF16's) for bf16 inputs and
   * AMX's f16 ones for f16 inputs (D and Dv multiples of 16), else fp32 */
  b.dout = tensor4(&a, ATTN_F32, 1, c->Hq, TQ, c->Dv);
  fill(&r, &b.dout);
  b.dq = tensor4(&a, ATTN_F32, 1, c->Hq, TQ, c->D);
  b.dk = tensor4(&a, ATTN_F32, 1, c->Hk, TK, c->D);
  b.dv = tensor4(&a, ATTN_F32, 1, c->Hk, TK, c->Dv);
  const int bwd = !c->half_tiles; /* the backward of half tiles' output is the fp32 one's: tested with fp32 */
  if (bwd) {
    poison(&b.dq), poison(&b.dk), poison(&b.dv);
    CHECK_OK(ctx, attn_sdpa_backward(ctx, &b.dq, &b.dk, &b.dv, NULL, NULL, &b.dout, &b.q, &b.k, &b.v, &b.out, &b.lse, &b.o));
    const int bwd_tiles = (kern == ATTN_KERNEL_AMX || (kern == ATTN_KERNEL_AVX512_BF16 && c->dt == ATTN_BF16)) &&
                          c->dt != ATTN_F32 && c->D % 16 == 0 && c->Dv % 16 == 0;
    const char *tiles_plan = c->dt == ATTN_F16 ? "f16 tiles (bf16 hi + lo), packed batch" : "bf16 tiles, packed batch";
    /* (a batch without queries or keys returns before any plan: the last call's stays) */
    CHECK(TQ == 0 || TK == 0 || bwd_tiles == (strstr(attn_ctx_plan(ctx), tiles_plan) != NULL),
          "the backward's half tiles %s (%s): %s",
          bwd_tiles ? "did not run" : "ran", desc, attn_ctx_plan(ctx));
    attn_tensor rq = tensor4(&a, ATTN_F64, 1, c->Hq, TQ, c->D), rk = tensor4(&a, ATTN_F64, 1, c->Hk, TK, c->D);
    attn_tensor rv = tensor4(&a, ATTN_F64, 1, c->Hk, TK, c->Dv);
    CHECK_OK(ctx, attn_sdpa_backward_ref(ctx, &rq, &rk, &rv, NULL, NULL, &b.dout, &b.q, &b.k, &b.v, &b.out, &b.lse, &b.o));
    /* out and lse of bf16 tiles disagree at bf16's precision with the fp32 scores
     * the backward recomputes, and the oracle takes Dd from its own probabilities;
     * the f16 backward tiles round P, dS and dO to f16 (test_half's F16_GRAD_BOUND) */
    const double btol = half ? 1e-2 : bwd_tiles && c->dt == ATTN_F16 ? 1e-3 : 1e-4;
    /* Where every row sees one key (a sequence of one key, a chunk or window of 1), dS = P (dP - Dd)
     * cancels: dq and dk are 0 but for roundings, the oracle's and ours alike. Their error is taken
     * against at least a tenth of dv's norm (no cancellation there; dq and dk are of its order otherwise). */
    const double dv_tenth = 0.1 * norm_of(&rv);
    CHECK((e = rel_err_floor(&b.dq, &rq, dv_tenth)) < btol, "dq vs oracle: %.3g (%s, seed %llu)", e, desc,
          (unsigned long long)seed);
    CHECK((e = rel_err_floor(&b.dk, &rk, dv_tenth)) < btol, "dk vs oracle: %.3g (%s, seed %llu)", e, desc,
          (unsigned long long)seed);
    CHECK((e = rel_err(&b.dv, &rv)) < btol, "dv vs oracle: %.3g (%s, seed %llu)", e, desc, (unsigned long long)seed);
  }

  /* 2 and 3 threads: bitwise the same */
  for (int th = 2; th <= 3; th++) {
    attn_ctx_set_threads(ctx, th);
    attn_tensor o2 = tensor4(&a, ATTN_F32, 1, c->Hq, TQ, c->Dv), l2 = tensor3(&a, 1, c->Hq, TQ);
    poison(&o2), poison(&l2);
    CHECK_OK(ctx, attn_sdpa(ctx, &o2, &l2, NULL, &b.q, &b.k, &b.v, &b.o));
    CHECK(same_bits(&o2, &b.out) && same_bits(&l2, &b.lse), "forward on %d threads differs (%s)", th, desc);
    if (!bwd) continue;
    attn_tensor q2 = tensor4(&a, ATTN_F32, 1, c->Hq, TQ, c->D), k2 = tensor4(&a, ATTN_F32, 1, c->Hk, TK, c->D);
    attn_tensor v2 = tensor4(&a, ATTN_F32, 1, c->Hk, TK, c->Dv);
    poison(&q2), poison(&k2), poison(&v2);
    CHECK_OK(ctx, attn_sdpa_backward(ctx, &q2, &k2, &v2, NULL, NULL, &b.dout, &b.q, &b.k, &b.v, &b.out, &b.lse, &b.o));
    CHECK(same_bits(&q2, &b.dq) && same_bits(&k2, &b.dk) && same_bits(&v2, &b.dv), "backward on %d threads differs (%s)",
          th, desc);
  }
  attn_ctx_set_threads(ctx, 1);

  /* each sequence alone: a batch of one (decode off: a lone sequence of a few rows
   * would take the decode kernel), or with dropout a packed batch of empty
   * sequences then this one, so that dropout's entries are (s, h, i, j) */
  attn_ctx_set_decode(ctx, 0);
  for (int64_t s = 0; s < c->nseq; s++) {
    const int64_t q0 = c->cq[s], nq = c->cq[s + 1] - q0, k0 = c->ck[s], nk = c->ck[s + 1] - k0;
    attn_tensor qs = rows_of(&b.q, q0, nq), ks = rows_of(&b.k, k0, nk), vs = rows_of(&b.v, k0, nk);
    attn_tensor os = tensor4(&a, ATTN_F32, 1, c->Hq, nq, c->Dv), ls = tensor3(&a, 1, c->Hq, nq);
    attn_sdpa_opts so = b.o;
    int64_t zq[MAXSEQ + 1], zk[MAXSEQ + 1];
    if (c->dropout > 0) {
      for (int64_t t = 0; t <= s; t++) zq[t] = 0, zk[t] = 0;
      zq[s + 1] = nq, zk[s + 1] = nk;
      so.cu_seqlens_q = zq, so.cu_seqlens_k = zk, so.num_seqs = s + 1;
    } else {
      so.cu_seqlens_q = so.cu_seqlens_k = NULL, so.num_seqs = 0;
    }
    poison(&os), poison(&ls);
    CHECK_OK(ctx, attn_sdpa(ctx, &os, &ls, NULL, &qs, &ks, &vs, &so));
    attn_tensor po = rows_of(&b.out, q0, nq), pl = b.lse;
    pl.data = (float *)b.lse.data + q0, pl.shape[2] = nq;
    CHECK(same_bits(&os, &po) && same_bits(&ls, &pl), "sequence %lld's forward alone differs (%s, seed %llu)",
          (long long)s, desc, (unsigned long long)seed);
    if (!bwd) continue;
    attn_tensor dqs = tensor4(&a, ATTN_F32, 1, c->Hq, nq, c->D), dks = tensor4(&a, ATTN_F32, 1, c->Hk, nk, c->D);
    attn_tensor dvs = tensor4(&a, ATTN_F32, 1, c->Hk, nk, c->Dv);
    attn_tensor gs = rows_of(&b.dout, q0, nq);
    poison(&dqs), poison(&dks), poison(&dvs);
    CHECK_OK(ctx, attn_sdpa_backward(ctx, &dqs, &dks, &dvs, NULL, NULL, &gs, &qs, &ks, &vs, &po, &pl, &so));
    attn_tensor pq = rows_of(&b.dq, q0, nq), pk = rows_of(&b.dk, k0, nk), pv = rows_of(&b.dv, k0, nk);
    CHECK(same_bits(&dqs, &pq) && same_bits(&dks, &pk) && same_bits(&dvs, &pv),
          "sequence %lld's backward alone differs (%s, seed %llu)", (long long)s, desc, (unsigned long long)seed);
  }
  attn_ctx_set_decode(ctx, 1);
  attn_ctx_set_precision(ctx, ATTN_PRECISION_DEFAULT);
  arena_free(&a);
}

/* The oracle's packed batch against its padded one ([nseq, H, max, D] with
 * key padding), dropout on: the same entries (s, h, i, j) are dropped. Keys
 * are aligned at the top-left, where padding moves no position. */
static void padded_oracle(attn_ctx *ctx, tu_rng *r) {
  arena a = {{0}, 0};
  const int64_t nseq = 3, H = 2, D = 8, nq[3] = {5, 0, 9}, nk[3] = {7, 3, 4}, M = 9;
  int64_t cq[4] = {0}, ck[4] = {0};
  for (int s = 0; s < 3; s++) cq[s + 1] = cq[s] + nq[s], ck[s + 1] = ck[s] + nk[s];
  attn_tensor q = tensor4(&a, ATTN_F32, 1, H, cq[3], D), k = tensor4(&a, ATTN_F32, 1, H, ck[3], D);
  attn_tensor v = tensor4(&a, ATTN_F32, 1, H, ck[3], D), o = tensor4(&a, ATTN_F64, 1, H, cq[3], D);
  fill(r, &q), fill(r, &k), fill(r, &v);
  attn_tensor Q = tensor4(&a, ATTN_F32, nseq, H, M, D), K = tensor4(&a, ATTN_F32, nseq, H, M, D);
  attn_tensor V = tensor4(&a, ATTN_F32, nseq, H, M, D), O = tensor4(&a, ATTN_F64, nseq, H, M, D);
  attn_tensor kp;
  memset(&kp, 0, sizeof kp);
  kp.dtype = ATTN_BOOL, kp.rank = 2, kp.shape[0] = nseq, kp.shape[1] = M, kp.strides[0] = M, kp.strides[1] = 1;
  kp.data = arena_alloc(&a, (size_t)(nseq * M));
  for (int64_t s = 0; s < nseq; s++)
    for (int64_t h = 0; h < H; h++) {
      for (int64_t i = 0; i < nq[s]; i++)
        memcpy((float *)Q.data + off4(&Q, s, h, i, 0), (float *)q.data + off4(&q, 0, h, cq[s] + i, 0), D * 4);
      for (int64_t j = 0; j < M; j++) {
        ((uint8_t *)kp.data)[s * M + j] = j >= nk[s];
        if (j >= nk[s]) continue;
        memcpy((float *)K.data + off4(&K, s, h, j, 0), (float *)k.data + off4(&k, 0, h, ck[s] + j, 0), D * 4);
        memcpy((float *)V.data + off4(&V, s, h, j, 0), (float *)v.data + off4(&v, 0, h, ck[s] + j, 0), D * 4);
      }
    }
  attn_sdpa_opts so, po;
  attn_sdpa_opts_init(&so);
  so.dropout_p = 0.3, so.dropout_seed = 99, so.causal = ATTN_CAUSAL_TOP_LEFT;
  po = so;
  so.cu_seqlens_q = cq, so.cu_seqlens_k = ck, so.num_seqs = nseq;
  po.key_padding = &kp;
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &o, NULL, NULL, &q, &k, &v, &so));
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &O, NULL, NULL, &Q, &K, &V, &po));
  int same = 1;
  for (int64_t s = 0; s < nseq; s++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t i = 0; i < nq[s]; i++)
        for (int64_t d = 0; d < D; d++)
          same &= ((double *)o.data)[off4(&o, 0, h, cq[s] + i, d)] == ((double *)O.data)[off4(&O, s, h, i, d)];
  CHECK(same, "the oracle's packed batch with dropout differs from its padded batch");
  arena_free(&a);
}

static void refusals(attn_ctx *ctx) {
  arena a = {{0}, 0};
  attn_tensor q = tensor4(&a, ATTN_F32, 1, 2, 10, 8), k = tensor4(&a, ATTN_F32, 1, 2, 10, 8);
  attn_tensor v = tensor4(&a, ATTN_F32, 1, 2, 10, 8), o = tensor4(&a, ATTN_F32, 1, 2, 10, 8);
  attn_tensor k7 = tensor4(&a, ATTN_F32, 1, 2, 7, 8), v7 = tensor4(&a, ATTN_F32, 1, 2, 7, 8);
  attn_tensor q2 = tensor4(&a, ATTN_F32, 2, 2, 5, 8), o2 = tensor4(&a, ATTN_F32, 2, 2, 5, 8);
  attn_tensor w = tensor4(&a, ATTN_F32, 1, 2, 10, 10);
  poison(&o);
  attn_sdpa_opts op;
  attn_sdpa_opts_init(&op);
  int64_t good[3] = {0, 4, 10};
  struct { int64_t cu[3]; const char *needle; } bad[] = {
      {{1, 4, 10}, "cu_seqlens_q[0]"},        {{0, 6, 4}, "cu_seqlens_q[2]"},
      {{0, 4, 9}, "cu_seqlens_q[2]"},         {{0, -3, 10}, "cu_seqlens_q[1]"},
      {{0, INT64_MAX, 10}, "cu_seqlens_q[1]"}, {{0, 4, 11}, "cu_seqlens_q[2]"},
      {{0, INT64_MIN, 10}, "cu_seqlens_q[1]"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    op.cu_seqlens_q = bad[i].cu, op.num_seqs = 2;
    CHECK_ERR(ctx, attn_sdpa(ctx, &o, NULL, NULL, &q, &k, &v, &op), ATTN_E_INVALID, bad[i].needle);
  }
  CHECK(isnan(((float *)o.data)[0]), "a refused call wrote out");
  op.cu_seqlens_q = good, op.num_seqs = -1;
  CHECK_ERR(ctx, attn_sdpa(ctx, &o, NULL, NULL, &q, &k, &v, &op), ATTN_E_INVALID, "num_seqs");
  op.num_seqs = INT64_MAX;
  CHECK_ERR(ctx, attn_sdpa(ctx, &o, NULL, NULL, &q, &k, &v, &op), ATTN_E_INVALID, "num_seqs");
  op.cu_seqlens_q = NULL, op.num_seqs = 2;
  CHECK_ERR(ctx, attn_sdpa(ctx, &o, NULL, NULL, &q, &k, &v, &op), ATTN_E_INVALID, "cu_seqlens_q");
  op.cu_seqlens_k = good, op.num_seqs = 0;
  CHECK_ERR(ctx, attn_sdpa(ctx, &o, NULL, NULL, &q, &k, &v, &op), ATTN_E_INVALID, "cu_seqlens_k");
  /* keys: their own offsets, ending at total_k; without them total_k must be total_q */
  int64_t kbad[3] = {0, 4, 10};
  op.cu_seqlens_q = good, op.cu_seqlens_k = kbad, op.num_seqs = 2;
  CHECK_ERR(ctx, attn_sdpa(ctx, &o, NULL, NULL, &q, &k7, &v7, &op), ATTN_E_INVALID, "cu_seqlens_k[1]");
  op.cu_seqlens_k = NULL;
  CHECK_ERR(ctx, attn_sdpa(ctx, &o, NULL, NULL, &q, &k7, &v7, &op), ATTN_E_SHAPE, "total_k");
  CHECK_ERR(ctx, attn_sdpa(ctx, &o2, NULL, NULL, &q2, &q2, &q2, &op), ATTN_E_SHAPE, "[1, Hq, total_q, D]");
  attn_tensor kp;
  memset(&kp, 0, sizeof kp);
  kp.dtype = ATTN_BOOL, kp.rank = 2, kp.shape[0] = 1, kp.shape[1] = 10, kp.strides[1] = 1, kp.strides[0] = 10;
  kp.data = arena_alloc(&a, 10);
  op.key_padding = &kp;
  CHECK_ERR(ctx, attn_sdpa(ctx, &o, NULL, NULL, &q, &k, &v, &op), ATTN_E_UNSUPPORTED, "key_padding");
  op.key_padding = NULL, op.mask = &kp;
  CHECK_ERR(ctx, attn_sdpa(ctx, &o, NULL, NULL, &q, &k, &v, &op), ATTN_E_UNSUPPORTED, "mask");
  op.mask = NULL;
  CHECK_ERR(ctx, attn_sdpa(ctx, &o, NULL, &w, &q, &k, &v, &op), ATTN_E_UNSUPPORTED, "weights");
  CHECK_ERR(ctx, attn_sdpa_ref(ctx, &o, NULL, &w, &q, &k, &v, &op), ATTN_E_UNSUPPORTED, "weights");
  /* the backward checks the same */
  op.cu_seqlens_q = bad[1].cu;
  attn_tensor lse = tensor3(&a, 1, 2, 10);
  CHECK_ERR(ctx, attn_sdpa_backward(ctx, &q, &k, &v, NULL, NULL, &o, &q, &k, &v, &o, &lse, &op), ATTN_E_INVALID,
            "cu_seqlens_q[2]");
  /* a caller built before the packed batch (a smaller size): its fields past the size are not read */
  attn_sdpa_opts old;
  attn_sdpa_opts_init(&old);
  old.size = offsetof(attn_sdpa_opts, cu_seqlens_q);
  old.cu_seqlens_q = bad[0].cu, old.num_seqs = 99;
  CHECK_OK(ctx, attn_sdpa(ctx, &o, NULL, NULL, &q, &k, &v, &old));
  /* a packed batch of nothing: every output empty */
  int64_t none[1] = {0};
  attn_tensor q0 = tensor4(&a, ATTN_F32, 1, 2, 0, 8), o0 = tensor4(&a, ATTN_F32, 1, 2, 0, 8);
  op.cu_seqlens_q = none, op.num_seqs = 0;
  CHECK_OK(ctx, attn_sdpa(ctx, &o0, NULL, NULL, &q0, &q0, &q0, &op));
  arena_free(&a);
}

/* The layer: a packed x [1, total, E] (causal self-attention, RoPE from each
 * sequence's start, GQA) against each sequence run alone [1, n, E]: out,
 * dquery and the parameters' gradients (summed over the sequences). */
static void layer(attn_ctx *ctx, tu_rng *r) {
  arena a = {{0}, 0};
  const int64_t E = 32, H = 4, nseq = 4, cu[5] = {0, 19, 19, 20, 61}, T = cu[4];
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, E, H);
  cfg.num_kv_heads = 2;
  cfg.bias = 1;
  attn_mha *m = NULL, *g = NULL, *g1 = NULL;
  CHECK_OK(ctx, attn_mha_create(ctx, &m, &cfg));
  CHECK_OK(ctx, attn_mha_create(ctx, &g, &cfg));
  CHECK_OK(ctx, attn_mha_create(ctx, &g1, &cfg));
  if (!m || !g || !g1) return;
  for (int w = 0; w < ATTN_MHA_NUM_PARAMS; w++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, m, (attn_mha_param)w) == ATTN_OK) tu_fill_f32(r, t.data, attn_tensor_numel(&t), 0.3);
  }
  attn_tensor x = tensor4(&a, ATTN_F32, 1, 1, T, E), o = tensor4(&a, ATTN_F32, 1, 1, T, E);
  attn_tensor dout = tensor4(&a, ATTN_F32, 1, 1, T, E), dx = tensor4(&a, ATTN_F32, 1, 1, T, E);
  attn_tensor *v3[4] = {&x, &o, &dout, &dx};
  for (int i = 0; i < 4; i++) { /* [1, T, E] */
    v3[i]->rank = 3, v3[i]->shape[1] = T, v3[i]->shape[2] = E;
    v3[i]->strides[0] = T * E, v3[i]->strides[1] = E, v3[i]->strides[2] = 1;
  }
  fill(r, &x), fill(r, &dout);
  poison(&o), poison(&dx);
  attn_rope_opts ro;
  attn_rope_opts_init(&ro);
  ro.position_offset = 3;
  attn_mha_opts mo;
  attn_mha_opts_init(&mo);
  mo.attn.causal = ATTN_CAUSAL_TOP_LEFT;
  mo.rope = &ro;
  int64_t cu_copy[5];
  memcpy(cu_copy, cu, sizeof cu);
  mo.attn.cu_seqlens_q = cu_copy, mo.attn.num_seqs = nseq;
  attn_mha_saved *sv = NULL;
  attn_ctx_set_decode(ctx, 0); /* a lone sequence of one row would take the decode kernel */
  CHECK_OK(ctx, attn_mha_forward_save(ctx, m, &o, NULL, &sv, &x, NULL, NULL, &mo));
  memset(cu_copy, 0xff, sizeof cu_copy); /* the saved state keeps its own offsets */
  CHECK_OK(ctx, attn_mha_backward(ctx, m, &dx, NULL, NULL, g, sv, &dout));
  attn_mha_saved_free(sv);
  /* each sequence alone; its parameter gradients summed in double */
  double *gsum[ATTN_MHA_NUM_PARAMS] = {0};
  attn_mha_opts so = mo;
  so.attn.cu_seqlens_q = NULL, so.attn.num_seqs = 0;
  double worst_o = 0, worst_dx = 0;
  for (int64_t s = 0; s < nseq; s++) {
    const int64_t n = cu[s + 1] - cu[s];
    attn_tensor xs = x, os = o, gs = dout, dxs = dx;
    xs.data = (float *)x.data + cu[s] * E, gs.data = (float *)dout.data + cu[s] * E;
    xs.shape[1] = gs.shape[1] = n;
    attn_tensor o1 = tensor4(&a, ATTN_F32, 1, 1, n, E), d1 = tensor4(&a, ATTN_F32, 1, 1, n, E);
    o1.rank = d1.rank = 3, o1.shape[1] = d1.shape[1] = n, o1.shape[2] = d1.shape[2] = E;
    o1.strides[1] = d1.strides[1] = E, o1.strides[2] = d1.strides[2] = 1;
    CHECK_OK(ctx, attn_mha_forward_save(ctx, m, &o1, NULL, &sv, &xs, NULL, NULL, &so));
    CHECK_OK(ctx, attn_mha_backward(ctx, m, &d1, NULL, NULL, g1, sv, &gs));
    attn_mha_saved_free(sv);
    os.data = (float *)o.data + cu[s] * E, dxs.data = (float *)dx.data + cu[s] * E;
    os.shape[1] = dxs.shape[1] = n;
#ifndef ATTN_TEST_CBLAS_PROJECTIONS
    /* the built-in GEMM rounds a row the same whatever the row count: bitwise the same
     * (a CBLAS's blocking may depend on it: then within the rounding checked below) */
    CHECK(same_bits(&os, &o1) && same_bits(&dxs, &d1), "layer: sequence %lld's out or dquery differs alone", (long long)s);
#endif
    const double eo = n ? rel_err(&os, &o1) : 0, ed = n ? rel_err(&dxs, &d1) : 0;
    worst_o = fmax(worst_o, eo), worst_dx = fmax(worst_dx, ed);
    for (int w = 0; w < ATTN_MHA_NUM_PARAMS; w++) {
      attn_tensor t;
      if (attn_mha_param_view(ctx, &t, g1, (attn_mha_param)w) != ATTN_OK) continue;
      const int64_t cnt = attn_tensor_numel(&t);
      if (!gsum[w]) gsum[w] = calloc((size_t)cnt, sizeof(double));
      for (int64_t e = 0; e < cnt && n; e++) gsum[w][e] += ((float *)t.data)[e];
    }
  }
  CHECK(worst_o < 1e-5, "layer: packed out vs each sequence alone: %.3g", worst_o);
  CHECK(worst_dx < 1e-4, "layer: packed dquery vs each sequence alone: %.3g", worst_dx);
  for (int w = 0; w < ATTN_MHA_NUM_PARAMS; w++) {
    attn_tensor t;
    if (!gsum[w] || attn_mha_param_view(ctx, &t, g, (attn_mha_param)w) != ATTN_OK) continue;
    double num = 0, den = 0;
    for (int64_t e = 0; e < attn_tensor_numel(&t); e++) {
      const double d = ((float *)t.data)[e] - gsum[w][e];
      num += d * d, den += gsum[w][e] * gsum[w][e];
    }
    CHECK(sqrt(num) <= 1e-4 * sqrt(den) + 1e-6, "layer: parameter %d's gradient: %.3g", w, sqrt(num / (den + 1e-30)));
    free(gsum[w]);
  }
  /* RoPE's per-sequence positions are for self-attention: cross-attention is refused */
  mo.attn.cu_seqlens_q = cu;
  CHECK_ERR(ctx, attn_mha_forward(ctx, m, &o, NULL, &x, &x, &x, &mo), ATTN_E_UNSUPPORTED, "RoPE");
  int64_t badcu[5] = {0, 19, 18, 20, 61};
  mo.attn.cu_seqlens_q = badcu;
  CHECK_ERR(ctx, attn_mha_forward(ctx, m, &o, NULL, &x, NULL, NULL, &mo), ATTN_E_INVALID, "cu_seqlens_q[2]");
  mo.rope = NULL;
  CHECK_ERR(ctx, attn_mha_forward(ctx, m, &o, NULL, &x, NULL, NULL, &mo), ATTN_E_INVALID, "cu_seqlens_q[2]");
  attn_ctx_set_decode(ctx, 1);
  attn_mha_destroy(m), attn_mha_destroy(g), attn_mha_destroy(g1);
  arena_free(&a);
}

int main(int argc, char **argv) {
  const char *name = argc > 1 ? argv[1] : getenv("ATTN_KERNEL");
  const attn_kernel kern = tu_kernel_or_skip(name);
  const int cases = argc > 2 ? atoi(argv[2]) : 40;
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx) != ATTN_OK) return 2;
  tu_rng r = {0x5eedull + (uint64_t)kern};
  const int bf16 = kern >= ATTN_KERNEL_AVX512_BF16;
  for (int i = 0; i < cases; i++) {
    const vcase c = random_case(&r, bf16 && (i & 1));
    run_case(ctx, kern, &c, tu_next(&r));
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  padded_oracle(ctx, &r);
  refusals(ctx);
  attn_ctx_set_kernel(ctx, kern);
  layer(ctx, &r);
  attn_ctx_destroy(ctx);
  char what[64];
  snprintf(what, sizeof what, "test_varlen %s", name && *name ? name : "auto");
  return tu_finish(what);
}
