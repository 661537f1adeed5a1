// loom_nvme_bench FOLDER [--gib N] [--block-size BYTES] [--queue-depth N] [--chunk-mib N]
//                 [--checksum-threads N] [--rounds N]
// loom_nvme_bench --checksum [--mib N] [--rounds N]
// loom_nvme_bench --raw FOLDER [--gib N] [--block-size BYTES] [--queue-depth N] [--rounds N]
// The swap file's sustained sequential throughput: N GiB written, then read back (checksums
// computed and checked, as in training), in chunks of --chunk-mib through the I/O thread with
// two chunks in flight (the offloaded update's pattern: one moving while the next is queued).
// Prints one line per round and direction in MiB/s; examples/bench/offload/run.py runs fio
// beside it with the same block size and queue depth.
// --checksum: the swap file's checksum alone (CRC-32C, Note [CRC-32C paths]) on this CPU, each
// path over an N MiB buffer (default 64, a chunk: out of cache, as the I/O thread meets it),
// one thread; GB/s by the thread's CPU time (per core, whatever else the machine runs) and by
// the clock, the median of --rounds (default 5), each round over at least 64 MiB (a buffer
// smaller than that is checked several times a round: --mib 1 measures the CPU, in cache).
// --raw: the disk alone, fio's sequential job (`--rw=write` then `--rw=read`, O_DIRECT,
// io_uring, --queue-depth requests of --block-size in flight), no checksum and none of the
// swap file's code: the reference where fio is not installed (a GPU machine's image).
#include <fcntl.h>
#include <liburing.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "loom/crc32c.h"
#include "loom/error.h"
#include "loom/offload/nvme_store.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double thread_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int checksum_bench(int argc, char** argv) {
  int64_t mib = 64;
  int rounds = 5;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    if (key == "--mib") mib = std::atoll(argv[i + 1]);
    else if (key == "--rounds") rounds = std::atoi(argv[i + 1]);
    else throw loom::ConfigError("unknown option " + key + " for --checksum (--mib, --rounds)");
  }
  if (mib < 1 || rounds < 1) throw loom::ConfigError("--mib and --rounds must be at least 1");
  const int64_t bytes = mib << 20;
  const int64_t repeat = std::max<int64_t>(1, 64 / mib);
  loom::offload::AlignedBuffer buffer(bytes);
  auto* words = static_cast<uint64_t*>(buffer.data());
  for (int64_t i = 0; i < bytes / 8; ++i) words[i] = i * 0x9E3779B97F4A7C15ull;
  std::printf("CRC-32C over %lld MiB, one thread, median of %d; this CPU takes the %s path\n",
              static_cast<long long>(mib), rounds, loom::crc32c_path_name(loom::crc32c_path()));
  std::vector<loom::Crc32cPath> paths{loom::Crc32cPath::software};
  if (loom::crc32c_path() == loom::Crc32cPath::sse42) paths.push_back(loom::Crc32cPath::sse42);
  for (const auto path : paths) {
    std::vector<double> cpu, wall;
    uint32_t sum = 0;
    for (int r = 0; r < rounds; ++r) {
      const auto start = Clock::now();
      const double cpu_start = thread_cpu_seconds();
      for (int64_t k = 0; k < repeat; ++k)
        sum = loom::crc32c_with(path, buffer.data(), static_cast<size_t>(bytes));
      cpu.push_back(repeat * bytes / 1e9 / (thread_cpu_seconds() - cpu_start));
      wall.push_back(repeat * bytes / 1e9 / seconds_since(start));
    }
    std::printf("%-8s %.1f GB/s per core (CPU time), %.1f GB/s by the clock (crc %08x)\n",
                loom::crc32c_path_name(path), median(cpu), median(wall), sum);
  }
  return 0;
}

// fio's job by hand: keep `depth` requests of `block` bytes in flight over the whole file, in
// file order, refilling each slot as its request completes.
double raw_pass(int fd, int64_t bytes, int64_t block, int depth, bool writing,
                std::vector<loom::offload::AlignedBuffer>& buffers) {
  struct Ring {
    io_uring ring{};
    explicit Ring(int depth) {
      if (int e = io_uring_queue_init(static_cast<unsigned>(depth), &ring, 0); e < 0)
        throw loom::Error(std::string("io_uring_queue_init: ") + std::strerror(-e));
    }
    ~Ring() { io_uring_queue_exit(&ring); }
  } owned(depth);
  io_uring& ring = owned.ring;
  const int64_t blocks = bytes / block;
  int64_t next = 0, done = 0;
  auto submit = [&](int slot) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    void* data = buffers[static_cast<size_t>(slot)].data();
    const auto offset = static_cast<uint64_t>(next * block);
    if (writing) io_uring_prep_write(sqe, fd, data, static_cast<unsigned>(block), offset);
    else io_uring_prep_read(sqe, fd, data, static_cast<unsigned>(block), offset);
    io_uring_sqe_set_data64(sqe, static_cast<uint64_t>(slot));
    ++next;
  };
  const auto start = Clock::now();
  for (int slot = 0; slot < depth && next < blocks; ++slot) submit(slot);
  io_uring_submit(&ring);
  while (done < blocks) {
    io_uring_cqe* cqe = nullptr;
    if (int e = io_uring_wait_cqe(&ring, &cqe); e < 0)
      throw loom::Error(std::string("io_uring_wait_cqe: ") + std::strerror(-e));
    if (cqe->res != block)
      throw loom::Error(std::string(writing ? "write" : "read") + " returned " +
                        std::to_string(cqe->res) + " of " + std::to_string(block) + " bytes");
    const int slot = static_cast<int>(io_uring_cqe_get_data64(cqe));
    io_uring_cqe_seen(&ring, cqe);
    ++done;
    if (next < blocks) {
      submit(slot);
      io_uring_submit(&ring);
    }
  }
  // No fdatasync, as fio's job has none (end_fsync=0) and the swap file needs none.
  return bytes / double(1 << 20) / seconds_since(start);
}

int raw_bench(int argc, char** argv) {
  if (argc < 3) throw loom::ConfigError("--raw needs a FOLDER");
  const std::string folder = argv[2];
  double gib = 2.0;
  int64_t block = 1 << 20;
  int depth = 8, rounds = 3;
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    const char* value = argv[i + 1];
    if (key == "--gib") gib = std::atof(value);
    else if (key == "--block-size") block = std::atoll(value);
    else if (key == "--queue-depth") depth = std::atoi(value);
    else if (key == "--rounds") rounds = std::atoi(value);
    else throw loom::ConfigError("unknown option " + key + " for --raw");
  }
  if (block < 4096 || block % 4096 != 0 || depth < 1 || rounds < 1)
    throw loom::ConfigError("--raw: --block-size a multiple of 4096, --queue-depth and --rounds >= 1");
  const int64_t bytes = static_cast<int64_t>(gib * (1 << 30)) / block * block;
  const std::string path = folder + "/loom-raw-bench-" + std::to_string(::getpid()) + ".bin";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
  if (fd < 0)
    throw loom::Error(path + ": " + std::strerror(errno) +
                      " (the folder must be on a filesystem that takes O_DIRECT)");
  struct Removed {  // the file goes, whatever ends the run
    int fd;
    const std::string& path;
    ~Removed() {
      ::close(fd);
      ::unlink(path.c_str());
    }
  } removed{fd, path};
  std::vector<loom::offload::AlignedBuffer> buffers;
  for (int k = 0; k < depth; ++k) {
    buffers.emplace_back(block);
    std::memset(buffers.back().data(), 0x5a + k, static_cast<size_t>(block));
  }
  std::printf("raw file %s (O_DIRECT, io_uring), %.2f GiB, block %lld B, queue depth %d\n",
              path.c_str(), bytes / double(1 << 30), static_cast<long long>(block), depth);
  for (int round = 0; round < rounds; ++round)
    for (const bool writing : {true, false})
      std::printf("round %d %s %.0f MiB/s\n", round + 1, writing ? "write" : "read",
                  raw_pass(fd, bytes, block, depth, writing, buffers));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 2) {
      std::cerr << "usage: loom_nvme_bench FOLDER [--gib N] [--block-size BYTES] "
                   "[--queue-depth N] [--chunk-mib N] [--checksum-threads N] [--rounds N]\n"
                   "       loom_nvme_bench --checksum [--mib N] [--rounds N]\n"
                   "       loom_nvme_bench --raw FOLDER [--gib N] [--block-size BYTES] "
                   "[--queue-depth N] [--rounds N]\n";
      return 2;
    }
    if (std::string(argv[1]) == "--checksum") return checksum_bench(argc, argv);
    if (std::string(argv[1]) == "--raw") return raw_bench(argc, argv);
    loom::offload::NvmeOptions options;
    options.path = argv[1];
    options.what = "benchmark data";
    double gib = 2.0;
    int64_t chunk_mib = 64;
    int rounds = 3;
    for (int i = 2; i + 1 < argc; i += 2) {
      const std::string key = argv[i];
      const char* value = argv[i + 1];
      if (key == "--gib") gib = std::atof(value);
      else if (key == "--block-size") options.block_size = std::atoll(value);
      else if (key == "--queue-depth") options.queue_depth = std::atoi(value);
      else if (key == "--checksum-threads") options.checksum_threads = std::atoi(value);
      else if (key == "--chunk-mib") chunk_mib = std::atoll(value);
      else if (key == "--rounds") rounds = std::atoi(value);
      else throw loom::ConfigError("unknown option " + key);
    }
    const int64_t chunk = chunk_mib << 20;
    const int64_t chunks = std::max<int64_t>(1, static_cast<int64_t>(gib * (1 << 30)) / chunk);
    loom::offload::SwapFile file(options, chunks * chunk);
    std::vector<int64_t> regions;
    for (int64_t c = 0; c < chunks; ++c) regions.push_back(file.allocate(chunk));
    // Two buffers: one chunk in flight while the next is handed over.
    loom::offload::AlignedBuffer buffers[2] = {loom::offload::AlignedBuffer(chunk),
                                               loom::offload::AlignedBuffer(chunk)};
    for (auto& b : buffers) {
      auto* words = static_cast<uint64_t*>(b.data());
      for (int64_t i = 0; i < chunk / 8; ++i) words[i] = i * 0x9E3779B97F4A7C15ull;
    }
    std::printf("file %s (%s), %.2f GiB in %lld chunks of %lld MiB, block %lld B, queue depth %d, "
                "%d checksum thread(s)\n",
                file.file().c_str(), file.direct() ? "O_DIRECT" : "buffered",
                chunks * chunk / double(1 << 30), static_cast<long long>(chunks),
                static_cast<long long>(chunk_mib), static_cast<long long>(options.block_size),
                options.queue_depth, options.checksum_threads);
    for (int round = 0; round < rounds; ++round) {
      for (const bool writing : {true, false}) {
        const auto start = Clock::now();
        loom::offload::SwapFile::Ticket pending[2] = {0, 0};
        for (int64_t c = 0; c < chunks; ++c) {
          const int slot = static_cast<int>(c % 2);
          if (pending[slot]) file.wait(pending[slot]);
          pending[slot] = writing ? file.write(regions[c], buffers[slot].data())
                                  : file.read(regions[c], buffers[slot].data());
        }
        for (auto ticket : pending)
          if (ticket) file.wait(ticket);
        const double s = seconds_since(start);
        std::printf("round %d %s %.0f MiB/s\n", round + 1, writing ? "write" : "read",
                    chunks * chunk / double(1 << 20) / s);
      }
    }
    return 0;
  } catch (const std::exception& error) {
    std::cerr << "loom_nvme_bench: " << error.what() << "\n";
    return 1;
  }
}
