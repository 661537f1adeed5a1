// The `loom` command: run, check, estimate, eval, plugins, env, consolidate, export, generate, plot. Every error is one line naming the thing and what
// to do, and a non-zero exit.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "loom/cpu.h"
#include "loom/error.h"
#include "loom/estimate.h"
#include "loom/plot.h"
#include "loom/plugin.h"
#include "loom/log.h"
#include "loom/trainer.h"

namespace {

const char* kUsage = R"(loom — a C++ training engine on LibTorch whose techniques are plugins.

usage:
  loom run JOB.toml [--set table.key=value ...]    train
      --deepspeed FILE       read a DeepSpeed config (ds_config.json) onto the job's tables,
                             as [train] deepspeed = "FILE" does (also for check, estimate)
      --allow-job-plugins    load plugins from the folders of the job's [plugins] path (any
                             command that reads a job; or LOOM_ALLOW_JOB_PLUGINS=1)
  loom check JOB.toml [--set table.key=value ...]  validate the job (plugins, keys, types)
  loom estimate JOB.toml [options] [--set ...]     memory per rank for every ZeRO stage,
                                                   offload and precision (short probe runs)
  loom estimate --params N [options]               the same for N parameters, model states only
      --world-size N         ranks to shard over (1)
      --batch B              per-device batch of the activations (the job's)
      --budget SIZE          also the largest batch that fits SIZE (e.g. 20GiB) per rank
      --no-proxy             probe the whole model, not proxies of 1, 2 and 3 of its units
                             (the default where the model has more than 3 equal units)
      --no-probe             model states only: no probe runs (the model is still built
                             once, on one rank, to count it)
  loom eval CHECKPOINT|OUTPUT_DIR [JOB.toml] [--set ...]
                                                   the checkpoint's model over the job's
                                                   evaluation set ([eval_data] or [data]
                                                   validation_split; the job the checkpoint
                                                   records unless JOB.toml is given): one JSON
                                                   line of eval_loss, ... on stdout
  loom plugins [--path FOLDER ...]                 list plugins, their slots and config keys
  loom env                                         the CPU, its kernel level (oneDNN ISA), threads
  loom consolidate CHECKPOINT OUT.safetensors      one fp32 model file from a (sharded) checkpoint
  loom export CHECKPOINT OUT_DIR [--merge]         a transformers folder (config.json, the
                                                   weights, the tokenizer) from_pretrained loads
      --merge                LoRA adapters folded into the weights (PEFT's merge_and_unload);
                             without it a llama LoRA run exports its base model (PEFT's
                             adapter goes on top); gpt and bert LoRA runs need --merge
  loom generate CHECKPOINT|OUTPUT_DIR [options]    continue a prompt (gpt, llama; KV cache)
      --prompt TEXT          text: encoded with the job's tokenizer (tokenizer.json of [data]
                             tokenizer or [model] from_pretrained) or as bytes (source "text")
      --prompt-ids 1,2,3     token ids, for any job (printed back as ids without a tokenizer)
      --max-new-tokens N     64
      --temperature T        0 = greedy (the default); > 0 samples
      --top-k K, --top-p P   sampling filters (0 and 1: off)
      --seed S               the sampling generator's seed (0)
      --eos-id N             stop after this token (default: the tokenizer's EOS; -1: never)
      --device D             cpu, cuda, cuda:N (default: the job's [train] device)
  loom plot RUN_DIR... --out FILE.svg [options]    the runs' curves (metrics.jsonl) in one SVG
                                                   file, a panel per metric, a colour per run
      --metrics a,b,c        the panels (default: loss, eval_loss, lr, those the runs have)
      --smooth W             TensorBoard's smoothing, weight W in [0, 1) (its default: 0.6);
                             the raw values drawn faint beneath
      --out FILE.svg         the file to write (its folder must exist)
  loom PLUGIN_COMMAND ARGS...                      a command a plugin adds (listed below)
  loom --version | --help

examples:
  loom run examples/demo.toml --set train.max_steps=20
  loom generate runs/demo --prompt "The meaning of " --temperature 0.8 --top-k 40
  loom plot runs/demo --out runs/demo/curves.svg
  loom check examples/distributed/zero3.toml
  loom run examples/deepspeed/job.toml --deepspeed examples/deepspeed/ds_zero2_offload.json
)";

struct Args {
  std::string command, job, out;
  std::vector<std::string> overrides;
  std::vector<std::filesystem::path> paths;
  loom::GenerateOptions generate;
  loom::estimate::Options estimate;
  loom::ExportOptions export_options;
  loom::plot::Options plot;
  double params = 0;
  bool has_prompt = false;
  bool allow_job_plugins = false;
};

int64_t integer_of(const std::string& flag, const std::string& text) {
  try {
    size_t used = 0;
    const int64_t value = std::stoll(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  throw loom::ConfigError(flag + " takes an integer, got '" + text + "'");
}

double number_of(const std::string& flag, const std::string& text) {
  try {
    size_t used = 0;
    const double value = std::stod(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  throw loom::ConfigError(flag + " takes a number, got '" + text + "'");
}

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    parts.push_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return parts;
}

std::vector<int64_t> ids_of(const std::string& text) {
  std::vector<int64_t> ids;
  for (const auto& part : split_commas(text)) ids.push_back(integer_of("--prompt-ids", part));
  for (int64_t id : ids)
    if (id < 0) throw loom::ConfigError("--prompt-ids takes ids >= 0, got " + std::to_string(id));
  return ids;
}

std::vector<std::string> metric_names_of(const std::string& text) {
  std::vector<std::string> names = split_commas(text);
  for (const auto& name : names)
    if (name.empty())
      throw loom::ConfigError("--metrics takes metric names separated by commas, got '" + text + "'");
  return names;
}

Args parse(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* flag) {
      if (i + 1 >= argc) throw loom::ConfigError(std::string(flag) + " needs a value");
      return std::string(argv[++i]);
    };
    if (a == "--deepspeed" || a.rfind("--deepspeed=", 0) == 0) {
      // Note [DeepSpeed config files]: as [train] deepspeed, but relative to where loom runs.
      const std::string file = a == "--deepspeed" ? value("--deepspeed") : a.substr(12);
      const std::string path = std::filesystem::absolute(file).lexically_normal().string();
      if (path.find('\'') != std::string::npos)
        throw loom::ConfigError("--deepspeed " + file + ": a path with a ' in it; rename the file");
      args.overrides.push_back("train.deepspeed='" + path + "'");
    } else if (a == "--set") {
      args.overrides.push_back(value("--set"));
    } else if (a.rfind("--set=", 0) == 0) {
      args.overrides.push_back(a.substr(6));
    } else if (a == "--path") {
      args.paths.emplace_back(value("--path"));
    } else if (a == "--allow-job-plugins") {
      args.allow_job_plugins = true;  // Note [Job plugin paths] in loom/trainer.h
    } else if (args.command == "generate" && a == "--prompt") {
      args.generate.prompt = value("--prompt");
      args.has_prompt = true;
    } else if (args.command == "generate" && a == "--prompt-ids") {
      args.generate.prompt_ids = ids_of(value("--prompt-ids"));
      args.has_prompt = true;
    } else if (args.command == "generate" && a == "--max-new-tokens") {
      args.generate.max_new_tokens = integer_of(a, value("--max-new-tokens"));
    } else if (args.command == "generate" && a == "--temperature") {
      args.generate.temperature = number_of(a, value("--temperature"));
    } else if (args.command == "generate" && a == "--top-k") {
      args.generate.top_k = integer_of(a, value("--top-k"));
    } else if (args.command == "generate" && a == "--top-p") {
      args.generate.top_p = number_of(a, value("--top-p"));
    } else if (args.command == "generate" && a == "--seed") {
      args.generate.seed = static_cast<uint64_t>(integer_of(a, value("--seed")));
    } else if (args.command == "generate" && a == "--eos-id") {
      args.generate.eos_id = integer_of(a, value("--eos-id"));
    } else if (args.command == "generate" && a == "--device") {
      args.generate.device = value("--device");
    } else if (args.command == "export" && a == "--merge") {
      args.export_options.merge = true;
    } else if (args.command == "estimate" && a == "--world-size") {
      const int64_t n = integer_of(a, value("--world-size"));
      if (n < 1 || n > (int64_t{1} << 30))
        throw loom::ConfigError("--world-size takes a rank count >= 1, got " + std::to_string(n));
      args.estimate.world_size = static_cast<int>(n);
    } else if (args.command == "estimate" && a == "--batch") {
      args.estimate.batch = integer_of(a, value("--batch"));
      if (args.estimate.batch < 1)
        throw loom::ConfigError("--batch takes a batch size >= 1, got " +
                                std::to_string(args.estimate.batch));
    } else if (args.command == "estimate" && a == "--budget") {
      args.estimate.budget_bytes = loom::estimate::parse_size(a, value("--budget"));
    } else if (args.command == "estimate" && a == "--no-proxy") {
      args.estimate.proxy = false;
    } else if (args.command == "estimate" && a == "--no-probe") {
      args.estimate.probe = false;
    } else if (args.command == "estimate" && a == "--params") {
      args.params = number_of(a, value("--params"));
      if (!(args.params >= 1))
        throw loom::ConfigError("--params takes a parameter count such as 1e12, got " +
                                std::to_string(args.params));
    } else if (args.command == "plot" && a == "--metrics") {
      args.plot.metrics = metric_names_of(value("--metrics"));
    } else if (args.command == "plot" && a == "--smooth") {
      args.plot.smooth = number_of(a, value("--smooth"));
    } else if (args.command == "plot" && a == "--out") {
      args.plot.out = value("--out");
    } else if (!a.empty() && a[0] == '-') {
      throw loom::ConfigError("unknown option '" + a + "'; see loom --help");
    } else if (args.command.empty()) {
      args.command = a;
    } else if (args.command == "plot") {
      args.plot.runs.emplace_back(a);
    } else if (args.job.empty()) {
      args.job = a;
    } else if ((args.command == "consolidate" || args.command == "export" ||
                args.command == "eval") &&
               args.out.empty()) {
      args.out = a;
    } else {
      throw loom::ConfigError("unexpected argument '" + a + "'; see loom --help");
    }
  }
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  const bool plugin_command = argc > 1 && argv[1][0] != '-' && !loom::is_own_command(argv[1]);
  for (int i = 1; i < argc && !plugin_command; ++i) {
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      std::cout << kUsage;
      // Plugins may add commands (Plugin::commands); those on the search path are listed.
      try {
        const auto usages = loom::plugin_command_usages();
        if (!usages.empty()) std::cout << "\nplugin commands:\n";
        for (const auto& usage : usages) std::cout << "  loom " << usage << "\n";
      } catch (const std::exception& error) {
        std::cout << "\nplugin commands: cannot list them: " << error.what() << "\n";
      }
      return 0;
    }
  }
  try {
    // Before anything runs a kernel or starts a thread: see loom/cpu.h.
    const auto& isa = loom::cpu::ensure_cpu_kernels_work();
    for (int i = 1; i < argc; ++i) {
      if (!std::strcmp(argv[i], "--version")) {
        std::cout << "loom " << LOOM_VERSION << " (" << LOOM_BUILD_STRING << ")\n"
                  << "cpu " << loom::cpu::read_cpu_info().model << "; oneDNN isa "
                  << isa.summary() << " (loom env says more)\n";
        return 0;
      }
    }
    if (plugin_command) {
      // Its arguments are the plugin's to parse.
      const std::vector<std::string> rest(argv + 2, argv + argc);
      if (auto rc = loom::run_plugin_command(argv[1], rest)) return *rc;
      throw loom::ConfigError(std::string("unknown command '") + argv[1] +
                              "'; use run, check, estimate, eval, plugins, env, consolidate, export, generate, plot "
                              "or a plugin's command (loom --help lists them)");
    }
    Args args = parse(argc, argv);
    if (args.allow_job_plugins) loom::allow_job_plugins();
    if (args.command == "env") {
      std::cout << "loom         " << LOOM_VERSION << " (" << LOOM_BUILD_STRING << ")\n"
                << loom::cpu::describe_environment();
      return 0;
    }
    if (args.command == "plugins") {
      std::cout << loom::describe_plugins(args.paths);
      return 0;
    }
    if (args.command == "plot") {
      const loom::plot::Summary drawn = loom::plot::write_svg(args.plot);
      std::string panels;
      for (const auto& metric : drawn.metrics) panels += (panels.empty() ? "" : ", ") + metric;
      std::cout << "wrote " << args.plot.out.string() << ": " << panels << " of "
                << drawn.runs.size() << (drawn.runs.size() == 1 ? " run" : " runs") << " ("
                << drawn.curves << " curves)\n";
      return 0;
    }
    if (args.command == "consolidate") {
      if (args.job.empty() || args.out.empty())
        throw loom::ConfigError(
            "loom consolidate needs a checkpoint folder and an output file: loom consolidate "
            "out/checkpoint-100 model.safetensors");
      loom::consolidate_checkpoint(args.job, args.out);
      std::cout << "wrote " << args.out << " from " << args.job << "\n";
      return 0;
    }
    if (args.command == "export") {
      if (args.job.empty() || args.out.empty())
        throw loom::ConfigError(
            "loom export needs a checkpoint folder and an output folder: loom export "
            "out/checkpoint-100 gpt2-finetuned");
      loom::export_checkpoint(args.job, args.out, args.export_options);
      std::cout << "wrote " << args.out << " (config.json, model.safetensors) from " << args.job
                << (args.export_options.merge ? ", adapters merged" : "") << "\n";
      return 0;
    }
    if (args.command == "generate") {
      if (args.job.empty() || !args.has_prompt)
        throw loom::ConfigError(
            "loom generate needs a checkpoint (or a run's output_dir) and a prompt: loom "
            "generate runs/demo --prompt \"The \" (or --prompt-ids 1,2,3)");
      const loom::Generation out = loom::generate(args.job, args.generate);
      std::cerr << "loom generate: " << out.checkpoint << " (step " << out.step << "), "
                << out.ids.size() - static_cast<size_t>(out.prompt_length) << " new tokens"
                << (out.tokenizer.empty() ? " (ids: the job has no tokenizer)" : "; " + out.tokenizer)
                << "\n";
      if (!out.tokenizer.empty()) {
        std::cout << out.text << "\n";
      } else {
        for (size_t i = 0; i < out.ids.size(); ++i) std::cout << (i ? " " : "") << out.ids[i];
        std::cout << "\n";
      }
      return 0;
    }
    if (args.command == "eval") {
      if (args.job.empty())
        throw loom::ConfigError(
            "loom eval needs a checkpoint (or a run's output_dir): loom eval "
            "runs/demo/checkpoint-300 [JOB.toml]");
      const loom::CheckpointEvaluation result =
          loom::evaluate_checkpoint(args.job, args.out, args.overrides);
      if (result.rank == 0) {
        // One JSON object, as metrics.jsonl's evaluation lines, with the checkpoint named.
        std::string line = "{\"checkpoint\":\"" + result.checkpoint + "\",\"step\":" +
                           std::to_string(result.step);
        char number[40];
        for (const auto& [name, value] : result.metrics) {
          std::snprintf(number, sizeof number, "%.17g", value);
          line += ",\"" + name + "\":" + number;
        }
        std::cout << line << "}\n";
      }
      return 0;
    }
    if (args.command == "estimate") {
      if (args.params > 0 && !args.job.empty())
        throw loom::ConfigError("loom estimate takes a job file or --params N, not both");
      if (args.params <= 0 && args.job.empty())
        throw loom::ConfigError(
            "loom estimate needs a job file (loom estimate JOB.toml) or a parameter count "
            "(loom estimate --params 1e12 --world-size 1024)");
      if (!args.estimate.probe && args.estimate.budget_bytes > 0)
        throw loom::ConfigError("--budget needs the probe (the batch that fits depends on the "
                                "activations it measures); drop --no-probe");
      if (args.params > 0 && args.estimate.budget_bytes > 0)
        throw loom::ConfigError("--budget needs a job file: the batch that fits depends on the "
                                "model's activations, which --params does not know");
      const loom::estimate::Report report =
          args.params > 0 ? loom::estimate::estimate_params(args.params, args.estimate)
                          : loom::estimate::estimate_job(args.job, args.overrides, args.estimate);
      std::cout << loom::estimate::format(report);
      return 0;
    }
    if (args.command == "run" || args.command == "check") {
      if (args.job.empty())
        throw loom::ConfigError("loom " + args.command + " needs a job file: loom " +
                                args.command + " JOB.toml");
      auto trainer = loom::Trainer::from_file(args.job, args.overrides);
      if (args.command == "check") {
        std::cout << trainer->describe() << "ok: the job is valid\n";
        return 0;
      }
      loom::install_stop_handlers();
      const loom::RunSummary summary = trainer->run();
      // Stopped early by SIGTERM/SIGINT: the shell's convention for death by that signal.
      return summary.stopped_by_signal ? 128 + summary.stopped_by_signal : 0;
    }
    if (args.command.empty()) {
      std::cerr << kUsage;
      return 2;
    }
    throw loom::ConfigError("unknown command '" + args.command +
                            "'; use run, check, estimate, eval, plugins, env, consolidate, export, generate or plot (loom --help)");
  } catch (const loom::Error& error) {
    std::cerr << "loom: error: " << error.what() << "\n";
    return 1;
  } catch (const c10::Error& error) {
    std::cerr << "loom: error: " << error.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& error) {
    std::cerr << "loom: error: " << error.what() << "\n";
    return 1;
  }
}
