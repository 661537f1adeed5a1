// The learning-rate schedules of schedule.h: transformers.optimization's lambdas, term by term
// (tests/core/test_schedule.cpp compares every step with transformers.get_scheduler).
#include "schedule.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <vector>

#include "loom/config.h"
#include "loom/error.h"

namespace loom {
namespace {

struct Kind {
  const char* name;
  std::vector<const char*> kwargs;  // the scheduler_specific_kwargs HF's function takes
};
const std::vector<Kind>& kinds() {
  static const std::vector<Kind> all = {
      {"constant", {}},
      {"constant_with_warmup", {}},
      {"linear", {}},
      {"cosine", {"num_cycles"}},
      {"cosine_with_restarts", {"num_cycles"}},
      {"polynomial", {"lr_end", "power"}},
      {"inverse_sqrt", {"timescale"}},
      {"cosine_with_min_lr", {"num_cycles", "min_lr", "min_lr_rate"}},
  };
  return all;
}

std::string kind_names() {
  std::string out;
  for (const auto& k : kinds()) out += (out.empty() ? "" : ", ") + std::string(k.name);
  return out;
}

}  // namespace

double Schedule::lr(int64_t step) const {
  const double s = static_cast<double>(step);
  if (kind == "constant") return base;
  // base * factor, the factor computed as HF's lambda computes it (same roundings).
  if (step < warmup) return base * (s / static_cast<double>(std::max<int64_t>(1, warmup)));
  const double progress = (s - static_cast<double>(warmup)) /
                          static_cast<double>(std::max<int64_t>(1, total - warmup));
  double factor = 1.0;
  if (kind == "constant_with_warmup") {
    factor = 1.0;
  } else if (kind == "linear") {
    factor = std::max(0.0, static_cast<double>(total - step) /
                               static_cast<double>(std::max<int64_t>(1, total - warmup)));
  } else if (kind == "cosine") {
    factor = std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * num_cycles * 2.0 * progress)));
  } else if (kind == "cosine_with_min_lr") {
    const double f = 0.5 * (1.0 + std::cos(M_PI * num_cycles * 2.0 * progress));
    factor = std::max(0.0, f * (1 - min_lr_rate) + min_lr_rate);
  } else if (kind == "cosine_with_restarts") {
    factor = progress >= 1.0
                 ? 0.0
                 : std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * std::fmod(num_cycles * progress, 1.0))));
  } else if (kind == "polynomial") {
    // lr_end + (base - lr_end) * remaining^power, divided by base for the factor, as HF.
    if (step > total) return base * (lr_end / base);
    const double remaining =
        1.0 - (s - static_cast<double>(warmup)) / static_cast<double>(total - warmup);
    factor = ((base - lr_end) * std::pow(remaining, power) + lr_end) / base;
  } else if (kind == "inverse_sqrt") {
    const double shift = static_cast<double>(timescale - warmup);
    factor = 1.0 / std::sqrt((s + shift) / static_cast<double>(timescale));
  }
  return base * factor;
}

std::string Schedule::describe() const {
  std::ostringstream out;
  out << kind;
  if (kind != "constant") out << ", warm-up " << warmup;
  if (kind == "cosine" || kind == "cosine_with_restarts" || kind == "cosine_with_min_lr")
    out << ", num_cycles " << num_cycles;
  if (kind == "cosine_with_min_lr") out << ", min_lr_rate " << min_lr_rate;
  if (kind == "polynomial") out << ", lr_end " << lr_end << ", power " << power;
  if (kind == "inverse_sqrt") out << ", timescale " << timescale;
  return out.str();
}

Schedule make_schedule(const ConfigSection& train, std::optional<int64_t> total) {
  Schedule s;
  s.kind = train.get_string("lr_scheduler_type");
  s.base = train.get_float("learning_rate");
  s.total = total ? *total : train.get_int("max_steps");
  const auto kind = std::find_if(kinds().begin(), kinds().end(),
                                 [&](const Kind& k) { return s.kind == k.name; });
  LOOM_CHECK_AS(ConfigError, kind != kinds().end(), train.where("lr_scheduler_type"),
                ": [train] lr_scheduler_type '", s.kind, "' is unknown; use one of ",
                kind_names(), " (Hugging Face's names)");

  const int64_t warmup_steps = train.get_int("warmup_steps");
  const double warmup_ratio = train.get_float("warmup_ratio");
  LOOM_CHECK_AS(ConfigError, warmup_steps >= 0, train.where("warmup_steps"),
                ": [train] warmup_steps must be >= 0, got ", warmup_steps);
  LOOM_CHECK_AS(ConfigError, warmup_ratio >= 0 && warmup_ratio <= 1, train.where("warmup_ratio"),
                ": [train] warmup_ratio must be in [0, 1], got ", warmup_ratio);
  LOOM_CHECK_AS(ConfigError, !(train.has("warmup_steps") && train.has("warmup_ratio")),
                train.where("warmup_ratio"),
                ": [train] set warmup_steps or warmup_ratio, not both (",
                train.where("warmup_steps"), " sets warmup_steps)");
  // As the Trainer: the ratio of max_steps, rounded up.
  s.warmup = train.has("warmup_ratio")
                 ? static_cast<int64_t>(std::ceil(static_cast<double>(s.total) * warmup_ratio))
                 : warmup_steps;
  s.num_cycles = s.kind == "cosine_with_restarts" ? 1.0 : 0.5;
  s.timescale = s.warmup > 0 ? s.warmup : 10000;

  const std::string where = train.where("lr_scheduler_kwargs");
  bool min_lr_set = false;
  if (const ConfigValue* kwargs = train.get("lr_scheduler_kwargs")) {
    LOOM_CHECK_AS(ConfigError, kwargs->is_table(), where,
                  ": [train] lr_scheduler_kwargs must be a table, e.g. { num_cycles = 2 }");
    for (const auto& [name, value] : std::get<ConfigTable>(kwargs->value)) {
      const bool taken = std::any_of(kind->kwargs.begin(), kind->kwargs.end(),
                                     [&](const char* k) { return name == k; });
      std::string allowed;
      for (const char* k : kind->kwargs) allowed += (allowed.empty() ? "" : ", ") + std::string(k);
      LOOM_CHECK_AS(ConfigError, taken, value.where, ": [train] lr_scheduler_kwargs.", name,
                    " is not an argument of the '", s.kind, "' schedule; it takes ",
                    allowed.empty() ? std::string("none") : allowed);
      double number = 0;
      if (const auto* d = std::get_if<double>(&value.value)) number = *d;
      else if (const auto* i = std::get_if<int64_t>(&value.value)) number = static_cast<double>(*i);
      else
        throw ConfigError(detail::cat(value.where, ": [train] lr_scheduler_kwargs.", name,
                                      " must be a number, not ", value.to_text()));
      LOOM_CHECK_AS(ConfigError, std::isfinite(number), value.where,
                    ": [train] lr_scheduler_kwargs.", name, " must be finite");
      if (name == "num_cycles") {
        LOOM_CHECK_AS(ConfigError, number > 0, value.where,
                      ": [train] lr_scheduler_kwargs.num_cycles must be positive");
        s.num_cycles = number;
      } else if (name == "lr_end") {
        s.lr_end = number;
      } else if (name == "power") {
        s.power = number;
      } else if (name == "timescale") {
        LOOM_CHECK_AS(ConfigError, std::get_if<int64_t>(&value.value) && number >= 1, value.where,
                      ": [train] lr_scheduler_kwargs.timescale must be an integer >= 1");
        s.timescale = static_cast<int64_t>(number);
      } else if (name == "min_lr") {
        LOOM_CHECK_AS(ConfigError, s.base > 0 && number >= 0 && number <= s.base, value.where,
                      ": [train] lr_scheduler_kwargs.min_lr must be in [0, learning_rate]");
        s.min_lr_rate = number / s.base;
        LOOM_CHECK_AS(ConfigError, !min_lr_set, value.where,
                      ": [train] lr_scheduler_kwargs: set min_lr or min_lr_rate, not both");
        min_lr_set = true;
      } else if (name == "min_lr_rate") {
        LOOM_CHECK_AS(ConfigError, number >= 0 && number <= 1, value.where,
                      ": [train] lr_scheduler_kwargs.min_lr_rate must be in [0, 1]");
        LOOM_CHECK_AS(ConfigError, !min_lr_set, value.where,
                      ": [train] lr_scheduler_kwargs: set min_lr or min_lr_rate, not both");
        s.min_lr_rate = number;
        min_lr_set = true;
      }
    }
  }
  // HF's own refusals, as configuration errors before any step.
  if (s.kind == "polynomial") {
    LOOM_CHECK_AS(ConfigError, s.base > s.lr_end, where,
                  ": [train] the polynomial schedule's lr_end (", s.lr_end,
                  ") must be smaller than learning_rate (", s.base, ")");
    LOOM_CHECK_AS(ConfigError, s.total > s.warmup || s.total == 0, train.where("max_steps"),
                  ": [train] the polynomial schedule decays over max_steps - warm-up steps: "
                  "max_steps (", s.total, ") must exceed the warm-up (", s.warmup, ")");
  }
  if (s.kind == "cosine_with_min_lr")
    LOOM_CHECK_AS(ConfigError, min_lr_set, where,
                  ": [train] the cosine_with_min_lr schedule needs lr_scheduler_kwargs.min_lr or "
                  "min_lr_rate");
  return s;
}

}  // namespace loom
