// adafactor on a GPU: the CPU loops' arithmetic (adafactor_element.h) in four phases for the
// factored tensors and three for the vectors, each one launch for a whole step's tensors. The
// tensor ops they replace made a dozen passes and temporaries per slice of 2 M elements (Note
// [Adafactor's tensor ops in slices]): 30x torch's fused AdamW on an H200, now 0.90x of its
// time (docs/BENCHMARKS.md "A third H200 session").
//
// Note [Adafactor's CUDA kernels]: round 0 (accumulate) and the update, as the CPU loops do them
// (Note [Adafactor in two passes] in adafactor.cpp):
// - adafactor_groups_staged (adafactor_groups past 2^14 columns), one thread block per row group
//   (Note [Adafactor's column sums in row groups]: the same groups, cut by global row): first
//   each row's sum of g² + eps1 in the CPU's eight fp64 lanes (eight threads a row, lane l
//   holding columns l, l + 8, ..., the tail past the last eight in lane 0, folded pairwise), so
//   each row's new factor has the CPU's bits; then one thread a column adds the group's rows in
//   row order into the group's column sums and w, as the CPU's partials.
// - adafactor_add_groups adds each group's partials into the accumulator in group order (the
//   CPU's order: the column sums and w have its bits), and, in one more thread block, the row
//   factors per matrix and the sum of p² — those two in a fixed tree, where the CPU adds row by
//   row: an fp64 rounding apart, which reaches the fp32 values they set (the row mean, the
//   parameter's RMS) only where the sum falls within that of a rounding boundary.
// - adafactor_columns: the new column factors and their 1/sqrt, the update's sum of squares in
//   shares per thread block (a tree again), each matrix's row mean.
// - adafactor_update_rows: the step's two scalars from the shares (each thread block alike, on
//   the GPU: no host sync), each row's factor, then u = rf · rsqrt_col · g, momentum, decay,
//   the step: four elements a thread where the rows allow.
// A vector's sums are a tree, its update one elementwise kernel. All compiled with
// --fmad=false, so each element's rounding is the CPU's.
#include <cuda_runtime.h>

#include <vector>

#include "adafactor_launch.h"
#include "batches.h"

namespace loom::optim {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFull = 0xffffffffu;

// The row groups of a segment: adafactor_element.h's arithmetic, which the CPU loops cut by.
using Groups = AdafactorGroups;
__host__ inline Groups groups_of(const AdafactorFactored& t) {
  return adafactor_groups(t.rows, t.C, t.R, t.first_row);
}
// Group `index`'s local rows [k0, k1) in the segment.
__device__ inline void group_rows(const AdafactorFactored& t, const Groups& gr, int64_t index,
                                  int64_t& k0, int64_t& k1) {
  int64_t matrix;
  adafactor_group_rows_of(gr, t.rows, t.R, t.first_row, index, k0, k1, matrix);
}

__host__ __device__ inline int64_t carried_at(const AdafactorFactored& t) {
  return 2 * t.M * t.C + t.M + t.first_row;  // the segment's first carried row factor
}
__host__ __device__ inline int64_t p2_at(const AdafactorFactored& t) {
  return 2 * t.M * t.C + t.M + t.M * t.R;
}

// The sum of x over the thread block, in a fixed order (the same bits every run): each warp by
// shuffles, then the warps' sums by thread 0 in warp order. Every thread calls it; thread 0
// gets the sum.
__device__ double block_sum(double x, double* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_down_sync(kFull, x, offset);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  double sum = 0;
  if (threadIdx.x == 0) {
    sum = scratch[0];
    for (int w = 1; w < static_cast<int>(blockDim.x) / 32; ++w) sum += scratch[w];
  }
  __syncthreads();  // scratch is reused by the next call
  return sum;
}

// ---- Note [Adafactor's CUDA kernels in batches] ----
// update_many hands the rule every tensor of a step at once; each phase below is then one
// launch for all of them (up to kKernelBatch tensors a launch), as torch's multi-tensor kernels do.
// Per tensor, the phases that are not passes over its elements (the accumulator's zeroing, the
// groups' adds, the column factors) are a few microseconds of latency on a few multiprocessors;
// one launch a tensor and phase made them most of the step (docs/BENCHMARKS.md). A batch is a
// kernel parameter, its thread blocks numbered through its tensors (batches.h).
struct Shared {  // what every tensor of a batch shares (update_many's one context)
  AdafactorStepInputs in;
  AdafactorCoefficients base;
};
template <typename Item>
using Batch = KernelBatch<Item, Shared>;

// A factored tensor's accumulate: part [group][2C] holds each group's column sums, then its w;
// sums [group][2] its row factors' sum and its rows' sum of p² (tree order). by4: C % 4 == 0,
// g and p 16-byte aligned.
struct GroupItem {
  AdafactorFactored t;
  Groups gr;
  double* part;
  double* sums;
  bool by4;
};

__device__ void groups_direct(const GroupItem& it, int64_t block) {
  const AdafactorFactored& t = it.t;
  double* const part = it.part;
  double* const sums = it.sums;
  __shared__ float inv_row[1024];  // S <= 1024 (launch checks C >= 16)
  __shared__ double scratch[kThreads / 32];
  int64_t k0, k1;
  group_rows(t, it.gr, it.gr.first + block, k0, k1);
  const int64_t C = t.C, C8 = C & ~int64_t{7}, carried = carried_at(t);
  const int lane = threadIdx.x & 7, slot = threadIdx.x >> 3;
  const int64_t rows = k1 - k0;
  double row_total = 0, p2_total = 0;  // slot's rows in order (lane 0)
  // Rows in rounds of 32 (eight threads a row); every thread runs every round (the shuffles).
  for (int64_t base = 0; base < rows; base += kThreads / 8) {
    const int64_t r = base + slot;
    const bool here = r < rows;
    double s = 0, q = 0;
    if (here) {
      const float* gk = t.g + (k0 + r) * C;
      const float* pk = t.p + (k0 + r) * C;
#pragma unroll 4
      for (int64_t j = lane; j < C8; j += 8) {
        s += adafactor_square_term(__ldg(gk + j), t.eps1);
        if (t.with_p2) q += adafactor_p2_term(pk[j]);
      }
      if (lane == 0)
        for (int64_t j = C8; j < C; ++j) {
          s += adafactor_square_term(__ldg(gk + j), t.eps1);
          if (t.with_p2) q += adafactor_p2_term(pk[j]);
        }
    }
    double a[8], b[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      a[i] = __shfl_sync(kFull, s, i, 8);
      b[i] = __shfl_sync(kFull, q, i, 8);
    }
    if (here && lane == 0) {
      const int64_t k = k0 + r;
      const float factor = adafactor_new_row_factor(adafactor_fold_lanes(a), C, t.row[k], t.b2t);
      t.acc[carried + k] = factor;  // Note [Adafactor in two passes]: carried to the update
      inv_row[r] = 1.0f / factor;
      row_total += factor;
      p2_total += adafactor_fold_lanes(b);
    }
  }
  __syncthreads();
  double* col = part + block * 2 * C;
  double* w = col + C;
  for (int64_t j = threadIdx.x; j < C; j += kThreads) {
    const float* gj = t.g + k0 * C + j;
    float x = __ldg(gj);
    double c = adafactor_square_term(x, t.eps1), v = adafactor_w_term(x, inv_row[0]);
#pragma unroll 4
    for (int64_t r = 1; r < rows; ++r) {
      x = __ldg(gj + r * C);
      c += adafactor_square_term(x, t.eps1);
      v += adafactor_w_term(x, inv_row[r]);
    }
    col[j] = c;
    w[j] = v;
  }
  row_total = block_sum(lane == 0 ? row_total : 0.0, scratch);
  p2_total = block_sum(lane == 0 ? p2_total : 0.0, scratch);
  if (threadIdx.x == 0) {
    sums[2 * block] = row_total;
    sums[2 * block + 1] = p2_total;
  }
}

// Note [Adafactor's groups staged in shared memory]: groups_direct above reads each group
// twice from global memory, the row chains 4 loads deep (each a memory latency apart) with 128
// of 256 threads busy at 1024 columns: 7.9 ms for 400 M parameters on an H200, 0.42x torch's
// fused AdamW (docs/BENCHMARKS.md). Here the whole thread block first copies a chunk of the
// group's rows (up to 2^14 elements: the whole group up to 1024 columns) into shared memory
// with 16-byte loads, all in flight at once, and both the row chains and the column sums then
// read shared memory. Rows sit C + 8 floats apart there, so the four rows a warp's chains read
// fall in different banks. Past one chunk a group (C > 1024) keeps its column partials in
// `part` between chunks (L2). The parameter's sum of squares, a tree in any order, is read in
// the same copy loop. Rows over 2^14 columns take groups_direct.
constexpr int64_t kStagedElements = int64_t{1} << 14;
__host__ __device__ inline int64_t staged_rows(int64_t C) {
  const int64_t rows = kStagedElements / C;
  return rows > 0 ? rows : 1;
}
__host__ __device__ inline int64_t staged_stride(int64_t C) { return C + 8; }

__device__ void groups_staged(const GroupItem& it, int64_t block, float* stage) {
  const AdafactorFactored& t = it.t;
  __shared__ float inv_row[1024];  // S <= 1024 (launch checks C >= 16)
  __shared__ double scratch[kThreads / 32];
  int64_t k0, k1;
  group_rows(t, it.gr, it.gr.first + block, k0, k1);
  const int64_t C = t.C, C8 = C & ~int64_t{7}, carried = carried_at(t);
  const int64_t stride = staged_stride(C), chunk = staged_rows(C);
  const int lane = threadIdx.x & 7, slot = threadIdx.x >> 3;
  const int64_t rows = k1 - k0;
  double* col = it.part + block * 2 * C;
  double* w = col + C;
  double row_total = 0, p2 = 0;
  for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
    const int64_t cr = rows - c0 < chunk ? rows - c0 : chunk;
    const float* g = t.g + (k0 + c0) * C;
    const float* p = t.p + (k0 + c0) * C;
    if (it.by4) {  // C % 4 == 0 and g, p 16-byte aligned: every row starts aligned
      const int64_t per_row = C / 4;
      for (int64_t i = threadIdx.x; i < cr * per_row; i += kThreads) {
        const int64_t r = i / per_row, j4 = i - r * per_row;
        const float4 x = __ldg(reinterpret_cast<const float4*>(g) + i);
        *reinterpret_cast<float4*>(stage + r * stride + 4 * j4) = x;
        if (t.with_p2) {
          const float4 y = __ldg(reinterpret_cast<const float4*>(p) + i);
          p2 += ((adafactor_p2_term(y.x) + adafactor_p2_term(y.y)) +
                 (adafactor_p2_term(y.z) + adafactor_p2_term(y.w)));
        }
      }
    } else {
      for (int64_t i = threadIdx.x; i < cr * C; i += kThreads) {
        const int64_t r = i / C, j = i - r * C;
        stage[r * stride + j] = __ldg(g + i);
        if (t.with_p2) p2 += adafactor_p2_term(p[i]);
      }
    }
    __syncthreads();
    // Each row's sum in the CPU's eight lanes (eight threads a row, 32 rows a round; every
    // thread runs every round, for the shuffles).
    for (int64_t base = 0; base < cr; base += kThreads / 8) {
      const int64_t r = base + slot;
      const bool here = r < cr;
      double s = 0;
      if (here) {
        const float* x = stage + r * stride;
#pragma unroll 8
        for (int64_t j = lane; j < C8; j += 8) s += adafactor_square_term(x[j], t.eps1);
        if (lane == 0)
          for (int64_t j = C8; j < C; ++j) s += adafactor_square_term(x[j], t.eps1);
      }
      double a[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = __shfl_sync(kFull, s, i, 8);
      if (here && lane == 0) {
        const int64_t k = k0 + c0 + r;
        const float factor = adafactor_new_row_factor(adafactor_fold_lanes(a), C, t.row[k], t.b2t);
        t.acc[carried + k] = factor;  // Note [Adafactor in two passes]: carried to the update
        inv_row[c0 + r] = 1.0f / factor;
        row_total += factor;
      }
    }
    __syncthreads();
    // The chunk's rows in row order into each column's sums (the group's first row starts them).
    for (int64_t j = threadIdx.x; j < C; j += kThreads) {
      double c, v;
      int64_t r = 0;
      if (c0 == 0) {
        const float x = stage[j];
        c = adafactor_square_term(x, t.eps1);
        v = adafactor_w_term(x, inv_row[0]);
        r = 1;
      } else {
        c = col[j];
        v = w[j];
      }
#pragma unroll 4
      for (; r < cr; ++r) {
        const float x = stage[r * stride + j];
        c += adafactor_square_term(x, t.eps1);
        v += adafactor_w_term(x, inv_row[c0 + r]);
      }
      col[j] = c;
      w[j] = v;
    }
    __syncthreads();  // the stage is refilled by the next chunk
  }
  row_total = block_sum(lane == 0 ? row_total : 0.0, scratch);
  p2 = block_sum(p2, scratch);
  if (threadIdx.x == 0) {
    it.sums[2 * block] = row_total;
    it.sums[2 * block + 1] = p2;
  }
}

__global__ void __launch_bounds__(kThreads)
    adafactor_groups(const __grid_constant__ Batch<GroupItem> b) {
  const int i = batch_item_of(b.start, b.count, blockIdx.x);
  groups_direct(b.item[i], blockIdx.x - b.start[i]);
}
__global__ void __launch_bounds__(kThreads)
    adafactor_groups_staged(const __grid_constant__ Batch<GroupItem> b) {
  extern __shared__ float stage[];
  const int i = batch_item_of(b.start, b.count, blockIdx.x);
  groups_staged(b.item[i], blockIdx.x - b.start[i], stage);
}

// One thread per column of each matrix the segment meets: the groups' partials into the
// accumulator in group order. The item's last thread block adds the row factors' sums per matrix
// and the sum of p² (a tree over the groups). A column's adds are a chain (the CPU's order), so
// its time is its loads' latency: one warp a thread block spreads the columns over 32
// multiprocessors at 1024 columns, where 256 threads a block left them to 4 (44 us a tensor of
// 4 M parameters on an H200: more than the two passes over its elements together).
constexpr int kAddThreads = 32;
__host__ __device__ inline int64_t add_blocks(const AdafactorFactored& t) {
  const int64_t columns = ((t.first_row + t.rows - 1) / t.R - t.first_row / t.R + 1) * t.C;
  return (columns + kAddThreads - 1) / kAddThreads + 1;  // + the sums' block
}

__device__ void add_groups(const GroupItem& it, int64_t block) {
  const AdafactorFactored& t = it.t;
  const Groups& gr = it.gr;
  const double* part = it.part;
  const double* sums = it.sums;
  const int64_t C = t.C, MC = t.M * t.C;
  const int64_t m_first = t.first_row / t.R;
  const int64_t m_last = (t.first_row + t.rows - 1) / t.R;
  const int64_t g_last = gr.first + gr.count - 1;
  if (block + 1 < add_blocks(t)) {
    const int64_t index = block * kAddThreads + threadIdx.x;
    if (index >= (m_last - m_first + 1) * C) return;
    const int64_t m = m_first + index / C, j = index % C;
    const int64_t g0 = m * gr.per_matrix > gr.first ? m * gr.per_matrix : gr.first;
    const int64_t g1 = (m + 1) * gr.per_matrix - 1 < g_last ? (m + 1) * gr.per_matrix - 1 : g_last;
    double c = t.acc[m * C + j], v = t.acc[MC + m * C + j];
    // In group order; loaded 16 groups ahead of the adds, so 32 loads are in flight, not one.
    constexpr int kAhead = 16;
    int64_t g = g0;
    for (; g + kAhead - 1 <= g1; g += kAhead) {
      double pc[kAhead], pw[kAhead];
#pragma unroll
      for (int i = 0; i < kAhead; ++i) {
        pc[i] = part[(g + i - gr.first) * 2 * C + j];
        pw[i] = part[(g + i - gr.first) * 2 * C + C + j];
      }
#pragma unroll
      for (int i = 0; i < kAhead; ++i) {
        c += pc[i];
        v += pw[i];
      }
    }
    for (; g <= g1; ++g) {
      const double* pc = part + (g - gr.first) * 2 * C;
      c += pc[j];
      v += pc[C + j];
    }
    t.acc[m * C + j] = c;
    t.acc[MC + m * C + j] = v;
    return;
  }
  __shared__ double scratch[kAddThreads / 32];
  for (int64_t m = m_first; m <= m_last; ++m) {
    const int64_t g0 = m * gr.per_matrix > gr.first ? m * gr.per_matrix : gr.first;
    const int64_t g1 = (m + 1) * gr.per_matrix - 1 < g_last ? (m + 1) * gr.per_matrix - 1 : g_last;
    double x = 0;
    for (int64_t g = g0 + threadIdx.x; g <= g1; g += kAddThreads) x += sums[2 * (g - gr.first)];
    x = block_sum(x, scratch);
    if (threadIdx.x == 0) t.acc[2 * MC + m] += x;
  }
  if (t.with_p2) {
    double x = 0;
    for (int64_t g = threadIdx.x; g < gr.count; g += kAddThreads) x += sums[2 * g + 1];
    x = block_sum(x, scratch);
    if (threadIdx.x == 0) t.acc[p2_at(t)] += x;
  }
}
__global__ void __launch_bounds__(kAddThreads)
    adafactor_add_groups(const __grid_constant__ Batch<GroupItem> b) {
  const int i = batch_item_of(b.start, b.count, blockIdx.x);
  add_groups(b.item[i], blockIdx.x - b.start[i]);
}

// The update's scratch for one tensor, in floats: [each column block's share of the update's
// sum of squares (doubles, an even count) | 1/sqrt of the new column factors (M·C) | each
// matrix's row mean], rounded up to 16 bytes.
struct UpdateScratch {
  int64_t blocks, rsqrt_col_at, row_mean_at, size;
};
__host__ __device__ inline UpdateScratch update_scratch(const AdafactorFactored& t) {
  UpdateScratch u{};
  u.blocks = (t.M * t.C + kThreads - 1) / kThreads;
  u.rsqrt_col_at = 2 * (u.blocks + u.blocks % 2);  // 16-byte aligned for the float4 loads
  u.row_mean_at = u.rsqrt_col_at + t.M * t.C;
  u.size = (u.row_mean_at + t.M + 3) / 4 * 4;
  return u;
}

// A factored tensor's update: its scratch (UpdateScratch); by4: four elements a thread (C a
// multiple of 4, p, g, m 16-byte aligned); small: under 2^32 elements (32-bit division).
struct UpdateItem {
  AdafactorFactored t;
  float* scratch;
  bool by4, small;
};

// One thread a column of the whole tensor (M·C): its new factor (into the state) and its 1/sqrt,
// and its term of the update's sum of squares, summed per thread block (a fixed tree); block 0
// also the row mean of each matrix. Was one thread block for all of it, with each row's factor:
// 8.2 us a tensor of 4 M parameters on an H200.
__device__ void columns(const UpdateItem& it, int64_t block) {
  const AdafactorFactored& t = it.t;
  float* const scratch = it.scratch;
  __shared__ double partial[kThreads / 32];
  const UpdateScratch layout = update_scratch(t);
  const int64_t MC = t.M * t.C, i = block * kThreads + threadIdx.x;
  const double R = static_cast<double>(t.R);
  double u2 = 0;
  if (i < MC) {
    const float col = t.col[i] * t.b2t.keep + t.b2t.add * static_cast<float>(t.acc[i] / R);
    t.col[i] = col;
    scratch[layout.rsqrt_col_at + i] = 1.0f / optim_sqrt(col);
    const float row_mean = static_cast<float>(t.acc[2 * MC + i / t.C] / R);
    u2 = static_cast<double>(row_mean) / col * t.acc[MC + i];
  }
  if (block == 0)
    for (int64_t m = threadIdx.x; m < t.M; m += kThreads)
      scratch[layout.row_mean_at + m] = static_cast<float>(t.acc[2 * MC + m] / R);
  u2 = block_sum(u2, partial);
  if (threadIdx.x == 0) reinterpret_cast<double*>(scratch)[block] = u2;
}
__global__ void __launch_bounds__(kThreads)
    adafactor_columns(const __grid_constant__ Batch<UpdateItem> b) {
  const int i = batch_item_of(b.start, b.count, blockIdx.x);
  columns(b.item[i], blockIdx.x - b.start[i]);
}

__device__ __forceinline__ float apply(float u, float p, float* m, const AdafactorCoefficients& c) {
  float x = u * c.step;
  if (m) {
    *m = adafactor_momentum(*m, x, c);
    x = *m;
  }
  return adafactor_decay_and_step(p, x, c);
}

// Element e = k·C + j of the segment: u = rf_k · rsqrt_col_(matrix, j) · g, with rf_k from the
// row's carried factor and its matrix's row mean (the thread at j = 0 also stores the factor).
// Each thread block first adds the column blocks' shares of the update's sum of squares (in
// block order: every block gets the same bits) into the step's scalars.
__device__ void update_rows(const UpdateItem& it, const Shared& shared, int64_t block) {
  const AdafactorFactored& t = it.t;
  const float* scratch = it.scratch;
  __shared__ float scalars[2];
  const UpdateScratch layout = update_scratch(t);
  AdafactorCoefficients c = shared.base;
  if (threadIdx.x == 0) {
    const double* shares = reinterpret_cast<const double*>(scratch);
    double u2 = shares[0];
    for (int64_t b = 1; b < layout.blocks; ++b) u2 += shares[b];
    const double n = static_cast<double>(t.M * t.R * t.C);
    adafactor_step_scalars(t.with_p2 ? t.acc[p2_at(t)] : 0.0, u2, n, shared.in, c);
    scalars[0] = c.step;
    scalars[1] = c.wd;
  }
  __syncthreads();
  c.step = scalars[0];
  c.wd = scalars[1];
  const float* rsqrt_col = scratch + layout.rsqrt_col_at;
  const float* row_mean = scratch + layout.row_mean_at;
  const double* carried = t.acc + carried_at(t);
  const int64_t width = it.by4 ? 4 : 1;
  const int64_t e = (block * kThreads + threadIdx.x) * width;
  if (e >= t.rows * t.C) return;
  // A 32-bit division where the segment allows (a 64-bit one is a long software sequence).
  const int64_t k =
      it.small ? static_cast<int64_t>(static_cast<uint32_t>(e) / static_cast<uint32_t>(t.C))
               : e / t.C;
  const int64_t j = e - k * t.C;
  const int64_t matrix = (t.first_row + k) / t.R;
  const int64_t col_at = matrix * t.C + j;
  const float factor = static_cast<float>(carried[k]);
  const float r = 1.0f / optim_sqrt(factor / row_mean[matrix]);
  if (j == 0) t.row[k] = factor;
  if (it.by4) {
    const float4 g = __ldg(reinterpret_cast<const float4*>(t.g + e));
    const float4 s = __ldg(reinterpret_cast<const float4*>(rsqrt_col + col_at));
    float4 p = *reinterpret_cast<const float4*>(t.p + e);
    if (t.m) {
      float4 m = *reinterpret_cast<const float4*>(t.m + e);
      p.x = apply(r * s.x * g.x, p.x, &m.x, c);
      p.y = apply(r * s.y * g.y, p.y, &m.y, c);
      p.z = apply(r * s.z * g.z, p.z, &m.z, c);
      p.w = apply(r * s.w * g.w, p.w, &m.w, c);
      *reinterpret_cast<float4*>(t.m + e) = m;
    } else {
      p.x = apply(r * s.x * g.x, p.x, nullptr, c);
      p.y = apply(r * s.y * g.y, p.y, nullptr, c);
      p.z = apply(r * s.z * g.z, p.z, nullptr, c);
      p.w = apply(r * s.w * g.w, p.w, nullptr, c);
    }
    *reinterpret_cast<float4*>(t.p + e) = p;
  } else {
    t.p[e] = apply(r * rsqrt_col[col_at] * t.g[e], t.p[e], t.m ? t.m + e : nullptr, c);
  }
}
__global__ void __launch_bounds__(kThreads)
    adafactor_update_rows(const __grid_constant__ Batch<UpdateItem> b) {
  const int i = batch_item_of(b.start, b.count, blockIdx.x);
  update_rows(b.item[i], b.shared, blockIdx.x - b.start[i]);
}

// ---- vectors: sums in a tree (thread blocks, then one block a vector), then the update ----
constexpr int64_t kVectorBlocks = 1024;
// A vector's thread blocks for its sums: a function of n alone (not of the GPU), so the tree,
// and the bits, are too.
__host__ __device__ inline int64_t vector_sum_blocks(const AdafactorVector& t) {
  const int64_t wanted = (t.n + kThreads * 4 - 1) / (kThreads * 4);
  return wanted < kVectorBlocks ? (wanted > 0 ? wanted : 1) : kVectorBlocks;
}
struct VectorItem {
  AdafactorVector t;
  double* sums;  // [block][2]: sum g²/v, sum p²
};

__device__ void vector_sums(const VectorItem& it, int64_t block) {
  const AdafactorVector& t = it.t;
  __shared__ double scratch[kThreads / 32];
  double u2 = 0, p2 = 0;
  const int64_t stride = vector_sum_blocks(t) * kThreads;
  for (int64_t i = block * kThreads + threadIdx.x; i < t.n; i += stride) {
    const float g = t.g[i];
    u2 += adafactor_g2_over_v_term(g, adafactor_new_v(t.v[i], g, t.eps1, t.b2t));
    if (t.with_p2) p2 += adafactor_p2_term(t.p[i]);
  }
  u2 = block_sum(u2, scratch);
  p2 = block_sum(p2, scratch);
  if (threadIdx.x == 0) {
    it.sums[2 * block] = u2;
    it.sums[2 * block + 1] = p2;
  }
}
__global__ void __launch_bounds__(kThreads)
    adafactor_vector_sums(const __grid_constant__ Batch<VectorItem> b) {
  const int i = batch_item_of(b.start, b.count, blockIdx.x);
  vector_sums(b.item[i], blockIdx.x - b.start[i]);
}

// One thread block a vector: its blocks' sums into the accumulator.
__global__ void __launch_bounds__(kThreads)
    adafactor_vector_total(const __grid_constant__ Batch<VectorItem> b) {
  const VectorItem& it = b.item[blockIdx.x];
  __shared__ double scratch[kThreads / 32];
  double u2 = 0, p2 = 0;
  for (int64_t i = threadIdx.x; i < vector_sum_blocks(it.t); i += kThreads) {
    u2 += it.sums[2 * i];
    p2 += it.sums[2 * i + 1];
  }
  u2 = block_sum(u2, scratch);
  p2 = block_sum(p2, scratch);
  if (threadIdx.x == 0) {
    it.t.acc[0] += u2;
    it.t.acc[1] += p2;
  }
}

__device__ void vector_update(const AdafactorVector& t, const Shared& shared, int64_t block) {
  __shared__ float scalars[2];
  AdafactorCoefficients c = shared.base;
  if (threadIdx.x == 0) {
    adafactor_step_scalars(t.acc[1], t.acc[0], static_cast<double>(t.numel), shared.in, c);
    scalars[0] = c.step;
    scalars[1] = c.wd;
  }
  __syncthreads();
  c.step = scalars[0];
  c.wd = scalars[1];
  const int64_t i = block * kThreads + threadIdx.x;
  if (i >= t.n) return;
  const float g = t.g[i];
  const float v = adafactor_new_v(t.v[i], g, t.eps1, t.b2t);
  t.v[i] = v;
  t.p[i] = apply((1.0f / optim_sqrt(v)) * g, t.p[i], t.m ? t.m + i : nullptr, c);
}
__global__ void __launch_bounds__(kThreads)
    adafactor_vector_update(const __grid_constant__ Batch<AdafactorVector> b) {
  const int i = batch_item_of(b.start, b.count, blockIdx.x);
  vector_update(b.item[i], b.shared, blockIdx.x - b.start[i]);
}

bool aligned(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

const char* last_error() {
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace

int64_t adafactor_factored_scratch(const AdafactorFactored& t) {
  if (t.rows <= 0) return 0;
  return groups_of(t).count * (2 * t.C + 2);
}

const char* launch_adafactor_accumulate_factored(const AdafactorFactored* tensors, int64_t count,
                                                 double* scratch, void* stream) {
  const auto on = static_cast<cudaStream_t>(stream);
  std::vector<GroupItem> staged, direct, all;
  int bytes = 0;  // the staged kernel's shared memory: the largest chunk of the batch
  for (int64_t i = 0; i < count; ++i) {
    const AdafactorFactored& t = tensors[i];
    if (t.rows <= 0) continue;
    if (t.C < 16) return "adafactor's CUDA kernels need rows of at least 16 columns";
    const Groups gr = groups_of(t);
    if (gr.count > 0x7fffffffLL) return "more than 2^31 - 1 row groups in one tensor";
    GroupItem it{t, gr, scratch, scratch + gr.count * 2 * t.C,
                 t.C % 4 == 0 && aligned(t.g) && aligned(t.p)};
    scratch += adafactor_factored_scratch(t);
    if (t.C <= kStagedElements) {
      const int64_t rows = staged_rows(t.C) < gr.S ? staged_rows(t.C) : gr.S;
      const int64_t need = rows * staged_stride(t.C) * static_cast<int64_t>(sizeof(float));
      bytes = need > bytes ? static_cast<int>(need) : bytes;
      staged.push_back(it);
    } else {
      direct.push_back(it);
    }
    all.push_back(it);
  }
  const auto groups = [](const GroupItem& it) { return it.gr.count; };
  const Shared none{};
  if (!staged.empty()) {
    const cudaError_t error = cudaFuncSetAttribute(
        adafactor_groups_staged, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (error != cudaSuccess) return cudaGetErrorString(error);
  }
  if (const char* error = for_each_batch(staged, none, groups, [&](const auto& b, unsigned blocks) {
        adafactor_groups_staged<<<blocks, kThreads, bytes, on>>>(b);
        return last_error();
      }))
    return error;
  if (const char* error = for_each_batch(direct, none, groups, [&](const auto& b, unsigned blocks) {
        adafactor_groups<<<blocks, kThreads, 0, on>>>(b);
        return last_error();
      }))
    return error;
  return for_each_batch(
      all, none, [](const GroupItem& it) { return add_blocks(it.t); },
      [&](const auto& b, unsigned blocks) {
        adafactor_add_groups<<<blocks, kAddThreads, 0, on>>>(b);
        return last_error();
      });
}

int64_t adafactor_factored_update_scratch(const AdafactorFactored& t) {
  return update_scratch(t).size;
}

const char* launch_adafactor_update_factored(const AdafactorFactored* tensors, int64_t count,
                                             const AdafactorStepInputs& in,
                                             const AdafactorCoefficients& base, float* scratch,
                                             void* stream) {
  const auto on = static_cast<cudaStream_t>(stream);
  std::vector<UpdateItem> items;
  for (int64_t i = 0; i < count; ++i) {
    const AdafactorFactored& t = tensors[i];
    const bool by4 =
        t.C % 4 == 0 && aligned(t.p) && aligned(t.g) && (!t.m || aligned(t.m)) && aligned(scratch);
    if (t.rows > 0) items.push_back({t, scratch, by4, t.rows * t.C < (int64_t{1} << 32)});
    scratch += update_scratch(t).size;
  }
  const Shared shared{in, base};
  if (const char* error = for_each_batch(
          items, shared, [](const UpdateItem& it) { return update_scratch(it.t).blocks; },
          [&](const auto& b, unsigned blocks) {
            adafactor_columns<<<blocks, kThreads, 0, on>>>(b);
            return last_error();
          }))
    return error;
  return for_each_batch(
      items, shared,
      [](const UpdateItem& it) {
        const int64_t per_block = kThreads * (it.by4 ? 4 : 1);
        return (it.t.rows * it.t.C + per_block - 1) / per_block;
      },
      [&](const auto& b, unsigned blocks) {
        adafactor_update_rows<<<blocks, kThreads, 0, on>>>(b);
        return last_error();
      });
}

int64_t adafactor_vector_scratch(const AdafactorVector& t) { return 2 * vector_sum_blocks(t); }

const char* launch_adafactor_accumulate_vector(const AdafactorVector* tensors, int64_t count,
                                               double* scratch, void* stream) {
  const auto on = static_cast<cudaStream_t>(stream);
  std::vector<VectorItem> items;
  for (int64_t i = 0; i < count; ++i) {
    if (tensors[i].n > 0) items.push_back({tensors[i], scratch});
    scratch += adafactor_vector_scratch(tensors[i]);
  }
  const Shared none{};
  if (const char* error = for_each_batch(
          items, none, [](const VectorItem& it) { return vector_sum_blocks(it.t); },
          [&](const auto& b, unsigned blocks) {
            adafactor_vector_sums<<<blocks, kThreads, 0, on>>>(b);
            return last_error();
          }))
    return error;
  return for_each_batch(
      items, none, [](const VectorItem&) { return int64_t{1}; },
      [&](const auto& b, unsigned) {
        adafactor_vector_total<<<b.count, kThreads, 0, on>>>(b);
        return last_error();
      });
}

const char* launch_adafactor_update_vector(const AdafactorVector* tensors, int64_t count,
                                           const AdafactorStepInputs& in,
                                           const AdafactorCoefficients& base, void* stream) {
  const auto on = static_cast<cudaStream_t>(stream);
  const std::vector<AdafactorVector> items(tensors, tensors + count);
  return for_each_batch(
      items, Shared{in, base},
      [](const AdafactorVector& t) { return (t.n + kThreads - 1) / kThreads; },
      [&](const auto& b, unsigned blocks) {
        adafactor_vector_update<<<blocks, kThreads, 0, on>>>(b);
        return last_error();
      });
}

}  // namespace loom::optim
