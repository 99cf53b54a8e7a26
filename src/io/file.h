/* File helpers shared by the .npy and safetensors readers and writers.
 * Internal; prefix attn__. Every message is "<kind> '<path>': ...", where kind
 * names the format ("npy", "safetensors"). */
#ifndef ATTN_IO_FILE_H
#define ATTN_IO_FILE_H

#include "internal.h"

#include <stddef.h>
#include <stdint.h>

/* attn__fail with the message prefixed "<kind> '<path>': ". */
#if defined(__GNUC__)
__attribute__((format(printf, 5, 6)))
#endif
attn_status attn__io_fail(attn_ctx *ctx, attn_status status, const char *kind, const char *path, const char *fmt,
                          ...);

/* Nonzero on a little-endian host. */
int attn__host_is_le(void);

/* Reverses the bytes of each of the n elements of es bytes at p. */
void attn__swap_elems(unsigned char *p, size_t es, size_t n);

/* Copies a hostile string of n bytes into a message: printable ASCII only,
 * bounded by cap; a string cut short ends in "...". */
void attn__sanitize(char *dst, size_t cap, const char *src, size_t n);

/* Opens path for reading and refuses anything but a regular file; on success
 * *fd is open (the caller closes it) and *size is the file's size. */
attn_status attn__io_open_read(attn_ctx *ctx, const char *kind, const char *path, int *fd, int64_t *size);

/* Reads up to n bytes; *got < n only at end of file. A read error fails. */
attn_status attn__io_read(attn_ctx *ctx, const char *kind, const char *path, int fd, void *buf, size_t n,
                          size_t *got);

/* ---- atomic writer: a temporary next to path, renamed over it at the end ---- */
typedef struct {
  int fd;
  char *tmp;
  const char *path;
  const char *kind;
} attn__out;

attn_status attn__out_open(attn_ctx *ctx, attn__out *w, const char *kind, const char *path);

/* On failure of any of these the temporary is already gone. */
attn_status attn__out_write(attn_ctx *ctx, attn__out *w, const void *buf, size_t n);
/* Streams t's elements in C order, whatever its strides, little-endian. */
attn_status attn__out_tensor(attn_ctx *ctx, attn__out *w, const attn_tensor *t);
/* Closes the temporary and renames it over the path. */
attn_status attn__out_commit(attn_ctx *ctx, attn__out *w);

#endif
