/* libattn_mpi under mpirun (any number of ranks): every strategy's forward
 * and backward against attn_sdpa and attn_sdpa_backward on the whole sequence,
 * which every rank computes for itself from the same seeded inputs. Uneven
 * and empty shards, GQA, causal, window, softcap, ALiBi, sinks, key padding
 * (the padded keys' K and V hold NaN) and dropout; half inputs under the
 * FP32 policy (the default bf16 tiles round each piece's probabilities). The
 * errors are summed over the ranks, so each check is the whole sequence's
 * relative L2. Then refusals: a rank with a wrong shape, ranks that disagree. */
#include "attn_mpi.h"
#include "testutil.h"

static int R, P;

typedef struct tcase {
  const char *name;
  int64_t B, Hq, Hk, N, D, Dv;
  attn_dtype dt;
  attn_causal causal;
  int64_t window;
  double softcap, dropout;
  int alibi, sinks, kpm;
  attn_mpi_strategy strategy;
  int64_t chunk;
} tcase;

/* A [B, H, N, F] tensor of dtype dt from f32 values. */
static attn_tensor make(arena *a, attn_ctx *ctx, const float *x, attn_dtype dt, int64_t B, int64_t H, int64_t N,
                        int64_t F) {
  const int64_t shape[4] = {B, H, N, F};
  attn_tensor src = attn_tensor_view((void *)x, ATTN_F32, 4, shape);
  attn_tensor t = attn_tensor_view(arena_alloc(a, (size_t)(B * H * N * F) * attn_dtype_size(dt)), dt, 4, shape);
  CHECK_OK(ctx, attn_tensor_copy(ctx, &t, &src));
  return t;
}

/* This rank's rows of a [.., .., N, F] tensor (rank 4) or [.., .., N] (rank 3): ranges [r0, r1), [r2, r3). */
static attn_tensor shard_of(arena *a, attn_ctx *ctx, const attn_tensor *g, const int64_t rg[4]) {
  const int64_t n = rg[1] - rg[0] + rg[3] - rg[2];
  int64_t shape[4];
  memcpy(shape, g->shape, sizeof shape);
  shape[2] = n;
  int64_t numel = 1;
  for (int i = 0; i < g->rank; i++) numel *= shape[i];
  attn_tensor t = attn_tensor_view(arena_alloc(a, (size_t)numel * attn_dtype_size(g->dtype)), g->dtype, g->rank, shape);
  for (int part = 0; part < 2; part++) {
    const int64_t lo = rg[2 * part], hi = rg[2 * part + 1], at = part ? rg[1] - rg[0] : 0;
    if (hi <= lo) continue;
    attn_tensor s = *g, d = t;
    s.data = (char *)g->data + (size_t)(lo * g->strides[2]) * attn_dtype_size(g->dtype), s.shape[2] = hi - lo;
    d.data = (char *)t.data + (size_t)(at * t.strides[2]) * attn_dtype_size(t.dtype), d.shape[2] = hi - lo;
    CHECK_OK(ctx, attn_tensor_copy(ctx, &d, &s));
  }
  return t;
}

/* Relative L2 of this rank's a against its rows of the reference b, summed over every rank. */
static double shard_error(const attn_tensor *a, const attn_tensor *b_shard) {
  const int64_t n = attn_tensor_numel(a);
  double *x = tu_to_f64(a), *y = tu_to_f64(b_shard), s[2] = {0, 0}, t[2];
  for (int64_t i = 0; i < n; i++) {
    const double d = x[i] - y[i];
    s[0] += isnan(d) ? INFINITY : d * d;
    s[1] += y[i] * y[i];
  }
  free(x), free(y);
  MPI_Allreduce(s, t, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return t[1] > 0 ? sqrt(t[0] / t[1]) : sqrt(t[0]);
}

static void run_case(attn_ctx *ctx, const tcase *c, int idx) {
  arena a = {0};
  tu_rng rng = {0x5eed0000u + (uint64_t)idx};
  const int64_t B = c->B, Hq = c->Hq, Hk = c->Hk, N = c->N, D = c->D, Dv = c->Dv;
  float *q = arena_alloc(&a, (size_t)(B * Hq * N * D) * 4), *k = arena_alloc(&a, (size_t)(B * Hk * N * D) * 4);
  float *v = arena_alloc(&a, (size_t)(B * Hk * N * Dv) * 4), *g = arena_alloc(&a, (size_t)(B * Hq * N * Dv) * 4);
  tu_fill_f32(&rng, q, B * Hq * N * D, 1.5);
  tu_fill_f32(&rng, k, B * Hk * N * D, 1.5);
  tu_fill_f32(&rng, v, B * Hk * N * Dv, 1.0);
  tu_fill_f32(&rng, g, B * Hq * N * Dv, 1.0);
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.causal = c->causal, o.window = c->window, o.softcap = c->softcap, o.chunk = c->chunk;
  o.dropout_p = c->dropout, o.dropout_seed = 1234 + (uint64_t)idx;
  float *slopes = arena_alloc(&a, (size_t)Hq * 4), *sinks = arena_alloc(&a, (size_t)Hq * 4);
  attn_tensor slopes_t = attn_tensor_view(slopes, ATTN_F32, 1, &Hq), sinks_t = attn_tensor_view(sinks, ATTN_F32, 1, &Hq);
  if (c->alibi) {
    CHECK_OK(ctx, attn_alibi_slopes(slopes, Hq));
    o.alibi_slopes = &slopes_t;
  }
  if (c->sinks) tu_fill_f32(&rng, sinks, Hq, 2.0), o.sinks = &sinks_t;
  uint8_t *kp = arena_alloc(&a, (size_t)(B * N));
  const int64_t kp_shape[2] = {B, N};
  attn_tensor kp_t = attn_tensor_view(kp, ATTN_U8, 2, kp_shape);
  if (c->kpm) {
    for (int64_t b = 0; b < B; b++)
      for (int64_t j = 0; j < N; j++) {
        kp[b * N + j] = tu_int(&rng, 0, 4) == 0;
        if (!kp[b * N + j]) continue;
        for (int64_t h = 0; h < Hk; h++) { /* a padded key is never read */
          tu_poison_f32(k + ((b * Hk + h) * N + j) * D, D);
          tu_poison_f32(v + ((b * Hk + h) * N + j) * Dv, Dv);
        }
      }
    o.key_padding = &kp_t;
  }
  const attn_tensor qg = make(&a, ctx, q, c->dt, B, Hq, N, D), kg = make(&a, ctx, k, c->dt, B, Hk, N, D);
  const attn_tensor vg = make(&a, ctx, v, c->dt, B, Hk, N, Dv), gg = make(&a, ctx, g, ATTN_F32, B, Hq, N, Dv);
  /* the whole sequence in one process */
  const int64_t lse_shape[3] = {B, Hq, N};
  attn_tensor ref_out = make(&a, ctx, g, ATTN_F32, B, Hq, N, Dv);
  attn_tensor ref_lse = attn_tensor_view(arena_alloc(&a, (size_t)(B * Hq * N) * 4), ATTN_F32, 3, lse_shape);
  CHECK_OK(ctx, attn_sdpa(ctx, &ref_out, &ref_lse, NULL, &qg, &kg, &vg, &o));
  attn_tensor ref_dq = make(&a, ctx, q, ATTN_F32, B, Hq, N, D), ref_dk = make(&a, ctx, k, ATTN_F32, B, Hk, N, D);
  attn_tensor ref_dv = make(&a, ctx, v, ATTN_F32, B, Hk, N, Dv);
  float *ref_sg = arena_alloc(&a, (size_t)Hq * 4);
  attn_tensor ref_sg_t = attn_tensor_view(ref_sg, ATTN_F32, 1, &Hq);
  CHECK_OK(ctx, attn_sdpa_backward(ctx, &ref_dq, &ref_dk, &ref_dv, NULL, c->sinks ? &ref_sg_t : NULL, &gg, &qg, &kg, &vg,
                                   &ref_out, &ref_lse, &o));
  /* this rank's shard */
  int64_t rg[4] = {0, 0, 0, 0};
  if (c->strategy == ATTN_MPI_ZIGZAG) {
    CHECK_OK(ctx, attn_mpi_zigzag_range(N, P, R, rg));
  } else { /* P - 1 random cuts, the same on every rank: uneven shards, some perhaps empty */
    tu_rng cut = {0xc0ffeeu + (uint64_t)idx};
    int64_t cuts[65] = {0};
    for (int r = 1; r < P && r < 64; r++) cuts[r] = tu_int(&cut, 0, N);
    cuts[P] = N;
    for (int r = 1; r < P; r++) /* insertion sort */
      for (int s = r; s > 1 && cuts[s - 1] > cuts[s]; s--) {
        const int64_t t = cuts[s];
        cuts[s] = cuts[s - 1], cuts[s - 1] = t;
      }
    rg[0] = cuts[R], rg[1] = cuts[R + 1], rg[2] = rg[3] = rg[1];
  }
  const attn_tensor ql = shard_of(&a, ctx, &qg, rg), kl = shard_of(&a, ctx, &kg, rg), vl = shard_of(&a, ctx, &vg, rg);
  const attn_tensor gl = shard_of(&a, ctx, &gg, rg);
  const int64_t n = ql.shape[2];
  attn_tensor kpl;
  if (c->kpm) { /* [B, n]: this rank's tokens' padding */
    uint8_t *d = arena_alloc(&a, (size_t)(B * n + 1));
    for (int64_t b = 0; b < B; b++)
      for (int64_t i = 0, j = 0; i < N; i++)
        if ((i >= rg[0] && i < rg[1]) || (i >= rg[2] && i < rg[3])) d[b * n + j++] = kp[b * N + i];
    const int64_t s2[2] = {B, n};
    kpl = attn_tensor_view(d, ATTN_U8, 2, s2);
    o.key_padding = &kpl;
  }
  float *poison = arena_alloc(&a, (size_t)(B * Hq * (n + 1) * (D > Dv ? D : Dv)) * 4);
  tu_poison_f32(poison, B * Hq * (n + 1) * (D > Dv ? D : Dv));
  attn_tensor out = make(&a, ctx, poison, ATTN_F32, B, Hq, n, Dv);
  const int64_t ls[3] = {B, Hq, n};
  attn_tensor lse = attn_tensor_view(arena_alloc(&a, (size_t)(B * Hq * n + 1) * 4), ATTN_F32, 3, ls);
  tu_poison_f32(lse.data, B * Hq * n);
  if (c->strategy == ATTN_MPI_ULYSSES && Hk % P) { /* every rank is told, none computes */
    CHECK_ERR(ctx, attn_mpi_sdpa(ctx, MPI_COMM_WORLD, c->strategy, &out, &lse, &ql, &kl, &vl, &o), ATTN_E_UNSUPPORTED,
              "divide");
    arena_free(&a);
    return;
  }
  CHECK_OK(ctx, attn_mpi_sdpa(ctx, MPI_COMM_WORLD, c->strategy, &out, &lse, &ql, &kl, &vl, &o));
  const attn_tensor ref_out_l = shard_of(&a, ctx, &ref_out, rg), ref_lse_l = shard_of(&a, ctx, &ref_lse, rg);
  const double e_out = shard_error(&out, &ref_out_l), e_lse = shard_error(&lse, &ref_lse_l);
  /* ULYSSES's forward computes each head whole, as one process does: bitwise. (Its backward splits
   * dK and dV's sums over query groups by how much work there is, and it has fewer heads.) */
  const double tol = attn_mpi_auto_strategy(Hk, P, &o) == ATTN_MPI_ULYSSES && c->strategy != ATTN_MPI_RING &&
                             c->strategy != ATTN_MPI_ZIGZAG
                         ? 0
                         : 1e-6;
  CHECK(e_out <= tol && e_lse <= tol, "%s (%d ranks): out %.2e, lse %.2e", c->name, P, e_out, e_lse);
  attn_tensor dq = make(&a, ctx, poison, ATTN_F32, B, Hq, n, D), dk = make(&a, ctx, poison, ATTN_F32, B, Hk, n, D);
  attn_tensor dv = make(&a, ctx, poison, ATTN_F32, B, Hk, n, Dv);
  float *sg = arena_alloc(&a, (size_t)Hq * 4);
  attn_tensor sg_t = attn_tensor_view(sg, ATTN_F32, 1, &Hq);
  CHECK_OK(ctx, attn_mpi_sdpa_backward(ctx, MPI_COMM_WORLD, c->strategy, &dq, &dk, &dv, c->sinks ? &sg_t : NULL, &gl,
                                       &ql, &kl, &vl, &out, &lse, &o));
  const attn_tensor rdq = shard_of(&a, ctx, &ref_dq, rg), rdk = shard_of(&a, ctx, &ref_dk, rg),
                    rdv = shard_of(&a, ctx, &ref_dv, rg);
  const double e_dq = shard_error(&dq, &rdq), e_dk = shard_error(&dk, &rdk), e_dv = shard_error(&dv, &rdv);
  CHECK(e_dq <= 1e-6 && e_dk <= 1e-6 && e_dv <= 1e-6, "%s (%d ranks): dq %.2e, dk %.2e, dv %.2e", c->name, P,
        e_dq, e_dk, e_dv);
  if (c->sinks) {
    double num = 0, den = 0;
    for (int64_t h = 0; h < Hq; h++) num += (sg[h] - ref_sg[h]) * (sg[h] - ref_sg[h]), den += ref_sg[h] * ref_sg[h];
    CHECK(sqrt(num / (den > 0 ? den : 1)) <= 1e-6, "%s: sinks_grad %.2e", c->name, sqrt(num / (den > 0 ? den : 1)));
  }
  if (R == 0)
    printf("%-28s %d ranks %-7s out %.1e lse %.1e dq %.1e dk %.1e dv %.1e\n", c->name, P,
           attn_mpi_strategy_name(c->strategy), e_out, e_lse, e_dq, e_dk, e_dv);
  arena_free(&a);
}

/* attn_mpi_shard_range: every token in exactly one shard, in the layout of its strategy. */
static void shard_ranges(void) {
  const attn_mpi_strategy all[4] = {ATTN_MPI_AUTO, ATTN_MPI_RING, ATTN_MPI_ZIGZAG, ATTN_MPI_ULYSSES};
  for (int s = 0; s < 4; s++)
    for (int p = 1; p <= 7; p++)
      for (int64_t N = 0; N <= 40; N += 3) {
        int seen[41] = {0}, ok = 1;
        int64_t prev_end = 0;
        for (int r = 0; r < p; r++) {
          int64_t rg[4], zz[4];
          CHECK(attn_mpi_shard_range(all[s], N, p, r, rg) == ATTN_OK, "shard_range %d %d %lld", s, r, (long long)N);
          for (int part = 0; part < 2; part++)
            for (int64_t t = rg[2 * part]; t < rg[2 * part + 1]; t++) ok &= t >= 0 && t < N && !seen[t]++;
          if (all[s] == ATTN_MPI_ZIGZAG) {
            attn_mpi_zigzag_range(N, p, r, zz);
            ok &= !memcmp(zz, rg, sizeof rg);
          } else { /* contiguous, in rank order, sizes differing by at most one */
            const int64_t size = rg[1] - rg[0];
            ok &= rg[0] == prev_end && rg[2] == rg[1] && rg[3] == rg[1] && (size == N / p || size == N / p + 1);
            prev_end = rg[1];
          }
        }
        for (int64_t t = 0; t < N; t++) ok &= seen[t] == 1;
        CHECK(ok, "shard_range: strategy %d, %d ranks, %lld tokens", (int)all[s], p, (long long)N);
      }
  /* attn_mpi_shard and attn_mpi_unshard: every rank's shard taken out and put back rebuilds the whole,
   * each shard holding its ranges' tokens in order; a whole poisoned with NaN is overwritten exactly */
  attn_ctx *ctx;
  CHECK_OK(NULL, attn_ctx_create(&ctx));
  const int64_t B = 2, H = 3, F = 5, N = 37;
  float whole[2 * 3 * 37 * 5], back[2 * 3 * 37 * 5], part[2 * 3 * 37 * 5];
  for (int64_t i = 0; i < B * H * N * F; i++) whole[i] = (float)i;
  const int64_t ws[4] = {B, H, N, F};
  const attn_tensor wt = attn_tensor_view(whole, ATTN_F32, 4, ws);
  for (int s = 0; s < 4; s++)
    for (int p = 1; p <= 5; p++) {
      for (int64_t i = 0; i < B * H * N * F; i++) back[i] = NAN;
      attn_tensor bt = attn_tensor_view(back, ATTN_F32, 4, ws);
      int ok = 1;
      for (int r = 0; r < p; r++) {
        int64_t rg[4];
        attn_mpi_shard_range(all[s], N, p, r, rg);
        const int64_t n = rg[1] - rg[0] + rg[3] - rg[2], ps[4] = {B, H, n, F};
        attn_tensor pt = attn_tensor_view(part, ATTN_F32, 4, ps);
        CHECK_OK(ctx, attn_mpi_shard(ctx, &pt, &wt, all[s], p, r));
        for (int64_t bh = 0; bh < B * H; bh++)
          for (int64_t j = 0; j < n; j++) {
            const int64_t tok = j < rg[1] - rg[0] ? rg[0] + j : rg[2] + j - (rg[1] - rg[0]);
            for (int64_t f = 0; f < F; f++) ok &= part[(bh * n + j) * F + f] == whole[(bh * N + tok) * F + f];
          }
        CHECK_OK(ctx, attn_mpi_unshard(ctx, &bt, &pt, all[s], p, r));
      }
      CHECK(ok && !memcmp(back, whole, sizeof whole), "shard/unshard: strategy %d, %d ranks", (int)all[s], p);
    }
  {
    const int64_t bad[4] = {B, H, 5, F};
    attn_tensor pt = attn_tensor_view(part, ATTN_F32, 4, bad);
    CHECK_ERR(ctx, attn_mpi_shard(ctx, &pt, &wt, ATTN_MPI_ZIGZAG, 2, 0), ATTN_E_SHAPE, "holds 19 of the 37");
    CHECK_ERR(ctx, attn_mpi_unshard(ctx, &pt, &wt, ATTN_MPI_RING, 2, 3), ATTN_E_INVALID, "no shard 3 of 2");
  }
  attn_ctx_destroy(ctx);
  int64_t rg[4];
  CHECK(attn_mpi_shard_range(ATTN_MPI_RING, 10, 2, 2, rg) == ATTN_E_INVALID, "rank out of range");
  CHECK(attn_mpi_shard_range(ATTN_MPI_RING, -1, 2, 0, rg) == ATTN_E_INVALID, "negative N");
  CHECK(attn_mpi_shard_range((attn_mpi_strategy)9, 10, 2, 0, rg) == ATTN_E_INVALID, "unknown strategy");
  CHECK(attn_mpi_shard_range(ATTN_MPI_ZIGZAG, 10, 0, 0, rg) == ATTN_E_INVALID, "no ranks");
}

/* Every rank gets the refusal of the one rank whose arguments are wrong. */
static void refusals(attn_ctx *ctx) {
  arena a = {0};
  const int64_t B = 1, H = 2, n = 8, D = 16;
  float *x = arena_alloc(&a, (size_t)(B * H * n * 32) * 4);
  const int64_t good[4] = {B, H, n, D}, bad[4] = {B, H, n, D + 1}, ls[3] = {B, H, n};
  const attn_tensor q = attn_tensor_view(x, ATTN_F32, 4, good), kb = attn_tensor_view(x, ATTN_F32, 4, R == P - 1 ? bad : good);
  attn_tensor out = attn_tensor_view(arena_alloc(&a, (size_t)(B * H * n * D) * 4), ATTN_F32, 4, good);
  attn_tensor lse = attn_tensor_view(arena_alloc(&a, (size_t)(B * H * n) * 4), ATTN_F32, 3, ls);
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  char want[32];
  snprintf(want, sizeof want, "rank %d:", P - 1);
  CHECK_ERR(ctx, attn_mpi_sdpa(ctx, MPI_COMM_WORLD, ATTN_MPI_RING, &out, &lse, &q, &kb, &q, &o), ATTN_E_SHAPE, want);
  /* ranks that disagree on an option: each rank's own arguments are fine */
  o.causal = R == 0 ? ATTN_CAUSAL_TOP_LEFT : ATTN_CAUSAL_NONE;
  if (P > 1) CHECK_ERR(ctx, attn_mpi_sdpa(ctx, MPI_COMM_WORLD, ATTN_MPI_RING, &out, &lse, &q, &q, &q, &o), ATTN_E_SHAPE, "disagree");
  o.causal = ATTN_CAUSAL_NONE;
  /* zigzag with shards of the wrong sizes (every rank holds 8: right only when 8 P tokens cut evenly) */
  if (P > 1) {
    const int64_t odd[4] = {B, H, R == 0 ? 3 : n, D};
    const attn_tensor qo = attn_tensor_view(x, ATTN_F32, 4, odd);
    attn_tensor oo = attn_tensor_view(out.data, ATTN_F32, 4, odd);
    CHECK_ERR(ctx, attn_mpi_sdpa(ctx, MPI_COMM_WORLD, ATTN_MPI_ZIGZAG, &oo, NULL, &qo, &qo, &qo, &o), ATTN_E_SHAPE,
              "zigzag");
  }
  /* a mask tensor is refused on every rank */
  o.mask = &q;
  CHECK_ERR(ctx, attn_mpi_sdpa(ctx, MPI_COMM_WORLD, ATTN_MPI_RING, &out, &lse, &q, &q, &q, &o), ATTN_E_UNSUPPORTED,
            "mask");
  arena_free(&a);
}

int main(int argc, char **argv) {
  /* "serialized": the ring's helper thread moves the blocks (else polls between calls) */
  const int serialized = argc > 1 && !strcmp(argv[1], "serialized");
  int level;
  if (serialized) MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &level);
  else MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &R);
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx) != ATTN_OK) return 2;
  attn_ctx_set_threads(ctx, 1);
  attn_ctx_set_precision(ctx, ATTN_PRECISION_FP32);
  const tcase cases[] = {
      {"plain", 1, 2, 2, 61, 32, 32, ATTN_F32, ATTN_CAUSAL_NONE, 0, 0, 0, 0, 0, 0, ATTN_MPI_RING, 0},
      {"causal gqa", 2, 4, 2, 97, 32, 16, ATTN_F32, ATTN_CAUSAL_TOP_LEFT, 0, 0, 0, 0, 0, 0, ATTN_MPI_RING, 0},
      {"causal zigzag", 1, 4, 1, 130, 64, 64, ATTN_F32, ATTN_CAUSAL_TOP_LEFT, 0, 0, 0, 0, 0, 0, ATTN_MPI_ZIGZAG, 0},
      {"window alibi softcap", 1, 4, 2, 120, 32, 32, ATTN_F32, ATTN_CAUSAL_BOTTOM_RIGHT, 23, 20, 0, 1, 0, 0,
       ATTN_MPI_RING, 0},
      {"window zigzag sinks", 1, 2, 2, 77, 16, 32, ATTN_F32, ATTN_CAUSAL_TOP_LEFT, 19, 0, 0, 0, 1, 0, ATTN_MPI_ZIGZAG, 0},
      {"key padding (NaN keys)", 2, 2, 1, 90, 32, 32, ATTN_F32, ATTN_CAUSAL_NONE, 0, 0, 0, 0, 0, 1, ATTN_MPI_RING, 0},
      {"dropout causal", 1, 2, 2, 70, 32, 32, ATTN_F32, ATTN_CAUSAL_TOP_LEFT, 0, 0, 0.2, 1, 0, 0, ATTN_MPI_ZIGZAG, 0},
      {"bf16 causal", 1, 4, 2, 100, 64, 64, ATTN_BF16, ATTN_CAUSAL_TOP_LEFT, 0, 0, 0, 0, 0, 0, ATTN_MPI_RING, 0},
      {"f16 zigzag sinks kpm", 1, 2, 1, 64, 32, 32, ATTN_F16, ATTN_CAUSAL_TOP_LEFT, 0, 0, 0, 0, 1, 1, ATTN_MPI_ZIGZAG, 0},
      {"auto", 1, 4, 4, 50, 32, 32, ATTN_F32, ATTN_CAUSAL_TOP_LEFT, 0, 0, 0, 1, 1, 0, ATTN_MPI_AUTO, 0},
      {"ulysses gqa kpm window", 2, 24, 12, 45, 16, 32, ATTN_F32, ATTN_CAUSAL_TOP_LEFT, 9, 0, 0, 1, 1, 1,
       ATTN_MPI_ULYSSES, 0},
      {"ulysses bf16 softcap", 1, 12, 12, 66, 32, 16, ATTN_BF16, ATTN_CAUSAL_NONE, 0, 30, 0, 0, 0, 0, ATTN_MPI_ULYSSES, 0},
      {"ulysses dropout gqa alibi", 2, 24, 12, 57, 32, 32, ATTN_F32, ATTN_CAUSAL_TOP_LEFT, 0, 0, 0.25, 1, 0, 0,
       ATTN_MPI_ULYSSES, 0},
      /* Llama 4's chunks: counted from the whole sequence's first token, not a shard's */
      {"chunk ring", 1, 4, 2, 120, 32, 32, ATTN_F32, ATTN_CAUSAL_TOP_LEFT, 0, 0, 0, 0, 0, 0, ATTN_MPI_RING, 17},
      {"chunk window zigzag alibi", 1, 2, 2, 130, 16, 16, ATTN_F32, ATTN_CAUSAL_TOP_LEFT, 23, 0, 0, 1, 0, 0,
       ATTN_MPI_ZIGZAG, 40},
      {"chunk ulysses kpm", 2, 24, 12, 45, 16, 32, ATTN_F32, ATTN_CAUSAL_NONE, 0, 0, 0, 0, 1, 1, ATTN_MPI_ULYSSES, 8},
      /* shards past POLL_ROWS (1024): without the helper thread a step runs in several pieces */
      {"long shards causal gqa", 1, 2, 1, 4300, 16, 16, ATTN_F32, ATTN_CAUSAL_TOP_LEFT, 0, 0, 0, 0, 0, 0, ATTN_MPI_RING, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(ctx, &cases[i], (int)i);
  refusals(ctx);
  shard_ranges();
  int fails = tu_failures, all;
  MPI_Allreduce(&fails, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (R == 0) printf("test_mpi (%d ranks): %d checks on rank 0, %d failed on all ranks\n", P, tu_checks, all);
  attn_ctx_destroy(ctx);
  MPI_Finalize();
  return all ? 1 : 0;
}
