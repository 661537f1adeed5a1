// loom/data.h — datasets (index -> sample), the rank-sharded deterministic sampler, and the
// DataSource the engine pulls micro-batches from. Preloading (worker threads) wraps a
// DataSource; it does not change which samples come in which order.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/batch.h"

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom {

// One example. input_ids (T) int64; labels (T) for LM or a 0-d int64 for classification.
// attention_mask and token_type_ids (T) int64 are optional (undefined: all ones / all zeros).
// Samples of one batch may differ in T: collate pads them (see there).
struct Sample {
  at::Tensor input_ids;
  at::Tensor labels;
  int64_t index = -1;
  at::Tensor attention_mask;
  at::Tensor token_type_ids;
};

// Random access to samples. get() must be deterministic and thread-safe: the same index gives
// the same sample whatever order or thread asks.
class Dataset {
 public:
  virtual ~Dataset();
  virtual int64_t size() const = 0;
  virtual Sample get(int64_t index) const = 0;
  virtual std::string describe() const = 0;
  // Classification data whose labels are names: the label map, names in id order (label i is
  // names[i]). The checkpoint keeps it and `loom export` writes it as config.json's
  // id2label/label2id. Empty (the default): the labels are plain ids.
  virtual std::vector<std::string> label_names() const;
};

// Where a rank is in the data: the epoch and how many of its samples of that epoch it consumed.
struct DataPosition {
  int64_t epoch = 0;
  int64_t cursor = 0;
  bool operator==(const DataPosition&) const = default;
};

struct SamplerOptions {
  int64_t batch_size = 1;
  bool shuffle = true;
  bool drop_last = true;
  uint64_t seed = 0;
  int rank = 0;
  int world_size = 1;
};

// The epoch's order: a permutation seeded by (seed, epoch), split round-robin over ranks
// (rank r takes positions r, r+W, ...) after trimming to a multiple of world_size, as
// torch's DistributedSampler does with drop_last.
class Sampler {
 public:
  Sampler(int64_t dataset_size, SamplerOptions options);
  // The dataset indices of the batch at `position`; advances nothing.
  std::vector<int64_t> batch_at(const DataPosition& position) const;
  // Position after taking one batch at `position` (rolls over to the next epoch).
  DataPosition advance(const DataPosition& position) const;
  int64_t samples_per_rank() const { return per_rank_; }
  int64_t batches_per_epoch() const;
  const SamplerOptions& options() const { return options_; }

 private:
  const std::vector<int64_t>& order(int64_t epoch) const;
  int64_t dataset_size_, per_rank_;
  SamplerOptions options_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_order_;
};

// Stacks samples into a Batch. Samples shorter than the batch's longest are padded on the
// right (as DataCollatorWithPadding does): input_ids and token_type_ids with 0, per-token labels
// with kIgnoreIndex, attention_mask with 0; the batch then has an attention_mask. Padding at
// the right never changes a causal model's real positions, and the mask keeps it out of a
// bidirectional one's attention.
Batch collate(const std::vector<Sample>& samples);

// What the engine pulls micro-batches from.
class DataSource {
 public:
  virtual ~DataSource();
  virtual Batch next() = 0;
  virtual DataPosition position() const = 0;  // of the next batch next() returns
  virtual void seek(const DataPosition& position) = 0;
  virtual const Sampler& sampler() const = 0;
  virtual std::string describe() const = 0;
};

// The plain, synchronous source: sampler + dataset + collate on the calling thread.
class SampledSource : public DataSource {
 public:
  SampledSource(std::shared_ptr<const Dataset> dataset, SamplerOptions options);
  Batch next() override;
  DataPosition position() const override { return position_; }
  void seek(const DataPosition& position) override { position_ = position; }
  const Sampler& sampler() const override { return sampler_; }
  std::string describe() const override;
  const std::shared_ptr<const Dataset>& dataset() const { return dataset_; }

 private:
  std::shared_ptr<const Dataset> dataset_;
  Sampler sampler_;
  DataPosition position_;
};

}  // namespace loom

#pragma GCC visibility pop
