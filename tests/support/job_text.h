// tests/support/job_text.h — small helpers over job text and reference output shared by the
// tests of the job's spellings (Trainer names, DeepSpeed files) and of the schedules; apart from
// test_util.h so that a change here rebuilds only those tests.
#pragma once

#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace loom::test {

// tiny_gpt_job with `train_extra` lines in [train] and `tables` after the job.
inline std::string tiny_gpt_job_with(const std::string& output_dir, const std::string& train_extra,
                                     const std::string& tables) {
  std::string text = tiny_gpt_job(output_dir);
  text.insert(text.find("[model]"), train_extra + "\n");
  return text + tables;
}

// The 16 hex digits after "config hash " in a job's description (Trainer::describe).
inline std::string config_hash_of(const std::string& description) {
  const auto at = description.find("config hash ");
  if (at == std::string::npos) return "(no config hash in: " + description + ")";
  return description.substr(at + 12, 16);
}

// Lines "NAME v1 v2 ..." (a Python reference's output) as NAME -> numbers.
inline std::map<std::string, std::vector<double>> named_numbers(const std::string& text) {
  std::istringstream lines(text);
  std::map<std::string, std::vector<double>> out;
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::string name;
    words >> name;
    for (double value; words >> value;) out[name].push_back(value);
  }
  return out;
}

}  // namespace loom::test
