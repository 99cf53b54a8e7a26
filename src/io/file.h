/* File helpers shared by the .npy and safetensors readers and writers.
 * Internal; prefix attn__. Every message is "<kind> '<path>': ...", where kind
 * names the format ("npy", "safetensors"). */
#ifndef ATTN_IO_FILE_H
#define ATTN_IO_FILE_H

#include "attn.h"

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

/* Where a reader's bytes come from: an open regular file, read by offset
 * (pread), or bytes in memory (the in-memory entry points of io.h, which the
 * fuzzers drive). The readers see no difference. */
typedef struct {
  const char *kind, *path;   /* for messages: the format, the file's path or the buffer's name */
  int fd;                    /* >= 0: a file, else mem */
  const unsigned char *mem;
  int64_t size;              /* bytes when opened */
} attn__src;

/* A file source: refuses anything but a regular file. On success src->fd is
 * open until attn__src_close. */
attn_status attn__src_open(attn_ctx *ctx, attn__src *src, const char *kind, const char *path);
/* A source over size bytes at mem (not copied: they must outlive the source). */
void attn__src_mem(attn__src *src, const char *kind, const char *name, const void *mem, size_t size);
void attn__src_close(attn__src *src);

/* Reads up to n bytes at offset off; *got < n only past the end (a file may
 * have shrunk since it was opened). A read error fails with ATTN_E_IO. */
attn_status attn__src_read(attn_ctx *ctx, const attn__src *src, int64_t off, void *buf, size_t n, size_t *got);

/* A whole file of at most cap bytes (a config, an index) into a fresh buffer
 * (*buf, free it; one byte more than *len, for a terminator); larger files are
 * refused (ATTN_E_FORMAT) before anything is allocated. */
attn_status attn__read_small_file(attn_ctx *ctx, const char *kind, const char *path, int64_t cap, unsigned char **buf,
                                  size_t *len);

/* ---- atomic writer: a temporary next to path, renamed over it at the end ---- */
/* path with each symbolic link at its end replaced by what it points to (a
 * relative link is relative to the link's own directory), until a name that is
 * not a link, existing or not: the file a write to path means. malloc'd; NULL
 * with errno set (ELOOP past 40 links, as the kernel's own limit). */
char *attn__follow_links(const char *path);

/* Writing to a symbolic link replaces the file it points to, and the link stays. */
typedef struct {
  int fd;
  char *tmp;
  char *target;     /* path with its links followed: what the rename replaces */
  const char *path; /* as given, for messages */
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
