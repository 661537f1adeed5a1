// Tests of the update rules: the core's adamw and the optim plugin's adafactor, adam8bit, sgd,
// lion. Parity with references run in Python (torch, Transformers, Lion from the paper), split
// conformance, bitwise resume, the 8-bit maps' error bound, convergence, and bad input.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>

#include "loom/kernel_isa.h"
#include "loom/memory.h"
#include "loom/plugin.h"
#include "loom/safetensors.h"
#include "loom/trainer.h"
#include "quantize.h"
#include "test_util.h"
#include "update_rules.h"

namespace loom {
namespace {

using test::TempDir;
using test::make_rule;
using test::RuleValue;
using test::optim_plugin;
using test::tiny_gpt_job;

using Trajectory = std::vector<std::vector<at::Tensor>>;  // [step][tensor]

// Parameters of several shapes and a gradient per step, reproducible.
struct Problem {
  std::vector<at::Tensor> params;
  std::vector<std::vector<at::Tensor>> grads;  // [step][tensor]
  std::vector<bool> decay;                     // weight decay group
};

Problem make_problem(const std::vector<std::vector<int64_t>>& shapes, int steps, uint64_t seed) {
  at::manual_seed(seed);
  Problem p;
  for (const auto& shape : shapes) {
    p.params.push_back(at::randn(shape) * 0.5);
    p.decay.push_back(shape.size() >= 2);
  }
  for (int s = 0; s < steps; ++s) {
    std::vector<at::Tensor> step;
    for (const auto& shape : shapes) step.push_back(at::randn(shape) * (0.1 + 0.01 * s));
    p.grads.push_back(step);
  }
  return p;
}

// Runs `rule` over the problem, each tensor cut into segments at `cuts` (flat offsets, without
// 0 and numel); returns the parameters after every step.
// With `with_state`, each step's snapshot also holds every segment's state tensors after the
// parameters.
// With `batched` (no cuts), each step gives the rule its tensors in two update_many calls, one
// per weight-decay group, as the step driver does.
Trajectory run_rule(const UpdateRule& rule, const Problem& problem, double lr, double weight_decay,
                    const std::vector<std::vector<int64_t>>& cuts = {}, bool with_state = false,
                    bool batched = false) {
  std::vector<at::Tensor> params;
  std::vector<std::vector<Segment>> segments;
  for (size_t i = 0; i < problem.params.size(); ++i) {
    params.push_back(problem.params[i].clone().view(-1));
    std::vector<int64_t> bounds = {0};
    if (i < cuts.size()) bounds.insert(bounds.end(), cuts[i].begin(), cuts[i].end());
    bounds.push_back(params[i].numel());
    std::vector<Segment> list;
    for (size_t k = 0; k + 1 < bounds.size(); ++k) {
      Segment s;
      s.name = detail::cat("p", i);  // "p" + to_string(i) drew GCC 12's false overflow warning
      s.param = params[i].slice(0, bounds[k], bounds[k + 1]);
      s.shape = problem.params[i].sizes().vec();
      s.offset = bounds[k];
      s.state = rule.init_state(s);
      list.push_back(std::move(s));
    }
    segments.push_back(std::move(list));
  }
  std::vector<std::vector<at::Tensor>> out;
  for (size_t step = 0; step < problem.grads.size(); ++step) {
    std::vector<Segment*> batch[2];  // [decay]
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor grad = problem.grads[step][i].reshape(-1);
      std::vector<Segment*> pointers;
      for (auto& s : segments[i]) {
        s.grad = grad.slice(0, s.offset, s.offset + s.param.numel());
        pointers.push_back(&s);
      }
      UpdateContext ctx;
      ctx.step = static_cast<int64_t>(step) + 1;
      ctx.lr = lr;
      ctx.weight_decay = problem.decay[i] ? weight_decay : 0.0;
      if (batched) {
        batch[problem.decay[i] ? 1 : 0].push_back(pointers.front());
      } else {
        update_tensor(rule, pointers, ctx);
      }
    }
    for (int decay : {0, 1}) {
      if (batch[decay].empty()) continue;
      UpdateContext ctx;
      ctx.step = static_cast<int64_t>(step) + 1;
      ctx.lr = lr;
      ctx.weight_decay = decay ? weight_decay : 0.0;
      rule.update_many(batch[decay], ctx);
    }
    std::vector<at::Tensor> snapshot;
    for (size_t i = 0; i < params.size(); ++i)
      snapshot.push_back(params[i].view(problem.params[i].sizes()).clone());
    if (with_state)
      for (const auto& list : segments)
        for (const Segment& s : list)
          for (const auto& named : s.state) snapshot.push_back(named.second.clone());
    out.push_back(snapshot);
  }
  return out;
}

// The references' parameters after every step (reference.py), one list per (rule, config).
std::vector<Trajectory> run_references(const std::vector<std::pair<std::string, std::string>>& jobs,
                                       const Problem& problem) {
  TempDir dir;
  NamedTensors input;
  for (size_t i = 0; i < problem.params.size(); ++i)
    input.emplace_back("param." + std::to_string(i), problem.params[i]);
  for (size_t s = 0; s < problem.grads.size(); ++s)
    for (size_t i = 0; i < problem.params.size(); ++i)
      input.emplace_back("grad." + std::to_string(s) + "." + std::to_string(i),
                         problem.grads[s][i]);
  safetensors::save(dir / "in.safetensors", input);
  std::string decay = "[";
  for (size_t i = 0; i < problem.decay.size(); ++i)
    decay += (i ? "," : "") + std::to_string(int(problem.decay[i]));
  std::string list = "[";
  for (size_t k = 0; k < jobs.size(); ++k)
    list += detail::cat(k ? ", " : "", "{\"rule\": \"", jobs[k].first, "\", \"config\": {",
                        jobs[k].second, ", \"decay\": ", decay, "]}}");
  list += "]";
  const std::string command = std::string(LOOM_TEST_PYTHON) + " " + LOOM_OPTIM_REFERENCE + " '" +
                              list + "' " + (dir / "in.safetensors").string() + " " +
                              (dir / "out").string();
  if (std::system(command.c_str()) != 0) throw std::runtime_error("reference failed: " + command);
  std::vector<Trajectory> out;
  for (size_t k = 0; k < jobs.size(); ++k) {
    auto contents = safetensors::load(dir / ("out." + std::to_string(k) + ".safetensors"));
    std::map<std::string, at::Tensor> by_name(contents.tensors.begin(), contents.tensors.end());
    Trajectory t(problem.grads.size());
    for (size_t s = 0; s < problem.grads.size(); ++s)
      for (size_t i = 0; i < problem.params.size(); ++i)
        t[s].push_back(by_name.at("param." + std::to_string(s) + "." + std::to_string(i)));
    out.push_back(t);
  }
  return out;
}
Trajectory run_reference(const std::string& rule, const std::string& config,
                         const Problem& problem) {
  return run_references({{rule, config}}, problem).front();
}

// Largest |a-b| / max|b| per tensor, over all steps and tensors: the error relative to the
// tensor's scale (an element that crosses zero is not held to a relative bound of its own).
double max_relative_error(const Trajectory& got, const Trajectory& want) {
  double worst = 0;
  for (size_t s = 0; s < want.size(); ++s)
    for (size_t i = 0; i < want[s].size(); ++i) {
      at::Tensor w = want[s][i].to(at::kDouble), g = got[s][i].to(at::kDouble);
      worst = std::max(worst, ((g - w).abs().max() / w.abs().max()).item<double>());
    }
  return worst;
}

const std::vector<std::vector<int64_t>> kShapes = {{24, 40}, {40}, {3, 8, 10}, {7}};

// ---- parity with references ----

TEST(OptimParity, AdamWMatchesTorchOver100Steps) {
  const Problem problem = make_problem(kShapes, 100, 1);
  auto rule = make_rule("adamw", {{"beta1", 0.8}, {"beta2", 0.95}, {"eps", 1e-6}});
  auto got = run_rule(*rule, problem, 1e-2, 0.1);
  auto want = run_reference(
      "adamw", R"("lr": 0.01, "beta1": 0.8, "beta2": 0.95, "eps": 1e-6, "weight_decay": 0.1)",
      problem);
  EXPECT_LT(max_relative_error(got, want), 1e-6);
}

TEST(OptimParity, SgdMatchesTorch) {
  const Problem problem = make_problem(kShapes, 30, 2);
  struct Case {
    double momentum, dampening;
    bool nesterov;
    double wd;
  };
  const std::vector<Case> cases = {Case{0.0, 0.0, false, 0.0}, Case{0.9, 0.0, true, 0.01},
                                   Case{0.9, 0.1, false, 0.05}};
  std::vector<std::pair<std::string, std::string>> jobs;
  for (const Case& c : cases)
    jobs.emplace_back("sgd", detail::cat("\"lr\": 0.05, \"momentum\": ", c.momentum,
                                         ", \"dampening\": ", c.dampening,
                                         ", \"nesterov\": ", c.nesterov ? "true" : "false",
                                         ", \"weight_decay\": ", c.wd));
  const auto want = run_references(jobs, problem);
  // Each kernel (Note [Multi-tensor passes] in plugins/optim/optim.cpp): the loops, torch's
  // fused SGD over update_many's tensors (a GPU's path), the per-tensor ops.
  for (const std::string kernel : {"auto", "multi_tensor", "tensor_ops"})
    for (size_t k = 0; k < cases.size(); ++k) {
      const Case& c = cases[k];
      auto rule = make_rule("sgd", {{"momentum", c.momentum},
                                    {"dampening", c.dampening},
                                    {"nesterov", c.nesterov},
                                    {"kernel", kernel}});
      const bool batched = kernel != "auto";
      EXPECT_LT(
          max_relative_error(run_rule(*rule, problem, 0.05, c.wd, {}, false, batched), want[k]),
          1e-6)
          << kernel << " " << c.momentum << " " << c.nesterov;
    }
}

TEST(OptimParity, LionMatchesThePaper) {
  const Problem problem = make_problem(kShapes, 50, 3);
  auto want = run_reference(
      "lion", R"("lr": 0.001, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.5)", problem);
  for (const std::string kernel : {"auto", "multi_tensor", "tensor_ops"}) {
    auto rule = make_rule("lion", {{"beta1", 0.9}, {"beta2", 0.99}, {"kernel", kernel}});
    auto got = run_rule(*rule, problem, 1e-3, 0.5, {}, false, /*batched=*/kernel != "auto");
    EXPECT_LT(max_relative_error(got, want), 1e-6) << kernel;
  }
}

// Note [Multi-tensor passes]: update_many takes the fp32 contiguous tensors in one pass and the
// others tensor by tensor, and both end where the loops do: a gradient that is a strided view
// (not contiguous) beside contiguous ones.
TEST(OptimParity, MultiTensorPassesLeaveOtherTensorsToTheirOwnPath) {
  for (const std::string name : {"sgd", "lion"}) {
    SCOPED_TRACE(name);
    std::map<std::string, RuleValue> options;
    if (name == "sgd") options = {{"momentum", 0.9}};
    auto loops = make_rule(name, options);
    options["kernel"] = std::string("multi_tensor");
    auto multi = make_rule(name, options);
    at::manual_seed(7);
    const at::Tensor start = at::randn({3, 64}), wide = at::randn({64, 6}) * 0.1;
    auto run = [&](const UpdateRule& rule) {
      std::vector<at::Tensor> params = {start[0].clone(), start[1].clone(), start[2].clone()};
      std::vector<Segment> segments(3);
      for (int i = 0; i < 3; ++i) {
        segments[i].name = "t" + std::to_string(i);
        segments[i].param = params[i];
        segments[i].shape = {64};
        segments[i].state = rule.init_state(segments[i]);
      }
      for (int step = 1; step <= 3; ++step) {
        segments[0].grad = wide.select(1, step);  // stride 6: not contiguous
        segments[1].grad = wide.select(1, step - 1).contiguous();
        segments[2].grad = wide.select(1, step + 2).contiguous() * 2;
        std::vector<Segment*> all = {&segments[0], &segments[1], &segments[2]};
        UpdateContext ctx;
        ctx.step = step;
        ctx.lr = 0.01;
        ctx.weight_decay = 0.1;
        rule.update_many(all, ctx);
      }
      return params;
    };
    const auto want = run(*loops), got = run(*multi);
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(at::allclose(got[i], want[i], 1e-6, 1e-7)) << "tensor " << i;
      EXPECT_FALSE(at::equal(got[i], start[i])) << "tensor " << i << " was not updated";
    }
  }
}

// Transformers' defaults (relative step, parameter scaling) and the Trainer's
// optim="adafactor" (scale_parameter=False, relative_step=False, the job's lr).
TEST(OptimParity, AdafactorMatchesTransformersStepByStep) {
  const Problem problem = make_problem(kShapes, 30, 4);
  const std::string common =
      R"("eps1": 1e-30, "eps2": 1e-3, "clip_threshold": 1.0, "decay_rate": -0.8, "beta1": null, "warmup_init": false)";
  const auto want = run_references(
      {{"adafactor", common + R"(, "scale_parameter": true, "relative_step": true)"},
       {"adafactor",
        common +
            R"(, "scale_parameter": false, "relative_step": false, "lr": 0.001, "weight_decay": 0.01)"}},
      problem);
  auto defaults = make_rule("adafactor");
  EXPECT_LT(max_relative_error(run_rule(*defaults, problem, 0.0, 0.0), want[0]), 1e-6);
  auto trainer = make_rule("adafactor", {{"scale_parameter", false}, {"relative_step", false}});
  EXPECT_LT(max_relative_error(run_rule(*trainer, problem, 1e-3, 0.01), want[1]), 1e-6);
  // The tensor-op implementation (what runs on GPUs), here on CPU tensors: the same reference.
  auto ops_defaults = make_rule("adafactor", {{"kernel", std::string("tensor_ops")}});
  EXPECT_LT(max_relative_error(run_rule(*ops_defaults, problem, 0.0, 0.0), want[0]), 1e-6);
  auto ops_trainer = make_rule("adafactor", {{"scale_parameter", false},
                                             {"relative_step", false},
                                             {"kernel", std::string("tensor_ops")}});
  EXPECT_LT(max_relative_error(run_rule(*ops_trainer, problem, 1e-3, 0.01), want[1]), 1e-6);
}

// An update that is never clipped (clip_threshold far above its RMS: clip_div = 1) takes the
// loops' path without the division by clip_div (u / 1 is u exactly); it still follows
// Transformers, whose arithmetic divides, within the same bound, on every ISA path.
TEST(OptimParity, AdafactorUnclippedStepsMatchTransformers) {
  const Problem problem = make_problem(kShapes, 20, 5);
  const std::string config =
      R"("eps1": 1e-30, "eps2": 1e-3, "clip_threshold": 1e6, "decay_rate": -0.8, "beta1": 0.9, "warmup_init": false, "scale_parameter": false, "relative_step": false, "lr": 0.001, "weight_decay": 0.01)";
  const Trajectory want = run_reference("adafactor", config, problem);
  auto rule = make_rule("adafactor", {{"clip_threshold", 1e6},
                                      {"beta1", 0.9},
                                      {"scale_parameter", false},
                                      {"relative_step", false}});
  for (const char* isa : {"scalar", "avx2", "avx512"}) {
    setenv("LOOM_KERNEL_ISA", isa, 1);
    const Trajectory got = run_rule(*rule, problem, 1e-3, 0.01);
    unsetenv("LOOM_KERNEL_ISA");
    EXPECT_LT(max_relative_error(got, want), 1e-6) << isa;
  }
}

// Note [Adafactor's column sums in row groups]: tensors of several row groups (512 rows of 256
// columns each; three matrices of 200 rows, where matrices cut the groups; a vector of two
// chunks; five matrices of 3 rows, groups whose first rows are fewer than four, which write
// the group's partial sums row by row) follow Transformers, give the same bits on one thread
// and on two, and give the same bits cut at a group's edge as whole.
TEST(OptimParity, AdafactorRowGroupsMatchTransformersAtAnyThreadCount) {
  const Problem problem = make_problem({{1100, 256}, {3, 200, 256}, {20000}, {5, 3, 7}}, 4, 8);
  const std::string common =
      R"("eps1": 1e-30, "eps2": 1e-3, "clip_threshold": 1.0, "decay_rate": -0.8, "beta1": null, "warmup_init": false)";
  const auto want = run_references(
      {{"adafactor", common + R"(, "scale_parameter": true, "relative_step": true)"}}, problem);
  auto rule = make_rule("adafactor");
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const Trajectory one = run_rule(*rule, problem, 0.0, 0.0);
  at::set_num_threads(2);
  const Trajectory two = run_rule(*rule, problem, 0.0, 0.0);
  const Trajectory cut = run_rule(*rule, problem, 0.0, 0.0, {{512 * 256}, {}, {16384}, {}});
  at::set_num_threads(threads);
  EXPECT_LT(max_relative_error(one, want[0]), 1e-6);
  for (size_t s = 0; s < one.size(); ++s)
    for (size_t i = 0; i < one[s].size(); ++i) {
      EXPECT_TRUE(at::equal(one[s][i], two[s][i])) << "step " << s << ", tensor " << i;
      EXPECT_TRUE(at::equal(one[s][i], cut[s][i])) << "step " << s << ", tensor " << i;
    }
}

// Both implementations with first moments (beta1), split into row segments as a ZeRO shard
// would cut them: the tensor ops follow the loops.
TEST(OptimParity, AdafactorTensorOpsFollowTheLoopsWithMomentumAndSplits) {
  const Problem problem = make_problem(kShapes, 20, 6);
  const std::map<std::string, RuleValue> momentum = {{"beta1", 0.9}, {"relative_step", false}};
  auto loops = make_rule("adafactor", momentum);
  auto with_ops = momentum;
  with_ops["kernel"] = std::string("tensor_ops");
  auto ops = make_rule("adafactor", with_ops);
  // Row cuts: (24,40) at rows 8 and 16, (40) anywhere, (3,8,10) between its matrices, (7).
  const std::vector<std::vector<int64_t>> cuts = {{320, 640}, {13, 27}, {80, 160}, {3}};
  EXPECT_LT(max_relative_error(run_rule(*ops, problem, 1e-3, 0.1, cuts),
                               run_rule(*loops, problem, 1e-3, 0.1)),
            1e-6);
}

// The bytes of temporaries one step of `rule` makes on a random tensor of `shape` (the CPU's
// tracking allocator, above what was live before), printed; the step must move the tensor.
int64_t update_temporaries(const UpdateRule& rule, const std::vector<int64_t>& shape) {
  memory::install_cpu_tracker();
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  Segment s;
  s.name = "w";
  s.param = at::randn({n});
  s.grad = at::randn({n}) * 0.1;
  s.shape = shape;
  s.state = rule.init_state(s);
  UpdateContext ctx;
  ctx.lr = 1e-3;
  const at::Tensor before = s.param.clone();
  const int64_t held = memory::cpu_stats().current_bytes;
  memory::reset_cpu_peak();
  update_tensor(rule, {&s}, ctx);
  const int64_t transient = memory::cpu_stats().peak_bytes - held;
  std::printf("%s tensor ops over %lld elements: %.1f MB of temporaries\n", rule.name().c_str(),
              static_cast<long long>(n), transient / 1e6);
  EXPECT_FALSE(at::equal(before, s.param));
  return transient;
}

// Note [Adafactor's tensor ops in slices]: the GPU path takes one slice's temporaries (2 M
// elements' worth), not the tensor's (before, 32 B per element: 537 MB for this gradient), and
// its update is the same whether a tensor is one slice or eight (the loops' result, to the
// fp64 rounding of the per-slice sums of p²): a 1024 x 2560 matrix (slices of 819 rows, the
// last partial) with momentum and weight decay, and a vector longer than a slice.
TEST(OptimParity, AdafactorTensorOpsRunInSlicesOfRows) {
  const Problem problem = make_problem({{1024, 2560}, {(int64_t{1} << 21) + 77}}, 2, 12);
  const std::map<std::string, RuleValue> momentum = {{"beta1", 0.9}, {"relative_step", false}};
  auto with_ops = momentum;
  with_ops["kernel"] = std::string("tensor_ops");
  auto ops = make_rule("adafactor", with_ops);
  auto loops = make_rule("adafactor", momentum);
  EXPECT_LT(max_relative_error(run_rule(*ops, problem, 1e-3, 0.1),
                               run_rule(*loops, problem, 1e-3, 0.1)),
            1e-6);
  const int64_t n = int64_t{4096} * 4096;  // eight slices
  EXPECT_LT(update_temporaries(*ops, {4096, 4096}), 8 * n)
      << "more than two fp32 copies of the tensor";
}

// With every tensor below min_8bit_size adam8bit is AdamW; quantized, it tracks AdamW closely.
TEST(OptimParity, Adam8bitIsAdamWWithFp32StateAndCloseWithQuantizedState) {
  const Problem problem = make_problem({{64, 128}, {128}}, 50, 5);
  auto adamw = make_rule("adamw");
  auto want = run_rule(*adamw, problem, 1e-3, 0.01);
  auto fp32 = make_rule("adam8bit", {{"min_8bit_size", int64_t{1} << 40}});
  EXPECT_LT(max_relative_error(run_rule(*fp32, problem, 1e-3, 0.01), want), 1e-6);
  auto q = make_rule("adam8bit", {{"min_8bit_size", int64_t{1024}}});
  auto got = run_rule(*q, problem, 1e-3, 0.01);
  // The displacement from the start differs from AdamW's by a few percent at most.
  const at::Tensor moved = want.back()[0] - problem.params[0];
  const double error = ((got.back()[0] - want.back()[0]).norm() / moved.norm()).item<double>();
  EXPECT_LT(error, 0.03);
}

// The default block size, by measured accuracy: the trajectory's distance from fp32 AdamW
// for the paper's 2048, bitsandbytes' current 256, and 64 (state 2 + 8/block bytes/param).
TEST(OptimParity, Adam8bitBlockSizeTradesAccuracyForState) {
  const Problem problem = make_problem({{128, 512}}, 60, 9);
  // Rows of very different scale, as embeddings and attention weights have.
  Problem scaled = problem;
  const at::Tensor scale = at::logspace(-3, 0, 128).unsqueeze(1);
  for (auto& step : scaled.grads) step[0] = step[0] * scale;
  auto adamw = make_rule("adamw");
  const auto want = run_rule(*adamw, scaled, 1e-3, 0.0);
  const at::Tensor moved = want.back()[0] - scaled.params[0];
  std::map<int64_t, double> error;
  for (int64_t block : {64, 256, 2048}) {
    auto q = make_rule("adam8bit", {{"block_size", block}});
    const auto got = run_rule(*q, scaled, 1e-3, 0.0);
    error[block] = ((got.back()[0] - want.back()[0]).norm() / moved.norm()).item<double>();
    std::printf("block %lld: relative distance from AdamW %.5f\n", static_cast<long long>(block),
                error[block]);
  }
  EXPECT_LT(error[256], error[2048]);
  EXPECT_LE(error[64], error[256] * 1.05);
}

// ---- conformance: every rule, split at its granularity, is bit-identical to unsplit ----

struct RuleCase {
  std::string name;
  std::map<std::string, RuleValue> values;
  double lr;
};

std::vector<RuleCase> all_rules() {
  return {
      {"adamw", {}, 1e-2},
      {"adamw", {{"state_dtype", std::string("bf16")}}, 1e-2},
      {"adafactor", {}, 0.0},
      {"adafactor", {{"scale_parameter", false}, {"relative_step", false}, {"beta1", 0.9}}, 1e-2},
      {"adam8bit", {{"block_size", int64_t{64}}, {"min_8bit_size", int64_t{256}}}, 1e-2},
      {"sgd", {{"momentum", 0.9}, {"nesterov", true}}, 1e-2},
      {"lion", {}, 1e-3}};
}

TEST(OptimConformance, SplitRunsAreBitIdenticalToUnsplit) {
  const Problem problem = make_problem(kShapes, 6, 6);  // 960, 40, 240, 7 elements
  for (const auto& c : all_rules()) {
    auto rule = make_rule(c.name, c.values);
    const auto whole = run_rule(*rule, problem, c.lr, 0.1);
    const Partitioning part = rule->partitioning();
    // Cut points in units of the granularity: rows of dim 0, blocks, or single elements.
    auto unit = [&](size_t i) -> int64_t {
      const auto& t = problem.params[i];
      if (part.granularity == Granularity::row) return t.numel() / t.size(0);
      if (part.granularity == Granularity::block) return part.block;
      return 1;
    };
    for (int pieces : {2, 3}) {
      std::vector<std::vector<int64_t>> cuts;
      for (size_t i = 0; i < problem.params.size(); ++i) {
        const int64_t u = unit(i), units = (problem.params[i].numel() + u - 1) / u;
        std::vector<int64_t> list;
        for (int k = 1; k < pieces; ++k) {
          const int64_t at_unit = units * k / pieces + (k == 1 ? 0 : 1);  // uneven pieces
          if (at_unit > 0 && at_unit * u < problem.params[i].numel()) list.push_back(at_unit * u);
        }
        std::sort(list.begin(), list.end());
        list.erase(std::unique(list.begin(), list.end()), list.end());
        cuts.push_back(list);
      }
      const auto split = run_rule(*rule, problem, c.lr, 0.1, cuts);
      for (size_t s = 0; s < whole.size(); ++s)
        for (size_t i = 0; i < whole[s].size(); ++i)
          EXPECT_TRUE(at::equal(whole[s][i], split[s][i]))
              << c.name << " in " << pieces << " pieces, step " << s << ", tensor " << i;
    }
  }
}

TEST(OptimConformance, ThreadCountDoesNotChangeResults) {
  const Problem problem = make_problem({{512, 300}, {300}}, 3, 7);
  const int threads = at::get_num_threads();
  for (const auto& c : all_rules()) {
    auto rule = make_rule(c.name, c.values);
    at::set_num_threads(1);
    const auto one = run_rule(*rule, problem, c.lr, 0.1);
    at::set_num_threads(2);
    const auto two = run_rule(*rule, problem, c.lr, 0.1);
    for (size_t i = 0; i < one.back().size(); ++i)
      EXPECT_TRUE(at::equal(one.back()[i], two.back()[i])) << c.name;
  }
  at::set_num_threads(threads);
}

// A batch of whole tensors in one update_many at 2 threads (adafactor shares them among the
// threads, Note [Adafactor's tensors shared among threads]: the large one split, the others
// whole per thread) gives the bits of one tensor at a time on one thread, state included.
TEST(OptimConformance, UpdateManyAtTwoThreadsEqualsOneTensorAtATime) {
  const Problem problem =
      make_problem({{512, 300}, {64, 96}, {300}, {48, 40}, {200, 30}, {7}, {96, 64}}, 3, 8);
  const int threads = at::get_num_threads();
  for (const auto& c : all_rules()) {
    auto rule = make_rule(c.name, c.values);
    at::set_num_threads(1);
    const auto one = run_rule(*rule, problem, c.lr, 0.1, {}, /*with_state=*/true);
    at::set_num_threads(2);
    const auto batched = run_rule(*rule, problem, c.lr, 0.1, {}, true, /*batched=*/true);
    ASSERT_EQ(one.back().size(), batched.back().size());
    for (size_t i = 0; i < one.back().size(); ++i)
      EXPECT_TRUE(at::equal(one.back()[i], batched.back()[i])) << c.name << " tensor " << i;
  }
  at::set_num_threads(threads);
}

// ---- checkpoints ----

std::vector<std::string> optimizer_set(const RuleCase& c) {
  std::vector<std::string> set = {"train.max_steps=6", "optimizer.name=" + c.name,
                                  "train.learning_rate=" + std::to_string(c.lr > 0 ? c.lr : 1e-2),
                                  "optimizer.weight_decay=0.01"};
  for (const auto& [key, v] : c.values)
    set.push_back("optimizer." + key + "=" +
                  std::visit(
                      [](auto x) {
                        if constexpr (std::is_same_v<decltype(x), bool>)
                          return std::string(x ? "true" : "false");
                        else if constexpr (std::is_same_v<decltype(x), std::string>)
                          return "\"" + x + "\"";
                        else
                          return std::to_string(x);
                      },
                      v));
  return set;
}

TEST(OptimCheckpoint, EveryRuleResumesBitwise) {
  for (const auto& c : all_rules()) {
    TempDir straight, split;
    auto set = optimizer_set(c);
    Trainer::from_text(tiny_gpt_job(straight.str()), straight.path(), set)->run();
    {
      auto first = Trainer::from_text(tiny_gpt_job(split.str()), split.path(), set);
      first->setup();
      for (int i = 0; i < 3; ++i) ASSERT_TRUE(first->step());
      first->save_checkpoint();
    }
    set.push_back("train.resume=latest");
    Trainer::from_text(tiny_gpt_job(split.str()), split.path(), set)->run();
    for (const char* file : {"model.safetensors", "optimizer-00000-of-00001.safetensors"}) {
      auto want = safetensors::load(straight / "checkpoint-6" / file).tensors;
      auto got = safetensors::load(split / "checkpoint-6" / file).tensors;
      ASSERT_EQ(want.size(), got.size()) << c.name << " " << file;
      for (size_t i = 0; i < want.size(); ++i)
        EXPECT_TRUE(at::equal(want[i].second, got[i].second)) << c.name << " " << want[i].first;
    }
  }
}

// Floats that end where an inaccessible page begins: any access past the last one faults.
class GuardedFloats {
 public:
  explicit GuardedFloats(int64_t n) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t need = static_cast<size_t>(n) * sizeof(float);
    const size_t pages = (need + page - 1) / page;
    bytes_ = (pages + 1) * page;
    base_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base_ == MAP_FAILED) throw std::runtime_error("mmap failed");
    char* guard = static_cast<char*>(base_) + pages * page;
    if (mprotect(guard, page, PROT_NONE) != 0) throw std::runtime_error("mprotect failed");
    tensor_ = at::from_blob(guard - need, {n}, at::kFloat);
  }
  ~GuardedFloats() { munmap(base_, bytes_); }
  GuardedFloats(const GuardedFloats&) = delete;
  GuardedFloats& operator=(const GuardedFloats&) = delete;
  at::Tensor& tensor() { return tensor_; }

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  at::Tensor tensor_;
};

// Note [Streams prefetched ahead] (loom/prefetch.h): the CPU loops ask for lines past their
// arrays' ends, which must stay harmless: with the parameter and the gradient each ending at an
// inaccessible page, every rule (both AdamW state types, adam8bit's blocks with a partial last
// one, adafactor's rows with and without momentum, sgd, lion) runs three steps without a fault
// and lands on the bits it lands on in ordinary memory.
TEST(OptimKernels, NoKernelReadsPastItsTensors) {
  const std::vector<int64_t> shape = {3, 347};  // 1041 elements: no multiple of 16 or 64
  const int64_t n = 3 * 347;
  at::manual_seed(17);
  const at::Tensor start = at::randn({n}) * 0.5;
  std::vector<at::Tensor> grads;
  for (int step = 0; step < 3; ++step) grads.push_back(at::randn({n}) * 0.1);
  for (const auto& c : all_rules()) {
    SCOPED_TRACE(c.name);
    auto rule = make_rule(c.name, c.values);
    auto train = [&](at::Tensor param, at::Tensor grad) {
      Segment s;
      s.name = "w";
      s.param = param;
      s.param.copy_(start);
      s.shape = shape;
      s.state = rule->init_state(s);
      for (int step = 0; step < 3; ++step) {
        grad.copy_(grads[step]);
        s.grad = grad;
        UpdateContext ctx;
        ctx.step = step + 1;
        ctx.lr = c.lr != 0 ? c.lr : 1e-3;
        ctx.weight_decay = 0.1;
        update_tensor(*rule, {&s}, ctx);
      }
      return s.param.clone();
    };
    GuardedFloats param(n), grad(n);
    const at::Tensor guarded = train(param.tensor(), grad.tensor());
    const at::Tensor ordinary = train(at::empty({n}), at::empty({n}));
    EXPECT_TRUE(at::equal(guarded, ordinary));
    EXPECT_FALSE(at::equal(guarded, start)) << "the rule did not update";
  }
}

TEST(OptimCheckpoint, RejectsAnotherRulesOrShapesState) {
  TempDir dir;
  const RuleCase q{
      "adam8bit", {{"block_size", int64_t{64}}, {"min_8bit_size", int64_t{256}}}, 1e-2};
  auto set = optimizer_set(q);
  set[0] = "train.max_steps=2";
  Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), set)->run();
  auto lion = optimizer_set({"lion", {}, 1e-3});
  lion[0] = "train.max_steps=4";
  lion.push_back("train.resume=latest");
  EXPECT_THROW_WITH(Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), lion)->run(),
                    CheckpointError, "adam8bit", "lion");
  // Same rule, another block size: the absmax tensors have another shape.
  set[0] = "train.max_steps=4";
  set.push_back("optimizer.block_size=128");
  set.push_back("train.resume=latest");
  EXPECT_THROW_WITH(Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), set)->run(),
                    CheckpointError, "optimizer-00000-of-00001.safetensors", "exp_avg_absmax");
}

// ---- 8-bit quantization ----

TEST(OptimQuantization, MapsAreSortedAndExactAtZeroAndOne) {
  for (bool is_signed : {true, false}) {
    const optim::QuantMap map(is_signed);
    for (int i = 0; i < 255; ++i) EXPECT_LE(map.code[i], map.code[i + 1]);
    EXPECT_EQ(map.code[255], 1.0f);
    EXPECT_EQ(map.code[0], is_signed ? -1.0f : 0.0f);
    EXPECT_EQ(map.dequantize(map.quantize(0.0f)), 0.0f);
    EXPECT_EQ(map.quantize(1.0f), 255);
    // Tiny values keep a code: the smallest positive is 10^-(bits-1).
    float smallest = 1;
    for (float c : map.code)
      if (c > 0) smallest = std::min(smallest, c);
    EXPECT_NEAR(smallest, is_signed ? 1e-6 : 1e-7, 1e-9);
  }
}

// Note [Quantize by table]: the table path gives the binary search's byte for every float it
// is tried on: a stride through all 2^32 bit patterns (both signs, tiny, huge, inf, NaN), and
// each threshold and code with its neighbours one ulp away.
TEST(OptimQuantization, TableQuantizeEqualsTheSearchForEveryFloatTried) {
  for (bool is_signed : {true, false}) {
    const optim::QuantMap& map = is_signed ? optim::signed_map() : optim::unsigned_map();
    int64_t tried = 0;
    auto check = [&](float y) {
      ++tried;
      ASSERT_EQ(map.quantize_fast(y), map.quantize(y)) << "y = " << y;
      ASSERT_EQ(map.quantize_step(y), map.quantize(y)) << "one step, y = " << y;
    };
    for (uint64_t bits = 0; bits < (1ull << 32); bits += 997) {
      float y;
      const auto b = static_cast<uint32_t>(bits);
      std::memcpy(&y, &b, sizeof y);
      check(y);
    }
    for (int i = 0; i < 256; ++i)
      for (float x : {map.threshold[i], map.code[i]})
        for (float s : {1.0f, -1.0f}) {
          const float v = s * x;
          check(v);
          check(std::nextafter(v, -INFINITY));
          check(std::nextafter(v, INFINITY));
        }
    for (float y : {0.0f, -0.0f, 1.0f, -1.0f, 1.0000001f, 2.0f, INFINITY, -INFINITY, NAN})
      check(y);
    EXPECT_GT(tried, 4000000);
    EXPECT_LE(map.walk_steps, 3) << "cells wider than the codes' spacing";
    EXPECT_TRUE(map.step_ready()) << "a one-step cell holds two thresholds";
  }
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) void quantize16(const optim::QuantMap& map, const float* y,
                                                   uint8_t* out) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm512_cvtepi32_epi8(map.quantize16_step(_mm512_loadu_ps(y))));
}
__attribute__((target("avx2"))) void quantize8(const optim::QuantMap& map, const float* y,
                                               uint8_t* out) {
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), map.quantize8(_mm256_loadu_ps(y)));
  for (int l = 0; l < 8; ++l) out[l] = static_cast<uint8_t>(lanes[l]);
}
#endif

// Note [Quantize in one step]: 16 lanes (AVX-512) and 8 (AVX2) at a time give quantize_fast's
// byte for every float tried (the stride through all bit patterns, and every threshold and
// code with its neighbours, in every lane position). Each width runs where the CPU has it; the
// AVX2 one everywhere the tests run (x86-64 CI machines all have AVX2).
TEST(OptimQuantization, VectorQuantizeEqualsTheTableForEveryFloatTried) {
#if defined(__x86_64__)
  const bool avx512 = cpu::cpu_kernel_isa() == cpu::KernelIsa::avx512;
  ASSERT_TRUE(__builtin_cpu_supports("avx2")) << "the AVX2 path must be tested";
  for (bool is_signed : {true, false}) {
    const optim::QuantMap& map = is_signed ? optim::signed_map() : optim::unsigned_map();
    ASSERT_TRUE(map.step_ready());
    std::vector<float> values;
    for (uint64_t bits = 0; bits < (1ull << 32); bits += 997) {
      float y;
      const auto b = static_cast<uint32_t>(bits);
      std::memcpy(&y, &b, sizeof y);
      values.push_back(y);
    }
    for (int i = 0; i < 256; ++i)
      for (float x : {map.threshold[i], map.code[i]})
        for (float sign : {1.0f, -1.0f})
          for (float v : {sign * x, std::nextafter(sign * x, -INFINITY),
                          std::nextafter(sign * x, INFINITY)})
            values.push_back(v);
    for (float y : {0.0f, -0.0f, 1.0f, -1.0f, 1.0000001f, 2.0f, 0x1p-26f, -0x1p-26f, 0x1p-27f,
                    -0x1p-27f, 0x1p-149f, -0x1p-149f, INFINITY, -INFINITY, NAN})
      values.push_back(y);
    int64_t tried = 0;
    for (int shift = 0; shift < 16; shift += 5) {  // each value in several lanes
      for (size_t at = shift; at + 16 <= values.size(); at += 16) {
        uint8_t got[16];
        quantize8(map, values.data() + at, got);
        quantize8(map, values.data() + at + 8, got + 8);
        for (int lane = 0; lane < 16; ++lane)
          ASSERT_EQ(got[lane], map.quantize_fast(values[at + lane]))
              << "AVX2, y = " << values[at + lane];
        tried += 16;
        if (!avx512) continue;
        quantize16(map, values.data() + at, got);
        for (int lane = 0; lane < 16; ++lane)
          ASSERT_EQ(got[lane], map.quantize_fast(values[at + lane]))
              << "AVX-512, y = " << values[at + lane];
      }
    }
    EXPECT_GT(tried, 4 * 4000000);
  }
#else
  GTEST_SKIP() << "not x86-64";
#endif
}

// run_rule with the state, lr 1e-3 and weight decay 0.01, its steps' kernels capped at `isa`
// (LOOM_KERNEL_ISA: Note [Kernel ISA cap]), the variable unset again whatever happens.
Trajectory run_rule_capped(const UpdateRule& rule, const Problem& problem, const char* isa) {
  setenv("LOOM_KERNEL_ISA", isa, 1);
  Trajectory out;
  try {
    out = run_rule(rule, problem, 1e-3, 0.01, {}, /*with_state=*/true);
  } catch (...) {
    unsetenv("LOOM_KERNEL_ISA");
    throw;
  }
  unsetenv("LOOM_KERNEL_ISA");
  return out;
}

// The rule's AVX2 and AVX-512 paths, each this CPU has, give its scalar path's trajectory
// (state included) bit for bit; a path the CPU lacks is skipped, and said so. `scalar` gets
// the scalar trajectory.
void expect_vector_paths_equal_scalar(const UpdateRule& rule, const Problem& problem,
                                      Trajectory& scalar) {
  scalar = run_rule_capped(rule, problem, "scalar");
  for (const char* isa : {"avx2", "avx512"}) {
    const cpu::KernelIsa wanted = std::string(isa) == "avx2" ? cpu::KernelIsa::avx2
                                                             : cpu::KernelIsa::avx512;
    if (cpu::cpu_kernel_isa() < wanted) {
      std::cout << "[ SKIPPED  ] " << isa << ": this CPU lacks it\n";
      continue;
    }
    const Trajectory vector = run_rule_capped(rule, problem, isa);
    ASSERT_EQ(vector.size(), scalar.size()) << isa;
    for (size_t step = 0; step < vector.size(); ++step)
      for (size_t i = 0; i < vector[step].size(); ++i)
        ASSERT_TRUE(at::equal(vector[step][i], scalar[step][i]))
            << isa << ", step " << step << " tensor " << i;
  }
}

#if defined(__x86_64__)
// The arithmetic quantizers as the kernels call them: a vector with an unsure lane goes to the
// one-step table. Returns how many of the calls had one.
__attribute__((target("avx512f,avx512bw,avx512dq"))) int quantize16_arith(
    const optim::QuantMap& map, const float* y, uint8_t* out) {
  const __m512 v = _mm512_loadu_ps(y);
  __mmask16 unsure;
  __m512i q = map.quantize16_arith(v, unsure);
  if (unsure) q = map.quantize16_step(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(q));
  return unsure != 0;
}
__attribute__((target("avx2,fma"))) int quantize8_arith(const optim::QuantMap& map,
                                                        const float* y, uint8_t* out) {
  const __m256 v = _mm256_loadu_ps(y);
  int unsure;
  __m256i q = map.quantize8_arith(v, unsure);
  if (unsure) q = map.quantize8(v);
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), q);
  for (int l = 0; l < 8; ++l) out[l] = static_cast<uint8_t>(lanes[l]);
  return unsure != 0;
}
#endif

// Note [Quantize by arithmetic]: the gather-free quantizers (AVX2 and AVX-512), with the table
// for their unsure vectors, give quantize_fast's byte for every float tried: the stride through
// all bit patterns, every float within 64 ulps of each threshold and code of either sign (where
// the arithmetic is closest to wrong), and the specials, in several lane positions. (All 2^32
// floats were checked once, outside the suite: docs/BENCHMARKS.md.) And the table stays the
// exception: on values spread over the maps' range, fewer than 1 % of vectors are unsure, or
// the fast path would be a slow one.
TEST(OptimQuantization, ArithmeticQuantizeEqualsTheTableForEveryFloatTried) {
#if defined(__x86_64__)
  const bool avx512 = cpu::cpu_kernel_isa() == cpu::KernelIsa::avx512;
  ASSERT_TRUE(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      << "the AVX2 path must be tested";
  for (bool is_signed : {true, false}) {
    const optim::QuantMap& map = is_signed ? optim::signed_map() : optim::unsigned_map();
    ASSERT_TRUE(map.arithmetic_ready()) << "a threshold lies outside the arithmetic's margin";
    std::vector<float> values;
    for (uint64_t bits = 0; bits < (1ull << 32); bits += 997) {
      float y;
      const auto b = static_cast<uint32_t>(bits);
      std::memcpy(&y, &b, sizeof y);
      values.push_back(y);
    }
    for (int i = 0; i < 256; ++i)
      for (float x : {map.threshold[i], map.code[i]})
        for (float sign : {1.0f, -1.0f}) {
          float below = sign * x, above = sign * x;
          values.push_back(sign * x);
          for (int ulp = 0; ulp < 64; ++ulp) {
            below = std::nextafter(below, -INFINITY);
            above = std::nextafter(above, INFINITY);
            values.push_back(below);
            values.push_back(above);
          }
        }
    for (float y : {0.0f, -0.0f, 1.0f, -1.0f, 1.0000001f, -1.0000001f, 2.0f, 33.0f, 1e30f,
                    0x1p-26f, -0x1p-26f, 0x1p-149f, -0x1p-149f, INFINITY, -INFINITY, NAN, -NAN})
      values.push_back(y);
    int64_t tried = 0;
    for (int shift = 0; shift < 16; shift += 5) {
      for (size_t at = shift; at + 16 <= values.size(); at += 16) {
        uint8_t got[16];
        quantize8_arith(map, values.data() + at, got);
        quantize8_arith(map, values.data() + at + 8, got + 8);
        for (int lane = 0; lane < 16; ++lane)
          ASSERT_EQ(got[lane], map.quantize_fast(values[at + lane]))
              << "AVX2, y = " << values[at + lane];
        tried += 16;
        if (!avx512) continue;
        quantize16_arith(map, values.data() + at, got);
        for (int lane = 0; lane < 16; ++lane)
          ASSERT_EQ(got[lane], map.quantize_fast(values[at + lane]))
              << "AVX-512, y = " << values[at + lane];
      }
    }
    EXPECT_GT(tried, 4 * 4000000);
    // Values as a block's scaled state holds them: log-uniform magnitudes over the map's
    // decades (and zero), either sign on the signed map.
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> decades(-8.0f, 0.0f), unit(0.0f, 1.0f);
    std::vector<float> spread(1 << 16);
    for (float& y : spread) {
      y = unit(rng) < 0.02f ? 0.0f : std::pow(10.0f, decades(rng));
      if (is_signed && unit(rng) < 0.5f) y = -y;
    }
    int unsure8 = 0, unsure16 = 0;
    for (size_t at = 0; at < spread.size(); at += 16) {
      uint8_t got[16];
      unsure8 += quantize8_arith(map, spread.data() + at, got);
      unsure8 += quantize8_arith(map, spread.data() + at + 8, got + 8);
      for (int lane = 0; lane < 16; ++lane)
        ASSERT_EQ(got[lane], map.quantize_fast(spread[at + lane])) << spread[at + lane];
      if (avx512) unsure16 += quantize16_arith(map, spread.data() + at, got);
    }
    EXPECT_LT(unsure8, static_cast<int>(spread.size() / 8 / 100)) << "AVX2 vectors unsure";
    EXPECT_LT(unsure16, static_cast<int>(spread.size() / 16 / 100)) << "AVX-512 vectors unsure";
  }
#else
  GTEST_SKIP() << "not x86-64";
#endif
}

#if defined(__x86_64__)
// Every byte of `q` (as many as the vector holds, from q) dequantized by the AVX2 and AVX-512
// arithmetic.
template <bool kSigned>
__attribute__((target("avx2,fma"))) void dequantize8(const optim::QuantMap& map, const uint8_t* q,
                                                     float* out) {
  const optim::QuantMap::Dequantizer8<kSigned> code(map);
  _mm256_storeu_ps(out, code(_mm256_cvtepu8_epi32(
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)))));
}
template <bool kSigned>
__attribute__((target("avx512f"))) void dequantize16(const optim::QuantMap& map, const uint8_t* q,
                                                     float* out) {
  const optim::QuantMap::Dequantizer16<kSigned> code(map);
  _mm512_storeu_ps(out, code(_mm512_cvtepu8_epi32(
                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))));
}
#endif

// Whether two floats have the same bits (a zero's sign and a NaN's payload included).
bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Note [Dequantize by arithmetic]: the code of every byte, from the scalar statement and from
// the AVX2 and AVX-512 code in every lane, is the map's float bit for bit (the zeros' sign
// included).
TEST(OptimQuantization, ArithmeticDequantizeEqualsTheCodeMapForEveryByte) {
#if defined(__x86_64__)
  const bool avx512 = cpu::cpu_kernel_isa() == cpu::KernelIsa::avx512;
  ASSERT_TRUE(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      << "the AVX2 path must be tested";
  for (bool is_signed : {true, false}) {
    const optim::QuantMap& map = is_signed ? optim::signed_map() : optim::unsigned_map();
    ASSERT_TRUE(map.dequantize_ready()) << "a code the arithmetic misses";
    for (int q = 0; q < 256; ++q)
      ASSERT_TRUE(same_bits(map.dequantize_arith(static_cast<uint8_t>(q)), map.code[q]))
          << "scalar, byte " << q << ": " << map.dequantize_arith(static_cast<uint8_t>(q))
          << " against " << map.code[q];
    std::vector<uint8_t> bytes(256 + 16);
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 % 256);
    for (size_t at = 0; at + 16 <= bytes.size(); ++at) {  // every byte in every lane
      float got[16];
      if (is_signed) {
        dequantize8<true>(map, bytes.data() + at, got);
      } else {
        dequantize8<false>(map, bytes.data() + at, got);
      }
      for (int lane = 0; lane < 8; ++lane)
        ASSERT_TRUE(same_bits(got[lane], map.code[bytes[at + lane]]))
            << "AVX2, byte " << int(bytes[at + lane]) << ": " << got[lane];
      if (!avx512) continue;
      if (is_signed) {
        dequantize16<true>(map, bytes.data() + at, got);
      } else {
        dequantize16<false>(map, bytes.data() + at, got);
      }
      for (int lane = 0; lane < 16; ++lane)
        ASSERT_TRUE(same_bits(got[lane], map.code[bytes[at + lane]]))
            << "AVX-512, byte " << int(bytes[at + lane]) << ": " << got[lane];
    }
  }
#else
  GTEST_SKIP() << "not x86-64";
#endif
}

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) void dequantize64_planes(
    const optim::QuantMap& map, const uint8_t* q, float* out) {
  const optim::QuantMap::PlaneDequantizer64 code(map);
  __m512 floats[4];
  code(_mm512_loadu_si512(q), floats);
  for (int t = 0; t < 4; ++t) _mm512_storeu_ps(out + 16 * t, floats[t]);
}
#endif

// Note [Dequantize by byte planes]: with AVX-512 VBMI, every byte in every one of the 64 lanes
// comes back as the map's float, bit for bit, in the order of the codes (the permute that
// orders them for the unpacks is what a wrong constant would break first).
TEST(OptimQuantization, BytePlaneDequantizeEqualsTheCodeMapForEveryByteAndLane) {
#if defined(__x86_64__)
  if (!(cpu::cpu_kernel_isa() == cpu::KernelIsa::avx512 && __builtin_cpu_supports("avx512vbmi")))
    GTEST_SKIP() << "this CPU lacks AVX-512 VBMI (the arithmetic dequantizer runs instead)";
  for (bool is_signed : {true, false}) {
    const optim::QuantMap& map = is_signed ? optim::signed_map() : optim::unsigned_map();
    std::vector<uint8_t> bytes(256 + 64);
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 % 256);
    for (size_t at = 0; at + 64 <= bytes.size(); ++at) {  // every byte in every lane
      float got[64];
      dequantize64_planes(map, bytes.data() + at, got);
      for (int lane = 0; lane < 64; ++lane)
        ASSERT_TRUE(same_bits(got[lane], map.code[bytes[at + lane]]))
            << (is_signed ? "signed" : "unsigned") << ", lane " << lane << ", byte "
            << int(bytes[at + lane]) << ": " << got[lane] << " against "
            << map.code[bytes[at + lane]];
    }
  }
#else
  GTEST_SKIP() << "not x86-64";
#endif
}

// Note [adam8bit in vectors]: the AVX-512, AVX2 and scalar kernels (LOOM_KERNEL_ISA caps the
// choice: Note [Kernel ISA cap]) give the same parameters, codes and absmax after every step
// (each step reads back every state byte the last one wrote), bit for bit, over blocks with
// tails of every kind, with and without the bias correction's division. The paths this CPU
// lacks are skipped, and said so. Blocks of 64 and 32: on a CPU with AVX-512 VBMI the first
// loop dequantizes whole 64-element runs by byte planes and the rest by arithmetic (Note
// [Dequantize by byte planes]), so blocks of 32 run the arithmetic loop alone and both AVX-512
// first loops are held to the scalar kernel here.
TEST(OptimQuantization, Adam8bitVectorKernelsEqualTheScalarOne) {
  // beta2 = 0.01: from step 4 on, sqrt(1 - beta2^t) rounds to 1.0f, so steps 4-6 take the
  // kernels' branch without that division (Note [A bias correction of one]).
  ASSERT_NE(static_cast<float>(std::sqrt(1.0 - std::pow(0.01, 3.0))), 1.0f);
  ASSERT_EQ(static_cast<float>(std::sqrt(1.0 - std::pow(0.01, 4.0))), 1.0f);
  for (const auto& [block, beta2] : {std::pair<int64_t, double>{64, 0.999}, {32, 0.999},
                                     {64, 0.01}}) {
    SCOPED_TRACE("block_size " + std::to_string(block) + ", beta2 " + std::to_string(beta2));
    // 64-element blocks; 23, 9 and 7 leave tails shorter than either vector in the last block,
    // 2048 + 12 one longer than AVX2's 8 and shorter than AVX-512's 16; a last block as long as
    // the others (64 x 48), shorter in whole vectors (the tails) or in its tail only (16 x 64 + 3),
    // and a range of 256 blocks (each block's two loops: Note [adam8bit's divisions beside the
    // quantizer]).
    const Problem problem = make_problem(
        {{5 * 64 + 23}, {64, 48}, {9}, {2048 + 7}, {2048 + 12}, {16 * 64 + 3}, {256, 64}}, 6, 11);
    auto rule = make_rule("adam8bit", {{"block_size", block},
                                       {"beta2", beta2},
                                       {"min_8bit_size", int64_t{8}}});
    // The AVX2 first loop's two dequantizers, forced in turn (Note [Dequantize by gather where
    // gathers are fast]; the AVX-512 paths ignore the variable).
    for (const char* dequantize : {"arithmetic", "gather"}) {
      SCOPED_TRACE(std::string("LOOM_ADAM8BIT_DEQUANTIZE=") + dequantize);
      setenv("LOOM_ADAM8BIT_DEQUANTIZE", dequantize, 1);
      Trajectory scalar;
      expect_vector_paths_equal_scalar(*rule, problem, scalar);
      unsetenv("LOOM_ADAM8BIT_DEQUANTIZE");
      ASSERT_FALSE(HasFatalFailure());
      ASSERT_EQ(scalar.front().size(), 7u + 4u * 7u);  // parameters, then 4 state tensors each
      // The codes moved: a comparison of untouched state could not fail.
      EXPECT_FALSE(at::equal(scalar.back()[7], scalar.front()[7]));
    }
  }
}

// LOOM_ADAM8BIT_DEQUANTIZE with a value it does not know: the rule refuses it when made (so
// `loom check` does), and an AVX2 step when it is set later, with an error naming the variable
// and its two values.
TEST(OptimQuantization, Adam8bitUnknownDequantizerIsAnErrorNamingTheVariable) {
#if defined(__x86_64__)
  if (cpu::cpu_kernel_isa() < cpu::KernelIsa::avx2) GTEST_SKIP() << "this CPU lacks AVX2";
  const Problem problem = make_problem({{4096}}, 1, 3);
  setenv("LOOM_ADAM8BIT_DEQUANTIZE", "lookup", 1);
  EXPECT_THROW_WITH(make_rule("adam8bit", {{"min_8bit_size", int64_t{8}}}), ConfigError,
                    "LOOM_ADAM8BIT_DEQUANTIZE='lookup'", "use gather or arithmetic");
  unsetenv("LOOM_ADAM8BIT_DEQUANTIZE");
  auto rule = make_rule("adam8bit", {{"min_8bit_size", int64_t{8}}});
  setenv("LOOM_ADAM8BIT_DEQUANTIZE", "lookup", 1);
  try {
    run_rule_capped(*rule, problem, "avx2");
    unsetenv("LOOM_ADAM8BIT_DEQUANTIZE");
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    unsetenv("LOOM_ADAM8BIT_DEQUANTIZE");
    EXPECT_NE(std::string(e.what()).find("LOOM_ADAM8BIT_DEQUANTIZE='lookup'"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("use gather or arithmetic"), std::string::npos)
        << e.what();
  }
#else
  GTEST_SKIP() << "not x86-64";
#endif
}

// Note [adam8bit's tensor ops in slices]: the GPU path (kernel = "tensor_ops", here on CPU
// tensors) follows the fused kernel over a tensor of two slices whose last block is partial,
// beside one below min_8bit_size (fp32 state) and one of a single partial slice: the same
// steps in ATen's kernels, whose lerp may fuse where the fused kernel rounds twice, so a moment
// can differ by an ulp and a code on a midpoint round the other way — a few codes in a
// million, one step off where the states were the same; everything else agrees.
TEST(OptimQuantization, Adam8bitTensorOpsFollowTheFusedKernelAcrossSlices) {
  const int64_t slice = int64_t{1} << 22;  // kSliceElements
  const Problem problem = make_problem({{slice + 1000}, {100}, {4096 + 100}}, 3, 21);
  auto fused = make_rule("adam8bit");
  auto ops = make_rule("adam8bit", {{"kernel", std::string("tensor_ops")}});
  const Trajectory want = run_rule(*fused, problem, 1e-3, 0.01, {}, /*with_state=*/true);
  const Trajectory got = run_rule(*ops, problem, 1e-3, 0.01, {}, /*with_state=*/true);
  ASSERT_EQ(got.size(), want.size());
  // Per step: 3 parameters, then the large tensor's codes and absmax (m then v: q, absmax,
  // q, absmax in init_state's order), the small one's fp32 moments, the third's quantized state.
  ASSERT_EQ(want.front().size(), 3u + 4u + 2u + 4u);
  int64_t codes = 0, moved = 0;
  for (size_t step = 0; step < want.size(); ++step) {
    for (size_t i = 0; i < want[step].size(); ++i) {
      const at::Tensor& w = want[step][i];
      const at::Tensor& g = got[step][i];
      ASSERT_EQ(w.sizes(), g.sizes()) << "step " << step << " tensor " << i;
      if (w.scalar_type() == at::kByte) {
        const at::Tensor diff = (w.to(at::kInt) - g.to(at::kInt)).abs();
        // From the same state (step 1) a code moves by one step at most; later a moved code
        // is dequantized to another value, which the next absmax can carry several codes.
        if (step == 0) EXPECT_LE(diff.max().item<int>(), 1) << "tensor " << i;
        moved += diff.ne(0).sum().item<int64_t>();
        codes += w.numel();
      } else {
        const double scale = w.abs().max().item<double>();
        EXPECT_LE((w - g).abs().max().item<double>(), 1e-5 * scale)
            << "step " << step << " tensor " << i;
      }
    }
  }
  EXPECT_LT(static_cast<double>(moved) / static_cast<double>(codes), 1e-4) << moved << " codes";
  // The last slice's last block (partial) took part: its codes moved from their start.
  const at::Tensor tail_codes = want.back()[3].narrow(0, slice, 1000);
  EXPECT_FALSE(at::equal(tail_codes, want.front()[3].narrow(0, slice, 1000).fill_(127)));
  EXPECT_FALSE(at::equal(got.back()[3].narrow(0, slice, 1000), want.front()[3].narrow(0, slice, 1000)));
}

// The reason for the slices: a tensor of five slices takes one slice's temporaries, not the
// tensor's (before, the whole tensor's: 20 B per element, 10x its 8-bit state).
TEST(OptimQuantization, Adam8bitTensorOpsTemporariesStayWithinASlice) {
  const int64_t n = 5 * (int64_t{1} << 22) + 1000;
  auto rule = make_rule("adam8bit", {{"kernel", std::string("tensor_ops")}});
  EXPECT_LT(update_temporaries(*rule, {n}), 8 * n) << "more than two fp32 copies of the tensor";
}

// Note [Adafactor's kernels per ISA]: the AVX-512, AVX2 and baseline copies of adafactor's loops
// give the same parameters and factors after every step, bit for bit (matrices, a rank-3
// tensor, vectors; momentum on; columns that end inside and past a vector; matrices of three
// rows, whose groups start with fewer than four rows).
TEST(OptimConformance, AdafactorKernelsAgreeAcrossIsas) {
  const Problem problem = make_problem({{24, 40}, {3, 8, 13}, {77}, {9, 1031}, {2, 3, 1031}}, 5, 3);
  auto rule = make_rule("adafactor", {{"beta1", 0.9}});
  Trajectory scalar;
  expect_vector_paths_equal_scalar(*rule, problem, scalar);
}

TEST(OptimQuantization, KernelIsaCapRejectsAnUnknownValue) {
  setenv("LOOM_KERNEL_ISA", "avx1024", 1);
  try {
    cpu::kernel_isa();
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("LOOM_KERNEL_ISA='avx1024'"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("avx512, avx2 or scalar"), std::string::npos) << e.what();
  }
  setenv("LOOM_KERNEL_ISA", "avx2", 1);
  EXPECT_EQ(cpu::kernel_isa(), std::min(cpu::KernelIsa::avx2, cpu::cpu_kernel_isa()));
  setenv("LOOM_KERNEL_ISA", "scalar", 1);
  EXPECT_EQ(cpu::kernel_isa(), cpu::KernelIsa::scalar);
  unsetenv("LOOM_KERNEL_ISA");
  EXPECT_EQ(cpu::kernel_isa(), cpu::cpu_kernel_isa());
}

// Each value comes back within half the gap between the two codes around it (nearest
// rounding), scaled by its block's absmax; the absmax element comes back exactly.
TEST(OptimQuantization, RoundTripErrorIsWithinTheMapsBound) {
  at::manual_seed(8);
  for (bool is_signed : {true, false}) {
    const optim::QuantMap& map = is_signed ? optim::signed_map() : optim::unsigned_map();
    at::Tensor x = at::randn({64, 256}) * at::logspace(-6, 2, 64).unsqueeze(1);
    if (!is_signed) x = x.square();
    const at::Tensor absmax = x.abs().amax(1);
    double worst_ratio = 0;
    for (int64_t b = 0; b < x.size(0); ++b) {
      const float a = absmax[b].item<float>();
      const float* row = x[b].data_ptr<float>();
      for (int64_t i = 0; i < x.size(1); ++i) {
        const float y = row[i] / a;
        const float back = map.dequantize(map.quantize(y)) * a;
        const float* hi = std::lower_bound(map.code.begin(), map.code.end(), y);
        const float upper = hi == map.code.end() ? 1.0f : *hi;
        const float lower = hi == map.code.begin() ? upper : *(hi - 1);
        const double bound = 0.5 * (upper - lower) * a + 1e-6 * std::abs(row[i]) + 1e-30;
        const double err = std::abs(back - row[i]);
        ASSERT_LE(err, bound) << "value " << row[i] << " absmax " << a;
        worst_ratio = std::max(worst_ratio, err / bound);
        if (std::abs(row[i]) == a) EXPECT_EQ(back, row[i]);
      }
    }
    EXPECT_GT(worst_ratio, 0.1);  // the bound is tight, not vacuous
  }
}

TEST(OptimMemory, StateBytesPerParameter) {
  const Segment big = [] {
    Segment s;
    s.param = at::zeros({1 << 20});
    s.shape = {1 << 20};
    return s;
  }();
  auto bytes = [&](const std::string& name,
                   const std::map<std::string, RuleValue>& v = {}) {
    int64_t total = 0;
    for (const auto& [key, t] : make_rule(name, v)->init_state(big))
      total += t.numel() * t.element_size();
    return static_cast<double>(total) / big.param.numel();
  };
  EXPECT_DOUBLE_EQ(bytes("adamw"), 8.0);
  EXPECT_DOUBLE_EQ(bytes("lion"), 4.0);
  EXPECT_DOUBLE_EQ(bytes("sgd", {{"momentum", 0.9}}), 4.0);
  EXPECT_DOUBLE_EQ(bytes("sgd"), 0.0);
  EXPECT_DOUBLE_EQ(bytes("adam8bit"), 2.0 + 8.0 / 256);
}

// ---- convergence ----

TEST(OptimConvergence, Adam8bitAndAdafactorTrackAdamWOnTinyGpt) {
  auto final_loss = [](const std::vector<std::string>& extra) {
    TempDir dir;
    std::vector<std::string> set = {
        "train.max_steps=200", "train.learning_rate=3e-3", "train.save_final=false",
        "data.num_samples=32", "model.n_layer=1",          "train.per_device_train_batch_size=2"};
    set.insert(set.end(), extra.begin(), extra.end());
    auto trainer = Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), set);
    double sum = 0;
    int n = 0;
    trainer->engine().on(Event::step_end, [&](Engine& e) {
      if (e.state().step > 180) sum += e.state().loss, ++n;
    });
    trainer->run();
    return sum / n;
  };
  const double adamw = final_loss({});
  const double adam8bit = final_loss({"optimizer.name=adam8bit", "optimizer.min_8bit_size=1024"});
  const double adafactor = final_loss({"optimizer.name=adafactor", "optimizer.relative_step=false",
                                       "optimizer.scale_parameter=false"});
  std::printf("last-20-step mean loss: adamw %.4f adam8bit %.4f adafactor %.4f\n", adamw, adam8bit,
              adafactor);
  const double start = std::log(64.0);
  ASSERT_LT(adamw, start - 0.5) << "adamw must learn for the comparison to mean anything";
  EXPECT_NEAR(adam8bit, adamw, 0.02 * adamw);
  // Adafactor without momentum (the Trainer's setting) learns more slowly here: 13% above
  // AdamW when measured; the bound says it still trains, not that it matches.
  EXPECT_NEAR(adafactor, adamw, 0.20 * adamw);
}

// ---- bad input ----

TEST(OptimBadInput, ErrorsNameTheKey) {
  TempDir dir;
  auto build = [&](const std::vector<std::string>& set) {
    return Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), set)->run();
  };
  EXPECT_THROW_WITH(build({"optimizer.name=adamx"}), ConfigError, "adamx");
  EXPECT_THROW_WITH(build({"train.learning_rate=-0.1"}), ConfigError, "learning_rate", "-0.1");
  for (const std::string rule : {"adamw", "adam8bit", "lion"})
    EXPECT_THROW_WITH(build({"optimizer.name=" + rule, "optimizer.beta1=1.0"}), ConfigError,
                      "beta1", "[0, 1)");
  EXPECT_THROW_WITH(build({"optimizer.name=adam8bit", "optimizer.beta2=-0.5"}), ConfigError,
                    "beta2", "[0, 1)");
  EXPECT_THROW_WITH(build({"optimizer.name=sgd", "optimizer.nesterov=true"}), ConfigError,
                    "nesterov", "momentum > 0");
  EXPECT_THROW_WITH(build({"optimizer.name=adam8bit", "optimizer.block_size=100"}), ConfigError,
                    "block_size", "power of two");
  EXPECT_THROW_WITH(build({"optimizer.name=adafactor", "optimizer.decay_rate=0.5"}), ConfigError,
                    "decay_rate");
  EXPECT_THROW_WITH(build({"optimizer.name=adafactor", "optimizer.kernel=cuda_magic"}),
                    ConfigError, "[optimizer] kernel 'cuda_magic' is unknown",
                    "auto, cpu_loops or tensor_ops");
  EXPECT_THROW_WITH(build({"optimizer.name=adam8bit", "optimizer.kernel=cpu_loops"}),
                    ConfigError, "[optimizer] kernel 'cpu_loops' is unknown for adam8bit",
                    "auto or tensor_ops");
  for (const std::string rule : {"sgd", "lion"})
    EXPECT_THROW_WITH(build({"optimizer.name=" + rule, "optimizer.kernel=fused"}), ConfigError,
                      "[optimizer] kernel 'fused' is unknown for " + rule,
                      "auto, multi_tensor or tensor_ops");
}

}  // namespace
}  // namespace loom
