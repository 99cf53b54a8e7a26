/* Sequence-parallel attention over MPI (attn_mpi.h), on libattn's public API
 * only: each piece of work is an attn_sdpa (or attn_sdpa_backward) call on one
 * segment of this rank's queries against one segment of a key block, with
 * q_offset and k_offset set to the segments' global positions, so that every
 * option (causal bound, window, ALiBi, dropout) is the whole sequence's.
 *
 * A shard is one or two segments of consecutive tokens (RING: one; ZIGZAG:
 * chunks r and 2P - 1 - r). The ring moves one block per step: the owner's
 * K, V and key padding packed contiguous (and, backward, its dK and dV
 * accumulators in fp32), in a buffer sized for the largest shard. Partial
 * outputs are merged in fp32 by their log-sum-exp; the sinks join once, at the
 * end (a sink per partial would count it P times). */
#include "attn_mpi.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MSG_LEN 512

typedef struct segment {
  int64_t global, local, rows; /* tokens [global, global + rows) at local rows [local, local + rows) */
} segment;

typedef struct shard {
  int nseg;
  segment seg[2];
  int64_t rows;
} shard;

/* What every rank must agree on, and each rank's shard. */
typedef struct plan {
  int P, rank;
  attn_mpi_strategy strategy;
  int64_t B, Hq, Hk, D, Dv, N, max_rows;
  attn_dtype qt, kt, vt;
  int64_t *counts; /* [P] tokens per rank */
  shard *shards;   /* [P] */
} plan;

const char *attn_mpi_strategy_name(attn_mpi_strategy s) {
  switch (s) {
    case ATTN_MPI_AUTO: return "auto";
    case ATTN_MPI_RING: return "ring";
    case ATTN_MPI_ZIGZAG: return "zigzag";
    case ATTN_MPI_ULYSSES: return "ulysses";
  }
  return "unknown";
}

attn_mpi_strategy attn_mpi_auto_strategy(int64_t kv_heads, int ranks, const attn_sdpa_opts *opts) {
  (void)opts; /* every option is taken by both */
  return ranks > 0 && kv_heads > 0 && kv_heads % ranks == 0 ? ATTN_MPI_ULYSSES : ATTN_MPI_RING;
}

static int64_t chunk_size(int64_t N, int P, int64_t c) { return N / (2 * P) + (c < N % (2 * P)); }
static int64_t chunk_start(int64_t N, int P, int64_t c) {
  const int64_t base = N / (2 * P), extra = N % (2 * P);
  return c * base + (c < extra ? c : extra);
}

attn_status attn_mpi_zigzag_range(int64_t N, int P, int r, int64_t range[4]) {
  if (!range || N < 0 || P < 1 || r < 0 || r >= P) return ATTN_E_INVALID;
  const int64_t c0 = r, c1 = 2 * (int64_t)P - 1 - r;
  range[0] = chunk_start(N, P, c0), range[1] = range[0] + chunk_size(N, P, c0);
  range[2] = chunk_start(N, P, c1), range[3] = range[2] + chunk_size(N, P, c1);
  return ATTN_OK;
}

attn_status attn_mpi_shard_range(attn_mpi_strategy strategy, int64_t N, int P, int r, int64_t range[4]) {
  if (strategy == ATTN_MPI_ZIGZAG) return attn_mpi_zigzag_range(N, P, r, range);
  if (!range || N < 0 || P < 1 || r < 0 || r >= P ||
      (strategy != ATTN_MPI_AUTO && strategy != ATTN_MPI_RING && strategy != ATTN_MPI_ULYSSES))
    return ATTN_E_INVALID;
  range[0] = r * (N / P) + (r < N % P ? r : N % P);
  range[1] = range[2] = range[3] = range[0] + N / P + (r < N % P);
  return ATTN_OK;
}

/* ---- every rank agrees, or every rank fails ----------------------------------- */
/* st: this rank's status (its message on ctx). Returns the first failing
 * rank's status on every rank, with that rank's message. */
static attn_status agree(attn_ctx *ctx, MPI_Comm comm, attn_status st) {
  int rank, P;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &P);
  int mine = st != ATTN_OK ? rank : P, first;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == P) return ATTN_OK;
  struct {
    int status;
    char msg[MSG_LEN];
  } m;
  memset(&m, 0, sizeof m);
  if (rank == first) {
    m.status = (int)st;
    snprintf(m.msg, sizeof m.msg, "%s", attn_ctx_error(ctx));
  }
  MPI_Bcast(&m, (int)sizeof m, MPI_BYTE, first, comm);
  return attn_ctx_fail(ctx, (attn_status)m.status, "rank %d: %s", first, m.msg);
}

static attn_status check4(attn_ctx *ctx, const attn_tensor *t, const char *what) {
  if (!t) return attn_ctx_fail(ctx, ATTN_E_INVALID, "%s is NULL", what);
  if (t->rank != 4) return attn_ctx_fail(ctx, ATTN_E_SHAPE, "%s must have rank 4 [B, H, n, D], got rank %d", what, t->rank);
  if (t->dtype != ATTN_F32 && t->dtype != ATTN_F16 && t->dtype != ATTN_BF16)
    return attn_ctx_fail(ctx, ATTN_E_DTYPE, "%s must be f32, f16 or bf16, got %s", what, attn_dtype_name(t->dtype));
  for (int i = 0; i < 4; i++)
    if (t->shape[i] < 0 || t->shape[i] > ((int64_t)1 << 40))
      return attn_ctx_fail(ctx, ATTN_E_SHAPE, "%s has dimension %d of size %lld", what, i, (long long)t->shape[i]);
  return ATTN_OK;
}

static attn_status same_shape(attn_ctx *ctx, const attn_tensor *t, const char *what, int64_t a, int64_t b, int64_t c,
                              int64_t d) {
  if (t->shape[0] != a || t->shape[1] != b || t->shape[2] != c || t->shape[3] != d)
    return attn_ctx_fail(ctx, ATTN_E_SHAPE, "%s is [%lld, %lld, %lld, %lld]; expected [%lld, %lld, %lld, %lld]", what,
                         (long long)t->shape[0], (long long)t->shape[1], (long long)t->shape[2],
                         (long long)t->shape[3], (long long)a, (long long)b, (long long)c, (long long)d);
  return ATTN_OK;
}

/* This rank's own checks: shapes of the local tensors and options. */
static attn_status local_checks(attn_ctx *ctx, int P, attn_mpi_strategy strategy, const attn_tensor *q,
                                const attn_tensor *k, const attn_tensor *v, const attn_tensor *out,
                                const attn_tensor *lse, const attn_sdpa_opts *o) {
  attn_status st;
  if ((st = check4(ctx, q, "q")) || (st = check4(ctx, k, "k")) || (st = check4(ctx, v, "v")) ||
      (out && (st = check4(ctx, out, "out"))))
    return st;
  const int64_t B = q->shape[0], Hq = q->shape[1], n = q->shape[2], D = q->shape[3];
  const int64_t Hk = k->shape[1], Dv = v->shape[3];
  if ((st = same_shape(ctx, k, "k", B, Hk, n, D)) || (st = same_shape(ctx, v, "v", B, Hk, n, Dv)) ||
      (out && (st = same_shape(ctx, out, "out", B, Hq, n, Dv))))
    return st;
  if (Hk < 1 || Hq % Hk)
    return attn_ctx_fail(ctx, ATTN_E_SHAPE, "q's %lld heads must be a multiple of k's %lld", (long long)Hq, (long long)Hk);
  if (lse && (lse->rank != 3 || lse->dtype != ATTN_F32 || lse->shape[0] != B || lse->shape[1] != Hq || lse->shape[2] != n))
    return attn_ctx_fail(ctx, ATTN_E_SHAPE, "lse must be f32 [B, Hq, n] = [%lld, %lld, %lld]", (long long)B,
                         (long long)Hq, (long long)n);
  if (strategy < ATTN_MPI_AUTO || strategy > ATTN_MPI_ULYSSES)
    return attn_ctx_fail(ctx, ATTN_E_INVALID, "unknown strategy %d", (int)strategy);
  if (o->mask)
    return attn_ctx_fail(ctx, ATTN_E_UNSUPPORTED, "a mask tensor is not taken over MPI (key_padding is: each rank "
                         "passes its tokens' [B, n] shard)");
  if (o->cu_seqlens_q || o->cu_seqlens_k || o->num_seqs)
    return attn_ctx_fail(ctx, ATTN_E_UNSUPPORTED, "a packed batch (cu_seqlens) is not taken over MPI");
  if (o->q_offset || o->k_offset || o->head_offset)
    return attn_ctx_fail(ctx, ATTN_E_INVALID, "q_offset, k_offset and head_offset are set by attn_mpi (the shards' "
                         "positions); pass 0");
  if (o->key_padding) {
    const attn_tensor *m = o->key_padding;
    if (m->rank != 2 || m->shape[0] != B || m->shape[1] != n || (m->dtype != ATTN_BOOL && m->dtype != ATTN_U8))
      return attn_ctx_fail(ctx, ATTN_E_SHAPE, "key_padding must be bool or u8 [B, n] = [%lld, %lld] (this rank's "
                           "tokens)", (long long)B, (long long)n);
  }
  const attn_mpi_strategy s = strategy == ATTN_MPI_AUTO ? attn_mpi_auto_strategy(Hk, P, o) : strategy;
  if (s == ATTN_MPI_ULYSSES && Hk % P)
    return attn_ctx_fail(ctx, ATTN_E_UNSUPPORTED, "ulysses shards the %lld kv heads over %d ranks: they must divide",
                         (long long)Hk, P);
  return ATTN_OK;
}

static void bits_of(int64_t *dst, double x) { memcpy(dst, &x, sizeof x); }

/* Gathers the shards' sizes and checks that the ranks agree; fills pl. */
static attn_status make_plan(attn_ctx *ctx, MPI_Comm comm, plan *pl, attn_mpi_strategy strategy, const attn_tensor *q,
                             const attn_tensor *k, const attn_tensor *v, const attn_tensor *lse,
                             const attn_tensor *out, const attn_sdpa_opts *o, int wants_sinks_grad, attn_status st) {
  memset(pl, 0, sizeof *pl);
  MPI_Comm_size(comm, &pl->P);
  MPI_Comm_rank(comm, &pl->rank);
  if ((st = agree(ctx, comm, st ? st : local_checks(ctx, pl->P, strategy, q, k, v, out, lse, o)))) return st;
  enum { NSIG = 20 };
  int64_t sig[NSIG] = {q->shape[0], q->shape[1], k->shape[1], q->shape[3], v->shape[3], q->dtype, k->dtype, v->dtype,
                       strategy, o->causal != ATTN_CAUSAL_NONE, o->window, 0, 0, 0, o->alibi_slopes != NULL,
                       o->sinks != NULL, o->key_padding != NULL, (int64_t)o->dropout_seed, wants_sinks_grad, o->chunk};
  bits_of(&sig[11], o->scale), bits_of(&sig[12], o->softcap), bits_of(&sig[13], o->dropout_p);
  int64_t lo[NSIG], hi[NSIG];
  MPI_Allreduce(sig, lo, NSIG, MPI_INT64_T, MPI_MIN, comm);
  MPI_Allreduce(sig, hi, NSIG, MPI_INT64_T, MPI_MAX, comm);
  static const char *const names[NSIG] = {"B", "Hq", "Hk", "D", "Dv", "q's dtype", "k's dtype", "v's dtype",
                                          "the strategy", "causal", "window", "scale", "softcap", "dropout_p",
                                          "ALiBi", "sinks", "key padding", "dropout_seed",
                                          "whether sinks_grad is asked for", "chunk"};
  for (int i = 0; i < NSIG; i++)
    if (lo[i] != hi[i]) {
      st = attn_ctx_fail(ctx, ATTN_E_SHAPE, "the ranks disagree on %s (this rank: %lld; every rank must pass the "
                         "same)", names[i], (long long)sig[i]);
      return agree(ctx, comm, st); /* every rank sees it: all fail, rank 0's message first */
    }
  pl->B = q->shape[0], pl->Hq = q->shape[1], pl->Hk = k->shape[1], pl->D = q->shape[3], pl->Dv = v->shape[3];
  pl->qt = q->dtype, pl->kt = k->dtype, pl->vt = v->dtype;
  pl->strategy = strategy == ATTN_MPI_AUTO ? attn_mpi_auto_strategy(pl->Hk, pl->P, o) : strategy;
  pl->counts = calloc((size_t)pl->P, sizeof *pl->counts);
  pl->shards = calloc((size_t)pl->P, sizeof *pl->shards);
  const int ok = pl->counts && pl->shards;
  int all_ok;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, comm);
  if (!all_ok) return agree(ctx, comm, ok ? ATTN_OK : attn_ctx_fail(ctx, ATTN_E_NOMEM, "out of memory"));
  const int64_t n = q->shape[2];
  MPI_Allgather(&n, 1, MPI_INT64_T, pl->counts, 1, MPI_INT64_T, comm);
  int64_t N = 0, mx = 0;
  for (int r = 0; r < pl->P; r++) N += pl->counts[r], mx = pl->counts[r] > mx ? pl->counts[r] : mx;
  pl->N = N, pl->max_rows = mx;
  for (int r = 0; r < pl->P; r++) {
    shard *s = &pl->shards[r];
    if (pl->strategy == ATTN_MPI_ZIGZAG) {
      int64_t rg[4] = {0, 0, 0, 0};
      attn_mpi_zigzag_range(N, pl->P, r, rg);
      s->nseg = 2;
      s->seg[0] = (segment){rg[0], 0, rg[1] - rg[0]};
      s->seg[1] = (segment){rg[2], rg[1] - rg[0], rg[3] - rg[2]};
      s->rows = s->seg[0].rows + s->seg[1].rows;
    } else { /* contiguous: the running sum of the counts */
      s->nseg = 1;
      s->seg[0] = (segment){r ? pl->shards[r - 1].seg[0].global + pl->counts[r - 1] : 0, 0, pl->counts[r]};
      s->rows = pl->counts[r];
    }
  }
  st = ATTN_OK;
  if (pl->shards[pl->rank].rows != n)
    st = attn_ctx_fail(ctx, ATTN_E_SHAPE, "zigzag: this rank (%d of %d) must hold %lld of the %lld tokens (chunks %d "
                       "and %d), not %lld", pl->rank, pl->P, (long long)pl->shards[pl->rank].rows, (long long)N,
                       pl->rank, 2 * pl->P - 1 - pl->rank, (long long)n);
  return agree(ctx, comm, st);
}

static void free_plan(plan *pl) {
  free(pl->counts);
  free(pl->shards);
}

/* ---- views and buffers ------------------------------------------------------------ */
/* Elements [start, start + count) of dimension dim of a view: rows (dim 2), heads (dim 1), an [Hq] option's entries. */
static attn_tensor along(const attn_tensor *t, int dim, int64_t start, int64_t count) {
  attn_tensor v = *t;
  v.data = (char *)t->data + (size_t)(start * t->strides[dim]) * attn_dtype_size(t->dtype);
  v.shape[dim] = count;
  return v;
}

/* One copy of attn_mpi_shard (to_whole 0) or attn_mpi_unshard (1) after the shapes are checked. */
static attn_status reshard(attn_ctx *ctx, const attn_tensor *whole, const attn_tensor *local,
                           attn_mpi_strategy strategy, int P, int r, int to_whole) {
  const char *fn = to_whole ? "attn_mpi_unshard" : "attn_mpi_shard";
  if (!ctx) return ATTN_E_INVALID;
  if (!whole || !local) return attn_ctx_fail(ctx, ATTN_E_INVALID, "%s: a NULL tensor", fn);
  if ((whole->rank != 3 && whole->rank != 4) || local->rank != whole->rank)
    return attn_ctx_fail(ctx, ATTN_E_SHAPE, "%s: whole and shard must both be [B, H, N, F] or [B, H, N]", fn);
  int64_t rg[4];
  if (attn_mpi_shard_range(strategy, whole->shape[2], P, r, rg))
    return attn_ctx_fail(ctx, ATTN_E_INVALID, "%s: no shard %d of %d ranks with strategy %d", fn, r, P, (int)strategy);
  const int64_t n = rg[1] - rg[0] + rg[3] - rg[2];
  for (int d = 0; d < whole->rank; d++)
    if (local->shape[d] != (d == 2 ? n : whole->shape[d]))
      return attn_ctx_fail(ctx, ATTN_E_SHAPE, "%s: rank %d of %d holds %lld of the %lld tokens: shard's dim %d is "
                           "%lld, not %lld", fn, r, P, (long long)n, (long long)whole->shape[2], d,
                           (long long)local->shape[d], (long long)(d == 2 ? n : whole->shape[d]));
  attn_status st = ATTN_OK;
  int64_t at = 0;
  for (int part = 0; part < 2 && !st; part++) {
    const int64_t len = rg[2 * part + 1] - rg[2 * part];
    if (!len) continue;
    attn_tensor w = along(whole, 2, rg[2 * part], len), s = along(local, 2, at, len);
    st = to_whole ? attn_tensor_copy(ctx, &w, &s) : attn_tensor_copy(ctx, &s, &w);
    at += len;
  }
  return st;
}

attn_status attn_mpi_shard(attn_ctx *ctx, attn_tensor *local, const attn_tensor *whole, attn_mpi_strategy strategy,
                           int P, int r) {
  return reshard(ctx, whole, local, strategy, P, r, 0);
}

attn_status attn_mpi_unshard(attn_ctx *ctx, attn_tensor *whole, const attn_tensor *local, attn_mpi_strategy strategy,
                             int P, int r) {
  return reshard(ctx, whole, local, strategy, P, r, 1);
}

/* A contiguous [B, H, cap, F] buffer's first n rows of each head, as a view. */
static attn_tensor block_view(void *data, attn_dtype dt, int64_t B, int64_t H, int64_t cap, int64_t n, int64_t F) {
  attn_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data, t.dtype = dt, t.rank = 4;
  t.shape[0] = B, t.shape[1] = H, t.shape[2] = n, t.shape[3] = F;
  t.strides[3] = 1, t.strides[2] = F, t.strides[1] = cap * F, t.strides[0] = H * cap * F;
  return t;
}

/* The travelling block: K, V (input dtypes), key padding (u8), and for the
 * backward dK, dV (f32), each [B, H, cap, F] (padding [B, cap]) at 64-byte offsets. */
typedef struct block {
  char *mem;
  size_t bytes, kv_bytes; /* all of it; the K/V/padding part (sent first) */
  size_t k_off, v_off, kp_off, dk_off, dv_off;
  int64_t cap;
} block;

static size_t up64(size_t x) { return (x + 63) & ~(size_t)63; }

static int block_init(block *bl, const plan *pl, int has_kp, int grads) {
  const int64_t cap = pl->max_rows > 0 ? pl->max_rows : 1;
  const size_t ke = (size_t)(pl->B * pl->Hk * cap), kb = ke * (size_t)pl->D * attn_dtype_size(pl->kt),
               vb = ke * (size_t)pl->Dv * attn_dtype_size(pl->vt), pb = has_kp ? (size_t)(pl->B * cap) : 0;
  bl->cap = cap;
  bl->k_off = 0, bl->v_off = up64(kb), bl->kp_off = bl->v_off + up64(vb);
  bl->kv_bytes = bl->kp_off + up64(pb);
  bl->dk_off = bl->kv_bytes, bl->dv_off = bl->dk_off + (grads ? up64(ke * (size_t)pl->D * 4) : 0);
  bl->bytes = bl->dv_off + (grads ? up64(ke * (size_t)pl->Dv * 4) : 0);
  if (bl->bytes > (size_t)INT32_MAX) return 0; /* one MPI message each part: counts are ints */
  bl->mem = aligned_alloc(64, bl->bytes);
  if (bl->mem) memset(bl->mem, 0, bl->bytes);
  return bl->mem != NULL;
}

/* This rank's K, V and padding packed into bl (its dK, dV zeroed). */
static attn_status block_pack(attn_ctx *ctx, block *bl, const plan *pl, const attn_tensor *k, const attn_tensor *v,
                              const attn_tensor *kp) {
  const int64_t n = k->shape[2];
  attn_tensor kd = block_view(bl->mem + bl->k_off, pl->kt, pl->B, pl->Hk, bl->cap, n, pl->D);
  attn_tensor vd = block_view(bl->mem + bl->v_off, pl->vt, pl->B, pl->Hk, bl->cap, n, pl->Dv);
  attn_status st;
  if ((st = attn_tensor_copy(ctx, &kd, k)) || (st = attn_tensor_copy(ctx, &vd, v))) return st;
  if (kp) {
    attn_tensor pd;
    memset(&pd, 0, sizeof pd);
    pd.data = bl->mem + bl->kp_off, pd.dtype = ATTN_U8, pd.rank = 2;
    pd.shape[0] = pl->B, pd.shape[1] = n, pd.strides[0] = bl->cap, pd.strides[1] = 1;
    if ((st = attn_tensor_copy(ctx, &pd, kp))) return st;
  }
  memset(bl->mem + bl->dk_off, 0, bl->bytes - bl->dk_off);
  return ATTN_OK;
}

static attn_tensor block_k(const block *bl, const plan *pl, int64_t r0, int64_t rows) {
  attn_tensor t = block_view(bl->mem + bl->k_off, pl->kt, pl->B, pl->Hk, bl->cap, bl->cap, pl->D);
  return along(&t, 2, r0, rows);
}
static attn_tensor block_v(const block *bl, const plan *pl, int64_t r0, int64_t rows) {
  attn_tensor t = block_view(bl->mem + bl->v_off, pl->vt, pl->B, pl->Hk, bl->cap, bl->cap, pl->Dv);
  return along(&t, 2, r0, rows);
}
static attn_tensor block_grad(const block *bl, const plan *pl, int dv, int64_t r0, int64_t rows) {
  attn_tensor t = block_view(bl->mem + (dv ? bl->dv_off : bl->dk_off), ATTN_F32, pl->B, pl->Hk, bl->cap, bl->cap,
                             dv ? pl->Dv : pl->D);
  return along(&t, 2, r0, rows);
}
static attn_tensor block_kp(const block *bl, const plan *pl, int64_t r0, int64_t rows) {
  attn_tensor t;
  memset(&t, 0, sizeof t);
  t.data = bl->mem + bl->kp_off + r0, t.dtype = ATTN_U8, t.rank = 2;
  t.shape[0] = pl->B, t.shape[1] = rows, t.strides[0] = bl->cap, t.strides[1] = 1;
  return t;
}

/* Whether segment ks of keys can be seen by any row of segment qs. */
static int pair_visible(const segment *qs, const segment *ks, const attn_sdpa_opts *o) {
  if (qs->rows == 0 || ks->rows == 0) return 0;
  const int causal = o->causal != ATTN_CAUSAL_NONE || o->window > 0 || o->chunk > 0;
  if (causal && ks->global > qs->global + qs->rows - 1) return 0; /* every key after every row */
  if (o->window > 0 && ks->global + ks->rows - 1 < qs->global - o->window + 1) return 0; /* before every window */
  if (o->chunk > 0 && (ks->global + ks->rows - 1) / o->chunk < qs->global / o->chunk) return 0; /* before every chunk */
  return 1;
}

/* The options of one (query segment, key segment) piece. */
static attn_sdpa_opts piece_opts(const attn_sdpa_opts *o, const segment *qs, const segment *ks,
                                 const attn_tensor *kp) {
  attn_sdpa_opts p = *o;
  if (p.causal == ATTN_CAUSAL_BOTTOM_RIGHT) p.causal = ATTN_CAUSAL_TOP_LEFT; /* Nq = Nk over the whole sequence */
  p.q_offset = qs->global, p.k_offset = ks->global;
  p.sinks = NULL; /* joined once, at the end */
  p.key_padding = kp;
  return p;
}

/* acc (rows of [B, Hq, n, Dv] f32 and lse [B, Hq, n]) merged with a piece's
 * (o, l: [B, Hq, rows, Dv], [B, Hq, rows]) at rows [r0, r0 + rows). */
static void merge(float *acc, float *acc_lse, const float *o, const float *l, const plan *pl, int64_t n, int64_t r0,
                  int64_t rows) {
  const int64_t Dv = pl->Dv;
  for (int64_t bh = 0; bh < pl->B * pl->Hq; bh++)
    for (int64_t i = 0; i < rows; i++) {
      float *a = acc + (bh * n + r0 + i) * Dv, *al = acc_lse + bh * n + r0 + i;
      const float *x = o + (bh * rows + i) * Dv;
      const double l2 = l[bh * rows + i], l1 = *al;
      if (l2 == -INFINITY) continue; /* nothing visible in this piece */
      if (l1 == -INFINITY || isnan(l2)) {
        memcpy(a, x, (size_t)Dv * sizeof *a);
        *al = (float)l2;
        continue;
      }
      const double m = l1 > l2 ? l1 : l2, w1 = exp(l1 - m), w2 = exp(l2 - m), s = w1 + w2;
      for (int64_t c = 0; c < Dv; c++) a[c] = (float)((a[c] * w1 + x[c] * w2) / s);
      *al = (float)(m + log(s));
    }
}

/* The sinks join each row's softmax: lse' = logaddexp(lse, sink), out scaled by exp(lse - lse'). */
static void join_sinks(float *acc, float *acc_lse, const plan *pl, int64_t n, const attn_tensor *sinks) {
  if (!sinks) return;
  for (int64_t b = 0; b < pl->B; b++)
    for (int64_t h = 0; h < pl->Hq; h++) {
      const double s = ((const float *)sinks->data)[h * sinks->strides[0]];
      for (int64_t i = 0; i < n; i++) {
        const int64_t row = (b * pl->Hq + h) * n + i;
        const double l = acc_lse[row], m = l > s ? l : s;
        const double lt = l == -INFINITY ? s : m + log(exp(l - m) + exp(s - m)), f = l == -INFINITY ? 0 : exp(l - lt);
        for (int64_t c = 0; c < pl->Dv; c++) acc[row * pl->Dv + c] = (float)(acc[row * pl->Dv + c] * f);
        acc_lse[row] = (float)lt;
      }
    }
}

static attn_tensor f32_view(float *data, int rank, int64_t a, int64_t b, int64_t c, int64_t d) {
  const int64_t shape[4] = {a, b, c, d};
  return attn_tensor_view(data, ATTN_F32, rank, shape);
}

/* ---- ring and zigzag ---------------------------------------------------------------- */
/* Open MPI's TCP transport moves a message only inside MPI calls, so a block
 * in flight would travel only once the current one is computed. Where MPI
 * was initialised with MPI_THREAD_SERIALIZED or MULTIPLE, a helper thread
 * calls MPI_Testall while the rank computes (the computing threads make no
 * MPI call meanwhile, and the helper is joined before the next one), and a
 * step is one attn_sdpa call a pair of segments. The helper polls every 50 us
 * at first, then every 1/16 of the time so far, up to 1 ms: each poll wakes it
 * on a busy core (at 1 Gbit/s polls every 50 us took 25 ms of a 65 ms step),
 * and the socket buffers keep the link busy between sparser polls. Without
 * the helper the ring polls between calls of POLL_ROWS query rows (more calls
 * would repack K and V more often; pieces of 1024 rows cost 3% at N = 16384). */
#define POLL_ROWS 1024

typedef struct pump {
  MPI_Request *req;
  int nreq, threaded;
  atomic_int stop;
  pthread_t thread;
} pump;

static void *pump_loop(void *arg) {
  pump *p = arg;
  const double t0 = MPI_Wtime();
  while (!atomic_load(&p->stop)) {
    int done = 0;
    MPI_Testall(p->nreq, p->req, &done, MPI_STATUSES_IGNORE);
    if (done) break;
    const double wait = (MPI_Wtime() - t0) / 16;
    const struct timespec pause = {0, (long)((wait < 50e-6 ? 50e-6 : wait > 1e-3 ? 1e-3 : wait) * 1e9)};
    nanosleep(&pause, NULL);
  }
  return NULL;
}

static void pump_start(pump *p, MPI_Request *req, int nreq) {
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  p->req = req, p->nreq = nreq, p->threaded = 0;
  atomic_store(&p->stop, 0);
  if (nreq && level >= MPI_THREAD_SERIALIZED) p->threaded = pthread_create(&p->thread, NULL, pump_loop, p) == 0;
}

/* Between the calls of a step: a poll, unless the helper thread is pumping. */
static void progress(pump *p) {
  int done;
  if (p->nreq && !p->threaded) MPI_Testall(p->nreq, p->req, &done, MPI_STATUSES_IGNORE);
}

static void pump_stop(pump *p) {
  if (!p->threaded) return;
  atomic_store(&p->stop, 1);
  pthread_join(p->thread, NULL);
  p->threaded = 0;
}

/* One piece of a ring step: this rank's queries qs against the keys ks of the block in hand. */
typedef attn_status (*piece_fn)(void *arg, const block *bl, const segment *qs, const segment *ks);

/* The ring's P steps over bl (bl[0]: this rank's block, packed): step s runs fn on every visible
 * piece of this rank's queries (whole segments, or POLL_ROWS rows at a time where the ring must
 * poll between calls) against the block of rank (r - s) mod P while the next block travels. With grads_in (the backward) a step's pieces add their dK and dV
 * to the block's zeroed ones while the sum of the ranks before arrives in grads_in; the two are
 * added and sent on during the next step, the last sum to the block's owner, so the hand-overs
 * hide behind computation but the last (bl[P & 1] ends up holding this rank's own). */
static attn_status ring_steps(MPI_Comm comm, const plan *pl, block bl[2], const attn_sdpa_opts *o, float *grads_in,
                              piece_fn fn, void *arg) {
  const int P = pl->P, r = pl->rank, next = (r + 1) % P, prev = (r - 1 + P) % P, tag = grads_in ? 8 : 7;
  const size_t gbytes = bl[0].bytes - bl[0].dk_off; /* dK and dV */
  const shard *mine = &pl->shards[r];
  MPI_Request grads_sent = MPI_REQUEST_NULL;
  attn_status st = ATTN_OK;
  for (int s = 0; s < P; s++) {
    const int src = (r - s + P) % P, cur = s & 1;
    float *grads = (float *)(bl[cur].mem + bl[cur].dk_off);
    MPI_Request req[4];
    int nreq = 0;
    if (s < P - 1) { /* the next block's K, V and padding travel while this one is computed */
      MPI_Irecv(bl[cur ^ 1].mem, (int)bl[cur ^ 1].kv_bytes, MPI_BYTE, prev, tag, comm, &req[nreq++]);
      MPI_Isend(bl[cur].mem, (int)bl[cur].kv_bytes, MPI_BYTE, next, tag, comm, &req[nreq++]);
    }
    if (grads_in && s > 0) { /* the block's previous sender finished its step-(s - 1) grads */
      memset(grads, 0, gbytes);
      MPI_Irecv(grads_in, (int)gbytes, MPI_BYTE, prev, 9, comm, &req[nreq++]);
    }
    if (grads_sent != MPI_REQUEST_NULL) req[nreq++] = grads_sent, grads_sent = MPI_REQUEST_NULL;
    pump pm;
    pump_start(&pm, req, nreq);
    const shard *theirs = &pl->shards[src];
    const int64_t piece_rows = nreq && !pm.threaded ? POLL_ROWS : INT64_MAX; /* polls only where it must */
    for (int a = 0; a < mine->nseg && !st; a++)
      for (int c = 0; c < theirs->nseg && !st; c++)
        for (int64_t i0 = 0; i0 < mine->seg[a].rows && !st; i0 += piece_rows) {
          const segment *ks = &theirs->seg[c], *whole = &mine->seg[a];
          const segment qs = {whole->global + i0, whole->local + i0,
                              whole->rows - i0 < piece_rows ? whole->rows - i0 : piece_rows};
          if (!pair_visible(&qs, ks, o)) continue;
          st = fn(arg, &bl[cur], &qs, ks);
          progress(&pm);
        }
    pump_stop(&pm);
    if (nreq) MPI_Waitall(nreq, req, MPI_STATUSES_IGNORE);
    if (grads_in) {
      if (s > 0)
        for (size_t i = 0; i < gbytes / sizeof(float); i++) grads[i] += grads_in[i];
      MPI_Isend(grads, (int)gbytes, MPI_BYTE, next, 9, comm, &grads_sent);
    }
  }
  if (grads_in) { /* this rank's own block, summed over every rank */
    MPI_Request req[2] = {grads_sent};
    MPI_Irecv(bl[P & 1].mem + bl[P & 1].dk_off, (int)gbytes, MPI_BYTE, prev, 9, comm, &req[1]);
    MPI_Waitall(2, req, MPI_STATUSES_IGNORE);
  }
  return st;
}

typedef struct fwd_pieces {
  attn_ctx *ctx;
  const plan *pl;
  const attn_tensor *q;
  const attn_sdpa_opts *o;
  float *acc, *acc_lse, *po, *pls; /* the running out and lse of this rank's rows; a piece's */
} fwd_pieces;

static attn_status fwd_piece(void *arg, const block *bl, const segment *qs, const segment *ks) {
  fwd_pieces *f = arg;
  const plan *pl = f->pl;
  const attn_tensor qv = along(f->q, 2, qs->local, qs->rows), kv = block_k(bl, pl, ks->local, ks->rows),
                    vv = block_v(bl, pl, ks->local, ks->rows), kp = block_kp(bl, pl, ks->local, ks->rows);
  const attn_sdpa_opts po = piece_opts(f->o, qs, ks, f->o->key_padding ? &kp : NULL);
  attn_tensor ov = f32_view(f->po, 4, pl->B, pl->Hq, qs->rows, pl->Dv), lv = f32_view(f->pls, 3, pl->B, pl->Hq, qs->rows, 0);
  const attn_status st = attn_sdpa(f->ctx, &ov, &lv, NULL, &qv, &kv, &vv, &po);
  if (!st) merge(f->acc, f->acc_lse, f->po, f->pls, pl, pl->counts[pl->rank], qs->local, qs->rows);
  return st;
}

static attn_status ring_forward(attn_ctx *ctx, MPI_Comm comm, const plan *pl, attn_tensor *out, attn_tensor *lse,
                                const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                                const attn_sdpa_opts *o) {
  const int64_t n = pl->counts[pl->rank], B = pl->B, Hq = pl->Hq, Dv = pl->Dv;
  block bl[2] = {{0}, {0}};
  const size_t acc_n = (size_t)(B * Hq * (n > 0 ? n : 1));
  fwd_pieces f = {ctx, pl, q, o, malloc(acc_n * (size_t)Dv * sizeof(float) + 1), malloc(acc_n * sizeof(float)),
                  malloc(acc_n * (size_t)Dv * sizeof(float) + 1), malloc(acc_n * sizeof(float))};
  attn_status st = ATTN_OK;
  if (!f.acc || !f.acc_lse || !f.po || !f.pls || !block_init(&bl[0], pl, o->key_padding != NULL, 0) ||
      !block_init(&bl[1], pl, o->key_padding != NULL, 0))
    st = attn_ctx_fail(ctx, ATTN_E_NOMEM, "out of memory for the ring's buffers (%lld tokens a block)",
                       (long long)pl->max_rows);
  if (!st) st = block_pack(ctx, &bl[0], pl, k, v, o->key_padding);
  if ((st = agree(ctx, comm, st))) goto done;
  for (size_t i = 0; i < acc_n; i++) f.acc_lse[i] = -INFINITY;
  memset(f.acc, 0, acc_n * (size_t)Dv * sizeof(float));
  if ((st = agree(ctx, comm, ring_steps(comm, pl, bl, o, NULL, fwd_piece, &f)))) goto done;
  join_sinks(f.acc, f.acc_lse, pl, n, o->sinks);
  {
    attn_tensor av = f32_view(f.acc, 4, B, Hq, n, Dv), alv = f32_view(f.acc_lse, 3, B, Hq, n, 0);
    st = attn_tensor_copy(ctx, out, &av);
    if (!st && lse) st = attn_tensor_copy(ctx, lse, &alv);
  }
  st = agree(ctx, comm, st);
done:
  free(f.acc), free(f.acc_lse), free(f.po), free(f.pls), free(bl[0].mem), free(bl[1].mem);
  return st;
}

static void add_into(float *dst, const float *src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] += src[i];
}

/* dst rows [r0, r0 + rows) of a [B, H, cap, F] f32 buffer += src [B, H, rows, F]. */
static void add_rows(float *dst, int64_t cap, const float *src, int64_t BH, int64_t r0, int64_t rows, int64_t F) {
  for (int64_t bh = 0; bh < BH; bh++) add_into(dst + (bh * cap + r0) * F, src + bh * rows * F, (size_t)(rows * F));
}

/* d sink_h = -sum over rows of exp(sink_h - lse) * rowsum(dout * out): this
 * rank's rows, then summed over the ranks (the same on each). */
static attn_status sinks_gradient(attn_ctx *ctx, MPI_Comm comm, const plan *pl, attn_tensor *sinks_grad,
                                  const attn_tensor *dout, const attn_tensor *out, const attn_tensor *lse,
                                  const attn_tensor *sinks) {
  const int64_t n = pl->counts[pl->rank], rows = pl->B * pl->Hq * n, Dv = pl->Dv;
  float *o = malloc((size_t)(rows * Dv + 1) * sizeof *o), *g = malloc((size_t)(rows * Dv + 1) * sizeof *g);
  float *l = malloc((size_t)(rows + 1) * sizeof *l);
  double *sum = calloc((size_t)pl->Hq, sizeof *sum);
  attn_status st = o && g && l && sum ? ATTN_OK : attn_ctx_fail(ctx, ATTN_E_NOMEM, "out of memory");
  attn_tensor ov = f32_view(o, 4, pl->B, pl->Hq, n, Dv), gv = f32_view(g, 4, pl->B, pl->Hq, n, Dv),
              lv = f32_view(l, 3, pl->B, pl->Hq, n, 0);
  if (!st) st = attn_tensor_copy(ctx, &ov, out);
  if (!st) st = attn_tensor_copy(ctx, &gv, dout);
  if (!st) st = attn_tensor_copy(ctx, &lv, lse);
  for (int64_t row = 0; row < rows && !st; row++) {
    const int64_t h = (row / n) % pl->Hq;
    double delta = 0;
    for (int64_t c = 0; c < Dv; c++) delta += (double)o[row * Dv + c] * g[row * Dv + c];
    sum[h] -= exp((double)((const float *)sinks->data)[h * sinks->strides[0]] - l[row]) * delta;
  }
  if ((st = agree(ctx, comm, st)) == ATTN_OK) {
    MPI_Allreduce(MPI_IN_PLACE, sum, (int)pl->Hq, MPI_DOUBLE, MPI_SUM, comm);
    for (int64_t h = 0; h < pl->Hq; h++) ((float *)sinks_grad->data)[h * sinks_grad->strides[0]] = (float)sum[h];
  }
  free(o), free(g), free(l), free(sum);
  return st;
}

typedef struct bwd_pieces {
  attn_ctx *ctx;
  const plan *pl;
  const attn_tensor *q, *out, *dout, *lse;
  const attn_sdpa_opts *o;
  float *dq_acc, *pq, *pk, *pv; /* this rank's dq; a piece's dq, dk, dv */
} bwd_pieces;

static attn_status bwd_piece(void *arg, const block *bl, const segment *qs, const segment *ks) {
  bwd_pieces *w = arg;
  const plan *pl = w->pl;
  const int64_t B = pl->B, Hq = pl->Hq, Hk = pl->Hk, D = pl->D, Dv = pl->Dv, n = pl->counts[pl->rank];
  const attn_tensor qv = along(w->q, 2, qs->local, qs->rows), ov = along(w->out, 2, qs->local, qs->rows),
                    gv = along(w->dout, 2, qs->local, qs->rows), lv = along(w->lse, 2, qs->local, qs->rows);
  const attn_tensor kv = block_k(bl, pl, ks->local, ks->rows), vv = block_v(bl, pl, ks->local, ks->rows),
                    kp = block_kp(bl, pl, ks->local, ks->rows);
  const attn_sdpa_opts po = piece_opts(w->o, qs, ks, w->o->key_padding ? &kp : NULL);
  attn_tensor dqv = f32_view(w->pq, 4, B, Hq, qs->rows, D), dkv = f32_view(w->pk, 4, B, Hk, ks->rows, D),
              dvv = f32_view(w->pv, 4, B, Hk, ks->rows, Dv);
  const attn_status st = attn_sdpa_backward(w->ctx, &dqv, &dkv, &dvv, NULL, NULL, &gv, &qv, &kv, &vv, &ov, &lv, &po);
  if (st) return st;
  add_rows(w->dq_acc, n > 0 ? n : 1, w->pq, B * Hq, qs->local, qs->rows, D);
  add_rows((float *)(bl->mem + bl->dk_off), bl->cap, w->pk, B * Hk, ks->local, ks->rows, D);
  add_rows((float *)(bl->mem + bl->dv_off), bl->cap, w->pv, B * Hk, ks->local, ks->rows, Dv);
  return ATTN_OK;
}

static attn_status ring_backward(attn_ctx *ctx, MPI_Comm comm, const plan *pl, attn_tensor *dq, attn_tensor *dk,
                                 attn_tensor *dv, attn_tensor *sinks_grad, const attn_tensor *dout,
                                 const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                                 const attn_tensor *out, const attn_tensor *lse, const attn_sdpa_opts *o) {
  const int64_t n = pl->counts[pl->rank], B = pl->B, Hq = pl->Hq, Hk = pl->Hk, D = pl->D, Dv = pl->Dv;
  const int64_t m = pl->max_rows > 0 ? pl->max_rows : 1, nn = n > 0 ? n : 1;
  block bl[2] = {{0}, {0}};
  bwd_pieces w = {ctx, pl, q, out, dout, lse, o, calloc((size_t)(B * Hq * nn * D), sizeof(float)),
                  malloc((size_t)(B * Hq * m * D) * sizeof(float)), malloc((size_t)(B * Hk * m * D) * sizeof(float)),
                  malloc((size_t)(B * Hk * m * Dv) * sizeof(float))};
  float *grads_in = NULL;
  attn_status st = ATTN_OK;
  if (!w.dq_acc || !w.pq || !w.pk || !w.pv || !block_init(&bl[0], pl, o->key_padding != NULL, 1) ||
      !block_init(&bl[1], pl, o->key_padding != NULL, 1) ||
      !(grads_in = aligned_alloc(64, bl[0].bytes - bl[0].dk_off)))
    st = attn_ctx_fail(ctx, ATTN_E_NOMEM, "out of memory for the ring's buffers (%lld tokens a block)",
                       (long long)pl->max_rows);
  if (!st) st = block_pack(ctx, &bl[0], pl, k, v, o->key_padding);
  if ((st = agree(ctx, comm, st))) goto done;
  if ((st = agree(ctx, comm, ring_steps(comm, pl, bl, o, grads_in, bwd_piece, &w)))) goto done;
  { /* after P steps and P hand-overs, bl[P & 1] holds this rank's own dK and dV */
    const block *own = &bl[pl->P & 1];
    attn_tensor dqa = f32_view(w.dq_acc, 4, B, Hq, n, D);
    attn_tensor dka = block_grad(own, pl, 0, 0, n), dva = block_grad(own, pl, 1, 0, n);
    st = attn_tensor_copy(ctx, dq, &dqa);
    if (!st) st = attn_tensor_copy(ctx, dk, &dka);
    if (!st) st = attn_tensor_copy(ctx, dv, &dva);
  }
  if (!(st = agree(ctx, comm, st)) && sinks_grad) st = sinks_gradient(ctx, comm, pl, sinks_grad, dout, out, lse, o->sinks);
  st = agree(ctx, comm, st);
done:
  free(w.dq_acc), free(w.pq), free(w.pk), free(w.pv), free(bl[0].mem), free(bl[1].mem), free(grads_in);
  return st;
}

/* ---- ulysses: sequence shards to head shards and back --------------------------------- */
/* lse [B, H, n] as [B, H, n, 1]. */
static attn_tensor as4(const attn_tensor *t) {
  attn_tensor v = *t;
  v.rank = 4, v.shape[3] = 1, v.strides[3] = 1;
  return v;
}

static int64_t seq_offset(const plan *pl, int r) { return pl->shards[r].seg[0].global; }

/* local [B, H, n_r, F] (this rank's tokens, every head) -> *whole [B, H / P,
 * N, F] contiguous in local's dtype (every token, this rank's heads), allocated. */
static attn_status seq_to_heads(attn_ctx *ctx, MPI_Comm comm, const plan *pl, const attn_tensor *local,
                                attn_tensor *whole, void **mem) {
  const int P = pl->P, r = pl->rank;
  const int64_t B = local->shape[0], Hs = local->shape[1] / P, F = local->shape[3], n = pl->counts[r];
  const size_t es = attn_dtype_size(local->dtype), row = (size_t)(B * Hs * F) * es; /* bytes per token, a head slice */
  char *send = malloc(row * (size_t)(n > 0 ? n : 1) * (size_t)P), *recv = malloc(row * (size_t)(pl->N > 0 ? pl->N : 1));
  *mem = aligned_alloc(64, up64(row * (size_t)(pl->N > 0 ? pl->N : 1)));
  int *sc = malloc(4 * sizeof(int) * (size_t)P);
  attn_status st = send && recv && *mem && sc ? ATTN_OK : attn_ctx_fail(ctx, ATTN_E_NOMEM, "out of memory");
  if (row * (size_t)pl->N > (size_t)INT32_MAX && !st)
    st = attn_ctx_fail(ctx, ATTN_E_UNSUPPORTED, "ulysses: a head slice of the sequence passes 2 GiB; use ring");
  if ((st = agree(ctx, comm, st))) goto done;
  int *sd = sc + P, *rc = sc + 2 * P, *rd = sc + 3 * P;
  for (int t = 0; t < P; t++) { /* to rank t: heads slice t of my tokens, as [B, Hs, n, F] */
    sc[t] = (int)(row * (size_t)n), sd[t] = (int)(row * (size_t)n * (size_t)t);
    rc[t] = (int)(row * (size_t)pl->counts[t]), rd[t] = (int)(row * (size_t)seq_offset(pl, t));
    attn_tensor dst = block_view(send + sd[t], local->dtype, B, Hs, n, n, F), src = along(local, 1, t * Hs, Hs);
    if (!st && n) st = attn_tensor_copy(ctx, &dst, &src);
  }
  MPI_Alltoallv(send, sc, sd, MPI_BYTE, recv, rc, rd, MPI_BYTE, comm);
  *whole = block_view(*mem, local->dtype, B, Hs, pl->N, pl->N, F);
  for (int t = 0; t < P && !st; t++) { /* rank t's tokens, [B, Hs, n_t, F], into rows o_t of whole */
    if (!pl->counts[t]) continue;
    attn_tensor src = block_view(recv + rd[t], local->dtype, B, Hs, pl->counts[t], pl->counts[t], F);
    attn_tensor dst = along(whole, 2, seq_offset(pl, t), pl->counts[t]);
    st = attn_tensor_copy(ctx, &dst, &src);
  }
done:
  free(send), free(recv), free(sc);
  return st;
}

/* whole [B, H / P, N, F] (this rank's heads, every token; contiguous) -> local
 * [B, H, n_r, F] (every head, this rank's tokens), converted to local's dtype. */
static attn_status heads_to_seq(attn_ctx *ctx, MPI_Comm comm, const plan *pl, const attn_tensor *whole,
                                attn_tensor *local) {
  const int P = pl->P, r = pl->rank;
  const int64_t B = whole->shape[0], Hs = whole->shape[1], F = whole->shape[3], n = pl->counts[r];
  const size_t es = attn_dtype_size(whole->dtype), row = (size_t)(B * Hs * F) * es;
  char *send = malloc(row * (size_t)(pl->N > 0 ? pl->N : 1)), *recv = malloc(row * (size_t)(n > 0 ? n : 1) * (size_t)P);
  int *sc = malloc(4 * sizeof(int) * (size_t)P);
  attn_status st = send && recv && sc ? ATTN_OK : attn_ctx_fail(ctx, ATTN_E_NOMEM, "out of memory");
  if ((st = agree(ctx, comm, st))) goto done;
  int *sd = sc + P, *rc = sc + 2 * P, *rd = sc + 3 * P;
  for (int t = 0; t < P; t++) { /* to rank t: its tokens of my heads, as [B, Hs, n_t, F] */
    sc[t] = (int)(row * (size_t)pl->counts[t]), sd[t] = (int)(row * (size_t)seq_offset(pl, t));
    rc[t] = (int)(row * (size_t)n), rd[t] = (int)(row * (size_t)n * (size_t)t);
    if (!pl->counts[t]) continue;
    attn_tensor dst = block_view(send + sd[t], whole->dtype, B, Hs, pl->counts[t], pl->counts[t], F);
    attn_tensor src = along(whole, 2, seq_offset(pl, t), pl->counts[t]);
    if (!st) st = attn_tensor_copy(ctx, &dst, &src);
  }
  MPI_Alltoallv(send, sc, sd, MPI_BYTE, recv, rc, rd, MPI_BYTE, comm);
  for (int t = 0; t < P && !st && n; t++) { /* heads slice t of my tokens */
    attn_tensor src = block_view(recv + rd[t], whole->dtype, B, Hs, n, n, F), dst = along(local, 1, t * Hs, Hs);
    st = attn_tensor_copy(ctx, &dst, &src);
  }
done:
  free(send), free(recv), free(sc);
  return st;
}

/* The whole sequence's key padding [B, N] from every rank's [B, n] (into mem, allocated). */
static attn_status gather_padding(attn_ctx *ctx, MPI_Comm comm, const plan *pl, const attn_tensor *kp, attn_tensor *all,
                                  uint8_t **mem) {
  const int P = pl->P;
  const int64_t B = pl->B, n = pl->counts[pl->rank], N = pl->N;
  uint8_t *mine = malloc((size_t)(B * n + 1)), *got = malloc((size_t)(B * N + 1));
  *mem = malloc((size_t)(B * N + 1));
  int *cnt = malloc(2 * sizeof(int) * (size_t)P);
  attn_status st = mine && got && *mem && cnt ? ATTN_OK : attn_ctx_fail(ctx, ATTN_E_NOMEM, "out of memory");
  if ((st = agree(ctx, comm, st))) goto done;
  const int64_t s2[2] = {B, n}, sN[2] = {B, N};
  attn_tensor m = attn_tensor_view(mine, ATTN_U8, 2, s2);
  if (n) st = attn_tensor_copy(ctx, &m, kp);
  for (int t = 0; t < P; t++) cnt[t] = (int)(B * pl->counts[t]), cnt[P + t] = (int)(B * seq_offset(pl, t));
  MPI_Allgatherv(mine, (int)(B * n), MPI_BYTE, got, cnt, cnt + P, MPI_BYTE, comm);
  for (int t = 0; t < P; t++) /* rank t's block [B, n_t] to columns [o_t, o_t + n_t) */
    for (int64_t b = 0; b < B; b++)
      memcpy(*mem + b * N + seq_offset(pl, t), got + B * seq_offset(pl, t) + b * pl->counts[t], (size_t)pl->counts[t]);
  *all = attn_tensor_view(*mem, ATTN_U8, 2, sN);
done:
  free(mine), free(got), free(cnt);
  return st;
}

/* The options of this rank's heads over the whole sequence. */
static attn_sdpa_opts ulysses_opts(const attn_sdpa_opts *o, const plan *pl, attn_tensor *alibi, attn_tensor *sinks,
                                   const attn_tensor *kp_all) {
  attn_sdpa_opts u = *o;
  const int64_t Hs = pl->Hq / pl->P;
  if (o->alibi_slopes) *alibi = along(o->alibi_slopes, 0, pl->rank * Hs, Hs), u.alibi_slopes = alibi;
  if (o->sinks) *sinks = along(o->sinks, 0, pl->rank * Hs, Hs), u.sinks = sinks;
  u.key_padding = kp_all;
  u.head_offset = pl->rank * Hs; /* dropout's heads are the whole layer's */
  return u;
}

static attn_status ulysses_forward(attn_ctx *ctx, MPI_Comm comm, const plan *pl, attn_tensor *out, attn_tensor *lse,
                                   const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                                   const attn_sdpa_opts *o) {
  const int64_t Hs = pl->Hq / pl->P;
  void *mq = NULL, *mk = NULL, *mv = NULL;
  uint8_t *mp = NULL;
  float *mo = NULL, *ml = NULL;
  attn_tensor qw, kw, vw, kp_all, alibi, sinks;
  attn_status st;
  if ((st = seq_to_heads(ctx, comm, pl, q, &qw, &mq)) || (st = seq_to_heads(ctx, comm, pl, k, &kw, &mk)) ||
      (st = seq_to_heads(ctx, comm, pl, v, &vw, &mv)))
    goto done;
  if (o->key_padding && (st = gather_padding(ctx, comm, pl, o->key_padding, &kp_all, &mp))) goto done;
  const size_t rows = (size_t)(pl->B * Hs * pl->N);
  mo = aligned_alloc(64, up64(rows * (size_t)pl->Dv * 4 + 4)), ml = aligned_alloc(64, up64(rows * 4 + 4));
  st = mo && ml ? ATTN_OK : attn_ctx_fail(ctx, ATTN_E_NOMEM, "out of memory");
  attn_tensor ow = block_view(mo, ATTN_F32, pl->B, Hs, pl->N, pl->N, pl->Dv);
  attn_tensor lw = block_view(ml, ATTN_F32, pl->B, Hs, pl->N, pl->N, 1);
  attn_tensor lw3 = lw;
  lw3.rank = 3;
  const attn_sdpa_opts u = ulysses_opts(o, pl, &alibi, &sinks, o->key_padding ? &kp_all : NULL);
  if (!st) st = attn_sdpa(ctx, &ow, &lw3, NULL, &qw, &kw, &vw, &u);
  if ((st = agree(ctx, comm, st))) goto done;
  if ((st = heads_to_seq(ctx, comm, pl, &ow, out))) goto done;
  if (lse) {
    attn_tensor l4 = as4(lse);
    st = heads_to_seq(ctx, comm, pl, &lw, &l4);
  }
done:
  free(mq), free(mk), free(mv), free(mp), free(mo), free(ml);
  return st;
}

static attn_status ulysses_backward(attn_ctx *ctx, MPI_Comm comm, const plan *pl, attn_tensor *dq, attn_tensor *dk,
                                    attn_tensor *dv, attn_tensor *sinks_grad, const attn_tensor *dout,
                                    const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                                    const attn_tensor *out, const attn_tensor *lse, const attn_sdpa_opts *o) {
  const int64_t Hs = pl->Hq / pl->P, Hks = pl->Hk / pl->P;
  void *m[6] = {0};
  uint8_t *mp = NULL;
  float *g[3] = {0}, *sg = NULL;
  attn_tensor qw, kw, vw, ow, gw, lw, kp_all, alibi, sinks;
  attn_status st;
  const attn_tensor l4 = as4(lse);
  if ((st = seq_to_heads(ctx, comm, pl, q, &qw, &m[0])) || (st = seq_to_heads(ctx, comm, pl, k, &kw, &m[1])) ||
      (st = seq_to_heads(ctx, comm, pl, v, &vw, &m[2])) || (st = seq_to_heads(ctx, comm, pl, out, &ow, &m[3])) ||
      (st = seq_to_heads(ctx, comm, pl, dout, &gw, &m[4])) || (st = seq_to_heads(ctx, comm, pl, &l4, &lw, &m[5])))
    goto done;
  if (o->key_padding && (st = gather_padding(ctx, comm, pl, o->key_padding, &kp_all, &mp))) goto done;
  const int64_t N = pl->N;
  g[0] = aligned_alloc(64, up64((size_t)(pl->B * Hs * N * pl->D) * 4 + 4));
  g[1] = aligned_alloc(64, up64((size_t)(pl->B * Hks * N * pl->D) * 4 + 4));
  g[2] = aligned_alloc(64, up64((size_t)(pl->B * Hks * N * pl->Dv) * 4 + 4));
  sg = calloc((size_t)pl->Hq, sizeof *sg);
  st = g[0] && g[1] && g[2] && sg ? ATTN_OK : attn_ctx_fail(ctx, ATTN_E_NOMEM, "out of memory");
  attn_tensor dqw = block_view(g[0], ATTN_F32, pl->B, Hs, N, N, pl->D), dkw = block_view(g[1], ATTN_F32, pl->B, Hks, N, N, pl->D);
  attn_tensor dvw = block_view(g[2], ATTN_F32, pl->B, Hks, N, N, pl->Dv);
  attn_tensor sgw = attn_tensor_view(sg + pl->rank * Hs, ATTN_F32, 1, &Hs);
  attn_tensor lw3 = lw;
  lw3.rank = 3;
  const attn_sdpa_opts u = ulysses_opts(o, pl, &alibi, &sinks, o->key_padding ? &kp_all : NULL);
  if (!st)
    st = attn_sdpa_backward(ctx, &dqw, &dkw, &dvw, NULL, sinks_grad ? &sgw : NULL, &gw, &qw, &kw, &vw, &ow, &lw3, &u);
  if ((st = agree(ctx, comm, st))) goto done;
  if ((st = heads_to_seq(ctx, comm, pl, &dqw, dq)) || (st = heads_to_seq(ctx, comm, pl, &dkw, dk)) ||
      (st = heads_to_seq(ctx, comm, pl, &dvw, dv)))
    goto done;
  if (sinks_grad) { /* each rank's heads' slice, summed into every rank's [Hq] */
    MPI_Allreduce(MPI_IN_PLACE, sg, (int)pl->Hq, MPI_FLOAT, MPI_SUM, comm);
    for (int64_t h = 0; h < pl->Hq; h++) ((float *)sinks_grad->data)[h * sinks_grad->strides[0]] = sg[h];
  }
done:
  for (int i = 0; i < 6; i++) free(m[i]);
  free(mp), free(g[0]), free(g[1]), free(g[2]), free(sg);
  return st;
}

/* ---- entry points -------------------------------------------------------------------- */
static attn_status grad_checks(attn_ctx *ctx, const attn_tensor *dq, const attn_tensor *dk, const attn_tensor *dv,
                               const attn_tensor *dout, const attn_tensor *q, const attn_tensor *k,
                               const attn_tensor *v) {
  attn_status st;
  if ((st = check4(ctx, dq, "dq")) || (st = check4(ctx, dk, "dk")) || (st = check4(ctx, dv, "dv")) ||
      (st = check4(ctx, dout, "dout")) || (st = check4(ctx, q, "q")) || (st = check4(ctx, k, "k")) ||
      (st = check4(ctx, v, "v")))
    return st;
  if ((st = same_shape(ctx, dq, "dq", q->shape[0], q->shape[1], q->shape[2], q->shape[3])) ||
      (st = same_shape(ctx, dk, "dk", k->shape[0], k->shape[1], k->shape[2], k->shape[3])) ||
      (st = same_shape(ctx, dv, "dv", v->shape[0], v->shape[1], v->shape[2], v->shape[3])))
    return st;
  return same_shape(ctx, dout, "dout", q->shape[0], q->shape[1], q->shape[2], v->shape[3]);
}

/* The caller's options over the defaults, by their size: an older attn.h's are a prefix of these. */
static attn_status read_opts(attn_ctx *ctx, attn_sdpa_opts *o, const attn_sdpa_opts *opts) {
  attn_sdpa_opts_init(o);
  if (!opts) return ATTN_OK;
  if (opts->size <= sizeof opts->size || opts->size > sizeof *o || opts->size % sizeof(size_t))
    return attn_ctx_fail(ctx, ATTN_E_INVALID, "opts.size is %zu, not the size of any attn_sdpa_opts (%zu here): "
                         "initialise with attn_sdpa_opts_init", opts->size, sizeof *o);
  memcpy((char *)o + sizeof o->size, (const char *)opts + sizeof o->size, opts->size - sizeof o->size);
  return ATTN_OK;
}

attn_status attn_mpi_sdpa(attn_ctx *ctx, MPI_Comm comm, attn_mpi_strategy strategy, attn_tensor *out,
                          attn_tensor *lse, const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                          const attn_sdpa_opts *opts) {
  attn_sdpa_opts o;
  attn_status st = read_opts(ctx, &o, opts);
  if (!st && !out) st = attn_ctx_fail(ctx, ATTN_E_INVALID, "out is NULL");
  plan pl;
  if ((st = make_plan(ctx, comm, &pl, strategy, q, k, v, lse, out, &o, 0, st))) {
    free_plan(&pl);
    return st;
  }
  if (pl.strategy == ATTN_MPI_ULYSSES) st = ulysses_forward(ctx, comm, &pl, out, lse, q, k, v, &o);
  else st = ring_forward(ctx, comm, &pl, out, lse, q, k, v, &o);
  free_plan(&pl);
  return agree(ctx, comm, st);
}

attn_status attn_mpi_sdpa_backward(attn_ctx *ctx, MPI_Comm comm, attn_mpi_strategy strategy, attn_tensor *dq,
                                   attn_tensor *dk, attn_tensor *dv, attn_tensor *sinks_grad, const attn_tensor *dout,
                                   const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                                   const attn_tensor *out, const attn_tensor *lse, const attn_sdpa_opts *opts) {
  attn_sdpa_opts o;
  attn_status st = read_opts(ctx, &o, opts);
  if (!st && (!dq || !dk || !dv || !dout || !out || !lse))
    st = attn_ctx_fail(ctx, ATTN_E_INVALID, "dq, dk, dv, dout, out and lse are required");
  if (!st) st = grad_checks(ctx, dq, dk, dv, dout, q, k, v);
  if (!st && sinks_grad && (!o.sinks || sinks_grad->dtype != ATTN_F32 || sinks_grad->rank != 1 ||
                            !q || sinks_grad->shape[0] != q->shape[1]))
    st = attn_ctx_fail(ctx, ATTN_E_SHAPE, "sinks_grad must be f32 [Hq], with sinks set");
  plan pl;
  if ((st = make_plan(ctx, comm, &pl, strategy, q, k, v, lse, out, &o, sinks_grad != NULL, st))) {
    free_plan(&pl);
    return st;
  }
  if (pl.strategy == ATTN_MPI_ULYSSES)
    st = ulysses_backward(ctx, comm, &pl, dq, dk, dv, sinks_grad, dout, q, k, v, out, lse, &o);
  else st = ring_backward(ctx, comm, &pl, dq, dk, dv, sinks_grad, dout, q, k, v, out, lse, &o);
  free_plan(&pl);
  return agree(ctx, comm, st);
}
