// A Llama layer's row ops (Note [Fused row ops]) at llama ~124M's shapes, forward then backward
// with a given incoming gradient: ATen's composite ops (LOOM_FUSED_OPS_ATEN=1) against loom's
// kernels on each path this CPU has (LOOM_KERNEL_ISA = avx512, avx2, scalar), the variants
// rotating within each round; prints each op's median milliseconds per call. Not a test.
//
// usage: loom_bench_row_ops [THREADS=2] [ROUNDS=7] [fp32|bf16]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "loom/nn.h"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Milliseconds per call over `calls` calls, after two unmeasured.
double ms_per_call(const std::function<void()>& f, int calls) {
  f();
  f();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
             .count() /
         calls;
}

void set_variant(const std::string& variant) {
  unsetenv("LOOM_FUSED_OPS_ATEN");
  unsetenv("LOOM_KERNEL_ISA");
  if (variant == "aten")
    setenv("LOOM_FUSED_OPS_ATEN", "1", 1);
  else
    setenv("LOOM_KERNEL_ISA", variant.c_str(), 1);
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  const at::ScalarType dtype =
      argc > 3 && std::string(argv[3]) == "bf16" ? at::kBFloat16 : at::kFloat;
  at::set_num_threads(threads);
  at::manual_seed(0);
  // Batch 4 x 256 tokens, hidden 768, SwiGLU 2048, 12 heads of 64.
  auto leaf = [&](at::IntArrayRef shape) { return at::randn(shape).to(dtype).requires_grad_(); };
  const at::Tensor x = leaf({4, 256, 768}), w = leaf({768});
  const at::Tensor gate = leaf({4, 256, 2048}), up = leaf({4, 256, 2048});
  const at::Tensor q = at::randn({4, 256, 12, 64}).to(dtype).transpose(1, 2).requires_grad_();
  const at::Tensor angles = at::arange(256).to(at::kFloat).unsqueeze(1) * at::rand({64});
  const at::Tensor cos = angles.cos().to(dtype), sin = angles.sin().to(dtype);
  const at::Tensor g_norm = at::randn({4, 256, 768}).to(dtype);
  const at::Tensor g_mlp = at::randn({4, 256, 2048}).to(dtype);
  const at::Tensor g_rope = at::randn({4, 12, 256, 64}).to(dtype);
  const std::vector<std::pair<std::string, std::function<void()>>> ops = {
      {"rms_norm (4,256,768)", [&] { loom::nn::rms_norm(x, w, 1e-6).backward(g_norm); }},
      {"swiglu (4,256,2048)", [&] { loom::nn::swiglu(gate, up).backward(g_mlp); }},
      {"rotary (4,12,256,64)", [&] { loom::nn::rotary(q, cos, sin).backward(g_rope); }},
  };
  const std::vector<std::string> variants = {"aten", "avx512", "avx2", "scalar"};
  std::vector<std::vector<std::vector<double>>> times(
      ops.size(), std::vector<std::vector<double>>(variants.size()));
  for (int round = 0; round < rounds; ++round)
    for (size_t k = 0; k < variants.size(); ++k) {
      const size_t v = (k + static_cast<size_t>(round)) % variants.size();  // rotate the order
      set_variant(variants[v]);
      for (size_t o = 0; o < ops.size(); ++o) times[o][v].push_back(ms_per_call(ops[o].second, 20));
    }
  set_variant("");
  unsetenv("LOOM_KERNEL_ISA");
  std::printf("%s, %d threads, median of %d rounds, ms per forward + backward:\n",
              dtype == at::kFloat ? "fp32" : "bf16", threads, rounds);
  std::printf("| op |");
  for (const auto& v : variants) std::printf(" %s |", v == "aten" ? "ATen composite" : v.c_str());
  std::printf("\n|---|");
  for (size_t v = 0; v < variants.size(); ++v) std::printf("---|");
  std::printf("\n");
  for (size_t o = 0; o < ops.size(); ++o) {
    std::printf("| %s |", ops[o].first.c_str());
    for (size_t v = 0; v < variants.size(); ++v) std::printf(" %.3f |", median(times[o][v]));
    std::printf("\n");
  }
  return 0;
}
