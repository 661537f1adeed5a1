// The `moe` plugin: Mixture-of-Experts layers in place of every k-th FeedForward of the model's
// TransformerBlocks (Switch Transformer, GShard), with expert parallelism.
//
// Note [MoE layer] — one layer, for the N tokens x (N, C) of this rank's micro-batch:
// - Router: logits = x·Wᵣᵀ (N, E) in fp32 whatever the autocast or weight dtype (Switch's
//   "selective precision"); in training the input may be jittered (x·U(1-ε, 1+ε), Switch) and
//   the logits used for the choice noised (+N(0, σ²), Shazeer's noisy top-k).
// - Top-k: probs = softmax(logits); each token picks its k most probable experts; its gates
//   are those probabilities, renormalised to sum to 1 when k > 1 (GShard, Mixtral).
// - Capacity: an expert takes at most ceil(capacity_factor · N · k / E) (at least min_capacity)
//   assignments; all first choices are placed before any second choice, and within a choice
//   tokens go in order (GShard's position priority). An assignment over capacity is dropped:
//   that token gets nothing from that expert (the residual connection carries it on).
//   dropless = true: no capacity, nothing dropped.
// - Experts: E copies of the block's FeedForward (its activation, biases and dropout), stored
//   stacked: w_in (E, H, C), b_in (E, H), w_out (E, C, H), b_out (E, C). Each expert runs once
//   on the rows routed to it (no padding to capacity); outputs are summed weighted by the gates.
// - Auxiliary losses (Note [Auxiliary losses] in loom/batch.h): load balancing
//   α·E·Σᵢ fᵢ·Pᵢ with fᵢ the fraction of the N·k assignments (before dropping) that chose
//   expert i and Pᵢ the mean router probability of i (Switch's loss for k = 1; for k > 1 f counts
//   every choice, which makes a balanced router's loss α for every k), and the router z-loss
//   β·mean(logsumexp(logits)²) (ST-MoE). Both are computed per rank over its own tokens (a
//   GShard "group").
// Expert parallelism: expert_parallel_size = P puts E/P experts on each rank of a group of P
// consecutive ranks; a layer sends every assignment's row to its expert's rank and the results
// back with two uneven all-to-alls (Comm::all_to_all_rows) whose backward is the reverse
// exchange. Expert weights are placed parameters (Note [Placed parameters] in loom/engine.h):
// rows of the global (E, ...) tensors, their gradients reduced over the world/P ranks holding the
// same experts.
#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <limits>

#include "loom/comm.h"
#include "loom/engine.h"
#include "loom/log.h"
#include "loom/model.h"
#include "loom/nn.h"
#include "loom/plugin.h"

namespace {

using loom::ConfigError;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct MoeOptions {
  int64_t num_experts = 8, top_k = 2, every = 2, expert_parallel_size = 1, min_capacity = 4;
  double capacity_factor = 1.25, eval_capacity_factor = 2.0;
  bool dropless = false, normalize_gates = true;
  double aux_loss_coef = 0.01, z_loss_coef = 0.0, router_jitter = 0.0, router_noise = 0.0;
  std::string init = "random";
};

// What one forward of a layer saw, for the step's metrics.
struct LayerStats {
  double load_max_over_mean = 0.0;  // busiest expert's assignments / the mean (1 = balanced)
  double dropped_fraction = 0.0;    // assignments dropped for capacity
  double balance_loss = 0.0, z_loss = 0.0;  // unweighted
  bool valid = false;
};

std::vector<int64_t> to_vector(const at::Tensor& counts) {
  const at::Tensor host = counts.to(at::kCPU, at::kLong).contiguous();
  return {host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel()};
}

// Uneven all-to-all of rows whose backward sends the gradients back the way the rows came.
struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, int64_t comm,
                            std::vector<int64_t> send_rows, std::vector<int64_t> recv_rows) {
    ctx->saved_data["comm"] = comm;
    ctx->saved_data["send"] = c10::List<int64_t>(send_rows);
    ctx->saved_data["recv"] = c10::List<int64_t>(recv_rows);
    return exchange(input, reinterpret_cast<loom::Comm*>(comm), send_rows, recv_rows);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* comm = reinterpret_cast<loom::Comm*>(ctx->saved_data["comm"].toInt());
    const auto send = ctx->saved_data["send"].toIntVector();
    const auto recv = ctx->saved_data["recv"].toIntVector();
    return {exchange(grads[0], comm, recv, send), at::Tensor(), at::Tensor(), at::Tensor()};
  }
  static at::Tensor exchange(const at::Tensor& input, loom::Comm* comm,
                             const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
    int64_t rows = 0;
    for (int64_t r : recv) rows += r;
    std::vector<int64_t> shape = input.sizes().vec();
    shape[0] = rows;
    at::Tensor output = at::empty(shape, input.options());
    at::Tensor contiguous = input.contiguous();
    comm->all_to_all_rows(output, contiguous, send, recv)->wait();
    return output;
  }
};

class MoeLayer final : public loom::nn::FeedForwardBase {
 public:
  // `dense`: the FeedForward this layer replaces (its sizes, activation, dropout; with
  // init = "upcycle" its weights too). `ep`: the expert-parallel group (nullptr: one rank).
  MoeLayer(loom::nn::FeedForward& dense, const MoeOptions& options, loom::Comm* ep)
      : options_(options), ep_(ep), activation_(dense.activation), dropout_(dense.dropout) {
    const int64_t experts = options.num_experts;
    const int64_t ranks = ep ? ep->world_size() : 1;
    local_ = experts / ranks;
    const int64_t first = (ep ? ep->rank() : 0) * local_;  // this rank's first expert
    const at::Tensor w1 = dense.fc_in->weight.detach(), w2 = dense.fc_out->weight.detach();
    const int64_t hidden = w1.size(0), dim = w1.size(1);
    const bool bias = dense.fc_in->bias.defined();
    at::NoGradGuard no_grad;
    const auto options32 = w1.options().dtype(at::kFloat);
    // Every rank draws the whole (E, ...) tensors from the same generator state and keeps its
    // rows, so the experts do not depend on the number of ranks.
    at::Tensor router = at::empty({experts, dim}, options32).normal_(0.0, w1.std().item<double>());
    at::Tensor in, out, in_bias, out_bias;
    if (options.init == "upcycle") {
      in = w1.to(at::kFloat).unsqueeze(0).expand({experts, hidden, dim}).clone();
      out = w2.to(at::kFloat).unsqueeze(0).expand({experts, dim, hidden}).clone();
      if (bias) {
        in_bias = dense.fc_in->bias.detach().to(at::kFloat).unsqueeze(0).expand({experts, hidden}).clone();
        out_bias = dense.fc_out->bias.detach().to(at::kFloat).unsqueeze(0).expand({experts, dim}).clone();
      }
    } else {
      in = at::empty({experts, hidden, dim}, options32).normal_(0.0, w1.std().item<double>());
      out = at::empty({experts, dim, hidden}, options32).normal_(0.0, w2.std().item<double>());
      if (bias) {
        in_bias = at::zeros({experts, hidden}, options32);
        out_bias = at::zeros({experts, dim}, options32);
      }
    }
    const auto dtype = w1.scalar_type();
    router_ = register_parameter("router", router.to(dtype));
    w_in = register_parameter("w_in", in.narrow(0, first, local_).to(dtype).contiguous());
    w_out = register_parameter("w_out", out.narrow(0, first, local_).to(dtype).contiguous());
    if (bias) {
      b_in = register_parameter("b_in", in_bias.narrow(0, first, local_).to(dtype).contiguous());
      b_out = register_parameter("b_out", out_bias.narrow(0, first, local_).to(dtype).contiguous());
    }
  }

  at::Tensor forward(const at::Tensor& x) override {
    const int64_t dim = x.size(-1), experts = options_.num_experts, k = options_.top_k;
    const at::Tensor tokens = x.reshape({-1, dim});
    const int64_t n = tokens.size(0);
    const bool training = is_training();

    // Router in fp32, outside autocast (Note [MoE layer]).
    at::Tensor logits;
    {
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      at::Tensor input = tokens.to(at::kFloat);
      if (training && options_.router_jitter > 0)
        input = input * at::empty_like(input).uniform_(1.0 - options_.router_jitter,
                                                       1.0 + options_.router_jitter);
      logits = at::matmul(input, router_.to(at::kFloat).t());  // (N, E)
    }
    const at::Tensor probs = at::softmax(logits, -1);
    at::Tensor choice_logits = logits.detach();
    if (training && options_.router_noise > 0)
      choice_logits = choice_logits + at::randn_like(choice_logits) * options_.router_noise;
    const at::Tensor chosen = std::get<1>(at::topk(choice_logits, k, -1));  // (N, k)
    at::Tensor gates = probs.gather(1, chosen);                             // (N, k)
    if (k > 1 && options_.normalize_gates) gates = gates / gates.sum(-1, true);

    // Assignments in priority order: every token's first choice, then every second choice.
    const at::Tensor expert_of = chosen.t().reshape({-1});                   // (k·N)
    const at::Tensor token_of = at::arange(n, expert_of.options()).repeat({k});
    const at::Tensor gate_of = gates.t().reshape({-1});
    const at::Tensor one_hot = at::one_hot(expert_of, experts);              // (k·N, E)
    const at::Tensor demand = one_hot.sum(0);                                // (E)
    at::Tensor keep;
    if (!options_.dropless) {
      const double factor = training ? options_.capacity_factor : options_.eval_capacity_factor;
      const int64_t capacity = std::max<int64_t>(
          options_.min_capacity,
          static_cast<int64_t>(std::ceil(factor * static_cast<double>(n * k) / experts)));
      const at::Tensor position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1;  // within expert
      keep = position < capacity;
    }

    // Losses on the router (Note [MoE layer]); attached to the output so they train the router
    // wherever this layer runs, a recomputed checkpointed unit included.
    at::Tensor aux;
    const at::Tensor fraction = demand.to(at::kFloat) / static_cast<double>(n * k);
    const at::Tensor balance = experts * (fraction * probs.mean(0)).sum();
    const at::Tensor z = at::logsumexp(logits, -1).pow(2).mean();
    if (training) {
      if (options_.aux_loss_coef > 0) aux = balance * options_.aux_loss_coef;
      if (options_.z_loss_coef > 0) {
        const at::Tensor weighted = z * options_.z_loss_coef;
        aux = aux.defined() ? aux + weighted : weighted;
      }
    }

    at::Tensor expert_ids = expert_of, token_ids = token_of, gate_values = gate_of;
    if (keep.defined()) {
      const at::Tensor kept = keep.nonzero().reshape({-1});
      expert_ids = expert_ids.index_select(0, kept);
      token_ids = token_ids.index_select(0, kept);
      gate_values = gate_values.index_select(0, kept);
    }
    {
      // One host read for the layer's numbers (the counts below need one anyway).
      at::NoGradGuard no_grad;
      const at::Tensor numbers =
          at::stack({demand.max().to(at::kDouble), balance.to(at::kDouble), z.to(at::kDouble)})
              .cpu();
      const double mean = static_cast<double>(n * k) / static_cast<double>(experts);
      stats_.load_max_over_mean = numbers[0].item<double>() / mean;
      stats_.dropped_fraction =
          1.0 - static_cast<double>(expert_ids.numel()) / static_cast<double>(n * k);
      stats_.balance_loss = numbers[1].item<double>();
      stats_.z_loss = numbers[2].item<double>();
      stats_.valid = true;
    }

    // Rows in expert order; counts per expert.
    const at::Tensor order = std::get<1>(at::sort(expert_ids, /*stable=*/true, 0, false));
    const at::Tensor sorted_tokens = token_ids.index_select(0, order);
    const at::Tensor sorted_gates = gate_values.index_select(0, order);
    const std::vector<int64_t> per_expert = to_vector(at::bincount(expert_ids, {}, experts));
    const at::Tensor rows = tokens.index_select(0, sorted_tokens);

    at::Tensor results;
    if (!ep_ || ep_->world_size() == 1) {
      results = run_local_experts(rows, per_expert);
    } else {
      const int ranks = ep_->world_size();
      // Rank j holds experts [j·L, (j+1)·L): their rows are the j-th run of the sorted rows.
      std::vector<int64_t> send(ranks, 0);
      for (int64_t e = 0; e < experts; ++e) send[e / local_] += per_expert[e];
      at::Tensor counts_out = at::tensor(per_expert, at::kLong).to(ep_->device());
      at::Tensor counts_in = at::empty_like(counts_out);
      ep_->all_to_all(counts_in, counts_out)->wait();
      const std::vector<int64_t> from = to_vector(counts_in);  // (source rank, local expert)
      std::vector<int64_t> recv(ranks, 0);
      for (int src = 0; src < ranks; ++src)
        for (int64_t e = 0; e < local_; ++e) recv[src] += from[src * local_ + e];
      const int64_t comm = reinterpret_cast<int64_t>(ep_);
      const at::Tensor received = AllToAllRows::apply(rows, comm, send, recv);
      // Received rows come by source, then local expert: regroup them by expert to run each
      // expert once, then put the results back in the order they came.
      std::vector<int64_t> regroup, local_counts(local_, 0);
      {
        std::vector<std::vector<int64_t>> by_expert(local_);
        int64_t at_row = 0;
        for (int src = 0; src < ranks; ++src)
          for (int64_t e = 0; e < local_; ++e)
            for (int64_t r = 0; r < from[src * local_ + e]; ++r) by_expert[e].push_back(at_row++);
        for (int64_t e = 0; e < local_; ++e) {
          local_counts[e] = static_cast<int64_t>(by_expert[e].size());
          regroup.insert(regroup.end(), by_expert[e].begin(), by_expert[e].end());
        }
      }
      const at::Tensor regroup_index = at::tensor(regroup, at::kLong).to(x.device());
      at::Tensor grouped = run_local_experts(received.index_select(0, regroup_index), local_counts);
      const at::Tensor back = at::empty_like(regroup_index).scatter_(
          0, regroup_index, at::arange(regroup_index.numel(), regroup_index.options()));
      results = AllToAllRows::apply(grouped.index_select(0, back), comm, recv, send);
    }
    results = results * sorted_gates.unsqueeze(1).to(results.scalar_type());
    at::Tensor out = at::zeros({n, dim}, results.options())
                         .index_add(0, sorted_tokens, results);
    out = at::dropout(out, dropout_, training).to(x.scalar_type()).view(x.sizes());
    if (aux.defined()) out = loom::nn::attach_aux_loss(out, aux);
    return out;
  }

  const LayerStats& stats() const { return stats_; }

  at::Tensor w_in, w_out, b_in, b_out;

 private:
  // rows grouped by local expert, counts[e] rows for local expert e. Every expert runs, on no
  // rows if it got none, so each has a (zero) gradient every step on every rank: whether an
  // expert is updated never depends on how its tokens were cut into micro-batches or ranks.
  at::Tensor run_local_experts(const at::Tensor& rows, const std::vector<int64_t>& counts) {
    std::vector<at::Tensor> outputs;
    int64_t at_row = 0;
    for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
      const at::Tensor mine = rows.narrow(0, at_row, counts[e]);
      at_row += counts[e];
      // loom::nn::linear: Note [Half matmuls through fp32] (loom/nn.h).
      at::Tensor h = loom::nn::linear(mine, w_in[e], b_in.defined() ? b_in[e] : at::Tensor());
      switch (activation_) {
        case loom::nn::FeedForward::Activation::gelu: h = at::gelu(h); break;
        case loom::nn::FeedForward::Activation::gelu_tanh: h = at::gelu(h, "tanh"); break;
        case loom::nn::FeedForward::Activation::relu: h = at::relu(h); break;
      }
      outputs.push_back(loom::nn::linear(h, w_out[e], b_out.defined() ? b_out[e] : at::Tensor()));
    }
    return at::cat(outputs, 0);
  }

  MoeOptions options_;
  loom::Comm* ep_;
  loom::nn::FeedForward::Activation activation_;
  double dropout_;
  int64_t local_ = 0;  // experts on this rank
  at::Tensor router_;
  LayerStats stats_;
};

class Moe final : public loom::Plugin {
 public:
  std::string name() const override { return "moe"; }
  std::string description() const override {
    return "Mixture-of-Experts layers (Switch top-1, GShard top-2) with expert parallelism";
  }
  // First of all: it changes the model's structure at model_built, and every other plugin
  // (precision's casts, LoRA's adapters, ZeRO's partitioning) must see the experts.
  Order order() const override { return {.before = {"*"}}; }
  bool shapes_model() const override { return true; }
  std::vector<loom::Schema> schemas() const override {
    loom::Schema s("moe");
    s.key_int("num_experts", 8, "experts per MoE layer")
        .key_int("top_k", 2, "experts per token: 1 (Switch) or 2 (GShard); at most num_experts")
        .key_int("moe_every", 2, "every moe_every-th block's FeedForward becomes an MoE layer "
                                 "(blocks moe_every-1, 2·moe_every-1, ...; 1: every block)")
        .key_float("capacity_factor", 1.25,
                   "training: an expert takes at most capacity_factor·tokens·top_k/num_experts "
                   "assignments; the rest are dropped")
        .key_float("eval_capacity_factor", 2.0, "the capacity factor outside training")
        .key_int("min_capacity", 4, "the smallest capacity of an expert (DeepSpeed's name)")
        .key_bool("dropless", false, "no capacity: every assignment is computed")
        .key_bool("normalize_gates", true, "top_k > 1: the chosen gates are scaled to sum to 1")
        .key_float("aux_loss_coef", 0.01,
                   "α of the load-balancing loss α·E·Σ f_i·P_i (0: none)")
        .key_float("z_loss_coef", 0.0, "β of the router z-loss β·mean(logsumexp(logits)²) "
                                        "(ST-MoE uses 0.001; 0: none)")
        .key_float("router_jitter", 0.0, "training: the router's input times U(1-ε, 1+ε)")
        .key_float("router_noise", 0.0,
                   "training: N(0, σ²) added to the logits the experts are chosen by")
        .key_int("expert_parallel_size", 1,
                 "ranks the experts of a layer are spread over (divides num_experts and the "
                 "world size); the rest of the world is data parallel")
        .key_string("init", "random", "experts start random (the dense FeedForward's weight "
                                      "scale) or \"upcycle\": each a copy of the dense one");
    return {s};
  }

  void configure(const loom::ConfigSection& t) override {
    o_.num_experts = t.get_int("num_experts");
    o_.top_k = t.get_int("top_k");
    o_.every = t.get_int("moe_every");
    o_.capacity_factor = t.get_float("capacity_factor");
    o_.eval_capacity_factor = t.get_float("eval_capacity_factor");
    o_.min_capacity = t.get_int("min_capacity");
    o_.dropless = t.get_bool("dropless");
    o_.normalize_gates = t.get_bool("normalize_gates");
    o_.aux_loss_coef = t.get_float("aux_loss_coef");
    o_.z_loss_coef = t.get_float("z_loss_coef");
    o_.router_jitter = t.get_float("router_jitter");
    o_.router_noise = t.get_float("router_noise");
    o_.expert_parallel_size = t.get_int("expert_parallel_size");
    o_.init = t.get_string("init");
    LOOM_CHECK_AS(ConfigError, o_.num_experts >= 1, t.where("num_experts"),
                  ": [moe] num_experts must be at least 1, got ", o_.num_experts);
    LOOM_CHECK_AS(ConfigError, o_.top_k >= 1 && o_.top_k <= o_.num_experts, t.where("top_k"),
                  ": [moe] top_k must be between 1 and num_experts (", o_.num_experts,
                  "), got ", o_.top_k);
    LOOM_CHECK_AS(ConfigError, o_.every >= 1, t.where("moe_every"),
                  ": [moe] moe_every must be at least 1, got ", o_.every);
    LOOM_CHECK_AS(ConfigError, o_.capacity_factor > 0, t.where("capacity_factor"),
                  ": [moe] capacity_factor must be positive, got ", o_.capacity_factor,
                  "; use dropless = true for no capacity limit");
    LOOM_CHECK_AS(ConfigError, o_.eval_capacity_factor > 0, t.where("eval_capacity_factor"),
                  ": [moe] eval_capacity_factor must be positive, got ", o_.eval_capacity_factor);
    LOOM_CHECK_AS(ConfigError, o_.min_capacity >= 0, t.where("min_capacity"),
                  ": [moe] min_capacity must be >= 0, got ", o_.min_capacity);
    for (const char* key : {"aux_loss_coef", "z_loss_coef", "router_jitter", "router_noise"})
      LOOM_CHECK_AS(ConfigError, t.get_float(key) >= 0, t.where(key), ": [moe] ", key,
                    " must be >= 0, got ", t.get_float(key));
    LOOM_CHECK_AS(ConfigError, o_.router_jitter < 1, t.where("router_jitter"),
                  ": [moe] router_jitter must be below 1, got ", o_.router_jitter);
    LOOM_CHECK_AS(ConfigError, o_.expert_parallel_size >= 1 &&
                                   o_.num_experts % o_.expert_parallel_size == 0,
                  t.where("expert_parallel_size"), ": [moe] expert_parallel_size (",
                  o_.expert_parallel_size, ") must divide num_experts (", o_.num_experts, ")");
    LOOM_CHECK_AS(ConfigError, o_.init == "random" || o_.init == "upcycle", t.where("init"),
                  ": [moe] init '", o_.init, "' is unknown; use \"random\" or \"upcycle\"");
    where_every_ = t.where("moe_every");
    where_ep_ = t.where("expert_parallel_size");
  }

  void attach(loom::Engine& engine) override {
    engine.on(loom::Event::model_built, [this](loom::Engine& e) { replace(e); });
    engine.on(loom::Event::after_forward, [this](loom::Engine& e) { collect(e); });
    engine.on(loom::Event::after_backward, [this](loom::Engine& e) { report(e); });
  }

 private:
  void replace(loom::Engine& engine) {
    loom::Comm& comm = engine.comm();
    const int64_t ep = o_.expert_parallel_size;
    LOOM_CHECK_AS(ConfigError, comm.world_size() % ep == 0, where_ep_,
                  ": [moe] expert_parallel_size (", ep, ") must divide the world size (",
                  comm.world_size(), " ranks)");
    if (ep > 1) {
      // Groups of ep consecutive ranks share out the experts; ranks at the same place in
      // every group hold the same experts (their replicas).
      ep_comm_ = comm.split(comm.rank() / static_cast<int>(ep), comm.rank());
      replicas_ = std::shared_ptr<loom::Comm>(comm.split(comm.rank() % static_cast<int>(ep),
                                                         comm.rank()));
    }
    int64_t dense_blocks = 0;
    for (auto* list : engine.unit_lists()) {
      for (size_t i = 0; i < list->size(); ++i) {
        auto* block = dynamic_cast<loom::nn::TransformerBlock*>(&(*list)[i]);
        if (!block) continue;
        auto* dense = dynamic_cast<loom::nn::FeedForward*>(block->ffn.get());
        if (!dense) continue;
        ++dense_blocks;
        if (static_cast<int64_t>(i) % o_.every != o_.every - 1) continue;
        auto layer = std::make_shared<MoeLayer>(*dense, o_, ep_comm_.get());
        block->set_feed_forward(layer);
        for (at::Tensor* t : {&layer->w_in, &layer->w_out, &layer->b_in, &layer->b_out}) {
          if (!t->defined()) continue;
          loom::ParamPlacement placement;
          // Stacked biases are 2-D: no weight decay, as the dense FeedForward's 1-D ones.
          placement.group = t == &layer->b_in || t == &layer->b_out ? 1 : -1;
          if (ep > 1) {
            placement.global_shape = t->sizes().vec();
            placement.global_shape[0] = o_.num_experts;
            placement.row_offset = ep_comm_->rank() * (o_.num_experts / ep);
            placement.replicas = replicas_;
          }
          engine.place_param(*t, placement);
        }
        layers_.push_back(layer);
      }
    }
    LOOM_CHECK_AS(ConfigError, !layers_.empty(), where_every_, ": [moe] found ",
                  dense_blocks == 0
                      ? std::string("no loom::nn::TransformerBlock with a FeedForward in model '") +
                            engine.section("train").get_string("model") +
                            "'; MoE replaces FeedForward blocks (the gpt and bert models have them)"
                      : std::to_string(dense_blocks) + " FeedForward block(s), fewer than moe_every = " +
                            std::to_string(o_.every) + "; lower moe_every");
    loom::log::info("moe: ", layers_.size(), " of ", dense_blocks, " FeedForward blocks -> ",
                    o_.num_experts, " experts, top-", o_.top_k, ", ",
                    o_.dropless ? std::string("dropless")
                                : loom::detail::cat("capacity factor ", o_.capacity_factor),
                    ep > 1 ? ", " + std::to_string(ep) + "-way expert parallel" : std::string());
  }

  void collect(loom::Engine& engine) {
    if (engine.state().evaluating) return;  // the training window's statistics only
    if (engine.state().micro_step == 0) window_ = {};
    for (const auto& layer : layers_) {
      const LayerStats& s = layer->stats();
      if (!s.valid) continue;
      window_.load += s.load_max_over_mean;
      window_.dropped += s.dropped_fraction;
      window_.balance += s.balance_loss;
      window_.z += s.z_loss;
      window_.count += 1;
    }
  }

  void report(loom::Engine& engine) {
    auto& state = engine.state();
    if (!state.is_last_micro_step() || window_.count == 0) return;
    const double n = static_cast<double>(window_.count);
    state.metrics.emplace_back("moe_load_max_over_mean", window_.load / n);
    state.metrics.emplace_back("moe_dropped_fraction", window_.dropped / n);
    state.metrics.emplace_back("moe_balance_loss", window_.balance / n);
    state.metrics.emplace_back("moe_z_loss", window_.z / n);
  }

  MoeOptions o_;
  std::string where_every_, where_ep_;
  std::unique_ptr<loom::Comm> ep_comm_;
  std::shared_ptr<loom::Comm> replicas_;
  std::vector<std::shared_ptr<MoeLayer>> layers_;
  struct Window {
    double load = 0, dropped = 0, balance = 0, z = 0;
    int64_t count = 0;
  } window_;
};

}  // namespace

LOOM_DEFINE_PLUGIN(Moe, "moe", "0.1.0")
