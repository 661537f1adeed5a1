// comm_trace.h (core-internal) — the last collectives of one Comm group on this rank, posted
// where the group's other ranks can read them, and the hang report and fingerprint check made
// from them (Note [Hang reports]). Not a backend: the c10d and mpi backends each own one per
// group and call begin/finish around every collective.
#pragma once

#include <c10/core/ScalarType.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace loom {

// Where the ranks of a group post their trace line and read each other's: the rendezvous store
// (gloo, nccl) or files in a shared folder (mpi). Both calls may throw when the place is
// unreachable (the store's host stopped or died); the trace then stops using it.
class TraceBoard {
 public:
  virtual ~TraceBoard();
  virtual void post(int rank, const std::string& line) = 0;
  // Rank `rank`'s last posted line, or nullopt when it has posted none.
  virtual std::optional<std::string> read(int rank) = 0;
  // Says where the board is, for a report that could not read it ("the store at HOST:PORT").
  virtual std::string where() const = 0;
};

// What a collective is, as every rank of the group must agree (check_collectives). `detail`
// is the reduce op for reductions, the root for broadcast, -1 otherwise; `count` the elements
// of this rank's input, -1 where ranks legitimately differ (all_to_all_rows).
struct CollectiveCall {
  const char* op = "";
  int64_t detail = -1;
  int64_t count = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  // A call that blocks and cannot be timed out (mpi's MPI_Comm_split): the poster thread
  // reports it once it outlasts the timeout, since no wait() will.
  bool blocking = false;
};

class CollectiveTrace {
 public:
  static constexpr size_t kRing = 16;       // collectives kept per group
  static constexpr int kFingerprint = 6;    // int64 values per rank in the fingerprint check

  // `group` names the group in messages ("world", "split 0 color 1"); `board` may be null
  // (no peers to ask: the report then says only what this rank knows).
  CollectiveTrace(std::string group, int rank, int world, std::chrono::milliseconds timeout,
                  std::unique_ptr<TraceBoard> board);
  ~CollectiveTrace();
  CollectiveTrace(const CollectiveTrace&) = delete;
  CollectiveTrace& operator=(const CollectiveTrace&) = delete;

  // Called as a collective starts: records it and returns its sequence number (1, 2, ... per
  // group; every rank of the group counts the same while they agree).
  int64_t begin(const CollectiveCall& call);
  // Called once collective `seq` has completed on this rank.
  void finish(int64_t seq);

  // "all_reduce #57 (4096 float32)".
  std::string describe(int64_t seq) const;
  const std::string& group() const { return group_; }

  // After collective `seq` failed or did not finish in time: logs this rank's last
  // collectives, then asks the board where every other rank is (about two heartbeats' wait, so
  // a silent rank can be told from a busy one) and returns the sentences naming the ranks that
  // did not reach `seq`, are elsewhere, or are silent. Never throws.
  std::string diagnose(int64_t seq);

  // check_collectives: this rank's fingerprint of collective `seq`, and the check of every
  // rank's (world x kFingerprint values, rank-major): throws loom::Error naming this rank's
  // call and the first other rank's that differs.
  std::array<int64_t, kFingerprint> fingerprint(int64_t seq) const;
  void check_fingerprints(int64_t seq, const int64_t* all) const;

 private:
  struct Record {
    int64_t seq = 0;
    CollectiveCall call;
    std::chrono::steady_clock::time_point entered;
    bool finished = false;
  };
  const Record* find(int64_t seq) const;  // under mutex_; null once out of the ring
  std::string line_of(const Record& record) const;
  void post_loop();
  std::string first_diagnosis(int64_t seq);

  std::string group_;
  int rank_, world_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<TraceBoard> board_;

  mutable std::mutex mutex_;
  std::array<Record, kRing> ring_{};
  int64_t last_seq_ = 0;
  int64_t changes_ = 0;  // bumped by begin and finish: the poster posts when it moved

  std::mutex post_mutex_;  // the poster's stop flag and wake-up
  std::condition_variable wake_;
  bool stop_ = false;
  std::mutex board_mutex_;  // one board call at a time (the poster's and diagnose's)
  std::atomic<bool> board_failed_{false};  // set by the poster or diagnose after a failed call
  int64_t watchdog_reported_ = 0;
  std::mutex diagnose_mutex_;
  std::optional<std::string> diagnosis_;  // the first report, returned to later failures  // the poster's: the last blocking call it reported
  std::thread poster_;
};

}  // namespace loom
