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

#endif
