/* DLPack interop: attn_tensor <-> attn_dl_tensor round trips, byte_offset,
 * NULL (compact) strides, computations through the views (negative strides
 * included), strides whose reach overflows, and every error. */
#include "attn_dlpack.h"
#include "testutil.h"

static int same_view(const attn_tensor *a, const attn_tensor *b) {
  if (a->data != b->data || a->dtype != b->dtype || a->rank != b->rank) return 0;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i] || a->strides[i] != b->strides[i]) return 0;
  return 1;
}

static void round_trips(attn_ctx *ctx) {
  static float buf[2 * 3 * 4 * 5];
  const int64_t shape[4] = {2, 3, 4, 5};
  const attn_dtype dts[] = {ATTN_F32, ATTN_F64, ATTN_F16, ATTN_BF16, ATTN_BOOL, ATTN_U8};
  const uint8_t codes[] = {ATTN_DL_FLOAT, ATTN_DL_FLOAT, ATTN_DL_FLOAT, ATTN_DL_BFLOAT, ATTN_DL_BOOL, ATTN_DL_UINT};
  const uint8_t bits[] = {32, 64, 16, 16, 8, 8};
  for (int d = 0; d < 6; d++) {
    attn_tensor t = attn_tensor_view(buf, dts[d], 4, shape), p, back;
    const int perm[4] = {0, 2, 1, 3}; /* [B, H, N, D] view of batch-first data: non-compact strides */
    CHECK_OK(ctx, attn_tensor_permute(&p, &t, perm));
    attn_dl_tensor dl;
    int64_t sb[ATTN_MAX_RANK], stb[ATTN_MAX_RANK];
    CHECK_OK(ctx, attn_tensor_to_dlpack(ctx, &dl, sb, stb, &p));
    CHECK(dl.data == buf && dl.device.device_type == ATTN_DL_CPU && dl.device.device_id == 0 && dl.ndim == 4 &&
              dl.dtype.code == codes[d] && dl.dtype.bits == bits[d] && dl.dtype.lanes == 1 && dl.byte_offset == 0 &&
              dl.shape == sb && dl.strides == stb,
          "to_dlpack fields for %s", attn_dtype_name(dts[d]));
    CHECK(sb[1] == 4 && sb[2] == 3 && stb[1] == 5 && stb[2] == 20, "to_dlpack shape/strides for %s", attn_dtype_name(dts[d]));
    CHECK_OK(ctx, attn_tensor_from_dlpack(ctx, &back, &dl));
    CHECK(same_view(&back, &p), "round trip of a permuted %s view", attn_dtype_name(dts[d]));
  }
  /* rank 0: a scalar, no shape array needed */
  float one = 1;
  attn_dl_tensor s = {&one, {ATTN_DL_CPU, 0}, 0, {ATTN_DL_FLOAT, 32, 1}, NULL, NULL, 0};
  attn_tensor st;
  CHECK_OK(ctx, attn_tensor_from_dlpack(ctx, &st, &s));
  CHECK(st.rank == 0 && st.data == &one && attn_tensor_numel(&st) == 1, "scalar");
  /* empty tensor: NULL data allowed when there are no elements */
  int64_t zshape[2] = {0, 7};
  attn_dl_tensor z = {NULL, {ATTN_DL_CPU, 0}, 2, {ATTN_DL_FLOAT, 32, 1}, zshape, NULL, 0};
  CHECK_OK(ctx, attn_tensor_from_dlpack(ctx, &st, &z));
  CHECK(st.rank == 2 && st.shape[0] == 0 && st.strides[0] == 7 && st.strides[1] == 1, "empty tensor");
}

static void offsets_and_compact(attn_ctx *ctx) {
  double buf[40];
  for (int i = 0; i < 40; i++) buf[i] = i;
  int64_t shape[3] = {2, 3, 4};
  attn_dl_tensor dl = {buf, {ATTN_DL_CPU, 0}, 3, {ATTN_DL_FLOAT, 64, 1}, shape, NULL, 5 * sizeof(double)};
  attn_tensor t;
  CHECK_OK(ctx, attn_tensor_from_dlpack(ctx, &t, &dl));
  CHECK(t.data == buf + 5, "byte_offset moves the data pointer");
  CHECK(t.strides[0] == 12 && t.strides[1] == 4 && t.strides[2] == 1, "NULL strides are compact row-major: %lld %lld %lld",
        (long long)t.strides[0], (long long)t.strides[1], (long long)t.strides[2]);
  CHECK(((double *)t.data)[1 * t.strides[0] + 2 * t.strides[1] + 3 * t.strides[2]] == 5 + 12 + 8 + 3, "element (1,2,3)");
  /* explicit strides are kept as given (a transposed view; a broadcast 0) */
  int64_t strides[3] = {0, 1, 3};
  dl.strides = strides;
  dl.byte_offset = 0;
  CHECK_OK(ctx, attn_tensor_from_dlpack(ctx, &t, &dl));
  CHECK(t.data == buf && t.strides[0] == 0 && t.strides[1] == 1 && t.strides[2] == 3, "explicit strides");
  /* back to DLPack: explicit strides, offset folded into the data pointer */
  dl.strides = NULL;
  dl.byte_offset = 8;
  CHECK_OK(ctx, attn_tensor_from_dlpack(ctx, &t, &dl));
  attn_dl_tensor back;
  int64_t sb[3], stb[3];
  CHECK_OK(ctx, attn_tensor_to_dlpack(ctx, &back, sb, stb, &t));
  CHECK(back.data == buf + 1 && back.byte_offset == 0 && stb[0] == 12 && stb[2] == 1, "offset view back to DLPack");
}

/* attn_sdpa on DLPack views of batch-first storage equals it on the same data copied to [B, H, N, D]. */
static void compute_through_views(attn_ctx *ctx) {
  enum { B = 2, N = 5, H = 3, D = 8 };
  static float qb[B * N * H * D], kb[B * N * H * D], vb[B * N * H * D], qc[B * H * N * D], kc[B * H * N * D],
      vc[B * H * N * D], o1[B * H * N * D], o2[B * H * N * D];
  tu_rng r = {7};
  tu_fill_f32(&r, qb, B * N * H * D, 1);
  tu_fill_f32(&r, kb, B * N * H * D, 1);
  tu_fill_f32(&r, vb, B * N * H * D, 1);
  for (int b = 0; b < B; b++)
    for (int n = 0; n < N; n++)
      for (int h = 0; h < H; h++)
        for (int d = 0; d < D; d++) {
          const int src = ((b * N + n) * H + h) * D + d, dst = ((b * H + h) * N + n) * D + d;
          qc[dst] = qb[src]; kc[dst] = kb[src]; vc[dst] = vb[src];
        }
  int64_t shape[4] = {B, H, N, D}, strides[4] = {N * H * D, D, H * D, 1};
  attn_dl_tensor dq = {qb, {ATTN_DL_CPU, 0}, 4, {ATTN_DL_FLOAT, 32, 1}, shape, strides, 0}, dk = dq, dv = dq;
  dk.data = kb;
  dv.data = vb;
  attn_tensor q, k, v;
  CHECK_OK(ctx, attn_tensor_from_dlpack(ctx, &q, &dq));
  CHECK_OK(ctx, attn_tensor_from_dlpack(ctx, &k, &dk));
  CHECK_OK(ctx, attn_tensor_from_dlpack(ctx, &v, &dv));
  attn_tensor o = attn_tensor_view(o1, ATTN_F32, 4, shape);
  CHECK_OK(ctx, attn_sdpa(ctx, &o, NULL, NULL, &q, &k, &v, NULL));
  attn_tensor qt = attn_tensor_view(qc, ATTN_F32, 4, shape), kt = attn_tensor_view(kc, ATTN_F32, 4, shape),
              vt = attn_tensor_view(vc, ATTN_F32, 4, shape), ot = attn_tensor_view(o2, ATTN_F32, 4, shape);
  CHECK_OK(ctx, attn_sdpa(ctx, &ot, NULL, NULL, &qt, &kt, &vt, NULL));
  double worst = 0;
  for (int i = 0; i < B * H * N * D; i++) worst = fmax(worst, fabs((double)o1[i] - (double)o2[i]));
  CHECK(worst < 1e-6, "sdpa through DLPack views differs by %g", worst);
}

/* Negative strides are taken as given: keys and values stored in reverse order, seen
 * through a view with a negative stride (and the data pointer moved to the last row
 * by byte_offset), and an output written backwards, give what the plain views give. */
static void negative_strides(attn_ctx *ctx) {
  enum { B = 2, H = 2, N = 19, D = 8 };
  static float q[B * H * N * D], k[B * H * N * D], v[B * H * N * D], kr[B * H * N * D], vr[B * H * N * D],
      o1[B * H * N * D], o2[B * H * N * D], o3[B * H * N * D];
  tu_rng r = {11};
  tu_fill_f32(&r, q, B * H * N * D, 1);
  tu_fill_f32(&r, k, B * H * N * D, 1);
  tu_fill_f32(&r, v, B * H * N * D, 1);
  for (int bh = 0; bh < B * H; bh++)
    for (int n = 0; n < N; n++)
      for (int d = 0; d < D; d++) {
        kr[(bh * N + N - 1 - n) * D + d] = k[(bh * N + n) * D + d];
        vr[(bh * N + N - 1 - n) * D + d] = v[(bh * N + n) * D + d];
      }
  int64_t shape[4] = {B, H, N, D}, back[4] = {H * N * D, N * D, -D, 1};
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, shape), tk = attn_tensor_view(k, ATTN_F32, 4, shape);
  attn_tensor tv = attn_tensor_view(v, ATTN_F32, 4, shape), to = attn_tensor_view(o1, ATTN_F32, 4, shape);
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.causal = ATTN_CAUSAL_TOP_LEFT;
  CHECK_OK(ctx, attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &tv, &o));
  const uint64_t last_row = (uint64_t)((N - 1) * D) * sizeof(float);
  attn_dl_tensor dk = {kr, {ATTN_DL_CPU, 0}, 4, {ATTN_DL_FLOAT, 32, 1}, shape, back, last_row}, dv = dk, dout = dk;
  dv.data = vr;
  dout.data = o3;
  attn_tensor nk, nv, no, t2 = attn_tensor_view(o2, ATTN_F32, 4, shape);
  CHECK_OK(ctx, attn_tensor_from_dlpack(ctx, &nk, &dk));
  CHECK_OK(ctx, attn_tensor_from_dlpack(ctx, &nv, &dv));
  CHECK_OK(ctx, attn_tensor_from_dlpack(ctx, &no, &dout));
  CHECK(nk.strides[2] == -D && nk.data == kr + (N - 1) * D, "a negative stride is copied as given");
  CHECK_OK(ctx, attn_sdpa(ctx, &t2, NULL, NULL, &tq, &nk, &nv, &o));
  CHECK_OK(ctx, attn_sdpa(ctx, &no, NULL, NULL, &tq, &tk, &tv, &o));
  double worst_in = 0, worst_out = 0;
  for (int bh = 0; bh < B * H; bh++)
    for (int n = 0; n < N; n++)
      for (int d = 0; d < D; d++) {
        const int i = (bh * N + n) * D + d;
        worst_in = fmax(worst_in, fabs((double)o1[i] - (double)o2[i]));
        worst_out = fmax(worst_out, fabs((double)o1[i] - (double)o3[(bh * N + N - 1 - n) * D + d]));
      }
  CHECK(worst_in < 1e-6 && worst_out < 1e-6, "negative strides: inputs differ by %g, output by %g", worst_in,
        worst_out);
}

/* The farthest element a view reaches (|stride| * (extent - 1) over the dimensions,
 * in bytes, plus byte_offset) must be addressable: else no call could compute an
 * element's address without overflow, and the view is refused. */
static void stride_reach(attn_ctx *ctx) {
  float buf[8];
  int64_t shape[2] = {3, 2}, strides[2] = {INT64_MAX / 2, 1};
  attn_dl_tensor dl = {buf, {ATTN_DL_CPU, 0}, 2, {ATTN_DL_FLOAT, 32, 1}, shape, strides, 0};
  attn_tensor t, untouched;
  memset(&untouched, 0xcd, sizeof untouched);
  t = untouched;
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_SHAPE, "stride");
  strides[0] = -(INT64_MAX / 2);
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_SHAPE, "stride");
  strides[0] = INT64_MIN;
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_SHAPE, "stride");
  /* the reach is in bytes: 2^61 float32 elements fit in int64_t, their bytes do not */
  strides[0] = INT64_MAX / 4 + 1;
  shape[0] = 2;
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_SHAPE, "stride");
  /* two dimensions that each fit, but not together (one-byte elements) */
  int64_t s2[2] = {INT64_MAX / 2 + 1, INT64_MAX / 2 + 1};
  dl.strides = s2;
  dl.dtype.code = ATTN_DL_UINT;
  dl.dtype.bits = 8;
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_SHAPE, "stride");
  s2[0] = INT64_MAX / 2; /* together exactly INT64_MAX: accepted */
  s2[1] = INT64_MAX / 2 + 1;
  attn_tensor ok_view;
  CHECK_OK(ctx, attn_tensor_from_dlpack(ctx, &ok_view, &dl));
  dl.dtype.code = ATTN_DL_FLOAT;
  dl.dtype.bits = 32;
  dl.strides = strides;
  /* a byte_offset beyond any address */
  strides[0] = 2;
  dl.byte_offset = (uint64_t)INT64_MAX + 1;
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_SHAPE, "byte_offset");
  CHECK(!memcmp(&t, &untouched, sizeof t), "a refused view leaves the output untouched");
  dl.byte_offset = 0;
  /* a huge stride on a dimension of extent 1 or 0 reaches nothing: accepted */
  shape[0] = 1;
  strides[0] = INT64_MAX;
  CHECK_OK(ctx, attn_tensor_from_dlpack(ctx, &t, &dl));
  shape[0] = 0;
  strides[0] = INT64_MIN;
  CHECK_OK(ctx, attn_tensor_from_dlpack(ctx, &t, &dl));
}

static void errors(attn_ctx *ctx) {
  float buf[6];
  int64_t shape[2] = {2, 3};
  const attn_dl_tensor good = {buf, {ATTN_DL_CPU, 0}, 2, {ATTN_DL_FLOAT, 32, 1}, shape, NULL, 0};
  attn_dl_tensor dl;
  attn_tensor t, untouched;
  memset(&untouched, 0xab, sizeof untouched);
  t = untouched;
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, NULL, &good), ATTN_E_INVALID, "NULL");
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, NULL), ATTN_E_INVALID, "NULL");
  dl = good; dl.device.device_type = 2; /* CUDA */
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_UNSUPPORTED, "device type 2");
  dl = good; dl.dtype.lanes = 4;
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_DTYPE, "lanes");
  dl = good; dl.dtype.lanes = 0;
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_DTYPE, "lanes");
  const attn_dl_dtype bad[] = {{ATTN_DL_FLOAT, 8, 1}, {ATTN_DL_FLOAT, 128, 1}, {ATTN_DL_INT, 32, 1}, {ATTN_DL_INT, 8, 1},
                               {ATTN_DL_UINT, 16, 1}, {ATTN_DL_BFLOAT, 32, 1}, {ATTN_DL_BOOL, 1, 1},
                               {ATTN_DL_COMPLEX, 64, 1}, {ATTN_DL_OPAQUE_HANDLE, 64, 1}, {99, 32, 1}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    dl = good; dl.dtype = bad[i];
    CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_DTYPE, "dtype code");
  }
  int64_t big[ATTN_MAX_RANK + 1];
  for (int i = 0; i <= ATTN_MAX_RANK; i++) big[i] = 1;
  dl = good; dl.ndim = ATTN_MAX_RANK + 1; dl.shape = big;
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_SHAPE, "ndim 9");
  dl = good; dl.ndim = -1;
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_SHAPE, "ndim -1");
  int64_t neg[2] = {2, -3};
  dl = good; dl.shape = neg;
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_SHAPE, "negative");
  int64_t huge[2] = {INT64_MAX / 2, 4};
  dl = good; dl.shape = huge;
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_SHAPE, "too many");
  dl = good; dl.shape = NULL;
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_INVALID, "NULL shape");
  dl = good; dl.data = NULL;
  CHECK_ERR(ctx, attn_tensor_from_dlpack(ctx, &t, &dl), ATTN_E_INVALID, "NULL data");
  CHECK(!memcmp(&t, &untouched, sizeof t), "a failed call leaves the output untouched");
  CHECK(attn_tensor_from_dlpack(NULL, &t, &dl) == ATTN_E_INVALID, "NULL context still reports the status");

  attn_tensor v = attn_tensor_view(buf, ATTN_F32, 2, shape);
  int64_t sb[ATTN_MAX_RANK], stb[ATTN_MAX_RANK];
  CHECK_ERR(ctx, attn_tensor_to_dlpack(ctx, NULL, sb, stb, &v), ATTN_E_INVALID, "NULL");
  CHECK_ERR(ctx, attn_tensor_to_dlpack(ctx, &dl, NULL, stb, &v), ATTN_E_INVALID, "NULL");
  CHECK_ERR(ctx, attn_tensor_to_dlpack(ctx, &dl, sb, NULL, &v), ATTN_E_INVALID, "NULL");
  CHECK_ERR(ctx, attn_tensor_to_dlpack(ctx, &dl, sb, stb, NULL), ATTN_E_INVALID, "NULL");
  attn_tensor w = v;
  w.dtype = (attn_dtype)42;
  CHECK_ERR(ctx, attn_tensor_to_dlpack(ctx, &dl, sb, stb, &w), ATTN_E_DTYPE, "dtype 42");
  w = v; w.rank = ATTN_MAX_RANK + 1;
  CHECK_ERR(ctx, attn_tensor_to_dlpack(ctx, &dl, sb, stb, &w), ATTN_E_SHAPE, "rank 9");
  w = v; w.rank = -1;
  CHECK_ERR(ctx, attn_tensor_to_dlpack(ctx, &dl, sb, stb, &w), ATTN_E_SHAPE, "rank -1");
  w = v; w.shape[1] = -1;
  CHECK_ERR(ctx, attn_tensor_to_dlpack(ctx, &dl, sb, stb, &w), ATTN_E_SHAPE, "negative");
  /* a success clears the last message */
  CHECK_OK(ctx, attn_tensor_to_dlpack(ctx, &dl, sb, stb, &v));
  CHECK(attn_ctx_error(ctx)[0] == '\0', "message cleared");
}

int main(void) {
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx)) return 1;
  round_trips(ctx);
  offsets_and_compact(ctx);
  compute_through_views(ctx);
  negative_strides(ctx);
  stride_reach(ctx);
  errors(ctx);
  attn_ctx_destroy(ctx);
  return tu_finish("test_dlpack");
}
