/* The commands of the attn tool, one file each; tools/main.c dispatches to them.
 * Each takes the arguments after its name and returns the exit code. */
#ifndef ATTN_COMMANDS_H
#define ATTN_COMMANDS_H

int cmd_sdpa(int argc, char **argv);         /* tools/sdpa.c */
int cmd_mpi_sdpa(int argc, char **argv);     /* tools/mpi_sdpa.c */
int cmd_mha(int argc, char **argv);          /* tools/mha.c */
int cmd_map(int argc, char **argv);          /* tools/map.c */
int cmd_demo(int argc, char **argv);         /* tools/demo.c */
int cmd_bench_sdpa(int argc, char **argv);   /* tools/bench/sdpa.c */
int cmd_bench_mha(int argc, char **argv);    /* tools/bench/mha.c */
int cmd_bench_decode(int argc, char **argv); /* tools/bench/decode.c */

/* tools/help.c */
int cmd_help(int argc, char **argv);
int cmd_version(int argc, char **argv);
int help_is_flag(const char *s); /* --help or -h */
/* 1 after printing the usage of argv[1] (and its operation, for bench) when
 * --help or -h follows it; 0 when not asked or argv[1] is no command. */
int help_printed(int argc, char **argv);

#endif
