// main() of every GoogleTest binary: GoogleTest's own, after the CPU kernel probe of loom/cpu.h,
// so the tests run on kernels that work on this machine (and their Python references inherit
// the level through ONEDNN_MAX_CPU_ISA); jobs may name plugin folders, as with
// --allow-job-plugins.
#include <gtest/gtest.h>

#include <cstring>

#include "loom/cpu.h"
#include "loom/trainer.h"

int main(int argc, char** argv) {
  // Listing the tests (CTest's discovery at build time) runs no kernel: no probe, no warning.
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing |= !std::strcmp(argv[i], "--gtest_list_tests");
  if (!listing) loom::cpu::ensure_cpu_kernels_work();
  // The tests' jobs name the test plugins' folder in [plugins] path: they are this suite's own
  // files, so the suite allows it as a user would with --allow-job-plugins (Note [Job plugin
  // paths]); the tests of the refusal switch it off for themselves.
  loom::allow_job_plugins();
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
