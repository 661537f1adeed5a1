// adam8bit: AdamW with blockwise dynamically quantized 8-bit state (Dettmers et al. 2021). A
// fused CPU kernel (dequantize -> update -> requantize per block, in one pass over the data)
// and a tensor-op path for other devices. Small tensors keep fp32 state.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "loom/kernel_isa.h"
#include "loom/prefetch.h"
#include "quantize.h"
#include "rules.h"
#if defined(LOOM_OPTIM_CUDA_KERNELS)
#include <c10/core/DeviceGuard.h>

#include "cuda/adam8bit_launch.h"
#endif

namespace loom::optim {
namespace {

// adamw_element, the AdamW arithmetic: adam8bit_element.h (which the CUDA kernel compiles too).
using Coefficients = Adam8bitCoefficients;

// One block of update_fused: dequantize m and v, update p, m, v, keep the new m, v in a
// block-sized buffer (L1-resident), take their absmax, requantize.
struct Block {
  float* p;
  const float* g;
  uint8_t *qm, *qv;
  float *am, *av;  // the block's absmax of m and of v
  int64_t len;
};

// Elements [from, to) of a block, one at a time: dequantize, update, keep m and v, fold them
// into the running absmax (new_am, new_av).
inline void update_range(const Block& b, const Coefficients& c, float* mbuf, float* vbuf,
                         int64_t from, int64_t to, float& new_am, float& new_av) {
  const QuantMap& ms = signed_map();
  const QuantMap& vs = unsigned_map();
  for (int64_t i = from; i < to; ++i) {
    float m = ms.code[b.qm[i]] * *b.am, v = vs.code[b.qv[i]] * *b.av;
    adamw_element(b.p[i], b.g[i], m, v, c);
    mbuf[i] = m;
    vbuf[i] = v;
    new_am = std::max(new_am, std::fabs(m));
    new_av = std::max(new_av, v);
  }
}
inline void requantize_range(const Block& b, const float* mbuf, const float* vbuf, int64_t from,
                             int64_t to, float inv_m, float inv_v) {
  for (int64_t i = from; i < to; ++i) {
    b.qm[i] = signed_map().quantize_fast(mbuf[i] * inv_m);
    b.qv[i] = unsigned_map().quantize_fast(vbuf[i] * inv_v);
  }
}
inline float inverse(float absmax) { return absmax > 0 ? 1.0f / absmax : 0.0f; }

void block_scalar(const Block& b, const Coefficients& c, float* mbuf, float* vbuf) {
  float new_am = 0.0f, new_av = 0.0f;
  update_range(b, c, mbuf, vbuf, 0, b.len, new_am, new_av);
  requantize_range(b, mbuf, vbuf, 0, b.len, inverse(new_am), inverse(new_av));
  *b.am = new_am;
  *b.av = new_av;
}

// LOOM_ADAM8BIT_DEQUANTIZE (Note [Dequantize by gather where gathers are fast]): read on every
// step, and by the rule's constructor, so `loom check` and `loom run` refuse a bad value before
// a job writes anything.
enum class Dequantize { kTimed, kGather, kArithmetic };
Dequantize forced_dequantizer() {
  const char* forced = std::getenv("LOOM_ADAM8BIT_DEQUANTIZE");
  if (!forced || !*forced) return Dequantize::kTimed;
  const std::string value(forced);
  if (value == "gather") return Dequantize::kGather;
  if (value == "arithmetic") return Dequantize::kArithmetic;
  throw ConfigError("environment variable LOOM_ADAM8BIT_DEQUANTIZE='" + value +
                    "' is unknown; use gather or arithmetic, or unset it to let the first AVX2 "
                    "step time both on this CPU");
}

#if defined(__x86_64__)
// Note [adam8bit in vectors]: block_scalar 16 (AVX-512) or 8 (AVX2) elements per instruction.
// Every byte and float equals the scalar kernel's (the optimizer tests compare all three bit
// for bit, on any CPU: Note [Kernel ISA cap]):
// - AdamW's arithmetic runs in the scalar kernel's order (the build has -ffp-contract=off, and
//   sqrt and division round alike in every width);
// - the absmax is kept as std::max keeps it (a NaN never enters; max is order-free otherwise);
// - dequantizing is code[q] · absmax, the code from the byte's own arithmetic (Note [Dequantize
//   by arithmetic] in quantize.h: one fma and a bit from a register table, no gather), in the
//   loop that updates the moments, on both widths; on CPUs with AVX-512 VBMI the AVX-512
//   path's first loop looks 64 codes up at once in the table's byte planes instead (Note
//   [Dequantize by byte planes]: 22 operations, not ~35 x 4), runs of under 64 by arithmetic;
//   the AVX2 path gathers them from the table where gathers are the faster (Note [Dequantize
//   by gather where gathers are fast]);
// - requantizing follows Note [Quantize by arithmetic] and Note [Quantize by lines], the
//   code from the float's bits and one fused multiply-subtract, no gather; the rare vector with
//   a lane too close to a threshold for that arithmetic to be sure (about 1 in 800 in
//   training) takes Note [Quantize in one step]'s gather, the same byte as quantize_fast
//   either way. (quantize()'s binary search
//   with its thresholds in registers, twelve permutes per 16 values, was measured slower than
//   the gather on the Xeon of issue 39: docs/BENCHMARKS.md.) Both widths run a block in two
//   loops (Note [adam8bit's divisions beside the quantizer]).
// A tail of fewer than a vector runs scalar.

// Note [adam8bit's divisions beside the quantizer]: a loop doing all of a vector's work (the
// dequantizing arithmetic, the moments, then square root, division, add and division) is one
// chain of ~80 cycles in 80-150 instructions, so the reorder buffer (224 entries on the Xeon
// of issue 39) held one to three iterations and the loop waited on latency, not on ports. So a
// block runs two loops whose chains are short and independent across iterations: (1) dequantize
// and the moments, kept in the block buffers (L1) with their absmax; (2) the parameter's
// division chain from the buffers, beside the requantization of the same moments, so the
// divider works while the quantizer's arithmetic takes the other ports. Each value is made by
// the operations block_scalar uses, in its order, so the bytes and floats stay its. (Until
// issue 39's fourth session AVX-512 ran one fused loop per block, requantizing the block before
// in it, and AVX2 a fused update loop and a requantizing loop: docs/BENCHMARKS.md.)

// 16 moments of each kind scaled by their block's inverse absmax and written as codes: by
// arithmetic, or by the one-step table where a lane lies too close to a threshold (Note
// [Quantize by arithmetic] in quantize.h).
__attribute__((target("avx512f,avx512bw,avx512dq"), always_inline)) inline void requantize16(
    const QuantMap::Quantizer16<true>& quantize_m, const QuantMap::Quantizer16<false>& quantize_v,
    __m512 m, __m512 v, __m512 scale_m, __m512 scale_v, uint8_t* qm_out, uint8_t* qv_out) {
  const __m512 ym = _mm512_mul_ps(m, scale_m);
  const __m512 yv = _mm512_mul_ps(v, scale_v);
  __mmask16 unsure_m, unsure_v;
  __m512i qm = quantize_m(ym, unsure_m);
  __m512i qv = quantize_v(yv, unsure_v);
  if (__builtin_expect(unsure_m != 0, 0)) qm = signed_map().quantize16_step(ym);
  if (__builtin_expect(unsure_v != 0, 0)) qv = unsigned_map().quantize16_step(yv);
  // Both vectors' int32 codes (each in [0, 255]) to bytes in three shuffles, where two
  // down-conversions (vpmovdb) take two each, all on the one shuffle port of the Xeon of
  // issue 39: per 128-bit lane l the packs leave m's codes 4l..4l+3 in dword 4l and v's in
  // dword 4l + 1, and one permute gathers m's four dwords, then v's, into the low 256 bits.
  const __m512i words = _mm512_packus_epi32(qm, qv);
  const __m512i bytes = _mm512_packus_epi16(words, words);
  const __m256i both = _mm512_castsi512_si256(_mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), bytes));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qm_out), _mm256_castsi256_si128(both));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qv_out), _mm256_extracti128_si256(both, 1));
}

// m / (sqrt(v) / bc2 + eps), AdamW's arithmetic in the scalar kernel's order.
//
// Note [A bias correction of one]: bc2 = sqrt(1 - beta2^t) rounds to 1.0f once beta2^t < 2^-24:
// after ~330 steps at beta2 = 0.95 (the usual LLM setting), ~1,700 at 0.99, ~16,600 at 0.999,
// so for most of a run. Then sqrt(v) / bc2 is sqrt(v) exactly (x / 1 is x for every float, and
// sqrt never returns a subnormal that a flush could change), and the kernels skip that division:
// kUnitBc2, chosen per block from the step's constant. Half the divisions of the second loop,
// where the divider is busiest (docs/BENCHMARKS.md, "adam8bit's codec in fewer operations").
template <bool kUnitBc2>
__attribute__((target("avx2"), always_inline)) inline __m256 divide_by_denominator(
    __m256 m, __m256 v, __m256 bc2, __m256 eps) {
  const __m256 root = _mm256_sqrt_ps(v);
  return _mm256_div_ps(m, _mm256_add_ps(kUnitBc2 ? root : _mm256_div_ps(root, bc2), eps));
}

// Note [adam8bit's streams prefetched]: both loops ask for their streams kPrefetchAhead elements
// before they read them (Note [Streams prefetched ahead] in loom/prefetch.h): the first loop g
// and the two code arrays, the second p, which it reads, scales and writes back. These loops
// spend 3-4 cycles an element on the codec's arithmetic between their loads, and the hardware's
// prefetcher alone did not keep their streams ahead: on the Intel Xeon with AMX, 40 M
// parameters, one thread, AVX-512, the step fell from 2.28 to 1.36 ns a parameter
// (docs/BENCHMARKS.md, "Streams prefetched ahead"; p prefetched by the first loop instead
// did less). An fp32 line holds 16 elements, a code line 64; on the last block the lines past
// the end go unused.
using cpu::prefetch_ahead;

// The moments' running maxima in block_avx512's first loop: m's absmax as max(most, -least),
// one operation a vector, not an absolute value and a max.
struct Maxima16 {
  __m512 most_m, least_m, most_v;
};

// The first loop's work on 16 elements once their codes are floats: scale by the block's
// absmax, update the moments with the gradient, keep them in the block buffers, fold them into
// the maxima. Shared by the arithmetic and the byte-plane loops.
struct MomentUpdate16 {
  __m512 w1, b2, w2, absmax_m, absmax_v;
  __attribute__((target("avx512f"))) MomentUpdate16(const Block& b, const Coefficients& c)
      : w1(_mm512_set1_ps(c.w1)),
        b2(_mm512_set1_ps(c.b2)),
        w2(_mm512_set1_ps(c.w2)),
        absmax_m(_mm512_set1_ps(*b.am)),
        absmax_v(_mm512_set1_ps(*b.av)) {}
  __attribute__((target("avx512f"), always_inline)) void operator()(
      __m512 code_m, __m512 code_v, const float* g, float* m_out, float* v_out,
      Maxima16& most) const {
    __m512 m = _mm512_mul_ps(code_m, absmax_m);
    __m512 v = _mm512_mul_ps(code_v, absmax_v);
    const __m512 grad = _mm512_loadu_ps(g);
    m = _mm512_add_ps(m, _mm512_mul_ps(w1, _mm512_sub_ps(grad, m)));
    v = _mm512_add_ps(_mm512_mul_ps(b2, v), _mm512_mul_ps(_mm512_mul_ps(w2, grad), grad));
    _mm512_storeu_ps(m_out, m);
    _mm512_storeu_ps(v_out, v);
    // max_ps(x, most) returns `most` where x is NaN, as std::max(most, x) does.
    most.most_m = _mm512_max_ps(m, most.most_m);
    most.least_m = _mm512_min_ps(m, most.least_m);
    most.most_v = _mm512_max_ps(v, most.most_v);
  }
};

// block_avx512's first loop over elements [from, to) (whole vectors): dequantize m and v by
// arithmetic, update them, keep them in the block buffers and fold them into `most`.
__attribute__((target("avx512f,avx512bw,avx512dq"), always_inline)) inline void
update_vectors16(const Block& b, const Coefficients& c, float* mbuf, float* vbuf, int64_t from,
                 int64_t to, Maxima16& most) {
  // Locals, not b's fields: a float store could alias `b`, which the loop would then reload.
  const float* const g = b.g;
  const uint8_t* const qm = b.qm;
  const uint8_t* const qv = b.qv;
  const MomentUpdate16 update(b, c);
  const QuantMap::Dequantizer16<true> code_m(signed_map());
  const QuantMap::Dequantizer16<false> code_v(unsigned_map());
  Maxima16 local = most;  // a local, so the loop keeps it in registers
  for (int64_t i = from; i < to; i += 16) {
    prefetch_ahead(g + i);
    if ((i & 63) == 0) {
      prefetch_ahead(qm + i);
      prefetch_ahead(qv + i);
    }
    update(code_m(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qm + i)))),
           code_v(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qv + i)))),
           g + i, mbuf + i, vbuf + i, local);
  }
  most = local;
}

// block_avx512's second loop over the first `whole` elements: the parameter's update beside
// the requantization of the moments kept in the block buffers.
template <bool kUnitBc2>
__attribute__((target("avx512f,avx512bw,avx512dq"), always_inline)) inline void
update_and_requantize16(const Block& b, const Coefficients& c, const float* mbuf,
                        const float* vbuf, int64_t whole, float inv_m, float inv_v) {
  float* const p = b.p;
  uint8_t* const qm = b.qm;
  uint8_t* const qv = b.qv;
  const __m512 decay = _mm512_set1_ps(c.decay), step = _mm512_set1_ps(c.step_size),
               scale_m = _mm512_set1_ps(inv_m), scale_v = _mm512_set1_ps(inv_v);
  const __m256 bc2 = _mm256_set1_ps(c.bc2_sqrt), eps = _mm256_set1_ps(c.eps);
  const QuantMap::Quantizer16<true> quantize_m(signed_map());
  const QuantMap::Quantizer16<false> quantize_v(unsigned_map());
  for (int64_t i = 0; i < whole; i += 16) {
    prefetch_ahead(p + i);
    const __m512 m = _mm512_loadu_ps(mbuf + i), v = _mm512_loadu_ps(vbuf + i);
    // In two halves: 256-bit divisions and square roots cost 26 cycles per 16 values on the
    // Xeon of issue 39 against 32 at 512 bits (the same roundings). The high halves are
    // loaded again rather than extracted: a load port is free, the shuffle port is not.
    const __m256 low = divide_by_denominator<kUnitBc2>(_mm512_castps512_ps256(m),
                                                       _mm512_castps512_ps256(v), bc2, eps);
    const __m256 high = divide_by_denominator<kUnitBc2>(
        _mm256_loadu_ps(mbuf + i + 8), _mm256_loadu_ps(vbuf + i + 8), bc2, eps);
    const __m512 ratio = _mm512_insertf32x8(_mm512_castps256_ps512(low), high, 1);
    _mm512_storeu_ps(p + i, _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(p + i), decay),
                                          _mm512_mul_ps(step, ratio)));
    requantize16(quantize_m, quantize_v, m, v, scale_m, scale_v, qm + i, qv + i);
  }
}

// What follows block_avx512's first loop: the tail, the new absmax, and the second loop (the
// parameter's update beside the requantization) over the first `whole` elements.
__attribute__((target("avx512f,avx512bw,avx512dq"), always_inline)) inline void
finish_block16(const Block& b, const Coefficients& c, float* mbuf, float* vbuf, int64_t whole,
               const Maxima16& most) {
  // Both folds start from +0, which no ±0 displaces, so an all-zero block's absmax is +0.
  float new_am = std::max(_mm512_reduce_max_ps(most.most_m), -_mm512_reduce_min_ps(most.least_m));
  float new_av = _mm512_reduce_max_ps(most.most_v);
  update_range(b, c, mbuf, vbuf, whole, b.len, new_am, new_av);  // the tail, p included
  const float inv_m = inverse(new_am), inv_v = inverse(new_av);
  if (c.bc2_sqrt == 1.0f) {  // Note [A bias correction of one]
    update_and_requantize16<true>(b, c, mbuf, vbuf, whole, inv_m, inv_v);
  } else {
    update_and_requantize16<false>(b, c, mbuf, vbuf, whole, inv_m, inv_v);
  }
  requantize_range(b, mbuf, vbuf, whole, b.len, inv_m, inv_v);
  *b.am = new_am;
  *b.av = new_av;
}

// One block on AVX-512, in two loops (Note [adam8bit's divisions beside the quantizer]).
// (avx512vl lets the 256-bit divisions use all 32 registers: without it each half moved to
// one of the first 16 by an instruction of its own.)
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))) void block_avx512(
    const Block& b, const Coefficients& c, float* mbuf, float* vbuf) {
  const int64_t whole = b.len / 16 * 16;
  Maxima16 most{_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  update_vectors16(b, c, mbuf, vbuf, 0, whole, most);
  finish_block16(b, c, mbuf, vbuf, whole, most);
}

// block_avx512 with its first loop dequantizing 64 codes at a time by byte planes (Note
// [Dequantize by byte planes] in quantize.h), for CPUs with AVX-512 VBMI; the same floats and
// bytes, as the dequantized codes are code[]'s either way.
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi"))) void block_avx512_vbmi(
    const Block& b, const Coefficients& c, float* mbuf, float* vbuf) {
  const float* const g = b.g;
  const uint8_t* const qm = b.qm;
  const uint8_t* const qv = b.qv;
  const int64_t whole64 = b.len / 64 * 64, whole = b.len / 16 * 16;
  Maxima16 most{_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  {
    const MomentUpdate16 update(b, c);
    const QuantMap::PlaneDequantizer64 code_m(signed_map());
    const QuantMap::PlaneDequantizer64 code_v(unsigned_map());
    for (int64_t i = 0; i < whole64; i += 64) {
      prefetch_ahead(qm + i);
      prefetch_ahead(qv + i);
      __m512 ms[4], vs[4];
      code_m(_mm512_loadu_si512(qm + i), ms);
      code_v(_mm512_loadu_si512(qv + i), vs);
      for (int t = 0; t < 4; ++t) {
        const int64_t at = i + 16 * t;
        prefetch_ahead(g + at);
        update(ms[t], vs[t], g + at, mbuf + at, vbuf + at, most);
      }
    }
  }
  update_vectors16(b, c, mbuf, vbuf, whole64, whole, most);
  finish_block16(b, c, mbuf, vbuf, whole, most);
}

// Eight int32 codes of each state (each in [0, 255]) to eight bytes each: three shuffles for
// both, not four each (they share port 5 with the permutes on the Xeon of issue 39).
__attribute__((target("avx2"))) inline void store8_codes(uint8_t* out_m, uint8_t* out_v,
                                                         __m256i qm, __m256i qv) {
  const __m256i words = _mm256_packus_epi32(qm, qv);        // per half: m0-3 v0-3 | m4-7 v4-7
  const __m256i bytes = _mm256_packus_epi16(words, words);  // dwords: m0-3 v0-3 m0-3 v0-3 | ...
  const __m128i both = _mm256_castsi256_si128(  // m0-3 m4-7 v0-3 v4-7
      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0)));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out_m), both);
  _mm_storeh_pd(reinterpret_cast<double*>(out_v), _mm_castsi128_pd(both));
}

// 8 moments of each kind scaled and written as codes (requantize16's AVX2 twin).
template <typename QuantizeM, typename QuantizeV>
__attribute__((target("avx2,fma"), always_inline)) inline void requantize8(
    const QuantizeM& quantize_m, const QuantizeV& quantize_v, __m256 m, __m256 v,
    __m256 scale_m, __m256 scale_v, uint8_t* qm_out, uint8_t* qv_out) {
  const __m256 ym = _mm256_mul_ps(m, scale_m);
  const __m256 yv = _mm256_mul_ps(v, scale_v);
  int unsure_m, unsure_v;
  __m256i qm = quantize_m(ym, unsure_m);
  __m256i qv = quantize_v(yv, unsure_v);
  if (__builtin_expect(unsure_m != 0, 0)) qm = signed_map().quantize8(ym);
  if (__builtin_expect(unsure_v != 0, 0)) qv = unsigned_map().quantize8(yv);
  store8_codes(qm_out, qv_out, qm, qv);
}

// The largest lane, as std::max folds them from 0 (no lane holds a NaN).
__attribute__((target("avx2"))) inline float lanes_max(__m256 most) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, most);
  float out = 0.0f;
  for (float x : lanes) out = std::max(out, x);
  return out;
}

// block_avx2's second loop (update_and_requantize16's AVX2 twin).
template <bool kUnitBc2>
__attribute__((target("avx2,fma"), always_inline)) inline void update_and_requantize8(
    const Block& b, const Coefficients& c, const float* mbuf, const float* vbuf, int64_t whole,
    float inv_m, float inv_v) {
  float* const p = b.p;
  uint8_t* const qm = b.qm;
  uint8_t* const qv = b.qv;
  const __m256 decay = _mm256_set1_ps(c.decay), bc2 = _mm256_set1_ps(c.bc2_sqrt),
               eps = _mm256_set1_ps(c.eps), step = _mm256_set1_ps(c.step_size),
               scale_m = _mm256_set1_ps(inv_m), scale_v = _mm256_set1_ps(inv_v);
  const QuantMap::Quantizer8<true> quantize_m(signed_map());
  const QuantMap::Quantizer8<false> quantize_v(unsigned_map());
  for (int64_t i = 0; i < whole; i += 8) {
    if ((i & 15) == 0) prefetch_ahead(p + i);
    const __m256 m = _mm256_loadu_ps(mbuf + i), v = _mm256_loadu_ps(vbuf + i);
    _mm256_storeu_ps(p + i, _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + i), decay),
                                          _mm256_mul_ps(step, divide_by_denominator<kUnitBc2>(
                                                                  m, v, bc2, eps))));
    requantize8(quantize_m, quantize_v, m, v, scale_m, scale_v, qm + i, qv + i);
  }
}

// One block on AVX2, in two loops (Note [adam8bit's divisions beside the quantizer]), its codes
// dequantized by `Dequantizer` (Note [Dequantize by gather where gathers are fast]).
template <template <bool> class Dequantizer>
__attribute__((target("avx2,fma"))) void block_avx2_with(const Block& b, const Coefficients& c,
                                                         float* mbuf, float* vbuf) {
  // Locals, not b's fields: a float store could alias `b`, which the loop would then reload.
  const float* const g = b.g;
  const uint8_t* const qm = b.qm;
  const uint8_t* const qv = b.qv;
  const int64_t whole = b.len / 8 * 8;
  // m's absmax as max(most, -least), as block_avx512 keeps it.
  __m256 most_m = _mm256_setzero_ps(), least_m = _mm256_setzero_ps(), most_v = most_m;
  {
    const __m256 w1 = _mm256_set1_ps(c.w1), b2 = _mm256_set1_ps(c.b2), w2 = _mm256_set1_ps(c.w2),
                 absmax_m = _mm256_set1_ps(*b.am), absmax_v = _mm256_set1_ps(*b.av);
    const Dequantizer<true> code_m(signed_map());
    const Dequantizer<false> code_v(unsigned_map());
    for (int64_t i = 0; i < whole; i += 8) {
      if ((i & 15) == 0) prefetch_ahead(g + i);
      if ((i & 63) == 0) {
        prefetch_ahead(qm + i);
        prefetch_ahead(qv + i);
      }
      const __m256i im =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qm + i)));
      const __m256i iv =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qv + i)));
      __m256 m = _mm256_mul_ps(code_m(im), absmax_m);
      __m256 v = _mm256_mul_ps(code_v(iv), absmax_v);
      const __m256 grad = _mm256_loadu_ps(g + i);
      m = _mm256_add_ps(m, _mm256_mul_ps(w1, _mm256_sub_ps(grad, m)));
      v = _mm256_add_ps(_mm256_mul_ps(b2, v), _mm256_mul_ps(_mm256_mul_ps(w2, grad), grad));
      _mm256_storeu_ps(mbuf + i, m);
      _mm256_storeu_ps(vbuf + i, v);
      // max_ps(x, most) returns `most` where x is NaN, as std::max(most, x) does.
      most_m = _mm256_max_ps(m, most_m);
      least_m = _mm256_min_ps(m, least_m);
      most_v = _mm256_max_ps(v, most_v);
    }
  }
  // -least's largest lane is -(least's smallest); a +0 from the fold's start wins a tie with -0.
  float new_am = std::max(lanes_max(most_m),
                          lanes_max(_mm256_xor_ps(least_m, _mm256_set1_ps(-0.0f))));
  float new_av = lanes_max(most_v);
  update_range(b, c, mbuf, vbuf, whole, b.len, new_am, new_av);  // the tail, p included
  const float inv_m = inverse(new_am), inv_v = inverse(new_av);
  if (c.bc2_sqrt == 1.0f) {  // Note [A bias correction of one]
    update_and_requantize8<true>(b, c, mbuf, vbuf, whole, inv_m, inv_v);
  } else {
    update_and_requantize8<false>(b, c, mbuf, vbuf, whole, inv_m, inv_v);
  }
  requantize_range(b, mbuf, vbuf, whole, b.len, inv_m, inv_v);
  *b.am = new_am;
  *b.av = new_av;
}
void block_avx2(const Block& b, const Coefficients& c, float* mbuf, float* vbuf) {
  block_avx2_with<QuantMap::Dequantizer8>(b, c, mbuf, vbuf);
}
void block_avx2_gather(const Block& b, const Coefficients& c, float* mbuf, float* vbuf) {
  block_avx2_with<QuantMap::GatherDequantizer8>(b, c, mbuf, vbuf);
}

// Note [Dequantize by gather where gathers are fast]: the AVX2 first loop can look the codes up
// in code[] by a gather (one instruction and eight loads) or compute them (Note [Dequantize by
// arithmetic]: ~15-20 register operations); both give code[]'s floats, so the choice is only
// speed, and gathers differ by an order between CPUs: on the Intel Xeon of issue 39 (Sapphire
// Rapids-class) two gathers cost 2.2-2.4 ns per 8 elements against the arithmetic's 3.2-3.6,
// on the AVX2-only AMD EPYC of issue 39 7.1 ns against 4.8, and Intel cores with the Gather
// Data Sampling microcode run them several times slower again (docs/BENCHMARKS.md, "adam8bit's
// AVX2 quantizer by lines"). So the first AVX2 step times both over 4096 codes of each map in
// L1, best of five rounds interleaved (about 0.1 ms), and gathers only where they are faster
// by more than a tenth. LOOM_ADAM8BIT_DEQUANTIZE = gather | arithmetic forces either, read on
// every step like LOOM_KERNEL_ISA, so the tests hold both to the scalar kernel on any CPU.
template <template <bool> class Dequantizer>
__attribute__((target("avx2,fma"))) double dequantize_seconds(const uint8_t* codes, float* out,
                                                              int64_t count) {
  const Dequantizer<true> code_m(signed_map());
  const Dequantizer<false> code_v(unsigned_map());
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < count; i += 8) {
    const __m256i q =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
    _mm256_storeu_ps(out + i, code_m(q));
    _mm256_storeu_ps(out + count + i, code_v(q));
  }
  asm volatile("" : : "r"(out) : "memory");  // the stores are the work: keep them
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
bool gathers_faster() {
  constexpr int64_t kCodes = 4096;
  std::vector<uint8_t> codes(kCodes);
  uint32_t state = 12345;
  for (uint8_t& q : codes) q = static_cast<uint8_t>((state = state * 1664525u + 1013904223u) >> 24);
  std::vector<float> out(2 * kCodes);
  double arithmetic = 1e30, gather = 1e30;
  for (int round = 0; round < 5; ++round) {
    arithmetic = std::min(arithmetic, dequantize_seconds<QuantMap::Dequantizer8>(
                                          codes.data(), out.data(), kCodes));
    gather = std::min(gather, dequantize_seconds<QuantMap::GatherDequantizer8>(
                                  codes.data(), out.data(), kCodes));
  }
  return gather < 0.9 * arithmetic;
}
bool avx2_dequantizes_by_gather() {
  const Dequantize forced = forced_dequantizer();
  if (forced != Dequantize::kTimed) return forced == Dequantize::kGather;
  static const bool faster = gathers_faster();  // timed once, only when not forced
  return faster;
}
#endif

// The path this CPU runs, capped by LOOM_KERNEL_ISA (Note [Kernel ISA cap]: the tests compare
// all three); the vector paths need the maps' one-step and arithmetic quantizers.
cpu::KernelIsa kernel_path() {
#if defined(__x86_64__)
  static const bool maps_ready = signed_map().step_ready() && unsigned_map().step_ready() &&
                                 signed_map().arithmetic_ready() &&
                                 unsigned_map().arithmetic_ready() &&
                                 signed_map().dequantize_ready() &&
                                 unsigned_map().dequantize_ready();
  if (maps_ready) return cpu::kernel_isa();
#endif
  return cpu::KernelIsa::scalar;
}

// The block kernel of this step: kernel_path()'s, the AVX-512 one by byte planes where the CPU
// has VBMI, the AVX2 one by gather where gathers are faster (chosen once per tensor and step,
// not per thread's range).
using BlockKernel = void (*)(const Block&, const Coefficients&, float*, float*);
BlockKernel block_kernel() {
#if defined(__x86_64__)
  switch (kernel_path()) {
    case cpu::KernelIsa::avx512: {
      static const bool vbmi = __builtin_cpu_supports("avx512vbmi");
      return vbmi ? block_avx512_vbmi : block_avx512;
    }
    case cpu::KernelIsa::avx2:
      return avx2_dequantizes_by_gather() ? block_avx2_gather : block_avx2;
    case cpu::KernelIsa::scalar:
      break;
  }
#endif
  return block_scalar;
}

class Adam8bit final : public UpdateRule {
 public:
  explicit Adam8bit(const ConfigSection& c)
      : beta1_(beta_in_range(c, "beta1")),
        beta2_(beta_in_range(c, "beta2")),
        eps_(c.get_float("eps")),
        block_(c.get_int("block_size")),
        min_8bit_(c.get_int("min_8bit_size")),
        tensor_ops_(kernel_in(c, "adam8bit", {"auto", "tensor_ops"}) == "tensor_ops") {
    forced_dequantizer();  // a bad LOOM_ADAM8BIT_DEQUANTIZE refused before the job starts
    LOOM_CHECK_AS(ConfigError, eps_ >= 0, c.where("eps"), ": [optimizer] eps must be >= 0");
    LOOM_CHECK_AS(ConfigError, block_ >= 16 && block_ <= 65536 && (block_ & (block_ - 1)) == 0,
                  c.where("block_size"),
                  ": [optimizer] block_size must be a power of two in [16, 65536], got ", block_,
                  "; 256 is the default, 2048 the paper's");
    LOOM_CHECK_AS(ConfigError, min_8bit_ >= 0, c.where("min_8bit_size"),
                  ": [optimizer] min_8bit_size must be >= 0");
    // state_dtype is one of the core's common keys (absent from a hand-built schema).
    LOOM_CHECK_AS(ConfigError,
                  !c.schema().find("state_dtype") || c.get_string("state_dtype") == "fp32",
                  c.where("state_dtype"), ": [optimizer] state_dtype = \"",
                  c.schema().find("state_dtype") ? c.get_string("state_dtype") : "",
                  "\" does not apply to adam8bit: it already quantizes its moments to 8 bits "
                  "per block (2 B/param); remove state_dtype, or use name = \"adamw\" with "
                  "state_dtype = \"bf16\" (4 B/param)");
  }
  std::string name() const override { return "adam8bit"; }
  Partitioning partitioning() const override { return {Granularity::block, block_}; }

  NamedTensors init_state(const Segment& s) const override {
    if (!quantized(s))
      return {{"exp_avg", at::zeros_like(s.param)}, {"exp_avg_sq", at::zeros_like(s.param)}};
    const int64_t n = s.param.numel(), blocks = (n + block_ - 1) / block_;
    auto bytes = s.param.options().dtype(at::kByte);
    // Code of 0.0: the signed map's zero sits in the middle, the unsigned map's at 0.
    const auto zero_m = static_cast<int64_t>(signed_map().quantize(0.0f));
    return {{"exp_avg_q", at::full({n}, zero_m, bytes)},
            {"exp_avg_absmax", at::zeros({blocks}, s.param.options())},
            {"exp_avg_sq_q", at::zeros({n}, bytes)},
            {"exp_avg_sq_absmax", at::zeros({blocks}, s.param.options())}};
  }

  // Note [Whole tensors shared among threads] (loom/update_rule.h).
  void update_many(const std::vector<Segment*>& segments,
                   const UpdateContext& ctx) const override {
    update_sharing_threads(*this, segments, ctx,
                           [this](const Segment& s) { return fused(s); });
  }
  void update(Segment& s, const UpdateContext& ctx) const override {
    const double bc1 = 1.0 - std::pow(beta1_, static_cast<double>(ctx.step));
    const Coefficients c{static_cast<float>(1.0 - ctx.lr * ctx.weight_decay),
                         static_cast<float>(1.0 - beta1_),
                         static_cast<float>(beta2_),
                         static_cast<float>(1.0 - beta2_),
                         static_cast<float>(std::sqrt(1.0 - std::pow(beta2_, double(ctx.step)))),
                         static_cast<float>(eps_),
                         static_cast<float>(ctx.lr / bc1)};
    if (!quantized(s)) return update_fp32(s, c);
    if (fused(s)) return update_fused(s, c);
    if (cuda_kernel(s)) return update_cuda(s, c);
    update_tensors(s, c);
  }

 private:
  // The fused CPU kernel where it can run, unless kernel = "tensor_ops" (the GPU path, on CPU
  // tensors for the tests).
  bool fused(const Segment& s) const { return !tensor_ops_ && cpu_fp32(s); }

  // The CUDA kernel (cuda/adam8bit.cu, the CPU's element code) where loom was built with its
  // kernels, unless kernel = "tensor_ops": fp32 parameters and gradients and the state, all
  // contiguous on one GPU.
  bool cuda_kernel(const Segment& s) const {
#if defined(LOOM_OPTIM_CUDA_KERNELS)
    if (tensor_ops_ || !s.param.is_cuda() || !signed_map().step_ready() ||
        !unsigned_map().step_ready())
      return false;
    auto ok = [&](const at::Tensor& t, at::ScalarType type) { return kernel_ready(s, t, type); };
    return ok(s.param, at::kFloat) && ok(s.grad, at::kFloat) &&
           ok(s.state_at("exp_avg_q"), at::kByte) && ok(s.state_at("exp_avg_sq_q"), at::kByte) &&
           ok(s.state_at("exp_avg_absmax"), at::kFloat) &&
           ok(s.state_at("exp_avg_sq_absmax"), at::kFloat);
#else
    (void)s;
    return false;
#endif
  }

  void update_cuda(Segment& s, const Coefficients& c) const {
#if defined(LOOM_OPTIM_CUDA_KERNELS)
    const at::Device device = s.param.device();
    const DeviceMaps& maps = maps_on(device);
    const Adam8bitDeviceTensor t{s.param.data_ptr<float>(),
                                 s.grad.data_ptr<float>(),
                                 s.state_at("exp_avg_q").data_ptr<uint8_t>(),
                                 s.state_at("exp_avg_sq_q").data_ptr<uint8_t>(),
                                 s.state_at("exp_avg_absmax").data_ptr<float>(),
                                 s.state_at("exp_avg_sq_absmax").data_ptr<float>(),
                                 s.param.numel(),
                                 block_,
                                 maps.mcode.data_ptr<float>(),
                                 maps.vcode.data_ptr<float>(),
                                 maps.mcells.data_ptr<int32_t>(),
                                 maps.vcells.data_ptr<int32_t>()};
    // The stream the caller's work is queued on.
    const c10::DeviceGuard guard(device);
    if (const char* error = launch_adam8bit(device.index(), t, c, current_cuda_stream(device)))
      throw Error(std::string("adam8bit's CUDA kernel did not launch on ") + device.str() +
                  " for " + s.name + ": " + error);
#else
    (void)s;
    (void)c;
#endif
  }

  // The whole tensor's size decides, so every segment of a tensor agrees.
  bool quantized(const Segment& s) const {
    int64_t numel = 1;
    for (int64_t d : s.shape) numel *= d;
    return numel >= min_8bit_;
  }

  void update_fp32(Segment& s, const Coefficients& c) const {
    at::Tensor& m = s.state_at("exp_avg");
    at::Tensor& v = s.state_at("exp_avg_sq");
    if (fused(s)) {
      float* p = s.param.data_ptr<float>();
      const float* g = s.grad.data_ptr<float>();
      float* mp = m.data_ptr<float>();
      float* vp = v.data_ptr<float>();
      for (int64_t i = 0, n = s.param.numel(); i < n; ++i)
        adamw_element(p[i], g[i], mp[i], vp[i], c);
      return;
    }
    s.param.mul_(c.decay);
    m.lerp_(s.grad, c.w1);
    v.mul_(c.b2).addcmul_(s.grad, s.grad, c.w2);
    s.param.addcdiv_(m, v.sqrt().div_(c.bc2_sqrt).add_(c.eps), -c.step_size);
  }

  // Per block (block_scalar, or its vector twin): blocks are independent, threads take ranges.
  void update_fused(Segment& s, const Coefficients& c) const {
    float* p = s.param.data_ptr<float>();
    const float* g = s.grad.data_ptr<float>();
    uint8_t* qm = s.state_at("exp_avg_q").data_ptr<uint8_t>();
    uint8_t* qv = s.state_at("exp_avg_sq_q").data_ptr<uint8_t>();
    float* am = s.state_at("exp_avg_absmax").data_ptr<float>();
    float* av = s.state_at("exp_avg_sq_absmax").data_ptr<float>();
    const int64_t n = s.param.numel(), block = block_, blocks = (n + block - 1) / block;
    const int64_t grain = std::max<int64_t>(1, (1 << 16) / block);
    const auto kernel = block_kernel();
    at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
      auto block_at = [&](int64_t k) {
        const int64_t b = first + k, start = b * block;
        return Block{p + start, g + start, qm + start, qv + start, am + b, av + b,
                     std::min(block, n - start)};
      };
      std::vector<float> mbuf(block), vbuf(block);
      for (int64_t k = 0; k < last - first; ++k) kernel(block_at(k), c, mbuf.data(), vbuf.data());
    });
  }

  // Note [adam8bit's tensor ops in slices]: other devices (and kernel = "tensor_ops") run the
  // fused kernel's steps as tensor ops over (blocks, block) views: dequantize, update, absmax,
  // requantize. Each op makes a temporary of the elements it covers (fp32 moments, the
  // denominator, the scaled moments, the codes' indices), 20 B an element at the peak (420 MB
  // over 21 M elements, measured with int32 indices; the int64 ones used before took more), so
  // over a whole tensor at once the update briefly held ten times the 8-bit state it exists to
  // save (a 50257 x 4096 embedding: ~4 GB). Slices of whole blocks, at most kSliceElements
  // each, bound that to 67 MB whatever the tensor
  // (OptimQuantization.Adam8bitTensorOpsTemporariesStayWithinASlice); a block never straddles
  // two slices, so the bytes are those of the whole-tensor ops. On a GPU each slice is ~25
  // kernel launches: ~250 slices for 1 B parameters.
  static constexpr int64_t kSliceElements = int64_t{1} << 22;

  // The maps' codes and midpoints on a device, copied there once: a copy from pageable host
  // memory per tensor and step (as before) made the host wait for the GPU four times a tensor.
  struct DeviceMaps {
    at::Device device;
    at::Tensor mcode, vcode, mthreshold, vthreshold;
    at::Tensor mcells, vcells;  // the one-step tables (Note [Quantize in one step]), int32
  };
  const DeviceMaps& maps_on(at::Device device) const {
    std::lock_guard<std::mutex> lock(maps_mutex_);
    for (const DeviceMaps& maps : maps_)
      if (maps.device == device) return maps;
    auto on_device = [&](const float* data, int64_t count) {
      return at::from_blob(const_cast<float*>(data), {count}, at::kFloat).to(device);
    };
    auto cells_on_device = [&](const QuantMap& map) {
      return at::from_blob(const_cast<int32_t*>(map.step_cell.data()),
                           {static_cast<int64_t>(map.step_cell.size())}, at::kInt)
          .to(device);
    };
    maps_.push_back({device, on_device(signed_map().code.data(), 256),
                     on_device(unsigned_map().code.data(), 256),
                     on_device(signed_map().threshold.data(), 255),
                     on_device(unsigned_map().threshold.data(), 255),
                     cells_on_device(signed_map()), cells_on_device(unsigned_map())});
    return maps_.back();
  }

  void update_tensors(Segment& s, const Coefficients& c) const {
    const int64_t n = s.param.numel(), block = block_, blocks = (n + block - 1) / block;
    const int64_t slice_blocks = std::max<int64_t>(1, kSliceElements / block);
    const DeviceMaps& maps = maps_on(s.param.device());
    const at::Tensor &mcode = maps.mcode, &vcode = maps.vcode, &mthreshold = maps.mthreshold,
                     &vthreshold = maps.vthreshold;
    at::Tensor& qm = s.state_at("exp_avg_q");
    at::Tensor& qv = s.state_at("exp_avg_sq_q");
    at::Tensor& am = s.state_at("exp_avg_absmax");
    at::Tensor& av = s.state_at("exp_avg_sq_absmax");
    for (int64_t first = 0; first < blocks; first += slice_blocks) {
      const int64_t nb = std::min(slice_blocks, blocks - first), start = first * block;
      const int64_t len = std::min(nb * block, n - start), pad = nb * block - len;
      auto blocked = [&](const at::Tensor& t) {  // (len) -> (nb, block), zero-padded
        return (pad ? at::constant_pad_nd(t, {0, pad}) : t).view({nb, block});
      };
      at::Tensor p = s.param.narrow(0, start, len);
      const at::Tensor g = s.grad.narrow(0, start, len);
      at::Tensor qm_s = qm.narrow(0, start, len), qv_s = qv.narrow(0, start, len);
      at::Tensor am_s = am.narrow(0, first, nb), av_s = av.narrow(0, first, nb);
      auto dequantize = [&](const at::Tensor& code, const at::Tensor& q, const at::Tensor& absmax) {
        return blocked(code.index_select(0, q.to(at::kInt)))
            .mul_(absmax.unsqueeze(1))
            .view(-1)
            .narrow(0, 0, len);
      };
      at::Tensor m = dequantize(mcode, qm_s, am_s);
      m.lerp_(g, c.w1);
      at::Tensor v = dequantize(vcode, qv_s, av_s);
      v.mul_(c.b2).addcmul_(g, g, c.w2);
      p.mul_(c.decay).addcdiv_(m, v.sqrt().div_(c.bc2_sqrt).add_(c.eps), -c.step_size);
      // Requantize: the block's absmax, then the nearest code by the midpoints (searchsorted
      // counts the thresholds below y, as quantize() does).
      auto requantize = [&](const at::Tensor& x, const at::Tensor& threshold, at::Tensor& q,
                            at::Tensor& absmax) {
        const at::Tensor xb = blocked(x);
        absmax.copy_(xb.abs().amax(1));
        const at::Tensor inverse =
            at::where(absmax > 0, absmax.reciprocal(), at::zeros_like(absmax));
        const at::Tensor y = (xb * inverse.unsqueeze(1)).view(-1).narrow(0, 0, len);
        q.copy_(at::searchsorted(threshold, y, /*out_int32=*/true, /*right=*/false));
      };
      requantize(m, mthreshold, qm_s, am_s);
      requantize(v, vthreshold, qv_s, av_s);
    }
  }

  double beta1_, beta2_, eps_;
  int64_t block_, min_8bit_;
  bool tensor_ops_;
  mutable std::mutex maps_mutex_;
  mutable std::deque<DeviceMaps> maps_;  // a deque: references to its elements stay valid
};

}  // namespace

std::unique_ptr<UpdateRule> make_adam8bit(const ConfigSection& c) {
  return std::make_unique<Adam8bit>(c);
}

}  // namespace loom::optim
