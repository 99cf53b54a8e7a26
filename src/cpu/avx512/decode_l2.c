/* The AVX-512 decode microkernels of decode.c again, their read-ahead asked
 * into L2 (_MM_HINT_T1) rather than L1: dispatch.c takes these on Intel CPUs
 * and AMD's before Zen 5 (cpu.c; BENCHMARKS.md, "Read-ahead into L2 on Intel"). */
#define DEC_PF_HINT _MM_HINT_T1
#define ATTN_DECODE_SET attn__decode_kernels_avx512_l2
#include "decode.c"
