// libFuzzer target: the safetensors header reader (core/src/checkpoint_format.cpp). The input
// is a whole file's bytes. It must end in a header whose every tensor lies inside the file, or
// a loom::CheckpointError; anything else — another exception, a crash, a sanitizer report — is
// a bug.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "checkpoint_format.h"
#include "loom/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view file(reinterpret_cast<const char*>(data), size);
  try {
    const uint64_t length = loom::format::safetensors_header_length(file, size, "fuzz.safetensors");
    const auto header =
        loom::format::parse_safetensors_header(file.substr(8, length), size, "fuzz.safetensors");
    // What the reader promises: each tensor's bytes inside the file, none overlapping.
    uint64_t previous_end = 0;
    for (const auto& entry : header.entries) {
      if (header.data_start + entry.end > size || entry.begin < previous_end ||
          entry.end - entry.begin != entry.numel * loom::format::element_size_of(entry.dtype))
        __builtin_trap();
      previous_end = entry.end;
    }
  } catch (const loom::CheckpointError&) {
  }
  return 0;
}
