// The deterministic, rank-sharded sampler, collation, and the synchronous SampledSource.
#include "loom/data.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "loom/error.h"

namespace loom {

Sampler::Sampler(int64_t dataset_size, SamplerOptions options)
    : dataset_size_(dataset_size), options_(options) {
  LOOM_CHECK_AS(DataError, options.batch_size > 0, "batch size must be positive, got ",
                options.batch_size);
  LOOM_CHECK_AS(DataError, options.world_size > 0 && options.rank >= 0 &&
                               options.rank < options.world_size,
                "bad rank ", options.rank, " of world size ", options.world_size);
  // Every rank gets the same number of samples (the tail that does not divide is dropped), so
  // ranks never wait on each other at an epoch's end.
  per_rank_ = dataset_size / options.world_size;
  LOOM_CHECK_AS(DataError, per_rank_ >= (options.drop_last ? options.batch_size : 1),
                "the dataset has ", dataset_size, " samples: too few for batch size ",
                options.batch_size, " on ", options.world_size,
                " rank(s); use more data or a smaller per_device_train_batch_size");
}

int64_t Sampler::batches_per_epoch() const {
  return options_.drop_last ? per_rank_ / options_.batch_size
                            : (per_rank_ + options_.batch_size - 1) / options_.batch_size;
}

const std::vector<int64_t>& Sampler::order(int64_t epoch) const {
  if (cached_epoch_ == epoch) return cached_order_;
  cached_order_.resize(dataset_size_);
  if (options_.shuffle) {
    // One generator per epoch, seeded by (seed, epoch): the order depends on nothing else.
    auto generator = at::make_generator<at::CPUGeneratorImpl>(
        options_.seed * 1000003ull + static_cast<uint64_t>(epoch) * 7919ull + 1);
    at::Tensor perm = at::randperm(dataset_size_, generator, at::kLong);
    const int64_t* data = perm.data_ptr<int64_t>();
    std::copy(data, data + dataset_size_, cached_order_.begin());
  } else {
    for (int64_t i = 0; i < dataset_size_; ++i) cached_order_[i] = i;
  }
  cached_epoch_ = epoch;
  return cached_order_;
}

namespace {
DataPosition normalised(const DataPosition& p, int64_t per_rank, int64_t batch, bool drop_last) {
  if (p.cursor >= per_rank || (drop_last && p.cursor + batch > per_rank)) return {p.epoch + 1, 0};
  return p;
}
}  // namespace

std::vector<int64_t> Sampler::batch_at(const DataPosition& position) const {
  const DataPosition p =
      normalised(position, per_rank_, options_.batch_size, options_.drop_last);
  const auto& ord = order(p.epoch);
  const int64_t count = std::min(options_.batch_size, per_rank_ - p.cursor);
  std::vector<int64_t> indices(count);
  for (int64_t j = 0; j < count; ++j)
    indices[j] = ord[options_.rank + (p.cursor + j) * options_.world_size];
  return indices;
}

DataPosition Sampler::advance(const DataPosition& position) const {
  DataPosition p = normalised(position, per_rank_, options_.batch_size, options_.drop_last);
  p.cursor += std::min(options_.batch_size, per_rank_ - p.cursor);
  return p;
}

namespace {
at::Tensor pad_right(const at::Tensor& t, int64_t length, int64_t value) {
  if (t.size(0) == length) return t;
  at::Tensor out = at::full({length}, value, t.options());
  out.slice(0, 0, t.size(0)).copy_(t);
  return out;
}
}  // namespace

Batch collate(const std::vector<Sample>& samples) {
  LOOM_INTERNAL_ASSERT(!samples.empty(), "collate of no samples");
  const Sample& first = samples.front();
  int64_t longest = 0;
  bool ragged = false, masks = false, types = false;
  for (const auto& sample : samples) {
    LOOM_CHECK_AS(DataError, sample.input_ids.dim() == 1 && sample.labels.dim() == first.labels.dim(),
                  "sample ", sample.index, " has input_ids of shape ", sample.input_ids.sizes(),
                  " and labels of shape ", sample.labels.sizes(), "; sample ", first.index,
                  " has labels of shape ", first.labels.sizes(),
                  "; a batch needs 1-D input_ids and labels of one kind");
    ragged = ragged || sample.input_ids.size(0) != first.input_ids.size(0);
    longest = std::max(longest, sample.input_ids.size(0));
    masks = masks || sample.attention_mask.defined();
    types = types || sample.token_type_ids.defined();
  }
  std::vector<at::Tensor> inputs, labels, attention, token_types;
  Batch batch;
  for (const auto& sample : samples) {
    const int64_t length = sample.input_ids.size(0);
    inputs.push_back(pad_right(sample.input_ids, longest, 0));
    labels.push_back(sample.labels.dim() == 1 ? pad_right(sample.labels, longest, kIgnoreIndex)
                                              : sample.labels);
    if (ragged || masks) {
      at::Tensor mask = sample.attention_mask.defined()
                            ? sample.attention_mask
                            : at::ones({length}, sample.input_ids.options());
      attention.push_back(pad_right(mask, longest, 0));
    }
    if (types) {
      at::Tensor t = sample.token_type_ids.defined() ? sample.token_type_ids
                                                      : at::zeros({length}, sample.input_ids.options());
      token_types.push_back(pad_right(t, longest, 0));
    }
    batch.sample_indices.push_back(sample.index);
  }
  batch.input_ids = at::stack(inputs);
  batch.labels = at::stack(labels);
  if (!attention.empty()) batch.attention_mask = at::stack(attention);
  if (!token_types.empty()) batch.token_type_ids = at::stack(token_types);
  return batch;
}

SampledSource::SampledSource(std::shared_ptr<const Dataset> dataset, SamplerOptions options)
    : dataset_(std::move(dataset)), sampler_(dataset_->size(), options) {}

Batch SampledSource::next() {
  std::vector<Sample> samples;
  for (int64_t index : sampler_.batch_at(position_)) {
    try {
      samples.push_back(dataset_->get(index));
    } catch (const std::exception& error) {
      throw DataError(detail::cat("sample ", index, " of ", dataset_->describe(),
                                  " failed: ", error.what()));
    }
    samples.back().index = index;
  }
  position_ = sampler_.advance(position_);
  return collate(samples);
}

std::string SampledSource::describe() const { return dataset_->describe(); }

}  // namespace loom
