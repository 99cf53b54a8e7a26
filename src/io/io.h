/* What the readers offer the rest of the library (the layer's loader) and the
 * fuzzers, beyond the public API. Internal; prefix attn__. The in-memory entry
 * points run the same code as the file readers, only the bytes come from a
 * buffer; name stands for the path in messages. */
#ifndef ATTN_IO_IO_H
#define ATTN_IO_IO_H

#include "attn.h"

#include <stddef.h>

/* attn_npy_read on size bytes at data. */
attn_status attn__npy_read_mem(attn_ctx *ctx, attn_tensor *out, const void *data, size_t size, const char *name);

/* attn_safetensors_open on size bytes at data; the handle keeps its own copy. */
attn_status attn__safetensors_open_mem(attn_ctx *ctx, attn_safetensors **out, const void *data, size_t size,
                                       const char *name);

/* The path (or name) a handle was opened with, for messages. */
const char *attn__safetensors_path(const attn_safetensors *st);

/* What the header says of one tensor; no data is read. */
typedef struct {
  int known;              /* its dtype is an attn_dtype (else dtype is meaningless) */
  attn_dtype dtype;
  const char *dtype_name; /* as in the file, printable */
  int rank;               /* may exceed ATTN_MAX_RANK; shape then holds the first ATTN_MAX_RANK */
  const int64_t *shape;
  int64_t numel;
} attn__st_info;

/* Joins next (and the shards after it) to st's chain: the internal readers
 * below then look in each shard in turn, and closing st closes them all. The
 * public calls (count, name, get) see st's own tensors only. */
void attn__safetensors_chain(attn_safetensors *st, attn_safetensors *next);

/* 1 and *info when st (or a shard chained to it) holds a tensor of that name, else 0. */
int attn__safetensors_info(const attn_safetensors *st, const char *name, attn__st_info *info);

/* Reads tensor name into a new buffer, *owned (free with attn__aligned_free),
 * and views it in *out; the handle keeps nothing, unlike attn_safetensors_get.
 * Statuses and messages as attn_safetensors_get's. */
void attn__aligned_free(void *p); /* core.c; declared here too so that io.h stands alone */
attn_status attn__safetensors_read(attn_ctx *ctx, const attn_safetensors *st, const char *name, attn_tensor *out,
                                   void **owned);

/* A sharded checkpoint's index (model.safetensors.index.json): its weight_map
 * as n (tensor name, shard file name) pairs; hf_index.c says what is refused. */
typedef struct {
  char **name, **file;
  int64_t n, cap;
} attn__hf_index;
attn_status attn__hf_index_read(attn_ctx *ctx, attn__hf_index *x, const char *path);
/* The same on len bytes in memory (the fuzzer's entry); path names them in messages. */
attn_status attn__hf_index_parse(attn_ctx *ctx, attn__hf_index *x, const void *data, size_t len, const char *path);
void attn__hf_index_free(attn__hf_index *x);

#endif
