/* libFuzzer harness: the linear KV cache (attn_kv_cache) as a state machine,
 * against a model of what it holds. The input's bytes pick the cache (rows,
 * capacity, kv heads, head dims, the key and value storage of every kind, RoPE
 * on the keys or not, with every scaling: DYNAMIC's and LONGROPE's, which take
 * L from each call, too), a kernel this CPU has and 1 to 3 threads, then a run of
 * operations: append (uneven counts per row, refused past the capacity),
 * attend (decode-sized and prefill steps, with window, softcap, ALiBi, sinks
 * and scale), truncate (one row or all), copy_row, and filling every row's
 * unused tail with NaN (appended, then truncated away). After every operation:
 *   - each status is the one the model expects (a refused call changes
 *     nothing) and a failure has a message; every row's length is the model's;
 *   - after an append, the stored tokens (attn_kv_cache_view, blocks decoded
 *     with attn_kv_dequantize) are the appended ones as the storage gives them
 *     back: bitwise without RoPE (the cache's encoder is attn_kv_quantize's);
 *     with RoPE within the storage's rounding of the float64 rotation
 *     (attn_rope_ref) at the row's next positions, L being the longest row's
 *     length plus the call's tokens (attn_kv_cache_config's rule);
 *   - an attend's out and lse are within 5e-5 (relative L2, with a floor) of the float64
 *     oracle's on the stored tokens (bottom-right causal; with RoPE the
 *     queries rotated by attn_rope_ref at their positions, L the longest row's
 *     length), and another thread
 *     count gives the same bits. */
#include "attn.h"
#include "fuzz_common.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { MAX_ROWS = 3, MAX_CAP = 200, MAX_OPS = 40 };

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  fuzz_init("fuzz_kv");
  return 0;
}

/* The cache as the model sees it: per row, its tokens as stored ([Hk][MAX_CAP][D] and [..][Dv]). */
typedef struct model {
  int64_t B, cap, Hk, D, Dv;
  attn_kv_dtype kd, vd;
  int rope;
  attn_rope_opts ro;
  int64_t len[MAX_ROWS];
  float *k[MAX_ROWS], *v[MAX_ROWS];
} model;

/* Token t of head h in a view of a row (storage dtype, or a block format's raw bytes) as n floats. */
static void read_stored(attn_ctx *ctx, const attn_tensor *view, attn_kv_dtype dt, int64_t h, int64_t t, int64_t n,
                        float *dst) {
  const char *src = (const char *)view->data +
                    (size_t)(h * view->strides[1] + t * view->strides[2]) * attn_dtype_size(view->dtype);
  if (fuzz_is_quant(dt)) {
    fuzz_need(attn_kv_dequantize(ctx, dt, dst, src, n) == ATTN_OK, ctx, "attn_kv_dequantize");
    return;
  }
  attn_tensor s = attn_tensor_view((void *)src, view->dtype, 1, &n), d = attn_tensor_view(dst, ATTN_F32, 1, &n);
  s.strides[0] = view->strides[3];
  fuzz_need(attn_tensor_copy(ctx, &d, &s) == ATTN_OK, ctx, "reading a stored token");
}

/* How far a stored value may be from the exact (rotated) one x[0..n): the storage's rounding. */
static double storage_tol(attn_kv_dtype dt, const double *x, int64_t i, int64_t n) {
  double amax = 0;
  const int64_t b0 = fuzz_is_quant(dt) ? i / 32 * 32 : i, b1 = fuzz_is_quant(dt) ? b0 + 32 : i + 1;
  for (int64_t j = b0; j < b1 && j < n; j++) amax = fabs(x[j]) > amax ? fabs(x[j]) : amax;
  switch (dt) {
  case ATTN_KV_F16: return amax * 0x1p-10 + 1e-6;
  case ATTN_KV_BF16: return amax * 0x1p-7 + 1e-6;
  case ATTN_KV_Q8_0: return amax * (0.5 / 127 + 0x1p-9) + 1e-6;
  case ATTN_KV_Q4_0: return amax * (1.0 / 8 + 0x1p-9) + 1e-6;
  default: return amax * 1e-6 + 1e-6;
  }
}

/* The longest row's length: DYNAMIC's and LONGROPE's L is taken from it on every call. */
static int64_t longest(const model *m) {
  int64_t L = 0;
  for (int64_t b = 0; b < m->B; b++) L = m->len[b] > L ? m->len[b] : L;
  return L;
}

static void check_lengths(attn_kv_cache *kc, const model *m, attn_ctx *ctx) {
  for (int64_t b = 0; b < m->B; b++) {
    char msg[96];
    snprintf(msg, sizeof msg, "row %lld: length %lld, the model's %lld", (long long)b,
             (long long)attn_kv_cache_length(kc, b), (long long)m->len[b]);
    fuzz_need(attn_kv_cache_length(kc, b) == m->len[b], ctx, msg);
  }
}

/* Appends n tokens (row b its first n_new[b]; all NaN when poison) and checks what was stored. */
static void step_append(attn_ctx *ctx, attn_kv_cache *kc, model *m, int64_t n, const int64_t *n_new, int poison) {
  const int64_t ks[4] = {m->B, m->Hk, n, m->D}, vs[4] = {m->B, m->Hk, n, m->Dv};
  const int64_t nk = m->B * m->Hk * n * m->D, nv = m->B * m->Hk * n * m->Dv;
  float *k = malloc(sizeof(float) * (size_t)nk + 1), *v = malloc(sizeof(float) * (size_t)nv + 1);
  for (int64_t i = 0; i < nk; i++) k[i] = poison ? NAN : (float)fuzz_uniform();
  for (int64_t i = 0; i < nv; i++) v[i] = poison ? NAN : (float)fuzz_uniform();
  attn_tensor tk = attn_tensor_view(k, ATTN_F32, 4, ks), tv = attn_tensor_view(v, ATTN_F32, 4, vs);
  int fits = 1;
  for (int64_t b = 0; b < m->B; b++) fits &= m->len[b] + (n_new ? n_new[b] : n) <= m->cap;
  const attn_status st = attn_kv_cache_append(ctx, kc, &tk, &tv, n_new);
  if (!poison) fuzz_log("append(%lld%s)%s ", (long long)n, n_new ? ", uneven" : "", st ? " refused" : "");
  if (!fits) {
    fuzz_need(st == ATTN_E_SHAPE && attn_ctx_error(ctx)[0], ctx, "an append past the capacity: not ATTN_E_SHAPE");
    free(k), free(v);
    return;
  }
  fuzz_need(st == ATTN_OK, ctx, "an append that fits failed");
  const int64_t call_len = longest(m) + n; /* every row's n positions count, appended or not */
  double xk[128];
  float want[128], got[128];
  for (int64_t b = 0; b < m->B; b++) {
    const int64_t add = n_new ? n_new[b] : n;
    attn_tensor vk, vv;
    fuzz_need(attn_kv_cache_view(ctx, &vk, &vv, kc, b) == ATTN_OK, ctx, "attn_kv_cache_view");
    for (int64_t h = 0; h < m->Hk; h++)
      for (int64_t t = 0; t < add; t++) {
        const int64_t pos = m->len[b] + t;
        float *mk = m->k[b] + (h * MAX_CAP + pos) * m->D, *mv = m->v[b] + (h * MAX_CAP + pos) * m->Dv;
        const float *ksrc = k + ((b * m->Hk + h) * n + t) * m->D, *vsrc = v + ((b * m->Hk + h) * n + t) * m->Dv;
        memcpy(want, vsrc, sizeof(float) * (size_t)m->Dv);
        fuzz_as_stored(ctx, m->vd, want, m->Dv);
        read_stored(ctx, &vv, m->vd, h, pos, m->Dv, got);
        fuzz_need(poison || memcmp(want, got, sizeof(float) * (size_t)m->Dv) == 0, ctx,
                  "a stored value is not the appended one");
        memcpy(mv, got, sizeof(float) * (size_t)m->Dv);
        read_stored(ctx, &vk, m->kd, h, pos, m->D, got);
        if (!m->rope) {
          memcpy(want, ksrc, sizeof(float) * (size_t)m->D);
          fuzz_as_stored(ctx, m->kd, want, m->D);
          fuzz_need(poison || memcmp(want, got, sizeof(float) * (size_t)m->D) == 0, ctx,
               "a stored key is not the appended one");
        } else if (!poison) { /* the float64 rotation at the token's position, then the storage's rounding */
          const int64_t one[4] = {1, 1, 1, m->D};
          attn_rope_opts ro = m->ro;
          ro.position_offset = pos;
          ro.seq_len = call_len;
          attn_tensor x = attn_tensor_view((void *)ksrc, ATTN_F32, 4, one), y = attn_tensor_view(xk, ATTN_F64, 4, one);
          fuzz_need(attn_rope_ref(ctx, &y, &x, &ro) == ATTN_OK, ctx, "attn_rope_ref");
          for (int64_t d = 0; d < m->D; d++) {
            char msg[160];
            snprintf(msg, sizeof msg, "row %lld head %lld token %lld: stored key[%lld] %.9g, rotated %.9g",
                     (long long)b, (long long)h, (long long)pos, (long long)d, got[d], xk[d]);
            fuzz_need(fabs(got[d] - xk[d]) <= storage_tol(m->kd, xk, d, m->D), ctx, msg);
          }
        }
        memcpy(mk, got, sizeof(float) * (size_t)m->D);
      }
    m->len[b] += add;
  }
  free(k), free(v);
}

static void step_attend(attn_ctx *ctx, attn_kv_cache *kc, const model *m, fuzz_reader *r, int threads2) {
  fuzz_step st;
  fuzz_step_draw(r, &st, m->B, m->Hk, m->D, m->Dv);
  fuzz_log("attend(Nq %lld, G %lld) ", (long long)st.Nq, (long long)st.G);
  fuzz_need(attn_kv_cache_attend(ctx, kc, &st.to, &st.tl, &st.tq, &st.o) == ATTN_OK, ctx, "attend failed");
  const int t1 = attn_ctx_threads(ctx);
  attn_ctx_set_threads(ctx, threads2);
  fuzz_need(attn_kv_cache_attend(ctx, kc, &st.to2, &st.tl2, &st.tq, &st.o) == ATTN_OK, ctx,
            "attend on another thread count");
  attn_ctx_set_threads(ctx, t1);
  fuzz_step_same_bits(&st, ctx);
  for (int64_t b = 0; b < m->B; b++) {
    const int64_t L = m->len[b], Nq = st.Nq, ks[4] = {1, m->Hk, L, m->D}, vs[4] = {1, m->Hk, L, m->Dv},
                  q1[4] = {1, st.Hq, Nq, m->D};
    attn_tensor kk = attn_tensor_view(m->k[b], ATTN_F32, 4, ks), vv = attn_tensor_view(m->v[b], ATTN_F32, 4, vs);
    kk.strides[1] = MAX_CAP * m->D, vv.strides[1] = MAX_CAP * m->Dv;
    double *qr = malloc(sizeof(double) * (size_t)(st.Hq * Nq * m->D) + 1);
    attn_tensor qq = attn_tensor_view(st.q + b * st.Hq * Nq * m->D, ATTN_F32, 4, q1),
                qd = attn_tensor_view(qr, ATTN_F64, 4, q1);
    fuzz_need(attn_tensor_copy(ctx, &qd, &qq) == ATTN_OK, ctx, "copying q");
    if (m->rope) { /* query i at len - Nq + i; rows before the first token see nothing, whatever their rotation */
      int64_t pos[64];
      for (int64_t i = 0; i < Nq; i++) pos[i] = L - Nq + i < 0 ? 0 : L - Nq + i;
      attn_rope_opts ro_q = m->ro;
      ro_q.positions = pos;
      ro_q.seq_len = longest(m) > 0 ? longest(m) : 1; /* the call's largest position + 1: positions clamp at 0 */
      fuzz_need(attn_rope_ref(ctx, &qd, &qq, &ro_q) == ATTN_OK, ctx, "attn_rope_ref on q");
    }
    fuzz_step_check_row(&st, ctx, b, &qd, &kk, &vv);
    free(qr);
  }
  fuzz_step_free(&st);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!fuzz_kernel_count) return 0;
  fuzz_reader r = {data, size, 0};
  fuzz_seed(data, size);
  fuzz_report_clear();

  model m;
  memset(&m, 0, sizeof m);
  static const attn_kv_dtype kinds[] = {ATTN_KV_F32, ATTN_KV_F16, ATTN_KV_BF16, ATTN_KV_Q8_0, ATTN_KV_Q4_0};
  static const int64_t dims[] = {2, 17, 32, 64, 80}, qdims[] = {32, 64, 96};
  m.kd = kinds[fuzz_pick(&r, 5)], m.vd = kinds[fuzz_pick(&r, 5)];
  m.rope = fuzz_pick(&r, 2) == 0;
  m.D = fuzz_is_quant(m.kd) ? qdims[fuzz_pick(&r, 3)] : dims[fuzz_pick(&r, 5)];
  if (m.rope && m.D % 2) m.D++; /* rotary pairs */
  m.Dv = fuzz_is_quant(m.vd) ? qdims[fuzz_pick(&r, 3)] : dims[fuzz_pick(&r, 5)];
  m.B = 1 + fuzz_pick(&r, MAX_ROWS);
  m.Hk = 1 + fuzz_pick(&r, 2);
  m.cap = 1 + fuzz_pick(&r, MAX_CAP);
  attn_rope_opts_init(&m.ro);
  if (m.rope) {
    static const attn_rope_scaling sc[] = {ATTN_ROPE_DEFAULT, ATTN_ROPE_LINEAR, ATTN_ROPE_LLAMA3,
                                           ATTN_ROPE_YARN,    ATTN_ROPE_DYNAMIC, ATTN_ROPE_LONGROPE};
    m.ro.layout = fuzz_pick(&r, 2) ? ATTN_ROPE_HALF : ATTN_ROPE_INTERLEAVED;
    m.ro.rotary_dim = fuzz_pick(&r, 2) ? 0 : 2 * (1 + fuzz_pick(&r, m.D / 2));
    m.ro.scaling = sc[fuzz_pick(&r, 6)];
    if (m.ro.scaling == ATTN_ROPE_DYNAMIC && (m.ro.rotary_dim ? m.ro.rotary_dim : m.D) < 4)
      m.ro.scaling = ATTN_ROPE_LINEAR; /* DYNAMIC's exponent r / (r - 2) needs r >= 4 (refused, as checked elsewhere) */
    /* P = 64 under a capacity of up to 200: DYNAMIC and LONGROPE change regime within a run */
    if (m.ro.scaling != ATTN_ROPE_DEFAULT) m.ro.factor = 1 + (double)fuzz_pick(&r, 8), m.ro.original_max_position = 64;
    if (m.ro.scaling == ATTN_ROPE_LONGROPE) {
      const int64_t pairs = (m.ro.rotary_dim ? m.ro.rotary_dim : m.D) / 2;
      const double spread = (double)fuzz_pick(&r, 8);
      for (int64_t i = 0; i < pairs; i++) {
        m.ro.short_factor[i] = 1 + 0.25 * (double)(i % 4);
        m.ro.long_factor[i] = 1 + spread * (double)(i + 1) / (double)pairs;
      }
    }
    m.ro.theta = fuzz_pick(&r, 2) ? 10000 : 500000;
  }
  const attn_kernel kernel = fuzz_kernel[fuzz_pick(&r, fuzz_kernel_count)];
  const int threads = 1 + (int)fuzz_pick(&r, 3);
  fuzz_log("kernel %s threads %d/%d B %lld capacity %lld Hk %lld D %lld Dv %lld k %s v %s rope %d (scaling %d)",
           attn_kernel_name(kernel), threads, 1 + threads % 3, (long long)m.B, (long long)m.cap, (long long)m.Hk,
           (long long)m.D, (long long)m.Dv, attn_kv_dtype_name(m.kd), attn_kv_dtype_name(m.vd), m.rope,
           m.rope ? (int)m.ro.scaling : -1);
  fuzz_log("; operations: ");

  attn_ctx *ctx;
  fuzz_need(attn_ctx_create(&ctx) == ATTN_OK, NULL, "cannot create a context");
  fuzz_need(attn_ctx_set_kernel(ctx, kernel) == ATTN_OK && attn_ctx_set_threads(ctx, threads) == ATTN_OK, ctx,
       "cannot set up the context");
  attn_kv_cache_config cfg;
  attn_kv_cache_config_init(&cfg, m.B, m.cap, m.Hk, m.D);
  cfg.v_head_dim = m.Dv, cfg.k_dtype = m.kd, cfg.v_dtype = m.vd, cfg.rope = m.rope ? &m.ro : NULL;
  attn_kv_cache *kc;
  fuzz_need(attn_kv_cache_create(ctx, &kc, &cfg) == ATTN_OK, ctx, "attn_kv_cache_create");
  for (int64_t b = 0; b < MAX_ROWS; b++) {
    m.k[b] = calloc((size_t)(m.Hk * MAX_CAP * m.D), sizeof(float));
    m.v[b] = calloc((size_t)(m.Hk * MAX_CAP * m.Dv), sizeof(float));
  }

  for (int op = 0; op < MAX_OPS && r.at < r.n; op++) {
    const int64_t kind = fuzz_pick(&r, 8);
    if (kind <= 2) {
      const int64_t n = fuzz_pick(&r, 4) ? fuzz_pick(&r, 5) : fuzz_pick(&r, 80);
      int64_t n_new[MAX_ROWS];
      const int uneven = (int)fuzz_pick(&r, 2);
      for (int64_t b = 0; b < m.B; b++) n_new[b] = fuzz_pick(&r, n + 1);
      step_append(ctx, kc, &m, n, uneven ? n_new : NULL, 0);
    } else if (kind <= 4) {
      step_attend(ctx, kc, &m, &r, 1 + threads % 3);
    } else if (kind == 5) { /* truncate one row, or all (-1); now and then past a length: refused */
      const int64_t b = fuzz_pick(&r, m.B + 1) - 1, len = fuzz_pick(&r, m.cap + 2) % (MAX_CAP + 1);
      int ok = 1;
      for (int64_t i = 0; i < m.B; i++)
        if (b < 0 || i == b) ok &= len <= m.len[i];
      const attn_status st = attn_kv_cache_truncate(ctx, kc, b, len);
      fuzz_log("truncate(%lld, %lld) ", (long long)b, (long long)len);
      fuzz_need(ok ? st == ATTN_OK : st != ATTN_OK && attn_ctx_error(ctx)[0], ctx, "truncate: status");
      for (int64_t i = 0; ok && i < m.B; i++)
        if (b < 0 || i == b) m.len[i] = len;
    } else if (kind == 6) {
      const int64_t dst = fuzz_pick(&r, m.B), src = fuzz_pick(&r, m.B);
      const attn_status st = attn_kv_cache_copy_row(ctx, kc, dst, src);
      fuzz_log("copy_row(%lld, %lld) ", (long long)dst, (long long)src);
      fuzz_need(st == ATTN_OK, ctx, "copy_row failed");
      if (dst != src) {
        m.len[dst] = m.len[src];
        memcpy(m.k[dst], m.k[src], sizeof(float) * (size_t)(m.Hk * MAX_CAP * m.D));
        memcpy(m.v[dst], m.v[src], sizeof(float) * (size_t)(m.Hk * MAX_CAP * m.Dv));
      }
    } else { /* NaN in every row's unused tail, then truncated away: stale tokens no step may read */
      int64_t n_new[MAX_ROWS], keep[MAX_ROWS], most = 0;
      for (int64_t b = 0; b < m.B; b++) {
        n_new[b] = m.cap - m.len[b], keep[b] = m.len[b];
        most = n_new[b] > most ? n_new[b] : most;
      }
      step_append(ctx, kc, &m, most, n_new, 1);
      for (int64_t b = 0; b < m.B; b++) {
        fuzz_need(attn_kv_cache_truncate(ctx, kc, b, keep[b]) == ATTN_OK, ctx, "truncating the NaN tail");
        m.len[b] = keep[b];
      }
      fuzz_log("nan_tail ");
    }
    check_lengths(kc, &m, ctx);
  }

  attn_kv_cache_destroy(kc);
  for (int64_t b = 0; b < MAX_ROWS; b++) free(m.k[b]), free(m.v[b]);
  attn_ctx_destroy(ctx);
  return 0;
}
