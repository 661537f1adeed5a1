// loom/kernel_isa.h — which vector instruction set loom's own hand-vectorised CPU kernels run
// (adam8bit's block kernel, the fused loss's softmax rows, the fused row ops): the best this
// CPU has, capped by the environment variable LOOM_KERNEL_ISA. Header-only. Not oneDNN's level
// (that is `[train] cpu_isa`, for ATen's own kernels): this one never reaches ATen.
//
// Note [Kernel ISA cap]: every kernel with an AVX-512 path has an AVX2 path and a scalar one,
// chosen per call at run time, so one binary runs on any x86-64 CPU and executes no instruction
// the CPU lacks. LOOM_KERNEL_ISA = avx512 | avx2 | scalar caps the choice (a cap above what the
// CPU has changes nothing), so the tests run every path on whatever CPU they find and compare
// them bit for bit, and a benchmark can time the AVX2 path on an AVX-512 machine. It is read on
// every call (a test sets it between calls); an unknown value is an error naming it, raised
// when a job is prepared too, so `loom check` refuses it and a run writes nothing.
#pragma once

#include <cstdlib>
#include <string>

#include "loom/error.h"

namespace loom::cpu {

enum class KernelIsa { scalar = 0, avx2 = 1, avx512 = 2 };

inline const char* kernel_isa_name(KernelIsa isa) {
  return isa == KernelIsa::avx512 ? "avx512" : isa == KernelIsa::avx2 ? "avx2" : "scalar";
}

// What this CPU runs: AVX-512 needs F, BW, VL and DQ (as the kernels use them); AVX2 needs FMA.
inline KernelIsa cpu_kernel_isa() {
#if defined(__x86_64__)
  static const KernelIsa best = [] {
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      return KernelIsa::avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return KernelIsa::avx2;
    return KernelIsa::scalar;
  }();
  return best;
#else
  return KernelIsa::scalar;
#endif
}

// The CPU's best, capped by LOOM_KERNEL_ISA (Note [Kernel ISA cap]).
inline KernelIsa kernel_isa() {
  const KernelIsa best = cpu_kernel_isa();
  const char* cap = std::getenv("LOOM_KERNEL_ISA");
  if (!cap || !*cap) return best;
  const std::string value(cap);
  KernelIsa wanted;
  if (value == "avx512")
    wanted = KernelIsa::avx512;
  else if (value == "avx2")
    wanted = KernelIsa::avx2;
  else if (value == "scalar")
    wanted = KernelIsa::scalar;
  else
    throw ConfigError("environment variable LOOM_KERNEL_ISA='" + value +
                      "' is no kernel ISA; use avx512, avx2 or scalar, or unset it for the best "
                      "this CPU has (" + kernel_isa_name(best) + ")");
  return wanted < best ? wanted : best;
}

}  // namespace loom::cpu
