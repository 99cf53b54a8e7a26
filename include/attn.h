/* libattn: exact multi-head attention for C programs.
 *
 * One header, prefix attn_ (ATTN_ for macros). Conventions:
 *   - Every call that can fail returns attn_status; the message for the last
 *     failure on a context is attn_ctx_error(ctx). The library never prints,
 *     never exits, and keeps no global mutable state: one context per thread,
 *     any number of threads.
 *   - Tensors are strided views (attn_tensor, the shape of DLPack's DLTensor):
 *     strides count elements, not bytes; a stride of 0 broadcasts.
 *   - Shapes are written as in PyTorch, outermost first: q is [B, Hq, Nq, D].
 *   - Outputs come first in argument lists (after the context and the object
 *     acted on), then inputs, then options. An optional output is a pointer
 *     that may be NULL; options structs hold inputs only.
 *   - Every call that takes a context refuses a NULL one with ATTN_E_INVALID.
 *   - Every options and config struct begins with size_t size, which its
 *     _init sets to the struct's sizeof. Fields are only ever appended, so a
 *     program built against an older attn.h passes a smaller size and the
 *     fields it does not know take their defaults; a size of 0 (a struct not
 *     initialised with its _init) or one no version has is refused with
 *     ATTN_E_INVALID. Initialise with the _init, then set fields.
 */
#ifndef ATTN_H
#define ATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- visibility ------------------------------------------------------------ */
#if defined(ATTN_STATIC)
#define ATTN_API
#elif defined(_WIN32)
#if defined(ATTN_BUILDING)
#define ATTN_API __declspec(dllexport)
#else
#define ATTN_API __declspec(dllimport)
#endif
#elif defined(__GNUC__)
#define ATTN_API __attribute__((visibility("default")))
#else
#define ATTN_API
#endif

/* ---- version --------------------------------------------------------------- */
/* ATTN_VERSION_MAJOR, _MINOR, _PATCH and ATTN_VERSION_HEX of this header. */
#include "attn_version.h"

/* The version of the library actually linked, as ATTN_VERSION_HEX and "0.2.0". */
ATTN_API unsigned attn_version(void);
ATTN_API const char *attn_version_string(void);

/* ---- status ---------------------------------------------------------------- */
typedef enum attn_status {
  ATTN_OK = 0,
  ATTN_E_INVALID = 1,     /* a null pointer, a bad option value */
  ATTN_E_SHAPE = 2,       /* shapes that do not fit together */
  ATTN_E_DTYPE = 3,       /* a dtype this call does not take */
  ATTN_E_NOMEM = 4,       /* an allocation failed */
  ATTN_E_IO = 5,          /* a file could not be opened, read or written */
  ATTN_E_FORMAT = 6,      /* a file is malformed */
  ATTN_E_NOT_FOUND = 7,   /* a named tensor is absent */
  ATTN_E_UNSUPPORTED = 8  /* valid, but not implemented by this build or path */
} attn_status;

/* A fixed English phrase for a status ("shape mismatch"); never NULL. */
ATTN_API const char *attn_strerror(attn_status status);

/* ---- context --------------------------------------------------------------- */
/* A context holds the thread count, the kernel choice and the last error
 * message. Calls on one context must not overlap; use one per thread. */
typedef struct attn_ctx attn_ctx;

/* Which implementation computes attention. AUTO picks the fastest this CPU
 * runs; the environment variable ATTN_KERNEL (ref, c, avx2, avx512, avx512bf16, amx) overrides
 * AUTO (an unknown or unsupported name is ignored). Asking for an instruction
 * set the CPU lacks is an error. */
typedef enum attn_kernel {
  ATTN_KERNEL_AUTO = 0,
  ATTN_KERNEL_REF = 1,    /* float64 oracle: slow, plain, the yardstick */
  ATTN_KERNEL_C = 2,      /* portable C, fp32: any CPU */
  ATTN_KERNEL_AVX2 = 3,   /* x86-64 AVX2 + FMA */
  ATTN_KERNEL_AVX512 = 4, /* x86-64 AVX-512 (F, DQ, BW, VL) */
  ATTN_KERNEL_AVX512_BF16 = 5, /* AVX-512 for fp32, and vdpbf16ps (AVX512-BF16) tiles for bf16 */
  ATTN_KERNEL_AMX = 6 /* AVX-512 for fp32, AMX-BF16 tiles for bf16 and f16 attention (Dv a multiple of 16) and
                         the bf16 GEMM;
                         Linux grants the tile state per process (arch_prctl), asked once when a context is
                         made: a refusal leaves the CPU without this kernel */
} attn_kernel;

/* What precision computes attention, by the dtype of q, k and v.
 *
 *   DEFAULT  f32 inputs: every step in fp32.
 *            bf16 inputs: as PyTorch computes them (its CPU flash attention):
 *              q.k and p.v as bf16 products (exact in fp32) summed in fp32,
 *              the scale, options and softmax in fp32, and the probabilities
 *              rounded to bf16 for p.v (on AMX, unmasked tiles' probabilities
 *              are exp(s - m) for a running maximum m that may trail the
 *              row's by up to 8: the same weights, P up to e^8 before the
 *              division by the sum, the largest one rounded too). Runs on the AMX tiles
 *              (ATTN_KERNEL_AMX; Dv a multiple of 16) or the AVX512-BF16 ones
 *              (ATTN_KERNEL_AVX512_BF16); on other kernels and shapes, and
 *              for decode-sized problems (a few query rows per kv head), bf16
 *              is widened and every step is fp32, which is at least as
 *              accurate. (On ATTN_KERNEL_AMX a decode-sized problem of 8 to
 *              64 query rows per kv head with bf16 q and k, D a multiple of 32
 *              up to 256, takes q.k on the tiles, K read in place, and with
 *              bf16 v, Dv a multiple of 32 up to 256, p.v too, each P as three
 *              bf16 terms: the same exact products summed in fp32, in the
 *              unit's order, bf16 subnormals counting as zero.)
 *            f16 inputs: f16 products are exact in fp32. On the AMX tiles (Dv a
 *              multiple of 16), as PyTorch computes them: those products summed
 *              in fp32 (each f16 as two bf16 whose four products are exact),
 *              the probabilities rounded to f16 for p.v. Elsewhere widened to
 *              fp32 with the probabilities kept in fp32: at least as accurate.
 *            Mixed dtypes: widened to fp32.
 *   FP32     every input widened to fp32 and every step in fp32: 0.2's
 *            behaviour, for whoever wants the most accurate answer.
 *   BF16     opt-in (PyTorch's set_float32_matmul_precision("medium")): f32
 *            inputs, and bf16 ones, are rounded to bf16 (to nearest even) for
 *            q.k and p.v and then computed as bf16 inputs are by DEFAULT on
 *            the bf16 tiles. Where those tiles do not run (other kernels and
 *            shapes, decode-sized problems, a KV cache's q8_0/q4_0 blocks)
 *            f32 inputs stay fp32, unrounded. f16 inputs are never rounded to
 *            bf16 (they would lose bits): they stay as DEFAULT computes them. The layer (attn_mha_forward,
 *            attn_mha_forward_save, attn_mha_forward_cached) then also runs
 *            its four projections with bf16 products summed in fp32 (x and
 *            the weights rounded to bf16, the bias added in fp32) where the
 *            kernel has a bf16 GEMM (ATTN_KERNEL_AVX512_BF16: vdpbf16ps;
 *            ATTN_KERNEL_AMX: AMX tiles), and its attention on the f32
 *            projections rounded as above.
 *   F16      opt-in, the same for f16 (PyTorch's model.half()): f32 inputs are
 *            rounded to f16 (to nearest even; past 65504 they become Inf) and
 *            then computed on the AMX f16 tiles as f16 inputs are by DEFAULT:
 *            f16 products, exact in fp32, summed in fp32, the probabilities
 *            rounded to f16 for p.v. Where those tiles do not run (other
 *            kernels, Dv not a multiple of 16, decode-sized problems) f32
 *            inputs stay fp32, unrounded, as BF16 leaves them off its tiles.
 *            bf16 inputs are never rounded to f16 (f16 holds a narrower
 *            range): they stay as DEFAULT computes them. The layer's
 *            projections take x and the weights rounded to f16 on every
 *            kernel (the fp32 GEMM then computes f16's products exactly; the
 *            bias is added in fp32), and its attention the f32 projections as
 *            above.
 * attn_linear follows the same rules for its x and weight (see there).
 * Outside these rules no input loses precision: f32 inputs are rounded only
 * under BF16 and F16. The oracle always runs in float64.
 * The backward (attn_sdpa_backward) of bf16 q, k and v under DEFAULT or BF16,
 * on ATTN_KERNEL_AMX or ATTN_KERNEL_AVX512_BF16 with D and Dv multiples of 16,
 * computes as PyTorch's bf16
 * backward: q.k and dout.v as bf16 products (dout rounded to bf16), P and
 * dS = P (dP - Dd) in fp32 with every option, then dV = P^T dout, dK = dS^T q
 * and dQ = dS k with P and dS rounded to bf16, every sum in fp32. f16 q, k and
 * v on ATTN_KERNEL_AMX compute as PyTorch's f16 backward: the same steps with f16's exact
 * products (each f16 as two bf16, four products) and dout, P and dS rounded to
 * f16. Every other backward (f32 inputs, FP32, other kernels and head sizes)
 * runs in fp32, halves widened as they are read. */
typedef enum attn_precision {
  ATTN_PRECISION_DEFAULT = 0,
  ATTN_PRECISION_FP32 = 1,
  ATTN_PRECISION_BF16 = 2,
  ATTN_PRECISION_F16 = 3
} attn_precision;

/* The environment (ATTN_KERNEL, ATTN_DECODE) is read here, once: a context's
 * choices never change under a later setenv. */
ATTN_API attn_status attn_ctx_create(attn_ctx **out);
ATTN_API void attn_ctx_destroy(attn_ctx *ctx);
/* A context keeps the scratch memory of its largest call (packed keys and
 * values, partial gradients: O(N·D), never O(N²)) for the calls that follow,
 * so repeated calls do not pay to fault it in again. attn_ctx_trim returns it
 * to the system now; attn_ctx_workspace_bytes says how much is held. */
ATTN_API void attn_ctx_trim(attn_ctx *ctx);
ATTN_API size_t attn_ctx_workspace_bytes(const attn_ctx *ctx);
/* 0 = all processors (OpenMP's default). Results do not depend on it. */
ATTN_API attn_status attn_ctx_set_threads(attn_ctx *ctx, int threads);
/* The thread count calls will use (the OpenMP default when set to 0). */
ATTN_API int attn_ctx_threads(const attn_ctx *ctx);
ATTN_API attn_status attn_ctx_set_kernel(attn_ctx *ctx, attn_kernel kernel);
/* The kernel calls will actually use (AUTO and the ATTN_KERNEL read at
 * create resolved); never AUTO. NULL: the automatic choice for this CPU and
 * build, without the environment. */
ATTN_API attn_kernel attn_ctx_kernel(const attn_ctx *ctx);
/* Problems of decode size (few query rows per kv head) run on the decode
 * kernel unless enabled is 0: then they go through the blocked kernel, for
 * tests and benchmarks (the results agree to rounding). Default 1, or 0 when
 * ATTN_DECODE=0 was set when the context was created. */
ATTN_API attn_status attn_ctx_set_decode(attn_ctx *ctx, int enabled);
/* 1 when the decode kernel may be used, else 0. NULL: 1 (the default). */
ATTN_API int attn_ctx_decode(const attn_ctx *ctx);
/* The precision policy of the context's forward calls and attn_linear (see attn_precision);
 * DEFAULT, or ATTN_PRECISION (default, fp32, bf16, f16) when the context was made. */
ATTN_API attn_status attn_ctx_set_precision(attn_ctx *ctx, attn_precision precision);
ATTN_API attn_precision attn_ctx_precision(const attn_ctx *ctx);
ATTN_API const char *attn_precision_name(attn_precision precision);
ATTN_API const char *attn_kernel_name(attn_kernel kernel);
/* Nonzero when this CPU (and this build) can run kernel. Asks the CPU on every
 * call (CPUID is slow inside VMs); a context asks once, when it is created. */
ATTN_API int attn_kernel_supported(attn_kernel kernel);
/* How the last attention call on ctx (forward, backward, decode) dealt its
 * work: its phases, the items of each, and whether they went to threads in
 * static ranges or on demand. "" before any; valid until the next call. For
 * tuning and bug reports: the wording may change between versions. */
ATTN_API const char *attn_ctx_plan(attn_ctx *ctx);
/* The message of the last failed call on ctx ("" if none). Valid until the next call. */
ATTN_API const char *attn_ctx_error(const attn_ctx *ctx);
/* Records a failure on ctx as the library's own calls do (printf-style
 * message) and returns status: for libraries built on this one (attn_mpi.h). */
ATTN_API attn_status attn_ctx_fail(attn_ctx *ctx, attn_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* ---- tensors --------------------------------------------------------------- */
typedef enum attn_dtype {
  ATTN_F32 = 0,
  ATTN_F64 = 1,
  ATTN_F16 = 2,
  ATTN_BF16 = 3,
  ATTN_BOOL = 4, /* one byte, 0 = false, anything else = true */
  ATTN_U8 = 5
} attn_dtype;

#define ATTN_MAX_RANK 8

typedef struct attn_tensor {
  void *data;
  attn_dtype dtype;
  int rank;
  int64_t shape[ATTN_MAX_RANK];
  int64_t strides[ATTN_MAX_RANK]; /* in elements; 0 broadcasts */
} attn_tensor;

ATTN_API size_t attn_dtype_size(attn_dtype dtype);
ATTN_API const char *attn_dtype_name(attn_dtype dtype);
/* A contiguous (C order) view of data. rank <= ATTN_MAX_RANK. A dimension of
 * size 0 counts as 1 in the strides (as in numpy); a stride that would pass
 * INT64_MAX, which only a tensor with no element can need (e.g. [0, 2^62, 4]),
 * is 0. Every call that takes a tensor refuses (ATTN_E_SHAPE) a view whose
 * extent, the sum of (shape[i] - 1) * |strides[i]| elements, empty or not,
 * passes 2^63 bytes. */
ATTN_API attn_tensor attn_tensor_view(void *data, attn_dtype dtype, int rank, const int64_t *shape);
/* The same data with dimensions reordered: result dim i is t's dim perm[i].
 * Turns batch-first [B, N, H, D] into [B, H, N, D] without a copy. */
ATTN_API attn_status attn_tensor_permute(attn_tensor *out, const attn_tensor *t, const int *perm);
/* Allocates a contiguous tensor (64-byte aligned, zero-filled); free with attn_tensor_free.
 * Refuses (ATTN_E_SHAPE) a shape whose strides attn_tensor_view could not represent. */
ATTN_API attn_status attn_tensor_alloc(attn_ctx *ctx, attn_tensor *out, attn_dtype dtype, int rank, const int64_t *shape);
ATTN_API void attn_tensor_free(attn_tensor *t);
/* Copies src into dst, an existing tensor of the same shape (ATTN_E_SHAPE
 * otherwise), element by element through any strides, converting between any
 * two dtypes: floats round to nearest even (f64 to f16 or bf16 in one
 * rounding), anything non-zero (NaN too) becomes true in a bool, and a u8 takes
 * the value rounded to nearest even, refused (ATTN_E_INVALID) outside 0..255
 * or NaN before anything is written. Refuses (ATTN_E_INVALID) a dst that
 * broadcasts (a stride 0) or whose memory overlaps src's. */
ATTN_API attn_status attn_tensor_copy(attn_ctx *ctx, attn_tensor *dst, const attn_tensor *src);
/* The element count (0 with any dimension 0), or -1 for a bad rank or on overflow. */
ATTN_API int64_t attn_tensor_numel(const attn_tensor *t);

/* ---- scaled dot-product attention ------------------------------------------ */
/* The largest head dim (D, Dv) any call takes; larger ones get ATTN_E_SHAPE. */
#define ATTN_MAX_HEAD_DIM ((int64_t)1 << 24)

typedef enum attn_causal {
  ATTN_CAUSAL_NONE = 0,
  ATTN_CAUSAL_TOP_LEFT = 1,     /* query i sees keys j <= i (PyTorch is_causal) */
  ATTN_CAUSAL_BOTTOM_RIGHT = 2  /* query i sees keys j <= i + Nk - Nq (a KV cache) */
} attn_causal;

/* How a mask tensor is read. Masked logits become -inf (ADDITIVE/SEED: added).
 *                  mask dtype     true/value means         as in
 *   KEEP           bool/u8        true = attend             F.scaled_dot_product_attention
 *   MASKED         bool/u8        true = masked out          nn.MultiheadAttention
 *   ADDITIVE       f32/f64/f16/bf16  added to the logits (-inf masks)   both, for float masks
 *   SEED           any            logits += mask * -1e9      the seed module
 * SEED's -1e9 is a finite bias, not a mask: a row whose every key it masks is,
 * in fp32, uniform over those keys (s - 1e9 rounds to -1e9 for |s| < 32), as
 * in the seed module run in fp32, while the float64 oracle keeps softmax(s)
 * there; rows that keep a key agree. */
typedef enum attn_mask_mode {
  ATTN_MASK_KEEP = 0,
  ATTN_MASK_MASKED = 1,
  ATTN_MASK_ADDITIVE = 2,
  ATTN_MASK_SEED = 3
} attn_mask_mode;

/* Options for attn_sdpa and its backward: inputs only (the optional outputs,
 * weights, lse and the option gradients, are arguments of the calls).
 * Initialise with attn_sdpa_opts_init (fields may be added in later versions,
 * always with a default that changes nothing). */
typedef struct attn_sdpa_opts {
  size_t size;                /* sizeof(attn_sdpa_opts), set by attn_sdpa_opts_init */
  double scale;               /* logits = q.k * scale; NaN (the default) = 1/sqrt(D) */
  attn_causal causal;
  const attn_tensor *mask;    /* broadcastable to [B, Hq, Nq, Nk] (numpy rules), or NULL */
  attn_mask_mode mask_mode;
  const attn_tensor *key_padding; /* bool/u8 [B, Nk], true = ignore that key; or NULL */
  /* Training: dropout on the probabilities, kept ones scaled by 1/(1-p). Entry
   * (b, h, i, j) is dropped when attn_dropout_keep(seed, p, b, h, i, j) is 0,
   * so the backward pass regenerates the mask and no thread count changes it
   * (in a packed batch b is the sequence, i and j positions within it). */
  double dropout_p;           /* in [0, 1]; 0 = off; 1 drops every entry: out and the
                                 gradients of q, k, v are 0, as PyTorch gives */
  uint64_t dropout_seed;
  /* Options of recent models. Positions: query row i sits at i' = i + Nk - Nq
   * under ATTN_CAUSAL_BOTTOM_RIGHT (a KV cache), else at i' = i.
   * Sliding window: query i' sees keys i' - window < j <= i' only. A window
   * implies the causal bound (top-left when causal is NONE); 0 = off. */
  int64_t window;
  /* Logit soft-capping: s = softcap * tanh(s / softcap) on the scaled logits,
   * before ALiBi and the masks (Gemma 2); 0 = off, else > 0. */
  double softcap;
  /* ALiBi: f32 [Hq], logits of head h += slope[h] * (j - i'); see
   * attn_alibi_slopes for the paper's slopes. NULL = off. */
  const attn_tensor *alibi_slopes;
  /* Attention sinks: f32 [Hq], one learned logit per query head that joins the
   * softmax's denominator and adds nothing to out (lse includes it, weights
   * do not). A row with every key masked then gives zeros and lse = sink. */
  const attn_tensor *sinks;
  /* Packed variable-length batch (FlashAttention's varlen): num_seqs
   * sequences stored one after another along the token dimension of a
   * single batch entry, so no padding is stored or computed. Then
   *   q [1, Hq, total_q, D], k [1, Hk, total_k, D], v [1, Hk, total_k, Dv],
   *   out [1, Hq, total_q, Dv], lse [1, Hq, total_q]
   * and sequence s has query rows cu_seqlens_q[s] .. cu_seqlens_q[s+1] and
   * keys cu_seqlens_k[s] .. cu_seqlens_k[s+1]. Each array has num_seqs + 1
   * entries: 0 first, non-decreasing, total_q (total_k) last; anything else
   * is ATTN_E_INVALID naming the entry. cu_seqlens_k NULL = cu_seqlens_q.
   * Every option applies per sequence, exactly as if the sequence were its
   * own batch entry b = s: positions (causal alignment, window, ALiBi) count
   * from the sequence's first query and key, dropout's entry is (s, h, i, j)
   * with i and j within the sequence. With the blocked kernels each
   * sequence's out and lse are bitwise those of attn_sdpa on that sequence
   * alone (with attn_ctx_set_decode(ctx, 0): a lone sequence of a few query
   * rows would otherwise go to the decode kernel), and likewise the
   * backward's dq, dk and dv. A sequence with no keys gives zeros (lse
   * -inf, or the sink). Refused with ATTN_E_UNSUPPORTED: mask and
   * key_padding (a packed batch has no padding to mask) and the weights
   * output. NULL / 0 = off (num_seqs must then be 0). */
  const int64_t *cu_seqlens_q, *cu_seqlens_k;
  int64_t num_seqs;
  /* A shard of a longer sequence (sequence parallelism, attn_mpi.h): the
   * global positions of query row 0 and of key 0. Every position-dependent
   * option then counts globally: row i sits at q_offset + i' and key j at
   * k_offset + j for the causal bound, the window and ALiBi, and dropout's
   * entry is (b, h, q_offset + i, k_offset + j), so shards computed apart and
   * merged by their lse give the whole sequence's result. 0 <= each <= 2^48;
   * 0 = off. Refused with a packed batch (cu_seqlens) and by the KV caches. */
  int64_t q_offset, k_offset;
  /* A shard of the heads (head parallelism, attn_mpi.h's ULYSSES): the global
   * index of q head 0, for dropout alone, whose entry is then
   * (b, head_offset + h, i, j) (ALiBi slopes and sinks are per-head tensors:
   * pass their slice). 0 <= head_offset <= 2^31; 0 = off. Refused by the KV
   * caches. */
  int64_t head_offset;
  /* Chunked attention (Llama 4's attention_chunk_size): positions are cut
   * into chunks of `chunk` tokens, [0, chunk), [chunk, 2 chunk), ..., and
   * query i' sees only keys j <= i' of its own chunk, floor(j / chunk) ==
   * floor(i' / chunk). Positions as for the window (global ones with
   * q_offset and k_offset, a sequence's own in a packed batch). Like the
   * window it implies the causal bound (top-left when causal is NONE); with
   * a window too, a key must lie in both. 0 = off, else > 0. */
  int64_t chunk;
} attn_sdpa_opts;

/* The ALiBi paper's slopes for heads heads into slopes[0..heads): for a power
 * of two n, slope h is 2^(-8(h+1)/n); otherwise the slopes of the largest
 * power of two below n, then every other slope of twice that power. */
ATTN_API attn_status attn_alibi_slopes(float *slopes, int64_t heads);

ATTN_API void attn_sdpa_opts_init(attn_sdpa_opts *opts);

/* out[b,h,i,:] = sum_j softmax_j(scale * q[b,h,i,:].k[b,g,j,:] + mask) v[b,g,j,:]
 *   out is [B, Hq, Nq, Dv]         q is [B, Hq, Nq, D]
 *   k   is [B, Hk, Nk, D]          v is [B, Hk, Nk, Dv]
 * Optional outputs (NULL: not computed):
 *   lse     f32 [B, Hq, Nq], the log-sum-exp of the scaled, masked logits
 *           (what attn_sdpa_backward needs);
 *   weights f32 [B, Hq, Nq, Nk], the probabilities applied to v (after dropout).
 * q, k and v are each f32, f16 or bf16, computed as the context's precision
 * policy says (attn_precision: every sum is in f32); out is f32, f16 or bf16
 * (the f32 result rounded to nearest even); weights and lse are f32.
 * Grouped-query attention: Hq = G * Hk, query head h reads kv head g = h / G
 * (Hk = 1 is multi-query attention). Any strides: pass permuted views for
 * batch-first data. A row whose every key is masked gives zeros in out and
 * weights and -inf in lse (the sink with sinks), never NaN. NaN or Inf in the inputs propagate.
 * Hidden keys are never read: a key outside row i's causal bound, window or
 * chunk, padded by key_padding, false in a KEEP mask, true in a MASKED mask or -inf
 * in an additive one reaches none of that row's out, weights, lse or
 * gradients, whatever its k and v hold (NaN and Inf included: the unused tail
 * of a buffer may stay uninitialised). Every kernel keeps this.
 * With ATTN_KERNEL_REF the oracle runs instead (see attn_sdpa_ref). */
ATTN_API attn_status attn_sdpa(attn_ctx *ctx, attn_tensor *out, attn_tensor *lse, attn_tensor *weights,
                               const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                               const attn_sdpa_opts *opts);

/* The float64 oracle: the same contract, but q/k/v/mask may be any float
 * dtype, every step runs in double, and out/lse/weights may be f32 or f64. */
ATTN_API attn_status attn_sdpa_ref(attn_ctx *ctx, attn_tensor *out, attn_tensor *lse, attn_tensor *weights,
                                   const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                                   const attn_sdpa_opts *opts);

/* Backward of attn_sdpa: gradients of a loss L given dout = dL/dout.
 *   dq is [B, Hq, Nq, D], dk [B, Hk, Nk, D], dv [B, Hk, Nk, Dv] (overwritten);
 *   mask_grad (or NULL) f32 [B, Hq, Nq, Nk], the gradient of an ADDITIVE mask
 *   (sum it over the dimensions the mask broadcast along);
 *   sinks_grad (or NULL) f32 [Hq], dL/dsinks (summed over batch and rows);
 *   q, k, v, dout and out are f32, f16 or bf16 (bf16 q, k, v run on the bf16
 *   tiles where attn_precision says so; other halves are widened as they are
 *   read, and every step is fp32); lse is f32;
 *   dq, dk and dv may also be f16 or bf16: the f32 gradients, rounded
 *   dout, out [B, Hq, Nq, Dv] and lse [B, Hq, Nq] come from the forward call,
 *   made with the same q, k, v and opts (mask, causal, scale, dropout); the
 *   weights are not needed: scores are recomputed tile by tile.
 * With grouped-query attention dk/dv sum over the query heads of a group.
 * Rows whose every key is masked give zero gradients. A packed batch (opts'
 * cu_seqlens_q): dq [1, Hq, total_q, D], dk [1, Hk, total_k, D], dv [1, Hk,
 * total_k, Dv], each sequence's bitwise its backward alone; sinks_grad sums
 * over every sequence's rows. */
ATTN_API attn_status attn_sdpa_backward(attn_ctx *ctx, attn_tensor *dq, attn_tensor *dk, attn_tensor *dv,
                                        attn_tensor *mask_grad, attn_tensor *sinks_grad, const attn_tensor *dout,
                                        const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                                        const attn_tensor *out, const attn_tensor *lse, const attn_sdpa_opts *opts);
/* The float64 oracle of the backward pass: any float dtype in, f32 or f64 out. */
ATTN_API attn_status attn_sdpa_backward_ref(attn_ctx *ctx, attn_tensor *dq, attn_tensor *dk, attn_tensor *dv,
                                            attn_tensor *mask_grad, attn_tensor *sinks_grad, const attn_tensor *dout,
                                            const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                                            const attn_tensor *out, const attn_tensor *lse, const attn_sdpa_opts *opts);
/* 1 when dropout keeps entry (b, h, i, j) for this seed and p: a counter-based
 * generator (Philox-4x32-10), the same in every kernel and on every machine. */
ATTN_API int attn_dropout_keep(uint64_t seed, double p, int64_t b, int64_t h, int64_t i, int64_t j);

/* ---- rotary position embeddings (RoPE) ----------------------------------------- */
/* Rotates pairs of each head's first r dims (r = rotary_dim) by angles that
 * grow with the token's position p: pair i (0 <= i < r/2) turns by p * f_i,
 *   out_a = x_a cos(p f_i) - x_b sin(p f_i),  out_b = x_b cos(p f_i) + x_a sin(p f_i),
 * both times the attention factor m (1 but for YaRN); dims r..D-1 pass unchanged.
 * The pair (a, b) is (i, i + r/2) in the HALF layout (GPT-NeoX, Llama: the
 * rotate_half of Hugging Face) and (2i, 2i + 1) in INTERLEAVED (GPT-J).
 * Frequencies, with d = r and base theta: f_i = theta^(-2i/d), then by scaling
 *   DEFAULT  as is
 *   LINEAR   f_i / factor (positions interpolated)
 *   DYNAMIC  NTK-aware: theta becomes theta ((factor L / P) - (factor - 1))^(d / (d - 2))
 *            when L > P (P = original_max_position, L = seq_len or the
 *            call's largest position + 1), else DEFAULT
 *   LLAMA3   by wavelength w_i = 2 pi / f_i: w_i > P / low_freq_factor: f_i / factor;
 *            w_i < P / high_freq_factor: f_i; between: (1 - s) f_i / factor + s f_i
 *            with s = (P / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor)
 *   YARN     f_i = f_i / factor (1 - e_i) + f_i e_i, where e_i = 1 - ramp(i) and ramp
 *            climbs linearly from 0 at lo to 1 at hi (lo = floor(c(beta_fast)),
 *            hi = ceil(c(beta_slow)); without yarn_truncate lo = c(beta_fast) and
 *            hi = c(beta_slow) as they are (gpt-oss); clamped to [0, d - 1], hi =
 *            lo + 0.001 if equal; c(n) = d ln(P / (2 pi n)) / (2 ln theta)); m = attention_factor,
 *            by default 0.1 ln(factor) + 1 (1 when factor <= 1).
 *   LONGROPE f_i = f_i / e_i with e = long_factor when L > P (L as DYNAMIC's: seq_len,
 *            or the call's largest position + 1), else short_factor (Phi-3, Phi-4-mini);
 *            m = attention_factor, by default sqrt(1 + ln(factor) / ln(P)) (1 when
 *            factor <= 1; P > 1).
 * Angles and their cos and sin are computed in double, then the rotation in f32. */
typedef enum attn_rope_layout {
  ATTN_ROPE_HALF = 0,       /* pairs (i, i + r/2) */
  ATTN_ROPE_INTERLEAVED = 1 /* pairs (2i, 2i + 1) */
} attn_rope_layout;

typedef enum attn_rope_scaling {
  ATTN_ROPE_DEFAULT = 0,
  ATTN_ROPE_LINEAR = 1,
  ATTN_ROPE_DYNAMIC = 2,
  ATTN_ROPE_LLAMA3 = 3,
  ATTN_ROPE_YARN = 4,
  ATTN_ROPE_LONGROPE = 5 /* added in 0.3 */
} attn_rope_scaling;

/* LONGROPE's factors per rotary pair, held in attn_rope_opts: r/2 at most this. */
#define ATTN_ROPE_MAX_PAIRS 128

typedef struct attn_rope_opts {
  size_t size;                   /* sizeof(attn_rope_opts), set by attn_rope_opts_init */
  int64_t rotary_dim;            /* r: even, 2..D; 0 = D (partial rotary: GPT-NeoX, Phi) */
  attn_rope_layout layout;       /* HALF */
  double theta;                  /* base, > 1: 10000 */
  attn_rope_scaling scaling;     /* DEFAULT */
  double factor;                 /* LINEAR, DYNAMIC, LLAMA3, YARN: > 0 (1) */
  int64_t original_max_position; /* DYNAMIC, LLAMA3, YARN: the pretraining context P (> 0) */
  double low_freq_factor, high_freq_factor; /* LLAMA3: 1 and 4; high > low > 0 */
  double beta_fast, beta_slow;   /* YARN: 32 and 1 */
  double attention_factor;       /* YARN's m; NAN (the default) = 0.1 ln(factor) + 1 */
  int64_t seq_len;               /* DYNAMIC's L; 0 = the call's largest position + 1 */
  /* Positions [B, N] (row-major int64), one per token, or NULL: token n of
   * every row sits at position_offset + n. Negative positions are refused. */
  const int64_t *positions;
  int64_t position_offset;
  int transpose;                 /* nonzero: apply the transposed rotation (the backward:
                                    dL/dx = rope(dL/dout) with transpose set) */
  /* Added in 0.3. */
  int yarn_truncate;             /* YARN: 1 (attn_rope_opts_init) rounds lo and hi out to whole
                                    pairs; 0 keeps them as computed (transformers' truncate: false) */
  /* LONGROPE: e_i for the r/2 rotary pairs (the rest unread), each finite and > 0; held by value,
     so a copy of the struct is complete */
  double short_factor[ATTN_ROPE_MAX_PAIRS];
  double long_factor[ATTN_ROPE_MAX_PAIRS];
} attn_rope_opts;

ATTN_API void attn_rope_opts_init(attn_rope_opts *opts);
/* out = RoPE(x): x and out are [B, H, N, D] (heads of q or k; position per
 * (b, n)), f32, f16 or bf16, any strides; out may be x itself (in place) but
 * must not otherwise overlap it. */
ATTN_API attn_status attn_rope(attn_ctx *ctx, attn_tensor *out, const attn_tensor *x, const attn_rope_opts *opts);
/* The float64 oracle: the same frequencies, every step in double; out may be f64. */
ATTN_API attn_status attn_rope_ref(attn_ctx *ctx, attn_tensor *out, const attn_tensor *x, const attn_rope_opts *opts);

/* ---- QK-norm: a norm over each head's features ----------------------------------- */
/* Normalises every row x[b, h, n, :] of F features (a head's q or k, or with
 * H = 1 a whole projection, as OLMo 2 does), in double, then scales it:
 *   RMS            y = x / sqrt(mean(x^2) + eps) * w                (Qwen3, OLMo 2)
 *   RMS_PLUS_ONE   y = x / sqrt(mean(x^2) + eps) * (1 + w)          (Gemma)
 *   LAYER          y = (x - mean(x)) / sqrt(var(x) + eps) * w + b   (b may be NULL: 0)
 * x and out are [B, H, N, F] (f32, f16, bf16, or f64 kept in double: the
 * float64 path; any strides; out may be x itself), w and b f32 [F] shared by
 * the heads or [H, F], each head its own (Cohere); eps > 0. */
typedef enum attn_norm_kind {
  ATTN_NORM_RMS = 0,
  ATTN_NORM_RMS_PLUS_ONE = 1,
  ATTN_NORM_LAYER = 2
} attn_norm_kind;

ATTN_API attn_status attn_head_norm(attn_ctx *ctx, attn_tensor *out, const attn_tensor *x, const attn_tensor *weight,
                                    const attn_tensor *bias, attn_norm_kind kind, double eps);
/* Its backward, given dout = dL/dout: dx [B, H, N, F] f32 or f64 (overwritten; may be
 * dout itself), dweight and dbias f32 shaped as weight (each may be NULL; overwritten
 * with the sum over every row, or every row of the head, in row order: the same
 * for any thread count). */
ATTN_API attn_status attn_head_norm_backward(attn_ctx *ctx, attn_tensor *dx, attn_tensor *dweight, attn_tensor *dbias,
                                             const attn_tensor *dout, const attn_tensor *x, const attn_tensor *weight,
                                             attn_norm_kind kind, double eps);

/* ---- Hugging Face configs ------------------------------------------------------ */
/* What a model's config.json (as transformers saves it) says of its attention.
 * The names of each family are read: hidden_size / n_embd / d_model / dim,
 * num_attention_heads / n_head / num_heads / n_heads, num_key_value_heads,
 * head_dim / d_kv, num_hidden_layers / n_layer / num_layers / n_layers; RoPE
 * from rope_theta (rotary_emb_base) and
 * rope_scaling (older configs) or rope_parameters (current ones, also per layer
 * type), partial_rotary_factor, rope_local_base_freq; sliding_window with
 * layer_types (or Gemma 2's and 3's older patterns, Qwen2's use_sliding_window
 * and max_window_layers); attn_logit_softcapping; query_pre_attn_scalar;
 * GPT-2's scale_attn_weights and scale_attn_by_inverse_layer_idx;
 * attention_bias; rms_norm_eps; SmolLM3's and Llama 4's no_rope_layers (or
 * their no_rope_layer_interval); Llama 4's attention_chunk_size with
 * layer_types (or its rule: the RoPE layers are chunked). Where the config is silent, a family gets what
 * transformers gives it: interleaved RoPE pairs (cohere, cohere2, glm, glm4,
 * helium, ernie4_5, gptj), its default rope_theta and partial rotary factor,
 * granite's attention_multiplier 1, its sliding layers' period (gemma2/3,
 * cohere2, exaone4, olmo3, qwen2_moe, dots1), no RoPE on cohere2's and
 * exaone4's full layers (nope[]), and olmo3's rope_scaling on its full
 * layers only. What the config asks for and libattn lacks (PhiMoE's longrope
 * mscales, relative position embeddings in BERT, an unknown layer type, Llama
 * 4's weightless QK-norm and temperature tuning, attention_chunk_size outside
 * Llama 4, clip_qkv
 * but OLMo's and OLMoE's, qk_layernorm but Phi's and StableLM's, use_qk_norm but Cohere's, kv_lora_rank / q_lora_rank,
 * key_multiplier, llama_4_scaling_beta, use_bidirectional_attention; the
 * model_types hunyuan_v1_*, bitnet, doge, qwen3_next, jetmoe, deepseek_v2/v3,
 * kimi_k2, falcon_h1) is ATTN_E_UNSUPPORTED naming the field or the type,
 * never a layer that silently differs. */
#define ATTN_HF_MAX_LAYERS 1024

typedef struct attn_hf_config {
  size_t size;                /* sizeof(attn_hf_config), set by the readers */
  char model_type[64];        /* "llama", "qwen3", "gemma2", "gpt2", "bert", "t5", ...; "" when absent */
  int64_t hidden_size, num_heads, num_kv_heads, head_dim, num_layers; /* kv heads, head_dim: derived when absent */
  double scale;               /* of the logits: query_pre_attn_scalar^(-1/2) (Gemma), attention_multiplier
                                 (Granite; 1 when unsaid), 1 (T5), else NAN = 1/sqrt(head_dim) */
  double softcap;             /* attn_logit_softcapping; 0 = none */
  int64_t sliding_window;     /* 0 = none; which layers use it: sliding[] */
  unsigned char sliding[ATTN_HF_MAX_LAYERS]; /* 1: layer L attends within sliding_window */
  int attention_bias;         /* 1 or 0 as said; -1 when the config does not say (the checkpoint tells) */
  double norm_eps;            /* rms_norm_eps or layer_norm_eps (QK-norm's); NAN when absent */
  int rope;                   /* 1: rotary embeddings (opts below; positions NULL) */
  attn_rope_opts rope_global; /* full-attention layers' */
  attn_rope_opts rope_local;  /* sliding layers' (Gemma 3's own base); = rope_global otherwise */
  int scale_inverse_layer;    /* GPT-2's scale_attn_by_inverse_layer_idx: layer L's scale divided by L + 1 */
  int relative_bias;          /* T5's relative position bias (relative_attention_num_buckets): not computed
                                 here; the caller passes it as an additive mask [B or 1, H, Nq, Nk] */
  /* Added in 0.3. */
  unsigned char nope[ATTN_HF_MAX_LAYERS]; /* 1: layer L takes no RoPE (SmolLM3's no_rope_layers[L] = 0;
                                             Cohere 2's and EXAONE 4's full layers) */
  int qk_norm;                /* 1: the config says q and k are normed (Cohere's use_qk_norm: a LayerNorm,
                                 each head its own weights; Phi's qk_layernorm: a LayerNorm with biases,
                                 shared by the heads; StableLM's: a LayerNorm per head, saved per head as
                                 q_layernorm.norms.{h}.weight); families that always norm say nothing here */
  double clip_qkv;            /* OLMo's and OLMoE's clip_qkv (attn_mha_config.clip_qkv); 0 = none */
  int64_t attention_chunk;    /* Llama 4's attention_chunk_size (attn_sdpa_opts.chunk); 0 = none; which
                                 layers use it: chunked[] */
  unsigned char chunked[ATTN_HF_MAX_LAYERS]; /* 1: layer L attends within its chunk (layer_types'
                                                "chunked_attention"; Llama 4's RoPE layers) */
} attn_hf_config;

/* Reads path (a config.json) into *out. */
ATTN_API attn_status attn_hf_config_read(attn_ctx *ctx, attn_hf_config *out, const char *path);
/* The same on len bytes of JSON text; name stands for a path in messages. */
ATTN_API attn_status attn_hf_config_parse(attn_ctx *ctx, attn_hf_config *out, const char *json, size_t len,
                                          const char *name);

/* ---- KV cache: incremental decoding ------------------------------------------- */
/* The keys and values of one attention layer's past tokens, for B sequences
 * (rows) that may each hold a different number of tokens. Storage is
 * [B, Hk, capacity, D] for keys and [B, Hk, capacity, Dv] for values, in f32,
 * f16 or bf16 (halves the memory and the read time of a decoding step; rounded
 * to nearest even on append, widened to f32 in registers on attend), or in
 * the block formats below (quantized on append, dequantized in registers by
 * the decode kernels), chosen separately for keys and values. */
typedef struct attn_kv_cache attn_kv_cache;

/* Storage of one kind (keys or values) of a KV cache.
 *
 * ATTN_KV_Q8_0 and ATTN_KV_Q4_0 store each token's D (or Dv) values as blocks
 * of 32, byte for byte ggml's block_q8_0 / block_q4_0 (a llama.cpp cache of
 * those types holds the same bytes); D and Dv must be multiples of 32.
 *   q8_0, 34 bytes: f16 scale d (little-endian), then int8 q[32]; x = d * q.
 *     Encoding: d = max|x| / 127 (f32), q = round(x * (1 / d)) (f32, halfway
 *     away from zero), all q = 0 when d = 0; then d is stored rounded to f16.
 *   q4_0, 18 bytes: f16 scale d, then 16 bytes: byte j holds element j in its
 *     low nibble and element j + 16 in its high nibble; x = d * (q - 8).
 *     Encoding: m = the element of largest magnitude, with its sign (the
 *     first, on a tie), d = m / -8 (f32), q = min(15, floor(x * (1 / d) + 8.5))
 *     (f32: halfway rounds up), all q = 8 when d = 0; d stored as f16.
 * The quotient uses the f32 d, not its f16 rounding, as ggml's quantizers do.
 * A block holding a NaN or an infinity is stored as scale NaN (0x7e00) with q
 * = 0 (q8_0) or 8 (q4_0): all 32 of its values read back NaN, so a non-finite
 * input poisons its block's results as it would in f32 storage instead of
 * vanishing. A finite block whose d passes the f16 range (|x| > 65504 * 127 or
 * * 8) gets scale Inf. */
typedef enum attn_kv_dtype {
  ATTN_KV_AS_DTYPE = 0, /* attn_kv_cache_config.dtype */
  ATTN_KV_F32 = 1,
  ATTN_KV_F16 = 2,
  ATTN_KV_BF16 = 3,
  ATTN_KV_Q8_0 = 4,
  ATTN_KV_Q4_0 = 5
} attn_kv_dtype;

/* "f32", "f16", "bf16", "q8_0", "q4_0" ("as_dtype" for 0, "?" otherwise). */
ATTN_API const char *attn_kv_dtype_name(attn_kv_dtype dt);
/* Bytes that n values take in dt (n a multiple of 32 for q8_0 and q4_0); 0 for
 * ATTN_KV_AS_DTYPE, an unknown dt or an n the format cannot hold. */
ATTN_API size_t attn_kv_dtype_bytes(attn_kv_dtype dt, int64_t n);
/* The encoders and decoders of the block formats, as the cache uses them:
 * src (n floats) into dst (attn_kv_dtype_bytes(dt, n) bytes), and back. dt is
 * ATTN_KV_Q8_0 or ATTN_KV_Q4_0 and n a multiple of 32 (else ATTN_E_INVALID). */
ATTN_API attn_status attn_kv_quantize(attn_ctx *ctx, attn_kv_dtype dt, void *dst, const float *src, int64_t n);
ATTN_API attn_status attn_kv_dequantize(attn_ctx *ctx, attn_kv_dtype dt, float *dst, const void *src, int64_t n);

typedef struct attn_kv_cache_config {
  size_t size;        /* sizeof(attn_kv_cache_config), set by attn_kv_cache_config_init */
  int64_t batch;      /* B rows */
  int64_t capacity;   /* tokens each row can hold */
  int64_t kv_heads;   /* Hk */
  int64_t head_dim;   /* D of the keys */
  int64_t v_head_dim; /* Dv of the values; 0 = D */
  attn_dtype dtype;   /* storage: ATTN_F32, ATTN_F16 or ATTN_BF16 (see k_dtype, v_dtype) */
  /* Rotary embeddings (NULL: none; the cache keeps a copy): keys are rotated
   * once, on append, at their positions (row b's length + i), and queries on
   * attend at theirs (len_b - Nq + i), so the cache holds rotated keys and a
   * step needs no position from the caller. positions must be NULL,
   * position_offset 0 and transpose 0. DYNAMIC and LONGROPE (with seq_len
   * 0) take L from each call: the longest row's length + n on append (n the
   * tensor's tokens), its length on attend; keys keep the rotation they were
   * appended with (transformers' longrope decoding does the same with its
   * step's positions). */
  const attn_rope_opts *rope;
  /* Storage of the keys and of the values; ATTN_KV_AS_DTYPE (0, the default
   * and what a caller built before these fields gets) = dtype. Keys are
   * quantized after RoPE. attn_kv_cache_get_config reports both resolved. */
  attn_kv_dtype k_dtype, v_dtype;
} attn_kv_cache_config;

/* batch, capacity, kv_heads, head_dim as given; Dv = D; f32 storage. */
ATTN_API void attn_kv_cache_config_init(attn_kv_cache_config *cfg, int64_t batch, int64_t capacity, int64_t kv_heads,
                                        int64_t head_dim);
/* Reserves B x Hk x capacity rows of K and of V. Memory becomes resident as
 * rows are appended, in 4 KiB pages, or, where a kv head's capacity holds 2
 * MiB or more, in 2 MiB huge pages where the OS gives them on request (Linux
 * THP "madvise" or "always"): decoding streams each head's rows, and small
 * pages' walks slowed it by up to 1.2x (BENCHMARKS.md). A touched head then
 * rounds up to whole 2 MiB pages; for many short rows in a large capacity,
 * the paged cache below holds only the blocks used. */
ATTN_API attn_status attn_kv_cache_create(attn_ctx *ctx, attn_kv_cache **out, const attn_kv_cache_config *cfg);
ATTN_API void attn_kv_cache_destroy(attn_kv_cache *cache);
ATTN_API const attn_kv_cache_config *attn_kv_cache_get_config(const attn_kv_cache *cache);
/* Tokens row b holds now (0 for a row out of range). */
ATTN_API int64_t attn_kv_cache_length(const attn_kv_cache *cache, int64_t b);
/* Appends new tokens: k is [B, Hk, n, D], v [B, Hk, n, Dv], any float dtype and
 * strides. Row b takes its first n_new[b] tokens (0..n); n_new NULL = all n.
 * If any row would pass its capacity nothing is appended (ATTN_E_SHAPE). */
ATTN_API attn_status attn_kv_cache_append(attn_ctx *ctx, attn_kv_cache *cache, const attn_tensor *k,
                                          const attn_tensor *v, const int64_t *n_new);
/* Attention of new queries over every cached token of their row. Decode-sized
 * steps (Nq times the GQA group at most 64; at most 24 where attn_sdpa would
 * take the bf16 tiles, see attn_precision) read the storage in place, the
 * block formats dequantized in registers; larger ones (a prefill) go row by
 * row through attn_sdpa's blocked forward on the storage itself, a block
 * format's keys and values dequantized a key block at a time as they are
 * packed (no copy of the cache: their products are then fp32 whatever the
 * precision policy). The reference kernel reads a block format through an
 * f32 copy of the row's keys and values (Hk * len_b * (D + Dv) floats, freed
 * before return):
 *   out is [B, Hq, Nq, Dv] (f32, f16 or bf16), q is [B, Hq, Nq, D] (f32, f16 or bf16), Hq a multiple of Hk.
 * Query i of row b is the token at position len_b - Nq + i (the row's last Nq
 * tokens, bottom-right causal), so append first, then attend. lse (or NULL)
 * is f32 [B, Hq, Nq], as in attn_sdpa. opts may set scale, window (only the
 * last W keys are read), chunk (only the queries' chunks are read), softcap,
 * alibi_slopes and sinks; masks, key padding
 * and dropout are refused (a row's length says which keys exist). Positions
 * < 0 (a row holding fewer than Nq tokens) see nothing: zeros, lse -inf. */
ATTN_API attn_status attn_kv_cache_attend(attn_ctx *ctx, attn_kv_cache *cache, attn_tensor *out, attn_tensor *lse,
                                          const attn_tensor *q, const attn_sdpa_opts *opts);
/* Rollback: row b (-1: every row) keeps its first length tokens (length <= its length). */
ATTN_API attn_status attn_kv_cache_truncate(attn_ctx *ctx, attn_kv_cache *cache, int64_t b, int64_t length);
/* Beam search: row dst becomes a copy of row src (tokens and length). */
ATTN_API attn_status attn_kv_cache_copy_row(attn_ctx *ctx, attn_kv_cache *cache, int64_t dst, int64_t src);
/* Views of row b's cached keys [1, Hk, len_b, D] and values [1, Hk, len_b, Dv]
 * in the storage dtype, valid until the next append, truncate or destroy. A
 * quantized kind is viewed as its raw blocks: ATTN_U8 [1, Hk, len_b, bytes],
 * bytes = attn_kv_dtype_bytes(kind, D or Dv) per token (decode them with
 * attn_kv_dequantize; writing them is allowed, as for the float kinds). */
ATTN_API attn_status attn_kv_cache_view(attn_ctx *ctx, attn_tensor *k, attn_tensor *v, const attn_kv_cache *cache,
                                        int64_t b);

/* ---- paged KV cache: many sequences in one pool of blocks --------------------- */
/* The keys and values of one attention layer for many sequences (vLLM's
 * PagedAttention layout): a pool of num_blocks blocks, each holding
 * block_tokens tokens of every kv head, [Hk, block_tokens, D] keys and
 * [Hk, block_tokens, Dv] values in k_dtype / v_dtype (as attn_kv_dtype above;
 * q8_0 and q4_0 quantized on append, D or Dv a multiple of 32). A sequence is
 * a list of blocks (its block table): memory is taken a block at a time as it
 * grows, so sequences of very different lengths waste at most one block each,
 * and a fork shares its parent's blocks (a prompt prefix stored once; a shared,
 * partly filled last block is copied before either side appends to it).
 * block_tokens of 16 to 256 are typical (at least 1).
 *
 * RoPE is not applied here: the caller rotates keys before appending them, and
 * queries before attending, at the tokens' positions (as vLLM does).
 *
 * Slots of a sequence's last block past its length and blocks in no table are
 * never read: whatever they hold (NaN, stale tokens) reaches no result. The
 * pool keeps each sequence's blocks in runs that follow one another (read as
 * one stream) while it has room: a sequence's next block is the one after its
 * last when that is free; a prompt's blocks start the smallest free extent
 * that holds them all, and a sequence growing a block at a time starts a new
 * run in the middle of the largest free extent (leaving room to the sequence
 * before it), so that sequences growing together do not take each other's
 * next blocks. In a crowded pool (no free run of 8 blocks) any free block is
 * taken. Block ids are the pool's choice: nothing else depends on them. */
typedef struct attn_paged_kv_cache attn_paged_kv_cache;

typedef struct attn_paged_kv_config {
  size_t size;           /* sizeof(attn_paged_kv_config), set by attn_paged_kv_config_init */
  int64_t num_blocks;    /* blocks in the pool, at most 2^31 - 1 */
  int64_t block_tokens;  /* tokens per block, >= 1 (16 to 256 typical) */
  int64_t kv_heads;      /* Hk */
  int64_t head_dim;      /* D of the keys */
  int64_t v_head_dim;    /* Dv of the values; 0 = D */
  attn_kv_dtype k_dtype; /* storage of the keys; ATTN_KV_AS_DTYPE (0) = f32 */
  attn_kv_dtype v_dtype; /* of the values; 0 = f32 */
  int64_t max_seqs;      /* live sequences at most (ids 0..max_seqs-1); init: 256 */
} attn_paged_kv_config;

/* num_blocks, block_tokens, kv_heads, head_dim as given; Dv = D; f32 storage; 256 sequences. */
ATTN_API void attn_paged_kv_config_init(attn_paged_kv_config *cfg, int64_t num_blocks, int64_t block_tokens,
                                        int64_t kv_heads, int64_t head_dim);
/* Sizes whose pool, block tables or counts cannot be addressed are refused
 * (ATTN_E_NOMEM) before anything is allocated. */
ATTN_API attn_status attn_paged_kv_create(attn_ctx *ctx, attn_paged_kv_cache **out, const attn_paged_kv_config *cfg);
ATTN_API void attn_paged_kv_destroy(attn_paged_kv_cache *cache);
/* The config, Dv and the dtypes resolved. */
ATTN_API const attn_paged_kv_config *attn_paged_kv_get_config(const attn_paged_kv_cache *cache);
/* *seq = the id of a new, empty sequence (the lowest free id). ATTN_E_NOMEM
 * when max_seqs sequences are live. */
ATTN_API attn_status attn_paged_kv_seq_new(attn_ctx *ctx, attn_paged_kv_cache *cache, int64_t *seq);
/* Ends sequence seq: its blocks go back to the pool unless another sequence shares them. */
ATTN_API attn_status attn_paged_kv_seq_free(attn_ctx *ctx, attn_paged_kv_cache *cache, int64_t seq);
/* *child = a new sequence holding parent's tokens, sharing its blocks (no copy). */
ATTN_API attn_status attn_paged_kv_seq_fork(attn_ctx *ctx, attn_paged_kv_cache *cache, int64_t *child, int64_t parent);
/* Sequence seq keeps its first length tokens (length <= its length); blocks
 * past them go back to the pool unless shared. */
ATTN_API attn_status attn_paged_kv_seq_truncate(attn_ctx *ctx, attn_paged_kv_cache *cache, int64_t seq,
                                                int64_t length);
/* Tokens sequence seq holds; -1 for an id that is not a live sequence. */
ATTN_API int64_t attn_paged_kv_seq_length(const attn_paged_kv_cache *cache, int64_t seq);
/* Blocks left in the pool (a block shared by several sequences is counted once, as used). */
ATTN_API int64_t attn_paged_kv_free_blocks(const attn_paged_kv_cache *cache);
/* Sequence seq's block table, for inspection: *blocks (or NULL) points at its
 * block ids, in token order, valid until the cache next changes. Returns how
 * many (ceil(length / block_tokens)); -1 for an id that is not a live sequence. */
ATTN_API int64_t attn_paged_kv_block_table(const attn_paged_kv_cache *cache, int64_t seq, const int32_t **blocks);
/* Views of pool block `block`'s keys [1, Hk, block_tokens, D] and values
 * [1, Hk, block_tokens, Dv] in the storage dtype (a block format's as raw
 * blocks, ATTN_U8 [1, Hk, block_tokens, bytes], as attn_kv_cache_view), for
 * inspection with attn_paged_kv_block_table; valid until destroy. Slots past
 * a sequence's length hold whatever was there. */
ATTN_API attn_status attn_paged_kv_block_view(attn_ctx *ctx, attn_tensor *k, attn_tensor *v,
                                              const attn_paged_kv_cache *cache, int64_t block);
/* Appends tokens to nseq distinct sequences seqs[0..nseq): k is
 * [nseq, Hk, n, D], v [nseq, Hk, n, Dv], any float dtype and strides; sequence
 * seqs[i] takes the first n_new[i] tokens (0..n; n_new NULL = all n). Blocks
 * are taken from the pool as needed; if it has too few, ATTN_E_NOMEM and
 * nothing is appended to any sequence. */
ATTN_API attn_status attn_paged_kv_append(attn_ctx *ctx, attn_paged_kv_cache *cache, int64_t nseq, const int64_t *seqs,
                                          const attn_tensor *k, const attn_tensor *v, const int64_t *n_new);
/* Attention of new queries over the tokens of sequences seqs[0..nseq), as
 * attn_kv_cache_attend over rows of those lengths:
 *   out is [nseq, Hq, Nq, Dv] (f32, f16 or bf16), q is [nseq, Hq, Nq, D] (f32,
 *   f16 or bf16), Hq a multiple of Hk; lse (or NULL) f32 [nseq, Hq, Nq].
 * Query i of seqs[b] is its token len - Nq + i (bottom-right causal: append
 * first); opts may set scale, window, chunk, softcap, alibi_slopes and sinks.
 * Decode-sized steps (as attn_kv_cache_attend's: at most 64 rows a kv head,
 * 24 where the bf16 tiles would run) are one parallel
 * call over every sequence and kv head, reading the blocks in place through
 * the block tables, nothing copied; larger ones (a prefill) go sequence by
 * sequence through attn_sdpa's blocked forward, which gathers each key block
 * through the block table as it packs it (a block format's dequantized), so
 * nothing the size of a sequence is copied either; the reference kernel reads
 * a contiguous copy of each sequence (its storage dtype when keys and values
 * share a float dtype, else f32).
 * Results do not depend on the thread count. The decode reads keys in runs
 * of 128, cut where a sequence's blocks stop following one another in the
 * pool; its results are bitwise those of an attn_kv_cache holding the same
 * tokens in the same dtypes when no run is cut short there (block_tokens a
 * multiple of 128, or blocks taken in a run, and no window), and otherwise
 * differ from them by float rounding only (about 1e-7 relative). A prefill's
 * results are bitwise an attn_kv_cache's. */
ATTN_API attn_status attn_paged_kv_attend(attn_ctx *ctx, attn_paged_kv_cache *cache, attn_tensor *out, attn_tensor *lse,
                                          const attn_tensor *q, int64_t nseq, const int64_t *seqs,
                                          const attn_sdpa_opts *opts);

/* ---- the multi-head attention layer ----------------------------------------- */
typedef struct attn_mha attn_mha;
typedef struct attn_safetensors attn_safetensors; /* an open safetensors file: see the files section */

typedef struct attn_mha_config {
  size_t size;          /* sizeof(attn_mha_config), set by attn_mha_config_init */
  int64_t embed_dim;    /* E */
  int64_t num_heads;    /* H; unless head_dim is set, E must divide by H and D = E / H */
  int64_t num_kv_heads; /* Hk for grouped-query attention; 0 = H */
  int64_t kdim;         /* features of the key input; 0 = E */
  int64_t vdim;         /* features of the value input; 0 = E */
  int bias;             /* nonzero: the q, k and v projections have a bias (and o, unless out_bias says not) */
  /* Fields below were added in 0.3; a caller built against an older
   * attn_mha_config (smaller size) gets their defaults. */
  int64_t head_dim;     /* D; 0 = E / H. Otherwise the heads span H*D features, which may differ
                           from E (Qwen3, Gemma, T5's d_kv): Q_WEIGHT [H*D, E], O_WEIGHT [E, H*D] */
  int out_bias;         /* -1 (attn_mha_config_init): as bias; 0 or 1: whether o has one (Qwen2: q, k, v only) */
  /* QK-norm: q and k normed after their projection and before RoPE, as
   * attn_head_norm defines it, with learned weights (parameters Q_NORM_*,
   * K_NORM_*). */
  int qk_norm;                 /* ATTN_QK_NORM_NONE, _PER_HEAD, _WHOLE or _EACH_HEAD */
  attn_norm_kind qk_norm_kind; /* RMS (Qwen3, OLMo 2), RMS_PLUS_ONE (Gemma 3) or LAYER (with biases) */
  double qk_norm_eps;          /* > 0; attn_mha_config_init sets 1e-6 */
  /* Added in 0.3. Learned attention sinks (gpt-oss): parameter SINKS [H], one
   * logit per query head that joins every row's softmax with no value, as
   * attn_sdpa_opts.sinks defines it. Every forward, the cached step included,
   * passes them to the attention (opts.attn.sinks must then be NULL); the
   * backward writes their gradient into grads' SINKS. */
  int sinks;                   /* 0 (attn_mha_config_init) or 1 */
  /* Added in 0.3. OLMo's clip_qkv: q, k and v each clamped to [-clip_qkv,
   * clip_qkv] after their projections (and QK-norm), before RoPE; NaN stays
   * NaN. The backward passes a value's gradient where its unclamped value lay
   * within the bounds, ends included (as torch.clamp). 0 = none. */
  double clip_qkv;             /* 0 (attn_mha_config_init) or finite and > 0 */
} attn_mha_config;

/* Where QK-norm's statistics are taken. */
enum {
  ATTN_QK_NORM_NONE = 0,
  ATTN_QK_NORM_PER_HEAD = 1, /* over each head's D features; weights [D] shared by the heads (Qwen3, Gemma 3) */
  ATTN_QK_NORM_WHOLE = 2,    /* over the whole projection: q over H*D, k over Hk*D; weights [H*D], [Hk*D] (OLMo 2) */
  ATTN_QK_NORM_EACH_HEAD = 3 /* over each head's D features; weights [H, D] and [Hk, D], each head its own
                                (Cohere's use_qk_norm); added in 0.3 */
};

/* Parameters, in PyTorch Linear layout (y = x W^T + b):
 *   Q_WEIGHT [H*D, E]     Q_BIAS [H*D]
 *   K_WEIGHT [Hk*D, kdim] K_BIAS [Hk*D]
 *   V_WEIGHT [Hk*D, vdim] V_BIAS [Hk*D]
 *   O_WEIGHT [E, H*D]     O_BIAS [E]
 * and with QK-norm, per head: Q_NORM_WEIGHT, K_NORM_WEIGHT [D] (and with
 * LAYER, Q_NORM_BIAS, K_NORM_BIAS [D]); over the whole projection: [H*D]
 * for q's, [Hk*D] for k's; with sinks, SINKS [H]. H*D = E unless head_dim
 * says otherwise. */
typedef enum attn_mha_param {
  ATTN_MHA_Q_WEIGHT = 0, ATTN_MHA_Q_BIAS, ATTN_MHA_K_WEIGHT, ATTN_MHA_K_BIAS,
  ATTN_MHA_V_WEIGHT, ATTN_MHA_V_BIAS, ATTN_MHA_O_WEIGHT, ATTN_MHA_O_BIAS,
  ATTN_MHA_Q_NORM_WEIGHT, ATTN_MHA_Q_NORM_BIAS, ATTN_MHA_K_NORM_WEIGHT, ATTN_MHA_K_NORM_BIAS,
  ATTN_MHA_SINKS, /* added in 0.3 (and with it a longer attn_mha_names) */
  ATTN_MHA_NUM_PARAMS
} attn_mha_param;

ATTN_API void attn_mha_config_init(attn_mha_config *cfg, int64_t embed_dim, int64_t num_heads);

/* The layer's projections on their own (PyTorch Linear): out [M, N] = x [M, K]
 * . weight [N, K]^T + bias [N] (bias may be NULL), all rank 2 (bias rank 1),
 * any strides (a view whose rows are not unit-stride is gathered first; out
 * must not overlap the inputs). x and weight are f32, f16 or bf16, bias any
 * float dtype (taken as f32, f64 rounded, and added in fp32), out f32.
 * Bitwise the same for any thread count.
 * The products, by the context's precision (attn_precision's rules):
 *   bf16 products summed in fp32 (vdpbf16ps; bf16 subnormals count as zero),
 *     on the context's bf16 GEMM (ATTN_KERNEL_AVX512_BF16 and ATTN_KERNEL_AMX have one):
 *       DEFAULT  when x and weight are both bf16;
 *       BF16     when each of x and weight is f32 or bf16 (f32 rounded to
 *                bf16, nearest even), as PyTorch's "medium" matmul precision;
 *   f16 products (exact in fp32) summed in fp32, on the fp32 GEMM:
 *       F16      when neither is bf16 (f32 rounded to f16, nearest even), as
 *                PyTorch's Linear in f16; otherwise as DEFAULT;
 *   otherwise fp32: the context's fp32 GEMM kernel (the portable one under
 *     ATTN_KERNEL_REF) on halves widened to f32 (exactly): always under FP32,
 *     for any f16 operand, for f32 mixed with bf16 under DEFAULT, and on
 *     kernels without a bf16 GEMM. A build with -DATTN_WITH_CBLAS=ON hands the
 *     fp32 AVX2/AVX-512 cases to its BLAS (not those of F16: it cannot round). */
ATTN_API attn_status attn_linear(attn_ctx *ctx, attn_tensor *out, const attn_tensor *x, const attn_tensor *weight,
                                 const attn_tensor *bias);
/* Projection parameters and sinks start zeroed; QK-norm weights start as the
 * identity (1, or 0 for RMS_PLUS_ONE) and its biases at 0, as PyTorch
 * initialises them. */
ATTN_API attn_status attn_mha_create(attn_ctx *ctx, attn_mha **out, const attn_mha_config *cfg);
ATTN_API void attn_mha_destroy(attn_mha *mha);
ATTN_API const attn_mha_config *attn_mha_get_config(const attn_mha *mha);
/* A writable contiguous f32 view of one parameter (NOT_FOUND for a bias the
 * layer lacks, by bias and out_bias, for QK-norm's parameters without
 * qk_norm, or its biases with a kind other than LAYER, and for SINKS without
 * sinks). attn_mha_get_config
 * gives the config resolved: head_dim = D, out_bias 0 or 1. */
ATTN_API attn_status attn_mha_param_view(attn_ctx *ctx, attn_tensor *out, attn_mha *mha, attn_mha_param which);
/* Sets a parameter by name, converting any float dtype and checking the shape.
 * Names of the seed module: wq.weight wq.bias wk.* wv.* dense.*;
 * of nn.MultiheadAttention: in_proj_weight [E+2*Hk*D, E] (q, k, v rows in turn),
 * in_proj_bias, q_proj_weight, k_proj_weight, v_proj_weight, out_proj.weight, out_proj.bias;
 * of Llama-style models: q_proj.weight, k_proj.weight, v_proj.weight, o_proj.weight (and .bias),
 *   q_norm.weight, k_norm.weight (and .bias: a LAYER norm's);
 * of BERT: self.query/key/value.{weight,bias}, output.dense.*; of ViT: attention.query/key/value.*;
 * of DistilBERT: q_lin, k_lin, v_lin, out_lin; of T5: q.weight, k.weight, v.weight, o.weight;
 * of GPT-2 (Conv1D, [in, out]): c_attn.weight [E, H*D + 2*Hk*D] (q, k, v columns in turn),
 *   c_attn.bias, c_proj.weight [H*D, E], c_proj.bias. A name several families
 *   use means the same parameter in each. */
ATTN_API attn_status attn_mha_set_param(attn_ctx *ctx, attn_mha *mha, const char *name, const attn_tensor *value);
/* Loads every parameter from a safetensors file, whatever its naming (detected),
 * each name preceded by prefix (e.g. "layers.0.attn."; NULL or "" for none).
 * All required parameters must be present with exactly the layer's shapes,
 * which are checked before any is written; unrelated tensors are ignored. */
ATTN_API attn_status attn_mha_load_safetensors(attn_ctx *ctx, attn_mha *mha, const char *path, const char *prefix);

/* Creates a layer whose sizes (E, head_dim, kdim, vdim, biases, RMS QK-norm)
 * are read from the parameters in a safetensors file, then loads them:
 * attn_mha_create_from_tensors with the detected naming. num_kv_heads 0 = num_heads.
 * Every parameter's shape is checked against the others and the head counts
 * before anything is allocated (ATTN_E_SHAPE otherwise; a kdim or vdim of 0
 * is refused), so the layer holds no more elements than the file's tensors. */
ATTN_API attn_status attn_mha_create_from_safetensors(attn_ctx *ctx, attn_mha **out, const char *path,
                                                      const char *prefix, int64_t num_heads, int64_t num_kv_heads);

/* The same two on a file already open: st is only read (tensors are read into
 * temporaries, converted into the layer and freed; st's cache of
 * attn_safetensors_get is not filled) and stays the caller's to close. */
ATTN_API attn_status attn_mha_load_safetensors_handle(attn_ctx *ctx, attn_mha *mha, const attn_safetensors *st,
                                                      const char *prefix);
ATTN_API attn_status attn_mha_create_from_safetensors_handle(attn_ctx *ctx, attn_mha **out,
                                                             const attn_safetensors *st, const char *prefix,
                                                             int64_t num_heads, int64_t num_kv_heads);

/* The parameter namings the loaders recognise, each known by a tell-tale
 * tensor (in brackets), looked for in the order of the enum: the first
 * naming whose q and o weights are both there, else the first whose q weight
 * is. Under each
 * family's own layer prefix (e.g. "model.layers.3.self_attn.",
 * "encoder.layer.3.attention.", "h.3.attn.", "transformer.layer.3.attention.",
 * "encoder.block.3.layer.0.SelfAttention."). A bias the file lacks is
 * absent from the layer (out_bias 0 when only o's is missing). */
typedef enum attn_mha_naming {
  ATTN_MHA_NAMING_NONE = 0,
  ATTN_MHA_NAMING_SEED = 1,           /* [wq.weight] wq/wk/wv/dense.{weight,bias} */
  ATTN_MHA_NAMING_TORCH_PACKED = 2,   /* [in_proj_weight] nn.MultiheadAttention, kdim = vdim = E (and sinks) */
  ATTN_MHA_NAMING_TORCH_SEPARATE = 3, /* [q_proj_weight] nn.MultiheadAttention with kdim/vdim != E (and sinks) */
  ATTN_MHA_NAMING_LLAMA = 4,          /* [q_proj.weight] q/k/v/o_proj.{weight,bias}, q_norm/k_norm.weight,
                                         sinks (Llama, Mistral, Qwen2/3, Gemma 1-3, OLMo 2, Phi-3 split,
                                         gpt-oss) */
  ATTN_MHA_NAMING_BERT = 5,           /* [self.query.weight] self.query/key/value, output.dense (BERT, RoBERTa) */
  ATTN_MHA_NAMING_VIT = 6,            /* [attention.query.weight] attention.query/key/value, output.dense (ViT) */
  ATTN_MHA_NAMING_DISTILBERT = 7,     /* [q_lin.weight] q_lin/k_lin/v_lin/out_lin */
  ATTN_MHA_NAMING_GPT2 = 8,           /* [c_attn.weight] fused q,k,v [E, 3E] and c_proj [E, E], both in
                                         Conv1D layout ([in, out]: transposed relative to Linear) */
  ATTN_MHA_NAMING_T5 = 9,             /* [q.weight] q/k/v/o, no biases */
  ATTN_MHA_NAMING_CUSTOM = 10,        /* a caller's attn_mha_names */
  ATTN_MHA_NAMING_PHI3 = 11,          /* [qkv_proj.weight] q, k, v rows packed, o_proj.weight (Phi-3, Phi-4-mini);
                                         added in 0.3 */
  ATTN_MHA_NAMING_PHI = 12            /* [q_proj.weight and dense.weight] q/k/v_proj and dense.{weight,bias},
                                         q_layernorm/k_layernorm.{weight,bias} (Phi-1, 1.5, 2); added in 0.3 */
} attn_mha_naming;

/* A caller's naming, for checkpoints of other families: the tensor name of
 * each parameter under the prefix. Parameters given the same name are packed
 * rows of one tensor, in q, k, v order (as in_proj_weight and c_attn). NULL:
 * absent (a bias, a QK-norm parameter or the sinks; every weight is
 * required). A caller built against 0.2's attn.h (no SINKS entry: a smaller
 * size) is read as it was written. */
typedef struct attn_mha_names {
  size_t size;                            /* sizeof(attn_mha_names) */
  const char *name[ATTN_MHA_NUM_PARAMS];
  int conv1d;                             /* 1: weights stored [in, out] (GPT-2's Conv1D), else [out, in] */
} attn_mha_names;

/* The general loader: creates a layer from the tensors under prefix in st,
 * named by names (NULL: the detected naming). like (attn_mha_config_init'd,
 * not NULL) gives what a file cannot tell: num_heads (required), num_kv_heads
 * (0: num_heads), head_dim (0: from the q weight's rows / H), qk_norm_kind,
 * qk_norm_eps and clip_qkv; its other fields are ignored. Everything else is read from the
 * tensors' shapes, checked against each other before anything is allocated:
 * E = o's rows, H*D = q's rows, Hk*D = k's, kdim and vdim = k's and v's
 * columns (Linear layout; [in, out] transposed with conv1d), bias = the q, k
 * and v biases (all three or none: some without the others is
 * ATTN_E_UNSUPPORTED naming the missing one), out_bias = o's, QK-norm (both
 * weights or neither) per head when they are [D], whole when [H*D] and
 * [Hk*D], each head its own when [H, D] and [Hk, D] (Cohere); a norm bias
 * needs qk_norm_kind LAYER (ATTN_E_INVALID naming it);
 * sinks when the naming's SINKS tensor is there ([H]). */
ATTN_API attn_status attn_mha_create_from_tensors(attn_ctx *ctx, attn_mha **out, const attn_safetensors *st,
                                                  const char *prefix, const attn_mha_names *names,
                                                  const attn_mha_config *like);
/* Loads into an existing layer the tensors under prefix in st, named by names
 * (NULL: the detected naming): every parameter the layer holds must be there
 * with exactly its shape (Linear layout [out, in], or [in, out] with
 * names->conv1d; a packed tensor [the members' rows stacked, in]), and none it
 * lacks; all are checked before any is written. A LAYER QK-norm's biases may be
 * absent (then zero). */
ATTN_API attn_status attn_mha_load_tensors(attn_ctx *ctx, attn_mha *mha, const attn_safetensors *st,
                                           const char *prefix, const attn_mha_names *names);
/* The naming of the layer under prefix in st, the one the loaders above use
 * (reads no tensor data); ATTN_E_NOT_FOUND, with *naming NONE, when st holds
 * none. */
ATTN_API attn_status attn_mha_detect_naming(attn_ctx *ctx, attn_mha_naming *naming, const attn_safetensors *st,
                                            const char *prefix);
/* The tensor name (without prefix; a static string) under which naming keeps
 * parameter which; NULL for ATTN_MHA_NAMING_NONE or a value out of range.
 * in_proj_weight and in_proj_bias are PyTorch's packed tensors: they hold the
 * q, k and v rows in turn ([E + 2*Hk*D, E] and [E + 2*Hk*D]), so the q, k and
 * v parameters share that name (TORCH_SEPARATE packs only the biases). */
ATTN_API const char *attn_mha_param_name(attn_mha_naming naming, attn_mha_param which);


/* Options of the layer: the attention's own, passed to attn_sdpa as they are
 * (with H query heads: a mask broadcastable to [B, H, Nq, Nk], ALiBi slopes
 * and sinks f32 [H]), and the layer's. attn_mha_opts_init sets attn.mask_mode
 * to MASKED (true = masked out, PyTorch MHA's rule); the rest as
 * attn_sdpa_opts_init. Sinks given here are constants (the backward gives no
 * gradient for them); learned ones are the layer's (attn_mha_config.sinks),
 * and a layer holding them refuses these (ATTN_E_INVALID). */
typedef struct attn_mha_opts {
  size_t size;         /* sizeof(attn_mha_opts), set by attn_mha_opts_init (attn.size too) */
  attn_sdpa_opts attn; /* read by its own size: an older attn_sdpa_opts moves the fields after it */
  int average_weights; /* attn_mha_forward's weights averaged over heads (PyTorch average_attn_weights) */
  /* Rotary embeddings of the projected q and k (NULL: none), as attn_rope
   * rotates them: query token n of row b at positions[b][n] (or
   * position_offset + n), key token j at the same positions in
   * self-attention and when Nk = Nq, else at position_offset + j (explicit
   * positions then are refused). transpose must be 0. The backward applies
   * the transposed rotation to dq and dk. The cached step takes its RoPE from
   * the cache (attn_kv_cache_config.rope) and refuses this one. */
  const attn_rope_opts *rope;
} attn_mha_opts;

ATTN_API void attn_mha_opts_init(attn_mha_opts *opts);

/* Layer L of a Hugging Face model, as saved: config.json (attn_hf_config_read)
 * and its weights (one .safetensors file, or the model.safetensors.index.json
 * of a sharded checkpoint, followed to the file holding the layer). The layer
 * is found under its family's prefix; what the config says (heads, kv heads,
 * head_dim, QK-norm's kind and eps) shapes the layer, and the options of
 * layer L (scale, sliding window, softcap, RoPE) are returned in *info for
 * attn_hf_layer_opts. weights_path ending in ".json" is read as an index; its
 * shard names must be plain file names in the index's folder. Prefixes tried,
 * in turn: model.layers.L.self_attn. (and without "model.", and Gemma 3's
 * language_model wrappers), bert./roberta./vit. + encoder.layer.L.attention.
 * (and bare), [distilbert.]transformer.layer.L.attention.,
 * [transformer.]h.L.attn., [encoder.]block.L.layer.0.SelfAttention. (T5's
 * encoder; its relative position bias, config.relative_bias, is the caller's
 * additive mask). A checkpoint whose tensors or config contradict each other
 * (hidden_size, kv heads, attention_bias, a QK-norm model_type without
 * q_norm, gpt_oss without sinks) is refused naming the field; the layer's
 * causality is the caller's.
 * On failure *out is NULL. */
typedef struct attn_hf_layer {
  size_t size;                /* sizeof(attn_hf_layer), set by attn_mha_create_from_hf */
  int64_t layer;
  attn_mha_naming naming;
  char prefix[256];           /* where its tensors were found */
  char weights_file[4096];    /* the file they were read from */
  attn_hf_config config;
  double scale;               /* NAN: 1/sqrt(D) */
  double softcap;             /* 0: none */
  int64_t window;             /* 0: none; else each query sees itself and the window - 1 keys before it */
  int has_rope;
  attn_rope_opts rope;        /* layer L's RoPE when has_rope */
  /* Added in 0.3. */
  int64_t chunk;              /* 0: none; else attn_sdpa_opts.chunk (Llama 4's chunked layers) */
} attn_hf_layer;

ATTN_API attn_status attn_mha_create_from_hf(attn_ctx *ctx, attn_mha **out, attn_hf_layer *info,
                                             const char *config_path, const char *weights_path, int64_t layer);
/* Fills opts (after attn_mha_opts_init) with layer L's scale, window, chunk,
 * softcap and RoPE (opts->rope points into info, which must outlive its use); the
 * mask, causality and positions stay the caller's. */
ATTN_API void attn_hf_layer_opts(const attn_hf_layer *info, attn_mha_opts *opts);

/* out = O(attention(Q(query), K(key), V(value)))
 *   out is [B, Nq, E] f32, query [B, Nq, E], key [B, Nk, kdim], value [B, Nk, vdim]
 *   (batch-first, any strides, f32). key and value NULL: self-attention on query.
 *   weights (or NULL): f32 [B, H, Nq, Nk], or [B, Nq, Nk] with average_weights.
 * With ATTN_KERNEL_REF every step runs in float64 (out, weights may then be f64).
 * A packed batch (opts->attn.cu_seqlens_q, see attn_sdpa_opts): query [1,
 * total_q, E] (key, value [1, total_k, kdim/vdim] with cu_seqlens_k), out
 * [1, total_q, E]; projections are per token, attention per sequence; each
 * sequence's out (and attn_mha_backward's dquery) is bitwise that of the
 * sequence run alone (decode off, as attn_sdpa; in a -DATTN_WITH_CBLAS build,
 * whose BLAS may block the projections by their row count, within rounding). RoPE without positions
 * counts each sequence from its own start (position_offset + n - cu[s]; the
 * call's largest position, DYNAMIC's default L, is the whole call's); that
 * needs self-attention (key, value and cu_seqlens_k NULL: ATTN_E_UNSUPPORTED
 * otherwise). forward_save keeps its own copy of the offsets.
 * Under ATTN_PRECISION_BF16 the projections and the attention take bf16
 * products (see attn_precision); the backward pass stays fp32 (on the
 * activations this forward saved). */
ATTN_API attn_status attn_mha_forward(attn_ctx *ctx, attn_mha *mha, attn_tensor *out, attn_tensor *weights,
                                      const attn_tensor *query, const attn_tensor *key, const attn_tensor *value,
                                      const attn_mha_opts *opts);

/* Incremental self-attention (decoding): x is [B, n, E] f32, the next n tokens
 * of every row; their keys and values are appended to cache (created with
 * batch B, kv_heads Hk and head_dim E / H of this layer), then their queries
 * attend over the whole cache (bottom-right causal) and out [B, n, E] gets
 * the output projection. Token by token this gives what one causal
 * attn_mha_forward over the whole sequence gives. opts->attn is read as by
 * attn_kv_cache_attend (causal is implied; masks, key padding and dropout are
 * refused). kdim = vdim = E. */
ATTN_API attn_status attn_mha_forward_cached(attn_ctx *ctx, attn_mha *mha, attn_kv_cache *cache, attn_tensor *out,
                                             const attn_tensor *x, const attn_mha_opts *opts);

/* Training. attn_mha_forward_save runs attn_mha_forward and keeps what the
 * backward pass needs (the projections, the attention output and its
 * log-sum-exp; O(N) memory, never the Nq x Nk weights), and copies of the
 * options' mask, key padding, ALiBi slopes and sinks: the caller may free
 * those once it returns. A copy keeps the view's own shape (a broadcast mask
 * stays as small as the caller's; a full [B, H, Nq, Nk] one is copied whole).
 * weights (or NULL) as in attn_mha_forward; the saved state never needs them.
 * The saved state owns everything it holds until attn_mha_saved_free, but the
 * backward reads the layer's parameters as they are then: they must be those
 * the forward used. attn_mha_backward then gives the gradients of a loss L
 * from dout = dL/dout [B, Nq, E]:
 *   dquery [B, Nq, E], dkey [B, Nk, kdim], dvalue [B, Nk, vdim] (any may be NULL;
 *   after self-attention dquery gets the whole input gradient and dkey/dvalue
 *   must be NULL), and every parameter's gradient written into the parameters
 *   of `grads`, a layer created with the same configuration (overwritten;
 *   SINKS gets dL/dsinks summed over the batch and the rows). */
typedef struct attn_mha_saved attn_mha_saved;
ATTN_API attn_status attn_mha_forward_save(attn_ctx *ctx, attn_mha *mha, attn_tensor *out, attn_tensor *weights,
                                           attn_mha_saved **saved, const attn_tensor *query, const attn_tensor *key,
                                           const attn_tensor *value, const attn_mha_opts *opts);
ATTN_API void attn_mha_saved_free(attn_mha_saved *saved);
ATTN_API attn_status attn_mha_backward(attn_ctx *ctx, attn_mha *mha, attn_tensor *dquery, attn_tensor *dkey,
                                       attn_tensor *dvalue, attn_mha *grads, const attn_mha_saved *saved,
                                       const attn_tensor *dout);

/* ---- files ------------------------------------------------------------------- */
/* .npy (format 1.0-3.0): f32, f64, bool, u8 (and f16); the reader also takes
 * int32 and int64 arrays (positions, token ids), read as f64, exactly (a value
 * past 2^53 is refused). Files in either byte order and in C or Fortran order
 * (np.save of a transposed array, Julia's and MATLAB's writers) are read into a
 * C-order tensor in this CPU's byte order; a Fortran-order file passes through a
 * second buffer of its size. The writer writes C order, little-endian.
 * Reading allocates: free with attn_tensor_free. Both readers refuse
 * (ATTN_E_FORMAT) a shape whose strides could not be represented, even one
 * with no element. Writing follows a symbolic link at path (the file it points
 * to is replaced, the link stays), gathers any strides and replaces path atomically
 * (a temporary file, then rename). */
ATTN_API attn_status attn_npy_read(attn_ctx *ctx, attn_tensor *out, const char *path);
/* Elements [start, start + count) of dimension dim only (a shard of a
 * sequence: attn_mpi.h), each contiguous run of the file read by offset; the
 * rest is not read. The file is checked as attn_npy_read checks it. */
ATTN_API attn_status attn_npy_read_slice(attn_ctx *ctx, attn_tensor *out, const char *path, int dim, int64_t start,
                                         int64_t count);
/* The array's dtype, rank and shape from its header (out->data NULL, nothing to free). */
ATTN_API attn_status attn_npy_info(attn_ctx *ctx, attn_tensor *out, const char *path);
ATTN_API attn_status attn_npy_write(attn_ctx *ctx, const char *path, const attn_tensor *t);

/* safetensors: a file of named tensors (F32, F64, F16, BF16, BOOL, U8).
 * Opening reads and checks the header only and keeps the file open until
 * close; a tensor's bytes are read when it is first asked for, so a handle on
 * a large checkpoint costs the tensors used, not the file. The file must not
 * change while open: a tensor cut off by a later truncation is ATTN_E_FORMAT.
 * Calls on one handle must not overlap (get fills the handle's cache). */
ATTN_API attn_status attn_safetensors_open(attn_ctx *ctx, attn_safetensors **out, const char *path);
ATTN_API void attn_safetensors_close(attn_safetensors *st);
ATTN_API int64_t attn_safetensors_count(const attn_safetensors *st);
/* The name of tensor index (file order), owned by st; NULL out of range. */
ATTN_API const char *attn_safetensors_name(const attn_safetensors *st, int64_t index);
/* A read-only view of the tensor's data (64-byte aligned, host byte order),
 * read from the file on the first call for that name and owned by st: valid
 * until close (NOT_FOUND if absent, DTYPE for a dtype libattn lacks). */
ATTN_API attn_status attn_safetensors_get(attn_ctx *ctx, attn_tensor *out, const attn_safetensors *st,
                                          const char *name);
/* Writes count tensors (any strides, gathered) under their names, atomically. */
ATTN_API attn_status attn_safetensors_write(attn_ctx *ctx, const char *path, int64_t count, const char *const *names,
                                            const attn_tensor *tensors);

#ifdef __cplusplus
}
#endif
#endif /* ATTN_H */
