/* The AVX-512 fp32 tile set again (6 x 64), for the AVX512-BF16 tiles' forward
 * (attention_bf16.c), whose probabilities are rounded to bf16 for p.v: the
 * softmax that writes the rounded P itself (kernels.h's softmax_round), with
 * the scale deferred to it and a lazy maximum, as amx/tiles16.c has for the AMX tiles. */
#define MR 6
#define NR 64
#define ATTN_TILE_SET attn__kernels_avx512_6p
#define ATTN_TILE_SET_NAME "avx512 6x64 (P rounded to bf16)"
#define ATTN_TILE_P_ROUNDED_TO_BF16
/* but the full exponential: the shorter one's 1e-7 turned a bf16 rounding of P in test_half's emulation
 * of the policy (D 1, 56 keys) */
#define ATTN_TILE_FULL_EXP
#define ATTN_SOFTMAX_ROUND attn__softmax_round_avx512bf16 /* kernels.h's softmax_round for the 6-row bf16 tiles */
#include "attention.c"
