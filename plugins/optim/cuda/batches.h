// batches.h — how the optim plugin's CUDA kernels take many tensors in one launch (Note
// [Adafactor's CUDA kernels in batches] in adafactor.cu): a batch is one kernel parameter
// (`const __grid_constant__ KernelBatch<...>`, read in place, not copied per thread) holding up
// to kKernelBatch tensors, whose thread blocks are numbered one tensor after another; a block
// finds its tensor by bisection. Host-and-device code without CUDA's headers, so the CPU tests
// (tests/plugins/optim/test_cuda_batches.cpp) hold the numbering and the cutting into batches
// that the GPU runs.
#pragma once

#include <cstdint>
#include <vector>

#include "../host_device.h"

namespace loom::optim {

// 64 tensors of ~160 bytes: ~10 KB, within the 32 KB a kernel's parameters may take (CUDA 12.1
// and later, Volta and later).
constexpr int kKernelBatch = 64;

template <typename Item, typename Shared>
struct KernelBatch {
  int count;
  Shared shared;                    // what every tensor of the batch shares (one context)
  int64_t start[kKernelBatch + 1];  // item i's thread blocks: start[i] .. start[i + 1]
  Item item[kKernelBatch];
};

// The item whose blocks hold `block` (start[0] = 0 <= block < start[count]); an item with no
// blocks is never found, as the cutting below leaves such items out.
LOOM_OPTIM_HOST_DEVICE int batch_item_of(const int64_t* start, int count, int64_t block) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (start[mid] <= block)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Cuts `items` into batches of up to kKernelBatch, in order, each item with blocks_of(item)
// thread blocks (items with none left out), and calls launch(batch, blocks) for each batch with
// any blocks; launch returns null or why it failed, and the first failure is returned.
template <typename Item, typename Shared, typename BlocksOf, typename Launch>
const char* for_each_batch(const std::vector<Item>& items, const Shared& shared, BlocksOf blocks_of,
                           Launch launch) {
  for (size_t first = 0; first < items.size();) {
    KernelBatch<Item, Shared> b{};
    b.shared = shared;
    int64_t total = 0;
    for (; first < items.size() && b.count < kKernelBatch; ++first) {
      const int64_t blocks = blocks_of(items[first]);
      if (blocks <= 0) continue;
      b.item[b.count] = items[first];
      b.start[b.count++] = total;
      total += blocks;
    }
    b.start[b.count] = total;
    if (total == 0) continue;
    if (total > 0x7fffffffLL) return "more than 2^31 - 1 thread blocks in one launch";
    if (const char* error = launch(b, static_cast<unsigned>(total))) return error;
  }
  return nullptr;
}

}  // namespace loom::optim
