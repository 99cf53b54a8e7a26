/* The layer's backward pass (attn_mha_forward_save, attn_mha_backward):
 *   (a) the float64 path (ATTN_KERNEL_REF) against central finite differences
 *       (a fourth-order stencil) of L = sum(out * G), for sampled entries of
 *       every parameter and input: self- and cross-attention, kdim/vdim != E,
 *       grouped-query and multi-query heads, bias on and off, bool and additive
 *       masks, key padding (a fully padded batch too), both causal modes,
 *       dropout with a fixed seed, strided inputs;
 *   (b) the fp32 path of every kernel this CPU runs against the float64 path,
 *       for 1, 2 and 3 threads, bitwise the same whatever the thread count;
 *       plus what must agree: forward_save's out with attn_mha_forward's,
 *       a second backward on the same saved state, partial requests, key and
 *       value given as one tensor, empty sequences;
 *   (c) the argument checks.
 * Run with the working directory tests/ (OMP_WAIT_POLICY=passive). Seeds are fixed. */
#include "testutil.h"

#define TOL_FD 1e-6
#define TOL_FP32 1e-5
#define FD_STEP (1.0 / 4096) /* parameters sit on a grid of 2^-12: p + k h is exact in float */
#define FD_SAMPLES 24
/* Gradients smaller than this (in L2 over the samples) are compared absolutely: a layer
 * whose every key is padded has zero gradients, and finite differences give rounding noise. */
#define FD_FLOOR 1e-3

/* ---- a problem: a layer, its inputs, options and the loss weights G ------------ */
typedef struct spec {
  const char *name;
  int64_t E, H, Hk, kdim, vdim; /* Hk, kdim, vdim 0: the defaults */
  int bias, cross;
  int64_t B, Nq, Nk; /* Nk: cross-attention only */
  attn_causal causal;
  int mask;    /* 0 none; 1 bool [Nq, Nk], true = masked out; 2 additive f32 [1, H, Nq, Nk] with some -inf */
  int kpm;     /* 0 none; 1 random key padding; 2 the last batch entirely padded as well */
  double dropout;
  int strided; /* inputs, dout and the input gradients in seq-first [N, B, F] buffers */
  int options; /* bits: 1 window 3, 2 softcap 2, 4 ALiBi (the paper's slopes x 4), 8 sinks (constants in
                  the options), 16 the layer's learned sinks (a parameter, differentiated) */
} spec;

typedef struct prob {
  spec s;
  attn_mha *m;
  int64_t E, kd, vd, Nk;
  attn_dtype dt; /* of the inputs and G: f64 for finite differences, f32 against the fp32 path */
  void *xq, *xk, *xv, *g;
  attn_tensor tq, tk, tv, tg; /* [B, N, F] views */
  uint8_t *mb;
  float *ma;
  uint8_t *kp;
  attn_tensor tmask, tkp;
  float slopes[16], sinks[16]; /* H <= 16 */
  attn_tensor tslopes, tsinks;
  attn_mha_opts o;
} prob;

/* A [B, N, F] view of data, batch-first or (strided) of a seq-first [N, B, F] buffer. */
static attn_tensor rows_view(void *data, attn_dtype dt, int64_t B, int64_t N, int64_t F, int strided) {
  int64_t s[3] = {B, N, F};
  attn_tensor t = attn_tensor_view(data, dt, 3, s);
  if (strided) {
    t.strides[0] = F;
    t.strides[1] = B * F;
  }
  return t;
}

static void *fill(tu_rng *r, attn_dtype dt, int64_t n, double amp) {
  void *p = calloc((size_t)(n > 0 ? n : 1), attn_dtype_size(dt));
  for (int64_t i = 0; i < n; i++) {
    if (dt == ATTN_F64) ((double *)p)[i] = amp * tu_uniform(r);
    else ((float *)p)[i] = (float)(amp * tu_uniform(r));
  }
  return p;
}

static void prob_init(attn_ctx *ctx, prob *P, const spec *s, attn_dtype dt, uint64_t seed) {
  memset(P, 0, sizeof *P);
  P->s = *s;
  P->dt = dt;
  tu_rng r = {seed};
  attn_mha_config c;
  attn_mha_config_init(&c, s->E, s->H);
  c.num_kv_heads = s->Hk;
  c.kdim = s->kdim;
  c.vdim = s->vdim;
  c.bias = s->bias;
  c.sinks = (s->options & 16) != 0;
  CHECK_OK(ctx, attn_mha_create(ctx, &P->m, &c));
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, P->m, (attn_mha_param)p)) continue;
    float *w = t.data;
    const double grid = p == ATTN_MHA_SINKS ? 1024 : 4096; /* sinks in [-2, 2]: logits' size */
    for (int64_t i = 0; i < attn_tensor_numel(&t); i++) w[i] = (float)(round(tu_uniform(&r) * 2048) / grid);
  }
  const int64_t E = P->E = s->E, B = s->B, Nq = s->Nq;
  const int64_t kd = P->kd = s->kdim ? s->kdim : E, vd = P->vd = s->vdim ? s->vdim : E;
  const int64_t Nk = P->Nk = s->cross ? s->Nk : Nq;
  P->xq = fill(&r, dt, B * Nq * E, 1);
  P->tq = rows_view(P->xq, dt, B, Nq, E, s->strided);
  if (s->cross) {
    P->xk = fill(&r, dt, B * Nk * kd, 1);
    P->xv = fill(&r, dt, B * Nk * vd, 1);
    P->tk = rows_view(P->xk, dt, B, Nk, kd, s->strided);
    P->tv = rows_view(P->xv, dt, B, Nk, vd, s->strided);
  }
  P->g = fill(&r, dt, B * Nq * E, 1);
  P->tg = rows_view(P->g, dt, B, Nq, E, s->strided);
  attn_mha_opts_init(&P->o);
  P->o.attn.causal = s->causal;
  P->o.attn.dropout_p = s->dropout;
  P->o.attn.dropout_seed = seed * 7919 + 1;
  if (s->mask == 1) {
    int64_t ms[2] = {Nq, Nk};
    P->mb = malloc((size_t)(Nq * Nk + 1));
    for (int64_t i = 0; i < Nq * Nk; i++) P->mb[i] = tu_int(&r, 0, 4) == 0;
    P->tmask = attn_tensor_view(P->mb, ATTN_BOOL, 2, ms);
    P->o.attn.mask = &P->tmask;
  } else if (s->mask == 2) {
    int64_t ms[4] = {1, s->H, Nq, Nk};
    P->ma = malloc(sizeof(float) * (size_t)(s->H * Nq * Nk + 1));
    for (int64_t i = 0; i < s->H * Nq * Nk; i++) P->ma[i] = tu_int(&r, 0, 5) == 0 ? -INFINITY : (float)tu_uniform(&r);
    P->tmask = attn_tensor_view(P->ma, ATTN_F32, 4, ms);
    P->o.attn.mask = &P->tmask;
    P->o.attn.mask_mode = ATTN_MASK_ADDITIVE;
  }
  if (s->kpm) {
    int64_t ks[2] = {B, Nk};
    P->kp = malloc((size_t)(B * Nk + 1));
    for (int64_t i = 0; i < B * Nk; i++) P->kp[i] = tu_int(&r, 0, 4) == 0;
    if (s->kpm == 2)
      for (int64_t j = 0; j < Nk; j++) P->kp[(B - 1) * Nk + j] = 1;
    P->tkp = attn_tensor_view(P->kp, ATTN_BOOL, 2, ks);
    P->o.attn.key_padding = &P->tkp;
  }
  const int64_t hs[1] = {s->H};
  if (s->options & 1) P->o.attn.window = 3;
  if (s->options & 2) P->o.attn.softcap = 2.0;
  if (s->options & 4) {
    attn_alibi_slopes(P->slopes, s->H);
    for (int64_t h = 0; h < s->H; h++) P->slopes[h] *= 4; /* short rows: a bias that matters */
    P->tslopes = attn_tensor_view(P->slopes, ATTN_F32, 1, hs);
    P->o.attn.alibi_slopes = &P->tslopes;
  }
  if (s->options & 8) {
    for (int64_t h = 0; h < s->H; h++) P->sinks[h] = (float)(round(tu_uniform(&r) * 2048) / 2048);
    P->tsinks = attn_tensor_view(P->sinks, ATTN_F32, 1, hs);
    P->o.attn.sinks = &P->tsinks;
  }
}

static void prob_free(prob *P) {
  attn_mha_destroy(P->m);
  free(P->xq); free(P->xk); free(P->xv); free(P->g); free(P->mb); free(P->ma); free(P->kp);
}

static const attn_tensor *key_of(const prob *P) { return P->s.cross ? &P->tk : NULL; }
static const attn_tensor *value_of(const prob *P) { return P->s.cross ? &P->tv : NULL; }

/* A layer of P's configuration for the gradients, filled with NaN (so an entry never written shows). */
static attn_mha *grads_layer(attn_ctx *ctx, const prob *P) {
  attn_mha *g = NULL;
  CHECK_OK(ctx, attn_mha_create(ctx, &g, attn_mha_get_config(P->m)));
  for (int p = 0; g && p < ATTN_MHA_NUM_PARAMS; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, g, (attn_mha_param)p) == ATTN_OK) tu_poison_f32(t.data, attn_tensor_numel(&t));
  }
  return g;
}

/* ---- (a) the float64 path against finite differences ----------------------------- */
static double loss(attn_ctx *ctx, prob *P, double *out) {
  const int64_t n = P->s.B * P->s.Nq * P->E;
  int64_t so[3] = {P->s.B, P->s.Nq, P->E};
  attn_tensor to = attn_tensor_view(out, ATTN_F64, 3, so);
  CHECK_OK(ctx, attn_mha_forward(ctx, P->m, &to, NULL, &P->tq, key_of(P), value_of(P), &P->o));
  double *g = tu_to_f64(&P->tg), L = 0;
  for (int64_t i = 0; i < n; i++) L += out[i] * g[i];
  free(g);
  return L;
}

/* dL/dx at element off of a float or double buffer (a fourth-order central difference). */
static double fd_at(attn_ctx *ctx, prob *P, void *buf, attn_dtype dt, int64_t off, double *scratch) {
  const double x0 = dt == ATTN_F64 ? ((double *)buf)[off] : ((float *)buf)[off];
  static const double at[4] = {-2, -1, 1, 2};
  double f[4];
  for (int k = 0; k < 4; k++) {
    const double x = x0 + at[k] * FD_STEP;
    if (dt == ATTN_F64) ((double *)buf)[off] = x;
    else ((float *)buf)[off] = (float)x;
    f[k] = loss(ctx, P, scratch);
  }
  if (dt == ATTN_F64) ((double *)buf)[off] = x0;
  else ((float *)buf)[off] = (float)x0;
  return (f[0] - 8 * f[1] + 8 * f[2] - f[3]) / (12 * FD_STEP);
}

/* Compares the analytic gradient (grad, a tensor shaped like t) with finite differences
 * at sampled elements of t, a tensor of rank <= 3 (walked through its strides). */
static double worst_fd = 0;

/* ||a - b|| / max(||b||, floor): floor > 0 where the true gradient is zero (the key bias:
 * adding a constant to every key moves every logit of a row alike, and softmax ignores it). */
static double rel_err(const double *a, const double *b, int64_t n, double floor) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  den = sqrt(den);
  if (den < floor) den = floor;
  return den > 0 ? sqrt(num) / den : sqrt(num);
}

static double norm_of(const attn_tensor *t) {
  double s = 0;
  for (int64_t i = 0; i < attn_tensor_numel(t); i++) s += (double)((const float *)t->data)[i] * ((const float *)t->data)[i];
  return sqrt(s);
}

static void fd_compare(attn_ctx *ctx, prob *P, const attn_tensor *t, const attn_tensor *grad, const char *what,
                       tu_rng *r, double *scratch, double floor) {
  const int64_t n = attn_tensor_numel(t);
  if (n == 0) return;
  double an[FD_SAMPLES], fd[FD_SAMPLES];
  const int ns = n < FD_SAMPLES ? (int)n : FD_SAMPLES;
  for (int s = 0; s < ns; s++) {
    const int64_t e = ns == n ? s : tu_int(r, 0, n - 1);
    int64_t idx[3] = {0, 0, 0}, rest = e, off = 0, goff = 0;
    for (int d = t->rank - 1; d >= 0; d--) {
      idx[d] = rest % t->shape[d];
      rest /= t->shape[d];
    }
    for (int d = 0; d < t->rank; d++) {
      off += idx[d] * t->strides[d];
      goff += idx[d] * grad->strides[d];
    }
    an[s] = grad->dtype == ATTN_F64 ? ((double *)grad->data)[goff] : ((float *)grad->data)[goff];
    fd[s] = fd_at(ctx, P, t->data, t->dtype, off, scratch);
  }
  const double err = rel_err(an, fd, ns, floor);
  if (err > worst_fd) worst_fd = err;
  CHECK(err <= TOL_FD && tu_count_nan(an, ns) == 0, "%s: %s: rel err %.3g vs finite differences (first %g vs %g)",
        P->s.name, what, err, an[0], fd[0]);
}

static const char *param_name[ATTN_MHA_NUM_PARAMS] = {"dWq", "dbq", "dWk", "dbk", "dWv", "dbv", "dWo", "dbo",
                                                       [ATTN_MHA_SINKS] = "dsinks"};

static void finite_difference_case(attn_ctx *ctx, const spec *s, uint64_t seed) {
  prob P;
  prob_init(ctx, &P, s, ATTN_F64, seed);
  const int64_t B = s->B, Nq = s->Nq, Nk = P.Nk, E = P.E;
  attn_mha *g = grads_layer(ctx, &P);
  double *out = calloc((size_t)(B * Nq * E + 1), sizeof(double));
  double *dq = calloc((size_t)(B * Nq * E + 1), sizeof(double)), *dk = calloc((size_t)(B * Nk * P.kd + 1), sizeof(double));
  double *dv = calloc((size_t)(B * Nk * P.vd + 1), sizeof(double));
  /* the gradients are written through the same strides as the inputs they belong to */
  attn_tensor tdq = rows_view(dq, ATTN_F64, B, Nq, E, s->strided), tdk = rows_view(dk, ATTN_F64, B, Nk, P.kd, s->strided);
  attn_tensor tdv = rows_view(dv, ATTN_F64, B, Nk, P.vd, s->strided), to = rows_view(out, ATTN_F64, B, Nq, E, 0);
  attn_mha_saved *sv = NULL;
  CHECK_OK(ctx, attn_mha_forward_save(ctx, P.m, &to, NULL, &sv, &P.tq, key_of(&P), value_of(&P), &P.o));
  CHECK_OK(ctx, attn_mha_backward(ctx, P.m, &tdq, s->cross ? &tdk : NULL, s->cross ? &tdv : NULL, g, sv, &P.tg));
  attn_mha_saved_free(sv);
  tu_rng r = {seed ^ 0x5eed};
  worst_fd = 0;
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    attn_tensor tp, tgp, tbq;
    if (attn_mha_param_view(ctx, &tp, P.m, (attn_mha_param)p)) continue;
    CHECK_OK(ctx, attn_mha_param_view(ctx, &tgp, g, (attn_mha_param)p));
    double floor = FD_FLOOR;
    if (p == ATTN_MHA_K_BIAS && attn_mha_param_view(ctx, &tbq, g, ATTN_MHA_Q_BIAS) == ATTN_OK && norm_of(&tbq) > floor)
      floor = norm_of(&tbq);
    fd_compare(ctx, &P, &tp, &tgp, param_name[p], &r, out, floor);
  }
  fd_compare(ctx, &P, &P.tq, &tdq, "dquery", &r, out, FD_FLOOR);
  if (s->cross) {
    fd_compare(ctx, &P, &P.tk, &tdk, "dkey", &r, out, FD_FLOOR);
    fd_compare(ctx, &P, &P.tv, &tdv, "dvalue", &r, out, FD_FLOOR);
  }
  printf("  finite differences  %-20s worst rel err %.2e\n", s->name, worst_fd);
  free(out); free(dq); free(dk); free(dv);
  attn_mha_destroy(g);
  prob_free(&P);
}

static const spec fd_specs[] = {
    /* name                E  H Hk kd vd bias cross B Nq Nk causal                    mask kpm drop strided */
    {"self",               8, 2, 0, 0, 0, 1, 0, 2, 5, 0, ATTN_CAUSAL_NONE,         0, 0, 0.0, 0, 0},
    {"self causal nobias", 8, 2, 0, 0, 0, 0, 0, 2, 6, 0, ATTN_CAUSAL_TOP_LEFT,     0, 0, 0.0, 1, 0},
    {"cross kdim vdim",    6, 3, 0, 5, 7, 1, 1, 2, 4, 6, ATTN_CAUSAL_NONE,         1, 1, 0.0, 0, 0},
    {"cross gqa additive", 8, 4, 2, 0, 0, 1, 1, 2, 5, 7, ATTN_CAUSAL_BOTTOM_RIGHT, 2, 0, 0.0, 1, 0},
    {"self mqa padded",    8, 4, 1, 0, 0, 1, 0, 2, 5, 0, ATTN_CAUSAL_NONE,         0, 2, 0.0, 0, 0},
    {"self dropout",       8, 2, 0, 0, 0, 1, 0, 2, 6, 0, ATTN_CAUSAL_NONE,         1, 0, 0.3, 0, 0},
    {"cross gqa dropout",  8, 4, 2, 3, 9, 0, 1, 1, 4, 6, ATTN_CAUSAL_TOP_LEFT,     2, 1, 0.5, 1, 0},
    {"self options",       8, 2, 0, 0, 0, 1, 0, 2, 6, 0, ATTN_CAUSAL_NONE,         0, 0, 0.0, 0, 15},
    {"cross gqa options",  8, 4, 2, 0, 0, 1, 1, 2, 5, 7, ATTN_CAUSAL_BOTTOM_RIGHT, 2, 1, 0.0, 1, 15},
    {"self learned sinks", 8, 2, 0, 0, 0, 1, 0, 2, 6, 0, ATTN_CAUSAL_TOP_LEFT,     0, 1, 0.0, 0, 16},
    {"cross gqa sinks opt",8, 4, 2, 0, 0, 0, 1, 2, 5, 7, ATTN_CAUSAL_BOTTOM_RIGHT, 2, 2, 0.3, 1, 23},
};

/* ---- (b) the fp32 path against the float64 path ---------------------------------- */
typedef struct result {
  double *param[ATTN_MHA_NUM_PARAMS];
  double *dq, *dk, *dv, *out;
  int64_t nparam[ATTN_MHA_NUM_PARAMS], nq, nk, nv, nout;
} result;

static void result_free(result *r) {
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) free(r->param[p]);
  free(r->dq); free(r->dk); free(r->dv); free(r->out);
  memset(r, 0, sizeof *r);
}

/* Forward (saved) and backward on the context as it is, outputs in dt; every result as doubles.
 * raw, when not NULL, gets the bytes of every fp32 result (params, then dq, dk, dv) for bitwise checks. */
static void run_backward(attn_ctx *ctx, prob *P, attn_dtype dt, result *res, float **raw, int64_t *nraw) {
  const spec *s = &P->s;
  const int64_t B = s->B, Nq = s->Nq, Nk = P->Nk, E = P->E;
  const size_t es = attn_dtype_size(dt);
  memset(res, 0, sizeof *res);
  attn_mha *g = grads_layer(ctx, P);
  void *out = calloc((size_t)(B * Nq * E + 1), es), *dq = calloc((size_t)(B * Nq * E + 1), es);
  void *dk = calloc((size_t)(B * Nk * P->kd + 1), es), *dv = calloc((size_t)(B * Nk * P->vd + 1), es);
  attn_tensor to = rows_view(out, dt, B, Nq, E, s->strided), tdq = rows_view(dq, dt, B, Nq, E, s->strided);
  attn_tensor tdk = rows_view(dk, dt, B, Nk, P->kd, s->strided), tdv = rows_view(dv, dt, B, Nk, P->vd, s->strided);
  if (dt == ATTN_F32) {
    tu_poison_f32(dq, B * Nq * E);
    tu_poison_f32(dk, B * Nk * P->kd);
    tu_poison_f32(dv, B * Nk * P->vd);
  }
  attn_mha_saved *sv = NULL;
  CHECK_OK(ctx, attn_mha_forward_save(ctx, P->m, &to, NULL, &sv, &P->tq, key_of(P), value_of(P), &P->o));
  CHECK_OK(ctx, attn_mha_backward(ctx, P->m, &tdq, s->cross ? &tdk : NULL, s->cross ? &tdv : NULL, g, sv, &P->tg));
  attn_mha_saved_free(sv);
  int64_t total = 0;
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, g, (attn_mha_param)p)) continue;
    res->param[p] = tu_to_f64(&t);
    res->nparam[p] = attn_tensor_numel(&t);
    total += res->nparam[p];
  }
  res->out = tu_to_f64(&to);
  res->nout = B * Nq * E;
  res->dq = tu_to_f64(&tdq);
  res->nq = B * Nq * E;
  if (s->cross) {
    res->dk = tu_to_f64(&tdk);
    res->dv = tu_to_f64(&tdv);
    res->nk = B * Nk * P->kd;
    res->nv = B * Nk * P->vd;
  }
  if (raw) {
    total += res->nq + res->nk + res->nv;
    float *b = *raw = malloc(sizeof(float) * (size_t)(total + 1));
    for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
      attn_tensor t;
      if (attn_mha_param_view(ctx, &t, g, (attn_mha_param)p)) continue;
      memcpy(b, t.data, sizeof(float) * (size_t)res->nparam[p]);
      b += res->nparam[p];
    }
    memcpy(b, dq, sizeof(float) * (size_t)res->nq);
    b += res->nq;
    if (s->cross) {
      memcpy(b, dk, sizeof(float) * (size_t)res->nk);
      memcpy(b + res->nk, dv, sizeof(float) * (size_t)res->nv);
    }
    *nraw = total;
  }
  free(out); free(dq); free(dk); free(dv);
  attn_mha_destroy(g);
}

static double worst_fp32 = 0;
static const char *worst_what = "";

static void compare(const prob *P, const char *what, const double *got, const double *want, int64_t n, const char *kn,
                    int threads, double floor) {
  if (!n) return;
  const double e = rel_err(got, want, n, floor);
  if (e > worst_fp32) {
    worst_fp32 = e;
    worst_what = what;
  }
  CHECK(e <= TOL_FP32 && tu_count_nan(got, n) == 0, "%s (%s, %d threads): %s rel err %.3g vs float64, %d NaN",
        P->s.name, kn, threads, what, e, tu_count_nan(got, n));
}

static double dot(const double *a, const double *b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
  return s;
}

static void fp32_case(attn_ctx *ctx, const spec *s, uint64_t seed) {
  worst_fp32 = 0;
  worst_what = "";
  prob P;
  prob_init(ctx, &P, s, ATTN_F32, seed);
  result ref;
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_REF));
  run_backward(ctx, &P, ATTN_F64, &ref, NULL, NULL);
  static const attn_kernel kernels[] = {ATTN_KERNEL_C, ATTN_KERNEL_AVX2, ATTN_KERNEL_AVX512};
  for (size_t k = 0; k < sizeof kernels / sizeof kernels[0]; k++) {
    if (!attn_kernel_supported(kernels[k])) continue;
    CHECK_OK(ctx, attn_ctx_set_kernel(ctx, kernels[k]));
    const char *kn = attn_kernel_name(kernels[k]);
    float *first = NULL;
    int64_t nfirst = 0;
    for (int threads = 1; threads <= 3; threads++) {
      attn_ctx_set_threads(ctx, threads);
      result res;
      float *raw;
      int64_t nraw;
      run_backward(ctx, &P, ATTN_F32, &res, &raw, &nraw);
      for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
        if (!ref.param[p]) continue;
        /* the key bias's true gradient is zero: its error is measured against the query bias's size */
        const double floor = p == ATTN_MHA_K_BIAS ? sqrt(dot(ref.param[ATTN_MHA_Q_BIAS], ref.param[ATTN_MHA_Q_BIAS],
                                                              ref.nparam[ATTN_MHA_Q_BIAS]))
                                                  : 0;
        compare(&P, param_name[p], res.param[p], ref.param[p], ref.nparam[p], kn, threads, floor);
      }
      compare(&P, "out", res.out, ref.out, ref.nout, kn, threads, 0);
      compare(&P, "dquery", res.dq, ref.dq, ref.nq, kn, threads, 0);
      compare(&P, "dkey", res.dk, ref.dk, ref.nk, kn, threads, 0);
      compare(&P, "dvalue", res.dv, ref.dv, ref.nv, kn, threads, 0);
      if (threads == 1) {
        first = raw;
        nfirst = nraw;
      } else {
        CHECK(nraw == nfirst && !memcmp(first, raw, sizeof(float) * (size_t)nraw),
              "%s (%s): %d threads changed the bits of the gradients", s->name, kn, threads);
        free(raw);
      }
      result_free(&res);
    }
    free(first);
  }
  attn_ctx_set_threads(ctx, 0);
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO));
  printf("  fp32 vs float64     %-20s worst rel err %.2e (%s)\n", s->name, worst_fp32, worst_what);
  result_free(&ref);
  prob_free(&P);
}

static const spec fp32_specs[] = {
    /* name                E  H Hk kd  vd bias cross B Nq  Nk causal                    mask kpm drop strided */
    {"f32 self",           64, 4, 0, 0,  0, 1, 0, 2, 37, 0,  ATTN_CAUSAL_TOP_LEFT,     0, 0, 0.1, 1, 0},
    {"f32 cross gqa",      48, 6, 2, 40, 24, 1, 1, 3, 19, 45, ATTN_CAUSAL_NONE,         1, 1, 0.0, 1, 0},
    {"f32 self mqa",       32, 4, 1, 0,  0, 0, 0, 2, 29, 0,  ATTN_CAUSAL_BOTTOM_RIGHT, 2, 0, 0.0, 0, 0},
    {"f32 cross dropout",  24, 3, 0, 0,  0, 1, 1, 2, 13, 70, ATTN_CAUSAL_NONE,         0, 2, 0.4, 0, 0},
    {"f32 small",          6,  3, 3, 5,  7, 1, 1, 1, 3,  2,  ATTN_CAUSAL_NONE,         1, 1, 0.0, 1, 0},
    {"f32 self options",   64, 4, 2, 0,  0, 1, 0, 2, 37, 0,  ATTN_CAUSAL_BOTTOM_RIGHT, 2, 1, 0.1, 1, 15},
    {"f32 cross options",  48, 6, 0, 40, 24, 1, 1, 2, 19, 45, ATTN_CAUSAL_NONE,         1, 0, 0.0, 0, 15},
    {"f32 learned sinks",  64, 4, 2, 0,  0, 1, 0, 2, 37, 0,  ATTN_CAUSAL_TOP_LEFT,     0, 2, 0.1, 1, 23},
    {"f32 cross sinks",    48, 6, 3, 40, 24, 0, 1, 3, 19, 45, ATTN_CAUSAL_NONE,         1, 1, 0.0, 0, 16},
};

/* A random small problem (any head count, D from 1, sequences from 1), for both (a) and (b). */
static spec random_spec(uint64_t seed) {
  tu_rng r = {seed};
  spec s;
  memset(&s, 0, sizeof s);
  s.name = "random";
  s.H = tu_int(&r, 1, 4);
  const int64_t D = tu_int(&r, 1, 8);
  s.E = s.H * D;
  const int64_t kvchoice = tu_int(&r, 0, 2);
  s.Hk = kvchoice == 0 ? 0 : (kvchoice == 1 ? 1 : (s.H % 2 ? s.H : s.H / 2));
  s.cross = (int)tu_int(&r, 0, 1);
  if (s.cross && tu_int(&r, 0, 1)) {
    s.kdim = tu_int(&r, 1, 12);
    s.vdim = tu_int(&r, 1, 12);
  }
  s.bias = (int)tu_int(&r, 0, 1);
  s.B = tu_int(&r, 1, 3);
  s.Nq = tu_int(&r, 1, 20);
  s.Nk = tu_int(&r, 1, 20);
  s.causal = (attn_causal)tu_int(&r, 0, 2);
  s.mask = (int)tu_int(&r, 0, 2);
  s.kpm = (int)tu_int(&r, 0, 2);
  s.dropout = tu_int(&r, 0, 1) ? 0.25 : 0.0;
  s.strided = (int)tu_int(&r, 0, 1);
  s.options = (int)tu_int(&r, 0, 15);
  if (s.options & 8 && tu_int(&r, 0, 1)) s.options ^= 8 | 16; /* the layer's learned sinks instead */
  return s;
}

/* ---- what must agree -------------------------------------------------------------- */
static void agreements(attn_ctx *ctx) {
  const spec s = {"agree", 16, 4, 2, 0, 0, 1, 1, 2, 9, 11, ATTN_CAUSAL_NONE, 1, 1, 0.2, 0, 0};
  prob P;
  prob_init(ctx, &P, &s, ATTN_F32, 99);
  const int64_t B = s.B, Nq = s.Nq, Nk = P.Nk, E = P.E, nq = B * Nq * E, nk = B * Nk * E;
  float *o1 = malloc(sizeof(float) * (size_t)nq), *o2 = malloc(sizeof(float) * (size_t)nq);
  attn_tensor t1 = rows_view(o1, ATTN_F32, B, Nq, E, 0), t2 = rows_view(o2, ATTN_F32, B, Nq, E, 0);
  attn_mha_saved *sv = NULL;
  /* the saving forward gives the plain forward's bits (dropout included) */
  CHECK_OK(ctx, attn_mha_forward(ctx, P.m, &t1, NULL, &P.tq, &P.tk, &P.tv, &P.o));
  CHECK_OK(ctx, attn_mha_forward_save(ctx, P.m, &t2, NULL, &sv, &P.tq, &P.tk, &P.tv, &P.o));
  CHECK(!memcmp(o1, o2, sizeof(float) * (size_t)nq), "forward_save's out differs from attn_mha_forward's");
  /* dropout changes the output, and only through its seed */
  attn_mha_opts nodrop = P.o;
  nodrop.attn.dropout_p = 0;
  CHECK_OK(ctx, attn_mha_forward(ctx, P.m, &t1, NULL, &P.tq, &P.tk, &P.tv, &nodrop));
  CHECK(memcmp(o1, o2, sizeof(float) * (size_t)nq), "dropout_p did not reach the attention");

  /* two backward passes on one saved state; then with only some outputs asked for */
  attn_mha *g1 = grads_layer(ctx, &P), *g2 = grads_layer(ctx, &P);
  float *dq1 = malloc(sizeof(float) * (size_t)nq), *dq2 = malloc(sizeof(float) * (size_t)nq);
  float *dk1 = malloc(sizeof(float) * (size_t)nk), *dk2 = malloc(sizeof(float) * (size_t)nk);
  float *dv1 = malloc(sizeof(float) * (size_t)nk), *dv2 = malloc(sizeof(float) * (size_t)nk);
  attn_tensor tq1 = rows_view(dq1, ATTN_F32, B, Nq, E, 0), tq2 = rows_view(dq2, ATTN_F32, B, Nq, E, 0);
  attn_tensor tk1 = rows_view(dk1, ATTN_F32, B, Nk, E, 0), tk2 = rows_view(dk2, ATTN_F32, B, Nk, E, 0);
  attn_tensor tv1 = rows_view(dv1, ATTN_F32, B, Nk, E, 0), tv2 = rows_view(dv2, ATTN_F32, B, Nk, E, 0);
  CHECK_OK(ctx, attn_mha_backward(ctx, P.m, &tq1, &tk1, &tv1, g1, sv, &P.tg));
  CHECK_OK(ctx, attn_mha_backward(ctx, P.m, &tq2, &tk2, &tv2, g2, sv, &P.tg));
  int same = !memcmp(dq1, dq2, sizeof(float) * (size_t)nq) && !memcmp(dk1, dk2, sizeof(float) * (size_t)nk);
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    attn_tensor a, b;
    if (attn_mha_param_view(ctx, &a, g1, (attn_mha_param)p)) continue;
    CHECK_OK(ctx, attn_mha_param_view(ctx, &b, g2, (attn_mha_param)p));
    same = same && !memcmp(a.data, b.data, sizeof(float) * (size_t)attn_tensor_numel(&a));
  }
  CHECK(same, "a second backward on the same saved state differs");
  tu_poison_f32(dq2, nq);
  tu_poison_f32(dv2, nk);
  CHECK_OK(ctx, attn_mha_backward(ctx, P.m, &tq2, NULL, &tv2, NULL, sv, &P.tg));
  CHECK(!memcmp(dq1, dq2, sizeof(float) * (size_t)nq) && !memcmp(dv1, dv2, sizeof(float) * (size_t)nk),
        "input gradients without grads differ");
  attn_mha_destroy(g2);
  g2 = grads_layer(ctx, &P);
  CHECK_OK(ctx, attn_mha_backward(ctx, P.m, NULL, NULL, NULL, g2, sv, &P.tg));
  same = 1;
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    attn_tensor a, b;
    if (attn_mha_param_view(ctx, &a, g1, (attn_mha_param)p)) continue;
    CHECK_OK(ctx, attn_mha_param_view(ctx, &b, g2, (attn_mha_param)p));
    same = same && !memcmp(a.data, b.data, sizeof(float) * (size_t)attn_tensor_numel(&a));
  }
  CHECK(same, "parameter gradients without input gradients differ");
  attn_mha_saved_free(sv);

  /* key and value as one tensor: its gradient is dkey + dvalue */
  CHECK_OK(ctx, attn_mha_forward_save(ctx, P.m, &t2, NULL, &sv, &P.tq, &P.tk, &P.tk, &P.o));
  CHECK_OK(ctx, attn_mha_backward(ctx, P.m, &tq1, &tk1, &tv1, g1, sv, &P.tg));
  attn_mha_saved_free(sv);
  float *copy = malloc(sizeof(float) * (size_t)nk);
  memcpy(copy, P.xk, sizeof(float) * (size_t)nk);
  attn_tensor tcopy = rows_view(copy, ATTN_F32, B, Nk, E, 0);
  CHECK_OK(ctx, attn_mha_forward_save(ctx, P.m, &t1, NULL, &sv, &P.tq, &P.tk, &tcopy, &P.o));
  CHECK_OK(ctx, attn_mha_backward(ctx, P.m, &tq2, &tk2, &tv2, g2, sv, &P.tg));
  attn_mha_saved_free(sv);
  CHECK(!memcmp(o1, o2, sizeof(float) * (size_t)nq) && !memcmp(dq1, dq2, sizeof(float) * (size_t)nq) &&
            !memcmp(dk1, dk2, sizeof(float) * (size_t)nk) && !memcmp(dv1, dv2, sizeof(float) * (size_t)nk),
        "key = value as one tensor differs from two equal tensors");
  free(copy);

  /* empty sequences: no query rows means zero gradients; no keys means A = 0 */
  for (int which = 0; which < 2; which++) {
    for (int refk = 0; refk < 2; refk++) {
      CHECK_OK(ctx, attn_ctx_set_kernel(ctx, refk ? ATTN_KERNEL_REF : ATTN_KERNEL_AUTO));
      const int64_t eq = which == 0 ? 0 : Nq, ek = which == 0 ? Nk : 0;
      attn_tensor q0 = rows_view(P.xq, ATTN_F32, B, eq, E, 0), k0 = rows_view(P.xk, ATTN_F32, B, ek, E, 0);
      attn_tensor g0 = rows_view(P.g, ATTN_F32, B, eq, E, 0), out0 = rows_view(o1, ATTN_F32, B, eq, E, 0);
      attn_tensor dq0 = rows_view(dq1, ATTN_F32, B, eq, E, 0), dk0 = rows_view(dk1, ATTN_F32, B, ek, E, 0);
      attn_tensor dv0 = rows_view(dv1, ATTN_F32, B, ek, E, 0);
      attn_mha_opts o;
      attn_mha_opts_init(&o);
      CHECK_OK(ctx, attn_mha_forward_save(ctx, P.m, &out0, NULL, &sv, &q0, &k0, &k0, &o));
      tu_poison_f32(dk1, nk);
      tu_poison_f32(dq1, nq);
      CHECK_OK(ctx, attn_mha_backward(ctx, P.m, &dq0, &dk0, &dv0, g1, sv, &g0));
      attn_mha_saved_free(sv);
      int ok = 1;
      for (int64_t i = 0; i < B * ek * E; i++) ok = ok && dk1[i] == 0;
      for (int64_t i = 0; i < B * eq * E; i++) ok = ok && dq1[i] == 0; /* no keys: A does not depend on the query */
      for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
        attn_tensor t;
        if (attn_mha_param_view(ctx, &t, g1, (attn_mha_param)p)) continue;
        const float *w = t.data;
        for (int64_t i = 0; i < attn_tensor_numel(&t); i++) {
          ok = ok && !isnan(w[i]);
          if (which == 0 || p != ATTN_MHA_O_BIAS) ok = ok && w[i] == 0;
        }
      }
      CHECK(ok, "empty %s (%s): gradients not zero", which == 0 ? "query" : "keys", refk ? "ref" : "fp32");
    }
  }
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO));
  free(o1); free(o2); free(dq1); free(dq2); free(dk1); free(dk2); free(dv1); free(dv2);
  attn_mha_destroy(g1);
  attn_mha_destroy(g2);
  prob_free(&P);
}

/* ---- (c) argument checks ---------------------------------------------------------- */
#define CHECK_STATUS(ctx, call, want, text)                                                            \
  do {                                                                                                 \
    attn_status st_ = (call);                                                                          \
    CHECK(st_ == (want) && strstr(attn_ctx_error(ctx), text), "%s -> %s (%s), want %s and '%s'", #call, \
          attn_strerror(st_), attn_ctx_error(ctx), attn_strerror(want), text);                         \
  } while (0)

static void error_paths(attn_ctx *ctx) {
  const spec s = {"errors", 8, 2, 0, 0, 0, 1, 0, 2, 4, 0, ATTN_CAUSAL_NONE, 0, 0, 0.0, 0, 0};
  prob P;
  prob_init(ctx, &P, &s, ATTN_F32, 5);
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_C)); /* an fp32 kernel, whatever ATTN_KERNEL says */
  const int64_t B = 2, N = 4, E = 8;
  float out[2 * 4 * 8], dq[2 * 4 * 8], big[3 * 4 * 8];
  double out64[2 * 4 * 8];
  attn_tensor to = rows_view(out, ATTN_F32, B, N, E, 0), tdq = rows_view(dq, ATTN_F32, B, N, E, 0);
  attn_tensor to64 = rows_view(out64, ATTN_F64, B, N, E, 0), tbig = rows_view(big, ATTN_F32, 3, N, E, 0);
  attn_mha_saved *sv = (attn_mha_saved *)&P; /* must be reset to NULL on failure */
  CHECK_STATUS(ctx, attn_mha_forward_save(ctx, P.m, &to, NULL, NULL, &P.tq, NULL, NULL, NULL), ATTN_E_INVALID, "saved");
  CHECK_STATUS(ctx, attn_mha_forward_save(ctx, NULL, &to, NULL, &sv, &P.tq, NULL, NULL, NULL), ATTN_E_INVALID, "NULL");
  CHECK(sv == NULL, "a failed forward_save leaves *saved NULL");
  CHECK_STATUS(ctx, attn_mha_forward_save(ctx, P.m, &tbig, NULL, &sv, &P.tq, NULL, NULL, NULL), ATTN_E_SHAPE, "out");
  CHECK(sv == NULL, "a failed forward_save leaves *saved NULL");
  attn_mha_opts o;
  attn_mha_opts_init(&o);
  const double bad_p[] = {1.5, -0.1, NAN, INFINITY};
  for (int i = 0; i < 4; i++) {
    o.attn.dropout_p = bad_p[i];
    CHECK_STATUS(ctx, attn_mha_forward_save(ctx, P.m, &to, NULL, &sv, &P.tq, NULL, NULL, &o), ATTN_E_INVALID,
                 "dropout_p");
    CHECK_STATUS(ctx, attn_mha_forward(ctx, P.m, &to, NULL, &P.tq, NULL, NULL, &o), ATTN_E_INVALID, "dropout_p");
  }
  attn_tensor empty = rows_view(out, ATTN_F32, 0, N, E, 0);
  CHECK_STATUS(ctx, attn_mha_forward(ctx, P.m, &empty, NULL, &empty, NULL, NULL, &o), ATTN_E_INVALID, "dropout_p");
  o.attn.dropout_p = 0;
  o.attn.window = -1;
  CHECK_STATUS(ctx, attn_mha_forward(ctx, P.m, &to, NULL, &P.tq, NULL, NULL, &o), ATTN_E_INVALID, "window");
  CHECK_STATUS(ctx, attn_mha_forward(ctx, P.m, &empty, NULL, &empty, NULL, NULL, &o), ATTN_E_INVALID, "window");
  o.attn.window = 0;
  o.attn.softcap = NAN;
  CHECK_STATUS(ctx, attn_mha_forward_save(ctx, P.m, &to, NULL, &sv, &P.tq, NULL, NULL, &o), ATTN_E_INVALID, "softcap");
  o.attn.softcap = 0;
  float three[3] = {1, 2, 3};
  const int64_t n3[1] = {3};
  attn_tensor t3 = attn_tensor_view(three, ATTN_F32, 1, n3);
  o.attn.sinks = &t3;
  CHECK_STATUS(ctx, attn_mha_forward(ctx, P.m, &to, NULL, &P.tq, NULL, NULL, &o), ATTN_E_SHAPE, "sinks");
  o.attn.sinks = NULL;
  o.attn.alibi_slopes = &t3;
  CHECK_STATUS(ctx, attn_mha_forward(ctx, P.m, &to, NULL, &P.tq, NULL, NULL, &o), ATTN_E_SHAPE, "alibi_slopes");
  o.attn.alibi_slopes = NULL;

  CHECK_OK(ctx, attn_mha_forward_save(ctx, P.m, &to, NULL, &sv, &P.tq, NULL, NULL, &o));
  attn_mha *g = grads_layer(ctx, &P), *other = NULL, *nobias = NULL;
  attn_mha_config c = *attn_mha_get_config(P.m);
  c.bias = 0;
  CHECK_OK(ctx, attn_mha_create(ctx, &nobias, &c));
  c.bias = 1;
  c.num_kv_heads = 1;
  CHECK_OK(ctx, attn_mha_create(ctx, &other, &c));
  CHECK_OK(ctx, attn_mha_backward(ctx, P.m, &tdq, NULL, NULL, g, sv, &P.tg));
  CHECK_STATUS(ctx, attn_mha_backward(ctx, NULL, &tdq, NULL, NULL, g, sv, &P.tg), ATTN_E_INVALID, "layer is NULL");
  CHECK_STATUS(ctx, attn_mha_backward(ctx, P.m, &tdq, NULL, NULL, g, NULL, &P.tg), ATTN_E_INVALID, "saved is NULL");
  CHECK_STATUS(ctx, attn_mha_backward(ctx, P.m, &tdq, NULL, NULL, g, sv, NULL), ATTN_E_INVALID, "dout");
  CHECK_STATUS(ctx, attn_mha_backward(ctx, P.m, &tdq, NULL, NULL, g, sv, &tbig), ATTN_E_SHAPE, "dout");
  CHECK_STATUS(ctx, attn_mha_backward(ctx, P.m, &tdq, NULL, NULL, g, sv, &to64), ATTN_E_DTYPE, "dout");
  CHECK_STATUS(ctx, attn_mha_backward(ctx, P.m, &tbig, NULL, NULL, g, sv, &P.tg), ATTN_E_SHAPE, "dquery");
  CHECK_STATUS(ctx, attn_mha_backward(ctx, P.m, &to64, NULL, NULL, g, sv, &P.tg), ATTN_E_DTYPE, "dquery");
  attn_tensor bcast = tdq;
  bcast.strides[1] = 0;
  CHECK_STATUS(ctx, attn_mha_backward(ctx, P.m, &bcast, NULL, NULL, g, sv, &P.tg), ATTN_E_INVALID, "stride 0");
  attn_tensor rank2 = tdq;
  rank2.rank = 2;
  CHECK_STATUS(ctx, attn_mha_backward(ctx, P.m, &rank2, NULL, NULL, g, sv, &P.tg), ATTN_E_SHAPE, "rank");
  CHECK_STATUS(ctx, attn_mha_backward(ctx, P.m, &tdq, &tdq, NULL, g, sv, &P.tg), ATTN_E_INVALID, "self-attention");
  CHECK_STATUS(ctx, attn_mha_backward(ctx, P.m, NULL, NULL, &tdq, g, sv, &P.tg), ATTN_E_INVALID, "self-attention");
  CHECK_STATUS(ctx, attn_mha_backward(ctx, P.m, &tdq, NULL, NULL, P.m, sv, &P.tg), ATTN_E_INVALID, "another layer");
  CHECK_STATUS(ctx, attn_mha_backward(ctx, P.m, &tdq, NULL, NULL, nobias, sv, &P.tg), ATTN_E_INVALID, "bias off");
  CHECK_STATUS(ctx, attn_mha_backward(ctx, P.m, &tdq, NULL, NULL, other, sv, &P.tg), ATTN_E_INVALID, "kv heads 1");
  CHECK_STATUS(ctx, attn_mha_backward(ctx, other, &tdq, NULL, NULL, g, sv, &P.tg), ATTN_E_INVALID, "saved comes from");
  /* the precision of the forward and the backward must match */
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_REF));
  CHECK_STATUS(ctx, attn_mha_backward(ctx, P.m, &tdq, NULL, NULL, g, sv, &P.tg), ATTN_E_INVALID, "fp32 forward");
  attn_mha_saved *sv64 = NULL;
  CHECK_OK(ctx, attn_mha_forward_save(ctx, P.m, &to64, NULL, &sv64, &P.tq, NULL, NULL, &o));
  CHECK_OK(ctx, attn_mha_backward(ctx, P.m, &to64, NULL, NULL, g, sv64, &to64)); /* f64 in and out: fine with REF */
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_C));
  CHECK_STATUS(ctx, attn_mha_backward(ctx, P.m, &tdq, NULL, NULL, g, sv64, &P.tg), ATTN_E_INVALID, "float64");
  attn_mha_saved_free(sv64);
  attn_mha_saved_free(sv);
  attn_mha_saved_free(NULL);
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO));
  attn_mha_destroy(g);
  attn_mha_destroy(other);
  attn_mha_destroy(nobias);
  prob_free(&P);
}

/* Each option reaches attention in the forward and, through the saved state, the backward:
 * it changes out and the gradients, and a second layer call with it gives the same answer. */
static void options_reach_attention(attn_ctx *ctx) {
  const spec s0 = {"options", 16, 4, 2, 0, 0, 1, 0, 2, 9, 0, ATTN_CAUSAL_NONE, 0, 0, 0.0, 0, 0};
  result base;
  prob P0;
  prob_init(ctx, &P0, &s0, ATTN_F32, 77);
  float *raw = NULL;
  int64_t nraw = 0;
  run_backward(ctx, &P0, ATTN_F32, &base, &raw, &nraw);
  free(raw);
  for (int bit = 1; bit <= 8; bit *= 2) {
    spec s = s0;
    s.options = bit;
    prob P;
    prob_init(ctx, &P, &s, ATTN_F32, 77);
    result res;
    run_backward(ctx, &P, ATTN_F32, &res, &raw, &nraw);
    free(raw);
    double dout = 0, dgrad = 0;
    for (int64_t i = 0; i < res.nout; i++) dout = fmax(dout, fabs(res.out[i] - base.out[i]));
    for (int64_t i = 0; i < res.nq; i++) dgrad = fmax(dgrad, fabs(res.dq[i] - base.dq[i]));
    CHECK(dout > 1e-4 && dgrad > 1e-4, "option bit %d changes nothing in the layer: out by %.3g, dquery by %.3g", bit,
          dout, dgrad);
    result_free(&res);
    prob_free(&P);
  }
  result_free(&base);
  prob_free(&P0);
}

/* The saved state keeps its own copies of the forward's mask, key padding,
 * ALiBi slopes and sinks: the caller's buffers may be poisoned and freed
 * between attn_mha_forward_save and attn_mha_backward (under ASan a read of
 * them is a use-after-free) and the gradients are bitwise those of a run that
 * kept them. Both precisions, a full [B, H, Nq, Nk] mask and a broadcast one. */
static void saved_owns_options(attn_ctx *ctx) {
  for (int variant = 0; variant < 4; variant++) {
    const int ref = variant & 1, full = variant < 2;
    const spec s = {"saved owns", 8, 4, 2, 5, 7, 1, 1, 2, 5, 6, ATTN_CAUSAL_NONE, full ? 2 : 1, 1, 0.0, 1, 12};
    prob P;
    prob_init(ctx, &P, &s, ATTN_F32, 31 + (uint64_t)variant);
    CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ref ? ATTN_KERNEL_REF : ATTN_KERNEL_AUTO));
    const attn_dtype dt = ref ? ATTN_F64 : ATTN_F32;
    result kept, dropped;
    run_backward(ctx, &P, dt, &kept, NULL, NULL);

    /* the same options in buffers of their own, gone before the backward */
    const int64_t B = s.B, Nq = s.Nq, Nk = P.Nk, E = P.E;
    const size_t nm = full ? sizeof(float) * (size_t)(s.H * Nq * Nk) : (size_t)(Nq * Nk), nk = (size_t)(B * Nk);
    void *mask = malloc(nm), *kpm = malloc(nk), *slopes = malloc(sizeof(float) * (size_t)s.H);
    void *sinks = malloc(sizeof(float) * (size_t)s.H);
    memcpy(mask, full ? (void *)P.ma : (void *)P.mb, nm);
    memcpy(kpm, P.kp, nk);
    memcpy(slopes, P.slopes, sizeof(float) * (size_t)s.H);
    memcpy(sinks, P.sinks, sizeof(float) * (size_t)s.H);
    attn_tensor tm = P.tmask, tkp = P.tkp, tsl = P.tslopes, tsk = P.tsinks;
    tm.data = mask;
    tkp.data = kpm;
    tsl.data = slopes;
    tsk.data = sinks;
    attn_mha_opts o = P.o;
    o.attn.mask = &tm;
    o.attn.key_padding = &tkp;
    o.attn.alibi_slopes = &tsl;
    o.attn.sinks = &tsk;
    memset(&dropped, 0, sizeof dropped);
    const size_t es = attn_dtype_size(dt);
    void *out = calloc((size_t)(B * Nq * E), es), *dq = calloc((size_t)(B * Nq * E), es);
    void *dk = calloc((size_t)(B * Nk * P.kd), es), *dv = calloc((size_t)(B * Nk * P.vd), es);
    attn_tensor to = rows_view(out, dt, B, Nq, E, s.strided), tdq = rows_view(dq, dt, B, Nq, E, s.strided);
    attn_tensor tdk = rows_view(dk, dt, B, Nk, P.kd, s.strided), tdv = rows_view(dv, dt, B, Nk, P.vd, s.strided);
    attn_mha *g = grads_layer(ctx, &P);
    attn_mha_saved *sv = NULL;
    CHECK_OK(ctx, attn_mha_forward_save(ctx, P.m, &to, NULL, &sv, &P.tq, &P.tk, &P.tv, &o));
    memset(mask, 0xff, nm); /* NaN, or true: every key masked */
    memset(kpm, 1, nk);
    memset(slopes, 0xff, sizeof(float) * (size_t)s.H);
    memset(sinks, 0xff, sizeof(float) * (size_t)s.H);
    free(mask);
    free(kpm);
    free(slopes);
    free(sinks);
    o.attn.mask = o.attn.key_padding = o.attn.alibi_slopes = o.attn.sinks = NULL;
    CHECK_OK(ctx, attn_mha_backward(ctx, P.m, &tdq, &tdk, &tdv, g, sv, &P.tg));
    attn_mha_saved_free(sv);
    dropped.dq = tu_to_f64(&tdq);
    dropped.dk = tu_to_f64(&tdk);
    dropped.dv = tu_to_f64(&tdv);
    int same = !memcmp(dropped.dq, kept.dq, sizeof(double) * (size_t)kept.nq) &&
               !memcmp(dropped.dk, kept.dk, sizeof(double) * (size_t)kept.nk) &&
               !memcmp(dropped.dv, kept.dv, sizeof(double) * (size_t)kept.nv);
    for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
      attn_tensor t;
      if (attn_mha_param_view(ctx, &t, g, (attn_mha_param)p)) continue;
      double *gp = tu_to_f64(&t);
      same = same && !memcmp(gp, kept.param[p], sizeof(double) * (size_t)kept.nparam[p]);
      free(gp);
    }
    CHECK(same, "%s, %s mask: the backward depends on the caller's option buffers", ref ? "float64" : "fp32",
          full ? "full" : "broadcast");
    result_free(&kept);
    result_free(&dropped);
    free(out); free(dq); free(dk); free(dv);
    attn_mha_destroy(g);
    prob_free(&P);
  }
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO));
}

int main(void) {
  attn_ctx *ctx = NULL;
  CHECK_OK(ctx, attn_ctx_create(&ctx));
  if (!ctx) return tu_finish("test_mha_backward");
  printf("default kernel: %s\n", attn_kernel_name(attn_ctx_kernel(ctx)));
  /* (a) in float64, one thread: the forward runs thousands of times */
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_REF));
  attn_ctx_set_threads(ctx, 1);
  for (size_t i = 0; i < sizeof fd_specs / sizeof fd_specs[0]; i++) finite_difference_case(ctx, &fd_specs[i], 100 + i);
  for (uint64_t i = 0; i < 6; i++) {
    spec s = random_spec(300 + i);
    s.name = "random (fd)";
    if (s.Nq > 8) s.Nq = 8; /* keep the forward cheap: it runs thousands of times */
    if (s.Nk > 8) s.Nk = 8;
    finite_difference_case(ctx, &s, 300 + i);
  }
  attn_ctx_set_threads(ctx, 0);
  CHECK_OK(ctx, attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO));
  /* (b) */
  for (size_t i = 0; i < sizeof fp32_specs / sizeof fp32_specs[0]; i++) fp32_case(ctx, &fp32_specs[i], 200 + i);
  for (uint64_t i = 0; i < 24; i++) {
    const spec s = random_spec(400 + i);
    fp32_case(ctx, &s, 400 + i);
  }
  agreements(ctx);
  options_reach_attention(ctx);
  saved_owns_options(ctx);
  /* (c) */
  error_paths(ctx);
  attn_ctx_destroy(ctx);
  return tu_finish("test_mha_backward");
}
