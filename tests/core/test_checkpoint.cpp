// safetensors and checkpoint folders: round trips, Python interoperability (the venv's
// safetensors/torch read loom's files and loom reads theirs), and corrupt-file detection.
#include <ATen/ATen.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "checkpoint_format.h"
#include "loom/safetensors.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;
using test::run_python;
using test::tiny_gpt_job;

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

// Headers a fuzzer or an editor could write: each a CheckpointError naming the problem, never
// an allocation of a wrapped size or a silent conversion.
TEST(Safetensors, HeadersWithImpossibleNumbersAreNamedErrors) {
  TempDir dir;
  auto write = [&](const std::string& name, const std::string& header, size_t data_bytes) {
    std::ofstream out(dir / name, std::ios::binary);
    uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << std::string(data_bytes, '\0');
  };
  // 2^32 x 2^32 x 4 bytes wraps to 0 in 64 bits: it must not pass as an empty tensor.
  write("wrap.safetensors",
        R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})", 0);
  EXPECT_THROW_WITH(safetensors::load(dir / "wrap.safetensors"), CheckpointError,
                    "wrap.safetensors", "tensor 'w' claims bytes [0, 0)", "too many elements");
  write("float.safetensors", R"({"w": {"dtype": "F32", "shape": [1.5e300], "data_offsets": [0, 4]}})",
        4);
  EXPECT_THROW_WITH(safetensors::load(dir / "float.safetensors"), CheckpointError,
                    "float.safetensors", "shape dimension is 1.5e+300, not an integer");
  write("meta.safetensors", R"({"__metadata__": {"step": 7}})", 0);
  EXPECT_THROW_WITH(safetensors::load(dir / "meta.safetensors"), CheckpointError,
                    "meta.safetensors", "__metadata__.step is 7, not a string");
  write("pair.safetensors", R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0]}})", 1);
  EXPECT_THROW_WITH(safetensors::load(dir / "pair.safetensors"), CheckpointError,
                    "pair.safetensors", "data_offsets is not a pair");
}

TEST(CheckpointFormat, ManifestAndLayoutNumbersAreCheckedBeforeUse) {
  const std::string good = test::read_text(std::filesystem::path(LOOM_SOURCE_DIR) /
                                           "tests/fuzz/corpus/manifest/manifest_v2.json")
                               .substr(1);
  EXPECT_EQ(format::parse_manifest(good, "m.json").world_size, 4);
  auto with = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    const auto at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return text.replace(at, from.size(), to);
  };
  EXPECT_THROW_WITH(format::parse_manifest(with("\"world_size\": 4", "\"world_size\": 4294967297"),
                                           "m.json"),
                    CheckpointError, "'m.json' is corrupt: world_size is 4294967297");
  EXPECT_THROW_WITH(format::parse_manifest(with("\"step\": 20", "\"step\": 2e1"), "m.json"),
                    CheckpointError, "step is 20.0, not an integer");
  EXPECT_THROW_WITH(format::parse_manifest(with("\"crc32\": ", "\"crc32\": 4294967296"), "m.json"),
                    CheckpointError, "crc32 is 4294967296");
  EXPECT_THROW_WITH(format::parse_manifest(good.substr(0, 40), "m.json"), CheckpointError,
                    "'m.json' is corrupt: not valid JSON");
  EXPECT_THROW_WITH(format::parse_shard_layout({{"layout", "{}"}, {"step", "x7"}}, 7, "s.st"),
                    CheckpointError, "'s.st' has corrupt layout metadata");
  EXPECT_THROW_WITH(format::parse_shard_layout({{"layout", "{}"}, {"step", "6"}}, 7, "s.st"),
                    CheckpointError, "is from step 6 but the checkpoint is of step 7");
  EXPECT_THROW_WITH(format::parse_shard_layout(
                        {{"layout", R"({"a": {"shape": [4], "offset": -1}})"}, {"step", "7"}}, 7,
                        "s.st"),
                    CheckpointError, "'a' offset is -1");
  EXPECT_EQ(format::parse_shard_layout(
                {{"layout", R"({"a": {"shape": [8, 2], "offset": 4}})"}, {"step", "7"}}, 7, "s.st")
                .at("a")
                .offset,
            4);
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

// Note [Manifest checksum]: the checksum covers content, not form: the manifest re-indented
// with its keys in the reverse order still reads; one value changed, even one loom never reads,
// does not.
TEST(Checkpoint, ManifestChecksumCoversContentNotForm) {
  TempDir dir;
  auto summary =
      Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), {"train.max_steps=1"})->run();
  const std::string text =
      test::read_text(std::filesystem::path(summary.last_checkpoint) / "manifest.json");
  EXPECT_NE(text.find("\"format_version\": 3"), std::string::npos) << text;
  EXPECT_NE(text.find("\"manifest_crc32\""), std::string::npos) << text;
  const auto doc = nlohmann::ordered_json::parse(text);
  nlohmann::ordered_json reversed = nlohmann::ordered_json::object();
  std::vector<std::string> keys;
  for (const auto& item : doc.items()) keys.push_back(item.key());
  for (auto key = keys.rbegin(); key != keys.rend(); ++key) reversed[*key] = doc[*key];
  EXPECT_EQ(format::parse_manifest(reversed.dump(7), "m.json").step, 1);
  reversed["loom_version"] = "0.0.0";
  EXPECT_THROW_WITH(format::parse_manifest(reversed.dump(), "m.json"), CheckpointError,
                    "'m.json' is corrupt: its content does not match its own checksum");
}

// As the reference reader: a name twice in the header, or data bytes that belong to no tensor.
TEST(Safetensors, DuplicateNamesAndBytesOutsideTheTensorsAreRefused) {
  const std::string twice = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                            R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  EXPECT_THROW_WITH(format::parse_safetensors_header(twice, 8 + twice.size() + 8, "x.st"),
                    CheckpointError, "'x.st' has a corrupt header: it names 'a' twice in one object");
  const std::string one = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  EXPECT_EQ(format::parse_safetensors_header(one, 8 + one.size() + 4, "x.st").entries.size(), 1u);
  EXPECT_THROW_WITH(format::parse_safetensors_header(one, 8 + one.size() + 6, "x.st"),
                    CheckpointError, "'x.st' is corrupt: 2 bytes after the last tensor");
  const std::string gap = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  EXPECT_THROW_WITH(format::parse_safetensors_header(gap, 8 + gap.size() + 8, "x.st"),
                    CheckpointError, "'x.st' is corrupt: 4 bytes before tensor 'a'");
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
  // A resume folder that is not there: refused while the job is prepared, naming the key.
  EXPECT_THROW_WITH(Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(),
                                       {"train.resume=" + (dir / "nope").string()}),
                    ConfigError, "[train] resume", "does not exist");
}

TEST(Checkpoint, AnotherModelShapeIsRefusedByTensorName) {
  TempDir dir;
  Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), {"train.max_steps=1"})->run();
  auto wider = Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(),
                                  {"train.max_steps=2", "train.resume=latest", "model.n_embd=48"});
  EXPECT_THROW_WITH(wider->setup(), CheckpointError, "model.safetensors", "wte.weight",
                    "another model shape");
}


// Note [Asynchronous checkpoints] through the Trainer API (the CLI cases are in
// tests/distributed/reliability_test.sh). The writer is held 300 ms after its files by the test
// knob, so a save is still in flight when the test acts.
std::string file_bytes(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct HeldWriter {
  HeldWriter() { ::setenv("LOOM_TEST_ASYNC_SAVE_DELAY_MS", "300", 1); }
  ~HeldWriter() { ::unsetenv("LOOM_TEST_ASYNC_SAVE_DELAY_MS"); }
};

TEST(AsyncSave, SaveCheckpointCommitsTheSaveInFlightFirstAndDestructionCommitsIt) {
  TempDir sync_dir, async_dir, dropped_dir;
  const std::vector<std::string> sets = {"train.save_steps=2", "train.save_final=false"};
  Trainer::from_text(tiny_gpt_job(sync_dir.str()), sync_dir.path(), sets)->run();
  HeldWriter held;
  auto with_async = sets;
  with_async.push_back("train.async_save=true");
  {
    auto trainer = Trainer::from_text(tiny_gpt_job(async_dir.str()), async_dir.path(), with_async);
    ASSERT_TRUE(trainer->step());
    ASSERT_TRUE(trainer->step());  // checkpoint-2 starts in the background
    EXPECT_FALSE(std::filesystem::exists(async_dir / "checkpoint-2"));
    EXPECT_TRUE(std::filesystem::exists(async_dir / ".checkpoint-2.tmp"));
    ASSERT_TRUE(trainer->step());
    // Checkpoint-2 is committed before checkpoint-3 is written: both whole.
    EXPECT_EQ(trainer->save_checkpoint(), (async_dir / "checkpoint-3").string());
    EXPECT_TRUE(std::filesystem::exists(async_dir / "checkpoint-2/manifest.json"));
    EXPECT_TRUE(std::filesystem::exists(async_dir / "checkpoint-3/manifest.json"));
  }
  {
    // A trainer of one process dropped mid-save: the save step's state is whole, so it commits.
    auto trainer = Trainer::from_text(tiny_gpt_job(dropped_dir.str()), dropped_dir.path(), with_async);
    ASSERT_TRUE(trainer->step());
    ASSERT_TRUE(trainer->step());
    EXPECT_FALSE(std::filesystem::exists(dropped_dir / "checkpoint-2"));
  }
  EXPECT_FALSE(std::filesystem::exists(dropped_dir / ".checkpoint-2.tmp"));
  for (const auto& dir : {&async_dir, &dropped_dir})
    for (const char* file : {"model.safetensors", "optimizer-00000-of-00001.safetensors",
                             "trainer.safetensors"})
      EXPECT_EQ(file_bytes(sync_dir / "checkpoint-2" / file), file_bytes(*dir / "checkpoint-2" / file))
          << dir->str() << " " << file;
  // ...and a resume reads it.
  with_async.push_back("train.resume=\"latest\"");
  auto resumed = Trainer::from_text(tiny_gpt_job(dropped_dir.str()), dropped_dir.path(),
                                    with_async)->run();
  EXPECT_EQ(resumed.steps, 4);
}

}  // namespace
}  // namespace loom
