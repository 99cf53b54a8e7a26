/* Reading the options structs callers pass (see opts.h). */
#include "opts.h"

attn_status attn__cached_opts(attn_ctx *ctx, attn_sdpa_opts *dst, const attn_sdpa_opts *opts, const char *fn) {
  attn_sdpa_opts_init(dst);
  if (opts) {
    if (opts->mask || opts->key_padding || opts->dropout_p != 0)
      return attn__fail(ctx, ATTN_E_INVALID,
                        "%s: masks, key padding and dropout are not taken here (each row's length says which keys "
                        "exist)",
                        fn);
    *dst = *opts;
  }
  dst->causal = ATTN_CAUSAL_BOTTOM_RIGHT;
  return ATTN_OK;
}

const char *const attn__sdpa_opt_tensor_names[ATTN__SDPA_OPT_TENSORS] = {"the mask", "the key padding",
                                                                         "the ALiBi slopes", "the sinks"};

void attn__sdpa_opt_tensors(attn_sdpa_opts *o, const attn_tensor **slots[ATTN__SDPA_OPT_TENSORS]) {
  slots[0] = &o->mask;
  slots[1] = &o->key_padding;
  slots[2] = &o->alibi_slopes;
  slots[3] = &o->sinks;
}
