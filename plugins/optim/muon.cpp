// muon: momentum orthogonalised by Newton-Schulz iterations for the hidden layers' matrices
// (Jordan et al. 2024), with Moonlight's RMS matching and decoupled weight decay (Liu et al.
// 2025, "Muon is Scalable for LLM Training", and its reference, examples/toy_train.py), and the
// core's AdamW for everything else: vectors, embeddings and output heads. Not a distributed
// Muon of its own: the rule orthogonalises the whole tensors it is given (Granularity::tensor),
// and the ZeRO driver hands each matrix whole to one rank (Note [Muon under ZeRO]).
#include <ATen/ATen.h>

#include <cmath>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "muon.h"

namespace loom::optim {
namespace {

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// A float array key of exactly `count` numbers, named in the error.
std::vector<double> floats_of(const ConfigSection& c, const char* key, size_t count,
                              const char* example) {
  const ConfigValue* value = c.get(key);
  LOOM_INTERNAL_ASSERT(value, "[optimizer] ", key, " has no default");
  const auto* array = std::get_if<ConfigArray>(&value->value);
  std::vector<double> out;
  if (array)
    for (const ConfigValue& item : *array) {
      if (const auto* f = std::get_if<double>(&item.value)) out.push_back(*f);
      else if (const auto* i = std::get_if<int64_t>(&item.value)) out.push_back(double(*i));
      else {
        out.clear();
        break;
      }
    }
  LOOM_CHECK_AS(ConfigError, array && out.size() == count, c.where(key), ": [optimizer] ", key,
                " must be an array of ", count, " numbers, not ", value->to_text(), "; e.g. ",
                key, " = ", example);
  for (double x : out)
    LOOM_CHECK_AS(ConfigError, std::isfinite(x), c.where(key), ": [optimizer] ", key,
                  " must hold finite numbers, not ", value->to_text());
  return out;
}

// The core's AdamW for the tensors Muon does not take, built from adamw_betas and adamw_eps
// (checked here, so an error names the key the user wrote).
std::unique_ptr<UpdateRule> adamw_from(const ConfigSection& c) {
  const std::vector<double> betas = floats_of(c, "adamw_betas", 2, "[0.9, 0.95]");
  for (double beta : betas)
    LOOM_CHECK_AS(ConfigError, beta >= 0 && beta < 1, c.where("adamw_betas"),
                  ": [optimizer] adamw_betas must be in [0, 1), got ", beta,
                  "; Moonlight uses [0.9, 0.95]");
  const double eps = c.get_float("adamw_eps");
  LOOM_CHECK_AS(ConfigError, eps >= 0, c.where("adamw_eps"),
                ": [optimizer] adamw_eps must be >= 0, got ", eps);
  Schema schema("optimizer", "adamw");
  schema.key_float("beta1", betas[0], "")
      .key_float("beta2", betas[1], "")
      .key_float("eps", eps, "");
  return make_adamw(ConfigSection("optimizer", {}, schema, c.where("adamw_betas")));
}

// Note [Newton-Schulz in fp32]: Moonlight's reference (and Keller Jordan's) runs the iteration
// in bf16 on GPUs, where bf16 matmuls run at several times fp32's rate and the quintic only has
// to bring the singular values near 1, not to 1, so bf16's rounding costs little. Here it runs
// in fp32 on every device: CPUs without AVX-512 BF16 or AMX (this project's) have no faster
// bf16 matmul, the parity tests hold the rule to 1e-5 against a torch reference, and a ZeRO run
// must match the one-process run, which bf16's 3 significant digits would not. The cost is the
// GPU's bf16 speed-up on the iteration, whose share of a step falls as the batch grows
// (docs/BENCHMARKS.md "Muon").
constexpr double kNormEps = 1e-7;  // the reference's X / (||X|| + 1e-7)

class Muon final : public UpdateRule {
 public:
  explicit Muon(const ConfigSection& c)
      : selection_(c),
        momentum_(beta_in_range(c, "momentum")),
        nesterov_(c.get_bool("nesterov")),
        ns_steps_(c.get_int("ns_steps")),
        rms_scale_(c.get_float("rms_scale")),
        adamw_(adamw_from(c)) {
    LOOM_CHECK_AS(ConfigError, ns_steps_ > 0, c.where("ns_steps"),
                  ": [optimizer] ns_steps must be > 0, got ", ns_steps_,
                  "; Moonlight uses 5");
    LOOM_CHECK_AS(ConfigError, std::isfinite(rms_scale_) && rms_scale_ > 0, c.where("rms_scale"),
                  ": [optimizer] rms_scale must be > 0, got ", rms_scale_,
                  "; Moonlight uses 0.2 (AdamW's typical update RMS)");
    const std::vector<double> k =
        floats_of(c, "ns_coefficients", 3, "[3.4445, -4.7750, 2.0315]");
    a_ = k[0];
    b_ = k[1];
    c_ = k[2];
  }
  std::string name() const override { return "muon"; }
  // Note [Muon under ZeRO]: the orthogonalisation needs the whole matrix, so no tensor is ever
  // cut, and ZeRO 1-3 (sharding/src/flat_layout.cpp) give each rank whole tensors of every
  // bucket instead of equal slices: no collective beyond ZeRO's own, each matrix's iteration
  // runs once, on its owner. The price is balance: a rank's chunk of a bucket is at least the
  // bucket's largest tensor, so optimizer state and masters are less even than at
  // element granularity (docs/BENCHMARKS.md measures it). The SDK's partitioning is one per
  // rule, not per tensor, so the AdamW tensors (embeddings included) are not cut either.
  Partitioning partitioning() const override { return {Granularity::tensor, 1}; }

  NamedTensors init_state(const Segment& s) const override {
    if (!selection_.takes_muon(s.name, s.shape)) return adamw_->init_state(s);
    return {{"momentum_buffer", at::zeros_like(s.param)}};
  }

  void update(Segment& s, const UpdateContext& ctx) const override {
    if (!selection_.takes_muon(s.name, s.shape)) return adamw_->update(s, ctx);
    LOOM_INTERNAL_ASSERT(s.offset == 0 && s.param.numel() == numel_of(s.shape),
                         "muon was given a piece of '", s.name, "' (offset ", s.offset, ", ",
                         s.param.numel(), " elements): its partitioning keeps tensors whole");
    // Moonlight's momentum: buf = mu buf + g (no dampening); Nesterov looks ahead: g + mu buf.
    at::Tensor& buf = s.state_at("momentum_buffer");
    buf.mul_(momentum_).add_(s.grad);
    const at::Tensor direction = nesterov_ ? s.grad.add(buf, momentum_) : buf;
    const Matrices m(s.shape);
    const at::Tensor update = orthogonalise(direction.reshape({m.count, m.rows, m.cols}));
    // Note [RMS matching]: an orthogonal A x B matrix has RMS 1/sqrt(max(A, B)); scaled by
    // rms_scale sqrt(max(A, B)) the update's RMS is rms_scale (0.2, AdamW's typical), so the
    // learning rate and weight decay tuned for AdamW carry over. Weight decay is decoupled and
    // uses the unscaled lr, as the reference: p = p (1 - lr wd) - lr 0.2 sqrt(max(A,B)) O.
    const double scaled_lr =
        ctx.lr * rms_scale_ * std::sqrt(static_cast<double>(std::max(m.rows, m.cols)));
    if (ctx.weight_decay != 0) s.param.mul_(1.0 - ctx.lr * ctx.weight_decay);
    s.param.add_(update.view(-1), -scaled_lr);
  }

  // AdamW's tensors go to AdamW together (one fused launch on CUDA); matrices one by one.
  void update_many(const std::vector<Segment*>& segments,
                   const UpdateContext& ctx) const override {
    std::vector<Segment*> adamw;
    for (Segment* s : segments) {
      if (selection_.takes_muon(s->name, s->shape)) update_tensor(*this, {s}, ctx);
      else adamw.push_back(s);
    }
    if (!adamw.empty()) adamw_->update_many(adamw, ctx);
  }

 private:
  // A tensor of rank >= 2 as `count` matrices (rows, cols): its last two dimensions, the
  // leading ones a stack (MoE's experts are one tensor; each expert's matrix is orthogonalised
  // on its own, so the result does not depend on how experts are placed on ranks).
  struct Matrices {
    int64_t count = 1, rows = 1, cols = 1;
    explicit Matrices(const std::vector<int64_t>& shape) {
      rows = shape[shape.size() - 2];
      cols = shape.back();
      count = numel_of(shape) / std::max<int64_t>(1, rows * cols);
    }
  };

  // The quintic Newton-Schulz iteration of the reference on each matrix of g (count, A, B):
  // X = G / (||G||_F + 1e-7), transposed to be wide (A <= B, so X X^T is the small Gram
  // matrix); then ns_steps times S = X X^T; T = b S + c S S; X = a X + T X. Returns (count, A, B).
  at::Tensor orthogonalise(const at::Tensor& g) const {
    const bool tall = g.size(1) > g.size(2);
    at::Tensor x = tall ? g.transpose(1, 2) : g;
    x = x / (at::linalg_vector_norm(x, 2, at::IntArrayRef{1, 2}, /*keepdim=*/true) + kNormEps);
    for (int64_t step = 0; step < ns_steps_; ++step) {
      const at::Tensor gram = at::bmm(x, x.transpose(1, 2));
      const at::Tensor poly = at::baddbmm(gram, gram, gram, /*beta=*/b_, /*alpha=*/c_);
      x = at::baddbmm(x, poly, x, /*beta=*/a_, /*alpha=*/1.0);
    }
    return (tall ? x.transpose(1, 2) : x).contiguous();
  }

  MuonSelection selection_;
  double momentum_;
  bool nesterov_;
  int64_t ns_steps_;
  double rms_scale_;
  double a_ = 0, b_ = 0, c_ = 0;
  std::unique_ptr<UpdateRule> adamw_;
};

}  // namespace

// Note [Which tensors Muon takes]: Muon is for the hidden layers' matrices; Moonlight gives
// AdamW the vectors (biases, norms), the embeddings and the output head, whose gradients are
// sparse or whose rows are independent (an orthogonalised embedding update would move every
// token's row alike). Shape decides the vectors (rank < 2); names decide embeddings and heads,
// which are matrices too: adamw_params, regexes over the whole parameter name (as param_groups'
// match), default the names loom's and transformers' models give them.
const char* const kDefaultAdamWParams =
    R"((.*\.)?(wte|wpe|embed_tokens|embed_positions|word_embeddings|position_embeddings|)"
    R"(token_type_embeddings|lm_head|embed_out|classifier|score)\..*)";

MuonSelection::MuonSelection(const ConfigSection& c) {
  for (const std::string& pattern : c.get_strings("adamw_params")) {
    try {
      patterns_.emplace_back(pattern, std::regex(pattern, std::regex::ECMAScript));
    } catch (const std::regex_error& error) {
      throw ConfigError(detail::cat(c.where("adamw_params"), ": [optimizer] adamw_params \"",
                                    pattern, "\" is not a valid regex (", error.what(), ")"));
    }
  }
  user_set_ = c.has("adamw_params");
  where_ = c.where("adamw_params");
}

const std::string* MuonSelection::matching_pattern(const std::string& name) const {
  for (const auto& [text, re] : patterns_)
    if (std::regex_match(name, re)) return &text;
  return nullptr;
}

bool MuonSelection::takes_muon(const std::string& name, const std::vector<int64_t>& shape) const {
  return shape.size() >= 2 && numel_of(shape) > 0 && !matching_pattern(name);
}

std::string MuonSelection::report(const std::vector<std::pair<std::string, std::vector<int64_t>>>&
                                      params) const {
  std::vector<std::string> by_name, matrices;
  int64_t muon_count = 0, muon_numel = 0, adamw_count = 0, adamw_numel = 0, vectors = 0;
  for (const auto& [name, shape] : params) {
    if (takes_muon(name, shape)) {
      ++muon_count;
      muon_numel += numel_of(shape);
      continue;
    }
    ++adamw_count;
    adamw_numel += numel_of(shape);
    if (shape.size() < 2) ++vectors;
    else by_name.push_back(name);
  }
  std::string names;
  for (const auto& n : by_name) names += (names.empty() ? "" : ", ") + n;
  return detail::cat("muon: ", muon_count, " matrices (", muon_numel,
                     " parameters) by Muon; ", adamw_count, " tensors (", adamw_numel,
                     " parameters) by AdamW: ", vectors, " of rank < 2",
                     by_name.empty() ? std::string() : "; by adamw_params: " + names);
}

void MuonSelection::check_patterns_match(const std::vector<std::string>& names) const {
  if (!user_set_) return;  // the defaults name every model's embeddings; most match nothing
  for (const auto& [text, re] : patterns_) {
    bool hit = false;
    for (const auto& n : names) hit = hit || std::regex_match(n, re);
    LOOM_CHECK_AS(ConfigError, hit, where_, ": [optimizer] adamw_params \"", text,
                  "\" matches no trainable parameter (e.g. '", names.empty() ? "" : names.front(),
                  "'); the regex must match the whole name");
  }
}

std::unique_ptr<UpdateRule> make_muon(const ConfigSection& c) { return std::make_unique<Muon>(c); }

}  // namespace loom::optim
