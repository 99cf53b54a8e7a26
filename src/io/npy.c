/* .npy files (format 1.0-3.0): a magic string, a Python-literal header dict,
 * then the raw data in C or Fortran order, in either byte order. Files are
 * treated as hostile: every length is checked against the file's real size
 * before anything is allocated. */
#include "internal.h"
#include "file.h"
#include "io.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* numpy itself refuses headers over 10000 bytes by default; anything this
 * reader accepts fits a v1 header, so 64 KiB is generous. */
#define NPY_HEADER_CAP 65536

static const unsigned char npy_magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};

#define npy_fail(ctx, st, path, ...) attn__io_fail(ctx, st, "npy", path, __VA_ARGS__)

/* ---- header dict parsing ------------------------------------------------------ */
typedef struct {
  const char *p, *end;
} npy_cur;

static void cur_ws(npy_cur *c) {
  while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r')) c->p++;
}

static int cur_eat(npy_cur *c, char ch) {
  cur_ws(c);
  if (c->p < c->end && *c->p == ch) {
    c->p++;
    return 1;
  }
  return 0;
}

static int cur_peek(npy_cur *c) {
  cur_ws(c);
  return c->p < c->end ? (unsigned char)*c->p : -1;
}

/* A Python string literal, raw (escapes are kept; no key or dtype needs them).
 * Copies at most cap-1 bytes; *len is the full length. 0 if malformed. */
static int cur_string(npy_cur *c, char *out, size_t cap, size_t *len) {
  int q = cur_peek(c);
  if (q != '\'' && q != '"') return 0;
  const char *s = ++c->p;
  while (c->p < c->end && *c->p != q) {
    if (*c->p == '\\') c->p++;
    if (c->p < c->end) c->p++;
  }
  if (c->p >= c->end) return 0;
  size_t n = (size_t)(c->p - s);
  c->p++;
  size_t k = n < cap - 1 ? n : cap - 1;
  memcpy(out, s, k);
  out[k] = '\0';
  *len = n;
  return 1;
}

static int cur_word(npy_cur *c, const char *w) {
  size_t n = strlen(w);
  cur_ws(c);
  if ((size_t)(c->end - c->p) < n || memcmp(c->p, w, n) != 0) return 0;
  if ((size_t)(c->end - c->p) > n) {
    char nx = c->p[n];
    if ((nx >= 'a' && nx <= 'z') || (nx >= 'A' && nx <= 'Z') || (nx >= '0' && nx <= '9') || nx == '_') return 0;
  }
  c->p += n;
  return 1;
}

typedef struct {
  char descr[32];
  size_t descr_len;
  int fortran;
  int rank;
  int64_t shape[ATTN_MAX_RANK];
} npy_header;

static attn_status parse_shape(attn_ctx *ctx, const char *path, npy_cur *c, npy_header *h) {
  if (!cur_eat(c, '(')) return npy_fail(ctx, ATTN_E_FORMAT, path, "'shape' is not a tuple");
  h->rank = 0;
  if (cur_eat(c, ')')) return ATTN_OK;
  for (;;) {
    cur_ws(c);
    int neg = 0;
    if (c->p < c->end && (*c->p == '-' || *c->p == '+')) neg = *c->p++ == '-';
    if (c->p >= c->end || *c->p < '0' || *c->p > '9')
      return npy_fail(ctx, ATTN_E_FORMAT, path, "'shape' holds something other than integers");
    int64_t v = 0;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
      int dgt = *c->p++ - '0';
      if (v > (INT64_MAX - dgt) / 10) return npy_fail(ctx, ATTN_E_FORMAT, path, "a dimension in 'shape' is too large");
      v = v * 10 + dgt;
    }
    if (c->p < c->end && (*c->p == 'L' || *c->p == 'l')) c->p++; /* Python 2 longs */
    if (neg && v != 0) return npy_fail(ctx, ATTN_E_FORMAT, path, "'shape' has a negative dimension");
    if (h->rank == ATTN_MAX_RANK)
      return npy_fail(ctx, ATTN_E_UNSUPPORTED, path, "rank exceeds ATTN_MAX_RANK (%d)", ATTN_MAX_RANK);
    h->shape[h->rank++] = v;
    if (cur_eat(c, ',')) {
      if (cur_eat(c, ')')) return ATTN_OK;
      continue;
    }
    if (cur_eat(c, ')')) return ATTN_OK;
    return npy_fail(ctx, ATTN_E_FORMAT, path, "'shape' tuple is malformed");
  }
}

/* The header is a dict literal with exactly the keys descr, fortran_order and
 * shape, as numpy demands; order, spacing and a trailing comma are free. */
static attn_status parse_header(attn_ctx *ctx, const char *path, const char *text, size_t n, npy_header *h) {
  npy_cur c = {text, text + n};
  int have_descr = 0, have_fortran = 0, have_shape = 0;
  attn_status st;
  if (!cur_eat(&c, '{')) return npy_fail(ctx, ATTN_E_FORMAT, path, "header is not a dict");
  if (!cur_eat(&c, '}')) {
    for (;;) {
      char key[32];
      size_t klen;
      if (!cur_string(&c, key, sizeof key, &klen))
        return npy_fail(ctx, ATTN_E_FORMAT, path, "header dict: expected a quoted key");
      if (!cur_eat(&c, ':')) return npy_fail(ctx, ATTN_E_FORMAT, path, "header dict: expected ':' after a key");
      if (klen == 5 && !memcmp(key, "descr", 5)) {
        if (have_descr++) return npy_fail(ctx, ATTN_E_FORMAT, path, "header repeats 'descr'");
        int q = cur_peek(&c);
        if (q == '[' || q == '(')
          return npy_fail(ctx, ATTN_E_DTYPE, path, "structured dtypes are not supported");
        if (!cur_string(&c, h->descr, sizeof h->descr, &h->descr_len))
          return npy_fail(ctx, ATTN_E_FORMAT, path, "'descr' is not a string");
      } else if (klen == 13 && !memcmp(key, "fortran_order", 13)) {
        if (have_fortran++) return npy_fail(ctx, ATTN_E_FORMAT, path, "header repeats 'fortran_order'");
        if (cur_word(&c, "True")) h->fortran = 1;
        else if (cur_word(&c, "False")) h->fortran = 0;
        else return npy_fail(ctx, ATTN_E_FORMAT, path, "'fortran_order' is not True or False");
      } else if (klen == 5 && !memcmp(key, "shape", 5)) {
        if (have_shape++) return npy_fail(ctx, ATTN_E_FORMAT, path, "header repeats 'shape'");
        if ((st = parse_shape(ctx, path, &c, h))) return st;
      } else {
        char k[40];
        attn__sanitize(k, sizeof k, key, klen < sizeof key ? klen : sizeof key - 1);
        return npy_fail(ctx, ATTN_E_FORMAT, path, "header has an unexpected key '%s'", k);
      }
      if (cur_eat(&c, ',')) {
        if (cur_eat(&c, '}')) break;
        continue;
      }
      if (cur_eat(&c, '}')) break;
      return npy_fail(ctx, ATTN_E_FORMAT, path, "header dict: expected ',' or '}'");
    }
  }
  cur_ws(&c);
  if (c.p != c.end) return npy_fail(ctx, ATTN_E_FORMAT, path, "header has characters after the dict");
  if (!have_descr || !have_fortran || !have_shape)
    return npy_fail(ctx, ATTN_E_FORMAT, path, "header lacks '%s'",
                    !have_descr ? "descr" : !have_fortran ? "fortran_order" : "shape");
  return ATTN_OK;
}

/* Maps a descr to a dtype; *swap says whether each element's bytes need reversing here
 * (a one-byte element reverses to itself). */
static attn_status parse_descr(attn_ctx *ctx, const char *path, const npy_header *h, attn_dtype *dt, int *swap,
                               int *int_size) {
  char shown[40];
  attn__sanitize(shown, sizeof shown, h->descr, h->descr_len < sizeof h->descr ? h->descr_len : sizeof h->descr - 1);
  const char *d = h->descr;
  int ok = h->descr_len == 3 && (d[0] == '<' || d[0] == '>' || d[0] == '=' || d[0] == '|');
  if (ok) {
    if (!memcmp(d + 1, "f4", 2)) *dt = ATTN_F32;
    else if (!memcmp(d + 1, "f8", 2)) *dt = ATTN_F64;
    else if (!memcmp(d + 1, "f2", 2)) *dt = ATTN_F16;
    else if (!memcmp(d + 1, "b1", 2)) *dt = ATTN_BOOL;
    else if (!memcmp(d + 1, "u1", 2)) *dt = ATTN_U8;
    else if (!memcmp(d + 1, "i8", 2)) *dt = ATTN_F64, *int_size = 8;
    else if (!memcmp(d + 1, "i4", 2)) *dt = ATTN_F64, *int_size = 4;
    else ok = 0;
  }
  if (!ok)
    return npy_fail(ctx, ATTN_E_DTYPE, path, "unsupported dtype '%s' (supported: <f4 <f8 <f2 |b1 |u1 <i4 <i8)", shown);
  /* '=' and '|' mean the writer's host order, taken to be ours */
  *swap = (d[0] == '<' && !attn__host_is_le()) || (d[0] == '>' && attn__host_is_le());
  return ATTN_OK;
}

/* n integers of size bytes (4 or 8) at buf, widened to doubles in place; the
 * buffer holds n doubles. Back to front, so no integer is overwritten before
 * it is read. Integers past 2^53 would round: refused. */
static attn_status widen_integers(attn_ctx *ctx, const char *path, void *buf, int size, int64_t n) {
  double *out = buf;
  for (int64_t i = n - 1; i >= 0; i--) {
    int64_t v;
    if (size == 8) memcpy(&v, (const unsigned char *)buf + 8 * i, 8);
    else {
      int32_t w;
      memcpy(&w, (const unsigned char *)buf + 4 * i, 4);
      v = w;
    }
    if (v > ((int64_t)1 << 53) || v < -((int64_t)1 << 53))
      return npy_fail(ctx, ATTN_E_DTYPE, path, "integer %lld is not exact as a double (|v| > 2^53)", (long long)v);
    out[i] = (double)v;
  }
  return ATTN_OK;
}

/* dst = the array src holds in Fortran order (the first index fastest), in C order; both
 * packed, elements of es bytes. */
static void fortran_to_c(unsigned char *dst, const unsigned char *src, size_t es, int rank, const int64_t *shape) {
  int64_t numel = 1, fstride[ATTN_MAX_RANK], idx[ATTN_MAX_RANK] = {0};
  for (int k = 0; k < rank; k++) fstride[k] = numel, numel *= shape[k];
  int64_t from = 0; /* src's element for idx */
  for (int64_t i = 0; i < numel; i++) {
    memcpy(dst + (size_t)i * es, src + (size_t)from * es, es);
    for (int k = rank - 1; k >= 0; k--) { /* the next C-order index: the last dimension fastest */
      from += fstride[k];
      if (++idx[k] < shape[k]) break;
      from -= idx[k] * fstride[k];
      idx[k] = 0;
    }
  }
}

/* What to read: everything, or elements [start, start + count) of dimension
 * dim (the rest of the file unread), or the header alone (shape and dtype in
 * out, no data). */
typedef struct npy_part {
  int dim; /* -1: the whole array */
  int64_t start, count;
  int header_only;
} npy_part;

/* The reader proper, on a file or on bytes in memory alike. */
static attn_status npy_read(attn_ctx *ctx, attn_tensor *out, const attn__src *src, const npy_part *part) {
  const char *path = src->path;
  const int64_t size = src->size;
  attn_status st;
  char *text = NULL;
  unsigned char *fortran_buf = NULL;
  attn_tensor t;
  memset(&t, 0, sizeof t);
  unsigned char pre[12];
  size_t got;

  if ((st = attn__src_read(ctx, src, 0, pre, 8, &got))) goto done;
  if (got < sizeof npy_magic || memcmp(pre, npy_magic, sizeof npy_magic)) {
    st = npy_fail(ctx, ATTN_E_FORMAT, path,
                  got == 0                                                   ? "empty file"
                  : got < sizeof npy_magic && !memcmp(pre, npy_magic, got) ? "truncated magic string"
                                                                             : "not a .npy file (bad magic string)");
    goto done;
  }
  if (got < 8) {
    st = npy_fail(ctx, ATTN_E_FORMAT, path, "truncated: no format version");
    goto done;
  }
  const int major = pre[6], minor = pre[7];
  if (major < 1 || major > 3 || minor != 0) {
    st = npy_fail(ctx, ATTN_E_UNSUPPORTED, path, "format version %d.%d is not supported (1.0, 2.0, 3.0 are)", major,
                  minor);
    goto done;
  }
  const size_t lenbytes = major == 1 ? 2 : 4;
  if ((st = attn__src_read(ctx, src, 8, pre + 8, lenbytes, &got))) goto done;
  if (got < lenbytes) {
    st = npy_fail(ctx, ATTN_E_FORMAT, path, "truncated: no header length");
    goto done;
  }
  uint32_t hlen = (uint32_t)pre[8] | (uint32_t)pre[9] << 8;
  if (lenbytes == 4) hlen |= (uint32_t)pre[10] << 16 | (uint32_t)pre[11] << 24;
  const int64_t data_off = (int64_t)(8 + lenbytes) + hlen;
  if (hlen > NPY_HEADER_CAP) {
    st = npy_fail(ctx, ATTN_E_FORMAT, path, "header length %lu exceeds the %d-byte limit", (unsigned long)hlen,
                  NPY_HEADER_CAP);
    goto done;
  }
  if (data_off > size) {
    st = npy_fail(ctx, ATTN_E_FORMAT, path, "truncated header: %lu bytes claimed, %lld in the file",
                  (unsigned long)hlen, (long long)(size - (int64_t)(8 + lenbytes)));
    goto done;
  }
  text = malloc(hlen + 1u);
  if (!text) {
    st = npy_fail(ctx, ATTN_E_NOMEM, path, "out of memory");
    goto done;
  }
  if ((st = attn__src_read(ctx, src, (int64_t)(8 + lenbytes), text, hlen, &got))) goto done;
  if (got < hlen) {
    st = npy_fail(ctx, ATTN_E_FORMAT, path, "truncated header");
    goto done;
  }
  npy_header h;
  memset(&h, 0, sizeof h);
  if ((st = parse_header(ctx, path, text, hlen, &h))) goto done;
  attn_dtype dt = ATTN_F32;
  int swap = 0, int_size = 0; /* int_size: integers of that many bytes, read as f64 */
  if ((st = parse_descr(ctx, path, &h, &dt, &swap, &int_size))) goto done;
  const int64_t file_esize = int_size ? int_size : (int64_t)attn_dtype_size(dt);
  int64_t numel = 1, bytes;
  for (int i = 0; i < h.rank; i++)
    if (attn__mul_overflows(numel, h.shape[i], &numel)) {
      st = npy_fail(ctx, ATTN_E_FORMAT, path, "shape is too large (element count overflows)");
      goto done;
    }
  if (attn__mul_overflows(numel, 8, &bytes) || attn__mul_overflows(numel, file_esize, &bytes)) {
    st = npy_fail(ctx, ATTN_E_FORMAT, path, "shape is too large (byte count overflows)");
    goto done;
  }
  int64_t span;
  if (attn__span_bytes(h.rank, h.shape, (int64_t)attn_dtype_size(dt), &span)) {
    st = npy_fail(ctx, ATTN_E_FORMAT, path, "shape is too large (its strides would pass 2^63 bytes)");
    goto done;
  }
  /* Before allocating: a tiny file cannot make us reserve terabytes. */
  if (bytes > size - data_off) {
    st = npy_fail(ctx, ATTN_E_FORMAT, path, "truncated: the shape needs %lld data bytes, the file has %lld",
                  (long long)bytes, (long long)(size - data_off));
    goto done;
  }
  if (part->header_only) {
    out->data = NULL, out->dtype = dt, out->rank = h.rank;
    for (int i = 0; i < h.rank; i++) out->shape[i] = h.shape[i];
    goto done;
  }
  /* a slice: outer runs of count * inner elements, start * inner into each of the file's runs; in
   * Fortran order the dimensions before dim are the inner ones and those after it the outer */
  int64_t outer = 1, inner = 1, full = 0;
  if (part->dim >= 0) {
    if (part->dim >= h.rank || part->start < 0 || part->count < 0 || part->start > h.shape[part->dim] ||
        part->count > h.shape[part->dim] - part->start) {
      st = npy_fail(ctx, ATTN_E_SHAPE, path, "no elements [%lld, %lld) of dimension %d in an array of rank %d%s",
                    (long long)part->start, (long long)(part->start + part->count), part->dim, h.rank,
                    part->dim < h.rank ? " of that size" : "");
      goto done;
    }
    for (int i = 0; i < part->dim; i++) *(h.fortran ? &inner : &outer) *= h.shape[i];
    for (int i = part->dim + 1; i < h.rank; i++) *(h.fortran ? &outer : &inner) *= h.shape[i];
    full = h.shape[part->dim];
    h.shape[part->dim] = part->count;
    numel = outer * part->count * inner;
    bytes = numel * file_esize;
  }
  if ((st = attn_tensor_alloc(ctx, &t, dt, h.rank, h.shape))) {
    char m[ATTN__MSG_LEN];
    snprintf(m, sizeof m, "%s", attn_ctx_error(ctx));
    st = npy_fail(ctx, st, path, "%s", m);
    goto done;
  }
  /* integers land in the tensor's own f64 buffer (at least as large), then widen in place, front to back;
   * a Fortran-order array lands in a buffer of its own first, then is reordered into the tensor */
  if (h.fortran && h.rank > 1 && bytes > 0 && !(fortran_buf = malloc((size_t)bytes))) {
    st = npy_fail(ctx, ATTN_E_NOMEM, path, "out of memory for a Fortran-order array's %lld bytes", (long long)bytes);
    goto done;
  }
  unsigned char *land = fortran_buf ? fortran_buf : t.data;
  if (part->dim < 0) {
    if ((st = attn__src_read(ctx, src, data_off, land, (size_t)bytes, &got))) goto done;
    if (got < (size_t)bytes) {
      st = npy_fail(ctx, ATTN_E_FORMAT, path, "truncated data (the file shrank while being read)");
      goto done;
    }
  } else {
    const int64_t run = part->count * inner * file_esize; /* within the file's size, checked above */
    for (int64_t o = 0; o < outer && run > 0; o++) {
      const int64_t from = data_off + ((o * full + part->start) * inner) * file_esize;
      if ((st = attn__src_read(ctx, src, from, land + o * run, (size_t)run, &got))) goto done;
      if (got < (size_t)run) {
        st = npy_fail(ctx, ATTN_E_FORMAT, path, "truncated data (the file shrank while being read)");
        goto done;
      }
    }
  }
  if (fortran_buf) fortran_to_c(t.data, fortran_buf, (size_t)file_esize, h.rank, h.shape);
  if (swap) attn__swap_elems(t.data, (size_t)file_esize, (size_t)numel);
  if (int_size && (st = widen_integers(ctx, path, t.data, int_size, numel))) goto done;
  *out = t;
  t.data = NULL;

done:
  attn_tensor_free(&t);
  free(fortran_buf);
  free(text);
  return st;
}

static attn_status npy_read_path(attn_ctx *ctx, attn_tensor *out, const char *path, const npy_part *part) {
  memset(out, 0, sizeof *out);
  attn__src src;
  attn_status st = attn__src_open(ctx, &src, "npy", path);
  if (st) return st;
  st = npy_read(ctx, out, &src, part);
  attn__src_close(&src);
  return st;
}

attn_status attn_npy_read(attn_ctx *ctx, attn_tensor *out, const char *path) {
  ATTN__ENTER(ctx);
  if (!out || !path) return attn__fail(ctx, ATTN_E_INVALID, "attn_npy_read: null argument");
  const npy_part whole = {-1, 0, 0, 0};
  return npy_read_path(ctx, out, path, &whole);
}

attn_status attn_npy_read_slice(attn_ctx *ctx, attn_tensor *out, const char *path, int dim, int64_t start,
                                int64_t count) {
  ATTN__ENTER(ctx);
  if (!out || !path) return attn__fail(ctx, ATTN_E_INVALID, "attn_npy_read_slice: null argument");
  if (dim < 0) return attn__fail(ctx, ATTN_E_INVALID, "attn_npy_read_slice: dim %d is negative", dim);
  const npy_part slice = {dim, start, count, 0};
  return npy_read_path(ctx, out, path, &slice);
}

attn_status attn_npy_info(attn_ctx *ctx, attn_tensor *out, const char *path) {
  ATTN__ENTER(ctx);
  if (!out || !path) return attn__fail(ctx, ATTN_E_INVALID, "attn_npy_info: null argument");
  const npy_part header = {-1, 0, 0, 1};
  return npy_read_path(ctx, out, path, &header);
}

attn_status attn__npy_read_mem(attn_ctx *ctx, attn_tensor *out, const void *data, size_t size, const char *name) {
  ATTN__ENTER(ctx);
  if (!out || (!data && size) || !name) return attn__fail(ctx, ATTN_E_INVALID, "attn__npy_read_mem: null argument");
  memset(out, 0, sizeof *out);
  attn__src src;
  attn__src_mem(&src, "npy", name, data, size);
  const npy_part whole = {-1, 0, 0, 0};
  return npy_read(ctx, out, &src, &whole);
}

attn_status attn_npy_write(attn_ctx *ctx, const char *path, const attn_tensor *t) {
  ATTN__ENTER(ctx);
  if (!path || !t) return attn__fail(ctx, ATTN_E_INVALID, "attn_npy_write: null argument");
  attn_status st = attn__check_tensor(ctx, t, "attn_npy_write: tensor", -1);
  if (st) return st;
  const char *descr;
  switch (t->dtype) {
    case ATTN_F32: descr = "<f4"; break;
    case ATTN_F64: descr = "<f8"; break;
    case ATTN_F16: descr = "<f2"; break;
    case ATTN_BOOL: descr = "|b1"; break;
    case ATTN_U8: descr = "|u1"; break;
    case ATTN_BF16:
    default:
      return npy_fail(ctx, ATTN_E_DTYPE, path, "dtype %s has no .npy equivalent; convert it to f32 first",
                      attn_dtype_name(t->dtype));
  }
  /* The dict as numpy writes it, e.g. {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), } */
  char dict[512];
  int n = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': (", descr);
  for (int i = 0; i < t->rank; i++)
    n += snprintf(dict + n, sizeof dict - (size_t)n, i ? ", %lld" : "%lld", (long long)t->shape[i]);
  n += snprintf(dict + n, sizeof dict - (size_t)n, "%s), }", t->rank == 1 ? "," : "");

  /* Pad with spaces and end with '\n' so the data starts on a 64-byte boundary. */
  size_t prefix = 10, total = ((prefix + (size_t)n + 1) + 63) / 64 * 64;
  if (total - prefix > 65535) {
    prefix = 12;
    total = ((prefix + (size_t)n + 1) + 63) / 64 * 64;
  }
  const size_t hlen = total - prefix;
  unsigned char hdr[640];
  memcpy(hdr, npy_magic, 6);
  hdr[6] = prefix == 10 ? 1 : 2;
  hdr[7] = 0;
  hdr[8] = (unsigned char)(hlen & 0xff);
  hdr[9] = (unsigned char)((hlen >> 8) & 0xff);
  if (prefix == 12) {
    hdr[10] = (unsigned char)((hlen >> 16) & 0xff);
    hdr[11] = (unsigned char)((hlen >> 24) & 0xff);
  }
  memcpy(hdr + prefix, dict, (size_t)n);
  memset(hdr + prefix + n, ' ', total - prefix - (size_t)n - 1);
  hdr[total - 1] = '\n';

  attn__out w;
  if ((st = attn__out_open(ctx, &w, "npy", path))) return st;
  if ((st = attn__out_write(ctx, &w, hdr, total))) return st;
  if ((st = attn__out_tensor(ctx, &w, t))) return st;
  return attn__out_commit(ctx, &w);
}
