// nn::attach_aux_loss and the engine's collection of auxiliary losses. See Note [Auxiliary
// losses] in loom/batch.h.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <mutex>

#include "loom/error.h"
#include "loom/nn.h"

namespace loom::nn {
namespace {

// Read by backward (which may run on an autograd device thread), set by the engine's thread.
std::atomic<double> grad_scale{1.0};
std::mutex collected_mutex;
at::Tensor collected;  // guarded by collected_mutex

// Identity on x; backward gives aux_loss the engine's scale, so the auxiliary loss joins the
// objective as if it had been added to the loss that backward started from.
struct AttachAuxLoss : torch::autograd::Function<AttachAuxLoss> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& aux_loss) {
    ctx->saved_data["aux_options"] = static_cast<int64_t>(aux_loss.scalar_type());
    ctx->saved_data["aux_device"] = aux_loss.device().str();
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["aux_options"].toInt());
    const c10::Device device(ctx->saved_data["aux_device"].toStringRef());
    at::Tensor aux_grad =
        at::full({}, grad_scale.load(), at::TensorOptions().dtype(dtype).device(device));
    return {grads[0], aux_grad};
  }
};

}  // namespace

at::Tensor attach_aux_loss(const at::Tensor& x, const at::Tensor& aux_loss) {
  LOOM_CHECK(aux_loss.defined() && aux_loss.dim() == 0, "attach_aux_loss needs a 0-d loss");
  {
    std::lock_guard<std::mutex> lock(collected_mutex);
    at::Tensor value = aux_loss.detach().to(at::kFloat);
    collected = collected.defined() ? collected + value : value;
  }
  if (!at::GradMode::is_enabled() || !aux_loss.requires_grad()) return x;
  return AttachAuxLoss::apply(x, aux_loss);
}

namespace detail {
void set_aux_loss_grad_scale(double scale) { grad_scale.store(scale); }
void reset_aux_losses() {
  std::lock_guard<std::mutex> lock(collected_mutex);
  collected = at::Tensor();
}
at::Tensor collected_aux_losses() {
  std::lock_guard<std::mutex> lock(collected_mutex);
  return collected;
}
}  // namespace detail

}  // namespace loom::nn
