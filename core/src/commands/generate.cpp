// `loom generate` (Note [Generation] in loom/trainer.h): the decoding loop and the token choice.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <limits>

#include "inference.h"
#include "loom/error.h"
#include "loom/log.h"
#include "loom/nn.h"
#include "loom/tokenizer.h"
#include "loom/trainer.h"

namespace loom {
namespace {

// The next token from one position's logits (V), as transformers' greedy search or its
// sampling with TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper in that order.
int64_t next_token(at::Tensor logits, const GenerateOptions& o, at::Generator& generator) {
  logits = logits.to(at::kFloat).to(at::kCPU);
  if (o.temperature == 0.0) return logits.argmax().item<int64_t>();
  logits = logits / o.temperature;
  const double minus_inf = -std::numeric_limits<double>::infinity();
  if (o.top_k > 0 && o.top_k < logits.size(0)) {
    at::Tensor kth = std::get<0>(logits.topk(o.top_k)).min();
    logits = logits.masked_fill(logits < kth, minus_inf);
  }
  if (o.top_p < 1.0) {
    // Drop the least likely tokens whose probabilities sum to at most 1 - top_p; keep the top one.
    auto [sorted, order] = logits.sort(/*dim=*/0, /*descending=*/false);
    at::Tensor drop = sorted.softmax(0).cumsum(0) <= (1.0 - o.top_p);
    drop.select(0, -1).fill_(false);
    logits = logits.masked_fill(drop.scatter(0, order, drop), minus_inf);
  }
  return at::multinomial(logits.softmax(0), 1, false, generator).item<int64_t>();
}

void check_options(const GenerateOptions& o) {
  LOOM_CHECK_AS(ConfigError, o.max_new_tokens >= 0, "--max-new-tokens must be >= 0, got ",
                o.max_new_tokens);
  LOOM_CHECK_AS(ConfigError, o.temperature >= 0, "--temperature must be >= 0 (0: greedy), got ",
                o.temperature);
  LOOM_CHECK_AS(ConfigError, o.top_k >= 0, "--top-k must be >= 0 (0: off), got ", o.top_k);
  LOOM_CHECK_AS(ConfigError, o.top_p > 0 && o.top_p <= 1, "--top-p must be in (0, 1], got ",
                o.top_p);
}

}  // namespace

Generation generate(const std::filesystem::path& path, const GenerateOptions& o) {
  check_options(o);
  InferenceModel opened = open_for_inference(path, o.device);
  auto* lm = dynamic_cast<CausalLM*>(opened.model);
  LOOM_CHECK_AS(ConfigError, lm, "the model of checkpoint '", opened.checkpoint,
                "' cannot generate text: its plugin does not implement loom::CausalLM (gpt and "
                "llama do)");
  Generation out;
  out.checkpoint = opened.checkpoint;
  out.step = opened.step;
  std::shared_ptr<const Tokenizer> tokenizer;
  if (!opened.tokenizer.empty()) {
    tokenizer = Tokenizer::load(opened.tokenizer);
    out.tokenizer = tokenizer->describe();
  } else if (opened.data_source == "text") {
    out.tokenizer = "bytes";
  }
  if (!o.prompt_ids.empty()) {
    out.ids = o.prompt_ids;
  } else if (tokenizer) {
    out.ids = tokenizer->encode(o.prompt).ids;
  } else {
    LOOM_CHECK_AS(ConfigError, opened.data_source == "text", "checkpoint '", opened.checkpoint,
                  "' trained on [data] source = \"", opened.data_source, "\" without a tokenizer "
                  "(no [data] tokenizer, no tokenizer.json in [model] from_pretrained), so loom "
                  "cannot make its token ids from text; give the prompt's ids with --prompt-ids");
    for (unsigned char byte : o.prompt) out.ids.push_back(byte);
  }
  LOOM_CHECK_AS(ConfigError, !out.ids.empty(), "loom generate needs a prompt (--prompt TEXT or "
                "--prompt-ids 1,2,3)");
  out.prompt_length = static_cast<int64_t>(out.ids.size());
  const int64_t limit = lm->max_positions();
  LOOM_CHECK_AS(ConfigError, out.prompt_length + o.max_new_tokens <= limit, "the prompt's ",
                out.prompt_length, " tokens and --max-new-tokens ", o.max_new_tokens,
                " exceed the ", limit, " positions the model takes; shorten either");

  int64_t eos = -1;
  if (o.eos_id) eos = *o.eos_id;
  else if (tokenizer && tokenizer->eos().id) eos = *tokenizer->eos().id;

  at::NoGradGuard no_grad;
  const at::Device device = opened.model->parameters().front().device();
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  nn::KVCache cache;
  at::Tensor input = at::tensor(out.ids, at::kLong).view({1, -1}).to(device);
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    at::Tensor logits = lm->decode(input, cache);  // (1, T, V)
    const int64_t token = next_token(logits[0][-1], o, generator);
    out.ids.push_back(token);
    if (token == eos) break;
    input = at::full({1, 1}, token, at::TensorOptions().dtype(at::kLong).device(device));
  }
  if (tokenizer) {
    out.text = tokenizer->decode(out.ids, /*skip_special_tokens=*/true);
  } else if (opened.data_source == "text") {
    for (int64_t id : out.ids) out.text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
  }
  return out;
}

}  // namespace loom
