/* DLPack views: attn_tensor and DLTensor describe strided memory the same
 * way (strides in elements), so conversion is a copy of the metadata only. */
#include "attn_dlpack.h"

#include "internal.h"

#include <stddef.h>
#include <string.h>

/* The struct must match DLPack's DLTensor byte for byte on every ABI. */
_Static_assert(sizeof(attn_dl_device) == 8, "DLDevice is two int32");
_Static_assert(sizeof(attn_dl_dtype) == 4, "DLDataType is uint8, uint8, uint16");
_Static_assert(offsetof(attn_dl_tensor, device) == sizeof(void *), "DLTensor.device follows data");
_Static_assert(offsetof(attn_dl_tensor, ndim) == sizeof(void *) + 8, "DLTensor.ndim follows device");
_Static_assert(offsetof(attn_dl_tensor, dtype) == sizeof(void *) + 12, "DLTensor.dtype follows ndim");

static int dtype_from_dl(attn_dl_dtype d, attn_dtype *out) {
  switch (d.code) {
  case ATTN_DL_FLOAT:
    if (d.bits == 32) *out = ATTN_F32;
    else if (d.bits == 64) *out = ATTN_F64;
    else if (d.bits == 16) *out = ATTN_F16;
    else return 0;
    return 1;
  case ATTN_DL_BFLOAT:
    if (d.bits != 16) return 0;
    *out = ATTN_BF16;
    return 1;
  case ATTN_DL_BOOL:
    if (d.bits != 8) return 0;
    *out = ATTN_BOOL;
    return 1;
  case ATTN_DL_UINT:
    if (d.bits != 8) return 0;
    *out = ATTN_U8;
    return 1;
  default:
    return 0;
  }
}

static int dtype_to_dl(attn_dtype t, attn_dl_dtype *out) {
  attn_dl_dtype d = {0, 0, 1};
  switch (t) {
  case ATTN_F32: d.code = ATTN_DL_FLOAT; d.bits = 32; break;
  case ATTN_F64: d.code = ATTN_DL_FLOAT; d.bits = 64; break;
  case ATTN_F16: d.code = ATTN_DL_FLOAT; d.bits = 16; break;
  case ATTN_BF16: d.code = ATTN_DL_BFLOAT; d.bits = 16; break;
  case ATTN_BOOL: d.code = ATTN_DL_BOOL; d.bits = 8; break;
  case ATTN_U8: d.code = ATTN_DL_UINT; d.bits = 8; break;
  default: return 0;
  }
  *out = d;
  return 1;
}

/* How far (in bytes) the farthest element of a view lies from its first, in
 * either direction: sum over dimensions of |stride| * (extent - 1) * size.
 * 0 when that does not fit in int64_t (nor, then, any offset a call computes). */
static int reach_fits(const attn_tensor *v, int64_t *reach) {
  int64_t r = 0;
  for (int i = 0; i < v->rank; i++) {
    if (v->shape[i] == 0) { /* no element: nothing is reached */
      *reach = 0;
      return 1;
    }
  }
  for (int i = 0; i < v->rank; i++) {
    const int64_t s = v->strides[i], e = v->shape[i] - 1;
    if (e == 0) continue;
    if (s == INT64_MIN) return 0;
    int64_t d;
    if (attn__mul_overflows(s < 0 ? -s : s, e, &d) || d > INT64_MAX - r) return 0;
    r += d;
  }
  if (attn__mul_overflows(r, (int64_t)attn_dtype_size(v->dtype), &r)) return 0;
  *reach = r;
  return 1;
}

attn_status attn_tensor_from_dlpack(attn_ctx *ctx, attn_tensor *out, const attn_dl_tensor *t) {
  ATTN__ENTER(ctx);
  if (!out || !t) return attn__fail(ctx, ATTN_E_INVALID, "dlpack: NULL %s", out ? "DLTensor" : "output tensor");
  if (t->device.device_type != ATTN_DL_CPU)
    return attn__fail(ctx, ATTN_E_UNSUPPORTED, "dlpack: device type %d is not the CPU (%d)",
                      (int)t->device.device_type, ATTN_DL_CPU);
  if (t->dtype.lanes != 1)
    return attn__fail(ctx, ATTN_E_DTYPE, "dlpack: %u lanes per element; only 1 is supported", (unsigned)t->dtype.lanes);
  attn_dtype dt;
  if (!dtype_from_dl(t->dtype, &dt))
    return attn__fail(ctx, ATTN_E_DTYPE, "dlpack: dtype code %u with %u bits has no attn dtype",
                      (unsigned)t->dtype.code, (unsigned)t->dtype.bits);
  if (t->ndim < 0 || t->ndim > ATTN_MAX_RANK)
    return attn__fail(ctx, ATTN_E_SHAPE, "dlpack: ndim %d is out of range 0..%d", (int)t->ndim, ATTN_MAX_RANK);
  if (t->ndim > 0 && !t->shape) return attn__fail(ctx, ATTN_E_INVALID, "dlpack: NULL shape with ndim %d", (int)t->ndim);
  attn_tensor v;
  memset(&v, 0, sizeof v);
  v.dtype = dt;
  v.rank = t->ndim;
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++) {
    if (t->shape[i] < 0) return attn__fail(ctx, ATTN_E_SHAPE, "dlpack: shape[%d] = %lld is negative", i, (long long)t->shape[i]);
    if (attn__mul_overflows(n, t->shape[i], &n)) return attn__fail(ctx, ATTN_E_SHAPE, "dlpack: too many elements");
    v.shape[i] = t->shape[i];
  }
  /* NULL strides: compact row-major, as DLPack defines it */
  int64_t s = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    v.strides[i] = t->strides ? t->strides[i] : s;
    s *= t->shape[i] > 0 ? t->shape[i] : 1;
  }
  if (n > 0 && !t->data) return attn__fail(ctx, ATTN_E_INVALID, "dlpack: NULL data with %lld elements", (long long)n);
  /* every element's offset must be computable: the calls index with int64_t */
  int64_t reach;
  if (!reach_fits(&v, &reach))
    return attn__fail(ctx, ATTN_E_SHAPE, "dlpack: the strides reach past %lld bytes from the first element",
                      (long long)INT64_MAX);
  if (t->byte_offset > (uint64_t)INT64_MAX)
    return attn__fail(ctx, ATTN_E_SHAPE, "dlpack: byte_offset %llu is past any address",
                      (unsigned long long)t->byte_offset);
  v.data = t->data ? (char *)t->data + t->byte_offset : NULL;
  *out = v;
  return ATTN_OK;
}

attn_status attn_tensor_to_dlpack(attn_ctx *ctx, attn_dl_tensor *out, int64_t shape_buf[], int64_t strides_buf[],
                                  const attn_tensor *t) {
  ATTN__ENTER(ctx);
  if (!out || !t || !shape_buf || !strides_buf) return attn__fail(ctx, ATTN_E_INVALID, "dlpack: NULL argument");
  attn_dl_dtype d;
  if (!dtype_to_dl(t->dtype, &d)) return attn__fail(ctx, ATTN_E_DTYPE, "dlpack: unknown dtype %d", (int)t->dtype);
  if (t->rank < 0 || t->rank > ATTN_MAX_RANK)
    return attn__fail(ctx, ATTN_E_SHAPE, "dlpack: rank %d is out of range 0..%d", t->rank, ATTN_MAX_RANK);
  for (int i = 0; i < t->rank; i++)
    if (t->shape[i] < 0) return attn__fail(ctx, ATTN_E_SHAPE, "dlpack: shape[%d] = %lld is negative", i, (long long)t->shape[i]);
  for (int i = 0; i < t->rank; i++) {
    shape_buf[i] = t->shape[i];
    strides_buf[i] = t->strides[i];
  }
  memset(out, 0, sizeof *out);
  out->data = t->data;
  out->device.device_type = ATTN_DL_CPU;
  out->device.device_id = 0;
  out->ndim = t->rank;
  out->dtype = d;
  out->shape = shape_buf;
  out->strides = strides_buf;
  out->byte_offset = 0;
  return ATTN_OK;
}
