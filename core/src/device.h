// device.h (core-internal) — choosing and activating the compute device, and its RNG state.
// Device-generic (c10's guard registry and ATen's generators): no CUDA header is needed here,
// so the same code is compiled and exercised by CPU-only runs.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <string>

namespace loom {

class ConfigSection;

// CUDA devices this process can see (0 when there is no driver or no GPU).
int cuda_device_count();

// `name` is [train] device (cpu, cuda, cuda:N, auto); `where` is its file:line for errors.
// "auto" and "cuda" take GPU `local_rank` of this node, so each rank of a node gets its own;
// an index past the visible devices, or CUDA where none exists, is a ConfigError naming the key.
c10::Device pick_device(const std::string& name, const std::string& where, int local_rank,
                        int local_world_size);

// Makes `device` the current one of its kind (cudaSetDevice), so that library calls without an
// explicit device (NCCL communicators, cuBLAS handles, the caching allocator) land on it.
void activate_device(c10::Device device);

// The default generator's state of an accelerator device (undefined for the CPU), and back.
at::Tensor device_rng_state(c10::Device device);
void set_device_rng_state(c10::Device device, const at::Tensor& state);

// The process's CPU threads and kernels for a job: [train] cpu_isa applied (before any kernel
// runs, so oneDNN still reads it) and ATen's intra-op threads set to [train] num_threads, or
// (0) the cores this process may use shared among the node's `local_world_size` ranks. A
// negative num_threads is a ConfigError naming the key, said before anything changes.
void set_job_threads(const ConfigSection& train, int local_world_size);

// Note [Freed memory kept]: glibc's malloc gives freed blocks back to the system (trimming the
// heap, and unmapping blocks above its dynamic mmap threshold), so each step's large
// temporaries are faulted in and zeroed again, page by page: 15 % of a bf16 GPT-2 124M step's
// samples were in the kernel, mostly autocast's per-step bf16 weight copies. Fixed settings keep
// them for the next step: blocks up to 32 MiB (glibc's largest mmap threshold) from the heap,
// which is never trimmed and grows by 256 MiB at a time. Measured: the bf16 step 10 % faster at
// the same peak RSS, fp32 unchanged (docs/BENCHMARKS.md). Blocks of 32 MiB and more, which
// glibc always maps afresh, are kept by loom's tracking allocator instead, up to 512 MiB in all
// (Note [Large blocks kept] in memory.cpp). Only for CPU runs, and not when the
// user set glibc's own (GLIBC_TUNABLES or MALLOC_*_ variables). Returns what it did, for the log
// ("" when nothing). ZeRO stage 3 lowers the mmap threshold again afterwards, to return its
// freed weights (Note [Freed weights go back]).
std::string keep_freed_cpu_memory();

// The cap on freed blocks of 32 MiB and more kept for reuse, in MiB (Note [Large blocks kept]
// in memory.cpp): LOOM_KEEP_LARGE_BLOCKS_MIB, else 512. A value that is no number of MiB >= 0
// is a ConfigError naming the variable (a prepared job checks it, so `loom check` refuses it).
int64_t kept_large_blocks_mib();

}  // namespace loom
