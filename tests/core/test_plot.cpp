// Note [Curves]: `loom plot` draws metrics.jsonl as SVG. Python's xml.etree, an independent
// parser, reads every file back: the root, one class="curve" path per (run, metric) with a point
// per finite value, every point inside the viewBox and the steps on the shared x axis. The
// smoothing is checked against TensorBoard's debiased EMA worked by hand, and every bad input is
// an error naming it that writes nothing.
#include <gtest/gtest.h>
#include <stdio.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "loom/plot.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::TempDir;

// A folder name with every character XML escapes.
const std::string kOddName = "beta & <gamma> \"q\" 'a'";

// Two runs: alpha trains steps 1-6 (step 3's loss written as null, step 4's as "NaN": the ways
// metrics.jsonl says NaN) and evaluates at 3 and 6; beta trains steps 2-8 and evaluates at 4, 8.
struct TwoRuns {
  TempDir dir;
  fs::path alpha = dir / "alpha", beta = dir / kOddName;
  std::map<std::string, std::vector<std::pair<double, double>>> alpha_points, beta_points;

  TwoRuns() {
    fs::create_directories(alpha);
    fs::create_directories(beta);
    std::ofstream a(alpha / "metrics.jsonl");
    for (int step = 1; step <= 6; ++step) {
      const double loss = 5.0 - 0.5 * step, lr = 1e-3 * step;
      const std::string written = step == 3 ? "null" : step == 4 ? "\"NaN\"" : std::to_string(loss);
      a << "{\"step\":" << step << ",\"loss\":" << written << ",\"lr\":" << lr
        << ",\"grad_norm\":1.5}\n";
      if (step != 3 && step != 4) alpha_points["loss"].push_back({step, loss});
      alpha_points["lr"].push_back({step, lr});
      if (step % 3 == 0) {
        a << "{\"step\":" << step << ",\"eval_loss\":" << 4.0 - 0.25 * step << "}\n";
        alpha_points["eval_loss"].push_back({step, 4.0 - 0.25 * step});
      }
    }
    std::ofstream b(beta / "metrics.jsonl");
    for (int step = 2; step <= 8; ++step) {
      const double loss = 6.0 - 0.4 * step + (step % 2) * 0.3, lr = 5e-4;
      b << "{\"step\":" << step << ",\"loss\":" << loss << ",\"lr\":" << lr << "}\n";
      beta_points["loss"].push_back({step, loss});
      beta_points["lr"].push_back({step, lr});
      if (step % 4 == 0) {
        b << "{\"step\":" << step << ",\"eval_loss\":" << 3.5 - 0.1 * step << "}\n";
        beta_points["eval_loss"].push_back({step, 3.5 - 0.1 * step});
      }
    }
  }
};

// What Python's xml.etree reads in an SVG file: the root, the legend, each panel's plot area and
// its paths' classes, runs and points (a path is "M x,y L x,y ..." and nothing else).
json read_svg(const fs::path& file) {
  const std::string out = test::run_python(R"py(
import json, re, sys, xml.etree.ElementTree as ET
ns = "{http://www.w3.org/2000/svg}"
root = ET.parse(r""")py" + file.string() + R"py(""").getroot()
point = r"(-?[0-9.]+),(-?[0-9.]+)"
svg = {"tag": root.tag, "width": root.get("width"), "height": root.get("height"),
       "viewBox": [float(v) for v in root.get("viewBox").split()], "panels": [],
       "legend": [g.find(ns + "text").text for g in root.iter(ns + "g")
                  if g.get("class") == "legend-entry"]}
for g in root.iter(ns + "g"):
    if g.get("class") != "panel":
        continue
    area = next(r for r in g.iter(ns + "rect") if r.get("class") == "plot-area")
    panel = {"metric": g.get("data-metric"), "paths": [],
             "area": [float(area.get(k)) for k in ("x", "y", "width", "height")]}
    for p in g.iter(ns + "path"):
        d = p.get("d")
        assert re.fullmatch("M" + point + "( L" + point + ")*", d), d
        panel["paths"].append({"class": p.get("class").split(), "run": p.get("data-run"),
                               "metric": p.get("data-metric"),
                               "points": [[float(x), float(y)] for x, y in re.findall(point, d)]})
    svg["panels"].append(panel)
print(json.dumps(svg))
)py");
  return json::parse(out.substr(out.rfind('\n', out.size() - 2) + 1));
}

bool has_class(const json& path, const std::string& name) {
  const auto classes = path["class"].get<std::vector<std::string>>();
  return std::find(classes.begin(), classes.end(), name) != classes.end();
}

TEST(Plot, OneCurvePerRunAndMetricWithAPointPerFiniteValue) {
  TwoRuns runs;
  plot::Options options;
  options.runs = {runs.alpha, runs.beta / "metrics.jsonl"};  // a folder, and a file
  options.out = runs.dir / "curves.svg";
  const plot::Summary summary = plot::write_svg(options);
  EXPECT_EQ(summary.metrics, (std::vector<std::string>{"loss", "eval_loss", "lr"}));
  EXPECT_EQ(summary.runs, (std::vector<std::string>{"alpha", kOddName}));
  EXPECT_EQ(summary.curves, 6);

  const json svg = read_svg(options.out);
  EXPECT_EQ(svg["tag"], "{http://www.w3.org/2000/svg}svg");
  const auto box = svg["viewBox"].get<std::vector<double>>();
  ASSERT_EQ(box.size(), 4u);
  EXPECT_EQ(box[0], 0);
  EXPECT_EQ(box[1], 0);
  EXPECT_EQ(std::stod(svg["width"].get<std::string>()), box[2]);
  EXPECT_EQ(std::stod(svg["height"].get<std::string>()), box[3]);
  EXPECT_EQ(svg["legend"], json({"alpha", kOddName}));  // escaped, and read back as it was
  ASSERT_EQ(svg["panels"].size(), 3u);
  // One x axis for all panels: from the first step drawn (alpha's 1) to the last (beta's 8).
  const double first_step = 1, last_step = 8;
  for (const json& panel : svg["panels"]) {
    const std::string metric = panel["metric"];
    const auto area = panel["area"].get<std::vector<double>>();
    int curves = 0;
    for (const json& path : panel["paths"]) {
      EXPECT_TRUE(has_class(path, "curve"));
      EXPECT_EQ(path["metric"], metric);
      ++curves;
      const auto& expected =
          path["run"] == "alpha" ? runs.alpha_points.at(metric) : runs.beta_points.at(metric);
      const auto points = path["points"].get<std::vector<std::vector<double>>>();
      ASSERT_EQ(points.size(), expected.size()) << metric << " of " << path["run"];
      for (size_t i = 0; i < points.size(); ++i) {
        const double x = points[i][0], y = points[i][1];
        const double step_x =
            area[0] + (expected[i].first - first_step) / (last_step - first_step) * area[2];
        EXPECT_NEAR(x, step_x, 0.006) << metric << " step " << expected[i].first;
        EXPECT_GE(x, box[0]);
        EXPECT_LE(x, box[0] + box[2]);
        EXPECT_GE(y, area[1] - 0.006) << metric;
        EXPECT_LE(y, area[1] + area[3] + 0.006) << metric;
      }
      // Larger values higher up (SVG's y grows downwards).
      for (size_t i = 1; i < points.size(); ++i) {
        if (expected[i].second != expected[i - 1].second) {
          EXPECT_EQ(points[i][1] < points[i - 1][1], expected[i].second > expected[i - 1].second);
        }
      }
    }
    EXPECT_EQ(curves, 2) << metric;
    // The first and the last step drawn sit on the panel's edges.
    const json& alpha = panel["paths"][0];
    const json& beta = panel["paths"][1];
    if (metric != "eval_loss") {
      EXPECT_NEAR(alpha["points"][0][0].get<double>(), area[0], 0.006);
    }
    EXPECT_NEAR(beta["points"].back()[0].get<double>(), area[0] + area[2], 0.006);
  }
}

TEST(Plot, SmoothingIsTensorBoardsDebiasedMovingAverage) {
  // last = 0.6 last + 0.4 v over 1, 3, 2, 5, 4, divided by 1 - 0.6^n: worked out as fractions.
  const std::vector<double> smoothed = plot::smooth_values({1, 3, 2, 5, 4}, 0.6);
  const std::vector<double> by_hand = {1.0, 9.0 / 4, 104.0 / 49, 937.0 / 272, 5311.0 / 1441};
  ASSERT_EQ(smoothed.size(), by_hand.size());
  for (size_t i = 0; i < by_hand.size(); ++i) EXPECT_NEAR(smoothed[i], by_hand[i], 1e-12) << i;
  EXPECT_EQ(plot::smooth_values({2.5, 2.5, 2.5}, 0.9), (std::vector<double>{2.5, 2.5, 2.5}));
  EXPECT_EQ(plot::smooth_values({1, 7, 3}, 0.0), (std::vector<double>{1, 7, 3}));

  // Drawn: per run and metric one faint raw path and one smoothed curve, on one scale.
  TwoRuns runs;
  plot::Options options;
  options.runs = {runs.alpha, runs.beta};
  options.metrics = {"loss"};
  options.smooth = 0.6;
  options.out = runs.dir / "smooth.svg";
  EXPECT_EQ(plot::write_svg(options).curves, 2);
  const json svg = read_svg(options.out);
  ASSERT_EQ(svg["panels"].size(), 1u);
  const json& paths = svg["panels"][0]["paths"];
  ASSERT_EQ(paths.size(), 4u);
  for (const std::string run : {"alpha", kOddName.c_str()}) {
    const json *raw = nullptr, *curve = nullptr;
    for (const json& path : paths)
      if (path["run"] == run) (has_class(path, "curve") ? curve : raw) = &path;
    ASSERT_TRUE(raw && curve) << run;
    EXPECT_TRUE(has_class(*raw, "raw"));
    EXPECT_TRUE(has_class(*curve, "smoothed"));
    const auto& points = run == "alpha" ? runs.alpha_points["loss"] : runs.beta_points["loss"];
    std::vector<double> values;
    for (const auto& [step, value] : points) values.push_back(value);
    const std::vector<double> expected = plot::smooth_values(values, 0.6);
    // The raw path fixes the panel's scale, y = a - b v; the curve must be the EMA on it.
    const auto raw_points = (*raw)["points"].get<std::vector<std::vector<double>>>();
    const auto curve_points = (*curve)["points"].get<std::vector<std::vector<double>>>();
    ASSERT_EQ(raw_points.size(), values.size());
    ASSERT_EQ(curve_points.size(), values.size());
    const size_t lo = std::min_element(values.begin(), values.end()) - values.begin();
    const size_t hi = std::max_element(values.begin(), values.end()) - values.begin();
    const double b = (raw_points[lo][1] - raw_points[hi][1]) / (values[hi] - values[lo]);
    const double a = raw_points[lo][1] + b * values[lo];
    for (size_t i = 0; i < values.size(); ++i) {
      EXPECT_NEAR(curve_points[i][0], raw_points[i][0], 1e-9);
      EXPECT_NEAR(curve_points[i][1], a - b * expected[i], 0.03) << run << " point " << i;
    }
  }
}

// The bad inputs: each a ConfigError naming it, nothing written, an older file left as it was.
TEST(Plot, BadInputIsAnErrorNamingItAndWritesNothing) {
  TwoRuns runs;
  const fs::path out = runs.dir / "curves.svg";
  const fs::path empty_run = runs.dir / "no-metrics";
  fs::create_directories(empty_run);
  const fs::path broken = runs.dir / "broken";
  fs::create_directories(broken);
  std::ofstream(broken / "metrics.jsonl") << "{\"step\":1,\"loss\":2.0}\n\n{\"step\":2,\"loss\":\n";
  const fs::path stepless = runs.dir / "stepless";
  fs::create_directories(stepless);
  std::ofstream(stepless / "metrics.jsonl") << "[1, 2]\n";

  auto options = [&](std::vector<fs::path> dirs, fs::path file = {}) {
    plot::Options o;
    o.runs = std::move(dirs);
    o.out = file.empty() ? out : file;
    return o;
  };
  const auto before = test::list_files(runs.dir.path());
  EXPECT_THROW_WITH(plot::write_svg(options({runs.alpha, empty_run})), ConfigError,
                    empty_run.string(), "has no metrics.jsonl");
  EXPECT_THROW_WITH(plot::write_svg(options({runs.dir / "nowhere"})), ConfigError,
                    (runs.dir / "nowhere").string(), "no such run folder");
  EXPECT_THROW_WITH(plot::write_svg(options({runs.alpha, broken})), ConfigError,
                    (broken / "metrics.jsonl").string() + ":3: not a JSON line");
  EXPECT_THROW_WITH(plot::write_svg(options({stepless})), ConfigError,
                    (stepless / "metrics.jsonl").string() + ":1: not a JSON object");
  plot::Options unknown = options({runs.alpha, runs.beta});
  unknown.metrics = {"loss", "eval_accuracy"};
  EXPECT_THROW_WITH(plot::write_svg(unknown), ConfigError,
                    "no run has the metric 'eval_accuracy'",
                    "the runs have: loss, lr, grad_norm, eval_loss");
  plot::Options no_out = options({runs.alpha});
  no_out.out.clear();
  EXPECT_THROW_WITH(plot::write_svg(no_out), ConfigError, "needs --out");
  for (double weight : {1.0, -0.1, 1.5}) {
    plot::Options smooth = options({runs.alpha});
    smooth.smooth = weight;
    EXPECT_THROW_WITH(plot::write_svg(smooth), ConfigError, "--smooth takes a weight in [0, 1)");
  }
  EXPECT_THROW_WITH(plot::write_svg(options({runs.alpha}, runs.dir / "missing" / "c.svg")),
                    ConfigError, (runs.dir / "missing").string(), "does not exist");
  EXPECT_EQ(test::list_files(runs.dir.path()), before);

  // A file from an earlier plot is kept whole when the next one fails.
  std::ofstream(out) << "earlier";
  EXPECT_THROW_WITH(plot::write_svg(options({runs.alpha, broken})), ConfigError, ":3:");
  EXPECT_EQ(test::read_text(out), "earlier");
}

// Runs a command; its exit status and its stdout and stderr together.
std::pair<int, std::string> run_status(const std::string& command) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return {-1, ""};
  std::string out;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// A path as one shell word (the odd run name holds quotes of both kinds).
std::string quoted(const fs::path& path) {
  std::string out = "'";
  for (char c : path.string()) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

TEST(Plot, TheLoomCommandWritesTheFileOrOneErrorLine) {
  TwoRuns runs;
  const fs::path out = runs.dir / "cli.svg";
  const std::string loom = LOOM_TEST_CLI;
  auto [rc, text] = run_status(loom + " plot " + quoted(runs.alpha) + " " + quoted(runs.beta) +
                               " --metrics loss,lr --smooth 0.5 --out " + quoted(out));
  EXPECT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("wrote " + out.string()), std::string::npos) << text;
  const json svg = read_svg(out);
  ASSERT_EQ(svg["panels"].size(), 2u);
  EXPECT_EQ(svg["panels"][1]["metric"], "lr");

  const fs::path nowhere = runs.dir / "missing" / "c.svg";
  std::tie(rc, text) =
      run_status(loom + " plot " + quoted(runs.alpha) + " --out " + quoted(nowhere));
  EXPECT_EQ(rc, 1) << text;
  // One line, the last (a CPU probe's warning may come before it on some machines).
  const size_t error_line = text.find("loom: error: ");
  EXPECT_EQ(text.find('\n', error_line), text.size() - 1) << text;
  EXPECT_EQ(text.find("loom: error: --out "), error_line) << text;
  EXPECT_NE(text.find("does not exist"), std::string::npos) << text;
  std::tie(rc, text) = run_status(loom + " plot " + quoted(runs.alpha));
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(text.find("needs --out"), std::string::npos) << text;
  std::tie(rc, text) = run_status(loom + " plot " + quoted(runs.alpha) + " --smooth 1 --out x.svg");
  EXPECT_EQ(rc, 1) << text;
  EXPECT_NE(text.find("--smooth takes a weight in [0, 1)"), std::string::npos) << text;
  EXPECT_FALSE(fs::exists(nowhere));
}

}  // namespace
}  // namespace loom
