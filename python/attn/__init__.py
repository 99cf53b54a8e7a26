"""libattn for Python: exact attention on NumPy arrays and PyTorch CPU tensors.

The shared library is called through ctypes; inputs are passed as strided
views (no copy) whenever they are float32 with non-negative strides.
"""
import ctypes
import math
import threading

import numpy as np

from . import _capi
from ._capi import library_path

__all__ = ["AttnError", "scaled_dot_product_attention", "MultiheadAttention", "version", "library_path"]


class AttnError(RuntimeError):
    """A libattn call failed; .status is the attn_status code."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def version():
    return _capi.lib.attn_version_string().decode()


class _Ctx:
    def __init__(self):
        h = ctypes.c_void_p()
        st = _capi.lib.attn_ctx_create(ctypes.byref(h))
        if st != 0:
            raise AttnError(st, _capi.lib.attn_strerror(st).decode())
        self.h = h

    def check(self, st):
        if st != 0:
            msg = _capi.lib.attn_ctx_error(self.h).decode() or _capi.lib.attn_strerror(st).decode()
            raise AttnError(st, msg)

    def set_threads(self, threads):
        self.check(_capi.lib.attn_ctx_set_threads(self.h, 0 if threads is None else int(threads)))

    def __del__(self):
        h = getattr(self, "h", None)
        if h is not None and _capi is not None:
            _capi.lib.attn_ctx_destroy(h)
            self.h = None


# A context must not be used by two threads at once: one per Python thread.
_local = threading.local()


def _ctx():
    c = getattr(_local, "ctx", None)
    if c is None:
        c = _local.ctx = _Ctx()
    return c


# ---- conversion of inputs -----------------------------------------------------

def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


def _to_numpy(x, what, kind="float"):
    """A NumPy view of x (a copy only where the dtype or layout needs one).

    kind "float": q/k/v and float masks, result float32 (float64/float16 copied).
    kind "mask": bool kept as bool, floats as float32.
    """
    if _is_torch(x):
        if x.device.type != "cpu":
            raise TypeError(f"{what}: only CPU tensors are supported (got device {x.device})")
        if x.is_complex():
            raise TypeError(f"{what}: unsupported dtype {x.dtype}")
        x = x.detach()
        if x.dtype.is_floating_point and str(x.dtype) not in ("torch.float32", "torch.float64"):
            x = x.float()  # float16/bfloat16: NumPy has no bfloat16, so widen (a copy)
        x = x.numpy()
    elif not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.dtype == np.bool_ and kind == "mask":
        pass
    elif x.dtype in (np.float32, np.float64, np.float16):
        if x.dtype != np.float32:
            x = x.astype(np.float32)  # the kernels compute in float32: a copy
    else:
        raise TypeError(f"{what}: unsupported dtype {x.dtype} (float32, float64, float16"
                        + (", bool" if kind == "mask" else "") + ")")
    if not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    if any(s < 0 for s in x.strides):
        x = np.ascontiguousarray(x)  # the library takes non-negative strides only
    return x


def _tensor(a):
    """An attn_tensor viewing NumPy array a (strides converted from bytes to elements)."""
    if a.ndim > _capi.MAX_RANK:
        raise ValueError(f"rank {a.ndim} exceeds {_capi.MAX_RANK}")
    t = _capi.Tensor()
    t.data = a.ctypes.data
    t.dtype = {np.dtype(np.float32): _capi.F32, np.dtype(np.float64): _capi.F64,
               np.dtype(np.bool_): _capi.BOOL, np.dtype(np.uint8): _capi.U8}[a.dtype]
    t.rank = a.ndim
    item = a.itemsize
    for i, (n, s) in enumerate(zip(a.shape, a.strides)):
        if s % item:
            raise ValueError(f"stride {s} bytes is not a multiple of the item size {item}")
        t.shape[i] = n
        t.strides[i] = s // item
    return t


def _to4(a):
    """Prepend unit dimensions up to rank 4 (a view)."""
    if a.ndim < 2 or a.ndim > 4:
        raise ValueError(f"expected 2 to 4 dimensions, got shape {a.shape}")
    return a.reshape((1,) * (4 - a.ndim) + a.shape)


def _wrap(out, like_torch):
    if like_torch:
        import torch
        return torch.from_numpy(out)
    return out


# ---- scaled dot-product attention --------------------------------------------

def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, key_padding_mask=None, causal_align="top-left",
                                 return_weights=False, return_lse=False, threads=None, dropout_seed=None):
    """Like torch.nn.functional.scaled_dot_product_attention, on CPU.

    q [..., L, D], k [..., S, D], v [..., S, Dv] with up to two leading dims
    ([B, H] or [H]). float32 inputs are read in place through their strides;
    float64/float16 are cast to float32 (a copy). The result is float32, a
    NumPy array or a torch tensor like q. Differences from PyTorch: a query
    row whose keys are all masked gives zeros, not NaN.
    attn_mask: bool (True = attend) or float (added to the logits),
    broadcastable to [..., L, S]. key_padding_mask: bool [B, S], True = ignore.
    causal_align: 'top-left' (PyTorch's is_causal) or 'bottom-right' (a KV cache).
    Returns out, or a tuple (out, weights?, lse?) when return_weights/return_lse.
    """
    like_torch = _is_torch(q)
    qa, ka, va = (_to_numpy(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    batch = qa.shape[:-2]
    L, S = qa.shape[-2], ka.shape[-2]
    q4, k4, v4 = _to4(qa), _to4(ka), _to4(va)
    if q4.shape[1] != k4.shape[1] and not enable_gqa:
        raise ValueError(f"q has {q4.shape[1]} heads and k {k4.shape[1]}: pass enable_gqa=True for grouped-query attention")
    B, H = q4.shape[0], q4.shape[1]
    Dv = v4.shape[3]

    opts = _capi.SdpaOpts()
    _capi.lib.attn_sdpa_opts_init(ctypes.byref(opts))
    if scale is not None:
        opts.scale = float(scale)
    if is_causal:
        opts.causal = {"top-left": _capi.CAUSAL_TOP_LEFT, "bottom-right": _capi.CAUSAL_BOTTOM_RIGHT}.get(causal_align)
        if opts.causal is None:
            raise ValueError("causal_align must be 'top-left' or 'bottom-right'")
    keep = []  # arrays and structs that must outlive the call
    if attn_mask is not None:
        m = _to_numpy(attn_mask, "attn_mask", "mask")
        m = _to4(np.broadcast_to(m, batch + (L, S)))  # stride 0 along broadcast dims
        mt = _tensor(m)
        keep += [m, mt]
        opts.mask = ctypes.pointer(mt)
        opts.mask_mode = _capi.MASK_KEEP if m.dtype == np.bool_ else _capi.MASK_ADDITIVE
    if key_padding_mask is not None:
        kp = _to_numpy(key_padding_mask, "key_padding_mask", "mask")
        if kp.dtype != np.bool_:
            raise TypeError("key_padding_mask must be bool (True = ignore that key)")
        kpt = _tensor(kp)
        keep += [kp, kpt]
        opts.key_padding = ctypes.pointer(kpt)
    if dropout_p:
        opts.dropout_p = float(dropout_p)
        opts.dropout_seed = int(np.random.randint(0, 2**63, dtype=np.int64)) if dropout_seed is None else int(dropout_seed)

    out = np.empty((B, H, L, Dv), np.float32)
    ot = _tensor(out)
    weights = lse = None
    if return_weights:
        weights = np.empty((B, H, L, S), np.float32)
        wt = _tensor(weights)
        keep.append(wt)
        opts.weights = ctypes.pointer(wt)
    if return_lse:
        lse = np.empty((B, H, L), np.float32)
        lt = _tensor(lse)
        keep.append(lt)
        opts.lse = ctypes.pointer(lt)
    qt, kt, vt = _tensor(q4), _tensor(k4), _tensor(v4)
    c = _ctx()
    c.set_threads(threads)
    c.check(_capi.lib.attn_sdpa(c.h, ctypes.byref(ot), ctypes.byref(qt), ctypes.byref(kt), ctypes.byref(vt),
                                ctypes.byref(opts)))
    res = [_wrap(out.reshape(batch + (L, Dv)), like_torch)]
    if return_weights:
        res.append(_wrap(weights.reshape(batch + (L, S)), like_torch))
    if return_lse:
        res.append(_wrap(lse.reshape(batch + (L,)), like_torch))
    return res[0] if len(res) == 1 else tuple(res)


# ---- the layer ---------------------------------------------------------------

class MultiheadAttention:
    """Inference counterpart of torch.nn.MultiheadAttention (no dropout, no bias_k/bias_v).

    Parameters start at zero: load them with load_state_dict (PyTorch names
    in_proj_weight, in_proj_bias, q/k/v_proj_weight, out_proj.weight,
    out_proj.bias; or the seed's wq/wk/wv/dense .weight/.bias) or build the
    layer with from_safetensors.
    """

    def __init__(self, embed_dim, num_heads, bias=True, kdim=None, vdim=None, batch_first=False,
                 num_kv_heads=None, *, threads=None, _handle=None):
        self._ctx = _Ctx()  # one context per layer, guarded by a lock
        self._lock = threading.Lock()
        self._h = None
        self._ctx.set_threads(threads)
        if _handle is None:
            cfg = _capi.MhaConfig()
            _capi.lib.attn_mha_config_init(ctypes.byref(cfg), int(embed_dim), int(num_heads))
            cfg.num_kv_heads = int(num_kv_heads or 0)
            cfg.kdim = int(kdim or 0)
            cfg.vdim = int(vdim or 0)
            cfg.bias = 1 if bias else 0
            h = ctypes.c_void_p()
            self._ctx.check(_capi.lib.attn_mha_create(self._ctx.h, ctypes.byref(h), ctypes.byref(cfg)))
            self._h = h
        else:
            self._h = _handle
        cfg = _capi.lib.attn_mha_get_config(self._h).contents
        self.embed_dim, self.num_heads = cfg.embed_dim, cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads or cfg.num_heads
        self.kdim, self.vdim = cfg.kdim or cfg.embed_dim, cfg.vdim or cfg.embed_dim
        self.bias = bool(cfg.bias)
        self.batch_first = batch_first

    @classmethod
    def from_safetensors(cls, path, num_heads, prefix="", *, num_kv_heads=None, batch_first=False, threads=None):
        c = _Ctx()
        h = ctypes.c_void_p()
        c.check(_capi.lib.attn_mha_create_from_safetensors(c.h, ctypes.byref(h), str(path).encode(),
                                                           prefix.encode(), int(num_heads), int(num_kv_heads or 0)))
        return cls(0, num_heads, batch_first=batch_first, threads=threads, _handle=h)

    def load_state_dict(self, state_dict):
        with self._lock:
            for name, value in state_dict.items():
                a = np.ascontiguousarray(_to_numpy(value, name))
                t = _tensor(a)
                self._ctx.check(_capi.lib.attn_mha_set_param(self._ctx.h, self._h, name.encode(), ctypes.byref(t)))

    def _batch_major(self, x, what):
        a = _to_numpy(x, what)
        if a.ndim == 2:
            return a[None], True
        if a.ndim != 3:
            raise ValueError(f"{what}: expected 2 or 3 dimensions, got shape {a.shape}")
        return (a if self.batch_first else a.transpose(1, 0, 2)), False  # a view, no copy

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        like_torch = _is_torch(query)
        q, unbatched = self._batch_major(query, "query")
        k, _ = self._batch_major(key, "key")
        v, _ = self._batch_major(value, "value")
        B, L, S, H = q.shape[0], q.shape[1], k.shape[1], self.num_heads
        opts = _capi.MhaOpts()
        _capi.lib.attn_mha_opts_init(ctypes.byref(opts))
        keep = []
        masks = []  # additive float masks to combine, [B or 1, H or 1, L or 1, S]
        if attn_mask is not None:
            m = _to_numpy(attn_mask, "attn_mask", "mask")
            if m.ndim == 3:  # PyTorch's [B*H, L, S]
                m = m.reshape(B, H, L, S)
            m = _to4(m)
            masks.append(m)
        elif is_causal:
            opts.causal = _capi.CAUSAL_TOP_LEFT  # PyTorch's hint: the mask, if given, is the causal one
        if key_padding_mask is not None:
            kp = _to_numpy(key_padding_mask, "key_padding_mask", "mask")
            if kp.ndim == 1:
                kp = kp[None]
            if kp.dtype == np.bool_:
                kpt = _tensor(kp)
                keep += [kp, kpt]
                opts.key_padding = ctypes.pointer(kpt)
            else:  # a float key padding mask is additive: fold it into the mask
                masks.append(kp[:, None, None, :])
        if len(masks) == 1:
            m = masks[0]
        elif len(masks) == 2:
            # both present: materialise one additive mask (bool True = masked out)
            f = [np.where(x, np.float32(-np.inf), np.float32(0)) if x.dtype == np.bool_ else x for x in masks]
            m = (f[0] + f[1]).astype(np.float32)
        if masks:
            mt = _tensor(m)
            keep += [m, mt]
            opts.mask = ctypes.pointer(mt)
            opts.mask_mode = _capi.MASK_MASKED if m.dtype == np.bool_ else _capi.MASK_ADDITIVE
        weights = None
        if need_weights:
            weights = np.empty((B, L, S) if average_attn_weights else (B, H, L, S), np.float32)
            wt = _tensor(weights)
            keep.append(wt)
            opts.weights = ctypes.pointer(wt)
            opts.average_weights = 1 if average_attn_weights else 0
        out = np.empty((B, L, self.embed_dim) if self.batch_first or unbatched else (L, B, self.embed_dim), np.float32)
        ob = out if self.batch_first or unbatched else out.transpose(1, 0, 2)
        ot, qt, kt, vt = _tensor(ob), _tensor(q), _tensor(k), _tensor(v)
        with self._lock:
            self._ctx.check(_capi.lib.attn_mha_forward(self._ctx.h, self._h, ctypes.byref(ot), ctypes.byref(qt),
                                                       ctypes.byref(kt), ctypes.byref(vt), ctypes.byref(opts)))
        if unbatched:
            out = out[0]
            if weights is not None:
                weights = weights[0]
        return _wrap(out, like_torch), (None if weights is None else _wrap(weights, like_torch))

    __call__ = forward

    def __del__(self):
        h = getattr(self, "_h", None)
        if h is not None and _capi is not None:
            _capi.lib.attn_mha_destroy(h)
            self._h = None
