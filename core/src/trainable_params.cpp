// The trainable parameters and the model state's sizes. See trainable_params.h.
#include "trainable_params.h"

#include <set>

#include "loom/error.h"
#include "loom/model.h"
#include "param_groups.h"

namespace loom {

void check_placement(const at::Tensor& param, const ParamPlacement& placement) {
  if (placement.global_shape.empty()) return;
  LOOM_CHECK(param.dim() >= 1 &&
                 static_cast<int64_t>(placement.global_shape.size()) == param.dim() &&
                 placement.row_offset >= 0 &&
                 placement.row_offset + param.size(0) <= placement.global_shape[0],
             "place_param: a ", param.sizes(), " parameter cannot be rows ",
             placement.row_offset, ".. of a global ", placement.global_shape, " tensor");
  for (int64_t d = 1; d < param.dim(); ++d)
    LOOM_CHECK(param.size(d) == placement.global_shape[d], "place_param: a ", param.sizes(),
               " parameter is not rows of a global ", placement.global_shape, " tensor");
}

TrainableParams collect_trainable_params(Model& model, const std::string& model_name,
                                         const std::map<const void*, ParamPlacement>& placements,
                                         const ConfigSection& optimizer) {
  TrainableParams out;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    Param param;
    param.name = item.key();
    param.tensor = item.value();
    param.group = model.no_weight_decay(item.key(), item.value()) ? 1 : 0;
    auto placed = placements.find(item.value().unsafeGetTensorImpl());
    if (placed != placements.end()) {
      param.global_shape = placed->second.global_shape;
      param.row_offset = placed->second.row_offset;
      param.replicas = placed->second.replicas;
      if (placed->second.group >= 0) param.group = placed->second.group;
    }
    out.params.push_back(param);
  }
  for (const auto& item : model.named_parameters(true)) {
    out.param_count += item.value().numel();
    if (item.value().requires_grad()) {
      out.trainable_count += item.value().numel();
      out.trainable_bytes += item.value().numel() * item.value().element_size();
    }
  }
  LOOM_CHECK(!out.params.empty(), "model '", model_name,
             "' has no trainable parameters (all are frozen)");
  apply_param_groups(optimizer, out.params);
  return out;
}

memory::ModelState model_state_of(Model& model, const TrainableParams& built,
                                  const StepDriver& driver, bool grads_freed_in_backward) {
  memory::ModelState s;
  s.param_count = built.param_count;
  s.trainable_count = built.trainable_count;
  std::set<std::string> sharded;
  for (const auto& name : driver.sharded_weights()) sharded.insert(name);
  for (const auto& item : model.named_parameters(true))
    if (!sharded.count(item.key()))
      s.param_bytes += item.value().numel() * item.value().element_size();
  s.param_bytes += driver.sharded_weight_bytes();
  // Unsharded: one gradient per trainable weight, as built; a sharding driver says its own.
  s.grad_bytes = driver.grad_bytes() >= 0 ? driver.grad_bytes() : built.trainable_bytes;
  if (grads_freed_in_backward) s.grad_bytes = 0;
  s.master_bytes = driver.master_bytes();
  s.optimizer_bytes = driver.state_bytes();
  return s;
}

}  // namespace loom
