// The `loom` command: run, check, plugins, env, consolidate, export. Every error is one line naming the thing and what
// to do, and a non-zero exit.
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "loom/cpu.h"
#include "loom/error.h"
#include "loom/plugin.h"
#include "loom/log.h"
#include "loom/trainer.h"

namespace {

const char* kUsage = R"(loom — a C++ training engine on LibTorch whose techniques are plugins.

usage:
  loom run JOB.toml [--set table.key=value ...]    train
  loom check JOB.toml [--set table.key=value ...]  validate the job (plugins, keys, types)
  loom plugins [--path FOLDER ...]                 list plugins, their slots and config keys
  loom env                                         the CPU, its kernel level (oneDNN ISA), threads
  loom consolidate CHECKPOINT OUT.safetensors      one fp32 model file from a (sharded) checkpoint
  loom export CHECKPOINT OUT_DIR                   a transformers folder (config.json +
                                                   model.safetensors) from_pretrained loads
  loom --version | --help

examples:
  loom run examples/demo.toml --set train.max_steps=20
  loom check examples/bert_seed.toml
)";

struct Args {
  std::string command, job, out;
  std::vector<std::string> overrides;
  std::vector<std::filesystem::path> paths;
};

Args parse(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* flag) {
      if (i + 1 >= argc) throw loom::ConfigError(std::string(flag) + " needs a value");
      return std::string(argv[++i]);
    };
    if (a == "--set") {
      args.overrides.push_back(value("--set"));
    } else if (a.rfind("--set=", 0) == 0) {
      args.overrides.push_back(a.substr(6));
    } else if (a == "--path") {
      args.paths.emplace_back(value("--path"));
    } else if (!a.empty() && a[0] == '-') {
      throw loom::ConfigError("unknown option '" + a + "'; see loom --help");
    } else if (args.command.empty()) {
      args.command = a;
    } else if (args.job.empty()) {
      args.job = a;
    } else if ((args.command == "consolidate" || args.command == "export") && args.out.empty()) {
      args.out = a;
    } else {
      throw loom::ConfigError("unexpected argument '" + a + "'; see loom --help");
    }
  }
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      std::cout << kUsage;
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
    Args args = parse(argc, argv);
    if (args.command == "env") {
      std::cout << "loom         " << LOOM_VERSION << " (" << LOOM_BUILD_STRING << ")\n"
                << loom::cpu::describe_environment();
      return 0;
    }
    if (args.command == "plugins") {
      std::cout << loom::describe_plugins(args.paths);
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
      loom::export_checkpoint(args.job, args.out);
      std::cout << "wrote " << args.out << " (config.json, model.safetensors) from " << args.job
                << "\n";
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
                            "'; use run, check, plugins, env, consolidate or export (loom --help)");
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
