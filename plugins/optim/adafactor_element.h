// adafactor_element.h — adafactor's per-element and per-tensor arithmetic, compiled by the C++
// compiler for the CPU loops (adafactor.cpp, adafactor_kernels.inc) and by nvcc for the CUDA
// kernels (cuda/adafactor.cu), so the GPU runs the CPU's own code (Note [loom's own CUDA
// kernels] in cmake/LoomCudaKernels.cmake). Both sides keep each operation's rounding:
// -ffp-contract=off for the plugin, --fmad=false for the kernels; IEEE division and square root.
// No LibTorch header: nvcc reads this file.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace loom::optim {

// step = lr / clip_div, in fp32 from the two fp32 values Transformers divides and multiplies
// by: one multiply per element instead of a division (the update's RMS is over clip_threshold
// on most steps; the division was 16 % of the update loop's samples on AVX2). x = u · step is
// within 1.5 ulp of Transformers' (u / clip_div) · lr, and equal to it when clip_div is 1.
struct AdafactorCoefficients {
  float step, b1, w1, wd;
};

// 1 - t^decay_rate and its complement, rounded to fp32 from double as torch does with
// Python-float scalars.
struct AdafactorBeta2 {
  float keep, add;
};

// A factored tensor's rows are summed in groups of this many (Note [Adafactor's column sums in
// row groups]): about 2^14 gradient elements, and at least 16 rows.
LOOM_OPTIM_HOST_DEVICE int64_t adafactor_group_rows(int64_t C) {
  const int64_t rows = (int64_t{1} << 14) / C;
  return rows > 16 ? rows : 16;
}

// A segment's row groups, by arithmetic (the CPU loops and the CUDA kernels both cut by it):
// group q of matrix m holds global rows m·R + q·S .. min(m·R + (q+1)·S, (m+1)·R); a segment of
// `rows` rows from global row `first_row` meets groups `first` .. `first + count`, numbered
// m·per_matrix + q, and holds the part of each that it meets.
struct AdafactorGroups {
  int64_t S, per_matrix, first, count;
};
LOOM_OPTIM_HOST_DEVICE int64_t adafactor_group_of(const AdafactorGroups& gr, int64_t R,
                                                  int64_t global_row) {
  return global_row / R * gr.per_matrix + global_row % R / gr.S;
}
LOOM_OPTIM_HOST_DEVICE AdafactorGroups adafactor_groups(int64_t rows, int64_t C, int64_t R,
                                                        int64_t first_row) {
  AdafactorGroups gr{};
  gr.S = adafactor_group_rows(C);
  gr.per_matrix = (R + gr.S - 1) / gr.S;
  gr.first = adafactor_group_of(gr, R, first_row);
  gr.count = rows > 0 ? adafactor_group_of(gr, R, first_row + rows - 1) - gr.first + 1 : 0;
  return gr;
}
// Group `index`'s rows in the segment: local rows [k0, k1), all of matrix `matrix`.
LOOM_OPTIM_HOST_DEVICE void adafactor_group_rows_of(const AdafactorGroups& gr, int64_t rows,
                                                    int64_t R, int64_t first_row, int64_t index,
                                                    int64_t& k0, int64_t& k1, int64_t& matrix) {
  matrix = index / gr.per_matrix;
  const int64_t q = index % gr.per_matrix;
  const int64_t begin = matrix * R + q * gr.S;
  const int64_t end = begin + gr.S < (matrix + 1) * R ? begin + gr.S : (matrix + 1) * R;
  const int64_t seg_end = first_row + rows;
  k0 = (begin > first_row ? begin : first_row) - first_row;
  k1 = (end < seg_end ? end : seg_end) - first_row;
}

// The second moment's term of one gradient element: g² + eps1 in fp32 (as torch squares),
// widened once.
LOOM_OPTIM_HOST_DEVICE double adafactor_square_term(float g, float eps) {
  return static_cast<double>(g * g + eps);
}

// w's term (Note [Adafactor in two passes]): g² / r_k as g² · (1 / r_k), in fp32, widened.
LOOM_OPTIM_HOST_DEVICE double adafactor_w_term(float g, float inv_row) {
  return static_cast<double>(g * g * inv_row);
}

// The parameter's RMS term, p² in fp64.
LOOM_OPTIM_HOST_DEVICE double adafactor_p2_term(float p) { return static_cast<double>(p) * p; }

// A vector's update RMS term, g² / v (v the new second moment), in fp64.
LOOM_OPTIM_HOST_DEVICE double adafactor_g2_over_v_term(float g, float v) {
  return static_cast<double>(g) * g / v;
}

// A vector's new second moment b2t v + (1 - b2t)(g² + eps1), in fp32.
LOOM_OPTIM_HOST_DEVICE float adafactor_new_v(float v, float g, float eps, AdafactorBeta2 b2t) {
  return v * b2t.keep + b2t.add * (g * g + eps);
}

// b2t row + (1-b2t) mean_j(g²+eps1) of one row, from the row's sum of g²+eps1.
LOOM_OPTIM_HOST_DEVICE float adafactor_new_row_factor(double sum, int64_t C, float old,
                                                      AdafactorBeta2 b2t) {
  const float mean = static_cast<float>(sum / static_cast<double>(C));
  return old * b2t.keep + b2t.add * mean;
}

// Eight fp64 lanes added pairwise, as every CPU sum over a row or chunk folds them.
LOOM_OPTIM_HOST_DEVICE double adafactor_fold_lanes(const double* a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// After the unclipped update u of an element: x = u · step, momentum (when beta1 > 0: m is
// updated and becomes x), weight decay and the step, in transformers' order. Returns the new p.
LOOM_OPTIM_HOST_DEVICE float adafactor_momentum(float m, float x, const AdafactorCoefficients& c) {
  return m * c.b1 + c.w1 * x;
}
LOOM_OPTIM_HOST_DEVICE float adafactor_decay_and_step(float p, float x,
                                                      const AdafactorCoefficients& c) {
  if (c.wd != 0) p = p + c.wd * p;
  return p - x;
}

// What the step needs besides the tensor's sums: the job's lr or the relative step of t
// (relative_lr), parameter scaling, clipping, weight decay.
struct AdafactorStepInputs {
  double relative_lr, eps2, clip, weight_decay;
  bool scale_parameter;
};

// The step's two fp32 scalars from the whole tensor's sum of p² and the unclipped update's sum
// of squares over its n elements: c.step (lr / clip divisor) and c.wd (-weight_decay · lr).
// Transformers computes the RMS in fp32: the parameter's is rounded to fp32 before it scales.
LOOM_OPTIM_HOST_DEVICE void adafactor_step_scalars(double sum_p2, double sum_u2, double n,
                                                   const AdafactorStepInputs& in,
                                                   AdafactorCoefficients& c) {
  const double param_rms = optim_sqrt(sum_p2 / n);
  const double rms_f = static_cast<double>(static_cast<float>(param_rms));
  const double scale = in.scale_parameter ? (in.eps2 < rms_f ? rms_f : in.eps2) : 1.0;  // std::max
  const double lr = scale * in.relative_lr;
  const double over = optim_sqrt(sum_u2 / n) / in.clip;
  const float clip_div = static_cast<float>(over < 1.0 ? 1.0 : over);  // std::max(over, 1.0)
  c.step = static_cast<float>(lr) / clip_div;
  c.wd = static_cast<float>(-in.weight_decay * lr);
}

}  // namespace loom::optim
