"""Rotary position embeddings and QK-norm (attn.h's attn_rope, attn_head_norm) on NumPy arrays and torch tensors."""
import ctypes

import numpy as np

from . import _capi
from ._context import _ctx
from ._tensors import _int64, _is_torch, _tensor, _to4, _to_numpy, _wrap


def rope_opts(rotary_dim=None, layout="half", theta=10000.0, scaling=None, factor=1.0, original_max_position=None,
              low_freq_factor=1.0, high_freq_factor=4.0, beta_fast=32.0, beta_slow=1.0, attention_factor=None,
              seq_len=None, position_offset=0, transpose=False, yarn_truncate=True, short_factor=None,
              long_factor=None):
    """An attn_rope_opts from attn.rope's keywords (positions aside)."""
    if layout not in _capi.ROPE_LAYOUTS:
        raise ValueError(f"layout must be 'half' or 'interleaved', got {layout!r}")
    if scaling not in _capi.ROPE_SCALINGS:
        raise ValueError(f"scaling must be None, 'linear', 'dynamic', 'llama3', 'yarn' or 'longrope', got {scaling!r}")
    o = _capi.init(_capi.RopeOpts())
    o.rotary_dim = int(rotary_dim or 0)
    o.layout = _capi.ROPE_LAYOUTS[layout]
    o.theta = float(theta)
    o.scaling = _capi.ROPE_SCALINGS[scaling]
    o.factor = float(factor)
    o.original_max_position = int(original_max_position or 0)
    o.low_freq_factor, o.high_freq_factor = float(low_freq_factor), float(high_freq_factor)
    o.beta_fast, o.beta_slow = float(beta_fast), float(beta_slow)
    o.attention_factor = float("nan") if attention_factor is None else float(attention_factor)
    o.seq_len = int(seq_len or 0)
    o.position_offset = int(position_offset)
    o.transpose = 1 if transpose else 0
    o.yarn_truncate = 1 if yarn_truncate else 0
    for name, f in (("short_factor", short_factor), ("long_factor", long_factor)):
        if f is None:
            continue
        f = np.asarray(f, np.float64).ravel()
        if f.size > _capi.ROPE_MAX_PAIRS:
            raise ValueError(f"{name}: at most {_capi.ROPE_MAX_PAIRS} rotary pairs, got {f.size}")
        getattr(o, name)[:f.size] = f.tolist()
    return o


def positions_into(o, positions, B, N):
    """o.positions = positions ([B, N] or [N] integers) as a contiguous int64 [B, N] array, which
    is returned: the caller keeps it alive for the call. None: left unset (offset + 0..N-1)."""
    if positions is None:
        return None
    p = _int64(positions, "positions")
    if p.dtype != np.int64:
        raise TypeError(f"positions: integers expected, got {p.dtype}")
    try:
        pos = np.ascontiguousarray(np.broadcast_to(p, (B, N)))
    except ValueError:
        raise ValueError(f"positions must be [{B}, {N}] or [{N}] (x's rows and tokens), got shape {p.shape}") from None
    o.positions = pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))
    return pos


def rope(x, positions=None, *, threads=None, **kw):
    """Rotary position embeddings of x [..., N, D] (up to two leading dims, [B, H] or [H]), as
    Hugging Face's apply_rotary_pos_emb computes them, with angles in float64.

    positions: [B, N] or [N] integer positions (default position_offset + 0..N-1).
    rotary_dim: the first rotary_dim dims rotate (partial rotary; default D).
    layout: 'half' (GPT-NeoX, Llama: rotate_half) or 'interleaved' (GPT-J).
    theta: the base (rope_theta).
    scaling: None, 'linear', 'dynamic', 'llama3' or 'yarn', with the config's fields
    (factor, original_max_position = original_max_position_embeddings, low/high_freq_factor,
    beta_fast/slow, attention_factor, yarn_truncate = truncate (False: the ramp's band is not rounded
    out to whole pairs, as gpt-oss), short_factor and long_factor for 'longrope' (one per rotary pair;
    long when the largest position + 1, or seq_len, passes original_max_position); seq_len for
    'dynamic' and 'longrope', default the largest position + 1).
    transpose=True applies the transposed rotation (the gradient of the rotation).
    Returns a float32 array or tensor like x."""
    o = rope_opts(**kw)
    like_torch = _is_torch(x)
    xa = _to_numpy(x, "x", kind="half")
    x4 = _to4(xa)
    B, _, N, _ = x4.shape
    out = np.empty(x4.shape, np.float32)
    pos = positions_into(o, positions, B, N)
    ot, xt = _tensor(out), _tensor(x4)
    c = _ctx()
    c.set_threads(threads)
    c.check(_capi.lib.attn_rope(c.h, ctypes.byref(ot), ctypes.byref(xt), ctypes.byref(o)))
    return _wrap(out.reshape(xa.shape), like_torch)


_NORM_KINDS = {"rms": 0, "rms_plus_one": 1, "layer": 2}


def head_norm(x, weight, bias=None, *, kind="rms", eps=1e-6, threads=None):
    """QK-norm of x [..., N, F] (up to two leading dims) over its last dim: kind 'rms'
    (Qwen3, OLMo 2), 'rms_plus_one' (Gemma: x * (1 + weight)) or 'layer' (LayerNorm, bias
    optional); weight and bias [F]. Statistics in float64. Returns float32 like x."""
    if kind not in _NORM_KINDS:
        raise ValueError(f"kind must be one of {sorted(_NORM_KINDS)}, got {kind!r}")
    like_torch = _is_torch(x)
    xa = _to_numpy(x, "x", kind="half")
    x4 = _to4(xa)
    out = np.empty(x4.shape, np.float32)
    w = np.ascontiguousarray(_to_numpy(weight, "weight"), np.float32)
    b = None if bias is None else np.ascontiguousarray(_to_numpy(bias, "bias"), np.float32)
    ot, xt, wt = _tensor(out), _tensor(x4), _tensor(w)
    bt = None if b is None else ctypes.byref(_tensor(b))
    c = _ctx()
    c.set_threads(threads)
    c.check(_capi.lib.attn_head_norm(c.h, ctypes.byref(ot), ctypes.byref(xt), ctypes.byref(wt), bt,
                                     _NORM_KINDS[kind], float(eps)))
    return _wrap(out.reshape(xa.shape), like_torch)
