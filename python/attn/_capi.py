"""ctypes mirror of include/attn.h and the shared-library lookup."""
import ctypes
import os
import pathlib

MAX_RANK = 8

# attn_dtype
F32, F64, F16, BF16, BOOL, U8 = 0, 1, 2, 3, 4, 5
KV_AS_DTYPE, KV_F32, KV_F16, KV_BF16, KV_Q8_0, KV_Q4_0 = 0, 1, 2, 3, 4, 5  # attn_kv_dtype
# attn_causal
CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2
# attn_mask_mode
MASK_KEEP, MASK_MASKED, MASK_ADDITIVE, MASK_SEED = 0, 1, 2, 3
# attn_mha_param
(MHA_Q_WEIGHT, MHA_Q_BIAS, MHA_K_WEIGHT, MHA_K_BIAS, MHA_V_WEIGHT, MHA_V_BIAS, MHA_O_WEIGHT,
 MHA_O_BIAS, MHA_Q_NORM_WEIGHT, MHA_Q_NORM_BIAS, MHA_K_NORM_WEIGHT, MHA_K_NORM_BIAS, MHA_SINKS,
 MHA_NUM_PARAMS) = range(14)
# QK-norm's scope (ATTN_QK_NORM_*) and attn_norm_kind
QK_NORM_NONE, QK_NORM_PER_HEAD, QK_NORM_WHOLE, QK_NORM_EACH_HEAD = 0, 1, 2, 3
NORM_RMS, NORM_RMS_PLUS_ONE, NORM_LAYER = 0, 1, 2

_c_enum = ctypes.c_int  # C enums with small values are int-sized on every ABI we target


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", _c_enum),
        ("rank", ctypes.c_int),
        ("shape", ctypes.c_int64 * MAX_RANK),
        ("strides", ctypes.c_int64 * MAX_RANK),
    ]


# The options and config structs begin with size_t size: the library reads
# only the first `size` bytes, so a mirror set up by init() below (size =
# ctypes.sizeof of the mirror) works with any library at least as new.
class SdpaOpts(ctypes.Structure):
    _init_ = "attn_sdpa_opts_init"
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("scale", ctypes.c_double),
        ("causal", _c_enum),
        ("mask", ctypes.POINTER(Tensor)),
        ("mask_mode", _c_enum),
        ("key_padding", ctypes.POINTER(Tensor)),
        ("dropout_p", ctypes.c_double),
        ("dropout_seed", ctypes.c_uint64),
        ("window", ctypes.c_int64),
        ("softcap", ctypes.c_double),
        ("alibi_slopes", ctypes.POINTER(Tensor)),
        ("sinks", ctypes.POINTER(Tensor)),
        ("cu_seqlens_q", ctypes.POINTER(ctypes.c_int64)),
        ("cu_seqlens_k", ctypes.POINTER(ctypes.c_int64)),
        ("num_seqs", ctypes.c_int64),
        ("q_offset", ctypes.c_int64),
        ("k_offset", ctypes.c_int64),
        ("head_offset", ctypes.c_int64),
        ("chunk", ctypes.c_int64),
    ]


class MhaConfig(ctypes.Structure):
    _init_ = "attn_mha_config_init"
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("embed_dim", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("kdim", ctypes.c_int64),
        ("vdim", ctypes.c_int64),
        ("bias", ctypes.c_int),
        ("head_dim", ctypes.c_int64),
        ("out_bias", ctypes.c_int),
        ("qk_norm", ctypes.c_int),
        ("qk_norm_kind", ctypes.c_int),
        ("qk_norm_eps", ctypes.c_double),
        ("sinks", ctypes.c_int),
        ("clip_qkv", ctypes.c_double),
    ]


class MhaNames(ctypes.Structure):
    """attn_mha_names: a tensor name per parameter (None: absent); names that
    repeat are one packed tensor. There is no init: set size to its sizeof."""
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("name", ctypes.c_char_p * MHA_NUM_PARAMS),
        ("conv1d", ctypes.c_int),
    ]


ROPE_MAX_PAIRS = 128  # ATTN_ROPE_MAX_PAIRS


class RopeOpts(ctypes.Structure):
    _init_ = "attn_rope_opts_init"
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("rotary_dim", ctypes.c_int64),
        ("layout", _c_enum),
        ("theta", ctypes.c_double),
        ("scaling", _c_enum),
        ("factor", ctypes.c_double),
        ("original_max_position", ctypes.c_int64),
        ("low_freq_factor", ctypes.c_double),
        ("high_freq_factor", ctypes.c_double),
        ("beta_fast", ctypes.c_double),
        ("beta_slow", ctypes.c_double),
        ("attention_factor", ctypes.c_double),
        ("seq_len", ctypes.c_int64),
        ("positions", ctypes.POINTER(ctypes.c_int64)),
        ("position_offset", ctypes.c_int64),
        ("transpose", ctypes.c_int),
        ("yarn_truncate", ctypes.c_int),
        ("short_factor", ctypes.c_double * ROPE_MAX_PAIRS),
        ("long_factor", ctypes.c_double * ROPE_MAX_PAIRS),
    ]


# attn_rope_layout and attn_rope_scaling
ROPE_LAYOUTS = {"half": 0, "interleaved": 1}
ROPE_SCALINGS = {None: 0, "default": 0, "linear": 1, "dynamic": 2, "llama3": 3, "yarn": 4, "longrope": 5}


class KvCacheConfig(ctypes.Structure):
    _init_ = "attn_kv_cache_config_init"
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("batch", ctypes.c_int64),
        ("capacity", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("v_head_dim", ctypes.c_int64),
        ("dtype", _c_enum),
        ("rope", ctypes.POINTER(RopeOpts)),
        ("k_dtype", _c_enum),  # attn_kv_dtype: 0 = dtype
        ("v_dtype", _c_enum),
    ]


class PagedKvConfig(ctypes.Structure):
    _init_ = "attn_paged_kv_config_init"
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("num_blocks", ctypes.c_int64),
        ("block_tokens", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("v_head_dim", ctypes.c_int64),
        ("k_dtype", _c_enum),  # attn_kv_dtype
        ("v_dtype", _c_enum),
        ("max_seqs", ctypes.c_int64),
    ]


class HfConfig(ctypes.Structure):  # filled by the library (attn_mha_create_from_hf): no _init_
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("model_type", ctypes.c_char * 64),
        ("hidden_size", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("num_layers", ctypes.c_int64),
        ("scale", ctypes.c_double),
        ("softcap", ctypes.c_double),
        ("sliding_window", ctypes.c_int64),
        ("sliding", ctypes.c_ubyte * 1024),
        ("attention_bias", ctypes.c_int),
        ("norm_eps", ctypes.c_double),
        ("rope", ctypes.c_int),
        ("rope_global", RopeOpts),
        ("rope_local", RopeOpts),
        ("scale_inverse_layer", ctypes.c_int),
        ("relative_bias", ctypes.c_int),
        ("nope", ctypes.c_ubyte * 1024),
        ("qk_norm", ctypes.c_int),
        ("clip_qkv", ctypes.c_double),
        ("attention_chunk", ctypes.c_int64),
        ("chunked", ctypes.c_ubyte * 1024),
    ]


class HfLayer(ctypes.Structure):  # attn_hf_layer, filled by attn_mha_create_from_hf
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("layer", ctypes.c_int64),
        ("naming", _c_enum),
        ("prefix", ctypes.c_char * 256),
        ("weights_file", ctypes.c_char * 4096),
        ("config", HfConfig),
        ("scale", ctypes.c_double),
        ("softcap", ctypes.c_double),
        ("window", ctypes.c_int64),
        ("has_rope", ctypes.c_int),
        ("rope", RopeOpts),
        ("chunk", ctypes.c_int64),
    ]


class MhaOpts(ctypes.Structure):
    _init_ = "attn_mha_opts_init"
    _nested_ = "attn"  # a sized struct inside: the library reads it by its own size
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("attn", SdpaOpts),
        ("average_weights", ctypes.c_int),
        ("rope", ctypes.POINTER(RopeOpts)),
    ]


def _candidates():
    here = pathlib.Path(__file__).resolve().parent
    # 1. the copy installed into the package by `pip install`
    for name in ("libattn.so", "libattn.dylib", "attn.dll"):
        yield here / name
    # 2. an explicit override
    env = os.environ.get("ATTN_LIBRARY")
    if env:
        yield pathlib.Path(env)
    # 3. a development build tree: <repo>/build next to <repo>/python/attn
    repo = here.parent.parent
    for name in ("libattn.so", "libattn.dylib", "attn.dll"):
        yield repo / "build" / name


def _load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.is_file():
            return ctypes.CDLL(str(path)), str(path)
    raise OSError("libattn shared library not found; tried: " + ", ".join(tried) +
                  " (build it with cmake, or set ATTN_LIBRARY)")


lib, library_path = _load()

_P = ctypes.c_void_p
_PT = ctypes.POINTER(Tensor)
_st = ctypes.c_int

_protos = {
    "attn_version": (ctypes.c_uint, []),
    "attn_version_string": (ctypes.c_char_p, []),
    "attn_strerror": (ctypes.c_char_p, [_st]),
    "attn_ctx_create": (_st, [ctypes.POINTER(_P)]),
    "attn_ctx_destroy": (None, [_P]),
    "attn_ctx_set_threads": (_st, [_P, ctypes.c_int]),
    "attn_ctx_set_precision": (_st, [_P, ctypes.c_int]),
    "attn_ctx_threads": (ctypes.c_int, [_P]),
    "attn_ctx_error": (ctypes.c_char_p, [_P]),
    "attn_ctx_kernel": (ctypes.c_int, [_P]),
    "attn_kernel_name": (ctypes.c_char_p, [ctypes.c_int]),
    "attn_tensor_view": (Tensor, [_P, _c_enum, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]),
    "attn_sdpa_opts_init": (None, [ctypes.POINTER(SdpaOpts)]),
    "attn_alibi_slopes": (ctypes.c_int, [ctypes.POINTER(ctypes.c_float), ctypes.c_int64]),
    # ctx, out, lse, weights, q, k, v, opts
    "attn_sdpa": (_st, [_P, _PT, _PT, _PT, _PT, _PT, _PT, ctypes.POINTER(SdpaOpts)]),
    # ctx, dq, dk, dv, mask_grad, sinks_grad, dout, q, k, v, out, lse, opts
    "attn_sdpa_backward": (_st, [_P, _PT, _PT, _PT, _PT, _PT, _PT, _PT, _PT, _PT, _PT, _PT,
                                 ctypes.POINTER(SdpaOpts)]),
    "attn_mha_config_init": (None, [ctypes.POINTER(MhaConfig), ctypes.c_int64, ctypes.c_int64]),
    "attn_mha_create": (_st, [_P, ctypes.POINTER(_P), ctypes.POINTER(MhaConfig)]),
    "attn_mha_destroy": (None, [_P]),
    "attn_mha_get_config": (ctypes.POINTER(MhaConfig), [_P]),
    "attn_mha_set_param": (_st, [_P, _P, ctypes.c_char_p, _PT]),
    "attn_mha_create_from_safetensors": (_st, [_P, ctypes.POINTER(_P), ctypes.c_char_p, ctypes.c_char_p,
                                               ctypes.c_int64, ctypes.c_int64]),
    "attn_safetensors_open": (_st, [_P, ctypes.POINTER(_P), ctypes.c_char_p]),
    "attn_safetensors_close": (None, [_P]),
    # ctx, out, st, prefix, names (or NULL), like
    "attn_mha_create_from_tensors": (_st, [_P, ctypes.POINTER(_P), _P, ctypes.c_char_p, ctypes.POINTER(MhaNames),
                                           ctypes.POINTER(MhaConfig)]),
    "attn_mha_opts_init": (None, [ctypes.POINTER(MhaOpts)]),
    # ctx, out, info, config path, weights path, layer
    "attn_mha_create_from_hf": (_st, [_P, ctypes.POINTER(_P), ctypes.POINTER(HfLayer), ctypes.c_char_p,
                                      ctypes.c_char_p, ctypes.c_int64]),
    "attn_hf_layer_opts": (None, [ctypes.POINTER(HfLayer), ctypes.POINTER(MhaOpts)]),
    # ctx, mha, out, weights, query, key, value, opts
    "attn_mha_forward": (_st, [_P, _P, _PT, _PT, _PT, _PT, _PT, ctypes.POINTER(MhaOpts)]),
    # ctx, out, mha, which
    "attn_mha_param_view": (_st, [_P, _PT, _P, ctypes.c_int]),
    # ctx, mha, out, weights, saved**, query, key, value, opts
    "attn_mha_forward_save": (_st, [_P, _P, _PT, _PT, ctypes.POINTER(_P), _PT, _PT, _PT, ctypes.POINTER(MhaOpts)]),
    "attn_mha_saved_free": (None, [_P]),
    # ctx, mha, dquery, dkey, dvalue, grads, saved, dout
    "attn_mha_backward": (_st, [_P, _P, _PT, _PT, _PT, _P, _P, _PT]),
    "attn_kv_cache_config_init": (None, [ctypes.POINTER(KvCacheConfig), ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64]),
    "attn_kv_cache_create": (_st, [_P, ctypes.POINTER(_P), ctypes.POINTER(KvCacheConfig)]),
    "attn_kv_cache_destroy": (None, [_P]),
    "attn_kv_cache_get_config": (ctypes.POINTER(KvCacheConfig), [_P]),
    "attn_kv_cache_length": (ctypes.c_int64, [_P, ctypes.c_int64]),
    # ctx, cache, k, v, n_new (int64[B] or NULL)
    "attn_kv_cache_append": (_st, [_P, _P, _PT, _PT, ctypes.POINTER(ctypes.c_int64)]),
    # ctx, cache, out, lse, q, opts
    "attn_kv_cache_attend": (_st, [_P, _P, _PT, _PT, _PT, ctypes.POINTER(SdpaOpts)]),
    "attn_kv_cache_truncate": (_st, [_P, _P, ctypes.c_int64, ctypes.c_int64]),
    "attn_kv_cache_copy_row": (_st, [_P, _P, ctypes.c_int64, ctypes.c_int64]),
    # ctx, k, v, cache, row
    "attn_kv_cache_view": (_st, [_P, _PT, _PT, _P, ctypes.c_int64]),
    "attn_paged_kv_config_init": (None, [ctypes.POINTER(PagedKvConfig), ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64]),
    "attn_paged_kv_create": (_st, [_P, ctypes.POINTER(_P), ctypes.POINTER(PagedKvConfig)]),
    "attn_paged_kv_destroy": (None, [_P]),
    "attn_paged_kv_get_config": (ctypes.POINTER(PagedKvConfig), [_P]),
    # ctx, cache, *seq
    "attn_paged_kv_seq_new": (_st, [_P, _P, ctypes.POINTER(ctypes.c_int64)]),
    "attn_paged_kv_seq_free": (_st, [_P, _P, ctypes.c_int64]),
    # ctx, cache, *child, parent
    "attn_paged_kv_seq_fork": (_st, [_P, _P, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]),
    "attn_paged_kv_seq_truncate": (_st, [_P, _P, ctypes.c_int64, ctypes.c_int64]),
    "attn_paged_kv_seq_length": (ctypes.c_int64, [_P, ctypes.c_int64]),
    "attn_paged_kv_free_blocks": (ctypes.c_int64, [_P]),
    # cache, seq, **blocks
    "attn_paged_kv_block_table": (ctypes.c_int64, [_P, ctypes.c_int64, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))]),
    # ctx, k, v, cache, block
    "attn_paged_kv_block_view": (_st, [_P, _PT, _PT, _P, ctypes.c_int64]),
    # ctx, cache, nseq, seqs, k, v, n_new
    "attn_paged_kv_append": (_st, [_P, _P, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64), _PT, _PT,
                                   ctypes.POINTER(ctypes.c_int64)]),
    # ctx, cache, out, lse, q, nseq, seqs, opts
    "attn_paged_kv_attend": (_st, [_P, _P, _PT, _PT, _PT, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64),
                                   ctypes.POINTER(SdpaOpts)]),
    # ctx, dt (attn_kv_dtype), dst, src, n
    "attn_kv_quantize": (_st, [_P, _c_enum, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]),
    "attn_kv_dequantize": (_st, [_P, _c_enum, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]),
    "attn_kv_dtype_bytes": (ctypes.c_size_t, [_c_enum, ctypes.c_int64]),
    # ctx, mha, cache, out, x, opts
    "attn_mha_forward_cached": (_st, [_P, _P, _P, _PT, _PT, ctypes.POINTER(MhaOpts)]),
    "attn_rope_opts_init": (None, [ctypes.POINTER(RopeOpts)]),
    # ctx, out, x, weight, bias, kind, eps
    "attn_head_norm": (_st, [_P, _PT, _PT, _PT, _PT, _c_enum, ctypes.c_double]),
    # ctx, out, x, opts
    "attn_rope": (_st, [_P, _PT, _PT, ctypes.POINTER(RopeOpts)]),
}
for _name, (_res, _args) in _protos.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args


_SCRATCH = 4096  # more than any of the library's structs


def _library_struct(struct, *args):
    """The bytes of the library's own defaults for struct (its *_init run on
    a scratch buffer: the library's struct may be larger than the mirror)."""
    init = getattr(lib, struct._init_)
    buf = (ctypes.c_ubyte * _SCRATCH)()
    init(ctypes.cast(buf, init.argtypes[0]), *args)
    n = ctypes.c_size_t.from_buffer(buf).value
    if not 0 < n <= _SCRATCH:
        raise ImportError(f"{library_path}: {struct._init_} sets size {n}: not a libattn this binding knows")
    return bytes(buf[:n])


def _fill(s, raw):
    """Mirror s from raw, the library's struct of the same kind (its size first)."""
    nested = getattr(type(s), "_nested_", None)
    if nested is None:
        ctypes.memmove(ctypes.addressof(s), raw, min(len(raw), ctypes.sizeof(s)))
    else:  # the fields after the nested struct start where the library's nested struct ends
        at = getattr(type(s), nested).offset
        inner = getattr(s, nested)
        inner_n = ctypes.c_size_t.from_buffer_copy(raw, at).value
        _fill(inner, raw[at:at + inner_n])
        tail = at + ctypes.sizeof(inner)
        ctypes.memmove(ctypes.addressof(s) + tail, raw[at + inner_n:], min(len(raw) - at - inner_n,
                                                                          ctypes.sizeof(s) - tail))
    s.size = ctypes.sizeof(s)


_defaults = {}  # (struct, args) -> the library's defaults: they never change within a process


def init(s, *args):
    """s (a mirror above) = the library's defaults (its *_init with args),
    with s.size the mirror's own size, which is what the library reads.
    The defaults are asked of the library once per struct and args: the
    scratch round trip cost more than the attention of a small decoding step."""
    key = (type(s), args)
    raw = _defaults.get(key)
    if raw is None:
        raw = _library_struct(type(s), *args)
        if len(_defaults) < 256:  # args are sizes chosen by callers: bound what is kept
            _defaults[key] = raw
    _fill(s, raw)
    return s
