/* Reading the options structs callers pass: what more than one public call
 * shares about them. Prefix attn__. */
#ifndef ATTN_OPTS_H
#define ATTN_OPTS_H

#include "internal.h"

/* Reads a caller's options or config struct, whose first member is its
 * size_t size (set by its _init, init names it in messages; what names the
 * argument, "opts"): dst, of dst_size bytes, already holds the defaults; the
 * caller's first size bytes go over them, its size member excepted. A caller
 * built against an older attn.h passes a smaller size: the fields it does not
 * know keep their defaults. This works because fields are only ever
 * appended, each one growing sizeof. Refused (ATTN_E_INVALID): a size of 0 (a
 * struct not made by its _init), one too small to hold a field, not a
 * multiple of the struct's alignment, or larger than dst_size (a newer attn.h). */
attn_status attn__read_sized(attn_ctx *ctx, void *dst, size_t dst_size, const void *src, const char *what,
                             const char *init);
/* attn__read_sized of a whole attn_sdpa_opts: *dst = the defaults when opts is NULL. */
attn_status attn__read_sdpa_opts(attn_ctx *ctx, attn_sdpa_opts *dst, const attn_sdpa_opts *opts, const char *what);

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
