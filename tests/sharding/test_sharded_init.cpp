// Sharded initialization (Note [Sharded initialization] in loom/nn.h) in one process: a model
// built under the observer draws the same random numbers as the unobserved build, so each
// unit's kept chunk is bitwise its slice of the whole-built unit; the weights it cut hold no
// bytes; assign reads a transposed source's pieces row by row.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "loom/comm.h"
#include "loom/nn.h"
#include "loom/sharding/sharded_init.h"

namespace {

using namespace loom;

// GPT's shape in miniature: an embedding, a UnitList of blocks, a head; init_normal_ with a
// per-unit finish (GPT-2's residual scaling).
class Tiny : public torch::nn::Module {
 public:
  Tiny() {
    wte = register_module("wte", std::make_shared<nn::Embedding>(50, 16));
    units = register_module("h", std::make_shared<nn::UnitList>());
    nn::TransformerBlock::Options block;
    block.dim = 16;
    block.n_heads = 2;
    block.hidden = 40;
    for (int i = 0; i < 3; ++i) units->push_back(std::make_shared<nn::TransformerBlock>(block));
    head = register_module("head", std::make_shared<nn::Linear>(16, 50, false));
    nn::init_normal_(*this, 0.02, [](nn::Unit& u) {
      static_cast<nn::TransformerBlock&>(u).attn->proj->weight.mul_(0.5);
    });
  }
  std::shared_ptr<nn::Embedding> wte;
  std::shared_ptr<nn::UnitList> units;
  std::shared_ptr<nn::Linear> head;
};

// Rank `rank` of `world` (the observer's cut for that rank; its broadcast is skipped: the
// local Comm has one rank and the plan's world is the shard group size).
struct Observed {
  std::unique_ptr<Comm> comm = make_comm(CommOptions{});
  std::unique_ptr<sharding::ShardedInit> init;
  explicit Observed(int64_t threshold, Partitioning partitioning = {}) {
    sharding::ShardedInitOptions options;
    options.comm = comm.get();
    options.persistence_threshold = threshold;
    options.partitioning = partitioning;
    init = std::make_unique<sharding::ShardedInit>(options);
    nn::set_unit_build_observer(init.get());
  }
  ~Observed() { nn::set_unit_build_observer(nullptr); }
};

TEST(ShardedInit, ChunksAreTheWholeBuildsValuesBitwise) {
  for (const auto& partitioning :
       {Partitioning{}, Partitioning{Granularity::row, 1}}) {
    at::manual_seed(7);
    Tiny whole;
    const at::Tensor after_whole = at::rand({4});  // where the generator was left
    at::manual_seed(7);
    Observed observed(/*threshold=*/100, partitioning);
    Tiny cut;
    EXPECT_TRUE(at::equal(at::rand({4}), after_whole)) << "the build drew other numbers";
    EXPECT_EQ(observed.init->uninitialised_units(), 0);
    // Outside units: untouched and whole.
    EXPECT_TRUE(at::equal(cut.wte->weight, whole.wte->weight));
    EXPECT_TRUE(at::equal(cut.head->weight, whole.head->weight));
    auto chunks = observed.init->take_chunks();
    ASSERT_EQ(chunks.size(), 3u);
    for (size_t u = 0; u < 3; ++u) {
      auto& kept_unit = (*cut.units)[u];
      auto& whole_unit = (*whole.units)[u];
      std::vector<at::Tensor> flat;
      auto whole_params = whole_unit.parameters();
      auto cut_params = kept_unit.parameters();
      for (size_t i = 0; i < whole_params.size(); ++i) {
        if (whole_params[i].numel() < 100) {  // below the threshold: kept whole, same values
          EXPECT_TRUE(at::equal(cut_params[i], whole_params[i]));
          continue;
        }
        EXPECT_TRUE(nn::storage_released(cut_params[i])) << "unit " << u << " tensor " << i;
        flat.push_back(whole_params[i].detach().reshape(-1));
      }
      // One rank: its chunk is the unit's whole flat group, then padding.
      const at::Tensor expected = at::cat(flat);
      const at::Tensor chunk = chunks.at(&kept_unit);
      ASSERT_GE(chunk.numel(), expected.numel());
      EXPECT_TRUE(at::equal(chunk.narrow(0, 0, expected.numel()), expected)) << "unit " << u;
    }
  }
}

// Stage 3's group rule in one place (unit_group_params): a unit's trainable tensors of at least
// the threshold, in parameter order (its own, then its children's); frozen ones and smaller ones
// left out. The observer cuts exactly those tensors.
class Mixed : public nn::Unit {
 public:
  Mixed() {
    register_parameter("big", at::zeros({3, 4}));                             // 12, trains
    register_parameter("frozen", at::zeros({20}), /*requires_grad=*/false);   // 20, frozen
    register_parameter("small", at::zeros({3}));                              // 3, trains
    inner = register_module("inner", std::make_shared<torch::nn::Module>());
    inner->register_parameter("w", at::zeros({2, 5}));                        // 10, trains
    register_parameter("last", at::zeros({8}));                               // 8, trains
  }
  at::Tensor forward(const at::Tensor& x, const nn::UnitArgs&) override { return x; }
  std::shared_ptr<torch::nn::Module> inner;
};

TEST(ShardedInit, UnitGroupIsTrainableTensorsAtTheThresholdInOrder) {
  Mixed unit;
  auto names = [&](int64_t threshold) {
    std::vector<std::string> out;
    for (const auto& member : sharding::unit_group_params(unit, threshold)) {
      EXPECT_TRUE(member.tensor.is_same(unit.named_parameters()[member.name])) << member.name;
      out.push_back(member.name);
    }
    return out;
  };
  using Names = std::vector<std::string>;
  EXPECT_EQ(names(0), (Names{"big", "small", "last", "inner.w"}));
  EXPECT_EQ(names(8), (Names{"big", "last", "inner.w"}));  // at the threshold: in
  EXPECT_EQ(names(11), (Names{"big"}));
  EXPECT_EQ(names(13), Names{});  // the frozen 20 never

  // The observer keeps the group's tensors, in its order.
  Observed observed(8);
  const auto group = sharding::unit_group_params(unit, 8);
  observed.init->unit_initialised(unit);
  const std::vector<at::Tensor>* kept = observed.init->kept_tensors(&unit);
  ASSERT_NE(kept, nullptr);
  ASSERT_EQ(kept->size(), group.size());
  for (size_t i = 0; i < group.size(); ++i)
    EXPECT_TRUE((*kept)[i].is_same(group[i].tensor)) << group[i].name;
}

TEST(ShardedInit, CopyFlatRangeReadsATransposedViewInPlace) {
  const at::Tensor stored = at::arange(7 * 5, at::kFloat).view({7, 5});  // (in, out), as HF's
  const at::Tensor view = stored.t();                                     // (out, in)
  const at::Tensor reference = view.contiguous().view(-1);
  for (int64_t offset : {0, 3, 7, 12}) {
    for (int64_t numel : {1, 6, 14, 35 - 12}) {
      if (offset + numel > 35) continue;
      at::Tensor out = at::empty({numel});
      sharding::copy_flat_range(view, offset, numel, out);
      EXPECT_TRUE(at::equal(out, reference.narrow(0, offset, numel)))
          << "offset " << offset << " numel " << numel;
    }
  }
}

}  // namespace
