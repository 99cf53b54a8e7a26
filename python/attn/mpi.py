"""Sequence-parallel attention over MPI (libattn_mpi, attn_mpi.h) with mpi4py communicators.

    from mpi4py import MPI
    import attn.mpi
    out, lse = attn.mpi.sdpa(MPI.COMM_WORLD, q, k, v, strategy="zigzag", is_causal=True, return_lse=True)
    dq, dk, dv = attn.mpi.sdpa_backward(MPI.COMM_WORLD, dout, q, k, v, out, lse, strategy="zigzag", is_causal=True)

Each rank passes its shard of one sequence ([B, H, n, D], or [H, n, D]; NumPy
or torch, float32/float16/bfloat16) and gets its shard of the results
(float32 NumPy arrays, or torch tensors like q). Which tokens a rank holds
depends on the strategy (zigzag_range for "zigzag"; contiguous shards in rank
order otherwise, of any sizes; shard_range gives the even split the CLI uses,
shard and unshard cut a whole sequence into it and put it back); the options count positions over the whole sequence.
"ring" and "zigzag" give attn_sdpa's result within about 1e-6, "ulysses"'s
forward bitwise. A refusal on any rank raises AttnError on every rank. Needs
libattn_mpi (a build with MPI: next to libattn, or ATTN_MPI_LIBRARY) and
mpi4py; not imported by `import attn`.
"""
import ctypes
import os
import pathlib

import numpy as np

from . import _capi
from ._context import _ctx
from ._sdpa import _SdpaCall
from ._tensors import _is_torch, _tensor, _to4, _to_numpy, _wrap

STRATEGIES = {"auto": 0, "ring": 1, "zigzag": 2, "ulysses": 3}


def _load():
    tried = []
    env = os.environ.get("ATTN_MPI_LIBRARY")
    here = pathlib.Path(_capi.library_path).resolve().parent
    for path in ([pathlib.Path(env)] if env else []) + [here / "libattn_mpi.so", here / "libattn_mpi.dylib"]:
        tried.append(str(path))
        if path.is_file():
            return ctypes.CDLL(str(path))
    raise ImportError("libattn_mpi not found (a build of libattn with MPI makes it); tried: " + ", ".join(tried) +
                      " (or set ATTN_MPI_LIBRARY)")


_lib = _load()


def _comm(comm):
    """mpi4py's communicator as the C MPI_Comm (a pointer in Open MPI, an int in MPICH)."""
    from mpi4py import MPI
    handle = MPI._handleof(comm)
    return (ctypes.c_void_p if MPI._sizeof(MPI.Comm) == ctypes.sizeof(ctypes.c_void_p) else ctypes.c_int)(handle)


def _strategy(name):
    if name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {name!r}")
    return STRATEGIES[name]


def zigzag_range(n_tokens, ranks, rank):
    """The zigzag shard of rank `rank` of `ranks` over n_tokens: ((a0, a1), (b0, b1)), two ranges of tokens."""
    rg = (ctypes.c_int64 * 4)()
    if _lib.attn_mpi_zigzag_range(ctypes.c_int64(n_tokens), ctypes.c_int(ranks), ctypes.c_int(rank), rg) != 0:
        raise ValueError(f"no zigzag shard {rank} of {ranks} over {n_tokens} tokens")
    return (rg[0], rg[1]), (rg[2], rg[3])


def shard_range(n_tokens, ranks, rank, strategy="ring"):
    """The shard the CLI uses for `strategy` (attn_mpi_shard_range): zigzag's two chunks, else the even
    contiguous split (n_tokens // ranks each, the first n_tokens % ranks one more) as ((a0, a1), (a1, a1))."""
    rg = (ctypes.c_int64 * 4)()
    if _lib.attn_mpi_shard_range(_strategy(strategy), ctypes.c_int64(n_tokens), ctypes.c_int(ranks),
                                 ctypes.c_int(rank), rg) != 0:
        raise ValueError(f"no shard {rank} of {ranks} over {n_tokens} tokens")
    return (rg[0], rg[1]), (rg[2], rg[3])


def shard(x, ranks, rank, strategy="ring"):
    """Rank `rank`'s tokens of a whole sequence x (NumPy or torch, the tokens along dim -2: [B, H, N, D]
    or [H, N, D]), in the order sdpa takes them (shard_range's): the local part of attn_mpi_shard."""
    (a0, a1), (b0, b1) = shard_range(x.shape[-2], ranks, rank, strategy)
    parts = [x[..., a0:a1, :], x[..., b0:b1, :]]
    if _is_torch(x):
        import torch
        return torch.cat(parts, dim=-2).contiguous()
    return np.ascontiguousarray(np.concatenate(parts, axis=-2))


def unshard(shards, strategy="ring"):
    """The whole sequence from every rank's shard, listed in rank order (e.g. comm.allgather(out)): the
    inverse of shard, attn_mpi_unshard's local part. Tokens along dim -2, as in shard."""
    P = len(shards)
    N = sum(s.shape[-2] for s in shards)
    first = shards[0]
    if _is_torch(first):
        import torch
        whole = torch.empty(first.shape[:-2] + (N, first.shape[-1]), dtype=first.dtype)
    else:
        whole = np.empty(first.shape[:-2] + (N, first.shape[-1]), first.dtype)
    for r, s in enumerate(shards):
        (a0, a1), (b0, b1) = shard_range(N, P, r, strategy)
        if s.shape[-2] != a1 - a0 + b1 - b0:
            raise ValueError(f"shard {r} holds {s.shape[-2]} tokens; rank {r} of {P} holds {a1 - a0 + b1 - b0}")
        whole[..., a0:a1, :] = s[..., :a1 - a0, :]
        whole[..., b0:b1, :] = s[..., a1 - a0:, :]
    return whole


def _call(q, k, v, is_causal, scale, key_padding_mask, dropout_p, dropout_seed, window, softcap, alibi, sinks):
    return _SdpaCall(q, k, v, None, dropout_p, is_causal, scale, True, key_padding_mask, "top-left", dropout_seed,
                     None, halves=True, window=window, softcap=softcap, alibi=alibi, sinks=sinks)


def sdpa(comm, q, k, v, *, strategy="auto", is_causal=False, scale=None, key_padding_mask=None, dropout_p=0.0,
         dropout_seed=None, window=None, softcap=None, alibi=None, sinks=None, threads=None, return_lse=False):
    """This rank's out (and lse with return_lse) of attention over the whole sequence (attn_mpi_sdpa)."""
    c = _call(q, k, v, is_causal, scale, key_padding_mask, dropout_p, dropout_seed, window, softcap, alibi, sinks)
    out = np.empty((c.B, c.H, c.L, c.Dv), np.float32)
    lse = np.empty((c.B, c.H, c.L), np.float32)
    ot, lt, qt, kt, vt = _tensor(out), _tensor(lse), _tensor(c.q4), _tensor(c.k4), _tensor(c.v4)
    x = _ctx()
    x.set_threads(threads)
    x.check(_lib.attn_mpi_sdpa(x.h, _comm(comm),
                               ctypes.c_int(_strategy(strategy)), ctypes.byref(ot), ctypes.byref(lt),
                               ctypes.byref(qt), ctypes.byref(kt), ctypes.byref(vt), ctypes.byref(c.opts)))
    like = _is_torch(q)
    res = _wrap(c.unbatch(out), like)
    return (res, _wrap(c.unbatch(lse), like)) if return_lse else res


def sdpa_backward(comm, dout, q, k, v, out, lse, *, strategy="auto", is_causal=False, scale=None,
                  key_padding_mask=None, dropout_p=0.0, dropout_seed=None, window=None, softcap=None, alibi=None,
                  sinks=None, threads=None, return_sinks_grad=False):
    """This rank's (dq, dk, dv) from its dout and the out and lse sdpa gave it (attn_mpi_sdpa_backward),
    then with return_sinks_grad the sinks' gradient [H], summed over every rank (the same on each)."""
    if dropout_p and dropout_seed is None:
        raise ValueError("sdpa_backward with dropout needs the forward's dropout_seed")
    c = _call(q, k, v, is_causal, scale, key_padding_mask, dropout_p, dropout_seed, window, softcap, alibi, sinks)
    d4, o4 = _to4(_to_numpy(dout, "dout")), _to4(_to_numpy(out, "out"))
    l = _to_numpy(lse, "lse")
    l3 = np.ascontiguousarray(l.reshape((1,) * (3 - l.ndim) + l.shape), np.float32)
    dq, dk, dv = (np.empty(a.shape, np.float32) for a in (c.q4, c.k4, c.v4))
    ts = [_tensor(a) for a in (dq, dk, dv, d4, c.q4, c.k4, c.v4, o4, l3)]
    ds = st = None
    if return_sinks_grad:
        if sinks is None:
            raise ValueError("a sinks gradient needs sinks")
        ds = np.empty(c.H, np.float32)
        st = _tensor(ds)
    x = _ctx()
    x.set_threads(threads)
    x.check(_lib.attn_mpi_sdpa_backward(x.h, _comm(comm),
                                        ctypes.c_int(_strategy(strategy)), *(ctypes.byref(t) for t in ts[:3]),
                                        None if st is None else ctypes.byref(st), *(ctypes.byref(t) for t in ts[3:]),
                                        ctypes.byref(c.opts)))
    like = _is_torch(q)
    res = tuple(_wrap(a.reshape(shp), like) for a, shp in zip((dq, dk, dv), c.shapes))
    return res + (_wrap(ds, like),) if return_sinks_grad else res
