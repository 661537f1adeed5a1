// Note [Fused row ops]: a Llama layer's RMSNorms, its SwiGLU and its rotary embedding were
// ATen's composite ops: RMSNorm six passes forward and about ten backward (pow, mean, rsqrt,
// two products, and their backwards with a sum for each product), SwiGLU three and three with
// silu(g) kept as a third activation, RoPE five (a neg, a cat, two products, an add) and more
// backward (two narrows' zero-filled gradients). At Llama ~124M's shapes on 2 threads they
// took 3.6, 3.6 and 1.9 ms per call, forward and backward: ~7 % of the training step
// (docs/BENCHMARKS.md, "Llama's row ops fused"). Here each is one pass forward and one
// backward, over the rows (RMSNorm, RoPE) or the elements (SwiGLU), from the inputs alone:
// - RMSNorm keeps x and one fp32 rstd per row; backward, gx = rstd·(go·w − n·mean(go·w·n)) with
//   n = x·rstd, and w's gradient summed over fixed chunks of 32 rows, the chunks in order.
// - SwiGLU keeps g and u (not silu(g)), recomputing the exponential backward.
// - RoPE keeps nothing but cos and sin: its backward is rotate_half's transpose.
// Each element is computed in fp32 by a fixed sequence of roundings (-ffp-contract=off, sums in
// 16 lanes folded pairwise), so the AVX-512, AVX2 and scalar paths (three compilations of the
// same loops, Note [Kernel ISA cap]) and any thread count give the same bits. bf16 values are
// widened, computed in fp32 and rounded once when stored, to nearest even with NaN as 0x7FC0
// (as c10::BFloat16 rounds): ATen's bf16 ops round each intermediate too (silu(g), x·rstd, each
// RoPE product), so in bf16 the results are closer to exact than theirs, and differ from
// theirs by bf16 roundings. (Rounding the intermediates as ATen does made SwiGLU's AVX2 loop
// 16 % slower than ATen's own AVX2 kernels.) The exponential is
// e^r·2^n by a Taylor series to r^7 (as in Note [Softmax rows in one kernel]), within a few ulps
// of libm's: the results agree with ATen's to fp32 rounding, not bit for bit.
#include "fused_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

#include "adamw_bf16_element.h"
#include "loom/kernel_isa.h"

namespace loom::nn::detail {
namespace {

#define LOOM_INLINE __attribute__((always_inline)) inline

LOOM_INLINE float load(const float* p, int64_t i) { return p[i]; }
LOOM_INLINE float load(const uint16_t* p, int64_t i) { return adamw_bf16::bf16_to_float(p[i]); }
LOOM_INLINE void store(float* p, int64_t i, float v) { p[i] = v; }
LOOM_INLINE void store(uint16_t* p, int64_t i, float v) {
  p[i] = adamw_bf16::float_to_bf16_nearest(v);
}
// The exponential's clamp, [-87, 88] (so 2^n stays a normal float), as values the compiler
// cannot see: with constants it folded e^-87 and e^88 and computed SwiGLU's quotient for all
// three cases in every lane, g / (1 + e^88) a subnormal whose microcode assist made the loop
// 4x slower than ATen's; opaque bounds leave one select before the exponential.
struct ExpBounds {
  float lo = -87.0f, hi = 88.0f;
  ExpBounds() {
#if defined(__x86_64__)
    asm("" : "+x"(lo), "+x"(hi));
#endif
  }
};

// e^x, x clamped to the bounds (a NaN stays NaN).
LOOM_INLINE float exp_clamped(float x, const ExpBounds& bounds) {
  x = x < bounds.lo ? bounds.lo : x;
  x = x > bounds.hi ? bounds.hi : x;
  const float shifted = x * 1.44269504088896341f + 12582912.0f;  // 1.5·2^23: n in its low bits
  const float n = shifted - 12582912.0f;
  float r = x - n * 0.693359375f;  // ln2 = hi + lo, n·hi exact
  r = r - n * -2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t k = std::bit_cast<uint32_t>(shifted) - 0x4B400000u;  // n as an integer
  return p * std::bit_cast<float>((k + 127u) << 23);
}

constexpr int kLanes = 16;
LOOM_INLINE float fold_lanes(float* lane) {  // pairwise, in place
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
  return lane[0];
}

// ---- RMSNorm ----
template <typename S>
LOOM_INLINE void rms_forward_rows(const S* x, const S* w, S* y, float* rstd, int64_t begin,
                                  int64_t end, int64_t C, float eps) {
  for (int64_t r = begin; r < end; ++r) {
    const S* xr = x + r * C;
    S* yr = y + r * C;
    float lane[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= C; j += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const float v = load(xr, j + l);
        lane[l] += v * v;
      }
    for (int l = 0; j < C; ++j, ++l) {
      const float v = load(xr, j);
      lane[l] += v * v;
    }
    const float s = 1.0f / std::sqrt(fold_lanes(lane) / static_cast<float>(C) + eps);
    rstd[r] = s;
    for (int64_t k = 0; k < C; ++k) store(yr, k, (load(xr, k) * s) * load(w, k));
  }
}

constexpr int64_t kGwRows = 32;  // rows per partial sum of w's gradient

// Rows [begin, end) of one chunk; gw_part (C floats) gets the chunk's sum of go·n when set.
template <typename S>
LOOM_INLINE void rms_backward_rows(const S* go, const S* x, const S* w, const float* rstd, S* gx,
                                   float* gw_part, int64_t begin, int64_t end, int64_t C) {
  for (int64_t r = begin; r < end; ++r) {
    const S* gr = go + r * C;
    const S* xr = x + r * C;
    S* out = gx + r * C;
    const float s = rstd[r];
    float lane[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= C; j += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const float gn = load(gr, j + l) * load(w, j + l);
        lane[l] += gn * (load(xr, j + l) * s);
      }
    for (int l = 0; j < C; ++j, ++l) {
      const float gn = load(gr, j) * load(w, j);
      lane[l] += gn * (load(xr, j) * s);
    }
    const float mean_dot = fold_lanes(lane) / static_cast<float>(C);
    for (int64_t k = 0; k < C; ++k) {
      const float n = load(xr, k) * s;
      store(out, k, s * (load(gr, k) * load(w, k) - n * mean_dot));
    }
    if (gw_part)
      for (int64_t k = 0; k < C; ++k) gw_part[k] += load(gr, k) * (load(xr, k) * s);
  }
}

// ---- SwiGLU ----
template <typename S>
LOOM_INLINE void swiglu_forward_range(const S* g, const S* u, S* out, int64_t begin, int64_t end) {
  const ExpBounds bounds;
  for (int64_t i = begin; i < end; ++i) {
    const float gi = load(g, i);
    const float silu = gi / (1.0f + exp_clamped(-gi, bounds));
    store(out, i, silu * load(u, i));
  }
}

// One element's gradients; kG and kU say which are written (loops without branches, so each
// case vectorises). One division: silu(g) as g·sigmoid(g) here, within an ulp of forward's
// g / (1 + e^-g).
template <bool kG, bool kU, typename S>
LOOM_INLINE void swiglu_backward_loop(const S* go, const S* g, const S* u, S* gg, S* gu,
                                      int64_t begin, int64_t end) {
  const ExpBounds bounds;
  for (int64_t i = begin; i < end; ++i) {
    const float gi = load(g, i), grad = load(go, i);
    const float sigmoid = 1.0f / (1.0f + exp_clamped(-gi, bounds));
    if constexpr (kU) store(gu, i, grad * (gi * sigmoid));
    if constexpr (kG) {
      const float grad_silu = grad * load(u, i);
      store(gg, i, grad_silu * sigmoid * (1.0f + gi * (1.0f - sigmoid)));
    }
  }
}
template <typename S>
LOOM_INLINE void swiglu_backward_range(const S* go, const S* g, const S* u, S* gg, S* gu,
                                       int64_t begin, int64_t end) {
  if (gg && gu)
    swiglu_backward_loop<true, true>(go, g, u, gg, gu, begin, end);
  else if (gg)
    swiglu_backward_loop<true, false>(go, g, u, gg, gu, begin, end);
  else if (gu)
    swiglu_backward_loop<false, true>(go, g, u, gg, gu, begin, end);
}

// ---- RoPE ----
// Forward: out_j = x_j·c_j + (−x_{j+h})·s_j (j < h), x_j·c_j + x_{j−h}·s_j (j ≥ h).
// Backward (x = go): gx_j = go_j·c_j + go_{j+h}·s_{j+h} (j < h), go_j·c_j − go_{j−h}·s_{j−h}.
// Rows in row-major order of the leading dimensions (shared by two layouts of one shape), each
// row's offsets kept by counting: a division per row and dimension cost as much as the row.
struct RowWalk {
  const RowLayout& a;
  const RowLayout& b;
  int64_t index[RowLayout::kMaxLead] = {};
  int64_t at_a = 0, at_b = 0;
  RowWalk(const RowLayout& a_, const RowLayout& b_, int64_t row) : a(a_), b(b_) {
    for (int d = a.lead - 1; d >= 0; --d) {
      index[d] = row % a.size[d];
      row /= a.size[d];
      at_a += index[d] * a.stride[d];
      at_b += index[d] * b.stride[d];
    }
  }
  int64_t position() const { return index[a.lead - 1]; }  // along dimension -2
  void next() {
    for (int d = a.lead - 1; d >= 0; --d) {
      at_a += a.stride[d];
      at_b += b.stride[d];
      if (++index[d] < a.size[d]) return;
      at_a -= a.size[d] * a.stride[d];
      at_b -= a.size[d] * b.stride[d];
      index[d] = 0;
    }
  }
};

template <typename S>
LOOM_INLINE void rotary_rows(bool backward, const S* x, const RowLayout& xl, const S* cos,
                             const S* sin, S* out, const RowLayout& ol, int64_t begin, int64_t end,
                             int64_t D) {
  const int64_t h = D / 2;
  RowWalk walk(xl, ol, begin);
  for (int64_t r = begin; r < end; ++r, walk.next()) {
    const S* xr = x + walk.at_a;
    S* o = out + walk.at_b;
    const S* c = cos + walk.position() * D;
    const S* s = sin + walk.position() * D;
    if (!backward) {
      for (int64_t j = 0; j < h; ++j)
        store(o, j, (load(xr, j) * load(c, j)) + (-load(xr, j + h) * load(s, j)));
      for (int64_t j = h; j < D; ++j)
        store(o, j, (load(xr, j) * load(c, j)) + (load(xr, j - h) * load(s, j)));
    } else {
      for (int64_t j = 0; j < h; ++j)
        store(o, j, (load(xr, j) * load(c, j)) + (load(xr, j + h) * load(s, j + h)));
      for (int64_t j = h; j < D; ++j)
        store(o, j, (load(xr, j) * load(c, j)) + -(load(xr, j - h) * load(s, j - h)));
    }
  }
}

// Each kernel compiled three times, for AVX-512 (x86-64-v4), AVX2 (v3) and the baseline; the
// bodies above inline into each.
#if defined(__x86_64__)
#define LOOM_ISA_VARIANTS(X)                       \
  X(v4, __attribute__((target("arch=x86-64-v4")))) \
  X(v3, __attribute__((target("arch=x86-64-v3")))) \
  X(base, )
#else
#define LOOM_ISA_VARIANTS(X) X(base, )
#endif

#define LOOM_DEFINE_KERNELS(isa, attr)                                                          \
  template <typename S>                                                                         \
  attr void rms_forward_##isa(const S* x, const S* w, S* y, float* rstd, int64_t b, int64_t e,  \
                              int64_t C, float eps) {                                           \
    rms_forward_rows(x, w, y, rstd, b, e, C, eps);                                              \
  }                                                                                             \
  template <typename S>                                                                         \
  attr void rms_backward_##isa(const S* go, const S* x, const S* w, const float* rstd, S* gx,   \
                               float* gw, int64_t b, int64_t e, int64_t C) {                    \
    rms_backward_rows(go, x, w, rstd, gx, gw, b, e, C);                                         \
  }                                                                                             \
  template <typename S>                                                                         \
  attr void swiglu_forward_##isa(const S* g, const S* u, S* out, int64_t b, int64_t e) {        \
    swiglu_forward_range(g, u, out, b, e);                                                      \
  }                                                                                             \
  template <typename S>                                                                         \
  attr void swiglu_backward_##isa(const S* go, const S* g, const S* u, S* gg, S* gu, int64_t b, \
                                  int64_t e) {                                                  \
    swiglu_backward_range(go, g, u, gg, gu, b, e);                                              \
  }                                                                                             \
  template <typename S>                                                                         \
  attr void rotary_##isa(bool backward, const S* x, const RowLayout& xl, const S* cos,          \
                         const S* sin, S* out, const RowLayout& ol, int64_t b, int64_t e,       \
                         int64_t D) {                                                           \
    rotary_rows(backward, x, xl, cos, sin, out, ol, b, e, D);                                   \
  }
LOOM_ISA_VARIANTS(LOOM_DEFINE_KERNELS)
#undef LOOM_DEFINE_KERNELS

// The compilation a call runs: the path kernel_isa() picks, where the CPU has the whole x86-64
// level the path was compiled for (kernel_isa() checks the AVX-512 and AVX2 parts the
// hand-written kernels use; the compiler may use the level's other instructions, BMI2 and the
// like, which a virtual CPU could leave out). Found once per call, before its threads split the
// work (kernel_isa() reads LOOM_KERNEL_ISA each time).
enum class Level { base, v3, v4 };
Level level() {
#if defined(__x86_64__)
  static const bool v3 = __builtin_cpu_supports("x86-64-v3");
  static const bool v4 = __builtin_cpu_supports("x86-64-v4");
  switch (cpu::kernel_isa()) {
    case cpu::KernelIsa::avx512:
      return v4 ? Level::v4 : v3 ? Level::v3 : Level::base;
    case cpu::KernelIsa::avx2:
      return v3 ? Level::v3 : Level::base;
    default:
      break;
  }
#endif
  return Level::base;
}

// Calls kernel_##isa<S>(args...) for the level `lv`.
#if defined(__x86_64__)
#define LOOM_DISPATCH(lv, kernel, S, ...) \
  switch (lv) {                           \
    case Level::v4:                       \
      kernel##_v4<S>(__VA_ARGS__);        \
      break;                              \
    case Level::v3:                       \
      kernel##_v3<S>(__VA_ARGS__);        \
      break;                              \
    default:                              \
      kernel##_base<S>(__VA_ARGS__);      \
      break;                              \
  }
#else
#define LOOM_DISPATCH(lv, kernel, S, ...) kernel##_base<S>(__VA_ARGS__);
#endif

constexpr int64_t kGrain = 32768;  // elements per task, as ATen's elementwise ops

template <typename S>
void rms_forward_typed(const S* x, const S* w, S* y, float* rstd, int64_t rows, int64_t C,
                       float eps) {
  const Level lv = level();
  at::parallel_for(
      0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(C, 1)),
      [&](int64_t b, int64_t e) { LOOM_DISPATCH(lv, rms_forward, S, x, w, y, rstd, b, e, C, eps) });
}

template <typename S>
void rms_backward_typed(const S* go, const S* x, const S* w, const float* rstd, S* gx, float* gw,
                        int64_t rows, int64_t C) {
  const int64_t chunks = (rows + kGwRows - 1) / kGwRows;
  // Each chunk's partial sum of w's gradient, added in chunk order: any thread count, the
  // same sum.
  std::vector<float> parts(gw ? static_cast<size_t>(chunks * C) : 0, 0.0f);
  const Level lv = level();
  at::parallel_for(0, chunks, std::max<int64_t>(1, kGrain / std::max<int64_t>(kGwRows * C, 1)),
                   [&](int64_t b, int64_t e) {
                     for (int64_t chunk = b; chunk < e; ++chunk) {
                       float* part = gw ? parts.data() + chunk * C : nullptr;
                       const int64_t first = chunk * kGwRows;
                       const int64_t last = std::min(rows, first + kGwRows);
                       LOOM_DISPATCH(lv, rms_backward, S, go, x, w, rstd, gx, part, first, last, C)
                     }
                   });
  if (!gw) return;
  std::fill(gw, gw + C, 0.0f);
  for (int64_t chunk = 0; chunk < chunks; ++chunk)
    for (int64_t k = 0; k < C; ++k) gw[k] += parts[chunk * C + k];
}

}  // namespace

void rms_norm_forward(Elem e, const void* x, const void* w, void* y, float* rstd, int64_t rows,
                      int64_t C, float eps) {
  if (e == Elem::f32)
    rms_forward_typed(static_cast<const float*>(x), static_cast<const float*>(w),
                      static_cast<float*>(y), rstd, rows, C, eps);
  else
    rms_forward_typed(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
                      static_cast<uint16_t*>(y), rstd, rows, C, eps);
}

void rms_norm_backward(Elem e, const void* go, const void* x, const void* w, const float* rstd,
                       void* gx, float* gw, int64_t rows, int64_t C) {
  if (e == Elem::f32)
    rms_backward_typed(static_cast<const float*>(go), static_cast<const float*>(x),
                       static_cast<const float*>(w), rstd, static_cast<float*>(gx), gw, rows, C);
  else
    rms_backward_typed(static_cast<const uint16_t*>(go), static_cast<const uint16_t*>(x),
                       static_cast<const uint16_t*>(w), rstd, static_cast<uint16_t*>(gx), gw, rows,
                       C);
}

void swiglu_forward(Elem e, const void* g, const void* u, void* out, int64_t n) {
  auto run = [&](auto* typed_out) {
    using S = std::remove_pointer_t<decltype(typed_out)>;
    const S* tg = static_cast<const S*>(g);
    const S* tu = static_cast<const S*>(u);
    const Level lv = level();
    at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t end) {
      LOOM_DISPATCH(lv, swiglu_forward, S, tg, tu, typed_out, b, end)
    });
  };
  if (e == Elem::f32)
    run(static_cast<float*>(out));
  else
    run(static_cast<uint16_t*>(out));
}

void swiglu_backward(Elem e, const void* go, const void* g, const void* u, void* gg, void* gu,
                     int64_t n) {
  auto run = [&](auto* typed) {
    using S = std::remove_pointer_t<decltype(typed)>;
    const S* tgo = static_cast<const S*>(go);
    const S* tg = static_cast<const S*>(g);
    const S* tu = static_cast<const S*>(u);
    S* tgg = static_cast<S*>(gg);
    S* tgu = static_cast<S*>(gu);
    const Level lv = level();
    at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t end) {
      LOOM_DISPATCH(lv, swiglu_backward, S, tgo, tg, tu, tgg, tgu, b, end)
    });
  };
  if (e == Elem::f32)
    run(static_cast<float*>(nullptr));
  else
    run(static_cast<uint16_t*>(nullptr));
}

void rotary(Elem e, bool backward, const void* x, const RowLayout& x_rows, const void* cos,
            const void* sin, void* out, const RowLayout& out_rows, int64_t rows, int64_t D) {
  auto run = [&](auto* typed_out) {
    using S = std::remove_pointer_t<decltype(typed_out)>;
    const S* tx = static_cast<const S*>(x);
    const S* tc = static_cast<const S*>(cos);
    const S* ts = static_cast<const S*>(sin);
    const Level lv = level();
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(D, 1)),
                     [&](int64_t b, int64_t end) {
                       LOOM_DISPATCH(lv, rotary, S, backward, tx, x_rows, tc, ts, typed_out,
                                     out_rows, b, end, D)
                     });
  };
  if (e == Elem::f32)
    run(static_cast<float*>(out));
  else
    run(static_cast<uint16_t*>(out));
}

}  // namespace loom::nn::detail
