/* attn help and attn version: the tool describing itself. Every command's
 * usage lives here, so `attn help` lists them all in one place. */
#include "cli.h"
#include "commands.h"

#include <stdio.h>
#include <string.h>

/* One entry per command (bench: per operation); `attn help` prints them all,
 * `attn CMD --help` its own with the notes on outputs and exit codes. */
static const struct {
  const char *cmd, *op, *text;
} usages[] = {
    {"demo", NULL, "  attn demo                         the seed's layer on a built-in example\n"},
    {"sdpa", NULL,
     "  attn sdpa --q Q.npy --k K.npy --v V.npy --out O.npy\n"
     "            [--mask M.npy --mask-mode keep|masked|additive|seed] [--key-padding KP.npy]\n"
     "            [--causal | --causal=bottom-right] [--scale S] [--weights-out W.npy] [--threads N]\n"
     "            [--dropout P [--seed S]] [--window W] [--chunk C] [--softcap C] [--alibi] [--sinks S.npy]\n"
     "            [--kv-dtype f32|f16|bf16] [--precision default|fp32|bf16|f16]\n"
     "            [--cu-seqlens CU.npy [--cu-seqlens-k CUK.npy]] [--q-offset I --k-offset J]\n"
     "            [--grad-out G.npy [--dq-out DQ.npy] [--dk-out DK.npy] [--dv-out DV.npy] [--mask-grad-out DM.npy]\n"
     "             [--sinks-grad-out DS.npy]]\n"},
    {"mpi-sdpa", NULL,
     "  mpirun -np P attn mpi-sdpa --q Q.npy --k K.npy --v V.npy --out O.npy [--lse-out L.npy]\n"
     "            [--strategy ring|zigzag|ulysses|auto] [--causal] [--scale S] [--threads N] [--window W]\n"
     "            [--chunk C] [--softcap C] [--alibi] [--dropout P [--seed S]]\n"
     "            [--grad-out G.npy --dq-out DQ.npy --dk-out DK.npy --dv-out DV.npy]\n"
     "            attn sdpa over MPI ranks (libattn_mpi): each rank reads its shard of the whole-sequence\n"
     "            files, rank 0 writes the gathered results (needs a build with MPI)\n"},
    {"mha", NULL,
     "  attn mha  --params P.safetensors [--prefix PFX] --heads H [--kv-heads G] --query X.npy\n"
     "            [--key K.npy --value V.npy] --out O.npy [--mask M.npy --mask-mode ...]\n"
     "            [--key-padding KP.npy] [--causal] [--weights-out W.npy] [--average-weights] [--threads N]\n"
     "            [--precision default|fp32|bf16|f16]\n"
     "            [--dropout P [--seed S]] [--window W] [--chunk C] [--softcap C] [--alibi] [--sinks S.npy]\n"
     "            [--scale S] [--clip-qkv C (OLMo: q, k, v clamped to [-C, C])]\n"
     "            [--names q=T,k=T,v=T,o=T[,q_bias=T,...,k_norm=T] [--layout linear|conv1d]]\n"
     "            [--rope THETA [--rope-dim R] [--rope-interleaved] [--rope-scaling linear:F|dynamic:F:P|\n"
     "             llama3:F:LOW:HIGH:P|yarn:F:P|longrope:F:P:S1,...:L1,... (one short and one long\n"
     "             factor per rotary pair)]] [--positions P.npy]\n"
     "            [--grad-out G.npy --grads-out GRADS.safetensors]\n"
     "  attn mha  --hf-config config.json --params model.safetensors|model.safetensors.index.json --layer L\n"
     "            --query X.npy --out O.npy [--causal] [--positions P.npy] [--mask M.npy] [--threads N] ...\n"
     "            layer L of a Hugging Face model as saved: its prefix, heads, head_dim, QK-norm, clip_qkv,\n"
     "            window, chunk, softcap, scale and RoPE from the config (X: the layer's input after its norm, [B, N, E])\n"},
    {"map", NULL,
     "  attn map  --params P.safetensors --heads H --query X.npy [--key K.npy [--value V.npy]] --png OUT.png\n"
     "            [--tokens T.txt] [--key-tokens T.txt] [--batch I] [--causal] [--prefix PFX] [--kv-heads G]\n"
     "  attn map  --weights W.npy --png OUT.png [--tokens T.txt] [--key-tokens T.txt] [--batch I]\n"
     "            every head's attention weights as heatmaps in a PNG (one token per line in T.txt)\n"},
    {"bench", "sdpa",
     "  attn bench sdpa --batch B --heads H [--kv-heads G] --seq N [--kv-seq M] --dim D [--causal] [--window W]\n"
     "            [--padding F] [--backward] [--dtype f32|bf16|f16] [--precision P] [--threads T] [--repeat R]\n"
     "            [--kernel K] [--max-gflop F] [--json] [--chunk C]\n"
     "            (--padding F: the last fraction F of every row's keys is key padding, and holds NaN)\n"
     "  attn bench sdpa --lengths L1,L2,... --heads H [--kv-heads G] --dim D [--causal] [--padded] [--backward]\n"
     "            [--dtype f32|bf16|f16] [--precision P] [--threads T] [--repeat R] [--kernel K] [--max-gflop F]\n"
     "            [--json]\n"
     "            (a packed batch of those sequences (cu_seqlens), or --padded: padded to the longest with\n"
     "            key padding, the padding rows' gradient 0; GFLOP/s count the sequences' own flops either way)\n"},
    {"bench", "mha",
     "  attn bench mha --batch B --seq N --embed E --heads H [--threads T] [--repeat R] [--kernel K]\n"
     "            [--dtype f32|bf16|f16] [--precision default|fp32|bf16|f16] [--max-gflop F] [--json]\n"
     "            (--dtype: a model in that type: x and the parameters rounded to it; bf16 and f16\n"
     "            imply --precision bf16 or f16 unless given)\n"},
    {"bench", "decode",
     "  attn bench decode --batch B (--kv-seq L | --lengths L1,L2,...) --heads H [--kv-heads G] --dim D [--seq Nq]\n"
     "            [--dtype f32|f16|bf16|q8_0|q4_0] [--k-dtype DT] [--v-dtype DT] [--q-dtype f32|f16|bf16] [--cache]\n"
     "            [--paged BLOCK_TOKENS [--interleaved | --scatter]] [--compare] [--threads T] [--repeat R]\n"
     "            [--kernel K] [--max-gflop F] [--json]\n"
     "            (--cache, a block format, two dtypes or --lengths: the step is attn_kv_cache_attend on an\n"
     "            attn_kv_cache; --paged: attn_paged_kv_attend on an attn_paged_kv_cache of blocks of that many\n"
     "            tokens, each row filled by a prefill of its own, or with --interleaved all rows growing\n"
     "            together a block at a time, as in serving (the pool keeps each row's blocks in runs), or\n"
     "            with --scatter the same in a pool crowded by fillers, so that a row's blocks lie one apart;\n"
     "            --lengths: one length per row, the bytes read being their sum's; --q-dtype: the new tokens'\n"
     "            queries in that type, f32 unless given)\n"},
    {"version", NULL, "  attn version\n"},
    {"help", NULL, "  attn help [COMMAND]               this text, or one command's (as attn COMMAND --help)\n"},
};

static const char notes_data[] =
    "Arrays are .npy (float32; float64 is converted). q/k/v are [B, H, N, D]; mha inputs are [B, N, E].\n"
    "A bool mask means keep (sdpa) or masked (mha) unless --mask-mode says otherwise; a float mask is additive.\n"
    "--grad-out G gives the gradients of sum(out * G): sdpa writes the ones asked for (--mask-grad-out: an\n"
    "additive mask's, in the mask's shape); mha writes every parameter's under the file's own names (with\n"
    "the prefix) and the inputs' as query (key, value) into one safetensors file.\n"
    "--dropout P: training-mode dropout on the attention probabilities (seed S, default 0).\n"
    "--window W: query i' sees keys i'-W < j <= i' (causal implied); --chunk C: query i' sees keys j <= i' of\n"
    "its own chunk of C positions, j/C = i'/C (Llama 4; causal implied); --softcap C: logits C*tanh(logits/C);\n"
    "--alibi: the ALiBi paper's slopes per query head; --sinks S.npy: one sink logit per query head [H].\n"
    "--kv-dtype: k and v rounded to f16 or bf16 (and read stored so) before attention.\n"
    "--cu-seqlens CU.npy: a packed batch (int32/int64 [S+1] offsets: 0, ..., total): q/k/v are [1, H, total, D],\n"
    "  sequence s rows CU[s]..CU[s+1], its keys by --cu-seqlens-k (default CU); every option per sequence;\n"
    "  no --mask, --key-padding or --weights-out with it.\n"
    "--precision: attn.h's attn_precision. default: bf16 inputs as PyTorch computes them (bf16 products on\n"
    "  AVX512-BF16 or AMX, f16 ones on AMX), everything else fp32; fp32: every input widened; bf16: f32\n"
    "  inputs rounded to bf16 too; f16: f32 inputs rounded to f16 too.\n";
static const char notes_outputs[] =
    "Outputs are written to temporary files beside them and renamed into place only when every one was\n"
    "written: a failed command changes no existing file. An output may not name an input; a symbolic link\n"
    "as an output is followed (the file it points to is replaced, the link stays).\n"
    "Exit status: 0 done, 1 bad data or a failed run, 2 a bad command line; errors are one line on stderr.\n";
static const char notes_bench[] =
    "bench refuses a case whose timed runs would take more than --max-gflop F GFLOP (default 1e5, a few\n"
    "minutes on two cores); --max-gflop inf lifts the bound.\n";

/* Every entry of cmd (op NULL: all of its operations); 0 if there is none. */
static int print_usage(FILE *f, const char *cmd, const char *op) {
  int found = 0;
  for (size_t i = 0; i < sizeof usages / sizeof usages[0]; i++)
    if (!strcmp(usages[i].cmd, cmd) && (!op || !usages[i].op || !strcmp(usages[i].op, op))) {
      if (!found) fputs("usage:\n", f);
      fputs(usages[i].text, f);
      found = 1;
    }
  if (found && (!strcmp(cmd, "sdpa") || !strcmp(cmd, "mha"))) fputs(notes_data, f);
  if (found && (!strcmp(cmd, "sdpa") || !strcmp(cmd, "mha") || !strcmp(cmd, "map"))) fputs(notes_outputs, f);
  if (found && !strcmp(cmd, "bench")) fputs(notes_bench, f);
  return found;
}

static void usage(FILE *f) {
  fputs("usage: attn <command> [flags]     (attn <command> --help: that command alone)\n", f);
  for (size_t i = 0; i < sizeof usages / sizeof usages[0]; i++) fputs(usages[i].text, f);
  fputs(notes_data, f);
  fputs(notes_outputs, f);
  fputs(notes_bench, f);
}

int help_is_flag(const char *s) { return !strcmp(s, "--help") || !strcmp(s, "-h"); }

int cmd_help(int argc, char **argv) {
  if (argc < 1) {
    usage(stdout);
    return 0;
  }
  if (!print_usage(stdout, argv[0], argc > 1 ? argv[1] : NULL))
    return cli_fail(CLI_EXIT_USAGE, "help: no command '%s' (see 'attn help')", cli_show(argv[0]));
  return 0;
}

int help_printed(int argc, char **argv) {
  const char *cmd = argv[1];
  /* --help or -h anywhere after the command wins over every other flag */
  for (int i = 2; i < argc; i++)
    if (help_is_flag(argv[i])) {
      const char *op = !strcmp(cmd, "bench") && i > 2 ? argv[2] : NULL;
      return print_usage(stdout, cmd, op) || print_usage(stdout, cmd, NULL); /* an unknown command is refused later */
    }
  return 0;
}

int cmd_version(int argc, char **argv) {
  if (argc > 0) return cli_fail(CLI_EXIT_USAGE, "version takes no arguments, got '%s'", cli_show(argv[0]));
  printf("attn %s (kernel: %s)\n", attn_version_string(), attn_kernel_name(attn_ctx_kernel(NULL)));
  return 0;
}
