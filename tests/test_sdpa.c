/* SDPA: every kernel against the float64 oracle over randomized shapes,
 * strides, masks, GQA and causal modes; thread-count determinism; the
 * documented edge cases (fully masked rows, NaN/Inf, no keys in any input
 * dtype); the oracle itself on hand-computed answers. Seeds are fixed and
 * printed on failure. */
#include "testutil.h"

/* A rank-4 f32 view of shape s in one of three layouts:
 * 0 contiguous, 1 dims 1 and 2 swapped in memory (batch-first [B, N, H, D]), 2 padded and reversed strides. */
static attn_tensor make4(arena *a, tu_rng *r, const int64_t s[4], int layout, attn_dtype dt) {
  int order[4] = {0, 1, 2, 3}; /* memory order, outermost first */
  int64_t pad[4] = {0, 0, 0, 0};
  if (layout == 1) { order[1] = 2; order[2] = 1; }
  if (layout == 2) {
    order[0] = 3; order[1] = 1; order[2] = 0; order[3] = 2;
    for (int i = 0; i < 4; i++) pad[i] = tu_int(r, 0, 2);
  }
  attn_tensor t;
  memset(&t, 0, sizeof t);
  t.dtype = dt;
  t.rank = 4;
  int64_t stride = 1;
  for (int m = 3; m >= 0; m--) {
    const int d = order[m];
    t.shape[d] = s[d];
    t.strides[d] = stride;
    stride *= s[d] + pad[d];
  }
  const size_t es = attn_dtype_size(dt);
  t.data = arena_alloc(a, (size_t)stride * es);
  for (int64_t i = 0; i < stride; i++) {
    if (dt == ATTN_F32) ((float *)t.data)[i] = (float)tu_uniform(r);
    else ((uint8_t *)t.data)[i] = 0;
  }
  return t;
}

typedef struct sdpa_case {
  int64_t B, Hq, Hk, Nq, Nk, D, Dv;
  int layout, causal, mask_mode, mask_kind, kpm, want_w, want_lse, scale_kind;
} sdpa_case;

static void describe(const sdpa_case *c, char *buf, size_t n) {
  snprintf(buf, n, "B=%lld Hq=%lld Hk=%lld Nq=%lld Nk=%lld D=%lld Dv=%lld layout=%d causal=%d mask=%d/%d kpm=%d",
           (long long)c->B, (long long)c->Hq, (long long)c->Hk, (long long)c->Nq, (long long)c->Nk, (long long)c->D,
           (long long)c->Dv, c->layout, c->causal, c->mask_mode, c->mask_kind, c->kpm);
}

/* Builds a mask of one of several broadcast shapes for [B, Hq, Nq, Nk]. */
static attn_tensor make_mask(arena *a, tu_rng *r, const sdpa_case *c) {
  int64_t full[4] = {c->B, c->Hq, c->Nq, c->Nk};
  attn_tensor m;
  const attn_dtype dt = c->mask_mode <= ATTN_MASK_MASKED ? ATTN_BOOL : ATTN_F32;
  int64_t s[4];
  for (int i = 0; i < 4; i++) s[i] = full[i];
  switch (c->mask_kind) {
    case 0: s[0] = 1; s[1] = 1; break; /* [1, 1, Nq, Nk] */
    case 1: s[1] = 1; break;           /* [B, 1, Nq, Nk] */
    case 2: s[2] = 1; break;           /* [B, H, 1, Nk] */
    default: break;                    /* full */
  }
  m = make4(a, r, s, c->mask_kind == 3 ? 2 : 0, dt);
  /* c->mask_kind 4: a rank-2 [Nq, Nk] view */
  for (int64_t i0 = 0; i0 < s[0]; i0++)
    for (int64_t i1 = 0; i1 < s[1]; i1++)
      for (int64_t i2 = 0; i2 < s[2]; i2++)
        for (int64_t j = 0; j < s[3]; j++) {
          const int64_t o = off4(&m, i0, i1, i2, j);
          const int masked = tu_int(r, 0, 99) < 30;
          switch (c->mask_mode) {
            case ATTN_MASK_KEEP: ((uint8_t *)m.data)[o] = !masked; break;
            case ATTN_MASK_MASKED: ((uint8_t *)m.data)[o] = (uint8_t)masked; break;
            case ATTN_MASK_ADDITIVE:
              ((float *)m.data)[o] = masked ? -INFINITY : (float)(2 * tu_uniform(r));
              break;
            case ATTN_MASK_SEED: ((float *)m.data)[o] = (float)(masked && j > 0); break; /* key 0 always kept */
          }
        }
  if (c->mask_kind == 4) {
    m.rank = 2;
    m.shape[0] = m.shape[2]; m.strides[0] = m.strides[2];
    m.shape[1] = m.shape[3]; m.strides[1] = m.strides[3];
  } else {
    for (int i = 0; i < 4; i++) m.shape[i] = s[i];
  }
  return m;
}

static double *run_ref(attn_ctx *ctx, attn_tensor *q, attn_tensor *k, attn_tensor *v, attn_sdpa_opts o,
                       const sdpa_case *c, double **w_ref, double **lse_ref) {
  int64_t os[4] = {c->B, c->Hq, c->Nq, c->Dv}, ws[4] = {c->B, c->Hq, c->Nq, c->Nk}, ls[3] = {c->B, c->Hq, c->Nq};
  double *out = malloc((size_t)(c->B * c->Hq * c->Nq * c->Dv + 1) * sizeof(double));
  *w_ref = malloc((size_t)(c->B * c->Hq * c->Nq * c->Nk + 1) * sizeof(double));
  *lse_ref = malloc((size_t)(c->B * c->Hq * c->Nq + 1) * sizeof(double));
  attn_tensor to = attn_tensor_view(out, ATTN_F64, 4, os), tw = attn_tensor_view(*w_ref, ATTN_F64, 4, ws);
  attn_tensor tl = attn_tensor_view(*lse_ref, ATTN_F64, 3, ls);
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &to, &tl, &tw, q, k, v, &o));
  return out;
}

/* Runs one randomized case on every kernel and thread count; returns 0 if all agree. */
static void random_case(attn_ctx *ctx, uint64_t seed) {
  tu_rng r = {seed};
  arena a = {{0}, 0};
  sdpa_case c;
  c.B = tu_int(&r, 1, 2);
  c.Hk = tu_int(&r, 1, 3);
  c.Hq = c.Hk * tu_int(&r, 1, 3);
  c.Nq = tu_int(&r, 1, 40);
  c.Nk = tu_int(&r, 0, 9) == 0 ? tu_int(&r, 0, 3) : tu_int(&r, 1, 45);
  static const int64_t dims[] = {1, 3, 8, 16, 17, 32, 64, 80};
  c.D = dims[tu_int(&r, 0, 7)];
  c.Dv = tu_int(&r, 0, 3) ? c.D : dims[tu_int(&r, 0, 7)];
  c.layout = (int)tu_int(&r, 0, 2);
  c.causal = (int)tu_int(&r, 0, 2);
  c.mask_mode = (int)tu_int(&r, -1, 3);
  c.mask_kind = (int)tu_int(&r, 0, 4);
  c.kpm = tu_int(&r, 0, 3) == 0 && c.mask_mode != ATTN_MASK_SEED; /* seed rows must keep a visible key */
  c.want_w = (int)tu_int(&r, 0, 1);
  c.want_lse = (int)tu_int(&r, 0, 1);
  c.scale_kind = (int)tu_int(&r, 0, 2);
  char desc[256];
  describe(&c, desc, sizeof desc);

  int64_t qs[4] = {c.B, c.Hq, c.Nq, c.D}, ks[4] = {c.B, c.Hk, c.Nk, c.D}, vs[4] = {c.B, c.Hk, c.Nk, c.Dv};
  attn_tensor q = make4(&a, &r, qs, c.layout, ATTN_F32), k = make4(&a, &r, ks, c.layout, ATTN_F32);
  attn_tensor v = make4(&a, &r, vs, c.layout, ATTN_F32);
  /* Larger logits than uniform inputs give, so the softmax is not nearly flat. */
  for (int64_t i = 0; i < c.B * c.Hq * c.Nq * c.D; i++) ((float *)q.data)[i] *= 3.0f;
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.causal = (attn_causal)c.causal;
  if (c.scale_kind == 1) o.scale = 0.3;
  attn_tensor mask, kpm;
  if (c.mask_mode >= 0) {
    mask = make_mask(&a, &r, &c);
    o.mask = &mask;
    o.mask_mode = (attn_mask_mode)c.mask_mode;
  }
  if (c.kpm) {
    uint8_t *kp = arena_alloc(&a, (size_t)(c.B * c.Nk + 1));
    for (int64_t i = 0; i < c.B * c.Nk; i++) kp[i] = tu_int(&r, 0, 99) < 20;
    int64_t s[2] = {c.B, c.Nk};
    kpm = attn_tensor_view(kp, ATTN_BOOL, 2, s);
    o.key_padding = &kpm;
  }
  double *w_ref, *lse_ref;
  double *out_ref = run_ref(ctx, &q, &k, &v, o, &c, &w_ref, &lse_ref);

  const int64_t no = c.B * c.Hq * c.Nq * c.Dv, nw = c.B * c.Hq * c.Nq * c.Nk, nl = c.B * c.Hq * c.Nq;
  float *first = NULL;
  static const attn_kernel kernels[] = {ATTN_KERNEL_C, ATTN_KERNEL_AVX2, ATTN_KERNEL_AVX512};
  for (size_t ki = 0; ki < sizeof kernels / sizeof kernels[0]; ki++) {
    if (!attn_kernel_supported(kernels[ki])) continue;
    for (int threads = 1; threads <= 3; threads++) {
      attn_ctx_set_kernel(ctx, kernels[ki]);
      attn_ctx_set_threads(ctx, threads);
      int64_t os[4] = {c.B, c.Hq, c.Nq, c.Dv}, ws[4] = {c.B, c.Hq, c.Nq, c.Nk}, ls[3] = {c.B, c.Hq, c.Nq};
      attn_tensor out = make4(&a, &r, os, c.layout, ATTN_F32);
      attn_tensor w = make4(&a, &r, ws, 0, ATTN_F32);
      float *lse = arena_alloc(&a, (size_t)(nl + 1) * sizeof(float));
      attn_tensor tl = attn_tensor_view(lse, ATTN_F32, 3, ls);
      tu_poison_f32(out.data, no);
      tu_poison_f32(w.data, nw);
      tu_poison_f32(lse, nl);
      attn_sdpa_opts of = o;
      attn_status st = attn_sdpa(ctx, &out, c.want_lse ? &tl : NULL, c.want_w ? &w : NULL, &q, &k, &v, &of);
      CHECK(st == ATTN_OK, "seed %llu (%s) kernel %s: %s", (unsigned long long)seed, desc,
            attn_kernel_name(kernels[ki]), attn_ctx_error(ctx));
      if (st) continue;
      double *got = tu_to_f64(&out);
      double e = tu_rel_l2(got, out_ref, no);
      CHECK(e <= 1e-5 && tu_count_nan(got, no) == 0, "seed %llu (%s) kernel %s threads %d: out rel err %.3g, %d NaN",
            (unsigned long long)seed, desc, attn_kernel_name(kernels[ki]), threads, e, tu_count_nan(got, no));
      if (c.want_w) {
        double *gw = tu_to_f64(&w);
        double ew = tu_rel_l2(gw, w_ref, nw);
        CHECK(ew <= 1e-5 && tu_count_nan(gw, nw) == 0, "seed %llu (%s): weights rel err %.3g",
              (unsigned long long)seed, desc, ew);
        free(gw);
      }
      if (c.want_lse) {
        int bad = 0;
        for (int64_t i = 0; i < nl; i++) {
          if (isinf(lse_ref[i])) bad += !(isinf(lse[i]) && lse[i] < 0);
          else bad += !(fabs(lse[i] - lse_ref[i]) <= 1e-5 * (1 + fabs(lse_ref[i])));
        }
        CHECK(bad == 0, "seed %llu (%s): %d lse values differ", (unsigned long long)seed, desc, bad);
      }
      /* The same kernel must give the same bits whatever the thread count. */
      float *flat = arena_alloc(&a, (size_t)(no + 1) * sizeof(float));
      for (int64_t i = 0; i < no; i++) flat[i] = (float)got[i];
      if (!first) first = flat;
      else CHECK(memcmp(first, flat, (size_t)no * sizeof(float)) == 0, "seed %llu (%s): threads %d changed the bits",
                 (unsigned long long)seed, desc, threads);
      free(got);
    }
    first = NULL;
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  attn_ctx_set_threads(ctx, 0);
  free(out_ref);
  free(w_ref);
  free(lse_ref);
  arena_free(&a);
}

/* The oracle on answers worked out by hand. */
static void oracle_by_hand(attn_ctx *ctx) {
  /* one query, two keys: logits (q.k)*scale = [1, 0] * 1 -> weights [e/(e+1), 1/(e+1)] */
  double q[2] = {1, 0}, k[4] = {1, 0, 0, 1}, v[4] = {10, 0, 0, 20}, out[2], w[2], lse[1];
  int64_t qs[4] = {1, 1, 1, 2}, ks[4] = {1, 1, 2, 2}, ls[3] = {1, 1, 1}, ws[4] = {1, 1, 1, 2};
  attn_tensor tq = attn_tensor_view(q, ATTN_F64, 4, qs), tk = attn_tensor_view(k, ATTN_F64, 4, ks);
  attn_tensor tv = attn_tensor_view(v, ATTN_F64, 4, ks), to = attn_tensor_view(out, ATTN_F64, 4, qs);
  attn_tensor tw = attn_tensor_view(w, ATTN_F64, 4, ws), tl = attn_tensor_view(lse, ATTN_F64, 3, ls);
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.scale = 1.0;
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &to, &tl, &tw, &tq, &tk, &tv, &o));
  const double e = exp(1.0), p0 = e / (e + 1), p1 = 1 / (e + 1);
  CHECK(fabs(w[0] - p0) < 1e-15 && fabs(w[1] - p1) < 1e-15, "weights %g %g", w[0], w[1]);
  CHECK(fabs(out[0] - 10 * p0) < 1e-14 && fabs(out[1] - 20 * p1) < 1e-14, "out %g %g", out[0], out[1]);
  CHECK(fabs(lse[0] - log(e + 1)) < 1e-15, "lse %g", lse[0]);
  /* default scale is 1/sqrt(D): D = 2 */
  o.scale = NAN;
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &to, &tl, &tw, &tq, &tk, &tv, &o));
  const double s = 1 / sqrt(2.0), z = exp(s) + 1;
  CHECK(fabs(w[0] - exp(s) / z) < 1e-15, "default scale weight %g", w[0]);
  /* top-left causal: query 0 sees key 0 only */
  o.causal = ATTN_CAUSAL_TOP_LEFT;
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &to, &tl, &tw, &tq, &tk, &tv, &o));
  CHECK(w[0] == 1 && w[1] == 0 && out[0] == 10 && out[1] == 0, "top-left causal %g %g", w[0], w[1]);
  /* bottom-right with Nq = 1, Nk = 2: the last query sees every key */
  o.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &to, &tl, &tw, &tq, &tk, &tv, &o));
  CHECK(fabs(w[0] - exp(s) / z) < 1e-15, "bottom-right causal %g", w[0]);
}

/* Fully masked rows, NaN and Inf, and the four mask modes saying the same thing.
 * ctx is either a default context (these few rows go to the decode kernel) or
 * one with the decode kernel off (the blocked kernel): main runs both. */
static void edge_cases(attn_ctx *ctx) {
  enum { N = 5, D = 4 };
  float q[N * D], k[N * D], v[N * D], out[N * D], w[N * N], lse[N];
  tu_rng r = {99};
  tu_fill_f32(&r, q, N * D, 1);
  tu_fill_f32(&r, k, N * D, 1);
  tu_fill_f32(&r, v, N * D, 1);
  int64_t s4[4] = {1, 1, N, D}, m2[2] = {N, N}, w4[4] = {1, 1, N, N}, l3[3] = {1, 1, N};
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, s4), tk = attn_tensor_view(k, ATTN_F32, 4, s4);
  attn_tensor tv = attn_tensor_view(v, ATTN_F32, 4, s4), to = attn_tensor_view(out, ATTN_F32, 4, s4);
  attn_tensor tw = attn_tensor_view(w, ATTN_F32, 4, w4), tl = attn_tensor_view(lse, ATTN_F32, 3, l3);
  uint8_t keep[N * N], masked[N * N];
  float additive[N * N], outs[4][N * D];
  for (int i = 0; i < N * N; i++) {
    keep[i] = (i % 3) != 0 && i / N != 2; /* row 2 keeps nothing */
    masked[i] = !keep[i];
    additive[i] = keep[i] ? 0.0f : -INFINITY;
  }
  attn_tensor mk = attn_tensor_view(keep, ATTN_BOOL, 2, m2), mm = attn_tensor_view(masked, ATTN_U8, 2, m2);
  attn_tensor ma = attn_tensor_view(additive, ATTN_F32, 2, m2);
  const attn_kernel kernels[] = {ATTN_KERNEL_REF, ATTN_KERNEL_C, ATTN_KERNEL_AVX2, ATTN_KERNEL_AVX512};
  for (int ki = 0; ki < 4; ki++) {
    if (!attn_kernel_supported(kernels[ki])) continue;
    attn_ctx_set_kernel(ctx, kernels[ki]);
    for (int mode = 0; mode < 3; mode++) {
      attn_sdpa_opts o;
      attn_sdpa_opts_init(&o);
      o.mask = mode == 0 ? &mk : mode == 1 ? &mm : &ma;
      o.mask_mode = (attn_mask_mode)mode;
      tu_poison_f32(out, N * D);
      tu_poison_f32(w, N * N);
      if (kernels[ki] == ATTN_KERNEL_REF) {
        /* f32 outputs from the oracle: the same contract */
        CHECK_OK(ctx, attn_sdpa_ref(ctx, &to, &tl, &tw, &tq, &tk, &tv, &o));
      } else {
        CHECK_OK(ctx, attn_sdpa(ctx, &to, &tl, &tw, &tq, &tk, &tv, &o));
      }
      int zeros = 1;
      for (int c = 0; c < D; c++) zeros &= out[2 * D + c] == 0;
      for (int j = 0; j < N; j++) zeros &= w[2 * N + j] == 0;
      CHECK(zeros && isinf(lse[2]) && lse[2] < 0, "kernel %s mode %d: a fully masked row must give zeros and lse -inf",
            attn_kernel_name(kernels[ki]), mode);
      int nan = 0;
      for (int i = 0; i < N * D; i++) nan += isnan(out[i]) != 0;
      CHECK(nan == 0, "kernel %s mode %d: %d NaN", attn_kernel_name(kernels[ki]), mode, nan);
      memcpy(outs[mode], out, sizeof out);
    }
    CHECK(!memcmp(outs[0], outs[1], sizeof out[0] * N * D) && !memcmp(outs[0], outs[2], sizeof out[0] * N * D),
          "kernel %s: keep, masked and additive -inf masks disagree", attn_kernel_name(kernels[ki]));

    /* NaN in one query row reaches that row only; Inf in a key makes NaN or Inf, never a crash. */
    attn_sdpa_opts o;
    attn_sdpa_opts_init(&o);
    float qn[N * D];
    memcpy(qn, q, sizeof q);
    qn[1 * D + 0] = NAN;
    attn_tensor tqn = attn_tensor_view(qn, ATTN_F32, 4, s4);
    tu_poison_f32(out, N * D);
    CHECK_OK(ctx, kernels[ki] == ATTN_KERNEL_REF ? attn_sdpa_ref(ctx, &to, NULL, NULL, &tqn, &tk, &tv, &o)
                                                 : attn_sdpa(ctx, &to, NULL, NULL, &tqn, &tk, &tv, &o));
    int row1_nan = 1, others_finite = 1;
    for (int i = 0; i < N; i++)
      for (int c = 0; c < D; c++) {
        if (i == 1) row1_nan &= isnan(out[i * D + c]) != 0;
        else others_finite &= isfinite(out[i * D + c]) != 0;
      }
    CHECK(row1_nan && others_finite, "kernel %s: NaN must propagate to its row only", attn_kernel_name(kernels[ki]));
    /* Inf in a visible key: q.k is +Inf or -Inf by the sign of q's element. A
     * row with +Inf gets NaN (Inf - Inf in the softmax), as in the oracle and
     * PyTorch; a row with -Inf gives that key weight 0 and stays finite. */
    float kinf[N * D];
    memcpy(kinf, k, sizeof k);
    kinf[1 * D + 3] = INFINITY;
    attn_tensor tki = attn_tensor_view(kinf, ATTN_F32, 4, s4);
    double want[N * D];
    attn_tensor twant = attn_tensor_view(want, ATTN_F64, 4, s4);
    CHECK_OK(ctx, attn_sdpa_ref(ctx, &twant, NULL, NULL, &tq, &tki, &tv, &o));
    tu_poison_f32(out, N * D);
    CHECK_OK(ctx, kernels[ki] == ATTN_KERNEL_REF ? attn_sdpa_ref(ctx, &to, NULL, NULL, &tq, &tki, &tv, &o)
                                                 : attn_sdpa(ctx, &to, NULL, NULL, &tq, &tki, &tv, &o));
    int nan_rows = 0, finite_rows = 0, agree = 1;
    for (int i = 0; i < N; i++) {
      const int row_nan = isnan(want[i * D]);
      nan_rows += row_nan;
      finite_rows += !row_nan;
      for (int c = 0; c < D; c++)
        agree &= row_nan ? isnan(out[i * D + c]) != 0 : fabs(out[i * D + c] - want[i * D + c]) <= 1e-5;
    }
    CHECK(agree && nan_rows > 0 && finite_rows > 0,
          "kernel %s: Inf in a key: rows must be NaN exactly where the oracle's are (%d NaN, %d finite rows)",
          attn_kernel_name(kernels[ki]), nan_rows, finite_rows);
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
}

/* No keys at all (Nk = 0), in every input dtype, on the blocked kernels (decode off) and the decode
 * kernel: zeros in out, lse -inf, or the sink with sinks; found by fuzz/fuzz_sdpa.c, where f16 and bf16
 * values with nothing to pack reached pointer arithmetic on an empty buffer (UBSan). */
static void no_keys(attn_ctx *ctx) {
  enum { H = 2, N = 3, D = 16 };
  uint16_t hq[H * N * D] = {0}, hkv[1];
  float q[H * N * D], kv[1], out[H * N * D], lse[H * N], sink[H] = {0.5f, -1.0f};
  tu_rng r = {7};
  tu_fill_f32(&r, q, H * N * D, 1);
  const int64_t sq[4] = {1, H, N, D}, sk[4] = {1, H, 0, D}, sl[3] = {1, H, N}, sh = H;
  attn_tensor ts = attn_tensor_view(sink, ATTN_F32, 1, &sh), to = attn_tensor_view(out, ATTN_F32, 4, sq);
  attn_tensor tl = attn_tensor_view(lse, ATTN_F32, 3, sl);
  const attn_kernel kernels[] = {ATTN_KERNEL_C, ATTN_KERNEL_AVX2, ATTN_KERNEL_AVX512, ATTN_KERNEL_AVX512_BF16,
                                 ATTN_KERNEL_AMX};
  const attn_dtype dts[] = {ATTN_F32, ATTN_F16, ATTN_BF16};
  for (int ki = 0; ki < 5; ki++) {
    if (!attn_kernel_supported(kernels[ki])) continue;
    CHECK_OK(ctx, attn_ctx_set_kernel(ctx, kernels[ki]));
    for (int di = 0; di < 3; di++)
      for (int decode = 0; decode < 2; decode++)
        for (int sinks = 0; sinks < 2; sinks++) {
          attn_tensor tq = attn_tensor_view(dts[di] == ATTN_F32 ? (void *)q : (void *)hq, dts[di], 4, sq);
          attn_tensor tk = attn_tensor_view(dts[di] == ATTN_F32 ? (void *)kv : (void *)hkv, dts[di], 4, sk);
          attn_sdpa_opts o;
          attn_sdpa_opts_init(&o);
          if (sinks) o.sinks = &ts;
          CHECK_OK(ctx, attn_ctx_set_decode(ctx, decode));
          tu_poison_f32(out, H * N * D);
          tu_poison_f32(lse, H * N);
          CHECK_OK(ctx, attn_sdpa(ctx, &to, &tl, NULL, &tq, &tk, &tk, &o));
          int ok = 1;
          for (int i = 0; i < H * N * D; i++) ok &= out[i] == 0;
          for (int i = 0; i < H * N; i++) ok &= sinks ? lse[i] == sink[i / N] : isinf(lse[i]) && lse[i] < 0;
          CHECK(ok, "kernel %s, %s inputs, decode %d, sinks %d: no keys must give zeros and lse %s",
                attn_kernel_name(kernels[ki]), attn_dtype_name(dts[di]), decode, sinks, sinks ? "the sink" : "-inf");
        }
  }
  attn_ctx_set_decode(ctx, 1);
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
}

/* A longer sequence than the random cases reach: many key blocks, many tiles. */
/* Nq query rows against Nk keys, 2 heads, D 64, every causal mode, every kernel at 1-3 threads. qb: the
 * tiles per query block the forward must pick (a kv head's K and V past 1 MiB share a key block among 16
 * tiles, else 4; engine/forward.c), read from the plan so that both ways are known to have run. */
static void long_case(attn_ctx *ctx, int Nq, int Nk, int qb) {
  enum { B = 1, H = 2, D = 64 };
  const int64_t nq = (int64_t)B * H * Nq * D, nk = (int64_t)B * H * Nk * D;
  float *q = malloc(sizeof(float) * nq), *k = malloc(sizeof(float) * nk);
  float *v = malloc(sizeof(float) * nk), *out = malloc(sizeof(float) * nq), *first = malloc(sizeof(float) * nq);
  double *ref = malloc(sizeof(double) * nq);
  tu_rng r = {7};
  tu_fill_f32(&r, q, nq, 2);
  tu_fill_f32(&r, k, nk, 2);
  tu_fill_f32(&r, v, nk, 1);
  int64_t sq[4] = {B, H, Nq, D}, sk[4] = {B, H, Nk, D};
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, sq), tk = attn_tensor_view(k, ATTN_F32, 4, sk);
  attn_tensor tv = attn_tensor_view(v, ATTN_F32, 4, sk), to = attn_tensor_view(out, ATTN_F32, 4, sq);
  attn_tensor tr = attn_tensor_view(ref, ATTN_F64, 4, sq);
  char want[64];
  snprintf(want, sizeof want, "query blocks of %d x", qb);
  for (int causal = 0; causal < 3; causal++) {
    attn_sdpa_opts o;
    attn_sdpa_opts_init(&o);
    o.causal = (attn_causal)causal;
    CHECK_OK(ctx, attn_sdpa_ref(ctx, &tr, NULL, NULL, &tq, &tk, &tv, &o));
    for (int kern = ATTN_KERNEL_C; kern <= ATTN_KERNEL_AVX512; kern++) {
      if (!attn_kernel_supported((attn_kernel)kern)) continue;
      attn_ctx_set_kernel(ctx, (attn_kernel)kern);
      for (int threads = 1; threads <= 3; threads++) { /* large enough that every thread works */
        attn_ctx_set_threads(ctx, threads);
        tu_poison_f32(out, nq);
        CHECK_OK(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &tv, &o));
        CHECK(strstr(attn_ctx_plan(ctx), want) != NULL, "Nq=%d Nk=%d: the plan \"%s\" lacks \"%s\"", Nq, Nk,
              attn_ctx_plan(ctx), want);
        double *got = tu_to_f64(&to);
        double e = tu_rel_l2(got, ref, nq);
        CHECK(e <= 1e-5, "Nq=%d Nk=%d causal %d kernel %s: rel err %.3g", Nq, Nk, causal,
              attn_kernel_name((attn_kernel)kern), e);
        if (threads == 1) memcpy(first, out, sizeof(float) * nq);
        else CHECK(!memcmp(first, out, sizeof(float) * nq), "Nq=%d Nk=%d kernel %s: threads %d changed the bits", Nq,
                   Nk, attn_kernel_name((attn_kernel)kern), threads);
        free(got);
      }
      attn_ctx_set_threads(ctx, 0);
    }
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  free(q); free(k); free(v); free(out); free(first); free(ref);
}

// out is (N, Dv) for one head: the textbook fp32 loop (scores, softmax, weighted sum), no blocking.
static void plain_fp32(float *out, const float *q, const float *k, const float *v, int N, int D, int causal) {
  float *s = malloc(sizeof(float) * (size_t)N);
  const float scale = 1.0f / sqrtf((float)D);
  for (int i = 0; i < N; i++) {
    const int end = causal ? i + 1 : N;
    float mx = -INFINITY, sum = 0;
    for (int j = 0; j < end; j++) {
      float dot = 0;
      for (int d = 0; d < D; d++) dot += q[i * D + d] * k[j * D + d];
      s[j] = dot * scale;
      if (s[j] > mx) mx = s[j];
    }
    for (int j = 0; j < end; j++) sum += (s[j] = expf(s[j] - mx));
    for (int c = 0; c < D; c++) {
      float acc = 0;
      for (int j = 0; j < end; j++) acc += s[j] * v[j * D + c];
      out[i * D + c] = acc / sum;
    }
  }
  free(s);
}

/* The fast kernels must be no less accurate than the plain fp32 loop: at most
 * twice its error against the oracle, over long rows where rounding builds up. */
static void accuracy_vs_plain(attn_ctx *ctx) {
  enum { N = 1024, D = 64 };
  float *q = malloc(sizeof(float) * N * D), *k = malloc(sizeof(float) * N * D), *v = malloc(sizeof(float) * N * D);
  float *out = malloc(sizeof(float) * N * D), *plain = malloc(sizeof(float) * N * D);
  double *ref = malloc(sizeof(double) * N * D), *pd = malloc(sizeof(double) * N * D);
  tu_rng r = {2024};
  tu_fill_f32(&r, q, N * D, 3);
  tu_fill_f32(&r, k, N * D, 3);
  tu_fill_f32(&r, v, N * D, 1);
  int64_t s[4] = {1, 1, N, D};
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, s), tk = attn_tensor_view(k, ATTN_F32, 4, s);
  attn_tensor tv = attn_tensor_view(v, ATTN_F32, 4, s), to = attn_tensor_view(out, ATTN_F32, 4, s);
  attn_tensor tr = attn_tensor_view(ref, ATTN_F64, 4, s);
  for (int causal = 0; causal < 2; causal++) {
    attn_sdpa_opts o;
    attn_sdpa_opts_init(&o);
    o.causal = causal ? ATTN_CAUSAL_TOP_LEFT : ATTN_CAUSAL_NONE;
    CHECK_OK(ctx, attn_sdpa_ref(ctx, &tr, NULL, NULL, &tq, &tk, &tv, &o));
    plain_fp32(plain, q, k, v, N, D, causal);
    for (int i = 0; i < N * D; i++) pd[i] = plain[i];
    const double e_plain = tu_rel_l2(pd, ref, N * D);
    for (int kern = ATTN_KERNEL_C; kern <= ATTN_KERNEL_AVX512; kern++) {
      if (!attn_kernel_supported((attn_kernel)kern)) continue;
      attn_ctx_set_kernel(ctx, (attn_kernel)kern);
      CHECK_OK(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &tv, &o));
      double *got = tu_to_f64(&to);
      const double e = tu_rel_l2(got, ref, N * D);
      printf("accuracy N=%d causal=%d: kernel %-6s rel L2 %.3g, plain fp32 loop %.3g\n", N, causal,
             attn_kernel_name((attn_kernel)kern), e, e_plain);
      CHECK(e <= 2 * e_plain && e <= 1e-5, "kernel %s: rel err %.3g vs plain %.3g", attn_kernel_name((attn_kernel)kern), e,
            e_plain);
      free(got);
    }
  }
  attn_ctx_set_kernel(ctx, ATTN_KERNEL_AUTO);
  free(q); free(k); free(v); free(out); free(plain); free(ref); free(pd);
}

int main(int argc, char **argv) {
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx)) return 1;
  int cases = argc > 1 ? atoi(argv[1]) : 400;
  for (int k = ATTN_KERNEL_C; k <= ATTN_KERNEL_AVX512; k++)
    printf("kernel %-6s %s\n", attn_kernel_name((attn_kernel)k),
           attn_kernel_supported((attn_kernel)k) ? "tested" : "not supported here: skipped");
  oracle_by_hand(ctx);
  edge_cases(ctx);
  attn_ctx *blocked;
  if (attn_ctx_create(&blocked)) return 1;
  CHECK_OK(blocked, attn_ctx_set_decode(blocked, 0));
  edge_cases(blocked);
  attn_ctx_destroy(blocked);
  no_keys(ctx);
  long_case(ctx, 300, 300, 4);
  long_case(ctx, 800, 2100, 16); /* 2100 keys of 64 + 64 floats: 1.03 MiB */
  accuracy_vs_plain(ctx);
  for (int i = 0; i < cases; i++) random_case(ctx, 1000 + (uint64_t)i);
  attn_ctx_destroy(ctx);
  return tu_finish("test_sdpa");
}
