/* QK-norm: RMSNorm (plain or Gemma's 1 + w) and LayerNorm over each row of a
 * head's features, forward and backward. Each row's statistics are taken in
 * double; rows are independent items of the scheduler, and the parameters'
 * gradients are summed over rows afterwards in row order, so no result
 * depends on the thread count. */
#include "internal.h"
#include "engine/schedule.h"

#include <math.h>
#include <stdlib.h>

typedef struct norm_call {
  const attn_tensor *x, *w, *b, *g; /* g: dout (backward) */
  attn_tensor *out;                  /* out (forward) or dx (backward) */
  attn_norm_kind kind;
  double eps;
  int64_t B, H, N, F;
  int per_head; /* w (and b) are [H, F]: each head its own */
} norm_call;

static int64_t row_offset(const attn_tensor *t, const norm_call *c, int64_t row) {
  const int64_t n = row % c->N, h = (row / c->N) % c->H, b = row / (c->N * c->H);
  return b * t->strides[0] + h * t->strides[1] + n * t->strides[2];
}

/* The row's centre (the mean for LAYER, else 0) and 1 / sqrt(mean((x - centre)^2) + eps). */
static void row_stats(const norm_call *c, int64_t xo, double *centre, double *inv) {
  const attn_tensor *x = c->x;
  double mean = 0, sq = 0;
  if (c->kind == ATTN_NORM_LAYER) {
    for (int64_t f = 0; f < c->F; f++) mean += attn__load(x->data, x->dtype, xo + f * x->strides[3]);
    mean /= (double)c->F;
  }
  for (int64_t f = 0; f < c->F; f++) {
    const double d = attn__load(x->data, x->dtype, xo + f * x->strides[3]) - mean;
    sq += d * d;
  }
  *centre = mean;
  *inv = 1.0 / sqrt(sq / (double)c->F + c->eps);
}

/* Entry f of head h's weights (or biases): [F] shared, or row h of [H, F]. */
static double param_at(const attn_tensor *p, const norm_call *c, int64_t h, int64_t f) {
  return ((const float *)p->data)[c->per_head ? h * p->strides[0] + f * p->strides[1] : f * p->strides[0]];
}

static double scale_of(const norm_call *c, int64_t h, int64_t f) {
  const double w = param_at(c->w, c, h, f);
  return c->kind == ATTN_NORM_RMS_PLUS_ONE ? 1.0 + w : w;
}

static int64_t head_of(const norm_call *c, int64_t row) { return (row / c->N) % c->H; }

static int64_t rows_items(const void *arg, int64_t round) {
  (void)round;
  const norm_call *c = arg;
  return c->B * c->H * c->N;
}

static void forward_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)scratch, (void)round;
  const norm_call *c = arg;
  const attn_tensor *x = c->x;
  attn_tensor *o = c->out;
  for (int64_t row = first; row < last; row++) {
    const int64_t xo = row_offset(x, c, row), oo = row_offset(o, c, row), h = head_of(c, row);
    double centre, inv;
    row_stats(c, xo, &centre, &inv);
    for (int64_t f = 0; f < c->F; f++) {
      const double xh = (attn__load(x->data, x->dtype, xo + f * x->strides[3]) - centre) * inv;
      const double bias = c->b ? param_at(c->b, c, h, f) : 0.0;
      attn__store(o->data, o->dtype, oo + f * o->strides[3], xh * scale_of(c, h, f) + bias); /* f64 keeps every bit */
    }
  }
}

/* dx of one row: with u = g * scale and xh the normalised x,
 *   RMS:   dx = inv (u - xh mean(u xh))
 *   LAYER: dx = inv (u - mean(u) - xh mean(u xh)) */
static void backward_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)round;
  const norm_call *c = arg;
  const attn_tensor *x = c->x, *g = c->g;
  attn_tensor *dx = c->out;
  double *u = scratch;
  for (int64_t row = first; row < last; row++) {
    const int64_t xo = row_offset(x, c, row), go = row_offset(g, c, row), dxo = row_offset(dx, c, row);
    const int64_t h = head_of(c, row);
    double centre, inv, mu = 0, mux = 0;
    row_stats(c, xo, &centre, &inv);
    for (int64_t f = 0; f < c->F; f++) {
      const double xh = (attn__load(x->data, x->dtype, xo + f * x->strides[3]) - centre) * inv;
      u[f] = attn__load(g->data, g->dtype, go + f * g->strides[3]) * scale_of(c, h, f);
      mu += u[f];
      mux += u[f] * xh;
    }
    mu = c->kind == ATTN_NORM_LAYER ? mu / (double)c->F : 0.0;
    mux /= (double)c->F;
    for (int64_t f = 0; f < c->F; f++) { /* dout's row is read above, so dx may be dout */
      const double xh = (attn__load(x->data, x->dtype, xo + f * x->strides[3]) - centre) * inv;
      attn__store(dx->data, dx->dtype, dxo + f * dx->strides[3], inv * (u[f] - mu - xh * mux));
    }
  }
}

/* a and b are the same view (in place) or share no byte. */
static attn_status identical_or_apart(attn_ctx *ctx, const attn_tensor *a, const attn_tensor *b, const char *fn,
                                      const char *an, const char *bn) {
  if (attn_tensor_numel(a) == 0 || attn_tensor_numel(b) == 0) return ATTN_OK;
  if (a->data == b->data && a->dtype == b->dtype && !memcmp(a->strides, b->strides, sizeof a->strides)) return ATTN_OK;
  uintptr_t al, ah, bl, bh;
  attn__extent(a, &al, &ah);
  attn__extent(b, &bl, &bh);
  if (al < bh && bl < ah) return attn__fail(ctx, ATTN_E_INVALID, "%s: %s overlaps %s (other than being it)", fn, an, bn);
  return ATTN_OK;
}

static attn_status norm_prepare(attn_ctx *ctx, norm_call *c, attn_tensor *out, const attn_tensor *x,
                                const attn_tensor *w, const attn_tensor *b, attn_norm_kind kind, double eps,
                                const char *fn) {
  attn_status st;
  memset(c, 0, sizeof *c);
  if ((st = attn__check_tensor(ctx, x, "x", 4)) || (st = attn__check_tensor(ctx, out, "out", 4)) ||
      (st = attn__check_writable(ctx, out, "out")) || (st = attn__check_tensor(ctx, w, "weight", w && w->rank == 2 ? 2 : 1)) ||
      (b && (st = attn__check_tensor(ctx, b, "bias", w->rank))))
    return st;
  if ((int)kind < ATTN_NORM_RMS || kind > ATTN_NORM_LAYER) return attn__fail(ctx, ATTN_E_INVALID, "%s: unknown kind %d", fn, (int)kind);
  if (!(eps > 0) || !isfinite(eps)) return attn__fail(ctx, ATTN_E_INVALID, "%s: eps must be finite and > 0, got %g", fn, eps);
  if (b && kind != ATTN_NORM_LAYER) return attn__fail(ctx, ATTN_E_INVALID, "%s: a bias goes with LAYER only", fn);
  if (!attn__is_float(x->dtype) || !attn__is_float(out->dtype))
    return attn__fail(ctx, ATTN_E_DTYPE, "%s: x and out take f32, f64, f16 or bf16, got %s and %s", fn,
                      attn_dtype_name(x->dtype), attn_dtype_name(out->dtype));
  if (w->dtype != ATTN_F32 || (b && b->dtype != ATTN_F32))
    return attn__fail(ctx, ATTN_E_DTYPE, "%s: weight and bias must be f32", fn);
  for (int i = 0; i < 4; i++)
    if (out->shape[i] != x->shape[i]) return attn__fail(ctx, ATTN_E_SHAPE, "%s: out must have x's shape", fn);
  c->B = x->shape[0], c->H = x->shape[1], c->N = x->shape[2], c->F = x->shape[3];
  c->per_head = w->rank == 2;
  const int64_t lead = c->per_head ? c->H : c->F;
  if (w->shape[0] != lead || (c->per_head && w->shape[1] != c->F) ||
      (b && (b->shape[0] != lead || (c->per_head && b->shape[1] != c->F))))
    return attn__fail(ctx, ATTN_E_SHAPE, "%s: weight and bias must be [F] = [%lld] or [H, F] = [%lld, %lld]", fn,
                      (long long)c->F, (long long)c->H, (long long)c->F);
  if ((st = identical_or_apart(ctx, out, x, fn, "out", "x"))) return st;
  c->x = x, c->w = w, c->b = b, c->out = out, c->kind = kind, c->eps = eps;
  return ATTN_OK;
}

attn_status attn_head_norm(attn_ctx *ctx, attn_tensor *out, const attn_tensor *x, const attn_tensor *weight,
                           const attn_tensor *bias, attn_norm_kind kind, double eps) {
  ATTN__ENTER(ctx);
  norm_call c;
  attn_status st = norm_prepare(ctx, &c, out, x, weight, bias, kind, eps, "attn_head_norm");
  if (st || attn_tensor_numel(x) == 0) return st;
  static const attn__phase phases[] = {{"rows", rows_items, forward_run, 0}};
  const attn__job job = {&c, 1, phases, 1, 0, NULL};
  const long long args[4] = {(long long)(c.B * c.H * c.N), (long long)c.F, 0, 0};
  return attn__schedule(ctx, "attn_head_norm (%lld rows of %lld)", args,
                        attn__threads_for(ctx, 8.0 * (double)attn_tensor_numel(x)), &job);
}

attn_status attn_head_norm_backward(attn_ctx *ctx, attn_tensor *dx, attn_tensor *dweight, attn_tensor *dbias,
                                    const attn_tensor *dout, const attn_tensor *x, const attn_tensor *weight,
                                    attn_norm_kind kind, double eps) {
  ATTN__ENTER(ctx);
  norm_call c;
  attn_status st = norm_prepare(ctx, &c, dx, x, weight, NULL, kind, eps, "attn_head_norm_backward");
  if (st) return st;
  if ((st = attn__check_tensor(ctx, dout, "dout", 4))) return st;
  for (int i = 0; i < 4; i++)
    if (dout->shape[i] != x->shape[i]) return attn__fail(ctx, ATTN_E_SHAPE, "attn_head_norm_backward: dout must have x's shape");
  if ((dx->dtype != ATTN_F32 && dx->dtype != ATTN_F64) || !attn__is_float(dout->dtype))
    return attn__fail(ctx, ATTN_E_DTYPE, "attn_head_norm_backward: dx must be f32 or f64 and dout f32, f64, f16 or bf16");
  if ((st = identical_or_apart(ctx, dx, dout, "attn_head_norm_backward", "dx", "dout"))) return st;
  attn_tensor *pg[2] = {dweight, dbias};
  for (int i = 0; i < 2; i++)
    if (pg[i] && ((st = attn__check_tensor(ctx, pg[i], i ? "dbias" : "dweight", weight->rank)) ||
                  (st = attn__check_writable(ctx, pg[i], i ? "dbias" : "dweight")) || pg[i]->dtype != ATTN_F32 ||
                  pg[i]->rank != weight->rank || pg[i]->shape[0] != weight->shape[0] ||
                  (c.per_head && pg[i]->shape[1] != c.F)))
      return st ? st : attn__fail(ctx, ATTN_E_SHAPE, "attn_head_norm_backward: %s must be f32 and shaped as weight",
                                  i ? "dbias" : "dweight");
  if (dbias && kind != ATTN_NORM_LAYER)
    return attn__fail(ctx, ATTN_E_INVALID, "attn_head_norm_backward: dbias goes with LAYER only");
  c.g = dout;
  const int64_t rows = c.B * c.H * c.N;
  /* the parameters' gradients first (serially, in row order, in double): dx may overwrite dout */
  const int64_t sets = c.per_head ? c.H : 1, n = sets * c.F; /* the weight holds n floats */
  double *acc = calloc((size_t)(2 * n + 1), sizeof(double));
  if (!acc) return attn__fail(ctx, ATTN_E_NOMEM, "attn_head_norm_backward: out of memory");
  for (int64_t row = 0; row < rows && (dweight || dbias); row++) {
    const int64_t xo = row_offset(x, &c, row), go = row_offset(dout, &c, row);
    double *aw = acc + (c.per_head ? head_of(&c, row) * c.F : 0), *ab = aw + n;
    double centre, inv;
    row_stats(&c, xo, &centre, &inv);
    for (int64_t f = 0; f < c.F; f++) {
      const double gf = attn__load(dout->data, dout->dtype, go + f * dout->strides[3]);
      aw[f] += gf * (attn__load(x->data, x->dtype, xo + f * x->strides[3]) - centre) * inv;
      ab[f] += gf;
    }
  }
  for (int64_t s = 0; s < sets; s++)
    for (int64_t f = 0; f < c.F; f++) {
      const int64_t i = s * c.F + f;
      if (dweight) ((float *)dweight->data)[s * (c.per_head ? dweight->strides[0] : 0) +
                                            f * dweight->strides[c.per_head]] = (float)acc[i];
      if (dbias) ((float *)dbias->data)[s * (c.per_head ? dbias->strides[0] : 0) + f * dbias->strides[c.per_head]] =
          (float)acc[n + i];
    }
  free(acc);
  if (rows == 0 || c.F == 0) return ATTN_OK;
  static const attn__phase phases[] = {{"rows", rows_items, backward_run, 0}};
  const attn__job job = {&c, 1, phases, 1, sizeof(double) * (size_t)c.F, NULL};
  const long long args[4] = {(long long)rows, (long long)c.F, 0, 0};
  return attn__schedule(ctx, "attn_head_norm_backward (%lld rows of %lld)", args,
                        attn__threads_for(ctx, 16.0 * (double)attn_tensor_numel(x)), &job);
}
