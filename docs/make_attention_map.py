#!/usr/bin/env python3
"""Makes the README's attention map: a hand-built 4-head layer whose heads
attend to the same word, the previous word, the word itself, and at random;
then draws it with `attn map`. Needs NumPy only.

    python3 docs/make_attention_map.py [build/attn]   -> docs/attention_map.png
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

TOKENS = "the cat sat on the mat because it was tired".split()
E, H, D = 32, 4, 8                          # x = [word embedding (16) | position (16)]
N = len(TOKENS)
rng = np.random.default_rng(7)


def write_safetensors(path, tensors):
    """The safetensors layout: u64 header length, JSON header, raw little-endian data."""
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, "<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))


# inputs: random unit word vectors (the same word, the same vector) and sin/cos positions
words = {w: v / np.linalg.norm(v) for w, v in ((w, rng.standard_normal(16)) for w in sorted(set(TOKENS)))}
freqs = np.array([0.35, 0.55, 0.8, 1.05, 0.3, 0.6, 0.9, 1.2])
pos = np.stack([np.concatenate([[np.cos(f * i), np.sin(f * i)] for f in freqs]) for i in range(N)])  # [N, 16]
x = np.concatenate([np.stack([words[t] for t in TOKENS]), pos], axis=1).astype(np.float32)       # [N, E]

wq, wk = np.zeros((E, E)), np.zeros((E, E))
s = 2.2
# head 0: same word (q = k = a projection of the word vector)
P = np.linalg.qr(rng.standard_normal((16, 16)))[0][:D] * 7.0
wq[0:8, 0:16] = wk[0:8, 0:16] = P
# head 1: previous word (k is the position rotated one step on, so q_i . k_j peaks at j = i - 1)
for p, f in enumerate(freqs[:4]):
    c, sn = np.cos(f), np.sin(f)
    r = slice(8 + 2 * p, 10 + 2 * p)
    wq[r, 16 + 2 * p:18 + 2 * p] = s * np.eye(2)
    wk[r, 16 + 2 * p:18 + 2 * p] = s * np.array([[c, -sn], [sn, c]])
# head 2: the word itself (q = k = position)
for p in range(4):
    wq[16 + 2 * p:18 + 2 * p, 24 + 2 * p:26 + 2 * p] = wk[16 + 2 * p:18 + 2 * p, 24 + 2 * p:26 + 2 * p] = s * np.eye(2)
# head 3: whatever random weights give
wq[24:32] = rng.standard_normal((8, E)) * 0.6
wk[24:32] = rng.standard_normal((8, E)) * 0.6
params = {"wq.weight": wq, "wk.weight": wk, "wv.weight": rng.standard_normal((E, E)) * 0.3,
          "dense.weight": rng.standard_normal((E, E)) * 0.3}
for n in ("wq", "wk", "wv", "dense"):
    params[n + ".bias"] = np.zeros(E)

attn = sys.argv[1] if len(sys.argv) > 1 else "build/attn"
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_map.png")
with tempfile.TemporaryDirectory() as d:
    write_safetensors(os.path.join(d, "params.safetensors"), params)
    np.save(os.path.join(d, "x.npy"), x)
    with open(os.path.join(d, "tokens.txt"), "w") as f:
        f.write("\n".join(TOKENS) + "\n")
    cmd = [attn, "map", "--params", os.path.join(d, "params.safetensors"), "--heads", str(H),
           "--query", os.path.join(d, "x.npy"), "--tokens", os.path.join(d, "tokens.txt"), "--png", out]
    print(" ".join(cmd))
    subprocess.run(cmd, check=True)
print("wrote", out)
