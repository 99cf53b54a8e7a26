/* The multi-head attention layer: projections, head split, SDPA, merge, output projection
 * (the forward in four steps: project, attend, project_out, save).
 *
 * Heads are split and merged by strides, not copies: the projected Q of
 * [B, N, H*D] is viewed as [B, H, N, D], and SDPA writes straight into a
 * [B, N, H*D] buffer viewed the same way. */
#include "mha_internal.h"
#include "../logit.h"
#include "../io/io.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static const char *param_label[ATTN_MHA_NUM_PARAMS] = {
    "q weight",      "q bias",      "k weight",      "k bias",     "v weight",           "v bias",
    "out weight",    "out bias",    "q norm weight", "q norm bias", "k norm weight", "k norm bias", "sinks"};

void attn_mha_config_init(attn_mha_config *cfg, int64_t embed_dim, int64_t num_heads) {
  if (!cfg) return;
  memset(cfg, 0, sizeof *cfg);
  cfg->size = sizeof *cfg;
  cfg->embed_dim = embed_dim;
  cfg->num_heads = num_heads;
  cfg->bias = 1;
  cfg->out_bias = -1;
  cfg->qk_norm_kind = ATTN_NORM_RMS;
  cfg->qk_norm_eps = 1e-6;
}

void attn_mha_opts_init(attn_mha_opts *opts) {
  if (!opts) return;
  memset(opts, 0, sizeof *opts);
  opts->size = sizeof *opts;
  attn_sdpa_opts_init(&opts->attn);
  opts->attn.mask_mode = ATTN_MASK_MASKED;
}

/* The largest head_dim, H*D, E, kdim and vdim: every parameter's element count
 * then fits 2^48 and no size computed from them overflows. */
#define MHA_MAX_FEATURES ((int64_t)1 << 24)

/* c's fields the caller may leave 0 or -1 resolved, and checked: a clear
 * status before anything is allocated. */
static attn_status resolve_config(attn_ctx *ctx, attn_mha_config *c) {
  if (c->num_kv_heads == 0) c->num_kv_heads = c->num_heads;
  if (c->kdim == 0) c->kdim = c->embed_dim;
  if (c->vdim == 0) c->vdim = c->embed_dim;
  if (c->embed_dim <= 0 || c->num_heads <= 0 || c->num_kv_heads < 0 || c->kdim < 0 || c->vdim < 0)
    return attn__fail(ctx, ATTN_E_INVALID, "embed_dim (%lld) and num_heads (%lld) must be positive", (long long)c->embed_dim,
                      (long long)c->num_heads);
  if (c->embed_dim > MHA_MAX_FEATURES || c->kdim > MHA_MAX_FEATURES || c->vdim > MHA_MAX_FEATURES)
    return attn__fail(ctx, ATTN_E_INVALID, "embed_dim, kdim and vdim must be at most 2^24");
  if (c->head_dim < 0 || c->head_dim > MHA_MAX_FEATURES)
    return attn__fail(ctx, ATTN_E_INVALID, "head_dim %lld must be between 1 and 2^24 (0: embed_dim / num_heads)",
                      (long long)c->head_dim);
  if (c->head_dim == 0) {
    if (c->embed_dim % c->num_heads)
      return attn__fail(ctx, ATTN_E_INVALID, "embed_dim %lld is not divisible by num_heads %lld (or set head_dim)",
                        (long long)c->embed_dim, (long long)c->num_heads);
    c->head_dim = c->embed_dim / c->num_heads;
  } else if (c->num_heads > MHA_MAX_FEATURES / c->head_dim) { /* both <= 2^24: the division is exact enough */
    return attn__fail(ctx, ATTN_E_INVALID, "num_heads %lld x head_dim %lld must be at most 2^24 features",
                      (long long)c->num_heads, (long long)c->head_dim);
  }
  if (c->num_heads % c->num_kv_heads)
    return attn__fail(ctx, ATTN_E_INVALID, "num_heads %lld is not a multiple of num_kv_heads %lld", (long long)c->num_heads,
                      (long long)c->num_kv_heads);
  if (c->out_bias < -1 || c->out_bias > 1)
    return attn__fail(ctx, ATTN_E_INVALID, "out_bias must be -1 (as bias), 0 or 1, got %d", c->out_bias);
  if (c->out_bias == -1) c->out_bias = c->bias != 0;
  c->bias = c->bias != 0;
  if (c->sinks != 0 && c->sinks != 1) return attn__fail(ctx, ATTN_E_INVALID, "sinks must be 0 or 1, got %d", c->sinks);
  if (c->qk_norm < ATTN_QK_NORM_NONE || c->qk_norm > ATTN_QK_NORM_EACH_HEAD)
    return attn__fail(ctx, ATTN_E_INVALID, "qk_norm must be ATTN_QK_NORM_NONE, _PER_HEAD, _WHOLE or _EACH_HEAD, got %d",
                      c->qk_norm);
  if (c->qk_norm) {
    if ((int)c->qk_norm_kind < ATTN_NORM_RMS || c->qk_norm_kind > ATTN_NORM_LAYER)
      return attn__fail(ctx, ATTN_E_INVALID, "qk_norm_kind must be ATTN_NORM_RMS, _RMS_PLUS_ONE or _LAYER, got %d",
                        (int)c->qk_norm_kind);
    if (!(c->qk_norm_eps > 0) || !isfinite(c->qk_norm_eps))
      return attn__fail(ctx, ATTN_E_INVALID, "qk_norm_eps must be finite and > 0, got %g", c->qk_norm_eps);
  }
  if (!(c->clip_qkv >= 0) || !isfinite(c->clip_qkv))
    return attn__fail(ctx, ATTN_E_INVALID, "clip_qkv must be 0 (none) or finite and > 0, got %g", c->clip_qkv);
  return ATTN_OK;
}

attn_status attn_mha_create(attn_ctx *ctx, attn_mha **out, const attn_mha_config *cfg) {
  ATTN__ENTER(ctx);
  if (!out || !cfg) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_create: null argument");
  *out = NULL;
  attn_mha_config c;
  attn_mha_config_init(&c, 0, 0);
  attn_status st = attn__read_sized(ctx, &c, sizeof c, cfg, "cfg", "attn_mha_config_init");
  if (st || (st = resolve_config(ctx, &c))) return st;
  attn_mha *m = calloc(1, sizeof *m);
  if (!m) return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_create: out of memory");
  m->cfg = c;
  const int64_t E = c.embed_dim, D = c.head_dim, qd = c.num_heads * D, kv = c.num_kv_heads * D;
  m->head_dim = D;
  m->q_dim = qd;
  m->kv_dim = kv;
  /* QK-norm's weights: [D] shared by the heads, [H*D] and [Hk*D] over the whole projections, or
   * [H, D] and [Hk, D], each head its own */
  const int each = c.qk_norm == ATTN_QK_NORM_EACH_HEAD, nd = each ? D : 0;
  const int64_t qn = c.qk_norm == ATTN_QK_NORM_WHOLE ? qd : each ? c.num_heads : D;
  const int64_t kn = c.qk_norm == ATTN_QK_NORM_WHOLE ? kv : each ? c.num_kv_heads : D;
  const int64_t r[ATTN_MHA_NUM_PARAMS] = {qd, qd, kv, kv, kv, kv, E, E, qn, qn, kn, kn, c.num_heads};
  const int64_t k[ATTN_MHA_NUM_PARAMS] = {E, 0, c.kdim, 0, c.vdim, 0, qd, 0, nd, nd, nd, nd, 0};
  const int layer_norm = c.qk_norm && c.qk_norm_kind == ATTN_NORM_LAYER;
  const int present[ATTN_MHA_NUM_PARAMS] = {1, c.bias, 1, c.bias, 1, c.bias, 1, c.out_bias,
                                            c.qk_norm != 0, layer_norm, c.qk_norm != 0, layer_norm, c.sinks};
  /* One allocation, the q, k, v weights (and biases) back to back: with kdim =
   * vdim = E they form PyTorch's packed [H*D + 2 Hk D, E] in_proj, and
   * self-attention projects with one GEMM. */
  static const int order[ATTN_MHA_NUM_PARAMS] = {
      ATTN_MHA_Q_WEIGHT, ATTN_MHA_K_WEIGHT, ATTN_MHA_V_WEIGHT,      ATTN_MHA_Q_BIAS,      ATTN_MHA_K_BIAS,
      ATTN_MHA_V_BIAS,   ATTN_MHA_O_WEIGHT, ATTN_MHA_O_BIAS,        ATTN_MHA_Q_NORM_WEIGHT, ATTN_MHA_Q_NORM_BIAS,
      ATTN_MHA_K_NORM_WEIGHT, ATTN_MHA_K_NORM_BIAS, ATTN_MHA_SINKS};
  int64_t total = 0; /* each term is below 2^48 (sizes <= 2^24): no overflow */
  for (int i = 0; i < ATTN_MHA_NUM_PARAMS; i++) {
    m->rows[i] = r[i];
    m->cols[i] = k[i];
    if (present[i]) total += r[i] * (k[i] ? k[i] : 1);
  }
  size_t bytes;
  if (attn__alloc_size(total, 1, 1, sizeof(float), &bytes) || !(m->store = attn__aligned_alloc(bytes))) {
    attn_mha_destroy(m);
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_create: cannot allocate %lld parameters", (long long)total);
  }
  memset(m->store, 0, bytes);
  float *next = m->store;
  for (int o = 0; o < ATTN_MHA_NUM_PARAMS; o++) {
    const int i = order[o];
    if (!present[i]) continue;
    m->param[i] = next;
    next += r[i] * (k[i] ? k[i] : 1);
  }
  /* QK-norm starts as the identity: weights 1 (RMS_PLUS_ONE scales by 1 + w), biases 0 */
  const float identity = c.qk_norm_kind == ATTN_NORM_RMS_PLUS_ONE ? 0.0f : 1.0f;
  const int norm_weights[2] = {ATTN_MHA_Q_NORM_WEIGHT, ATTN_MHA_K_NORM_WEIGHT};
  for (int j = 0; j < 2; j++)
    if (m->param[norm_weights[j]])
      for (int64_t f = 0; f < attn__mha_param_numel(m, norm_weights[j]); f++) m->param[norm_weights[j]][f] = identity;
  if (c.sinks) m->sinks = attn_tensor_view(m->param[ATTN_MHA_SINKS], ATTN_F32, 1, &c.num_heads);
  *out = m;
  return ATTN_OK;
}

void attn_mha_destroy(attn_mha *mha) {
  if (!mha) return;
  attn__aligned_free(mha->store);
  free(mha);
}

const attn_mha_config *attn_mha_get_config(const attn_mha *mha) { return mha ? &mha->cfg : NULL; }


attn_status attn_mha_param_view(attn_ctx *ctx, attn_tensor *out, attn_mha *mha, attn_mha_param which) {
  ATTN__ENTER(ctx);
  if (!mha || !out) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_param_view: null argument");
  if ((int)which < 0 || which >= ATTN_MHA_NUM_PARAMS)
    return attn__fail(ctx, ATTN_E_INVALID, "unknown parameter %d", (int)which);
  if (!mha->param[which])
    return attn__fail(ctx, ATTN_E_NOT_FOUND, "the layer has no %s (%s)", param_label[which],
                      which < ATTN__MHA_PROJ_PARAMS ? "created without it: bias / out_bias"
                      : which == ATTN_MHA_SINKS     ? "created without sinks"
                      : which == ATTN_MHA_Q_NORM_BIAS || which == ATTN_MHA_K_NORM_BIAS
                          ? "QK-norm biases go with qk_norm_kind LAYER"
                          : "created without qk_norm");
  *out = attn__mha_param(mha, which);
  return ATTN_OK;
}

/* ---- forward ---------------------------------------------------------------- */
static attn_status check_input(attn_ctx *ctx, const attn_tensor *t, const char *what, int64_t B, int64_t feat,
                               int f64_ok) {
  attn_status st = attn__check_tensor(ctx, t, what, 3);
  if (st) return st;
  if (t->dtype != ATTN_F32 && !(f64_ok && t->dtype == ATTN_F64))
    return attn__fail(ctx, ATTN_E_DTYPE, "%s must be f32, got %s", what, attn_dtype_name(t->dtype));
  if ((B >= 0 && t->shape[0] != B) || t->shape[2] != feat)
    return attn__fail(ctx, ATTN_E_SHAPE, "%s is [%lld, %lld, %lld]; want [B, N, %lld]%s", what, (long long)t->shape[0],
                      (long long)t->shape[1], (long long)t->shape[2], (long long)feat,
                      B >= 0 ? " with the query's batch" : "");
  return ATTN_OK;
}

/* Gathers a [B, N, F] f32 view into contiguous rows unless it already is and
 * copy is 0 (then the view's own data is returned and *owned stays NULL). */
static const float *rows_of(const attn_tensor *t, float **owned, int copy) {
  const int64_t B = t->shape[0], N = t->shape[1], F = t->shape[2];
  *owned = NULL;
  if (!copy && t->strides[2] == 1 && t->strides[1] == F && (t->strides[0] == N * F || B == 1)) return t->data;
  float *c = attn__aligned_alloc((size_t)(B * N * F) * sizeof(float));
  if (!c) return NULL;
  const float *s = t->data;
  for (int64_t b = 0; b < B; b++)
    for (int64_t n = 0; n < N; n++)
      for (int64_t f = 0; f < F; f++) c[(b * N + n) * F + f] = s[b * t->strides[0] + n * t->strides[1] + f * t->strides[2]];
  *owned = c;
  return c;
}

/* A contiguous double copy of a [B, N, F] f32 or f64 view (the float64 path's saved inputs). */
static double *rows_f64(const attn_tensor *t) {
  const int64_t B = t->shape[0], N = t->shape[1], F = t->shape[2];
  double *c = attn__aligned_alloc((size_t)(B * N * F) * sizeof(double));
  if (!c) return NULL;
  for (int64_t b = 0; b < B; b++)
    for (int64_t n = 0; n < N; n++)
      for (int64_t f = 0; f < F; f++)
        c[(b * N + n) * F + f] = attn__load(t->data, t->dtype, b * t->strides[0] + n * t->strides[1] + f * t->strides[2]);
  return c;
}

/* A copy of t in *own, viewed in *copy with t's shape, for the saved state: a
 * dimension t broadcasts (stride 0) is not expanded, so a broadcast mask stays
 * as small as the caller's. what names t in messages. */
static attn_status save_view(attn_ctx *ctx, const attn_tensor *t, attn_tensor *copy, void **own, const char *what) {
  const int r = t->rank;
  int64_t cs[ATTN_MAX_RANK];
  for (int i = 0; i < r; i++) cs[i] = t->strides[i] == 0 && t->shape[i] > 1 ? 1 : t->shape[i];
  attn_tensor c = attn_tensor_view(NULL, t->dtype, r, cs);
  const int64_t n = attn_tensor_numel(&c);
  const size_t es = attn_dtype_size(t->dtype);
  size_t bytes;
  if (n < 0 || attn__alloc_size(n, 1, 1, es, &bytes))
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward_save: a copy of %s is too large to allocate", what);
  unsigned char *dst = attn__aligned_alloc(bytes);
  if (!dst) return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward_save: cannot allocate a copy of %s", what);
  const unsigned char *src = t->data;
  /* runs along the last dimension, each one memcpy when it is contiguous */
  const int64_t inner = r ? cs[r - 1] : 1, step = r ? t->strides[r - 1] : 0;
  int64_t idx[ATTN_MAX_RANK] = {0};
  for (int64_t done = 0; done < n; done += inner) {
    int64_t off = 0;
    for (int i = 0; i < r - 1; i++) off += idx[i] * t->strides[i];
    if (step == 1) memcpy(dst + (size_t)done * es, src + off * (int64_t)es, (size_t)inner * es);
    else
      for (int64_t j = 0; j < inner; j++)
        memcpy(dst + (size_t)(done + j) * es, src + (off + j * step) * (int64_t)es, es);
    for (int i = r - 2; i >= 0; i--) {
      if (++idx[i] < cs[i]) break;
      idx[i] = 0;
    }
  }
  c.data = dst;
  for (int i = 0; i < r; i++)
    if (cs[i] != t->shape[i]) {
      c.shape[i] = t->shape[i];
      c.strides[i] = 0;
    }
  *copy = c;
  *own = dst;
  return ATTN_OK;
}

/* A contiguous [B, N, F] view. */
static attn_tensor rows_view(void *data, attn_dtype dt, int64_t B, int64_t N, int64_t F) {
  int64_t s[3] = {B, N, F};
  return attn_tensor_view(data, dt, 3, s);
}

static attn_tensor heads_view(void *data, attn_dtype dt, int64_t B, int64_t N, int64_t H, int64_t D) {
  return attn__heads_view(data, dt, B, N, H, D, H * D);
}

/* y is (M, N) contiguous doubles = x (M, K) . W^T + b, all read as given. */
static void linear_ref(int threads, double *y, const attn_tensor *x, int64_t M, const float *W, const float *b,
                       int64_t N, int64_t K) {
  const int64_t Nx = x->shape[1];
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < M; r++) {
    const int64_t bb = r / Nx, n = r % Nx;
    for (int64_t o = 0; o < N; o++) {
      double acc = b ? b[o] : 0.0;
      for (int64_t kk = 0; kk < K; kk++)
        acc += attn__load(x->data, x->dtype, bb * x->strides[0] + n * x->strides[1] + kk * x->strides[2]) *
               (double)W[o * K + kk];
      y[r * N + o] = acc;
    }
  }
}

/* Averages per-head weights [B, H, Nq, Nk] into out [B, Nq, Nk] (f32 or f64). */
static void average_heads(attn_tensor *out, const attn_tensor *w) {
  const int64_t B = w->shape[0], H = w->shape[1], Nq = w->shape[2], Nk = w->shape[3];
  for (int64_t b = 0; b < B; b++)
    for (int64_t i = 0; i < Nq; i++)
      for (int64_t j = 0; j < Nk; j++) {
        double s = 0;
        for (int64_t h = 0; h < H; h++)
          s += attn__load(w->data, w->dtype, b * w->strides[0] + h * w->strides[1] + i * w->strides[2] + j * w->strides[3]);
        attn__store(out->data, out->dtype, b * out->strides[0] + i * out->strides[1] + j * out->strides[2], s / (double)H);
      }
}

/* The layer's learned sinks into o (again on a struct already read: the same view). */
static attn_status layer_sinks(attn_ctx *ctx, attn_sdpa_opts *o, const attn_mha *mha) {
  if (!mha || !mha->cfg.sinks || o->sinks == &mha->sinks) return ATTN_OK;
  if (o->sinks)
    return attn__fail(ctx, ATTN_E_INVALID, "opts.attn.sinks must be NULL: this layer holds its own (learned) sinks");
  o->sinks = &mha->sinks;
  return ATTN_OK;
}

attn_status attn__read_mha_opts(attn_ctx *ctx, attn_mha_opts *dst, const attn_mha_opts *opts, const attn_mha *mha) {
  attn_mha_opts_init(dst);
  if (!opts) return layer_sinks(ctx, &dst->attn, mha);
  /* attn holds its own size: what follows it in the caller's struct starts where the caller's attn ends */
  const size_t at = offsetof(attn_mha_opts, attn), head = at + sizeof opts->attn.size;
  if (opts->size == 0) return attn__fail(ctx, ATTN_E_INVALID, "opts.size is 0: initialise with attn_mha_opts_init");
  if (opts->size < head || opts->attn.size > opts->size - at)
    return attn__fail(ctx, ATTN_E_INVALID,
                      "opts.size is %zu and opts.attn.size %zu: not the sizes of any version of attn_mha_opts (%zu "
                      "and %zu in this libattn): initialise with attn_mha_opts_init",
                      opts->size, opts->attn.size, sizeof *dst, sizeof dst->attn);
  attn_status st = attn__read_sized(ctx, &dst->attn, sizeof dst->attn, &opts->attn, "opts.attn", "attn_mha_opts_init");
  if (st) return st;
  const size_t tail = at + sizeof dst->attn, caller_tail = at + opts->attn.size;
  if (opts->size - caller_tail > sizeof *dst - tail)
    return attn__fail(ctx, ATTN_E_INVALID,
                      "opts.size is %zu, more than any version of attn_mha_opts with a %zu-byte attn (this libattn: "
                      "%zu); built against a newer attn.h?",
                      opts->size, opts->attn.size, sizeof *dst);
  memcpy((char *)dst + tail, (const char *)opts + caller_tail, opts->size - caller_tail);
  return layer_sinks(ctx, &dst->attn, mha);
}

/* ---- the forward, step by step: project, attend, project out, save ---------------- */
/* One forward's buffers, in the path's type (double when ref, else float);
 * M = B * Nq query rows, Mk = B * Nk key rows. Each is owned here until save
 * hands it to a saved state; fwd_free frees what is left. */
typedef struct fwd {
  int ref, fused, keep; /* fused: self-attention in fp32, Q, K and V side by side in Q's rows */
  int64_t B, Nq, Nk;
  void *Q, *K, *V;      /* [M, H*D] rows ldq apart, [Mk, Hk*D] rows ldkv apart; fused: K, V point into Q */
  int64_t ldq, ldkv;
  float *own_q, *own_k, *own_v; /* fp32 copies of the inputs (gathered, or kept for the backward) */
  const float *xq, *xk, *xv;    /* the fp32 inputs' contiguous rows: own_* or the caller's */
  double *cq, *ck, *cv;         /* float64 copies, kept for the backward; may share a buffer */
  void *Qx, *Kx;        /* with QK-norm, kept for the backward: q [M, H*D] and k [Mk, Hk*D] before the norm */
  uint8_t *Cm;          /* with clip_qkv, kept for the backward: attn__mha_clip's mask */
  void *A;              /* [M, H*D]: attention's output, heads side by side */
  size_t nA;            /* its bytes */
  void *L;              /* [B, H, Nq]: attention's lse, kept for the backward (else NULL) */
  void *own_opt[ATTN__SDPA_OPT_TENSORS]; /* the saved copies of the options' tensors */
} fwd;

static void fwd_free(fwd *f) {
  for (int i = 0; i < ATTN__SDPA_OPT_TENSORS; i++) attn__aligned_free(f->own_opt[i]);
  attn__aligned_free(f->own_q);
  attn__aligned_free(f->own_k);
  attn__aligned_free(f->own_v);
  if (f->ck != f->cq) attn__aligned_free(f->ck);
  if (f->cv != f->cq && f->cv != f->ck) attn__aligned_free(f->cv);
  attn__aligned_free(f->cq);
  if (!f->fused) {
    attn__aligned_free(f->K);
    attn__aligned_free(f->V);
  }
  attn__aligned_free(f->Q);
  attn__aligned_free(f->Qx);
  attn__aligned_free(f->Kx);
  attn__aligned_free(f->Cm);
  attn__aligned_free(f->A);
  attn__aligned_free(f->L);
}

/* f->Q [M, E] = query Wq^T + bq, f->K [Mk, Hk*D] = key Wk^T + bk, f->V alike:
 * query [B, Nq, E], key [B, Nk, kdim], value [B, Nk, vdim] (key and value may be query). */
static attn_status project(attn_ctx *ctx, fwd *f, const attn_mha *mha, const attn_tensor *query,
                           const attn_tensor *key, const attn_tensor *value) {
  const attn_mha_config *c = &mha->cfg;
  const int64_t E = c->embed_dim, qd = mha->q_dim, kv = mha->kv_dim, B = f->B, Nq = f->Nq, Nk = f->Nk;
  const float *const *P = (const float *const *)mha->param;
  const int th = attn__threads(ctx);
  if (f->fused) {
    f->xq = f->xk = f->xv = rows_of(query, &f->own_q, f->keep);
    if (!f->xq) return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward: cannot allocate a copy of the inputs");
    attn__mha_qkv(ctx, f->Q, f->xq, mha, B * Nq);
    return ATTN_OK;
  }
  if (f->ref) {
    attn_tensor vq, vk, vv;
    const attn_tensor *tq = query, *tk = key, *tv = value;
    if (f->keep) { /* project from double copies, which the backward reads */
      f->cq = rows_f64(query);
      f->ck = key == query ? f->cq : rows_f64(key);
      f->cv = value == query ? f->cq : (value == key ? f->ck : rows_f64(value));
      if (!f->cq || !f->ck || !f->cv)
        return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward: cannot allocate a copy of the inputs");
      vq = rows_view(f->cq, ATTN_F64, B, Nq, E);
      vk = rows_view(f->ck, ATTN_F64, B, Nk, c->kdim);
      vv = rows_view(f->cv, ATTN_F64, B, Nk, c->vdim);
      tq = &vq, tk = &vk, tv = &vv;
    }
    linear_ref(th, f->Q, tq, B * Nq, P[ATTN_MHA_Q_WEIGHT], P[ATTN_MHA_Q_BIAS], qd, E);
    linear_ref(th, f->K, tk, B * Nk, P[ATTN_MHA_K_WEIGHT], P[ATTN_MHA_K_BIAS], kv, c->kdim);
    linear_ref(th, f->V, tv, B * Nk, P[ATTN_MHA_V_WEIGHT], P[ATTN_MHA_V_BIAS], kv, c->vdim);
    return ATTN_OK;
  }
  f->xq = rows_of(query, &f->own_q, f->keep);
  f->xk = key == query ? f->xq : rows_of(key, &f->own_k, f->keep);
  f->xv = value == query ? f->xq : (value == key ? f->xk : rows_of(value, &f->own_v, f->keep));
  if (!f->xq || !f->xk || !f->xv)
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward: cannot allocate a copy of the inputs");
  attn__project_nt(ctx, B * Nq, qd, E, f->xq, E, P[ATTN_MHA_Q_WEIGHT], E, f->Q, qd, P[ATTN_MHA_Q_BIAS]);
  attn__project_nt(ctx, B * Nk, kv, c->kdim, f->xk, c->kdim, P[ATTN_MHA_K_WEIGHT], c->kdim, f->K, kv,
                   P[ATTN_MHA_K_BIAS]);
  attn__project_nt(ctx, B * Nk, kv, c->vdim, f->xv, c->vdim, P[ATTN_MHA_V_WEIGHT], c->vdim, f->V, kv,
                   P[ATTN_MHA_V_BIAS]);
  return ATTN_OK;
}

/* Copies rows x cols elements of es bytes, src rows ld elements apart, into contiguous dst. */
static void copy_rows(void *dst, const void *src, int64_t rows, int64_t cols, int64_t ld, size_t es) {
  for (int64_t r = 0; r < rows; r++)
    memcpy((char *)dst + (size_t)(r * cols) * es, (const char *)src + (size_t)(r * ld) * es, (size_t)cols * es);
}

/* f's Q and K normed in place (QK-norm), after keeping copies of them for the backward. */
static attn_status norm_qk(attn_ctx *ctx, fwd *f, const attn_mha *mha) {
  if (!mha->cfg.qk_norm) return ATTN_OK;
  const size_t es = f->ref ? sizeof(double) : sizeof(float);
  if (f->Qx) {
    copy_rows(f->Qx, f->Q, f->B * f->Nq, mha->q_dim, f->ldq, es);
    copy_rows(f->Kx, f->K, f->B * f->Nk, mha->kv_dim, f->ldkv, es);
  }
  attn_status st = attn__mha_qk_norm(ctx, mha, f->ref, f->Q, f->ldq, f->K, f->ldkv, f->B, f->Nq, f->Nk);
  if (st) {
    char msg[ATTN__MSG_LEN];
    snprintf(msg, sizeof msg, "%s", attn_ctx_error(ctx));
    return attn__fail(ctx, st, "attn_mha_forward: QK-norm: %s", msg);
  }
  return ATTN_OK;
}

/* f's Q, K and V clamped in place (clip_qkv), the mask kept for the backward (f->Cm, when kept). */
static attn_status clip_qkv(fwd *f, const attn_mha *mha) {
  if (mha->cfg.clip_qkv > 0)
    attn__mha_clip(mha, f->ref, f->Q, f->ldq, f->K, f->V, f->ldkv, f->B * f->Nq, f->B * f->Nk, f->Cm);
  return ATTN_OK;
}

/* f's Q and K heads rotated in place by rope (NULL: nothing to do). */
static attn_status rotate_qk(attn_ctx *ctx, const fwd *f, const attn_mha *mha, const attn_rope_opts *rope) {
  if (!rope) return ATTN_OK;
  const attn_dtype dt = f->ref ? ATTN_F64 : ATTN_F32;
  attn_tensor qh = attn__heads_view(f->Q, dt, f->B, f->Nq, mha->cfg.num_heads, mha->head_dim, f->ldq);
  attn_tensor kh = attn__heads_view(f->K, dt, f->B, f->Nk, mha->cfg.num_kv_heads, mha->head_dim, f->ldkv);
  attn_status st = attn__mha_rope(ctx, rope, rope->positions, 0, f->ref, &qh, &kh);
  if (st) {
    char msg[ATTN__MSG_LEN];
    snprintf(msg, sizeof msg, "%s", attn_ctx_error(ctx));
    return attn__fail(ctx, st, "attn_mha_forward: opts.rope: %s", msg);
  }
  return ATTN_OK;
}

/* A [M, E] (head h in columns h*D ..) = SDPA of f's Q, K, V head by head under o;
 * lse [B, H, Nq] (or NULL); weights (or NULL) [B, H, Nq, Nk], or [B, Nq, Nk]
 * averaged over heads when average. */
static attn_status attend(attn_ctx *ctx, void *A, void *lse, attn_tensor *weights, const fwd *f,
                          const attn_mha *mha, const attn_sdpa_opts *o, int average) {
  const int64_t H = mha->cfg.num_heads, Hk = mha->cfg.num_kv_heads, D = mha->head_dim;
  const int64_t B = f->B, Nq = f->Nq, Nk = f->Nk;
  const attn_dtype dt = f->ref ? ATTN_F64 : ATTN_F32;
  attn_tensor qh = attn__heads_view(f->Q, dt, B, Nq, H, D, f->ldq), ah = heads_view(A, dt, B, Nq, H, D);
  attn_tensor kh = attn__heads_view(f->K, dt, B, Nk, Hk, D, f->ldkv);
  attn_tensor vh = attn__heads_view(f->V, dt, B, Nk, Hk, D, f->ldkv);
  int64_t ls[3] = {B, H, Nq};
  attn_tensor lt = attn_tensor_view(lse, dt, 3, ls), wbuf = {0}, *w = weights;
  attn_status st;
  if (weights && average) { /* SDPA gives every head's; the layer averages them */
    int64_t ws[4] = {B, H, Nq, Nk};
    if ((st = attn_tensor_alloc(ctx, &wbuf, dt, 4, ws))) return st;
    w = &wbuf;
  }
  st = f->ref ? attn_sdpa_ref(ctx, &ah, lse ? &lt : NULL, w, &qh, &kh, &vh, o)
              : attn_sdpa(ctx, &ah, lse ? &lt : NULL, w, &qh, &kh, &vh, o);
  if (!st && w == &wbuf) average_heads(weights, &wbuf);
  attn_tensor_free(&wbuf);
  return st;
}

/* out [B, Nq, E] (any strides; f64 on the float64 path) = f->A [M, H*D] Wo^T + bo.
 * nOut: the bytes of [M, E] in the path's type. */
static attn_status project_out(attn_ctx *ctx, attn_tensor *out, const fwd *f, const attn_mha *mha, size_t nOut,
                               size_t nQ) {
  const int64_t E = mha->cfg.embed_dim, qd = mha->q_dim, B = f->B, Nq = f->Nq;
  /* Q's buffer, done with, holds the rows unless the backward keeps it or it is too small (H*D < E) */
  if (!f->ref) return attn__mha_out(ctx, out, f->A, mha, B, Nq, !f->keep && nQ >= nOut ? f->Q : NULL);
  double *y = attn__aligned_alloc(nOut); /* the rows in double, then stored as out's dtype */
  if (!y) return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward: cannot allocate the output rows");
  attn_tensor a3 = rows_view(f->A, ATTN_F64, B, Nq, qd);
  linear_ref(attn__threads(ctx), y, &a3, B * Nq, mha->param[ATTN_MHA_O_WEIGHT], mha->param[ATTN_MHA_O_BIAS], E, qd);
  for (int64_t b = 0; b < B; b++)
    for (int64_t n = 0; n < Nq; n++)
      for (int64_t e = 0; e < E; e++)
        attn__store(out->data, out->dtype, b * out->strides[0] + n * out->strides[1] + e * out->strides[2],
                    y[(b * Nq + n) * E + e]);
  attn__aligned_free(y);
  return ATTN_OK;
}

/* sv takes every buffer of f the backward reads (f keeps none of them), and
 * copies of the tensors o points at, which its own options then point at:
 * the backward must not depend on the caller's buffers. */
static attn_status save(attn_ctx *ctx, attn_mha_saved *sv, fwd *f, const attn_sdpa_opts *o) {
  attn_sdpa_opts caller = *o;
  const attn_tensor **from[ATTN__SDPA_OPT_TENSORS], **to[ATTN__SDPA_OPT_TENSORS];
  attn__sdpa_opt_tensors(&caller, from);
  attn__sdpa_opt_tensors(&sv->attn, to);
  for (int i = 0; i < ATTN__SDPA_OPT_TENSORS; i++) {
    if (!*from[i]) continue;
    attn_status st = save_view(ctx, *from[i], &sv->opt_copy[i], &f->own_opt[i], attn__sdpa_opt_tensor_names[i]);
    if (st) return st;
    *to[i] = &sv->opt_copy[i];
  }
  if (f->ref) {
    sv->xq = f->cq; sv->xk = f->ck; sv->xv = f->cv;
  } else {
    sv->xq = f->xq; sv->xk = f->xk; sv->xv = f->xv;
  }
  sv->q = f->Q; sv->k = f->K; sv->v = f->V;
  sv->ldq = f->ldq; sv->ldkv = f->ldkv;
  sv->qx = f->Qx; sv->kx = f->Kx;
  sv->clipped = f->Cm;
  sv->a = f->A;
  sv->lse = f->L;
  void *bufs[] = {f->own_q, f->own_k, f->own_v, f->cq, f->ck != f->cq ? f->ck : NULL,
                  (f->cv != f->cq && f->cv != f->ck) ? f->cv : NULL, f->Q, f->fused ? NULL : f->K,
                  f->fused ? NULL : f->V, f->Qx, f->Kx, f->Cm, f->A, f->L};
  _Static_assert(sizeof bufs / sizeof bufs[0] + ATTN__SDPA_OPT_TENSORS == ATTN__MHA_SAVED_BUFS,
                 "owned[] must hold every buffer of this list and every option copy");
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
    if (bufs[i]) sv->owned[sv->n_owned++] = bufs[i];
  for (int i = 0; i < ATTN__SDPA_OPT_TENSORS; i++)
    if (f->own_opt[i]) sv->owned[sv->n_owned++] = f->own_opt[i];
  const int fused = f->fused;
  memset(f, 0, sizeof *f); /* all of it is the saved state's now */
  f->fused = fused;
  return ATTN_OK;
}

attn_status attn__mha_rope(attn_ctx *ctx, const attn_rope_opts *rope, const int64_t *positions, int transpose, int ref,
                           attn_tensor *qh, attn_tensor *kh) {
  attn_rope_opts ro = *rope;
  ro.positions = positions;
  ro.transpose = transpose;
  attn_status st = ref ? attn_rope_ref(ctx, qh, qh, &ro) : attn_rope(ctx, qh, qh, &ro);
  if (st) return st;
  if (kh->shape[2] != qh->shape[2]) ro.positions = NULL; /* cross-attention: keys at offset + j */
  return ref ? attn_rope_ref(ctx, kh, kh, &ro) : attn_rope(ctx, kh, kh, &ro);
}

attn_tensor attn__mha_norm_view(const attn_mha *mha, void *data, int ref, int64_t B, int64_t N, int64_t heads,
                                int64_t ld) {
  const attn_dtype dt = ref ? ATTN_F64 : ATTN_F32;
  if (mha->cfg.qk_norm == ATTN_QK_NORM_WHOLE) return attn__heads_view(data, dt, B, N, 1, heads * mha->head_dim, ld);
  return attn__heads_view(data, dt, B, N, heads, mha->head_dim, ld);
}

attn_tensor attn__mha_param(const attn_mha *mha, int which) {
  const int64_t shape[2] = {mha->rows[which], mha->cols[which]};
  return attn_tensor_view(mha->param[which], ATTN_F32, mha->cols[which] ? 2 : 1, shape);
}

attn_status attn__mha_qk_norm(attn_ctx *ctx, const attn_mha *mha, int ref, void *Q, int64_t ldq, void *K, int64_t ldk,
                              int64_t B, int64_t Nq, int64_t Nk) {
  const attn_mha_config *c = &mha->cfg;
  const int layer = c->qk_norm_kind == ATTN_NORM_LAYER;
  attn_tensor qv = attn__mha_norm_view(mha, Q, ref, B, Nq, c->num_heads, ldq);
  attn_tensor kv = attn__mha_norm_view(mha, K, ref, B, Nk, c->num_kv_heads, ldk);
  attn_tensor wq = attn__mha_param(mha, ATTN_MHA_Q_NORM_WEIGHT), wk = attn__mha_param(mha, ATTN_MHA_K_NORM_WEIGHT);
  attn_tensor bq = layer ? attn__mha_param(mha, ATTN_MHA_Q_NORM_BIAS) : wq;
  attn_tensor bk = layer ? attn__mha_param(mha, ATTN_MHA_K_NORM_BIAS) : wk;
  attn_status st = attn_head_norm(ctx, &qv, &qv, &wq, layer ? &bq : NULL, c->qk_norm_kind, c->qk_norm_eps);
  return st ? st : attn_head_norm(ctx, &kv, &kv, &wk, layer ? &bk : NULL, c->qk_norm_kind, c->qk_norm_eps);
}

/* ---- what the forward and the cached step share --------------------------------- */
/* rows [rows, cols] ld apart clamped to [-c, c]; mask (or NULL) [rows, cols] as attn__mha_clip says.
 * Selects, not branches: the loops vectorise (a branch a value mispredicts on random signs, 20% of a
 * layer's forward at E 512). NaN fails both tests and stays. */
#define CLIP_ROWS(T)                                                                           \
  static void clip_rows_##T(T *x, int64_t rows, int64_t cols, int64_t ld, T c, uint8_t *mask) { \
    for (int64_t r = 0; r < rows; r++) {                                                       \
      T *restrict v = x + r * ld;                                                              \
      if (mask)                                                                                \
        for (int64_t i = 0; i < cols; i++) mask[r * cols + i] = v[i] >= -c && v[i] <= c;       \
      for (int64_t i = 0; i < cols; i++) {                                                     \
        const T y = v[i] < -c ? -c : v[i];                                                     \
        v[i] = y > c ? c : y;                                                                  \
      }                                                                                        \
    }                                                                                          \
  }
CLIP_ROWS(float)
CLIP_ROWS(double)
#undef CLIP_ROWS

void attn__mha_clip(const attn_mha *mha, int ref, void *Q, int64_t ldq, void *K, void *V, int64_t ldkv, int64_t M,
                    int64_t Mk, uint8_t *mask) {
  const int64_t qd = mha->q_dim, kv = mha->kv_dim;
  void *const x[3] = {Q, K, V};
  const int64_t rows[3] = {M, Mk, Mk}, cols[3] = {qd, kv, kv}, ld[3] = {ldq, ldkv, ldkv};
  for (int i = 0; i < 3; i++) {
    if (ref) clip_rows_double(x[i], rows[i], cols[i], ld[i], mha->cfg.clip_qkv, mask);
    else clip_rows_float(x[i], rows[i], cols[i], ld[i], (float)mha->cfg.clip_qkv, mask);
    if (mask) mask += rows[i] * cols[i];
  }
}

void attn__mha_qkv(const attn_ctx *ctx, void *QKV, const float *X, const attn_mha *mha, int64_t M) {
  const int64_t E = mha->cfg.embed_dim, ld = mha->q_dim + 2 * mha->kv_dim;
  attn__project_nt(ctx, M, ld, E, X, E, mha->param[ATTN_MHA_Q_WEIGHT], E, QKV, ld, mha->param[ATTN_MHA_Q_BIAS]);
}

attn_status attn__mha_out(attn_ctx *ctx, attn_tensor *out, const float *A, const attn_mha *mha,
                          int64_t B, int64_t N, void *scratch) {
  const int64_t E = mha->cfg.embed_dim, qd = mha->q_dim;
  const int contiguous = out->strides[2] == 1 && out->strides[1] == E && (out->strides[0] == N * E || B == 1);
  float *y = contiguous ? out->data : scratch;
  if (!y && !(y = attn__aligned_alloc((size_t)(B * N * E) * sizeof(float))))
    return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward: cannot allocate the output rows");
  attn__project_nt(ctx, B * N, E, qd, A, qd, mha->param[ATTN_MHA_O_WEIGHT], qd, y, E, mha->param[ATTN_MHA_O_BIAS]);
  if (!contiguous)
    for (int64_t b = 0; b < B; b++)
      for (int64_t n = 0; n < N; n++)
        for (int64_t e = 0; e < E; e++)
          ((float *)out->data)[b * out->strides[0] + n * out->strides[1] + e * out->strides[2]] =
              y[(b * N + n) * E + e];
  if (y != out->data && y != scratch) attn__aligned_free(y);
  return ATTN_OK;
}

/* An empty batch or no query never reaches attention, which must refuse the
 * same options all the same: SDPA's checks on stand-in views of the shapes it
 * would get (stride 0 everywhere: nothing is read, no extent can overflow). */
static attn_status check_unrun_attention(attn_ctx *ctx, const attn_mha *mha, const attn_sdpa_opts *o, int64_t B,
                                         int64_t Nq, int64_t Nk, int ref) {
  static const double stand_in; /* data of the views; never read */
  const int64_t H = mha->cfg.num_heads, Hk = mha->cfg.num_kv_heads, D = mha->head_dim;
  const int64_t dims[4][4] = {{B, H, Nq, D}, {B, Hk, Nk, D}, {B, Hk, Nk, D}, {B, H, Nq, D}};
  attn_tensor t[4]; /* q, k, v, out */
  for (int i = 0; i < 4; i++) {
    memset(&t[i], 0, sizeof t[i]);
    t[i].data = (void *)&stand_in;
    t[i].dtype = ref ? ATTN_F64 : ATTN_F32;
    t[i].rank = 4;
    memcpy(t[i].shape, dims[i], sizeof dims[i]);
  }
  attn__sdpa p;
  return attn__sdpa_prepare(ctx, &p, &t[3], NULL, NULL, &t[0], &t[1], &t[2], o, !ref);
}

attn_status attn_mha_forward(attn_ctx *ctx, attn_mha *mha, attn_tensor *out, attn_tensor *weights,
                             const attn_tensor *query, const attn_tensor *key, const attn_tensor *value,
                             const attn_mha_opts *opts) {
  ATTN__ENTER(ctx);
  return attn__mha_forward(ctx, mha, out, weights, NULL, query, key, value, opts);
}

/* The forward; with saved, it also keeps (instead of freeing) copies of the
 * inputs, the projections (and with QK-norm q and k before it), the attention
 * output A and SDPA's lse. Steps: project (+ bias), QK-norm, RoPE, attend,
 * project out. */
static attn_status mha_forward(attn_ctx *ctx, attn_mha *mha, attn_tensor *out, attn_tensor *weights,
                               attn_mha_saved **saved, const attn_tensor *query, const attn_tensor *key,
                               const attn_tensor *value, const attn_mha_opts *opts) {
  if (saved) *saved = NULL;
  if (!mha) return attn__fail(ctx, ATTN_E_INVALID, "attn_mha_forward: layer is NULL");
  const attn_kernel kern = attn_ctx_kernel(ctx);
  const int ref = kern == ATTN_KERNEL_REF;
  const attn_mha_config *c = &mha->cfg;
  const int64_t E = c->embed_dim, H = c->num_heads;
  attn_status st;
  if ((st = check_input(ctx, query, "query", -1, E, ref))) return st;
  const int64_t B = query->shape[0], Nq = query->shape[1];
  if (!key != !value) return attn__fail(ctx, ATTN_E_INVALID, "give both key and value, or neither (self-attention)");
  const int self = !key;
  if (!key) {
    if (c->kdim != E || c->vdim != E)
      return attn__fail(ctx, ATTN_E_INVALID, "self-attention needs kdim = vdim = embed_dim; pass key and value");
    key = value = query;
  }
  if ((st = check_input(ctx, key, "key", B, c->kdim, ref)) || (st = check_input(ctx, value, "value", B, c->vdim, ref)))
    return st;
  const int64_t Nk = key->shape[1];
  if (value->shape[1] != Nk)
    return attn__fail(ctx, ATTN_E_SHAPE, "key has %lld positions but value has %lld", (long long)Nk,
                      (long long)value->shape[1]);
  if ((st = attn__check_tensor(ctx, out, "out", 3)) || (st = attn__check_writable(ctx, out, "out"))) return st;
  if (out->dtype != ATTN_F32 && !(ref && out->dtype == ATTN_F64))
    return attn__fail(ctx, ATTN_E_DTYPE, "out must be f32, got %s", attn_dtype_name(out->dtype));
  if (out->shape[0] != B || out->shape[1] != Nq || out->shape[2] != E)
    return attn__fail(ctx, ATTN_E_SHAPE, "out must be [B, Nq, E] = [%lld, %lld, %lld]", (long long)B, (long long)Nq,
                      (long long)E);
  attn_mha_opts given; /* a caller's older, shorter struct gets the defaults for the rest */
  if ((st = attn__read_mha_opts(ctx, &given, opts, mha))) return st;
  opts = &given;
  /* a packed batch: query [1, total, E], its offsets checked before anything reads them */
  if ((st = attn__check_cu_seqlens(ctx, &opts->attn, B, Nq, Nk))) return st;
  attn_rope_opts rope;
  if (opts->rope) {
    attn_rope_opts_init(&rope);
    if ((st = attn__read_sized(ctx, &rope, sizeof rope, opts->rope, "opts.rope", "attn_rope_opts_init"))) return st;
    if (rope.transpose) return attn__fail(ctx, ATTN_E_INVALID, "opts.rope.transpose must be 0 (the backward applies it)");
    if (rope.positions && Nk != Nq)
      return attn__fail(ctx, ATTN_E_INVALID, "opts.rope.positions are the queries' [B, Nq]: with Nk = %lld keys != Nq = %lld, "
                        "leave them NULL (keys then sit at position_offset + j)", (long long)Nk, (long long)Nq);
  }
  if (weights) {
    const attn_tensor *w = weights;
    const int want = opts->average_weights ? 3 : 4;
    if ((st = attn__check_tensor(ctx, w, "weights", want)) || (st = attn__check_writable(ctx, w, "weights"))) return st;
    const int ok = opts->average_weights
                       ? (w->shape[0] == B && w->shape[1] == Nq && w->shape[2] == Nk)
                       : (w->shape[0] == B && w->shape[1] == H && w->shape[2] == Nq && w->shape[3] == Nk);
    if (!ok)
      return attn__fail(ctx, ATTN_E_SHAPE, "weights must be %s = [%lld, %lld%s, %lld]",
                        opts->average_weights ? "[B, Nq, Nk]" : "[B, H, Nq, Nk]", (long long)B,
                        (long long)(opts->average_weights ? Nq : H), opts->average_weights ? "" : ", Nq", (long long)Nk);
    if (w->dtype != ATTN_F32 && !(ref && w->dtype == ATTN_F64))
      return attn__fail(ctx, ATTN_E_DTYPE, "weights must be f32, got %s", attn_dtype_name(w->dtype));
  }
  if ((B == 0 || Nq == 0) && (st = check_unrun_attention(ctx, mha, &opts->attn, B, Nq, Nk, ref))) return st;

  attn_mha_saved *sv = NULL;
  if (saved) {
    if (!(sv = calloc(1, sizeof *sv))) return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward_save: out of memory");
    sv->cfg = *c;
    sv->ref = ref;
    sv->self = self;
    sv->B = B; sv->Nq = Nq; sv->Nk = Nk;
    sv->attn = opts->attn;
    if (opts->rope) {
      sv->has_rope = 1;
      sv->rope = rope;
      sv->rope.positions = NULL;
      if (rope.positions && B * Nq > 0) { /* the caller's positions may go once the forward returns */
        if (!(sv->rope_pos = malloc(sizeof(int64_t) * (size_t)(B * Nq)))) {
          free(sv);
          return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward_save: out of memory");
        }
        memcpy(sv->rope_pos, rope.positions, sizeof(int64_t) * (size_t)(B * Nq));
      }
    }
    if (opts->attn.cu_seqlens_q) { /* the caller's offsets may go too */
      const size_t n = (size_t)opts->attn.num_seqs + 1;
      if (!(sv->cu_seqlens = malloc(sizeof(int64_t) * n * (opts->attn.cu_seqlens_k ? 2 : 1)))) {
        free(sv->rope_pos);
        free(sv);
        return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward_save: out of memory");
      }
      memcpy(sv->cu_seqlens, opts->attn.cu_seqlens_q, sizeof(int64_t) * n);
      sv->attn.cu_seqlens_q = sv->cu_seqlens;
      if (opts->attn.cu_seqlens_k) {
        memcpy(sv->cu_seqlens + n, opts->attn.cu_seqlens_k, sizeof(int64_t) * n);
        sv->attn.cu_seqlens_k = sv->cu_seqlens + n;
      }
    }
    /* set to the saved state's own copies once attention has checked them */
    const attn_tensor **slot[ATTN__SDPA_OPT_TENSORS];
    attn__sdpa_opt_tensors(&sv->attn, slot);
    for (int i = 0; i < ATTN__SDPA_OPT_TENSORS; i++) *slot[i] = NULL;
  }
  if (B == 0 || Nq == 0) { /* nothing to compute; the backward gives zero gradients */
    if (saved) *saved = sv;
    return ATTN_OK;
  }

  fwd f;
  memset(&f, 0, sizeof f);
  f.ref = ref;

  f.keep = saved != NULL;
  f.B = B, f.Nq = Nq, f.Nk = Nk;
  /* Self-attention in fp32: q, k, v in one GEMM against the packed weights. */
  f.fused = !ref && key == query && value == query && c->kdim == E && c->vdim == E;
  const size_t es = ref ? sizeof(double) : sizeof(float);
  const int64_t qd = mha->q_dim, kv = mha->kv_dim, ldqkv = qd + 2 * kv;
  /* Every buffer's size before any is allocated: broadcast (stride 0) inputs
   * may claim more positions than a buffer of their projections could hold.
   * nX bounds the copies of the inputs (rows_of, rows_f64). */
  size_t nQ, nKV = 0, nL = 0, nX, nOut, nQx = 0, nKx = 0;
  const int keep_prenorm = f.keep && c->qk_norm;
  const int keep_clip = f.keep && c->clip_qkv > 0;
  size_t nCq = 0, nCk = 0;
  if (attn__alloc_size(B, Nq, f.fused ? ldqkv : qd, es, &nQ) || attn__alloc_size(B, Nq, qd, es, &f.nA) ||
      attn__alloc_size(B, Nq, E, es, &nOut) ||
      (keep_prenorm && (attn__alloc_size(B, Nq, qd, es, &nQx) || attn__alloc_size(B, Nk, kv, es, &nKx))) ||
      (keep_clip && (attn__alloc_size(B, Nq, qd, 1, &nCq) || attn__alloc_size(B, Nk, 2 * kv, 1, &nCk))) ||
      (!f.fused && attn__alloc_size(B, Nk, kv, es, &nKV)) || (f.keep && attn__alloc_size(B, H, Nq, es, &nL)) ||
      attn__alloc_size(B, Nq, E, es, &nX) || attn__alloc_size(B, Nk, c->kdim, es, &nX) ||
      attn__alloc_size(B, Nk, c->vdim, es, &nX)) {
    free(sv);
    return attn__fail(ctx, ATTN_E_NOMEM,
                      "attn_mha_forward: the buffers for B = %lld, Nq = %lld and Nk = %lld positions (embed_dim %lld, "
                      "%lld k/v features) are too large to allocate",
                      (long long)B, (long long)Nq, (long long)Nk, (long long)E, (long long)kv);
  }
  f.Q = attn__aligned_alloc(nQ);
  f.A = attn__aligned_alloc(f.nA);
  f.K = f.fused ? (f.Q ? (char *)f.Q + (size_t)qd * es : NULL) : attn__aligned_alloc(nKV);
  f.V = f.fused ? (f.Q ? (char *)f.Q + (size_t)(qd + kv) * es : NULL) : attn__aligned_alloc(nKV);
  f.L = f.keep ? attn__aligned_alloc(nL) : NULL;
  f.Qx = keep_prenorm ? attn__aligned_alloc(nQx) : NULL;
  f.Kx = keep_prenorm ? attn__aligned_alloc(nKx) : NULL;
  f.Cm = keep_clip ? attn__aligned_alloc(nCq + nCk) : NULL;
  f.ldq = f.fused ? ldqkv : qd;
  f.ldkv = f.fused ? ldqkv : kv;
  if (!f.Q || !f.K || !f.V || !f.A || (f.keep && !f.L) || (keep_prenorm && (!f.Qx || !f.Kx)) ||
      (keep_clip && !f.Cm))
    st = attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward: cannot allocate activations");
  else if (!(st = project(ctx, &f, mha, query, key, value)) && !(st = norm_qk(ctx, &f, mha)) &&
           !(st = clip_qkv(&f, mha)) &&
           !(st = rotate_qk(ctx, &f, mha, opts->rope ? &rope : NULL)) &&
           !(st = attend(ctx, f.A, f.L, weights, &f, mha, &opts->attn, opts->average_weights)) &&
           !(st = project_out(ctx, out, &f, mha, nOut, nQ)) && saved && !(st = save(ctx, sv, &f, &opts->attn))) {
    *saved = sv;
    sv = NULL;
  }
  fwd_free(&f);
  if (sv) free(sv->rope_pos), free(sv->cu_seqlens);
  free(sv);
  return st;
}

/* The forward. A packed batch (opts->attn.cu_seqlens_q) with RoPE and no
 * positions of the caller's: token n of sequence s sits at position_offset +
 * n - cu_seqlens_q[s], each sequence from its own start, as the attention
 * counts positions; the keys, self-attention's, the same. */
attn_status attn__mha_forward(attn_ctx *ctx, attn_mha *mha, attn_tensor *out, attn_tensor *weights,
                              attn_mha_saved **saved, const attn_tensor *query, const attn_tensor *key,
                              const attn_tensor *value, const attn_mha_opts *opts) {
  attn_mha_opts given;
  attn_status st;
  if (!opts || !mha || !query) return mha_forward(ctx, mha, out, weights, saved, query, key, value, opts);
  if ((st = attn__read_mha_opts(ctx, &given, opts, mha))) return st;
  if (!given.attn.cu_seqlens_q || !given.rope) return mha_forward(ctx, mha, out, weights, saved, query, key, value, opts);
  if (saved) *saved = NULL;
  attn_rope_opts rope;
  attn_rope_opts_init(&rope);
  if ((st = attn__read_sized(ctx, &rope, sizeof rope, given.rope, "opts.rope", "attn_rope_opts_init"))) return st;
  if (rope.positions) return mha_forward(ctx, mha, out, weights, saved, query, key, value, opts);
  if (key || given.attn.cu_seqlens_k)
    return attn__fail(ctx, ATTN_E_UNSUPPORTED, "attn_mha_forward: RoPE in a packed batch is for self-attention "
                      "(key, value and cu_seqlens_k NULL): the keys' positions would be the queries'");
  if ((st = attn__check_tensor(ctx, query, "query", 3))) return st;
  const int64_t N = query->shape[1];
  if ((st = attn__check_cu_seqlens(ctx, &given.attn, query->shape[0], N, N))) return st;
  if (rope.position_offset < 0 || rope.position_offset > INT64_MAX - N)
    return attn__fail(ctx, ATTN_E_INVALID, "opts.rope.position_offset %lld: positions must be >= 0 and fit int64",
                      (long long)rope.position_offset);
  int64_t *pos = malloc(sizeof(int64_t) * (size_t)(N > 0 ? N : 1));
  if (!pos) return attn__fail(ctx, ATTN_E_NOMEM, "attn_mha_forward: out of memory");
  for (int64_t s = 0; s < given.attn.num_seqs; s++)
    for (int64_t n = given.attn.cu_seqlens_q[s]; n < given.attn.cu_seqlens_q[s + 1]; n++)
      pos[n] = rope.position_offset + n - given.attn.cu_seqlens_q[s];
  rope.positions = pos;
  rope.position_offset = 0;
  given.rope = &rope;
  st = mha_forward(ctx, mha, out, weights, saved, query, key, value, &given);
  free(pos);
  return st;
}
