// The baseline for loom's overhead benchmark: a hand-written LibTorch training loop — no
// engine, no events, no metrics — of the same GPT-2-style model (pre-norm blocks, fused qkv,
// tanh-GELU MLP, tied head) with torch::optim::AdamW. Not a test and not a loom component.
// usage: raw_loop STEPS BATCH SEQ N_LAYER N_EMBD N_HEAD VOCAB THREADS  -> one step time per line
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "loom/cpu.h"

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t c, int64_t heads) : n_head(heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c})));
    qkv = register_module("qkv", torch::nn::Linear(c, 3 * c));
    proj = register_module("proj", torch::nn::Linear(c, c));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c})));
    fc1 = register_module("fc1", torch::nn::Linear(c, 4 * c));
    fc2 = register_module("fc2", torch::nn::Linear(4 * c, c));
  }
  torch::Tensor forward(torch::Tensor x) {  // x (B,T,C)
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
    auto parts = qkv(ln1(x)).view({B, T, 3, n_head, C / n_head}).permute({2, 0, 3, 1, 4});
    auto y = at::scaled_dot_product_attention(parts[0], parts[1], parts[2], {}, 0.0, true);
    x = x + proj(y.transpose(1, 2).reshape({B, T, C}));
    return x + fc2(torch::gelu(fc1(ln2(x)), "tanh"));
  }
  int64_t n_head;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  GptImpl(int64_t layers, int64_t c, int64_t heads, int64_t vocab, int64_t positions) {
    wte = register_module("wte", torch::nn::Embedding(vocab, c));
    wpe = register_module("wpe", torch::nn::Embedding(positions, c));
    for (int64_t i = 0; i < layers; ++i)
      blocks.push_back(register_module("h" + std::to_string(i), Block(c, heads)));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c})));
  }
  torch::Tensor forward(torch::Tensor ids) {  // ids (B,T) -> logits (B,T,V)
    auto x = wte(ids) + wpe(torch::arange(ids.size(1), ids.options()));
    for (auto& block : blocks) x = block(x);
    return torch::linear(ln_f(x), wte->weight);
  }
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(Gpt);

int main(int argc, char** argv) {
  loom::cpu::ensure_cpu_kernels_work();  // before any kernel or thread: loom/cpu.h
  if (argc != 9) {
    std::fprintf(stderr, "usage: raw_loop STEPS BATCH SEQ N_LAYER N_EMBD N_HEAD VOCAB THREADS\n");
    return 2;
  }
  const int64_t steps = std::atoll(argv[1]), batch = std::atoll(argv[2]), seq = std::atoll(argv[3]),
                layers = std::atoll(argv[4]), embd = std::atoll(argv[5]), heads = std::atoll(argv[6]),
                vocab = std::atoll(argv[7]);
  at::set_num_threads(std::atoi(argv[8]));
  torch::manual_seed(0);
  Gpt model(layers, embd, heads, vocab, seq);
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  std::fprintf(stderr, "raw_loop: %lld params, %d threads\n", static_cast<long long>(params),
               at::get_num_threads());
  torch::optim::AdamW optimizer(model->parameters(),
                                torch::optim::AdamWOptions(1e-3).weight_decay(0.0));
  for (int64_t step = 0; step < steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    auto tokens = torch::randint(0, vocab, {batch, seq + 1}, torch::kLong);
    auto ids = tokens.slice(1, 0, seq), labels = tokens.slice(1, 1, seq + 1);
    optimizer.zero_grad();
    auto logits = model(ids);
    auto loss = torch::nn::functional::cross_entropy(logits.view({-1, vocab}), labels.reshape({-1}));
    loss.backward();
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    optimizer.step();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("%.6f %.4f\n", seconds, loss.item<double>());
    std::fflush(stdout);
  }
  return 0;
}
