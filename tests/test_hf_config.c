/* attn_hf_config_parse / _read on configs as the Hub holds them (older and
 * current forms of each family, written out here), and on hostile or
 * unsupported ones: a clear status naming the field. transformers' own saved
 * configs are read in the conformance suite (python/tests). */
#include "testutil.h"

static attn_hf_config parse(attn_ctx *ctx, const char *json, attn_status want, const char *needle) {
  attn_hf_config c;
  memset(&c, 0xab, sizeof c);
  const attn_status st = attn_hf_config_parse(ctx, &c, json, strlen(json), "config.json");
  CHECK(st == want, "%.60s...: status %d, want %d (%s)", json, (int)st, (int)want, attn_ctx_error(ctx));
  if (needle) CHECK(strstr(attn_ctx_error(ctx), needle) != NULL, "message '%s' lacks '%s'", attn_ctx_error(ctx), needle);
  return c;
}

int main(void) {
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  attn_hf_config c;

  /* Llama 3.1 as on the Hub: rope_theta and rope_scaling with rope_type llama3 */
  c = parse(ctx, "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", \"hidden_size\": 4096,"
                 " \"num_attention_heads\": 32, \"num_key_value_heads\": 8, \"num_hidden_layers\": 32,"
                 " \"rope_theta\": 500000.0, \"max_position_embeddings\": 131072, \"rms_norm_eps\": 1e-05,"
                 " \"rope_scaling\": {\"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0,"
                 " \"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"}, \"attention_bias\": false,"
                 " \"torch_dtype\": \"bfloat16\", \"vocab_size\": 128256}",
            ATTN_OK, NULL);
  CHECK(!strcmp(c.model_type, "llama") && c.hidden_size == 4096 && c.num_heads == 32 && c.num_kv_heads == 8 &&
            c.head_dim == 128 && c.num_layers == 32 && isnan(c.scale) && c.softcap == 0 && c.sliding_window == 0 &&
            c.attention_bias == 0 && c.norm_eps == 1e-5, "llama 3.1: shape");
  CHECK(c.rope && c.rope_global.scaling == ATTN_ROPE_LLAMA3 && c.rope_global.theta == 500000 &&
            c.rope_global.factor == 8 && c.rope_global.original_max_position == 8192 &&
            c.rope_global.high_freq_factor == 4 && c.rope_global.rotary_dim == 0, "llama 3.1: rope");

  /* Mistral: a sliding window on every layer; older "type" key for the scaling */
  c = parse(ctx, "{\"model_type\": \"mistral\", \"hidden_size\": 512, \"num_attention_heads\": 8,"
                 " \"num_key_value_heads\": 2, \"num_hidden_layers\": 3, \"sliding_window\": 4096, \"rope_theta\": 1e6,"
                 " \"rope_scaling\": {\"type\": \"linear\", \"factor\": 2}}",
            ATTN_OK, NULL);
  CHECK(c.sliding_window == 4096 && c.sliding[0] && c.sliding[1] && c.sliding[2] && !c.sliding[3], "mistral: window");
  CHECK(c.rope_global.scaling == ATTN_ROPE_LINEAR && c.rope_global.factor == 2 && c.rope_global.theta == 1e6, "mistral: rope");

  /* Qwen2: a window only when use_sliding_window, on layers from max_window_layers */
  c = parse(ctx, "{\"model_type\": \"qwen2\", \"hidden_size\": 256, \"num_attention_heads\": 4, \"num_hidden_layers\": 4,"
                 " \"sliding_window\": 128, \"use_sliding_window\": false, \"max_window_layers\": 2}", ATTN_OK, NULL);
  CHECK(c.sliding_window == 128 && !c.sliding[0] && !c.sliding[3], "qwen2 without use_sliding_window");
  c = parse(ctx, "{\"model_type\": \"qwen2\", \"hidden_size\": 256, \"num_attention_heads\": 4, \"num_hidden_layers\": 4,"
                 " \"sliding_window\": 128, \"use_sliding_window\": true, \"max_window_layers\": 2}", ATTN_OK, NULL);
  CHECK(!c.sliding[0] && !c.sliding[1] && c.sliding[2] && c.sliding[3], "qwen2 with use_sliding_window");

  /* Gemma 2, older form: even layers slide; the cap and query_pre_attn_scalar */
  c = parse(ctx, "{\"model_type\": \"gemma2\", \"hidden_size\": 2304, \"num_attention_heads\": 8, \"num_key_value_heads\": 4,"
                 " \"head_dim\": 256, \"num_hidden_layers\": 4, \"sliding_window\": 4096, \"attn_logit_softcapping\": 50.0,"
                 " \"query_pre_attn_scalar\": 256, \"final_logit_softcapping\": 30.0}", ATTN_OK, NULL);
  CHECK(c.head_dim == 256 && c.scale == 1.0 / 16 && c.softcap == 50 && c.sliding[0] && !c.sliding[1] && c.sliding[2] &&
            c.rope && c.rope_global.theta == 10000, "gemma2");

  /* Gemma 3, older form: every 6th layer full, rope_local_base_freq on the others */
  c = parse(ctx, "{\"model_type\": \"gemma3_text\", \"hidden_size\": 640, \"num_attention_heads\": 4, \"head_dim\": 256,"
                 " \"num_hidden_layers\": 7, \"sliding_window\": 512, \"sliding_window_pattern\": 6, \"rope_theta\": 1000000,"
                 " \"rope_local_base_freq\": 10000, \"query_pre_attn_scalar\": 256, \"rope_scaling\": null}", ATTN_OK, NULL);
  CHECK(c.sliding[0] && c.sliding[4] && !c.sliding[5] && c.sliding[6] && c.rope_global.theta == 1e6 &&
            c.rope_local.theta == 1e4, "gemma3: layers and bases");

  /* current form: rope_parameters per layer type, layer_types */
  c = parse(ctx, "{\"model_type\": \"gemma3_text\", \"hidden_size\": 640, \"num_attention_heads\": 4, \"head_dim\": 256,"
                 " \"num_hidden_layers\": 3, \"sliding_window\": 512, \"layer_types\": [\"sliding_attention\","
                 " \"full_attention\", \"sliding_attention\"], \"rope_parameters\": {\"full_attention\": {\"rope_type\":"
                 " \"linear\", \"factor\": 8.0, \"rope_theta\": 1000000.0}, \"sliding_attention\": {\"rope_type\": \"default\","
                 " \"rope_theta\": 10000.0}}}", ATTN_OK, NULL);
  CHECK(c.sliding[0] && !c.sliding[1] && c.sliding[2] && c.rope_global.scaling == ATTN_ROPE_LINEAR &&
            c.rope_global.factor == 8 && c.rope_local.scaling == ATTN_ROPE_DEFAULT && c.rope_local.theta == 1e4,
        "gemma3: rope_parameters per layer type");

  /* partial rotary: Phi's factor, GPT-NeoX's rotary_pct, GPT-J's rotary_dim (interleaved) */
  c = parse(ctx, "{\"model_type\": \"phi\", \"hidden_size\": 2560, \"num_attention_heads\": 32, \"partial_rotary_factor\": 0.4}",
            ATTN_OK, NULL);
  CHECK(c.head_dim == 80 && c.rope_global.rotary_dim == 32, "phi: partial rotary");
  c = parse(ctx, "{\"model_type\": \"gpt_neox\", \"hidden_size\": 512, \"num_attention_heads\": 8, \"rotary_pct\": 0.25,"
                 " \"rotary_emb_base\": 10000}", ATTN_OK, NULL);
  CHECK(c.rope_global.rotary_dim == 16 && c.rope_global.layout == ATTN_ROPE_HALF, "gpt-neox: rotary_pct");
  c = parse(ctx, "{\"model_type\": \"gptj\", \"n_embd\": 4096, \"n_head\": 16, \"n_layer\": 28, \"rotary_dim\": 64}", ATTN_OK, NULL);
  CHECK(c.hidden_size == 4096 && c.num_layers == 28 && c.rope_global.rotary_dim == 64 &&
            c.rope_global.layout == ATTN_ROPE_INTERLEAVED, "gpt-j: rotary_dim, interleaved");

  /* YaRN (with DeepSeek's mscale form) and dynamic */
  c = parse(ctx, "{\"model_type\": \"qwen2\", \"hidden_size\": 256, \"num_attention_heads\": 4,"
                 " \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 32768,"
                 " \"mscale\": 1.0, \"mscale_all_dim\": 0.5}}", ATTN_OK, NULL);
  CHECK(c.rope_global.scaling == ATTN_ROPE_YARN && c.rope_global.original_max_position == 32768 &&
            fabs(c.rope_global.attention_factor - (0.1 * log(4.0) + 1) / (0.05 * log(4.0) + 1)) < 1e-12, "yarn");
  c = parse(ctx, "{\"model_type\": \"llama\", \"hidden_size\": 256, \"num_attention_heads\": 4, \"max_position_embeddings\": 2048,"
                 " \"rope_scaling\": {\"rope_type\": \"dynamic\", \"factor\": 2.0}}", ATTN_OK, NULL);
  CHECK(c.rope_global.scaling == ATTN_ROPE_DYNAMIC && c.rope_global.original_max_position == 2048, "dynamic");

  /* no RoPE: GPT-2, BERT, T5 (scale 1, d_kv), DistilBERT's names */
  c = parse(ctx, "{\"model_type\": \"gpt2\", \"n_embd\": 768, \"n_head\": 12, \"n_layer\": 12, \"n_positions\": 1024}", ATTN_OK, NULL);
  CHECK(!c.rope && c.head_dim == 64 && c.num_kv_heads == 12, "gpt2");
  c = parse(ctx, "{\"model_type\": \"t5\", \"d_model\": 512, \"num_heads\": 8, \"d_kv\": 64, \"num_layers\": 6}", ATTN_OK, NULL);
  CHECK(!c.rope && c.scale == 1 && c.head_dim == 64 && c.num_layers == 6 && !c.relative_bias, "t5");
  c = parse(ctx, "{\"model_type\": \"t5\", \"d_model\": 512, \"num_heads\": 8, \"d_kv\": 64, \"num_layers\": 6,"
                 " \"relative_attention_num_buckets\": 32, \"relative_attention_max_distance\": 128}", ATTN_OK, NULL);
  CHECK(c.relative_bias, "t5: its relative position bias is the caller's");
  c = parse(ctx, "{\"model_type\": \"gpt2\", \"n_embd\": 64, \"n_head\": 4, \"scale_attn_weights\": false,"
                 " \"scale_attn_by_inverse_layer_idx\": true}", ATTN_OK, NULL);
  CHECK(c.scale == 1 && c.scale_inverse_layer && !c.relative_bias, "gpt2: scale keys");
  c = parse(ctx, "{\"model_type\": \"distilbert\", \"dim\": 768, \"n_heads\": 12, \"n_layers\": 6}", ATTN_OK, NULL);
  CHECK(!c.rope && c.hidden_size == 768 && c.num_heads == 12 && c.num_layers == 6, "distilbert");
  c = parse(ctx, "\xef\xbb\xbf{\"model_type\": \"bert\", \"hidden_size\": 768, \"num_attention_heads\": 12,"
                 " \"position_embedding_type\": \"absolute\", \"layer_norm_eps\": 1e-12}", ATTN_OK, NULL);
  CHECK(!c.rope && c.norm_eps == 1e-12, "bert (after a byte order mark)");

  c = parse(ctx, "{\"model_type\": \"phi3\", \"hidden_size\": 8, \"num_attention_heads\": 4, \"rope_scaling\": {\"type\":"
                 " \"longrope\", \"short_factor\": [1.0], \"long_factor\": [2.0]}, \"max_position_embeddings\": 8192,"
                 " \"original_max_position_embeddings\": 2048}", ATTN_OK, NULL);
  CHECK(c.rope && c.rope_global.scaling == ATTN_ROPE_LONGROPE && c.rope_global.short_factor[0] == 1 &&
            c.rope_global.long_factor[0] == 2 && c.rope_global.factor == 4 && c.rope_global.original_max_position == 2048,
        "phi3: longrope, its factor the context's growth");
  parse(ctx, "{\"model_type\": \"phi3\", \"hidden_size\": 256, \"num_attention_heads\": 4, \"rope_scaling\": {\"type\":"
             " \"longrope\", \"short_factor\": [1.0], \"long_factor\": [2.0]}}", ATTN_E_FORMAT, "32 pairs");

  c = parse(ctx, "{\"model_type\": \"smollm3\", \"hidden_size\": 64, \"num_attention_heads\": 4,"
                 " \"num_hidden_layers\": 4, \"rope_theta\": 5e6, \"no_rope_layers\": [1, 0, 1, 1]}", ATTN_OK, NULL);
  CHECK(c.rope && !c.nope[0] && c.nope[1] && !c.nope[2] && !c.nope[3], "smollm3: layer 1 takes no RoPE");
  c = parse(ctx, "{\"model_type\": \"smollm3\", \"hidden_size\": 64, \"num_attention_heads\": 4,"
                 " \"num_hidden_layers\": 8, \"rope_theta\": 5e6}", ATTN_OK, NULL);
  CHECK(!c.nope[2] && c.nope[3] && !c.nope[4] && c.nope[7], "smollm3: every 4th layer without RoPE by default");
  c = parse(ctx, "{\"model_type\": \"llama\", \"hidden_size\": 64, \"num_attention_heads\": 4,"
                 " \"num_hidden_layers\": 8, \"attention_chunk_size\": null, \"use_qk_norm\": false}", ATTN_OK, NULL);
  CHECK(!c.nope[3], "llama: every layer takes RoPE");
  parse(ctx, "{\"model_type\": \"smollm3\", \"hidden_size\": 64, \"num_attention_heads\": 4, \"num_hidden_layers\": 3,"
             " \"no_rope_layers\": [1, 0]}", ATTN_E_FORMAT, "2 entries for 3 layers");

  /* Llama 4: NoPE every 4th layer (no_rope_layers absent or empty), the RoPE layers chunked, interleaved
   * pairs and its theta; layer_types or no_rope_layers say otherwise; a chunk of 0 or chunked layers
   * without a size are no model; attention_chunk_size elsewhere is refused */
#define L4 "\"model_type\": \"llama4_text\", \"hidden_size\": 64, \"num_attention_heads\": 4, \"num_hidden_layers\": 8"
  static const char *const l4_default[] = {"{" L4 ", \"attention_chunk_size\": 32}",
                                           "{" L4 ", \"attention_chunk_size\": 32, \"no_rope_layers\": []}",
                                           "{\"attention_chunk_size\": 32, \"no_rope_layer_interval\": 4, " L4 "}"};
  for (size_t i = 0; i < sizeof l4_default / sizeof l4_default[0]; i++) {
    c = parse(ctx, l4_default[i], ATTN_OK, NULL);
    int rule = c.attention_chunk == 32 && c.rope && c.rope_global.layout == ATTN_ROPE_INTERLEAVED &&
               c.rope_global.theta == 5e5;
    for (int l = 0; l < 8; l++) rule &= c.nope[l] == ((l + 1) % 4 == 0) && c.chunked[l] == !c.nope[l];
    CHECK(rule, "llama4_text config %zu: chunk %lld, every 4th layer unrotated and unchunked", i,
          (long long)c.attention_chunk);
  }
  c = parse(ctx, "{" L4 ", \"attention_chunk_size\": 16, \"no_rope_layers\": [1, 0, 1, 0, 1, 1, 0, 0]}", ATTN_OK, NULL);
  CHECK(c.chunked[0] && !c.chunked[1] && c.chunked[5] && !c.chunked[7] && c.nope[1] && !c.nope[5],
        "llama4_text: no_rope_layers say which layers rotate and chunk");
  c = parse(ctx, "{" L4 ", \"attention_chunk_size\": 16, \"layer_types\": [\"full_attention\", \"chunked_attention\","
                 " \"full_attention\", \"chunked_attention\", \"chunked_attention\", \"chunked_attention\","
                 " \"chunked_attention\", \"full_attention\"]}", ATTN_OK, NULL);
  CHECK(!c.chunked[0] && c.chunked[1] && c.chunked[3] && !c.chunked[7] && c.sliding_window == 0 && !c.sliding[1],
        "llama4_text: layer_types say which layers chunk");
  c = parse(ctx, "{" L4 ", \"attention_chunk_size\": null}", ATTN_OK, NULL);
  CHECK(c.attention_chunk == 0 && !c.chunked[0], "llama4_text: attention_chunk_size null, no chunks");
  c = parse(ctx, "{\"model_type\": \"llama4\", \"hidden_size\": 64, \"num_attention_heads\": 4, \"num_hidden_layers\": 2,"
                 " \"attention_chunk_size\": 8192}", ATTN_OK, NULL);
  CHECK(c.attention_chunk == 8192 && c.chunked[0] && c.chunked[1], "llama4: chunk 8192 on both layers");
  parse(ctx, "{" L4 ", \"attention_chunk_size\": 0}", ATTN_E_FORMAT, "attention_chunk_size is 0");
  parse(ctx, "{" L4 ", \"layer_types\": [\"chunked_attention\", \"full_attention\", \"full_attention\","
             " \"full_attention\", \"full_attention\", \"full_attention\", \"full_attention\", \"full_attention\"]}",
        ATTN_E_FORMAT, "not given");
  parse(ctx, "{" L4 ", \"attention_chunk_size\": 16, \"layer_types\": [\"chunked_attention\"]}", ATTN_E_FORMAT,
        "1 entries for 8 layers");
  parse(ctx, "{\"model_type\": \"llama\", \"hidden_size\": 64, \"num_attention_heads\": 4,"
             " \"attention_chunk_size\": 512}", ATTN_E_UNSUPPORTED, "attention_chunk_size");
#undef L4
  parse(ctx, "{\"model_type\": \"smollm3\", \"hidden_size\": 64, \"num_attention_heads\": 4, \"num_hidden_layers\": 2,"
             " \"no_rope_layers\": [1, 2]}", ATTN_E_FORMAT, "want 0 or 1");

  /* families as the Hub keeps them (configs saved before layer_types and per-type RoPE), read as
   * transformers reads them: the layout, the defaults, which layers slide and which rotate */
#define HF_SHAPE "\"hidden_size\": 64, \"num_attention_heads\": 4, \"num_hidden_layers\": 8"
  static const char *const interleaved[] = {"cohere", "cohere2", "glm", "glm4", "helium", "ernie4_5", "gptj"};
  for (size_t i = 0; i < sizeof interleaved / sizeof interleaved[0]; i++) {
    char json[256];
    snprintf(json, sizeof json, "{\"model_type\": \"%s\", " HF_SHAPE ", \"rope_theta\": 1e4}", interleaved[i]);
    c = parse(ctx, json, ATTN_OK, NULL);
    CHECK(c.rope && c.rope_global.layout == ATTN_ROPE_INTERLEAVED && c.rope_local.layout == ATTN_ROPE_INTERLEAVED,
          "%s: RoPE over interleaved pairs", interleaved[i]);
  }
  c = parse(ctx, "{\"model_type\": \"llama\", " HF_SHAPE "}", ATTN_OK, NULL);
  CHECK(c.rope_global.layout == ATTN_ROPE_HALF && c.rope_global.theta == 1e4, "llama: half pairs, theta 1e4");
  c = parse(ctx, "{\"model_type\": \"cohere\", " HF_SHAPE "}", ATTN_OK, NULL);
  CHECK(c.rope_global.theta == 5e5, "cohere: theta 5e5 when unsaid, got %g", c.rope_global.theta);
  c = parse(ctx, "{\"model_type\": \"glm4\", " HF_SHAPE ", \"head_dim\": 32}", ATTN_OK, NULL);
  CHECK(c.rope_global.rotary_dim == 16, "glm4: partial rotary 0.5 when unsaid, got %lld", (long long)c.rope_global.rotary_dim);
  c = parse(ctx, "{\"model_type\": \"stablelm\", " HF_SHAPE ", \"partial_rotary_factor\": null}", ATTN_OK, NULL);
  CHECK(c.rope_global.rotary_dim == 4, "stablelm: partial rotary 0.25 when unsaid");
  c = parse(ctx, "{\"model_type\": \"stablelm\", " HF_SHAPE ", \"partial_rotary_factor\": 0.5}", ATTN_OK, NULL);
  CHECK(c.rope_global.rotary_dim == 8, "stablelm: the saved factor wins");
  c = parse(ctx, "{\"model_type\": \"granite\", " HF_SHAPE "}", ATTN_OK, NULL);
  CHECK(c.scale == 1.0, "granite: attention_multiplier 1 when unsaid, got %g", c.scale);
  c = parse(ctx, "{\"model_type\": \"granite\", " HF_SHAPE ", \"attention_multiplier\": 0.0078125}", ATTN_OK, NULL);
  CHECK(c.scale == 0.0078125, "granite: attention_multiplier");
  c = parse(ctx, "{\"model_type\": \"cohere2\", " HF_SHAPE ", \"head_dim\": 8, \"sliding_window\": 4096}", ATTN_OK, NULL);
  int rule = c.head_dim == 16;
  for (int l = 0; l < 8; l++) rule &= c.sliding[l] == ((l + 1) % 4 != 0) && c.nope[l] == !c.sliding[l];
  CHECK(rule, "cohere2: every 4th layer full and without RoPE, head_dim hidden / heads");
  c = parse(ctx, "{\"model_type\": \"cohere2\", " HF_SHAPE ", \"sliding_window\": 4096, \"sliding_window_pattern\": 3}",
            ATTN_OK, NULL);
  CHECK(c.sliding[1] && !c.sliding[2] && c.nope[2] && !c.nope[3], "cohere2: sliding_window_pattern 3");
  c = parse(ctx, "{\"model_type\": \"cohere2\", " HF_SHAPE ", \"sliding_window\": null}", ATTN_OK, NULL);
  CHECK(c.nope[0] && c.nope[3], "cohere2 without a window: no layer rotates");
  c = parse(ctx, "{\"model_type\": \"exaone4\", " HF_SHAPE ", \"sliding_window\": 4096, \"sliding_window_pattern\": \"LLLG\","
                 " \"layer_types\": [\"sliding_attention\", \"full_attention\", \"sliding_attention\", \"sliding_attention\","
                 " \"sliding_attention\", \"sliding_attention\", \"sliding_attention\", \"full_attention\"]}", ATTN_OK, NULL);
  CHECK(c.sliding[0] && !c.sliding[1] && c.nope[1] && !c.nope[0] && c.nope[7], "exaone4: full layers without RoPE");
  parse(ctx, "{\"model_type\": \"exaone4\", " HF_SHAPE ", \"sliding_window\": 4096, \"sliding_window_pattern\": \"LLLG\"}",
        ATTN_E_FORMAT, "no layer_types");
  c = parse(ctx, "{\"model_type\": \"exaone4\", " HF_SHAPE ", \"sliding_window\": null}", ATTN_OK, NULL);
  CHECK(!c.nope[3], "exaone4 without a window: every layer rotates");
  c = parse(ctx, "{\"model_type\": \"olmo3\", " HF_SHAPE ", \"sliding_window\": 4096, \"rope_theta\": 5e5,"
                 " \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 8.0, \"original_max_position_embeddings\": 8192}}",
            ATTN_OK, NULL);
  CHECK(c.sliding[2] && !c.sliding[3] && c.rope_global.scaling == ATTN_ROPE_YARN &&
            c.rope_local.scaling == ATTN_ROPE_DEFAULT && c.rope_local.theta == 5e5 && !c.nope[2] && !c.nope[3],
        "olmo3: every 4th layer full; rope_scaling on the full layers only");
  c = parse(ctx, "{\"model_type\": \"qwen2_moe\", " HF_SHAPE ", \"sliding_window\": 32, \"use_sliding_window\": true,"
                 " \"max_window_layers\": 5}", ATTN_OK, NULL);
  CHECK(c.sliding[0] && !c.sliding[1] && c.sliding[4] && !c.sliding[6], "qwen2_moe: even layers below max_window_layers");
  c = parse(ctx, "{\"model_type\": \"dots1\", " HF_SHAPE ", \"sliding_window\": 32, \"max_window_layers\": 5}", ATTN_OK, NULL);
  CHECK(!c.sliding[4] && c.sliding[5], "dots1: layers from max_window_layers on");
  /* clip_qkv: read for OLMo and OLMoE (a key before model_type too), null as none anywhere */
  static const struct { const char *json; attn_status st; double clip; const char *needle; } clips[] = {
      {"{\"model_type\": \"olmo\", " HF_SHAPE ", \"clip_qkv\": null}", ATTN_OK, 0, NULL},
      {"{\"model_type\": \"olmo\", " HF_SHAPE ", \"clip_qkv\": 8.0}", ATTN_OK, 8, NULL},
      {"{" HF_SHAPE ", \"clip_qkv\": 0.5, \"model_type\": \"olmoe\"}", ATTN_OK, 0.5, NULL},
      {"{\"model_type\": \"llama\", " HF_SHAPE ", \"clip_qkv\": null}", ATTN_OK, 0, NULL},
      {"{\"model_type\": \"olmo\", " HF_SHAPE ", \"clip_qkv\": 0}", ATTN_E_FORMAT, 0, "clip_qkv must be"},
      {"{\"model_type\": \"olmo\", " HF_SHAPE ", \"clip_qkv\": -8}", ATTN_E_FORMAT, 0, "clip_qkv must be"},
      {"{\"model_type\": \"llama\", " HF_SHAPE ", \"clip_qkv\": 8.0}", ATTN_E_UNSUPPORTED, 0,
       "clip_qkv (a clamp of q, k and v outside OLMo"},
      {"{" HF_SHAPE ", \"clip_qkv\": 8.0, \"model_type\": \"olmo2\"}", ATTN_E_UNSUPPORTED, 0, "clip_qkv"}};
  for (size_t i = 0; i < sizeof clips / sizeof clips[0]; i++) {
    c = parse(ctx, clips[i].json, clips[i].st, clips[i].needle);
    CHECK(clips[i].st || c.clip_qkv == clips[i].clip, "%s: clip_qkv %g, want %g", clips[i].json, c.clip_qkv,
          clips[i].clip);
  }
  c = parse(ctx, "{\"model_type\": \"ministral3\", " HF_SHAPE ", \"llama_4_scaling_beta\": 0}", ATTN_OK, NULL);

  /* what libattn lacks: refused, naming the field */
  c = parse(ctx, "{\"model_type\": \"stablelm\", " HF_SHAPE ", \"qk_layernorm\": true}", ATTN_OK, NULL);
  CHECK(c.qk_norm == 1, "stablelm: qk_layernorm read");
  parse(ctx, "{" HF_SHAPE ", \"qk_layernorm\": true, \"model_type\": \"persimmon\"}", ATTN_E_UNSUPPORTED, "qk_layernorm");
  c = parse(ctx, "{" HF_SHAPE ", \"qk_layernorm\": true, \"model_type\": \"phi\"}", ATTN_OK, NULL);
  CHECK(c.qk_norm == 1 && c.rope_global.rotary_dim == 8, "phi: qk_layernorm read (a key before model_type), partial 0.5");
  c = parse(ctx, "{\"model_type\": \"stablelm\", " HF_SHAPE ", \"qk_layernorm\": false}", ATTN_OK, NULL);
  CHECK(c.qk_norm == 0, "stablelm: qk_layernorm false");
  c = parse(ctx, "{" HF_SHAPE ", \"use_qk_norm\": true, \"model_type\": \"cohere\"}", ATTN_OK, NULL);
  CHECK(c.qk_norm == 1, "cohere: use_qk_norm read");
  c = parse(ctx, "{\"model_type\": \"cohere\", " HF_SHAPE ", \"use_qk_norm\": false}", ATTN_OK, NULL);
  CHECK(c.qk_norm == 0, "cohere: use_qk_norm false");
  parse(ctx, "{" HF_SHAPE ", \"use_qk_norm\": true, \"model_type\": \"llama4_text\"}", ATTN_E_UNSUPPORTED, "Llama 4");
  parse(ctx, "{\"model_type\": \"deepseek_v3\", " HF_SHAPE ", \"kv_lora_rank\": 512}", ATTN_E_UNSUPPORTED, "latent");
  parse(ctx, "{\"model_type\": \"x\", " HF_SHAPE ", \"q_lora_rank\": 1536}", ATTN_E_UNSUPPORTED, "q_lora_rank");
  parse(ctx, "{\"model_type\": \"falcon_h1\", " HF_SHAPE "}", ATTN_E_UNSUPPORTED, "falcon_h1");
  parse(ctx, "{\"model_type\": \"x\", " HF_SHAPE ", \"key_multiplier\": 0.5}", ATTN_E_UNSUPPORTED, "key_multiplier");
  parse(ctx, "{\"model_type\": \"ministral3\", " HF_SHAPE ", \"llama_4_scaling_beta\": 0.1}", ATTN_E_UNSUPPORTED,
        "llama_4_scaling_beta");
  parse(ctx, "{\"model_type\": \"gemma3_text\", " HF_SHAPE ", \"use_bidirectional_attention\": true}",
        ATTN_E_UNSUPPORTED, "use_bidirectional_attention");
  static const char *const other[] = {"hunyuan_v1_dense", "bitnet", "doge", "qwen3_next", "jetmoe", "deepseek_v2"};
  for (size_t i = 0; i < sizeof other / sizeof other[0]; i++) {
    char json[200];
    snprintf(json, sizeof json, "{\"model_type\": \"%s\", " HF_SHAPE "}", other[i]);
    parse(ctx, json, ATTN_E_UNSUPPORTED, other[i]);
  }
#undef HF_SHAPE
  parse(ctx, "{\"model_type\": \"llama4_text\", \"hidden_size\": 64, \"num_attention_heads\": 4,"
             " \"use_qk_norm\": true}", ATTN_E_UNSUPPORTED, "use_qk_norm");
  parse(ctx, "{\"model_type\": \"llama4_text\", \"hidden_size\": 64, \"num_attention_heads\": 4,"
             " \"attn_temperature_tuning\": true}", ATTN_E_UNSUPPORTED, "attn_temperature_tuning");
  parse(ctx, "{\"model_type\": \"phimoe\", \"hidden_size\": 8, \"num_attention_heads\": 4, \"rope_scaling\": {\"type\":"
             " \"longrope\", \"short_factor\": [1.0], \"long_factor\": [2.0], \"short_mscale\": 1.2}}",
        ATTN_E_UNSUPPORTED, "short_mscale");
  parse(ctx, "{\"model_type\": \"bert\", \"hidden_size\": 64, \"num_attention_heads\": 4,"
             " \"position_embedding_type\": \"relative_key\"}", ATTN_E_UNSUPPORTED, "position_embedding_type");
  parse(ctx, "{\"model_type\": \"x\", \"hidden_size\": 64, \"num_attention_heads\": 4, \"num_hidden_layers\": 1,"
             " \"sliding_window\": 8, \"layer_types\": [\"chunked_attention\"]}", ATTN_E_UNSUPPORTED, "layer_types[0]");
  parse(ctx, "{\"model_type\": \"falcon\", \"hidden_size\": 64, \"num_attention_heads\": 4, \"alibi\": true}",
        ATTN_E_UNSUPPORTED, "alibi");
  parse(ctx, "{\"model_type\": \"x\", \"hidden_size\": 64, \"num_attention_heads\": 4, \"num_hidden_layers\": 5000}",
        ATTN_E_UNSUPPORTED, "layers");
  /* malformed or inconsistent */
  parse(ctx, "{\"hidden_size\": 64}", ATTN_E_FORMAT, "head count");
  parse(ctx, "{\"hidden_size\": 65, \"num_attention_heads\": 4}", ATTN_E_FORMAT, "divide");
  parse(ctx, "{\"hidden_size\": 64, \"num_attention_heads\": 4, \"num_key_value_heads\": 3}", ATTN_E_FORMAT, "kv heads");
  parse(ctx, "{\"hidden_size\": -64, \"num_attention_heads\": 4}", ATTN_E_FORMAT, "non-negative integer");
  parse(ctx, "{\"hidden_size\": 64.5, \"num_attention_heads\": 4}", ATTN_E_FORMAT, "non-negative integer");
  parse(ctx, "{\"hidden_size\": 64, \"num_attention_heads\": 4, \"partial_rotary_factor\": 0.35, \"rope_theta\": 1e4}",
        ATTN_E_FORMAT, "rotary dims");
  /* a factor past int64_t once multiplied by head_dim (found by fuzz_hf_config), and one over 1 */
  parse(ctx, "{\"hidden_size\": 64, \"num_attention_heads\": 4, \"partial_rotary_factor\": 8.8e50, \"rope_theta\": 1e4}", ATTN_E_FORMAT,
        "partial_rotary_factor");
  parse(ctx, "{\"hidden_size\": 64, \"num_attention_heads\": 4, \"rope_scaling\": {\"partial_rotary_factor\": 2}}",
        ATTN_E_FORMAT, "partial_rotary_factor");
  parse(ctx, "{\"hidden_size\": 64, \"num_attention_heads\": 4, \"rotary_pct\": -0.5, \"rope_theta\": 1e4}", ATTN_E_FORMAT,
        "partial_rotary_factor");
  parse(ctx, "{\"hidden_size\": 64, \"num_attention_heads\": 4} x", ATTN_E_FORMAT, "after the config");
  parse(ctx, "[1, 2]", ATTN_E_FORMAT, "not a JSON object");
  parse(ctx, "{\"hidden_size\": 64, \"num_attention_heads\": 4, \"model_type\": \"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"}",
        ATTN_E_FORMAT, "model_type");
  parse(ctx, "{\"hidden_size\": 64, \"num_attention_heads\": 4, \"x\": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["
             "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}",
        ATTN_E_FORMAT, "nesting");
  parse(ctx, "{\"hidden_size\": 64, \"num_attention_heads\": 4, \"x\": \"\\ud800\"}", ATTN_E_FORMAT, "surrogate");
  parse(ctx, "{\"hidden_size\": 64, \"num_attention_heads\": 4, \"rope_theta\": 1e999}", ATTN_E_FORMAT, "out of range");
  char nul[] = "{\"hidden_size\": 64, \"num_attention_heads\": 4}";
  CHECK(attn_hf_config_parse(ctx, &c, nul, 10, "cut") == ATTN_E_FORMAT, "a cut config is refused");
  /* files: a missing one, a directory */
  CHECK_ERR(ctx, attn_hf_config_read(ctx, &c, "/nonexistent/config.json"), ATTN_E_IO, "config.json");
  CHECK(attn_hf_config_read(ctx, &c, ".") != ATTN_OK, "a directory is refused");
  attn_ctx_destroy(ctx);
  return tu_finish("test_hf_config");
}
