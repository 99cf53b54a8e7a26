/* safetensors: an 8-byte little-endian header length N, N bytes of JSON
 *   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
 *    "__metadata__": {...}}
 * then the data buffer, which the offsets index. Opening reads and checks the
 * header only; a tensor's bytes are read (pread) into a 64-byte aligned buffer
 * of its own when it is first asked for, so loading one layer from a large
 * checkpoint costs that layer's bytes, not the file's. Reading rather than
 * mapping the file: a mapped file that another process truncates faults
 * (SIGBUS) on access, where a short read is an error we can report.
 *
 * Hostile files: the header is parsed by a strict JSON parser of our own with
 * a length cap and a nesting cap; every offset is checked against the buffer,
 * every byte size against shape x dtype (overflow-checked); duplicate names and
 * overlapping tensors are refused. Holes between tensors are tolerated.
 *
 * Dtypes with no attn_dtype (I32, F8_E4M3, ...) do not make the file
 * unreadable: such tensors are listed and, where their element size is known,
 * size-checked; attn_safetensors_get refuses them with ATTN_E_DTYPE. */
#include "internal.h"
#include "file.h"
#include "io.h"
#include "json.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define ST_HEADER_CAP ((uint64_t)100 << 20)

typedef struct {
  char *name;
  char dtype_name[24]; /* as in the file, printable, for messages */
  int known;           /* dtype maps to an attn_dtype */
  attn_dtype dtype;
  int64_t esize;       /* 0: an element size we do not know */
  int rank;            /* may exceed ATTN_MAX_RANK: get refuses those */
  int64_t shape[ATTN_MAX_RANK];
  int64_t numel, begin, end;
  int64_t span;        /* product of the dimensions, each 0 counted as 1 (what strides span) */
  void *own;           /* its bytes once attn_safetensors_get has read them, until close */
} st_entry;

struct attn_safetensors {
  attn__src src;       /* the open file, or mem below */
  unsigned char *mem;  /* an in-memory file's own copy of its bytes */
  int64_t data_start;  /* 8 + the header's length: where offset 0 of the data lies */
  char *path;
  st_entry *e;
  st_entry **byname;
  int64_t count, cap;
  attn_safetensors *next; /* the other shards of a checkpoint (attn__safetensors_chain), looked in after this one */
};

/* What an empty tensor's view points at: never read, but not NULL and aligned. */
static const union {
  unsigned char b[64];
  double align;
} st_empty;

static const struct {
  const char *name;
  int64_t size;
  int known;
  attn_dtype dtype;
} st_dtypes[] = {
    {"F32", 4, 1, ATTN_F32},     {"F64", 8, 1, ATTN_F64},     {"F16", 2, 1, ATTN_F16},
    {"BF16", 2, 1, ATTN_BF16},   {"BOOL", 1, 1, ATTN_BOOL},   {"U8", 1, 1, ATTN_U8},
    {"I8", 1, 0, ATTN_U8},       {"I16", 2, 0, ATTN_U8},      {"U16", 2, 0, ATTN_U8},
    {"I32", 4, 0, ATTN_U8},      {"U32", 4, 0, ATTN_U8},      {"I64", 8, 0, ATTN_U8},
    {"U64", 8, 0, ATTN_U8},      {"F8_E4M3", 1, 0, ATTN_U8},  {"F8_E5M2", 1, 0, ATTN_U8},
    {"F8_E8M0", 1, 0, ATTN_U8},  {"C64", 8, 0, ATTN_U8},
};

#define st_fail(ctx, status, path, ...) attn__io_fail(ctx, status, "safetensors", path, __VA_ARGS__)

static int key_is(const char *k, size_t n, const char *w) { return n == strlen(w) && !memcmp(k, w, n); }

/* One tensor's {"dtype": ..., "shape": [...], "data_offsets": [b, e]}; unknown keys are skipped. */
static attn_status parse_info(attn__json *j, st_entry *e, const char *shown) {
  attn_status st;
  int have_dtype = 0, have_shape = 0, have_off = 0;
  if (attn__json_peek(j) != '{') return attn__json_fail(j, "tensor '%s': expected an object", shown);
  j->p++;
  if (attn__json_peek(j) == '}') j->p++;
  else
    for (;;) {
      char *key;
      size_t klen;
      if ((st = attn__json_string(j, &key, &klen))) return st;
      int which = key_is(key, klen, "dtype")          ? 1
                  : key_is(key, klen, "shape")        ? 2
                  : key_is(key, klen, "data_offsets") ? 3
                                                       : 0;
      free(key);
      if ((st = attn__json_expect(j, ':'))) return st;
      if ((which == 1 && have_dtype++) || (which == 2 && have_shape++) || (which == 3 && have_off++))
        return attn__json_fail(j, "tensor '%s': repeated key", shown);
      if (which == 1) {
        char *dt;
        size_t dlen;
        if (attn__json_peek(j) != '"') return attn__json_fail(j, "tensor '%s': \"dtype\" is not a string", shown);
        if ((st = attn__json_string(j, &dt, &dlen))) return st;
        attn__sanitize(e->dtype_name, sizeof e->dtype_name, dt, dlen);
        e->known = 0;
        e->esize = 0;
        for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
          if (key_is(dt, dlen, st_dtypes[i].name)) {
            e->known = st_dtypes[i].known;
            e->dtype = st_dtypes[i].dtype;
            e->esize = st_dtypes[i].size;
          }
        free(dt);
      } else if (which == 2) {
        if (attn__json_peek(j) != '[') return attn__json_fail(j, "tensor '%s': \"shape\" is not an array", shown);
        j->p++;
        e->rank = 0;
        e->numel = 1;
        e->span = 1;
        if (attn__json_peek(j) == ']') j->p++;
        else
          for (;;) {
            int64_t d;
            if ((st = attn__json_uint(j, &d))) return st;
            if (e->rank < ATTN_MAX_RANK) e->shape[e->rank] = d;
            if (e->rank == INT32_MAX) return attn__json_fail(j, "tensor '%s': absurd rank", shown);
            e->rank++;
            if (attn__mul_overflows(e->numel, d, &e->numel) || attn__mul_overflows(e->span, d ? d : 1, &e->span))
              return attn__json_fail(j, "tensor '%s': shape is too large (element count overflows)", shown);
            int c = attn__json_peek(j);
            if (c == ',') {
              j->p++;
              continue;
            }
            if (c == ']') {
              j->p++;
              break;
            }
            return attn__json_fail(j, "tensor '%s': expected ',' or ']' in \"shape\"", shown);
          }
      } else if (which == 3) {
        if ((st = attn__json_expect(j, '['))) return st;
        if ((st = attn__json_uint(j, &e->begin)) || (st = attn__json_expect(j, ',')) || (st = attn__json_uint(j, &e->end))) return st;
        if (attn__json_peek(j) != ']') return attn__json_fail(j, "tensor '%s': \"data_offsets\" must hold exactly two integers", shown);
        j->p++;
      } else if ((st = attn__json_skip(j, 2))) {
        return st;
      }
      int c = attn__json_peek(j);
      if (c == ',') {
        j->p++;
        continue;
      }
      if (c == '}') {
        j->p++;
        break;
      }
      return attn__json_fail(j, "tensor '%s': expected ',' or '}'", shown);
    }
  if (!have_dtype || !have_shape || !have_off)
    return attn__json_fail(j, "tensor '%s' lacks \"%s\"", shown, !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets");
  return ATTN_OK;
}

static attn_status st_push(attn_ctx *ctx, attn_safetensors *s, const st_entry *e) {
  if (s->count == s->cap) {
    int64_t cap = s->cap ? s->cap * 2 : 16;
    st_entry *ne = realloc(s->e, (size_t)cap * sizeof *ne);
    if (!ne) return st_fail(ctx, ATTN_E_NOMEM, s->path, "out of memory");
    s->e = ne;
    s->cap = cap;
  }
  s->e[s->count++] = *e;
  return ATTN_OK;
}

static attn_status parse_header(attn__json *j, attn_safetensors *s) {
  attn_status st;
  int have_meta = 0;
  if (attn__json_peek(j) != '{') return attn__json_fail(j, "the header is not a JSON object");
  j->p++;
  if (attn__json_peek(j) == '}') j->p++;
  else
    for (;;) {
      st_entry e;
      memset(&e, 0, sizeof e);
      size_t nlen;
      if ((st = attn__json_string(j, &e.name, &nlen))) return st;
      char shown[72];
      attn__sanitize(shown, sizeof shown, e.name, nlen);
      if ((st = attn__json_expect(j, ':'))) {
        free(e.name);
        return st;
      }
      if (key_is(e.name, nlen, "__metadata__")) {
        free(e.name);
        if (have_meta++) return attn__json_fail(j, "repeated \"__metadata__\"");
        if (attn__json_peek(j) != '{') return attn__json_fail(j, "\"__metadata__\" is not an object");
        if ((st = attn__json_skip(j, 1))) return st;
      } else {
        if (strlen(e.name) != nlen) {
          free(e.name);
          return attn__json_fail(j, "a tensor name contains a NUL character");
        }
        if ((st = parse_info(j, &e, shown)) || (st = st_push(j->ctx, s, &e))) {
          free(e.name);
          return st;
        }
      }
      int c = attn__json_peek(j);
      if (c == ',') {
        j->p++;
        continue;
      }
      if (c == '}') {
        j->p++;
        break;
      }
      return attn__json_fail(j, "expected ',' or '}' after a tensor");
    }
  attn__json_peek(j); /* past trailing white space */
  if (j->p != j->end) return attn__json_fail(j, "characters after the header object");
  return ATTN_OK;
}

static int cmp_name(const void *a, const void *b) {
  return strcmp((*(st_entry *const *)a)->name, (*(st_entry *const *)b)->name);
}

static int cmp_begin(const void *a, const void *b) {
  const st_entry *x = *(st_entry *const *)a, *y = *(st_entry *const *)b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return x->end < y->end ? -1 : x->end > y->end;
}

/* Offsets inside the buffer, sizes exact, names unique, no two tensors sharing bytes. */
static attn_status validate(attn_ctx *ctx, attn_safetensors *s, int64_t bufsize) {
  char a[72], b[72];
  for (int64_t i = 0; i < s->count; i++) {
    st_entry *e = &s->e[i];
    attn__sanitize(a, sizeof a, e->name, strlen(e->name));
    if (e->begin > e->end)
      return st_fail(ctx, ATTN_E_FORMAT, s->path, "tensor '%s': data_offsets [%lld, %lld] are reversed", a,
                     (long long)e->begin, (long long)e->end);
    if (e->end > bufsize)
      return st_fail(ctx, ATTN_E_FORMAT, s->path,
                     "tensor '%s': data_offsets end %lld lies beyond the %lld-byte data buffer (truncated?)", a,
                     (long long)e->end, (long long)bufsize);
    int64_t bytes;
    if (attn__mul_overflows(e->span, e->esize ? e->esize : 1, &bytes))
      return st_fail(ctx, ATTN_E_FORMAT, s->path, "tensor '%s': shape is too large (its strides would pass 2^63 bytes)",
                     a);
    if (e->esize) {
      if (attn__mul_overflows(e->numel, e->esize, &bytes))
        return st_fail(ctx, ATTN_E_FORMAT, s->path, "tensor '%s': shape is too large", a);
      if (bytes != e->end - e->begin)
        return st_fail(ctx, ATTN_E_FORMAT, s->path,
                       "tensor '%s': data_offsets span %lld bytes, but its shape and dtype %s need %lld", a,
                       (long long)(e->end - e->begin), e->dtype_name, (long long)bytes);
    }
  }
  if (s->count == 0) return ATTN_OK;
  s->byname = malloc((size_t)s->count * sizeof *s->byname);
  st_entry **order = malloc((size_t)s->count * sizeof *order);
  if (!s->byname || !order) {
    free(order);
    return st_fail(ctx, ATTN_E_NOMEM, s->path, "out of memory");
  }
  for (int64_t i = 0; i < s->count; i++) s->byname[i] = order[i] = &s->e[i];
  qsort(s->byname, (size_t)s->count, sizeof *s->byname, cmp_name);
  for (int64_t i = 1; i < s->count; i++)
    if (!strcmp(s->byname[i - 1]->name, s->byname[i]->name)) {
      free(order);
      attn__sanitize(a, sizeof a, s->byname[i]->name, strlen(s->byname[i]->name));
      return st_fail(ctx, ATTN_E_FORMAT, s->path, "duplicate tensor name '%s'", a);
    }
  qsort(order, (size_t)s->count, sizeof *order, cmp_begin);
  const st_entry *prev = NULL;
  for (int64_t i = 0; i < s->count; i++) {
    const st_entry *e = order[i];
    if (e->begin == e->end) continue; /* empty tensors own no bytes */
    if (prev && e->begin < prev->end) {
      attn__sanitize(a, sizeof a, prev->name, strlen(prev->name));
      attn__sanitize(b, sizeof b, e->name, strlen(e->name));
      free(order);
      return st_fail(ctx, ATTN_E_FORMAT, s->path, "tensors '%s' and '%s' overlap in the data buffer", a, b);
    }
    prev = e;
  }
  free(order);
  return ATTN_OK;
}

void attn_safetensors_close(attn_safetensors *st) {
  if (!st) return;
  attn_safetensors_close(st->next);
  for (int64_t i = 0; i < st->count; i++) {
    free(st->e[i].name);
    attn__aligned_free(st->e[i].own);
  }
  free(st->e);
  free(st->byname);
  attn__src_close(&st->src);
  free(st->mem);
  free(st->path);
  free(st);
}

/* Reads and checks the header; s->src and s->path are set. */
static attn_status st_open(attn_ctx *ctx, attn_safetensors *s) {
  const char *path = s->path;
  const int64_t size = s->src.size;
  unsigned char pre[8];
  size_t got;
  attn_status st = attn__src_read(ctx, &s->src, 0, pre, 8, &got);
  if (st) return st;
  if (got < 8) return st_fail(ctx, ATTN_E_FORMAT, path, "truncated: %zu bytes, too short for the header length", got);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = n << 8 | pre[i];
  if (n == 0) return st_fail(ctx, ATTN_E_FORMAT, path, "header length is 0");
  if (n > ST_HEADER_CAP)
    return st_fail(ctx, ATTN_E_FORMAT, path, "header length %llu exceeds the %llu-byte limit", (unsigned long long)n,
                   (unsigned long long)ST_HEADER_CAP);
  if ((int64_t)n > size - 8)
    return st_fail(ctx, ATTN_E_FORMAT, path, "truncated: header length %llu, but only %lld bytes follow",
                   (unsigned long long)n, (long long)(size - 8));
  unsigned char *hdr = malloc((size_t)n);
  if (!hdr) return st_fail(ctx, ATTN_E_NOMEM, path, "cannot allocate the %llu-byte header", (unsigned long long)n);
  if (!(st = attn__src_read(ctx, &s->src, 8, hdr, (size_t)n, &got)) && got < n)
    st = st_fail(ctx, ATTN_E_FORMAT, path, "truncated header (the file shrank while being read)");
  attn__json j = {hdr, hdr, hdr + n, ctx, path, "safetensors", "header JSON"};
  s->data_start = 8 + (int64_t)n;
  if (!st && !(st = parse_header(&j, s))) st = validate(ctx, s, size - s->data_start);
  free(hdr);
  return st;
}

attn_status attn_safetensors_open(attn_ctx *ctx, attn_safetensors **out, const char *path) {
  ATTN__ENTER(ctx);
  if (!out || !path) return attn__fail(ctx, ATTN_E_INVALID, "attn_safetensors_open: null argument");
  *out = NULL;
  attn_safetensors *s = calloc(1, sizeof *s);
  if (s) s->path = malloc(strlen(path) + 1);
  if (!s || !s->path) {
    free(s);
    return st_fail(ctx, ATTN_E_NOMEM, path, "out of memory");
  }
  memcpy(s->path, path, strlen(path) + 1);
  s->src.fd = -1;
  attn_status st = attn__src_open(ctx, &s->src, "safetensors", s->path);
  if (!st) st = st_open(ctx, s);
  if (st) {
    attn_safetensors_close(s);
    return st;
  }
  *out = s;
  return ATTN_OK;
}

attn_status attn__safetensors_open_mem(attn_ctx *ctx, attn_safetensors **out, const void *data, size_t size,
                                       const char *name) {
  ATTN__ENTER(ctx);
  if (!out || (!data && size) || !name)
    return attn__fail(ctx, ATTN_E_INVALID, "attn__safetensors_open_mem: null argument");
  *out = NULL;
  attn_safetensors *s = calloc(1, sizeof *s);
  if (s) {
    s->path = malloc(strlen(name) + 1);
    s->mem = malloc(size ? size : 1);
  }
  if (!s || !s->path || !s->mem) {
    if (s) {
      free(s->path);
      free(s->mem);
      free(s);
    }
    return st_fail(ctx, ATTN_E_NOMEM, name, "out of memory");
  }
  memcpy(s->path, name, strlen(name) + 1);
  if (size) memcpy(s->mem, data, size);
  attn__src_mem(&s->src, "safetensors", s->path, s->mem, size);
  attn_status st = st_open(ctx, s);
  if (st) {
    attn_safetensors_close(s);
    return st;
  }
  *out = s;
  return ATTN_OK;
}

const char *attn__safetensors_path(const attn_safetensors *st) { return st ? st->path : ""; }

static const st_entry *st_lookup(const attn_safetensors *st, const char *name) {
  int64_t lo = 0, hi = st->count;
  while (lo < hi) {
    int64_t mid = lo + (hi - lo) / 2;
    int c = strcmp(st->byname[mid]->name, name);
    if (c == 0) return st->byname[mid];
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  return NULL;
}

void attn__safetensors_chain(attn_safetensors *st, attn_safetensors *next) {
  while (st->next) st = st->next;
  st->next = next;
}

/* The shard of the chain that holds name (st itself when none does). */
static const attn_safetensors *st_holder(const attn_safetensors *st, const char *name) {
  for (const attn_safetensors *s = st; s; s = s->next)
    if (st_lookup(s, name)) return s;
  return st;
}

int attn__safetensors_info(const attn_safetensors *st, const char *name, attn__st_info *info) {
  if (st && name) st = st_holder(st, name);
  const st_entry *e = st && name ? st_lookup(st, name) : NULL;
  if (!e) return 0;
  info->known = e->known;
  info->dtype = e->dtype;
  info->dtype_name = e->dtype_name;
  info->rank = e->rank;
  info->shape = e->shape;
  info->numel = e->numel;
  return 1;
}

/* The entry of name, refusing what get cannot view; *e NULL on failure. */
static attn_status st_entry_for(attn_ctx *ctx, const attn_safetensors *st, const char *name, const st_entry **e) {
  char shown[72];
  attn__sanitize(shown, sizeof shown, name, strlen(name));
  *e = st_lookup(st, name);
  if (!*e) return st_fail(ctx, ATTN_E_NOT_FOUND, st->path, "no tensor named '%s'", shown);
  const st_entry *f = *e;
  *e = NULL;
  if (!f->known)
    return st_fail(ctx, ATTN_E_DTYPE, st->path, "tensor '%s' has dtype %s, which libattn does not support", shown,
                   f->dtype_name);
  if (f->rank > ATTN_MAX_RANK)
    return st_fail(ctx, ATTN_E_UNSUPPORTED, st->path, "tensor '%s' has rank %d, more than ATTN_MAX_RANK (%d)", shown,
                   f->rank, ATTN_MAX_RANK);
  *e = f;
  return ATTN_OK;
}

/* e's bytes into a fresh aligned buffer, in the host's byte order. */
static attn_status st_load(attn_ctx *ctx, const attn_safetensors *st, const st_entry *e, void **out) {
  const int64_t bytes = e->end - e->begin;
  *out = NULL;
  if ((uint64_t)bytes > SIZE_MAX / 2) return st_fail(ctx, ATTN_E_NOMEM, st->path, "tensor too large for this machine");
  void *p = attn__aligned_alloc((size_t)bytes);
  if (!p) return st_fail(ctx, ATTN_E_NOMEM, st->path, "cannot allocate %lld bytes", (long long)bytes);
  size_t got;
  attn_status s = attn__src_read(ctx, &st->src, st->data_start + e->begin, p, (size_t)bytes, &got);
  if (!s && got < (size_t)bytes)
    s = st_fail(ctx, ATTN_E_FORMAT, st->path, "truncated data (the file shrank after it was opened)");
  if (s) {
    attn__aligned_free(p);
    return s;
  }
  if (e->esize > 1 && !attn__host_is_le()) attn__swap_elems(p, (size_t)e->esize, (size_t)e->numel);
  *out = p;
  return ATTN_OK;
}

attn_status attn__safetensors_read(attn_ctx *ctx, const attn_safetensors *st, const char *name, attn_tensor *out,
                                   void **owned) {
  *owned = NULL;
  const st_entry *e;
  st = st_holder(st, name);
  attn_status s = st_entry_for(ctx, st, name, &e);
  if (s) return s;
  void *p = (void *)st_empty.b;
  if (e->numel > 0 && (s = st_load(ctx, st, e, owned))) return s;
  if (*owned) p = *owned;
  *out = attn_tensor_view(p, e->dtype, e->rank, e->shape);
  return ATTN_OK;
}

int64_t attn_safetensors_count(const attn_safetensors *st) { return st ? st->count : 0; }

const char *attn_safetensors_name(const attn_safetensors *st, int64_t index) {
  if (!st || index < 0 || index >= st->count) return NULL;
  return st->e[index].name;
}

attn_status attn_safetensors_get(attn_ctx *ctx, attn_tensor *out, const attn_safetensors *st, const char *name) {
  ATTN__ENTER(ctx);
  if (!st || !name || !out) return attn__fail(ctx, ATTN_E_INVALID, "attn_safetensors_get: null argument");
  const st_entry *e;
  attn_status s = st_entry_for(ctx, st, name, &e);
  if (s) return s;
  void *p = (void *)st_empty.b;
  if (e->numel > 0) {
    if (!e->own) {
      /* the handle is const to the caller, but its cache of read tensors is not */
      st_entry *m = (st_entry *)e;
      if ((s = st_load(ctx, st, e, &m->own))) return s;
    }
    p = e->own;
  }
  *out = attn_tensor_view(p, e->dtype, e->rank, e->shape);
  return ATTN_OK;
}

/* ---- writing ------------------------------------------------------------------ */
typedef struct {
  char *s;
  size_t len, cap;
  int oom;
} st_sb;

static void sb_put(st_sb *b, const char *p, size_t n) {
  if (b->oom) return;
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n + 1) cap *= 2;
    char *ns = realloc(b->s, cap);
    if (!ns) {
      b->oom = 1;
      return;
    }
    b->s = ns;
    b->cap = cap;
  }
  memcpy(b->s + b->len, p, n);
  b->len += n;
  b->s[b->len] = '\0';
}

static void sb_str(st_sb *b, const char *p) { sb_put(b, p, strlen(p)); }

static void sb_int(st_sb *b, int64_t v) {
  char t[24];
  int n = snprintf(t, sizeof t, "%lld", (long long)v);
  sb_put(b, t, (size_t)n);
}

static void sb_json_string(st_sb *b, const char *s) {
  sb_put(b, "\"", 1);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    char t[8];
    switch (*p) {
      case '"': sb_put(b, "\\\"", 2); break;
      case '\\': sb_put(b, "\\\\", 2); break;
      case '\n': sb_put(b, "\\n", 2); break;
      case '\r': sb_put(b, "\\r", 2); break;
      case '\t': sb_put(b, "\\t", 2); break;
      default:
        if (*p < 0x20) {
          snprintf(t, sizeof t, "\\u%04x", *p);
          sb_put(b, t, 6);
        } else {
          sb_put(b, (const char *)p, 1);
        }
    }
  }
  sb_put(b, "\"", 1);
}

static const char *st_dtype_code(attn_dtype dt) {
  switch (dt) {
    case ATTN_F32: return "F32";
    case ATTN_F64: return "F64";
    case ATTN_F16: return "F16";
    case ATTN_BF16: return "BF16";
    case ATTN_BOOL: return "BOOL";
    case ATTN_U8: return "U8";
  }
  return NULL;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

static int utf8_valid(const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  size_t n = strlen(s);
  for (size_t i = 0; i < n;) {
    size_t k = attn__utf8_len(p + i, n - i);
    if (!k) return 0;
    i += k;
  }
  return 1;
}

attn_status attn_safetensors_write(attn_ctx *ctx, const char *path, int64_t count, const char *const *names,
                                   const attn_tensor *tensors) {
  ATTN__ENTER(ctx);
  if (!path) return attn__fail(ctx, ATTN_E_INVALID, "attn_safetensors_write: path is NULL");
  if (count < 0) return st_fail(ctx, ATTN_E_INVALID, path, "negative tensor count %lld", (long long)count);
  if (count > 0 && (!names || !tensors))
    return st_fail(ctx, ATTN_E_INVALID, path, "names or tensors is NULL");
  if ((uint64_t)count > SIZE_MAX / sizeof(char *))
    return st_fail(ctx, ATTN_E_INVALID, path, "absurd tensor count %lld", (long long)count);
  attn_status st;
  char what[64], shown[72];
  for (int64_t i = 0; i < count; i++) {
    if (!names[i] || !names[i][0])
      return st_fail(ctx, ATTN_E_INVALID, path, "names[%lld] is %s", (long long)i, names[i] ? "empty" : "NULL");
    attn__sanitize(shown, sizeof shown, names[i], strlen(names[i]));
    if (!strcmp(names[i], "__metadata__"))
      return st_fail(ctx, ATTN_E_INVALID, path, "\"__metadata__\" is reserved and cannot name a tensor");
    if (!utf8_valid(names[i]))
      return st_fail(ctx, ATTN_E_INVALID, path, "tensor name '%s' is not valid UTF-8", shown);
    snprintf(what, sizeof what, "attn_safetensors_write: tensors[%lld]", (long long)i);
    if ((st = attn__check_tensor(ctx, &tensors[i], what, -1))) return st;
  }
  if (count > 1) {
    const char **sorted = malloc((size_t)count * sizeof *sorted);
    if (!sorted) return st_fail(ctx, ATTN_E_NOMEM, path, "out of memory");
    memcpy(sorted, names, (size_t)count * sizeof *sorted);
    qsort(sorted, (size_t)count, sizeof *sorted, cmp_str);
    for (int64_t i = 1; i < count; i++)
      if (!strcmp(sorted[i - 1], sorted[i])) {
        attn__sanitize(shown, sizeof shown, sorted[i], strlen(sorted[i]));
        free(sorted);
        return st_fail(ctx, ATTN_E_INVALID, path, "duplicate tensor name '%s'", shown);
      }
    free(sorted);
  }

  /* Tensors lie in the given order, back to back, as the offsets say. */
  st_sb b = {NULL, 0, 0, 0};
  int64_t off = 0;
  sb_str(&b, "{");
  for (int64_t i = 0; i < count; i++) {
    const attn_tensor *t = &tensors[i];
    int64_t bytes;
    if (attn__mul_overflows(attn_tensor_numel(t), (int64_t)attn_dtype_size(t->dtype), &bytes) ||
        off > INT64_MAX - bytes) {
      free(b.s);
      return st_fail(ctx, ATTN_E_INVALID, path, "the tensors are too large to write");
    }
    if (i) sb_str(&b, ",");
    sb_json_string(&b, names[i]);
    sb_str(&b, ":{\"dtype\":\"");
    sb_str(&b, st_dtype_code(t->dtype));
    sb_str(&b, "\",\"shape\":[");
    for (int d = 0; d < t->rank; d++) {
      if (d) sb_str(&b, ",");
      sb_int(&b, t->shape[d]);
    }
    sb_str(&b, "],\"data_offsets\":[");
    sb_int(&b, off);
    sb_str(&b, ",");
    sb_int(&b, off + bytes);
    sb_str(&b, "]}");
    off += bytes;
  }
  sb_str(&b, "}");
  while (!b.oom && b.len % 8) sb_str(&b, " "); /* the reference writer keeps data 8-byte aligned */
  if (b.oom) {
    free(b.s);
    return st_fail(ctx, ATTN_E_NOMEM, path, "out of memory");
  }
  unsigned char pre[8];
  for (int i = 0; i < 8; i++) pre[i] = (unsigned char)(((uint64_t)b.len >> (8 * i)) & 0xff);

  attn__out w;
  st = attn__out_open(ctx, &w, "safetensors", path);
  if (!st) st = attn__out_write(ctx, &w, pre, 8);
  if (!st) st = attn__out_write(ctx, &w, b.s, b.len);
  free(b.s);
  for (int64_t i = 0; i < count && !st; i++) st = attn__out_tensor(ctx, &w, &tensors[i]);
  if (!st) st = attn__out_commit(ctx, &w);
  return st;
}
