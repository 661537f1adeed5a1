// The `gpt` model plugin: a GPT-2-style decoder language model built from loom::nn blocks
// (so LoRA, checkpointing, MoE and ZeRO-3 apply). Not a tokenizer or a generator: it maps
// token ids to next-token logits and a summed cross-entropy.
#include <ATen/ATen.h>

#include <cmath>

#include "loom/engine.h"
#include "loom/memory.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/plugin.h"

namespace {

struct GptConfig {
  int64_t vocab_size, n_positions, n_embd, n_layer, n_head, n_inner;
  double dropout, layer_norm_epsilon, initializer_range;
  bool tie_word_embeddings;
};

class Gpt final : public loom::Model {
 public:
  explicit Gpt(const GptConfig& c) : config_(c) {
    wte = register_module("wte", std::make_shared<loom::nn::Embedding>(c.vocab_size, c.n_embd));
    wpe = register_module("wpe", std::make_shared<loom::nn::Embedding>(c.n_positions, c.n_embd));
    units = register_module("h", std::make_shared<loom::nn::UnitList>());
    loom::nn::TransformerBlock::Options block;
    block.dim = c.n_embd;
    block.n_heads = c.n_head;
    block.hidden = c.n_inner > 0 ? c.n_inner : 4 * c.n_embd;
    block.causal = true;
    block.pre_norm = true;
    block.dropout = block.attention_dropout = c.dropout;
    block.norm_eps = c.layer_norm_epsilon;
    block.activation = loom::nn::FeedForward::Activation::gelu_tanh;
    for (int64_t i = 0; i < c.n_layer; ++i)
      units->push_back(std::make_shared<loom::nn::TransformerBlock>(block));
    ln_f = register_module("ln_f",
                           std::make_shared<loom::nn::LayerNorm>(c.n_embd, c.layer_norm_epsilon));
    if (!c.tie_word_embeddings)
      lm_head = register_module("lm_head",
                                std::make_shared<loom::nn::Linear>(c.n_embd, c.vocab_size, false));
    loom::nn::init_normal_(*this, c.initializer_range);
    // GPT-2: residual projections scaled by 1/sqrt(2 * n_layer).
    at::NoGradGuard no_grad;
    const double scale = 1.0 / std::sqrt(2.0 * static_cast<double>(c.n_layer));
    for (size_t i = 0; i < units->size(); ++i) {
      auto& unit = static_cast<loom::nn::TransformerBlock&>((*units)[i]);
      unit.attn->proj->weight.mul_(scale);
      if (auto* ffn = dynamic_cast<loom::nn::FeedForward*>(unit.ffn.get()))
        ffn->fc_out->weight.mul_(scale);
    }
  }

  loom::Output forward(const loom::Batch& batch) override {
    // input_ids (B,T) -> logits (B,T,V); labels (B,T).
    const at::Tensor& ids = batch.input_ids;
    LOOM_CHECK(ids.dim() == 2, "gpt takes input_ids of shape (B,T), got ", ids.sizes());
    const int64_t T = ids.size(1);
    LOOM_CHECK(T <= config_.n_positions, "gpt: sequence length ", T, " exceeds [model] n_positions ",
               config_.n_positions, "; raise n_positions or shorten [data] seq_len");
    const auto [min_id, max_id] = batch.input_id_range();  // host counts: no GPU sync
    LOOM_CHECK(max_id < config_.vocab_size && min_id >= 0, "gpt: token id ",
               min_id < 0 ? min_id : max_id, " is outside [model] vocab_size ", config_.vocab_size,
               "; raise vocab_size to cover the data's ids");
    at::Tensor positions = at::arange(T, ids.options());
    at::Tensor x = at::dropout(wte->forward(ids) + wpe->forward(positions), config_.dropout,
                               is_training());
    x = ln_f->forward(units->forward(x));
    at::Tensor logits = lm_head ? lm_head->forward(x) : at::linear(x, wte->weight);
    loom::Output out;
    out.logits = logits;
    if (batch.labels.defined()) {
      LOOM_CHECK(batch.labels.sizes() == ids.sizes(), "gpt needs next-token labels of shape ",
                 ids.sizes(), ", got ", batch.labels.sizes(),
                 "; with random_tokens set [data] task = \"lm\"");
      out.loss_sum = at::cross_entropy_loss(logits.view({-1, logits.size(-1)}).to(at::kFloat),
                                            batch.labels.reshape({-1}), {}, at::Reduction::Sum,
                                            loom::kIgnoreIndex);
      out.num_targets = batch.num_loss_targets();
    }
    return out;
  }

  std::shared_ptr<loom::nn::Embedding> wte, wpe;
  std::shared_ptr<loom::nn::UnitList> units;
  std::shared_ptr<loom::nn::LayerNorm> ln_f;
  std::shared_ptr<loom::nn::Linear> lm_head;

 private:
  GptConfig config_;
};

class GptPlugin final : public loom::Plugin {
 public:
  std::string name() const override { return "gpt"; }
  std::string description() const override {
    return "GPT-2-style decoder language model (defaults: GPT-2 124M)";
  }
  std::vector<loom::Schema> schemas() const override {
    loom::Schema s("model", "gpt");
    s.key_int("vocab_size", 50257, "token ids are below this")
        .key_int("n_positions", 1024, "longest sequence")
        .key_int("n_embd", 768, "width")
        .key_int("n_layer", 12, "transformer blocks")
        .key_int("n_head", 12, "attention heads")
        .key_int("n_inner", 0, "MLP width (0 = 4 * n_embd)")
        .key_float("dropout", 0.1, "dropout of embeddings, attention and residuals")
        .key_float("layer_norm_epsilon", 1e-5, "LayerNorm epsilon")
        .key_float("initializer_range", 0.02, "std of the initial weights")
        .key_bool("tie_word_embeddings", true, "the LM head shares the token embedding");
    return {s};
  }
  void validate(const std::string&, const loom::ConfigSection& t,
                const JobTables& job) const override {
    for (const char* key : {"vocab_size", "n_positions", "n_embd", "n_layer", "n_head"})
      LOOM_CHECK_AS(ConfigError, t.get_int(key) > 0, t.where(key), ": [model] ", key,
                    " must be positive, got ", t.get_int(key));
    LOOM_CHECK_AS(ConfigError, t.get_int("n_inner") >= 0, t.where("n_inner"),
                  ": [model] n_inner must be >= 0 (0: 4 x n_embd), got ", t.get_int("n_inner"));
    const int64_t n_embd = t.get_int("n_embd"), n_head = t.get_int("n_head");
    LOOM_CHECK_AS(ConfigError, n_embd % n_head == 0, t.where("n_head"), ": [model] n_embd ",
                  n_embd, " must be divisible by n_head ", n_head);
    LOOM_CHECK_AS(ConfigError, t.get_float("dropout") >= 0 && t.get_float("dropout") < 1,
                  t.where("dropout"), ": [model] dropout must be in [0, 1)");
    LOOM_CHECK_AS(ConfigError, t.get_float("layer_norm_epsilon") > 0,
                  t.where("layer_norm_epsilon"), ": [model] layer_norm_epsilon must be positive");
    if (const loom::ConfigSection* data = job("data");
        data && data->schema().find("seq_len") && data->get("seq_len"))
      LOOM_CHECK_AS(ConfigError, data->get_int("seq_len") <= t.get_int("n_positions"),
                    data->where("seq_len"), ": [data] seq_len ", data->get_int("seq_len"),
                    " exceeds [model] n_positions ", t.get_int("n_positions"),
                    "; shorten seq_len or raise n_positions");
    const double d = static_cast<double>(n_embd), layers = static_cast<double>(t.get_int("n_layer"));
    const double inner = t.get_int("n_inner") > 0 ? static_cast<double>(t.get_int("n_inner")) : 4 * d;
    const double params = layers * (4 * d * d + 2 * d * inner) +
                          d * static_cast<double>(t.get_int("vocab_size") + t.get_int("n_positions"));
    loom::memory::check_model_fits(params, t.where("n_layer"),
                                   loom::detail::cat("n_layer = ", t.get_int("n_layer"),
                                                     ", n_embd = ", n_embd));
  }

  std::shared_ptr<loom::Model> create_model(const std::string&, const loom::ConfigSection& t,
                                            loom::Engine&) override {
    GptConfig c{t.get_int("vocab_size"), t.get_int("n_positions"), t.get_int("n_embd"),
                t.get_int("n_layer"),    t.get_int("n_head"),      t.get_int("n_inner"),
                t.get_float("dropout"),  t.get_float("layer_norm_epsilon"),
                t.get_float("initializer_range"), t.get_bool("tie_word_embeddings")};
    return std::make_shared<Gpt>(c);
  }
};

}  // namespace

LOOM_DEFINE_PLUGIN(GptPlugin, "gpt", "0.1.0")
