// Test plugin: a data source of next-token samples that throws at one chosen index, to check
// that a failing sample reaches the training loop with its index through [preload]'s workers.
#include <ATen/ATen.h>

#include "loom/data.h"
#include "loom/error.h"
#include "loom/plugin.h"

namespace {

class FaultyTokens final : public loom::Dataset {
 public:
  FaultyTokens(int64_t size, int64_t seq_len, int64_t fail_index)
      : size_(size), seq_len_(seq_len), fail_index_(fail_index) {}
  int64_t size() const override { return size_; }
  loom::Sample get(int64_t index) const override {
    if (index == fail_index_)
      throw std::runtime_error(loom::detail::cat("bad record at ", index, " (test)"));
    loom::Sample s;
    s.index = index;
    at::Tensor ids = (at::arange(seq_len_ + 1, at::kLong) * (index + 3)) % 64;
    s.input_ids = ids.slice(0, 0, seq_len_).clone();
    s.labels = ids.slice(0, 1).clone();
    return s;
  }
  std::string describe() const override { return "faulty_tokens"; }

 private:
  int64_t size_, seq_len_, fail_index_;
};

class FaultyTokensPlugin final : public loom::Plugin {
 public:
  std::string name() const override { return "faulty_tokens"; }
  std::string description() const override { return "test: samples, one of which throws"; }
  std::vector<loom::Schema> schemas() const override {
    return {loom::Schema("data", "faulty_tokens")
                .key_int("num_samples", 64, "samples")
                .key_int("seq_len", 16, "tokens per sample")
                .key_int("fail_index", 5, "the sample that throws")};
  }
  std::shared_ptr<const loom::Dataset> create_dataset(const std::string&,
                                                      const loom::ConfigSection& t,
                                                      loom::Engine&) override {
    return std::make_shared<FaultyTokens>(t.get_int("num_samples"), t.get_int("seq_len"),
                                          t.get_int("fail_index"));
  }
};

}  // namespace

LOOM_DEFINE_PLUGIN(FaultyTokensPlugin, "faulty_tokens", "0.1.0")
