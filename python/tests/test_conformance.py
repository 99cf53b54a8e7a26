#!/usr/bin/env python3
"""Conformance of the attn Python package against PyTorch, run in float64.

Case families: scaled_dot_product_attention forward (shapes, layouts, masks,
GQA), its backward (torch autograd through attn's Function and the plain
attn.sdpa_backward, against torch autograd), nn.MultiheadAttention, the seed
module (written below in torch), file loading, errors, plots, half precision
beside PyTorch's own bf16/f16, and attn.rope against transformers' rotary code
(when transformers is importable). Prints one line
per case and the worst relative L2 error of each family; exits 1 on any
failure. Without torch (or with ATTN_TEST_NO_TORCH=1) the NumPy float64
reference cases still run, then the suite exits 77 (skipped) if they pass.
"""
import ctypes
import math
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numpy as np  # noqa: E402

import attn  # noqa: E402
from attn import _capi  # noqa: E402

SKIP = 77  # ctest's SKIP_RETURN_CODE
try:
    if os.environ.get("ATTN_TEST_NO_TORCH"):  # exercise the NumPy-only path
        raise ImportError("ATTN_TEST_NO_TORCH is set")
    import torch
    import torch.nn.functional as F
    torch.manual_seed(4321)
except ImportError as e:
    torch = None
    no_torch_reason = str(e)

# PyTorch's own deprecation notice for a bool key_padding_mask beside a float attn_mask
warnings.filterwarnings("ignore", message="Support for mismatched key_padding_mask")
TOL = 1e-5  # float32 kernels against a float64 reference, relative L2
rng = np.random.default_rng(1234)
passed = failed = 0
worst = {}  # family -> worst error


def rel(a, b):
    if torch is not None and torch.is_tensor(a):
        a = a.detach().numpy()
    if torch is not None and torch.is_tensor(b):
        b = b.detach().numpy()
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shape {a.shape} != reference {b.shape}")
    if not np.isfinite(a).all():
        return float("inf")
    d = np.linalg.norm(a - b)
    n = np.linalg.norm(b)
    return d / n if n > 0 else d


def case(family, name, fn):
    """fn returns the error, or (error, its bound) where TOL is not the bound."""
    global passed, failed
    bound = TOL
    try:
        res = fn()
        err, bound = (float(res[0]), float(res[1])) if isinstance(res, tuple) else (float(res), TOL)
        ok = err <= bound
    except Exception as e:  # a crash of one case is a failure, not the end of the run
        err, ok = float("nan"), False
        name += f" [{type(e).__name__}: {e}]"
    extra = f" (bound {bound:.3g})" if bound != TOL else ""
    print(f"{'PASS' if ok else 'FAIL'} {family}: {name}: rel err {err:.3g}{extra}")
    w = worst.get(family, 0.0)
    worst[family] = err if (math.isnan(err) or err > w) else w
    if ok:
        passed += 1
    else:
        failed += 1


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def np_sdpa(q, k, v, mask=None, causal=None, scale=None, kpm=None):
    """float64 NumPy reference, [..., L, D] with GQA on dim -3; returns (out, weights)."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    if q.ndim == 4 and k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    L, S = q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if mask is not None:
        s = s + (np.where(mask, 0.0, -np.inf) if mask.dtype == np.bool_ else mask.astype(np.float64))
    if causal is not None:
        off = 0 if causal == "top-left" else S - L
        s = s + np.where(np.arange(S)[None, :] <= np.arange(L)[:, None] + off, 0.0, -np.inf)
    if kpm is not None:
        s = s + np.where(kpm, -np.inf, 0.0)[:, None, None, :]
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return p @ v, p


def torch_mask(mask, kpm, causal, L, S, requires_grad=False):
    """One PyTorch attn_mask (True = attend, or float) for mask + key padding + bottom-right causal."""
    m = None
    if mask is not None:
        m = torch.from_numpy(np.ascontiguousarray(mask))
        m = m if mask.dtype == np.bool_ else m.double().requires_grad_(requires_grad)
    leaf = m
    extra = None
    if kpm is not None:
        extra = torch.from_numpy(~kpm)[:, None, None, :]
    if causal == "bottom-right":
        cm = torch.ones(L, S, dtype=torch.bool).tril(S - L)
        extra = cm if extra is None else extra & cm
    if extra is not None:
        m = extra if m is None else (m & extra if m.dtype == torch.bool else m.masked_fill(~extra, float("-inf")))
    return m, leaf


def ref_sdpa(q, k, v, mask=None, causal=None, scale=None, kpm=None, gqa=False):
    if torch is None:
        return np_sdpa(q, k, v, mask, causal, scale, kpm)[0]
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).double()  # noqa: E731
    m, _ = torch_mask(mask, kpm, causal, q.shape[-2], k.shape[-2])
    return F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=m, is_causal=causal == "top-left",
                                          scale=scale, enable_gqa=gqa).numpy()


# ---- the ctypes mirror matches the C layout -----------------------------------
def layout():
    shape = (ctypes.c_int64 * 3)(2, 3, 5)
    buf = np.zeros(30, np.float32)
    t = _capi.lib.attn_tensor_view(buf.ctypes.data, _capi.F32, 3, shape)
    assert t.data == buf.ctypes.data and t.rank == 3 and list(t.shape[:3]) == [2, 3, 5]
    assert list(t.strides[:3]) == [15, 5, 1], list(t.strides[:3])
    o = _capi.SdpaOpts()
    o.causal = 77
    o.dropout_seed = 99
    _capi.lib.attn_sdpa_opts_init(ctypes.byref(o))
    assert math.isnan(o.scale) and o.causal == 0 and not o.mask and o.dropout_p == 0.0
    assert o.dropout_seed == 0
    mo = _capi.MhaOpts()
    mo.attn.mask_mode = 9
    _capi.lib.attn_mha_opts_init(ctypes.byref(mo))
    assert mo.attn.mask_mode == _capi.MASK_MASKED and mo.average_weights in (0, 1)
    # the mirrors are as large as the library's structs (their *_init sets size to their sizeof)
    for st, args in ((_capi.SdpaOpts, ()), (_capi.MhaOpts, ()), (_capi.MhaConfig, (8, 2))):
        assert len(_capi._library_struct(st, *args)) == ctypes.sizeof(st), st.__name__
    m = attn.MultiheadAttention(8, 2, kdim=6, vdim=5, num_kv_heads=1, bias=False)
    assert (m.embed_dim, m.num_heads, m.num_kv_heads, m.kdim, m.vdim, m.bias) == (8, 2, 1, 6, 5, False)
    return 0.0


case("binding", "ctypes layout of attn_tensor/attn_sdpa_opts/attn_mha_opts/attn_mha_config", layout)

# ---- scaled_dot_product_attention forward -------------------------------------
FWD = "sdpa forward"
SHAPES = [(1, 1, 1, 1, 8), (2, 3, 7, 5, 16), (2, 4, 33, 47, 64), (1, 2, 300, 257, 64), (1, 2, 16, 16, 128)]
for (B, H, L, S, D) in SHAPES:
    sh = f"{B}x{H}x{L}x{S}x{D}"
    q, k, v = randn(B, H, L, D), randn(B, H, S, D), randn(B, H, S, D)
    case(FWD, f"[B,H,N,D] {sh}", lambda: rel(attn.scaled_dot_product_attention(q, k, v), ref_sdpa(q, k, v)))
    # batch-first storage [B, N, H, D], passed as a permuted view (no copy)
    qb, kb, vb = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    qv, kv, vv = (x.transpose(0, 2, 1, 3) for x in (qb, kb, vb))
    case(FWD, f"batch-first permuted view {sh}",
         lambda: rel(attn.scaled_dot_product_attention(qv, kv, vv), ref_sdpa(q, k, v)))
    # non-contiguous: every other row of a taller array, a column slice, a stride-2 last dimension
    qs = randn(B, H, 2 * L, D)[:, :, ::2]
    ks = randn(B, H, S, D + 5)[..., 3:3 + D]
    vs = randn(B, H, S, 2 * D)[..., ::2]
    case(FWD, f"non-contiguous (row step, column slice, inner stride 2) {sh}",
         lambda: rel(attn.scaled_dot_product_attention(qs, ks, vs), ref_sdpa(qs, ks, vs)))
    case(FWD, f"causal top-left {sh}",
         lambda: rel(attn.scaled_dot_product_attention(q, k, v, is_causal=True), ref_sdpa(q, k, v, causal="top-left")))
    if L <= S:  # with L > S bottom-right leaves rows with no key (NaN in PyTorch, zeros here)
        case(FWD, f"causal bottom-right {sh}",
             lambda: rel(attn.scaled_dot_product_attention(q, k, v, is_causal=True, causal_align="bottom-right"),
                         ref_sdpa(q, k, v, causal="bottom-right")))
    bm = rng.random((L, S)) < 0.7
    bm[:, 0] = True  # no fully masked rows (PyTorch gives NaN there, libattn zeros)
    bm4 = np.broadcast_to(bm, (B, H, L, S))  # stride-0 broadcast
    case(FWD, f"bool mask (stride-0 broadcast) {sh}",
         lambda: rel(attn.scaled_dot_product_attention(q, k, v, attn_mask=bm4), ref_sdpa(q, k, v, mask=bm)))
    fm = randn(B, 1, L, S)
    case(FWD, f"float mask [B,1,L,S], scale 0.3 {sh}",
         lambda: rel(attn.scaled_dot_product_attention(q, k, v, attn_mask=fm, scale=0.3),
                     ref_sdpa(q, k, v, mask=fm, scale=0.3)))
    kpm = rng.random((B, S)) < 0.3
    kpm[:, 0] = False
    case(FWD, f"key padding {sh}",
         lambda: rel(attn.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm), ref_sdpa(q, k, v, kpm=kpm)))
    case(FWD, f"bool mask + key padding + causal {sh}",
         lambda: rel(attn.scaled_dot_product_attention(q, k, v, attn_mask=bm, key_padding_mask=kpm, is_causal=True),
                     ref_sdpa(q, k, v, mask=bm & np.tril(np.ones((L, S), bool)), kpm=kpm)))
    if H % 2 == 0:
        k2, v2 = randn(B, H // 2, S, D), randn(B, H // 2, S, D)
        case(FWD, f"GQA {H}q/{H // 2}kv {sh}",
             lambda: rel(attn.scaled_dot_product_attention(q, k2, v2, enable_gqa=True), ref_sdpa(q, k2, v2, gqa=True)))
    if H > 1:
        k1, v1 = randn(B, 1, S, D), randn(B, 1, S, D)
        case(FWD, f"MQA {H}q/1kv {sh}",
             lambda: rel(attn.scaled_dot_product_attention(q, k1, v1, enable_gqa=True), ref_sdpa(q, k1, v1, gqa=True)))


def weights_lse():
    q, k, v = randn(2, 2, 9, 8), randn(2, 2, 11, 8), randn(2, 2, 11, 8)
    out, w, lse = attn.scaled_dot_product_attention(q, k, v, return_weights=True, return_lse=True)
    ro, rw = np_sdpa(q, k, v)
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64) / math.sqrt(8)
    rl = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    return max(rel(out, ro), rel(w, rw), rel(lse, rl))


case(FWD, "return_weights/return_lse vs NumPy float64", weights_lse)


def rank3_and_f64():
    q = rng.standard_normal((3, 6, 8))  # float64: cast to float32 with a copy
    o = attn.scaled_dot_product_attention(q, q, q)
    assert o.dtype == np.float32 and o.shape == (3, 6, 8)
    return rel(o, np_sdpa(q, q, q)[0])


case(FWD, "rank-3 float64 input", rank3_and_f64)


def seed_mask_mode():
    q, k, v = randn(2, 2, 6, 8), randn(2, 2, 7, 8), randn(2, 2, 7, 8)
    m = (rng.random((2, 1, 1, 7)) < 0.3).astype(np.float32)  # 1 = padding, the seed's convention
    m[..., 0] = 0
    return rel(attn.scaled_dot_product_attention(q, k, v, attn_mask=m, mask_mode="seed"),
               np_sdpa(q, k, v, mask=m * -1e9)[0])


case(FWD, "mask_mode='seed' (logits += mask * -1e9)", seed_mask_mode)


def uint8_mask():
    q, k, v = randn(1, 2, 5, 8), randn(1, 2, 6, 8), randn(1, 2, 6, 8)
    bm = rng.random((5, 6)) < 0.6
    bm[:, 0] = True
    u = bm.astype(np.uint8) * 7  # nonzero = true
    return rel(attn.scaled_dot_product_attention(q, k, v, attn_mask=u), np_sdpa(q, k, v, mask=bm)[0])


case(FWD, "uint8 mask reads as bool", uint8_mask)


def errors():
    q = randn(1, 2, 4, 8)
    try:
        attn.scaled_dot_product_attention(q, randn(1, 2, 5, 8), randn(1, 2, 6, 8))
        raise AssertionError("mismatched k/v accepted")
    except attn.AttnError as e:
        assert isinstance(e, RuntimeError) and e.status == 2 and str(e) != attn._capi.lib.attn_strerror(2).decode(), e
    for bad, exc in (((q, randn(1, 1, 4, 8), randn(1, 1, 4, 8)), ValueError),  # GQA without enable_gqa
                     ((q.astype(np.int32), q, q), TypeError),
                     ((np.lib.stride_tricks.as_strided(q, shape=(1, 2, 4, 8), strides=(256, 128, 32, 2)), q, q),
                      ValueError)):  # a stride that is not a whole number of elements
        try:
            attn.scaled_dot_product_attention(*bad)
            raise AssertionError(f"{exc.__name__} expected")
        except exc:
            pass
    try:
        attn.scaled_dot_product_attention(q, q, q, mask_mode="nope", attn_mask=np.ones((4, 4), bool))
        raise AssertionError("bad mask_mode accepted")
    except ValueError:
        pass
    try:  # the library's own message reaches Python: GQA with heads that do not divide
        attn.scaled_dot_product_attention(randn(1, 3, 4, 8), randn(1, 2, 4, 8), randn(1, 2, 4, 8), enable_gqa=True)
        raise AssertionError("3 query heads over 2 kv heads accepted")
    except attn.AttnError as e:
        assert str(e) and e.status != 0, e
    try:
        attn.MultiheadAttention(10, 3)
        raise AssertionError("E=10, H=3 accepted")
    except attn.AttnError as e:
        assert "10" in str(e) or "divide" in str(e), e
    return 0.0


case("errors", "AttnError(status, library message), ValueError, TypeError", errors)


# ---- plots ---------------------------------------------------------------------
def plots():
    w = np_sdpa(randn(1, 3, 5, 4), randn(1, 3, 5, 4), randn(1, 3, 5, 4))[1].astype(np.float32)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        try:
            attn.plot_attention(w)
            raise AssertionError("plot_attention without matplotlib did not raise")
        except ImportError as e:
            assert "matplotlib" in str(e)
            print("  (matplotlib not importable: checked the ImportError only)")
            return 0.0
    fig = attn.plot_attention(w, tokens=list("abcde"))
    from matplotlib.figure import Figure
    assert isinstance(fig, Figure) and len([a for a in fig.axes if a.get_images()]) == 3
    assert [a.get_title() for a in fig.axes[:3]] == ["head 0", "head 1", "head 2"]
    try:
        attn.plot_attention(w, tokens=list("abc"))
        raise AssertionError("wrong token count accepted")
    except ValueError:
        pass
    return 0.0


case("plot", "plot_attention returns a Figure with one heatmap per head", plots)

if torch is None:
    print(f"SKIP: PyTorch is not importable ({no_torch_reason}); only the NumPy float64 reference cases ran")
else:
    # ---- torch tensors in, torch tensors out ----------------------------------------
    def torch_io():
        q = torch.randn(2, 3, 10, 16)
        kb = torch.randn(2, 12, 3, 16).transpose(1, 2)  # a strided (batch-first) view
        v = torch.randn(2, 3, 12, 16)
        o = attn.scaled_dot_product_attention(q, kb, v, is_causal=False)
        assert isinstance(o, torch.Tensor) and o.dtype == torch.float32
        r = F.scaled_dot_product_attention(q.double(), kb.double(), v.double())
        # zero copy: the view handed to the library points at the tensor's own memory
        # (a sliced, transposed float32 tensor: storage offset and strides kept)
        big = torch.randn(3, 20, 4, 16)
        sl = big[1:, 2:14].transpose(1, 2)
        t = attn._tensors._tensor(attn._tensors._to_numpy(sl, "q"))
        assert t.data == sl.data_ptr(), (t.data, sl.data_ptr())
        assert list(t.strides[:4]) == list(sl.stride()) and list(t.shape[:4]) == list(sl.shape)
        a = rng.standard_normal((4, 6, 8), dtype=np.float32)[:, ::2]
        assert attn._tensors._tensor(attn._tensors._to_numpy(a, "q")).data == a.ctypes.data
        if torch.cuda.is_available():
            try:
                attn.scaled_dot_product_attention(q.cuda(), q.cuda(), q.cuda())
                raise AssertionError("a CUDA tensor was accepted")
            except TypeError as e:
                assert "CPU" in str(e)
        try:
            attn.scaled_dot_product_attention(q.to(torch.int64), q, q)
            raise AssertionError("an int64 tensor was accepted")
        except TypeError as e:
            assert "dtype" in str(e)
        try:
            attn.scaled_dot_product_attention(torch.complex(q, q), q, q)
            raise AssertionError("a complex tensor was accepted")
        except TypeError:
            pass
        ob = attn.scaled_dot_product_attention(q.bfloat16(), kb.bfloat16(), v.bfloat16(), precision="fp32")  # widened
        rb = F.scaled_dot_product_attention(q.bfloat16().double(), kb.bfloat16().double(), v.bfloat16().double())
        return max(rel(o, r), rel(ob, rb))

    case("torch io", "torch tensors (strided view, zero copy, bf16, bad dtype/device)", torch_io)

    # ---- backward: against torch autograd in float64 ---------------------------------
    BWD = "sdpa backward"

    def bwd_case(B, H, Hk, L, S, D, mask=None, causal=None, kpm=False, batch_first=False, api="autograd", scale=None):
        def run():
            q, k, v = randn(B, H, L, D), randn(B, Hk, S, D), randn(B, Hk, S, D)
            G = randn(B, H, L, D)
            m = None
            if mask == "bool":
                m = rng.random((L, S)) < 0.7
                m[:, 0] = True
            elif mask == "float":
                m = randn(B, 1, L, S)
            kp = None
            if kpm:
                kp = rng.random((B, S)) < 0.3
                kp[:, 0] = False
            # reference: float64 autograd through F.scaled_dot_product_attention
            qd, kd, vd = (torch.from_numpy(x).double().requires_grad_() for x in (q, k, v))
            tm, leaf = torch_mask(m, kp, causal, L, S, requires_grad=mask == "float")
            ro = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=tm, is_causal=causal == "top-left", scale=scale,
                                                enable_gqa=H != Hk)
            ro.backward(torch.from_numpy(G).double())
            refs = [ro, qd.grad, kd.grad, vd.grad] + ([leaf.grad] if mask == "float" else [])
            kw = dict(attn_mask=m, is_causal=causal is not None, causal_align=causal or "top-left", scale=scale,
                      enable_gqa=H != Hk, key_padding_mask=kp)
            if api == "autograd":
                if batch_first:  # leaves stored [B, N, H, D], attention on their permuted views
                    leaves = [torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).requires_grad_()
                              for x in (q, k, v)]
                    ins = [x.transpose(1, 2) for x in leaves]
                else:
                    leaves = ins = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
                tmask = None
                if mask == "float":
                    tmask = torch.from_numpy(m).requires_grad_()
                    kw["attn_mask"] = tmask
                o = attn.scaled_dot_product_attention(*ins, **kw)
                assert o.grad_fn is not None
                o.backward(torch.from_numpy(G))
                grads = [x.grad.transpose(1, 2) if batch_first else x.grad for x in leaves]
                got = [o] + grads + ([tmask.grad] if mask == "float" else [])
            else:  # the plain function on NumPy arrays
                o, lse = attn.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
                got = [o] + list(attn.sdpa_backward(G, q, k, v, o, lse, return_mask_grad=mask == "float", **kw))
            return max(rel(a, b) for a, b in zip(got, refs))
        return run

    bgrid = [
        dict(B=1, H=1, Hk=1, L=1, S=1, D=8),
        dict(B=2, H=3, Hk=3, L=7, S=5, D=16),
        dict(B=2, H=4, Hk=4, L=33, S=47, D=64),
        dict(B=1, H=2, Hk=2, L=130, S=129, D=64),
        dict(B=2, H=3, Hk=3, L=9, S=9, D=16, batch_first=True),
        dict(B=2, H=3, Hk=3, L=9, S=11, D=16, causal="top-left"),
        dict(B=2, H=3, Hk=3, L=9, S=11, D=16, causal="bottom-right"),
        dict(B=2, H=2, Hk=2, L=8, S=10, D=16, mask="bool"),
        dict(B=2, H=2, Hk=2, L=8, S=10, D=16, mask="float"),
        dict(B=2, H=2, Hk=2, L=8, S=10, D=16, kpm=True, scale=0.2),
        dict(B=2, H=4, Hk=2, L=12, S=12, D=32, causal="top-left"),
        dict(B=2, H=4, Hk=1, L=6, S=20, D=32, causal="bottom-right", kpm=True),
    ]
    for g in bgrid:
        desc = ",".join(f"{k}={v}" for k, v in g.items())
        case(BWD, f"autograd {desc}", bwd_case(**g))
        if not g.get("batch_first"):
            case(BWD, f"attn.sdpa_backward {desc}", bwd_case(api="numpy", **g))

    def dropout_consistency():
        # dropout is not comparable to torch's RNG; check the backward against a
        # finite difference of the forward with the same seed instead
        q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float32, requires_grad=True) for _ in range(3))
        o = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.3, dropout_seed=11)
        o.sum().backward()
        e = torch.zeros_like(q)
        e[0, 1, 2, 3] = 1e-2
        with torch.no_grad():
            fp = attn.scaled_dot_product_attention(q + e, k, v, dropout_p=0.3, dropout_seed=11).double().sum()
            fm = attn.scaled_dot_product_attention(q - e, k, v, dropout_p=0.3, dropout_seed=11).double().sum()
        fd = (fp - fm) / 2e-2
        return abs(fd.item() - q.grad[0, 1, 2, 3].item()) / max(1.0, abs(fd.item())) * 1e-2  # fd is ~1e-4 accurate

    case(BWD, "dropout: gradient matches a central difference of the same seed's forward (x1e-2)", dropout_consistency)

    def sinks_grad_case(api):
        """Learnable sinks (gpt-oss): q, k, v and sinks' gradients, through autograd or sdpa_backward's
        return_sinks_grad, against autograd through a float64 torch reference (the sink as an extra
        logit column whose probability is dropped), GQA and causal."""
        B, H, Hk, L, D = 2, 4, 2, 9, 16
        q, k, v = torch.randn(B, H, L, D), torch.randn(B, Hk, L, D), torch.randn(B, Hk, L, D)
        sk, G = torch.randn(H), torch.randn(B, H, L, D)
        ref = [t.double().requires_grad_() for t in (q, k, v, sk)]
        rq, rk, rv, rs = ref
        kk, vv = (t.repeat_interleave(H // Hk, dim=1) for t in (rk, rv))
        logits = (rq @ kk.transpose(-1, -2) / math.sqrt(D)).masked_fill(
            torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        col = rs[None, :, None, None].expand(B, H, L, 1)
        p = torch.softmax(torch.cat([logits, col], -1), -1)[..., :-1]
        (p @ vv).backward(G.double())
        kw = dict(is_causal=True, enable_gqa=True)
        if api == "autograd":
            ours = [t.clone().requires_grad_() for t in (q, k, v, sk)]
            attn.scaled_dot_product_attention(ours[0], ours[1], ours[2], sinks=ours[3], **kw).backward(G)
            got = [t.grad for t in ours]
        else:
            out, lse = attn.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), sinks=sk.numpy(),
                                                         return_lse=True, **kw)
            got = attn.sdpa_backward(G.numpy(), q.numpy(), k.numpy(), v.numpy(), out, lse, sinks=sk.numpy(),
                                     return_sinks_grad=True, **kw)
        assert got[3] is not None and tuple(got[3].shape) == (H,), got[3]
        return max(rel(a, r.grad) for a, r in zip(got, ref))

    case(BWD, "sinks' gradient (torch autograd; sinks a tensor that requires grad)",
         lambda: sinks_grad_case("autograd"))
    case(BWD, "sinks' gradient (sdpa_backward, return_sinks_grad=True, NumPy)", lambda: sinks_grad_case("numpy"))

    # ---- nn.MultiheadAttention ---------------------------------------------------
    MHA = "nn.MultiheadAttention"

    def mha_case(E, H, L, S, batch_first, kdim=None, vdim=None, bias=True, need_weights=True, avg=True,
                 mask=None, kpm=False, causal=False, self_attn=False, unbatched=False):
        def run():
            tm = torch.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first)
            with torch.no_grad():
                for p in tm.parameters():
                    p.normal_(0, 0.3)
            tm = tm.double().eval()
            m = attn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first)
            m.load_state_dict(tm.state_dict())
            B = 2
            shp = lambda n, f: (n, f) if unbatched else ((B, n, f) if batch_first else (n, B, f))  # noqa: E731
            q = torch.randn(*shp(L, E))
            k = q if self_attn else torch.randn(*shp(S, kdim or E))
            v = q if self_attn else torch.randn(*shp(S, vdim or E))
            Sk = L if self_attn else S
            am = None
            if mask == "bool":
                am = torch.rand(L, Sk) < 0.3  # True = masked out
                am[:, 0] = False
            elif mask == "float":
                am = torch.randn(L, Sk)
            elif mask == "float3d":
                am = torch.randn((1 if unbatched else B) * H, L, Sk)
            if causal:
                am = torch.ones(L, Sk, dtype=torch.bool).triu(1)
            kp = None
            if kpm:
                kp = torch.rand(Sk) < 0.3 if unbatched else torch.rand(B, Sk) < 0.3
                kp[..., 0] = False
            o, w = m(q, k, v, key_padding_mask=kp, need_weights=need_weights, attn_mask=None if causal else am,
                     average_attn_weights=avg, is_causal=causal)
            ro, rw = tm(q.double(), k.double(), v.double(), key_padding_mask=kp, need_weights=need_weights,
                        attn_mask=None if am is None else (am if am.dtype == torch.bool else am.double()),
                        average_attn_weights=avg)
            errs = [rel(o, ro)]
            if need_weights:
                errs.append(rel(w, rw))
            else:
                assert w is None
            return max(errs)
        return run

    grid = [
        dict(E=16, H=4, L=5, S=7, batch_first=True),
        dict(E=16, H=4, L=5, S=7, batch_first=False),
        dict(E=16, H=4, L=5, S=7, batch_first=False, avg=False),
        dict(E=16, H=4, L=5, S=7, batch_first=True, need_weights=False),
        dict(E=32, H=4, L=9, S=9, batch_first=False, self_attn=True, causal=True),
        dict(E=32, H=8, L=6, S=11, batch_first=True, mask="bool", kpm=True),
        dict(E=32, H=8, L=6, S=11, batch_first=False, mask="float", kpm=True, avg=False),
        dict(E=32, H=8, L=6, S=11, batch_first=True, mask="float3d"),
        dict(E=24, H=3, L=8, S=10, batch_first=False, kdim=10, vdim=12),
        dict(E=24, H=3, L=8, S=10, batch_first=True, bias=False),
        dict(E=16, H=2, L=5, S=6, batch_first=False, unbatched=True, kpm=True),
        dict(E=128, H=8, L=200, S=300, batch_first=False, kpm=True),
        dict(E=64, H=4, L=257, S=257, batch_first=True, self_attn=True, need_weights=True, avg=False),
    ]
    for g in grid:
        desc = ",".join(f"{k}={v}" for k, v in g.items())
        case(MHA, desc, mha_case(**g))

    # ---- MultiheadAttention.grad against torch autograd ----------------------------
    MHB = "mha backward"

    def mha_grad_case(E, H, L, S, batch_first, kdim=None, vdim=None, bias=True, self_attn=False, mask=None,
                      kpm=False, causal=False, unbatched=False):
        def run():
            tm = torch.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first)
            with torch.no_grad():
                for p in tm.parameters():
                    p.normal_(0, 0.3)
            tm = tm.double()
            m = attn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first)
            m.load_state_dict(tm.state_dict())
            B = 2
            shp = lambda n, f: (n, f) if unbatched else ((B, n, f) if batch_first else (n, B, f))  # noqa: E731
            q = torch.randn(*shp(L, E))
            k = q if self_attn else torch.randn(*shp(S, kdim or E))
            v = q if self_attn else torch.randn(*shp(S, vdim or E))
            Sk = L if self_attn else S
            am = None
            if mask == "bool":
                am = torch.rand(L, Sk) < 0.3
                am[:, 0] = False
            elif mask == "float":
                am = torch.randn(L, Sk)
            if causal:
                am = torch.ones(L, Sk, dtype=torch.bool).triu(1)
            kp = None
            if kpm:
                kp = torch.rand(Sk) < 0.3 if unbatched else torch.rand(B, Sk) < 0.3
                kp[..., 0] = False
            G = torch.randn(*shp(L, E))
            qd = q.double().requires_grad_()
            kd = qd if self_attn else k.double().requires_grad_()
            vd = qd if self_attn else v.double().requires_grad_()
            ro, _ = tm(qd, kd, vd, key_padding_mask=kp, need_weights=False,
                       attn_mask=None if am is None else (am if am.dtype == torch.bool else am.double()))
            ro.backward(G.double())
            g = m.grad(q, k, v, G, key_padding_mask=kp, attn_mask=None if causal else am, is_causal=causal)
            errs = [rel(g["query"], qd.grad)]
            if not self_attn:
                errs += [rel(g["key"], kd.grad), rel(g["value"], vd.grad)]
            else:
                assert "key" not in g
            for name, p in tm.named_parameters():
                errs.append(rel(g[name], p.grad))
            assert set(g) - {"query", "key", "value"} == {n for n, _ in tm.named_parameters()}, sorted(g)
            return max(errs)
        return run

    for g in [dict(E=16, H=4, L=5, S=7, batch_first=True),
              dict(E=16, H=4, L=6, S=6, batch_first=False, self_attn=True),
              dict(E=32, H=4, L=9, S=9, batch_first=True, self_attn=True, causal=True),
              dict(E=32, H=8, L=6, S=11, batch_first=False, mask="bool", kpm=True),
              dict(E=32, H=8, L=6, S=11, batch_first=True, mask="float"),
              dict(E=24, H=3, L=8, S=10, batch_first=False, kdim=10, vdim=12),
              dict(E=24, H=3, L=8, S=10, batch_first=True, bias=False),
              dict(E=16, H=2, L=5, S=6, batch_first=False, unbatched=True, kpm=True),
              dict(E=64, H=4, L=100, S=130, batch_first=True)]:
        desc = ",".join(f"{k}={v}" for k, v in g.items())
        case(MHB, desc, mha_grad_case(**g))

    def mha_grad_options_case():
        """grad() with a window, softcap, ALiBi, sinks and seeded dropout: the gradients torch autograd
        takes through the layer's projections composed around scaled_dot_product_attention (whose own
        backward is attn_sdpa_backward) with the same options."""
        E, H, B, L = 32, 4, 2, 11
        m = attn.MultiheadAttention(E, H, batch_first=True)
        w, b = torch.randn(3 * E, E) * 0.2, torch.randn(3 * E) * 0.1
        wo, bo = torch.randn(E, E) * 0.2, torch.randn(E) * 0.1
        m.load_state_dict({"in_proj_weight": w, "in_proj_bias": b, "out_proj.weight": wo, "out_proj.bias": bo})
        x, G = torch.randn(B, L, E), torch.randn(B, L, E)
        kw = dict(window=4, softcap=5.0, alibi=True, sinks=torch.randn(H), dropout_p=0.25, dropout_seed=11,
                  scale=0.3)
        got = m.grad(x, x, x, G, **kw)
        ps = [t.clone().requires_grad_() for t in (x, w, b, wo, bo)]
        xt, wt, bt, wot, bot = ps
        heads = lambda t: t.reshape(B, L, H, E // H).transpose(1, 2)  # noqa: E731
        q, k, v = (heads(xt @ wt[i * E:(i + 1) * E].T + bt[i * E:(i + 1) * E]) for i in range(3))
        a = attn.scaled_dot_product_attention(q, k, v, **kw).transpose(1, 2).reshape(B, L, E)
        (a @ wot.T + bot).backward(G)
        names = ("query", "in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
        assert set(got) == set(names), sorted(got)
        # dropout is on: without its seed's mask in grad() the gradients would differ by far more
        return max(rel(got[n], p.grad) for n, p in zip(names, ps))

    case(MHB, "scale, window, softcap, ALiBi, sinks and seeded dropout (grad against autograd through the SDPA)",
         mha_grad_options_case)

    # ---- head_dim != E/H, out_bias and QK-norm against a plain PyTorch composition ----------
    QKN = "mha head_dim + QK-norm"

    def qk_norm_case(E, H, Hk, D, scope, kind, bias=True, out_bias=False, rope=False, L=7):
        """Linear projections, rms_norm / layer_norm per head or over the whole projection
        (Gemma's 1 + w for rms_plus_one), RoPE (rotate_half) when set, causal SDPA with GQA, the
        output Linear: forward and the gradients of the input and every parameter, in float64."""
        def run():
            B, eps = 2, 1e-6
            nq, nk = {"per_head": (D, D), "whole": (H * D, Hk * D), "each_head": ((H, D), (Hk, D))}[scope]
            dbl = lambda *shape: torch.randn(*shape, dtype=torch.float64)  # noqa: E731
            nq, nk = (nq if isinstance(nq, tuple) else (nq,)), (nk if isinstance(nk, tuple) else (nk,))
            P = {"q_proj_weight": dbl(H * D, E) * 0.3, "k_proj_weight": dbl(Hk * D, E) * 0.3,
                 "v_proj_weight": dbl(Hk * D, E) * 0.3, "out_proj.weight": dbl(E, H * D) * 0.3,
                 "q_norm.weight": 1 + 0.3 * dbl(*nq), "k_norm.weight": 1 + 0.3 * dbl(*nk)}
            if kind == "rms_plus_one":
                P["q_norm.weight"] -= 1
                P["k_norm.weight"] -= 1
            if kind == "layer":
                P["q_norm.bias"], P["k_norm.bias"] = 0.2 * dbl(*nq), 0.2 * dbl(*nk)
            if bias:
                P["in_proj_bias"] = dbl(H * D + 2 * Hk * D) * 0.1
            if out_bias:
                P["out_proj.bias"] = dbl(E) * 0.1
            for t in P.values():
                t.requires_grad_()
            x = dbl(B, L, E).requires_grad_()
            G = dbl(B, L, E)

            def norm(t, w, b, heads):  # t [B, L, heads*D]
                shape = (B, L, heads * D) if scope == "whole" else (B, L, heads, D)
                t = t.reshape(shape)
                F_ = shape[-1:]
                if scope == "each_head":  # head h by row h of w [heads, D] (Cohere)
                    if kind == "layer":
                        y = F.layer_norm(t, F_, None, None, eps) * w + b
                    else:
                        y = F.rms_norm(t, F_, None, eps) * (w + 1 if kind == "rms_plus_one" else w)
                elif kind == "layer":
                    y = F.layer_norm(t, F_, w, b, eps)
                else:
                    y = F.rms_norm(t, F_, w + 1 if kind == "rms_plus_one" else w, eps)
                return y.reshape(B, L, heads, D).transpose(1, 2)  # [B, heads, L, D]

            def rot(t):  # rotate_half RoPE at positions 0..L-1, theta 10000
                inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
                ang = torch.arange(L, dtype=torch.float64)[:, None] * inv[None]
                cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
                t1, t2 = t[..., :D // 2], t[..., D // 2:]
                return t * cos + torch.cat([-t2, t1], -1) * sin

            bq = bk = bv = None
            if bias:
                bq, bk, bv = P["in_proj_bias"].split([H * D, Hk * D, Hk * D])
            q = norm(F.linear(x, P["q_proj_weight"], bq), P["q_norm.weight"], P.get("q_norm.bias"), H)
            k = norm(F.linear(x, P["k_proj_weight"], bk), P["k_norm.weight"], P.get("k_norm.bias"), Hk)
            v = F.linear(x, P["v_proj_weight"], bv).reshape(B, L, Hk, D).transpose(1, 2)
            if rope:
                q, k = rot(q), rot(k)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            want = F.linear(a.transpose(1, 2).reshape(B, L, H * D), P["out_proj.weight"], P.get("out_proj.bias"))
            want.backward(G)

            m = attn.MultiheadAttention(E, H, bias=bias, batch_first=True, num_kv_heads=Hk, head_dim=D,
                                        out_bias=out_bias, qk_norm=scope, qk_norm_kind=kind, qk_norm_eps=eps)
            load = {n: t.detach() for n, t in P.items() if n != "in_proj_bias"}
            if bias:  # with H*D != E, PyTorch's in_proj_bias packing is not this layer's: per projection
                load.update({"q_proj.bias": bq.detach(), "k_proj.bias": bk.detach(), "v_proj.bias": bv.detach()})
            m.load_state_dict(load)
            sd = m.state_dict()
            assert set(sd) == set(P), (sorted(sd), sorted(P))
            assert max(rel(sd[n], P[n].detach()) for n in P) < 1e-7, "state_dict reads back what was loaded"
            kw = dict(rope={}) if rope else {}
            xf = x.detach().float()
            got, _ = m(xf, xf, xf, need_weights=False, is_causal=True, **kw)
            g = m.grad(xf, xf, xf, G.float(), is_causal=True, **kw)
            assert set(g) == set(P) | {"query"}, sorted(g)
            errs = [rel(got, want), rel(g["query"], x.grad)] + [rel(g[n], P[n].grad) for n in P if n != "k_norm.bias"]
            if "k_norm.bias" in P:  # 0 without RoPE (it shifts a query's every score alike): against q's scale
                d = np.linalg.norm(np.asarray(g["k_norm.bias"], np.float64) - P["k_norm.bias"].grad.numpy())
                errs.append(d / max(P["k_norm.bias"].grad.norm().item(), P["q_norm.bias"].grad.norm().item()))
            return max(errs), 1e-4
        return run

    for g in [dict(E=24, H=4, Hk=2, D=8, scope="per_head", kind="rms", out_bias=False, rope=True),
              dict(E=20, H=4, Hk=1, D=6, scope="per_head", kind="rms_plus_one", bias=False, out_bias=True, rope=True),
              dict(E=16, H=2, Hk=2, D=12, scope="whole", kind="rms", bias=False),
              dict(E=30, H=6, Hk=3, D=4, scope="whole", kind="layer", out_bias=True),
              dict(E=18, H=3, Hk=3, D=4, scope="per_head", kind="layer", rope=True),
              dict(E=20, H=4, Hk=2, D=6, scope="each_head", kind="layer", out_bias=False, rope=True),
              dict(E=16, H=2, Hk=1, D=8, scope="each_head", kind="rms", bias=False)]:
        desc = ",".join(f"{k}={v}" for k, v in g.items())
        case(QKN, desc, qk_norm_case(**g))

    # ---- the seed module ------------------------------------------------------------
    class SeedMHA(torch.nn.Module):
        """The seed's layer: Q/K/V Linear projections wq/wk/wv, split heads, scaled
        dot product with the mask added as mask * -1e9, concat, dense output.
        Inputs [B, N, E]; returns (out [B, Nq, E], weights [B, H, Nq, Nk])."""

        def __init__(self, E, H):
            super().__init__()
            self.H, self.D = H, E // H
            self.wq, self.wk, self.wv = (torch.nn.Linear(E, E) for _ in range(3))
            self.dense = torch.nn.Linear(E, E)

        def split(self, x):
            B, N, _ = x.shape
            return x.reshape(B, N, self.H, self.D).transpose(1, 2)  # [B, H, N, D]

        def forward(self, q, k, v, mask=None):
            q, k, v = self.split(self.wq(q)), self.split(self.wk(k)), self.split(self.wv(v))
            logits = q @ k.transpose(-1, -2) / math.sqrt(self.D)
            if mask is not None:
                logits = logits + mask * -1e9
            w = torch.softmax(logits, dim=-1)
            o = (w @ v).transpose(1, 2).reshape(q.shape[0], -1, self.H * self.D)  # concat heads
            return self.dense(o), w

    SEED = "seed module"

    def seed_case(E, H, L, S, mask=None, cross=True):
        def run():
            sm = SeedMHA(E, H).double().eval()
            m = attn.MultiheadAttention(E, H, batch_first=True)
            m.load_state_dict(sm.state_dict())  # wq.weight, ..., dense.bias
            B = 2
            x = torch.randn(B, L, E)
            kx = torch.randn(B, S, E) if cross else x
            vx = torch.randn(B, S, E) if cross else x
            Sk = S if cross else L
            mk = None
            if mask == "padding":  # [B, 1, 1, S], 1 = a padding key
                mk = (torch.rand(B, 1, 1, Sk) < 0.3).float()
                mk[..., 0] = 0
            elif mask == "look-ahead":  # [L, S], 1 = a future key
                mk = torch.ones(L, Sk).triu(1)
            ro, rw = sm(x.double(), kx.double(), vx.double(), None if mk is None else mk.double())
            o, w = m(x, kx, vx, attn_mask=mk, mask_mode=None if mk is None else "seed", average_attn_weights=False)
            return max(rel(o, ro), rel(w, rw))
        return run

    for g in [dict(E=16, H=4, L=5, S=7), dict(E=16, H=4, L=6, S=6, cross=False),
              dict(E=32, H=8, L=9, S=11, mask="padding"), dict(E=32, H=4, L=10, S=10, mask="look-ahead", cross=False),
              dict(E=64, H=2, L=70, S=90, mask="padding")]:
        desc = ",".join(f"{k}={v}" for k, v in g.items())
        case(SEED, desc, seed_case(**g))

    def seed_backward():
        E, H, L = 32, 4, 9
        sm = SeedMHA(E, H).double()
        m = attn.MultiheadAttention(E, H, batch_first=True)
        m.load_state_dict(sm.state_dict())
        x = torch.randn(2, L, E)
        mk = torch.ones(L, L).triu(1)  # the seed's look-ahead mask
        G = torch.randn(2, L, E)
        xd = x.double().requires_grad_()
        ro, _ = sm(xd, xd, xd, mk.double())
        ro.backward(G.double())
        g = m.grad(x, x, x, G, attn_mask=mk, mask_mode="seed")
        ipw, ipb = g["in_proj_weight"], g["in_proj_bias"]
        pairs = [(g["query"], xd.grad), (g["out_proj.weight"], sm.dense.weight.grad),
                 (g["out_proj.bias"], sm.dense.bias.grad)]
        for i, lin in enumerate((sm.wq, sm.wk, sm.wv)):
            pairs.append((ipw[i * E:(i + 1) * E], lin.weight.grad))
        # the key bias's gradient is zero in exact arithmetic (softmax ignores a shift
        # of every logit of a row): compare the three biases together, as PyTorch stores them
        pairs.append((ipb, torch.cat([sm.wq.bias.grad, sm.wk.bias.grad, sm.wv.bias.grad])))
        return max(rel(a, b) for a, b in pairs)

    case(SEED, "backward: input and every parameter's gradient, look-ahead mask", seed_backward)

    def seed_from_safetensors():
        E, H = 16, 4
        sm = SeedMHA(E, H).eval()
        x = torch.randn(2, 6, E)
        with torch.no_grad():
            ro, _ = sm.double()(x.double(), x.double(), x.double())
        try:
            from safetensors.numpy import save_file
        except ImportError:
            print("  (safetensors not importable: from_safetensors not tested)")
            return 0.0
        errs = []
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "l.safetensors")
            save_file({"blk." + k: v.float().numpy() for k, v in sm.state_dict().items()}, path)
            m2 = attn.MultiheadAttention.from_safetensors(path, H, prefix="blk.", batch_first=True)
            errs.append(rel(m2(x, x, x)[0], ro))
            try:
                attn.MultiheadAttention.from_safetensors(path, H, prefix="nope.")
                raise AssertionError("a missing prefix was accepted")
            except attn.AttnError as e:
                assert str(e)
        return max(errs)

    case(SEED, "from_safetensors with a prefix (seed naming)", seed_from_safetensors)

    FAMILIES = "checkpoint families"

    def family_from_safetensors(kind):
        """A transformers model's own state_dict (layer 1 among 2), loaded by its
        family's names, against nn.MultiheadAttention holding the same weights."""
        try:
            import transformers
            from safetensors.torch import save_file as save_torch
        except ImportError:
            print(f"  (transformers or safetensors not importable: {kind} not tested)")
            return 0.0
        E, H = 16, 4
        torch.manual_seed(3)
        if kind == "bert":
            cfg = transformers.BertConfig(hidden_size=E, num_attention_heads=H, num_hidden_layers=2,
                                          intermediate_size=32, vocab_size=50)
            model, prefix = transformers.BertModel(cfg), "encoder.layer.1.attention."
            names = ["self.query", "self.key", "self.value", "output.dense"]
        elif kind == "vit":
            cfg = transformers.ViTConfig(hidden_size=E, num_attention_heads=H, num_hidden_layers=2,
                                         intermediate_size=32, image_size=8, patch_size=4)
            model, prefix = transformers.ViTModel(cfg), "encoder.layer.1.attention."
            names = ["attention.query", "attention.key", "attention.value", "output.dense"]
        elif kind == "distilbert":
            cfg = transformers.DistilBertConfig(dim=E, n_heads=H, n_layers=2, hidden_dim=32, vocab_size=50)
            model, prefix = transformers.DistilBertModel(cfg), "transformer.layer.1.attention."
            names = ["q_lin", "k_lin", "v_lin", "out_lin"]
        else:
            cfg = transformers.GPT2Config(n_embd=E, n_head=H, n_layer=2, vocab_size=50, n_positions=16)
            model, prefix = transformers.GPT2Model(cfg), "h.1.attn."
            names = None
        sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        if kind == "vit" and "layers.1.attention.q_proj.weight" in sd:
            # transformers 5 keeps ViT as q/k/v/o_proj (Hub files keep attention.query: converted on load)
            prefix, names = "layers.1.attention.", ["q_proj", "k_proj", "v_proj", "o_proj"]
        with torch.no_grad():  # random biases: a zero-initialised one would hide a misplaced copy
            for k in sd:
                if k.startswith(prefix) and k.endswith("bias") and sd[k].ndim == 1:
                    sd[k].normal_()
        tm = torch.nn.MultiheadAttention(E, H, batch_first=True).double().eval()
        with torch.no_grad():
            if names is None:  # GPT-2's Conv1D: [in, out], q, k, v columns in turn
                tm.in_proj_weight.copy_(sd[prefix + "c_attn.weight"].t())
                tm.in_proj_bias.copy_(sd[prefix + "c_attn.bias"])
                tm.out_proj.weight.copy_(sd[prefix + "c_proj.weight"].t())
                tm.out_proj.bias.copy_(sd[prefix + "c_proj.bias"])
            else:
                tm.in_proj_weight.copy_(torch.cat([sd[prefix + n + ".weight"] for n in names[:3]]))
                tm.in_proj_bias.copy_(torch.cat([sd[prefix + n + ".bias"] for n in names[:3]]))
                tm.out_proj.weight.copy_(sd[prefix + names[3] + ".weight"])
                tm.out_proj.bias.copy_(sd[prefix + names[3] + ".bias"])
        x = torch.randn(2, 5, E)
        with torch.no_grad():
            ro = tm(x.double(), x.double(), x.double(), need_weights=False)[0]
        errs = []
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "model.safetensors")
            save_torch(sd, path)
            m = attn.MultiheadAttention.from_safetensors(path, H, prefix=prefix, batch_first=True)
            errs.append(rel(m(x, x, x, need_weights=False)[0], ro))
            # the same tensors through a names map (packed and Conv1D for GPT-2)
            if names is None:
                nm = {"q": "c_attn.weight", "k": "c_attn.weight", "v": "c_attn.weight", "o": "c_proj.weight",
                      "q_bias": "c_attn.bias", "k_bias": "c_attn.bias", "v_bias": "c_attn.bias", "o_bias": "c_proj.bias"}
                m2 = attn.MultiheadAttention.from_safetensors(path, H, prefix, names=nm, layout="conv1d",
                                                              batch_first=True)
            else:
                nm = dict(zip(["q", "k", "v", "o"], [n + ".weight" for n in names]))
                nm.update(zip(["q_bias", "k_bias", "v_bias", "o_bias"], [n + ".bias" for n in names]))
                m2 = attn.MultiheadAttention.from_safetensors(path, H, prefix, names=nm, batch_first=True)
            errs.append(rel(m2(x, x, x, need_weights=False)[0], ro))
            for bad in ({"q": "x"}, {"q": "a", "k": "b", "v": "c", "o": "d", "w": "e"}):
                try:
                    attn.MultiheadAttention.from_safetensors(path, H, prefix, names=bad)
                    raise AssertionError(f"names {bad} accepted")
                except ValueError:
                    pass
            try:
                attn.MultiheadAttention.from_safetensors(path, 3, prefix)
                raise AssertionError("num_heads 3 accepted for 16 features")
            except attn.AttnError as e:
                assert "num_heads 3" in str(e), str(e)
        return max(errs)

    def qwen3_from_safetensors():
        """Qwen3's own tensors (head_dim 8 != 16 / 4, 2 kv heads, q_norm/k_norm [D])
        and OLMo 2's whole-projection norms: sizes and values read back."""
        try:
            import transformers
            from safetensors.torch import save_file as save_torch
        except ImportError:
            print("  (transformers or safetensors not importable: Qwen3 not tested)")
            return 0.0
        torch.manual_seed(4)
        errs = []
        for kind in ("qwen3", "olmo2"):
            kw = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=32, vocab_size=50)
            if kind == "qwen3":
                model = transformers.Qwen3Model(transformers.Qwen3Config(head_dim=8, **kw))
            else:
                model = transformers.Olmo2Model(transformers.Olmo2Config(**kw))
            prefix = "layers.1.self_attn."
            sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
            for k in sd:  # norms start at 1: random values show a misplaced copy
                if "norm" in k:
                    sd[k].normal_()
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "model.safetensors")
                save_torch(sd, path)
                m = attn.MultiheadAttention.from_safetensors(path, 4, prefix, num_kv_heads=2, qk_norm_eps=1e-5)
            D = 8 if kind == "qwen3" else 4
            assert (m.head_dim, m.num_kv_heads, m.bias, m.qk_norm) == (D, 2, False,
                                                                      "per_head" if kind == "qwen3" else "whole"), m
            got = m.state_dict()
            pairs = [(got["q_proj_weight"], sd[prefix + "q_proj.weight"]),
                     (got["k_proj_weight"], sd[prefix + "k_proj.weight"]),
                     (got["out_proj.weight"], sd[prefix + "o_proj.weight"]),
                     (got["q_norm.weight"], sd[prefix + "q_norm.weight"]),
                     (got["k_norm.weight"], sd[prefix + "k_norm.weight"])]
            errs += [float(np.abs(a - b.numpy()).max()) for a, b in pairs]
        return max(errs)

    case(FAMILIES, "from_safetensors: Qwen3 (head_dim, per-head QK-norm) and OLMo 2 (whole) as saved",
         qwen3_from_safetensors)

    for kind in ("bert", "vit", "distilbert", "gpt2"):
        case(FAMILIES, f"from_safetensors: {kind}'s own state_dict, detected and by a names map",
             lambda kind=kind: family_from_safetensors(kind))

    def torch_names_numpy_dict():
        E, H = 16, 4
        tm = torch.nn.MultiheadAttention(E, H, batch_first=True).double().eval()
        m = attn.MultiheadAttention(E, H, batch_first=True)
        m.load_state_dict({k: v.numpy() for k, v in tm.state_dict().items()})  # a dict of arrays
        x = torch.randn(2, 6, E)
        ro, _ = tm(x.double(), x.double(), x.double())
        return rel(m(x.numpy(), x.numpy(), x.numpy())[0], ro)

    case(MHA, "load_state_dict from a dict of NumPy arrays, NumPy in and out", torch_names_numpy_dict)

    def torch_signature_and_dropout():
        """The constructor's positional arguments are torch's (dropout third, batch_first ninth); the
        layer's dropout acts while training (seeded here: the same as a dropout-free layer's forward
        with that dropout_p and seed), not after eval(), where it equals torch's in eval mode."""
        E, H = 16, 4
        args = (E, H, 0.25, True, False, False, None, None, True)
        tm = torch.nn.MultiheadAttention(*args).double()
        m = attn.MultiheadAttention(*args)
        assert (m.dropout, m.bias, m.batch_first, m.training) == (0.25, True, True, True), repr(m)
        plain = attn.MultiheadAttention(E, H, batch_first=True)
        m.load_state_dict(tm.state_dict())
        plain.load_state_dict(tm.state_dict())
        x = torch.randn(2, 7, E)
        dropped, _ = m(x, x, x, need_weights=False, dropout_seed=5)
        same, _ = plain(x, x, x, need_weights=False, dropout_p=0.25, dropout_seed=5)
        assert torch.equal(dropped, same), "the layer's dropout is not forward's dropout_p"
        assert m.eval() is m and not m.training
        kept, _ = m(x, x, x, need_weights=False)
        assert not torch.allclose(kept, dropped), "dropout changed nothing while training"
        for bad in (dict(add_bias_kv=True), dict(add_zero_attn=True), dict(device="cuda"),
                    dict(dtype=torch.float64), dict(dropout=1.5), dict(dropout=-0.1)):
            try:
                attn.MultiheadAttention(E, H, **bad)
                raise AssertionError(f"{bad} accepted")
            except ValueError:
                pass
        with torch.no_grad():
            ref, _ = tm.eval()(x.double(), x.double(), x.double(), need_weights=False)
        return rel(kept, ref)

    case(MHA, "torch's positional arguments; dropout while training, none after eval()", torch_signature_and_dropout)

    def dropout_everything():
        """dropout 1 drops every probability, so torch's answers are deterministic: zeros from
        the SDPA and its input gradients; from the layer, out_proj's bias, zero weights, and
        gradients only for out_proj.bias. Ours must be those, whatever the seed."""
        E, H = 16, 4
        q, k, v = (torch.randn(2, H, 6, 8, requires_grad=True) for _ in range(3))
        errs = []
        for api in ("torch", "ours"):
            if api == "torch":
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
            else:
                o = attn.scaled_dot_product_attention(q, k, v, dropout_p=1.0, dropout_seed=3)
            g = torch.autograd.grad(o.sum(), (q, k, v))
            if api == "torch":
                want = [o.detach()] + [x.detach() for x in g]
            else:
                errs += [rel(a.detach(), b) for a, b in zip([o] + list(g), want)]
        assert all(float(w.abs().max()) == 0 for w in want), "torch's dropout 1 is no longer zeros"
        tm = torch.nn.MultiheadAttention(E, H, 1.0, batch_first=True)
        with torch.no_grad():
            tm.out_proj.bias.normal_()
        m = attn.MultiheadAttention(E, H, 1.0, batch_first=True)
        m.load_state_dict(tm.state_dict())
        x = torch.randn(2, 7, E, requires_grad=True)
        to, tw = tm(x, x, x)
        ours, ow = m(x.detach(), x.detach(), x.detach())
        errs += [rel(ours, to.detach()), rel(ow, tw.detach())]
        G = torch.randn(2, 7, E)
        tg = dict(zip(["x"] + [n for n, _ in tm.named_parameters()],
                      torch.autograd.grad((to * G).sum(), [x] + [p for _, p in tm.named_parameters()])))
        og = m.grad(x.detach(), x.detach(), x.detach(), G, dropout_seed=8)
        errs += [rel(og["query"], tg["x"])] + [rel(og[n], tg[n]) for n in ("in_proj_weight", "in_proj_bias",
                                                                          "out_proj.weight", "out_proj.bias")]
        assert float(tg["out_proj.bias"].abs().max()) > 0 and float(tg["in_proj_weight"].abs().max()) == 0
        return max(errs)

    case(MHA, "dropout 1 (every probability dropped): torch's zeros in the SDPA, its gradients and the layer",
         dropout_everything)

# ---- the KV cache: step by step through attn.KVCache equals one causal pass (NumPy reference) ----
KV = "kv cache"


def round_to(x, dtype):
    """x as the cache stores it: rounded to float16 or bfloat16 (nearest even), back in float32."""
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        return u.astype(np.uint32).view(np.float32)
    return x


def kv_steps(dtype, steps, Hq, Hk, D):
    B, T = 2, sum(steps)
    q, k, v = randn(B, Hq, T, D), randn(B, Hk, T, D), randn(B, Hk, T, D)
    kr, vr = round_to(k, dtype), round_to(v, dtype)
    worst_err, at = 0.0, 0
    with attn.KVCache(B, T + 2, Hk, D, dtype=dtype) as c:
        for n in steps:
            c.append(k[:, :, at:at + n], v[:, :, at:at + n])  # strided views, no copies
            out = c.attend(q[:, :, at:at + n])
            ref, _ = np_sdpa(q[:, :, at:at + n], kr[:, :, :at + n], vr[:, :, :at + n], causal="bottom-right")
            worst_err = max(worst_err, rel(out, ref))
            at += n
        assert c.lengths == (T, T), c.lengths
    return worst_err


def kv_rows_and_rollback():
    B, Hq, Hk, D, N = 3, 4, 2, 16, 20
    k, v, q = randn(B, Hk, N, D), randn(B, Hk, N, D), randn(B, Hq, 2, D)
    with attn.KVCache(B, 25, Hk, D) as c:
        c.append(k, v, n_new=[20, 6, 0])
        c.truncate(11, row=0)
        c.copy_row(2, 1)
        try:
            c.append(k, v)  # 11 + 20 > 25 for row 0: refused, nothing appended
            raise AssertionError("append past capacity accepted")
        except attn.AttnError:
            pass
        assert c.lengths == (11, 6, 6), c.lengths
        out = c.attend(q)
        err = 0.0
        for b, (src, n) in enumerate([(0, 11), (1, 6), (1, 6)]):
            ref, _ = np_sdpa(q[b:b + 1], k[src:src + 1, :, :n], v[src:src + 1, :, :n], causal="bottom-right")
            err = max(err, rel(out[b:b + 1], ref))
    return err


case(KV, "f32 cache, token by token, GQA 4/2", lambda: kv_steps("float32", [1] * 9, 4, 2, 32))
case(KV, "f32 cache, uneven chunks, MQA 8/1", lambda: kv_steps("float32", [7, 1, 1, 40, 1], 8, 1, 64))
case(KV, "f16 cache against the rounded keys and values", lambda: kv_steps("float16", [5, 1, 1, 30, 1], 8, 2, 64))
case(KV, "bf16 cache against the rounded keys and values", lambda: kv_steps("bfloat16", [5, 1, 1, 30, 1], 4, 4, 32))
case(KV, "rows of different lengths, truncate, copy_row, a refused append", kv_rows_and_rollback)

if torch is not None:
    def mha_decode(batch_first):
        E, H, T = 32, 4, 9
        tm = torch.nn.MultiheadAttention(E, H, batch_first=batch_first).double().eval()
        m = attn.MultiheadAttention(E, H, batch_first=batch_first)
        m.load_state_dict(tm.state_dict())
        x = torch.randn(2, T, E) if batch_first else torch.randn(T, 2, E)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        with torch.no_grad():
            ref = tm(x.double(), x.double(), x.double(), attn_mask=causal, need_weights=False)[0]
        cache = m.new_cache(2, T)
        steps = [x[:, t:t + 1] if batch_first else x[t:t + 1] for t in range(T)]
        out = torch.cat([torch.as_tensor(m.forward_cached(s, cache)) for s in steps], 1 if batch_first else 0)
        return rel(out, ref)

    case("mha decode", "forward_cached token by token vs nn.MultiheadAttention causal, batch_first",
         lambda: mha_decode(True))
    case("mha decode", "forward_cached token by token vs nn.MultiheadAttention causal, seq first",
         lambda: mha_decode(False))

# ---- the options of recent models, against a NumPy float64 reference ----
def options_case(window=None, softcap=None, alibi=False, sinks=False, chunk=None):
    B, H, Hk, L, S, D = 2, 4, 2, 9, 23, 16
    q, k, v = randn(B, H, L, D), randn(B, Hk, S, D), randn(B, Hk, S, D)
    sk = rng.standard_normal(H).astype(np.float32) if sinks else None
    slopes = np.array([2.0 ** (-8 * (h + 1) / H) for h in range(H)])  # the paper's rule for a power of two
    banded = window is not None or chunk is not None
    out = attn.scaled_dot_product_attention(q, k, v, is_causal=banded, causal_align="bottom-right",
                                            enable_gqa=True, window=window, softcap=softcap, alibi=alibi,
                                            sinks=sk, chunk=chunk)
    kk, vv = (np.repeat(x.astype(np.float64), H // Hk, axis=1) for x in (k, v))
    s = q.astype(np.float64) @ np.swapaxes(kk, -1, -2) / math.sqrt(D)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    qpos = np.arange(L)[:, None] + (S - L if banded else 0)
    j = np.arange(S)[None, :]
    if alibi:
        s = s + slopes[None, :, None, None] * (j - qpos)[None, None]
    if window is not None:
        s = np.where((j <= qpos) & (j > qpos - window), s, -np.inf)
    if chunk is not None:  # Llama 4's chunked mask: the same chunk, causal
        s = np.where((j <= qpos) & (j // chunk == qpos // chunk), s, -np.inf)
    m = s.max(-1, keepdims=True)
    if sinks:
        m = np.maximum(m, sk.astype(np.float64)[None, :, None, None])
    p = np.exp(s - m)
    den = p.sum(-1, keepdims=True) + (np.exp(sk.astype(np.float64)[None, :, None, None] - m) if sinks else 0)
    return rel(out, (p / den) @ vv)


OPT = "options"
case(OPT, "window 5 (bottom-right)", lambda: options_case(window=5))
case(OPT, "softcap 2", lambda: options_case(softcap=2.0))
case(OPT, "ALiBi, the paper's slopes", lambda: options_case(alibi=True))
case(OPT, "sinks", lambda: options_case(sinks=True))
case(OPT, "all four", lambda: options_case(window=7, softcap=3.0, alibi=True, sinks=True))
case(OPT, "chunk 6 (bottom-right)", lambda: options_case(chunk=6))
case(OPT, "chunk 8 with window 5, softcap, ALiBi and sinks", lambda: options_case(window=5, softcap=3.0, alibi=True,
                                                                                   sinks=True, chunk=8))


def cache_chunk_case():
    """KVCache.attend(chunk=) token by token equals scaled_dot_product_attention(chunk=) over the whole sequence."""
    B, H, Hk, T, D, C = 2, 4, 2, 21, 16, 5
    q, k, v = randn(B, H, T, D), randn(B, Hk, T, D), randn(B, Hk, T, D)
    ref = attn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, chunk=C)
    cache = attn.KVCache(B, T, Hk, D)
    got = []
    for t in range(T):
        cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        got.append(cache.attend(q[:, :, t:t + 1], chunk=C))
    return rel(np.concatenate(got, 2), ref)


case(OPT, "chunk 5 through a KV cache, token by token", cache_chunk_case)


def layer_options_case():
    """MultiheadAttention.forward with every option of recent models (and seeded dropout) equals its
    projections composed by hand around scaled_dot_product_attention with the same options."""
    E, H, B, L = 32, 4, 2, 11
    m = attn.MultiheadAttention(E, H, batch_first=True)
    w, b = randn(3 * E, E) * 0.2, randn(3 * E) * 0.1
    wo, bo = randn(E, E) * 0.2, randn(E) * 0.1
    m.load_state_dict({"in_proj_weight": w, "in_proj_bias": b, "out_proj.weight": wo, "out_proj.bias": bo})
    x = randn(B, L, E)
    kw = dict(window=4, softcap=5.0, alibi=True, sinks=randn(H), dropout_p=0.25, dropout_seed=11, scale=0.3,
              chunk=6)
    got, _ = m(x, x, x, need_weights=False, **kw)
    heads = lambda t: t.reshape(B, L, H, E // H).transpose(0, 2, 1, 3)
    q, k, v = (heads(x @ w[i * E:(i + 1) * E].T + b[i * E:(i + 1) * E]) for i in range(3))
    a = attn.scaled_dot_product_attention(q, k, v, **kw).transpose(0, 2, 1, 3).reshape(B, L, E)
    return rel(got, a.astype(np.float64) @ wo.T + bo)


case(OPT, "the layer: scale, window, chunk, softcap, ALiBi, sinks and seeded dropout in MultiheadAttention.forward",
     layer_options_case)


def cache_options_case(paged):
    """KVCache.attend / PagedKVCache.attend with a scale, window, softcap, ALiBi and sinks, in uneven steps:
    scaled_dot_product_attention (bottom-right causal) over the tokens appended so far."""
    B, Hq, Hk, D, steps = 2, 4, 2, 16, [6, 1, 1, 9, 1, 1]
    T = sum(steps)
    kw = dict(window=5, softcap=4.0, alibi=True, sinks=randn(Hq), scale=0.3)
    q, k, v = randn(B, Hq, T, D), randn(B, Hk, T, D), randn(B, Hk, T, D)
    c = attn.PagedKVCache(16, 4, Hk, D) if paged else attn.KVCache(B, T, Hk, D)
    seqs = [c.new_seq() for _ in range(B)] if paged else None
    err, at = 0.0, 0
    for n in steps:
        if paged:
            c.append(seqs, k[:, :, at:at + n], v[:, :, at:at + n])
            out = c.attend(seqs, q[:, :, at:at + n], **kw)
        else:
            c.append(k[:, :, at:at + n], v[:, :, at:at + n])
            out = c.attend(q[:, :, at:at + n], **kw)
        ref = attn.scaled_dot_product_attention(q[:, :, at:at + n], k[:, :, :at + n], v[:, :, :at + n],
                                                is_causal=True, causal_align="bottom-right", enable_gqa=True, **kw)
        err = max(err, rel(out, ref))
        at += n
    c.close()
    return err


case(OPT, "KVCache.attend: scale, window, softcap, ALiBi and sinks, step by step", lambda: cache_options_case(False))
case(OPT, "PagedKVCache.attend: scale, window, softcap, ALiBi and sinks, step by step",
     lambda: cache_options_case(True))


def layer_cached_options_case():
    """MultiheadAttention.forward_cached token by token with a window, softcap, ALiBi and sinks equals
    forward over the whole sequence, causal, with the same options."""
    E, H, B, T = 32, 4, 2, 10
    m = attn.MultiheadAttention(E, H, batch_first=True)
    m.load_state_dict({"in_proj_weight": randn(3 * E, E) * 0.2, "in_proj_bias": randn(3 * E) * 0.1,
                       "out_proj.weight": randn(E, E) * 0.2, "out_proj.bias": randn(E) * 0.1})
    x = randn(B, T, E)
    kw = dict(window=3, softcap=5.0, alibi=True, sinks=randn(H), scale=0.3)
    whole, _ = m(x, x, x, need_weights=False, is_causal=True, **kw)
    cache = m.new_cache(B, T)
    steps = np.concatenate([m.forward_cached(x[:, t:t + 1], cache, **kw) for t in range(T)], axis=1)
    return rel(steps, whole)


case(OPT, "the layer: forward_cached with a scale, window, softcap, ALiBi and sinks, token by token",
     layer_cached_options_case)


# ---- half precision: our error beside PyTorch's, both against float64 on the same rounded inputs ----
def half_case(dtype, B, H, Hk, L, S, D, causal=False, kpm=False, window=None, softcap=None):
    """Ours (the context's default precision: bf16 tiles where the CPU has them) against
    PyTorch's SDPA in the same dtype; the bound is PyTorch's own error (its out in dtype)."""
    q, k, v = (torch.from_numpy(randn(B, h, n, D)).to(dtype) for h, n in ((H, L), (Hk, S), (Hk, S)))
    mask = None
    kp = None
    if kpm:
        kp = torch.zeros(B, S, dtype=torch.bool)
        kp[:, S - S // 4:] = True
        mask = ~kp[:, None, None, :]
    if window is not None:
        i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
        band = (j <= i) & (j > i - window)
        mask = band if mask is None else mask & band
    ours = attn.scaled_dot_product_attention(q, k, v, is_causal=causal and window is None, enable_gqa=H != Hk,
                                             key_padding_mask=kp, window=window, softcap=softcap)

    def torch_sdpa(q, k, v):
        if softcap is not None:  # the logits' cap, written out: PyTorch's SDPA has none
            kk = k.repeat_interleave(H // Hk, 1) if H != Hk else k
            vv = v.repeat_interleave(H // Hk, 1) if H != Hk else v
            s = q @ kk.transpose(-1, -2) / math.sqrt(D)
            s = softcap * torch.tanh(s / softcap)
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            return torch.softmax(s.float(), -1).to(q.dtype) @ vv
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                              enable_gqa=H != Hk)
    theirs = torch_sdpa(q, k, v)
    ref = torch_sdpa(q.double(), k.double(), v.double())
    return rel(ours, ref), rel(theirs.double(), ref)


if torch is not None:
    HALF = "half precision"
    for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "f16")):
        case(HALF, f"{name}: H8 N256 D64, no worse than PyTorch {name} SDPA", lambda dt=dt: half_case(dt, 1, 8, 8, 256, 256, 64))
        case(HALF, f"{name}: causal H4 N300 D128", lambda dt=dt: half_case(dt, 1, 4, 4, 300, 300, 128, causal=True))
        case(HALF, f"{name}: GQA 8/2 N200 S333 D80, key padding", lambda dt=dt: half_case(dt, 2, 8, 2, 200, 333, 80, kpm=True))
        case(HALF, f"{name}: window 40, softcap 30, N190 D64",
             lambda dt=dt: half_case(dt, 1, 4, 4, 190, 190, 64, window=40, softcap=30.0))


def f16_policy_case(B, H, L, D, causal=False):
    """float32 inputs under precision='f16' where the AMX f16 tiles run (kernel amx; these shapes take
    them): rounded to f16, then as f16 inputs, against PyTorch's f16 SDPA on the same f16 values, both
    against float64 on those values. Elsewhere attn.h's F16 leaves them fp32, unrounded: held to TOL
    against float64 on the f32 values."""
    q, k, v = (torch.from_numpy(randn(B, H, L, D)).float() for _ in range(3))
    ours = attn.scaled_dot_product_attention(q, k, v, is_causal=causal, precision="f16")
    if _capi.lib.attn_kernel_name(_capi.lib.attn_ctx_kernel(attn._context._ctx().h)).decode() != "amx":
        return rel(ours, F.scaled_dot_product_attention(*(x.double() for x in (q, k, v)), is_causal=causal))
    h = [x.half() for x in (q, k, v)]
    theirs = F.scaled_dot_product_attention(*h, is_causal=causal)
    ref = F.scaled_dot_product_attention(*(x.double() for x in h), is_causal=causal)
    return rel(ours, ref), rel(theirs.double(), ref)


if torch is not None:
    case(HALF, "f32 under precision='f16': H8 N256 D64, no worse than PyTorch f16 SDPA",
         lambda: f16_policy_case(1, 8, 256, 64))
    case(HALF, "f32 under precision='f16': causal H4 N300 D128", lambda: f16_policy_case(1, 4, 300, 128, causal=True))


def half_bwd_case(dtype, B, H, Hk, L, S, D, causal=False, kpm=False):
    """The half backward (autograd through ours: the bf16 or f16 backward tiles where the CPU has
    AMX, else fp32) beside PyTorch's SDPA backward in the same dtype, both against float64 autograd
    on the same q, k, v and dout in dtype; the error is the worst of dq, dk and dv, the bound PyTorch's."""
    q, k, v = (torch.from_numpy(randn(B, h, n, D)).to(dtype) for h, n in ((H, L), (Hk, S), (Hk, S)))
    G = torch.from_numpy(randn(B, H, L, D)).to(dtype)
    kp = None
    mask = None
    if kpm:
        kp = torch.zeros(B, S, dtype=torch.bool)
        kp[:, S - S // 4:] = True
        mask = ~kp[:, None, None, :]

    def grads(dt, fn):
        leaves = [x.detach().clone().to(dt).requires_grad_() for x in (q, k, v)]
        o = fn(*leaves)  # ours is float32 (exact values of G), PyTorch's in its inputs' dtype
        o.backward(G.to(o.dtype))
        return [x.grad.double() for x in leaves]

    def theirs(q_, k_, v_):
        return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, is_causal=causal and mask is None,
                                              enable_gqa=H != Hk)

    def ours(q_, k_, v_):
        return attn.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=H != Hk,
                                                 key_padding_mask=kp)
    ref = grads(torch.float64, theirs)
    got, pt = grads(dtype, ours), grads(dtype, theirs)
    return max(rel(a, b) for a, b in zip(got, ref)), max(rel(a, b) for a, b in zip(pt, ref))


if torch is not None:
    for shape, kw in (("H8 N256 D64", dict(B=1, H=8, Hk=8, L=256, S=256, D=64)),
                      ("causal H4 N300 D128", dict(B=1, H=4, Hk=4, L=300, S=300, D=128, causal=True)),
                      ("GQA 8/2 N200 S333 D64, key padding", dict(B=2, H=8, Hk=2, L=200, S=333, D=64, kpm=True))):
        for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "f16")):
            case(HALF, f"{name} backward: {shape}, no worse than PyTorch's {name} backward",
                 lambda kw=kw, dt=dt: half_bwd_case(dt, **kw))


# ---- rotary embeddings: attn.rope against transformers' own rotary code ----------------
def hf_rope_case(rope_parameters, ours_kw, N=40, D=64, max_positions=2048, partial=None, positions=None):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    cfg = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, head_dim=D, rope_parameters=rope_parameters,
                      max_position_embeddings=max_positions)
    if partial is not None:
        cfg.partial_rotary_factor = partial
    q = torch.from_numpy(randn(2, 4, N, D))
    pos = torch.arange(N).expand(2, N) if positions is None else positions
    cos, sin = LlamaRotaryEmbedding(cfg)(q, pos)
    r = cos.shape[-1]
    want, _ = apply_rotary_pos_emb(q[..., :r], q[..., :r], cos, sin)
    want = torch.cat([want, q[..., r:]], -1)
    return rel(attn.rope(q, pos, rotary_dim=r, **ours_kw), want.double())


def gptj_rope_case():
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions
    N, D, r = 33, 64, 32
    x = torch.from_numpy(randn(2, N, 4, r))  # GPT-J's [B, N, H, rotary] layout
    sincos = create_sinusoidal_positions(N, r)[torch.arange(N)][None]
    sin, cos = torch.split(sincos, r // 2, dim=-1)
    want = apply_rotary_pos_emb(x, sin, cos).transpose(1, 2)
    return rel(attn.rope(x.transpose(1, 2), layout="interleaved"), want.double())


try:
    import transformers  # noqa: F401
    have_transformers = torch is not None
except ImportError:
    have_transformers = False
if have_transformers:
    ROPE = "rope, qk-norm vs transformers"
    case(ROPE, "Llama default, theta 10000", lambda: (hf_rope_case({"rope_type": "default", "rope_theta": 10000.0}, {}), 1e-4))
    case(ROPE, "linear x4", lambda: (hf_rope_case({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
                                                  dict(scaling="linear", factor=4.0)), 1e-4))
    case(ROPE, "dynamic NTK x2, N 40 past P 16",
         lambda: (hf_rope_case({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
                               dict(scaling="dynamic", factor=2.0, original_max_position=16), max_positions=16), 1e-4))
    case(ROPE, "llama3 x8, theta 5e5",
         lambda: (hf_rope_case({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                               dict(theta=500000.0, scaling="llama3", factor=8.0, original_max_position=64)), 1e-4))
    case(ROPE, "yarn x4",
         lambda: (hf_rope_case({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                "original_max_position_embeddings": 64},
                               dict(scaling="yarn", factor=4.0, original_max_position=64), max_positions=256), 1e-4))
    case(ROPE, "yarn x32, truncate false (gpt-oss: theta 150000, beta 32/1, P 4096)",
         lambda: (hf_rope_case({"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
                               dict(theta=150000.0, scaling="yarn", factor=32.0, original_max_position=4096,
                                    yarn_truncate=False), positions=torch.arange(0, 40 * 25, 25).expand(2, 40),
                               max_positions=131072), 1e-4))
    lr_short, lr_long = (1 + np.arange(32) / 31).tolist(), (1 + 30 * np.arange(32) / 31).tolist()
    for regime, step in (("positions within P: short_factor", 1), ("positions past P: long_factor", 7)):
        case(ROPE, f"longrope (Phi-3), {regime}",
             lambda step=step: (hf_rope_case({"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": lr_short,
                                              "long_factor": lr_long, "original_max_position_embeddings": 64},
                                             dict(scaling="longrope", factor=1024 / 64, original_max_position=64,
                                                  short_factor=lr_short, long_factor=lr_long),
                                             positions=torch.arange(0, 40 * step, step).expand(2, 40),
                                             max_positions=1024), 1e-4))
    case(ROPE, "partial rotary 0.5 (GPT-NeoX, Phi)",
         lambda: (hf_rope_case({"rope_type": "default", "rope_theta": 10000.0}, {}, partial=0.5), 1e-4))
    case(ROPE, "left-padded positions per row",
         lambda: (hf_rope_case({"rope_type": "default", "rope_theta": 10000.0}, {}, N=12,
                               positions=torch.tensor([[0] * 4 + list(range(8)), list(range(100, 112))])), 1e-4))
    case(ROPE, "interleaved pairs (GPT-J), rotary 32 of 64", lambda: (gptj_rope_case(), 1e-4))

    def hf_norm_case(cls_path, kind):
        import importlib
        mod, name = cls_path.rsplit(".", 1)
        cls = getattr(importlib.import_module(mod), name)
        F_ = 64
        norm = cls(F_, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.from_numpy(randn(F_)))
        x = torch.from_numpy(randn(2, 4, 7, F_))
        return rel(attn.head_norm(x, norm.weight.detach(), kind=kind, eps=1e-6), norm(x).detach().double()), 1e-5
    case(ROPE, "QK-norm: Qwen3RMSNorm",
         lambda: hf_norm_case("transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm", "rms"))
    case(ROPE, "QK-norm: Gemma3RMSNorm (1 + weight)",
         lambda: hf_norm_case("transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm", "rms_plus_one"))

    def hf_attention_case(family, rope_parameters, ours_rope, bias):
        """transformers' own attention module (eager) against attn.MultiheadAttention loaded from its
        state dict as saved, with RoPE at per-row positions and a causal mask."""
        import importlib
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        cap = {"llama": "Llama", "qwen2": "Qwen2"}[family]
        cfg = getattr(mod, f"{cap}Config")(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                           rope_parameters=rope_parameters, max_position_embeddings=256,
                                           **({"attention_bias": bias} if family == "llama" else {}))
        cfg._attn_implementation = "eager"
        module = getattr(mod, f"{cap}Attention")(cfg, layer_idx=0).eval()
        with torch.no_grad():
            for p_ in module.parameters():
                p_.copy_(torch.from_numpy(randn(*p_.shape)) * 0.2)
        B, L = 2, 37
        x = torch.from_numpy(randn(B, L, 128))
        pos = torch.stack([torch.arange(L), torch.arange(L) + 5])  # row 1 continues a longer sequence
        cos, sin = getattr(mod, f"{cap}RotaryEmbedding")(cfg)(x, pos)
        mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            want, _ = module(x, (cos, sin), mask)
        layer = attn.MultiheadAttention(128, 8, bias=bias, batch_first=True, num_kv_heads=2)
        layer.load_state_dict(dict(module.state_dict()))
        got, _ = layer(x, x, x, need_weights=False, is_causal=True, rope=ours_rope, positions=pos)
        return rel(got, want.double()), 1e-4
    case(ROPE, "LlamaAttention (llama3 RoPE, GQA 8/2) as saved, positions per row",
         lambda: hf_attention_case("llama", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64},
                                   dict(theta=500000.0, scaling="llama3", factor=8.0, original_max_position=64), False))
    case(ROPE, "Qwen2Attention (q/k/v biases, o without) as saved",
         lambda: hf_attention_case("qwen2", {"rope_type": "default", "rope_theta": 1000000.0},
                                   dict(theta=1000000.0), True))
else:
    print("(transformers not importable: the rope-vs-transformers cases were not run)")


# ---------------------------------------------------------------------------
# Checkpoint families as saved: each model built by transformers from a small
# config (random weights, no download), saved with save_pretrained, and layer L
# loaded by attn.MultiheadAttention.from_hf from that folder. The reference is
# the model's own attention module inside a full forward (hooks capture its
# input, the arguments the model gave it, and its output), so the RoPE, masks,
# windows and scales are the model's. Checked: the forward against the module
# in fp32 (<= 1e-4) and against libattn's float64 oracle (ATTN_KERNEL=ref,
# <= 1e-5); the gradients of the input and the q, o (and QK-norm) weights
# against autograd through the module in float64; and token by token through
# the KV cache against the module's causal output.
# ---------------------------------------------------------------------------
def _hf_build(kind, L):
    import tempfile
    import transformers as tf
    tiny = dict(vocab_size=32, max_position_embeddings=128)
    dec = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, **tiny)
    if kind.startswith("llama_"):
        rp = {"default": {"rope_type": "default", "rope_theta": 10000.0},
              "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
              "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
              "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
              "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                       "original_max_position_embeddings": 16}}[kind.split("_")[1]]
        model = tf.LlamaForCausalLM(tf.LlamaConfig(rope_parameters=rp, **dec))
    elif kind == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(sliding_window=5, **dec))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**dec))
    elif kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=32, **dec))
    elif kind == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(head_dim=16, attn_logit_softcapping=3.0, query_pre_attn_scalar=24,
                                                     sliding_window=6, **dec))
    elif kind == "gemma3":
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
                                                         rope_local_base_freq=10000.0, **dec))
    elif kind == "olmo2":
        model = tf.Olmo2ForCausalLM(tf.Olmo2Config(**dec))
    elif kind == "smollm3":  # layer 1 takes no RoPE (no_rope_layers)
        model = tf.SmolLM3ForCausalLM(tf.SmolLM3Config(no_rope_layers=[1, 0, 1], pad_token_id=0, **dec))
    elif kind == "phi3":  # q, k, v packed in qkv_proj; longrope past P = 8 (13 tokens); partial rotary 0.5
        n = 4  # rotary pairs: head_dim 16 x 0.5 / 2
        rp = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.2, 1.5, 2.0],
              "long_factor": [1.0, 3.0, 9.0, 27.0][:n], "original_max_position_embeddings": 8}
        model = tf.Phi3ForCausalLM(tf.Phi3Config(rope_parameters=rp, partial_rotary_factor=0.5, pad_token_id=0,
                                                 original_max_position_embeddings=8,  # else its 4096 replaces rp's
                                                 **{**dec, "max_position_embeddings": 64}))
        assert model.config.rope_parameters["original_max_position_embeddings"] == 8, model.config.rope_parameters
    elif kind.startswith("gpt_oss"):  # learned sinks; YaRN without rounding its band (theta, P: a band of 2 pairs)
        rp = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
              "truncate": False, "original_max_position_embeddings": 64}
        model = tf.GptOssForCausalLM(tf.GptOssConfig(
            head_dim=16, sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            num_local_experts=4, num_experts_per_tok=2, rope_parameters=rp, attention_bias=True,
            **{**dec, "max_position_embeddings": 131072}))
    elif kind == "cohere":  # RoPE over interleaved pairs
        model = tf.CohereForCausalLM(tf.CohereConfig(pad_token_id=0, **dec))
    elif kind == "cohere_qk_norm":  # and a LayerNorm of q and k, each head its own weights
        model = tf.CohereForCausalLM(tf.CohereConfig(pad_token_id=0, use_qk_norm=True, **dec))
    elif kind.startswith("cohere2"):  # layers 0, 1 sliding with RoPE, layer 2 full without
        model = tf.Cohere2ForCausalLM(tf.Cohere2Config(sliding_window=5, sliding_window_pattern=3, pad_token_id=0, **dec))
    elif kind == "glm4":  # interleaved pairs over half the head (partial_rotary_factor's default)
        model = tf.Glm4ForCausalLM(tf.Glm4Config(head_dim=16, pad_token_id=0, **dec))
    elif kind.startswith("exaone4"):  # QK-norm; the full layer 2 without RoPE, as a window is set
        model = tf.Exaone4ForCausalLM(tf.Exaone4Config(sliding_window=5, sliding_window_pattern=3, pad_token_id=0,
                                                       **dec))
    elif kind.startswith("olmo3"):  # whole-projection QK-norm; YaRN on the full layer 3 only
        rs = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
        model = tf.Olmo3ForCausalLM(tf.Olmo3Config(sliding_window=5, rope_scaling=rs, pad_token_id=0,
                                                   **{**dec, "num_hidden_layers": 4}))
    elif kind == "olmo_clip":  # clip_qkv: q, k, v clamped after their projections
        model = tf.OlmoForCausalLM(tf.OlmoConfig(clip_qkv=2.0, pad_token_id=0, **dec))
    elif kind == "olmoe_clip":  # clip_qkv after the whole-projection QK-norm
        model = tf.OlmoeForCausalLM(tf.OlmoeConfig(clip_qkv=0.3, num_experts=4, num_experts_per_tok=2, pad_token_id=0,
                                                   **dec))
    elif kind.startswith("llama4_chunk"):  # layers 0, 1 chunked (chunks of 5) with interleaved RoPE, layer 2 full
        # without; dense MLPs; its weightless QK-norm and NoPE temperature off (libattn refuses them)
        model = tf.Llama4ForCausalLM(tf.Llama4TextConfig(
            attention_chunk_size=5, use_qk_norm=False, attn_temperature_tuning=False, moe_layers=[],
            no_rope_layers=[1, 1, 0], intermediate_size_mlp=96, head_dim=16, pad_token_id=0, **dec))
        assert model.config.layer_types == ["chunked_attention", "chunked_attention", "full_attention"]
    elif kind == "granite":  # attention_multiplier as the logits' scale
        model = tf.GraniteForCausalLM(tf.GraniteConfig(attention_multiplier=0.3, pad_token_id=0, **dec))
    elif kind.startswith("phi_"):  # q/k/v_proj and dense, all biased; partial rotary 0.5; a biased LayerNorm of q, k
        model = tf.PhiForCausalLM(tf.PhiConfig(qk_layernorm=kind == "phi_qk_layernorm", pad_token_id=0, **dec))
    elif kind.startswith("stablelm"):  # partial rotary 0.25; qk_layernorm: a LayerNorm per head, saved per head
        model = tf.StableLmForCausalLM(tf.StableLmConfig(qk_layernorm=kind == "stablelm_qk_layernorm", pad_token_id=0,
                                                         **dec))
    elif kind == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=32, n_positions=128,
                                                 scale_attn_by_inverse_layer_idx=True))
    elif kind == "bert":
        model = tf.BertModel(tf.BertConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                           intermediate_size=96, **tiny), add_pooling_layer=False)
    elif kind == "t5":
        model = tf.T5EncoderModel(tf.T5Config(d_model=64, d_kv=24, num_heads=4, d_ff=96, num_layers=3,
                                              vocab_size=32))
    else:
        raise ValueError(kind)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for p_ in model.parameters():
            p_.copy_(torch.from_numpy(randn(*p_.shape)) * 0.3)
    model.eval()
    folder = tempfile.mkdtemp(prefix=f"attn_hf_{kind}_")
    model.save_pretrained(folder, safe_serialization=True)
    if kind.endswith("_hub"):
        _hub_form(folder, model.config, {"sliding_window_pattern": 3} if kind.startswith("cohere2") else {})
    return model, folder


def _hub_form(folder, config, extra):
    """Rewrites folder's config.json as the Hub keeps these families (saved before transformers 5):
    no layer_types (the family's period says which layers slide), rope_theta and rope_scaling at
    the top; then checks that transformers reads the rewritten file back into the model's own
    layer types and RoPE, so that the file is the same model."""
    import json
    import transformers as tf
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        c = json.load(f)
    c.pop("layer_types", None)
    c.update(extra)  # what transformers 5 reads once and no longer saves (Cohere 2's period)
    rp = c.pop("rope_parameters")
    full = rp.get("full_attention", rp)
    c["rope_theta"] = full["rope_theta"]
    if full.get("rope_type", "default") != "default":
        c["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    with open(path, "w") as f:
        json.dump(c, f)
    back = tf.AutoConfig.from_pretrained(folder)
    assert back.layer_types == config.layer_types, (back.layer_types, config.layer_types)
    assert back.rope_parameters == config.rope_parameters, (back.rope_parameters, config.rope_parameters)


def _hf_attention_module(model, kind, L):
    if kind == "gpt2":
        return model.transformer.h[L].attn
    if kind == "bert":
        return model.encoder.layer[L].attention
    if kind == "t5":
        return model.encoder.block[L].layer[0].SelfAttention
    return model.model.layers[L].self_attn


def _hf_run(model, kind, L, ids, mask, module=None):
    """The attention module's input, call and output inside the model's forward. module (a float64
    copy of the attention module): call runs it instead, on the model's arguments in float64."""
    mod = _hf_attention_module(model, kind, L)
    inner = mod.self if kind == "bert" else mod
    got = {}

    def pre(m, args, kwargs):
        got["args"], got["kwargs"] = args, kwargs

    def post(m, args, kwargs, out):
        got["out"] = out
    h1 = inner.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = inner.register_forward_hook(post, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **({} if kind in ("bert", "t5") else {"use_cache": False}))
    finally:
        h1.remove()
        h2.remove()
    x = got["kwargs"].get("hidden_states", got["args"][0] if got["args"] else None)

    def as64(a):
        if torch.is_tensor(a) and a.is_floating_point():
            return a.double()
        return tuple(as64(e) for e in a) if isinstance(a, tuple) else a
    run, outer = inner, mod
    if module is not None:
        run, outer = (module.self if kind == "bert" else module), module
        got["args"] = tuple(as64(a) for a in got["args"])
        got["kwargs"] = {k: as64(v) for k, v in got["kwargs"].items()}

    def call(xin):  # the module on xin with the model's own other arguments; the attention output [B, N, E]
        args = (xin,) + tuple(got["args"][1:]) if got["args"] else ()
        kw = dict(got["kwargs"])
        if not got["args"]:
            kw["hidden_states"] = xin
        o = run(*args, **kw)
        o = o[0] if isinstance(o, tuple) else o
        return outer.output.dense(o) if kind == "bert" else o
    extra = None
    if kind == "t5":  # the relative position bias (with the padding mask folded in) the model passed along
        pb = got["out"][1] if isinstance(got["out"], tuple) and len(got["out"]) > 1 else None
        extra = pb
    return x, call, extra


def _hf_grads_torch(mod, kind, E):
    """Gradients the module's parameters got: q weight [H*D, E], o weight [E, H*D] (Linear layout), norms."""
    if kind == "gpt2":
        return {"q": mod.c_attn.weight.grad[:, :E].T, "o": mod.c_proj.weight.grad.T}
    if kind == "bert":
        return {"q": mod.self.query.weight.grad, "o": mod.output.dense.weight.grad}
    if kind == "t5":
        return {"q": mod.q.weight.grad, "o": mod.o.weight.grad}
    if hasattr(mod, "qkv_proj"):  # Phi-3: q's rows come first
        return {"q": mod.qkv_proj.weight.grad[:mod.config.num_attention_heads * mod.head_dim],
                "o": mod.o_proj.weight.grad}
    g = {"q": mod.q_proj.weight.grad, "o": (mod.o_proj if hasattr(mod, "o_proj") else mod.dense).weight.grad}
    if getattr(mod, "q_norm", None) is not None:
        g["q_norm"], g["k_norm"] = mod.q_norm.weight.grad, mod.k_norm.weight.grad
    if hasattr(getattr(mod, "q_layernorm", None), "norms"):  # StableLM: one LayerNorm per head
        g["q_norm"], g["k_norm"] = (torch.stack([n.weight.grad for n in ln.norms])
                                    for ln in (mod.q_layernorm, mod.k_layernorm))
    elif getattr(mod, "q_layernorm", None) is not None:  # Phi
        g["q_norm"], g["k_norm"] = mod.q_layernorm.weight.grad, mod.k_layernorm.weight.grad
    if isinstance(getattr(mod, "sinks", None), torch.nn.Parameter):
        g["sinks"] = mod.sinks.grad
    return g


def _hf_grads_ours(g, layer):
    q = g["in_proj_weight"][:layer.num_heads * layer.head_dim] if "in_proj_weight" in g else g["q_proj_weight"]
    out = {"q": q, "o": g["out_proj.weight"]}
    if "q_norm.weight" in g:
        out["q_norm"], out["k_norm"] = g["q_norm.weight"], g["k_norm.weight"]
    if "sinks" in g:
        out["sinks"] = g["sinks"]
    return out


def _hf_decode_steps(model, kind, L, ids):
    """transformers' own decoding, one token per step through its cache: the attention module's
    input and output at every step, [B, N, E] each."""
    import transformers as tf
    mod = _hf_attention_module(model, kind, L)
    xs, ys = [], []

    def pre(m, args, kwargs):
        xs.append(kwargs.get("hidden_states", args[0] if args else None))

    def post(m, args, kwargs, out):
        ys.append(out[0] if isinstance(out, tuple) else out)
    h1 = mod.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = mod.register_forward_hook(post, with_kwargs=True)
    try:
        with torch.no_grad():
            cache = tf.DynamicCache(config=model.config)
            for t in range(ids.shape[1]):
                model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
    finally:
        h1.remove()
        h2.remove()
    return torch.cat(xs, 1), torch.cat(ys, 1)


_hf_memo = {}


def hf_family(kind, L=1, causal=True, pad=False, cached=True, backward=True):
    """Every check of one family, computed once: {name: (error, bound)}."""
    if kind in _hf_memo:
        return _hf_memo[kind]
    model, folder = _hf_build(kind, L)
    B, N = 2, 13
    ids = torch.from_numpy(np.random.default_rng(len(kind)).integers(0, 32, (B, N)))
    mask = torch.ones(B, N, dtype=torch.long)
    if pad:
        mask[1, -4:] = 0  # row 1's last 4 tokens are padding
    x32, call32, extra = _hf_run(model, kind, L, ids, mask)
    with torch.no_grad():
        want32 = call32(x32)
    layer = attn.MultiheadAttention.from_hf(folder, L)
    kw = dict(need_weights=False, is_causal=causal)
    if pad:
        kw["key_padding_mask"] = (mask == 0).numpy()
    if extra is not None:  # T5: the bias the model built (relative positions and padding) as an additive mask
        kw["attn_mask"] = extra.detach().float().numpy()
    x = x32.detach().float()
    got, _ = layer(x, x, x, **kw)
    res = {}
    live = slice(None) if not pad else None

    def rows(a):  # padded queries' outputs are not compared (the models differ in what they put there)
        a = a.detach().numpy() if torch.is_tensor(a) else np.asarray(a)
        return a if live is not None else np.concatenate([a[0], a[1, :-4]])
    res["forward vs transformers fp32"] = (rel(rows(got), rows(want32)), 1e-4)
    old = os.environ.get("ATTN_KERNEL")
    os.environ["ATTN_KERNEL"] = "ref"
    try:
        oracle_layer = attn.MultiheadAttention.from_hf(folder, L)
    finally:
        if old is None:
            del os.environ["ATTN_KERNEL"]
        else:
            os.environ["ATTN_KERNEL"] = old
    oracle, _ = oracle_layer(x, x, x, **kw)
    if extra is not None:  # without its bias, a T5 layer is refused, not silently another layer
        try:
            layer(x, x, x, need_weights=False)
            res["T5 without its relative bias is refused"] = (1.0, 0.0)
        except ValueError:
            res["T5 without its relative bias is refused"] = (0.0, 0.0)
    res["forward vs float64 oracle"] = (rel(rows(got), rows(oracle)), 1e-5)
    if kind == "phi3":  # longrope: each step in its own regime, short then long, in both caches
        xs, ys = _hf_decode_steps(model, kind, L, ids)
        cache = layer.new_cache(B, N)
        steps = np.concatenate([np.asarray(layer.forward_cached(xs[:, i:i + 1].float(), cache)) for i in range(N)], 1)
        res["token by token through the KV cache vs transformers' own decoding"] = (rel(steps, ys.double()), 1e-4)
    if backward:
        # PyTorch's own fp32 gradients, for scale: a weight gradient that cancels (saturated softmax)
        # is as hard for fp32 autograd as for us
        G = torch.from_numpy(randn(*want32.shape))
        if pad:
            G[1, -4:] = 0
        mod = _hf_attention_module(model, kind, L)
        mod.zero_grad()
        xg = x32.detach().clone().requires_grad_(True)
        (call32(xg) * G.float()).sum().backward()
        g32 = {n: v.detach().clone() for n, v in _hf_grads_torch(mod, kind, layer.embed_dim).items()}
        if kind.startswith(("gpt_oss", "olmoe")):  # their experts do not run in float64 on the CPU: the attention alone
            import copy
            mod = copy.deepcopy(_hf_attention_module(model, kind, L)).double()
            _, call64, _ = _hf_run(model, kind, L, ids, mask, module=mod)
        else:
            m64 = model.double()
            _, call64, _ = _hf_run(m64, kind, L, ids, mask)
            mod = _hf_attention_module(m64, kind, L)
        x64 = x32.detach().double().requires_grad_(True)
        mod.zero_grad()
        (call64(x64) * G).sum().backward()
        gw = _hf_grads_torch(mod, kind, layer.embed_dim)
        gkw = {k: v for k, v in kw.items() if k != "need_weights"}
        ours = layer.grad(x, x, x, G.float(), **gkw)
        res["backward: input vs autograd float64"] = (rel(rows(ours["query"]), rows(x64.grad)), 1e-4)
        og = _hf_grads_ours(ours, layer)
        # each weight's error over its bound: 1e-5, or 4x PyTorch fp32's own error where that is larger
        ratio = {n: rel(og[n], gw[n]) / max(1e-5, 4 * rel(g32[n], gw[n])) for n in gw}
        if os.environ.get("ATTN_CONFORMANCE_VERBOSE"):
            print("   ", kind, {n: f"ours {rel(og[n], gw[n]):.2e} torch fp32 {rel(g32[n], gw[n]):.2e}" for n in gw})
        n = max(ratio, key=ratio.get)
        res["backward: q, o" + (", QK-norm" if "q_norm" in gw else "") + (", sinks" if "sinks" in gw else "") +
            f" weights vs autograd float64 (worst: {n}; bound max(1e-5, 4x PyTorch fp32's error))"] = \
            (rel(og[n], gw[n]), max(1e-5, 4 * rel(g32[n], gw[n])))
    if cached and causal:
        cache = layer.new_cache(B, N)
        steps = np.concatenate([np.asarray(layer.forward_cached(x[:, i:i + 1], cache)) for i in range(N)], 1)
        res["token by token through the KV cache vs transformers"] = (rel(steps, want32), 1e-4)
        res["token by token vs our full causal forward"] = (rel(steps, got), 1e-5)
    _hf_memo[kind] = res
    import shutil
    shutil.rmtree(folder, ignore_errors=True)
    return res


if have_transformers:
    FAM = "checkpoint families vs transformers"
    families = [
        ("BertSelfAttention + BertSelfOutput.dense (key padding)", "bert", dict(causal=False, pad=True, cached=False)),
        ("GPT2Attention (Conv1D c_attn, inverse-layer scale)", "gpt2", {}),
        ("LlamaAttention, default RoPE", "llama_default", {}),
        ("LlamaAttention, linear RoPE", "llama_linear", dict(backward=False)),
        ("LlamaAttention, dynamic NTK RoPE", "llama_dynamic", dict(backward=False, cached=False)),
        ("LlamaAttention, llama3 RoPE", "llama_llama3", dict(backward=False)),
        ("LlamaAttention, YaRN RoPE", "llama_yarn", dict(backward=False)),
        ("MistralAttention (sliding window 5)", "mistral", {}),
        ("Qwen2Attention (q/k/v biases)", "qwen2", {}),
        ("Qwen3Attention (QK-norm, head_dim 32 of hidden 64)", "qwen3", {}),
        ("Gemma2Attention (softcap, query_pre_attn_scalar, sliding layer 0)", "gemma2", dict(L=0)),
        ("Gemma3Attention (QK-norm 1 + w, local RoPE base, sliding)", "gemma3", dict(L=0)),
        ("Olmo2Attention (QK-norm over the whole projection)", "olmo2", {}),
        ("GptOssAttention (learned sinks, biases, YaRN truncate false, sliding window 5)", "gpt_oss_sliding",
         dict(L=0)),
        ("GptOssAttention (learned sinks, full layer)", "gpt_oss_full", {}),
        # longrope rotates each step's keys in that step's regime: the cache is checked against
        # transformers' own decoding, not its full forward
        ("Phi3Attention (qkv_proj packed, GQA, longrope past P, partial rotary)", "phi3", dict(cached=False)),
        ("SmolLM3Attention (a NoPE layer: no_rope_layers)", "smollm3", {}),
        ("CohereAttention (RoPE over interleaved pairs)", "cohere", {}),
        ("CohereAttention (use_qk_norm: LayerNorm, weights [H, D] and [Hk, D])", "cohere_qk_norm", {}),
        ("Cohere2Attention (sliding layer: interleaved RoPE, window 5)", "cohere2", {}),
        ("Llama4TextAttention (chunked layer 0: chunks of 5 over 13 tokens, interleaved RoPE)", "llama4_chunk", {}),
        ("Llama4TextAttention (full NoPE layer 2)", "llama4_chunk_nope", dict(L=2)),
        ("Cohere2Attention (full layer: no RoPE), config.json as on the Hub", "cohere2_hub", dict(L=2)),
        ("Glm4Attention (interleaved RoPE over half the head)", "glm4", {}),
        ("Exaone4Attention (QK-norm, full layer without RoPE), config.json as on the Hub", "exaone4_hub", dict(L=2)),
        ("Olmo3Attention (sliding layer: default RoPE beside YaRN), config.json as on the Hub", "olmo3_hub", {}),
        ("Olmo3Attention (full layer: YaRN)", "olmo3", dict(L=3)),
        ("OlmoAttention (clip_qkv 2: q, k and v clamped)", "olmo_clip", {}),
        ("OlmoeAttention (clip_qkv 0.3 after QK-norm over the whole projection)", "olmoe_clip", {}),
        ("GraniteAttention (attention_multiplier)", "granite", {}),
        ("StableLmAttention (partial rotary 0.25)", "stablelm", {}),
        ("StableLmAttention (qk_layernorm: a LayerNorm per head, saved per head)", "stablelm_qk_layernorm", {}),
        ("PhiAttention (q/k/v_proj and dense, biased; partial rotary 0.5)", "phi_plain", {}),
        ("PhiAttention (qk_layernorm: a LayerNorm with biases over each head, shared)", "phi_qk_layernorm", {}),
        ("T5Attention (no scaling, relative bias as an additive mask, d_kv 24)", "t5",
         dict(L=0, causal=False, pad=True, cached=False)),
    ]
    for title, kind, opt in families:
        probe = None
        try:
            probe = hf_family(kind, **opt)
        except Exception as e:  # a family that fails to build or load is one failure, reported
            case(FAM, f"{title} [{type(e).__name__}: {e}]", lambda: float("nan"))
            continue
        for check, (err, bound) in probe.items():
            case(FAM, f"{title}: {check}", lambda e=err, b=bound: (e, b))

    def refused(build, needle):
        """A family whose attention libattn does not compute, saved by transformers: from_hf refuses
        it naming what differs, where reading it as a Llama layer would give other numbers."""
        import shutil
        import tempfile
        import transformers as tf
        dec = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=32, max_position_embeddings=128, pad_token_id=0)
        folder = tempfile.mkdtemp(prefix="attn_hf_refused_")
        try:
            build(tf, dec).save_pretrained(folder, safe_serialization=True)
            try:
                attn.MultiheadAttention.from_hf(folder, 1)
            except attn.AttnError as e:
                assert needle in str(e), str(e)
                return 0.0
            raise AssertionError("loaded")
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    case(FAM, "Olmo2Attention with a clip_qkv in its config (which Olmo2 does not apply): refused naming clip_qkv",
         lambda: refused(lambda tf, d: tf.Olmo2ForCausalLM(tf.Olmo2Config(clip_qkv=0.5, **d)), "clip_qkv"))
    case(FAM, "PersimmonAttention with qk_layernorm: refused naming it",
         lambda: refused(lambda tf, d: tf.PersimmonForCausalLM(tf.PersimmonConfig(qk_layernorm=True, **d)),
                         "qk_layernorm"))
    l4 = dict(attention_chunk_size=5, moe_layers=[], intermediate_size_mlp=96, head_dim=16)
    case(FAM, "Llama4TextAttention with its weightless QK-norm after RoPE: refused naming use_qk_norm",
         lambda: refused(lambda tf, d: tf.Llama4ForCausalLM(tf.Llama4TextConfig(
             use_qk_norm=True, attn_temperature_tuning=False, **l4, **d)), "use_qk_norm"))
    case(FAM, "Llama4TextAttention with temperature tuning on its NoPE layers: refused naming attn_temperature_tuning",
         lambda: refused(lambda tf, d: tf.Llama4ForCausalLM(tf.Llama4TextConfig(
             use_qk_norm=False, attn_temperature_tuning=True, **l4, **d)), "attn_temperature_tuning"))
    case(FAM, "HunYuanDenseV1Attention (QK-norm after RoPE): refused naming its model_type",
         lambda: refused(lambda tf, d: tf.HunYuanDenseV1ForCausalLM(tf.HunYuanDenseV1Config(head_dim=16, **d)),
                         "hunyuan_v1_dense"))

print("worst relative error per family:")
for fam, err in worst.items():
    print(f"  {fam:24s} {err:.3g}")
print(f"{passed} passed, {failed} failed")
if failed:
    sys.exit(1)
sys.exit(SKIP if torch is None else 0)
