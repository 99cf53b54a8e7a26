/* libattn_mpi: sequence-parallel attention over MPI (an optional component,
 * built when CMake finds MPI; the core library stays MPI-free).
 *
 * The P ranks of a communicator each hold a shard of one sequence of N tokens
 * (dim 2) and get their shard of the result, equal to attn_sdpa (and
 * attn_sdpa_backward) on the whole sequence within rounding: the partials are
 * merged in fp32 by their log-sum-exp in an order that differs from one
 * process's, so the figures agree to about 1e-6 (relative L2), not bitwise.
 *
 *   q [B, Hq, n, D], k [B, Hk, n, D], v [B, Hk, n, Dv]   this rank's n tokens
 *   out [B, Hq, n, Dv], lse f32 [B, Hq, n] (or NULL)
 * Self-attention: q and k hold the same tokens. Any float dtype in (f32, f16,
 * bf16; the partials are fp32 whatever it is), any strides.
 *
 * Which tokens a rank holds (its shard):
 *   RING, ULYSSES, AUTO: contiguous shards in rank order, of any sizes (they
 *     may differ, or be 0): rank r holds tokens [o_r, o_r + n_r), o_r the sum
 *     of the lower ranks' n.
 *   ZIGZAG: the sequence cut into 2P chunks (N / 2P tokens, the first
 *     N % 2P chunks one more); rank r holds chunks r and 2P - 1 - r, in that
 *     order, so that every rank has as much causal work.
 *     attn_mpi_zigzag_range says where they lie.
 *
 * Strategies:
 *   RING     K and V blocks pass around the ring (rank r sends to r + 1),
 *            the next block's transfer posted before the current block is
 *            computed, so it hides behind that computation when the link is
 *            fast enough. Causal blocks wholly in a shard's future are skipped.
 *            Backward: dK and dV travel behind their block and reach its owner
 *            after a full turn; each rank's sum moves on during its next
 *            step's computation, so only the last hand-over is waited for.
 *   ZIGZAG   RING on the zigzag layout.
 *   ULYSSES  two all-to-alls trade the sequence shards for head shards
 *            (Hk must divide by P), each rank attends over the whole
 *            sequence for Hq / P heads (head_offset set for dropout), and
 *            trades back.
 *   AUTO     ULYSSES where it applies (Hk % P == 0), else RING.
 *            The layout decides between ZIGZAG and the others, so AUTO never
 *            picks ZIGZAG.
 *
 * Options (attn_sdpa_opts), with positions counted over the whole sequence:
 * causal (TOP_LEFT and BOTTOM_RIGHT agree, as Nq = Nk), window, chunk, softcap,
 * ALiBi, sinks, key padding (each rank passes the [B, n] shard for its own
 * tokens), dropout (entry (b, h, i, j) at global positions and heads, so the
 * result is the single process's). Refused (ATTN_E_UNSUPPORTED): a mask
 * tensor, a packed batch (cu_seqlens); q_offset, k_offset and head_offset are
 * set here (ATTN_E_INVALID unless 0).
 *
 * Collective: every rank of comm calls with the same strategy, dtypes, head
 * counts and options. Arguments are checked on every rank before any data
 * moves, and a refusal on any rank is returned on every rank, with that
 * rank's message ("rank 2: ..."), never a hang. The ctx of each rank is its
 * own (threads, kernel); MPI must be initialised (any thread level: only the
 * calling thread uses MPI). */
#ifndef ATTN_MPI_H
#define ATTN_MPI_H

#include "attn.h"

#include <mpi.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum attn_mpi_strategy {
  ATTN_MPI_AUTO = 0,
  ATTN_MPI_RING = 1,
  ATTN_MPI_ZIGZAG = 2,
  ATTN_MPI_ULYSSES = 3
} attn_mpi_strategy;

ATTN_API const char *attn_mpi_strategy_name(attn_mpi_strategy strategy);

/* The strategy AUTO runs for these head counts, ranks and options. */
ATTN_API attn_mpi_strategy attn_mpi_auto_strategy(int64_t kv_heads, int ranks, const attn_sdpa_opts *opts);

/* ZIGZAG's shard of rank r of P over N tokens: tokens [range[0], range[1])
 * then [range[2], range[3]]; its size is range[1] - range[0] + range[3] - range[2]. */
ATTN_API attn_status attn_mpi_zigzag_range(int64_t N, int P, int r, int64_t range[4]);

/* The shard of rank r of P over N tokens that the CLI and the benchmarks use, in the same form:
 * ZIGZAG's two chunks (attn_mpi_zigzag_range); else the even contiguous split, N / P tokens
 * each and the first N % P ranks one more ([range[0], range[1]), range[2] = range[3] = range[1]).
 * AUTO is taken as RING or ULYSSES, whose layout it is. */
ATTN_API attn_status attn_mpi_shard_range(attn_mpi_strategy strategy, int64_t N, int P, int r, int64_t range[4]);

/* Sharding and unsharding a whole sequence held by one process (no communication):
 *   whole [B, H, N, F] (or [B, H, N]), shard [B, H, n_r, F] (or [B, H, n_r]): dim 2 the tokens
 * attn_mpi_shard copies rank r's tokens of whole (attn_mpi_shard_range's, in that order: ZIGZAG's
 * two chunks one after the other) into shard; attn_mpi_unshard writes them back to their places
 * in whole, touching nothing else. Any dtypes and strides (converted as attn_tensor_copy does). */
ATTN_API attn_status attn_mpi_shard(attn_ctx *ctx, attn_tensor *shard, const attn_tensor *whole,
                                    attn_mpi_strategy strategy, int P, int r);
ATTN_API attn_status attn_mpi_unshard(attn_ctx *ctx, attn_tensor *whole, const attn_tensor *shard,
                                      attn_mpi_strategy strategy, int P, int r);

/* This rank's out (and lse) of attention over the whole sequence. */
ATTN_API attn_status attn_mpi_sdpa(attn_ctx *ctx, MPI_Comm comm, attn_mpi_strategy strategy, attn_tensor *out,
                                   attn_tensor *lse, const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                                   const attn_sdpa_opts *opts);

/* This rank's dq, dk, dv (shapes of q, k, v; any float dtype) from its dout,
 * q, k, v and the out and lse attn_mpi_sdpa gave it (lse is required).
 * sinks_grad (f32 [Hq], or NULL): the sinks' gradient summed over every rank,
 * the same on each. */
ATTN_API attn_status attn_mpi_sdpa_backward(attn_ctx *ctx, MPI_Comm comm, attn_mpi_strategy strategy, attn_tensor *dq,
                                            attn_tensor *dk, attn_tensor *dv, attn_tensor *sinks_grad,
                                            const attn_tensor *dout, const attn_tensor *q, const attn_tensor *k,
                                            const attn_tensor *v, const attn_tensor *out, const attn_tensor *lse,
                                            const attn_sdpa_opts *opts);

#ifdef __cplusplus
}
#endif

#endif
