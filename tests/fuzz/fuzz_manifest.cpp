// libFuzzer target: a checkpoint's manifest.json and an optimizer shard's layout metadata
// (core/src/checkpoint_format.cpp). The first byte picks which; the rest is the text. Any input
// must end in a parsed value within its bounds or a loom::CheckpointError; anything else is a
// bug.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "checkpoint_format.h"
#include "loom/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    if (data[0] & 1) {
      const auto m = loom::format::parse_manifest(text, "fuzz/manifest.json");
      if (m.step < 0 || m.world_size < 1 || m.epoch < 0 || m.cursor < 0 ||
          m.skipped_updates < 0 || !(m.loss_scale > 0) || m.version < 1 || m.version > 3)
        __builtin_trap();
      for (const auto& f : m.files)
        if (f.name.find('/') != std::string::npos) __builtin_trap();
    } else {
      // The layout's JSON, written at step 7.
      const auto layout = loom::format::parse_shard_layout({{"layout", text}, {"step", "7"}}, 7,
                                                           "fuzz.safetensors");
      for (const auto& [name, piece] : layout) {
        if (piece.offset < 0) __builtin_trap();
        for (int64_t d : piece.global_shape)
          if (d < 0) __builtin_trap();
      }
    }
  } catch (const loom::CheckpointError&) {
  }
  return 0;
}
