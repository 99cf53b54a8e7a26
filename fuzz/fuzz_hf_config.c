/* libFuzzer harness for the config.json reader (attn_hf_config_parse) and,
 * on the same bytes, a sharded checkpoint's index reader (attn__hf_index_parse:
 * both are JSON a model's folder holds). Whatever the bytes: a known status
 * with a message on failure; on success a config whose sizes are consistent
 * (heads divide by kv heads, head_dim > 0, no more layers than the table
 * holds) and whose RoPE options the rotation accepts, and an index whose every
 * shard is a plain file name. */
#include "attn.h"
#include "io/io.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static attn_ctx *ctx;

static void need(int cond, const char *what) {
  if (cond) return;
  fprintf(stderr, "fuzz_hf_config: %s (message: '%s')\n", what, attn_ctx_error(ctx));
  abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  attn_ctx_create(&ctx);
  attn_ctx_set_threads(ctx, 1);
  return 0;
}

static void check_index(const uint8_t *data, size_t size) {
  attn__hf_index x;
  const attn_status st = attn__hf_index_parse(ctx, &x, data, size, "fuzz.index.json");
  if (st != ATTN_OK) {
    need(st == ATTN_E_FORMAT || st == ATTN_E_NOMEM, "index: an unexpected status");
    need(attn_ctx_error(ctx)[0] != '\0', "index: a failure without a message");
    return;
  }
  need(x.n > 0, "index: no entries on success");
  for (int64_t i = 0; i < x.n; i++)
    need(x.file[i][0] && !strchr(x.file[i], '/') && !strchr(x.file[i], '\\') && strcmp(x.file[i], "..") &&
             strcmp(x.file[i], "."), "index: a shard that is not a plain file name");
  attn__hf_index_free(&x);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  check_index(data, size);
  attn_hf_config c;
  const attn_status st = attn_hf_config_parse(ctx, &c, (const char *)data, size, "fuzz");
  if (st != ATTN_OK) {
    need(st == ATTN_E_FORMAT || st == ATTN_E_UNSUPPORTED || st == ATTN_E_NOMEM, "an unexpected status");
    need(attn_ctx_error(ctx)[0] != '\0', "a failure without a message");
    return 0;
  }
  need(c.size == sizeof c && c.num_heads > 0 && c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads == 0,
       "inconsistent heads");
  need(c.head_dim > 0 && c.num_layers >= 0 && c.num_layers <= ATTN_HF_MAX_LAYERS, "inconsistent sizes");
  need(memchr(c.model_type, '\0', sizeof c.model_type) != NULL, "an unterminated model_type");
  if (c.rope && c.head_dim <= 4096) { /* the options go to attn_rope as they are: valid or refused, never a crash */
    const int64_t shape[4] = {1, 1, 2, c.head_dim};
    float *x = calloc((size_t)(2 * c.head_dim), sizeof(float));
    need(x != NULL, "out of memory");
    attn_tensor t = attn_tensor_view(x, ATTN_F32, 4, shape);
    attn_rope_opts *ro[2] = {&c.rope_global, &c.rope_local};
    for (int i = 0; i < 2; i++) {
      const attn_status rs = attn_rope(ctx, &t, &t, ro[i]);
      need(rs == ATTN_OK || rs == ATTN_E_INVALID, "attn_rope: an unexpected status");
    }
    free(x);
  }
  return 0;
}
