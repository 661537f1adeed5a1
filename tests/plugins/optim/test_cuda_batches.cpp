// The optim plugin's CUDA kernels take a step's tensors in batches (plugins/optim/cuda/batches.h):
// the numbering of thread blocks through a batch's tensors and the cutting into batches are
// host-and-device code, held here on the CPU to what the kernels rely on.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "cuda/batches.h"

namespace loom::optim {
namespace {

struct Item {
  int id;
  int64_t blocks;
};
struct NoShared {};

// 150 tensors of 1 to 300 blocks, every seventh with none, one of 100000: each block finds the
// tensor whose range holds it, each tensor gets exactly its blocks, in order, batches hold at
// most kKernelBatch tensors and the empty ones are left out.
TEST(CudaBatches, EveryBlockFindsItsTensorInOrder) {
  std::mt19937 rng(7);
  std::vector<Item> items;
  for (int i = 0; i < 150; ++i)
    items.push_back({i, i % 7 == 3 ? 0 : static_cast<int64_t>(rng() % 300 + 1)});
  items[40].blocks = 100000;
  std::vector<int64_t> seen(items.size(), 0);
  std::vector<int> order;
  int launches = 0;
  const char* error = for_each_batch(
      items, NoShared{}, [](const Item& it) { return it.blocks; },
      [&](const auto& b, unsigned blocks) -> const char* {
        ++launches;
        EXPECT_GT(b.count, 0);
        EXPECT_LE(b.count, kKernelBatch);
        EXPECT_EQ(b.start[0], 0);
        EXPECT_EQ(b.start[b.count], static_cast<int64_t>(blocks));
        for (int64_t block = 0; block < blocks; ++block) {
          const int i = batch_item_of(b.start, b.count, block);
          EXPECT_GE(block, b.start[i]);
          EXPECT_LT(block, b.start[i + 1]);
          ++seen[b.item[i].id];
        }
        for (int i = 0; i < b.count; ++i) order.push_back(b.item[i].id);
        return nullptr;
      });
  EXPECT_EQ(error, nullptr);
  std::vector<int> expected;
  for (const Item& it : items)
    if (it.blocks > 0) expected.push_back(it.id);
  EXPECT_EQ(order, expected);
  for (const Item& it : items) EXPECT_EQ(seen[it.id], it.blocks) << "tensor " << it.id;
  EXPECT_EQ(launches, static_cast<int>((expected.size() + kKernelBatch - 1) / kKernelBatch));
}

// A launch's failure ends the work and is what the caller gets; so is a batch past a grid's
// 2^31 - 1 blocks, before anything is launched.
TEST(CudaBatches, AFailedLaunchOrAnOversizedBatchIsReturned) {
  std::vector<Item> items;
  for (int i = 0; i < 200; ++i) items.push_back({i, 5});
  int launches = 0;
  const char* error = for_each_batch(
      items, NoShared{}, [](const Item& it) { return it.blocks; },
      [&](const auto&, unsigned) -> const char* {
        return ++launches == 2 ? "the second launch failed" : nullptr;
      });
  ASSERT_NE(error, nullptr);
  EXPECT_EQ(std::string(error), "the second launch failed");
  EXPECT_EQ(launches, 2);

  const std::vector<Item> huge = {{0, int64_t{1} << 30}, {1, int64_t{1} << 30}, {2, 5}};
  launches = 0;
  error = for_each_batch(
      huge, NoShared{}, [](const Item& it) { return it.blocks; },
      [&](const auto&, unsigned) -> const char* {
        ++launches;
        return nullptr;
      });
  ASSERT_NE(error, nullptr);
  EXPECT_NE(std::string(error).find("2^31 - 1 thread blocks"), std::string::npos) << error;
  EXPECT_EQ(launches, 0);
}

}  // namespace
}  // namespace loom::optim
