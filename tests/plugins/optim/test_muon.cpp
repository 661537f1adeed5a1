// Tests of the optim plugin's muon rule: parity with a torch reference written from Moonlight's
// algorithm (reference_muon.py) on matrices wide, tall and stacked, vectors, an embedding and a
// head; which tensors go to AdamW (and the adamw_params override); bitwise resume; the log's
// report of the split; bad keys refused by name. Multi-rank ZeRO runs are in
// tests/distributed/muon_zero_test.sh.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>

#include "loom/safetensors.h"
#include "loom/trainer.h"
#include "test_util.h"
#include "update_rules.h"

namespace loom {
namespace {

using test::make_rule;
using test::RuleValue;
using test::TempDir;
using test::tiny_gpt_job;

using Trajectory = std::vector<std::vector<at::Tensor>>;  // [step][tensor]

ConfigValue numbers(const std::vector<double>& values) {
  ConfigArray array;
  for (double v : values) array.push_back(ConfigValue{v, "test"});
  return ConfigValue{array, "test"};
}
ConfigValue strings(const std::vector<std::string>& values) {
  ConfigArray array;
  for (const auto& v : values) array.push_back(ConfigValue{v, "test"});
  return ConfigValue{array, "test"};
}

// The muon rule from the plugin's schema and `values` (arrays included; the rest defaults).
std::unique_ptr<UpdateRule> make_muon(const std::map<std::string, ConfigValue>& values) {
  Schema schema;
  for (const auto& s : test::optim_plugin().schemas())
    if (s.provider() == "muon") schema = s;
  ConfigTable table(values.begin(), values.end());
  return test::optim_plugin().create_update_rule(
      "muon", ConfigSection("optimizer", table, schema, "job.toml"));
}

// Named parameters of several shapes and a gradient per step, reproducible.
struct Problem {
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<std::vector<at::Tensor>> grads;  // [step][tensor]
  std::vector<bool> decay;
};

// Wide and tall matrices, a stack of three (MoE experts), vectors, an embedding and a head.
Problem make_problem(int steps, uint64_t seed) {
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"h.0.attn.qkv.weight", {24, 40}},  {"h.0.mlp.fc_out.weight", {40, 12}},
      {"h.0.moe.w_in", {3, 8, 10}},       {"h.0.attn.qkv.bias", {40}},
      {"wte.weight", {64, 16}},           {"lm_head.weight", {64, 16}},
      {"ln_f.weight", {16}}};
  at::manual_seed(seed);
  Problem p;
  for (const auto& [name, shape] : shapes) {
    p.names.push_back(name);
    p.params.push_back(at::randn(shape) * 0.5);
    p.decay.push_back(shape.size() >= 2);
  }
  for (int s = 0; s < steps; ++s) {
    std::vector<at::Tensor> step;
    for (const auto& entry : shapes) step.push_back(at::randn(entry.second) * (0.1 + 0.01 * s));
    p.grads.push_back(step);
  }
  return p;
}

struct RunResult {
  Trajectory params;
  std::vector<std::vector<std::string>> state_keys;  // per tensor
};

// The rule over the problem, one whole segment per tensor, the segments of one step given to
// update_many together (as the step drivers batch them).
RunResult run_rule(const UpdateRule& rule, const Problem& problem, double lr, double wd) {
  std::vector<at::Tensor> flat;
  std::vector<Segment> segments(problem.params.size());
  RunResult out;
  for (size_t i = 0; i < problem.params.size(); ++i) {
    flat.push_back(problem.params[i].clone().view(-1));
    Segment& s = segments[i];
    s.name = problem.names[i];
    s.param = flat[i];
    s.shape = problem.params[i].sizes().vec();
    s.state = rule.init_state(s);
    std::vector<std::string> keys;
    for (const auto& named : s.state) keys.push_back(named.first);
    out.state_keys.push_back(keys);
  }
  for (size_t step = 0; step < problem.grads.size(); ++step) {
    std::vector<Segment*> decayed, plain;
    for (size_t i = 0; i < segments.size(); ++i) {
      segments[i].grad = problem.grads[step][i].reshape(-1);
      (problem.decay[i] ? decayed : plain).push_back(&segments[i]);
    }
    for (auto* list : {&decayed, &plain}) {
      UpdateContext ctx;
      ctx.step = static_cast<int64_t>(step) + 1;
      ctx.lr = lr;
      ctx.weight_decay = list == &decayed ? wd : 0.0;
      rule.update_many(*list, ctx);
    }
    std::vector<at::Tensor> snapshot;
    for (size_t i = 0; i < flat.size(); ++i)
      snapshot.push_back(flat[i].view(problem.params[i].sizes()).clone());
    out.params.push_back(snapshot);
  }
  return out;
}

// reference_muon.py's parameters after every step, one trajectory per config (JSON objects
// without the decay list, which is added here).
std::vector<Trajectory> run_references(const std::vector<std::string>& configs,
                                       const Problem& problem) {
  TempDir dir;
  NamedTensors input;
  std::string names;
  for (size_t i = 0; i < problem.params.size(); ++i) {
    input.emplace_back("param." + std::to_string(i), problem.params[i]);
    names += (i ? "," : "") + problem.names[i];
  }
  for (size_t s = 0; s < problem.grads.size(); ++s)
    for (size_t i = 0; i < problem.params.size(); ++i)
      input.emplace_back("grad." + std::to_string(s) + "." + std::to_string(i),
                         problem.grads[s][i]);
  safetensors::save(dir / "in.safetensors", input, {{"names", names}});
  std::string decay = "[";
  for (size_t i = 0; i < problem.decay.size(); ++i)
    decay += (i ? "," : "") + std::to_string(int(problem.decay[i]));
  std::string list = "[";
  for (size_t k = 0; k < configs.size(); ++k)
    list += detail::cat(k ? ", " : "", "{", configs[k], ", \"decay\": ", decay, "]}");
  list += "]";
  const std::string command = std::string(LOOM_TEST_PYTHON) + " " + LOOM_MUON_REFERENCE + " '" +
                              list + "' " + (dir / "in.safetensors").string() + " " +
                              (dir / "out").string();
  if (std::system(command.c_str()) != 0) throw std::runtime_error("reference failed: " + command);
  std::vector<Trajectory> out;
  for (size_t k = 0; k < configs.size(); ++k) {
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

// Largest |a-b| / max|b| per tensor over all steps and tensors, and that the parameters moved
// by far more than that (a parity with no movement could not fail).
double max_relative_error(const Trajectory& got, const Trajectory& want, const Problem& problem) {
  double worst = 0;
  for (size_t s = 0; s < want.size(); ++s)
    for (size_t i = 0; i < want[s].size(); ++i) {
      at::Tensor w = want[s][i].to(at::kDouble), g = got[s][i].to(at::kDouble);
      worst = std::max(worst, ((g - w).abs().max() / w.abs().max()).item<double>());
    }
  for (size_t i = 0; i < problem.params.size(); ++i) {
    const at::Tensor moved = (want.back()[i] - problem.params[i]).abs().max();
    EXPECT_GT(moved.item<double>(), 1e-3 * problem.params[i].abs().max().item<double>())
        << problem.names[i] << " hardly moved";
  }
  return worst;
}

// ---- parity with the torch reference ----

// One reference run (a Python start costs seconds) of four settings, 8 steps each, within
// 1e-5: Moonlight's defaults (Nesterov, 5 iterations, its coefficients, RMS scale 0.2, AdamW
// betas (0.9, 0.95)); another value of every key (heavy-ball momentum, 3 iterations, other
// coefficients and scale, AdamW (0.8, 0.99) and eps 1e-6); adamw_params = [] (shape alone
// decides: the embedding and the head are orthogonalised too); and adamw_params naming two
// matrices, which AdamW then takes.
TEST(MuonParity, MatchesTheReferenceForEveryKindOfTensor) {
  const Problem problem = make_problem(8, 1);
  const std::string defaults =
      R"("lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": true, "ns_steps": 5, )"
      R"("coefficients": [3.4445, -4.7750, 2.0315], "rms_scale": 0.2, "betas": [0.9, 0.95], )"
      R"("eps": 1e-8)";
  const auto want = run_references(
      {defaults,
       R"("lr": 0.01, "weight_decay": 0.0, "momentum": 0.8, "nesterov": false, "ns_steps": 3, )"
       R"("coefficients": [2.0, -1.5, 0.5], "rms_scale": 0.3, "betas": [0.8, 0.99], )"
       R"("eps": 1e-6)",
       defaults + R"(, "adamw_names": [])",
       defaults + R"(, "adamw_names": ["h.0.mlp.fc_out.weight", "h.0.moe.w_in"])"},
      problem);
  auto report = [](const char* what, double error) {
    std::printf("muon vs reference, %s: max relative error %.3g\n", what, error);
    return error;
  };
  const RunResult got = run_rule(*make_rule("muon"), problem, 0.02, 0.1);
  EXPECT_LT(report("defaults", max_relative_error(got.params, want[0], problem)), 1e-5);
  auto other = make_muon({{"momentum", ConfigValue{0.8, "test"}},
                          {"nesterov", ConfigValue{false, "test"}},
                          {"ns_steps", ConfigValue{int64_t{3}, "test"}},
                          {"ns_coefficients", numbers({2.0, -1.5, 0.5})},
                          {"rms_scale", ConfigValue{0.3, "test"}},
                          {"adamw_betas", numbers({0.8, 0.99})},
                          {"adamw_eps", ConfigValue{1e-6, "test"}}});
  EXPECT_LT(report("every key changed", max_relative_error(
                                            run_rule(*other, problem, 0.01, 0.0).params, want[1],
                                            problem)),
            1e-5);
  // Matrices keep a momentum buffer; vectors, the embedding and the head AdamW's moments.
  const std::vector<std::string> muon_state = {"momentum_buffer"},
                                  adamw_state = {"exp_avg", "exp_avg_sq"};
  for (size_t i = 0; i < problem.names.size(); ++i)
    EXPECT_EQ(got.state_keys[i], i < 3 ? muon_state : adamw_state) << problem.names[i];

  auto by_shape = make_muon({{"adamw_params", strings({})}});
  const RunResult shape_only = run_rule(*by_shape, problem, 0.02, 0.1);
  EXPECT_LT(report("adamw_params = []", max_relative_error(shape_only.params, want[2], problem)),
            1e-5);
  EXPECT_EQ(shape_only.state_keys[4], muon_state) << "wte is a matrix like any other";
  auto by_name =
      make_muon({{"adamw_params", strings({R"(.*fc_out\..*)", R"(h\.0\.moe\.w_in)"})}});
  const RunResult named = run_rule(*by_name, problem, 0.02, 0.1);
  EXPECT_LT(report("adamw_params naming two matrices",
                   max_relative_error(named.params, want[3], problem)),
            1e-5);
  EXPECT_EQ(named.state_keys[1], adamw_state);
  EXPECT_EQ(named.state_keys[2], adamw_state);
  EXPECT_EQ(named.state_keys[0], muon_state);
}

// The update is the same on one thread and on two, bit for bit (ATen's matmuls split rows and
// columns over threads, never the sums).
TEST(MuonConformance, ThreadCountDoesNotChangeResults) {
  const Problem problem = make_problem(3, 3);
  auto rule = make_rule("muon");
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const RunResult one = run_rule(*rule, problem, 0.02, 0.1);
  at::set_num_threads(2);
  const RunResult two = run_rule(*rule, problem, 0.02, 0.1);
  at::set_num_threads(threads);
  for (size_t i = 0; i < problem.names.size(); ++i)
    EXPECT_TRUE(at::equal(one.params.back()[i], two.params.back()[i])) << problem.names[i];
}

// ---- in a run ----

std::vector<std::string> muon_set(int steps) {
  return {"train.max_steps=" + std::to_string(steps), "optimizer.name=muon",
          "train.learning_rate=0.02"};
}

TEST(MuonRun, ResumesBitwiseAndSaysWhichTensorsWentWhere) {
  TempDir straight, split;
  auto set = muon_set(6);
  testing::internal::CaptureStderr();
  testing::internal::CaptureStdout();
  auto info = set;
  info.push_back("train.log_level=\"info\"");
  Trainer::from_text(tiny_gpt_job(straight.str()), straight.path(), info)->run();
  const std::string log = testing::internal::GetCapturedStdout() +
                          testing::internal::GetCapturedStderr();
  // The tiny GPT: 2 blocks of 4 matrices by Muon; wte and wpe (lm_head is tied) and the
  // vectors (2 x 8 + 2) by AdamW.
  EXPECT_NE(log.find("muon: 8 matrices"), std::string::npos) << log;
  EXPECT_NE(log.find("by AdamW: 18 of rank < 2; by adamw_params: wte.weight, wpe.weight"),
            std::string::npos)
      << log;
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
    ASSERT_EQ(want.size(), got.size()) << file;
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(at::equal(want[i].second, got[i].second)) << want[i].first;
  }
}

// ---- bad input ----

TEST(MuonBadInput, ErrorsNameTheKey) {
  TempDir dir;
  auto build = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> set = {"optimizer.name=muon"};
    set.insert(set.end(), extra.begin(), extra.end());
    return Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), set)->run();
  };
  EXPECT_THROW_WITH(build({"optimizer.ns_steps=0"}), ConfigError,
                    "[optimizer] ns_steps must be > 0, got 0");
  EXPECT_THROW_WITH(build({"optimizer.ns_steps=-2"}), ConfigError,
                    "[optimizer] ns_steps must be > 0, got -2");
  EXPECT_THROW_WITH(build({"optimizer.momentum=1.0"}), ConfigError,
                    "[optimizer] momentum must be in [0, 1), got 1");
  EXPECT_THROW_WITH(build({"optimizer.momentum=-0.1"}), ConfigError,
                    "[optimizer] momentum must be in [0, 1), got -0.1");
  EXPECT_THROW_WITH(build({"optimizer.rms_scale=0"}), ConfigError,
                    "[optimizer] rms_scale must be > 0");
  EXPECT_THROW_WITH(build({"optimizer.adamw_betas=[0.9]"}), ConfigError,
                    "[optimizer] adamw_betas must be an array of 2 numbers");
  EXPECT_THROW_WITH(build({"optimizer.adamw_betas=[0.9, 1.0]"}), ConfigError,
                    "[optimizer] adamw_betas must be in [0, 1), got 1");
  EXPECT_THROW_WITH(build({"optimizer.adamw_eps=-1e-8"}), ConfigError,
                    "[optimizer] adamw_eps must be >= 0");
  EXPECT_THROW_WITH(build({"optimizer.ns_coefficients=[3.4445, -4.775]"}), ConfigError,
                    "[optimizer] ns_coefficients must be an array of 3 numbers");
  EXPECT_THROW_WITH(build({"optimizer.adamw_params=[\"([\"]"}), ConfigError,
                    "[optimizer] adamw_params \"([\" is not a valid regex");
  EXPECT_THROW_WITH(build({"optimizer.adamw_params=[\"lm_head\\\\..*\"]"}), ConfigError,
                    "[optimizer] adamw_params \"lm_head\\..*\" matches no trainable parameter");
  EXPECT_THROW_WITH(build({"optimizer.beta1=0.9"}), ConfigError, "beta1");
  // Each refused run left no checkpoint behind.
  EXPECT_FALSE(std::filesystem::exists(dir / "checkpoint-4"));
}

}  // namespace
}  // namespace loom
