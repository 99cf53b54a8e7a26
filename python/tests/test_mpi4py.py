"""attn.mpi under mpirun (any number of ranks): every strategy's forward and
backward against attn.scaled_dot_product_attention on the whole sequence,
which each rank computes from the same seeded inputs; a refusal on one rank
raised on every rank. Exits 77 (skipped) without mpi4py or libattn_mpi."""
import sys

import numpy as np

try:
    from mpi4py import MPI
    import attn
    import attn.mpi
except ImportError as e:
    print(f"test_mpi4py: skipped ({e})")
    sys.exit(77)

comm = MPI.COMM_WORLD
R, P = comm.Get_rank(), comm.Get_size()
fails = 0


def check(ok, what):
    global fails
    if not ok:
        fails += 1
        print(f"rank {R}: FAIL {what}", flush=True)


def rel(a, b):
    num = comm.allreduce(float(np.sum((np.asarray(a, np.float64) - b) ** 2)))
    den = comm.allreduce(float(np.sum(np.asarray(b, np.float64) ** 2)))
    return (num / den) ** 0.5 if den else num ** 0.5


def shard(x, rg):
    return np.ascontiguousarray(np.concatenate([x[..., rg[0][0]:rg[0][1], :], x[..., rg[1][0]:rg[1][1], :]], axis=-2))


rng = np.random.default_rng(5)
B, H, G, N, D = 1, 4, 2, 83, 32
q = rng.standard_normal((B, H, N, D), dtype=np.float32)
k = rng.standard_normal((B, G, N, D), dtype=np.float32)
v = rng.standard_normal((B, G, N, D), dtype=np.float32)
g = rng.standard_normal((B, H, N, D), dtype=np.float32)
for strategy, opts in (("ring", dict(is_causal=True, window=17, alibi=True)),
                       ("zigzag", dict(is_causal=True, softcap=20.0)),
                       ("ulysses", dict(is_causal=False, sinks=np.array([0.5, -1, 2, 0], np.float32),
                                        dropout_p=0.2, dropout_seed=11)),
                       ("auto", dict(is_causal=True, sinks=np.array([1.5, 0, -0.5, 3], np.float32)))):
    if strategy == "ulysses" and G % P:
        try:
            attn.mpi.sdpa(comm, q[..., :1, :], k[..., :1, :], v[..., :1, :], strategy="ulysses")
            check(False, "ulysses with kv heads not divisible by the ranks was taken")
        except attn.AttnError as e:
            check("divide" in str(e), f"ulysses refusal: {e}")
        continue
    ref, ref_lse = attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_lse=True, **opts)
    has_sinks = "sinks" in opts
    rdq, rdk, rdv, *rds = attn.sdpa_backward(g, q, k, v, ref, ref_lse, enable_gqa=True,
                                             return_sinks_grad=has_sinks, **opts)
    rg = attn.mpi.shard_range(N, P, R, strategy)
    check(strategy != "zigzag" or rg == attn.mpi.zigzag_range(N, P, R), "zigzag's shard_range is zigzag_range")
    check(np.array_equal(attn.mpi.shard(q, P, R, strategy), shard(q, rg)), f"{strategy}: attn.mpi.shard")
    out, lse = attn.mpi.sdpa(comm, shard(q, rg), shard(k, rg), shard(v, rg), strategy=strategy, return_lse=True,
                             **opts)
    e_out, e_lse = rel(out, shard(ref, rg)), rel(lse[..., None], shard(ref_lse[..., None], rg))
    dq, dk, dv, *ds = attn.mpi.sdpa_backward(comm, shard(g, rg), shard(q, rg), shard(k, rg), shard(v, rg), out,
                                             lse, strategy=strategy, return_sinks_grad=has_sinks, **opts)
    e = [rel(a, shard(b, rg)) for a, b in ((dq, rdq), (dk, rdk), (dv, rdv))] + [rel(a, b) for a, b in zip(ds, rds)]
    check(len(ds) == len(rds) == has_sinks, f"{strategy}: a sinks gradient where there are sinks")
    whole = attn.mpi.unshard(comm.allgather(out), strategy)  # every rank's out, put back in sequence order
    check(whole.shape == ref.shape and rel(whole, ref) <= 1e-6, f"{strategy}: unshard of the gathered out")
    ds_msg = f" dsinks {e[3]:.2e}" if has_sinks else ""
    check(e_out <= 1e-6 and e_lse <= 1e-6 and max(e) <= 1e-6,
          f"{strategy}: out {e_out:.2e} lse {e_lse:.2e} dq/dk/dv {e[0]:.2e} {e[1]:.2e} {e[2]:.2e}{ds_msg}")
    if R == 0:
        print(f"{strategy:8s} {P} ranks: out {e_out:.1e} lse {e_lse:.1e} dq {e[0]:.1e} dk {e[1]:.1e} dv {e[2]:.1e}"
              + ds_msg)
# one rank's k of the wrong head dim: every rank raises, naming that rank
bad_k = k[..., :4, :] if R != P - 1 else np.zeros((B, G, 4, D + 1), np.float32)
try:
    attn.mpi.sdpa(comm, q[..., :4, :], bad_k, v[..., :4, :], strategy="ring")
    check(False, "a wrong shape on the last rank was taken")
except attn.AttnError as e:
    check(f"rank {P - 1}" in str(e), f"the refusal names the rank: {e}")
total = comm.allreduce(fails)
if R == 0:
    print(f"test_mpi4py ({P} ranks): {total} failed")
sys.exit(1 if total else 0)
