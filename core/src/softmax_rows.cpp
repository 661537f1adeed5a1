// Note [Softmax rows in one kernel]: the fused loss (Note [Fused linear cross-entropy]) spent a
// third of its bf16 time outside its three matmuls, in ATen's passes over each chunk of logits:
// log_softmax from the bf16 logits into an fp32 tensor (itself three passes), exp_ over that,
// the one-hot, and a cast of the result back to bf16 for the matmuls: about 24 bytes moved and
// two exponentials per logit, and an fp32 (rows, vocabulary) tensor. Here one kernel does a row
// at a time: a pass for the maximum, a pass for the sum of exponentials (fp64 lanes), and, when
// a gradient is wanted, a pass writing softmax − one-hot over the logits in their own dtype, so
// 8 bytes per logit (bf16) and no tensor besides the logits. AVX-512 and AVX2, chosen at run
// time (Note [Kernel ISA cap] in loom/kernel_isa.h); without AVX2, with LOOM_KERNEL_ISA=scalar
// or with LOOM_FUSED_CE_ATEN=1 the caller keeps ATen's path.
// - The two kernels give the same bits: the AVX2 one runs a row in the same 16 lanes, as two
//   halves of 8 (the tail through a zero-padded copy, as the masked loads read it), computes
//   scalef's product with two exact powers of two (so it rounds once, as scalef does), and both
//   reduce their lanes in one fixed order of their own (an intrinsic's reduction tree is the
//   compiler's: GCC's and clang's differ).
// - The exponential is e^r·2^n with x = n·ln2 + r, |r| ≤ ln2/2, e^r by its Taylor series to
//   r^7 (truncation below 6e-9 relative) and 2^n by scalef, which returns 0 below 2^-149: within
//   a few ulps of libm's, so the loss and gradients agree with ATen's path to fp32 rounding, not
//   bit for bit.
// - Each row is computed by one thread in a fixed order of lanes: the result does not depend on
//   the thread count or on how rows are split into chunks.
// - bf16 results are rounded as c10::BFloat16 rounds (to nearest even, NaN → 0x7FC0).
// - A NaN logit makes its row's loss and gradient NaN (the sum of exponentials carries it).
#include "softmax_rows.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "loom/error.h"
#include "loom/kernel_isa.h"

namespace loom::nn::detail {
namespace {

bool aten_forced() {
  const char* value = std::getenv("LOOM_FUSED_CE_ATEN");
  return value && std::string_view(value) == "1";
}

#if defined(__x86_64__)
// A row's 16 lanes reduced in one fixed order, the same for both kernels.
inline float max_of_lanes(const float* lane) {
  float most = lane[0];
  for (int l = 1; l < 16; ++l) most = std::max(most, lane[l]);
  return most;
}
inline double sum_of_lanes(double* lane) {  // pairwise, in place
  for (int width = 8; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
  return lane[0];
}

#define LOOM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

// 16 elements (fewer at a row's end: the mask) widened to fp32.
LOOM_AVX512 inline __m512 load16(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
LOOM_AVX512 inline __m512 load16(const uint16_t* p, __mmask16 m) {
  const __m256i half = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

LOOM_AVX512 inline void store16(float* p, __mmask16 m, __m512 v) {
  _mm512_mask_storeu_ps(p, m, v);
}
LOOM_AVX512 inline void store16(uint16_t* p, __mmask16 m, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                  _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(rounded));
}

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return static_cast<float>(c10::BFloat16(v, c10::BFloat16::from_bits())); }
inline void set_value(float* p, float v) { *p = v; }
inline void set_value(uint16_t* p, float v) { *p = c10::BFloat16(v).x; }

// e^x for the x ≤ 0 softmax needs (Note [Softmax rows in one kernel]).
LOOM_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);  // e^-104 is 0 in fp32; a NaN x stays NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 = hi + lo, n·hi exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  for (float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// Sixteen fp32 values added into eight fp64 lanes each.
LOOM_AVX512 inline void add_wide(__m512d& low, __m512d& high, __m512 e) {
  low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
  high = _mm512_add_pd(high, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1)));
}

inline __mmask16 tail_mask(int64_t left) {
  return static_cast<__mmask16>((1u << left) - 1u);
}

template <class T>
LOOM_AVX512 float row_kernel(T* row, int64_t V, int64_t label, bool write_grad) {
  constexpr __mmask16 kAll = 0xFFFF;
  const int64_t body = V / 16 * 16;
  const __mmask16 tail = tail_mask(V - body);
  __m512 most = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < body; j += 16) most = _mm512_max_ps(most, load16(row + j, kAll));
  if (tail) most = _mm512_mask_max_ps(most, tail, most, load16(row + body, tail));
  alignas(64) float most_lanes[16];
  _mm512_store_ps(most_lanes, most);
  const __m512 m = _mm512_set1_ps(max_of_lanes(most_lanes));

  __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
  for (int64_t j = 0; j < body; j += 16)
    add_wide(low, high, exp16(_mm512_sub_ps(load16(row + j, kAll), m)));
  if (tail)
    add_wide(low, high,
             _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(load16(row + body, tail), m))));
  alignas(64) double sum_lanes[16];
  _mm512_store_pd(sum_lanes, low);
  _mm512_store_pd(sum_lanes + 8, high);
  const double sum = sum_of_lanes(sum_lanes);
  const float lse = static_cast<float>(static_cast<double>(_mm512_cvtss_f32(m)) + std::log(sum));
  if (label < 0) {  // ignored
    if (write_grad) std::memset(row, 0, static_cast<size_t>(V) * sizeof(T));
    return 0.0f;
  }
  const float picked = to_float(row[label]);
  if (!write_grad) return lse - picked;
  const __m512 l = _mm512_set1_ps(lse);
  for (int64_t j = 0; j < body; j += 16)
    store16(row + j, kAll, exp16(_mm512_sub_ps(load16(row + j, kAll), l)));
  if (tail) store16(row + body, tail, exp16(_mm512_sub_ps(load16(row + body, tail), l)));
  // The one-hot, from the softmax value the pass computed (the same lanes, the same bits).
  const float p = _mm512_cvtss_f32(exp16(_mm512_sub_ps(_mm512_set1_ps(picked), l)));
  set_value(row + label, p - 1.0f);
  return lse - picked;
}

// ---- AVX2: row_kernel's lanes and arithmetic, 8 lanes per instruction ----
#define LOOM_AVX2 __attribute__((target("avx2,fma")))

LOOM_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
LOOM_AVX2 inline __m256 load8(const uint16_t* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
LOOM_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
LOOM_AVX2 inline void store8(uint16_t* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0),
                               _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // Words 0-3 and 4-7 sit in the low 64 bits of either half after the pack.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// 2^e for e in [-126, 127].
LOOM_AVX2 inline __m256 power_of_two(__m256i e) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
}

// exp16's arithmetic; scalef(p, n) as p · 2^⌊n/2⌋ · 2^(n-⌊n/2⌋): n ≥ -150 here, so both factors
// are normal, the first product is exact and the second rounds once, as scalef rounds.
LOOM_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-104.0f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  for (float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i k = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(k, 1);
  return _mm256_mul_ps(_mm256_mul_ps(p, power_of_two(half)),
                       power_of_two(_mm256_sub_epi32(k, half)));
}

// Eight fp32 values added into four fp64 lanes each.
LOOM_AVX2 inline void add_wide(__m256d& low, __m256d& high, __m256 e) {
  low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
  high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
}

template <class T>
LOOM_AVX2 float row_kernel_avx2(T* row, int64_t V, int64_t label, bool write_grad) {
  const int64_t body = V / 16 * 16, left = V - body;
  // The tail as the AVX-512 kernel's masked loads read it: zeros past the row.
  alignas(32) T tail[16] = {};
  std::memcpy(tail, row + body, static_cast<size_t>(left) * sizeof(T));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep0 = _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), lane));
  const __m256 keep1 = _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left) - 8), lane));
  __m256 most0 = _mm256_set1_ps(-INFINITY), most1 = most0;
  for (int64_t j = 0; j < body; j += 16) {
    most0 = _mm256_max_ps(most0, load8(row + j));
    most1 = _mm256_max_ps(most1, load8(row + j + 8));
  }
  if (left) {
    most0 = _mm256_blendv_ps(most0, _mm256_max_ps(most0, load8(tail)), keep0);
    most1 = _mm256_blendv_ps(most1, _mm256_max_ps(most1, load8(tail + 8)), keep1);
  }
  alignas(32) float most_lanes[16];
  _mm256_store_ps(most_lanes, most0);
  _mm256_store_ps(most_lanes + 8, most1);
  const float most = max_of_lanes(most_lanes);
  const __m256 m = _mm256_set1_ps(most);

  // Lanes 0-3, 4-7 (the AVX-512 kernel's `low`), 8-11, 12-15 (its `high`).
  __m256d s0 = _mm256_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
  for (int64_t j = 0; j < body; j += 16) {
    const __m256 e0 = exp8(_mm256_sub_ps(load8(row + j), m));
    const __m256 e1 = exp8(_mm256_sub_ps(load8(row + j + 8), m));
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e0)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e0, 1)));
    s2 = _mm256_add_pd(s2, _mm256_cvtps_pd(_mm256_castps256_ps128(e1)));
    s3 = _mm256_add_pd(s3, _mm256_cvtps_pd(_mm256_extractf128_ps(e1, 1)));
  }
  if (left) {
    add_wide(s0, s1, _mm256_and_ps(exp8(_mm256_sub_ps(load8(tail), m)), keep0));
    add_wide(s2, s3, _mm256_and_ps(exp8(_mm256_sub_ps(load8(tail + 8), m)), keep1));
  }
  alignas(32) double sum_lanes[16];
  _mm256_store_pd(sum_lanes, s0);
  _mm256_store_pd(sum_lanes + 4, s1);
  _mm256_store_pd(sum_lanes + 8, s2);
  _mm256_store_pd(sum_lanes + 12, s3);
  const double sum = sum_of_lanes(sum_lanes);
  const float lse = static_cast<float>(static_cast<double>(most) + std::log(sum));
  if (label < 0) {  // ignored
    if (write_grad) std::memset(row, 0, static_cast<size_t>(V) * sizeof(T));
    return 0.0f;
  }
  const float picked = to_float(row[label]);
  if (!write_grad) return lse - picked;
  const __m256 l = _mm256_set1_ps(lse);
  for (int64_t j = 0; j < body; j += 8) store8(row + j, exp8(_mm256_sub_ps(load8(row + j), l)));
  if (left) {
    store8(tail, exp8(_mm256_sub_ps(load8(tail), l)));
    store8(tail + 8, exp8(_mm256_sub_ps(load8(tail + 8), l)));
    std::memcpy(row + body, tail, static_cast<size_t>(left) * sizeof(T));
  }
  const float p = _mm256_cvtss_f32(exp8(_mm256_sub_ps(_mm256_set1_ps(picked), l)));
  set_value(row + label, p - 1.0f);
  return lse - picked;
}

template <class T>
void all_rows(T* data, int64_t n, int64_t V, const int64_t* labels, int64_t ignore_index,
              bool write_grad, bool avx512, float* out) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t label = labels[r] == ignore_index ? -1 : labels[r];
      out[r] = avx512 ? row_kernel(data + r * V, V, label, write_grad)
                      : row_kernel_avx2(data + r * V, V, label, write_grad);
    }
  });
}
#endif

}  // namespace

bool softmax_rows(at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index,
                  bool write_grad, at::Tensor& row_loss) {
#if defined(__x86_64__)
  const cpu::KernelIsa isa = cpu::kernel_isa();
  const bool avx512 = isa == cpu::KernelIsa::avx512;
  const auto dtype = logits.scalar_type();
  if (isa == cpu::KernelIsa::scalar || aten_forced() || !logits.is_cpu() || logits.dim() != 2 ||
      !logits.is_contiguous() || (dtype != at::kFloat && dtype != at::kBFloat16) ||
      labels.scalar_type() != at::kLong || !labels.is_cpu() || logits.size(1) == 0)
    return false;
  const int64_t n = logits.size(0), V = logits.size(1);
  const at::Tensor flat_labels = labels.contiguous();
  LOOM_CHECK(flat_labels.numel() == n, "softmax_rows: ", n, " rows but ", flat_labels.numel(),
             " labels");
  const int64_t* label = flat_labels.data_ptr<int64_t>();  // checked by the caller
  row_loss = at::empty({n}, logits.options().dtype(at::kFloat));
  float* out = row_loss.data_ptr<float>();
  if (dtype == at::kFloat)
    all_rows(logits.data_ptr<float>(), n, V, label, ignore_index, write_grad, avx512, out);
  else
    all_rows(reinterpret_cast<uint16_t*>(logits.data_ptr<at::BFloat16>()), n, V, label,
             ignore_index, write_grad, avx512, out);
  return true;
#else
  (void)logits, (void)labels, (void)ignore_index, (void)write_grad, (void)row_loss;
  return false;
#endif
}

}  // namespace loom::nn::detail
