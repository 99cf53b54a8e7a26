"""KVCache: keys and values of past tokens for incremental decoding."""
import ctypes
import operator
import threading

import numpy as np

from . import _capi
from ._context import _Ctx
from ._rope import rope_opts
from ._sdpa import _model_options
from ._tensors import _int64_list, _is_torch, _stored_to_f32, _tensor, _to_numpy, _wrap


_CACHE_DTYPES = {"float32": _capi.F32, "float16": _capi.F16, "bfloat16": _capi.BF16}
# storage kinds (attn_kv_dtype): the float dtypes' names, and the block formats
_KV_KINDS = {"float32": _capi.KV_F32, "float16": _capi.KV_F16, "bfloat16": _capi.KV_BF16,
             "q8_0": _capi.KV_Q8_0, "q4_0": _capi.KV_Q4_0}
_KV_NAMES = {v: k for k, v in _KV_KINDS.items()}


def _cache_dtype(dtype):
    """'float32'/'float16'/'bfloat16' (or numpy/torch dtypes that print so) to an attn_dtype."""
    name = str(dtype).replace("torch.", "")
    if name not in _CACHE_DTYPES:
        raise ValueError(f"KV cache dtype must be one of {sorted(_CACHE_DTYPES)}, got {dtype!r}")
    return _CACHE_DTYPES[name]


def _kv_kind(dtype, what):
    """A storage name (a float dtype's, 'q8_0' or 'q4_0') to an attn_kv_dtype."""
    name = str(dtype).replace("torch.", "")
    if name not in _KV_KINDS:
        raise ValueError(f"KV cache {what} must be one of {sorted(_KV_KINDS)}, got {dtype!r}")
    return _KV_KINDS[name]


def _attend(owner, q, shape, scale, return_lse, call, model):
    """Shared body of KVCache.attend and PagedKVCache.attend: q [B, Hq, Nq, D]
    (its names in shape, for the error), out and lse made here, model the
    window, chunk, softcap, alibi and sinks keywords, and call(out, lse or None, q,
    opts), the library call, run under owner's lock."""
    like_torch = _is_torch(q)
    qa = _to_numpy(q, "q", "half")
    if qa.ndim != 4:
        raise ValueError(f"q must be {shape}, got shape {tuple(qa.shape)}")
    B, Hq, Nq = (int(n) for n in qa.shape[:3])
    out = np.empty((B, Hq, Nq, owner.v_head_dim), np.float32)
    o = _capi.SdpaOpts()
    _capi.init(o)
    keep = []  # the slopes' and sinks' arrays, alive until the call returns
    _model_options(o, keep, Hq, scale=scale, **model)
    lse = lt = None
    if return_lse:
        lse = np.empty((B, Hq, Nq), np.float32)
        lt = _tensor(lse)
    ot, qt = _tensor(out), _tensor(qa)
    with owner._lock:
        owner._ctx.check(call(ctypes.byref(ot), None if lt is None else ctypes.byref(lt), ctypes.byref(qt),
                              ctypes.byref(o)))
    if return_lse:
        return _wrap(out, like_torch), _wrap(lse, like_torch)
    return _wrap(out, like_torch)


class _Owner:
    """close(), with-blocks and __del__ for a class that owns one library object, self._h, which
    the C function named _DESTROY frees (under self._lock)."""
    _DESTROY = None

    def close(self):
        with self._lock:
            if self._h is not None:
                getattr(_capi.lib, self._DESTROY)(self._h)
                self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        h = getattr(self, "_h", None)
        if h is not None and _capi is not None:
            getattr(_capi.lib, self._DESTROY)(h)
            self._h = None


class KVCache(_Owner):
    """Keys and values of past tokens for incremental decoding (attn_kv_cache).

    batch rows, each holding up to capacity tokens of kv_heads heads; keys have
    head_dim features, values v_head_dim (default head_dim). dtype is the
    storage: 'float32', 'float16' or 'bfloat16' (rounded to nearest even on
    append, widened to float32 on attend), or the block formats 'q8_0' and
    'q4_0' (ggml's layouts; head dims multiples of 32; quantized on append,
    dequantized in registers on attend: see attn.h). k_dtype / v_dtype, when
    given, choose the keys' and the values' storage separately. keys() and
    values() return what is stored, decoded. Use append() then attend() each
    step; close() (or a with block) frees the storage now rather than at
    garbage collection. Errors raise AttnError with the library's message;
    a failed append changes nothing. rope: a dict of attn.rope's keywords
    (theta, scaling, factor, ...): keys are rotated on append at their
    positions, queries on attend at theirs.
    """

    _DESTROY = "attn_kv_cache_destroy"

    def __init__(self, batch, capacity, kv_heads, head_dim, v_head_dim=None, dtype="float32", *, threads=None,
                 rope=None, k_dtype=None, v_dtype=None):
        self._ctx = _Ctx()  # one context per cache, guarded by a lock (calls on a context must not overlap)
        self._lock = threading.Lock()
        self._h = None
        self._ctx.set_threads(threads)
        cfg = _capi.KvCacheConfig()
        # operator.index: a float (2.5 tokens) is a TypeError, not truncated
        _capi.init(cfg, *(operator.index(n) for n in (batch, capacity, kv_heads, head_dim)))
        cfg.v_head_dim = operator.index(v_head_dim or 0)
        kind = _kv_kind(dtype, "dtype")
        if kind in (_capi.KV_Q8_0, _capi.KV_Q4_0):  # a block format: both kinds, unless named apart
            cfg.k_dtype = cfg.v_dtype = kind
        else:
            cfg.dtype = _cache_dtype(dtype)
        if k_dtype is not None:
            cfg.k_dtype = _kv_kind(k_dtype, "k_dtype")
        if v_dtype is not None:
            cfg.v_dtype = _kv_kind(v_dtype, "v_dtype")
        if rope is not None:
            # read by the library when the cache is made (it keeps a copy); a layer from a
            # checkpoint hands its own attn_rope_opts
            self._rope = rope if isinstance(rope, _capi.RopeOpts) else rope_opts(**rope)
            cfg.rope = ctypes.pointer(self._rope)
        h = ctypes.c_void_p()
        self._ctx.check(_capi.lib.attn_kv_cache_create(self._ctx.h, ctypes.byref(h), ctypes.byref(cfg)))
        self._h = h
        c = _capi.lib.attn_kv_cache_get_config(h).contents  # Dv resolved by the library
        self.batch, self.capacity, self.kv_heads = c.batch, c.capacity, c.kv_heads
        self.head_dim, self.v_head_dim = c.head_dim, c.v_head_dim
        self.k_dtype, self.v_dtype = _KV_NAMES[c.k_dtype], _KV_NAMES[c.v_dtype]  # resolved by the library
        self.dtype = self.k_dtype if self.k_dtype == self.v_dtype else f"k {self.k_dtype}, v {self.v_dtype}"

    def __repr__(self):
        state = "closed" if self._h is None else f"lengths={self.lengths}"
        return (f"KVCache(batch={self.batch}, capacity={self.capacity}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, dtype={self.dtype!r}, {state})")

    def _handle(self):
        if self._h is None:
            raise ValueError("the KV cache is closed")
        return self._h

    @property
    def lengths(self):
        """The tokens each row holds now, a tuple of batch ints."""
        h = self._handle()
        return tuple(int(_capi.lib.attn_kv_cache_length(h, b)) for b in range(self.batch))

    def append(self, k, v, n_new=None):
        """Appends the next tokens: k [B, Hk, n, D], v [B, Hk, n, Dv] (NumPy or torch
        CPU, any float dtype and strides, read in place). Row b takes its first
        n_new[b] tokens (default all n). If a row would pass its capacity nothing
        is appended."""
        ka, va = _to_numpy(k, "k", "any"), _to_numpy(v, "v", "any")
        kt, vt = _tensor(ka), _tensor(va)
        nn = None
        if n_new is not None:
            n = _int64_list(n_new, "n_new")
            if len(n) != self.batch:
                raise ValueError(f"n_new has {len(n)} entries for {self.batch} rows")
            nn = (ctypes.c_int64 * self.batch)(*n)
        with self._lock:
            self._ctx.check(_capi.lib.attn_kv_cache_append(self._ctx.h, self._handle(), ctypes.byref(kt),
                                                           ctypes.byref(vt), nn))

    def attend(self, q, scale=None, return_lse=False, *, window=None, softcap=None, alibi=None, sinks=None,
               chunk=None):
        """Attention of new queries over every cached token of their row.

        q [B, Hq, Nq, D] (float32, float16 or torch bfloat16 read in place;
        Hq a multiple of Hk): query i of row b is the token at position
        len_b - Nq + i (append first). window, chunk, softcap, alibi and sinks as in
        attn.scaled_dot_product_attention (positions counted from the row's
        first token). Returns out [B, Hq, Nq, Dv] float32, NumPy or torch like
        q, and with return_lse also lse [B, Hq, Nq]."""
        return _attend(self, q, "[B, Hq, Nq, D]", scale, return_lse,
                       lambda out, lse, qt, o: _capi.lib.attn_kv_cache_attend(self._ctx.h, self._handle(), out, lse,
                                                                              qt, o),
                       dict(window=window, softcap=softcap, alibi=alibi, sinks=sinks, chunk=chunk))

    def truncate(self, length, row=None):
        """Rollback: row (None: every row) keeps its first length tokens."""
        r = -1 if row is None else operator.index(row)
        with self._lock:
            self._ctx.check(_capi.lib.attn_kv_cache_truncate(self._ctx.h, self._handle(), r, operator.index(length)))

    def copy_row(self, dst, src):
        """Beam search: row dst becomes a copy of row src (tokens and length)."""
        with self._lock:
            self._ctx.check(_capi.lib.attn_kv_cache_copy_row(self._ctx.h, self._handle(), operator.index(dst),
                                                             operator.index(src)))

    def reset(self):
        """Empties every row (the storage is kept)."""
        self.truncate(0)

    def _row(self, row):
        kt, vt = _capi.Tensor(), _capi.Tensor()
        with self._lock:
            self._ctx.check(_capi.lib.attn_kv_cache_view(self._ctx.h, ctypes.byref(kt), ctypes.byref(vt),
                                                         self._handle(), operator.index(row)))
            # copied under the lock: the views die on append
            return (self._decoded(kt, self.k_dtype, self.head_dim), self._decoded(vt, self.v_dtype, self.v_head_dim))

    def _decoded(self, t, kind, F):
        """A float32 [Hk, len, F] copy of view t: a block format's raw blocks (uint8) decoded by the library."""
        if t.dtype != _capi.U8:
            return _stored_to_f32(t)
        Hk, n = t.shape[1], t.shape[2]
        out = np.zeros((Hk, n, F), np.float32)
        for g in range(Hk):  # a head's tokens are back to back: one call each
            src = ctypes.c_void_p((t.data or 0) + g * t.strides[1])
            if n:
                self._ctx.check(_capi.lib.attn_kv_dequantize(self._ctx.h, _KV_KINDS[kind], out[g].ctypes.data,
                                                             src, n * F))
        return out

    def keys(self, row):
        """A float32 NumPy copy of row's stored keys, [Hk, len_row, D] (as rounded to the storage dtype)."""
        return self._row(row)[0]

    def values(self, row):
        """A float32 NumPy copy of row's stored values, [Hk, len_row, Dv]."""
        return self._row(row)[1]



class PagedKVCache(_Owner):
    """Keys and values of many sequences in one pool of blocks (attn_paged_kv_cache,
    vLLM's paged layout).

    num_blocks blocks of block_tokens tokens each (16 to 256 typical), of
    kv_heads heads; keys have head_dim features, values v_head_dim (default
    head_dim). k_dtype / v_dtype: 'float32', 'float16', 'bfloat16', 'q8_0' or
    'q4_0' (as KVCache's). A sequence takes blocks as it grows; fork() shares
    its parent's blocks (a prompt stored once, copied block by block only
    where the two then differ). No RoPE here: rotate keys before append() and
    queries before attend(). Sequence ids are ints from new_seq() / fork().
    A failed call changes nothing (an append the pool cannot hold appends
    nothing). close() (or a with block) frees the pool now.
    """

    _DESTROY = "attn_paged_kv_destroy"

    def __init__(self, num_blocks, block_tokens, kv_heads, head_dim, v_head_dim=None, *, k_dtype="float32",
                 v_dtype="float32", max_seqs=256, threads=None):
        self._ctx = _Ctx()
        self._lock = threading.Lock()
        self._h = None
        self._ctx.set_threads(threads)
        cfg = _capi.PagedKvConfig()
        _capi.init(cfg, *(operator.index(n) for n in (num_blocks, block_tokens, kv_heads, head_dim)))
        cfg.v_head_dim = operator.index(v_head_dim or 0)
        cfg.k_dtype, cfg.v_dtype = _kv_kind(k_dtype, "k_dtype"), _kv_kind(v_dtype, "v_dtype")
        cfg.max_seqs = operator.index(max_seqs)
        h = ctypes.c_void_p()
        self._ctx.check(_capi.lib.attn_paged_kv_create(self._ctx.h, ctypes.byref(h), ctypes.byref(cfg)))
        self._h = h
        c = _capi.lib.attn_paged_kv_get_config(h).contents
        self.num_blocks, self.block_tokens, self.kv_heads = c.num_blocks, c.block_tokens, c.kv_heads
        self.head_dim, self.v_head_dim, self.max_seqs = c.head_dim, c.v_head_dim, c.max_seqs
        self.k_dtype, self.v_dtype = _KV_NAMES[c.k_dtype], _KV_NAMES[c.v_dtype]

    def __repr__(self):
        state = "closed" if self._h is None else f"free_blocks={self.free_blocks}"
        return (f"PagedKVCache(num_blocks={self.num_blocks}, block_tokens={self.block_tokens}, "
                f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, "
                f"k_dtype={self.k_dtype!r}, v_dtype={self.v_dtype!r}, {state})")

    def _handle(self):
        if self._h is None:
            raise ValueError("the paged KV cache is closed")
        return self._h

    @staticmethod
    def _seqs(seqs):
        s = _int64_list(seqs, "seqs")
        return len(s), (ctypes.c_int64 * max(len(s), 1))(*s)

    @property
    def free_blocks(self):
        """Blocks left in the pool (a shared block counts once, as used)."""
        return int(_capi.lib.attn_paged_kv_free_blocks(self._handle()))

    def new_seq(self):
        """A new, empty sequence's id."""
        s = ctypes.c_int64()
        with self._lock:
            self._ctx.check(_capi.lib.attn_paged_kv_seq_new(self._ctx.h, self._handle(), ctypes.byref(s)))
        return s.value

    def fork(self, parent):
        """A new sequence holding parent's tokens, sharing its blocks; its id."""
        s = ctypes.c_int64()
        with self._lock:
            self._ctx.check(_capi.lib.attn_paged_kv_seq_fork(self._ctx.h, self._handle(), ctypes.byref(s),
                                                             operator.index(parent)))
        return s.value

    def free(self, seq):
        """Ends sequence seq; its blocks go back to the pool unless shared."""
        with self._lock:
            self._ctx.check(_capi.lib.attn_paged_kv_seq_free(self._ctx.h, self._handle(), operator.index(seq)))

    def truncate(self, seq, length):
        """Sequence seq keeps its first length tokens."""
        with self._lock:
            self._ctx.check(_capi.lib.attn_paged_kv_seq_truncate(self._ctx.h, self._handle(), operator.index(seq),
                                                                 operator.index(length)))

    def length(self, seq):
        """Tokens sequence seq holds (ValueError for an id that is not live)."""
        n = int(_capi.lib.attn_paged_kv_seq_length(self._handle(), operator.index(seq)))
        if n < 0:
            raise ValueError(f"sequence {seq} is not live")
        return n

    def block_table(self, seq):
        """Sequence seq's block ids, in token order (a tuple of ints)."""
        p = ctypes.POINTER(ctypes.c_int32)()
        n = int(_capi.lib.attn_paged_kv_block_table(self._handle(), operator.index(seq), ctypes.byref(p)))
        if n < 0:
            raise ValueError(f"sequence {seq} is not live")
        return tuple(p[i] for i in range(n))

    def append(self, seqs, k, v, n_new=None):
        """Appends tokens to sequences seqs (distinct ids): k [nseq, Hk, n, D],
        v [nseq, Hk, n, Dv] (NumPy or torch CPU, any float dtype and strides);
        sequence seqs[i] takes its first n_new[i] tokens (default all n)."""
        nseq, sa = self._seqs(seqs)
        kt, vt = _tensor(_to_numpy(k, "k", "any")), _tensor(_to_numpy(v, "v", "any"))
        nn = None
        if n_new is not None:
            n = _int64_list(n_new, "n_new")
            if len(n) != nseq:
                raise ValueError(f"n_new has {len(n)} entries for {nseq} sequences")
            nn = (ctypes.c_int64 * max(nseq, 1))(*n)
        with self._lock:
            self._ctx.check(_capi.lib.attn_paged_kv_append(self._ctx.h, self._handle(), nseq, sa, ctypes.byref(kt),
                                                           ctypes.byref(vt), nn))

    def attend(self, seqs, q, scale=None, return_lse=False, *, window=None, softcap=None, alibi=None, sinks=None,
               chunk=None):
        """Attention of q [nseq, Hq, Nq, D] (float32, float16 or torch bfloat16)
        over sequences seqs: query i of seqs[b] is its token len - Nq + i
        (append first). window, chunk, softcap, alibi and sinks as in KVCache.attend.
        Returns out [nseq, Hq, Nq, Dv] float32, NumPy or torch like q, and
        with return_lse also lse [nseq, Hq, Nq]."""
        nseq, sa = self._seqs(seqs)
        return _attend(self, q, "[nseq, Hq, Nq, D]", scale, return_lse,
                       lambda out, lse, qt, o: _capi.lib.attn_paged_kv_attend(self._ctx.h, self._handle(), out, lse,
                                                                              qt, nseq, sa, o),
                       dict(window=window, softcap=softcap, alibi=alibi, sinks=sinks, chunk=chunk))

