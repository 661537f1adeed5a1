// grad_hooks.h (core-internal) — the autograd side of the grad_ready event: a post-accumulate-
// grad hook per trainable parameter that calls back with the parameter's index. Which handlers
// run, and in which order, stays the engine's (Note [Optimizer in backward] runs last).
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "loom/engine.h"

namespace loom {

// Installs on every parameter of `params` an autograd post-accumulate-grad hook
// (torch::autograd::impl::set_post_acc_grad_hooks) that calls `ready(i)` for params[i] once its
// .grad holds this backward's contribution. The hook fires on the autograd thread, while
// backward continues with the rest of the graph, so gradient sync can start early. A parameter
// takes one such hook: call once per run (the hooks replace any installed before).
void install_grad_ready_hooks(const std::vector<Param>& params,
                              std::function<void(size_t index)> ready);

}  // namespace loom
