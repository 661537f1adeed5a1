// Records -> token sequences with the tokens the loss is taken on: Note [Dataset tasks].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/tokenizer.h"
#include "records.h"

namespace loom::datasets {

enum class Task { Lm, Classification, Instruction, Chat };
const char* task_name(Task task);

struct FieldNames {
  std::string text = "text", text_pair = "text_pair", label = "label", prompt = "prompt",
              completion = "completion", messages = "messages";
};

// The task a record's fields ask for: messages -> chat, prompt + completion -> instruction,
// a label -> classification, text -> language modelling. DataError naming the record and the
// fields it has when none fits.
Task detect_task(const Record& record, const FieldNames& names);
// The fields `task` needs are in `record` (DataError naming the missing one and those found).
void check_fields(const Record& record, Task task, const FieldNames& names);

enum class ChatFormat { ChatMl, Llama3 };
// "chatml" | "llama3" | "auto" (read from the tokenizer's chat_template: <|im_start|> ->
// ChatML, <|start_header_id|> -> Llama 3); ConfigError otherwise.
ChatFormat chat_format(const std::string& setting, const Tokenizer& tokenizer);

struct Example {
  std::vector<int64_t> ids;
  std::vector<uint8_t> target;    // per token: the loss predicts this token (instruction, chat)
  std::vector<int64_t> type_ids;  // classification pairs
  int64_t label = -1;             // classification
  bool truncated = false;
};

// A document for language modelling: its ids with the tokenizer's specials, then EOS.
Example format_document(const Tokenizer& tokenizer, const std::string& text, bool add_eos);
// text (+ text_pair), truncated to max_length ids with the specials (longest first, as
// transformers' truncation=True).
Example format_classification(const Tokenizer& tokenizer, const std::string& text,
                               const std::string* pair, int64_t max_length);
// prompt + completion (+ EOS); targets: the completion and the EOS.
Example format_instruction(const Tokenizer& tokenizer, const std::string& prompt,
                           const std::string& completion, bool add_eos);
// messages [{role, content}] in the chat format; targets: each assistant message's content and
// its end-of-turn token.
Example format_chat(const Tokenizer& tokenizer, const nlohmann::json& messages, ChatFormat format);
// Keeps the first `max_length` ids (and their targets); marks the example truncated.
void truncate(Example& example, int64_t max_length);

}  // namespace loom::datasets
