/* The KV cache: keys and values of past tokens per row, appended as decoding
 * goes and attended by each new token's queries. A decoding step (a few
 * query rows per kv head) is one call of the decode kernel over the whole
 * batch, each row's length saying which keys exist (attn__sdpa.kv_len), so
 * rows of mixed lengths share one parallel region; a prefill attends row by
 * row through attn_sdpa on views of the storage (or, for block formats or
 * keys and values of different dtypes, on an f32 copy of the row). */
#include "internal.h"
#include "logit.h"
#include "opts.h"
#include "quant.h"

#include <stdio.h>
#include <stdlib.h>

struct attn_kv_cache {
  attn_kv_cache_config cfg; /* Dv resolved; rope points at the copy below */
  attn_rope_opts rope;      /* the caller's, when cfg.rope is set */
  void *k, *v;              /* [B, Hk, capacity, D] and [B, Hk, capacity, Dv] rows in kt, vt */
  attn_dtype kt, vt;        /* storage: a float dtype or quant.h's ATTN__Q8_0, ATTN__Q4_0 */
  int64_t *len;             /* [B] tokens per row */
};

/* ---- the block formats (attn.h's attn_kv_dtype says what they are) ---- */

/* 1 when every x[0..n) is finite. */
static int all_finite(const float *x, int n) {
  int ok = 1;
  for (int i = 0; i < n; i++) ok &= isfinite(x[i]) != 0;
  return ok;
}

// dst: one q8_0 block (34 bytes) of x[0..32).
static void quantize_q8_0(uint8_t *dst, const float *x) {
  int8_t *q = (int8_t *)(dst + 2);
  if (!all_finite(x, ATTN__QK)) { /* a non-finite value poisons its block: see attn.h */
    const uint16_t nan = 0x7e00;
    memcpy(dst, &nan, 2);
    memset(q, 0, ATTN__QK);
    return;
  }
  float amax = 0;
  for (int i = 0; i < ATTN__QK; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
  const float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
  const uint16_t h = attn__f32_to_f16(d);
  memcpy(dst, &h, 2);
  for (int i = 0; i < ATTN__QK; i++) q[i] = (int8_t)roundf(x[i] * id); /* |x * id| <= 127 (+ an ulp) */
}

// dst: one q4_0 block (18 bytes) of x[0..32).
static void quantize_q4_0(uint8_t *dst, const float *x) {
  uint8_t *q = dst + 2;
  if (!all_finite(x, ATTN__QK)) {
    const uint16_t nan = 0x7e00;
    memcpy(dst, &nan, 2);
    memset(q, 0x88, ATTN__QK / 2); /* q = 8: value 0 times the NaN scale */
    return;
  }
  float amax = 0, max = 0; /* the element of largest magnitude, with its sign; the first on a tie */
  for (int i = 0; i < ATTN__QK; i++)
    if (fabsf(x[i]) > amax) amax = fabsf(x[i]), max = x[i];
  const float d = max / -8.0f, id = d != 0 ? 1.0f / d : 0.0f;
  const uint16_t h = attn__f32_to_f16(d);
  memcpy(dst, &h, 2);
  for (int j = 0; j < ATTN__QK / 2; j++) {
    /* x * id lies in [-8, 8] (+ an ulp), so x * id + 8.5 > 0 and truncation is floor */
    const int lo = (int)(x[j] * id + 8.5f), hi = (int)(x[j + ATTN__QK / 2] * id + 8.5f);
    q[j] = (uint8_t)((lo > 15 ? 15 : lo) | (hi > 15 ? 15 : hi) << 4);
  }
}

void attn__quantize_row(attn_dtype dt, uint8_t *dst, const float *src, int64_t n) {
  const size_t bb = attn__qblock_bytes(dt);
  for (int64_t c = 0; c < n; c += ATTN__QK, dst += bb) {
    if (dt == ATTN__Q8_0) quantize_q8_0(dst, src + c);
    else quantize_q4_0(dst, src + c);
  }
}

void attn__dequantize_row(attn_dtype dt, float *dst, const uint8_t *src, int64_t n) {
  const size_t bb = attn__qblock_bytes(dt);
  for (int64_t c = 0; c < n; c += ATTN__QK, src += bb) {
    const float d = attn__qscale(src);
    if (dt == ATTN__Q8_0)
      for (int i = 0; i < ATTN__QK; i++) dst[c + i] = d * (float)((const int8_t *)(src + 2))[i];
    else
      for (int j = 0; j < ATTN__QK / 2; j++) {
        dst[c + j] = d * (float)((src[2 + j] & 15) - 8);
        dst[c + j + ATTN__QK / 2] = d * (float)((src[2 + j] >> 4) - 8);
      }
  }
}

/* The storage code of a public kind (resolved: never ATTN_KV_AS_DTYPE); -1 if unknown. */
static int storage_of(attn_kv_dtype k) {
  switch (k) {
    case ATTN_KV_F32: return ATTN_F32;
    case ATTN_KV_F16: return ATTN_F16;
    case ATTN_KV_BF16: return ATTN_BF16;
    case ATTN_KV_Q8_0: return (int)ATTN__Q8_0;
    case ATTN_KV_Q4_0: return (int)ATTN__Q4_0;
    default: return -1;
  }
}

const char *attn_kv_dtype_name(attn_kv_dtype dt) {
  static const char *const names[] = {"as_dtype", "f32", "f16", "bf16", "q8_0", "q4_0"};
  return (unsigned)dt < sizeof names / sizeof names[0] ? names[dt] : "?";
}

size_t attn_kv_dtype_bytes(attn_kv_dtype dt, int64_t n) {
  const int s = storage_of(dt);
  if (s < 0 || n < 0 || (attn__is_quant((attn_dtype)s) && n % ATTN__QK)) return 0;
  return attn__row_bytes((attn_dtype)s, n);
}

static attn_status check_codec(attn_ctx *ctx, attn_kv_dtype dt, const void *a, const void *b, int64_t n,
                               const char *fn) {
  if (dt != ATTN_KV_Q8_0 && dt != ATTN_KV_Q4_0)
    return attn__fail(ctx, ATTN_E_INVALID, "%s: dt must be ATTN_KV_Q8_0 or ATTN_KV_Q4_0, got %d", fn, (int)dt);
  if (n < 0 || n % ATTN__QK)
    return attn__fail(ctx, ATTN_E_INVALID, "%s: n = %lld is not a multiple of %d (the block size)", fn, (long long)n,
                      ATTN__QK);
  if (n && (!a || !b)) return attn__fail(ctx, ATTN_E_INVALID, "%s: null buffer", fn);
  return ATTN_OK;
}

attn_status attn_kv_quantize(attn_ctx *ctx, attn_kv_dtype dt, void *dst, const float *src, int64_t n) {
  ATTN__ENTER(ctx);
  attn_status st = check_codec(ctx, dt, dst, src, n, "attn_kv_quantize");
  if (!st) attn__quantize_row((attn_dtype)storage_of(dt), dst, src, n);
  return st;
}

attn_status attn_kv_dequantize(attn_ctx *ctx, attn_kv_dtype dt, float *dst, const void *src, int64_t n) {
  ATTN__ENTER(ctx);
  attn_status st = check_codec(ctx, dt, dst, src, n, "attn_kv_dequantize");
  if (!st) attn__dequantize_row((attn_dtype)storage_of(dt), dst, src, n);
  return st;
}

/* The public kind of a storage code. */
static attn_kv_dtype kind_of(attn_dtype s) {
  return s == ATTN_F32 ? ATTN_KV_F32 : s == ATTN_F16 ? ATTN_KV_F16 : s == ATTN_BF16 ? ATTN_KV_BF16
         : s == ATTN__Q8_0 ? ATTN_KV_Q8_0 : ATTN_KV_Q4_0;
}

attn_status attn__kv_storage(attn_ctx *ctx, const char *fn, attn_kv_dtype kinds[2], attn_dtype as_dtype,
                             const int64_t dims[2], attn_dtype storage[2]) {
  for (int kind = 0; kind < 2; kind++) {
    const int s = kinds[kind] == ATTN_KV_AS_DTYPE ? (int)as_dtype : storage_of(kinds[kind]);
    if (s < 0)
      return attn__fail(ctx, ATTN_E_DTYPE, "%s: %s_dtype %d is not an attn_kv_dtype", fn, kind ? "v" : "k",
                        (int)kinds[kind]);
    storage[kind] = (attn_dtype)s;
    kinds[kind] = kind_of(storage[kind]);
    if (attn__is_quant(storage[kind]) && dims[kind] % ATTN__QK)
      return attn__fail(ctx, ATTN_E_INVALID,
                        "%s: %s storage %s takes blocks of %d values; %s = %lld is not a multiple of %d", fn,
                        kind ? "value" : "key", attn_kv_dtype_name(kinds[kind]), ATTN__QK,
                        kind ? "v_head_dim" : "head_dim", (long long)dims[kind], ATTN__QK);
  }
  return ATTN_OK;
}

void attn_kv_cache_config_init(attn_kv_cache_config *cfg, int64_t batch, int64_t capacity, int64_t kv_heads,
                               int64_t head_dim) {
  if (!cfg) return;
  memset(cfg, 0, sizeof *cfg);
  cfg->size = sizeof *cfg;
  cfg->batch = batch;
  cfg->capacity = capacity;
  cfg->kv_heads = kv_heads;
  cfg->head_dim = head_dim;
  cfg->dtype = ATTN_F32;
}

attn_status attn_kv_cache_create(attn_ctx *ctx, attn_kv_cache **out, const attn_kv_cache_config *cfg) {
  ATTN__ENTER(ctx);
  if (!out || !cfg) return attn__fail(ctx, ATTN_E_INVALID, "attn_kv_cache_create: null argument");
  *out = NULL;
  attn_kv_cache_config c;
  attn_kv_cache_config_init(&c, 0, 0, 0, 0);
  attn_status st = attn__read_sized(ctx, &c, sizeof c, cfg, "cfg", "attn_kv_cache_config_init");
  if (st) return st;
  if (!c.v_head_dim) c.v_head_dim = c.head_dim;
  if (c.batch < 1 || c.capacity < 1 || c.kv_heads < 1 || c.head_dim < 1 || c.v_head_dim < 1)
    return attn__fail(ctx, ATTN_E_INVALID,
                      "attn_kv_cache_create: batch (%lld), capacity (%lld), kv_heads (%lld) and head dims (%lld, %lld) "
                      "must be at least 1",
                      (long long)c.batch, (long long)c.capacity, (long long)c.kv_heads, (long long)c.head_dim,
                      (long long)c.v_head_dim);
  if (c.dtype != ATTN_F32 && c.dtype != ATTN_F16 && c.dtype != ATTN_BF16)
    return attn__fail(ctx, ATTN_E_DTYPE, "attn_kv_cache_create: storage must be f32, f16 or bf16, got %s",
                      attn_dtype_name(c.dtype));
  /* each kind's storage: its own, or dtype's */
  attn_kv_dtype asked[2] = {c.k_dtype, c.v_dtype};
  const int64_t dims[2] = {c.head_dim, c.v_head_dim};
  attn_dtype kinds[2];
  if ((st = attn__kv_storage(ctx, "attn_kv_cache_create", asked, c.dtype, dims, kinds))) return st;
  c.k_dtype = asked[0], c.v_dtype = asked[1];
  attn_rope_opts rope;
  attn_rope_opts_init(&rope);
  if (c.rope) {
    if ((st = attn__read_sized(ctx, &rope, sizeof rope, c.rope, "cfg.rope", "attn_rope_opts_init"))) return st;
    if (rope.positions || rope.position_offset || rope.transpose)
      return attn__fail(ctx, ATTN_E_INVALID, "attn_kv_cache_create: cfg.rope must leave positions, position_offset "
                                             "and transpose unset (the cache knows each token's position)");
    /* every other field checked now, on an empty [1, 1, 0, D] view, not at the first append */
    const int64_t s4[4] = {1, 1, 0, c.head_dim};
    attn_tensor none = attn_tensor_view(NULL, ATTN_F32, 4, s4);
    if ((st = attn_rope(ctx, &none, &none, &rope))) {
      char msg[ATTN__MSG_LEN];
      snprintf(msg, sizeof msg, "%s", attn_ctx_error(ctx));
      return attn__fail(ctx, st, "attn_kv_cache_create: cfg.rope: %s", msg);
    }
  }
  int64_t rows, nk, nv;
  if (attn__mul_overflows(c.batch, c.kv_heads, &rows) || attn__mul_overflows(rows, c.capacity, &rows) ||
      c.head_dim > INT64_MAX / 8 || c.v_head_dim > INT64_MAX / 8 ||
      attn__mul_overflows(rows, (int64_t)attn__row_bytes(kinds[0], c.head_dim), &nk) ||
      attn__mul_overflows(rows, (int64_t)attn__row_bytes(kinds[1], c.v_head_dim), &nv) ||
      (uint64_t)nk > SIZE_MAX / 4 || (uint64_t)nv > SIZE_MAX / 4)
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_kv_cache_create: a cache of this size cannot be addressed");
  attn_kv_cache *kc = calloc(1, sizeof *kc);
  if (kc) {
    kc->cfg = c;
    kc->rope = rope;
    kc->cfg.rope = c.rope ? &kc->rope : NULL;
    kc->kt = kinds[0], kc->vt = kinds[1];
    /* a kv head's capacity of 2 MiB or more in huge pages: a decoding step streams each
     * head's rows, and with 4 KiB pages their page walks held a step on a Xeon VM to 22 GB/s
     * where huge pages gave 31 (BENCHMARKS.md). Smaller heads stay in small pages, where
     * one touched huge page would make several heads' unused capacity resident. */
    const int64_t huge = (int64_t)2 << 20;
    kc->k = c.capacity * (int64_t)attn__row_bytes(kinds[0], c.head_dim) >= huge ? attn__huge_alloc((size_t)nk)
                                                                              : attn__aligned_alloc((size_t)nk);
    kc->v = c.capacity * (int64_t)attn__row_bytes(kinds[1], c.v_head_dim) >= huge ? attn__huge_alloc((size_t)nv)
                                                                                : attn__aligned_alloc((size_t)nv);
    kc->len = calloc((size_t)c.batch, sizeof(int64_t));
  }
  if (!kc || !kc->k || !kc->v || !kc->len) {
    attn_kv_cache_destroy(kc);
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_kv_cache_create: cannot allocate %lld + %lld bytes", (long long)nk,
                      (long long)nv);
  }
  *out = kc;
  return ATTN_OK;
}

void attn_kv_cache_destroy(attn_kv_cache *cache) {
  if (!cache) return;
  attn__aligned_free(cache->k);
  attn__aligned_free(cache->v);
  free(cache->len);
  free(cache);
}

const attn_kv_cache_config *attn_kv_cache_get_config(const attn_kv_cache *cache) { return cache ? &cache->cfg : NULL; }

int64_t attn_kv_cache_length(const attn_kv_cache *cache, int64_t b) {
  return cache && b >= 0 && b < cache->cfg.batch ? cache->len[b] : 0;
}

/* Row b's storage of one kind (0 keys, 1 values) as a [1, Hk, len, F] view,
 * F = D or Dv; a block format's as ATTN_U8 [1, Hk, len, its bytes per token]. */
static attn_tensor row_view(const attn_kv_cache *c, int kind, int64_t b, int64_t len) {
  const attn_dtype dt = kind ? c->vt : c->kt;
  const int64_t Fv = kind ? c->cfg.v_head_dim : c->cfg.head_dim;
  const int64_t F = attn__is_quant(dt) ? (int64_t)attn__row_bytes(dt, Fv) : Fv;
  const int64_t plane = c->cfg.capacity * F;
  attn_tensor t;
  memset(&t, 0, sizeof t);
  t.dtype = attn__is_quant(dt) ? ATTN_U8 : dt;
  t.data = (char *)(kind ? c->v : c->k) + (size_t)(b * c->cfg.kv_heads * plane) * attn_dtype_size(t.dtype);
  t.rank = 4;
  t.shape[0] = 1, t.shape[1] = c->cfg.kv_heads, t.shape[2] = len, t.shape[3] = F;
  t.strides[0] = c->cfg.kv_heads * plane, t.strides[1] = plane, t.strides[2] = F, t.strides[3] = 1;
  return t;
}

static attn_status check_new(attn_ctx *ctx, const attn_kv_cache *c, const attn_tensor *t, const char *what, int64_t F,
                             int64_t n) {
  attn_status st = attn__check_tensor(ctx, t, what, 4);
  if (st) return st;
  if (!attn__is_float(t->dtype))
    return attn__fail(ctx, ATTN_E_DTYPE, "attn_kv_cache_append: %s must be a float dtype, got %s", what,
                      attn_dtype_name(t->dtype));
  if (t->shape[0] != c->cfg.batch || t->shape[1] != c->cfg.kv_heads || t->shape[2] != n || t->shape[3] != F)
    return attn__fail(ctx, ATTN_E_SHAPE,
                      "attn_kv_cache_append: %s is [%lld, %lld, %lld, %lld]; want [B, Hk, n, %s] = [%lld, %lld, %lld, %lld]",
                      what, (long long)t->shape[0], (long long)t->shape[1], (long long)t->shape[2],
                      (long long)t->shape[3], what[0] == 'k' ? "D" : "Dv", (long long)c->cfg.batch,
                      (long long)c->cfg.kv_heads, (long long)n, (long long)F);
  return ATTN_OK;
}

/* Tokens [0, n) of row b of src (a [B, Hk, n, F] view) into dst (row b's
 * [1, Hk, *, F] view, or its raw blocks when qt is a block format) from
 * position at. row: scratch of F floats (for the blocks). */
static void copy_tokens(attn_tensor *dst, const attn_tensor *src, attn_dtype qt, float *row, int64_t b, int64_t at,
                        int64_t n) {
  const int64_t Hk = dst->shape[1], F = attn__is_quant(qt) ? src->shape[3] : dst->shape[3];
  for (int64_t g = 0; g < Hk; g++)
    for (int64_t j = 0; j < n; j++) {
      const int64_t so = b * src->strides[0] + g * src->strides[1] + j * src->strides[2];
      const int64_t d0 = g * dst->strides[1] + (at + j) * dst->strides[2];
      if (attn__is_quant(qt)) { /* quantized as the token's row is appended */
        for (int64_t f = 0; f < F; f++) row[f] = (float)attn__load(src->data, src->dtype, so + f * src->strides[3]);
        attn__quantize_row(qt, (uint8_t *)dst->data + d0, row, F);
      } else if (dst->dtype == ATTN_F32 && src->dtype == ATTN_F32 && src->strides[3] == 1)
        memcpy((float *)dst->data + d0, (const float *)src->data + so, (size_t)F * sizeof(float));
      else
        for (int64_t f = 0; f < F; f++)
          attn__store(dst->data, dst->dtype, d0 + f, attn__load(src->data, src->dtype, so + f * src->strides[3]));
    }
}

/* *out (f32, allocated here) = x [B, *, n, D] rotated by the cache's RoPE at the
 * positions its tokens take: appended after each row's tokens (queries: 0), or
 * for queries the row's last n (queries: 1; positions before 0, of rows holding
 * fewer than n tokens, see nothing anyway and are taken as 0). */
static attn_status rotate(attn_ctx *ctx, attn_tensor *out, const attn_kv_cache *cache, const attn_tensor *x, int64_t n,
                          int queries) {
  const int64_t B = cache->cfg.batch;
  int64_t *pos = malloc(sizeof(int64_t) * (size_t)(B * n + 1));
  if (!pos) return attn__fail(ctx, ATTN_E_NOMEM, "attn_kv_cache: out of memory for positions");
  for (int64_t b = 0; b < B; b++)
    for (int64_t i = 0; i < n; i++) {
      const int64_t p = queries ? cache->len[b] - n + i : cache->len[b] + i;
      pos[b * n + i] = p < 0 ? 0 : p;
    }
  attn_rope_opts ro = cache->rope;
  ro.positions = pos;
  attn_status st = attn_tensor_alloc(ctx, out, ATTN_F32, 4, x->shape);
  if (!st && (st = attn_rope(ctx, out, x, &ro))) attn_tensor_free(out);
  free(pos);
  return st;
}

attn_status attn_kv_cache_append(attn_ctx *ctx, attn_kv_cache *cache, const attn_tensor *k, const attn_tensor *v,
                                 const int64_t *n_new) {
  ATTN__ENTER(ctx);
  if (!cache || !k || !v) return attn__fail(ctx, ATTN_E_INVALID, "attn_kv_cache_append: null argument");
  const attn_kv_cache_config *c = &cache->cfg;
  const int64_t n = k->rank == 4 ? k->shape[2] : -1;
  attn_status st;
  if ((st = check_new(ctx, cache, k, "k", c->head_dim, n)) || (st = check_new(ctx, cache, v, "v", c->v_head_dim, n)))
    return st;
  for (int64_t b = 0; b < c->batch; b++) { /* every row is checked before any is written */
    const int64_t m = n_new ? n_new[b] : n;
    if (m < 0 || m > n)
      return attn__fail(ctx, ATTN_E_INVALID, "attn_kv_cache_append: n_new[%lld] = %lld is outside 0..%lld",
                        (long long)b, (long long)m, (long long)n);
    if (m > c->capacity - cache->len[b])
      return attn__fail(ctx, ATTN_E_SHAPE,
                        "attn_kv_cache_append: row %lld holds %lld of %lld tokens; %lld more do not fit (nothing appended)",
                        (long long)b, (long long)cache->len[b], (long long)c->capacity, (long long)m);
  }
  const int64_t F = c->head_dim > c->v_head_dim ? c->head_dim : c->v_head_dim;
  float *row = malloc((size_t)F * sizeof(float)); /* a token's row, on its way into blocks */
  if (!row) return attn__fail(ctx, ATTN_E_NOMEM, "attn_kv_cache_append: out of memory");
  attn_tensor rotated;
  if (c->rope && (st = rotate(ctx, &rotated, cache, k, n, 0))) {
    free(row);
    return st;
  }
  for (int64_t b = 0; b < c->batch; b++) {
    const int64_t m = n_new ? n_new[b] : n;
    attn_tensor kd = row_view(cache, 0, b, c->capacity), vd = row_view(cache, 1, b, c->capacity);
    copy_tokens(&kd, c->rope ? &rotated : k, cache->kt, row, b, cache->len[b], m);
    copy_tokens(&vd, v, cache->vt, row, b, cache->len[b], m);
    cache->len[b] += m;
  }
  if (c->rope) attn_tensor_free(&rotated);
  free(row);
  return ATTN_OK;
}

/* The whole batch in one decode call when the step is decode-sized and the
 * fp32 kernels run; ATTN_E_UNSUPPORTED (nothing done) otherwise, and the
 * rows then go one by one. */
static attn_status attend_batch(attn_ctx *ctx, const attn_kv_cache *cache, attn_tensor *out, attn_tensor *lse,
                                const attn_tensor *q, const attn_sdpa_opts *o) {
  const attn_kv_cache_config *c = &cache->cfg;
  if (ctx->dispatch.kernel == ATTN_KERNEL_REF || !ctx->dispatch.decode_enabled) return ATTN_E_UNSUPPORTED;
  int64_t longest = 0;
  for (int64_t b = 0; b < c->batch; b++) longest = cache->len[b] > longest ? cache->len[b] : longest;
  attn_tensor k = row_view(cache, 0, 0, longest), v = row_view(cache, 1, 0, longest);
  k.shape[0] = v.shape[0] = c->batch;
  /* a block format is checked as the f32 [B, Hk, len, F] it holds (prepare
   * reads shapes, not data), then handed to the kernels as its blocks */
  attn_tensor ks = k, vs = v;
  if (attn__is_quant(cache->kt)) ks.dtype = ATTN_F32, ks.shape[3] = c->head_dim;
  if (attn__is_quant(cache->vt)) vs.dtype = ATTN_F32, vs.shape[3] = c->v_head_dim;
  attn__sdpa p;
  attn_status st = attn__sdpa_prepare(ctx, &p, out, lse, NULL, q, &ks, &vs, o, 1);
  if (st) {
    char msg[ATTN__MSG_LEN];
    snprintf(msg, sizeof msg, "%s", attn_ctx_error(ctx));
    return attn__fail(ctx, st, "attn_kv_cache_attend: %s", msg);
  }
  p.kv_len = cache->len;
  if (attn__is_quant(cache->kt)) p.k = k, p.k.dtype = cache->kt, p.k.shape[3] = c->head_dim; /* strides in bytes */
  if (attn__is_quant(cache->vt)) p.v = v, p.v.dtype = cache->vt, p.v.shape[3] = c->v_head_dim;
  if (!attn__decode_fits(&ctx->dispatch, &p)) return ATTN_E_UNSUPPORTED;
  if (p.Hq == 0 || p.Nq == 0) return ATTN_OK;
  return attn__sdpa_run_decode(ctx, &p);
}

static attn_status attend_rows(attn_ctx *ctx, const attn_kv_cache *cache, attn_tensor *out, attn_tensor *lse,
                               const attn_tensor *q, const attn_sdpa_opts *opts);

attn_status attn_kv_cache_attend(attn_ctx *ctx, attn_kv_cache *cache, attn_tensor *out, attn_tensor *lse,
                                 const attn_tensor *q, const attn_sdpa_opts *opts) {
  ATTN__ENTER(ctx);
  if (!cache) return attn__fail(ctx, ATTN_E_INVALID, "attn_kv_cache_attend: cache is NULL");
  attn_status st;
  if ((st = attn__check_tensor(ctx, q, "q", 4)) || (st = attn__check_tensor(ctx, out, "out", 4)) ||
      (st = attn__check_writable(ctx, out, "out")))
    return st;
  const attn_kv_cache_config *c = &cache->cfg;
  if (q->shape[0] != c->batch || q->shape[3] != c->head_dim)
    return attn__fail(ctx, ATTN_E_SHAPE, "attn_kv_cache_attend: q is [%lld, %lld, %lld, %lld]; want [B, Hq, Nq, D] with B = %lld, D = %lld",
                      (long long)q->shape[0], (long long)q->shape[1], (long long)q->shape[2], (long long)q->shape[3],
                      (long long)c->batch, (long long)c->head_dim);
  if (out->shape[0] != c->batch)
    return attn__fail(ctx, ATTN_E_SHAPE, "attn_kv_cache_attend: out has batch %lld; the cache has %lld rows",
                      (long long)out->shape[0], (long long)c->batch);
  if (lse && ((st = attn__check_tensor(ctx, lse, "lse", 3)) || (st = attn__check_writable(ctx, lse, "lse")) ||
              lse->shape[0] != c->batch))
    return st ? st : attn__fail(ctx, ATTN_E_SHAPE, "attn_kv_cache_attend: lse has batch %lld; the cache has %lld rows",
                                (long long)lse->shape[0], (long long)c->batch);
  attn_sdpa_opts o;
  if ((st = attn__cached_opts(ctx, &o, opts, "attn_kv_cache_attend"))) return st;
  if (!c->rope) return attend_rows(ctx, cache, out, lse, q, &o);
  attn_tensor rotated;
  if ((st = rotate(ctx, &rotated, cache, q, q->shape[2], 1))) return st;
  st = attend_rows(ctx, cache, out, lse, &rotated, &o);
  attn_tensor_free(&rotated);
  return st;
}

/* *out = row b's keys (kind 0) or values (1) as an f32 [1, Hk, len_b, F]
 * tensor (allocated here): dequantized, or widened. */
static attn_status row_f32(attn_ctx *ctx, attn_tensor *out, const attn_kv_cache *cache, int kind, int64_t b) {
  const attn_dtype dt = kind ? cache->vt : cache->kt;
  const int64_t F = kind ? cache->cfg.v_head_dim : cache->cfg.head_dim, len = cache->len[b];
  const int64_t shape[4] = {1, cache->cfg.kv_heads, len, F};
  attn_status st = attn_tensor_alloc(ctx, out, ATTN_F32, 4, shape);
  if (st) return st;
  const attn_tensor s = row_view(cache, kind, b, len);
  float *dst = out->data;
  for (int64_t g = 0; g < shape[1]; g++)
    for (int64_t j = 0; j < len; j++, dst += F) {
      const int64_t off = g * s.strides[1] + j * s.strides[2];
      if (attn__is_quant(dt)) attn__dequantize_row(dt, dst, (const uint8_t *)s.data + off, F);
      else
        for (int64_t f = 0; f < F; f++) dst[f] = (float)attn__load(s.data, s.dtype, off + f);
    }
  return ATTN_OK;
}

/* Row b (q, out and lse its entries) on the kernels, its keys and values read as stored: a block
 * format's are dequantized a key block at a time as the blocked forward packs them (forward.c), so no
 * f32 copy of the row is made. */
static attn_status attend_row(attn_ctx *ctx, const attn_kv_cache *cache, attn_tensor *out, attn_tensor *lse,
                              const attn_tensor *q, const attn_sdpa_opts *o, int64_t b) {
  const attn_tensor k = row_view(cache, 0, b, cache->len[b]), v = row_view(cache, 1, b, cache->len[b]);
  attn_tensor ks = k, vs = v; /* a block format checked as the f32 rows it holds, as in attend_batch */
  if (attn__is_quant(cache->kt)) ks.dtype = ATTN_F32, ks.shape[3] = cache->cfg.head_dim;
  if (attn__is_quant(cache->vt)) vs.dtype = ATTN_F32, vs.shape[3] = cache->cfg.v_head_dim;
  attn__sdpa p;
  attn_status st = attn__sdpa_prepare(ctx, &p, out, lse, NULL, q, &ks, &vs, o, 1);
  if (st) return st;
  if (attn__is_quant(cache->kt)) p.k = k, p.k.dtype = cache->kt, p.k.shape[3] = cache->cfg.head_dim;
  if (attn__is_quant(cache->vt)) p.v = v, p.v.dtype = cache->vt, p.v.shape[3] = cache->cfg.v_head_dim;
  return attn__sdpa_dispatch(ctx, &p);
}

/* The batch in one decode call, or row by row. */
static attn_status attend_rows(attn_ctx *ctx, const attn_kv_cache *cache, attn_tensor *out, attn_tensor *lse,
                               const attn_tensor *q, const attn_sdpa_opts *opts) {
  const attn_kv_cache_config *c = &cache->cfg;
  attn_sdpa_opts o = *opts;
  attn_status st;
  if ((st = attend_batch(ctx, cache, out, lse, q, &o)) != ATTN_E_UNSUPPORTED) return st;
  ctx->msg[0] = '\0';
  /* the oracle reads floats: a block format goes to it as an f32 copy */
  const int copy = ctx->dispatch.kernel == ATTN_KERNEL_REF && (attn__is_quant(cache->kt) || attn__is_quant(cache->vt));
  for (int64_t b = 0; b < c->batch; b++) {
    attn_tensor qb = attn__batch_entry(q, b), ob = attn__batch_entry(out, b);
    attn_tensor kb = row_view(cache, 0, b, cache->len[b]), vb = row_view(cache, 1, b, cache->len[b]);
    attn_tensor lb, *lbp = NULL;
    if (lse) lb = attn__batch_entry(lse, b), lbp = &lb;
    if (ctx->dispatch.kernel != ATTN_KERNEL_REF) {
      st = attend_row(ctx, cache, &ob, lbp, &qb, &o, b);
    } else if (copy) {
      if ((st = row_f32(ctx, &kb, cache, 0, b))) return st;
      if ((st = row_f32(ctx, &vb, cache, 1, b))) {
        attn_tensor_free(&kb);
        return st;
      }
      st = attn_sdpa(ctx, &ob, lbp, NULL, &qb, &kb, &vb, &o);
      attn_tensor_free(&kb), attn_tensor_free(&vb);
    } else {
      st = attn_sdpa(ctx, &ob, lbp, NULL, &qb, &kb, &vb, &o); /* the oracle, on the row's view */
    }
    if (st) {
      char msg[ATTN__MSG_LEN];
      snprintf(msg, sizeof msg, "%s", attn_ctx_error(ctx));
      return attn__fail(ctx, st, "attn_kv_cache_attend: row %lld: %s", (long long)b, msg);
    }
  }
  return ATTN_OK;
}

attn_status attn_kv_cache_truncate(attn_ctx *ctx, attn_kv_cache *cache, int64_t b, int64_t length) {
  ATTN__ENTER(ctx);
  if (!cache) return attn__fail(ctx, ATTN_E_INVALID, "attn_kv_cache_truncate: cache is NULL");
  if (b < -1 || b >= cache->cfg.batch)
    return attn__fail(ctx, ATTN_E_INVALID, "attn_kv_cache_truncate: row %lld is outside -1..%lld", (long long)b,
                      (long long)cache->cfg.batch - 1);
  const int64_t lo = b < 0 ? 0 : b, hi = b < 0 ? cache->cfg.batch : b + 1;
  for (int64_t r = lo; r < hi; r++)
    if (length < 0 || length > cache->len[r])
      return attn__fail(ctx, ATTN_E_INVALID, "attn_kv_cache_truncate: row %lld holds %lld tokens; cannot keep %lld",
                        (long long)r, (long long)cache->len[r], (long long)length);
  for (int64_t r = lo; r < hi; r++) cache->len[r] = length;
  return ATTN_OK;
}

attn_status attn_kv_cache_copy_row(attn_ctx *ctx, attn_kv_cache *cache, int64_t dst, int64_t src) {
  ATTN__ENTER(ctx);
  if (!cache) return attn__fail(ctx, ATTN_E_INVALID, "attn_kv_cache_copy_row: cache is NULL");
  const attn_kv_cache_config *c = &cache->cfg;
  if (dst < 0 || dst >= c->batch || src < 0 || src >= c->batch)
    return attn__fail(ctx, ATTN_E_INVALID, "attn_kv_cache_copy_row: rows %lld and %lld must be in 0..%lld",
                      (long long)dst, (long long)src, (long long)c->batch - 1);
  if (dst == src) return ATTN_OK;
  for (int kind = 0; kind < 2; kind++) {
    const attn_tensor d = row_view(cache, kind, dst, 0), s = row_view(cache, kind, src, 0);
    const size_t es = attn_dtype_size(d.dtype); /* rows of F elements, or of bytes of blocks */
    for (int64_t g = 0; g < c->kv_heads; g++) /* only the tokens held, not the whole capacity */
      memcpy((char *)d.data + (size_t)(g * d.strides[1]) * es, (const char *)s.data + (size_t)(g * s.strides[1]) * es,
             (size_t)(cache->len[src] * d.shape[3]) * es);
  }
  cache->len[dst] = cache->len[src];
  return ATTN_OK;
}

attn_status attn_kv_cache_view(attn_ctx *ctx, attn_tensor *k, attn_tensor *v, const attn_kv_cache *cache, int64_t b) {
  ATTN__ENTER(ctx);
  if (!cache || !k || !v) return attn__fail(ctx, ATTN_E_INVALID, "attn_kv_cache_view: null argument");
  if (b < 0 || b >= cache->cfg.batch)
    return attn__fail(ctx, ATTN_E_INVALID, "attn_kv_cache_view: row %lld is outside 0..%lld", (long long)b,
                      (long long)cache->cfg.batch - 1);
  *k = row_view(cache, 0, b, cache->len[b]); /* a block format's: its raw blocks, ATTN_U8 (attn.h) */
  *v = row_view(cache, 1, b, cache->len[b]);
  return ATTN_OK;
}
