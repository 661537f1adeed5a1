// nn::linear_cross_entropy_sum against LibTorch's unfused linear + cross_entropy: the loss and
// the gradients of x, the head and its bias, across chunk sizes, ignored rows, autocast, a frozen
// head and no-grad mode.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

#include "loom/loss.h"

namespace {

constexpr int64_t kIgnore = -100;

struct Case {
  at::Tensor x, weight, bias, labels;
};

Case make_case(int64_t B, int64_t T, int64_t D, int64_t V, bool with_bias, bool ignore_some) {
  at::manual_seed(7);
  Case c;
  c.x = at::randn({B, T, D}).requires_grad_();
  c.weight = (at::randn({V, D}) * 0.3).requires_grad_();
  if (with_bias) c.bias = (at::randn({V}) * 0.1).requires_grad_();
  c.labels = at::randint(0, V, {B, T}, at::kLong);
  if (ignore_some) {
    c.labels.index_put_({0, 0}, kIgnore);
    c.labels.index_put_({B - 1, T - 1}, kIgnore);
    c.labels.index_put_({0, T / 2}, kIgnore);
  }
  return c;
}

struct Result {
  at::Tensor loss, gx, gw, gb;
};

Result grads_of(const Case& c, const at::Tensor& loss) {
  for (const auto* t : {&c.x, &c.weight, &c.bias})
    if (t->defined() && t->grad().defined()) t->mutable_grad().zero_();
  (loss * 0.37).backward();  // a non-unit incoming gradient, as the engine's 1/targets gives
  Result r;
  r.loss = loss.detach();
  r.gx = c.x.grad().clone();
  if (c.weight.requires_grad()) r.gw = c.weight.grad().clone();
  if (c.bias.defined()) r.gb = c.bias.grad().clone();
  return r;
}

Result reference(const Case& c) {
  const at::Tensor logits = at::linear(c.x, c.weight, c.bias);
  const at::Tensor loss =
      at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                             c.labels.reshape({-1}), {}, at::Reduction::Sum, kIgnore);
  return grads_of(c, loss);
}

// CPU autocast in `dtype` for this object's life.
struct CpuAutocast {
  explicit CpuAutocast(at::ScalarType dtype) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
  }
  ~CpuAutocast() {
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
  }
};

Result fused(const Case& c, int64_t chunk_rows) {
  return grads_of(c, loom::nn::linear_cross_entropy_sum(c.x, c.weight, c.bias, c.labels, kIgnore,
                                                        chunk_rows));
}

void expect_close(const at::Tensor& got, const at::Tensor& want, double rtol, double atol,
                  const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  EXPECT_TRUE(at::allclose(got.to(at::kDouble), want.to(at::kDouble), rtol, atol))
      << what << ": max |diff| " << (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
}

void expect_same(const Result& got, const Result& want, double rtol, double atol) {
  expect_close(got.loss, want.loss, rtol, atol, "loss");
  expect_close(got.gx, want.gx, rtol, atol, "grad x");
  if (want.gw.defined()) expect_close(got.gw, want.gw, rtol, atol, "grad weight");
  if (want.gb.defined()) expect_close(got.gb, want.gb, rtol, atol, "grad bias");
}

TEST(LinearCrossEntropy, MatchesUnfusedAcrossChunkSizes) {
  const Case c = make_case(2, 13, 16, 37, /*with_bias=*/true, /*ignore_some=*/true);
  const Result want = reference(c);
  for (int64_t chunk : {1, 3, 7, 26, 100, 0}) {
    SCOPED_TRACE("chunk_rows " + std::to_string(chunk));
    expect_same(fused(c, chunk), want, 1e-5, 1e-6);
  }
}

TEST(LinearCrossEntropy, NoBiasNoIgnoredRows) {
  const Case c = make_case(3, 5, 8, 50, /*with_bias=*/false, /*ignore_some=*/false);
  expect_same(fused(c, 4), reference(c), 1e-5, 1e-6);
}

TEST(LinearCrossEntropy, FrozenHeadGetsNoGradient) {
  Case c = make_case(2, 6, 8, 20, /*with_bias=*/false, /*ignore_some=*/true);
  c.weight.requires_grad_(false);
  const Result got = fused(c, 5);
  EXPECT_FALSE(c.weight.grad().defined());
  expect_same(got, reference(c), 1e-5, 1e-6);
}

TEST(LinearCrossEntropy, AllRowsIgnoredIsZero) {
  Case c = make_case(1, 4, 8, 10, /*with_bias=*/true, /*ignore_some=*/false);
  c.labels.fill_(kIgnore);
  const Result got = fused(c, 3);
  EXPECT_EQ(got.loss.item<float>(), 0.0f);
  EXPECT_EQ(got.gx.abs().max().item<float>(), 0.0f);
  EXPECT_EQ(got.gw.abs().max().item<float>(), 0.0f);
}

// No rows at all: no chunk writes the head's gradient (the first chunk's product does, with no
// zero-fill before it), so the pass must zero it itself, in fp32 and under bf16 autocast.
TEST(LinearCrossEntropy, NoRowsGiveZeroGradients) {
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16 autocast" : "fp32");
    const Case c = make_case(1, 0, 8, 300, /*with_bias=*/false, /*ignore_some=*/false);
    std::optional<CpuAutocast> autocast;
    if (bf16) autocast.emplace(at::kBFloat16);
    // Memory of the gradient's size left holding NaN, which the allocator hands out again: an
    // unwritten gradient shows.
    at::full({300, 8}, NAN);
    const Result got = fused(c, 3);
    EXPECT_EQ(got.loss.item<float>(), 0.0f);
    ASSERT_TRUE(got.gw.defined());
    EXPECT_EQ(got.gw.sizes(), c.weight.sizes());
    EXPECT_EQ(got.gw.abs().max().item<float>(), 0.0f);
  }
}

TEST(LinearCrossEntropy, NoGradModeGivesTheLossOnly) {
  const Case c = make_case(2, 9, 8, 30, /*with_bias=*/true, /*ignore_some=*/true);
  const at::Tensor want = reference(c).loss;
  at::NoGradGuard no_grad;
  const at::Tensor got =
      loom::nn::linear_cross_entropy_sum(c.x, c.weight, c.bias, c.labels, kIgnore, 4);
  EXPECT_FALSE(got.requires_grad());
  expect_close(got, want, 1e-5, 1e-6, "loss");
}

// Under bf16 autocast both paths run the matmuls in bf16 and the softmax in fp32; they round
// differently (the fused head gradient is a sum of per-chunk bf16 products), so the comparison
// is at bf16's resolution, and the gradients come back in the inputs' fp32.
TEST(LinearCrossEntropy, Bf16AutocastMatchesUnfusedAutocast) {
  const Case c = make_case(2, 16, 32, 64, /*with_bias=*/true, /*ignore_some=*/true);
  Result want, got, many_chunks;
  {
    CpuAutocast bf16(at::kBFloat16);
    want = reference(c);
    got = fused(c, 8);
    many_chunks = fused(c, 3);  // 11 chunks: partial sums of 4, 4 and 3
  }
  expect_same(got, want, 2e-2, 2e-2);
  expect_same(many_chunks, want, 2e-2, 2e-2);
  // Not the fp32 result: the matmuls did run in bf16.
  const Result exact = reference(c);
  EXPECT_GT((got.loss - exact.loss).abs().item<double>(), 0.0);
}

// A head of more than 4 MiB in fp32 (9000 x 128): the partial sums after the first join the
// fp32 gradient a block of rows at a time; every block must, the last (partial) one included.
TEST(LinearCrossEntropy, Bf16PartialSumsJoinAHeadOfSeveralBlocks) {
  const Case c = make_case(2, 10, 128, 9000, /*with_bias=*/false, /*ignore_some=*/true);
  Result want, got;
  {
    CpuAutocast bf16(at::kBFloat16);
    want = reference(c);
    got = fused(c, 2);  // 10 chunks: partial sums of 4, 4 and 2
  }
  expect_same(got, want, 2e-2, 2e-2);
}

TEST(LinearCrossEntropy, Fp16AutocastTakesTheUnfusedPath) {
  const Case c = make_case(2, 8, 16, 24, /*with_bias=*/false, /*ignore_some=*/true);
  Result want, got;
  {
    CpuAutocast fp16(at::kHalf);
    want = reference(c);
    got = fused(c, 4);
  }
  EXPECT_TRUE(at::equal(got.loss, want.loss));
  EXPECT_TRUE(at::equal(got.gx, want.gx));
}

TEST(LinearCrossEntropy, Bf16WeightsGiveBf16Gradients) {
  Case c = make_case(2, 8, 16, 40, /*with_bias=*/false, /*ignore_some=*/false);
  c.x = c.x.detach().to(at::kBFloat16).requires_grad_();
  c.weight = c.weight.detach().to(at::kBFloat16).requires_grad_();
  const Result want = reference(c);
  const Result got = fused(c, 5);
  expect_same(got, want, 2e-2, 2e-2);
}

// Note [Softmax rows in one kernel]: with no trained bias the CPU path runs loom's row kernel
// (AVX-512; ATen's ops elsewhere or with LOOM_FUSED_CE_ATEN=1). Against an fp64 reference on
// vocabularies that end inside and on a 16-lane vector, with logits far apart (probabilities
// that underflow) and ignored rows; and against ATen's path on the same inputs.
Result fused_with_aten(const Case& c, int64_t chunk_rows, bool aten) {
  if (aten) setenv("LOOM_FUSED_CE_ATEN", "1", 1);
  Result r = fused(c, chunk_rows);
  unsetenv("LOOM_FUSED_CE_ATEN");
  return r;
}

TEST(LinearCrossEntropy, RowKernelMatchesAnFp64Reference) {
  for (int64_t V : {1, 15, 16, 17, 1003}) {
    SCOPED_TRACE("vocabulary " + std::to_string(V));
    Case c = make_case(2, 9, 24, V, /*with_bias=*/false, /*ignore_some=*/true);
    // Logits up to about ±150: many probabilities underflow fp32's exponential.
    c.weight = (c.weight.detach() * 8.0).requires_grad_();
    Case wide;
    wide.x = c.x.detach().to(at::kDouble).requires_grad_();
    wide.weight = c.weight.detach().to(at::kDouble).requires_grad_();
    wide.labels = c.labels;
    const at::Tensor logits = at::linear(wide.x, wide.weight);
    const Result exact = grads_of(
        wide, at::cross_entropy_loss(logits.reshape({-1, V}), wide.labels.reshape({-1}), {},
                                     at::Reduction::Sum, kIgnore));
    for (bool aten : {false, true}) {
      SCOPED_TRACE(aten ? "ATen's path" : "row kernel");
      const Result got = fused_with_aten(c, 5, aten);
      const double scale = exact.loss.abs().item<double>();
      EXPECT_NEAR(got.loss.item<double>(), exact.loss.item<double>(), 1e-5 * scale);
      expect_close(got.gx.to(at::kDouble), exact.gx, 1e-4, 1e-5, "grad x");
      expect_close(got.gw.to(at::kDouble), exact.gw, 1e-4, 1e-5, "grad weight");
    }
  }
}

TEST(LinearCrossEntropy, RowKernelFollowsATensPathInBf16) {
  const Case c = make_case(4, 16, 32, 517, /*with_bias=*/false, /*ignore_some=*/true);
  Result kernel, aten;
  {
    CpuAutocast bf16(at::kBFloat16);
    kernel = fused_with_aten(c, 7, false);
    aten = fused_with_aten(c, 7, true);
  }
  // The same bf16 logits, an fp32 softmax each: the losses agree to fp32 rounding; the
  // gradients went through bf16 (softmax - one-hot rounded, then two bf16 matmuls).
  EXPECT_NEAR(kernel.loss.item<double>(), aten.loss.item<double>(),
              1e-6 * aten.loss.abs().item<double>());
  expect_close(kernel.gx, aten.gx, 2e-2, 2e-3, "grad x");
  expect_close(kernel.gw, aten.gw, 2e-2, 2e-3, "grad weight");
}

// Note [Softmax rows in one kernel]: the AVX2 row kernel gives the AVX-512 one's bits (loss and
// gradients), in fp32 and bf16, on vocabularies ending inside, on and past a 16-lane vector, with
// logits far enough apart that exponentials underflow into subnormals. LOOM_KERNEL_ISA picks the
// path (Note [Kernel ISA cap]); the AVX2 path runs on any x86-64 machine the tests run on,
// AVX-512 where the CPU has it. And the kernels did run: ATen's path (the scalar cap) rounds
// differently.
Result fused_with_isa(const Case& c, const char* isa, bool bf16) {
  setenv("LOOM_KERNEL_ISA", isa, 1);
  Result r;
  try {
    if (bf16) {
      CpuAutocast autocast(at::kBFloat16);
      r = fused(c, 5);
    } else {
      r = fused(c, 5);
    }
  } catch (...) {
    unsetenv("LOOM_KERNEL_ISA");
    throw;
  }
  unsetenv("LOOM_KERNEL_ISA");
  return r;
}

TEST(LinearCrossEntropy, RowKernelsAgreeBitForBitAcrossIsas) {
#if defined(__x86_64__)
  ASSERT_TRUE(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      << "the AVX2 row kernel must be tested";
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (!avx512) std::cout << "[ SKIPPED  ] the AVX-512 comparison: this CPU lacks AVX-512\n";
  int differs_from_aten = 0;
  for (bool bf16 : {false, true})
    for (int64_t V : {1, 7, 15, 16, 17, 31, 1003}) {
      SCOPED_TRACE(std::string(bf16 ? "bf16" : "fp32") + ", vocabulary " + std::to_string(V));
      Case c = make_case(2, 9, 24, V, /*with_bias=*/false, /*ignore_some=*/true);
      c.weight = (c.weight.detach() * 8.0).requires_grad_();  // logits up to about ±150
      const Result two = fused_with_isa(c, "avx2", bf16);
      const Result aten = fused_with_isa(c, "scalar", bf16);
      differs_from_aten += !at::equal(two.loss, aten.loss) || !at::equal(two.gx, aten.gx);
      if (!avx512) continue;
      const Result five = fused_with_isa(c, "avx512", bf16);
      EXPECT_TRUE(at::equal(two.loss, five.loss))
          << two.loss.item<double>() << " vs " << five.loss.item<double>();
      EXPECT_TRUE(at::equal(two.gx, five.gx)) << "grad x";
      EXPECT_TRUE(at::equal(two.gw, five.gw)) << "grad weight";
    }
  EXPECT_GT(differs_from_aten, 0) << "the row kernel never ran";
#else
  GTEST_SKIP() << "not x86-64";
#endif
}

TEST(LinearCrossEntropy, NaNLogitsGiveANaNLossOnEitherPath) {
  Case c = make_case(1, 6, 8, 33, /*with_bias=*/false, /*ignore_some=*/false);
  at::Tensor x = c.x.detach().clone();
  x.index_put_({0, 2, 3}, std::nan(""));
  c.x = x.requires_grad_();
  for (bool aten : {false, true}) {
    const Result r = fused_with_aten(c, 4, aten);
    EXPECT_TRUE(std::isnan(r.loss.item<double>())) << (aten ? "ATen" : "kernel");
  }
}

TEST(LinearCrossEntropy, LabelOutsideTheVocabularyIsNamed) {
  Case c = make_case(1, 4, 8, 20, /*with_bias=*/false, /*ignore_some=*/false);
  c.labels.index_put_({0, 1}, 20);
  for (bool aten : {false, true}) {  // the row kernel (where AVX-512 runs it) and ATen's path
    try {
      fused_with_aten(c, 0, aten);
      ADD_FAILURE() << "label 20 of a 20-token vocabulary was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(
          std::string(e.what()).find("cross-entropy label 20 is outside the vocabulary [0, 20)"),
          std::string::npos)
          << e.what();
    }
    unsetenv("LOOM_FUSED_CE_ATEN");  // fused_with_aten's own unset is skipped by the throw
  }
}

TEST(LinearCrossEntropy, MismatchedShapesAreNamed) {
  const Case c = make_case(1, 4, 8, 10, /*with_bias=*/false, /*ignore_some=*/false);
  try {
    loom::nn::linear_cross_entropy_sum(c.x, at::randn({10, 9}), {}, c.labels, kIgnore);
    FAIL() << "no error for a head of the wrong width";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("does not match the head"), std::string::npos) << e.what();
  }
}

}  // namespace
