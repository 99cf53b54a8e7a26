/* The AVX-512 fp32 tile set again, 16 query rows tall: the softmax (and the
 * rest of the set) under the AMX tiles, whose A operand is 16 rows, with the
 * shorter exponential their bf16-rounded probabilities allow (built with
 * -mavx512bf16 too: every CPU with AMX-BF16 has it). */
#define MR 16
#define NR 64
#define ATTN_TILE_SET attn__kernels_avx512_16
#define ATTN_TILE_SET_NAME "avx512 16x64"
#define ATTN_TILE_P_ROUNDED_TO_BF16
#define ATTN_SOFTMAX_ROUND attn__softmax_round_amx16 /* kernels.h's softmax_round for the AMX sets: bf16 */
#define ATTN_SOFTMAX_ROUND_F16 attn__softmax_round_amx16_f16 /* and f16 (two planes) */
#include "../avx512/attention.c"
