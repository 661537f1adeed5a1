// PreloadSource: worker threads, the in-order hand-out, shutdown, and (CUDA builds) pinned host
// buffers copied to the device on a side stream. See Note [Preload order] in preload_source.h.
#include "preload_source.h"

#include <ATen/ATen.h>
#include <pthread.h>
#include <signal.h>

#ifdef LOOM_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "loom/error.h"

namespace loom::preload {

PreloadSource::PreloadSource(std::shared_ptr<const Dataset> dataset, SamplerOptions sampler,
                             PreloadOptions options)
    : dataset_(std::move(dataset)), sampler_(dataset_->size(), sampler),
      options_(options) {
  LOOM_INTERNAL_ASSERT(options_.num_workers >= 0 && options_.prefetch_factor >= 1,
                       "PreloadOptions were not validated");
}

PreloadSource::~PreloadSource() { stop_workers(); }

std::string PreloadSource::describe() const {
  return detail::cat(dataset_->describe(), ", preloaded by ", options_.num_workers,
                     " worker thread(s), ", options_.prefetch_factor, " batches each",
                     options_.persistent_workers ? ", persistent" : "",
                     options_.pin_memory && options_.device.is_cuda() ? ", pinned" : "");
}

int64_t PreloadSource::epoch_of(const DataPosition& position) const {
  // advance() rolls a finished epoch's position over first, so its epoch is the batch's.
  return sampler_.advance(position).epoch;
}

PreloadSource::Result PreloadSource::prepare(const Task& task, bool on_worker) {
  Result result;
  int64_t current = -1;
  try {
    std::vector<Sample> samples;
    samples.reserve(task.indices.size());
    for (int64_t index : task.indices) {
      // A stop request is honoured between samples, so shutdown waits for one sample at most.
      if (on_worker && stop_.load(std::memory_order_relaxed)) {
        result.stopped = true;
        return result;
      }
      current = index;
      samples.push_back(dataset_->get(index));
      samples.back().index = index;
    }
    current = -1;
    result.batch = collate(samples);
    // Counted here, on the host copy, so the trainer never syncs with a GPU to count them.
    result.batch.compute_host_stats();
#ifdef LOOM_WITH_CUDA
    if (options_.pin_memory && options_.device.is_cuda()) {
      // Page-locked copies, then an asynchronous copy on a side stream; the trainer's stream
      // waits for it when it takes the batch, so the copy overlaps compute.
      c10::cuda::CUDAGuard device_guard(options_.device);
      c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, options_.device.index());
      c10::cuda::CUDAStreamGuard stream_guard(side);
      result.batch = result.batch.pinned().to(options_.device, /*non_blocking=*/true);
      auto event = std::make_shared<at::cuda::CUDAEvent>();
      event->record(side);
      const c10::Device device = options_.device;
      result.on_take = [event, device](Batch& taken) {
        c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(device.index());
        event->block(compute);
        // The caching allocator must not hand these blocks out again while compute reads them.
        for (at::Tensor* t : {&taken.input_ids, &taken.labels, &taken.attention_mask,
                              &taken.token_type_ids})
          if (t->defined()) t->record_stream(compute);
      };
    }
#endif
  } catch (const std::exception& error) {
    result.error = error.what();
    result.failed_index = current;
  } catch (...) {
    result.error = "an exception that is not a std::exception";
    result.failed_index = current;
  }
  return result;
}

void PreloadSource::worker_loop() {
  // Signals (Ctrl-C) go to the main thread, whose handler decides; a worker never runs one.
  sigset_t block;
  sigemptyset(&block);
  sigaddset(&block, SIGINT);
  sigaddset(&block, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &block, nullptr);
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      task_ready_.wait(lock, [&] { return stop_.load() || !tasks_.empty(); });
      if (stop_.load()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    Result result = prepare(task, /*on_worker=*/true);
    if (result.stopped) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (task.generation != generation_) continue;  // seek() discarded it
      results_.emplace(task.sequence, std::move(result));
    }
    result_ready_.notify_all();
  }
}

void PreloadSource::start_workers() {
  stop_workers();
  stop_ = false;
  workers_epoch_ = epoch_of(position_);
  for (int64_t w = 0; w < options_.num_workers; ++w)
    workers_.emplace_back([this] { worker_loop(); });
}

void PreloadSource::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    ++generation_;
    tasks_.clear();
    results_.clear();
  }
  task_ready_.notify_all();
  result_ready_.notify_all();
  for (auto& thread : workers_) thread.join();
  workers_.clear();
  issued_ = position_;
  issued_sequence_ = next_sequence_;
}

void PreloadSource::refill() {
  const int64_t limit = options_.num_workers * options_.prefetch_factor;
  std::vector<Task> fresh;
  while (issued_sequence_ - next_sequence_ < limit) {
    // Note [Workers per epoch]: without persistent_workers nothing of the next epoch is
    // prepared by this epoch's workers (they end with it, as torch's DataLoader's do).
    if (!options_.persistent_workers && epoch_of(issued_) != workers_epoch_) break;
    fresh.push_back({issued_sequence_++, generation_, issued_, sampler_.batch_at(issued_)});
    issued_ = sampler_.advance(issued_);
  }
  if (fresh.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& task : fresh) tasks_.push_back(std::move(task));
  }
  task_ready_.notify_all();
}

Batch PreloadSource::next() {
  if (options_.num_workers == 0) {
    Result result = prepare({next_sequence_, generation_, position_, sampler_.batch_at(position_)},
                            /*on_worker=*/false);
    return take(std::move(result));
  }
  const bool epoch_changed = epoch_of(position_) != workers_epoch_;
  if (workers_.empty() || (!options_.persistent_workers && epoch_changed)) start_workers();
  refill();
  Result result;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    result_ready_.wait(lock, [&] { return results_.count(next_sequence_) > 0; });
    auto it = results_.find(next_sequence_);
    if (it->second.error.empty()) {
      result = std::move(it->second);
      results_.erase(it);
    } else {
      result = it->second;  // a failed batch stays failed, should the trainer ask again
    }
  }
  return take(std::move(result));
}

Batch PreloadSource::take(Result result) {
  if (!result.error.empty()) {
    // The batch stays failed: the trainer's position does not move past it.
    if (result.failed_index >= 0)
      throw DataError(detail::cat("sample ", result.failed_index, " of ", dataset_->describe(),
                                  " failed", options_.num_workers > 0 ? " in a [preload] worker thread" : "",
                                  ": ", result.error));
    throw DataError(detail::cat("[preload] could not make the batch at epoch ", position_.epoch,
                                ", sample ", position_.cursor, ": ", result.error));
  }
  if (result.on_take) result.on_take(result.batch);
  position_ = sampler_.advance(position_);
  ++next_sequence_;
  if (options_.num_workers > 0) refill();
  return std::move(result.batch);
}

void PreloadSource::seek(const DataPosition& position) {
  stop_workers();
  position_ = issued_ = position;
  next_sequence_ = issued_sequence_ = 0;
}

}  // namespace loom::preload
