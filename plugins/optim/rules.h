// The optim plugin's update rules (adafactor, adam8bit, sgd, lion, muon): factories the plugin
// class calls, plus the shared checks. Plugin-internal; not part of the SDK.
#pragma once

#include <initializer_list>
#include <memory>
#include <string>

#include "loom/config.h"
#include "loom/error.h"
#include "loom/update_rule.h"

namespace loom::optim {

std::unique_ptr<UpdateRule> make_adafactor(const ConfigSection& table);
std::unique_ptr<UpdateRule> make_adam8bit(const ConfigSection& table);
std::unique_ptr<UpdateRule> make_sgd(const ConfigSection& table);
std::unique_ptr<UpdateRule> make_lion(const ConfigSection& table);
std::unique_ptr<UpdateRule> make_muon(const ConfigSection& table);

// A decay rate in [0, 1), named in the error.
inline double beta_in_range(const ConfigSection& c, const char* key) {
  const double beta = c.get_float(key);
  LOOM_CHECK_AS(ConfigError, beta >= 0 && beta < 1, c.where(key), ": [optimizer] ", key,
                " must be in [0, 1), got ", beta, "; use e.g. 0.9");
  return beta;
}

// [optimizer] kernel: one of the rule's `choices` ("auto" first), or an error naming the rule and
// listing them.
inline std::string kernel_in(const ConfigSection& c, const char* rule,
                             std::initializer_list<const char*> choices) {
  const std::string kernel = c.get_string("kernel");
  std::string list;
  size_t at = 0;
  for (const char* choice : choices) {
    if (kernel == choice) return kernel;
    list += (at == 0 ? "" : at + 1 == choices.size() ? " or " : ", ") + std::string(choice);
    ++at;
  }
  throw ConfigError(detail::cat(c.where("kernel"), ": [optimizer] kernel '", kernel,
                                "' is unknown for ", rule, "; use ", list));
}

// For the CUDA kernels (cuda/): t is of `type`, contiguous, on the parameter's device.
inline bool kernel_ready(const Segment& s, const at::Tensor& t, at::ScalarType type) {
  return t.scalar_type() == type && t.is_contiguous() && t.device() == s.param.device();
}

// The current stream of a GPU as a cudaStream_t, through c10's device-generic interface: this
// plugin links LibTorch's CPU half only (the CUDA half registers the implementation). The caller
// holds a c10::DeviceGuard for `device`. Defined in optim.cpp.
void* current_cuda_stream(const c10::Device& device);

// True when the segment can take the raw-pointer CPU kernels.
inline bool cpu_fp32(const Segment& s) {
  return s.param.is_cpu() && s.param.scalar_type() == at::kFloat && s.param.is_contiguous() &&
         s.grad.scalar_type() == at::kFloat && s.grad.is_contiguous();
}

}  // namespace loom::optim
