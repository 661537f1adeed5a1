// Optimizer step benchmark (one measurement per run; bench_optim.py interleaves and takes
// medians): update throughput of one loom update rule on ~100M fp32 parameters in 100
// tensors with random grads, or the STREAM triad bandwidth of this machine. Not a test.
//
// usage: loom_bench_optim RULE THREADS STEPS PARAMS_MILLIONS   (RULE: adamw adamw_bf16 (adamw
//        with state_dtype = "bf16") adafactor adam8bit sgd lion, or "triad")   prints one JSON line
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "loom/cpu.h"
#include "loom/kernel_isa.h"
#include "loom/plugin.h"
#include "loom/update_rule.h"

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// STREAM's triad a = b + s c on restrict pointers, so it vectorises as the rules' loops do.
void triad(float* __restrict a, const float* __restrict b, const float* __restrict c,
           int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + 3.0f * c[i];
}

std::unique_ptr<loom::UpdateRule> make(const std::string& name) {
  loom::Schema schema("optimizer", name);
  loom::Plugin* plugin = nullptr;
  const bool adamw = name == "adamw" || name == "adamw_bf16";
  if (adamw) {
    schema.key_float("beta1", 0.9, "").key_float("beta2", 0.999, "").key_float("eps", 1e-8, "");
    schema.key_string("state_dtype", "fp32", "");
  } else {
    void* handle = dlopen(LOOM_OPTIM_PLUGIN, RTLD_NOW);
    if (!handle) throw std::runtime_error(dlerror());
    auto entry =
        reinterpret_cast<const loom_plugin_info* (*)()>(dlsym(handle, "loom_plugin_entry"));
    plugin = entry()->create();
    for (const auto& s : plugin->schemas())
      if (s.provider() == name) schema = s;
  }
  loom::ConfigTable values;
  if (name == "adamw_bf16")
    values.emplace_back("state_dtype", loom::ConfigValue{std::string("bf16"), "bench"});
  if (name == "sgd") values.emplace_back("momentum", loom::ConfigValue{0.9, "bench"});
  if (name == "adafactor") {  // the Trainer's optim="adafactor"
    values.emplace_back("relative_step", loom::ConfigValue{false, "bench"});
    values.emplace_back("scale_parameter", loom::ConfigValue{false, "bench"});
  }
  loom::ConfigSection section("optimizer", values, schema, "bench");
  return adamw ? loom::make_adamw(section) : plugin->create_update_rule(name, section);
}

// The path the rule's kernels took: adam8bit's and adafactor's follow LOOM_KERNEL_ISA (Note
// [Kernel ISA cap]); adamw's clones and sgd's and lion's loops take what the CPU has.
std::string used_isa(const std::string& rule) {
  if (rule == "adam8bit" || rule == "adafactor" || rule == "adamw_bf16")
    return loom::cpu::kernel_isa_name(loom::cpu::kernel_isa());
  return std::string(loom::cpu::kernel_isa_name(loom::cpu::cpu_kernel_isa())) + " (not capped)";
}

}  // namespace

int main(int argc, char** argv) {
  loom::cpu::ensure_cpu_kernels_work();  // before any kernel or thread: loom/cpu.h
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s RULE THREADS STEPS PARAMS_MILLIONS\n", argv[0]);
    return 2;
  }
  const std::string rule_name = argv[1];
  const int threads = std::stoi(argv[2]), steps = std::stoi(argv[3]);
  const int64_t total = static_cast<int64_t>(std::stod(argv[4]) * 1e6);
  at::set_num_threads(threads);
  std::vector<double> times;
  if (rule_name == "triad") {  // a = b + s c, 12 bytes per element (STREAM's count)
    at::Tensor a = at::zeros({total}), b = at::rand({total}), c = at::rand({total});
    float* pa = a.data_ptr<float>();
    const float* pb = b.data_ptr<float>();
    const float* pc = c.data_ptr<float>();
    for (int s = 0; s < steps + 1; ++s) {
      const auto t = Clock::now();
      at::parallel_for(0, total, 1 << 16, [&](int64_t i0, int64_t i1) {
        triad(pa + i0, pb + i0, pc + i0, i1 - i0);
      });
      if (s > 0) times.push_back(seconds_since(t));
    }
    std::sort(times.begin(), times.end());
    // STREAM counts 12 bytes; the write of `a` also reads its line first (write-allocate),
    // so the memory moves 16. The rules rewrite lines they read, so 16 is the comparable rate.
    const double t = times[times.size() / 2];
    std::printf("{\"rule\": \"triad\", \"threads\": %d, \"stream_gbps\": %.3f, \"gbps\": %.3f}\n",
                threads, 12.0 * total / t / 1e9, 16.0 * total / t / 1e9);
    return 0;
  }
  auto rule = make(rule_name);
  // 100 tensors: 99 matrices (rows x 1024) and one vector, ~total elements.
  const int64_t cols = 1024, rows = total / 100 / cols;
  std::vector<loom::Segment> segments;
  std::vector<at::Tensor> grads;
  int64_t count = 0;
  for (int i = 0; i < 100; ++i) {
    loom::Segment s;
    s.name = "t" + std::to_string(i);
    const std::vector<int64_t> shape =
        i == 99 ? std::vector<int64_t>{rows * cols} : std::vector<int64_t>{rows, cols};
    s.param = at::randn({rows * cols}) * 0.02;
    s.shape = shape;
    s.state = rule->init_state(s);
    grads.push_back(at::randn({rows * cols}) * 1e-3);
    count += rows * cols;
    segments.push_back(std::move(s));
  }
  int64_t state_bytes = 0;
  for (const auto& s : segments)
    for (const auto& [key, t] : s.state) state_bytes += t.numel() * t.element_size();
  for (int step = 0; step < steps + 1; ++step) {
    const auto t = Clock::now();
    for (size_t i = 0; i < segments.size(); ++i) {
      segments[i].grad = grads[i];
      loom::UpdateContext ctx;
      ctx.step = step + 1;
      ctx.lr = 1e-3;
      ctx.weight_decay = 0.01;
      loom::update_tensor(*rule, {&segments[i]}, ctx);
    }
    if (step > 0) times.push_back(seconds_since(t));  // the first step warms up
  }
  std::sort(times.begin(), times.end());
  std::printf(
      "{\"rule\": \"%s\", \"threads\": %d, \"params\": %lld, \"seconds\": %.5f, "
      "\"state_bytes_per_param\": %.4f, \"kernel_isa\": \"%s\"}\n",
      rule_name.c_str(), threads, static_cast<long long>(count), times[times.size() / 2],
      static_cast<double>(state_bytes) / count, used_isa(rule_name).c_str());
  return 0;
}
