/* The attn command line tool's shared helpers (tools/cli.c, tools/outputs.c):
 * what every command uses, and nothing that calls a command. */
#ifndef ATTN_CLI_H
#define ATTN_CLI_H

#include "attn.h"

#include <stdint.h>

/* Exit codes: scripts tell a bad command line from a failed run. */
#define CLI_EXIT_FAIL 1  /* bad input data, unreadable file, failed computation */
#define CLI_EXIT_USAGE 2 /* unknown flag, missing or malformed value */

/* The whole tool: what main() runs (tools/main.c), callable again and again
 * (the fuzz harness does). Returns the exit code. */
int attn_cli_main(int argc, char **argv);

/* Parsed flags: each --name value or --name=value, plus bare switches. */
#define CLI_MAX_FLAGS 32
typedef struct cli_args {
  int n;
  char name[CLI_MAX_FLAGS][64];
  const char *value[CLI_MAX_FLAGS]; /* NULL for a switch */
} cli_args;

/* Prints "attn: message" on stderr as one line (control characters and
 * non-ASCII bytes escaped, whatever the arguments hold) and returns code. */
int cli_fail(int code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* A user-supplied string as an error message shows it: cut to CLI_SHOW_MAX
 * bytes with "..." (cli_fail escapes the rest). Valid until four more calls. */
#define CLI_SHOW_MAX 160
const char *cli_show(const char *s);

/* switches: the flags that take no value. Returns 0, or an exit code after printing. */
int cli_parse(cli_args *a, int argc, char **argv, const char *const *known, const char *const *switches);
const char *cli_get(cli_args *a, const char *name);
int cli_has(cli_args *a, const char *name);
/* Parses an integer flag in [lo, hi]; 0 or an exit code. */
int cli_int(cli_args *a, const char *name, long long lo, long long hi, long long *out);
/* Parses a number; one that underflows (a subnormal, or to 0) is taken, one
 * that overflows is refused. 0 or an exit code. */
int cli_double(cli_args *a, const char *name, double *out);
/* Parses an unsigned 64-bit decimal integer flag (no sign); 0 or an exit code. */
int cli_u64(cli_args *a, const char *name, uint64_t *out);

double cli_now(void);

/* ---- arrays and the options several commands share (tools/cli.c) ---------------
 * Each returns 0, or an exit code after printing the error. */
/* Loads an .npy file; float64 becomes float32 when to_f32 (other dtypes are then refused). */
int cli_load_array(attn_ctx *ctx, attn_tensor *t, const char *path, const char *flag, int to_f32);
/* layout names the dimensions in the message, e.g. "[B, H, N, D]". */
int cli_want_rank(const attn_tensor *t, int rank, const char *flag, const char *layout);
int cli_alloc_f32(attn_ctx *ctx, attn_tensor *t, int rank, const int64_t *shape);
/* A context with --threads applied (0 or absent: OpenMP's default). */
/* attn_precision by its name (attn_precision_name), or -1 after the usage message on stderr. */
int cli_precision(const char *name);
int cli_setup_ctx(attn_ctx **ctx, cli_args *a);
int cli_parse_mask_mode(const char *s, attn_mask_mode *mode);
/* --causal (top-left), --causal=top-left or --causal=bottom-right; none when absent. */
int cli_parse_causal(cli_args *a, attn_causal *c);
/* --dropout P (in [0, 1]) and --seed S (needs --dropout; default 0). */
int cli_parse_dropout(cli_args *a, double *p, uint64_t *seed);
/* The mask mode: --mask-mode if given, else bool_default for a bool or u8 mask, additive for a float one. */
int cli_mask_mode_for(cli_args *a, const attn_tensor *mask, attn_mask_mode bool_default, attn_mask_mode *mode);
/* --window W, --chunk C (>= 0, 0 = off) and --softcap C (finite, >= 0, 0 = off): checked before any file is read. */
int cli_parse_band_softcap(cli_args *a, int64_t *window, int64_t *chunk, double *softcap);
/* RoPE from --rope THETA [--rope-dim R] [--rope-interleaved] [--rope-scaling linear:F | dynamic:F:P |
 * llama3:F:LOW:HIGH:P | yarn:F:P] (P: the pretraining context); *on 0 when --rope is absent (and the
 * others are then refused). Checked before any file is read. */
int cli_parse_rope(cli_args *a, attn_rope_opts *o, int *on);
/* --positions P.npy: integer positions (int32/int64, or integral floats) >= 0, [B, N] or [N] (the
 * same for every row), into a new [B, N] array *pos (free it). */
int cli_load_positions(attn_ctx *ctx, cli_args *a, int64_t B, int64_t N, int64_t **pos);
/* --alibi: the paper's slopes for heads query heads; --sinks S.npy: f32 [heads] (the call checks the length). */
/* A packed batch's offsets from flag's .npy (rank 1, integers >= 0: the reader gives int32 and int64
 * arrays as exact f64): *cu (malloc'd, *n entries). The library checks their order and ends. */
int cli_load_offsets(attn_ctx *ctx, cli_args *a, const char *flag, int64_t **cu, int64_t *n);
int cli_load_head_options(attn_ctx *ctx, cli_args *a, int64_t heads, attn_tensor *slopes, attn_tensor *sinks);

/* ---- output files (tools/outputs.c) ----------------------------------------------
 * Every output of a command is written to a temporary file next to its target,
 * and the temporaries are renamed over their targets only after all of them
 * were written, so a failed command leaves each pre-existing file as it was and
 * no temporary behind. A target that is a symbolic link is followed: the file
 * it points to is replaced and the link stays. */
#define CLI_MAX_OUTPUTS 8
typedef struct cli_outputs {
  int n;
  struct {
    const char *flag, *path; /* as given */
    char *target;            /* path with its symbolic links followed: what the rename replaces */
    char *tmp;               /* the staged temporary, once there is one */
  } o[CLI_MAX_OUTPUTS];
} cli_outputs;

/* Before anything runs: every flag of outputs that is given must name a new
 * or regular file in an existing directory, no two the same file, and none a
 * file named by a flag of inputs. 0 or an exit code (after printing); either
 * way cli_outputs_free(o) afterwards. */
int cli_outputs_plan(cli_outputs *o, cli_args *a, const char *const *outputs, const char *const *inputs);
/* A fresh temporary for the output of flag (planned), to be written by the
 * caller; NULL after printing an error. */
const char *cli_outputs_stage(cli_outputs *o, const char *flag);
/* Renames every staged temporary over its target, in plan order. 0 or an exit code. */
int cli_outputs_commit(cli_outputs *o);
/* Removes the temporaries not committed, and frees what plan allocated. */
void cli_outputs_free(cli_outputs *o);
/* t as .npy, or count tensors as safetensors, into a staged temporary for flag's output. 0 or an exit code. */
int cli_write_npy(attn_ctx *ctx, cli_outputs *o, const char *flag, const attn_tensor *t);
int cli_write_safetensors(attn_ctx *ctx, cli_outputs *o, const char *flag, int64_t count, const char *const *names,
                          const attn_tensor *t);


#endif
