// Compute-device choice and activation. See device.h.
#include "device.h"

#include <malloc.h>
#include <sched.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <limits>

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <thread>

#include <ATen/Parallel.h>

#include "loom/config.h"
#include "loom/cpu.h"
#include "loom/error.h"
#include "loom/memory_control.h"

namespace loom {

int cuda_device_count() {
  if (!at::hasCUDA()) return 0;
  return static_cast<int>(c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount());
}

c10::Device pick_device(const std::string& name, const std::string& where, int local_rank,
                        int local_world_size) {
  c10::Device device(c10::kCPU);
  if (name != "auto") {
    try {
      device = c10::Device(name);
    } catch (const std::exception&) {
      throw ConfigError(detail::cat(where, ": [train] device '", name,
                                    "' is not a device; use cpu, cuda, cuda:N or auto"));
    }
    LOOM_CHECK_AS(ConfigError, device.is_cpu() || device.is_cuda(), where, ": [train] device '",
                  name, "' is not supported; use cpu, cuda, cuda:N or auto");
  }
  const int gpus = cuda_device_count();
  if (name == "auto") {
    if (gpus == 0) return c10::Device(c10::kCPU);
    device = c10::Device(c10::kCUDA);
  }
  if (device.is_cpu()) return device;
#ifdef LOOM_WITH_CUDA
  const char* why_none = "this machine has no usable CUDA device (no GPU, or no driver)";
#else
  // Note [LibTorch without the CUDA toolkit] (cmake/LoomFindTorch.cmake): LibTorch's CUDA half
  // is not linked, so a GPU would not be seen either.
  const char* why_none =
      "this loom has no usable CUDA device: it was built without CUDA (no CUDA toolkit where it "
      "was configured)";
#endif
  LOOM_CHECK_AS(ConfigError, gpus > 0, where, ": [train] device '", name, "' asks for CUDA, but ",
                why_none, "; set [train] device = \"cpu\" or \"auto\"");
  if (!device.has_index()) {
    // One GPU per rank of this node, as torchrun and DeepSpeed do.
    LOOM_CHECK_AS(ConfigError, local_rank < gpus, where, ": [train] device '", name, "': ",
                  local_world_size, " ranks run on this node but it has ", gpus,
                  " CUDA device(s); start at most ", gpus,
                  " ranks per node (loom-launch --nproc-per-node)");
    device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
  }
  LOOM_CHECK_AS(ConfigError, device.index() < gpus, where, ": [train] device '", name,
                "' does not exist: this machine has ", gpus, " CUDA device(s), cuda:0",
                gpus > 1 ? detail::cat(" to cuda:", gpus - 1) : std::string(),
                "; use one of them, \"cuda\" or \"auto\"");
  return device;
}

void activate_device(c10::Device device) {
  if (device.is_cpu()) return;
  c10::impl::getDeviceGuardImpl(device.type())->setDevice(device);
}

at::Tensor device_rng_state(c10::Device device) {
  if (device.is_cpu()) return {};
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_device_rng_state(c10::Device device, const at::Tensor& state) {
  if (device.is_cpu() || !state.defined()) return;
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

int64_t kept_large_blocks_mib() {
  int64_t cap_mib = 512;
  if (const char* value = std::getenv("LOOM_KEEP_LARGE_BLOCKS_MIB")) {
    char* end = nullptr;
    errno = 0;
    cap_mib = std::strtoll(value, &end, 10);
    // Out of range (errno) or past what a byte count holds: not a number of MiB either.
    LOOM_CHECK_AS(ConfigError,
                  *value && end && *end == '\0' && errno == 0 && cap_mib >= 0 &&
                      static_cast<uint64_t>(cap_mib) <= (SIZE_MAX >> 20),
                  "environment variable LOOM_KEEP_LARGE_BLOCKS_MIB='", value,
                  "' is not a number of MiB >= 0; use 0 to keep no freed block of 32 MiB or "
                  "more, or unset it for 512");
  }
  return cap_mib;
}

std::string keep_freed_cpu_memory() {
  for (const char* name : {"GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                           "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX"})
    if (std::getenv(name)) return "";
  const bool ok = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 &&
                  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max()) == 1 &&
                  mallopt(M_TOP_PAD, 256 << 20) == 1;
  if (!ok) return "";
  const int64_t cap_mib = kept_large_blocks_mib();
  memory::keep_large_cpu_blocks(static_cast<size_t>(cap_mib) << 20);
  return "malloc keeps freed blocks for reuse (mmap threshold 32 MiB, no trim; blocks of 32 MiB "
         "and more kept for their next use, up to " + std::to_string(cap_mib) +
         " MiB: LOOM_KEEP_LARGE_BLOCKS_MIB; GLIBC_TUNABLES to choose)";
}

void set_job_threads(const ConfigSection& train, int local_world_size) {
  int threads = static_cast<int>(train.get_int("num_threads"));
  LOOM_CHECK_AS(ConfigError, threads >= 0, train.where("num_threads"),
                ": [train] num_threads must be >= 0 (0 = all cores)");
  if (threads == 0) {
    cpu_set_t set;
    const int cores = sched_getaffinity(0, sizeof set, &set) == 0
                          ? CPU_COUNT(&set)
                          : static_cast<int>(std::thread::hardware_concurrency());
    threads = std::max(1, cores / std::max(1, local_world_size));
  }
  cpu::apply_job_isa(train.get_string("cpu_isa"), train.where("cpu_isa"));
  at::set_num_threads(threads);
}

}  // namespace loom
