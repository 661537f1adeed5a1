// Which tensors the muon rule orthogonalises and which it gives to AdamW (Note [Which tensors
// Muon takes] in muon.cpp): shared by the rule and by the plugin's report of the split at
// params_ready. Plugin-internal; not part of the SDK.
#pragma once

#include <cstdint>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "rules.h"

namespace loom::optim {

// The default of [optimizer] adamw_params: embeddings and output heads by their usual names.
extern const char* const kDefaultAdamWParams;

class MuonSelection {
 public:
  explicit MuonSelection(const ConfigSection& optimizer);  // reads adamw_params
  // Rank >= 2 and no adamw_params regex matches the whole name.
  bool takes_muon(const std::string& name, const std::vector<int64_t>& shape) const;
  // One line for the log: how many tensors and parameters each rule takes, and the matrices
  // given to AdamW by name.
  std::string report(const std::vector<std::pair<std::string, std::vector<int64_t>>>& params) const;
  // A user's adamw_params regex that matches none of `names` is an error naming it (as
  // param_groups'); the defaults are not checked.
  void check_patterns_match(const std::vector<std::string>& names) const;

 private:
  const std::string* matching_pattern(const std::string& name) const;
  std::vector<std::pair<std::string, std::regex>> patterns_;
  bool user_set_ = false;
  std::string where_;
};

}  // namespace loom::optim
