// libFuzzer target: the job-file parser (core/src/job.cpp over TOML++). Any input must end in a
// parsed job or a loom::ConfigError; anything else — another exception, a crash, a stack
// overflow, a sanitizer report — is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include "job.h"
#include "loom/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const loom::Job job = loom::Job::parse(text, "fuzz.toml");
    (void)job.canonical_text();
  } catch (const loom::ConfigError&) {
  }
  return 0;
}
