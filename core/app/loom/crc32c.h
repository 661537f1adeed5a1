// loom/crc32c.h — CRC-32C (Castagnoli, iSCSI's polynomial 0x1EDC6F41, reflected, ~0 in and
// out): the one implementation behind TensorBoard's TFRecord frames and the NVMe swap file's
// region checks. Torch-free. Not a cryptographic hash: it detects accidents (bit flips, stale or
// truncated data), not tampering. In app/, not the SDK: no plugin needs it yet, and a new SDK
// header would change every plugin's ABI digest (Note [SDK digest] in loom/plugin.h);
// libloom_offload sees app/ through loom::core's build interface.
//
// Note [CRC-32C paths]: two paths give bit-identical results, chosen once per process at run
// time (cpuid), so one binary runs on any x86-64 and on other architectures:
//   sse42     x86-64 with SSE4.2 and PCLMULQDQ: in 8 KiB rounds, the crc32 instruction over
//             four interleaved streams (it takes 3 cycles and issues one per cycle, so independent
//             streams keep it busy) while carry-less multiplies fold a fifth part on another
//             execution port (Note [Folding beside crc32] in crc32c.cpp); the parts joined by
//             one carry-less multiply each (crc · x^(8n) mod P moves a CRC past n bytes);
//             shorter data by three crc32 streams. crc32 streams alone peak at 8 bytes a cycle
//             (20 GB/s at 2.5 GHz); with the folding beside them, about 28 GB/s a core on the
//             2.5 GHz Xeon of docs/BENCHMARKS.md (NVMe section, issue 39), data in cache.
//   software  slice-by-8 tables, for any CPU (and any other architecture); 1.6 GB/s there.
// crc32c_with() runs a named path, so the tests compare the two on whatever CPU they find.
#pragma once

#include <cstddef>
#include <cstdint>

// Exported from libloom_core, which is built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom {

// The CRC-32C of `size` bytes. `crc` continues an earlier one: crc32c(b, nb, crc32c(a, na)) is
// the CRC of a followed by b (as zlib's crc32() and the reference check value "123456789" ->
// 0xE3069283 use it).
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

enum class Crc32cPath { software, sse42 };

// The path crc32c() takes on this CPU, and its name ("sse42", "software").
Crc32cPath crc32c_path();
const char* crc32c_path_name(Crc32cPath path);

// crc32c() through the named path; Error naming the path if this CPU cannot run it.
uint32_t crc32c_with(Crc32cPath path, const void* data, size_t size, uint32_t crc = 0);

}  // namespace loom

#pragma GCC visibility pop
