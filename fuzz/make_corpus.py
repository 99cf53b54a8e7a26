#!/usr/bin/env python3
"""Writes the seed corpora of the fuzzers: for the readers, fuzz/corpus/npy/,
fuzz/corpus/safetensors/ and fuzz/corpus/hf_config/ (config.json files of
each family, older and current forms, and ones libattn refuses). Small valid files of every dtype and format
version, layers under every parameter naming, and hostile files (bad
headers, absurd shapes, overlapping tensors, the hardening issue's
[0, 2^24] projection weights in a small form); and for the structure-aware
harnesses fuzz/corpus/sdpa/, paged/, kv/ and mha/ (their inputs are choices: any
bytes make a case). Standard library only;
rerun after changing it:  python3 fuzz/make_corpus.py
"""
import json
import math
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def out(kind, name, data):
    d = os.path.join(HERE, "corpus", kind)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- .npy -----------------------------------------------------------------------
def npy(descr, shape, payload=b"", version=1, fortran=False, pad=True, raw_dict=None):
    if raw_dict is None:
        dims = ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "")
        raw_dict = "{'descr': '%s', 'fortran_order': %s, 'shape': (%s), }" % (descr, fortran, dims)
    head = raw_dict.encode("latin-1")
    prefix = 10 if version == 1 else 12
    if pad:
        total = (prefix + len(head) + 1 + 63) // 64 * 64
        head = head + b" " * (total - prefix - len(head) - 1) + b"\n"
    size = struct.pack("<H", len(head)) if version == 1 else struct.pack("<I", len(head))
    return b"\x93NUMPY" + bytes([version, 0]) + size + head + payload


def values(fmt, n):
    return b"".join(struct.pack(fmt, math.sin(i + 1) * 3) for i in range(n))


def npy_corpus():
    kinds = {"<f4": ("<f", 4), "<f8": ("<d", 8), "<f2": ("<e", 2)}
    for version in (1, 2, 3):
        for descr, (fmt, _) in kinds.items():
            for shape in ((), (5,), (2, 3), (2, 1, 3)):
                n = math.prod(shape)
                tag = "x".join(map(str, shape)) or "scalar"
                out("npy", "v%d_%s_%s.npy" % (version, descr[1:], tag), npy(descr, shape, values(fmt, n), version))
        out("npy", "v%d_b1.npy" % version, npy("|b1", (2, 2), bytes([0, 1, 1, 0]), version))
        out("npy", "v%d_u1.npy" % version, npy("|u1", (4,), bytes([0, 1, 200, 255]), version))
    out("npy", "native_f4.npy", npy("=f4", (3,), values("<f", 3)))
    out("npy", "lt_u1.npy", npy("<u1", (3,), b"\x01\x02\x03"))
    # integers (positions, token ids) are read as exact f64
    out("npy", "i4.npy", npy("<i4", (2, 3), struct.pack("<6i", 0, 1, -2, 2**31 - 1, -2**31, 7)))
    out("npy", "i8.npy", npy("<i8", (3,), struct.pack("<3q", 0, 2**53, -5)))
    out("npy", "bool_nonzero.npy", npy("|b1", (3,), b"\x00\x02\xff"))
    out("npy", "unpadded.npy", npy("<f4", (2,), values("<f", 2), pad=False,
                                   raw_dict="{'fortran_order':False,'descr':'<f4','shape':(2,)}"))
    out("npy", "py2_longs.npy", npy("<f4", (), values("<f", 2), raw_dict=
                                    "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (1L, 2L)}"))
    out("npy", "trailing_bytes.npy", npy("<f4", (2,), values("<f", 3)))
    # empty tensors, and shapes at the edge of int64
    out("npy", "empty_0x5.npy", npy("<f4", (0, 5)))
    out("npy", "empty_huge_ok.npy", npy("|u1", (0, 4611686018427387903, 2)))
    out("npy", "empty_0_2p62_4.npy", npy("<f4", (0, 2**62, 4)))
    out("npy", "huge_product.npy", npy("<f4", (100000000000, 100000000000)))
    out("npy", "huge_dim.npy", npy("<f8", (2**60,)))
    out("npy", "int_overflow.npy", npy("<f4", (99999999999999999999999,)))
    out("npy", "rank9.npy", npy("<f4", (1,) * 8 + (2,), values("<f", 2)))
    out("npy", "negative.npy", npy("<f4", (-1, 3)))
    # the other layout and byte order (read into C order, this CPU's bytes)
    out("npy", "fortran.npy", npy("<f4", (2, 2), values("<f", 4), fortran=True))
    out("npy", "big_endian.npy", npy(">f4", (2,), values(">f", 2)))
    out("npy", "fortran_big_i4_2x3x2.npy", npy(">i4", (2, 3, 2), struct.pack(">12i", *range(-6, 6)), fortran=True))
    # headers that are wrong
    out("npy", "int32.npy", npy("<i4", (2,), b"\0" * 8))
    out("npy", "structured.npy", npy("", (), b"", raw_dict="{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,)}"))
    out("npy", "extra_key.npy", npy("<f4", (), values("<f", 1),
                                    raw_dict="{'descr': '<f4', 'fortran_order': False, 'shape': (), 'x': 1}"))
    out("npy", "repeated_key.npy", npy("<f4", (), values("<f", 1),
                                       raw_dict="{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': ()}"))
    out("npy", "not_a_dict.npy", npy("", (), raw_dict="['descr', '<f4']"))
    out("npy", "truncated_data.npy", npy("<f4", (4,), values("<f", 3)))
    good = npy("<f4", (2, 3), values("<f", 6))
    out("npy", "truncated_header.npy", good[:40])
    out("npy", "bad_magic.npy", b"\x93NUMPX" + good[6:])
    out("npy", "version4.npy", good[:6] + b"\x04\x00" + good[8:])
    out("npy", "header_too_long.npy", b"\x93NUMPY\x02\x00\x00\x00\x10\x00" + good[10:])
    out("npy", "header_past_end.npy", good[:8] + b"\xff\xff" + good[10:])


# ---- safetensors ------------------------------------------------------------------
def st(tensors, metadata=None, align=8, raw_header=None, data=None):
    """tensors: (name, dtype, shape, bytes) in file order, back to back."""
    header, blob, off = {}, b"", 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, payload in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(payload)]}
        blob += payload
        off += len(payload)
    text = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":"))
    text = text.encode("utf-8")
    text += b" " * (-len(text) % align)
    return struct.pack("<Q", len(text)) + text + (blob if data is None else data)


def f32(shape, seed=1):
    return values("<f", math.prod(shape)) if seed else b"\0" * 4 * math.prod(shape)


def layer(naming, E, kv, kdim=None, vdim=None, bias=True, prefix="", dtype="F32"):
    fmt, es = {"F32": ("<f", 4), "F64": ("<d", 8), "F16": ("<e", 2)}.get(dtype, ("<e", 2))
    kdim, vdim = kdim or E, vdim or E

    def t(name, *shape):
        if dtype == "BF16":
            payload = b"".join(struct.pack("<f", math.sin(i) / 4)[2:] for i in range(math.prod(shape)))
        else:
            payload = b"".join(struct.pack(fmt, math.sin(i) / 4) for i in range(math.prod(shape)))
        return (prefix + name, dtype, shape, payload)

    if naming == "seed":
        ts = [t("wq.weight", E, E), t("wk.weight", kv, kdim), t("wv.weight", kv, vdim), t("dense.weight", E, E)]
        if bias:
            ts += [t("wq.bias", E), t("wk.bias", kv), t("wv.bias", kv), t("dense.bias", E)]
    elif naming == "llama":
        ts = [t("q_proj.weight", E, E), t("k_proj.weight", kv, kdim), t("v_proj.weight", kv, vdim),
              t("o_proj.weight", E, E)]
        if bias:
            ts += [t("q_proj.bias", E), t("k_proj.bias", kv), t("v_proj.bias", kv), t("o_proj.bias", E)]
    elif naming == "packed":
        ts = [t("in_proj_weight", E + 2 * kv, E), t("out_proj.weight", E, E)]
        if bias:
            ts += [t("in_proj_bias", E + 2 * kv), t("out_proj.bias", E)]
    elif naming == "gpt2":  # Conv1D: [in, out], q, k, v columns in turn
        ts = [t("c_attn.weight", E, 3 * E), t("c_proj.weight", E, E)]
        if bias:
            ts += [t("c_attn.bias", 3 * E), t("c_proj.bias", E)]
    elif naming == "bert":
        ts = [t("self.query.weight", E, E), t("self.key.weight", kv, kdim), t("self.value.weight", kv, vdim),
              t("output.dense.weight", E, E)]
        if bias:
            ts += [t("self.query.bias", E), t("self.key.bias", kv), t("self.value.bias", kv),
                   t("output.dense.bias", E)]
    elif naming == "t5":  # inner dim kv (H * d_kv) apart from d_model E
        ts = [t("q.weight", kv, E), t("k.weight", kv, E), t("v.weight", kv, E), t("o.weight", E, kv)]
    elif naming == "qwen3":  # head_dim 2 (4 heads: 8 rows) for E, per-head QK-norm
        ts = [t("q_proj.weight", 8, E), t("k_proj.weight", kv, E), t("v_proj.weight", kv, E),
              t("o_proj.weight", E, 8), t("q_norm.weight", 2), t("k_norm.weight", 2)]
    else:  # torch separate
        ts = [t("q_proj_weight", E, E), t("k_proj_weight", kv, kdim), t("v_proj_weight", kv, vdim),
              t("out_proj.weight", E, E)]
        if bias:
            ts += [t("in_proj_bias", E + 2 * kv), t("out_proj.bias", E)]
    return st(ts)


def st_corpus():
    # every dtype, one tensor each, and all of them in one file (odd sizes: misaligned offsets)
    each = [("f32", "F32", (2, 3), values("<f", 6)), ("f64", "F64", (2,), values("<d", 2)),
            ("f16", "F16", (3,), values("<e", 3)), ("bf16", "BF16", (2, 2), b"\x80\x3f\x00\x40\x40\x40\x80\xc0"),
            ("bool", "BOOL", (3,), b"\x00\x01\x02"), ("u8", "U8", (5,), bytes(range(5))),
            ("i32", "I32", (2,), b"\1\0\0\0\2\0\0\0"), ("f8", "F8_E4M3", (2,), b"\x38\xb8"),
            ("odd", "F4", (7,), b"")]
    for name, dtype, shape, payload in each:
        out("safetensors", "dtype_%s.safetensors" % name, st([(name, dtype, shape, payload)]))
    out("safetensors", "all_dtypes_misaligned.safetensors",
        st([("u8.odd", "U8", (3,), b"\1\2\3")] + each[:6], metadata={"format": "pt"}))
    out("safetensors", "scalar_and_empty.safetensors",
        st([("s", "F64", (), values("<d", 1)), ("e", "BF16", (0, 4), b""), ("z", "F32", (0,), b"")]))
    out("safetensors", "empty_header.safetensors", st([]))
    out("safetensors", "metadata_nested.safetensors",
        st([("w", "F32", (2,), values("<f", 2))], metadata={"format": "pt", "v": "[1, 2.5e-3, {\"k\": null}]"},
           raw_header='{"__metadata__":{"format":"pt","v":[1,-2.5e3,true,null,{"a":"b"}]},'
                      '"w":{"shape":[2],"data_offsets":[0,8],"dtype":"F32","extra":[{}]}}'))
    out("safetensors", "escaped_names.safetensors",
        st([], raw_header='{"n\\u00e9\\ud83d\\ude00\\"\\\\\\n\\/":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}',
           data=b"abc"))
    # layers: every naming, biases on and off, GQA rows, kdim/vdim, prefixes, half dtypes
    out("safetensors", "layer_llama_e4.safetensors", layer("llama", 4, 4))
    out("safetensors", "layer_llama_gqa.safetensors", layer("llama", 8, 4, bias=False))
    out("safetensors", "layer_llama_prefix_bf16.safetensors", layer("llama", 4, 2, prefix="model.layers.0.self_attn.",
                                                                    dtype="BF16"))
    out("safetensors", "layer_seed_e6.safetensors", layer("seed", 6, 6, dtype="F64"))
    out("safetensors", "layer_seed_kdim.safetensors", layer("seed", 4, 4, kdim=3, vdim=5, bias=False))
    out("safetensors", "layer_packed_e4.safetensors", layer("packed", 4, 4, dtype="F16"))
    out("safetensors", "layer_packed_nobias.safetensors", layer("packed", 8, 8, bias=False, prefix="attn."))
    out("safetensors", "layer_separate.safetensors", layer("separate", 4, 4, kdim=2, vdim=6))
    out("safetensors", "layer_gpt2.safetensors", layer("gpt2", 4, 4, prefix="h.0.attn."))
    out("safetensors", "layer_bert_f16.safetensors", layer("bert", 4, 4, prefix="encoder.layer.0.attention.",
                                                          dtype="F16"))
    out("safetensors", "layer_t5_inner.safetensors", layer("t5", 4, 6, prefix="encoder.block.0.layer.0.SelfAttention."))
    out("safetensors", "layer_qwen3_norms.safetensors", layer("qwen3", 4, 4, prefix="layers.0.self_attn."))
    out("safetensors", "layer_separate_gqa.safetensors", layer("separate", 8, 2, kdim=3, vdim=3))
    # the hardening issue's file, small: q/o [4, 4], k/v weights [0, 2^24] holding nothing
    out("safetensors", "layer_empty_kv_2p24.safetensors",
        st([("q_proj.weight", "F32", (4, 4), f32((4, 4))), ("k_proj.weight", "F32", (0, 16777216), b""),
            ("v_proj.weight", "F32", (0, 16777216), b""), ("o_proj.weight", "F32", (4, 4), f32((4, 4)))]))
    out("safetensors", "layer_kdim0.safetensors",
        st([("q_proj.weight", "F32", (4, 4), f32((4, 4))), ("k_proj.weight", "F32", (4, 0), b""),
            ("v_proj.weight", "F32", (4, 0), b""), ("o_proj.weight", "F32", (4, 4), f32((4, 4)))]))
    out("safetensors", "layer_e0.safetensors", st([("out_proj.weight", "F32", (0, 0), b""),
                                                  ("in_proj_weight", "F32", (0, 0), b"")]))
    out("safetensors", "layer_bad_qshape.safetensors",
        st([("wq.weight", "F32", (4, 5), f32((4, 5))), ("wk.weight", "F32", (4, 4), f32((4, 4))),
            ("wv.weight", "F32", (4, 4), f32((4, 4))), ("dense.weight", "F32", (4, 4), f32((4, 4)))]))
    out("safetensors", "layer_int_weights.safetensors",
        st([("q_proj.weight", "I32", (2, 2), b"\0" * 16), ("k_proj.weight", "F32", (2, 2), f32((2, 2))),
            ("v_proj.weight", "F32", (2, 2), f32((2, 2))), ("o_proj.weight", "F32", (2, 2), f32((2, 2)))]))
    # shapes at the edge of int64
    out("safetensors", "empty_0_2p62_4.safetensors", st([("e", "F32", (0, 2**62, 4), b"")]))
    out("safetensors", "empty_huge_ok.safetensors", st([("e", "U8", (0, 4611686018427387903, 2), b"")]))
    out("safetensors", "huge_product.safetensors", st([("h", "F32", (2**32, 2**32, 2**32), b"\0" * 8)]))
    out("safetensors", "rank10.safetensors", st([("r", "F32", (1,) * 9 + (2,), f32((2,)))]))
    # framing and JSON that are wrong
    good = st([("a", "F32", (2,), values("<f", 2)), ("b", "F32", (2,), values("<f", 2))])
    out("safetensors", "truncated_data.safetensors", good[:-3])
    out("safetensors", "truncated_header.safetensors", good[:20])
    out("safetensors", "header_len_zero.safetensors", b"\0" * 8 + good[8:])
    out("safetensors", "header_len_huge.safetensors", b"\xff" * 8 + good[8:])
    out("safetensors", "header_over_cap.safetensors", struct.pack("<Q", (100 << 20) + 1) + good[8:])
    bad = [
        ("overlap", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', 16),
        ("duplicate", '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', 2),
        ("beyond", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,9]}}', 8),
        ("reversed", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}', 8),
        ("size_mismatch", '{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', 8),
        ("negative", '{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', 8),
        ("fraction", '{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}', 8),
        ("no_offsets", '{"a":{"dtype":"F32","shape":[2]}}', 8),
        ("metadata_twice", '{"__metadata__":{},"__metadata__":{}}', 0),
        ("nul_in_name", '{"a\\u0000b":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}', 0),
        ("lone_surrogate", '{"a\\ud800":{}}', 0),
        ("trailing_comma", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},}', 8),
        ("deep_nesting", '{"__metadata__":{"x":' + "[" * 100 + "]" * 100 + "}}", 0),
        ("not_an_object", "[]", 0),
    ]
    for name, text, nd in bad:
        out("safetensors", "bad_%s.safetensors" % name, st([], raw_header=text, data=bytes(range(nd))))
    text = b'{"a\xff":{}}'
    out("safetensors", "bad_utf8.safetensors", struct.pack("<Q", len(text)) + text)


# ---- config.json -------------------------------------------------------------------
def hf_config_corpus():
    configs = {
        "llama3": {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "num_hidden_layers": 32, "rope_theta": 500000.0, "max_position_embeddings": 131072,
                   "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
        "gemma3": {"model_type": "gemma3_text", "hidden_size": 640, "num_attention_heads": 4, "head_dim": 256,
                   "num_hidden_layers": 3, "sliding_window": 512,
                   "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                   "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                   "query_pre_attn_scalar": 256, "attn_logit_softcapping": None},
        "qwen2_yarn": {"model_type": "qwen2", "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 4,
                       "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                        "mscale": 1.0, "mscale_all_dim": 0.5},
                       "sliding_window": 128, "use_sliding_window": True, "max_window_layers": 2},
        "gptj": {"model_type": "gptj", "n_embd": 4096, "n_head": 16, "n_layer": 28, "rotary_dim": 64},
        "t5": {"model_type": "t5", "d_model": 512, "num_heads": 8, "d_kv": 64, "num_layers": 6},
        "longrope": {"model_type": "phi3", "hidden_size": 256, "num_attention_heads": 4,
                     "rope_scaling": {"type": "longrope", "short_factor": [1.0]}},
        "phi3": {"model_type": "phi3", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "partial_rotary_factor": 0.5, "max_position_embeddings": 131072,
                 "original_max_position_embeddings": 4096, "sliding_window": 262144,
                 "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [3.0, 40.5]}},
        "gpt_oss": {"model_type": "gpt_oss", "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
                    "head_dim": 64, "num_hidden_layers": 4, "attention_bias": True, "sliding_window": 128,
                    "layer_types": ["sliding_attention", "full_attention"] * 2, "max_position_embeddings": 131072,
                    "rope_theta": 150000,
                    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                     "truncate": False}},
    }
    for name, c in configs.items():
        out("hf_config", name + ".json", json.dumps(c).encode())
    # sharded checkpoints' indexes (the same harness reads every input as one too)
    wm = {f"model.layers.{i}.self_attn.{p}_proj.weight": f"model-0000{1 + i // 2}-of-00002.safetensors"
          for i in range(4) for p in "qkvo"}
    out("hf_config", "index.json", json.dumps({"metadata": {"total_size": 123456}, "weight_map": wm}).encode())
    out("hf_config", "index_escape.json",
        json.dumps({"weight_map": {"a": "../outside.safetensors", "b": "sub/dir.safetensors"}}).encode())


# ---- the structure-aware harnesses (sdpa, paged, kv, mha) ---------------------------
def choices_corpus():
    """Their inputs are choices, a byte each, so any bytes make a case: a
    dozen reproducible random ones each, long enough for a run of operations."""
    import random
    for kind, length, seed in (("sdpa", 64, 7), ("paged", 160, 11), ("kv", 160, 13), ("mha", 64, 17)):
        rng = random.Random(seed)
        for i in range(12):
            out(kind, "seed_%02d" % i, bytes(rng.randrange(256) for _ in range(length)))


if __name__ == "__main__":
    npy_corpus()
    st_corpus()
    hf_config_corpus()
    choices_corpus()
