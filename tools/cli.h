/* Shared pieces of the attn command line tool. */
#ifndef ATTN_CLI_H
#define ATTN_CLI_H

#include "attn.h"

#include <stdint.h>

/* Exit codes: scripts tell a bad command line from a failed run. */
#define CLI_EXIT_FAIL 1  /* bad input data, unreadable file, failed computation */
#define CLI_EXIT_USAGE 2 /* unknown flag, missing or malformed value */

/* Parsed flags: each --name value or --name=value, plus bare switches. */
#define CLI_MAX_FLAGS 32
typedef struct cli_args {
  int n;
  char name[CLI_MAX_FLAGS][64];
  const char *value[CLI_MAX_FLAGS]; /* NULL for a switch */
} cli_args;

/* Prints "attn: message" on stderr and returns code. */
int cli_fail(int code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* switches: the flags that take no value. Returns 0, or an exit code after printing. */
int cli_parse(cli_args *a, int argc, char **argv, const char *const *known, const char *const *switches);
const char *cli_get(cli_args *a, const char *name);
int cli_has(cli_args *a, const char *name);
/* Parses an integer flag in [lo, hi]; 0 or an exit code. */
int cli_int(cli_args *a, const char *name, long long lo, long long hi, long long *out);
int cli_double(cli_args *a, const char *name, double *out);
/* Parses an unsigned 64-bit decimal integer flag (no sign); 0 or an exit code. */
int cli_u64(cli_args *a, const char *name, uint64_t *out);

double cli_now(void);

int cmd_demo(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_map(int argc, char **argv); /* tools/map.c */

#endif
