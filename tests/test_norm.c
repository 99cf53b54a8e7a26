/* attn_head_norm and its backward against the formulas of attn.h, written out
 * again here in double, and the backward against central differences of that
 * forward; every kind, strided and in-place views, half inputs, 1 and 3
 * threads (bitwise the same parameter gradients), poisoned outputs, refusals. */
#include "testutil.h"

/* y (F) of row x (F) in double */
static void norm_row(double *y, const double *x, const double *w, const double *b, int64_t F, attn_norm_kind kind,
                     double eps) {
  double mean = 0, var = 0;
  if (kind == ATTN_NORM_LAYER) {
    for (int64_t f = 0; f < F; f++) mean += x[f];
    mean /= (double)F;
  }
  for (int64_t f = 0; f < F; f++) var += (x[f] - mean) * (x[f] - mean);
  var /= (double)F;
  for (int64_t f = 0; f < F; f++) {
    const double s = kind == ATTN_NORM_RMS_PLUS_ONE ? 1 + w[f] : w[f];
    y[f] = (x[f] - mean) / sqrt(var + eps) * s + (b ? b[f] : 0);
  }
}

typedef struct ncase {
  int64_t B, H, N, F;
  attn_norm_kind kind;
  double eps;
  int bias, permuted, in_place;
  int per_head; /* weights and biases [H, F], each head its own */
  attn_dtype xdt;
} ncase;

static void run_case(attn_ctx *ctx, const ncase *c, int seed) {
  tu_rng r = {(uint64_t)seed * 7 + 3};
  const int64_t rows = c->B * c->H * c->N, n = rows * c->F, s4[4] = {c->B, c->H, c->N, c->F};
  /* the parameters: [F], or [H, F] with each head's own */
  const int64_t np = c->per_head ? c->H * c->F : c->F, s1[2] = {c->per_head ? c->H : c->F, c->F};
  const int prank = c->per_head ? 2 : 1;
#define PARAMS_OF(row) (c->per_head ? ((row) / c->N % c->H) * c->F : 0) /* row's offset into the parameters */
  float *x = malloc(sizeof(float) * (size_t)(n + 1)), *g = malloc(sizeof(float) * (size_t)(n + 1));
  float *w = malloc(sizeof(float) * (size_t)np), *b = malloc(sizeof(float) * (size_t)np);
  for (int64_t e = 0; e < n; e++) x[e] = tu_round_through((float)(2 * tu_uniform(&r) + 0.3), c->xdt);
  tu_fill_f32(&r, g, n, 1), tu_fill_f32(&r, w, np, 1), tu_fill_f32(&r, b, np, 0.5);
  /* x's storage in its dtype, viewed [B, H, N, F] over [B, N, H, F] memory when permuted */
  const size_t es = attn_dtype_size(c->xdt);
  void *xs = malloc(es * (size_t)(n + 1));
  attn_tensor tx = attn_tensor_view(xs, c->xdt, 4, s4);
  if (c->permuted) tx.strides[1] = c->F, tx.strides[2] = c->H * c->F, tx.strides[0] = c->N * c->H * c->F;
  double *xd = malloc(sizeof(double) * (size_t)(n + 1)), *want = malloc(sizeof(double) * (size_t)(n + 1));
  double *wd = malloc(sizeof(double) * (size_t)np), *bd = malloc(sizeof(double) * (size_t)np);
  for (int64_t f = 0; f < np; f++) wd[f] = w[f], bd[f] = b[f];
  for (int64_t bb = 0; bb < c->B; bb++)
    for (int64_t h = 0; h < c->H; h++)
      for (int64_t t = 0; t < c->N; t++)
        for (int64_t f = 0; f < c->F; f++) {
          const int64_t e = ((bb * c->H + h) * c->N + t) * c->F + f;
          tu_store_float(xs, c->xdt, bb * tx.strides[0] + h * tx.strides[1] + t * tx.strides[2] + f, x[e]);
          xd[e] = x[e];
        }
  for (int64_t row = 0; row < rows; row++)
    norm_row(want + row * c->F, xd + row * c->F, wd + PARAMS_OF(row), c->bias ? bd + PARAMS_OF(row) : NULL, c->F,
             c->kind, c->eps);
  attn_tensor tw = attn_tensor_view(w, ATTN_F32, prank, s1), tb = attn_tensor_view(b, ATTN_F32, prank, s1);
  char desc[180];
  snprintf(desc, sizeof desc, "case %d: B%lld H%lld N%lld F%lld kind %d bias %d permuted %d in place %d per head %d %s",
           seed, (long long)c->B, (long long)c->H, (long long)c->N, (long long)c->F, (int)c->kind, c->bias, c->permuted,
           c->in_place, c->per_head, attn_dtype_name(c->xdt));
  /* forward */
  float *out = malloc(sizeof(float) * (size_t)(n + 1));
  tu_poison_f32(out, n);
  attn_tensor to = attn_tensor_view(out, ATTN_F32, 4, s4);
  const int in_place = c->in_place && c->xdt == ATTN_F32 && !c->permuted;
  attn_tensor *dst = in_place ? &tx : &to;
  CHECK_OK(ctx, attn_head_norm(ctx, dst, &tx, &tw, c->bias ? &tb : NULL, c->kind, c->eps));
  double num = 0, den = 0;
  int nan = 0;
  for (int64_t e = 0; e < n; e++) {
    const double got = in_place ? ((float *)xs)[e] : out[e];
    nan += isnan(got);
    num += (got - want[e]) * (got - want[e]), den += want[e] * want[e];
  }
  CHECK(!nan && sqrt(num / (den > 0 ? den : 1)) <= 1e-6, "%s: forward rel L2 %.3g", desc, sqrt(num / (den > 0 ? den : 1)));
  if (in_place) /* restore x for the backward */
    for (int64_t e = 0; e < n; e++) ((float *)xs)[e] = x[e];
  /* backward: against central differences of the double forward, for L = sum(g * y) */
  float *dx = malloc(sizeof(float) * (size_t)(n + 1)), *dw = malloc(sizeof(float) * (size_t)np);
  float *db = malloc(sizeof(float) * (size_t)np);
  tu_poison_f32(dx, n), tu_poison_f32(dw, np), tu_poison_f32(db, np);
  attn_tensor tdx = attn_tensor_view(dx, ATTN_F32, 4, s4), tg = attn_tensor_view(g, ATTN_F32, 4, s4);
  attn_tensor tdw = attn_tensor_view(dw, ATTN_F32, prank, s1), tdb = attn_tensor_view(db, ATTN_F32, prank, s1);
  CHECK_OK(ctx, attn_head_norm_backward(ctx, &tdx, &tdw, c->kind == ATTN_NORM_LAYER ? &tdb : NULL, &tg, &tx, &tw,
                                        c->kind, c->eps));
  double *yp = malloc(sizeof(double) * (size_t)c->F), *ym = malloc(sizeof(double) * (size_t)c->F);
  const double hstep = 1e-5;
  double en = 0, ed = 0, wn = 0, wdn = 0, bn = 0, bdn = 0;
  double *dwf = calloc((size_t)np, sizeof(double)), *dbf = calloc((size_t)np, sizeof(double));
  double *ones = malloc(sizeof(double) * (size_t)c->F);
  for (int64_t f = 0; f < c->F; f++) ones[f] = 1;
  for (int64_t row = 0; row < rows; row++) {
    double *xr = xd + row * c->F;
    const float *gr = g + row * c->F;
    const double *wr = wd + PARAMS_OF(row), *br = c->bias ? bd + PARAMS_OF(row) : NULL;
    for (int64_t f = 0; f < c->F; f++) { /* dx */
      const double keep = xr[f];
      xr[f] = keep + hstep;
      norm_row(yp, xr, wr, br, c->F, c->kind, c->eps);
      xr[f] = keep - hstep;
      norm_row(ym, xr, wr, br, c->F, c->kind, c->eps);
      xr[f] = keep;
      double fd = 0;
      for (int64_t k = 0; k < c->F; k++) fd += gr[k] * (yp[k] - ym[k]) / (2 * hstep);
      const double got = dx[row * c->F + f];
      en += (got - fd) * (got - fd), ed += fd * fd;
    }
    /* xhat (the normalised row: weight 1, no bias), then dL/dw_f = g_f xhat_f and dL/db_f = g_f,
     * from y = xhat s(w) + b with s' = 1 */
    norm_row(yp, xr, ones, NULL, c->F, c->kind == ATTN_NORM_LAYER ? ATTN_NORM_LAYER : ATTN_NORM_RMS, c->eps);
    for (int64_t f = 0; f < c->F; f++) {
      dwf[PARAMS_OF(row) + f] += gr[f] * yp[f];
      dbf[PARAMS_OF(row) + f] += gr[f];
    }
  }
#undef PARAMS_OF
  for (int64_t f = 0; f < np; f++) {
    wn += (dw[f] - dwf[f]) * (dw[f] - dwf[f]), wdn += dwf[f] * dwf[f];
    if (c->kind == ATTN_NORM_LAYER) bn += (db[f] - dbf[f]) * (db[f] - dbf[f]), bdn += dbf[f] * dbf[f];
  }
  CHECK(sqrt(en / (ed > 0 ? ed : 1)) <= 1e-4, "%s: dx rel L2 %.3g against central differences", desc, sqrt(en / (ed > 0 ? ed : 1)));
  CHECK(sqrt(wn / (wdn > 0 ? wdn : 1)) <= 1e-5, "%s: dweight rel L2 %.3g", desc, sqrt(wn / (wdn > 0 ? wdn : 1)));
  if (c->kind == ATTN_NORM_LAYER) CHECK(sqrt(bn / (bdn > 0 ? bdn : 1)) <= 1e-5, "%s: dbias rel L2 %.3g", desc, sqrt(bn / (bdn > 0 ? bdn : 1)));
  /* the same gradients, bitwise, on another thread count; and dx written over dout */
  float *dx2 = malloc(sizeof(float) * (size_t)(n + 1)), *dw2 = malloc(sizeof(float) * (size_t)np);
  memcpy(dx2, g, sizeof(float) * (size_t)n);
  attn_tensor tdx2 = attn_tensor_view(dx2, ATTN_F32, 4, s4), tdw2 = attn_tensor_view(dw2, ATTN_F32, prank, s1);
  attn_ctx_set_threads(ctx, attn_ctx_threads(ctx) == 1 ? 3 : 1);
  CHECK_OK(ctx, attn_head_norm_backward(ctx, &tdx2, &tdw2, NULL, &tdx2, &tx, &tw, c->kind, c->eps));
  CHECK(!memcmp(dx, dx2, sizeof(float) * (size_t)n) && !memcmp(dw, dw2, sizeof(float) * (size_t)np),
        "%s: the backward differs between thread counts (or in place over dout)", desc);
  free(x), free(g), free(w), free(b), free(xs), free(xd), free(want), free(wd), free(bd), free(out), free(dx);
  free(dw), free(db), free(yp), free(ym), free(dwf), free(dbf), free(dx2), free(dw2), free(ones);
}

/* The float64 path (the layer's ATTN_KERNEL_REF path): x, out, dout and dx in
 * double, values no float holds, so a rounding through float anywhere shows:
 * forward to 1e-13 of the formula, dx to 1e-8 of central differences. */
static void f64_case(attn_ctx *ctx, attn_norm_kind kind, int in_place, int seed) {
  enum { B = 2, H = 3, N = 4, F = 9, n = B * H * N * F, rows = B * H * N };
  tu_rng r = {(uint64_t)seed + 101};
  const int64_t s4[4] = {B, H, N, F}, s1[1] = {F};
  double x[n], y[n], want[n], g[n], dx[n], wd[F], bd[F], yp[F], ym[F];
  float w[F], b[F], dw[F], db[F];
  for (int i = 0; i < n; i++) x[i] = 2 * tu_uniform(&r) + 0.3 + 1e-12 * tu_uniform(&r), g[i] = tu_uniform(&r);
  for (int f = 0; f < F; f++) w[f] = (float)tu_uniform(&r), b[f] = (float)(0.5 * tu_uniform(&r)), wd[f] = w[f], bd[f] = b[f];
  const double *bias = kind == ATTN_NORM_LAYER ? bd : NULL;
  for (int row = 0; row < rows; row++) norm_row(want + row * F, x + row * F, wd, bias, F, kind, 1e-6);
  attn_tensor tx = attn_tensor_view(x, ATTN_F64, 4, s4), ty = attn_tensor_view(y, ATTN_F64, 4, s4);
  attn_tensor tw = attn_tensor_view(w, ATTN_F32, 1, s1), tb = attn_tensor_view(b, ATTN_F32, 1, s1);
  double keep[n];
  memcpy(keep, x, sizeof x);
  for (int i = 0; i < n; i++) y[i] = NAN;
  CHECK_OK(ctx, attn_head_norm(ctx, in_place ? &tx : &ty, &tx, &tw, bias ? &tb : NULL, kind, 1e-6));
  const double *got = in_place ? x : y;
  double e = 0;
  for (int i = 0; i < n; i++) e = fmax(e, isnan(got[i]) ? INFINITY : fabs(got[i] - want[i]));
  CHECK(e <= 1e-13, "f64 kind %d in place %d: forward max err %.3g", (int)kind, in_place, e);
  memcpy(x, keep, sizeof x);
  for (int i = 0; i < n; i++) dx[i] = NAN;
  for (int f = 0; f < F; f++) dw[f] = db[f] = NAN;
  attn_tensor tg = attn_tensor_view(g, ATTN_F64, 4, s4), tdx = attn_tensor_view(dx, ATTN_F64, 4, s4);
  attn_tensor tdw = attn_tensor_view(dw, ATTN_F32, 1, s1), tdb = attn_tensor_view(db, ATTN_F32, 1, s1);
  CHECK_OK(ctx, attn_head_norm_backward(ctx, &tdx, &tdw, kind == ATTN_NORM_LAYER ? &tdb : NULL, &tg, &tx, &tw, kind, 1e-6));
  double en = 0;
  for (int row = 0; row < rows; row++)
    for (int f = 0; f < F; f++) {
      double *xr = x + row * F;
      const double h = 1e-6, k0 = xr[f];
      xr[f] = k0 + h;
      norm_row(yp, xr, wd, bias, F, kind, 1e-6);
      xr[f] = k0 - h;
      norm_row(ym, xr, wd, bias, F, kind, 1e-6);
      xr[f] = k0;
      double fd = 0;
      for (int k = 0; k < F; k++) fd += g[row * F + k] * (yp[k] - ym[k]) / (2 * h);
      en = fmax(en, isnan(dx[row * F + f]) ? INFINITY : fabs(dx[row * F + f] - fd));
    }
  CHECK(en <= 1e-8, "f64 kind %d: dx max err %.3g against central differences", (int)kind, en);
  int finite = 1;
  for (int f = 0; f < F; f++) finite &= !isnan(dw[f]) && (kind != ATTN_NORM_LAYER || !isnan(db[f]));
  CHECK(finite, "f64 kind %d: parameter gradients written", (int)kind);
}

static void errors(attn_ctx *ctx) {
  float x[24], out[24], w[4], b[4];
  for (int i = 0; i < 24; i++) x[i] = (float)i, out[i] = -7;
  for (int i = 0; i < 4; i++) w[i] = 1, b[i] = 0;
  const int64_t s4[4] = {1, 2, 3, 4}, s1[1] = {4}, s3[1] = {3};
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 4, s4), to = attn_tensor_view(out, ATTN_F32, 4, s4);
  attn_tensor tw = attn_tensor_view(w, ATTN_F32, 1, s1), tb = attn_tensor_view(b, ATTN_F32, 1, s1);
  attn_tensor tw3 = attn_tensor_view(w, ATTN_F32, 1, s3), shifted = attn_tensor_view(x + 2, ATTN_F32, 4, s4);
  CHECK_ERR(ctx, attn_head_norm(ctx, &to, &tx, &tw, NULL, ATTN_NORM_RMS, 0), ATTN_E_INVALID, "eps");
  CHECK_ERR(ctx, attn_head_norm(ctx, &to, &tx, &tw, NULL, ATTN_NORM_RMS, NAN), ATTN_E_INVALID, "eps");
  CHECK_ERR(ctx, attn_head_norm(ctx, &to, &tx, &tw, &tb, ATTN_NORM_RMS, 1e-6), ATTN_E_INVALID, "LAYER");
  CHECK_ERR(ctx, attn_head_norm(ctx, &to, &tx, &tw3, NULL, ATTN_NORM_RMS, 1e-6), ATTN_E_SHAPE, "weight");
  float wide[12] = {0}, wide2[8] = {0};
  const int64_t s34[2] = {3, 4}, s24[2] = {2, 4};
  attn_tensor tw34 = attn_tensor_view(wide, ATTN_F32, 2, s34), tw24 = attn_tensor_view(wide2, ATTN_F32, 2, s24);
  CHECK_ERR(ctx, attn_head_norm(ctx, &to, &tx, &tw34, NULL, ATTN_NORM_RMS, 1e-6), ATTN_E_SHAPE, "[H, F]");
  CHECK_ERR(ctx, attn_head_norm(ctx, &to, &tx, &tw24, &tb, ATTN_NORM_LAYER, 1e-6), ATTN_E_SHAPE, "bias");
  CHECK_ERR(ctx, attn_head_norm_backward(ctx, &to, &tw, NULL, &tx, &tx, &tw24, ATTN_NORM_RMS, 1e-6), ATTN_E_SHAPE,
            "dweight");
  CHECK_ERR(ctx, attn_head_norm(ctx, &to, &tx, &tw, NULL, (attn_norm_kind)7, 1e-6), ATTN_E_INVALID, "kind");
  CHECK_ERR(ctx, attn_head_norm(ctx, &shifted, &tx, &tw, NULL, ATTN_NORM_RMS, 1e-6), ATTN_E_INVALID, "overlaps");
  int untouched = 1;
  for (int i = 0; i < 24; i++) untouched &= out[i] == -7;
  CHECK(untouched, "a refused call wrote out");
}

int main(void) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  tu_rng r = {31};
  const attn_dtype dts[3] = {ATTN_F32, ATTN_BF16, ATTN_F16};
  for (int seed = 0; seed < 60; seed++) {
    ncase c;
    c.B = tu_int(&r, 1, 2), c.H = tu_int(&r, 1, 3), c.N = tu_int(&r, 1, 9), c.F = tu_int(&r, 1, 70);
    c.kind = (attn_norm_kind)tu_int(&r, 0, 2);
    c.eps = tu_int(&r, 0, 1) ? 1e-6 : 1e-5;
    c.bias = c.kind == ATTN_NORM_LAYER && tu_int(&r, 0, 1);
    c.permuted = tu_int(&r, 0, 1), c.in_place = tu_int(&r, 0, 1);
    c.xdt = dts[tu_int(&r, 0, 2)];
    c.per_head = seed % 3 == 2;
    attn_ctx_set_threads(ctx, seed % 2 ? 3 : 1);
    run_case(ctx, &c, seed);
  }
  for (int kind = ATTN_NORM_RMS; kind <= ATTN_NORM_LAYER; kind++)
    for (int in_place = 0; in_place < 2; in_place++) {
      attn_ctx_set_threads(ctx, 1 + 2 * in_place);
      f64_case(ctx, (attn_norm_kind)kind, in_place, kind * 2 + in_place);
    }
  errors(ctx);
  attn_ctx_destroy(ctx);
  return tu_finish("test_norm");
}
