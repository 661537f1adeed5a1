// plugins/precision/cpu_support.h — does this CPU compute in bf16 / fp16 natively? Header-only
// so the tests can feed it a made-up capability map; not a CPU detector (LibTorch's cpuinfo is).
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/ScalarType.h>

#include <string>
#include <unordered_map>

namespace loom::precision {

// Empty when `caps` (at::cpu::get_cpu_capabilities()) lists an instruction set that computes
// `dtype` natively; otherwise why not. Without one LibTorch still runs the dtype, converting
// to fp32 around every kernel: correct, but usually slower than plain fp32.
inline std::string cpu_half_gap(c10::ScalarType dtype,
                                const std::unordered_map<std::string, c10::IValue>& caps) {
  auto has = [&](const char* key) {
    auto it = caps.find(key);
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  };
  if (dtype == c10::kBFloat16) {
    if (has("avx512_bf16") || has("amx_bf16")) return "";
    return "this CPU has no bf16 instructions (avx512_bf16 / amx_bf16)";
  }
  if (dtype == c10::kHalf) {
    if (has("avx512_fp16") || has("amx_fp16")) return "";
    return "this CPU has no fp16 arithmetic instructions (avx512_fp16 / amx_fp16)";
  }
  return "";
}

// Note [Auto precision]: mode = "auto" runs bf16 autocast where it is faster than fp32 and
// fp32 elsewhere. On a CPU that speed depends on more than the instruction set (bf16 ran at
// 1.5x fp32 on an AVX-512-BF16 EPYC and at 0.65x on a Xeon with AMX switched off: the casts
// and non-matmul ops dominated), so the plugin times one transformer MLP block (matmuls,
// LayerNorm, GELU, forward and backward) both ways and hands the medians here. bf16 must win by
// a margin, because it also costs precision.
constexpr double kAutoBf16Margin = 0.9;
inline bool auto_prefers_bf16(double fp32_seconds, double bf16_seconds) {
  return bf16_seconds > 0 && fp32_seconds > 0 && bf16_seconds < kAutoBf16Margin * fp32_seconds;
}

}  // namespace loom::precision
