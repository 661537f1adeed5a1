// Note [TensorBoard events]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// An event file is a sequence of TFRecord frames, each
//   uint64 length (little-endian) | uint32 masked_crc32c(length bytes) | data | uint32
//   masked_crc32c(data),  masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8,
// and each frame's data a protobuf `Event` message: wall_time (field 1, double), step (field 2,
// varint), file_version (field 3, string: "brain.Event:2" in the first event) or summary (field
// 5: a `Summary` whose repeated field 1 is a `Value` of tag (field 1, string) and simple_value
// (field 2, float)). That is all TensorBoard's scalar dashboard reads, so loom encodes those few
// fields by hand. tests/core/test_tensorboard.cpp reads the files back with the tensorboard
// package's own reader.
#include "tensorboard.h"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>

#include "loom/crc32c.h"
#include "loom/error.h"

namespace loom {
namespace {

uint32_t masked_crc(const void* data, size_t size) {
  const uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

template <typename T>
void fixed(std::string& out, T v) {  // little-endian, as x86 and ARM hold it
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}

void bytes_field(std::string& out, int field, std::string_view data) {
  varint(out, static_cast<uint64_t>(field) << 3 | 2);
  varint(out, data.size());
  out.append(data);
}

std::string event_header(int64_t step) {
  std::string e;
  const double now = std::chrono::duration<double>(
                         std::chrono::system_clock::now().time_since_epoch()).count();
  e.push_back(0x09);  // field 1, fixed64
  fixed(e, now);
  e.push_back(0x10);  // field 2, varint
  varint(e, static_cast<uint64_t>(step));
  return e;
}

}  // namespace

EventFileWriter::EventFileWriter(const std::string& folder) {
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch()).count();
  for (int n = 0; !file_ && n < 1000; ++n) {
    path_ = detail::cat(folder, "/events.out.tfevents.", seconds, ".", host, ".", ::getpid(), ".", n);
    if (!std::filesystem::exists(path_, ec)) file_ = std::fopen(path_.c_str(), "wb");
  }
  LOOM_CHECK_AS(ConfigError, file_ != nullptr, "[train] logging_dir '", folder,
                "': cannot create a TensorBoard event file there (", std::strerror(errno),
                "); choose a writable folder");
  std::string first = event_header(0);
  bytes_field(first, 3, "brain.Event:2");
  record(first);
}

EventFileWriter::~EventFileWriter() {
  if (file_) std::fclose(file_);
}

void EventFileWriter::scalar(std::string_view tag, int64_t step, double value) {
  std::string v;
  bytes_field(v, 1, tag);
  v.push_back(0x15);  // field 2, fixed32
  fixed(v, static_cast<float>(value));
  std::string summary;
  bytes_field(summary, 1, v);
  std::string e = event_header(step);
  bytes_field(e, 5, summary);
  record(e);
}

void EventFileWriter::record(const std::string& event) {
  std::string frame;
  const uint64_t length = event.size();
  fixed(frame, length);
  fixed(frame, masked_crc(frame.data(), 8));
  frame += event;
  fixed(frame, masked_crc(event.data(), event.size()));
  // A full disk loses curve points, never the run: the checkpoints are what must not fail.
  if (std::fwrite(frame.data(), 1, frame.size(), file_) == frame.size()) std::fflush(file_);
}

}  // namespace loom
