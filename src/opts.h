/* Reading the options structs callers pass: what more than one public call
 * shares about them. Prefix attn__. */
#ifndef ATTN_OPTS_H
#define ATTN_OPTS_H

#include "internal.h"

/* The options of a decoding step over a KV cache (attn_kv_cache_attend, the
 * layer's attn_mha_forward_cached): *dst = opts (defaults when NULL) with the
 * bottom-right causal alignment, after refusing what a step cannot take:
 * masks, key padding and dropout (a row's length says which keys exist).
 * fn names the public call in the message. */
attn_status attn__cached_opts(attn_ctx *ctx, attn_sdpa_opts *dst, const attn_sdpa_opts *opts, const char *fn);

/* The input tensors attn_sdpa_opts points at (mask, key padding, ...): for
 * code that must keep copies of them all, such as the layer's saved state,
 * without naming each. slots[i] is the address of member i of o; names[i]
 * says what it holds ("the mask"). A tensor added to the struct is added here. */
#define ATTN__SDPA_OPT_TENSORS 4
extern const char *const attn__sdpa_opt_tensor_names[ATTN__SDPA_OPT_TENSORS];
void attn__sdpa_opt_tensors(attn_sdpa_opts *o, const attn_tensor **slots[ATTN__SDPA_OPT_TENSORS]);

#endif
