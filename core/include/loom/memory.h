// loom/memory.h — memory accounting: a tracking CPU allocator (current and peak bytes of every
// tensor allocation on the CPU), the CUDA caching allocator's stats on CUDA builds, peak RSS,
// and the model-state report in bytes (params, grads, master weights, optimizer state) that the
// seed documents reason with.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom::memory {

struct Stats {
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t allocations = 0;  // live allocations
};

// Installs the tracker as LibTorch's CPU allocator (idempotent). Allocations made before are
// not counted, their frees are not either.
void install_cpu_tracker();
bool cpu_tracker_installed();
Stats cpu_stats();
void reset_cpu_peak();  // peak := current
// Note [Large blocks in huge pages]: on (installs the tracker if needed), every CPU block of 2
// MiB and more the tracker allocates from then on is a mapping of its own, 2 MiB-aligned and
// advised to transparent huge pages (madvise MADV_HUGEPAGE), unmapped the moment it is freed:
// its memory goes back to the system at once, and is faulted in again 2 MiB at a time, not 4 KiB.
// Off: the wrapped allocator's blocks again (blocks already mapped stay so until freed).
// ZeRO stage 3 turns it on to return its freed weights (Note [Freed weights go back]).
void map_large_cpu_blocks(bool on);

// The device's numbers: the tracker for the CPU, the caching allocator for CUDA.
Stats device_stats(c10::Device device);
void reset_device_peak(c10::Device device);

int64_t peak_rss_bytes();     // the process's high-water mark (VmHWM)
int64_t physical_memory_bytes();  // the machine's RAM
// For model providers' validate(): refuses (ConfigError at `where`) a model of `params`
// parameters (a double: sizes like n_embd = 1e18 overflow integers) whose fp32 weights alone
// exceed this machine's RAM — before anything is allocated — naming the estimate and `keys`
// ("n_layer = 100000, n_embd = 768").
void check_model_fits(double params, const std::string& where, const std::string& keys);
int64_t current_rss_bytes();  // VmRSS

// Model state in bytes on this rank.
struct ModelState {
  int64_t param_count = 0, trainable_count = 0;
  int64_t param_bytes = 0;      // the model's weights as stored (compute dtype)
  int64_t master_bytes = 0;     // fp32 master copies kept apart from the weights
  int64_t grad_bytes = 0;
  int64_t optimizer_bytes = 0;  // update-rule state
  int64_t total() const { return param_bytes + master_bytes + grad_bytes + optimizer_bytes; }
  std::string describe() const;
};

std::string format_bytes(int64_t bytes);

// Note [ZeRO's model states]: the one formula of what one of N ranks holds for `trainable`
// elements at a ZeRO stage (the ZeRO paper's anatomy, loom's byte counts), used by the zero
// plugin's measured-against-formula line and by `loom estimate`'s rows. `weight` bytes per weight
// and per gradient element (4 fp32, 2 half), `master` bytes of fp32 master per element (0 when
// the weights are fp32), `state` bytes of update-rule state per element (AdamW 8). Stage 1
// divides masters and state by N, stage 2 the gradients too, stage 3 the weights too, of which
// only `sharded` elements are cut (the rest, below the persistence threshold, stays whole on
// every rank). What a stage adds beside the model states (stage 0's gradient buckets, stage 3's
// gathered units) and what does not train (frozen tensors) the callers count themselves.
struct ZeroModelStates {
  double weights = 0, grads = 0, masters = 0, optimizer = 0;
  double total() const { return weights + grads + masters + optimizer; }
};
ZeroModelStates zero_model_states(int stage, double world_size, double trainable, double sharded,
                                  double weight, double master, double state);

}  // namespace loom::memory

#pragma GCC visibility pop
