/* Internal to the multi-head attention layer: what the forward (mha.c) and the
 * backward (mha_backward.c) share. Prefix attn__. */
#ifndef ATTN_LAYER_MHA_INTERNAL_H
#define ATTN_LAYER_MHA_INTERNAL_H

#include "../internal.h"
#include "../opts.h"

/* The projections' parameters: Q_WEIGHT .. O_BIAS, before QK-norm's (loops
 * over every parameter run to ATTN_MHA_NUM_PARAMS and skip the absent ones). */
#define ATTN__MHA_PROJ_PARAMS (ATTN_MHA_O_BIAS + 1)

struct attn_mha {
  attn_mha_config cfg;
  int64_t head_dim, q_dim, kv_dim; /* D (cfg.head_dim, or E / H); q_dim = H * D; kv_dim = Hk * D */
  float *param[ATTN_MHA_NUM_PARAMS]; /* views into store */
  float *store;
  int64_t rows[ATTN_MHA_NUM_PARAMS], cols[ATTN_MHA_NUM_PARAMS]; /* cols 0: a vector */
  attn_tensor sinks; /* f32 [H] over param[ATTN_MHA_SINKS], the attention's sinks (cfg.sinks) */
};

/* The length of the list of buffers attn__mha_forward hands to the saved
 * state (14 activations and copies of the inputs, then the copies of the
 * attention options' tensors), which a static assertion there ties to this. */
#define ATTN__MHA_SAVED_BUFS (14 + ATTN__SDPA_OPT_TENSORS)

/* What attn_mha_forward_save keeps for attn_mha_backward. Every buffer is
 * contiguous and owned; its element type is double when `ref` (the forward ran
 * with ATTN_KERNEL_REF) and float otherwise. M = B * Nq and Mk = B * Nk rows. */
struct attn_mha_saved {
  attn_mha_config cfg;   /* of the layer that made it (kv heads, kdim, vdim resolved) */
  int ref;
  int self;              /* key and value were NULL: dquery gets the whole input gradient */
  int64_t B, Nq, Nk;
  const void *xq, *xk, *xv; /* copies of the inputs' rows [M, E], [Mk, kdim], [Mk, vdim]; may share a buffer */
  const void *q, *k, *v;    /* projections [M, H*D], [Mk, Hk*D], [Mk, Hk*D], rows ldq / ldkv apart;
                               q and k after QK-norm and RoPE */
  int64_t ldq, ldkv;
  const void *qx, *kx;      /* with QK-norm: q [M, H*D] and k [Mk, Hk*D] before it (contiguous); else NULL */
  const uint8_t *clipped;   /* with clip_qkv: attn__mha_clip's mask of q, k and v (1: the gradient passes); else NULL */
  const void *a;            /* [M, H*D]: the attention output before the out projection (SDPA's out) */
  const void *lse;          /* [B, H, Nq]: SDPA's log-sum-exp */
  /* The forward's attention options. Their tensors point at opt_copy, views
   * of the saved state's own compact copies (a dimension the caller broadcast
   * stays broadcast, not expanded): the caller's buffers may go once the
   * forward returns. */
  attn_sdpa_opts attn;
  attn_tensor opt_copy[ATTN__SDPA_OPT_TENSORS];
  int has_rope;             /* q and k were rotated: rope, with the positions in rope_pos (owned, or NULL) */
  attn_rope_opts rope;
  int64_t *rope_pos;
  int64_t *cu_seqlens;      /* a packed batch's offsets, owned: q's then (cu_seqlens_k given) k's; or NULL */
  void *owned[ATTN__MHA_SAVED_BUFS];
  int n_owned;
};

/* Rotates (transpose: the backward's transposed rotation) the heads [B, H, N, D]
 * and [B, Hk, Nk, D] of q and k in place, in the path's type (double when ref). */
attn_status attn__mha_rope(attn_ctx *ctx, const attn_rope_opts *rope, const int64_t *positions, int transpose, int ref,
                           attn_tensor *qh, attn_tensor *kh);

/* QK-norm's view of q or k rows [B, N, ld] (heads of D features in the first
 * heads*D columns; double when ref): [B, heads, N, D] per head, or
 * [B, 1, N, heads*D] over the whole projection. */
attn_tensor attn__mha_norm_view(const attn_mha *mha, void *data, int ref, int64_t B, int64_t N, int64_t heads,
                                int64_t ld);
/* An f32 view of the layer's parameter which (present): [rows], or [rows, cols]. */
attn_tensor attn__mha_param(const attn_mha *mha, int which);
/* Its number of floats. */
static inline int64_t attn__mha_param_numel(const attn_mha *mha, int which) {
  return mha->rows[which] * (mha->cols[which] ? mha->cols[which] : 1);
}
/* clip_qkv in place on q rows Q [M, H*D] (ldq apart), k rows K and v rows V [Mk, Hk*D] (ldkv apart),
 * in the path's type (double when ref): each value outside [-c, c] set to the bound it passed, NaN
 * kept. mask (or NULL): M H*D bytes for q, then Mk Hk*D for k and as many for v, 1 where the value
 * lay within the bounds (torch.clamp's gradient passes), 0 elsewhere. The layer must have clip_qkv. */
void attn__mha_clip(const attn_mha *mha, int ref, void *Q, int64_t ldq, void *K, void *V, int64_t ldkv, int64_t M,
                    int64_t Mk, uint8_t *mask);
/* QK-norm in place on q rows Q [B, Nq, ldq] (H heads) and k rows K [B, Nk, ldk]
 * (Hk heads), in the path's type (double when ref). The layer must have qk_norm. */
attn_status attn__mha_qk_norm(attn_ctx *ctx, const attn_mha *mha, int ref, void *Q, int64_t ldq, void *K, int64_t ldk,
                              int64_t B, int64_t Nq, int64_t Nk);

/* attn_mha_forward's body. saved NULL: a plain forward. Otherwise *saved gets
 * a new attn_mha_saved on success (NULL on failure). Does not clear ctx. */
attn_status attn__mha_forward(attn_ctx *ctx, attn_mha *mha, attn_tensor *out, attn_tensor *weights,
                              attn_mha_saved **saved, const attn_tensor *query, const attn_tensor *key,
                              const attn_tensor *value, const attn_mha_opts *opts);

/* A caller's attn_mha_opts (NULL: the defaults) into *dst, each of its two
 * sizes honoured as attn__read_sized does (opts.h); a layer with learned sinks
 * puts them in dst->attn.sinks (the caller's own are refused). */
attn_status attn__read_mha_opts(attn_ctx *ctx, attn_mha_opts *dst, const attn_mha_opts *opts, const attn_mha *mha);

/* The projections the forward and the cached step share (fp32, or bf16
 * products under ATTN_PRECISION_BF16: attn__project_nt):
 * QKV [M, H D + 2 Hk D] (Q, K, V side by side) = X [M, E] . [Wq; Wk; Wv]^T + [bq; bk; bv]. */
void attn__mha_qkv(const attn_ctx *ctx, void *QKV, const float *X, const attn_mha *mha, int64_t M);
/* out [B, N, E] (f32, any strides) = A [B*N, H*D] . Wo^T + bo; the rows go
 * through scratch ([B*N, E] floats at least; NULL: allocated) unless out is contiguous. */
attn_status attn__mha_out(attn_ctx *ctx, attn_tensor *out, const float *A, const attn_mha *mha,
                          int64_t B, int64_t N, void *scratch);

/* [B, N, ld] rows (the first H*D columns) viewed as [B, H, N, D]. */
static inline attn_tensor attn__heads_view(void *data, attn_dtype dt, int64_t B, int64_t N, int64_t H, int64_t D,
                                           int64_t ld) {
  attn_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dt;
  t.rank = 4;
  t.shape[0] = B; t.shape[1] = H; t.shape[2] = N; t.shape[3] = D;
  t.strides[0] = N * ld; t.strides[1] = D; t.strides[2] = ld; t.strides[3] = 1;
  return t;
}

#endif
