// The NVMe swap file (loom/offload/nvme_store.h) on real files: regions of every awkward size
// come back byte for byte through io_uring with small blocks and a shallow queue; a file changed
// or truncated under the run is an error naming it; a missing, read-only or too-small folder is
// a ConfigError at the start that leaves nothing behind. The small and read-only file systems
// are tmpfs mounts (root only; skipped otherwise).
#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "loom/error.h"
#include "loom/offload/nvme_store.h"
#include "test_util.h"

namespace loom::offload {
namespace {

using test::TempDir;
namespace fs = std::filesystem;

// A tmpfs of `bytes` mounted on a fresh folder for the test's life (root only).
class SmallDisk {
 public:
  explicit SmallDisk(int64_t bytes, bool read_only = false) {
    const std::string options = "size=" + std::to_string(bytes);
    mounted_ = ::mount("tmpfs", dir_.str().c_str(), "tmpfs", read_only ? MS_RDONLY : 0,
                       options.c_str()) == 0;
  }
  ~SmallDisk() {
    if (mounted_) ::umount2(dir_.str().c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  std::string path() const { return dir_.str(); }

 private:
  TempDir dir_;
  bool mounted_ = false;
};

void fill(AlignedBuffer& buffer, int64_t bytes, uint32_t seed) {
  std::mt19937 random(seed);
  auto* p = static_cast<unsigned char*>(buffer.data());
  for (int64_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(random());
}

void regions_come_back(int checksum_threads) {
  TempDir dir;
  NvmeOptions options;
  options.path = dir.str();
  options.block_size = 64 << 10;  // many blocks per region, more than the queue holds
  options.queue_depth = 3;
  options.checksum_threads = checksum_threads;
  const std::vector<int64_t> sizes = {1, 4095, 4096, 4097, (3 << 20) + 5, 200000};
  int64_t total = 0;
  for (int64_t b : sizes) total += align_up(b);
  SwapFile file(options, total);
  ASSERT_TRUE(fs::exists(file.file()));
  EXPECT_EQ(fs::file_size(file.file()), static_cast<uintmax_t>(total));  // reserved up front
  std::vector<int64_t> regions;
  std::vector<AlignedBuffer> written;
  std::vector<SwapFile::Ticket> tickets;
  for (size_t i = 0; i < sizes.size(); ++i) {
    regions.push_back(file.allocate(sizes[i]));
    written.emplace_back(sizes[i]);
    fill(written.back(), sizes[i], static_cast<uint32_t>(i + 1));
    tickets.push_back(file.write(regions.back(), written.back().data()));  // all in flight
  }
  for (auto t : tickets) file.wait(t);
  // Read back in reverse order, all in flight at once.
  std::vector<AlignedBuffer> read;
  tickets.clear();
  for (size_t i = 0; i < sizes.size(); ++i) read.emplace_back(sizes[i]);
  for (size_t i = sizes.size(); i-- > 0;) tickets.push_back(file.read(regions[i], read[i].data()));
  for (auto t : tickets) file.wait(t);
  for (size_t i = 0; i < sizes.size(); ++i)
    EXPECT_EQ(std::memcmp(read[i].data(), written[i].data(), sizes[i]), 0) << "region " << i;
  EXPECT_GE(file.bytes_moved(), 2 * total);
  // A region rewritten is read as rewritten.
  fill(written[1], sizes[1], 99);
  file.wait(file.write(regions[1], written[1].data()));
  file.wait(file.read(regions[1], read[1].data()));
  EXPECT_EQ(std::memcmp(read[1].data(), written[1].data(), sizes[1]), 0);
  EXPECT_THROW_WITH(file.allocate(1), Error, "does not fit");
  const std::string name = file.file();
  { SwapFile gone(options, 4096); }
  EXPECT_TRUE(fs::exists(name));  // another store's file is its own
}

// With one checksum thread, and with three taking the pieces of one region out of order (Note
// [Checksums beside the ring]).
TEST(NvmeStore, RegionsOfEverySizeComeBackByteForByte) {
  for (const int checksum_threads : {1, 3}) {
    SCOPED_TRACE(checksum_threads);
    regions_come_back(checksum_threads);
  }
}

TEST(NvmeStore, AFileChangedOrTruncatedUnderTheRunIsAnErrorNamingIt) {
  TempDir dir;
  NvmeOptions options;
  options.path = dir.str();
  options.block_size = 4096;
  SwapFile file(options, 3 * 4096);
  const int64_t a = file.allocate(8000), b = file.allocate(100);
  AlignedBuffer data(8000), back(8000);
  fill(data, 8000, 5);
  file.wait(file.write(a, data.data()));
  file.wait(file.write(b, data.data()));
  {
    // One byte changed behind the store's back.
    const int fd = ::open(file.file().c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    const char x = 0x5a;
    ASSERT_EQ(::pwrite(fd, &x, 1, 7000), 1);
    ::close(fd);
  }
  EXPECT_THROW_WITH(file.wait(file.read(a, back.data())), Error, file.file(), "region 0",
                    "checksum mismatch");
  ASSERT_EQ(::truncate(file.file().c_str(), 4096), 0);
  EXPECT_THROW_WITH(file.wait(file.read(b, back.data())), Error, file.file(), "region 1",
                    "truncated");
  EXPECT_THROW_WITH(file.read(5, back.data()), Error, "region 5 does not exist");
}

TEST(NvmeStore, BadFoldersAreErrorsAtTheStartLeavingNothingBehind) {
  NvmeOptions options;
  options.path = "/nonexistent/loom-nvme";
  EXPECT_THROW_WITH(SwapFile(options, 4096), ConfigError, "/nonexistent/loom-nvme",
                    "not an existing folder");
  options.path = "";
  EXPECT_THROW_WITH(SwapFile(options, 4096), ConfigError, "nvme_path is empty");
  TempDir dir;
  options.path = dir.str();
  options.block_size = 1000;
  EXPECT_THROW_WITH(SwapFile(options, 4096), ConfigError, "block_size 1000", "multiple of 4096");
  options.block_size = 4096;
  options.queue_depth = 0;
  EXPECT_THROW_WITH(SwapFile(options, 4096), ConfigError, "queue_depth 0");
  options.queue_depth = 8;
  options.checksum_threads = 0;
  EXPECT_THROW_WITH(SwapFile(options, 4096), ConfigError, "checksum_threads 0",
                    "between 1 and 64");
  EXPECT_TRUE(fs::is_empty(dir.path()));

  SmallDisk small(1 << 20);
  if (!small.mounted()) GTEST_SKIP() << "mounting a small tmpfs needs root";
  options = {};
  options.path = small.path();
  options.what = "optimizer state";
  EXPECT_THROW_WITH(SwapFile(options, 8 << 20), ConfigError, small.path(),
                    "cannot hold the optimizer state", "8388608 bytes", "free space");
  EXPECT_TRUE(fs::is_empty(small.path()));  // no half-made file left
  options.require_direct = true;
  EXPECT_THROW_WITH(SwapFile(options, 4096), ConfigError, "is on tmpfs", "stay in RAM");
  EXPECT_TRUE(fs::is_empty(small.path()));
  options.require_direct = false;
  {
    // tmpfs with a warning (a GPU run's too: the store cannot tell, and says what it costs).
    testing::internal::CaptureStderr();
    SwapFile fits(options, 4096);
    const std::string said = testing::internal::GetCapturedStderr();
    EXPECT_NE(said.find("nvme_path '" + small.path() + "' is on tmpfs"), std::string::npos) << said;
    EXPECT_NE(said.find("name a folder on an NVMe disk"), std::string::npos) << said;
    EXPECT_TRUE(fs::exists(fits.file()));
  }
  EXPECT_TRUE(fs::is_empty(small.path()));  // removed with the store

  SmallDisk read_only(1 << 20, /*read_only=*/true);
  ASSERT_TRUE(read_only.mounted());
  options.path = read_only.path();
  EXPECT_THROW_WITH(SwapFile(options, 4096), ConfigError, read_only.path(), "not writable");
}

// A region of three 4 KiB pieces and 100 bytes: a byte changed in any piece is a mismatch
// naming the region; put back, the region reads whole again; the padding after its last byte
// (written, never data) is not checked.
void every_piece_is_checked(int checksum_threads) {
  TempDir dir;
  NvmeOptions options;
  options.path = dir.str();
  options.block_size = 4096;
  options.checksum_threads = checksum_threads;
  const int64_t bytes = 3 * 4096 + 100;
  SwapFile file(options, 5 * 4096);
  file.allocate(10);  // region 1 starts at 4096 in the file
  const int64_t region = file.allocate(bytes);
  AlignedBuffer data(bytes), back(bytes);
  fill(data, bytes, 7);
  file.wait(file.write(region, data.data()));
  const int fd = ::open(file.file().c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  auto flip = [&](int64_t at) {  // at: the byte's place in the region
    char x;
    ASSERT_EQ(::pread(fd, &x, 1, 4096 + at), 1);
    x ^= 0x10;
    ASSERT_EQ(::pwrite(fd, &x, 1, 4096 + at), 1);
  };
  for (const int64_t at : {int64_t{0}, int64_t{4095}, int64_t{4096 + 17}, int64_t{2 * 4096 + 4095},
                           bytes - 1}) {
    SCOPED_TRACE(at);
    flip(at);
    EXPECT_THROW_WITH(file.wait(file.read(region, back.data())), Error, file.file(), "region 1",
                      "checksum mismatch");
    flip(at);
    file.wait(file.read(region, back.data()));
    EXPECT_EQ(std::memcmp(back.data(), data.data(), bytes), 0);
  }
  flip(bytes);  // the first padding byte
  file.wait(file.read(region, back.data()));
  EXPECT_EQ(std::memcmp(back.data(), data.data(), bytes), 0);
  ::close(fd);
}

TEST(NvmeStore, EveryPieceOfARegionIsCheckedButNotItsPadding) {
  for (const int checksum_threads : {1, 2}) {
    SCOPED_TRACE(checksum_threads);
    every_piece_is_checked(checksum_threads);
  }
}

}  // namespace
}  // namespace loom::offload
