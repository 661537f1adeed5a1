// The built-in AdamW update rule: a fused, vectorised, multi-threaded CPU kernel over flat fp32
// segments, PyTorch's fused kernel on CUDA, and tensor ops on any other device; with [optimizer]
// state_dtype = "bf16" its moments kept in bf16 and written back with stochastic rounding
// (Note [Stochastic rounding of the state]), on CUDA by loom's own kernel of the CPU kernel's
// element code (adamw_bf16_element.h). Not torch::optim: no param groups here; the step
// driver resolves lr and weight decay per segment.
#include "adamw.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <mutex>
#include <type_traits>

#include "adamw_bf16_element.h"
#include "cuda_runtime.h"
#include "loom/error.h"
#include "loom/kernel_isa.h"
#include "loom/prefetch.h"
#include "stochastic_rounding.h"

namespace loom {
namespace {

// One pass over param, grad, m, v (all (n) fp32): 16 bytes read and 12 written per element,
// the least any AdamW can move. A plain loop the compiler vectorises (see core/CMakeLists.txt:
// no errno so sqrt vectorises, no FMA contraction so the vector body and the scalar tail round
// alike); cloned for AVX-512 and AVX2 and picked at load time. The arithmetic is
// torch.optim.AdamW's: p *= 1 - lr wd; m = lerp(m, g, 1-b1); v = b2 v + (1-b2) g²;
// p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps). In runs of 16 elements (a cache line of each
// array), each run first prefetching the lines it will read kPrefetchAhead elements on (Note
// [Streams prefetched ahead] in loom/prefetch.h); the fixed-length inner loop vectorises whole.
// The gradient as it is stored (adamw_bf16::gradient_value): fp32, or bf16 bits.
template <typename G>
__attribute__((always_inline)) inline void adamw_element(float* __restrict p,
                                                         const G* __restrict g,
                                                         float* __restrict m, float* __restrict v,
                                                         int64_t i, const AdamWCoefficients& c) {
  const float gi = adamw_bf16::gradient_value(g, i);
  const float mi = m[i] + c.w1 * (gi - m[i]);
  const float vi = c.b2 * v[i] + c.w2 * gi * gi;
  m[i] = mi;
  v[i] = vi;
  p[i] = p[i] * c.decay - c.step_size * (mi / (std::sqrt(vi) / c.bc2_sqrt + c.eps));
}
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void adamw_kernel(float* __restrict p, const float* __restrict g, float* __restrict m,
                  float* __restrict v, int64_t n, AdamWCoefficients c) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    cpu::prefetch_ahead(p + i);
    cpu::prefetch_ahead(g + i);
    cpu::prefetch_ahead(m + i);
    cpu::prefetch_ahead(v + i);
    for (int64_t k = i; k < i + 16; ++k) adamw_element(p, g, m, v, k, c);
  }
  for (; i < n; ++i) adamw_element(p, g, m, v, i, c);
}

// Note [bf16 gradients read as they are]: full_bf16 with fp32 masters hands the core's adamw its
// bf16 gradients as they are (takes_bf16_gradients), where the driver made an fp32 copy of each
// first (6 B per parameter more, and 4 B/param of copies): the same element, widening in
// registers, so the same bits; with bf16 moments adamw_bf16_body does the same
// (adamw_bf16_kernel<uint16_t>). On a GPU, or with a strided gradient, update() widens it first. In runs of 32 (a cache line of the gradient), one copy per ISA
// level picked by cpu::kernel_isa() (so LOOM_KERNEL_ISA runs each, as the tests do).
__attribute__((always_inline)) inline void adamw_bf16_grad_body(float* __restrict p,
                                                                const uint16_t* __restrict g,
                                                                float* __restrict m,
                                                                float* __restrict v, int64_t n,
                                                                AdamWCoefficients c) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    cpu::prefetch_ahead(p + i);
    cpu::prefetch_ahead(p + i + 16);
    cpu::prefetch_ahead(g + i);
    cpu::prefetch_ahead(m + i);
    cpu::prefetch_ahead(m + i + 16);
    cpu::prefetch_ahead(v + i);
    cpu::prefetch_ahead(v + i + 16);
    for (int64_t k = i; k < i + 32; ++k) adamw_element(p, g, m, v, k, c);
  }
  for (; i < n; ++i) adamw_element(p, g, m, v, i, c);
}
using AdamWBf16GradKernel = void (*)(float*, const uint16_t*, float*, float*, int64_t,
                                     AdamWCoefficients);
#if defined(__x86_64__)
__attribute__((target("arch=x86-64-v4"))) void adamw_bf16_grad_avx512(
    float* p, const uint16_t* g, float* m, float* v, int64_t n, AdamWCoefficients c) {
  adamw_bf16_grad_body(p, g, m, v, n, c);
}
__attribute__((target("arch=x86-64-v3"))) void adamw_bf16_grad_avx2(
    float* p, const uint16_t* g, float* m, float* v, int64_t n, AdamWCoefficients c) {
  adamw_bf16_grad_body(p, g, m, v, n, c);
}
#endif
void adamw_bf16_grad_baseline(float* p, const uint16_t* g, float* m, float* v, int64_t n,
                              AdamWCoefficients c) {
  adamw_bf16_grad_body(p, g, m, v, n, c);
}
AdamWBf16GradKernel adamw_bf16_grad_kernel() {
#if defined(__x86_64__)
  switch (cpu::kernel_isa()) {
    case cpu::KernelIsa::avx512: return adamw_bf16_grad_avx512;
    case cpu::KernelIsa::avx2: return adamw_bf16_grad_avx2;
    case cpu::KernelIsa::scalar: break;
  }
#endif
  return adamw_bf16_grad_baseline;
}

// Note [Stochastic rounding of the state]: with [optimizer] state_dtype = "bf16" AdamW keeps
// exp_avg and exp_avg_sq as bf16 (4 B per parameter instead of 8). Each update widens them to
// fp32 (exact), runs the fp32 arithmetic above unchanged, updates the parameter from the fp32
// moments, and writes the moments back rounded stochastically: a uniform random 16-bit value is
// added to the low half of the fp32 bits and the low half dropped, so a value rounds up with
// probability equal to its distance from the bf16 below (in units of the last place), and
// E[round(x)] = x. Round-to-nearest would lose every update smaller than half a bf16 ulp of the
// moment, 2^-9 of it: exp_avg_sq with beta2 = 0.999 moves by 0.1 % per step, so it would stall.
// NaN stays NaN (quieted); a value that rounds past the largest bf16 becomes inf, as it should.
//
// The random bits are a counter-based hash, not a stateful generator, so nothing but the
// element's coordinates decides them: the run's [train] seed (UpdateRule::set_seed, the same
// on every rank), the step, the parameter's name and the element's index in the whole flattened
// tensor (segment offset + i). A run is thus deterministic, a resume continues bitwise (nothing
// to save), and threads, ZeRO cuts and offload chunks cannot change the result. Per element:
//   key  = mix64(mix64(mix64(seed ^ fnv1a64(name)) ^ step) ^ (index >> 32))   (per span)
//   x    = lowbias32(lowbias32(uint32(index) ^ key_lo) ^ key_hi)
//   exp_avg takes the low 16 bits of x, exp_avg_sq the high 16.
// mix64 is SplitMix64's finaliser (with its golden-ratio increment), lowbias32 Chris Wellons'
// 32-bit integer hash; tests/plugins/optim/bf16_state_reference.py recomputes both in numpy.
// mix64, fnv1a64, rounding_key, each_rounding_span: stochastic_rounding.h.

// lowbias32 and the rounding itself: adamw_bf16_element.h, which the CUDA kernel compiles too.

// The same AdamW step as adamw_kernel over bf16 moments (raw bf16 bits in m and v), for
// elements first_index.. of the whole tensor, all with one rounding key. An always-inlined body
// that each ISA's copy below vectorises for itself; no FMA contraction (-ffp-contract=off), so
// every copy, and torch's separate ops in the tests' reference, round alike. (The AVX2 copy is
// written out by hand below: Note [bf16 moments in AVX2 by hand].)
// p, g: (n) fp32; m, v: (n) bf16 bits. In runs of 32 elements (a cache line of each bf16
// array, two of each fp32 one), prefetched ahead as adamw_kernel's.
// The lines a run of 32 elements from i reads, asked for kPrefetchAhead elements ahead (always
// inlined: Note [Streams prefetched ahead] in loom/prefetch.h on copies that lose them).
template <typename G>
__attribute__((always_inline)) inline void prefetch_bf16_run(const float* p, const G* g,
                                                             const uint16_t* m, const uint16_t* v,
                                                             int64_t i) {
  cpu::prefetch_ahead(p + i);
  cpu::prefetch_ahead(p + i + 16);
  cpu::prefetch_ahead(g + i);
  cpu::prefetch_ahead(g + i + 16);
  cpu::prefetch_ahead(m + i);
  cpu::prefetch_ahead(v + i);
}

template <typename G>
__attribute__((always_inline)) inline void adamw_bf16_body(
    float* __restrict p, const G* __restrict g, uint16_t* __restrict m,
    uint16_t* __restrict v, int64_t n, AdamWCoefficients c, uint32_t first_index, uint32_t key_lo,
    uint32_t key_hi) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_bf16_run(p, g, m, v, i);
    for (int64_t k = i; k < i + 32; ++k)
      adamw_bf16::update(p, g, m, v, k, c, first_index, key_lo, key_hi);
  }
  for (; i < n; ++i) adamw_bf16::update(p, g, m, v, i, c, first_index, key_lo, key_hi);
}

// Picked per update by loom::cpu::kernel_isa(), so LOOM_KERNEL_ISA runs the AVX2 and scalar
// copies on an AVX-512 machine and the tests compare all three bit for bit (Note [Kernel ISA
// cap]). G: the gradient's storage, fp32 or bf16 bits (Note [bf16 gradients read as they are]).
template <typename G>
using AdamWBf16Kernel = void (*)(float*, const G*, uint16_t*, uint16_t*, int64_t,
                                 AdamWCoefficients, uint32_t, uint32_t, uint32_t);
#if defined(__x86_64__)
template <typename G>
__attribute__((target("arch=x86-64-v4"))) void adamw_bf16_avx512(
    float* p, const G* g, uint16_t* m, uint16_t* v, int64_t n, AdamWCoefficients c,
    uint32_t first_index, uint32_t key_lo, uint32_t key_hi) {
  adamw_bf16_body(p, g, m, v, n, c, first_index, key_lo, key_hi);
}
// Note [bf16 moments in AVX2 by hand]: GCC's AVX2 copy of adamw_bf16_body took ~100
// instructions per 8 elements (the index in 64-bit lanes, each 16-bit result masked before its
// pack, four permutes to pack them), 0.46x torch's fused AdamW at one thread on the AVX2-only
// AMD EPYC of issue 39. Written out here: the index in 32-bit lanes (it is taken mod 2^32
// anyway), lowbias32 twice on 8 lanes, each moment's 16 results packed with one packus (they
// are in [0, 65535], so it never saturates) and one permute: 0.68x at one thread, 1.22x at two
// (docs/BENCHMARKS.md, "bf16 moments by hand"). Every operation is the element code's in its
// order (no FMA: -ffp-contract=off holds for intrinsics too), and once sqrt(1 - beta2^t) has
// rounded to 1 the division by it, exact then, is left out; so the bits are
// adamw_bf16::update's (OptimBf16State.IsaPathsAndTensorOpsGiveIdenticalBits and
// LateStepsKeepTheBitsWithoutTheBiasDivision; Bf16Masters.AdamwReadsBf16GradientsWithTheWidenedCopysBits
// for bf16 gradients).
__attribute__((target("avx2"), always_inline)) inline __m256i lowbias32_8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x7FEB352Du)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}
// float_to_bf16_stochastic on 8 lanes, each result in the low 16 bits of its lane.
__attribute__((target("avx2"), always_inline)) inline __m256i bf16_stochastic_8(__m256 f,
                                                                                 __m256i random16) {
  const __m256i bits = _mm256_castps_si256(f);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, random16), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x0040));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}
// Two vectors of 16-bit results (lanes 0-7, 8-15) stored as 16 bf16 in order.
__attribute__((target("avx2"), always_inline)) inline void store_bf16_16(uint16_t* out, __m256i lo,
                                                                         __m256i hi) {
  const __m256i packed = _mm256_packus_epi32(lo, hi);  // per 128-bit half: lo 4, hi 4
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permute4x64_epi64(packed, 0xD8));  // lo 0-7, hi 8-15
}
__attribute__((target("avx2"), always_inline)) inline __m256 widen_bf16_8(const uint16_t* from) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from))), 16));
}
__attribute__((target("avx2"), always_inline)) inline __m256 gradient_8(const float* g) {
  return _mm256_loadu_ps(g);
}
__attribute__((target("avx2"), always_inline)) inline __m256 gradient_8(const uint16_t* g) {
  return widen_bf16_8(g);
}

// kUnitBc2: sqrt(1 - beta2^t) has rounded to 1.0f, so sqrt(v) / bc2 is sqrt(v) exactly and
// the division is left out (Note [A bias correction of one] in plugins/optim/adam8bit.cpp).
template <typename G, bool kUnitBc2>
__attribute__((target("arch=x86-64-v3"), always_inline)) inline void adamw_bf16_avx2_loop(
    float* p, const G* g, uint16_t* m, uint16_t* v, int64_t n, AdamWCoefficients c,
    uint32_t first_index, uint32_t key_lo, uint32_t key_hi) {
  const __m256 w1 = _mm256_set1_ps(c.w1), b2 = _mm256_set1_ps(c.b2), w2 = _mm256_set1_ps(c.w2),
               decay = _mm256_set1_ps(c.decay), bc2 = _mm256_set1_ps(c.bc2_sqrt),
               eps = _mm256_set1_ps(c.eps), step = _mm256_set1_ps(c.step_size);
  const __m256i lo = _mm256_set1_epi32(static_cast<int>(key_lo)),
                hi = _mm256_set1_epi32(static_cast<int>(key_hi)),
                low16 = _mm256_set1_epi32(0xFFFF);
  // Element k's index mod 2^32, as adamw_bf16::update takes it: first_index + uint32(k).
  __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first_index)),
                                   _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i eight = _mm256_set1_epi32(8);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_bf16_run(p, g, m, v, i);
    for (int64_t k = i; k < i + 32; k += 16) {
      __m256i m_half[2], v_half[2];
      for (int h = 0; h < 2; ++h) {
        const int64_t at = k + 8 * h;
        const __m256 gi = gradient_8(g + at);
        const __m256 m0 = widen_bf16_8(m + at), v0 = widen_bf16_8(v + at);
        const __m256 mi = _mm256_add_ps(m0, _mm256_mul_ps(w1, _mm256_sub_ps(gi, m0)));
        const __m256 vi =
            _mm256_add_ps(_mm256_mul_ps(b2, v0), _mm256_mul_ps(_mm256_mul_ps(w2, gi), gi));
        const __m256i x =
            lowbias32_8(_mm256_xor_si256(lowbias32_8(_mm256_xor_si256(index, lo)), hi));
        index = _mm256_add_epi32(index, eight);
        m_half[h] = bf16_stochastic_8(mi, _mm256_and_si256(x, low16));
        v_half[h] = bf16_stochastic_8(vi, _mm256_srli_epi32(x, 16));
        const __m256 root = _mm256_sqrt_ps(vi);
        const __m256 denom = _mm256_add_ps(kUnitBc2 ? root : _mm256_div_ps(root, bc2), eps);
        _mm256_storeu_ps(p + at,
                         _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + at), decay),
                                       _mm256_mul_ps(step, _mm256_div_ps(mi, denom))));
      }
      store_bf16_16(m + k, m_half[0], m_half[1]);
      store_bf16_16(v + k, v_half[0], v_half[1]);
    }
  }
  for (; i < n; ++i) adamw_bf16::update(p, g, m, v, i, c, first_index, key_lo, key_hi);
}
template <typename G>
__attribute__((target("arch=x86-64-v3"))) void adamw_bf16_avx2(
    float* p, const G* g, uint16_t* m, uint16_t* v, int64_t n, AdamWCoefficients c,
    uint32_t first_index, uint32_t key_lo, uint32_t key_hi) {
  if (c.bc2_sqrt == 1.0f)
    adamw_bf16_avx2_loop<G, true>(p, g, m, v, n, c, first_index, key_lo, key_hi);
  else
    adamw_bf16_avx2_loop<G, false>(p, g, m, v, n, c, first_index, key_lo, key_hi);
}
#endif
// The baseline: the scalar path (SSE2 at most, which the compiler may still use for it).
template <typename G>
void adamw_bf16_baseline(float* p, const G* g, uint16_t* m, uint16_t* v, int64_t n,
                         AdamWCoefficients c, uint32_t first_index, uint32_t key_lo,
                         uint32_t key_hi) {
  adamw_bf16_body(p, g, m, v, n, c, first_index, key_lo, key_hi);
}

template <typename G>
AdamWBf16Kernel<G> adamw_bf16_kernel() {
#if defined(__x86_64__)
  switch (cpu::kernel_isa()) {
    case cpu::KernelIsa::avx512: return adamw_bf16_avx512<G>;
    case cpu::KernelIsa::avx2: return adamw_bf16_avx2<G>;
    case cpu::KernelIsa::scalar: break;
  }
#endif
  return adamw_bf16_baseline<G>;
}

// Note [bf16 weights as their own masters] (step_driver.cpp), fused: AdamW on bf16 weights that
// have no fp32 master, from bf16 gradients, in one pass. Each element widens its weight and
// gradient in registers (exact), runs adamw_element's (or adamw_bf16::update's) fp32 arithmetic
// in the same order, and writes the weight back rounded with the weight stream's bits: the bits
// of the driver's generic path (widen, the fp32 kernel, round), which made three more passes
// over the weights and the gradients (18 B per parameter: 46 B against this pass's 22 with fp32
// moments, 14 with bf16 ones). Moments fp32 (kBf16State false: mf, vf) or bf16 bits rounded with
// the state stream (mh, vh).
template <bool kBf16State>
__attribute__((always_inline)) inline void adamw_weights_body(
    uint16_t* __restrict p, const uint16_t* __restrict g, float* __restrict mf,
    float* __restrict vf, uint16_t* __restrict mh, uint16_t* __restrict vh, int64_t n,
    AdamWCoefficients c, uint32_t first_index, uint32_t weight_lo, uint32_t weight_hi,
    uint32_t state_lo, uint32_t state_hi) {
  const auto element = [&](int64_t i) __attribute__((always_inline)) {
    const float gi = adamw_bf16::bf16_to_float(g[i]);
    const float m0 = kBf16State ? adamw_bf16::bf16_to_float(mh[i]) : mf[i];
    const float v0 = kBf16State ? adamw_bf16::bf16_to_float(vh[i]) : vf[i];
    const float mi = m0 + c.w1 * (gi - m0);
    const float vi = c.b2 * v0 + c.w2 * gi * gi;
    const uint32_t index = first_index + static_cast<uint32_t>(i);
    if constexpr (kBf16State) {
      const uint32_t x = adamw_bf16::random_bits(index, state_lo, state_hi);
      mh[i] = adamw_bf16::float_to_bf16_stochastic(mi, x & 0xFFFFu);
      vh[i] = adamw_bf16::float_to_bf16_stochastic(vi, x >> 16);
    } else {
      mf[i] = mi;
      vf[i] = vi;
    }
    const float pi = adamw_bf16::bf16_to_float(p[i]);
    const float updated =
        pi * c.decay - c.step_size * (mi / (adamw_bf16::square_root(vi) / c.bc2_sqrt + c.eps));
    p[i] = adamw_bf16::float_to_bf16_stochastic(
        updated, adamw_bf16::random_bits(index, weight_lo, weight_hi) & 0xFFFFu);
  };
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    cpu::prefetch_ahead(p + i);
    cpu::prefetch_ahead(g + i);
    if constexpr (kBf16State) {
      cpu::prefetch_ahead(mh + i);
      cpu::prefetch_ahead(vh + i);
    } else {
      cpu::prefetch_ahead(mf + i);
      cpu::prefetch_ahead(mf + i + 16);
      cpu::prefetch_ahead(vf + i);
      cpu::prefetch_ahead(vf + i + 16);
    }
    for (int64_t k = i; k < i + 32; ++k) element(k);
  }
  for (; i < n; ++i) element(i);
}

using AdamWWeightsKernel = void (*)(uint16_t*, const uint16_t*, float*, float*, uint16_t*,
                                    uint16_t*, int64_t, AdamWCoefficients, uint32_t, uint32_t,
                                    uint32_t, uint32_t, uint32_t);
#define LOOM_ADAMW_WEIGHTS_COPY(name, attributes, bf16_state)                                    \
  attributes void name(uint16_t* p, const uint16_t* g, float* mf, float* vf, uint16_t* mh,     \
                       uint16_t* vh, int64_t n, AdamWCoefficients c, uint32_t first,          \
                       uint32_t wlo, uint32_t whi, uint32_t slo, uint32_t shi) {              \
    adamw_weights_body<bf16_state>(p, g, mf, vf, mh, vh, n, c, first, wlo, whi, slo, shi);     \
  }
#if defined(__x86_64__)
LOOM_ADAMW_WEIGHTS_COPY(adamw_weights_avx512, __attribute__((target("arch=x86-64-v4"))), false)
LOOM_ADAMW_WEIGHTS_COPY(adamw_weights_avx2, __attribute__((target("arch=x86-64-v3"))), false)
LOOM_ADAMW_WEIGHTS_COPY(adamw_weights_bf16_avx512, __attribute__((target("arch=x86-64-v4"))), true)
LOOM_ADAMW_WEIGHTS_COPY(adamw_weights_bf16_avx2, __attribute__((target("arch=x86-64-v3"))), true)
#endif
LOOM_ADAMW_WEIGHTS_COPY(adamw_weights_baseline, , false)
LOOM_ADAMW_WEIGHTS_COPY(adamw_weights_bf16_baseline, , true)
#undef LOOM_ADAMW_WEIGHTS_COPY

AdamWWeightsKernel adamw_weights_kernel(bool bf16_state) {
#if defined(__x86_64__)
  switch (cpu::kernel_isa()) {
    case cpu::KernelIsa::avx512: return bf16_state ? adamw_weights_bf16_avx512 : adamw_weights_avx512;
    case cpu::KernelIsa::avx2: return bf16_state ? adamw_weights_bf16_avx2 : adamw_weights_avx2;
    case cpu::KernelIsa::scalar: break;
  }
#endif
  return bf16_state ? adamw_weights_bf16_baseline : adamw_weights_baseline;
}

// AdamW (Loshchilov & Hutter) with torch.optim.AdamW's arithmetic and bias correction.
class AdamW final : public UpdateRule {
 public:
  explicit AdamW(const ConfigSection& c)
      : beta1_(c.get_float("beta1")), beta2_(c.get_float("beta2")), eps_(c.get_float("eps")) {
    LOOM_CHECK_AS(ConfigError, beta1_ >= 0 && beta1_ < 1, c.where("beta1"),
                  ": [optimizer] beta1 must be in [0, 1), got ", beta1_);
    LOOM_CHECK_AS(ConfigError, beta2_ >= 0 && beta2_ < 1, c.where("beta2"),
                  ": [optimizer] beta2 must be in [0, 1), got ", beta2_);
    LOOM_CHECK_AS(ConfigError, eps_ >= 0, c.where("eps"), ": [optimizer] eps must be >= 0");
    // A schema without the core's common keys (a rule built by hand) keeps fp32 state.
    if (c.schema().find("state_dtype")) {
      const std::string dtype = c.get_string("state_dtype");
      LOOM_CHECK_AS(ConfigError, dtype == "fp32" || dtype == "bf16", c.where("state_dtype"),
                    ": [optimizer] state_dtype '", dtype,
                    "' is unknown for adamw; use \"fp32\" (the default) or \"bf16\"");
      bf16_state_ = dtype == "bf16";
    }
  }
  std::string name() const override { return "adamw"; }
  std::vector<std::string> state_dtypes() const override { return {"fp32", "bf16"}; }
  void set_seed(uint64_t seed) override { seed_ = seed; }
  uint64_t seed() const { return seed_; }
  NamedTensors init_state(const Segment& s) const override {
    const auto options = s.param.options().dtype(bf16_state_ ? at::kBFloat16 : at::kFloat);
    return {{"exp_avg", at::zeros(s.param.sizes(), options)},
            {"exp_avg_sq", at::zeros(s.param.sizes(), options)}};
  }
  void update(Segment& s, const UpdateContext& ctx) const override {
    at::Tensor& m = s.state_at("exp_avg");
    at::Tensor& v = s.state_at("exp_avg_sq");
    const double bc1 = 1.0 - std::pow(beta1_, static_cast<double>(ctx.step));
    const double bc2_sqrt = std::sqrt(1.0 - std::pow(beta2_, static_cast<double>(ctx.step)));
    const double step_size = ctx.lr / bc1;
    if (s.param.scalar_type() == at::kBFloat16)
      return update_bf16_weights(s, ctx, bc2_sqrt, step_size);
    // Note [bf16 gradients read as they are]: the fp32-moment CPU kernel reads them; any other
    // path widens them first.
    const bool cpu_flat = s.param.is_cpu() && s.param.scalar_type() == at::kFloat &&
                          s.param.is_contiguous() && s.grad.is_cpu() && s.grad.is_contiguous();
    const bool cpu_fp32 = cpu_flat && !bf16_state_;
    if (s.grad.scalar_type() == at::kBFloat16 && cpu_fp32) {
      const AdamWCoefficients c = coefficients(ctx, bc2_sqrt, step_size);
      float* p = s.param.data_ptr<float>();
      const auto* g = reinterpret_cast<const uint16_t*>(s.grad.data_ptr<at::BFloat16>());
      float* mp = m.data_ptr<float>();
      float* vp = v.data_ptr<float>();
      const AdamWBf16GradKernel kernel = adamw_bf16_grad_kernel();
      at::parallel_for(0, s.param.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
        kernel(p + begin, g + begin, mp + begin, vp + begin, end - begin, c);
      });
      return;
    }
    const bool bf16_kernel_reads = bf16_state_ && cpu_flat && s.grad.scalar_type() == at::kBFloat16;
    if (s.grad.scalar_type() != at::kFloat && !bf16_kernel_reads) {  // widened for this update
      Segment widened = s;
      widened.grad = s.grad.to(at::kFloat);
      return update(widened, ctx);
    }
    if (bf16_state_) return update_bf16_state(s, ctx, bc2_sqrt, step_size);
    if (cpu_fp32 && s.grad.scalar_type() == at::kFloat) {
      const AdamWCoefficients c = coefficients(ctx, bc2_sqrt, step_size);
      float* p = s.param.data_ptr<float>();
      const float* g = s.grad.data_ptr<float>();
      float* mp = m.data_ptr<float>();
      float* vp = v.data_ptr<float>();
      // Chunks of 64K elements (1.75 MB of traffic) amortise the thread hand-off; results do
      // not depend on the split since every element is independent.
      at::parallel_for(0, s.param.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
        adamw_kernel(p + begin, g + begin, mp + begin, vp + begin, end - begin, c);
      });
      return;
    }
    if (fused_cuda(s)) {
      fused_cuda_update({&s}, ctx);
      return;
    }
    // Any other device: the same arithmetic as tensor ops.
    s.param.mul_(1.0 - ctx.lr * ctx.weight_decay);
    m.lerp_(s.grad, 1.0 - beta1_);
    v.mul_(beta2_).addcmul_(s.grad, s.grad, 1.0 - beta2_);
    s.param.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(eps_), -step_size);
  }

  void update_many(const std::vector<Segment*>& segments,
                   const UpdateContext& ctx) const override {
    bool fused = !segments.empty() && !bf16_state_;
    for (const Segment* s : segments)
      fused = fused && fused_cuda(*s) && s->param.device() == segments.front()->param.device();
    if (fused) return fused_cuda_update(segments, ctx);
    // Note [Whole tensors shared among threads] (loom/update_rule.h).
    update_sharing_threads(*this, segments, ctx, [](const Segment& s) {
      return s.param.is_cpu() && s.grad.is_cpu();
    });
  }

 private:
  static bool fused_cuda(const Segment& s) {
    return s.param.is_cuda() && s.param.scalar_type() == at::kFloat &&
           s.grad.scalar_type() == at::kFloat && s.grad.device() == s.param.device();
  }

  // PyTorch's fused CUDA AdamW (what torch.optim.AdamW(fused=True) runs): a multi-tensor
  // kernel that reads and writes each element once, a few launches for any number of tensors.
  // Its step count is a device tensor (one, shared: the kernel only reads it), so nothing
  // syncs the host.
  // The step tensor is made once per step and device and kept: optimizer in backward calls this
  // per large parameter, where a fill kernel each time was one of the seven kernels a parameter
  // cost (Note [Small gradients batched on a GPU] in core/src/optimizer_in_backward.cpp). A new
  // step makes a new tensor, so a kernel still reading the old one is unaffected.
  void fused_cuda_update(const std::vector<Segment*>& segments, const UpdateContext& ctx) const {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
    const c10::Device device = segments.front()->param.device();
    at::Tensor step;
    {
      std::lock_guard<std::mutex> lock(step_mutex_);
      if (!step_tensor_.defined() || step_value_ != ctx.step || step_tensor_.device() != device) {
        step_tensor_ = at::full({}, static_cast<double>(ctx.step),
                                at::TensorOptions().dtype(at::kFloat).device(device));
        step_value_ = ctx.step;
      }
      step = step_tensor_;
    }
    for (Segment* s : segments) {
      params.push_back(s->param);
      grads.push_back(s->grad);
      exp_avgs.push_back(s->state_at("exp_avg"));
      exp_avg_sqs.push_back(s->state_at("exp_avg_sq"));
      steps.push_back(step);
    }
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, {}, steps, ctx.lr, beta1_, beta2_,
                      ctx.weight_decay, eps_, /*amsgrad=*/false, /*maximize=*/false);
  }

  AdamWCoefficients coefficients(const UpdateContext& ctx, double bc2_sqrt,
                                 double step_size) const {
    return {static_cast<float>(1.0 - ctx.lr * ctx.weight_decay),
            static_cast<float>(1.0 - beta1_),
            static_cast<float>(beta2_),
            static_cast<float>(1.0 - beta2_),
            static_cast<float>(bc2_sqrt),
            static_cast<float>(eps_),
            static_cast<float>(step_size)};
  }

  // Note [bf16 weights as their own masters], fused (takes_bf16_weights): s.param is the bf16
  // weights themselves and s.grad their bf16 gradient, both contiguous on the CPU.
  void update_bf16_weights(Segment& s, const UpdateContext& ctx, double bc2_sqrt,
                           double step_size) const {
    at::Tensor& m = s.state_at("exp_avg");
    at::Tensor& v = s.state_at("exp_avg_sq");
    LOOM_INTERNAL_ASSERT(s.param.is_cpu() && s.param.is_contiguous() &&
                             s.grad.scalar_type() == at::kBFloat16 && s.grad.is_cpu() &&
                             s.grad.is_contiguous() && m.is_contiguous() && v.is_contiguous(),
                         "adamw's bf16-weight kernel got ", s.name, " in another layout");
    const AdamWCoefficients c = coefficients(ctx, bc2_sqrt, step_size);
    const uint64_t state_key = mix64(seed_ ^ fnv1a64(s.name));
    const uint64_t weight_key = weight_rounding_key(seed_, s.name);
    auto* p = reinterpret_cast<uint16_t*>(s.param.data_ptr<at::BFloat16>());
    const auto* g = reinterpret_cast<const uint16_t*>(s.grad.data_ptr<at::BFloat16>());
    float* mf = bf16_state_ ? nullptr : m.data_ptr<float>();
    float* vf = bf16_state_ ? nullptr : v.data_ptr<float>();
    uint16_t* mh = bf16_state_ ? reinterpret_cast<uint16_t*>(m.data_ptr<at::BFloat16>()) : nullptr;
    uint16_t* vh = bf16_state_ ? reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>()) : nullptr;
    const AdamWWeightsKernel kernel = adamw_weights_kernel(bf16_state_);
    at::parallel_for(0, s.param.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
      // Both keys change only where the whole tensor's index crosses a multiple of 2^32.
      each_rounding_span(state_key, ctx.step, s.offset, begin, end,
                         [&](int64_t from, int64_t stop, uint32_t index, uint64_t key) {
                           const uint64_t wkey = rounding_key(weight_key, ctx.step, s.offset + from);
                           kernel(p + from, g + from, mf ? mf + from : nullptr,
                                  vf ? vf + from : nullptr, mh ? mh + from : nullptr,
                                  vh ? vh + from : nullptr, stop - from, c, index,
                                  static_cast<uint32_t>(wkey), static_cast<uint32_t>(wkey >> 32),
                                  static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32));
                         });
    });
  }

  // Note [Stochastic rounding of the state]. The CPU kernel for contiguous fp32 parameters and
  // gradients, its CUDA twin for the same on a GPU; tensor ops with the same arithmetic and the
  // same random bits anywhere else (or on a GPU where loom was built without its kernels).
  void update_bf16_state(Segment& s, const UpdateContext& ctx, double bc2_sqrt,
                         double step_size) const {
    at::Tensor& m = s.state_at("exp_avg");
    at::Tensor& v = s.state_at("exp_avg_sq");
    LOOM_INTERNAL_ASSERT(m.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
                             m.is_contiguous() && v.is_contiguous(),
                         "adamw with bf16 state got ", m.scalar_type(), " moments for ", s.name);
    const AdamWCoefficients c = coefficients(ctx, bc2_sqrt, step_size);
    const uint64_t tensor_key = mix64(seed_ ^ fnv1a64(s.name));
    const int64_t n = s.param.numel();
    // The kernels take flat fp32 parameters and gradients and the moments on one device: the
    // CPU kernel, or the same element in a CUDA kernel (adamw_bf16_element.h), bitwise alike.
    const CudaRuntime* cuda = cuda_runtime();
    // A bf16 gradient (Note [bf16 gradients read as they are]) only on the CPU: update() widens
    // it for any other device.
    const bool bf16_grad = s.grad.scalar_type() == at::kBFloat16 && s.grad.is_cpu();
    const bool flat = s.param.scalar_type() == at::kFloat && s.param.is_contiguous() &&
                      (s.grad.scalar_type() == at::kFloat || bf16_grad) && s.grad.is_contiguous() &&
                      s.grad.device() == s.param.device() && m.device() == s.param.device() &&
                      v.device() == s.param.device();
    const bool on_gpu = s.param.is_cuda() && cuda && cuda->adamw_bf16_update;
    if (flat && (s.param.is_cpu() || on_gpu)) {
      float* p = s.param.data_ptr<float>();
      auto* mp = reinterpret_cast<uint16_t*>(m.data_ptr<at::BFloat16>());
      auto* vp = reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>());
      // The CPU kernel over the gradient as it is stored (G: float, or uint16_t bf16 bits).
      const auto on_cpu = [&](const auto* g) {
        using G = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
        const AdamWBf16Kernel<G> kernel = adamw_bf16_kernel<G>();
        at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
          each_rounding_span(tensor_key, ctx.step, s.offset, begin, end,
                             [&](int64_t from, int64_t stop, uint32_t index, uint64_t key) {
                               kernel(p + from, g + from, mp + from, vp + from, stop - from, c,
                                      index, static_cast<uint32_t>(key),
                                      static_cast<uint32_t>(key >> 32));
                             });
        });
      };
      if (bf16_grad)
        return on_cpu(reinterpret_cast<const uint16_t*>(s.grad.data_ptr<at::BFloat16>()));
      const float* g = s.grad.data_ptr<float>();
      if (on_gpu) {
        each_rounding_span(tensor_key, ctx.step, s.offset, 0, n,
                           [&](int64_t from, int64_t stop, uint32_t index, uint64_t key) {
                             cuda->adamw_bf16_update(s.param.get_device(), p + from, g + from,
                                                     mp + from, vp + from, stop - from, c, index,
                                                     static_cast<uint32_t>(key),
                                                     static_cast<uint32_t>(key >> 32));
                           });
        return;
      }
      return on_cpu(g);
    }
    // Tensor ops: each op rounds to fp32 as the kernel's expression does, in the same order.
    const auto f32 = [&](double x) {
      return at::scalar_tensor(static_cast<float>(x), s.param.options().dtype(at::kFloat));
    };
    const at::Tensor g = s.grad.to(at::kFloat);
    const at::Tensor m0 = m.to(at::kFloat), v0 = v.to(at::kFloat);
    const at::Tensor mi = m0 + f32(c.w1) * (g - m0);
    const at::Tensor vi = f32(c.b2) * v0 + f32(c.w2) * g * g;
    // ATen's CPU sqrt of a long fp32 tensor is not correctly rounded (VML: 0.8 % of elements
    // one ulp off); fp64's, rounded to fp32, is, as the kernel's sqrtps is.
    const at::Tensor root = at::sqrt(vi.to(at::kDouble)).to(at::kFloat);
    const at::Tensor denominator = root / f32(c.bc2_sqrt) + f32(c.eps);
    s.param.copy_(s.param * f32(c.decay) - f32(c.step_size) * (mi / denominator));
    const at::Tensor random = random_bits_ops(tensor_key, ctx.step, s.offset, n, s.param.options());
    round_into_ops(mi.contiguous(), at::bitwise_and(random, 0xFFFF), m);
    round_into_ops(vi.contiguous(), at::bitwise_right_shift(random, 16), v);
  }

  double beta1_, beta2_, eps_;
  bool bf16_state_ = false;
  mutable std::mutex step_mutex_;
  mutable at::Tensor step_tensor_;  // fused_cuda_update's, for step_value_
  mutable int64_t step_value_ = -1;
  uint64_t seed_ = 0;
};

}  // namespace

bool takes_bf16_gradients(const UpdateRule& rule) {
  return dynamic_cast<const AdamW*>(&rule) != nullptr;  // its CPU kernels read them
}

bool takes_bf16_weights(const UpdateRule& rule, uint64_t seed) {
  const auto* adamw = dynamic_cast<const AdamW*>(&rule);
  return adamw && adamw->seed() == seed;
}

std::unique_ptr<UpdateRule> make_adamw(const ConfigSection& table) {
  return std::make_unique<AdamW>(table);
}

}  // namespace loom
