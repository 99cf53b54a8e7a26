/* attn mha: the multi-head attention layer from a safetensors file, and its backward.
 *
 *   attn mha --params P.safetensors --heads H --query X.npy --out O.npy [options]
 *            [--grad-out G.npy --grads-out GRADS.safetensors]
 *   attn mha --hf-config config.json --params model.safetensors|model.safetensors.index.json --layer L ... */
#include "cli.h"
#include "commands.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The parameter naming of a safetensors file, as the library detects it. */
typedef attn_mha_naming naming;

static char *join(const char *a, const char *b) {
  const size_t la = strlen(a), lb = strlen(b);
  char *s = malloc(la + lb + 1);
  if (s) {
    memcpy(s, a, la);
    memcpy(s + la, b, lb + 1);
  }
  return s;
}

/* The tensors of the gradients file: names and f32 tensors, some owned (packed copies). */
#define GRADS_MAX (ATTN_MHA_NUM_PARAMS + 3)
typedef struct grad_file {
  int n;
  char *name[GRADS_MAX];
  attn_tensor t[GRADS_MAX];
  int owned[GRADS_MAX];
} grad_file;

static void grad_file_free(grad_file *f) {
  for (int i = 0; i < f->n; i++) {
    free(f->name[i]);
    if (f->owned[i]) attn_tensor_free(&f->t[i]);
  }
  f->n = 0;
}

static int grad_add(grad_file *f, const char *prefix, const char *name, const attn_tensor *t, int owned) {
  if (f->n == GRADS_MAX || !(f->name[f->n] = join(prefix, name))) return cli_fail(CLI_EXIT_FAIL, "out of memory");
  f->t[f->n] = *t;
  f->owned[f->n] = owned;
  f->n++;
  return 0;
}

/* Every parameter's gradient under the name the file used, prefix included.
 * Parameters that share a name are rows of one packed tensor, in q, k, v
 * order (in_proj_weight, c_attn.weight); conv1d stores weights [in, out]. */
static int collect_param_grads(attn_ctx *ctx, grad_file *f, attn_mha *grads, const char *const *pname, int conv1d,
                               const char *prefix) {
  int done[ATTN_MHA_NUM_PARAMS] = {0};
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    if (done[p] || !pname[p]) continue;
    attn_tensor part[3];
    int n = 0;
    int64_t rows = 0, cols = 0;
    for (int q = p; q < ATTN_MHA_NUM_PARAMS; q++) {
      if (done[q] || !pname[q] || strcmp(pname[q], pname[p])) continue;
      done[q] = 1;
      attn_tensor t;
      if (attn_mha_param_view(ctx, &t, grads, (attn_mha_param)q)) continue; /* a bias the layer does not have */
      if (n == 3) return cli_fail(CLI_EXIT_FAIL, "mha gradients: more than three parameters named '%s'", pname[p]);
      part[n++] = t;
      rows += t.shape[0];
      cols = t.rank == 2 ? t.shape[1] : 0;
    }
    if (!n) continue;
    const int transpose = conv1d && cols;
    int r;
    if (n == 1 && !transpose) {
      if ((r = grad_add(f, prefix, pname[p], &part[0], 0))) return r;
      continue;
    }
    int64_t shape[2] = {transpose ? cols : rows, transpose ? rows : cols};
    attn_tensor t;
    if ((r = cli_alloc_f32(ctx, &t, cols ? 2 : 1, shape))) return r;
    float *dst = t.data;
    int64_t row0 = 0;
    for (int i = 0; i < n; i++) {
      const float *src = part[i].data;
      const int64_t pr = part[i].shape[0], pc = cols ? cols : 1;
      for (int64_t r0 = 0; r0 < pr; r0++)
        for (int64_t c = 0; c < pc; c++) {
          if (transpose) dst[c * rows + row0 + r0] = src[r0 * pc + c];
          else dst[(row0 + r0) * pc + c] = src[r0 * pc + c];
        }
      row0 += pr;
    }
    if ((r = grad_add(f, prefix, pname[p], &t, 1))) {
      attn_tensor_free(&t);
      return r;
    }
  }
  return 0;
}

/* --names q=NAME,k=NAME,v=NAME,o=NAME[,q_bias=..,k_bias=..,v_bias=..,o_bias=..,q_norm=..,k_norm=..,
 * q_norm_bias=..,k_norm_bias=..,sinks=..] into names, whose strings point into buf (a copy of the spec). */
static int parse_names(const char *spec, attn_mha_names *names, char *buf, size_t cap) {
  static const char *const keys[ATTN_MHA_NUM_PARAMS] = {"q", "q_bias", "k", "k_bias", "v", "v_bias", "o", "o_bias",
                                                        "q_norm", "q_norm_bias", "k_norm", "k_norm_bias", "sinks"};
  memset(names, 0, sizeof *names);
  names->size = sizeof *names;
  if (strlen(spec) >= cap) return cli_fail(CLI_EXIT_USAGE, "--names is too long");
  strcpy(buf, spec);
  for (char *item = buf; item && *item;) {
    char *next = strchr(item, ',');
    if (next) *next++ = '\0';
    char *eq = strchr(item, '=');
    int k = -1;
    if (eq) {
      *eq = '\0';
      for (int i = 0; i < ATTN_MHA_NUM_PARAMS; i++)
        if (!strcmp(item, keys[i])) k = i;
    }
    if (k < 0 || !eq[1])
      return cli_fail(CLI_EXIT_USAGE,
                      "--names wants KEY=TENSOR items (q, k, v, o, q_bias, ..., k_norm_bias, sinks), got '%s'",
                      cli_show(item));
    if (names->name[k]) return cli_fail(CLI_EXIT_USAGE, "--names gives %s twice", keys[k]);
    names->name[k] = eq + 1;
    item = next;
  }
  static const int weights[4] = {ATTN_MHA_Q_WEIGHT, ATTN_MHA_K_WEIGHT, ATTN_MHA_V_WEIGHT, ATTN_MHA_O_WEIGHT};
  for (int i = 0; i < 4; i++)
    if (!names->name[weights[i]]) return cli_fail(CLI_EXIT_USAGE, "--names needs %s=TENSOR", keys[weights[i]]);
  return 0;
}

int cmd_mha(int argc, char **argv) {
  static const char *const known[] = {"--params", "--prefix", "--heads", "--kv-heads", "--query", "--key",
                                      "--value", "--out", "--mask", "--mask-mode", "--key-padding",
                                      "--weights-out", "--threads", "--grad-out", "--grads-out", "--dropout",
                                      "--seed", "--window", "--chunk", "--softcap", "--sinks", "--precision", "--scale",
                                      "--hf-config", "--layer", "--names", "--layout", "--positions", "--rope",
                                      "--rope-dim", "--rope-scaling", "--clip-qkv", NULL};
  static const char *const switches[] = {"--causal", "--average-weights", "--alibi", "--rope-interleaved", NULL};
  static const char *const out_flags[] = {"--out", "--weights-out", "--grads-out", NULL};
  static const char *const in_flags[] = {"--params", "--query", "--key", "--value", "--mask", "--key-padding",
                                         "--grad-out", "--sinks", "--hf-config", "--positions", NULL};
  /* what a config says; given with --hf-config, they would contradict it */
  static const char *const from_config[] = {"--heads", "--kv-heads", "--prefix", "--names", "--layout", "--window", "--chunk",
                                            "--softcap", "--scale", "--rope", "--clip-qkv", NULL};
  cli_args a;
  int r = cli_parse(&a, argc, argv, known, switches);
  if (r) return r;
  const int hf = cli_has(&a, "--hf-config");
  const char *need[] = {"--params", "--query", "--out", hf ? "--layer" : "--heads"};
  for (int i = 0; i < 4; i++)
    if (!cli_get(&a, need[i]) || !*cli_get(&a, need[i])) return cli_fail(CLI_EXIT_USAGE, "mha needs %s", need[i]);
  for (int i = 0; hf && from_config[i]; i++)
    if (cli_has(&a, from_config[i]))
      return cli_fail(CLI_EXIT_USAGE, "%s comes from --hf-config; drop it", from_config[i]);
  if (!hf && cli_has(&a, "--layer")) return cli_fail(CLI_EXIT_USAGE, "--layer needs --hf-config");
  if (cli_has(&a, "--layout") && !cli_has(&a, "--names")) return cli_fail(CLI_EXIT_USAGE, "--layout needs --names");
  int conv1d = 0;
  if (cli_has(&a, "--layout")) {
    const char *l = cli_get(&a, "--layout");
    if (strcmp(l, "linear") && strcmp(l, "conv1d"))
      return cli_fail(CLI_EXIT_USAGE, "--layout wants linear or conv1d, got '%s'", cli_show(l));
    conv1d = !strcmp(l, "conv1d");
  }
  attn_mha_names names;
  char names_buf[4096];
  if (cli_has(&a, "--names") && (r = parse_names(cli_get(&a, "--names"), &names, names_buf, sizeof names_buf))) return r;
  names.conv1d = conv1d;
  attn_rope_opts rope;
  int rope_on = 0;
  if ((r = cli_parse_rope(&a, &rope, &rope_on))) return r;
  if (cli_has(&a, "--key") != cli_has(&a, "--value")) return cli_fail(CLI_EXIT_USAGE, "give both --key and --value, or neither");
  if (cli_has(&a, "--mask-mode") && !cli_has(&a, "--mask")) return cli_fail(CLI_EXIT_USAGE, "--mask-mode needs --mask");
  if (cli_has(&a, "--average-weights") && !cli_has(&a, "--weights-out"))
    return cli_fail(CLI_EXIT_USAGE, "--average-weights needs --weights-out");
  if (cli_has(&a, "--grad-out") != cli_has(&a, "--grads-out"))
    return cli_fail(CLI_EXIT_USAGE, "give both --grad-out and --grads-out, or neither");
  const int train = cli_has(&a, "--grad-out");
  if (train && !*cli_get(&a, "--grad-out")) return cli_fail(CLI_EXIT_USAGE, "--grad-out needs a file name");
  long long heads = 0, kv_heads = 0, layer = 0;
  attn_causal causal;
  int64_t window = 0, chunk = 0;
  double dropout = 0, softcap = 0, scale = NAN, clip_qkv = 0;
  uint64_t seed = 0;
  if ((r = cli_int(&a, "--heads", 1, 1 << 20, &heads)) || (r = cli_int(&a, "--kv-heads", 1, 1 << 20, &kv_heads)) ||
      (r = cli_int(&a, "--layer", 0, ATTN_HF_MAX_LAYERS - 1, &layer)) || (r = cli_parse_causal(&a, &causal)) ||
      (r = cli_parse_dropout(&a, &dropout, &seed)) || (r = cli_parse_band_softcap(&a, &window, &chunk, &softcap)) ||
      (r = cli_double(&a, "--scale", &scale)) || (r = cli_double(&a, "--clip-qkv", &clip_qkv)))
    return r;
  if (cli_has(&a, "--clip-qkv") && !(clip_qkv > 0 && isfinite(clip_qkv)))
    return cli_fail(CLI_EXIT_USAGE, "--clip-qkv wants a finite number > 0, got '%s'", cli_show(cli_get(&a, "--clip-qkv")));
  if (cli_has(&a, "--scale") && !(scale > 0))
    return cli_fail(CLI_EXIT_USAGE, "--scale wants a number > 0, got '%s'", cli_show(cli_get(&a, "--scale")));
  attn_ctx *ctx = NULL;
  if ((r = cli_setup_ctx(&ctx, &a))) return r;
  attn_mha *mha = NULL, *grads = NULL;
  attn_mha_saved *saved = NULL;
  attn_tensor x = {0}, key = {0}, value = {0}, mask = {0}, kpm = {0}, out = {0}, w = {0};
  attn_tensor *wp = NULL; /* &w once --weights-out asks for it */
  attn_tensor g = {0}, dx = {0}, dkey = {0}, dvalue = {0}, slopes = {0}, sinks = {0};
  grad_file gf = {0};
  int64_t *positions = NULL;
  attn_hf_layer *info = NULL;
  cli_outputs outs;
  const char *prefix = cli_get(&a, "--prefix");
  if (!prefix) prefix = "";
  if ((r = cli_outputs_plan(&outs, &a, out_flags, in_flags))) goto done;
  /* the layer, and the names its file keeps each parameter under (for the gradients) */
  const char *pname[ATTN_MHA_NUM_PARAMS] = {0};
  if (hf) {
    if (!(info = malloc(sizeof *info))) {
      r = cli_fail(CLI_EXIT_FAIL, "out of memory");
      goto done;
    }
    if (attn_mha_create_from_hf(ctx, &mha, info, cli_get(&a, "--hf-config"), cli_get(&a, "--params"), layer)) {
      r = cli_fail(CLI_EXIT_FAIL, "--hf-config/--params: %s", attn_ctx_error(ctx));
      goto done;
    }
    prefix = info->prefix;
    if (info->config.relative_bias && !cli_has(&a, "--mask")) {
      r = cli_fail(CLI_EXIT_USAGE, "model_type '%s' adds a relative position bias, which attn does not compute: "
                   "give it as --mask (additive, [H, N, N] or [B, H, N, N])", info->config.model_type);
      goto done;
    }
    conv1d = info->naming == ATTN_MHA_NAMING_GPT2;
    for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) pname[p] = attn_mha_param_name(info->naming, (attn_mha_param)p);
  } else {
    attn_safetensors *params = NULL;
    naming nm = ATTN_MHA_NAMING_CUSTOM;
    attn_mha_config like;
    attn_mha_config_init(&like, 0, heads);
    like.num_kv_heads = kv_heads;
    like.clip_qkv = clip_qkv;
    if (attn_safetensors_open(ctx, &params, cli_get(&a, "--params")) ||
        (!cli_has(&a, "--names") && attn_mha_detect_naming(ctx, &nm, params, prefix)) ||
        attn_mha_create_from_tensors(ctx, &mha, params, prefix, cli_has(&a, "--names") ? &names : NULL, &like)) {
      r = cli_fail(CLI_EXIT_FAIL, "--params: %s", attn_ctx_error(ctx));
      attn_safetensors_close(params);
      goto done;
    }
    attn_safetensors_close(params);
    if (nm == ATTN_MHA_NAMING_GPT2) conv1d = 1;
    for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++)
      pname[p] = nm == ATTN_MHA_NAMING_CUSTOM ? names.name[p] : attn_mha_param_name(nm, (attn_mha_param)p);
  }
  heads = attn_mha_get_config(mha)->num_heads;
  if ((r = cli_load_array(ctx, &x, cli_get(&a, "--query"), "--query", 1)) || (r = cli_want_rank(&x, 3, "--query", "[B, N, E]")))
    goto done;
  const int cross = cli_has(&a, "--key");
  if (cross && ((r = cli_load_array(ctx, &key, cli_get(&a, "--key"), "--key", 1)) ||
                (r = cli_want_rank(&key, 3, "--key", "[B, Nk, kdim]")) ||
                (r = cli_load_array(ctx, &value, cli_get(&a, "--value"), "--value", 1)) ||
                (r = cli_want_rank(&value, 3, "--value", "[B, Nk, vdim]"))))
    goto done;
  const int64_t B = x.shape[0], Nq = x.shape[1], Nk = cross ? key.shape[1] : Nq;
  attn_mha_opts o;
  attn_mha_opts_init(&o);
  if (hf) {
    attn_hf_layer_opts(info, &o);
  } else {
    o.attn.window = window;
    o.attn.chunk = chunk;
    o.attn.softcap = softcap;
    o.attn.scale = scale;
    o.rope = rope_on ? &rope : NULL;
  }
  o.attn.causal = causal;
  o.attn.dropout_p = dropout;
  o.attn.dropout_seed = seed;
  if (cli_has(&a, "--positions")) {
    if (!o.rope) {
      r = cli_fail(CLI_EXIT_USAGE, "--positions needs RoPE (--rope, or a config with rotary embeddings)");
      goto done;
    }
    if (cross) {
      r = cli_fail(CLI_EXIT_USAGE, "--positions is for self-attention (no --key/--value)");
      goto done;
    }
    if ((r = cli_load_positions(ctx, &a, B, Nq, &positions))) goto done;
    rope = *o.rope;
    rope.positions = positions;
    o.rope = &rope;
  }
  if ((r = cli_load_head_options(ctx, &a, heads, &slopes, &sinks))) goto done;
  o.attn.alibi_slopes = cli_has(&a, "--alibi") ? &slopes : NULL;
  o.attn.sinks = cli_has(&a, "--sinks") ? &sinks : NULL;
  if (cli_has(&a, "--mask")) {
    if ((r = cli_load_array(ctx, &mask, cli_get(&a, "--mask"), "--mask", 0)) ||
        (r = cli_mask_mode_for(&a, &mask, ATTN_MASK_MASKED, &o.attn.mask_mode)))
      goto done;
    /* nn.MultiheadAttention's 3-D mask is [B*H, Nq, Nk]: view it as [B, H, Nq, Nk] */
    if (mask.rank == 3 && mask.shape[0] == B * heads && heads > 1) {
      mask.rank = 4;
      mask.shape[3] = mask.shape[2]; mask.strides[3] = mask.strides[2];
      mask.shape[2] = mask.shape[1]; mask.strides[2] = mask.strides[1];
      mask.shape[1] = heads; mask.strides[1] = mask.strides[0];
      mask.shape[0] = B; mask.strides[0] = mask.strides[0] * heads;
    }
    o.attn.mask = &mask;
  }
  if (cli_has(&a, "--key-padding")) {
    if ((r = cli_load_array(ctx, &kpm, cli_get(&a, "--key-padding"), "--key-padding", 0))) goto done;
    o.attn.key_padding = &kpm;
  }
  if (train && ((r = cli_load_array(ctx, &g, cli_get(&a, "--grad-out"), "--grad-out", 1)) ||
                (r = cli_want_rank(&g, 3, "--grad-out", "[B, Nq, E]"))))
    goto done;
  const attn_mha_config *cfg = attn_mha_get_config(mha);
  int64_t oshape[3] = {B, Nq, cfg->embed_dim};
  if ((r = cli_alloc_f32(ctx, &out, 3, oshape))) goto done;
  if (train && (g.shape[0] != B || g.shape[1] != Nq || g.shape[2] != cfg->embed_dim)) {
    r = cli_fail(CLI_EXIT_FAIL, "--grad-out is [%lld, %lld, %lld]; want the output's shape [B, Nq, E] = [%lld, %lld, %lld]",
                 (long long)g.shape[0], (long long)g.shape[1], (long long)g.shape[2], (long long)B, (long long)Nq,
                 (long long)cfg->embed_dim);
    goto done;
  }
  if (cli_has(&a, "--weights-out")) {
    o.average_weights = cli_has(&a, "--average-weights");
    int64_t ws4[4] = {B, heads, Nq, Nk}, ws3[3] = {B, Nq, Nk};
    if ((r = cli_alloc_f32(ctx, &w, o.average_weights ? 3 : 4, o.average_weights ? ws3 : ws4))) goto done;
    wp = &w;
  }
  if (!train) {
    if (attn_mha_forward(ctx, mha, &out, wp, &x, cross ? &key : NULL, cross ? &value : NULL, &o)) {
      r = cli_fail(CLI_EXIT_FAIL, "mha: %s", attn_ctx_error(ctx));
      goto done;
    }
  } else {
    if (attn_mha_forward_save(ctx, mha, &out, wp, &saved, &x, cross ? &key : NULL, cross ? &value : NULL, &o)) {
      r = cli_fail(CLI_EXIT_FAIL, "mha: %s", attn_ctx_error(ctx));
      goto done;
    }
    if ((r = cli_alloc_f32(ctx, &dx, 3, x.shape)) ||
        (cross && ((r = cli_alloc_f32(ctx, &dkey, 3, key.shape)) || (r = cli_alloc_f32(ctx, &dvalue, 3, value.shape)))))
      goto done;
    if (attn_mha_create(ctx, &grads, cfg)) {
      r = cli_fail(CLI_EXIT_FAIL, "mha gradients: %s", attn_ctx_error(ctx));
      goto done;
    }
    if (attn_mha_backward(ctx, mha, &dx, cross ? &dkey : NULL, cross ? &dvalue : NULL, grads, saved, &g)) {
      r = cli_fail(CLI_EXIT_FAIL, "mha backward: %s", attn_ctx_error(ctx));
      goto done;
    }
    if ((r = collect_param_grads(ctx, &gf, grads, pname, conv1d, prefix)) || (r = grad_add(&gf, "", "query", &dx, 0)) ||
        (cross && ((r = grad_add(&gf, "", "key", &dkey, 0)) || (r = grad_add(&gf, "", "value", &dvalue, 0)))))
      goto done;
  }
  if ((r = cli_write_npy(ctx, &outs, "--out", &out)) || (wp && (r = cli_write_npy(ctx, &outs, "--weights-out", &w))) ||
      (train && (r = cli_write_safetensors(ctx, &outs, "--grads-out", gf.n, (const char *const *)gf.name, gf.t))) ||
      (r = cli_outputs_commit(&outs)))
    goto done;
done:
  cli_outputs_free(&outs);
  grad_file_free(&gf);
  attn_tensor_free(&x); attn_tensor_free(&key); attn_tensor_free(&value); attn_tensor_free(&mask);
  attn_tensor_free(&kpm); attn_tensor_free(&out); attn_tensor_free(&w); attn_tensor_free(&g);
  attn_tensor_free(&dx); attn_tensor_free(&dkey); attn_tensor_free(&dvalue);
  attn_tensor_free(&slopes); attn_tensor_free(&sinks);
  free(positions);
  free(info);
  attn_mha_saved_free(saved);
  attn_mha_destroy(grads);
  attn_mha_destroy(mha);
  attn_ctx_destroy(ctx);
  return r;
}
