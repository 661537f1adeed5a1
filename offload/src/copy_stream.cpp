// The offload's worker thread and its device copies. See loom/offload/copy_stream.h and Note
// [One code for the GPU and its twin] there.
#include "loom/offload/copy_stream.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <chrono>

#include "loom/error.h"

namespace loom::offload {

WorkerThread::WorkerThread() : thread_([this] { run(); }) {}

WorkerThread::~WorkerThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_.notify_one();
  thread_.join();
}

void WorkerThread::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
  }
  work_.notify_one();
}

void WorkerThread::wait() {
  const auto started = std::chrono::steady_clock::now();
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [&] { return tasks_.empty() && !busy_; });
    std::swap(error, error_);
  }
  waited_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (error) std::rethrow_exception(error);
}

void WorkerThread::run() {
  at::NoGradGuard no_grad;  // the thread's own grad mode: updates and copies record no graph
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    work_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stop_, and everything posted has run
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    busy_ = true;
    lock.unlock();
    try {
      task();
    } catch (...) {
      std::lock_guard<std::mutex> error_lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    task = nullptr;  // what it held (a device gradient) is released before the next wait ends
    lock.lock();
    busy_ = false;
    if (tasks_.empty()) idle_.notify_all();
  }
}

// The side stream and the guard that reaches CUDA without linking it.
struct CopyStream::Streams {
  explicit Streams(c10::Device device)
      : guard(c10::DeviceType::CUDA), side(guard.getStreamFromGlobalPool(device, false)) {}
  c10::impl::VirtualGuardImpl guard;
  c10::Stream side;
};

CopyStream::CopyStream(c10::Device device) : device_(device) {
  LOOM_INTERNAL_ASSERT(device.is_cpu() || device.is_cuda(), "offload copies between host memory "
                       "and a CUDA device, not ", device.str());
  if (device.is_cuda()) {
    if (!device.has_index()) device_ = c10::Device(c10::DeviceType::CUDA, 0);
    streams_ = std::make_unique<Streams>(device_);
  }
}

CopyStream::~CopyStream() = default;

std::function<void()> CopyStream::start(const at::Tensor& dst, const at::Tensor& src) {
  LOOM_INTERNAL_ASSERT(dst.numel() == src.numel(), "a copy between tensors of ", dst.numel(),
                       " and ", src.numel(), " elements");
  if (!streams_)
    return [dst, src] { dst.view(-1).copy_(src.reshape(-1)); };
  // `src` rides along until the copy is done: freed earlier, the caching allocator could give
  // its bytes to the compute stream's next kernel while the side stream still reads them.
  return [queued = enqueue(dst, src), src] { queued->synchronize(); };
}

std::function<void()> CopyStream::start_for_stream(const at::Tensor& dst, const at::Tensor& src) {
  LOOM_INTERNAL_ASSERT(dst.numel() == src.numel(), "a copy between tensors of ", dst.numel(),
                       " and ", src.numel(), " elements");
  if (!streams_)
    return [dst, src] { dst.view(-1).copy_(src.reshape(-1)); };
  return [this, queued = enqueue(dst, src), src] {
    queued->block(streams_->guard.getStream(device_));
  };
}

std::shared_ptr<c10::Event> CopyStream::enqueue(const at::Tensor& dst, const at::Tensor& src) {
  // The copy reads what the current stream wrote (a gradient's accumulation, a weight
  // already staged on the host): the side stream waits for it on the device.
  const c10::Stream current = streams_->guard.getStream(device_);
  auto queued = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
  c10::Event ready(c10::DeviceType::CUDA);
  ready.record(current);
  ready.block(streams_->side);
  c10::StreamGuard on_side(streams_->side);
  dst.view(-1).copy_(src.reshape(-1), /*non_blocking=*/true);
  queued->record(streams_->side);
  return queued;
}

void CopyStream::join_current_stream() {
  if (!streams_) return;
  c10::Event copied(c10::DeviceType::CUDA);
  copied.record(streams_->side);
  copied.block(streams_->guard.getStream(device_));
}

}  // namespace loom::offload
