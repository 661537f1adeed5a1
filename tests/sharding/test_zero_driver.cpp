// sharding/ZeroDriver, Note [Bucket memory]: a stage-2 backward never holds the whole fp32
// gradient in bucket buffers. Groups whose reduce-scatter finished land during backward, and
// past four reduce buckets in flight the oldest is waited for; the landed shard is still the
// gradient that went in. At stage 3, one unit's reduce-scatter in flight at a time (Note [Unit
// buckets in flight]). One rank, with the tracking allocator counting every byte.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <deque>

#include "loom/comm.h"
#include "loom/memory.h"
#include "loom/sharding/zero_driver.h"
#include "loom/step_driver.h"
#include "update_rules.h"

namespace loom::sharding {
namespace {

// One rank whose reduce-scatters complete only when waited for: what a slow network looks like
// to the driver.
class DeferredComm final : public Comm {
 public:
  struct Pending final : Work {
    at::Tensor output, input;
    bool done = false;
    void wait() override {
      if (!done) output.copy_(input);
      done = true;
    }
    bool completed() override { return done; }
  };
  std::string backend() const override { return "deferred"; }
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  int local_rank() const override { return 0; }
  int local_world_size() const override { return 1; }
  std::shared_ptr<Work> all_reduce(at::Tensor&, ReduceOp) override { return finished(); }
  std::shared_ptr<Work> reduce_scatter(at::Tensor& output, const at::Tensor& input,
                                       ReduceOp) override {
    auto work = std::make_shared<Pending>();
    work->output = output;
    work->input = input;
    return work;
  }
  std::shared_ptr<Work> all_gather(at::Tensor& output, const at::Tensor& input) override {
    output.copy_(input);
    return finished();
  }
  std::shared_ptr<Work> broadcast(at::Tensor&, int) override { return finished(); }
  std::shared_ptr<Work> all_to_all(at::Tensor& output, const at::Tensor& input) override {
    output.copy_(input);
    return finished();
  }
  void barrier() override {}

 private:
  static std::shared_ptr<Work> finished() {
    auto work = std::make_shared<Pending>();
    work->done = true;
    return work;
  }
};

constexpr int kParams = 8;
constexpr int64_t kNumel = 64 * 1024;          // 256 KiB of fp32 per parameter
constexpr int64_t kGroupBytes = kNumel * 4;    // a bucket holds one parameter

// kParams fp32 parameters of kNumel elements under `rule`, on `comm`, with the tracking
// allocator counting from here.
StepDriverOptions driver_options(Comm& comm, const UpdateRule& rule) {
  memory::install_cpu_tracker();
  StepDriverOptions options;
  options.rule = &rule;
  options.comm = &comm;
  for (int i = 0; i < kParams; ++i)
    options.params.push_back(
        {"p" + std::to_string(i), at::zeros({64, 1024}).set_requires_grad(true)});
  return options;
}

struct Backward {
  int64_t most_held = 0;  // tracked bytes above the start, at the most, during backward
  std::vector<at::Tensor> fed, landed;
};

// Hands `p` a random gradient, as backward would (the driver takes .grad; the test keeps a
// copy, first in out.fed, as backward runs in reverse).
void feed_gradient(ZeroDriver& driver, const Param& p, Backward& out) {
  at::Tensor grad = at::randn({64, 1024});
  out.fed.insert(out.fed.begin(), grad.clone());
  at::Tensor(p.tensor).mutable_grad() = grad;
  grad = at::Tensor();
  driver.grad_ready(p);
}

Backward run_backward(Comm& comm) {
  auto rule = test::make_rule("adamw");
  StepDriverOptions options = driver_options(comm, *rule);
  ZeroOptions zero;
  zero.stage = 2;
  zero.reduce_bucket_bytes = kGroupBytes;
  ZeroDriver driver(options, zero);

  Backward out;
  memory::reset_cpu_peak();
  const int64_t start = memory::cpu_stats().current_bytes;
  // Backward's order is the reverse of the model's.
  for (int i = kParams - 1; i >= 0; --i) {
    const Param& p = options.params[i];
    feed_gradient(driver, p, out);
  }
  out.most_held = memory::cpu_stats().peak_bytes - start;
  driver.finish_backward();
  for (const at::Tensor& g : driver.grads()) out.landed.push_back(g.clone());
  return out;
}

void expect_landed_is_fed(const Backward& b) {
  ASSERT_EQ(b.landed.size(), static_cast<size_t>(kParams));
  for (int i = 0; i < kParams; ++i) {
    // Group k holds the k-th parameter of backward's order, padded to the chunk alignment.
    const at::Tensor& shard = b.landed[kParams - 1 - i];
    EXPECT_TRUE(at::equal(shard.narrow(0, 0, kNumel), b.fed[i].view(-1))) << "p" << i;
  }
}

TEST(ZeroDriver, FinishedBucketsLandDuringBackward) {
  auto comm = make_comm(CommOptions{});  // one process: local, every collective done at once
  const Backward b = run_backward(*comm);
  // The fed gradients (kParams clones) are the test's; beyond them, one .grad and one group's
  // buffers (send + received) at any moment, not all eight groups' (16 x kGroupBytes).
  EXPECT_LE(b.most_held, kParams * kGroupBytes + 4 * (kGroupBytes + 1024));
  expect_landed_is_fed(b);
}

TEST(ZeroDriver, BucketsInFlightAreCappedAtFourReduceBuckets) {
  DeferredComm comm;
  const Backward b = run_backward(comm);
  // Unfinished groups are waited for once more than 4 x reduce_bucket_size is in flight (send
  // + received: 2 x kGroupBytes a group), so at most three groups' at a moment, 6 x
  // kGroupBytes; all eight would be 16 x.
  EXPECT_LE(b.most_held, kParams * kGroupBytes + 6 * (kGroupBytes + 1024));
  expect_landed_is_fed(b);
}

// Note [Unit buckets in flight]: at stage 3, a unit's reduce-scatter lands before the next
// unit's buffers are made, whatever reduce_bucket_size would allow. Eight one-parameter units,
// a reduce_bucket_size that would let all eight fly, and reduce-scatters that finish only when
// waited for: backward holds the computing unit, the prefetched one, one .grad and two units'
// reduce-scatter buffers at the most (all eight in flight would be 16 x kGroupBytes), and the
// landed chunks are bitwise the gradients fed.
TEST(ZeroDriver, Stage3HoldsOneUnitReduceScatterInFlight) {
  DeferredComm comm;
  auto rule = test::make_rule("adamw");
  StepDriverOptions options = driver_options(comm, *rule);
  int keys[kParams];
  ZeroOptions zero;
  zero.stage = 3;
  zero.reduce_bucket_bytes = 100 * kGroupBytes;
  for (int i = 0; i < kParams; ++i) zero.units.push_back({&keys[i], {static_cast<size_t>(i)}});
  ZeroDriver driver(options, zero);

  Backward out;
  memory::reset_cpu_peak();
  const int64_t start = memory::cpu_stats().current_bytes;
  for (int i = kParams - 1; i >= 0; --i) {
    driver.gather_unit(&keys[i], /*forward=*/false);
    const Param& p = options.params[i];
    feed_gradient(driver, p, out);
    EXPECT_EQ(p.tensor.storage().nbytes(), 0u) << "unit " << i << " released once its gradient "
                                                << "is in its bucket";
  }
  out.most_held = memory::cpu_stats().peak_bytes - start;
  driver.finish_backward();
  for (const at::Tensor& g : driver.grads()) out.landed.push_back(g.clone());
  // The fed clones are the test's; beyond them: unit i whole, unit i-1 gathering, unit i's
  // .grad and send buffer, unit i+1's send and received: 6 x kGroupBytes, plus alignment.
  EXPECT_LE(out.most_held, kParams * kGroupBytes + 6 * (kGroupBytes + 1024));
  ASSERT_EQ(out.landed.size(), static_cast<size_t>(kParams));
  for (int i = 0; i < kParams; ++i)  // a unit's group is its position: forward order here
    EXPECT_TRUE(at::equal(out.landed[i].narrow(0, 0, kNumel), out.fed[i].view(-1))) << "p" << i;
}

}  // namespace
}  // namespace loom::sharding
