// Note [One resolved job]: `loom check` accepts exactly what `loom run` accepts. Each job of the
// table is refused while it is prepared, by the path `loom check` takes (the Trainer's
// construction, then describe()) and by the path `loom run` takes (construction, then run()),
// with one message, naming the key; and nothing is written to its output_dir.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "loom/error.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::TempDir;

// The tiny GPT job of test_util.h, with `data` in place of its [data] table when not empty, and
// `extra` after it.
std::string job_text(const std::string& output_dir, const std::string& data,
                     const std::string& extra) {
  std::string job = test::tiny_gpt_job(output_dir);
  if (!data.empty()) job = job.substr(0, job.find("[data]")) + data;
  return job + "\n" + extra;
}

struct Refused {
  const char* name;
  std::string data;   // the [data] table ("": the tiny job's own)
  std::string extra;  // tables after it
  std::vector<std::string> message;  // parts of the one message
};

// The message of the loom::Error `make` throws, or "" when it throws none.
template <typename F>
std::string error_of(F&& make) {
  try {
    make();
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

TEST(PreparedJob, CheckRefusesExactlyTheJobsRunRefusesWithOneMessage) {
  const std::vector<Refused> table = {
      // The four `loom check` used to accept and `loom run` refused.
      {"missing data file", "[data]\nsource = \"text\"\npath = \"missing.txt\"\nseq_len = 16\n", "",
       {"[data] path 'missing.txt': cannot read", "missing or unreadable"}},
      {"offload_param without half weights", "",
       "[zero]\nstage = 3\noffload_param = { device = \"nvme\", nvme_path = \"nvme\" }\n",
       {"offload_param keeps half-precision weight shards", "[precision] mode is fp32",
        "full_bf16"}},
      {"lora without target_modules", "", "[lora]\nr = 4\n",
       {"[lora] needs target_modules", "adapter_path"}},
      {"beta2 >= 1", "", "[optimizer]\nbeta2 = 1.0\n", {"beta2 must be in [0, 1), got 1"}},
      // Keys, types, names.
      {"misspelt key", "", "", {"unknown key 'max_step' in [train]", "did you mean 'max_steps'"}},
      {"wrong type", "", "", {"[train] max_steps must be"}},
      {"unknown model", "", "", {"no plugin provides model 'gtp'"}},
      {"unknown table", "", "[lorra]\n", {"[lorra] names no known plugin", "lora"}},
      {"two plugins in one slot", "", "[zero]\n[ddp]\n", {"claimed twice", "ddp", "zero"}},
      // The core's ranges.
      {"negative learning rate", "", "", {"learning_rate must be >= 0"}},
      {"unknown schedule", "", "", {"lr_scheduler_type", "cosine"}},
      {"negative threads", "", "", {"num_threads must be >= 0"}},
      {"unknown cpu_isa", "", "", {"cpu_isa", "avx2"}},
      {"zero timeout", "", "[distributed]\ntimeout_seconds = 0\n",
       {"timeout_seconds must be positive"}},
      {"nccl on a cpu", "", "[distributed]\nbackend = \"nccl\"\n",
       {"backend = \"nccl\" moves CUDA tensors only", "gloo"}},
      // Data sources.
      {"vocab range",
       "[data]\nsource = \"random_tokens\"\nseq_len = 16\nvocab_low = 9\nvocab_high = 9\n", "",
       {"0 <= vocab_low < vocab_high"}},
      {"text shorter than a sample", "[data]\nsource = \"text\"\npath = \"short.txt\"\nseq_len = 16\n",
       "", {"too few for one sample", "seq_len 16"}},
      {"tokens of odd length", "[data]\nsource = \"tokens\"\npath = \"odd.bin\"\nseq_len = 16\n", "",
       {"odd.bin' has 3 bytes, not a multiple of 2"}},
      // The data against the model (Note [Data against the model]): the tiny GPT has 64 ids.
      {"a token id beyond the vocabulary",
       "[data]\nsource = \"tokens\"\npath = \"ids.bin\"\nseq_len = 16\n", "",
       {"[data] path 'ids.bin': token id 64 at position 517 (byte 1034) of '",
        "is not below the model's vocabulary of 64 ids ([model] vocab_size (",
        "tokenize it with the model's tokenizer"}},
      {"a uint32 token id beyond the vocabulary",
       "[data]\nsource = \"tokens\"\npath = \"ids.bin\"\ndtype = \"uint32\"\nseq_len = 16\n", "",
       {"token id 70000 at position 999 (byte 3996)", "vocabulary of 64 ids",
        "[data] dtype = \"uint32\""}},
      {"an evaluation set's token id beyond the vocabulary", "",
       "[eval_data]\nsource = \"tokens\"\npath = \"ids.bin\"\nseq_len = 16\n",
       {"[eval_data] path 'ids.bin': token id 64 at position 517"}},
      {"text bytes beyond the vocabulary",
       "[data]\nsource = \"text\"\npath = \"text.txt\"\nseq_len = 16\n", "",
       {"[data] path 'text.txt': token id 104 at position 2 (byte 2)", "vocabulary of 64 ids",
        "ids are its bytes (0-255)"}},
      {"random ids beyond the vocabulary",
       "[data]\nsource = \"random_tokens\"\ntask = \"lm\"\nseq_len = 16\nvocab_low = 0\n"
       "vocab_high = 65\n", "",
       {"[data] vocab_high = 65 draws token ids up to 64, not below the model's vocabulary of 64",
        "set vocab_high <= 64"}},
      {"an empty tokens file",
       "[data]\nsource = \"tokens\"\npath = \"empty.bin\"\nseq_len = 16\n", "",
       {"[data] path 'empty.bin': '", "empty.bin' is empty (0 bytes)", "write the data again"}},
      {"an empty text shard",
       "[data]\nsource = \"text\"\npath = [\"text.txt\", \"empty.txt\"]\nseq_len = 16\n",
       "", {"[data] path 'empty.txt': '", "empty.txt' is empty (0 bytes)"}},
      // Model, optimizer and table plugins, validated against the whole job.
      {"heads not dividing the width", "", "", {"n_head"}},
      {"sequences longer than the positions",
       "[data]\nsource = \"random_tokens\"\ntask = \"lm\"\nseq_len = 32\nvocab_high = 64\n", "",
       {"n_positions"}},
      {"adafactor clip threshold", "", "[optimizer]\nname = \"adafactor\"\nclip_threshold = 0\n",
       {"clip_threshold"}},
      {"zero stage 5", "", "[zero]\nstage = 5\n", {"stage must be 0, 1, 2 or 3"}},
      {"swap file checksum threads", "",
       "[zero]\noffload_optimizer = { device = \"nvme\", nvme_path = \"nvme\", "
       "checksum_threads = 0 }\n",
       {"[zero] offload_optimizer.checksum_threads 0 must be between 1 and 64"}},
      {"swap file block size", "",
       "[zero]\noffload_optimizer = { device = \"nvme\", nvme_path = \"nvme\", "
       "block_size = 1000 }\n",
       {"[zero] offload_optimizer.block_size 1000 must be a multiple of 4096"}},
      {"sgd kernel", "", "[optimizer]\nname = \"sgd\"\nkernel = \"fused\"\n",
       {"[optimizer] kernel 'fused' is unknown for sgd", "auto, multi_tensor or tensor_ops"}},
      // Environment variables the kernels read at every step (set below).
      {"unknown kernel ISA", "", "", {"LOOM_KERNEL_ISA='avx1024'", "avx512, avx2 or scalar"}},
      {"unknown adam8bit dequantizer", "", "[optimizer]\nname = \"adam8bit\"\n",
       {"LOOM_ADAM8BIT_DEQUANTIZE='lookup'", "use gather or arithmetic"}},
      {"offload_param below stage 3", "",
       "[precision]\nmode = \"full_bf16\"\n[zero]\nstage = 2\n"
       "offload_param = { device = \"nvme\", nvme_path = \"nvme\" }\n",
       {"offload_param offloads stage 3's weight shards, but stage = 2"}},
      {"lora regex", "", "[lora]\ntarget_modules = \"([\"\n", {"is not a valid regex"}},
      {"lora adapter folder", "", "[lora]\nadapter_path = \"no_adapter\"\n",
       {"[lora] adapter_path", "no_adapter holds no adapter_model.safetensors"}},
      {"unknown precision mode", "", "[precision]\nmode = \"fp8\"\n", {"mode", "fp8"}},
      // Evaluation (Note [Evaluation]).
      {"unknown eval_strategy", "", "", {"eval_strategy = \"step\" is unknown", "\"steps\""}},
      {"evaluation without data", "", "",
       {"eval_strategy = \"steps\" needs evaluation data", "[eval_data]", "validation_split"}},
      {"two evaluation sets",
       "[data]\nsource = \"random_tokens\"\ntask = \"lm\"\nseq_len = 16\nvocab_high = 64\n"
       "validation_split = 0.1\n",
       "[eval_data]\nseq_len = 16\n", {"validation_split = 0.1 and an [eval_data] table"}},
      {"validation_split of everything",
       "[data]\nsource = \"random_tokens\"\ntask = \"lm\"\nseq_len = 16\nvocab_high = 64\n"
       "validation_split = 1.0\n",
       "", {"validation_split must be in [0, 1)"}},
      {"eval batch of zero", "", "[eval_data]\nseq_len = 16\n",
       {"per_device_eval_batch_size must be positive"}},
      {"eval data source unknown", "", "[eval_data]\nsource = \"jsonll\"\n",
       {"no plugin provides data source 'jsonll'"}},
      {"eval data file missing", "",
       "[eval_data]\nsource = \"text\"\npath = \"held_out.txt\"\nseq_len = 16\n",
       {"path 'held_out.txt': cannot read"}},
      // Best model and early stopping (Note [Best model]).
      {"metric never computed", "", "[eval_data]\nseq_len = 16\n",
       {"metric_for_best_model 'bleu' names no metric", "eval_loss", "eval_f1"}},
      {"early stopping without evaluation", "", "",
       {"early_stopping_patience ranks evaluations, but eval_strategy = \"no\""}},
      {"best model without a checkpoint at evaluations", "", "[eval_data]\nseq_len = 16\n",
       {"load_best_model_at_end needs a checkpoint at evaluation steps", "save_steps = 3",
        "every 2 steps"}},
      // The output folder.
      {"an earlier run's checkpoints", "", "",
       {"already holds checkpoints of an earlier run", "resume = \"latest\""}},
      {"a resume folder that is not there", "", "",
       {"resume = \"nowhere\": checkpoint folder", "does not exist"}},
  };
  ASSERT_GE(table.size(), 20u);
  for (const auto& job : table) {
    SCOPED_TRACE(job.name);
    TempDir dir;
    const std::string out = (dir / "out").string();
    std::string text = job_text(out, job.data, job.extra);
    std::vector<std::string> set;
    const std::string name = job.name;
    if (name == "misspelt key") set = {"train.max_step=3"};
    if (name == "wrong type") set = {"train.max_steps=\"ten\""};
    if (name == "unknown model") set = {"train.model=\"gtp\""};
    if (name == "negative learning rate") set = {"train.learning_rate=-1.0"};
    if (name == "unknown schedule") set = {"train.lr_scheduler_type=\"cosinus\""};
    if (name == "negative threads") set = {"train.num_threads=-1"};
    if (name == "unknown cpu_isa") set = {"train.cpu_isa=\"avx9000\""};
    if (name == "nccl on a cpu") set = {"train.device=\"cpu\""};
    if (name == "heads not dividing the width") set = {"model.n_head=5"};
    if (name == "a resume folder that is not there") set = {"train.resume=\"nowhere\""};
    if (name == "unknown eval_strategy") set = {"train.eval_strategy=\"step\""};
    if (name == "evaluation without data") set = {"train.eval_strategy=\"steps\""};
    if (name == "eval batch of zero") set = {"train.per_device_eval_batch_size=0"};
    if (name == "metric never computed")
      set = {"train.eval_strategy=\"steps\"", "train.metric_for_best_model=\"bleu\""};
    if (name == "early stopping without evaluation") set = {"train.early_stopping_patience=2"};
    if (name == "best model without a checkpoint at evaluations")
      set = {"train.eval_strategy=\"steps\"", "train.eval_steps=2", "train.save_steps=3",
             "train.load_best_model_at_end=true"};
    if (name == "text shorter than a sample") std::ofstream(dir / "short.txt") << "too short";
    if (name == "tokens of odd length") std::ofstream(dir / "odd.bin") << "abc";
    // 1000 ids below 64 but one: 64 at 517 (uint16), 70000 at the last (uint32).
    if (name.find("token id beyond") != std::string::npos) {
      const bool wide = name.find("uint32") != std::string::npos;
      std::ofstream file(dir / "ids.bin", std::ios::binary);
      for (uint32_t i = 0; i < 1000; ++i) {
        const uint32_t id = wide ? (i == 999 ? 70000 : i % 64) : (i == 517 ? 64 : i % 64);
        file.write(reinterpret_cast<const char*>(&id), wide ? 4 : 2);  // little-endian
      }
    }
    if (name == "text bytes beyond the vocabulary" || name == "an empty text shard")
      std::ofstream(dir / "text.txt") << "!!h, a text of more than seventeen bytes";
    if (name == "an empty tokens file") std::ofstream(dir / "empty.bin");
    if (name == "an empty text shard") std::ofstream(dir / "empty.txt");
    if (name == "an earlier run's checkpoints") {
      std::filesystem::create_directories(dir / "out/checkpoint-3");
      std::ofstream(dir / "out/checkpoint-3/manifest.json") << "{}";
    }
    // The variable set for this job only, unset whatever happens.
    struct Environment {
      const char* variable = nullptr;
      ~Environment() {
        if (variable) unsetenv(variable);
      }
    } environment;
    if (name == "unknown kernel ISA") environment.variable = "LOOM_KERNEL_ISA";
    if (name == "unknown adam8bit dequantizer") environment.variable = "LOOM_ADAM8BIT_DEQUANTIZE";
    if (environment.variable)
      setenv(environment.variable, name == "unknown kernel ISA" ? "avx1024" : "lookup", 1);
    const auto before = test::list_files(dir.path());
    const std::string check = error_of([&] {
      auto trainer = Trainer::from_text(text, dir.path(), set);
      (void)trainer->describe();
    });
    const std::string run = error_of([&] { Trainer::from_text(text, dir.path(), set)->run(); });
    ASSERT_FALSE(check.empty()) << "loom check accepted it";
    EXPECT_EQ(check, run);
    for (const auto& part : job.message)
      EXPECT_NE(check.find(part), std::string::npos) << "message lacks \"" << part << "\": "
                                                     << check;
    EXPECT_EQ(test::list_files(dir.path()), before) << "something was written";
  }
}

}  // namespace
}  // namespace loom
