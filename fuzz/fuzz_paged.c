/* libFuzzer harness: the paged KV cache as a state machine, against a model
 * of what it holds. The input's bytes pick the pool (block size, blocks,
 * kv heads, head dims, the key and value storage of every kind), a kernel this
 * CPU has and 1 to 3 threads, then a run of operations: new, free, fork,
 * truncate, append (to several sequences at once, uneven counts) and attend
 * (decode-sized and prefill steps over several sequences, with window,
 * softcap, ALiBi, sinks and scale). The model keeps each live sequence's
 * tokens as the storage gives them back (rounded to f16/bf16, or through
 * attn_kv_quantize and attn_kv_dequantize). After every operation:
 *   - each call's status is the one the model expects (a refused call, a full
 *     pool or too many sequences, changes nothing), a failure has a message;
 *   - every live sequence's length and block-table length are the model's,
 *     and the free-block count is the pool minus the blocks in some table;
 * and before every attend, each block in no table and each slot past every
 * sharer's length holds NaN, Inf or a NaN-scaled block; then out and lse are
 * within 5e-5 (relative L2, with a floor) of the float64 oracle's on the model's tokens
 * (bottom-right causal), and another thread count gives the same bits. */
#include "attn.h"
#include "fuzz_common.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { MAX_SEQS = 6, MAX_LEN = 320, MAX_OPS = 40, MAX_STEP = 4 };

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  fuzz_init("fuzz_paged");
  return 0;
}

/* What the cache should hold: per live sequence, its tokens as stored ([Hk][MAX_LEN][D] and [..][Dv]). */
typedef struct model {
  int64_t Hk, D, Dv, bt, num_blocks;
  attn_kv_dtype kd, vd;
  int live[MAX_SEQS];
  int64_t len[MAX_SEQS];
  float *k[MAX_SEQS], *v[MAX_SEQS];
} model;

static float *mk(const model *m, int64_t s, int64_t h, int64_t t) { return m->k[s] + (h * MAX_LEN + t) * m->D; }
static float *mv(const model *m, int64_t s, int64_t h, int64_t t) { return m->v[s] + (h * MAX_LEN + t) * m->Dv; }

/* Every slot no sequence can read gets poison: blocks in no table whole, and
 * in each block the slots past the longest of its sharers' tokens there. */
static void poison_unused(attn_ctx *ctx, attn_paged_kv_cache *pc, const model *m) {
  int64_t used[512] = {0};
  for (int64_t s = 0; s < MAX_SEQS; s++) {
    if (!m->live[s]) continue;
    const int32_t *t;
    const int64_t nb = attn_paged_kv_block_table(pc, s, &t);
    for (int64_t i = 0; i < nb; i++) {
      const int64_t n = m->len[s] - i * m->bt < m->bt ? m->len[s] - i * m->bt : m->bt;
      if (n > used[t[i]]) used[t[i]] = n;
    }
  }
  int kind = 0;
  for (int64_t blk = 0; blk < m->num_blocks; blk++) {
    attn_tensor kv[2];
    fuzz_need(attn_paged_kv_block_view(ctx, &kv[0], &kv[1], pc, blk) == ATTN_OK, ctx, "attn_paged_kv_block_view");
    for (int which = 0; which < 2; which++) {
      const attn_tensor *t = &kv[which];
      const attn_kv_dtype dt = which ? m->vd : m->kd;
      for (int64_t h = 0; h < m->Hk; h++)
        for (int64_t slot = used[blk]; slot < m->bt; slot++) {
          char *row = (char *)t->data + (size_t)(h * t->strides[1] + slot * t->strides[2]) * attn_dtype_size(t->dtype);
          const int64_t n = t->shape[3];
          kind = (kind + 1) % 3;
          if (t->dtype == ATTN_F32)
            for (int64_t i = 0; i < n; i++) ((float *)row)[i] = kind == 0 ? NAN : kind == 1 ? INFINITY : -INFINITY;
          else if (t->dtype == ATTN_F16)
            for (int64_t i = 0; i < n; i++) ((uint16_t *)row)[i] = kind == 0 ? 0x7e00 : kind == 1 ? 0x7c00 : 0xfc00;
          else if (t->dtype == ATTN_BF16)
            for (int64_t i = 0; i < n; i++) ((uint16_t *)row)[i] = kind == 0 ? 0x7fc0 : kind == 1 ? 0x7f80 : 0xff80;
          else { /* q8_0 / q4_0 blocks: a NaN scale (f16, little-endian) and arbitrary values */
            const size_t blk_bytes = attn_kv_dtype_bytes(dt, 32);
            for (int64_t i = 0; i < n; i++) row[i] = (char)(i * 37 + slot);
            for (int64_t b0 = 0; b0 + (int64_t)blk_bytes <= n; b0 += (int64_t)blk_bytes)
              row[b0] = 0x00, row[b0 + 1] = 0x7e;
          }
        }
    }
  }
}

/* Lengths, table lengths and the free-block count the model implies. */
static void check_state(attn_paged_kv_cache *pc, const model *m, attn_ctx *ctx) {
  static uint8_t seen[512];
  memset(seen, 0, sizeof seen);
  int64_t used = 0;
  for (int64_t s = 0; s < MAX_SEQS; s++) {
    char msg[128];
    snprintf(msg, sizeof msg, "sequence %lld: length %lld, the model's %lld", (long long)s,
             (long long)attn_paged_kv_seq_length(pc, s), (long long)(m->live[s] ? m->len[s] : -1));
    fuzz_need(attn_paged_kv_seq_length(pc, s) == (m->live[s] ? m->len[s] : -1), ctx, msg);
    if (!m->live[s]) continue;
    const int32_t *t;
    const int64_t nb = attn_paged_kv_block_table(pc, s, &t);
    fuzz_need(nb == (m->len[s] + m->bt - 1) / m->bt, ctx, "a block table's length");
    for (int64_t i = 0; i < nb; i++) {
      fuzz_need(t[i] >= 0 && t[i] < m->num_blocks, ctx, "a block id out of the pool");
      if (!seen[t[i]]) seen[t[i]] = 1, used++;
    }
  }
  fuzz_need(attn_paged_kv_free_blocks(pc) == m->num_blocks - used, ctx, "the free-block count");
}

static void step_append(attn_ctx *ctx, attn_paged_kv_cache *pc, model *m, fuzz_reader *r) {
  int64_t seqs[MAX_STEP], n_new[MAX_STEP], nseq = 0;
  const int64_t want = 1 + fuzz_pick(r, MAX_STEP);
  for (int64_t s0 = fuzz_pick(r, MAX_SEQS), i = 0; i < MAX_SEQS && nseq < want; i++) {
    const int64_t s = (s0 + i) % MAX_SEQS;
    if (m->live[s] && fuzz_pick(r, 3)) seqs[nseq++] = s;
  }
  if (!nseq) return;
  const int64_t n = fuzz_pick(r, 4) ? 1 + fuzz_pick(r, 4) : 1 + fuzz_pick(r, 70);
  const int uneven = (int)fuzz_pick(r, 2);
  for (int64_t i = 0; i < nseq; i++) {
    n_new[i] = uneven ? fuzz_pick(r, n + 1) : n;
    if (m->len[seqs[i]] + n_new[i] > MAX_LEN) return; /* past the model's room: skipped */
  }
  const int64_t ks[4] = {nseq, m->Hk, n, m->D}, vs[4] = {nseq, m->Hk, n, m->Dv};
  float *k = malloc(sizeof(float) * (size_t)(nseq * m->Hk * n * m->D) + 1);
  float *v = malloc(sizeof(float) * (size_t)(nseq * m->Hk * n * m->Dv) + 1);
  for (int64_t i = 0; i < nseq * m->Hk * n * m->D; i++) k[i] = (float)fuzz_uniform();
  for (int64_t i = 0; i < nseq * m->Hk * n * m->Dv; i++) v[i] = (float)fuzz_uniform();
  attn_tensor tk = attn_tensor_view(k, ATTN_F32, 4, ks), tv = attn_tensor_view(v, ATTN_F32, 4, vs);
  const attn_status st = attn_paged_kv_append(ctx, pc, nseq, seqs, &tk, &tv, uneven ? n_new : NULL);
  fuzz_log("append(%lld seqs, n %lld)%s ", (long long)nseq, (long long)n, st == ATTN_OK ? "" : " refused");
  if (st != ATTN_OK) {
    fuzz_need(st == ATTN_E_NOMEM && attn_ctx_error(ctx)[0], ctx, "an append failed other than for a full pool");
    free(k), free(v);
    return;
  }
  for (int64_t i = 0; i < nseq; i++) {
    const int64_t s = seqs[i];
    for (int64_t h = 0; h < m->Hk; h++)
      for (int64_t t = 0; t < n_new[i]; t++) {
        float *dk = mk(m, s, h, m->len[s] + t), *dv = mv(m, s, h, m->len[s] + t);
        memcpy(dk, k + ((i * m->Hk + h) * n + t) * m->D, sizeof(float) * (size_t)m->D);
        memcpy(dv, v + ((i * m->Hk + h) * n + t) * m->Dv, sizeof(float) * (size_t)m->Dv);
        fuzz_as_stored(ctx, m->kd, dk, m->D);
        fuzz_as_stored(ctx, m->vd, dv, m->Dv);
      }
    m->len[s] += n_new[i];
  }
  free(k), free(v);
}

static void step_attend(attn_ctx *ctx, attn_paged_kv_cache *pc, model *m, fuzz_reader *r, int threads2) {
  int64_t seqs[MAX_STEP], nseq = 0;
  const int64_t want = 1 + fuzz_pick(r, MAX_STEP);
  for (int64_t s0 = fuzz_pick(r, MAX_SEQS), i = 0; i < MAX_SEQS && nseq < want; i++) {
    const int64_t s = (s0 + i) % MAX_SEQS;
    if (m->live[s] && fuzz_pick(r, 3)) seqs[nseq++] = s;
  }
  if (!nseq) return;
  fuzz_step st;
  fuzz_step_draw(r, &st, nseq, m->Hk, m->D, m->Dv);
  poison_unused(ctx, pc, m);
  fuzz_log("attend(%lld seqs, Nq %lld, G %lld) ", (long long)nseq, (long long)st.Nq, (long long)st.G);
  fuzz_need(attn_paged_kv_attend(ctx, pc, &st.to, &st.tl, &st.tq, nseq, seqs, &st.o) == ATTN_OK, ctx,
            "attend over live sequences failed");
  const int t1 = attn_ctx_threads(ctx);
  attn_ctx_set_threads(ctx, threads2);
  fuzz_need(attn_paged_kv_attend(ctx, pc, &st.to2, &st.tl2, &st.tq, nseq, seqs, &st.o) == ATTN_OK, ctx,
            "attend on another thread count");
  attn_ctx_set_threads(ctx, t1);
  fuzz_step_same_bits(&st, ctx);
  for (int64_t b = 0; b < nseq; b++) { /* the oracle, sequence by sequence, on the model's tokens */
    const int64_t s = seqs[b], ks[4] = {1, m->Hk, m->len[s], m->D}, vs[4] = {1, m->Hk, m->len[s], m->Dv};
    attn_tensor kk = attn_tensor_view(m->k[s], ATTN_F32, 4, ks), vv = attn_tensor_view(m->v[s], ATTN_F32, 4, vs);
    kk.strides[1] = MAX_LEN * m->D, vv.strides[1] = MAX_LEN * m->Dv;
    fuzz_step_check_row(&st, ctx, b, NULL, &kk, &vv);
  }
  fuzz_step_free(&st);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!fuzz_kernel_count) return 0;
  fuzz_reader r = {data, size, 0};
  fuzz_seed(data, size);
  fuzz_report_clear();

  model m;
  memset(&m, 0, sizeof m);
  static const attn_kv_dtype kinds[] = {ATTN_KV_F32, ATTN_KV_F16, ATTN_KV_BF16, ATTN_KV_Q8_0, ATTN_KV_Q4_0};
  static const int64_t dims[] = {4, 17, 32, 64, 80}, qdims[] = {32, 64, 96};
  static const int64_t sizes[] = {1, 3, 16, 32, 64, 100, 128};
  m.kd = kinds[fuzz_pick(&r, 5)], m.vd = kinds[fuzz_pick(&r, 5)];
  m.D = fuzz_is_quant(m.kd) ? qdims[fuzz_pick(&r, 3)] : dims[fuzz_pick(&r, 5)];
  m.Dv = fuzz_is_quant(m.vd) ? qdims[fuzz_pick(&r, 3)] : dims[fuzz_pick(&r, 5)];
  m.Hk = 1 + fuzz_pick(&r, 2);
  m.bt = sizes[fuzz_pick(&r, 7)];
  m.num_blocks = 1 + fuzz_pick(&r, (3 * MAX_LEN) / m.bt + 2);
  if (m.num_blocks > 512) m.num_blocks = 512;
  const attn_kernel kernel = fuzz_kernel[fuzz_pick(&r, fuzz_kernel_count)];
  const int threads = 1 + (int)fuzz_pick(&r, 3);
  fuzz_log("kernel %s threads %d/%d blocks %lld x %lld tokens Hk %lld D %lld Dv %lld k %s v %s",
           attn_kernel_name(kernel), threads, 1 + threads % 3, (long long)m.num_blocks, (long long)m.bt,
           (long long)m.Hk, (long long)m.D, (long long)m.Dv, attn_kv_dtype_name(m.kd), attn_kv_dtype_name(m.vd));
  fuzz_log("; operations: ");

  attn_ctx *ctx;
  fuzz_need(attn_ctx_create(&ctx) == ATTN_OK, NULL, "cannot create a context");
  fuzz_need(attn_ctx_set_kernel(ctx, kernel) == ATTN_OK && attn_ctx_set_threads(ctx, threads) == ATTN_OK, ctx,
       "cannot set up the context");
  attn_paged_kv_config cfg;
  attn_paged_kv_config_init(&cfg, m.num_blocks, m.bt, m.Hk, m.D);
  cfg.v_head_dim = m.Dv, cfg.k_dtype = m.kd, cfg.v_dtype = m.vd, cfg.max_seqs = MAX_SEQS;
  attn_paged_kv_cache *pc;
  fuzz_need(attn_paged_kv_create(ctx, &pc, &cfg) == ATTN_OK, ctx, "attn_paged_kv_create");
  for (int s = 0; s < MAX_SEQS; s++) {
    m.k[s] = calloc((size_t)(m.Hk * MAX_LEN * m.D), sizeof(float));
    m.v[s] = calloc((size_t)(m.Hk * MAX_LEN * m.Dv), sizeof(float));
  }

  for (int op = 0; op < MAX_OPS && r.at < r.n; op++) {
    const int64_t kind = fuzz_pick(&r, 8), s = fuzz_pick(&r, MAX_SEQS);
    if (kind == 0) { /* new: the lowest free id */
      int64_t id = -1, expect = -1;
      for (int64_t i = 0; i < MAX_SEQS && expect < 0; i++)
        if (!m.live[i]) expect = i;
      const attn_status st = attn_paged_kv_seq_new(ctx, pc, &id);
      fuzz_log("new->%lld ", (long long)id);
      if (expect < 0) {
        fuzz_need(st == ATTN_E_NOMEM, ctx, "a new sequence beyond max_seqs");
      } else {
        fuzz_need(st == ATTN_OK && id == expect, ctx, "a new sequence: not the lowest free id");
        m.live[id] = 1, m.len[id] = 0;
      }
    } else if (kind == 1) { /* free */
      const attn_status st = attn_paged_kv_seq_free(ctx, pc, s);
      fuzz_log("free(%lld) ", (long long)s);
      fuzz_need(m.live[s] ? st == ATTN_OK : st != ATTN_OK && attn_ctx_error(ctx)[0], ctx, "free: status");
      m.live[s] = 0;
    } else if (kind == 2) { /* fork */
      int64_t child = -1, expect = -1;
      for (int64_t i = 0; i < MAX_SEQS && expect < 0; i++)
        if (!m.live[i]) expect = i;
      const attn_status st = attn_paged_kv_seq_fork(ctx, pc, &child, s);
      fuzz_log("fork(%lld)->%lld ", (long long)s, (long long)child);
      if (!m.live[s] || expect < 0) {
        fuzz_need(st != ATTN_OK && attn_ctx_error(ctx)[0], ctx, "fork of a dead sequence or beyond max_seqs");
      } else {
        fuzz_need(st == ATTN_OK && child == expect, ctx, "fork: status or id");
        m.live[child] = 1, m.len[child] = m.len[s];
        memcpy(m.k[child], m.k[s], sizeof(float) * (size_t)(m.Hk * MAX_LEN * m.D));
        memcpy(m.v[child], m.v[s], sizeof(float) * (size_t)(m.Hk * MAX_LEN * m.Dv));
      }
    } else if (kind == 3) { /* truncate (now and then past the length: refused) */
      const int64_t len = m.live[s] ? fuzz_pick(&r, m.len[s] + 2) : 0;
      const attn_status st = attn_paged_kv_seq_truncate(ctx, pc, s, len);
      fuzz_log("truncate(%lld, %lld) ", (long long)s, (long long)len);
      if (m.live[s] && len <= m.len[s]) {
        fuzz_need(st == ATTN_OK, ctx, "truncate: status");
        m.len[s] = len;
      } else {
        fuzz_need(st != ATTN_OK && attn_ctx_error(ctx)[0], ctx, "truncate past the length or of a dead sequence");
      }
    } else if (kind <= 5) {
      step_append(ctx, pc, &m, &r);
    } else {
      step_attend(ctx, pc, &m, &r, 1 + threads % 3);
    }
    check_state(pc, &m, ctx);
  }

  attn_paged_kv_destroy(pc);
  for (int s = 0; s < MAX_SEQS; s++) free(m.k[s]), free(m.v[s]);
  attn_ctx_destroy(ctx);
  return 0;
}
