// Note [Tokenizers]
// ~~~~~~~~~~~~~~~~~
// A Hugging Face tokenizer.json is a pipeline, and loom runs the same one, stage by stage:
//
//   text -> added tokens split out (leftmost, longest; lstrip/rstrip/single_word honoured)
//        -> normalizer (NFC/NFD/NFKC/NFKD, Lowercase, BertNormalizer, Strip, StripAccents,
//           Replace, Prepend, Sequence) on each stretch between added tokens
//        -> pre-tokenizer (Split by regex or string with its five behaviours, ByteLevel with or
//           without GPT-2's regex, Metaspace with its prepend schemes, BertPreTokenizer,
//           Whitespace, WhitespaceSplit, Digits, Punctuation, Sequence) into words
//        -> model (BPE with merges by rank, ignore_merges, unk/byte_fallback; WordPiece greedy
//           longest-match; Unigram's Viterbi over piece scores) into ids
//        -> post-processor (TemplateProcessing, BertProcessing, ByteLevel) adding specials.
//   ids  -> tokens (special ones skipped on request) -> decoder chain (ByteLevel, WordPiece
//           with its cleanup, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence; none =
//           joined by spaces).
// So GPT-2, Llama 3 and Qwen 2 (byte-level BPE), BERT (WordPiece), Llama 2 and Mistral
// (SentencePiece BPE with byte fallback) and unigram files load.
//
// The regexes of Split (GPT-2's, Llama 3's, Qwen 2's ...) run in ICU's regex engine, whose
// \p{L}/\p{N} are the Unicode categories Oniguruma (the `tokenizers` package's engine) uses.
// Their \s differs (ICU: [\t\n\f\r\p{Z}]; Oniguruma: the White_Space property, which adds \v
// and U+0085), so \s and \S are rewritten to \p{White_Space} before compiling. BPE results are
// cached per word, as `tokenizers` does, and long words (SentencePiece's whole lines) merge
// through a queue, not a rescan. Anything else a file names (the WordLevel model, T5's and
// ALBERT's Precompiled normalizer, RobertaProcessing, continuing_subword_prefix in BPE ...) is
// refused by name with the list above, never approximated: ids that differ from the model's
// training are a silent disaster. tests/core/test_tokenizer.cpp checks ids, type ids and
// decoded text against `tokenizers` on ~1 MB of mixed text per family.
#include "loom/tokenizer.h"

#include <unicode/regex.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <limits>
#include <mutex>
#include <queue>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "loom/error.h"
#include "tokenizer/unicode.h"

namespace loom {
namespace tok {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------- errors and JSON helpers

struct FileContext {
  std::string path;
};

[[noreturn]] void refuse(const FileContext& file, const std::string& what) {
  throw DataError(detail::cat(file.path, ": ", what));
}

std::string type_of(const json& j) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string()) return "";
  return j["type"].get<std::string>();
}

std::string string_or(const json& j, const char* key, const std::string& fallback) {
  if (j.contains(key) && j[key].is_string()) return j[key].get<std::string>();
  return fallback;
}
bool bool_or(const json& j, const char* key, bool fallback) {
  if (j.contains(key) && j[key].is_boolean()) return j[key].get<bool>();
  return fallback;
}

// ---------------------------------------------------------------- regex (ICU)

// Oniguruma's \s is White_Space; ICU's is narrower: rewrite (see the Note).
std::string icu_pattern(const std::string& pattern) {
  std::string out;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '\\' && i + 1 < pattern.size()) {
      const char next = pattern[i + 1];
      if (next == 's') out += "\\p{White_Space}";
      else if (next == 'S') out += "\\P{White_Space}";
      else out += pattern.substr(i, 2);
      ++i;
    } else {
      out.push_back(pattern[i]);
    }
  }
  return out;
}

// A compiled pattern; matchers are per thread (ICU's are not thread-safe).
class Regex {
 public:
  Regex(const std::string& pattern, const FileContext& file) : id_(next_id_++) {
    UErrorCode status = U_ZERO_ERROR;
    UParseError parse{};
    pattern_.reset(icu::RegexPattern::compile(icu::UnicodeString::fromUTF8(icu_pattern(pattern)),
                                              0, parse, status));
    if (U_FAILURE(status))
      refuse(file, detail::cat("the regex '", pattern, "' does not compile (", u_errorName(status),
                               " at offset ", parse.offset, ")"));
  }
  // The byte ranges [begin, end) of the non-overlapping matches in `text` (valid UTF-8).
  void find_all(const std::string& text, std::vector<std::pair<size_t, size_t>>& out) const {
    out.clear();
    thread_local std::unordered_map<uint64_t, std::unique_ptr<icu::RegexMatcher>> matchers;
    auto& matcher = matchers[id_];
    UErrorCode status = U_ZERO_ERROR;
    if (!matcher) matcher.reset(pattern_->matcher(status));
    // UTF-16 index -> byte offset, walked once.
    thread_local std::vector<uint32_t> offsets;
    offsets.clear();
    icu::UnicodeString u16;
    size_t i = 0;
    while (i < text.size()) {
      size_t length;
      const char32_t c = next_code_point(text, i, &length);
      offsets.push_back(static_cast<uint32_t>(i));
      if (c >= 0x10000) offsets.push_back(static_cast<uint32_t>(i));
      u16.append(static_cast<UChar32>(c));
      i += length;
    }
    offsets.push_back(static_cast<uint32_t>(text.size()));
    matcher->reset(u16);
    while (matcher->find(status) && U_SUCCESS(status)) {
      const int32_t b = matcher->start(status), e = matcher->end(status);
      if (e > b) out.emplace_back(offsets[static_cast<size_t>(b)], offsets[static_cast<size_t>(e)]);
    }
    matcher->reset(icu::UnicodeString());  // drop the reference to u16
  }

 private:
  static inline std::atomic<uint64_t> next_id_{1};
  uint64_t id_;
  std::unique_ptr<icu::RegexPattern> pattern_;
};

// ---------------------------------------------------------------- normalizers

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual std::string apply(std::string s) const = 0;
};

template <class F>
std::string map_code_points(const std::string& s, F&& f) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t n;
    const char32_t c = next_code_point(s, i, &n);
    f(out, c);
    i += n;
  }
  return out;
}

std::string strip_accents(const std::string& s) {
  return map_code_points(normalize(s, NormalForm::NFD), [](std::string& out, char32_t c) {
    if (!is_nonspacing_mark(c)) append_utf8(out, c);
  });
}

bool is_chinese_char(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
         (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

class BertNormalizer final : public Normalizer {
 public:
  explicit BertNormalizer(const json& j)
      : clean_text_(bool_or(j, "clean_text", true)),
        chinese_(bool_or(j, "handle_chinese_chars", true)),
        lowercase_(bool_or(j, "lowercase", true)),
        strip_accents_(j.contains("strip_accents") && j["strip_accents"].is_boolean()
                           ? j["strip_accents"].get<bool>()
                           : lowercase_) {}
  std::string apply(std::string s) const override {
    if (clean_text_) {
      s = map_code_points(s, [](std::string& out, char32_t c) {
        const bool tab_or_newline = c == '\t' || c == '\n' || c == '\r';
        if (c == 0 || c == 0xFFFD || (!tab_or_newline && is_other(c))) return;
        if (tab_or_newline || is_white_space(c)) out.push_back(' ');
        else append_utf8(out, c);
      });
    }
    if (chinese_) {
      s = map_code_points(s, [](std::string& out, char32_t c) {
        if (is_chinese_char(c)) {
          out.push_back(' ');
          append_utf8(out, c);
          out.push_back(' ');
        } else {
          append_utf8(out, c);
        }
      });
    }
    if (strip_accents_) s = strip_accents(s);
    if (lowercase_) s = lowercase(s);
    return s;
  }

 private:
  bool clean_text_, chinese_, lowercase_, strip_accents_;
};

class FormNormalizer final : public Normalizer {
 public:
  explicit FormNormalizer(NormalForm form) : form_(form) {}
  std::string apply(std::string s) const override { return normalize(s, form_); }

 private:
  NormalForm form_;
};

class LambdaNormalizer final : public Normalizer {
 public:
  explicit LambdaNormalizer(std::function<std::string(std::string)> f) : f_(std::move(f)) {}
  std::string apply(std::string s) const override { return f_(std::move(s)); }

 private:
  std::function<std::string(std::string)> f_;
};

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  std::string out;
  size_t start = 0, hit;
  while ((hit = s.find(from, start)) != std::string::npos) {
    out.append(s, start, hit - start);
    out += to;
    start = hit + from.size();
  }
  out.append(s, start);
  return out;
}

std::string strip(const std::string& s, bool left, bool right) {
  size_t begin = 0, end = s.size();
  if (left) {
    while (begin < end) {
      size_t n;
      if (!is_white_space(next_code_point(s, begin, &n))) break;
      begin += n;
    }
  }
  if (right) {
    while (end > begin) {
      size_t start = end - 1;
      while (start > begin && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
      size_t n;
      if (!is_white_space(next_code_point(s, start, &n))) break;
      end = start;
    }
  }
  return s.substr(begin, end - begin);
}

std::unique_ptr<Normalizer> make_normalizer(const json& j, const FileContext& file);

class SequenceNormalizer final : public Normalizer {
 public:
  SequenceNormalizer(const json& j, const FileContext& file) {
    for (const auto& item : j.at("normalizers")) parts_.push_back(make_normalizer(item, file));
  }
  std::string apply(std::string s) const override {
    for (const auto& part : parts_) s = part->apply(std::move(s));
    return s;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

std::string literal_pattern(const json& pattern, const FileContext& file, const char* who) {
  if (pattern.is_object() && pattern.contains("String")) return pattern["String"].get<std::string>();
  refuse(file, detail::cat(who, " with a regex pattern is not supported (only {\"String\": ...})"));
}

std::unique_ptr<Normalizer> make_normalizer(const json& j, const FileContext& file) {
  const std::string type = type_of(j);
  if (type == "BertNormalizer") return std::make_unique<BertNormalizer>(j);
  if (type == "NFC") return std::make_unique<FormNormalizer>(NormalForm::NFC);
  if (type == "NFD") return std::make_unique<FormNormalizer>(NormalForm::NFD);
  if (type == "NFKC") return std::make_unique<FormNormalizer>(NormalForm::NFKC);
  if (type == "NFKD") return std::make_unique<FormNormalizer>(NormalForm::NFKD);
  if (type == "Lowercase")
    return std::make_unique<LambdaNormalizer>([](std::string s) { return lowercase(s); });
  if (type == "StripAccents")
    return std::make_unique<LambdaNormalizer>([](std::string s) { return strip_accents(s); });
  if (type == "Strip") {
    const bool left = bool_or(j, "strip_left", true), right = bool_or(j, "strip_right", true);
    return std::make_unique<LambdaNormalizer>(
        [left, right](std::string s) { return strip(s, left, right); });
  }
  if (type == "Replace") {
    const std::string from = literal_pattern(j.at("pattern"), file, "the Replace normalizer");
    const std::string to = j.at("content").get<std::string>();
    return std::make_unique<LambdaNormalizer>(
        [from, to](std::string s) { return replace_all(std::move(s), from, to); });
  }
  if (type == "Prepend") {
    const std::string prefix = j.at("prepend").get<std::string>();
    return std::make_unique<LambdaNormalizer>(
        [prefix](std::string s) { return s.empty() ? s : prefix + s; });
  }
  if (type == "Sequence") return std::make_unique<SequenceNormalizer>(j, file);
  refuse(file, detail::cat("the normalizer '", type.empty() ? j.dump() : type,
                           "' is not supported; loom reads BertNormalizer, NFC, NFD, NFKC, NFKD, "
                           "Lowercase, StripAccents, Strip, Replace (string), Prepend, Sequence"));
}

// ---------------------------------------------------------------- pre-tokenizers

// Bytes <-> the printable characters GPT-2's byte-level alphabet stands them for.
struct ByteAlphabet {
  std::string byte_to_text[256];
  std::unordered_map<char32_t, uint8_t> text_to_byte;
  ByteAlphabet() {
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      const char32_t c = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + extra++);
      append_utf8(byte_to_text[b], c);
      text_to_byte[c] = static_cast<uint8_t>(b);
    }
  }
};
const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet;
  return alphabet;
}

using Pieces = std::vector<std::string>;

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void apply(Pieces& pieces, bool at_start) const = 0;  // at_start: pieces[0] begins the text
};

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

Behavior parse_behavior(const json& j, const FileContext& file) {
  const std::string b = j.is_string() ? j.get<std::string>() : "";
  if (b == "Removed") return Behavior::Removed;
  if (b == "Isolated") return Behavior::Isolated;
  if (b == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::MergedWithNext;
  if (b == "Contiguous") return Behavior::Contiguous;
  refuse(file, detail::cat("unknown split behavior ", j.dump()));
}

// Splits `piece` at the spans `matches` marks (sorted, disjoint byte ranges) as HF's
// NormalizedString::split does for each behaviour.
void split_by(const std::string& piece, const std::vector<std::pair<size_t, size_t>>& matches,
              Behavior behavior, bool invert, Pieces& out) {
  // Spans covering the piece, each flagged as a match or not.
  std::vector<std::tuple<size_t, size_t, bool>> spans;
  size_t at = 0;
  for (const auto& [b, e] : matches) {
    if (b > at) spans.emplace_back(at, b, invert);
    spans.emplace_back(b, e, !invert);
    at = e;
  }
  if (at < piece.size()) spans.emplace_back(at, piece.size(), invert);
  std::vector<std::pair<size_t, size_t>> result;
  bool previous_was_match = false;
  for (const auto& [b, e, is_match] : spans) {
    switch (behavior) {
      case Behavior::Removed:
        if (!is_match) result.emplace_back(b, e);
        break;
      case Behavior::Isolated:
        result.emplace_back(b, e);
        break;
      case Behavior::Contiguous:
        if (is_match && previous_was_match && !result.empty()) result.back().second = e;
        else result.emplace_back(b, e);
        break;
      case Behavior::MergedWithPrevious:
        if (is_match && !result.empty() && !previous_was_match) result.back().second = e;
        else result.emplace_back(b, e);
        break;
      case Behavior::MergedWithNext:
        if (!is_match && previous_was_match && !result.empty()) result.back().second = e;
        else result.emplace_back(b, e);
        break;
    }
    previous_was_match = is_match;
  }
  for (const auto& [b, e] : result)
    if (e > b) out.push_back(piece.substr(b, e - b));
}

// Every code point for which `pred` holds is one match.
template <class Pred>
void char_matches(const std::string& s, Pred&& pred, std::vector<std::pair<size_t, size_t>>& out) {
  out.clear();
  for (size_t i = 0; i < s.size();) {
    size_t n;
    if (pred(next_code_point(s, i, &n))) out.emplace_back(i, i + n);
    i += n;
  }
}

template <class Pred>
class CharSplit final : public PreTokenizer {
 public:
  CharSplit(Pred pred, Behavior behavior, bool contiguous_runs)
      : pred_(std::move(pred)), behavior_(behavior), runs_(contiguous_runs) {}
  void apply(Pieces& pieces, bool at_start) const override {
    Pieces out;
    std::vector<std::pair<size_t, size_t>> matches;
    for (const auto& piece : pieces) {
      char_matches(piece, pred_, matches);
      if (runs_) {  // adjacent matching code points form one match
        std::vector<std::pair<size_t, size_t>> merged;
        for (const auto& m : matches) {
          if (!merged.empty() && merged.back().second == m.first) merged.back().second = m.second;
          else merged.push_back(m);
        }
        matches.swap(merged);
      }
      split_by(piece, matches, behavior_, false, out);
    }
    pieces.swap(out);
  }

 private:
  Pred pred_;
  Behavior behavior_;
  bool runs_;
};
template <class Pred>
std::unique_ptr<PreTokenizer> char_split(Pred pred, Behavior behavior, bool runs = false) {
  return std::make_unique<CharSplit<Pred>>(std::move(pred), behavior, runs);
}

class RegexSplit final : public PreTokenizer {
 public:
  RegexSplit(const std::string& pattern, Behavior behavior, bool invert, const FileContext& file)
      : regex_(pattern, file), behavior_(behavior), invert_(invert) {}
  void apply(Pieces& pieces, bool at_start) const override {
    Pieces out;
    std::vector<std::pair<size_t, size_t>> matches;
    for (const auto& piece : pieces) {
      regex_.find_all(piece, matches);
      split_by(piece, matches, behavior_, invert_, out);
    }
    pieces.swap(out);
  }

 private:
  Regex regex_;
  Behavior behavior_;
  bool invert_;
};

class StringSplit final : public PreTokenizer {
 public:
  StringSplit(std::string pattern, Behavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void apply(Pieces& pieces, bool at_start) const override {
    Pieces out;
    std::vector<std::pair<size_t, size_t>> matches;
    for (const auto& piece : pieces) {
      matches.clear();
      if (!pattern_.empty()) {
        size_t at = 0, hit;
        while ((hit = piece.find(pattern_, at)) != std::string::npos) {
          matches.emplace_back(hit, hit + pattern_.size());
          at = hit + pattern_.size();
        }
      }
      split_by(piece, matches, behavior_, invert_, out);
    }
    pieces.swap(out);
  }

 private:
  std::string pattern_;
  Behavior behavior_;
  bool invert_;
};

const char* kGpt2Split =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

class ByteLevelPre final : public PreTokenizer {
 public:
  ByteLevelPre(const json& j, const FileContext& file)
      : add_prefix_space_(bool_or(j, "add_prefix_space", false)) {
    if (bool_or(j, "use_regex", true))
      split_ = std::make_unique<RegexSplit>(kGpt2Split, Behavior::Isolated, false, file);
  }
  void apply(Pieces& pieces, bool at_start) const override {
    if (add_prefix_space_)
      for (auto& piece : pieces)
        if (!piece.empty() && piece[0] != ' ') piece.insert(piece.begin(), ' ');
    if (split_) split_->apply(pieces, at_start);
    const auto& alphabet = byte_alphabet();
    for (auto& piece : pieces) {
      std::string mapped;
      mapped.reserve(piece.size() * 2);
      for (const char ch : piece) mapped += alphabet.byte_to_text[static_cast<unsigned char>(ch)];
      piece.swap(mapped);
    }
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<RegexSplit> split_;
};

// SentencePiece's word boundary (Llama 2, Mistral, T5): spaces become the replacement (U+2581
// "▁"), one is prepended per prepend_scheme (always; first: only where the text begins, not
// after an added token; never), and with split the text is cut before each replacement.
class MetaspacePre final : public PreTokenizer {
 public:
  MetaspacePre(const json& j, const FileContext& file)
      : replacement_(string_or(j, "replacement", "\u2581")), split_(bool_or(j, "split", true)) {
    std::string scheme = string_or(j, "prepend_scheme", "");
    if (scheme.empty())  // files of tokenizers < 0.19: add_prefix_space
      scheme = bool_or(j, "add_prefix_space", true) ? "always" : "never";
    if (scheme == "always") prepend_ = Prepend::Always;
    else if (scheme == "first") prepend_ = Prepend::First;
    else if (scheme == "never") prepend_ = Prepend::Never;
    else refuse(file, detail::cat("Metaspace prepend_scheme '", scheme, "' is not always, first or never"));
  }
  void apply(Pieces& pieces, bool at_start) const override {
    Pieces out;
    for (size_t p = 0; p < pieces.size(); ++p) {
      std::string piece = replace_all(pieces[p], " ", replacement_);
      const bool prepend = prepend_ == Prepend::Always || (prepend_ == Prepend::First && at_start && p == 0);
      if (prepend && piece.rfind(replacement_, 0) != 0) piece = replacement_ + piece;
      if (!split_) {
        out.push_back(std::move(piece));
        continue;
      }
      std::vector<std::pair<size_t, size_t>> matches;
      for (size_t at = 0, hit; (hit = piece.find(replacement_, at)) != std::string::npos;
           at = hit + replacement_.size())
        matches.emplace_back(hit, hit + replacement_.size());
      split_by(piece, matches, Behavior::MergedWithNext, false, out);
    }
    pieces.swap(out);
  }
  const std::string& replacement() const { return replacement_; }

 private:
  enum class Prepend { Always, First, Never };
  std::string replacement_;
  bool split_;
  Prepend prepend_ = Prepend::Always;
};

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, const FileContext& file);

class SequencePre final : public PreTokenizer {
 public:
  SequencePre(const json& j, const FileContext& file) {
    for (const auto& item : j.at("pretokenizers")) parts_.push_back(make_pre_tokenizer(item, file));
  }
  void apply(Pieces& pieces, bool at_start) const override {
    for (const auto& part : parts_) part->apply(pieces, at_start);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

// BERT's and the Punctuation pre-tokenizer's test: ASCII punctuation (which counts $+<=>^`|~,
// symbols to Unicode) or a Unicode P* category.
bool is_bert_punctuation(char32_t c) {
  return (c < 0x80 && std::ispunct(static_cast<int>(c))) || is_punctuation(c);
}

class BertPre final : public PreTokenizer {
 public:
  void apply(Pieces& pieces, bool at_start) const override {
    whitespace_->apply(pieces, at_start);
    punctuation_->apply(pieces, at_start);
  }

 private:
  std::unique_ptr<PreTokenizer> whitespace_ =
      char_split([](char32_t c) { return is_white_space(c); }, Behavior::Removed);
  std::unique_ptr<PreTokenizer> punctuation_ = char_split(is_bert_punctuation, Behavior::Isolated);
};

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, const FileContext& file) {
  const std::string type = type_of(j);
  if (type == "ByteLevel") return std::make_unique<ByteLevelPre>(j, file);
  if (type == "Sequence") return std::make_unique<SequencePre>(j, file);
  if (type == "BertPreTokenizer") return std::make_unique<BertPre>();
  if (type == "Split") {
    const Behavior behavior = parse_behavior(j.at("behavior"), file);
    const bool invert = bool_or(j, "invert", false);
    const json& pattern = j.at("pattern");
    if (pattern.contains("Regex"))
      return std::make_unique<RegexSplit>(pattern["Regex"].get<std::string>(), behavior, invert, file);
    return std::make_unique<StringSplit>(pattern.at("String").get<std::string>(), behavior, invert);
  }
  if (type == "Whitespace")
    return std::make_unique<RegexSplit>("\\w+|[^\\w\\s]+", Behavior::Removed, true, file);
  if (type == "WhitespaceSplit")
    return char_split([](char32_t c) { return is_white_space(c); }, Behavior::Removed);
  if (type == "Digits") {
    const bool individual = bool_or(j, "individual_digits", false);
    return char_split([](char32_t c) { return c < 0x80 && c >= '0' && c <= '9'; },
                      individual ? Behavior::Isolated : Behavior::Contiguous);
  }
  if (type == "Metaspace") return std::make_unique<MetaspacePre>(j, file);
  if (type == "Punctuation") {
    const Behavior behavior =
        j.contains("behavior") ? parse_behavior(j["behavior"], file) : Behavior::Isolated;
    return char_split(is_bert_punctuation, behavior);
  }
  refuse(file, detail::cat("the pre-tokenizer '", type.empty() ? j.dump() : type,
                           "' is not supported; loom reads ByteLevel, Metaspace, Split, "
                           "BertPreTokenizer, Whitespace, WhitespaceSplit, Digits, Punctuation, "
                           "Sequence"));
}

// ---------------------------------------------------------------- models

class Model {
 public:
  virtual ~Model() = default;
  virtual void tokenize(const std::string& word, std::vector<int64_t>& ids) const = 0;
  std::optional<int64_t> token_to_id(std::string_view token) const {
    const auto it = vocab_.find(std::string(token));
    if (it == vocab_.end()) return std::nullopt;
    return it->second;
  }
  const std::unordered_map<std::string, int64_t>& vocab() const { return vocab_; }

 protected:
  void read_vocab(const json& vocab, const FileContext& file) {
    if (!vocab.is_object()) refuse(file, "model.vocab is not an object of token -> id");
    vocab_.reserve(vocab.size());
    for (const auto& [token, id] : vocab.items()) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0)
        refuse(file, detail::cat("model.vocab['", token, "'] is not a non-negative integer id"));
      vocab_.emplace(token, id.get<int64_t>());
    }
  }
  std::unordered_map<std::string, int64_t> vocab_;
};

class Bpe final : public Model {
 public:
  Bpe(const json& j, const FileContext& file) {
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (j.contains(key) && !j[key].is_null() && !j[key].get<std::string>().empty())
        refuse(file, detail::cat("BPE with ", key,
                                 " is not supported (the byte-level BPE of GPT-2, Llama 3 and Qwen "
                                 "is); ask for it with this file"));
    if (j.contains("dropout") && j["dropout"].is_number() && j["dropout"].get<double>() > 0)
      refuse(file, "BPE dropout is a training-time sampling loom does not do; set it to null");
    read_vocab(j.at("vocab"), file);
    ignore_merges_ = bool_or(j, "ignore_merges", false);
    byte_fallback_ = bool_or(j, "byte_fallback", false);
    fuse_unk_ = bool_or(j, "fuse_unk", false);
    if (j.contains("unk_token") && j["unk_token"].is_string()) {
      const auto unk = token_to_id(j["unk_token"].get<std::string>());
      if (unk) unk_ = *unk;
    }
    const json& merges = j.at("merges");
    merges_.reserve(merges.size());
    int64_t rank = 0;
    for (const auto& merge : merges) {
      std::string a, b;
      if (merge.is_string()) {
        const std::string s = merge.get<std::string>();
        const size_t space = s.find(' ');
        if (space == std::string::npos) refuse(file, detail::cat("merge '", s, "' has no space"));
        a = s.substr(0, space);
        b = s.substr(space + 1);
      } else if (merge.is_array() && merge.size() == 2) {
        a = merge[0].get<std::string>();
        b = merge[1].get<std::string>();
      } else {
        refuse(file, detail::cat("merge ", merge.dump(), " is neither \"a b\" nor [\"a\", \"b\"]"));
      }
      const auto ia = token_to_id(a), ib = token_to_id(b), ic = token_to_id(a + b);
      if (!ia || !ib || !ic)
        refuse(file, detail::cat("merge '", a, " ", b, "' names a token the vocab lacks"));
      merges_.emplace(key(*ia, *ib), std::make_pair(rank++, *ic));
    }
  }

  void tokenize(const std::string& word, std::vector<int64_t>& ids) const override {
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      const auto hit = cache_.find(word);
      if (hit != cache_.end()) {
        ids.insert(ids.end(), hit->second.begin(), hit->second.end());
        return;
      }
    }
    std::vector<int64_t> symbols;
    if (ignore_merges_) {
      if (const auto whole = token_to_id(word)) symbols.push_back(*whole);
    }
    if (symbols.empty()) {
      initial_symbols(word, symbols);
      merge(symbols);
    }
    ids.insert(ids.end(), symbols.begin(), symbols.end());
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() > 200000) cache_.clear();
    cache_.emplace(word, std::move(symbols));
  }

 private:
  static uint64_t key(int64_t a, int64_t b) {
    return (static_cast<uint64_t>(a) << 32) | static_cast<uint64_t>(b);
  }
  void initial_symbols(const std::string& word, std::vector<int64_t>& symbols) const {
    bool previous_unk = false;
    for (size_t i = 0; i < word.size();) {
      size_t n;
      next_code_point(word, i, &n);
      const std::string ch = word.substr(i, n);
      i += n;
      if (const auto id = token_to_id(ch)) {
        symbols.push_back(*id);
        previous_unk = false;
        continue;
      }
      if (byte_fallback_) {
        bool all = true;
        std::vector<int64_t> bytes;
        for (const char c : ch) {
          char name[8];
          std::snprintf(name, sizeof name, "<0x%02X>", static_cast<unsigned char>(c));
          const auto id = token_to_id(name);
          if (!id) { all = false; break; }
          bytes.push_back(*id);
        }
        if (all) {
          symbols.insert(symbols.end(), bytes.begin(), bytes.end());
          previous_unk = false;
          continue;
        }
      }
      if (unk_ >= 0) {
        if (!(fuse_unk_ && previous_unk)) symbols.push_back(unk_);
        previous_unk = true;
      }
      // Without an unk token `tokenizers` drops the character; so does loom.
    }
  }
  // Merge the pair of lowest rank (leftmost among equals) until none is left: by scanning for
  // short words, through a queue for long ones (a SentencePiece BPE's word is a whole line).
  void merge(std::vector<int64_t>& symbols) const {
    if (symbols.size() > 32) return merge_long(symbols);
    while (symbols.size() > 1) {
      int64_t best_rank = INT64_MAX, best_id = -1;
      size_t best_at = 0;
      for (size_t i = 0; i + 1 < symbols.size(); ++i) {
        const auto it = merges_.find(key(symbols[i], symbols[i + 1]));
        if (it != merges_.end() && it->second.first < best_rank) {
          best_rank = it->second.first;
          best_id = it->second.second;
          best_at = i;
        }
      }
      if (best_id < 0) break;
      symbols[best_at] = best_id;
      symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
    }
  }

  // The same choices in O(n log n): a min-queue of (rank, left symbol's index) for every
  // adjacent pair that merges; entries whose pair changed since are skipped when popped.
  void merge_long(std::vector<int64_t>& symbols) const {
    struct Entry {
      int64_t rank;
      int64_t pos;
      int64_t id;
      bool operator>(const Entry& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue;
    const int64_t n = static_cast<int64_t>(symbols.size());
    std::vector<int64_t> prev(static_cast<size_t>(n)), next(static_cast<size_t>(n));
    std::vector<uint8_t> alive(static_cast<size_t>(n), 1);
    auto offer = [&](int64_t left, int64_t right) {
      const auto it = merges_.find(key(symbols[left], symbols[right]));
      if (it != merges_.end()) queue.push({it->second.first, left, it->second.second});
    };
    for (int64_t i = 0; i < n; ++i) {
      prev[i] = i - 1;
      next[i] = i + 1 < n ? i + 1 : -1;
      if (i + 1 < n) offer(i, i + 1);
    }
    while (!queue.empty()) {
      const Entry top = queue.top();
      queue.pop();
      const int64_t right = next[top.pos];
      if (!alive[top.pos] || right < 0) continue;
      const auto it = merges_.find(key(symbols[top.pos], symbols[right]));
      if (it == merges_.end() || it->second.first != top.rank || it->second.second != top.id) continue;
      symbols[top.pos] = top.id;
      alive[right] = 0;
      next[top.pos] = next[right];
      if (next[right] >= 0) prev[next[right]] = top.pos;
      if (prev[top.pos] >= 0) offer(prev[top.pos], top.pos);
      if (next[top.pos] >= 0) offer(top.pos, next[top.pos]);
    }
    std::vector<int64_t> out;
    for (int64_t i = 0; i >= 0; i = next[i]) out.push_back(symbols[i]);
    symbols.swap(out);
  }

  std::unordered_map<uint64_t, std::pair<int64_t, int64_t>> merges_;
  bool ignore_merges_ = false, byte_fallback_ = false, fuse_unk_ = false;
  int64_t unk_ = -1;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

class WordPiece final : public Model {
 public:
  WordPiece(const json& j, const FileContext& file)
      : prefix_(string_or(j, "continuing_subword_prefix", "##")),
        max_chars_(j.value("max_input_chars_per_word", int64_t{100})) {
    read_vocab(j.at("vocab"), file);
    const std::string unk = string_or(j, "unk_token", "[UNK]");
    const auto id = token_to_id(unk);
    if (!id) refuse(file, detail::cat("WordPiece's unk_token '", unk, "' is not in the vocab"));
    unk_ = *id;
  }
  void tokenize(const std::string& word, std::vector<int64_t>& ids) const override {
    std::vector<size_t> starts;  // byte offset of each code point
    for (size_t i = 0; i < word.size();) {
      size_t n;
      next_code_point(word, i, &n);
      starts.push_back(i);
      i += n;
    }
    if (static_cast<int64_t>(starts.size()) > max_chars_) {
      ids.push_back(unk_);
      return;
    }
    starts.push_back(word.size());
    const size_t before = ids.size();
    size_t begin = 0;  // index into starts
    while (begin + 1 < starts.size()) {
      size_t end = starts.size() - 1;
      std::optional<int64_t> found;
      while (end > begin) {
        std::string piece = word.substr(starts[begin], starts[end] - starts[begin]);
        if (begin > 0) piece = prefix_ + piece;
        if ((found = token_to_id(piece))) break;
        --end;
      }
      if (!found) {
        ids.resize(before);
        ids.push_back(unk_);
        return;
      }
      ids.push_back(*found);
      begin = end;
    }
  }

 private:
  std::string prefix_;
  int64_t max_chars_;
  int64_t unk_ = 0;
};

// SentencePiece's unigram model (T5, ALBERT, XLNet, mBART): the segmentation of most total
// log-probability (Viterbi over every vocabulary piece that starts at each character), as
// `tokenizers` computes it: candidates in order of length, a later one only when strictly
// better; a character no piece covers costs the lowest score - 10 and becomes unk, runs of
// them fused into one (fuse_unk); a piece not in the vocabulary falls back to <0xHH> bytes
// (byte_fallback) or unk.
class Unigram final : public Model {
 public:
  Unigram(const json& j, const FileContext& file) {
    const json& vocab = j.at("vocab");
    if (!vocab.is_array()) refuse(file, "Unigram's model.vocab is not a list of [piece, score]");
    scores_.reserve(vocab.size());
    double min_score = std::numeric_limits<double>::infinity();
    for (size_t id = 0; id < vocab.size(); ++id) {
      const json& entry = vocab[id];
      if (!entry.is_array() || entry.size() != 2 || !entry[0].is_string() || !entry[1].is_number())
        refuse(file, detail::cat("Unigram's model.vocab[", id, "] is not [piece, score]"));
      const std::string piece = entry[0].get<std::string>();
      vocab_.emplace(piece, static_cast<int64_t>(id));
      scores_.push_back(entry[1].get<double>());
      min_score = std::min(min_score, scores_.back());
      max_piece_ = std::max(max_piece_, piece.size());
    }
    unk_score_ = min_score - 10.0;
    if (j.contains("unk_id") && j["unk_id"].is_number_integer()) unk_ = j["unk_id"].get<int64_t>();
    byte_fallback_ = bool_or(j, "byte_fallback", false);
  }

  void tokenize(const std::string& word, std::vector<int64_t>& ids) const override {
    struct Node {
      double score = 0;
      int64_t start = -1;  // -1: not reached
      int64_t id = -1;
    };
    const size_t size = word.size();
    std::vector<Node> best(size + 1);
    best[0].start = 0;
    for (size_t at = 0; at < size;) {
      size_t char_len;
      next_code_point(word, at, &char_len);
      const double here = best[at].score;
      bool single = false;
      for (size_t len = 1; len <= max_piece_ && at + len <= size; ++len) {
        const auto it = vocab_.find(word.substr(at, len));
        if (it == vocab_.end()) continue;
        Node& target = best[at + len];
        const double candidate = here + scores_[static_cast<size_t>(it->second)];
        if (target.start < 0 || candidate > target.score) target = {candidate, static_cast<int64_t>(at), it->second};
        if (len == char_len) single = true;
      }
      if (!single) {
        LOOM_CHECK_AS(DataError, unk_ >= 0, "the Unigram tokenizer has no unk_id, and '",
                      word.substr(at, char_len), "' has no piece");
        Node& target = best[at + char_len];
        const double candidate = here + unk_score_;
        if (target.start < 0 || candidate > target.score) target = {candidate, static_cast<int64_t>(at), unk_};
      }
      at += char_len;
    }
    // Back from the end: the pieces, with runs of unk fused into one string.
    std::vector<std::string> pieces;
    std::string unk_run;
    for (size_t end = size; end > 0;) {
      const Node& node = best[end];
      const std::string piece = word.substr(static_cast<size_t>(node.start), end - static_cast<size_t>(node.start));
      if (node.id == unk_) {
        unk_run = piece + unk_run;
      } else {
        if (!unk_run.empty()) pieces.push_back(std::move(unk_run));
        unk_run.clear();
        pieces.push_back(piece);
      }
      end = static_cast<size_t>(node.start);
    }
    if (!unk_run.empty()) pieces.push_back(std::move(unk_run));
    for (auto it = pieces.rbegin(); it != pieces.rend(); ++it) {
      if (const auto id = token_to_id(*it)) {
        ids.push_back(*id);
        continue;
      }
      if (byte_fallback_) {
        std::vector<int64_t> bytes;
        for (const char c : *it) {
          char name[8];
          std::snprintf(name, sizeof name, "<0x%02X>", static_cast<unsigned char>(c));
          const auto id = token_to_id(name);
          if (!id) break;
          bytes.push_back(*id);
        }
        if (bytes.size() == it->size()) {
          ids.insert(ids.end(), bytes.begin(), bytes.end());
          continue;
        }
      }
      ids.push_back(unk_);
    }
  }

 private:
  std::vector<double> scores_;
  size_t max_piece_ = 0;
  double unk_score_ = 0;
  int64_t unk_ = -1;
  bool byte_fallback_ = false;
};

// ---------------------------------------------------------------- post-processors

struct Piece {
  bool is_sequence;  // A or B
  bool second;       // B (sequence) — for specials unused
  std::vector<int64_t> ids;  // special's ids
  int64_t type_id;
};

class PostProcessor {
 public:
  std::vector<Piece> single, pair;
  bool has_pair = false;
};

std::vector<Piece> template_pieces(const json& list, const json& specials, const FileContext& file) {
  std::vector<Piece> pieces;
  for (const auto& item : list) {
    if (item.contains("Sequence")) {
      const auto& s = item["Sequence"];
      pieces.push_back({true, s.at("id").get<std::string>() == "B", {}, s.value("type_id", int64_t{0})});
    } else if (item.contains("SpecialToken")) {
      const auto& s = item["SpecialToken"];
      const std::string name = s.at("id").get<std::string>();
      if (!specials.contains(name))
        refuse(file, detail::cat("the post-processor's template names '", name,
                                 "', which its special_tokens lack"));
      pieces.push_back({false, false, specials[name].at("ids").get<std::vector<int64_t>>(),
                        s.value("type_id", int64_t{0})});
    } else {
      refuse(file, detail::cat("a template piece ", item.dump(), " is neither Sequence nor SpecialToken"));
    }
  }
  return pieces;
}

void make_post_processor(const json& j, const FileContext& file, PostProcessor& post) {
  if (j.is_null()) return;
  const std::string type = type_of(j);
  if (type == "ByteLevel") return;  // offsets only; ids unchanged
  if (type == "TemplateProcessing") {
    const json& specials = j.contains("special_tokens") ? j["special_tokens"] : json::object();
    post.single = template_pieces(j.at("single"), specials, file);
    if (j.contains("pair") && j["pair"].is_array()) {
      post.pair = template_pieces(j["pair"], specials, file);
      post.has_pair = true;
    }
    return;
  }
  if (type == "BertProcessing") {
    const int64_t sep = j.at("sep").at(1).get<int64_t>(), cls = j.at("cls").at(1).get<int64_t>();
    post.single = {{false, false, {cls}, 0}, {true, false, {}, 0}, {false, false, {sep}, 0}};
    post.pair = {{false, false, {cls}, 0}, {true, false, {}, 0}, {false, false, {sep}, 0},
                 {true, true, {}, 1}, {false, false, {sep}, 1}};
    post.has_pair = true;
    return;
  }
  if (type == "Sequence") {
    for (const auto& item : j.at("processors")) make_post_processor(item, file, post);
    return;
  }
  refuse(file, detail::cat("the post-processor '", type.empty() ? j.dump() : type,
                           "' is not supported; loom reads TemplateProcessing, BertProcessing, "
                           "ByteLevel, Sequence"));
}

// ---------------------------------------------------------------- decoders

// Decoders as `tokenizers` runs them: each step maps the list of token strings to another
// (decode_chain), and the result is joined without spaces; no decoder at all joins with spaces.
using Tokens = std::vector<std::string>;
using DecodeStep = std::function<void(Tokens&)>;
std::string cleanup_spaces(std::string s);

// "<0xHH>" -> the byte, else -1.
int byte_token(const std::string& token) {
  if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return -1;
  int value = 0;
  for (int k = 3; k < 5; ++k) {
    const char c = token[static_cast<size_t>(k)];
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10
                    : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}

bool valid_utf8(const std::string& bytes) {
  for (size_t i = 0; i < bytes.size();) {
    size_t n;
    if (next_code_point(bytes, i, &n) == 0xFFFD && bytes.compare(i, 3, "\xEF\xBF\xBD") != 0) return false;
    i += n;
  }
  return true;
}

void decode_steps(const json& j, const FileContext& file, std::vector<DecodeStep>& steps) {
  const std::string type = type_of(j);
  if (type == "Sequence") {
    for (const auto& item : j.at("decoders")) decode_steps(item, file, steps);
  } else if (type == "ByteLevel") {
    steps.push_back([](Tokens& tokens) {
      const auto& alphabet = byte_alphabet();
      std::string bytes;
      for (const auto& token : tokens) {
        std::string mapped;
        bool all = true;
        for (size_t i = 0; i < token.size() && all;) {
          size_t n;
          const auto it = alphabet.text_to_byte.find(next_code_point(token, i, &n));
          if (it == alphabet.text_to_byte.end()) all = false;
          else mapped.push_back(static_cast<char>(it->second));
          i += n;
        }
        bytes += all ? mapped : token;
      }
      tokens = {utf8_lossy(bytes)};
    });
  } else if (type == "WordPiece") {
    const std::string prefix = string_or(j, "prefix", "##");
    const bool cleanup = bool_or(j, "cleanup", true);
    steps.push_back([prefix, cleanup](Tokens& tokens) {
      for (size_t i = 0; i < tokens.size(); ++i) {
        std::string& token = tokens[i];
        if (i != 0) {
          if (token.rfind(prefix, 0) == 0) token = token.substr(prefix.size());
          else token = " " + token;
        }
        if (cleanup) token = cleanup_spaces(std::move(token));
      }
    });
  } else if (type == "Replace") {
    const std::string from = literal_pattern(j.at("pattern"), file, "the Replace decoder");
    const std::string to = j.at("content").get<std::string>();
    steps.push_back([from, to](Tokens& tokens) {
      for (auto& token : tokens) token = replace_all(std::move(token), from, to);
    });
  } else if (type == "ByteFallback") {
    // Runs of <0xHH> become their bytes when those are UTF-8, else one U+FFFD per byte.
    steps.push_back([](Tokens& tokens) {
      Tokens out;
      std::string bytes;
      size_t count = 0;
      auto flush = [&] {
        if (count == 0) return;
        if (valid_utf8(bytes)) out.push_back(bytes);
        else out.insert(out.end(), count, "\xEF\xBF\xBD");
        bytes.clear();
        count = 0;
      };
      for (auto& token : tokens) {
        if (const int byte = byte_token(token); byte >= 0) {
          bytes.push_back(static_cast<char>(byte));
          ++count;
          continue;
        }
        flush();
        out.push_back(std::move(token));
      }
      flush();
      tokens.swap(out);
    });
  } else if (type == "Fuse") {
    steps.push_back([](Tokens& tokens) {
      std::string all;
      for (const auto& token : tokens) all += token;
      tokens = {all};
    });
  } else if (type == "Strip") {
    // Up to `start` leading and `stop` trailing copies of the character `content`, per token.
    std::string content = j.at("content").get<std::string>();
    size_t n = 0;
    const char32_t c = content.empty() ? 0 : next_code_point(content, 0, &n);
    const int64_t start = j.value("start", int64_t{0}), stop = j.value("stop", int64_t{0});
    steps.push_back([c, start, stop](Tokens& tokens) {
      for (auto& token : tokens) {
        std::vector<size_t> at;  // byte offset of each code point, and the end
        for (size_t i = 0; i < token.size();) {
          size_t len;
          next_code_point(token, i, &len);
          at.push_back(i);
          i += len;
        }
        at.push_back(token.size());
        const size_t chars = at.size() - 1;
        size_t len, begin = 0, end = chars;
        for (size_t i = 0; i < static_cast<size_t>(start) && i < chars &&
                           next_code_point(token, at[i], &len) == c; ++i)
          begin = i + 1;
        for (size_t i = 0; i < static_cast<size_t>(stop) && i < chars; ++i) {
          const size_t index = chars - i - 1;
          if (next_code_point(token, at[index], &len) != c) break;
          end = index;
        }
        token = begin < end ? token.substr(at[begin], at[end] - at[begin]) : "";
      }
    });
  } else if (type == "Metaspace") {
    // The replacement becomes a space, except in the first token (the prepended one goes).
    const std::string replacement = string_or(j, "replacement", "\u2581");
    std::string scheme = string_or(j, "prepend_scheme", "");
    if (scheme.empty()) scheme = bool_or(j, "add_prefix_space", true) ? "always" : "never";
    const bool drop_first = scheme != "never";
    steps.push_back([replacement, drop_first](Tokens& tokens) {
      for (size_t i = 0; i < tokens.size(); ++i)
        tokens[i] = replace_all(std::move(tokens[i]), replacement, i == 0 && drop_first ? "" : " ");
    });
  } else {
    refuse(file, detail::cat("the decoder '", type.empty() ? j.dump() : type,
                             "' is not supported; loom reads ByteLevel, WordPiece, Metaspace, "
                             "Replace, ByteFallback, Fuse, Strip, Sequence"));
  }
}

struct Decoder {
  bool present = false;
  std::vector<DecodeStep> steps;
};

void make_decoder(const json& j, const FileContext& file, Decoder& decoder) {
  if (j.is_null()) return;
  decoder.present = true;
  decode_steps(j, file, decoder.steps);
}

std::string cleanup_spaces(std::string s) {
  static const std::pair<const char*, const char*> kReplacements[] = {
      {" .", "."}, {" ?", "?"}, {" !", "!"}, {" ,", ","}, {" ' ", "'"}, {" n't", "n't"},
      {" 'm", "'m"}, {" do not", " don't"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  for (const auto& [from, to] : kReplacements) s = replace_all(std::move(s), from, to);
  return s;
}

// ---------------------------------------------------------------- the tokenizer

struct AddedToken {
  int64_t id;
  std::string content;
  bool special, single_word, lstrip, rstrip;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(detail::cat(path, ": cannot read (missing or unreadable)"));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

json parse_json(const std::string& path) {
  try {
    return json::parse(read_file(path));
  } catch (const json::exception& error) {
    throw DataError(detail::cat(path, ": not valid JSON (", error.what(), ")"));
  }
}

bool is_word_char(char32_t c) { return is_letter(c) || is_number(c) || c == '_'; }

class HfTokenizer final : public Tokenizer {
 public:
  HfTokenizer(const std::string& tokenizer_json, const std::string& config_json) {
    file_.path = tokenizer_json;
    const json j = parse_json(tokenizer_json);
    try {
      load(j);
    } catch (const json::exception& error) {
      refuse(file_, detail::cat("unexpected structure (", error.what(), ")"));
    }
    if (!config_json.empty()) read_config(config_json);
  }

  Encoding encode(std::string_view text, bool add_special_tokens) const override {
    std::vector<int64_t> a = encode_plain(text);
    return assemble(a, nullptr, add_special_tokens);
  }
  Encoding encode_pair(std::string_view text, std::string_view pair,
                       bool add_special_tokens) const override {
    std::vector<int64_t> a = encode_plain(text), b = encode_plain(pair);
    return assemble(a, &b, add_special_tokens);
  }

  Encoding post_process(const std::vector<int64_t>& a, const std::vector<int64_t>* b,
                        bool add_special_tokens) const override {
    return assemble(a, b, add_special_tokens);
  }
  int64_t num_special_tokens_to_add(bool pair) const override {
    const std::vector<int64_t> none;
    return static_cast<int64_t>(assemble(none, pair ? &none : nullptr, true).ids.size());
  }

  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const override {
    std::vector<std::string> tokens;
    for (const int64_t id : ids) {
      if (id < 0 || id >= static_cast<int64_t>(id_to_token_.size()) || !has_token_[id]) continue;
      if (skip_special_tokens && is_special(id)) continue;
      tokens.push_back(id_to_token_[id]);
    }
    std::string out;
    if (!decoder_.present) {
      for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
      return out;
    }
    for (const auto& step : decoder_.steps) step(tokens);
    for (const auto& token : tokens) out += token;
    return out;
  }

  std::optional<int64_t> token_to_id(std::string_view token) const override {
    const auto added = added_by_content_.find(std::string(token));
    if (added != added_by_content_.end()) return added->second;
    return model_->token_to_id(token);
  }
  std::string id_to_token(int64_t id) const override {
    if (id < 0 || id >= static_cast<int64_t>(id_to_token_.size()) || !has_token_[id]) return "";
    return id_to_token_[id];
  }
  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token_.size()); }
  bool is_special(int64_t id) const override {
    return id >= 0 && id < static_cast<int64_t>(special_.size()) && special_[id];
  }
  const SpecialToken& bos() const override { return bos_; }
  const SpecialToken& eos() const override { return eos_; }
  const SpecialToken& pad() const override { return pad_; }
  const std::string& chat_template() const override { return chat_template_; }
  std::string describe() const override {
    return detail::cat(family_, ", ", vocab_size(), " ids (", file_.path, ")");
  }

 private:
  void load(const json& j) {
    const json& model = j.at("model");
    const std::string type = type_of(model).empty() && model.contains("merges") ? "BPE" : type_of(model);
    if (type == "BPE") {
      model_ = std::make_unique<Bpe>(model, file_);
      family_ = "BPE";
    } else if (type == "WordPiece") {
      model_ = std::make_unique<WordPiece>(model, file_);
      family_ = "WordPiece";
    } else if (type == "Unigram") {
      model_ = std::make_unique<Unigram>(model, file_);
      family_ = "Unigram";
    } else {
      refuse(file_, detail::cat("the tokenizer model '", type,
                                "' is not supported; loom reads BPE (byte-level: GPT-2, Llama 3, "
                                "Qwen; SentencePiece's: Llama 2, Mistral), WordPiece (BERT) and "
                                "Unigram (T5, ALBERT)"));
    }
    if (j.contains("normalizer") && !j["normalizer"].is_null())
      normalizer_ = make_normalizer(j["normalizer"], file_);
    if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) {
      pre_tokenizer_ = make_pre_tokenizer(j["pre_tokenizer"], file_);
      if (j["pre_tokenizer"].dump().find("\"ByteLevel\"") != std::string::npos)
        family_ = "byte-level " + family_;
    }
    if (j.contains("post_processor")) make_post_processor(j["post_processor"], file_, post_);
    if (j.contains("decoder")) make_decoder(j["decoder"], file_, decoder_);

    int64_t size = 0;
    for (const auto& [token, id] : model_->vocab()) size = std::max(size, id + 1);
    if (j.contains("added_tokens")) {
      for (const auto& t : j["added_tokens"]) {
        AddedToken a{t.at("id").get<int64_t>(), t.at("content").get<std::string>(),
                     t.value("special", false), t.value("single_word", false),
                     t.value("lstrip", false), t.value("rstrip", false)};
        if (a.content.empty()) continue;
        size = std::max(size, a.id + 1);
        added_by_content_[a.content] = a.id;
        added_.push_back(std::move(a));
      }
    }
    // Longest first, so the first match at a position is the longest.
    std::stable_sort(added_.begin(), added_.end(), [](const AddedToken& x, const AddedToken& y) {
      return x.content.size() > y.content.size();
    });
    for (const auto& a : added_) first_byte_[static_cast<unsigned char>(a.content[0])] = true;
    id_to_token_.assign(static_cast<size_t>(size), "");
    has_token_.assign(static_cast<size_t>(size), 0);
    special_.assign(static_cast<size_t>(size), 0);
    for (const auto& [token, id] : model_->vocab()) {
      id_to_token_[id] = token;
      has_token_[id] = 1;
    }
    for (const auto& a : added_) {
      id_to_token_[a.id] = a.content;
      has_token_[a.id] = 1;
      special_[a.id] = a.special;
    }
  }

  void read_config(const std::string& path) {
    const json c = parse_json(path);
    auto special = [&](const char* key, SpecialToken& out) {
      if (!c.contains(key)) return;
      const json& v = c[key];
      if (v.is_string()) out.text = v.get<std::string>();
      else if (v.is_object() && v.contains("content")) out.text = v["content"].get<std::string>();
      else return;
      out.id = token_to_id(out.text);
    };
    special("bos_token", bos_);
    special("eos_token", eos_);
    special("pad_token", pad_);
    if (c.contains("chat_template")) {
      const json& t = c["chat_template"];
      if (t.is_string()) {
        chat_template_ = t.get<std::string>();
      } else if (t.is_array()) {  // [{name, template}]: the "default" one
        for (const auto& item : t)
          if (item.value("name", "") == "default") chat_template_ = item.value("template", "");
      }
    }
  }

  // Text (no specials added) -> ids.
  std::vector<int64_t> encode_plain(std::string_view raw) const {
    std::string text(raw);
    // Python strings are always valid UTF-8; a C++ caller's may not be: repair as Rust would.
    bool valid = true;
    for (size_t i = 0; i < text.size() && valid;) {
      size_t n;
      if (next_code_point(text, i, &n) == 0xFFFD && !(n == 3 && text.compare(i, 3, "\xEF\xBF\xBD") == 0))
        valid = false;
      i += n;
    }
    if (!valid) text = utf8_lossy(text);
    std::vector<int64_t> ids;
    size_t start = 0;  // start of the stretch not yet tokenized
    size_t i = 0;
    while (i < text.size()) {
      if (!first_byte_[static_cast<unsigned char>(text[i])]) {
        ++i;
        continue;
      }
      const AddedToken* hit = nullptr;
      for (const auto& a : added_) {
        if (text.compare(i, a.content.size(), a.content) != 0) continue;
        if (a.single_word && !single_word_ok(text, i, i + a.content.size())) continue;
        hit = &a;
        break;
      }
      if (!hit) {
        ++i;
        continue;
      }
      size_t stretch_end = i, next = i + hit->content.size();
      if (hit->lstrip)
        while (stretch_end > start && is_ascii_or_unicode_space_before(text, stretch_end))
          stretch_end = previous_start(text, stretch_end);
      if (hit->rstrip)
        while (next < text.size()) {
          size_t n;
          if (!is_white_space(next_code_point(text, next, &n))) break;
          next += n;
        }
      tokenize_stretch(std::string_view(text).substr(start, stretch_end - start), start == 0, ids);
      ids.push_back(hit->id);
      start = i = next;
    }
    tokenize_stretch(std::string_view(text).substr(start), start == 0, ids);
    return ids;
  }

  static size_t previous_start(const std::string& s, size_t end) {
    size_t p = end - 1;
    while (p > 0 && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80) --p;
    return p;
  }
  static bool is_ascii_or_unicode_space_before(const std::string& s, size_t end) {
    size_t n;
    return is_white_space(next_code_point(s, previous_start(s, end), &n));
  }
  static bool single_word_ok(const std::string& s, size_t begin, size_t end) {
    if (begin > 0) {
      size_t n;
      if (is_word_char(next_code_point(s, previous_start(s, begin), &n))) return false;
    }
    if (end < s.size()) {
      size_t n;
      if (is_word_char(next_code_point(s, end, &n))) return false;
    }
    return true;
  }

  // at_start: the stretch begins the text (Metaspace's prepend_scheme "first").
  void tokenize_stretch(std::string_view stretch, bool at_start, std::vector<int64_t>& ids) const {
    if (stretch.empty()) return;
    Pieces pieces{normalizer_ ? normalizer_->apply(std::string(stretch)) : std::string(stretch)};
    if (pieces[0].empty()) return;
    if (pre_tokenizer_) pre_tokenizer_->apply(pieces, at_start);
    for (const auto& piece : pieces)
      if (!piece.empty()) model_->tokenize(piece, ids);
  }

  Encoding assemble(const std::vector<int64_t>& a, const std::vector<int64_t>* b,
                    bool add_special_tokens) const {
    Encoding e;
    auto push = [&e](const std::vector<int64_t>& ids, int64_t type_id, uint8_t special) {
      e.ids.insert(e.ids.end(), ids.begin(), ids.end());
      e.type_ids.insert(e.type_ids.end(), ids.size(), type_id);
      e.special_mask.insert(e.special_mask.end(), ids.size(), special);
    };
    const bool templated = add_special_tokens && !post_.single.empty();
    if (!templated) {
      push(a, 0, 0);
      if (b) push(*b, 1, 0);
      return e;
    }
    if (b && !post_.has_pair)
      throw DataError(detail::cat(file_.path, ": the post-processor has no template for pairs"));
    for (const auto& piece : b ? post_.pair : post_.single) {
      if (piece.is_sequence) push(piece.second ? *b : a, piece.type_id, 0);
      else push(piece.ids, piece.type_id, 1);
    }
    return e;
  }

  FileContext file_;
  std::string family_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  PostProcessor post_;
  Decoder decoder_;
  std::vector<AddedToken> added_;
  std::unordered_map<std::string, int64_t> added_by_content_;
  bool first_byte_[256] = {};
  std::vector<std::string> id_to_token_;
  std::vector<uint8_t> has_token_, special_;
  SpecialToken bos_, eos_, pad_;
  std::string chat_template_;
};

}  // namespace
}  // namespace tok

Tokenizer::~Tokenizer() = default;

bool Tokenizer::present(const std::string& folder) {
  return std::filesystem::is_regular_file(std::filesystem::path(folder) / "tokenizer.json");
}

std::shared_ptr<const Tokenizer> Tokenizer::load(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path file = path, folder = fs::path(path).parent_path();
  if (fs::is_directory(path)) {
    folder = path;
    file = folder / "tokenizer.json";
  }
  LOOM_CHECK_AS(DataError, fs::is_regular_file(file), file.string(),
                ": no tokenizer.json there; a Hugging Face model folder (save_pretrained) has one");
  const fs::path config = folder / "tokenizer_config.json";
  return std::make_shared<tok::HfTokenizer>(file.string(),
                                            fs::is_regular_file(config) ? config.string() : "");
}

}  // namespace loom
