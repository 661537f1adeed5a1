// loom/plot.h — `loom plot`: the curves of one or several runs' metrics.jsonl as one SVG file,
// with no Python and no LibTorch (Note [Curves] in src/commands/plot.cpp).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom::plot {

struct Options {
  // Run folders (an output_dir holding metrics.jsonl) or metrics.jsonl files themselves.
  std::vector<std::filesystem::path> runs;
  // One panel each, in this order; empty: loss, eval_loss and lr, those any run has.
  std::vector<std::string> metrics;
  // TensorBoard's smoothing weight, in [0, 1); 0 draws the values as they are.
  double smooth = 0.0;
  std::filesystem::path out;  // the SVG file; its folder must exist
};

// What was drawn, for the command's one line of output.
struct Summary {
  std::vector<std::string> runs;     // the legend's names
  std::vector<std::string> metrics;  // the panels
  int curves = 0;                    // (run, metric) pairs with at least one finite value
};

// Reads every run, draws the panels and writes `out` under a temporary name, renamed at the
// end: the file appears whole or not at all. Bad input (a run with no metrics.jsonl, a line
// that is not JSON, a metric no run has, no --out, a weight outside [0, 1), a missing folder)
// is a ConfigError naming it, before anything is written.
Summary write_svg(const Options& options);

// TensorBoard's scalar smoothing: an exponential moving average started at 0 and debiased,
// last = last * weight + (1 - weight) * value, smoothed = last / (1 - weight^n) after n values;
// a constant series stays as it is.
std::vector<double> smooth_values(const std::vector<double>& values, double weight);

}  // namespace loom::plot

#pragma GCC visibility pop
