// Stochastic rounding to bf16: the random bits' keys and tensor ops, and the weights' rounding
// pass. See stochastic_rounding.h.
#include "stochastic_rounding.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "adamw_bf16_element.h"
#include "cuda_runtime.h"
#include "loom/error.h"
#include "loom/kernel_isa.h"

namespace loom {

uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t fnv1a64(const std::string& text) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001B3ull;
  return h;
}

uint64_t weight_rounding_key(uint64_t seed, const std::string& name) {
  return mix64(seed ^ fnv1a64("weight/" + name));
}

namespace {

// The random bits as tensor ops (int64 tensors holding uint32 values).
// x * factor mod 2^32 for x < 2^32 held in int64, in two halves of factor so that no product
// reaches 2^63 (signed overflow).
at::Tensor multiply_mod32(const at::Tensor& x, int64_t factor) {
  const at::Tensor low = x * (factor & 0xFFFF);
  const at::Tensor high = at::bitwise_left_shift(at::bitwise_and(x * (factor >> 16), 0xFFFF), 16);
  return at::bitwise_and(low + high, 0xFFFFFFFFll);
}

at::Tensor lowbias32_ops(at::Tensor x) {
  x = at::bitwise_xor(x, at::bitwise_right_shift(x, 16));
  x = multiply_mod32(x, 0x7FEB352Dll);
  x = at::bitwise_xor(x, at::bitwise_right_shift(x, 15));
  x = multiply_mod32(x, 0x846CA68Bll);
  return at::bitwise_xor(x, at::bitwise_right_shift(x, 16));
}

// The weights' pass: round_weight over a span, a loop each ISA's copy vectorises for itself
// (integer multiplies, shifts and adds only, so the copies agree by construction).
__attribute__((always_inline)) inline void round_weights_body(const float* __restrict from,
                                                              uint16_t* __restrict into, int64_t n,
                                                              uint32_t first_index, uint32_t key_lo,
                                                              uint32_t key_hi) {
  for (int64_t i = 0; i < n; ++i)
    adamw_bf16::round_weight(from, into, i, first_index, key_lo, key_hi);
}
using RoundWeightsKernel = void (*)(const float*, uint16_t*, int64_t, uint32_t, uint32_t, uint32_t);
#if defined(__x86_64__)
__attribute__((target("arch=x86-64-v4"))) void round_weights_avx512(const float* from,
                                                                    uint16_t* into, int64_t n,
                                                                    uint32_t first, uint32_t lo,
                                                                    uint32_t hi) {
  round_weights_body(from, into, n, first, lo, hi);
}
__attribute__((target("arch=x86-64-v3"))) void round_weights_avx2(const float* from, uint16_t* into,
                                                                  int64_t n, uint32_t first,
                                                                  uint32_t lo, uint32_t hi) {
  round_weights_body(from, into, n, first, lo, hi);
}
#endif
void round_weights_baseline(const float* from, uint16_t* into, int64_t n, uint32_t first,
                            uint32_t lo, uint32_t hi) {
  round_weights_body(from, into, n, first, lo, hi);
}

RoundWeightsKernel round_weights_kernel() {
#if defined(__x86_64__)
  switch (cpu::kernel_isa()) {
    case cpu::KernelIsa::avx512:
      return round_weights_avx512;
    case cpu::KernelIsa::avx2:
      return round_weights_avx2;
    case cpu::KernelIsa::scalar:
      break;
  }
#endif
  return round_weights_baseline;
}

}  // namespace

at::Tensor random_bits_ops(uint64_t tensor_key, int64_t step, int64_t offset, int64_t n,
                           const at::TensorOptions& options) {
  const auto longs = options.dtype(at::kLong);
  at::Tensor random = at::empty({n}, longs);
  each_rounding_span(
      tensor_key, step, offset, 0, n,
      [&](int64_t from, int64_t stop, uint32_t index, uint64_t key) {
        const at::Tensor low = at::arange(static_cast<int64_t>(index),
                                          static_cast<int64_t>(index) + (stop - from), longs);
        random.slice(0, from, stop)
            .copy_(lowbias32_ops(at::bitwise_xor(
                lowbias32_ops(at::bitwise_xor(low, static_cast<int64_t>(key & 0xFFFFFFFFull))),
                static_cast<int64_t>(key >> 32))));
      });
  return random;
}

void round_into_ops(const at::Tensor& x, const at::Tensor& random16, at::Tensor& into) {
  const at::Tensor bits = at::bitwise_and(x.view(at::kInt).to(at::kLong), 0xFFFFFFFFll);
  const at::Tensor nan = at::bitwise_and(bits, 0x7FFFFFFFll) > 0x7F800000ll;
  const at::Tensor rounded = at::bitwise_right_shift(bits + random16, 16);
  const at::Tensor quiet = at::bitwise_or(at::bitwise_right_shift(bits, 16), 0x0040);
  at::Tensor half = at::where(nan, quiet, at::bitwise_and(rounded, 0xFFFF));
  // 0..65535 into int16's bit pattern.
  half = at::where(half >= 32768, half - 65536, half).to(at::kShort);
  into.view(at::kShort).copy_(half);
}

void round_to_bf16_stochastic(const at::Tensor& from, at::Tensor& into, uint64_t tensor_key,
                              int64_t step, int64_t offset) {
  LOOM_INTERNAL_ASSERT(from.scalar_type() == at::kFloat && into.scalar_type() == at::kBFloat16 &&
                           from.is_contiguous() && into.is_contiguous() &&
                           from.numel() == into.numel() && from.device() == into.device(),
                       "round_to_bf16_stochastic takes (n) fp32 into (n) bf16 on one device");
  const int64_t n = from.numel();
  const float* source = from.data_ptr<float>();
  auto* target = reinterpret_cast<uint16_t*>(into.data_ptr<at::BFloat16>());
  const CudaRuntime* cuda = from.is_cuda() ? cuda_runtime() : nullptr;
  if (cuda && cuda->round_bf16_stochastic) {
    each_rounding_span(tensor_key, step, offset, 0, n,
                       [&](int64_t begin, int64_t stop, uint32_t index, uint64_t key) {
                         cuda->round_bf16_stochastic(
                             from.get_device(), source + begin, target + begin, stop - begin, index,
                             static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32));
                       });
    return;
  }
  if (from.is_cpu()) {
    const RoundWeightsKernel kernel = round_weights_kernel();
    at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
      each_rounding_span(tensor_key, step, offset, begin, end,
                         [&](int64_t span_begin, int64_t stop, uint32_t index, uint64_t key) {
                           kernel(source + span_begin, target + span_begin, stop - span_begin,
                                  index, static_cast<uint32_t>(key),
                                  static_cast<uint32_t>(key >> 32));
                         });
    });
    return;
  }
  const at::Tensor random = random_bits_ops(tensor_key, step, offset, n, from.options());
  round_into_ops(from, at::bitwise_and(random, 0xFFFF), into);
}

}  // namespace loom
