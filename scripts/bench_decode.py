#!/usr/bin/env python3
"""The decode table: `attn bench decode --json` on the standard decoding cases
(GQA and MHA head layouts, f32/f16/bf16 caches, 1 and 2 threads), with the
outside yardstick ../shared/tools/peak.c (its read bandwidth) in the same run;
written into BENCHMARKS.md between <!-- decode:begin --> and <!-- decode:end -->.

    scripts/bench_decode.py [--attn PATH] [--out BENCHMARKS.md] [--dry-run] [--only REGEX]
                            [--baseline PATH [--pairs 2]]

Each case's fraction is its GB/s of cache read over the read bandwidth that
`attn bench decode` measures in the same process for the same thread count;
peak.c's figure for that thread count is shown beside it. Only the standard
library is used; the tool is (re)built in build-bench/ unless --attn is given.

--only REGEX runs the cases whose "label dtype threads" matches. --baseline PATH: a
second attn binary; each case runs it and ours in turn (baseline first, --pairs
times) and the table gets "ours / before", the median over the pairs of our GB/s
over the baseline's (above 1: this tree is faster); the other columns are ours
from the last pair.
"""
import argparse
import datetime
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_grid import ROOT, TorchWorker, cpu_model, find_torch_python, loadavg, write_markdown  # noqa: E402

# PyTorch's side of a case: SDPA of the new token's queries over the whole cache held as a tensor of this
# dtype (PyTorch has no block formats: q8_0/q4_0 caches are set beside its f16 cache, the smallest it has)
TORCH_DTYPE = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "q8_0": "float16", "q4_0": "float16"}


def run_case(argv):
    """One `attn bench decode --json`: its JSON object, or None after printing why."""
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
    if p.returncode:
        print("failed: %s: %s" % (" ".join(argv), p.stderr.strip()), file=sys.stderr)
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def median(xs):
    xs, n = sorted(xs), len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])

BEGIN, END = "<!-- decode:begin -->", "<!-- decode:end -->"

# label, batch, kv_seq, heads, kv_heads, dim, dtype, threads, extra flags (--compare: the half
# type's speed-up over f32; on the 4096-token case, the blocked kernel and a full recompute)
CASES = [
    ("GQA 32/8, L=32768", 1, 32768, 32, 8, 128, "f32", 2, []),
    ("GQA 32/8, L=32768", 1, 32768, 32, 8, 128, "f16", 2, ["--compare"]),
    ("GQA 32/8, L=32768", 1, 32768, 32, 8, 128, "bf16", 2, ["--compare"]),
    ("GQA 32/8, L=32768", 1, 32768, 32, 8, 128, "q8_0", 2, ["--cache"]),
    ("GQA 32/8, L=32768", 1, 32768, 32, 8, 128, "q4_0", 2, ["--cache"]),
    ("GQA 32/8, L=32768", 1, 32768, 32, 8, 128, "f32", 1, []),
    ("MHA 8/8, L=8192 (split-KV)", 1, 8192, 8, 8, 128, "f32", 2, []),
    ("MHA 8/8, L=8192 (split-KV)", 1, 8192, 8, 8, 128, "f32", 1, []),
    ("MHA 8/8, L=32768 (split-KV)", 1, 32768, 8, 8, 128, "f32", 2, []),
    ("MHA 8/8, L=32768 (split-KV)", 1, 32768, 8, 8, 128, "f32", 1, []),
    ("MHA 8/8, L=32768 (split-KV)", 1, 32768, 8, 8, 128, "f16", 2, ["--compare"]),
    ("1 token over 4096", 1, 4096, 32, 8, 128, "f32", 2, ["--compare"]),
    ("batch 8, GQA 32/8, L=4096", 8, 4096, 32, 8, 128, "f16", 2, []),
]


def run_peak_c():
    """{threads: read GB/s} from ../shared/tools/peak.c, or ({}, note)."""
    src = os.path.join(os.path.dirname(ROOT), "shared", "tools", "peak.c")
    cc = shutil.which("gcc") or shutil.which("cc")
    if not os.path.exists(src) or not cc:
        return {}, "peak.c or gcc not found: no outside yardstick in this run"
    d = tempfile.mkdtemp(prefix="attn_peak_")
    try:
        exe = os.path.join(d, "peak")
        if subprocess.run([cc, "-O2", "-march=native", "-fopenmp", src, "-o", exe],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode:
            return {}, "peak.c did not build"
        out = subprocess.run([exe, "--json"], stdout=subprocess.PIPE, universal_newlines=True).stdout
        return {j["threads"]: j["read_gbs"] for j in map(json.loads, filter(lambda l: l.startswith("{"),
                                                                         out.splitlines()))}, None
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attn", help="an attn binary to use as is (default: build build-bench/attn from this tree)")
    ap.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"))
    ap.add_argument("--dry-run", action="store_true", help="list the cases and stop")
    ap.add_argument("--only", help='run only the cases whose "label dtype threads" matches this regex')
    ap.add_argument("--baseline", help="a second attn binary: each case runs it and ours in turn; adds ours / before")
    ap.add_argument("--pairs", type=int, default=2, help="with --baseline: (baseline, ours) runs per case (default 2)")
    ap.add_argument("--torch-python", help="a Python with torch for the PyTorch column (default: $TORCH_PYTHON, "
                    "else python3 if it imports torch)")
    ap.add_argument("--no-torch", action="store_true", help="leave the PyTorch column out")
    args = ap.parse_args()
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    if args.baseline and not os.access(args.baseline, os.X_OK):
        ap.error("--baseline %s is not an executable" % args.baseline)
    cases = [c for c in CASES if not args.only or re.search(args.only, "%s %s %d" % (c[0], c[6], c[7]))]
    if args.dry_run:
        for c in cases:
            print(c)
        return 0
    attn = args.attn
    if attn is None:
        bdir = os.path.join(ROOT, "build-bench")
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", ROOT, "-B", bdir] + gen + ["-DCMAKE_BUILD_TYPE=Release", "-DATTN_BUILD_TESTS=OFF"],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", bdir, "--target", "attn_cli"], check=True, stdout=subprocess.DEVNULL)
        attn = os.path.join(bdir, "attn")
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_model(),
            "load": loadavg(), "cmd": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])}
    peak, note = run_peak_c()
    torch_py = None if args.no_torch else find_torch_python(args.torch_python)
    worker = TorchWorker(torch_py) if torch_py else None
    rows = []
    if args.baseline:
        bv = subprocess.run([args.baseline, "version"], stdout=subprocess.PIPE, universal_newlines=True).stdout.strip()
    for label, B, L, H, G, D, dt, T, extra in cases:
        argv = ["bench", "decode", "--batch", str(B), "--kv-seq", str(L), "--heads", str(H), "--kv-heads",
                str(G), "--dim", str(D), "--dtype", dt, "--threads", str(T), "--json"] + extra
        ratios = []
        for _ in range(args.pairs if args.baseline else 1):
            b = run_case([args.baseline] + argv) if args.baseline else None
            r = run_case([attn] + argv)
            if r is None or (args.baseline and b is None):
                return 1
            if b:
                ratios.append(r["read_gbs"] / b["read_gbs"])
        if args.baseline:
            r["before_read_gbs_ratio"] = median(ratios)
        if worker and "--lengths" not in extra:
            # PyTorch's K and V cycled through copies by attn bench decode's rule (twice the last-level
            # cache, at least 256 MiB), so that both sides read memory, not L3
            tbytes = 2.0 * B * G * L * D * (4 if TORCH_DTYPE[dt] == "float32" else 2)
            cold = min(max(256.0 * 2**20, 2.0 * r.get("llc_bytes", 0)), 2.0**32)
            r["torch_copies"] = min(32, math.ceil(cold / tbytes)) if tbytes < cold else 1
            t = worker.run({"id": len(rows), "op": "sdpa", "threads": T, "batch": B, "heads": H, "kv_heads": G,
                            "seq": 1, "kv_seq": L, "dim": D, "causal": False, "torch_dtype": TORCH_DTYPE[dt],
                            "unfused_skip": "not timed", "grouped": True, "kv_copies": r["torch_copies"]},
                           timeout=600)
            # the faster of enable_gqa and the grouped formulation (bench_grid's worker), named in the cell
            ways = [(t[k]["median_s"], w) for k, w in (("sdpa", "gqa"), ("sdpa_grouped", "grouped")) if k in t]
            r["torch"], r["torch_way"] = min(ways) if ways else (None, None)
            r["torch_dtype"] = TORCH_DTYPE[dt]
            if "error" in t:
                print("PyTorch on %s %s: %s" % (label, dt, t["error"]), file=sys.stderr)
        print("%-28s %-4s %dT %7.3f ms %6.2f GB/s %5.1f%%" % (label, dt, T, r["median_s"] * 1e3, r["read_gbs"],
                                                              100 * r["fraction_of_read_bw"]) +
              (" | ours / before %.3f×" % r["before_read_gbs_ratio"] if args.baseline else ""), file=sys.stderr)
        rows.append((label, dt, T, r))
    if worker:
        worker.close()
    # a cache's speed-up over the f32 cache of the same case and threads, from the runs above (the half types'
    # --compare figure, paired step by step, is preferred where there is one)
    f32_ms = {(label, T): r["median_s"] for label, dt, T, r in rows if dt == "f32"}
    for label, dt, T, r in rows:
        if dt != "f32" and not r.get("speedup_over_f32") and (label, T) in f32_ms:
            r["speedup_over_f32"] = f32_ms[(label, T)] / r["median_s"]
            r["speedup_note"] = "separate runs"
    out = [BEGIN, "", "## Decoding (attn bench decode)", "",
           "Run %s on %s; load average before: %s. Command: `%s`." % (info["date"], info["cpu"], info["load"], info["cmd"]),
           "One new token per row (Nq = 1), bottom-right causal, D = 128; the cache is B·Hk·L·D keys and as many values "
           "in the stated type. *Fraction* is GB/s of cache read over the read bandwidth `attn bench decode` measures "
           "in the same run for the same thread count (a cache smaller than twice the last-level cache, and at least "
           "256 MiB, is cycled through copies, so every step reads memory); each step is followed by a read pass over "
           "twice the last-level cache (at least 512 MiB) and the median of 20 such pairs' ratios is "
           "given, as the host's bandwidth drifts. *Speed-up over f32*: the same cache in f32 and in the half type, "
           "timed step by step in turn in one process (median of 20 pairs). peak.c's read bandwidth for that thread "
           "count is in the last column" +
           (" (%s)." % note if note else ".") +
           (" *PyTorch*: `torch.nn.functional.scaled_dot_product_attention` (torch %s, same threads) of the "
            "new token's queries over the whole cache as a tensor (f32 for an f32 cache, f16 beside f16, q8_0 and "
            "q4_0, bf16 beside bf16), median of its timed runs, the faster of two ways: `enable_gqa=True` (gqa) or "
            "each kv head's query heads as rows of one head (grouped: q `[B, Hk, H/Hk, D]`, no copy of K and V), "
            "K and V cycled through copies by the same rule as ours (so that neither side reads from L3); "
            "*× PyTorch* is its time over ours."
            % worker.version if worker and worker.version else " PyTorch: not run (%s)." %
            ("--no-torch" if args.no_torch else "no Python with torch found")) +
           " For q8_0/q4_0 (through `attn_kv_cache`), the speed-up over f32 divides the f32 row's median by "
           "theirs, both from this run." +
           (" *ours / before*: the baseline `%s` (`%s`) and ours run in turn on each case (baseline first, %d pairs); "
            "the median over the pairs of our GB/s over the baseline's (above 1: faster now)." %
            (args.baseline, bv, args.pairs) if args.baseline else ""), "",
           "| case | cache | threads | median ms | GB/s | fraction of read BW | speed-up over f32 | oracle rel L2 | "
           "peak.c read GB/s | PyTorch ms | × PyTorch |" +
           (" ours / before |" if args.baseline else ""),
           "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.baseline else "")]
    for label, dt, T, r in rows:
        sp = ("%.2f×" % r["speedup_over_f32"] + (" (%s)" % r["speedup_note"] if r.get("speedup_note") else "")
              if r.get("speedup_over_f32") else "—")
        tm = r.get("torch")
        out.append("| %s | %s | %d | %.3f | %.2f | **%.3f** | %s | %.1e | %s | %s | %s |" % (
            label, dt, T, r["median_s"] * 1e3, r["read_gbs"], r["fraction_of_read_bw"], sp, r["oracle_rel_l2"],
            "%.1f" % peak[T] if T in peak else "—", "%.3f (%s, %s)" % (tm * 1e3, r["torch_dtype"], r["torch_way"]) if tm else "—",
            "**%.2f×**" % (tm / r["median_s"]) if tm else "—") +
            (" %.3f× |" % r["before_read_gbs_ratio"] if args.baseline else ""))
    cmp = [(label, r) for label, dt, T, r in rows if r.get("full_recompute_s")]
    if cmp:
        out += ["", "The same decoding step three ways (`--compare`): the decode kernel, the blocked (prefill) kernel on "
                "the same single row (`ATTN_DECODE=0`), and a full recomputation of all L rows without a cache:", "",
                "| case | decode ms | blocked kernel ms | full recompute ms |", "|---|---|---|---|"]
        for label, r in cmp:
            full = r.get("full_recompute_s")
            out.append("| %s | %.3f | %.3f (%.2f× slower) | %s |" % (
                label, r["median_s"] * 1e3, r["blocked_kernel_s"] * 1e3, r["blocked_kernel_s"] / r["median_s"],
                "%.1f (%.0f× slower)" % (full * 1e3, full / r["median_s"]) if full else "—"))
    out += ["", END]
    write_markdown(args.out, "\n".join(out), BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
