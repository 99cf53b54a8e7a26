/* The attn executable: all of it is attn_cli_main (tools/attn.c), which the fuzz harness also calls. */
#include "cli.h"

int main(int argc, char **argv) { return attn_cli_main(argc, argv); }
