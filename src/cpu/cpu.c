#define _DEFAULT_SOURCE /* syscall(), for arch_prctl */
/* Which SIMD instruction sets this CPU and OS support, asked anew on every
 * call. CPUID is not cheap: it serializes the pipeline and, in many virtual
 * machines, traps to the hypervisor (microseconds each). So a context asks
 * once, in attn_ctx_create, and keeps the answer; nothing is cached here, as
 * that would be global mutable state. */
#include "../internal.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

static uint64_t xgetbv0(void) {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((uint64_t)hi << 32) | lo;
}

/* Linux hands out the tile data state (8 KiB per thread's context) only to
 * a process that asks for it; the grant is for the whole process and for
 * good, so asking again is harmless. A refusal (an older kernel, a seccomp
 * filter) means no AMX: a tile instruction without it would be a SIGILL. */
static int amx_permitted(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
  enum { ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
  unsigned long bits = 0;
  if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) == 0 && ((bits >> XFEATURE_XTILEDATA) & 1)) return 1;
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
  return syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) == 0 && ((bits >> XFEATURE_XTILEDATA) & 1);
#else
  return 0;
#endif
}

int attn__cpu_has(attn_kernel isa) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
  if (!osxsave || !avx) return 0;
  const uint64_t xcr0 = xgetbv0();
  const int ymm_os = (xcr0 & 0x6) == 0x6, zmm_os = (xcr0 & 0xe6) == 0xe6;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
  const int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1, avx512bw = (b >> 30) & 1,
            avx512vl = (b >> 31) & 1;
  const int avx512 = zmm_os && avx512f && avx512dq && avx512bw && avx512vl;
  switch (isa) {
    case ATTN_KERNEL_AVX2: return ymm_os && avx2 && fma && f16c;
    case ATTN_KERNEL_AVX512: return avx512;
    case ATTN_KERNEL_AVX512_BF16: /* CPUID.(7,1):EAX bit 5 */
      return avx512 && __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);
    case ATTN_KERNEL_AMX: { /* AMX-TILE and AMX-BF16 (CPUID.(7,0):EDX bits 24, 22), the OS's XTILECFG and XTILEDATA */
#ifndef ATTN_HAVE_AMX
      return 0; /* not built: the compiler lacked AMX */
#endif
      const int amx = ((d >> 24) & 1) && ((d >> 22) & 1) && (xcr0 & 0x60000) == 0x60000;
      return amx && attn__cpu_has(ATTN_KERNEL_AVX512_BF16) && amx_permitted();
    }
    default: return 1;
  }
}

/* Measured faster with the read-ahead into L2: Intel Xeons (models 167 and 207: f16 steps 1.1x) and AMD Zen 4
 * (family 25: f32 steps 1.3x, 2026-12-06); Zen 4's own build (decode_l2_blocks8.c) also widens a KV cache's key
 * blocks whole for 5-8 query rows (q8_0 steps of 5-8 rows 4-6% faster, q4_0 8-22%, 2026-12-06) and reads f32 rows
 * ahead into L1 too (one thread's f32 step 0.89x, 2026-12-07). Zen 5 (family 26) keeps the tuning it was
 * measured with (L1, blocks for 1-4 rows), and so does Intel, where Zen 4's additions were not measured. */
unsigned attn__cpu_decode_tuning(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
  if (b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e) return ATTN__CPU_READ_AHEAD_L2; /* "GenuineIntel" */
  if (b != 0x68747541 || d != 0x69746e65 || c != 0x444d4163) return 0;                      /* "AuthenticAMD" */
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  const unsigned base = (a >> 8) & 0xf, family = base + (base == 0xf ? (a >> 20) & 0xff : 0);
  return family < 26 ? ATTN__CPU_READ_AHEAD_L2 | ATTN__CPU_QK_BLOCK_ROWS_8 : 0;
}
#else
int attn__cpu_has(attn_kernel isa) { return isa == ATTN_KERNEL_C || isa == ATTN_KERNEL_REF; }
unsigned attn__cpu_decode_tuning(void) { return 0; }
#endif
