// step_report.h (core-internal) — what a finished step tells the user: one JSON line in
// output_dir/metrics.jsonl (rank 0; the engine's numbers plus every plugin's
// TrainState::metrics), and on the terminal a progress bar, or a log line every logging_steps.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/engine.h"

namespace loom {

class EventFileWriter;

class StepReport {
 public:
  struct Options {
    std::string metrics_path;  // output_dir/metrics.jsonl
    int rank = 0, world_size = 1;
    bool progress_bar = true;  // shown only on rank 0, on a terminal, at log level info
    int64_t logging_steps = 10;     // 0: no step lines
    bool logging_first_step = false;
    std::string tensorboard_dir;    // report_to tensorboard: event files here (rank 0); "" = off
    c10::Device device{c10::kCPU};  // whose memory statistics are reported
  };
  explicit StepReport(Options options);
  ~StepReport();

  // A fresh run: an empty metrics.jsonl (a resumed run appends to the one it has).
  void start_fresh() const;
  // After step state.step: `seconds` it took, `samples` and `tokens` this rank trained.
  void report(const TrainState& state, double seconds, int64_t samples, int64_t tokens);
  // After an evaluation at step `step`: its metrics as one line of metrics.jsonl (rank 0) and
  // one log line.
  void report_eval(int64_t step, const std::vector<std::pair<std::string, double>>& metrics);
  // Ends the progress bar's line, if one is shown.
  void end_progress();

 private:
  Options options_;
  std::unique_ptr<EventFileWriter> events_;  // null: no TensorBoard
  bool bar_started_ = false;  // the bar's clock: from the first step this process reported
  std::chrono::steady_clock::time_point bar_start_;
  int64_t bar_start_step_ = 0;
};

}  // namespace loom
