// adafactor: Shazeer & Stern 2018 with the arithmetic and defaults of Transformers' Adafactor
// (relative step, parameter scaling, update clipping, decay 1 - t^-0.8; or the Trainer's
// optim="adafactor": the job's lr, no scaling). Factored second moment for rank >= 2, full for
// vectors. Two implementations of the same arithmetic: raw loops over CPU fp32 tensors, and
// tensor ops for any device (CUDA: no host round trip, no sync); `kernel` picks, and the tests
// hold the tensor ops to the loops on the CPU.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <vector>

#include "adafactor_element.h"
#include "loom/kernel_isa.h"
#include "loom/prefetch.h"
#include "rules.h"
#if defined(LOOM_OPTIM_CUDA_KERNELS)
#include <c10/core/DeviceGuard.h>

#include "cuda/adafactor_launch.h"
#endif

namespace loom::optim {
namespace {

// Where a segment sits in its tensor. Rank >= 2 is viewed as M matrices (R, C) (leading dims
// folded into M); the segment holds whole rows of C (the `row` granularity: cuts between rows
// of dim 0, which for rank >= 3 are whole matrices). Vectors: one "row" per element.
struct Geometry {
  bool factored = false;
  int64_t numel = 1, R = 1, C = 1, M = 1;
  int64_t first_row = 0, rows = 0;  // global row index of the segment's first row, its row count

  explicit Geometry(const Segment& s) {
    for (int64_t d : s.shape) numel *= d;
    factored = s.shape.size() >= 2;
    if (factored) {
      C = s.shape.back();
      R = s.shape[s.shape.size() - 2];
      M = numel / (R * C);
    }
    first_row = s.offset / C;
    rows = s.param.numel() / C;
  }
  int64_t matrix(int64_t k) const { return (first_row + k) / R; }  // of local row k
};

// ---- CPU kernels (adafactor_kernels.inc). Sums run in fp64 over eight fixed lanes, folded in
// lane order: the result depends on the row alone, never on threads or on where a shard cuts the
// tensor.

// Note [Adafactor's sums stay fp64 per element]: the column sums and w add every element's fp32
// term in fp64, one widening each. That is what keeps them independent of where the rows are cut: a
// sum of fp32 terms in fp64 is near exact (relative error ~n·2^-53), so its rounding to the fp32
// factor does not depend on how the additions are grouped, and a ZeRO shard cut at any row gives
// the bits of one process (OptimConformance.SplitRunsAreBitIdenticalToUnsplit; the offload tests
// that train adafactor bitwise). fp32 partials of four rows, widened once per four rows, would cut
// the widenings by four but tie the bits to where the four-row blocks fall: on a 390 x 1024
// gradient, a cut at row 17, 101, 195 or 202 changed 81 to 117 of the 1024 fp32 column means
// against the uncut sum (none with the per-element fp64 sums; docs/BENCHMARKS.md, 2026-11-27 second
// session). w feeds only the clipping divisor, but through the same kind of rounding. The row sums
// have no such constraint (a row is never cut); fp32 row lanes flushed to fp64 every 64 columns
// were measured instead, and ran 0.94x as fast in L1: the row's adds are not what bounds
// sum_four_rows_and_columns (on AVX2 it runs at ~0.5 cycles per element in L1, one port-0/1
// operation per element: square, eps, widen, and the column's fp64 add), so the rows keep their
// fp64 lanes and their bits.

// Rows summed and folded together (adafactor_kernels.inc's sum_four_rows_and_columns, fold_w).
constexpr int64_t kFoldRows = 4;

// Rows k in [begin, end) of the segment, all in one matrix (Note [Adafactor's column sums in
// row groups]).
struct RowGroup {
  int64_t begin, end, matrix;
};

// About 2^14 gradient elements per group and at least 16 rows, so a kept partial (16 bytes per
// column, written once and read once) costs at most 1 byte per parameter against the 16 the
// update moves. The groups are small so that two threads get nearly equal shares of a tensor:
// at 2^17 (when the fold was a pass of its own over a group in L2) a matrix of 390 rows of 1024
// was 4 groups, cut 256 rows to 134 between two threads; at 2^14 it is 25, cut 192 to 198
// (accumulate() cuts the threads' shares by rows).
std::vector<RowGroup> row_groups(const Geometry& geo) {
  const AdafactorGroups gr = adafactor_groups(geo.rows, geo.C, geo.R, geo.first_row);
  std::vector<RowGroup> groups;
  for (int64_t i = 0; i < gr.count; ++i) {
    RowGroup g{};
    adafactor_group_rows_of(gr, geo.rows, geo.R, geo.first_row, gr.first + i, g.begin, g.end,
                            g.matrix);
    groups.push_back(g);
  }
  return groups;
}

// n doubles of `buffer` from a 64-byte boundary (a vector's own alignment, 16, splits every
// other 64-byte access across two cache lines: the fold ran 1.2x slower into one). The groups'
// partials, 2·C doubles apart, then start on boundaries too when C is a multiple of 4.
double* cache_aligned(std::vector<double>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n + 8) buffer.resize(n + 8);
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((64 - address % 64) % 64) / sizeof(double);
}

// The step's scalars (AdafactorCoefficients, adafactor_element.h: the CUDA kernels' too).
using Coefficients = AdafactorCoefficients;

// Element j of the step from its unclipped update u: x = u · lr / clip_div, then momentum,
// weight decay and the step, in transformers' order (adafactor_element.h). Inlined into each
// clone below.
__attribute__((always_inline)) inline void step_element(float u, int64_t j, float* __restrict p,
                                                        float* __restrict m, const Coefficients& c) {
  float x = u * c.step;
  if (m) {
    m[j] = adafactor_momentum(m[j], x, c);
    x = m[j];
  }
  p[j] = adafactor_decay_and_step(p[j], x, c);
}

// Note [Adafactor's kernels per ISA]: the loops of adafactor_kernels.inc, compiled for AVX-512
// (x86-64-v4), AVX2 (x86-64-v3) and the baseline, and picked per update by
// loom::cpu::kernel_isa(), so LOOM_KERNEL_ISA runs the AVX2 loops on an AVX-512 machine (Note
// [Kernel ISA cap]; they were target_clones, which the CPU alone picks). No FMA contraction
// (-ffp-contract=off), so every copy rounds alike: the optimizer tests compare them bit for bit.
#if defined(__x86_64__)
namespace isa_avx512 {
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#include "adafactor_kernels.inc"
#pragma GCC pop_options
}  // namespace isa_avx512
namespace isa_avx2 {
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#include "adafactor_kernels.inc"
#pragma GCC pop_options
}  // namespace isa_avx2
#endif
namespace isa_baseline {
#include "adafactor_kernels.inc"
}  // namespace isa_baseline

struct Kernels {
  decltype(&isa_baseline::sum_row_and_columns) sum_row_and_columns;
  decltype(&isa_baseline::sum_four_rows_and_columns) sum_four_rows_and_columns;
  decltype(&isa_baseline::sum_of_squares) sum_of_squares;
  decltype(&isa_baseline::fold_w) fold_w;
  decltype(&isa_baseline::add_columns) add_columns;
  decltype(&isa_baseline::update_row) update_row;
  decltype(&isa_baseline::sum_of_g2_over_v) sum_of_g2_over_v;
  decltype(&isa_baseline::update_vector) update_vector;
};
#define LOOM_ADAFACTOR_KERNELS(ns)                                                        \
  Kernels {                                                                               \
    ns::sum_row_and_columns, ns::sum_four_rows_and_columns, ns::sum_of_squares, ns::fold_w, \
        ns::add_columns, ns::update_row, ns::sum_of_g2_over_v, ns::update_vector            \
  }
// The copy this call runs (reads LOOM_KERNEL_ISA: once per update, not per row).
const Kernels& kernels() {
#if defined(__x86_64__)
  static const Kernels avx512 = LOOM_ADAFACTOR_KERNELS(isa_avx512);
  static const Kernels avx2 = LOOM_ADAFACTOR_KERNELS(isa_avx2);
#endif
  static const Kernels baseline = LOOM_ADAFACTOR_KERNELS(isa_baseline);
#if defined(__x86_64__)
  switch (cpu::kernel_isa()) {
    case cpu::KernelIsa::avx512: return avx512;
    case cpu::KernelIsa::avx2: return avx2;
    case cpu::KernelIsa::scalar: break;
  }
#endif
  return baseline;
}
#undef LOOM_ADAFACTOR_KERNELS

// Elements per chunk of a vector's sums (Note [Adafactor's column sums in row groups]).
constexpr int64_t kVectorChunk = int64_t{1} << 14;

class Adafactor final : public UpdateRule {
 public:
  explicit Adafactor(const ConfigSection& c)
      : eps1_(c.get_float("eps1")),
        eps2_(c.get_float("eps2")),
        clip_(c.get_float("clip_threshold")),
        decay_rate_(c.get_float("decay_rate")),
        beta1_(beta_in_range(c, "beta1")),
        scale_parameter_(c.get_bool("scale_parameter")),
        relative_step_(c.get_bool("relative_step")),
        warmup_init_(c.get_bool("warmup_init")),
        kernel_(kernel_in(c, "adafactor", {"auto", "cpu_loops", "tensor_ops"})) {
    LOOM_CHECK_AS(ConfigError, eps1_ >= 0 && eps2_ >= 0, c.where("eps1"),
                  ": [optimizer] eps1 and eps2 must be >= 0");
    LOOM_CHECK_AS(ConfigError, clip_ > 0, c.where("clip_threshold"),
                  ": [optimizer] clip_threshold must be > 0, got ", clip_);
    LOOM_CHECK_AS(ConfigError, decay_rate_ < 0, c.where("decay_rate"),
                  ": [optimizer] decay_rate must be negative (1 - t^decay_rate), got ", decay_rate_,
                  "; the default is -0.8");
    LOOM_CHECK_AS(ConfigError, !warmup_init_ || relative_step_, c.where("warmup_init"),
                  ": [optimizer] warmup_init = true needs relative_step = true");
  }
  std::string name() const override { return "adafactor"; }
  Partitioning partitioning() const override { return {Granularity::row, 1}; }

  NamedTensors init_state(const Segment& s) const override {
    const Geometry geo(s);
    auto f32 = s.param.options();
    NamedTensors state;
    if (geo.factored) {
      state.emplace_back("exp_avg_sq_row", at::zeros({geo.rows}, f32));
      state.emplace_back("exp_avg_sq_col", at::zeros({geo.M * geo.C}, f32));  // whole tensor
    } else {
      state.emplace_back("exp_avg_sq", at::zeros_like(s.param));
    }
    if (beta1_ > 0) state.emplace_back("exp_avg", at::zeros_like(s.param));
    return state;
  }

  // Note [Adafactor in two passes]: one reduction round whose accumulator holds everything the
  // update needs from the whole tensor. The update's RMS, before clipping, comes from round 0 too:
  // u_kj² = (row_mean/r_k)(1/c_j) g_kj² (r, c the new factors), so sum u² = sum over matrices m
  // and columns j of row_mean_m / c_mj · w_mj with w_mj = sum over m's rows k of g_kj² / r_k. w
  // is folded with the column sums, so the gradient is read once to reduce and once to update.
  // Each row's new factor r_k is also carried to the update in the accumulator, at its global
  // row, so the update does not sum the row's g² again (the two sums were 46 % of the loops'
  // time on AVX2, docs/BENCHMARKS.md). A driver sums accumulators over ranks; each row belongs
  // to one rank's segment and the others add 0.0, so the factor arrives exactly (a positive
  // double plus zeros); 8 bytes per row, 2/C of the fp32 gradient's bytes.
  // Factored: [column sums of g²+eps1 (M*C) | w (M*C) | sums of the new row factor (M) |
  //            the new row factors (M*R) | sum p²].
  // Vectors: [sum g²/v (v the new second moment) | sum p²].
  int reduction_rounds() const override { return 1; }
  static int64_t accumulator_size(const Geometry& geo) {
    return geo.factored ? 2 * geo.M * geo.C + geo.M + geo.M * geo.R + 1 : 2;
  }
  at::Tensor make_accumulator(const Segment& s, int) const override {
    const Geometry geo(s);
    const int64_t size = accumulator_size(geo);
    // The tensor-op path folds into it on the parameter's device, without a host sync.
    return at::zeros({size}, at::TensorOptions().dtype(at::kDouble).device(
                                 use_loops(s) ? c10::Device(c10::kCPU) : s.param.device()));
  }

  void accumulate(const Segment& segment, const UpdateContext& ctx, int,
                  at::Tensor& acc) const override {
    if (cuda_kernels(segment)) return cuda_accumulate(segment, ctx, acc);
    if (!use_loops(segment)) return tensor_ops_accumulate(segment, ctx, acc);
    const Kernels& kern = kernels();
    const Cpu s(segment);
    const Geometry geo(segment);
    const Beta2 b2t = beta2t(ctx.step);
    double* a = acc.data_ptr<double>();
    if (!geo.factored) {
      // Fixed chunks of the vector, aligned to its global indices (as the row groups below):
      // each chunk's sums in fp64 lanes, then added in chunk order.
      const float* v = s.state("exp_avg_sq");
      const int64_t first = geo.first_row, chunks = (first + geo.rows + kVectorChunk - 1) /
                                                       kVectorChunk - first / kVectorChunk;
      std::vector<double> u2(chunks, 0.0), chunk_p2(chunks, 0.0);
      at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t global = (first / kVectorChunk + c) * kVectorChunk;
          const int64_t i0 = std::max<int64_t>(0, global - first);
          const int64_t i1 = std::min(geo.rows, global + kVectorChunk - first);
          u2[c] = kern.sum_of_g2_over_v(s.g + i0, v + i0, i1 - i0, eps1f(), b2t.keep, b2t.add);
          if (scale_parameter_) chunk_p2[c] = kern.sum_of_squares(s.p + i0, i1 - i0);
        }
      });
      for (int64_t c = 0; c < chunks; ++c) {
        a[0] += u2[c];
        a[1] += chunk_p2[c];
      }
      return;
    }
    // Note [Adafactor's column sums in row groups]: the rows are cut into groups of a fixed
    // size, aligned to global row indices and to matrices, so the cuts depend on the tensor
    // alone (never on the thread count) and a shard cut on a group boundary changes nothing.
    // Each group's rows get their new row factor (and p²) and are folded, in row order, into
    // the group's own column sums and w from zero (Note [Adafactor's one pass over the
    // gradient]); the accumulator adds the groups' sums in group order. One parallel region
    // takes whole groups, each thread a share cut where the rows split evenly. The thread
    // whose groups start at 0 adds each one into the
    // accumulator as soon as it is folded (it is first in the order anyway: on one thread
    // nothing else happens); the others keep theirs, and a second region, threads splitting
    // the columns, adds them in order (for a tensor of a few MB, the calling thread alone). At
    // most two regions per tensor: one per block of 128 rows (as before) put ~1,700 barriers
    // in a 100 M-parameter step, and every stall of one vCPU at one of them held the other
    // thread.
    // Note [Adafactor's one pass over the gradient]: each block of four rows is read from
    // memory once. sum_four_rows_and_columns squares each element once (g² + eps1 in fp32),
    // widens it once, and adds it both to its row's eight fp64 lanes and to its column's sum;
    // the rows' new factors follow from the row sums, and fold_w adds g² / r_k into w while
    // the 16 KiB block (at 1024 columns) is still in L1, prefetching the next block meanwhile.
    // The row pass and the fold were two passes over a group in L2 (the fold a second
    // widening of every element, and w in fp64 from g widened): the row sums 33 % and the
    // fold 26 % of the loops' samples on AVX2, against the update's 41 %. The row factors and
    // column sums keep their bits (the same terms, added in the same order); w's terms are now
    // rounded to fp32 before they are added, which moves only the clipping divisor, by at most
    // fp32's relative rounding (6e-8): Transformers computes the update's RMS in fp32 anyway.
    const float* row = s.state("exp_avg_sq_row");
    std::vector<double> p2(geo.rows, 0.0);  // one sum per row, then added in row order
    double* col_sums = a;
    double* w = a + geo.M * geo.C;
    const std::vector<RowGroup> groups = row_groups(geo);
    const int64_t n_groups = static_cast<int64_t>(groups.size());
    std::vector<float> new_row(geo.rows);
    // [group][col sums (C) | w (C)] of the groups kept for the second region (none on one
    // thread). Kept between calls: a fresh buffer of this size is mmap'ed, and its page faults
    // cost more than the fold.
    thread_local std::vector<double> kept_buffer;
    double* const kept =
        threads_here() > 1 ? cache_aligned(kept_buffer, n_groups * 2 * geo.C) : nullptr;
    // Each thread's share of the groups, cut where the rows split evenly (the nearest group
    // boundary), not by group count: 390 rows in groups of 16 were cut 208 / 182 by count (25
    // groups, 13 and 12), 192 / 198 now. Which thread folds a group changes no bits: every
    // group's partial is added in group order either way.
    const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(threads_here(), n_groups));
    std::vector<int64_t> share_start(shares + 1, n_groups);
    for (int64_t t = 0, gi = 0; t < shares; ++t) {
      const int64_t target = geo.rows * t / shares;
      while (gi + 1 < n_groups &&
             std::abs(groups[gi + 1].begin - target) <= std::abs(groups[gi].begin - target))
        ++gi;
      share_start[t] = t == 0 ? 0 : gi;
    }
    int64_t added_directly = 0;  // groups [0, added_directly) are in the accumulator
    at::parallel_for(0, shares, 1, [&](int64_t t0, int64_t t1) {
      thread_local std::vector<double> scratch;  // the first share's one group, in L1
      for (int64_t t = t0; t < t1; ++t) {
        const bool direct = t == 0;  // share 0 holds group 0 and adds its groups at once
        double* const own = direct ? cache_aligned(scratch, 2 * geo.C) : nullptr;
        for (int64_t gi = share_start[t]; gi < share_start[t + 1]; ++gi) {
          const RowGroup& grp = groups[gi];
          double* part_col = direct ? own : kept + gi * 2 * geo.C;
          double* part_w = part_col + geo.C;
          // Four rows at a time, read once (Note [Adafactor's one pass over the gradient]).
          // The group's first rows write its partials instead of adding to them, so they
          // need no zeroing pass (16 bytes per column per group; 0.0 + t is t).
          for (int64_t k = grp.begin; k < grp.end; k += kFoldRows) {
            const int64_t count = std::min(kFoldRows, grp.end - k);
            const float* g = s.g + k * geo.C;
            const bool first_rows = k == grp.begin;
            double sums[kFoldRows];
            if (count == kFoldRows) {
              kern.sum_four_rows_and_columns(g, geo.C, eps1f(), sums, part_col, first_rows);
            } else {
              for (int64_t r = 0; r < count; ++r)
                sums[r] = kern.sum_row_and_columns(g + r * geo.C, geo.C, eps1f(), part_col,
                                                   first_rows && r == 0);
            }
            float inv_row[kFoldRows];
            for (int64_t r = 0; r < count; ++r) {
              new_row[k + r] = new_row_factor(sums[r], geo.C, row[k + r], b2t);
              inv_row[r] = 1.0f / new_row[k + r];
            }
            kern.fold_w(g, count, geo.C, inv_row, part_w, first_rows);
            // The parameter's RMS only scales the step (scale_parameter): without it, no pass
            // over the parameter here.
            if (scale_parameter_)
              for (int64_t r = 0; r < count; ++r)
                p2[k + r] = kern.sum_of_squares(s.p + (k + r) * geo.C, geo.C);
          }
          if (direct) {
            kern.add_columns(part_col, 0, geo.C, col_sums + grp.matrix * geo.C);
            kern.add_columns(part_w, 0, geo.C, w + grp.matrix * geo.C);
          }
        }
        if (direct) added_directly = share_start[1];  // read after the region's join
      }
    });
    // A region costs a barrier, and a barrier on a loaded machine costs a time slice: below
    // about 2^18 doubles to add (~0.1 ms), the calling thread adds them alone.
    const int64_t to_add = (n_groups - added_directly) * 2 * geo.C;
    if (added_directly < n_groups)
      at::parallel_for(0, geo.C, to_add < (int64_t{1} << 18) ? geo.C : 256, [&](int64_t j0,
                                                                               int64_t j1) {
        for (int64_t gi = added_directly; gi < n_groups; ++gi) {
          const int64_t offset = groups[gi].matrix * geo.C;
          kern.add_columns(kept + gi * 2 * geo.C, j0, j1, col_sums + offset);
          kern.add_columns(kept + gi * 2 * geo.C + geo.C, j0, j1, w + offset);
        }
      });
    double* const carried_rows = a + row_factors_at(geo);
    for (int64_t k = 0; k < geo.rows; ++k) {
      a[2 * geo.M * geo.C + geo.matrix(k)] += new_row[k];
      carried_rows[k] = new_row[k];  // Note [Adafactor in two passes]
    }
    double& total = a[acc.numel() - 1];
    for (double x : p2) total += x;
  }

  // Note [Whole tensors shared among threads] (loom/update_rule.h): the CPU loops' bits do not
  // depend on the threads that run a tensor (Note [Adafactor's column sums in row groups]).
  // On a GPU, every tensor the CUDA kernels take, in a few launches for all of them (Note
  // [Adafactor's CUDA kernels in batches] in cuda/adafactor.cu), one batch per GPU.
  void update_many(const std::vector<Segment*>& segments,
                   const UpdateContext& ctx) const override {
    std::vector<Segment*> rest;
    std::map<int, std::vector<Segment*>> on_gpu;
    for (Segment* s : segments) {
      if (cuda_kernels(*s))
        on_gpu[s->param.device().index()].push_back(s);
      else
        rest.push_back(s);
    }
    for (auto& [index, batch] : on_gpu) cuda_update_many(batch, ctx);
    update_sharing_threads(*this, rest, ctx, [this](const Segment& s) { return use_loops(s); });
  }

  void update(Segment& segment, const UpdateContext& ctx) const override {
    LOOM_INTERNAL_ASSERT(ctx.totals.size() == 1, "adafactor runs through update_tensor");
    if (cuda_kernels(segment)) return cuda_update(segment, ctx);
    if (!use_loops(segment)) return tensor_ops_update(segment, ctx);
    const Kernels& kern = kernels();
    Cpu s(segment);
    const Geometry geo(segment);
    const Beta2 b2t = beta2t(ctx.step);
    const double* t0 = ctx.totals[0].data_ptr<double>();
    const int64_t n_total = ctx.totals[0].numel();
    const double n = static_cast<double>(geo.numel);
    Coefficients c = base_coefficients();
    float* m = beta1_ > 0 ? s.state("exp_avg") : nullptr;
    if (!geo.factored) {
      adafactor_step_scalars(t0[n_total - 1], t0[0], n, step_inputs(ctx), c);
      float* v = s.state("exp_avg_sq");
      at::parallel_for(0, geo.rows, 4096, [&](int64_t i0, int64_t i1) {
        kern.update_vector(s.g + i0, v + i0, s.p + i0, m ? m + i0 : nullptr, i1 - i0, eps1f(),
                      b2t.keep, b2t.add, c);
      });
      s.write_back(segment);
      return;
    }
    const ColumnFactors f = column_factors(s, geo, t0, b2t);
    adafactor_step_scalars(t0[n_total - 1], f.sum_u2, n, step_inputs(ctx), c);
    // Round 0's row factors (Note [Adafactor in two passes]), exact: floats carried in doubles.
    const double* carried_rows = t0 + row_factors_at(geo);
    std::vector<float> new_row(geo.rows);
    for (int64_t k = 0; k < geo.rows; ++k) new_row[k] = static_cast<float>(carried_rows[k]);
    at::parallel_for(0, geo.rows, 16, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        const float rf = 1.0f / std::sqrt(new_row[k] / f.row_mean[geo.matrix(k)]);
        kern.update_row(s.g + k * geo.C, f.rsqrt_col.data() + geo.matrix(k) * geo.C, rf,
                        s.p + k * geo.C, m ? m + k * geo.C : nullptr, geo.C, c);
      }
    });
    // Store the new second moments (the column factor is whole-tensor, the same everywhere).
    std::copy(new_row.begin(), new_row.end(), s.state("exp_avg_sq_row"));
    std::copy(f.col.begin(), f.col.end(), s.state("exp_avg_sq_col"));
    s.write_back(segment);
  }

 private:
  // The threads a parallel region here would get: one inside another region (update_many's),
  // where at::parallel_for runs inline.
  static int threads_here() { return at::in_parallel_region() ? 1 : at::get_num_threads(); }

  bool use_loops(const Segment& s) const {
    return kernel_ == "cpu_loops" || (kernel_ == "auto" && cpu_fp32(s));
  }

  // ---- CUDA kernels (Note [Adafactor's CUDA kernels] in cuda/adafactor.cu) ----
  // Where loom was built with them and kernel = "auto": the parameter, gradient and state fp32
  // and contiguous on one GPU, and a factored tensor's rows at least 16 wide (a row group then
  // fits the kernel's shared memory); tensor ops otherwise.
  bool cuda_kernels(const Segment& s) const {
#if defined(LOOM_OPTIM_CUDA_KERNELS)
    if (kernel_ != "auto" || !s.param.is_cuda()) return false;
    if (!kernel_ready(s, s.param, at::kFloat) || !kernel_ready(s, s.grad, at::kFloat)) return false;
    for (const auto& [key, t] : s.state)
      if (!kernel_ready(s, t, at::kFloat)) return false;
    const Geometry geo(s);
    return !geo.factored || geo.C >= 16;
#else
    (void)s;
    return false;
#endif
  }

#if defined(LOOM_OPTIM_CUDA_KERNELS)
  AdafactorFactored factored_view(const Segment& s, const Geometry& geo, const at::Tensor& acc,
                                  AdafactorBeta2 b2t) const {
    Segment& w = const_cast<Segment&>(s);  // the kernels write state and parameter in update
    return AdafactorFactored{w.param.data_ptr<float>(),
                             s.grad.data_ptr<float>(),
                             beta1_ > 0 ? w.state_at("exp_avg").data_ptr<float>() : nullptr,
                             w.state_at("exp_avg_sq_row").data_ptr<float>(),
                             w.state_at("exp_avg_sq_col").data_ptr<float>(),
                             acc.data_ptr<double>(),
                             geo.rows,
                             geo.C,
                             geo.R,
                             geo.M,
                             geo.first_row,
                             eps1f(),
                             b2t,
                             scale_parameter_};
  }
  AdafactorVector vector_view(const Segment& s, const Geometry& geo, const at::Tensor& acc,
                              AdafactorBeta2 b2t) const {
    Segment& w = const_cast<Segment&>(s);
    return AdafactorVector{w.param.data_ptr<float>(),
                           s.grad.data_ptr<float>(),
                           beta1_ > 0 ? w.state_at("exp_avg").data_ptr<float>() : nullptr,
                           w.state_at("exp_avg_sq").data_ptr<float>(),
                           acc.data_ptr<double>(),
                           geo.rows,
                           s.offset,
                           geo.numel,
                           eps1f(),
                           b2t,
                           scale_parameter_};
  }
#endif

  // One segment's round 0 (update_tensor's protocol: a ZeRO driver sums the accumulators).
  void cuda_accumulate(const Segment& s, const UpdateContext& ctx, at::Tensor& acc) const {
#if defined(LOOM_OPTIM_CUDA_KERNELS)
    const c10::DeviceGuard guard(s.param.device());
    launch_accumulate({&s}, {acc}, ctx);
#else
    (void)s, (void)ctx, (void)acc;
#endif
  }

  void cuda_update(Segment& s, const UpdateContext& ctx) const {
#if defined(LOOM_OPTIM_CUDA_KERNELS)
    const at::Tensor& t0 = ctx.totals[0];
    LOOM_INTERNAL_ASSERT(t0.device() == s.param.device() && t0.scalar_type() == at::kDouble &&
                             t0.is_contiguous(),
                         "adafactor's totals for ", s.name, " are not on its GPU");
    const c10::DeviceGuard guard(s.param.device());
    launch_update({&s}, {t0}, ctx);
#else
    (void)s, (void)ctx;
#endif
  }

  // Whole tensors on one GPU: their accumulators in one zeroed buffer, round 0 and the update
  // for all of them.
  void cuda_update_many(const std::vector<Segment*>& segments, const UpdateContext& ctx) const {
#if defined(LOOM_OPTIM_CUDA_KERNELS)
    const c10::DeviceGuard guard(segments.front()->param.device());
    std::vector<int64_t> sizes;
    int64_t total = 0;
    for (const Segment* s : segments) {
      sizes.push_back(accumulator_size(Geometry(*s)));
      total += sizes.back();
    }
    const at::Tensor all = at::zeros(
        {total}, at::TensorOptions().dtype(at::kDouble).device(segments.front()->param.device()));
    std::vector<at::Tensor> accs;
    std::vector<const Segment*> views;
    for (size_t i = 0, at = 0; i < segments.size(); at += sizes[i], ++i) {
      accs.push_back(all.narrow(0, static_cast<int64_t>(at), sizes[i]));
      views.push_back(segments[i]);
    }
    launch_accumulate(views, accs, ctx);
    launch_update(views, accs, ctx);
#else
    (void)segments, (void)ctx;
#endif
  }

#if defined(LOOM_OPTIM_CUDA_KERNELS)
  // The kernels' views of the segments (all on the current GPU) with their accumulators, split
  // into factored tensors and vectors.
  struct CudaViews {
    std::vector<AdafactorFactored> factored;
    std::vector<AdafactorVector> vectors;
    std::vector<const Segment*> factored_of, vector_of;  // for the errors
  };
  CudaViews cuda_views(const std::vector<const Segment*>& segments,
                       const std::vector<at::Tensor>& accs, const UpdateContext& ctx) const {
    CudaViews v;
    const Beta2 b2t = beta2t(ctx.step);
    for (size_t i = 0; i < segments.size(); ++i) {
      const Geometry geo(*segments[i]);
      if (geo.factored) {
        v.factored.push_back(factored_view(*segments[i], geo, accs[i], b2t));
        v.factored_of.push_back(segments[i]);
      } else {
        v.vectors.push_back(vector_view(*segments[i], geo, accs[i], b2t));
        v.vector_of.push_back(segments[i]);
      }
    }
    return v;
  }
  static void check_launch(const char* error, const std::vector<const Segment*>& of,
                           const char* what) {
    if (!error || of.empty()) return;
    std::string names = of.front()->name;
    if (of.size() > 1) names += " and " + std::to_string(of.size() - 1) + " more tensors";
    throw Error(std::string("adafactor's CUDA kernels (") + what + ") did not launch on " +
                of.front()->param.device().str() + " for " + names + ": " + error);
  }
  void launch_accumulate(const std::vector<const Segment*>& segments,
                         const std::vector<at::Tensor>& accs, const UpdateContext& ctx) const {
    const CudaViews v = cuda_views(segments, accs, ctx);
    void* stream = current_cuda_stream(segments.front()->param.device());
    int64_t doubles = 0;
    for (const auto& t : v.factored) doubles += adafactor_factored_scratch(t);
    for (const auto& t : v.vectors) doubles += adafactor_vector_scratch(t);
    // Freed when this returns, and reused by the caching allocator only after the kernels
    // queued on this stream.
    at::Tensor scratch = at::empty({doubles}, accs.front().options());
    double* at = scratch.data_ptr<double>();
    check_launch(launch_adafactor_accumulate_factored(v.factored.data(),
                                                      static_cast<int64_t>(v.factored.size()),
                                                      at, stream),
                 v.factored_of, "accumulate");
    for (const auto& t : v.factored) at += adafactor_factored_scratch(t);
    check_launch(launch_adafactor_accumulate_vector(v.vectors.data(),
                                                    static_cast<int64_t>(v.vectors.size()), at,
                                                    stream),
                 v.vector_of, "accumulate");
  }
  void launch_update(const std::vector<const Segment*>& segments,
                     const std::vector<at::Tensor>& accs, const UpdateContext& ctx) const {
    const CudaViews v = cuda_views(segments, accs, ctx);
    void* stream = current_cuda_stream(segments.front()->param.device());
    int64_t floats = 0;
    for (const auto& t : v.factored) floats += adafactor_factored_update_scratch(t);
    at::Tensor scratch = at::empty({floats}, segments.front()->param.options());
    const AdafactorStepInputs in = step_inputs(ctx);
    check_launch(launch_adafactor_update_factored(v.factored.data(),
                                                  static_cast<int64_t>(v.factored.size()), in,
                                                  base_coefficients(), scratch.data_ptr<float>(),
                                                  stream),
                 v.factored_of, "update");
    check_launch(launch_adafactor_update_vector(v.vectors.data(),
                                                static_cast<int64_t>(v.vectors.size()), in,
                                                base_coefficients(), stream),
                 v.vector_of, "update");
  }
#endif

  // ---- CPU loops ----
  // The segment's tensors as CPU fp32 pointers; with kernel = "cpu_loops" on another device,
  // CPU copies that write_back() returns.
  struct Cpu {
    explicit Cpu(const Segment& s) {
      const bool direct = cpu_fp32(s);
      param = direct ? s.param : s.param.to(at::kCPU, at::kFloat).contiguous();
      grad = direct ? s.grad : s.grad.to(at::kCPU, at::kFloat).contiguous();
      for (const auto& [key, t] : s.state)
        state_.emplace_back(key, direct ? t : t.to(at::kCPU, at::kFloat).contiguous());
      p = param.data_ptr<float>();
      g = grad.data_ptr<float>();
    }
    float* state(const std::string& key) {
      for (auto& [name, t] : state_)
        if (name == key) return t.data_ptr<float>();
      throw InternalError("adafactor state '" + key + "' missing");
    }
    const float* state(const std::string& key) const { return const_cast<Cpu*>(this)->state(key); }
    void write_back(Segment& s) {
      if (s.param.data_ptr() == param.data_ptr()) return;
      s.param.copy_(param);
      for (size_t i = 0; i < state_.size(); ++i) s.state[i].second.copy_(state_[i].second);
    }
    at::Tensor param, grad;
    NamedTensors state_;
    float* p;
    const float* g;
  };

  struct ColumnFactors {
    std::vector<float> col;        // new column factor (M*C)
    std::vector<float> rsqrt_col;  // 1/sqrt of it: the column factor of u, once per tensor
    std::vector<float> row_mean;   // mean of the new row factor per matrix (M)
    double sum_u2 = 0;             // the unclipped update's sum of squares (Note [Adafactor in two passes])
  };

  float eps1f() const { return static_cast<float>(eps1_); }
  // Where the segment's first row factor sits in the accumulator (Note [Adafactor in two passes]).
  static int64_t row_factors_at(const Geometry& geo) {
    return 2 * geo.M * geo.C + geo.M + geo.first_row;
  }
  // 1 - t^decay_rate; the weights b2t and 1 - b2t are rounded to fp32 from double, as torch
  // does with Python-float scalars.
  using Beta2 = AdafactorBeta2;
  Beta2 beta2t(int64_t step) const {
    const double b = 1.0 - std::pow(static_cast<double>(step), decay_rate_);
    return {static_cast<float>(b), static_cast<float>(1.0 - b)};
  }
  // The step before parameter scaling: the job's lr, or the relative step of t.
  double relative_lr(const UpdateContext& ctx) const {
    if (!relative_step_) return ctx.lr;
    const double t = static_cast<double>(ctx.step);
    return std::min(warmup_init_ ? 1e-6 * t : 1e-2, 1.0 / std::sqrt(t));
  }
  // What the step's scalars need besides the tensor's sums (adafactor_step_scalars).
  AdafactorStepInputs step_inputs(const UpdateContext& ctx) const {
    return {relative_lr(ctx), eps2_, clip_, ctx.weight_decay, scale_parameter_};
  }
  // Momentum's weights; step and wd come from adafactor_step_scalars.
  Coefficients base_coefficients() const {
    Coefficients c{};
    c.b1 = static_cast<float>(beta1_);
    c.w1 = static_cast<float>(1.0 - beta1_);
    return c;
  }

  static float new_row_factor(double sum, int64_t C, float old, Beta2 b2t) {
    return adafactor_new_row_factor(sum, C, old, b2t);
  }

  // The new column factors from round 0's totals, and the update's sum of squares.
  ColumnFactors column_factors(const Cpu& s, const Geometry& geo, const double* t0,
                               AdafactorBeta2 b2t) const {
    ColumnFactors f;
    const int64_t MC = geo.M * geo.C;
    const double R = static_cast<double>(geo.R);
    const float* col = s.state("exp_avg_sq_col");
    f.col.resize(MC);
    f.rsqrt_col.resize(MC);
    for (int64_t i = 0; i < MC; ++i) {
      f.col[i] = col[i] * b2t.keep + b2t.add * static_cast<float>(t0[i] / R);
      f.rsqrt_col[i] = 1.0f / std::sqrt(f.col[i]);
    }
    f.row_mean.resize(geo.M);
    for (int64_t m = 0; m < geo.M; ++m) {
      f.row_mean[m] = static_cast<float>(t0[2 * MC + m] / R);
      for (int64_t j = 0; j < geo.C; ++j)
        f.sum_u2 += static_cast<double>(f.row_mean[m]) / f.col[m * geo.C + j] *
                    t0[MC + m * geo.C + j];
    }
    return f;
  }

  // ---- tensor ops: the loops' arithmetic, step for step, as ATen ops on any device ----
  // Note [Adafactor's tensor ops in slices]: each op makes a temporary of the rows it covers
  // (g² + eps1 in fp32 and fp64, g in fp64, g²/r, the update), 32 B an element at the peak, so
  // over a whole tensor at once a GPU's update briefly held eight times the tensor's fp32
  // bytes (537 MB for a 4096 x 4096 gradient; ~17 GB for a 128256 x 4096 embedding): more than
  // the factored moments save. Both passes run over slices of whole rows, at most
  // kSliceElements each (vectors: slices of elements, a vector's "rows" being its elements).
  // Every element's arithmetic is the whole-tensor ops', and index_add_ adds the rows in order,
  // so the factors and the update are the same bits; only the fp64 sums of p² and g²/v (one
  // number per tensor) are added slice by slice, a rounding of fp64 apart.
  static constexpr int64_t kSliceElements = int64_t{1} << 21;
  static int64_t rows_per_slice(const Geometry& geo) {
    return std::max<int64_t>(1, kSliceElements / geo.C);
  }
  // Local rows [k0, k0 + nk) of a factored segment: g as (nk, C) and each row's matrix (M).
  struct Rows {
    at::Tensor g, matrix;
  };
  static Rows rows_of(const Segment& s, const Geometry& geo, int64_t k0, int64_t nk) {
    Rows r;
    r.g = s.grad.view({geo.rows, geo.C}).narrow(0, k0, nk);
    r.matrix = at::arange(geo.first_row + k0, geo.first_row + k0 + nk,
                          s.param.options().dtype(at::kLong))
                   .div_(geo.R, "floor");
    return r;
  }
  // The rows' new factors from their g²+eps1 in fp64 (the row mean summed in fp64 and rounded
  // once, as the loops do).
  at::Tensor new_row_factor(const Segment& s, const at::Tensor& g2_eps, const Geometry& geo,
                            int64_t k0, int64_t nk, Beta2 b2t) const {
    const at::Tensor mean =
        g2_eps.sum(1).div_(static_cast<double>(geo.C)).to(at::kFloat);
    return s.state_at("exp_avg_sq_row").narrow(0, k0, nk) * b2t.keep + mean * b2t.add;
  }

  void tensor_ops_accumulate(const Segment& s, const UpdateContext& ctx, at::Tensor& acc) const {
    const Geometry geo(s);
    const Beta2 b2t = beta2t(ctx.step);
    const int64_t per = rows_per_slice(geo), MC = geo.M * geo.C;
    at::Tensor p2 = acc.narrow(0, acc.numel() - 1, 1);
    for (int64_t k0 = 0; k0 < geo.rows; k0 += per) {
      const int64_t nk = std::min(per, geo.rows - k0);
      p2.add_(s.param.narrow(0, k0 * geo.C, nk * geo.C).to(at::kDouble).square_().sum());
      if (!geo.factored) {
        const at::Tensor g = s.grad.narrow(0, k0, nk);
        const at::Tensor v = s.state_at("exp_avg_sq").narrow(0, k0, nk) * b2t.keep +
                             (g * g + eps1f()) * b2t.add;
        const at::Tensor gd = g.to(at::kDouble);
        acc.narrow(0, 0, 1).add_((gd * gd / v.to(at::kDouble)).sum());
        continue;
      }
      const Rows r = rows_of(s, geo, k0, nk);
      const at::Tensor g2_eps = (r.g * r.g + eps1f()).to(at::kDouble);
      const at::Tensor new_row = new_row_factor(s, g2_eps, geo, k0, nk, b2t);
      acc.narrow(0, 0, MC).view({geo.M, geo.C}).index_add_(0, r.matrix, g2_eps);
      const at::Tensor g = r.g.to(at::kDouble);
      acc.narrow(0, MC, MC).view({geo.M, geo.C}).index_add_(
          0, r.matrix, g.square().div_(new_row.to(at::kDouble).unsqueeze(1)));
      acc.narrow(0, 2 * MC, geo.M).index_add_(0, r.matrix, new_row.to(at::kDouble));
      acc.narrow(0, row_factors_at(geo) + k0, nk).copy_(new_row);
    }
  }

  // The unclipped update's sum of squares from the totals (Note [Adafactor in two passes]).
  at::Tensor sum_u2(const Geometry& geo, const at::Tensor& t0, const at::Tensor& new_col) const {
    if (!geo.factored) return t0.narrow(0, 0, 1);
    const int64_t MC = geo.M * geo.C;
    const at::Tensor row_mean =
        t0.narrow(0, 2 * MC, geo.M).div(static_cast<double>(geo.R)).to(at::kFloat);
    return (row_mean.to(at::kDouble).unsqueeze(1) / new_col.view({geo.M, geo.C}).to(at::kDouble) *
            t0.narrow(0, MC, MC).view({geo.M, geo.C}))
        .sum()
        .view({1});
  }

  void tensor_ops_update(Segment& s, const UpdateContext& ctx) const {
    const Geometry geo(s);
    const Beta2 b2t = beta2t(ctx.step);
    const at::Tensor& t0 = ctx.totals[0];
    const double n = static_cast<double>(geo.numel);
    // The whole tensor's factors (rows, M x C: small) and scalars, on device: no host sync.
    at::Tensor new_row, new_col, rf, rsqrt_col;
    if (geo.factored) {
      // Round 0's row factors, carried (Note [Adafactor in two passes]).
      new_row = t0.narrow(0, row_factors_at(geo), geo.rows).to(at::kFloat);
      const double R = static_cast<double>(geo.R);
      new_col = s.state_at("exp_avg_sq_col") * b2t.keep +
                t0.narrow(0, 0, geo.M * geo.C).div(R).to(at::kFloat) * b2t.add;
      const at::Tensor row_mean = t0.narrow(0, 2 * geo.M * geo.C, geo.M).div(R).to(at::kFloat);
      const at::Tensor matrix = rows_of(s, geo, 0, geo.rows).matrix;
      rf = at::reciprocal(at::sqrt(new_row / row_mean.index_select(0, matrix)));
      rsqrt_col = at::reciprocal(at::sqrt(new_col.view({geo.M, geo.C})));
    }
    at::Tensor param_rms = t0.narrow(0, t0.numel() - 1, 1).div(n).sqrt();
    const double rel = relative_lr(ctx);
    at::Tensor lr = scale_parameter_
                        ? param_rms.to(at::kFloat).to(at::kDouble).clamp_min(eps2_).mul(rel)
                        : at::full({1}, rel, param_rms.options());
    at::Tensor update_rms = sum_u2(geo, t0, new_col).div(n).sqrt();
    at::Tensor clip_div = update_rms.div(clip_).clamp_min(1.0).to(at::kFloat);
    const at::Tensor step = lr.to(at::kFloat) / clip_div;  // as the loops' Coefficients::step
    const at::Tensor decay = (lr * -ctx.weight_decay).to(at::kFloat);
    const int64_t per = rows_per_slice(geo);
    for (int64_t k0 = 0; k0 < geo.rows; k0 += per) {
      const int64_t nk = std::min(per, geo.rows - k0), e0 = k0 * geo.C, ne = nk * geo.C;
      at::Tensor u, new_v;
      if (geo.factored) {
        const Rows r = rows_of(s, geo, k0, nk);
        u = (rf.narrow(0, k0, nk).unsqueeze(1) * rsqrt_col.index_select(0, r.matrix) * r.g)
                .view(-1);
      } else {
        const at::Tensor g = s.grad.narrow(0, e0, ne);
        new_v = s.state_at("exp_avg_sq").narrow(0, e0, ne) * b2t.keep + (g * g + eps1f()) * b2t.add;
        u = at::reciprocal(at::sqrt(new_v)) * g;
      }
      at::Tensor x = u * step;
      if (beta1_ > 0) {
        at::Tensor m = s.state_at("exp_avg").narrow(0, e0, ne);
        m.copy_(m * static_cast<float>(beta1_) + x * static_cast<float>(1.0 - beta1_));
        x = m;
      }
      at::Tensor p = s.param.narrow(0, e0, ne);
      if (ctx.weight_decay != 0) p.copy_(p + decay * p);
      p.sub_(x);
      if (!geo.factored) s.state_at("exp_avg_sq").narrow(0, e0, ne).copy_(new_v);
    }
    if (geo.factored) {
      s.state_at("exp_avg_sq_row").copy_(new_row);
      s.state_at("exp_avg_sq_col").copy_(new_col);
    }
  }

  double eps1_, eps2_, clip_, decay_rate_, beta1_;
  bool scale_parameter_, relative_step_, warmup_init_;
  std::string kernel_;
};

}  // namespace

std::unique_ptr<UpdateRule> make_adafactor(const ConfigSection& c) {
  return std::make_unique<Adafactor>(c);
}

}  // namespace loom::optim
