/* Which SIMD instruction sets this CPU and OS support, asked anew on every
 * call. CPUID is not cheap: it serializes the pipeline and, in many virtual
 * machines, traps to the hypervisor (microseconds each). So a context asks
 * once, in attn_ctx_create, and keeps the answer; nothing is cached here, as
 * that would be global mutable state. */
#include "../internal.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>

static uint64_t xgetbv0(void) {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((uint64_t)hi << 32) | lo;
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
    default: return 1;
  }
}
#else
int attn__cpu_has(attn_kernel isa) { return isa == ATTN_KERNEL_C || isa == ATTN_KERNEL_REF; }
#endif
