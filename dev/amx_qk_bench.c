/* What one q.k block costs on the AMX tiles, piece by piece: a 16-row tile of
 * queries against 64 keys at D = 128 (attention_amx.c's qk_t with one term: four
 * steps of 32 values of D, four 16-key C tiles), every operand in L1, timed in
 * this thread's CPU time, the variants in turn over 15 rounds (best of each), as
 * this host's matrix unit changes speed from minute to minute:
 *   the 16 tdpbf16ps alone, then with the 16 B tile loads (K), the 4 A tile loads
 *   (q), the 4 C tile stores (S), then an AVX-512 read of S after the stores, and
 *   last that read alone, without tiles.
 * It says whether the loads hide behind the products (they did on the model-207
 * Xeon of BENCHMARKS.md: 108-113 ns for the products, the same with every load),
 * what the stores add (22-25 ns for four) and what the first vector work after
 * tile work waits (the read took 100-113 ns after the tiles, 50 alone).
 *   gcc -O2 -mamx-tile -mamx-bf16 -mavx512f dev/amx_qk_bench.c -o /tmp/amxqk && /tmp/amxqk
 * Linux only (the tile state is asked for with arch_prctl); exits 2 without AMX. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

typedef struct {
  uint8_t palette, start;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((packed)) tile_config;

enum { D2 = 64, CALLS = 50000, ROUNDS = 15, VARIANTS = 6 };
static uint16_t Q[16 * 2 * D2] __attribute__((aligned(64))), K[64 * 2 * D2] __attribute__((aligned(64)));
static float S[16 * 64] __attribute__((aligned(64)));

/* The largest value of S, read with four chains of vector maxima. */
static float read_s(void) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int r = 0; r < 16; r++)
    for (int v = 0; v < 4; v++) a[v] = _mm512_max_ps(a[v], _mm512_load_ps(S + r * 64 + 16 * v));
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a[0], a[1]), _mm512_max_ps(a[2], a[3])));
}

/* One block as the variant asks: 0 products only, 1 + B loads, 2 + A loads, 3 + C stores, 4 + reading S;
 * 5 the read alone. */
static float block(int variant) {
  if (variant == 5) return read_s();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int t0 = 0; t0 < D2; t0 += 16) {
    const uint16_t *kb = K + 2 * t0 * 64;
    if (variant >= 2) _tile_loadd(4, Q + 2 * t0, D2 * 4);
    if (variant >= 1) {
      _tile_loadd(5, kb, 256);
      _tile_loadd(6, kb + 32, 256);
    }
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    if (variant >= 1) {
      _tile_loadd(5, kb + 64, 256);
      _tile_loadd(6, kb + 96, 256);
    }
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 6);
  }
  if (variant < 3) return 0;
  _tile_stored(0, S, 256);
  _tile_stored(1, S + 16, 256);
  _tile_stored(2, S + 32, 256);
  _tile_stored(3, S + 48, 256);
  return variant < 4 ? 0 : read_s();
}

int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    fprintf(stderr, "amx_qk_bench: no AMX tile state for this process\n");
    return 2;
  }
  tile_config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
  _tile_loadconfig(&c);
  for (int i = 0; i < 16 * 2 * D2; i++) Q[i] = 0x3f80; /* bf16 1.0 */
  for (int i = 0; i < 64 * 2 * D2; i++) K[i] = 0x3f80;
  double best[VARIANTS];
  float sink = 0;
  for (int v = 0; v < VARIANTS; v++) best[v] = 1e30;
  for (int round = 0; round < ROUNDS; round++)
    for (int v = 0; v < VARIANTS; v++) {
      const double t = now();
      for (int i = 0; i < CALLS; i++) sink += block(v);
      const double per = (now() - t) / CALLS;
      if (per < best[v]) best[v] = per;
    }
  _tile_release();
  static const char *const names[VARIANTS] = {"16 tdpbf16ps alone", "+ 16 B tile loads (K)", "+ 4 A tile loads (q)",
                                              "+ 4 C tile stores (S)", "+ AVX-512 read of S",
                                              "the read alone, no tiles"};
  for (int v = 0; v < VARIANTS; v++) printf("%-24s %6.1f ns a block\n", names[v], best[v] * 1e9);
  return sink == 1.5f; /* keeps the reads */
}
