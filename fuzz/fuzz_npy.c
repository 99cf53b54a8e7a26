/* libFuzzer harness for the .npy reader, fed from memory (attn__npy_read_mem
 * runs the file reader's code). Whatever the bytes: a known status, a message
 * on failure and no tensor; on success a tensor whose every byte can be read,
 * no larger than the input, that the writer saves and the reader gives back
 * unchanged (dtype, shape and bytes), and of which a slice read from the same
 * bytes in a file (a dimension and range picked from the input) holds the
 * same elements. */
#include "io/io.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static attn_ctx *ctx;
static char path[512];

static void need(int cond, const char *what) {
  if (cond) return;
  fprintf(stderr, "fuzz_npy: %s (message: '%s')\n", what, attn_ctx_error(ctx));
  abort();
}

static void cleanup(void) {
  remove(path);
  attn_ctx_destroy(ctx);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  need(attn_ctx_create(&ctx) == ATTN_OK, "cannot create a context");
  /* the round trip goes through a file: memory-backed when the system has it */
  const char *dir = getenv("TMPDIR");
  if (!dir || !dir[0]) dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  snprintf(path, sizeof path, "%s/fuzz_npy_%ld.npy", dir, (long)getpid());
  atexit(cleanup);
  return 0;
}

/* The input's bytes as a file, read by attn_npy_read_slice over one dimension and range
 * chosen from the input: the elements t (the whole read) holds there. */
static void slice_matches(const attn_tensor *t, const uint8_t *data, size_t size) {
  FILE *f = fopen(path, "wb");
  need(f && fwrite(data, 1, size, f) == size && fclose(f) == 0, "cannot write the input to a file");
  uint64_t h = (uint64_t)size * 0x9e3779b97f4a7c15u;
  for (size_t i = size > 8 ? size - 8 : 0; i < size; i++) h = (h ^ data[i]) * 0x100000001b3u;
  const int dim = (int)(h % (uint64_t)t->rank);
  const int64_t full = t->shape[dim];
  const int64_t start = (int64_t)((h >> 16) % (uint64_t)(full + 1));
  const int64_t count = (int64_t)((h >> 40) % (uint64_t)(full - start + 1));
  attn_tensor s;
  need(attn_npy_read_slice(ctx, &s, path, dim, start, count) == ATTN_OK, "a slice of an accepted file refused");
  need(s.dtype == t->dtype && s.rank == t->rank && s.shape[dim] == count, "the slice's dtype or shape");
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < dim; i++) outer *= t->shape[i];
  for (int i = dim + 1; i < t->rank; i++) inner *= t->shape[i];
  const size_t run = (size_t)(count * inner) * attn_dtype_size(t->dtype);
  for (int64_t o = 0; o < outer && run > 0; o++)
    need(!memcmp((const char *)s.data + (size_t)o * run,
                 (const char *)t->data + (size_t)((o * full + start) * inner) * attn_dtype_size(t->dtype), run),
         "the slice differs from the whole read there");
  attn_tensor_free(&s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  attn_tensor t;
  attn_status st = attn__npy_read_mem(ctx, &t, data, size, "fuzz.npy");
  need(st >= ATTN_OK && st <= ATTN_E_UNSUPPORTED, "unknown status");
  if (st) {
    need(attn_ctx_error(ctx)[0] != '\0', "a failure without a message");
    need(t.data == NULL, "a tensor handed back on failure");
    return 0;
  }
  const int64_t n = attn_tensor_numel(&t);
  const size_t es = attn_dtype_size(t.dtype);
  /* int32 arrays come back as f64: 4 bytes of input per 8-byte element */
  const size_t in_es = t.dtype == ATTN_F64 ? 4 : es;
  need(n >= 0 && (uint64_t)n * in_es <= size, "more data than the input holds");
  unsigned acc = 0;
  for (int64_t i = 0; i < n * (int64_t)es; i++) acc += ((const unsigned char *)t.data)[i];
  (void)acc;

  if (t.rank > 0) slice_matches(&t, data, size);

  st = attn_npy_write(ctx, path, &t);
  need(st == ATTN_OK, "a tensor the reader accepted cannot be written");
  attn_tensor u;
  st = attn_npy_read(ctx, &u, path);
  need(st == ATTN_OK, "what the writer wrote cannot be read");
  need(u.dtype == t.dtype && u.rank == t.rank, "the round trip changed the dtype or rank");
  for (int i = 0; i < t.rank; i++) need(u.shape[i] == t.shape[i], "the round trip changed the shape");
  need(n == 0 || !memcmp(u.data, t.data, (size_t)n * es), "the round trip changed the data");
  attn_tensor_free(&u);
  attn_tensor_free(&t);
  return 0;
}
