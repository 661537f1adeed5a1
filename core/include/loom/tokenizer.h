// loom/tokenizer.h — Hugging Face tokenizers in C++: a model folder's tokenizer.json (with
// tokenizer_config.json's special tokens and chat template) read into an encoder/decoder whose
// ids equal the `tokenizers` package's. Families: byte-level BPE (GPT-2, Llama 3, Qwen 2 and
// their split-regex kin) and WordPiece (BERT). See Note [Tokenizers] in
// core/src/tokenizer/tokenizer.cpp for the pipeline and what is refused.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

// The SDK is the core's exported surface: visible to plugins built with hidden visibility.
#pragma GCC visibility push(default)

namespace loom {

struct Encoding {
  std::vector<int64_t> ids;
  std::vector<int64_t> type_ids;       // 0 for the first text, 1 for a pair's second
  std::vector<uint8_t> special_mask;   // 1 where the post-processor added a special token
};

// The special tokens a model's files name (tokenizer_config.json, else none): the text of each
// and its id, when the vocabulary has it.
struct SpecialToken {
  std::string text;
  std::optional<int64_t> id;
};

class Tokenizer {
 public:
  // `path` is a tokenizer.json or a folder holding one (and maybe tokenizer_config.json).
  // Throws DataError naming the file for a missing file, bad JSON, or a model, normalizer,
  // pre-tokenizer, post-processor or decoder it does not support (with what is supported).
  static std::shared_ptr<const Tokenizer> load(const std::string& path);
  // Whether `folder` has a tokenizer.json.
  static bool present(const std::string& folder);

  virtual ~Tokenizer();
  // add_special_tokens runs the post-processor (BERT's [CLS] ... [SEP], Llama 3's BOS).
  virtual Encoding encode(std::string_view text, bool add_special_tokens = true) const = 0;
  virtual Encoding encode_pair(std::string_view text, std::string_view pair,
                               bool add_special_tokens = true) const = 0;
  // The post-processor alone, on ids already encoded without specials (`b`: a pair's second
  // text, or null): what encode(..., true) adds. Lets a caller truncate before it.
  virtual Encoding post_process(const std::vector<int64_t>& a, const std::vector<int64_t>* b,
                                bool add_special_tokens = true) const = 0;
  // How many ids the post-processor adds to one text (pair = false) or a pair.
  virtual int64_t num_special_tokens_to_add(bool pair) const = 0;
  virtual std::string decode(const std::vector<int64_t>& ids,
                             bool skip_special_tokens = true) const = 0;
  virtual std::optional<int64_t> token_to_id(std::string_view token) const = 0;
  virtual std::string id_to_token(int64_t id) const = 0;
  // Number of ids (model vocabulary plus added tokens beyond it).
  virtual int64_t vocab_size() const = 0;
  // Whether `id` is an added token marked special (never produced by the model's merges).
  virtual bool is_special(int64_t id) const = 0;

  // tokenizer_config.json's (or, where it is silent, the families' usual) special tokens.
  virtual const SpecialToken& bos() const = 0;
  virtual const SpecialToken& eos() const = 0;
  virtual const SpecialToken& pad() const = 0;
  // tokenizer_config.json's chat_template ("" when none).
  virtual const std::string& chat_template() const = 0;
  // e.g. "byte-level BPE, 50257 ids (tokenizer.json)".
  virtual std::string describe() const = 0;
};

}  // namespace loom

#pragma GCC visibility pop
