// The `gpt` model plugin: a GPT-2-style decoder language model built from loom::nn blocks
// (so LoRA, checkpointing, MoE and ZeRO-3 apply). Not a tokenizer: it maps token ids to
// next-token logits and a summed cross-entropy, and decodes with a KV cache (`loom generate`). It imports and exports
// transformers' GPT2LMHeadModel folders (Note [GPT-2 names]).
#include <ATen/ATen.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "loom/engine.h"
#include "loom/memory.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/plugin.h"
#include "loom/hf_config.h"
#include "loom/loss.h"
#include "loom/pretrained.h"

namespace {

struct GptConfig {
  int64_t vocab_size, n_positions, n_embd, n_layer, n_head, n_inner;
  double dropout, layer_norm_epsilon, initializer_range;
  bool tie_word_embeddings;
  loom::nn::FeedForward::Activation activation = loom::nn::FeedForward::Activation::gelu_tanh;
  // Training choices, not the architecture: Note [Fused linear cross-entropy] in loom/loss.h.
  bool fused_cross_entropy = true;
  int64_t cross_entropy_chunk = 0;
};

// Note [GPT-2 names]: transformers' GPT2LMHeadModel stores Conv1D weights as (in, out), the
// transpose of a Linear's; c_attn's output columns are q, k, v, each split into heads as loom's
// qkv is; "transformer." prefixes every name but lm_head's, which a tied model does not save.
struct NamePair {
  std::string hf, loom;
  bool transpose;
};
std::vector<NamePair> gpt2_names(int64_t n_layer, bool tied) {
  std::vector<NamePair> names = {{"transformer.wte.weight", "wte.weight", false},
                                 {"transformer.wpe.weight", "wpe.weight", false}};
  for (int64_t i = 0; i < n_layer; ++i) {
    const std::string hf = "transformer.h." + std::to_string(i) + ".";
    const std::string loom = "h." + std::to_string(i) + ".";
    for (const char* p : {"weight", "bias"}) {
      names.push_back({hf + "ln_1." + p, loom + "norm1." + p, false});
      names.push_back({hf + "attn.c_attn." + p, loom + "attn.qkv." + p, p[0] == 'w'});
      names.push_back({hf + "attn.c_proj." + p, loom + "attn.proj." + p, p[0] == 'w'});
      names.push_back({hf + "ln_2." + p, loom + "norm2." + p, false});
      names.push_back({hf + "mlp.c_fc." + p, loom + "ffn.fc_in." + p, p[0] == 'w'});
      names.push_back({hf + "mlp.c_proj." + p, loom + "ffn.fc_out." + p, p[0] == 'w'});
    }
  }
  for (const char* p : {"weight", "bias"})
    names.push_back({std::string("transformer.ln_f.") + p, std::string("ln_f.") + p, false});
  if (!tied) names.push_back({"lm_head.weight", "lm_head.weight", false});
  return names;
}

// A GPT2Config's fields, checked: what loom's gpt cannot express is an error naming the key.
GptConfig config_from_hf(const loom::pretrained::HfConfig& hf) {
  const std::string& file = hf.file();
  auto number = [&](const char* key, double def) { return hf.number(key, def); };
  auto integer = [&](const char* key, int64_t def) { return hf.integer(key, def); };
  auto flag = [&](const char* key, bool def) { return hf.flag(key, def); };
  const std::string type = hf.type();
  LOOM_CHECK_AS(ConfigError, type == "gpt2", "'", file, "' describes a model of type '", type,
                "'; [model] gpt imports model_type 'gpt2' (GPT2LMHeadModel, GPT2Model) only. loom "
                "imports: ", loom::pretrained::kImportable);
  for (const char* off : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"})
    LOOM_CHECK_AS(ConfigError, !flag(off, false), "'", file, "': ", off,
                  " = true is not supported by loom's gpt");
  LOOM_CHECK_AS(ConfigError, flag("scale_attn_weights", true), "'", file,
                "': scale_attn_weights = false is not supported by loom's gpt");
  GptConfig c{integer("vocab_size", 50257), integer("n_positions", 1024), integer("n_embd", 768),
              integer("n_layer", 12),       integer("n_head", 12),        integer("n_inner", 0),
              number("resid_pdrop", 0.1),   number("layer_norm_epsilon", 1e-5),
              number("initializer_range", 0.02), flag("tie_word_embeddings", true)};
  const std::string act = hf.text("activation_function", "gelu_new");
  using Act = loom::nn::FeedForward::Activation;
  if (act == "gelu_new" || act == "gelu_pytorch_tanh") c.activation = Act::gelu_tanh;
  else if (act == "gelu") c.activation = Act::gelu;
  else if (act == "relu") c.activation = Act::relu;
  else
    throw loom::ConfigError(loom::detail::cat("'", file, "': activation_function '", act,
                                        "' is not supported; loom's gpt has gelu_new, "
                                        "gelu_pytorch_tanh, gelu and relu"));
  return c;
}

// The model's configuration: the job's [model] keys, or a pretrained folder's config.json
// where the job names one (its architecture keys, where the job sets them too, must agree).
GptConfig job_config(const loom::ConfigSection& t,
                     const std::optional<loom::pretrained::Folder>& folder) {
  GptConfig c{t.get_int("vocab_size"), t.get_int("n_positions"), t.get_int("n_embd"),
              t.get_int("n_layer"),    t.get_int("n_head"),      t.get_int("n_inner"),
              t.get_float("dropout"),  t.get_float("layer_norm_epsilon"),
              t.get_float("initializer_range"), t.get_bool("tie_word_embeddings")};
  c.fused_cross_entropy = t.get_bool("fused_cross_entropy");
  c.cross_entropy_chunk = t.get_int("cross_entropy_chunk");
  if (!folder) return c;
  const std::string file = folder->config_path().string();
  GptConfig p = config_from_hf(loom::pretrained::HfConfig(*folder));
  const std::pair<const char*, int64_t> ints[] = {
      {"vocab_size", p.vocab_size}, {"n_positions", p.n_positions}, {"n_embd", p.n_embd},
      {"n_layer", p.n_layer},       {"n_head", p.n_head},           {"n_inner", p.n_inner}};
  for (const auto& [key, value] : ints)
    LOOM_CHECK_AS(ConfigError, !t.has(key) || t.get_int(key) == value, t.where(key),
                  ": [model] ", key, " = ", t.get_int(key), " but the pretrained model's '",
                  file, "' has ", value, "; remove the key (it comes from config.json)");
  LOOM_CHECK_AS(ConfigError,
                !t.has("tie_word_embeddings") ||
                    t.get_bool("tie_word_embeddings") == p.tie_word_embeddings,
                t.where("tie_word_embeddings"),
                ": [model] tie_word_embeddings differs from the pretrained model's '", file, "'");
  for (const auto& [key, value] : ints)
    LOOM_CHECK_AS(ConfigError, value > 0 || (value == 0 && std::string(key) == "n_inner"), "'",
                  file, "': ", key, " is ", value, ", it must be positive");
  LOOM_CHECK_AS(ConfigError, p.n_embd % p.n_head == 0, "'", file, "': n_embd ", p.n_embd,
                " is not divisible by n_head ", p.n_head);
  if (t.has("dropout")) p.dropout = t.get_float("dropout");  // a training choice: the job's
  if (t.has("layer_norm_epsilon")) p.layer_norm_epsilon = t.get_float("layer_norm_epsilon");
  p.fused_cross_entropy = c.fused_cross_entropy;
  p.cross_entropy_chunk = c.cross_entropy_chunk;
  return p;
}

class Gpt final : public loom::Model, public loom::CausalLM {
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
    block.activation = c.activation;
    for (int64_t i = 0; i < c.n_layer; ++i)
      units->push_back(std::make_shared<loom::nn::TransformerBlock>(block));
    ln_f = register_module("ln_f",
                           std::make_shared<loom::nn::LayerNorm>(c.n_embd, c.layer_norm_epsilon));
    if (!c.tie_word_embeddings)
      lm_head = register_module("lm_head",
                                std::make_shared<loom::nn::Linear>(c.n_embd, c.vocab_size, false));
    // GPT-2: residual projections scaled by 1/sqrt(2 * n_layer), each unit as init_normal_
    // finishes it (Note [Sharded initialization]: the last moment it is whole).
    const double scale = 1.0 / std::sqrt(2.0 * static_cast<double>(c.n_layer));
    loom::nn::init_normal_(*this, c.initializer_range, [scale](loom::nn::Unit& u) {
      auto& unit = static_cast<loom::nn::TransformerBlock&>(u);
      unit.attn->proj->weight.mul_(scale);
      if (auto* ffn = dynamic_cast<loom::nn::FeedForward*>(unit.ffn.get()))
        ffn->fc_out->weight.mul_(scale);
    });
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
    if (batch.labels.defined())
      LOOM_CHECK(batch.labels.sizes() == ids.sizes(), "gpt needs next-token labels of shape ",
                 ids.sizes(), ", got ", batch.labels.sizes(),
                 "; with random_tokens set [data] task = \"lm\"");
    return loom::nn::causal_lm_output(x, lm_head.get(), wte->weight, batch,
                                      config_.fused_cross_entropy, config_.cross_entropy_chunk);
  }

  at::Tensor decode(const at::Tensor& ids, loom::nn::KVCache& cache) override {
    const int64_t held = cache.length, T = ids.size(1);
    LOOM_CHECK(held + T <= config_.n_positions, "gpt: ", held + T,
               " positions exceed [model] n_positions ", config_.n_positions);
    at::Tensor positions = at::arange(held, held + T, ids.options());
    at::Tensor x = wte->forward(ids) + wpe->forward(positions);
    loom::nn::UnitArgs args;
    args.cache = &cache;
    x = ln_f->forward(units->forward(x, args));
    cache.length += T;
    return lm_head ? lm_head->forward(x) : loom::nn::linear(x, wte->weight);
  }
  int64_t max_positions() const override { return config_.n_positions; }

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
        .key_bool("tie_word_embeddings", true, "the LM head shares the token embedding")
        .key_bool("fused_cross_entropy", true,
                  "the loss runs the LM head chunk by chunk and never holds the (tokens, "
                  "vocab) logits; training outputs then carry no logits")
        .key_int("cross_entropy_chunk", 0,
                 "tokens per chunk of the fused loss (0: about 16 M logits per chunk)")
        .key_string("from_pretrained", "",
                    "a transformers GPT-2 folder (save_pretrained: config.json + safetensors) "
                    "to start from; its config.json sets the shape keys");
    return {s};
  }
  std::string unit_count_key(const std::string&) const override { return "n_layer"; }
  void validate(const std::string&, const loom::ConfigSection& t,
                const JobTables& job) const override {
    // A pretrained model's shape comes from its config.json, checked when the model is made
    // (job_config): here only what the job itself sets.
    if (!t.get_string("from_pretrained").empty()) {
      for (const char* key : {"vocab_size", "n_positions", "n_embd", "n_layer", "n_head"})
        LOOM_CHECK_AS(ConfigError, !t.has(key) || t.get_int(key) > 0, t.where(key), ": [model] ",
                      key, " must be positive, got ", t.get_int(key));
      LOOM_CHECK_AS(ConfigError, t.get_float("dropout") >= 0 && t.get_float("dropout") < 1,
                    t.where("dropout"), ": [model] dropout must be in [0, 1)");
      return;
    }
    for (const char* key : {"vocab_size", "n_positions", "n_embd", "n_layer", "n_head"})
      LOOM_CHECK_AS(ConfigError, t.get_int(key) > 0, t.where(key), ": [model] ", key,
                    " must be positive, got ", t.get_int(key));
    LOOM_CHECK_AS(ConfigError, t.get_int("cross_entropy_chunk") >= 0, t.where("cross_entropy_chunk"),
                  ": [model] cross_entropy_chunk must be >= 0 (0: automatic), got ",
                  t.get_int("cross_entropy_chunk"));
    LOOM_CHECK_AS(ConfigError, t.get_int("n_inner") >= 0, t.where("n_inner"),
                  ": [model] n_inner must be >= 0 (0: 4 x n_embd), got ", t.get_int("n_inner"));
    const int64_t n_embd = t.get_int("n_embd"), n_head = t.get_int("n_head");
    LOOM_CHECK_AS(ConfigError, n_embd % n_head == 0, t.where("n_head"), ": [model] n_embd ",
                  n_embd, " must be divisible by n_head ", n_head);
    LOOM_CHECK_AS(ConfigError, t.get_float("dropout") >= 0 && t.get_float("dropout") < 1,
                  t.where("dropout"), ": [model] dropout must be in [0, 1)");
    LOOM_CHECK_AS(ConfigError, t.get_float("layer_norm_epsilon") > 0,
                  t.where("layer_norm_epsilon"), ": [model] layer_norm_epsilon must be positive");
    // The data's sample length: seq_len (text, tokens, random_tokens) or max_seq_length
    // (jsonl, csv).
    if (const loom::ConfigSection* data = job("data"); data)
      for (const char* key : {"seq_len", "max_seq_length"})
        if (data->schema().find(key) && data->get(key))
          LOOM_CHECK_AS(ConfigError, data->get_int(key) <= t.get_int("n_positions"),
                        data->where(key), ": [data] ", key, " ", data->get_int(key),
                        " exceeds [model] n_positions ", t.get_int("n_positions"),
                        "; shorten ", key, " or raise n_positions");
    const double d = static_cast<double>(n_embd), layers = static_cast<double>(t.get_int("n_layer"));
    const double inner = t.get_int("n_inner") > 0 ? static_cast<double>(t.get_int("n_inner")) : 4 * d;
    const double params = layers * (4 * d * d + 2 * d * inner) +
                          d * static_cast<double>(t.get_int("vocab_size") + t.get_int("n_positions"));
    loom::memory::check_model_fits(params, t.where("n_layer"),
                                   loom::detail::cat("n_layer = ", t.get_int("n_layer"),
                                                     ", n_embd = ", n_embd));
  }

  std::shared_ptr<loom::Model> create_model(const std::string&, const loom::ConfigSection& t,
                                            loom::Engine& engine) override {
    std::optional<loom::pretrained::Folder> folder;
    if (!t.get_string("from_pretrained").empty())
      folder.emplace(engine.resolve_path(t.get_string("from_pretrained")));
    const GptConfig c = job_config(t, folder);
    auto model = std::make_shared<Gpt>(c);
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
      // Keep what loom does not model (token ids, task settings...) as the original had it.
      config = nlohmann::ordered_json::parse(folder->config_text());
    }
    const GptConfig c = job_config(t, folder);
    config["architectures"] = {"GPT2LMHeadModel"};
    config["model_type"] = "gpt2";
    config["vocab_size"] = c.vocab_size;
    config["n_positions"] = c.n_positions;
    config["n_embd"] = c.n_embd;
    config["n_layer"] = c.n_layer;
    config["n_head"] = c.n_head;
    config["n_inner"] = c.n_inner > 0 ? nlohmann::ordered_json(c.n_inner) : nlohmann::ordered_json();
    using Act = loom::nn::FeedForward::Activation;
    config["activation_function"] = c.activation == Act::gelu_tanh ? "gelu_new"
                                    : c.activation == Act::gelu    ? "gelu"
                                                                   : "relu";
    config["resid_pdrop"] = config["embd_pdrop"] = config["attn_pdrop"] = c.dropout;
    config["layer_norm_epsilon"] = c.layer_norm_epsilon;
    config["initializer_range"] = c.initializer_range;
    config["tie_word_embeddings"] = c.tie_word_embeddings;
    if (!config.contains("bos_token_id")) config["bos_token_id"] = std::min<int64_t>(50256, c.vocab_size - 1);
    if (!config.contains("eos_token_id")) config["eos_token_id"] = std::min<int64_t>(50256, c.vocab_size - 1);
    config["dtype"] = "float32";
    std::map<std::string, at::Tensor> by_name(weights.begin(), weights.end());
    for (const auto& [name, tensor] : by_name)
      LOOM_CHECK_AS(CheckpointError, name.find(".ffn.router") == std::string::npos,
                    "the checkpoint is a Mixture-of-Experts GPT ([moe]: '", name, "'), which "
                    "transformers' GPT2LMHeadModel cannot hold; `loom consolidate` gives its "
                    "weights in one safetensors file");
    loom::pretrained::Export out;
    out.config_json = config.dump(2) + "\n";
    for (const auto& [hf, loom_name, transpose] : gpt2_names(c.n_layer, c.tie_word_embeddings)) {
      auto it = by_name.find(loom_name);
      LOOM_CHECK_AS(CheckpointError, it != by_name.end(), "the checkpoint lacks the gpt weight '",
                    loom_name, "'");
      out.tensors.emplace_back(hf, transpose ? it->second.t().contiguous() : it->second);
      by_name.erase(it);
    }
    LOOM_CHECK_AS(CheckpointError, by_name.empty(), "the checkpoint has weights GPT-2 does not ('",
                  by_name.empty() ? "" : by_name.begin()->first,
                  "'); export a LoRA run with --merge (its adapters folded into the weights)");
    return out;
  }

 private:
  static void import_weights(Gpt& model, const loom::pretrained::Folder& folder,
                             const GptConfig& c) {
    // GPT2Model folders save the same names without "transformer.".
    const bool prefixed = folder.has("transformer.wte.weight");
    const std::string source = "pretrained model '" + folder.dir().string() + "'";
    loom::NamedTensors tensors;
    std::set<std::string> used;
    for (const auto& [hf, loom_name, transpose] : gpt2_names(c.n_layer, c.tie_word_embeddings)) {
      std::string name = hf;
      if (!prefixed && name.rfind("transformer.", 0) == 0) name = name.substr(12);
      at::Tensor t = folder.map(name);
      tensors.emplace_back(loom_name, transpose ? t.t() : t);
      used.insert(name);
    }
    for (const auto& name : folder.names()) {
      // The causal-mask buffers older transformers saved, and a tied head saved anyway.
      const bool known_extra =
          (name.size() > 10 && name.compare(name.size() - 10, 10, ".attn.bias") == 0) ||
          name.find(".attn.masked_bias") != std::string::npos ||
          (name == "lm_head.weight" && c.tie_word_embeddings);
      LOOM_CHECK_AS(CheckpointError, used.count(name) || known_extra, source,
                    " has the tensor '", name, "', which loom's gpt does not have");
    }
    loom::pretrained::assign(model, tensors, source);
  }
};

}  // namespace

LOOM_DEFINE_PLUGIN(GptPlugin, "gpt", "0.1.0")
