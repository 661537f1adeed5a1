// What adam8bit's AVX2 kernel spends per 8 elements, part by part, in L1 (no memory traffic):
// its two codecs (Note [Dequantize by arithmetic] and Note [Quantize by arithmetic] in
// plugins/optim/quantize.h, each against the gather it replaced), and AdamW's division chain
// (sqrt and two divisions, torch's order) against one with a single division. Every part
// runs on 2048 values (8 KB per stream) 20,000 times; the best of five rounds, nanoseconds
// per 8 lanes of both moments. The parts' sum against torch's fused AdamW step per element
// (`loom_bench_optim compare`) is the floor argument of docs/BENCHMARKS.md ("adam8bit's floor
// on AVX2"). Built as build/bin/loom_codec_cost on x86-64; every CPU kind here has AVX2.
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>

#include "../../../plugins/optim/quantize.h"

namespace {

using loom::optim::QuantMap;
using Clock = std::chrono::steady_clock;

constexpr int kValues = 2048;
alignas(32) float g_m[kValues], g_v[kValues], g_out[kValues];
alignas(32) uint8_t g_qm[kValues], g_qv[kValues];

template <typename Body>
double ns_per_8(Body body) {
  double best = 1e30;
  for (int round = 0; round < 5; ++round) {
    const auto start = Clock::now();
    for (int pass = 0; pass < 20000; ++pass) {
      body();
      // Every pass's stores happen and its loads are made again: no pass is folded away.
      asm volatile("" : : : "memory");
    }
    const double ns = std::chrono::duration<double, std::nano>(Clock::now() - start).count();
    best = std::min(best, ns / (20000.0 * kValues / 8));
  }
  return best;
}

__m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }

void store_codes(uint8_t* out, __m256i qm, __m256i qv) {
  const __m256i words = _mm256_packus_epi32(qm, qv);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out),
                   _mm256_castsi256_si128(_mm256_packus_epi16(words, words)));
}

}  // namespace

int main() {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (int i = 0; i < kValues; ++i) {
    g_m[i] = std::tanh(normal(rng)) * 0.9f;  // scaled moments in [-1, 1] and [0, 1]
    g_v[i] = g_m[i] * g_m[i];
    g_qm[i] = static_cast<uint8_t>(rng());
    g_qv[i] = static_cast<uint8_t>(rng());
  }
  const QuantMap& sm = loom::optim::signed_map();
  const QuantMap& um = loom::optim::unsigned_map();
  const double dequant_arith = ns_per_8([&] {
    const QuantMap::Dequantizer8<true> code_m(sm);
    const QuantMap::Dequantizer8<false> code_v(um);
    for (int i = 0; i < kValues; i += 8)
      _mm256_store_ps(g_out + i, _mm256_add_ps(code_m(_mm256_cvtepu8_epi32(load8(g_qm + i))),
                                               code_v(_mm256_cvtepu8_epi32(load8(g_qv + i)))));
  });
  const double dequant_gather = ns_per_8([&] {
    for (int i = 0; i < kValues; i += 8)
      _mm256_store_ps(
          g_out + i,
          _mm256_add_ps(_mm256_i32gather_ps(sm.code.data(), _mm256_cvtepu8_epi32(load8(g_qm + i)), 4),
                        _mm256_i32gather_ps(um.code.data(), _mm256_cvtepu8_epi32(load8(g_qv + i)), 4)));
  });
  int unsure = 0;
  const double quant_arith = ns_per_8([&] {
    const QuantMap::Quantizer8<true> quantize_m(sm);
    const QuantMap::Quantizer8<false> quantize_v(um);
    for (int i = 0; i < kValues; i += 8) {
      int a, b;
      const __m256i qm = quantize_m(_mm256_load_ps(g_m + i), a);
      const __m256i qv = quantize_v(_mm256_load_ps(g_v + i), b);
      unsure |= a | b;
      store_codes(g_qm + i, qm, qv);
    }
  });
  const double quant_gather = ns_per_8([&] {
    for (int i = 0; i < kValues; i += 8)
      store_codes(g_qm + i, sm.quantize8(_mm256_load_ps(g_m + i)), um.quantize8(_mm256_load_ps(g_v + i)));
  });
  const __m256 bc2 = _mm256_set1_ps(0.3f), eps = _mm256_set1_ps(1e-8f);
  const double two_divisions = ns_per_8([&] {
    for (int i = 0; i < kValues; i += 8) {
      const __m256 v = _mm256_load_ps(g_v + i);
      _mm256_store_ps(g_out + i, _mm256_div_ps(_mm256_load_ps(g_m + i),
                                               _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps)));
    }
  });
  const double one_division = ns_per_8([&] {
    for (int i = 0; i < kValues; i += 8) {
      const __m256 v = _mm256_load_ps(g_v + i);
      _mm256_store_ps(g_out + i,
                      _mm256_div_ps(_mm256_load_ps(g_m + i), _mm256_add_ps(_mm256_sqrt_ps(v), eps)));
    }
  });
  std::printf("ns per 8 elements (both moments), in L1, best of 5:\n");
  std::printf("  dequantize: arithmetic %.2f, gather %.2f\n", dequant_arith, dequant_gather);
  std::printf("  quantize:   arithmetic %.2f, one-step table (gather) %.2f%s\n", quant_arith,
              quant_gather, unsure ? "" : " (no lane unsure)");
  std::printf("  AdamW's division chain: sqrt + 2 divisions %.2f, sqrt + 1 division %.2f\n",
              two_divisions, one_division);
  std::printf("  codec + chain (the kernel's least work beside its loads and stores): %.2f ns = "
              "%.3f ns per element\n", dequant_arith + quant_arith + two_divisions,
              (dequant_arith + quant_arith + two_divisions) / 8);
}
