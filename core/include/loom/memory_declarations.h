// loom/memory_declarations.h — what a technique adds to the memory one rank needs: the context a
// plugin reads (the model's counts, the ranks) and the byte terms it declares, which `loom
// estimate` sums over the job's plugins. Torch-free: only counts and bytes; it measures nothing
// (the estimate's probes do).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "loom/config.h"

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom::memory {

// Note [Memory declarations]: `loom estimate` knows no technique. The core counts the model once
// (one rank, the model built and, with probes, run) into a MemoryContext and starts the terms as
// the plain run holds them: fp32 weights and gradients (4 + 4 B per element, every weight held
// whole, every gradient of a trainable one), no masters, the update rule's measured state, the
// probes' fixed part in `buffers`. Then every plugin declares, in the order Note [Plugin order]
// gives (precision before zero), through Plugin::declare_memory with its own validated table:
// it reads the terms the plugins before it left and adds or replaces its own (the precision
// plugin the bytes per weight, gradient and master; zero divides the model states by the ranks
// through Note [ZeRO's model states], adds its buffers and moves what it offloads). The core then
// sums: device = the model states + activations + buffers - what was moved; host = what moved to
// host RAM + host buffers (on a CPU run the two are one memory); nvme = what moved there.
// The what-if table (DeepSpeed's, every stage x offload x precision) is the same sum over the
// variants plugins offer (Plugin::memory_variants: keys of their own table and the labels of
// the table's columns), each declared as if the job's table said so.
// LoRA declares nothing of its own: its adapters are the trainable elements and its frozen base
// the rest, both in the core's counts (the base's half copies under autocast are the
// precision's). MoE's expert parallelism (each rank holding E/P experts) is not declared yet:
// the probes run one rank, which expert_parallel_size > 1 refuses.
struct MemoryContext {
  double params = 0, trainable = 0;       // the model's elements; trainable: requires_grad
  double optimizer_per_trainable = 8;     // update-rule state, bytes per trainable element
  double largest_tensor_params = 0;       // the largest trainable tensor's elements
  double frozen_linear_params = 0;        // frozen elements held only as Linear weights/biases
  // The trainable elements inside the model's units (its UnitLists' children) in tensors of at
  // least `min_elements` elements: of every unit, or (largest_unit) of the largest one.
  std::function<double(double min_elements, bool largest_unit)> unit_params;
  int world_size = 1;
  bool cpu_device = false;                // the compute device is the host: one memory
  bool activations_measured = false;      // the probes measured this precision's activations
  int buffer_count = 4;                   // NVMe offload's buffers ([zero] may override)
  // [train] optimizer_in_backward: each gradient freed once its update ran during backward, so a
  // step driver that updates its own pieces holds less gradient at the peak (Note [Updating
  // chunks in backward]); the probes measure the step without it.
  bool optimizer_in_backward = false;
  // [optimizer] master_dtype = "bf16" (Note [bf16 weights as their own masters] in
  // core/src/step_driver.cpp): full_bf16 keeps no fp32 masters, and only the core's step driver
  // offers it (no ZeRO stage, no offload).
  bool bf16_masters = false;
};

// One rank's bytes, by what they hold; `to_host` and `to_nvme` say how much of them lives off
// the compute device.
struct MemoryTerms {
  // Bytes per element, declared by the precision plugin and read by those after it.
  double weight_bytes = 4, grad_bytes = 4, master_bytes = 0;
  double weights = 0, grads = 0, masters = 0, optimizer = 0;
  double buffers = 0;       // everything else on the device: workspaces, copies, send buffers
  double to_host = 0, to_nvme = 0;  // of the terms above, moved to host RAM / NVMe
  double host_buffers = 0;          // host RAM besides (staging buffers of an NVMe offload)
  // Reported beside the model's counts: what a sharding plugin treats as the units' elements,
  // and the frozen elements a precision holds at 2 B beside 4 B weights (autocast's).
  double unit_params = 0, largest_unit_params = 0, half_frozen_params = 0;
  bool buildable = true;    // loom runs this configuration today
  bool applicable = true;   // false: the configuration does not exist (left out of the table)
  // The step driver releases `grads` between steps and backward makes them again (the default
  // driver: Note [Gradients released, not zeroed]), so the peak of forward and backward holds
  // only those made by then, which the measured activations count. false: the driver keeps its
  // gradient memory through forward (a driver that zeroes its gradients, or keeps a shard).
  bool grads_released = true;
  std::map<std::string, std::string> labels;  // the table's columns: "stage" -> "3"
  std::vector<std::string> notes;        // the job's: said in the estimate's first line
  std::vector<std::string> table_notes;  // the job's: said under the table
  double model_states() const { return weights + grads + masters + optimizer; }
};

// A configuration of a plugin's table that the estimate's what-if table shows: the keys that
// make it (over the job's own table, or the schema's defaults) and the column labels it has.
struct MemoryVariant {
  std::map<std::string, std::string> labels;
  ConfigTable overrides;  // tables among them are merged key by key into the job's
  std::string legend;     // said under the table where the variant is shown: what its label means
};

}  // namespace loom::memory

#pragma GCC visibility pop
