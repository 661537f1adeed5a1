// adamw_bf16_element.h (core-internal) — one element of AdamW over bf16 moments, compiled both
// by the CPU kernel (core/src/adamw.cpp) and by the CUDA kernel (core/src/cuda/adamw_bf16.cu),
// so the two are one piece of arithmetic: Note [Stochastic rounding of the state] in adamw.cpp.
// Both compilers keep each operation's own rounding (no FMA contraction: -ffp-contract=off for
// the CPU file, --fmad=false for the CUDA one; IEEE division and square root on both), so the
// GPU's parameters and moments are bitwise the CPU kernel's (Gpu.Bf16OptimizerStateFollowsTheCpuKernel).
// Plain C++ with no LibTorch header: nvcc compiles it without them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LOOM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LOOM_HOST_DEVICE __attribute__((always_inline)) inline
#endif

namespace loom {

// One step's constants, for the fp32 kernel as for this one.
struct AdamWCoefficients {
  float decay;      // 1 - lr * weight_decay
  float w1;         // 1 - beta1 (lerp weight)
  float b2, w2;     // beta2, 1 - beta2
  float bc2_sqrt;   // sqrt(1 - beta2^t)
  float eps;
  float step_size;  // lr / (1 - beta1^t)
};

namespace adamw_bf16 {

// Chris Wellons' 32-bit integer hash.
LOOM_HOST_DEVICE uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

LOOM_HOST_DEVICE uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
#endif
}

LOOM_HOST_DEVICE float float_of(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

LOOM_HOST_DEVICE float bf16_to_float(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

// f rounded to the nearest bf16, ties to even (c10::BFloat16's rounding); NaN -> 0x7FC0.
LOOM_HOST_DEVICE uint16_t float_to_bf16_nearest(float f) {
  const uint32_t bits = bits_of(f);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

// f rounded to bf16 up with probability equal to its distance from the bf16 below; NaN quieted.
LOOM_HOST_DEVICE uint16_t float_to_bf16_stochastic(float f, uint32_t random16) {
  const uint32_t bits = bits_of(f);
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  const uint32_t rounded = (bits + random16) >> 16;
  return static_cast<uint16_t>(nan ? (bits >> 16) | 0x0040u : rounded);
}

LOOM_HOST_DEVICE float square_root(float x) {
#if defined(__CUDA_ARCH__)
  return sqrtf(x);  // correctly rounded (nvcc's default -prec-sqrt=true), as sqrtps is
#else
  return std::sqrt(x);
#endif
}

// The 32 random bits of the element at `index` (of the whole tensor, mod 2^32) under a span's
// key (key_lo, key_hi).
LOOM_HOST_DEVICE uint32_t random_bits(uint32_t index, uint32_t key_lo, uint32_t key_hi) {
  return lowbias32(lowbias32(index ^ key_lo) ^ key_hi);
}

// A gradient element as it is stored: fp32, or bf16 bits (full_bf16's, read as they are on the
// CPU: Note [bf16 gradients read as they are] in ../adamw.cpp), widened exactly.
LOOM_HOST_DEVICE float gradient_value(const float* g, int64_t i) { return g[i]; }
LOOM_HOST_DEVICE float gradient_value(const uint16_t* g, int64_t i) { return bf16_to_float(g[i]); }

// Element i of a span whose first element has index `first_index` in the whole flattened
// tensor and whose rounding key is (key_lo, key_hi). p: fp32; g: fp32 or bf16 bits; m, v: bf16
// bits.
template <typename G>
LOOM_HOST_DEVICE void update(float* __restrict p, const G* __restrict g, uint16_t* __restrict m,
                             uint16_t* __restrict v, int64_t i, const AdamWCoefficients& c,
                             uint32_t first_index, uint32_t key_lo, uint32_t key_hi) {
  const float gi = gradient_value(g, i);
  const float m0 = bf16_to_float(m[i]), v0 = bf16_to_float(v[i]);
  const float mi = m0 + c.w1 * (gi - m0);
  const float vi = c.b2 * v0 + c.w2 * gi * gi;
  const uint32_t x = random_bits(first_index + static_cast<uint32_t>(i), key_lo, key_hi);
  m[i] = float_to_bf16_stochastic(mi, x & 0xFFFFu);
  v[i] = float_to_bf16_stochastic(vi, x >> 16);
  p[i] = p[i] * c.decay - c.step_size * (mi / (square_root(vi) / c.bc2_sqrt + c.eps));
}

// Element i of a weight span written back into bf16 from its fp32 value, rounded with the low
// 16 random bits (Note [bf16 weights as their own masters] in ../step_driver.cpp).
LOOM_HOST_DEVICE void round_weight(const float* __restrict from, uint16_t* __restrict into,
                                   int64_t i, uint32_t first_index, uint32_t key_lo,
                                   uint32_t key_hi) {
  const uint32_t x = random_bits(first_index + static_cast<uint32_t>(i), key_lo, key_hi);
  into[i] = float_to_bf16_stochastic(from[i], x & 0xFFFFu);
}

}  // namespace adamw_bf16
}  // namespace loom
