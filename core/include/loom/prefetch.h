// loom/prefetch.h — software prefetch for loom's streaming CPU kernels (the update rules'
// element loops), and for plugins' own. Header-only.
//
// Note [Streams prefetched ahead]: a kernel that walks its arrays front to back asks for each
// array's cache line kPrefetchAhead elements before it reads it. The hardware's prefetcher
// alone left these loops waiting on memory: on the Intel Xeon with AMX this project measures
// on, at 40 M parameters and one thread, adam8bit's AVX-512 kernel took 2.28 ns a parameter
// without the prefetches and 1.36 with them, and the fused AdamW kernels (fp32 state and bf16
// state) took 11-24 % longer without them (docs/BENCHMARKS.md, "Streams prefetched ahead"). Not
// every loop gains: one that only reads one stream (the gradient norm's) was slower with them,
// as the hardware already keeps it fed. The distance is in elements, not bytes, because a
// loop's arrays advance together element by element whatever their element size: 256 elements
// are 1 KB of an fp32 array, 512 B of a bf16 one, 256 B of a byte array, a few hundred
// nanoseconds ahead at these loops' rates, enough to cover the latency of a miss to memory and
// short enough that nothing is evicted before it is read. A prefetch changes no value and never
// faults, so an address past an array's end is harmless (the address is formed as an integer,
// so no out-of-bounds pointer is formed either; tests/plugins/optim: NoKernelReadsPastItsTensors).
#pragma once

#include <cstdint>

namespace loom::cpu {

inline constexpr int64_t kPrefetchAhead = 256;

// Asks for the cache line that holds at[kPrefetchAhead], into every cache level. Always
// inlined: GCC counts __builtin_prefetch as no side effect, so a copy of this function left out
// of line is "const" to it, and calls to it are deleted. That happened to the second loops of
// every adam8bit kernel when this function was defined in the plugin instead (13 % slower,
// docs/BENCHMARKS.md, "adam8bit's AVX2 quantizer by lines"); inlined, the builtin stays.
template <class T>
__attribute__((always_inline)) inline void prefetch_ahead(const T* at) {
  const auto address = reinterpret_cast<uintptr_t>(at) + kPrefetchAhead * sizeof(T);
  __builtin_prefetch(reinterpret_cast<const void*>(address), 0, 3);
}

}  // namespace loom::cpu
