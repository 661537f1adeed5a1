// loom/comm.h — collective communication between ranks, behind one interface.
// Backends: `local` (one rank; here), `mpi`, `gloo`, `nccl` (the multi-process issue). Every
// collective may run asynchronously and returns a Work handle; every wait has a timeout, and a
// dead peer is an error naming the rank, never a hang.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom {

enum class ReduceOp { sum, avg, max, min };

// Note [Work semantics] — the same on every backend unless said otherwise:
// - A collective's buffers (its input and output) must stay untouched by the caller until its
//   handle is waited for (or says completed()); the handle keeps them alive meanwhile.
// - wait() returns once the result is in the output as the caller's next operation sees it:
//   on CPU backends (local, mpi, gloo) the host blocks until the data is there, and the
//   finishing step (avg's divide, a half-type copy back, gloo's reduce-scatter reduction) has
//   run. On nccl it is stream-ordered: the current CUDA stream waits for the collective and
//   the finishing step is queued on it; the host may return before the GPU is done, so
//   anything reading the output on another stream or on the host synchronises that stream.
// - wait() throws loom::Error naming the rank and the operation when the collective fails or
//   does not finish within the timeout (CommOptions::timeout; on nccl, ProcessGroupNCCL's
//   watchdog enforces it); a wait() after success returns at once. On mpi, gloo and nccl the
//   error also says where the other ranks are: the ones that did not reach the collective,
//   called another, or went silent (Note [Hang reports] in core/src/comm_trace.cpp).
// - completed() never blocks; true means wait() would return at once (it has then run the
//   finishing step).
// - A handle destroyed unwaited waits in its destructor, so its result still lands; its error,
//   if any, is lost: wait() is where errors surface.
// - Handles are not thread-safe: wait on a handle from one thread at a time. Collectives must
//   be started in the same order on every rank (each backend's own rule).
class Work {
 public:
  virtual ~Work();
  virtual void wait() = 0;  // throws loom::Error on failure or timeout
  virtual bool completed() = 0;
};

struct CommOptions {
  // auto: one process -> local; several: nccl for CUDA jobs, mpi under mpirun, else gloo.
  std::string backend = "auto";
  bool cuda = false;  // the job trains on CUDA devices
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

class Comm {
 public:
  virtual ~Comm();
  virtual std::string backend() const = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual int local_rank() const = 0;
  virtual int local_world_size() const = 0;
  // Where the tensors of this backend's collectives must live: the CPU for local, mpi and gloo;
  // this rank's current CUDA device for nccl. Callers put small scalars (target counts, loss
  // sums, overflow flags) there, so no backend ever sees a tensor on the wrong device.
  virtual c10::Device device() const;

  // In place on `tensor`.
  virtual std::shared_ptr<Work> all_reduce(at::Tensor& tensor, ReduceOp op) = 0;
  // input (world*n) -> output (n), same dtype: output = reduce(input's rank-th chunk over
  // ranks). Each rank sends about (world-1)/world of its input: half an all-reduce's traffic.
  virtual std::shared_ptr<Work> reduce_scatter(at::Tensor& output, const at::Tensor& input,
                                               ReduceOp op) = 0;
  // input (n) -> output (world*n), rank r's input at chunk r.
  virtual std::shared_ptr<Work> all_gather(at::Tensor& output, const at::Tensor& input) = 0;
  virtual std::shared_ptr<Work> broadcast(at::Tensor& tensor, int root) = 0;
  // input (world*n): chunk j goes to rank j; output (world*n): chunk j came from rank j.
  virtual std::shared_ptr<Work> all_to_all(at::Tensor& output, const at::Tensor& input) = 0;
  // Uneven all-to-all along dim 0 (MoE dispatch): input's first send_rows[0] rows go to rank 0,
  // the next send_rows[1] to rank 1, ...; output receives recv_rows[j] rows from rank j, in rank
  // order. Rows are input.numel() / input.size(0) elements; output has sum(recv_rows) rows of
  // the same size and dtype. recv_rows[j] must equal rank j's send_rows[rank()] (exchange the
  // counts first, e.g. with all_to_all).
  virtual std::shared_ptr<Work> all_to_all_rows(at::Tensor& output, const at::Tensor& input,
                                                const std::vector<int64_t>& send_rows,
                                                const std::vector<int64_t>& recv_rows);
  virtual void barrier() = 0;
  // Collective over this Comm: the ranks passing the same `color` form a new Comm of their own,
  // ranked by (key, rank). It shares this Comm's backend and timeout and lives independently of
  // it. Every rank must call split in the same order with the other collectives.
  virtual std::unique_ptr<Comm> split(int color, int key);
};

// Backends register a factory by name; "local" is built in. The multi-process issue adds
// mpi / gloo / nccl here without touching the engine.
using CommFactory = std::function<std::unique_ptr<Comm>(const CommOptions&)>;
void register_comm_backend(const std::string& name, CommFactory factory);
std::unique_ptr<Comm> make_comm(const CommOptions& options);

}  // namespace loom

#pragma GCC visibility pop
