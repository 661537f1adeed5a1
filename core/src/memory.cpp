// Memory accounting: the tracking CPU allocator, CUDA caching-allocator stats, RSS, and
// byte formatting.
#include "loom/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_runtime.h"
#include "loom/error.h"
#include "loom/memory_control.h"

namespace loom::memory {
namespace {

// Wraps the default CPU allocator. Note [Tracker header]: each allocation carries a 64-byte
// header in front of the data (the wrapped allocation's context and deleter, and the size), so
// the free subtracts exactly what the allocation added, whichever thread frees it — and the
// DataPtr's context is its data pointer, as c10::Allocator::raw_allocate requires (oneDNN's
// bf16 kernels allocate through it). 64 bytes keep the data as aligned as the wrapped
// allocator made the block.
class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return inner_->allocate(0);  // no memory, nothing to count
    Header* header = nullptr;
    c10::Device device(c10::kCPU);
    const size_t mapped = huge_blocks_.load(std::memory_order_relaxed) ? huge_span(n) : 0;
    const size_t kept = mapped ? 0 : keepable_span(n);
    char* base = mapped ? map_huge(mapped) : kept ? take_kept_or_map(kept) : nullptr;
    if (base != nullptr) {
      header = reinterpret_cast<Header*>(base);
      header->deleter = nullptr;
      header->context = nullptr;
      header->mapped = static_cast<int64_t>(mapped ? mapped : kept);
      header->keepable = kept != 0;
    } else {
      c10::DataPtr inner = inner_->allocate(n + kHeaderBytes);
      device = inner.device();
      base = static_cast<char*>(inner.get());
      header = reinterpret_cast<Header*>(base);
      LOOM_INTERNAL_ASSERT(base != nullptr && inner.get_context() != nullptr,
                           "the CPU allocator returned no memory for ", n, " bytes");
      header->deleter = inner.get_deleter();
      header->context = inner.release_context();
      header->mapped = 0;
      header->keepable = false;
    }
    header->bytes = static_cast<int64_t>(n);
    header->owner = this;
    void* data = base + kHeaderBytes;
    const int64_t now = current_.fetch_add(header->bytes) + header->bytes;
    live_.fetch_add(1);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, data, &release, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  Stats stats() const { return {current_.load(), peak_.load(), live_.load()}; }
  void reset_peak() { peak_.store(current_.load()); }
  void set_huge_blocks(bool on) { huge_blocks_.store(on); }
  void set_kept_cap(size_t cap) {
    std::vector<std::pair<size_t, char*>> dropped;
    {
      std::lock_guard<std::mutex> lock(kept_mutex_);
      kept_cap_.store(cap);
      while (kept_bytes_ > cap) {  // the oldest first
        dropped.push_back(kept_.front());
        kept_bytes_ -= kept_.front().first;
        kept_.erase(kept_.begin());
      }
    }
    for (const auto& [span, block] : dropped) munmap(block, span);
  }

 private:
  struct Header {
    c10::DeleterFnPtr deleter;  // frees the block through the wrapped allocator
    void* context;              // the wrapped allocation's context
    int64_t bytes;
    TrackingAllocator* owner;
    int64_t mapped;  // > 0: a block of its own mapping (map_huge or kept), this many bytes
    bool keepable;   // a mapping that may be kept for reuse when freed (Note [Large blocks kept])
  };
  static constexpr size_t kHeaderBytes = 64;
  static_assert(sizeof(Header) <= kHeaderBytes);

  // Note [Large blocks in huge pages]: ZeRO stage 3 returns the memory it frees (Note [Freed
  // weights go back]), so each step its gathered weights and its activations are mapped anew.
  // glibc maps them page by page: each 4 KiB page of a fresh block is a fault (an exception,
  // a page from the allocator, the memory cgroup's charge, the zeroing), 17.2-17.5 M faults and
  // 58-63 s of system time over 5 steps of GPT-2 124M on 2 ranks (2.7 M faults with the blocks
  // kept in the heap). Blocks of 2 MiB and more are therefore mapped here, each by itself,
  // starting on a 2 MiB boundary and advised to transparent huge pages: they fault in 2 MiB at
  // a time (1.48 M faults, 33-37 s of system time: what is left is mostly the zeroing, which
  // only keeping the blocks avoids; the step 1.13x faster) and go back with munmap when freed.
  // The mapping ends at the block's last 4 KiB page, so its last partial 2 MiB stays in small
  // pages and no block holds more than its own pages (rank 0's peak RSS 1.83 -> 1.72 GiB).
  // Where THP is off ("never"), the advice does nothing and the blocks behave as glibc's mapped
  // ones. Not glibc's hugetlb tunable nor LibTorch's THP_MEM_ALLOC_ENABLE: both are read once,
  // at start or at the first allocation, before a job says it runs stage 3.
  // docs/BENCHMARKS.md "Stage 3's returned blocks in huge pages".
  static size_t huge_span(size_t n) {
    const size_t need = n + kHeaderBytes;
    return need < kHugePage ? 0 : (need + kSmallPage - 1) / kSmallPage * kSmallPage;
  }
  // A fresh mapping of `span` bytes starting on a 2 MiB boundary, advised to transparent huge
  // pages; nullptr when the system refuses it (the caller falls back to the wrapped allocator).
  static char* map_huge(size_t span) {
    void* raw = mmap(nullptr, span + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
    if (aligned > start) munmap(raw, aligned - start);  // the unaligned head and tail go back
    const uintptr_t end = start + span + kHugePage;
    if (end > aligned + span) munmap(reinterpret_cast<void*>(aligned + span), end - aligned - span);
    char* base = reinterpret_cast<char*>(aligned);
    madvise(base, span, MADV_HUGEPAGE);  // a hint: where THP is off the block works all the same
    return base;
  }
  static constexpr size_t kHugePage = size_t{2} << 20, kSmallPage = 4096;

  // Note [Large blocks kept]: glibc maps every block above its largest mmap threshold (32 MiB)
  // afresh and unmaps it when freed (unless its heap's free top can hold it: with no trim and a
  // top pad, as Note [Freed memory kept] sets them, it may carve the block from there, old
  // bytes and all), so each step faults in and zeroes the same few large tensors again, page
  // by page: an untied vocabulary's embedding and head gradients (98 MiB each at Llama ~124M)
  // and the fused loss's logits buffer. 2.8 % of that step was page faults.
  // With a cap set (keep_large_cpu_blocks, CPU runs: Note [Freed memory kept] in device.h)
  // blocks of 32 MiB and more are mappings of their own, and a freed one is kept, up to the cap
  // in all, for the next request of exactly its size (its pages, 4 KiB-rounded); past the cap
  // it is unmapped as before. A step asks for the same sizes every time, so what is kept is
  // what the next step takes back (docs/BENCHMARKS.md, "Large blocks kept"). Kept blocks count
  // in the RSS, not in the tracked bytes. Stage 3's huge-page blocks are never kept.
  size_t keepable_span(size_t n) const {
    const size_t need = n + kHeaderBytes;
    if (kept_cap_.load(std::memory_order_relaxed) == 0 || need < kKeptFrom) return 0;
    return (need + kSmallPage - 1) / kSmallPage * kSmallPage;
  }
  char* take_kept_or_map(size_t span) {
    {
      std::lock_guard<std::mutex> lock(kept_mutex_);
      for (auto it = kept_.rbegin(); it != kept_.rend(); ++it)  // the newest first
        if (it->first == span) {
          char* block = it->second;
          kept_bytes_ -= span;
          kept_.erase(std::next(it).base());
          return block;
        }
    }
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return raw == MAP_FAILED ? nullptr : static_cast<char*>(raw);
  }
  // Keeps a freed block if the cap allows; false: the caller unmaps it.
  bool keep(char* block, size_t span) {
    std::lock_guard<std::mutex> lock(kept_mutex_);
    if (kept_bytes_ + span > kept_cap_.load()) return false;
    kept_.emplace_back(span, block);
    kept_bytes_ += span;
    return true;
  }
  static constexpr size_t kKeptFrom = size_t{32} << 20;

  static void release(void* data) {
    if (data == nullptr) return;  // a 0-byte raw_allocate (oneDNN asks for those) gave nullptr
    auto* header = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeaderBytes);
    header->owner->current_.fetch_sub(header->bytes);
    header->owner->live_.fetch_sub(1);
    if (header->mapped > 0) {
      const size_t span = static_cast<size_t>(header->mapped);
      if (!header->keepable || !header->owner->keep(reinterpret_cast<char*>(header), span))
        munmap(header, span);
      return;
    }
    const c10::DeleterFnPtr deleter = header->deleter;
    void* context = header->context;
    if (deleter) deleter(context);
  }

  c10::Allocator* inner_;
  std::mutex kept_mutex_;
  std::vector<std::pair<size_t, char*>> kept_;  // (span, block), oldest first
  size_t kept_bytes_ = 0;
  std::atomic<size_t> kept_cap_{0};
  std::atomic<int64_t> current_{0}, peak_{0}, live_{0};
  std::atomic<bool> huge_blocks_{false};
};

TrackingAllocator* g_tracker = nullptr;
std::once_flag g_install_once;

int64_t read_status_kib(const char* field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(field) + ":";
  while (std::getline(status, line)) {
    if (line.rfind(prefix, 0) == 0) {
      std::istringstream in(line.substr(prefix.size()));
      int64_t kib = 0;
      in >> kib;
      return kib * 1024;
    }
  }
  return 0;
}

}  // namespace

void install_cpu_tracker() {
  std::call_once(g_install_once, [] {
    // Never freed: tensors alive at exit still hold contexts that point at it.
    g_tracker = new TrackingAllocator(c10::GetDefaultCPUAllocator());
    // Priority above the default (0) so later SetCPUAllocator calls of lower priority lose.
    c10::SetCPUAllocator(g_tracker, /*priority=*/10);
  });
}

bool cpu_tracker_installed() { return g_tracker != nullptr; }

Stats cpu_stats() { return g_tracker ? g_tracker->stats() : Stats{}; }

void map_large_cpu_blocks(bool on) {
  install_cpu_tracker();
  g_tracker->set_huge_blocks(on);
}

void keep_large_cpu_blocks(size_t cap_bytes) {
  install_cpu_tracker();
  g_tracker->set_kept_cap(cap_bytes);
}

void reset_cpu_peak() {
  if (g_tracker) g_tracker->reset_peak();
}

Stats device_stats(c10::Device device) {
  if (device.is_cuda()) {
    const CudaRuntime* cuda = cuda_runtime();
    LOOM_CHECK(cuda, "memory statistics for ", device.str(), ": LibTorch's CUDA half is ",
               cuda_runtime_status());
    // Before the first CUDA allocation the caching allocator has no devices yet (asking it
    // then is "Invalid device argument"): nothing is allocated.
    if (!cuda->allocator_initialized()) return {};
    Stats stats;
    cuda->allocated_bytes(device.index(), &stats.current_bytes, &stats.peak_bytes,
                          &stats.allocations);
    return stats;
  }
  LOOM_CHECK(device.is_cpu(), "memory statistics for ", device.str(),
             " are not available in this build");
  return cpu_stats();
}

void reset_device_peak(c10::Device device) {
  if (device.is_cuda()) {
    const CudaRuntime* cuda = cuda_runtime();
    if (cuda && cuda->allocator_initialized()) cuda->reset_peak(device.index());
    return;
  }
  reset_cpu_peak();
}

int64_t peak_rss_bytes() { return read_status_kib("VmHWM"); }
int64_t current_rss_bytes() { return read_status_kib("VmRSS"); }

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (std::abs(value) >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, unit == 0 ? "%.0f %s" : "%.2f %s", value, units[unit]);
  return buffer;
}

std::string ModelState::describe() const {
  auto per_param = [&](int64_t bytes) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%.2f B/param",
                  param_count ? static_cast<double>(bytes) / param_count : 0.0);
    return std::string(buffer);
  };
  std::ostringstream out;
  out << "params " << param_count << " (" << trainable_count << " trainable): weights "
      << format_bytes(param_bytes) << " (" << per_param(param_bytes) << ")";
  if (master_bytes) out << ", fp32 master " << format_bytes(master_bytes);
  out << ", grads " << format_bytes(grad_bytes) << ", optimizer state "
      << format_bytes(optimizer_bytes) << " (" << per_param(optimizer_bytes)
      << "), total " << format_bytes(total()) << " (" << per_param(total()) << ")";
  return out.str();
}

int64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

void check_model_fits(double params, const std::string& where, const std::string& keys) {
  const double need = params * 4.0;  // fp32 weights, before gradients or optimizer state
  const auto have = static_cast<double>(physical_memory_bytes());
  if (have <= 0 || need <= have) return;
  const auto shown = [](double bytes) {
    return bytes < 9e18 ? format_bytes(static_cast<int64_t>(bytes)) : detail::cat(bytes, " B");
  };
  throw ConfigError(detail::cat(where, ": [model] ", keys, " make a model of about ", params,
                                " parameters, whose fp32 weights alone need ", shown(need),
                                "; this machine has ", shown(have),
                                " of memory: choose smaller sizes"));
}

ZeroModelStates zero_model_states(int stage, double world_size, double trainable, double sharded,
                                  double weight, double master, double state) {
  const double n = std::max(world_size, 1.0);
  ZeroModelStates z;
  z.weights = stage >= 3 ? weight * (trainable - sharded) + weight * sharded / n : weight * trainable;
  z.grads = stage >= 2 ? weight * trainable / n : weight * trainable;
  z.masters = stage >= 1 ? master * trainable / n : master * trainable;
  z.optimizer = stage >= 1 ? state * trainable / n : state * trainable;
  return z;
}

}  // namespace loom::memory
