// Blockwise dynamic 8-bit quantization (Dettmers et al. 2021, "8-bit Optimizers via Block-wise
// Quantization"): the code maps of adam8bit and the scalar quantize/dequantize steps. Header
// only, so the tests check the maps and the error bound they imply directly.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "adam8bit_element.h"

namespace loom::optim {

#if defined(__x86_64__)
// Note [Lookups in registers]: a 256-entry float table held in 16 AVX-512 registers, looked up
// for 16 lanes by eight two-register permutes (each picks from 32 entries by an index's low 5
// bits) and a blend tree on bits 5-7. On the EPYC this project measured it costs 1.9 ns against a
// gather's 4.8 (build/bin/loom_lookup_cost); the same floats come back, so the kernels that use it
// stay bit-identical to the gathers'. Callers load it once per block (a local, so the compiler
// keeps it in registers: a byte store in the loop could alias a table in memory). adam8bit's
// kernel dequantized by it until issue 39 and now by arithmetic (Note [Dequantize by
// arithmetic]: three permutes per 16 values, not eight and seven blends); loom_lookup_cost
// still measures it against the gather.
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

// An 8-entry table of 32-bit words twice over, so a 16-entry permute reads entry (index & 7)
// with no mask.
__attribute__((target("avx512f"))) inline __m512i twice_over(const void* table) {
  const __m512i low =
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(table)));
  return _mm512_shuffle_i32x4(low, low, 0x44);
}

#endif

// A dynamic ("tree") map: 256 sorted codes in [-1, 1] (signed, for m) or [0, 1] (unsigned, for
// v). A magnitude code is e zero bits (the decimal exponent: scale 10^-e), an indicator 1 bit,
// then f = bits-1-e fraction bits spread linearly over (0.1, 1]; so large values get many
// fraction bits and tiny ones (down to 10^-(bits-1)) still have a code. The top code is
// exactly 1, so each block's absmax element comes back exactly. Signed: 7 magnitude bits and a
// sign (127 codes a side + zero; the 256th code is a second zero); unsigned: 8 bits (255 + 0).
struct QuantMap {
  std::array<float, 256> code{};       // sorted ascending; the byte is the index
  // code[] as four planes of bytes: byte b of code[i] at 256 b + i (Note [Dequantize by byte
  // planes]).
  alignas(64) std::array<uint8_t, 1024> code_planes{};
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
    build_step_cells();
    build_lines(is_signed);
    build_dequantize(is_signed);
    for (int i = 0; i < 256; ++i)
      for (int b = 0; b < 4; ++b)
        code_planes[256 * b + i] = static_cast<uint8_t>(to_bits(code[i]) >> (8 * b));
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

  // Note [Quantize in one step]: quantize_fast in one lookup and one comparison. The cells are
  // finer here (1/128 binade, from 2^-26 up: the maps' least threshold is 2^-24.3), so no cell
  // of either sign holds more than one threshold (step_ready() says so; the constructor
  // counts). A cell's entry is the count of thresholds below the whole cell (`base`, 8 bits)
  // and where its one threshold lies in it, as the 16 mantissa bits below the cell's own 7
  // (integers order like the floats they are, within a cell of one sign): y's code is base
  // plus whether that threshold lies below y. For a negative y the threshold lies below y when
  // its magnitude is the larger, so both offsets are stored and compared complemented (~a < ~b
  // is a > b) and one signed comparison serves both signs. A cell without a threshold holds a
  // sentinel no offset passes. Cell 0 is |y| < 2^-26, zero included: its one threshold is the
  // signed map's 0 (between its two zero codes), passed by any y != 0, so y's offset there is
  // min(|y| bits, 1). The last cell is |y| >= 2, infinities and NaN (NaN's code is 0, masked).
  // One gather per vector of values instead of the walk's three or four lookups; byte-identical
  // to quantize_fast (tested for every float tried, in every lane).
  // The cells and the scalar code are in adam8bit_element.h, which the CUDA kernel compiles too.
  static constexpr int kStepBits = optim::kStepBits, kStepMinExponent = optim::kStepMinExponent;
  static constexpr int kStepCells = optim::kStepCells;
  std::array<int32_t, 2 * kStepCells> step_cell{};  // by 2 x cell + sign: base | offset << 8
  bool step_ready() const { return step_cells_fit; }
  // The scalar statement of the vector code (the tests hold it to quantize()).
  uint8_t quantize_step(float y) const { return quantize_by_cells(y, step_cell.data()); }
#if defined(__x86_64__)
  // quantize_step for 8 lanes (AVX2) and for 16 (AVX-512): the codes as int32 lanes.
  __attribute__((target("avx2"))) __m256i quantize8(__m256 y) const {
    const __m256i bits = _mm256_castps_si256(y);
    const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    const __m256i raw = _mm256_sub_epi32(_mm256_srli_epi32(magnitude, 16),
                                         _mm256_set1_epi32((kStepMinExponent << kStepBits) - 1));
    const __m256i cell = _mm256_min_epi32(_mm256_max_epi32(raw, _mm256_setzero_si256()),
                                          _mm256_set1_epi32(kStepCells - 1));
    const __m256i negative = _mm256_srai_epi32(bits, 31);
    const __m256i entry = _mm256_i32gather_epi32(
        reinterpret_cast<const int*>(step_cell.data()),
        _mm256_sub_epi32(_mm256_add_epi32(cell, cell), negative), 4);
    const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(1), raw);
    const __m256i offset = _mm256_xor_si256(
        _mm256_blendv_epi8(_mm256_and_si256(magnitude, _mm256_set1_epi32(0xffff)),
                           _mm256_min_epu32(magnitude, _mm256_set1_epi32(1)), tiny),
        negative);
    const __m256i q = _mm256_sub_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0xff)),
                                       _mm256_cmpgt_epi32(offset, _mm256_srai_epi32(entry, 8)));
    return _mm256_and_si256(q, _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_ORD_Q)));  // NaN: 0
  }
  __attribute__((target("avx512f"))) __m512i quantize16_step(__m512 y) const {
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    const __m512i raw = _mm512_sub_epi32(_mm512_srli_epi32(magnitude, 16),
                                         _mm512_set1_epi32((kStepMinExponent << kStepBits) - 1));
    const __m512i cell = _mm512_min_epi32(_mm512_max_epi32(raw, _mm512_setzero_si512()),
                                          _mm512_set1_epi32(kStepCells - 1));
    const __m512i negative = _mm512_srai_epi32(bits, 31);
    const __m512i entry =
        _mm512_i32gather_epi32(_mm512_sub_epi32(_mm512_add_epi32(cell, cell), negative),
                               step_cell.data(), 4);
    const __mmask16 tiny = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(1), raw);
    const __m512i offset = _mm512_xor_si512(
        _mm512_mask_min_epu32(_mm512_and_si512(magnitude, _mm512_set1_epi32(0xffff)), tiny,
                              magnitude, _mm512_set1_epi32(1)),
        negative);
    const __m512i base = _mm512_and_si512(entry, _mm512_set1_epi32(0xff));
    const __m512i q = _mm512_mask_add_epi32(
        base, _mm512_cmpgt_epi32_mask(offset, _mm512_srai_epi32(entry, 8)), base,
        _mm512_set1_epi32(1));
    return _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(y, y, _CMP_ORD_Q), q);  // NaN: 0
  }
#endif

  // Note [Quantize by arithmetic]: the map is arithmetic, so its code is too. Decade e (scale
  // 10^-e, n_e codes, the first at byte base_e) holds the codes 10^-e (0.1 + 0.9 (k+1)/n_e), and
  // its thresholds, the midpoints, lie where x = (|y| 10^e - 0.1) n_e / 0.9 is k + 1/2: its lower
  // edge (the midpoint to the decade below) at x = 1/2, the one between codes k-1 and k at
  // k + 1/2. So with the decade's line x'' = |y| S_e - O_e = x - 1/2 + base_e + kArithMargin,
  // the byte is floor(x''); which line a |y| takes is Note [Quantize by lines]. The thresholds
  // are float roundings of double arithmetic, so x'' misses them by a little: a lane whose x''
  // lies at or less than 2 kArithMargin above an integer is "unsure" and the caller quantizes
  // that vector by the one-step table (quantize8 / quantize16_step). The constructor proves the
  // rest exact (arithmetic_ready()): at every threshold x'' (the same fma) lies within
  // kArithMargin / 2 of its integer + kArithMargin, and x'' rises with |y|, so a sure lane is
  // on the right side of every threshold. (The lift by kArithMargin, in O_e, makes the test one
  // comparison of x'' - floor(x''), one AVX-512 instruction, where a window either side of the
  // integer took a subtraction and an absolute value more: docs/BENCHMARKS.md.) The negative
  // half of the signed map mirrors the positive (threshold[254 - i] = -threshold[i], checked):
  // byte 255 - q, and y <= 0 takes the lower of the two zeros. The unsigned map's negatives and
  // NaN are 0 (max(y, 0) is 0 for both); the signed map's NaN is unsure. No gather: about 17-20
  // register operations per vector, against a gather of ~35 cycles on the Cascade Lake Xeon of
  // issue 39 (docs/BENCHMARKS.md).
  //
  // Note [Quantize by lines]: which line. Decade e's line is right over (10^-(e+1), 10^-e], from
  // the decade below's top code to its own: below its lower edge, down to that code, x'' lies
  // within 1/2 under its first integer and gives the code below; at its top code x'' is the top
  // byte + 1/2. A non-negative float's bits read as an integer are 2^23 (log2 |y| + 127) to
  // within 0.086 of a binade (the mantissa read as linear), so one fma of their conversion and
  // a truncation give an estimate of the span, log10(0.33) - log10 |y| truncated: it moves to
  // the next span at 0.33 10^-e, inside every span with room for the 0.086 binade either side,
  // so it names the span or the one above, and one comparison with the span's lower end (the
  // code 10^-(e+1), as an integer) settles it. The lowest decade's one code gets a line
  // through its lower edge (the midpoint to zero) at base + margin and the code itself at
  // base + 3/4 + margin; it carries down to |y| = 0 at the zero byte (x'' = base - 3/4 +
  // margin), so there is no decade of zeros to mask: eight lines on both maps (the signed map's
  // eighth repeats its seventh). (Its slope sets how wide the unsure window at that edge is:
  // through both of the code's edges, a slope of 1/4 of this, it held 0.3 % of |y| there and
  // half again as many vectors as before were unsure on log-uniform values.) A span's ends are
  // codes, not thresholds, so no tie is rounded there, and x'' is capped at 255.5, the top
  // byte, for |y| >= 1. The constructor proves it (build_lines): each line at every threshold
  // of its span, both ends sure, the estimate at both ends of every span, every line at or
  // over the cap from |y| = 1 up (where a wrapped estimate may pick any line). A y at a
  // threshold is then unsure, ties of either sign included; just under a decade's lower edge,
  // where a cap once made x'' sure, the line above now gives the byte below, unsure within the
  // margin as above the edge. (Until issue 39's session 27 the decade came from a table of 32
  // binades and a comparison with its lower edge, each decade's line capped at its top: seven
  // operations more per vector on AVX2, whose permutes hold 8 entries, and three more for the
  // unsigned map's zeros; docs/BENCHMARKS.md, "adam8bit's AVX2 quantizer by lines".)
  static constexpr float kArithMargin = 1.0f / 4096;
  bool arithmetic_ready() const { return lines_fit; }
  // The estimate's fma (Note [Quantize by lines]), and the cap for |y| >= 1.
  static constexpr float kLineEstimateScale = static_cast<float>(-0.30102999566398120 / 8388608.0);
  static constexpr float kLineEstimateOffset =
      static_cast<float>(127 * 0.30102999566398120 - 0.48148606012211248);  // log10(0.33)
  static constexpr float kLineTop = 255.5f;
  // The estimate as scalar code (the constructor's proof), the vector one's operations in order.
  static int line_estimate(float a) {
    const float f = std::min(std::fma(static_cast<float>(static_cast<int32_t>(to_bits(a))),
                                      kLineEstimateScale, kLineEstimateOffset),
                             7.0f);
    return static_cast<int>(f);
  }
#if defined(__x86_64__)
  __attribute__((target("avx512f,avx512bw,avx512dq"))) __m512i quantize16_arith(
      __m512 y, __mmask16& unsure) const {
    return is_signed_map ? Quantizer16<true>(*this)(y, unsure)
                         : Quantizer16<false>(*this)(y, unsure);
  }
  // quantize16_arith's tables in registers, made per block (a local: kSigned must be the map's),
  // so the kernel's loop neither reloads them nor tests the map's signedness per vector. The
  // eight lines twice over (twice_over).
  template <bool kSigned>
  struct Quantizer16 {
    __m512 scale, offset;
    __m512i edge_above;  // a span's lower end + 1 as an integer: key < it is key <= the end
    __attribute__((target("avx512f"))) explicit Quantizer16(const QuantMap& map)
        : scale(_mm512_castsi512_ps(twice_over(map.line_scale.data()))),
          offset(_mm512_castsi512_ps(twice_over(map.line_offset.data()))),
          edge_above(twice_over(map.line_edge_above.data())) {}
    __attribute__((target("avx512f,avx512bw,avx512dq"), always_inline)) __m512i operator()(
        __m512 y, __mmask16& unsure) const {
      const __m512 zero = _mm512_setzero_ps();
      const __m512 a = kSigned ? _mm512_abs_ps(y) : _mm512_max_ps(y, zero);
      const __m512i magnitude = _mm512_castps_si512(a);
      const __m512i estimate = _mm512_cvttps_epi32(_mm512_min_ps(
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(magnitude), _mm512_set1_ps(kLineEstimateScale),
                          _mm512_set1_ps(kLineEstimateOffset)),
          _mm512_set1_ps(7.0f)));
      const __mmask16 below =
          _mm512_cmpgt_epi32_mask(_mm512_permutexvar_epi32(estimate, edge_above), magnitude);
      const __m512i line = _mm512_mask_add_epi32(estimate, below, estimate, _mm512_set1_epi32(1));
      // A NaN x stays NaN in min (its second operand), so the lane is unsure.
      const __m512 x = _mm512_min_ps(_mm512_set1_ps(kLineTop),
                                     _mm512_fmsub_ps(a, _mm512_permutexvar_ps(line, scale),
                                                     _mm512_permutexvar_ps(line, offset)));
      __m512i q = _mm512_cvttps_epi32(x);
      // x - floor(x), exact (x >= 0 here, below 2^23).
      const __m512 fraction = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      unsure = _mm512_cmp_ps_mask(fraction, _mm512_set1_ps(2 * kArithMargin), _CMP_NGT_UQ);
      if (kSigned)  // y <= 0: the mirror byte (and +-0 the lower zero)
        q = _mm512_mask_xor_epi32(q, _mm512_cmp_ps_mask(y, zero, _CMP_LE_OQ), q,
                                  _mm512_set1_epi32(0xff));
      return q;
    }
  };
  // The same for 8 lanes, by a Quantizer8 (below) made for the call.
  __attribute__((target("avx2,fma"))) __m256i quantize8_arith(__m256 y, int& unsure) const {
    return is_signed_map ? Quantizer8<true>(*this)(y, unsure)
                         : Quantizer8<false>(*this)(y, unsure);
  }
  // quantize8_arith's tables in registers, made per block (a local: kSigned must be the map's).
  template <bool kSigned>
  struct Quantizer8 {
    __m256 scale, offset;
    __m256i edge_above;  // a span's lower end + 1 as an integer: key < it is key <= the end
    __attribute__((target("avx2"))) explicit Quantizer8(const QuantMap& map)
        : scale(_mm256_loadu_ps(map.line_scale.data())),
          offset(_mm256_loadu_ps(map.line_offset.data())),
          edge_above(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(map.line_edge_above.data()))) {}
    __attribute__((target("avx2,fma"), always_inline)) __m256i operator()(__m256 y,
                                                                          int& unsure) const {
      const __m256 zero = _mm256_setzero_ps();
      // |y|; the unsigned map's negatives and NaN are 0 (max returns its second operand).
      const __m256 a =
          kSigned ? _mm256_andnot_ps(_mm256_set1_ps(-0.0f), y) : _mm256_max_ps(y, zero);
      const __m256i magnitude = _mm256_castps_si256(a);
      const __m256i estimate = _mm256_cvttps_epi32(_mm256_min_ps(
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(kLineEstimateScale),
                          _mm256_set1_ps(kLineEstimateOffset)),
          _mm256_set1_ps(7.0f)));
      // At or below the estimated span's lower end: the span below (a true mask is -1).
      const __m256i line = _mm256_sub_epi32(
          estimate, _mm256_cmpgt_epi32(_mm256_permutevar8x32_epi32(edge_above, estimate),
                                       magnitude));
      // A NaN x stays NaN in min (its second operand), so the lane is unsure.
      const __m256 x = _mm256_min_ps(_mm256_set1_ps(kLineTop),
                                     _mm256_fmsub_ps(a, _mm256_permutevar8x32_ps(scale, line),
                                                     _mm256_permutevar8x32_ps(offset, line)));
      __m256i q = _mm256_cvttps_epi32(x);
      const __m256 fraction = _mm256_sub_ps(x, _mm256_cvtepi32_ps(q));  // exact
      unsure = _mm256_movemask_ps(
          _mm256_cmp_ps(fraction, _mm256_set1_ps(2 * kArithMargin), _CMP_NGT_UQ));
      if (kSigned) {  // y <= 0: the mirror byte (and +-0 the lower zero)
        q = _mm256_xor_si256(
            q, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(y, zero, _CMP_LE_OQ)),
                                _mm256_set1_epi32(0xff)));
      }
      return q;
    }
  };
#endif

  // Note [Dequantize by arithmetic]: code[q] without a table of 256 floats. A magnitude code is
  // j in [1, 127] (signed map: q = 128 + j, or 127 - j for its negative) or [1, 255]
  // (unsigned: q = j); its decade has n = 2^floor(log2 j) codes, the one at k = j - n being
  // float(10^-e (0.1 + 0.9 (k+1)/n)) as the constructor rounds it from double. Per decade one
  // fma of k with two floats S, O comes within one ulp below that code; no fma alone is exact
  // (fma(k+1, S, O) missed some code of every decade of 8 or more codes for every S, O within
  // 64 ulps of the obvious ones, tried offline), so a 256-bit table holds each code's missing
  // last bit: code bits = fma bits + fix bit (bit j >> 3 of word j & 7 for AVX2's 8-entry
  // permutes; bit j >> 4 of word j & 15 for AVX-512's 16-entry ones, which read j's low 4 bits
  // with no mask). The decade is the exponent of float(j) (its low 3 bits index 8-entry
  // permutes) and k is float(j) less its exponent's power of two, both
  // exact; j = 0 (the zeros) is masked. The constructor finds S, O per decade and checks all
  // 256 codes (dequantize_ready()); the tests check every byte in every lane. About 15 register
  // operations per vector (20 signed), no memory lookup: AVX2 has no room for 256 floats in
  // registers (16 x 8), and gathers cost ~35 cycles each on the Cascade Lake Xeon of issue 39
  // and more than this arithmetic on its AVX2 EPYC (docs/BENCHMARKS.md). Where they cost less,
  // as on the Sapphire Rapids-class Xeon, the AVX2 kernel gathers instead (Note [Dequantize by
  // gather where gathers are fast] in adam8bit.cpp). With AVX-512 VBMI the table itself is
  // looked up in registers (Note [Dequantize by byte planes], below).
  bool dequantize_ready() const { return dequantize_fits; }
  // The scalar statement of the vector code (the tests hold it to code[]).
  float dequantize_arith(uint8_t q) const {
    int j = q;
    uint32_t sign = 0;
    if (is_signed_map) {
      j = q >= 128 ? q - 128 : 127 - q;
      sign = q >= 128 ? 0u : 0x80000000u;
    }
    if (j == 0) return 0.0f;
    const float jf = static_cast<float>(j);
    const float n = from_bits(to_bits(jf) & 0x7f800000u);
    const int index = static_cast<int>(to_bits(jf) >> 23) & 7;
    const uint32_t fix = (dequant_fix[j & 7] >> (j >> 3)) & 1u;
    const float approx = std::fma(jf - n, dequant_scale[index], dequant_offset[index]);
    return from_bits((to_bits(approx) + fix) | sign);
  }
#if defined(__x86_64__)
  // code[q] for 8 (AVX2) or 16 (AVX-512) bytes as int32 lanes; a Dequantizer is made per block
  // (a local, so its tables stay in registers). kSigned must be the map's.
  template <bool kSigned>
  struct Dequantizer8 {
    __m256 scale, offset;
    __m256i fix;
    __attribute__((target("avx2"))) explicit Dequantizer8(const QuantMap& map)
        : scale(_mm256_loadu_ps(map.dequant_scale.data())),
          offset(_mm256_loadu_ps(map.dequant_offset.data())),
          fix(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(map.dequant_fix.data()))) {}
    __attribute__((target("avx2,fma"), always_inline)) __m256 operator()(__m256i q) const {
      __m256i j = q, sign = _mm256_setzero_si256();
      if (kSigned) {  // j = q - 128, or 127 - q (= ~(q - 128)) below 128
        const __m256i x = _mm256_sub_epi32(q, _mm256_set1_epi32(128));
        const __m256i below = _mm256_srai_epi32(x, 31);
        j = _mm256_xor_si256(x, below);
        sign = _mm256_slli_epi32(below, 31);
      }
      const __m256 jf = _mm256_cvtepi32_ps(j);
      const __m256i jbits = _mm256_castps_si256(jf);
      const __m256 k = _mm256_sub_ps(
          jf, _mm256_castsi256_ps(_mm256_and_si256(jbits, _mm256_set1_epi32(0x7f800000))));
      const __m256i index = _mm256_srli_epi32(jbits, 23);  // permutes read the low 3 bits
      const __m256 approx = _mm256_fmadd_ps(k, _mm256_permutevar8x32_ps(scale, index),
                                            _mm256_permutevar8x32_ps(offset, index));
      const __m256i bit = _mm256_and_si256(
          _mm256_srlv_epi32(_mm256_permutevar8x32_epi32(fix, j), _mm256_srli_epi32(j, 3)),
          _mm256_set1_epi32(1));
      __m256i bits = _mm256_add_epi32(_mm256_castps_si256(approx), bit);
      if (kSigned) bits = _mm256_or_si256(bits, sign);
      bits = _mm256_andnot_si256(_mm256_cmpeq_epi32(j, _mm256_setzero_si256()), bits);
      return _mm256_castsi256_ps(bits);
    }
  };
  // code[q] by one gather from the table itself (Note [Dequantize by gather where gathers are
  // fast] in adam8bit.cpp): Dequantizer8's interface, the table's floats by construction.
  template <bool kSigned>
  struct GatherDequantizer8 {
    const float* table;
    explicit GatherDequantizer8(const QuantMap& map) : table(map.code.data()) {}
    __attribute__((target("avx2"), always_inline)) __m256 operator()(__m256i q) const {
      return _mm256_i32gather_ps(table, q, 4);
    }
  };
  template <bool kSigned>
  struct Dequantizer16 {
    __m512 scale, offset;
    __m512i fix;
    // The 8-entry tables twice over (twice_over).
    __attribute__((target("avx512f"))) explicit Dequantizer16(const QuantMap& map)
        : scale(_mm512_castsi512_ps(twice_over(map.dequant_scale.data()))),
          offset(_mm512_castsi512_ps(twice_over(map.dequant_offset.data()))),
          fix(_mm512_loadu_si512(map.dequant_fix16.data())) {}
    __attribute__((target("avx512f"), always_inline)) __m512 operator()(__m512i q) const {
      __m512i j = q, sign = _mm512_setzero_si512();
      if (kSigned) {
        const __m512i x = _mm512_sub_epi32(q, _mm512_set1_epi32(128));
        const __m512i below = _mm512_srai_epi32(x, 31);
        j = _mm512_xor_si512(x, below);
        sign = _mm512_slli_epi32(below, 31);
      }
      const __m512 jf = _mm512_cvtepi32_ps(j);
      const __m512i jbits = _mm512_castps_si512(jf);
      const __m512 k = _mm512_sub_ps(
          jf, _mm512_castsi512_ps(_mm512_and_si512(jbits, _mm512_set1_epi32(0x7f800000))));
      // 16-entry permutes of the tables twice over: the exponent's bit 3 needs no mask.
      const __m512i index = _mm512_srli_epi32(jbits, 23);
      const __m512 approx = _mm512_fmadd_ps(k, _mm512_permutexvar_ps(index, scale),
                                            _mm512_permutexvar_ps(index, offset));
      // The fix bit from the 16-word table: the permute reads j's low 4 bits itself.
      const __m512i word = _mm512_permutexvar_epi32(j, fix);
      const __m512i bit = _mm512_and_si512(_mm512_srlv_epi32(word, _mm512_srli_epi32(j, 4)),
                                           _mm512_set1_epi32(1));
      __m512i bits = _mm512_add_epi32(_mm512_castps_si512(approx), bit);
      if (kSigned) bits = _mm512_or_si512(bits, sign);
      bits = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(j, j), bits);
      return _mm512_castsi512_ps(bits);
    }
  };

  // Note [Dequantize by byte planes]: with AVX-512 VBMI, code[q] for 64 bytes at once, looked up
  // in the table itself, so every float is code[]'s by construction. The 256 floats are cut
  // into four planes of 256 bytes (plane b holds byte b of every code), each in four registers;
  // a byte permute over two registers (vpermt2b) looks up 128 entries by the byte's low 7 bits,
  // two of them and a blend on bit 7 give a plane's byte for all 64 codes, and two rounds of
  // unpacks put the planes' bytes together as floats. The unpacks work within 128-bit lanes, so
  // one byte permute first orders the codes for them (order, below). 22 operations for 64
  // values, against ~15 (unsigned) and ~20 (signed) for every 16 by arithmetic (Note
  // [Dequantize by arithmetic]): what VBMI CPUs (Ice Lake and later Xeons, AMD Zen 4) run, and
  // 5-6 % off adam8bit's step on the Intel Xeon of issue 39 (docs/BENCHMARKS.md, "adam8bit's
  // codec in fewer operations"). The 32 table registers of two maps do not all fit beside the
  // loop's own: the compiler keeps some in memory, one load each, which the load ports absorb.
  struct PlaneDequantizer64 {
    __m512i table[4][4];  // [plane][quarter]: quarter k holds entries 64 k .. 64 k + 63
    __m512i order;
    __attribute__((target("avx512f,avx512bw"))) explicit PlaneDequantizer64(const QuantMap& map) {
      for (int plane = 0; plane < 4; ++plane)
        for (int quarter = 0; quarter < 4; ++quarter)
          table[plane][quarter] =
              _mm512_loadu_si512(map.code_planes.data() + 256 * plane + 64 * quarter);
      order = _mm512_loadu_si512(kPlaneOrder.data());
    }
    // Codes q[0..63] to out[t] = code[q[16 t .. 16 t + 15]].
    __attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) void operator()(
        __m512i q, __m512* out) const {
      const __m512i ordered = _mm512_permutexvar_epi8(order, q);
      const __mmask64 high = _mm512_movepi8_mask(ordered);  // bit 7: entries 128 and up
      __m512i plane[4];
      for (int b = 0; b < 4; ++b)
        plane[b] = _mm512_mask_blend_epi8(
            high, _mm512_permutex2var_epi8(table[b][0], ordered, table[b][1]),
            _mm512_permutex2var_epi8(table[b][2], ordered, table[b][3]));
      const __m512i low01 = _mm512_unpacklo_epi8(plane[0], plane[1]);
      const __m512i high01 = _mm512_unpackhi_epi8(plane[0], plane[1]);
      const __m512i low23 = _mm512_unpacklo_epi8(plane[2], plane[3]);
      const __m512i high23 = _mm512_unpackhi_epi8(plane[2], plane[3]);
      out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(low01, low23));
      out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(low01, low23));
      out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(high01, high23));
      out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(high01, high23));
    }
  };
  // out[t]'s 128-bit lane l, position p (0-3), comes from byte 16 l + 4 t + p of the permuted
  // codes; it must be code 16 t + 4 l + p: a 4 x 4 transpose of 4-byte groups.
  static constexpr std::array<uint8_t, 64> kPlaneOrder = [] {
    std::array<uint8_t, 64> order{};
    for (int l = 0; l < 4; ++l)
      for (int t = 0; t < 4; ++t)
        for (int p = 0; p < 4; ++p)
          order[16 * l + 4 * t + p] = static_cast<uint8_t>(16 * t + 4 * l + p);
    return order;
  }();
#endif

  // Cells: [0, 2^(kMinExponent-127)) is cell 0, then kCellsPerBinade per binade up to |y| < 2;
  // anything larger (or NaN) is the last cell.
  static constexpr int kCellBits = 5, kCellsPerBinade = 1 << kCellBits;
  static constexpr int kMinExponent = 127 - 32, kMaxExponent = 127;
  static constexpr int kCells = 1 + (kMaxExponent - kMinExponent + 1) * kCellsPerBinade;
  std::array<uint8_t, kCells> first_positive{}, first_negative{};
  int walk_steps = 0;  // the most thresholds any one cell holds (signed map 2, unsigned 3)

 private:
  bool step_cells_fit = true;
  // Note [Quantize by lines]: per line its scale and offset, and its span's lower end + 1 as an
  // integer (0 for the lowest line, whose span reaches 0).
  bool is_signed_map = false, lines_fit = true;
  std::array<float, 8> line_scale{}, line_offset{};
  std::array<int32_t, 8> line_edge_above{};
  // Note [Dequantize by arithmetic]: per decade (by the low 3 bits of float(j)'s exponent) the
  // fma's two floats, and per magnitude j its missing last bit (bit j >> 3 of word j & 7).
  bool dequantize_fits = true;
  std::array<float, 8> dequant_scale{}, dequant_offset{};
  std::array<uint32_t, 8> dequant_fix{};
  std::array<uint32_t, 16> dequant_fix16{};  // dequant_fix's bits as word j & 15, bit j >> 4
  void build_dequantize(bool is_signed) {
    const int bits = is_signed ? 7 : 8, base = is_signed ? 128 : 0;
    for (int log_n = 0; log_n < bits; ++log_n) {
      const int n = 1 << log_n, e = bits - 1 - log_n, index = (127 + log_n) & 7;
      const double scale = std::pow(10.0, -e);
      const float slope = static_cast<float>(scale * 0.9 / n);
      const float start = static_cast<float>(scale * 0.1) + slope;  // the code at k = 0
      // The first S, O (nearest the obvious ones, ulp by ulp) whose fma lies at or one ulp
      // below every code of the decade.
      bool found = false;
      for (int radius = 0; radius <= 4 && !found; ++radius)
        for (int ds = -radius; ds <= radius && !found; ++ds)
          for (int dof = -radius; dof <= radius && !found; ++dof) {
            if (std::max(std::abs(ds), std::abs(dof)) != radius) continue;
            const float s = from_bits(to_bits(slope) + static_cast<uint32_t>(ds));
            const float o = from_bits(to_bits(start) + static_cast<uint32_t>(dof));
            bool fits = true;
            for (int k = 0; k < n && fits; ++k) {
              const uint32_t want = to_bits(code[base + n + k]);
              const uint32_t got = to_bits(std::fma(static_cast<float>(k), s, o));
              fits = want == got || want == got + 1;
            }
            if (!fits) continue;
            found = true;
            dequant_scale[index] = s;
            dequant_offset[index] = o;
            for (int k = 0; k < n; ++k) {
              const int j = n + k;
              if (to_bits(code[base + j]) != to_bits(std::fma(static_cast<float>(k), s, o)))
                dequant_fix[j & 7] |= 1u << (j >> 3);
            }
          }
      if (!found) dequantize_fits = false;
    }
    // The same fix bits laid out for AVX-512's 16-entry permutes.
    for (int j = 0; j < 256; ++j)
      if ((dequant_fix[j & 7] >> (j >> 3)) & 1u) dequant_fix16[j & 15] |= 1u << (j >> 4);
    // The proof: every byte's arithmetic code is the table's, bit for bit.
    for (int q = 0; q < 256; ++q)
      if (to_bits(dequantize_arith(static_cast<uint8_t>(q))) != to_bits(code[q]))
        dequantize_fits = false;
  }
  // Note [Quantize by arithmetic], Note [Quantize by lines]: the lines, and the proofs that make
  // the quantizers exact wherever they are sure.
  void build_lines(bool is_signed) {
    is_signed_map = is_signed;
    const int decades = is_signed ? 7 : 8, zero_byte = is_signed ? 128 : 0;
    auto base_of = [&](int e) { return zero_byte + (1 << (decades - 1 - e)); };
    auto count_of = [&](int e) { return 1 << (decades - 1 - e); };
    // Line e's span is (decade e + 1's top code, decade e's top code]; the lowest reaches 0.
    auto top_code = [&](int e) { return code[base_of(e) + count_of(e) - 1]; };
    for (int e = 0; e < 8; ++e) {
      const int line = std::min(e, decades - 1);
      const int base = base_of(line), n = count_of(line);
      if (n > 1) {  // x'' = (|y| 10^e - 0.1) n / 0.9 - 1/2 + base + margin
        line_scale[e] = static_cast<float>(std::pow(10.0, line) * n / 0.9);
        line_offset[e] = static_cast<float>(0.1 * n / 0.9 + 0.5 - base - kArithMargin);
      } else {  // through its lower edge at base + margin and its code at base + 3/4 + margin
        const double low = threshold[base - 1], top = code[base];
        const double slope = 0.75 / (top - low);
        line_scale[e] = static_cast<float>(slope);
        line_offset[e] = static_cast<float>(low * slope - base - kArithMargin);
      }
      line_edge_above[e] =
          line < decades - 1 ? static_cast<int32_t>(to_bits(top_code(line + 1)) + 1) : 0;
    }
    auto x_of = [&](int e, float a) { return std::fma(a, line_scale[e], -line_offset[e]); };
    // x'' at a span's end, where no threshold lies: that byte, and sure.
    auto sure_at = [&](float x, int byte) {
      return std::floor(x) == static_cast<float>(byte) && x - std::floor(x) > 2 * kArithMargin;
    };
    for (int e = 0; e < decades; ++e) {
      const int base = base_of(e), n = count_of(e);
      // Every threshold of the span: its lower edge and those between its codes.
      for (int k = 0; k < n; ++k) {
        const float x = x_of(e, threshold[base - 1 + k]);
        if (!(std::fabs(x - (static_cast<float>(base + k) + kArithMargin)) <= kArithMargin / 2))
          lines_fit = false;
      }
      // The span's ends: the code below the lower edge, the top code.
      const float low_end = e < decades - 1 ? top_code(e + 1) : 0.0f;
      if (!sure_at(x_of(e, low_end), base - 1)) lines_fit = false;
      if (!sure_at(std::min(kLineTop, x_of(e, top_code(e))), base + n - 1)) lines_fit = false;
      // The estimate: the span's own or the one above over the span (it falls as |y| rises).
      if (e < decades - 1 && line_estimate(std::nextafter(low_end, 2.0f)) > e) lines_fit = false;
      if (line_estimate(top_code(e)) < std::max(e - 1, 0)) lines_fit = false;
    }
    // From |y| = 1 up (and where the estimate wraps, past 3), every line is at or above the cap.
    for (int e = 0; e < 8; ++e)
      if (!(x_of(e, 1.0f) >= kLineTop)) lines_fit = false;
    if (is_signed)  // the negative half mirrors the positive
      for (int i = 0; i < 255; ++i)
        if (!(threshold[254 - i] == -threshold[i])) lines_fit = false;
  }
  static float from_bits(uint32_t bits) {
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
  }
  static uint32_t to_bits(float x) {
    uint32_t out;
    std::memcpy(&out, &x, sizeof out);
    return out;
  }
  // Note [Quantize in one step]: each cell's entry for either sign.
  void build_step_cells() {
    for (int cell = 0; cell < kStepCells; ++cell) {
      // The cell's magnitudes: [lo, hi).
      float lo = 0.0f, hi = from_bits(static_cast<uint32_t>(kStepMinExponent) << 23);
      if (cell == kStepCells - 1) {
        lo = 2.0f;
        hi = std::numeric_limits<float>::infinity();
      } else if (cell > 0) {
        const uint32_t low_bits =
            (static_cast<uint32_t>(cell - 1) + (static_cast<uint32_t>(kStepMinExponent) << kStepBits))
            << 16;
        lo = from_bits(low_bits);
        hi = from_bits(low_bits + (1u << 16));
      }
      // Where threshold t sits in the cell: 0 for cell 0, whose only threshold may be 0.
      auto offset_of = [&](float t) -> int32_t {
        const float magnitude = std::fabs(t);
        if (cell == 0) {
          if (magnitude != 0.0f) step_cells_fit = false;
          return 0;
        }
        return static_cast<int32_t>(to_bits(magnitude) - to_bits(lo));
      };
      auto entry = [](int base, int32_t offset) {
        return static_cast<int32_t>(static_cast<uint32_t>(base) |
                                    static_cast<uint32_t>(offset) << 8);
      };
      // y in [lo, hi): the thresholds below lo, and those in [lo, hi).
      const int below_lo = below(lo), in_positive = below(hi) - below_lo;
      // y in (-hi, -lo]: the thresholds at or below -hi, and those in (-hi, -lo].
      const int upto_hi = at_most(-hi), in_negative = at_most(-lo) - upto_hi;
      if (in_positive > 1 || in_negative > 1) step_cells_fit = false;
      step_cell[2 * cell] = entry(below_lo, in_positive ? offset_of(threshold[below_lo]) : 1 << 16);
      step_cell[2 * cell + 1] =
          entry(upto_hi, ~(in_negative ? offset_of(threshold[upto_hi]) : 0));
    }
  }
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
