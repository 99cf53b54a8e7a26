/* Reading the options structs callers pass (see opts.h). */
#include "opts.h"

#include <stdalign.h>

attn_status attn__read_sized(attn_ctx *ctx, void *dst, size_t dst_size, const void *src, const char *what,
                             const char *init) {
  size_t size;
  memcpy(&size, src, sizeof size);
  if (size == 0) return attn__fail(ctx, ATTN_E_INVALID, "%s.size is 0: initialise with %s", what, init);
  /* every version holds at least one field after size, and the struct's alignment is size_t's at least */
  if (size <= sizeof size || size % alignof(size_t) || size > dst_size)
    return attn__fail(ctx, ATTN_E_INVALID,
                      "%s.size is %zu, not the size of any version of this struct (%zu in this libattn%s): "
                      "initialise with %s",
                      what, size, dst_size, size > dst_size ? "; built against a newer attn.h?" : "", init);
  memcpy((char *)dst + sizeof size, (const char *)src + sizeof size, size - sizeof size);
  return ATTN_OK;
}

attn_status attn__read_sdpa_opts(attn_ctx *ctx, attn_sdpa_opts *dst, const attn_sdpa_opts *opts, const char *what) {
  attn_sdpa_opts_init(dst);
  return opts ? attn__read_sized(ctx, dst, sizeof *dst, opts, what, "attn_sdpa_opts_init") : ATTN_OK;
}

attn_status attn__cached_opts(attn_ctx *ctx, attn_sdpa_opts *dst, const attn_sdpa_opts *opts, const char *fn) {
  attn_status st = attn__read_sdpa_opts(ctx, dst, opts, "opts");
  if (st) return st;
  if (dst->mask || dst->key_padding || dst->dropout_p != 0)
    return attn__fail(ctx, ATTN_E_INVALID,
                      "%s: masks, key padding and dropout are not taken here (each row's length says which keys "
                      "exist)",
                      fn);
  if (dst->cu_seqlens_q || dst->cu_seqlens_k || dst->num_seqs)
    return attn__fail(ctx, ATTN_E_UNSUPPORTED, "%s: a packed batch (cu_seqlens) is not taken here (the cache's rows "
                      "are the sequences, each row's length says which keys exist)", fn);
  if (dst->q_offset || dst->k_offset || dst->head_offset)
    return attn__fail(ctx, ATTN_E_UNSUPPORTED, "%s: q_offset, k_offset and head_offset are not taken here (the "
                      "cache's rows count their tokens from 0)", fn);
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
