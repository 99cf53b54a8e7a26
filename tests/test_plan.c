/* The scheduler's work lists, as attn_ctx_plan reports them: one parallel
 * region per call, the phases each framework deals, and a KV cache's batch
 * of rows of different lengths decoded in one call (not one call per row). */
#include "testutil.h"

static void fill(float *x, int64_t n, uint64_t seed) {
  tu_rng g = {seed};
  tu_fill_f32(&g, x, n, 1.0);
}

/* test_plan --show T: the work lists of B1 H1 N16384 D64 (causal forward and
 * backward) and of one decoding step of 16 rows of mixed lengths, on T
 * threads, printed (for the docs: how a machine of T cores is dealt work). */
static int show(int threads) {
  attn_ctx *ctx = NULL;
  if (attn_ctx_create(&ctx) || attn_ctx_set_threads(ctx, threads)) return 1;
  const int64_t N = 16384, D = 64, s[4] = {1, 1, N, D}, ls[3] = {1, 1, N};
  attn_tensor q, k, v, o, l, dq, dk, dv;
  attn_status st = attn_tensor_alloc(ctx, &q, ATTN_F32, 4, s);
  if (!st) st = attn_tensor_alloc(ctx, &k, ATTN_F32, 4, s);
  if (!st) st = attn_tensor_alloc(ctx, &v, ATTN_F32, 4, s);
  if (!st) st = attn_tensor_alloc(ctx, &o, ATTN_F32, 4, s);
  if (!st) st = attn_tensor_alloc(ctx, &dq, ATTN_F32, 4, s);
  if (!st) st = attn_tensor_alloc(ctx, &dk, ATTN_F32, 4, s);
  if (!st) st = attn_tensor_alloc(ctx, &dv, ATTN_F32, 4, s);
  if (!st) st = attn_tensor_alloc(ctx, &l, ATTN_F32, 3, ls);
  if (st) return 1;
  attn_sdpa_opts opts;
  attn_sdpa_opts_init(&opts);
  opts.causal = ATTN_CAUSAL_TOP_LEFT;
  if ((st = attn_sdpa(ctx, &o, &l, NULL, &q, &k, &v, &opts))) return 1;
  printf("B1 H1 N16384 D64 causal, forward:\n  %s\n", attn_ctx_plan(ctx));
  if ((st = attn_sdpa_backward(ctx, &dq, &dk, &dv, NULL, NULL, &o, &q, &k, &v, &o, &l, &opts))) return 1;
  printf("B1 H1 N16384 D64 causal, backward:\n  %s\n", attn_ctx_plan(ctx));
  /* 16 rows of 100 to 32000 tokens, 8 kv heads of D 128, GQA 4 (32 query heads), one new token each */
  attn_kv_cache_config cfg;
  attn_kv_cache_config_init(&cfg, 16, 32768, 8, 128);
  attn_kv_cache *cache = NULL;
  if (attn_kv_cache_create(ctx, &cache, &cfg)) return 1;
  const int64_t ks[4] = {16, 8, 1, 128}, qs[4] = {16, 32, 1, 128};
  attn_tensor kk, qq, oo;
  if (attn_tensor_alloc(ctx, &kk, ATTN_F32, 4, ks) || attn_tensor_alloc(ctx, &qq, ATTN_F32, 4, qs) ||
      attn_tensor_alloc(ctx, &oo, ATTN_F32, 4, qs))
    return 1;
  int64_t lengths[16];
  printf("decode step, 16 rows of lengths");
  for (int b = 0; b < 16; b++) printf(" %lld", (long long)(lengths[b] = 100 + (int64_t)b * b * 124));
  printf(", Hq 32, Hk 8, D 128:\n");
  for (int64_t t = 0; t < 32000; t++) { /* rows grow to their lengths one token at a time, as decoding does */
    int64_t n_new[16], any = 0;
    for (int b = 0; b < 16; b++) any |= (n_new[b] = t < lengths[b]);
    if (!any) break;
    if (attn_kv_cache_append(ctx, cache, &kk, &kk, n_new)) return 1;
  }
  if (attn_kv_cache_attend(ctx, cache, &oo, NULL, &qq, NULL)) return 1;
  printf("  %s\n", attn_ctx_plan(ctx));
  attn_kv_cache_destroy(cache);
  attn_tensor *all[] = {&q, &k, &v, &o, &l, &dq, &dk, &dv, &kk, &qq, &oo};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) attn_tensor_free(all[i]);
  attn_ctx_destroy(ctx);
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 3 && !strcmp(argv[1], "--show")) return show(atoi(argv[2]));
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
  CHECK_OK(ctx, attn_sdpa(ctx, &to, &tl, NULL, &tq, &tk, &tv, &opts));
  const char *plan = attn_ctx_plan(ctx);
  printf("forward:  %s\n", plan);
  CHECK(strstr(plan, "forward") && strstr(plan, "on 3 threads") && strstr(plan, "pack_k") &&
            strstr(plan, "query_blocks") && strstr(plan, "on demand"),
        "forward plan: %s", plan);
  attn_sdpa_opts bo;
  attn_sdpa_opts_init(&bo);
  bo.causal = ATTN_CAUSAL_TOP_LEFT;
  CHECK_OK(ctx, attn_sdpa_backward(ctx, &tdq, &tdk, &tdv, NULL, NULL, &tv, &tq, &tk, &tv, &to, &tl, &bo));
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
  CHECK_OK(ctx, attn_kv_cache_attend(ctx, cache, &too, NULL, &tqq, NULL));
  plan = attn_ctx_plan(ctx);
  printf("decode:   %s\n", plan);
  CHECK(strstr(plan, "decode (4 rows") && strstr(plan, "kv_chunks") && strstr(plan, "merge_rows"),
        "a batch of mixed lengths decodes in one call: %s", plan);
  /* decoding threads follow the keys read, not only the flops: 8 kv heads of 512 keys (one row each)
   * take every thread, 8 of 16 keys one */
  {
    const int64_t dq4[4] = {1, 8, 1, 64}, dk4[4] = {1, 8, 512, 64};
    float *dqb = calloc(8 * 64, sizeof(float)), *dob = calloc(8 * 64, sizeof(float));
    float *dkb = calloc(8 * 512 * 64, sizeof(float));
    attn_tensor tdq4 = attn_tensor_view(dqb, ATTN_F32, 4, dq4), tdo4 = attn_tensor_view(dob, ATTN_F32, 4, dq4);
    attn_tensor tdk4 = attn_tensor_view(dkb, ATTN_F32, 4, dk4);
    attn_sdpa_opts dopt;
    attn_sdpa_opts_init(&dopt);
    CHECK_OK(ctx, attn_sdpa(ctx, &tdo4, NULL, NULL, &tdq4, &tdk4, &tdk4, &dopt));
    plan = attn_ctx_plan(ctx);
    CHECK(strstr(plan, "decode") && strstr(plan, "on 3 threads"), "8 kv heads x 512 keys: %s", plan);
    tdk4.shape[2] = 16;
    CHECK_OK(ctx, attn_sdpa(ctx, &tdo4, NULL, NULL, &tdq4, &tdk4, &tdk4, &dopt));
    plan = attn_ctx_plan(ctx);
    CHECK(strstr(plan, "decode") && strstr(plan, "on 1 thread,"), "8 kv heads x 16 keys: %s", plan);
    free(dqb), free(dob), free(dkb);
  }
  attn_kv_cache_destroy(cache);
  free(q), free(k), free(v), free(o), free(l), free(dq), free(dk), free(dv), free(kk), free(qq), free(oo);
  attn_ctx_destroy(ctx);
  return tu_finish("test_plan");
}
