// The cheapest program that shows what a configure of loom made of LibTorch
// (no_cuda_toolkit_test.sh): compiled with loom::torch's flags and linked to LibTorch through it,
// it prints the build string `loom --version` prints (device=cpu or device=cuda: whether the
// GPU code compiles in), whether LibTorch sees CUDA, and runs a tensor op.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/ones.h>

#include <iostream>

#include "loom/plugin.h"

int main() {
  const double sum = at::ones({2, 3}).sum().item<double>();
  std::cout << "build " << LOOM_BUILD_STRING << "\n"
            << "cuda " << (at::hasCUDA() ? "available" : "unavailable") << "\n"
            << "ones(2,3).sum() " << sum << "\n";
  return sum == 6.0 ? 0 : 1;
}
