// Note [Tokenizers]: loom's C++ tokenizers against the `tokenizers` package. reference.py trains
// one tokenizer per family on a mixed corpus and encodes ~1 MB of held-out text (fortunes, this
// repository's code, synthetic Unicode: scripts with and without case, combining marks, CJK,
// RTL, emoji with ZWJ and skin tones, digits of several scripts, runs of odd whitespace, special
// tokens inside the text); loom must give the same ids, type ids and decoded text.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "loom/tokenizer.h"
#include "test_util.h"

namespace loom {
namespace {

using json = nlohmann::json;

// The reference files of one family, made by the test that reads them: ctest runs each family's
// test in a process of its own, so a suite-wide set-up trained all six families six times.
class TokenizerVsHf : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    test::run_command(std::string(LOOM_TEST_PYTHON) + " " + LOOM_SOURCE_DIR +
                      "/tests/core/tokenizer/reference.py make " + dir_.str() + " 1050000 " +
                      GetParam());
  }
  test::TempDir dir_;
};

std::string show(const std::string& text) { return json(text).dump().substr(0, 300); }

TEST_P(TokenizerVsHf, IdsTypeIdsAndDecodingEqualTokenizersPackage) {
  const auto folder = dir_ / GetParam();
  const auto tokenizer = Tokenizer::load(folder.string());
  std::ifstream in(folder / "expected.jsonl");
  std::string line;
  int64_t documents = 0, bytes = 0, mismatches = 0;
  while (std::getline(in, line)) {
    const json row = json::parse(line);
    const std::string text = row["text"];
    const bool pair = row.contains("text_pair");
    const Encoding e = pair ? tokenizer->encode_pair(text, row["text_pair"].get<std::string>())
                            : tokenizer->encode(text);
    const Encoding plain = tokenizer->encode(text, /*add_special_tokens=*/false);
    const auto expected = row["ids"].get<std::vector<int64_t>>();
    bool ok = e.ids == expected && e.type_ids == row["type_ids"].get<std::vector<int64_t>>() &&
              plain.ids == row["ids_plain"].get<std::vector<int64_t>>() &&
              tokenizer->decode(e.ids) == row["decoded"].get<std::string>();
    if (!ok && ++mismatches <= 3) {
      ADD_FAILURE() << GetParam() << " document " << documents << " " << show(text)
                    << "\n loom ids: " << json(e.ids).dump().substr(0, 400)
                    << "\n   hf ids: " << json(expected).dump().substr(0, 400)
                    << "\n loom decoded: " << show(tokenizer->decode(e.ids))
                    << "\n   hf decoded: " << show(row["decoded"].get<std::string>());
    }
    ++documents;
    bytes += static_cast<int64_t>(text.size());
  }
  EXPECT_EQ(mismatches, 0) << "of " << documents << " documents";
  EXPECT_GE(bytes, 1'000'000) << "the comparison must cover at least 1 MB of text";
  EXPECT_GT(documents, 100);
}

INSTANTIATE_TEST_SUITE_P(Families, TokenizerVsHf,
                         ::testing::Values("gpt2", "llama3", "qwen2", "bert", "llama2", "t5"),
                         [](const auto& info) { return info.param; });

TEST(Tokenizer, SpecialTokensAndChatTemplateComeFromTokenizerConfig) {
  test::TempDir dir;
  std::ofstream(dir / "tokenizer.json") << R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1,
    "ab": 2}, "merges": ["a b"]}, "added_tokens": [{"id": 3, "content": "<eos>", "special": true}]})";
  std::ofstream(dir / "tokenizer_config.json")
      << R"({"eos_token": {"content": "<eos>"}, "pad_token": "<eos>", "chat_template": "{{x}}"})";
  const auto t = Tokenizer::load(dir.str());
  EXPECT_EQ(t->eos().text, "<eos>");
  EXPECT_EQ(t->eos().id, 3);
  EXPECT_EQ(t->pad().id, 3);
  EXPECT_FALSE(t->bos().id.has_value());
  EXPECT_EQ(t->chat_template(), "{{x}}");
  EXPECT_EQ(t->encode("abab<eos>a").ids, (std::vector<int64_t>{2, 2, 3, 0}));
  EXPECT_EQ(t->decode({2, 3}), "ab");
  EXPECT_EQ(t->decode({2, 3}, /*skip_special_tokens=*/false), "ab <eos>");
  EXPECT_EQ(t->vocab_size(), 4);
}

TEST(Tokenizer, RefusesWhatItCannotReproduceNamingTheFileAndWhatIsSupported) {
  test::TempDir dir;
  const auto file = (dir / "tokenizer.json").string();
  std::ofstream(file) << R"({"model": {"type": "WordLevel", "vocab": {"a": 0}}})";
  EXPECT_THROW_WITH(Tokenizer::load(dir.str()), DataError, file, "'WordLevel' is not supported",
                    "WordPiece", "Unigram");
  // T5's and ALBERT's files: SentencePiece's compiled normalization rules.
  std::ofstream(file) << R"({"model": {"type": "Unigram", "vocab": [["a", -1.0]], "unk_id": 0},
    "normalizer": {"type": "Precompiled", "precompiled_charsmap": "AAAA"}})";
  EXPECT_THROW_WITH(Tokenizer::load(file), DataError, "'Precompiled' is not supported", "NFKC");
  std::ofstream(file) << R"({"model": {"type": "WordPiece", "vocab": {"[UNK]": 0}},
    "pre_tokenizer": {"type": "UnicodeScripts"}})";
  EXPECT_THROW_WITH(Tokenizer::load(file), DataError, "'UnicodeScripts' is not supported",
                    "Metaspace");
  std::ofstream(file) << R"({"model": {"type": "Unigram", "vocab": {"a": 0}}})";
  EXPECT_THROW_WITH(Tokenizer::load(file), DataError, "Unigram's model.vocab is not a list");
  std::ofstream(file) << "{\"model\": ";
  EXPECT_THROW_WITH(Tokenizer::load(file), DataError, file, "not valid JSON");
  EXPECT_THROW_WITH(Tokenizer::load((dir / "nowhere").string()), DataError, "no tokenizer.json");
}

}  // namespace
}  // namespace loom
