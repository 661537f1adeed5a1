// The `bert` model plugin: a BERT-style encoder (post-norm, bidirectional, GELU) with a
// sequence-classification head — the seed benchmark's model. Key names follow Hugging Face's
// BertConfig; BERT-large is hidden_size 1024, 24 layers, 16 heads, intermediate 4096.
#include <ATen/ATen.h>

#include "loom/engine.h"
#include "loom/memory.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/plugin.h"

namespace {

struct BertConfig {
  int64_t vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
      max_position_embeddings, type_vocab_size, num_labels;
  double hidden_dropout_prob, attention_probs_dropout_prob, layer_norm_eps, initializer_range;
};

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
        .key_float("initializer_range", 0.02, "std of the initial weights");
    return {s};
  }
  void validate(const std::string&, const loom::ConfigSection& t,
                const JobTables& job) const override {
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
    if (const loom::ConfigSection* data = job("data");
        data && data->schema().find("seq_len") && data->get("seq_len"))
      LOOM_CHECK_AS(ConfigError, data->get_int("seq_len") <= t.get_int("max_position_embeddings"),
                    data->where("seq_len"), ": [data] seq_len ", data->get_int("seq_len"),
                    " exceeds [model] max_position_embeddings ",
                    t.get_int("max_position_embeddings"),
                    "; shorten seq_len or raise max_position_embeddings");
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
                                            loom::Engine&) override {
    BertConfig c{t.get_int("vocab_size"),          t.get_int("hidden_size"),
                 t.get_int("num_hidden_layers"),   t.get_int("num_attention_heads"),
                 t.get_int("intermediate_size"),   t.get_int("max_position_embeddings"),
                 t.get_int("type_vocab_size"),     t.get_int("num_labels"),
                 t.get_float("hidden_dropout_prob"), t.get_float("attention_probs_dropout_prob"),
                 t.get_float("layer_norm_eps"),    t.get_float("initializer_range")};
    return std::make_shared<Bert>(c);
  }
};

}  // namespace

LOOM_DEFINE_PLUGIN(BertPlugin, "bert", "0.1.0")
