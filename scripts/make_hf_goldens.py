#!/usr/bin/env python3
"""Writes tests/golden_hf/: tiny Hugging Face checkpoints as transformers saves
them (config.json and model.safetensors, or shards and their index), randomly
initialised from a fixed seed, and what layer L's attention module gives on a
fixed input, for the CLI test (`attn mha --hf-config`) to check without torch.

Each case holds config.json, the weights, x.npy (the layer's input after its
norm, [B, N, E], float32), optionally positions.npy (int64 [B, N]) and
mask.npy (T5's relative position bias, [H, N, N], the caller's additive
mask), out.npy (transformers' attention module on x in float64: the model converted to
double, the float32 inputs upcast exactly) and case.txt (layer, causal).

Usage: python scripts/make_hf_goldens.py [output_dir]
"""

import os
import shutil
import sys

import numpy as np
import torch

torch.set_num_threads(1)
F64 = torch.float64


def additive_mask(N, causal, window=0):
    i = torch.arange(N)[:, None]
    j = torch.arange(N)[None, :]
    ok = torch.ones(N, N, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if window:
        ok &= i - j < window
    return torch.where(ok, 0.0, float("-inf")).to(F64)[None, None]


def save_case(root, name, model, x, out, layer, causal, positions=None, shard_size=None):
    d = os.path.join(root, name)
    shutil.rmtree(d, ignore_errors=True)
    model.float().save_pretrained(d, safe_serialization=True, max_shard_size=shard_size or "100MB")
    for extra in os.listdir(d):
        if extra not in ("config.json",) and not extra.endswith((".safetensors", ".index.json")):
            os.remove(os.path.join(d, extra))
    np.save(os.path.join(d, "x.npy"), x.float().numpy())
    np.save(os.path.join(d, "out.npy"), out.detach().to(F64).numpy())
    if positions is not None:
        np.save(os.path.join(d, "positions.npy"), positions.numpy().astype(np.int64))
    weights = "model.safetensors.index.json" if os.path.exists(os.path.join(d, "model.safetensors.index.json")) \
        else "model.safetensors"
    with open(os.path.join(d, "case.txt"), "w") as f:
        f.write(f"layer={layer}\ncausal={int(causal)}\nweights={weights}\npositions={int(positions is not None)}\n")
    return d


def randomise(model, gen, scale=0.2):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


def decoder_case(root, name, cfg_cls, model_cls, layer, gen, positions_offset=0, shard_size=None, **cfg):
    config = cfg_cls(vocab_size=16, num_hidden_layers=2, max_position_embeddings=128, **cfg)
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    randomise(model, gen)
    B, N, E = 2, 11, config.hidden_size
    x32 = torch.randn(B, N, E, generator=gen).float()
    # row 1's positions have gaps (RoPE is blind to a shift, not to gaps)
    gaps = torch.randint(1, 4, (N,), generator=gen)
    pos = torch.stack([torch.arange(N), positions_offset + torch.cumsum(gaps, 0) - gaps[0]])
    if not positions_offset:
        pos = torch.stack([torch.arange(N), torch.arange(N)])
    m64 = model.double()
    attn = m64.model.layers[layer].self_attn
    x = x32.to(F64)
    cos, sin = m64.model.rotary_emb(x, pos)
    window = 0
    if getattr(config, "layer_types", None) and config.layer_types[layer] == "sliding_attention":
        window = config.sliding_window
    with torch.no_grad():
        out, _ = attn(x, (cos, sin), additive_mask(N, True, window))
    return save_case(root, name, model, x32, out, layer, True, positions=pos if positions_offset else None,
                     shard_size=shard_size)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "golden_hf")
    os.makedirs(root, exist_ok=True)
    gen = torch.Generator().manual_seed(2026)
    from transformers import (BertConfig, BertModel, Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2Model,
                              LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, T5Config, T5EncoderModel)

    # Llama: GQA 4/2, llama3 RoPE scaling, positions that continue a longer sequence in row 1
    decoder_case(root, "llama", LlamaConfig, LlamaForCausalLM, 1, gen, positions_offset=7,
                 hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 16})
    # Qwen3: head_dim 16 with hidden 32 and 4 heads (H*D = 64), QK-norm; saved in shards
    decoder_case(root, "qwen3_sharded", Qwen3Config, Qwen3ForCausalLM, 1, gen, shard_size="20KB",
                 hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    # Gemma 2: softcap, query_pre_attn_scalar, a sliding window on layer 0
    decoder_case(root, "gemma2", Gemma2Config, Gemma2ForCausalLM, 0, gen,
                 hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 attn_logit_softcapping=5.0, query_pre_attn_scalar=16, sliding_window=4)

    # GPT-2: the fused Conv1D c_attn, causal, scale_attn_by_inverse_layer_idx
    config = GPT2Config(vocab_size=16, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        scale_attn_by_inverse_layer_idx=True)
    config._attn_implementation = "eager"
    model = GPT2Model(config).eval()
    randomise(model, gen)
    x32 = torch.randn(2, 9, 32, generator=gen).float()
    m64 = model.double()
    with torch.no_grad():
        out = m64.h[1].attn(x32.to(F64), attention_mask=additive_mask(9, True))[0]
    save_case(root, "gpt2", model, x32, out, 1, True)

    # BERT: self.query/key/value and output.dense (the block's residual and LayerNorm are not attention)
    config = BertConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=64)
    config._attn_implementation = "eager"
    model = BertModel(config, add_pooling_layer=False).eval()
    randomise(model, gen)
    x32 = torch.randn(2, 10, 32, generator=gen).float()
    m64 = model.double()
    block = m64.encoder.layer[0].attention
    with torch.no_grad():
        ctx = block.self(x32.to(F64), attention_mask=None)[0]
        out = block.output.dense(ctx)
    save_case(root, "bert", model, x32, out, 0, False)

    # T5 encoder: no 1/sqrt(d) scaling, d_kv 12 (H*D = 48 != d_model 32), the relative position bias
    # computed by transformers and saved as the additive mask the caller passes
    config = T5Config(vocab_size=16, d_model=32, d_kv=12, num_heads=4, d_ff=48, num_layers=2)
    config._attn_implementation = "eager"
    model = T5EncoderModel(config).eval()
    randomise(model, gen)
    x32 = torch.randn(2, 10, 32, generator=gen).float()
    m64 = model.double()
    with torch.no_grad():
        res = m64.encoder.block[0].layer[0].SelfAttention(x32.to(F64))
    d = save_case(root, "t5", model, x32, res[0], 0, False)
    np.save(os.path.join(d, "mask.npy"), res[1][0].float().numpy())  # [H, N, N]


if __name__ == "__main__":
    main()
