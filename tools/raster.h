/* A tiny RGB raster for the attention maps: rectangles, a built-in 5x7 bitmap
 * font, a colour ramp, heatmaps. No dependencies; PNG encoding is elsewhere. */
#ifndef ATTN_RASTER_H
#define ATTN_RASTER_H

#include <stdint.h>

typedef struct rs_rgb {
  unsigned char r, g, b;
} rs_rgb;

typedef struct rs_image {
  int w, h;
  unsigned char *px; /* [h][w][3], row-major */
} rs_image;

#define RS_GLYPH_W 5
#define RS_GLYPH_H 7
#define RS_ADVANCE 6 /* glyph width plus one column of spacing */

/* Allocates a w x h image filled with bg; 0, or -1 when out of memory or too large. */
int rs_create(rs_image *im, int w, int h, rs_rgb bg);
void rs_free(rs_image *im);
/* Fills a rectangle, clipped to the image. */
void rs_fill(rs_image *im, int x, int y, int w, int h, rs_rgb c);
/* Draws s with its top-left corner at (x, y), each font pixel scale x scale.
 * vertical: rotated a quarter turn anticlockwise (reads bottom to top), (x, y)
 * is then the bottom-left corner. Each glyph outside printable ASCII draws as
 * one '?': a UTF-8 sequence is one glyph (a lead byte and the continuation bytes
 * after it), any other byte one. */
void rs_text(rs_image *im, int x, int y, const char *s, int scale, rs_rgb c, int vertical);
/* Pixels along the reading direction that rs_text uses for s. */
int rs_text_width(const char *s, int scale);
/* Whether byte k of s begins a glyph (see rs_text). */
int rs_glyph_starts(const char *s, int k);
/* The colour ramp at t in [0, 1] (clamped): dark blue through teal to yellow. */
rs_rgb rs_ramp(double t);
/* rows x cols cells of size cell at (x, y): v[i * ld + j] mapped from [vmin, vmax]
 * onto the ramp; NaN cells are grey. */
void rs_heatmap(rs_image *im, int x, int y, int cell, int64_t rows, int64_t cols, const float *v, int64_t ld,
                double vmin, double vmax);

#endif
