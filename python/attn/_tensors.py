"""NumPy and torch inputs as attn_tensor views, and attn_tensors back as NumPy arrays."""
import ctypes

import numpy as np

from . import _capi


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


def _to_numpy(x, what, kind="float"):
    """A NumPy view of x (a copy only where the dtype or layout needs one).

    kind "float": q/k/v and float masks, result float32 (float64/float16 copied).
    kind "half": float16 kept (NumPy), torch bfloat16 kept as the detached
    tensor itself (NumPy has no bfloat16), float64 copied to float32: inputs
    the library widens itself (the forward pass, the KV cache).
    kind "any": as "half", and float64 kept too (the KV cache's append).
    kind "mask": bool kept as bool, floats as float32.
    """
    halves = kind in ("half", "any")
    if _is_torch(x):
        if x.device.type != "cpu":
            raise TypeError(f"{what}: only CPU tensors are supported (got device {x.device})")
        if x.is_complex():
            raise TypeError(f"{what}: unsupported dtype {x.dtype}")
        x = x.detach()
        if halves and str(x.dtype) == "torch.bfloat16":
            return x  # no NumPy view possible: _tensor reads data_ptr() and stride() (never negative in torch)
        if x.dtype.is_floating_point and str(x.dtype) not in ("torch.float32", "torch.float64", "torch.float16"):
            x = x.float()  # bfloat16 where the call needs float32: NumPy has no bfloat16, so widen (a copy)
        x = x.numpy()
    elif not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))  # big-endian data (from a file, say): a copy in this CPU's order
    if x.dtype == np.bool_ and kind == "mask":
        pass
    elif x.dtype == np.uint8 and kind == "mask":
        x = x != 0  # a uint8 mask reads as bool (nonzero = true): a copy
    elif x.dtype in (np.float32, np.float64, np.float16):
        keep = (np.float32,) + ((np.float16,) if halves else ()) + ((np.float64,) if kind == "any" else ())
        if x.dtype not in keep:
            x = x.astype(np.float32)  # the kernels compute in float32: a copy
    else:
        raise TypeError(f"{what}: unsupported dtype {x.dtype} (float32, float64, float16"
                        + (", bool" if kind == "mask" else "") + ")")
    if any(s < 0 for s in x.strides):
        x = np.ascontiguousarray(x)  # the library takes non-negative strides only
    return x


def _int64(x, what):
    """Integer array x (NumPy, torch or a sequence) as int64, refusing what int64 cannot hold
    (a uint64 above 2^63 - 1 would otherwise wrap to a negative number the library reports)."""
    a = x.detach().cpu().numpy() if _is_torch(x) else np.asarray(x)
    if a.dtype.kind not in "iu":
        return a  # the caller says what it wanted
    if a.dtype.kind == "u" and a.size and a.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{what}: {int(a.max())} does not fit in int64")
    return a.astype(np.int64, copy=False)


def _int64_list(x, what):
    """Integers x (a sequence, NumPy or torch array, any shape) as a flat list of Python ints;
    floats are refused rather than truncated."""
    a = _int64(x, what).reshape(-1)
    if a.size and a.dtype != np.int64:
        raise TypeError(f"{what}: integers expected, got {a.dtype}")
    return [int(v) for v in a]


_DTYPES = {np.dtype(np.float32): _capi.F32, np.dtype(np.float64): _capi.F64, np.dtype(np.float16): _capi.F16,
           np.dtype(np.bool_): _capi.BOOL, np.dtype(np.uint8): _capi.U8}


def _tensor(a):
    """An attn_tensor viewing NumPy array a (strides converted from bytes to elements),
    or a torch bfloat16 tensor (the one dtype kept as torch by _to_numpy)."""
    if a.ndim > _capi.MAX_RANK:
        raise ValueError(f"rank {a.ndim} exceeds {_capi.MAX_RANK}")
    t = _capi.Tensor()
    if _is_torch(a):
        t.data = a.data_ptr()
        t.dtype = _capi.BF16
        n = t.rank = a.ndim
        t.shape[:n] = tuple(a.shape)
        t.strides[:n] = a.stride()  # torch strides already count elements
        return t
    t.data = a.ctypes.data
    t.dtype = _DTYPES[a.dtype]
    n = t.rank = a.ndim
    item = a.itemsize
    strides = [s // item for s in a.strides]
    if any(s * item != b for s, b in zip(strides, a.strides)):
        raise ValueError(f"strides {a.strides} bytes are not multiples of the item size {item}")
    t.shape[:n] = a.shape  # a slice each: element by element cost more
    t.strides[:n] = strides
    return t


def _to4(a):
    """Prepend unit dimensions up to rank 4 (a view)."""
    if a.ndim < 2 or a.ndim > 4:
        raise ValueError(f"expected 2 to 4 dimensions, got shape {a.shape}")
    return a.reshape((1,) * (4 - a.ndim) + tuple(a.shape))


def _wrap(out, like_torch):
    if like_torch:
        import torch
        return torch.from_numpy(out)
    return out


def _stored_to_f32(t):
    """A float32 NumPy copy of attn_tensor t (f32, f16 or bf16, any strides), shape [shape[1:]]."""
    shape = tuple(t.shape[i] for i in range(t.rank))
    if any(n == 0 for n in shape):
        return np.zeros(shape[1:], np.float32)  # an empty row: its pointer need not be read
    ctype, npd = {_capi.F32: (ctypes.c_float, np.float32), _capi.F16: (ctypes.c_uint16, np.float16),
                  _capi.BF16: (ctypes.c_uint16, np.uint16)}[t.dtype]
    item = np.dtype(npd).itemsize
    span = 1 + sum((n - 1) * t.strides[i] for i, n in enumerate(shape))  # elements from the first to the last
    flat = np.ctypeslib.as_array(ctypes.cast(t.data, ctypes.POINTER(ctype)), (span,)).view(npd)
    a = np.lib.stride_tricks.as_strided(flat, shape, tuple(t.strides[i] * item for i in range(t.rank)))
    if t.dtype == _capi.BF16:  # bfloat16 is the top half of a float32
        return (a.astype(np.uint32) << 16).view(np.float32)[0]
    return a.astype(np.float32)[0]  # astype copies: the result outlives the cache's storage
