// What one 256-entry table lookup for 16 lanes costs on this CPU, the unit adam8bit's codec is
// built from (docs/BENCHMARKS.md, "adam8bit in vectors"): an AVX-512 gather, the same lookup as
// the kernels make it (loom::optim::RegisterTable, Note [Lookups in registers]), and a
// branch-free binary search over 256 thresholds with such lookups (a gather-free quantizer).
// Each over 2^20 random bytes / floats, 20 passes, three rounds; nanoseconds per 16 lanes.
// Built as build/bin/loom_lookup_cost (examples/CMakeLists.txt); run it without arguments.
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "../../../plugins/optim/quantize.h"  // RegisterTable: the kernels' lookup

namespace {

alignas(64) float codes[256];
alignas(64) float thresholds[256];

}  // namespace

int main() {
  for (int i = 0; i < 256; ++i) {
    codes[i] = std::sin(0.1f * static_cast<float>(i));
    thresholds[i] = -1.0f + 2.0f * static_cast<float>(i) / 256.0f;
  }
  thresholds[255] = INFINITY;
  const int n = 1 << 20, passes = 20;
  std::vector<uint8_t> bytes(n);
  std::vector<float> values(n), out(n);
  for (int i = 0; i < n; ++i) {
    bytes[i] = static_cast<uint8_t>((static_cast<uint32_t>(i) * 2654435761u) >> 24);
    values[i] = std::sin(0.37f * static_cast<float>(i));
  }
  const loom::optim::RegisterTable code_regs(codes), threshold_regs(thresholds);
  using Clock = std::chrono::steady_clock;
  auto per16 = [&](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::nano>(b - a).count() / (passes * (n / 16.0));
  };
  for (int round = 0; round < 3; ++round) {
    const auto t0 = Clock::now();
    for (int p = 0; p < passes; ++p)
      for (int i = 0; i < n; i += 16) {
        const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(&bytes[i])));
        _mm512_storeu_ps(&out[i], _mm512_i32gather_ps(index, codes, 4));
      }
    const auto t1 = Clock::now();
    for (int p = 0; p < passes; ++p)
      for (int i = 0; i < n; i += 16) {
        const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(&bytes[i])));
        _mm512_storeu_ps(&out[i], code_regs.lookup(index));
      }
    const auto t2 = Clock::now();
    for (int p = 0; p < passes; ++p)
      for (int i = 0; i < n; i += 16) {
        const __m512 y = _mm512_loadu_ps(&values[i]);
        __m512i q = _mm512_setzero_si512();
        for (int step = 128; step >= 1; step >>= 1) {
          const __m512 t = threshold_regs.lookup(_mm512_add_epi32(q, _mm512_set1_epi32(step - 1)));
          q = _mm512_mask_add_epi32(q, _mm512_cmp_ps_mask(t, y, _CMP_LT_OQ), q, _mm512_set1_epi32(step));
        }
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&out[i]), _mm512_cvtepi32_epi8(q));
      }
    const auto t3 = Clock::now();
    std::printf("gather %.2f ns, permute lookup %.2f ns, binary search by permutes %.2f ns (per 16 lanes)\n",
                per16(t0, t1), per16(t1, t2), per16(t2, t3));
  }
}
