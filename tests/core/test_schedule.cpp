// Learning-rate schedules: the rate every step of a real run uses (metrics.jsonl) equals
// transformers.get_scheduler's for the same name, warm-up and kwargs — the reference drives a
// torch optimizer exactly as the HF Trainer does (read the lr, step, scheduler.step()).
#include <nlohmann/json.hpp>

#include <map>

#include "loom/trainer.h"
#include "job_text.h"

namespace loom {
namespace {

using test::TempDir;

constexpr int kSteps = 12;
constexpr double kBase = 1e-2;  // tiny_gpt_job's learning_rate

struct Case {
  std::string name, type;
  std::string loom_keys;  // lines added to [train]
  int warmup;             // for the reference
  std::string kwargs;     // Python dict literal for scheduler_specific_kwargs
};

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      // HF's Trainer ignores the warm-up for "constant": the bug report's case.
      {"constant", "constant", "warmup_steps = 3", 3, "{}"},
      {"constant_with_warmup", "constant_with_warmup", "warmup_steps = 3", 3, "{}"},
      {"linear", "linear", "warmup_steps = 3", 3, "{}"},
      {"linear_ratio", "linear", "warmup_ratio = 0.3", 4, "{}"},  // ceil(12 x 0.3)
      {"cosine", "cosine", "warmup_steps = 2", 2, "{}"},
      {"cosine_cycles", "cosine", "warmup_steps = 2\nlr_scheduler_kwargs = { num_cycles = 1.5 }",
       2, "{'num_cycles': 1.5}"},
      {"restarts", "cosine_with_restarts",
       "warmup_steps = 1\nlr_scheduler_kwargs = { num_cycles = 3 }", 1, "{'num_cycles': 3}"},
      {"polynomial", "polynomial",
       "warmup_steps = 2\nlr_scheduler_kwargs = { lr_end = 1e-4, power = 2.0 }", 2,
       "{'lr_end': 1e-4, 'power': 2.0}"},
      {"inverse_sqrt", "inverse_sqrt", "warmup_steps = 4", 4, "{}"},
      {"inverse_sqrt_timescale", "inverse_sqrt",
       "lr_scheduler_kwargs = { timescale = 3 }", 0, "{'timescale': 3}"},
      {"min_lr", "cosine_with_min_lr",
       "warmup_steps = 2\nlr_scheduler_kwargs = { min_lr = 1e-3 }", 2, "{'min_lr': 1e-3}"},
  };
  return all;
}

std::string job_with(const std::string& dir, const std::string& type, const std::string& keys) {
  std::string job = test::tiny_gpt_job(dir);
  const std::string steps = "max_steps = 4\n";
  return job.replace(job.find(steps), steps.size(),
                     "max_steps = " + std::to_string(kSteps) + "\nlr_scheduler_type = \"" + type +
                         "\"\n" + keys + "\nsave_final = false\n");
}

std::vector<double> rates_of_run(const std::string& type, const std::string& keys) {
  TempDir dir;
  Trainer::from_text(job_with(dir.str(), type, keys), dir.path())->run();
  std::ifstream in(dir / "metrics.jsonl");
  std::vector<double> rates;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) rates.push_back(nlohmann::json::parse(line).at("lr").get<double>());
  return rates;
}

TEST(Schedule, EveryStepsRateEqualsTransformersGetScheduler) {
  std::string script =
      "import torch\nfrom transformers import get_scheduler\n"
      "def rates(name, warmup, kwargs):\n"
      "    p = torch.nn.Parameter(torch.zeros(1))\n"
      "    opt = torch.optim.SGD([p], lr=" + std::to_string(kBase) + ")\n"
      "    s = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=" +
      std::to_string(kSteps) + ", scheduler_specific_kwargs=kwargs)\n"
      "    out = []\n"
      "    for _ in range(" + std::to_string(kSteps) + "):\n"
      "        out.append(opt.param_groups[0]['lr']); opt.step(); s.step()\n"
      "    return out\n";
  for (const Case& c : cases())
    script += "print('" + c.name + "', *[repr(r) for r in rates('" + c.type + "', " +
              std::to_string(c.warmup) + ", " + c.kwargs + ")])\n";
  auto reference = test::named_numbers(test::run_python(script));
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto& expected = reference[c.name];
    ASSERT_EQ(expected.size(), static_cast<size_t>(kSteps)) << "no reference for " << c.name;
    const auto rates = rates_of_run(c.type, c.loom_keys);
    ASSERT_EQ(rates.size(), expected.size());
    for (size_t i = 0; i < rates.size(); ++i)
      EXPECT_DOUBLE_EQ(rates[i], expected[i]) << "step " << i;
  }
}

TEST(Schedule, BadSchedulesAreConfigErrorsNamingTheKey) {
  TempDir dir;
  auto refused = [&](const std::string& type, const std::string& keys) {
    return Trainer::from_text(job_with(dir.str(), type, keys), dir.path());
  };
  EXPECT_THROW_WITH(refused("cosin", ""), ConfigError, "lr_scheduler_type 'cosin' is unknown",
                    "cosine_with_restarts");
  EXPECT_THROW_WITH(refused("cosine", "lr_scheduler_kwargs = { power = 2 }"), ConfigError,
                    "lr_scheduler_kwargs.power is not an argument of the 'cosine' schedule",
                    "num_cycles");
  EXPECT_THROW_WITH(refused("linear", "warmup_steps = 2\nwarmup_ratio = 0.1"), ConfigError,
                    "set warmup_steps or warmup_ratio, not both");
  EXPECT_THROW_WITH(refused("linear", "warmup_ratio = 1.5"), ConfigError,
                    "warmup_ratio must be in [0, 1]");
  EXPECT_THROW_WITH(refused("polynomial", "lr_scheduler_kwargs = { lr_end = 0.5 }"), ConfigError,
                    "lr_end (0.5) must be smaller than learning_rate");
  EXPECT_THROW_WITH(refused("cosine_with_min_lr", ""), ConfigError,
                    "needs lr_scheduler_kwargs.min_lr or min_lr_rate");
  EXPECT_THROW_WITH(refused("inverse_sqrt", "lr_scheduler_kwargs = { timescale = 0 }"),
                    ConfigError, "timescale must be an integer >= 1");
}

}  // namespace
}  // namespace loom
