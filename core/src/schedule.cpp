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
      // DeepSpeed's schedulers (Note [DeepSpeed schedules]), what a ds_config.json maps to.
      {"ds_warmup_lr", {"warmup_min_lr", "warmup_type"}},
      {"ds_warmup_decay_lr", {"warmup_min_lr", "warmup_type"}},
      {"ds_warmup_cosine_lr", {"warmup_min_ratio", "cos_min_ratio", "warmup_type"}},
  };
  return all;
}

std::string kind_names() {
  std::string out;
  for (const auto& k : kinds()) out += (out.empty() ? "" : ", ") + std::string(k.name);
  return out;
}

bool is_deepspeed(const std::string& kind) { return kind.rfind("ds_", 0) == 0; }

}  // namespace

// Note [DeepSpeed schedules]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR as DeepSpeed runs them: its engine
// steps the scheduler after each update, and the scheduler's constructor sets the rate of the
// first update from iteration -1 (WarmupLR/WarmupDecayLR: warmup_min_lr; WarmupCosineLR: 0).
// So update k runs at f(k - 1), with f(i) for iteration i:
//   gamma(i) = log(i + 1) / log(W) ("log", DeepSpeed's default) or i / W ("linear"), i < W,
//              where W = max(2, warmup_num_steps) as DeepSpeed clamps it;
//   WarmupLR        f = min + (max - min) * (i < W ? gamma : 1)
//   WarmupDecayLR   f = min + (max - min) * (i < W ? gamma : max(0, (T - i) / max(1, T - W)))
//   WarmupCosineLR  f = lr * (i < W ? r0 + (1 - r0) * gamma
//                              : max(0, rc + (1 - rc) * (1 + cos(pi * (i - W + 1) / (T - W))) / 2))
// with max = learning_rate, min = warmup_min_lr, T = max_steps, r0 = warmup_min_ratio and
// rc = cos_min_ratio; tests/core/test_schedule.cpp checks every update against these formulas
// written out in Python.
double Schedule::deepspeed_lr(int64_t step) const {
  const int64_t i = step - 1;
  const bool cosine = kind == "ds_warmup_cosine_lr";
  if (i < 0) return cosine ? 0.0 : warmup_min_lr;
  const double x = static_cast<double>(i), w = static_cast<double>(warmup);
  const double gamma = warmup_log ? std::log(x + 1.0) / std::log(w) : x / w;
  if (cosine) {
    if (i < warmup) return base * (warmup_min_ratio + gamma * (1.0 - warmup_min_ratio));
    const double wave = (1.0 + std::cos(M_PI * (x - w + 1.0) / static_cast<double>(total - warmup))) / 2.0;
    return base * std::max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * wave);
  }
  double factor = 1.0;
  if (i < warmup) factor = gamma;
  else if (kind == "ds_warmup_decay_lr")
    factor = std::max(0.0, static_cast<double>(total - i) /
                               std::max(1.0, static_cast<double>(total - warmup)));
  return warmup_min_lr + (base - warmup_min_lr) * factor;
}

double Schedule::lr(int64_t step) const {
  const double s = static_cast<double>(step);
  if (kind == "constant") return base;
  if (is_deepspeed(kind)) return deepspeed_lr(step);
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
  if (is_deepspeed(kind))
    out << " (DeepSpeed's), warmup_type " << (warmup_log ? "log" : "linear")
        << (kind == "ds_warmup_cosine_lr" ? ", warmup_min_ratio " : ", warmup_min_lr ")
        << (kind == "ds_warmup_cosine_lr" ? warmup_min_ratio : warmup_min_lr)
        << (kind == "ds_warmup_cosine_lr" ? ", cos_min_ratio " + std::to_string(cos_min_ratio) : "");
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
      if (name == "warmup_type") {
        const auto* text = std::get_if<std::string>(&value.value);
        LOOM_CHECK_AS(ConfigError, text && (*text == "log" || *text == "linear"), value.where,
                      ": [train] lr_scheduler_kwargs.warmup_type is \"log\" or \"linear\" "
                      "(DeepSpeed's warm-up curves), not ", value.to_text());
        s.warmup_log = *text == "log";
        continue;
      }
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
      } else if (name == "warmup_min_lr") {
        LOOM_CHECK_AS(ConfigError, number >= 0, value.where,
                      ": [train] lr_scheduler_kwargs.warmup_min_lr must be >= 0");
        s.warmup_min_lr = number;
      } else if (name == "warmup_min_ratio" || name == "cos_min_ratio") {
        LOOM_CHECK_AS(ConfigError, number >= 0 && number <= 1, value.where,
                      ": [train] lr_scheduler_kwargs.", name, " must be in [0, 1]");
        (name == "warmup_min_ratio" ? s.warmup_min_ratio : s.cos_min_ratio) = number;
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
  if (is_deepspeed(s.kind)) {
    s.warmup = std::max<int64_t>(2, s.warmup);  // DeepSpeed's own clamp (log(1) would divide by 0)
    LOOM_CHECK_AS(ConfigError, s.kind != "ds_warmup_cosine_lr" || s.total > s.warmup,
                  train.where("max_steps"), ": [train] DeepSpeed's WarmupCosineLR decays over "
                  "total_num_steps - warmup_num_steps: max_steps (", s.total,
                  ") must exceed the warm-up (", s.warmup, ")");
  }
  if (s.kind == "cosine_with_min_lr")
    LOOM_CHECK_AS(ConfigError, min_lr_set, where,
                  ": [train] the cosine_with_min_lr schedule needs lr_scheduler_kwargs.min_lr or "
                  "min_lr_rate");
  return s;
}

}  // namespace loom
