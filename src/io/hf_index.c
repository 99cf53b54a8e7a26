/* A sharded checkpoint's model.safetensors.index.json: {"metadata": {...},
 * "weight_map": {"tensor name": "shard file", ...}}, read with the strict JSON
 * reader from a hostile file: a size cap, an entry cap, and every shard named
 * by a plain file name (no path: a shard stays in the index's folder). */
#include "internal.h"
#include "file.h"
#include "io.h"
#include "json.h"

#include <stdlib.h>

#define HF_INDEX_CAP ((int64_t)64 << 20)
#define HF_INDEX_MAX_ENTRIES 4000000

void attn__hf_index_free(attn__hf_index *x) {
  for (int64_t i = 0; i < x->n; i++) free(x->name[i]), free(x->file[i]);
  free(x->name);
  free(x->file);
  memset(x, 0, sizeof *x);
}

/* A shard's name must stay in the index's folder: a plain file name. */
static int plain_file_name(const char *f, size_t len) {
  if (len == 0 || len > 255 || strlen(f) != len || !strcmp(f, ".") || !strcmp(f, "..")) return 0;
  return !strchr(f, '/') && !strchr(f, '\\');
}

static attn_status weight_map_key(attn__json *j, const char *k, void *arg) {
  attn__hf_index *x = arg;
  char *file = NULL;
  size_t len = 0;
  attn_status st = attn__json_string(j, &file, &len);
  if (st) return st;
  if (!plain_file_name(file, len)) {
    char shown[64];
    attn__sanitize(shown, sizeof shown, file, len);
    free(file);
    return attn__json_fail(j, "weight_map names '%s': not a file name in the index's folder", shown);
  }
  if (x->n == x->cap) {
    if (x->n >= HF_INDEX_MAX_ENTRIES) {
      free(file);
      return attn__json_fail(j, "weight_map has more than %d entries", HF_INDEX_MAX_ENTRIES);
    }
    const int64_t cap = x->cap ? 2 * x->cap : 256;
    char **names = realloc(x->name, (size_t)cap * sizeof *names);
    if (names) x->name = names;
    char **files = names ? realloc(x->file, (size_t)cap * sizeof *files) : NULL;
    if (!files) {
      free(file);
      return attn__fail(j->ctx, ATTN_E_NOMEM, "index: out of memory");
    }
    x->file = files, x->cap = cap;
  }
  char *name = malloc(strlen(k) + 1);
  if (!name) {
    free(file);
    return attn__fail(j->ctx, ATTN_E_NOMEM, "index: out of memory");
  }
  strcpy(name, k);
  x->name[x->n] = name, x->file[x->n] = file;
  x->n++;
  return ATTN_OK;
}

static attn_status index_key(attn__json *j, const char *k, void *arg) {
  if (!strcmp(k, "weight_map")) return attn__json_each_key(j, weight_map_key, arg, 2);
  return attn__json_skip(j, 1);
}

attn_status attn__hf_index_parse(attn_ctx *ctx, attn__hf_index *x, const void *data, size_t len, const char *path) {
  memset(x, 0, sizeof *x);
  if ((int64_t)len > HF_INDEX_CAP)
    return attn__io_fail(ctx, ATTN_E_FORMAT, "index", path, "%zu bytes: more than an index's %lld", len,
                         (long long)HF_INDEX_CAP);
  const unsigned char *b = data;
  attn__json j = {b, b, b + len, ctx, path, "index", "JSON"};
  attn_status st = attn__json_peek(&j) == '{' ? attn__json_each_key(&j, index_key, x, 0)
                                              : attn__json_fail(&j, "the index is not a JSON object");
  if (!st && attn__json_peek(&j) != -1) st = attn__json_fail(&j, "characters after the index object");
  if (!st && x->n == 0) st = attn__io_fail(ctx, ATTN_E_FORMAT, "index", path, "no weight_map entries");
  if (st) attn__hf_index_free(x);
  return st;
}

attn_status attn__hf_index_read(attn_ctx *ctx, attn__hf_index *x, const char *path) {
  memset(x, 0, sizeof *x);
  unsigned char *buf;
  size_t len;
  attn_status st = attn__read_small_file(ctx, "index", path, HF_INDEX_CAP, &buf, &len);
  if (st) return st;
  st = attn__hf_index_parse(ctx, x, buf, len, path);
  free(buf);
  return st;
}
