// loom/trainer.h — running a job: what the `loom` CLI calls, and what tests and embedding
// programs use to drive training step by step.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/engine.h"

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

#define LOOM_VERSION "0.1.0"

namespace loom {

struct RunSummary {
  int64_t steps = 0;              // optimizer steps completed in total
  double final_loss = 0.0;        // mean loss of the last step
  std::string output_dir;
  std::string last_checkpoint;    // folder, or empty
  int64_t peak_memory_bytes = 0;  // device peak (tracked allocator on CPU)
  int stopped_by_signal = 0;      // SIGTERM/SIGINT that ended the run early, else 0
  // Note [Best model]: the checkpoint of the best evaluation (empty: none), and its metric.
  std::string best_checkpoint;
  double best_metric = 0.0;
};

// Note [Graceful stop]: pre-emption (Slurm, Kubernetes) sends SIGTERM, a terminal SIGINT.
// install_stop_handlers() makes the first of them a request: every rank finishes its current
// step, the ranks agree on the step to stop after (the flag rides on the step's loss
// all-reduce), the run writes a checkpoint when the job saves at all ([train] save_on_signal),
// and run() returns with stopped_by_signal set; the CLI then exits 128 + signal. A second
// signal, half a second or more after the first (an earlier one is the same request delivered
// twice, as Slurm and `timeout` do), ends the process at once.
void install_stop_handlers();
// The signal asked for a stop, or 0. request_stop() is what the handler calls (tests and
// embedding programs may call it too).
int stop_requested();
void request_stop(int signal);

class Trainer {
 public:
  // Parses and resolves the job (plugins found, every table validated). Throws ConfigError /
  // PluginError with file:line and what to do.
  static std::unique_ptr<Trainer> from_file(const std::filesystem::path& job,
                                            const std::vector<std::string>& overrides = {});
  // The same from TOML text; relative paths start at `dir`.
  static std::unique_ptr<Trainer> from_text(const std::string& toml,
                                            const std::filesystem::path& dir,
                                            const std::vector<std::string>& overrides = {});
  virtual ~Trainer();

  // A human-readable summary of the resolved job (what `loom check` prints).
  virtual std::string describe() const = 0;
  // Builds everything: setup → model_built → params_ready (→ load when resuming).
  virtual void setup() = 0;
  // One optimizer step (A micro-batches). Returns false, doing nothing, once max_steps is done.
  virtual bool step() = 0;
  // setup (if not done), steps to max_steps, the final checkpoint, teardown.
  virtual RunSummary run() = 0;
  // Writes a checkpoint of the current step now; returns its folder.
  virtual std::string save_checkpoint() = 0;
  // Note [Evaluation]: the evaluation set ([eval_data] or [data] validation_split) through the
  // model now, on every rank together; the metrics ("eval_loss", ...), also written to
  // metrics.jsonl and the log. A ConfigError when the job has no evaluation set.
  virtual std::vector<std::pair<std::string, double>> evaluate() = 0;
  virtual Engine& engine() = 0;
};

// Note [Job plugin paths]: a job's [plugins] path makes loom load (and so run) the libraries in
// the folders it names, and job files travel between people; so a job naming [plugins] path is
// a ConfigError unless the user allowed it: `loom ... --allow-job-plugins` (the CLI calls
// allow_job_plugins()) or LOOM_ALLOW_JOB_PLUGINS=1 in the environment. The installed plugin
// folder and LOOM_PLUGIN_PATH, which the user sets up, need no permission. Whatever allowed a
// folder, its plugins are still checked as every plugin is (Note [Trusted plugin files]).
void allow_job_plugins(bool allowed = true);
// Whether jobs may name plugin folders now: allow_job_plugins(true) or LOOM_ALLOW_JOB_PLUGINS=1.
bool job_plugins_allowed();

// Plugin commands (Plugin::commands): the usage line of every command of the plugins on the
// search path (extra_path first), for `loom --help`; and running one by name. run_plugin_command
// returns nullopt when no plugin has `name`; two plugins with one command name, or a command
// named as one of loom's own, is a PluginError naming both.
std::vector<std::string> plugin_command_usages(const std::vector<std::filesystem::path>& extra_path = {});
// Whether `name` is one of loom's own commands (run, check, estimate, ...), which no plugin may add.
bool is_own_command(const std::string& name);
std::optional<int> run_plugin_command(const std::string& name, const std::vector<std::string>& args,
                                      const std::vector<std::filesystem::path>& extra_path = {});

// `loom plugins`: every plugin on the search path (plus the core's), its slots and keys.
// extra_path: folders searched first. Load failures are listed, not thrown.
std::string describe_plugins(const std::vector<std::filesystem::path>& extra_path = {});

// `loom consolidate CKPT OUT`: a checkpoint folder (any world size or ZeRO stage) streamed into
// one safetensors file OUT holding the model's tensors by name, floating ones in fp32 (the
// fp32 masters where the run kept them), that Python's safetensors loads. Peak memory: about
// the largest tensor. Written under a temporary name and renamed: OUT appears whole or not at
// all. A missing, truncated or corrupt file of the checkpoint is a CheckpointError naming it.
void consolidate_checkpoint(const std::filesystem::path& checkpoint,
                            const std::filesystem::path& out_file);

// `loom export CKPT OUT_DIR`: a checkpoint as a folder transformers' from_pretrained loads
// (config.json + model.safetensors), by the model plugin's Plugin::export_pretrained and the
// job the checkpoint records. OUT_DIR must be new or empty; it appears whole or not at all.
// Note [Merged export]: a LoRA run exports its base model (the adapter the lora plugin wrote
// loads onto it with PEFT); with `merge` (`--merge`) the job's table plugins first fold what
// they added into the base tensors (Plugin::merge_for_export: LoRA's scaling · B·A, as PEFT's
// merge_and_unload), and the folder is one plain model. `merge` on a job with nothing to fold
// is a ConfigError.
struct ExportOptions {
  bool merge = false;
};
void export_checkpoint(const std::filesystem::path& checkpoint,
                       const std::filesystem::path& out_dir, const ExportOptions& options = {});

// Note [Generation]: `loom generate CKPT` continues a prompt with the checkpoint's model (a
// loom::CausalLM: gpt, llama), decoding one token at a time with a KV cache, in fp32. A text
// prompt is encoded with the job's Hugging Face tokenizer when it has one ([data] tokenizer,
// or the from_pretrained folder's tokenizer.json: with its special tokens, as transformers'
// tokenizer(prompt) does) and the result decoded with it (special tokens skipped); a job that
// trained on bytes ([data] source = "text") takes the prompt's bytes; any job takes token ids.
// Each next token is the argmax (temperature 0, transformers' greedy search), or drawn from
// softmax(logits / temperature) after top-k and then top-p filtering, as transformers' warpers
// apply them, with a generator seeded by `seed`. Decoding stops after the EOS token: the
// tokenizer's unless eos_id says otherwise.
struct GenerateOptions {
  std::string prompt;               // text (jobs with a tokenizer, byte-level jobs)
  std::vector<int64_t> prompt_ids;  // token ids (any job); used when not empty
  int64_t max_new_tokens = 64;
  double temperature = 0.0;  // 0: greedy
  int64_t top_k = 0;         // 0: off
  double top_p = 1.0;        // 1: off
  uint64_t seed = 0;
  std::optional<int64_t> eos_id;  // stop after this token; unset: the tokenizer's EOS; -1: never
  std::string device = "auto";  // cpu, cuda, cuda:N, auto (the job's [train] device)
};

struct Generation {
  std::vector<int64_t> ids;  // the prompt's and the new tokens
  int64_t prompt_length = 0;
  std::string text;          // the ids decoded (tokenizer or bytes); "" when neither applies
  std::string tokenizer;     // what decoded them: a tokenizer's describe(), "bytes", or ""
  std::string checkpoint;    // the folder read
  int64_t step = 0;          // its training step
};

// `loom eval` (Note [Evaluation]): the model of the checkpoint at `path` (a checkpoint folder,
// or a run's output_dir: its newest) over its job's evaluation set, on every rank of the
// launch together; the job is `job` when given, else the one the checkpoint records, with
// `overrides` (--set). The checkpoint is resumed into a scratch output_dir that is removed
// afterwards: nothing is written anywhere else.
struct CheckpointEvaluation {
  std::string checkpoint;
  int64_t step = 0;
  std::vector<std::pair<std::string, double>> metrics;
  int rank = 0;  // of this process (rank 0 prints)
};
CheckpointEvaluation evaluate_checkpoint(const std::filesystem::path& path,
                                         const std::filesystem::path& job = {},
                                         const std::vector<std::string>& overrides = {});

// `path`: a checkpoint folder, or a run's output_dir (its newest checkpoint). Bad options, a
// model that cannot decode, or a prompt longer than the model takes: ConfigError saying so.
Generation generate(const std::filesystem::path& path, const GenerateOptions& options);

}  // namespace loom

#pragma GCC visibility pop
