// `loom estimate`: Note [Memory estimate] in loom/estimate.h.
#include "loom/estimate.h"

#include <ATen/DeviceAccelerator.h>
#include <ATen/core/Tensor.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>

#include "device.h"
#include "dist_env.h"
#include "job.h"
#include "loom/engine.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/memory.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/trainer.h"
#include "estimate_rows.h"
#include "plugin_host.h"
#include "resolve.h"

namespace loom::estimate {

const char* to_string(Precision p) {
  switch (p) {
    case Precision::fp32: return "fp32";
    case Precision::bf16: return "bf16";
    case Precision::full_bf16: return "full_bf16";
  }
  return "?";
}
const char* to_string(Offload o) {
  switch (o) {
    case Offload::none: return "none";
    case Offload::cpu: return "cpu";
    case Offload::nvme: return "nvme";
    case Offload::cpu_params: return "cpu+p";
    case Offload::nvme_params: return "nvme+p";
  }
  return "?";
}

namespace {

// A folder under the system's temporary directory, removed with this object.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "loom-estimate-XXXXXX").string();
    LOOM_CHECK(mkdtemp(pattern.data()) != nullptr, "cannot create a temporary folder under ",
               std::filesystem::temp_directory_path().string(), "; set TMPDIR to a writable one");
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

const ConfigValue* key_of(const Job& job, std::string_view table, std::string_view key) {
  const ConfigValue* t = job.table(table);
  return t && t->is_table() ? t->find(key) : nullptr;
}

// What one probe run saw: the model's counts and the peak of device memory above what was
// live before it.
struct ProbeResult {
  ModelCounts counts;
  // Absolute peaks of device memory: building the model, forward + backward, the update.
  double setup_peak = 0, backward_peak = 0, update_peak = 0;
  c10::Device device = c10::Device(c10::kCPU);
  // The units of the model's UnitLists, and whether they all hold as many elements (Note
  // [Proxy probes]).
  int64_t units = 0;
  bool uniform_units = true;
  double params_per_unit = 0;  // every parameter of the first unit
  // Each unit's trainable tensors' elements (what a sharding plugin may cut with the units).
  std::vector<std::vector<double>> unit_tensors;
};

// The lower of the two probe batches (Note [Probe batches]).
int64_t lower_probe_batch(int64_t job_batch) { return job_batch >= 3 ? 2 : 1; }

// `run` false: the model set up and counted, no step run.
ProbeResult probe(const Job& job, std::vector<std::string> overrides, int64_t batch,
                  const std::vector<std::string>& layout, const std::filesystem::path& out,
                  bool run = true) {
  overrides.insert(overrides.begin(), job.overrides.begin(), job.overrides.end());
  // One process of its own, whatever launched this one (Note [Solo probes]); and no auto batch
  // inside a probe.
  const SoloScope solo;
  overrides.push_back("distributed.backend=\"local\"");
  overrides.push_back("train.auto_find_batch_size=false");
  overrides.push_back("train.per_device_train_batch_size=" + std::to_string(batch));
  overrides.push_back("train.gradient_accumulation_steps=1");
  overrides.push_back("train.max_steps=2");
  overrides.push_back("train.output_dir=" + quoted(out.string()));
  overrides.push_back("train.resume=\"\"");
  overrides.push_back("train.save_steps=0");
  overrides.push_back("train.save_final=false");
  overrides.push_back("train.progress_bar=false");
  overrides.push_back("train.log_level=\"error\"");
  // The normal step: what optimizer_in_backward frees is declared (MemoryContext), not
  // measured, so every row's model states are what the probes' peaks are taken above.
  overrides.push_back("train.optimizer_in_backward=false");
  // Probes measure the unsharded, in-memory layout; sharding and offload are what the plugins
  // declare (Note [Memory declarations]).
  overrides.insert(overrides.end(), layout.begin(), layout.end());
  std::filesystem::remove_all(out);
  auto trainer = make_trainer(Job::parse(job.text, job.file, overrides));
  trainer->setup();
  Engine& engine = trainer->engine();
  ProbeResult r;
  r.device = engine.device();
  const memory::ModelState state = engine.model_state();
  r.counts.params = static_cast<double>(state.param_count);
  r.counts.trainable = static_cast<double>(state.trainable_count);
  r.counts.optimizer_per_trainable =
      state.trainable_count ? static_cast<double>(state.optimizer_bytes) /
                                  static_cast<double>(state.trainable_count)
                            : 0.0;
  // Frozen Linear weights: held in half under autocast where the precision declares so.
  for (const auto& t : nn::frozen_linear_tensors(engine.model()))
    r.counts.frozen_linear_params += static_cast<double>(t.numel());
  for (const auto& p : engine.params())
    r.counts.largest_tensor_params =
        std::max(r.counts.largest_tensor_params, static_cast<double>(p.tensor.numel()));
  double first_unit = -1;
  for (nn::UnitList* list : engine.unit_lists())
    for (const auto& unit : list->children()) {
      double all = 0;
      for (const auto& p : unit->parameters(/*recurse=*/true)) all += static_cast<double>(p.numel());
      if (first_unit < 0) first_unit = r.params_per_unit = all;
      r.uniform_units = r.uniform_units && all == first_unit;
      ++r.units;
      std::vector<double>& tensors = r.unit_tensors.emplace_back();
      for (const auto& p : unit->parameters(/*recurse=*/true))
        if (p.requires_grad()) tensors.push_back(static_cast<double>(p.numel()));
    }
  r.setup_peak = static_cast<double>(memory::device_stats(r.device).peak_bytes);
  if (!run) return r;
  // Each phase's own peak: building the model may peak higher than the step (a half-precision
  // model is built in fp32 first), and the update's peak does not grow with the batch.
  const c10::Device device = r.device;
  auto peak = [device] { return static_cast<double>(memory::device_stats(device).peak_bytes); };
  engine.on(Event::before_forward, [device](Engine&) { memory::reset_device_peak(device); });
  engine.on(Event::after_backward, [&](Engine&) { r.backward_peak = peak(); });
  engine.on(Event::before_update, [device](Engine&) { memory::reset_device_peak(device); });
  engine.on(Event::after_update, [&](Engine&) { r.update_peak = peak(); });
  // Two steps: from the second on, gradients and the update rule's state already exist when
  // forward starts (the steady state); the handlers keep the second step's peaks.
  trainer->step();
  trainer->step();
  return r;
}

}  // namespace

namespace {
Report estimate_loaded(const Job& job, const Options& options);
}  // namespace

Report estimate_job(const std::filesystem::path& job_path,
                    const std::vector<std::string>& overrides, const Options& options) {
  // A bad job fails here, as loom check would.
  return estimate_loaded(Job::load(job_path, overrides), options);
}

namespace {

Report estimate_loaded(const Job& job, const Options& options) {
  LOOM_CHECK_AS(ConfigError, options.world_size >= 1,
                "--world-size must be >= 1, got ", options.world_size);
  Report report;
  report.job = job.file.string();
  report.options = options;
  int64_t job_batch = 8, accumulation = 1;
  if (const ConfigValue* v = key_of(job, "train", "per_device_train_batch_size"))
    if (auto* n = std::get_if<int64_t>(&v->value)) job_batch = *n;
  if (const ConfigValue* v = key_of(job, "train", "gradient_accumulation_steps"))
    if (auto* n = std::get_if<int64_t>(&v->value)) accumulation = *n;
  report.batch = options.batch > 0 ? options.batch : job_batch;
  report.effective_batch = job_batch * accumulation;
  if (const ConfigValue* v = key_of(job, "train", "model"))
    if (auto* s = std::get_if<std::string>(&v->value)) report.model_name = *s;
  bool in_backward = false;  // the probes run without it: the declarations say what it frees
  bool bf16_masters = false;  // the full_bf16 probe runs with it; the other precisions cannot
  if (const ConfigValue* v = key_of(job, "optimizer", "master_dtype"))
    if (auto* s = std::get_if<std::string>(&v->value)) bf16_masters = *s == "bf16";
  if (const ConfigValue* v = key_of(job, "train", "optimizer_in_backward"))
    if (auto* b = std::get_if<bool>(&v->value)) in_backward = *b;
  // Note [GPU jobs estimated on a CPU]: a job written for a GPU is planned on a machine without
  // one (a laptop, a login node), where its probes cannot run on CUDA. They run on the CPU
  // instead, and the rows are split as the GPU run's: device memory apart from host RAM, which
  // is what the job's offload settings decide. Model states, buffers and what moves to the host
  // are arithmetic and hold as they are; the activations and the fixed part are the CPU's
  // kernels', which the note under the table says. auto_find_batch_size sizes the batch of a
  // run on this machine: it refuses a GPU job here before any probe runs.
  std::string gpu_device;
  if (const ConfigValue* v = key_of(job, "train", "device"))
    if (auto* s = std::get_if<std::string>(&v->value))
      if (s->rfind("cuda", 0) == 0 && cuda_device_count() == 0) gpu_device = *s;

  // The model plugin's key for its unit count (Note [Proxy probes]), from the job resolved as
  // `loom check` resolves it: a bad job fails here.
  PluginHost host;
  const ResolvedJob resolved = resolve(job, host);
  const std::string unit_key = resolved.model.provider->plugin->unit_count_key(resolved.model.name);
  // The job's own tables say which row is the job's (see Note [Memory declarations]; the
  // labels do not depend on the model's counts).
  const Declarers all = declarers(host, &resolved, job.file.string());
  {
    const Choice own(all.size(), -1);
    memory::MemoryContext labels_only;  // no counts yet: the labels and notes need the ranks
    labels_only.world_size = options.world_size;
    const memory::MemoryTerms mine = declare(all, own, labels_only, 0);
    report.job_stage = stage_label(mine);
    const std::string offload = label(mine, "offload", "none");
    for (Offload o : kOffloads)
      if (offload == to_string(o)) report.job_offload = o;
    report.job_precision = kPrecisions[precision_index(mine)];
    // offload_param alone (the optimizer state in memory) has no row of its own: the cpu+p and
    // nvme+p rows count the state where the shards go, and the note under the table says so.
    report.job_offload_params_only = label(mine, "optimizer_state", "") == "memory";
    report.notes = mine.notes;
    report.table_notes = mine.table_notes;
  }
  // What the probes run: every axis the job has but the precision at its first variant (zero:
  // stage 0, in memory: the unsharded layout, whose sharding and offload are declared), and
  // each precision's variant in turn.
  std::vector<std::string> layout;
  auto set_lines = [](const Declarer& d, const memory::MemoryVariant& v) {
    std::vector<std::string> lines;
    for (const auto& [key, value] : v.overrides)
      lines.push_back(d.plugin->plugin->name() + "." + key + "=" + value.to_text());
    return lines;
  };
  for (const Declarer& d : all)
    if (d.in_job && !d.variants.empty() && !d.variants.front().labels.count("precision")) {
      const auto lines = set_lines(d, d.variants.front());
      layout.insert(layout.end(), lines.begin(), lines.end());
    }
  if (!gpu_device.empty()) layout.push_back("train.device=\"cpu\"");
  ScratchDir scratch;
  memory::install_cpu_tracker();
  std::optional<c10::Device> device;  // known after the first probe
  bool counted = false;
  // Progress on stderr (the table goes to stdout), from rank 0 alone when every rank probes
  // (auto_find_batch_size): each probe builds the model and runs it, seconds to minutes apiece.
  const bool speak = detect_dist_env().rank == 0;
  int done = 0, planned = 1;
  // One probe, its peaks made relative to what was live before it.
  auto run_probe = [&](const std::string& what, const std::vector<std::string>& with,
                       int64_t b, bool run) {
    const c10::Device on = device.value_or(c10::Device(c10::kCPU));
    const auto before = memory::device_stats(on).current_bytes;
    memory::reset_cpu_peak();  // the setup's peak: on the CPU until the device is known
    memory::reset_device_peak(on);
    if (speak) {
      std::fprintf(stderr, "loom estimate: probe %d of %d: %s, batch %lld...\n", done + 1,
                   std::max(planned, done + 1), what.c_str(), static_cast<long long>(b));
      std::fflush(stderr);
    }
    const auto start = std::chrono::steady_clock::now();
    ProbeResult r = probe(job, with, b, layout, scratch.path() / "run", run);
    ++done;
    if (speak)
      std::fprintf(stderr, "loom estimate: probe %d of %d done in %.1f s\n", done,
                   std::max(planned, done),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (r.device == on)
      for (double* p : {&r.setup_peak, &r.backward_peak, &r.update_peak})
        *p -= static_cast<double>(before);
    device = r.device;
    report.device = r.device.is_cpu() ? "cpu" : r.device.str();
    return r;
  };
  auto precision_of = [&](int pass) {
    return options.job_precision_only ? static_cast<int>(report.job_precision) : pass;
  };
  auto overrides_for = [&](Precision precision) {
    std::vector<std::string> with;
    if (options.job_precision_only) return with;
    for (const Declarer& d : all)
      for (const auto& v : d.variants)
        if (const auto at = v.labels.find("precision");
            at != v.labels.end() && at->second == to_string(precision))
          with = set_lines(d, v);
    // Note [bf16 weights as their own masters]: a job without masters is full_bf16; its
    // probes of the other precisions keep the default, which they need.
    if (bf16_masters && precision != Precision::full_bf16)
      with.push_back("optimizer.master_dtype=\"fp32\"");
    return with;
  };

  // Note [Probe batches]: the probes run two batches a sample apart and the activations are
  // the line through their peaks. At batch 1 a fixed transient can set the peak instead of the
  // activations (on a CPU without bf16 instructions full_bf16's peak rose 0.14 MiB from batch
  // 1 to 2 and 0.70 MiB per sample beyond, so the line from batch 1 fell 13 % short at batch
  // 12): where the job's batch is 3 or more the probes take batches 2 and 3, never above the
  // job's own batch, else 1 and 2.
  const int64_t low = lower_probe_batch(report.batch);
  double per_unit = 0;
  std::vector<std::vector<double>> unit_tensors;  // the whole model's (ProbeResult)
  // The model states of a probe's model in one precision on one rank, as the job's plugins
  // declare them: what the probes' peaks are measured above. The probes' stage-0 step releases
  // its gradients between steps (Note [Gradients released, not zeroed]), so forward and
  // backward are measured above the states without them (the activations then count the
  // gradients backward has made by the peak), the update above all of them.
  struct ProbeStates {
    double forward_backward = 0, update = 0;
  };
  auto model_states = [&](const ModelCounts& counts,
                          const std::vector<std::vector<double>>& units, Precision precision) {
    const Choice choice = choice_for(
        all, {{"stage", "0"}, {"offload", "none"}, {"precision", to_string(precision)}});
    ModelCounts probed = counts;
    probed.optimizer_in_backward = false;  // the probes' step (see probe())
    probed.bf16_masters = bf16_masters;
    const memory::MemoryTerms terms = declare(
        all, choice, context_with_units(probed, units, 1, true, options.buffer_count), 0);
    const double released = terms.grads_released ? terms.grads : 0.0;
    return ProbeStates{terms.model_states() - released, terms.model_states()};
  };
  // The whole model set up once (no step): its counts, its units, its setup peak in the first
  // precision probed. Without probes that is all.
  const int passes = options.probe && !options.job_precision_only ? 3 : 1;
  {
    const Precision first = kPrecisions[precision_of(0)];
    const ProbeResult whole = run_probe(std::string("the whole model set up, ") + to_string(first),
                                        overrides_for(first), 1, false);
    report.model = whole.counts;
    report.model.optimizer_in_backward = in_backward;
    report.model.bf16_masters = bf16_masters;
    unit_tensors = whole.unit_tensors;
    counted = true;
    report.activations[precision_of(0)].setup_peak = whole.setup_peak;
    report.units = whole.units;
    report.uniform_units = whole.uniform_units;
    per_unit = whole.params_per_unit;
  }
  // Note [Proxy probes]: a model whose plugin names the key of its unit count and whose units
  // (more than 3) hold as many elements each is probed as proxies of 1, 2 and 3 units; what the
  // probes measure grows by one unit's activations (and its share of the half copies and of the
  // update's temporaries) per unit, so the whole model is a point on the line through them.
  // The proxies are trusted only where their peaks lie on that line and rise with each unit
  // (checked at both batches): a peak that a fixed spike sets (the loss's workspace over a large
  // vocabulary) is flat over a few units and left behind by the whole model's stack, and such
  // a precision, like units of different sizes (MoE every k-th layer) or a proxy that cannot be
  // built (a checkpointing list naming later units, a pretrained folder), takes the whole
  // model's probes (`--no-proxy` asks for them everywhere).
  // They pay where they cost less: per precision six passes of what lies outside the units
  // (embeddings, the head over the vocabulary) and twelve unit passes, against two and twice
  // the unit count, each taken as proportional to its parameters.
  const double outside = report.model.params - static_cast<double>(report.units) * per_unit;
  const bool cheaper =
      4 * outside < (2 * static_cast<double>(report.units) - 12) * per_unit;
  bool proxies = options.probe && options.proxy && !unit_key.empty() && report.units > 3 &&
                 report.uniform_units && cheaper;
  auto plan = [&] { planned = 1 + passes * (proxies ? 7 : 2) - (proxies ? 1 : 0); };
  if (options.probe) plan();
  for (int pass = 0; pass < passes && options.probe; ++pass) {
    // auto_find_batch_size probes the job's own precision only (mode "auto" included: the
    // probe chooses as the run will), kept in its precision's slot.
    const int i = precision_of(pass);
    const Precision precision = kPrecisions[i];
    Activations& a = report.activations[i];
    const std::vector<std::string> with = overrides_for(precision);
    const std::string name = to_string(precision);
    try {
      if (proxies) {
        bool built = false;  // a proxy ran (if none could be built, no precision's will)
        try {
          if (pass > 0)  // the setup peak of the whole model in this precision
            a.setup_peak = run_probe("the whole model set up, " + name, with, 1, false).setup_peak;
          // above[u][b]: the peaks above the proxy's own model states, units u + 1, batch b + 1.
          double above[3][2], update[3] = {0, 0, 0};
          // The lower batch first, and out as soon as a second unit adds nothing (a flat peak:
          // below).
          for (int64_t b = low; b <= low + 1; ++b)
            for (int u = 1; u <= 3; ++u) {
              std::vector<std::string> proxy = with;
              proxy.push_back("model." + unit_key + "=" + std::to_string(u));
              const ProbeResult r = run_probe(
                  "two steps of a " + std::to_string(u) + "-unit proxy, " + name, proxy, b, true);
              LOOM_CHECK(r.units == u, "the proxy has ", r.units, " units, not ", u);
              built = true;
              const ProbeStates states = model_states(r.counts, r.unit_tensors, precision);
              above[u - 1][b - low] = r.backward_peak - states.forward_backward;
              update[u - 1] = std::max(update[u - 1], r.update_peak - states.update);
              if (u == 2)
                LOOM_CHECK(above[1][b - low] > above[0][b - low], "a second unit adds nothing "
                           "to the peak at batch ", b, " (", above[0][b - low] / 1048576,
                           " MiB above the model states): a fixed spike sets it");
            }
          // Each unit must add to the peak, and the same each time: a peak that some fixed
          // spike sets (GPT-2's fp32 loss workspace at a 50k vocabulary, above a few units'
          // activations) is flat here and would be left behind by the whole model's stack.
          for (int b = 0; b < 2; ++b) {
            const double one = above[1][b] - above[0][b], two = above[2][b] - above[1][b];
            LOOM_CHECK(one > 0 && two > 0 && std::abs(two - one) <= 0.1 * std::max(one, two),
                       "their peaks at batch ", b + low, " are not on a line (",
                       above[0][b] / 1048576, ", ", above[1][b] / 1048576, ", ",
                       above[2][b] / 1048576, " MiB above the model states)");
          }
          const double extra = static_cast<double>(report.units - 1);
          auto whole = [&](const double at[3]) { return at[0] + extra * (at[2] - at[0]) / 2; };
          const double first[3] = {above[0][0], above[1][0], above[2][0]};
          const double second[3] = {above[0][1], above[1][1], above[2][1]};
          const double peak1 = whole(first), peak2 = whole(second);
          a.per_sample = std::max(0.0, peak2 - peak1);
          a.fixed = std::max(0.0, peak1 - static_cast<double>(low) * a.per_sample);
          a.update = std::max(0.0, whole(update));
          a.measured = true;
          a.proxied = true;
          continue;
        } catch (const std::exception& error) {
          if (speak)
            std::fprintf(stderr, "loom estimate: proxies of 1, 2 and 3 units do not stand for "
                         "the model in %s: %s; probing the whole model\n", name.c_str(),
                         error.what());
          planned += 2;  // this precision's whole-model probes
          if (!built) {
            proxies = false;
            plan();
          }
        }
      }
      double peaks[2] = {0, 0}, update_peaks[2] = {0, 0};
      for (int64_t b = low; b <= low + 1; ++b) {
        const ProbeResult r = run_probe("two steps of the whole model, " + name, with, b, true);
        a.setup_peak = std::max(a.setup_peak, r.setup_peak);
        update_peaks[b - low] = r.update_peak;
        peaks[b - low] = r.backward_peak;
      }
      const ProbeStates states = model_states(report.model, unit_tensors, precision);
      a.measured = true;
      a.per_sample = std::max(0.0, peaks[1] - peaks[0]);
      a.fixed = std::max(0.0, peaks[0] - static_cast<double>(low) * a.per_sample -
                                  states.forward_backward);
      a.update = std::max(0.0, std::max(update_peaks[0], update_peaks[1]) - states.update);
    } catch (const ConfigError&) {
      throw;  // the job itself is wrong: say so, as loom check would
    } catch (const std::exception& error) {
      if (speak)
        std::fprintf(stderr, "loom estimate: %s not measured: %s\n", name.c_str(), error.what());
      a.note = error.what();
      if (options.job_precision_only) throw;
    }
  }
  LOOM_CHECK(counted, "no probe of '", job.file.string(), "' ran");
  if (!gpu_device.empty()) {  // Note [GPU jobs estimated on a CPU]
    report.device = gpu_device;
    report.gpu_probed_on_cpu = true;
    report.table_notes.push_back(
        "[train] device = \"" + gpu_device + "\", but this machine has no CUDA device: the "
        "probes ran the job on the CPU and the rows are split as the GPU run's (device, host "
        "RAM, NVMe); the activations and the fixed part are the CPU kernels', so estimate on the "
        "GPU machine for its own");
  }
  // Every combination of the axes' variants over the job's tables, each the sum of what the
  // job's plugins (and the axes') declare (see Note [Memory declarations]).
  const bool cpu = report.device == "cpu";
  const memory::MemoryContext context = context_with_units(
      report.model, unit_tensors, options.world_size, cpu, options.buffer_count);
  report.model.frozen_linear_params = 0;  // now: what the declarations hold in half
  const std::vector<Combination> table = combinations(all, context, report.activations);
  report.legends = legends(all, table);
  for (const Combination& c : table) {
    const Row r = finish(c.terms, report.activations[precision_index(c.terms)], report.batch, cpu);
    if (r.stage == report.job_stage && r.offload == report.job_offload &&
        r.precision == report.job_precision) {
      report.job_terms = c.terms;
      report.has_job_terms = true;
    }
    // What the declarations counted, for the report's counts (and row() of them).
    report.model.unit_params = std::max(report.model.unit_params, c.terms.unit_params);
    report.model.largest_unit_params =
        std::max(report.model.largest_unit_params, c.terms.largest_unit_params);
    report.model.frozen_linear_params =
        std::max(report.model.frozen_linear_params, c.terms.half_frozen_params);
    report.rows.push_back(r);
  }
  return report;
}

}  // namespace

Report estimate_params(double params, const Options& options) {
  LOOM_CHECK_AS(ConfigError, params >= 1 && std::isfinite(params),
                "--params must be a positive parameter count (e.g. 1e12), got ", params);
  LOOM_CHECK_AS(ConfigError, options.world_size >= 1,
                "--world-size must be >= 1, got ", options.world_size);
  Report report;
  report.options = options;
  report.device = "accelerator";
  report.model.params = report.model.trainable = params;
  report.model.unit_params = params;  // all of it in layers; their size is not known
  report.model.optimizer_per_trainable = 8;
  report.model_name = "(a parameter count)";
  const Declarers all = standalone_for(report.model);
  const std::vector<Combination> table = combinations(
      all, context_of(report.model, options.world_size, false, options.buffer_count),
      report.activations);
  report.legends = legends(all, table);
  for (const Combination& c : table)
    report.rows.push_back(finish(c.terms, {}, 0, false));
  return report;
}

Row job_row(const Report& r, int64_t batch) {
  const Activations& a = r.activations[static_cast<int>(r.job_precision)];
  if (r.has_job_terms) return finish(r.job_terms, a, batch, r.device == "cpu");
  return row(r.model, r.job_stage, r.job_offload, r.job_precision, r.options.world_size, a, batch,
             r.device == "cpu", r.options.buffer_count);
}

int64_t largest_batch(const Report& r, double budget_bytes) {
  const Activations& a = r.activations[static_cast<int>(r.job_precision)];
  if (!a.measured || a.per_sample <= 0) return 0;
  const Row base = job_row(r, 0);
  // The setup and the update (every gradient held, and the rule's temporaries) must fit at any
  // batch: base.peak is the largest of them at batch 0.
  if (base.peak > budget_bytes) return 0;
  const double room = budget_bytes - base.device;
  if (room < a.per_sample) return 0;
  return static_cast<int64_t>(std::floor(room / a.per_sample));
}

BatchPlan plan_batch(int64_t effective, int64_t fits) {
  if (fits < 1 || effective < 1) return {};
  const int64_t most = std::min(fits, effective);
  for (int64_t b = most / 8 * 8; b >= 8; b -= 8)
    if (effective % b == 0) return {b, effective / b};
  for (int64_t b = most; b >= 1; --b)
    if (effective % b == 0) return {b, effective / b};
  return {};
}

double parse_size(const std::string& what, const std::string& text) {
  static const std::pair<const char*, double> units[] = {
      {"TiB", 1099511627776.0}, {"GiB", 1073741824.0}, {"MiB", 1048576.0}, {"KiB", 1024.0},
      {"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}, {"B", 1.0}};
  std::string number = text;
  double scale = 1.0;
  for (const auto& [suffix, factor] : units) {
    const std::string s(suffix);
    if (text.size() > s.size() && text.compare(text.size() - s.size(), s.size(), s) == 0) {
      number = text.substr(0, text.size() - s.size());
      scale = factor;
      break;
    }
  }
  double value = 0;
  try {
    size_t used = 0;
    value = std::stod(number, &used);
    if (used != number.size()) value = 0;
  } catch (const std::exception&) {
  }
  LOOM_CHECK_AS(ConfigError, value > 0 && std::isfinite(value), what,
                " takes a positive size such as 20GiB, got '", text, "'");
  return value * scale;
}

std::string format(const Report& r) {
  std::ostringstream out;
  // One unit for the whole table: GiB, or MiB for a model whose every row is below 1 GiB.
  double largest = 0;
  for (const Row& row : r.rows) largest = std::max({largest, row.peak, row.host, row.nvme});
  const bool in_mib = largest < double(int64_t{1} << 30);
  const char* unit = in_mib ? "MiB" : "GiB";
  auto gib = [in_mib](double bytes) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%.2f", bytes / double(int64_t{1} << (in_mib ? 20 : 30)));
    return std::string(buffer);
  };
  auto millions = [](double n) {
    char buffer[32];
    if (n >= 1e9)
      std::snprintf(buffer, sizeof buffer, "%.2f B", n / 1e9);
    else
      std::snprintf(buffer, sizeof buffer, "%.2f M", n / 1e6);
    return std::string(buffer);
  };
  const bool cpu = r.device == "cpu";
  out << "loom estimate: " << (r.job.empty() ? "" : r.job + ", ") << r.model_name << ", "
      << millions(r.model.params) << " parameters (" << millions(r.model.trainable)
      << " trainable), " << r.model.rule << " state ";
  char per[32];
  std::snprintf(per, sizeof per, "%.3g", r.model.optimizer_per_trainable);
  out << per << " B per trainable parameter; " << r.options.world_size << " rank(s)";
  for (const std::string& note : r.notes) out << " (" << note << ")";
  out << ", device " << r.device;
  if (!r.job.empty()) out << ", per-device batch " << r.batch;
  out << "\n";
  if (r.job.empty()) {
    out << "model states only (no activations): AdamW as DeepSpeed's estimators assume; "
           "fp32/bf16 hold 4+4 B of weights and grads, full_bf16 2+2 B and 4 B of fp32 masters; "
           "bf16 autocast adds 2 B per parameter of half copies that live from forward to "
           "backward, at every stage\n";
  } else {
    const int64_t low = lower_probe_batch(r.batch);
    out << "activations (two steps at batch " << low << " and " << low + 1
        << " on one rank; the second step's peaks above the model states):\n";
    for (Precision p : kPrecisions) {
      const Activations& a = r.activations[static_cast<int>(p)];
      out << "  " << to_string(p) << ": ";
      if (a.measured)
        out << gib(a.per_sample) << " " << unit << " per sample + " << gib(a.fixed) << " "
            << unit << " fixed in forward and backward; the update adds " << gib(a.update) << " "
            << unit << "; building the model peaks at " << gib(a.setup_peak) << " " << unit
            << (a.proxied ? " (on proxies of 1, 2 and 3 units, scaled to " +
                                std::to_string(r.units) + ")"
                          : std::string())
            << "\n";
      else
        out << (a.note.empty() ? "not probed (--no-probe)" : "probe failed: " + a.note) << "\n";
    }
  }
  out << unit << " per rank. Columns: weights, grads, fp32 masters, optimizer state, "
      << "activations, other (workspace, data, autocast copies); then the peak on the device (the "
      << "larger of the step and building the model), host RAM besides, NVMe\n";
  char line[256];
  std::snprintf(line, sizeof line, "%-5s %-7s %-9s %9s %9s %9s %9s %9s %9s | %10s %10s %10s\n",
                "stage", "offload", "precision", "weights", "grads", "masters", "optim",
                "activ.", "other", cpu ? "RAM" : "device", cpu ? "" : "host RAM", "NVMe");
  out << line;
  for (const Row& row : r.rows) {
    const bool mine = !r.job.empty() && row.stage == r.job_stage && row.offload == r.job_offload &&
                      row.precision == r.job_precision;
    std::snprintf(line, sizeof line,
                  "%-5d %-7s %-9s %9s %9s %9s %9s %9s %9s | %10s %10s %10s%s%s\n", row.stage,
                  to_string(row.offload), to_string(row.precision), gib(row.weights).c_str(),
                  gib(row.grads).c_str(), gib(row.masters).c_str(), gib(row.optimizer).c_str(),
                  gib(row.activations).c_str(), gib(row.buffers).c_str(), gib(row.peak).c_str(),
                  cpu ? "" : gib(row.host).c_str(), gib(row.nvme).c_str(),
                  row.buildable ? "" : "  (not in loom yet)", mine ? "  <- this job" : "");
    out << line;
  }
  for (const std::string& legend : r.legends) out << legend << "\n";
  for (const std::string& note : r.table_notes) out << note << "\n";
  if (r.options.budget_bytes > 0 && !r.job.empty()) {
    const int64_t fits = largest_batch(r, r.options.budget_bytes);
    const BatchPlan plan = plan_batch(r.effective_batch, fits);
    out << "budget " << memory::format_bytes(static_cast<int64_t>(r.options.budget_bytes)) << ": ";
    if (plan.batch == 0) {
      out << "not even batch 1 of this job's configuration fits\n";
    } else {
      out << "per_device_train_batch_size = " << plan.batch << ", gradient_accumulation_steps = "
          << plan.accumulation << " (the job's " << r.effective_batch
          << " samples per step and rank; up to " << fits << " fit per micro-batch)\n";
    }
  }
  return out.str();
}

}  // namespace loom::estimate

namespace loom {
namespace {

// Bytes of RAM this process may use: MemTotal, or the cgroup's limit where it is lower.
double ram_limit() {
  double total = 0;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemTotal:") {
      total = kib * 1024.0;
      break;
    }
    meminfo.ignore(256, '\n');
  }
  for (const char* file : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(file);
    double limit = 0;
    if (in >> limit && limit > 0 && (total == 0 || limit < total)) total = limit;
  }
  return total;
}

}  // namespace

// Note [Auto batch size]: HF's auto_find_batch_size halves the batch after each out-of-memory
// error; on a CPU an out-of-memory is the kernel's OOM killer, not an exception, so loom measures
// instead. The job runs twice as `loom estimate` probes it (two batches, two steps each, one
// process, zero stage 0 in memory: nothing written beside a temporary folder), in its own
// precision; the estimate for its stage, offload and world size then gives the largest batch
// within the budget, and plan_batch keeps its samples per step exact. The budget is per rank:
// "auto" is 90 % of the GPU's memory, or on the CPU 90 % of RAM (or of the cgroup's limit)
// shared by the ranks of the node. Every rank decides alone, from the same measurements and the
// same budget, so ranks on like machines agree; the engine checks that they do.
Job with_auto_batch(Job job) {
  const ConfigValue* on = estimate::key_of(job, "train", "auto_find_batch_size");
  const bool* enabled = on ? std::get_if<bool>(&on->value) : nullptr;
  if (!enabled || !*enabled) return job;  // a non-bool is the schema's error, later
  const DistEnv env = detect_dist_env();
  std::string backend = "auto";
  if (const ConfigValue* v = estimate::key_of(job, "distributed", "backend"))
    if (auto* s = std::get_if<std::string>(&v->value)) backend = *s;
  estimate::Options options;
  options.world_size = backend == "local" ? 1 : env.world_size;
  options.job_precision_only = true;
  std::string budget_text = "auto";
  const ConfigValue* budget_value = estimate::key_of(job, "train", "memory_budget");
  if (budget_value) {
    const auto* text = std::get_if<std::string>(&budget_value->value);
    LOOM_CHECK_AS(ConfigError, text, budget_value->where,
                  ": [train] memory_budget must be a size in quotes such as \"20GiB\", or \"auto\"");
    budget_text = *text;
  }
  const std::string where = budget_value ? budget_value->where : "[train] memory_budget";
  // Note [GPU jobs estimated on a CPU]: the probes could only stand in for a GPU this machine
  // lacks, and the batch is sized for a run here; refused before any probe runs.
  if (const ConfigValue* device = estimate::key_of(job, "train", "device"))
    if (const auto* name = std::get_if<std::string>(&device->value))
      LOOM_CHECK_AS(ConfigError, name->rfind("cuda", 0) != 0 || cuda_device_count() > 0,
                    device->where, ": auto_find_batch_size: [train] device = \"", *name,
                    "\", but this machine has no CUDA device; run the job on a GPU machine, "
                    "or set [train] device = \"cpu\" or \"auto\"");
  double budget = 0;
  if (budget_text != "auto") budget = estimate::parse_size(where + ": [train] memory_budget", budget_text);
  log::info("auto_find_batch_size: probing ", job.file.string(), " at two small batches");
  const log::Level level = log::level();  // the probes' runs set their own
  estimate::Report report;
  try {
    report = estimate::estimate_loaded(job, options);
  } catch (...) {
    log::set_level(level);
    throw;
  }
  log::set_level(level);
  if (budget_text == "auto") {
    if (report.device == "cpu") {
      const int sharing = backend == "local" ? 1 : std::max(1, env.local_world_size);
      budget = 0.9 * ram_limit() / sharing;
    } else {
      const c10::Device device(report.device);
      budget = 0.9 * static_cast<double>(
                         at::accelerator::getMemoryInfo(device.has_index() ? device.index() : 0).second);
    }
    LOOM_CHECK(budget > 0, "auto_find_batch_size: cannot tell how much memory ", report.device,
               " has; set [train] memory_budget");
  }
  const int64_t fits = estimate::largest_batch(report, budget);
  const estimate::BatchPlan plan = estimate::plan_batch(report.effective_batch, fits);
  const estimate::Row mine = estimate::job_row(report, 1);
  LOOM_CHECK_AS(ConfigError, plan.batch > 0, where, ": auto_find_batch_size: not even one sample "
                "per micro-batch fits the memory budget of ", memory::format_bytes(static_cast<int64_t>(budget)),
                " per rank (batch 1 needs about ", memory::format_bytes(static_cast<int64_t>(mine.peak)),
                "); raise memory_budget, or shard or offload more ([zero] stage, offload_optimizer)");
  log::info("auto_find_batch_size: per_device_train_batch_size = ", plan.batch,
            ", gradient_accumulation_steps = ", plan.accumulation, " (", report.effective_batch,
            " samples per step and rank; up to ", fits, " fit ",
            memory::format_bytes(static_cast<int64_t>(budget)), " per rank)");
  std::vector<std::string> overrides = job.overrides;
  overrides.push_back("train.per_device_train_batch_size=" + std::to_string(plan.batch));
  overrides.push_back("train.gradient_accumulation_steps=" + std::to_string(plan.accumulation));
  return Job::parse(job.text, job.file, overrides);
}

}  // namespace loom
