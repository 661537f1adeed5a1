// prepared_job.h (core-internal) — a job resolved once: Note [One resolved job].
#pragma once

#include <memory>
#include <string>

#include "job.h"
#include "loom/log.h"
#include "loom/update_rule.h"
#include "plugin_host.h"
#include "resolve.h"
#include "schedule.h"

namespace loom {

// Note [One resolved job]: everything loom decides about a job before it builds anything, done
// once, in this object: the job parsed (Job); its plugins found, its tables validated against
// their schemas and its plugins ordered (resolve()); the core's own ranges; every table
// plugin's configure() and every active plugin's validate() against the whole job (the data's
// files readable, cross-table rules such as ZeRO's offload_param needing half weights); the
// update rule built, so its values are checked (beta2 >= 1 is refused here, not at the first
// step), between the providers' validate() and the table plugins', which see it
// (JobTables::update_rule: ZeRO refuses a rule with whole-tensor statistics in backward); the
// schedule and the log level derived; and, for training, the output folder's state
// (an earlier run's checkpoints without `resume`, a resume folder that is not there). `loom run`,
// `check`, `estimate`, `export` and `generate` all start from one of these, so `loom check`
// says "ok" for exactly the jobs `loom run` goes on to build: what `run` refuses after this
// point depends on the machine or the other ranks (the device found, the world size, memory).
// Nothing is written to disk and nothing big is built.
class PreparedJob {
 public:
  enum class Purpose {
    train,      // loom run, check, estimate: everything above
    inference,  // loom export, generate: a checkpoint's recorded job, whose data is not read and
                // whose run is not resumed: neither the data's files nor output_dir are checked
  };
  explicit PreparedJob(Job job, Purpose purpose = Purpose::train);
  PreparedJob(const PreparedJob&) = delete;
  PreparedJob& operator=(const PreparedJob&) = delete;

  const Job& job() const { return job_; }
  const ResolvedJob& resolved() const { return resolved_; }
  PluginHost& host() { return host_; }
  Purpose purpose() const { return purpose_; }
  const ConfigSection& section(const std::string& table) const { return resolved_.section(table); }
  // A path of the job made absolute: relative paths start at the job file's folder.
  std::string resolve_path(const std::string& path) const;
  const Schedule& schedule() const { return schedule_; }
  // [train] num_train_epochs: the schedule spans `total` steps, counted from the data.
  void set_total_steps(int64_t total) { schedule_ = make_schedule(section("train"), total); }
  // Whether the job counts its steps in epochs (num_train_epochs set, max_steps not).
  bool steps_by_epochs() const;
  // [train] report_to names tensorboard (checked: only known integrations).
  bool reports_to_tensorboard() const { return tensorboard_; }
  log::Level log_level() const { return log_level_; }
  // The update rule built at preparation; the engine takes it (once).
  std::unique_ptr<UpdateRule> take_update_rule();
  // What `loom check` prints: the resolved job, its plugins and their order, every table.
  std::string describe() const;
  // Several ranks and no table that synchronises gradients: [ddp] was switched on with its
  // defaults (Note [Data parallelism by default]).
  bool data_parallel_by_default() const { return default_ddp_; }
  // Note [Evaluation]: an [eval_data] table or [data] validation_split.
  bool has_evaluation_set() const;

 private:
  void check_output_dir() const;
  void check_evaluation() const;
  void add_default_data_parallelism();

  Job job_;
  Purpose purpose_;
  PluginHost host_;
  ResolvedJob resolved_;
  Schedule schedule_;
  bool tensorboard_ = false;
  log::Level log_level_ = log::Level::info;
  std::unique_ptr<UpdateRule> rule_;
  bool default_ddp_ = false;
};

// The label `loom check` and the run header give a plugin: "core (built in)" or its file
// (LoadedPlugin::file_label).
std::string plugin_label(const LoadedPlugin* plugin);

}  // namespace loom
