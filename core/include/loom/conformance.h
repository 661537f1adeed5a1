// loom/conformance.h — conformance kits: what the engine relies on from each kind of plugin,
// checked on a plugin's own objects. Each kit returns a Report (its failures as sentences; no
// test framework needed), so a plugin's test suite asserts `report.ok()` and prints
// `report.text()`. loom's own test suite runs every in-tree plugin through its kit
// (tests/core/test_conformance.cpp); docs/plugins.md says when to use which.
//   check_update_rule  a rule split at any cut its partitioning allows updates bit for bit as
//                      unsplit; its state round-trips through a checkpoint file; its state
//                      bytes are those init_state reported (what drivers count)
//   check_dataset      deterministic samples; the sampler's shards of it are disjoint and
//                      cover it; a source resumed mid-epoch continues exactly
//   check_model        forward is deterministic; every trainable parameter gets a gradient
//   check_interceptor  gradients with the interceptor equal those without it
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "loom/data.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/safetensors.h"
#include "loom/update_rule.h"

namespace loom::conformance {

struct Report {
  std::string subject;
  std::vector<std::string> failures;
  bool ok() const { return failures.empty(); }
  std::string text() const {
    std::ostringstream out;
    out << subject << ": " << (ok() ? "conforms" : std::to_string(failures.size()) + " failure(s)");
    for (const auto& f : failures) out << "\n  - " << f;
    return out.str();
  }
  template <typename... Parts>
  void fail(const Parts&... parts) {
    std::ostringstream out;
    (out << ... << parts);
    failures.push_back(out.str());
  }
};

namespace detail {

// The cuts a rule allows in a tensor of `shape` (offsets in the flattened tensor, not 0 or n).
inline std::vector<int64_t> allowed_cuts(const Partitioning& p, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const int64_t row = shape.size() > 1 ? n / shape[0] : 1;
  std::vector<int64_t> cuts;
  for (int64_t at : {n / 3, n / 2, (2 * n) / 3 + 1}) {
    int64_t cut = at;
    switch (p.granularity) {
      case Granularity::element: break;
      case Granularity::block: cut = at / p.block * p.block; break;
      case Granularity::row: cut = at / row * row; break;
      case Granularity::tensor: cut = 0; break;
    }
    if (cut > 0 && cut < n && (cuts.empty() || cut > cuts.back())) cuts.push_back(cut);
  }
  return cuts;
}

// One tensor's segments over the flat fp32 `param` and `grad`, cut at `cuts`.
inline std::vector<Segment> segments_of(const UpdateRule& rule, const std::string& name,
                                        const std::vector<int64_t>& shape, at::Tensor& param,
                                        const at::Tensor& grad, const std::vector<int64_t>& cuts) {
  std::vector<Segment> out;
  int64_t start = 0;
  std::vector<int64_t> ends = cuts;
  ends.push_back(param.numel());
  for (int64_t end : ends) {
    Segment s;
    s.name = name;
    s.param = param.narrow(0, start, end - start);
    s.grad = grad.narrow(0, start, end - start);
    s.shape = shape;
    s.offset = start;
    s.state = rule.init_state(s);
    out.push_back(std::move(s));
    start = end;
  }
  return out;
}

inline void run_update(const UpdateRule& rule, std::vector<Segment>& segments, int64_t step) {
  std::vector<Segment*> pointers;
  for (auto& s : segments) pointers.push_back(&s);
  UpdateContext context;
  context.step = step;
  context.lr = 1e-2;
  context.weight_decay = 0.01;
  update_tensor(rule, pointers, context);
}

inline int64_t state_bytes(const std::vector<Segment>& segments) {
  int64_t bytes = 0;
  for (const auto& s : segments)
    for (const auto& [key, t] : s.state) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  return bytes;
}

}  // namespace detail

// The update rule on fp32 tensors of `shapes` (seeded random parameters and gradients), three
// steps each: unsplit, and split at cuts its partitioning allows.
inline Report check_update_rule(const UpdateRule& rule,
                                const std::vector<std::vector<int64_t>>& shapes = {
                                    {96, 64}, {640}, {12, 10, 6}}) {
  Report report{"update rule '" + rule.name() + "'", {}};
  at::manual_seed(1234);
  const auto scratch = std::filesystem::temp_directory_path() /
                       ("loom-conformance-" + std::to_string(::getpid()) + ".safetensors");
  for (const auto& shape : shapes) {
    const std::string name = "p" + std::to_string(&shape - shapes.data());
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const at::Tensor start = at::randn({n}) * 0.1;
    std::vector<at::Tensor> grads;
    for (int step = 0; step < 3; ++step) grads.push_back(at::randn({n}) * 0.01);
    auto train = [&](const std::vector<int64_t>& cuts, bool through_file) {
      at::Tensor param = start.clone(), grad = at::empty({n});
      auto segments = detail::segments_of(rule, name, shape, param, grad, cuts);
      const int64_t initial_bytes = detail::state_bytes(segments);
      for (int step = 0; step < 3; ++step) {
        grad.copy_(grads[static_cast<size_t>(step)]);
        if (through_file && step == 2) {
          // A checkpoint between steps: the state written, fresh segments, the state read.
          NamedTensors saved;
          for (size_t i = 0; i < segments.size(); ++i)
            for (const auto& [key, t] : segments[i].state)
              saved.emplace_back(std::to_string(i) + "/" + key, t);
          safetensors::save(scratch, saved);
          auto fresh = detail::segments_of(rule, name, shape, param, grad, cuts);
          std::map<std::string, at::Tensor> read;
          for (auto& [key, t] : safetensors::load(scratch).tensors) read[key] = t;
          for (size_t i = 0; i < fresh.size(); ++i)
            for (auto& [key, t] : fresh[i].state) {
              auto it = read.find(std::to_string(i) + "/" + key);
              if (it == read.end() || it->second.sizes() != t.sizes()) {
                report.fail(name, ": state '", key, "' does not round-trip through a file");
                return param;
              }
              t.copy_(it->second);
            }
          segments = std::move(fresh);
        }
        detail::run_update(rule, segments, step + 1);
      }
      if (detail::state_bytes(segments) != initial_bytes)
        report.fail(name, ": the state grew from ", initial_bytes, " to ",
                    detail::state_bytes(segments), " bytes after init_state (drivers count "
                    "init_state's tensors)");
      if (!at::isfinite(param).all().item<bool>()) report.fail(name, ": non-finite parameters");
      return param;
    };
    const at::Tensor whole = train({}, false);
    if (at::equal(whole, start)) report.fail(name, ": three updates left the parameter unchanged");
    const auto cuts = detail::allowed_cuts(rule.partitioning(), shape);
    if (!cuts.empty() && !at::equal(train(cuts, false), whole))
      report.fail(name, " ", at::IntArrayRef(shape), ": split at ", at::IntArrayRef(cuts),
                  " (allowed by its partitioning) differs from the unsplit update");
    if (!at::equal(train(cuts, true), whole))
      report.fail(name, ": a state saved and loaded between steps changes the result");
  }
  std::error_code ec;
  std::filesystem::remove(scratch, ec);
  return report;
}

// A dataset through the core's sampler and source: samples are deterministic; `world_size`
// ranks' shards of an epoch are disjoint and cover every sample (less the remainder a multiple
// of world_size trims); a source stopped mid-epoch and another seeked to its position draw the
// same batches.
inline Report check_dataset(const std::shared_ptr<const Dataset>& dataset, int64_t batch_size = 2,
                            int world_size = 3) {
  Report report{"dataset '" + dataset->describe() + "'", {}};
  const int64_t size = dataset->size();
  if (size < world_size * batch_size) {
    report.fail("has ", size, " samples; the kit needs at least ", world_size * batch_size);
    return report;
  }
  for (int64_t i : {int64_t{0}, size / 2, size - 1}) {
    const Sample a = dataset->get(i), b = dataset->get(i);
    if (!at::equal(a.input_ids, b.input_ids) ||
        (a.labels.defined() && !at::equal(a.labels, b.labels)))
      report.fail("get(", i, ") is not deterministic");
  }
  std::set<int64_t> seen;
  int64_t drawn = 0;
  for (int rank = 0; rank < world_size; ++rank) {
    SamplerOptions o{batch_size, true, false, 7, rank, world_size};
    Sampler sampler(size, o);
    DataPosition at;
    for (int64_t b = 0; b < sampler.batches_per_epoch(); ++b) {
      for (int64_t index : sampler.batch_at(at)) {
        ++drawn;
        if (!seen.insert(index).second) report.fail("sample ", index, " is in two ranks' shards");
      }
      at = sampler.advance(at);
    }
  }
  if (static_cast<int64_t>(seen.size()) != size / world_size * world_size)
    report.fail("the shards cover ", seen.size(), " of ", size / world_size * world_size,
                " samples");
  SamplerOptions o{batch_size, true, true, 7, 1, world_size};
  SampledSource first(dataset, o), resumed(dataset, o);
  const int64_t half = std::max<int64_t>(1, first.sampler().batches_per_epoch() / 2);
  for (int64_t b = 0; b < half; ++b) first.next();
  resumed.seek(first.position());
  for (int64_t b = 0; b < first.sampler().batches_per_epoch() + 1; ++b) {
    const Batch x = first.next(), y = resumed.next();
    if (x.sample_indices != y.sample_indices || !at::equal(x.input_ids, y.input_ids)) {
      report.fail("a source seeked to batch ", half, " of an epoch draws batch ", half + b,
                  " differently");
      break;
    }
  }
  return report;
}

// A model on `batch` (with labels): two forwards in eval mode give the same loss (and logits,
// where the model returns them: one with a fused loss need not, Note [Fused linear
// cross-entropy] in loom/loss.h) bit for bit, and a forward without labels gives logits; in
// train mode a backward of loss_sum gives every trainable parameter a finite gradient.
inline Report check_model(Model& model, const Batch& batch, const std::string& name = "model") {
  Report report{name, {}};
  {
    at::NoGradGuard no_grad;
    model.eval();
    const Output a = model.forward(batch), b = model.forward(batch);
    if (!a.loss_sum.defined() || a.loss_sum.dim() != 0 || a.num_targets <= 0)
      report.fail("forward with labels gives no 0-d loss_sum and positive num_targets");
    else if (!b.loss_sum.defined() || !at::equal(a.loss_sum, b.loss_sum) ||
             a.logits.defined() != b.logits.defined() ||
             (a.logits.defined() && !at::equal(a.logits, b.logits)))
      report.fail("two forwards of one batch in eval mode differ");
    Batch unlabeled = batch;
    unlabeled.labels = at::Tensor();
    if (!model.forward(unlabeled).logits.defined())
      report.fail("forward without labels gives no logits");
  }
  model.train();
  for (auto& p : model.parameters()) p.mutable_grad() = at::Tensor();
  const Output out = model.forward(batch);
  out.loss_sum.backward();
  for (const auto& item : model.named_parameters()) {
    const at::Tensor& p = item.value();
    if (!p.requires_grad()) continue;
    if (!p.grad().defined())
      report.fail("parameter '", item.key(), "' gets no gradient: it is not reachable from the loss");
    else if (!at::isfinite(p.grad()).all().item<bool>())
      report.fail("parameter '", item.key(), "' gets a non-finite gradient");
  }
  for (auto& p : model.parameters()) p.mutable_grad() = at::Tensor();
  return report;
}

// A unit interceptor on a model of loom::nn::UnitLists: the loss and every gradient of a
// train-mode forward and backward of `batch` with the interceptor equal those without it, bit
// for bit. `rng_seed` is set before each run, so dropout draws alike.
inline Report check_interceptor(Model& model, const std::shared_ptr<nn::UnitInterceptor>& interceptor,
                                const Batch& batch, uint64_t rng_seed = 5) {
  Report report{"unit interceptor '" + interceptor->name() + "'", {}};
  std::vector<nn::UnitList*> lists;
  for (const auto& module : model.modules(/*include_self=*/false))
    if (auto* list = dynamic_cast<nn::UnitList*>(module.get())) lists.push_back(list);
  if (lists.empty()) {
    report.fail("the model has no loom::nn::UnitList to intercept");
    return report;
  }
  std::vector<std::vector<std::shared_ptr<nn::UnitInterceptor>>> before;
  for (auto* list : lists) before.push_back(list->interceptors());
  auto run = [&](bool with) {
    for (size_t i = 0; i < lists.size(); ++i) {
      auto chain = before[i];
      if (with) chain.push_back(interceptor);
      lists[i]->set_interceptors(chain);
    }
    model.train();
    for (auto& p : model.parameters()) p.mutable_grad() = at::Tensor();
    at::manual_seed(static_cast<int64_t>(rng_seed));
    const Output out = model.forward(batch);
    out.loss_sum.backward();
    std::map<std::string, at::Tensor> grads{{"(loss)", out.loss_sum.detach().clone()}};
    for (const auto& item : model.named_parameters())
      if (item.value().grad().defined()) grads[item.key()] = item.value().grad().clone();
    return grads;
  };
  const auto plain = run(false), intercepted = run(true);
  for (size_t i = 0; i < lists.size(); ++i) lists[i]->set_interceptors(before[i]);
  for (auto& p : model.parameters()) p.mutable_grad() = at::Tensor();
  for (const auto& [key, g] : plain) {
    auto it = intercepted.find(key);
    if (it == intercepted.end()) report.fail("'", key, "' has no gradient with the interceptor");
    else if (!at::equal(it->second, g)) report.fail("'", key, "' differs with the interceptor");
  }
  if (intercepted.size() != plain.size())
    report.fail("with the interceptor ", intercepted.size(), " tensors have gradients, without ",
                plain.size());
  return report;
}

}  // namespace loom::conformance
