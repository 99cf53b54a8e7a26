/* Decoding with a paged, quantized KV cache: two sequences share one prompt
 * (a fork: the prompt's blocks stored once), then each decodes a few tokens of
 * its own; keys are stored as q8_0 and values as q4_0, in blocks of 16 tokens.
 * The keys, values and queries are random here, where a model would project
 * them (and rotate keys and queries by RoPE before appending and attending).
 * Prints each step's pool use; exit status 0 when every call succeeded and the
 * shared prompt took its blocks once. */
#include <attn.h>

#include <stdio.h>
#include <stdlib.h>

enum { HK = 2, HQ = 8, D = 64, PROMPT = 40, STEPS = 20 };

static float frand(unsigned *s) { /* in (-1, 1) */
  *s = *s * 1664525u + 1013904223u;
  return (float)(*s >> 8) / (float)(1u << 23) - 1.0f;
}

/* t: nseq x HK x n x D (or queries nseq x HQ x n x D) random floats, as a view. */
static attn_tensor randn(float *buf, int64_t nseq, int64_t heads, int64_t n, unsigned *s) {
  const int64_t shape[4] = {nseq, heads, n, D};
  for (int64_t i = 0; i < nseq * heads * n * D; i++) buf[i] = frand(s);
  return attn_tensor_view(buf, ATTN_F32, 4, shape);
}

int main(void) {
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx)) return 1;
  attn_paged_kv_config cfg;
  attn_paged_kv_config_init(&cfg, /*num_blocks*/ 64, /*block_tokens*/ 16, HK, D);
  cfg.k_dtype = ATTN_KV_Q8_0, cfg.v_dtype = ATTN_KV_Q4_0;
  attn_paged_kv_cache *cache = NULL;
  attn_status st = attn_paged_kv_create(ctx, &cache, &cfg);

  static float k[2 * HK * PROMPT * D], v[2 * HK * PROMPT * D], q[2 * HQ * D], out[2 * HQ * D];
  unsigned s = 1;
  int64_t seq[2];
  /* the prompt once, into sequence 0; sequence 1 forks it (shares its blocks) */
  if (!st) st = attn_paged_kv_seq_new(ctx, cache, &seq[0]);
  if (!st) {
    attn_tensor tk = randn(k, 1, HK, PROMPT, &s), tv = randn(v, 1, HK, PROMPT, &s);
    st = attn_paged_kv_append(ctx, cache, 1, seq, &tk, &tv, NULL);
  }
  if (!st) st = attn_paged_kv_seq_fork(ctx, cache, &seq[1], seq[0]);
  const int64_t shared_used = cfg.num_blocks - attn_paged_kv_free_blocks(cache);
  printf("prompt of %d tokens, shared by 2 sequences: %lld blocks of %lld tokens\n", PROMPT, (long long)shared_used,
         (long long)cfg.block_tokens);
  /* each step: one new token per sequence, then its query over all its tokens */
  for (int step = 0; step < STEPS && !st; step++) {
    attn_tensor tk = randn(k, 2, HK, 1, &s), tv = randn(v, 2, HK, 1, &s), tq = randn(q, 2, HQ, 1, &s);
    const int64_t os[4] = {2, HQ, 1, D};
    attn_tensor to = attn_tensor_view(out, ATTN_F32, 4, os);
    st = attn_paged_kv_append(ctx, cache, 2, seq, &tk, &tv, NULL);
    if (!st) st = attn_paged_kv_attend(ctx, cache, &to, NULL, &tq, 2, seq, NULL);
    if (!st && step % 5 == 4)
      printf("step %2d: lengths %lld, %lld; %lld blocks in use; out[0] = %+.4f\n", step + 1,
             (long long)attn_paged_kv_seq_length(cache, seq[0]), (long long)attn_paged_kv_seq_length(cache, seq[1]),
             (long long)(cfg.num_blocks - attn_paged_kv_free_blocks(cache)), out[0]);
  }
  if (st) fprintf(stderr, "paged_decode: %s\n", attn_ctx_error(ctx));
  attn_paged_kv_destroy(cache);
  attn_ctx_destroy(ctx);
  return st || shared_used != (PROMPT + 15) / 16;
}
