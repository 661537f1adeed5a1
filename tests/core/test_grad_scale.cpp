// The clipping factor applied in one pass (core/src/grad_scale.cpp, through scale_gradients in
// loom/step_driver.h): the bits of at::_foreach_mul_ by a Scalar for fp32 and bf16 CPU
// gradients (bf16: the factor rounded to bf16 first, as ATen does) of every
// size about the chunk edges, many factors and values (subnormal, huge, signed zeros), at 1, 2
// and 3 threads; the others (fp16, strided, fp64) still scaled, by ATen; and written out as the
// scalar arithmetic Note [Gradient scale in one pass] states.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "loom/step_driver.h"

namespace loom {
namespace {

// Gradients of the sizes about the pass's 65536-element chunks, with the values ATen rounds at
// the edges: subnormals, the largest floats, signed zeros, and values a product's rounding
// decides (random mantissas).
std::vector<at::Tensor> gradients(at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  at::manual_seed(17);
  for (int64_t n : {0, 1, 15, 16, 17, 65535, 65536, 65537, 200003}) {
    at::Tensor t = at::randn({n}) * at::pow(2.0, at::randint(-140, 120, {n}).to(at::kFloat));
    if (n >= 16) {
      t[0] = 0.0;
      t[1] = -0.0;
      t[2] = std::numeric_limits<float>::denorm_min();
      t[3] = -3.0e38f;  // near the largest float, and finite in bf16 too
      t[4] = 1e-39f;
    }
    out.push_back(t.to(dtype));
  }
  out.push_back(at::randn({3, 5, 7}).to(dtype));
  return out;
}

TEST(GradScale, BitsAreForeachMulsForFp32AndBf16AtAnyThreadCount) {
  const int threads = at::get_num_threads();
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16})
    for (const double factor : {0.5, 0.3333333333333333, 1e-7, 0.9999999, 3.1e-41, 0.1234567891})
      for (const int t : {1, 2, 3}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " factor " + std::to_string(factor) +
                     ", " + std::to_string(t) + " threads");
        at::set_num_threads(t);
        const std::vector<at::Tensor> grads = gradients(dtype);
        std::vector<at::Tensor> mine, atens;
        for (const auto& g : grads) {
          mine.push_back(g.clone());
          atens.push_back(g.clone());
        }
        const int64_t version = mine.back()._version();
        scale_gradients(mine, factor);
        at::_foreach_mul_(atens, factor);
        EXPECT_GT(mine.back()._version(), version) << "an in-place change not counted";
        for (size_t i = 0; i < grads.size(); ++i) {
          // Bits, not values: -0.0 == 0.0 would pass a value comparison.
          const at::Tensor a = dtype == at::kFloat ? mine[i].view(at::kInt) : mine[i].view(at::kShort);
          const at::Tensor b = dtype == at::kFloat ? atens[i].view(at::kInt) : atens[i].view(at::kShort);
          const at::Tensor differ = (a != b).nonzero();
          EXPECT_EQ(differ.size(0), 0)
              << "tensor " << i << " of " << grads[i].numel() << ", first at element "
              << (differ.size(0) ? differ[0].item<int64_t>() : -1) << ": "
              << (differ.size(0) ? grads[i][differ[0].item<int64_t>()].item<float>() : 0.f)
              << " -> " << (differ.size(0) ? mine[i][differ[0].item<int64_t>()].item<float>() : 0.f)
              << " (ATen " << (differ.size(0) ? atens[i][differ[0].item<int64_t>()].item<float>() : 0.f)
              << ")";
        }
      }
  at::set_num_threads(threads);
}

// The Note's arithmetic written out as scalar code, element by element.
TEST(GradScale, EachElementIsTheProductRoundedAsTheNoteSays) {
  const double factor = 0.7071067811865476;
  const float f = static_cast<float>(factor);
  // bf16 gradients are scaled by the factor rounded to bf16 (nearest, ties to even).
  const uint32_t fb = std::bit_cast<uint32_t>(f);
  const float f_bf16 = std::bit_cast<float>(((fb + 0x7FFFu + ((fb >> 16) & 1u)) >> 16) << 16);
  ASSERT_NE(f_bf16, f);
  at::Tensor fp32 = gradients(at::kFloat)[8], bf16 = gradients(at::kBFloat16)[8];
  const at::Tensor fp32_before = fp32.clone(), bf16_before = bf16.clone();
  scale_gradients({fp32, bf16}, factor);
  const float* x = fp32_before.data_ptr<float>();
  const float* y = fp32.data_ptr<float>();
  const auto* xb = reinterpret_cast<const uint16_t*>(bf16_before.data_ptr<at::BFloat16>());
  const auto* yb = reinterpret_cast<const uint16_t*>(bf16.data_ptr<at::BFloat16>());
  int64_t wrong = 0;
  for (int64_t i = 0; i < fp32.numel(); ++i) {
    const float product = x[i] * f;
    wrong += std::bit_cast<uint32_t>(product) != std::bit_cast<uint32_t>(y[i]);
    const float widened = std::bit_cast<float>(static_cast<uint32_t>(xb[i]) << 16);
    const uint32_t b = std::bit_cast<uint32_t>(widened * f_bf16);
    const auto nearest = static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    wrong += nearest != yb[i];
  }
  EXPECT_EQ(wrong, 0);
}

// What the pass does not take is still scaled, by ATen: fp16, fp64, a strided view.
TEST(GradScale, OtherDtypesAndLayoutsAreScaledByAten) {
  at::manual_seed(3);
  const at::Tensor base = at::randn({64, 32});
  std::vector<at::Tensor> mine = {base.to(at::kHalf), base.to(at::kDouble), base.clone().t()};
  std::vector<at::Tensor> atens = {base.to(at::kHalf), base.to(at::kDouble), base.clone().t()};
  ASSERT_FALSE(mine[2].is_contiguous());
  scale_gradients(mine, 0.25);
  at::_foreach_mul_(atens, 0.25);
  for (size_t i = 0; i < mine.size(); ++i) EXPECT_TRUE(at::equal(mine[i], atens[i])) << i;
  EXPECT_FALSE(at::equal(mine[0], base.to(at::kHalf)));
  scale_gradients({}, 0.5);  // nothing to scale: nothing happens
}

}  // namespace
}  // namespace loom
