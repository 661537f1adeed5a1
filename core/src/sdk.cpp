// Small out-of-line pieces of the SDK: key functions of the interfaces (one vtable, in the
// core), the default plugin behaviour, names of enums, batch helpers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

#include "loom/batch.h"
#include "loom/comm.h"
#include "loom/data.h"
#include "loom/engine.h"
#include "loom/error.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/plugin.h"
#include "loom/step_driver.h"
#include "loom/update_rule.h"

namespace loom {

const char* to_string(Slot slot) {
  switch (slot) {
    case Slot::model: return "model";
    case Slot::data: return "data";
    case Slot::precision: return "precision";
    case Slot::update_rule: return "update_rule";
    case Slot::grad_sync: return "grad_sync";
    case Slot::step_driver: return "step_driver";
  }
  return "?";
}

const char* to_string(Event event) {
  switch (event) {
    case Event::setup: return "setup";
    case Event::model_built: return "model_built";
    case Event::params_ready: return "params_ready";
    case Event::batch: return "batch";
    case Event::before_forward: return "before_forward";
    case Event::after_forward: return "after_forward";
    case Event::before_backward: return "before_backward";
    case Event::grad_ready: return "grad_ready";
    case Event::after_backward: return "after_backward";
    case Event::before_update: return "before_update";
    case Event::after_update: return "after_update";
    case Event::step_end: return "step_end";
    case Event::evaluate: return "evaluate";
    case Event::save: return "save";
    case Event::load: return "load";
    case Event::teardown: return "teardown";
  }
  return "?";
}

Plugin::~Plugin() = default;
void Plugin::configure(const ConfigSection&) {}
void Plugin::attach(Engine&) {}
std::shared_ptr<Model> Plugin::create_model(const std::string& name, const ConfigSection&,
                                            Engine&) {
  throw InternalError(detail::cat("plugin '", this->name(), "' declares model '", name,
                                  "' but does not implement create_model"));
}
std::shared_ptr<const Dataset> Plugin::create_dataset(const std::string& name,
                                                      const ConfigSection&, Engine&) {
  throw InternalError(detail::cat("plugin '", this->name(), "' declares data source '", name,
                                  "' but does not implement create_dataset"));
}
void Plugin::validate(const std::string&, const ConfigSection&, const JobTables&) const {}
std::string Plugin::unit_count_key(const std::string&) const { return {}; }
void Plugin::declare_memory(const ConfigSection&, const memory::MemoryContext&,
                            memory::MemoryTerms&) const {}
std::vector<memory::MemoryVariant> Plugin::memory_variants() const { return {}; }

std::unique_ptr<UpdateRule> Plugin::create_update_rule(const std::string& name,
                                                       const ConfigSection&) {
  throw InternalError(detail::cat("plugin '", this->name(), "' declares optimizer '", name,
                                  "' but does not implement create_update_rule"));
}

std::optional<pretrained::Export> Plugin::export_pretrained(
    const std::string&, const ConfigSection&, const NamedTensors&,
    const std::function<std::string(const std::string&)>&) const {
  return std::nullopt;
}

bool Plugin::merge_for_export(const ConfigSection&, NamedTensors&,
                              const std::function<std::string(const std::string&)>&) const {
  return false;
}

std::unique_ptr<StepDriver> Plugin::create_step_driver(const StepDriverOptions&, Engine&) {
  throw InternalError(detail::cat("plugin '", this->name(),
                                  "' fills slot step_driver but does not implement "
                                  "create_step_driver"));
}

bool Plugin::keeps_no_masters(const ConfigSection&) const { return false; }

Engine::~Engine() = default;
UpdateRule::~UpdateRule() = default;
Work::~Work() = default;
Comm::~Comm() = default;
c10::Device Comm::device() const { return c10::Device(c10::kCPU); }
Dataset::~Dataset() = default;
std::vector<std::string> Dataset::label_names() const { return {}; }
DataSource::~DataSource() = default;
nn::UnitInterceptor::~UnitInterceptor() = default;

at::Tensor& Segment::state_at(const std::string& key) {
  for (auto& [name, tensor] : state)
    if (name == key) return tensor;
  throw InternalError(detail::cat("segment '", name, "' has no state '", key, "'"));
}

const at::Tensor& Segment::state_at(const std::string& key) const {
  return const_cast<Segment*>(this)->state_at(key);
}

at::Tensor UpdateRule::make_accumulator(const Segment&, int) const {
  return at::zeros({0}, at::kDouble);
}
void UpdateRule::accumulate(const Segment&, const UpdateContext&, int, at::Tensor&) const {}

void update_tensor(const UpdateRule& rule, const std::vector<Segment*>& segments,
                   UpdateContext context) {
  LOOM_INTERNAL_ASSERT(!segments.empty(), "update_tensor needs at least one segment");
  // The cuts must fall where the rule allows (a driver bug otherwise, never a user's).
  const Partitioning part = rule.partitioning();
  const auto& shape = segments.front()->shape;
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const int64_t row = shape.empty() || shape[0] == 0 ? 1 : numel / shape[0];
  int64_t expected_offset = segments.front()->offset;
  for (const Segment* s : segments) {
    LOOM_INTERNAL_ASSERT(s->offset == expected_offset, "segments of '", s->name,
                         "' are not contiguous in offset order");
    expected_offset += s->param.numel();
    const bool whole = s->offset == 0 && s->param.numel() == numel;
    const int64_t unit = part.granularity == Granularity::block ? part.block
                         : part.granularity == Granularity::row ? row
                         : part.granularity == Granularity::tensor ? numel
                                                                   : 1;
    LOOM_INTERNAL_ASSERT(whole || (s->offset % unit == 0 &&
                                   (s->param.numel() % unit == 0 ||
                                    s->offset + s->param.numel() == numel)),
                         "segment of '", s->name, "' at offset ", s->offset, " (", s->param.numel(),
                         " elements) cuts across the rule's ", rule.name(), " partitioning");
  }
  context.totals.clear();
  for (int round = 0; round < rule.reduction_rounds(); ++round) {
    at::Tensor accumulator = rule.make_accumulator(*segments.front(), round);
    for (const Segment* s : segments) rule.accumulate(*s, context, round, accumulator);
    context.totals.push_back(accumulator);
  }
  for (Segment* s : segments) rule.update(*s, context);
}

void update_sharing_threads(const UpdateRule& rule, const std::vector<Segment*>& segments,
                            const UpdateContext& context,
                            const std::function<bool(const Segment&)>& shareable) {
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  if (threads < 2 || segments.size() < 2) {
    for (Segment* s : segments) update_tensor(rule, {s}, context);
    return;
  }
  int64_t total = 0;
  for (const Segment* s : segments) total += s->param.numel();
  std::vector<Segment*> shared;
  for (Segment* s : segments) {
    if (s->param.numel() * 2 * threads <= total && shareable(*s)) {
      shared.push_back(s);
    } else {
      update_tensor(rule, {s}, context);
    }
  }
  std::stable_sort(shared.begin(), shared.end(), [](const Segment* a, const Segment* b) {
    return a->param.numel() > b->param.numel();
  });
  std::atomic<size_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (size_t i; (i = next.fetch_add(1)) < shared.size();)
        update_tensor(rule, {shared[i]}, context);
  });
}

void UpdateRule::update_many(const std::vector<Segment*>& segments,
                             const UpdateContext& context) const {
  for (Segment* s : segments) update_tensor(*this, {s}, context);
}

bool Model::no_weight_decay(const std::string&, const at::Tensor& param) const {
  return param.dim() < 2;
}

CausalLM::~CausalLM() = default;

int64_t Batch::num_loss_targets() const {
  if (host_stats.known) return host_stats.loss_targets;
  if (!labels.defined()) return 0;
  return labels.ne(kIgnoreIndex).sum().item<int64_t>();
}

std::pair<int64_t, int64_t> Batch::input_id_range() const {
  if (host_stats.known) return {host_stats.min_input_id, host_stats.max_input_id};
  if (!input_ids.defined() || input_ids.numel() == 0) return {0, -1};
  auto [low, high] = at::aminmax(input_ids);
  return {low.item<int64_t>(), high.item<int64_t>()};
}

int64_t Batch::max_label() const {
  if (host_stats.known) return host_stats.max_label;
  if (!labels.defined() || labels.numel() == 0) return -1;
  return labels.max().item<int64_t>();
}

void Batch::compute_host_stats() {
  LOOM_CHECK(!input_ids.defined() || input_ids.is_cpu(),
             "Batch::compute_host_stats runs on the host copy of a batch, before it moves");
  host_stats = HostStats{};
  host_stats.loss_targets = num_loss_targets();
  std::tie(host_stats.min_input_id, host_stats.max_input_id) = input_id_range();
  host_stats.max_label = max_label();
  host_stats.known = true;
}

Batch Batch::pinned() const {
  auto pin = [](const at::Tensor& t) {
    return t.defined() && t.is_cpu() && !t.is_pinned() ? t.pin_memory() : t;
  };
  Batch out = *this;
  out.input_ids = pin(input_ids);
  out.labels = pin(labels);
  out.attention_mask = pin(attention_mask);
  out.token_type_ids = pin(token_type_ids);
  return out;
}

Batch Batch::to(c10::Device device, bool non_blocking) const {
  auto move = [&](const at::Tensor& t) {
    return t.defined() ? t.to(device, /*non_blocking=*/non_blocking) : t;
  };
  Batch out;
  out.input_ids = move(input_ids);
  out.labels = move(labels);
  out.attention_mask = move(attention_mask);
  out.token_type_ids = move(token_type_ids);
  out.sample_indices = sample_indices;
  out.host_stats = host_stats;
  return out;
}

}  // namespace loom
