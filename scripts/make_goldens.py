#!/usr/bin/env python3
"""Writes the golden test cases under tests/golden/ with PyTorch.

Every input is drawn in float32 from a fixed seed and stored as float32; the
reference outputs are computed in float64 from those same float32 values
(upcast exactly) and stored as float64 .npy. Running this again rewrites the
same bytes.

Layout: tests/golden/<case>/{*.npy, params.safetensors, case.txt} and
tests/golden/INDEX (one case name per line). See tests/test_golden.c (forward)
and tests/test_backward.c (gradients of the cases with backward=1).

The options of recent models (sliding window, softcap, ALiBi, attention sinks,
dropout) are computed from their definitions in include/attn.h by explicit
float64 math in torch; dropout's keep mask comes from a Python Philox-4x32-10
written here from the algorithm (checked against Random123's known answers),
keyed as src/dropout.h documents, so those goldens also check the C generator.

Usage: python scripts/make_goldens.py [output_dir]
"""

import math
import os
import shutil
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

torch.set_num_threads(1)  # same summation order every run

F32 = torch.float32
F64 = torch.float64


# ---------------------------------------------------------------------------
# The seed module, as given (tests/golden cases of naming=seed follow it).
# ---------------------------------------------------------------------------
class MultiHeadSelfAttention(nn.Module):
    def __init__(self, embed_size, num_heads):
        super().__init__()
        self.embed_size = embed_size
        self.num_heads = num_heads
        assert embed_size % num_heads == 0
        self.depth = embed_size // num_heads
        self.wq = nn.Linear(embed_size, embed_size)
        self.wk = nn.Linear(embed_size, embed_size)
        self.wv = nn.Linear(embed_size, embed_size)
        self.dense = nn.Linear(embed_size, embed_size)

    def split_into_heads(self, x, batch_size):
        x = x.view(batch_size, -1, self.num_heads, self.depth)
        return x.permute(0, 2, 1, 3)

    def forward(self, q, k, v, mask=None):
        batch_size = q.size(0)
        q = self.split_into_heads(self.wq(q), batch_size)
        k = self.split_into_heads(self.wk(k), batch_size)
        v = self.split_into_heads(self.wv(v), batch_size)
        scaled_attention, attention_weights = seed_sdpa(q, k, v, mask=mask)
        concat = scaled_attention.permute(0, 2, 1, 3).contiguous().view(batch_size, -1, self.embed_size)
        return self.dense(concat), attention_weights


def seed_sdpa(q, k, v, mask=None):
    """The seed's scaled_dot_product_attention. Note dk is a float32 scalar:
    sqrt(D) rounded to float32, so the cases use D = 16 (sqrt exact)."""
    matmul_qk = torch.matmul(q, k.transpose(-2, -1))
    dk = torch.tensor(k.shape[-1], dtype=torch.float32).sqrt()
    logits = matmul_qk / dk
    if mask is not None:
        logits += mask * -1e9
    attention_weights = torch.softmax(logits, dim=-1)
    return torch.matmul(attention_weights, v), attention_weights


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
class Case:
    """Collects one case's arrays and manifest, then writes them."""

    def __init__(self, name, manifest):
        self.name = name
        self.manifest = dict(manifest)
        self.arrays = {}
        self.params = None

    def add(self, fname, tensor):
        self.arrays[fname] = tensor.detach().cpu().contiguous().numpy()

    def write(self, root):
        d = os.path.join(root, self.name)
        os.makedirs(d)
        for fname, arr in self.arrays.items():
            np.save(os.path.join(d, fname + ".npy"), np.ascontiguousarray(arr))
        if self.params is not None:
            save_file({k: v.contiguous() for k, v in self.params.items()}, os.path.join(d, "params.safetensors"))
        with open(os.path.join(d, "case.txt"), "w") as f:
            for key, val in self.manifest.items():
                f.write(f"{key}={val}\n")
        shapes = " ".join(f"{k}{list(a.shape)}" for k, a in self.arrays.items())
        print(f"{self.name:22s} {self.manifest['kind']:4s} {shapes}")


def randn(gen, *shape):
    """float32 normal draws, as a float32 tensor."""
    return torch.randn(*shape, generator=gen, dtype=F32)


def assert_no_empty_row(allowed):
    """allowed: bool [..., Nq, Nk], True = the key takes part."""
    assert bool(allowed.any(dim=-1).all()), "a golden case has a fully masked row"


def causal_allowed(nq, nk, mode):
    i = torch.arange(nq).unsqueeze(1)
    j = torch.arange(nk).unsqueeze(0)
    if mode == "top_left":
        return j <= i
    if mode == "bottom_right":
        return j <= i + (nk - nq)
    return torch.ones(nq, nk, dtype=torch.bool)


def math_sdpa(q, k, v, scale, bias):
    """float64 attention from first principles: returns out, weights, lse.
    bias: additive float64 logits bias (-inf masks), broadcastable, or None."""
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk:  # grouped-query: query head h reads kv head h // (hq // hk)
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    logits = (q @ k.transpose(-2, -1)) * scale
    if bias is not None:
        logits = logits + bias
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.softmax(logits, dim=-1)
    return weights @ v, weights, lse


def bias_from_allowed(allowed):
    return torch.zeros(allowed.shape, dtype=F64).masked_fill(~allowed, -math.inf)


# ---------------------------------------------------------------------------
# SDPA cases
# ---------------------------------------------------------------------------
def add_forward(case, q, k, v, out, weights, lse):
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("weights", weights), ("lse", lse)):
        case.add(name, t)


def add_backward(case, G, grads, fourth):
    """dout G and dq, dk, dv; fourth names grads[3] (dmask, dsinks) when there is one."""
    case.manifest["backward"] = 1
    case.add("G", G)
    for name, g in zip(("dq", "dk", "dv"), grads):
        case.add(name, g)
    if fourth:
        case.add(fourth, grads[3])


def sdpa_case(name, seed, B, Hq, Hk, Nq, Nk, D, Dv=None, scale=None, causal="none", mask_mode="none",
              mask_shape=None, key_padding=False, backward=False):
    """Builds an sdpa case. mask_mode: none | keep | additive | seed.
    backward: also an upstream gradient G (float32) and float64 autograd's dq, dk, dv
    (and dmask, shaped like the mask, for an additive mask) of sum(out * G)."""
    Dv = D if Dv is None else Dv
    gen = torch.Generator().manual_seed(seed)
    q32, k32, v32 = randn(gen, B, Hq, Nq, D), randn(gen, B, Hk, Nk, D), randn(gen, B, Hk, Nk, Dv)
    q, k, v = q32.to(F64), k32.to(F64), v32.to(F64)
    eff_scale = 1.0 / math.sqrt(D) if scale is None else scale

    # allowed[b,h,i,j]: which logits survive every mask; bias: what is added.
    allowed = causal_allowed(Nq, Nk, causal).expand(B, Hq, Nq, Nk).clone()
    bias = torch.zeros(B, Hq, Nq, Nk, dtype=F64)
    case = Case(name, dict(kind="sdpa", causal=causal, mask_mode=mask_mode,
                           scale="default" if scale is None else repr(float(scale)), gqa=int(Hq != Hk)))

    mask = None
    if mask_mode != "none":
        # Draw a mask, then make sure each row keeps a key the causal rule allows.
        keep = torch.rand(*mask_shape, generator=gen) > 0.35
        first_ok = causal_allowed(Nq, Nk, causal).int().argmax(dim=-1)  # a key each row may see
        keep[..., torch.arange(Nq), first_ok] = True
        if mask_mode == "keep":
            mask = keep
            allowed &= keep
        elif mask_mode == "additive":
            mask = (0.5 * randn(gen, *mask_shape)).masked_fill(~keep, -math.inf)  # float32
            bias = bias + mask.to(F64)
            allowed &= keep
        elif mask_mode == "seed":
            mask = (~keep).to(F32)  # 1 = masked, the seed adds mask * -1e9
        else:
            raise ValueError(mask_mode)
        case.add("mask", mask)

    if key_padding:
        pad = torch.zeros(B, Nk, dtype=torch.bool)
        pad[B - 1, Nk - 2:] = True  # the last batch ignores its last two keys
        allowed &= ~pad[:, None, None, :]
        case.add("key_padding", pad)

    assert_no_empty_row(allowed if mask_mode != "seed" else (mask == 0) & allowed)

    if mask_mode == "seed":
        # The seed's own formula, in float64 (its mask is float 0/1, 1 = masked).
        assert scale is None and causal == "none" and Hq == Hk and math.isqrt(D) ** 2 == D
        out, weights = seed_sdpa(q, k, v, mask=mask.to(F64))
        logits = q @ k.transpose(-2, -1) / math.sqrt(D) + mask.to(F64) * -1e9
        lse = torch.logsumexp(logits, dim=-1)
        ref_out = out
    else:
        bias = bias.masked_fill(~allowed, -math.inf)
        ref_out, weights, lse = math_sdpa(q, k, v, eff_scale, bias)

        def torch_sdpa(q, k, v, mask64):
            """The output from PyTorch's sdpa (float64); mask64: the additive mask as float64."""
            kw = dict(scale=scale, enable_gqa=Hq != Hk)
            if causal == "top_left" and mask is None and not key_padding:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
            elif causal == "none" and mask_mode == "keep" and not key_padding:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
            elif causal == "none" and mask_mode == "additive" and not key_padding:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask64, **kw)
            elif causal == "none" and mask_mode == "none" and not key_padding:
                return F.scaled_dot_product_attention(q, k, v, **kw)
            else:  # several rules at once (or bottom-right causal): one explicit keep mask
                return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.isfinite(bias)
                                                      if mask_mode != "additive" else bias, **kw)

        out = torch_sdpa(q, k, v, mask.to(F64) if mask_mode == "additive" else None)
    assert torch.allclose(out, ref_out, rtol=0, atol=1e-12), name

    if backward:
        # Gradients of sum(out * G) by float64 autograd, through PyTorch's sdpa (the seed's
        # formula for seed masks), checked against autograd of the explicit math.
        G32 = randn(gen, B, Hq, Nq, Dv)
        G = G32.to(F64)
        grad_mask = mask_mode == "additive"
        assert not grad_mask or (causal == "none" and not key_padding), "dmask only through sdpa's attn_mask"

        def autograd(fn):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            if grad_mask:
                leaves.append(mask.to(F64).clone().requires_grad_(True))
            (fn(*leaves) * G).sum().backward()
            return [t.grad for t in leaves]

        if mask_mode == "seed":
            grads = autograd(lambda q, k, v: seed_sdpa(q, k, v, mask=mask.to(F64))[0])
            check = autograd(lambda q, k, v: math_sdpa(q, k, v, eff_scale, mask.to(F64) * -1e9)[0])
        elif grad_mask:
            grads = autograd(lambda q, k, v, m: torch_sdpa(q, k, v, m))
            check = autograd(lambda q, k, v, m: math_sdpa(
                q, k, v, eff_scale, (m + torch.zeros(B, Hq, Nq, Nk, dtype=F64)).masked_fill(~allowed, -math.inf))[0])
        else:
            grads = autograd(lambda q, k, v: torch_sdpa(q, k, v, None))
            check = autograd(lambda q, k, v: math_sdpa(q, k, v, eff_scale, bias)[0])
        for g, c in zip(grads, check):
            assert torch.isfinite(g).all() and torch.allclose(g, c, rtol=0, atol=1e-12), name
        add_backward(case, G32, grads, "dmask" if grad_mask else None)

    add_forward(case, q32, k32, v32, out, weights, lse)
    return case


def sdpa_cases():
    return [
        sdpa_case("sdpa_plain", 101, B=2, Hq=2, Hk=2, Nq=7, Nk=7, D=8),
        sdpa_case("sdpa_scale", 102, B=2, Hq=3, Hk=3, Nq=5, Nk=9, D=8, scale=0.3),
        sdpa_case("sdpa_causal_tl", 103, B=2, Hq=2, Hk=2, Nq=6, Nk=9, D=8, causal="top_left"),
        sdpa_case("sdpa_causal_tl_tall", 104, B=2, Hq=2, Hk=2, Nq=9, Nk=6, D=8, causal="top_left"),
        sdpa_case("sdpa_causal_br", 105, B=2, Hq=2, Hk=2, Nq=5, Nk=11, D=8, causal="bottom_right"),
        sdpa_case("sdpa_keep_2d", 106, B=2, Hq=2, Hk=2, Nq=6, Nk=10, D=8, mask_mode="keep", mask_shape=(6, 10)),
        sdpa_case("sdpa_keep_4d", 107, B=2, Hq=3, Hk=3, Nq=7, Nk=8, D=8, mask_mode="keep", mask_shape=(2, 1, 7, 8)),
        sdpa_case("sdpa_additive", 108, B=2, Hq=2, Hk=2, Nq=6, Nk=9, D=12, mask_mode="additive",
                  mask_shape=(2, 2, 6, 9)),
        sdpa_case("sdpa_gqa", 109, B=2, Hq=4, Hk=2, Nq=7, Nk=9, D=8),
        sdpa_case("sdpa_mqa", 110, B=2, Hq=4, Hk=1, Nq=5, Nk=8, D=8, mask_mode="keep", mask_shape=(1, 4, 5, 8)),
        sdpa_case("sdpa_dv", 111, B=2, Hq=2, Hk=2, Nq=6, Nk=8, D=8, Dv=12),
        sdpa_case("sdpa_seed_mask", 112, B=2, Hq=2, Hk=2, Nq=7, Nk=7, D=16, mask_mode="seed",
                  mask_shape=(2, 1, 7, 7)),
        sdpa_case("sdpa_key_padding", 113, B=2, Hq=2, Hk=2, Nq=5, Nk=9, D=8, key_padding=True),
        sdpa_case("sdpa_combo", 114, B=2, Hq=4, Hk=2, Nq=17, Nk=17, D=16, Dv=8, scale=0.2,
                  causal="top_left", mask_mode="additive", mask_shape=(17, 17)),
        sdpa_case("sdpa_combo_br", 115, B=2, Hq=4, Hk=2, Nq=4, Nk=13, D=8, causal="bottom_right",
                  mask_mode="keep", mask_shape=(2, 1, 4, 13), key_padding=True),
        # backward=1: the gradients too (tests/test_backward.c)
        sdpa_case("sdpa_bwd_plain", 301, B=2, Hq=2, Hk=2, Nq=6, Nk=7, D=8, backward=True),
        sdpa_case("sdpa_bwd_gqa_causal", 302, B=2, Hq=4, Hk=2, Nq=6, Nk=9, D=8, Dv=12, scale=0.3,
                  causal="top_left", backward=True),
        sdpa_case("sdpa_bwd_additive", 303, B=2, Hq=2, Hk=2, Nq=6, Nk=9, D=8, mask_mode="additive",
                  mask_shape=(2, 1, 6, 9), backward=True),
        sdpa_case("sdpa_bwd_mqa_br", 304, B=2, Hq=4, Hk=1, Nq=4, Nk=10, D=8, causal="bottom_right",
                  mask_mode="keep", mask_shape=(1, 4, 4, 10), key_padding=True, backward=True),
        sdpa_case("sdpa_bwd_seed", 305, B=2, Hq=2, Hk=2, Nq=7, Nk=7, D=16, mask_mode="seed",
                  mask_shape=(2, 1, 7, 7), backward=True),
    ]


# ---------------------------------------------------------------------------
# Dropout's keep mask: Philox-4x32-10 in plain Python (Salmon et al., SC 2011),
# keyed as src/dropout.h documents, written from the algorithm so that the
# goldens check the C generator rather than copy it.
# ---------------------------------------------------------------------------
U32 = 0xFFFFFFFF
PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # Weyl key increments: golden ratio, sqrt(3) - 1


def philox4x32_10(ctr, key):
    """Ten rounds of Philox-4x32 on the 4-word counter under the 2-word key."""
    x = list(ctr)
    k = list(key)
    for rnd in range(10):
        if rnd:  # the key is bumped between rounds
            k = [(k[0] + PHILOX_W[0]) & U32, (k[1] + PHILOX_W[1]) & U32]
        a = PHILOX_M[0] * x[0]  # 64-bit products: high and low words
        b = PHILOX_M[1] * x[2]
        x = [((b >> 32) ^ x[1] ^ k[0]) & U32, b & U32, ((a >> 32) ^ x[3] ^ k[1]) & U32, a & U32]
    return x


# Random123's published known answers for philox4x32_10: counter, key -> output.
for _ctr, _key, _want in [
        ((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
        ((U32,) * 4, (U32, U32), (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
        ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
         (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1))]:
    assert tuple(philox4x32_10(_ctr, _key)) == _want, "philox4x32_10 known answer"


def dropout_keep(seed, p, B, H, Nq, Nk):
    """bool [B, H, Nq, Nk]: entry (b, h, i, j) is kept unless word (j & 3) of
    philox(counter (j >> 2, i, h, b), key (low, high word of seed)) < floor(p * 2^32)."""
    threshold = int(p * 4294967296.0)
    key = (seed & U32, (seed >> 32) & U32)
    keep = torch.ones(B, H, Nq, Nk, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(Nq):
                for j0 in range(0, Nk, 4):
                    u = philox4x32_10((j0 >> 2, i, h, b), key)
                    for j in range(j0, min(j0 + 4, Nk)):
                        keep[b, h, i, j] = u[j & 3] >= threshold
    return keep


def alibi_paper_slopes(H):
    """The ALiBi paper's slopes: 2^(-8(h+1)/n) for the largest power of two n <= H,
    then every other slope of 2n for the remaining heads."""
    n = 1 << (H.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    slopes += [2.0 ** (-8.0 * (2 * r + 1) / (2 * n)) for r in range(H - n)]
    return torch.tensor(slopes, dtype=F32)


# ---------------------------------------------------------------------------
# Cases of the options of recent models: sliding window, softcap, ALiBi,
# attention sinks, dropout. Explicit float64 math, each option as defined in
# include/attn.h; checked against F.scaled_dot_product_attention where an
# option is a mask, and the gradients against finite differences.
# ---------------------------------------------------------------------------
def options_case(name, seed, B, Hq, Hk, Nq, Nk, D, Dv=None, causal="none", window=0, softcap=0.0,
                 alibi=False, sinks=False, dropout_p=0.0, dropout_seed=0, keep_shape=None, dead_row=False,
                 q_amp=1.0):
    Dv = D if Dv is None else Dv
    gen = torch.Generator().manual_seed(seed)
    q32 = (q_amp * randn(gen, B, Hq, Nq, D)).to(F32)
    k32, v32 = randn(gen, B, Hk, Nk, D), randn(gen, B, Hk, Nk, Dv)
    q, k, v = q32.to(F64), k32.to(F64), v32.to(F64)
    scale = 1.0 / math.sqrt(D)
    # a window implies the causal bound (top-left when none is asked for)
    eff_causal = "top_left" if window > 0 and causal == "none" else causal
    case = Case(name, dict(kind="sdpa", causal=causal, mask_mode="keep" if keep_shape else "none",
                           scale="default", gqa=int(Hq != Hk)))

    # query row i sits at i' = i + Nk - Nq under bottom-right alignment, else at i
    ipos = torch.arange(Nq).unsqueeze(1) + (Nk - Nq if eff_causal == "bottom_right" else 0)
    j = torch.arange(Nk).unsqueeze(0)
    allowed = causal_allowed(Nq, Nk, eff_causal)
    if window > 0:
        allowed = allowed & (j > ipos - window)
        case.manifest["window"] = window
    allowed = allowed.expand(B, Hq, Nq, Nk).clone()
    keep_mask = None
    if keep_shape:
        keep_mask = torch.rand(*keep_shape, generator=gen) > 0.3
        if dead_row:  # batch 1, row 0: no key at all (only the sink is left)
            keep_mask[1, ..., 0, :] = False
        allowed &= keep_mask
        case.add("mask", keep_mask)
    if not sinks:
        assert_no_empty_row(allowed)

    slopes = alibi_paper_slopes(Hq) if alibi else None
    sink32 = (1.5 * randn(gen, Hq)).to(F32) if sinks else None
    if alibi:
        case.add("alibi", slopes)
    if sinks:
        case.add("sinks", sink32)
    if softcap:
        case.manifest["softcap"] = repr(float(softcap))
    keep = None
    if dropout_p:
        case.manifest["dropout_p"] = repr(float(dropout_p))
        case.manifest["dropout_seed"] = dropout_seed
        keep = dropout_keep(dropout_seed, dropout_p, B, Hq, Nq, Nk)
        frac = keep.double().mean().item()
        assert abs(frac - (1 - dropout_p)) < 0.1, f"{name}: kept fraction {frac}"

    def forward(q, k, v, sink):
        """out, weights, lse from first principles."""
        kk = k.repeat_interleave(Hq // Hk, dim=1)
        vv = v.repeat_interleave(Hq // Hk, dim=1)
        s = (q @ kk.transpose(-2, -1)) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if alibi:
            s = s + slopes.to(F64).view(1, Hq, 1, 1) * (j - ipos).to(F64)
        s = s.masked_fill(~allowed, -math.inf)
        if sinks:  # one more logit per head, dropped after the softmax
            s = torch.cat([s, sink.view(1, Hq, 1, 1).expand(B, Hq, Nq, 1)], dim=-1)
        lse = torch.logsumexp(s, dim=-1)
        w = torch.softmax(s, dim=-1)
        if sinks:
            w = w[..., :Nk]
        if keep is not None:
            w = w * keep.to(F64) / (1 - dropout_p)
        return w @ vv, w, lse

    sink64 = sink32.to(F64) if sinks else None
    with torch.no_grad():
        out, weights, lse = forward(q, k, v, sink64)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    if not softcap and not sinks and not dropout_p:
        # window, causal and ALiBi are masks: PyTorch's sdpa must agree
        bias = torch.zeros(B, Hq, Nq, Nk, dtype=F64)
        if alibi:
            bias = bias + slopes.to(F64).view(1, Hq, 1, 1) * (j - ipos).to(F64)
        bias = bias.masked_fill(~allowed, -math.inf)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=Hq != Hk)
        assert torch.allclose(ref, out, rtol=0, atol=1e-12), name

    # gradients of sum(out * G) by float64 autograd, checked by finite differences
    G32 = randn(gen, B, Hq, Nq, Dv)
    G = G32.to(F64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    if sinks:
        leaves.append(sink64.clone().requires_grad_(True))

    def loss(*xs):
        return (forward(xs[0], xs[1], xs[2], xs[3] if sinks else None)[0] * G).sum()

    loss(*leaves).backward()
    assert torch.autograd.gradcheck(loss, leaves, eps=1e-6, atol=1e-7, rtol=1e-6), name
    grads = [t.grad for t in leaves]
    for g in grads:
        assert torch.isfinite(g).all(), name
    add_backward(case, G32, grads, "dsinks" if sinks else None)
    add_forward(case, q32, k32, v32, out, weights, lse)
    return case


def options_cases():
    return [
        options_case("sdpa_window", 401, B=2, Hq=2, Hk=2, Nq=11, Nk=11, D=8, window=4),
        # bottom-right, GQA, three query rows: the decode kernel's size
        options_case("sdpa_window_br", 402, B=2, Hq=4, Hk=2, Nq=3, Nk=13, D=8, causal="bottom_right", window=5),
        options_case("sdpa_softcap", 403, B=2, Hq=2, Hk=2, Nq=7, Nk=9, D=8, softcap=2.0, causal="top_left",
                     q_amp=3.0),
        options_case("sdpa_alibi", 404, B=2, Hq=4, Hk=2, Nq=5, Nk=10, D=8, alibi=True, causal="bottom_right"),
        options_case("sdpa_alibi_nc", 405, B=2, Hq=3, Hk=3, Nq=6, Nk=9, D=8, alibi=True),
        options_case("sdpa_sinks", 406, B=2, Hq=4, Hk=2, Nq=6, Nk=9, D=8, sinks=True, keep_shape=(2, 1, 6, 9),
                     dead_row=True),
        options_case("sdpa_dropout", 407, B=2, Hq=4, Hk=2, Nq=6, Nk=11, D=8, dropout_p=0.3,
                     dropout_seed=0x9E3779B97F4A7C15, causal="top_left"),
        options_case("sdpa_all_options", 408, B=2, Hq=4, Hk=2, Nq=5, Nk=12, D=8, causal="bottom_right", window=6,
                     softcap=2.5, alibi=True, sinks=True, dropout_p=0.2, dropout_seed=12345, q_amp=2.0),
    ]


# ---------------------------------------------------------------------------
# MHA cases
# ---------------------------------------------------------------------------
def mha_manifest(naming, E, H, kdim=None, vdim=None, bias=1, prefix="", causal="none", mask_mode="none",
                 average_weights=0, self_attn=1):
    return dict(kind="mha", naming=naming, embed_dim=E, heads=H, kdim=kdim or E, vdim=vdim or E, bias=bias,
                prefix=prefix, causal=causal, mask_mode=mask_mode, average_weights=average_weights,
                self=self_attn)


def seed_module_case(name, seed, B, E, H, Nq, Nk=None, with_mask=False):
    torch.manual_seed(seed)
    module = MultiHeadSelfAttention(E, H)  # float32 parameters
    params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    module = module.double().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    cross = Nk is not None
    Nk = Nk if cross else Nq
    case = Case(name, mha_manifest("seed", E, H, mask_mode="seed" if with_mask else "none",
                                     self_attn=0 if cross else 1))
    case.params = params
    x32 = randn(gen, B, Nq, E)
    case.add("x", x32)
    if cross:
        k32, v32 = randn(gen, B, Nk, E), randn(gen, B, Nk, E)
        case.add("key", k32)
        case.add("value", v32)
    else:
        k32 = v32 = x32
    mask = None
    if with_mask:
        masked = torch.rand(B, 1, Nq, Nk, generator=gen) < 0.35
        masked[..., 0] = False  # every query keeps key 0
        mask = masked.to(F32)  # the seed's float 0/1 mask, 1 = masked
        case.add("mask", mask)
    with torch.no_grad():
        out, weights = module(x32.to(F64), k32.to(F64), v32.to(F64),
                              mask=None if mask is None else mask.to(F64))
    case.add("out", out)
    case.add("weights", weights)  # per head, [B, H, Nq, Nk]
    return case


def torch_mha_case(name, seed, B, E, H, Nq, Nk=None, kdim=None, vdim=None, bias=True, prefix="",
                   causal="none", mask_kind="none", key_padding=False, average=True):
    """nn.MultiheadAttention(batch_first=True), float32 parameters, run in float64.
    mask_kind: none | bool2d ([Nq,Nk], True = masked) | bool3d ([B*H,Nq,Nk], stored as
    [B,H,Nq,Nk]) | float2d (additive, -inf entries)."""
    torch.manual_seed(seed)
    module = nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=True)
    params = {prefix + k: v.detach().clone() for k, v in module.state_dict().items()}
    if prefix:  # a tensor the loader must ignore
        params[prefix.rsplit("self_attn.", 1)[0] + "norm1.weight"] = torch.ones(E)
    module = module.double().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    cross = Nk is not None
    Nk = Nk if cross else Nq
    mask_mode = {"none": "none", "bool2d": "masked", "bool3d": "masked", "float2d": "additive"}[mask_kind]
    case = Case(name, mha_manifest("torch", E, H, kdim=kdim, vdim=vdim, bias=int(bias), prefix=prefix,
                                     causal=causal, mask_mode=mask_mode, average_weights=int(average),
                                     self_attn=0 if cross else 1))
    case.params = params

    x32 = randn(gen, B, Nq, E)
    case.add("x", x32)
    if cross:
        k32, v32 = randn(gen, B, Nk, kdim or E), randn(gen, B, Nk, vdim or E)
        case.add("key", k32)
        case.add("value", v32)
    else:
        k32 = v32 = x32

    allowed = causal_allowed(Nq, Nk, causal).expand(B, H, Nq, Nk).clone()
    attn_mask = None  # what PyTorch gets
    if causal != "none":
        attn_mask = ~causal_allowed(Nq, Nk, causal)  # True = masked; not stored, the manifest says causal
    if mask_kind == "bool2d":
        masked = torch.rand(Nq, Nk, generator=gen) < 0.35
        masked[:, 0] = False
        allowed &= ~masked
        attn_mask, stored = masked, masked
    elif mask_kind == "bool3d":
        masked = torch.rand(B, H, Nq, Nk, generator=gen) < 0.35
        masked[..., 1] = False
        allowed &= ~masked
        attn_mask, stored = masked.reshape(B * H, Nq, Nk), masked
    elif mask_kind == "float2d":
        masked = torch.rand(Nq, Nk, generator=gen) < 0.3
        masked[:, 0] = False
        add = (0.5 * randn(gen, Nq, Nk)).masked_fill(masked, -math.inf)  # float32
        allowed &= ~masked
        attn_mask, stored = add.to(F64), add
    if mask_kind != "none":
        assert causal == "none"
        case.add("mask", stored)
    pad = None
    if key_padding:
        pad = torch.zeros(B, Nk, dtype=torch.bool)
        pad[0, Nk - 1] = True
        pad[B - 1, Nk - 3:] = True
        allowed &= ~pad[:, None, None, :]
        case.add("key_padding", pad)
    assert_no_empty_row(allowed)

    with torch.no_grad():
        out, weights = module(x32.to(F64), k32.to(F64), v32.to(F64), key_padding_mask=pad, attn_mask=attn_mask,
                              need_weights=True, average_attn_weights=average)
    assert weights.shape == ((B, Nq, Nk) if average else (B, H, Nq, Nk))
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    case.add("out", out)
    case.add("weights", weights)
    return case


def mha_cases():
    return [
        seed_module_case("mha_seed", 201, B=2, E=32, H=2, Nq=7),
        seed_module_case("mha_seed_mask", 202, B=2, E=32, H=2, Nq=9, with_mask=True),
        seed_module_case("mha_seed_cross", 203, B=2, E=32, H=2, Nq=5, Nk=11, with_mask=True),
        torch_mha_case("mha_torch_avg", 211, B=2, E=24, H=3, Nq=8, mask_kind="bool2d", key_padding=True,
                       average=True),
        torch_mha_case("mha_torch_heads", 212, B=2, E=32, H=4, Nq=7, mask_kind="bool2d", key_padding=True,
                       average=False, prefix="encoder.layers.0.self_attn."),
        torch_mha_case("mha_torch_causal", 213, B=2, E=16, H=2, Nq=9, causal="top_left", key_padding=True,
                       average=False),
        torch_mha_case("mha_torch_kvdim", 214, B=2, E=24, H=2, Nq=6, Nk=11, kdim=10, vdim=6,
                       mask_kind="bool3d", key_padding=True, average=False),
        torch_mha_case("mha_torch_kvdim_avg", 215, B=2, E=16, H=4, Nq=5, Nk=8, kdim=12, vdim=20, average=True),
        torch_mha_case("mha_torch_nobias", 216, B=2, E=24, H=3, Nq=7, bias=False, mask_kind="float2d",
                       average=False),
        torch_mha_case("mha_torch_cross_nobias", 217, B=2, E=16, H=2, Nq=4, Nk=10, bias=False, key_padding=True,
                       average=True),
    ]


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                              "..", "tests", "golden")
    root = os.path.normpath(root)
    cases = sdpa_cases() + options_cases() + mha_cases()
    if os.path.isdir(root):  # start clean so removed cases do not linger
        for entry in os.listdir(root):
            path = os.path.join(root, entry)
            if os.path.isdir(path) and os.path.exists(os.path.join(path, "case.txt")):
                shutil.rmtree(path)
    os.makedirs(root, exist_ok=True)
    for case in cases:
        case.write(root)
    with open(os.path.join(root, "INDEX"), "w") as f:
        for case in cases:
            f.write(case.name + "\n")
    total = sum(os.path.getsize(os.path.join(dp, fn)) for dp, _, fns in os.walk(root) for fn in fns)
    print(f"{len(cases)} cases, {total / 1024:.1f} KiB in {root}")


if __name__ == "__main__":
    main()
