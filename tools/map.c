/* attn map: attention weights drawn as a PNG, one heatmap per head.
 *
 *   attn map --params P.safetensors --heads H --query X.npy [--key K.npy] [--value V.npy]
 *            --png OUT.png [--tokens T.txt] [--key-tokens T.txt] [--batch I] [--causal]
 *   attn map --weights W.npy --png OUT.png [--tokens T.txt] [--key-tokens T.txt] [--batch I]
 *
 * The first runs the layer (weights per head, not averaged); the second draws
 * weights saved by `attn mha --weights-out`. Token labels go on the axes when
 * given and at most MAP_MAX_LABELS long. The PNG is encoded in memory, then
 * written through a staged temporary (tools/outputs.c): a failed run changes no file. */
#include "cli.h"
#include "commands.h"
#include "io/file.h"
#include "raster.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef ATTN_HAVE_PNG
#include <png.h>
#endif

#define MAP_MAX_LABELS 64   /* more tokens than this: the axes stay unlabelled */
#define MAP_LABEL_CHARS 10  /* longer tokens are cut to this many characters */
#define MAP_MAX_SIDE 2048   /* queries or keys beyond this are too many to draw */
#define MAP_MAX_TOKENS 100000

#ifndef ATTN_HAVE_PNG
int cmd_map(int argc, char **argv) {
  (void)argc;
  (void)argv;
  return cli_fail(CLI_EXIT_FAIL, "map: built without libpng (install libpng and rebuild to draw attention maps)");
}
#else

/* ---- tokens ------------------------------------------------------------------- */
typedef struct tokens {
  int64_t n;
  char **s;
} tokens;

static void tokens_free(tokens *t) {
  for (int64_t i = 0; i < t->n; i++) free(t->s[i]);
  free(t->s);
  t->n = 0;
  t->s = NULL;
}

/* One token per line (a final newline optional, "\r\n" accepted), cut to
 * MAP_LABEL_CHARS glyphs (rs_text's). A NUL byte or a line over 4094 bytes is
 * refused. 0 or an exit code. */
static int tokens_read(tokens *t, const char *path, const char *flag) {
  memset(t, 0, sizeof *t);
  FILE *f = fopen(path, "rb");
  if (!f) return cli_fail(CLI_EXIT_FAIL, "%s '%s': %s", flag, cli_show(path), strerror(errno));
  char line[4096];
  int64_t cap = 0;
  int r = 0, ch = 0;
  while (!r && ch != EOF) {
    size_t len = 0;
    while ((ch = getc(f)) != EOF && ch != '\n') {
      if (ch == '\0') {
        r = cli_fail(CLI_EXIT_FAIL, "%s '%s': line %lld holds a NUL byte", flag, cli_show(path), (long long)t->n + 1);
        break;
      }
      if (len == sizeof line - 2) {
        r = cli_fail(CLI_EXIT_FAIL, "%s '%s': line %lld is longer than %d bytes", flag, cli_show(path),
                     (long long)t->n + 1, (int)sizeof line - 2);
        break;
      }
      line[len++] = (char)ch;
    }
    if (r || (ch == EOF && len == 0)) break; /* no line after the final newline */
    while (len > 0 && line[len - 1] == '\r') len--;
    line[len] = '\0';
    for (int k = 0, glyphs = 0; line[k]; k++)
      if (rs_glyph_starts(line, k) && ++glyphs > MAP_LABEL_CHARS) {
        line[k] = '\0';
        break;
      }
    if (t->n == MAP_MAX_TOKENS) {
      r = cli_fail(CLI_EXIT_FAIL, "%s '%s': more than %d tokens", flag, cli_show(path), MAP_MAX_TOKENS);
      break;
    }
    if (t->n == cap) {
      cap = cap ? 2 * cap : 64;
      char **s = realloc(t->s, (size_t)cap * sizeof *s);
      if (!s) {
        r = cli_fail(CLI_EXIT_FAIL, "out of memory");
        break;
      }
      t->s = s;
    }
    if (!(t->s[t->n] = strdup(line))) {
      r = cli_fail(CLI_EXIT_FAIL, "out of memory");
      break;
    }
    t->n++;
  }
  if (!r && ferror(f)) r = cli_fail(CLI_EXIT_FAIL, "%s '%s': read error", flag, cli_show(path));
  fclose(f);
  if (r) tokens_free(t);
  return r;
}

/* ---- PNG in memory ----------------------------------------------------------------- */
typedef struct membuf {
  unsigned char *p;
  size_t n, cap;
  int oom;
} membuf;

static void mem_write(png_structp png, png_bytep data, png_size_t len) {
  membuf *m = png_get_io_ptr(png);
  if (m->oom) return;
  if (m->n + len > m->cap) {
    size_t cap = m->cap ? m->cap : 65536;
    while (cap < m->n + len) cap *= 2;
    unsigned char *p = realloc(m->p, cap);
    if (!p) {
      m->oom = 1;
      png_error(png, "out of memory");
    }
    m->p = p;
    m->cap = cap;
  }
  memcpy(m->p + m->n, data, len);
  m->n += len;
}

static void mem_flush(png_structp png) { (void)png; }

/* Encodes im as an 8-bit RGB PNG into *m; 0 or -1 (m freed). */
static int png_encode(const rs_image *im, membuf *m) {
  memset(m, 0, sizeof *m);
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
  if (!png) return -1;
  png_infop info = png_create_info_struct(png);
  if (!info || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, info ? &info : NULL);
    free(m->p);
    memset(m, 0, sizeof *m);
    return -1;
  }
  png_set_write_fn(png, m, mem_write, mem_flush);
  png_set_IHDR(png, info, (png_uint_32)im->w, (png_uint_32)im->h, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < im->h; y++) png_write_row(png, im->px + (size_t)y * (size_t)im->w * 3);
  png_write_end(png, NULL);
  png_destroy_write_struct(&png, &info);
  return 0;
}

/* ---- the picture ----------------------------------------------------------------- */
static const rs_rgb white = {255, 255, 255}, ink = {20, 20, 20}, frame = {160, 160, 160};

static int max_label_width(const tokens *t) {
  int w = 0;
  for (int64_t i = 0; t && i < t->n; i++) {
    const int x = rs_text_width(t->s[i], 1);
    if (x > w) w = x;
  }
  return w;
}

/* w: H maps of [Nq, Nk], contiguous. qt/kt: labels or NULL. */
static int render(rs_image *im, const float *w, int64_t H, int64_t Nq, int64_t Nk, const tokens *qt, const tokens *kt) {
  double vmin = 0, vmax = 0;
  int any = 0;
  for (int64_t e = 0; e < H * Nq * Nk; e++) {
    const double x = w[e];
    if (x != x) continue; /* NaN */
    if (!any || x > vmax) vmax = x;
    if (!any || x < vmin) vmin = x;
    any = 1;
  }
  if (vmin > 0) vmin = 0; /* probabilities: the scale starts at 0 */
  if (!(vmax > vmin)) vmax = vmin + 1;
  const int64_t side = Nq > Nk ? Nq : Nk;
  int cell = (int)(288 / side);
  if (cell > 32) cell = 32;
  if (cell < 1) cell = 1;
  if (qt || kt) cell = cell < RS_GLYPH_H + 2 ? RS_GLYPH_H + 2 : cell; /* one label per row */
  const int pw = (int)Nk * cell, ph = (int)Nq * cell;
  const int lw = qt ? max_label_width(qt) + 4 : 0, lh = kt ? max_label_width(kt) + 4 : 0;
  const int title_h = 14, gap = 14, margin = 10;
  int ncols = 1; /* a near-square grid of heads */
  while ((int64_t)ncols * ncols < H) ncols++;
  const int nrows = (int)((H + ncols - 1) / ncols);
  const int bw = lw + pw + gap, bh = title_h + ph + lh + gap; /* one head's block */
  /* colour bar: a strip as tall as one map, with three ticks and their values */
  char tick[3][32];
  snprintf(tick[0], sizeof tick[0], "%.3g", vmax);
  snprintf(tick[1], sizeof tick[1], "%.3g", (vmin + vmax) / 2);
  snprintf(tick[2], sizeof tick[2], "%.3g", vmin);
  int tw = rs_text_width("weight", 1);
  for (int i = 0; i < 3; i++) tw = rs_text_width(tick[i], 1) > tw ? rs_text_width(tick[i], 1) : tw;
  const int cb_h = ph > 60 ? ph : 60, cb_w = 14;
  const int64_t W = 2 * margin + (int64_t)ncols * bw + cb_w + 6 + tw;
  int64_t Hh = 2 * margin + (int64_t)nrows * bh;
  if (Hh < 2 * margin + title_h + cb_h + 10) Hh = 2 * margin + title_h + cb_h + 10;
  if (W > 16384 || Hh > 16384 || rs_create(im, (int)W, (int)Hh, white))
    return cli_fail(CLI_EXIT_FAIL, "map: a %lld x %lld image is too large or out of memory", (long long)W, (long long)Hh);
  for (int64_t h = 0; h < H; h++) {
    const int bx = margin + (int)(h % ncols) * bw, by = margin + (int)(h / ncols) * bh;
    const int mx = bx + lw, my = by + title_h;
    char title[32];
    snprintf(title, sizeof title, "head %lld", (long long)h);
    rs_text(im, mx + (pw - rs_text_width(title, 1)) / 2 > bx ? mx + (pw - rs_text_width(title, 1)) / 2 : bx, by + 2,
            title, 1, ink, 0);
    rs_fill(im, mx - 1, my - 1, pw + 2, ph + 2, frame);
    rs_heatmap(im, mx, my, cell, Nq, Nk, w + h * Nq * Nk, Nk, vmin, vmax);
    for (int64_t i = 0; qt && i < Nq; i++) /* query labels, right-aligned left of the rows */
      rs_text(im, mx - 3 - rs_text_width(qt->s[i], 1), my + (int)i * cell + (cell - RS_GLYPH_H) / 2, qt->s[i], 1, ink, 0);
    for (int64_t j = 0; kt && j < Nk; j++) /* key labels, reading upwards below the columns */
      rs_text(im, mx + (int)j * cell + (cell - RS_GLYPH_H) / 2, my + ph + 3 + rs_text_width(kt->s[j], 1), kt->s[j], 1,
              ink, 1);
  }
  const int cx = margin + ncols * bw, cy = margin + title_h;
  rs_text(im, cx, cy - title_h + 2, "weight", 1, ink, 0);
  rs_fill(im, cx - 1, cy - 1, cb_w + 2, cb_h + 2, frame);
  for (int y = 0; y < cb_h; y++) rs_fill(im, cx, cy + y, cb_w, 1, rs_ramp(1.0 - (double)y / (cb_h - 1)));
  const int ty[3] = {cy, cy + cb_h / 2, cy + cb_h - 1};
  for (int i = 0; i < 3; i++) {
    rs_fill(im, cx + cb_w, ty[i], 4, 1, ink);
    /* the top value sits below its tick, clear of the "weight" caption */
    rs_text(im, cx + cb_w + 6, i == 0 ? ty[i] : ty[i] - RS_GLYPH_H / 2, tick[i], 1, ink, 0);
  }
  return 0;
}

/* ---- the command --------------------------------------------------------------- */
/* The batch element b of t ([B, ...]) as a view [1, ...]. */
static int pick_batch(attn_tensor *t, long long b, const char *flag) {
  if (b >= t->shape[0])
    return cli_fail(CLI_EXIT_FAIL, "--batch %lld is out of range: %s has %lld batch elements", b, flag,
                    (long long)t->shape[0]);
  t->data = (char *)t->data + (size_t)(b * t->strides[0]) * attn_dtype_size(t->dtype);
  t->shape[0] = 1;
  return 0;
}

/* Loads an .npy as float32 (float64 converted); any other dtype is an error. */
static int load_f32(attn_ctx *ctx, attn_tensor *t, const char *path, const char *flag) {
  if (attn_npy_read(ctx, t, path)) return cli_fail(CLI_EXIT_FAIL, "%s: %s", flag, attn_ctx_error(ctx));
  if (t->dtype == ATTN_F32) return 0;
  if (t->dtype != ATTN_F64) {
    const int r = cli_fail(CLI_EXIT_FAIL, "%s '%s': dtype %s; want float32 or float64", flag, cli_show(path), attn_dtype_name(t->dtype));
    attn_tensor_free(t);
    return r;
  }
  attn_tensor f;
  if (attn_tensor_alloc(ctx, &f, ATTN_F32, t->rank, t->shape)) {
    attn_tensor_free(t);
    return cli_fail(CLI_EXIT_FAIL, "%s: %s", flag, attn_ctx_error(ctx));
  }
  for (int64_t i = 0; i < attn_tensor_numel(t); i++) ((float *)f.data)[i] = (float)((const double *)t->data)[i];
  attn_tensor_free(t);
  *t = f;
  return 0;
}

/* load_f32 into *own (freed by the caller), and *view starts as the same tensor. */
static int load_view(attn_ctx *ctx, attn_tensor *own, attn_tensor *view, const char *path, const char *flag) {
  const int r = load_f32(ctx, own, path, flag);
  *view = *own;
  return r;
}

/* [N, F] becomes [1, N, F]; [B, N, F] gives its element b. */
static int as_one_batch(attn_tensor *t, long long b, const char *flag, const char *layout) {
  if (t->rank == 2) {
    for (int d = 2; d > 0; d--) {
      t->shape[d] = t->shape[d - 1];
      t->strides[d] = t->strides[d - 1];
    }
    t->shape[0] = 1;
    t->strides[0] = t->shape[1] * t->strides[1];
    t->rank = 3;
    return b ? cli_fail(CLI_EXIT_FAIL, "--batch %lld is out of range: %s has no batch dimension", b, flag) : 0;
  }
  if (t->rank != 3) return cli_fail(CLI_EXIT_FAIL, "%s must be %s, got rank %d", flag, layout, t->rank);
  return pick_batch(t, b, flag);
}

int cmd_map(int argc, char **argv) {
  static const char *const known[] = {"--params", "--prefix", "--heads", "--kv-heads", "--query", "--key", "--value",
                                      "--weights", "--png", "--tokens", "--key-tokens", "--batch", "--threads", NULL};
  static const char *const switches[] = {"--causal", NULL};
  static const char *const layer_flags[] = {"--prefix", "--heads", "--kv-heads", "--query", "--key", "--value",
                                            "--causal", NULL};
  static const char *const out_flags[] = {"--png", NULL};
  static const char *const in_flags[] = {"--params", "--query", "--key", "--value", "--weights", "--tokens",
                                         "--key-tokens", NULL};
  cli_args a;
  int r = cli_parse(&a, argc, argv, known, switches);
  if (r) return r;
  if (!cli_has(&a, "--png") || !*cli_get(&a, "--png")) return cli_fail(CLI_EXIT_USAGE, "map needs --png OUT.png");
  const int from_weights = cli_has(&a, "--weights");
  if (from_weights == cli_has(&a, "--params")) return cli_fail(CLI_EXIT_USAGE, "map needs --weights W.npy or --params P.safetensors (one of them)");
  if (from_weights) {
    for (int i = 0; layer_flags[i]; i++)
      if (cli_has(&a, layer_flags[i])) return cli_fail(CLI_EXIT_USAGE, "%s goes with --params, not --weights", layer_flags[i]);
  } else {
    if (!cli_has(&a, "--heads")) return cli_fail(CLI_EXIT_USAGE, "map --params needs --heads");
    if (!cli_has(&a, "--query") || !*cli_get(&a, "--query")) return cli_fail(CLI_EXIT_USAGE, "map --params needs --query");
    if (cli_has(&a, "--value") && !cli_has(&a, "--key")) return cli_fail(CLI_EXIT_USAGE, "--value needs --key");
  }
  long long heads = 0, kv_heads = 0, batch = 0;
  if ((r = cli_int(&a, "--heads", 1, 1 << 20, &heads)) || (r = cli_int(&a, "--kv-heads", 1, 1 << 20, &kv_heads)) ||
      (r = cli_int(&a, "--batch", 0, INT64_MAX, &batch)))
    return r;
  long long threads = 0;
  if ((r = cli_int(&a, "--threads", 0, 4096, &threads))) return r;
  cli_outputs outs;
  attn_ctx *ctx = NULL;
  if ((r = cli_outputs_plan(&outs, &a, out_flags, in_flags))) {
    cli_outputs_free(&outs);
    return r;
  }
  if (attn_ctx_create(&ctx)) {
    cli_outputs_free(&outs);
    return cli_fail(CLI_EXIT_FAIL, "out of memory");
  }
  attn_ctx_set_threads(ctx, (int)threads);
  /* own: as loaded (freed at the end); in, x, key, value: views of one batch element */
  attn_tensor own[4] = {{0}}, in, x, key, value, w = {0};
  attn_mha *mha = NULL;
  tokens qt = {0}, kt = {0};
  rs_image im = {0};
  membuf png = {0};
  int64_t H = 0, Nq = 0, Nk = 0;
  const float *maps = NULL; /* [H, Nq, Nk] contiguous */
  if (from_weights) {
    /* [B, H, Nq, Nk] (pick --batch), [H, Nq, Nk], or one map [Nq, Nk] */
    if ((r = load_view(ctx, &own[0], &in, cli_get(&a, "--weights"), "--weights"))) goto done;
    if (in.rank == 4 && (r = pick_batch(&in, batch, "--weights"))) goto done;
    if (in.rank != 4 && batch) {
      r = cli_fail(CLI_EXIT_FAIL, "--batch %lld is out of range: --weights has no batch dimension", batch);
      goto done;
    }
    if (in.rank < 2 || in.rank > 4) {
      r = cli_fail(CLI_EXIT_FAIL, "--weights must be [B, H, Nq, Nk], [H, Nq, Nk] or [Nq, Nk], got rank %d", in.rank);
      goto done;
    }
    Nq = in.shape[in.rank - 2];
    Nk = in.shape[in.rank - 1];
    H = in.rank >= 3 ? in.shape[in.rank - 3] : 1;
    maps = in.data; /* a batch view of a C-order array is still contiguous */
  } else {
    const char *prefix = cli_get(&a, "--prefix");
    if (attn_mha_create_from_safetensors(ctx, &mha, cli_get(&a, "--params"), prefix ? prefix : "", heads, kv_heads)) {
      r = cli_fail(CLI_EXIT_FAIL, "--params: %s", attn_ctx_error(ctx));
      goto done;
    }
    if ((r = load_view(ctx, &own[1], &x, cli_get(&a, "--query"), "--query")) ||
        (r = as_one_batch(&x, batch, "--query", "[N, E] or [B, N, E]")))
      goto done;
    const int cross = cli_has(&a, "--key");
    if (cross && ((r = load_view(ctx, &own[2], &key, cli_get(&a, "--key"), "--key")) ||
                  (r = as_one_batch(&key, batch, "--key", "[Nk, kdim] or [B, Nk, kdim]"))))
      goto done;
    /* --key alone: the keys are also the values (a memory attended to) */
    if (cli_has(&a, "--value") && ((r = load_view(ctx, &own[3], &value, cli_get(&a, "--value"), "--value")) ||
                                   (r = as_one_batch(&value, batch, "--value", "[Nk, vdim] or [B, Nk, vdim]"))))
      goto done;
    const attn_tensor *kp = cross ? &key : NULL, *vp = cross ? (cli_has(&a, "--value") ? &value : &key) : NULL;
    H = heads;
    Nq = x.shape[1];
    Nk = cross ? key.shape[1] : Nq;
    if (Nq > MAP_MAX_SIDE || Nk > MAP_MAX_SIDE) { /* before the [H, Nq, Nk] weights are allocated */
      r = cli_fail(CLI_EXIT_FAIL, "map: %lld queries x %lld keys: more than %d a side to draw", (long long)Nq,
                   (long long)Nk, MAP_MAX_SIDE);
      goto done;
    }
    const attn_mha_config *cfg = attn_mha_get_config(mha);
    attn_tensor out;
    int64_t os[3] = {1, Nq, cfg->embed_dim}, ws[4] = {1, H, Nq, Nk};
    if (attn_tensor_alloc(ctx, &out, ATTN_F32, 3, os) || attn_tensor_alloc(ctx, &w, ATTN_F32, 4, ws)) {
      r = cli_fail(CLI_EXIT_FAIL, "map: %s", attn_ctx_error(ctx));
      goto done;
    }
    attn_mha_opts o;
    attn_mha_opts_init(&o);
    o.attn.causal = cli_has(&a, "--causal") ? ATTN_CAUSAL_TOP_LEFT : ATTN_CAUSAL_NONE;
    const attn_status st = attn_mha_forward(ctx, mha, &out, &w, &x, kp, vp, &o);
    attn_tensor_free(&out);
    if (st) {
      r = cli_fail(CLI_EXIT_FAIL, "map: mha: %s", attn_ctx_error(ctx));
      goto done;
    }
    maps = w.data;
  }
  if (H * Nq * Nk == 0 || Nq > MAP_MAX_SIDE || Nk > MAP_MAX_SIDE) {
    r = cli_fail(CLI_EXIT_FAIL, "map: %lld heads of %lld x %lld weights: nothing to draw, or more than %d a side",
                 (long long)H, (long long)Nq, (long long)Nk, MAP_MAX_SIDE);
    goto done;
  }
  if (cli_has(&a, "--tokens")) {
    if ((r = tokens_read(&qt, cli_get(&a, "--tokens"), "--tokens"))) goto done;
    if (qt.n != Nq) {
      r = cli_fail(CLI_EXIT_FAIL, "--tokens has %lld lines for %lld queries", (long long)qt.n, (long long)Nq);
      goto done;
    }
  }
  if (cli_has(&a, "--key-tokens")) {
    if ((r = tokens_read(&kt, cli_get(&a, "--key-tokens"), "--key-tokens"))) goto done;
    if (kt.n != Nk) {
      r = cli_fail(CLI_EXIT_FAIL, "--key-tokens has %lld lines for %lld keys", (long long)kt.n, (long long)Nk);
      goto done;
    }
  }
  /* keys share the query labels when there are as many (self-attention) */
  const tokens *ql = qt.n && qt.n <= MAP_MAX_LABELS ? &qt : NULL;
  const tokens *kl = kt.n ? (kt.n <= MAP_MAX_LABELS ? &kt : NULL) : (ql && Nk == Nq ? ql : NULL);
  if ((r = render(&im, maps, H, Nq, Nk, ql, kl))) goto done;
  if (png_encode(&im, &png)) {
    r = cli_fail(CLI_EXIT_FAIL, "map: PNG encoding failed (out of memory)");
    goto done;
  }
  attn__out f;
  const char *tmp = cli_outputs_stage(&outs, "--png");
  if (!tmp) {
    r = CLI_EXIT_FAIL;
    goto done;
  }
  if (attn__out_open(ctx, &f, "png", tmp) || attn__out_write(ctx, &f, png.p, png.n) || attn__out_commit(ctx, &f)) {
    r = cli_fail(CLI_EXIT_FAIL, "--png: %s", attn_ctx_error(ctx));
    goto done;
  }
  r = cli_outputs_commit(&outs);
done:
  cli_outputs_free(&outs);
  free(png.p);
  rs_free(&im);
  tokens_free(&qt);
  tokens_free(&kt);
  for (int i = 0; i < 4; i++) attn_tensor_free(&own[i]);
  attn_tensor_free(&w);
  attn_mha_destroy(mha);
  attn_ctx_destroy(ctx);
  return r;
}
#endif
