/* The precision policy (attn.h's attn_precision) and the half-precision tiles.
 *
 *   test_half policy      on any CPU: the API, and that no input loses
 *                         precision outside the rules (f32 under DEFAULT, any
 *                         dtype under FP32, f16 under BF16, bf16 under F16) on
 *                         every kernel here;
 *                         the backward on f16/bf16 inputs is the backward on
 *                         their values in f32, bitwise (under FP32 on AMX),
 *                         and f32 inputs' is fp32 under every policy
 *   test_half avx512bf16  the bf16 tiles (skipped where the CPU lacks them),
 *   test_half amx         and the AMX ones (mostly Dv % 16 = 0, the shapes
 *                         they take, D padded to 16-pair steps; a few widened),
 *                         f16 inputs on them too:
 *                         bf16 inputs, and f32 inputs under BF16 (F16), against the
 *                         float64 oracle on the same (rounded) inputs with the
 *                         documented bound; out exactly as the policy says
 *                         (probabilities rounded to bf16 for p.v), checked on
 *                         one-block problems against a float64 emulation of
 *                         that rounding; 1 and 3 threads; poisoned outputs.
 * Both: the bf16 backward on the tiles (backward_tiles; AVX512-BF16's 16-row set).
 * amx also: the f16 backward on the tiles, a bf16 KV
 * cache's multi-row steps on them (kv_cache_tiles), and the packing's vector split
 * of f16 (and of f32 rounded to f16) against the portable one (split_f16_bitwise).
 * Hidden keys holding NaN/Inf on these tiles: test_hidden avx512bf16. */
#include "testutil.h"
#ifdef ATTN_HAVE_AMX
#include "cpu/kernels.h"
#include "half.h"
#endif

/* out's rel L2 bound on the bf16 tiles, the documented one (README, attn.h):
 * the probabilities' rounding to bf16 (relative 2^-9 each) dominates. */
#define BF16_OUT_BOUND 1e-2
/* and on the f16 tiles (AMX: f16 as bf16 hi + lo), whose only rounding is the
 * probabilities' to f16 (2^-11) */
#define F16_OUT_BOUND 2e-3
#define F32_TOL 2e-5 /* the fp32 kernels' bound in test_sdpa */
/* dq, dk and dv's rel L2 bound on the bf16 backward tiles (attn.h): P and dS
 * rounded to bf16 for their products, and dO to bf16 */
#define BF16_GRAD_BOUND 1e-2
/* and on the f16 ones (AMX: f16 as bf16 hi + lo), P, dS and dO rounded to f16 */
#define F16_GRAD_BOUND 1e-3

typedef struct hcase {
  int64_t B, Hq, Hk, Nq, Nk, D, Dv;
  attn_causal causal;
  int64_t window;
  double softcap;
  int alibi, sinks, kpm, weights;
  int64_t chunk;
} hcase;

typedef struct prob {
  arena a;
  attn_tensor q, k, v;     /* in the case's dtype */
  attn_tensor tkpm, tslopes, tsinks;
  attn_sdpa_opts o;
} prob;

static void make(prob *P, const hcase *c, attn_dtype dt, tu_rng *r) {
  memset(P, 0, sizeof *P);
  arena *a = &P->a;
  const int64_t sq[4] = {c->B, c->Hq, c->Nq, c->D}, sk[4] = {c->B, c->Hk, c->Nk, c->D}, sv[4] = {c->B, c->Hk, c->Nk, c->Dv};
  const int64_t *shapes[3] = {sq, sk, sv};
  attn_tensor *ts[3] = {&P->q, &P->k, &P->v};
  for (int i = 0; i < 3; i++) {
    const int64_t n = shapes[i][0] * shapes[i][1] * shapes[i][2] * shapes[i][3];
    void *d = arena_alloc(a, (size_t)(n ? n : 1) * attn_dtype_size(dt));
    for (int64_t e = 0; e < n; e++) tu_store_float(d, dt, e, (i == 2 ? 1.0 : 1.5) * tu_uniform(r));
    *ts[i] = attn_tensor_view(d, dt, 4, shapes[i]);
  }
  attn_sdpa_opts_init(&P->o);
  P->o.causal = c->causal;
  P->o.window = c->window;
  P->o.chunk = c->chunk;
  P->o.softcap = c->softcap;
  const int64_t s2[2] = {c->B, c->Nk}, s1[1] = {c->Hq};
  if (c->kpm) {
    uint8_t *m = arena_alloc(a, (size_t)(c->B * c->Nk + 1));
    for (int64_t e = 0; e < c->B * c->Nk; e++) m[e] = e % c->Nk >= c->Nk - 1 - (e / c->Nk) * 3;
    P->tkpm = attn_tensor_view(m, ATTN_BOOL, 2, s2);
    P->o.key_padding = &P->tkpm;
  }
  float *sl = arena_alloc(a, sizeof(float) * (size_t)c->Hq), *sk2 = arena_alloc(a, sizeof(float) * (size_t)c->Hq);
  attn_alibi_slopes(sl, c->Hq);
  tu_fill_f32(r, sk2, c->Hq, 1);
  P->tslopes = attn_tensor_view(sl, ATTN_F32, 1, s1);
  P->tsinks = attn_tensor_view(sk2, ATTN_F32, 1, s1);
  if (c->alibi) P->o.alibi_slopes = &P->tslopes;
  if (c->sinks) P->o.sinks = &P->tsinks;
}

static int amx_shapes; /* the kernel under test has AMX tiles */

static hcase random_case(tu_rng *r, int one_block) {
  hcase c;
  memset(&c, 0, sizeof c);
  c.B = tu_int(r, 1, 2);
  c.Hk = tu_int(r, 1, 2);
  c.Hq = c.Hk * tu_int(r, 1, 3);
  c.Nq = tu_int(r, 9, one_block ? 40 : 140); /* past the decode kernel's size: the blocked forward */
  c.Nk = one_block ? tu_int(r, 1, 64) : tu_int(r, 1, 300);
  const int64_t dims[] = {1, 7, 16, 33, 64, 80, 128};
  c.D = dims[tu_int(r, 0, 6)];
  c.Dv = tu_int(r, 0, 2) ? c.D : dims[tu_int(r, 0, 6)];
  if (amx_shapes && tu_int(r, 0, 5)) { /* mostly shapes the AMX tiles take (Dv % 16; D padded to 32), a few widened */
    const int64_t ad[] = {32, 64, 80, 128, 160, 7}, av[] = {16, 48, 64, 128, 144, 80};
    c.D = ad[tu_int(r, 0, 5)];
    c.Dv = tu_int(r, 0, 2) && c.D % 16 == 0 ? c.D : av[tu_int(r, 0, 5)];
  }
  c.causal = (attn_causal)tu_int(r, 0, 2);
  c.window = tu_int(r, 0, 4) == 0 ? tu_int(r, 1, 50) : 0;
  c.softcap = tu_int(r, 0, 3) == 0 ? 3.0 : 0;
  c.alibi = tu_int(r, 0, 3) == 0;
  c.sinks = !one_block && tu_int(r, 0, 3) == 0; /* a sink starts the running max: not the emulation's */
  c.kpm = tu_int(r, 0, 2) == 0;
  c.weights = tu_int(r, 0, 2) == 0;
  c.chunk = tu_int(r, 0, 4) == 0 ? tu_int(r, 1, 80) : 0;
  return c;
}

/* The AMX tiles' shapes (attn.h's ATTN_KERNEL_AMX: any D, Dv a multiple of 16; others are widened). */
static int amx_takes(const hcase *c) { return c->Dv % 16 == 0; }

static void describe(char *buf, size_t n, const hcase *c, int seed) {
  snprintf(buf, n, "case %d: B%lld Hq%lld Hk%lld Nq%lld Nk%lld D%lld Dv%lld causal %d window %lld softcap %g alibi %d "
                   "sinks %d kpm %d chunk %lld", seed, (long long)c->B, (long long)c->Hq, (long long)c->Hk, (long long)c->Nq,
           (long long)c->Nk, (long long)c->D, (long long)c->Dv, (int)c->causal, (long long)c->window, c->softcap,
           c->alibi, c->sinks, c->kpm, (long long)c->chunk);
}

/* Relative L2 of got (f32) against want, and whether got is non-finite where want is finite. */
static double err_vs(const float *got, const double *want, int64_t n, int *bad) {
  double num = 0, den = 0;
  for (int64_t e = 0; e < n; e++) {
    if (isfinite(want[e]) && !isfinite(got[e])) *bad = 1;
    if (!isfinite(want[e])) continue; /* -inf lse of a row with nothing visible: compared below */
    num += (got[e] - want[e]) * (got[e] - want[e]);
    den += want[e] * want[e];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* out of one-block problems as the policy defines it: p = exp(s - max s), each
 * rounded to bf16 for p.v, the sum taken from the unrounded p; from the oracle's
 * weights (w = p / sum p, so p = w / max w) and the bf16 values of v. */
static void emulate(double *out, const double *w, const attn_tensor *v, const hcase *c, attn_dtype dt) {
  const int64_t G = c->Hq / c->Hk;
  for (int64_t b = 0; b < c->B; b++)
    for (int64_t h = 0; h < c->Hq; h++)
      for (int64_t i = 0; i < c->Nq; i++) {
        const double *wr = w + ((b * c->Hq + h) * c->Nq + i) * c->Nk;
        double mx = 0, l = 0;
        for (int64_t j = 0; j < c->Nk; j++) mx = wr[j] > mx ? wr[j] : mx;
        double *o = out + ((b * c->Hq + h) * c->Nq + i) * c->Dv;
        for (int64_t d = 0; d < c->Dv; d++) o[d] = 0;
        if (mx == 0) continue; /* nothing visible: 0 */
        for (int64_t j = 0; j < c->Nk; j++) {
          const double p = wr[j] / mx, pr = tu_round_through((float)p, dt);
          l += p;
          if (pr == 0) continue;
          const uint16_t *vr = (const uint16_t *)v->data + ((b * c->Hk + h / G) * c->Nk + j) * c->Dv;
          for (int64_t d = 0; d < c->Dv; d++) o[d] += pr * (dt == ATTN_F16 ? tu_f16_to_f32(vr[d]) : tu_bf16_to_f32(vr[d]));
        }
        for (int64_t d = 0; d < c->Dv; d++) o[d] /= l;
      }
}

/* One case through ctx (its kernel and precision as set), against the oracle on the same inputs.
 * tiles: 1 when the bf16 tiles must run (then out is held to BF16_OUT_BOUND), 2 the f16 ones
 * (F16_OUT_BOUND), 0 when none must. */
static void run(attn_ctx *ctx, attn_ctx *oracle, const hcase *c, attn_dtype dt, int seed, int tiles, int one_block,
                const char *what) {
  /* few rows a kv head go to the decode kernel wherever tiles would run (fp32 on the inputs as stored):
   * up to 24 rows where the bf16 tiles would, 64 where the f16 ones would (decode.c) */
  if (tiles && !c->weights && attn_ctx_decode(ctx) && c->Nq * (c->Hq / c->Hk) <= (tiles == 2 ? 64 : 24)) tiles = 0;
  tu_rng r = {(uint64_t)seed * 104729u + 7};
  prob P;
  make(&P, c, dt, &r);
  char desc[300];
  describe(desc, sizeof desc, c, seed);
  arena *a = &P.a;
  const int64_t no = c->B * c->Hq * c->Nq * c->Dv, nl = c->B * c->Hq * c->Nq, nw = nl * c->Nk;
  const int64_t so[4] = {c->B, c->Hq, c->Nq, c->Dv}, sl[3] = {c->B, c->Hq, c->Nq}, sw[4] = {c->B, c->Hq, c->Nq, c->Nk};
  double *ro = arena_alloc(a, sizeof(double) * (size_t)(no + 1)), *rl = arena_alloc(a, sizeof(double) * (size_t)(nl + 1));
  double *rw = arena_alloc(a, sizeof(double) * (size_t)(nw + 1));
  attn_tensor tro = attn_tensor_view(ro, ATTN_F64, 4, so), trl = attn_tensor_view(rl, ATTN_F64, 3, sl);
  attn_tensor trw = attn_tensor_view(rw, ATTN_F64, 4, sw);
  /* the oracle on what the tiles read: f32 inputs rounded to bf16 (f16 for the f16 tiles) when the tiles
   * round them */
  attn_tensor oq = P.q, ok = P.k, ov = P.v;
  if (tiles && dt == ATTN_F32) {
    attn_tensor *in[3] = {&oq, &ok, &ov};
    for (int i = 0; i < 3; i++) {
      const int64_t n = attn_tensor_numel(in[i]);
      float *d = arena_alloc(a, sizeof(float) * (size_t)(n + 1));
      for (int64_t e = 0; e < n; e++)
        d[e] = tu_round_through(((const float *)in[i]->data)[e], tiles == 2 ? ATTN_F16 : ATTN_BF16);
      *in[i] = attn_tensor_view(d, ATTN_F32, 4, in[i]->shape);
    }
  }
  CHECK_OK(oracle, attn_sdpa_ref(oracle, &tro, &trl, &trw, &oq, &ok, &ov, &P.o));
  float *out = arena_alloc(a, sizeof(float) * (size_t)(no + 1)), *lse = arena_alloc(a, sizeof(float) * (size_t)(nl + 1));
  float *w = arena_alloc(a, sizeof(float) * (size_t)(nw + 1));
  tu_poison_f32(out, no), tu_poison_f32(lse, nl), tu_poison_f32(w, nw);
  attn_tensor to = attn_tensor_view(out, ATTN_F32, 4, so), tl = attn_tensor_view(lse, ATTN_F32, 3, sl);
  attn_tensor tw = attn_tensor_view(w, ATTN_F32, 4, sw);
  const attn_status st = attn_sdpa(ctx, &to, &tl, c->weights ? &tw : NULL, &P.q, &P.k, &P.v, &P.o);
  CHECK(st == ATTN_OK, "%s %s: %s", what, desc, attn_ctx_error(ctx));
  if (st == ATTN_OK) {
    const char *plan = attn_ctx_plan(ctx);
    const int ran = strstr(plan, "(bf16 hi + lo)") ? 2 : strstr(plan, "bf16 tiles") ? 1 : 0;
    CHECK(ran == tiles, "%s %s: tiles %d ran, %d expected; plan: %s", what, desc, ran, tiles, plan);
    int bad = 0;
    const double eo = err_vs(out, ro, no, &bad), el = err_vs(lse, rl, nl, &bad);
    for (int64_t e = 0; e < nl; e++) bad |= (rl[e] == -INFINITY) != (lse[e] == -INFINITY);
    CHECK(!bad && eo <= (tiles == 2 ? F16_OUT_BOUND : tiles ? BF16_OUT_BOUND : F32_TOL),
          "%s %s: out rel L2 %.3g (or a non-finite value)", what, desc, eo);
    /* the logits and the softmax's sums stay fp32 on the tiles: lse and weights keep fp32's bound */
    CHECK(el <= F32_TOL, "%s %s: lse rel L2 %.3g", what, desc, el);
    if (c->weights) {
      const double ew = err_vs(w, rw, nw, &bad);
      CHECK(!bad && ew <= F32_TOL, "%s %s: weights rel L2 %.3g", what, desc, ew);
    }
    if (tiles && one_block && dt != ATTN_F32) {
      double *em = arena_alloc(a, sizeof(double) * (size_t)(no + 1));
      emulate(em, rw, &P.v, c, dt);
      bad = 0;
      const double ee = err_vs(out, em, no, &bad);
      /* fp32 sums and logits only: far inside the rounding's own 2^-9 */
      CHECK(!bad && ee <= 1e-4, "%s %s: out rel L2 %.3g from the policy's rounding (oracle: %.3g)", what, desc, ee, eo);
    }
  }
  arena_free(a);
}

/* A backward's f32 inputs beside q, k, v: out and lse (left for the caller to fill), dout random. */
typedef struct bwd_io {
  attn_tensor out, lse, dout;
} bwd_io;

static bwd_io bwd_inputs(arena *a, const hcase *c, tu_rng *r) {
  const int64_t no = c->B * c->Hq * c->Nq * c->Dv, nl = c->B * c->Hq * c->Nq;
  const int64_t so[4] = {c->B, c->Hq, c->Nq, c->Dv}, sl[3] = {c->B, c->Hq, c->Nq};
  float *dout = arena_alloc(a, sizeof(float) * (size_t)(no + 1));
  tu_fill_f32(r, dout, no, 1);
  bwd_io io = {attn_tensor_view(arena_alloc(a, sizeof(float) * (size_t)(no + 1)), ATTN_F32, 4, so),
               attn_tensor_view(arena_alloc(a, sizeof(float) * (size_t)(nl + 1)), ATTN_F32, 3, sl),
               attn_tensor_view(dout, ATTN_F32, 4, so)};
  return io;
}

/* The backward of P's q, k, v with gradients in gdt (bf16 or f16, poisoned first) must give the f32
 * gradients g, rounded. */
static void grads_are_rounded(attn_ctx *ctx, arena *a, const prob *P, const bwd_io *io, float *const g[3],
                              const char *desc, attn_dtype gdt) {
  static const char *const names[3] = {"dq", "dk", "dv"};
  const attn_tensor *shp[3] = {&P->q, &P->k, &P->v};
  uint16_t *gh[3];
  attn_tensor tgh[3];
  for (int i = 0; i < 3; i++) {
    const int64_t n = attn_tensor_numel(shp[i]);
    gh[i] = arena_alloc(a, sizeof(uint16_t) * (size_t)(n + 1));
    for (int64_t e = 0; e < n; e++) gh[i][e] = 0x7fc1;
    tgh[i] = attn_tensor_view(gh[i], gdt, 4, shp[i]->shape);
  }
  CHECK_OK(ctx, attn_sdpa_backward(ctx, &tgh[0], &tgh[1], &tgh[2], NULL, NULL, &io->dout, &P->q, &P->k, &P->v, &io->out,
                                   &io->lse, &P->o));
  for (int i = 0; i < 3; i++) {
    const int64_t n = attn_tensor_numel(shp[i]);
    int64_t wrong = 0;
    for (int64_t e = 0; e < n; e++) wrong += gh[i][e] != (gdt == ATTN_F16 ? tu_f32_to_f16(g[i][e]) : tu_f32_to_bf16(g[i][e]));
    CHECK(wrong == 0, "%s %s: %lld of %lld %s %s entries are not the f32 gradient rounded",
          attn_kernel_name(attn_ctx_kernel(ctx)), desc, (long long)wrong, (long long)n, attn_dtype_name(gdt), names[i]);
  }
}

/* The backward on f16/bf16 inputs is the backward on their f32 values, bitwise (it widens them), off
 * the half backward tiles. */
static void backward_halves(attn_ctx *ctx, const hcase *c, attn_dtype dt, int seed) {
  tu_rng r = {(uint64_t)seed * 31u + 5};
  prob H, F;
  make(&H, c, dt, &r);
  r.s = (uint64_t)seed * 31u + 5;
  make(&F, c, ATTN_F32, &r); /* the same draws, not rounded: replace by the halves' values */
  attn_tensor *hs[3] = {&H.q, &H.k, &H.v}, *fs[3] = {&F.q, &F.k, &F.v};
  for (int i = 0; i < 3; i++)
    for (int64_t e = 0; e < attn_tensor_numel(hs[i]); e++)
      ((float *)fs[i]->data)[e] = dt == ATTN_F16 ? tu_f16_to_f32(((uint16_t *)hs[i]->data)[e])
                                                 : tu_bf16_to_f32(((uint16_t *)hs[i]->data)[e]);
  arena *a = &F.a;
  const int64_t nq = c->B * c->Hq * c->Nq * c->D, nk = c->B * c->Hk * c->Nk * c->D, nv = c->B * c->Hk * c->Nk * c->Dv;
  const bwd_io io = bwd_inputs(a, c, &r);
  attn_tensor to = io.out, tl = io.lse, tdo = io.dout;
  CHECK_OK(ctx, attn_sdpa(ctx, &to, &tl, NULL, &F.q, &F.k, &F.v, &F.o));
  float *g[2][3];
  attn_tensor tg[2][3];
  const int64_t n3[3] = {nq, nk, nv};
  for (int w = 0; w < 2; w++)
    for (int i = 0; i < 3; i++) {
      g[w][i] = arena_alloc(a, sizeof(float) * (size_t)(n3[i] + 1));
      tu_poison_f32(g[w][i], n3[i]);
      tg[w][i] = attn_tensor_view(g[w][i], ATTN_F32, 4, (i == 0 ? &H.q : i == 1 ? &H.k : &H.v)->shape);
    }
  /* halves on AMX (bf16 on AVX512-BF16) run the backward tiles by DEFAULT (backward_tiles); FP32 keeps the
   * widened one */
  const attn_precision was = attn_ctx_precision(ctx);
  const attn_kernel kern = attn_ctx_kernel(ctx);
  if (kern == ATTN_KERNEL_AMX || (kern == ATTN_KERNEL_AVX512_BF16 && dt == ATTN_BF16))
    CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_FP32));
  CHECK_OK(ctx, attn_sdpa_backward(ctx, &tg[0][0], &tg[0][1], &tg[0][2], NULL, NULL, &tdo, &H.q, &H.k, &H.v, &to, &tl, &H.o));
  CHECK_OK(ctx, attn_sdpa_backward(ctx, &tg[1][0], &tg[1][1], &tg[1][2], NULL, NULL, &tdo, &F.q, &F.k, &F.v, &to, &tl, &F.o));
  /* gradients in bf16: the same f32 gradients, rounded (through f32 copies off the tiles) */
  char desc[32];
  snprintf(desc, sizeof desc, "(case %d)", seed);
  grads_are_rounded(ctx, a, &H, &io, g[0], desc, ATTN_BF16);
  CHECK_OK(ctx, attn_ctx_set_precision(ctx, was));
  int same = 1;
  for (int i = 0; i < 3; i++) same &= memcmp(g[0][i], g[1][i], sizeof(float) * (size_t)n3[i]) == 0;
  CHECK(same, "%s: backward on %s inputs differs from the backward on their f32 values (case %d)",
        attn_kernel_name(attn_ctx_kernel(ctx)), attn_dtype_name(dt), seed);
  arena_free(&H.a);
  arena_free(&F.a);
}

/* f32 q, k, v: the backward is fp32 under every policy (BF16 and F16 round only the forward's inputs),
 * bitwise DEFAULT's, and on no half tiles. */
static void backward_f32_any_policy(attn_ctx *ctx, const hcase *c, int seed) {
  tu_rng r = {(uint64_t)seed * 53u + 9};
  prob P;
  make(&P, c, ATTN_F32, &r);
  arena *a = &P.a;
  const bwd_io io = bwd_inputs(a, c, &r);
  attn_tensor to = io.out, tl = io.lse, tdo = io.dout;
  const attn_precision was = attn_ctx_precision(ctx);
  CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_DEFAULT));
  CHECK_OK(ctx, attn_sdpa(ctx, &to, &tl, NULL, &P.q, &P.k, &P.v, &P.o));
  const attn_tensor *shp[3] = {&P.q, &P.k, &P.v};
  float *g[3][3];
  static const attn_precision pol[3] = {ATTN_PRECISION_DEFAULT, ATTN_PRECISION_BF16, ATTN_PRECISION_F16};
  for (int w = 0; w < 3; w++) {
    attn_tensor tg[3];
    for (int i = 0; i < 3; i++) {
      const int64_t n = attn_tensor_numel(shp[i]);
      g[w][i] = arena_alloc(a, sizeof(float) * (size_t)(n + 1));
      tu_poison_f32(g[w][i], n);
      tg[i] = attn_tensor_view(g[w][i], ATTN_F32, 4, shp[i]->shape);
    }
    CHECK_OK(ctx, attn_ctx_set_precision(ctx, pol[w]));
    CHECK_OK(ctx, attn_sdpa_backward(ctx, &tg[0], &tg[1], &tg[2], NULL, NULL, &tdo, &P.q, &P.k, &P.v, &to, &tl, &P.o));
    CHECK(!strstr(attn_ctx_plan(ctx), "tiles"), "%s: f32 backward under %s ran half tiles: %s",
          attn_kernel_name(attn_ctx_kernel(ctx)), attn_precision_name(pol[w]), attn_ctx_plan(ctx));
    for (int i = 0; i < 3 && w > 0; i++)
      CHECK(!memcmp(g[w][i], g[0][i], sizeof(float) * (size_t)attn_tensor_numel(shp[i])),
            "%s: f32 backward under %s differs from DEFAULT's (case %d)", attn_kernel_name(attn_ctx_kernel(ctx)),
            attn_precision_name(pol[w]), seed);
  }
  CHECK_OK(ctx, attn_ctx_set_precision(ctx, was));
  arena_free(a);
}

/* out in f16 or bf16 is the f32 out rounded to nearest even, bitwise, on the blocked and the decode paths. */
static void half_out(attn_ctx *ctx, const hcase *c, attn_dtype in_dt, attn_dtype out_dt, int seed) {
  tu_rng r = {(uint64_t)seed * 77u + 3};
  prob P;
  make(&P, c, in_dt, &r);
  arena *a = &P.a;
  const int64_t no = c->B * c->Hq * c->Nq * c->Dv, so[4] = {c->B, c->Hq, c->Nq, c->Dv};
  float *o32 = arena_alloc(a, sizeof(float) * (size_t)(no + 1));
  uint16_t *oh = arena_alloc(a, sizeof(uint16_t) * (size_t)(no + 1));
  tu_poison_f32(o32, no);
  for (int64_t e = 0; e < no; e++) oh[e] = 0x7fc1; /* a NaN in either half type */
  attn_tensor t32 = attn_tensor_view(o32, ATTN_F32, 4, so), th = attn_tensor_view(oh, out_dt, 4, so);
  CHECK_OK(ctx, attn_sdpa(ctx, &t32, NULL, NULL, &P.q, &P.k, &P.v, &P.o));
  CHECK_OK(ctx, attn_sdpa(ctx, &th, NULL, NULL, &P.q, &P.k, &P.v, &P.o));
  int64_t wrong = 0;
  for (int64_t e = 0; e < no; e++)
    wrong += oh[e] != (out_dt == ATTN_BF16 ? tu_f32_to_bf16(o32[e]) : tu_f32_to_f16(o32[e]));
  CHECK(wrong == 0, "%s, %s in, %s out (decode %d): %lld of %lld elements are not the f32 out rounded (case %d)",
        attn_kernel_name(attn_ctx_kernel(ctx)), attn_dtype_name(in_dt), attn_dtype_name(out_dt), attn_ctx_decode(ctx),
        (long long)wrong, (long long)no, seed);
  arena_free(a);
}

/* The half backward on the tiles (AMX's; bf16 also AVX512-BF16's): bf16 (or f16) q, k, v (dout f32, as a
 * loss may give it), from the oracle's out and lse in f32, against the oracle's
 * backward on the same values with BF16_GRAD_BOUND (F16_GRAD_BOUND); the same
 * bits on 1 and 3 threads; gradients in the inputs' type are the f32 ones
 * rounded; poisoned outputs. Shapes the tiles do not take (D or Dv not a
 * multiple of 16) must run the fp32 backward. */
static void backward_tiles(attn_ctx *ctx, attn_ctx *oracle, const hcase *c, int seed, attn_dtype dt) {
  tu_rng r = {(uint64_t)seed * 7001u + 11};
  prob P;
  make(&P, c, dt, &r);
  arena *a = &P.a;
  char desc[300];
  describe(desc, sizeof desc, c, seed);
  const int64_t n3[3] = {c->B * c->Hq * c->Nq * c->D, c->B * c->Hk * c->Nk * c->D, c->B * c->Hk * c->Nk * c->Dv};
  const int64_t sh[1] = {c->Hq};
  const bwd_io io = bwd_inputs(a, c, &r);
  attn_tensor to = io.out, tl = io.lse, tdo = io.dout;
  /* out and lse as exact as f32 holds them: the oracle's Dd comes from its own probabilities, not from out */
  CHECK_OK(oracle, attn_sdpa_ref(oracle, &to, &tl, NULL, &P.q, &P.k, &P.v, &P.o));
  /* the oracle: f64 gradients from the same out and lse (sinks_grad is f32 on every path) */
  double *rg[3];
  attn_tensor trg[3];
  const attn_tensor *shp[3] = {&P.q, &P.k, &P.v};
  float *rsink = arena_alloc(a, sizeof(float) * (size_t)c->Hq);
  attn_tensor trs = attn_tensor_view(rsink, ATTN_F32, 1, sh);
  for (int i = 0; i < 3; i++) {
    rg[i] = arena_alloc(a, sizeof(double) * (size_t)(n3[i] + 1));
    trg[i] = attn_tensor_view(rg[i], ATTN_F64, 4, shp[i]->shape);
  }
  CHECK_OK(oracle, attn_sdpa_backward_ref(oracle, &trg[0], &trg[1], &trg[2], NULL, c->sinks ? &trs : NULL, &tdo, &P.q,
                                          &P.k, &P.v, &to, &tl, &P.o));
  const int tiles = c->D % 16 == 0 && c->Dv % 16 == 0;
  float *g[2][3], *sink[2];
  attn_tensor tg[2][3], ts[2];
  for (int w = 0; w < 2; w++) { /* w: 1 thread, 3 threads */
    for (int i = 0; i < 3; i++) {
      g[w][i] = arena_alloc(a, sizeof(float) * (size_t)(n3[i] + 1));
      tu_poison_f32(g[w][i], n3[i]);
      tg[w][i] = attn_tensor_view(g[w][i], ATTN_F32, 4, shp[i]->shape);
    }
    sink[w] = arena_alloc(a, sizeof(float) * (size_t)c->Hq);
    tu_poison_f32(sink[w], c->Hq);
    ts[w] = attn_tensor_view(sink[w], ATTN_F32, 1, sh);
    attn_ctx_set_threads(ctx, 1 + 2 * w);
    const attn_status st = attn_sdpa_backward(ctx, &tg[w][0], &tg[w][1], &tg[w][2], NULL, c->sinks ? &ts[w] : NULL, &tdo,
                                              &P.q, &P.k, &P.v, &to, &tl, &P.o);
    CHECK(st == ATTN_OK, "backward %s: %s", desc, attn_ctx_error(ctx));
    if (st) {
      arena_free(a);
      return;
    }
    const char *want = dt == ATTN_F16 ? "attn_sdpa_backward, f16 tiles (bf16 hi + lo)" : "attn_sdpa_backward, bf16 tiles";
    const int ran = strstr(attn_ctx_plan(ctx), want) != NULL;
    CHECK(ran == tiles, "backward %s: %s ran %d, expected %d; plan: %s", desc, want, ran, tiles, attn_ctx_plan(ctx));
  }
  static const char *const names[3] = {"dq", "dk", "dv"};
  /* Where every row sees one key (Nk 1, a window of 1), dS = P (dP - Dd) cancels: dq and dk are 0 but for
   * roundings, the oracle's and ours alike, and their relative error says nothing. Their error is taken
   * against at least a tenth of dv's norm (no cancellation there; dq and dk are of its order otherwise). */
  double dv_norm = 0;
  for (int64_t e = 0; e < n3[2]; e++) dv_norm += isfinite(rg[2][e]) ? rg[2][e] * rg[2][e] : 0;
  dv_norm = sqrt(dv_norm);
  for (int i = 0; i < 3; i++) {
    int bad = 0;
    double e = err_vs(g[0][i], rg[i], n3[i], &bad);
    if (i < 2) {
      double want = 0;
      for (int64_t k = 0; k < n3[i]; k++) want += isfinite(rg[i][k]) ? rg[i][k] * rg[i][k] : 0;
      want = sqrt(want);
      if (want < 0.1 * dv_norm && want > 0) e *= want / (0.1 * dv_norm);
    }
    const double bound = !tiles ? F32_TOL * 10 : dt == ATTN_F16 ? F16_GRAD_BOUND : BF16_GRAD_BOUND;
    CHECK(!bad && e <= bound, "backward %s, %s: %s rel L2 %.3g (or a non-finite value)", desc, attn_dtype_name(dt),
          names[i], e);
    CHECK(!memcmp(g[0][i], g[1][i], sizeof(float) * (size_t)n3[i]), "backward %s: %s differs between 1 and 3 threads",
          desc, names[i]);
  }
  if (c->sinks) {
    int bad = 0;
    double rs[8];
    for (int64_t h = 0; h < c->Hq; h++) rs[h] = rsink[h];
    CHECK(err_vs(sink[0], rs, c->Hq, &bad) <= 1e-4 && !bad, "backward %s: sinks_grad", desc);
  }
  grads_are_rounded(ctx, a, &P, &io, g[0], desc, dt); /* the tiles' f32 gradients, rounded */
  if (tiles && dt == ATTN_BF16) { /* dout stored as bf16 (copied as it is) = dout of the same values in f32 */
    const int64_t nd = c->B * c->Hq * c->Nq * c->Dv;
    uint16_t *dh = arena_alloc(a, sizeof(uint16_t) * (size_t)(nd + 1));
    float *df = arena_alloc(a, sizeof(float) * (size_t)(nd + 1));
    for (int64_t e = 0; e < nd; e++) dh[e] = tu_f32_to_bf16(((const float *)tdo.data)[e]), df[e] = tu_bf16_to_f32(dh[e]);
    attn_tensor tdh = attn_tensor_view(dh, ATTN_BF16, 4, tdo.shape), tdf = attn_tensor_view(df, ATTN_F32, 4, tdo.shape);
    const attn_tensor *dos[2] = {&tdf, &tdh};
    for (int w = 0; w < 2; w++) {
      for (int i = 0; i < 3; i++) tu_poison_f32(g[w][i], n3[i]);
      CHECK_OK(ctx, attn_sdpa_backward(ctx, &tg[w][0], &tg[w][1], &tg[w][2], NULL, NULL, dos[w], &P.q, &P.k, &P.v, &to,
                                       &tl, &P.o));
    }
    for (int i = 0; i < 3; i++)
      CHECK(!memcmp(g[0][i], g[1][i], sizeof(float) * (size_t)n3[i]), "backward %s: %s with a bf16 dout differs", desc,
            names[i]);
  }
  arena_free(a);
}

/* Rel L2 of got (row b's out for the queries q, one batch row, bottom-right causal) against the
 * oracle on what the cache holds for that row. */
static double cache_row_err(attn_ctx *ctx, attn_ctx *oracle, arena *a, attn_kv_cache *cache, int64_t b,
                            attn_tensor q, const float *got, int *bad) {
  attn_tensor kv, vv;
  CHECK_OK(ctx, attn_kv_cache_view(ctx, &kv, &vv, cache, b));
  const int64_t n = q.shape[1] * q.shape[2] * q.shape[3];
  double *ro = arena_alloc(a, sizeof(double) * (size_t)n);
  attn_tensor tro = attn_tensor_view(ro, ATTN_F64, 4, q.shape);
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
  CHECK_OK(oracle, attn_sdpa_ref(oracle, &tro, NULL, NULL, &q, &kv, &vv, &o));
  return err_vs(got, ro, n, bad);
}

/* A KV cache in bf16 attended by bf16 queries with more rows per kv head than the decode kernel
 * takes (a chunk of a prefill, or a wide GQA group): each row goes through the blocked forward, so
 * the AMX tiles must run, and out agrees with the oracle on the cached values (BF16_OUT_BOUND).
 * f32 queries under DEFAULT are widened (mixed dtypes), and under BF16 rounded onto the tiles.
 * A paged cache holding the same tokens in blocks of 16, its pool first filled with NaN tokens,
 * takes the same tiles through its block tables, bitwise the linear cache's results. */
static void kv_cache_tiles(attn_ctx *ctx, attn_ctx *oracle) {
  enum { B = 2, Hk = 2, Hq = 8, D = 64, Nq = 20, CAP = 300 };
  const int64_t lens[B] = {150, 77};
  arena a = {{0}, 0};
  tu_rng r = {99};
  attn_kv_cache_config kc;
  attn_kv_cache_config_init(&kc, B, CAP, Hk, D);
  kc.dtype = ATTN_BF16;
  attn_kv_cache *cache;
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &kc));
  const int64_t sk[4] = {B, Hk, 150, D}, sq[4] = {B, Hq, Nq, D}, so[4] = {B, Hq, Nq, D};
  float *k = arena_alloc(&a, sizeof(float) * B * Hk * 150 * D), *v = arena_alloc(&a, sizeof(float) * B * Hk * 150 * D);
  tu_fill_f32(&r, k, B * Hk * 150 * D, 1.5), tu_fill_f32(&r, v, B * Hk * 150 * D, 1);
  attn_tensor tk = attn_tensor_view(k, ATTN_F32, 4, sk), tv = attn_tensor_view(v, ATTN_F32, 4, sk);
  CHECK_OK(ctx, attn_kv_cache_append(ctx, cache, &tk, &tv, lens));
  enum { BLOCKS = 40, BT = 16 };
  attn_paged_kv_config pc;
  attn_paged_kv_config_init(&pc, BLOCKS, BT, Hk, D);
  pc.k_dtype = pc.v_dtype = ATTN_KV_BF16;
  attn_paged_kv_cache *pg;
  CHECK_OK(ctx, attn_paged_kv_create(ctx, &pg, &pc));
  {
    const int64_t sn[4] = {1, Hk, BLOCKS * BT, D};
    float *nan = arena_alloc(&a, sizeof(float) * Hk * BLOCKS * BT * D);
    tu_poison_f32(nan, Hk * BLOCKS * BT * D);
    attn_tensor tn = attn_tensor_view(nan, ATTN_F32, 4, sn);
    int64_t s;
    CHECK_OK(ctx, attn_paged_kv_seq_new(ctx, pg, &s));
    CHECK_OK(ctx, attn_paged_kv_append(ctx, pg, 1, &s, &tn, &tn, NULL));
    CHECK_OK(ctx, attn_paged_kv_seq_free(ctx, pg, s));
  }
  int64_t seqs[B];
  for (int64_t b = 0; b < B; b++) CHECK_OK(ctx, attn_paged_kv_seq_new(ctx, pg, &seqs[b]));
  CHECK_OK(ctx, attn_paged_kv_append(ctx, pg, B, seqs, &tk, &tv, lens));
  float *q32 = arena_alloc(&a, sizeof(float) * B * Hq * Nq * D);
  uint16_t *q16 = arena_alloc(&a, sizeof(uint16_t) * B * Hq * Nq * D);
  tu_fill_f32(&r, q32, B * Hq * Nq * D, 1.5);
  for (int64_t e = 0; e < B * Hq * Nq * D; e++) q16[e] = tu_f32_to_bf16(q32[e]), q32[e] = tu_bf16_to_f32(q16[e]);
  attn_tensor tq16 = attn_tensor_view(q16, ATTN_BF16, 4, sq), tq32 = attn_tensor_view(q32, ATTN_F32, 4, sq);
  float *out = arena_alloc(&a, sizeof(float) * B * Hq * Nq * D), *pout = arena_alloc(&a, sizeof(float) * B * Hq * Nq * D);
  attn_tensor to = attn_tensor_view(out, ATTN_F32, 4, so), tpo = attn_tensor_view(pout, ATTN_F32, 4, so);
  for (int c = 0; c < 3; c++) { /* bf16 q; f32 q under DEFAULT; f32 q under BF16 */
    CHECK_OK(ctx, attn_ctx_set_precision(ctx, c == 2 ? ATTN_PRECISION_BF16 : ATTN_PRECISION_DEFAULT));
    tu_poison_f32(out, B * Hq * Nq * D);
    CHECK_OK(ctx, attn_kv_cache_attend(ctx, cache, &to, NULL, c ? &tq32 : &tq16, NULL));
    const int tiles = strstr(attn_ctx_plan(ctx), "bf16 tiles") != NULL;
    CHECK(tiles == (c != 1), "kv cache, %s queries%s: bf16 tiles ran %d: %s", c ? "f32" : "bf16",
          c == 2 ? " under bf16" : "", tiles, attn_ctx_plan(ctx));
    tu_poison_f32(pout, B * Hq * Nq * D);
    CHECK_OK(ctx, attn_paged_kv_attend(ctx, pg, &tpo, NULL, c ? &tq32 : &tq16, B, seqs, NULL));
    CHECK((strstr(attn_ctx_plan(ctx), "bf16 tiles") != NULL) == (c != 1), "paged kv cache, case %d: %s", c,
          attn_ctx_plan(ctx));
    CHECK(memcmp(out, pout, sizeof(float) * B * Hq * Nq * D) == 0, "paged kv cache, case %d: out differs from the linear cache's", c);
    /* the oracle on what the cache holds, row by row */
    for (int64_t b = 0; b < B; b++) {
      const int64_t sqr[4] = {1, Hq, Nq, D};
      int bad = 0;
      const double e = cache_row_err(ctx, oracle, &a, cache, b, attn_tensor_view(q32 + b * Hq * Nq * D, ATTN_F32, 4, sqr),
                                     out + b * Hq * Nq * D, &bad);
      CHECK(!bad && e <= (c == 1 ? F32_TOL : BF16_OUT_BOUND), "kv cache row %lld, case %d: out rel L2 %.3g",
            (long long)b, c, e);
    }
  }
  CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_DEFAULT));
  { /* 4 new tokens (16 rows a kv head): the decode, q.k and p.v on its tiles, the paged pool read through
     * its block tables with NaN in its free slots, bitwise the linear cache's, within fp32's bound */
    enum { NQ4 = 4 };
    const int64_t s4[4] = {B, Hq, NQ4, D};
    attn_tensor tq4 = tq16, to4 = attn_tensor_view(out, ATTN_F32, 4, s4), tp4 = attn_tensor_view(pout, ATTN_F32, 4, s4);
    tq4.shape[2] = NQ4; /* the first 4 of each head's rows */
    tu_poison_f32(out, B * Hq * NQ4 * D), tu_poison_f32(pout, B * Hq * NQ4 * D);
    CHECK_OK(ctx, attn_kv_cache_attend(ctx, cache, &to4, NULL, &tq4, NULL));
    CHECK(strstr(attn_ctx_plan(ctx), "q.k on the tiles") != NULL, "kv cache, 16 rows: %s", attn_ctx_plan(ctx));
    CHECK_OK(ctx, attn_paged_kv_attend(ctx, pg, &tp4, NULL, &tq4, B, seqs, NULL));
    CHECK(strstr(attn_ctx_plan(ctx), "q.k on the tiles") != NULL, "paged kv cache, 16 rows: %s", attn_ctx_plan(ctx));
    CHECK(memcmp(out, pout, sizeof(float) * B * Hq * NQ4 * D) == 0, "paged kv cache, 16 rows: out differs from the linear cache's");
    for (int64_t b = 0; b < B; b++) {
      attn_tensor tqr = tq4;
      tqr.data = q16 + b * Hq * Nq * D, tqr.shape[0] = 1;
      int bad = 0;
      const double e = cache_row_err(ctx, oracle, &a, cache, b, tqr, out + b * Hq * NQ4 * D, &bad);
      CHECK(!bad && e <= F32_TOL, "kv cache row %lld, 16 rows: out rel L2 %.3g", (long long)b, e);
    }
  }
  attn_kv_cache_destroy(cache);
  attn_paged_kv_destroy(pg);
  arena_free(&a);
}

/* Logits that rise from one key block to the next by a set amount per head, so that the fused
 * softmax (kernels.h's softmax_round) meets each of its cases: +3 a block leaves m trailing the
 * row's maximum (it moves only past LAZY_MAX), +30 moves it every block (the two passes; were it
 * kept, P would pass fp32's range by the fourth block), -4 never moves it. lse must stay within
 * fp32's bound and out within bf16's (the weights, asked for on 2 threads, fp32's); with a last
 * partial tile, on 1 and 2 threads. Nk 640: ten blocks, queued for pv_blocks a few at a time, so
 * a moving m rescales O inside a queue too; D 64 is one group of O's columns for pv_blocks, D 144
 * three (64, 64 and 16). */
static void rising_logits(attn_ctx *ctx, attn_ctx *oracle, const int64_t D) {
  enum { H = 3, Nq = 40, Nk = 640 };
  const double rise[H] = {3, 30, -4};
  arena a = {{0}, 0};
  tu_rng r = {4242};
  const int64_t sq[4] = {1, H, Nq, D}, sk[4] = {1, H, Nk, D}, sl[3] = {1, H, Nq}, sw[4] = {1, H, Nq, Nk};
  uint16_t *q = arena_alloc(&a, 2 * H * Nq * D), *k = arena_alloc(&a, 2 * H * Nk * D), *v = arena_alloc(&a, 2 * H * Nk * D);
  for (int64_t e = 0; e < H * Nq * D; e++) q[e] = tu_f32_to_bf16((float)(1 + 0.25 * tu_uniform(&r)));
  for (int64_t h = 0; h < H; h++)
    for (int64_t j = 0; j < Nk; j++)
      for (int64_t d = 0; d < D; d++) { /* scale * q.k is about rise * (j / 64) + a little */
        const int64_t e = (h * Nk + j) * D + d;
        k[e] = tu_f32_to_bf16((float)((rise[h] * (double)(j / 64) + tu_uniform(&r)) / sqrt((double)D)));
        v[e] = tu_f32_to_bf16((float)tu_uniform(&r));
      }
  attn_tensor tq = attn_tensor_view(q, ATTN_BF16, 4, sq), tk = attn_tensor_view(k, ATTN_BF16, 4, sk);
  attn_tensor tv = attn_tensor_view(v, ATTN_BF16, 4, sk);
  double *ro = arena_alloc(&a, sizeof(double) * H * Nq * D), *rl = arena_alloc(&a, sizeof(double) * H * Nq);
  double *rw = arena_alloc(&a, sizeof(double) * H * Nq * Nk);
  attn_tensor tro = attn_tensor_view(ro, ATTN_F64, 4, sq), trl = attn_tensor_view(rl, ATTN_F64, 3, sl);
  attn_tensor trw = attn_tensor_view(rw, ATTN_F64, 4, sw);
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  CHECK_OK(oracle, attn_sdpa_ref(oracle, &tro, &trl, &trw, &tq, &tk, &tv, &o));
  float *out = arena_alloc(&a, sizeof(float) * H * Nq * D), *lse = arena_alloc(&a, sizeof(float) * H * Nq);
  float *w = arena_alloc(&a, sizeof(float) * H * Nq * Nk);
  attn_tensor to = attn_tensor_view(out, ATTN_F32, 4, sq), tl = attn_tensor_view(lse, ATTN_F32, 3, sl);
  attn_tensor tw = attn_tensor_view(w, ATTN_F32, 4, sw);
  for (int threads = 1; threads <= 2; threads++) {
    attn_ctx_set_threads(ctx, threads);
    tu_poison_f32(out, H * Nq * D), tu_poison_f32(lse, H * Nq), tu_poison_f32(w, H * Nq * Nk);
    CHECK_OK(ctx, attn_sdpa(ctx, &to, &tl, threads == 2 ? &tw : NULL, &tq, &tk, &tv, &o));
    CHECK(strstr(attn_ctx_plan(ctx), "bf16 tiles") != NULL, "rising logits: the plan is %s", attn_ctx_plan(ctx));
    for (int64_t h = 0; h < H; h++) {
      int bad = 0;
      const double eo = err_vs(out + h * Nq * D, ro + h * Nq * D, Nq * D, &bad);
      const double el = err_vs(lse + h * Nq, rl + h * Nq, Nq, &bad);
      const double ew = threads == 2 ? err_vs(w + h * Nq * Nk, rw + h * Nq * Nk, Nq * Nk, &bad) : 0;
      CHECK(!bad && eo <= BF16_OUT_BOUND && el <= F32_TOL && ew <= F32_TOL,
            "rising logits, D %lld, %+g a block, %d threads: out rel L2 %.3g, lse %.3g, weights %.3g", (long long)D,
            rise[h], threads, eo, el, ew);
    }
  }
  arena_free(&a);
}

/* Decode-sized steps with bf16 q and k on AMX (engine/decode.c's dec_tiles): q.k on the tiles with K read
 * in place, and p.v there too for bf16 values with Dv a multiple of 32 (P as three bf16 terms), so the
 * error bound is the fp32 decode's (test_decode's), not the bf16 policy's. 8 to 64 rows a kv head, key
 * counts under one tile (5), off the 16-key tiles (37, 130) and past a chunk (2100), every option; the
 * keys padded away hold NaN in K and Inf in V, which no row may meet (a block holding them goes to the
 * vectors' p.v, the others to the tiles'). The plan must name the tiles where they take the shape (D a
 * multiple of 32, at most 256) and not elsewhere; 1-3 threads give the same bits. */
typedef struct tcase {
  int64_t B, Hq, Hk, Nq, Nk, D, Dv;
  attn_causal causal;
  int batch_first, kpm, mask;
  int64_t window;
  double softcap;
  int alibi, tiles;
} tcase;

static void decode_tiles_case(attn_ctx *ctx, attn_ctx *oracle, const tcase *c, uint64_t seed) {
  tu_rng r = {seed};
  arena a = {{0}, 0};
  const int64_t nq = c->B * c->Hq * c->Nq * c->D, nk = c->B * c->Hk * c->Nk * c->D, nv = c->B * c->Hk * c->Nk * c->Dv;
  const int64_t no = c->B * c->Hq * c->Nq * c->Dv;
  uint16_t *q = arena_alloc(&a, 2 * (size_t)nq), *k = arena_alloc(&a, 2 * (size_t)nk), *v = arena_alloc(&a, 2 * (size_t)nv);
  for (int64_t i = 0; i < nq; i++) q[i] = tu_f32_to_bf16((float)(tu_uniform(&r) * 1.5));
  for (int64_t i = 0; i < nk; i++) k[i] = tu_f32_to_bf16((float)(tu_uniform(&r) * 1.5));
  for (int64_t i = 0; i < nv; i++) v[i] = tu_f32_to_bf16((float)tu_uniform(&r));
  const int64_t sq[4] = {c->B, c->Hq, c->Nq, c->D}, sk[4] = {c->B, c->Hk, c->Nk, c->D}, sv[4] = {c->B, c->Hk, c->Nk, c->Dv};
  const int64_t so[4] = {c->B, c->Hq, c->Nq, c->Dv}, sp[2] = {c->B, c->Nk}, sm[2] = {c->Nq, c->Nk}, sh[1] = {c->Hq};
  attn_tensor tq = attn_tensor_view(q, ATTN_BF16, 4, sq), tk = attn_tensor_view(k, ATTN_BF16, 4, sk);
  attn_tensor tv = attn_tensor_view(v, ATTN_BF16, 4, sv);
  if (c->batch_first) { /* [B, N, H, F] in memory */
    attn_tensor *ts[3] = {&tq, &tk, &tv};
    for (int i = 0; i < 3; i++) {
      const int64_t H = ts[i]->shape[1], N = ts[i]->shape[2], F = ts[i]->shape[3];
      ts[i]->strides[1] = F, ts[i]->strides[2] = H * F, ts[i]->strides[0] = H * N * F;
    }
  }
  uint8_t *kpm = arena_alloc(&a, (size_t)(c->B * c->Nk + 1)), *mask = arena_alloc(&a, (size_t)(c->Nq * c->Nk + 1));
  for (int64_t i = 0; i < c->B * c->Nk; i++) kpm[i] = c->kpm && tu_int(&r, 0, 6) == 0;
  for (int64_t i = 0; i < c->Nq * c->Nk; i++) mask[i] = tu_int(&r, 0, 4) != 0;
  float slopes[64];
  attn_alibi_slopes(slopes, c->Hq);
  attn_tensor tp = attn_tensor_view(kpm, ATTN_BOOL, 2, sp), tm = attn_tensor_view(mask, ATTN_BOOL, 2, sm);
  attn_tensor ta = attn_tensor_view(slopes, ATTN_F32, 1, sh);
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.causal = c->causal, o.window = c->window, o.softcap = c->softcap;
  if (c->kpm) o.key_padding = &tp;
  if (c->mask) o.mask = &tm;
  if (c->alibi) o.alibi_slopes = &ta;
  double *ref = arena_alloc(&a, sizeof(double) * (size_t)no);
  attn_tensor tr = attn_tensor_view(ref, ATTN_F64, 4, so);
  CHECK_OK(oracle, attn_sdpa_ref(oracle, &tr, NULL, NULL, &tq, &tk, &tv, &o)); /* before the poison: the true answer */
  for (int64_t b = 0; b < c->B; b++)
    for (int64_t j = 0; j < c->Nk; j++) {
      if (!kpm[b * c->Nk + j]) continue;
      for (int64_t g = 0; g < c->Hk; g++) {
        for (int64_t d = 0; d < c->D; d++) k[off4(&tk, b, g, j, d)] = 0x7fc0; /* NaN */
        for (int64_t d = 0; d < c->Dv; d++) v[off4(&tv, b, g, j, d)] = 0x7f80; /* Inf */
      }
    }
  char what[160];
  snprintf(what, sizeof what, "decode tiles B%lld Hq%lld Hk%lld Nq%lld Nk%lld D%lld Dv%lld causal%d bf%d kpm%d mask%d W%lld cap%g alibi%d",
           (long long)c->B, (long long)c->Hq, (long long)c->Hk, (long long)c->Nq, (long long)c->Nk, (long long)c->D,
           (long long)c->Dv, (int)c->causal, c->batch_first, c->kpm, c->mask, (long long)c->window, c->softcap, c->alibi);
  const double tol = c->alibi ? 1e-5 : c->softcap > 0 ? 3e-6 : 2e-6;
  float *first = arena_alloc(&a, sizeof(float) * (size_t)no), *out = arena_alloc(&a, sizeof(float) * (size_t)no);
  for (int threads = 1; threads <= 3; threads++) {
    attn_ctx_set_threads(ctx, threads);
    tu_poison_f32(out, no);
    attn_tensor to = attn_tensor_view(out, ATTN_F32, 4, so);
    CHECK_OK(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &tv, &o));
    const char *plan = attn_ctx_plan(ctx);
    CHECK(strstr(plan, "attn_sdpa decode") != NULL, "%s: plan %s", what, plan);
    CHECK((strstr(plan, "q.k on the tiles") != NULL) == c->tiles, "%s: tiles expected %d, plan %s", what, c->tiles, plan);
    double *got = tu_to_f64(&to);
    const double err = tu_rel_l2(got, ref, no);
    CHECK(err <= tol, "%s, %d threads: rel L2 %.3g against the oracle", what, threads, err);
    free(got);
    if (threads == 1) memcpy(first, out, sizeof(float) * (size_t)no);
    else CHECK(!memcmp(first, out, sizeof(float) * (size_t)no), "%s: %d threads differ from 1", what, threads);
  }
  arena_free(&a);
}

static void decode_tiles(attn_ctx *ctx, attn_ctx *oracle) {
  const tcase cases[] = {
      /* B Hq Hk Nq Nk    D    Dv  causal                    bf kpm mask W   cap alibi tiles */
      {1, 32, 8, 2, 700, 128, 128, ATTN_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, 0, 0, 0, 1},   /* 8 rows */
      {2, 8, 2, 3, 2100, 64, 64, ATTN_CAUSAL_BOTTOM_RIGHT, 0, 1, 0, 0, 0, 0, 1},    /* 12 rows, two chunks */
      {1, 16, 1, 2, 130, 32, 48, ATTN_CAUSAL_BOTTOM_RIGHT, 1, 1, 1, 0, 0, 0, 1},    /* 32 rows */
      {1, 8, 1, 2, 5, 64, 64, ATTN_CAUSAL_NONE, 0, 0, 0, 0, 0, 0, 1},               /* under one tile of keys */
      {1, 8, 2, 5, 37, 256, 80, ATTN_CAUSAL_TOP_LEFT, 0, 1, 0, 0, 0, 0, 1},         /* 20 rows, D 256 */
      {1, 12, 4, 3, 900, 64, 64, ATTN_CAUSAL_BOTTOM_RIGHT, 0, 0, 1, 300, 8.0, 1, 1}, /* the options */
      {2, 8, 1, 3, 513, 96, 64, ATTN_CAUSAL_NONE, 1, 1, 0, 0, 0, 1, 1},
      {1, 8, 2, 4, 640, 128, 128, ATTN_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, 100, 0, 0, 1},
      {1, 32, 2, 3, 1500, 64, 96, ATTN_CAUSAL_BOTTOM_RIGHT, 1, 1, 0, 0, 0, 0, 1},    /* 48 rows */
      {1, 32, 4, 8, 2200, 128, 128, ATTN_CAUSAL_BOTTOM_RIGHT, 0, 0, 1, 0, 30.0, 0, 1}, /* 64 rows */
      {2, 16, 1, 4, 300, 32, 32, ATTN_CAUSAL_NONE, 0, 1, 0, 0, 0, 0, 1},            /* 64 rows, padded keys */
      {1, 8, 8, 1, 700, 128, 128, ATTN_CAUSAL_BOTTOM_RIGHT, 0, 1, 0, 0, 0, 0, 0},   /* 1 row: the vectors */
      {1, 16, 2, 2, 300, 80, 80, ATTN_CAUSAL_BOTTOM_RIGHT, 0, 1, 0, 0, 0, 0, 0},    /* D 80: the vectors */
      {1, 8, 1, 2, 300, 288, 64, ATTN_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, 0, 0, 0, 0},    /* D past 256: the vectors */
  };
  CHECK_OK(ctx, attn_ctx_set_decode(ctx, 1));
  CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_DEFAULT));
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) decode_tiles_case(ctx, oracle, &cases[i], 4000 + i);
  /* under FP32 no tile runs */
  tcase c = cases[0];
  c.tiles = 0;
  CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_FP32));
  decode_tiles_case(ctx, oracle, &c, 4100);
  CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_DEFAULT));
}

static int policy(void) {
  attn_ctx *ctx, *oracle;
  attn_ctx_create(&ctx);
  attn_ctx_create(&oracle);
  CHECK(attn_ctx_precision(ctx) == ATTN_PRECISION_DEFAULT || getenv("ATTN_PRECISION"), "default precision");
  CHECK_ERR(ctx, attn_ctx_set_precision(ctx, (attn_precision)7), ATTN_E_INVALID, "unknown precision");
  CHECK(attn_ctx_precision(NULL) == ATTN_PRECISION_DEFAULT, "NULL context: DEFAULT");
  CHECK(!strcmp(attn_precision_name(ATTN_PRECISION_BF16), "bf16") && !strcmp(attn_precision_name(ATTN_PRECISION_FP32), "fp32") &&
            !strcmp(attn_precision_name(ATTN_PRECISION_DEFAULT), "default") &&
            !strcmp(attn_precision_name(ATTN_PRECISION_F16), "f16"), "precision names");
  CHECK_ERR(ctx, attn_ctx_set_precision(ctx, (attn_precision)(ATTN_PRECISION_F16 + 1)), ATTN_E_INVALID,
            "unknown precision 4");
  /* no input loses precision outside the rules, on every kernel this CPU runs */
  tu_rng r = {77};
  for (int k = ATTN_KERNEL_C; k <= ATTN_KERNEL_AMX; k++) {
    if (!attn_kernel_supported((attn_kernel)k)) continue;
    CHECK_OK(ctx, attn_ctx_set_kernel(ctx, (attn_kernel)k));
    for (int seed = 0; seed < 12; seed++) {
      const hcase c = random_case(&r, 0);
      char what[96];
      snprintf(what, sizeof what, "%s, f32 under default", attn_kernel_name((attn_kernel)k));
      CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_DEFAULT));
      run(ctx, oracle, &c, ATTN_F32, seed, 0, 0, what);
      snprintf(what, sizeof what, "%s, f16 under bf16", attn_kernel_name((attn_kernel)k));
      CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_BF16));
      /* f16 is never rounded to bf16: widened, or on AMX's f16 tiles (exact products) where they take the shape */
      run(ctx, oracle, &c, ATTN_F16, seed, k == ATTN_KERNEL_AMX && amx_takes(&c) ? 2 : 0, 0, what);
      snprintf(what, sizeof what, "%s, bf16 under fp32", attn_kernel_name((attn_kernel)k));
      CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_FP32));
      run(ctx, oracle, &c, ATTN_BF16, seed, 0, 0, what);
      /* bf16 is never rounded to f16 (a narrower range): as DEFAULT computes it */
      snprintf(what, sizeof what, "%s, bf16 under f16", attn_kernel_name((attn_kernel)k));
      CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_F16));
      run(ctx, oracle, &c, ATTN_BF16, seed, k >= ATTN_KERNEL_AVX512_BF16 && (k != ATTN_KERNEL_AMX || amx_takes(&c)), 0,
          what);
      CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_DEFAULT));
      backward_halves(ctx, &c, seed % 2 ? ATTN_BF16 : ATTN_F16, seed);
      if (seed % 3 == 0) backward_f32_any_policy(ctx, &c, seed);
      if (k == ATTN_KERNEL_C) { /* and the oracle, which writes f32 or f64 itself */
        CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_REF));
        backward_halves(ctx, &c, seed % 2 ? ATTN_BF16 : ATTN_F16, seed);
        CHECK_OK(ctx, attn_ctx_set_kernel(ctx, (attn_kernel)k));
      }
      hcase small = c; /* few query rows per kv head: the decode kernel */
      small.Nq = 1 + seed % 2;
      small.Hq = small.Hk * (1 + seed % 3);
      for (int dec = 0; dec < 2; dec++) {
        CHECK_OK(ctx, attn_ctx_set_decode(ctx, dec));
        half_out(ctx, dec ? &small : &c, seed % 2 ? ATTN_BF16 : ATTN_F16, seed % 3 ? ATTN_BF16 : ATTN_F16, seed);
      }
      CHECK_OK(ctx, attn_ctx_set_decode(ctx, 1));
      if (k < ATTN_KERNEL_AVX512_BF16) { /* kernels without bf16 tiles widen bf16 under every policy */
        snprintf(what, sizeof what, "%s, bf16 under default", attn_kernel_name((attn_kernel)k));
        CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_DEFAULT));
        run(ctx, oracle, &c, ATTN_BF16, seed, 0, 0, what);
      }
    }
  }
  attn_ctx_destroy(ctx);
  attn_ctx_destroy(oracle);
  return tu_finish("test_half policy");
}

#ifdef ATTN_HAVE_AMX
/* The AMX set's split_f16 (its base's) against half.h's attn__split_row, bitwise (a NaN only as a
 * NaN in both terms' hi): every f16 value; f32 values at and around f16's rounding boundaries, its
 * subnormal range, 65504 and the overflow to Inf, and random ones; rows of every length to 70, at
 * every start, so each tail mask is met. */
static int same_split(uint16_t a, uint16_t b) {
  const int nan_a = (a & 0x7f80) == 0x7f80 && (a & 0x7f), nan_b = (b & 0x7f80) == 0x7f80 && (b & 0x7f);
  return nan_a || nan_b ? nan_a == nan_b : a == b;
}
static void split_f16_bitwise(void) {
  void (*split)(uint16_t *, uint16_t *, const void *, int, int64_t) = attn__kernels_avx512_16.split_f16;
  CHECK(split != NULL, "the AMX set's base has no split_f16");
  if (!split) return;
  enum { N = 65536 + 70 };
  static uint16_t h[N], hi[N], lo[N], rhi[N], rlo[N];
  static float f[N];
  for (int e = 0; e < 65536; e++) h[e] = (uint16_t)e;
  split(hi, lo, h, 1, 65536);
  attn__split_row(rhi, rlo, h, 1, 0, 1, 65536);
  int bad = 0;
  for (int e = 0; e < 65536; e++) bad += !same_split(hi[e], rhi[e]) || !same_split(lo[e], rlo[e]);
  CHECK(bad == 0, "split_f16: %d of the 65536 f16 values split otherwise than attn__split_row", bad);
  /* f32: each f16 value, its neighbours one f32 ulp away, the midpoints to the next f16 and the floats
   * next to them, then random bits */
  tu_rng r = {77};
  int n = 0;
  for (int e = 0; e < 65535 && n + 6 <= N; e += 7) {
    const float x = tu_f16_to_f32((uint16_t)e), y = tu_f16_to_f32((uint16_t)(e + 1)), mid = 0.5f * (x + y);
    if (!isfinite(x) || !isfinite(y)) continue;
    f[n++] = x, f[n++] = nextafterf(x, INFINITY), f[n++] = mid, f[n++] = nextafterf(mid, -INFINITY);
    f[n++] = nextafterf(mid, INFINITY), f[n++] = -mid;
  }
  const float edges[] = {65504.0f, 65519.996f, 65520.0f, 1e6f, INFINITY, -INFINITY, NAN, 0.0f, -0.0f, 0x1p-25f,
                         0x1.8p-25f, 0x1p-24f, 0x1.7ffp-15f, 0x1p-14f, 1e-30f};
  for (size_t k = 0; k < sizeof edges / sizeof edges[0]; k++) f[n++] = edges[k];
  while (n < N) {
    uint32_t u = (uint32_t)tu_next(&r);
    float x;
    memcpy(&x, &u, 4);
    f[n++] = x;
  }
  split(hi, lo, f, 0, N);
  attn__split_row(rhi, rlo, f, 0, 0, 1, N);
  bad = 0;
  for (int e = 0; e < N; e++) bad += !same_split(hi[e], rhi[e]) || !same_split(lo[e], rlo[e]);
  CHECK(bad == 0, "split_f16: %d of %d f32 values split otherwise than attn__split_row", bad, N);
  /* short rows at every offset: the tail masks, and nothing written past n */
  for (int len = 0; len <= 70; len++)
    for (int at = 0; at < 33; at += 8) {
      uint16_t oh[80], ol[80];
      for (int e = 0; e < 80; e++) oh[e] = ol[e] = 0xabcd;
      split(oh, ol, h + 1000 + at, 1, len);
      attn__split_row(rhi, rlo, h + 1000 + at, 1, 0, 1, len);
      int wrong = 0;
      for (int e = 0; e < len; e++) wrong += oh[e] != rhi[e] || ol[e] != rlo[e];
      for (int e = len; e < 80; e++) wrong += oh[e] != 0xabcd || ol[e] != 0xabcd;
      CHECK(wrong == 0, "split_f16: a row of %d at offset %d: %d values wrong or written past its end", len, at, wrong);
    }
}
#endif

int main(int argc, char **argv) {
  const char *kname = argc > 1 ? argv[1] : "policy";
  if (!strcmp(kname, "policy")) return policy();
  const attn_kernel kern = tu_kernel_or_skip(kname);
  if (kern != ATTN_KERNEL_AVX512_BF16 && kern != ATTN_KERNEL_AMX) {
    fprintf(stderr, "test_half: %s has no half-precision tiles\n", kname);
    return 2;
  }
  amx_shapes = kern == ATTN_KERNEL_AMX;
#ifdef ATTN_HAVE_AMX
  if (amx_shapes) split_f16_bitwise();
#endif
  attn_ctx *ctx, *oracle;
  attn_ctx_create(&ctx);
  attn_ctx_create(&oracle);
  attn_ctx_set_threads(oracle, 2);
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, kern));
  CHECK_OK(ctx, attn_ctx_set_decode(ctx, 0)); /* small cases too: the blocked forward, where the tiles are */
  tu_rng r = {2027};
  for (int seed = 0; seed < 60; seed++) {
    const int one_block = seed % 2 == 0;
    const hcase c = random_case(&r, one_block);
    for (int threads = 1; threads <= 3; threads += 2) {
      attn_ctx_set_threads(ctx, threads);
      char what[64];
      snprintf(what, sizeof what, "bf16 inputs, %d threads", threads);
      CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_DEFAULT));
      const int bf16_tiles = !amx_shapes || amx_takes(&c); /* AMX widens the shapes its tiles do not take */
      run(ctx, oracle, &c, ATTN_BF16, seed, bf16_tiles, one_block, what);
      snprintf(what, sizeof what, "f32 inputs under bf16, %d threads", threads);
      CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_BF16));
      run(ctx, oracle, &c, ATTN_F32, seed, bf16_tiles, 0, what);
      /* f32 under F16: rounded to f16 onto AMX's f16 tiles; widened (fp32, unrounded) elsewhere */
      snprintf(what, sizeof what, "f32 inputs under f16, %d threads", threads);
      CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_F16));
      run(ctx, oracle, &c, ATTN_F32, seed, kern == ATTN_KERNEL_AMX && amx_takes(&c) ? 2 : 0, 0, what);
      if (kern == ATTN_KERNEL_AMX) { /* f16 inputs: the f16 tiles where they take the shape, else widened */
        snprintf(what, sizeof what, "f16 inputs, %d threads", threads);
        CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_DEFAULT));
        run(ctx, oracle, &c, ATTN_F16, seed, amx_takes(&c) ? 2 : 0, one_block, what);
      }
    }
    CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_DEFAULT));
    backward_tiles(ctx, oracle, &c, seed, ATTN_BF16);
    if (kern == ATTN_KERNEL_AMX) backward_tiles(ctx, oracle, &c, seed, ATTN_F16);
  }
  { /* a kv head's K and V past 1 MiB: 16 tiles share each key block (engine/forward.c), shown by the plan */
    const hcase c = {1, 2, 1, 300, 4200, 64, 64, ATTN_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, 0, 0, 0, 0};
    attn_ctx_set_threads(ctx, 1);
    CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_DEFAULT));
    run(ctx, oracle, &c, ATTN_BF16, 9001, 1, 0, "bf16 inputs, long keys, 1 thread");
    CHECK(strstr(attn_ctx_plan(ctx), "query blocks of 16 x") != NULL, "long keys: the plan is %s", attn_ctx_plan(ctx));
  }
  CHECK_OK(ctx, attn_ctx_set_precision(ctx, ATTN_PRECISION_DEFAULT));
  rising_logits(ctx, oracle, 64);
  rising_logits(ctx, oracle, 144);
  if (kern == ATTN_KERNEL_AMX) {
    attn_ctx_set_threads(ctx, 2);
    CHECK_OK(ctx, attn_ctx_set_decode(ctx, 1)); /* the cache's own dispatch: too many rows for the decode kernel */
    kv_cache_tiles(ctx, oracle);
    decode_tiles(ctx, oracle);
  }
  attn_ctx_destroy(ctx);
  attn_ctx_destroy(oracle);
  return tu_finish(kern == ATTN_KERNEL_AMX ? "test_half amx" : "test_half avx512bf16");
}
