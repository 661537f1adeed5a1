// loom/memory_control.h — the tracking CPU allocator's settings a host program may choose
// (core/src/memory.cpp), beside the SDK's loom/memory.h: not part of the plugin SDK.
#pragma once

#include <cstddef>

// Exported from libloom_core, which is built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom::memory {

// Note [Large blocks kept] (memory.cpp): freed CPU blocks of 32 MiB and more are kept for the
// next request of their size, up to `cap_bytes` in all; 0 keeps none (the default) and unmaps
// what is kept. Installs the tracker if needed. CPU runs set it (Note [Freed memory kept] in
// core/src/device.h).
void keep_large_cpu_blocks(size_t cap_bytes);

}  // namespace loom::memory

#pragma GCC visibility pop
