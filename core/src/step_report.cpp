// The per-step report. See step_report.h.
#include "step_report.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "loom/error.h"
#include "loom/log.h"
#include "loom/memory.h"
#include "tensorboard.h"

namespace loom {
namespace {

// tqdm's clock: MM:SS, or H:MM:SS from an hour.
std::string clock_text(double seconds) {
  const auto s = static_cast<long long>(std::max(0.0, seconds) + 0.5);
  char text[32];
  if (s >= 3600)
    std::snprintf(text, sizeof text, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  else
    std::snprintf(text, sizeof text, "%02lld:%02lld", s / 60, s % 60);
  return text;
}

// The Trainer's TensorBoard tags (its TensorBoardCallback's rewrite_logs): eval_x -> eval/x,
// anything else -> train/x.
std::string tensorboard_tag(const std::string& key) {
  return key.rfind("eval_", 0) == 0 ? "eval/" + key.substr(5) : "train/" + key;
}

void write_scalars(EventFileWriter& events, const nlohmann::ordered_json& line, int64_t step) {
  for (const auto& [key, value] : line.items())
    if (key != "step" && value.is_number()) events.scalar(tensorboard_tag(key), step, value.get<double>());
}

}  // namespace

StepReport::StepReport(Options options) : options_(std::move(options)) {
  if (options_.rank == 0 && !options_.tensorboard_dir.empty())
    events_ = std::make_unique<EventFileWriter>(options_.tensorboard_dir);
}

StepReport::~StepReport() = default;

void StepReport::start_fresh() const {
  if (options_.rank == 0) std::ofstream(options_.metrics_path, std::ios::trunc);
}

void StepReport::report(const TrainState& state, double seconds, int64_t samples,
                        int64_t tokens) {
  const auto memory_now = memory::device_stats(options_.device);
  const double world = options_.world_size;
  const double samples_per_s = samples * world / seconds, tokens_per_s = tokens * world / seconds;
  if (options_.rank == 0) {
    nlohmann::ordered_json line = {
        {"step", state.step},
        {"loss", state.loss},
        {"lr", state.lr},
        {"grad_norm", state.grad_norm},
        {"step_time_s", seconds},
        {"samples_per_s", samples_per_s},
        {"tokens_per_s", tokens_per_s},
        // Targets the loss summed this step on all ranks (labels not -100): the answer tokens
        // of an SFT step, the samples of a classifier's.
        {"trained_tokens", state.window_targets},
        {"mem_current_bytes", memory_now.current_bytes},
        {"mem_peak_bytes", memory_now.peak_bytes},
        {"rss_peak_bytes", memory::peak_rss_bytes()},
        {"skipped_updates", state.skipped_updates},
        {"loss_scale", state.loss_scale}};
    for (const auto& [key, value] : state.metrics) line[key] = value;
    std::ofstream out(options_.metrics_path, std::ios::app);
    out << line.dump() << "\n";
    if (events_) write_scalars(*events_, line, state.step);
  }
  const bool bar = options_.progress_bar && options_.rank == 0 && ::isatty(2) &&
                   log::level() <= log::Level::info;
  if (bar) {
    // As tqdm: elapsed<remaining, from the steps this process ran (a resumed run starts here).
    const auto now = std::chrono::steady_clock::now();
    if (!bar_started_) {
      bar_started_ = true;
      bar_start_ = now - std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             std::chrono::duration<double>(seconds));
      bar_start_step_ = state.step - 1;
    }
    const double elapsed = std::chrono::duration<double>(now - bar_start_).count();
    const double done = static_cast<double>(state.step - bar_start_step_);
    const double remaining =
        done > 0 ? elapsed / done * static_cast<double>(state.max_steps - state.step) : 0.0;
    const int width = 30;
    const int filled =
        static_cast<int>(width * state.step / std::max<int64_t>(1, state.max_steps));
    char line[256];
    std::snprintf(line, sizeof line, "[%s%s] %lld/%lld [%s<%s] loss %.4f lr %.2e %.1f samples/s",
                  std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                  static_cast<long long>(state.step), static_cast<long long>(state.max_steps),
                  clock_text(elapsed).c_str(), clock_text(remaining).c_str(), state.loss,
                  state.lr, samples_per_s);
    log::status(line);
    return;
  }
  const int64_t every = options_.logging_steps;
  const bool due = every > 0 ? state.step % every == 0 || state.step == state.max_steps
                             : false;
  if (due || (state.step == 1 && options_.logging_first_step))
    log::info("step ", state.step, "/", state.max_steps, " loss ", state.loss, " lr ", state.lr,
              " grad_norm ", state.grad_norm, " ", samples_per_s, " samples/s ", tokens_per_s,
              " tokens/s, memory ", memory::format_bytes(memory_now.current_bytes), " (peak ",
              memory::format_bytes(memory_now.peak_bytes), ")");
}

void StepReport::report_eval(int64_t step,
                             const std::vector<std::pair<std::string, double>>& metrics) {
  if (options_.rank == 0) {
    nlohmann::ordered_json line = {{"step", step}};
    for (const auto& [key, value] : metrics) line[key] = value;
    std::ofstream out(options_.metrics_path, std::ios::app);
    out << line.dump() << "\n";
    if (events_) write_scalars(*events_, line, step);
  }
  std::string text;
  for (const auto& [key, value] : metrics) text += detail::cat(" ", key, " ", value);
  log::end_status();  // the evaluation's line below the progress bar, not over it
  log::info("eval at step ", step, ":", text);
}

void StepReport::end_progress() { log::end_status(); }

}  // namespace loom
