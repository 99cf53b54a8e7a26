#!/usr/bin/env python3
"""Conformance of the attn Python package against PyTorch (float64 reference),
or against a NumPy float64 reference where torch is absent. Prints one line
per case with its worst relative L2 error; exits non-zero on any failure."""
import ctypes
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numpy as np  # noqa: E402

import attn  # noqa: E402
from attn import _capi  # noqa: E402

try:
    if os.environ.get("ATTN_TEST_NO_TORCH"):  # exercise the NumPy-only path
        raise ImportError
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = None

TOL = 1e-5
rng = np.random.default_rng(1234)
passed = failed = 0


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    d = np.linalg.norm(a - b)
    n = np.linalg.norm(b)
    return d / n if n > 0 else d


def case(name, fn):
    global passed, failed
    try:
        err = fn()
        ok = err <= TOL
    except Exception as e:  # a crash of one case is a failure, not the end of the run
        err, ok = float("nan"), False
        name += f" [{type(e).__name__}: {e}]"
    print(f"{'PASS' if ok else 'FAIL'} {name}: worst rel err {err:.3g}")
    if ok:
        passed += 1
    else:
        failed += 1


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def np_sdpa(q, k, v, mask=None, causal=None, scale=None, kpm=None):
    """float64 NumPy reference, [..., L, D] with GQA on dim -3."""
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


def ref_sdpa(q, k, v, mask=None, causal=None, scale=None, kpm=None, gqa=False):
    if torch is None:
        return np_sdpa(q, k, v, mask, causal, scale, kpm)[0]
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).double()  # noqa: E731
    m = None
    if mask is not None:
        m = torch.from_numpy(np.ascontiguousarray(mask))
        m = m if mask.dtype == np.bool_ else m.double()
    if kpm is not None:
        km = torch.from_numpy(~kpm)[:, None, None, :]
        m = km if m is None else (m & km if m.dtype == torch.bool else m.masked_fill(~km, float("-inf")))
    if causal == "bottom-right":
        L, S = q.shape[-2], k.shape[-2]
        cm = torch.ones(L, S, dtype=torch.bool).tril(S - L)
        m = cm if m is None else (m & cm if m.dtype == torch.bool else m.masked_fill(~cm, float("-inf")))
        causal = None
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
    assert math.isnan(o.scale) and o.causal == 0 and not o.mask and not o.weights and o.dropout_p == 0.0
    assert o.dropout_seed == 0 and not o.mask_grad
    mo = _capi.MhaOpts()
    mo.mask_mode = 9
    _capi.lib.attn_mha_opts_init(ctypes.byref(mo))
    assert mo.mask_mode == _capi.MASK_MASKED and mo.average_weights in (0, 1)
    m = attn.MultiheadAttention(8, 2, kdim=6, vdim=5, num_kv_heads=1, bias=False)
    assert (m.embed_dim, m.num_heads, m.num_kv_heads, m.kdim, m.vdim, m.bias) == (8, 2, 1, 6, 5, False)
    return 0.0


case("ctypes layout of attn_tensor/attn_sdpa_opts/attn_mha_opts/attn_mha_config", layout)

# ---- scaled_dot_product_attention ---------------------------------------------
for (B, H, L, S, D) in [(1, 1, 1, 1, 8), (2, 3, 7, 5, 16), (2, 4, 33, 47, 64), (1, 2, 300, 257, 64)]:
    q, k, v = randn(B, H, L, D), randn(B, H, S, D), randn(B, H, S, D)
    case(f"sdpa [B,H,N,D] {B}x{H}x{L}x{S}x{D}", lambda: rel(attn.scaled_dot_product_attention(q, k, v),
                                                            ref_sdpa(q, k, v)))
    # batch-first storage [B, N, H, D], passed as a permuted view (no copy)
    qb, kb, vb = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    qv, kv, vv = (x.transpose(0, 2, 1, 3) for x in (qb, kb, vb))
    case(f"sdpa batch-first view {B}x{H}x{L}x{S}x{D}",
         lambda: rel(attn.scaled_dot_product_attention(qv, kv, vv), ref_sdpa(q, k, v)))
    case(f"sdpa causal top-left {B}x{H}x{L}x{S}x{D}",
         lambda: rel(attn.scaled_dot_product_attention(q, k, v, is_causal=True), ref_sdpa(q, k, v, causal="top-left")))
    if L <= S:  # with L > S bottom-right leaves rows with no key (NaN in PyTorch, zeros here)
        case(f"sdpa causal bottom-right {B}x{H}x{L}x{S}x{D}",
             lambda: rel(attn.scaled_dot_product_attention(q, k, v, is_causal=True, causal_align="bottom-right"),
                         ref_sdpa(q, k, v, causal="bottom-right")))
    bm = rng.random((L, S)) < 0.7
    bm[:, 0] = True  # no fully masked rows (PyTorch gives NaN there, libattn zeros)
    bm4 = np.broadcast_to(bm, (B, H, L, S))  # stride-0 broadcast
    case(f"sdpa bool mask (broadcast) {B}x{H}x{L}x{S}x{D}",
         lambda: rel(attn.scaled_dot_product_attention(q, k, v, attn_mask=bm4), ref_sdpa(q, k, v, mask=bm)))
    fm = randn(B, 1, L, S)
    case(f"sdpa float mask [B,1,L,S] {B}x{H}x{L}x{S}x{D}",
         lambda: rel(attn.scaled_dot_product_attention(q, k, v, attn_mask=fm, scale=0.3),
                     ref_sdpa(q, k, v, mask=fm, scale=0.3)))
    kpm = rng.random((B, S)) < 0.3
    kpm[:, 0] = False
    case(f"sdpa key padding {B}x{H}x{L}x{S}x{D}",
         lambda: rel(attn.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm), ref_sdpa(q, k, v, kpm=kpm)))
    if H % 2 == 0:
        k2, v2 = randn(B, H // 2, S, D), randn(B, H // 2, S, D)
        case(f"sdpa GQA {H}q/{H // 2}kv {B}x{L}x{S}x{D}",
             lambda: rel(attn.scaled_dot_product_attention(q, k2, v2, enable_gqa=True),
                         ref_sdpa(q, k2, v2, gqa=True)))


def weights_lse():
    q, k, v = randn(2, 2, 9, 8), randn(2, 2, 11, 8), randn(2, 2, 11, 8)
    out, w, lse = attn.scaled_dot_product_attention(q, k, v, return_weights=True, return_lse=True)
    ro, rw = np_sdpa(q, k, v)
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64) / math.sqrt(8)
    rl = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    return max(rel(out, ro), rel(w, rw), rel(lse, rl))


case("sdpa return_weights/return_lse vs NumPy float64", weights_lse)


def rank3_and_f64():
    q = rng.standard_normal((3, 6, 8))  # float64: cast to float32 with a copy
    o = attn.scaled_dot_product_attention(q, q, q)
    assert o.dtype == np.float32 and o.shape == (3, 6, 8)
    return rel(o, np_sdpa(q, q, q)[0])


case("sdpa rank-3 float64 input", rank3_and_f64)


def errors():
    q = randn(1, 2, 4, 8)
    try:
        attn.scaled_dot_product_attention(q, randn(1, 2, 5, 8), randn(1, 2, 6, 8))
        return 1.0
    except attn.AttnError as e:
        assert isinstance(e, RuntimeError) and e.status == 2 and str(e), e
    try:
        attn.scaled_dot_product_attention(q, randn(1, 1, 4, 8), randn(1, 1, 4, 8))  # GQA without enable_gqa
        return 1.0
    except ValueError:
        pass
    try:
        attn.scaled_dot_product_attention(q.astype(np.int32), q, q)
        return 1.0
    except TypeError:
        pass
    odd = np.lib.stride_tricks.as_strided(q, shape=(1, 2, 4, 8), strides=(256, 128, 32, 2))
    try:
        attn.scaled_dot_product_attention(odd, q, q)
        return 1.0
    except ValueError:
        pass
    return 0.0


case("errors: AttnError(status, message), ValueError, TypeError", errors)

# ---- torch tensors in, torch tensors out --------------------------------------
if torch is None:
    print("SKIP torch cases: PyTorch is not importable (NumPy float64 reference only)")
else:
    def torch_io():
        q = torch.randn(2, 3, 10, 16)
        kb = torch.randn(2, 12, 3, 16).transpose(1, 2)  # a strided (batch-first) view
        v = torch.randn(2, 3, 12, 16)
        o = attn.scaled_dot_product_attention(q, kb, v, is_causal=False)
        assert isinstance(o, torch.Tensor)
        r = F.scaled_dot_product_attention(q.double(), kb.double(), v.double())
        if torch.cuda.is_available():
            try:
                attn.scaled_dot_product_attention(q.cuda(), q.cuda(), q.cuda())
                return 1.0
            except TypeError:
                pass
        qg = q.clone().requires_grad_(True)
        o2 = attn.scaled_dot_product_attention(qg, kb, v)
        return max(rel(o.numpy(), r.numpy()), rel(o2.numpy(), r.numpy()))

    case("sdpa torch tensors (strided view, requires_grad)", torch_io)

    # ---- nn.MultiheadAttention ---------------------------------------------------
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
            errs = [rel(o.numpy(), ro.detach().numpy())]
            if need_weights:
                errs.append(rel(w.numpy(), rw.detach().numpy()))
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
        case(f"mha {desc}", mha_case(**g))

    def mha_seed_names_and_safetensors():
        E, H = 16, 4
        tm = torch.nn.MultiheadAttention(E, H, batch_first=True).double().eval()
        with torch.no_grad():
            for p in tm.parameters():
                p.normal_(0, 0.3)
        sd = tm.state_dict()
        w = sd["in_proj_weight"].float()
        b = sd["in_proj_bias"].float()
        seed = {"wq.weight": w[:E], "wk.weight": w[E:2 * E], "wv.weight": w[2 * E:],
                "wq.bias": b[:E], "wk.bias": b[E:2 * E], "wv.bias": b[2 * E:],
                "dense.weight": sd["out_proj.weight"].float(), "dense.bias": sd["out_proj.bias"].float()}
        m = attn.MultiheadAttention(E, H, batch_first=True)
        m.load_state_dict({k: v.numpy() for k, v in seed.items()})
        x = torch.randn(2, 6, E)
        ro, _ = tm(x.double(), x.double(), x.double())
        errs = [rel(m(x, x, x)[0].numpy(), ro.detach().numpy())]
        try:
            from safetensors.numpy import save_file
        except ImportError:
            print("  (safetensors not importable: from_safetensors not tested)")
            return errs[0]
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "l.safetensors")
            save_file({"blk." + k: np.ascontiguousarray(v.numpy()) for k, v in seed.items()}, path)
            m2 = attn.MultiheadAttention.from_safetensors(path, H, prefix="blk.", batch_first=True)
            errs.append(rel(m2(x, x, x)[0].numpy(), ro.detach().numpy()))
        return max(errs)

    case("mha seed names (wq/wk/wv/dense) + from_safetensors", mha_seed_names_and_safetensors)

print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
