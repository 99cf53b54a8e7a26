"""libattn for Python: exact attention on NumPy arrays and PyTorch CPU tensors.

The shared library is called through ctypes; inputs are passed as strided
views (no copy) whenever they are float32 with non-negative strides, and so
are the float16/bfloat16 q, k, v of the forward pass and of the KV cache.
"""
import ctypes
import threading

import numpy as np

from . import _capi
from ._capi import library_path

__all__ = ["AttnError", "scaled_dot_product_attention", "sdpa_backward", "MultiheadAttention", "KVCache",
           "plot_attention", "version", "library_path"]


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
    if not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    if any(s < 0 for s in x.strides):
        x = np.ascontiguousarray(x)  # the library takes non-negative strides only
    return x


def _tensor(a):
    """An attn_tensor viewing NumPy array a (strides converted from bytes to elements),
    or a torch bfloat16 tensor (the one dtype kept as torch by _to_numpy)."""
    if a.ndim > _capi.MAX_RANK:
        raise ValueError(f"rank {a.ndim} exceeds {_capi.MAX_RANK}")
    t = _capi.Tensor()
    if _is_torch(a):
        t.data = a.data_ptr()
        t.dtype = _capi.BF16
        t.rank = a.ndim
        for i, (n, s) in enumerate(zip(a.shape, a.stride())):  # torch strides already count elements
            t.shape[i] = n
            t.strides[i] = s
        return t
    t.data = a.ctypes.data
    t.dtype = {np.dtype(np.float32): _capi.F32, np.dtype(np.float64): _capi.F64, np.dtype(np.float16): _capi.F16,
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
    return a.reshape((1,) * (4 - a.ndim) + tuple(a.shape))


def _wrap(out, like_torch):
    if like_torch:
        import torch
        return torch.from_numpy(out)
    return out


# ---- scaled dot-product attention --------------------------------------------

_MASK_MODES = {"keep": _capi.MASK_KEEP, "masked": _capi.MASK_MASKED, "additive": _capi.MASK_ADDITIVE,
               "seed": _capi.MASK_SEED}


def _mask_mode(mode, m, bool_default):
    """The attn_mask_mode for mask array m: mode by name, else the default rule for its dtype."""
    if mode is None:
        return bool_default if m.dtype == np.bool_ else _capi.MASK_ADDITIVE
    if mode not in _MASK_MODES:
        raise ValueError(f"mask_mode must be one of {sorted(_MASK_MODES)}, got {mode!r}")
    return _MASK_MODES[mode]


class _SdpaCall:
    """Inputs of one attn_sdpa / attn_sdpa_backward call as 4-D views plus the options.

    q [..., L, D], k [..., S, D], v [..., S, Dv] with up to two leading dims; the
    views and ctypes structs in .keep must outlive the call. halves: pass
    float16/bfloat16 q, k, v through (the forward widens them; the backward
    takes float32 only)."""

    def __init__(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
                 causal_align, dropout_seed, mask_mode, halves=False, window=None, softcap=None, alibi=None,
                 sinks=None):
        kind = "half" if halves else "float"
        qa, ka, va = (_to_numpy(x, n, kind) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        self.batch = tuple(qa.shape[:-2])
        self.shapes = (tuple(qa.shape), tuple(ka.shape), tuple(va.shape))  # gradients come back in these
        self.L, self.S = qa.shape[-2], ka.shape[-2]
        self.q4, self.k4, self.v4 = _to4(qa), _to4(ka), _to4(va)
        if self.q4.shape[1] != self.k4.shape[1] and not enable_gqa:
            raise ValueError(f"q has {self.q4.shape[1]} heads and k {self.k4.shape[1]}: "
                             "pass enable_gqa=True for grouped-query attention")
        self.B, self.H = self.q4.shape[0], self.q4.shape[1]
        self.Dv = self.v4.shape[3]
        o = self.opts = _capi.SdpaOpts()
        _capi.init(o)
        if scale is not None:
            o.scale = float(scale)
        if is_causal:
            o.causal = {"top-left": _capi.CAUSAL_TOP_LEFT, "bottom-right": _capi.CAUSAL_BOTTOM_RIGHT}.get(causal_align)
            if o.causal is None:
                raise ValueError("causal_align must be 'top-left' or 'bottom-right'")
        self.keep = []
        self.mask_shape = None
        if attn_mask is not None:
            m = _to_numpy(attn_mask, "attn_mask", "mask")
            self.mask_shape = m.shape
            m = _to4(np.broadcast_to(m, self.batch + (self.L, self.S)))  # stride 0 along broadcast dims
            mt = _tensor(m)
            self.keep += [m, mt]
            o.mask = ctypes.pointer(mt)
            o.mask_mode = _mask_mode(mask_mode, m, _capi.MASK_KEEP)
        if key_padding_mask is not None:
            kp = _to_numpy(key_padding_mask, "key_padding_mask", "mask")
            if kp.dtype != np.bool_:
                raise TypeError("key_padding_mask must be bool (True = ignore that key)")
            kpt = _tensor(kp)
            self.keep += [kp, kpt]
            o.key_padding = ctypes.pointer(kpt)
        # the options of recent models (attn_sdpa_opts): window, softcap, ALiBi slopes, sinks
        if window:
            o.window = int(window)
        if softcap:
            o.softcap = float(softcap)
        for attr, val in (("alibi_slopes", alibi), ("sinks", sinks)):
            if val is None or val is False:
                continue
            if val is True:  # the ALiBi paper's slopes for this head count
                arr = np.empty(self.H, np.float32)
                _capi.lib.attn_alibi_slopes(arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), self.H)
            else:
                arr = np.ascontiguousarray(_to_numpy(val, attr, "float"), np.float32).reshape(-1)
            t = _tensor(arr)
            self.keep += [arr, t]
            setattr(o, attr, ctypes.pointer(t))
        if dropout_p:
            o.dropout_p = float(dropout_p)
            o.dropout_seed = (int(np.random.randint(0, 2**63, dtype=np.int64)) if dropout_seed is None
                              else int(dropout_seed))

    def out_ptr(self, a):
        """An optional output argument viewing array a (kept alive with this call)."""
        t = _tensor(a)
        self.keep += [a, t]
        return ctypes.byref(t)

    def unbatch(self, a):
        """[B, H, ...] back to the caller's leading dims."""
        return a.reshape(self.batch + a.shape[2:])


def _unbroadcast(g, shape):
    """Sum g (the broadcast shape) down to shape, numpy's broadcasting rules in reverse."""
    g = g.sum(axis=tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def _sdpa_forward(c, want_weights, want_lse, threads):
    out = np.empty((c.B, c.H, c.L, c.Dv), np.float32)
    weights = lse = weights_arg = lse_arg = None
    if want_weights:
        weights = np.empty((c.B, c.H, c.L, c.S), np.float32)
        weights_arg = c.out_ptr(weights)
    if want_lse:
        lse = np.empty((c.B, c.H, c.L), np.float32)
        lse_arg = c.out_ptr(lse)
    ot, qt, kt, vt = _tensor(out), _tensor(c.q4), _tensor(c.k4), _tensor(c.v4)
    x = _ctx()
    x.set_threads(threads)
    x.check(_capi.lib.attn_sdpa(x.h, ctypes.byref(ot), lse_arg, weights_arg, ctypes.byref(qt), ctypes.byref(kt),
                                ctypes.byref(vt), ctypes.byref(c.opts)))
    return out, weights, lse


def _sdpa_backward(c, dout, out, lse, want_mask_grad, threads):
    """dq, dk, dv (4-D float32) and the mask's gradient in the mask's own shape (or None)."""
    d4 = _to4(_to_numpy(dout, "dout"))
    o4 = _to4(_to_numpy(out, "out"))
    l = _to_numpy(lse, "lse")
    l3 = l.reshape((1,) * (3 - l.ndim) + l.shape) if l.ndim <= 3 else l
    dq = np.empty(c.q4.shape, np.float32)
    dk = np.empty(c.k4.shape, np.float32)
    dv = np.empty(c.v4.shape, np.float32)
    mg = mg_arg = None
    if want_mask_grad:
        if c.mask_shape is None or c.opts.mask_mode != _capi.MASK_ADDITIVE:
            raise ValueError("a mask gradient needs a float (additive) attn_mask")
        mg = np.empty((c.B, c.H, c.L, c.S), np.float32)
        mg_arg = c.out_ptr(mg)
    ts = [_tensor(a) for a in (dq, dk, dv, d4, c.q4, c.k4, c.v4, o4, l3)]
    x = _ctx()
    x.set_threads(threads)
    args = [ctypes.byref(t) for t in ts]
    x.check(_capi.lib.attn_sdpa_backward(x.h, *args[:3], mg_arg, None, *args[3:], ctypes.byref(c.opts)))
    dmask = None
    if mg is not None:
        dmask = np.ascontiguousarray(_unbroadcast(c.unbatch(mg), c.mask_shape), np.float32)
    return dq, dk, dv, dmask


def _wants_autograd(*xs):
    if not any(_is_torch(x) for x in xs if x is not None):
        return False
    import torch
    return torch.is_grad_enabled() and any(_is_torch(x) and x.requires_grad for x in xs if x is not None)


_sdpa_fn = None


def _autograd_fn():
    """torch.autograd.Function over attn_sdpa / attn_sdpa_backward (made on first use: torch is optional)."""
    global _sdpa_fn
    if _sdpa_fn is not None:
        return _sdpa_fn
    import torch

    class SdpaFunction(torch.autograd.Function):
        @staticmethod
        def forward(fctx, q, k, v, attn_mask, kw):
            c = _SdpaCall(q, k, v, attn_mask, halves=True, **kw["call"])
            kw["call"]["dropout_seed"] = int(c.opts.dropout_seed)  # the backward regenerates the same dropout
            out, weights, lse = _sdpa_forward(c, kw["return_weights"], True, kw["threads"])
            o = torch.from_numpy(c.unbatch(out))
            l_ = torch.from_numpy(c.unbatch(lse))
            fctx.save_for_backward(q, k, v, attn_mask if torch.is_tensor(attn_mask) else None, o, l_)
            fctx.kw = kw
            fctx.np_mask = None if torch.is_tensor(attn_mask) else attn_mask
            fctx.mark_non_differentiable(l_)
            res = [o]
            if kw["return_weights"]:
                w = torch.from_numpy(c.unbatch(weights))
                fctx.mark_non_differentiable(w)
                res.append(w)
            if kw["return_lse"]:
                res.append(l_)
            return tuple(res)

        @staticmethod
        def backward(fctx, dout, *unused):
            q, k, v, m, o, l_ = fctx.saved_tensors
            m = fctx.np_mask if m is None else m
            c = _SdpaCall(q, k, v, m, **fctx.kw["call"])
            want_mg = fctx.needs_input_grad[3]
            dq, dk, dv, dm = _sdpa_backward(c, dout.contiguous(), o, l_, want_mg, fctx.kw["threads"])
            g = [torch.from_numpy(x.reshape(shp)) for x, shp in zip((dq, dk, dv), c.shapes)]
            g = [x.to(t.dtype) for x, t in zip(g, (q, k, v))]
            gm = torch.from_numpy(dm).to(m.dtype) if want_mg else None
            return g[0], g[1], g[2], gm, None

    _sdpa_fn = SdpaFunction
    return _sdpa_fn


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, key_padding_mask=None, causal_align="top-left",
                                 mask_mode=None, return_weights=False, return_lse=False, threads=None,
                                 dropout_seed=None, window=None, softcap=None, alibi=None, sinks=None):
    """Like torch.nn.functional.scaled_dot_product_attention, on CPU.

    q [..., L, D], k [..., S, D], v [..., S, Dv] with up to two leading dims
    ([B, H] or [H]). float32, float16 (NumPy or torch) and torch bfloat16
    inputs are read in place through their strides (halves are widened inside
    the library); float64 is cast to float32 (a copy). The backward pass takes
    float32, so halves that require grad are widened for it. The result is float32, a
    NumPy array or a torch tensor like q. Differences from PyTorch: a query
    row whose keys are all masked gives zeros, not NaN.
    attn_mask: bool (True = attend) or float (added to the logits),
    broadcastable to [..., L, S]. Library extras: key_padding_mask bool [B, S],
    True = ignore; causal_align 'top-left' (PyTorch's is_causal) or
    'bottom-right' (a KV cache); mask_mode 'keep', 'masked', 'additive' or
    'seed' (logits += mask * -1e9) to read attn_mask another way; dropout_seed
    makes dropout reproducible; window W (query i' sees keys i'-W < j <= i',
    causal implied), softcap C (logits C*tanh(logits/C)), alibi (True for the
    paper's slopes, or slopes [H]) and sinks (one logit per query head [H]).
    torch tensors that require grad get a grad_fn: the backward pass is
    libattn's attn_sdpa_backward (q, k, v and a float attn_mask).
    Returns out, or a tuple (out, weights?, lse?) when return_weights/return_lse.
    """
    call = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                key_padding_mask=key_padding_mask, causal_align=causal_align, dropout_seed=dropout_seed,
                mask_mode=mask_mode, window=window, softcap=softcap, alibi=alibi, sinks=sinks)
    if _wants_autograd(q, k, v, attn_mask):
        res = _autograd_fn().apply(q, k, v, attn_mask, dict(call=call, return_weights=return_weights,
                                                            return_lse=return_lse, threads=threads))
        return res[0] if len(res) == 1 else res
    like_torch = _is_torch(q)
    c = _SdpaCall(q, k, v, attn_mask, halves=True, **call)
    out, weights, lse = _sdpa_forward(c, return_weights, return_lse, threads)
    res = [_wrap(c.unbatch(out), like_torch)]
    if return_weights:
        res.append(_wrap(c.unbatch(weights), like_torch))
    if return_lse:
        res.append(_wrap(c.unbatch(lse), like_torch))
    return res[0] if len(res) == 1 else tuple(res)


def sdpa_backward(dout, q, k, v, out, lse, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, *, key_padding_mask=None, causal_align="top-left", mask_mode=None,
                  dropout_seed=None, return_mask_grad=False, threads=None):
    """Gradients of a loss L through scaled_dot_product_attention, given dout = dL/dout.

    out and lse come from the forward call (return_lse=True) made with the same
    q, k, v and options (for dropout: the same dropout_p and dropout_seed).
    Returns (dq, dk, dv), or (dq, dk, dv, dmask) with return_mask_grad (a float
    attn_mask's gradient, summed down to the mask's own shape). float32, NumPy
    or torch like q. With grouped-query attention dk/dv sum over each group.
    """
    if dropout_p and dropout_seed is None:
        raise ValueError("sdpa_backward with dropout needs the forward's dropout_seed")
    like_torch = _is_torch(q)
    c = _SdpaCall(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask, causal_align,
                  dropout_seed, mask_mode)
    dq, dk, dv, dm = _sdpa_backward(c, dout, out, lse, return_mask_grad, threads)
    res = [_wrap(x.reshape(shp), like_torch) for x, shp in zip((dq, dk, dv), c.shapes)]
    if return_mask_grad:
        res.append(_wrap(dm, like_torch))
    return tuple(res)


# ---- the KV cache --------------------------------------------------------------

_CACHE_DTYPES = {"float32": _capi.F32, "float16": _capi.F16, "bfloat16": _capi.BF16}


def _cache_dtype(dtype):
    """'float32'/'float16'/'bfloat16' (or numpy/torch dtypes that print so) to an attn_dtype."""
    name = str(dtype).replace("torch.", "")
    if name not in _CACHE_DTYPES:
        raise ValueError(f"KV cache dtype must be one of {sorted(_CACHE_DTYPES)}, got {dtype!r}")
    return _CACHE_DTYPES[name]


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


class KVCache:
    """Keys and values of past tokens for incremental decoding (attn_kv_cache).

    batch rows, each holding up to capacity tokens of kv_heads heads; keys have
    head_dim features, values v_head_dim (default head_dim). dtype is the
    storage: 'float32', 'float16' or 'bfloat16' (rounded to nearest even on
    append, widened to float32 on attend). Use append() then attend() each
    step; close() (or a with block) frees the storage now rather than at
    garbage collection. Errors raise AttnError with the library's message;
    a failed append changes nothing.
    """

    def __init__(self, batch, capacity, kv_heads, head_dim, v_head_dim=None, dtype="float32", *, threads=None):
        self._ctx = _Ctx()  # one context per cache, guarded by a lock (calls on a context must not overlap)
        self._lock = threading.Lock()
        self._h = None
        self._ctx.set_threads(threads)
        cfg = _capi.KvCacheConfig()
        _capi.init(cfg, int(batch), int(capacity), int(kv_heads), int(head_dim))
        cfg.v_head_dim = int(v_head_dim or 0)
        cfg.dtype = _cache_dtype(dtype)
        h = ctypes.c_void_p()
        self._ctx.check(_capi.lib.attn_kv_cache_create(self._ctx.h, ctypes.byref(h), ctypes.byref(cfg)))
        self._h = h
        c = _capi.lib.attn_kv_cache_get_config(h).contents  # Dv resolved by the library
        self.batch, self.capacity, self.kv_heads = c.batch, c.capacity, c.kv_heads
        self.head_dim, self.v_head_dim = c.head_dim, c.v_head_dim
        self.dtype = {v: k for k, v in _CACHE_DTYPES.items()}[c.dtype]

    def _handle(self):
        if self._h is None:
            raise ValueError("the KV cache is closed")
        return self._h

    @property
    def lengths(self):
        """The tokens each row holds now, a tuple of batch ints."""
        h = self._handle()
        return tuple(int(_capi.lib.attn_kv_cache_length(h, b)) for b in range(self.batch))

    def append(self, k, v, n_new=None):
        """Appends the next tokens: k [B, Hk, n, D], v [B, Hk, n, Dv] (NumPy or torch
        CPU, any float dtype and strides, read in place). Row b takes its first
        n_new[b] tokens (default all n). If a row would pass its capacity nothing
        is appended."""
        ka, va = _to_numpy(k, "k", "any"), _to_numpy(v, "v", "any")
        kt, vt = _tensor(ka), _tensor(va)
        nn = None
        if n_new is not None:
            n = [int(x) for x in np.asarray(n_new).reshape(-1)]
            if len(n) != self.batch:
                raise ValueError(f"n_new has {len(n)} entries for {self.batch} rows")
            nn = (ctypes.c_int64 * self.batch)(*n)
        with self._lock:
            self._ctx.check(_capi.lib.attn_kv_cache_append(self._ctx.h, self._handle(), ctypes.byref(kt),
                                                           ctypes.byref(vt), nn))

    def attend(self, q, scale=None, return_lse=False):
        """Attention of new queries over every cached token of their row.

        q [B, Hq, Nq, D] (float32, float16 or torch bfloat16 read in place;
        Hq a multiple of Hk): query i of row b is the token at position
        len_b - Nq + i (append first). Returns out [B, Hq, Nq, Dv] float32,
        NumPy or torch like q, and with return_lse also lse [B, Hq, Nq]."""
        like_torch = _is_torch(q)
        qa = _to_numpy(q, "q", "half")
        if qa.ndim != 4:
            raise ValueError(f"q must be [B, Hq, Nq, D], got shape {tuple(qa.shape)}")
        B, Hq, Nq = (int(n) for n in qa.shape[:3])
        out = np.empty((B, Hq, Nq, self.v_head_dim), np.float32)
        o = _capi.SdpaOpts()
        _capi.init(o)
        if scale is not None:
            o.scale = float(scale)
        lse = lt = None
        if return_lse:
            lse = np.empty((B, Hq, Nq), np.float32)
            lt = _tensor(lse)
        ot, qt = _tensor(out), _tensor(qa)
        with self._lock:
            self._ctx.check(_capi.lib.attn_kv_cache_attend(self._ctx.h, self._handle(), ctypes.byref(ot),
                                                           None if lt is None else ctypes.byref(lt),
                                                           ctypes.byref(qt), ctypes.byref(o)))
        if return_lse:
            return _wrap(out, like_torch), _wrap(lse, like_torch)
        return _wrap(out, like_torch)

    def truncate(self, length, row=None):
        """Rollback: row (None: every row) keeps its first length tokens."""
        with self._lock:
            self._ctx.check(_capi.lib.attn_kv_cache_truncate(self._ctx.h, self._handle(),
                                                             -1 if row is None else int(row), int(length)))

    def copy_row(self, dst, src):
        """Beam search: row dst becomes a copy of row src (tokens and length)."""
        with self._lock:
            self._ctx.check(_capi.lib.attn_kv_cache_copy_row(self._ctx.h, self._handle(), int(dst), int(src)))

    def reset(self):
        """Empties every row (the storage is kept)."""
        self.truncate(0)

    def _row(self, row):
        kt, vt = _capi.Tensor(), _capi.Tensor()
        with self._lock:
            self._ctx.check(_capi.lib.attn_kv_cache_view(self._ctx.h, ctypes.byref(kt), ctypes.byref(vt),
                                                         self._handle(), int(row)))
            return _stored_to_f32(kt), _stored_to_f32(vt)  # copied under the lock: the views die on append

    def keys(self, row):
        """A float32 NumPy copy of row's stored keys, [Hk, len_row, D] (as rounded to the storage dtype)."""
        return self._row(row)[0]

    def values(self, row):
        """A float32 NumPy copy of row's stored values, [Hk, len_row, Dv]."""
        return self._row(row)[1]

    def close(self):
        with self._lock:
            if self._h is not None:
                _capi.lib.attn_kv_cache_destroy(self._h)
                self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        h = getattr(self, "_h", None)
        if h is not None and _capi is not None:
            _capi.lib.attn_kv_cache_destroy(h)
            self._h = None


# ---- the layer ---------------------------------------------------------------

class MultiheadAttention:
    """Counterpart of torch.nn.MultiheadAttention (no dropout, no bias_k/bias_v).

    forward builds no autograd graph (inputs are read as plain arrays); the
    gradients come from grad(), which runs libattn's backward pass.

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
            _capi.init(cfg, int(embed_dim), int(num_heads))
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

    def _opts(self, B, L, S, key_padding_mask, attn_mask, is_causal, mask_mode):
        """attn_mha_opts for the masks of one call, and the arrays/structs it points to."""
        H = self.num_heads
        opts = _capi.MhaOpts()
        _capi.init(opts)
        keep = []
        masks = []  # additive float masks to combine, [B or 1, H or 1, L or 1, S]
        if attn_mask is not None:
            m = _to_numpy(attn_mask, "attn_mask", "mask")
            if m.ndim == 3:  # PyTorch's [B*H, L, S]
                m = m.reshape(B, H, L, S)
            m = _to4(m)
            masks.append(m)
        elif is_causal:
            opts.attn.causal = _capi.CAUSAL_TOP_LEFT  # PyTorch's hint: the mask, if given, is the causal one
        if key_padding_mask is not None:
            kp = _to_numpy(key_padding_mask, "key_padding_mask", "mask")
            if kp.ndim == 1:
                kp = kp[None]
            if kp.dtype == np.bool_:
                kpt = _tensor(kp)
                keep += [kp, kpt]
                opts.attn.key_padding = ctypes.pointer(kpt)
            else:  # a float key padding mask is additive: fold it into the mask
                masks.append(kp[:, None, None, :])
        if mask_mode is not None and len(masks) != 1:
            raise ValueError("mask_mode needs attn_mask (and no float key_padding_mask)")
        if len(masks) == 1:
            m = masks[0]
        elif len(masks) == 2:
            # both present: materialise one additive mask (bool True = masked out)
            f = [np.where(x, np.float32(-np.inf), np.float32(0)) if x.dtype == np.bool_ else x for x in masks]
            m = (f[0] + f[1]).astype(np.float32)
        if masks:
            mt = _tensor(m)
            keep += [m, mt]
            opts.attn.mask = ctypes.pointer(mt)
            opts.attn.mask_mode = _mask_mode(mask_mode, m, _capi.MASK_MASKED)
        return opts, keep

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False, *, mask_mode=None):
        """As torch.nn.MultiheadAttention.forward: returns (out, weights or None).

        Library extra: mask_mode ('masked', 'keep', 'additive', 'seed') reads
        attn_mask another way than PyTorch's rule (bool True = masked out,
        float added); 'seed' is the seed module's logits += mask * -1e9."""
        like_torch = _is_torch(query)
        q, unbatched = self._batch_major(query, "query")
        k, _ = self._batch_major(key, "key")
        v, _ = self._batch_major(value, "value")
        B, L, S, H = q.shape[0], q.shape[1], k.shape[1], self.num_heads
        opts, keep = self._opts(B, L, S, key_padding_mask, attn_mask, is_causal, mask_mode)
        weights = wt = None
        if need_weights:
            weights = np.empty((B, L, S) if average_attn_weights else (B, H, L, S), np.float32)
            wt = _tensor(weights)
            keep.append(wt)
            opts.average_weights = 1 if average_attn_weights else 0
        out = np.empty((B, L, self.embed_dim) if self.batch_first or unbatched else (L, B, self.embed_dim), np.float32)
        ob = out if self.batch_first or unbatched else out.transpose(1, 0, 2)
        ot, qt, kt, vt = _tensor(ob), _tensor(q), _tensor(k), _tensor(v)
        with self._lock:
            self._ctx.check(_capi.lib.attn_mha_forward(self._ctx.h, self._h, ctypes.byref(ot),
                                                       None if wt is None else ctypes.byref(wt), ctypes.byref(qt),
                                                       ctypes.byref(kt), ctypes.byref(vt), ctypes.byref(opts)))
        if unbatched:
            out = out[0]
            if weights is not None:
                weights = weights[0]
        return _wrap(out, like_torch), (None if weights is None else _wrap(weights, like_torch))

    __call__ = forward

    def _user_layout(self, shape_bm, unbatched):
        """A float32 array in the caller's layout and its batch-major [B, N, F] view."""
        B, N, Fd = shape_bm
        if self.batch_first or unbatched:
            a = np.empty((B, N, Fd), np.float32)
            return a, a
        a = np.empty((N, B, Fd), np.float32)
        return a, a.transpose(1, 0, 2)

    def new_cache(self, batch, capacity, dtype="float32", *, threads=None):
        """A KVCache for forward_cached: this layer's kv heads and head dim, batch rows of capacity tokens."""
        return KVCache(batch, capacity, self.num_kv_heads, self.embed_dim // self.num_heads, dtype=dtype,
                       threads=threads)

    def forward_cached(self, x, cache):
        """Incremental causal self-attention (decoding) through a KVCache.

        x holds the next n tokens of every row, in the layer's layout: [B, n, E]
        with batch_first, else [n, B, E] (and [n, E] for one row). Their keys and
        values are appended to cache (from new_cache(B, ...)), then their queries
        attend over the whole row. Returns out like x (same layout, float32,
        NumPy or torch). Token by token this equals forward() with a causal mask
        over the whole sequence. If the step fails the cache is left as it was."""
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be an attn.KVCache, got {type(cache).__name__}")
        like_torch = _is_torch(x)
        xb, unbatched = self._batch_major(x, "x")
        B, n = xb.shape[0], xb.shape[1]
        out, ob = self._user_layout((B, n, self.embed_dim), unbatched)
        opts = _capi.MhaOpts()
        _capi.init(opts)
        ot, xt = _tensor(ob), _tensor(xb)
        # layer lock, then cache lock: KVCache methods take only the latter, so no cycle
        with self._lock, cache._lock:
            self._ctx.check(_capi.lib.attn_mha_forward_cached(self._ctx.h, self._h, cache._handle(), ctypes.byref(ot),
                                                              ctypes.byref(xt), ctypes.byref(opts)))
        return _wrap(out[0] if unbatched else out, like_torch)

    decode_step = forward_cached

    def _packed_in_proj(self):
        """Whether PyTorch would pack this configuration's Q/K/V weights into in_proj_weight."""
        return self.kdim == self.embed_dim and self.vdim == self.embed_dim and self.num_kv_heads == self.num_heads

    def grad(self, query, key, value, grad_output, key_padding_mask=None, attn_mask=None, is_causal=False, *,
             mask_mode=None):
        """Gradients of a loss L through forward(query, key, value, ...), given grad_output = dL/dout.

        Runs the forward pass again (attn_mha_forward_save), then attn_mha_backward.
        Returns a dict: 'query', 'key', 'value' (input gradients, in the inputs'
        layout; with key and value the very same object as query, self-attention,
        only 'query', the whole gradient), and every parameter's under PyTorch's
        names (in_proj_weight or q/k/v_proj_weight, in_proj_bias, out_proj.weight,
        out_proj.bias). NumPy or torch like query.
        """
        like_torch = _is_torch(query)
        self_attn = key is query and value is query
        q, unbatched = self._batch_major(query, "query")
        k, _ = self._batch_major(key, "key")
        v, _ = self._batch_major(value, "value")
        g, _ = self._batch_major(grad_output, "grad_output")
        B, L, S = q.shape[0], q.shape[1], k.shape[1]
        opts, keep = self._opts(B, L, S, key_padding_mask, attn_mask, is_causal, mask_mode)
        out = np.empty((B, L, self.embed_dim), np.float32)
        dq, dqb = self._user_layout(q.shape, unbatched)
        dk = dkb = dv = dvb = None
        if not self_attn:
            dk, dkb = self._user_layout(k.shape, unbatched)
            dv, dvb = self._user_layout(v.shape, unbatched)
        ts = [_tensor(a) for a in (out, q, k, v, g, dqb)]
        dkt = None if dkb is None else _tensor(dkb)
        dvt = None if dvb is None else _tensor(dvb)
        ref = lambda t: None if t is None else ctypes.byref(t)  # noqa: E731
        c = self._ctx
        grads = ctypes.c_void_p()
        saved = ctypes.c_void_p()
        with self._lock:
            try:
                c.check(_capi.lib.attn_mha_create(c.h, ctypes.byref(grads), _capi.lib.attn_mha_get_config(self._h)))
                c.check(_capi.lib.attn_mha_forward_save(c.h, self._h, ref(ts[0]), None, ctypes.byref(saved),
                                                        ref(ts[1]), None if self_attn else ref(ts[2]),
                                                        None if self_attn else ref(ts[3]), ctypes.byref(opts)))
                c.check(_capi.lib.attn_mha_backward(c.h, self._h, ref(ts[5]), ref(dkt), ref(dvt), grads, saved,
                                                    ref(ts[4])))
                p = {}
                for which in range(8):
                    t = _capi.Tensor()
                    if _capi.lib.attn_mha_param_view(c.h, ctypes.byref(t), grads, which) != 0:
                        continue  # a bias of a layer without biases
                    n = int(np.prod([t.shape[i] for i in range(t.rank)]))
                    flat = np.ctypeslib.as_array(ctypes.cast(t.data, ctypes.POINTER(ctypes.c_float)), (n,))
                    p[which] = flat.reshape([t.shape[i] for i in range(t.rank)]).copy()
            finally:
                if saved:
                    _capi.lib.attn_mha_saved_free(saved)
                if grads:
                    _capi.lib.attn_mha_destroy(grads)
        res = {"query": dq[0] if unbatched else dq}
        if not self_attn:
            res["key"] = dk[0] if unbatched else dk
            res["value"] = dv[0] if unbatched else dv
        P = _capi
        if self._packed_in_proj():
            res["in_proj_weight"] = np.concatenate([p[P.MHA_Q_WEIGHT], p[P.MHA_K_WEIGHT], p[P.MHA_V_WEIGHT]])
        else:
            res["q_proj_weight"], res["k_proj_weight"], res["v_proj_weight"] = (
                p[P.MHA_Q_WEIGHT], p[P.MHA_K_WEIGHT], p[P.MHA_V_WEIGHT])
        if P.MHA_Q_BIAS in p:
            res["in_proj_bias"] = np.concatenate([p[P.MHA_Q_BIAS], p[P.MHA_K_BIAS], p[P.MHA_V_BIAS]])
            res["out_proj.bias"] = p[P.MHA_O_BIAS]
        res["out_proj.weight"] = p[P.MHA_O_WEIGHT]
        return {n: _wrap(a, like_torch) for n, a in res.items()}

    def __del__(self):
        h = getattr(self, "_h", None)
        if h is not None and _capi is not None:
            _capi.lib.attn_mha_destroy(h)
            self._h = None


# ---- plots -------------------------------------------------------------------

def plot_attention(weights, tokens=None, *, key_tokens=None, heads=None, cmap="viridis", ncols=None,
                   vmin=0.0, vmax=None, title=None):
    """A matplotlib Figure with one heatmap per head and a shared colour bar.

    weights: [H, Nq, Nk], [1, H, Nq, Nk] or [Nq, Nk] (NumPy or torch), e.g.
    MultiheadAttention(..., need_weights=True, average_attn_weights=False)'s.
    tokens label the query axis (and the key axis unless key_tokens is given).
    heads: the head indices to draw (default all). vmax None = the largest weight.
    """
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("attn.plot_attention needs matplotlib (pip install matplotlib)") from e
    w = np.asarray(_to_numpy(weights, "weights"), np.float32)
    if w.ndim == 4 and w.shape[0] == 1:
        w = w[0]
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3:
        raise ValueError(f"weights must be [H, Nq, Nk], [1, H, Nq, Nk] or [Nq, Nk], got shape {w.shape}")
    H, Nq, Nk = w.shape
    heads = list(range(H)) if heads is None else [int(h) for h in heads]
    for h in heads:
        if not 0 <= h < H:
            raise ValueError(f"head {h} out of range 0..{H - 1}")
    qt = None if tokens is None else [str(t) for t in tokens]
    kt = qt if key_tokens is None else [str(t) for t in key_tokens]
    if qt is not None and len(qt) != Nq:
        raise ValueError(f"{len(qt)} tokens for {Nq} queries")
    if kt is not None and len(kt) != Nk:
        raise ValueError(f"{len(kt)} key tokens for {Nk} keys")
    ncols = ncols or min(len(heads), 4)
    nrows = (len(heads) + ncols - 1) // ncols
    vmax = float(w.max()) if vmax is None else vmax
    fig = Figure(figsize=(3.2 * ncols + 1, 3.2 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    im = None
    for i, ax in enumerate(axes.flat):
        if i >= len(heads):
            ax.set_axis_off()
            continue
        h = heads[i]
        im = ax.imshow(w[h], cmap=matplotlib.colormaps[cmap] if hasattr(matplotlib, "colormaps") else cmap,
                       vmin=vmin, vmax=vmax, interpolation="nearest", aspect="auto")
        ax.set_title(f"head {h}")
        if kt is not None:
            ax.set_xticks(range(Nk), kt, rotation=90, fontsize=7)
        if qt is not None:
            ax.set_yticks(range(Nq), qt, fontsize=7)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    if title:
        fig.suptitle(title)
    return fig
