// Note [Curves]
// ~~~~~~~~~~~~~
// `loom plot RUN... --out FILE.svg` draws what metrics.jsonl holds, with no Python and no
// LibTorch (this file is compiled apart from the core's torch headers: a reader of text files
// should not cost a torch translation unit). One panel per metric, stacked, sharing the x axis
// (the step) so that a loss and an eval_loss line up; one colour per run; one <path
// class="curve"> per (run, metric) with a finite value, a point per step. With smoothing the
// values are also drawn faint (class="raw") under the smoothed curve, as TensorBoard does.
//
// What a line of metrics.jsonl says: nlohmann writes a NaN or an infinity as null, and other
// writers as a string ("NaN", "inf"); both are skipped, never drawn. A resumed run appends to
// the metrics.jsonl it had, so a step that ran before the crash and again after it appears
// twice: the later line wins, as it is the run that went on.
//
// The y axis of a panel spans its values widened to "nice" numbers (1, 2 or 5 times a power of
// ten); the x axis spans exactly the first to the last step drawn, so the first and last points
// sit on the panel's edges. Smoothed values are weighted means of the raw ones (weights >= 0,
// summing to 1 after debiasing), so they never leave the raw values' range.
#include "loom/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <cctype>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "fsutil.h"
#include "loom/error.h"

namespace loom::plot {
namespace fs = std::filesystem;

namespace {

// Page layout, in SVG user units (pixels).
constexpr double kWidth = 820, kLeft = 72, kRight = 24;
constexpr double kLegendRow = 20, kLegendTop = 10;
constexpr double kPanelTitle = 30, kPlotHeight = 170, kPanelBottom = 44;
constexpr double kPanelHeight = kPanelTitle + kPlotHeight + kPanelBottom;
// Series this short (evaluations, mostly) get a dot on every point, so that one value shows.
constexpr size_t kMarkedPoints = 30;
// Matplotlib's default cycle ("tab10"): ten colours told apart on screen and in print.
constexpr const char* kColours[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

struct Series {
  std::vector<double> steps, values;  // finite values only, by increasing step
};

struct Run {
  std::string name;
  fs::path file;
  std::vector<std::string> metric_names;  // as first seen in the file
  std::map<std::string, Series> series;
};

struct Range {
  double lo = 0, hi = 1;
};

std::string quoted(const fs::path& path) { return "'" + path.string() + "'"; }

// A value of metrics.jsonl as a number: NaN for what stands for a non-finite one (null, "nan",
// "inf", ...); nothing for what is no metric (text, lists, objects, booleans).
std::optional<double> number_of(const nlohmann::ordered_json& value) {
  if (value.is_number()) return value.get<double>();
  if (value.is_null()) return std::nan("");
  if (value.is_string()) {
    std::string text = value.get<std::string>();
    std::transform(text.begin(), text.end(), text.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    if (!text.empty() && (text[0] == '+' || text[0] == '-')) text.erase(0, 1);
    if (text == "nan" || text == "inf" || text == "infinity") return std::nan("");
  }
  return std::nullopt;
}

fs::path metrics_file_of(const fs::path& given) {
  std::error_code ec;
  if (fs::is_directory(given, ec)) {
    const fs::path file = given / "metrics.jsonl";
    LOOM_CHECK_AS(ConfigError, fs::exists(file, ec), "run folder ", quoted(given),
                  " has no metrics.jsonl; give a run's output_dir (where loom run writes it) or "
                  "the metrics.jsonl file itself");
    return file;
  }
  LOOM_CHECK_AS(ConfigError, fs::exists(given, ec), quoted(given),
                ": no such run folder or metrics.jsonl file");
  return given;
}

Run read_run(const fs::path& given) {
  Run run;
  run.file = metrics_file_of(given);
  std::ifstream in(run.file);
  LOOM_CHECK_AS(ConfigError, in.good(), "cannot read ", quoted(run.file));
  // Per metric, step -> value; a later line for a step replaces an earlier one.
  std::map<std::string, std::map<double, double>> points;
  int64_t line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = detail::cat(run.file.string(), ":", line_number);
    nlohmann::ordered_json row;
    try {
      row = nlohmann::ordered_json::parse(line);
    } catch (const nlohmann::ordered_json::parse_error& error) {
      throw ConfigError(detail::cat(where, ": not a JSON line (byte ", error.byte,
                                    "); metrics.jsonl holds one JSON object per line"));
    }
    LOOM_CHECK_AS(ConfigError, row.is_object(), where,
                  ": not a JSON object; metrics.jsonl holds one JSON object per line");
    const auto step = row.find("step");
    LOOM_CHECK_AS(ConfigError, step != row.end() && step->is_number(), where,
                  ": no \"step\" number; every line of metrics.jsonl has one");
    const double at = step->get<double>();
    for (const auto& [key, value] : row.items()) {
      if (key == "step") continue;
      const std::optional<double> number = number_of(value);
      if (!number) continue;
      auto [metric, fresh] = points.try_emplace(key);
      if (fresh) run.metric_names.push_back(key);
      if (std::isfinite(*number))
        metric->second[at] = *number;
      else
        metric->second.erase(at);
    }
  }
  LOOM_CHECK_AS(ConfigError, !in.bad(), "reading ", quoted(run.file), " failed");
  for (auto& [key, by_step] : points) {
    Series& series = run.series[key];
    for (const auto& [at, value] : by_step) {
      series.steps.push_back(at);
      series.values.push_back(value);
    }
  }
  return run;
}

// The legend's names: each run's folder name, or the path as given where two folders share one
// (runs/a/out and runs/b/out).
void name_runs(std::vector<Run>& runs, const std::vector<fs::path>& given) {
  std::map<std::string, int> uses;
  for (size_t i = 0; i < runs.size(); ++i) {
    std::error_code ec;
    fs::path folder = fs::weakly_canonical(fs::absolute(runs[i].file.parent_path()), ec);
    if (ec) folder = runs[i].file.parent_path();
    runs[i].name = folder.filename().string();
    if (runs[i].name.empty()) runs[i].name = given[i].string();
    ++uses[runs[i].name];
  }
  for (size_t i = 0; i < runs.size(); ++i)
    if (uses[runs[i].name] > 1) runs[i].name = given[i].string();
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

std::vector<std::string> chosen_metrics(const Options& options, const std::vector<Run>& runs) {
  std::vector<std::string> present;
  std::set<std::string> seen;
  for (const Run& run : runs)
    for (const auto& name : run.metric_names)
      if (seen.insert(name).second) present.push_back(name);
  std::vector<std::string> chosen;
  if (options.metrics.empty()) {
    for (const char* name : {"loss", "eval_loss", "lr"})
      if (seen.count(name)) chosen.push_back(name);
    LOOM_CHECK_AS(ConfigError, !chosen.empty(), "no run has loss, eval_loss or lr; ",
                  present.empty() ? std::string("the runs have no metrics at all")
                                  : "pick from what they have with --metrics: " + joined(present));
    return chosen;
  }
  for (const auto& name : options.metrics) {
    LOOM_CHECK_AS(ConfigError, seen.count(name), "no run has the metric '", name, "'; ",
                  present.empty() ? std::string("the runs have no metrics at all")
                                  : "the runs have: " + joined(present));
    if (std::find(chosen.begin(), chosen.end(), name) == chosen.end()) chosen.push_back(name);
  }
  return chosen;
}

// XML text: the five special characters escaped; control characters, which XML 1.0 forbids,
// and bytes that are not UTF-8 (a folder name may hold any) become '?'.
std::string xml_text(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    // The sequence's length by its lead byte; 0 for a byte no sequence starts with.
    const size_t length = c < 0x80            ? 1
                          : (c >> 5) == 0x6   ? 2
                          : (c >> 4) == 0xE   ? 3
                          : (c >> 3) == 0x1E  ? 4
                                              : 0;
    bool valid = length > 0 && i + length <= text.size();
    for (size_t k = 1; valid && k < length; ++k)
      valid = (static_cast<unsigned char>(text[i + k]) & 0xC0) == 0x80;
    if (!valid) {
      out += '?';
      ++i;
      continue;
    }
    if (length > 1) {
      out.append(text, i, length);
    } else if (c == '&') {
      out += "&amp;";
    } else if (c == '<') {
      out += "&lt;";
    } else if (c == '>') {
      out += "&gt;";
    } else if (c == '"') {
      out += "&quot;";
    } else if (c == '\'') {
      out += "&apos;";
    } else {
      out += c < 0x20 && c != '\t' ? '?' : static_cast<char>(c);
    }
    i += length;
  }
  return out;
}

std::string fixed(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", value);
  return text;
}

// 1, 2 or 5 times a power of ten, near `rough`.
double nice_step(double rough) {
  const double power = std::pow(10.0, std::floor(std::log10(rough)));
  const double fraction = rough / power;
  return (fraction < 1.5 ? 1 : fraction < 3 ? 2 : fraction < 7 ? 5 : 10) * power;
}

// A tick's label with the digits that tell neighbouring ticks apart, and no more.
std::string tick_label(double value, double step) {
  if (std::abs(value) < step * 1e-6) return "0";
  char text[32];
  const int decimals = static_cast<int>(std::max(0.0, -std::floor(std::log10(step) + 1e-9)));
  if (decimals <= 6 && std::abs(value) < 1e7) {
    std::snprintf(text, sizeof text, "%.*f", decimals, value);
  } else {
    const int digits = static_cast<int>(std::floor(std::log10(std::abs(value))) -
                                        std::floor(std::log10(step) + 1e-9)) + 1;
    std::snprintf(text, sizeof text, "%.*g", std::clamp(digits, 1, 15), value);
  }
  return text;
}

Range padded(double lo, double hi) {
  if (lo < hi) return {lo, hi};
  const double pad = lo == 0 ? 1 : std::abs(lo) * 0.1;
  return {lo - pad, hi + pad};
}

std::vector<double> ticks(const Range& range, double step) {
  std::vector<double> out;
  for (double k = std::ceil(range.lo / step - 1e-9); k * step <= range.hi + step * 1e-9; ++k)
    out.push_back(k * step);
  return out;
}

// The elements of the page, in drawing order; document() wraps them in the <svg> root once the
// height is known (the legend's rows decide it).
class Canvas {
 public:
  void line(double x1, double y1, double x2, double y2, const std::string& style) {
    svg_ += "<line x1=\"" + fixed(x1) + "\" y1=\"" + fixed(y1) + "\" x2=\"" + fixed(x2) +
            "\" y2=\"" + fixed(y2) + "\" " + style + "/>\n";
  }
  void text(double x, double y, const std::string& content, const std::string& style) {
    svg_ += "<text x=\"" + fixed(x) + "\" y=\"" + fixed(y) + "\" " + style + ">" + content +
            "</text>\n";
  }
  void raw(const std::string& markup) { svg_ += markup; }

  std::string document(double height, const std::string& title) const {
    const std::string w = std::to_string(static_cast<int>(kWidth));
    const std::string h = std::to_string(static_cast<int>(std::ceil(height)));
    return "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
           "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + w + "\" height=\"" + h +
           "\" viewBox=\"0 0 " + w + " " + h +
           "\" font-family=\"sans-serif\" font-size=\"12\">\n<title>" + title +
           "</title>\n<rect width=\"" + w + "\" height=\"" + h + "\" fill=\"white\"/>\n" + svg_ +
           "</svg>\n";
  }

 private:
  std::string svg_;
};

// The legend, wrapped into rows across the page; returns its height.
double draw_legend(Canvas& canvas, const std::vector<Run>& runs) {
  double x = kLeft, y = kLegendTop + kLegendRow / 2;
  for (size_t i = 0; i < runs.size(); ++i) {
    // A name's width, guessed at 7 units a character of a 12-unit sans-serif font.
    const double width = 28 + 7.0 * static_cast<double>(runs[i].name.size()) + 18;
    if (x > kLeft && x + width > kWidth - kRight) {
      x = kLeft;
      y += kLegendRow;
    }
    const std::string colour = kColours[i % std::size(kColours)];
    canvas.raw("<g class=\"legend-entry\">\n");
    canvas.line(x, y, x + 22, y, "stroke=\"" + colour + "\" stroke-width=\"2.5\"");
    canvas.text(x + 28, y, xml_text(runs[i].name), "dominant-baseline=\"middle\"");
    canvas.raw("</g>\n");
    x += width;
  }
  return y + kLegendRow / 2 + 6;
}

struct Panel {
  double top = 0;
  Range x, y;
};

double to_x(const Panel& panel, double step) {
  return kLeft + (step - panel.x.lo) / (panel.x.hi - panel.x.lo) * (kWidth - kLeft - kRight);
}
double to_y(const Panel& panel, double value) {
  const double bottom = panel.top + kPanelTitle + kPlotHeight;
  return bottom - (value - panel.y.lo) / (panel.y.hi - panel.y.lo) * kPlotHeight;
}

std::string path_data(const Panel& panel, const std::vector<double>& steps,
                      const std::vector<double>& values) {
  std::string d;
  for (size_t i = 0; i < steps.size(); ++i)
    d += (i ? " L" : "M") + fixed(to_x(panel, steps[i])) + "," + fixed(to_y(panel, values[i]));
  return d;
}

void draw_axes(Canvas& canvas, const Panel& panel, const std::string& title, bool last) {
  const double top = panel.top + kPanelTitle, bottom = top + kPlotHeight;
  const double right = kWidth - kRight;
  canvas.text(kLeft, panel.top + 20, title, "class=\"title\" font-weight=\"bold\"");
  const double y_step = nice_step((panel.y.hi - panel.y.lo) / 5);
  for (double value : ticks(panel.y, y_step)) {
    const double y = to_y(panel, value);
    canvas.line(kLeft, y, right, y, "stroke=\"#e6e6e6\"");
    canvas.text(kLeft - 6, y, tick_label(value, y_step),
                "text-anchor=\"end\" dominant-baseline=\"middle\" fill=\"#444\"");
  }
  const double x_step = nice_step((panel.x.hi - panel.x.lo) / 8);
  for (double step : ticks(panel.x, x_step)) {
    const double x = to_x(panel, step);
    canvas.line(x, top, x, bottom, "stroke=\"#e6e6e6\"");
    canvas.text(x, bottom + 16, tick_label(step, x_step), "text-anchor=\"middle\" fill=\"#444\"");
  }
  canvas.raw("<rect class=\"plot-area\" x=\"" + fixed(kLeft) + "\" y=\"" + fixed(top) +
             "\" width=\"" + fixed(right - kLeft) + "\" height=\"" + fixed(kPlotHeight) +
             "\" fill=\"none\" stroke=\"#999\"/>\n");
  if (last) canvas.text((kLeft + right) / 2, bottom + 34, "step", "text-anchor=\"middle\"");
}

// One metric's panel: its y axis fitted to every run's values, then each run's curve; returns
// the curves drawn.
int draw_panel(Canvas& canvas, Panel& panel, const std::vector<Run>& runs,
               const std::string& metric, double smooth, bool last) {
  double lo = INFINITY, hi = -INFINITY;
  for (const Run& run : runs)
    if (auto it = run.series.find(metric); it != run.series.end())
      for (double value : it->second.values) {
        lo = std::min(lo, value);
        hi = std::max(hi, value);
      }
  const bool empty = lo > hi;
  if (!empty) {
    const Range values = padded(lo, hi);
    const double step = nice_step((values.hi - values.lo) / 5);
    panel.y = {std::floor(values.lo / step + 1e-9) * step,
               std::ceil(values.hi / step - 1e-9) * step};
  }
  std::string title = xml_text(metric);
  if (smooth > 0)
    title += detail::cat(" <tspan fill=\"#777\" font-weight=\"normal\">(smoothed, weight ", smooth,
                         ")</tspan>");
  canvas.raw("<g class=\"panel\" data-metric=\"" + xml_text(metric) + "\">\n");
  draw_axes(canvas, panel, title, last);
  if (empty)
    canvas.text((kLeft + kWidth - kRight) / 2, panel.top + kPanelTitle + kPlotHeight / 2,
                "no finite values", "class=\"empty\" text-anchor=\"middle\" fill=\"#999\"");
  int curves = 0;
  for (size_t r = 0; r < runs.size(); ++r) {
    const auto it = runs[r].series.find(metric);
    if (it == runs[r].series.end() || it->second.steps.empty()) continue;
    const Series& series = it->second;
    ++curves;
    const std::string colour = kColours[r % std::size(kColours)];
    const std::string common = "data-run=\"" + xml_text(runs[r].name) + "\" data-metric=\"" +
                               xml_text(metric) + "\" fill=\"none\" stroke=\"" + colour +
                               "\" stroke-linejoin=\"round\"";
    const std::vector<double> values =
        smooth > 0 ? smooth_values(series.values, smooth) : series.values;
    if (smooth > 0)
      canvas.raw("<path class=\"raw\" " + common +
                 " stroke-width=\"1\" stroke-opacity=\"0.3\" d=\"" +
                 path_data(panel, series.steps, series.values) + "\"/>\n");
    canvas.raw(std::string("<path class=\"curve") + (smooth > 0 ? " smoothed" : "") + "\" " +
               common + " stroke-width=\"1.8\" d=\"" + path_data(panel, series.steps, values) +
               "\"/>\n");
    if (series.steps.size() <= kMarkedPoints)
      for (size_t i = 0; i < series.steps.size(); ++i)
        canvas.raw("<circle class=\"marker\" cx=\"" + fixed(to_x(panel, series.steps[i])) +
                   "\" cy=\"" + fixed(to_y(panel, values[i])) + "\" r=\"2.5\" fill=\"" + colour +
                   "\"/>\n");
  }
  canvas.raw("</g>\n");
  return curves;
}

}  // namespace

std::vector<double> smooth_values(const std::vector<double>& values, double weight) {
  // TensorBoard keeps a constant series as it is (debiasing would only add rounding).
  if (std::all_of(values.begin(), values.end(), [&](double v) { return v == values.front(); }))
    return values;
  std::vector<double> out;
  out.reserve(values.size());
  double last = 0;
  for (size_t n = 1; n <= values.size(); ++n) {
    last = last * weight + (1 - weight) * values[n - 1];
    out.push_back(last / (1 - std::pow(weight, static_cast<double>(n))));
  }
  return out;
}

Summary write_svg(const Options& options) {
  LOOM_CHECK_AS(ConfigError, !options.runs.empty(),
                "loom plot needs at least one run folder: loom plot runs/a [runs/b ...] --out "
                "curves.svg");
  LOOM_CHECK_AS(ConfigError, !options.out.empty(),
                "loom plot needs --out FILE.svg: loom plot runs/a --out curves.svg");
  LOOM_CHECK_AS(ConfigError, options.smooth >= 0 && options.smooth < 1,
                "--smooth takes a weight in [0, 1), as TensorBoard's smoothing (0.6, say), got ",
                options.smooth);
  std::error_code ec;
  const fs::path folder = options.out.has_parent_path() ? options.out.parent_path() : ".";
  LOOM_CHECK_AS(ConfigError, fs::is_directory(folder, ec), "--out ", quoted(options.out),
                ": the folder ", quoted(folder), " does not exist; create it first");
  LOOM_CHECK_AS(ConfigError, !fs::is_directory(options.out, ec), "--out ", quoted(options.out),
                " is a folder; name the SVG file to write");

  std::vector<Run> runs;
  for (const auto& given : options.runs) runs.push_back(read_run(given));
  name_runs(runs, options.runs);
  Summary summary;
  summary.metrics = chosen_metrics(options, runs);
  for (const Run& run : runs) summary.runs.push_back(run.name);

  // One x axis for every panel: the steps of everything drawn.
  double first = INFINITY, last = -INFINITY;
  for (const Run& run : runs)
    for (const auto& metric : summary.metrics)
      if (auto it = run.series.find(metric); it != run.series.end() && !it->second.steps.empty()) {
        first = std::min(first, it->second.steps.front());
        last = std::max(last, it->second.steps.back());
      }
  const Range x_range = first <= last ? padded(first, last) : Range{};

  Canvas body;
  const double legend_height = draw_legend(body, runs);
  for (size_t m = 0; m < summary.metrics.size(); ++m) {
    Panel panel;
    panel.top = legend_height + static_cast<double>(m) * kPanelHeight;
    panel.x = x_range;
    summary.curves += draw_panel(body, panel, runs, summary.metrics[m], options.smooth,
                                 m + 1 == summary.metrics.size());
  }
  const double height = legend_height + static_cast<double>(summary.metrics.size()) * kPanelHeight;
  fsutil::write_file_atomic(options.out,
                            body.document(height, xml_text("loom plot: " + joined(summary.runs))));
  return summary;
}

}  // namespace loom::plot
