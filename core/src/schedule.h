// schedule.h (core-internal) — the learning-rate schedules, as Hugging Face's
// transformers.get_scheduler defines them (names, warm-up, defaults of their extra arguments),
// so a job ported from a Trainer run gets the same rate at every step.
//
// Steps count from 0 at the first update, as a torch LambdaLR's do: update k (0-based) runs
// at base * factor(k). `constant` ignores the warm-up (HF's Trainer does: that is what
// `constant_with_warmup` is for).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace loom {

class ConfigSection;

struct Schedule {
  std::string kind = "constant";
  double base = 0;      // learning_rate
  int64_t warmup = 0;   // steps of linear warm-up from 0
  int64_t total = 0;    // max_steps
  double num_cycles = 0.5;  // cosine (0.5: one half wave), cosine_with_restarts (1)
  double lr_end = 1e-7, power = 1.0;  // polynomial
  int64_t timescale = 0;              // inverse_sqrt
  double min_lr_rate = 0;             // cosine_with_min_lr
  // DeepSpeed's schedulers (ds_warmup_lr, ds_warmup_decay_lr, ds_warmup_cosine_lr)
  bool warmup_log = true;             // warmup_type "log" (DeepSpeed's default) or "linear"
  double warmup_min_lr = 0;           // WarmupLR, WarmupDecayLR
  double warmup_min_ratio = 0, cos_min_ratio = 1e-4;  // WarmupCosineLR

  double lr(int64_t step) const;
  std::string describe() const;

 private:
  double deepspeed_lr(int64_t step) const;
};

// From [train]: lr_scheduler_type, learning_rate, warmup_steps or warmup_ratio, max_steps and
// lr_scheduler_kwargs (HF's scheduler_specific_kwargs). Wrong names, kwargs the schedule does
// not take, and values HF refuses are ConfigErrors naming the key.
// `total`: the steps the schedule spans when [train] num_train_epochs sets them (the engine
// counts them once the data is read), else max_steps.
Schedule make_schedule(const ConfigSection& train, std::optional<int64_t> total = std::nullopt);

}  // namespace loom
