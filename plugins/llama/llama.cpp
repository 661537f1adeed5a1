// The `llama` model plugin: a Llama-style decoder language model — RMSNorm, rotary position
// embeddings (transformers' rope types default, linear, dynamic and llama3), SwiGLU, grouped-query
// attention, tied or untied head — built from loom::nn blocks with a UnitList, so LoRA,
// checkpointing and ZeRO-3 apply. Its parameters carry transformers' LlamaForCausalLM names
// (model.layers.0.self_attn.q_proj.weight, ...): import, export and PEFT adapters (targets
// q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) need no name mapping.
#include <ATen/ATen.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "loom/engine.h"
#include "loom/memory.h"
#include "loom/loss.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/plugin.h"
#include "loom/hf_config.h"
#include "loom/pretrained.h"

namespace {

using loom::ConfigError;

// Note [Rope types]: the inverse frequencies of transformers' rope_type choices, computed as
// modeling_rope_utils does (fp32): "default" θ^(-2i/d); "linear" divides them by `factor`;
// "dynamic" (NTK) raises the base once a sequence is longer than max_position_embeddings;
// "llama3" divides the low frequencies by `factor` and blends the middle band.
struct Rope {
  std::string type = "default";
  double theta = 10000.0, factor = 1.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_positions = 0;  // llama3; 0 = max_position_embeddings
};

struct LlamaConfig {
  int64_t vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
      num_key_value_heads, head_dim, max_position_embeddings;
  double rms_norm_eps, initializer_range, attention_dropout;
  bool tie_word_embeddings, attention_bias, mlp_bias;
  Rope rope;
  // Training choices, not the architecture: Note [Fused linear cross-entropy] in loom/loss.h.
  bool fused_cross_entropy = true;
  int64_t cross_entropy_chunk = 0;
  int64_t kv_heads() const { return num_key_value_heads > 0 ? num_key_value_heads : num_attention_heads; }
  int64_t dim_per_head() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }
};

const std::set<std::string> kRopeTypes = {"default", "linear", "dynamic", "llama3"};

// (head_dim / 2) fp32 inverse frequencies for a forward whose positions end before `seq_len`.
at::Tensor inverse_frequencies(const LlamaConfig& c, int64_t seq_len, const at::Device& device) {
  const int64_t dim = c.dim_per_head();
  const Rope& r = c.rope;
  double base = r.theta;
  if (r.type == "dynamic" && seq_len > c.max_position_embeddings)
    base *= std::pow(r.factor * static_cast<double>(seq_len) /
                             static_cast<double>(c.max_position_embeddings) -
                         (r.factor - 1.0),
                     static_cast<double>(dim) / static_cast<double>(dim - 2));
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor exponents = at::arange(0, dim, 2, f32.dtype(at::kLong)).to(at::kFloat) /
                         static_cast<double>(dim);
  at::Tensor inv = at::reciprocal(at::pow(base, exponents));
  if (r.type == "linear") inv = inv / r.factor;
  if (r.type == "llama3") {
    const double old_len = static_cast<double>(r.original_max_positions > 0
                                                   ? r.original_max_positions
                                                   : c.max_position_embeddings);
    const double low_wavelen = old_len / r.low_freq_factor;
    const double high_wavelen = old_len / r.high_freq_factor;
    at::Tensor wavelen = (2 * M_PI) / inv;
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
    at::Tensor smooth = (old_len / wavelen - r.low_freq_factor) /
                        (r.high_freq_factor - r.low_freq_factor);
    at::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
    at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
    inv = at::where(medium, smoothed, scaled);
  }
  return inv;
}

class LlamaAttention : public torch::nn::Module {
 public:
  explicit LlamaAttention(const LlamaConfig& c) : c_(c) {
    const int64_t D = c.dim_per_head();
    q_proj = register_module("q_proj", std::make_shared<loom::nn::Linear>(
                                           c.hidden_size, c.num_attention_heads * D, c.attention_bias));
    k_proj = register_module("k_proj", std::make_shared<loom::nn::Linear>(
                                           c.hidden_size, c.kv_heads() * D, c.attention_bias));
    v_proj = register_module("v_proj", std::make_shared<loom::nn::Linear>(
                                           c.hidden_size, c.kv_heads() * D, c.attention_bias));
    o_proj = register_module("o_proj", std::make_shared<loom::nn::Linear>(
                                           c.num_attention_heads * D, c.hidden_size, c.attention_bias));
  }

  // x (B,T,C) at positions held..held+T-1 (held: what args.kv holds, 0 without a cache). The
  // core, from the projections' outputs to o_proj's input, is a region in training (Note
  // [Recompute regions]); decoding appends to the cache inside it, so it runs as is there.
  at::Tensor forward(const at::Tensor& x, const loom::nn::UnitArgs& args) {
    const int64_t B = x.size(0), T = x.size(1), D = c_.dim_per_head();
    const int64_t H = c_.num_attention_heads, Hkv = c_.kv_heads();
    loom::nn::KVCache::Layer* kv = args.kv;
    const int64_t held = kv ? kv->held() : 0;
    const double p = is_training() ? c_.attention_dropout : 0.0;
    const LlamaConfig& c = c_;
    const c10::Device device = x.device();
    const at::ScalarType dtype = x.scalar_type();
    // q, k, v (B,T,H*D), (B,T,Hkv*D) x2 -> (B,T,H*D). Captures by value but for kv (null when
    // it runs as a region) and c (the module's own config).
    auto core = [B, T, D, H, Hkv, held, p, kv, &c, device,
                 dtype](const std::vector<at::Tensor>& in) {
      at::Tensor q = in[0].view({B, T, H, D}).transpose(1, 2);
      at::Tensor k = in[1].view({B, T, Hkv, D}).transpose(1, 2);
      at::Tensor v = in[2].view({B, T, Hkv, D}).transpose(1, 2);
      // cos and sin in fp32, then the activations' dtype (as transformers does).
      at::Tensor inv = inverse_frequencies(c, held + T, device);
      at::Tensor positions = at::arange(held, held + T, inv.options());
      at::Tensor freqs = positions.unsqueeze(1) * inv.unsqueeze(0);
      at::Tensor angles = at::cat({freqs, freqs}, -1);
      at::Tensor cos = angles.cos().to(dtype), sin = angles.sin().to(dtype);
      q = loom::nn::rotary(q, cos, sin);  // x·cos + rotate_half(x)·sin
      k = loom::nn::rotary(k, cos, sin);
      std::optional<at::Tensor> mask;
      bool causal = true;
      if (kv) {
        kv->append(k, v);
        if (held > 0) {
          causal = false;
          if (T > 1) mask = loom::nn::causal_mask(held, T, at::TensorOptions(device));
        }
      }
      if (Hkv != H) {  // grouped-query attention: query head j reads key/value head j / (H/Hkv)
        k = k.repeat_interleave(H / Hkv, 1);
        v = v.repeat_interleave(H / Hkv, 1);
      }
      at::Tensor y = loom::nn::attention(q, k, v, mask, p, causal && T > 1);
      return y.transpose(1, 2).reshape({B, T, H * D});
    };
    std::vector<at::Tensor> qkv = {q_proj->forward(x), k_proj->forward(x), v_proj->forward(x)};
    return o_proj->forward(kv ? core(qkv)
                              : args.region(loom::nn::Region::attention, nullptr, qkv, core));
  }

  std::shared_ptr<loom::nn::Linear> q_proj, k_proj, v_proj, o_proj;

 private:
  LlamaConfig c_;
};

class LlamaMlp : public loom::nn::FeedForwardBase {
 public:
  explicit LlamaMlp(const LlamaConfig& c) {
    gate_proj = register_module("gate_proj", std::make_shared<loom::nn::Linear>(
                                                 c.hidden_size, c.intermediate_size, c.mlp_bias));
    up_proj = register_module("up_proj", std::make_shared<loom::nn::Linear>(
                                             c.hidden_size, c.intermediate_size, c.mlp_bias));
    down_proj = register_module("down_proj", std::make_shared<loom::nn::Linear>(
                                                 c.intermediate_size, c.hidden_size, c.mlp_bias));
  }
  at::Tensor forward(const at::Tensor& x) override {  // SwiGLU
    return down_proj->forward(loom::nn::swiglu(gate_proj->forward(x), up_proj->forward(x)));
  }
  std::shared_ptr<loom::nn::Linear> gate_proj, up_proj, down_proj;
};

class LlamaLayer : public loom::nn::Unit {
 public:
  explicit LlamaLayer(const LlamaConfig& c) {
    input_layernorm = register_module(
        "input_layernorm", std::make_shared<loom::nn::RMSNorm>(c.hidden_size, c.rms_norm_eps));
    self_attn = register_module("self_attn", std::make_shared<LlamaAttention>(c));
    post_attention_layernorm = register_module(
        "post_attention_layernorm",
        std::make_shared<loom::nn::RMSNorm>(c.hidden_size, c.rms_norm_eps));
    mlp = register_module("mlp", std::make_shared<LlamaMlp>(c));
  }
  at::Tensor forward(const at::Tensor& x, const loom::nn::UnitArgs& args) override {
    at::Tensor h = x + self_attn->forward(input_layernorm->forward(x), args);
    LlamaMlp* m = mlp.get();
    return h + args.region(loom::nn::Region::mlp, m, {post_attention_layernorm->forward(h)},
                           [m](const std::vector<at::Tensor>& in) { return m->forward(in[0]); });
  }
  std::shared_ptr<loom::nn::RMSNorm> input_layernorm, post_attention_layernorm;
  std::shared_ptr<LlamaAttention> self_attn;
  std::shared_ptr<LlamaMlp> mlp;
};

// transformers' LlamaModel: what LlamaForCausalLM holds as "model".
class LlamaBody : public torch::nn::Module {
 public:
  explicit LlamaBody(const LlamaConfig& c) {
    embed_tokens = register_module("embed_tokens", std::make_shared<loom::nn::Embedding>(
                                                       c.vocab_size, c.hidden_size));
    layers = register_module("layers", std::make_shared<loom::nn::UnitList>());
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      layers->push_back(std::make_shared<LlamaLayer>(c));
    norm = register_module("norm", std::make_shared<loom::nn::RMSNorm>(c.hidden_size, c.rms_norm_eps));
  }
  std::shared_ptr<loom::nn::Embedding> embed_tokens;
  std::shared_ptr<loom::nn::UnitList> layers;
  std::shared_ptr<loom::nn::RMSNorm> norm;
};

class Llama final : public loom::Model, public loom::CausalLM {
 public:
  explicit Llama(const LlamaConfig& c) : config_(c) {
    model = register_module("model", std::make_shared<LlamaBody>(c));
    if (!c.tie_word_embeddings)
      lm_head = register_module(
          "lm_head", std::make_shared<loom::nn::Linear>(c.hidden_size, c.vocab_size, false));
    loom::nn::init_normal_(*this, c.initializer_range);  // transformers' _init_weights
  }

  loom::Output forward(const loom::Batch& batch) override {
    const at::Tensor& ids = batch.input_ids;
    LOOM_CHECK(ids.dim() == 2, "llama takes input_ids of shape (B,T), got ", ids.sizes());
    const auto [min_id, max_id] = batch.input_id_range();
    LOOM_CHECK(max_id < config_.vocab_size && min_id >= 0, "llama: token id ",
               min_id < 0 ? min_id : max_id, " is outside [model] vocab_size ",
               config_.vocab_size, "; raise vocab_size to cover the data's ids");
    at::Tensor x =
        model->norm->forward(model->layers->forward(model->embed_tokens->forward(ids)));
    if (batch.labels.defined())
      LOOM_CHECK(batch.labels.sizes() == ids.sizes(), "llama needs next-token labels of shape ",
                 ids.sizes(), ", got ", batch.labels.sizes(),
                 "; with random_tokens set [data] task = \"lm\"");
    return loom::nn::causal_lm_output(x, lm_head.get(), model->embed_tokens->weight, batch,
                                      config_.fused_cross_entropy, config_.cross_entropy_chunk);
  }

  at::Tensor decode(const at::Tensor& ids, loom::nn::KVCache& cache) override {
    loom::nn::UnitArgs args;
    args.cache = &cache;
    at::Tensor logits = head(model->layers->forward(model->embed_tokens->forward(ids), args));
    cache.length += ids.size(1);
    return logits;
  }
  // Rotary positions have no table; dynamic and llama3 ropes are made for longer sequences.
  int64_t max_positions() const override {
    return config_.rope.type == "default" || config_.rope.type == "linear"
               ? config_.max_position_embeddings
               : std::numeric_limits<int64_t>::max();
  }

  std::shared_ptr<LlamaBody> model;
  std::shared_ptr<loom::nn::Linear> lm_head;

 private:
  at::Tensor head(const at::Tensor& hidden) {
    at::Tensor x = model->norm->forward(hidden);
    return lm_head ? lm_head->forward(x) : loom::nn::linear(x, model->embed_tokens->weight);
  }
  LlamaConfig config_;
};

// ---- configuration: the job's keys, or a transformers LlamaConfig (config.json) ----

void check_rope(const Rope& r, const std::string& where) {
  LOOM_CHECK_AS(ConfigError, kRopeTypes.count(r.type), where, ": rope_type '", r.type,
                "' is not supported; loom's llama has default, linear, dynamic and llama3");
  LOOM_CHECK_AS(ConfigError, r.theta > 0, where, ": rope_theta must be positive, got ", r.theta);
  LOOM_CHECK_AS(ConfigError, r.type == "default" || r.factor >= 1, where,
                ": the rope factor must be >= 1, got ", r.factor);
  LOOM_CHECK_AS(ConfigError, r.type != "llama3" || r.high_freq_factor > r.low_freq_factor, where,
                ": llama3 rope needs high_freq_factor > low_freq_factor, got ",
                r.high_freq_factor, " and ", r.low_freq_factor);
}

void check_shape(const LlamaConfig& c, const std::string& where) {
  const std::pair<const char*, int64_t> sizes[] = {
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"max_position_embeddings", c.max_position_embeddings}};
  for (const auto& [key, value] : sizes)
    LOOM_CHECK_AS(ConfigError, value > 0, where, ": ", key, " must be positive, got ", value);
  LOOM_CHECK_AS(ConfigError, c.num_key_value_heads >= 0 && c.head_dim >= 0, where,
                ": num_key_value_heads and head_dim must be >= 0 (0: the default)");
  LOOM_CHECK_AS(ConfigError, c.head_dim > 0 || c.hidden_size % c.num_attention_heads == 0, where,
                ": hidden_size ", c.hidden_size, " is not divisible by num_attention_heads ",
                c.num_attention_heads, "; set head_dim");
  LOOM_CHECK_AS(ConfigError, c.dim_per_head() % 2 == 0, where, ": the head size ",
                c.dim_per_head(), " must be even (rotary embeddings rotate pairs)");
  LOOM_CHECK_AS(ConfigError, c.num_attention_heads % c.kv_heads() == 0, where,
                ": num_attention_heads ", c.num_attention_heads,
                " must be a multiple of num_key_value_heads ", c.kv_heads());
  LOOM_CHECK_AS(ConfigError, c.rms_norm_eps > 0, where, ": rms_norm_eps must be positive");
  check_rope(c.rope, where);
}

LlamaConfig config_from_hf(const loom::pretrained::HfConfig& hf) {
  const std::string& file = hf.file();
  auto integer = [&](const char* key, int64_t def) { return hf.integer(key, def); };
  auto flag = [&](const char* key, bool def) { return hf.flag(key, def); };
  const std::string type = hf.type();
  LOOM_CHECK_AS(ConfigError, type == "llama", "'", file, "' describes a model of type '", type,
                "'; [model] llama imports model_type 'llama' (LlamaForCausalLM, LlamaModel) "
                "only. loom imports: ", loom::pretrained::kImportable);
  const std::string act = hf.text("hidden_act", "silu");
  LOOM_CHECK_AS(ConfigError, act == "silu", "'", file, "': hidden_act '", act,
                "' is not supported; loom's llama has silu (SwiGLU)");
  LlamaConfig c{integer("vocab_size", 32000),
                integer("hidden_size", 4096),
                integer("intermediate_size", 11008),
                integer("num_hidden_layers", 32),
                integer("num_attention_heads", 32),
                integer("num_key_value_heads", 0),
                integer("head_dim", 0),
                integer("max_position_embeddings", 2048),
                hf.number("rms_norm_eps", 1e-6),
                hf.number("initializer_range", 0.02),
                hf.number("attention_dropout", 0.0),
                flag("tie_word_embeddings", false),
                flag("attention_bias", false),
                flag("mlp_bias", false),
                {}};
  // transformers 5 keeps the rope in rope_parameters (rope_theta inside); 4 in rope_theta and
  // rope_scaling (null, or {"type" or "rope_type", "factor", ...}).
  const auto rope = hf.has("rope_parameters") ? hf.object("rope_parameters") : hf.object("rope_scaling");
  c.rope.theta = rope.number("rope_theta", hf.number("rope_theta", 10000.0));
  c.rope.type = rope.text("rope_type", rope.text("type", "default"));
  c.rope.factor = rope.number("factor", 1.0);
  c.rope.low_freq_factor = rope.number("low_freq_factor", 1.0);
  c.rope.high_freq_factor = rope.number("high_freq_factor", 4.0);
  c.rope.original_max_positions = rope.integer("original_max_position_embeddings", 0);
  const double partial = rope.number("partial_rotary_factor", hf.number("partial_rotary_factor", 1.0));
  LOOM_CHECK_AS(ConfigError, partial == 1.0, "'", file, "': partial_rotary_factor ", partial,
                " is not supported; loom's llama rotates the whole head");
  check_shape(c, "'" + file + "'");
  return c;
}

LlamaConfig job_config(const loom::ConfigSection& t,
                       const std::optional<loom::pretrained::Folder>& folder) {
  LlamaConfig c{t.get_int("vocab_size"),
                t.get_int("hidden_size"),
                t.get_int("intermediate_size"),
                t.get_int("num_hidden_layers"),
                t.get_int("num_attention_heads"),
                t.get_int("num_key_value_heads"),
                t.get_int("head_dim"),
                t.get_int("max_position_embeddings"),
                t.get_float("rms_norm_eps"),
                t.get_float("initializer_range"),
                t.get_float("attention_dropout"),
                t.get_bool("tie_word_embeddings"),
                t.get_bool("attention_bias"),
                t.get_bool("mlp_bias"),
                {t.get_string("rope_type"), t.get_float("rope_theta"), t.get_float("rope_factor"),
                 t.get_float("rope_low_freq_factor"), t.get_float("rope_high_freq_factor"),
                 t.get_int("rope_original_max_position_embeddings")}};
  c.fused_cross_entropy = t.get_bool("fused_cross_entropy");
  c.cross_entropy_chunk = t.get_int("cross_entropy_chunk");
  if (!folder) return c;
  const std::string file = folder->config_path().string();
  LlamaConfig p = config_from_hf(loom::pretrained::HfConfig(*folder));
  // The architecture comes from config.json; a job key that says otherwise is an error.
  const std::pair<const char*, int64_t> ints[] = {
      {"vocab_size", p.vocab_size},
      {"hidden_size", p.hidden_size},
      {"intermediate_size", p.intermediate_size},
      {"num_hidden_layers", p.num_hidden_layers},
      {"num_attention_heads", p.num_attention_heads},
      {"num_key_value_heads", p.num_key_value_heads},
      {"head_dim", p.head_dim},
      {"max_position_embeddings", p.max_position_embeddings}};
  for (const auto& [key, value] : ints)
    LOOM_CHECK_AS(ConfigError, !t.has(key) || t.get_int(key) == value, t.where(key),
                  ": [model] ", key, " = ", t.get_int(key), " but the pretrained model's '",
                  file, "' has ", value, "; remove the key (it comes from config.json)");
  for (const char* key : {"tie_word_embeddings", "attention_bias", "mlp_bias", "rope_type",
                          "rope_theta", "rope_factor"})
    LOOM_CHECK_AS(ConfigError, !t.has(key), t.where(key), ": [model] ", key,
                  " is set, but a pretrained model's comes from its '", file,
                  "'; remove the key");
  if (t.has("attention_dropout")) p.attention_dropout = t.get_float("attention_dropout");
  p.fused_cross_entropy = c.fused_cross_entropy;
  p.cross_entropy_chunk = c.cross_entropy_chunk;
  return p;
}

int64_t parameter_count(const LlamaConfig& c) {
  const int64_t C = c.hidden_size, D = c.dim_per_head();
  const int64_t attn = C * D * (2 * c.num_attention_heads + 2 * c.kv_heads());
  const int64_t mlp = 3 * C * c.intermediate_size;
  return c.num_hidden_layers * (attn + mlp + 2 * C) + C +
         c.vocab_size * C * (c.tie_word_embeddings ? 1 : 2);
}

class LlamaPlugin final : public loom::Plugin {
 public:
  std::string name() const override { return "llama"; }
  std::string description() const override {
    return "Llama-style decoder language model (RMSNorm, RoPE, SwiGLU, grouped-query "
           "attention); transformers' LlamaConfig names and defaults";
  }
  std::vector<loom::Schema> schemas() const override {
    loom::Schema s("model", "llama");
    s.key_int("vocab_size", 32000, "token ids are below this")
        .key_int("hidden_size", 4096, "width")
        .key_int("intermediate_size", 11008, "SwiGLU width")
        .key_int("num_hidden_layers", 32, "decoder layers")
        .key_int("num_attention_heads", 32, "query heads")
        .key_int("num_key_value_heads", 0, "key/value heads (grouped-query attention; 0 = "
                                           "num_attention_heads)")
        .key_int("head_dim", 0, "size of a head (0 = hidden_size / num_attention_heads)")
        .key_int("max_position_embeddings", 2048, "longest sequence (the rope's base length)")
        .key_float("rms_norm_eps", 1e-6, "RMSNorm epsilon")
        .key_float("rope_theta", 10000.0, "rotary base")
        .key_string("rope_type", "default", "default | linear | dynamic | llama3 (transformers' "
                                            "rope_parameters.rope_type)")
        .key_float("rope_factor", 1.0, "the scaling factor of linear, dynamic and llama3 ropes")
        .key_float("rope_low_freq_factor", 1.0, "llama3 rope")
        .key_float("rope_high_freq_factor", 4.0, "llama3 rope")
        .key_int("rope_original_max_position_embeddings", 0,
                 "llama3 rope's pretraining length (0 = max_position_embeddings)")
        .key_bool("tie_word_embeddings", false, "the LM head shares the token embedding")
        .key_bool("attention_bias", false, "biases in q/k/v/o projections")
        .key_bool("mlp_bias", false, "biases in the SwiGLU projections")
        .key_float("attention_dropout", 0.0, "dropout of attention probabilities")
        .key_bool("fused_cross_entropy", true,
                  "the loss runs the LM head chunk by chunk and never holds the (tokens, "
                  "vocab) logits; training outputs then carry no logits")
        .key_int("cross_entropy_chunk", 0,
                 "tokens per chunk of the fused loss (0: about 16 M logits per chunk)")
        .key_float("initializer_range", 0.02, "std of the initial weights")
        .key_string("from_pretrained", "",
                    "a transformers Llama folder (save_pretrained: config.json + safetensors) "
                    "to start from; its config.json sets the shape keys");
    return {s};
  }

  std::string unit_count_key(const std::string&) const override { return "num_hidden_layers"; }
  void validate(const std::string&, const loom::ConfigSection& t,
                const JobTables& job) const override {
    LOOM_CHECK_AS(ConfigError,
                  t.get_float("attention_dropout") >= 0 && t.get_float("attention_dropout") < 1,
                  t.where("attention_dropout"), ": [model] attention_dropout must be in [0, 1)");
    LOOM_CHECK_AS(ConfigError, t.get_int("cross_entropy_chunk") >= 0,
                  t.where("cross_entropy_chunk"),
                  ": [model] cross_entropy_chunk must be >= 0 (0: automatic), got ",
                  t.get_int("cross_entropy_chunk"));
    if (!t.get_string("from_pretrained").empty()) return;  // the shape is checked at import
    LlamaConfig c = job_config(t, std::nullopt);
    check_shape(c, t.where("(shape)"));  // "job.toml [model]"
    // The data's sample length: seq_len (text, tokens, random_tokens) or max_seq_length
    // (jsonl, csv).
    if (const loom::ConfigSection* data = job("data");
        data && (c.rope.type == "default" || c.rope.type == "linear"))
      for (const char* key : {"seq_len", "max_seq_length"})
        if (data->schema().find(key) && data->get(key))
          LOOM_CHECK_AS(ConfigError, data->get_int(key) <= c.max_position_embeddings,
                        data->where(key), ": [data] ", key, " ", data->get_int(key),
                        " exceeds [model] max_position_embeddings ", c.max_position_embeddings,
                        "; shorten ", key, " or raise max_position_embeddings");
    loom::memory::check_model_fits(static_cast<double>(parameter_count(c)),
                                   t.where("num_hidden_layers"),
                                   loom::detail::cat("num_hidden_layers = ", c.num_hidden_layers,
                                                     ", hidden_size = ", c.hidden_size));
  }

  std::shared_ptr<loom::Model> create_model(const std::string&, const loom::ConfigSection& t,
                                            loom::Engine& engine) override {
    std::optional<loom::pretrained::Folder> folder;
    if (!t.get_string("from_pretrained").empty())
      folder.emplace(engine.resolve_path(t.get_string("from_pretrained")));
    const LlamaConfig c = job_config(t, folder);
    auto model = std::make_shared<Llama>(c);
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
      config = nlohmann::ordered_json::parse(folder->config_text());  // token ids, etc. kept
      config.erase("rope_scaling");
      config.erase("rope_theta");
    }
    const LlamaConfig c = job_config(t, folder);
    config["architectures"] = {"LlamaForCausalLM"};
    config["model_type"] = "llama";
    config["vocab_size"] = c.vocab_size;
    config["hidden_size"] = c.hidden_size;
    config["intermediate_size"] = c.intermediate_size;
    config["num_hidden_layers"] = c.num_hidden_layers;
    config["num_attention_heads"] = c.num_attention_heads;
    config["num_key_value_heads"] = c.kv_heads();
    config["head_dim"] = c.dim_per_head();
    config["max_position_embeddings"] = c.max_position_embeddings;
    config["hidden_act"] = "silu";
    config["rms_norm_eps"] = c.rms_norm_eps;
    config["initializer_range"] = c.initializer_range;
    config["attention_dropout"] = c.attention_dropout;
    config["attention_bias"] = c.attention_bias;
    config["mlp_bias"] = c.mlp_bias;
    config["tie_word_embeddings"] = c.tie_word_embeddings;
    nlohmann::ordered_json rope = {{"rope_type", c.rope.type}, {"rope_theta", c.rope.theta}};
    if (c.rope.type != "default") rope["factor"] = c.rope.factor;
    if (c.rope.type == "llama3") {
      rope["low_freq_factor"] = c.rope.low_freq_factor;
      rope["high_freq_factor"] = c.rope.high_freq_factor;
      rope["original_max_position_embeddings"] = c.rope.original_max_positions > 0
                                                     ? c.rope.original_max_positions
                                                     : c.max_position_embeddings;
    }
    config["rope_parameters"] = rope;
    config["dtype"] = "float32";
    loom::pretrained::Export out;
    out.config_json = config.dump(2) + "\n";
    // loom's names are transformers'; only what a Llama has goes out.
    Llama reference(tiny_copy(c));
    std::set<std::string> expected;
    for (const auto& p : reference.named_parameters()) expected.insert(p.key());
    for (const auto& [name, tensor] : weights) {
      // A LoRA run's export is its base model: the adapter the lora plugin wrote (PEFT's
      // format) goes on top of it, as PeftModel.from_pretrained(base, adapter) does.
      if (name.find(".adapter.") != std::string::npos) continue;
      LOOM_CHECK_AS(CheckpointError, expected.count(name), "the checkpoint has the weight '",
                    name, "', which transformers' LlamaForCausalLM does not");
      out.tensors.emplace_back(name, tensor);
      expected.erase(name);
    }
    LOOM_CHECK_AS(CheckpointError, expected.empty(), "the checkpoint lacks the llama weight '",
                  expected.empty() ? "" : *expected.begin(), "'");
    return out;
  }

 private:
  // The same architecture at width 2 (names only: a real-size model would cost its memory).
  static LlamaConfig tiny_copy(LlamaConfig c) {
    c.vocab_size = c.hidden_size = c.intermediate_size = 2;
    c.num_attention_heads = c.head_dim = 2;
    c.num_key_value_heads = 1;
    return c;
  }

  static void import_weights(Llama& model, const loom::pretrained::Folder& folder,
                             const LlamaConfig& c) {
    // LlamaModel folders save the same names without "model.".
    const bool prefixed = folder.has("model.embed_tokens.weight");
    const std::string source = "pretrained model '" + folder.dir().string() + "'";
    loom::NamedTensors tensors;
    std::set<std::string> used;
    for (const auto& p : model.named_parameters()) {
      std::string name = p.key();
      if (!prefixed && name.rfind("model.", 0) == 0) name = name.substr(6);
      tensors.emplace_back(p.key(), folder.map(name));
      used.insert(name);
    }
    for (const auto& name : folder.names()) {
      // A tied head saved anyway, and the rotary buffers older transformers saved.
      const bool known_extra = (name == "lm_head.weight" && c.tie_word_embeddings) ||
                               name.find("rotary_emb.inv_freq") != std::string::npos;
      LOOM_CHECK_AS(CheckpointError, used.count(name) || known_extra, source,
                    " has the tensor '", name, "', which loom's llama does not have");
    }
    loom::pretrained::assign(model, tensors, source);
  }
};

}  // namespace

LOOM_DEFINE_PLUGIN(LlamaPlugin, "llama", "0.1.0")
