// The unsharded step driver with masters and optimizer state on NVMe. See
// loom/offload/offloaded_driver.h and Note [Pipelined update] there.
#include "loom/offload/offloaded_driver.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <exception>
#include <thread>

#include "loom/error.h"
#include "loom/log.h"

namespace loom::offload {
namespace {

class OffloadedDriver final : public OffloadedStepDriver {
 public:
  OffloadedDriver(const StepDriverOptions& options, const OffloadOptions& offload)
      : params_(options.params),
        rule_(*options.rule),
        weight_decay_(options.weight_decay),
        delayed_(offload.delayed_update) {
    std::vector<SwapSegment> segments;
    bool masters = false;
    for (const auto& param : params_) {
      const at::Tensor data = param.tensor.detach();
      LOOM_INTERNAL_ASSERT(data.is_contiguous(), "parameter ", param.name, " is not contiguous");
      SwapSegment s;
      s.name = param.name;
      s.shape = data.sizes().vec();
      s.numel = data.numel();
      s.group = param.group;
      // fp32 CPU weights are their own masters, updated in place; not while forward reads
      // them during a delayed update (Note [Delayed update]).
      if (data.scalar_type() == at::kFloat && data.is_cpu() && !delayed_) s.in_place = data.view(-1);
      else masters = true;
      segments.push_back(std::move(s));
    }
    OffloadOptions store = offload;
    store.pin_memory = offload.pin_memory && !params_.empty() && params_.front().tensor.is_cuda();
    swap_ = std::make_unique<SegmentSwap>(rule_, std::move(segments), store);
    for (size_t i = 0; i < params_.size(); ++i) swap_->initialise(i, params_[i].tensor.detach());
    if (delayed_) {
      // Host copies of a step's gradients and of its update's weights, page-locked for a GPU.
      const bool pin = store.pin_memory;
      for (const auto& p : params_) {
        const at::Tensor& w = p.tensor;
        grad_copies_.push_back(at::empty({w.numel()}, w.options().device(at::kCPU)
                                                          .dtype(at::kFloat).pinned_memory(pin)));
        new_weights_.push_back(at::empty(w.sizes(), w.options().device(at::kCPU).pinned_memory(pin)));
        host_bytes_ += grad_copies_.back().nbytes() + new_weights_.back().nbytes();
      }
      updated_.assign(params_.size(), 0);
    }
    log::info("offload: optimizer state", masters ? " and fp32 masters" : "", " of ",
              params_.size(), " tensors ", swap_->in_host_memory() ? "in host memory" : "on NVMe",
              ": ", swap_->describe(),
              delayed_ ? "; each update runs one step late, overlapping the next step's forward "
                         "and backward (delayed_update)"
                       : "");
  }

  ~OffloadedDriver() override {
    if (worker_.joinable()) worker_.join();  // its error, if any, has nowhere to go now
  }

  std::string name() const override {
    return swap_->in_host_memory() ? "offloaded (cpu)" : "offloaded (nvme)";
  }

  void zero_grad() override {
    auto all = grads();
    if (!all.empty()) at::_foreach_zero_(all);
  }
  at::Tensor grad_norm_squared() override { return squared_norm(grads()); }
  std::vector<at::Tensor> grads() override {
    std::vector<at::Tensor> out;
    for (const auto& p : params_)
      if (p.tensor.grad().defined()) out.push_back(p.tensor.grad());
    return out;
  }
  void scale_grads(double factor) override {
    at::NoGradGuard no_grad;
    auto all = grads();
    if (!all.empty()) at::_foreach_mul_(all, factor);
  }

  // Note [Pipelined update]; Note [Delayed update].
  void update(int64_t step, double lr) override {
    at::NoGradGuard no_grad;
    if (delayed_) return start_delayed_update(step, lr);
    swap_->walk([&](size_t i, Segment& segment) {
      const Param& p = params_[i];
      const at::Tensor& grad = p.tensor.grad();
      if (!grad.defined()) return false;  // unused this step: its state stays as it is on disk
      segment.grad = grad.reshape(-1).to(at::kCPU, at::kFloat);
      rule_.update_many({&segment}, update_context(p, step, lr, weight_decay_));
      if (swap_->separate_master(i)) p.tensor.detach().copy_(segment.param.view(p.tensor.sizes()));
      return true;
    });
  }
  // With delayed_update, the last finished update's (the one in flight is still counting).
  const OffloadStats& last_stats() const override {
    return delayed_ ? finished_stats_ : swap_->last_stats();
  }

  void synchronize() override {
    wait();
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i)
      if (updated_.size() > i && updated_[i]) {
        params_[i].tensor.detach().copy_(new_weights_[i]);
        updated_[i] = 0;
      }
  }

  // Streamed: each piece is read from the file when the checkpoint writer reaches it.
  StatePieces state_pieces() const override {
    wait();  // no walk in flight while the writer reads the store
    StatePieces out;
    const SegmentSwap* swap = swap_.get();
    for (size_t i = 0; i < swap->size(); ++i) {
      const Segment meta = swap->meta_segment(i);
      for (const auto& [key, tensor] : meta.state)
        out.push_back({"state/" + meta.name + "/" + key, tensor, tensor.sizes().vec(), 0, {},
                       [swap, i, key = key] { return swap->read(i, key); }});
      if (swap->separate_master(i))
        out.push_back({"master/" + meta.name, meta.param, {meta.param.numel()}, 0, {},
                       [swap, i] { return swap->read(i, ""); }});
    }
    return out;
  }
  // Streams: each segment's saved state is read into a buffer and written to its region.
  void load_state(StateReader& reader) override {
    at::NoGradGuard no_grad;
    wait();  // the loaded masters are the weights: nothing of the run before stays in flight
    std::fill(updated_.begin(), updated_.end(), 0);
    swap_->each([&](size_t i, Segment& segment) {
      for (auto& [key, tensor] : segment.state)
        reader.read("state/" + segment.name + "/" + key, tensor.sizes().vec(), 0, tensor);
      if (swap_->separate_master(i)) {
        reader.read("master/" + segment.name, {segment.param.numel()}, 0, segment.param);
        const at::Tensor& weight = params_[i].tensor;
        weight.detach().copy_(segment.param.view(weight.sizes()));
      }
      return true;
    });
    check_nothing_unread(reader);
  }
  // What stays in memory: the staging buffers (the state itself is on NVMe), and with
  // delayed_update the host copies of one step's gradients and weights.
  int64_t state_bytes() const override { return swap_->buffer_bytes() + host_bytes_; }
  int64_t master_bytes() const override { return 0; }

 private:
  // Note [Delayed update]: step k's gradients copied, update k started on its own thread.
  void start_delayed_update(int64_t step, double lr) {
    synchronize();  // update k-1 into the weights
    std::vector<UpdateContext> contexts(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& grad = params_[i].tensor.grad();
      updated_[i] = grad.defined();  // unused this step: its state stays as it is
      if (!grad.defined()) continue;
      grad_copies_[i].copy_(grad.reshape(-1));
      contexts[i] = update_context(params_[i], step, lr, weight_decay_);
    }
    worker_ = std::thread([this, contexts = std::move(contexts)] {
      try {
        at::NoGradGuard no_grad;
        swap_->walk([&](size_t i, Segment& segment) {
          if (!updated_[i]) return false;
          segment.grad = grad_copies_[i];
          rule_.update_many({&segment}, contexts[i]);
          new_weights_[i].copy_(segment.param.view(new_weights_[i].sizes()));
          return true;
        });
      } catch (...) {
        worker_error_ = std::current_exception();
      }
    });
  }

  // Waits for the update in flight (its error raised here, on the training thread).
  void wait() const {
    if (!worker_.joinable()) return;
    worker_.join();
    finished_stats_ = swap_->last_stats();
    if (worker_error_) {
      std::exception_ptr error = worker_error_;
      worker_error_ = nullptr;
      std::fill(updated_.begin(), updated_.end(), 0);
      std::rethrow_exception(error);
    }
  }

  std::vector<Param> params_;
  const UpdateRule& rule_;
  double weight_decay_;
  std::unique_ptr<SegmentSwap> swap_;
  // Note [Delayed update]
  bool delayed_ = false;
  std::vector<at::Tensor> grad_copies_, new_weights_;  // host, per parameter
  mutable std::vector<char> updated_;                  // which weights the update in flight sets
  mutable std::thread worker_;
  mutable std::exception_ptr worker_error_;
  mutable OffloadStats finished_stats_;
  int64_t host_bytes_ = 0;
};

}  // namespace

std::unique_ptr<OffloadedStepDriver> make_offloaded_step_driver(
    const StepDriverOptions& options, const OffloadOptions& offload) {
  LOOM_INTERNAL_ASSERT(options.rule, "the offloaded driver needs the update rule");
  for (const auto& p : options.params)  // the zero plugin refuses these with the job's key
    LOOM_INTERNAL_ASSERT(!p.placed(), "the offloaded driver keeps every parameter's state whole, "
                         "but '", p.name, "' is placed (expert parallelism)");
  return std::make_unique<OffloadedDriver>(options, offload);
}

}  // namespace loom::offload
