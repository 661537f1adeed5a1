// The `lora` plugin's public C entry points, for programs that embed loom (inference, tests):
// fold every LoRA adapter of a model into its Linear weights and take it out again. Not the
// plugin itself (lora.cpp) and not needed to train: the job file switches LoRA on with [lora].
// Look the functions up with dlsym in loom_lora.so once the engine has loaded it.
#pragma once

#include <cstdint>

namespace torch::nn {
class Module;
}

extern "C" {
// W += scaling · B·A for every adapter that is not merged yet; its forward then adds nothing.
// Returns the number of adapters merged. Merged adapters get no gradient: merge for inference.
__attribute__((visibility("default"))) int64_t loom_lora_merge(torch::nn::Module* model);
// W -= scaling · B·A for every merged adapter. Returns the number unmerged.
__attribute__((visibility("default"))) int64_t loom_lora_unmerge(torch::nn::Module* model);
}
