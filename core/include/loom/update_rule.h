// loom/update_rule.h — optimizers as update rules over flat fp32 segments.
// Not a torch::optim::Optimizer: a rule sees a contiguous 1-D slice of one parameter (param,
// grad, its own state) plus the full tensor's shape and the slice's offset. The same rule thus
// runs unsharded (one segment per tensor), on a ZeRO shard, on a CPU-offloaded shard, or on
// NVMe chunks streamed through memory; the driver cuts segments only at the rule's
// partitioning granularity.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/config.h"

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom {

enum class Granularity {
  element,  // any cut is fine (Adam, SGD, Lion)
  block,    // cuts only at multiples of `block` elements of the flattened tensor (8-bit Adam)
  row,      // cuts only between rows of the tensor viewed as (shape[0], rest) (Adafactor)
  tensor,   // never cut a tensor
};

struct Partitioning {
  Granularity granularity = Granularity::element;
  int64_t block = 1;  // for Granularity::block
};

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// One contiguous slice of a parameter. param and grad are 1-D fp32 views of the same numel;
// the rule updates param in place and owns `state` (made by init_state).
struct Segment {
  std::string name;             // the parameter's name
  at::Tensor param;             // (n) fp32, updated in place
  at::Tensor grad;              // (n) fp32
  std::vector<int64_t> shape;   // the whole tensor's shape
  int64_t offset = 0;           // where this slice starts in the flattened whole tensor
  int group = 0;                // parameter group
  NamedTensors state;

  at::Tensor& state_at(const std::string& key);
  const at::Tensor& state_at(const std::string& key) const;
};

// Per-update values, already resolved for the segment's group.
struct UpdateContext {
  int64_t step = 1;          // 1-based count of this update (bias correction)
  double lr = 0.0;
  double weight_decay = 0.0;
  // Whole-tensor reductions of the rounds done so far (see UpdateRule::reduction_rounds).
  std::vector<at::Tensor> totals;
};

class UpdateRule {
 public:
  virtual ~UpdateRule();
  virtual std::string name() const = 0;
  virtual Partitioning partitioning() const { return {}; }
  // State tensors for a new segment (e.g. Adam's exp_avg, exp_avg_sq), on param's device.
  virtual NamedTensors init_state(const Segment& segment) const = 0;
  virtual void update(Segment& segment, const UpdateContext& context) const = 0;

  // The [optimizer] state_dtype values this rule can keep its state in (Note [Stochastic
  // rounding of the state] in core/src/adamw.cpp is the core's adamw). The core refuses any
  // other value by name before the run starts; a rule offering more than "fp32" reads the key
  // from its table (it is one of the core's common [optimizer] keys) in its constructor.
  virtual std::vector<std::string> state_dtypes() const { return {"fp32"}; }
  // The run's [train] seed, the same on every rank, given once before the first update: the
  // stream of a rule that rounds stochastically. Its random bits must depend only on the seed,
  // the step, the parameter and the element's index in the whole tensor, so a resume, a thread
  // count, a ZeRO cut or an offload chunk cannot change them.
  virtual void set_seed(uint64_t seed) { (void)seed; }

  // Whole-tensor statistics. A rule whose update of one segment needs statistics of its whole
  // tensor (Adafactor: column means of g², RMS of the parameter and of the update) declares
  // rounds. In round r every segment of the tensor adds its share into one fp64 accumulator
  // (make_accumulator), segments in offset order; context.totals then holds rounds 0..r-1 for
  // round r, and all rounds for update. Computing each row's share inside the row and folding
  // rows in order makes a split run bit-identical to the unsplit one. A sharded driver folds
  // its own segments and sums the accumulators over ranks.
  virtual int reduction_rounds() const { return 0; }

  // Whole tensors (one segment each) that share one context, updated in one call, so a rule
  // can batch them into one multi-tensor kernel (adamw on CUDA: one fused launch for the whole
  // model instead of one per tensor; launches, not bytes, bound a GPU step of many small
  // tensors). The default runs update_tensor on each; results must not depend on the batching.
  virtual void update_many(const std::vector<Segment*>& segments,
                           const UpdateContext& context) const;
  virtual at::Tensor make_accumulator(const Segment& segment, int round) const;
  virtual void accumulate(const Segment& segment, const UpdateContext& context, int round,
                          at::Tensor& accumulator) const;
};

// Updates one tensor given as its segments in offset order (each with param and grad set):
// runs the reduction rounds, then update() on every segment. Checks that the cuts respect
// the rule's partitioning. Drivers and tests share it.
void update_tensor(const UpdateRule& rule, const std::vector<Segment*>& segments,
                   UpdateContext context);

// Note [Whole tensors shared among threads]: a CPU rule whose kernels split each tensor over
// the intra-op threads pays one parallel region, ending at a barrier, per tensor (adafactor two
// or three); on 2 vCPUs a step of 100 tensors met ~300 barriers, and each stall of one vCPU
// held the other (adafactor scaled 1.55x on 2 threads where torch's fused AdamW scaled 1.7x;
// under load its steps took 3-10x longer). This runs a batch of whole tensors (update_many's)
// so: a tensor larger than 1/(2 x threads) of the batch's elements, or one `shareable` refuses
// (a GPU tensor, a path whose bits depend on the thread count), alone, split over the threads
// as before; the rest whole, each on one thread (whichever is free next, largest first) in one
// parallel region, where their own at::parallel_for runs inline. For a rule whose results do
// not depend on the thread count (OptimConformance.ThreadCountDoesNotChangeResults holds the
// optim plugin's rules and the core's adamw to it), so the bits are one tensor at a time's.
void update_sharing_threads(const UpdateRule& rule, const std::vector<Segment*>& segments,
                            const UpdateContext& context,
                            const std::function<bool(const Segment&)>& shareable);

// The core's AdamW ([optimizer] name = "adamw"; keys beta1, beta2, eps), for drivers, tests
// and benchmarks that build a rule themselves.
std::unique_ptr<UpdateRule> make_adamw(const ConfigSection& table);

}  // namespace loom

#pragma GCC visibility pop
