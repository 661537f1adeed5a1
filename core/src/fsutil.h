// fsutil.h (core-internal) — crash-safe file writing: write to a temporary name in the same
// folder, fsync, rename over the target, fsync the folder. A crash leaves either the old file
// or the new one, never half of one.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

namespace loom::fsutil {

class AtomicFile {
 public:
  explicit AtomicFile(std::filesystem::path target);
  ~AtomicFile();  // not committed: the temporary file is removed
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void write(const void* data, size_t bytes);
  void commit();  // fsync, rename, fsync folder
  const std::filesystem::path& temporary() const { return temporary_; }

 private:
  std::filesystem::path target_, temporary_;
  int fd_ = -1;
};

void write_file_atomic(const std::filesystem::path& target, const std::string& text);
void fsync_dir(const std::filesystem::path& dir);
// crc32 (IEEE) of a file's bytes, and its size.
struct FileDigest {
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};
FileDigest digest(const std::filesystem::path& file);

}  // namespace loom::fsutil
