// One gradient's sum of squares. See sum_of_squares.h.
#include "sum_of_squares.h"

#include <ATen/Parallel.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <vector>

#include "adamw_bf16_element.h"

namespace loom {
namespace {

// Note [Sum of squares in one pass]: the global gradient norm (for clipping and the logged
// grad_norm) reads every gradient once more each step. As ATen ops, `sum(g.pow(2), kDouble)`,
// it was a pass writing the squares to a temporary and a second reading them back: for GPT-2's
// 124 M gradients at 2 threads on an Intel Xeon with AMX, 147 ms a step in fp32 and 135 ms in
// bf16, 4 % and 7 % of those steps; this one read takes 33 and 44 ms (docs/BENCHMARKS.md).
//
// The value is fixed by the arithmetic, not by the machine: each square is rounded to fp32 (what
// the old fp32 pow made), then added in fp64 into one of kLanes running sums, element i into
// lane i mod kLanes of its chunk; the lanes are folded pairwise in a fixed order, and the
// chunks' sums (kChunk elements each, from the tensor's start) added in order. So threads,
// which take whole chunks, and the ISA clone (each lane's adds are the same scalar fp64 adds in
// every vector width) cannot change a bit. It differs from ATen's order (a cascade of its own)
// in the last bits only; every caller (the default, ZeRO, offload and in-backward norms) comes
// here, so they still sum alike.
constexpr int kLanes = 16;
constexpr int64_t kChunk = int64_t{1} << 16;

template <typename Load>
inline double fold_chunk(int64_t n, Load load) {
  double lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const float v = load(i + j);
      const float square = v * v;
      lane[j] += square;
    }
  for (int j = 0; i < n; ++i, ++j) {
    const float v = load(i);
    const float square = v * v;
    lane[j] += square;
  }
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
  return lane[0];
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
double chunk_fp32(const float* __restrict x, int64_t n) {
  return fold_chunk(n, [x](int64_t i) { return x[i]; });
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
double chunk_bf16(const uint16_t* __restrict x, int64_t n) {
  return fold_chunk(n, [x](int64_t i) { return adamw_bf16::bf16_to_float(x[i]); });  // exact
}

template <typename T, typename Chunk>
double over_chunks(const T* x, int64_t n, Chunk chunk) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  if (chunks <= 1) return n > 0 ? chunk(x, n) : 0.0;
  std::vector<double> sums(static_cast<size_t>(chunks));
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      sums[c] = chunk(x + c * kChunk, std::min(kChunk, n - c * kChunk));
  });
  double total = 0.0;
  for (const double s : sums) total += s;
  return total;
}

}  // namespace

at::Tensor sum_of_squares(const at::Tensor& grad) {
  const auto type = grad.scalar_type();
  if (grad.is_cpu() && (type == at::kFloat || type == at::kBFloat16)) {
    const at::Tensor flat = grad.contiguous();
    const double total =
        type == at::kFloat
            ? over_chunks(flat.data_ptr<float>(), flat.numel(), chunk_fp32)
            : over_chunks(reinterpret_cast<const uint16_t*>(flat.data_ptr<at::BFloat16>()),
                          flat.numel(), chunk_bf16);
    return at::scalar_tensor(total, at::TensorOptions().dtype(at::kDouble));
  }
  // Other devices and dtypes: fp32 squares summed in fp64 by ATen, over slices of 1 M elements
  // (a whole tensor at once made an fp64 copy of its squares: three times the largest gradient
  // at once, 94 MiB for BERT's embedding, which set the peak of checkpointed runs).
  constexpr int64_t kSlice = int64_t{1} << 20;
  const at::Tensor flat = grad.reshape(-1);
  const int64_t n = flat.numel();
  if (n <= kSlice) return at::sum(flat.to(at::kFloat).pow(2), at::kDouble);
  at::Tensor total = at::zeros({}, flat.options().dtype(at::kDouble));
  for (int64_t start = 0; start < n; start += kSlice)
    total += at::sum(flat.narrow(0, start, std::min(kSlice, n - start)).to(at::kFloat).pow(2),
                     at::kDouble);
  return total;
}

}  // namespace loom
