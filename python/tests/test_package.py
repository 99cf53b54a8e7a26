#!/usr/bin/env python3
"""The package's face: attn exports its API and nothing else, reports the loaded
library's version, and its objects print their configuration. Needs NumPy only."""
import os
import re
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attn  # noqa: E402

API = {"AttnError", "scaled_dot_product_attention", "sdpa_backward", "MultiheadAttention", "KVCache", "PagedKVCache",
       "plot_attention", "rope", "head_norm", "version", "library_path"}


def qk_norm_layer():
    """head_dim != E/H, out_bias and QK-norm: the config, the parameters by name, refusals, decoding."""
    import numpy as np
    m = attn.MultiheadAttention(6, 2, num_kv_heads=1, head_dim=4, out_bias=False, qk_norm="per_head",
                                qk_norm_kind="layer", batch_first=True)
    assert repr(m) == ("MultiheadAttention(embed_dim=6, num_heads=2, num_kv_heads=1, head_dim=4, kdim=6, vdim=6, "
                       "bias=True, out_bias=False, qk_norm='per_head', qk_norm_kind='layer', qk_norm_eps=1e-06, "
                       "batch_first=True)"), repr(m)
    sd = m.state_dict()
    shapes = {n: a.shape for n, a in sd.items()}
    assert shapes == {"q_proj_weight": (8, 6), "k_proj_weight": (4, 6), "v_proj_weight": (4, 6),
                      "in_proj_bias": (16,), "out_proj.weight": (6, 8), "q_norm.weight": (4,),
                      "k_norm.weight": (4,), "q_norm.bias": (4,), "k_norm.bias": (4,)}, shapes
    assert (sd["q_norm.weight"] == 1).all() and (sd["k_norm.bias"] == 0).all(), sd
    rng = np.random.default_rng(5)
    new = {n: rng.standard_normal(a.shape).astype(np.float32) for n, a in sd.items() if n != "in_proj_bias"}
    m.load_state_dict(new)
    back = m.state_dict()
    assert all((back[n] == new[n]).all() for n in new), "state_dict reads back what load_state_dict wrote"
    for bad, err in (({"q_norm.weight": np.zeros(3, np.float32)}, ValueError),
                     ({"q_norm.weight": np.zeros(8, np.float32)}, ValueError)):
        try:
            m.load_state_dict(bad)
            raise AssertionError(f"{bad} accepted")
        except err:
            pass
    try:
        attn.MultiheadAttention(8, 2, qk_norm="per_head").load_state_dict({"k_norm.bias": np.zeros(4, np.float32)})
        raise AssertionError("a bias of an RMS norm accepted")
    except KeyError:
        pass
    for kw in (dict(qk_norm="heads"), dict(qk_norm="whole", qk_norm_kind="batch")):
        try:
            attn.MultiheadAttention(8, 2, **kw)
            raise AssertionError(f"{kw} accepted")
        except ValueError:
            pass
    for kw in (dict(qk_norm="whole", qk_norm_eps=0.0), dict(head_dim=-2), dict(head_dim=1 << 30)):
        try:
            attn.MultiheadAttention(8, 2, **kw)
            raise AssertionError(f"{kw} accepted")
        except attn.AttnError:
            pass
    # decoding token by token equals the causal forward
    x = rng.standard_normal((1, 5, 6)).astype(np.float32)
    full, _ = m(x, x, x, need_weights=False, is_causal=True)
    cache = m.new_cache(1, 5)
    steps = np.concatenate([m.forward_cached(x[:, t:t + 1], cache) for t in range(5)], axis=1)
    assert np.abs(steps - full).max() <= 1e-5 * np.abs(full).max(), np.abs(steps - full).max()
    g = m.grad(x, x, x, np.ones_like(x), is_causal=True)
    assert {"q_norm.weight", "k_norm.weight", "q_norm.bias", "k_norm.bias"} <= set(g) and "out_proj.bias" not in g, g


def clipped_qkv():
    """clip_qkv=: the layer clamps q, k and v; with identity projections and one key the output is
    the input clamped, and its gradient passes where the input lay within the bounds (ends too)."""
    import numpy as np
    m = attn.MultiheadAttention(4, 1, bias=False, clip_qkv=0.5, batch_first=True)
    assert m.clip_qkv == 0.5 and repr(m).endswith("clip_qkv=0.5, batch_first=True)"), repr(m)
    assert attn.MultiheadAttention(4, 1).clip_qkv is None
    eye = np.eye(4, dtype=np.float32)
    m.load_state_dict({"in_proj_weight": np.concatenate([eye] * 3), "out_proj.weight": eye})
    x = np.array([[[0.5, -0.5, 0.25, 2.0]]], np.float32)
    out, _ = m(x, x, x, need_weights=False)
    assert (np.asarray(out) == np.array([[[0.5, -0.5, 0.25, 0.5]]], np.float32)).all(), out
    g = m.grad(x, x, x, np.ones_like(x))["query"]
    assert np.abs(np.asarray(g) - np.array([[[1, 1, 1, 0]]])).max() <= 1e-6, g
    try:
        attn.MultiheadAttention(4, 1, clip_qkv=-1.0)
        raise AssertionError("clip_qkv -1 accepted")
    except attn.AttnError as e:
        assert "clip_qkv" in str(e), e


def learned_sinks():
    """sinks=True: the parameter by name, what a call's own sinks meet, its gradient (the float64
    path's within fp32 rounding, and central differences of the float64 path)."""
    import numpy as np
    m = attn.MultiheadAttention(8, 2, sinks=True, batch_first=True)
    assert repr(m).endswith("bias=True, out_bias=True, sinks=True, batch_first=True)"), repr(m)
    sd = m.state_dict()
    assert sd["sinks"].shape == (2,) and (sd["sinks"] == 0).all(), sd
    rng = np.random.default_rng(9)
    new = {n: (0.5 * rng.standard_normal(a.shape)).astype(np.float32) for n, a in sd.items()}
    new["sinks"] = np.array([1.5, -0.5], np.float32)
    m.load_state_dict(new)
    assert (m.state_dict()["sinks"] == new["sinks"]).all()
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    plain = attn.MultiheadAttention(8, 2, batch_first=True)
    plain.load_state_dict({n: a for n, a in new.items() if n != "sinks"})
    got, _ = m(x, x, x, need_weights=False, is_causal=True)
    want, _ = plain(x, x, x, need_weights=False, is_causal=True, sinks=new["sinks"])
    assert (np.asarray(got) == np.asarray(want)).all(), "learned sinks: the options' sinks' bits"
    try:
        m(x, x, x, need_weights=False, sinks=new["sinks"])
        raise AssertionError("a call's sinks accepted beside the layer's")
    except attn.AttnError as e:
        assert "holds its own" in str(e), e
    try:
        plain.load_state_dict({"sinks": new["sinks"]})
        raise AssertionError("sinks loaded into a layer without them")
    except attn.AttnError:
        pass
    G = rng.standard_normal(x.shape).astype(np.float32)
    g = m.grad(x, x, x, G, is_causal=True)["sinks"]
    assert "sinks" not in plain.grad(x, x, x, G, is_causal=True, sinks=new["sinks"])
    x64, G64 = x.astype(np.float64), G.astype(np.float64)
    old = os.environ.get("ATTN_KERNEL")
    os.environ["ATTN_KERNEL"] = "ref"  # read when a layer's context is made
    try:
        r = attn.MultiheadAttention(8, 2, sinks=True, batch_first=True)
    finally:
        if old is None:
            del os.environ["ATTN_KERNEL"]
        else:
            os.environ["ATTN_KERNEL"] = old
    r.load_state_dict(new)
    g64 = np.asarray(r.grad(x64, x64, x64, G64, is_causal=True)["sinks"], np.float64)
    assert np.abs(np.asarray(g) - g64).max() <= 1e-5 * np.abs(g64).max(), (g, g64)
    h = 2.0 ** -10
    for k in range(2):
        f = []
        for step in (-h, h):
            s = dict(new)
            s["sinks"] = new["sinks"].copy()
            s["sinks"][k] += step
            r.load_state_dict(s)
            out, _ = r(x64, x64, x64, need_weights=False, is_causal=True)
            f.append(float((np.asarray(out, np.float64) * G64).sum()))
        fd = (f[1] - f[0]) / (2 * h)
        assert abs(fd - g64[k]) <= 1e-4 * max(1.0, abs(g64[k])), (k, fd, g64[k])


def kv_quant():
    """Block-format storage: keys()/values() decode what is stored, attend matches NumPy on it."""
    import numpy as np
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 2, 5, 64)).astype(np.float32)
    v = rng.standard_normal((2, 2, 5, 32)).astype(np.float32)
    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
    c = attn.KVCache(2, 8, 2, 64, 32, dtype="q8_0")
    assert (c.dtype, c.k_dtype, c.v_dtype) == ("q8_0", "q8_0", "q8_0"), (c.dtype, c.k_dtype, c.v_dtype)
    c.append(k, v)
    kk, vv = c.keys(1), c.values(1)
    assert kk.shape == (2, 5, 64) and vv.shape == (2, 5, 32)
    assert np.abs(kk - k[1]).max() <= np.abs(k).max() / 127, np.abs(kk - k[1]).max()  # half a step, and the f16 scale
    out = np.asarray(c.attend(q))
    for b in range(2):
        K, V = np.repeat(c.keys(b), 2, axis=0), np.repeat(c.values(b), 2, axis=0)  # GQA: heads 0, 1 read kv head 0
        s = np.einsum("hd,hnd->hn", q[b, :, 0].astype(np.float64), K) / 8.0
        p = np.exp(s - s.max(axis=1, keepdims=True))
        want = np.einsum("hn,hnd->hd", p / p.sum(axis=1, keepdims=True), V)
        assert np.abs(out[b, :, 0] - want).max() <= 1e-5, np.abs(out[b, :, 0] - want).max()
    c.close()
    c = attn.KVCache(1, 4, 1, 32, k_dtype="q4_0", v_dtype="float16")
    assert c.dtype == "k q4_0, v float16", c.dtype
    c.close()
    try:
        attn.KVCache(1, 4, 1, 48, dtype="q4_0")
        raise AssertionError("head_dim 48 accepted for q4_0")
    except attn.AttnError as e:
        assert "multiple of 32" in str(e), str(e)


def paged():
    """PagedKVCache: decoding bitwise as a KVCache of the same tokens and storage (q8_0 keys,
    q4_0 values), fork sharing blocks, copy on write, truncate, free, a refused append."""
    import numpy as np
    rng = np.random.default_rng(1)
    lens = [70, 5, 33]
    p = attn.PagedKVCache(16, 16, 2, 64, k_dtype="q8_0", v_dtype="q4_0", threads=2)
    lin = attn.KVCache(3, 80, 2, 64, k_dtype="q8_0", v_dtype="q4_0", threads=2)
    assert repr(p) == ("PagedKVCache(num_blocks=16, block_tokens=16, kv_heads=2, head_dim=64, v_head_dim=64, "
                       "k_dtype='q8_0', v_dtype='q4_0', free_blocks=16)"), repr(p)
    seqs = [p.new_seq() for _ in lens]
    k = rng.standard_normal((3, 2, 70, 64)).astype(np.float32)
    v = rng.standard_normal((3, 2, 70, 64)).astype(np.float32)
    p.append(seqs, k, v, n_new=lens)
    lin.append(k, v, n_new=lens)
    assert [p.length(s) for s in seqs] == lens and lin.lengths == tuple(lens)
    assert p.free_blocks == 16 - (5 + 1 + 3), p.free_blocks
    for _ in range(3):  # decoding steps: one token each, then a query each
        kn = rng.standard_normal((3, 2, 1, 64)).astype(np.float32)
        p.append(seqs, kn, kn)
        lin.append(kn, kn)
        q = rng.standard_normal((3, 8, 1, 64)).astype(np.float32)
        (a, la), (b, lb) = p.attend(seqs, q, return_lse=True), lin.attend(q, return_lse=True)
        assert np.array_equal(a, b) and np.array_equal(la, lb), np.abs(a - b).max()
    child = p.fork(seqs[0])
    assert p.block_table(child) == p.block_table(seqs[0]) and p.free_blocks == 16 - 9
    q1 = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    before = p.attend([seqs[0]], q1)
    kn = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    p.append([child], kn, kn)  # into the shared, partly filled last block: copied
    assert p.free_blocks == 16 - 10, p.free_blocks
    assert np.array_equal(p.attend([seqs[0]], q1), before), "the parent is unchanged by its child's append"
    p.truncate(child, 10)
    assert p.length(child) == 10 and p.free_blocks == 16 - 9, p.free_blocks
    try:
        big = np.zeros((1, 2, 200, 64), np.float32)
        p.append([child], big, big)
        raise AssertionError("an append past the pool accepted")
    except attn.AttnError as e:
        assert "nothing appended" in str(e), str(e)
    assert p.length(child) == 10 and p.free_blocks == 16 - 9
    one = np.zeros((1, 2, 1, 64), np.float32)
    for call, err in ((lambda: p.append([child], one, one, n_new=[0.6]), TypeError),  # not truncated to 0
                      (lambda: p.append([float(child)], one, one), TypeError),
                      (lambda: p.append(np.array([child], np.uint64), one, one, n_new=np.array([2**63], np.uint64)),
                       ValueError),  # not wrapped to -2^63
                      (lambda: p.truncate(child, 9.5), TypeError),
                      (lambda: attn.PagedKVCache(16, 16.5, 2, 64), TypeError),
                      (lambda: attn.MultiheadAttention(8.0, 2), TypeError),
                      (lambda: attn.scaled_dot_product_attention(q1, q1, q1, threads=1.5), TypeError),
                      (lambda: attn.rope(q1, positions=np.array([2**63 + 1], np.uint64)), ValueError),
                      (lambda: attn.scaled_dot_product_attention(q1, q1, q1, cu_seqlens_q=np.array([0, 2**64 - 1],
                                                                                                   np.uint64)),
                       ValueError)):
        try:
            call()
            raise AssertionError("a fractional or overflowing count accepted")
        except err:
            pass
    assert p.length(child) == 10 and p.free_blocks == 16 - 9
    p.free(child)
    for s in seqs:
        p.free(s)
    assert p.free_blocks == 16
    try:
        p.length(seqs[0])
        raise AssertionError("a freed sequence's length")
    except ValueError:
        pass
    try:
        attn.rope(q1, positions=np.arange(4))
        raise AssertionError("4 positions for 1 token accepted")
    except ValueError as e:
        assert str(e) == "positions must be [1, 1] or [1] (x's rows and tokens), got shape (4,)", str(e)
    p.close()
    lin.close()
    assert repr(p).endswith(", closed)"), repr(p)


def views():
    """Inputs read in place through their strides: a strided and a transposed view give the bytes
    their contiguous copies give; big-endian arrays give their values; a stride that is not a whole
    number of items is refused."""
    import numpy as np
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 3, 5, 32), dtype=np.float32)
    kb = rng.standard_normal((2, 3, 64, 7), dtype=np.float32)
    k = kb.transpose(0, 1, 3, 2)[:, :, :, ::2]  # [2, 3, 7, 32]: keys along a stride of 7, columns of 14
    v = rng.standard_normal((2, 3, 7, 48), dtype=np.float32)[..., 8:40]
    want = attn.scaled_dot_product_attention(q, np.ascontiguousarray(k), np.ascontiguousarray(v))
    got = attn.scaled_dot_product_attention(q, k, v)
    assert np.array_equal(got, want), np.abs(got - want).max()
    # big-endian arrays (np.load of a '>f4' file) are read as the values they hold, masks too
    big = attn.scaled_dot_product_attention(q.astype(">f4"), k.astype(">f8"), v.astype(">f2"),
                                            attn_mask=np.tril(np.ones((5, 7))).astype(">f4"))
    want = attn.scaled_dot_product_attention(q, k, v.astype(np.float16), attn_mask=np.tril(np.ones((5, 7), np.float32)))
    assert np.array_equal(big, want), np.abs(big - want).max()
    raw = np.zeros(4096, np.uint8)
    odd = np.ndarray((2, 3, 5, 32), np.float32, raw, offset=0, strides=(1922, 642, 130, 4))  # rows 2 bytes apart
    try:
        attn.scaled_dot_product_attention(odd, q, q)
        raise AssertionError("a stride of 130 bytes over 4-byte items accepted")
    except ValueError as e:
        assert "item size" in str(e), str(e)


def main():
    assert set(attn.__all__) == API, sorted(set(attn.__all__) ^ API)
    for name in attn.__all__:
        assert hasattr(attn, name), name
    # the helpers' modules stay private: no attn.np, attn.ctypes, attn.threading
    public = {n for n in dir(attn) if not n.startswith("_")}
    assert public == API, sorted(public - API)
    for name in ("np", "ctypes", "threading"):
        assert not hasattr(attn, name), name
    leaked = [n for n in dir(attn) if isinstance(getattr(attn, n), types.ModuleType) and not n.startswith("_")]
    assert not leaked, leaked
    ns = {}
    exec("from attn import *", ns)
    assert set(ns) - {"__builtins__"} == API, sorted(ns)

    assert attn.__version__ == attn.version() and re.fullmatch(r"\d+\.\d+\.\d+", attn.__version__), attn.__version__

    m = attn.MultiheadAttention(8, 2, num_kv_heads=1, batch_first=True)
    assert repr(m) == ("MultiheadAttention(embed_dim=8, num_heads=2, num_kv_heads=1, head_dim=4, kdim=8, vdim=8, "
                       "bias=True, out_bias=True, batch_first=True)"), repr(m)
    qk_norm_layer()
    learned_sinks()
    clipped_qkv()
    kv_quant()
    paged()
    views()
    c = attn.KVCache(2, 16, 1, 4, dtype="float16")
    assert repr(c) == ("KVCache(batch=2, capacity=16, kv_heads=1, head_dim=4, v_head_dim=4, dtype='float16', "
                       "lengths=(0, 0))"), repr(c)
    c.close()
    assert repr(c).endswith(", closed)"), repr(c)
    ctx = attn._context._Ctx()
    ctx.set_threads(3)
    assert re.fullmatch(r"_Ctx\(threads=3, kernel='\w+'\)", repr(ctx)), repr(ctx)
    print("test_package: ok")


if __name__ == "__main__":
    main()
