#!/usr/bin/env python3
"""The standard benchmark grid: `attn bench --json` on every case, the same cases
through PyTorch (when a Python with torch is around), and the outside FMA yardstick
../shared/tools/peak.c, all in one run; writes the table into BENCHMARKS.md between
<!-- grid:begin --> and <!-- grid:end --> (prose outside the markers stays).
Then the backward table: `attn bench sdpa --backward` (forward with lse, then
attn_sdpa_backward) beside PyTorch's F.scaled_dot_product_attention and the unfused
path under autograd (forward, then .backward(G)), and our peak memory at N=16384;
written between <!-- backward:begin --> and <!-- backward:end --> (appended when absent).
Then the half-precision table: `attn bench sdpa --dtype f32|bf16|f16` beside PyTorch's
SDPA on tensors of the same dtype, with the matching units' peaks (ours and peak.c's);
written between <!-- half:begin --> and <!-- half:end --> (labels start with "half").

    scripts/bench_grid.py [--attn PATH] [--threads 2] [--torch-python PY | --no-torch]
                          [--case-budget 90] [--only REGEX] [--out BENCHMARKS.md] [--dry-run]
                          [--baseline PATH [--pairs 2]] [--rounds 1]

--only REGEX runs the cases whose label matches, in either table; a table none of
whose cases ran is left as it is. The backward cases' labels start with "backward",
so `--only backward` runs the backward table alone; the default run does both.

--baseline PATH: a second attn binary (say, a build of the previous commit). Each
case then runs it and ours in turn, baseline first, --pairs times, with the same
threads and repeats; both tables get a column "ours / before", the median over the
pairs of our rate over the baseline's (above 1: this tree is faster), and the raw
results keep the baseline's runs. The other columns are ours from the last pair.

--rounds N (the half table): N rounds, each running every case, ours and then PyTorch's
for each dtype, so that the two sides of a ratio are measured a few seconds apart in
every round; each rate is then the median over the rounds and each ratio the median of
the rounds' own ratios (this host's speed moves by up to 2x from minute to minute, which
a single pair of runs can put on either side of a ratio).

PyTorch: --torch-python, else $TORCH_PYTHON, else python3 if `import torch` works.
Only the standard library is used here; torch runs in a worker process.
Every case's runs are planned from the best rate measured so far on cases of the
same kind: large cases get fewer repeats, and a case whose warm-up plus runs would take more than
--case-budget seconds is skipped with its estimate. The unfused PyTorch path is
skipped where its score matrix would exceed 4 GiB.
"""
import argparse
import datetime
import json
import math
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- grid:begin -->", "<!-- grid:end -->"
BWD_BEGIN, BWD_END = "<!-- backward:begin -->", "<!-- backward:end -->"
HALF_BEGIN, HALF_END = "<!-- half:begin -->", "<!-- half:end -->"
HALF_DTYPES = ("f32", "bf16", "f16")
TORCH_DTYPE = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
BWD_FACTOR, FWD_BWD_FACTOR = 2.5, 3.5  # the backward's flops and forward+backward's, in forwards (as attn bench)
SCORES_LIMIT = 4 << 30  # bytes of one score matrix the unfused path may allocate

# ---- the PyTorch worker: one JSON case per stdin line, one JSON result per stdout line ----
TORCH_WORKER = r'''
import json, math, sys, time
import torch
import torch.nn.functional as F

def timed(fn, repeat):
    t0 = time.perf_counter(); fn(); one = time.perf_counter() - t0; warm = 1
    if one < 0.25:
        t0 = time.perf_counter(); fn(); one = time.perf_counter() - t0; warm = 2
    r = repeat or max(3, min(1000000, math.ceil(1.0 / max(one, 1e-9))))
    ts = []
    for _ in range(r):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    ts.sort()
    med = ts[r // 2] if r % 2 else 0.5 * (ts[r // 2 - 1] + ts[r // 2])
    return {"median_s": med, "min_s": ts[0], "repeats": r, "warmups": warm}

def rand(*shape, gen):
    return torch.rand(*shape, generator=gen) * 2 - 1

def backward_case(c, res, gen):
    """Forward + backward under autograd: SDPA and the unfused path, then .backward(G)."""
    B, H, N, D = c["batch"], c["heads"], c["seq"], c["dim"]
    causal = c["causal"]
    dt = getattr(torch, c.get("torch_dtype", "float32"))
    q, k, v = [rand(B, H, N, D, gen=gen).to(dt).requires_grad_() for _ in range(3)]
    g = rand(B, H, N, D, gen=gen).to(dt)
    scale = 1.0 / math.sqrt(D)
    mask = torch.ones(N, N, dtype=torch.bool).triu(1) if causal else None
    def clear():
        q.grad = k.grad = v.grad = None
    def sdpa():
        clear()
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
    def unfused():
        clear()
        s = (q @ k.transpose(-2, -1)) * scale
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        (torch.softmax(s, dim=-1) @ v).backward(g)
    for key, fn in (("sdpa", sdpa), ("unfused", unfused)):
        if c.get(key + "_skip"):
            res[key + "_note"] = c[key + "_skip"]
        else:
            res[key] = timed(fn, c.get(key + "_repeat"))
    if c.get("backward_alone"):  # the backward alone: one forward's graph, kept, walked again each time
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        def bwd():
            clear()
            o.backward(g, retain_graph=True)
        res["sdpa_backward"] = timed(bwd, c.get("sdpa_repeat"))

print(json.dumps({"torch": torch.__version__}), flush=True)
for line in sys.stdin:
    c = json.loads(line)
    res = {"id": c["id"]}
    try:
        torch.set_num_threads(c["threads"])
        gen = torch.Generator().manual_seed(0)
        if c.get("backward"):
            backward_case(c, res, gen)
            print(json.dumps(res), flush=True)
            continue
        with torch.inference_mode():
            if c["op"] == "sdpa":
                B, H, G, N, M, D = c["batch"], c["heads"], c["kv_heads"], c["seq"], c["kv_seq"], c["dim"]
                q, k, v = rand(B, H, N, D, gen=gen), rand(B, G, M, D, gen=gen), rand(B, G, M, D, gen=gen)
                dt = getattr(torch, c.get("torch_dtype", "float32"))
                q, k, v = q.to(dt), k.to(dt), v.to(dt)
                # kv_copies: K and V in that many copies, used in turn, so that a cache the last-level cache
                # would hold is read from memory each time (as attn bench decode cycles its own)
                ncop = max(1, int(c.get("kv_copies", 1)))
                ks, vs, turn = [k] + [k.clone() for _ in range(ncop - 1)], [v] + [v.clone() for _ in range(ncop - 1)], [0]
                def kv():
                    i = turn[0]
                    turn[0] = (i + 1) % ncop
                    return ks[i], vs[i]
                causal = c["causal"]
                keep = None  # --padding: a key-padding mask, True = attend, as PyTorch's bool attn_mask reads
                if c.get("padding"):
                    keep = torch.zeros(B, 1, 1, M, dtype=torch.bool)
                    keep[..., :M - int(c["padding"] * M)] = True
                try:
                    F.scaled_dot_product_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], enable_gqa=G != H)
                    sdpa = lambda: F.scaled_dot_product_attention(q, *kv(), attn_mask=keep, is_causal=causal,
                                                                  enable_gqa=G != H)
                except TypeError:  # torch without enable_gqa
                    ks = [x.repeat_interleave(H // G, 1) for x in ks]
                    vs = [x.repeat_interleave(H // G, 1) for x in vs]
                    sdpa = lambda: F.scaled_dot_product_attention(q, *kv(), attn_mask=keep, is_causal=causal)
                if c.get("sdpa_skip"):
                    res["sdpa_note"] = c["sdpa_skip"]
                else:
                    res["sdpa"] = timed(sdpa, c.get("sdpa_repeat"))
                if c.get("grouped") and G != H and not causal and keep is None:
                    # a decoding step as a GQA-aware user writes it: each kv head's query heads as rows of
                    # one head (head h reads kv head h // (H / G)), no expanded copy of K and V
                    qg = q.reshape(B, G, (H // G) * N, D)
                    res["sdpa_grouped"] = timed(lambda: F.scaled_dot_product_attention(qg, *kv()),
                                                c.get("sdpa_repeat"))
                if c.get("unfused_skip"):
                    res["unfused_note"] = c["unfused_skip"]
                else:
                    scale = 1.0 / math.sqrt(D)
                    mask = torch.ones(N, M, dtype=torch.bool).triu(1) if causal else None
                    def unfused():
                        kk = k if G == H else k.repeat_interleave(H // G, 1)
                        vv = v if G == H else v.repeat_interleave(H // G, 1)
                        s = (q @ kk.transpose(-2, -1)) * scale
                        if mask is not None:
                            s.masked_fill_(mask, float("-inf"))
                        if keep is not None:
                            s.masked_fill_(~keep, float("-inf"))
                        return torch.softmax(s, dim=-1) @ vv
                    res["unfused"] = timed(unfused, c.get("unfused_repeat"))
            else:
                B, N, E, H = c["batch"], c["seq"], c["embed"], c["heads"]
                dt = getattr(torch, c.get("torch_dtype", "float32"))
                mha = torch.nn.MultiheadAttention(E, H, batch_first=True).eval().to(dt)
                x = rand(B, N, E, gen=gen).to(dt)
                if c.get("sdpa_skip"):
                    res["sdpa_note"] = c["sdpa_skip"]
                else:
                    res["sdpa"] = timed(lambda: mha(x, x, x, need_weights=False), c.get("sdpa_repeat"))
                res["unfused_note"] = "n/a"
    except Exception as e:  # out of memory and the like: report, keep serving
        res["error"] = "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    print(json.dumps(res), flush=True)
'''


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---- cases ------------------------------------------------------------------------------
def sdpa_case(label, B, H, N, D, G=None, M=None, causal=False, threads=None, group="main", padding=0.0):
    return {"op": "sdpa", "label": label, "batch": B, "heads": H, "kv_heads": G or H, "seq": N, "kv_seq": M or N,
            "dim": D, "causal": causal, "threads": threads, "group": group, "padding": padding}


def grid(T):
    cs = []
    for N in (1, 16, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768):
        cs.append(sdpa_case("B1 H8 N%d D64" % N, 1, 8, N, 64))
    cs.append(sdpa_case("B1 H4 N2048 D128", 1, 4, 2048, 128))
    for N in (1024, 2048, 4096):
        cs.append(sdpa_case("causal B1 H8 N%d D64" % N, 1, 8, N, 64, causal=True))
    cs.append(sdpa_case("GQA B1 H32 G8 N2048 D128", 1, 32, 2048, 128, G=8))
    for D in (32, 80, 96, 256):
        cs.append(sdpa_case("B1 H8 N2048 D%d" % D, 1, 8, 2048, D))
    # a padded batch: the last quarter of every row's keys is key padding (NaN in ours: never read)
    cs.append(sdpa_case("padded B2 H8 N2048 D64, 1/4 of keys", 2, 8, 2048, 64, padding=0.25))
    if T != 1:
        for N in (1024, 2048):
            cs.append(sdpa_case("B1 H8 N%d D64, 1 thread" % N, 1, 8, N, 64, threads=1, group="threads"))
    cs.append({"op": "mha", "label": "MHA layer B1 N2048 E512 H8", "batch": 1, "seq": 2048, "embed": 512, "heads": 8,
               "threads": None, "group": "main"})
    for i, c in enumerate(cs):
        c["id"] = i
        if c["threads"] is None:
            c["threads"] = T
    return cs


def backward_grid(T, first_id):
    """Forward+backward beside PyTorch, then our peak memory at N=16384 (ours only)."""
    cs = []
    for causal in (False, True):
        for N in (1024, 2048):
            c = sdpa_case("backward %sB1 H8 N%d D64" % ("causal " if causal else "", N), 1, 8, N, 64, causal=causal,
                          group="backward")
            c["backward"] = True
            cs.append(c)
    c = sdpa_case("backward memory B1 H8 N16384 D64", 1, 8, 16384, 64, group="backward_memory")
    c["backward"] = True
    c["torch"] = False
    cs.append(c)
    for i, c in enumerate(cs):
        c["id"] = first_id + i
        c["threads"] = T
    return cs


def half_grid(T, first_id):
    """The issue's half-precision cases, each run in f32, bf16 and f16 (ours and PyTorch's)."""
    cs = [sdpa_case("half B1 H8 N2048 D64", 1, 8, 2048, 64, group="half"),
          sdpa_case("half B1 H4 N2048 D128", 1, 4, 2048, 128, group="half"),
          sdpa_case("half causal B1 H8 N2048 D64", 1, 8, 2048, 64, causal=True, group="half"),
          sdpa_case("half B1 H8 N4096 D64", 1, 8, 4096, 64, group="half"),
          sdpa_case("half GQA B1 H32 G8 N2048 D128", 1, 32, 2048, 128, G=8, group="half"),
          {"op": "mha", "label": "half MHA layer B1 N2048 E512 H8", "batch": 1, "seq": 2048, "embed": 512,
           "heads": 8, "group": "half"}]
    for label, H, D, causal in (("B1 H8 N2048 D64", 8, 64, False), ("B1 H4 N2048 D128", 4, 128, False),
                                ("causal B1 H8 N2048 D64", 8, 64, True)):
        c = sdpa_case("half backward " + label, 1, H, 2048, D, causal=causal, group="half")
        c["half_backward"] = True
        cs.append(c)
    for i, c in enumerate(cs):
        c["id"] = first_id + i
        c["threads"] = T
    return cs


def case_gflop(c):
    """The same count as attn bench: 4*D per visible (query, key) pair (+ the projections for mha)."""
    if c["op"] == "mha":
        B, N, E = c["batch"], c["seq"], c["embed"]
        return (4.0 * B * N * N * E + 4 * 2.0 * B * N * E * E) * 1e-9
    N, M = c["seq"], c["kv_seq"]
    kept = M - int(c.get("padding", 0) * M)  # keys past it are padding
    if c["causal"]:  # top-left: row i sees min(i + 1, M) keys
        pairs = sum(min(i + 1, kept) for i in range(N))
    else:
        pairs = N * kept
    return 4.0 * c["dim"] * pairs * c["batch"] * c["heads"] * 1e-9


class Planner:
    """Repeats and skips from the best rate seen so far on cases of the same kind
    (only cases long enough to time count: tiny ones say nothing about big ones);
    before any, a modest prior rate plans the repeats but never skips a case."""

    PRIOR_GFLOPS = 20.0

    def __init__(self, budget):
        self.budget = budget
        self.rate = {}

    def plan(self, kind, gflop, prior=None):
        r = self.rate.get(kind)
        est = gflop / (r or prior or self.PRIOR_GFLOPS)
        if est < 0.35:
            return None, est, None  # the tool's own rule: about a second of runs
        repeat = max(1, min(3, int(round(3.0 / est))))
        if r is not None and est * (1 + repeat) > self.budget:  # one warm-up run, then the repeats
            return None, est, "skipped (~%.0f s per run, over the %.0f s budget per case)" % (est, self.budget)
        return repeat, est, None

    def seen(self, kind, gflop, median_s):
        if median_s and median_s >= 2e-3:
            self.rate[kind] = max(self.rate.get(kind, 0.0), gflop / median_s)


# ---- running -------------------------------------------------------------------------------
def run_attn(attn, c, timeout):
    cmd = [attn, "bench", c["op"], "--batch", str(c["batch"]), "--heads", str(c["heads"]), "--seq", str(c["seq"])]
    if c["op"] == "sdpa":
        cmd += ["--dim", str(c["dim"])]
        if c["kv_heads"] != c["heads"]:
            cmd += ["--kv-heads", str(c["kv_heads"])]
        if c["kv_seq"] != c["seq"]:
            cmd += ["--kv-seq", str(c["kv_seq"])]
        if c["causal"]:
            cmd += ["--causal"]
        if c.get("padding"):
            cmd += ["--padding", repr(c["padding"])]
        if c.get("backward") or c.get("half_backward"):
            cmd += ["--backward"]
        if c.get("dtype"):
            cmd += ["--dtype", c["dtype"]]
    else:
        cmd += ["--embed", str(c["embed"])]
        if c.get("dtype"):
            cmd += ["--dtype", c["dtype"]]
    cmd += ["--threads", str(c["threads"]), "--json"]
    if c.get("repeat"):
        cmd += ["--repeat", str(c["repeat"])]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after %.0f s" % timeout}
    wall = time.time() - t0
    if p.returncode != 0:
        return {"error": "exit %d: %s" % (p.returncode, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "")}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if len(lines) != 1:
        return {"error": "expected one JSON line, got %d" % len(lines)}
    r = json.loads(lines[0])
    r["wall_s"] = wall
    r["command"] = " ".join(shlex.quote(x) for x in cmd)
    return r


# The rates a baseline is compared on, per table: (JSON key, column title).
BEFORE_RATES = {False: (("gflops", "ours / before"),),
                True: (("fwd_bwd_gflops", "fwd+bwd ours / before"), ("backward_gflops", "backward ours / before"))}


def run_pairs(attn, baseline, c, timeout, pairs):
    """Baseline, ours, baseline, ours...: ours from the last pair, with r["before"] holding
    the baseline's rates and, per rate, the median over the pairs of ours over the baseline's."""
    rates = [k for k, _ in BEFORE_RATES[bool(c.get("backward"))]]
    runs, r = [], None
    for _ in range(pairs):
        b = run_attn(baseline, c, timeout)
        r = run_attn(attn, c, timeout)
        if "error" in r:
            return r
        if "error" in b:
            r["before"] = {"error": b["error"]}
            return r
        runs.append((b, r))
    before = {}
    for k in rates:
        before[k] = [b.get(k) for b, _ in runs]
        ratios = sorted(o[k] / b[k] for b, o in runs if b.get(k) and o.get(k) is not None)
        n = len(ratios)
        before[k + "_ratio"] = None if not n else (ratios[n // 2] if n % 2 else 0.5 * (ratios[n // 2 - 1] + ratios[n // 2]))
    r["before"] = before
    return r


def before_cell(r, key):
    b = (r or {}).get("before")
    if b is None:
        return "—"
    if "error" in b:
        return "baseline error: " + b["error"]
    return fmt(b.get(key + "_ratio"), "%.3f×")


class TorchWorker:
    def __init__(self, python):
        self.python = python
        self.proc = None
        self.version = None
        self.errlog = tempfile.TemporaryFile(mode="w+")

    def start(self):
        self.proc = subprocess.Popen([self.python, "-c", TORCH_WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.errlog, universal_newlines=True, bufsize=1)
        hello = self.proc.stdout.readline()
        if not hello:
            self.proc = None
            return False
        self.version = json.loads(hello)["torch"]
        return True

    def run(self, c, timeout):
        if self.proc is None and not self.start():
            return {"error": "the torch worker did not start"}
        try:
            self.proc.stdin.write(json.dumps(c) + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            if not ready:
                self.proc.kill()
                self.proc.wait()
                self.proc = None
                return {"error": "timed out after %.0f s" % timeout}
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:  # killed (out of memory?): restart for the next case
            code = self.proc.wait()
            self.proc = None
            self.errlog.seek(0)
            tail = [ln.strip() for ln in self.errlog.read().splitlines() if ln.strip()][-1:]
            return {"error": "the torch worker died (exit %s)%s" % (code, ": " + tail[0] if tail else "")}
        return json.loads(line)

    def close(self):
        if self.proc:
            self.proc.stdin.close()
            self.proc.wait()


def find_torch_python(arg):
    cands = [arg] if arg else ([os.environ["TORCH_PYTHON"]] if os.environ.get("TORCH_PYTHON") else ["python3"])
    for py in cands:
        try:
            if subprocess.run([py, "-c", "import torch"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=120).returncode == 0:
                return py
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


BF16_PEAKS = {}  # peak.c's vdpbf16ps GFLOP/s per thread count, where the CPU has it
AMX_PEAKS = {}  # peak.c's AMX-BF16 tdpbf16ps GFLOP/s per thread count, where the CPU has it


def run_peak_c():
    """Builds and runs ../shared/tools/peak.c: {threads: fma_gflops}, its lines, and a note."""
    src = os.path.join(os.path.dirname(ROOT), "shared", "tools", "peak.c")
    if not os.path.exists(src):
        return {}, [], "../shared/tools/peak.c not found: no outside yardstick in this run"
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        return {}, [], "no gcc to build peak.c"
    d = tempfile.mkdtemp(prefix="attn_peak_")
    exe = os.path.join(d, "peak")
    try:
        b = subprocess.run([cc, "-O2", "-march=native", "-fopenmp", src, "-o", exe], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, universal_newlines=True)
        if b.returncode != 0:
            return {}, [], "peak.c did not build: " + b.stdout.strip().splitlines()[-1]
        p = subprocess.run([exe, "--json"], stdout=subprocess.PIPE, universal_newlines=True)
        peaks, lines = {}, []
        for ln in p.stdout.splitlines():
            if ln.startswith("{"):
                j = json.loads(ln)
                peaks[j["threads"]] = j["fma_gflops"]
                if j.get("bf16_dot_gflops"):
                    BF16_PEAKS[j["threads"]] = j["bf16_dot_gflops"]
                if j.get("amx_bf16_gflops"):
                    AMX_PEAKS[j["threads"]] = j["amx_bf16_gflops"]
                lines.append(ln)
        return peaks, lines, None
    finally:
        shutil.rmtree(d, ignore_errors=True)


def cpu_model():
    model, fam, mod = "unknown", "?", "?"
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                k, _, v = ln.partition(":")
                k, v = k.strip(), v.strip()
                if k == "model name" and model == "unknown":
                    model = v
                elif k == "cpu family" and fam == "?":
                    fam = v
                elif k == "model" and mod == "?":
                    mod = v
    except OSError:
        pass
    return "%s (family %s, model %s), %d logical CPUs" % (model, fam, mod, os.cpu_count() or 0)


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


# ---- the table ------------------------------------------------------------------------------
def fmt(x, spec="%.1f"):
    return "—" if x is None else spec % x


def ratio(a, b):
    return None if a is None or not b else a / b


def median_of(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def paired_ratio(a, b):
    """The median over rounds of a[i] / b[i], rounds where both were measured."""
    return median_of([ratio(x, y) for x, y in zip(a, b)])


def gflops_of(r):
    return r.get("gflops") if r and "error" not in r and "note" not in r else None


def torch_gflops(t, key, gflop):
    if not t or key not in t:
        return None
    return gflop / t[key]["median_s"]


def torch_cell(t, key, gflop):
    g = torch_gflops(t, key, gflop)
    if g is not None:
        return "%.1f" % g
    if t is None:
        return "—"
    if "error" in t:
        return "error: " + t["error"]
    return t.get(key + "_note", "—")


CONTENDED = 0.85  # a case's measured peak under this share of the run's best: the CPUs were shared


def best_peaks(ours, outside=None):
    """The best FMA peak seen in this run per thread count: ours, and peak.c's."""
    best = dict(outside or {})
    for r in ours.values():
        if r and "peak_gflops" in r and r["peak_gflops"]:
            best[r["threads"]] = max(best.get(r["threads"], 0.0), r["peak_gflops"])
    return best


def contended(r, bests):
    b = bests.get(r.get("threads"))
    return bool(b) and r.get("peak_gflops", 0) < CONTENDED * b


def subset_tag(sub):
    """A short name for the oracle's subset: all, b0, b0 h0 rows a-b, b0 rows a-b."""
    if sub == "all":
        return "all"
    m = re.match(r"batch 0 head 0 query rows (\d+)\.\.(\d+) of \d+, all \d+ keys", sub)
    if m:
        return "b0 h0 rows %s–%s" % m.groups()
    m = re.match(r"batch 0 query rows (\d+)\.\.(\d+) of \d+ \(keys and values from all rows\)", sub)
    if m:
        return "b0 rows %s–%s" % m.groups()
    if sub.startswith("batch 0 (all"):
        return "b0"
    return "subset"


BEFORE_NOTE = ("ours / before: the baseline `%s` (`%s`) and ours run in turn on each case (baseline first, %d pairs, "
               "same threads and repeats); the median over the pairs of our rate over the baseline's (above 1: faster "
               "now).")


def header(begin, info, what, key):
    """The lines every table starts with: its marker, the command, date, CPU, versions, and the
    load average around the part of the run that made it (info's KEY-prefixed load and wall)."""
    return [begin, "",
            "Command: `%s`  " % info["command"],
            "Date: %s  " % info["date"],
            "CPU: %s  " % info["cpu"],
            "libattn: `%s`; PyTorch: %s  " % (info["version"], info["torch"]),
            "Load average (1, 5, 15 min) before: %s, after: %s; %s wall time %.0f s" %
            (info[key + "load_before"], info[key + "load_after"], what, info[key + "wall"])]


def raw_results(cases, ours, theirs):
    """A folded block of every case's JSON, ours (less the command line) then PyTorch's."""
    out = ["<details><summary>raw results (one JSON object per case: ours, then PyTorch)</summary>", "", "```"]
    for c in cases:
        r = dict(ours.get(c["id"]) or {})
        r.pop("command", None)
        out.append(json.dumps({"case": c["label"], "ours": r, "torch": theirs.get(c["id"])}, sort_keys=False))
    return out + ["```", "</details>", ""]


def render(cases, ours, theirs, peaks, peak_lines, peak_note, info):
    out = header(BEGIN, info, "grid", "")
    out.append("")
    if peak_lines:
        out.append("Outside yardstick, `../shared/tools/peak.c --json` in the same run:")
        out.append("")
        out.append("```")
        out.extend(peak_lines)
        out.append("```")
    else:
        out.append("Outside yardstick: %s." % peak_note)
    out.append("")
    T = info["threads"]
    out.append("All cases fp32, %d threads unless the case says otherwise. GFLOP/s = counted flops / median time." % T)
    out.append("")
    bl = info.get("baseline")
    out.append("| case | ours GFLOP/s | fraction of our measured peak | fraction of peak.c's peak | PyTorch SDPA GFLOP/s "
               "| unfused GFLOP/s | ours/PyTorch | ours/unfused | oracle error | peak RSS |" +
               "".join(" %s |" % t for _, t in BEFORE_RATES[False]) * bool(bl))
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---|---|" + "---:|" * len(BEFORE_RATES[False]) * bool(bl))
    notes = []
    bests, n_contended = best_peaks(ours, peaks), 0
    for c in cases:
        r, t = ours.get(c["id"]), theirs.get(c["id"])
        g = gflops_of(r)
        gf = case_gflop(c)
        if r is None:
            og = "—"
        elif "error" in r:
            og = "error: " + r["error"]
        elif "note" in r:
            og = r["note"]
        else:
            og = "%.1f" % g
        frac = fmt(r.get("fraction_of_peak") if g is not None else None, "%.3f")
        if g is not None and contended(r, bests):
            frac += " *"
            n_contended += 1
        pk = peaks.get(c["threads"]) or (peaks[max(peaks)] if peaks else None)
        frac_pc = fmt(ratio(g, pk), "%.3f")
        ts, tu = torch_gflops(t, "sdpa", gf), torch_gflops(t, "unfused", gf)
        if g is not None and r.get("oracle_rel_l2") is not None:
            sub = r.get("oracle_subset", "")
            err = "%.1e (%s)" % (r["oracle_rel_l2"], subset_tag(sub))
            if subset_tag(sub) == "subset":
                notes.append("%s: oracle on %s" % (c["label"], sub))
        elif g is not None:
            err = r.get("oracle_subset", "—")
        else:
            err = "—"
        rss = "%.0f MiB (io %.0f MiB)" % (r["peak_rss_mib"], r["io_mib"]) if g is not None else "—"
        label = c["label"] + (" [%.3g GFLOP]" % gf)
        out.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            label, og, frac, frac_pc, torch_cell(t, "sdpa", gf), torch_cell(t, "unfused", gf),
            fmt(ratio(g, ts), "%.2f×"), fmt(ratio(g, tu), "%.2f×"), err, rss) +
            "".join(" %s |" % before_cell(r, k) for k, _ in BEFORE_RATES[False]) * bool(bl))
    out.append("")
    out.append("Cases whose own measured peak was below %.0f%% of the best measured at the same thread count in this "
               "run shared the CPUs with another load; the grid reran each such case once (%d reruns) and kept the "
               "less disturbed run.%s" % (100 * CONTENDED, info.get("retried", 0),
                                          " Still so, marked *: %d." % n_contended if n_contended else ""))
    out.append("")
    out.append("The MHA row's PyTorch column is `nn.MultiheadAttention(E, H, batch_first=True)(x, x, x, "
               "need_weights=False)`; its flops count the attention plus the four projections (2·B·N·E² each).")
    if bl:
        out.append("")
        out.append(BEFORE_NOTE % (bl, info["baseline_version"], info["pairs"]))
    # thread scaling
    pairs = []
    for c in cases:
        if c["group"] != "threads":
            continue
        for d in cases:
            if (d["group"] == "main" and d["op"] == c["op"] and d["threads"] == T and
                    all(d.get(k) == c.get(k) for k in ("batch", "heads", "kv_heads", "seq", "kv_seq", "dim", "causal"))):
                pairs.append((c, d))
    if pairs:
        out.append("")
        out.append("Thread scaling (same case, 1 thread vs %d threads):" % T)
        out.append("")
        out.append("| case | ours 1 thread GFLOP/s | ours %d threads GFLOP/s | ours speed-up | PyTorch SDPA 1 thread "
                   "| PyTorch SDPA %d threads | PyTorch speed-up |" % (T, T))
        out.append("|---|---:|---:|---:|---:|---:|---:|")
        for c1, cT in pairs:
            gf = case_gflop(c1)
            a, b = gflops_of(ours.get(c1["id"])), gflops_of(ours.get(cT["id"]))
            ta, tb = torch_gflops(theirs.get(c1["id"]), "sdpa", gf), torch_gflops(theirs.get(cT["id"]), "sdpa", gf)
            out.append("| %s | %s | %s | %s | %s | %s | %s |" % (
                cT["label"], fmt(a), fmt(b), fmt(ratio(b, a), "%.2f×"), fmt(ta), fmt(tb), fmt(ratio(tb, ta), "%.2f×")))
    out.append("")
    out.append("Oracle error: relative L2 against the float64 oracle, on all of the output (all), or on the last "
               "query rows of batch 0, head 0 against all keys (b0 h0 rows a–b; a causal case's rows keep exactly "
               "the keys they see in the full problem), or for the layer on the last rows of batch 0, their "
               "queries against keys and values from every row (b0 rows a–b).")
    for n in notes:
        out.append("- " + n)
    out.append("")
    out.extend(raw_results(cases, ours, theirs))
    out.append(END)
    return "\n".join(out)


def bwd_ok(r):
    return bool(r) and "error" not in r and "note" not in r and r.get("fwd_bwd_median_s") is not None


def ms(x):
    return "—" if x is None else ("%.1f" % (x * 1e3) if x >= 0.1 else "%.2f" % (x * 1e3))


def render_backward(cases, ours, theirs, peaks, peak_lines, peak_note, info):
    out = header(BWD_BEGIN, info, "backward table", "bwd_")
    out.append("")
    T = info["threads"]
    if peak_lines:
        out.append("Outside yardstick (`../shared/tools/peak.c`, same run): %s." %
                   ", ".join("%d threads %.1f GFLOP/s" % (t, g) for t, g in sorted(peaks.items())))
    else:
        out.append("Outside yardstick: %s." % peak_note)
    out.append("")
    out.append("Forward+backward of SDPA, fp32, %d threads. Ours: `attn bench sdpa --backward` (the forward with "
               "lse, then `attn_sdpa_backward`; the backward alone is timed on the forward's out and lse). "
               "PyTorch: `F.scaled_dot_product_attention(q, k, v, is_causal=...)` on `requires_grad` inputs, then "
               "`.backward(G)`; unfused: `q @ k.T * scale` → (`masked_fill` under causal) → `softmax` → `@ v` under "
               "autograd, then `.backward(G)`. Flops: the backward counts %.1f× the forward's visible-pair flops, "
               "forward+backward %.1f×, for all three. ours/X is X's forward+backward time over ours (above 1: we "
               "are faster)." % (T, BWD_FACTOR, FWD_BWD_FACTOR))
    out.append("")
    bl = info.get("baseline")
    extra = "".join(" %s |" % t for _, t in BEFORE_RATES[True]) * bool(bl)
    out.append("| case | ours fwd+bwd | ours fwd+bwd GFLOP/s | PyTorch SDPA fwd+bwd | unfused fwd+bwd | ours/PyTorch "
               "| ours/unfused | ours backward | backward GFLOP/s | backward fraction of our peak "
               "| backward fraction of peak.c's | forward fraction of our peak | backward oracle error |" + extra)
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|" + "---:|" * len(BEFORE_RATES[True]) * bool(bl))
    bests, n_contended, mem = best_peaks(ours, peaks), 0, []
    for c in cases:
        if c["group"] == "backward_memory":
            mem.append(c)
            continue
        r, t = ours.get(c["id"]), theirs.get(c["id"])
        fb_gflop = FWD_BWD_FACTOR * case_gflop(c)
        label = c["label"][len("backward "):] + " [%.3g GFLOP fwd+bwd]" % fb_gflop
        if not bwd_ok(r):
            why = "—" if r is None else ("error: " + r["error"] if "error" in r else r.get("note", "no backward"))
            out.append("| %s | %s |%s" % (label, why, " — |" * (11 + len(BEFORE_RATES[True]) * bool(bl))))
            continue
        fb = r["fwd_bwd_median_s"]
        ts = t["sdpa"]["median_s"] if t and "sdpa" in t else None
        tu = t["unfused"]["median_s"] if t and "unfused" in t else None
        def tcell(tm, key):
            if tm is not None:
                return "%s ms (%.1f GFLOP/s)" % (ms(tm), fb_gflop / tm)
            if t is None:
                return "—"
            return "error: " + t["error"] if "error" in t else t.get(key + "_note", "—")
        frac = "%.3f" % r["backward_fraction_of_peak"]
        if contended(r, bests):
            frac += " *"
            n_contended += 1
        pk = peaks.get(c["threads"]) or (peaks[max(peaks)] if peaks else None)
        if r.get("backward_oracle_rel_l2") is not None:
            sub = r.get("backward_oracle_subset", "")
            tag = "all" if sub == "all" else ("b0 h0" if sub.startswith("batch 0 head 0") else "subset")
            err = "%.1e (%s)" % (r["backward_oracle_rel_l2"], tag)
        else:
            err = r.get("backward_oracle_subset", "—")
        out.append("| %s | %s ms | %.1f | %s | %s | %s | %s | %s ms | %.1f | %s | %s | %.3f | %s |" % (
            label, ms(fb), r["fwd_bwd_gflops"], tcell(ts, "sdpa"), tcell(tu, "unfused"),
            fmt(ratio(ts, fb), "%.2f×"), fmt(ratio(tu, fb), "%.2f×"), ms(r["backward_median_s"]),
            r["backward_gflops"], frac, fmt(ratio(r["backward_gflops"], pk), "%.3f"), r["fraction_of_peak"], err) +
            "".join(" %s |" % before_cell(r, k) for k, _ in BEFORE_RATES[True]) * bool(bl))
    out.append("")
    out.append("Backward oracle error: the largest relative L2 error of dq, dk and dv against `attn_sdpa_backward_ref` "
               "fed by the float64 forward, on the whole problem (all) or on batch 0, head 0 with all rows and keys "
               "(b0 h0). A case whose measured peak was below %.0f%% of the run's best at the same thread count "
               "shared the CPUs: the table reran each such case once (%d reruns) and kept the less disturbed run%s."
               % (100 * CONTENDED, info.get("bwd_retried", 0),
                  "; still so, its backward fraction marked *: %d" % n_contended if n_contended else ""))
    if bl:
        out.append("")
        out.append(BEFORE_NOTE % (bl, info["baseline_version"], info["pairs"]))
    if mem:
        out.append("")
        out.append("Peak memory of forward+backward without weights (`attn bench sdpa --backward`, the whole "
                   "process's peak RSS after the timed runs) beside the bytes of its inputs and outputs (q, k, v, "
                   "out, dout, dq, dk, dv, lse):")
        out.append("")
        out.append("| case | peak RSS | inputs+outputs | RSS − io | RSS / io | fwd+bwd time | backward oracle |")
        out.append("|---|---:|---:|---:|---:|---:|---|")
        for c in mem:
            r = ours.get(c["id"])
            label = c["label"][len("backward memory "):]
            if not bwd_ok(r):
                why = "—" if r is None else ("error: " + r["error"] if "error" in r else r.get("note", "no backward"))
                out.append("| %s | %s | — | — | — | — | — |" % (label, why))
                continue
            out.append("| %s | %.0f MiB | %.0f MiB | %.0f MiB | %.2f | %s ms | %s |" % (
                label, r["peak_rss_mib"], r["io_mib"], r["peak_rss_mib"] - r["io_mib"],
                r["peak_rss_mib"] / r["io_mib"], ms(r["fwd_bwd_median_s"]), r.get("backward_oracle_subset", "—")))
    out.append("")
    out.extend(raw_results(cases, ours, theirs))
    out.append(BWD_END)
    return "\n".join(out)


def write_markdown(path, block, begin=BEGIN, end=END):
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    if begin in text and end in text and text.index(begin) < text.index(end):
        new = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        new = text + ("\n" if text and not text.endswith("\n") else "") + block + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)


def run_cases(cases, attn, worker, args, plan_ours, plan_torch, ours, theirs):
    """Ours, then PyTorch's, case by case; results into ours and theirs by case id."""
    for c in cases:
        gf = case_gflop(c)
        bwd = bool(c.get("backward"))
        kind = (c["op"] + ("_bwd" if bwd else ""), c["threads"])
        # --backward times the forward, forward+backward and the backward, each with these repeats: planned
        # on the longest (forward+backward), a case takes about twice what the plan says. Before any
        # backward ran, the forward's rate (or a modest one) stands in: the default prior would cap small
        # cases at 3 repeats and make their medians noisy.
        plan_gf = gf * FWD_BWD_FACTOR if bwd else gf
        prior = (plan_ours.rate.get((c["op"], c["threads"])) or 100.0) if bwd else None
        rep, est, skip = plan_ours.plan(kind, plan_gf, prior)
        if skip:
            ours[c["id"]] = {"note": skip}
        else:
            c["repeat"] = rep
            timeout = (3 if not bwd else 7) * args.case_budget + 60
            if args.baseline:
                r = run_pairs(attn, args.baseline, c, timeout, args.pairs)
            else:
                r = run_attn(attn, c, timeout)
            ours[c["id"]] = r
            if "error" not in r:
                plan_ours.seen(kind, plan_gf, r.get("fwd_bwd_median_s") if bwd else r["median_s"])
        r = ours[c["id"]]
        if bwd:
            log("%-36s ours: %s" % (c["label"], ("fwd+bwd %.1f GFLOP/s, backward %.1f GFLOP/s" % (
                r["fwd_bwd_gflops"], r["backward_gflops"])) if bwd_ok(r) else r.get("error", r.get("note"))))
        else:
            log("%-36s ours: %s" % (c["label"], ("%.1f GFLOP/s" % r["gflops"]) if "gflops" in r else
                                     r.get("error", r.get("note"))))
        if args.baseline and "before" in r:
            log("%-36s %s" % ("", ", ".join("%s %s" % (t, before_cell(r, k)) for k, t in BEFORE_RATES[bwd])))
        if worker and c.get("torch", True):
            tc = dict(c)
            tgf = gf * FWD_BWD_FACTOR if bwd else gf
            sfx = "_bwd" if bwd else ""
            fwd_kind = (c["op"], c["threads"])
            srep, _, sskip = plan_torch.plan(("sdpa" + sfx,) + kind, tgf,
                                             (plan_torch.rate.get(("sdpa",) + fwd_kind) or 50.0) if bwd else None)
            urep, _, uskip = plan_torch.plan(("unfused" + sfx,) + kind, tgf,
                                             (plan_torch.rate.get(("unfused",) + fwd_kind) or 20.0) if bwd else None)
            tc["sdpa_repeat"], tc["unfused_repeat"] = srep, urep
            if sskip:
                tc["sdpa_skip"] = sskip
            if c["op"] == "sdpa":
                # under autograd the unfused path keeps the scores, the probabilities and their gradients
                scores = 4 * c["batch"] * c["heads"] * c["seq"] * c["kv_seq"] * (4 if bwd else 1)
                if scores > SCORES_LIMIT:
                    tc["unfused_skip"] = "skipped (scores need %.0f GiB)" % (scores / 2 ** 30)
                elif uskip:
                    tc["unfused_skip"] = uskip
            t = worker.run(tc, 2 * (3 * args.case_budget + 60))
            theirs[c["id"]] = t
            for key in ("sdpa", "unfused"):
                if key in t:
                    plan_torch.seen((key + sfx,) + kind, tgf, t[key]["median_s"])
            log("%-36s torch: sdpa %s, unfused %s" % ("", torch_cell(t, "sdpa", tgf), torch_cell(t, "unfused", tgf)))


def run_half_cases(cases, attn, worker, args, ours, theirs):
    """Each case in f32, bf16 and f16, ours then PyTorch's, --rounds times over the whole list, into
    lists (one result a round) in ours/theirs[(id, dtype)]."""
    for rnd in range(args.rounds):
        if args.rounds > 1:
            log("half table: round %d of %d" % (rnd + 1, args.rounds))
        run_half_round(cases, attn, worker, args, ours, theirs)


def run_half_round(cases, attn, worker, args, ours, theirs):
    for c in cases:
        gf = case_gflop(c)
        bwd = c.get("half_backward")
        for dt in HALF_DTYPES:
            r = run_attn(attn, dict(c, dtype=dt), (7 if bwd else 3) * args.case_budget + 60)
            ours.setdefault((c["id"], dt), []).append(r)
            if bwd:
                line = "%-36s ours %-4s: %s" % (c["label"], dt, ("backward %.1f GFLOP/s on %s tiles" % (
                    r["backward_gflops"], r.get("backward_tiles"))) if "backward_gflops" in r else r.get("error"))
            else:
                line = "%-36s ours %-4s: %s" % (c["label"], dt, ("%.1f GFLOP/s on %s tiles" % (r["gflops"], r.get("tiles")))
                                                  if "gflops" in r else r.get("error"))
            if worker:
                tc = dict(c, torch_dtype=TORCH_DTYPE[dt], unfused_skip="n/a")
                if bwd:
                    tc.update(backward=True, backward_alone=True)
                t = worker.run(tc, 2 * ((7 if bwd else 3) * args.case_budget + 60))
                theirs.setdefault((c["id"], dt), []).append(t)
                line += ", torch %s" % (torch_cell(t, "sdpa_backward", BWD_FACTOR * gf) if bwd else torch_cell(t, "sdpa", gf))
            log(line)


def render_half(cases, ours, theirs, peaks, info):
    out = header(HALF_BEGIN, info, "half table", "half_")
    out.append("")
    if info["rounds"] > 1:
        out.append("%d rounds: each round ran every case, ours and then PyTorch's for each dtype; every rate below "
                   "is the median over the rounds, every ratio the median of the rounds' own ratios (both sides "
                   "measured seconds apart in the same round)." % info["rounds"])
        out.append("")
    T = info["threads"]
    bp, ap = BF16_PEAKS.get(T), AMX_PEAKS.get(T)
    def rate(x):
        return fmt(x) + " GFLOP/s" if x else "absent on this CPU"
    out.append("Outside yardstick (`../shared/tools/peak.c`, same run), %d threads: fp32 FMA %s GFLOP/s, AVX512-BF16 "
               "`vdpbf16ps` %s, AMX-BF16 `tdpbf16ps` %s." % (T, fmt(peaks.get(T)), rate(bp), rate(ap)))
    out.append("")
    out.append("Forward SDPA, %d threads, inputs q, k, v in the column's dtype (ours: `attn bench sdpa --dtype`, out in "
               "f32, the context's default precision; PyTorch: `F.scaled_dot_product_attention` on tensors of that "
               "dtype, out in that dtype; the MHA row: `attn bench mha --dtype`, x and the parameters rounded to the dtype, "
               "under the bf16 or f16 policy (projections on the bf16 GEMM, or on the fp32 one with x and the "
               "weights rounded to f16), beside `nn.MultiheadAttention` in that dtype). Which tiles ours ran on is in the column (bf16: AMX's or AVX512-BF16's bf16 "
               "tiles, by the kernel; f16 split: AMX's f16 tiles, each f16 as bf16 hi + lo; fp32: widened). GFLOP/s "
               "count the visible pairs as the grid does. Fractions: ours bf16 over our own probe of the unit its "
               "tiles ran on (`tdpbf16ps` on AMX, else `vdpbf16ps`) and over peak.c's figure for that unit "
               "(`amx_bf16_gflops` or `bf16_dot_gflops`). Errors: ours against the float64 oracle on the same rounded "
               "inputs (the grid's subset; the MHA row: the float64 layer on the f32 values of x and the parameters "
               "as rounded, so the layer's own roundings count)." % T)
    out.append("")
    out.append("| case | ours f32 | ours bf16 | ours f16 | PyTorch f32 | PyTorch bf16 | PyTorch f16 | ours bf16 / PyTorch "
               "bf16 | ours bf16 / ours f32 | ours f16 / PyTorch f16 | ours f16 / ours f32 | bf16 fraction of our "
               "probe | of peak.c's | ours bf16 error | ours f16 error |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for c in [c for c in cases if not c.get("half_backward")]:
        gf = case_gflop(c)
        runs = {dt: ours.get((c["id"], dt)) or [{}] for dt in HALF_DTYPES}
        G = {dt: [gflops_of(r) for r in runs[dt]] for dt in HALF_DTYPES}
        TG = {dt: [torch_gflops(t, "sdpa", gf) for t in theirs.get((c["id"], dt)) or []] for dt in HALF_DTYPES}
        g = {dt: median_of(G[dt]) for dt in HALF_DTYPES}
        tg = {dt: median_of(TG[dt]) for dt in HALF_DTYPES}
        rb = runs["bf16"][0]
        def cell(dt):
            r = runs[dt][0]
            if g[dt] is None:
                return "error: " + r["error"] if "error" in r else "—"
            return "%.1f (%s)" % (g[dt], r.get("tiles", "?"))
        def err_of(dt):
            r = runs[dt][0]
            return "%.1e" % r["oracle_rel_l2"] if r.get("oracle_rel_l2") is not None else "—"
        on_amx = rb.get("peak_isa") == "amx_bf16"
        probe = [r.get("peak_gflops") if r.get("peak_isa") in ("avx512bf16", "amx_bf16") else None for r in runs["bf16"]]
        frac = fmt(paired_ratio(G["bf16"], probe), "%.3f")
        unit_peak = ap if on_amx else bp
        out.append("| %s [%.3g GFLOP] | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            c["label"][len("half "):], gf, cell("f32"), cell("bf16"), cell("f16"),
            fmt(tg["f32"]), fmt(tg["bf16"]), fmt(tg["f16"]), fmt(paired_ratio(G["bf16"], TG["bf16"]), "%.2f×"),
            fmt(paired_ratio(G["bf16"], G["f32"]), "%.2f×"), fmt(paired_ratio(G["f16"], TG["f16"]), "%.2f×"),
            fmt(paired_ratio(G["f16"], G["f32"]), "%.2f×"), frac, fmt(ratio(g["bf16"], unit_peak), "%.3f"),
            err_of("bf16"), err_of("f16")))
    out.append("")
    bcases = [c for c in cases if c.get("half_backward")]
    if bcases:
        out.append("The backward alone, %d threads, q, k, v in the column's dtype (ours: `attn bench sdpa --backward "
                   "--dtype`, dout and the gradients in f32, its backward timed on the forward's out and lse; PyTorch: "
                   "`.backward(G, retain_graph=True)` on one `F.scaled_dot_product_attention` of `requires_grad` "
                   "tensors of that dtype, G in that dtype). GFLOP/s count %.1f× the forward's visible-pair flops. "
                   "Which tiles our backward ran on is in the column (bf16: AMX's bf16 tiles; f16 split: AMX's f16 "
                   "tiles, each f16 as bf16 hi + lo; fp32: widened). Fraction: ours "
                   "bf16 over peak.c's `amx_bf16_gflops`. Errors: the largest of dq, dk, dv against the float64 "
                   "oracle on the same bf16 (f16) inputs (all rows where it fits the oracle's budget)." % (T, BWD_FACTOR))
        out.append("")
        out.append("| case | ours f32 | ours bf16 | ours f16 | PyTorch f32 | PyTorch bf16 | PyTorch f16 | ours bf16 / "
                   "PyTorch bf16 | ours bf16 / ours f32 | ours f16 / PyTorch f16 | ours f16 / ours f32 | fwd+bwd: ours "
                   "bf16 / PyTorch bf16 | bf16 of peak.c's AMX | ours bf16 error | ours f16 error |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
        for c in bcases:
            gb = BWD_FACTOR * case_gflop(c)
            runs = {dt: ours.get((c["id"], dt)) or [{}] for dt in HALF_DTYPES}
            r = {dt: runs[dt][0] for dt in HALF_DTYPES}
            G = {dt: [x.get("backward_gflops") for x in runs[dt]] for dt in HALF_DTYPES}
            TG = {dt: [torch_gflops(t, "sdpa_backward", gb) for t in theirs.get((c["id"], dt)) or []]
                  for dt in HALF_DTYPES}
            g = {dt: median_of(G[dt]) for dt in HALF_DTYPES}
            tg = {dt: median_of(TG[dt]) for dt in HALF_DTYPES}
            fb = [x.get("fwd_bwd_median_s") for x in runs["bf16"]]
            tfb = [(t or {}).get("sdpa", {}).get("median_s") for t in theirs.get((c["id"], "bf16")) or []]
            def cell(dt):
                if g[dt] is None:
                    return "error: " + r[dt]["error"] if "error" in r[dt] else "—"
                return "%.1f (%s)" % (g[dt], r[dt].get("backward_tiles", "?"))
            def bwd_err(dt):
                e = r[dt].get("backward_oracle_rel_l2")
                return "%.1e" % e if e is not None else "— (" + r[dt].get("backward_oracle_subset", "") + ")"
            out.append("| %s [%.3g GFLOP] | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                c["label"][len("half backward "):], gb, cell("f32"), cell("bf16"), cell("f16"), fmt(tg["f32"]),
                fmt(tg["bf16"]), fmt(tg["f16"]), fmt(paired_ratio(G["bf16"], TG["bf16"]), "%.2f×"),
                fmt(paired_ratio(G["bf16"], G["f32"]), "%.2f×"), fmt(paired_ratio(G["f16"], TG["f16"]), "%.2f×"),
                fmt(paired_ratio(G["f16"], G["f32"]), "%.2f×"), fmt(paired_ratio(tfb, fb), "%.2f×"),
                fmt(ratio(g["bf16"], ap), "%.3f"),
                bwd_err("bf16"), bwd_err("f16")))
        out.append("")
    out.append(HALF_END)
    return "\n".join(out)


def rerun_contended(cases, attn, args, ours, peaks):
    """Reruns once each case whose measured peak fell below CONTENDED of the run's best; keeps the less disturbed."""
    retried = 0
    for c in cases:
        r = ours.get(c["id"])
        if not r or "gflops" not in r or not contended(r, best_peaks(ours, peaks)):
            continue
        c2 = dict(c)
        r2 = run_attn(attn, c2, (7 if c.get("backward") else 3) * args.case_budget + 60)
        retried += 1
        if "gflops" in r2 and r2["peak_gflops"] > r["peak_gflops"]:
            r2["retried"] = "kept the rerun (measured peak %.0f before, %.0f now)" % (r["peak_gflops"], r2["peak_gflops"])
            if "before" in r:  # the comparison with the baseline stays the pairs'
                r2["before"] = r["before"]
            ours[c["id"]] = r2
        else:
            r["retried"] = "kept the first run (the rerun's measured peak was no higher)"
        log("%-36s rerun: %.1f GFLOP/s (peak %.0f)" % (c["label"], ours[c["id"]]["gflops"], ours[c["id"]]["peak_gflops"]))
    return retried


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attn", default=None,
                    help="an attn binary to use as is (default: build build-bench/attn, Release, from this tree)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch-python", default=None)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--case-budget", type=float, default=90.0, help="seconds one case may take (default 90)")
    ap.add_argument("--only", default=None, help="run only the cases whose label matches this regex")
    ap.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"))
    ap.add_argument("--dry-run", action="store_true", help="list the cases and exit")
    ap.add_argument("--baseline", default=None,
                    help="a second attn binary: each case runs it and ours in turn; the tables get ours / before")
    ap.add_argument("--pairs", type=int, default=2, help="with --baseline: (baseline, ours) runs per case (default 2)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="the half table: rounds over its cases, ours and PyTorch's alternating (default 1)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.threads < 1:
        ap.error("--threads must be at least 1")
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    if args.baseline and not os.access(args.baseline, os.X_OK):
        ap.error("--baseline %s is not an executable" % args.baseline)

    cases = grid(args.threads)
    cases += backward_grid(args.threads, len(cases))
    cases += half_grid(args.threads, len(cases))
    if args.only:
        cases = [c for c in cases if re.search(args.only, c["label"])]
    if args.dry_run:
        for c in cases:
            g = case_gflop(c) * (FWD_BWD_FACTOR if c.get("backward") else 1.0)
            print("%-40s %8.3g GFLOP%s  %d threads" % (c["label"], g, " fwd+bwd" if c.get("backward") else "",
                                                      c["threads"]) +
                  ("  vs baseline, %d pairs" % args.pairs if args.baseline else ""))
        return 0
    grid_cases = [c for c in cases if not c.get("backward") and c["group"] != "half"]
    bwd_cases = [c for c in cases if c.get("backward")]
    half_cases = [c for c in cases if c["group"] == "half"]

    attn = args.attn
    if attn is None:  # (re)build the tool from this tree: incremental, and never a stale binary
        bdir = os.path.join(ROOT, "build-bench")
        log("building %s/attn" % bdir)
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", ROOT, "-B", bdir] + gen + ["-DCMAKE_BUILD_TYPE=Release", "-DATTN_BUILD_TESTS=OFF"],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", bdir, "--target", "attn_cli"], check=True, stdout=subprocess.DEVNULL)
        attn = os.path.join(bdir, "attn")
    version = subprocess.run([attn, "version"], stdout=subprocess.PIPE, universal_newlines=True).stdout.strip()

    cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    if os.environ.get("TORCH_PYTHON") and not args.torch_python and not args.no_torch:
        cmd = "TORCH_PYTHON=%s %s" % (shlex.quote(os.environ["TORCH_PYTHON"]), cmd)
    info = {"command": cmd, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_model(), "version": version, "threads": args.threads, "load_before": loadavg(),
            "rounds": args.rounds}
    if args.baseline:
        bv = subprocess.run([args.baseline, "version"], stdout=subprocess.PIPE, universal_newlines=True).stdout.strip()
        info.update(baseline=args.baseline, baseline_version=bv, pairs=args.pairs)
    t_start = time.time()

    torch_py = None if args.no_torch else find_torch_python(args.torch_python)
    worker = TorchWorker(torch_py) if torch_py else None
    if worker and not worker.start():
        log("torch worker failed to start; continuing without PyTorch")
        worker = None
    info["torch"] = ("%s (`%s`)" % (worker.version, torch_py)) if worker else "not available in this run"

    log("peak.c ...")
    peaks, peak_lines, peak_note = run_peak_c()
    for ln in peak_lines:
        log("  peak.c: " + ln)

    ours, theirs = {}, {}
    plan_ours, plan_torch = Planner(args.case_budget), Planner(args.case_budget)
    retried = 0
    if grid_cases:
        run_cases(grid_cases, attn, worker, args, plan_ours, plan_torch, ours, theirs)
        # A case whose own measured peak fell well below the run's best shared the CPUs
        # with another load: run it once more and keep the less disturbed of the two.
        retried = rerun_contended(grid_cases, attn, args, ours, peaks)
    info["retried"] = retried
    info["wall"] = time.time() - t_start
    info["load_after"] = info["bwd_load_before"] = loadavg()
    t_bwd = time.time()
    info["bwd_retried"] = 0
    if bwd_cases:
        run_cases(bwd_cases, attn, worker, args, plan_ours, plan_torch, ours, theirs)
        info["bwd_retried"] = rerun_contended(bwd_cases, attn, args, ours, peaks)
    info["bwd_wall"] = time.time() - t_bwd
    info["bwd_load_after"] = info["half_load_before"] = loadavg()
    t_half = time.time()
    if half_cases:
        run_half_cases(half_cases, attn, worker, args, ours, theirs)
    info["half_wall"] = time.time() - t_half
    info["half_load_after"] = loadavg()
    if worker:
        worker.close()
    if grid_cases:
        write_markdown(args.out, render(grid_cases, ours, theirs, peaks, peak_lines, peak_note, info))
    if bwd_cases:
        write_markdown(args.out, render_backward(bwd_cases, ours, theirs, peaks, peak_lines, peak_note, info),
                       BWD_BEGIN, BWD_END)
    if half_cases:
        write_markdown(args.out, render_half(half_cases, ours, theirs, peaks, info), HALF_BEGIN, HALF_END)
    log("wrote %s (%s; %.0f s)" % (args.out, " and ".join(
        n for n, cs in (("the grid", grid_cases), ("the backward table", bwd_cases), ("the half table", half_cases))
        if cs), time.time() - t_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
