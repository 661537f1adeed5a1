// The grad_ready event's autograd hooks. See grad_hooks.h.
#include "grad_hooks.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>

namespace loom {
namespace {

// Calls back once a parameter's .grad holds this micro-batch's contribution. The callback is
// shared by every parameter's hook (autograd owns each hook).
class GradReadyHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  GradReadyHook(std::shared_ptr<const std::function<void(size_t)>> ready, size_t index)
      : ready_(std::move(ready)), index_(index) {}
  void operator()(const torch::autograd::Variable&) override { (*ready_)(index_); }

 private:
  std::shared_ptr<const std::function<void(size_t)>> ready_;
  size_t index_;
};

}  // namespace

void install_grad_ready_hooks(const std::vector<Param>& params,
                              std::function<void(size_t index)> ready) {
  auto shared = std::make_shared<const std::function<void(size_t)>>(std::move(ready));
  for (size_t i = 0; i < params.size(); ++i)
    torch::autograd::impl::set_post_acc_grad_hooks(params[i].tensor,
                                                   std::make_unique<GradReadyHook>(shared, i));
}

}  // namespace loom
