/* File helpers shared by the .npy and safetensors code: see file.h. */
#include "internal.h"
#include "file.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define ATTN__IO_CHUNK 65536

attn_status attn__io_fail(attn_ctx *ctx, attn_status status, const char *kind, const char *path, const char *fmt,
                          ...) {
  char msg[ATTN__MSG_LEN], shown[200];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  /* a path may hold a newline or a terminal escape: the message stays one line (other bytes, UTF-8 too, stay) */
  size_t j = 0;
  for (const char *c = path; *c && j + 4 < sizeof shown; c++)
    shown[j++] = (unsigned char)*c < 0x20 || *c == 0x7f ? '?' : *c;
  if (path[j]) memcpy(shown + j, "...", 3), j += 3;
  shown[j] = '\0';
  return attn__fail(ctx, status, "%s '%s': %s", kind, shown, msg);
}

int attn__host_is_le(void) {
  const uint16_t one = 1;
  unsigned char b;
  memcpy(&b, &one, 1);
  return b == 1;
}

void attn__swap_elems(unsigned char *p, size_t es, size_t n) {
  for (size_t i = 0; i < n; i++, p += es)
    for (size_t a = 0, b = es - 1; a < b; a++, b--) {
      unsigned char t = p[a];
      p[a] = p[b];
      p[b] = t;
    }
}

void attn__sanitize(char *dst, size_t cap, const char *src, size_t n) {
  size_t j = 0;
  for (size_t i = 0; i < n && j + 1 < cap; i++) dst[j++] = (src[i] >= 0x20 && src[i] < 0x7f) ? src[i] : '?';
  if (n >= cap && cap > 4) {
    memcpy(dst + cap - 4, "...", 3);
    j = cap - 1;
  }
  dst[j] = '\0';
}

attn_status attn__src_open(attn_ctx *ctx, attn__src *src, const char *kind, const char *path) {
  memset(src, 0, sizeof *src);
  src->kind = kind;
  src->path = path;
  /* O_NONBLOCK: a FIFO must not hang open(); non-regular files are refused below. */
  src->fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (src->fd < 0) return attn__io_fail(ctx, ATTN_E_IO, kind, path, "cannot open: %s", strerror(errno));
  struct stat sb;
  attn_status st = ATTN_OK;
  if (fstat(src->fd, &sb) != 0) st = attn__io_fail(ctx, ATTN_E_IO, kind, path, "cannot stat: %s", strerror(errno));
  else if (!S_ISREG(sb.st_mode)) st = attn__io_fail(ctx, ATTN_E_IO, kind, path, "not a regular file");
  if (st) {
    attn__src_close(src);
    return st;
  }
  src->size = (int64_t)sb.st_size;
  return ATTN_OK;
}

void attn__src_mem(attn__src *src, const char *kind, const char *name, const void *mem, size_t size) {
  memset(src, 0, sizeof *src);
  src->kind = kind;
  src->path = name;
  src->fd = -1;
  src->mem = mem;
  src->size = (int64_t)size;
}

void attn__src_close(attn__src *src) {
  if (src->fd >= 0) close(src->fd);
  src->fd = -1;
}

attn_status attn__src_read(attn_ctx *ctx, const attn__src *src, int64_t off, void *buf, size_t n, size_t *got) {
  *got = 0;
  if (off < 0) return attn__io_fail(ctx, ATTN_E_IO, src->kind, src->path, "negative offset");
  if (src->fd < 0) {
    if (off < src->size) {
      const uint64_t left = (uint64_t)(src->size - off);
      *got = left < n ? (size_t)left : n;
      memcpy(buf, src->mem + off, *got);
    }
    return ATTN_OK;
  }
  size_t done = 0;
  while (done < n) {
    /* some systems cap one read; the loop takes the rest */
    const size_t want = n - done < ((size_t)1 << 30) ? n - done : ((size_t)1 << 30);
    ssize_t r = pread(src->fd, (unsigned char *)buf + done, want, (off_t)(off + (int64_t)done));
    if (r < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      *got = done;
      return attn__io_fail(ctx, ATTN_E_IO, src->kind, src->path, "cannot read: %s", strerror(err));
    }
    if (r == 0) break;
    done += (size_t)r;
  }
  *got = done;
  return ATTN_OK;
}

/* ---- atomic writer ------------------------------------------------------------ */
static uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

char *attn__follow_links(const char *path) {
  char *p = strdup(path);
  for (int hops = 0; p; hops++) {
    struct stat sb;
    if (lstat(p, &sb) != 0 || !S_ISLNK(sb.st_mode)) return p;
    char link[PATH_MAX];
    ssize_t n = -1;
    if (hops == 40) errno = ELOOP;
    else if ((n = readlink(p, link, sizeof link)) >= (ssize_t)sizeof link) n = -1, errno = ENAMETOOLONG;
    char *next = NULL;
    if (n >= 0) {
      link[n] = '\0';
      const char *slash = strrchr(p, '/');
      const int dir = link[0] == '/' || !slash ? 0 : (int)(slash - p) + 1;
      const size_t cap = (size_t)dir + (size_t)n + 1;
      if ((next = malloc(cap))) snprintf(next, cap, "%.*s%s", dir, p, link);
    }
    const int err = errno;
    free(p);
    errno = err;
    p = next;
  }
  return NULL;
}

/* O_EXCL with a fresh name rather than mkstemp so the file gets the usual
 * 0666 & ~umask mode instead of 0600. The name is short and in the target's
 * directory (the rename stays on one file system): path + a suffix would pass
 * NAME_MAX for a long file name. */
attn_status attn__out_open(attn_ctx *ctx, attn__out *w, const char *kind, const char *path) {
  w->fd = -1;
  w->path = path;
  w->kind = kind;
  w->tmp = NULL;
  errno = 0;
  if (!(w->target = attn__follow_links(path)))
    return errno == ENOMEM || !errno ? attn__io_fail(ctx, ATTN_E_NOMEM, kind, path, "out of memory")
                                     : attn__io_fail(ctx, ATTN_E_IO, kind, path, "cannot follow the link: %s",
                                                     strerror(errno));
  const char *slash = strrchr(w->target, '/');
  const int dir = slash ? (int)(slash - w->target) + 1 : 0;
  const size_t cap = strlen(w->target) + 32;
  w->tmp = malloc(cap);
  if (!w->tmp) {
    free(w->target);
    w->target = NULL;
    return attn__io_fail(ctx, ATTN_E_NOMEM, kind, path, "out of memory");
  }
  struct timespec ts = {0, 0};
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t seed = ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^
                  (uint64_t)(uintptr_t)w;
  int err = 0;
  for (int attempt = 0; attempt < 100; attempt++) {
    seed = mix64(seed + 0x9e3779b97f4a7c15ull);
    snprintf(w->tmp, cap, "%.*s.attn.tmp.%06llx", dir, w->target, (unsigned long long)(seed & 0xffffffu));
    w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (w->fd >= 0) return ATTN_OK;
    err = errno;
    if (err != EEXIST) break;
  }
  free(w->tmp);
  free(w->target);
  w->tmp = w->target = NULL;
  return attn__io_fail(ctx, ATTN_E_IO, kind, path, "cannot create a temporary file next to it: %s", strerror(err));
}

static void out_abort(attn__out *w) {
  if (w->fd >= 0) close(w->fd);
  if (w->tmp) unlink(w->tmp);
  free(w->tmp);
  free(w->target);
  w->fd = -1;
  w->tmp = w->target = NULL;
}

attn_status attn__out_write(attn_ctx *ctx, attn__out *w, const void *buf, size_t n) {
  const unsigned char *p = buf;
  while (n > 0) {
    ssize_t r = write(w->fd, p, n);
    if (r < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      out_abort(w);
      return attn__io_fail(ctx, ATTN_E_IO, w->kind, w->path, "write failed: %s", strerror(err));
    }
    p += r;
    n -= (size_t)r;
  }
  return ATTN_OK;
}

attn_status attn__out_commit(attn_ctx *ctx, attn__out *w) {
  int fd = w->fd;
  w->fd = -1;
  if (close(fd) != 0) {
    int err = errno;
    out_abort(w);
    return attn__io_fail(ctx, ATTN_E_IO, w->kind, w->path, "write failed: %s", strerror(err));
  }
  if (rename(w->tmp, w->target) != 0) {
    int err = errno;
    out_abort(w);
    return attn__io_fail(ctx, ATTN_E_IO, w->kind, w->path, "cannot rename the temporary file over it: %s",
                         strerror(err));
  }
  free(w->tmp);
  free(w->target);
  w->tmp = w->target = NULL;
  return ATTN_OK;
}

static int is_c_contiguous(const attn_tensor *t) {
  int64_t s = 1;
  for (int i = t->rank - 1; i >= 0; i--) {
    if (t->shape[i] != 1 && t->strides[i] != s) return 0;
    s *= t->shape[i];
  }
  return 1;
}

attn_status attn__out_tensor(attn_ctx *ctx, attn__out *w, const attn_tensor *t) {
  int64_t n = attn_tensor_numel(t);
  if (n <= 0) return ATTN_OK;
  const size_t es = attn_dtype_size(t->dtype);
  const unsigned char *src = t->data;
  const int le = attn__host_is_le();
  if (le && is_c_contiguous(t)) return attn__out_write(ctx, w, src, (size_t)n * es);
  unsigned char *buf = malloc(ATTN__IO_CHUNK);
  if (!buf) {
    out_abort(w);
    return attn__io_fail(ctx, ATTN_E_NOMEM, w->kind, w->path, "out of memory");
  }
  const size_t cap = ATTN__IO_CHUNK / es * es;
  size_t fill = 0;
  int64_t idx[ATTN_MAX_RANK] = {0}, off = 0;
  attn_status st = ATTN_OK;
  for (int64_t i = 0; i < n && !st; i++) {
    memcpy(buf + fill, src + off * (int64_t)es, es);
    fill += es;
    if (fill == cap || i == n - 1) {
      if (!le) attn__swap_elems(buf, es, fill / es);
      st = attn__out_write(ctx, w, buf, fill);
      fill = 0;
    }
    for (int d = t->rank - 1; d >= 0; d--) {
      if (++idx[d] < t->shape[d]) {
        off += t->strides[d];
        break;
      }
      off -= t->strides[d] * (t->shape[d] - 1);
      idx[d] = 0;
    }
  }
  free(buf);
  return st;
}

attn_status attn__read_small_file(attn_ctx *ctx, const char *kind, const char *path, int64_t cap, unsigned char **buf,
                                  size_t *len) {
  *buf = NULL;
  *len = 0;
  attn__src src;
  attn_status st = attn__src_open(ctx, &src, kind, path);
  if (st) return st;
  if (src.size > cap) {
    attn__src_close(&src);
    return attn__io_fail(ctx, ATTN_E_FORMAT, kind, path, "%lld bytes: more than a %s's %lld", (long long)src.size, kind,
                         (long long)cap);
  }
  unsigned char *b = malloc((size_t)src.size + 1);
  size_t got = 0;
  if (!b) st = attn__fail(ctx, ATTN_E_NOMEM, "%s: out of memory", kind);
  else st = attn__src_read(ctx, &src, 0, b, (size_t)src.size, &got);
  attn__src_close(&src);
  if (!st && got != (size_t)src.size) st = attn__io_fail(ctx, ATTN_E_IO, kind, path, "the file shrank while read");
  if (st) {
    free(b);
    return st;
  }
  *buf = b;
  *len = got;
  return ATTN_OK;
}
