/* The strict JSON reader of json.h. */
#include "internal.h"
#include "file.h"
#include "json.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* Length of the valid UTF-8 sequence at p (no overlongs, no surrogates), or 0. */
size_t attn__utf8_len(const unsigned char *p, size_t avail) {
  unsigned c = p[0];
  if (c < 0x80) return 1;
  size_t n;
  uint32_t cp, min;
  if ((c & 0xe0) == 0xc0) {
    n = 2;
    cp = c & 0x1f;
    min = 0x80;
  } else if ((c & 0xf0) == 0xe0) {
    n = 3;
    cp = c & 0x0f;
    min = 0x800;
  } else if ((c & 0xf8) == 0xf0) {
    n = 4;
    cp = c & 0x07;
    min = 0x10000;
  } else {
    return 0;
  }
  if (avail < n) return 0;
  for (size_t i = 1; i < n; i++) {
    if ((p[i] & 0xc0) != 0x80) return 0;
    cp = cp << 6 | (p[i] & 0x3f);
  }
  if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return n;
}


#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
attn_status attn__json_fail(attn__json *j, const char *fmt, ...) {
  char msg[ATTN__MSG_LEN];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return attn__io_fail(j->ctx, ATTN_E_FORMAT, j->kind, j->path, "bad %s at byte %lld: %s", j->what,
                       (long long)(j->p - j->start), msg);
}

static void json_ws(attn__json *j) {
  while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

int attn__json_peek(attn__json *j) {
  json_ws(j);
  return j->p < j->end ? *j->p : -1;
}

attn_status attn__json_expect(attn__json *j, int ch) {
  if (attn__json_peek(j) != ch)
    return j->p < j->end ? attn__json_fail(j, "expected '%c'", ch) : attn__json_fail(j, "unexpected end, expected '%c'", ch);
  j->p++;
  return ATTN_OK;
}

static int hex4(const unsigned char *p, uint32_t *v) {
  uint32_t x = 0;
  for (int i = 0; i < 4; i++) {
    unsigned c = p[i];
    x <<= 4;
    if (c >= '0' && c <= '9') x |= c - '0';
    else if (c >= 'a' && c <= 'f') x |= c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') x |= c - 'A' + 10;
    else return 0;
  }
  *v = x;
  return 1;
}

/* A string, decoded to UTF-8 into a fresh *out (NUL-terminated, *len bytes
 * which may include NULs from \u0000); out NULL only validates. */
attn_status attn__json_string(attn__json *j, char **out, size_t *len) {
  if (attn__json_peek(j) != '"') return attn__json_fail(j, j->p < j->end ? "expected a string" : "unexpected end, expected a string");
  const unsigned char *s = ++j->p, *q = s;
  while (q < j->end && *q != '"') {
    if (*q == '\\') q++;
    else if (*q < 0x20) {
      j->p = q;
      return attn__json_fail(j, "control character in a string");
    }
    if (q < j->end) q++;
  }
  if (q >= j->end) return attn__json_fail(j, "unterminated string");
  char *o = NULL;
  if (out) {
    o = malloc((size_t)(q - s) + 1); /* decoding never lengthens */
    if (!o) return attn__io_fail(j->ctx, ATTN_E_NOMEM, j->kind, j->path, "out of memory");
  }
  size_t k = 0;
  const unsigned char *r = s;
  while (r < q) {
    if (*r == '\\') {
      const unsigned char *esc = r++;
      char c1 = 0;
      switch (*r) {
        case '"': c1 = '"'; break;
        case '\\': c1 = '\\'; break;
        case '/': c1 = '/'; break;
        case 'b': c1 = '\b'; break;
        case 'f': c1 = '\f'; break;
        case 'n': c1 = '\n'; break;
        case 'r': c1 = '\r'; break;
        case 't': c1 = '\t'; break;
        case 'u': break;
        default: j->p = esc; free(o); return attn__json_fail(j, "invalid escape in a string");
      }
      if (*r != 'u') {
        if (o) o[k] = c1;
        k++;
        r++;
        continue;
      }
      uint32_t cp, lo;
      if (q - r < 5 || !hex4(r + 1, &cp)) {
        j->p = esc;
        free(o);
        return attn__json_fail(j, "invalid \\u escape");
      }
      r += 5;
      if (cp >= 0xd800 && cp <= 0xdbff) {
        if (q - r < 6 || r[0] != '\\' || r[1] != 'u' || !hex4(r + 2, &lo) || lo < 0xdc00 || lo > 0xdfff) {
          j->p = esc;
          free(o);
          return attn__json_fail(j, "unpaired surrogate in a \\u escape");
        }
        r += 6;
        cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
      } else if (cp >= 0xdc00 && cp <= 0xdfff) {
        j->p = esc;
        free(o);
        return attn__json_fail(j, "unpaired surrogate in a \\u escape");
      }
      unsigned char u[4];
      size_t n = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
      static const unsigned char lead[5] = {0, 0x00, 0xc0, 0xe0, 0xf0};
      for (size_t i = n - 1; i > 0; i--, cp >>= 6) u[i] = (unsigned char)(0x80 | (cp & 0x3f));
      u[0] = (unsigned char)(lead[n] | cp);
      if (o) memcpy(o + k, u, n);
      k += n;
    } else {
      size_t n = attn__utf8_len(r, (size_t)(q - r));
      if (!n) {
        j->p = r;
        free(o);
        return attn__json_fail(j, "invalid UTF-8 in a string");
      }
      if (o) memcpy(o + k, r, n);
      k += n;
      r += n;
    }
  }
  j->p = q + 1;
  if (o) {
    o[k] = '\0';
    *out = o;
  }
  if (len) *len = k;
  return ATTN_OK;
}

/* A non-negative integer that fits int64 (sizes and offsets). */
attn_status attn__json_uint(attn__json *j, int64_t *v) {
  int c = attn__json_peek(j);
  if (c == '-') return attn__json_fail(j, "negative number where a size or offset belongs");
  if (c < '0' || c > '9') return attn__json_fail(j, "expected a non-negative integer");
  if (c == '0' && j->p + 1 < j->end && j->p[1] >= '0' && j->p[1] <= '9') return attn__json_fail(j, "number with a leading zero");
  int64_t x = 0;
  while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
    int d = *j->p - '0';
    if (x > (INT64_MAX - d) / 10) return attn__json_fail(j, "integer too large");
    x = x * 10 + d;
    j->p++;
  }
  if (j->p < j->end && (*j->p == '.' || *j->p == 'e' || *j->p == 'E'))
    return attn__json_fail(j, "expected an integer, not a fraction");
  *v = x;
  return ATTN_OK;
}

attn_status attn__json_number(attn__json *j) {
  const unsigned char *p = j->p, *e = j->end;
  if (p < e && *p == '-') p++;
  if (p >= e || *p < '0' || *p > '9') return attn__json_fail(j, "malformed number");
  if (*p == '0') p++;
  else
    while (p < e && *p >= '0' && *p <= '9') p++;
  if (p < e && *p == '.') {
    if (++p >= e || *p < '0' || *p > '9') return attn__json_fail(j, "malformed number");
    while (p < e && *p >= '0' && *p <= '9') p++;
  }
  if (p < e && (*p == 'e' || *p == 'E')) {
    p++;
    if (p < e && (*p == '+' || *p == '-')) p++;
    if (p >= e || *p < '0' || *p > '9') return attn__json_fail(j, "malformed number");
    while (p < e && *p >= '0' && *p <= '9') p++;
  }
  j->p = p;
  return ATTN_OK;
}

int attn__json_literal(attn__json *j, const char *w) {
  size_t n = strlen(w);
  if ((size_t)(j->end - j->p) < n || memcmp(j->p, w, n) != 0) return 0;
  j->p += n;
  return 1;
}

/* Validates and skips any value; recursion is bounded by ATTN__JSON_MAX_DEPTH. */
attn_status attn__json_skip(attn__json *j, int depth) {
  attn_status st;
  if (depth > ATTN__JSON_MAX_DEPTH) return attn__json_fail(j, "nesting deeper than %d", ATTN__JSON_MAX_DEPTH);
  int c = attn__json_peek(j);
  if (c == '{' || c == '[') {
    const int close = c == '{' ? '}' : ']';
    j->p++;
    if (attn__json_peek(j) == close) {
      j->p++;
      return ATTN_OK;
    }
    for (;;) {
      if (c == '{') {
        if ((st = attn__json_string(j, NULL, NULL)) || (st = attn__json_expect(j, ':'))) return st;
      }
      if ((st = attn__json_skip(j, depth + 1))) return st;
      int d = attn__json_peek(j);
      if (d == ',') {
        j->p++;
        continue;
      }
      if (d == close) {
        j->p++;
        return ATTN_OK;
      }
      return attn__json_fail(j, "expected ',' or '%c'", close);
    }
  }
  if (c == '"') return attn__json_string(j, NULL, NULL);
  if (c == '-' || (c >= '0' && c <= '9')) return attn__json_number(j);
  if (attn__json_literal(j, "true") || attn__json_literal(j, "false") || attn__json_literal(j, "null")) return ATTN_OK;
  return attn__json_fail(j, c < 0 ? "unexpected end, expected a value" : "expected a JSON value");
}


attn_status attn__json_double(attn__json *j, double *v) {
  attn__json_peek(j);
  const unsigned char *from = j->p;
  attn_status st = attn__json_number(j);
  if (st) return st;
  char buf[64];
  const size_t n = (size_t)(j->p - from);
  if (n >= sizeof buf) return attn__json_fail(j, "number too long");
  memcpy(buf, from, n);
  buf[n] = '\0';
  const double x = strtod(buf, NULL);
  if (!isfinite(x)) return attn__json_fail(j, "number out of range");
  *v = x;
  return ATTN_OK;
}

attn_status attn__json_each_key(attn__json *j, attn_status (*visit)(attn__json *, const char *, void *), void *arg,
                                int depth) {
  attn_status st;
  if (depth > ATTN__JSON_MAX_DEPTH) return attn__json_fail(j, "nesting deeper than %d", ATTN__JSON_MAX_DEPTH);
  if ((st = attn__json_expect(j, '{'))) return st;
  if (attn__json_peek(j) == '}') {
    j->p++;
    return ATTN_OK;
  }
  for (;;) {
    char *key = NULL;
    if ((st = attn__json_string(j, &key, NULL)) || (st = attn__json_expect(j, ':')) || (st = visit(j, key, arg))) {
      free(key);
      return st;
    }
    free(key);
    const int c = attn__json_peek(j);
    if (c == ',') {
      j->p++;
      continue;
    }
    if (c == '}') {
      j->p++;
      return ATTN_OK;
    }
    return attn__json_fail(j, "expected ',' or '}'");
  }
}

attn_status attn__json_each_item(attn__json *j, attn_status (*visit)(attn__json *, int64_t, void *), void *arg) {
  attn_status st;
  if ((st = attn__json_expect(j, '['))) return st;
  if (attn__json_peek(j) == ']') {
    j->p++;
    return ATTN_OK;
  }
  for (int64_t i = 0;; i++) {
    if ((st = visit(j, i, arg))) return st;
    const int c = attn__json_peek(j);
    if (c == ']') {
      j->p++;
      return ATTN_OK;
    }
    if (c != ',') return attn__json_fail(j, "expected ',' or ']'");
    j->p++;
  }
}
