// main() of every GoogleTest binary: GoogleTest's own, after the CPU kernel probe of loom/cpu.h,
// so the tests run on kernels that work on this machine (and their Python references inherit
// the level through ONEDNN_MAX_CPU_ISA).
#include <gtest/gtest.h>

#include <cstring>

#include "loom/cpu.h"

int main(int argc, char** argv) {
  // Listing the tests (CTest's discovery at build time) runs no kernel: no probe, no warning.
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing |= !std::strcmp(argv[i], "--gtest_list_tests");
  if (!listing) loom::cpu::ensure_cpu_kernels_work();
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
