/* attn mha: the multi-head attention layer from a safetensors file, and its backward.
 *
 *   attn mha --params P.safetensors --heads H --query X.npy --out O.npy [options]
 *            [--grad-out G.npy --grads-out GRADS.safetensors] */
#include "cli.h"
#include "commands.h"

#include <stdlib.h>
#include <string.h>

/* The parameter naming of a safetensors file, as the library detects it. */
typedef attn_mha_naming naming;

/* The file's name of parameter p under naming nm; NULL where PyTorch packs it
 * into in_proj_weight / in_proj_bias (collect_param_grads adds those whole). */
static const char *single_name(naming nm, int p) {
  const char *name = attn_mha_param_name(nm, (attn_mha_param)p);
  return name && strncmp(name, "in_proj_", 8) ? name : NULL;
}

static char *join(const char *a, const char *b) {
  const size_t la = strlen(a), lb = strlen(b);
  char *s = malloc(la + lb + 1);
  if (s) {
    memcpy(s, a, la);
    memcpy(s + la, b, lb + 1);
  }
  return s;
}

static int detect_naming(attn_ctx *ctx, const attn_safetensors *st, const char *prefix, naming *nm) {
  if (attn_mha_detect_naming(ctx, nm, st, prefix)) return cli_fail(CLI_EXIT_FAIL, "--params: %s", attn_ctx_error(ctx));
  return 0;
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

/* PyTorch's packed in_proj_weight / in_proj_bias: the q, k and v rows in turn. */
static int grad_add_packed(attn_ctx *ctx, grad_file *f, attn_mha *grads, const char *prefix, const char *name,
                           int bias) {
  attn_tensor part[3], t;
  int64_t shape[2] = {0, 0};
  for (int i = 0; i < 3; i++) {
    if (attn_mha_param_view(ctx, &part[i], grads, (attn_mha_param)(2 * i + bias)))
      return cli_fail(CLI_EXIT_FAIL, "mha gradients: %s", attn_ctx_error(ctx));
    shape[0] += part[i].shape[0];
    shape[1] = bias ? 0 : part[i].shape[1];
  }
  int r = cli_alloc_f32(ctx, &t, bias ? 1 : 2, shape);
  if (r) return r;
  float *dst = t.data;
  for (int i = 0; i < 3; i++) {
    const int64_t n = attn_tensor_numel(&part[i]);
    memcpy(dst, part[i].data, (size_t)n * sizeof *dst);
    dst += n;
  }
  if ((r = grad_add(f, prefix, name, &t, 1))) attn_tensor_free(&t);
  return r;
}

/* Every parameter's gradient under the name the file used, prefix included. */
static int collect_param_grads(attn_ctx *ctx, grad_file *f, attn_mha *grads, naming nm, const char *prefix) {
  const int bias = attn_mha_get_config(grads)->bias;
  int r;
  if (nm == ATTN_MHA_NAMING_TORCH_PACKED && (r = grad_add_packed(ctx, f, grads, prefix, "in_proj_weight", 0))) return r;
  if ((nm == ATTN_MHA_NAMING_TORCH_PACKED || nm == ATTN_MHA_NAMING_TORCH_SEPARATE) && bias &&
      (r = grad_add_packed(ctx, f, grads, prefix, "in_proj_bias", 1)))
    return r;
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    const char *name = single_name(nm, p);
    if (!name || (p % 2 == 1 && !bias)) continue;
    attn_tensor t;
    if (attn_mha_param_view(ctx, &t, grads, (attn_mha_param)p))
      return cli_fail(CLI_EXIT_FAIL, "mha gradients: %s", attn_ctx_error(ctx));
    if ((r = grad_add(f, prefix, name, &t, 0))) return r;
  }
  return 0;
}

int cmd_mha(int argc, char **argv) {
  static const char *const known[] = {"--params", "--prefix", "--heads", "--kv-heads", "--query", "--key",
                                      "--value", "--out", "--mask", "--mask-mode", "--key-padding",
                                      "--weights-out", "--threads", "--grad-out", "--grads-out", "--dropout",
                                      "--seed", "--window", "--softcap", "--sinks", "--precision", NULL};
  static const char *const switches[] = {"--causal", "--average-weights", "--alibi", NULL};
  static const char *const out_flags[] = {"--out", "--weights-out", "--grads-out", NULL};
  static const char *const in_flags[] = {"--params", "--query", "--key", "--value", "--mask", "--key-padding",
                                         "--grad-out", "--sinks", NULL};
  cli_args a;
  int r = cli_parse(&a, argc, argv, known, switches);
  if (r) return r;
  const char *need[] = {"--params", "--heads", "--query", "--out"};
  for (int i = 0; i < 4; i++)
    if (!cli_get(&a, need[i]) || !*cli_get(&a, need[i])) return cli_fail(CLI_EXIT_USAGE, "mha needs %s", need[i]);
  if (cli_has(&a, "--key") != cli_has(&a, "--value")) return cli_fail(CLI_EXIT_USAGE, "give both --key and --value, or neither");
  if (cli_has(&a, "--mask-mode") && !cli_has(&a, "--mask")) return cli_fail(CLI_EXIT_USAGE, "--mask-mode needs --mask");
  if (cli_has(&a, "--average-weights") && !cli_has(&a, "--weights-out"))
    return cli_fail(CLI_EXIT_USAGE, "--average-weights needs --weights-out");
  if (cli_has(&a, "--grad-out") != cli_has(&a, "--grads-out"))
    return cli_fail(CLI_EXIT_USAGE, "give both --grad-out and --grads-out, or neither");
  const int train = cli_has(&a, "--grad-out");
  if (train && !*cli_get(&a, "--grad-out")) return cli_fail(CLI_EXIT_USAGE, "--grad-out needs a file name");
  long long heads = 0, kv_heads = 0;
  attn_causal causal;
  int64_t window = 0;
  double dropout = 0, softcap = 0;
  uint64_t seed = 0;
  if ((r = cli_int(&a, "--heads", 1, 1 << 20, &heads)) || (r = cli_int(&a, "--kv-heads", 1, 1 << 20, &kv_heads)) ||
      (r = cli_parse_causal(&a, &causal)) || (r = cli_parse_dropout(&a, &dropout, &seed)) ||
      (r = cli_parse_window_softcap(&a, &window, &softcap)))
    return r;
  attn_ctx *ctx = NULL;
  if ((r = cli_setup_ctx(&ctx, &a))) return r;
  attn_mha *mha = NULL, *grads = NULL;
  attn_mha_saved *saved = NULL;
  attn_tensor x = {0}, key = {0}, value = {0}, mask = {0}, kpm = {0}, out = {0}, w = {0};
  attn_tensor *wp = NULL; /* &w once --weights-out asks for it */
  attn_tensor g = {0}, dx = {0}, dkey = {0}, dvalue = {0}, slopes = {0}, sinks = {0};
  grad_file gf = {0};
  cli_outputs outs;
  const char *prefix = cli_get(&a, "--prefix");
  if (!prefix) prefix = "";
  if ((r = cli_outputs_plan(&outs, &a, out_flags, in_flags))) goto done;
  /* one open file for the layer and the names of its gradients */
  attn_safetensors *params = NULL;
  naming nm = ATTN_MHA_NAMING_NONE;
  if (attn_safetensors_open(ctx, &params, cli_get(&a, "--params")) ||
      attn_mha_create_from_safetensors_handle(ctx, &mha, params, prefix, heads, kv_heads)) {
    r = cli_fail(CLI_EXIT_FAIL, "--params: %s", attn_ctx_error(ctx));
    attn_safetensors_close(params);
    goto done;
  }
  r = detect_naming(ctx, params, prefix, &nm);
  attn_safetensors_close(params);
  if (r) goto done;
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
  o.attn.causal = causal;
  o.attn.dropout_p = dropout;
  o.attn.dropout_seed = seed;
  o.attn.window = window;
  o.attn.softcap = softcap;
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
    if ((r = collect_param_grads(ctx, &gf, grads, nm, prefix)) || (r = grad_add(&gf, "", "query", &dx, 0)) ||
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
  attn_mha_saved_free(saved);
  attn_mha_destroy(grads);
  attn_mha_destroy(mha);
  attn_ctx_destroy(ctx);
  return r;
}
