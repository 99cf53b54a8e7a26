/* libFuzzer harness: the multi-head attention layer against its float64 path
 * (the same layer under ATTN_KERNEL_REF, every step in double). The input's
 * bytes pick the layer (E, heads, kv heads, head_dim, kdim and vdim, biases,
 * QK-norm's scope and kind), a kernel this CPU has and 1 to 3 threads, the
 * inputs (self- or cross-attention, batch and lengths, a packed batch), and
 * the options (causal, window, softcap, ALiBi, sinks, dropout, a bool or
 * additive mask, key padding, RoPE, averaged weights); the parameters and
 * inputs come from a generator seeded by the bytes. Then:
 *   - the fp32 layer and the float64 one agree on the status (a failure has a
 *     message);
 *   - out and weights (NaN before the call) within 1e-4 of the float64 ones
 *     (relative L2, with a floor), cross-attention's padded key and value rows
 *     holding NaN or Inf in the fp32 call;
 *   - forward_save + backward: dquery, dkey, dvalue and every parameter's
 *     gradient within 1e-3 of the float64 path's (with floors for sums that
 *     cancel);
 *   - another thread count gives the same bits, forward and backward. */
#include "attn.h"
#include "fuzz_common.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { MAX_SEQS = 4 };

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  fuzz_init("fuzz_mha");
  return 0;
}

typedef struct mcase {
  attn_kernel kernel;
  int threads, threads2;
  attn_mha_config cfg;
  int64_t B, Nq, Nk, kdim, vdim;
  int cross, mask_kind, mask_full, kpm, rope, average, want_weights, backward;
  int64_t kp_len[2], nseq, cu[MAX_SEQS + 1];
  attn_causal causal;
  int64_t window;
  double softcap, dropout;
  int alibi, sinks; /* sinks: 0 none, 1 in the options, 2 learned (the layer's), 3 both (refused) */
  uint64_t seed;
} mcase;

static void read_case(fuzz_reader *r, mcase *c) {
  memset(c, 0, sizeof *c);
  c->kernel = fuzz_kernel[fuzz_pick(r, fuzz_kernel_count)];
  c->threads = 1 + (int)fuzz_pick(r, 3);
  c->threads2 = 1 + c->threads % 3;
  const int64_t H = 1 + fuzz_pick(r, 4), Hk = H % 2 == 0 && fuzz_pick(r, 2) ? H / 2 : fuzz_pick(r, 3) ? H : 1;
  const int64_t D = 1 + fuzz_pick(r, 20), E = fuzz_pick(r, 2) ? H * D : 1 + fuzz_pick(r, 48);
  attn_mha_config_init(&c->cfg, E, H);
  c->cfg.num_kv_heads = Hk;
  if (E != H * D || fuzz_pick(r, 3) == 0) c->cfg.head_dim = D;
  c->cfg.bias = (int)fuzz_pick(r, 2);
  c->cfg.out_bias = (int)fuzz_pick(r, 3) - 1;
  c->cfg.qk_norm = (int)fuzz_pick(r, 4); /* none, per head, whole, each head its own */
  c->cfg.qk_norm_kind = (attn_norm_kind)fuzz_pick(r, 3);
  c->cross = fuzz_pick(r, 3) == 0;
  if (c->cross) {
    c->cfg.kdim = fuzz_pick(r, 2) ? 0 : 1 + fuzz_pick(r, 40);
    c->cfg.vdim = fuzz_pick(r, 2) ? 0 : 1 + fuzz_pick(r, 40);
  }
  c->kdim = c->cfg.kdim ? c->cfg.kdim : E, c->vdim = c->cfg.vdim ? c->cfg.vdim : E;
  c->B = 1 + fuzz_pick(r, 2);
  c->Nq = fuzz_pick(r, 40);
  c->Nk = c->cross ? fuzz_pick(r, 60) : c->Nq;
  c->causal = (attn_causal)fuzz_pick(r, 3);
  c->window = fuzz_pick(r, 4) == 0 ? 1 + fuzz_pick(r, 40) : 0;
  static const double caps[] = {1, 5, 30};
  c->softcap = fuzz_pick(r, 4) == 0 ? caps[fuzz_pick(r, 3)] : 0;
  c->alibi = fuzz_pick(r, 4) == 0;
  c->sinks = fuzz_pick(r, 4) == 0 ? 1 + (int)fuzz_pick(r, 3) : 0; /* 1 the options', 2 the layer's, 3 both */
  c->cfg.sinks = c->sinks >= 2;
  c->dropout = fuzz_pick(r, 5) == 0 ? 0.3 : 0;
  c->seed = (uint64_t)fuzz_pick(r, 256);
  c->mask_kind = (int)fuzz_pick(r, 3); /* 0 none, 1 bool MASKED, 2 additive */
  c->mask_full = (int)fuzz_pick(r, 2);  /* [B, H, Nq, Nk], else [Nq, Nk] */
  c->kpm = fuzz_pick(r, 3) == 0;
  c->kp_len[0] = fuzz_pick(r, c->Nk + 1), c->kp_len[1] = fuzz_pick(r, c->Nk + 1);
  c->rope = !c->cross && fuzz_pick(r, 3) == 0;
  c->average = (int)fuzz_pick(r, 2);
  c->want_weights = (int)fuzz_pick(r, 2);
  c->backward = (int)fuzz_pick(r, 2);
  if (!c->cross && fuzz_pick(r, 5) == 0) { /* a packed batch of self-attention */
    c->B = 1;
    c->nseq = 1 + fuzz_pick(r, MAX_SEQS);
    c->cu[0] = 0;
    for (int64_t s = 1; s < c->nseq; s++) c->cu[s] = c->cu[s - 1] + fuzz_pick(r, c->Nq - c->cu[s - 1] + 1);
    c->cu[c->nseq] = c->Nq;
    c->mask_kind = c->kpm = c->want_weights = 0;
  }
  if (c->rope && (c->cfg.head_dim ? c->cfg.head_dim : E / H) % 2) c->rope = 0; /* rotary pairs */
  c->cfg.clip_qkv = fuzz_pick(r, 4) == 0 ? 0.25 * (double)(1 + fuzz_pick(r, 8)) : 0; /* drawn last: older inputs keep their cases */
}

static void describe(const mcase *c) {
  const attn_mha_config *g = &c->cfg;
  fuzz_report_clear();
  fuzz_log("kernel %s threads %d/%d E %lld H %lld Hk %lld head_dim %lld kdim %lld vdim %lld bias %d out_bias %d "
           "qk_norm %d kind %d cross %d B %lld Nq %lld Nk %lld causal %d window %lld softcap %g alibi %d "
           "sinks %d dropout %g mask %d full %d kpm %d (%lld %lld) rope %d average %d weights %d backward %d "
           "clip_qkv %g",
           attn_kernel_name(c->kernel), c->threads, c->threads2, (long long)g->embed_dim,
           (long long)g->num_heads, (long long)g->num_kv_heads, (long long)g->head_dim, (long long)g->kdim,
           (long long)g->vdim, g->bias, g->out_bias, g->qk_norm, (int)g->qk_norm_kind, c->cross,
           (long long)c->B, (long long)c->Nq, (long long)c->Nk, (int)c->causal, (long long)c->window,
           c->softcap, c->alibi, c->sinks, c->dropout, c->mask_kind, c->mask_full, c->kpm,
           (long long)c->kp_len[0], (long long)c->kp_len[1], c->rope, c->average, c->want_weights,
           c->backward, g->clip_qkv);
  for (int64_t s = 0; s < c->nseq; s++) fuzz_log("%s%lld", s ? " " : " packed ", (long long)(c->cu[s + 1] - c->cu[s]));
}

static float *fill(int64_t n, double amp) {
  float *x = malloc(sizeof(float) * (size_t)n + 1);
  for (int64_t i = 0; i < n; i++) x[i] = (float)(amp * fuzz_uniform());
  return x;
}

static float *nans(int64_t n) {
  float *x = malloc(sizeof(float) * (size_t)n + 1);
  for (int64_t i = 0; i < n; i++) x[i] = NAN;
  return x;
}

/* ||a - r|| <= tol (||r|| + floor sqrt(n)); an infinity must match, NaN fails. */
static void close_to(const float *a, const double *r, int64_t n, double tol, double floor, const char *name,
                     attn_ctx *ctx) {
  double d = 0, s = 0;
  for (int64_t i = 0; i < n; i++) {
    char msg[160];
    snprintf(msg, sizeof msg, "%s[%lld] is %g where the float64 path's is %g", name, (long long)i, a[i], r[i]);
    if (isinf(r[i])) {
      fuzz_need(a[i] == r[i], ctx, msg);
      continue;
    }
    fuzz_need(isfinite(a[i]), ctx, msg);
    d += (a[i] - r[i]) * (a[i] - r[i]);
    s += r[i] * r[i];
  }
  char msg[200];
  snprintf(msg, sizeof msg, "%s: L2 distance %.3g from the float64 path's (norm %.3g), bound %.3g", name, sqrt(d),
           sqrt(s), tol * (sqrt(s) + floor * sqrt((double)n)));
  fuzz_need(sqrt(d) <= tol * (sqrt(s) + floor * sqrt((double)n)), ctx, msg);
}

typedef struct run_out {
  float *out, *weights, *dq, *dk, *dv, *grads[ATTN_MHA_NUM_PARAMS];
  attn_status st;
} run_out;

/* One forward (and forward_save + backward) of mha on ctx. k_in, v_in: the cross-attention inputs of
 * the forward (NaN in padded rows for the fp32 call); kc, vc: the clean ones the backward takes. */
static void run_layer(attn_ctx *ctx, attn_mha *mha, attn_mha *grads, const mcase *c, const attn_mha_opts *o,
                      const attn_tensor *x, const attn_tensor *k_in, const attn_tensor *v_in, const attn_tensor *kc,
                      const attn_tensor *vc, const float *gout, run_out *ro) {
  const attn_mha_config *g = attn_mha_get_config(mha);
  const int64_t E = g->embed_dim, H = g->num_heads;
  const int64_t so[3] = {c->B, c->Nq, E}, sw4[4] = {c->B, H, c->Nq, c->Nk}, sw3[3] = {c->B, c->Nq, c->Nk};
  memset(ro, 0, sizeof *ro);
  ro->out = nans(c->B * c->Nq * E);
  ro->weights = nans(c->B * H * c->Nq * c->Nk);
  attn_tensor to = attn_tensor_view(ro->out, ATTN_F32, 3, so);
  attn_tensor tw = c->average ? attn_tensor_view(ro->weights, ATTN_F32, 3, sw3)
                               : attn_tensor_view(ro->weights, ATTN_F32, 4, sw4);
  ro->st = attn_mha_forward(ctx, mha, &to, c->want_weights ? &tw : NULL, x, k_in, v_in, o);
  fuzz_need(ro->st == ATTN_OK || attn_ctx_error(ctx)[0], ctx, "attn_mha_forward failed without a message");
  if (ro->st != ATTN_OK || !c->backward) return;
  attn_mha_saved *saved = NULL;
  float *out2 = nans(c->B * c->Nq * E);
  attn_tensor to2 = attn_tensor_view(out2, ATTN_F32, 3, so);
  fuzz_need(attn_mha_forward_save(ctx, mha, &to2, NULL, &saved, x, kc, vc, o) == ATTN_OK, ctx, "attn_mha_forward_save");
  free(out2);
  const int64_t sq[3] = {c->B, c->Nq, E}, sk[3] = {c->B, c->Nk, c->kdim}, sv[3] = {c->B, c->Nk, c->vdim};
  ro->dq = nans(c->B * c->Nq * E);
  ro->dk = nans(c->B * c->Nk * c->kdim);
  ro->dv = nans(c->B * c->Nk * c->vdim);
  attn_tensor tdq = attn_tensor_view(ro->dq, ATTN_F32, 3, sq), tdk = attn_tensor_view(ro->dk, ATTN_F32, 3, sk),
              tdv = attn_tensor_view(ro->dv, ATTN_F32, 3, sv), tg = attn_tensor_view((void *)gout, ATTN_F32, 3, so);
  const attn_status sb = attn_mha_backward(ctx, mha, &tdq, c->cross ? &tdk : NULL, c->cross ? &tdv : NULL, grads,
                                           saved, &tg);
  attn_mha_saved_free(saved);
  fuzz_need(sb == ATTN_OK, ctx, "attn_mha_backward failed");
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, grads, (attn_mha_param)p) != ATTN_OK) continue;
    const int64_t n = attn_tensor_numel(&t);
    ro->grads[p] = malloc(sizeof(float) * (size_t)n + 1);
    memcpy(ro->grads[p], t.data, sizeof(float) * (size_t)n);
  }
}

static void free_run(run_out *ro) {
  free(ro->out), free(ro->weights), free(ro->dq), free(ro->dk), free(ro->dv);
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) free(ro->grads[p]);
}

static double *widen(const float *x, int64_t n) {
  double *d = malloc(sizeof(double) * (size_t)n + 1);
  for (int64_t i = 0; i < n; i++) d[i] = x[i];
  return d;
}

static void compare(const float *a, const float *r, int64_t n, double tol, double floor, const char *name,
                    attn_ctx *ctx) {
  double *rd = widen(r, n);
  close_to(a, rd, n, tol, floor, name, ctx);
  free(rd);
}

static void same_bits(const float *a, const float *b, int64_t n, const char *name, attn_ctx *ctx) {
  char msg[96];
  snprintf(msg, sizeof msg, "%s differs between thread counts", name);
  fuzz_need(!a == !b && (!a || memcmp(a, b, sizeof(float) * (size_t)n) == 0), ctx, msg);
}

static void run(const mcase *c, attn_ctx *ctx, attn_ctx *ref) {
  attn_mha *mha = NULL, *grads = NULL;
  const attn_status sc = attn_mha_create(ctx, &mha, &c->cfg);
  fuzz_need(sc == ATTN_OK || attn_ctx_error(ctx)[0], ctx, "attn_mha_create failed without a message");
  if (sc != ATTN_OK) return; /* sizes the config refuses (head_dim, QK-norm's kind): the status is the check */
  fuzz_need(attn_mha_create(ctx, &grads, &c->cfg) == ATTN_OK, ctx, "a second layer of the same config");
  const attn_mha_config *g = attn_mha_get_config(mha);
  const int64_t E = g->embed_dim, H = g->num_heads;
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, mha, (attn_mha_param)p) != ATTN_OK) continue;
    const int64_t n = attn_tensor_numel(&t), fan_in = t.rank == 2 ? t.shape[1] : 1;
    const int norm = p >= ATTN_MHA_Q_NORM_WEIGHT && p <= ATTN_MHA_K_NORM_BIAS;
    for (int64_t i = 0; i < n; i++)
      ((float *)t.data)[i] = p == ATTN_MHA_SINKS ? (float)(2 * fuzz_uniform())
                                                 : (float)((norm ? 0.5 : 1) * fuzz_uniform() / sqrt((double)fan_in) +
                                                           (norm ? 1 : 0));
  }

  const int64_t sx[3] = {c->B, c->Nq, E}, sk[3] = {c->B, c->Nk, c->kdim}, sv[3] = {c->B, c->Nk, c->vdim};
  float *x = fill(c->B * c->Nq * E, 1), *kc = fill(c->B * c->Nk * c->kdim, 1), *vc = fill(c->B * c->Nk * c->vdim, 1);
  float *kp = malloc(sizeof(float) * (size_t)(c->B * c->Nk * c->kdim) + 1);
  float *vp = malloc(sizeof(float) * (size_t)(c->B * c->Nk * c->vdim) + 1);
  memcpy(kp, kc, sizeof(float) * (size_t)(c->B * c->Nk * c->kdim));
  memcpy(vp, vc, sizeof(float) * (size_t)(c->B * c->Nk * c->vdim));
  uint8_t *pad = calloc((size_t)(c->B * c->Nk) + 1, 1);
  for (int64_t b = 0; b < c->B; b++)
    for (int64_t j = 0; j < c->Nk; j++) {
      pad[b * c->Nk + j] = c->kpm && j >= c->kp_len[b];
      if (!pad[b * c->Nk + j]) continue; /* a padded key's inputs: whatever they hold reaches nothing */
      for (int64_t f = 0; f < c->kdim; f++) kp[(b * c->Nk + j) * c->kdim + f] = j % 2 ? NAN : INFINITY;
      for (int64_t f = 0; f < c->vdim; f++) vp[(b * c->Nk + j) * c->vdim + f] = j % 2 ? -INFINITY : NAN;
    }
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 3, sx), tkc = attn_tensor_view(kc, ATTN_F32, 3, sk),
              tvc = attn_tensor_view(vc, ATTN_F32, 3, sv), tkp = attn_tensor_view(kp, ATTN_F32, 3, sk),
              tvp = attn_tensor_view(vp, ATTN_F32, 3, sv);

  attn_mha_opts o;
  attn_mha_opts_init(&o);
  o.average_weights = c->average;
  o.attn.causal = c->causal;
  o.attn.window = c->window;
  o.attn.softcap = c->softcap;
  o.attn.dropout_p = c->dropout;
  o.attn.dropout_seed = c->seed;
  float slopes[8], sinks[8];
  const int64_t nh = H;
  attn_tensor ts = attn_tensor_view(slopes, ATTN_F32, 1, &nh), tsk = attn_tensor_view(sinks, ATTN_F32, 1, &nh);
  for (int64_t h = 0; h < H; h++) slopes[h] = (float)(0.3 * fuzz_uniform()), sinks[h] = (float)(2 * fuzz_uniform());
  if (c->alibi) o.attn.alibi_slopes = &ts;
  if (c->sinks == 1 || c->sinks == 3) o.attn.sinks = &tsk;
  const int64_t s_kpm[2] = {c->B, c->Nk};
  attn_tensor tkpm = attn_tensor_view(pad, ATTN_BOOL, 2, s_kpm);
  if (c->kpm) o.attn.key_padding = &tkpm;
  const int64_t ms4[4] = {c->B, H, c->Nq, c->Nk}, ms2[2] = {c->Nq, c->Nk};
  const int64_t mn = c->mask_full ? c->B * H * c->Nq * c->Nk : c->Nq * c->Nk;
  void *mask = malloc((size_t)mn * 4 + 1);
  for (int64_t i = 0; i < mn; i++) {
    const double u = fuzz_uniform();
    if (c->mask_kind == 1) ((uint8_t *)mask)[i] = u < -0.5;
    else ((float *)mask)[i] = u < -0.6 ? -INFINITY : (float)u;
  }
  attn_tensor tm = attn_tensor_view(mask, c->mask_kind == 1 ? ATTN_BOOL : ATTN_F32, c->mask_full ? 4 : 2,
                                    c->mask_full ? ms4 : ms2);
  if (c->mask_kind) o.attn.mask = &tm, o.attn.mask_mode = c->mask_kind == 1 ? ATTN_MASK_MASKED : ATTN_MASK_ADDITIVE;
  attn_rope_opts rope;
  attn_rope_opts_init(&rope);
  if (c->rope) o.rope = &rope;
  if (c->nseq) o.attn.cu_seqlens_q = c->cu, o.attn.num_seqs = c->nseq;
  float *gout = fill(c->B * c->Nq * E, 1);

  const attn_tensor *kin = c->cross ? &tkp : NULL, *vin = c->cross ? &tvp : NULL;
  const attn_tensor *kcl = c->cross ? &tkc : NULL, *vcl = c->cross ? &tvc : NULL;
  run_out a, b, r;
  run_layer(ctx, mha, grads, c, &o, &tx, kin, vin, kcl, vcl, gout, &a);
  run_layer(ref, mha, grads, c, &o, &tx, kcl, vcl, kcl, vcl, gout, &r);
  fuzz_log("; status %s", attn_strerror(a.st));
  char msg[160];
  snprintf(msg, sizeof msg, "status %s, the float64 path's %s", attn_strerror(a.st), attn_strerror(r.st));
  fuzz_need(a.st == r.st, ctx, msg);
  if (a.st == ATTN_OK) {
    const int64_t n_out = c->B * c->Nq * E, n_w = c->B * (c->average ? 1 : H) * c->Nq * c->Nk;
    compare(a.out, r.out, n_out, 1e-4, 0.1, "out", ctx);
    if (c->want_weights) compare(a.weights, r.weights, n_w, 1e-4, 1e-3 / (1 - c->dropout), "weights", ctx);
    attn_ctx_set_threads(ctx, c->threads2);
    run_layer(ctx, mha, grads, c, &o, &tx, kin, vin, kcl, vcl, gout, &b);
    attn_ctx_set_threads(ctx, c->threads);
    same_bits(a.out, b.out, n_out, "out", ctx);
    if (c->want_weights) same_bits(a.weights, b.weights, n_w, "weights", ctx);
    if (c->backward) {
      /* sums over tokens (the parameters') or keys (dquery) of terms of about the inputs' size */
      const double tokens = sqrt((double)(c->B * (c->Nq + c->Nk))), keys = sqrt((double)c->Nk + 1);
      const double unit = 0.01 / (1 - c->dropout);
      compare(a.dq, r.dq, c->B * c->Nq * E, 1e-3, unit * keys, "dquery", ctx);
      same_bits(a.dq, b.dq, c->B * c->Nq * E, "dquery", ctx);
      if (c->cross) {
        compare(a.dk, r.dk, c->B * c->Nk * c->kdim, 1e-3, unit * tokens, "dkey", ctx);
        compare(a.dv, r.dv, c->B * c->Nk * c->vdim, 1e-3, unit * tokens, "dvalue", ctx);
        same_bits(a.dk, b.dk, c->B * c->Nk * c->kdim, "dkey", ctx);
        same_bits(a.dv, b.dv, c->B * c->Nk * c->vdim, "dvalue", ctx);
      }
      for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
        attn_tensor t;
        if (!a.grads[p] || attn_mha_param_view(ctx, &t, grads, (attn_mha_param)p) != ATTN_OK) continue;
        const int64_t n = attn_tensor_numel(&t);
        char name[48];
        snprintf(name, sizeof name, "the gradient of parameter %d", p);
        compare(a.grads[p], r.grads[p], n, 1e-3, unit * tokens, name, ctx);
        same_bits(a.grads[p], b.grads[p], n, name, ctx);
      }
    }
    free_run(&b);
  }
  free_run(&a), free_run(&r);
  free(x), free(kc), free(vc), free(kp), free(vp), free(pad), free(mask), free(gout);
  attn_mha_destroy(mha);
  attn_mha_destroy(grads);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!fuzz_kernel_count) return 0;
  fuzz_reader r = {data, size, 0};
  mcase c;
  read_case(&r, &c);
  fuzz_seed(data, size);
  describe(&c);
  attn_ctx *ctx = NULL, *ref = NULL;
  fuzz_need(attn_ctx_create(&ctx) == ATTN_OK && attn_ctx_create(&ref) == ATTN_OK, NULL, "cannot create the contexts");
  fuzz_need(attn_ctx_set_kernel(ctx, c.kernel) == ATTN_OK && attn_ctx_set_threads(ctx, c.threads) == ATTN_OK &&
           attn_ctx_set_kernel(ref, ATTN_KERNEL_REF) == ATTN_OK && attn_ctx_set_threads(ref, 1) == ATTN_OK,
       ctx, "cannot set up the contexts");
  run(&c, ctx, ref);
  attn_ctx_destroy(ctx);
  attn_ctx_destroy(ref);
  return 0;
}
