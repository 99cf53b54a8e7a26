/* The KV cache and incremental decoding: token-by-token attention over a cache
 * equals one causal pass over the whole sequence (SDPA and the MHA layer);
 * rows of different lengths, f16/bf16 storage (against the oracle on the
 * rounded keys and values), truncate, copy_row, windows; and every refusal
 * leaves the cache as it was. */
#include "testutil.h"

static float *rand_f32(tu_rng *r, int64_t n) {
  float *x = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
  tu_fill_f32(r, x, n, 1.0);
  return x;
}

/* Rounds x through dt (what the cache stores). */
static void round_through(float *x, int64_t n, attn_dtype dt) {
  for (int64_t i = 0; i < n; i++) x[i] = tu_round_through(x[i], dt);
}

/* Appends a sequence in steps of sizes steps[] and attends after each; every
 * step's output must match the oracle's causal pass over the whole sequence
 * (on the keys and values as the cache stores them). */
static void sdpa_incremental(attn_dtype dt, const int *steps, int nsteps, int64_t Hq, int64_t Hk, int64_t D,
                             int64_t window, uint64_t seed) {
  tu_rng r = {seed};
  int64_t T = 0;
  for (int s = 0; s < nsteps; s++) T += steps[s];
  const int64_t B = 2;
  const int64_t qs[4] = {B, Hq, T, D}, ks[4] = {B, Hk, T, D}, ls[3] = {B, Hq, T};
  float *q = rand_f32(&r, B * Hq * T * D), *k = rand_f32(&r, B * Hk * T * D), *v = rand_f32(&r, B * Hk * T * D);
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  attn_kv_cache_config cfg;
  attn_kv_cache_config_init(&cfg, B, T + 3, Hk, D);
  cfg.dtype = dt;
  attn_kv_cache *cache;
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &cfg));

  /* the oracle: one causal pass over everything, with k and v as stored */
  float *kr = malloc((size_t)(B * Hk * T * D) * sizeof(float)), *vr = malloc((size_t)(B * Hk * T * D) * sizeof(float));
  memcpy(kr, k, (size_t)(B * Hk * T * D) * sizeof(float));
  memcpy(vr, v, (size_t)(B * Hk * T * D) * sizeof(float));
  round_through(kr, B * Hk * T * D, dt);
  round_through(vr, B * Hk * T * D, dt);
  double *ref = malloc((size_t)(B * Hq * T * D) * sizeof(double)), *ref_lse = malloc((size_t)(B * Hq * T) * sizeof(double));
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, qs), tk = attn_tensor_view(kr, ATTN_F32, 4, ks);
  attn_tensor tv = attn_tensor_view(vr, ATTN_F32, 4, ks), tr = attn_tensor_view(ref, ATTN_F64, 4, qs);
  attn_tensor trl = attn_tensor_view(ref_lse, ATTN_F64, 3, ls);
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.causal = ATTN_CAUSAL_TOP_LEFT;
  o.window = window;
  CHECK_OK(ctx, attn_sdpa_ref(ctx, &tr, &trl, NULL, &tq, &tk, &tv, &o));

  int64_t at = 0;
  double worst = 0, worst_lse = 0;
  for (int s = 0; s < nsteps; s++) {
    const int64_t n = steps[s];
    /* this step's slices of the full tensors, as strided views */
    attn_tensor sk = attn_tensor_view(k + at * D, ATTN_F32, 4, ks), sv = attn_tensor_view(v + at * D, ATTN_F32, 4, ks);
    attn_tensor sq = attn_tensor_view(q + at * D, ATTN_F32, 4, qs);
    sk.shape[2] = sv.shape[2] = sq.shape[2] = n;
    CHECK_OK(ctx, attn_kv_cache_append(ctx, cache, &sk, &sv, NULL));
    const int64_t os[4] = {B, Hq, n, D}, osl[3] = {B, Hq, n};
    float *out = malloc((size_t)(B * Hq * n * D) * sizeof(float)), *lse = malloc((size_t)(B * Hq * n) * sizeof(float));
    tu_poison_f32(out, B * Hq * n * D);
    tu_poison_f32(lse, B * Hq * n);
    attn_tensor to = attn_tensor_view(out, ATTN_F32, 4, os), tl = attn_tensor_view(lse, ATTN_F32, 3, osl);
    attn_sdpa_opts ao;
    attn_sdpa_opts_init(&ao);
    ao.window = window;
    CHECK_OK(ctx, attn_kv_cache_attend(ctx, cache, &to, &tl, &sq, &ao));
    double num = 0, den = 0;
    for (int64_t b = 0; b < B; b++)
      for (int64_t h = 0; h < Hq; h++)
        for (int64_t i = 0; i < n; i++) {
          const double lr = ref_lse[(b * Hq + h) * T + at + i], lg = lse[(b * Hq + h) * n + i];
          if (!(fabs(lg - lr) <= worst_lse)) worst_lse = fabs(lg - lr);
          for (int64_t d = 0; d < D; d++) {
            const double y = ref[((b * Hq + h) * T + at + i) * D + d], x = out[((b * Hq + h) * n + i) * D + d];
            num += (x - y) * (x - y), den += y * y;
          }
        }
    const double err = sqrt(num / den);
    if (!(err <= worst)) worst = err;
    free(out), free(lse);
    at += n;
  }
  CHECK(worst <= 2e-6 && worst_lse <= 1e-5, "%s cache, Hq %lld Hk %lld D %lld window %lld: worst step rel L2 %.3g, lse %.3g",
        attn_dtype_name(dt), (long long)Hq, (long long)Hk, (long long)D, (long long)window, worst, worst_lse);
  CHECK(attn_kv_cache_length(cache, 0) == T && attn_kv_cache_length(cache, 1) == T, "lengths %lld %lld, want %lld",
        (long long)attn_kv_cache_length(cache, 0), (long long)attn_kv_cache_length(cache, 1), (long long)T);
  attn_kv_cache_destroy(cache);
  attn_ctx_destroy(ctx);
  free(q), free(k), free(v), free(kr), free(vr), free(ref), free(ref_lse);
}

/* Rows of different lengths (n_new per row), truncate and copy_row, checked row by row against the oracle. */
static void rows_and_rollback(void) {
  tu_rng r = {77};
  const int64_t B = 3, Hq = 4, Hk = 2, D = 32, N = 40;
  const int64_t ks[4] = {B, Hk, N, D};
  float *k = rand_f32(&r, B * Hk * N * D), *v = rand_f32(&r, B * Hk * N * D), *k2 = rand_f32(&r, B * Hk * N * D);
  attn_tensor tk = attn_tensor_view(k, ATTN_F32, 4, ks), tv = attn_tensor_view(v, ATTN_F32, 4, ks);
  attn_tensor tk2 = attn_tensor_view(k2, ATTN_F32, 4, ks);
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  attn_kv_cache_config cfg;
  attn_kv_cache_config_init(&cfg, B, 64, Hk, D);
  attn_kv_cache *cache;
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &cfg));
  const int64_t n_new[3] = {40, 7, 0};
  CHECK_OK(ctx, attn_kv_cache_append(ctx, cache, &tk, &tv, n_new));
  CHECK(attn_kv_cache_length(cache, 0) == 40 && attn_kv_cache_length(cache, 1) == 7 &&
            attn_kv_cache_length(cache, 2) == 0, "per-row lengths");
  /* over capacity: refused, nothing appended */
  CHECK(attn_kv_cache_append(ctx, cache, &tk, &tv, NULL) == ATTN_E_SHAPE, "append past capacity accepted");
  CHECK(*attn_ctx_error(ctx) != 0, "no message for a refused append");
  CHECK(attn_kv_cache_length(cache, 1) == 7, "a refused append changed a row");
  /* rollback: row 0 keeps 30 tokens, then appends k2's first 5 (for every row: 5 each) */
  CHECK_OK(ctx, attn_kv_cache_truncate(ctx, cache, 0, 30));
  CHECK(attn_kv_cache_truncate(ctx, cache, 1, 8) == ATTN_E_INVALID, "truncate beyond the length accepted");
  attn_tensor tk5 = tk2, tv5 = tv;
  tk5.shape[2] = tv5.shape[2] = 5;
  CHECK_OK(ctx, attn_kv_cache_append(ctx, cache, &tk5, &tv5, NULL));
  CHECK_OK(ctx, attn_kv_cache_copy_row(ctx, cache, 2, 1)); /* beam search: row 2 := row 1 */

  /* queries: 3 per row; compare each row with the oracle on what that row should hold */
  const int64_t Nq = 3, qs[4] = {B, Hq, Nq, D};
  float *q = rand_f32(&r, B * Hq * Nq * D), *out = malloc((size_t)(B * Hq * Nq * D) * sizeof(float));
  tu_poison_f32(out, B * Hq * Nq * D);
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, qs), to = attn_tensor_view(out, ATTN_F32, 4, qs);
  CHECK_OK(ctx, attn_kv_cache_attend(ctx, cache, &to, NULL, &tq, NULL));
  const int64_t want_len[3] = {35, 12, 12};
  float *ek = malloc((size_t)(Hk * 64 * D) * sizeof(float)), *ev = malloc((size_t)(Hk * 64 * D) * sizeof(float));
  for (int64_t b = 0; b < B; b++) {
    const int64_t L = want_len[b], src = b == 2 ? 1 : b; /* row 2 copies row 1 */
    CHECK(attn_kv_cache_length(cache, b) == L, "row %lld holds %lld tokens, want %lld", (long long)b,
          (long long)attn_kv_cache_length(cache, b), (long long)L);
    const int64_t kept = src == 0 ? 30 : 7;
    for (int64_t g = 0; g < Hk; g++)
      for (int64_t j = 0; j < L; j++)
        for (int64_t d = 0; d < D; d++) {
          const int64_t from = j < kept ? ((src * Hk + g) * N + j) * D + d : ((src * Hk + g) * N + j - kept) * D + d;
          ek[(g * L + j) * D + d] = j < kept ? k[from] : k2[from];
          ev[(g * L + j) * D + d] = v[from];
        }
    const int64_t eks[4] = {1, Hk, L, D}, rqs[4] = {1, Hq, Nq, D};
    attn_tensor rk = attn_tensor_view(ek, ATTN_F32, 4, eks), rv = attn_tensor_view(ev, ATTN_F32, 4, eks);
    attn_tensor rq = attn_tensor_view(q + b * Hq * Nq * D, ATTN_F32, 4, rqs);
    double ref[4 * 3 * 32];
    attn_tensor rr = attn_tensor_view(ref, ATTN_F64, 4, rqs);
    attn_sdpa_opts o;
    attn_sdpa_opts_init(&o);
    o.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
    CHECK_OK(ctx, attn_sdpa_ref(ctx, &rr, NULL, NULL, &rq, &rk, &rv, &o));
    double num = 0, den = 0;
    for (int64_t e = 0; e < Hq * Nq * D; e++) {
      const double x = out[b * Hq * Nq * D + e];
      num += (x - ref[e]) * (x - ref[e]), den += ref[e] * ref[e];
    }
    CHECK(sqrt(num / den) <= 2e-6, "row %lld after truncate/copy: rel L2 %.3g", (long long)b, sqrt(num / den));
  }
  /* view: the stored keys of row 0 */
  attn_tensor vk, vv;
  CHECK_OK(ctx, attn_kv_cache_view(ctx, &vk, &vv, cache, 0));
  CHECK(vk.shape[2] == 35 && ((float *)vk.data)[vk.strides[1] + 31 * vk.strides[2] + 3] == k2[(0 * Hk + 1) * N * D + 1 * D + 3],
        "view of row 0 does not show its keys");
  /* refusals */
  attn_sdpa_opts bad;
  attn_sdpa_opts_init(&bad);
  const int64_t ms[2] = {Nq, 35};
  uint8_t mbuf[3 * 35] = {0};
  attn_tensor m = attn_tensor_view(mbuf, ATTN_BOOL, 2, ms);
  bad.mask = &m;
  CHECK(attn_kv_cache_attend(ctx, cache, &to, NULL, &tq, &bad) == ATTN_E_INVALID, "attend took a mask");
  CHECK(attn_kv_cache_truncate(ctx, cache, 3, 0) == ATTN_E_INVALID, "truncate of a missing row accepted");
  CHECK(attn_kv_cache_copy_row(ctx, cache, 0, -1) == ATTN_E_INVALID, "copy_row of a missing row accepted");
  const int64_t wrong[4] = {B, Hk + 1, 1, D};
  attn_tensor tw = attn_tensor_view(k, ATTN_F32, 4, wrong);
  CHECK(attn_kv_cache_append(ctx, cache, &tw, &tw, NULL) == ATTN_E_SHAPE, "append of the wrong head count accepted");
  CHECK_OK(ctx, attn_kv_cache_truncate(ctx, cache, -1, 0));
  CHECK(attn_kv_cache_length(cache, 0) == 0 && attn_kv_cache_length(cache, 2) == 0, "reset of every row");
  attn_kv_cache_config badcfg = cfg;
  attn_kv_cache *none = NULL;
  badcfg.dtype = ATTN_F64;
  CHECK(attn_kv_cache_create(ctx, &none, &badcfg) == ATTN_E_DTYPE && !none, "f64 storage accepted");
  badcfg = cfg;
  badcfg.capacity = 0;
  CHECK(attn_kv_cache_create(ctx, &none, &badcfg) == ATTN_E_INVALID && !none, "capacity 0 accepted");
  attn_kv_cache_destroy(cache);
  attn_ctx_destroy(ctx);
  free(k), free(v), free(k2), free(q), free(out), free(ek), free(ev);
}

/* The MHA layer: token by token (and in uneven chunks) through the cache equals one causal forward. */
static void mha_incremental(attn_dtype dt, int64_t E, int64_t H, int64_t Hk, int bias, int options) {
  tu_rng r = {900 + (uint64_t)E + (uint64_t)dt};
  const int64_t B = 2, T = 19;
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  attn_mha_config mc;
  attn_mha_config_init(&mc, E, H);
  mc.num_kv_heads = Hk;
  mc.bias = bias;
  attn_mha *mha;
  CHECK_OK(ctx, attn_mha_create(ctx, &mha, &mc));
  for (int p = 0; p < TU_MHA_PROJ_PARAMS; p++) {
    attn_tensor pv;
    if (attn_mha_param_view(ctx, &pv, mha, (attn_mha_param)p) == ATTN_OK)
      tu_fill_f32(&r, pv.data, attn_tensor_numel(&pv), 0.3);
  }
  const int64_t xs[3] = {B, T, E};
  float *x = rand_f32(&r, B * T * E), *full = malloc((size_t)(B * T * E) * sizeof(float));
  float *inc = malloc((size_t)(B * T * E) * sizeof(float));
  tu_poison_f32(inc, B * T * E);
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 3, xs), tf = attn_tensor_view(full, ATTN_F32, 3, xs);
  attn_mha_opts mo;
  attn_mha_opts_init(&mo);
  mo.attn.causal = ATTN_CAUSAL_TOP_LEFT;
  float slopes[16], sinks[16];
  const int64_t hs[1] = {H};
  attn_tensor ts = attn_tensor_view(slopes, ATTN_F32, 1, hs), tk = attn_tensor_view(sinks, ATTN_F32, 1, hs);
  if (options) { /* every option of recent models at once: the step must still equal the full pass */
    attn_alibi_slopes(slopes, H);
    tu_fill_f32(&r, sinks, H, 1.0);
    mo.attn.window = 6;
    mo.attn.softcap = 3.0;
    mo.attn.alibi_slopes = &ts;
    mo.attn.sinks = &tk;
  }
  CHECK_OK(ctx, attn_mha_forward(ctx, mha, &tf, NULL, &tx, NULL, NULL, &mo));
  attn_kv_cache_config cfg;
  attn_kv_cache_config_init(&cfg, B, T, Hk, E / H);
  cfg.dtype = dt;
  attn_kv_cache *cache;
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &cfg));
  const int chunks[] = {5, 1, 1, 3, 1, 1, 1, 6};
  int64_t at = 0;
  for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
    attn_tensor sx = tx, so = attn_tensor_view(inc, ATTN_F32, 3, xs);
    sx.data = x + at * E, so.data = inc + at * E;
    sx.shape[1] = so.shape[1] = chunks[c];
    CHECK_OK(ctx, attn_mha_forward_cached(ctx, mha, cache, &so, &sx, &mo));
    at += chunks[c];
  }
  double num = 0, den = 0;
  for (int64_t e = 0; e < B * T * E; e++) num += (inc[e] - full[e]) * (inc[e] - full[e]), den += full[e] * full[e];
  /* halves: the cache rounds k and v, the full pass does not */
  const double tol = dt == ATTN_F32 ? 2e-6 : dt == ATTN_F16 ? 2e-3 : 1.5e-2;
  CHECK(sqrt(num / den) <= tol, "MHA E%lld H%lld Hk%lld %s cache%s: incremental vs full rel L2 %.3g", (long long)E,
        (long long)H, (long long)Hk, attn_dtype_name(dt), options ? " with options" : "", sqrt(num / den));
  /* a step past capacity fails and leaves the cache alone */
  attn_tensor one = tx;
  one.shape[1] = 1;
  attn_tensor oo = attn_tensor_view(inc, ATTN_F32, 3, xs);
  oo.shape[1] = 1;
  CHECK(attn_mha_forward_cached(ctx, mha, cache, &oo, &one, NULL) == ATTN_E_SHAPE, "step past capacity accepted");
  CHECK(attn_kv_cache_length(cache, 0) == T, "a failed step changed the cache");
  attn_kv_cache_destroy(cache);
  attn_mha_destroy(mha);
  attn_ctx_destroy(ctx);
  free(x), free(full), free(inc);
}

/* The rounding helpers the comparisons rest on (testutil.h): every half
 * survives the round trip, and ties go to even, in the subnormals too. */
static void half_rounding(void) {
  int bad = 0;
  for (uint32_t h = 0; h < 0x10000; h++) {
    const float f = tu_f16_to_f32((uint16_t)h);
    if (isnan(f)) bad += !isnan(tu_f16_to_f32(tu_f32_to_f16(f)));
    else bad += tu_f32_to_f16(f) != h;
    if (!isnan(tu_bf16_to_f32((uint16_t)h))) bad += tu_f32_to_bf16(tu_bf16_to_f32((uint16_t)h)) != h;
  }
  CHECK(bad == 0, "%d halves do not survive the round trip", bad);
  const struct { float x; uint16_t h; } f16[] = {
      {1.0f + 0x1p-11f, 0x3c00}, {1.0f + 3 * 0x1p-11f, 0x3c02}, {1.0f + 0x1p-11f + 0x1p-20f, 0x3c01},
      {0x1p-25f, 0x0000},        {3 * 0x1p-25f, 0x0002},        {0x1p-25f + 0x1p-35f, 0x0001},
      {65519.0f, 0x7bff},        {65520.0f, 0x7c00},            {-0x1p-14f * 1.5f, 0x8600},
      {0x1p-14f - 0x1p-26f, 0x0400}, /* a subnormal that rounds up to the smallest normal */
  };
  for (size_t i = 0; i < sizeof f16 / sizeof f16[0]; i++)
    CHECK(tu_f32_to_f16(f16[i].x) == f16[i].h, "f16(%a) = %04x, want %04x", f16[i].x, tu_f32_to_f16(f16[i].x), f16[i].h);
  CHECK(tu_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80 && tu_f32_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3f82 &&
            tu_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81,
        "bf16 ties to even");
}

int main(void) {
  half_rounding();
  const int tokens[] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  const int mixed[] = {37, 1, 1, 5, 1, 600, 1, 1};
  sdpa_incremental(ATTN_F32, tokens, 10, 4, 4, 64, 0, 1);
  sdpa_incremental(ATTN_F32, mixed, 8, 8, 2, 64, 0, 2);
  sdpa_incremental(ATTN_F16, mixed, 8, 8, 2, 128, 0, 3);
  sdpa_incremental(ATTN_BF16, mixed, 8, 4, 1, 40, 0, 4);
  sdpa_incremental(ATTN_F32, mixed, 8, 8, 4, 64, 50, 5);
  sdpa_incremental(ATTN_F32, tokens, 10, 8, 4, 64, 4, 7);
  sdpa_incremental(ATTN_F16, tokens, 10, 4, 2, 64, 3, 6);
  rows_and_rollback();
  mha_incremental(ATTN_F32, 64, 4, 4, 1, 0);
  mha_incremental(ATTN_F32, 96, 6, 2, 0, 0);
  mha_incremental(ATTN_F16, 64, 4, 2, 1, 0);
  mha_incremental(ATTN_BF16, 64, 4, 4, 1, 0);
  mha_incremental(ATTN_F32, 64, 4, 2, 1, 1);
  mha_incremental(ATTN_F16, 96, 6, 3, 1, 1);
  return tu_finish("test_kv_cache");
}
