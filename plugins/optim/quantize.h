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

#if defined(__x86_64__)
// Note [Lookups in registers]: a 256-entry float table held in 16 AVX-512 registers, looked up
// for 16 lanes by eight two-register permutes (each picks from 32 entries by an index's low 5
// bits) and a blend tree on bits 5-7. On the EPYC this project measured it costs 1.9 ns against a
// gather's 4.8 (build/bin/loom_lookup_cost); the same floats come back, so the kernels that use it
// stay bit-identical to the gathers'. Callers load it once per block (a local, so the compiler
// keeps it in registers: a byte store in the loop could alias a table in memory).
struct RegisterTable {
  __m512 part[16];
  __attribute__((target("avx512f"))) explicit RegisterTable(const float* table) {
    for (int k = 0; k < 16; ++k) part[k] = _mm512_loadu_ps(table + 16 * k);
  }
  // table[index] for every lane; index in [0, 255].
  __attribute__((target("avx512f"))) __m512 lookup(__m512i index) const {
    __m512 pair[8];
    for (int k = 0; k < 8; ++k) pair[k] = _mm512_permutex2var_ps(part[2 * k], index, part[2 * k + 1]);
    const __mmask16 b5 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(32));
    const __mmask16 b6 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(64));
    const __mmask16 b7 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(128));
    const __m512 q0 = _mm512_mask_blend_ps(b5, pair[0], pair[1]);
    const __m512 q1 = _mm512_mask_blend_ps(b5, pair[2], pair[3]);
    const __m512 q2 = _mm512_mask_blend_ps(b5, pair[4], pair[5]);
    const __m512 q3 = _mm512_mask_blend_ps(b5, pair[6], pair[7]);
    return _mm512_mask_blend_ps(b7, _mm512_mask_blend_ps(b6, q0, q1),
                                _mm512_mask_blend_ps(b6, q2, q3));
  }
};
#endif

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
    // Note [Quantize in vectors]: the walk's first candidate by cell and sign.
    for (int cell = 0; cell < kCells; ++cell)
      for (int negative = 0; negative < 2; ++negative)
        lane_first[2 * cell + negative] = negative ? first_negative[cell] : first_positive[cell];
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
  // (tested over the same values): the walk's first candidate comes from a gather by cell and
  // sign, and the thresholds its steps compare, threshold[first + k] (the last one, inf, past
  // the end), from `thresholds`, this map's threshold table in registers (Note [Lookups in
  // registers]); i plus how many of them lie below y, counted in order (a step past the answer
  // adds nothing), is the walk's answer. Needs walk_steps <= 3 (2 for the signed map, 3 for the
  // unsigned); callers check vector_ready().
  bool vector_ready() const { return walk_steps <= 3; }
  __attribute__((target("avx512f"))) __m512i quantize16(__m512 y,
                                                        const RegisterTable& thresholds) const {
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
    const __m512i one = _mm512_set1_epi32(1), last = _mm512_set1_epi32(255);
    const __m512i first1 = _mm512_min_epi32(_mm512_add_epi32(first, one), last);
    const __mmask16 above0 = _mm512_cmp_ps_mask(thresholds.lookup(first), y, _CMP_LT_OQ);
    const __mmask16 above1 = above0 & _mm512_cmp_ps_mask(thresholds.lookup(first1), y, _CMP_LT_OQ);
    __m512i q = _mm512_mask_add_epi32(first, above0, first, one);
    q = _mm512_mask_add_epi32(q, above1, q, one);
    if (walk_steps > 2) {  // a third step only where a map's cells need it
      const __m512i first2 = _mm512_min_epi32(_mm512_add_epi32(first1, one), last);
      q = _mm512_mask_add_epi32(
          q, above1 & _mm512_cmp_ps_mask(thresholds.lookup(first2), y, _CMP_LT_OQ), q, one);
    }
    return _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(y, y, _CMP_ORD_Q), q);  // NaN: 0
  }
  // The same with the table loaded here (a caller with one value to quantize: the tests).
  __attribute__((target("avx512f"))) __m512i quantize16(__m512 y) const {
    const RegisterTable thresholds(threshold.data());
    return quantize16(y, thresholds);
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
