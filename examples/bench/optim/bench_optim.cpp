// Optimizer step benchmark (one measurement per run; bench_optim.py interleaves and takes
// medians): update throughput of one loom update rule on ~100M fp32 parameters in 100
// tensors with random grads, or the STREAM triad bandwidth of this machine. Not a test.
//
// usage: loom_bench_optim RULE THREADS STEPS PARAMS_MILLIONS   (RULE: adamw adamw_bf16 (adamw
//        with state_dtype = "bf16") adafactor adam8bit sgd lion, or "triad")   prints one JSON line
//        LOOM_BENCH_OPTIM_PLUGIN=PATH loads that loom_optim.so instead of the build's (an old
//        and a new plugin compared in one session, neither copied over the build tree)
//    or: loom_bench_optim compare THREADS ROUNDS PARAMS_MILLIONS ENTRY...   one process, every
//        entry's own parameters and state, one step of each entry per round in turn (the
//        first round warms up), prints one JSON line per entry with every round's seconds. An
//        ENTRY is torch-fused (at::_fused_adamw_, the kernel of torch.optim.AdamW(fused=True)),
//        or RULE[/KERNEL][:ISA][@PLUGIN] (KERNEL the rule's [optimizer] kernel, e.g.
//        lion/tensor_ops; ISA sets LOOM_KERNEL_ISA for its steps; PLUGIN a loom_optim.so to
//        load instead of the build's). On a machine others load, ratios between entries of one
//        process are what to compare: each round's entries run seconds apart.
//        LOOM_BENCH_OPTIM_DEVICE=cuda (or cuda:N) puts every entry's parameters, gradients and
//        state on that GPU: each rule takes its GPU path, torch-fused its CUDA kernel,
//        and each timing ends when the last parameter's value has come back to the host (the
//        stream's queued work done).
//        LOOM_BENCH_OPTIM_FIRST_STEP=N numbers compare's first round step N, not 1 (the steps
//        of a run's late phase: adam8bit skips a division once beta2's bias correction
//        rounds to 1, Note [A bias correction of one]).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
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

// `schema_out`, when given, receives the rule's schema (its keys' defaults).
std::unique_ptr<loom::UpdateRule> make(const std::string& name, const char* plugin_path,
                                       const std::string& kernel = "",
                                       loom::Schema* schema_out = nullptr) {
  loom::Schema schema("optimizer", name);
  loom::Plugin* plugin = nullptr;
  const bool adamw = name == "adamw" || name == "adamw_bf16";
  if (adamw) {
    schema.key_float("beta1", 0.9, "").key_float("beta2", 0.999, "").key_float("eps", 1e-8, "");
    schema.key_string("state_dtype", "fp32", "");
  } else {
    void* handle = dlopen(plugin_path && *plugin_path ? plugin_path : LOOM_OPTIM_PLUGIN, RTLD_NOW);
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
  if (!kernel.empty()) values.emplace_back("kernel", loom::ConfigValue{kernel, "bench"});
  if (name == "adafactor") {  // the Trainer's optim="adafactor"
    values.emplace_back("relative_step", loom::ConfigValue{false, "bench"});
    values.emplace_back("scale_parameter", loom::ConfigValue{false, "bench"});
  }
  if (schema_out) *schema_out = schema;
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

// Where compare's tensors live: the CPU unless LOOM_BENCH_OPTIM_DEVICE names a GPU.
at::Device bench_device() {
  const char* name = std::getenv("LOOM_BENCH_OPTIM_DEVICE");
  if (!name || !*name) return at::kCPU;
  const at::Device device{std::string(name)};
  if (device.is_cuda() && !at::hasCUDA())
    throw std::runtime_error(std::string("LOOM_BENCH_OPTIM_DEVICE=") + name +
                             ": no GPU here (LibTorch's CUDA half is not loaded; `loom env` "
                             "says why)");
  return device;
}

// Waits for the device's queued work: a value copied back is read after the kernels that wrote
// it (on the CPU a no-op in effect). Needs no CUDA header, so the bench builds without CUDA.
void finish(const at::Tensor& t) {
  if (!t.is_cpu()) (void)t.view(-1)[0].item<float>();
}

// The elements of each of make_segments' tensors for `total`: whole rows of kColumns.
constexpr int64_t kTensors = 100, kColumns = 1024;
int64_t elements_per_tensor(int64_t total) { return total / kTensors / kColumns * kColumns; }

// 100 tensors: 99 matrices (rows x 1024) and one vector, ~total elements, each with its grad.
std::vector<loom::Segment> make_segments(const loom::UpdateRule* rule, int64_t total,
                                         std::vector<at::Tensor>& grads,
                                         at::Device device = at::kCPU) {
  const auto on = at::TensorOptions().device(device);
  const int64_t cols = kColumns, rows = elements_per_tensor(total) / cols;
  const bool fresh_grads = grads.empty();
  std::vector<loom::Segment> segments;
  for (int i = 0; i < kTensors; ++i) {
    loom::Segment s;
    s.name = "t" + std::to_string(i);
    s.shape = i == kTensors - 1 ? std::vector<int64_t>{rows * cols}
                                : std::vector<int64_t>{rows, cols};
    s.param = at::randn({rows * cols}, on) * 0.02;
    if (rule) s.state = rule->init_state(s);
    if (fresh_grads) grads.push_back(at::randn({rows * cols}, on) * 1e-3);
    s.grad = grads[i];
    segments.push_back(std::move(s));
  }
  return segments;
}

// All tensors in one update_many, as the step driver gives a group of one learning rate and
// weight decay to the rule (torch's fused AdamW gets its tensor list in one call too).
void update_all(const loom::UpdateRule& rule, std::vector<loom::Segment>& segments, int step) {
  loom::UpdateContext ctx;
  ctx.step = step;
  ctx.lr = 1e-3;
  ctx.weight_decay = 0.01;
  std::vector<loom::Segment*> all;
  for (auto& segment : segments) all.push_back(&segment);
  rule.update_many(all, ctx);
}

// LOOM_BENCH_OPTIM_FIRST_STEP (usage above): a positive step number, 1 if unset.
int first_step_from_environment() {
  const char* text = std::getenv("LOOM_BENCH_OPTIM_FIRST_STEP");
  if (!text || !*text) return 1;
  char* end = nullptr;
  const long step = std::strtol(text, &end, 10);
  if (*end != '\0' || step < 1 || step > (1L << 30))
    throw std::runtime_error(std::string("LOOM_BENCH_OPTIM_FIRST_STEP='") + text +
                             "' is not a step number: use a whole number from 1");
  return static_cast<int>(step);
}

// The compare mode (usage above): entries interleaved in one process.
int compare(int threads, int rounds, int64_t total, const std::vector<std::string>& names) {
  struct Entry {
    std::string name, rule, kernel, isa, plugin, used_isa;
    std::unique_ptr<loom::UpdateRule> update_rule;
    std::vector<loom::Segment> segments;
    std::vector<at::Tensor> m, v;  // torch-fused's state
    std::vector<double> seconds;
  };
  std::vector<at::Tensor> grads;
  std::vector<Entry> entries;
  const at::Device device = bench_device();
  const int first_step = first_step_from_environment();  // bad input refused before any work
  const int64_t per_tensor = elements_per_tensor(total);
  if (per_tensor == 0)
    throw std::runtime_error("PARAMS_MILLIONS " + std::to_string(total / 1e6) +
                             " makes empty tensors: use at least 0.1024 (100 tensors of 1024)");
  for (const std::string& name : names) {
    Entry e;
    e.name = name;
    std::string rest = name;
    if (const auto at = rest.find('@'); at != std::string::npos) {
      e.plugin = rest.substr(at + 1);
      rest = rest.substr(0, at);
    }
    if (const auto colon = rest.find(':'); colon != std::string::npos) {
      e.isa = rest.substr(colon + 1);
      rest = rest.substr(0, colon);
    }
    if (const auto slash = rest.find('/'); slash != std::string::npos) {
      e.kernel = rest.substr(slash + 1);
      rest = rest.substr(0, slash);
    }
    e.rule = rest;
    if (!e.isa.empty() && e.isa != "avx512" && e.isa != "avx2" && e.isa != "scalar")
      throw std::runtime_error("entry '" + name + "': ISA '" + e.isa +
                               "' is not avx512, avx2 or scalar");
    loom::Schema schema("optimizer", e.rule);
    if (e.rule != "torch-fused") e.update_rule = make(e.rule, e.plugin.c_str(), e.kernel, &schema);
    // A rule that keeps fp32 state below min_8bit_size (adam8bit) would time AdamW's loop, not
    // its own kernel, on tensors this small (session 25 nearly drew conclusions from one).
    if (const loom::KeySpec* key = schema.find("min_8bit_size"); key && key->default_value)
      if (const auto* least = std::get_if<int64_t>(&key->default_value->value);
          least && per_tensor < *least)
        std::fprintf(stderr,
                     "%s: tensors of %lld elements are below its min_8bit_size (%lld): this "
                     "times its fp32-state path; use PARAMS_MILLIONS >= %.4g\n",
                     name.c_str(), static_cast<long long>(per_tensor),
                     static_cast<long long>(*least),
                     static_cast<double>((*least + 1023) / 1024 * 1024) * 100 / 1e6);
    e.segments = make_segments(e.update_rule.get(), total, grads, device);
    if (!e.update_rule)
      for (const auto& s : e.segments) {
        e.m.push_back(at::zeros_like(s.param));
        e.v.push_back(at::zeros_like(s.param));
      }
    entries.push_back(std::move(e));
  }
  const char* outer_isa = std::getenv("LOOM_KERNEL_ISA");
  const std::string restore = outer_isa ? outer_isa : "";
  for (int round = 0; round < rounds + 1; ++round)
    for (Entry& e : entries) {
      if (!e.isa.empty()) setenv("LOOM_KERNEL_ISA", e.isa.c_str(), 1);
      std::vector<at::Tensor> params, grads_of, steps;  // torch-fused's lists, made untimed
      if (!e.update_rule)
        for (const auto& s : e.segments) {
          params.push_back(s.param);
          grads_of.push_back(s.grad);
          steps.push_back(at::full({}, static_cast<double>(first_step + round),
                                   at::TensorOptions().dtype(at::kFloat).device(device)));
        }
      finish(e.segments.back().param);  // the untimed work above done first
      const auto t = Clock::now();
      if (e.update_rule) {
        update_all(*e.update_rule, e.segments, first_step + round);
      } else {
        at::_fused_adamw_(params, grads_of, e.m, e.v, {}, steps, 1e-3, 0.9, 0.999, 0.01, 1e-8,
                          /*amsgrad=*/false, /*maximize=*/false);
      }
      finish(e.segments.back().param);
      if (round > 0) e.seconds.push_back(seconds_since(t));  // round 0 warms up
      // What ran: LOOM_KERNEL_ISA is a cap, so "avx512" on an AVX2 CPU runs avx2.
      if (e.update_rule) e.used_isa = used_isa(e.rule);
      if (!e.isa.empty()) {
        if (restore.empty()) unsetenv("LOOM_KERNEL_ISA");
        else setenv("LOOM_KERNEL_ISA", restore.c_str(), 1);
      }
    }
  const int64_t count = static_cast<int64_t>(entries.front().segments.size()) *
                        entries.front().segments[0].param.numel();
  for (const Entry& e : entries) {
    std::string list;
    for (double x : e.seconds) list += (list.empty() ? "" : ", ") + std::to_string(x);
    std::printf("{\"entry\": \"%s\", \"threads\": %d, \"params\": %lld, \"seconds\": [%s], "
                "\"kernel_isa\": \"%s\", \"device\": \"%s\"}\n",
                e.name.c_str(), threads, static_cast<long long>(count), list.c_str(),
                device.is_cpu() ? e.used_isa.c_str() : "gpu", device.str().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  loom::cpu::ensure_cpu_kernels_work();  // before any kernel or thread: loom/cpu.h
  if (argc >= 6 && std::string(argv[1]) == "compare") {
    try {
      at::set_num_threads(std::stoi(argv[2]));
      return compare(std::stoi(argv[2]), std::stoi(argv[3]),
                     static_cast<int64_t>(std::stod(argv[4]) * 1e6),
                     std::vector<std::string>(argv + 5, argv + argc));
    } catch (const std::exception& e) {  // an unknown rule, ISA or plugin file: say which
      std::fprintf(stderr, "%s compare: %s\n", argv[0], e.what());
      return 1;
    }
  }
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
  auto rule = make(rule_name, std::getenv("LOOM_BENCH_OPTIM_PLUGIN"));
  std::vector<at::Tensor> grads;
  std::vector<loom::Segment> segments = make_segments(rule.get(), total, grads);
  const int64_t count = static_cast<int64_t>(segments.size()) * segments[0].param.numel();
  int64_t state_bytes = 0;
  for (const auto& s : segments)
    for (const auto& [key, t] : s.state) state_bytes += t.numel() * t.element_size();
  for (int step = 0; step < steps + 1; ++step) {
    const auto t = Clock::now();
    update_all(*rule, segments, step + 1);
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
