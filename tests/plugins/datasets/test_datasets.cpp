// The jsonl/csv data sources (plugins/datasets, Note [Dataset tasks]) against transformers:
// chat samples carry labels on exactly the assistant tokens of the model's own chat template
// (Llama 3's and ChatML, rendered by transformers' apply_chat_template, offsets from its fast
// tokenizer); classification samples are transformers' tokenizer(text, text_pair,
// truncation=True) with the sorted label map; packing and bad input.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "loom/conformance.h"
#include "loom/data.h"
#include "loom/engine.h"
#include "loom/tokenizer.h"
#include "loom/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using json = nlohmann::json;

class Datasets : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    dir_ = new test::TempDir();
    test::run_command(std::string(LOOM_TEST_PYTHON) + " " + LOOM_SOURCE_DIR +
                      "/tests/plugins/datasets/reference.py make " + dir_->str());
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }

 protected:
  // A tiny GPT over the reference tokenizer's 600 ids, and a [data] table.
  static std::string job(const std::string& output_dir, const std::string& data) {
    return R"([train]
model = "gpt"
max_steps = 2
per_device_train_batch_size = 4
learning_rate = 1e-3
output_dir = ")" + output_dir + R"("
progress_bar = false
log_level = "warn"
[model]
vocab_size = 600
n_positions = 512
n_embd = 16
n_layer = 1
n_head = 2
[data]
)" + data;
  }
  static std::vector<json> read_jsonl(const std::string& name) {
    std::vector<json> rows;
    std::ifstream in(*dir_ / name);
    std::string line;
    while (std::getline(in, line)) rows.push_back(json::parse(line));
    return rows;
  }
  static std::shared_ptr<const Dataset> dataset_of(Trainer& trainer) {
    trainer.setup();
    auto* sampled = dynamic_cast<SampledSource*>(&trainer.engine().data());
    EXPECT_NE(sampled, nullptr);
    return sampled->dataset();
  }
  static std::vector<int64_t> values(const at::Tensor& t) {
    return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  }
  static test::TempDir* dir_;
};
test::TempDir* Datasets::dir_ = nullptr;

class ChatFormats : public Datasets, public ::testing::WithParamInterface<std::string> {};

TEST_P(ChatFormats, ExactlyTheAssistantTokensCarryLabels) {
  test::TempDir out;
  const std::string format = GetParam();
  auto trainer = Trainer::from_text(
      job(out.str(), "source = \"jsonl\"\npath = \"" + (*dir_ / "chat.jsonl").string() +
                         "\"\ntokenizer = \"" + (*dir_ / format).string() +
                         "\"\nmax_seq_length = 512\nshuffle = false\n"),
      out.path());
  const auto dataset = dataset_of(*trainer);
  const auto expected = read_jsonl("expected_chat_" + format + ".jsonl");
  ASSERT_EQ(dataset->size(), static_cast<int64_t>(expected.size()));
  int64_t targets = 0;
  for (int64_t i = 0; i < dataset->size(); ++i) {
    const auto ids = expected[i]["ids"].get<std::vector<int64_t>>();
    const auto target = expected[i]["target"].get<std::vector<int>>();
    std::vector<int64_t> inputs(ids.begin(), ids.end() - 1), labels;
    for (size_t t = 1; t < ids.size(); ++t) labels.push_back(target[t] ? ids[t] : kIgnoreIndex);
    const Sample s = dataset->get(i);
    ASSERT_EQ(values(s.input_ids), inputs) << "chat " << i << " (" << format << ")";
    ASSERT_EQ(values(s.labels), labels) << "chat " << i << " (" << format << ")";
    for (const int t : target) targets += t;
  }
  EXPECT_GT(targets, 100);
  // The model trains on it (padded batches of different lengths), and each step's metrics line
  // counts the tokens it trained on: its batch's assistant tokens (batches of 4, in order).
  EXPECT_TRUE(trainer->step());
  EXPECT_TRUE(trainer->step());
  std::ifstream metrics(out / "metrics.jsonl");
  int64_t step = 0;
  for (std::string line; std::getline(metrics, line); ++step) {
    int64_t trained = 0;
    for (int64_t i = 4 * step; i < 4 * step + 4; ++i)
      trained += (dataset->get(i).labels != kIgnoreIndex).sum().item<int64_t>();
    EXPECT_EQ(json::parse(line)["trained_tokens"].get<int64_t>(), trained) << "step " << step + 1;
  }
  EXPECT_EQ(step, 2);
}
INSTANTIATE_TEST_SUITE_P(Templates, ChatFormats, ::testing::Values("llama3", "chatml"),
                         [](const auto& info) { return info.param; });

TEST_F(Datasets, ClassificationIsTransformersTokenizerWithTheSortedLabelMap) {
  test::TempDir out;
  auto classifier = Trainer::from_text(R"([train]
model = "bert"
max_steps = 1
per_device_train_batch_size = 4
output_dir = ")" + out.str() + R"("
progress_bar = false
log_level = "warn"
[model]
vocab_size = 600
hidden_size = 16
num_hidden_layers = 1
num_attention_heads = 2
intermediate_size = 32
max_position_embeddings = 64
num_labels = 3
[data]
source = "jsonl"
path = ")" + (*dir_ / "classify.jsonl").string() + R"("
tokenizer = ")" + (*dir_ / "llama3").string() + R"("
max_seq_length = 24
)", out.path());
  const auto dataset = dataset_of(*classifier);
  const auto expected = read_jsonl("expected_classify.jsonl");
  ASSERT_EQ(dataset->size(), static_cast<int64_t>(expected.size()));
  for (int64_t i = 0; i < dataset->size(); ++i) {
    const Sample s = dataset->get(i);
    EXPECT_EQ(values(s.input_ids), expected[i]["ids"].get<std::vector<int64_t>>()) << i;
    EXPECT_EQ(values(s.token_type_ids), expected[i]["type_ids"].get<std::vector<int64_t>>()) << i;
    EXPECT_EQ(s.labels.item<int64_t>(), expected[i]["label"].get<int64_t>()) << i;
  }
  EXPECT_NE(dataset->describe().find("3 labels (negative, neutral, positive)"), std::string::npos)
      << dataset->describe();
  EXPECT_TRUE(classifier->step());
}

// The dataset conformance kit (loom/conformance.h) on every task of both formats: samples
// deterministic, rank shards disjoint and covering, a mid-epoch resume exact.
TEST_F(Datasets, EveryTaskPassesTheDatasetConformanceKit) {
  test::TempDir out;
  std::ofstream(out / "docs.csv") << "text\nthe cat sat on the mat\nwhy 42?\nhello world\n"
                                  << "naïve dog 東京\nit's code: x = f(y)\n\"a, \"\"quoted\"\" one\"\n"
                                  << "we'll see 😀\n";
  const std::string tokenizer = "\ntokenizer = \"" + (*dir_ / "llama3").string() + "\"\n";
  for (const std::string data : {
           "source = \"jsonl\"\npath = \"" + (*dir_ / "chat.jsonl").string() + "\"\nmax_seq_length = 64",
           "source = \"jsonl\"\npath = \"" + (*dir_ / "classify.jsonl").string() + "\"\nmax_seq_length = 24",
           "source = \"csv\"\npath = \"" + (out / "docs.csv").string() + "\"\nmax_seq_length = 8",
           "source = \"csv\"\npath = \"" + (out / "docs.csv").string() +
               "\"\nmax_seq_length = 4\npacking = true"}) {
    SCOPED_TRACE(data);
    const bool classify = data.find("classify") != std::string::npos;
    std::string text = job(out.str(), data + tokenizer);
    if (classify)  // a classifier over the same 600 ids
      text.replace(text.find("model = \"gpt\""), 13, "model = \"bert\"")
          .replace(text.find("[model]"), std::string::npos,
                   "[model]\nvocab_size = 600\nhidden_size = 16\nnum_hidden_layers = 1\n"
                   "num_attention_heads = 2\nintermediate_size = 32\nmax_position_embeddings = 64\n"
                   "num_labels = 3\n[data]\n" + data + tokenizer);
    auto trainer = Trainer::from_text(text, out.path());
    const auto report = conformance::check_dataset(dataset_of(*trainer));
    EXPECT_TRUE(report.ok()) << report.text();
  }
}

// Bad input: refused before anything is built (Trainer::from_text is `loom check`), naming the
// file and line, and nothing is written to output_dir.
TEST_F(Datasets, BadRecordsAreRefusedBeforeTrainingNamingFileAndLine) {
  test::TempDir out;
  const auto output = out / "run";
  auto refuse = [&](const std::string& records, const std::string& extra,
                    const std::vector<std::string>& parts,
                    const std::string& tokenizer = (*dir_ / "llama3").string()) {
    const auto file = out / "data.jsonl";
    std::ofstream(file) << records;
    try {
      Trainer::from_text(job(output.string(), "source = \"jsonl\"\npath = \"" + file.string() +
                                                  "\"\ntokenizer = \"" + tokenizer + "\"\n" + extra),
                         out.path());
      ADD_FAILURE() << "accepted: " << records;
    } catch (const Error& error) {
      const std::string message = error.what();
      for (const auto& part : parts)
        EXPECT_NE(message.find(part), std::string::npos) << "lacks \"" << part << "\": " << message;
    }
    EXPECT_FALSE(std::filesystem::exists(output)) << "output_dir was written";
  };
  const std::string file = (out / "data.jsonl").string();
  refuse("{\"text\": \"a\"}\n{\"text\": oops}\n", "", {file + ":2", "not a JSON object"});
  refuse("{\"text\": \"a\"}\n[1, 2]\n", "", {file + ":2", "not an object"});
  refuse("{\"text\": \"a\"}\n{\"body\": \"b\"}\n", "", {file + ":2", "no field 'text'", "body"});
  refuse("{\"txt\": \"a\"}\n", "", {file + ":1", "none of the fields", "txt"});
  refuse("{\"text\": \"a\", \"label\": \"pos\"}\n{\"text\": \"b\", \"label\": \"meh\"}\n",
         "label_names = [\"neg\", \"pos\"]\n", {file + ":2", "'meh' is not in the label map of [data] label_names (neg, pos)"});
  refuse("", "", {"no records"});
  refuse("{\"prompt\": \"a\", \"completion\": \"b\"}\n", "packing = true\n",
         {"packing", "instruction"});
  refuse("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n", "",
         {file + ":1", "no assistant message"});
  refuse("{\"text\": \"a\"}\n", "task = \"summarize\"\n", {"task must be auto, lm", "summarize"});
  refuse("{\"text\": \"a\"}\n", "max_seq_length = 1\n", {"max_seq_length must be at least 2"});
  refuse("{\"messages\": [{\"role\": \"assistant\", \"content\": \"hi\"}]}\n",
         "chat_template = \"vicuna\"\n", {"chat_template must be", "vicuna"});
  refuse("{\"text\": \"a\"}\n", "", {"needs a tokenizer", "from_pretrained"}, "");
  // A tokenizer of a kind loom cannot reproduce.
  test::TempDir unigram;
  std::ofstream(unigram / "tokenizer.json") << R"({"model": {"type": "WordLevel", "vocab": {}}})";
  refuse("{\"text\": \"a\"}\n", "", {"'WordLevel' is not supported", "WordPiece"}, unigram.str());
}

// Note [Data against the model]: records the model cannot take (a token id beyond its
// vocabulary, a label beyond its classes, a negative label) and an empty shard are refused by
// `loom check` (Trainer::from_text, describe) and by `loom run` (run()) with one message naming
// the file and record, the value and the limit, before anything is written to output_dir.
TEST_F(Datasets, DataTheModelCannotTakeIsRefusedByCheckAndRunAlikeBeforeAnythingIsWritten) {
  test::TempDir out;
  const auto output = out / "run";
  const std::string llama3 = (*dir_ / "llama3").string();
  const std::string data = (out / "data.jsonl").string(), empty = (out / "empty.jsonl").string();
  // A BERT classifier of 3 classes over the tokenizer's 600 ids.
  auto classifier = [&](const std::string& extra, const std::string& path = "") {
    std::string text = job(output.string(), "source = \"jsonl\"\npath = " +
                                                (path.empty() ? "\"" + data + "\"" : path) +
                                                "\ntokenizer = \"" + llama3 + "\"\n" + extra);
    return text.replace(text.find("model = \"gpt\""), 13, "model = \"bert\"")
        .replace(text.find("[model]"), text.find("[data]") - text.find("[model]"),
                 "[model]\nvocab_size = 600\nhidden_size = 16\nnum_hidden_layers = 1\n"
                 "num_attention_heads = 2\nintermediate_size = 32\nmax_position_embeddings = 64\n"
                 "num_labels = 3\n");
  };
  auto refuse = [&](const std::string& name, const std::string& records, const std::string& text,
                    const std::vector<std::string>& parts) {
    SCOPED_TRACE(name);
    std::ofstream(data) << records;
    std::string check, run;
    try {
      (void)Trainer::from_text(text, out.path())->describe();
    } catch (const Error& error) {
      check = error.what();
    }
    try {
      Trainer::from_text(text, out.path())->run();
    } catch (const Error& error) {
      run = error.what();
    }
    ASSERT_FALSE(check.empty()) << "loom check accepted it";
    EXPECT_EQ(check, run);
    for (const auto& part : parts)
      EXPECT_NE(check.find(part), std::string::npos) << "lacks \"" << part << "\": " << check;
    EXPECT_FALSE(std::filesystem::exists(output)) << "output_dir was written";
  };
  const std::string three = "{\"text\": \"a\", \"label\": 0}\n{\"text\": \"b\", \"label\": 2}\n";
  refuse("an integer label beyond the classes", three + "{\"text\": \"c\", \"label\": 3}\n",
         classifier("max_seq_length = 24\n"),
         {data + ":3: label 3 is not below the model's 3 classes ([model] num_labels (",
          "the data has 4 classes: set [model] num_labels = 4, or fix the record"});
  refuse("a negative label", three + "{\"text\": \"c\", \"label\": -1}\n",
         classifier("max_seq_length = 24\n"),
         {data + ":3: label -1 is negative; class ids count from 0"});
  refuse("a named label beyond the classes",
         "{\"text\": \"a\", \"label\": \"b\"}\n{\"text\": \"b\", \"label\": \"d\"}\n",
         classifier("max_seq_length = 24\nlabel_names = [\"a\", \"b\", \"c\", \"d\"]\n"),
         {data + ":2: label d (class 3) is not below the model's 3 classes"});
  std::ofstream(empty).flush();
  refuse("an empty shard", three,
         classifier("max_seq_length = 24\n", "[\"" + data + "\", \"" + empty + "\"]"),
         {"[data] path '" + empty + "': '" + empty + "' holds no records (0 bytes)"});
  // A GPT of 300 ids under the tokenizer's 373: the first id >= 300 of the records, as the
  // tokenizer (itself checked against transformers' in test_tokenizer) encodes them, with the
  // specials and the EOS an LM document gets.
  const auto tokenizer = Tokenizer::load(llama3);
  const std::vector<std::string> texts = {"a", "the cat", "hello world, a longer text of words"};
  std::string records, where, id;
  for (size_t line = 0; line < texts.size(); ++line) {
    records += json{{"text", texts[line]}}.dump() + "\n";
    auto ids = tokenizer->encode(texts[line]).ids;
    ids.push_back(*tokenizer->eos().id);
    for (size_t t = 0; t < ids.size() && where.empty(); ++t)
      if (ids[t] >= 300) {
        where = data + ":" + std::to_string(line + 1) + ": token id " + std::to_string(ids[t]);
        id = " at position " + std::to_string(t) + " of the record's tokens";
      }
  }
  ASSERT_FALSE(where.empty()) << "no id >= 300 in the test's texts";
  std::string small_vocab = job(output.string(), "source = \"jsonl\"\npath = \"" + data +
                                                     "\"\ntokenizer = \"" + llama3 + "\"\n");
  small_vocab.replace(small_vocab.find("vocab_size = 600"), 16, "vocab_size = 300");
  refuse("a token id beyond the vocabulary", records, small_vocab,
         {where, id, "is not below the model's vocabulary of 300 ids ([model] vocab_size (",
          detail::cat("has ", tokenizer->vocab_size(), ": give the model vocab_size = ",
                      tokenizer->vocab_size())});
}

TEST_F(Datasets, PackedDocumentsAreOneStreamWithEosBetween) {
  test::TempDir out;
  const auto file = out / "docs.csv";
  std::ofstream(file) << "text,source\n\"the cat sat, on the mat\",a\n\"why \"\"42\"\"?\nhello\",b\n"
                      << "naïve dog,c\n";
  auto trainer = Trainer::from_text(
      job(out.str(), "source = \"csv\"\npath = \"" + file.string() + "\"\ntokenizer = \"" +
                         (*dir_ / "llama3").string() + "\"\npacking = true\nmax_seq_length = 4\n"),
      out.path());
  const auto dataset = dataset_of(*trainer);
  const auto tokenizer = Tokenizer::load((*dir_ / "llama3").string());
  std::vector<int64_t> stream;
  for (const std::string doc : {"the cat sat, on the mat", "why \"42\"?\nhello", "naïve dog"}) {
    const auto ids = tokenizer->encode(doc).ids;
    stream.insert(stream.end(), ids.begin(), ids.end());
    stream.push_back(*tokenizer->eos().id);
  }
  ASSERT_EQ(dataset->size(), static_cast<int64_t>((stream.size() - 1) / 4));
  for (int64_t i = 0; i < dataset->size(); ++i) {
    const Sample s = dataset->get(i);
    EXPECT_EQ(values(s.input_ids), std::vector<int64_t>(stream.begin() + i * 4, stream.begin() + i * 4 + 4));
    EXPECT_EQ(values(s.labels), std::vector<int64_t>(stream.begin() + i * 4 + 1, stream.begin() + i * 4 + 5));
  }
  EXPECT_EQ(tokenizer->encode("why \"42\"?\nhello").ids.front(), *tokenizer->bos().id);
}

}  // namespace
}  // namespace loom
