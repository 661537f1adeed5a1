// loom/plugin.h — the plugin contract and its C entry point.
// A plugin .so exports one extern "C" function, loom_plugin_entry(), returning a
// loom_plugin_info whose first field is the API version: the host reads that before anything
// else, then the build string (LibTorch version, C++ ABI, CUDA), and only then calls into C++.
// Loaded libraries are never unloaded (see Note [Plugins stay loaded] in plugin_host.cpp).
#pragma once

#include <torch/headeronly/version.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/config.h"
#include "loom/memory_declarations.h"
#include "loom/pretrained.h"
#include "loom/sdk_digest.h"

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

// Bumped whenever a type a plugin sees (Plugin, Engine, nn, UpdateRule, ...) changes. Note [SDK
// digest]: the build records a digest of the SDK headers (loom/sdk_digest.h, made from
// core/include/loom/*.h less comments and spacing) in every plugin's build string, so a plugin
// built against other headers is refused before it loads; and a test (tests/core/sdk_digest.sh)
// fails when the headers change while this number does not (core/sdk_digests.txt records
// the digest of each version).
#define LOOM_PLUGIN_API_VERSION 32u

#define LOOM_STR2(x) #x
#define LOOM_STR(x) LOOM_STR2(x)
#ifdef LOOM_WITH_CUDA
#define LOOM_BUILD_CUDA "cuda"
#else
#define LOOM_BUILD_CUDA "cpu"
#endif
// What must match between host and plugin (everything before "compiler=").
#define LOOM_BUILD_STRING                                                              \
  "torch=" LOOM_STR(TORCH_VERSION_MAJOR) "." LOOM_STR(TORCH_VERSION_MINOR) "." LOOM_STR( \
      TORCH_VERSION_PATCH) " cxx11abi=" LOOM_STR(_GLIBCXX_USE_CXX11_ABI) " device=" LOOM_BUILD_CUDA \
      " sdk=" LOOM_SDK_DIGEST " compiler=gcc-" __VERSION__

namespace loom {

class Engine;
class Model;
class Dataset;
class UpdateRule;
class StepDriver;
struct StepDriverOptions;

// A `loom NAME ARGS...` subcommand a plugin adds (estimators, exporters, converters): listed by
// `loom --help`, run by `loom NAME` with the arguments after NAME. `run` returns the exit
// code; the SDK's errors it throws are printed as one line and exit 1, as loom's own.
struct Command {
  std::string name;   // not one of loom's own (run, check, ...) nor another plugin's
  std::string usage;  // one line: "NAME ARGS   what it does"
  std::function<int(const std::vector<std::string>& args)> run;
};

// The exclusive slots: each is filled by at most one active plugin.
enum class Slot { model, data, precision, update_rule, grad_sync, step_driver };
const char* to_string(Slot slot);

class Plugin {
 public:
  virtual ~Plugin();
  // The plugin's name; also the job-file table that switches it on ([lora] -> "lora").
  virtual std::string name() const = 0;
  virtual std::string description() const = 0;
  // Slots this plugin fills when switched on by its own table ([precision] -> precision).
  virtual std::vector<Slot> slots() const { return {}; }
  // The tables it reads. Schema(name()) for its own table; for choices of a selector table,
  // Schema("model", "gpt"), Schema("data", "text"), Schema("optimizer", "adamw") — each makes
  // this plugin a provider of that choice for the slot model / data / update_rule.
  virtual std::vector<Schema> schemas() const { return {}; }
  // Note [Plugin order]: where this plugin's handlers (and unit interceptors) go among the other
  // active plugins'. Each entry names a plugin ("lora") or a role, the slot a plugin fills
  // ("precision", "grad_sync", "step_driver", "model", "data", "update_rule"). The host sorts the
  // active plugins so that every constraint holds (ties keep the job's order: the model, data
  // and update-rule providers, then the tables by name), attaches them in that order, and
  // every event's handlers run in it; a cycle is a PluginError naming every plugin in it. A name
  // that matches no active plugin constrains nothing; one that names no plugin loom can find is
  // a warning (a typo, or a plugin that is not installed).
  struct Order {
    std::vector<std::string> after;   // run after these
    std::vector<std::string> before;  // run before these
  };
  virtual Order order() const { return {}; }
  // Whether this table plugin's table matters to the model alone (`loom generate`, which
  // rebuilds the model from a checkpoint's job): true for plugins that change the model's
  // structure or the meaning of its weights (LoRA adapters, MoE layers); false (the default) for
  // techniques of training only (optimizers, precision, sharding, EMA), whose tables are dropped
  // before the model is rebuilt for inference.
  virtual bool shapes_model() const { return false; }
  // `loom` subcommands this plugin adds (no job is involved: they run without a table).
  virtual std::vector<Command> commands() const { return {}; }
  // Switched on by its own table: receives that validated table (then validate(), below).
  virtual void configure(const ConfigSection& table);
  // Once everything is configured: register event handlers and unit interceptors.
  virtual void attach(Engine& engine);

  // The job as validate() sees it: any resolved table by name (`job("data")`, nullptr when the
  // job has none) and the job's paths made absolute (relative to the job file's folder).
  // update_rule: the job's rule, built from [optimizer] once the providers are validated, so a
  // table plugin can refuse what the rule needs (ZeRO: whole-tensor statistics, reduction_rounds,
  // with [train] optimizer_in_backward); nullptr in the providers' own validate().
  struct JobTables {
    std::function<const ConfigSection*(const std::string& table)> table;
    std::function<std::string(const std::string& path)> resolve_path;
    const UpdateRule* update_rule = nullptr;
    const ConfigSection* operator()(const std::string& name) const { return table(name); }
  };
  // Note [One resolved job]: before anything is built, `loom check` and `loom run` alike, every
  // active plugin's table is checked against itself and the rest of the job: a provider's with
  // the chosen `name` (heads dividing the width, the data's sequences fitting the positions, the
  // data's files readable), a table plugin's with its own name, after configure() (cross-table
  // rules: ZeRO's offload_param needs [precision]'s half weights). Throw ConfigError naming the
  // key and what to change. Whatever can be refused here must be: `loom check` says "ok" only
  // for jobs `loom run` builds. Default: nothing more to check.
  virtual void validate(const std::string& name, const ConfigSection& table,
                        const JobTables& job) const;

  // Model providers, for `loom estimate` (Note [Proxy probes]): the key of the model's table
  // that sets how many units its UnitList holds (gpt: "n_layer"), so the estimate can probe
  // models of 1, 2 and 3 units and scale; empty (the default): the whole model is probed.
  virtual std::string unit_count_key(const std::string& name) const;
  // Providers: called with the chosen name and its validated selector table.
  virtual std::shared_ptr<Model> create_model(const std::string& name,
                                              const ConfigSection& table, Engine& engine);
  virtual std::shared_ptr<const Dataset> create_dataset(const std::string& name,
                                                        const ConfigSection& table,
                                                        Engine& engine);
  virtual std::unique_ptr<UpdateRule> create_update_rule(const std::string& name,
                                                         const ConfigSection& table);
  // Model providers, for `loom export`: the model of the validated table `table` with trained
  // `weights` (loom's names, floating ones fp32) as a transformers save_pretrained folder's
  // config.json and tensors. resolve_path makes a path of the job absolute (the job's folder).
  // std::nullopt: this model has no transformers equivalent (the default).
  virtual std::optional<pretrained::Export> export_pretrained(
      const std::string& name, const ConfigSection& table, const NamedTensors& weights,
      const std::function<std::string(const std::string&)>& resolve_path) const;
  // Table plugins that change a model's structure, for `loom export --merge` (Note [Merged
  // export]): fold what the plugin added into the base model's tensors, in place in `weights`
  // (loom's names, floating ones fp32, as the checkpoint holds them; `table` the plugin's
  // validated table; resolve_path as for export_pretrained), and drop the added tensors, so the
  // model plugin's export_pretrained writes one plain model. Returns whether anything was
  // folded. The default folds nothing.
  virtual bool merge_for_export(
      const ConfigSection& table, NamedTensors& weights,
      const std::function<std::string(const std::string&)>& resolve_path) const;
  // Note [Memory declarations] (loom/memory_declarations.h), for `loom estimate`: the plugin's
  // byte terms for one rank of a job whose table is `table` (validated; the job's own or a
  // variant's): read the context and what the plugins before it declared in `terms`, add or
  // replace its own. Must not depend on configure() (it may not have run). Default: nothing.
  virtual void declare_memory(const ConfigSection& table, const memory::MemoryContext& context,
                              memory::MemoryTerms& terms) const;
  // The configurations of its table the estimate's what-if table shows, whether or not the job
  // has the table (zero: its stages and offloads; precision: its modes). Default: none.
  virtual std::vector<memory::MemoryVariant> memory_variants() const;
  // A plugin that fills Slot::step_driver: called once, after model_built and before
  // params_ready, with the trainable parameters, the rule and the Comm (see loom/step_driver.h).
  virtual std::unique_ptr<StepDriver> create_step_driver(const StepDriverOptions& options,
                                                         Engine& engine);
  // A plugin that fills Slot::step_driver: whether the driver it makes for its validated `table`
  // keeps no fp32 masters under [optimizer] master_dtype = "bf16" (the bf16 weights as their own
  // masters, Note [bf16 weights as their own masters]; loom/step_driver.h has the SDK calls that
  // build it). Default false: `loom check` and `loom run` alike refuse master_dtype = "bf16"
  // with the plugin's table, naming both, before anything is built. A driver that says true and
  // keeps masters all the same is refused once made (its master_bytes()).
  virtual bool keeps_no_masters(const ConfigSection& table) const;
};

}  // namespace loom

extern "C" {
// The C face of a plugin. api_version stays the first field in every future version.
struct loom_plugin_info {
  uint32_t api_version;
  const char* name;
  const char* version;
  const char* build;  // LOOM_BUILD_STRING of the plugin's build
  loom::Plugin* (*create)();
  void (*destroy)(loom::Plugin*);
};

// Note [ABI record]: what the host must know before any of a plugin's code runs — its API
// version and its build — in an ELF section of its own, ".loom_abi", which the host reads
// from the file before it loads the library (loading runs the plugin's static initialisers,
// compiled against whatever SDK the plugin saw). The layout is fixed for every future version.
struct loom_plugin_abi {
  char magic[8];         // "LOOMABI" and a NUL
  uint32_t api_version;  // LOOM_PLUGIN_API_VERSION of the plugin's build
  char build[244];       // LOOM_BUILD_STRING of the plugin's build, NUL-terminated
};
}

#define LOOM_PLUGIN_EXPORT __attribute__((visibility("default")))
#define LOOM_ABI_SECTION ".loom_abi"

// A plugin's ABI record (Note [ABI record]); LOOM_DEFINE_PLUGIN writes it. Tests of the host
// write one of another version or build by hand.
#define LOOM_DEFINE_ABI_RECORD(API_VERSION, BUILD)                                         \
  extern "C" LOOM_PLUGIN_EXPORT __attribute__((section(LOOM_ABI_SECTION), used))           \
  const loom_plugin_abi loom_plugin_abi_record = {"LOOMABI", API_VERSION, BUILD};

// In exactly one .cpp of a plugin: LOOM_DEFINE_PLUGIN(MyPlugin, "myplugin", "1.0.0")
#define LOOM_DEFINE_PLUGIN(Class, NAME, VERSION)                                           \
  LOOM_DEFINE_ABI_RECORD(LOOM_PLUGIN_API_VERSION, LOOM_BUILD_STRING)                       \
  extern "C" LOOM_PLUGIN_EXPORT const loom_plugin_info* loom_plugin_entry() {              \
    static const loom_plugin_info info{                                                    \
        LOOM_PLUGIN_API_VERSION, NAME, VERSION, LOOM_BUILD_STRING,                         \
        []() -> ::loom::Plugin* { return new Class(); },                                   \
        [](::loom::Plugin* plugin) { delete plugin; }};                                    \
    return &info;                                                                          \
  }

#pragma GCC visibility pop
