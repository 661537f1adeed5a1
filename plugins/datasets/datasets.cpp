// The `datasets` plugin: data sources `jsonl` and `csv` (Hugging Face's field names), tokenized
// with the model's tokenizer (loom/tokenizer.h). What each task makes of a record: Note
// [Dataset tasks] in formatting.cpp. Records are read and checked (fields, labels, the
// tokenizer) before anything is built, by validate(); the dataset tokenizes them all once when
// built, so its size, packing windows and truncation count are known up front and every
// get() is a copy out of memory (deterministic, thread-safe, resumable at any position).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "formatting.h"
#include "loom/data.h"
#include "loom/engine.h"
#include "loom/error.h"
#include "loom/hf_config.h"
#include "loom/log.h"
#include "loom/plugin.h"
#include "records.h"

namespace loom::datasets {
namespace {

using PathResolver = std::function<std::string(const std::string&)>;

// What validate() and the dataset both derive from the table and the records.
struct Plan {
  std::vector<std::string> files;
  std::string tokenizer_path;
  std::vector<Record> records;
  Task task = Task::Lm;
  FieldNames names;
  std::vector<std::string> label_names;  // empty: integer labels
  int64_t num_labels = 0;
  std::vector<int64_t> labels;           // per record (classification)
};

std::string model_tokenizer(const ConfigSection* model) {
  if (model && model->has("from_pretrained")) return model->get_string("from_pretrained");
  return "";
}

// A label map for messages, as the engine writes one.
std::string label_map_text(const std::vector<std::string>& names) {
  if (names.empty()) return "integer ids";
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

// Note [Data against the model] (core/src/builtin.cpp): the model's vocab_size or num_labels as
// the job states them, read as the core's data sources read them.
using pretrained::ModelLimit;
using pretrained::model_limit;

// A pretrained classifier's label map: config.json's id2label when it names real classes
// (transformers writes LABEL_0, LABEL_1... when nobody named them: those say nothing).
struct PretrainedLabels {
  std::vector<std::string> names;
  std::string file;
};
PretrainedLabels pretrained_labels(const ConfigSection* model, const PathResolver& resolve) {
  PretrainedLabels out;
  const std::string folder = model_tokenizer(model);
  if (folder.empty()) return out;
  out.file = (std::filesystem::path(resolve(folder)) / "config.json").string();
  std::ifstream in(out.file);
  if (!in) return out;  // the model plugin reports a folder without config.json
  const auto config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!config.is_object() || !config.contains("id2label") || !config["id2label"].is_object())
    return out;
  const auto& map = config["id2label"];
  std::vector<std::string> names(map.size());
  bool named = false;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string key = std::to_string(i);
    if (!map.contains(key) || !map[key].is_string()) return out;
    names[i] = map[key].get<std::string>();
    named = named || names[i] != "LABEL_" + key;
  }
  if (named) out.names = std::move(names);
  return out;
}

Plan make_plan(const ConfigSection& c, Format format, const PathResolver& resolve,
               const ConfigSection* model) {
  Plan p;
  for (const auto& raw : c.get_strings("path")) {
    const std::string path = resolve(raw);
    LOOM_CHECK_AS(DataError, std::filesystem::is_regular_file(path), c.where("path"),
                  ": [data] path '", raw, "': no such file ('", path, "')");
    p.files.push_back(path);
  }
  LOOM_CHECK_AS(ConfigError, !p.files.empty(), c.where("path"),
                ": [data] needs path = \"file\" (or a list of files)");
  std::string tokenizer = c.get_string("tokenizer");
  if (tokenizer.empty()) tokenizer = model_tokenizer(model);
  LOOM_CHECK_AS(ConfigError, !tokenizer.empty(), c.where("tokenizer"),
                ": [data] needs a tokenizer: set tokenizer = \"folder with tokenizer.json\", or "
                "[model] from_pretrained to a folder that has one");
  p.tokenizer_path = resolve(tokenizer);
  p.names.text = c.get_string("text_field");
  p.names.text_pair = c.get_string("text_pair_field");
  p.names.label = c.get_string("label_field");
  p.names.prompt = c.get_string("prompt_field");
  p.names.completion = c.get_string("completion_field");
  p.names.messages = c.get_string("messages_field");

  p.records = read_records(p.files, format);
  LOOM_CHECK_AS(DataError, !p.records.empty(), c.where("path"),
                ": [data] the files hold no records (", p.files.front(),
                p.files.size() > 1 ? " ..." : "", ")");
  // One empty shard among several (a download or a preparation that was cut off) would train on
  // the rest without a word.
  {
    std::set<std::string> with_records;
    for (const auto& r : p.records) with_records.insert(r.where.substr(0, r.where.rfind(':')));
    const auto raw = c.get_strings("path");
    for (size_t i = 0; i < p.files.size(); ++i)
      LOOM_CHECK_AS(DataError, with_records.count(p.files[i]), c.where("path"), ": [",
                    c.name(), "] path '", raw[i], "': '", p.files[i], "' holds no records (",
                    std::filesystem::file_size(p.files[i]), " bytes); remove it from path, or "
                    "write its data again (an interrupted download or preparation leaves empty "
                    "files)");
  }
  const std::string task = c.get_string("task");
  if (task == "auto") p.task = detect_task(p.records.front(), p.names);
  else if (task == "lm") p.task = Task::Lm;
  else if (task == "classification") p.task = Task::Classification;
  else if (task == "instruction") p.task = Task::Instruction;
  else if (task == "chat") p.task = Task::Chat;
  else
    throw ConfigError(detail::cat(c.where("task"), ": [data] task must be auto, lm, "
                                  "classification, instruction or chat, not \"", task, "\""));
  for (const auto& r : p.records) check_fields(r, p.task, p.names);
  LOOM_CHECK_AS(ConfigError, !(c.get_bool("packing") && p.task != Task::Lm), c.where("packing"),
                ": [data] packing = true packs language-modelling text; the task is ",
                task_name(p.task), ": set packing = false");
  const int64_t max_len = c.get_int("max_seq_length");
  LOOM_CHECK_AS(ConfigError, max_len >= 2, c.where("max_seq_length"),
                ": [data] max_seq_length must be at least 2, got ", max_len);

  if (p.task == Task::Classification) {
    // Label names, in id order: the job's list; else, for string labels, the pretrained
    // model's own map (config.json's id2label, when it names real classes) or the sorted
    // distinct strings (datasets' ClassLabel). Integer labels (JSON numbers, or CSV fields that
    // are all digits) are ids themselves.
    auto as_integer = [](const nlohmann::json& v) -> std::optional<int64_t> {
      if (v.is_number_integer()) return v.get<int64_t>();
      if (v.is_string()) {
        const std::string s = v.get<std::string>();
        if (!s.empty() && s.size() < 18 && std::all_of(s.begin(), s.end(), ::isdigit))
          return std::stoll(s);
      }
      return std::nullopt;
    };
    bool all_integer = true;
    std::set<std::string> distinct;
    for (const auto& r : p.records) {
      const auto& v = r.fields[p.names.label];
      LOOM_CHECK_AS(DataError, v.is_string() || v.is_number_integer(), r.where, ": label ",
                    v.dump(), " is neither an integer nor a string");
      if (!as_integer(v)) all_integer = false;
      if (v.is_string()) distinct.insert(v.get<std::string>());
    }
    std::string map_source = "[data] label_names";
    if (c.has("label_names")) {
      p.label_names = c.get_strings("label_names");
      LOOM_CHECK_AS(ConfigError, !p.label_names.empty(), c.where("label_names"),
                    ": [data] label_names is empty; list the classes in id order or drop the key");
      const std::set<std::string> unique(p.label_names.begin(), p.label_names.end());
      LOOM_CHECK_AS(ConfigError, unique.size() == p.label_names.size(), c.where("label_names"),
                    ": [data] label_names names a class twice");
    } else if (!all_integer) {
      PretrainedLabels pretrained = pretrained_labels(model, resolve);
      if (!pretrained.names.empty()) {
        p.label_names = std::move(pretrained.names);
        map_source = pretrained.file + "'s id2label";
      } else {
        p.label_names.assign(distinct.begin(), distinct.end());
      }
    }
    if (p.label_names.empty()) {
      for (const auto& r : p.records) {
        const auto& v = r.fields[p.names.label];
        LOOM_CHECK_AS(DataError, !v.is_number_integer() || v.get<int64_t>() >= 0, r.where,
                      ": label ", v.dump(), " is negative; class ids count from 0 (fix the "
                      "record, or name the classes with [data] label_names)");
        const int64_t label = *as_integer(v);
        p.labels.push_back(label);
        p.num_labels = std::max(p.num_labels, label + 1);
      }
    } else {
      std::map<std::string, int64_t> ids;
      for (size_t i = 0; i < p.label_names.size(); ++i) ids[p.label_names[i]] = static_cast<int64_t>(i);
      const std::string known = label_map_text(p.label_names);  // for the message
      for (const auto& r : p.records) {
        const auto& v = r.fields[p.names.label];
        const std::string name = v.is_string() ? v.get<std::string>() : v.dump();
        const auto it = ids.find(name);
        LOOM_CHECK_AS(DataError, it != ids.end(), r.where, ": label '", name,
                      "' is not in the label map of ", map_source, " (", known,
                      "); fix the record or set [data] label_names");
        p.labels.push_back(it->second);
      }
      p.num_labels = static_cast<int64_t>(p.label_names.size());
    }
    // Note [Data against the model]: every label below the model's classes.
    const ModelLimit classes = model_limit(model, resolve, "num_labels");
    if (classes.value > 0)
      for (size_t i = 0; i < p.records.size(); ++i) {
        const auto& v = p.records[i].fields[p.names.label];
        LOOM_CHECK_AS(DataError, p.labels[i] < classes.value, p.records[i].where, ": label ",
                      v.is_string() ? v.get<std::string>() : v.dump(),
                      p.label_names.empty() ? "" : detail::cat(" (class ", p.labels[i], ")"),
                      " is not below the model's ", classes.value, " classes (",
                      classes.source, "); the data has ", p.num_labels,
                      " classes: set [model] num_labels = ", p.num_labels,
                      ", or fix the record");
      }
  }
  return p;
}

// Record `i` of the plan as a sample's ids and targets (Note [Dataset tasks]).
Example format_record_of(const Plan& plan, size_t i, const Tokenizer& tokenizer, ChatFormat chat,
                         bool eos, int64_t max_len, bool packing) {
  const Record& r = plan.records[i];
  const auto& f = r.fields;
  Example e;
  switch (plan.task) {
    case Task::Lm: e = format_document(tokenizer, f[plan.names.text], eos); break;
    case Task::Classification: {
      const bool has_pair = f.contains(plan.names.text_pair) && f[plan.names.text_pair].is_string();
      const std::string pair = has_pair ? f[plan.names.text_pair].get<std::string>() : "";
      e = format_classification(tokenizer, f[plan.names.text], has_pair ? &pair : nullptr, max_len);
      e.label = plan.labels[i];
      break;
    }
    case Task::Instruction:
      e = format_instruction(tokenizer, f[plan.names.prompt], f[plan.names.completion], eos);
      break;
    case Task::Chat: e = format_chat(tokenizer, f[plan.names.messages], chat); break;
  }
  // Language modelling and SFT samples are inputs + next-token labels: max_seq_length + 1 ids.
  if (plan.task != Task::Classification && !packing) truncate(e, max_len + 1);
  if (plan.task == Task::Lm && !packing) e.target.assign(e.ids.size(), 1);
  return e;
}

// Note [Data against the model]: a record's ids below the model's vocabulary.
void check_record_ids(const Example& e, const Record& r, const ModelLimit& vocab,
                      const Tokenizer& tokenizer) {
  for (size_t t = 0; t < e.ids.size(); ++t)
    LOOM_CHECK_AS(DataError, e.ids[t] < vocab.value, r.where, ": token id ", e.ids[t], " ('",
                  tokenizer.id_to_token(e.ids[t]), "') at position ", t,
                  " of the record's tokens is not below the model's vocabulary of ", vocab.value,
                  " ids (", vocab.source, "); the tokenizer (", tokenizer.describe(), ") has ",
                  tokenizer.vocab_size(), ": give the model vocab_size = ",
                  tokenizer.vocab_size(), " (as resize_token_embeddings would), or use the "
                  "model's own tokenizer");
}

// Records validate() formats to check their ids, at most (evenly spread over the data); the
// dataset checks every record when it is built, before the run writes anything.
constexpr size_t kRecordsChecked = 4096;

// The samples, tokenized once.
class RecordsDataset final : public Dataset {
 public:
  RecordsDataset(const ConfigSection& c, Format format, Engine& engine)
      : format_(format), max_len_(c.get_int("max_seq_length")), packing_(c.get_bool("packing")) {
    const ConfigSection* model = nullptr;
    try {
      model = &engine.section("model");
    } catch (const Error&) {
    }
    plan_ = make_plan(c, format, [&](const std::string& p) { return engine.resolve_path(p); }, model);
    tokenizer_ = Tokenizer::load(plan_.tokenizer_path);
    LOOM_CHECK_AS(DataError, tokenizer_->vocab_size() < (int64_t{1} << 31), tokenizer_->describe(),
                  ": more than 2^31 ids");
    const ChatFormat chat = plan_.task == Task::Chat
                                ? chat_format(c.get_string("chat_template"), *tokenizer_)
                                : ChatFormat::ChatMl;
    const bool eos = c.get_bool("add_eos");
    // Pure, so blocks of records are formatted on every intra-op thread and appended in record
    // order (the result is the same for any count).
    const auto format_record = [&](size_t i) {
      return format_record_of(plan_, i, *tokenizer_, chat, eos, max_len_, packing_);
    };
    // Note [Data against the model]: validate() checked a sample of the records when the
    // tokenizer has ids the model lacks; here, before anything is written, every one.
    const ModelLimit vocab =
        model_limit(model, [&](const std::string& p) { return engine.resolve_path(p); },
                    "vocab_size");
    const bool check_ids = vocab.value > 0 && tokenizer_->vocab_size() > vocab.value;
    int64_t truncated = 0;
    offsets_.push_back(0);
    constexpr size_t kBlock = 1024;
    std::vector<Example> block;
    for (size_t first = 0; first < plan_.records.size(); first += kBlock) {
      block.assign(std::min(kBlock, plan_.records.size() - first), Example{});
      at::parallel_for(0, static_cast<int64_t>(block.size()), 16, [&](int64_t begin, int64_t end) {
        for (int64_t k = begin; k < end; ++k) block[static_cast<size_t>(k)] = format_record(first + static_cast<size_t>(k));
      });
      for (size_t k = 0; k < block.size(); ++k) {
        Example& e = block[k];
        if (check_ids) check_record_ids(e, plan_.records[first + k], vocab, *tokenizer_);
        if (plan_.task != Task::Classification && !packing_) {
          // A sample needs two ids and one target among its labels.
          if (e.ids.size() < 2 || std::none_of(e.target.begin() + 1, e.target.end(), [](uint8_t t) { return t; })) {
            ++skipped_;
            continue;
          }
        }
        truncated += e.truncated ? 1 : 0;
        ids_.insert(ids_.end(), e.ids.begin(), e.ids.end());
        targets_.insert(targets_.end(), e.target.begin(), e.target.end());
        types_.insert(types_.end(), e.type_ids.begin(), e.type_ids.end());
        offsets_.push_back(static_cast<int64_t>(ids_.size()));
        labels_.push_back(e.label);
      }
    }
    if (plan_.task == Task::Lm && packing_) {
      windows_ = (static_cast<int64_t>(ids_.size()) - 1) / max_len_;
      LOOM_CHECK_AS(DataError, windows_ > 0, "[data] the text holds ", ids_.size(),
                    " tokens: too few for one window of max_seq_length ", max_len_,
                    " (+1); add text or lower max_seq_length");
    }
    // The parsed records are not needed past this point: only their tokens stay in memory.
    records_ = static_cast<int64_t>(plan_.records.size());
    std::vector<Record>().swap(plan_.records);
    LOOM_CHECK_AS(DataError, size() > 0, "[data] no samples are left: all ", records_,
                  " records were too short after tokenizing (a sample needs two tokens and one "
                  "trained token)");
    log::info("[data] ", describe(), truncated ? detail::cat("; ", truncated, " truncated to max_seq_length ", max_len_) : "",
              skipped_ ? detail::cat("; ", skipped_, " records skipped (nothing to train on)") : "");
  }

  int64_t size() const override {
    if (plan_.task == Task::Lm && packing_) return windows_;
    return static_cast<int64_t>(labels_.size());
  }

  Sample get(int64_t index) const override {
    LOOM_CHECK_AS(DataError, index >= 0 && index < size(), "sample ", index, " of ", size());
    Sample s;
    s.index = index;
    auto tensor = [](const int32_t* data, int64_t n) {
      return at::from_blob(const_cast<int32_t*>(data), {n}, at::kInt).to(at::kLong);
    };
    if (plan_.task == Task::Lm && packing_) {
      const int64_t begin = index * max_len_;
      s.input_ids = tensor(ids_.data() + begin, max_len_);
      s.labels = tensor(ids_.data() + begin + 1, max_len_);
      return s;
    }
    const int64_t begin = offsets_[index], n = offsets_[index + 1] - begin;
    if (plan_.task == Task::Classification) {
      s.input_ids = tensor(ids_.data() + begin, n);
      s.labels = at::scalar_tensor(labels_[index], at::kLong);
      if (!types_.empty()) s.token_type_ids = tensor(types_.data() + begin, n);
      return s;
    }
    s.input_ids = tensor(ids_.data() + begin, n - 1);
    s.labels = tensor(ids_.data() + begin + 1, n - 1);
    auto* labels = s.labels.data_ptr<int64_t>();
    for (int64_t t = 0; t + 1 < n; ++t)
      if (!targets_[begin + t + 1]) labels[t] = kIgnoreIndex;
    return s;
  }

  std::vector<std::string> label_names() const override { return plan_.label_names; }

  std::string describe() const override {
    std::string what = detail::cat(format_ == Format::Jsonl ? "jsonl" : "csv", "(",
                                   plan_.files.size(), " file(s), ", records_,
                                   " records, task ", task_name(plan_.task));
    if (plan_.task == Task::Lm && packing_)
      what += detail::cat(", ", ids_.size(), " tokens packed into ", windows_, " windows of ", max_len_);
    else
      what += detail::cat(", ", size(), " samples of up to ", max_len_, " tokens");
    if (plan_.task == Task::Classification) {
      what += detail::cat(", ", plan_.num_labels, " labels");
      if (!plan_.label_names.empty()) what += " (" + label_map_text(plan_.label_names) + ")";
    }
    return what + "; " + tokenizer_->describe() + ")";
  }

 private:
  Format format_;
  int64_t max_len_;
  bool packing_;
  Plan plan_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::vector<int32_t> ids_, types_;  // ids below 2^31 (checked): half the memory of int64
  std::vector<int64_t> offsets_, labels_;
  std::vector<uint8_t> targets_;
  int64_t windows_ = 0, skipped_ = 0, records_ = 0;
};

Schema source_schema(const std::string& name, const std::string& what) {
  Schema s("data", name);
  s.key_required("path", ValueType::Any, what + " file(s), relative to the job file")
      .key_string("tokenizer", "",
                  "folder with tokenizer.json (default: [model] from_pretrained's folder)")
      .key_string("task", "auto",
                  "auto (from the fields) | lm | classification | instruction | chat")
      .key_int("max_seq_length", 128,
               "tokens per sample (packing: window length); longer samples are truncated")
      .key_bool("packing", false,
                "lm: documents (each + EOS) in one stream cut into max_seq_length windows")
      .key_bool("add_eos", true, "lm and instruction: end each document/completion with EOS")
      .key_string("chat_template", "auto",
                  "chat: auto (the tokenizer's chat_template) | chatml | llama3")
      .key_optional("label_names", ValueType::Any,
                    "classification: the label map's names in id order (default: sorted)")
      .key_string("text_field", "text", "field of the text")
      .key_string("text_pair_field", "text_pair", "classification: field of the second text")
      .key_string("label_field", "label", "classification: field of the label")
      .key_string("prompt_field", "prompt", "instruction: field of the prompt")
      .key_string("completion_field", "completion", "instruction: field of the answer")
      .key_string("messages_field", "messages", "chat: field of the [{role, content}] list");
  return s;
}

class DatasetsPlugin final : public Plugin {
 public:
  std::string name() const override { return "datasets"; }
  std::string description() const override {
    return "JSONL and CSV data (text, text+label, prompt/completion, chat messages) tokenized "
           "with the model's Hugging Face tokenizer";
  }
  std::vector<Schema> schemas() const override {
    return {source_schema("jsonl", "JSON Lines"), source_schema("csv", "CSV (with a header row)")};
  }
  void validate(const std::string& name, const ConfigSection& c, const JobTables& job) const override {
    const Plan plan = make_plan(c, name == "csv" ? Format::Csv : Format::Jsonl, job.resolve_path,
                                job("model"));
    const auto tokenizer = Tokenizer::load(plan.tokenizer_path);
    const ChatFormat chat = plan.task == Task::Chat
                                ? chat_format(c.get_string("chat_template"), *tokenizer)
                                : ChatFormat::ChatMl;
    // Note [Data against the model]: a tokenizer whose ids all fit the model's vocabulary needs
    // no look at the records; one with more ids (added tokens, another model's tokenizer) has
    // its records' ids checked, all of them or kRecordsChecked spread over the data.
    const ModelLimit vocab = model_limit(job("model"), job.resolve_path, "vocab_size");
    if (vocab.value > 0 && tokenizer->vocab_size() > vocab.value) {
      const size_t n = plan.records.size(), checked = std::min(n, kRecordsChecked);
      for (size_t k = 0; k < checked; ++k) {
        const size_t i = checked < 2 ? k : k * (n - 1) / (checked - 1);
        check_record_ids(format_record_of(plan, i, *tokenizer, chat, c.get_bool("add_eos"),
                                          c.get_int("max_seq_length"), c.get_bool("packing")),
                         plan.records[i], vocab, *tokenizer);
      }
      if (checked < n)
        log::info("[", c.name(), "] the tokenizer has ", tokenizer->vocab_size(),
                  " ids, the model ", vocab.value, ": token ids checked in ", checked, " of ", n,
                  " records (spread over the data); the rest are checked as the dataset is built");
    }
    // The engine refuses an evaluation set whose label map is not the training data's; when
    // both tables are this plugin's, `loom check` says so too (Note [One resolved job]).
    const ConfigSection* data = job("data");
    if (c.name() != "eval_data" || plan.task != Task::Classification || !data) return;
    const std::string source = data->get_string("source");
    if (source != "jsonl" && source != "csv") return;
    const Plan train = make_plan(*data, source == "csv" ? Format::Csv : Format::Jsonl,
                                 job.resolve_path, job("model"));
    LOOM_CHECK_AS(ConfigError, train.label_names == plan.label_names, c.where("path"),
                  ": [eval_data]'s label map (", label_map_text(plan.label_names),
                  ") differs from [data]'s (", label_map_text(train.label_names),
                  "): the ids would mean other classes; set the same label_names = [...] in "
                  "both tables");
  }
  std::shared_ptr<const Dataset> create_dataset(const std::string& name, const ConfigSection& c,
                                                Engine& engine) override {
    return std::make_shared<RecordsDataset>(c, name == "csv" ? Format::Csv : Format::Jsonl, engine);
  }
};

}  // namespace
}  // namespace loom::datasets

LOOM_DEFINE_PLUGIN(loom::datasets::DatasetsPlugin, "datasets", "1.0.0")
