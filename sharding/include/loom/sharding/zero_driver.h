// loom/sharding/zero_driver.h — ZeRO stages 1, 2 and 3 as a step driver (loom/step_driver.h).
//
// The trainable parameters are cut into flat groups (flat_layout.h): gradient buckets of about
// reduce_bucket_size bytes, each cut across the ranks at the update rule's granularity. Each
// rank keeps, for its chunk of every group only, the fp32 masters (when the weights are stored
// in another dtype; fp32 weights are updated in place) and the rule's state.
//   stage 1: gradients accumulate whole in .grad over the micro-steps; on the last one each
//            bucket is reduce-scattered as soon as its gradients are ready (during backward),
//            each .grad released once packed (Note [Stage 1's gradient once packed]); the
//            rank's chunk of the averaged gradient lives until the update.
//   stage 2: on every micro-step each gradient goes into its bucket and .grad is released at
//            once; the bucket is reduce-scattered when full and its chunk added to the rank's
//            gradient shard (in the weights' dtype): the whole gradient is never held.
//   stage 3: as stage 2, and each unit of the model's UnitLists is one group whose weights are
//            held as the rank's chunk only: all-gathered before the unit's forward (the next
//            unit's gather prefetched), released after it, gathered again when backward
//            reaches the unit's output (the previous unit prefetched), released once all its
//            gradients are in their bucket, before that bucket's reduce-scatter starts; the
//            previous unit's reduce-scatter lands first, so one unit's is in flight at a time
//            (Note [Unit buckets in flight]). On gloo the gather is one broadcast per rank
//            (Note [Gathering without gloo's copy]). Parameters outside units (embeddings,
//            final norm) and those below the persistence threshold stay whole, as at stage 2.
// Then each rank updates its chunk (rules with whole-tensor statistics — Adafactor — add their
// partial sums over ranks), and every whole-kept group's updated values are all-gathered into
// the parameters, at most allgather_bucket_size bytes in flight.
//
// Note [Hybrid sharding]: with shard_group_size G < N (HSDP: FSDP's HYBRID_SHARD, DeepSpeed's
// MiCS) the N ranks form N/G shard groups of G consecutive ranks (ranks g*G .. g*G+G-1: with
// one group per node, the node's ranks, so the heavy traffic stays on the node's links).
// Everything above runs inside the group: the flat groups are cut over G ranks, gradients are
// reduce-scattered, updated values and stage 3's unit weights all-gathered, the gradient norm
// and the rules' partial sums added, all over the group's Comm (the chunks divided by N, not
// G). The groups are replicas of one another: on the window's last micro-step, as each chunk's
// reduce-scatter lands, the fp32 sum of the chunk accumulated so far and the landed one is
// all-reduced with the ranks holding the same chunk in the other groups (the replica Comm:
// ranks r, r+G, r+2G, ...), overlapping the rest of backward (at most kBucketsInFlight reduce
// buckets of them in flight); finish_backward lands them all in the gradient chunks. Each rank
// then holds its chunk of the gradient averaged over all N ranks, rounded to half precision
// once, after the sum over every rank, as stage 0 rounds its fp32 buckets, and every replica
// updates alike. That all-reduce is the only traffic between groups: Psi/G fp32 elements
// (padding included) per rank and step, whatever the accumulation; a ring all-reduce over
// R = N/G replicas sends 2 (R-1)/R of its 4 Psi/G bytes. The model state per rank is the
// formula's with G in place of N. Checkpoints: group 0's ranks write the pieces, one copy of
// the state as a G-rank run would; the ranks of the other groups write empty optimizer files
// (the manifest lists a file per rank), so a resume at any world size or G reads the pieces as
// it reads any other cut (Note [Resharding a run]).
//
// Note [ZeRO without masters]: with [optimizer] master_dtype = "bf16" and full_bf16's weights
// (Note [bf16 weights as their own masters] in core/src/step_driver.cpp) no rank keeps an fp32
// master shard: each piece's update widens its bf16 weights (the stage-3 shard, or the rank's
// piece of the replicated parameter at stages 1-2) to fp32, runs the rule, and writes the result
// back rounded stochastically with round_weights_to_bf16's bits, keyed by the parameter's name
// and each element's index in the whole tensor, so every cut (stage, ranks, shard groups) writes
// the bits of one process's update; on the CPU the core's adamw does it in its own pass
// (rule_takes_bf16_weights). Stages 1-2 then all-gather the rank's pieces from the parameters,
// as for fp32 weights. A rank holds 2 B/param of weights (stage 3: 2/N) and its state's share:
// with bf16 moments 2 + (2 + 4)/N B/param at stage 2. The fp32 copies the update makes go a few
// groups at a time (Note [Update copies bounded]). With offload_optimizer the store holds the
// state alone (SwapSegment::no_master): the walk widens each piece's weights where they live (the
// shard, or the parameter; on a GPU run copied to the host) and rounds them back there, so the
// swap file moves 8 B/param each way with fp32 moments where masters made it 12, 4 with bf16
// moments. With offload_param too the walk makes each unit's shard resident from its home (read,
// not rebuilt from masters), widens and rounds its pieces there and sends it home as it leaves
// the unit; the walks that only read (adafactor's sums) read each unit's shard once, resident
// nowhere. Without offload_optimizer nothing would bring the state to the shards: refused by
// name.
//
// Note [Offloaded ZeRO]: with offload_optimizer on NVMe the rank's pieces are the segments of a
// SegmentSwap (loom/offload/segment_swap.h): their fp32 masters and state live in the rank's
// swap file and the update walks them through a few buffers (Note [Pipelined update]), the rule
// running on the same bytes as in memory, so the weights are bitwise the in-memory run's. What
// the all-gather sends stays in memory in the weights' dtype: the chunk's new values are written
// into the stage-3 shard, or (other groups with non-fp32 weights) a values chunk; fp32 CPU
// weights are updated in place as without offload. Rules with whole-tensor statistics walk the
// file once per reduction round, reading only, before the updating walk.
//
// Note [Stage 1's gradient once packed]: on the window's last micro-step a stage-1 gradient is
// copied into its bucket's fp32 send buffer as backward makes it, and nothing reads .grad after
// (the update reads the rank's reduced chunk), so it goes then, as at stages 2-3. Keeping it to
// the next step held the whole gradient beside the chunks through the end of backward and the
// update: on one rank, where the chunk is the whole gradient too, stage 1 peaked above stage 0
// (the 110 M GPT of examples/bench/zero/zero_bench.toml: 2314 against 1768 MiB on a CPU, 2389
// against 2126 on an H200; now 1896 and 2127, as stage 2; docs/BENCHMARKS.md). What stage 1
// still holds whole is the accumulation window's gradient between its micro-steps (ZeRO's
// stage-1 anatomy: loom estimate counts it whole); after the update it holds none (the zero
// plugin's measured model state, Note [Measured model state], leaves it out of the formula).
//
// Note [Updating chunks in backward]: with [train] optimizer_in_backward (Note [Optimizer in
// backward], core/src/optimizer_in_backward.h) stages 1 and 2 update each group's chunk as
// soon as it is final: on the window's last micro-step, when the group's reduce-scatter lands
// (with shard groups: when its all-reduce across them lands), its pieces' sums of squares are
// kept for the gradient norm, the rule runs on the chunk (update_groups, the normal update's
// batching of the same segments with the same contexts: the rules are elementwise within a
// segment, so the values are bitwise the normal step's), the chunk's gradient is freed (stage
// 2's shard is made again at the group's next landing; stage 1's whole .grad goes once it is
// in its bucket) and the group's updated values are all-gathered into the parameters. Every
// parameter of a landed group has had its gradient accumulated, so autograd has run every node
// that reads it and writing it disturbs no saved tensor. The all-gathers go over a Comm of their
// own (split from the shard group's once): groups land in launch order, the same on every rank,
// but interleaved with the next reduce-scatters' launches as each rank's timing gives, and
// collectives on one Comm must start in the same order everywhere. update() then only waits for
// the last of them (at most allgather_bucket_size bytes in flight, as after a normal update).
// The gradient norm is the normal step's: per piece, in parameter order, summed over the
// ranks once backward is over. Not built: stage 3 (its shards are the weights the next unit's
// backward gathers), offloaded optimizers (one pipelined walk over the swap file) and rules
// with whole-tensor statistics (Adafactor: their sums need every chunk's before any update).
//
// Note [Offloaded parameters] (loom/sharding/shard_file.h): with offload_param, stage 3's unit
// shards live in a parameter swap file or host memory between uses, each fetched a unit ahead
// (on a GPU: copied to the device on a side stream).
//
// The driver's parts, one job each. They are files of the one class, not classes of their own
// (a first step): every part reads and writes the same per-group state (a Group holds its
// bucket's buffers, the gradient chunk the update reads, a unit's shard and its gather), and
// the reduction releases stage 3's units as their gradients go into their buckets.
//   zero_driver.cpp  construction, the gradient norm and scaling, the update's order
//   zero_reduce.cpp  gradient buckets packed, reduce-scattered and landed (Note [Bucket
//                    memory], Note [Unit buckets in flight]), and across shard groups (Note
//                    [Hybrid sharding])
//   zero_gather.cpp  stage 3's unit weights gathered and released, and the updated values
//                    all-gathered (Note [Diverged ranks], Note [Releasing a weight], Note
//                    [Gathering without gloo's copy])
//   zero_update.cpp  the update rule over the rank's pieces, in memory or in the swap file
//   zero_in_backward.cpp  each chunk updated as it lands (Note [Updating chunks in backward])
//   zero_state.cpp   the checkpoint pieces and the bytes held
// and ShardFile (shard_file.h), the parameter swap file, a class of its own.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "loom/comm.h"
#include "loom/engine.h"
#include "loom/offload/segment_swap.h"
#include "loom/sharding/flat_layout.h"
#include "loom/sharding/shard_file.h"
#include "loom/step_driver.h"

#pragma GCC visibility push(default)

namespace loom::sharding {

struct ZeroOptions {
  int stage = 1;                                // 1, 2 or 3
  int64_t reduce_bucket_bytes = 25 << 20;       // of gradients per reduce-scatter (fp32)
  int64_t allgather_bucket_bytes = 50 << 20;    // of parameters in flight in the all-gather
  bool overlap = true;                          // reduce buckets during backward
  // Stage 3: the units whose weights are sharded, in forward order: a key the unit
  // interceptor passes back (the nn::Unit's address) and the unit's parameter indices.
  std::vector<std::pair<const void*, std::vector<size_t>>> units;
  int64_t prefetch_elements = 50'000'000;       // prefetch a unit up to this size (0: never)
  int64_t max_live_elements = 1'000'000'000;    // gathered elements beyond which no prefetch
  // device = "nvme": masters and state in a swap file (Note [Offloaded ZeRO]).
  offload::OffloadOptions offload;
  // Stage 3, device = "nvme" or "cpu": the weights' shards in a swap file or host memory
  // (Note [Offloaded parameters]); twin: a CPU run stages them as a GPU run does (Note
  // [Parameter offload twin]).
  offload::OffloadOptions offload_param;
  bool offload_param_twin = false;
  // Ranks per shard group (Note [Hybrid sharding]); 0 or the world size: one group of every rank.
  int shard_group_size = 0;
  // Stage 3, Note [Sharded initialization] (loom/nn.h, sharding/sharded_init.h): units cut
  // while the model was built, by unit key: this rank's chunk of the unit's group (the same
  // plan, padding zero), in the build's dtype. Their weights hold no bytes already; the driver
  // starts from these chunks instead of slicing whole weights.
  std::unordered_map<const void*, at::Tensor> built_chunks;
};

struct ZeroStats {
  double comm_seconds = 0.0;     // launch to observed completion of the reduce-scatters
  double exposed_seconds = 0.0;  // waiting for them after backward: not hidden behind compute
  int64_t elements = 0;          // elements this rank put into collectives this step
  // Of those, the ones put into the all-reduce across shard groups (Note [Hybrid sharding]).
  int64_t cross_group_elements = 0;
  // offload_param (Note [Offloaded parameters]), this step: shard fetches issued a unit ahead,
  // and the time gathers waited for a shard's fetch (what the read-ahead did not hide).
  int64_t shard_reads_ahead = 0;
  double shard_wait_seconds = 0.0;
};

class ZeroDriver final : public StepDriver {
 public:
  // By value: the driver frees each of zero.built_chunks once its shard is made.
  ZeroDriver(const StepDriverOptions& options, ZeroOptions zero);
  ~ZeroDriver() override;
  std::string name() const override;

  // The grad-sync side, called by the zero plugin: a parameter's gradient is complete for this
  // backward; and backward is over (launch what is left, wait, land the chunks; at the window's
  // last micro-step, also reduce the chunks across shard groups: Note [Hybrid sharding]).
  void grad_ready(const Param& param);
  void finish_backward(bool window_end = true);
  // Before each backward: whether it is the window's last (Note [Hybrid sharding]: its chunks
  // go across the groups as they land).
  void begin_backward(bool window_end) { window_end_ = window_end; }
  const ZeroStats& stats() const { return stats_; }
  bool offloads_params() const { return param_file_ != nullptr; }
  // The last update's walk over the swap file; null without offload.
  const offload::OffloadStats* offload_stats() const {
    return swap_ ? &swap_->last_stats() : nullptr;
  }
  // "2 ranks, 3 groups, chunk padding 0.1 %" for the log.
  std::string describe() const;
  // Ranks per shard group, and how many groups replicate one another (Note [Hybrid sharding]).
  int shard_group_size() const { return world_; }
  int replicas() const { return replicas_; }

  // Stage 3, called by the zero plugin's unit interceptor: the unit's weights whole (waiting
  // for a prefetch if one is in flight, and prefetching the next unit in `forward` or
  // backward order), and released again. Units with no sharded weights are ignored.
  bool shards_unit(const void* unit) const { return unit_group_.count(unit) > 0; }
  void gather_unit(const void* unit, bool forward);
  void release_unit(const void* unit);
  // Every sharded weight whole in the model again, for good (the end of a run: exporters such
  // as LoRA's adapter file read the model). Collective.
  void gather_all_weights();

  // Note [Updating chunks in backward].
  bool updates_pieces_in_backward() const override;
  void begin_update_in_backward(int64_t step, double lr) override;

  void zero_grad() override;
  at::Tensor grad_norm_squared() override;
  std::vector<at::Tensor> grads() override;
  void scale_grads(double factor) override;
  void update(int64_t step, double lr) override;
  StatePieces state_pieces() const override;
  void load_state(StateReader& reader) override;
  bool state_is_sharded() const override { return world_ > 1; }  // group 0 writes the pieces
  int64_t state_bytes() const override;
  int64_t master_bytes() const override;
  int64_t grad_bytes() const override;
  std::vector<std::string> sharded_weights() const override;
  int64_t sharded_weight_bytes() const override;

 private:
  struct Placement {  // where one parameter's elements go, for one rank's piece
    size_t group;
    int rank;
    Piece piece;
  };
  struct Group {
    FlatGroup plan;
    std::vector<Segment> segments;           // plan.ranks[rank], as the rule sees them
    at::Tensor master;                       // (chunk) fp32, when the weights are not fp32
    at::Tensor values;                       // (chunk) offloaded masters' values, weights' dtype
    at::Tensor grad;                         // (chunk): stage 2 shard / stage 1 reduced chunk
    // This backward's bucket:
    at::Tensor send;                         // (world * chunk) fp32
    at::Tensor received;                     // (chunk) fp32
    std::shared_ptr<Work> work;
    bool launched_this_backward = false;     // stays set after it lands, until backward ends
    std::chrono::steady_clock::time_point launched;
    size_t pending = 0;
    // Stage 3 unit groups:
    bool sharded = false;                    // weights held as this rank's chunk only
    UnitShard unit;                          // that chunk, + the tag; its place in the file
    at::Tensor across;                       // (chunk) fp32, its all-reduce across groups
    std::shared_ptr<Work> across_work;       // ... in flight (Note [Hybrid sharding])
    at::Tensor gathering;                    // (world * chunk), while an all-gather runs
    std::shared_ptr<Work> gather_work;
    bool live = false;                       // the parameters hold their whole weights
  };

  // zero_reduce.cpp: the gradient buckets.
  void pack(Group& group, size_t param_index, const at::Tensor& grad);
  void launch(size_t g);
  void land(Group& group);
  void land_finished();  // Note [Bucket memory]
  void land_all();       // every launched group, oldest first (Note [Unit buckets in flight])
  // Note [Hybrid sharding]: a landed chunk's all-reduce across the groups started, and all of
  // them landed in the gradient chunks.
  void launch_across_replicas(size_t g, at::Tensor sum);
  void land_across(size_t g);
  void reduce_across_replicas();
  static int64_t bucket_bytes(const Group& group);  // a launched group's send + received

  // zero_gather.cpp: stage 3's units, and the updated values to every rank.
  struct ValuesGather {  // one group's updated values on their way to every rank
    size_t group;
    at::Tensor gathered;  // (world * chunk), in the weights' dtype (half types as bytes)
    std::shared_ptr<Work> work;
    int64_t bytes;
  };
  // The rank's chunk of group g's current values (masters or weights) in the weights' dtype.
  at::Tensor chunk_values(const Group& group) const;
  void all_gather_params();
  // Starts group g's all-gather of its updated values over `comm`, finishing the oldest in
  // flight past allgather_bucket_size; and finishes every one in flight (copied into the
  // parameters).
  void start_values_gather(size_t g, Comm& comm);
  void finish_values_gathers();
  void finish_values_gather(ValuesGather& gather);
  void start_gather(Group& group);
  void gather(size_t g);
  void release(size_t g);
  // Note [Offloaded parameters]: starts reading a unit's shard; every resident shard written.
  void read_ahead(Group& group);
  void flush_resident();

  // zero_update.cpp: the rule over the rank's pieces.
  struct Held {  // a piece being updated, its gradient set
    Segment* segment;
    size_t param;
    at::Tensor weights;  // Note [ZeRO without masters]: the bf16 weights the piece updates
    bool fused = false;  // ... which the rule takes as they are (rule_takes_bf16_weights)
  };
  // The rank's pieces of `groups` with their gradients: fp32 views of fp32_grads' chunks, or
  // with `as_is`, bf16 chunks the rule reads as they are (rule_reads_bf16_gradients).
  std::vector<Held> hold_pieces(const std::vector<size_t>& groups,
                                std::vector<at::Tensor>& fp32_grads, bool as_is = false);
  // Note [ZeRO without masters]: a held piece's fp32 weights made for the rule (or, fused, the
  // bf16 weights themselves), and written back rounded after it.
  void widen(const Held& h) const;
  void round_back(const Held& h, int64_t step) const;
  // segment.param (fp32, on the device or, in the offloaded walk, the host) rounded into
  // `weights` (bf16, wherever they live) with round_weights_to_bf16's bits.
  void write_rounded(const Segment& segment, at::Tensor weights, int64_t step) const;
  // Whether the rule reads this gradient chunk as it is: bf16 on the CPU, and a rule whose
  // kernels take it (the bf16 weights themselves without masters, or beside fp32 masters).
  bool reads_as_is(const at::Tensor& grad) const;
  // Piece k of group g's weights in their own dtype: a view of the stage-3 shard, or of the
  // parameter itself at stages 1-2.
  at::Tensor piece_weights(size_t g, size_t k) const;
  // The bytes of fp32 copies the update of group g makes (Note [Update copies bounded]).
  int64_t update_copy_bytes(size_t g) const;
  void run_rule(int64_t step, double lr);
  // The rule over the pieces of `groups` (rules without reduction rounds), segments sharing lr
  // and weight decay batched together as the default driver does.
  void update_groups(const std::vector<size_t>& groups, int64_t step, double lr);
  void run_rule_offloaded(int64_t step, double lr);
  // The accumulator of a tensor this rank holds no piece of (rules with reduction rounds).
  at::Tensor empty_accumulator(size_t index, int round) const;
  // Sums every tensor's accumulators over the ranks (one all-reduce).
  void reduce_accumulators(std::vector<at::Tensor>& accumulators);
  // Offload: where segment i's updated values go in the weights' dtype (Note [Offloaded ZeRO]).
  at::Tensor values_of(size_t i) const;

  // zero_in_backward.cpp: Note [Updating chunks in backward]. Group g's chunk is final.
  void chunk_final(size_t g);

  // zero_state.cpp: a rank's piece k of group g, its state and master as checkpoint pieces
  // (views of segment).
  void add_pieces(size_t g, size_t k, const Segment& segment, StatePieces& out) const;

  std::vector<Param> params_;
  std::vector<TensorInfo> tensors_;
  const UpdateRule& rule_;
  double weight_decay_;
  // Note [Hybrid sharding]: comm_ is the shard group's (the world's itself without hybrid
  // sharding); replica_comm_ joins the ranks holding the same chunks, one in each group.
  Comm& world_comm_;
  std::unique_ptr<Comm> shard_comm_, replica_comm_;
  Comm& comm_;
  ZeroOptions options_;
  int rank_, world_;  // in the shard group
  int replicas_;      // shard groups (1 without hybrid sharding)
  at::ScalarType weight_dtype_;
  c10::Device device_{c10::kCPU};
  bool separate_master_ = false;
  // Note [ZeRO without masters]: [optimizer] master_dtype = "bf16" with bf16 weights; the
  // rounding's seed; whether the rule takes the bf16 weights (and gradients) as they are, or
  // reads bf16 gradients beside fp32 masters.
  bool rounded_ = false;
  uint64_t seed_ = 0;
  bool fused_rule_ = false;
  bool reads_bf16_grads_ = false;
  std::vector<Group> groups_;
  std::vector<std::vector<Placement>> placements_;  // per parameter
  std::vector<size_t> group_of_;                    // per parameter
  std::vector<bool> ready_;                         // per parameter, this backward
  std::unordered_map<const void*, size_t> index_of_;  // TensorImpl -> parameter index
  std::vector<NamedTensors> whole_state_;             // per parameter: the rule's state, meta
  std::unique_ptr<offload::SegmentSwap> swap_;        // Note [Offloaded ZeRO]
  std::unique_ptr<ShardFile> param_file_;             // Note [Offloaded parameters]
  std::vector<std::pair<size_t, size_t>> swapped_;    // per swap segment: (group, piece k)
  ZeroStats stats_;
  std::unordered_map<const void*, size_t> unit_group_;  // stage 3: unit -> its group
  std::vector<size_t> unit_order_;                      // groups of units, forward order
  std::vector<size_t> unit_position_;                   // per group: index in unit_order_
  int64_t live_elements_ = 0;
  bool in_backward_ = false;
  bool backward_open_ = false;  // a gradient arrived since the last finish_backward
  std::deque<size_t> flying_;   // launched groups not yet landed, oldest first
  int64_t flying_bytes_ = 0;  // a unit's backward began this micro-step
  std::deque<size_t> across_flying_;  // Note [Hybrid sharding]: all-reduces across groups
  int64_t across_bytes_ = 0;
  bool window_end_ = true;            // this backward is the window's last
  std::deque<ValuesGather> values_gathers_;  // updated values in flight, oldest first
  int64_t values_gather_bytes_ = 0;
  // Note [Updating chunks in backward]: this step's update, armed by begin_update_in_backward
  // until update() completes it.
  struct BackwardUpdate {
    bool armed = false;
    int64_t step = 0;
    double lr = 0.0;
    std::vector<at::Tensor> squares;  // per parameter: its piece's sum of squares, this step
    size_t groups_updated = 0;
  } backward_update_;
  std::unique_ptr<Comm> values_comm_;  // the updated values' all-gathers in backward
};

}  // namespace loom::sharding

#pragma GCC visibility pop
