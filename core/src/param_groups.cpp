// [optimizer] param_groups: per-group learning-rate multipliers and weight decay, matched by a
// regular expression over parameter names (first match wins). See param_groups.h.
#include "param_groups.h"

#include <regex>
#include <string>
#include <variant>

#include "loom/error.h"
#include "loom/log.h"

namespace loom {

void apply_param_groups(const ConfigSection& opt, std::vector<Param>& params) {
  const ConfigValue* groups = opt.get("param_groups");
  if (!groups) return;
  std::vector<bool> assigned(params.size(), false);
  int index = 0;
  for (const auto& entry : std::get<ConfigArray>(groups->value)) {
    const std::string where = entry.where;
    LOOM_CHECK_AS(ConfigError, entry.is_table(), where, ": [optimizer] param_groups[", index,
                  "] must be a table like {match = \"wte.*\", lr_scale = 0.1}");
    const ConfigValue* match = entry.find("match");
    LOOM_CHECK_AS(ConfigError, match && std::holds_alternative<std::string>(match->value),
                  where, ": [optimizer] param_groups[", index, "] needs match = \"regex\"");
    double lr_scale = 1.0, weight_decay = -1.0;
    for (const auto& [key, value] : std::get<ConfigTable>(entry.value)) {
      const double* d = std::get_if<double>(&value.value);
      const int64_t* i = std::get_if<int64_t>(&value.value);
      if (key == "match") continue;
      LOOM_CHECK_AS(ConfigError, key == "lr_scale" || key == "weight_decay", value.where,
                    ": unknown key '", key, "' in [optimizer] param_groups[", index,
                    "]; use match, lr_scale, weight_decay");
      LOOM_CHECK_AS(ConfigError, (d || i) && (d ? *d : static_cast<double>(*i)) >= 0,
                    value.where, ": [optimizer] param_groups[", index, "] ", key,
                    " must be a number >= 0, not ", value.to_text());
      (key == "lr_scale" ? lr_scale : weight_decay) = d ? *d : static_cast<double>(*i);
    }
    const std::string& pattern = std::get<std::string>(match->value);
    std::regex re;
    try {
      re = std::regex(pattern);
    } catch (const std::regex_error& error) {
      throw ConfigError(detail::cat(match->where, ": [optimizer] param_groups[", index,
                                    "] match \"", pattern, "\" is not a valid regex: ",
                                    error.what()));
    }
    int matched = 0;
    for (size_t p = 0; p < params.size(); ++p) {
      if (assigned[p] || !std::regex_match(params[p].name, re)) continue;
      params[p].lr_scale = lr_scale;
      params[p].weight_decay = weight_decay;
      assigned[p] = true;
      ++matched;
    }
    LOOM_CHECK_AS(ConfigError, matched > 0, match->where, ": [optimizer] param_groups[",
                  index, "] match \"", pattern, "\" matches no trainable parameter (e.g. ",
                  params.front().name, "); the regex must match the whole name");
    log::info("param group ", index, " (", pattern, "): ", matched, " tensor(s), lr x ",
              lr_scale, weight_decay >= 0 ? detail::cat(", weight decay ", weight_decay) : "");
    ++index;
  }
}

}  // namespace loom
