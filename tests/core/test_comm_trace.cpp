// The collective trace and its hang report (core/src/comm_trace.h, Note [Hang reports]) with
// two ranks' traces in one process over an in-memory board: which rank is named and how, the
// fingerprint check's message, a board that does not answer, and the cost of the bookkeeping
// each collective pays. tests/distributed/hang_test.sh runs the same over real processes.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "comm_trace.h"
#include "loom/error.h"

namespace loom {
namespace {

using namespace std::chrono_literals;

// The store of a job, shared by the ranks' boards; `down` makes every call throw (a store whose
// host stopped).
struct Shared {
  std::mutex mutex;
  std::map<int, std::string> lines;
  bool down = false;
};

class MemoryBoard final : public TraceBoard {
 public:
  explicit MemoryBoard(Shared& shared) : shared_(shared) {}
  void post(int rank, const std::string& line) override {
    std::lock_guard<std::mutex> lock(shared_.mutex);
    if (shared_.down) throw Error("connection timed out");
    shared_.lines[rank] = line;
  }
  std::optional<std::string> read(int rank) override {
    std::lock_guard<std::mutex> lock(shared_.mutex);
    if (shared_.down) throw Error("connection timed out");
    auto it = shared_.lines.find(rank);
    if (it == shared_.lines.end()) return std::nullopt;
    return it->second;
  }
  std::string where() const override { return "the test's store"; }

 private:
  Shared& shared_;
};

std::unique_ptr<CollectiveTrace> trace(Shared& shared, int rank) {
  return std::make_unique<CollectiveTrace>("world", rank, 2, 10s,
                                           std::make_unique<MemoryBoard>(shared));
}

// n finished all_reduces of 4 float32 (the step's loss), sequence numbers 1..n.
void finished_steps(CollectiveTrace& t, int n) {
  for (int i = 0; i < n; ++i) t.finish(t.begin({"all_reduce", 0, 4, c10::ScalarType::Float}));
}

// Waits until the board holds rank's line for sequence number `seq` (the poster posts within
// 10 ms of a change).
void wait_posted(Shared& shared, int rank, int64_t seq) {
  for (int i = 0; i < 500; ++i) {
    {
      std::lock_guard<std::mutex> lock(shared.mutex);
      auto it = shared.lines.find(rank);
      if (it != shared.lines.end() &&
          it->second.find(" " + std::to_string(seq) + " ") != std::string::npos)
        return;
    }
    std::this_thread::sleep_for(5ms);
  }
  FAIL() << "rank " << rank << " never posted #" << seq;
}

TEST(CollectiveTrace, DescribesItsCollectivesWhileTheyAreInTheRing) {
  CollectiveTrace t("world", 0, 1, 10s, nullptr);
  for (int i = 0; i < 20; ++i)
    EXPECT_EQ(t.begin({"all_gather", -1, 4096, c10::ScalarType::BFloat16}), i + 1);
  EXPECT_EQ(t.describe(20), "all_gather #20 (4096 bfloat16)");
  EXPECT_EQ(t.describe(5), "all_gather #5 (4096 bfloat16)");
  EXPECT_EQ(t.describe(4), "collective #4");  // 16 kept: #5..#20
  const int64_t barrier = t.begin({"barrier", -1, 0, c10::ScalarType::Undefined});
  EXPECT_EQ(t.describe(barrier), "barrier #21");
}

TEST(CollectiveTrace, NamesAStoppedRankAndItsLastCollective) {
  Shared shared;
  auto rank0 = trace(shared, 0);
  {
    auto rank1 = trace(shared, 1);
    finished_steps(*rank1, 5);
    wait_posted(shared, 1, 5);
  }  // rank 1 is gone: its line stays, its heartbeat stops
  finished_steps(*rank0, 5);
  const int64_t seq = rank0->begin({"all_gather", -1, 128, c10::ScalarType::BFloat16});
  ASSERT_EQ(seq, 6);
  EXPECT_EQ(rank0->diagnose(seq),
            "; rank 1 did not reach all_gather #6 (128 bfloat16): its last collective was "
            "all_reduce #5 (4 float32); it has been silent for 2.5 s (stopped, or dead)");
  // Later failures of the same hang repeat the first report without another wait.
  const auto start = std::chrono::steady_clock::now();
  EXPECT_NE(rank0->diagnose(seq).find("rank 1 did not reach all_gather #6"), std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 500ms);
}

TEST(CollectiveTrace, ALaggingLineIsCorrectedByWhatCompletedHere) {
  // Rank 1 posted #2 and stopped before its poster caught up with #3..#5; those completed on
  // rank 0, so rank 1 took part in them: its last collective is #5, not #2.
  Shared shared;
  shared.lines[1] = "7 2 all_reduce 4 float32 1";
  auto rank0 = trace(shared, 0);
  finished_steps(*rank0, 5);
  const int64_t seq = rank0->begin({"broadcast", 0, 10, c10::ScalarType::Long});
  EXPECT_EQ(rank0->diagnose(seq),
            "; rank 1 did not reach broadcast #6 (10 int64): its last collective was "
            "all_reduce #5 (4 float32); it has been silent for 2.5 s (stopped, or dead)");
}

TEST(CollectiveTrace, NamesARunningRankOnAnotherPath) {
  Shared shared;
  auto rank0 = trace(shared, 0);
  auto rank1 = trace(shared, 1);
  finished_steps(*rank0, 3);
  finished_steps(*rank1, 3);
  const int64_t seq = rank0->begin({"all_gather", -1, 3, c10::ScalarType::Long});
  rank1->begin({"all_reduce", 0, 1, c10::ScalarType::Double});  // skipped the all_gather
  wait_posted(shared, 1, 4);
  EXPECT_EQ(rank0->diagnose(seq),
            "; rank 1 called all_reduce #4 (1 float64) where this rank called all_gather #4 "
            "(3 int64): the ranks took different paths (a collective skipped, added or "
            "reordered on one of them)");
}

TEST(CollectiveTrace, SaysSoWhenTheStoreDoesNotAnswer) {
  Shared shared;
  auto rank0 = trace(shared, 0);
  finished_steps(*rank0, 1);
  shared.down = true;
  const std::string report = rank0->diagnose(rank0->begin({"barrier", -1, 0, c10::ScalarType::Undefined}));
  EXPECT_EQ(report, "; the rendezvous store (the test's store) did not answer (connection timed "
                    "out): its host — rank 0 — is likely stopped or dead");
}

TEST(CollectiveTrace, FingerprintMismatchNamesBothCalls) {
  CollectiveTrace rank0("world", 0, 2, 10s, nullptr), rank1("world", 1, 2, 10s, nullptr);
  const int64_t a = rank0.begin({"all_gather", -1, 3, c10::ScalarType::Long});
  const int64_t b = rank1.begin({"all_reduce", 0, 1, c10::ScalarType::Double});
  const auto f0 = rank0.fingerprint(a), f1 = rank1.fingerprint(b);
  std::vector<int64_t> all(f0.begin(), f0.end());
  all.insert(all.end(), f1.begin(), f1.end());
  try {
    rank0.check_fingerprints(a, all.data());
    FAIL() << "no error";
  } catch (const Error& error) {
    EXPECT_STREQ(error.what(),
                 "rank 0: [distributed] check_collectives: collective #1 of group world differs "
                 "between ranks: rank 0 calls all_gather #1 (3 int64), rank 1 calls all_reduce #1 "
                 "(1 float64) sum — the ranks took different paths through the code (a "
                 "collective skipped, added or reordered on one of them)");
  }
  // Agreeing calls pass.
  std::vector<int64_t> same(f0.begin(), f0.end());
  same.insert(same.end(), f0.begin(), f0.end());
  EXPECT_NO_THROW(rank0.check_fingerprints(a, same.data()));
}

// The bookkeeping every collective pays (begin + finish), with the poster thread running: the
// number docs/RELIABILITY.md quotes. The bound is loose (a shared machine); a gloo collective
// of one element takes tens of microseconds.
TEST(CollectiveTrace, BookkeepingCostsUnderAMicrosecondPerCollective) {
  Shared shared;
  auto t = trace(shared, 0);
  constexpr int kCalls = 1000000;
  std::vector<double> runs;
  for (int run = 0; run < 3; ++run) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i)
      t->finish(t->begin({"all_reduce", 0, 4096, c10::ScalarType::Float}));
    runs.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start)
                       .count() / kCalls);
  }
  std::sort(runs.begin(), runs.end());
  std::printf("collective trace: %.1f ns per collective (begin + finish; median of 3 x %d)\n",
              runs[1], kCalls);
  EXPECT_LT(runs[1], 1000.0);
}

}  // namespace
}  // namespace loom
