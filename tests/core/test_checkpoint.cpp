// safetensors and checkpoint folders: round trips, Python interoperability (the venv's
// safetensors/torch read loom's files and loom reads theirs), and corrupt-file detection.
#include <ATen/ATen.h>

#include <cstdio>

#include "loom/safetensors.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
using test::tiny_gpt_job;

std::string run_python(const std::string& script) {
  TempDir dir;
  std::ofstream(dir / "script.py") << script;
  const std::string command = std::string(LOOM_TEST_PYTHON) + " " + (dir / "script.py").string() + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  std::string out;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, n);
  const int status = pclose(pipe);
  EXPECT_EQ(status, 0) << out;
  return out;
}

NamedTensors sample_tensors() {
  at::manual_seed(3);
  return {{"weight", at::randn({3, 5})},
          {"half", at::randn({4}).to(at::kHalf)},
          {"brain", at::randn({2, 2}).to(at::kBFloat16)},
          {"ids", at::arange(7, at::kLong)},
          {"bytes", at::arange(5, at::kByte)},
          {"scalar", at::scalar_tensor(2.5)}};
}

TEST(Safetensors, RoundTripKeepsDtypeShapeValuesAndMetadata) {
  TempDir dir;
  const auto tensors = sample_tensors();
  safetensors::save(dir / "t.safetensors", tensors, {{"format", "pt"}, {"who", "loom"}});
  auto back = safetensors::load(dir / "t.safetensors");
  ASSERT_EQ(back.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(back.tensors[i].first, tensors[i].first);
    EXPECT_TRUE(at::equal(back.tensors[i].second, tensors[i].second)) << tensors[i].first;
  }
  EXPECT_EQ(back.metadata.at("who"), "loom");
  // Only the finished file remains: no temporary names.
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) files += e.exists();
  EXPECT_EQ(files, 1u);
}

TEST(Safetensors, PythonReadsLoomsFileAndLoomReadsPythons) {
  TempDir dir;
  const auto tensors = sample_tensors();
  safetensors::save(dir / "loom.safetensors", tensors, {{"format", "pt"}});
  const std::string out = run_python(
      "import torch\nfrom safetensors.torch import load_file, save_file\n"
      "t = load_file('" + (dir / "loom.safetensors").string() + "')\n"
      "for k in sorted(t): print(k, str(t[k].dtype), list(t[k].shape), "
      "round(float(t[k].double().sum()), 4))\n"
      "save_file({'x': torch.arange(6, dtype=torch.float32).reshape(2, 3), "
      "'y': torch.tensor([1, -2], dtype=torch.int64)}, '" + (dir / "py.safetensors").string() +
      "', metadata={'by': 'python'})\n");
  for (const auto& [name, tensor] : tensors) {
    char line[256];
    std::snprintf(line, sizeof line, "%s ", name.c_str());
    EXPECT_NE(out.find(line), std::string::npos) << out;
  }
  EXPECT_NE(out.find("weight torch.float32 [3, 5]"), std::string::npos) << out;
  EXPECT_NE(out.find("brain torch.bfloat16 [2, 2]"), std::string::npos) << out;
  EXPECT_NE(out.find("ids torch.int64 [7] 21.0"), std::string::npos) << out;
  EXPECT_NE(out.find("scalar torch.float32 [] 2.5"), std::string::npos) << out;
  auto py = safetensors::load(dir / "py.safetensors");
  EXPECT_EQ(py.metadata.at("by"), "python");
  ASSERT_EQ(py.tensors.size(), 2u);
  std::map<std::string, at::Tensor> by_name(py.tensors.begin(), py.tensors.end());
  EXPECT_TRUE(at::equal(by_name.at("x"), at::arange(6, at::kFloat).view({2, 3})));
  EXPECT_TRUE(at::equal(by_name.at("y"), at::tensor({1, -2}, at::kLong)));
}

TEST(Safetensors, TruncatedAndCorruptFilesAreNamedErrors) {
  TempDir dir;
  safetensors::save(dir / "t.safetensors", sample_tensors());
  const auto size = std::filesystem::file_size(dir / "t.safetensors");
  std::filesystem::copy_file(dir / "t.safetensors", dir / "short.safetensors");
  std::filesystem::resize_file(dir / "short.safetensors", size - 10);
  EXPECT_THROW_WITH(safetensors::load(dir / "short.safetensors"), CheckpointError,
                    "short.safetensors", "corrupt or truncated");
  std::ofstream(dir / "tiny.safetensors") << "abc";
  EXPECT_THROW_WITH(safetensors::load(dir / "tiny.safetensors"), CheckpointError,
                    "tiny.safetensors", "truncated");
  {
    std::string header = "{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8";
    std::ofstream out(dir / "bad.safetensors", std::ios::binary);
    uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << "12345678";
  }
  EXPECT_THROW_WITH(safetensors::load(dir / "bad.safetensors"), CheckpointError,
                    "bad.safetensors", "corrupt header");
  EXPECT_THROW_WITH(safetensors::load(dir / "none.safetensors"), CheckpointError,
                    "cannot open", "none.safetensors");
}

TEST(Checkpoint, FolderHoldsManifestAndPythonReadableWeights) {
  TempDir dir;
  auto summary = Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), {"train.max_steps=2"})->run();
  const auto folder = std::filesystem::path(summary.last_checkpoint);
  EXPECT_EQ(folder, dir / "checkpoint-2");
  const std::string manifest = test::read_text(folder / "manifest.json");
  for (const char* key : {"\"step\": 2", "\"config_hash\"", "\"crc32\"", "\"epoch\"",
                          "\"model.safetensors\"", "\"optimizer-00000-of-00001.safetensors\"", "\"optimizer_shards\""})
    EXPECT_NE(manifest.find(key), std::string::npos) << key << " in " << manifest;
  const std::string out = run_python(
      "from safetensors.torch import load_file\n"
      "t = load_file('" + (folder / "model.safetensors").string() + "')\n"
      "print('wte', tuple(t['wte.weight'].shape), 'count', len(t))\n");
  EXPECT_NE(out.find("wte (64, 32)"), std::string::npos) << out;
  auto model = safetensors::load(folder / "model.safetensors").tensors;
  EXPECT_NE(out.find("count " + std::to_string(model.size())), std::string::npos) << out;
}

TEST(Checkpoint, CorruptOrTruncatedCheckpointRefusesToResume) {
  TempDir dir;
  Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), {"train.max_steps=1"})->run();
  const auto model = dir / "checkpoint-1" / "model.safetensors";
  auto resume = [&] {
    Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(),
                       {"train.max_steps=2", "train.resume=latest"})
        ->setup();
  };
  {  // one flipped byte in the data
    std::fstream f(model, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    char c;
    f.read(&c, 1);
    f.seekp(-3, std::ios::end);
    c ^= 0x40;
    f.write(&c, 1);
  }
  EXPECT_THROW_WITH(resume(), CheckpointError, "model.safetensors", "is corrupt: crc32");
  std::filesystem::resize_file(model, 100);
  EXPECT_THROW_WITH(resume(), CheckpointError, "model.safetensors", "truncated");
  std::ofstream(dir / "checkpoint-1" / "manifest.json") << "{\"format\": \"loom-checkpo";
  EXPECT_THROW_WITH(resume(), CheckpointError, "manifest.json", "is corrupt");
  EXPECT_THROW_WITH(Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(),
                                       {"train.resume=" + (dir / "nope").string()})
                        ->setup(),
                    CheckpointError, "does not exist");
}

TEST(Checkpoint, AnotherModelShapeIsRefusedByTensorName) {
  TempDir dir;
  Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), {"train.max_steps=1"})->run();
  auto wider = Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(),
                                  {"train.max_steps=2", "train.resume=latest", "model.n_embd=48"});
  EXPECT_THROW_WITH(wider->setup(), CheckpointError, "model.safetensors", "wte.weight",
                    "another model shape");
}

}  // namespace
}  // namespace loom
