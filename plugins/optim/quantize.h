// Blockwise dynamic 8-bit quantization (Dettmers et al. 2021, "8-bit Optimizers via Block-wise
// Quantization"): the code maps of adam8bit and the scalar quantize/dequantize steps. Header
// only, so the tests check the maps and the error bound they imply directly.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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
    // The cells' first candidates: the number of thresholds below the least y of the cell.
    for (int cell = 0; cell < kCells; ++cell) {
      const float lo = cell_low(cell), hi = cell == kCells - 1
                                               ? std::numeric_limits<float>::infinity()
                                               : cell_low(cell + 1);
      first_positive[cell] = static_cast<uint8_t>(below(lo));
      first_negative[cell] = static_cast<uint8_t>(below(-hi));
      // y in [lo, hi) lands in [below(lo), below(hi)]; y in (-hi, -lo] in
      // [below(-hi), at_most(-lo)]: the walk never needs more steps than the widest cell.
      if (cell < kCells - 1)
        walk_steps = std::max({walk_steps, below(hi) - below(lo), at_most(-lo) - below(-hi)});
    }
    // Note [Quantize in vectors]: the walk of at most three steps, unrolled per cell and sign.
    constexpr float inf = std::numeric_limits<float>::infinity();
    for (int cell = 0; cell < kCells; ++cell)
      for (int negative = 0; negative < 2; ++negative) {
        const int first = negative ? first_negative[cell] : first_positive[cell];
        const int k = 2 * cell + negative;
        lane_first[k] = first;
        lane_t0[k] = threshold[first];
        lane_t1[k] = first + 1 <= 255 ? threshold[first + 1] : inf;
        lane_t2[k] = first + 2 <= 255 ? threshold[first + 2] : inf;
      }
  }

  // The nearest code of y (|y| <= 1): a branch-free binary search over the midpoints.
  uint8_t quantize(float y) const {
    int i = 0;
    for (int step = 128; step >= 1; step >>= 1)
      i += step * static_cast<int>(threshold[i + step - 1] < y);  // setcc, no branch
    return static_cast<uint8_t>(i);
  }
  float dequantize(uint8_t q) const { return code[q]; }

  // Note [Quantize by table]: the same code as quantize() for every float, NaN included, with a
  // table lookup and a comparison or two instead of eight dependent steps. |y| is cut into
  // cells by its exponent and top kCellBits mantissa bits (each cell 1/32 of a binade, finer
  // than the codes are spaced); a cell's table entry is the number of thresholds below its
  // least value, and the walk up from there counts the rest below y — the binary search's
  // answer by definition.
  uint8_t quantize_fast(float y) const {
    uint32_t bits;
    std::memcpy(&bits, &y, sizeof bits);
    const uint32_t magnitude = bits & 0x7fffffffu;
    const int exponent = static_cast<int>(magnitude >> 23);
    int cell = exponent < kMinExponent
                   ? 0
                   : 1 + (exponent - kMinExponent) * kCellsPerBinade +
                         static_cast<int>((magnitude >> (23 - kCellBits)) & (kCellsPerBinade - 1));
    cell = exponent > kMaxExponent ? kCells - 1 : cell;
    int i = (bits >> 31) ? first_negative[cell] : first_positive[cell];
    // A fixed number of branch-free steps (a data-dependent loop mispredicts): a step past the
    // answer adds 0, and threshold[255] = inf stops every walk.
    for (int step = 0; step < walk_steps; ++step) i += static_cast<int>(threshold[i] < y);
    return static_cast<uint8_t>(y == y ? i : 0);  // NaN: 0, as the search gives
  }

#if defined(__x86_64__)
  // Note [Quantize in vectors]: quantize_fast for 16 floats at once, its byte for every float
  // (tested over the same values): the cell and sign index tables of the walk's first candidate
  // and of the three thresholds its steps compare, so the walk — i plus how many of t0 <= t1 <= t2
  // lie below y, counted in order (a step past the answer adds nothing) — is four independent
  // gathers and three compares. Needs walk_steps <= 3 (2 for the signed map, 3 for the
  // unsigned); callers check vector_ready().
  bool vector_ready() const { return walk_steps <= 3; }
  __attribute__((target("avx512f"))) __m512i quantize16(__m512 y) const {
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    const __m512i exponent = _mm512_srli_epi32(magnitude, 23);
    __m512i cell = _mm512_add_epi32(
        _mm512_set1_epi32(1),
        _mm512_add_epi32(
            _mm512_slli_epi32(_mm512_sub_epi32(exponent, _mm512_set1_epi32(kMinExponent)), kCellBits),
            _mm512_and_si512(_mm512_srli_epi32(magnitude, 23 - kCellBits),
                             _mm512_set1_epi32(kCellsPerBinade - 1))));
    cell = _mm512_mask_mov_epi32(
        cell, _mm512_cmplt_epi32_mask(exponent, _mm512_set1_epi32(kMinExponent)),
        _mm512_setzero_si512());
    cell = _mm512_mask_mov_epi32(
        cell, _mm512_cmpgt_epi32_mask(exponent, _mm512_set1_epi32(kMaxExponent)),
        _mm512_set1_epi32(kCells - 1));
    const __m512i index = _mm512_add_epi32(_mm512_slli_epi32(cell, 1), _mm512_srli_epi32(bits, 31));
    const __m512i first = _mm512_i32gather_epi32(index, lane_first.data(), 4);
    const __m512 t0 = _mm512_i32gather_ps(index, lane_t0.data(), 4);
    const __m512 t1 = _mm512_i32gather_ps(index, lane_t1.data(), 4);
    const __mmask16 above0 = _mm512_cmp_ps_mask(t0, y, _CMP_LT_OQ);
    const __mmask16 above1 = above0 & _mm512_cmp_ps_mask(t1, y, _CMP_LT_OQ);
    const __m512i one = _mm512_set1_epi32(1);
    __m512i q = _mm512_mask_add_epi32(first, above0, first, one);
    q = _mm512_mask_add_epi32(q, above1, q, one);
    if (walk_steps > 2) {  // the gathers are the cost: the third only where a cell needs it
      const __m512 t2 = _mm512_i32gather_ps(index, lane_t2.data(), 4);
      q = _mm512_mask_add_epi32(q, above1 & _mm512_cmp_ps_mask(t2, y, _CMP_LT_OQ), q, one);
    }
    return _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(y, y, _CMP_ORD_Q), q);  // NaN: 0
  }
#endif
  // Cells: [0, 2^(kMinExponent-127)) is cell 0, then kCellsPerBinade per binade up to |y| < 2;
  // anything larger (or NaN) is the last cell.
  static constexpr int kCellBits = 5, kCellsPerBinade = 1 << kCellBits;
  static constexpr int kMinExponent = 127 - 32, kMaxExponent = 127;
  static constexpr int kCells = 1 + (kMaxExponent - kMinExponent + 1) * kCellsPerBinade;
  std::array<uint8_t, kCells> first_positive{}, first_negative{};
  int walk_steps = 0;  // the most thresholds any one cell holds (signed map 2, unsigned 3)
  // Note [Quantize in vectors]: by 2 x cell + sign.
  std::array<int32_t, 2 * kCells> lane_first{};
  std::array<float, 2 * kCells> lane_t0{}, lane_t1{}, lane_t2{};

 private:
  static float cell_low(int cell) {
    if (cell == 0) return 0.0f;
    const int c = cell - 1;
    const uint32_t bits = static_cast<uint32_t>(kMinExponent + c / kCellsPerBinade) << 23 |
                          static_cast<uint32_t>(c % kCellsPerBinade) << (23 - kCellBits);
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
  }
  int below(float x) const {  // thresholds < x (threshold[255] = inf never is)
    int n = 0;
    while (n < 255 && threshold[n] < x) ++n;
    return n;
  }
  int at_most(float x) const {  // thresholds <= x
    int n = 0;
    while (n < 255 && threshold[n] <= x) ++n;
    return n;
  }
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
