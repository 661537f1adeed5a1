// Loading libloom_cuda.so: Note [CUDA loaded on demand] in cuda_runtime.h.
#include "cuda_runtime.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

namespace loom {
namespace {

#ifdef LOOM_WITH_CUDA
bool exists(const char* path) { return ::access(path, F_OK) == 0; }

// Where an NVIDIA GPU can be in use: the driver's control node and /proc entry (bare metal,
// containers given GPUs), or WSL's paravirtual GPU.
bool gpu_driver_present() {
  return exists("/dev/nvidiactl") || exists("/proc/driver/nvidia/version") || exists("/dev/dxg");
}
#endif

struct Loaded {
  const CudaRuntime* runtime = nullptr;
  std::string status;
};

Loaded load() {
#ifndef LOOM_WITH_CUDA
  return {nullptr, "not built (a CPU build of loom)"};
#else
  const char* force = std::getenv("LOOM_LOAD_CUDA");
  const std::string forced = force ? force : "";
  if (forced == "0") return {nullptr, "not loaded (LOOM_LOAD_CUDA=0)"};
  if (forced != "1" && !gpu_driver_present())
    return {nullptr, "not loaded: no GPU driver on this machine (LOOM_LOAD_CUDA=1 loads it)"};
  // Beside this library, in the build tree and in an install alike.
  Dl_info self{};
  if (::dladdr(reinterpret_cast<void*>(&cuda_runtime), &self) == 0 || !self.dli_fname)
    return {nullptr, "not loaded: libloom_core's own path is unknown"};
  std::string path = self.dli_fname;
  path = path.substr(0, path.rfind('/') + 1) + "libloom_cuda.so";
  // Global, as when it was linked: plugins built against the CUDA half resolve against it.
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (!handle) {
    const char* why = ::dlerror();
    return {nullptr, "failed to load: " + std::string(why ? why : path)};
  }
  using Entry = const CudaRuntime* (*)();
  auto entry = reinterpret_cast<Entry>(::dlsym(handle, "loom_cuda_runtime_v1"));
  if (!entry) return {nullptr, "failed to load: " + path + " has no loom_cuda_runtime_v1"};
  return {entry(), "loaded from " + path};
#endif
}

const Loaded& loaded() {
  static const Loaded once = load();
  return once;
}

// At load time of libloom_core, before anything asks ATen about CUDA (see the Note).
[[maybe_unused]] const bool g_loaded_early = (loaded(), true);

}  // namespace

const CudaRuntime* cuda_runtime() { return loaded().runtime; }
std::string cuda_runtime_status() { return loaded().status; }

}  // namespace loom
