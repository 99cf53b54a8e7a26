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
