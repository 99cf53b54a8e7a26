#!/usr/bin/env python3
"""libattn_mpi's benchmarks: attn-mpi-bench on one machine, ranks in network
namespaces over veth links shaped to 1, 10 and 25 Gbit/s (scripts/mpi_netns.sh;
needs root), beside the single process (attn_sdpa, --strategy none).

  scripts/bench_mpi.py [--bench build/attn-mpi-bench] [--out results.json] [--quick]

Prints markdown tables (BENCHMARKS.md's MPI section): the runs, and each link's
rate for one ring block (attn-mpi-bench --strategy link; "unshaped" is the TCP
stack's own rate on this CPU), and writes them all as JSON for
`scripts/mpi_cost_model.py check`.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_WAIT_POLICY="passive")


def run(cmd):
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode or not lines:
        sys.stderr.write(f"failed: {' '.join(cmd)}\n{r.stdout[-2000:]}{r.stderr[-2000:]}\n")
        return None
    return json.loads(lines[-1])


def single(bench, threads, args):
    return run(["mpirun", "-np", "1", "--bind-to", "none", "-x", "OMP_WAIT_POLICY", bench, "--threads", str(threads),
                "--strategy", "none", "--json"] + args)


def blocks(bench, P, args):
    return run(["mpirun", "-np", str(P), "--oversubscribe", "--bind-to", "none", "-x", "OMP_WAIT_POLICY", bench,
                "--threads", "1", "--strategy", "none", "--json"] + args)


LINKS = {}  # (ranks, gbits or None for an unshaped link, seq): the link's measured rate (attn-mpi-bench --strategy link)


def link(bench, P, gbits, args):
    """The rate one ring block crosses the link at, measured once per (ranks, rate, N) on the link as set up."""
    seq = args[args.index("--seq") + 1]
    key = (P, gbits, int(seq))
    if key not in LINKS:
        shape = [a for a in args if a not in ("--causal", "--backward")]
        r = run(["bash", f"{HERE}/mpi_netns.sh", "run", str(P), bench, "--strategy", "link", "--json"] + shape)
        if r:
            r["gbits"] = gbits
        LINKS[key] = r


def netns(bench, P, gbits, strategy, args):
    subprocess.run(["bash", f"{HERE}/mpi_netns.sh", "up", str(P), f"{gbits}gbit" if gbits else "none"], env=ENV,
                   check=True)
    link(bench, P, gbits, args)
    if strategy == "link":
        return None
    r = run(["bash", f"{HERE}/mpi_netns.sh", "run", str(P), bench, "--threads", "1", "--strategy", strategy,
             "--json"] + args)
    if r:
        r["gbits"] = gbits
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default="build/attn-mpi-bench")
    ap.add_argument("--out", default="mpi_results.json")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    bench = os.path.abspath(a.bench)
    shape = ["--batch", "1", "--heads", "8", "--kv-heads", "8", "--dim", "64", "--repeat", "3"]
    runs = []
    big = 8192 if a.quick else 16384
    seqs = [2048, 8192] if a.quick else [2048, 4096, 8192, 16384]
    try:
        for causal in (0, 1):
            c = ["--causal"] if causal else []
            for threads in (1, 2):
                runs.append(single(bench, threads, ["--seq", str(big)] + shape + c))
            for gb in (1, 10, 25):
                for strategy in (["zigzag", "ring", "ulysses"] if causal else ["ring", "ulysses"]):
                    runs.append(netns(bench, 2, gb, strategy, ["--seq", str(big)] + shape + c))
        for n in seqs:  # as the block grows, its computation outgrows its transfer (1 Gbit/s)
            runs.append(single(bench, 1, ["--seq", str(n)] + shape))
            runs.append(single(bench, 2, ["--seq", str(n)] + shape))
            runs.append(netns(bench, 2, 1, "ring", ["--seq", str(n)] + shape))
        for P in (2, 4):  # the cost model's F: every rank computing a block of its own at once
            for n in ([big] if P == 4 else seqs):
                runs.append(blocks(bench, P, ["--seq", str(n)] + shape))
            runs.append(blocks(bench, P, ["--seq", str(big // 2), "--backward"] + shape))
            runs.append(blocks(bench, P, ["--seq", str(big), "--causal"] + shape))  # a causal shard: masked pieces
            if P == 2:
                runs.append(blocks(bench, P, ["--seq", str(big // 2), "--backward", "--causal"] + shape))
            for n in ([big] if P == 4 else [big, big // 2]):  # the TCP stack's own rate: an unshaped link
                netns(bench, P, None, "link", ["--seq", str(n)] + shape)
        for strategy in ("zigzag", "ring"):  # 4 ranks on 2 cores: the causal balance
            runs.append(netns(bench, 4, 25, strategy, ["--seq", str(big)] + shape + ["--causal"]))
        b = ["--backward", "--seq", str(big // 2)] + shape
        for causal in (0, 1):
            c = ["--causal"] if causal else []
            runs.append(single(bench, 1, b + c))
            runs.append(single(bench, 2, b + c))
            for strategy in (["zigzag"] if causal else ["ring"]) + ["ulysses"]:
                runs.append(netns(bench, 2, 25, strategy, b + c))
    finally:
        subprocess.run(["bash", f"{HERE}/mpi_netns.sh", "down"], env=ENV)
    runs = [r for r in runs if r]
    links = [r for r in LINKS.values() if r]
    json.dump(runs + links, open(a.out, "w"), indent=1)
    base = {(r["seq"], r["causal"], r["backward"]): r for r in runs if r["ranks"] == 1 and r["threads"] == 2}
    print("| ranks x threads | strategy | link | N | causal | pass | median s | GFLOP/s | x the 2-thread process |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        b = base.get((r["seq"], r["causal"], r["backward"]))
        rel = f"{r['gflops'] / b['gflops']:.2f}" if b and r["ranks"] > 1 and r["strategy"] != "none" else "—"
        where = f"{r['gbits']} Gbit/s" if r.get("gbits") else "none (each rank its own block)" if r["ranks"] > 1 else "—"
        print(f"| {r['ranks']} x {r['threads']} | {r['strategy']} | {where} | {r['seq']} | {'yes' if r['causal'] else 'no'} | "
              f"{'fwd+bwd' if r['backward'] else 'fwd'} | {r['median_s']:.3f} | {r['gflops']:.1f} | {rel} |")
    print("\n| ranks | link | N | ring block MB | median s | GB/s a link |")
    print("|---|---|---|---|---|---|")
    for r in links:
        print(f"| {r['ranks']} | {str(r['gbits']) + ' Gbit/s' if r['gbits'] else 'unshaped'} | {r['seq']} | "
              f"{r['bytes'] / 1e6:.1f} | {r['median_s']:.4f} | {r['gbytes']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
