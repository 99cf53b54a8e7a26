#!/usr/bin/env python3
"""Layer L of a real model's shape, libattn beside transformers, on the same machine and threads.

Each case builds a model with transformers from its config (random weights; the
shapes of Qwen3-0.6B, Llama-3.2-1B, BERT-base, Phi-3-mini and gpt-oss-20b),
saves it, and times layer 1's attention forward (projections, QK-norm, RoPE,
attention with gpt-oss's learned sinks, output projection) on one batch of N
tokens:
  * ours: attn.MultiheadAttention.from_hf(folder, 1) on the saved files;
  * transformers: the model's own attention module, with its "sdpa"
    implementation (PyTorch's fused SDPA; "eager" for gpt-oss, whose sinks
    transformers' sdpa path does not take) and the rotary embeddings it is given.
Both in fp32, with the same thread count; medians of repeated runs after a
warm-up, alternating the two. GFLOP/s counts the projections (2 N E (H D + 2 Hk D)
+ 2 N H D E) and the attention (4 N^2 H D, half of it when causal).

    ATTN_LIBRARY=build/libattn.so python scripts/bench_hf_layer.py [--threads 2] [--seq 2048] [--json]
"""
import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build(kind):
    import torch
    import transformers as tf
    if kind == "qwen3-0.6b":
        cfg = tf.Qwen3Config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                             intermediate_size=64, num_hidden_layers=2, vocab_size=64, max_position_embeddings=40960)
        model, causal = tf.Qwen3ForCausalLM(cfg), True
    elif kind == "llama-3.2-1b":
        cfg = tf.LlamaConfig(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                             intermediate_size=64, num_hidden_layers=2, vocab_size=64, max_position_embeddings=131072,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192})
        model, causal = tf.LlamaForCausalLM(cfg), True
    elif kind == "phi-3-mini":  # q, k, v packed in qkv_proj; longrope (short factors below 4096 tokens)
        pairs = 48
        cfg = tf.Phi3Config(hidden_size=3072, num_attention_heads=32, num_key_value_heads=32, intermediate_size=64,
                            num_hidden_layers=2, vocab_size=64, pad_token_id=0, max_position_embeddings=131072,
                            original_max_position_embeddings=4096,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                             "short_factor": [1.0 + i / pairs for i in range(pairs)],
                                             "long_factor": [1.0 + 40 * i / pairs for i in range(pairs)],
                                             "original_max_position_embeddings": 4096})
        model, causal = tf.Phi3ForCausalLM(cfg), True
    elif kind == "gpt-oss-20b":  # learned sinks, biases, YaRN; layer 1 is a full-attention layer
        cfg = tf.GptOssConfig(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                              intermediate_size=64, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                              vocab_size=64, layer_types=["sliding_attention", "full_attention"])
        model, causal = tf.GptOssForCausalLM(cfg), True
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
        model.config._attn_implementation = "eager"
        model.eval()
        folder = tempfile.mkdtemp(prefix=f"bench_{kind}_")
        model.save_pretrained(folder, safe_serialization=True)
        return model, folder, causal
    else:  # bert-base
        cfg = tf.BertConfig(hidden_size=768, num_attention_heads=12, intermediate_size=64, num_hidden_layers=2,
                            vocab_size=64, max_position_embeddings=4096)
        model, causal = tf.BertModel(cfg, add_pooling_layer=False), False
    model.config._attn_implementation = "sdpa"
    model.eval()
    folder = tempfile.mkdtemp(prefix=f"bench_{kind}_")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder, causal


def flops(layer, N, causal):
    E, H, Hk, D = layer.embed_dim, layer.num_heads, layer.num_kv_heads, layer.head_dim
    proj = 2 * N * E * (H * D + 2 * Hk * D) + 2 * N * H * D * E
    att = 4 * N * N * H * D * (0.5 if causal else 1.0)
    return proj + att


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--cases", default="qwen3-0.6b,llama-3.2-1b,bert-base,phi-3-mini,gpt-oss-20b")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import attn
    torch.set_num_threads(args.threads)
    rows = []
    for kind in args.cases.split(","):
        model, folder, causal = build(kind)
        layer = attn.MultiheadAttention.from_hf(folder, 1, threads=args.threads)
        N = args.seq
        x = torch.randn(1, N, layer.embed_dim) * 0.5
        if kind == "bert-base":
            mod = model.encoder.layer[1].attention

            def theirs():
                ctx = mod.self(x)[0]
                return mod.output.dense(ctx)
        else:
            mod = model.model.layers[1].self_attn
            pos = torch.arange(N)[None]
            pe = model.model.rotary_emb(x, pos)

            # sdpa: is_causal when no mask is given; eager (gpt-oss) needs the causal mask
            mask = torch.full((N, N), float("-inf")).triu(1)[None, None] if kind == "gpt-oss-20b" else None

            def theirs():
                return mod(x, pe, mask)[0]

        def ours():
            return layer(x, x, x, need_weights=False, is_causal=causal)[0]
        with torch.no_grad():
            err = float(torch.linalg.norm(ours() - theirs()) / torch.linalg.norm(theirs()))
            t = {"ours": [], "transformers": []}
            for _ in range(args.repeat + 1):  # the first round warms up
                for name, fn in (("ours", ours), ("transformers", theirs)):
                    t0 = time.perf_counter()
                    fn()
                    t[name].append(time.perf_counter() - t0)
        med = {k: float(np.median(v[1:])) for k, v in t.items()}
        f = flops(layer, N, causal)
        rows.append(dict(case=kind, seq=N, causal=causal, threads=args.threads, heads=layer.num_heads,
                         kv_heads=layer.num_kv_heads, head_dim=layer.head_dim, embed=layer.embed_dim,
                         qk_norm=layer.qk_norm, sinks=layer.has_sinks, gflop=f / 1e9, ours_s=med["ours"], transformers_s=med["transformers"],
                         ours_gflops=f / med["ours"] / 1e9, transformers_gflops=f / med["transformers"] / 1e9,
                         speedup=med["transformers"] / med["ours"], rel_l2_vs_transformers=err))
        import shutil
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"CPU: {cpu_name()}; torch {torch.__version__}; threads {args.threads}; N {args.seq}; fp32")
    print("| model shape (layer 1) | E, H/Hk, D | causal | ours ms | transformers (sdpa; gpt-oss eager) ms | ours GFLOP/s | "
          "transformers GFLOP/s | ours / transformers | rel L2 vs transformers |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']}{' (QK-norm)' if r['qk_norm'] else ''}{' (sinks)' if r['sinks'] else ''} | {r['embed']}, {r['heads']}/{r['kv_heads']}, "
              f"{r['head_dim']} | {'yes' if r['causal'] else 'no'} | {1e3 * r['ours_s']:.1f} | "
              f"{1e3 * r['transformers_s']:.1f} | {r['ours_gflops']:.0f} | {r['transformers_gflops']:.0f} | "
              f"{r['speedup']:.2f} | {r['rel_l2_vs_transformers']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
