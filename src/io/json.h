/* A strict JSON reader over a byte range, shared by the safetensors header and
 * the Hugging Face config.json: streaming (no tree), every byte checked
 * (UTF-8, escapes, surrogates, numbers), nesting bounded. Internal. */
#ifndef ATTN_IO_JSON_H
#define ATTN_IO_JSON_H

#include "attn.h"

#include <stddef.h>
#include <stdint.h>

#define ATTN__JSON_MAX_DEPTH 64

typedef struct attn__json {
  const unsigned char *start, *p, *end;
  attn_ctx *ctx;
  const char *path;
  const char *kind; /* the file's kind, for messages: "safetensors", "config" */
  const char *what; /* what the JSON is, for messages: "header JSON" */
} attn__json;

/* Length of the valid UTF-8 sequence at p (no overlongs, no surrogates), or 0. */
size_t attn__utf8_len(const unsigned char *p, size_t avail);
/* ATTN_E_FORMAT, with the byte offset of the reader in the message. */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
attn_status attn__json_fail(attn__json *j, const char *fmt, ...);
/* The next byte after white space, or -1 at the end. */
int attn__json_peek(attn__json *j);
attn_status attn__json_expect(attn__json *j, int ch);
/* A string, decoded to UTF-8 into a fresh *out (NUL-terminated, *len bytes
 * which may include NULs from \u0000); out NULL only validates. */
attn_status attn__json_string(attn__json *j, char **out, size_t *len);
/* A non-negative integer that fits int64 (sizes and offsets). */
attn_status attn__json_uint(attn__json *j, int64_t *v);
/* Validates and skips a number. */
attn_status attn__json_number(attn__json *j);
/* A number as a double (finite; integers above 2^53 round). */
attn_status attn__json_double(attn__json *j, double *v);
/* 1 (and moves past it) when the literal w (true, false, null) is next. */
int attn__json_literal(attn__json *j, const char *w);
/* Validates and skips any value; recursion bounded by ATTN__JSON_MAX_DEPTH. */
attn_status attn__json_skip(attn__json *j, int depth);

/* An object: visit(j, key, arg) for each key, which must read (or skip) its
 * value; depth bounds the nesting as in attn__json_skip. */
attn_status attn__json_each_key(attn__json *j, attn_status (*visit)(attn__json *, const char *, void *), void *arg,
                                int depth);
/* An array: visit(j, index, arg) for each item, which must read (or skip) it. */
attn_status attn__json_each_item(attn__json *j, attn_status (*visit)(attn__json *, int64_t, void *), void *arg);

#endif
