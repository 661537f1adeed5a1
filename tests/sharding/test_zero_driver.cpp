// sharding/ZeroDriver, Note [Bucket memory]: a stage-2 backward never holds the whole fp32
// gradient in bucket buffers. Groups whose reduce-scatter finished land during backward, and
// past four reduce buckets in flight the oldest is waited for; the landed shard is still the
// gradient that went in. At stage 3, one unit's reduce-scatter in flight at a time (Note [Unit
// buckets in flight]). One rank, with the tracking allocator counting every byte. And Note
// [Updating chunks in backward]: with the update in backward, the weights, masters, state and
// gradient norm of ranks run as threads are bitwise the normal step's. Note [ZeRO without
// masters]: bf16 weights with no fp32 masters at stages 1-3 on 2 ranks as threads are bitwise
// the core's driver's in one process (adamw, lion, adafactor).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "loom/comm.h"
#include "loom/error.h"
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
  // The fed gradients (kParams clones) are the test's, and the shards are made as their groups
  // first land (kParams chunks); beyond them, one .grad and one group's buffers (send +
  // received) at any moment, not all eight groups' (16 x kGroupBytes).
  EXPECT_LE(b.most_held, 2 * kParams * (kGroupBytes + 1024) + 4 * (kGroupBytes + 1024));
  expect_landed_is_fed(b);
}

TEST(ZeroDriver, BucketsInFlightAreCappedAtFourReduceBuckets) {
  DeferredComm comm;
  const Backward b = run_backward(comm);
  // Unfinished groups are waited for once more than 4 x reduce_bucket_size is in flight (send
  // + received: 2 x kGroupBytes a group), so at most three groups' at a moment, 6 x
  // kGroupBytes; all eight would be 16 x. (Beside the fed clones and the landed shards.)
  EXPECT_LE(b.most_held, 2 * kParams * (kGroupBytes + 1024) + 6 * (kGroupBytes + 1024));
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
  // The fed clones and the landed shards are the test's; beyond them: unit i whole, unit i-1
  // gathering, unit i's .grad and send buffer, unit i+1's send and received: 6 x kGroupBytes,
  // plus alignment.
  EXPECT_LE(out.most_held, 2 * kParams * (kGroupBytes + 1024) + 6 * (kGroupBytes + 1024));
  ASSERT_EQ(out.landed.size(), static_cast<size_t>(kParams));
  for (int i = 0; i < kParams; ++i)  // a unit's group is its position: forward order here
    EXPECT_TRUE(at::equal(out.landed[i].narrow(0, 0, kNumel), out.fed[i].view(-1))) << "p" << i;
}

// ---- Note [Updating chunks in backward], over ranks as threads ----

// The collectives of ranks that are threads of this process. Each Comm numbers its calls; the
// n-th call of every rank of a Comm meets on the board, so collectives must start in the same
// order on every rank, as any backend's. Inputs are copied when a call starts; a call's result
// is made when it is waited for, summing in rank order.
class Board {
 public:
  struct Call {
    std::vector<at::Tensor> inputs;  // by rank in the Comm
    int posted = 0;
  };
  std::shared_ptr<Call> post(const std::string& comm, int64_t n, int world, int rank,
                             at::Tensor input) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& call = calls_[{comm, n}];
    if (!call) {
      call = std::make_shared<Call>();
      call->inputs.resize(world);
    }
    call->inputs[rank] = std::move(input);
    ++call->posted;
    posted_.notify_all();
    return call;
  }
  void wait(const Call& call) {
    std::unique_lock<std::mutex> lock(mutex_);
    posted_.wait(lock, [&] { return call.posted == static_cast<int>(call.inputs.size()); });
  }
  bool done(const Call& call) {
    std::lock_guard<std::mutex> lock(mutex_);
    return call.posted == static_cast<int>(call.inputs.size());
  }

 private:
  std::mutex mutex_;
  std::condition_variable posted_;
  std::map<std::pair<std::string, int64_t>, std::shared_ptr<Call>> calls_;
};

class ThreadComm final : public Comm {
 public:
  ThreadComm(std::shared_ptr<Board> board, std::string id, int rank, int world)
      : board_(std::move(board)), id_(std::move(id)), rank_(rank), world_(world) {}
  std::string backend() const override { return "threads"; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  int local_rank() const override { return rank_; }
  int local_world_size() const override { return world_; }
  std::shared_ptr<Work> all_reduce(at::Tensor& tensor, ReduceOp) override {
    at::Tensor out = tensor;
    return start(tensor, [out](const Board::Call& call) mutable { out.copy_(sum(call, 0, 0)); });
  }
  std::shared_ptr<Work> reduce_scatter(at::Tensor& output, const at::Tensor& input,
                                       ReduceOp) override {
    at::Tensor out = output;
    const int64_t n = output.numel(), offset = rank_ * n;
    return start(input, [out, n, offset](const Board::Call& call) mutable {
      out.copy_(sum(call, offset, n));
    });
  }
  std::shared_ptr<Work> all_gather(at::Tensor& output, const at::Tensor& input) override {
    at::Tensor out = output;
    return start(input, [out](const Board::Call& call) mutable {
      const int64_t n = call.inputs.front().numel();
      for (size_t r = 0; r < call.inputs.size(); ++r)
        out.narrow(0, static_cast<int64_t>(r) * n, n).copy_(call.inputs[r]);
    });
  }
  std::shared_ptr<Work> broadcast(at::Tensor& tensor, int root) override {
    at::Tensor out = tensor;
    return start(tensor, [out, root](const Board::Call& call) mutable {
      out.copy_(call.inputs[root]);
    });
  }
  std::shared_ptr<Work> all_to_all(at::Tensor&, const at::Tensor&) override {
    throw Error("ThreadComm has no all_to_all");
  }
  void barrier() override { start(at::zeros({1}), [](const Board::Call&) {})->wait(); }
  std::unique_ptr<Comm> split(int color, int key) override {
    const int64_t n = calls_;
    at::Tensor mine = at::tensor({static_cast<int64_t>(color), static_cast<int64_t>(key)});
    std::vector<std::pair<int64_t, int>> members;  // (key, rank) of this color
    start(mine, [&](const Board::Call& call) {
      for (size_t r = 0; r < call.inputs.size(); ++r)
        if (call.inputs[r][0].item<int64_t>() == color)
          members.emplace_back(call.inputs[r][1].item<int64_t>(), static_cast<int>(r));
    })->wait();
    std::sort(members.begin(), members.end());
    int new_rank = 0;
    while (members[new_rank].second != rank_) ++new_rank;
    return std::make_unique<ThreadComm>(
        board_, id_ + "/" + std::to_string(n) + "." + std::to_string(color), new_rank,
        static_cast<int>(members.size()));
  }

 private:
  class ThreadWork final : public Work {
   public:
    ThreadWork(std::shared_ptr<Board> board, std::shared_ptr<Board::Call> call,
               std::function<void(const Board::Call&)> finish)
        : board_(std::move(board)), call_(std::move(call)), finish_(std::move(finish)) {}
    void wait() override {
      board_->wait(*call_);
      if (finish_) finish_(*call_);
      finish_ = nullptr;
    }
    bool completed() override { return board_->done(*call_); }

   private:
    std::shared_ptr<Board> board_;
    std::shared_ptr<Board::Call> call_;
    std::function<void(const Board::Call&)> finish_;
  };

  // Elements [offset, offset + n) of every rank's input summed in rank order (n = 0: all).
  static at::Tensor sum(const Board::Call& call, int64_t offset, int64_t n) {
    auto part = [&](const at::Tensor& t) { return n == 0 ? t : t.narrow(0, offset, n); };
    at::Tensor total = part(call.inputs.front()).clone();
    for (size_t r = 1; r < call.inputs.size(); ++r) total.add_(part(call.inputs[r]));
    return total;
  }
  std::shared_ptr<Work> start(const at::Tensor& input,
                              std::function<void(const Board::Call&)> finish) {
    auto call = board_->post(id_, calls_++, world_, rank_, input.detach().clone());
    return std::make_shared<ThreadWork>(board_, std::move(call), std::move(finish));
  }

  std::shared_ptr<Board> board_;
  std::string id_;
  int rank_, world_;
  int64_t calls_ = 0;
};

// What one rank holds after the steps: its parameters (whole, every rank's), its pieces of
// masters and state, and each step's squared gradient norm.
struct RankRun {
  std::vector<at::Tensor> weights;
  StatePieces state;
  std::vector<double> norms;
};

struct InBackwardCase {
  const char* name;
  int ranks;
  ZeroOptions zero;
  at::ScalarType dtype;
  int accumulation;
  // Note [ZeRO without masters]: bf16 weights updated with no fp32 masters.
  bool no_masters = false;
};

constexpr int kSteps = 3;

// Parameters of odd sizes in `dtype`, the same on every rank, half of them without weight decay.
std::vector<Param> odd_params(at::ScalarType dtype) {
  const std::vector<std::vector<int64_t>> shapes = {{48, 33}, {7},   {64, 16},
                                                    {5, 5},   {100}, {3, 90}};
  std::vector<Param> params;
  for (size_t i = 0; i < shapes.size(); ++i) {
    at::Generator gen = at::detail::createCPUGenerator(1000 + i);
    at::Tensor t = at::randn(shapes[i], gen).to(dtype).set_requires_grad(true);
    params.push_back({"p" + std::to_string(i), t, static_cast<int>(i % 2)});
  }
  return params;
}

// Steps 1..kSteps of a ZeroDriver on `comm`, fed the gradients backward would give, as the zero
// plugin feeds them: at stage 1 they accumulate in .grad and are handed over on the window's
// last micro-step; at stage 2 each micro-step's are.
RankRun run_rank(Comm& comm, const InBackwardCase& c, bool in_backward) {
  auto rule = test::make_rule("adamw");
  StepDriverOptions options;
  options.rule = rule.get();
  options.comm = &comm;
  options.weight_decay = 0.1;
  options.params = odd_params(c.dtype);
  if (c.no_masters) {
    options.master_dtype = "bf16";
    options.seed = 11;
    rule->set_seed(11);
  }
  ZeroDriver driver(options, c.zero);
  RankRun out;
  const double lr = 1e-2;
  for (int64_t step = 1; step <= kSteps; ++step) {
    driver.zero_grad();
    for (int k = 0; k < c.accumulation; ++k) {
      const bool last = k + 1 == c.accumulation;
      driver.begin_backward(last);
      if (in_backward && last) driver.begin_update_in_backward(step, lr);
      for (size_t i = options.params.size(); i-- > 0;) {  // backward's order
        const Param& p = options.params[i];
        at::Generator gen = at::detail::createCPUGenerator(
            ((step * 8 + k) * 16 + static_cast<int64_t>(i)) * 16 + comm.rank());
        at::Tensor grad = at::randn(p.tensor.sizes(), gen).to(c.dtype);
        at::Tensor& held = at::Tensor(p.tensor).mutable_grad();
        if (held.defined()) held.add_(grad);  // as autograd accumulates
        else held = grad;
        if (c.zero.stage >= 2 || last) driver.grad_ready(p);
      }
      if (c.zero.stage >= 2 || last) driver.finish_backward(last);
    }
    out.norms.push_back(driver.grad_norm_squared().item<double>());
    driver.update(step, lr);
  }
  for (const Param& p : options.params) out.weights.push_back(p.tensor.detach().clone());
  for (auto piece : driver.state_pieces()) {
    piece.tensor = piece.tensor.clone();
    out.state.push_back(std::move(piece));
  }
  return out;
}

// `rank(comm)` on `ranks` threads, each with its ThreadComm of one board; the results by rank
// (a rank's exception rethrown once all are done).
template <typename Run>
auto on_threads(int ranks, const Run& rank) {
  auto board = std::make_shared<Board>();
  std::vector<decltype(rank(std::declval<Comm&>()))> runs(ranks);
  std::vector<std::exception_ptr> errors(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        ThreadComm comm(board, "world", r, ranks);
        runs[r] = rank(comm);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return runs;
}

// Every rank of `c` as a thread; their runs by rank.
std::vector<RankRun> run_ranks(const InBackwardCase& c, bool in_backward) {
  return on_threads(c.ranks, [&](Comm& comm) { return run_rank(comm, c, in_backward); });
}

class UpdateInBackward : public ::testing::TestWithParam<InBackwardCase> {};

TEST_P(UpdateInBackward, IsBitwiseTheNormalStep) {
  const InBackwardCase& c = GetParam();
  const auto normal = run_ranks(c, false);
  const auto in_backward = run_ranks(c, true);
  const auto start = odd_params(c.dtype);
  for (int r = 0; r < c.ranks; ++r) {
    const RankRun &want = normal[r], &got = in_backward[r];
    ASSERT_EQ(want.weights.size(), got.weights.size());
    for (size_t i = 0; i < want.weights.size(); ++i) {
      EXPECT_TRUE(at::equal(want.weights[i], got.weights[i])) << "rank " << r << " p" << i;
      EXPECT_FALSE(at::equal(start[i].tensor, got.weights[i])) << "rank " << r << " p" << i
                                                                << " never updated";
    }
    ASSERT_EQ(want.state.size(), got.state.size()) << "rank " << r;
    // Note [Hybrid sharding]: the first shard group's ranks write the state; the other groups
    // hold the same chunks (their weights, equal above, came from them).
    const int writers = c.zero.shard_group_size > 0 ? c.zero.shard_group_size : c.ranks;
    if (r < writers) ASSERT_FALSE(want.state.empty()) << "rank " << r;
    for (size_t i = 0; i < want.state.size(); ++i) {
      EXPECT_EQ(want.state[i].name, got.state[i].name);
      EXPECT_EQ(want.state[i].offset, got.state[i].offset) << want.state[i].name;
      EXPECT_TRUE(at::equal(want.state[i].tensor, got.state[i].tensor))
          << "rank " << r << " " << want.state[i].name;
    }
    EXPECT_EQ(want.norms, got.norms) << "rank " << r;
    EXPECT_GT(got.norms.front(), 0.0);
  }
}

ZeroOptions zero_options(int stage, int shard_group_size = 0) {
  ZeroOptions zero;
  zero.stage = stage;
  zero.reduce_bucket_bytes = 4000;    // groups of about one tensor
  zero.allgather_bucket_bytes = 3000;  // the updated values' gathers capped below the model
  zero.shard_group_size = shard_group_size;
  return zero;
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, UpdateInBackward,
    ::testing::Values(
        // The window's whole gradient accumulated in .grad, reduce-scattered on the last one.
        InBackwardCase{"stage1_fp32_accumulation2", 2, zero_options(1), at::kFloat, 2},
        // Shards accumulated over the micro-steps; bf16 weights from fp32 masters.
        InBackwardCase{"stage2_bf16_accumulation2", 2, zero_options(2), at::kBFloat16, 2},
        // Note [Hybrid sharding]: each chunk updated once its sum across the groups lands.
        InBackwardCase{"stage2_bf16_hybrid_4_ranks", 4, zero_options(2, 2), at::kBFloat16, 2},
        // Note [ZeRO without masters]: each chunk's bf16 weights rounded as they are updated.
        InBackwardCase{"stage2_bf16_no_masters_accumulation2", 2, zero_options(2), at::kBFloat16,
                       2, true},
        InBackwardCase{"stage1_fp32_hybrid_4_ranks", 4, zero_options(1, 2), at::kFloat, 1}),
    [](const ::testing::TestParamInfo<InBackwardCase>& info) {
      return std::string(info.param.name);
    });

// ---- Note [ZeRO without masters], over ranks as threads ----

constexpr uint64_t kSeed = 77;

// What a run of kSteps leaves: the weights, and the checkpoint pieces' names.
struct NoMasterRun {
  std::vector<at::Tensor> weights;
  std::vector<std::string> pieces;
  int64_t master_bytes = -1;
};

// The gradient every rank feeds for parameter i at `step` (bf16, as full_bf16's backward).
at::Tensor shared_grad(const Param& p, int64_t step, size_t i) {
  at::Generator gen = at::detail::createCPUGenerator(step * 64 + static_cast<int64_t>(i));
  return at::randn(p.tensor.sizes(), gen).to(at::kBFloat16);
}

std::unique_ptr<UpdateRule> seeded_rule(const std::string& name,
                                        const std::map<std::string, test::RuleValue>& values) {
  auto rule = test::make_rule(name, values);
  rule->set_seed(kSeed);
  return rule;
}

StepDriverOptions no_master_options(const UpdateRule& rule, Comm* comm) {
  StepDriverOptions options;
  options.rule = &rule;
  options.comm = comm;
  options.weight_decay = 0.1;
  options.params = odd_params(at::kBFloat16);
  options.master_dtype = "bf16";
  options.seed = kSeed;
  return options;
}

// The core's driver in one process, fed each step's shared gradients.
NoMasterRun core_no_master_run(const std::string& rule_name,
                               const std::map<std::string, test::RuleValue>& values) {
  auto rule = seeded_rule(rule_name, values);
  StepDriverOptions options = no_master_options(*rule, nullptr);
  auto driver = make_default_step_driver(options);
  for (int64_t step = 1; step <= kSteps; ++step) {
    driver->zero_grad();
    for (size_t i = 0; i < options.params.size(); ++i)
      at::Tensor(options.params[i].tensor).mutable_grad() =
          shared_grad(options.params[i], step, i);
    driver->update(step, 1e-2);
  }
  NoMasterRun out;
  for (const Param& p : options.params) out.weights.push_back(p.tensor.detach().clone());
  for (const auto& piece : driver->state_pieces()) out.pieces.push_back(piece.name);
  out.master_bytes = driver->master_bytes();
  return out;
}

// ZeroDriver at `stage` on `ranks` threads, every rank fed the shared gradients (so their
// average is each of them, exactly); stage 3 holds the parameters in two units.
std::vector<NoMasterRun> zero_no_master_runs(const std::string& rule_name,
                                             const std::map<std::string, test::RuleValue>& values,
                                             int stage, int ranks) {
  return on_threads(ranks, [&](Comm& comm) {
    auto rule = seeded_rule(rule_name, values);
    StepDriverOptions options = no_master_options(*rule, &comm);
    int keys[2];
    ZeroOptions zero = zero_options(stage);
    if (stage == 3) zero.units = {{&keys[0], {0, 1, 2}}, {&keys[1], {3, 4, 5}}};
    ZeroDriver driver(options, zero);
    for (int64_t step = 1; step <= kSteps; ++step) {
      driver.zero_grad();
      driver.begin_backward(true);
      for (size_t i = options.params.size(); i-- > 0;) {
        if (stage == 3 && (i == 5 || i == 2)) driver.gather_unit(&keys[i / 3], false);
        const Param& p = options.params[i];
        at::Tensor(p.tensor).mutable_grad() = shared_grad(p, step, i);
        driver.grad_ready(p);
      }
      driver.finish_backward(true);
      (void)driver.grad_norm_squared();
      driver.update(step, 1e-2);
    }
    if (stage == 3) driver.gather_all_weights();
    NoMasterRun out;
    for (const Param& p : options.params) out.weights.push_back(p.tensor.detach().clone());
    for (const auto& piece : driver.state_pieces()) out.pieces.push_back(piece.name);
    out.master_bytes = driver.master_bytes();
    EXPECT_NE(driver.describe().find("no masters"), std::string::npos) << driver.describe();
    return out;
  });
}

struct NoMasterCase {
  const char* name;
  const char* rule;
  std::map<std::string, test::RuleValue> values;
};

class ZeroWithoutMasters : public ::testing::TestWithParam<NoMasterCase> {};

// The weights' bits depend on the seed, the step, the name and each element's index in the
// whole tensor, not on the cut: ZeRO stages 1-3 on 2 ranks write what the core's driver writes
// in one process, and keep no masters.
TEST_P(ZeroWithoutMasters, WritesTheCoreDriversBitsAtEveryStage) {
  const NoMasterCase& c = GetParam();
  const NoMasterRun want = core_no_master_run(c.rule, c.values);
  EXPECT_EQ(want.master_bytes, 0);
  const auto start = odd_params(at::kBFloat16);
  for (int stage = 1; stage <= 3; ++stage) {
    const auto runs = zero_no_master_runs(c.rule, c.values, stage, 2);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(runs[r].master_bytes, 0) << "stage " << stage << " rank " << r;
      for (const auto& name : runs[r].pieces)
        EXPECT_NE(name.rfind("master/", 0), 0u) << "stage " << stage << ": " << name;
      ASSERT_EQ(runs[r].weights.size(), want.weights.size());
      for (size_t i = 0; i < want.weights.size(); ++i) {
        const at::Tensor& got = runs[r].weights[i];
        EXPECT_FALSE(at::equal(got, start[i].tensor)) << "p" << i << " never updated";
        EXPECT_TRUE(at::equal(got, want.weights[i]))
            << "stage " << stage << " rank " << r << " p" << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Rules, ZeroWithoutMasters,
    ::testing::Values(
        // The core's adamw: its own pass over the bf16 weights and gradients.
        NoMasterCase{"adamw", "adamw", {}},
        NoMasterCase{"adamw_bf16_state", "adamw", {{"state_dtype", std::string("bf16")}}},
        // Any other elementwise rule: the fp32 copy, then the rounding pass.
        NoMasterCase{"lion", "lion", {}},
        // Whole-tensor sums across the ranks (Adafactor's factored second moment, summed in
        // fp64: the pieces' order leaves no trace at this size).
        NoMasterCase{"adafactor", "adafactor", {}}),
    [](const ::testing::TestParamInfo<NoMasterCase>& info) {
      return std::string(info.param.name);
    });

}  // namespace
}  // namespace loom::sharding
