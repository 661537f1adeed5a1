// The `mpi` Comm backend: Open MPI's non-blocking collectives on CPU tensors. Waits poll
// MPI_Test against a deadline, so a stalled peer is an error after the timeout, never a hang
// (and when a peer dies, mpirun ends the job with the dead rank's name).
#include <ATen/ATen.h>
#include <mpi.h>

#include <chrono>
#include <functional>
#include <thread>

#include "comm_backends.h"
#include "loom/error.h"

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

// MPI is initialised once per process and finalised at exit.
struct MpiRuntime {
  MpiRuntime() {
    int initialised = 0;
    MPI_Initialized(&initialised);
    if (!initialised) {
      int provided = 0;
      check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided),
                "MPI_Init_thread");
      owned = true;
    }
    // Errors come back as codes (check_mpi) instead of aborting inside MPI.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  }
  ~MpiRuntime() {
    int finalised = 0;
    MPI_Finalized(&finalised);
    if (owned && !finalised) MPI_Finalize();
  }
  bool owned = false;
};

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
  MpiWork(MPI_Request request, const char* op, int rank, std::chrono::milliseconds timeout,
          std::function<void()> finish)
      : request_(request), op_(op), rank_(rank), timeout_(timeout), finish_(std::move(finish)) {}
  ~MpiWork() override {
    // A handle dropped unwaited must still complete before its buffers may be freed.
    if (!done_) {
      try {
        wait();
      } catch (...) {
      }
    }
  }
  void wait() override {
    if (done_) return;
    const auto deadline = Clock::now() + timeout_;
    int flag = 0;
    while (true) {
      check_mpi(MPI_Test(&request_, &flag, MPI_STATUS_IGNORE), op_);
      if (flag) break;
      if (Clock::now() > deadline)
        throw Error(detail::cat("rank ", rank_, ": MPI ", op_, " did not complete within ",
                                timeout_.count() / 1000.0,
                                " s; a peer rank died or stalled (raise [distributed] "
                                "timeout_seconds if a step legitimately takes longer)"));
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    done_ = true;
    if (finish_) finish_();
  }
  bool completed() override {
    if (done_) return true;
    int flag = 0;
    check_mpi(MPI_Test(&request_, &flag, MPI_STATUS_IGNORE), op_);
    if (flag) {
      done_ = true;
      if (finish_) finish_();
    }
    return done_;
  }

 private:
  MPI_Request request_;
  const char* op_;
  int rank_;
  std::chrono::milliseconds timeout_;
  std::function<void()> finish_;
  bool done_ = false;
};

class MpiComm final : public Comm {
 public:
  explicit MpiComm(const CommOptions& options) : timeout_(options.timeout) {
    static MpiRuntime runtime;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &world_);
    MPI_Comm local;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local);
    MPI_Comm_rank(local, &local_rank_);
    MPI_Comm_size(local, &local_world_);
    MPI_Comm_free(&local);
  }
  std::string backend() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  int local_rank() const override { return local_rank_; }
  int local_world_size() const override { return local_world_; }

  std::shared_ptr<Work> all_reduce(at::Tensor& tensor, ReduceOp op) override {
    check_tensor(tensor, "all_reduce");
    // Half types have no MPI reduction: reduce an fp32 copy and write it back.
    at::Tensor buffer = mpi_type(tensor.scalar_type()) == MPI_DATATYPE_NULL
                            ? tensor.to(at::kFloat)
                            : tensor;
    MPI_Request request;
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buffer.data_ptr(), static_cast<int>(buffer.numel()),
                             mpi_type(buffer.scalar_type()), mpi_op(op), MPI_COMM_WORLD,
                             &request),
              "all_reduce");
    const int world = world_;
    return std::make_shared<MpiWork>(request, "all_reduce", rank_, timeout_,
                                     [tensor, buffer, op, world]() mutable {
                                       if (op == ReduceOp::avg) buffer.div_(world);
                                       if (!buffer.is_same(tensor)) tensor.copy_(buffer);
                                     });
  }

  std::shared_ptr<Work> reduce_scatter(at::Tensor& output, const at::Tensor& input,
                                       ReduceOp op) override {
    check_tensor(output, "reduce_scatter");
    check_tensor(input, "reduce_scatter");
    LOOM_CHECK(input.numel() == output.numel() * world_, "reduce_scatter: input has ",
               input.numel(), " elements, needs world_size x output = ", output.numel() * world_);
    LOOM_CHECK(mpi_type(input.scalar_type()) != MPI_DATATYPE_NULL,
               "reduce_scatter: dtype ", input.scalar_type(), " has no MPI type; use fp32");
    MPI_Request request;
    check_mpi(MPI_Ireduce_scatter_block(input.data_ptr(), output.data_ptr(),
                                        static_cast<int>(output.numel()),
                                        mpi_type(input.scalar_type()), mpi_op(op),
                                        MPI_COMM_WORLD, &request),
              "reduce_scatter");
    const int world = world_;
    return std::make_shared<MpiWork>(request, "reduce_scatter", rank_, timeout_,
                                     [output, input, op, world]() mutable {
                                       if (op == ReduceOp::avg) output.div_(world);
                                     });
  }

  std::shared_ptr<Work> all_gather(at::Tensor& output, const at::Tensor& input) override {
    check_tensor(output, "all_gather");
    check_tensor(input, "all_gather");
    LOOM_CHECK(output.numel() == input.numel() * world_, "all_gather: output has ",
               output.numel(), " elements, needs world_size x input = ", input.numel() * world_);
    MPI_Datatype type = byte_view(input);
    MPI_Request request;
    check_mpi(MPI_Iallgather(input.data_ptr(), count(input, type), type, output.data_ptr(),
                             count(input, type), type, MPI_COMM_WORLD, &request),
              "all_gather");
    return std::make_shared<MpiWork>(request, "all_gather", rank_, timeout_,
                                     [output, input] {});
  }

  std::shared_ptr<Work> broadcast(at::Tensor& tensor, int root) override {
    check_tensor(tensor, "broadcast");
    LOOM_CHECK(root >= 0 && root < world_, "broadcast root ", root, " is not a rank");
    MPI_Datatype type = byte_view(tensor);
    MPI_Request request;
    check_mpi(MPI_Ibcast(tensor.data_ptr(), count(tensor, type), type, root, MPI_COMM_WORLD,
                         &request),
              "broadcast");
    return std::make_shared<MpiWork>(request, "broadcast", rank_, timeout_, [tensor] {});
  }

  std::shared_ptr<Work> all_to_all(at::Tensor& output, const at::Tensor& input) override {
    check_tensor(output, "all_to_all");
    check_tensor(input, "all_to_all");
    LOOM_CHECK(input.numel() == output.numel() && input.numel() % world_ == 0,
               "all_to_all: input and output need the same numel, divisible by ", world_);
    MPI_Datatype type = byte_view(input);
    const int chunk = count(input, type) / world_;
    MPI_Request request;
    check_mpi(MPI_Ialltoall(input.data_ptr(), chunk, type, output.data_ptr(), chunk, type,
                            MPI_COMM_WORLD, &request),
              "all_to_all");
    return std::make_shared<MpiWork>(request, "all_to_all", rank_, timeout_,
                                     [output, input] {});
  }

  void barrier() override {
    MPI_Request request;
    check_mpi(MPI_Ibarrier(MPI_COMM_WORLD, &request), "barrier");
    MpiWork(request, "barrier", rank_, timeout_, {}).wait();
  }

 private:
  static void check_tensor(const at::Tensor& t, const char* op) {
    LOOM_CHECK(t.is_cpu() && t.is_contiguous(), "mpi ", op,
               " needs contiguous CPU tensors; use the nccl backend for CUDA tensors");
  }
  // Data movement without reduction works on raw bytes, whatever the dtype.
  static MPI_Datatype byte_view(const at::Tensor&) { return MPI_BYTE; }
  static int count(const at::Tensor& t, MPI_Datatype) {
    return static_cast<int>(t.numel() * t.element_size());
  }

  int rank_ = 0, world_ = 1, local_rank_ = 0, local_world_ = 1;
  std::chrono::milliseconds timeout_;
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm(const CommOptions& options) {
  return std::make_unique<MpiComm>(options);
}

}  // namespace loom
