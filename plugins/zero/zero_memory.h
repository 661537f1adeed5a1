// zero_memory.h — the zero plugin's memory declarations for `loom estimate` (Note [Memory
// declarations] in loom/memory_declarations.h): its stages and offloads as byte terms, and the
// variants of [zero] the estimate's table shows. Torch-free; not the driver's own accounting
// (the log's measured-against-formula line), which shares only Note [ZeRO's model states].
#pragma once

#include <vector>

#include "loom/config.h"
#include "loom/memory_declarations.h"

namespace loom::zero {

void declare_memory(const ConfigSection& table, const memory::MemoryContext& context,
                    memory::MemoryTerms& terms);
std::vector<memory::MemoryVariant> memory_variants();

}  // namespace loom::zero
