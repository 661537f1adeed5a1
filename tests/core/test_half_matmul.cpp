// Note [Half matmuls through fp32] (loom/nn.h): a half-dtype Linear, attention and the fused
// loss widened to fp32 sgemm on CPUs that emulate the half dtype. Both paths run on every CPU
// (set_half_matmul_override), so the widened one is checked where the native one is fast too.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "loom/error.h"
#include "loom/loss.h"
#include "loom/memory.h"
#include "loom/nn.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using nn::HalfMatmul;

// Restores the CPU's own choice when a test ends, pass or fail.
struct Override {
  explicit Override(HalfMatmul path) { nn::set_half_matmul_override(path); }
  ~Override() { nn::set_half_matmul_override(std::nullopt); }
};

// The widened product is the fp32 product of the half values, rounded once: forward and the
// gradients of all three operands, against the same arithmetic written out in fp32 autograd.
TEST(HalfMatmul, LinearThroughFp32IsTheFp32ProductOfTheHalfValuesRoundedOnce) {
  at::manual_seed(3);
  // 4096 inputs: the weight is widened in blocks of 256 rows, so 600 outputs take three.
  for (const auto& [in, out] : {std::pair<int64_t, int64_t>{24, 7}, {4096, 600}})
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(std::string(c10::toString(dtype)) + " " + std::to_string(in) + " -> " + std::to_string(out));
    const at::Tensor x = at::randn({3, 5, in}).to(dtype).requires_grad_();
    const at::Tensor w = (at::randn({out, in}) / std::sqrt(double(in))).to(dtype).requires_grad_();
    const at::Tensor b = at::randn({out}).to(dtype).requires_grad_();
    const at::Tensor gy = at::randn({3, 5, out}).to(dtype);
    const at::Tensor y = nn::linear_through_fp32(x, w, b);
    ASSERT_EQ(y.scalar_type(), dtype);
    y.backward(gy);

    // The reference: fp64 products of the same half values, rounded to the dtype once.
    const at::Tensor xd = x.detach().to(at::kDouble).requires_grad_();
    const at::Tensor wd = w.detach().to(at::kDouble).requires_grad_();
    const at::Tensor bd = b.detach().to(at::kDouble).requires_grad_();
    const at::Tensor yd = at::linear(xd, wd, bd);
    yd.backward(gy.to(at::kDouble));
    // fp32 accumulation against fp64: at most one rounding step of the half dtype apart.
    const double tol = dtype == at::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
    auto close = [&](const at::Tensor& got, const at::Tensor& want) {
      const at::Tensor g = got.to(at::kDouble), r = want.to(dtype).to(at::kDouble);
      return at::allclose(g, r, tol, tol * 1e-2);
    };
    EXPECT_TRUE(close(y, yd));
    EXPECT_TRUE(close(x.grad(), xd.grad()));
    EXPECT_TRUE(close(w.grad(), wd.grad()));
    EXPECT_TRUE(close(b.grad(), bd.grad()));
    EXPECT_EQ(x.grad().scalar_type(), dtype);
    EXPECT_EQ(w.grad().scalar_type(), dtype);
  }
}

// A LOOM_HALF_MATMUL that names no path is an error naming the variable and its values.
TEST(HalfMatmul, AnUnknownLoomHalfMatmulIsAnErrorListingItsValues) {
  ::setenv("LOOM_HALF_MATMUL", "fast", 1);
  try {
    nn::half_matmul_path(at::kBFloat16);
    ADD_FAILURE() << "LOOM_HALF_MATMUL=fast was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("LOOM_HALF_MATMUL='fast': use native"), std::string::npos)
        << e.what();
  }
  ::setenv("LOOM_HALF_MATMUL", "fp32", 1);
  EXPECT_EQ(nn::half_matmul_path(at::kBFloat16), HalfMatmul::through_fp32);
  EXPECT_EQ(nn::half_matmul_path(at::kFloat), HalfMatmul::native);
  ::unsetenv("LOOM_HALF_MATMUL");
}

// A Linear takes the widened path only where told (or where the CPU emulates the dtype), and
// both paths agree to the half dtype's rounding, under full-half weights and under autocast.
TEST(HalfMatmul, LinearAgreesOnBothPathsInHalfWeightsAndUnderAutocast) {
  at::manual_seed(5);
  nn::Linear linear(32, 16);
  const at::Tensor x = at::randn({4, 32});
  auto run = [&](HalfMatmul path, bool autocast) {
    Override use(path);
    EXPECT_EQ(nn::half_matmul_path(at::kBFloat16), path);
    EXPECT_EQ(nn::half_matmul_path(at::kFloat), HalfMatmul::native);
    if (!autocast) {
      nn::Linear half(32, 16);
      half.weight.set_data(linear.weight.detach().to(at::kBFloat16));
      half.bias.set_data(linear.bias.detach().to(at::kBFloat16));
      return half.forward(x.to(at::kBFloat16));
    }
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::Tensor y = linear.forward(x);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    return y;
  };
  for (const bool autocast : {false, true}) {
    SCOPED_TRACE(autocast ? "autocast" : "bf16 weights");
    const at::Tensor native = run(HalfMatmul::native, autocast);
    const at::Tensor wide = run(HalfMatmul::through_fp32, autocast);
    EXPECT_EQ(native.scalar_type(), at::kBFloat16);
    EXPECT_EQ(wide.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::allclose(native.to(at::kFloat), wide.to(at::kFloat), 1.0 / 64, 1e-3));
  }
}

// attention() widened agrees with LibTorch's half attention, causal and with a mask.
// The fused loss's head on the widened path goes through the weight a block at a time (1024
// rows of 1024 columns here, so 5000 rows take five, the last partial): the loss and all three
// gradients are the fp64 ones of the same half values to fp32's accuracy, and the pass holds
// the head's fp32 gradient and one block beside it, not a widened copy of the whole head too.
TEST(HalfMatmul, FusedLossWidensTheHeadABlockAtATime) {
  memory::install_cpu_tracker();
  at::manual_seed(5);
  const int64_t N = 6, D = 1024, V = 5000;
  const at::Tensor x = at::randn({N, D}).to(at::kBFloat16).requires_grad_();
  const at::Tensor w = (at::randn({V, D}) / 32.0).to(at::kBFloat16).requires_grad_();
  const at::Tensor b = (at::randn({V}) * 0.1).to(at::kBFloat16).requires_grad_();
  const at::Tensor labels = at::randint(V, {N}, at::kLong);
  labels[2] = -100;  // an ignored row
  int64_t transient = 0;
  at::Tensor loss;
  {
    Override widened(HalfMatmul::through_fp32);
    const int64_t held = memory::cpu_stats().current_bytes;
    memory::reset_cpu_peak();
    loss = nn::linear_cross_entropy_sum(x, w, b, labels, -100, 4);
    transient = memory::cpu_stats().peak_bytes - held;
    loss.backward();
  }
  const at::Tensor xd = x.detach().to(at::kDouble).requires_grad_();
  const at::Tensor wd = w.detach().to(at::kDouble).requires_grad_();
  const at::Tensor bd = b.detach().to(at::kDouble).requires_grad_();
  const at::Tensor want = at::cross_entropy_loss(at::linear(xd, wd, bd), labels, {},
                                                 at::Reduction::Sum, -100);
  want.backward();
  EXPECT_NEAR(loss.item<double>(), want.item<double>(), 1e-4 * std::abs(want.item<double>()));
  auto close = [](const at::Tensor& got, const at::Tensor& ref) {  // one bf16 step apart
    return at::allclose(got.to(at::kDouble), ref.to(at::kBFloat16).to(at::kDouble), 1.0 / 128,
                        1.0 / 128 * ref.abs().max().item<double>());
  };
  EXPECT_TRUE(close(x.grad(), xd.grad()));
  EXPECT_TRUE(close(w.grad(), wd.grad()));
  EXPECT_TRUE(close(b.grad(), bd.grad()));
  // The fp32 head gradient (V x D x 4 B, 20.5 MB) and at most one 4 MiB widened block; a whole
  // widened head would add another 20.5 MB.
  const int64_t head = V * D * 4;
  std::printf("fused loss, widened path: %.1f MB beside a %.1f MB head\n", transient / 1e6,
              head / 1e6);
  EXPECT_LT(transient, head + head / 2) << transient << " bytes beside a " << head << "-byte head";
}

TEST(HalfMatmul, AttentionAgreesOnBothPaths) {
  at::manual_seed(9);
  const at::Tensor q = at::randn({2, 2, 8, 16}).to(at::kBFloat16);
  const at::Tensor k = at::randn({2, 2, 8, 16}).to(at::kBFloat16);
  const at::Tensor v = at::randn({2, 2, 8, 16}).to(at::kBFloat16);
  const at::Tensor keep = at::rand({8, 8}) > 0.3;
  for (const bool causal : {true, false}) {
    // Every query keeps its own key, so no row is all masked.
    const std::optional<at::Tensor> mask =
        causal ? std::nullopt : std::optional<at::Tensor>(keep.logical_or(at::eye(8, at::kBool)));
    at::Tensor native, wide;
    {
      Override use(HalfMatmul::native);
      native = nn::attention(q, k, v, mask, 0.0, causal);
    }
    {
      Override use(HalfMatmul::through_fp32);
      wide = nn::attention(q, k, v, mask, 0.0, causal);
    }
    EXPECT_EQ(wide.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::allclose(native.to(at::kFloat), wide.to(at::kFloat), 1.0 / 32, 1e-2));
  }
}

// The losses of the tiny GPT's first six steps on `path`, the job's text extended by `extra`.
std::vector<double> six_losses(HalfMatmul path, const std::string& extra,
                               std::vector<std::string> settings) {
  Override use(path);
  test::TempDir dir;
  settings.push_back("train.max_steps=6");
  auto trainer = Trainer::from_text(test::tiny_gpt_job(dir.str()) + extra, dir.path(), settings);
  trainer->run();
  std::vector<double> out;
  std::istringstream in(test::read_text(dir / "metrics.jsonl"));
  const std::regex field("\"loss\":([^,}]+)");
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_search(line, m, field)) out.push_back(std::stod(m[1]));
  }
  return out;
}

void expect_alike(const std::vector<double>& native, const std::vector<double>& wide) {
  ASSERT_EQ(native.size(), 6u);
  ASSERT_EQ(wide.size(), native.size());
  for (size_t i = 0; i < native.size(); ++i) EXPECT_NEAR(wide[i], native[i], 0.02 * native[i]) << i;
  // Not the same bits: the override reached the model's products (another summation order).
  EXPECT_NE(wide, native);
}

// The tiny GPT in full_bf16 trains alike on both paths (every matmul of it: the blocks'
// Linears, attention and the fused loss's head).
TEST(HalfMatmul, AFullBf16GptTrainsAlikeOnBothPaths) {
  const std::vector<std::string> bf16 = {"precision.mode=\"full_bf16\""};
  expect_alike(six_losses(HalfMatmul::native, "", bf16),
               six_losses(HalfMatmul::through_fp32, "", bf16));
}

// nn::linear, the path-choosing at::linear that plugins call (tied heads, LoRA's adapters,
// MoE's experts): under autocast it is linear_through_fp32 of autocast's narrowed operands,
// bit for bit, on the widened path and at::linear's own product on the native one; a product
// of no rows (an expert that got no tokens) gives zero gradients on both.
TEST(HalfMatmul, NnLinearPicksThePathAndTakesEmptyInputs) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({5, 24});
  const at::Tensor w = (at::randn({40, 24}) * 0.2).requires_grad_();
  auto under_autocast = [&](auto&& body) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::Tensor y = body();
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    return y;
  };
  {
    Override use(HalfMatmul::through_fp32);
    const at::Tensor y = under_autocast([&] { return nn::linear(x, w); });
    const at::Tensor expected =
        nn::linear_through_fp32(x.to(at::kBFloat16), w.to(at::kBFloat16), at::Tensor());
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(y, expected));
  }
  {
    Override use(HalfMatmul::native);
    const at::Tensor y = under_autocast([&] { return nn::linear(x, w); });
    const at::Tensor expected = under_autocast([&] { return at::linear(x, w); });
    EXPECT_TRUE(at::equal(y, expected));
  }
  for (const HalfMatmul path : {HalfMatmul::native, HalfMatmul::through_fp32}) {
    Override use(path);
    const at::Tensor wh = w.detach().to(at::kBFloat16).requires_grad_();
    const at::Tensor bh = at::ones({40}, at::kBFloat16).requires_grad_();
    const at::Tensor none = at::zeros({0, 24}, at::kBFloat16).requires_grad_();
    const at::Tensor y = nn::linear(none, wh, bh);
    EXPECT_EQ(y.sizes(), (std::vector<int64_t>{0, 40}));
    y.sum().backward();
    ASSERT_TRUE(wh.grad().defined());
    EXPECT_EQ(wh.grad().abs().max().item<float>(), 0.0f);
    EXPECT_EQ(bh.grad().abs().max().item<float>(), 0.0f);
  }
}

// An MoE GPT in full_bf16 (its experts' products are nn::linear) and LoRA adapters under bf16
// autocast train alike on both paths.
TEST(HalfMatmul, MoeExpertsAndLoraAdaptersTrainAlikeOnBothPaths) {
  {
    SCOPED_TRACE("moe");
    const std::string moe = "\n[moe]\nnum_experts = 4\ntop_k = 2\nmoe_every = 1\n";
    const std::vector<std::string> bf16 = {"precision.mode=\"full_bf16\""};
    expect_alike(six_losses(HalfMatmul::native, moe, bf16),
                 six_losses(HalfMatmul::through_fp32, moe, bf16));
  }
  {
    SCOPED_TRACE("lora");
    const std::string lora =
        "\n[lora]\nr = 4\ntarget_modules = [\"qkv\", \"fc_in\"]\ninit_lora_weights = false\n";
    const std::vector<std::string> bf16 = {"precision.mode=\"bf16\""};
    expect_alike(six_losses(HalfMatmul::native, lora, bf16),
                 six_losses(HalfMatmul::through_fp32, lora, bf16));
  }
}

}  // namespace
}  // namespace loom
