// The model plugins' interop tests (tests/plugins/{gpt,bert,llama}): running a reference script
// of transformers and PEFT in the venv, reading what it wrote, and comparing with loom.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "loom/engine.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/safetensors.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom::test::hf {

// Runs the reference script tests/plugins/SCRIPT (e.g. "gpt/gpt_hf.py") with `args`, a Python
// list literal of its arguments.
inline void run_script(const std::string& script, const std::string& args) {
  const std::string path = std::string(LOOM_SOURCE_DIR) + "/tests/plugins/" + script;
  run_python("import runpy, sys\nsys.argv = ['" + script + "'] + " + args + "\nrunpy.run_path('" +
             path + "', run_name='__main__')\n");
}

// Runs SCRIPT once per element of `each_args` in one Python process: each run executes the whole
// script afresh (its seeding included), so it writes what separate runs would, while transformers
// is imported once (~10 s of CPU each time on the test machines).
inline void run_script_each(const std::string& script, const std::vector<std::string>& each_args) {
  const std::string path = std::string(LOOM_SOURCE_DIR) + "/tests/plugins/" + script;
  std::string code = "import runpy, sys\n";
  for (const auto& args : each_args)
    code += "sys.argv = ['" + script + "'] + " + args + "\nrunpy.run_path('" + path +
            "', run_name='__main__')\n";
  run_python(code);
}

// Runs the example job examples/EXAMPLE (the file a user copies, as written) on the model
// folder `folder` for `steps` steps into `output_dir`, with `overrides` for a tiny test model.
inline RunSummary run_example(const std::string& example, const std::filesystem::path& folder,
                              const std::filesystem::path& output_dir, int steps,
                              std::vector<std::string> overrides = {}) {
  const std::filesystem::path file = std::filesystem::path(LOOM_SOURCE_DIR) / "examples" / example;
  overrides.push_back("model.from_pretrained=\"" + folder.string() + "\"");
  overrides.push_back("train.output_dir=\"" + output_dir.string() + "\"");
  overrides.push_back("train.max_steps=" + std::to_string(steps));
  overrides.push_back("train.log_level=\"warn\"");
  return Trainer::from_file(file, overrides)->run();
}

inline std::map<std::string, at::Tensor> load(const std::filesystem::path& file) {
  auto contents = safetensors::load(file);
  return {contents.tensors.begin(), contents.tensors.end()};
}

// The model's logits for `ids` (B,T), in eval mode, without gradients.
inline at::Tensor logits_of(Engine& engine, const at::Tensor& ids) {
  at::NoGradGuard no_grad;
  engine.model().eval();
  Batch batch;
  batch.input_ids = ids;
  return engine.model().forward(batch).logits.clone();
}

inline void expect_close(const at::Tensor& a, const at::Tensor& b, double tol) {
  ASSERT_EQ(a.sizes(), b.sizes());
  const double diff = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  EXPECT_LE(diff, tol) << "max |difference| " << diff;
}

// An exported `folder` and the engine whose model it holds; `scratch` holds the files between
// loom and the reference script.
struct ExportedModel {
  Engine* engine;
  std::filesystem::path folder, scratch;
  std::string label = "";  // what a failure names (else the folder)
};

// transformers' logits of each exported folder (the reference script's `logits` mode) equal
// its engine's model's on the same ids (below the vocabulary `vocab`) within 1e-5; all the
// folders in one Python process (run_script_each), so transformers is imported once.
inline void expect_exports_give_looms_logits(const std::string& script,
                                             const std::vector<ExportedModel>& exports,
                                             int64_t vocab = 64) {
  const at::Tensor ids = (at::arange(32, at::kLong) * 5 % vocab).view({2, 16});
  std::vector<std::string> each_args;
  for (const ExportedModel& e : exports) {
    safetensors::save(e.scratch / "ids.safetensors", {{"input_ids", ids}});
    each_args.push_back("['logits', '" + e.folder.string() + "', '" +
                        (e.scratch / "ids.safetensors").string() + "', '" +
                        (e.scratch / "hf_logits.safetensors").string() + "']");
  }
  run_script_each(script, each_args);
  for (const ExportedModel& e : exports) {
    SCOPED_TRACE(e.label.empty() ? e.folder.string() : e.label);
    expect_close(logits_of(*e.engine, ids), load(e.scratch / "hf_logits.safetensors").at("logits"),
                 1e-5);
  }
}

// The same for one exported folder.
inline void expect_export_gives_looms_logits(Engine& engine, const std::string& script,
                                             const std::filesystem::path& folder,
                                             const std::filesystem::path& scratch,
                                             int64_t vocab = 64) {
  expect_exports_give_looms_logits(script, {{&engine, folder, scratch}}, vocab);
}

inline void expect_same_ids(const std::vector<int64_t>& ids, const at::Tensor& expected) {
  ASSERT_EQ(static_cast<int64_t>(ids.size()), expected.numel());
  for (size_t i = 0; i < ids.size(); ++i)
    EXPECT_EQ(ids[i], expected[static_cast<int64_t>(i)].item<int64_t>()) << "token " << i;
}

// Runs `trainer` (5 steps, metrics in `dir`), recording its batches; the reference script's
// `train` mode trains the pretrained `folder` on the same batches with torch AdamW; the 5
// losses agree within 1e-5.
inline void expect_fine_tune_follows_reference(Trainer& trainer, const std::string& script,
                                               const std::filesystem::path& folder,
                                               const std::filesystem::path& dir) {
  NamedTensors batches;
  int step = 0;
  trainer.engine().on(Event::before_forward, [&](Engine& engine) {
    batches.emplace_back("input_ids." + std::to_string(step), engine.batch().input_ids.clone());
    batches.emplace_back("labels." + std::to_string(step), engine.batch().labels.clone());
    ++step;
  });
  trainer.run();
  ASSERT_EQ(step, 5);
  safetensors::save(dir / "batches.safetensors", batches);
  run_script(script, "['train', '" + folder.string() + "', '" +
                         (dir / "batches.safetensors").string() + "', '" +
                         (dir / "losses.safetensors").string() + "']");
  const at::Tensor expected = load(dir / "losses.safetensors").at("losses");
  std::ifstream metrics(dir / "metrics.jsonl");
  int i = 0;
  for (std::string line; std::getline(metrics, line); ++i) {
    const auto at = line.find("\"loss\":");
    ASSERT_NE(at, std::string::npos);
    EXPECT_NEAR(std::stod(line.substr(at + 7)), expected[i].item<double>(), 1e-5) << "step " << i;
  }
  EXPECT_EQ(i, 5);
}

// Note [KV cache]: the model, a loom::CausalLM, decoding `ids` (B,12) in pieces (one token,
// six, one, four) gives the logits of one forward over the whole sequence.
inline void expect_decoding_in_pieces_equals_one_forward(Engine& engine, const at::Tensor& ids) {
  const at::Tensor whole = logits_of(engine, ids);
  auto* lm = dynamic_cast<CausalLM*>(&engine.model());
  ASSERT_NE(lm, nullptr);
  at::NoGradGuard no_grad;
  nn::KVCache cache;
  std::vector<at::Tensor> pieces;
  for (auto [start, length] : {std::pair<int64_t, int64_t>{0, 1}, {1, 6}, {7, 1}, {8, 4}})
    pieces.push_back(lm->decode(ids.narrow(1, start, length), cache));
  EXPECT_EQ(cache.length, 12);
  expect_close(at::cat(pieces, 1), whole, 1e-5);
}

}  // namespace loom::test::hf
