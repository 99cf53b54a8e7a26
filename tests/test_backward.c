/* The SDPA backward pass and dropout:
 *   (a) the float64 oracle's gradients against central finite differences of
 *       L = sum(out * G), over every option (masks, causal, key padding, GQA,
 *       scale, strides, Dv != D, fully masked rows, dropout with a fixed seed);
 *   (b) dropout itself: Philox-4x32-10 known answers, kept fractions, the same
 *       mask for the same seed, forward weights = softmax * keep / (1 - p);
 *   (c) attn_sdpa_backward (the default kernel) against the oracle on random
 *       cases, bitwise the same for 1, 2 and 3 threads;
 *   (d) its argument checks;
 *   (e) PyTorch autograd goldens (tests/golden, cases with backward=1; with
 *       the options window, softcap, ALiBi, sinks (and dL/dsinks) and dropout
 *       where the case sets them).
 * Run with the working directory tests/. Seeds are fixed. */
#include "testutil.h"
#include "dropout.h"

#define TOL_FD 1e-6
#define TOL_FP32 1e-5
#define TOL_GOLD_REF 1e-12

/* ---- buffers and views ------------------------------------------------------------ */

static double tget(const attn_tensor *t, int64_t off) {
  switch (t->dtype) {
    case ATTN_F32: return ((const float *)t->data)[off];
    case ATTN_F64: return ((const double *)t->data)[off];
    default: return ((const uint8_t *)t->data)[off];
  }
}

static void tset(attn_tensor *t, int64_t off, double x) {
  switch (t->dtype) {
    case ATTN_F32: ((float *)t->data)[off] = (float)x; break;
    case ATTN_F64: ((double *)t->data)[off] = x; break;
    default: ((uint8_t *)t->data)[off] = (uint8_t)(x != 0); break;
  }
}

/* A rank-4 f32/f64 tensor of logical shape s, filled with amp * uniform, laid out as
 *   0: contiguous
 *   1: batch-first: a contiguous [s0, s2, s1, s3] buffer seen through attn_tensor_permute
 *   2: padded, with the dimensions in memory order 3, 1, 0, 2 */
static attn_tensor make4(arena *a, tu_rng *r, const int64_t s[4], attn_dtype dt, int layout, double amp) {
  attn_tensor t;
  memset(&t, 0, sizeof t);
  int64_t span;
  if (layout == 1) {
    const int64_t bf[4] = {s[0], s[2], s[1], s[3]};
    span = bf[0] * bf[1] * bf[2] * bf[3];
    attn_tensor base = attn_tensor_view(arena_alloc(a, (size_t)span * attn_dtype_size(dt)), dt, 4, bf);
    static const int perm[4] = {0, 2, 1, 3};
    if (attn_tensor_permute(&t, &base, perm) != ATTN_OK) exit(2);
  } else {
    int order[4] = {0, 1, 2, 3};
    int64_t pad[4] = {0, 0, 0, 0};
    if (layout == 2) {
      order[0] = 3; order[1] = 1; order[2] = 0; order[3] = 2;
      for (int i = 0; i < 4; i++) pad[i] = tu_int(r, 0, 2);
    }
    t.dtype = dt;
    t.rank = 4;
    span = 1;
    for (int m = 3; m >= 0; m--) {
      const int d = order[m];
      t.shape[d] = s[d];
      t.strides[d] = span;
      span *= s[d] + pad[d];
    }
    t.data = arena_alloc(a, (size_t)span * attn_dtype_size(dt));
  }
  for (int64_t i = 0; i < span; i++) {
    const double x = amp * tu_uniform(r);
    if (dt == ATTN_F32) ((float *)t.data)[i] = (float)x;
    else ((double *)t.data)[i] = x;
  }
  return t;
}

/* Sets every element of a rank-4 view to NaN: catches elements never written. */
static void poison4(attn_tensor *t) {
  for (int64_t a = 0; a < t->shape[0]; a++)
    for (int64_t b = 0; b < t->shape[1]; b++)
      for (int64_t c = 0; c < t->shape[2]; c++)
        for (int64_t d = 0; d < t->shape[3]; d++) tset(t, off4(t, a, b, c, d), NAN);
}

/* A contiguous tensor of shape s (rank n) filled with NaN (float dtypes). */
static attn_tensor make_nan(arena *a, attn_dtype dt, int n, const int64_t *s) {
  int64_t numel = 1;
  for (int i = 0; i < n; i++) numel *= s[i];
  attn_tensor t = attn_tensor_view(arena_alloc(a, (size_t)numel * attn_dtype_size(dt)), dt, n, s);
  for (int64_t i = 0; i < numel; i++) tset(&t, i, NAN);
  return t;
}

/* Sums a full [B, Hq, Nq, Nk] array (contiguous) over the dimensions a mask of
 * shape like (right-aligned, rank <= 4) broadcasts along: the mask's own gradient. */
static double *reduce_to(const double *full, const int64_t fs[4], const attn_tensor *like) {
  int64_t sh[4] = {1, 1, 1, 1};
  for (int i = 0; i < like->rank; i++) sh[4 - like->rank + i] = like->shape[i];
  double *o = calloc((size_t)(sh[0] * sh[1] * sh[2] * sh[3] + 1), sizeof(double));
  int64_t idx = 0;
  for (int64_t a = 0; a < fs[0]; a++)
    for (int64_t b = 0; b < fs[1]; b++)
      for (int64_t c = 0; c < fs[2]; c++)
        for (int64_t d = 0; d < fs[3]; d++, idx++) {
          const int64_t e = (((sh[0] > 1 ? a : 0) * sh[1] + (sh[1] > 1 ? b : 0)) * sh[2] + (sh[2] > 1 ? c : 0)) * sh[3] +
                            (sh[3] > 1 ? d : 0);
          o[e] += full[idx];
        }
  return o;
}

/* ---- a problem: inputs, upstream gradient, options ----------------------------------- */
typedef struct problem {
  int64_t B, Hq, Hk, Nq, Nk, D, Dv;
  attn_tensor q, k, v, G, mask, kpm;
  int has_mask, has_kpm;
  attn_mask_mode mask_mode;
  attn_causal causal;
  double scale, dropout_p;
  uint64_t dropout_seed;
} problem;

/* The options of pb (pointing into pb: build them where pb stays put). */
static attn_sdpa_opts popts(problem *pb) {
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.scale = pb->scale;
  o.causal = pb->causal;
  if (pb->has_mask) {
    o.mask = &pb->mask;
    o.mask_mode = pb->mask_mode;
  }
  if (pb->has_kpm) o.key_padding = &pb->kpm;
  o.dropout_p = pb->dropout_p;
  o.dropout_seed = pb->dropout_seed;
  return o;
}

typedef struct spec {
  const char *name;
  int64_t B, Hq, Hk, Nq, Nk, D, Dv;
  int layout;          /* of q, k, v and the gradients: see make4 */
  attn_causal causal;
  int mask_mode;       /* -1: none */
  int mask_shape;      /* 0 [B, Hq, Nq, Nk], 1 [Nq, Nk], 2 [B, 1, Nq, Nk] */
  int kpm;             /* 0 none, 1 the last batch ignores its last two keys, 2 batch 0 ignores every key */
  int empty_row;       /* the mask masks every key of query row 1 */
  double scale;        /* NaN: 1/sqrt(D) */
  double dropout;
} spec;

/* Draws a problem. dt: dtype of q, k, v, G and float masks. */
static void make_problem(arena *a, problem *pb, const spec *sp, uint64_t seed, attn_dtype dt) {
  tu_rng r = {seed};
  memset(pb, 0, sizeof *pb);
  pb->B = sp->B; pb->Hq = sp->Hq; pb->Hk = sp->Hk; pb->Nq = sp->Nq; pb->Nk = sp->Nk; pb->D = sp->D; pb->Dv = sp->Dv;
  const int64_t qs[4] = {sp->B, sp->Hq, sp->Nq, sp->D}, ks[4] = {sp->B, sp->Hk, sp->Nk, sp->D};
  const int64_t vs[4] = {sp->B, sp->Hk, sp->Nk, sp->Dv}, os[4] = {sp->B, sp->Hq, sp->Nq, sp->Dv};
  pb->q = make4(a, &r, qs, dt, sp->layout, 1.5); /* logits of a few units: a softmax far from flat */
  pb->k = make4(a, &r, ks, dt, sp->layout, 1.0);
  pb->v = make4(a, &r, vs, dt, sp->layout, 1.0);
  pb->G = make4(a, &r, os, dt, sp->layout, 1.0);
  pb->causal = sp->causal;
  pb->scale = sp->scale;
  pb->dropout_p = sp->dropout;
  pb->dropout_seed = seed * 0x9E3779B97F4A7C15ull + 12345;
  if (sp->mask_mode >= 0) {
    pb->has_mask = 1;
    pb->mask_mode = (attn_mask_mode)sp->mask_mode;
    const int boolean = sp->mask_mode == ATTN_MASK_KEEP || sp->mask_mode == ATTN_MASK_MASKED;
    int64_t s[4] = {sp->B, sp->Hq, sp->Nq, sp->Nk};
    if (sp->mask_shape == 2) s[1] = 1;
    const attn_dtype mdt = boolean ? ATTN_BOOL : dt;
    if (sp->mask_shape == 1) {
      const int64_t s2[2] = {sp->Nq, sp->Nk};
      pb->mask = attn_tensor_view(arena_alloc(a, (size_t)(sp->Nq * sp->Nk) * attn_dtype_size(mdt)), mdt, 2, s2);
      s[0] = s[1] = 1;
    } else {
      pb->mask = attn_tensor_view(arena_alloc(a, (size_t)(s[0] * s[1] * s[2] * s[3]) * attn_dtype_size(mdt)), mdt, 4, s);
    }
    int64_t idx = 0;
    for (int64_t b = 0; b < s[0]; b++)
      for (int64_t h = 0; h < s[1]; h++)
        for (int64_t i = 0; i < s[2]; i++)
          for (int64_t j = 0; j < s[3]; j++, idx++) {
            int masked = tu_int(&r, 0, 99) < 25;
            if (sp->empty_row && i == 1) masked = 1;
            switch (sp->mask_mode) {
              case ATTN_MASK_KEEP: tset(&pb->mask, idx, !masked); break;
              case ATTN_MASK_MASKED: tset(&pb->mask, idx, masked); break;
              case ATTN_MASK_ADDITIVE: tset(&pb->mask, idx, masked ? -INFINITY : 0.8 * tu_uniform(&r)); break;
              default: tset(&pb->mask, idx, masked && j > 0); break; /* seed: 1 = pushed down by 1e9 */
            }
          }
  }
  if (sp->kpm) {
    const int64_t s[2] = {sp->B, sp->Nk};
    pb->kpm = attn_tensor_view(arena_alloc(a, (size_t)(sp->B * sp->Nk + 1)), ATTN_BOOL, 2, s);
    uint8_t *kp = pb->kpm.data;
    for (int64_t j = 0; j < sp->Nk; j++) {
      if (sp->kpm == 1) kp[(sp->B - 1) * sp->Nk + j] = j >= sp->Nk - 2;
      else kp[j] = 1;
    }
    pb->has_kpm = 1;
  }
}

/* ---- (a) finite differences ---------------------------------------------------------- */
/* L = sum(out * G), out by the oracle in double; outbuf holds [B, Hq, Nq, Dv]. */
static double loss(attn_ctx *ctx, problem *pb, double *outbuf) {
  const int64_t os[4] = {pb->B, pb->Hq, pb->Nq, pb->Dv};
  attn_tensor out = attn_tensor_view(outbuf, ATTN_F64, 4, os);
  attn_sdpa_opts o = popts(pb);
  if (attn_sdpa_ref(ctx, &out, NULL, NULL, &pb->q, &pb->k, &pb->v, &o) != ATTN_OK) return NAN;
  double L = 0;
  for (int64_t b = 0; b < pb->B; b++)
    for (int64_t h = 0; h < pb->Hq; h++)
      for (int64_t i = 0; i < pb->Nq; i++)
        for (int64_t c = 0; c < pb->Dv; c++)
          L += outbuf[((b * pb->Hq + h) * pb->Nq + i) * pb->Dv + c] * tget(&pb->G, off4(&pb->G, b, h, i, c));
  return L;
}

/* dL/dt by central differences, in t's logical (C) order; t is one of pb's f64 tensors. */
static double *fd_grad(attn_ctx *ctx, problem *pb, attn_tensor *t, double *outbuf) {
  int64_t sh[4] = {1, 1, 1, 1}, st[4] = {0, 0, 0, 0};
  for (int i = 0; i < t->rank; i++) {
    sh[4 - t->rank + i] = t->shape[i];
    st[4 - t->rank + i] = t->strides[i];
  }
  double *g = malloc((size_t)(sh[0] * sh[1] * sh[2] * sh[3] + 1) * sizeof(double));
  int64_t idx = 0;
  for (int64_t a = 0; a < sh[0]; a++)
    for (int64_t b = 0; b < sh[1]; b++)
      for (int64_t c = 0; c < sh[2]; c++)
        for (int64_t d = 0; d < sh[3]; d++) {
          const int64_t e = a * st[0] + b * st[1] + c * st[2] + d * st[3];
          double *x = (double *)t->data + e;
          const double x0 = *x, step = 1e-6;
          if (isinf(x0)) { /* a -inf mask entry: no neighbourhood to difference */
            g[idx++] = 0;
            continue;
          }
          const double xp = x0 + step, xm = x0 - step;
          *x = xp;
          const double Lp = loss(ctx, pb, outbuf);
          *x = xm;
          const double Lm = loss(ctx, pb, outbuf);
          *x = x0;
          g[idx++] = (Lp - Lm) / (xp - xm);
        }
  return g;
}

static void fd_case(attn_ctx *ctx, const spec *sp, uint64_t seed) {
  arena a = {{0}, 0};
  problem pb;
  make_problem(&a, &pb, sp, seed, ATTN_F64);
  const int64_t B = sp->B, Hq = sp->Hq, Nq = sp->Nq, Nk = sp->Nk;
  const int64_t os[4] = {B, Hq, Nq, sp->Dv}, ls[3] = {B, Hq, Nq}, fs[4] = {B, Hq, Nq, Nk};
  double *outbuf = arena_alloc(&a, (size_t)(B * Hq * Nq * sp->Dv + 1) * sizeof(double));
  double *lsebuf = arena_alloc(&a, (size_t)(B * Hq * Nq + 1) * sizeof(double));
  attn_tensor out = attn_tensor_view(outbuf, ATTN_F64, 4, os), lse = attn_tensor_view(lsebuf, ATTN_F64, 3, ls);
  attn_sdpa_opts o = popts(&pb);
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &out, &lse, NULL, &pb.q, &pb.k, &pb.v, &o));

  /* the gradients, in the layout of the inputs */
  tu_rng r = {seed + 1};
  const int64_t qs[4] = {B, Hq, Nq, sp->D}, ks[4] = {B, sp->Hk, Nk, sp->D}, vs[4] = {B, sp->Hk, Nk, sp->Dv};
  attn_tensor dq = make4(&a, &r, qs, ATTN_F64, sp->layout, 0), dk = make4(&a, &r, ks, ATTN_F64, sp->layout, 0);
  attn_tensor dv = make4(&a, &r, vs, ATTN_F64, sp->layout, 0), mg = make_nan(&a, ATTN_F64, 4, fs);
  poison4(&dq);
  poison4(&dk);
  poison4(&dv);
  const int additive = pb.has_mask && pb.mask_mode == ATTN_MASK_ADDITIVE;
  attn_sdpa_opts ob = popts(&pb);
  CHECK_OK(ctx, attn_sdpa_backward_ref(ctx, &dq, &dk, &dv, additive ? &mg : NULL, NULL, &pb.G, &pb.q, &pb.k, &pb.v,
                                       &out, &lse, &ob));

  double *gq = tu_to_f64(&dq), *gk = tu_to_f64(&dk), *gv = tu_to_f64(&dv);
  double *fq = fd_grad(ctx, &pb, &pb.q, outbuf), *fk = fd_grad(ctx, &pb, &pb.k, outbuf);
  double *fv = fd_grad(ctx, &pb, &pb.v, outbuf);
  const int64_t nq = B * Hq * Nq * sp->D, nk = B * sp->Hk * Nk * sp->D, nv = B * sp->Hk * Nk * sp->Dv;
  const double eq = tu_rel_l2(gq, fq, nq), ek = tu_rel_l2(gk, fk, nk), ev = tu_rel_l2(gv, fv, nv);
  const int nans = tu_count_nan(gq, nq) + tu_count_nan(gk, nk) + tu_count_nan(gv, nv);
  CHECK(eq <= TOL_FD && ek <= TOL_FD && ev <= TOL_FD && nans == 0,
        "%s: rel err vs finite differences dq %.3g dk %.3g dv %.3g, %d NaN", sp->name, eq, ek, ev, nans);
  double em = 0;
  if (additive) {
    double *gm_full = tu_to_f64(&mg);
    double *gm = reduce_to(gm_full, fs, &pb.mask), *fm = fd_grad(ctx, &pb, &pb.mask, outbuf);
    const int64_t nm = attn_tensor_numel(&pb.mask);
    em = tu_rel_l2(gm, fm, nm);
    CHECK(em <= TOL_FD && tu_count_nan(gm_full, B * Hq * Nq * Nk) == 0, "%s: mask_grad rel err %.3g vs finite differences",
          sp->name, em);
    free(gm_full);
    free(gm);
    free(fm);
  }
  /* Fully masked rows (lse -inf): zero gradients, exactly. */
  int dead = 0, dead_nonzero = 0;
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < Hq; h++)
      for (int64_t i = 0; i < Nq; i++) {
        if (lsebuf[(b * Hq + h) * Nq + i] != -INFINITY) continue;
        dead++;
        for (int64_t d = 0; d < sp->D; d++) dead_nonzero += tget(&dq, off4(&dq, b, h, i, d)) != 0;
        if (additive)
          for (int64_t j = 0; j < Nk; j++) dead_nonzero += tget(&mg, off4(&mg, b, h, i, j)) != 0;
      }
  CHECK(dead_nonzero == 0, "%s: %d nonzero gradients in %d fully masked rows", sp->name, dead_nonzero, dead);
  CHECK(!sp->empty_row && sp->kpm != 2 ? 1 : dead > 0, "%s: the case was meant to have fully masked rows", sp->name);
  char dm[32] = "";
  if (additive) snprintf(dm, sizeof dm, " dmask %.1e", em);
  printf("  fd %-22s dq %.1e dk %.1e dv %.1e%s  (%d fully masked rows)\n", sp->name, eq, ek, ev, dm, dead);
  free(gq); free(gk); free(gv); free(fq); free(fk); free(fv);
  arena_free(&a);
}

static void finite_differences(attn_ctx *ctx) {
  attn_ctx_set_threads(ctx, 1); /* thousands of tiny calls */
  const double dflt = NAN;
  const spec specs[] = {
      /* name, B, Hq, Hk, Nq, Nk, D, Dv, layout, causal, mask mode, mask shape, key padding, empty row, scale, p */
      {"plain",               2, 2, 2, 5, 6, 4, 4, 0, ATTN_CAUSAL_NONE,         -1,                  0, 0, 0, dflt, 0},
      {"keep",                2, 2, 2, 5, 6, 4, 4, 0, ATTN_CAUSAL_NONE,         ATTN_MASK_KEEP,      2, 0, 0, dflt, 0},
      {"keep, empty row",     1, 2, 2, 4, 5, 3, 3, 0, ATTN_CAUSAL_NONE,         ATTN_MASK_KEEP,      0, 0, 1, dflt, 0},
      {"masked",              2, 2, 2, 5, 6, 4, 4, 0, ATTN_CAUSAL_NONE,         ATTN_MASK_MASKED,    1, 0, 0, dflt, 0},
      {"additive full",       2, 2, 2, 4, 6, 4, 4, 0, ATTN_CAUSAL_NONE,         ATTN_MASK_ADDITIVE,  0, 0, 0, dflt, 0},
      {"additive [Nq,Nk]",    2, 2, 1, 4, 5, 4, 3, 0, ATTN_CAUSAL_TOP_LEFT,     ATTN_MASK_ADDITIVE,  1, 1, 0, dflt, 0},
      {"additive, empty row", 1, 2, 2, 4, 5, 4, 4, 1, ATTN_CAUSAL_NONE,         ATTN_MASK_ADDITIVE,  2, 0, 1, dflt, 0},
      {"seed",                2, 2, 2, 5, 6, 4, 4, 0, ATTN_CAUSAL_NONE,         ATTN_MASK_SEED,      2, 0, 0, dflt, 0},
      {"causal top-left",     2, 2, 2, 4, 6, 4, 4, 0, ATTN_CAUSAL_TOP_LEFT,     -1,                  0, 0, 0, dflt, 0},
      {"causal tl, tall",     1, 2, 2, 6, 4, 4, 4, 0, ATTN_CAUSAL_TOP_LEFT,     -1,                  0, 0, 0, dflt, 0},
      {"causal bottom-right", 2, 2, 2, 3, 7, 4, 4, 0, ATTN_CAUSAL_BOTTOM_RIGHT, -1,                  0, 0, 0, dflt, 0},
      {"causal br, tall",     1, 2, 2, 6, 4, 4, 4, 0, ATTN_CAUSAL_BOTTOM_RIGHT, -1,                  0, 0, 0, dflt, 0},
      {"key padding",         2, 2, 2, 4, 6, 4, 4, 0, ATTN_CAUSAL_NONE,         -1,                  0, 1, 0, dflt, 0},
      {"key padding, empty",  2, 1, 1, 3, 5, 4, 4, 0, ATTN_CAUSAL_NONE,         -1,                  0, 2, 0, dflt, 0},
      {"gqa",                 1, 4, 2, 4, 5, 4, 4, 0, ATTN_CAUSAL_NONE,         -1,                  0, 0, 0, dflt, 0},
      {"mqa",                 2, 3, 1, 4, 5, 4, 4, 0, ATTN_CAUSAL_NONE,         ATTN_MASK_KEEP,      0, 0, 0, dflt, 0},
      {"scale",               2, 2, 2, 4, 5, 4, 4, 0, ATTN_CAUSAL_NONE,         -1,                  0, 0, 0, 0.37, 0},
      {"batch-first, Dv!=D",  2, 2, 2, 4, 5, 3, 6, 1, ATTN_CAUSAL_NONE,         ATTN_MASK_ADDITIVE,  2, 0, 0, dflt, 0},
      {"dropout 0.3",         2, 2, 2, 5, 6, 4, 4, 0, ATTN_CAUSAL_NONE,         -1,                  0, 0, 0, dflt, 0.3},
      {"dropout 0.6 gqa br",  1, 4, 2, 4, 6, 4, 5, 1, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_MASK_ADDITIVE,  0, 1, 0, 0.5, 0.6},
      {"dropout seed mask",   2, 2, 1, 4, 5, 4, 4, 0, ATTN_CAUSAL_TOP_LEFT,     ATTN_MASK_SEED,      2, 0, 0, dflt, 0.2},
      {"combo",               2, 4, 2, 5, 7, 4, 3, 1, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_MASK_KEEP,      2, 1, 1, 0.45, 0.25},
      {"dropout 1 (all)",     1, 4, 2, 4, 6, 4, 5, 1, ATTN_CAUSAL_BOTTOM_RIGHT, ATTN_MASK_ADDITIVE,  0, 1, 0, dflt, 1.0},
  };
  for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) fd_case(ctx, &specs[i], 500 + (uint64_t)i);
  attn_ctx_set_threads(ctx, 0);
}

/* ---- (b) dropout ----------------------------------------------------------------------- */
static void philox_known_answers(void) {
  /* Random123's kat_vectors for philox4x32_10: counter, key, expected output. */
  static const uint32_t kat[3][10] = {
      {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
      {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d, 0x41c83b0e, 0xa20bc7c6,
       0x6d5451fd},
      {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09, 0x94fdcceb, 0x5001e420,
       0x24126ea1},
  };
  for (int t = 0; t < 3; t++) {
    uint32_t out[4];
    attn__philox4x32(out, kat[t], (uint64_t)kat[t][4] | (uint64_t)kat[t][5] << 32);
    CHECK(out[0] == kat[t][6] && out[1] == kat[t][7] && out[2] == kat[t][8] && out[3] == kat[t][9],
          "philox4x32-10 known answer %d: got %08x %08x %08x %08x", t, out[0], out[1], out[2], out[3]);
  }
  CHECK(attn__dropout_threshold(0.5) == 0x80000000u && attn__dropout_threshold(0) == 0 &&
            attn__dropout_threshold(0.25) == 0x40000000u && attn__dropout_threshold(1.0 - 1e-16) == 0xffffffffu,
        "dropout thresholds");
  /* The public decision is word (j & 3) of the block of counter (j >> 2, i, h, b). */
  const uint64_t seed = 0x0123456789abcdefull;
  int agree = 1;
  for (int64_t j = 0; j < 64; j++) {
    const uint32_t ctr[4] = {(uint32_t)(j >> 2), 7, 3, 1};
    uint32_t u[4];
    attn__philox4x32(u, ctr, seed);
    agree &= attn_dropout_keep(seed, 0.5, 1, 3, 7, j) == (u[j & 3] >= 0x80000000u);
    uint8_t k4[4];
    attn__dropout_keep4(k4, seed, attn__dropout_threshold(0.5), 1, 3, 7, j);
    agree &= k4[j & 3] == attn_dropout_keep(seed, 0.5, 1, 3, 7, j);
  }
  CHECK(agree, "attn_dropout_keep does not follow the documented counter layout");
  int all = 1;
  for (int64_t j = 0; j < 1000; j++)
    all &= attn_dropout_keep(seed, 0, 0, 0, 0, j) && attn_dropout_keep(seed, NAN, 0, 0, 0, j) &&
           attn_dropout_keep(seed, -1, 0, 0, 0, j) && !attn_dropout_keep(seed, 1, 0, 0, 0, j) &&
           !attn_dropout_keep(seed, 2, 0, 0, 0, j);
  CHECK(all, "p <= 0 (and NaN) must keep everything, p >= 1 drop everything");
}

static void dropout_statistics(attn_ctx *ctx) {
  enum { B = 1, H = 2, N = 256, D = 16 };
  const int64_t n = (int64_t)B * H * N * N;
  arena a = {{0}, 0};
  tu_rng r = {77};
  const int64_t s[4] = {B, H, N, D}, ws[4] = {B, H, N, N}, ls[3] = {B, H, N};
  attn_tensor q = make4(&a, &r, s, ATTN_F32, 0, 2), k = make4(&a, &r, s, ATTN_F32, 0, 2);
  attn_tensor v = make4(&a, &r, s, ATTN_F32, 0, 1);
  attn_tensor out0 = make_nan(&a, ATTN_F64, 4, s), w0 = make_nan(&a, ATTN_F64, 4, ws);
  attn_tensor l0 = make_nan(&a, ATTN_F64, 3, ls);
  attn_tensor out = make_nan(&a, ATTN_F64, 4, s), w = make_nan(&a, ATTN_F64, 4, ws), l = make_nan(&a, ATTN_F64, 3, ls);
  attn_tensor w2 = make_nan(&a, ATTN_F64, 4, ws), out2 = make_nan(&a, ATTN_F64, 4, s);
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &out0, &l0, &w0, &q, &k, &v, &o));
  double *vd = tu_to_f64(&v);
  const double *W0 = w0.data, *W = w.data, *O = out.data, *V = vd;

  static const double ps[3] = {0.1, 0.5, 0.9};
  for (int pi = 0; pi < 3; pi++) {
    const double p = ps[pi];
    const uint64_t seed = 1000 + (uint64_t)pi, other = 0xfeedfacecafebeefull + (uint64_t)pi;
    /* the kept fraction, overall and in each of the four words of a Philox block */
    int64_t kept = 0, lane[4] = {0, 0, 0, 0}, differ = 0;
    for (int64_t h = 0; h < H; h++)
      for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < N; j++) {
          const int kk = attn_dropout_keep(seed, p, 0, h, i, j);
          kept += kk;
          lane[j & 3] += kk;
          differ += kk != attn_dropout_keep(other, p, 0, h, i, j);
        }
    const double mean = n * (1 - p), sd = sqrt(n * p * (1 - p));
    CHECK(fabs((double)kept - mean) <= 5 * sd, "p = %g: kept %lld of %lld, want %.0f +- %.0f", p, (long long)kept,
          (long long)n, mean, 5 * sd);
    for (int c = 0; c < 4; c++)
      CHECK(fabs((double)lane[c] - mean / 4) <= 5 * sd / 2, "p = %g: word %d keeps %lld of %lld", p, c,
            (long long)lane[c], (long long)(n / 4));
    const double pd = 2 * p * (1 - p); /* two independent masks disagree this often */
    CHECK(fabs((double)differ - n * pd) <= 5 * sqrt(n * pd * (1 - pd)), "p = %g: seeds %llu and %llx differ at %lld",
          p, (unsigned long long)seed, (unsigned long long)other, (long long)differ);
    printf("  dropout p=%.1f: kept %.4f (want %.4f), words %lld %lld %lld %lld, another seed differs at %.4f (want %.4f)\n",
           p, (double)kept / n, 1 - p, (long long)lane[0], (long long)lane[1], (long long)lane[2], (long long)lane[3],
           (double)differ / n, pd);

    /* the forward: weights = softmax * keep / (1 - p), out = weights . v, lse unchanged */
    o.dropout_p = p;
    o.dropout_seed = seed;
    attn_ctx_set_threads(ctx, 1);
    CHECK_OK(ctx, attn_sdpa_ref(ctx, &out, &l, &w, &q, &k, &v, &o));
    int64_t bad = 0, dropped = 0;
    for (int64_t h = 0; h < H; h++)
      for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < N; j++) {
          const int64_t e = (h * N + i) * N + j;
          const double want = W0[e] * attn_dropout_keep(seed, p, 0, h, i, j) / (1 - p);
          bad += !(fabs(W[e] - want) <= 1e-15 * want);
          dropped += W[e] == 0;
        }
    CHECK(bad == 0, "p = %g: %lld weights are not softmax * keep / (1 - p)", p, (long long)bad);
    CHECK(dropped == n - kept, "p = %g: %lld zero weights, %lld dropped", p, (long long)dropped, (long long)(n - kept));
    CHECK(memcmp(l.data, l0.data, sizeof(double) * H * N) == 0, "p = %g: lse must be that of the undropped softmax", p);
    double *ow = malloc(sizeof(double) * H * N * D);
    for (int64_t h = 0; h < H; h++)
      for (int64_t i = 0; i < N; i++)
        for (int64_t c = 0; c < D; c++) {
          double acc = 0;
          for (int64_t j = 0; j < N; j++) acc += W[(h * N + i) * N + j] * V[(h * N + j) * D + c];
          ow[(h * N + i) * D + c] = acc;
        }
    const double e_out = tu_rel_l2(O, ow, H * N * D);
    CHECK(e_out <= 1e-13, "p = %g: out differs from weights . v by %.3g", p, e_out);
    free(ow);

    /* the same seed: the same mask, whatever the thread count; another seed: another mask */
    attn_ctx_set_threads(ctx, 2);
    CHECK_OK(ctx, attn_sdpa_ref(ctx, &out2, &l, &w2, &q, &k, &v, &o));
    CHECK(memcmp(w2.data, w.data, sizeof(double) * n) == 0 && memcmp(out2.data, out.data, sizeof(double) * H * N * D) == 0,
          "p = %g: the same seed must give the same dropout", p);
    o.dropout_seed = other;
    CHECK_OK(ctx, attn_sdpa_ref(ctx, &out2, &l, &w2, &q, &k, &v, &o));
    CHECK(memcmp(w2.data, w.data, sizeof(double) * n) != 0, "p = %g: another seed gave the same weights", p);

    /* the fp32 path gives the oracle's answer */
    attn_ctx_set_threads(ctx, 0);
    o.dropout_seed = seed;
    attn_tensor of = make_nan(&a, ATTN_F32, 4, s), wf = make_nan(&a, ATTN_F32, 4, ws);
    attn_sdpa_opts ofo = o;
    attn_status st = attn_sdpa(ctx, &of, NULL, &wf, &q, &k, &v, &ofo);
    CHECK(st == ATTN_OK, "p = %g: attn_sdpa with dropout -> %s: %s", p, attn_strerror(st), attn_ctx_error(ctx));
    if (st == ATTN_OK) {
      double *go = tu_to_f64(&of), *gw = tu_to_f64(&wf);
      const double eo = tu_rel_l2(go, O, H * N * D), ew = tu_rel_l2(gw, W, n);
      CHECK(eo <= TOL_FP32 && ew <= TOL_FP32, "p = %g: fp32 dropout vs the oracle: out %.3g weights %.3g", p, eo, ew);
      free(go);
      free(gw);
    }
    o.dropout_p = 0;
  }
  /* p = 0 with a seed is no dropout at all */
  o.dropout_p = 0;
  o.dropout_seed = 99;
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &out, NULL, &w, &q, &k, &v, &o));
  CHECK(memcmp(w.data, w0.data, sizeof(double) * n) == 0 && memcmp(out.data, out0.data, sizeof(double) * H * N * D) == 0,
        "dropout_p = 0 must change nothing");
  free(vd);
  arena_free(&a);
}

/* ---- (c) attn_sdpa_backward against the oracle ----------------------------------------- */
static void random_case(attn_ctx *ctx, uint64_t seed) {
  tu_rng r = {seed};
  arena a = {{0}, 0};
  spec sp;
  memset(&sp, 0, sizeof sp);
  sp.name = "random";
  sp.B = tu_int(&r, 1, 2);
  sp.Hk = tu_int(&r, 1, 2);
  sp.Hq = sp.Hk * tu_int(&r, 1, 3);
  sp.Nq = tu_int(&r, 1, 24);
  sp.Nk = tu_int(&r, 0, 7) == 0 ? tu_int(&r, 0, 2) : tu_int(&r, 1, 28);
  static const int64_t dims[] = {1, 3, 8, 16, 17, 32, 48, 80}; /* 48, 80: every chunk width of the tiles' sums */
  sp.D = dims[tu_int(&r, 0, 7)];
  sp.Dv = tu_int(&r, 0, 2) ? sp.D : dims[tu_int(&r, 0, 7)];
  sp.layout = (int)tu_int(&r, 0, 2);
  sp.causal = (attn_causal)tu_int(&r, 0, 2);
  sp.mask_mode = (int)tu_int(&r, -1, 3);
  sp.mask_shape = (int)tu_int(&r, 0, 2);
  sp.kpm = sp.mask_mode != ATTN_MASK_SEED && sp.Nk > 0 && tu_int(&r, 0, 2) == 0; /* seed rows keep a visible key */
  sp.scale = tu_int(&r, 0, 2) == 0 ? 0.3 : NAN;
  sp.dropout = tu_int(&r, 0, 2) == 0 ? 0.25 : 0;
  char desc[256];
  snprintf(desc, sizeof desc,
           "seed %llu: B=%lld Hq=%lld Hk=%lld Nq=%lld Nk=%lld D=%lld Dv=%lld layout=%d causal=%d mask=%d/%d kpm=%d p=%g",
           (unsigned long long)seed, (long long)sp.B, (long long)sp.Hq, (long long)sp.Hk, (long long)sp.Nq,
           (long long)sp.Nk, (long long)sp.D, (long long)sp.Dv, sp.layout, (int)sp.causal, sp.mask_mode, sp.mask_shape,
           sp.kpm, sp.dropout);
  problem pb;
  make_problem(&a, &pb, &sp, seed * 31 + 7, ATTN_F32);
  const int additive = pb.has_mask && pb.mask_mode == ATTN_MASK_ADDITIVE;
  const int64_t B = sp.B, Hq = sp.Hq, Hk = sp.Hk, Nq = sp.Nq, Nk = sp.Nk, D = sp.D, Dv = sp.Dv;
  const int64_t os[4] = {B, Hq, Nq, Dv}, ls[3] = {B, Hq, Nq}, fs[4] = {B, Hq, Nq, Nk};
  const int64_t qs[4] = {B, Hq, Nq, D}, ks[4] = {B, Hk, Nk, D}, vs[4] = {B, Hk, Nk, Dv};
  const int64_t nq = B * Hq * Nq * D, nk = B * Hk * Nk * D, nv = B * Hk * Nk * Dv, nm = B * Hq * Nq * Nk;

  /* the oracle, from its own float64 forward */
  attn_tensor out64 = make_nan(&a, ATTN_F64, 4, os), lse64 = make_nan(&a, ATTN_F64, 3, ls);
  attn_tensor rq = make_nan(&a, ATTN_F64, 4, qs), rk = make_nan(&a, ATTN_F64, 4, ks), rv = make_nan(&a, ATTN_F64, 4, vs);
  attn_tensor rm = make_nan(&a, ATTN_F64, 4, fs);
  attn_sdpa_opts o = popts(&pb);
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &out64, &lse64, NULL, &pb.q, &pb.k, &pb.v, &o));
  CHECK_OK(ctx, attn_sdpa_backward_ref(ctx, &rq, &rk, &rv, additive ? &rm : NULL, NULL, &pb.G, &pb.q, &pb.k, &pb.v,
                                       &out64, &lse64, &o));

  /* the fp32 forward whose out and lse the fp32 backward takes */
  attn_tensor out = make4(&a, &r, os, ATTN_F32, sp.layout, 0), lse = make_nan(&a, ATTN_F32, 3, ls);
  o = popts(&pb);
  attn_status st = attn_sdpa(ctx, &out, &lse, NULL, &pb.q, &pb.k, &pb.v, &o);
  CHECK(st == ATTN_OK, "%s: forward: %s", desc, attn_ctx_error(ctx));

  float *first[4] = {NULL, NULL, NULL, NULL};
  for (int threads = 1; st == ATTN_OK && threads <= 3; threads++) {
    attn_ctx_set_threads(ctx, threads);
    attn_tensor dq = make4(&a, &r, qs, ATTN_F32, sp.layout, 0), dk = make4(&a, &r, ks, ATTN_F32, sp.layout, 0);
    attn_tensor dv = make4(&a, &r, vs, ATTN_F32, sp.layout, 0), mg = make_nan(&a, ATTN_F32, 4, fs);
    poison4(&dq);
    poison4(&dk);
    poison4(&dv);
    attn_sdpa_opts ob = popts(&pb);
    attn_status bs = attn_sdpa_backward(ctx, &dq, &dk, &dv, additive ? &mg : NULL, NULL, &pb.G, &pb.q, &pb.k, &pb.v,
                                        &out, &lse, &ob);
    CHECK(bs == ATTN_OK, "%s threads %d: attn_sdpa_backward -> %s: %s", desc, threads, attn_strerror(bs),
          attn_ctx_error(ctx));
    if (bs) break;
    const attn_tensor *got[4] = {&dq, &dk, &dv, &mg}, *want[4] = {&rq, &rk, &rv, &rm};
    const int64_t cnt[4] = {nq, nk, nv, nm};
    static const char *names[4] = {"dq", "dk", "dv", "mask_grad"};
    for (int t = 0; t < (additive ? 4 : 3); t++) {
      double *g = tu_to_f64(got[t]), *w = tu_to_f64(want[t]);
      const double e = tu_rel_l2(g, w, cnt[t]);
      const int nan = tu_count_nan(g, cnt[t]);
      CHECK(e <= TOL_FP32 && nan == 0, "%s threads %d: %s rel err %.3g vs the oracle, %d NaN", desc, threads, names[t], e,
            nan);
      float *flat = arena_alloc(&a, (size_t)(cnt[t] + 1) * sizeof(float));
      for (int64_t i = 0; i < cnt[t]; i++) flat[i] = (float)g[i];
      if (!first[t]) first[t] = flat;
      else CHECK(memcmp(first[t], flat, (size_t)cnt[t] * sizeof(float)) == 0, "%s: threads %d changed the bits of %s",
                 desc, threads, names[t]);
      free(g);
      free(w);
    }
  }
  attn_ctx_set_threads(ctx, 0);
  arena_free(&a);
}

/* ---- (d) argument checks ---------------------------------------------------------------- */
static void error_paths(attn_ctx *ctx) {
  enum { B = 2, Hq = 2, Hk = 1, Nq = 3, Nk = 4, D = 5, Dv = 6 };
  arena a = {{0}, 0};
  tu_rng r = {5};
  const int64_t qs[4] = {B, Hq, Nq, D}, ks[4] = {B, Hk, Nk, D}, vs[4] = {B, Hk, Nk, Dv}, os[4] = {B, Hq, Nq, Dv};
  const int64_t ls[3] = {B, Hq, Nq}, fs[4] = {B, Hq, Nq, Nk};
  attn_tensor q = make4(&a, &r, qs, ATTN_F32, 0, 1), k = make4(&a, &r, ks, ATTN_F32, 0, 1);
  attn_tensor v = make4(&a, &r, vs, ATTN_F32, 0, 1), dout = make4(&a, &r, os, ATTN_F32, 0, 1);
  attn_tensor out = make4(&a, &r, os, ATTN_F32, 0, 0), lse = make_nan(&a, ATTN_F32, 3, ls);
  attn_tensor dq = make4(&a, &r, qs, ATTN_F32, 0, 0), dk = make4(&a, &r, ks, ATTN_F32, 0, 0);
  attn_tensor dv = make4(&a, &r, vs, ATTN_F32, 0, 0), mg = make4(&a, &r, fs, ATTN_F32, 0, 0);
  attn_tensor dq64 = make4(&a, &r, qs, ATTN_F64, 0, 0), mg64 = make4(&a, &r, fs, ATTN_F64, 0, 0);
  attn_tensor add = make4(&a, &r, fs, ATTN_F32, 0, 1);
  uint8_t keepbuf[B * Hq * Nq * Nk];
  memset(keepbuf, 1, sizeof keepbuf);
  attn_tensor keep = attn_tensor_view(keepbuf, ATTN_BOOL, 4, fs);
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  CHECK(o.dropout_p == 0 && o.dropout_seed == 0, "attn_sdpa_opts_init: dropout off");
  CHECK_OK(ctx, attn_sdpa(ctx, &out, &lse, NULL, &q, &k, &v, &o));
  CHECK_OK(ctx, attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &o));
  CHECK_OK(ctx, attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse,
                                   NULL)); /* NULL opts: defaults */

#define EXPECT(want, call, what)                                                                                 \
  do {                                                                                                            \
    attn_status st_ = (call);                                                                                     \
    CHECK(st_ == (want) && attn_ctx_error(ctx)[0] != '\0', "%s: got %s (%s), want %s", what, attn_strerror(st_), \
          attn_ctx_error(ctx), attn_strerror(want));                                                              \
  } while (0)
  /* NULLs */
  EXPECT(ATTN_E_INVALID, attn_sdpa_backward(ctx, NULL, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &o),
         "dq NULL");
  EXPECT(ATTN_E_INVALID, attn_sdpa_backward(ctx, &dq, NULL, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &o),
         "dk NULL");
  EXPECT(ATTN_E_INVALID, attn_sdpa_backward(ctx, &dq, &dk, NULL, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &o),
         "dv NULL");
  EXPECT(ATTN_E_INVALID, attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, NULL, &q, &k, &v, &out, &lse, &o),
         "dout NULL");
  EXPECT(ATTN_E_INVALID, attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, &dout, NULL, &k, &v, &out, &lse, &o),
         "q NULL");
  EXPECT(ATTN_E_INVALID, attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, &dout, &q, &k, NULL, &out, &lse, &o),
         "v NULL");
  EXPECT(ATTN_E_INVALID, attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, NULL, &lse, &o),
         "out NULL");
  EXPECT(ATTN_E_INVALID, attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, NULL, &o),
         "lse NULL");
  EXPECT(ATTN_E_INVALID, attn_sdpa_backward_ref(ctx, &dq, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, NULL, &o),
         "lse NULL (oracle)");
  attn_tensor nodata = dq;
  nodata.data = NULL;
  EXPECT(ATTN_E_INVALID, attn_sdpa_backward(ctx, &nodata, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &o),
         "dq data NULL");

  /* shapes */
  attn_tensor bad = dq;
  bad.shape[3] = D - 1;
  EXPECT(ATTN_E_SHAPE, attn_sdpa_backward(ctx, &bad, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &o),
         "dq [.., D-1]");
  CHECK(strstr(attn_ctx_error(ctx), "dq") != NULL, "message names dq: %s", attn_ctx_error(ctx));
  bad = dk;
  bad.shape[1] = 2;
  EXPECT(ATTN_E_SHAPE, attn_sdpa_backward(ctx, &dq, &bad, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &o),
         "dk with Hq heads");
  bad = dv;
  bad.shape[2] = Nk - 1;
  EXPECT(ATTN_E_SHAPE, attn_sdpa_backward(ctx, &dq, &dk, &bad, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &o),
         "dv [.., Nk-1, ..]");
  bad = dout;
  bad.shape[3] = Dv - 1;
  EXPECT(ATTN_E_SHAPE, attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, &bad, &q, &k, &v, &out, &lse, &o),
         "dout [.., Dv-1]");
  CHECK(strstr(attn_ctx_error(ctx), "dout") != NULL, "message names dout: %s", attn_ctx_error(ctx));
  bad = out;
  bad.shape[2] = Nq + 1;
  EXPECT(ATTN_E_SHAPE, attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &bad, &lse, &o),
         "out [.., Nq+1, ..]");
  bad = lse;
  bad.shape[2] = Nq - 1;
  EXPECT(ATTN_E_SHAPE, attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &bad, &o),
         "lse [.., Nq-1]");
  CHECK(strstr(attn_ctx_error(ctx), "lse") != NULL, "message names lse: %s", attn_ctx_error(ctx));
  EXPECT(ATTN_E_SHAPE, attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &dout, &o),
         "lse of rank 4");
  bad = dq;
  bad.rank = 3;
  EXPECT(ATTN_E_SHAPE, attn_sdpa_backward(ctx, &bad, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &o),
         "dq of rank 3");
  bad = dq;
  bad.strides[2] = 0;
  EXPECT(ATTN_E_INVALID, attn_sdpa_backward(ctx, &bad, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &o),
         "dq broadcast");
  bad = k;
  bad.shape[3] = D + 1;
  EXPECT(ATTN_E_SHAPE, attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, &dout, &q, &bad, &v, &out, &lse, &o),
         "k of another D");

  /* dtypes: the fp32 kernels take f32, the oracle f32 or f64 gradients */
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_C);
  EXPECT(ATTN_E_DTYPE, attn_sdpa_backward(ctx, &dq64, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &o),
         "f64 dq, fp32 path");
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_REF);
  CHECK_OK(ctx, attn_sdpa_backward(ctx, &dq64, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &o));
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  CHECK_OK(ctx, attn_sdpa_backward_ref(ctx, &dq64, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &o));
  attn_tensor ub = dq;
  ub.dtype = ATTN_BOOL;
  EXPECT(ATTN_E_DTYPE, attn_sdpa_backward_ref(ctx, &ub, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &o),
         "bool dq");

  /* dropout_p */
  const double bad_p[] = {1.0000001, 1.5, -0.1, NAN, INFINITY};
  for (size_t i = 0; i < sizeof bad_p / sizeof bad_p[0]; i++) {
    attn_sdpa_opts od = o;
    od.dropout_p = bad_p[i];
    char what[64];
    snprintf(what, sizeof what, "dropout_p = %g", bad_p[i]);
    EXPECT(ATTN_E_INVALID, attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &od),
           what);
    CHECK(strstr(attn_ctx_error(ctx), "dropout_p") != NULL, "message names dropout_p: %s", attn_ctx_error(ctx));
    EXPECT(ATTN_E_INVALID, attn_sdpa_backward_ref(ctx, &dq, &dk, &dv, NULL, NULL, &dout, &q, &k, &v, &out, &lse, &od),
           what);
    EXPECT(ATTN_E_INVALID, attn_sdpa(ctx, &out, NULL, NULL, &q, &k, &v, &od), what);
    EXPECT(ATTN_E_INVALID, attn_sdpa_ref(ctx, &out, NULL, NULL, &q, &k, &v, &od), what);
  }

  /* mask_grad: only with an additive mask, [B, Hq, Nq, Nk], writable */
  attn_sdpa_opts om = o;
  EXPECT(ATTN_E_INVALID, attn_sdpa_backward(ctx, &dq, &dk, &dv, &mg, NULL, &dout, &q, &k, &v, &out, &lse, &om),
         "mask_grad, no mask");
  CHECK(strstr(attn_ctx_error(ctx), "mask_grad") != NULL, "message names mask_grad: %s", attn_ctx_error(ctx));
  om.mask = &keep;
  om.mask_mode = ATTN_MASK_KEEP;
  EXPECT(ATTN_E_INVALID, attn_sdpa_backward(ctx, &dq, &dk, &dv, &mg, NULL, &dout, &q, &k, &v, &out, &lse, &om),
         "mask_grad with a keep mask");
  om.mask = &add;
  om.mask_mode = ATTN_MASK_SEED;
  EXPECT(ATTN_E_INVALID, attn_sdpa_backward(ctx, &dq, &dk, &dv, &mg, NULL, &dout, &q, &k, &v, &out, &lse, &om),
         "mask_grad with a seed mask");
  om.mask_mode = ATTN_MASK_ADDITIVE;
  CHECK_OK(ctx, attn_sdpa_backward(ctx, &dq, &dk, &dv, &mg, NULL, &dout, &q, &k, &v, &out, &lse, &om));
  bad = mg;
  bad.shape[1] = 1;
  EXPECT(ATTN_E_SHAPE, attn_sdpa_backward(ctx, &dq, &dk, &dv, &bad, NULL, &dout, &q, &k, &v, &out, &lse, &om),
         "mask_grad [B, 1, Nq, Nk]");
  bad = mg;
  bad.strides[0] = 0;
  EXPECT(ATTN_E_INVALID, attn_sdpa_backward(ctx, &dq, &dk, &dv, &bad, NULL, &dout, &q, &k, &v, &out, &lse, &om),
         "mask_grad broadcast");
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_C);
  EXPECT(ATTN_E_DTYPE, attn_sdpa_backward(ctx, &dq, &dk, &dv, &mg64, NULL, &dout, &q, &k, &v, &out, &lse, &om),
         "f64 mask_grad, fp32 path");
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  CHECK_OK(ctx, attn_sdpa_backward_ref(ctx, &dq, &dk, &dv, &mg64, NULL, &dout, &q, &k, &v, &out, &lse, &om));
#undef EXPECT
  arena_free(&a);
}

/* ---- (e) PyTorch goldens ------------------------------------------------------------------ */
static void strip_eol(char *s) {
  size_t n = strlen(s);
  while (n > 0 && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ')) s[--n] = '\0';
}

/* The value of key in golden/<cas>/case.txt into val ("" when absent). */
static void manifest_value(const char *cas, const char *key, char *val, size_t cap) {
  char path[512], line[512];
  snprintf(path, sizeof path, "golden/%s/case.txt", cas);
  val[0] = '\0';
  FILE *f = fopen(path, "r");
  if (!f) return;
  const size_t kl = strlen(key);
  while (fgets(line, sizeof line, f)) {
    strip_eol(line);
    if (strncmp(line, key, kl) == 0 && line[kl] == '=') {
      snprintf(val, cap, "%s", line + kl + 1);
      break;
    }
  }
  fclose(f);
}

static int load(attn_ctx *ctx, const char *cas, const char *file, attn_tensor *t, int required) {
  char path[512];
  snprintf(path, sizeof path, "golden/%s/%s.npy", cas, file);
  memset(t, 0, sizeof *t);
  FILE *f = fopen(path, "rb");
  if (!f) {
    CHECK(!required, "%s: missing %s", cas, path);
    return 0;
  }
  fclose(f);
  attn_status st = attn_npy_read(ctx, t, path);
  CHECK(st == ATTN_OK, "%s: attn_npy_read(%s): %s", cas, path, attn_ctx_error(ctx));
  if (st) memset(t, 0, sizeof *t);
  return st == ATTN_OK;
}

static void tfree(attn_tensor *t) {
  if (t->data) attn_tensor_free(t);
  memset(t, 0, sizeof *t);
}

static void gold_compare(const char *cas, const char *pass, const char *what, const attn_tensor *got,
                         const attn_tensor *want, double tol) {
  int same = got->rank == want->rank;
  for (int i = 0; same && i < got->rank; i++) same = got->shape[i] == want->shape[i];
  CHECK(same, "%s [%s] %s: shape differs from the golden", cas, pass, what);
  if (!same) return;
  const int64_t n = attn_tensor_numel(want);
  double *g = tu_to_f64(got), *w = tu_to_f64(want);
  const double e = tu_rel_l2(g, w, n);
  CHECK(e <= tol, "%s [%s] %s: rel L2 %.3g > %.0e", cas, pass, what, e, tol);
  free(g);
  free(w);
}

static void golden_case(attn_ctx *ctx, const char *cas) {
  char val[256];
  attn_tensor q, k, v, G, gdq, gdk, gdv, mask, pad, gdm, alibi, sinks, gds;
  int ok = load(ctx, cas, "q", &q, 1) & load(ctx, cas, "k", &k, 1) & load(ctx, cas, "v", &v, 1) &
           load(ctx, cas, "G", &G, 1) & load(ctx, cas, "dq", &gdq, 1) & load(ctx, cas, "dk", &gdk, 1) &
           load(ctx, cas, "dv", &gdv, 1);
  const int has_mask = load(ctx, cas, "mask", &mask, 0), has_pad = load(ctx, cas, "key_padding", &pad, 0);
  const int has_dm = load(ctx, cas, "dmask", &gdm, 0);
  const int has_alibi = load(ctx, cas, "alibi", &alibi, 0), has_sinks = load(ctx, cas, "sinks", &sinks, 0);
  const int has_ds = load(ctx, cas, "dsinks", &gds, has_sinks);
  ok = ok && q.dtype == ATTN_F32 && k.dtype == ATTN_F32 && v.dtype == ATTN_F32 && G.dtype == ATTN_F32 && q.rank == 4;
  ok = ok && (!has_alibi || alibi.dtype == ATTN_F32) && (!has_sinks || (sinks.dtype == ATTN_F32 && has_ds));
  CHECK(ok, "%s: cannot use the golden's arrays", cas);
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  /* the options of recent models (absent: off) */
  manifest_value(cas, "window", val, sizeof val);
  o.window = val[0] ? strtoll(val, NULL, 10) : 0;
  manifest_value(cas, "softcap", val, sizeof val);
  o.softcap = val[0] ? strtod(val, NULL) : 0;
  manifest_value(cas, "dropout_p", val, sizeof val);
  o.dropout_p = val[0] ? strtod(val, NULL) : 0;
  manifest_value(cas, "dropout_seed", val, sizeof val);
  o.dropout_seed = val[0] ? strtoull(val, NULL, 10) : 0;
  if (has_alibi) o.alibi_slopes = &alibi;
  if (has_sinks) o.sinks = &sinks;
  manifest_value(cas, "scale", val, sizeof val);
  o.scale = (!val[0] || strcmp(val, "default") == 0) ? NAN : strtod(val, NULL);
  manifest_value(cas, "causal", val, sizeof val);
  o.causal = strcmp(val, "top_left") == 0 ? ATTN_CAUSAL_TOP_LEFT
             : strcmp(val, "bottom_right") == 0 ? ATTN_CAUSAL_BOTTOM_RIGHT : ATTN_CAUSAL_NONE;
  manifest_value(cas, "mask_mode", val, sizeof val);
  const int mode = strcmp(val, "keep") == 0 ? ATTN_MASK_KEEP : strcmp(val, "masked") == 0 ? ATTN_MASK_MASKED
                   : strcmp(val, "additive") == 0 ? ATTN_MASK_ADDITIVE : strcmp(val, "seed") == 0 ? ATTN_MASK_SEED : -1;
  if (mode >= 0) {
    CHECK(has_mask, "%s: mask_mode %s without mask.npy", cas, val);
    ok = ok && has_mask;
    o.mask = &mask;
    o.mask_mode = (attn_mask_mode)mode;
  }
  if (has_pad) o.key_padding = &pad;
  CHECK(!has_dm || mode == ATTN_MASK_ADDITIVE, "%s: dmask.npy for a mask that is not additive", cas);

  for (int pass = 0; ok && pass < 2; pass++) {
    /* pass 0: the oracle in f64 from its own forward; pass 1: the fp32 forward and attn_sdpa_backward */
    const attn_dtype dt = pass == 0 ? ATTN_F64 : ATTN_F32;
    const char *pname = pass == 0 ? "oracle" : "attn_sdpa_backward";
    const double tol = pass == 0 ? TOL_GOLD_REF : TOL_FP32;
    const int64_t B = q.shape[0], Hq = q.shape[1], Nq = q.shape[2], Nk = k.shape[2];
    const int64_t os[4] = {B, Hq, Nq, v.shape[3]}, ls[3] = {B, Hq, Nq}, fs[4] = {B, Hq, Nq, Nk};
    attn_tensor out, lse, dq, dk, dv, mg, ds;
    const int64_t hs[1] = {Hq};
    int good = attn_tensor_alloc(ctx, &out, dt, 4, os) == ATTN_OK;
    good &= attn_tensor_alloc(ctx, &ds, ATTN_F32, 1, hs) == ATTN_OK; /* sinks_grad is f32 on every path */
    good &= attn_tensor_alloc(ctx, &lse, dt, 3, ls) == ATTN_OK;
    good &= attn_tensor_alloc(ctx, &dq, dt, 4, gdq.shape) == ATTN_OK;
    good &= attn_tensor_alloc(ctx, &dk, dt, 4, gdk.shape) == ATTN_OK;
    good &= attn_tensor_alloc(ctx, &dv, dt, 4, gdv.shape) == ATTN_OK;
    good &= attn_tensor_alloc(ctx, &mg, dt, 4, fs) == ATTN_OK;
    CHECK(good, "%s: alloc", cas);
    if (!good) break;
    attn_sdpa_opts of = o;
    attn_status st = pass == 0 ? attn_sdpa_ref(ctx, &out, &lse, NULL, &q, &k, &v, &of)
                               : attn_sdpa(ctx, &out, &lse, NULL, &q, &k, &v, &of);
    CHECK(st == ATTN_OK, "%s [%s] forward: %s", cas, pname, attn_ctx_error(ctx));
    attn_sdpa_opts ob = o;
    if (st == ATTN_OK) {
      st = pass == 0 ? attn_sdpa_backward_ref(ctx, &dq, &dk, &dv, has_dm ? &mg : NULL, has_sinks ? &ds : NULL, &G, &q,
                                              &k, &v, &out, &lse, &ob)
                     : attn_sdpa_backward(ctx, &dq, &dk, &dv, has_dm ? &mg : NULL, has_sinks ? &ds : NULL, &G, &q, &k,
                                          &v, &out, &lse, &ob);
      CHECK(st == ATTN_OK, "%s [%s] backward: %s", cas, pname, attn_ctx_error(ctx));
    }
    if (st == ATTN_OK) {
      gold_compare(cas, pname, "dq", &dq, &gdq, tol);
      gold_compare(cas, pname, "dk", &dk, &gdk, tol);
      gold_compare(cas, pname, "dv", &dv, &gdv, tol);
      if (has_sinks) gold_compare(cas, pname, "dsinks", &ds, &gds, pass == 0 ? 1e-6 : TOL_FP32); /* f32 */
      if (has_dm) {
        double *full = tu_to_f64(&mg), *red = reduce_to(full, fs, &mask), *want = tu_to_f64(&gdm);
        const double e = tu_rel_l2(red, want, attn_tensor_numel(&gdm));
        CHECK(attn_tensor_numel(&gdm) == attn_tensor_numel(&mask) && e <= tol, "%s [%s] dmask: rel L2 %.3g > %.0e",
              cas, pname, e, tol);
        free(full);
        free(red);
        free(want);
      }
    }
    tfree(&out); tfree(&lse); tfree(&dq); tfree(&dk); tfree(&dv); tfree(&mg); tfree(&ds);
  }
  tfree(&q); tfree(&k); tfree(&v); tfree(&G); tfree(&gdq); tfree(&gdk); tfree(&gdv);
  tfree(&mask); tfree(&pad); tfree(&gdm); tfree(&alibi); tfree(&sinks); tfree(&gds);
}

static void goldens(attn_ctx *ctx) {
  FILE *index = fopen("golden/INDEX", "r");
  CHECK(index != NULL, "cannot open golden/INDEX (run from tests/)");
  if (!index) return;
  char line[256], val[64];
  int cases = 0;
  while (fgets(line, sizeof line, index)) {
    strip_eol(line);
    if (!line[0] || line[0] == '#') continue;
    manifest_value(line, "backward", val, sizeof val);
    if (strcmp(val, "1") != 0) continue;
    const int before = tu_failures;
    golden_case(ctx, line);
    printf("  golden %-22s %s\n", line, tu_failures == before ? "ok" : "FAILED");
    cases++;
  }
  fclose(index);
  CHECK(cases >= 5, "only %d golden cases with backward=1", cases);
}

int main(int argc, char **argv) {
  /* ctest runs this again with ATTN_KERNEL set: a kernel this CPU lacks is a skip */
  tu_kernel_or_skip(getenv("ATTN_KERNEL"));
  attn_ctx *ctx = NULL;
  CHECK_OK(ctx, attn_ctx_create(&ctx));
  if (!ctx) return tu_finish("test_backward");
  const int cases = argc > 1 ? atoi(argv[1]) : 40;
  printf("default kernel: %s\n", attn_kernel_name(attn_ctx_kernel(ctx)));
  finite_differences(ctx);
  philox_known_answers();
  dropout_statistics(ctx);
  for (int i = 0; i < cases; i++) random_case(ctx, 7000 + (uint64_t)i);
  error_paths(ctx);
  goldens(ctx);
  attn_ctx_destroy(ctx);
  return tu_finish("test_backward");
}
