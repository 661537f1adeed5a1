// The `bert` model plugin: a BERT-style encoder (post-norm, bidirectional, GELU) with a
// sequence-classification head — the seed benchmark's model. Key names follow Hugging Face's
// BertConfig; BERT-large is hidden_size 1024, 24 layers, 16 heads, intermediate 4096. It
// imports transformers' BERT folders and exports BertForSequenceClassification (Note [BERT
// names]).
#include <ATen/ATen.h>

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "loom/engine.h"
#include "loom/log.h"
#include "loom/memory.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/plugin.h"
#include "loom/hf_config.h"
#include "loom/pretrained.h"

namespace {

struct BertConfig {
  int64_t vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
      max_position_embeddings, type_vocab_size, num_labels;
  double hidden_dropout_prob, attention_probs_dropout_prob, layer_norm_eps, initializer_range;
};

// Note [BERT names]: transformers' BertForSequenceClassification prefixes the encoder with
// "bert." (BertModel saves without it; BertForMaskedLM has no pooler and a "cls." head).
// Separate query/key/value Linears are loom's one qkv Linear, stacked q, k, v along the output
// dimension; HF's Linear weights are (out, in) like loom's, so nothing is transposed.
struct Layer {
  std::string hf, loom;
};
std::vector<Layer> bert_layers(int64_t layers) {
  std::vector<Layer> out = {{"embeddings.word_embeddings", "word_embeddings"},
                            {"embeddings.position_embeddings", "position_embeddings"},
                            {"embeddings.token_type_embeddings", "token_type_embeddings"},
                            {"embeddings.LayerNorm", "embeddings_norm"}};
  for (int64_t i = 0; i < layers; ++i) {
    const std::string hf = "encoder.layer." + std::to_string(i) + ".";
    const std::string loom = "encoder." + std::to_string(i) + ".";
    out.push_back({hf + "attention.output.dense", loom + "attn.proj"});
    out.push_back({hf + "attention.output.LayerNorm", loom + "norm1"});
    out.push_back({hf + "intermediate.dense", loom + "ffn.fc_in"});
    out.push_back({hf + "output.dense", loom + "ffn.fc_out"});
    out.push_back({hf + "output.LayerNorm", loom + "norm2"});
  }
  return out;
}
const char* const kQkv[] = {"query", "key", "value"};

BertConfig config_from_hf(const loom::pretrained::HfConfig& hf) {
  const std::string& file = hf.file();
  auto integer = [&](const char* key, int64_t def) { return hf.positive(key, def); };
  auto number = [&](const char* key, double def) { return hf.number(key, def); };
  const std::string type = hf.type();
  LOOM_CHECK_AS(ConfigError, type == "bert", "'", file, "' describes a model of type '", type,
                "'; [model] bert imports model_type 'bert' (BertModel, BertForMaskedLM, "
                "BertForSequenceClassification) only. loom imports: ",
                loom::pretrained::kImportable);
  const std::string act = hf.text("hidden_act", "gelu");
  LOOM_CHECK_AS(ConfigError, act == "gelu", "'", file, "': hidden_act '", act,
                "' is not supported; loom's bert has gelu (erf)");
  const std::string positions = hf.text("position_embedding_type", "absolute");
  LOOM_CHECK_AS(ConfigError, positions == "absolute", "'", file, "': position_embedding_type '",
                positions, "' is not supported; loom's bert has absolute positions");
  const int64_t labels = hf.num_labels(2);  // id2label's size first, as transformers counts
  BertConfig c{integer("vocab_size", 30522),
               integer("hidden_size", 768),
               integer("num_hidden_layers", 12),
               integer("num_attention_heads", 12),
               integer("intermediate_size", 3072),
               integer("max_position_embeddings", 512),
               integer("type_vocab_size", 2),
               labels,
               number("hidden_dropout_prob", 0.1),
               number("attention_probs_dropout_prob", 0.1),
               number("layer_norm_eps", 1e-12),
               number("initializer_range", 0.02)};
  LOOM_CHECK_AS(ConfigError, c.hidden_size % c.num_attention_heads == 0, "'", file,
                "': hidden_size ", c.hidden_size, " is not divisible by num_attention_heads ",
                c.num_attention_heads);
  return c;
}

// The job's [model] keys, or the pretrained folder's config.json (the job's shape keys, where
// set too, must agree; dropout and num_labels are the job's choice when it sets them).
BertConfig job_config(const loom::ConfigSection& t,
                      const std::optional<loom::pretrained::Folder>& folder) {
  BertConfig c{t.get_int("vocab_size"),          t.get_int("hidden_size"),
               t.get_int("num_hidden_layers"),   t.get_int("num_attention_heads"),
               t.get_int("intermediate_size"),   t.get_int("max_position_embeddings"),
               t.get_int("type_vocab_size"),     t.get_int("num_labels"),
               t.get_float("hidden_dropout_prob"), t.get_float("attention_probs_dropout_prob"),
               t.get_float("layer_norm_eps"),    t.get_float("initializer_range")};
  if (!folder) return c;
  const std::string file = folder->config_path().string();
  BertConfig p = config_from_hf(loom::pretrained::HfConfig(*folder));
  const std::pair<const char*, int64_t> shape[] = {
      {"vocab_size", p.vocab_size},
      {"hidden_size", p.hidden_size},
      {"num_hidden_layers", p.num_hidden_layers},
      {"num_attention_heads", p.num_attention_heads},
      {"intermediate_size", p.intermediate_size},
      {"max_position_embeddings", p.max_position_embeddings},
      {"type_vocab_size", p.type_vocab_size}};
  for (const auto& [key, value] : shape)
    LOOM_CHECK_AS(ConfigError, !t.has(key) || t.get_int(key) == value, t.where(key),
                  ": [model] ", key, " = ", t.get_int(key), " but the pretrained model's '",
                  file, "' has ", value, "; remove the key (it comes from config.json)");
  if (t.has("num_labels")) p.num_labels = t.get_int("num_labels");
  if (t.has("hidden_dropout_prob")) p.hidden_dropout_prob = t.get_float("hidden_dropout_prob");
  if (t.has("attention_probs_dropout_prob"))
    p.attention_probs_dropout_prob = t.get_float("attention_probs_dropout_prob");
  return p;
}

class Bert final : public loom::Model {
 public:
  explicit Bert(const BertConfig& c) : config_(c) {
    using namespace loom::nn;
    word = register_module("word_embeddings", std::make_shared<Embedding>(c.vocab_size, c.hidden_size));
    position = register_module("position_embeddings",
                               std::make_shared<Embedding>(c.max_position_embeddings, c.hidden_size));
    token_type = register_module("token_type_embeddings",
                                 std::make_shared<Embedding>(c.type_vocab_size, c.hidden_size));
    embeddings_norm = register_module("embeddings_norm",
                                      std::make_shared<LayerNorm>(c.hidden_size, c.layer_norm_eps));
    units = register_module("encoder", std::make_shared<UnitList>());
    TransformerBlock::Options block;
    block.dim = c.hidden_size;
    block.n_heads = c.num_attention_heads;
    block.hidden = c.intermediate_size;
    block.causal = false;
    block.pre_norm = false;
    block.dropout = c.hidden_dropout_prob;
    block.attention_dropout = c.attention_probs_dropout_prob;
    block.norm_eps = c.layer_norm_eps;
    block.activation = FeedForward::Activation::gelu;
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      units->push_back(std::make_shared<TransformerBlock>(block));
    pooler = register_module("pooler", std::make_shared<Linear>(c.hidden_size, c.hidden_size));
    classifier = register_module("classifier",
                                 std::make_shared<Linear>(c.hidden_size, c.num_labels));
    init_normal_(*this, c.initializer_range);
  }

  loom::Output forward(const loom::Batch& batch) override {
    // input_ids (B,T) -> logits (B,num_labels); labels (B).
    const at::Tensor& ids = batch.input_ids;
    LOOM_CHECK(ids.dim() == 2, "bert takes input_ids of shape (B,T), got ", ids.sizes());
    const int64_t B = ids.size(0), T = ids.size(1);
    LOOM_CHECK(T <= config_.max_position_embeddings, "bert: sequence length ", T,
               " exceeds [model] max_position_embeddings ", config_.max_position_embeddings);
    const auto [min_id, max_id] = batch.input_id_range();  // host counts: no GPU sync
    LOOM_CHECK(max_id < config_.vocab_size && min_id >= 0, "bert: token id ",
               min_id < 0 ? min_id : max_id, " is outside [model] vocab_size ",
               config_.vocab_size);
    at::Tensor types = batch.token_type_ids.defined() ? batch.token_type_ids : at::zeros_like(ids);
    at::Tensor x = word->forward(ids) + position->forward(at::arange(T, ids.options())) +
                   token_type->forward(types);
    x = at::dropout(embeddings_norm->forward(x), config_.hidden_dropout_prob, is_training());
    loom::nn::UnitArgs args;
    args.padding_mask = batch.attention_mask;
    x = units->forward(x, args);
    at::Tensor pooled = at::tanh(pooler->forward(x.select(1, 0)));
    at::Tensor logits = classifier->forward(
        at::dropout(pooled, config_.hidden_dropout_prob, is_training()));
    loom::Output out;
    out.logits = logits;
    if (batch.labels.defined()) {
      LOOM_CHECK(batch.labels.dim() == 1 && batch.labels.size(0) == B,
                 "bert classifies whole sequences: labels must be (B) = (", B, "), got ",
                 batch.labels.sizes(), "; with random_tokens use [data] task = \"classification\"");
      const int64_t max_label = batch.max_label();
      LOOM_CHECK(max_label < config_.num_labels, "bert: label ", max_label,
                 " >= [model] num_labels ", config_.num_labels);
      out.loss_sum = at::cross_entropy_loss(logits.to(at::kFloat), batch.labels, {},
                                            at::Reduction::Sum, loom::kIgnoreIndex);
      out.num_targets = batch.num_loss_targets();
    }
    return out;
  }

  std::shared_ptr<loom::nn::Embedding> word, position, token_type;
  std::shared_ptr<loom::nn::LayerNorm> embeddings_norm;
  std::shared_ptr<loom::nn::UnitList> units;
  std::shared_ptr<loom::nn::Linear> pooler, classifier;

 private:
  BertConfig config_;
};

class BertPlugin final : public loom::Plugin {
 public:
  std::string name() const override { return "bert"; }
  std::string description() const override {
    return "BERT-style encoder with a sequence-classification head (defaults: BERT-base)";
  }
  std::vector<loom::Schema> schemas() const override {
    loom::Schema s("model", "bert");
    s.key_int("vocab_size", 30522, "token ids are below this")
        .key_int("hidden_size", 768, "width (BERT-large: 1024)")
        .key_int("num_hidden_layers", 12, "encoder layers (BERT-large: 24)")
        .key_int("num_attention_heads", 12, "attention heads (BERT-large: 16)")
        .key_int("intermediate_size", 3072, "MLP width (BERT-large: 4096)")
        .key_int("max_position_embeddings", 512, "longest sequence")
        .key_int("type_vocab_size", 2, "token types")
        .key_int("num_labels", 2, "classes of the classification head")
        .key_float("hidden_dropout_prob", 0.1, "dropout of embeddings and residuals")
        .key_float("attention_probs_dropout_prob", 0.1, "dropout of attention weights")
        .key_float("layer_norm_eps", 1e-12, "LayerNorm epsilon")
        .key_float("initializer_range", 0.02, "std of the initial weights")
        .key_string("from_pretrained", "",
                    "a transformers BERT folder (save_pretrained of BertModel, BertForMaskedLM "
                    "or BertForSequenceClassification) to start from; its config.json sets the "
                    "shape keys, and a head it lacks starts fresh");
    return {s};
  }
  std::string unit_count_key(const std::string&) const override { return "num_hidden_layers"; }
  void validate(const std::string&, const loom::ConfigSection& t,
                const JobTables& job) const override {
    // A pretrained model's shape is checked when the model is made (job_config).
    if (!t.get_string("from_pretrained").empty()) {
      for (const char* key : {"hidden_dropout_prob", "attention_probs_dropout_prob"})
        LOOM_CHECK_AS(ConfigError, t.get_float(key) >= 0 && t.get_float(key) < 1, t.where(key),
                      ": [model] ", key, " must be in [0, 1)");
      LOOM_CHECK_AS(ConfigError, t.get_int("num_labels") > 0, t.where("num_labels"),
                    ": [model] num_labels must be positive");
      return;
    }
    for (const char* key : {"vocab_size", "hidden_size", "num_hidden_layers",
                            "num_attention_heads", "intermediate_size", "max_position_embeddings",
                            "type_vocab_size", "num_labels"})
      LOOM_CHECK_AS(ConfigError, t.get_int(key) > 0, t.where(key), ": [model] ", key,
                    " must be positive, got ", t.get_int(key));
    const int64_t hidden = t.get_int("hidden_size"), heads = t.get_int("num_attention_heads");
    LOOM_CHECK_AS(ConfigError, hidden % heads == 0, t.where("num_attention_heads"),
                  ": [model] hidden_size ", hidden, " must be divisible by num_attention_heads ",
                  heads);
    for (const char* key : {"hidden_dropout_prob", "attention_probs_dropout_prob"})
      LOOM_CHECK_AS(ConfigError, t.get_float(key) >= 0 && t.get_float(key) < 1, t.where(key),
                    ": [model] ", key, " must be in [0, 1)");
    LOOM_CHECK_AS(ConfigError, t.get_float("layer_norm_eps") > 0, t.where("layer_norm_eps"),
                  ": [model] layer_norm_eps must be positive");
    // The data's sample length: seq_len (text, tokens, random_tokens) or max_seq_length
    // (jsonl, csv).
    if (const loom::ConfigSection* data = job("data"); data)
      for (const char* key : {"seq_len", "max_seq_length"})
        if (data->schema().find(key) && data->get(key))
          LOOM_CHECK_AS(ConfigError, data->get_int(key) <= t.get_int("max_position_embeddings"),
                        data->where(key), ": [data] ", key, " ", data->get_int(key),
                        " exceeds [model] max_position_embeddings ", t.get_int("max_position_embeddings"),
                        "; shorten ", key, " or raise max_position_embeddings");
    const double d = static_cast<double>(hidden);
    const double params =
        static_cast<double>(t.get_int("num_hidden_layers")) *
            (4 * d * d + 2 * d * static_cast<double>(t.get_int("intermediate_size"))) +
        d * static_cast<double>(t.get_int("vocab_size") + t.get_int("max_position_embeddings"));
    loom::memory::check_model_fits(
        params, t.where("num_hidden_layers"),
        loom::detail::cat("num_hidden_layers = ", t.get_int("num_hidden_layers"),
                          ", hidden_size = ", hidden));
  }

  std::shared_ptr<loom::Model> create_model(const std::string&, const loom::ConfigSection& t,
                                            loom::Engine& engine) override {
    std::optional<loom::pretrained::Folder> folder;
    if (!t.get_string("from_pretrained").empty())
      folder.emplace(engine.resolve_path(t.get_string("from_pretrained")));
    const BertConfig c = job_config(t, folder);
    auto model = std::make_shared<Bert>(c);
    if (folder) import_weights(*model, *folder, c);
    return model;
  }

  std::optional<loom::pretrained::Export> export_pretrained(
      const std::string&, const loom::ConfigSection& t, const loom::NamedTensors& weights,
      const std::function<std::string(const std::string&)>& resolve_path) const override {
    std::optional<loom::pretrained::Folder> folder;
    nlohmann::ordered_json config = nlohmann::ordered_json::object();
    if (!t.get_string("from_pretrained").empty()) {
      folder.emplace(resolve_path(t.get_string("from_pretrained")));
      config = nlohmann::ordered_json::parse(folder->config_text());
    }
    const BertConfig c = job_config(t, folder);
    config["architectures"] = {"BertForSequenceClassification"};
    config["model_type"] = "bert";
    config["vocab_size"] = c.vocab_size;
    config["hidden_size"] = c.hidden_size;
    config["num_hidden_layers"] = c.num_hidden_layers;
    config["num_attention_heads"] = c.num_attention_heads;
    config["intermediate_size"] = c.intermediate_size;
    config["hidden_act"] = "gelu";
    config["hidden_dropout_prob"] = c.hidden_dropout_prob;
    config["attention_probs_dropout_prob"] = c.attention_probs_dropout_prob;
    config["max_position_embeddings"] = c.max_position_embeddings;
    config["type_vocab_size"] = c.type_vocab_size;
    config["initializer_range"] = c.initializer_range;
    config["layer_norm_eps"] = c.layer_norm_eps;
    config["position_embedding_type"] = "absolute";
    if (!config.contains("id2label") || static_cast<int64_t>(config["id2label"].size()) != c.num_labels) {
      config["id2label"] = nlohmann::ordered_json::object();
      config["label2id"] = nlohmann::ordered_json::object();
      for (int64_t i = 0; i < c.num_labels; ++i) {
        config["id2label"][std::to_string(i)] = "LABEL_" + std::to_string(i);
        config["label2id"]["LABEL_" + std::to_string(i)] = i;
      }
    }
    config["dtype"] = "float32";
    std::map<std::string, at::Tensor> by_name(weights.begin(), weights.end());
    auto take = [&](const std::string& name) {
      auto it = by_name.find(name);
      LOOM_CHECK_AS(CheckpointError, it != by_name.end(), "the checkpoint lacks the bert weight '",
                    name, "'");
      at::Tensor out = it->second;
      by_name.erase(it);
      return out;
    };
    loom::pretrained::Export out;
    out.config_json = config.dump(2) + "\n";
    const int64_t H = c.hidden_size;
    for (const char* p : {"weight", "bias"}) {
      for (const auto& [hf, loom_name] : bert_layers(c.num_hidden_layers))
        if (std::string(p) == "weight" || hf.find("_embeddings") == std::string::npos)
          out.tensors.emplace_back("bert." + hf + "." + p, take(loom_name + "." + p));
      for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
        const at::Tensor qkv = take("encoder." + std::to_string(i) + ".attn.qkv." + p);
        for (int k = 0; k < 3; ++k)
          out.tensors.emplace_back("bert.encoder.layer." + std::to_string(i) +
                                       ".attention.self." + kQkv[k] + "." + p,
                                   qkv.narrow(0, k * H, H).contiguous());
      }
      out.tensors.emplace_back(std::string("bert.pooler.dense.") + p, take(std::string("pooler.") + p));
      out.tensors.emplace_back(std::string("classifier.") + p, take(std::string("classifier.") + p));
    }
    LOOM_CHECK_AS(CheckpointError, by_name.empty(), "the checkpoint has weights BERT does not ('",
                  by_name.empty() ? "" : by_name.begin()->first,
                  "'); export a LoRA run with --merge (its adapters folded into the weights)");
    return out;
  }

 private:
  static void import_weights(Bert& model, const loom::pretrained::Folder& folder,
                             const BertConfig& c) {
    const std::string prefix = folder.has("bert.embeddings.word_embeddings.weight") ? "bert." : "";
    const std::string source = "pretrained model '" + folder.dir().string() + "'";
    std::map<std::string, at::Tensor> own;
    for (const auto& item : model.named_parameters()) own[item.key()] = item.value().detach();
    loom::NamedTensors tensors;
    std::set<std::string> used;
    auto read = [&](const std::string& name) {
      used.insert(name);
      return folder.read(name);
    };
    for (const char* p : {"weight", "bias"}) {
      for (const auto& [hf, loom_name] : bert_layers(c.num_hidden_layers))
        if (std::string(p) == "weight" || hf.find("_embeddings") == std::string::npos)
          tensors.emplace_back(loom_name + "." + p, read(prefix + hf + "." + p));
      for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
        std::vector<at::Tensor> parts;
        for (const char* k : kQkv)
          parts.push_back(read(prefix + "encoder.layer." + std::to_string(i) + ".attention.self." +
                               k + "." + p));
        tensors.emplace_back("encoder." + std::to_string(i) + ".attn.qkv." + p, at::cat(parts, 0));
      }
    }
    // Heads: taken when the folder has them with this shape, else they start fresh (as
    // transformers does when a BertForMaskedLM checkpoint becomes a classifier).
    std::vector<std::string> fresh;
    for (const auto& [hf, loom_name] :
         std::vector<std::pair<std::string, std::string>>{{prefix + "pooler.dense", "pooler"},
                                                          {"classifier", "classifier"}})
      for (const char* p : {".weight", ".bias"}) {
        const std::string name = hf + p;
        if (folder.has(name) && folder.shape(name) == own.at(loom_name + p).sizes().vec()) {
          tensors.emplace_back(loom_name + p, read(name));
        } else {
          tensors.emplace_back(loom_name + p, own.at(loom_name + p));
          fresh.push_back(loom_name + p);
        }
      }
    std::vector<std::string> ignored;
    for (const auto& name : folder.names())
      if (!used.count(name)) {
        const bool known = name.rfind("cls.", 0) == 0 || name.find("position_ids") != std::string::npos ||
                           name.rfind(prefix + "pooler.", 0) == 0 || name.rfind("classifier.", 0) == 0;
        LOOM_CHECK_AS(CheckpointError, known, source, " has the tensor '", name,
                      "', which loom's bert does not have");
        ignored.push_back(name);
      }
    if (!fresh.empty())
      loom::log::warn("bert: ", source, " has no ", fresh.front(),
                      fresh.size() > 1 ? " (and more)" : "", " of this shape: the pooler/classifier "
                      "start freshly initialised; train before using the predictions");
    if (!ignored.empty())
      loom::log::info("bert: ", ignored.size(), " tensors of ", source,
                      " are not used (e.g. '", ignored.front(), "': a head loom's bert lacks)");
    loom::pretrained::assign(model, tensors, source);
  }
};

}  // namespace

LOOM_DEFINE_PLUGIN(BertPlugin, "bert", "0.1.0")
