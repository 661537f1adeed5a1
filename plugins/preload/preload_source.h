// PreloadSource: a DataSource that prepares the coming batches on worker threads while the
// trainer computes, and hands them out in the sampler's order. Not a sampler: which samples
// form which batch, and the data position in checkpoints, are exactly the wrapped source's.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "loom/data.h"

namespace loom::preload {

struct PreloadOptions {
  int64_t num_workers = 2;         // threads; 0 = prepare on the calling thread
  int64_t prefetch_factor = 2;     // batches in flight per worker
  bool persistent_workers = false; // false: workers end with each epoch, new ones start the next
  bool pin_memory = true;          // CUDA device: page-locked buffers + copy on a side stream
  c10::Device device{c10::kCPU};   // where the trainer computes
};

// Note [Preload order]: only the calling thread touches the sampler. It hands batch k's sample
// indices to the workers as task k and takes results back strictly by k, so the stream is the
// wrapped source's for any number of workers; position() is the next batch the *trainer* gets,
// never what the workers have prefetched, so a checkpoint resumes exactly.
class PreloadSource final : public DataSource {
 public:
  PreloadSource(std::shared_ptr<const Dataset> dataset, SamplerOptions sampler,
                PreloadOptions options);
  ~PreloadSource() override;  // stops and joins the workers (mid-batch too)

  Batch next() override;
  DataPosition position() const override { return position_; }
  void seek(const DataPosition& position) override;
  const Sampler& sampler() const override { return sampler_; }
  std::string describe() const override;

  int64_t live_workers() const { return static_cast<int64_t>(workers_.size()); }

 private:
  struct Task {
    int64_t sequence;
    uint64_t generation;
    DataPosition position;
    std::vector<int64_t> indices;
  };
  struct Result {
    Batch batch;
    std::string error;  // non-empty: the batch failed
    int64_t failed_index = -1;  // the sample that failed, when one did
    std::function<void(Batch&)> on_take;  // run by the trainer's thread as it takes the batch
    bool stopped = false;  // the worker was told to stop half-way
  };

  // On a worker (or on the caller with 0 workers); never throws: failures go into the Result.
  Result prepare(const Task& task, bool on_worker);
  void start_workers();
  void stop_workers();
  void worker_loop();
  Batch take(Result result);  // hand a result to the trainer, or throw its error
  void refill();  // issue tasks up to the prefetch limit
  int64_t epoch_of(const DataPosition& position) const;

  std::shared_ptr<const Dataset> dataset_;
  Sampler sampler_;
  PreloadOptions options_;
  DataPosition position_;  // of the next batch next() returns
  DataPosition issued_;    // of the next batch to hand to a worker
  int64_t next_sequence_ = 0, issued_sequence_ = 0;
  int64_t workers_epoch_ = -1;

  std::mutex mutex_;
  std::condition_variable task_ready_, result_ready_;
  std::deque<Task> tasks_;
  std::map<int64_t, Result> results_;
  uint64_t generation_ = 0;  // bumped by seek/stop: older tasks' results are dropped
  std::atomic<bool> stop_{false};
  std::vector<std::thread> workers_;
};

}  // namespace loom::preload
