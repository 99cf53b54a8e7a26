#!/usr/bin/env python3
"""Packed variable-length batches through the Python API (cu_seqlens_q/_k,
and the layer's cu_seqlens): forward and backward against each sequence run
alone, every option per sequence, refusals. Needs NumPy only (torch, when installed: autograd too)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numpy as np  # noqa: E402

import attn  # noqa: E402


def close(a, b, what, tol=2e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-3 * np.sqrt(max(b.size, 1)))
    assert err < tol, f"{what}: relative error {err:.3g}"


def packed_vs_alone(rng, lens_q, lens_k, H, Hk, D, **opts):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)  # int32 on purpose: converted to int64
    cu_k = np.concatenate([[0], np.cumsum(lens_k)])
    q = rng.standard_normal((1, H, cu_q[-1], D)).astype(np.float32)
    k = rng.standard_normal((1, Hk, cu_k[-1], D)).astype(np.float32)
    v = rng.standard_normal((1, Hk, cu_k[-1], D)).astype(np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    gqa = H != Hk
    out, lse = attn.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, return_lse=True, cu_seqlens_q=cu_q,
                                                 cu_seqlens_k=cu_k, **opts)
    dq, dk, dv = attn.sdpa_backward(dout, q, k, v, out, lse, enable_gqa=gqa, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                    **opts)
    for s in range(len(lens_q)):
        a, b, c, d = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        if b == a:
            continue
        qs, ks, vs = q[:, :, a:b], k[:, :, c:d], v[:, :, c:d]
        o1, l1 = attn.scaled_dot_product_attention(qs, ks, vs, enable_gqa=gqa, return_lse=True, **opts)
        close(out[:, :, a:b], o1, f"sequence {s}'s out")
        assert np.array_equal(np.isinf(lse[:, :, a:b]), np.isinf(l1)), f"sequence {s}'s lse"
        g = attn.sdpa_backward(dout[:, :, a:b], qs, ks, vs, o1, l1, enable_gqa=gqa, **opts)
        close(dq[:, :, a:b], g[0], f"sequence {s}'s dq", 1e-4)
        close(dk[:, :, c:d], g[1], f"sequence {s}'s dk", 1e-4)
        close(dv[:, :, c:d], g[2], f"sequence {s}'s dv", 1e-4)


def refusals():
    q = np.zeros((1, 2, 10, 8), np.float32)
    for bad in ([1, 4, 10], [0, 6, 4], [0, 4, 9], [0, -1, 10]):
        try:
            attn.scaled_dot_product_attention(q, q, q, cu_seqlens_q=np.array(bad))
            raise AssertionError(f"cu_seqlens_q {bad} accepted")
        except attn.AttnError as e:
            assert "cu_seqlens_q[" in str(e), str(e)
    for bad in (np.array([0.0, 10.0]), np.zeros((1, 2), np.int64)):
        try:
            attn.scaled_dot_product_attention(q, q, q, cu_seqlens_q=bad)
            raise AssertionError(f"cu_seqlens_q {bad!r} accepted")
        except TypeError:
            pass
    try:
        attn.scaled_dot_product_attention(q, q, q, cu_seqlens_q=np.array([0, 10]), key_padding_mask=np.zeros((1, 10), bool))
        raise AssertionError("key padding with a packed batch accepted")
    except attn.AttnError as e:
        assert "key_padding" in str(e), str(e)


def layer_packed_vs_alone(rng, batch_first):
    """MultiheadAttention on a packed batch (GQA, causal, RoPE counted from each sequence's start): out,
    the input's gradient and the parameters' (summed over the sequences) against each sequence alone."""
    E, H, lens = 32, 4, [5, 1, 12, 0, 7]
    cu = np.concatenate([[0], np.cumsum(lens)])
    m = attn.MultiheadAttention(E, H, num_kv_heads=2, batch_first=batch_first)
    m.load_state_dict({k: rng.standard_normal(v.shape).astype(np.float32) * 0.3 for k, v in m.state_dict().items()})
    T = int(cu[-1])
    x = rng.standard_normal((1, T, E) if batch_first else (T, 1, E)).astype(np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    rope = {"theta": 500.0, "position_offset": 2}
    out, w = m(x, x, x, need_weights=False, is_causal=True, rope=rope, cu_seqlens=cu)
    assert w is None and out.shape == x.shape
    gr = m.grad(x, x, x, g, is_causal=True, rope=rope, cu_seqlens=cu)
    seq = (lambda a, s: a[:, cu[s]:cu[s + 1]]) if batch_first else (lambda a, s: a[cu[s]:cu[s + 1]])
    psum = {}
    for s in range(len(lens)):
        if not lens[s]:
            continue
        xs = np.ascontiguousarray(seq(x, s))
        o1, _ = m(xs, xs, xs, need_weights=False, is_causal=True, rope=rope)
        close(seq(out, s), o1, f"layer sequence {s}'s out")
        g1 = m.grad(xs, xs, xs, np.ascontiguousarray(seq(g, s)), is_causal=True, rope=rope)
        close(seq(gr["query"], s), g1["query"], f"layer sequence {s}'s dquery", 1e-4)
        for name, a in g1.items():
            if name != "query":
                psum[name] = psum.get(name, 0) + a.astype(np.float64)
    for name, a in psum.items():
        close(gr[name], a, f"layer gradient of {name}", 1e-4)
    for bad, why in (({"need_weights": True}, "need_weights=False"), ({"key": x[..., ::-1].copy()}, "same object")):
        kw = {"need_weights": False, "key": x}
        kw.update(bad)
        try:
            m(x, kw["key"], x, need_weights=kw["need_weights"], cu_seqlens=cu)
            raise AssertionError(f"layer: packed call with {bad} accepted")
        except ValueError as e:
            assert why in str(e), str(e)
    try:  # the library checks the offsets: the last one must be the token count
        m(x, x, x, need_weights=False, cu_seqlens=cu + [0, 0, 0, 0, 0, 1])
        raise AssertionError("layer: offsets past the tokens accepted")
    except attn.AttnError as e:
        assert "cu_seqlens_q" in str(e), str(e)


def torch_autograd(rng):
    try:
        import torch
    except ImportError:
        print("test_varlen: torch not installed: autograd not tested")
        return
    cu = torch.tensor([0, 3, 3, 11], dtype=torch.int32)
    q, k, v = (torch.randn(1, 2, 11, 8, requires_grad=True) for _ in range(3))
    out = attn.scaled_dot_product_attention(q, k, v, is_causal=True, cu_seqlens_q=cu)
    out.sum().backward()
    for s, (a, b) in enumerate(((0, 3), (3, 11))):
        qs, ks, vs = (x.detach()[:, :, a:b].clone().requires_grad_() for x in (q, k, v))
        o1 = attn.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        o1.sum().backward()
        close(out.detach()[:, :, a:b].numpy(), o1.detach().numpy(), f"torch sequence {s}'s out")
        close(q.grad[:, :, a:b].numpy(), qs.grad.numpy(), f"torch sequence {s}'s dq", 1e-4)
        close(k.grad[:, :, a:b].numpy(), ks.grad.numpy(), f"torch sequence {s}'s dk", 1e-4)


def main():
    rng = np.random.default_rng(16)
    packed_vs_alone(rng, [37, 0, 5, 70], [37, 0, 5, 70], 4, 2, 16)
    packed_vs_alone(rng, [9, 1, 33], [20, 7, 2], 2, 2, 8, is_causal=True, causal_align="bottom-right")
    packed_vs_alone(rng, [17, 40], [17, 40], 2, 1, 32, is_causal=True, window=5, softcap=4.0, alibi=True,
                    sinks=np.array([0.1, -0.2], np.float32))
    packed_vs_alone(rng, [12, 30], [12, 30], 2, 2, 8, scale=0.2)
    refusals()
    layer_packed_vs_alone(rng, batch_first=True)
    layer_packed_vs_alone(rng, batch_first=False)
    torch_autograd(rng)
    print("test_varlen: ok")


if __name__ == "__main__":
    main()
