// device.h (core-internal) — choosing and activating the compute device, and its RNG state.
// Device-generic (c10's guard registry and ATen's generators): no CUDA header is needed here,
// so the same code is compiled and exercised by CPU-only runs.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <string>

namespace loom {

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

}  // namespace loom
