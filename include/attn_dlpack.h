/* libattn <-> DLPack: attn_tensor views of DLPack tensors and back, without a copy.
 *
 * The structs below are declared here, from DLPack's published ABI (v0.8+
 * DLTensor layout), so this header needs no dlpack.h: a DLTensor* from any
 * producer (PyTorch, NumPy, JAX, ...) may be cast to const attn_dl_tensor*.
 * Only the plain DLTensor is covered; a DLManagedTensor's deleter stays the
 * caller's business (keep the producer alive while the view is used). */
#ifndef ATTN_DLPACK_H
#define ATTN_DLPACK_H

#include "attn.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* DLDeviceType values we name; only CPU memory can be viewed. */
#define ATTN_DL_CPU 1

/* DLDataTypeCode values. */
#define ATTN_DL_INT 0
#define ATTN_DL_UINT 1
#define ATTN_DL_FLOAT 2
#define ATTN_DL_OPAQUE_HANDLE 3
#define ATTN_DL_BFLOAT 4
#define ATTN_DL_COMPLEX 5
#define ATTN_DL_BOOL 6

typedef struct attn_dl_device {
  int32_t device_type; /* ATTN_DL_CPU, ... (a C enum in DLPack: int-sized) */
  int32_t device_id;
} attn_dl_device;

typedef struct attn_dl_dtype {
  uint8_t code;   /* ATTN_DL_FLOAT, ... */
  uint8_t bits;   /* 32 for float32 */
  uint16_t lanes; /* 1 for scalars: vector types are refused */
} attn_dl_dtype;

typedef struct attn_dl_tensor {
  void *data;
  attn_dl_device device;
  int32_t ndim;
  attn_dl_dtype dtype;
  int64_t *shape;       /* [ndim] */
  int64_t *strides;     /* [ndim] in elements, or NULL = compact row-major */
  uint64_t byte_offset; /* the first element is at (char *)data + byte_offset */
} attn_dl_tensor;

/* A view of t's memory as an attn_tensor (shape and strides copied into out).
 * dtypes: float16/32/64, bfloat16, bool (code BOOL, or code UINT with 8 bits
 * read as U8). Errors: ATTN_E_INVALID (NULL arguments, NULL shape with
 * ndim > 0, NULL data with elements), ATTN_E_UNSUPPORTED (a device other
 * than the CPU), ATTN_E_DTYPE (lanes != 1, a code/bits pair with no attn_dtype),
 * ATTN_E_SHAPE (ndim < 0 or > ATTN_MAX_RANK, a negative extent, strides or
 * a byte_offset that reach further than INT64_MAX bytes: the sum over the
 * dimensions of |stride| * (extent - 1), times the element size). out is
 * written only on success. Strides are copied as given, negative and zero
 * ones too; every call takes negative strides. What cannot be checked is the
 * producer's promise: that the memory behind the view exists, and that an
 * output does not overlap itself (attn_sdpa and the backward passes refuse an
 * output with a zero stride; other overlaps are not detected). */
ATTN_API attn_status attn_tensor_from_dlpack(attn_ctx *ctx, attn_tensor *out, const attn_dl_tensor *t);

/* A DLTensor describing t (CPU, device 0, byte_offset 0, explicit strides).
 * shape_buf and strides_buf hold at least t->rank entries and must outlive
 * out (they become out->shape and out->strides). Errors: ATTN_E_INVALID
 * (NULL arguments), ATTN_E_SHAPE (rank out of range, negative extents),
 * ATTN_E_DTYPE (an unknown dtype). */
ATTN_API attn_status attn_tensor_to_dlpack(attn_ctx *ctx, attn_dl_tensor *out, int64_t shape_buf[],
                                           int64_t strides_buf[], const attn_tensor *t);

#ifdef __cplusplus
}
#endif
#endif /* ATTN_DLPACK_H */
