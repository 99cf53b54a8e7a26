#!/usr/bin/env python3
"""Packed variable-length batches beside PyTorch: `attn bench sdpa --lengths` (packed with cu_seqlens,
and the same batch padded with key padding) against what a PyTorch 2.x CPU user has for the same batch:
SDPA once per sequence in a loop, SDPA on the batch padded to the longest with a boolean mask, and
SDPA on a nested (jagged) tensor where this torch accepts one. Forward, and the backward alone.
Written into BENCHMARKS.md between <!-- varlen:begin --> and <!-- varlen:end -->.

    scripts/bench_varlen.py [--attn PATH] [--torch-python PY] [--threads 2] [--out BENCHMARKS.md] [--dry-run]

GFLOP/s count each sequence's own flops (4 D per visible pair, 2.5 times that for the backward) in
every column, so they compare as speeds. Only the standard library is used here; PyTorch runs in its
own interpreter (--torch-python, or TORCH_PYTHON, or python3).
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_grid import ROOT, cpu_model, find_torch_python, loadavg, write_markdown  # noqa: E402

LENGTHS = [37, 100, 250, 400, 700, 1000, 1500, 2048]
HEADS, DIM = 8, 64
BWD_FLOP_FACTOR = 2.5  # as attn bench counts the backward
BEGIN, END = "<!-- varlen:begin -->", "<!-- varlen:end -->"

TORCH_SIDE = r'''
import json, math, sys, time
import torch
import torch.nn.functional as F

c = json.loads(sys.argv[1])
torch.set_num_threads(c["threads"])
L, H, D, causal = c["lengths"], c["heads"], c["dim"], c["causal"]
dt = getattr(torch, c["dtype"])
gen = torch.Generator().manual_seed(0)
S, Lmax = len(L), max(L)

def timed(fn):
    fn(); fn()
    t0 = time.perf_counter(); fn(); one = time.perf_counter() - t0
    r = max(3, min(200, math.ceil(2.0 / max(one, 1e-9))))
    ts = []
    for _ in range(r):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[r // 2]

def rand(*shape):
    return (torch.rand(*shape, generator=gen) * 2 - 1).to(dt)

res = {"torch": torch.__version__}
seqs = [[rand(1, H, n, D).requires_grad_() for _ in range(3)] for n in L]
grads = [rand(1, H, n, D) for n in L]
# each sequence alone, in a loop
def loop_fwd():
    with torch.no_grad():
        for q, k, v in seqs:
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
outs = [F.scaled_dot_product_attention(q, k, v, is_causal=causal) for q, k, v in seqs]
def loop_bwd():
    for (q, k, v), o, g in zip(seqs, outs, grads):
        q.grad = k.grad = v.grad = None
        o.backward(g, retain_graph=True)
res["loop"] = [timed(loop_fwd), timed(loop_bwd)]
# padded to the longest: a boolean mask, True = attend (padding keys hidden; causal folded in)
qp, kp, vp = [rand(S, H, Lmax, D).requires_grad_() for _ in range(3)]
keep = torch.zeros(S, 1, Lmax, Lmax, dtype=torch.bool)
for s, n in enumerate(L):
    keep[s, :, :, :n] = True
if causal:
    keep &= torch.ones(Lmax, Lmax, dtype=torch.bool).tril()
gp = rand(S, H, Lmax, D)
for s, n in enumerate(L):
    gp[s, :, n:] = 0  # a padding row's loss is masked
def pad_fwd():
    with torch.no_grad():
        F.scaled_dot_product_attention(qp, kp, vp, attn_mask=keep)
op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=keep)
def pad_bwd():
    qp.grad = kp.grad = vp.grad = None
    op.backward(gp, retain_graph=True)
res["padded"] = [timed(pad_fwd), timed(pad_bwd)]
# a nested (jagged) tensor: [S, j, H, D] transposed to [S, H, j, D], as PyTorch's NJT SDPA takes it
try:
    def njt(xs):
        return torch.nested.nested_tensor([x[0].transpose(0, 1).detach() for x in xs], layout=torch.jagged).transpose(1, 2)
    qn, kn, vn = (njt([s[i] for s in seqs]) for i in range(3))
    def nested_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(qn, kn, vn, is_causal=causal)
    nested_fwd()
    res["nested"] = [timed(nested_fwd), None]
except Exception as e:  # not every torch runs SDPA on a jagged CPU tensor
    res["nested_error"] = type(e).__name__
print(json.dumps(res))
'''


def flops(causal, dim=DIM, heads=HEADS):
    pairs = sum(n * (n + 1) / 2 if causal else n * n for n in LENGTHS)
    return 4.0 * dim * pairs * heads


def ours(attn, dtype, causal, padded, threads):
    argv = [attn, "bench", "sdpa", "--lengths", ",".join(map(str, LENGTHS)), "--heads", str(HEADS), "--dim", str(DIM),
            "--threads", str(threads), "--repeat", "10", "--json", "--dtype", dtype, "--backward"]
    argv += ["--causal"] if causal else []
    argv += ["--padded"] if padded else []
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
    if p.returncode:
        sys.exit("failed: %s: %s" % (" ".join(argv), p.stderr.strip()))
    return json.loads(p.stdout.strip().splitlines()[-1])


def theirs(py, dtype, causal, threads):
    c = {"lengths": LENGTHS, "heads": HEADS, "dim": DIM, "causal": causal, "threads": threads,
         "dtype": {"f32": "float32", "bf16": "bfloat16"}[dtype]}
    p = subprocess.run([py, "-c", TORCH_SIDE, json.dumps(c)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True, timeout=1800)
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attn", default=os.path.join(ROOT, "build", "attn"))
    ap.add_argument("--torch-python")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"))
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    py = find_torch_python(a.torch_python)
    if not py:
        print("no python with torch: the PyTorch columns are left empty", file=sys.stderr)
    model, load, start = cpu_model(), loadavg(), datetime.datetime.utcnow()
    rows, version = [], None
    for dtype in ("f32", "bf16"):
        for causal in (False, True):
            packed = ours(a.attn, dtype, causal, False, a.threads)
            padded = ours(a.attn, dtype, causal, True, a.threads)
            t = theirs(py, dtype, causal, a.threads) if py else {"error": "no torch"}
            version = t.get("torch", version)
            rows.append((dtype, causal, packed, padded, t))
            print(dtype, "causal" if causal else "", "packed %.1f ms" % (packed["median_s"] * 1e3), t, file=sys.stderr)
    gf = {c: flops(c) * 1e-9 for c in (False, True)}

    def rate(s, c, bwd=False):
        return "—" if s is None else "%.1f" % (gf[c] * (BWD_FLOP_FACTOR if bwd else 1) / s)

    def ms(s):
        return "—" if s is None else "%.2f" % (s * 1e3)

    lines = [BEGIN, "",
             "Run %s UTC on %s, %d threads; load average before: %s. Command: `scripts/bench_varlen.py --attn %s "
             "--torch-python PY`. PyTorch: torch %s, same threads." % (start.strftime("%Y-%m-%d %H:%M"), model,
                                                                       a.threads, load, os.path.relpath(a.attn, ROOT),
                                                                       version or "—"),
             "Lengths %s, H %d, D %d; GFLOP/s count the sequences' own flops (the backward's 2.5 times the forward's)."
             % (",".join(map(str, LENGTHS)), HEADS, DIM),
             "*× loop* and *× padded*: PyTorch's time over ours (packed); *nested*: SDPA on a jagged nested tensor.",
             "",
             "| inputs | causal | ours packed: fwd ms (GFLOP/s) | bwd ms (GFLOP/s) | ours padded fwd / bwd ms | "
             "PyTorch loop fwd / bwd ms | PyTorch padded fwd / bwd ms | PyTorch nested fwd ms | × loop fwd / bwd | "
             "× padded fwd / bwd | oracle rel L2 fwd / bwd |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for dtype, causal, packed, padded, t in rows:
        pf, pb = packed["median_s"], packed.get("backward_median_s")
        loop, pad, nested = t.get("loop", [None, None]), t.get("padded", [None, None]), t.get("nested", [None, None])

        def ratio(x, y):
            return "—" if x is None or y is None else "%.2f×" % (x / y)
        lines.append("| %s | %s | %s (%s) | %s (%s) | %s / %s | %s / %s | %s / %s | %s | %s / %s | %s / %s | %.1e / %.1e |" % (
            dtype, "yes" if causal else "no", ms(pf), rate(pf, causal), ms(pb), rate(pb, causal, True),
            ms(padded["median_s"]), ms(padded.get("backward_median_s")), ms(loop[0]), ms(loop[1]), ms(pad[0]),
            ms(pad[1]), ms(nested[0]) if nested[0] else "fails (%s)" % t["nested_error"] if "nested_error" in t else "—",
            ratio(loop[0], pf), ratio(loop[1], pb), ratio(pad[0], pf), ratio(pad[1], pb), packed["oracle_rel_l2"],
            packed.get("backward_oracle_rel_l2", float("nan"))))
    lines += ["", END]
    block = "\n".join(lines)
    print(block)
    if not a.dry_run:
        write_markdown(a.out, block, BEGIN, END)


if __name__ == "__main__":
    main()
