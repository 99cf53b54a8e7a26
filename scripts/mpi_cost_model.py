#!/usr/bin/env python3
"""Cost model of libattn_mpi's strategies (ring, zigzag, ulysses), forward and
backward, and its check against measured runs.

  scripts/mpi_cost_model.py predict [--ranks 2,4,...,1024] --seq 131072 --heads 32 --kv-heads 8 --dim 128 \
      --gflops 2000 --gbits 25 --latency-us 20 [--stack-gbytes 1.3] [--causal] [--backward] [--bytes 2]
      (each strategy's time and efficiency, the share of the time the links add, and whether it is
      communication-bound: see comm_bound)
  scripts/mpi_cost_model.py check RESULTS.json       measured runs (scripts/bench_mpi.py) against the model
  scripts/mpi_cost_model.py plot OUT.png             predicted efficiency against P for a few link speeds

The model, per rank (P ranks of F FLOP/s each, Fc on causal pieces; links of
beta bytes/s each way and alpha seconds of latency; a TCP stack that moves
gamma bytes/s on a core, time taken from the computation, infinite where the
network card does it; a shard of n = N / P tokens; e bytes a value):
  a block   K and V of a shard: 2 B Hk n D e bytes; its forward work on one
            shard's queries: 4 B H n^2 D flops (a causal diagonal block half).
  ring      P steps; step s computes one block while the next travels (sent
            before, moved by the helper thread):
            max(compute + bytes / gamma, alpha + bytes / beta), the last step
            without a transfer. Causal: every step waits for the rank with the
            most work, a full block from step 1 on: P - 1/2 blocks of time for
            P/2 of work (the diagonal one at Fc).
  zigzag    the ring with every step holding half a block of causal work on every
            rank (pieces a quarter of a block, half of them diagonal: at Fc):
            P/2 blocks of time.
  backward  2.5 times the forward's flops a step; K and V travel ahead as in the
            forward, and a block's dK and dV (f32, 2 B Hk n D 4 bytes) summed
            over the ranks so far move on during the next step, so step s moves
            the next K, V (s < P - 1) and the previous dK, dV (s > 0) under its
            computation; the last hand-over, to the owner, is waited for.
  ulysses   all-to-alls of q, k, v in and of out (f32) and lse back, (P - 1)/P
            of each rank's shard each way, not overlapped; the computation is
            the whole sequence for H / P heads (causal: half, at Fc), perfectly balanced.
            Backward: q, k, v, out, dout and lse in, dq, dk, dv (f32) back.
Efficiency is the ideal time, total flops / (P F), over the predicted time.
F and Fc are measured: P ranks each computing one block of their own at once, no
communication (`mpirun -np P attn-mpi-bench --strategy none [--causal]`), or failing
that one rank alone. beta is the rate one ring block crosses the link at
(`attn-mpi-bench --strategy link` over it: at a shaped rate R about R 1448/1514,
TCP's payload in a 1500-byte Ethernet frame, or less where the CPU limits it),
else R 1448/1514; gamma the same over an unshaped link, where only the CPU
limits it (on 2 cores sharing 2 ranks, about 1.3 GB/s).
"""
import argparse
import json
import os
import sys


def predict(strategy, P, N, B, H, Hk, D, F, beta, alpha, causal, e=4, backward=False, Fc=None,
            gamma=float("inf")):
    """Seconds for one call (forward, or forward + backward) and the ideal time."""
    Fc = Fc or F
    n = N / P
    blk_flops = 4.0 * B * H * n * n * D
    kv_bytes = 2.0 * B * Hk * n * D * e
    total_flops = 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)
    bwd = 2.5
    ideal = total_flops / (P * F) * (1 + (bwd if backward else 0))
    if P == 1:
        return ideal, ideal
    if strategy in ("ring", "zigzag"):
        grad_bytes = 2.0 * B * Hk * n * D * 4

        def steps(flop_scale, grads):
            t = 0.0
            for s in range(P):
                if not causal:
                    work, rate = 1.0, F
                elif strategy == "zigzag":
                    work, rate = 0.5, Fc
                else:
                    work, rate = (0.5, Fc) if s == 0 else (1.0, F)
                moved = (kv_bytes if s < P - 1 else 0.0) + (grad_bytes if grads and s > 0 else 0.0)
                comp = work * blk_flops * flop_scale / rate + moved / gamma
                t += max(comp, alpha + moved / beta if moved else 0.0)
            return t + (alpha + grad_bytes / min(beta, gamma) if grads else 0.0)
        t = steps(1.0, False)
        if backward:
            t += steps(bwd, True)
        return t, ideal
    if strategy == "ulysses":
        frac = (P - 1) / P
        a2a = lambda nbytes: (P - 1) * alpha + frac * nbytes / min(beta, gamma)
        q_b, kv_b = B * H * n * D * e, 2 * B * Hk * n * D * e
        out_b, lse_b = B * H * n * D * 4, B * H * n * 4
        comp = total_flops / (P * (Fc if causal else F))
        t = a2a(q_b) + a2a(kv_b) + comp + a2a(out_b) + a2a(lse_b)
        if backward:
            t += a2a(q_b) + a2a(kv_b) + a2a(out_b) * 2 + a2a(lse_b) + comp * bwd + a2a(B * H * n * D * 4) + \
                a2a(2 * B * Hk * n * D * 4)
        return t, ideal
    raise ValueError(strategy)


def link_share(strategy, P, N, B, H, Hk, D, F, beta, alpha, causal, e=4, backward=False, Fc=None,
               gamma=float("inf")):
    """The share of the predicted time that the links add over the computation alone (the same model with
    infinitely fast links)."""
    t, _ = predict(strategy, P, N, B, H, Hk, D, F, beta, alpha, causal, e, backward, Fc, gamma)
    t_comp, _ = predict(strategy, P, N, B, H, Hk, D, F, float("inf"), 0.0, causal, e, backward, Fc, gamma)
    return (t - t_comp) / t


def comm_bound(strategy, P, N, B, H, Hk, D, F, beta, alpha, causal, e=4, backward=False, Fc=None,
               gamma=float("inf")):
    """Ring and zigzag: whether a middle step's transfer outlasts its computation (the ring paper's
    condition; the forward's, or the backward's, which moves dK and dV too). Ulysses: whether the
    all-to-alls take longer than the computation."""
    if strategy == "ulysses" or P < 2:
        return link_share(strategy, P, N, B, H, Hk, D, F, beta, alpha, causal, e, backward, Fc, gamma) > 0.5
    n, Fc = N / P, Fc or F
    work, rate = (1.0, F) if not causal else (0.5, Fc) if strategy == "zigzag" else (1.0, F)
    kv, grads = 2.0 * B * Hk * n * D * e, 2.0 * B * Hk * n * D * 4
    moved, scale = (kv + grads, 2.5) if backward and P > 2 else (kv, 1.0)
    return alpha + moved / beta > work * 4.0 * B * H * n * n * D * scale / rate + moved / gamma


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("predict")
    p.add_argument("--ranks", default="2,4,8,16,32,64,128,256,512,1024", help="one P or a comma-separated list")
    for name, default in (("seq", 131072), ("batch", 1), ("heads", 32), ("kv-heads", 8), ("dim", 128),
                          ("gflops", 2000.0), ("gbits", 25.0), ("latency-us", 20.0), ("bytes", 4),
                          ("stack-gbytes", 0.0)):
        p.add_argument("--" + name, type=type(default), default=default)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--backward", action="store_true")
    c = sub.add_parser("check")
    c.add_argument("results")
    c.add_argument("--latency-us", type=float, default=50.0)
    c.add_argument("--cores", type=int, default=os.cpu_count(), help="ranks past this share the cores")
    pl = sub.add_parser("plot")
    pl.add_argument("out")
    a = ap.parse_args()
    if a.cmd == "predict":
        print("| ranks | strategy | predicted ms | efficiency | link share | bound by |")
        print("|---|---|---|---|---|---|")
        for P in (int(x) for x in a.ranks.split(",")):
            for s in ("ring", "zigzag", "ulysses"):
                if s == "ulysses" and a.kv_heads % P:
                    continue
                args = (s, P, a.seq, a.batch, a.heads, a.kv_heads, a.dim, a.gflops * 1e9, a.gbits * 1e9 / 8,
                        a.latency_us * 1e-6, a.causal, a.bytes, a.backward, None,
                        a.stack_gbytes * 1e9 if a.stack_gbytes else float("inf"))
                t, ideal = predict(*args)
                print(f"| {P} | {s} | {t * 1e3:.2f} | {ideal / t:.3f} | {link_share(*args):.2f} | "
                      f"{'communication' if comm_bound(*args) else 'computation'} |")
        return 0
    if a.cmd == "check":
        everything = json.load(open(a.results))
        links = {(r["ranks"], r["gbits"], r["seq"]): r["gbytes"] * 1e9 for r in everything if r.get("op") == "link"}
        runs = [r for r in everything if r.get("op") != "link"]
        base = {}  # one rank, one thread: F per (seq, causal, backward)
        block = {}  # P ranks each computing one ring block at once, no communication: F per rank
        for r in runs:
            if r["ranks"] == 1 and r["threads"] == 1:
                base[(r["seq"], r["causal"], r["backward"])] = r["gflops"] * 1e9
            elif r["strategy"] == "none" and r["threads"] == 1:
                block[(r["ranks"], r["seq"], r["causal"], r["backward"])] = r["gflops"] * 1e9 / r["ranks"]

        def link_rate(P, gbits, seq):
            """The measured rate of this link (the nearest N measured), else None."""
            near = [(abs(k[2] - seq), v) for k, v in links.items() if k[0] == P and k[1] == gbits]
            return min(near)[1] if near else None
        worst = 0.0
        print("| ranks | strategy | seq | causal | backward | link Gbit/s | measured s | predicted s | predicted / measured |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in runs:
            if r["ranks"] == 1 or not r.get("gbits"):
                continue
            # F: a rank's rate on a block while the other ranks compute theirs (measured, where the runs
            # have it); else one rank alone on one core, ranks past the cores sharing them
            F = block.get((r["ranks"], r["seq"], 0, r["backward"]))
            if not F:
                F = base.get((r["seq"], r["causal"], r["backward"]))
                if not F:
                    continue
                F *= min(1.0, a.cores / r["ranks"])
            Fc = block.get((r["ranks"], r["seq"], 1, r["backward"]), F)
            beta = link_rate(r["ranks"], r["gbits"], r["seq"]) or r["gbits"] * 1e9 / 8 * 1448 / 1514
            gamma = link_rate(r["ranks"], None, r["seq"]) or float("inf")
            t, _ = predict(r["strategy"], r["ranks"], r["seq"], r["batch"], r["heads"], r["kv_heads"], r["dim"],
                           F, beta, a.latency_us * 1e-6, bool(r["causal"]), 4, bool(r["backward"]), Fc, gamma)
            ratio = t / r["median_s"]
            worst = max(worst, abs(ratio - 1))
            print(f"| {r['ranks']} | {r['strategy']} | {r['seq']} | {r['causal']} | {r['backward']} | {r['gbits']:g} | "
                  f"{r['median_s']:.3f} | {t:.3f} | {ratio:.2f} |")
        print(f"\nlargest deviation: {worst * 100:.1f}%")
        return 0
    if a.cmd == "plot":
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        Ps = [2 ** k for k in range(1, 11)]
        B, H, Hk, D, F, alpha = 1, 32, 8, 128, 2e12, 20e-6
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), dpi=110, sharey=True)
        colors = {"ring": "tab:red", "zigzag": "tab:blue", "ulysses": "tab:green"}
        styles = {1: ":", 10: "--", 25: "-", 100: "-."}
        for ax, logn in zip(axes, (17, 20)):
            N = 1 << logn
            for s, col in colors.items():
                for gb, ls in styles.items():
                    xs, ys = [], []
                    for P in Ps:
                        if s == "ulysses" and Hk % P:
                            continue
                        t, ideal = predict(s, P, N, B, H, Hk, D, F, gb * 1e9 / 8, alpha, True, 2)
                        xs.append(P), ys.append(ideal / t)
                    ax.plot(xs, ys, ls, color=col, label=f"{s}, {gb} Gbit/s")
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.05)
            ax.set_xlabel("ranks P")
            ax.set_title(f"causal forward, N = 2^{logn}", fontsize=9)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("predicted efficiency (ideal / predicted time)")
        axes[1].legend(fontsize=6, ncol=3, loc="lower left")
        fig.suptitle("libattn_mpi cost model: H 32/8, D 128, bf16; 2 TFLOP/s a rank, 20 us latency "
                     "(ulysses: kv heads divide by P)", fontsize=9)
        fig.tight_layout()
        fig.savefig(a.out)
        print(f"wrote {a.out}")
        return 0

if __name__ == "__main__":
    sys.exit(main())
