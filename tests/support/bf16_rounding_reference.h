// The random bits of Note [bf16 weights as their own masters] (core/src/step_driver.cpp) and
// the rounding they drive, written from the Note's formula for the tests (not the core's code):
// what a bf16 weight without a master holds after an update whose fp32 result is known.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace loom::test {

inline uint64_t splitmix_finaliser(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
inline uint64_t fnv(const std::string& text) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}
inline uint32_t wellons(uint32_t x) {
  x = (x ^ (x >> 16)) * 0x7FEB352Du;
  x = (x ^ (x >> 15)) * 0x846CA68Bu;
  return x ^ (x >> 16);
}
// Weight `index` of parameter `name` at update `step`, rounded from its fp32 value.
inline uint16_t reference_round(float value, uint64_t seed, const std::string& name, int64_t step,
                                int64_t index) {
  const uint64_t tensor_key = splitmix_finaliser(seed ^ fnv("weight/" + name));
  const uint64_t key =
      splitmix_finaliser(splitmix_finaliser(tensor_key ^ uint64_t(step)) ^ (uint64_t(index) >> 32));
  const uint32_t x = wellons(wellons(uint32_t(index) ^ uint32_t(key)) ^ uint32_t(key >> 32));
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return static_cast<uint16_t>((bits + (x & 0xFFFFu)) >> 16);
}
// An fp32 tensor (on the CPU) rounded as parameter `name`'s weights at update `step`.
inline at::Tensor reference_rounding(const at::Tensor& fp32, uint64_t seed, const std::string& name,
                                     int64_t step) {
  const at::Tensor flat = fp32.contiguous().view(-1);
  at::Tensor out = at::empty({flat.numel()}, at::kShort);
  const float* v = flat.data_ptr<float>();
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<int16_t>());
  for (int64_t i = 0; i < flat.numel(); ++i) o[i] = reference_round(v[i], seed, name, step, i);
  return out.view(at::kBFloat16).view(fp32.sizes());
}

}  // namespace loom::test
