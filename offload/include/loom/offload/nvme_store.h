// loom/offload/nvme_store.h — where offloaded tensors live when they are not in memory: a swap
// file under [zero] offload_* nvme_path, written and read with O_DIRECT through Linux io_uring
// (liburing), in requests of block_size bytes with up to queue_depth of them in flight
// (DeepSpeed's aio knobs). Torch-free: it moves bytes between aligned host buffers and regions
// of the file.
//
// Note [Swap file]: one file per store, made in nvme_path at construction and removed at
// destruction. Its whole size is reserved up front (fallocate), so a disk too small is an error
// at the start, naming the path and the bytes, not a failure mid-run; every region is aligned
// to 4 KiB (O_DIRECT's rule), and every write records a CRC-32C (core/app/loom/crc32c.h) of each
// block_size piece of the region's bytes that the read checks, so a file truncated or changed
// under the run is an error naming it, never silently wrong numbers. The sums live in memory
// only, as long as the file does: no file format or checkpoint carries them. A file system without O_DIRECT is used with buffered I/O after
// a warning, and one in memory (tmpfs, ramfs: it takes O_DIRECT on recent kernels) after a
// warning that it saves no memory; require_direct = true refuses both.
//
// Note [I/O thread]: one thread per store drives the ring: it keeps up to queue_depth block
// requests submitted and reaps their completions, so I/O proceeds while the caller computes
// (read chunk i+1 and write chunk i-1 while updating chunk i). The kernel does the transfers;
// the thread submits, reaps, and computes and checks the checksums of what landed one piece at
// a time, going back to the ring between pieces; checksum_threads > 1 adds helpers for the
// checks (Note [Checksums beside the ring] in nvme_store.cpp). Tickets are waited for on the
// caller's thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#pragma GCC visibility push(default)

namespace loom::offload {

inline constexpr int64_t kAlignment = 4096;  // O_DIRECT's buffer, offset and length unit

struct NvmeOptions {
  std::string path;                // folder for the swap file (must exist, writable)
  int64_t block_size = 1 << 20;    // bytes per request (DeepSpeed aio block_size)
  int queue_depth = 8;             // requests in flight (DeepSpeed aio queue_depth)
  int checksum_threads = 1;        // threads checking what lands, the ring's own counted
  bool require_direct = false;     // true: refuse a file system without O_DIRECT, or tmpfs
  std::string what = "offloaded state";  // for messages: what the file holds
};

// The bounds of block_size, queue_depth and checksum_threads: a ConfigError naming the key,
// `where` before it (a job's "file:line: [zero] offload_optimizer."). SwapFile checks them when
// it is made; the job's parser checks them too, so `loom check` refuses what `loom run` would.
void check_nvme_options(const NvmeOptions& options, const std::string& where = "");

// Host memory aligned for O_DIRECT, zero-filled; its size rounded up to kAlignment.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(int64_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  void* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  int64_t size_ = 0;
};

int64_t align_up(int64_t bytes);

class SwapFile {
 public:
  using Ticket = int64_t;

  // Makes the file and reserves `capacity` bytes (rounded up). A missing or unwritable folder,
  // too little space, or (with require_direct) no O_DIRECT: a loom::ConfigError naming the
  // path and what to do.
  SwapFile(const NvmeOptions& options, int64_t capacity);
  ~SwapFile();
  SwapFile(const SwapFile&) = delete;
  SwapFile& operator=(const SwapFile&) = delete;

  // A region of `bytes` (its file range rounded up to kAlignment); regions are laid out in
  // order. More than the capacity reserved: an error. All regions come before any I/O.
  int64_t allocate(int64_t bytes);
  int64_t region_bytes(int64_t region) const;

  // Start moving a region's bytes from / into `buffer` (aligned, at least align_up(region
  // bytes) long, untouched until the ticket is waited for).
  Ticket write(int64_t region, const void* buffer);
  Ticket read(int64_t region, void* buffer);
  // Blocks until done. An I/O error, a short transfer or (reads) a checksum other than the last
  // write's: a loom::Error naming the file, the region and what to check.
  void wait(Ticket ticket);

  const std::string& file() const;
  bool direct() const;
  int64_t capacity() const;
  // Bytes moved (both ways) since construction.
  int64_t bytes_moved() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::offload

#pragma GCC visibility pop
