/* Views whose shapes sit at the edge of int64: attn_tensor_view's strides for
 * an empty tensor beside huge dimensions, and every checked call refusing a
 * view whose extent in bytes (the farthest element from the first) cannot be
 * represented. Under the sanitizer build any signed overflow here aborts. */
#include "testutil.h"

#define P62 ((int64_t)1 << 62)

static void view_strides(void) {
  /* (0, 2^62, 4): numpy's rule counts the 0 as 1, which puts 2^64 in the
   * outermost stride; that stride is 0 instead (the tensor has no element) */
  int64_t s1[3] = {0, P62, 4};
  attn_tensor t = attn_tensor_view(NULL, ATTN_F32, 3, s1);
  CHECK(t.rank == 3 && t.strides[2] == 1 && t.strides[1] == 4 && t.strides[0] == 0,
        "(0, 2^62, 4): strides (%lld, %lld, %lld)", (long long)t.strides[0], (long long)t.strides[1],
        (long long)t.strides[2]);
  CHECK(attn_tensor_numel(&t) == 0, "(0, 2^62, 4) has no element");
  /* the zero innermost: every stride still fits */
  int64_t s2[3] = {P62, P62, 0};
  t = attn_tensor_view(NULL, ATTN_U8, 3, s2);
  CHECK(t.strides[2] == 1 && t.strides[1] == 1 && t.strides[0] == P62, "(2^62, 2^62, 0): strides (%lld, %lld, %lld)",
        (long long)t.strides[0], (long long)t.strides[1], (long long)t.strides[2]);
  /* several strides past int64 */
  int64_t s3[4] = {0, (int64_t)1 << 40, (int64_t)1 << 40, 3};
  t = attn_tensor_view(NULL, ATTN_F64, 4, s3);
  CHECK(t.strides[3] == 1 && t.strides[2] == 3 && t.strides[1] == ((int64_t)3 << 40) && t.strides[0] == 0,
        "(0, 2^40, 2^40, 3): strides (%lld, %lld, %lld, %lld)", (long long)t.strides[0], (long long)t.strides[1],
        (long long)t.strides[2], (long long)t.strides[3]);
  /* an ordinary shape is untouched */
  int64_t s4[3] = {2, 0, 5};
  t = attn_tensor_view(NULL, ATTN_F32, 3, s4);
  CHECK(t.strides[0] == 5 && t.strides[1] == 5 && t.strides[2] == 1, "(2, 0, 5) strides");
}

/* A view whose elements reach past int64 bytes is refused by checked calls,
 * empty or not; one just inside is taken. */
static void extents(void) {
  attn_ctx *ctx;
  CHECK_OK(NULL, attn_ctx_create(&ctx));
  enum { B = 1, H = 1, N = 2, D = 4 };
  static float q[B * H * N * D], k[B * H * N * D], v[B * H * N * D], out[B * H * N * D];
  int64_t s[4] = {B, H, N, D};
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, s), tk = attn_tensor_view(k, ATTN_F32, 4, s);
  attn_tensor tv = attn_tensor_view(v, ATTN_F32, 4, s), to = attn_tensor_view(out, ATTN_F32, 4, s);
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  CHECK_OK(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &tv, &o));

  /* q's second row 2^62 floats away: 2^64 bytes, which wraps */
  attn_tensor far = tq;
  far.strides[2] = P62;
  CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &far, &tk, &tv, &o), ATTN_E_SHAPE, "q");
  /* a negative stride counts by its size */
  far.strides[2] = -P62;
  CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &far, &tv, &o), ATTN_E_SHAPE, "k");
  far.strides[2] = INT64_MIN;
  CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &far, &o), ATTN_E_SHAPE, "v");
  /* the sum of the dimensions' reaches overflows although each fits */
  far = tq;
  far.strides[2] = (int64_t)1 << 60;
  far.strides[3] = (int64_t)1 << 59;
  CHECK_ERR(ctx, attn_sdpa(ctx, &to, NULL, NULL, &far, &tk, &tv, &o), ATTN_E_SHAPE, "q");

  /* empty, with a dimension of 2^62 beside the zero: attn_tensor_view's own strides */
  int64_t se[4] = {0, 1, P62, 4};
  attn_tensor eq = attn_tensor_view(q, ATTN_F32, 4, se), eo = eq;
  CHECK_ERR(ctx, attn_sdpa(ctx, &eo, NULL, NULL, &eq, &eq, &eq, &o), ATTN_E_SHAPE, "q");
  /* the same reach in bytes is fine for one-byte elements just inside int64 */
  int64_t sb[2] = {0, P62 - 1};
  attn_tensor eb = attn_tensor_view(q, ATTN_U8, 2, sb);
  char path[1024];
  const char *tmp = getenv("ATTN_TEST_TMP");
  snprintf(path, sizeof path, "%s/test_views.npy", tmp && tmp[0] ? tmp : "/tmp");
  CHECK_OK(ctx, attn_npy_write(ctx, path, &eb));
  eb.dtype = ATTN_F32;
  CHECK_ERR(ctx, attn_npy_write(ctx, path, &eb), ATTN_E_SHAPE, "extent");
  remove(path);

  /* allocation: a shape whose strides cannot be represented is refused, even empty */
  attn_tensor a;
  int64_t sa[3] = {0, P62, 4};
  CHECK_ERR(ctx, attn_tensor_alloc(ctx, &a, ATTN_F32, 3, sa), ATTN_E_SHAPE, "large");
  int64_t sok[3] = {0, P62, 1};
  CHECK_OK(ctx, attn_tensor_alloc(ctx, &a, ATTN_U8, 3, sok));
  CHECK(a.strides[0] == P62 && a.strides[1] == 1, "empty u8 allocation strides");
  attn_tensor_free(&a);

  /* the layer's inputs go through the same check */
  attn_mha *m;
  attn_mha_config c;
  attn_mha_config_init(&c, D, 1);
  CHECK_OK(ctx, attn_mha_create(ctx, &m, &c));
  int64_t sx[3] = {1, N, D};
  attn_tensor x = attn_tensor_view(q, ATTN_F32, 3, sx), y = attn_tensor_view(out, ATTN_F32, 3, sx);
  attn_tensor xf = x;
  xf.strides[1] = P62;
  CHECK_ERR(ctx, attn_mha_forward(ctx, m, &y, NULL, &xf, NULL, NULL, NULL), ATTN_E_SHAPE, "query");
  CHECK_OK(ctx, attn_mha_forward(ctx, m, &y, NULL, &x, NULL, NULL, NULL));
  attn_mha_destroy(m);
  attn_ctx_destroy(ctx);
}

int main(void) {
  view_strides();
  extents();
  return tu_finish("test_views");
}
