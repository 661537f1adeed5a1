// loom/offload/copy_stream.h — the two pieces an offloaded update overlaps with: a worker thread
// that runs the host's share (copies landing, the CPU update) in order, and the copies between
// a device and host memory on a side stream. Not a scheduler: the drivers decide what to post.
//
// Note [One code for the GPU and its twin]: an offloaded GPU run copies gradients device to
// host and weights host to device on a side stream, ordered by events, while the CPU updates
// what has landed; a CPU run of the same code (the twin, tested in CI) does the copies as
// memcpy on the worker thread, in the same order, through the same calls. So the logic the
// twin tests — what lands when, what waits for what, bitwise results — is the GPU's; the GPU
// only adds the streams. CopyStream::start returns a `landed` function either way: on the
// GPU it waits for the copy's event (and keeps the source alive until then, so the caching
// allocator cannot hand its bytes to a later kernel while the copy still reads them), on the
// CPU it is the copy itself. A weight's copy back to the device, started on the worker
// thread, needs no wait on the compute stream: its update began only after its gradient's copy
// landed, which the side stream ran after every kernel that read the weight in this backward;
// start() still makes it wait for the worker thread's current stream (the device's default
// stream), which costs a little overlap where the compute stream is that stream, nothing more.
// A copy whose reader is a kernel, not the host (stage 3's weight shard fetched for its gather,
// Note [Offloaded parameters] in loom/sharding/shard_file.h), is started with start_for_stream:
// the reader's stream waits for the copy's event on the device, and the host never blocks on it.
// The CUDA half uses only device-generic c10 (c10::Stream,
// c10::Event, the CUDA guard behind c10::impl::VirtualGuardImpl), since libloom_offload links
// LibTorch's CPU half only (Note [CUDA loaded on demand]); its GPU tests pass on an H200.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace c10 {
struct Event;
}

#pragma GCC visibility push(default)

namespace loom::offload {

// One thread running posted tasks in order (the offload's I/O thread). A task's exception is
// kept and rethrown by the next wait(); the tasks after it still run, each its own.
class WorkerThread {
 public:
  WorkerThread();
  ~WorkerThread();  // runs what is posted, then joins; an error left unwaited is dropped
  WorkerThread(const WorkerThread&) = delete;
  WorkerThread& operator=(const WorkerThread&) = delete;

  void post(std::function<void()> task);
  // Blocks until every task posted so far has run; rethrows the first error since the last
  // wait.
  void wait();
  // Seconds the caller spent blocked in wait() since the last reset (work not hidden).
  double waited_seconds() const { return waited_seconds_; }
  void reset_waited() { waited_seconds_ = 0; }

 private:
  void run();
  std::mutex mutex_;
  std::condition_variable work_, idle_;
  std::deque<std::function<void()>> tasks_;
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
  double waited_seconds_ = 0;
  std::thread thread_;
};

// Note [One code for the GPU and its twin]: copies between `device`'s memory and host memory.
class CopyStream {
 public:
  explicit CopyStream(c10::Device device);
  ~CopyStream();
  bool on_device() const { return device_.is_cuda(); }

  // Starts dst.copy_(src) (same numel; dst may differ in dtype only where both are on the
  // host). On a GPU the copy is queued on the side stream after everything the calling
  // thread's current stream has queued so far (non_blocking: dst or src page-locked); on the
  // CPU nothing happens yet. Call the returned function (on any thread) before reading dst:
  // it waits for the copy, or on the CPU makes it.
  std::function<void()> start(const at::Tensor& dst, const at::Tensor& src);
  // As start(), but the returned function, called on the thread that will read dst, makes that
  // thread's current stream wait for the copy on the device (the host goes on: no sync); on the
  // CPU it makes the copy, as start()'s does. It holds src: keep it until the host knows the
  // copy is done (a later host read of the current stream's results), then drop it.
  std::function<void()> start_for_stream(const at::Tensor& dst, const at::Tensor& src);
  // On a GPU, the calling thread's current stream waits (on the device, not the host) for
  // every copy queued on the side stream so far: the next forward reads the copied weights.
  void join_current_stream();

  struct Streams;

 private:
  // Queues the copy on the side stream after the calling thread's current stream; its event.
  std::shared_ptr<c10::Event> enqueue(const at::Tensor& dst, const at::Tensor& src);
  c10::Device device_;
  std::unique_ptr<Streams> streams_;  // CUDA only
};

}  // namespace loom::offload

#pragma GCC visibility pop
