/* attn: the command line tool. Its flags are a contract that scripts rely on.
 *
 *   attn sdpa ...                     (tools/sdpa.c)
 *   attn mpi-sdpa ...                 (tools/mpi_sdpa.c, under mpirun)
 *   attn mha ...                      (tools/mha.c)
 *   attn map ...                      (tools/map.c)
 *   attn bench sdpa|mha|decode ...    (tools/bench/)
 *   attn demo                         (tools/demo.c)
 *   attn version, attn help [COMMAND], attn COMMAND --help   (tools/help.c)
 *
 * Errors: one line on stderr, exit 1 (bad data) or 2 (bad command line). The
 * outputs are staged (tools/outputs.c): a failed command changes no file it
 * did not create.
 *
 * Layers, each calling only the ones below it: this file (dispatch); one file
 * per command and per bench operation; tools/bench/common.c; tools/outputs.c;
 * tools/cli.c; the library. */
#include "cli.h"
#include "commands.h"

#include <string.h>

typedef int (*command_fn)(int argc, char **argv);

static int bench(int argc, char **argv) {
  static const struct { const char *name; command_fn run; } ops[] = {
      {"sdpa", cmd_bench_sdpa}, {"mha", cmd_bench_mha}, {"decode", cmd_bench_decode}};
  if (argc < 1)
    return cli_fail(CLI_EXIT_USAGE, "bench needs an operation: 'attn bench sdpa ...', 'attn bench mha ...' or 'attn bench decode ...'");
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
    if (!strcmp(argv[0], ops[i].name)) return ops[i].run(argc - 1, argv + 1);
  return cli_fail(CLI_EXIT_USAGE, "bench: unknown operation '%s'; want sdpa, mha or decode", cli_show(argv[0]));
}

int attn_cli_main(int argc, char **argv) {
  static const struct { const char *name; command_fn run; } commands[] = {
      {"sdpa", cmd_sdpa}, {"mha", cmd_mha},         {"demo", cmd_demo},          {"bench", bench},
      {"map", cmd_map},   {"version", cmd_version}, {"--version", cmd_version}, {"mpi-sdpa", cmd_mpi_sdpa}};
  if (argc < 2) return cli_fail(CLI_EXIT_USAGE, "no command given (see 'attn help')");
  const char *cmd = argv[1];
  if (!strcmp(cmd, "help") || help_is_flag(cmd)) return cmd_help(argc - 2, argv + 2);
  if (help_printed(argc, argv)) return 0;
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (!strcmp(cmd, commands[i].name)) return commands[i].run(argc - 2, argv + 2);
  return cli_fail(CLI_EXIT_USAGE, "unknown command '%s' (see 'attn help')", cli_show(cmd));
}

/* The fuzz harness links the rest of this file and brings its own main. */
#ifndef ATTN_CLI_NO_MAIN
int main(int argc, char **argv) { return attn_cli_main(argc, argv); }
#endif
