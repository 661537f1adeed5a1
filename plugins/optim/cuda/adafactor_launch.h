// adafactor_launch.h — adafactor's CUDA kernels' launchers (adafactor.cu), declared without
// CUDA's headers so adafactor.cpp (compiled by the C++ compiler, LibTorch's CPU half only) can
// call them. Each takes `count` tensors (update_many's whole step, or one segment) and queues
// their work on `stream` (a cudaStream_t of the current GPU), a few launches for all of them
// (Note [Adafactor's CUDA kernels in batches]); it returns null, or the CUDA runtime's words
// for why a launch failed. Scratch is on the GPU: each tensor's share (the *_scratch sizes)
// one after another, in the tensors' order.
#pragma once

#include <cstdint>

#include "../adafactor_element.h"

namespace loom::optim {

// One segment of a factored tensor (rank >= 2, viewed as M matrices R x C; the segment holds
// whole rows `first_row` .. `first_row + rows` of the M·R), all on one GPU, fp32 and contiguous,
// and its accumulator (Note [Adafactor in two passes] in adafactor.cpp, on the same GPU):
// [column sums (M·C) | w (M·C) | row-factor sums (M) | row factors (M·R) | sum p²].
struct AdafactorFactored {
  float* p;
  const float* g;
  float* m;    // exp_avg, or null without momentum
  float* row;  // exp_avg_sq_row: the segment's rows
  float* col;  // exp_avg_sq_col: the whole tensor's M·C
  double* acc;
  int64_t rows, C, R, M, first_row;
  float eps1;
  AdafactorBeta2 b2t;
  bool with_p2;  // scale_parameter: the parameter's RMS is needed
};

// Doubles of scratch accumulate needs for t: each row group's column sums and w.
int64_t adafactor_factored_scratch(const AdafactorFactored& t);
// Round 0 of factored segments (adafactor.cpp's accumulate, the same sums to the bit but for
// the row-factor sums and sum p², which are added in a tree, not in row order).
const char* launch_adafactor_accumulate_factored(const AdafactorFactored* t, int64_t count,
                                                 double* scratch, void* stream);
// Floats of scratch update needs for t (a multiple of four): the update's sum of squares in
// shares, the new column factors' 1/sqrt, each matrix's row mean.
int64_t adafactor_factored_update_scratch(const AdafactorFactored& t);
// The update from the reduced accumulators (t.acc): new factors into t.row and t.col, p and m.
// `base` carries momentum's weights (step and wd are computed on the GPU from the totals).
const char* launch_adafactor_update_factored(const AdafactorFactored* t, int64_t count,
                                             const AdafactorStepInputs& in,
                                             const AdafactorCoefficients& base, float* scratch,
                                             void* stream);

// One segment of a vector (rank 1): elements `offset` .. `offset + n` of `numel`; v is
// exp_avg_sq; acc is [sum g²/v | sum p²].
struct AdafactorVector {
  float* p;
  const float* g;
  float* m;
  float* v;
  double* acc;
  int64_t n, offset, numel;
  float eps1;
  AdafactorBeta2 b2t;
  bool with_p2;
};
// Doubles of scratch accumulate needs for t: its thread blocks' two sums.
int64_t adafactor_vector_scratch(const AdafactorVector& t);
const char* launch_adafactor_accumulate_vector(const AdafactorVector* t, int64_t count,
                                               double* scratch, void* stream);
const char* launch_adafactor_update_vector(const AdafactorVector* t, int64_t count,
                                           const AdafactorStepInputs& in,
                                           const AdafactorCoefficients& base, void* stream);

}  // namespace loom::optim
