/* The AVX-512 fp32 tile set again, 16 query rows tall: the softmax (and the
 * rest of the set) under the AMX tiles, whose A operand is 16 rows, with the
 * shorter exponential their bf16-rounded probabilities allow. */
#define MR 16
#define NR 64
#define ATTN_TILE_SET attn__kernels_avx512_16
#define ATTN_TILE_SET_NAME "avx512 16x64"
#define ATTN_TILES_ONLY
#define ATTN_TILE_P_ROUNDED_TO_BF16
#include "../avx512/attention.c"
