// Crash-safe writes and file digests (Boost.CRC for the checksum).
#include "fsutil.h"

#include <fcntl.h>
#include <unistd.h>

#include <boost/crc.hpp>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "loom/error.h"

namespace loom::fsutil {

AtomicFile::AtomicFile(std::filesystem::path target) : target_(std::move(target)) {
  temporary_ = target_;
  temporary_ += ".tmp-" + std::to_string(::getpid());
  fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  LOOM_CHECK_AS(CheckpointError, fd_ >= 0, "cannot write '", temporary_.string(),
                "': ", std::strerror(errno), "; check the folder exists and is writable");
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    std::error_code ec;
    std::filesystem::remove(temporary_, ec);
  }
}

void AtomicFile::write(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd_, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    LOOM_CHECK_AS(CheckpointError, n > 0, "writing '", temporary_.string(), "' failed: ",
                  std::strerror(errno), " (disk full?)");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void AtomicFile::commit() {
  LOOM_CHECK_AS(CheckpointError, ::fsync(fd_) == 0, "fsync of '", temporary_.string(),
                "' failed: ", std::strerror(errno));
  ::close(fd_);
  fd_ = -1;
  std::error_code ec;
  std::filesystem::rename(temporary_, target_, ec);
  if (ec) {
    std::filesystem::remove(temporary_);
    throw CheckpointError(detail::cat("cannot rename '", temporary_.string(), "' to '",
                                      target_.string(), "': ", ec.message()));
  }
  fsync_dir(target_.has_parent_path() ? target_.parent_path() : ".");
}

void write_file_atomic(const std::filesystem::path& target, const std::string& text) {
  AtomicFile file(target);
  file.write(text.data(), text.size());
  file.commit();
}

void fsync_dir(const std::filesystem::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

FileDigest digest(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  LOOM_CHECK_AS(CheckpointError, in.good(), "cannot read '", file.string(), "'");
  boost::crc_32_type crc;
  FileDigest out;
  std::vector<char> buffer(1 << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const auto n = in.gcount();
    crc.process_bytes(buffer.data(), static_cast<size_t>(n));
    out.bytes += static_cast<uint64_t>(n);
  }
  out.crc32 = crc.checksum();
  return out;
}

}  // namespace loom::fsutil
