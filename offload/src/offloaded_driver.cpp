// The unsharded step driver with masters and optimizer state on NVMe. See
// loom/offload/offloaded_driver.h and Note [Pipelined update] there.
#include "loom/offload/offloaded_driver.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>

#include "loom/error.h"
#include "loom/log.h"
#include "loom/memory.h"

namespace loom::offload {
namespace {

constexpr int64_t kTensorAlign = 64;  // each state tensor starts on a cache line

int64_t align_to(int64_t bytes, int64_t unit) { return (bytes + unit - 1) / unit * unit; }

class OffloadedDriver final : public OffloadedStepDriver {
 public:
  OffloadedDriver(const StepDriverOptions& options, const OffloadOptions& offload)
      : rule_(*options.rule), weight_decay_(options.weight_decay) {
    LOOM_CHECK_AS(ConfigError, offload.buffer_count >= 3, "offload_optimizer.buffer_count = ",
                  offload.buffer_count, " is too few: the pipelined update needs 3 (one read, "
                  "one updated, one written)");
    // Pass 1: every segment's region layout, from the state shapes the rule makes on the meta
    // device (no memory), so the swap file is reserved whole before anything is written.
    int64_t total = 0, largest = 0;
    for (const auto& param : options.params) {
      Entry e;
      e.param = param;
      const at::Tensor data = param.tensor.detach();
      LOOM_INTERNAL_ASSERT(data.is_contiguous(), "parameter ", param.name, " is not contiguous");
      e.numel = data.numel();
      e.separate_master = data.scalar_type() != at::kFloat || !data.is_cpu();
      int64_t at_byte = e.separate_master ? align_to(e.numel * 4, kTensorAlign) : 0;
      for (auto& [key, tensor] :
           whole_tensor_state_shapes(rule_, param.name, data.sizes().vec(), param.group)) {
        Layout l{key, tensor.scalar_type(), tensor.sizes().vec(), at_byte,
                 tensor.numel() * static_cast<int64_t>(tensor.element_size())};
        at_byte = align_to(at_byte + l.bytes, kTensorAlign);
        e.state.push_back(std::move(l));
      }
      e.bytes = std::max<int64_t>(at_byte, 1);
      total += align_up(e.bytes);
      largest = std::max(largest, e.bytes);
      entries_.push_back(std::move(e));
    }
    file_ = std::make_unique<SwapFile>(offload.nvme, total);
    for (auto& e : entries_) e.region = file_->allocate(e.bytes);
    for (int b = 0; b < offload.buffer_count; ++b) buffers_.emplace_back(largest);
    // Pass 2: each segment's initial masters and state, written one at a time.
    at::NoGradGuard no_grad;
    for (auto& e : entries_) {
      void* base = buffers_[0].data();
      Segment segment = segment_over(e, base);
      if (e.separate_master)
        segment.param.copy_(e.param.tensor.detach().reshape(-1).to(at::kCPU, at::kFloat));
      for (auto& [key, tensor] : rule_.init_state(segment)) segment.state_at(key).copy_(tensor);
      file_->wait(file_->write(e.region, base));
    }
    log::info("offload: optimizer state", entries_.empty() || !entries_.front().separate_master
                                              ? ""
                                              : " and fp32 masters",
              " of ", entries_.size(), " tensors on NVMe: ",
              memory::format_bytes(total), " in ", file_->file(),
              file_->direct() ? " (O_DIRECT, io_uring)" : " (buffered, io_uring)", "; ",
              offload.buffer_count, " buffers of ", memory::format_bytes(largest), " in memory");
  }

  std::string name() const override { return "offloaded (nvme)"; }

  void zero_grad() override {
    auto all = grads();
    if (!all.empty()) at::_foreach_zero_(all);
  }
  at::Tensor grad_norm_squared() override { return squared_norm(grads()); }
  std::vector<at::Tensor> grads() override {
    std::vector<at::Tensor> out;
    for (const auto& e : entries_)
      if (e.param.tensor.grad().defined()) out.push_back(e.param.tensor.grad());
    return out;
  }
  void scale_grads(double factor) override {
    at::NoGradGuard no_grad;
    auto all = grads();
    if (!all.empty()) at::_foreach_mul_(all, factor);
  }

  // Note [Pipelined update].
  void update(int64_t step, double lr) override {
    using Clock = std::chrono::steady_clock;
    auto since = [](Clock::time_point t) {
      return std::chrono::duration<double>(Clock::now() - t).count();
    };
    const auto started = Clock::now();
    stats_ = {};
    at::NoGradGuard no_grad;
    const size_t n = entries_.size(), count = buffers_.size();
    std::vector<SwapFile::Ticket> reading(count, 0), writing(count, 0);
    auto wait = [&](SwapFile::Ticket ticket) {
      const auto t = Clock::now();
      file_->wait(ticket);
      stats_.io_wait_seconds += since(t);
    };
    auto start_read = [&](size_t i) {
      const size_t b = i % count;
      if (writing[b]) wait(writing[b]);  // the buffer's last segment is on disk
      writing[b] = 0;
      reading[b] = file_->read(entries_[i].region, buffers_[b].data());
      stats_.bytes_read += align_up(entries_[i].bytes);
    };
    // Reads run `ahead` segments ahead of the update: every buffer but the one being updated
    // and the one being written holds a read in flight.
    const size_t ahead = count - 2;
    size_t issued = 0;
    for (size_t i = 0; i < n; ++i) {
      while (issued < n && issued <= i + ahead) start_read(issued++);
      const size_t b = i % count;
      wait(reading[b]);
      reading[b] = 0;
      Entry& e = entries_[i];
      const at::Tensor& grad = e.param.tensor.grad();
      if (!grad.defined()) continue;  // unused this step: its state stays as it is on disk
      const auto computing = Clock::now();
      Segment segment = segment_over(e, buffers_[b].data());
      segment.grad = grad.reshape(-1).to(at::kCPU, at::kFloat);
      rule_.update_many({&segment}, update_context(e.param, step, lr, weight_decay_));
      if (e.separate_master)
        e.param.tensor.detach().copy_(segment.param.view(e.param.tensor.sizes()));
      stats_.compute_seconds += since(computing);
      writing[b] = file_->write(e.region, buffers_[b].data());
      stats_.bytes_written += align_up(e.bytes);
    }
    for (auto ticket : writing)
      if (ticket) wait(ticket);
    stats_.update_seconds = since(started);
  }
  OffloadStats last_stats() const override { return stats_; }

  // Checkpoints read each region back into tensors of their own (all of the state at once: the
  // checkpoint writer takes a list; a streaming writer is the next step).
  StatePieces state_pieces() const override {
    StatePieces out;
    for (const auto& e : entries_) {
      file_->wait(file_->read(e.region, buffers_[0].data()));
      const Segment segment = segment_over(e, buffers_[0].data());
      for (const auto& [key, tensor] : segment.state)
        out.push_back({"state/" + e.param.name + "/" + key, tensor.clone(), tensor.sizes().vec(), 0});
      if (e.separate_master)
        out.push_back({"master/" + e.param.name, segment.param.clone(), {e.numel}, 0});
    }
    return out;
  }
  // Streams: each segment's saved state is read into a buffer and written to its region.
  void load_state(StateReader& reader) override {
    at::NoGradGuard no_grad;
    for (auto& e : entries_) {
      void* base = buffers_[0].data();
      Segment segment = segment_over(e, base);
      for (auto& [key, tensor] : segment.state)
        reader.read("state/" + e.param.name + "/" + key, tensor.sizes().vec(), 0, tensor);
      if (e.separate_master) {
        reader.read("master/" + e.param.name, {e.numel}, 0, segment.param);
        e.param.tensor.detach().copy_(segment.param.view(e.param.tensor.sizes()));
      }
      file_->wait(file_->write(e.region, base));
    }
    check_nothing_unread(reader);
  }
  // What stays in memory: the staging buffers (the state itself is on NVMe).
  int64_t state_bytes() const override {
    int64_t bytes = 0;
    for (const auto& b : buffers_) bytes += b.size();
    return bytes;
  }
  int64_t master_bytes() const override { return 0; }

 private:
  struct Layout {
    std::string key;
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t offset, bytes;
  };
  struct Entry {
    Param param;
    int64_t numel = 0, bytes = 0, region = -1;
    bool separate_master = false;
    std::vector<Layout> state;
  };

  // The segment the rule sees, its masters and state being views of a buffer's bytes (the
  // parameter itself when it is an fp32 CPU tensor: its own master).
  Segment segment_over(const Entry& e, void* base) const {
    Segment segment;
    segment.name = e.param.name;
    segment.shape = e.param.tensor.sizes().vec();
    segment.offset = 0;
    segment.group = e.param.group;
    auto* bytes = static_cast<char*>(base);
    segment.param = e.separate_master
                        ? at::from_blob(bytes, {e.numel}, at::TensorOptions().dtype(at::kFloat))
                        : e.param.tensor.detach().view(-1);
    for (const auto& l : e.state)
      segment.state.emplace_back(
          l.key, at::from_blob(bytes + l.offset, l.shape, at::TensorOptions().dtype(l.dtype)));
    return segment;
  }

  const UpdateRule& rule_;
  double weight_decay_;
  std::vector<Entry> entries_;
  std::unique_ptr<SwapFile> file_;
  mutable std::vector<AlignedBuffer> buffers_;
  OffloadStats stats_;
};

}  // namespace

std::unique_ptr<OffloadedStepDriver> make_offloaded_step_driver(
    const StepDriverOptions& options, const OffloadOptions& offload) {
  LOOM_INTERNAL_ASSERT(options.rule, "the offloaded driver needs the update rule");
  for (const auto& p : options.params)
    LOOM_CHECK_AS(ConfigError, !p.placed(), "offload_optimizer keeps every parameter's state "
                  "whole, but '", p.name, "' is placed (expert parallelism); offload without "
                  "[moe] expert_parallel_size > 1");
  return std::make_unique<OffloadedDriver>(options, offload);
}

}  // namespace loom::offload
