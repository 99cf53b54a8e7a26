/* The scheduler's work lists, as attn_ctx_plan reports them: one parallel
 * region per call, the phases each framework deals, and a KV cache's batch
 * of rows of different lengths decoded in one call (not one call per row). */
#include "testutil.h"

static void fill(float *x, int64_t n, uint64_t seed) {
  tu_rng g = {seed};
  tu_fill_f32(&g, x, n, 1.0);
}

int main(void) {
  attn_ctx *ctx = NULL;
  CHECK_OK(ctx, attn_ctx_create(&ctx));
  CHECK(!strcmp(attn_ctx_plan(ctx), "") && !strcmp(attn_ctx_plan(NULL), ""), "no plan before any call");
  CHECK_OK(ctx, attn_ctx_set_threads(ctx, 3));
  const int64_t B = 2, H = 2, N = 96, D = 16, s[4] = {B, H, N, D}, ls[3] = {B, H, N};
  float *q = malloc(sizeof(float) * B * H * N * D), *k = malloc(sizeof(float) * B * H * N * D);
  float *v = malloc(sizeof(float) * B * H * N * D), *o = malloc(sizeof(float) * B * H * N * D);
  float *l = malloc(sizeof(float) * B * H * N), *dq = malloc(sizeof(float) * B * H * N * D);
  float *dk = malloc(sizeof(float) * B * H * N * D), *dv = malloc(sizeof(float) * B * H * N * D);
  fill(q, B * H * N * D, 1), fill(k, B * H * N * D, 2), fill(v, B * H * N * D, 3);
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, s), tk = attn_tensor_view(k, ATTN_F32, 4, s);
  attn_tensor tv = attn_tensor_view(v, ATTN_F32, 4, s), to = attn_tensor_view(o, ATTN_F32, 4, s);
  attn_tensor tl = attn_tensor_view(l, ATTN_F32, 3, ls), tdq = attn_tensor_view(dq, ATTN_F32, 4, s);
  attn_tensor tdk = attn_tensor_view(dk, ATTN_F32, 4, s), tdv = attn_tensor_view(dv, ATTN_F32, 4, s);
  if (attn_ctx_kernel(ctx) == ATTN_KERNEL_REF) {
    printf("the oracle runs: no work lists\n");
    return 0;
  }
  attn_sdpa_opts opts;
  attn_sdpa_opts_init(&opts);
  opts.causal = ATTN_CAUSAL_TOP_LEFT;
  opts.lse = &tl;
  CHECK_OK(ctx, attn_sdpa(ctx, &to, &tq, &tk, &tv, &opts));
  const char *plan = attn_ctx_plan(ctx);
  printf("forward:  %s\n", plan);
  CHECK(strstr(plan, "forward") && strstr(plan, "on 3 threads") && strstr(plan, "pack_k") &&
            strstr(plan, "query_blocks") && strstr(plan, "on demand"),
        "forward plan: %s", plan);
  attn_sdpa_opts bo;
  attn_sdpa_opts_init(&bo);
  bo.causal = ATTN_CAUSAL_TOP_LEFT;
  CHECK_OK(ctx, attn_sdpa_backward(ctx, &tdq, &tdk, &tdv, &tv, &tq, &tk, &tv, &to, &tl, &bo));
  plan = attn_ctx_plan(ctx);
  printf("backward: %s\n", plan);
  /* B * H = 4 kv heads: 16 items each for 64 threads, as 8 key chunks (N = 96 has fewer
   * blocks on most kernels, which then take more query splits) */
  CHECK(strstr(plan, "backward") && strstr(plan, "key_chunks_x_query_splits") && strstr(plan, "sum_dq"), "backward plan: %s",
        plan);

  /* a cache of 4 rows of lengths 5, 0, 37, 96: one decode call for the step */
  attn_kv_cache_config cfg;
  attn_kv_cache_config_init(&cfg, 4, 128, 1, D);
  attn_kv_cache *cache = NULL;
  CHECK_OK(ctx, attn_kv_cache_create(ctx, &cache, &cfg));
  const int64_t ks[4] = {4, 1, 96, D}, qs[4] = {4, 2, 1, D}, n_new[4] = {5, 0, 37, 96};
  float *kk = malloc(sizeof(float) * 4 * 96 * D), *qq = malloc(sizeof(float) * 4 * 2 * D), *oo = malloc(sizeof(float) * 4 * 2 * D);
  fill(kk, 4 * 96 * D, 4), fill(qq, 4 * 2 * D, 5);
  attn_tensor tkk = attn_tensor_view(kk, ATTN_F32, 4, ks), tqq = attn_tensor_view(qq, ATTN_F32, 4, qs);
  attn_tensor too = attn_tensor_view(oo, ATTN_F32, 4, qs);
  CHECK_OK(ctx, attn_kv_cache_append(ctx, cache, &tkk, &tkk, n_new));
  CHECK_OK(ctx, attn_kv_cache_attend(ctx, cache, &too, &tqq, NULL));
  plan = attn_ctx_plan(ctx);
  printf("decode:   %s\n", plan);
  CHECK(strstr(plan, "decode (4 rows") && strstr(plan, "kv_chunks") && strstr(plan, "merge_rows"),
        "a batch of mixed lengths decodes in one call: %s", plan);
  attn_kv_cache_destroy(cache);
  free(q), free(k), free(v), free(o), free(l), free(dq), free(dk), free(dv), free(kk), free(qq), free(oo);
  attn_ctx_destroy(ctx);
  return tu_finish("test_plan");
}
