// Blockwise dynamic 8-bit quantization (Dettmers et al. 2021, "8-bit Optimizers via Block-wise
// Quantization"): the code maps of adam8bit and the scalar quantize/dequantize steps. Header
// only, so the tests check the maps and the error bound they imply directly.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

namespace loom::optim {

// A dynamic ("tree") map: 256 sorted codes in [-1, 1] (signed, for m) or [0, 1] (unsigned, for
// v). A magnitude code is e zero bits (the decimal exponent: scale 10^-e), an indicator 1 bit,
// then f = bits-1-e fraction bits spread linearly over (0.1, 1]; so large values get many
// fraction bits and tiny ones (down to 10^-(bits-1)) still have a code. The top code is
// exactly 1, so each block's absmax element comes back exactly. Signed: 7 magnitude bits and a
// sign (127 codes a side + zero; the 256th code is a second zero); unsigned: 8 bits (255 + 0).
struct QuantMap {
  std::array<float, 256> code{};       // sorted ascending; the byte is the index
  std::array<float, 256> threshold{};  // threshold[i] = midpoint of code[i], code[i+1]; [255] = inf

  explicit QuantMap(bool is_signed) {
    const int bits = is_signed ? 7 : 8;
    float magnitudes[256];
    int count = 0;
    for (int e = 0; e < bits; ++e) {
      const int fraction_codes = 1 << (bits - 1 - e);
      const double scale = std::pow(10.0, -e);
      for (int k = 0; k < fraction_codes; ++k)
        magnitudes[count++] =
            static_cast<float>(scale * (0.1 + 0.9 * static_cast<double>(k + 1) / fraction_codes));
    }
    int n = 0;
    code[n++] = 0.0f;
    for (int i = 0; i < count; ++i) code[n++] = magnitudes[i];
    if (is_signed) {
      for (int i = 0; i < count; ++i) code[n++] = -magnitudes[i];
      code[n++] = 0.0f;  // the spare code: a second zero
    }
    std::sort(code.begin(), code.begin() + n);
    for (int i = 0; i < 255; ++i) threshold[i] = 0.5f * (code[i] + code[i + 1]);
    threshold[255] = std::numeric_limits<float>::infinity();
  }

  // The nearest code of y (|y| <= 1): a branch-free binary search over the midpoints.
  uint8_t quantize(float y) const {
    int i = 0;
    for (int step = 128; step >= 1; step >>= 1)
      i += step * static_cast<int>(threshold[i + step - 1] < y);  // setcc, no branch
    return static_cast<uint8_t>(i);
  }
  float dequantize(uint8_t q) const { return code[q]; }
};

inline const QuantMap& signed_map() {
  static const QuantMap map(true);
  return map;
}
inline const QuantMap& unsigned_map() {
  static const QuantMap map(false);
  return map;
}

}  // namespace loom::optim
