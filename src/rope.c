/* Rotary position embeddings: the one definition of the frequencies (read by
 * the fp32 rotation and the float64 oracle alike) and the rotation itself.
 * attn.h states the formulas; the tests write them out again independently. */
#include "internal.h"
#include "opts.h"
#include "engine/schedule.h"

#include <math.h>
#include <stdlib.h>

#define TWO_PI 6.283185307179586476925286766559

void attn_rope_opts_init(attn_rope_opts *opts) {
  if (!opts) return;
  memset(opts, 0, sizeof *opts);
  opts->size = sizeof *opts;
  opts->layout = ATTN_ROPE_HALF;
  opts->theta = 10000.0;
  opts->scaling = ATTN_ROPE_DEFAULT;
  opts->factor = 1.0;
  opts->low_freq_factor = 1.0;
  opts->high_freq_factor = 4.0;
  opts->beta_fast = 32.0;
  opts->beta_slow = 1.0;
  opts->attention_factor = NAN;
  opts->yarn_truncate = 1;
}

/* A validated call: shapes, the rotary dims and each pair's frequency. */
typedef struct rope_call {
  const attn_tensor *x;
  attn_tensor *out;
  const attn_rope_opts *o;
  int64_t B, H, N, D, r;
  double m;        /* the attention factor, times cos and sin */
  double *freq;    /* [r / 2] */
} rope_call;

/* YaRN's correction dim: the pair index whose wavelength fits `rotations` turns in P positions. */
static double yarn_dim(double rotations, double d, double theta, double P) {
  return d * log(P / (rotations * TWO_PI)) / (2.0 * log(theta));
}

/* freq[0 .. r/2) and the attention factor for opts, with L the call's largest position + 1. */
static void rope_frequencies(const attn_rope_opts *o, int64_t r, int64_t L, double *freq, double *m) {
  const double d = (double)r, P = (double)o->original_max_position, f = o->factor;
  const double len = (double)(o->seq_len > 0 ? o->seq_len : L); /* DYNAMIC's and LONGROPE's L */
  double theta = o->theta;
  *m = 1.0;
  if (o->scaling == ATTN_ROPE_DYNAMIC && len > P) theta *= pow(f * len / P - (f - 1.0), d / (d - 2.0));
  for (int64_t i = 0; i < r / 2; i++) freq[i] = pow(theta, -2.0 * (double)i / d);
  if (o->scaling == ATTN_ROPE_LINEAR) {
    for (int64_t i = 0; i < r / 2; i++) freq[i] /= f;
  } else if (o->scaling == ATTN_ROPE_LLAMA3) {
    const double low_wave = P / o->low_freq_factor, high_wave = P / o->high_freq_factor;
    for (int64_t i = 0; i < r / 2; i++) {
      const double wave = TWO_PI / freq[i];
      if (wave > low_wave) {
        freq[i] /= f;
      } else if (wave >= high_wave) {
        const double s = (P / wave - o->low_freq_factor) / (o->high_freq_factor - o->low_freq_factor);
        freq[i] = (1.0 - s) * freq[i] / f + s * freq[i];
      }
    }
  } else if (o->scaling == ATTN_ROPE_YARN) {
    double lo = yarn_dim(o->beta_fast, d, theta, P), hi = yarn_dim(o->beta_slow, d, theta, P);
    if (o->yarn_truncate) lo = floor(lo), hi = ceil(hi);
    lo = lo < 0 ? 0 : lo;
    hi = hi > d - 1 ? d - 1 : hi;
    if (hi == lo) hi += 0.001; /* a ramp of one step */
    for (int64_t i = 0; i < r / 2; i++) {
      double ramp = ((double)i - lo) / (hi - lo);
      ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
      const double keep = 1.0 - ramp; /* 1: the pair's frequency is kept (extrapolated), 0: divided */
      freq[i] = freq[i] / f * (1.0 - keep) + freq[i] * keep;
    }
    *m = isnan(o->attention_factor) ? (f <= 1.0 ? 1.0 : 0.1 * log(f) + 1.0) : o->attention_factor;
  } else if (o->scaling == ATTN_ROPE_LONGROPE) {
    const double *e = len > P ? o->long_factor : o->short_factor;
    for (int64_t i = 0; i < r / 2; i++) freq[i] /= e[i];
    *m = isnan(o->attention_factor) ? (f <= 1.0 ? 1.0 : sqrt(1.0 + log(f) / log(P))) : o->attention_factor;
  }
}

static int64_t position_of(const attn_rope_opts *o, int64_t N, int64_t b, int64_t n) {
  return o->positions ? o->positions[b * N + n] : o->position_offset + n;
}

/* Checks everything before anything is written; fills c (its freq from the caller's buffer). */
static attn_status rope_prepare(attn_ctx *ctx, rope_call *c, attn_rope_opts *given, attn_tensor *out,
                                const attn_tensor *x, const attn_rope_opts *opts, int oracle) {
  attn_status st;
  memset(c, 0, sizeof *c);
  attn_rope_opts_init(given);
  if (opts && (st = attn__read_sized(ctx, given, sizeof *given, opts, "opts", "attn_rope_opts_init"))) return st;
  const attn_rope_opts *o = given;
  if ((st = attn__check_tensor(ctx, x, "x", 4)) || (st = attn__check_tensor(ctx, out, "out", 4)) ||
      (st = attn__check_writable(ctx, out, "out")))
    return st;
  const int x_ok = x->dtype == ATTN_F32 || x->dtype == ATTN_F16 || x->dtype == ATTN_BF16 || (oracle && x->dtype == ATTN_F64);
  const int o_ok = out->dtype == ATTN_F32 || out->dtype == ATTN_F16 || out->dtype == ATTN_BF16 ||
                   (oracle && out->dtype == ATTN_F64);
  if (!x_ok || !o_ok)
    return attn__fail(ctx, ATTN_E_DTYPE, "attn_rope: x is %s and out %s; they take f32, f16 or bf16%s",
                      attn_dtype_name(x->dtype), attn_dtype_name(out->dtype), oracle ? " (or f64)" : "");
  for (int i = 0; i < 4; i++)
    if (x->shape[i] != out->shape[i])
      return attn__fail(ctx, ATTN_E_SHAPE, "attn_rope: out must have x's shape [B, H, N, D]");
  c->B = x->shape[0], c->H = x->shape[1], c->N = x->shape[2], c->D = x->shape[3];
  c->r = o->rotary_dim ? o->rotary_dim : c->D;
  if (o->rotary_dim < 0 || c->r > c->D || c->r % 2 || (c->r < 2 && c->D > 0))
    return attn__fail(ctx, ATTN_E_INVALID, "attn_rope: rotary_dim %lld must be even, from 2 to D = %lld (0 = D)",
                      (long long)o->rotary_dim, (long long)c->D);
  if ((int)o->layout < ATTN_ROPE_HALF || o->layout > ATTN_ROPE_INTERLEAVED)
    return attn__fail(ctx, ATTN_E_INVALID, "attn_rope: unknown layout %d", (int)o->layout);
  if ((int)o->scaling < ATTN_ROPE_DEFAULT || o->scaling > ATTN_ROPE_LONGROPE)
    return attn__fail(ctx, ATTN_E_INVALID, "attn_rope: unknown scaling %d", (int)o->scaling);
  if (!(o->theta > 1.0) || !isfinite(o->theta))
    return attn__fail(ctx, ATTN_E_INVALID, "attn_rope: theta must be finite and above 1, got %g", o->theta);
  if (o->scaling != ATTN_ROPE_DEFAULT && (!(o->factor > 0) || !isfinite(o->factor)))
    return attn__fail(ctx, ATTN_E_INVALID, "attn_rope: factor must be finite and positive, got %g", o->factor);
  if ((o->scaling == ATTN_ROPE_DYNAMIC || o->scaling == ATTN_ROPE_LLAMA3 || o->scaling == ATTN_ROPE_YARN ||
       o->scaling == ATTN_ROPE_LONGROPE) &&
      o->original_max_position < 1)
    return attn__fail(ctx, ATTN_E_INVALID, "attn_rope: this scaling needs original_max_position > 0, got %lld",
                      (long long)o->original_max_position);
  if (o->scaling == ATTN_ROPE_DYNAMIC && c->r < 4)
    return attn__fail(ctx, ATTN_E_INVALID, "attn_rope: dynamic scaling needs rotary_dim >= 4 (its exponent is r / (r - 2))");
  if (o->scaling == ATTN_ROPE_LLAMA3 &&
      !(o->low_freq_factor > 0 && o->high_freq_factor > o->low_freq_factor && isfinite(o->high_freq_factor)))
    return attn__fail(ctx, ATTN_E_INVALID, "attn_rope: llama3 needs 0 < low_freq_factor < high_freq_factor, got %g and %g",
                      o->low_freq_factor, o->high_freq_factor);
  if (o->scaling == ATTN_ROPE_YARN &&
      !(o->beta_fast > 0 && o->beta_slow > 0 && isfinite(o->beta_fast) && isfinite(o->beta_slow) &&
        (isnan(o->attention_factor) || (o->attention_factor > 0 && isfinite(o->attention_factor)))))
    return attn__fail(ctx, ATTN_E_INVALID, "attn_rope: yarn needs positive finite beta_fast, beta_slow and attention_factor");
  if (o->scaling == ATTN_ROPE_LONGROPE) {
    if (c->r / 2 > ATTN_ROPE_MAX_PAIRS)
      return attn__fail(ctx, ATTN_E_INVALID, "attn_rope: longrope holds factors for %d rotary pairs; rotary_dim %lld has %lld",
                        ATTN_ROPE_MAX_PAIRS, (long long)c->r, (long long)(c->r / 2));
    if (o->original_max_position < 2)
      return attn__fail(ctx, ATTN_E_INVALID, "attn_rope: longrope needs original_max_position > 1 (its m divides by ln P)");
    if (!isnan(o->attention_factor) && !(o->attention_factor > 0 && isfinite(o->attention_factor)))
      return attn__fail(ctx, ATTN_E_INVALID, "attn_rope: longrope's attention_factor must be positive and finite");
    for (int64_t i = 0; i < c->r / 2; i++)
      if (!(o->short_factor[i] > 0 && isfinite(o->short_factor[i]) && o->long_factor[i] > 0 &&
            isfinite(o->long_factor[i])))
        return attn__fail(ctx, ATTN_E_INVALID,
                          "attn_rope: longrope needs short_factor and long_factor finite and > 0 for each of the %lld "
                          "rotary pairs; pair %lld has %g and %g",
                          (long long)(c->r / 2), (long long)i, o->short_factor[i], o->long_factor[i]);
  }
  if (o->seq_len < 0) return attn__fail(ctx, ATTN_E_INVALID, "attn_rope: seq_len must be >= 0");
  int64_t L = 0; /* the largest position + 1 */
  for (int64_t b = 0; b < c->B; b++)
    for (int64_t n = 0; n < c->N; n++) {
      const int64_t pos = position_of(o, c->N, b, n);
      if (pos < 0 || pos > ((int64_t)1 << 52))
        return attn__fail(ctx, ATTN_E_INVALID, "attn_rope: position %lld of row %lld, token %lld is outside 0..2^52",
                          (long long)pos, (long long)b, (long long)n);
      if (pos + 1 > L) L = pos + 1;
    }
  if (attn_tensor_numel(x) > 0 && !(x->data == out->data && x->dtype == out->dtype &&
                                    !memcmp(x->strides, out->strides, sizeof x->strides))) {
    uintptr_t xl, xh, ol, oh;
    attn__extent(x, &xl, &xh);
    attn__extent(out, &ol, &oh);
    if (xl < oh && ol < xh) return attn__fail(ctx, ATTN_E_INVALID, "attn_rope: out overlaps x (other than being x itself)");
  }
  c->x = x, c->out = out, c->o = o;
  c->freq = malloc(sizeof(double) * (size_t)(c->r / 2 + 1));
  if (!c->freq) return attn__fail(ctx, ATTN_E_NOMEM, "attn_rope: out of memory");
  rope_frequencies(o, c->r, L, c->freq, &c->m);
  return ATTN_OK;
}

/* The two dims of pair i in a row: a and b. */
static inline void pair_dims(attn_rope_layout layout, int64_t r, int64_t i, int64_t *a, int64_t *b) {
  *a = layout == ATTN_ROPE_HALF ? i : 2 * i;
  *b = layout == ATTN_ROPE_HALF ? i + r / 2 : 2 * i + 1;
}

/* One item per token (b, n): its cos and sin (double, then f32), then every head's row. */
static int64_t rope_items(const void *arg, int64_t round) {
  (void)round;
  const rope_call *c = arg;
  return c->B * c->N;
}

static void rope_run(const void *arg, void *scratch, int64_t round, int64_t first, int64_t last) {
  (void)round;
  const rope_call *c = arg;
  const attn_tensor *x = c->x, *out = c->out;
  float *cs = scratch, *sn = cs + c->r / 2;
  const float sign = c->o->transpose ? -1.0f : 1.0f; /* R^T turns the other way */
  for (int64_t t = first; t < last; t++) {
    const int64_t b = t / c->N, n = t % c->N;
    const double pos = (double)position_of(c->o, c->N, b, n);
    for (int64_t i = 0; i < c->r / 2; i++) {
      const double ang = pos * c->freq[i];
      cs[i] = (float)(cos(ang) * c->m);
      sn[i] = sign * (float)(sin(ang) * c->m);
    }
    for (int64_t h = 0; h < c->H; h++) {
      const int64_t xo = b * x->strides[0] + h * x->strides[1] + n * x->strides[2];
      const int64_t oo = b * out->strides[0] + h * out->strides[1] + n * out->strides[2];
      const int64_t xs = x->strides[3], os = out->strides[3];
      for (int64_t i = 0; i < c->r / 2; i++) {
        int64_t da, db;
        pair_dims(c->o->layout, c->r, i, &da, &db);
        const float xa = attn__load_f32(x->data, x->dtype, xo + da * xs), xb = attn__load_f32(x->data, x->dtype, xo + db * xs);
        attn__store_f32(out->data, out->dtype, oo + da * os, xa * cs[i] - xb * sn[i]);
        attn__store_f32(out->data, out->dtype, oo + db * os, xb * cs[i] + xa * sn[i]);
      }
      if (x->data != out->data || x->dtype != out->dtype)
        for (int64_t d = c->r; d < c->D; d++)
          attn__store_f32(out->data, out->dtype, oo + d * os, attn__load_f32(x->data, x->dtype, xo + d * xs));
    }
  }
}

attn_status attn_rope(attn_ctx *ctx, attn_tensor *out, const attn_tensor *x, const attn_rope_opts *opts) {
  ATTN__ENTER(ctx);
  rope_call c;
  attn_rope_opts given;
  attn_status st = rope_prepare(ctx, &c, &given, out, x, opts, 0);
  if (st) return st;
  if (attn_tensor_numel(x) > 0) {
    static const attn__phase phases[] = {{"tokens", rope_items, rope_run, 0}};
    const attn__job job = {&c, 1, phases, 1, sizeof(float) * (size_t)(c.r + 1), NULL};
    const long long args[4] = {(long long)c.B * c.N, (long long)c.H, 0, 0};
    st = attn__schedule(ctx, "attn_rope (%lld tokens of %lld heads)", args,
                        attn__threads_for(ctx, 8.0 * (double)attn_tensor_numel(x)), &job);
  }
  free(c.freq);
  return st;
}

attn_status attn_rope_ref(attn_ctx *ctx, attn_tensor *out, const attn_tensor *x, const attn_rope_opts *opts) {
  ATTN__ENTER(ctx);
  rope_call c;
  attn_rope_opts given;
  attn_status st = rope_prepare(ctx, &c, &given, out, x, opts, 1);
  if (st) return st;
  const double sign = c.o->transpose ? -1.0 : 1.0;
  for (int64_t b = 0; b < c.B; b++)
    for (int64_t n = 0; n < c.N; n++) {
      const double pos = (double)position_of(c.o, c.N, b, n);
      for (int64_t h = 0; h < c.H; h++) {
        const int64_t xo = b * x->strides[0] + h * x->strides[1] + n * x->strides[2];
        const int64_t oo = b * out->strides[0] + h * out->strides[1] + n * out->strides[2];
        for (int64_t i = 0; i < c.r / 2; i++) {
          int64_t da, db;
          pair_dims(c.o->layout, c.r, i, &da, &db);
          const double cs = cos(pos * c.freq[i]) * c.m, sn = sign * sin(pos * c.freq[i]) * c.m;
          const double xa = attn__load(x->data, x->dtype, xo + da * x->strides[3]);
          const double xb = attn__load(x->data, x->dtype, xo + db * x->strides[3]);
          attn__store(out->data, out->dtype, oo + da * out->strides[3], xa * cs - xb * sn);
          attn__store(out->data, out->dtype, oo + db * out->strides[3], xb * cs + xa * sn);
        }
        for (int64_t d = c.r; d < c.D; d++)
          attn__store(out->data, out->dtype, oo + d * out->strides[3], attn__load(x->data, x->dtype, xo + d * x->strides[3]));
      }
    }
  free(c.freq);
  return ATTN_OK;
}
