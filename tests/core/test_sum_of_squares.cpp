// The gradient norm's sum of squares (core/src/sum_of_squares.cpp, through squared_norm in
// loom/step_driver.h): bit for bit the order Note [Sum of squares in one pass] documents, written
// out again here as plain scalar code; the same bits at any thread count; within rounding of an
// independent long-double sum; bf16 and strided gradients; inf and NaN carried to the norm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "loom/step_driver.h"

namespace loom {
namespace {

// The documented order: per chunk of 65536 elements (from the tensor's start) 16 fp64 lanes,
// element i into lane i mod 16 (a partial last row from lane 0), each square rounded to fp32
// first; lanes folded pairwise (j += j + 8, then + 4, + 2, + 1); chunk sums added in order.
double documented_sum(const std::vector<float>& x) {
  constexpr int64_t kChunk = 65536;
  const int64_t n = static_cast<int64_t>(x.size());
  double total = 0.0;
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t len = std::min(kChunk, n - start);
    double lane[16] = {};
    const int64_t whole = len / 16 * 16;
    for (int64_t i = 0; i < whole; ++i) {
      const float square = x[start + i] * x[start + i];
      lane[i % 16] += static_cast<double>(square);
    }
    for (int64_t i = whole; i < len; ++i) {
      const float square = x[start + i] * x[start + i];
      lane[i - whole] += static_cast<double>(square);
    }
    for (int width = 8; width >= 1; width /= 2)
      for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
    total += lane[0];
  }
  return total;
}

std::vector<float> values_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous().to(at::kFloat);
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

double norm_squared(const at::Tensor& t) { return squared_norm({t}).item<double>(); }

uint64_t bits_of(double d) {
  uint64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

// Sizes below a chunk, at chunk and lane edges, and across several chunks with a ragged tail.
const std::vector<int64_t> kSizes = {0, 1, 15, 16, 17, 1000, 65535, 65536, 65537, 3 * 65536 + 37};

TEST(SumOfSquares, Fp32IsTheDocumentedOrderBitForBit) {
  at::manual_seed(7);
  for (const int64_t n : kSizes) {
    const at::Tensor g = at::randn({n}) * 3.0;
    EXPECT_EQ(bits_of(norm_squared(g)), bits_of(documented_sum(values_of(g)))) << "n=" << n;
  }
}

TEST(SumOfSquares, WithinRoundingOfALongDoubleSum) {
  at::manual_seed(8);
  const at::Tensor g = at::randn({5 * 65536 + 11}) * 1e-3;
  long double exact = 0;  // each fp32 square is exact in long double; the adds nearly so
  for (const float v : values_of(g)) exact += static_cast<long double>(v * v);
  const double got = norm_squared(g);
  EXPECT_NEAR(got, static_cast<double>(exact), 1e-12 * static_cast<double>(exact));
  // And ATen's own order of the same squares, the norm loom took before this pass.
  const double aten = at::sum(g.pow(2), at::kDouble).item<double>();
  EXPECT_NEAR(got, aten, 1e-12 * aten);
}

TEST(SumOfSquares, TheThreadCountChangesNoBit) {
  at::manual_seed(9);
  const at::Tensor g = at::randn({7 * 65536 + 5});
  const int threads = at::get_num_threads();
  std::vector<uint64_t> seen;
  for (const int t : {1, 2, 3}) {
    at::set_num_threads(t);
    seen.push_back(bits_of(norm_squared(g)));
  }
  at::set_num_threads(threads);
  EXPECT_EQ(seen[0], seen[1]);
  EXPECT_EQ(seen[0], seen[2]);
}

TEST(SumOfSquares, Bf16AndStridedGradientsSumTheirValues) {
  at::manual_seed(10);
  const at::Tensor g = at::randn({300, 700});
  const at::Tensor half = g.to(at::kBFloat16);
  // bf16 widens to fp32 exactly, so its sum is the fp32 sum of the widened values.
  EXPECT_EQ(bits_of(norm_squared(half)), bits_of(norm_squared(half.to(at::kFloat))));
  // A transposed gradient sums as its contiguous copy (the order is the copy's).
  const at::Tensor t = g.t();
  ASSERT_FALSE(t.is_contiguous());
  EXPECT_EQ(bits_of(norm_squared(t)), bits_of(norm_squared(t.contiguous())));
  // Other dtypes keep ATen's fp32 squares in fp64.
  const at::Tensor wide = g.to(at::kDouble);
  EXPECT_NEAR(norm_squared(wide), at::sum(g.pow(2), at::kDouble).item<double>(),
              1e-12 * at::sum(g.pow(2), at::kDouble).item<double>());
}

TEST(SumOfSquares, InfAndNanReachTheNorm) {
  at::Tensor g = at::ones({65536 + 3});
  g[65536 + 1] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(norm_squared(g)));
  g[17] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(norm_squared(g)));
  // A square past fp32's range is inf, as fp32 arithmetic makes it.
  EXPECT_TRUE(std::isinf(norm_squared(at::full({4}, 2e19f))));
}

TEST(SumOfSquares, SeveralTensorsTotalTheirSums) {
  at::manual_seed(11);
  const at::Tensor a = at::randn({65536 * 2 + 9}), b = at::randn({33});
  const double total = squared_norm({a, b}).item<double>();
  EXPECT_EQ(bits_of(total), bits_of(documented_sum(values_of(a)) + documented_sum(values_of(b))));
  EXPECT_EQ(squared_norm({}).item<double>(), 0.0);
}

}  // namespace
}  // namespace loom
