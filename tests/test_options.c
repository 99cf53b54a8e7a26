/* The options of recent models: sliding window, softcap, ALiBi and sinks.
 *   (a) the oracle forward against a plain double loop written here from the
 *       header's words (positions, window, cap, bias, sink), and against the
 *       same result built from older features: a window as a boolean band
 *       mask, ALiBi as an additive mask, a sink as one more key of value 0;
 *   (b) the oracle backward against central finite differences of the oracle
 *       forward, each option alone and all together (dq, dk, dv, dmask, dsinks);
 *   (c) every fp32 kernel (c, avx2, avx512 where this CPU has them), threads
 *       1, 2 and 3, against the oracle, forward and backward, on fresh random
 *       inputs and poisoned outputs, each option alone and combined with
 *       causal, GQA, masks, key padding, dropout, weights and lse; the same
 *       bits whatever the thread count;
 *   (d) the ALiBi paper's slopes for 8 and 12 heads, the kernels' vectorisable
 *       tanh against libm's in double, and the argument checks.
 * Seeds are fixed. The worst errors per option are printed at the end. */
#include "testutil.h"
#include "cpu/vmath.h"

#define TOL_FWD 1e-5
#define TOL_BWD 2e-5
#define TOL_FD 1e-6


/* A rank-4 tensor of shape s, filled with amp * uniform (0 = zeros); batch_first:
 * a contiguous [s0, s2, s1, s3] buffer seen as [s0, s1, s2, s3]. */
static attn_tensor make4(arena *a, tu_rng *r, const int64_t s[4], attn_dtype dt, int batch_first, double amp) {
  const int64_t n = s[0] * s[1] * s[2] * s[3];
  void *data = arena_alloc(a, (size_t)n * attn_dtype_size(dt));
  for (int64_t i = 0; i < n && amp != 0; i++) {
    const double x = amp * tu_uniform(r);
    if (dt == ATTN_F32) ((float *)data)[i] = (float)x;
    else ((double *)data)[i] = x;
  }
  if (!batch_first) return attn_tensor_view(data, dt, 4, s);
  const int64_t bf[4] = {s[0], s[2], s[1], s[3]};
  attn_tensor base = attn_tensor_view(data, dt, 4, bf), t;
  static const int perm[4] = {0, 2, 1, 3};
  if (attn_tensor_permute(&t, &base, perm) != ATTN_OK) exit(2);
  return t;
}

static attn_tensor make_vec(arena *a, int64_t n, attn_dtype dt) {
  return attn_tensor_view(arena_alloc(a, (size_t)(n > 0 ? n : 1) * attn_dtype_size(dt)), dt, 1, &n);
}

static double tget(const attn_tensor *t, int64_t off) {
  return t->dtype == ATTN_F32 ? ((const float *)t->data)[off] : t->dtype == ATTN_F64 ? ((const double *)t->data)[off]
                                                                                     : ((const uint8_t *)t->data)[off];
}

static void tset(attn_tensor *t, int64_t off, double x) {
  if (t->dtype == ATTN_F32) ((float *)t->data)[off] = (float)x;
  else if (t->dtype == ATTN_F64) ((double *)t->data)[off] = x;
  else ((uint8_t *)t->data)[off] = (uint8_t)(x != 0);
}

static void poison(attn_tensor *t) {
  const int64_t n = attn_tensor_numel(t);
  int64_t idx[4] = {0, 0, 0, 0}, sh[4] = {1, 1, 1, 1};
  const int off = 4 - t->rank;
  for (int i = 0; i < t->rank; i++) sh[off + i] = t->shape[i];
  for (int64_t e = 0; e < n; e++) {
    int64_t rest = e, o = 0;
    for (int d = 3; d >= 0; d--) {
      idx[d] = rest % sh[d];
      rest /= sh[d];
    }
    for (int i = 0; i < t->rank; i++) o += idx[off + i] * t->strides[i];
    tset(t, o, NAN);
  }
}

/* ---- worst errors per option, for the summary ------------------------------------ */
enum { OPT_PLAIN, OPT_WINDOW, OPT_SOFTCAP, OPT_ALIBI, OPT_SINKS, OPT_CHUNK, OPT_COMBINED, OPT_KINDS };
static const char *opt_names[OPT_KINDS] = {"none", "window", "softcap", "alibi", "sinks", "chunk", "combined"};
enum { ERR_OUT, ERR_W, ERR_LSE, ERR_DQKV, ERR_DMASK, ERR_DSINK, ERR_KINDS };
static const char *err_names[ERR_KINDS] = {"out", "weights", "lse", "dq/dk/dv", "dmask", "dsinks"};
static double worst[OPT_KINDS][ERR_KINDS];

static void note(int kind, int what, double e) {
  if (e > worst[kind][what] || isnan(e)) worst[kind][what] = e;
}

/* ---- one problem ------------------------------------------------------------------ */
typedef struct ocase {
  const char *name;
  int64_t B, Hq, Hk, Nq, Nk, D, Dv;
  attn_causal causal;
  int64_t window;
  double softcap;
  int alibi, sinks;
  int mask_mode; /* -1: none */
  int kpm;       /* key padding */
  int dead;      /* rows with every key masked (by a KEEP mask unless another is asked for) */
  double dropout;
  int batch_first;
  double qamp;   /* larger logits so that the softmax is not flat and the cap bites */
  int64_t chunk; /* last: the tables above leave it 0 */
} ocase;

static int opt_kind(const ocase *c) {
  const int n = (c->window > 0) + (c->softcap > 0) + (c->alibi != 0) + (c->sinks != 0) + (c->chunk > 0);
  if (n == 0) return OPT_PLAIN;
  if (n > 1) return OPT_COMBINED;
  return c->window > 0 ? OPT_WINDOW : c->softcap > 0 ? OPT_SOFTCAP : c->alibi ? OPT_ALIBI : c->sinks ? OPT_SINKS : OPT_CHUNK;
}

typedef struct problem {
  attn_tensor q, k, v, G, mask, kpm, slopes, sinks;
  int has_mask, has_kpm;
  attn_sdpa_opts o;
} problem;

static void make_problem(arena *a, problem *pb, const ocase *c, uint64_t seed, attn_dtype dt) {
  tu_rng r = {seed};
  memset(pb, 0, sizeof *pb);
  const int64_t qs[4] = {c->B, c->Hq, c->Nq, c->D}, ks[4] = {c->B, c->Hk, c->Nk, c->D};
  const int64_t vs[4] = {c->B, c->Hk, c->Nk, c->Dv}, os[4] = {c->B, c->Hq, c->Nq, c->Dv};
  const int64_t ms[4] = {c->B, c->Hq, c->Nq, c->Nk};
  pb->q = make4(a, &r, qs, dt, c->batch_first, c->qamp > 0 ? c->qamp : 2.0);
  pb->k = make4(a, &r, ks, dt, c->batch_first, 1.0);
  pb->v = make4(a, &r, vs, dt, c->batch_first, 1.0);
  pb->G = make4(a, &r, os, dt, c->batch_first, 1.0);
  attn_sdpa_opts_init(&pb->o);
  attn_sdpa_opts *o = &pb->o;
  o->causal = c->causal;
  o->window = c->window;
  o->chunk = c->chunk;
  o->softcap = c->softcap;
  o->dropout_p = c->dropout;
  o->dropout_seed = seed ^ 0x5eed;
  if (c->alibi) {
    pb->slopes = make_vec(a, c->Hq, ATTN_F32);
    /* the paper's slopes are gentle; larger ones make the bias matter in short rows */
    attn_alibi_slopes(pb->slopes.data, c->Hq);
    for (int64_t h = 0; h < c->Hq; h++) ((float *)pb->slopes.data)[h] *= 1.5f;
    o->alibi_slopes = &pb->slopes;
  }
  if (c->sinks) {
    pb->sinks = make_vec(a, c->Hq, ATTN_F32);
    for (int64_t h = 0; h < c->Hq; h++) ((float *)pb->sinks.data)[h] = (float)(1.5 * tu_uniform(&r));
    o->sinks = &pb->sinks;
  }
  const int mode = c->mask_mode >= 0 ? c->mask_mode : c->dead ? ATTN_MASK_KEEP : -1;
  if (mode >= 0) {
    const attn_dtype mdt = mode == ATTN_MASK_ADDITIVE ? dt : ATTN_BOOL;
    pb->mask = make4(a, &r, ms, mdt, 0, 0);
    for (int64_t b = 0; b < c->B; b++)
      for (int64_t h = 0; h < c->Hq; h++)
        for (int64_t i = 0; i < c->Nq; i++) {
          /* dead rows: row 0 of head 0 and the last row of the last head, in batch 0 */
          const int dead = c->dead && b == 0 && ((h == 0 && i == 0) || (h == c->Hq - 1 && i == c->Nq - 1));
          for (int64_t j = 0; j < c->Nk; j++) {
            const int masked = dead || tu_int(&r, 0, 99) < 20;
            const int64_t e = off4(&pb->mask, b, h, i, j);
            switch (mode) {
              case ATTN_MASK_KEEP: tset(&pb->mask, e, !masked); break;
              case ATTN_MASK_MASKED: tset(&pb->mask, e, masked); break;
              default: tset(&pb->mask, e, masked ? -INFINITY : tu_uniform(&r)); break;
            }
          }
        }
    pb->has_mask = 1;
    o->mask = &pb->mask;
    o->mask_mode = (attn_mask_mode)mode;
  }
  if (c->kpm) {
    const int64_t s[2] = {c->B, c->Nk};
    pb->kpm = attn_tensor_view(arena_alloc(a, (size_t)(c->B * c->Nk + 1)), ATTN_BOOL, 2, s);
    for (int64_t e = 0; e < c->B * c->Nk; e++) ((uint8_t *)pb->kpm.data)[e] = tu_int(&r, 0, 99) < 20;
    pb->has_kpm = 1;
    o->key_padding = &pb->kpm;
  }
}

static void describe(const ocase *c, uint64_t seed, char *buf, size_t n) {
  snprintf(buf, n,
           "%s seed %llu: B=%lld Hq=%lld Hk=%lld Nq=%lld Nk=%lld D=%lld Dv=%lld causal=%d window=%lld softcap=%g "
           "alibi=%d sinks=%d mask=%d kpm=%d dead=%d p=%g bf=%d chunk=%lld",
           c->name, (unsigned long long)seed, (long long)c->B, (long long)c->Hq, (long long)c->Hk, (long long)c->Nq,
           (long long)c->Nk, (long long)c->D, (long long)c->Dv, (int)c->causal, (long long)c->window, c->softcap,
           c->alibi, c->sinks, c->mask_mode, c->kpm, c->dead, c->dropout, c->batch_first, (long long)c->chunk);
}

/* lse: -inf must match -inf; otherwise relative to 1 + |ref|. Returns the worst error (inf on a mismatch). */
static double lse_err(const double *got, const double *ref, int64_t n) {
  double e = 0;
  for (int64_t i = 0; i < n; i++) {
    double d;
    if (isinf(ref[i])) d = got[i] == ref[i] ? 0 : INFINITY;
    else d = fabs(got[i] - ref[i]) / (1 + fabs(ref[i]));
    if (!(d <= e)) e = d;
  }
  return e;
}

/* ---- (c) every kernel against the oracle -------------------------------------------- */
static const attn_kernel kernels[] = {ATTN_KERNEL_C, ATTN_KERNEL_AVX2, ATTN_KERNEL_AVX512};

static void check_case(attn_ctx *ctx, const ocase *c, uint64_t seed, int backward) {
  arena a = {{0}, 0};
  char desc[400];
  describe(c, seed, desc, sizeof desc);
  problem pb;
  make_problem(&a, &pb, c, seed, ATTN_F32);
  const int kind = opt_kind(c);
  const int64_t B = c->B, Hq = c->Hq, Hk = c->Hk, Nq = c->Nq, Nk = c->Nk, D = c->D, Dv = c->Dv;
  const int64_t os[4] = {B, Hq, Nq, Dv}, ws[4] = {B, Hq, Nq, Nk}, ls[3] = {B, Hq, Nq};
  const int64_t qs[4] = {B, Hq, Nq, D}, ks[4] = {B, Hk, Nk, D}, vs[4] = {B, Hk, Nk, Dv};
  const int64_t no = B * Hq * Nq * Dv, nw = B * Hq * Nq * Nk, nl = B * Hq * Nq;
  const int64_t nq = B * Hq * Nq * D, nk = B * Hk * Nk * D, nv = B * Hk * Nk * Dv;
  const int additive = pb.has_mask && pb.o.mask_mode == ATTN_MASK_ADDITIVE;
  tu_rng r = {seed * 7 + 1};

  /* the oracle: forward in f64, then its backward from its own out and lse */
  attn_tensor ro = make4(&a, &r, os, ATTN_F64, 0, 0), rw = make4(&a, &r, ws, ATTN_F64, 0, 0);
  attn_tensor rl = attn_tensor_view(arena_alloc(&a, (size_t)(nl + 1) * sizeof(double)), ATTN_F64, 3, ls);
  attn_sdpa_opts o = pb.o;
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &ro, &rl, &rw, &pb.q, &pb.k, &pb.v, &o));
  double *ref_o = tu_to_f64(&ro), *ref_w = tu_to_f64(&rw), *ref_l = tu_to_f64(&rl);
  attn_tensor rdq = make4(&a, &r, qs, ATTN_F64, 0, 0), rdk = make4(&a, &r, ks, ATTN_F64, 0, 0);
  attn_tensor rdv = make4(&a, &r, vs, ATTN_F64, 0, 0), rdm = make4(&a, &r, ws, ATTN_F64, 0, 0);
  attn_tensor rds = make_vec(&a, Hq, ATTN_F32);
  double *ref_dq = NULL, *ref_dk = NULL, *ref_dv = NULL, *ref_dm = NULL, *ref_ds = NULL;
  /* the fp32 backward's out and lse: the oracle's, in f32, so only the backward's error shows */
  attn_tensor fo = make4(&a, &r, os, ATTN_F32, c->batch_first, 0);
  attn_tensor fl = attn_tensor_view(arena_alloc(&a, (size_t)(nl + 1) * sizeof(float)), ATTN_F32, 3, ls);
  if (backward) {
    o = pb.o;
    CHECK_OK(ctx, attn_sdpa_backward_ref(ctx, &rdq, &rdk, &rdv, additive ? &rdm : NULL, c->sinks ? &rds : NULL, &pb.G,
                                         &pb.q, &pb.k, &pb.v, &ro, &rl, &o));
    ref_dq = tu_to_f64(&rdq), ref_dk = tu_to_f64(&rdk), ref_dv = tu_to_f64(&rdv);
    ref_dm = tu_to_f64(&rdm), ref_ds = tu_to_f64(&rds);
    for (int64_t b = 0; b < B; b++)
      for (int64_t h = 0; h < Hq; h++)
        for (int64_t i = 0; i < Nq; i++) {
          for (int64_t e = 0; e < Dv; e++) tset(&fo, off4(&fo, b, h, i, e), tget(&ro, off4(&ro, b, h, i, e)));
          ((float *)fl.data)[(b * Hq + h) * Nq + i] = (float)ref_l[(b * Hq + h) * Nq + i];
        }
  }

  for (size_t ki = 0; ki < sizeof kernels / sizeof kernels[0]; ki++) {
    if (!attn_kernel_supported(kernels[ki])) continue;
    const char *kn = attn_kernel_name(kernels[ki]);
    float *first_o = NULL, *first_g = NULL;
    const int64_t ng = nq + nk + nv + (additive ? nw : 0) + (c->sinks ? Hq : 0);
    for (int threads = 1; threads <= 3; threads++) {
      CHECK_OK(ctx, attn_ctx_set_kernel(ctx, kernels[ki]));
      CHECK_OK(ctx, attn_ctx_set_threads(ctx, threads));
      /* forward */
      attn_tensor out = make4(&a, &r, os, ATTN_F32, c->batch_first, 0), w = make4(&a, &r, ws, ATTN_F32, 0, 0);
      attn_tensor l = attn_tensor_view(arena_alloc(&a, (size_t)(nl + 1) * sizeof(float)), ATTN_F32, 3, ls);
      poison(&out);
      poison(&w);
      poison(&l);
      o = pb.o;
      attn_status st = attn_sdpa(ctx, &out, &l, &w, &pb.q, &pb.k, &pb.v, &o);
      CHECK(st == ATTN_OK, "%s: %s threads %d: forward: %s", desc, kn, threads, attn_ctx_error(ctx));
      if (st == ATTN_OK) {
        double *go = tu_to_f64(&out), *gw = tu_to_f64(&w), *gl = tu_to_f64(&l);
        const double eo = tu_rel_l2(go, ref_o, no), ew = tu_rel_l2(gw, ref_w, nw), el = lse_err(gl, ref_l, nl);
        note(kind, ERR_OUT, eo);
        note(kind, ERR_W, ew);
        note(kind, ERR_LSE, el);
        CHECK(eo <= TOL_FWD && tu_count_nan(go, no) == 0, "%s: %s threads %d: out rel err %.3g, %d NaN", desc, kn,
              threads, eo, tu_count_nan(go, no));
        CHECK(ew <= TOL_FWD && tu_count_nan(gw, nw) == 0, "%s: %s threads %d: weights rel err %.3g, %d NaN", desc, kn,
              threads, ew, tu_count_nan(gw, nw));
        CHECK(el <= TOL_FWD, "%s: %s threads %d: lse err %.3g", desc, kn, threads, el);
        float *bits = arena_alloc(&a, (size_t)(no + nl + 1) * sizeof(float));
        for (int64_t e = 0; e < no; e++) bits[e] = (float)go[e];
        for (int64_t e = 0; e < nl; e++) bits[no + e] = (float)gl[e];
        if (!first_o) first_o = bits;
        else CHECK(memcmp(first_o, bits, (size_t)(no + nl) * sizeof(float)) == 0,
                   "%s: %s: forward with %d threads changed the bits", desc, kn, threads);
        free(go);
        free(gw);
        free(gl);
      }
      if (!backward) continue;
      attn_tensor dq = make4(&a, &r, qs, ATTN_F32, c->batch_first, 0), dk = make4(&a, &r, ks, ATTN_F32, c->batch_first, 0);
      attn_tensor dv = make4(&a, &r, vs, ATTN_F32, c->batch_first, 0), dm = make4(&a, &r, ws, ATTN_F32, 0, 0);
      attn_tensor ds = make_vec(&a, Hq, ATTN_F32);
      poison(&dq);
      poison(&dk);
      poison(&dv);
      poison(&dm);
      poison(&ds);
      o = pb.o;
      st = attn_sdpa_backward(ctx, &dq, &dk, &dv, additive ? &dm : NULL, c->sinks ? &ds : NULL, &pb.G, &pb.q, &pb.k,
                              &pb.v, &fo, &fl, &o);
      CHECK(st == ATTN_OK, "%s: %s threads %d: backward: %s", desc, kn, threads, attn_ctx_error(ctx));
      if (st) continue;
      double *gq = tu_to_f64(&dq), *gk = tu_to_f64(&dk), *gv = tu_to_f64(&dv), *gm = tu_to_f64(&dm), *gs = tu_to_f64(&ds);
      double e = tu_rel_l2(gq, ref_dq, nq);
      if (tu_rel_l2(gk, ref_dk, nk) > e) e = tu_rel_l2(gk, ref_dk, nk);
      if (tu_rel_l2(gv, ref_dv, nv) > e) e = tu_rel_l2(gv, ref_dv, nv);
      const int nan = tu_count_nan(gq, nq) + tu_count_nan(gk, nk) + tu_count_nan(gv, nv);
      note(kind, ERR_DQKV, e);
      CHECK(e <= TOL_BWD && nan == 0, "%s: %s threads %d: dq/dk/dv rel err %.3g, %d NaN", desc, kn, threads, e, nan);
      if (additive) {
        const double em = tu_rel_l2(gm, ref_dm, nw);
        note(kind, ERR_DMASK, em);
        CHECK(em <= TOL_BWD && tu_count_nan(gm, nw) == 0, "%s: %s threads %d: dmask rel err %.3g", desc, kn, threads, em);
      }
      if (c->sinks) {
        const double es = tu_rel_l2(gs, ref_ds, Hq);
        note(kind, ERR_DSINK, es);
        CHECK(es <= TOL_BWD && tu_count_nan(gs, Hq) == 0, "%s: %s threads %d: dsinks rel err %.3g", desc, kn, threads, es);
      }
      float *bits = arena_alloc(&a, (size_t)(ng + 1) * sizeof(float));
      int64_t at = 0;
      for (int64_t x = 0; x < nq; x++) bits[at++] = (float)gq[x];
      for (int64_t x = 0; x < nk; x++) bits[at++] = (float)gk[x];
      for (int64_t x = 0; x < nv; x++) bits[at++] = (float)gv[x];
      for (int64_t x = 0; additive && x < nw; x++) bits[at++] = (float)gm[x];
      for (int64_t x = 0; c->sinks && x < Hq; x++) bits[at++] = (float)gs[x];
      if (!first_g) first_g = bits;
      else CHECK(memcmp(first_g, bits, (size_t)ng * sizeof(float)) == 0,
                 "%s: %s: backward with %d threads changed the bits", desc, kn, threads);
      free(gq);
      free(gk);
      free(gv);
      free(gm);
      free(gs);
    }
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  attn_ctx_set_threads(ctx, 0);
  free(ref_o);
  free(ref_w);
  free(ref_l);
  free(ref_dq);
  free(ref_dk);
  free(ref_dv);
  free(ref_dm);
  free(ref_ds);
  arena_free(&a);
}

/* The chosen cases: windows below, at and above Nk, W = 1, Nq != Nk both ways,
 * Nk off the tile widths (16, 64), fully masked rows with sinks, everything at once. */
static void chosen_cases(attn_ctx *ctx) {
  const ocase base = {"base", 1, 2, 1, 37, 70, 16, 16, ATTN_CAUSAL_NONE, 0, 0, 0, 0, -1, 0, 0, 0, 0, 3.0, 0};
  ocase cs[40];
  int n = 0;
  ocase c;
  /* each option alone */
  c = base; c.name = "window 5"; c.window = 5; cs[n++] = c;
  c = base; c.name = "window 1"; c.window = 1; cs[n++] = c;
  c = base; c.name = "window = Nk, bottom-right"; c.window = 70; c.causal = ATTN_CAUSAL_BOTTOM_RIGHT; cs[n++] = c;
  c = base; c.name = "window > Nk"; c.window = 500; cs[n++] = c;
  c = base; c.name = "window 20, Nq > Nk, bottom-right"; c.Nq = 90; c.Nk = 45; c.window = 20;
  c.causal = ATTN_CAUSAL_BOTTOM_RIGHT; cs[n++] = c;
  c = base; c.name = "window 30, long keys, bottom-right"; c.Nq = 20; c.Nk = 200; c.window = 30;
  c.causal = ATTN_CAUSAL_BOTTOM_RIGHT; cs[n++] = c;
  c = base; c.name = "softcap 2"; c.softcap = 2.0; cs[n++] = c;
  c = base; c.name = "softcap 30, big logits"; c.softcap = 30.0; c.qamp = 20; cs[n++] = c;
  c = base; c.name = "alibi"; c.alibi = 1; c.Hq = 4; c.Hk = 2; cs[n++] = c;
  c = base; c.name = "alibi, bottom-right causal"; c.alibi = 1; c.causal = ATTN_CAUSAL_BOTTOM_RIGHT; cs[n++] = c;
  c = base; c.name = "sinks"; c.sinks = 1; cs[n++] = c;
  c = base; c.name = "sinks, dead rows"; c.sinks = 1; c.dead = 1; cs[n++] = c;
  c = base; c.name = "sinks, dead rows, additive"; c.sinks = 1; c.dead = 1; c.mask_mode = ATTN_MASK_ADDITIVE; cs[n++] = c;
  /* combined */
  c = base; c.name = "all, GQA, bottom-right, additive, kpm"; c.B = 2; c.Hq = 6; c.Hk = 2; c.Nq = 41; c.Nk = 77;
  c.window = 13; c.softcap = 5; c.alibi = 1; c.sinks = 1; c.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
  c.mask_mode = ATTN_MASK_ADDITIVE; c.kpm = 1; c.D = 24; c.Dv = 8; cs[n++] = c;
  c = base; c.name = "all, keep mask, dead rows, batch-first"; c.Hq = 4; c.Hk = 1; c.window = 9; c.softcap = 3;
  c.alibi = 1; c.sinks = 1; c.mask_mode = ATTN_MASK_KEEP; c.dead = 1; c.batch_first = 1; cs[n++] = c;
  c = base; c.name = "all, masked mask, dropout, W = 1"; c.window = 1; c.softcap = 4; c.alibi = 1; c.sinks = 1;
  c.mask_mode = ATTN_MASK_MASKED; c.kpm = 1; c.dropout = 0.2; cs[n++] = c;
  c = base; c.name = "dropout 1: every probability dropped"; c.dropout = 1.0; cs[n++] = c;
  c = base; c.name = "all, dropout 1, additive"; c.Hq = 4; c.Hk = 2; c.window = 7; c.softcap = 4; c.alibi = 1;
  c.sinks = 1; c.mask_mode = ATTN_MASK_ADDITIVE; c.kpm = 1; c.dropout = 1.0; cs[n++] = c;
  c = base; c.name = "all, window > Nk, top-left, Nq > Nk"; c.Nq = 80; c.Nk = 33; c.window = 100; c.softcap = 6;
  c.alibi = 1; c.sinks = 1; c.causal = ATTN_CAUSAL_TOP_LEFT; cs[n++] = c;
  /* large enough that the forward runs on several threads, with blocks of keys skipped */
  c = base; c.name = "all, threaded"; c.B = 1; c.Hq = 4; c.Hk = 2; c.Nq = 300; c.Nk = 310; c.D = 64; c.Dv = 64;
  c.window = 37; c.softcap = 8; c.alibi = 1; c.sinks = 1; c.causal = ATTN_CAUSAL_BOTTOM_RIGHT; c.kpm = 1; cs[n++] = c;
  c = base; c.name = "window, threaded"; c.B = 1; c.Hq = 4; c.Hk = 4; c.Nq = 300; c.Nk = 300; c.D = 64; c.Dv = 64;
  c.window = 64; cs[n++] = c;
  /* chunks: off and on the tile widths, 1, past Nk, with a window both narrower and wider, threaded */
  static const struct { const char *name; int64_t Nq, Nk, chunk, window; attn_causal causal; } chunks[] = {
      {"chunk 8", 37, 70, 8, 0, ATTN_CAUSAL_NONE},
      {"chunk 1", 37, 70, 1, 0, ATTN_CAUSAL_NONE},
      {"chunk 16, Nq > Nk, bottom-right", 90, 45, 16, 0, ATTN_CAUSAL_BOTTOM_RIGHT},
      {"chunk 23, long keys, bottom-right", 20, 200, 23, 0, ATTN_CAUSAL_BOTTOM_RIGHT},
      {"chunk > Nk", 37, 70, 500, 0, ATTN_CAUSAL_NONE},
      {"chunk 20, window 7", 37, 70, 20, 7, ATTN_CAUSAL_NONE}};
  for (size_t i = 0; i < sizeof chunks / sizeof chunks[0]; i++) {
    c = base, c.name = chunks[i].name, c.Nq = chunks[i].Nq, c.Nk = chunks[i].Nk, c.chunk = chunks[i].chunk;
    c.window = chunks[i].window, c.causal = chunks[i].causal, cs[n++] = c;
  }
  c = base; c.name = "all, chunk 24, window 40, GQA, kpm"; c.B = 2; c.Hq = 6; c.Hk = 2; c.Nq = 41; c.Nk = 77;
  c.chunk = 24; c.window = 40; c.softcap = 5; c.alibi = 1; c.sinks = 1; c.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
  c.kpm = 1; cs[n++] = c;
  c = base; c.name = "chunk 100, threaded"; c.B = 1; c.Hq = 4; c.Hk = 2; c.Nq = 300; c.Nk = 310; c.D = 64; c.Dv = 64;
  c.chunk = 100; c.causal = ATTN_CAUSAL_BOTTOM_RIGHT; cs[n++] = c;
  for (int i = 0; i < n; i++) check_case(ctx, &cs[i], 1000 + (uint64_t)i, 1);
}

static void random_cases(attn_ctx *ctx, int count) {
  for (int s = 0; s < count; s++) {
    tu_rng r = {77 + (uint64_t)s};
    ocase c;
    memset(&c, 0, sizeof c);
    c.name = "random";
    c.B = tu_int(&r, 1, 2);
    c.Hk = tu_int(&r, 1, 2);
    c.Hq = c.Hk * tu_int(&r, 1, 3);
    c.Nq = tu_int(&r, 1, 50);
    c.Nk = tu_int(&r, 1, 90);
    static const int64_t dims[] = {1, 8, 16, 17, 32};
    c.D = dims[tu_int(&r, 0, 4)];
    c.Dv = tu_int(&r, 0, 2) ? c.D : dims[tu_int(&r, 0, 4)];
    c.causal = (attn_causal)tu_int(&r, 0, 2);
    c.window = tu_int(&r, 0, 1) ? tu_int(&r, 1, c.Nk + 5) : 0;
    c.softcap = tu_int(&r, 0, 1) ? 0.5 + 10 * fabs(tu_uniform(&r)) : 0;
    c.alibi = (int)tu_int(&r, 0, 1);
    c.sinks = (int)tu_int(&r, 0, 1);
    c.mask_mode = (int)tu_int(&r, -1, 2);
    c.kpm = tu_int(&r, 0, 2) == 0;
    c.dead = tu_int(&r, 0, 3) == 0;
    c.dropout = tu_int(&r, 0, 4) == 0 ? 0.3 : 0;
    c.batch_first = (int)tu_int(&r, 0, 1);
    c.qamp = 1 + 4 * fabs(tu_uniform(&r));
    c.chunk = tu_int(&r, 0, 2) == 0 ? tu_int(&r, 1, c.Nk + 5) : 0; /* drawn last: the cases before keep theirs */
    check_case(ctx, &c, 5000 + (uint64_t)s, 1);
  }
}

/* ---- (a) the oracle against the header's words ------------------------------------- */
/* A plain loop over contiguous f64 inputs, written from the documentation alone. */
static void plain_attention(const ocase *c, const double *q, const double *k, const double *v, const float *slopes,
                            const float *sinks, double *out, double *lse) {
  const int64_t G = c->Hq / c->Hk;
  double *s = malloc((size_t)c->Nk * sizeof(double));
  for (int64_t b = 0; b < c->B; b++)
    for (int64_t h = 0; h < c->Hq; h++)
      for (int64_t i = 0; i < c->Nq; i++) {
        const int64_t ip = c->causal == ATTN_CAUSAL_BOTTOM_RIGHT ? i + c->Nk - c->Nq : i;
        const int causal = c->causal != ATTN_CAUSAL_NONE || c->window > 0 || c->chunk > 0;
        double m = sinks ? sinks[h] : -INFINITY;
        for (int64_t j = 0; j < c->Nk; j++) {
          const int seen = (!causal || j <= ip) && (c->window <= 0 || j > ip - c->window) &&
                           (c->chunk <= 0 || (ip >= 0 && j / c->chunk == ip / c->chunk));
          double x = 0;
          for (int64_t d = 0; d < c->D; d++)
            x += q[((b * c->Hq + h) * c->Nq + i) * c->D + d] * k[((b * c->Hk + h / G) * c->Nk + j) * c->D + d];
          x /= sqrt((double)c->D);
          if (c->softcap > 0) x = c->softcap * tanh(x / c->softcap);
          if (slopes) x += slopes[h] * (double)(j - ip);
          s[j] = seen ? x : -INFINITY;
          if (s[j] > m) m = s[j];
        }
        double sum = sinks && m > -INFINITY ? exp(sinks[h] - m) : 0;
        for (int64_t j = 0; j < c->Nk; j++) sum += s[j] == -INFINITY ? 0 : exp(s[j] - m);
        for (int64_t e = 0; e < c->Dv; e++) {
          double acc = 0;
          for (int64_t j = 0; j < c->Nk; j++)
            if (s[j] != -INFINITY) acc += exp(s[j] - m) / sum * v[((b * c->Hk + h / G) * c->Nk + j) * c->Dv + e];
          out[((b * c->Hq + h) * c->Nq + i) * c->Dv + e] = acc;
        }
        lse[(b * c->Hq + h) * c->Nq + i] = sum > 0 ? m + log(sum) : -INFINITY;
      }
  free(s);
}

static void oracle_vs_plain(attn_ctx *ctx) {
  static const ocase cases[] = {
      {"plain: window", 2, 2, 1, 9, 13, 5, 4, ATTN_CAUSAL_NONE, 4, 0, 0, 0, -1, 0, 0, 0, 0, 2, 0},
      {"plain: window, bottom-right", 1, 2, 2, 6, 15, 5, 3, ATTN_CAUSAL_BOTTOM_RIGHT, 3, 0, 0, 0, -1, 0, 0, 0, 0, 2, 0},
      {"plain: softcap", 1, 3, 1, 7, 8, 4, 4, ATTN_CAUSAL_NONE, 0, 1.5, 0, 0, -1, 0, 0, 0, 0, 4, 0},
      {"plain: alibi, bottom-right", 1, 4, 2, 5, 9, 4, 4, ATTN_CAUSAL_BOTTOM_RIGHT, 0, 0, 1, 0, -1, 0, 0, 0, 0, 2, 0},
      {"plain: sinks", 2, 2, 1, 6, 7, 3, 5, ATTN_CAUSAL_TOP_LEFT, 0, 0, 0, 1, -1, 0, 0, 0, 0, 2, 0},
      {"plain: all, Nq > Nk", 1, 2, 1, 11, 6, 4, 4, ATTN_CAUSAL_BOTTOM_RIGHT, 2, 2.5, 1, 1, -1, 0, 0, 0, 0, 3, 0},
      {"plain: chunk", 2, 2, 1, 9, 13, 5, 4, ATTN_CAUSAL_NONE, 0, 0, 0, 0, -1, 0, 0, 0, 0, 2, 4},
      {"plain: chunk, window, bottom-right", 1, 2, 2, 7, 15, 5, 3, ATTN_CAUSAL_BOTTOM_RIGHT, 4, 0, 1, 0, -1, 0, 0, 0, 0,
       2, 5},
      {"plain: chunk, Nq > Nk", 1, 2, 1, 11, 6, 4, 4, ATTN_CAUSAL_BOTTOM_RIGHT, 0, 2.5, 0, 1, -1, 0, 0, 0, 0, 3, 3},
  };
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    const ocase *c = &cases[ci];
    arena a = {{0}, 0};
    problem pb;
    make_problem(&a, &pb, c, 300 + ci, ATTN_F64);
    const int64_t os[4] = {c->B, c->Hq, c->Nq, c->Dv}, ls[3] = {c->B, c->Hq, c->Nq};
    const int64_t no = c->B * c->Hq * c->Nq * c->Dv, nl = c->B * c->Hq * c->Nq;
    tu_rng r = {1};
    attn_tensor out = make4(&a, &r, os, ATTN_F64, 0, 0);
    attn_tensor lse = attn_tensor_view(arena_alloc(&a, (size_t)nl * sizeof(double)), ATTN_F64, 3, ls);
    attn_sdpa_opts o = pb.o;
    CHECK_OK(ctx, attn_sdpa_ref(ctx, &out, &lse, NULL, &pb.q, &pb.k, &pb.v, &o));
    double *po = malloc((size_t)no * sizeof(double)), *pl = malloc((size_t)nl * sizeof(double));
    plain_attention(c, pb.q.data, pb.k.data, pb.v.data, c->alibi ? pb.slopes.data : NULL,
                    c->sinks ? pb.sinks.data : NULL, po, pl);
    const double eo = tu_rel_l2(out.data, po, no), el = lse_err(lse.data, pl, nl);
    CHECK(eo <= 1e-13 && el <= 1e-13, "%s: the oracle vs a plain loop: out %.3g lse %.3g", c->name, eo, el);
    free(po);
    free(pl);
    arena_free(&a);
  }
}

/* dropout_p = 1 in the oracle, as PyTorch defines it: every probability dropped, so out,
 * the weights and dq, dk, dv are 0 (not 0 * inf), while lse stays the softmax's. */
static void dropout_one_oracle(attn_ctx *ctx) {
  const ocase c = {"dropout 1", 1, 2, 1, 5, 7, 4, 3, ATTN_CAUSAL_TOP_LEFT, 0, 0, 0, 1, -1, 0, 0, 1.0, 0, 2, 0};
  arena a = {{0}, 0};
  problem pb;
  make_problem(&a, &pb, &c, 77, ATTN_F64);
  const int64_t os[4] = {1, 2, 5, 3}, ws[4] = {1, 2, 5, 7}, ls[3] = {1, 2, 5};
  const int64_t qs[4] = {1, 2, 5, 4}, ks[4] = {1, 1, 7, 4}, vs[4] = {1, 1, 7, 3};
  tu_rng r = {2};
  attn_tensor out = make4(&a, &r, os, ATTN_F64, 0, 1), w = make4(&a, &r, ws, ATTN_F64, 0, 1);
  attn_tensor lse = attn_tensor_view(arena_alloc(&a, 10 * sizeof(double)), ATTN_F64, 3, ls);
  attn_tensor lse0 = attn_tensor_view(arena_alloc(&a, 10 * sizeof(double)), ATTN_F64, 3, ls);
  attn_tensor dq = make4(&a, &r, qs, ATTN_F64, 0, 1), dk = make4(&a, &r, ks, ATTN_F64, 0, 1);
  attn_tensor dv = make4(&a, &r, vs, ATTN_F64, 0, 1), ds = make_vec(&a, 2, ATTN_F32);
  attn_sdpa_opts o = pb.o;
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &out, &lse, &w, &pb.q, &pb.k, &pb.v, &o));
  o.dropout_p = 0;
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &out, &lse0, NULL, &pb.q, &pb.k, &pb.v, &o));
  o = pb.o;
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &out, NULL, NULL, &pb.q, &pb.k, &pb.v, &o));
  CHECK_OK(ctx, attn_sdpa_backward_ref(ctx, &dq, &dk, &dv, NULL, &ds, &pb.G, &pb.q, &pb.k, &pb.v, &out, &lse, &o));
  int zero = 1, same_lse = 1;
  for (int e = 0; e < 30; e++) zero &= ((double *)out.data)[e] == 0;
  for (int e = 0; e < 70; e++) zero &= ((double *)w.data)[e] == 0;
  for (int e = 0; e < 40; e++) zero &= ((double *)dq.data)[e] == 0;
  for (int e = 0; e < 28; e++) zero &= ((double *)dk.data)[e] == 0;
  for (int e = 0; e < 21; e++) zero &= ((double *)dv.data)[e] == 0;
  for (int e = 0; e < 2; e++) zero &= ((float *)ds.data)[e] == 0;
  for (int e = 0; e < 10; e++) same_lse &= ((double *)lse.data)[e] == ((double *)lse0.data)[e];
  CHECK(zero, "dropout 1: the oracle's out, weights and gradients must be 0");
  CHECK(same_lse, "dropout 1: lse must stay the softmax's");
  o.dropout_p = 1.0000001;
  CHECK(attn_sdpa_ref(ctx, &out, NULL, NULL, &pb.q, &pb.k, &pb.v, &o) == ATTN_E_INVALID, "dropout_p > 1 accepted");
  arena_free(&a);
}

/* out and lse of attn_sdpa(q, k, v, o) and attn_sdpa(q, kb, vb, m) agree within tol. */
static void same_as(attn_ctx *ctx, const char *kn, const char *what, double tol, const problem *pb, const attn_sdpa_opts *o,
                    const attn_sdpa_opts *m, const attn_tensor *kb, const attn_tensor *vb, attn_tensor *oa,
                    attn_tensor *ob, attn_tensor *la, attn_tensor *lb) {
  CHECK_OK(ctx, attn_sdpa(ctx, oa, la, NULL, &pb->q, &pb->k, &pb->v, o));
  CHECK_OK(ctx, attn_sdpa(ctx, ob, lb, NULL, &pb->q, kb, vb, m));
  double *x = tu_to_f64(oa), *y = tu_to_f64(ob), *lx = tu_to_f64(la), *ly = tu_to_f64(lb);
  const double e = tu_rel_l2(x, y, attn_tensor_numel(oa)), el = lse_err(lx, ly, attn_tensor_numel(la));
  CHECK(e <= tol && el <= tol, "%s: %s: out %.3g lse %.3g", kn, what, e, el);
  free(x), free(y), free(lx), free(ly);
}

/* The options through older features, on the oracle and on every kernel:
 * window = boolean band mask, ALiBi = additive mask, sink = an extra key of value 0. */
static void options_as_masks(attn_ctx *ctx) {
  arena a = {{0}, 0};
  const ocase c = {"as masks", 2, 3, 1, 29, 83, 16, 8, ATTN_CAUSAL_BOTTOM_RIGHT, 11, 0, 1, 1, -1, 0, 0, 0, 0, 3, 0};
  problem pb;
  make_problem(&a, &pb, &c, 42, ATTN_F32);
  const int64_t B = c.B, Hq = c.Hq, Nq = c.Nq, Nk = c.Nk, D = c.D, Dv = c.Dv, sh = Nk - Nq;
  const int64_t os[4] = {B, Hq, Nq, Dv}, ls[3] = {B, Hq, Nq}, ms[4] = {B, Hq, Nq, Nk};
  const int64_t ms1[4] = {B, Hq, Nq, Nk + 1}, ks1[4] = {B, c.Hk, Nk + 1, D}, vs1[4] = {B, c.Hk, Nk + 1, Dv};
  const int64_t nl = B * Hq * Nq;
  tu_rng r = {9};
  /* band: j in (i' - W, i'] as a KEEP mask with causal off; ALiBi folded into an additive mask;
   * chunks: j <= i' and j / C = i' / C as a KEEP mask */
  const int64_t C = 16;
  attn_tensor band = make4(&a, &r, ms, ATTN_BOOL, 0, 0), bias = make4(&a, &r, ms, ATTN_F32, 0, 0);
  attn_tensor chunks = make4(&a, &r, ms, ATTN_BOOL, 0, 0);
  /* the sink as key Nk: k = 0, v = 0, the additive mask puts the sink there */
  attn_tensor k1 = make4(&a, &r, ks1, ATTN_F32, 0, 0), v1 = make4(&a, &r, vs1, ATTN_F32, 0, 0);
  attn_tensor bias1 = make4(&a, &r, ms1, ATTN_F32, 0, 0);
  for (int64_t b = 0; b < B; b++)
    for (int64_t g = 0; g < c.Hk; g++)
      for (int64_t j = 0; j < Nk; j++) {
        for (int64_t d = 0; d < D; d++) tset(&k1, off4(&k1, b, g, j, d), tget(&pb.k, off4(&pb.k, b, g, j, d)));
        for (int64_t d = 0; d < Dv; d++) tset(&v1, off4(&v1, b, g, j, d), tget(&pb.v, off4(&pb.v, b, g, j, d)));
      }
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < Hq; h++)
      for (int64_t i = 0; i < Nq; i++) {
        const int64_t ip = i + sh;
        for (int64_t j = 0; j < Nk; j++) {
          const int in = j <= ip && j > ip - c.window;
          const double al = ((float *)pb.slopes.data)[h] * (float)(j - ip);
          tset(&band, off4(&band, b, h, i, j), in);
          tset(&chunks, off4(&chunks, b, h, i, j), j <= ip && j / C == ip / C);
          tset(&bias, off4(&bias, b, h, i, j), in ? al : -INFINITY);
          tset(&bias1, off4(&bias1, b, h, i, j), in ? al : -INFINITY);
        }
        tset(&bias1, off4(&bias1, b, h, i, Nk), ((float *)pb.sinks.data)[h]);
      }
  attn_tensor lse_a = attn_tensor_view(arena_alloc(&a, (size_t)nl * 4), ATTN_F32, 3, ls);
  attn_tensor lse_b = attn_tensor_view(arena_alloc(&a, (size_t)nl * 4), ATTN_F32, 3, ls);
  for (int kk = 0; kk < 4; kk++) {
    const attn_kernel kern = kk == 0 ? ATTN_KERNEL_REF : kernels[kk - 1];
    if (!attn_kernel_supported(kern)) continue;
    CHECK_OK(ctx, attn_ctx_set_kernel(ctx, kern));
    const char *kn = attn_kernel_name(kern);
    attn_tensor oa = make4(&a, &r, os, ATTN_F32, 0, 0), ob = make4(&a, &r, os, ATTN_F32, 0, 0);
    attn_sdpa_opts o, m;
    /* window alone vs the band */
    attn_sdpa_opts_init(&o), attn_sdpa_opts_init(&m);
    o.causal = ATTN_CAUSAL_BOTTOM_RIGHT, o.window = c.window;
    m.mask = &band, m.mask_mode = ATTN_MASK_KEEP;
    same_as(ctx, kn, "window vs a band mask", 1e-6, &pb, &o, &m, &pb.k, &pb.v, &oa, &ob, &lse_a, &lse_b);
    /* chunk alone vs its mask */
    attn_sdpa_opts_init(&o);
    o.causal = ATTN_CAUSAL_BOTTOM_RIGHT, o.chunk = C;
    m.mask = &chunks;
    same_as(ctx, kn, "chunk vs a mask of chunks", 1e-6, &pb, &o, &m, &pb.k, &pb.v, &oa, &ob, &lse_a, &lse_b);
    /* window + ALiBi vs the band with the bias added */
    attn_sdpa_opts_init(&o);
    o.causal = ATTN_CAUSAL_BOTTOM_RIGHT, o.window = c.window, o.alibi_slopes = &pb.slopes;
    m.mask = &bias, m.mask_mode = ATTN_MASK_ADDITIVE;
    same_as(ctx, kn, "ALiBi vs an additive mask", 1e-5, &pb, &o, &m, &pb.k, &pb.v, &oa, &ob, &lse_a, &lse_b);
    /* window + ALiBi + sinks vs one more key */
    o.sinks = &pb.sinks;
    m.mask = &bias1;
    same_as(ctx, kn, "sinks vs an extra key", 1e-5, &pb, &o, &m, &k1, &v1, &oa, &ob, &lse_a, &lse_b);
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  arena_free(&a);
}

/* A row with every key masked: zeros, lse = sink, weights zero, zero gradients (every kernel). */
static void dead_rows_with_sinks(attn_ctx *ctx) {
  const int64_t Hq = 2, N = 20, D = 8, s4[4] = {1, Hq, N, D}, ws[4] = {1, Hq, N, N}, ls[3] = {1, Hq, N};
  arena a = {{0}, 0};
  tu_rng r = {5};
  attn_tensor q = make4(&a, &r, s4, ATTN_F32, 0, 1), k = make4(&a, &r, s4, ATTN_F32, 0, 1), v = make4(&a, &r, s4, ATTN_F32, 0, 1);
  attn_tensor G = make4(&a, &r, s4, ATTN_F32, 0, 1);
  attn_tensor kpm = attn_tensor_view(arena_alloc(&a, N), ATTN_BOOL, 2, (const int64_t[2]){1, N});
  for (int64_t j = 0; j < 5; j++) ((uint8_t *)kpm.data)[j] = 1; /* keys 0..4 padded: rows 0..4 see nothing (causal) */
  attn_tensor sinks = make_vec(&a, Hq, ATTN_F32), sg = make_vec(&a, Hq, ATTN_F32);
  ((float *)sinks.data)[0] = 0.75f;
  ((float *)sinks.data)[1] = -1.25f;
  for (int kk = 0; kk < 4; kk++) {
    const attn_kernel kern = kk == 0 ? ATTN_KERNEL_REF : kernels[kk - 1];
    if (!attn_kernel_supported(kern)) continue;
    CHECK_OK(ctx, attn_ctx_set_kernel(ctx, kern));
    attn_tensor out = make4(&a, &r, s4, ATTN_F32, 0, 0), w = make4(&a, &r, ws, ATTN_F32, 0, 0);
    attn_tensor l = attn_tensor_view(arena_alloc(&a, (size_t)(Hq * N) * 4), ATTN_F32, 3, ls);
    attn_tensor dq = make4(&a, &r, s4, ATTN_F32, 0, 0), dk = make4(&a, &r, s4, ATTN_F32, 0, 0), dv = make4(&a, &r, s4, ATTN_F32, 0, 0);
    poison(&out), poison(&w), poison(&l), poison(&dq), poison(&dk), poison(&dv), poison(&sg);
    attn_sdpa_opts o;
    attn_sdpa_opts_init(&o);
    o.causal = ATTN_CAUSAL_TOP_LEFT;
    o.window = 6;
    o.key_padding = &kpm;
    o.sinks = &sinks;
    CHECK_OK(ctx, attn_sdpa(ctx, &out, &l, &w, &q, &k, &v, &o));
    int bad = 0;
    for (int64_t h = 0; h < Hq; h++)
      for (int64_t i = 0; i < 5; i++) {
        bad += ((float *)l.data)[h * N + i] != ((float *)sinks.data)[h];
        for (int64_t d = 0; d < D; d++) bad += ((float *)out.data)[(h * N + i) * D + d] != 0;
        for (int64_t j = 0; j < N; j++) bad += ((float *)w.data)[(h * N + i) * N + j] != 0;
      }
    CHECK(bad == 0, "%s: fully masked rows with sinks: %d values are not zeros / lse = sink", attn_kernel_name(kern), bad);
    CHECK_OK(ctx, attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, &sg, &G, &q, &k, &v, &out, &l, &o));
    bad = 0;
    for (int64_t h = 0; h < Hq; h++)
      for (int64_t i = 0; i < 5; i++)
        for (int64_t d = 0; d < D; d++) bad += ((float *)dq.data)[(h * N + i) * D + d] != 0;
    for (int64_t h = 0; h < Hq; h++)
      for (int64_t j = 0; j < 5; j++)
        for (int64_t d = 0; d < D; d++) bad += ((float *)dk.data)[(h * N + j) * D + d] != 0;
    bad += !isfinite(((float *)sg.data)[0]) || !isfinite(((float *)sg.data)[1]);
    CHECK(bad == 0, "%s: fully masked rows with sinks: %d gradients not zero (or dsinks not finite)",
          attn_kernel_name(kern), bad);
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  arena_free(&a);
}

/* ---- (b) the oracle backward against finite differences --------------------------- */
/* L = sum(out * G) by the oracle in double. */
static double loss(attn_ctx *ctx, const problem *pb, const ocase *c, attn_tensor *out) {
  attn_sdpa_opts o = pb->o;
  if (attn_sdpa_ref(ctx, out, NULL, NULL, &pb->q, &pb->k, &pb->v, &o) != ATTN_OK) return NAN;
  double L = 0;
  const double *od = out->data, *g = pb->G.data;
  for (int64_t e = 0; e < c->B * c->Hq * c->Nq * c->Dv; e++) L += od[e] * g[e];
  return L;
}

/* Central differences on every element of a contiguous f64 tensor against an analytic gradient. */
static double fd_err(attn_ctx *ctx, const problem *pb, const ocase *c, attn_tensor *out, double *x, int64_t n,
                     const double *grad) {
  const double h = 1e-6;
  double num = 0, den = 0;
  for (int64_t e = 0; e < n; e++) {
    const double x0 = x[e];
    x[e] = x0 + h;
    const double lp = loss(ctx, pb, c, out);
    x[e] = x0 - h;
    const double lm = loss(ctx, pb, c, out);
    x[e] = x0;
    const double fd = (lp - lm) / (2 * h), d = fd - grad[e];
    num += d * d;
    den += fd * fd;
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void finite_differences(attn_ctx *ctx) {
  static const ocase cases[] = {
      {"fd: window", 1, 2, 1, 6, 9, 4, 3, ATTN_CAUSAL_BOTTOM_RIGHT, 3, 0, 0, 0, -1, 0, 0, 0, 0, 2, 0},
      {"fd: softcap", 1, 2, 1, 5, 7, 4, 3, ATTN_CAUSAL_NONE, 0, 1.2, 0, 0, ATTN_MASK_ADDITIVE, 0, 0, 0, 0, 3, 0},
      {"fd: alibi", 1, 2, 2, 5, 6, 3, 4, ATTN_CAUSAL_TOP_LEFT, 0, 0, 1, 0, ATTN_MASK_ADDITIVE, 0, 0, 0, 0, 2, 0},
      {"fd: sinks", 2, 2, 1, 4, 6, 3, 3, ATTN_CAUSAL_NONE, 0, 0, 0, 1, -1, 0, 0, 0, 0, 2, 0},
      {"fd: sinks, dead rows", 1, 2, 1, 5, 6, 3, 3, ATTN_CAUSAL_NONE, 0, 0, 0, 1, -1, 0, 1, 0, 0, 2, 0},
      {"fd: all", 1, 4, 2, 7, 9, 4, 3, ATTN_CAUSAL_BOTTOM_RIGHT, 4, 1.5, 1, 1, ATTN_MASK_ADDITIVE, 1, 0, 0, 0, 3, 0},
      {"fd: chunk", 1, 2, 1, 7, 9, 4, 3, ATTN_CAUSAL_BOTTOM_RIGHT, 0, 1.5, 1, 1, -1, 0, 0, 0, 0, 3, 3},
  };
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    const ocase *c = &cases[ci];
    arena a = {{0}, 0};
    problem pb;
    make_problem(&a, &pb, c, 900 + ci, ATTN_F64);
    const int64_t os[4] = {c->B, c->Hq, c->Nq, c->Dv}, ls[3] = {c->B, c->Hq, c->Nq}, ms[4] = {c->B, c->Hq, c->Nq, c->Nk};
    const int64_t qs[4] = {c->B, c->Hq, c->Nq, c->D}, ks[4] = {c->B, c->Hk, c->Nk, c->D}, vs[4] = {c->B, c->Hk, c->Nk, c->Dv};
    tu_rng r = {3};
    attn_tensor out = make4(&a, &r, os, ATTN_F64, 0, 0), tmp = make4(&a, &r, os, ATTN_F64, 0, 0);
    attn_tensor lse = attn_tensor_view(arena_alloc(&a, (size_t)(c->B * c->Hq * c->Nq) * 8), ATTN_F64, 3, ls);
    attn_tensor dq = make4(&a, &r, qs, ATTN_F64, 0, 0), dk = make4(&a, &r, ks, ATTN_F64, 0, 0);
    attn_tensor dv = make4(&a, &r, vs, ATTN_F64, 0, 0), dm = make4(&a, &r, ms, ATTN_F64, 0, 0);
    attn_tensor ds = make_vec(&a, c->Hq, ATTN_F32);
    const int additive = pb.has_mask && pb.o.mask_mode == ATTN_MASK_ADDITIVE;
    attn_sdpa_opts o = pb.o;
    CHECK_OK(ctx, attn_sdpa_ref(ctx, &out, &lse, NULL, &pb.q, &pb.k, &pb.v, &o));
    o = pb.o;
    CHECK_OK(ctx, attn_sdpa_backward_ref(ctx, &dq, &dk, &dv, additive ? &dm : NULL, c->sinks ? &ds : NULL, &pb.G, &pb.q,
                                         &pb.k, &pb.v, &out, &lse, &o));
    const double eq = fd_err(ctx, &pb, c, &tmp, pb.q.data, attn_tensor_numel(&pb.q), dq.data);
    const double ek = fd_err(ctx, &pb, c, &tmp, pb.k.data, attn_tensor_numel(&pb.k), dk.data);
    const double ev = fd_err(ctx, &pb, c, &tmp, pb.v.data, attn_tensor_numel(&pb.v), dv.data);
    CHECK(eq <= TOL_FD && ek <= TOL_FD && ev <= TOL_FD, "%s: finite differences: dq %.3g dk %.3g dv %.3g", c->name, eq,
          ek, ev);
    if (additive) {
      /* only where the mask is finite: a -inf entry has no difference to take */
      double num = 0, den = 0;
      double *m = pb.mask.data;
      for (int64_t e = 0; e < attn_tensor_numel(&pb.mask); e++) {
        if (!isfinite(m[e])) continue;
        const double m0 = m[e];
        m[e] = m0 + 1e-6;
        const double lp = loss(ctx, &pb, c, &tmp);
        m[e] = m0 - 1e-6;
        const double lm = loss(ctx, &pb, c, &tmp);
        m[e] = m0;
        const double fd = (lp - lm) / 2e-6, d = fd - ((double *)dm.data)[e];
        num += d * d;
        den += fd * fd;
      }
      const double em = den > 0 ? sqrt(num / den) : sqrt(num);
      CHECK(em <= TOL_FD, "%s: finite differences: dmask %.3g", c->name, em);
    }
    if (c->sinks) {
      /* sinks are f32: the step is what f32 can hold, measured exactly */
      float *s = pb.sinks.data;
      double num = 0, den = 0;
      for (int64_t h = 0; h < c->Hq; h++) {
        const float s0 = s[h], sp = s0 + 1e-3f, sm = s0 - 1e-3f;
        s[h] = sp;
        const double lp = loss(ctx, &pb, c, &tmp);
        s[h] = sm;
        const double lm = loss(ctx, &pb, c, &tmp);
        s[h] = s0;
        const double fd = (lp - lm) / ((double)sp - (double)sm), d = fd - ((float *)ds.data)[h];
        num += d * d;
        den += fd * fd;
      }
      /* the f32 gradient and the O(step^2) error of the difference */
      const double es = den > 0 ? sqrt(num / den) : sqrt(num);
      CHECK(es <= 1e-5, "%s: finite differences: dsinks %.3g", c->name, es);
    }
    arena_free(&a);
  }
}

/* ---- (d) slopes and argument checks ----------------------------------------------- */
static void alibi_slopes(void) {
  float s[16];
  CHECK(attn_alibi_slopes(s, 8) == ATTN_OK, "8 heads");
  for (int h = 0; h < 8; h++)
    CHECK(s[h] == (float)pow(2.0, -(h + 1)), "8 heads: slope %d is %.9g, want 2^-%d", h, s[h], h + 1);
  CHECK(attn_alibi_slopes(s, 12) == ATTN_OK, "12 heads");
  static const double want12[12] = {-1, -2, -3, -4, -5, -6, -7, -8, -0.5, -1.5, -2.5, -3.5};
  for (int h = 0; h < 12; h++)
    CHECK(s[h] == (float)pow(2.0, want12[h]), "12 heads: slope %d is %.9g, want 2^%g", h, s[h], want12[h]);
  CHECK(attn_alibi_slopes(s, 1) == ATTN_OK && s[0] == (float)pow(2.0, -8), "1 head: %.9g", s[0]);
  CHECK(attn_alibi_slopes(NULL, 8) == ATTN_E_INVALID, "NULL slopes");
  CHECK(attn_alibi_slopes(s, 0) == ATTN_E_INVALID, "0 heads");
}

/* The fp32 kernels' tanh: a dense sweep against tanh in double, the special values,
 * and the tile helper's cap and slope. */
static void fast_tanh(void) {
  double tworst = 0, at = 0;
  for (double x = -30; x <= 30; x += 3e-5) {
    const float xf = (float)x;
    const double want = tanh((double)xf), got = attn__tanhf(xf);
    const double e = want == 0 ? fabs(got) : fabs(got - want) / fabs(want);
    if (!(e <= tworst)) tworst = e, at = xf;
  }
  for (float x = 1e-30f; x < 1; x *= 1.003f) {
    const double e = fabs(attn__tanhf(x) - tanh((double)x)) / tanh((double)x);
    if (!(e <= tworst)) tworst = e, at = x;
  }
  CHECK(tworst <= 5e-7, "fast tanh: relative error %.3g at %.9g", tworst, at);
  CHECK(attn__tanhf(INFINITY) == 1 && attn__tanhf(-INFINITY) == -1 && attn__tanhf(1e30f) == 1 &&
            attn__tanhf(-1e30f) == -1 && isnan(attn__tanhf(NAN)) && attn__tanhf(0.0f) == 0 &&
            signbit(attn__tanhf(-0.0f)),
        "fast tanh: special values");
  float S[150], slope[150];
  for (int i = 0; i < 150; i++) S[i] = (float)(i - 75) * 0.37f;
  attn__cap_tanh(S, slope, 150, 7.5f);
  double es = 0, ed = 0;
  for (int i = 0; i < 150; i++) {
    const double t = tanh((double)((float)(i - 75) * 0.37f) / 7.5);
    es = fmax(es, fabs(S[i] - 7.5 * t) / 7.5);
    ed = fmax(ed, fabs(slope[i] - (1 - t * t)));
  }
  CHECK(es <= 5e-7 && ed <= 1e-6, "softcap tile: cap error %.3g, slope error %.3g", es, ed);
}

static void argument_checks(attn_ctx *ctx) {
  arena a = {{0}, 0};
  tu_rng r = {11};
  const int64_t s4[4] = {1, 2, 5, 4}, ls[3] = {1, 2, 5};
  attn_tensor q = make4(&a, &r, s4, ATTN_F32, 0, 1), k = make4(&a, &r, s4, ATTN_F32, 0, 1), v = make4(&a, &r, s4, ATTN_F32, 0, 1);
  attn_tensor out = make4(&a, &r, s4, ATTN_F32, 0, 0), G = make4(&a, &r, s4, ATTN_F32, 0, 1);
  attn_tensor dq = make4(&a, &r, s4, ATTN_F32, 0, 0), dk = make4(&a, &r, s4, ATTN_F32, 0, 0), dv = make4(&a, &r, s4, ATTN_F32, 0, 0);
  attn_tensor lse = attn_tensor_view(arena_alloc(&a, 40), ATTN_F32, 3, ls);
  attn_tensor two = make_vec(&a, 2, ATTN_F32), three = make_vec(&a, 3, ATTN_F32), two64 = make_vec(&a, 2, ATTN_F64);
  attn_sdpa_opts o;
#define EXPECT(call, want, what)                                                                            \
  do {                                                                                                      \
    const attn_status st_ = (call);                                                                         \
    CHECK(st_ == (want) && attn_ctx_error(ctx)[0] != '\0', "%s: got %s (%s), want %s", what, attn_strerror(st_), \
          attn_ctx_error(ctx), attn_strerror(want));                                                        \
  } while (0)
  for (int kk = 0; kk < 2; kk++) {
    CHECK_OK(ctx, attn_ctx_set_kernel(ctx, kk ? ATTN_KERNEL_AUTO : ATTN_KERNEL_REF));
    attn_sdpa_opts_init(&o); o.window = -1;
    EXPECT(attn_sdpa(ctx, &out, NULL, NULL, &q, &k, &v, &o), ATTN_E_INVALID, "negative window");
    attn_sdpa_opts_init(&o); o.chunk = -3;
    EXPECT(attn_sdpa(ctx, &out, NULL, NULL, &q, &k, &v, &o), ATTN_E_INVALID, "negative chunk");
    attn_sdpa_opts_init(&o); o.softcap = -1;
    EXPECT(attn_sdpa(ctx, &out, NULL, NULL, &q, &k, &v, &o), ATTN_E_INVALID, "negative softcap");
    attn_sdpa_opts_init(&o); o.softcap = NAN;
    EXPECT(attn_sdpa(ctx, &out, NULL, NULL, &q, &k, &v, &o), ATTN_E_INVALID, "NaN softcap");
    attn_sdpa_opts_init(&o); o.softcap = INFINITY;
    EXPECT(attn_sdpa(ctx, &out, NULL, NULL, &q, &k, &v, &o), ATTN_E_INVALID, "infinite softcap");
    attn_sdpa_opts_init(&o); o.alibi_slopes = &three;
    EXPECT(attn_sdpa(ctx, &out, NULL, NULL, &q, &k, &v, &o), ATTN_E_SHAPE, "3 slopes for 2 heads");
    attn_sdpa_opts_init(&o); o.alibi_slopes = &two64;
    EXPECT(attn_sdpa(ctx, &out, NULL, NULL, &q, &k, &v, &o), ATTN_E_DTYPE, "f64 slopes");
    attn_sdpa_opts_init(&o); o.sinks = &three;
    EXPECT(attn_sdpa(ctx, &out, NULL, NULL, &q, &k, &v, &o), ATTN_E_SHAPE, "3 sinks for 2 heads");
    attn_sdpa_opts_init(&o); o.q_offset = -1;
    EXPECT(attn_sdpa(ctx, &out, NULL, NULL, &q, &k, &v, &o), ATTN_E_INVALID, "negative q_offset");
    attn_sdpa_opts_init(&o); o.k_offset = ((int64_t)1 << 48) + 1;
    EXPECT(attn_sdpa(ctx, &out, NULL, NULL, &q, &k, &v, &o), ATTN_E_INVALID, "k_offset past 2^48");
    attn_sdpa_opts_init(&o); o.head_offset = -2;
    EXPECT(attn_sdpa(ctx, &out, NULL, NULL, &q, &k, &v, &o), ATTN_E_INVALID, "negative head_offset");
    attn_sdpa_opts_init(&o); o.head_offset = ((int64_t)1 << 31) + 1;
    EXPECT(attn_sdpa(ctx, &out, NULL, NULL, &q, &k, &v, &o), ATTN_E_INVALID, "head_offset past 2^31");
    {
      const int64_t cu[2] = {0, 5};
      attn_sdpa_opts_init(&o); o.cu_seqlens_q = cu, o.num_seqs = 1, o.q_offset = 3;
      EXPECT(attn_sdpa(ctx, &out, NULL, NULL, &q, &k, &v, &o), ATTN_E_UNSUPPORTED, "q_offset in a packed batch");
    }
    attn_sdpa_opts_init(&o);
    CHECK_OK(ctx, attn_sdpa(ctx, &out, &lse, NULL, &q, &k, &v, &o));
    attn_sdpa_opts_init(&o);
    EXPECT(attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, &two, &G, &q, &k, &v, &out, &lse, &o), ATTN_E_INVALID,
           "sinks_grad without sinks");
    attn_sdpa_opts_init(&o);
    o.sinks = &two;
    EXPECT(attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, &three, &G, &q, &k, &v, &out, &lse, &o), ATTN_E_SHAPE,
           "3 sinks_grad for 2 heads");
    /* the oracle writes f64 gradients, the sinks' too (it refused an f64 sinks_grad before fuzz_sdpa.c
     * asked); the fp32 backward writes f32 */
    CHECK_OK(ctx, attn_sdpa(ctx, &out, &lse, NULL, &q, &k, &v, &o));
    double sg64[2] = {NAN, NAN};
    float sg32[2] = {NAN, NAN};
    const int64_t nh = 2;
    attn_tensor tsg64 = attn_tensor_view(sg64, ATTN_F64, 1, &nh), tsg32 = attn_tensor_view(sg32, ATTN_F32, 1, &nh);
    CHECK_OK(ctx, attn_sdpa_backward_ref(ctx, &dq, &dk, &dv, NULL, &tsg64, &G, &q, &k, &v, &out, &lse, &o));
    CHECK_OK(ctx, attn_sdpa_backward_ref(ctx, &dq, &dk, &dv, NULL, &tsg32, &G, &q, &k, &v, &out, &lse, &o));
    CHECK(sg64[0] != 0 && (float)sg64[0] == sg32[0] && (float)sg64[1] == sg32[1],
          "the oracle's sinks_grad in f64 (%.9g %.9g) and in f32 (%.9g %.9g)", sg64[0], sg64[1], sg32[0], sg32[1]);
    if (kk) EXPECT(attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, &tsg64, &G, &q, &k, &v, &out, &lse, &o), ATTN_E_DTYPE,
                   "an f64 sinks_grad on the fp32 backward");
  }
#undef EXPECT
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  arena_free(&a);
}

/* A shard's rows against part of the keys, at their global positions
 * (q_offset, k_offset), give the whole sequence's rows: causal, window, ALiBi
 * and dropout all count globally. Rows [30, 70) of 70 see keys from
 * 30 - window + 1 = 11 on, so keys [11, 70) are all they need. */
static void shard_offsets(attn_ctx *ctx, int64_t chunk) {
  arena a = {{0}, 0};
  tu_rng r = {77};
  /* the shard: rows from q0, keys from k0, heads from h0 (sequence and head parallelism at once) */
  const int64_t N = 70, H = 4, D = 16, q0 = 30, k0 = 11, h0 = 2, s4[4] = {1, H, N, D}, ls[3] = {1, H, N};
  const attn_tensor q = make4(&a, &r, s4, ATTN_F32, 0, 1), k = make4(&a, &r, s4, ATTN_F32, 0, 1);
  const attn_tensor v = make4(&a, &r, s4, ATTN_F32, 0, 1);
  attn_tensor ref = make4(&a, &r, s4, ATTN_F32, 0, 0), ref_lse = attn_tensor_view(arena_alloc(&a, 4 * H * N), ATTN_F32, 3, ls);
  attn_tensor slopes = make_vec(&a, H, ATTN_F32);
  CHECK_OK(ctx, attn_alibi_slopes(slopes.data, H));
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.causal = ATTN_CAUSAL_TOP_LEFT, o.window = 20, o.alibi_slopes = &slopes, o.dropout_p = 0.15, o.dropout_seed = 9;
  o.chunk = chunk; /* chunks start at global multiples of chunk, which the shard's own positions are not */
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_REF));
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &ref, &ref_lse, NULL, &q, &k, &v, &o));
  for (size_t ki = 0; ki <= sizeof kernels / sizeof kernels[0]; ki++) {
    const attn_kernel kern = ki < sizeof kernels / sizeof kernels[0] ? kernels[ki] : ATTN_KERNEL_REF;
    if (!attn_kernel_supported(kern)) continue;
    CHECK_OK(ctx, attn_ctx_set_kernel(ctx, kern));
    attn_tensor qs = q, ks = k, vs = v, sl_slopes = slopes;
    qs.data = (float *)q.data + (h0 * N + q0) * D, qs.shape[1] = H - h0, qs.shape[2] = N - q0;
    ks.data = (float *)k.data + (h0 * N + k0) * D, ks.shape[1] = H - h0, ks.shape[2] = N - k0;
    vs.data = (float *)v.data + (h0 * N + k0) * D, vs.shape[1] = H - h0, vs.shape[2] = N - k0;
    sl_slopes.data = (float *)slopes.data + h0, sl_slopes.shape[0] = H - h0;
    const int64_t so[4] = {1, H - h0, N - q0, D}, sl[3] = {1, H - h0, N - q0};
    attn_tensor out = make4(&a, &r, so, ATTN_F32, 0, 0), lse = attn_tensor_view(arena_alloc(&a, 4 * H * N), ATTN_F32, 3, sl);
    attn_tensor rs = ref, rl = ref_lse;
    rs.data = (float *)ref.data + (h0 * N + q0) * D, rs.shape[1] = H - h0, rs.shape[2] = N - q0;
    rl.data = (float *)ref_lse.data + h0 * N + q0, rl.shape[1] = H - h0, rl.shape[2] = N - q0;
    for (int global_heads = 1; global_heads >= 0; global_heads--) {
      poison(&out);
      attn_sdpa_opts p = o;
      p.q_offset = q0, p.k_offset = k0, p.head_offset = global_heads ? h0 : 0, p.alibi_slopes = &sl_slopes;
      CHECK_OK(ctx, attn_sdpa(ctx, &out, &lse, NULL, &qs, &ks, &vs, &p));
      double *x = tu_to_f64(&out), *y = tu_to_f64(&rs), *xl = tu_to_f64(&lse), *yl = tu_to_f64(&rl);
      const double e = tu_rel_l2(x, y, attn_tensor_numel(&out)), el = tu_rel_l2(xl, yl, attn_tensor_numel(&lse));
      if (global_heads)
        CHECK(e <= 1e-6 && el <= 1e-6,
              "kernel %s: a shard at offsets (%lld, %lld, head %lld), chunk %lld: out %.2e, lse %.2e",
              attn_kernel_name(kern), (long long)q0, (long long)k0, (long long)h0, (long long)chunk, e, el);
      else /* the heads numbered from 0 draw other dropout: the check above can tell */
        CHECK(e > 1e-2, "kernel %s: head_offset 0 gave the shard's dropout anyway (%.2e)", attn_kernel_name(kern), e);
      free(x), free(y), free(xl), free(yl);
    }
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  arena_free(&a);
}

static void summary(void) {
  printf("worst errors against the oracle (relative L2; lse relative to 1 + |lse|):\n");
  printf("  %-9s", "option");
  for (int e = 0; e < ERR_KINDS; e++) printf(" %10s", err_names[e]);
  printf("\n");
  for (int k = 0; k < OPT_KINDS; k++) {
    printf("  %-9s", opt_names[k]);
    for (int e = 0; e < ERR_KINDS; e++) printf(" %10.3g", worst[k][e]);
    printf("\n");
  }
}

int main(int argc, char **argv) {
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx) != ATTN_OK) return 2;
  const int randoms = argc > 1 ? atoi(argv[1]) : 60;
  for (size_t ki = 0; ki < sizeof kernels / sizeof kernels[0]; ki++)
    printf("kernel %-6s %s\n", attn_kernel_name(kernels[ki]),
           attn_kernel_supported(kernels[ki]) ? "tested" : "not supported here: skipped");
  alibi_slopes();
  fast_tanh();
  argument_checks(ctx);
  shard_offsets(ctx, 0);
  shard_offsets(ctx, 16);
  oracle_vs_plain(ctx);
  dropout_one_oracle(ctx);
  options_as_masks(ctx);
  dead_rows_with_sinks(ctx);
  finite_differences(ctx);
  chosen_cases(ctx);
  random_cases(ctx, randoms);
  summary();
  attn_ctx_destroy(ctx);
  return tu_finish("test_options");
}
