// The swap file and its io_uring engine. See loom/offload/nvme_store.h.
#include "loom/offload/nvme_store.h"

#include <fcntl.h>
#include <liburing.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "loom/crc32c.h"
#include "loom/error.h"
#include "loom/log.h"

namespace loom::offload {

int64_t align_up(int64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

AlignedBuffer::AlignedBuffer(int64_t bytes) : size_(align_up(std::max<int64_t>(bytes, 1))) {
  if (posix_memalign(&data_, kAlignment, static_cast<size_t>(size_)) != 0 || !data_)
    throw Error(detail::cat("cannot allocate an aligned I/O buffer of ", size_,
                            " bytes; lower [zero] offload buffer_count or the chunk size"));
  std::memset(data_, 0, static_cast<size_t>(size_));
}
AlignedBuffer::~AlignedBuffer() { std::free(data_); }
AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
  other.size_ = 0;
}
AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(size_, other.size_);
  return *this;
}

struct SwapFile::Impl {
  struct Region {
    int64_t offset = 0, bytes = 0;
    std::vector<uint32_t> sums;  // CRC-32C of each block_size piece's bytes of the region
    bool written = false;
  };
  struct Request {
    int64_t region = 0;
    Region* place = nullptr;  // regions[region], for the I/O thread's checksums
    bool write = false;
    char* buffer = nullptr;
    int64_t pending = 0;  // pieces not completed and checked
    int error = 0;        // first errno (negative res), or EIO for a short transfer
    int64_t short_piece_at = -1;
    bool mismatch = false;  // a read whose bytes are not what was written
    bool done = false;
  };
  struct Piece {
    Ticket ticket;
    bool write;
    char* buffer;
    int64_t offset, length;
    int64_t index;  // which piece of its request
  };
  struct Landed {  // a piece reaped (whole, short or failed), its checksum not yet done
    Request* request;
    int64_t index;
    bool check;  // it landed whole in a request without an error: its bytes are summed
  };

  NvmeOptions options;
  std::string file;
  int fd = -1;
  bool direct = true;
  int64_t capacity = 0, used = 0;
  std::deque<Region> regions;  // a deque: the I/O thread holds pointers to them

  io_uring ring{};
  std::thread thread;                // the ring's (Note [I/O thread])
  std::vector<std::thread> helpers;  // checksum_threads - 1 (Note [Checksums beside the ring])
  std::mutex mutex;
  std::condition_variable work, finished, to_check;
  std::deque<Landed> landed;  // reaped, not yet checked
  bool helpers_stopping = false;
  std::deque<Piece> queued;  // not yet submitted
  std::unordered_map<Ticket, Request> requests;
  Ticket next_ticket = 1;
  int in_flight = 0;
  bool stopping = false;
  std::atomic<int64_t> moved{0};

  // Where piece `index` of a request on region r starts, and its length in the file (the
  // region's bytes rounded up to kAlignment, cut into block_size pieces).
  int64_t piece_start(int64_t index) const { return index * options.block_size; }
  int64_t piece_length(const Region& r, int64_t index) const {
    return std::min(options.block_size,
                    align_up(std::max<int64_t>(r.bytes, 1)) - piece_start(index));
  }

  // Hands queued pieces to the ring up to the queue depth; the caller holds the lock.
  int fill_ring() {
    int added = 0;
    while (!queued.empty() && in_flight < options.queue_depth) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      if (!sqe) break;
      Piece piece = queued.front();
      queued.pop_front();
      if (piece.write)
        io_uring_prep_write(sqe, fd, piece.buffer, static_cast<unsigned>(piece.length),
                            static_cast<__u64>(piece.offset));
      else
        io_uring_prep_read(sqe, fd, piece.buffer, static_cast<unsigned>(piece.length),
                           static_cast<__u64>(piece.offset));
      // Ticket and piece packed: the piece's place and length (to check a short transfer)
      // follow from its request's region.
      io_uring_sqe_set_data64(sqe, (static_cast<uint64_t>(piece.ticket) << 32) |
                                       static_cast<uint64_t>(piece.index));
      ++in_flight;
      ++added;
    }
    return added;
  }

  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      work.wait(lock, [&] {
        return stopping || !queued.empty() || in_flight > 0 || !landed.empty();
      });
      if (stopping && queued.empty() && in_flight == 0 && landed.empty()) return;
      const int added = fill_ring();
      const bool checks_waiting = !landed.empty();
      lock.unlock();
      if (added > 0) io_uring_submit(&ring);
      io_uring_cqe* cqe = nullptr;
      // With pieces to check, only a look at what landed meanwhile; otherwise a short wait, so
      // pieces queued meanwhile are submitted promptly.
      __kernel_timespec timeout{0, 200 * 1000};
      const int got = checks_waiting ? io_uring_peek_cqe(&ring, &cqe)
                                     : io_uring_wait_cqe_timeout(&ring, &cqe, &timeout);
      lock.lock();
      if (got == 0) reap();
      if (!landed.empty()) check_one(lock);  // one piece, then back to refill the ring
    }
  }

  // Takes every completion the ring holds: a piece's errors are its request's, and the piece
  // joins `landed` for its checksum. The caller holds the lock.
  void reap() {
    io_uring_cqe* cqe = nullptr;
    unsigned head;
    unsigned seen = 0;
    io_uring_for_each_cqe(&ring, head, cqe) {
      ++seen;
      const uint64_t data = io_uring_cqe_get_data64(cqe);
      const Ticket ticket = static_cast<Ticket>(data >> 32);
      const int64_t index = static_cast<int64_t>(data & 0xFFFFFFFFull);
      --in_flight;
      auto it = requests.find(ticket);
      if (it == requests.end()) continue;
      Request& request = it->second;
      const int64_t length = piece_length(*request.place, index);
      if (cqe->res < 0) {
        if (!request.error) request.error = -cqe->res;
      } else if (cqe->res != length) {
        if (!request.error) request.error = EIO;
      } else {
        moved += length;
      }
      landed.push_back({&request, index, request.error == 0});
    }
    io_uring_cq_advance(&ring, seen);
    if (seen > 0 && !helpers.empty()) to_check.notify_all();
  }

  // Note [Checksums beside the ring]: each piece's CRC-32C (a write records the sum of what it
  // wrote, a read checks what it got against that; a sum per block_size piece, so there is no
  // pass over a region after its last piece) is computed as it lands, never on the caller's
  // thread (which runs the update rule). The ring's thread checks one piece at a time and goes
  // back to the ring between pieces: it reaps what landed meanwhile and refills the ring, so
  // the disk never waits on the checks. Before, it checked every piece a reap found before
  // reaping again, and on a disk of 3-4 GB/s the ring was found drained up to 9x as often as
  // without checksums (docs/BENCHMARKS.md, issue 39). One piece of 1 MiB takes ~125 us at the
  // 8-9 GB/s one core sums from memory on the development VM (Note [CRC-32C paths] in
  // core/app/loom/crc32c.h), against the ~1 ms of work a queue of 8 such pieces holds on a
  // PCIe 4 disk's 7 GB/s. A faster disk, or a slower core, takes checksum_threads = 2 or more:
  // the ring's thread and helpers taking pieces from the same queue. Helpers are threads of
  // their own only when asked for: on a machine with few cores, waking a second thread for
  // every piece cost more than it gave (measured on the 2-core VM). Outside the lock while
  // summing: a request is erased only after it is done, and a region's sums are written by the
  // write's pieces and read by a later read, ordered through wait(). The caller holds the lock.
  void check_one(std::unique_lock<std::mutex>& lock) {
    const Landed piece = landed.front();
    landed.pop_front();
    lock.unlock();
    Request& request = *piece.request;
    bool mismatch = false;
    if (piece.check) {
      Region& r = *request.place;
      const int64_t at = piece_start(piece.index);
      const int64_t bytes = std::max<int64_t>(0, std::min(options.block_size, r.bytes - at));
      const uint32_t sum = crc32c(request.buffer + at, static_cast<size_t>(bytes));
      uint32_t& recorded = r.sums[static_cast<size_t>(piece.index)];
      if (request.write) recorded = sum;
      else mismatch = sum != recorded;
    }
    lock.lock();
    if (mismatch) request.mismatch = true;
    if (--request.pending == 0) {
      request.done = true;
      finished.notify_all();
    }
  }

  // A helper's loop (checksum_threads > 1).
  void help() {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      to_check.wait(lock, [&] { return helpers_stopping || !landed.empty(); });
      if (landed.empty()) return;  // stopping, and every reaped piece taken
      check_one(lock);
    }
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(detail::cat(options.what, " swap file ", file, ": ", what));
  }
};

namespace {

bool writable_folder(const std::string& path) { return ::access(path.c_str(), W_OK | X_OK) == 0; }

}  // namespace

void check_nvme_options(const NvmeOptions& options, const std::string& where) {
  LOOM_CHECK_AS(ConfigError, options.block_size >= kAlignment && options.block_size % kAlignment == 0 &&
                                 options.block_size <= (int64_t{1} << 30),
                where, "block_size ", options.block_size, " must be a multiple of ", kAlignment,
                " bytes, at most 1 GiB");
  LOOM_CHECK_AS(ConfigError, options.queue_depth >= 1 && options.queue_depth <= 4096, where,
                "queue_depth ", options.queue_depth, " must be between 1 and 4096");
  LOOM_CHECK_AS(ConfigError, options.checksum_threads >= 1 && options.checksum_threads <= 64,
                where, "checksum_threads ", options.checksum_threads, " must be between 1 and 64");
}

SwapFile::SwapFile(const NvmeOptions& options, int64_t capacity) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.options = options;
  namespace fs = std::filesystem;
  LOOM_CHECK_AS(ConfigError, !options.path.empty(), "nvme_path is empty: name a folder on a fast "
                "local disk (NVMe) for the ", options.what);
  std::error_code ec;
  LOOM_CHECK_AS(ConfigError, fs::is_directory(options.path, ec), "nvme_path '", options.path,
                "' is not an existing folder: create it (on a fast local disk) or name another");
  LOOM_CHECK_AS(ConfigError, writable_folder(options.path), "nvme_path '", options.path,
                "' is not writable by this process: fix its permissions or name another folder");
  check_nvme_options(options);
  s.capacity = align_up(std::max<int64_t>(capacity, kAlignment));
  // Swap files are named by the pid and a process-wide count, not by the store's address: two
  // stores of one process (two runs one after the other in one folder) had the same name when
  // their addresses agreed modulo 100000, and O_EXCL refused the second ("File exists": a test
  // that failed once in a CI run). A name an earlier process of the same pid left is skipped.
  static std::atomic<uint64_t> stores_made{0};
  const auto open_new = [&](int flags) {
    for (int attempt = 0; attempt < 64; ++attempt) {
      s.file = (fs::path(options.path) /
                detail::cat("loom-swap-", ::getpid(), "-", stores_made.fetch_add(1), ".bin"))
                   .string();
      s.fd = ::open(s.file.c_str(), flags, 0600);
      if (s.fd >= 0 || errno != EEXIST) return;
    }
  };
  open_new(O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC);
  if (s.fd < 0 && errno == EINVAL) {
    LOOM_CHECK_AS(ConfigError, !options.require_direct, "nvme_path '", options.path,
                  "' is on a file system without O_DIRECT (tmpfs?); name a folder on a real "
                  "disk");
    s.direct = false;
    open_new(O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC);
    if (s.fd >= 0)
      log::warn("nvme_path '", options.path, "' has no O_DIRECT (tmpfs?): the ", options.what,
                " goes through the page cache, which holds it in memory too; use a folder on "
                "an NVMe disk");
  }
  LOOM_CHECK_AS(ConfigError, s.fd >= 0, "cannot create a swap file in nvme_path '",
                options.path, "': ", std::strerror(errno));
  {
    // A memory-backed file system takes O_DIRECT on recent kernels, but what is written there
    // stays in RAM: offloading to it saves no memory.
    struct statfs fs_info {};
    if (::fstatfs(s.fd, &fs_info) == 0 &&
        (fs_info.f_type == TMPFS_MAGIC || fs_info.f_type == RAMFS_MAGIC)) {
      if (options.require_direct) {
        ::close(s.fd);
        ::unlink(s.file.c_str());
        throw ConfigError(detail::cat("nvme_path '", options.path, "' is on tmpfs (memory): "
                                      "the ", options.what, " would stay in RAM; name a folder "
                                      "on an NVMe disk"));
      }
      log::warn("nvme_path '", options.path, "' is on tmpfs: the ", options.what,
                " stays in memory there; name a folder on an NVMe disk to save memory");
    }
  }
  // Reserve the whole size now (Note [Swap file]).
  const int reserved = ::posix_fallocate(s.fd, 0, static_cast<off_t>(s.capacity));
  if (reserved != 0) {
    struct statvfs vfs {};
    const int64_t free_bytes =
        ::fstatvfs(s.fd, &vfs) == 0 ? static_cast<int64_t>(vfs.f_bavail) * vfs.f_frsize : -1;
    ::close(s.fd);
    ::unlink(s.file.c_str());
    s.fd = -1;
    throw ConfigError(detail::cat(
        "nvme_path '", options.path, "' cannot hold the ", options.what, ": it needs ",
        s.capacity, " bytes (", s.capacity / double(1 << 30), " GiB), ",
        free_bytes >= 0 ? detail::cat(free_bytes, " bytes are free") : std::string("free space unknown"),
        " (", std::strerror(reserved), "); free space there or name a larger disk"));
  }
  const int ring = io_uring_queue_init(static_cast<unsigned>(options.queue_depth), &s.ring, 0);
  if (ring < 0) {
    ::close(s.fd);
    ::unlink(s.file.c_str());
    throw Error(detail::cat("io_uring is not available (", std::strerror(-ring),
                            "): NVMe offload needs Linux io_uring (kernel 5.6 or later, not "
                            "disabled by the container's seccomp policy)"));
  }
  s.thread = std::thread([&s] { s.run(); });
  for (int i = 1; i < options.checksum_threads; ++i)
    s.helpers.emplace_back([&s] { s.help(); });
}

SwapFile::~SwapFile() {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.stopping = true;
  }
  s.work.notify_all();
  if (s.thread.joinable()) s.thread.join();
  // The ring's thread left with every piece reaped and taken; helpers may still be checking.
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.helpers_stopping = true;
  }
  s.to_check.notify_all();
  for (auto& helper : s.helpers) helper.join();
  io_uring_queue_exit(&s.ring);
  if (s.fd >= 0) ::close(s.fd);
  ::unlink(s.file.c_str());
}

int64_t SwapFile::allocate(int64_t bytes) {
  Impl& s = *impl_;
  LOOM_CHECK(bytes >= 0, "a swap region cannot have ", bytes, " bytes");

  const int64_t size = align_up(std::max<int64_t>(bytes, 1));
  LOOM_CHECK(s.used + size <= s.capacity, s.options.what, " swap file ", s.file, ": a region of ",
             bytes, " bytes does not fit the ", s.capacity, " reserved (", s.used, " used)");
  const int64_t pieces = (size + s.options.block_size - 1) / s.options.block_size;
  s.regions.push_back({s.used, bytes, std::vector<uint32_t>(static_cast<size_t>(pieces)), false});
  s.used += size;
  return static_cast<int64_t>(s.regions.size()) - 1;
}

int64_t SwapFile::region_bytes(int64_t region) const {
  LOOM_CHECK(region >= 0 && region < static_cast<int64_t>(impl_->regions.size()), "swap region ",
             region, " does not exist");
  return impl_->regions[region].bytes;
}

namespace {
SwapFile::Ticket start(SwapFile::Impl& s, int64_t region, bool write, char* buffer) {
  LOOM_CHECK(reinterpret_cast<uintptr_t>(buffer) % kAlignment == 0,
             "swap I/O buffers must be aligned to ", kAlignment, " bytes (AlignedBuffer)");
  const auto& r = s.regions[region];
  const int64_t length = align_up(std::max<int64_t>(r.bytes, 1));
  std::lock_guard<std::mutex> lock(s.mutex);
  const SwapFile::Ticket ticket = s.next_ticket++;
  auto& request = s.requests[ticket];
  request.region = region;
  request.place = &s.regions[region];
  request.write = write;
  request.buffer = buffer;
  for (int64_t at = 0; at < length; at += s.options.block_size) {
    const int64_t piece = std::min(s.options.block_size, length - at);
    s.queued.push_back(
        {ticket, write, buffer + at, r.offset + at, piece, at / s.options.block_size});
    ++request.pending;
  }
  s.work.notify_one();
  return ticket;
}
}  // namespace

namespace {
void check_region(const SwapFile::Impl& s, int64_t region) {
  LOOM_CHECK(region >= 0 && region < static_cast<int64_t>(s.regions.size()), s.options.what,
             " swap file ", s.file, ": region ", region, " does not exist");
}
}  // namespace

SwapFile::Ticket SwapFile::write(int64_t region, const void* buffer) {
  Impl& s = *impl_;
  check_region(s, region);
  s.regions[region].written = true;  // its sum comes when the write lands
  return start(s, region, true, static_cast<char*>(const_cast<void*>(buffer)));
}

SwapFile::Ticket SwapFile::read(int64_t region, void* buffer) {
  Impl& s = *impl_;
  check_region(s, region);
  LOOM_CHECK(s.regions[region].written, s.options.what, " swap file ", s.file, ": region ",
             region, " is read before it was ever written");
  return start(s, region, false, static_cast<char*>(buffer));
}

void SwapFile::wait(Ticket ticket) {
  Impl& s = *impl_;
  Impl::Request request;
  {
    std::unique_lock<std::mutex> lock(s.mutex);
    auto it = s.requests.find(ticket);
    LOOM_CHECK(it != s.requests.end(), "swap ticket ", ticket, " is unknown or already waited for");
    s.finished.wait(lock, [&] { return it->second.done; });
    request = it->second;
    s.requests.erase(it);
  }
  const auto& r = s.regions[request.region];
  if (request.error)
    s.fail(detail::cat(request.write ? "writing" : "reading", " region ", request.region, " (",
                       r.bytes, " bytes at offset ", r.offset, ") failed: ",
                       request.error == EIO && !request.write
                           ? std::string("short read: the file was truncated under the run")
                           : std::string(std::strerror(request.error)),
                       request.error == ENOSPC ? "; the disk is full: free space there"
                                               : "; check the disk (dmesg) and the file"));
  if (request.mismatch)
    s.fail(detail::cat("region ", request.region, " (", r.bytes, " bytes at offset ", r.offset,
                       ") does not hold what was written (checksum mismatch): the file was "
                       "changed under the run, or the disk returned bad data"));
}

const std::string& SwapFile::file() const { return impl_->file; }
bool SwapFile::direct() const { return impl_->direct; }
int64_t SwapFile::capacity() const { return impl_->capacity; }
int64_t SwapFile::bytes_moved() const { return impl_->moved.load(); }

}  // namespace loom::offload
