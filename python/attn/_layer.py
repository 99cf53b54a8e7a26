"""MultiheadAttention: the counterpart of torch.nn.MultiheadAttention."""
import ctypes
import operator
import threading

import numpy as np

from . import _capi
from ._cache import KVCache
from ._context import _Ctx
from ._rope import positions_into, rope_opts
from ._sdpa import _cu_seqlens, _mask_mode, _model_options
from ._tensors import _is_torch, _tensor, _to4, _to_numpy, _wrap


def _packed_call(cu_seqlens, query, key, value, need_weights):
    """The layer's own rules for a packed batch, checked before any work (the
    library checks the offsets and the single batch row)."""
    if cu_seqlens is None:
        return
    if key is not query or value is not query:
        raise ValueError("cu_seqlens: a packed batch is self-attention: pass the same object as query, key and value")
    if need_weights:
        raise ValueError("cu_seqlens: a packed batch has no weights matrix: pass need_weights=False")


class MultiheadAttention:
    """Counterpart of torch.nn.MultiheadAttention (its positional arguments too; no
    add_bias_kv or add_zero_attn, CPU and float32 parameters only).

    dropout, as torch's, drops attention probabilities in forward() and grad()
    while the layer is training (train(), the default; eval() turns it off),
    with a fresh seed per call unless dropout_seed is given; forward_cached()
    never drops.

    forward builds no autograd graph (inputs are read as plain arrays); the
    gradients come from grad(), which runs libattn's backward pass.

    Parameters start at zero: load them with load_state_dict (PyTorch names
    in_proj_weight, in_proj_bias, q/k/v_proj_weight, out_proj.weight,
    out_proj.bias; or the seed's wq/wk/wv/dense .weight/.bias) or build the
    layer with from_safetensors; state_dict() reads them back.

    Real checkpoints' shapes: head_dim (None: embed_dim // num_heads; the
    heads then span num_heads * head_dim features, q_proj [H*D, E] and
    out_proj [E, H*D]); out_bias (None: as bias) whether the out projection
    has a bias apart from q/k/v's; qk_norm ('per_head': weights [D] shared by
    the heads, as Qwen3 and Gemma 3; 'whole': over the whole projection,
    [H*D] and [Hk*D], as OLMo 2; 'each_head': over each head's D features with
    its own weights, [H, D] and [Hk, D], as Cohere) normalises q and k after their projection
    and before RoPE, by qk_norm_kind 'rms', 'rms_plus_one' (Gemma: 1 + w) or
    'layer' (with biases) with qk_norm_eps. Its parameters are "q_norm.weight",
    "k_norm.weight" (and "q_norm.bias", "k_norm.bias" for 'layer'), starting
    as the identity (weights 1, or 0 for rms_plus_one; biases 0). sinks=True
    gives the layer learned attention sinks (gpt-oss): parameter "sinks" [H],
    one logit per head joining each row's softmax, used by every forward and
    differentiated by grad(); the sinks= keyword of a call then must be None.
    clip_qkv (OLMo's; None or > 0) clamps q, k and v to [-clip_qkv, clip_qkv]
    after their projections (and QK-norm), before RoPE, in every forward; the
    gradient passes where a value lay within the bounds, as torch.clamp's.
    """

    _QK_NORM = {None: _capi.QK_NORM_NONE, "per_head": _capi.QK_NORM_PER_HEAD, "whole": _capi.QK_NORM_WHOLE,
                "each_head": _capi.QK_NORM_EACH_HEAD}
    _NORM_KIND = {"rms": _capi.NORM_RMS, "rms_plus_one": _capi.NORM_RMS_PLUS_ONE, "layer": _capi.NORM_LAYER}
    # QK-norm's parameters by name (attn_mha_param_view: read and written here, not by name in the library)
    _NORM_PARAMS = {"q_norm.weight": _capi.MHA_Q_NORM_WEIGHT, "q_norm.bias": _capi.MHA_Q_NORM_BIAS,
                    "k_norm.weight": _capi.MHA_K_NORM_WEIGHT, "k_norm.bias": _capi.MHA_K_NORM_BIAS}

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None, num_kv_heads=None, *,
                 head_dim=None, out_bias=None, qk_norm=None, qk_norm_kind="rms", qk_norm_eps=1e-6, sinks=False,
                 clip_qkv=None, threads=None, _handle=None):
        if add_bias_kv or add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported")
        if device is not None and str(device) != "cpu":
            raise ValueError(f"device must be the CPU, got {device!r}")
        if dtype is not None and str(dtype).replace("torch.", "") != "float32":
            raise ValueError(f"parameters are float32 (inputs may be half precision), got dtype {dtype!r}")
        if not 0 <= float(dropout) <= 1:
            raise ValueError(f"dropout must be in [0, 1], got {dropout!r}")
        self.dropout = float(dropout)
        self.training = True
        self._ctx = _Ctx()  # one context per layer, guarded by a lock
        self._lock = threading.Lock()
        self._h = None
        self._hf = None  # attn_hf_layer of a layer from_hf: its model's options
        self._ctx.set_threads(threads)
        if _handle is None:
            cfg = _capi.MhaConfig()
            _capi.init(cfg, operator.index(embed_dim), operator.index(num_heads))
            cfg.num_kv_heads = operator.index(num_kv_heads or 0)
            cfg.kdim = operator.index(kdim or 0)
            cfg.vdim = operator.index(vdim or 0)
            cfg.bias = 1 if bias else 0
            cfg.head_dim = operator.index(head_dim or 0)
            cfg.out_bias = -1 if out_bias is None else (1 if out_bias else 0)
            if qk_norm not in self._QK_NORM:
                raise ValueError(f"qk_norm must be None, 'per_head', 'whole' or 'each_head', got {qk_norm!r}")
            if qk_norm_kind not in self._NORM_KIND:
                raise ValueError(f"qk_norm_kind must be 'rms', 'rms_plus_one' or 'layer', got {qk_norm_kind!r}")
            cfg.qk_norm = self._QK_NORM[qk_norm]
            cfg.qk_norm_kind = self._NORM_KIND[qk_norm_kind]
            cfg.qk_norm_eps = float(qk_norm_eps)
            cfg.sinks = 1 if sinks else 0
            cfg.clip_qkv = 0.0 if clip_qkv is None else float(clip_qkv)
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
        self.head_dim = cfg.head_dim or cfg.embed_dim // cfg.num_heads
        self.out_bias = bool(cfg.out_bias) if cfg.out_bias >= 0 else self.bias
        self.qk_norm = {v: k for k, v in self._QK_NORM.items()}[cfg.qk_norm]
        self.qk_norm_kind = {v: k for k, v in self._NORM_KIND.items()}[cfg.qk_norm_kind]
        self.qk_norm_eps = cfg.qk_norm_eps
        self.has_sinks = bool(cfg.sinks)
        self.clip_qkv = cfg.clip_qkv or None
        self.batch_first = batch_first

    def __repr__(self):
        norm = (f", qk_norm={self.qk_norm!r}, qk_norm_kind={self.qk_norm_kind!r}, qk_norm_eps={self.qk_norm_eps}"
                if self.qk_norm else "")
        drop = f", dropout={self.dropout}" if self.dropout else ""
        return (f"MultiheadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}{drop}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, kdim={self.kdim}, vdim={self.vdim}, "
                f"bias={self.bias}, out_bias={self.out_bias}{norm}{', sinks=True' if self.has_sinks else ''}"
                f"{f', clip_qkv={self.clip_qkv}' if self.clip_qkv else ''}, "
                f"batch_first={self.batch_first})")

    def train(self, mode=True):
        """Training mode (dropout on, as the layer was built with it); returns the layer."""
        self.training = bool(mode)
        return self

    def eval(self):
        """Inference mode (no dropout); returns the layer."""
        return self.train(False)

    def _dropout_p(self, dropout_p):
        """A call's dropout probability: its own, else the layer's while training."""
        if dropout_p is not None:
            return dropout_p
        return self.dropout if self.training else 0.0

    # from_safetensors' names keys, each a parameter of the layer
    _NAME_KEYS = {"q": _capi.MHA_Q_WEIGHT, "k": _capi.MHA_K_WEIGHT, "v": _capi.MHA_V_WEIGHT, "o": _capi.MHA_O_WEIGHT,
                  "q_bias": _capi.MHA_Q_BIAS, "k_bias": _capi.MHA_K_BIAS, "v_bias": _capi.MHA_V_BIAS,
                  "o_bias": _capi.MHA_O_BIAS, "q_norm": _capi.MHA_Q_NORM_WEIGHT, "k_norm": _capi.MHA_K_NORM_WEIGHT,
                  "q_norm_bias": _capi.MHA_Q_NORM_BIAS, "k_norm_bias": _capi.MHA_K_NORM_BIAS, "sinks": _capi.MHA_SINKS}

    @classmethod
    def from_safetensors(cls, path, num_heads, prefix="", *, num_kv_heads=None, head_dim=None, names=None,
                         layout="linear", qk_norm_kind="rms", qk_norm_eps=None, clip_qkv=None, batch_first=False,
                         threads=None):
        """The layer under prefix in a safetensors file (attn_mha_create_from_tensors).

        Sizes (embed_dim, H*D, kv rows, kdim, vdim, biases, QK-norm's scope, learned sinks) are
        read off the tensors' shapes; num_heads, num_kv_heads (None: num_heads),
        head_dim (None: q rows / num_heads), qk_norm_kind ("rms", "rms_plus_one"
        or "layer"), qk_norm_eps (None: the library's 1e-6) and clip_qkv (None:
        none) are what a file cannot say. names=None detects the family (PyTorch, Llama/Qwen/Gemma/OLMo/gpt-oss,
        BERT, ViT, DistilBERT, GPT-2, T5, the seed). Otherwise a dict of tensor
        names under prefix: "q", "k", "v", "o" (required) and optionally "q_bias",
        "k_bias", "v_bias", "o_bias", "q_norm", "k_norm", "q_norm_bias",
        "k_norm_bias", "sinks"; keys given the same name are one tensor holding the q, k,
        v rows in turn (like in_proj_weight). layout="conv1d" (with names): the
        weights are stored [in, out], as GPT-2's Conv1D.
        """
        if layout not in ("linear", "conv1d"):
            raise ValueError(f"layout must be 'linear' or 'conv1d', got {layout!r}")
        if qk_norm_kind not in cls._NORM_KIND:
            raise ValueError(f"qk_norm_kind must be one of {sorted(cls._NORM_KIND)}, got {qk_norm_kind!r}")
        nm = None
        if names is not None:
            unknown = sorted(set(names) - set(cls._NAME_KEYS))
            if unknown:
                raise ValueError(f"names: unknown keys {unknown}; known: {sorted(cls._NAME_KEYS)}")
            missing = [k for k in ("q", "k", "v", "o") if not names.get(k)]
            if missing:
                raise ValueError(f"names: every weight needs a tensor name; missing {missing}")
            nm = _capi.MhaNames()
            nm.size = ctypes.sizeof(nm)
            for key, which in cls._NAME_KEYS.items():
                if names.get(key) is not None:
                    nm.name[which] = str(names[key]).encode()  # ctypes keeps the bytes with nm
            nm.conv1d = 1 if layout == "conv1d" else 0
        elif layout != "linear":
            raise ValueError("layout applies to a names map; a detected family knows its own layout")
        like = _capi.MhaConfig()
        _capi.init(like, 0, operator.index(num_heads))
        like.num_kv_heads = operator.index(num_kv_heads or 0)
        like.head_dim = operator.index(head_dim or 0)
        like.qk_norm_kind = cls._NORM_KIND[qk_norm_kind]
        if qk_norm_eps is not None:
            like.qk_norm_eps = float(qk_norm_eps)
        if clip_qkv is not None:
            like.clip_qkv = float(clip_qkv)
        c = _Ctx()
        st = ctypes.c_void_p()
        c.check(_capi.lib.attn_safetensors_open(c.h, ctypes.byref(st), str(path).encode()))
        h = ctypes.c_void_p()
        try:
            c.check(_capi.lib.attn_mha_create_from_tensors(c.h, ctypes.byref(h), st, str(prefix or "").encode(),
                                                           ctypes.byref(nm) if nm is not None else None,
                                                           ctypes.byref(like)))
        finally:
            _capi.lib.attn_safetensors_close(st)
        return cls(0, num_heads, batch_first=batch_first, threads=threads, _handle=h)

    @classmethod
    def from_hf(cls, path, layer, *, weights=None, batch_first=True, threads=None):
        """Layer `layer` of a Hugging Face checkpoint as saved (attn_mha_create_from_hf).

        path: the model's folder (config.json, and model.safetensors or a sharded
        checkpoint's model.safetensors.index.json), or its config.json with the
        weights' file in weights. The family's prefix is found, the config's
        heads, kv heads, head_dim and QK-norm shape the layer, and its options
        for that layer (scale, sliding window, chunk, softcap, RoPE) become forward's
        and forward_cached's defaults (new_cache gives the cache the RoPE). The
        input is the layer's input after its norm, batch-first by default; pass
        is_causal=True for a decoder, and positions for RoPE other than 0..N-1.
        """
        import os
        path = os.fspath(path)
        config = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if weights is None:
            folder = os.path.dirname(config)
            index = os.path.join(folder, "model.safetensors.index.json")
            weights = index if os.path.exists(index) else os.path.join(folder, "model.safetensors")
        info = _capi.HfLayer()
        c = _Ctx()
        h = ctypes.c_void_p()
        c.check(_capi.lib.attn_mha_create_from_hf(c.h, ctypes.byref(h), ctypes.byref(info), config.encode(),
                                                  os.fspath(weights).encode(), int(layer)))
        if info.size != ctypes.sizeof(info):
            _capi.lib.attn_mha_destroy(h)
            raise RuntimeError(f"attn_hf_layer is {info.size} bytes in the library, {ctypes.sizeof(info)} here")
        cfg = _capi.lib.attn_mha_get_config(h).contents
        self = cls(0, cfg.num_heads, batch_first=batch_first, threads=threads, _handle=h)
        self._hf = info
        return self

    @property
    def hf_options(self):
        """The options from_hf read for this layer (None for other layers): prefix, naming, scale, window,
        chunk, softcap, rope (a dict of attn.rope's keywords, or None)."""
        i = self._hf
        if i is None:
            return None
        rope = None
        if i.has_rope:
            r = i.rope
            names = {v: k for k, v in _capi.ROPE_SCALINGS.items()}
            rope = dict(theta=r.theta, rotary_dim=r.rotary_dim or None,
                        layout={v: k for k, v in _capi.ROPE_LAYOUTS.items()}[r.layout], scaling=names[r.scaling],
                        factor=r.factor, original_max_position=r.original_max_position or None)
            if rope["scaling"] == "yarn":
                rope["yarn_truncate"] = bool(r.yarn_truncate)
            if rope["scaling"] == "longrope":
                n = (r.rotary_dim or self.head_dim) // 2
                rope.update(short_factor=list(r.short_factor[:n]), long_factor=list(r.long_factor[:n]))
        return dict(prefix=i.prefix.decode(), naming=int(i.naming), model_type=i.config.model_type.decode(),
                    scale=i.scale, window=i.window, chunk=i.chunk, softcap=i.softcap, rope=rope)

    def _hf_defaults(self, opts, keep, B, L, positions, rope, cached=False):
        """A from_hf layer's own options into opts, before the caller's: RoPE (unless rope is given,
        or the step is cached: the cache holds it) at positions."""
        if self._hf is None:
            return
        if self._hf.config.relative_bias and not opts.attn.mask:
            raise ValueError(f"model_type {self._hf.config.model_type.decode()!r} adds a relative position bias, "
                             "which libattn does not compute: pass it as attn_mask (additive, [H, N, N] or [B, H, N, N])")
        _capi.lib.attn_hf_layer_opts(ctypes.byref(self._hf), ctypes.byref(opts))
        opts.rope = None
        if rope is None and self._hf.has_rope and not cached:
            ro = _capi.RopeOpts.from_buffer_copy(self._hf.rope)
            keep += [ro, positions_into(ro, positions, B, L)]
            opts.rope = ctypes.pointer(ro)

    def load_state_dict(self, state_dict):
        with self._lock:
            for name, value in state_dict.items():
                a = np.ascontiguousarray(_to_numpy(value, name))
                if name in self._NORM_PARAMS:
                    self._set_norm_param(name, a)
                    continue
                t = _tensor(a)
                self._ctx.check(_capi.lib.attn_mha_set_param(self._ctx.h, self._h, name.encode(), ctypes.byref(t)))

    @staticmethod
    def _params_of(c, h):
        """{attn_mha_param: float32 NumPy view} of every parameter layer h has (views of its storage)."""
        p = {}
        for which in range(_capi.MHA_NUM_PARAMS):
            t = _capi.Tensor()
            if _capi.lib.attn_mha_param_view(c.h, ctypes.byref(t), h, which) != 0:
                continue  # absent: a bias of a layer without it, or QK-norm's
            shape = [t.shape[i] for i in range(t.rank)]
            flat = np.ctypeslib.as_array(ctypes.cast(t.data, ctypes.POINTER(ctypes.c_float)), (int(np.prod(shape)),))
            p[which] = flat.reshape(shape)
        return p

    def _set_norm_param(self, name, a):
        p = self._params_of(self._ctx, self._h).get(self._NORM_PARAMS[name])
        if p is None:
            raise KeyError(f"{name}: this layer has no such parameter (qk_norm={self.qk_norm!r}, "
                           f"qk_norm_kind={self.qk_norm_kind!r})")
        if a.shape != p.shape:
            raise ValueError(f"{name} must have shape {tuple(p.shape)}, got {tuple(a.shape)}")
        p[...] = a.astype(np.float32)

    def _named(self, p):
        """The parameters p ({attn_mha_param: array}) under PyTorch's names (and QK-norm's)."""
        P = _capi
        res = {}
        if self._packed_in_proj():
            res["in_proj_weight"] = np.concatenate([p[P.MHA_Q_WEIGHT], p[P.MHA_K_WEIGHT], p[P.MHA_V_WEIGHT]])
        else:
            res["q_proj_weight"], res["k_proj_weight"], res["v_proj_weight"] = (
                p[P.MHA_Q_WEIGHT], p[P.MHA_K_WEIGHT], p[P.MHA_V_WEIGHT])
        if P.MHA_Q_BIAS in p:
            res["in_proj_bias"] = np.concatenate([p[P.MHA_Q_BIAS], p[P.MHA_K_BIAS], p[P.MHA_V_BIAS]])
        res["out_proj.weight"] = p[P.MHA_O_WEIGHT]
        if P.MHA_O_BIAS in p:
            res["out_proj.bias"] = p[P.MHA_O_BIAS]
        for name, which in self._NORM_PARAMS.items():
            if which in p:
                res[name] = p[which]
        if P.MHA_SINKS in p:
            res["sinks"] = p[P.MHA_SINKS]
        return res

    def state_dict(self):
        """Copies of every parameter the layer has, under the names grad() uses (float32 NumPy arrays)."""
        with self._lock:
            return {n: a.copy() for n, a in self._named(self._params_of(self._ctx, self._h)).items()}

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
                average_attn_weights=True, is_causal=False, *, mask_mode=None, rope=None, positions=None,
                window=None, softcap=None, alibi=None, sinks=None, dropout_p=None, dropout_seed=None,
                cu_seqlens=None, scale=None, chunk=None):
        """As torch.nn.MultiheadAttention.forward: returns (out, weights or None).

        Library extras: mask_mode ('masked', 'keep', 'additive', 'seed') reads
        attn_mask another way than PyTorch's rule (bool True = masked out,
        float added); 'seed' is the seed module's logits += mask * -1e9.
        rope: a dict of attn.rope's keywords; the projected q and k are rotated
        at positions ([B, L] integers; default 0..L-1) before attention.
        scale, window, chunk, softcap, alibi (True: the paper's slopes, or [H]), sinks
        ([H]), dropout_p and dropout_seed: as in attn.scaled_dot_product_attention
        (each over a from_hf model's own, where given; dropout_p None: the
        layer's dropout while training).
        cu_seqlens: a packed batch of self-attention (key and value the very
        object query is): query holds sequences end to end, one batch row
        ([total, E] unbatched, [1, total, E] batch-first, else [total, 1, E]),
        sequence s being tokens cu_seqlens[s]:cu_seqlens[s+1] (num_seqs + 1
        integer offsets); each attends to itself alone, with need_weights=False
        (there is no weights matrix for a packed batch)."""
        _packed_call(cu_seqlens, query, key, value, need_weights)
        like_torch = _is_torch(query)
        q, unbatched = self._batch_major(query, "query")
        k, _ = self._batch_major(key, "key")
        v, _ = self._batch_major(value, "value")
        B, L, S, H = q.shape[0], q.shape[1], k.shape[1], self.num_heads
        opts, keep = self._opts(B, L, S, key_padding_mask, attn_mask, is_causal, mask_mode)
        self._hf_defaults(opts, keep, B, L, positions, rope)
        _model_options(opts.attn, keep, H, window, softcap, alibi, sinks, self._dropout_p(dropout_p), dropout_seed,
                       scale, chunk)
        _cu_seqlens(opts.attn, keep, cu_seqlens, None)
        if rope is not None:
            ro = rope_opts(**rope)
            keep += [ro, positions_into(ro, positions, B, L)]
            opts.rope = ctypes.pointer(ro)
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
                                                       # packed: self-attention as such (RoPE per sequence)
                                                       None if cu_seqlens is not None else ctypes.byref(kt),
                                                       None if cu_seqlens is not None else ctypes.byref(vt),
                                                       ctypes.byref(opts)))
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
        rope = self._hf.rope if self._hf is not None and self._hf.has_rope else None
        return KVCache(batch, capacity, self.num_kv_heads, self.head_dim, dtype=dtype, threads=threads, rope=rope)

    def forward_cached(self, x, cache, *, window=None, softcap=None, alibi=None, sinks=None, scale=None, chunk=None):
        """Incremental causal self-attention (decoding) through a KVCache.

        x holds the next n tokens of every row, in the layer's layout: [B, n, E]
        with batch_first, else [n, B, E] (and [n, E] for one row). Their keys and
        values are appended to cache (from new_cache(B, ...)), then their queries
        attend over the whole row. scale, window, chunk, softcap, alibi and sinks as in
        forward (over a model's own options, from_hf, where given). Returns out
        like x (same layout, float32, NumPy or torch). Token by token this
        equals forward() with a causal mask over the whole sequence and the
        same options. If the step fails the cache is left as it was."""
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be an attn.KVCache, got {type(cache).__name__}")
        like_torch = _is_torch(x)
        xb, unbatched = self._batch_major(x, "x")
        B, n = xb.shape[0], xb.shape[1]
        out, ob = self._user_layout((B, n, self.embed_dim), unbatched)
        opts = _capi.MhaOpts()
        _capi.init(opts)
        keep = []
        self._hf_defaults(opts, keep, B, n, None, None, cached=True)
        _model_options(opts.attn, keep, self.num_heads, window, softcap, alibi, sinks, scale=scale, chunk=chunk)
        ot, xt = _tensor(ob), _tensor(xb)
        # layer lock, then cache lock: KVCache methods take only the latter, so no cycle
        with self._lock, cache._lock:
            self._ctx.check(_capi.lib.attn_mha_forward_cached(self._ctx.h, self._h, cache._handle(), ctypes.byref(ot),
                                                              ctypes.byref(xt), ctypes.byref(opts)))
        return _wrap(out[0] if unbatched else out, like_torch)

    decode_step = forward_cached

    def _packed_in_proj(self):
        """Whether PyTorch would pack this configuration's Q/K/V weights into in_proj_weight."""
        return (self.kdim == self.embed_dim and self.vdim == self.embed_dim and self.num_kv_heads == self.num_heads
                and self.num_heads * self.head_dim == self.embed_dim)

    def grad(self, query, key, value, grad_output, key_padding_mask=None, attn_mask=None, is_causal=False, *,
             mask_mode=None, rope=None, positions=None, window=None, softcap=None, alibi=None, sinks=None,
             dropout_p=None, dropout_seed=None, cu_seqlens=None, scale=None, chunk=None):
        """Gradients of a loss L through forward(query, key, value, ...), given grad_output = dL/dout.

        Runs the forward pass again (attn_mha_forward_save), then attn_mha_backward.
        rope, positions, scale, window, chunk, softcap, alibi, sinks (constants: not differentiated),
        dropout_p, dropout_seed and cu_seqlens (a packed batch): as in forward;
        with dropout, pass the forward's dropout_seed to differentiate that very
        forward (without one this call draws its own mask).
        Returns a dict: 'query', 'key', 'value' (input gradients, in the inputs'
        layout; with key and value the very same object as query, self-attention,
        only 'query', the whole gradient), and every parameter's under PyTorch's
        names (in_proj_weight or q/k/v_proj_weight, in_proj_bias, out_proj.weight,
        out_proj.bias), QK-norm's (q_norm.weight, k_norm.weight, q_norm.bias,
        k_norm.bias) and the learned sinks' (sinks), those the layer has. NumPy or
        torch like query.
        """
        _packed_call(cu_seqlens, query, key, value, False)
        like_torch = _is_torch(query)
        self_attn = key is query and value is query
        q, unbatched = self._batch_major(query, "query")
        k, _ = self._batch_major(key, "key")
        v, _ = self._batch_major(value, "value")
        g, _ = self._batch_major(grad_output, "grad_output")
        B, L, S = q.shape[0], q.shape[1], k.shape[1]
        opts, keep = self._opts(B, L, S, key_padding_mask, attn_mask, is_causal, mask_mode)
        self._hf_defaults(opts, keep, B, L, positions, rope)
        _model_options(opts.attn, keep, self.num_heads, window, softcap, alibi, sinks, self._dropout_p(dropout_p),
                       dropout_seed, scale, chunk)
        _cu_seqlens(opts.attn, keep, cu_seqlens, None)
        if rope is not None:
            ro = rope_opts(**rope)
            keep += [ro, positions_into(ro, positions, B, L)]
            opts.rope = ctypes.pointer(ro)
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
                p = {w: a.copy() for w, a in self._params_of(c, grads).items()}
            finally:
                if saved:
                    _capi.lib.attn_mha_saved_free(saved)
                if grads:
                    _capi.lib.attn_mha_destroy(grads)
        res = {"query": dq[0] if unbatched else dq}
        if not self_attn:
            res["key"] = dk[0] if unbatched else dk
            res["value"] = dv[0] if unbatched else dv
        res.update(self._named(p))
        return {n: _wrap(a, like_torch) for n, a in res.items()}

    def __del__(self):
        h = getattr(self, "_h", None)
        if h is not None and _capi is not None:
            _capi.lib.attn_mha_destroy(h)
            self._h = None
