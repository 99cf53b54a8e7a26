/* The one place a kernel choice becomes the kernel sets a context's calls run. */
#include "../internal.h"
#include "../cpu/gemm.h"
#include "../cpu/kernels.h"
#include "../logit.h"

void attn__dispatch_fill(attn__dispatch *d, attn_kernel kernel, unsigned supported, int decode_enabled,
                         attn_precision precision) {
  if (kernel == ATTN_KERNEL_AUTO || !((supported >> kernel) & 1)) {
    kernel = ATTN_KERNEL_C;
    if ((supported >> ATTN_KERNEL_AVX2) & 1) kernel = ATTN_KERNEL_AVX2;
    if ((supported >> ATTN_KERNEL_AVX512) & 1) kernel = ATTN_KERNEL_AVX512;
    if ((supported >> ATTN_KERNEL_AVX512_BF16) & 1) kernel = ATTN_KERNEL_AVX512_BF16;
    if ((supported >> ATTN_KERNEL_AMX) & 1) kernel = ATTN_KERNEL_AMX;
  }
  d->kernel = kernel;
  d->attention = &attn__kernels_c;
  d->decode = &attn__decode_kernels_c;
  d->gemm = &attn__sgemm_kernel_c;
  d->half = d->half_next = d->half_f16 = d->half_backward = NULL;
  d->gemm_bf16 = NULL;
#ifdef ATTN_HAVE_X86_KERNELS
  if (kernel == ATTN_KERNEL_AVX2) {
    d->attention = &attn__kernels_avx2;
    d->decode = &attn__decode_kernels_avx2;
    d->gemm = &attn__sgemm_kernel_avx2;
  } else if (kernel == ATTN_KERNEL_AVX512 || kernel == ATTN_KERNEL_AVX512_BF16 || kernel == ATTN_KERNEL_AMX) {
    d->attention = &attn__kernels_avx512;
    /* read-ahead into L2 on Intel and Zen 4, key blocks whole for 8 rows on Zen 4 (cpu.c); Zen 5's tuning stays */
    d->decode = (supported & ATTN__CPU_QK_BLOCK_ROWS_8) ? &attn__decode_kernels_avx512_l2_blocks8
                : (supported & ATTN__CPU_READ_AHEAD_L2) ? &attn__decode_kernels_avx512_l2
                                                        : &attn__decode_kernels_avx512;
    d->gemm = &attn__sgemm_kernel_avx512;
    if (kernel != ATTN_KERNEL_AVX512) {
      d->half = &attn__half_kernels_avx512bf16;
      /* 16 rows a tile, where the backward's groups of ATTN__BWD_MAX_ROWS rows take whole tiles */
      d->half_backward = &attn__half_kernels_avx512bf16_16;
      d->gemm_bf16 = &attn__bgemm_kernel_avx512bf16;
    }
#ifdef ATTN_HAVE_AMX
    if (kernel == ATTN_KERNEL_AMX) {
      /* no vdpbf16ps tiles behind them: on these CPUs they are slower than widening to fp32
       * (bf16 B1 H8 N2048 D80 on a Xeon: 156 against 222 GFLOP/s), so a Dv the AMX tiles do
       * not take is widened */
      d->half = d->half_backward = &attn__half_kernels_amx;
      d->half_f16 = &attn__half_kernels_amx_f16;
      d->gemm_bf16 = &attn__bgemm_kernel_amx;
    }
#endif
  }
#endif
  d->decode_enabled = decode_enabled != 0;
  d->precision = precision;
}

static int takes(const attn__half_kernels *h, const attn__sdpa *p) {
  return h && h->mr == h->base->mr && h->nr == h->base->nr && p->Dv % h->dv_align == 0;
}

/* The policy of attn.h's attn_precision, for the blocked forward: bf16 tiles
 * when the kernel has them and q, k and v are bf16 (or, under BF16, f32 or
 * bf16); the first set that takes the head sizes. f16 q, k and v (or, under
 * F16, f32 or f16): the f16 tiles where the kernel has them, unless the
 * policy is FP32. */
const attn__half_kernels *attn__dispatch_half(const attn__dispatch *d, const attn__sdpa *p) {
  if (!d->half || d->precision == ATTN_PRECISION_FP32) return NULL;
  const attn_dtype dt[3] = {p->q.dtype, p->k.dtype, p->v.dtype};
  int f16 = 1;
  for (int i = 0; i < 3; i++) f16 &= dt[i] == ATTN_F16 || (d->precision == ATTN_PRECISION_F16 && dt[i] == ATTN_F32);
  if (f16) return takes(d->half_f16, p) ? d->half_f16 : NULL;
  for (int i = 0; i < 3; i++)
    if (dt[i] != ATTN_BF16 && !(d->precision == ATTN_PRECISION_BF16 && dt[i] == ATTN_F32)) return NULL;
  const attn__half_kernels *sets[2] = {d->half, d->half_next};
  for (int i = 0; i < 2; i++)
    if (takes(sets[i], p)) return sets[i];
  return NULL;
}

/* The backward's policy: bf16 q, k and v (as the forward's DEFAULT and BF16
 * take them) on a set with backward tiles, and f16 ones on the f16 set, for
 * D and Dv the tiles take (dQ's dS.K runs on pv with D as its columns).
 * Everything else, f32 under BF16 included, runs the fp32 backward, halves
 * widened as they are packed. */
const attn__half_kernels *attn__dispatch_half_backward(const attn__dispatch *d, const attn__sdpa *p) {
  if (d->precision == ATTN_PRECISION_FP32 || p->q.dtype != p->k.dtype || p->q.dtype != p->v.dtype) return NULL;
  const attn__half_kernels *h = p->q.dtype == ATTN_BF16 ? d->half_backward
                                : p->q.dtype == ATTN_F16 ? d->half_f16
                                                         : NULL;
  if (!h || !h->pt_acc) return NULL;
  return takes(h, p) && p->D > 0 && p->Dv > 0 && p->D % h->dv_align == 0 && h->nr % h->mr == 0 ? h : NULL;
}
