"""scaled_dot_product_attention and sdpa_backward, with torch autograd through them."""
import ctypes

import numpy as np

from . import _capi
from ._context import _ctx
from ._tensors import _int64, _is_torch, _tensor, _to4, _to_numpy, _wrap


_MASK_MODES = {"keep": _capi.MASK_KEEP, "masked": _capi.MASK_MASKED, "additive": _capi.MASK_ADDITIVE,
               "seed": _capi.MASK_SEED}


def _mask_mode(mode, m, bool_default):
    """The attn_mask_mode for mask array m: mode by name, else the default rule for its dtype."""
    if mode is None:
        return bool_default if m.dtype == np.bool_ else _capi.MASK_ADDITIVE
    if mode not in _MASK_MODES:
        raise ValueError(f"mask_mode must be one of {sorted(_MASK_MODES)}, got {mode!r}")
    return _MASK_MODES[mode]


def _cu_seqlens(o, keep, cu_q, cu_k):
    """A packed batch's offsets (int arrays of num_seqs + 1 entries, NumPy or torch) into o as int64."""
    if cu_q is None:
        if cu_k is not None:
            raise ValueError("cu_seqlens_k needs cu_seqlens_q (a packed batch)")
        return
    for attr, val in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if val is None:
            continue
        a = _int64(val, attr)
        if a.ndim != 1 or a.size < 1 or a.dtype != np.int64:
            raise TypeError(f"{attr} must be a 1-D integer array of num_seqs + 1 offsets, got {a.dtype} {a.shape}")
        a = np.ascontiguousarray(a)
        keep.append(a)
        setattr(o, attr, a.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)))
        if attr == "cu_seqlens_q":
            o.num_seqs = a.size - 1


def _model_options(o, keep, H, window=None, softcap=None, alibi=None, sinks=None, dropout_p=0.0, dropout_seed=None,
                   scale=None, chunk=None):
    """The options of recent models into attn_sdpa_opts o (H query heads): scale (None: the
    default or a model's), window, softcap, ALiBi slopes (True: the paper's), sinks [H], dropout
    (a random seed unless given), chunk; the arrays they point at go into keep."""
    if scale is not None:
        o.scale = float(scale)
    if window:
        o.window = int(window)
    if chunk:
        o.chunk = int(chunk)
    if softcap:
        o.softcap = float(softcap)
    for attr, val in (("alibi_slopes", alibi), ("sinks", sinks)):
        if val is None or val is False:
            continue
        if val is True:  # the ALiBi paper's slopes for this head count
            arr = np.empty(H, np.float32)
            _capi.lib.attn_alibi_slopes(arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), H)
        else:
            arr = np.ascontiguousarray(_to_numpy(val, attr, "float"), np.float32).reshape(-1)
        t = _tensor(arr)
        keep += [arr, t]
        setattr(o, attr, ctypes.pointer(t))
    if dropout_p:
        o.dropout_p = float(dropout_p)
        o.dropout_seed = (int(np.random.randint(0, 2**63, dtype=np.int64)) if dropout_seed is None
                          else int(dropout_seed))


class _SdpaCall:
    """Inputs of one attn_sdpa / attn_sdpa_backward call as 4-D views plus the options.

    q [..., L, D], k [..., S, D], v [..., S, Dv] with up to two leading dims; the
    views and ctypes structs in .keep must outlive the call. halves: pass
    float16/bfloat16 q, k, v through (the library widens them, or computes
    bfloat16 ones on its bf16 tiles)."""

    def __init__(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
                 causal_align, dropout_seed, mask_mode, halves=False, window=None, softcap=None, alibi=None,
                 sinks=None, cu_seqlens_q=None, cu_seqlens_k=None, q_offset=0, k_offset=0, head_offset=0,
                 chunk=None):
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
        _model_options(o, self.keep, self.H, window, softcap, alibi, sinks, dropout_p, dropout_seed, chunk=chunk)
        _cu_seqlens(o, self.keep, cu_seqlens_q, cu_seqlens_k)
        for attr, val in (("q_offset", q_offset), ("k_offset", k_offset), ("head_offset", head_offset)):
            # the library checks the range
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
                raise TypeError(f"{attr} must be an int, got {type(val).__name__}")
            if not -2 ** 63 <= int(val) < 2 ** 63:
                raise ValueError(f"{attr} {val} does not fit int64")
            setattr(o, attr, int(val))

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


def _sdpa_forward(c, want_weights, want_lse, threads, precision=None):
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
    x.set_precision(precision)
    x.check(_capi.lib.attn_sdpa(x.h, ctypes.byref(ot), lse_arg, weights_arg, ctypes.byref(qt), ctypes.byref(kt),
                                ctypes.byref(vt), ctypes.byref(c.opts)))
    return out, weights, lse


def _sdpa_backward(c, dout, out, lse, want_mask_grad, threads, precision=None, want_sinks_grad=False):
    """dq, dk, dv (4-D float32), the mask's gradient in the mask's own shape and the sinks'
    gradient [H] (each None unless wanted)."""
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
    dsinks = sg_arg = None
    if want_sinks_grad:
        if not c.opts.sinks:
            raise ValueError("a sinks gradient needs sinks")
        dsinks = np.empty(c.H, np.float32)
        sg_arg = c.out_ptr(dsinks)
    ts = [_tensor(a) for a in (dq, dk, dv, d4, c.q4, c.k4, c.v4, o4, l3)]
    x = _ctx()
    x.set_threads(threads)
    x.set_precision(precision)
    args = [ctypes.byref(t) for t in ts]
    x.check(_capi.lib.attn_sdpa_backward(x.h, *args[:3], mg_arg, sg_arg, *args[3:], ctypes.byref(c.opts)))
    dmask = None
    if mg is not None:
        dmask = np.ascontiguousarray(_unbroadcast(c.unbatch(mg), c.mask_shape), np.float32)
    return dq, dk, dv, dmask, dsinks


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
        def forward(fctx, q, k, v, attn_mask, sinks, kw):  # sinks: a tensor here only to get its gradient
            c = _SdpaCall(q, k, v, attn_mask, halves=True, **kw["call"])
            kw["call"]["dropout_seed"] = int(c.opts.dropout_seed)  # the backward regenerates the same dropout
            out, weights, lse = _sdpa_forward(c, kw["return_weights"], True, kw["threads"], kw["precision"])
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
            c = _SdpaCall(q, k, v, m, halves=True, **fctx.kw["call"])
            want_mg, want_sg = fctx.needs_input_grad[3], fctx.needs_input_grad[4]
            dq, dk, dv, dm, ds = _sdpa_backward(c, dout.contiguous(), o, l_, want_mg, fctx.kw["threads"],
                                                fctx.kw["precision"], want_sg)
            g = [torch.from_numpy(x.reshape(shp)) for x, shp in zip((dq, dk, dv), c.shapes)]
            g = [x.to(t.dtype) for x, t in zip(g, (q, k, v))]
            gm = torch.from_numpy(dm).to(m.dtype) if want_mg else None
            sinks = fctx.kw["call"]["sinks"]
            gs = torch.from_numpy(ds).reshape(sinks.shape).to(sinks.dtype) if want_sg else None
            return g[0], g[1], g[2], gm, gs, None

    _sdpa_fn = SdpaFunction
    return _sdpa_fn


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, key_padding_mask=None, causal_align="top-left",
                                 mask_mode=None, return_weights=False, return_lse=False, threads=None,
                                 dropout_seed=None, window=None, softcap=None, alibi=None, sinks=None,
                                 precision=None, cu_seqlens_q=None, cu_seqlens_k=None, q_offset=0, k_offset=0,
                                 head_offset=0, chunk=None):
    """Like torch.nn.functional.scaled_dot_product_attention, on CPU.

    q [..., L, D], k [..., S, D], v [..., S, Dv] with up to two leading dims
    ([B, H] or [H]). float32, float16 (NumPy or torch) and torch bfloat16
    inputs are read in place through their strides; float64 is cast to float32
    (a copy). precision (attn.h's attn_precision): None or 'default' computes
    bfloat16 inputs as PyTorch does (bf16 products, fp32 sums and softmax, the
    probabilities rounded to bf16 for p.v) where the CPU has AVX512-BF16, and
    everything else in fp32; 'fp32' widens every input; 'bf16' also rounds
    float32 inputs to bf16 (PyTorch's matmul precision "medium"), 'f16' to
    f16 (then computed as float16 inputs are). The backward
    pass (autograd) runs bfloat16 q, k and v on bf16 tiles too where the CPU
    has AMX, and float16 ones on its f16 tiles (exact f16 products, fp32 sums,
    P, dS and dout rounded to f16), else widens them to fp32; the gradients
    come back in q's dtype.
    The result is float32, a NumPy array or a torch tensor like q. Differences from PyTorch: a query
    row whose keys are all masked gives zeros, not NaN.
    attn_mask: bool (True = attend) or float (added to the logits),
    broadcastable to [..., L, S]. Library extras: key_padding_mask bool [B, S],
    True = ignore; causal_align 'top-left' (PyTorch's is_causal) or
    'bottom-right' (a KV cache); mask_mode 'keep', 'masked', 'additive' or
    'seed' (logits += mask * -1e9) to read attn_mask another way; dropout_seed
    makes dropout reproducible; window W (query i' sees keys i'-W < j <= i',
    causal implied), chunk C (Llama 4's chunked attention: query i' sees keys
    j <= i' with j // C == i' // C, causal implied), softcap C (logits C*tanh(logits/C)), alibi (True for the
    paper's slopes, or slopes [H]) and sinks (one logit per query head [H]).
    Packed variable-length batch (FlashAttention's varlen): cu_seqlens_q, int
    [num_seqs + 1] (NumPy or torch), 0 first, non-decreasing, total_q last;
    q [1, H, total_q, D] (or [H, total_q, D]) holds the sequences one after
    another, sequence s being rows cu_seqlens_q[s]:cu_seqlens_q[s+1]; keys the
    same way by cu_seqlens_k (default: cu_seqlens_q). Every option applies
    per sequence as if it were its own batch entry; attn_mask,
    key_padding_mask and return_weights are refused with it.
    q_offset, k_offset: the global positions of q's row 0 and k's key 0 when
    the call is a shard of a longer sequence (causal bound, window, ALiBi and
    dropout then count globally; see attn_mpi.h); head_offset: the global
    index of q's head 0 when the call is a shard of the heads (dropout's).
    torch tensors that require grad get a grad_fn: the backward pass is
    libattn's attn_sdpa_backward (q, k, v, a float attn_mask and sinks).
    Returns out, or a tuple (out, weights?, lse?) when return_weights/return_lse.
    """
    call = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                key_padding_mask=key_padding_mask, causal_align=causal_align, dropout_seed=dropout_seed,
                mask_mode=mask_mode, window=window, softcap=softcap, alibi=alibi, sinks=sinks,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, q_offset=q_offset, k_offset=k_offset,
                head_offset=head_offset, chunk=chunk)
    if _is_torch(q) and _wants_autograd(q, k, v, attn_mask, sinks):  # torch q: autograd saves tensors only
        res = _autograd_fn().apply(q, k, v, attn_mask, sinks if _is_torch(sinks) else None,
                                   dict(call=call, return_weights=return_weights, return_lse=return_lse,
                                        threads=threads, precision=precision))
        return res[0] if len(res) == 1 else res
    like_torch = _is_torch(q)
    c = _SdpaCall(q, k, v, attn_mask, halves=True, **call)
    out, weights, lse = _sdpa_forward(c, return_weights, return_lse, threads, precision)
    res = [_wrap(c.unbatch(out), like_torch)]
    if return_weights:
        res.append(_wrap(c.unbatch(weights), like_torch))
    if return_lse:
        res.append(_wrap(c.unbatch(lse), like_torch))
    return res[0] if len(res) == 1 else tuple(res)


def sdpa_backward(dout, q, k, v, out, lse, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, *, key_padding_mask=None, causal_align="top-left", mask_mode=None,
                  dropout_seed=None, return_mask_grad=False, threads=None, window=None, softcap=None, alibi=None,
                  sinks=None, cu_seqlens_q=None, cu_seqlens_k=None, precision=None, q_offset=0, k_offset=0,
                  head_offset=0, return_sinks_grad=False, chunk=None):
    """Gradients of a loss L through scaled_dot_product_attention, given dout = dL/dout.

    out and lse come from the forward call (return_lse=True) made with the same
    q, k, v and options (for dropout: the same dropout_p and dropout_seed).
    Returns (dq, dk, dv), then dmask with return_mask_grad (a float attn_mask's
    gradient, summed down to the mask's own shape), then dsinks [H] with
    return_sinks_grad (summed over batch and rows). float32, NumPy or torch
    like q. With grouped-query attention dk/dv sum over each group.
    window, chunk, softcap, alibi, sinks, cu_seqlens_q, cu_seqlens_k, q_offset, k_offset and head_offset as
    the forward's.
    torch bfloat16 q, k and v run on the bf16 backward tiles where the CPU has
    AMX (bf16 products, fp32 sums; precision='fp32' widens them instead), and
    float16 ones on its f16 tiles (exact f16 products, fp32 sums); the
    gradients are float32 either way.
    """
    if dropout_p and dropout_seed is None:
        raise ValueError("sdpa_backward with dropout needs the forward's dropout_seed")
    like_torch = _is_torch(q)
    c = _SdpaCall(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask, causal_align,
                  dropout_seed, mask_mode, halves=True, window=window, softcap=softcap, alibi=alibi,
                  sinks=sinks, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, q_offset=q_offset,
                  k_offset=k_offset, head_offset=head_offset, chunk=chunk)
    dq, dk, dv, dm, ds = _sdpa_backward(c, dout, out, lse, return_mask_grad, threads, precision, return_sinks_grad)
    res = [_wrap(x.reshape(shp), like_torch) for x, shp in zip((dq, dk, dv), c.shapes)]
    if return_mask_grad:
        res.append(_wrap(dm, like_torch))
    if return_sinks_grad:
        res.append(_wrap(ds, like_torch))
    return tuple(res)
