/* attn_rope and attn_rope_ref against the formulas of attn.h, written out again
 * here in double: every layout, partial rotary, every scaling, explicit and
 * implicit positions, strided and in-place views, half outputs, 1 and 3
 * threads, poisoned outputs; the transposed rotation (the backward) as the
 * adjoint; and the refusals, which must leave out untouched. */
#include "testutil.h"

#define PI2 6.283185307179586476925286766559

/* f_i of pair i for opts, L the largest position + 1; *m the attention factor. */
static double freq_of(const attn_rope_opts *o, int64_t r, int64_t L, int64_t i, double *m) {
  const double d = (double)r, P = (double)o->original_max_position, fac = o->factor;
  double base = o->theta;
  *m = 1;
  if (o->scaling == ATTN_ROPE_DYNAMIC) {
    const double len = (double)(o->seq_len ? o->seq_len : L);
    if (len > P) base = base * pow(fac * len / P - fac + 1, d / (d - 2));
  }
  const double f = 1.0 / pow(base, 2.0 * (double)i / d);
  switch (o->scaling) {
    case ATTN_ROPE_LINEAR: return f / fac;
    case ATTN_ROPE_LLAMA3: {
      const double wave = PI2 / f;
      if (wave < P / o->high_freq_factor) return f;
      if (wave > P / o->low_freq_factor) return f / fac;
      const double s = (P / wave - o->low_freq_factor) / (o->high_freq_factor - o->low_freq_factor);
      return (1 - s) * f / fac + s * f;
    }
    case ATTN_ROPE_YARN: {
      const double cfast = d * log(P / (o->beta_fast * PI2)) / (2 * log(base));
      const double cslow = d * log(P / (o->beta_slow * PI2)) / (2 * log(base));
      const double lo = fmax(o->yarn_truncate ? floor(cfast) : cfast, 0.0);
      double hi = fmin(o->yarn_truncate ? ceil(cslow) : cslow, d - 1);
      if (hi == lo) hi = lo + 0.001;
      const double t = fmin(fmax(((double)i - lo) / (hi - lo), 0.0), 1.0); /* 0: extrapolate, 1: interpolate */
      *m = isnan(o->attention_factor) ? (fac > 1 ? 1 + 0.1 * log(fac) : 1) : o->attention_factor;
      return f * (1 - t) + f / fac * t;
    }
    case ATTN_ROPE_LONGROPE: {
      const double len = (double)(o->seq_len ? o->seq_len : L);
      *m = isnan(o->attention_factor) ? (fac > 1 ? sqrt(1 + log(fac) / log(P)) : 1) : o->attention_factor;
      return f / (len > P ? o->long_factor[i] : o->short_factor[i]);
    }
    default: return f;
  }
}

typedef struct rcase {
  int64_t B, H, N, D;
  attn_rope_opts o;
  int explicit_pos, permuted, in_place;
  attn_dtype out_dt;
} rcase;

/* want [B, H, N, D] (contiguous) of x (contiguous doubles) */
static void reference(double *want, const double *x, const rcase *c, const int64_t *pos) {
  const int64_t r = c->o.rotary_dim ? c->o.rotary_dim : c->D;
  int64_t L = 0;
  for (int64_t e = 0; e < c->B * c->N; e++) L = pos[e] + 1 > L ? pos[e] + 1 : L;
  for (int64_t b = 0; b < c->B; b++)
    for (int64_t h = 0; h < c->H; h++)
      for (int64_t n = 0; n < c->N; n++) {
        const double *xr = x + ((b * c->H + h) * c->N + n) * c->D;
        double *wr = want + ((b * c->H + h) * c->N + n) * c->D;
        for (int64_t d = 0; d < c->D; d++) wr[d] = xr[d];
        for (int64_t i = 0; i < r / 2; i++) {
          double m;
          const double ang = (double)pos[b * c->N + n] * freq_of(&c->o, r, L, i, &m);
          const int64_t a = c->o.layout == ATTN_ROPE_HALF ? i : 2 * i, bb = c->o.layout == ATTN_ROPE_HALF ? i + r / 2 : 2 * i + 1;
          const double s = c->o.transpose ? -sin(ang) : sin(ang);
          wr[a] = m * (xr[a] * cos(ang) - xr[bb] * s);
          wr[bb] = m * (xr[bb] * cos(ang) + xr[a] * s);
        }
      }
}

static rcase random_case(tu_rng *r) {
  rcase c;
  memset(&c, 0, sizeof c);
  c.B = tu_int(r, 1, 2), c.H = tu_int(r, 1, 3), c.N = tu_int(r, 1, 40);
  const int64_t dims[] = {2, 4, 6, 16, 33, 64, 80, 128};
  c.D = dims[tu_int(r, 0, 7)];
  attn_rope_opts_init(&c.o);
  const int64_t evenD = c.D & ~(int64_t)1;
  c.o.rotary_dim = tu_int(r, 0, 2) == 0 ? 2 * tu_int(r, 1, evenD / 2) : (c.D % 2 ? evenD : 0);
  c.o.layout = (attn_rope_layout)tu_int(r, 0, 1);
  c.o.theta = tu_int(r, 0, 1) ? 10000.0 : 500000.0;
  c.o.scaling = (attn_rope_scaling)tu_int(r, 0, 5);
  c.o.factor = 1 + 7 * (tu_uniform(r) + 1) / 2;
  c.o.original_max_position = tu_int(r, 8, 64);
  c.o.seq_len = tu_int(r, 0, 2) == 0 ? tu_int(r, 1, 200) : 0;
  if (c.o.scaling == ATTN_ROPE_DYNAMIC && (c.o.rotary_dim ? c.o.rotary_dim : c.D) < 4) c.o.rotary_dim = c.D = 4;
  if (c.o.scaling == ATTN_ROPE_YARN && tu_int(r, 0, 1)) c.o.attention_factor = 1.25;
  if (c.o.scaling == ATTN_ROPE_YARN && tu_int(r, 0, 1)) c.o.yarn_truncate = 0;
  if (c.o.scaling == ATTN_ROPE_LONGROPE) {
    for (int i = 0; i < ATTN_ROPE_MAX_PAIRS; i++) {
      c.o.short_factor[i] = 1.5 + 0.5 * tu_uniform(r);
      c.o.long_factor[i] = 10 + 9 * tu_uniform(r);
    }
    if (tu_int(r, 0, 1)) c.o.attention_factor = 1.2;
    if (tu_int(r, 0, 1)) c.o.factor = 0.5; /* no growth: m = 1 */
  }
  c.o.position_offset = tu_int(r, 0, 2) ? 0 : tu_int(r, 1, 5000);
  c.o.transpose = tu_int(r, 0, 3) == 0;
  c.explicit_pos = tu_int(r, 0, 1);
  c.permuted = tu_int(r, 0, 1);
  c.in_place = tu_int(r, 0, 2) == 0;
  const attn_dtype outs[3] = {ATTN_F32, ATTN_BF16, ATTN_F16};
  c.out_dt = c.in_place ? ATTN_F32 : outs[tu_int(r, 0, 4) / 3 ? tu_int(r, 1, 2) : 0];
  return c;
}

/* A [B, H, N, D] view over physical [B, N, H, D] memory when permuted. */
static attn_tensor view(void *data, attn_dtype dt, const rcase *c) {
  const int64_t shape[4] = {c->B, c->H, c->N, c->D};
  attn_tensor t = attn_tensor_view(data, dt, 4, shape);
  if (c->permuted) {
    t.strides[0] = c->N * c->H * c->D, t.strides[1] = c->D, t.strides[2] = c->H * c->D, t.strides[3] = 1;
  }
  return t;
}

static int64_t phys(const rcase *c, int64_t b, int64_t h, int64_t n, int64_t d) {
  return c->permuted ? ((b * c->N + n) * c->H + h) * c->D + d : ((b * c->H + h) * c->N + n) * c->D + d;
}

static void run_case(attn_ctx *ctx, attn_ctx *oracle, const rcase *c, int seed) {
  tu_rng r = {(uint64_t)seed * 9973u + 1};
  const int64_t n = c->B * c->H * c->N * c->D;
  float *x = malloc(sizeof(float) * (size_t)n);
  double *xd = malloc(sizeof(double) * (size_t)n), *want = malloc(sizeof(double) * (size_t)n);
  int64_t *pos = malloc(sizeof(int64_t) * (size_t)(c->B * c->N));
  for (int64_t e = 0; e < c->B * c->N; e++)
    pos[e] = c->explicit_pos ? tu_int(&r, 0, 3) == 0 ? tu_int(&r, 0, 100000) : tu_int(&r, 0, 300) : c->o.position_offset + e % c->N;
  for (int64_t b = 0; b < c->B; b++)
    for (int64_t h = 0; h < c->H; h++)
      for (int64_t t = 0; t < c->N; t++)
        for (int64_t d = 0; d < c->D; d++) {
          const float v = (float)tu_uniform(&r);
          x[phys(c, b, h, t, d)] = v;
          xd[((b * c->H + h) * c->N + t) * c->D + d] = v;
        }
  attn_rope_opts o = c->o;
  if (c->explicit_pos) o.positions = pos;
  reference(want, xd, c, pos);
  char desc[200];
  snprintf(desc, sizeof desc, "case %d: B%lld H%lld N%lld D%lld r%lld layout %d scaling %d transpose %d permuted %d "
                              "in place %d out %s", seed, (long long)c->B, (long long)c->H, (long long)c->N,
           (long long)c->D, (long long)o.rotary_dim, (int)o.layout, (int)o.scaling, o.transpose, c->permuted,
           c->in_place, attn_dtype_name(c->out_dt));
  /* the oracle, in f64 */
  double *od = malloc(sizeof(double) * (size_t)n);
  for (int64_t e = 0; e < n; e++) od[e] = NAN;
  attn_tensor tx = view(x, ATTN_F32, c), tod = view(od, ATTN_F64, c);
  CHECK_OK(oracle, attn_rope_ref(oracle, &tod, &tx, &o));
  double *got = tu_to_f64(&tod);
  double e = tu_rel_l2(got, want, n);
  CHECK(e <= 1e-10 && !tu_count_nan(got, n), "%s: oracle rel L2 %.3g", desc, e); /* angles up to 1e5 rad */
  free(got);
  /* the kernel */
  const size_t es = attn_dtype_size(c->out_dt);
  void *outb = c->in_place ? (void *)x : malloc(es * (size_t)n);
  if (!c->in_place) memset(outb, 0xff, es * (size_t)n); /* NaN in every dtype */
  attn_tensor tout = view(outb, c->out_dt, c);
  const attn_status st = attn_rope(ctx, &tout, &tx, &o);
  CHECK(st == ATTN_OK, "%s: %s", desc, attn_ctx_error(ctx));
  if (st == ATTN_OK) {
    got = malloc(sizeof(double) * (size_t)n);
    for (int64_t b = 0; b < c->B; b++)
      for (int64_t h = 0; h < c->H; h++)
        for (int64_t t = 0; t < c->N; t++)
          for (int64_t d = 0; d < c->D; d++) {
            const int64_t p = phys(c, b, h, t, d);
            got[((b * c->H + h) * c->N + t) * c->D + d] =
                c->out_dt == ATTN_F32 ? ((float *)outb)[p]
                : c->out_dt == ATTN_BF16 ? tu_bf16_to_f32(((uint16_t *)outb)[p]) : tu_f16_to_f32(((uint16_t *)outb)[p]);
          }
    e = tu_rel_l2(got, want, n);
    const double tol = c->out_dt == ATTN_F32 ? 1e-6 : c->out_dt == ATTN_F16 ? 1e-3 : 8e-3; /* the output's rounding */
    CHECK(e <= tol && !tu_count_nan(got, n), "%s: rel L2 %.3g", desc, e);
    free(got);
  }
  if (!c->in_place) free(outb);
  free(x), free(xd), free(want), free(pos), free(od);
}

/* <rope(x), y> = <x, rope^T(y)>: the transposed rotation is the backward of the rotation. */
static void adjoint(attn_ctx *ctx, tu_rng *r) {
  for (int k = 0; k < 20; k++) {
    rcase c = random_case(r);
    c.permuted = 0;
    c.o.transpose = 0;
    const int64_t n = c.B * c.H * c.N * c.D, s4[4] = {c.B, c.H, c.N, c.D};
    float *x = malloc(sizeof(float) * (size_t)n), *y = malloc(sizeof(float) * (size_t)n);
    float *rx = malloc(sizeof(float) * (size_t)n), *ry = malloc(sizeof(float) * (size_t)n);
    tu_fill_f32(r, x, n, 1), tu_fill_f32(r, y, n, 1);
    attn_tensor tx = attn_tensor_view(x, ATTN_F32, 4, s4), ty = attn_tensor_view(y, ATTN_F32, 4, s4);
    attn_tensor trx = attn_tensor_view(rx, ATTN_F32, 4, s4), try_ = attn_tensor_view(ry, ATTN_F32, 4, s4);
    attn_rope_opts o = c.o;
    CHECK_OK(ctx, attn_rope(ctx, &trx, &tx, &o));
    o.transpose = 1;
    CHECK_OK(ctx, attn_rope(ctx, &try_, &ty, &o));
    double a = 0, b = 0, scale = 0;
    for (int64_t e = 0; e < n; e++) {
      a += (double)rx[e] * y[e];
      b += (double)x[e] * ry[e];
      scale += fabs((double)rx[e] * y[e]);
    }
    CHECK(fabs(a - b) <= 1e-5 * scale, "adjoint %d (scaling %d, layout %d): <Rx, y> = %.9g, <x, R^T y> = %.9g", k,
          (int)o.scaling, (int)o.layout, a, b);
    free(x), free(y), free(rx), free(ry);
  }
}

/* Refusals: a clear status, and out untouched. */
static void errors(attn_ctx *ctx) {
  float x[2 * 3 * 4], out[2 * 3 * 4];
  const int64_t s4[4] = {1, 2, 3, 4};
  for (int i = 0; i < 24; i++) x[i] = (float)i, out[i] = -7.0f;
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 4, s4), to = attn_tensor_view(out, ATTN_F32, 4, s4);
  attn_rope_opts o;
#define REFUSED(what, want, needle)                                                            \
  do {                                                                                         \
    CHECK_ERR(ctx, attn_rope(ctx, &to, &tx, &o), want, needle);                                \
    int kept = 1;                                                                              \
    for (int i = 0; i < 24; i++) kept &= out[i] == -7.0f;                                      \
    CHECK(kept, "%s: out was written by a refused call", what);                                \
  } while (0)
  attn_rope_opts_init(&o); o.rotary_dim = 3; REFUSED("odd rotary_dim", ATTN_E_INVALID, "rotary_dim");
  attn_rope_opts_init(&o); o.rotary_dim = 6; REFUSED("rotary_dim > D", ATTN_E_INVALID, "rotary_dim");
  attn_rope_opts_init(&o); o.theta = 1.0; REFUSED("theta 1", ATTN_E_INVALID, "theta");
  attn_rope_opts_init(&o); o.theta = NAN; REFUSED("theta NaN", ATTN_E_INVALID, "theta");
  attn_rope_opts_init(&o); o.scaling = ATTN_ROPE_LINEAR; o.factor = 0; REFUSED("factor 0", ATTN_E_INVALID, "factor");
  attn_rope_opts_init(&o); o.scaling = ATTN_ROPE_YARN; REFUSED("yarn without P", ATTN_E_INVALID, "original_max_position");
  attn_rope_opts_init(&o); o.scaling = ATTN_ROPE_LLAMA3; o.original_max_position = 8; o.high_freq_factor = 0.5;
  REFUSED("llama3 factors", ATTN_E_INVALID, "low_freq_factor");
  attn_rope_opts_init(&o); o.scaling = (attn_rope_scaling)9; REFUSED("unknown scaling", ATTN_E_INVALID, "scaling");
  attn_rope_opts_init(&o); o.scaling = ATTN_ROPE_LONGROPE; o.original_max_position = 8;
  REFUSED("longrope without factors", ATTN_E_INVALID, "short_factor and long_factor");
  o.short_factor[0] = o.long_factor[0] = 1;
  o.short_factor[1] = 2, o.long_factor[1] = INFINITY;
  REFUSED("longrope with an infinite factor", ATTN_E_INVALID, "pair 1");
  o.long_factor[1] = 3, o.original_max_position = 1;
  REFUSED("longrope with P = 1", ATTN_E_INVALID, "original_max_position > 1");
  attn_rope_opts_init(&o); o.layout = (attn_rope_layout)5; REFUSED("unknown layout", ATTN_E_INVALID, "layout");
  int64_t pos[3] = {0, -1, 2};
  attn_rope_opts_init(&o); o.positions = pos; REFUSED("negative position", ATTN_E_INVALID, "position");
  attn_rope_opts_init(&o); o.position_offset = -5; REFUSED("negative offset", ATTN_E_INVALID, "position");
  attn_rope_opts_init(&o);
  attn_tensor shifted = attn_tensor_view(x + 1, ATTN_F32, 4, s4);
  CHECK_ERR(ctx, attn_rope(ctx, &shifted, &tx, &o), ATTN_E_INVALID, "overlaps");
  const int64_t s4b[4] = {1, 2, 3, 2};
  attn_tensor small = attn_tensor_view(out, ATTN_F32, 4, s4b);
  CHECK_ERR(ctx, attn_rope(ctx, &small, &tx, &o), ATTN_E_SHAPE, "shape");
  double xd[24];
  attn_tensor t64 = attn_tensor_view(xd, ATTN_F64, 4, s4);
  CHECK_ERR(ctx, attn_rope(ctx, &to, &t64, &o), ATTN_E_DTYPE, "f32, f16 or bf16");
  attn_rope_opts old;
  attn_rope_opts_init(&old);
  old.size = 7; /* not a size any version had */
  CHECK_ERR(ctx, attn_rope(ctx, &to, &tx, &old), ATTN_E_INVALID, "attn_rope_opts_init");
  /* in place is allowed, and position 0 is the identity */
  attn_rope_opts_init(&o);
  o.positions = (const int64_t[3]){0, 0, 0};
  float y[24];
  memcpy(y, x, sizeof y);
  attn_tensor ty = attn_tensor_view(y, ATTN_F32, 4, s4);
  CHECK_OK(ctx, attn_rope(ctx, &ty, &ty, &o));
  CHECK(!memcmp(x, y, sizeof y), "position 0 is not the identity");
#undef REFUSED
}

/* The KV cache with RoPE: keys rotated on append, queries on attend, against
 * the oracle on the whole sequence of each row rotated at positions 0..len-1. */
static void kv_cache(attn_ctx *ctx, attn_ctx *oracle, attn_dtype storage) {
  enum { B = 3, Hk = 2, Hq = 4, D = 16, T = 40 };
  tu_rng r = {99};
  float *K = malloc(sizeof(float) * B * Hk * T * D), *V = malloc(sizeof(float) * B * Hk * T * D);
  float *Q = malloc(sizeof(float) * B * Hq * T * D);
  tu_fill_f32(&r, K, B * Hk * T * D, 1), tu_fill_f32(&r, V, B * Hk * T * D, 1), tu_fill_f32(&r, Q, B * Hq * T * D, 1);
  for (int64_t e = 0; e < B * Hk * T * D; e++) K[e] = tu_round_through(K[e], storage), V[e] = tu_round_through(V[e], storage);
  attn_rope_opts ro;
  attn_rope_opts_init(&ro);
  ro.rotary_dim = 8, ro.scaling = ATTN_ROPE_LLAMA3, ro.factor = 4, ro.original_max_position = 16, ro.theta = 50000;
  attn_kv_cache_config kc;
  attn_kv_cache_config_init(&kc, B, T, Hk, D);
  kc.dtype = storage;
  kc.rope = &ro;
  attn_kv_cache *cache = NULL;
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &kc));
  if (!cache) return;
  CHECK(attn_kv_cache_get_config(cache)->rope && attn_kv_cache_get_config(cache)->rope->factor == 4, "the cache's rope");
  const int64_t first[B] = {5, 1, 12}; /* a prefill of each row's own length, then steps of n tokens for all */
  int64_t len[B] = {0, 0, 0};
  double worst = 0;
  for (int step = 0; step < 8; step++) {
    const int64_t n = step == 0 ? 12 : 1 + step % 3, Nq = n;
    int64_t nn[B];
    for (int b = 0; b < B; b++) nn[b] = step == 0 ? first[b] : n;
    /* the new tokens of each row, [B, Hk, n, D] (rows past their count: zeros, unused) */
    float *kn = calloc((size_t)(B * Hk * n * D), sizeof(float)), *vn = calloc((size_t)(B * Hk * n * D), sizeof(float));
    for (int b = 0; b < B; b++)
      for (int g = 0; g < Hk; g++)
        for (int64_t i = 0; i < nn[b]; i++)
          for (int d = 0; d < D; d++) {
            kn[((b * Hk + g) * n + i) * D + d] = K[((b * Hk + g) * T + len[b] + i) * D + d];
            vn[((b * Hk + g) * n + i) * D + d] = V[((b * Hk + g) * T + len[b] + i) * D + d];
          }
    const int64_t s4n[4] = {B, Hk, n, D};
    attn_tensor tk = attn_tensor_view(kn, ATTN_F32, 4, s4n), tv = attn_tensor_view(vn, ATTN_F32, 4, s4n);
    CHECK_OK(ctx, attn_kv_cache_append(ctx, cache, &tk, &tv, nn));
    for (int b = 0; b < B; b++) len[b] += nn[b];
    /* queries: the last Nq tokens of each row */
    float *qn = calloc((size_t)(B * Hq * Nq * D), sizeof(float)), *out = malloc(sizeof(float) * B * Hq * Nq * D);
    for (int b = 0; b < B; b++)
      for (int h = 0; h < Hq; h++)
        for (int64_t i = 0; i < Nq; i++)
          for (int d = 0; d < D && len[b] - Nq + i >= 0; d++)
            qn[((b * Hq + h) * Nq + i) * D + d] = Q[((b * Hq + h) * T + len[b] - Nq + i) * D + d];
    tu_poison_f32(out, B * Hq * Nq * D);
    const int64_t s4q[4] = {B, Hq, Nq, D};
    attn_tensor tq = attn_tensor_view(qn, ATTN_F32, 4, s4q), to = attn_tensor_view(out, ATTN_F32, 4, s4q);
    CHECK_OK(ctx, attn_kv_cache_attend(ctx, cache, &to, NULL, &tq, NULL));
    for (int b = 0; b < B; b++) {
      if (len[b] < Nq) continue; /* rows without Nq tokens: queries before position 0 */
      /* the oracle: row b's whole sequence so far, rotated at 0..len-1, queries at theirs */
      const int64_t L = len[b], sk[4] = {1, Hk, L, D}, sq[4] = {1, Hq, Nq, D};
      double *kr = malloc(sizeof(double) * Hk * L * D), *qr = malloc(sizeof(double) * Hq * Nq * D);
      double *want = malloc(sizeof(double) * Hq * Nq * D);
      attn_tensor kin = attn_tensor_view(K + (size_t)b * Hk * T * D, ATTN_F32, 4, sk);
      kin.strides[1] = T * D; /* [1, Hk, L, D] of the [Hk, T, D] block */
      attn_tensor vin = kin;
      vin.data = V + (size_t)b * Hk * T * D;
      attn_tensor qin = attn_tensor_view(Q + ((size_t)b * Hq * T + (size_t)(L - Nq)) * D, ATTN_F32, 4, sq);
      qin.strides[1] = T * D;
      attn_tensor tkr = attn_tensor_view(kr, ATTN_F64, 4, sk), tqr = attn_tensor_view(qr, ATTN_F64, 4, sq);
      attn_tensor tw = attn_tensor_view(want, ATTN_F64, 4, sq);
      attn_rope_opts o = ro;
      CHECK_OK(oracle, attn_rope_ref(oracle, &tkr, &kin, &o));
      o.position_offset = L - Nq;
      CHECK_OK(oracle, attn_rope_ref(oracle, &tqr, &qin, &o));
      attn_sdpa_opts so;
      attn_sdpa_opts_init(&so);
      so.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
      CHECK_OK(oracle, attn_sdpa_ref(oracle, &tw, NULL, NULL, &tqr, &tkr, &vin, &so));
      double num = 0, den = 0;
      for (int64_t e = 0; e < Hq * Nq * D; e++) {
        const double gv = out[(size_t)b * Hq * Nq * D + e];
        num += (gv - want[e]) * (gv - want[e]), den += want[e] * want[e];
      }
      const double err = sqrt(num / den);
      worst = err > worst ? err : worst;
      free(kr), free(qr), free(want);
    }
    free(kn), free(vn), free(qn), free(out);
  }
  /* bf16 storage rounds the rotated keys */
  CHECK(worst <= (storage == ATTN_F32 ? 1e-5 : 3e-3), "kv cache with rope, %s storage: rel L2 %.3g",
        attn_dtype_name(storage), worst);
  printf("kv cache with rope, %s storage: worst rel L2 %.3g\n", attn_dtype_name(storage), worst);
  /* refusals */
  attn_rope_opts bad = ro;
  bad.position_offset = 3;
  kc.rope = &bad;
  attn_kv_cache *none = NULL;
  CHECK_ERR(ctx, attn_kv_cache_create(ctx, &none, &kc), ATTN_E_INVALID, "position_offset");
  bad = ro;
  bad.rotary_dim = 18;
  CHECK_ERR(ctx, attn_kv_cache_create(ctx, &none, &kc), ATTN_E_INVALID, "rotary_dim");
  attn_kv_cache_destroy(cache);
  free(K), free(V), free(Q);
}

/* The layer with RoPE: fp32 against the float64 layer (ATTN_KERNEL_REF) and
 * against its composition by hand (attn_linear, attn_rope_ref, attn_sdpa_ref);
 * the input gradient against central differences of the float64 layer. */
static void layer(attn_ctx *ctx, attn_ctx *oracle) {
  enum { B = 2, N = 9, E = 32, H = 4, G = 2, D = E / H };
  tu_rng r = {4321};
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, E, H);
  cfg.num_kv_heads = G;
  attn_mha *m = NULL;
  CHECK_OK(ctx, attn_mha_create(ctx, &m, &cfg));
  if (!m) return;
  for (int pidx = 0; pidx < TU_MHA_PROJ_PARAMS; pidx++) {
    attn_tensor pv;
    CHECK_OK(ctx, attn_mha_param_view(ctx, &pv, m, (attn_mha_param)pidx));
    tu_fill_f32(&r, pv.data, attn_tensor_numel(&pv), 0.4);
  }
  float x[B * N * E], out[B * N * E];
  double ref[B * N * E];
  tu_fill_f32(&r, x, B * N * E, 1);
  const int64_t s3[3] = {B, N, E};
  int64_t pos[B * N];
  for (int b = 0; b < B; b++)
    for (int n = 0; n < N; n++) pos[b * N + n] = b ? 3 + 2 * n : n; /* row 1: gaps, as a packed batch may have */
  attn_rope_opts ro;
  attn_rope_opts_init(&ro);
  ro.rotary_dim = 4, ro.scaling = ATTN_ROPE_YARN, ro.factor = 2, ro.original_max_position = 8, ro.positions = pos;
  attn_mha_opts mo;
  attn_mha_opts_init(&mo);
  mo.attn.causal = ATTN_CAUSAL_TOP_LEFT;
  mo.rope = &ro;
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 3, s3), to = attn_tensor_view(out, ATTN_F32, 3, s3);
  attn_tensor tr = attn_tensor_view(ref, ATTN_F64, 3, s3);
  tu_poison_f32(out, B * N * E);
  CHECK_OK(ctx, attn_mha_forward(ctx, m, &to, NULL, &tx, NULL, NULL, &mo));
  CHECK_OK(oracle, attn_ctx_set_kernel(oracle, ATTN_KERNEL_REF));
  CHECK_OK(oracle, attn_mha_forward(oracle, m, &tr, NULL, &tx, NULL, NULL, &mo));
  double num = 0, den = 0;
  for (int e = 0; e < B * N * E; e++) num += (out[e] - ref[e]) * (out[e] - ref[e]), den += ref[e] * ref[e];
  CHECK(sqrt(num / den) <= 1e-5, "layer with rope: fp32 against the float64 layer %.3g", sqrt(num / den));
  /* by hand: q = x Wq^T + bq, k alike, rotated, then attention, then the out projection */
  attn_tensor W[TU_MHA_PROJ_PARAMS];
  for (int i = 0; i < TU_MHA_PROJ_PARAMS; i++) CHECK_OK(ctx, attn_mha_param_view(ctx, &W[i], m, (attn_mha_param)i));
  const int64_t s2x[2] = {B * N, E}, s2k[2] = {B * N, G * D};
  float q[B * N * E], k[B * N * G * D], v[B * N * G * D], a[B * N * E], y[B * N * E];
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 2, s2x), tk = attn_tensor_view(k, ATTN_F32, 2, s2k);
  attn_tensor tv = attn_tensor_view(v, ATTN_F32, 2, s2k), x2 = attn_tensor_view(x, ATTN_F32, 2, s2x);
  CHECK_OK(ctx, attn_linear(ctx, &tq, &x2, &W[ATTN_MHA_Q_WEIGHT], &W[ATTN_MHA_Q_BIAS]));
  CHECK_OK(ctx, attn_linear(ctx, &tk, &x2, &W[ATTN_MHA_K_WEIGHT], &W[ATTN_MHA_K_BIAS]));
  CHECK_OK(ctx, attn_linear(ctx, &tv, &x2, &W[ATTN_MHA_V_WEIGHT], &W[ATTN_MHA_V_BIAS]));
  const int64_t s4q[4] = {B, H, N, D}, s4k[4] = {B, G, N, D};
  attn_tensor qh = attn_tensor_view(q, ATTN_F32, 4, s4q), kh = attn_tensor_view(k, ATTN_F32, 4, s4k);
  attn_tensor vh = attn_tensor_view(v, ATTN_F32, 4, s4k);
  qh.strides[0] = N * E, qh.strides[1] = D, qh.strides[2] = E; /* [B, N, H, D] rows as heads */
  kh.strides[0] = vh.strides[0] = N * G * D, kh.strides[1] = vh.strides[1] = D, kh.strides[2] = vh.strides[2] = G * D;
  double qr[B * H * N * D], kr[B * G * N * D];
  attn_tensor tqr = attn_tensor_view(qr, ATTN_F64, 4, s4q), tkr = attn_tensor_view(kr, ATTN_F64, 4, s4k);
  CHECK_OK(oracle, attn_rope_ref(oracle, &tqr, &qh, &ro));
  CHECK_OK(oracle, attn_rope_ref(oracle, &tkr, &kh, &ro));
  double ad[B * H * N * D];
  attn_tensor tad = attn_tensor_view(ad, ATTN_F64, 4, s4q);
  CHECK_OK(oracle, attn_sdpa_ref(oracle, &tad, NULL, NULL, &tqr, &tkr, &vh, &mo.attn));
  for (int b = 0; b < B; b++) /* heads back to rows, f32 */
    for (int h = 0; h < H; h++)
      for (int n = 0; n < N; n++)
        for (int d = 0; d < D; d++) a[(b * N + n) * E + h * D + d] = (float)ad[((b * H + h) * N + n) * D + d];
  attn_tensor ta = attn_tensor_view(a, ATTN_F32, 2, s2x), ty = attn_tensor_view(y, ATTN_F32, 2, s2x);
  CHECK_OK(ctx, attn_linear(ctx, &ty, &ta, &W[ATTN_MHA_O_WEIGHT], &W[ATTN_MHA_O_BIAS]));
  num = den = 0;
  for (int e = 0; e < B * N * E; e++) num += (out[e] - y[e]) * (out[e] - y[e]), den += (double)y[e] * y[e];
  CHECK(sqrt(num / den) <= 1e-5, "layer with rope: against its composition by hand %.3g", sqrt(num / den));
  /* the input gradient against central differences of the float64 layer, for L = sum(g * out) */
  float g[B * N * E], dx[B * N * E];
  tu_fill_f32(&r, g, B * N * E, 1);
  attn_tensor tg = attn_tensor_view(g, ATTN_F32, 3, s3), tdx = attn_tensor_view(dx, ATTN_F32, 3, s3);
  attn_mha_saved *sv = NULL;
  CHECK_OK(ctx, attn_mha_forward_save(ctx, m, &to, NULL, &sv, &tx, NULL, NULL, &mo));
  for (int i = 0; i < B * N; i++) pos[i] = -1; /* the saved state keeps its own copy of the positions */
  CHECK_OK(ctx, attn_mha_backward(ctx, m, &tdx, NULL, NULL, NULL, sv, &tg));
  for (int b = 0; b < B; b++)
    for (int n = 0; n < N; n++) pos[b * N + n] = b ? 3 + 2 * n : n;
  attn_mha_saved_free(sv);
  double worst = 0, scale = 0;
  for (int t = 0; t < 24; t++) {
    const int e = (int)tu_int(&r, 0, B * N * E - 1);
    const float keep = x[e];
    double lp = 0, lm = 0;
    x[e] = keep + 1e-3f;
    CHECK_OK(oracle, attn_mha_forward(oracle, m, &tr, NULL, &tx, NULL, NULL, &mo));
    for (int i = 0; i < B * N * E; i++) lp += g[i] * ref[i];
    x[e] = keep - 1e-3f;
    CHECK_OK(oracle, attn_mha_forward(oracle, m, &tr, NULL, &tx, NULL, NULL, &mo));
    for (int i = 0; i < B * N * E; i++) lm += g[i] * ref[i];
    x[e] = keep;
    const double fd = (lp - lm) / (double)((keep + 1e-3f) - (keep - 1e-3f));
    worst = fmax(worst, fabs(fd - dx[e]));
    scale = fmax(scale, fabs(fd));
  }
  CHECK(worst <= 1e-3 * fmax(scale, 1e-3), "layer with rope: dquery against central differences, worst %.3g (scale %.3g)",
        worst, scale);
  /* refusals: explicit positions with Nk != Nq; transpose; the cached step */
  float kin[B * 5 * E];
  tu_fill_f32(&r, kin, B * 5 * E, 1);
  const int64_t s3k[3] = {B, 5, E};
  attn_tensor tkin = attn_tensor_view(kin, ATTN_F32, 3, s3k);
  CHECK_ERR(ctx, attn_mha_forward(ctx, m, &to, NULL, &tx, &tkin, &tkin, &mo), ATTN_E_INVALID, "positions");
  ro.positions = NULL; /* keys then at offset + j: accepted */
  CHECK_OK(ctx, attn_mha_forward(ctx, m, &to, NULL, &tx, &tkin, &tkin, &mo));
  ro.transpose = 1;
  CHECK_ERR(ctx, attn_mha_forward(ctx, m, &to, NULL, &tx, NULL, NULL, &mo), ATTN_E_INVALID, "transpose");
  attn_mha_destroy(m);
  attn_ctx_set_kernel(oracle, ATTN_KERNEL_AUTO);
}

int main(void) {
  attn_ctx *ctx, *oracle;
  attn_ctx_create(&ctx);
  attn_ctx_create(&oracle);
  tu_rng r = {515};
  for (int seed = 0; seed < 300; seed++) {
    const rcase c = random_case(&r);
    attn_ctx_set_threads(ctx, seed % 2 ? 3 : 1);
    run_case(ctx, oracle, &c, seed);
  }
  adjoint(ctx, &r);
  errors(ctx);
  kv_cache(ctx, oracle, ATTN_F32);
  kv_cache(ctx, oracle, ATTN_BF16);
  layer(ctx, oracle);
  attn_ctx_destroy(ctx);
  attn_ctx_destroy(oracle);
  return tu_finish("test_rope");
}
