/* attn sdpa: scaled dot-product attention on .npy arrays, and its backward.
 *
 *   attn sdpa --q Q.npy --k K.npy --v V.npy --out O.npy [options]
 *             [--cu-seqlens CU.npy [--cu-seqlens-k CUK.npy]]  (a packed batch: q [1, H, total_q, D])
 *             [--grad-out G.npy --dq-out DQ.npy --dk-out DK.npy --dv-out DV.npy --mask-grad-out DM.npy] */
#include "cli.h"
#include "commands.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The gradient of a mask that broadcast to [B, Hq, Nq, Nk]: mg (contiguous
 * [B, Hq, Nq, Nk]) summed over the dimensions the mask broadcast along, into
 * dm (f32, the mask's own shape). Sums run in double, in a fixed order. */
static int reduce_mask_grad(attn_ctx *ctx, attn_tensor *dm, const attn_tensor *mg, const attn_tensor *mask) {
  int r = cli_alloc_f32(ctx, dm, mask->rank, mask->shape);
  if (r) return r;
  const int64_t n = attn_tensor_numel(dm);
  double *acc = calloc(n > 0 ? (size_t)n : 1, sizeof *acc);
  if (!acc) return cli_fail(CLI_EXIT_FAIL, "out of memory");
  int64_t cs[ATTN_MAX_RANK], st[4];
  for (int d = mask->rank - 1; d >= 0; d--) cs[d] = d == mask->rank - 1 ? 1 : cs[d + 1] * mask->shape[d + 1];
  const int off = 4 - mask->rank; /* right-aligned, as numpy broadcasts */
  for (int d = 0; d < 4; d++) st[d] = (d < off || mask->shape[d - off] == 1) ? 0 : cs[d - off];
  const float *g = mg->data;
  for (int64_t b = 0; b < mg->shape[0]; b++)
    for (int64_t h = 0; h < mg->shape[1]; h++)
      for (int64_t i = 0; i < mg->shape[2]; i++) {
        double *row = acc + b * st[0] + h * st[1] + i * st[2];
        for (int64_t j = 0; j < mg->shape[3]; j++) row[j * st[3]] += *g++;
      }
  for (int64_t e = 0; e < n; e++) ((float *)dm->data)[e] = (float)acc[e];
  free(acc);
  return 0;
}

/* --kv-dtype f32|f16|bf16: k and v rounded to that type before attention. The
 * forward then reads them stored as halves; the backward (f32 only) reads the
 * rounded values in f32, which is the same function. */
static int kv_dtype(attn_ctx *ctx, cli_args *a, attn_tensor *k, attn_tensor *v, int backward) {
  const char *s = cli_get(a, "--kv-dtype");
  if (!s || !strcmp(s, "f32")) return 0;
  attn_dtype dt;
  if (!strcmp(s, "f16")) dt = ATTN_F16;
  else if (!strcmp(s, "bf16")) dt = ATTN_BF16;
  else return cli_fail(CLI_EXIT_USAGE, "--kv-dtype wants f32, f16 or bf16, got '%s'", cli_show(s));
  attn_tensor *t[2] = {k, v};
  for (int i = 0; i < 2; i++) {
    attn_tensor h;
    if (attn_tensor_alloc(ctx, &h, dt, 4, t[i]->shape)) return cli_fail(CLI_EXIT_FAIL, "out of memory");
    if (attn_tensor_copy(ctx, &h, t[i]) || (backward && attn_tensor_copy(ctx, t[i], &h))) {
      attn_tensor_free(&h);
      return cli_fail(CLI_EXIT_FAIL, "--kv-dtype: %s", attn_ctx_error(ctx));
    }
    if (backward) {
      attn_tensor_free(&h);
    } else {
      attn_tensor_free(t[i]);
      *t[i] = h;
    }
  }
  return 0;
}

int cmd_sdpa(int argc, char **argv) {
  static const char *const known[] = {"--q", "--k", "--v", "--out", "--mask", "--mask-mode", "--scale",
                                      "--weights-out", "--threads", "--key-padding", "--grad-out", "--dq-out",
                                      "--dk-out", "--dv-out", "--mask-grad-out", "--dropout", "--seed",
                                      "--window", "--chunk", "--softcap", "--sinks", "--sinks-grad-out", "--kv-dtype", "--precision",
                                      "--cu-seqlens", "--cu-seqlens-k", "--q-offset", "--k-offset", NULL};
  static const char *const switches[] = {"--causal", "--alibi", NULL};
  static const char *const out_flags[] = {"--out", "--weights-out", "--dq-out", "--dk-out", "--dv-out",
                                          "--mask-grad-out", "--sinks-grad-out", NULL};
  static const char *const in_flags[] = {"--q", "--k", "--v", "--mask", "--key-padding", "--grad-out", "--sinks",
                                         "--cu-seqlens", "--cu-seqlens-k", NULL};
  cli_args a;
  int r = cli_parse(&a, argc, argv, known, switches);
  if (r) return r;
  const char *need[] = {"--q", "--k", "--v", "--out"};
  for (int i = 0; i < 4; i++)
    if (!cli_get(&a, need[i]) || !*cli_get(&a, need[i])) return cli_fail(CLI_EXIT_USAGE, "sdpa needs %s", need[i]);
  attn_causal causal;
  double scale = NAN, dropout = 0;
  uint64_t seed = 0;
  int64_t window = 0, chunk = 0;
  double softcap = 0;
  if ((r = cli_parse_causal(&a, &causal)) || (r = cli_double(&a, "--scale", &scale)) ||
      (r = cli_parse_dropout(&a, &dropout, &seed)) || (r = cli_parse_band_softcap(&a, &window, &chunk, &softcap)))
    return r;
  /* the fp32 kernels scale in float: a larger scale (or inf, or NaN, the default's marker) is no scale */
  if (cli_has(&a, "--scale") && !(fabs(scale) <= FLT_MAX))
    return cli_fail(CLI_EXIT_USAGE, "--scale wants a number finite in float32 (|S| <= %.4g), got '%s'", (double)FLT_MAX,
                    cli_show(cli_get(&a, "--scale")));
  /* a shard of a longer sequence: its rows' and keys' global positions */
  long long q_offset = 0, k_offset = 0;
  if ((cli_has(&a, "--q-offset") && (r = cli_int(&a, "--q-offset", 0, 1LL << 48, &q_offset))) ||
      (cli_has(&a, "--k-offset") && (r = cli_int(&a, "--k-offset", 0, 1LL << 48, &k_offset))))
    return r;
  attn_mask_mode mode_flag = ATTN_MASK_KEEP;
  if (cli_has(&a, "--mask-mode")) {
    if (!cli_has(&a, "--mask")) return cli_fail(CLI_EXIT_USAGE, "--mask-mode needs --mask");
    if ((r = cli_parse_mask_mode(cli_get(&a, "--mask-mode"), &mode_flag))) return r;
  }
  /* the backward: --grad-out G with at least one gradient output, and none without it */
  const int want_dq = cli_has(&a, "--dq-out"), want_dk = cli_has(&a, "--dk-out"), want_dv = cli_has(&a, "--dv-out");
  const int want_dm = cli_has(&a, "--mask-grad-out"), want_ds = cli_has(&a, "--sinks-grad-out");
  const int backward = cli_has(&a, "--grad-out");
  if (backward && !want_dq && !want_dk && !want_dv && !want_dm && !want_ds)
    return cli_fail(CLI_EXIT_USAGE,
                    "--grad-out needs at least one of --dq-out, --dk-out, --dv-out, --mask-grad-out, --sinks-grad-out");
  if (!backward && (want_dq || want_dk || want_dv || want_dm || want_ds))
    return cli_fail(CLI_EXIT_USAGE, "%s needs --grad-out",
                    want_dq ? "--dq-out" : want_dk ? "--dk-out" : want_dv ? "--dv-out" : want_dm ? "--mask-grad-out"
                                                                                                 : "--sinks-grad-out");
  if (cli_has(&a, "--cu-seqlens-k") && !cli_has(&a, "--cu-seqlens"))
    return cli_fail(CLI_EXIT_USAGE, "--cu-seqlens-k needs --cu-seqlens");
  if (want_ds && !cli_has(&a, "--sinks")) return cli_fail(CLI_EXIT_USAGE, "--sinks-grad-out needs --sinks");
  if (backward && !*cli_get(&a, "--grad-out")) return cli_fail(CLI_EXIT_USAGE, "--grad-out needs a file name");
  if (want_dm && !cli_has(&a, "--mask")) return cli_fail(CLI_EXIT_USAGE, "--mask-grad-out needs --mask");
  if (want_dm && cli_has(&a, "--mask-mode") && mode_flag != ATTN_MASK_ADDITIVE)
    return cli_fail(CLI_EXIT_USAGE, "--mask-grad-out needs an additive mask, not --mask-mode %s",
                    cli_show(cli_get(&a, "--mask-mode")));
  attn_ctx *ctx = NULL;
  if ((r = cli_setup_ctx(&ctx, &a))) return r;
  attn_tensor q = {0}, k = {0}, v = {0}, mask = {0}, kpm = {0}, out = {0}, w = {0};
  attn_tensor *wp = NULL; /* &w once --weights-out asks for it */
  attn_tensor g = {0}, lse = {0}, dq = {0}, dk = {0}, dv = {0}, mg = {0}, dm = {0};
  attn_tensor slopes = {0}, sinks = {0}, ds = {0};
  int64_t *cu_q = NULL, *cu_k = NULL, ncu_q = 0, ncu_k = 0;
  cli_outputs outs;
  if ((r = cli_outputs_plan(&outs, &a, out_flags, in_flags))) goto done;
  if ((r = cli_load_array(ctx, &q, cli_get(&a, "--q"), "--q", 1)) || (r = cli_want_rank(&q, 4, "--q", "[B, H, Nq, D]")) ||
      (r = cli_load_array(ctx, &k, cli_get(&a, "--k"), "--k", 1)) || (r = cli_want_rank(&k, 4, "--k", "[B, Hk, Nk, D]")) ||
      (r = cli_load_array(ctx, &v, cli_get(&a, "--v"), "--v", 1)) || (r = cli_want_rank(&v, 4, "--v", "[B, Hk, Nk, Dv]")) ||
      (r = kv_dtype(ctx, &a, &k, &v, backward)))
    goto done;
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.scale = scale;
  o.causal = causal;
  o.dropout_p = dropout;
  o.dropout_seed = seed;
  o.window = window;
  o.chunk = chunk;
  o.softcap = softcap;
  o.q_offset = q_offset, o.k_offset = k_offset;
  if ((r = cli_load_head_options(ctx, &a, q.shape[1], &slopes, &sinks))) goto done;
  o.alibi_slopes = cli_has(&a, "--alibi") ? &slopes : NULL;
  o.sinks = cli_has(&a, "--sinks") ? &sinks : NULL;
  /* a packed batch: q [1, H, total_q, D], sequence s at rows cu[s]..cu[s+1] */
  if (cli_has(&a, "--cu-seqlens")) {
    if ((r = cli_load_offsets(ctx, &a, "--cu-seqlens", &cu_q, &ncu_q)) ||
        (cli_has(&a, "--cu-seqlens-k") && (r = cli_load_offsets(ctx, &a, "--cu-seqlens-k", &cu_k, &ncu_k))))
      goto done;
    if (cu_k && ncu_k != ncu_q) {
      r = cli_fail(CLI_EXIT_FAIL, "--cu-seqlens-k has %lld entries; --cu-seqlens has %lld", (long long)ncu_k,
                   (long long)ncu_q);
      goto done;
    }
    o.cu_seqlens_q = cu_q, o.cu_seqlens_k = cu_k, o.num_seqs = ncu_q - 1;
  }
  if (cli_has(&a, "--mask")) {
    if ((r = cli_load_array(ctx, &mask, cli_get(&a, "--mask"), "--mask", 0)) ||
        (r = cli_mask_mode_for(&a, &mask, ATTN_MASK_KEEP, &o.mask_mode)))
      goto done;
    if (want_dm && o.mask_mode != ATTN_MASK_ADDITIVE) {
      r = cli_fail(CLI_EXIT_FAIL, "--mask-grad-out needs an additive (float) mask; '%s' is %s", cli_show(cli_get(&a, "--mask")),
                   attn_dtype_name(mask.dtype));
      goto done;
    }
    o.mask = &mask;
  }
  if (cli_has(&a, "--key-padding")) {
    if ((r = cli_load_array(ctx, &kpm, cli_get(&a, "--key-padding"), "--key-padding", 0))) goto done;
    o.key_padding = &kpm;
  }
  if (backward && ((r = cli_load_array(ctx, &g, cli_get(&a, "--grad-out"), "--grad-out", 1)) ||
                   (r = cli_want_rank(&g, 4, "--grad-out", "[B, H, Nq, Dv]"))))
    goto done;
  int64_t oshape[4] = {q.shape[0], q.shape[1], q.shape[2], v.shape[3]};
  if ((r = cli_alloc_f32(ctx, &out, 4, oshape))) goto done;
  if (cli_has(&a, "--weights-out")) {
    int64_t wshape[4] = {q.shape[0], q.shape[1], q.shape[2], k.shape[2]};
    if ((r = cli_alloc_f32(ctx, &w, 4, wshape))) goto done;
    wp = &w;
  }
  if (backward && (r = cli_alloc_f32(ctx, &lse, 3, q.shape))) goto done;
  if (attn_sdpa(ctx, &out, backward ? &lse : NULL, wp, &q, &k, &v, &o)) {
    r = cli_fail(CLI_EXIT_FAIL, "sdpa: %s", attn_ctx_error(ctx));
    goto done;
  }
  if (backward) {
    /* the forward has checked the shapes: every gradient is computed, the asked-for ones written */
    int64_t mshape[4] = {q.shape[0], q.shape[1], q.shape[2], k.shape[2]};
    if ((r = cli_alloc_f32(ctx, &dq, 4, q.shape)) || (r = cli_alloc_f32(ctx, &dk, 4, k.shape)) ||
        (r = cli_alloc_f32(ctx, &dv, 4, v.shape)) || (want_dm && (r = cli_alloc_f32(ctx, &mg, 4, mshape))) ||
        (want_ds && (r = cli_alloc_f32(ctx, &ds, 1, sinks.shape))))
      goto done;
    if (attn_sdpa_backward(ctx, &dq, &dk, &dv, want_dm ? &mg : NULL, want_ds ? &ds : NULL, &g, &q, &k, &v, &out, &lse,
                           &o)) {
      r = cli_fail(CLI_EXIT_FAIL, "sdpa backward: %s", attn_ctx_error(ctx));
      goto done;
    }
    if (want_dm && (r = reduce_mask_grad(ctx, &dm, &mg, &mask))) goto done;
  }
  if ((r = cli_write_npy(ctx, &outs, "--out", &out)) || (wp && (r = cli_write_npy(ctx, &outs, "--weights-out", &w))) ||
      (want_dq && (r = cli_write_npy(ctx, &outs, "--dq-out", &dq))) ||
      (want_dk && (r = cli_write_npy(ctx, &outs, "--dk-out", &dk))) ||
      (want_dv && (r = cli_write_npy(ctx, &outs, "--dv-out", &dv))) ||
      (want_dm && (r = cli_write_npy(ctx, &outs, "--mask-grad-out", &dm))) ||
      (want_ds && (r = cli_write_npy(ctx, &outs, "--sinks-grad-out", &ds))) || (r = cli_outputs_commit(&outs)))
    goto done;
done:
  cli_outputs_free(&outs);
  attn_tensor_free(&q); attn_tensor_free(&k); attn_tensor_free(&v); attn_tensor_free(&mask);
  attn_tensor_free(&kpm); attn_tensor_free(&out); attn_tensor_free(&w); attn_tensor_free(&g);
  attn_tensor_free(&lse); attn_tensor_free(&dq); attn_tensor_free(&dk); attn_tensor_free(&dv);
  attn_tensor_free(&mg); attn_tensor_free(&dm);
  attn_tensor_free(&slopes); attn_tensor_free(&sinks); attn_tensor_free(&ds);
  free(cu_q), free(cu_k);
  attn_ctx_destroy(ctx);
  return r;
}
