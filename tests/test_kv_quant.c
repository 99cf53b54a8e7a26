/* Quantized KV cache storage (q8_0, q4_0): the block encoders bitwise against
 * this file's own implementation of the formats' definitions (attn.h), edge
 * cases included; attend over quantized storage against the float64 oracle
 * run on the keys and values the cache holds (decoded by this file), on every
 * kernel and 1-3 threads (bitwise the same for each), lse too, decode-sized
 * and prefill steps, GQA, rows of mixed lengths, window, softcap, ALiBi,
 * sinks and RoPE, with the storage past each row's length poisoned; the
 * decode kernels on every row count 1-8 and D, Dv of 1-4 blocks, with NaN
 * blocks in hidden keys (that must not reach an output) and NaN scales in a
 * key visible to some rows only (that must reach exactly those); and,
 * printed, how far each format moves the output from an f32 cache's.
 * Optional argument: one kernel's name (else all; 77 if this CPU lacks it). */
#include "testutil.h"

#include <stddef.h>

/* ---- the formats, as attn.h defines them (independent of src/) ---- */

static int finite_block(const float *x) {
  for (int i = 0; i < 32; i++)
    if (!isfinite(x[i])) return 0;
  return 1;
}

static void ref_q8_0(uint8_t out[34], const float x[32]) {
  uint16_t scale = 0x7e00;
  int8_t q[32] = {0};
  if (finite_block(x)) {
    float amax = 0;
    for (int i = 0; i < 32; i++)
      if (fabsf(x[i]) > amax) amax = fabsf(x[i]);
    const float d = amax / 127.0f, inv = d == 0 ? 0.0f : 1.0f / d;
    scale = tu_f32_to_f16(d);
    for (int i = 0; i < 32; i++) q[i] = (int8_t)roundf(x[i] * inv); /* halfway away from zero */
  }
  out[0] = (uint8_t)(scale & 0xff), out[1] = (uint8_t)(scale >> 8); /* little-endian */
  memcpy(out + 2, q, 32);
}

static void ref_q4_0(uint8_t out[18], const float x[32]) {
  uint16_t scale = 0x7e00;
  int q[32];
  for (int i = 0; i < 32; i++) q[i] = 8;
  if (finite_block(x)) {
    float big = 0; /* signed, largest magnitude, first on a tie */
    for (int i = 0; i < 32; i++)
      if (fabsf(x[i]) > fabsf(big)) big = x[i];
    const float d = big / -8.0f, inv = d == 0 ? 0.0f : 1.0f / d;
    scale = tu_f32_to_f16(d);
    for (int i = 0; i < 32; i++) {
      const float t = floorf(x[i] * inv + 8.5f); /* halfway rounds up */
      q[i] = t < 0 ? 0 : t > 15 ? 15 : (int)t;
    }
  }
  out[0] = (uint8_t)(scale & 0xff), out[1] = (uint8_t)(scale >> 8);
  for (int j = 0; j < 16; j++) out[2 + j] = (uint8_t)(q[j] | q[j + 16] << 4); /* j low, j + 16 high */
}

static void ref_encode(attn_kv_dtype dt, uint8_t *out, const float *x, int64_t n) {
  for (int64_t c = 0; c < n; c += 32, out += dt == ATTN_KV_Q8_0 ? 34 : 18)
    if (dt == ATTN_KV_Q8_0) ref_q8_0(out, x + c);
    else ref_q4_0(out, x + c);
}

static void ref_decode(attn_kv_dtype dt, float *x, const uint8_t *in, int64_t n) {
  for (int64_t c = 0; c < n; c += 32, in += dt == ATTN_KV_Q8_0 ? 34 : 18) {
    const float d = tu_f16_to_f32((uint16_t)(in[0] | in[1] << 8));
    for (int i = 0; i < 32; i++)
      x[c + i] = dt == ATTN_KV_Q8_0 ? d * (float)(int8_t)in[2 + i]
                                    : d * (float)((i < 16 ? in[2 + i] & 15 : in[2 + i - 16] >> 4) - 8);
  }
}

/* ---- (1) the encoders ---- */

/* Encodes x (n values) with the library and with the reference: bytes equal, decodings equal. */
static void check_blocks(attn_ctx *ctx, attn_kv_dtype dt, const float *x, int64_t n, const char *what) {
  const size_t bytes = attn_kv_dtype_bytes(dt, n);
  uint8_t *lib = malloc(bytes), *ref = malloc(bytes);
  float *xl = malloc((size_t)n * sizeof(float)), *xr = malloc((size_t)n * sizeof(float));
  CHECK_OK(ctx, attn_kv_quantize(ctx, dt, lib, x, n));
  ref_encode(dt, ref, x, n);
  size_t bad = bytes;
  for (size_t i = 0; i < bytes && bad == bytes; i++)
    if (lib[i] != ref[i]) bad = i;
  CHECK(bad == bytes, "%s %s: byte %zu is %02x, the definition gives %02x", attn_kv_dtype_name(dt), what, bad,
        bad < bytes ? lib[bad] : 0, bad < bytes ? ref[bad] : 0);
  CHECK_OK(ctx, attn_kv_dequantize(ctx, dt, xl, ref, n));
  ref_decode(dt, xr, ref, n);
  CHECK(memcmp(xl, xr, (size_t)n * sizeof(float)) == 0 || n == 0, "%s %s: decoded values differ", attn_kv_dtype_name(dt),
        what);
  free(lib), free(ref), free(xl), free(xr);
}

static void encoders(void) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  const attn_kv_dtype dts[2] = {ATTN_KV_Q8_0, ATTN_KV_Q4_0};
  CHECK(attn_kv_dtype_bytes(ATTN_KV_Q8_0, 64) == 68 && attn_kv_dtype_bytes(ATTN_KV_Q4_0, 64) == 36 &&
            attn_kv_dtype_bytes(ATTN_KV_Q8_0, 40) == 0 && attn_kv_dtype_bytes(ATTN_KV_F16, 3) == 6,
        "block sizes");
  tu_rng r = {5};
  float x[32 * 64];
  for (int di = 0; di < 2; di++) {
    const attn_kv_dtype dt = dts[di];
    /* random blocks over many magnitudes */
    for (int b = 0; b < 64; b++) tu_fill_f32(&r, x + 32 * b, 32, pow(10.0, (b % 13) - 6));
    check_blocks(ctx, dt, x, 32 * 64, "random");
    float e[32];
    memset(e, 0, sizeof e);
    check_blocks(ctx, dt, e, 32, "all zeros");
    e[7] = 1000.0f;
    check_blocks(ctx, dt, e, 32, "one large value");
    e[7] = -3.0f, e[20] = 1.5f, e[3] = -0.25f;
    check_blocks(ctx, dt, e, 32, "negative max");
    e[9] = 3.0f; /* a magnitude tie with -3: the first wins (q4_0) */
    check_blocks(ctx, dt, e, 32, "magnitude tie");
    memset(e, 0, sizeof e);
    e[0] = 1e-30f, e[1] = -1e-30f; /* a scale below f16's subnormals */
    check_blocks(ctx, dt, e, 32, "tiny");
    for (int i = 0; i < 32; i++) e[i] = 1e7f * (i % 2 ? 1 : -1); /* a scale past f16's range */
    check_blocks(ctx, dt, e, 32, "huge");
    const float specials[3] = {NAN, INFINITY, -INFINITY};
    for (int s = 0; s < 3; s++) { /* a non-finite value: the block reads back NaN */
      tu_fill_f32(&r, e, 32, 1.0);
      e[11] = specials[s];
      uint8_t blk[34];
      float back[32];
      CHECK_OK(ctx, attn_kv_quantize(ctx, dt, blk, e, 32));
      check_blocks(ctx, dt, e, 32, "non-finite");
      CHECK_OK(ctx, attn_kv_dequantize(ctx, dt, back, blk, 32));
      int nans = 0;
      for (int i = 0; i < 32; i++) nans += isnan(back[i]) != 0;
      CHECK(nans == 32 && blk[0] == 0x00 && blk[1] == 0x7e, "%s: a block holding %g gives %d NaN of 32",
            attn_kv_dtype_name(dt), (double)specials[s], nans);
    }
  }
  /* rounding ties, by hand: q8_0 with max 127 (d = 1): 0.5 -> 1, -0.5 -> -1, 2.5 -> 3, -2.5 -> -3 */
  float t[32] = {127.0f, 0.5f, -0.5f, 2.5f, -2.5f, 126.5f};
  uint8_t blk[34];
  CHECK_OK(ctx, attn_kv_quantize(ctx, ATTN_KV_Q8_0, blk, t, 32));
  CHECK(blk[0] == 0x00 && blk[1] == 0x3c && (int8_t)blk[2] == 127 && (int8_t)blk[3] == 1 && (int8_t)blk[4] == -1 &&
            (int8_t)blk[5] == 3 && (int8_t)blk[6] == -3 && (int8_t)blk[7] == 127,
        "q8_0 ties: scale %02x%02x, q %d %d %d %d %d", blk[1], blk[0], (int8_t)blk[3], (int8_t)blk[4], (int8_t)blk[5],
        (int8_t)blk[6], (int8_t)blk[7]);
  check_blocks(ctx, ATTN_KV_Q8_0, t, 32, "ties");
  /* q4_0 with max -8 (d = 1): 0.5 -> 9, -0.5 -> 8, 2.5 -> 11, -2.5 -> 6 (halfway up), 8 -> 15 (clamped);
   * element 16 (-4) is byte 0's high nibble, element 1 byte 1's low */
  float u[32] = {-8.0f, 0.5f, -0.5f, 2.5f, -2.5f, 8.0f};
  u[16] = -4.0f;
  CHECK_OK(ctx, attn_kv_quantize(ctx, ATTN_KV_Q4_0, blk, u, 32));
  CHECK(blk[0] == 0x00 && blk[1] == 0x3c && blk[2] == (0 | 4 << 4) && blk[3] == (9 | 8 << 4) && blk[4] == (8 | 8 << 4) &&
            blk[5] == (11 | 8 << 4) && blk[6] == (6 | 8 << 4) && blk[7] == (15 | 8 << 4),
        "q4_0 ties and nibbles: scale %02x%02x, bytes %02x %02x %02x %02x %02x %02x", blk[1], blk[0], blk[2], blk[3],
        blk[4], blk[5], blk[6], blk[7]);
  check_blocks(ctx, ATTN_KV_Q4_0, u, 32, "ties");
  CHECK_ERR(ctx, attn_kv_quantize(ctx, ATTN_KV_Q8_0, blk, t, 33), ATTN_E_INVALID, "multiple of 32");
  CHECK_ERR(ctx, attn_kv_quantize(ctx, ATTN_KV_F16, blk, t, 32), ATTN_E_INVALID, "ATTN_KV_Q8_0");
  attn_ctx_destroy(ctx);
}

/* ---- the cache: configuration, refusals, and the bytes it stores ---- */

static void cache_config(void) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  attn_kv_cache_config cfg;
  attn_kv_cache_config_init(&cfg, 2, 8, 1, 48);
  CHECK(cfg.k_dtype == ATTN_KV_AS_DTYPE && cfg.v_dtype == ATTN_KV_AS_DTYPE, "defaults are 'as dtype'");
  attn_kv_cache *cache = NULL;
  cfg.k_dtype = ATTN_KV_Q8_0;
  CHECK_ERR(ctx, attn_kv_cache_create(ctx, &cache, &cfg), ATTN_E_INVALID, "multiple of 32");
  cfg.k_dtype = ATTN_KV_AS_DTYPE, cfg.v_dtype = ATTN_KV_Q4_0, cfg.v_head_dim = 20;
  CHECK_ERR(ctx, attn_kv_cache_create(ctx, &cache, &cfg), ATTN_E_INVALID, "v_head_dim");
  cfg.v_dtype = (attn_kv_dtype)9;
  CHECK_ERR(ctx, attn_kv_cache_create(ctx, &cache, &cfg), ATTN_E_DTYPE, "attn_kv_dtype");
  /* a caller built before k_dtype existed (a shorter size) gets dtype for both */
  attn_kv_cache_config_init(&cfg, 2, 8, 1, 64);
  cfg.dtype = ATTN_F16;
  cfg.k_dtype = ATTN_KV_Q8_0;
  cfg.size = offsetof(attn_kv_cache_config, k_dtype);
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &cfg));
  const attn_kv_cache_config *got = attn_kv_cache_get_config(cache);
  CHECK(got->k_dtype == ATTN_KV_F16 && got->v_dtype == ATTN_KV_F16, "an old-size config: %s/%s",
        attn_kv_dtype_name(got->k_dtype), attn_kv_dtype_name(got->v_dtype));
  attn_kv_cache_destroy(cache);

  /* the stored bytes are the definition's, and copy_row copies them */
  const int64_t B = 2, Hk = 2, N = 5, D = 64, Dv = 96;
  attn_kv_cache_config_init(&cfg, B, 8, Hk, D);
  cfg.v_head_dim = Dv, cfg.k_dtype = ATTN_KV_Q4_0, cfg.v_dtype = ATTN_KV_Q8_0;
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &cfg));
  tu_rng r = {9};
  float *k = malloc(sizeof(float) * (size_t)(B * Hk * N * D)), *v = malloc(sizeof(float) * (size_t)(B * Hk * N * Dv));
  tu_fill_f32(&r, k, B * Hk * N * D, 2.0);
  tu_fill_f32(&r, v, B * Hk * N * Dv, 2.0);
  const int64_t ks[4] = {B, Hk, N, D}, vs[4] = {B, Hk, N, Dv};
  attn_tensor tk = attn_tensor_view(k, ATTN_F32, 4, ks), tv = attn_tensor_view(v, ATTN_F32, 4, vs);
  const int64_t n_new[2] = {N, 3};
  CHECK_OK(ctx, attn_kv_cache_append(ctx, cache, &tk, &tv, n_new));
  CHECK_OK(ctx, attn_kv_cache_copy_row(ctx, cache, 1, 0));
  for (int64_t b = 0; b < B; b++) {
    attn_tensor vk, vv;
    CHECK_OK(ctx, attn_kv_cache_view(ctx, &vk, &vv, cache, b));
    CHECK(vk.dtype == ATTN_U8 && vk.shape[2] == N && vk.shape[3] == 36 && vv.shape[3] == 102, "view of blocks: %s [.., %lld, %lld]",
          attn_dtype_name(vk.dtype), (long long)vk.shape[2], (long long)vk.shape[3]);
    int same = 1;
    uint8_t want[128];
    for (int64_t g = 0; g < Hk; g++)
      for (int64_t j = 0; j < N; j++) {
        ref_encode(ATTN_KV_Q4_0, want, k + ((0 * Hk + g) * N + j) * D, D); /* row 1 is row 0's copy */
        same &= memcmp(want, (uint8_t *)vk.data + g * vk.strides[1] + j * vk.strides[2], 36) == 0;
        ref_encode(ATTN_KV_Q8_0, want, v + ((0 * Hk + g) * N + j) * Dv, Dv);
        same &= memcmp(want, (uint8_t *)vv.data + g * vv.strides[1] + j * vv.strides[2], 102) == 0;
      }
    CHECK(same, "row %lld: the cache's blocks are not the definition's", (long long)b);
  }
  attn_kv_cache_destroy(cache);
  free(k), free(v);
  attn_ctx_destroy(ctx);
}

/* ---- (2) attend over quantized storage against the oracle ---- */

typedef struct options {
  const char *name;
  int64_t window;
  double softcap;
  int alibi, sinks, rope;
  int64_t chunk;
} options;

typedef struct setup {
  attn_kv_dtype kt, vt;
  int64_t B, Hq, Hk, D, Dv, Nq;
  options opt;
} setup;

/* Fills the cache: two appends with per-row counts, then NaN tokens
 * appended and truncated away, then every byte past each row's length set to
 * 0xff (an f16 NaN scale, NaN floats): none of it may reach an output. */
static void fill_cache(attn_ctx *ctx, attn_kv_cache *cache, const setup *s, const int64_t *len, tu_rng *r) {
  const attn_kv_cache_config *c = attn_kv_cache_get_config(cache);
  for (int step = 0; step < 3; step++) {
    int64_t n = 0, n_new[8];
    for (int64_t b = 0; b < s->B; b++) {
      n_new[b] = step == 0 ? len[b] - len[b] / 3 : step == 1 ? len[b] / 3 : 4;
      n = n_new[b] > n ? n_new[b] : n;
    }
    const int64_t ks[4] = {s->B, s->Hk, n, s->D}, vs[4] = {s->B, s->Hk, n, s->Dv};
    float *k = malloc(sizeof(float) * (size_t)(s->B * s->Hk * n * s->D + 1));
    float *v = malloc(sizeof(float) * (size_t)(s->B * s->Hk * n * s->Dv + 1));
    tu_fill_f32(r, k, s->B * s->Hk * n * s->D, 1.5);
    tu_fill_f32(r, v, s->B * s->Hk * n * s->Dv, 1.5);
    if (step == 2) tu_poison_f32(k, s->B * s->Hk * n * s->D), tu_poison_f32(v, s->B * s->Hk * n * s->Dv);
    attn_tensor tk = attn_tensor_view(k, ATTN_F32, 4, ks), tv = attn_tensor_view(v, ATTN_F32, 4, vs);
    CHECK_OK(ctx, attn_kv_cache_append(ctx, cache, &tk, &tv, n_new));
    free(k), free(v);
  }
  for (int64_t b = 0; b < s->B; b++) {
    CHECK_OK(ctx, attn_kv_cache_truncate(ctx, cache, b, len[b]));
    attn_tensor vk, vv;
    CHECK_OK(ctx, attn_kv_cache_view(ctx, &vk, &vv, cache, b));
    const attn_tensor *t[2] = {&vk, &vv};
    for (int kind = 0; kind < 2; kind++) { /* each head's plane past the row's tokens */
      const size_t es = attn_dtype_size(t[kind]->dtype), row = (size_t)t[kind]->shape[3] * es;
      for (int64_t g = 0; g < s->Hk; g++)
        memset((char *)t[kind]->data + (size_t)(g * t[kind]->strides[1]) * es + (size_t)len[b] * row, 0xff,
               (size_t)(c->capacity - len[b]) * row);
    }
  }
}

/* Row b's keys (kind 0) or values as f32 [Hk, len, F], decoded by this file from the cache's bytes. */
static float *stored_f32(attn_ctx *ctx, const attn_kv_cache *cache, int kind, int64_t b, attn_kv_dtype dt, int64_t F) {
  attn_tensor vk, vv;
  CHECK_OK(ctx, attn_kv_cache_view(ctx, &vk, &vv, cache, b));
  const attn_tensor *t = kind ? &vv : &vk;
  const int64_t Hk = t->shape[1], len = t->shape[2];
  float *x = malloc(sizeof(float) * (size_t)(Hk * len * F + 1));
  for (int64_t g = 0; g < Hk; g++)
    for (int64_t j = 0; j < len; j++) {
      float *dst = x + (g * len + j) * F;
      if (dt == ATTN_KV_Q8_0 || dt == ATTN_KV_Q4_0)
        ref_decode(dt, dst, (const uint8_t *)t->data + g * t->strides[1] + j * t->strides[2], F);
      else
        for (int64_t f = 0; f < F; f++) {
          const int64_t o = g * t->strides[1] + j * t->strides[2] + f;
          dst[f] = dt == ATTN_KV_F32 ? ((float *)t->data)[o]
                   : dt == ATTN_KV_F16 ? tu_f16_to_f32(((uint16_t *)t->data)[o])
                                       : tu_bf16_to_f32(((uint16_t *)t->data)[o]);
        }
    }
  return x;
}

/* Makes the cache of s with rows of lengths len and its queries; attends
 * them on every kernel and 1-3 threads; each output against the oracle. */
static void attend_case(const setup *s, const int64_t *len, const char *only, uint64_t seed) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  tu_rng r = {seed};
  attn_rope_opts rope;
  attn_rope_opts_init(&rope);
  attn_kv_cache_config cfg;
  int64_t cap = 0;
  for (int64_t b = 0; b < s->B; b++) cap = len[b] > cap ? len[b] : cap;
  attn_kv_cache_config_init(&cfg, s->B, cap + 6, s->Hk, s->D);
  cfg.v_head_dim = s->Dv, cfg.k_dtype = s->kt, cfg.v_dtype = s->vt;
  cfg.rope = s->opt.rope ? &rope : NULL;
  attn_kv_cache *cache;
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &cfg));
  fill_cache(ctx, cache, s, len, &r);

  const int64_t B = s->B, Hq = s->Hq, Nq = s->Nq, D = s->D, Dv = s->Dv;
  const int64_t qs[4] = {B, Hq, Nq, D}, os[4] = {B, Hq, Nq, Dv}, hs[1] = {Hq};
  float *q = malloc(sizeof(float) * (size_t)(B * Hq * Nq * D)), slopes[64], sinks[64];
  tu_fill_f32(&r, q, B * Hq * Nq * D, 1.0);
  attn_alibi_slopes(slopes, Hq);
  tu_fill_f32(&r, sinks, Hq, 2.0);
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, qs), tsl = attn_tensor_view(slopes, ATTN_F32, 1, hs);
  attn_tensor tsi = attn_tensor_view(sinks, ATTN_F32, 1, hs);
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.window = s->opt.window, o.softcap = s->opt.softcap, o.chunk = s->opt.chunk;
  o.alibi_slopes = s->opt.alibi ? &tsl : NULL;
  o.sinks = s->opt.sinks ? &tsi : NULL;

  /* the oracle, row by row on the stored keys and values (queries rotated at their positions) */
  double *ref = malloc(sizeof(double) * (size_t)(B * Hq * Nq * Dv)), *ref_lse = malloc(sizeof(double) * (size_t)(B * Hq * Nq));
  for (int64_t b = 0; b < B; b++) {
    float *kb = stored_f32(ctx, cache, 0, b, s->kt, D), *vb = stored_f32(ctx, cache, 1, b, s->vt, Dv);
    const int64_t q1[4] = {1, Hq, Nq, D}, k1[4] = {1, s->Hk, len[b], D}, v1[4] = {1, s->Hk, len[b], Dv};
    const int64_t o1[4] = {1, Hq, Nq, Dv};
    float *qb = malloc(sizeof(float) * (size_t)(Hq * Nq * D));
    memcpy(qb, q + b * Hq * Nq * D, sizeof(float) * (size_t)(Hq * Nq * D));
    attn_tensor tqb = attn_tensor_view(qb, ATTN_F32, 4, q1);
    if (s->opt.rope) {
      int64_t pos[64];
      for (int64_t i = 0; i < Nq; i++) pos[i] = len[b] - Nq + i;
      attn_rope_opts ro = rope;
      ro.positions = pos;
      CHECK_OK(ctx, attn_rope(ctx, &tqb, &tqb, &ro));
    }
    attn_tensor tkb = attn_tensor_view(kb, ATTN_F32, 4, k1), tvb = attn_tensor_view(vb, ATTN_F32, 4, v1);
    attn_tensor tr = attn_tensor_view(ref + b * Hq * Nq * Dv, ATTN_F64, 4, o1);
    attn_tensor trl = attn_tensor_view(ref_lse + b * Hq * Nq, ATTN_F64, 3, o1);
    attn_sdpa_opts ro = o;
    ro.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
    CHECK_OK(ctx, attn_sdpa_ref(ctx, &tr, &trl, NULL, &tqb, &tkb, &tvb, &ro));
    free(kb), free(vb), free(qb);
  }

  const attn_kernel kernels[6] = {ATTN_KERNEL_REF, ATTN_KERNEL_C, ATTN_KERNEL_AVX2, ATTN_KERNEL_AVX512,
                                  ATTN_KERNEL_AVX512_BF16, ATTN_KERNEL_AMX};
  float *out = malloc(sizeof(float) * (size_t)(B * Hq * Nq * Dv)), *first = malloc(sizeof(float) * (size_t)(B * Hq * Nq * Dv));
  float *lse = malloc(sizeof(float) * (size_t)(B * Hq * Nq));
  attn_tensor to = attn_tensor_view(out, ATTN_F32, 4, os), tl = attn_tensor_view(lse, ATTN_F32, 3, os);
  for (int ki = 0; ki < 6; ki++) {
    if (only && strcmp(only, attn_kernel_name(kernels[ki]))) continue;
    if (!attn_kernel_supported(kernels[ki])) continue; /* main skips (77) when the one asked for is missing */
    attn_ctx_set_kernel(ctx, kernels[ki]);
    for (int threads = 1; threads <= 3; threads++) {
      attn_ctx_set_threads(ctx, threads);
      tu_poison_f32(out, B * Hq * Nq * Dv);
      tu_poison_f32(lse, B * Hq * Nq);
      CHECK_OK(ctx, attn_kv_cache_attend(ctx, cache, &to, &tl, &tq, &o));
      double lse_err = 0;
      for (int64_t i = 0; i < B * Hq * Nq; i++)
        if (!(fabs(lse[i] - ref_lse[i]) <= lse_err)) lse_err = fabs(lse[i] - ref_lse[i]); /* NaN sticks */
      CHECK(lse_err <= 1e-5, "k %s v %s, %s, Nq %lld, kernel %s threads %d: lse off by %.3g", attn_kv_dtype_name(s->kt),
            attn_kv_dtype_name(s->vt), s->opt.name, (long long)Nq, attn_kernel_name(kernels[ki]), threads, lse_err);
      if (threads == 1) memcpy(first, out, sizeof(float) * (size_t)(B * Hq * Nq * Dv));
      else
        CHECK(memcmp(first, out, sizeof(float) * (size_t)(B * Hq * Nq * Dv)) == 0,
              "k %s v %s, %s, Nq %lld, kernel %s: %d threads differ from 1", attn_kv_dtype_name(s->kt),
              attn_kv_dtype_name(s->vt), s->opt.name, (long long)Nq, attn_kernel_name(kernels[ki]), threads);
      double *got = tu_to_f64(&to);
      const double err = tu_rel_l2(got, ref, B * Hq * Nq * Dv);
      const int nans = tu_count_nan(got, B * Hq * Nq * Dv);
      CHECK(err <= 1e-6 && nans == 0, "k %s v %s, %s, Hq %lld Hk %lld D %lld Dv %lld Nq %lld, kernel %s threads %d: rel L2 %.3g, %d NaN",
            attn_kv_dtype_name(s->kt), attn_kv_dtype_name(s->vt), s->opt.name, (long long)Hq, (long long)s->Hk,
            (long long)D, (long long)Dv, (long long)Nq, attn_kernel_name(kernels[ki]), threads, err, nans);
      free(got);
    }
  }
  attn_kv_cache_destroy(cache);
  attn_ctx_destroy(ctx);
  free(q), free(ref), free(ref_lse), free(out), free(first), free(lse);
}

static void attend_all(const char *only) {
  const options opts[] = {{"plain", 0, 0, 0, 0, 0, 0},     {"window 200", 200, 0, 0, 0, 0, 0},
                          {"softcap 5", 0, 5.0, 0, 0, 0, 0}, {"alibi", 0, 0, 1, 0, 0, 0},
                          {"sinks", 0, 0, 0, 1, 0, 0},       {"rope", 0, 0, 0, 0, 1, 0},
                          {"chunk 1000", 0, 0, 0, 0, 0, 1000}, {"all", 300, 5.0, 1, 1, 1, 0},
                          {"all, chunk 32", 300, 5.0, 1, 1, 1, 32}};
  const attn_kv_dtype pairs[][2] = {{ATTN_KV_Q8_0, ATTN_KV_Q8_0}, {ATTN_KV_Q4_0, ATTN_KV_Q4_0},
                                    {ATTN_KV_Q8_0, ATTN_KV_Q4_0}, {ATTN_KV_Q4_0, ATTN_KV_F16},
                                    {ATTN_KV_F32, ATTN_KV_Q8_0}};
  const int64_t len[3] = {2100, 37, 6}; /* past a decode chunk (2048 keys); short rows */
  uint64_t seed = 100;
  for (size_t pi = 0; pi < sizeof pairs / sizeof pairs[0]; pi++)
    for (size_t oi = 0; oi < sizeof opts / sizeof opts[0]; oi++) {
      /* decode steps (Nq 1 and 2, GQA 4: rows 4 and 8) and a prefill of 6 (24 rows: the row-by-row path) */
      const int64_t nqs[3] = {1, 2, 6};
      for (int ni = 0; ni < 3; ni++) {
        const int wide = (pi + oi + (size_t)ni) % 2; /* D 128 with Dv 32, or D = Dv = 64 */
        const setup s = {pairs[pi][0], pairs[pi][1], 3, 8, 2, wide ? 128 : 64, wide ? 32 : 64, nqs[ni], opts[oi]};
        attend_case(&s, len, only, seed++);
      }
    }
}

/* ---- (2b) the decode kernels on every row count and head size ---- */

/* Key j of kv head g of row b's keys (kind 0) or values: its block blk's f16
 * scale becomes NaN; or, with blk < 0, all its bytes 0xff (NaN scales, garbage quants). */
static void poison_key(attn_ctx *ctx, attn_kv_cache *cache, int kind, attn_kv_dtype dt, int64_t b, int64_t g, int64_t j,
                       int64_t blk) {
  attn_tensor vk, vv;
  CHECK_OK(ctx, attn_kv_cache_view(ctx, &vk, &vv, cache, b));
  const attn_tensor *t = kind ? &vv : &vk;
  uint8_t *row = (uint8_t *)t->data + g * t->strides[1] + j * t->strides[2];
  if (blk < 0) memset(row, 0xff, (size_t)t->shape[3]);
  else row[blk * (dt == ATTN_KV_Q8_0 ? 34 : 18)] = 0x00, row[blk * (dt == ATTN_KV_Q8_0 ? 34 : 18) + 1] = 0x7e;
}

/* Rows 1..8 per kv head (GQA group x Nq), D and Dv of one to four blocks, every
 * pairing of q8_0 and q4_0, on every kernel and 1-3 threads (bitwise the same).
 * A window of 300 hides the oldest keys of the long row from every query row;
 * they hold 0xff blocks (NaN), some in a block of 128 keys with visible ones (so
 * pv runs sparse there). The newest key, hidden by causality from all but the
 * last query row when Nq > 1, has a NaN scale in one K block (kv head 0) and in
 * one V block (kv head 1): NaN must reach exactly the outputs where the oracle,
 * on the same stored values, has it (a whole row; a V block's 32 columns) and
 * no other; the rest within 1e-6 rel L2 of it. */
static void kernel_shapes(const char *only) {
  const int64_t groups[][3] = {{2, 2, 1}, {4, 2, 1},  {6, 2, 1}, {2, 2, 3}, {4, 2, 2},
                               {10, 2, 1}, {6, 2, 2}, {14, 2, 1}, {8, 2, 2}, {16, 2, 1}}; /* Hq, Hk, Nq */
  const int64_t dims[][2] = {{32, 32}, {64, 64}, {96, 96}, {128, 128}, {128, 96}, {96, 32}};
  const attn_kv_dtype pairs[][2] = {{ATTN_KV_Q8_0, ATTN_KV_Q8_0}, {ATTN_KV_Q4_0, ATTN_KV_Q4_0},
                                    {ATTN_KV_Q8_0, ATTN_KV_Q4_0}, {ATTN_KV_Q4_0, ATTN_KV_Q8_0}};
  const attn_kernel kernels[6] = {ATTN_KERNEL_REF, ATTN_KERNEL_C, ATTN_KERNEL_AVX2, ATTN_KERNEL_AVX512,
                                  ATTN_KERNEL_AVX512_BF16, ATTN_KERNEL_AMX};
  const int64_t len[2] = {2100, 130}, window = 300; /* the long row crosses a decode chunk (2048 keys) */
  uint64_t seed = 7000;
  int cases = 0, nan_rows = 0;
  for (size_t gi = 0; gi < sizeof groups / sizeof groups[0]; gi++)
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++)
      for (size_t pi = 0; pi < sizeof pairs / sizeof pairs[0]; pi++) {
        const options opt = {"window 300", window, 0, 0, 0, 0, 0};
        const setup s = {pairs[pi][0], pairs[pi][1], 2, groups[gi][0], groups[gi][1], dims[di][0], dims[di][1],
                         groups[gi][2], opt};
        attn_ctx *ctx;
        attn_ctx_create(&ctx);
        tu_rng r = {seed++};
        attn_kv_cache_config cfg;
        attn_kv_cache_config_init(&cfg, s.B, len[0] + 6, s.Hk, s.D);
        cfg.v_head_dim = s.Dv, cfg.k_dtype = s.kt, cfg.v_dtype = s.vt;
        attn_kv_cache *cache;
        CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &cfg));
        fill_cache(ctx, cache, &s, len, &r);
        const int64_t B = s.B, Hq = s.Hq, Hk = s.Hk, Nq = s.Nq, D = s.D, Dv = s.Dv;
        for (int64_t g = 0; g < Hk; g++) /* hidden from every query row: j <= len - Nq - window */
          for (int64_t j = 0; j <= len[0] - Nq - window; j++) {
            poison_key(ctx, cache, 0, s.kt, 0, g, j, -1);
            poison_key(ctx, cache, 1, s.vt, 0, g, j, -1);
          }
        poison_key(ctx, cache, 0, s.kt, 0, 0, len[0] - 1, D / 32 - 1);
        poison_key(ctx, cache, 1, s.vt, 0, 1, len[0] - 1, Dv / 32 > 1 ? 1 : 0);

        const int64_t n_out = B * Hq * Nq * Dv, qs[4] = {B, Hq, Nq, D}, os[4] = {B, Hq, Nq, Dv};
        float *q = malloc(sizeof(float) * (size_t)(B * Hq * Nq * D));
        tu_fill_f32(&r, q, B * Hq * Nq * D, 1.0);
        attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, qs);
        attn_sdpa_opts o;
        attn_sdpa_opts_init(&o);
        o.window = window;
        double *ref = malloc(sizeof(double) * (size_t)n_out);
        for (int64_t b = 0; b < B; b++) { /* the oracle on the stored values, poison included */
          float *kb = stored_f32(ctx, cache, 0, b, s.kt, D), *vb = stored_f32(ctx, cache, 1, b, s.vt, Dv);
          const int64_t q1[4] = {1, Hq, Nq, D}, k1[4] = {1, Hk, len[b], D}, v1[4] = {1, Hk, len[b], Dv};
          const int64_t o1[4] = {1, Hq, Nq, Dv};
          attn_tensor tqb = attn_tensor_view(q + b * Hq * Nq * D, ATTN_F32, 4, q1);
          attn_tensor tkb = attn_tensor_view(kb, ATTN_F32, 4, k1), tvb = attn_tensor_view(vb, ATTN_F32, 4, v1);
          attn_tensor tr = attn_tensor_view(ref + b * Hq * Nq * Dv, ATTN_F64, 4, o1);
          attn_sdpa_opts ro = o;
          ro.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
          CHECK_OK(ctx, attn_sdpa_ref(ctx, &tr, NULL, NULL, &tqb, &tkb, &tvb, &ro));
          free(kb), free(vb);
        }
        int ref_nans = 0;
        for (int64_t i = 0; i < n_out; i++) ref_nans += isnan(ref[i]) != 0;
        CHECK(ref_nans > 0 && ref_nans <= n_out / 2, "case %d: the oracle has %d NaN of %lld", cases, ref_nans,
              (long long)n_out);
        nan_rows += ref_nans;

        float *out = malloc(sizeof(float) * (size_t)n_out), *first = malloc(sizeof(float) * (size_t)n_out);
        attn_tensor to = attn_tensor_view(out, ATTN_F32, 4, os);
        for (int ki = 0; ki < 6; ki++) {
          if (only && strcmp(only, attn_kernel_name(kernels[ki]))) continue;
          if (!attn_kernel_supported(kernels[ki])) continue;
          attn_ctx_set_kernel(ctx, kernels[ki]);
          for (int threads = 1; threads <= 3; threads++) {
            attn_ctx_set_threads(ctx, threads);
            tu_poison_f32(out, n_out);
            CHECK_OK(ctx, attn_kv_cache_attend(ctx, cache, &to, NULL, &tq, &o));
            if (threads == 1) memcpy(first, out, sizeof(float) * (size_t)n_out);
            else
              CHECK(memcmp(first, out, sizeof(float) * (size_t)n_out) == 0, "k %s v %s, Hq %lld Hk %lld Nq %lld D %lld Dv %lld, kernel %s: %d threads differ from 1",
                    attn_kv_dtype_name(s.kt), attn_kv_dtype_name(s.vt), (long long)Hq, (long long)Hk, (long long)Nq,
                    (long long)D, (long long)Dv, attn_kernel_name(kernels[ki]), threads);
            double num = 0, den = 0;
            int64_t wrong_nan = 0;
            for (int64_t i = 0; i < n_out; i++) {
              if (isnan(ref[i]) || isnan(out[i])) {
                wrong_nan += !isnan(ref[i]) || !isnan(out[i]);
                continue;
              }
              num += (out[i] - ref[i]) * (out[i] - ref[i]), den += ref[i] * ref[i];
            }
            const double err = den > 0 ? sqrt(num / den) : sqrt(num);
            CHECK(err <= 1e-6 && wrong_nan == 0,
                  "k %s v %s, Hq %lld Hk %lld Nq %lld D %lld Dv %lld, kernel %s threads %d: rel L2 %.3g, %lld outputs NaN in one only",
                  attn_kv_dtype_name(s.kt), attn_kv_dtype_name(s.vt), (long long)Hq, (long long)Hk, (long long)Nq,
                  (long long)D, (long long)Dv, attn_kernel_name(kernels[ki]), threads, err, (long long)wrong_nan);
          }
        }
        attn_kv_cache_destroy(cache);
        attn_ctx_destroy(ctx);
        free(q), free(ref), free(out), free(first);
        cases++;
      }
  printf("  decode kernels: %d cases of rows 1-8, D/Dv 32-128, NaN blocks hidden and visible (%d NaN outputs expected)\n",
         cases, nan_rows);
}

/* ---- (3) how far the formats move the output from an f32 cache's (printed) ---- */

static void against_f32(void) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  const int64_t B = 1, Hq = 8, Hk = 2, N = 1024, D = 128;
  tu_rng r = {31};
  const int64_t ks[4] = {B, Hk, N, D}, qs[4] = {B, Hq, 1, D};
  float *k = malloc(sizeof(float) * (size_t)(B * Hk * N * D)), *v = malloc(sizeof(float) * (size_t)(B * Hk * N * D));
  float q[8 * 128], out[8 * 128];
  tu_fill_f32(&r, k, B * Hk * N * D, 1.0);
  tu_fill_f32(&r, v, B * Hk * N * D, 1.0);
  tu_fill_f32(&r, q, B * Hq * D, 3.0); /* sharper attention than uniform */
  attn_tensor tk = attn_tensor_view(k, ATTN_F32, 4, ks), tv = attn_tensor_view(v, ATTN_F32, 4, ks);
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, qs), to = attn_tensor_view(out, ATTN_F32, 4, qs);
  const attn_kv_dtype dts[5] = {ATTN_KV_F32, ATTN_KV_F16, ATTN_KV_BF16, ATTN_KV_Q8_0, ATTN_KV_Q4_0};
  const double bound[5] = {0, 1e-2, 5e-2, 5e-2, 0.5};
  double base[8 * 128];
  for (int i = 0; i < 5; i++) {
    attn_kv_cache_config cfg;
    attn_kv_cache_config_init(&cfg, B, N, Hk, D);
    cfg.k_dtype = cfg.v_dtype = dts[i];
    attn_kv_cache *cache;
    CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &cfg));
    CHECK_OK(ctx, attn_kv_cache_append(ctx, cache, &tk, &tv, NULL));
    CHECK_OK(ctx, attn_kv_cache_attend(ctx, cache, &to, NULL, &tq, NULL));
    double *got = tu_to_f64(&to);
    if (i == 0) memcpy(base, got, sizeof base);
    const double err = tu_rel_l2(got, base, Hq * D);
    printf("  storage %-4s: output rel L2 against an f32 cache %.3g (1024 keys, D 128, random inputs)\n",
           attn_kv_dtype_name(dts[i]), err);
    CHECK(err <= bound[i], "%s storage moves the output by %.3g", attn_kv_dtype_name(dts[i]), err);
    free(got);
    attn_kv_cache_destroy(cache);
  }
  free(k), free(v);
  attn_ctx_destroy(ctx);
}

int main(int argc, char **argv) {
  const char *only = argc > 1 ? argv[1] : NULL;
  if (only) tu_kernel_or_skip(only); /* 77 when this CPU lacks it */
  encoders();
  cache_config();
  attend_all(only);
  kernel_shapes(only);
  against_f32();
  return tu_finish("test_kv_quant");
}
