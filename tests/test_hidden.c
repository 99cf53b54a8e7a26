/* Hidden keys are never read (src/logit.h defines the hidden set): a key that
 * the causal bound, the window, the chunk, the key padding or the mask hides from every
 * row holds NaN, +Inf or -Inf in K and V here, and out, weights, lse and every
 * gradient must equal the float64 oracle's on clean inputs. Run once per
 * kernel (the argument: ref, c, avx2, avx512; a kernel this CPU lacks is
 * skipped), through the blocked kernel and the decode kernel, on 1 and 3
 * threads, then through the KV cache (a poisoned tail past each row's length)
 * and the layer (NaN in the padded rows of key and value). The hidden set is
 * written out again here, independently of the library's definition.
 * With avx512bf16 the forward runs on the bf16 tiles (precision BF16, inputs
 * already bf16 values so the oracle sees what the tiles see); its out is held
 * to the bf16 bound, and its backward (fp32, as avx512's) is not repeated.
 * With amx a quarter of the cases are f16, forward and backward on its f16
 * tiles (bf16 hi + lo), the poison in f16 too. On either, bf16 tensors with
 * only a band hiding keys (band_poison), the poison in bf16; with amx the same
 * in f16 on its f16 tiles. */
#include "testutil.h"

enum { MAX_CASES = 400 };

static int half_tiles; /* the kernel under test has bf16 tiles (1: avx512bf16, 2: amx): the forward runs on them */
static int f16_inputs; /* this case's q, k and v are f16 (amx: its f16 tiles) */
static int half_bwd_runs[2]; /* backward runs on the bf16 and on the f16 tiles */
/* out's rel L2 error bound on the bf16 tiles: the probabilities rounded to bf16 (2^-9) */
#define HALF_OUT_TOL 1e-2

typedef struct hcase {
  int64_t B, Hq, Hk, Nq, Nk, D, Dv;
  attn_causal causal;
  int64_t window;
  int kpm;          /* key padding: row b holds keys [0, len[b]) */
  int64_t len[2];
  int mask;         /* 0 none, else 1 + attn_mask_mode (KEEP, MASKED, ADDITIVE) */
  double softcap;
  int alibi, sinks, weights;
  double dropout;
  int poison;       /* 0 NaN, 1 +Inf, 2 -Inf; K and V get it (V the next kind) */
  int64_t chunk;
} hcase;

static float poison_value(int kind) { return kind == 0 ? NAN : kind == 1 ? INFINITY : -INFINITY; }

/* The hidden set, from the documentation of attn_sdpa_opts: mask entry m of the
 * full [B, Hq, Nq, Nk] mask (0 = hidden for KEEP, nonzero for MASKED, -inf for ADDITIVE). */
static int is_hidden(const hcase *c, const double *mask, int64_t b, int64_t h, int64_t i, int64_t j) {
  attn_causal causal = c->causal;
  if ((c->window > 0 || c->chunk > 0) && causal == ATTN_CAUSAL_NONE) causal = ATTN_CAUSAL_TOP_LEFT;
  const int64_t pos = causal == ATTN_CAUSAL_BOTTOM_RIGHT ? i + c->Nk - c->Nq : i;
  if (causal != ATTN_CAUSAL_NONE && j > pos) return 1;
  if (c->window > 0 && j <= pos - c->window) return 1;
  if (c->chunk > 0 && j / c->chunk != pos / c->chunk) return 1; /* j <= pos here, so pos >= 0 */
  if (c->kpm && j >= c->len[b]) return 1;
  if (c->mask) {
    const double m = mask[((b * c->Hq + h) * c->Nq + i) * c->Nk + j];
    if (c->mask == 1 + ATTN_MASK_KEEP && m == 0) return 1;
    if (c->mask == 1 + ATTN_MASK_MASKED && m != 0) return 1;
    if (c->mask == 1 + ATTN_MASK_ADDITIVE && m == -INFINITY) return 1;
  }
  return 0;
}

static hcase random_case(tu_rng *r, int decode) {
  hcase c;
  memset(&c, 0, sizeof c);
  c.B = tu_int(r, 1, 2);
  c.Hk = tu_int(r, 1, 2);
  c.Hq = c.Hk * tu_int(r, 1, 3);
  c.Nq = decode ? tu_int(r, 1, 8 / (c.Hq / c.Hk)) : tu_int(r, 1, 70);
  c.Nk = tu_int(r, 1, 150);
  const int64_t dims[] = {1, 4, 16, 33, 64, 72}, amx_dims[] = {32, 64, 96, 16, 33, 64};
  const int64_t *dd = half_tiles == 2 ? amx_dims : dims; /* AMX: whole and padded 16-pair steps of D */
  c.D = dd[tu_int(r, 0, 5)];
  c.Dv = tu_int(r, 0, 3) ? c.D : dd[tu_int(r, 0, 5)];
  c.causal = (attn_causal)tu_int(r, 0, 2);
  c.window = tu_int(r, 0, 3) == 0 ? tu_int(r, 1, 40) : 0;
  c.kpm = tu_int(r, 0, 2) != 0;
  for (int b = 0; b < 2; b++) c.len[b] = tu_int(r, 0, c.Nk); /* a row may hold nothing */
  c.mask = (int)tu_int(r, 0, 3);
  c.softcap = tu_int(r, 0, 3) == 0 ? 2.5 + tu_uniform(r) : 0;
  c.alibi = tu_int(r, 0, 3) == 0;
  c.sinks = tu_int(r, 0, 3) == 0;
  c.weights = !decode && tu_int(r, 0, 2) == 0;
  c.dropout = !decode && tu_int(r, 0, 4) == 0 ? 0.25 : 0;
  c.poison = (int)tu_int(r, 0, 2);
  c.chunk = tu_int(r, 0, 3) == 0 ? tu_int(r, 1, 60) : 0;
  return c;
}

typedef struct problem {
  arena a;
  float *q, *k, *v, *kp, *vp, *dout, *slopes, *sinkv;
  double *mask;              /* the full mask as doubles, for is_hidden */
  void *maskbuf;             /* as the library reads it */
  uint8_t *kpmbuf;
  uint8_t *dead;             /* [B, Hk, Nk]: hidden from every row of the group: poisoned */
  int64_t ndead;
  attn_tensor tq, tk, tv, tkp, tvp, tmask, tkpm, tslopes, tsinks, tdout;
} problem;

static void build(problem *P, const hcase *c, tu_rng *r) {
  memset(P, 0, sizeof *P);
  arena *a = &P->a;
  const int64_t nq = c->B * c->Hq * c->Nq * c->D, nk = c->B * c->Hk * c->Nk * c->D, nv = c->B * c->Hk * c->Nk * c->Dv;
  const int64_t nm = c->B * c->Hq * c->Nq * c->Nk;
  P->q = arena_alloc(a, sizeof(float) * nq);
  P->k = arena_alloc(a, sizeof(float) * nk);
  P->v = arena_alloc(a, sizeof(float) * nv);
  P->kp = arena_alloc(a, sizeof(float) * nk);
  P->vp = arena_alloc(a, sizeof(float) * nv);
  P->dout = arena_alloc(a, sizeof(float) * c->B * c->Hq * c->Nq * c->Dv);
  tu_fill_f32(r, P->q, nq, 1.5);
  tu_fill_f32(r, P->k, nk, 1.5);
  tu_fill_f32(r, P->v, nv, 1);
  tu_fill_f32(r, P->dout, c->B * c->Hq * c->Nq * c->Dv, 1);
  const attn_dtype rt = f16_inputs ? ATTN_F16 : ATTN_BF16;
  for (int64_t e = 0; half_tiles && e < nq; e++) P->q[e] = tu_round_through(P->q[e], rt);
  for (int64_t e = 0; half_tiles && e < nk; e++) P->k[e] = tu_round_through(P->k[e], rt);
  for (int64_t e = 0; half_tiles && e < nv; e++) P->v[e] = tu_round_through(P->v[e], rt);
  P->mask = arena_alloc(a, sizeof(double) * (nm ? nm : 1));
  /* the mask hides whole columns of a row (as padding does) and scattered entries */
  for (int64_t e = 0; e < nm; e++) {
    const int64_t j = e % c->Nk, b = e / (c->Hq * c->Nq * c->Nk);
    const int col_dead = (j * 7 + b) % 5 == 0, dead = col_dead || tu_int(r, 0, 6) == 0;
    if (c->mask == 1 + ATTN_MASK_KEEP) P->mask[e] = !dead;
    else if (c->mask == 1 + ATTN_MASK_MASKED) P->mask[e] = dead ? 1 + (double)tu_int(r, 0, 3) : 0;
    else P->mask[e] = dead ? -INFINITY : 0.5 * tu_uniform(r);
  }
  const int64_t s4q[4] = {c->B, c->Hq, c->Nq, c->D}, s4k[4] = {c->B, c->Hk, c->Nk, c->D};
  const int64_t s4v[4] = {c->B, c->Hk, c->Nk, c->Dv}, s4m[4] = {c->B, c->Hq, c->Nq, c->Nk};
  const int64_t s4o[4] = {c->B, c->Hq, c->Nq, c->Dv}, s2p[2] = {c->B, c->Nk}, s1h[1] = {c->Hq};
  if (c->mask) {
    if (c->mask == 1 + ATTN_MASK_ADDITIVE) {
      float *m = arena_alloc(a, sizeof(float) * (nm ? nm : 1));
      for (int64_t e = 0; e < nm; e++) m[e] = (float)P->mask[e];
      P->maskbuf = m;
      P->tmask = attn_tensor_view(m, ATTN_F32, 4, s4m);
    } else {
      uint8_t *m = arena_alloc(a, (size_t)(nm ? nm : 1));
      for (int64_t e = 0; e < nm; e++) m[e] = (uint8_t)P->mask[e];
      P->maskbuf = m;
      P->tmask = attn_tensor_view(m, c->mask == 1 + ATTN_MASK_KEEP ? ATTN_BOOL : ATTN_U8, 4, s4m);
    }
  }
  P->kpmbuf = arena_alloc(a, (size_t)(c->B * c->Nk + 1));
  for (int64_t b = 0; b < c->B; b++)
    for (int64_t j = 0; j < c->Nk; j++) P->kpmbuf[b * c->Nk + j] = j >= c->len[b];
  P->tkpm = attn_tensor_view(P->kpmbuf, ATTN_BOOL, 2, s2p);
  P->slopes = arena_alloc(a, sizeof(float) * c->Hq);
  attn_alibi_slopes(P->slopes, c->Hq);
  P->sinkv = arena_alloc(a, sizeof(float) * c->Hq);
  tu_fill_f32(r, P->sinkv, c->Hq, 1);
  P->tslopes = attn_tensor_view(P->slopes, ATTN_F32, 1, s1h);
  P->tsinks = attn_tensor_view(P->sinkv, ATTN_F32, 1, s1h);
  /* keys hidden from every row of every head of their group get the poison */
  P->dead = arena_alloc(a, (size_t)(c->B * c->Hk * c->Nk + 1));
  memcpy(P->kp, P->k, sizeof(float) * nk);
  memcpy(P->vp, P->v, sizeof(float) * nv);
  const int64_t G = c->Hq / c->Hk;
  for (int64_t b = 0; b < c->B; b++)
    for (int64_t g = 0; g < c->Hk; g++)
      for (int64_t j = 0; j < c->Nk; j++) {
        int dead = 1;
        for (int64_t h = g * G; h < (g + 1) * G && dead; h++)
          for (int64_t i = 0; i < c->Nq && dead; i++) dead = is_hidden(c, P->mask, b, h, i, j);
        const int64_t row = (b * c->Hk + g) * c->Nk + j;
        P->dead[row] = (uint8_t)dead;
        if (!dead) continue;
        P->ndead++;
        for (int64_t d = 0; d < c->D; d++) P->kp[row * c->D + d] = poison_value(c->poison);
        for (int64_t d = 0; d < c->Dv; d++) P->vp[row * c->Dv + d] = poison_value((c->poison + 1) % 3);
      }
  P->tq = attn_tensor_view(P->q, ATTN_F32, 4, s4q);
  P->tk = attn_tensor_view(P->k, ATTN_F32, 4, s4k);
  P->tv = attn_tensor_view(P->v, ATTN_F32, 4, s4v);
  P->tkp = attn_tensor_view(P->kp, ATTN_F32, 4, s4k);
  P->tvp = attn_tensor_view(P->vp, ATTN_F32, 4, s4v);
  P->tdout = attn_tensor_view(P->dout, ATTN_F32, 4, s4o);
}

static void options(attn_sdpa_opts *o, const hcase *c, problem *P) {
  attn_sdpa_opts_init(o);
  o->causal = c->causal;
  o->window = c->window;
  o->chunk = c->chunk;
  o->softcap = c->softcap;
  o->dropout_p = c->dropout;
  o->dropout_seed = 1234;
  if (c->kpm) o->key_padding = &P->tkpm;
  if (c->mask) {
    o->mask = &P->tmask;
    o->mask_mode = (attn_mask_mode)(c->mask - 1);
  }
  if (c->alibi) o->alibi_slopes = &P->tslopes;
  if (c->sinks) o->sinks = &P->tsinks;
}

/* Worst relative L2 error per tensor, and whether got has a non-finite value where want has none. */
static int agrees(const attn_tensor *got, const double *want, int64_t n, double tol, double *err) {
  double *g = tu_to_f64(got);
  int bad = 0;
  for (int64_t e = 0; e < n; e++) bad |= isfinite(want[e]) && !isfinite(g[e]);
  /* -inf lse (rows with nothing visible) compare as equal */
  double *gw = malloc(sizeof(double) * (size_t)(n ? n : 1)), *ww = malloc(sizeof(double) * (size_t)(n ? n : 1));
  for (int64_t e = 0; e < n; e++) {
    const int both_ninf = g[e] == -INFINITY && want[e] == -INFINITY;
    gw[e] = both_ninf ? 0 : g[e];
    ww[e] = both_ninf ? 0 : want[e];
    bad |= (want[e] == -INFINITY) != (g[e] == -INFINITY);
  }
  *err = tu_rel_l2(gw, ww, n);
  free(g), free(gw), free(ww);
  return !bad && *err <= tol;
}

static void describe(char *buf, size_t n, const hcase *c, int seed) {
  snprintf(buf, n,
           "case %d: B%lld Hq%lld Hk%lld Nq%lld Nk%lld D%lld Dv%lld causal %d window %lld kpm %d mask %d softcap %g "
           "alibi %d sinks %d weights %d dropout %g poison %d chunk %lld",
           seed, (long long)c->B, (long long)c->Hq, (long long)c->Hk, (long long)c->Nq, (long long)c->Nk,
           (long long)c->D, (long long)c->Dv, (int)c->causal, (long long)c->window, c->kpm, c->mask, c->softcap,
           c->alibi, c->sinks, c->weights, c->dropout, c->poison, (long long)c->chunk);
}

/* One case on one context: forward (out, weights, lse) and backward against the oracle on clean inputs. */
static void run_case(attn_ctx *ctx, attn_ctx *oracle, const hcase *c, int seed, const char *path) {
  tu_rng r = {(uint64_t)seed * 7919u + 17};
  problem P;
  build(&P, c, &r);
  char desc[512];
  describe(desc, sizeof desc, c, seed);
  const int64_t no = c->B * c->Hq * c->Nq * c->Dv, nw = c->B * c->Hq * c->Nq * c->Nk, nl = c->B * c->Hq * c->Nq;
  const int64_t s4o[4] = {c->B, c->Hq, c->Nq, c->Dv}, s4w[4] = {c->B, c->Hq, c->Nq, c->Nk}, s3l[3] = {c->B, c->Hq, c->Nq};
  arena *a = &P.a;
  double *ro = arena_alloc(a, sizeof(double) * (no ? no : 1)), *rw = arena_alloc(a, sizeof(double) * (nw ? nw : 1));
  double *rl = arena_alloc(a, sizeof(double) * (nl ? nl : 1));
  attn_tensor tro = attn_tensor_view(ro, ATTN_F64, 4, s4o), trw = attn_tensor_view(rw, ATTN_F64, 4, s4w);
  attn_tensor trl = attn_tensor_view(rl, ATTN_F64, 3, s3l);
  attn_sdpa_opts o;
  options(&o, c, &P);
  CHECK_OK(oracle, attn_sdpa_ref(oracle, &tro, &trl, &trw, &P.tq, &P.tk, &P.tv, &o));

  float *out = arena_alloc(a, sizeof(float) * (no ? no : 1)), *w = arena_alloc(a, sizeof(float) * (nw ? nw : 1));
  float *lse = arena_alloc(a, sizeof(float) * (nl ? nl : 1));
  tu_poison_f32(out, no), tu_poison_f32(w, nw), tu_poison_f32(lse, nl);
  attn_tensor to = attn_tensor_view(out, ATTN_F32, 4, s4o), tw = attn_tensor_view(w, ATTN_F32, 4, s4w);
  attn_tensor tl = attn_tensor_view(lse, ATTN_F32, 3, s3l);
  attn_tensor tq = P.tq, tkp = P.tkp, tvp = P.tvp; /* as f16 (the poison too) for f16 cases */
  if (f16_inputs) {
    attn_tensor *ts[3] = {&tq, &tkp, &tvp};
    for (int i = 0; i < 3; i++) {
      const attn_tensor src = *ts[i];
      *ts[i] = attn_tensor_view(arena_alloc(a, 2 * (size_t)attn_tensor_numel(&src) + 2), ATTN_F16, 4, src.shape);
      CHECK_OK(ctx, attn_tensor_copy(ctx, ts[i], &src));
    }
  }
  attn_status st = attn_sdpa(ctx, &to, &tl, c->weights ? &tw : NULL, &tq, &tkp, &tvp, &o);
  CHECK(st == ATTN_OK, "%s %s: %s", path, desc, attn_ctx_error(ctx));
  if (st) {
    arena_free(a);
    return;
  }
  /* the oracle on poisoned inputs must be the oracle on clean ones (to f32's rounding of its outputs) */
  const int exact = attn_ctx_kernel(ctx) == ATTN_KERNEL_REF;
  const double tol = exact ? 2e-7 : 2e-5;
  double e;
  CHECK(agrees(&to, ro, no, half_tiles ? HALF_OUT_TOL : tol, &e), "%s %s: out rel err %.3g or a non-finite value", path,
        desc, e);
  CHECK(agrees(&tl, rl, nl, tol, &e), "%s %s: lse rel err %.3g or a non-finite value", path, desc, e);
  if (c->weights) CHECK(agrees(&tw, rw, nw, tol, &e), "%s %s: weights rel err %.3g", path, desc, e);
  if (half_tiles) {
    /* the blocked path must have run the half tiles (AMX's f16 ones on the shapes they take), else this
     * kernel was not tested */
    const int amx_takes = c->Dv % 16 == 0; /* AMX widens the other shapes */
    const char *want = half_tiles == 2 && !amx_takes ? "attn_sdpa forward ("
                       : f16_inputs                  ? "(bf16 hi + lo)"
                                                     : "bf16 tiles";
    CHECK(attn_ctx_decode(ctx) || strstr(attn_ctx_plan(ctx), want), "%s %s: the blocked forward did not run %s: %s",
          path, desc, want, attn_ctx_plan(ctx));
    if (half_tiles != 2) { /* avx512bf16's backward is fp32, as avx512's */
      arena_free(a);
      return;
    }
  }
  /* AMX: the half backward tiles, on bf16 q, k and v (their values already are bf16), or on the f16
   * ones (the poison too), from the oracle's out and lse in f32 (the oracle's Dd comes from its own
   * probabilities, not from out) */
  const int half_bwd = half_tiles == 2;
  attn_tensor bq = P.tq, bk = P.tkp, bv = P.tvp, bo = to, bl = tl;
  if (half_bwd) {
    attn_tensor *ts[3] = {&bq, &bk, &bv};
    if (f16_inputs) bq = tq, bk = tkp, bv = tvp;
    for (int i = 0; i < 3 && !f16_inputs; i++) {
      const attn_tensor src = *ts[i];
      *ts[i] = attn_tensor_view(arena_alloc(a, 2 * (size_t)attn_tensor_numel(&src) + 2), ATTN_BF16, 4, src.shape);
      CHECK_OK(ctx, attn_tensor_copy(ctx, ts[i], &src));
    }
    bo = attn_tensor_view(arena_alloc(a, sizeof(float) * (no ? no : 1)), ATTN_F32, 4, s4o);
    bl = attn_tensor_view(arena_alloc(a, sizeof(float) * (nl ? nl : 1)), ATTN_F32, 3, s3l);
    CHECK_OK(ctx, attn_tensor_copy(ctx, &bo, &tro));
    CHECK_OK(ctx, attn_tensor_copy(ctx, &bl, &trl));
  }

  /* the backward from this forward's out and lse, against the oracle's backward on clean inputs */
  const int64_t nq = c->B * c->Hq * c->Nq * c->D, nk = c->B * c->Hk * c->Nk * c->D, nv = c->B * c->Hk * c->Nk * c->Dv;
  const int64_t s4q[4] = {c->B, c->Hq, c->Nq, c->D}, s4k[4] = {c->B, c->Hk, c->Nk, c->D};
  const int64_t s4v[4] = {c->B, c->Hk, c->Nk, c->Dv}, s1h[1] = {c->Hq};
  double *rdq = arena_alloc(a, sizeof(double) * (nq ? nq : 1)), *rdk = arena_alloc(a, sizeof(double) * (nk ? nk : 1));
  double *rdv = arena_alloc(a, sizeof(double) * (nv ? nv : 1)), *rdm = arena_alloc(a, sizeof(double) * (nw ? nw : 1));
  float *rds32 = arena_alloc(a, sizeof(float) * c->Hq); /* sinks_grad is f32 on every path */
  double *rds = arena_alloc(a, sizeof(double) * c->Hq);
  attn_tensor trdq = attn_tensor_view(rdq, ATTN_F64, 4, s4q), trdk = attn_tensor_view(rdk, ATTN_F64, 4, s4k);
  attn_tensor trdv = attn_tensor_view(rdv, ATTN_F64, 4, s4v), trdm = attn_tensor_view(rdm, ATTN_F64, 4, s4w);
  attn_tensor trds = attn_tensor_view(rds32, ATTN_F32, 1, s1h);
  attn_sdpa_opts ob;
  options(&ob, c, &P);
  const int additive = c->mask == 1 + ATTN_MASK_ADDITIVE;
  CHECK_OK(oracle, attn_sdpa_backward_ref(oracle, &trdq, &trdk, &trdv, additive ? &trdm : NULL, c->sinks ? &trds : NULL,
                                          &P.tdout, &P.tq, &P.tk, &P.tv, &tro, &trl, &ob));
  for (int64_t h = 0; h < c->Hq; h++) rds[h] = rds32[h];

  float *dq = arena_alloc(a, sizeof(float) * (nq ? nq : 1)), *dk = arena_alloc(a, sizeof(float) * (nk ? nk : 1));
  float *dv = arena_alloc(a, sizeof(float) * (nv ? nv : 1)), *dm = arena_alloc(a, sizeof(float) * (nw ? nw : 1));
  float *ds = arena_alloc(a, sizeof(float) * c->Hq);
  tu_poison_f32(dq, nq), tu_poison_f32(dk, nk), tu_poison_f32(dv, nv), tu_poison_f32(dm, nw), tu_poison_f32(ds, c->Hq);
  attn_tensor tdq = attn_tensor_view(dq, ATTN_F32, 4, s4q), tdk = attn_tensor_view(dk, ATTN_F32, 4, s4k);
  attn_tensor tdv = attn_tensor_view(dv, ATTN_F32, 4, s4v), tdm = attn_tensor_view(dm, ATTN_F32, 4, s4w);
  attn_tensor tds = attn_tensor_view(ds, ATTN_F32, 1, s1h);
  st = attn_sdpa_backward(ctx, &tdq, &tdk, &tdv, additive ? &tdm : NULL, c->sinks ? &tds : NULL, &P.tdout, &bq, &bk,
                          &bv, &bo, &bl, &ob);
  CHECK(st == ATTN_OK, "%s %s: backward: %s", path, desc, attn_ctx_error(ctx));
  if (half_bwd && st == ATTN_OK) {
    const int tiles = c->D % 16 == 0 && c->Dv % 16 == 0; /* the shapes they take */
    const char *want = f16_inputs ? "attn_sdpa_backward, f16 tiles (bf16 hi + lo)" : "attn_sdpa_backward, bf16 tiles";
    CHECK(!tiles || strstr(attn_ctx_plan(ctx), want), "%s %s: the backward did not run %s: %s", path, desc, want,
          attn_ctx_plan(ctx));
    half_bwd_runs[f16_inputs] += tiles;
  }
  if (st == ATTN_OK) {
    /* the f32 lse the backward starts from; on the half tiles test_half's BF16_GRAD_BOUND (F16_GRAD_BOUND) */
    const double gtol = exact ? 1e-5 : half_bwd ? (f16_inputs ? 1e-3 : 1e-2) : 2e-4;
    CHECK(agrees(&tdq, rdq, nq, gtol, &e), "%s %s: dq rel err %.3g or a non-finite value", path, desc, e);
    CHECK(agrees(&tdk, rdk, nk, gtol, &e), "%s %s: dk rel err %.3g or a non-finite value", path, desc, e);
    CHECK(agrees(&tdv, rdv, nv, gtol, &e), "%s %s: dv rel err %.3g or a non-finite value", path, desc, e);
    if (additive) CHECK(agrees(&tdm, rdm, nw, gtol, &e), "%s %s: mask grad rel err %.3g", path, desc, e);
    if (c->sinks) CHECK(agrees(&tds, rds, c->Hq, gtol, &e), "%s %s: sinks grad rel err %.3g", path, desc, e);
    /* a key hidden from every row gets exactly zero gradients */
    int64_t nonzero = 0;
    for (int64_t row = 0; row < c->B * c->Hk * c->Nk; row++) {
      if (!P.dead[row]) continue;
      for (int64_t d = 0; d < c->D; d++) nonzero += dk[row * c->D + d] != 0;
      for (int64_t d = 0; d < c->Dv; d++) nonzero += dv[row * c->Dv + d] != 0;
    }
    CHECK(nonzero == 0, "%s %s: %lld gradient entries of hidden keys are not 0", path, desc, (long long)nonzero);
  }
  arena_free(a);
}

/* The KV cache: each row's storage past its length holds tokens that were
 * appended as NaN and Inf and then truncated away. */
static void kv_cache_tail(attn_ctx *ctx, attn_ctx *oracle, const char *kname) {
  enum { B = 3, Hk = 2, Hq = 4, D = 24, CAP = 200 };
  const attn_dtype dts[3] = {ATTN_F32, ATTN_F16, ATTN_BF16};
  const int64_t lens[B] = {70, 1, 133};
  tu_rng r = {4242};
  /* with chunks of 32, each row's first half lies before its queries' chunk: NaN keys, Inf values */
  for (int64_t chunk = 0; chunk <= 32; chunk += 32)
  for (int di = 0; di < 3; di++)
    for (int64_t nq = 1; nq <= 5; nq += 4) {
      attn_kv_cache_config cfg;
      attn_kv_cache_config_init(&cfg, B, CAP, Hk, D);
      cfg.dtype = dts[di];
      attn_kv_cache *cache = NULL;
      CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &cfg));
      if (!cache) return;
      /* real tokens: every row gets its length, in two appends */
      static float kbuf[B * Hk * CAP * D], vbuf[B * Hk * CAP * D];
      for (int part = 0; part < 2; part++) {
        int64_t n_new[B], n = 0;
        for (int b = 0; b < B; b++) {
          n_new[b] = part == 0 ? lens[b] / 2 : lens[b] - lens[b] / 2;
          if (n_new[b] > n) n = n_new[b];
        }
        tu_fill_f32(&r, kbuf, B * Hk * n * D, 1);
        tu_fill_f32(&r, vbuf, B * Hk * n * D, 1);
        for (int64_t e = 0; chunk && part == 0 && e < B * Hk * n * D; e++) kbuf[e] = NAN, vbuf[e] = INFINITY;
        const int64_t s[4] = {B, Hk, n, D};
        attn_tensor tk = attn_tensor_view(kbuf, ATTN_F32, 4, s), tv = attn_tensor_view(vbuf, ATTN_F32, 4, s);
        CHECK_OK(ctx, attn_kv_cache_append(ctx, cache, &tk, &tv, n_new));
      }
      /* poison: fill every row to capacity with NaN keys and Inf values, then roll back */
      int64_t fill[B], n = 0;
      for (int b = 0; b < B; b++) {
        fill[b] = CAP - lens[b];
        if (fill[b] > n) n = fill[b];
      }
      for (int64_t e = 0; e < B * Hk * n * D; e++) {
        kbuf[e] = e % 2 ? NAN : -INFINITY;
        vbuf[e] = e % 3 ? INFINITY : NAN;
      }
      const int64_t sp[4] = {B, Hk, n, D};
      attn_tensor tk = attn_tensor_view(kbuf, ATTN_F32, 4, sp), tv = attn_tensor_view(vbuf, ATTN_F32, 4, sp);
      CHECK_OK(ctx, attn_kv_cache_append(ctx, cache, &tk, &tv, fill));
      for (int b = 0; b < B; b++) CHECK_OK(ctx, attn_kv_cache_truncate(ctx, cache, b, lens[b]));
      /* queries of the last nq tokens of every row */
      static float q[B * Hq * 8 * D], out[B * Hq * 8 * D], lse[B * Hq * 8];
      tu_fill_f32(&r, q, B * Hq * nq * D, 1);
      tu_poison_f32(out, B * Hq * nq * D);
      const int64_t sq[4] = {B, Hq, nq, D}, sl[3] = {B, Hq, nq};
      attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, sq), to = attn_tensor_view(out, ATTN_F32, 4, sq);
      attn_tensor tl = attn_tensor_view(lse, ATTN_F32, 3, sl);
      attn_sdpa_opts o;
      attn_sdpa_opts_init(&o);
      o.chunk = chunk;
      CHECK_OK(ctx, attn_kv_cache_attend(ctx, cache, &to, &tl, &tq, &o));
      /* the oracle row by row on what the row holds (its view: the stored, rounded values) */
      double err = 0;
      int nonfinite = 0;
      for (int b = 0; b < B; b++) {
        attn_tensor kv, vv;
        CHECK_OK(ctx, attn_kv_cache_view(ctx, &kv, &vv, cache, b));
        double ro[Hq * 8 * D];
        const int64_t s1[4] = {1, Hq, nq, D};
        attn_tensor tqb = attn_tensor_view(q + b * Hq * nq * D, ATTN_F32, 4, s1);
        attn_tensor trob = attn_tensor_view(ro, ATTN_F64, 4, s1);
        attn_sdpa_opts ob;
        attn_sdpa_opts_init(&ob);
        ob.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
        ob.chunk = chunk;
        CHECK_OK(oracle, attn_sdpa_ref(oracle, &trob, NULL, NULL, &tqb, &kv, &vv, &ob));
        double num = 0, den = 0;
        for (int64_t e = 0; e < Hq * nq * D; e++) {
          const double g = out[b * Hq * nq * D + e], d = g - ro[e];
          nonfinite += !isfinite(g);
          num += d * d;
          den += ro[e] * ro[e];
        }
        const double rel = den > 0 ? sqrt(num / den) : sqrt(num);
        if (rel > err) err = rel;
      }
      CHECK(nonfinite == 0 && err <= 2e-5,
            "%s: KV cache %s, %lld queries, chunk %lld: %d non-finite outputs, rel err %.3g", kname,
            attn_dtype_name(dts[di]), (long long)nq, (long long)chunk, nonfinite, err);
      attn_kv_cache_destroy(cache);
    }
}

/* The layer: cross-attention whose padded key and value rows are NaN, hidden by key_padding. */
static void layer_padding(attn_ctx *ctx, const char *kname) {
  enum { B = 2, Nq = 9, Nk = 37, E = 32, H = 4 };
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, E, H);
  cfg.bias = 1;
  attn_mha *mha = NULL;
  CHECK_OK(ctx, attn_mha_create(ctx, &mha, &cfg));
  if (!mha) return;
  tu_rng r = {31337};
  for (int p = 0; p < TU_MHA_PROJ_PARAMS; p++) {
    attn_tensor t;
    CHECK_OK(ctx, attn_mha_param_view(ctx, &t, mha, (attn_mha_param)p));
    tu_fill_f32(&r, t.data, attn_tensor_numel(&t), 0.3);
  }
  static float x[B * Nq * E], kin[B * Nk * E], vin[B * Nk * E], kpo[B * Nk * E], vpo[B * Nk * E];
  static float clean[B * Nq * E], got[B * Nq * E];
  tu_fill_f32(&r, x, B * Nq * E, 1);
  tu_fill_f32(&r, kin, B * Nk * E, 1);
  tu_fill_f32(&r, vin, B * Nk * E, 1);
  const int64_t len[B] = {20, 37};
  uint8_t kpm[B * Nk];
  memcpy(kpo, kin, sizeof kin);
  memcpy(vpo, vin, sizeof vin);
  for (int b = 0; b < B; b++)
    for (int j = 0; j < Nk; j++) {
      kpm[b * Nk + j] = j >= len[b];
      if (j < len[b]) continue;
      for (int e = 0; e < E; e++) {
        kpo[(b * Nk + j) * E + e] = NAN;
        vpo[(b * Nk + j) * E + e] = INFINITY;
      }
    }
  const int64_t sx[3] = {B, Nq, E}, sk[3] = {B, Nk, E}, sp[2] = {B, Nk};
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 3, sx), tk = attn_tensor_view(kin, ATTN_F32, 3, sk);
  attn_tensor tv = attn_tensor_view(vin, ATTN_F32, 3, sk), tkp = attn_tensor_view(kpo, ATTN_F32, 3, sk);
  attn_tensor tvp = attn_tensor_view(vpo, ATTN_F32, 3, sk), tpad = attn_tensor_view(kpm, ATTN_BOOL, 2, sp);
  attn_tensor tc = attn_tensor_view(clean, ATTN_F32, 3, sx), tg = attn_tensor_view(got, ATTN_F32, 3, sx);
  attn_mha_opts o;
  attn_mha_opts_init(&o);
  o.attn.key_padding = &tpad;
  CHECK_OK(ctx, attn_mha_forward(ctx, mha, &tc, NULL, &tx, &tk, &tv, &o));
  tu_poison_f32(got, B * Nq * E);
  CHECK_OK(ctx, attn_mha_forward(ctx, mha, &tg, NULL, &tx, &tkp, &tvp, &o));
  double num = 0, den = 0;
  int nonfinite = 0;
  for (int e = 0; e < B * Nq * E; e++) {
    nonfinite += !isfinite(got[e]);
    num += (got[e] - clean[e]) * (got[e] - clean[e]);
    den += clean[e] * clean[e];
  }
  CHECK(nonfinite == 0 && sqrt(num / den) <= 1e-6, "%s: layer with NaN/Inf padded keys: %d non-finite, rel diff %.3g",
        kname, nonfinite, sqrt(num / den));
  attn_mha_destroy(mha);
}

/* bf16 tensors on the bf16 tiles with nothing but a band hiding keys (causal, a window, chunks): the blocks
 * the band cuts go to the fused kernels only while their values are finite (engine/forward.c), so the
 * keys past the last query (hidden from every row, top-left) hold Inf or NaN in one run and finite
 * values in the other; out is held to the oracle on the clean inputs either way. */
/* dt: bf16, or f16 (amx's f16 tiles) */
static void band_poison(const char *kname, attn_ctx *ctx, attn_ctx *oracle, attn_dtype dt) {
  static const struct { int64_t Nq, Nk, D, window, chunk; } cases[] = {
      {100, 150, 64, 0, 0}, {70, 131, 32, 20, 0}, {90, 200, 128, 0, 0}, {130, 140, 64, 50, 0}, {100, 150, 64, 0, 40},
      {130, 140, 128, 50, 72}};
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
    for (int poisoned = 0; poisoned < 2; poisoned++)
      for (int threads = 1; threads <= 2; threads++) {
        const int64_t B = 1, Hq = 4, Hk = 2, Nq = cases[ci].Nq, Nk = cases[ci].Nk, D = cases[ci].D;
        arena a = {0};
        const int64_t sq[4] = {B, Hq, Nq, D}, sk[4] = {B, Hk, Nk, D}, so[4] = {B, Hq, Nq, D};
        const int64_t nq = B * Hq * Nq * D, nk = B * Hk * Nk * D;
        uint16_t *qh = arena_alloc(&a, 2 * (size_t)nq), *kh = arena_alloc(&a, 2 * (size_t)nk), *vh = arena_alloc(&a, 2 * (size_t)nk);
        float *qf = arena_alloc(&a, 4 * (size_t)nq), *kf = arena_alloc(&a, 4 * (size_t)nk), *vf = arena_alloc(&a, 4 * (size_t)nk);
        tu_rng r = {(uint64_t)(ci * 4 + 1)};
        const int f16 = dt == ATTN_F16;
#define TO_HALF(x) (f16 ? tu_f32_to_f16(x) : tu_f32_to_bf16(x))
#define FROM_HALF(h) (f16 ? tu_f16_to_f32(h) : tu_bf16_to_f32(h))
        for (int64_t e = 0; e < nq; e++) qh[e] = TO_HALF((float)tu_uniform(&r)), qf[e] = FROM_HALF(qh[e]);
        for (int64_t e = 0; e < nk; e++) {
          const int64_t j = (e / D) % Nk;
          kh[e] = TO_HALF((float)tu_uniform(&r)), kf[e] = FROM_HALF(kh[e]);
          vh[e] = TO_HALF((float)tu_uniform(&r)), vf[e] = FROM_HALF(vh[e]);
          if (poisoned && j >= Nq) { /* hidden from every row: the oracle sees zeros, the tiles the poison */
            kh[e] = TO_HALF(NAN), vh[e] = TO_HALF(e % 2 ? INFINITY : NAN);
            kf[e] = vf[e] = 0.0f;
          }
        }
#undef TO_HALF
#undef FROM_HALF
        attn_sdpa_opts o;
        attn_sdpa_opts_init(&o);
        o.causal = ATTN_CAUSAL_TOP_LEFT;
        o.window = cases[ci].window;
        o.chunk = cases[ci].chunk;
        double *want = arena_alloc(&a, 8 * (size_t)nq);
        float *got = arena_alloc(&a, 4 * (size_t)nq);
        tu_poison_f32(got, nq);
        attn_tensor tw = attn_tensor_view(want, ATTN_F64, 4, so), tg = attn_tensor_view(got, ATTN_F32, 4, so);
        attn_tensor q = attn_tensor_view(qf, ATTN_F32, 4, sq), k = attn_tensor_view(kf, ATTN_F32, 4, sk),
                    v = attn_tensor_view(vf, ATTN_F32, 4, sk);
        CHECK_OK(oracle, attn_sdpa_ref(oracle, &tw, NULL, NULL, &q, &k, &v, &o));
        q = attn_tensor_view(qh, dt, 4, sq), k = attn_tensor_view(kh, dt, 4, sk);
        v = attn_tensor_view(vh, dt, 4, sk);
        attn_ctx_set_threads(ctx, threads);
        CHECK_OK(ctx, attn_sdpa(ctx, &tg, NULL, NULL, &q, &k, &v, &o));
        CHECK(strstr(attn_ctx_plan(ctx), f16 ? "(bf16 hi + lo)" : "bf16 tiles") != NULL, "%s band: the plan is %s",
              kname, attn_ctx_plan(ctx));
        double num = 0, den = 0;
        int nonfinite = 0;
        for (int64_t e = 0; e < nq; e++) {
          nonfinite += !isfinite(got[e]);
          num += (got[e] - want[e]) * (got[e] - want[e]);
          den += want[e] * want[e];
        }
        CHECK(nonfinite == 0 && sqrt(num / den) <= HALF_OUT_TOL,
              "%s %s band case %zu (Nq %lld Nk %lld D %lld window %lld chunk %lld) %s, %d threads: %d non-finite, "
              "rel L2 %.3g",
              kname, attn_dtype_name(dt), ci, (long long)Nq, (long long)Nk, (long long)D, (long long)cases[ci].window,
              (long long)cases[ci].chunk,
              poisoned ? "poisoned" : "clean", threads, nonfinite, sqrt(num / den));
        arena_free(&a);
      }
}

int main(int argc, char **argv) {
  const char *kname = argc > 1 ? argv[1] : "";
  const attn_kernel kern = tu_kernel_or_skip(kname);
  const int ncases = argc > 2 ? atoi(argv[2]) : 120;
  attn_ctx *oracle, *ctx[2];
  attn_ctx_create(&oracle);
  attn_ctx_set_threads(oracle, 2);
  attn_ctx_create(&ctx[0]);          /* the decode kernel where a problem fits it */
  attn_ctx_create(&ctx[1]);          /* always the blocked kernel */
  CHECK_OK(ctx[1], attn_ctx_set_decode(ctx[1], 0));
  for (int i = 0; i < 2; i++) CHECK_OK(ctx[i], attn_ctx_set_kernel(ctx[i], kern));
  half_tiles = kern == ATTN_KERNEL_AMX ? 2 : kern == ATTN_KERNEL_AVX512_BF16;
  for (int i = 0; i < 2 && half_tiles; i++) CHECK_OK(ctx[i], attn_ctx_set_precision(ctx[i], ATTN_PRECISION_BF16));
  const char *paths[2] = {"decode-or-blocked", "blocked"};
  tu_rng r = {2026};
  int64_t dead = 0;
  for (int seed = 0; seed < ncases && seed < MAX_CASES; seed++) {
    const int decode = seed % 2 == 0; /* half the cases small enough for the decode kernel */
    f16_inputs = half_tiles == 2 && seed % 4 == 1; /* AMX: a quarter of the cases in f16, on its f16 tiles */
    hcase c = random_case(&r, decode);
    for (int threads = 1; threads <= 3; threads += 2)
      for (int pi = 0; pi < 2; pi++) {
        if (pi == 0 && !decode) continue; /* the same as the blocked run */
        attn_ctx_set_threads(ctx[pi], threads);
        char path[96];
        snprintf(path, sizeof path, "%s %s %d threads", kname[0] ? kname : "auto", paths[pi], threads);
        run_case(ctx[pi], oracle, &c, seed, path);
      }
    problem P;
    tu_rng rr = {(uint64_t)seed * 7919u + 17};
    build(&P, &c, &rr);
    dead += P.ndead;
    arena_free(&P.a);
  }
  f16_inputs = 0;
  if (half_tiles) {
    CHECK_OK(ctx[1], attn_ctx_set_precision(ctx[1], ATTN_PRECISION_DEFAULT));
    band_poison(kname, ctx[1], oracle, ATTN_BF16);
    if (half_tiles == 2) band_poison(kname, ctx[1], oracle, ATTN_F16);
    CHECK_OK(ctx[1], attn_ctx_set_precision(ctx[1], ATTN_PRECISION_BF16));
  }
  /* the cases must exercise what they claim to */
  CHECK(half_tiles != 2 || (half_bwd_runs[0] > 20 && half_bwd_runs[1] > 10),
        "the backward ran the bf16 tiles %d times, the f16 ones %d", half_bwd_runs[0], half_bwd_runs[1]);
  CHECK(dead > 1000, "only %lld poisoned keys over all cases", (long long)dead);
  printf("%lld poisoned key rows over %d cases\n", (long long)dead, ncases);
  for (int i = 0; i < 2; i++) CHECK_OK(ctx[i], attn_ctx_set_precision(ctx[i], ATTN_PRECISION_DEFAULT));
  kv_cache_tail(ctx[0], oracle, kname);
  kv_cache_tail(ctx[1], oracle, kname);
  layer_padding(ctx[0], kname);
  for (int i = 0; i < 2; i++) attn_ctx_destroy(ctx[i]);
  attn_ctx_destroy(oracle);
  return tu_finish("test_hidden");
}
