// sharding/flat_layout: every element of every tensor lands on exactly one rank, cuts fall only
// where the update rule allows, the chunk is the smallest that fits (then aligned), and the
// buckets follow backward's order.
#include <gtest/gtest.h>

#include <numeric>

#include "loom/sharding/flat_layout.h"
#include "loom/step_driver.h"

namespace loom::sharding {
namespace {

// Checks a plan against its tensors: coverage, chunk bounds, cut units.
void check_plan(const FlatGroup& group, const std::vector<TensorInfo>& tensors,
                const Partitioning& partitioning, int world) {
  ASSERT_EQ(group.ranks.size(), static_cast<size_t>(world));
  EXPECT_EQ(group.chunk % kChunkAlign, 0);
  std::vector<std::vector<int>> owner(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) owner[t].assign(tensors[t].numel(), 0);
  for (int r = 0; r < world; ++r) {
    int64_t used = 0;
    for (const Piece& piece : group.ranks[r]) {
      EXPECT_EQ(piece.chunk_offset, used) << "pieces are packed from the chunk's start";
      used += piece.numel;
      const int64_t numel = tensors[piece.tensor].numel();
      const int64_t unit = std::min(cut_unit(tensors[piece.tensor].shape, partitioning), numel);
      EXPECT_EQ(piece.offset % unit, 0) << tensors[piece.tensor].name;
      EXPECT_TRUE(piece.numel % unit == 0 || piece.offset + piece.numel == numel)
          << tensors[piece.tensor].name << " cut at " << piece.offset << "+" << piece.numel;
      for (int64_t i = 0; i < piece.numel; ++i) ++owner[piece.tensor][piece.offset + i];
    }
    EXPECT_LE(used, group.chunk);
  }
  for (size_t t = 0; t < tensors.size(); ++t)
    for (int64_t i = 0; i < tensors[t].numel(); ++i)
      ASSERT_EQ(owner[t][i], 1) << tensors[t].name << " element " << i;
}

std::vector<size_t> all_of(const std::vector<TensorInfo>& tensors) {
  std::vector<size_t> members(tensors.size());
  std::iota(members.begin(), members.end(), 0);
  return members;
}

TEST(FlatLayout, ElementCutsSplitEvenlyWithPaddingOnlyAtTheEnd) {
  const std::vector<TensorInfo> tensors = {{"a", {100, 30}}, {"b", {30}}, {"c", {7, 9}}};
  for (int world : {1, 2, 3, 4, 7}) {
    const auto group = plan_group(tensors, all_of(tensors), {}, world);
    check_plan(group, tensors, {}, world);
    const int64_t total = 3000 + 30 + 63;
    const int64_t even = (total + world - 1) / world;
    EXPECT_EQ(group.chunk, (even + kChunkAlign - 1) / kChunkAlign * kChunkAlign) << world;
    EXPECT_EQ(group.numel(), total);
  }
}

TEST(FlatLayout, RowCutsNeverSplitARow) {
  // Adafactor: rows of dim 0 (a 3-D tensor's rows are whole matrices); vectors cut anywhere.
  const std::vector<TensorInfo> tensors = {
      {"w", {37, 64}}, {"bias", {64}}, {"stack", {5, 8, 16}}, {"head", {11, 128}}};
  const Partitioning rows{Granularity::row, 1};
  for (int world : {2, 3, 4, 8}) {
    const auto group = plan_group(tensors, all_of(tensors), rows, world);
    check_plan(group, tensors, rows, world);
    // At most one row of padding per rank beyond the even split (then alignment).
    int64_t total = 0;
    for (const auto& t : tensors) total += t.numel();
    EXPECT_LE(group.chunk, (total + world - 1) / world + 128 + kChunkAlign) << world;
  }
}

TEST(FlatLayout, BlockCutsFallOnBlocksAndAPartialLastBlockStaysWhole) {
  // adam8bit: cuts at multiples of the quantization block; 1000 elements = 15 blocks of 64 + 40.
  const std::vector<TensorInfo> tensors = {{"x", {1000}}, {"y", {10, 50}}};
  const Partitioning blocks{Granularity::block, 64};
  for (int world : {2, 3, 5}) {
    const auto group = plan_group(tensors, all_of(tensors), blocks, world);
    check_plan(group, tensors, blocks, world);
  }
}

TEST(FlatLayout, TensorGranularityKeepsEveryTensorOnOneRank) {
  const std::vector<TensorInfo> tensors = {{"a", {300}}, {"b", {200}}, {"c", {100}}};
  const Partitioning whole{Granularity::tensor, 1};
  const auto group = plan_group(tensors, all_of(tensors), whole, 3);
  check_plan(group, tensors, whole, 3);
  for (const auto& pieces : group.ranks)
    for (const auto& piece : pieces) EXPECT_EQ(piece.numel, tensors[piece.tensor].numel());
  EXPECT_EQ(group.chunk, 304);  // the largest tensor, aligned: a smaller chunk cannot hold it
}

TEST(FlatLayout, MoreRanksThanElementsLeavesSomeRanksEmpty) {
  const std::vector<TensorInfo> tensors = {{"tiny", {3}}};
  const auto group = plan_group(tensors, all_of(tensors), {}, 8);
  check_plan(group, tensors, {}, 8);
  EXPECT_EQ(group.ranks[0].size(), 1u);
  for (int r = 1; r < 8; ++r) EXPECT_TRUE(group.ranks[r].empty());
}

TEST(FlatLayout, BucketsFollowBackwardsOrder) {
  // 4 bytes per element, buckets of 400 bytes = 100 elements; the last tensor comes first.
  const std::vector<TensorInfo> tensors = {{"t0", {60}}, {"t1", {30}}, {"t2", {50}}, {"t3", {120}}};
  const auto groups = bucket_groups(tensors, 400, 4);
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_EQ(groups[0], std::vector<size_t>({3}));     // larger than a bucket: alone
  EXPECT_EQ(groups[1], std::vector<size_t>({1, 2}));  // 50 + 30 fit, 60 more would not
  EXPECT_EQ(groups[2], std::vector<size_t>({0}));
  EXPECT_THROW(bucket_groups(tensors, 0, 4), ConfigError);
}

TEST(StatePiece, OffsetsScaleWithTheStateAndWholeStateStaysWhole) {
  // A segment of elements [128, 192) of a 256-element tensor: per-element state starts at 128,
  // per-block state (blocks of 64) at block 2, state as large as the whole tensor's at 0.
  const at::Tensor piece_elements = at::zeros({64}), whole_elements = at::zeros({256});
  EXPECT_EQ(state_piece("e", piece_elements, whole_elements, 128, 64, 256).offset, 128);
  const at::Tensor piece_blocks = at::zeros({1}), whole_blocks = at::zeros({4});
  EXPECT_EQ(state_piece("b", piece_blocks, whole_blocks, 128, 64, 256).offset, 2);
  const at::Tensor columns = at::zeros({16});
  const auto kept = state_piece("c", columns, columns, 128, 64, 256);
  EXPECT_EQ(kept.offset, 0);
  EXPECT_EQ(kept.global_shape, std::vector<int64_t>({16}));
}

}  // namespace
}  // namespace loom::sharding
