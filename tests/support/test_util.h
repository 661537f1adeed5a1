// Shared helpers of the core tests: a temporary folder, a tiny GPT job, error matching.
#pragma once

#include <gtest/gtest.h>
#include <stdio.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <algorithm>
#include <vector>

#include "loom/error.h"

namespace loom::test {

class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "loom-test-XXXXXX").string();
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

// A GPT small enough to train in milliseconds, on random next-token data.
inline std::string tiny_gpt_job(const std::string& output_dir) {
  return R"([train]
model = "gpt"
max_steps = 4
per_device_train_batch_size = 4
learning_rate = 1e-2
seed = 7
output_dir = ")" + output_dir + R"("
logging_steps = 1000
progress_bar = false
log_level = "warn"

[model]
vocab_size = 64
n_positions = 16
n_embd = 32
n_layer = 2
n_head = 2
dropout = 0.0

[data]
source = "random_tokens"
task = "lm"
num_samples = 64
seq_len = 16
vocab_low = 0
vocab_high = 64
)";
}

// Every file and folder under `root`, relative, each file with its size: a test's "nothing was
// written" compares two of these.
inline std::vector<std::string> list_files(const std::filesystem::path& root) {
  std::vector<std::string> out;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(root)) {
    std::string line = std::filesystem::relative(entry.path(), root).string();
    if (entry.is_regular_file()) line += " " + std::to_string(entry.file_size());
    out.push_back(line);
  }
  std::sort(out.begin(), out.end());
  return out;
}

inline std::string read_text(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs a shell command; its stdout and stderr. A command that fails fails the test.
inline std::string run_command(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  EXPECT_NE(pipe, nullptr) << command;
  if (!pipe) return "";
  std::string out;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, n);
  EXPECT_EQ(pclose(pipe), 0) << out;
  return out;
}

// Runs a Python script with the project venv's interpreter (the independent references:
// torch, transformers, safetensors, PEFT).
#ifdef LOOM_TEST_PYTHON
inline std::string run_python(const std::string& script) {
  TempDir dir;
  const auto file = dir / "reference.py";
  std::ofstream(file) << script;
  return run_command(std::string(LOOM_TEST_PYTHON) + " " + file.string());
}
#endif

}  // namespace loom::test

// Expects `statement` to throw `type` whose message contains every one of the strings.
#define EXPECT_THROW_WITH(statement, type, ...)                                        \
  do {                                                                                 \
    try {                                                                              \
      statement;                                                                       \
      ADD_FAILURE() << "expected " #type " from: " #statement;                         \
    } catch (const type& error) {                                                      \
      const std::string message = error.what();                                        \
      for (const std::string& part : std::vector<std::string>{__VA_ARGS__})            \
        EXPECT_NE(message.find(part), std::string::npos)                               \
            << "message lacks \"" << part << "\": " << message;                        \
    }                                                                                  \
  } while (0)
