// nn::rms_norm, nn::swiglu and nn::rotary (Note [Fused row ops]) against ATen's composite ops
// (the same functions with LOOM_FUSED_OPS_ATEN=1, and an independent formula): values and
// every input's gradient, fp32 and bf16, strided inputs, rows not a multiple of the vector
// width; the AVX-512, AVX2 and scalar paths and one or two threads giving the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "loom/error.h"
#include "loom/nn.h"

namespace {

struct Outcome {
  at::Tensor y;
  std::vector<at::Tensor> grads;
  std::string node;  // the output's backward node
};

using View = std::function<at::Tensor(const at::Tensor&)>;

// y = op(inputs) and the inputs' gradients under a fixed incoming gradient. `view` makes the
// first input from its leaf (a clone would lay a strided view out densely).
Outcome run(const std::function<at::Tensor(const std::vector<at::Tensor>&)>& op,
            const std::vector<at::Tensor>& values, const std::vector<bool>& grad,
            const View& view = {}) {
  std::vector<at::Tensor> inputs;
  for (size_t i = 0; i < values.size(); ++i)
    inputs.push_back(values[i].detach().clone().requires_grad_(grad[i]));
  std::vector<at::Tensor> args = inputs;
  if (view) args[0] = view(inputs[0]);
  Outcome out;
  out.y = op(args);
  out.node = out.y.grad_fn() ? out.y.grad_fn()->name() : "";
  at::manual_seed(99);
  const at::Tensor incoming = at::randn(out.y.sizes()).to(out.y.scalar_type());
  out.y.backward(incoming);
  out.y = out.y.detach();
  for (size_t i = 0; i < inputs.size(); ++i)
    out.grads.push_back(grad[i] ? inputs[i].grad() : at::Tensor());
  return out;
}

Outcome with_env(const char* name, const char* value, const std::function<Outcome()>& f) {
  setenv(name, value, 1);
  Outcome o;
  try {
    o = f();
  } catch (...) {
    unsetenv(name);
    throw;
  }
  unsetenv(name);
  return o;
}

void expect_close(const at::Tensor& a, const at::Tensor& b, double rtol, double atol,
                  const std::string& what) {
  ASSERT_TRUE(a.defined() && b.defined()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const at::Tensor fa = a.to(at::kFloat), fb = b.to(at::kFloat);
  const double worst = ((fa - fb).abs() - (fb.abs() * rtol + atol)).max().item<double>();
  EXPECT_LE(worst, 0.0) << what << ": max |difference| " << (fa - fb).abs().max().item<double>();
}

void expect_same_bits(const Outcome& a, const Outcome& b, const std::string& what) {
  EXPECT_TRUE(at::equal(a.y, b.y)) << what << ": values";
  for (size_t i = 0; i < a.grads.size(); ++i)
    if (a.grads[i].defined())
      EXPECT_TRUE(at::equal(a.grads[i], b.grads[i])) << what << ": grad " << i;
}

// The fused op against ATen's (and against its own other paths and thread counts).
void check(const std::function<at::Tensor(const std::vector<at::Tensor>&)>& op,
           const std::vector<at::Tensor>& values, const std::vector<bool>& grad,
           const std::string& node, double rtol, double atol, const View& view = {}) {
  const Outcome fused = run(op, values, grad, view);
  EXPECT_NE(fused.node.find(node), std::string::npos)
      << "the kernel's path did not run: " << fused.node;
  const Outcome aten =
      with_env("LOOM_FUSED_OPS_ATEN", "1", [&] { return run(op, values, grad, view); });
  EXPECT_EQ(aten.node.find(node), std::string::npos) << aten.node;
  expect_close(fused.y, aten.y, rtol, atol, "values");
  for (size_t i = 0; i < values.size(); ++i)
    if (grad[i])
      expect_close(fused.grads[i], aten.grads[i], rtol, atol, "grad " + std::to_string(i));
  for (const char* isa : {"avx2", "scalar"})
    expect_same_bits(
        fused, with_env("LOOM_KERNEL_ISA", isa, [&] { return run(op, values, grad, view); }), isa);
  const int threads = at::get_num_threads();
  at::set_num_threads(threads == 1 ? 2 : 1);
  const Outcome other = run(op, values, grad, view);
  at::set_num_threads(threads);
  expect_same_bits(fused, other, "another thread count");
}

at::Tensor rms_norm_op(const std::vector<at::Tensor>& in) {
  return loom::nn::rms_norm(in[0], in[1], 1e-6);
}

TEST(FusedRmsNorm, Fp32MatchesAtenWithTailsAndAWideRow) {
  at::manual_seed(1);
  // 77 is no multiple of 16 lanes; 1029 rows cut the w-gradient chunks unevenly.
  check(rms_norm_op, {at::randn({3, 5, 77}) * 3, at::randn({77})}, {true, true}, "RmsNormFunction",
        1e-5, 1e-6);
  check(rms_norm_op, {at::randn({1029, 768}), at::randn({768})}, {true, true}, "RmsNormFunction",
        1e-5, 1e-5);
}

TEST(FusedRmsNorm, Bf16MatchesAtenToItsRounding) {
  at::manual_seed(2);
  check(rms_norm_op, {at::randn({4, 33, 96}).to(at::kBFloat16), at::randn({96}).to(at::kBFloat16)},
        {true, true}, "RmsNormFunction", 2e-2, 2e-2);
}

TEST(FusedRmsNorm, AFrozenWeightAndANonContiguousInput) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({40, 6, 64}).transpose(0, 1);  // (6, 40, 64), strided
  check(rms_norm_op, {at::randn({40, 6, 64}), at::randn({64})}, {true, false}, "RmsNormFunction",
        1e-5, 1e-6, [](const at::Tensor& t) { return t.transpose(0, 1); });
  // The independent formula, on a strided input.
  const at::Tensor w = at::randn({64});
  const at::Tensor expected = x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-6) * w;
  expect_close(loom::nn::rms_norm(x, w, 1e-6), expected, 1e-5, 1e-6, "formula");
}

TEST(FusedRmsNorm, WithoutAGraphGivesTheSameValues) {
  at::manual_seed(4);
  const at::Tensor x = at::randn({7, 50}), w = at::randn({50});
  const at::Tensor with_graph = loom::nn::rms_norm(x.clone().requires_grad_(), w, 1e-5);
  at::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(loom::nn::rms_norm(x, w, 1e-5), with_graph.detach()));
}

TEST(FusedRmsNorm, AWeightOfAnotherWidthIsAnError) {
  try {
    loom::nn::rms_norm(at::randn({2, 8}), at::ones({6}), 1e-6);
    FAIL() << "expected an error";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not end in the weight's"), std::string::npos)
        << e.what();
  }
}

at::Tensor swiglu_op(const std::vector<at::Tensor>& in) { return loom::nn::swiglu(in[0], in[1]); }

TEST(FusedSwiglu, Fp32MatchesAtenOverTheExponentialsRange) {
  at::manual_seed(5);
  at::Tensor gate = at::randn({3, 37, 129}) * 4;
  // Past both ends of the exponential's clamp, and zeros.
  gate.view(-1).slice(0, 0, 8).copy_(
      at::tensor({-200.f, -90.f, -87.5f, -20.f, 0.f, 20.f, 88.5f, 200.f}));
  check(swiglu_op, {gate, at::randn({3, 37, 129})}, {true, true}, "SwigluFunction", 1e-5, 1e-6);
  // The independent formula.
  const at::Tensor up = at::randn({3, 37, 129});
  expect_close(loom::nn::swiglu(gate, up), gate / (1 + at::exp(-gate)) * up, 1e-5, 1e-6, "formula");
}

TEST(FusedSwiglu, Bf16AndOneFrozenInput) {
  at::manual_seed(6);
  check(swiglu_op,
        {(at::randn({5, 300}) * 3).to(at::kBFloat16), at::randn({5, 300}).to(at::kBFloat16)},
        {true, true}, "SwigluFunction", 2e-2, 2e-2);
  check(swiglu_op, {at::randn({5, 300}), at::randn({5, 300})}, {false, true}, "SwigluFunction",
        1e-5, 1e-6);
}

at::Tensor rotary_op(const std::vector<at::Tensor>& in) {
  return loom::nn::rotary(in[0], in[1], in[2]);
}

std::vector<at::Tensor> rope_case(int64_t B, int64_t T, int64_t H, int64_t D,
                                  at::ScalarType dtype) {
  at::manual_seed(7);
  // q as the models make it: a (B, T, H, D) projection seen as (B, H, T, D).
  const at::Tensor x = at::randn({B, T, H, D}).to(dtype).transpose(1, 2);
  const at::Tensor angles = at::arange(T).to(at::kFloat).unsqueeze(1) * at::rand({D}) * 3;
  return {x, angles.cos().to(dtype), angles.sin().to(dtype)};
}

TEST(FusedRotary, Fp32MatchesAtenOnAStridedInput) {
  const std::vector<at::Tensor> c = rope_case(2, 9, 3, 20, at::kFloat);
  check(rotary_op, c, {true, false, false}, "RotaryFunction", 1e-6, 1e-6);
  // The independent formula: pairs (j, j + D/2) rotated by the angle.
  const at::Tensor& x = c[0];
  const at::Tensor x1 = x.narrow(-1, 0, 10), x2 = x.narrow(-1, 10, 10);
  const at::Tensor cos = c[1].narrow(-1, 0, 10), sin = c[2].narrow(-1, 0, 10);
  const at::Tensor expected = at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
  // c[1] and c[2] repeat their halves only where the frequencies do; use matching tables.
  const at::Tensor cos_full = at::cat({cos, cos}, -1), sin_full = at::cat({sin, sin}, -1);
  expect_close(loom::nn::rotary(x, cos_full.contiguous(), sin_full.contiguous()), expected, 1e-6,
               1e-6, "formula");
}

TEST(FusedRotary, InputsWhoseRowsAreNotDense) {
  std::vector<at::Tensor> c = rope_case(2, 9, 3, 20, at::kFloat);
  // A window of positions out of a longer (B, H, T, D) tensor: the output is laid out anew, so
  // input and output rows are found with different strides.
  c[0] = at::randn({2, 3, 12, 20});
  check(rotary_op, c, {true, false, false}, "RotaryFunction", 1e-6, 1e-6,
        [](const at::Tensor& x) { return x.narrow(2, 2, 9); });
  // The last dimension strided: rows copied to unit stride first.
  c[0] = at::randn({2, 3, 20, 9});
  check(rotary_op, c, {true, false, false}, "RotaryFunction", 1e-6, 1e-6,
        [](const at::Tensor& x) { return x.transpose(-1, -2); });
}

TEST(FusedRotary, AnOddOrMissingDimensionIsAnError) {
  for (const at::Tensor& x : {at::randn({2, 5, 7}), at::randn({8})}) {
    try {
      loom::nn::rotary(x, at::ones({5, 7}), at::ones({5, 7}));
      FAIL() << "expected an error for " << x.sizes();
    } catch (const loom::Error& e) {
      EXPECT_NE(std::string(e.what()).find("needs positions and an even last dimension"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(FusedRotary, Bf16MatchesAten) {
  check(rotary_op, rope_case(1, 17, 2, 64, at::kBFloat16), {true, false, false}, "RotaryFunction",
        2e-2, 2e-2);
}

}  // namespace
