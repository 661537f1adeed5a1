// The memory tracker, the sampler, and the built-in data sources.
#include <ATen/ATen.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "loom/data.h"
#include "loom/memory.h"
#include "loom/memory_control.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;

TEST(Memory, TrackerCountsEveryAllocationExactly) {
  memory::install_cpu_tracker();
  ASSERT_TRUE(memory::cpu_tracker_installed());
  const auto before = memory::cpu_stats();
  memory::reset_cpu_peak();
  {
    at::Tensor t = at::empty({1000, 3}, at::kFloat);
    const auto during = memory::cpu_stats();
    EXPECT_EQ(during.current_bytes - before.current_bytes, 12000);
    EXPECT_EQ(during.allocations - before.allocations, 1);
    at::Tensor u = at::empty({10}, at::kDouble);
    EXPECT_EQ(memory::cpu_stats().current_bytes - before.current_bytes, 12080);
  }
  const auto after = memory::cpu_stats();
  EXPECT_EQ(after.current_bytes, before.current_bytes);
  EXPECT_EQ(after.peak_bytes - before.current_bytes, 12080);
}

// Whether the page holding `address` is mapped in this process: mincore fails (ENOMEM) on a
// range that is not.
bool mapped(const void* address) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  unsigned char resident = 0;
  return mincore(reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(address) & ~(page - 1)),
                 page, &resident) == 0;
}

// Note [Large blocks kept]: a freed block of 32 MiB or more comes back, its contents as they
// were, for the next request of its size, up to the cap; a fresh mapping reads zero; the
// tracked bytes never count kept blocks; a cap of 0 keeps none.
TEST(Memory, LargeFreedBlocksAreKeptForTheirSizeUpToTheCap) {
  memory::keep_large_cpu_blocks(0);  // none kept from before
  memory::keep_large_cpu_blocks(size_t{100} << 20);
  const int64_t base = memory::cpu_stats().current_bytes;
  const int64_t n = (int64_t{40} << 20) / 4;  // 40 MiB of floats
  void* first = nullptr;
  {
    at::Tensor t = at::empty({n}, at::kFloat).fill_(3.0f);
    first = t.data_ptr();
    EXPECT_EQ(memory::cpu_stats().current_bytes - base, n * 4);
  }
  EXPECT_EQ(memory::cpu_stats().current_bytes, base);  // kept, not counted
  {
    at::Tensor other = at::empty({n + 1024}, at::kFloat);  // another size: a fresh mapping
    EXPECT_NE(other.data_ptr(), first);
    EXPECT_EQ(other[0].item<float>(), 0.0f);
    at::Tensor again = at::empty({n}, at::kFloat);  // the same size: the kept block
    EXPECT_EQ(again.data_ptr(), first);
    EXPECT_EQ(again[n - 1].item<float>(), 3.0f);
  }
  memory::keep_large_cpu_blocks(0);
  memory::keep_large_cpu_blocks(size_t{100} << 20);
  std::vector<const void*> blocks;  // where the three taken back lie
  {
    // Three freed in turn, 120 MiB, past the 100 MiB cap: the first two are kept, the third
    // goes back to the system.
    std::vector<at::Tensor> three;
    for (int i = 0; i < 3; ++i) three.push_back(at::empty({n}, at::kFloat).fill_(i + 1.0f));
    three.clear();
    std::multiset<float> found;
    std::vector<at::Tensor> back;
    for (int i = 0; i < 3; ++i) {
      back.push_back(at::empty({n}, at::kFloat));
      found.insert(back.back()[0].item<float>());
      blocks.push_back(back.back().data_ptr());
    }
    EXPECT_EQ(found, (std::multiset<float>{0.0f, 1.0f, 2.0f}));
  }
  // Two of the three are kept again; a cap of 0 unmaps them, so none of the three is mapped.
  memory::keep_large_cpu_blocks(0);
  for (const void* block : blocks) EXPECT_FALSE(mapped(block));
  // New blocks are glibc's again, tracked as before. (Not read as zeros: where an earlier test
  // in this process left glibc a large free top of its heap, as Note [Freed memory kept]'s
  // settings do, glibc carves a block from it with whatever bytes it held.)
  at::Tensor t = at::empty({n}, at::kFloat);
  EXPECT_EQ(memory::cpu_stats().current_bytes - base, n * 4);
}

// The /proc/self/smaps entry of the mapping holding `address`: its first line and its fields.
std::string mapping_of(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(address);
  std::string line, entry;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t from = 0, to = 0;
    char dash = 0;
    std::istringstream head(line);
    // A mapping's first line ("from-to perms ..."), not one of its "Key: value" lines.
    const bool first_line = line.find(':') > line.find(' ');
    if (first_line && (head >> std::hex >> from >> dash >> to) && dash == '-') {
      if (inside) return entry;
      inside = from <= at && at < to;
      entry = line + "\n";
    } else if (inside) {
      entry += line + "\n";
    }
  }
  return inside ? entry : "";
}

// Note [Large blocks in huge pages]: with the switch on, a tensor of 2 MiB and more is a
// mapping of its own, 2 MiB-aligned and advised to huge pages ("hg" in its VmFlags), counted by
// the tracker as any block, and unmapped when freed; smaller tensors stay the heap's.
TEST(Memory, LargeBlocksAreMappingsOfTheirOwnInHugePages) {
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled"))
    GTEST_SKIP() << "this kernel has no transparent huge pages (madvise refuses the advice)";
  memory::install_cpu_tracker();
  const auto before = memory::cpu_stats();
  memory::map_large_cpu_blocks(true);
  struct Off {
    ~Off() { memory::map_large_cpu_blocks(false); }
  } off;
  const void* freed = nullptr;
  {
    at::Tensor large = at::ones({3 << 20}, at::kFloat);  // 12 MiB
    at::Tensor small = at::ones({1 << 10}, at::kFloat);  // 4 KiB
    EXPECT_EQ(memory::cpu_stats().current_bytes - before.current_bytes, (12 << 20) + 4096);
    EXPECT_EQ(large.sum().item<float>(), static_cast<float>(3 << 20));
    const std::string mapping = mapping_of(large.data_ptr());
    ASSERT_FALSE(mapping.empty());
    uintptr_t from = 0, to = 0;
    char dash = 0;
    std::istringstream range(mapping);
    range >> std::hex >> from >> dash >> to;
    EXPECT_EQ(from % (2 << 20), 0u) << mapping;
    EXPECT_NE(mapping.find("VmFlags:"), std::string::npos);
    EXPECT_NE(mapping.substr(mapping.find("VmFlags:")).find(" hg"), std::string::npos) << mapping;
    // Its own mapping: the block's header and data, no more than its own pages.
    EXPECT_EQ(to - from, static_cast<uintptr_t>((12 << 20) + 4096)) << mapping;
    const std::string heap = mapping_of(small.data_ptr());
    EXPECT_EQ(heap.substr(heap.find("VmFlags:")).find(" hg"), std::string::npos) << heap;
    freed = large.data_ptr();
  }
  EXPECT_EQ(mapping_of(freed), "") << "the freed block is still mapped";
  EXPECT_EQ(memory::cpu_stats().current_bytes, before.current_bytes);
  memory::map_large_cpu_blocks(false);
  at::Tensor after = at::ones({3 << 20}, at::kFloat);
  const std::string mapping = mapping_of(after.data_ptr());
  EXPECT_TRUE(mapping.empty() || mapping.find(" hg") == std::string::npos) << mapping;
}

TEST(Memory, FormatsBytes) {
  EXPECT_EQ(memory::format_bytes(512), "512 B");
  EXPECT_EQ(memory::format_bytes(3 << 20), "3.00 MiB");
}

TEST(Sampler, ShardsAreDisjointCoverTheEpochAndAreSeeded) {
  SamplerOptions o;
  o.batch_size = 3;
  o.seed = 11;
  o.world_size = 3;
  std::set<int64_t> all;
  for (int r = 0; r < 3; ++r) {
    o.rank = r;
    Sampler s(20, o);  // 20 / 3 ranks = 6 samples per rank, 2 batches
    EXPECT_EQ(s.batches_per_epoch(), 2);
    DataPosition p;
    for (int b = 0; b < 2; ++b) {
      for (int64_t i : s.batch_at(p)) EXPECT_TRUE(all.insert(i).second) << "sample " << i;
      p = s.advance(p);
    }
    EXPECT_EQ(s.advance(p), (DataPosition{1, 3}));  // rolls into epoch 1
  }
  EXPECT_EQ(all.size(), 18u);
  o.rank = 0;
  Sampler a(20, o), b(20, o);
  EXPECT_EQ(a.batch_at({0, 0}), b.batch_at({0, 0}));
  EXPECT_NE(a.batch_at({0, 0}), a.batch_at({1, 0}));  // another epoch, another order
  o.seed = 12;
  EXPECT_NE(Sampler(20, o).batch_at({0, 0}), a.batch_at({0, 0}));
}

TEST(Sampler, TooFewSamplesIsAnError) {
  SamplerOptions o;
  o.batch_size = 8;
  o.world_size = 2;
  EXPECT_THROW_WITH(Sampler(10, o), DataError, "10 samples", "batch size 8", "2 rank(s)");
}

std::string job_with_data(const std::string& out, const std::string& data) {
  return "[train]\nmodel = \"gpt\"\nmax_steps = 1\noutput_dir = \"" + out +
         "\"\nlog_level = \"warn\"\n[model]\nvocab_size = 300\nn_positions = 128\nn_embd = 16\n"
         "n_layer = 1\nn_head = 2\n[data]\n" + data;
}

TEST(Data, TextIsByteTokensInWindows) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 40; ++i) text += "The quick brown fox jumps. ";
  std::ofstream(dir / "corpus.txt") << text;
  auto trainer = Trainer::from_text(
      job_with_data(dir.str(), "source = \"text\"\npath = \"corpus.txt\"\nseq_len = 8\n"
                               "shuffle = false\n"),
      dir.path(), {"train.per_device_train_batch_size=2"});
  trainer->setup();
  Batch batch = trainer->engine().data().next();
  ASSERT_EQ(batch.input_ids.sizes(), (std::vector<int64_t>{2, 8}));
  for (int64_t row = 0; row < 2; ++row)
    for (int64_t i = 0; i < 8; ++i) {
      EXPECT_EQ(batch.input_ids[row][i].item<int64_t>(), (unsigned char)text[row * 8 + i]);
      EXPECT_EQ(batch.labels[row][i].item<int64_t>(), (unsigned char)text[row * 8 + i + 1]);
    }
}

TEST(Data, TokensFileIsMemoryMapped) {
  TempDir dir;
  std::vector<uint16_t> ids(100);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint16_t>(3 * i);
  std::ofstream(dir / "ids.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(ids.data()), ids.size() * 2);
  auto trainer = Trainer::from_text(
      job_with_data(dir.str(), "source = \"tokens\"\npath = \"ids.bin\"\nseq_len = 4\n"
                               "shuffle = false\n"),
      dir.path(), {"train.per_device_train_batch_size=1"});
  trainer->setup();
  trainer->engine().data().next();
  Batch second = trainer->engine().data().next();
  EXPECT_TRUE(at::equal(second.input_ids[0], at::tensor({12, 15, 18, 21}, at::kLong)));
  EXPECT_TRUE(at::equal(second.labels[0], at::tensor({15, 18, 21, 24}, at::kLong)));
  std::ofstream(dir / "odd.bin", std::ios::binary) << "abc";
  EXPECT_THROW_WITH(Trainer::from_text(
                        job_with_data(dir.str(), "source = \"tokens\"\npath = \"odd.bin\"\n"),
                        dir.path()),
                    DataError, "odd.bin", "not a multiple of 2");
}

TEST(Data, MissingFileNamesThePath) {
  TempDir dir;
  // Refused while the job is prepared (Note [One resolved job]): `loom check` says so too.
  EXPECT_THROW_WITH(
      Trainer::from_text(
          job_with_data(dir.str(), "source = \"text\"\npath = \"no/such.txt\"\n"), dir.path()),
      DataError, "job.toml:", "no/such.txt", "cannot read");
  EXPECT_FALSE(std::filesystem::exists(dir / "checkpoint-1"));
}

TEST(Data, RandomTokensAreDeterministicPerIndex) {
  TempDir dir;
  auto make = [&](const std::string& order) {
    // Ids in [100, 300): below the model's vocabulary (Note [Data against the model]).
    auto t = Trainer::from_text(
        job_with_data(dir.str(), "task = \"lm\"\nseq_len = 8\nvocab_high = 300\n" + order),
        dir.path(), {"train.per_device_train_batch_size=4"});
    t->setup();
    return t->engine().data().next();
  };
  Batch shuffled = make("shuffle = true\n"), ordered = make("shuffle = false\n");
  // The same dataset index yields the same sample whatever order it is drawn in.
  Batch again = make("shuffle = true\n");
  EXPECT_TRUE(at::equal(shuffled.input_ids, again.input_ids));
  EXPECT_EQ(ordered.sample_indices, (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_GE(shuffled.input_ids.min().item<int64_t>(), 100);
}

}  // namespace
}  // namespace loom
