// The unsharded step driver with masters and optimizer state on NVMe. See
// loom/offload/offloaded_driver.h and Note [Pipelined update] there.
#include "loom/offload/offloaded_driver.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <thread>
#include <unordered_map>

#include "loom/error.h"
#include "loom/log.h"
#include "loom/offload/copy_stream.h"

namespace loom::offload {
namespace {

class OffloadedDriver final : public OffloadedStepDriver {
 public:
  OffloadedDriver(const StepDriverOptions& options, const OffloadOptions& offload)
      : params_(options.params),
        rule_(*options.rule),
        weight_decay_(options.weight_decay),
        seed_(options.seed),
        fused_rule_(options.master_dtype == "bf16" && rule_takes_bf16_weights(rule_, seed_)),
        delayed_(offload.delayed_update) {
    std::vector<SwapSegment> segments;
    bool masters = false, rounded = false;
    for (const auto& param : params_) {
      const at::Tensor data = param.tensor.detach();
      LOOM_INTERNAL_ASSERT(data.is_contiguous(), "parameter ", param.name, " is not contiguous");
      SwapSegment s;
      s.name = param.name;
      s.shape = data.sizes().vec();
      s.numel = data.numel();
      s.group = param.group;
      // fp32 CPU weights are their own masters, updated in place; not while forward reads
      // them during a delayed update (Note [Delayed update]). bf16 weights are their own with
      // master_dtype = "bf16" (Note [Offloaded without masters]): the store holds the state
      // alone.
      rounded_.push_back(options.master_dtype == "bf16" && data.scalar_type() == at::kBFloat16);
      if (rounded_.back()) s.no_master = rounded = true;
      else if (data.scalar_type() == at::kFloat && data.is_cpu() && !delayed_) s.in_place = data.view(-1);
      else masters = true;
      segments.push_back(std::move(s));
    }
    OffloadOptions store = offload;
    store.pin_memory = offload.pin_memory && !params_.empty() && params_.front().tensor.is_cuda();
    swap_ = std::make_unique<SegmentSwap>(rule_, std::move(segments), store);
    for (size_t i = 0; i < params_.size(); ++i) swap_->initialise(i, params_[i].tensor.detach());
    if (delayed_) {
      // Host copies of a step's gradients and of its update's weights, page-locked for a GPU,
      // both in the weights' dtype (a gradient's, as autograd makes it): bf16 gradients cost
      // 2 B/param here, not 4, and widening them to fp32 is exact, so the walk widens each
      // segment's copy only as the rule reads it (the core's adamw reads bf16 as it is).
      const bool pin = store.pin_memory;
      for (const auto& p : params_) {
        const at::Tensor& w = p.tensor;
        grad_copies_.push_back(
            at::empty({w.numel()}, w.options().device(at::kCPU).pinned_memory(pin)));
        new_weights_.push_back(at::empty(w.sizes(), w.options().device(at::kCPU).pinned_memory(pin)));
        host_bytes_ += grad_copies_.back().nbytes() + new_weights_.back().nbytes();
      }
      fill_new_weights();
      updated_.assign(params_.size(), 0);
    }
    // Note [Overlapped update]: the host store, updated where it lives as gradients land.
    overlap_ = offload.overlap_update && swap_->in_host_memory() && !delayed_ && !params_.empty();
    if (overlap_) {
      const bool pin = store.pin_memory;
      copies_ = std::make_unique<CopyStream>(params_.front().tensor.device());
      for (size_t i = 0; i < params_.size(); ++i) {
        const at::Tensor& w = params_[i].tensor;
        landed_.push_back(at::empty({w.numel()}, w.options().device(at::kCPU).pinned_memory(pin)));
        host_bytes_ += landed_.back().nbytes();
        if (copies_->on_device()) {  // the weights' way back: staged, then host to device
          staged_.push_back(at::empty({w.numel()}, w.options().device(at::kCPU).pinned_memory(pin)));
          host_bytes_ += staged_.back().nbytes();
        }
        index_[w.unsafeGetTensorImpl()] = i;
      }
      norms_.resize(params_.size());
      landing_.assign(params_.size(), 0);
      updated_early_.assign(params_.size(), 0);
      io_ = std::make_unique<WorkerThread>();
    }
    log::info("offload: optimizer state", masters ? " and fp32 masters" : "", " of ",
              params_.size(), " tensors ", swap_->in_host_memory() ? "in host memory" : "on NVMe",
              rounded ? " (bf16 weights as their own masters: none kept)" : "", ": ",
              swap_->describe(),
              delayed_ ? "; each update runs one step late, overlapping the next step's forward "
                         "and backward (delayed_update)"
              : overlap_ ? "; each tensor's gradient copied to host memory as it is final, its "
                           "update overlapping the rest of backward when nothing clips or scales"
                           " it"
                         : "");
  }

  ~OffloadedDriver() override {
    if (worker_.joinable()) worker_.join();  // its error, if any, has nowhere to go now
    io_.reset();  // runs what is posted: no task outlives the tensors it reads
  }

  std::string name() const override {
    return swap_->in_host_memory() ? "offloaded (cpu)" : "offloaded (nvme)";
  }

  void zero_grad() override {
    if (overlap_) end_overlapped_step();
    auto all = model_grads();
    if (!all.empty()) at::_foreach_zero_(all);
  }
  at::Tensor grad_norm_squared() override {
    if (!overlap_) return squared_norm(model_grads());
    // Note [Overlapped update]: squared_norm's per-tensor sums, taken as each gradient landed,
    // stacked in parameter order and summed as squared_norm sums them: the same bits.
    finish_landing();
    std::vector<at::Tensor> squares;
    for (size_t i = 0; i < params_.size(); ++i)
      if (landing_[i]) squares.push_back(norms_[i]);
    if (squares.empty()) return squared_norm({});
    return at::stack(squares).sum();
  }
  // Note [Overlapped update]: the host copies the update reads, once landed.
  std::vector<at::Tensor> grads() override {
    if (!overlap_) return model_grads();
    finish_landing();
    io_->wait();
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < params_.size(); ++i)
      if (landing_[i]) out.push_back(landed_[i]);
    return out;
  }
  void scale_grads(double factor) override {
    at::NoGradGuard no_grad;
    LOOM_INTERNAL_ASSERT(!overlap_ || !early_, "scale_grads after the overlapped update started "
                         "during backward (the zero plugin starts it only without clipping)");
    scale_gradients(grads(), factor);
  }

  bool overlaps_backward() const override { return overlap_; }

  // Note [Overlapped update].
  void grad_final(const at::Tensor& param, bool update_now, int64_t step, double lr) override {
    LOOM_INTERNAL_ASSERT(overlap_, "grad_final on an offloaded driver that does not overlap");
    auto found = index_.find(param.unsafeGetTensorImpl());
    LOOM_INTERNAL_ASSERT(found != index_.end(), "grad_final for a tensor that is not a "
                         "trainable parameter of this job");
    const size_t i = found->second;
    LOOM_INTERNAL_ASSERT(!landing_[i], "the gradient of ", params_[i].name, " became final "
                         "twice in one step");
    land(i);
    if (!update_now) return;
    if (!early_) {
      early_ = true;
      early_step_ = step;
      early_lr_ = lr;
    }
    LOOM_INTERNAL_ASSERT(step == early_step_ && lr == early_lr_, "one step's overlapped "
                         "updates were started with different steps or learning rates");
    updated_early_[i] = 1;
    const UpdateContext context = update_context(params_[i], step, lr, weight_decay_);
    io_->post([this, i, context] { update_segment(i, context); });
  }

  // Note [Pipelined update]; Note [Delayed update].
  void update(int64_t step, double lr) override {
    at::NoGradGuard no_grad;
    if (delayed_) return start_delayed_update(step, lr);
    if (overlap_) return finish_overlapped_update(step, lr);
    swap_->walk([&](size_t i, Segment& segment) {
      const Param& p = params_[i];
      const at::Tensor& grad = p.tensor.grad();
      if (!grad.defined()) return false;  // unused this step: its state stays as it is on disk
      const UpdateContext context = update_context(p, step, lr, weight_decay_);
      if (rounded_[i]) {  // Note [Offloaded without masters]: widened from the weights
        const at::Tensor weights = p.tensor.detach().view(-1);
        const at::Tensor host = weights.is_cpu() ? weights : weights.to(at::kCPU);
        update_rounded(segment, host, grad.reshape(-1).to(at::kCPU), context);
        if (!weights.is_cpu()) weights.copy_(host);
        return true;
      }
      segment.grad = grad.reshape(-1).to(at::kCPU, at::kFloat);
      rule_.update_many({&segment}, context);
      if (swap_->separate_master(i)) p.tensor.detach().copy_(segment.param.view(p.tensor.sizes()));
      return true;
    });
  }
  // With delayed_update, the last finished update's (the one in flight is still counting).
  const OffloadStats& last_stats() const override {
    return delayed_ ? finished_stats_ : overlap_ ? overlap_stats_ : swap_->last_stats();
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
    if (io_) io_->wait();
    StatePieces out;
    const SegmentSwap* swap = swap_.get();
    for (size_t i = 0; i < swap->size(); ++i) {
      const Segment meta = swap->meta_segment(i);
      for (const auto& [key, tensor] : meta.state)
        out.push_back({"state/" + meta.name + "/" + key, tensor, tensor.sizes().vec(), 0, {},
                       [swap, i, key = key] { return swap->read(i, key); }});
      // fp32 weights equal their copy in the store after every applied update (a delayed
      // one is applied before a save): the weights file holds them, bit for bit, as an
      // in-memory run's checkpoint does.
      if (swap->separate_master(i) && params_[i].tensor.scalar_type() != at::kFloat)
        out.push_back({"master/" + meta.name, meta.param, {meta.param.numel()}, 0, {},
                       [swap, i] { return swap->read(i, ""); }});
    }
    return out;
  }
  // Streams: each segment's saved state is read into a buffer and written to its region.
  void load_state(StateReader& reader) override {
    at::NoGradGuard no_grad;
    wait();  // the loaded masters are the weights: nothing of the run before stays in flight
    if (io_) io_->wait();
    std::fill(updated_.begin(), updated_.end(), 0);
    // Note [Offloaded without masters]: masters saved by a run that kept them, or none by one
    // that did not (nor for fp32 weights, which are their own: state_pieces).
    std::string dropped, widened;
    swap_->each([&](size_t i, Segment& segment) {
      for (auto& [key, tensor] : segment.state)
        reader.read("state/" + segment.name + "/" + key, tensor.sizes().vec(), 0, tensor);
      const std::string master = "master/" + segment.name;
      const at::Tensor weight = params_[i].tensor.detach();
      if (swap_->separate_master(i) && reader.holds(master)) {
        reader.read(master, {segment.param.numel()}, 0, segment.param);
        weight.copy_(segment.param.view(weight.sizes()));
      } else if (swap_->separate_master(i)) {
        segment.param.copy_(weight.view(-1));  // exact: the weights into fp32
        if (weight.scalar_type() != at::kFloat && widened.empty()) widened = master;
      } else if (reader.holds(master)) {
        // Read (so nothing is left unread) and dropped: the weights go on from their values.
        at::Tensor into = at::empty({weight.numel()}, at::TensorOptions().dtype(at::kFloat));
        reader.read(master, {into.numel()}, 0, into);
        if (rounded_[i] && dropped.empty()) dropped = master;
      }
      return true;
    });
    if (delayed_) fill_new_weights();  // the next update starts from the loaded weights
    warn_master_dtype_switch(reader, dropped, widened);
    check_nothing_unread(reader);
  }
  // What stays in memory: the staging buffers (the state itself is on NVMe), and with
  // delayed_update the host copies of one step's gradients and weights (with the overlapped
  // update, of the gradients, and on a GPU of the weights staged for their way back).
  int64_t state_bytes() const override { return swap_->buffer_bytes() + host_bytes_; }
  int64_t master_bytes() const override { return 0; }

 private:
  std::vector<at::Tensor> model_grads() const {
    std::vector<at::Tensor> out;
    for (const auto& p : params_)
      if (p.tensor.grad().defined()) out.push_back(p.tensor.grad());
    return out;
  }

  // Note [Overlapped update]: parameter i's gradient is final: its squared norm taken (on its
  // device, no sync) and its copy to the host started; the worker thread waits for it.
  void land(size_t i) {
    at::NoGradGuard no_grad;
    const at::Tensor grad = params_[i].tensor.grad().detach();
    LOOM_INTERNAL_ASSERT(grad.defined(), "grad_final for ", params_[i].name, " without a gradient");
    norms_[i] = squared_norm({grad});
    landing_[i] = 1;
    io_->post(copies_->start(landed_[i], grad));
    // Note [Offloaded without masters]: a GPU's bf16 weights come to the host to be updated;
    // backward reads them no more (their gradient is final), and forward not before update().
    if (rounded_[i] && copies_->on_device())
      io_->post(copies_->start(staged_[i], params_[i].tensor.detach().view(-1)));
  }
  // Gradients no grad_final handed over (one that only an earlier micro-step made): landed now.
  void finish_landing() {
    for (size_t i = 0; i < params_.size(); ++i)
      if (!landing_[i] && params_[i].tensor.grad().defined()) land(i);
  }

  // On the worker thread, after segment i's gradient landed: the rule over it where it lives
  // in the host store, exactly the unoverlapped walk's call, and the new weights on their way
  // back (the twin: copied into the model here; a GPU run: staged in page-locked memory, then
  // host to device on the side stream, which update() joins into the compute stream).
  void update_segment(size_t i, const UpdateContext& context) {
    Segment segment = swap_->host_segment(i);
    if (rounded_[i]) {  // Note [Offloaded without masters]
      const at::Tensor weight = params_[i].tensor.detach().view(-1);
      if (!copies_->on_device()) return update_rounded(segment, weight, landed_[i], context);
      update_rounded(segment, staged_[i], landed_[i], context);  // landed beside the gradient
      copies_->start(weight, staged_[i]);
      return;
    }
    segment.grad = landed_[i].to(at::kFloat);
    rule_.update_many({&segment}, context);
    if (!swap_->separate_master(i)) return;  // fp32 CPU weights: updated in place
    const at::Tensor weight = params_[i].tensor.detach();
    if (copies_->on_device()) {
      staged_[i].copy_(segment.param);
      copies_->start(weight, staged_[i]);
    } else {
      copies_->start(weight, segment.param)();
    }
  }

  void finish_overlapped_update(int64_t step, double lr) {
    using Clock = std::chrono::steady_clock;
    const auto started = Clock::now();
    finish_landing();
    LOOM_INTERNAL_ASSERT(!early_ || (step == early_step_ && lr == early_lr_), "the overlapped "
                         "update started during backward with step ", early_step_, ", lr ",
                         early_lr_, ", but update() came with step ", step, ", lr ", lr);
    int64_t early = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!landing_[i]) continue;  // unused this step: its state stays as it is
      if (updated_early_[i]) {
        ++early;
        continue;
      }
      const UpdateContext context = update_context(params_[i], step, lr, weight_decay_);
      io_->post([this, i, context] { update_segment(i, context); });
    }
    io_->wait();
    copies_->join_current_stream();
    overlap_stats_ = {};
    overlap_stats_.update_seconds = std::chrono::duration<double>(Clock::now() - started).count();
    overlap_stats_.updated_in_backward = early;
    early_ = false;
    std::fill(landing_.begin(), landing_.end(), 0);
    std::fill(updated_early_.begin(), updated_early_.end(), 0);
    for (auto& norm : norms_) norm = at::Tensor();
  }

  // Before a step's backward: nothing of the last step in flight, and an update applied during
  // backward was not followed by a skip.
  void end_overlapped_step() {
    io_->wait();
    LOOM_CHECK(!early_, "step ", early_step_, ": the update was skipped (a plugin set "
               "skip_update in before_update), but offload_optimizer's overlapped update had "
               "applied it during backward; set [train] max_grad_norm > 0 to make it wait for "
               "the whole gradient, or report this plugin");
    std::fill(landing_.begin(), landing_.end(), 0);
    std::fill(updated_early_.begin(), updated_early_.end(), 0);
    for (auto& norm : norms_) norm = at::Tensor();
  }

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
          if (rounded_[i]) {  // Note [Offloaded without masters]: the host copy is the truth
            update_rounded(segment, new_weights_[i].view(-1), grad_copies_[i], contexts[i]);
            return true;
          }
          segment.grad = grad_copies_[i].to(at::kFloat);  // a no-op for fp32
          rule_.update_many({&segment}, contexts[i]);
          new_weights_[i].copy_(segment.param.view(new_weights_[i].sizes()));
          return true;
        });
      } catch (...) {
        worker_error_ = std::current_exception();
      }
    });
  }

  // Note [Offloaded without masters]: a segment's update on bf16 weights that are their own
  // masters, `weights` on the host (flat: the model's own on a CPU run, a host copy of them on
  // a GPU's), `grad` on the host in any dtype; the result written into `weights` rounded
  // stochastically with the core's bits (offset 0: the segment is the whole tensor), or by the
  // rule in its own pass where it takes bf16 weights and the gradient is bf16.
  void update_rounded(Segment& segment, const at::Tensor& weights, const at::Tensor& grad,
                      const UpdateContext& context) const {
    if (fused_rule_ && grad.scalar_type() == at::kBFloat16 && grad.is_contiguous()) {
      segment.param = weights;
      segment.grad = grad.view(-1);
      rule_.update_many({&segment}, context);
    } else {
      segment.param = weights.to(at::kFloat);
      segment.grad = grad.reshape(-1).to(at::kFloat);
      rule_.update_many({&segment}, context);
      at::Tensor into = weights;
      round_weights_to_bf16(segment.param, into, seed_, segment.name, context.step, 0);
    }
    segment.param = at::Tensor();
    segment.grad = at::Tensor();
  }
  // Note [Delayed update]: without masters the host copy of the weights is what the next
  // update starts from, so it begins (and after a load, begins again) as the weights.
  void fill_new_weights() {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i)
      if (rounded_[i]) new_weights_[i].copy_(params_[i].tensor.detach());
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
  // Note [Offloaded without masters]
  uint64_t seed_;
  bool fused_rule_;
  std::vector<char> rounded_;  // per parameter: bf16 weights that are their own masters
  std::unique_ptr<SegmentSwap> swap_;
  // Note [Delayed update]
  bool delayed_ = false;
  std::vector<at::Tensor> grad_copies_, new_weights_;  // host, per parameter
  mutable std::vector<char> updated_;                  // which weights the update in flight sets
  mutable std::thread worker_;
  mutable std::exception_ptr worker_error_;
  mutable OffloadStats finished_stats_;
  int64_t host_bytes_ = 0;
  // Note [Overlapped update]
  bool overlap_ = false;
  std::unique_ptr<CopyStream> copies_;
  std::vector<at::Tensor> landed_, staged_;  // host, per parameter, flat, its dtype
  std::vector<at::Tensor> norms_;            // this step's per-tensor squared norms
  std::vector<char> landing_, updated_early_;
  std::unordered_map<const void*, size_t> index_;
  bool early_ = false;  // some update of this step already started during backward
  int64_t early_step_ = 0;
  double early_lr_ = 0;
  OffloadStats overlap_stats_;
  // Last: destroyed first, so its tasks finish while everything they read is alive.
  std::unique_ptr<WorkerThread> io_;
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
