/* The logit's options checked (attn__logit_prepare) and tiles of logits
 * classified (attn__mask_tile): logit.h's definition, the parts that are not
 * inline. */
#include "logit.h"
#include "cpu/kernels.h"

#include <float.h>
#include <stdio.h>

/* Right-aligns a mask of rank <= 4 against [B, H, Nq, Nk] (numpy broadcasting). */
static attn_status broadcast_mask(attn_ctx *ctx, attn_tensor *out, const attn_tensor *m, const int64_t full[4],
                                  const char *what) {
  attn_status st = attn__check_tensor(ctx, m, what, -1);
  if (st) return st;
  if (m->rank > 4) return attn__fail(ctx, ATTN_E_SHAPE, "%s has rank %d; at most 4", what, m->rank);
  attn_tensor r;
  memset(&r, 0, sizeof r);
  r.data = m->data;
  r.dtype = m->dtype;
  r.rank = 4;
  int off = 4 - m->rank;
  for (int i = 0; i < 4; i++) {
    r.shape[i] = full[i];
    if (i < off) { r.strides[i] = 0; continue; }
    int64_t s = m->shape[i - off];
    if (s == full[i]) r.strides[i] = s == 1 ? 0 : m->strides[i - off];
    else if (s == 1) r.strides[i] = 0;
    else {
      char a[96];
      attn__format_shape(a, sizeof a, m);
      return attn__fail(ctx, ATTN_E_SHAPE,
                        "%s of shape %s does not broadcast to [%lld, %lld, %lld, %lld] (dimension %d: %lld vs %lld)",
                        what, a, (long long)full[0], (long long)full[1], (long long)full[2], (long long)full[3], i,
                        (long long)s, (long long)full[i]);
    }
  }
  *out = r;
  return ATTN_OK;
}

attn_status attn__logit_prepare(attn_ctx *ctx, attn__sdpa *p, const attn_sdpa_opts *opts, int f32_only) {
  attn_status st;
  if (isnan(opts->scale)) p->scale = 1.0 / sqrt((double)p->D);
  else if (isfinite(opts->scale)) p->scale = opts->scale;
  else return attn__fail(ctx, ATTN_E_INVALID, "scale must be finite (or NaN for 1/sqrt(D)), got %g", opts->scale);
  /* the fp32 kernels scale q in float: a scale float cannot hold would make every logit Inf or NaN */
  if (f32_only && fabs(p->scale) > FLT_MAX)
    return attn__fail(ctx, ATTN_E_INVALID, "scale %g overflows float32 (the fp32 kernels compute in float)", p->scale);
  if (opts->causal != ATTN_CAUSAL_NONE && opts->causal != ATTN_CAUSAL_TOP_LEFT &&
      opts->causal != ATTN_CAUSAL_BOTTOM_RIGHT)
    return attn__fail(ctx, ATTN_E_INVALID, "unknown causal mode %d", (int)opts->causal);
  p->causal = opts->causal;
  const int64_t max_offset = (int64_t)1 << 48;
  if (opts->q_offset < 0 || opts->q_offset > max_offset || opts->k_offset < 0 || opts->k_offset > max_offset)
    return attn__fail(ctx, ATTN_E_INVALID, "q_offset and k_offset must be in [0, 2^48], got %lld and %lld",
                      (long long)opts->q_offset, (long long)opts->k_offset);
  p->q_offset = opts->q_offset, p->k_offset = opts->k_offset;
  if (opts->head_offset < 0 || opts->head_offset > ((int64_t)1 << 31))
    return attn__fail(ctx, ATTN_E_INVALID, "head_offset must be in [0, 2^31], got %lld", (long long)opts->head_offset);
  p->head_offset = opts->head_offset;
  if (opts->window < 0) return attn__fail(ctx, ATTN_E_INVALID, "window must be >= 0 (0 = off), got %lld", (long long)opts->window);
  /* a window past every position hides nothing more: capping it keeps i' - window from overflowing */
  const int64_t shift = p->q_offset > p->k_offset ? p->q_offset - p->k_offset : p->k_offset - p->q_offset;
  const int64_t no_op_window = (p->Nk > p->Nq ? p->Nk : p->Nq) + shift + 1;
  p->window = opts->window < no_op_window ? opts->window : no_op_window;
  if (p->window > 0 && p->causal == ATTN_CAUSAL_NONE) p->causal = ATTN_CAUSAL_TOP_LEFT;
  if (opts->chunk < 0) return attn__fail(ctx, ATTN_E_INVALID, "chunk must be >= 0 (0 = off), got %lld", (long long)opts->chunk);
  /* a chunk past every global position (each below Nq + Nk + the offsets) holds them all, as one that
   * long does: capping it keeps the chunk arithmetic from overflowing (broadcast views may be long) */
  const int64_t long_side = (int64_t)1 << 59;
  const int64_t no_op_chunk =
      p->Nq > long_side || p->Nk > long_side ? long_side * 2 : p->Nq + p->Nk + p->q_offset + p->k_offset + 1;
  p->chunk = opts->chunk < no_op_chunk ? opts->chunk : no_op_chunk;
  if (opts->chunk > 0 && p->causal == ATTN_CAUSAL_NONE) p->causal = ATTN_CAUSAL_TOP_LEFT;
  if (!(opts->softcap >= 0) || !isfinite(opts->softcap))
    return attn__fail(ctx, ATTN_E_INVALID, "softcap must be finite and >= 0 (0 = off), got %g", opts->softcap);
  p->softcap = opts->softcap;
  if ((st = attn__check_head_vector(ctx, opts->alibi_slopes, "alibi_slopes", p->Hq, 0)) ||
      (st = attn__check_head_vector(ctx, opts->sinks, "sinks", p->Hq, 0)))
    return st;
  p->alibi = opts->alibi_slopes;
  p->sinks = opts->sinks;

  if (opts->mask) {
    int64_t full[4] = {p->B, p->Hq, p->Nq, p->Nk};
    if ((st = broadcast_mask(ctx, &p->mask, opts->mask, full, "mask"))) return st;
    attn_dtype dt = opts->mask->dtype;
    switch (opts->mask_mode) {
      case ATTN_MASK_KEEP: case ATTN_MASK_MASKED:
        if (dt != ATTN_BOOL && dt != ATTN_U8)
          return attn__fail(ctx, ATTN_E_DTYPE, "a %s mask must be bool or u8, got %s (use additive for a float mask)",
                            opts->mask_mode == ATTN_MASK_KEEP ? "keep" : "masked", attn_dtype_name(dt));
        break;
      case ATTN_MASK_ADDITIVE:
        if (!attn__is_float(dt))
          return attn__fail(ctx, ATTN_E_DTYPE, "an additive mask must be a float dtype, got %s", attn_dtype_name(dt));
        break;
      case ATTN_MASK_SEED: break;
      default: return attn__fail(ctx, ATTN_E_INVALID, "unknown mask mode %d", (int)opts->mask_mode);
    }
    p->has_mask = 1;
    p->mask_mode = opts->mask_mode;
  }
  if (opts->key_padding) {
    const attn_tensor *m = opts->key_padding;
    if ((st = attn__check_tensor(ctx, m, "key_padding", 2))) return st;
    if (m->shape[0] != p->B || m->shape[1] != p->Nk)
      return attn__fail(ctx, ATTN_E_SHAPE, "key_padding [%lld, %lld] must be [B, Nk] = [%lld, %lld]",
                        (long long)m->shape[0], (long long)m->shape[1], (long long)p->B, (long long)p->Nk);
    if (m->dtype != ATTN_BOOL && m->dtype != ATTN_U8)
      return attn__fail(ctx, ATTN_E_DTYPE, "key_padding must be bool or u8, got %s", attn_dtype_name(m->dtype));
    memset(&p->kpm, 0, sizeof p->kpm);
    p->kpm.data = m->data;
    p->kpm.dtype = m->dtype;
    p->kpm.rank = 4;
    p->kpm.shape[0] = p->B; p->kpm.shape[1] = 1; p->kpm.shape[2] = 1; p->kpm.shape[3] = p->Nk;
    p->kpm.strides[0] = m->strides[0];
    p->kpm.strides[3] = m->strides[1];
    p->has_kpm = 1;
  }
  return ATTN_OK;
}

/* Row i's band [key_begin(i), key_end(i)) moves right as i grows: the first
 * row has the earliest end, the last row the latest begin. ALiBi's term is
 * added here too, so a tile with ALiBi is never OPEN. */
attn__tile_mask attn__mask_tile(const attn__sdpa *p, float *Mb, int64_t ld, int nr, int64_t b, int64_t h, int64_t i0,
                                int rows, int64_t j0) {
  const int64_t nk = attn__keys(p, b);
  const int64_t kend_first = attn__key_end(p, b, i0);
  const int64_t kbeg_last = attn__key_begin(p, b, i0 + rows - 1);
  const int keys = nk - j0 < nr ? (int)(nk - j0 > 0 ? nk - j0 : 0) : nr; /* keys of the block that exist */
  /* key padding alone is the same for every row: read once per tile, and a
   * block it leaves whole is as if there were none */
  float kp_row[ATTN__MAX_NR];
  const int kp_only = p->has_kpm && !p->has_mask;
  int kp_none = 0;
  if (kp_only) {
    attn__mask_row(p, b, h, i0, j0, keys, kp_row);
    kp_none = keys == nr;
    for (int jj = 0; jj < keys; jj++) kp_none &= kp_row[jj] == 0.0f;
  }
  const int plain = !p->has_mask && (!p->has_kpm || kp_none) && !p->alibi;
  if (plain && j0 + nr <= kend_first && j0 >= kbeg_last) return ATTN__TILE_OPEN;
  int64_t visible = 0;
  int hidden = 0;
  for (int r = 0; r < rows; r++) {
    const int64_t i = i0 + r, kend = attn__key_end(p, b, i), kbeg = attn__key_begin(p, b, i);
    float *mb = Mb + r * ld;
    /* keys [lo, hi) of the tile lie in the row's band */
    const int hi = kend - j0 <= 0 ? 0 : kend - j0 >= nr ? nr : (int)(kend - j0);
    const int lo = kbeg - j0 <= 0 ? 0 : kbeg - j0 >= hi ? hi : (int)(kbeg - j0);
    hidden |= lo > 0 || hi < keys;
    if (attn__band_only(p)) {
      *attn__band_at(Mb, ld, r) = (attn__row_band){lo, hi};
      visible += hi - lo;
    } else if (!p->has_mask && !p->has_kpm) {
      for (int jj = 0; jj < nr; jj++) mb[jj] = jj >= lo && jj < hi ? 0.0f : -INFINITY;
      visible += hi - lo;
    } else {
      for (int jj = 0; jj < lo; jj++) mb[jj] = -INFINITY;
      if (kp_only) memcpy(mb + lo, kp_row + lo, (size_t)(hi - lo) * sizeof(float));
      else attn__mask_row(p, b, h, i, j0 + lo, hi - lo, mb + lo);
      for (int jj = hi; jj < nr; jj++) mb[jj] = -INFINITY;
      int shown = 0;
      for (int jj = lo; jj < hi; jj++) shown += mb[jj] != -INFINITY;
      visible += shown;
      hidden |= shown < hi - lo;
    }
    if (p->alibi)
      for (int jj = lo; jj < hi; jj++) mb[jj] += (float)attn__alibi_term(p, b, h, i, j0 + jj);
  }
  return !visible ? ATTN__TILE_CLOSED : hidden ? ATTN__TILE_MIXED : ATTN__TILE_ADD;
}
