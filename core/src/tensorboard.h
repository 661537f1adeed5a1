// tensorboard.h (core-internal) — TensorBoard event files written natively ([train] report_to
// = ["tensorboard"]): no Python, no TensorFlow, no protobuf library. Note [TensorBoard events]
// in the .cpp says what the bytes are.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace loom {

class EventFileWriter {
 public:
  // Creates `folder` and a new events.out.tfevents.<time>.<host>.<pid>.<n> file in it (a resumed
  // run adds a file; TensorBoard reads a folder's files as one run). Throws ConfigError naming
  // the folder when it cannot.
  explicit EventFileWriter(const std::string& folder);
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  // One scalar (TensorBoard stores float32) at `step`, flushed: a killed run keeps its curve.
  void scalar(std::string_view tag, int64_t step, double value);
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace loom
