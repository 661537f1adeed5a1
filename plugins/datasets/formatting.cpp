// Note [Dataset tasks]
// ~~~~~~~~~~~~~~~~~~~~
// What each task turns a record into, with transformers' and TRL's conventions:
//  - lm: `text`, encoded with the tokenizer's specials (Llama 3's BOS), then EOS. Packed
//    (packing = true): all documents in one stream, cut into windows of max_seq_length + 1
//    (inputs and next-token labels), as the text source does; else one sample per document.
//  - classification: `text` (+ `text_pair`) with the post-processor's specials ([CLS] a [SEP]
//    b [SEP], type ids 0/1), truncated longest-first so that the specials stay; `label` an
//    integer or a name of the label map.
//  - instruction: `prompt` (with specials) + `completion` + EOS; the loss only on the
//    completion and the EOS (TRL's completion_only_loss).
//  - chat: `messages` (role/content) in ChatML (<|im_start|>role\ncontent<|im_end|>\n) or
//    Llama 3's format (<|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\ncontent
//    <|eot_id|>, content trimmed, as its template does); the loss only on each assistant
//    content and its end-of-turn token (TRL's assistant_only_loss).
// Each piece of a template is encoded on its own and the ids concatenated, so every token
// knows whether it is trained; the pieces end where the pre-tokenizers split anyway (at an
// added token or a newline), and test_datasets.cpp checks the result equals transformers'
// encoding of the whole formatted string, token by token.
#include "formatting.h"

#include <algorithm>

#include "loom/error.h"

namespace loom::datasets {
namespace {

void append(Example& e, const std::vector<int64_t>& ids, bool target) {
  e.ids.insert(e.ids.end(), ids.begin(), ids.end());
  e.target.insert(e.target.end(), ids.size(), target ? 1 : 0);
}

int64_t eos_id(const Tokenizer& tokenizer) {
  LOOM_CHECK_AS(DataError, tokenizer.eos().id.has_value(), tokenizer.describe(),
                ": no EOS token (tokenizer_config.json's eos_token names none in the vocabulary); "
                "set [data] add_eos = false or give the tokenizer one");
  return *tokenizer.eos().id;
}

int64_t special_id(const Tokenizer& tokenizer, const std::string& token, const char* format) {
  const auto id = tokenizer.token_to_id(token);
  LOOM_CHECK_AS(ConfigError, id.has_value(), "[data] chat_template = \"", format, "\" needs the token ",
                token, ", which ", tokenizer.describe(), " lacks; choose the model's own format");
  return *id;
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\n\r");
  if (b == std::string::npos) return "";
  const size_t e = s.find_last_not_of(" \t\n\r");
  return s.substr(b, e - b + 1);
}

}  // namespace

const char* task_name(Task task) {
  switch (task) {
    case Task::Lm: return "lm";
    case Task::Classification: return "classification";
    case Task::Instruction: return "instruction";
    case Task::Chat: return "chat";
  }
  return "?";
}

Task detect_task(const Record& r, const FieldNames& n) {
  const auto& f = r.fields;
  if (f.contains(n.messages)) return Task::Chat;
  if (f.contains(n.prompt) && f.contains(n.completion)) return Task::Instruction;
  if (f.contains(n.label)) return Task::Classification;
  if (f.contains(n.text)) return Task::Lm;
  throw DataError(detail::cat(r.where, ": none of the fields loom reads (", n.text, "; ", n.text,
                              " + ", n.label, "; ", n.prompt, " + ", n.completion, "; ", n.messages,
                              "); the record has: ", field_names(f),
                              ". Rename them, or set [data] text_field/label_field/... to yours"));
}

void check_fields(const Record& r, Task task, const FieldNames& n) {
  auto need = [&](const std::string& field, bool string) {
    LOOM_CHECK_AS(DataError, r.fields.contains(field), r.where, ": no field '", field, "' (task ",
                  task_name(task), "); the record has: ", field_names(r.fields));
    if (string)
      LOOM_CHECK_AS(DataError, r.fields[field].is_string(), r.where, ": field '", field,
                    "' is a ", r.fields[field].type_name(), ", not a string");
  };
  switch (task) {
    case Task::Lm: need(n.text, true); break;
    case Task::Classification:
      need(n.text, true);
      need(n.label, false);
      if (r.fields.contains(n.text_pair) && !r.fields[n.text_pair].is_null()) need(n.text_pair, true);
      break;
    case Task::Instruction: need(n.prompt, true); need(n.completion, true); break;
    case Task::Chat: {
      need(n.messages, false);
      const auto& m = r.fields[n.messages];
      LOOM_CHECK_AS(DataError, m.is_array() && !m.empty(), r.where, ": field '", n.messages,
                    "' must be a non-empty list of {\"role\": ..., \"content\": ...}");
      bool assistant = false;
      for (const auto& message : m) {
        LOOM_CHECK_AS(DataError, message.is_object() && message.contains("role") &&
                                     message["role"].is_string() && message.contains("content") &&
                                     message["content"].is_string(),
                      r.where, ": a message is not {\"role\": \"...\", \"content\": \"...\"}: ",
                      message.dump().substr(0, 200));
        assistant = assistant || message["role"] == "assistant";
      }
      LOOM_CHECK_AS(DataError, assistant, r.where,
                    ": no assistant message, so nothing to train on (roles: system, user, "
                    "assistant)");
      break;
    }
  }
}

ChatFormat chat_format(const std::string& setting, const Tokenizer& tokenizer) {
  if (setting == "chatml") return ChatFormat::ChatMl;
  if (setting == "llama3") return ChatFormat::Llama3;
  LOOM_CHECK_AS(ConfigError, setting == "auto", "[data] chat_template must be \"auto\", \"chatml\" "
                "or \"llama3\", not \"", setting, "\"");
  const std::string& t = tokenizer.chat_template();
  if (t.find("<|im_start|>") != std::string::npos) return ChatFormat::ChatMl;
  if (t.find("<|start_header_id|>") != std::string::npos) return ChatFormat::Llama3;
  throw ConfigError(detail::cat(
      "[data] chat_template = \"auto\": ", tokenizer.describe(),
      t.empty() ? " has no chat_template in tokenizer_config.json"
                : " has a chat_template of a form loom does not know",
      "; set [data] chat_template = \"chatml\" or \"llama3\""));
}

Example format_document(const Tokenizer& tokenizer, const std::string& text, bool add_eos) {
  Example e;
  append(e, tokenizer.encode(text, true).ids, true);
  if (add_eos) append(e, {eos_id(tokenizer)}, true);
  return e;
}

Example format_classification(const Tokenizer& tokenizer, const std::string& text,
                              const std::string* pair, int64_t max_length) {
  std::vector<int64_t> a = tokenizer.encode(text, false).ids, b;
  if (pair) b = tokenizer.encode(*pair, false).ids;
  const int64_t budget = max_length - tokenizer.num_special_tokens_to_add(pair != nullptr);
  LOOM_CHECK_AS(ConfigError, budget > 0, "[data] max_seq_length ", max_length,
                " leaves no room for text beside the tokenizer's special tokens");
  // transformers' truncation=True (longest_first) as `tokenizers` computes it: the shorter
  // text is kept whole when the longer can give up enough; else the budget is halved (the
  // odd one to the text that was longer).
  const auto before = a.size() + b.size();
  if (!pair) {
    if (static_cast<int64_t>(a.size()) > budget) a.resize(static_cast<size_t>(budget));
  } else if (static_cast<int64_t>(before) > budget) {
    auto n1 = static_cast<int64_t>(a.size()), n2 = static_cast<int64_t>(b.size());
    const bool swap = n1 > n2;
    if (swap) std::swap(n1, n2);
    n2 = n1 > budget ? n1 : std::max(n1, budget - n1);
    if (n1 + n2 > budget) {
      n1 = budget / 2;
      n2 = n1 + budget % 2;
    }
    if (swap) std::swap(n1, n2);
    a.resize(std::min(a.size(), static_cast<size_t>(n1)));
    b.resize(std::min(b.size(), static_cast<size_t>(n2)));
  }
  const bool truncated = a.size() + b.size() < before;
  const Encoding enc = tokenizer.post_process(a, pair ? &b : nullptr);
  Example e;
  e.ids = enc.ids;
  e.type_ids = enc.type_ids;
  e.truncated = truncated;
  return e;
}

Example format_instruction(const Tokenizer& tokenizer, const std::string& prompt,
                           const std::string& completion, bool add_eos) {
  Example e;
  append(e, tokenizer.encode(prompt, true).ids, false);
  append(e, tokenizer.encode(completion, false).ids, true);
  if (add_eos) append(e, {eos_id(tokenizer)}, true);
  return e;
}

Example format_chat(const Tokenizer& tokenizer, const nlohmann::json& messages, ChatFormat format) {
  Example e;
  auto text = [&](const std::string& s, bool target) { append(e, tokenizer.encode(s, false).ids, target); };
  if (format == ChatFormat::ChatMl) {
    const int64_t start = special_id(tokenizer, "<|im_start|>", "chatml");
    const int64_t end = special_id(tokenizer, "<|im_end|>", "chatml");
    for (const auto& m : messages) {
      const std::string role = m["role"], content = m["content"];
      const bool assistant = role == "assistant";
      append(e, {start}, false);
      text(role + "\n", false);
      text(content, assistant);
      append(e, {end}, assistant);
      text("\n", false);
    }
  } else {
    const int64_t begin = special_id(tokenizer, "<|begin_of_text|>", "llama3");
    const int64_t header = special_id(tokenizer, "<|start_header_id|>", "llama3");
    const int64_t header_end = special_id(tokenizer, "<|end_header_id|>", "llama3");
    const int64_t eot = special_id(tokenizer, "<|eot_id|>", "llama3");
    append(e, {begin}, false);
    for (const auto& m : messages) {
      const std::string role = m["role"], content = trim(m["content"]);
      const bool assistant = role == "assistant";
      append(e, {header}, false);
      text(role, false);
      append(e, {header_end}, false);
      text("\n\n", false);
      text(content, assistant);
      append(e, {eot}, assistant);
    }
  }
  return e;
}

void truncate(Example& example, int64_t max_length) {
  if (static_cast<int64_t>(example.ids.size()) <= max_length) return;
  example.ids.resize(static_cast<size_t>(max_length));
  if (!example.target.empty()) example.target.resize(static_cast<size_t>(max_length));
  if (!example.type_ids.empty()) example.type_ids.resize(static_cast<size_t>(max_length));
  example.truncated = true;
}

}  // namespace loom::datasets
