/* Training one attention layer with libattn: associative recall.
 *
 * Each sequence holds PAIRS key/value token pairs, then a query key:
 *
 *     k1 v1 k2 v2 ... k6 v6 q        (q is one of the k's; the answer is its v)
 *
 * Keys are tokens 0..15, values 16..31. A model that ignores the context can
 * only guess (1 in 16); to answer, the last position has to find the pair whose
 * key is q and read that pair's value: a lookup, which is what attention does.
 *
 * The model, kept as small as the task allows:
 *   x_t    = Emb[tok_t] + Prev[tok_{t-1}]     two learned tables: each position
 *                                             also sees the token before it, so
 *                                             a value's input carries its key
 *   y      = MHA(x)                           one self-attention layer, E = 64, 4 heads
 *   logits = Wr y_last + br                   a linear readout from the last position
 *   loss   = cross-entropy(softmax(logits), answer)
 *
 * libattn gives the layer's forward (attn_mha_forward_save) and backward
 * (attn_mha_backward: the input gradient and every parameter's gradient);
 * the rest (embeddings, readout, softmax cross-entropy, Adam) is written out
 * below. Every batch is fresh, so the accuracy printed is on unseen data.
 *
 * Usage: train_recall [steps [threads]]. One thread by default: a layer this
 * small (64 x 13 x 64) is done before other threads would have woken up.
 * Exit status 0 when the final accuracy (on
 * 2048 new sequences) reaches PASS_ACCURACY, 1 otherwise. Seeds are fixed. */
#include <attn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum {
  KEYS = 16,               /* key tokens 0 .. KEYS-1 */
  VALUES = 16,             /* value tokens KEYS .. KEYS+VALUES-1 */
  VOCAB = KEYS + VALUES,
  PAIRS = 6,
  SEQ = 2 * PAIRS + 1,     /* the pairs, then the query */
  EMBED = 64,
  HEADS = 4,
  BATCH = 64,
  DEFAULT_STEPS = 300,
  PRINT_EVERY = 25
};
static const double LR = 3e-3, BETA1 = 0.9, BETA2 = 0.999, ADAM_EPS = 1e-8;
static const double PASS_ACCURACY = 0.9; /* chance is 1 / VALUES = 0.0625 */

/* ---- small helpers ---------------------------------------------------------------- */
static uint64_t rng_state = 12345;
static uint64_t rng_next(void) { /* splitmix64 */
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static int rng_int(int n) { return (int)(rng_next() % (uint64_t)n); }
static float rng_uniform(float a) { return a * (float)((double)(rng_next() >> 11) * (2.0 / 9007199254740992.0) - 1.0); }

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n, size);
  if (!p) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  return p;
}

static void check(attn_ctx *ctx, attn_status st, const char *what) {
  if (st == ATTN_OK) return;
  fprintf(stderr, "%s: %s: %s\n", what, attn_strerror(st), attn_ctx_error(ctx));
  exit(1);
}

/* ---- the task ----------------------------------------------------------------------- */
/* One batch: tokens [BATCH][SEQ] and the answers [BATCH]. */
static void make_batch(int tok[BATCH][SEQ], int answer[BATCH]) {
  for (int b = 0; b < BATCH; b++) {
    int keys[KEYS];
    for (int i = 0; i < KEYS; i++) keys[i] = i;
    for (int i = 0; i < PAIRS; i++) { /* PAIRS distinct keys: a partial shuffle */
      int j = i + rng_int(KEYS - i), t = keys[i];
      keys[i] = keys[j];
      keys[j] = t;
    }
    for (int i = 0; i < PAIRS; i++) {
      tok[b][2 * i] = keys[i];
      tok[b][2 * i + 1] = KEYS + rng_int(VALUES);
    }
    const int q = rng_int(PAIRS);
    tok[b][SEQ - 1] = keys[q];
    answer[b] = tok[b][2 * q + 1];
  }
}

/* ---- parameters and Adam ------------------------------------------------------------ */
typedef struct param {
  float *w, *g;  /* the values and their gradient */
  float *m, *v;  /* Adam's moment estimates */
  int64_t n;
} param;

static param new_param(float *w, float *g, int64_t n) {
  param p = {w, g, xcalloc((size_t)n, sizeof(float)), xcalloc((size_t)n, sizeof(float)), n};
  return p;
}

static void adam_step(param *p, int t) {
  const double c1 = 1 - pow(BETA1, t), c2 = 1 - pow(BETA2, t);
  for (int64_t i = 0; i < p->n; i++) {
    const double g = p->g[i];
    p->m[i] = (float)(BETA1 * p->m[i] + (1 - BETA1) * g);
    p->v[i] = (float)(BETA2 * p->v[i] + (1 - BETA2) * g * g);
    p->w[i] -= (float)(LR * (p->m[i] / c1) / (sqrt(p->v[i] / c2) + ADAM_EPS));
  }
}

/* ---- the model ------------------------------------------------------------------------ */
typedef struct model {
  attn_mha *mha, *mha_grad;        /* the layer, and a layer of the same shape holding its gradients */
  float emb[VOCAB][EMBED], prev[VOCAB][EMBED];
  float wr[VOCAB][EMBED], br[VOCAB];
  float d_emb[VOCAB][EMBED], d_prev[VOCAB][EMBED], d_wr[VOCAB][EMBED], d_br[VOCAB];
  param params[ATTN_MHA_NUM_PARAMS + 4];
  int nparams;
} model;

/* Activations of one step. */
typedef struct acts {
  float x[BATCH][SEQ][EMBED], y[BATCH][SEQ][EMBED];
  float dx[BATCH][SEQ][EMBED], dy[BATCH][SEQ][EMBED];
  float logits[BATCH][VOCAB];
} acts;

static void model_init(attn_ctx *ctx, model *m) {
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, EMBED, HEADS); /* bias on */
  check(ctx, attn_mha_create(ctx, &m->mha, &cfg), "attn_mha_create");
  check(ctx, attn_mha_create(ctx, &m->mha_grad, &cfg), "attn_mha_create");
  /* weights uniform in +-1/sqrt(fan_in), biases zero (as attn_mha_create leaves them) */
  const float a = 1.0f / sqrtf((float)EMBED);
  for (int p = 0; p < ATTN_MHA_NUM_PARAMS; p++) {
    attn_tensor w, g;
    if (attn_mha_param_view(ctx, &w, m->mha, (attn_mha_param)p) != ATTN_OK) continue; /* a bias, when off */
    check(ctx, attn_mha_param_view(ctx, &g, m->mha_grad, (attn_mha_param)p), "attn_mha_param_view");
    const int64_t n = attn_tensor_numel(&w);
    if (w.rank == 2)
      for (int64_t i = 0; i < n; i++) ((float *)w.data)[i] = rng_uniform(a);
    m->params[m->nparams++] = new_param(w.data, g.data, n);
  }
  for (int t = 0; t < VOCAB; t++)
    for (int e = 0; e < EMBED; e++) {
      m->emb[t][e] = rng_uniform(1);
      m->prev[t][e] = rng_uniform(1);
      m->wr[t][e] = rng_uniform(a);
    }
  memset(m->br, 0, sizeof m->br);
  m->params[m->nparams++] = new_param(&m->emb[0][0], &m->d_emb[0][0], VOCAB * EMBED);
  m->params[m->nparams++] = new_param(&m->prev[0][0], &m->d_prev[0][0], VOCAB * EMBED);
  m->params[m->nparams++] = new_param(&m->wr[0][0], &m->d_wr[0][0], VOCAB * EMBED);
  m->params[m->nparams++] = new_param(m->br, m->d_br, VOCAB);
}

static void model_free(model *m) {
  for (int i = 0; i < m->nparams; i++) {
    free(m->params[i].m);
    free(m->params[i].v);
  }
  attn_mha_destroy(m->mha);
  attn_mha_destroy(m->mha_grad);
}

/* Forward (keeping what the backward needs when saved is not NULL) through the
 * logits; returns the batch's mean loss and counts the correct answers. */
static double forward(attn_ctx *ctx, model *m, acts *a, int tok[BATCH][SEQ], const int answer[BATCH],
                      attn_mha_saved **saved, int *correct) {
  for (int b = 0; b < BATCH; b++)
    for (int t = 0; t < SEQ; t++)
      for (int e = 0; e < EMBED; e++)
        a->x[b][t][e] = m->emb[tok[b][t]][e] + (t > 0 ? m->prev[tok[b][t - 1]][e] : 0.0f);

  int64_t shape[3] = {BATCH, SEQ, EMBED};
  attn_tensor x = attn_tensor_view(a->x, ATTN_F32, 3, shape), y = attn_tensor_view(a->y, ATTN_F32, 3, shape);
  attn_mha_opts opts;
  attn_mha_opts_init(&opts); /* no mask: the last position sees the whole sequence */
  if (saved)
    check(ctx, attn_mha_forward_save(ctx, m->mha, &y, NULL, saved, &x, NULL, NULL, &opts), "attn_mha_forward_save");
  else
    check(ctx, attn_mha_forward(ctx, m->mha, &y, NULL, &x, NULL, NULL, &opts), "attn_mha_forward");

  double loss = 0;
  for (int b = 0; b < BATCH; b++) {
    const float *h = a->y[b][SEQ - 1];
    int best = 0;
    for (int v = 0; v < VOCAB; v++) {
      double s = m->br[v];
      for (int e = 0; e < EMBED; e++) s += (double)m->wr[v][e] * h[e];
      a->logits[b][v] = (float)s;
      if (a->logits[b][v] > a->logits[b][best]) best = v;
    }
    /* cross-entropy = logsumexp(logits) - logits[answer] */
    double mx = a->logits[b][best], z = 0;
    for (int v = 0; v < VOCAB; v++) z += exp(a->logits[b][v] - mx);
    loss += mx + log(z) - a->logits[b][answer[b]];
    *correct += best == answer[b];
  }
  return loss / BATCH;
}

/* Gradients of the mean loss into every param's g. */
static void backward(attn_ctx *ctx, model *m, acts *a, int tok[BATCH][SEQ], const int answer[BATCH],
                     const attn_mha_saved *saved) {
  memset(m->d_wr, 0, sizeof m->d_wr);
  memset(m->d_br, 0, sizeof m->d_br);
  memset(a->dy, 0, sizeof a->dy);
  for (int b = 0; b < BATCH; b++) {
    /* d loss / d logits = softmax - onehot(answer), over the batch mean */
    double mx = a->logits[b][0], z = 0, p[VOCAB];
    for (int v = 1; v < VOCAB; v++) mx = a->logits[b][v] > mx ? a->logits[b][v] : mx;
    for (int v = 0; v < VOCAB; v++) z += (p[v] = exp(a->logits[b][v] - mx));
    const float *h = a->y[b][SEQ - 1];
    float *dh = a->dy[b][SEQ - 1]; /* only the last position feeds the readout */
    for (int v = 0; v < VOCAB; v++) {
      const float dl = (float)((p[v] / z - (v == answer[b])) / BATCH);
      m->d_br[v] += dl;
      for (int e = 0; e < EMBED; e++) {
        m->d_wr[v][e] += dl * h[e];
        dh[e] += dl * m->wr[v][e];
      }
    }
  }
  /* through the attention layer: dx and the layer's parameter gradients */
  int64_t shape[3] = {BATCH, SEQ, EMBED};
  attn_tensor dy = attn_tensor_view(a->dy, ATTN_F32, 3, shape), dx = attn_tensor_view(a->dx, ATTN_F32, 3, shape);
  check(ctx, attn_mha_backward(ctx, m->mha, &dx, NULL, NULL, m->mha_grad, saved, &dy), "attn_mha_backward");
  /* through the embeddings: each row gathered gets its position's gradient back */
  memset(m->d_emb, 0, sizeof m->d_emb);
  memset(m->d_prev, 0, sizeof m->d_prev);
  for (int b = 0; b < BATCH; b++)
    for (int t = 0; t < SEQ; t++)
      for (int e = 0; e < EMBED; e++) {
        m->d_emb[tok[b][t]][e] += a->dx[b][t][e];
        if (t > 0) m->d_prev[tok[b][t - 1]][e] += a->dx[b][t][e];
      }
}

int main(int argc, char **argv) {
  const int steps = argc > 1 ? atoi(argv[1]) : DEFAULT_STEPS, threads = argc > 2 ? atoi(argv[2]) : 1;
  if (steps < 1 || threads < 0) {
    fprintf(stderr, "usage: train_recall [steps [threads]]  (threads 0 = all processors)\n");
    return 2;
  }
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx) != ATTN_OK) return 1;
  check(ctx, attn_ctx_set_threads(ctx, threads), "attn_ctx_set_threads");
  model *m = xcalloc(1, sizeof *m);
  acts *a = xcalloc(1, sizeof *a);
  model_init(ctx, m);
  static int tok[BATCH][SEQ], answer[BATCH];
  printf("associative recall: %d pairs, %d keys, %d values (chance %.3f); E=%d, %d heads, batch %d, %s kernel, %d "
         "thread(s)\n",
         PAIRS, KEYS, VALUES, 1.0 / VALUES, EMBED, HEADS, BATCH, attn_kernel_name(attn_ctx_kernel(ctx)),
         attn_ctx_threads(ctx));

  const clock_t c0 = clock();
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  double loss_sum = 0;
  int correct = 0, seen = 0;
  for (int step = 1; step <= steps; step++) {
    make_batch(tok, answer);
    attn_mha_saved *saved;
    loss_sum += forward(ctx, m, a, tok, answer, &saved, &correct);
    seen += BATCH;
    backward(ctx, m, a, tok, answer, saved);
    attn_mha_saved_free(saved);
    for (int i = 0; i < m->nparams; i++) adam_step(&m->params[i], step);
    if (step % PRINT_EVERY == 0 || step == steps) {
      const int n = step % PRINT_EVERY ? step % PRINT_EVERY : PRINT_EVERY;
      printf("step %5d  loss %.4f  accuracy %.3f\n", step, loss_sum / n, (double)correct / seen);
      loss_sum = 0;
      correct = seen = 0;
    }
  }

  /* the verdict: new sequences, forward only */
  int right = 0;
  double loss = 0;
  const int batches = 2048 / BATCH;
  for (int i = 0; i < batches; i++) {
    make_batch(tok, answer);
    loss += forward(ctx, m, a, tok, answer, NULL, &right);
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  const double acc = (double)right / (batches * BATCH);
  printf("final: loss %.4f, accuracy %.3f on %d new sequences (pass: %.2f); %.2f s wall, %.2f s cpu\n",
         loss / batches, acc, batches * BATCH, PASS_ACCURACY,
         (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec),
         (double)(clock() - c0) / CLOCKS_PER_SEC);
  model_free(m);
  free(m);
  free(a);
  attn_ctx_destroy(ctx);
  return acc >= PASS_ACCURACY ? 0 : 1;
}
