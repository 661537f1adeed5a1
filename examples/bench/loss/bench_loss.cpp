// The language-model loss at GPT-2's vocabulary, side by side in one process: the unfused path
// (linear, then cross_entropy over fp32 logits, as gpt ran before),
// nn::linear_cross_entropy_sum, and the floor any exact loss path stands on: its three matmuls
// alone (logits, the gradients of x and of the head; in bf16 with the casts of x and the head
// autocast makes), rotating, each forward + backward timed and its peak of tensor memory
// (loom's tracking CPU allocator, above what was live before) recorded. Not a test;
// examples/bench/loss/run.py drives it.
//
// usage: loom_bench_loss fp32|bf16 TOKENS DIM VOCAB ROUNDS THREADS   prints one JSON line per
//        variant: median seconds and peak bytes
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "loom/cpu.h"
#include "loom/loss.h"
#include "loom/memory.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Inputs {
  at::Tensor x, weight, labels;
  at::Tensor logits_grad;  // (tokens, vocab) in the compute dtype: stands in for softmax - 1hot
};

at::Tensor unfused(const Inputs& in) {
  const at::Tensor logits = at::linear(in.x, in.weight);
  return at::cross_entropy_loss(logits.view({-1, logits.size(-1)}).to(at::kFloat),
                                in.labels.reshape({-1}), {}, at::Reduction::Sum, -100);
}

at::Tensor fused(const Inputs& in) {
  return loom::nn::linear_cross_entropy_sum(in.x, in.weight, {}, in.labels, -100);
}

// The three matmuls of the head's forward and backward, nothing else; returns a checksum.
at::Tensor matmuls_only(const Inputs& in, bool bf16) {
  at::NoGradGuard no_grad;
  const auto dtype = bf16 ? at::kBFloat16 : at::kFloat;
  const at::Tensor x = in.x.detach().to(dtype), w = in.weight.detach().to(dtype);
  const at::Tensor logits = at::mm(x, w.t());
  const at::Tensor gx = at::mm(in.logits_grad, w), gw = at::mm(in.logits_grad.t(), x);
  return logits.sum() + gx.sum() + gw.sum();
}

enum Variant { kUnfused, kFused, kMatmuls };

// One forward + backward: seconds, and the peak of live tensor bytes above the start.
std::pair<double, int64_t> measure(const Inputs& in, Variant variant, bool bf16) {
  in.x.mutable_grad() = at::Tensor();
  in.weight.mutable_grad() = at::Tensor();
  const int64_t before = loom::memory::cpu_stats().current_bytes;
  loom::memory::reset_cpu_peak();
  const auto t0 = Clock::now();
  if (variant == kMatmuls) {
    matmuls_only(in, bf16);
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    return {seconds, loom::memory::cpu_stats().peak_bytes - before};
  }
  if (bf16) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  at::Tensor loss = variant == kFused ? fused(in) : unfused(in);
  if (bf16) {
    at::autocast::set_autocast_enabled(at::kCPU, false);
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  }
  (loss / 1000.0).backward();
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return {seconds, loom::memory::cpu_stats().peak_bytes - before};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: loom_bench_loss fp32|bf16 TOKENS DIM VOCAB ROUNDS THREADS\n");
    return 2;
  }
  loom::cpu::ensure_cpu_kernels_work();  // before any kernel or thread: loom/cpu.h
  const bool bf16 = std::string(argv[1]) == "bf16";
  const int64_t N = std::stoll(argv[2]), D = std::stoll(argv[3]), V = std::stoll(argv[4]);
  const int rounds = std::stoi(argv[5]);
  at::set_num_threads(std::stoi(argv[6]));
  loom::memory::install_cpu_tracker();
  at::manual_seed(0);
  Inputs in;
  in.x = at::randn({N, D}).requires_grad_();
  in.weight = (at::randn({V, D}) * 0.02).requires_grad_();
  in.labels = at::randint(0, V, {N}, at::kLong);
  in.logits_grad = (at::randn({N, V}) * 1e-3).to(bf16 ? at::kBFloat16 : at::kFloat);
  std::vector<double> times[3];
  int64_t peak[3] = {0, 0, 0};
  float losses[2] = {0, 0};
  for (int r = 0; r <= rounds; ++r) {
    for (int i = 0; i < 3; ++i) {  // rotate who goes first
      const int v = (r + i) % 3;
      auto [seconds, bytes] = measure(in, static_cast<Variant>(v), bf16);
      if (r == 0) continue;  // warm-up: first-touch page faults, oneDNN's kernel choice
      times[v].push_back(seconds);
      peak[v] = std::max(peak[v], bytes);
    }
  }
  for (int v : {0, 1}) {
    at::NoGradGuard no_grad;
    losses[v] = (v ? fused(in) : unfused(in)).item<float>();
  }
  const char* names[3] = {"unfused", "fused", "matmuls"};
  for (int v : {0, 1, 2}) {
    std::sort(times[v].begin(), times[v].end());
    std::printf(
        "{\"variant\": \"%s\", \"precision\": \"%s\", \"tokens\": %lld, \"dim\": %lld, "
        "\"vocab\": %lld, \"seconds\": %.4f, \"peak_bytes\": %lld, \"loss\": %.6f}\n",
        names[v], argv[1], static_cast<long long>(N), static_cast<long long>(D),
        static_cast<long long>(V), times[v][times[v].size() / 2], static_cast<long long>(peak[v]),
        v < 2 ? losses[v] : 0.0f);
  }
  return 0;
}
