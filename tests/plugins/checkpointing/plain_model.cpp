// Test plugin: a language model of plain ATen pieces with no loom::nn::UnitList, to check that
// [checkpointing] says it has nothing to wrap instead of silently doing nothing.
#include <ATen/ATen.h>

#include "loom/model.h"
#include "loom/plugin.h"

namespace {

class PlainLm final : public loom::Model {
 public:
  explicit PlainLm(int64_t vocab) {
    embedding = register_parameter("embedding", at::randn({vocab, 8}) * 0.02);
    head = register_parameter("head", at::randn({vocab, 8}) * 0.02);
  }
  loom::Output forward(const loom::Batch& batch) override {
    // input_ids (B,T) -> logits (B,T,V)
    at::Tensor logits = at::linear(at::embedding(embedding, batch.input_ids), head);
    loom::Output out;
    out.loss_sum = at::cross_entropy_loss(logits.view({-1, logits.size(-1)}),
                                          batch.labels.reshape({-1}), {}, at::Reduction::Sum,
                                          loom::kIgnoreIndex);
    out.num_targets = batch.labels.ne(loom::kIgnoreIndex).sum().item<int64_t>();
    return out;
  }
  at::Tensor embedding, head;
};

class PlainLmPlugin final : public loom::Plugin {
 public:
  std::string name() const override { return "plain_lm"; }
  std::string description() const override { return "test: an LM without a UnitList"; }
  std::vector<loom::Schema> schemas() const override {
    return {loom::Schema("model", "plain_lm").key_int("vocab_size", 64, "token ids are below")};
  }
  std::shared_ptr<loom::Model> create_model(const std::string&, const loom::ConfigSection& t,
                                            loom::Engine&) override {
    return std::make_shared<PlainLm>(t.get_int("vocab_size"));
  }
};

}  // namespace

LOOM_DEFINE_PLUGIN(PlainLmPlugin, "plain_lm", "0.1.0")
