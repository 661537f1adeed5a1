// The `mpi` Comm backend: Open MPI's non-blocking collectives on CPU tensors. Waits poll
// MPI_Test against a deadline, so a stalled peer is an error after the timeout, never a hang
// (and when a peer dies, mpirun ends the job with the dead rank's name).
//
// Note [MPI progress]: Open MPI moves a non-blocking collective forward only inside MPI calls
// (its progress engine runs when the process tests or waits), so a collective started during
// backward would sit still until the next MPI call, after backward: nothing overlapped. A
// progress thread tests every outstanding collective every ~50 us while any exists (and sleeps
// on a condition variable when none does). MPI runs in MPI_THREAD_SERIALIZED: one mutex
// serialises every MPI call of the process, the progress thread's included. wait() then only
// finds its collective done (and runs its finishing step on the caller's thread).
//
// Note [MPI counts]: MPI counts are `int`, tensors are not. A collective whose counts would
// pass max_count() elements (INT_MAX; LOOM_TEST_MPI_MAX_COUNT lowers it so tests can force
// this on small tensors) is split into pieces of at most that many elements, all started at
// once and held by one MpiWork: wait() waits for every piece against one deadline. Movement
// without reduction uses an unsigned integer type of the element's size, so counts are
// elements, not bytes.
#include <ATen/ATen.h>
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "comm_backends.h"
#include "comm_trace.h"
#include "loom/error.h"
#include "loom/log.h"

namespace loom {
namespace {

using Clock = std::chrono::steady_clock;

void check_mpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw Error(detail::cat("MPI ", what, " failed: ", std::string(text, length)));
}

// Every MPI call of the process holds this (MPI_THREAD_SERIALIZED; Note [MPI progress]).
std::mutex& mpi_mutex() {
  static std::mutex mutex;
  return mutex;
}

// The requests of one collective, shared between its MpiWork and the progress thread.
struct Pending {
  std::vector<MPI_Request> requests;
  std::atomic<bool> done{false};
  int error = MPI_SUCCESS;
};

// Tests every outstanding collective while any exists (Note [MPI progress]).
class ProgressThread {
 public:
  ProgressThread() : thread_([this] { loop(); }) {}
  ~ProgressThread() {
    {
      std::lock_guard<std::mutex> lock(queue_mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  void add(std::shared_ptr<Pending> pending) {
    {
      std::lock_guard<std::mutex> lock(queue_mutex_);
      pending_.push_back(std::move(pending));
    }
    wake_.notify_all();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(queue_mutex_);
    while (true) {
      wake_.wait(lock, [this] { return stop_ || !pending_.empty(); });
      if (stop_) return;
      std::list<std::shared_ptr<Pending>> batch(pending_.begin(), pending_.end());
      lock.unlock();
      {
        std::lock_guard<std::mutex> mpi(mpi_mutex());
        for (auto& p : batch) {
          if (p->done.load()) continue;
          int flag = 0;
          const int code = MPI_Testall(static_cast<int>(p->requests.size()), p->requests.data(),
                                       &flag, MPI_STATUSES_IGNORE);
          if (code != MPI_SUCCESS) p->error = code;
          if (flag || code != MPI_SUCCESS) p->done.store(true);
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      lock.lock();
      pending_.remove_if([](const std::shared_ptr<Pending>& p) { return p->done.load(); });
    }
  }

  std::mutex queue_mutex_;
  std::condition_variable wake_;
  std::list<std::shared_ptr<Pending>> pending_;
  bool stop_ = false;
  std::thread thread_;
};

// MPI is initialised once per process and finalised at exit (the progress thread first).
struct MpiRuntime {
  MpiRuntime() {
    int initialised = 0;
    MPI_Initialized(&initialised);
    if (!initialised) {
      int provided = 0;
      check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided),
                "MPI_Init_thread");
      LOOM_CHECK(provided >= MPI_THREAD_SERIALIZED, "this MPI library offers thread level ",
                 provided, ", below MPI_THREAD_SERIALIZED, which loom's progress thread needs");
      owned = true;
    }
    // Errors come back as codes (check_mpi) instead of aborting inside MPI.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    // LOOM_MPI_PROGRESS_THREAD=0 leaves progress to the waits (for comparisons).
    const char* env = std::getenv("LOOM_MPI_PROGRESS_THREAD");
    if (!env || std::string(env) != "0") progress = std::make_unique<ProgressThread>();
  }
  ~MpiRuntime() {
    progress.reset();
    int finalised = 0;
    MPI_Finalized(&finalised);
    // After a collective was abandoned (a peer stopped or died), MPI_Finalize would wait for
    // that peer forever; exiting without it makes mpirun end the whole job instead.
    if (owned && !finalised && !abandoned.load()) MPI_Finalize();
  }
  bool owned = false;
  std::atomic<bool> abandoned{false};  // a collective timed out (Note [Hang reports])
  std::unique_ptr<ProgressThread> progress;
};

MpiRuntime& runtime() {
  static MpiRuntime instance;
  return instance;
}

MPI_Datatype mpi_type(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kLong: return MPI_INT64_T;
    case at::kInt: return MPI_INT32_T;
    case at::kByte: return MPI_UINT8_T;
    case at::kChar: return MPI_INT8_T;
    case at::kBool: return MPI_C_BOOL;
    default: return MPI_DATATYPE_NULL;  // half types: reduced through an fp32 copy
  }
}

// Data movement without reduction: any dtype, as an integer type of its element size.
MPI_Datatype element_type(const at::Tensor& t) {
  switch (t.element_size()) {
    case 1: return MPI_UINT8_T;
    case 2: return MPI_UINT16_T;
    case 4: return MPI_UINT32_T;
    case 8: return MPI_UINT64_T;
  }
  throw Error(detail::cat("mpi: dtype ", t.scalar_type(), " (", t.element_size(),
                          " bytes) has no MPI element type; convert the tensor to a real dtype"));
}

// The most elements one MPI call is given (Note [MPI counts]).
int64_t max_count() {
  static const int64_t limit = [] {
    const char* text = std::getenv("LOOM_TEST_MPI_MAX_COUNT");
    if (!text || !*text) return static_cast<int64_t>(INT_MAX);
    char* end = nullptr;
    const long long value = std::strtoll(text, &end, 10);
    LOOM_CHECK_AS(ConfigError, *end == 0 && value >= 1 && value <= INT_MAX,
                  "LOOM_TEST_MPI_MAX_COUNT='", text, "' must be an integer in 1..", INT_MAX,
                  " (a test-only limit on elements per MPI call); unset it");
    return static_cast<int64_t>(value);
  }();
  return limit;
}

// Calls piece(offset, length) for consecutive pieces of [0, n) of at most max_count().
void for_pieces(int64_t n, const std::function<void(int64_t, int)>& piece) {
  const int64_t limit = max_count();
  for (int64_t offset = 0; offset < n; offset += limit)
    piece(offset, static_cast<int>(std::min(limit, n - offset)));
}

char* at_element(const at::Tensor& t, int64_t index) {
  return static_cast<char*>(t.data_ptr()) + index * static_cast<int64_t>(t.element_size());
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return MPI_SUM;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::min: return MPI_MIN;
  }
  return MPI_SUM;
}

class MpiWork final : public Work {
 public:
  MpiWork(std::vector<MPI_Request> requests, const char* op, int rank,
          std::chrono::milliseconds timeout, std::function<void()> finish,
          std::shared_ptr<CollectiveTrace> trace, int64_t seq, bool records_finish = true)
      : pending_(std::make_shared<Pending>()), op_(op), rank_(rank), timeout_(timeout),
        finish_(std::move(finish)), trace_(std::move(trace)), seq_(seq),
        records_finish_(records_finish) {
    pending_->requests = std::move(requests);
    if (runtime().progress) runtime().progress->add(pending_);
  }
  ~MpiWork() override {
    // A handle dropped unwaited must still complete before its buffers may be freed.
    if (!done_ && !abandoned_) {
      try {
        wait();
      } catch (...) {
      }
    }
  }
  void wait() override {
    if (done_ || abandoned_) return;
    // From the start, as c10d's works count: the collectives in flight at a hang (ddp's
    // buckets) then all expire together, not one timeout after another in their destructors.
    const auto deadline = started_ + timeout_;
    while (!completed()) {
      if (Clock::now() > deadline) {
        // Note [Hang reports]; the requests stay pending (MPI cannot cancel a collective), so
        // the destructor must not wait for them again.
        abandoned_ = true;
        runtime().abandoned = true;
        const std::string where = trace_->diagnose(seq_);
        throw Error(detail::cat("rank ", rank_, ": MPI ", trace_->describe(seq_), " of group ",
                                trace_->group(), " did not complete within ",
                                timeout_.count() / 1000.0, " s",
                                where.empty() ? "; a peer rank died or stalled" : where,
                                " (raise [distributed] timeout_seconds if a step legitimately "
                                "takes longer)"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  bool completed() override {
    if (done_) return true;
    if (!runtime().progress) {  // no progress thread: this test is what moves it forward
      std::lock_guard<std::mutex> mpi(mpi_mutex());
      int flag = 0;
      pending_->error = MPI_Testall(static_cast<int>(pending_->requests.size()),
                                    pending_->requests.data(), &flag, MPI_STATUSES_IGNORE);
      if (flag || pending_->error != MPI_SUCCESS) pending_->done.store(true);
    }
    if (!pending_->done.load()) return false;
    check_mpi(pending_->error, op_);
    done_ = true;
    if (records_finish_) trace_->finish(seq_);
    if (finish_) finish_();
    return true;
  }

 private:
  std::shared_ptr<Pending> pending_;
  const char* op_;
  int rank_;
  std::chrono::milliseconds timeout_;
  std::function<void()> finish_;
  std::shared_ptr<CollectiveTrace> trace_;
  int64_t seq_;
  bool records_finish_;
  Clock::time_point started_ = Clock::now();
  bool done_ = false, abandoned_ = false;
};

// The trace's board for mpi, which has no store: one file per rank, FOLDER/GROUP.RANK, written
// whole and renamed into place (a reader sees an old line or a new one, never half of one).
// The folder is the job's output_dir, which ZeRO's shards already require every rank to share;
// it is removed, file by file, when the Comm ends.
class FileBoard final : public TraceBoard {
 public:
  FileBoard(std::string folder, std::string group, int rank)
      : folder_(std::move(folder)), group_(std::move(group)), rank_(rank) {
    std::filesystem::create_directories(folder_);
  }
  ~FileBoard() override {
    std::error_code ignored;
    std::filesystem::remove(path(rank_), ignored);
    std::filesystem::remove(folder_, ignored);  // only once empty: the last rank's removes it
    std::filesystem::remove(std::filesystem::path(folder_).parent_path(), ignored);
  }
  void post(int rank, const std::string& line) override {
    const std::string final_path = path(rank), temporary = final_path + ".tmp";
    {
      std::ofstream out(temporary, std::ios::trunc);
      out << line;
      if (!out) throw Error(detail::cat("cannot write ", temporary));
    }
    if (std::rename(temporary.c_str(), final_path.c_str()) != 0)
      throw Error(detail::cat("cannot rename ", temporary, " to ", final_path));
  }
  std::optional<std::string> read(int rank) override {
    std::ifstream in(path(rank));
    if (!in) return std::nullopt;
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
  }
  std::string where() const override { return "the folder " + folder_; }

 private:
  std::string path(int rank) const { return detail::cat(folder_, "/", group_, ".", rank); }
  std::string folder_, group_;
  int rank_;
};

class MpiComm final : public Comm {
 public:
  MpiComm(const CommOptions& options, const CommChecks& checks)
      : timeout_(options.timeout), checks_(checks) {
    runtime();
    {
      std::lock_guard<std::mutex> mpi(mpi_mutex());
      init(MPI_COMM_WORLD);
      // One name per job for the trace's folder, rank 0's, so no rank reads a line a former
      // run left behind.
      int64_t job = rank_ == 0 ? static_cast<int64_t>(::getpid()) * 1000003 +
                                     Clock::now().time_since_epoch().count() % 1000003
                               : 0;
      check_mpi(MPI_Bcast(&job, 1, MPI_INT64_T, 0, comm_), "set-up");
      job_ = job;
    }
    trace_ = make_trace("world");
  }
  // A sub-group made by split (owned: freed with this Comm, while MPI still runs).
  MpiComm(MPI_Comm comm, std::chrono::milliseconds timeout, const CommChecks& checks,
          int64_t job, const std::string& group)
      : timeout_(timeout), owned_(true), checks_(checks), job_(job) {
    init(comm);
    trace_ = make_trace(group);
  }
  ~MpiComm() override {
    trace_.reset();  // its poster thread first
    if (!owned_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      std::lock_guard<std::mutex> mpi(mpi_mutex());
      MPI_Comm_free(&comm_);
    }
  }
  std::string backend() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  int local_rank() const override { return local_rank_; }
  int local_world_size() const override { return local_world_; }

  std::shared_ptr<Work> all_reduce(at::Tensor& tensor, ReduceOp op) override {
    check_tensor(tensor, "all_reduce");
    const int64_t seq =
        enter({"all_reduce", static_cast<int64_t>(op), tensor.numel(), tensor.scalar_type()});
    // Half types have no MPI reduction: reduce an fp32 copy and write it back.
    at::Tensor buffer = reducible(tensor);
    std::vector<MPI_Request> requests;
    std::lock_guard<std::mutex> mpi(mpi_mutex());
    for_pieces(buffer.numel(), [&](int64_t offset, int length) {
      check_mpi(MPI_Iallreduce(MPI_IN_PLACE, at_element(buffer, offset), length,
                               mpi_type(buffer.scalar_type()), mpi_op(op), comm_,
                               &requests.emplace_back()),
                "all_reduce");
    });
    const int world = world_;
    return std::make_shared<MpiWork>(std::move(requests), "all_reduce", rank_, timeout_,
                                     [tensor, buffer, op, world]() mutable {
                                       if (op == ReduceOp::avg) buffer.div_(world);
                                       if (!buffer.is_same(tensor)) tensor.copy_(buffer);
                                     },
                                     trace_, seq);
  }

  std::shared_ptr<Work> reduce_scatter(at::Tensor& output, const at::Tensor& input,
                                       ReduceOp op) override {
    check_tensor(output, "reduce_scatter");
    check_tensor(input, "reduce_scatter");
    LOOM_CHECK(input.numel() == output.numel() * world_, "reduce_scatter: input has ",
               input.numel(), " elements, needs world_size x output = ", output.numel() * world_);
    LOOM_CHECK(input.scalar_type() == output.scalar_type(), "reduce_scatter: output dtype ",
               output.scalar_type(), " differs from the input's ", input.scalar_type());
    const int64_t seq = enter(
        {"reduce_scatter", static_cast<int64_t>(op), input.numel(), input.scalar_type()});
    // Half types: reduce fp32 copies, as all_reduce does.
    const at::Tensor in = reducible(input);
    at::Tensor out = reducible(output);
    const MPI_Datatype type = mpi_type(in.scalar_type());
    const int64_t n = out.numel();
    std::vector<MPI_Request> requests;
    std::lock_guard<std::mutex> mpi(mpi_mutex());
    if (n * world_ <= max_count()) {
      // Open MPI's non-blocking reduce-scatter counts world x n in an int: both must fit.
      check_mpi(MPI_Ireduce_scatter_block(in.data_ptr(), out.data_ptr(), static_cast<int>(n),
                                          type, mpi_op(op), comm_,
                                          &requests.emplace_back()),
                "reduce_scatter");
    } else {
      // Too many for one call: rank r's chunk is reduced to r, piece by piece.
      for (int root = 0; root < world_; ++root)
        for_pieces(n, [&](int64_t offset, int length) {
          check_mpi(MPI_Ireduce(at_element(in, root * n + offset),
                                root == rank_ ? at_element(out, offset) : nullptr, length, type,
                                mpi_op(op), root, comm_, &requests.emplace_back()),
                    "reduce_scatter");
        });
    }
    const int world = world_;
    return std::make_shared<MpiWork>(std::move(requests), "reduce_scatter", rank_, timeout_,
                                     [output, out, in, op, world]() mutable {
                                       if (op == ReduceOp::avg) out.div_(world);
                                       if (!out.is_same(output)) output.copy_(out);
                                     },
                                     trace_, seq);
  }

  std::shared_ptr<Work> all_gather(at::Tensor& output, const at::Tensor& input) override {
    check_tensor(output, "all_gather");
    check_tensor(input, "all_gather");
    LOOM_CHECK(output.numel() == input.numel() * world_, "all_gather: output has ",
               output.numel(), " elements, needs world_size x input = ", input.numel() * world_);
    const int64_t seq = enter({"all_gather", -1, input.numel(), input.scalar_type()});
    const MPI_Datatype type = element_type(input);
    const int64_t n = input.numel();
    std::vector<MPI_Request> requests;
    std::lock_guard<std::mutex> mpi(mpi_mutex());
    if (n * world_ <= max_count()) {
      check_mpi(MPI_Iallgather(input.data_ptr(), static_cast<int>(n), type, output.data_ptr(),
                               static_cast<int>(n), type, comm_,
                               &requests.emplace_back()),
                "all_gather");
    } else {
      // Too many for one call: each rank broadcasts its chunk, piece by piece, from its slot.
      output.view(-1).narrow(0, rank_ * n, n).copy_(input.view(-1));
      for (int root = 0; root < world_; ++root)
        for_pieces(n, [&](int64_t offset, int length) {
          check_mpi(MPI_Ibcast(at_element(output, root * n + offset), length, type, root,
                               comm_, &requests.emplace_back()),
                    "all_gather");
        });
    }
    return std::make_shared<MpiWork>(std::move(requests), "all_gather", rank_, timeout_,
                                     [output, input] {}, trace_, seq);
  }

  std::shared_ptr<Work> broadcast(at::Tensor& tensor, int root) override {
    check_tensor(tensor, "broadcast");
    LOOM_CHECK(root >= 0 && root < world_, "broadcast root ", root, " is not a rank");
    const int64_t seq = enter({"broadcast", root, tensor.numel(), tensor.scalar_type()});
    const MPI_Datatype type = element_type(tensor);
    std::vector<MPI_Request> requests;
    std::lock_guard<std::mutex> mpi(mpi_mutex());
    for_pieces(tensor.numel(), [&](int64_t offset, int length) {
      check_mpi(MPI_Ibcast(at_element(tensor, offset), length, type, root, comm_,
                           &requests.emplace_back()),
                "broadcast");
    });
    return std::make_shared<MpiWork>(std::move(requests), "broadcast", rank_, timeout_,
                                     [tensor] {}, trace_, seq);
  }

  std::shared_ptr<Work> all_to_all(at::Tensor& output, const at::Tensor& input) override {
    check_tensor(output, "all_to_all");
    check_tensor(input, "all_to_all");
    LOOM_CHECK(input.numel() == output.numel() && input.numel() % world_ == 0,
               "all_to_all: input and output need the same numel, divisible by ", world_);
    const int64_t seq = enter({"all_to_all", -1, input.numel(), input.scalar_type()});
    const MPI_Datatype type = element_type(input);
    const int64_t chunk = input.numel() / world_;
    std::vector<MPI_Request> requests;
    std::lock_guard<std::mutex> mpi(mpi_mutex());
    if (input.numel() <= max_count()) {
      check_mpi(MPI_Ialltoall(input.data_ptr(), static_cast<int>(chunk), type, output.data_ptr(),
                              static_cast<int>(chunk), type, comm_,
                              &requests.emplace_back()),
                "all_to_all");
    } else {
      // Too many for one call: rank j gathers piece [offset, +length) of every rank's chunk j.
      // Its receive type spans one chunk, so rank r's piece lands at r x chunk + offset.
      for (int root = 0; root < world_; ++root)
        for_pieces(chunk, [&](int64_t offset, int length) {
          MPI_Datatype piece = MPI_DATATYPE_NULL, strided = MPI_DATATYPE_NULL;
          check_mpi(MPI_Type_contiguous(length, type, &piece), "all_to_all");
          check_mpi(MPI_Type_create_resized(piece, 0, chunk * input.element_size(), &strided),
                    "all_to_all");
          check_mpi(MPI_Type_commit(&strided), "all_to_all");
          check_mpi(MPI_Igather(at_element(input, root * chunk + offset), length, type,
                                at_element(output, offset), 1, strided, root, comm_,
                                &requests.emplace_back()),
                    "all_to_all");
          // Freed types live on until the operations that use them complete (MPI 3.1 4.1.9).
          MPI_Type_free(&strided);
          MPI_Type_free(&piece);
        });
    }
    return std::make_shared<MpiWork>(std::move(requests), "all_to_all", rank_, timeout_,
                                     [output, input] {}, trace_, seq);
  }

  std::shared_ptr<Work> all_to_all_rows(at::Tensor& output, const at::Tensor& input,
                                        const std::vector<int64_t>& send_rows,
                                        const std::vector<int64_t>& recv_rows) override {
    check_tensor(output, "all_to_all_rows");
    check_tensor(input, "all_to_all_rows");
    check_rows(output, input, send_rows, recv_rows, world_, "all_to_all_rows");
    const int64_t row = input.size(0) > 0 ? input.numel() / input.size(0)
                        : output.size(0) > 0 ? output.numel() / output.size(0) : 1;
    std::vector<int> send_counts(world_), send_at(world_), recv_counts(world_), recv_at(world_);
    int64_t sent = 0, received = 0;
    for (int j = 0; j < world_; ++j) {
      if ((sent + send_rows[j]) * row > max_count() || (received + recv_rows[j]) * row > max_count())
        return Comm::all_to_all_rows(output, input, send_rows, recv_rows);  // int counts overflow
      send_at[j] = static_cast<int>(sent * row);
      send_counts[j] = static_cast<int>(send_rows[j] * row);
      recv_at[j] = static_cast<int>(received * row);
      recv_counts[j] = static_cast<int>(recv_rows[j] * row);
      sent += send_rows[j];
      received += recv_rows[j];
    }
    const int64_t seq = enter({"all_to_all_rows", -1, -1, input.scalar_type()});
    const MPI_Datatype type = element_type(input);
    std::vector<MPI_Request> requests;
    std::lock_guard<std::mutex> mpi(mpi_mutex());
    check_mpi(MPI_Ialltoallv(input.data_ptr(), send_counts.data(), send_at.data(), type,
                             output.data_ptr(), recv_counts.data(), recv_at.data(), type, comm_,
                             &requests.emplace_back()),
              "all_to_all_rows");
    // The count arrays must outlive the non-blocking call (MPI 3.1 5.12): the finish holds them.
    auto counts = std::make_shared<std::vector<std::vector<int>>>(
        std::vector<std::vector<int>>{send_counts, send_at, recv_counts, recv_at});
    return std::make_shared<MpiWork>(std::move(requests), "all_to_all_rows", rank_, timeout_,
                                     [output, input, counts] {}, trace_, seq);
  }

  std::unique_ptr<Comm> split(int color, int key) override {
    // MPI_Comm_split blocks and cannot be timed out: the trace's watchdog reports it when it
    // outlasts the timeout (Note [Hang reports]), but only mpirun or the user can end it.
    const int64_t seq = enter({"split", -1, 0, c10::ScalarType::Undefined, true});
    MPI_Comm part = MPI_COMM_NULL;
    {
      std::lock_guard<std::mutex> mpi(mpi_mutex());
      check_mpi(MPI_Comm_split(comm_, color, key, &part), "split");
      MPI_Comm_set_errhandler(part, MPI_ERRORS_RETURN);
    }
    trace_->finish(seq);
    return std::make_unique<MpiComm>(part, timeout_, checks_, job_,
                                     detail::cat("split-", splits_++, "-color-", color));
  }

  void barrier() override {
    const int64_t seq = enter({"barrier", -1, 0, c10::ScalarType::Undefined});
    std::vector<MPI_Request> requests(1);
    {
      std::lock_guard<std::mutex> mpi(mpi_mutex());
      check_mpi(MPI_Ibarrier(comm_, requests.data()), "barrier");
    }
    MpiWork(std::move(requests), "barrier", rank_, timeout_, {}, trace_, seq).wait();
  }

 private:
  static void check_tensor(const at::Tensor& t, const char* op) {
    LOOM_CHECK(t.is_cpu() && t.is_contiguous(), "mpi ", op,
               " needs contiguous CPU tensors; use the nccl backend for CUDA tensors");
  }
  // The tensor itself where MPI can reduce its dtype, else an fp32 copy (bf16, fp16).
  static at::Tensor reducible(const at::Tensor& t) {
    return mpi_type(t.scalar_type()) == MPI_DATATYPE_NULL ? t.to(at::kFloat) : t;
  }

  std::shared_ptr<CollectiveTrace> make_trace(const std::string& group) {
    std::unique_ptr<TraceBoard> board;
    if (!checks_.trace_folder.empty() && world_ > 1) {
      try {
        board = std::make_unique<FileBoard>(
            detail::cat(checks_.trace_folder, "/.collective-trace/", job_), group, rank_);
      } catch (const std::exception& error) {
        log::warn("rank ", rank_, ": the collective trace cannot use ", checks_.trace_folder,
                  " (", error.what(), "); a hang report will not name the other ranks");
      }
    }
    return std::make_shared<CollectiveTrace>(group, rank_, world_, timeout_, std::move(board));
  }
  // Records a collective as it starts; with check_collectives, first compares every rank's
  // fingerprint of it (an all-gather, waited for against the timeout).
  int64_t enter(const CollectiveCall& call) {
    const int64_t seq = trace_->begin(call);
    if (!checks_.check_collectives || world_ < 2) return seq;
    const auto mine = trace_->fingerprint(seq);
    std::vector<int64_t> all(static_cast<size_t>(CollectiveTrace::kFingerprint) * world_);
    std::vector<MPI_Request> requests(1);
    {
      std::lock_guard<std::mutex> mpi(mpi_mutex());
      check_mpi(MPI_Iallgather(mine.data(), CollectiveTrace::kFingerprint, MPI_INT64_T,
                               all.data(), CollectiveTrace::kFingerprint, MPI_INT64_T, comm_,
                               requests.data()),
                "check_collectives");
    }
    // A timeout here is reported as collective `seq`'s, which is not finished by the check.
    MpiWork(std::move(requests), "check_collectives", rank_, timeout_, {}, trace_, seq,
            /*records_finish=*/false).wait();
    trace_->check_fingerprints(seq, all.data());
    return seq;
  }

  void init(MPI_Comm comm) {
    comm_ = comm;
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &world_);
    MPI_Comm local;
    MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local);
    MPI_Comm_rank(local, &local_rank_);
    MPI_Comm_size(local, &local_world_);
    MPI_Comm_free(&local);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, world_ = 1, local_rank_ = 0, local_world_ = 1;
  std::chrono::milliseconds timeout_;
  bool owned_ = false;
  CommChecks checks_;
  int64_t job_ = 0;
  int splits_ = 0;
  std::shared_ptr<CollectiveTrace> trace_;
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm(const CommOptions& options, const CommChecks& checks) {
  return std::make_unique<MpiComm>(options, checks);
}

}  // namespace loom
