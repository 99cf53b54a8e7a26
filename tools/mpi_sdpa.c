/* attn mpi-sdpa: attn sdpa over MPI ranks (libattn_mpi), on whole-sequence files.
 *
 *   mpirun -np P attn mpi-sdpa --q Q.npy --k K.npy --v V.npy --out O.npy [--causal] [--window W] [--chunk C]
 *          [--softcap C] [--alibi] [--dropout P --seed S] [--scale S] [--threads T]
 *          [--strategy ring|zigzag|ulysses|auto] [--lse-out L.npy]
 *          [--grad-out G.npy --dq-out DQ.npy --dk-out DK.npy --dv-out DV.npy]
 * The arrays are whole sequences, [B, H, N, D] as for attn sdpa. Each rank
 * reads only its own shard's rows of each (attn_npy_read_slice: ZIGZAG its
 * two chunks, else N / P rows, the first N % P ranks one more); rank 0
 * gathers the results and writes them, so the files are those attn sdpa
 * writes (within rounding: see attn_mpi.h). Outputs are staged and renamed
 * only once every rank has succeeded. A failure is one line on rank 0's
 * stderr, the first failing rank's (the other ranks' stderr is held until
 * then), and every rank exits non-zero. */
#include "cli.h"
#include "commands.h"

#ifdef ATTN_HAVE_MPI
#include "attn_mpi.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Ranks other than 0 write their errors here; the first failing rank's reaches rank 0's stderr. */
static FILE *held_stderr, *real_stderr;
static char *held_text;
static size_t held_len;

/* 0 on every rank when every rank's r is 0; else the largest code, everywhere,
 * and the first failing rank's message printed by rank 0 (rank 0's own was). */
static int all_agree(int r) {
  int rank, P, worst, first;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  MPI_Allreduce(&r, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (!worst) return 0;
  int mine = r ? rank : P;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (first > 0 && first < P) {
    char line[512] = "";
    if (rank == first && held_stderr) {
      fflush(held_stderr);
      snprintf(line, sizeof line, "%s", held_text ? held_text : "");
    }
    MPI_Bcast(line, (int)sizeof line, MPI_CHAR, first, MPI_COMM_WORLD);
    if (rank == 0) {
      line[strcspn(line, "\n")] = '\0';
      fprintf(stderr, "%s%s\n", line[0] ? "" : "attn: ", line[0] ? line : "a rank failed");
    }
  }
  return worst;
}

/* This rank's rows of flag's file: ranges rg (the second may be empty), concatenated along dim 2. */
static int read_shard(attn_ctx *ctx, attn_tensor *t, const char *path, const char *flag, const int64_t rg[4]) {
  attn_tensor a = {0}, b = {0};
  if (attn_npy_read_slice(ctx, &a, path, 2, rg[0], rg[1] - rg[0]) ||
      (rg[3] > rg[2] && attn_npy_read_slice(ctx, &b, path, 2, rg[2], rg[3] - rg[2]))) {
    attn_tensor_free(&a);
    return cli_fail(CLI_EXIT_FAIL, "%s: %s", flag, attn_ctx_error(ctx));
  }
  if (a.dtype == ATTN_F64 || b.dtype == ATTN_F64) {
    attn_tensor_free(&a), attn_tensor_free(&b);
    return cli_fail(CLI_EXIT_FAIL, "%s: float64 is not taken here (save f32, f16 or bf16)", flag);
  }
  if (!b.data) {
    *t = a;
    return 0;
  }
  int64_t shape[4] = {a.shape[0], a.shape[1], a.shape[2] + b.shape[2], a.shape[3]};
  if (attn_tensor_alloc(ctx, t, a.dtype, 4, shape)) {
    attn_tensor_free(&a), attn_tensor_free(&b);
    return cli_fail(CLI_EXIT_FAIL, "out of memory");
  }
  attn_tensor d0 = *t, d1 = *t;
  d0.shape[2] = a.shape[2];
  d1.data = (char *)t->data + (size_t)(a.shape[2] * t->strides[2]) * attn_dtype_size(t->dtype), d1.shape[2] = b.shape[2];
  const int bad = attn_tensor_copy(ctx, &d0, &a) || attn_tensor_copy(ctx, &d1, &b);
  attn_tensor_free(&a), attn_tensor_free(&b);
  return bad ? cli_fail(CLI_EXIT_FAIL, "%s: %s", flag, attn_ctx_error(ctx)) : 0;
}

/* Every rank's shard of a f32 [B, H, n, F] (or [B, H, n]) tensor, into rank 0's whole [.., N, ..]. */
static int gather(attn_ctx *ctx, attn_tensor *whole, const attn_tensor *mine, int64_t N, int P, int rank,
                  attn_mpi_strategy layout) {
  const int r3 = mine->rank == 3;
  const int64_t B = mine->shape[0], H = mine->shape[1], F = r3 ? 1 : mine->shape[3];
  const size_t row = (size_t)(B * H * F) * sizeof(float);
  int *cnt = calloc(2 * (size_t)P, sizeof *cnt), *dsp = cnt ? cnt + P : NULL;
  int64_t *rows = calloc((size_t)P, sizeof *rows);
  float *buf = rank == 0 ? malloc(row * (size_t)(N > 0 ? N : 1)) : NULL;
  int r = cnt && rows && (rank || buf) ? 0 : cli_fail(CLI_EXIT_FAIL, "out of memory");
  if ((r = all_agree(r))) goto done;
  const int64_t n = mine->shape[2];
  MPI_Gather(&n, 1, MPI_INT64_T, rows, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
  for (int t = 0, off = 0; t < P; t++) cnt[t] = (int)(row * (size_t)rows[t]), dsp[t] = off, off += cnt[t];
  MPI_Gatherv(mine->data, (int)(row * (size_t)n), MPI_BYTE, buf, cnt, dsp, MPI_BYTE, 0, MPI_COMM_WORLD);
  if (rank == 0) { /* rank t's [B, H, n_t, F] block, its rows at their places in the sequence */
    int64_t shape[4] = {B, H, N, F};
    if ((r = cli_alloc_f32(ctx, whole, mine->rank, shape)) == 0) {
      for (int t = 0, base = 0; t < P && !r; t++) {
        const int64_t part_shape[4] = {B, H, rows[t], F};
        const attn_tensor part = attn_tensor_view((char *)buf + base, ATTN_F32, mine->rank, part_shape);
        if (attn_mpi_unshard(ctx, whole, &part, layout, P, t))
          r = cli_fail(CLI_EXIT_FAIL, "gathering the result: %s", attn_ctx_error(ctx));
        base += cnt[t];
      }
    }
  }
  r = all_agree(r);
done:
  free(cnt), free(rows), free(buf);
  return r;
}

int cmd_mpi_sdpa(int argc, char **argv) {
  static const char *const known[] = {"--q", "--k", "--v", "--out", "--lse-out", "--scale", "--threads", "--grad-out",
                                      "--dq-out", "--dk-out", "--dv-out", "--dropout", "--seed", "--window", "--chunk",
                                      "--softcap", "--strategy", NULL};
  static const char *const switches[] = {"--causal", "--alibi", NULL};
  static const char *const out_flags[] = {"--out", "--lse-out", "--dq-out", "--dk-out", "--dv-out", NULL};
  static const char *const in_flags[] = {"--q", "--k", "--v", "--grad-out", NULL};
  int level, rank = 0, P = 1, inited = 0;
  MPI_Initialized(&inited);
  if (!inited) MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &level);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  if (rank != 0) { /* one line on stderr in all: rank 0's */
    fflush(stderr);
    real_stderr = stderr;
    held_stderr = open_memstream(&held_text, &held_len);
    if (held_stderr) stderr = held_stderr;
  }
  cli_args a;
  int r = cli_parse(&a, argc, argv, known, switches);
  const char *need[] = {"--q", "--k", "--v", "--out"};
  for (int i = 0; i < 4 && !r; i++)
    if (!cli_get(&a, need[i]) || !*cli_get(&a, need[i])) r = cli_fail(CLI_EXIT_USAGE, "mpi-sdpa needs %s", need[i]);
  attn_causal causal = ATTN_CAUSAL_NONE;
  double scale = NAN, dropout = 0, softcap = 0;
  uint64_t seed = 0;
  int64_t window = 0, chunk = 0;
  if (!r && !(r = cli_parse_causal(&a, &causal)) && !(r = cli_double(&a, "--scale", &scale)) &&
      !(r = cli_parse_dropout(&a, &dropout, &seed)))
    r = cli_parse_band_softcap(&a, &window, &chunk, &softcap);
  attn_mpi_strategy strategy = ATTN_MPI_AUTO;
  const char *sname = r ? NULL : cli_get(&a, "--strategy");
  if (sname) {
    if (!strcmp(sname, "ring")) strategy = ATTN_MPI_RING;
    else if (!strcmp(sname, "zigzag")) strategy = ATTN_MPI_ZIGZAG;
    else if (!strcmp(sname, "ulysses")) strategy = ATTN_MPI_ULYSSES;
    else if (strcmp(sname, "auto")) r = cli_fail(CLI_EXIT_USAGE, "--strategy wants ring, zigzag, ulysses or auto");
  }
  const int backward = !r && cli_has(&a, "--grad-out");
  if (!r && backward != (cli_has(&a, "--dq-out") || cli_has(&a, "--dk-out") || cli_has(&a, "--dv-out")))
    r = cli_fail(CLI_EXIT_USAGE, "--grad-out and --dq-out/--dk-out/--dv-out go together");
  attn_ctx *ctx = NULL;
  cli_outputs outs;
  memset(&outs, 0, sizeof outs);
  attn_tensor q = {0}, k = {0}, v = {0}, g = {0}, out = {0}, lse = {0}, dq = {0}, dk = {0}, dv = {0}, info = {0};
  attn_tensor slopes = {0}, whole = {0};
  if (!r) r = cli_setup_ctx(&ctx, &a);
  if (!r && rank == 0) r = cli_outputs_plan(&outs, &a, out_flags, in_flags); /* rank 0 writes */
  if ((r = all_agree(r))) goto done;
  /* every rank learns N from q's header and reads its rows of each file */
  if (attn_npy_info(ctx, &info, cli_get(&a, "--q")) || info.rank != 4)
    r = cli_fail(CLI_EXIT_FAIL, "--q: %s", info.rank != 4 && !attn_ctx_error(ctx)[0] ? "must be [B, H, N, D]"
                                                                                      : attn_ctx_error(ctx));
  if ((r = all_agree(r))) goto done;
  const int64_t N = info.shape[2];
  int64_t rg[4] = {0, 0, 0, 0};
  const attn_mpi_strategy ran = strategy == ATTN_MPI_AUTO ? attn_mpi_auto_strategy(0, P, NULL) : strategy;
  attn_mpi_shard_range(ran, N, P, rank, rg);
  r = read_shard(ctx, &q, cli_get(&a, "--q"), "--q", rg);
  if (!r) r = read_shard(ctx, &k, cli_get(&a, "--k"), "--k", rg);
  if (!r) r = read_shard(ctx, &v, cli_get(&a, "--v"), "--v", rg);
  if (!r && backward) r = read_shard(ctx, &g, cli_get(&a, "--grad-out"), "--grad-out", rg);
  if (!r && (k.rank != 4 || v.rank != 4 || k.shape[2] != q.shape[2] || v.shape[2] != q.shape[2]))
    r = cli_fail(CLI_EXIT_FAIL, "--k and --v must be [B, Hk, N, D] with q's N = %lld", (long long)N);
  if ((r = all_agree(r))) goto done;
  attn_sdpa_opts o;
  attn_sdpa_opts_init(&o);
  o.scale = scale, o.causal = causal, o.dropout_p = dropout, o.dropout_seed = seed, o.window = window, o.chunk = chunk;
  o.softcap = softcap;
  if (cli_has(&a, "--alibi")) {
    if ((r = cli_load_head_options(ctx, &a, q.shape[1], &slopes, NULL)) == 0) o.alibi_slopes = &slopes;
  }
  int64_t os[4] = {q.shape[0], q.shape[1], q.shape[2], v.shape[3]};
  if (!r) r = cli_alloc_f32(ctx, &out, 4, os);
  if (!r) r = cli_alloc_f32(ctx, &lse, 3, q.shape);
  if ((r = all_agree(r))) goto done;
  /* a refusal comes back on every rank: the rank whose arguments were wrong says so */
  if (attn_mpi_sdpa(ctx, MPI_COMM_WORLD, strategy, &out, &lse, &q, &k, &v, &o)) {
    r = rank == 0 ? cli_fail(CLI_EXIT_FAIL, "mpi-sdpa: %s", attn_ctx_error(ctx)) : CLI_EXIT_FAIL;
    goto done;
  }
  if (backward) {
    r = cli_alloc_f32(ctx, &dq, 4, q.shape);
    if (!r) r = cli_alloc_f32(ctx, &dk, 4, k.shape);
    if (!r) r = cli_alloc_f32(ctx, &dv, 4, v.shape);
    if ((r = all_agree(r))) goto done;
    if (attn_mpi_sdpa_backward(ctx, MPI_COMM_WORLD, strategy, &dq, &dk, &dv, NULL, &g, &q, &k, &v, &out, &lse, &o)) {
      r = rank == 0 ? cli_fail(CLI_EXIT_FAIL, "mpi-sdpa backward: %s", attn_ctx_error(ctx)) : CLI_EXIT_FAIL;
      goto done;
    }
  }
  /* rank 0 gathers each output and stages it; the renames come once all are written */
  const char *flags[5] = {"--out", "--lse-out", "--dq-out", "--dk-out", "--dv-out"};
  attn_tensor *parts[5] = {&out, &lse, &dq, &dk, &dv};
  for (int i = 0; i < 5; i++) {
    if (!cli_has(&a, flags[i])) continue;
    if ((r = gather(ctx, &whole, parts[i], N, P, rank, ran))) goto done;
    if (rank == 0) r = cli_write_npy(ctx, &outs, flags[i], &whole);
    attn_tensor_free(&whole);
    if ((r = all_agree(r))) goto done;
  }
  if (rank == 0) r = cli_outputs_commit(&outs);
  r = all_agree(r);
done:
  if (rank == 0) cli_outputs_free(&outs);
  attn_tensor *all[] = {&q, &k, &v, &g, &out, &lse, &dq, &dk, &dv, &slopes, &whole};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) attn_tensor_free(all[i]);
  attn_ctx_destroy(ctx);
  if (held_stderr) {
    stderr = real_stderr;
    fclose(held_stderr);
    free(held_text);
    held_stderr = NULL, held_text = NULL;
  }
  if (!inited) MPI_Finalize();
  return r;
}
#else
int cmd_mpi_sdpa(int argc, char **argv) {
  (void)argc, (void)argv;
  return cli_fail(CLI_EXIT_FAIL, "mpi-sdpa: this attn was built without MPI (install Open MPI and rebuild)");
}
#endif
