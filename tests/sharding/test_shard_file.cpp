// sharding/ShardFile, Note [Offloaded parameters]: stage 3's unit shards on a real swap file.
// Every shard (awkward sizes, bf16, its tag after the chunk) leaves memory once written and
// comes back bit for bit, read now or read ahead; a fresh shard is zeros and its tag; no more
// than two writes fly at once; a byte changed in the file is an error naming the file, and the
// half-read shard is dropped rather than used. Staged (Note [Parameter offload twin]): copies
// fetched ahead on the worker, freed after the gather, stores landed home; an arena that cannot
// be allocated is named.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "loom/error.h"
#include "loom/sharding/shard_file.h"
#include "test_util.h"

namespace loom::sharding {
namespace {

using test::TempDir;

// Units of `chunks`, each a random bf16 chunk and its position as the tag.
std::vector<UnitShard> make_units(const std::vector<int64_t>& chunks) {
  std::vector<UnitShard> units(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    units[i].chunk = chunks[i];
    units[i].position = static_cast<int64_t>(i);
    units[i].shard = at::randn({chunks[i] + 1}).to(at::kBFloat16);
    set_tag(units[i]);
  }
  return units;
}

std::vector<UnitShard*> pointers(std::vector<UnitShard>& units) {
  std::vector<UnitShard*> out;
  for (auto& unit : units) out.push_back(&unit);
  return out;
}

// The shard's bits, so that comparisons are bitwise (NaN-free or not).
at::Tensor bits(const at::Tensor& shard) { return shard.view(at::kShort).clone(); }

offload::OffloadOptions options_in(const TempDir& dir, const std::string& device = "nvme") {
  offload::OffloadOptions options;
  options.device = device;
  options.nvme.path = dir.str();
  options.nvme.block_size = 4096;  // regions of several blocks
  options.nvme.what = "weight shards";
  return options;
}

TEST(ShardFile, ShardsLeaveMemoryAndComeBackBitForBit) {
  at::manual_seed(3);
  TempDir dir;
  std::vector<UnitShard> units = make_units({5, 3000, 1, 2047});
  std::vector<at::Tensor> written;
  for (const auto& unit : units) written.push_back(bits(unit.shard));
  ShardFile file(options_in(dir), at::kBFloat16, c10::kCPU, /*staged=*/false, pointers(units));
  for (size_t i = 0; i < units.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_FALSE(units[i].shard.defined());  // the file alone holds it
    EXPECT_EQ(units[i].ticket, -1);
    const at::Tensor back = file.read(units[i]);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(back.data_ptr()) % offload::kAlignment, 0u);
    EXPECT_TRUE(at::equal(bits(back), written[i]));
    EXPECT_EQ(bits(back)[units[i].chunk].item<int64_t>(), static_cast<int64_t>(i));  // the tag
  }
  // Read ahead: in flight until settled, then the same bits; a second read ahead is refused.
  EXPECT_TRUE(file.read_ahead(units[1]));
  EXPECT_GE(units[1].ticket, 0);
  EXPECT_FALSE(units[1].writing);
  EXPECT_FALSE(file.read_ahead(units[1]));
  file.make_resident(units[1], /*read=*/true);  // lands the read in flight
  EXPECT_EQ(units[1].ticket, -1);
  EXPECT_TRUE(at::equal(bits(units[1].shard), written[1]));
  // A fresh shard, to be filled whole from the masters: zeros, then the tag.
  file.make_resident(units[3], /*read=*/false);
  at::Tensor fresh = bits(units[3].shard);
  EXPECT_EQ(fresh[units[3].chunk].item<int64_t>(), 3);
  EXPECT_TRUE(at::equal(fresh.narrow(0, 0, units[3].chunk),
                        at::zeros({units[3].chunk}, at::kShort)));
}

TEST(ShardFile, UpdatedShardsAreWrittenTwoAtATimeAndFreedAsTheyLand) {
  at::manual_seed(4);
  TempDir dir;
  std::vector<UnitShard> units = make_units({700, 9000, 33});
  ShardFile file(options_in(dir), at::kBFloat16, c10::kCPU, /*staged=*/false, pointers(units));
  std::vector<at::Tensor> updated;
  for (auto& unit : units) {
    file.make_resident(unit, /*read=*/false);
    unit.shard.narrow(0, 0, unit.chunk).copy_(at::randn({unit.chunk}).to(at::kBFloat16));
    updated.push_back(bits(unit.shard));
  }
  file.flush(units[0]);
  file.flush(units[1]);
  EXPECT_TRUE(units[0].writing && units[1].writing);
  EXPECT_TRUE(units[0].shard.defined());  // not freed before its write lands
  file.flush(units[2]);  // a third write waits for the oldest first
  EXPECT_EQ(units[0].ticket, -1);
  EXPECT_FALSE(units[0].shard.defined());
  EXPECT_TRUE(units[2].writing);
  file.flush(units[2]);  // already being written: nothing more
  for (auto& unit : units) file.settle(unit);
  for (size_t i = 0; i < units.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_FALSE(units[i].shard.defined());
    EXPECT_TRUE(at::equal(bits(file.read(units[i])), updated[i]));
  }
}

TEST(ShardFile, AShardChangedInTheFileIsAnErrorNamingItAndIsNotUsed) {
  at::manual_seed(5);
  TempDir dir;
  std::vector<UnitShard> units = make_units({100, 100});
  ShardFile file(options_in(dir), at::kBFloat16, c10::kCPU, /*staged=*/false, pointers(units));
  {
    // One byte of the first unit's region (the file's first) changed behind the file's back.
    const int fd = ::open(file.file().c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    const char x = 0x5a;
    ASSERT_EQ(::pwrite(fd, &x, 1, 10), 1);
    ::close(fd);
  }
  EXPECT_THROW_WITH(file.read(units[0]), Error, file.file(), "region 0", "checksum mismatch");
  ASSERT_TRUE(file.read_ahead(units[0]));
  EXPECT_THROW_WITH(file.settle(units[0]), Error, file.file(), "checksum mismatch");
  EXPECT_FALSE(units[0].shard.defined());  // half read: dropped
  EXPECT_EQ(units[0].ticket, -1);
  file.make_resident(units[1], /*read=*/true);  // the other unit is intact
  EXPECT_EQ(bits(units[1].shard)[100].item<int64_t>(), 1);
}

// Note [Parameter offload twin]: staged on the CPU, each home ("cpu": a host arena of its own;
// "nvme": the file through staging buffers) hands the gather a separate copy that the worker
// thread made ahead of use, bit for bit; the copy is freed after the gather, the host form kept
// (or the file's); a store from fp32 masters lands home on the worker, cast as the in-memory
// driver casts; a fetch nobody gathered is dropped.
TEST(ShardFile, StagedTwinFetchesSeparateCopiesAheadAndStoresThemHome) {
  for (const std::string home : {"cpu", "nvme"}) {
    SCOPED_TRACE(home);
    at::manual_seed(6);
    TempDir dir;
    std::vector<UnitShard> units = make_units({5, 3000, 2047});
    std::vector<at::Tensor> written;
    for (const auto& unit : units) written.push_back(bits(unit.shard));
    ShardFile file(options_in(dir, home), at::kBFloat16, c10::kCPU, /*staged=*/true,
                   pointers(units));
    for (size_t i = 0; i < units.size(); ++i) {
      SCOPED_TRACE(i);
      EXPECT_EQ(file.device_bytes(units[i]), 0);
      // "cpu": the arena's copy (its own bytes); "nvme": the file alone holds it.
      EXPECT_EQ(units[i].shard.defined(), home == "cpu");
      ASSERT_TRUE(file.read_ahead(units[i]));
      EXPECT_FALSE(file.read_ahead(units[i]));  // already on its way
      file.settle(units[i]);  // the worker's task done: the copy made there, not by fetch()
      EXPECT_TRUE(at::equal(bits(units[i].on_device), written[i]));
      const at::Tensor sent = file.fetch(units[i]);
      EXPECT_TRUE(at::equal(bits(sent), written[i]));
      EXPECT_EQ(file.device_bytes(units[i]), (units[i].chunk + 1) * 2);
      if (home == "cpu") EXPECT_NE(sent.data_ptr(), units[i].shard.data_ptr());
      file.gathered(units[i]);
      EXPECT_FALSE(units[i].on_device.defined());
      EXPECT_EQ(file.device_bytes(units[i]), 0);
      EXPECT_TRUE(at::equal(bits(file.read(units[i])), written[i]));  // home unchanged
    }
    // Fetched without a read ahead; and a read ahead dropped unused.
    EXPECT_TRUE(at::equal(bits(file.fetch(units[0])), written[0]));
    file.gathered(units[0]);
    ASSERT_TRUE(file.read_ahead(units[1]));
    file.drop_fetch(units[1]);
    EXPECT_FALSE(units[1].on_device.defined());
    // New shards from fp32 masters, all three stored before any is waited for (two in flight).
    std::vector<at::Tensor> stored;
    for (auto& unit : units) {
      const at::Tensor master = at::randn({unit.chunk});
      file.store(unit, master);
      at::Tensor expected = master.to(at::kBFloat16).view(at::kShort);
      stored.push_back(at::cat({expected, at::full({1}, unit.position, at::kShort)}));
    }
    for (auto& unit : units) file.settle(unit);
    for (size_t i = 0; i < units.size(); ++i) {
      SCOPED_TRACE(i);
      EXPECT_EQ(units[i].shard.defined(), home == "cpu");  // "nvme": written, then freed
      EXPECT_TRUE(at::equal(bits(file.read(units[i])), stored[i]));
      EXPECT_TRUE(at::equal(bits(file.fetch(units[i])), stored[i]));
      file.gathered(units[i]);
    }
  }
}

// Note [Offloaded parameters]: a host arena that cannot be allocated is named with its size
// and what to do: page-locked (a GPU run's; this process cannot pin 128 TiB, nor can a GPU
// host) suggests pin_memory = false, pageable suggests NVMe.
TEST(ShardFile, AHostArenaThatCannotBeAllocatedIsNamed) {
  TempDir dir;
  std::vector<UnitShard> units(1);
  units[0].chunk = (int64_t{1} << 46) - 1;  // 128 TiB of bf16 with the tag
  offload::OffloadOptions host = options_in(dir, "cpu");
  host.pin_memory = true;
  EXPECT_THROW_WITH(ShardFile(host, at::kBFloat16, c10::Device(c10::kCUDA, 0), true,
                              pointers(units)),
                    ConfigError,
                    "offload_param.device = \"cpu\": cannot allocate 128.00 TiB of page-locked "
                    "host memory for the weight shards",
                    "set pin_memory = false");
  try {
    ShardFile(host, at::kBFloat16, c10::kCPU, true, pointers(units));
    ADD_FAILURE() << "128 TiB of host memory were allocated";
  } catch (const ConfigError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("cannot allocate 128.00 TiB of host memory"), std::string::npos)
        << message;
    EXPECT_NE(message.find("use device = \"nvme\""), std::string::npos) << message;
    EXPECT_EQ(message.find("pin_memory"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace loom::sharding
