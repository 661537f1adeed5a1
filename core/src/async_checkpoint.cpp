// Note [Asynchronous checkpoints] (async_checkpoint.h).
#include "async_checkpoint.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>

#include "loom/comm.h"
#include "loom/error.h"
#include "loom/log.h"

namespace loom {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Copies into host buffers, reusing the previous save's by position.
class HostCopier {
 public:
  explicit HostCopier(std::vector<at::Tensor>& buffers) : buffers_(buffers) {}

  at::Tensor operator()(const at::Tensor& source) {
    if (!source.defined()) return source;
    const bool from_gpu = !source.is_cpu();
    if (from_gpu) device_ = source.device();
    at::Tensor buffer;
    if (next_ < buffers_.size() && buffers_[next_].sizes() == source.sizes() &&
        buffers_[next_].scalar_type() == source.scalar_type()) {
      buffer = buffers_[next_];
    } else {
      // Page-locked for a GPU tensor: the copy then runs asynchronously, at the bus's speed.
      buffer = at::empty(source.sizes(), at::TensorOptions()
                                             .dtype(source.scalar_type())
                                             .pinned_memory(from_gpu));
      if (next_ < buffers_.size()) buffers_[next_] = buffer;
      else buffers_.push_back(buffer);
    }
    ++next_;
    buffer.copy_(source.detach(), /*non_blocking=*/from_gpu);
    return buffer;
  }

  // The GPU copies are queued on the current stream: done when it is.
  void wait() {
    if (!device_) return;
    c10::impl::VirtualGuardImpl guard(device_->type());
    guard.getStream(*device_).synchronize();
  }

 private:
  std::vector<at::Tensor>& buffers_;
  size_t next_ = 0;
  std::optional<c10::Device> device_;
};

// Every tensor a host copy holds, in one order (host_copy's and prepare's, so the buffers
// prepare makes sit where host_copy looks for them); streamed pieces are read, not copied.
template <typename Visit>
void for_each_copied(CheckpointContents& c, Visit&& visit) {
  for (auto& [name, tensor] : c.model) visit(tensor);
  for (auto& piece : c.optimizer)
    if (!piece.load) visit(piece.tensor);
  visit(c.rng_cpu);
  visit(c.rng_device);
  for (auto& [stem, tensors] : c.plugin.files)
    for (auto& [name, tensor] : tensors) visit(tensor);
}

}  // namespace

CheckpointContents host_copy(const CheckpointContents& live, std::vector<at::Tensor>& buffers) {
  at::NoGradGuard no_grad;
  HostCopier copy(buffers);
  CheckpointContents out = live;  // the numbers and names; every tensor replaced below
  for_each_copied(out, [&copy](at::Tensor& tensor) { tensor = copy(tensor); });
  for (auto& piece : out.optimizer) {
    if (!piece.load) continue;
    // Offloaded state: read now, while the file holds this step's values.
    piece.tensor = piece.load();
    piece.load = {};
  }
  copy.wait();
  return out;
}

AsyncCheckpointer::AsyncCheckpointer(std::string output_dir, Comm& comm)
    : output_dir_(std::move(output_dir)), comm_(comm) {}

AsyncCheckpointer::~AsyncCheckpointer() { abandon(); }

int64_t AsyncCheckpointer::step() const { return writer_ ? writer_->step() : -1; }

void AsyncCheckpointer::prepare(CheckpointContents shapes) {
  if (prepared_ || writer_) return;
  prepared_ = true;
  struct Spec {
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
    bool pinned;
  };
  std::vector<Spec> specs;
  for_each_copied(shapes, [&specs](at::Tensor& t) {
    if (t.defined()) specs.push_back({t.sizes().vec(), t.scalar_type(), !t.is_cpu()});
  });
  thread_ = std::thread([this, specs = std::move(specs)] {
    try {
      std::vector<at::Tensor> made;
      for (const Spec& spec : specs) {
        at::Tensor buffer = at::empty(
            spec.sizes, at::TensorOptions().dtype(spec.dtype).pinned_memory(spec.pinned));
        // Touched here, so the save step's copy finds its pages mapped (a first touch costs
        // more than the copy itself). memset, not zero_(): no ATen thread team on this thread.
        if (buffer.nbytes() > 0) std::memset(buffer.data_ptr(), 0, buffer.nbytes());
        made.push_back(std::move(buffer));
      }
      buffers_ = std::move(made);
    } catch (...) {
      // No memory to spare now: the first save allocates its buffers itself.
    }
  });
}

void AsyncCheckpointer::start(const CheckpointContents& live, int64_t keep, int64_t protect_step) {
  LOOM_INTERNAL_ASSERT(!writer_, "an asynchronous save started while checkpoint-", step(),
                       " is still in flight");
  const auto start = Clock::now();
  join();  // prepare's thread, if it is still touching the buffers
  prepared_ = true;
  copy_ = host_copy(live, buffers_);
  keep_ = keep;
  protect_step_ = protect_step;
  writer_ = std::make_unique<CheckpointWriter>(output_dir_, copy_, comm_);  // phase 1
  written_.store(false, std::memory_order_release);
  // Tests hold the writer between its files and the commit, to kill a run there (a folder of
  // whole files and no manifest) and to see a save step wait for the previous save.
  int delay_ms = 0;
  if (const char* delay = std::getenv("LOOM_TEST_ASYNC_SAVE_DELAY_MS")) delay_ms = std::atoi(delay);
  CheckpointWriter* writer = writer_.get();
  thread_ = std::thread([this, writer, delay_ms] {
    const auto began = Clock::now();
    try {
      writer->write_files();  // keeps its failures (every std::exception) for the commit
    } catch (...) {
      // Nothing else is thrown by its writes; a thread must not end by an exception.
    }
    write_seconds_ = seconds_since(began);
    if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    written_.store(true, std::memory_order_release);
  });
  copy_seconds_ = seconds_since(start);
  commit_seconds_ = wait_seconds_ = 0;
}

void AsyncCheckpointer::join() {
  if (thread_.joinable()) thread_.join();
}

std::string AsyncCheckpointer::finish() {
  LOOM_INTERNAL_ASSERT(writer_, "no asynchronous save to finish");
  const auto start = Clock::now();
  join();
  wait_seconds_ = seconds_since(start);
  const auto commit_start = Clock::now();
  // The writer goes whatever the commit says (its destructor removes an uncommitted folder).
  std::unique_ptr<CheckpointWriter> writer = std::move(writer_);
  const std::string folder = writer->commit(keep_, protect_step_);
  commit_seconds_ = seconds_since(commit_start);
  return folder;
}

void AsyncCheckpointer::abandon() noexcept {
  join();
  if (!writer_) return;
  std::unique_ptr<CheckpointWriter> writer = std::move(writer_);
  if (comm_.world_size() == 1 && writer->error().empty()) {
    try {
      const std::string folder = writer->commit(keep_, protect_step_);
      log::info("saved checkpoint ", folder, " (written in the background before the run ended)");
    } catch (const std::exception& e) {
      log::warn("the checkpoint of step ", writer->step(), ", written in the background, could ",
                "not be committed: ", e.what());
    }
  }
  // An uncommitted writer removes its temporary folder (rank 0) as it goes.
  try {
    writer.reset();
  } catch (...) {
  }
}

}  // namespace loom
