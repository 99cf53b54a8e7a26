/* The AVX-512 decode microkernels of decode.c again, for Zen 4 (cpu.c:
 * AMD family 25): read-ahead into L2 as decode_l2.c, a KV cache's key
 * blocks widened whole for up to 8 query rows rather than 4 (q8_0 steps of
 * 5-8 rows 4-6% and q4_0 8-22% faster there), and f32 rows asked for into
 * L1 too, 4 rows ahead (one thread's f32 step 0.89x; BENCHMARKS.md). */
#define DEC_PF_HINT _MM_HINT_T1
#define DEC_QK_BLOCK_ROWS 8
#define DEC_PF_NEAR_ROWS 4
#define ATTN_DECODE_SET attn__decode_kernels_avx512_l2_blocks8
#include "decode.c"
