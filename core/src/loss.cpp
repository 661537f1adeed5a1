// nn::linear_cross_entropy_sum: Note [Fused linear cross-entropy] in loom/loss.h.
#include "loom/loss.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <optional>

#include "half_matmul.h"
#include "loom/error.h"
#include "loom/nn.h"
#include "softmax_rows.h"

namespace loom::nn {
namespace {

struct Grads {
  at::Tensor x, weight, bias;  // undefined where not wanted
};

// The head's two products with the weight, logits = xs W^T (+ bias) and gx = gc W. Where the
// rows are fp32 and the weight half (Note [Half matmuls through fp32]: a CPU that emulates the
// half dtype), the weight is widened block by block into the thread's kept buffer, as the
// linears do, not whole: a whole widened head is V x D x 4 B for the length of the pass (147
// MiB for GPT-2's, 2.1 GB for a 128256 x 4096 one) on top of its fp32 gradient.
struct HeadProducts {
  const at::Tensor& weight;  // (V, D), the rows' dtype or half
  const at::Tensor& bias;    // (V) in the rows' dtype, or undefined
  bool by_blocks;

  // xs's logits, written into `kept`'s first rows where it is given (made by the first call:
  // the first chunk is the largest).
  at::Tensor logits(const at::Tensor& xs, at::Tensor* kept) const {
    const int64_t V = weight.size(0);
    if (kept && !kept->defined()) *kept = at::empty({xs.size(0), V}, xs.options());
    at::Tensor out =
        kept ? kept->narrow(0, 0, xs.size(0)) : at::empty({xs.size(0), V}, xs.options());
    if (!by_blocks)
      return bias.defined() ? at::addmm_out(out, bias, xs, weight.t())
                            : at::mm_out(out, xs, weight.t());
    const int64_t step = detail::widened_rows_per_block(weight.size(1));
    for (int64_t r = 0; r < V; r += step) {
      const int64_t n = std::min(step, V - r);
      const at::Tensor wb = detail::widened_weight_rows(weight, r, n).t();
      out.narrow(1, r, n).copy_(bias.defined() ? at::addmm(bias.narrow(0, r, n), xs, wb)
                                               : at::mm(xs, wb));
    }
    return out;
  }
  // gc (n, V) times the weight, into out (n, D).
  void x_grad(const at::Tensor& gc, at::Tensor out) const {
    if (!by_blocks) {
      out.copy_(at::mm(gc, weight));
      return;
    }
    const int64_t V = weight.size(0), step = detail::widened_rows_per_block(weight.size(1));
    at::Tensor sum = at::zeros(out.sizes(), gc.options());  // fp32 over the blocks
    for (int64_t r = 0; r < V; r += step) {
      const int64_t n = std::min(step, V - r);
      sum.addmm_(gc.narrow(1, r, n), detail::widened_weight_rows(weight, r, n));
    }
    out.copy_(sum);
  }
};

// The loss of rows x (N, D) in the compute dtype against labels (N), and, for the wanted
// inputs, its gradient with respect to them (x's in x_dtype, the head's in fp32). The weight
// is in x's dtype, or half with fp32 rows (HeadProducts).
at::Tensor chunked_pass(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                        const at::Tensor& labels, int64_t ignore_index, int64_t chunk_rows,
                        at::ScalarType x_dtype, bool want_x, bool want_weight, bool want_bias,
                        Grads* grads) {
  const int64_t N = x.size(0), D = x.size(1), V = weight.size(0);
  const bool any_grad = want_x || want_weight || want_bias;
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor loss = at::zeros({}, f32);
  if (want_x) grads->x = at::empty({N, D}, x.options().dtype(x_dtype));
  // The head's gradient is written by its first chunk's product (beta = 0), not zero-filled
  // first: V x D x 4 B (154 MiB for GPT-2's head) of fresh pages written once, not twice. The
  // values are the same: 0 + x is x (but for a -0 product, which stays -0 where it became +0).
  if (want_weight) grads->weight = at::empty({V, D}, f32);
  bool weight_written = false;
  if (want_bias) grads->bias = at::zeros({V}, f32);
  const HeadProducts head{weight, bias, weight.scalar_type() != x.scalar_type()};
  constexpr int kChunksPerSum = 4;
  at::Tensor partial = want_weight && x.scalar_type() != at::kFloat
                           ? at::empty({V, D}, x.options())
                           : at::Tensor();  // the head's gradient over a few chunks, half
  int in_sum = 0;
  // The half partial sum into the fp32 gradient. On the CPU an fp32 += half add_ widens its
  // half operand into a temporary first (ATen's CPU kernels take one dtype): a whole head's
  // worth (154 MiB for GPT-2's) at the pass's peak, so it goes a few MiB of rows at a time
  // there (CUDA's kernels cast as they load).
  auto add_partial = [&] {
    if (!weight_written) {
      grads->weight.copy_(partial);  // the first: no add, no temporary
    } else if (!partial.is_cpu()) {
      grads->weight.add_(partial);
    } else {
      const int64_t step = detail::widened_rows_per_block(D);  // 4 MiB of fp32 rows
      for (int64_t r = 0; r < V; r += step) {
        const int64_t n = std::min(step, V - r);
        grads->weight.narrow(0, r, n).add_(partial.narrow(0, r, n));
      }
    }
    weight_written = true;
    in_sum = 0;
  };
  // The gradients of x and of the head from one chunk's gradient of its logits, gc (n, V) in
  // the compute dtype.
  auto add_chunk_grads = [&](const at::Tensor& gc, const at::Tensor& xs, int64_t start, int64_t n) {
    if (want_x) head.x_grad(gc, grads->x.narrow(0, start, n));
    if (!want_weight) return;
    if (gc.scalar_type() == at::kFloat) {
      if (weight_written)
        grads->weight.addmm_(gc.t(), xs);
      else
        at::mm_out(grads->weight, gc.t(), xs);
      weight_written = true;
      return;
    }
    // Half: the matmul accumulates up to kChunksPerSum chunks itself (beta = 1), then the
    // partial sum joins the fp32 gradient (Note [Fused linear cross-entropy]).
    if (in_sum == 0)
      at::mm_out(partial, gc.t(), xs);
    else
      partial.addmm_(gc.t(), xs);
    if (++in_sum == kChunksPerSum) add_partial();
  };
  // On the CPU every chunk's logits go to one buffer: a chunk's (rows, V) logits are tens of
  // MiB (51 MiB for GPT-2's 256-row chunks), above glibc's 32 MiB mapping threshold, so a
  // tensor per chunk is a fresh mapping each time, every 4 KiB page of it a fault the kernel
  // zero-fills. The row kernel's gradient in them is used up before the next chunk.
  at::Tensor kept_logits;
  const int64_t chunks = (N + chunk_rows - 1) / std::max<int64_t>(chunk_rows, 1);
  const int64_t rows = chunks ? (N + chunks - 1) / chunks : 0;  // even chunks
  for (int64_t start = 0; start < N; start += rows) {
    const int64_t n = std::min(rows, N - start);
    const at::Tensor xs = x.narrow(0, start, n), ls = labels.narrow(0, start, n);
    at::Tensor logits = head.logits(xs, x.is_cpu() ? &kept_logits : nullptr);
    // Note [Softmax rows in one kernel]: the loss and, in the logits' memory, the gradient.
    at::Tensor row_loss;
    if (!want_bias && detail::softmax_rows(logits, ls, ignore_index, any_grad, row_loss)) {
      loss.add_(row_loss.sum());
      if (any_grad) add_chunk_grads(logits, xs, start, n);
      continue;
    }
    // In fp32 straight from half logits: no fp32 copy of them.
    at::Tensor logp = at::log_softmax(logits, 1, at::kFloat);
    logits = kept_logits = at::Tensor();  // its memory goes back before the chunk's matmuls
    const at::Tensor valid = ls.ne(ignore_index);
    const bool all_valid = x.is_cpu() && valid.all().item<bool>();  // no GPU sync
    const at::Tensor index = (all_valid ? ls : at::where(valid, ls, 0)).unsqueeze(1);
    at::Tensor picked = logp.gather(1, index).squeeze(1);
    loss.sub_(all_valid ? picked.sum() : at::where(valid, picked, 0).sum());
    if (!any_grad) continue;
    // d loss / d logits = softmax − one-hot, zero on ignored rows; built in logp's memory.
    at::Tensor g = logp.exp_();
    g.scatter_add_(1, index, all_valid ? at::full({n, 1}, -1.0f, f32)
                                       : valid.to(at::kFloat).neg().unsqueeze(1));
    if (!all_valid) g.masked_fill_(valid.logical_not().unsqueeze(1), 0.0f);
    if (want_bias) grads->bias.add_(g.sum(0));
    add_chunk_grads(g.scalar_type() == x.scalar_type() ? g : g.to(x.scalar_type()), xs, start, n);
  }
  if (in_sum > 0) add_partial();
  if (want_weight && !weight_written) grads->weight.zero_();  // no rows
  return loss;
}

// chunked_pass on x, weight and bias cast to the compute dtype, with autocast off: the casts
// are explicit here, and autocast must not cast the fp32 softmax's matmuls again.
at::Tensor cast_and_pass(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                         const at::Tensor& labels, int64_t ignore_index, int64_t chunk_rows,
                         at::ScalarType compute, bool want_x, bool want_weight, bool want_bias,
                         Grads* grads) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  // Note [Half matmuls through fp32] (loom/nn.h): on a CPU that emulates the half
  // dtype, the operands are rounded to it and widened back, and the pass runs in fp32 (its
  // logits are not rounded to the half dtype: closer to fp32, not further). The head stays
  // half, widened a block at a time by HeadProducts.
  const at::ScalarType wide =
      x.is_cpu() && nn::half_matmul_path(compute) == nn::HalfMatmul::through_fp32 ? at::kFloat
                                                                                 : compute;
  auto in = [&](const at::Tensor& t) { return t.to(compute).to(wide); };
  const at::Tensor bc = bias.defined() ? in(bias) : at::Tensor();
  return chunked_pass(in(x), weight.to(compute), bc, labels, ignore_index, chunk_rows,
                      x.scalar_type(), want_x, want_weight, want_bias, grads);
}

struct LinearCrossEntropy : torch::autograd::Function<LinearCrossEntropy> {
  // x (N, D) and weight/bias already in the compute dtype where autocast asked for one; the
  // originals' dtypes come as ints so backward returns gradients in them.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const std::optional<at::Tensor>& bias_opt,
                            const at::Tensor& labels, int64_t ignore_index, int64_t chunk_rows,
                            at::ScalarType compute_dtype) {
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    Grads grads;
    at::Tensor loss = cast_and_pass(x, weight, bias, labels, ignore_index, chunk_rows,
                                    compute_dtype, x.requires_grad(), weight.requires_grad(),
                                    bias.defined() && bias.requires_grad(), &grads);
    ctx->saved_data["gx"] = grads.x;
    ctx->saved_data["gw"] = grads.weight;
    ctx->saved_data["gb"] = grads.bias;
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["b_dtype"] =
        static_cast<int64_t>(bias.defined() ? bias.scalar_type() : at::kFloat);
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const at::Tensor g = grad_out[0].to(at::kFloat);
    // Each saved gradient times the incoming one, back in its input's dtype (x's is saved in it).
    auto scaled = [&](const char* key, std::optional<at::ScalarType> dtype) {
      const at::Tensor t = ctx->saved_data[key].toTensor();
      if (!t.defined()) return at::Tensor();
      return t.to(at::kFloat).mul_(g).to(dtype.value_or(t.scalar_type()));
    };
    at::Tensor gx = scaled("gx", std::nullopt);
    at::Tensor gw = scaled("gw", static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt()));
    at::Tensor gb = scaled("gb", static_cast<at::ScalarType>(ctx->saved_data["b_dtype"].toInt()));
    ctx->saved_data.clear();  // a second backward through this graph is not supported
    return {gx, gw, gb, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

int64_t default_chunk_rows(int64_t vocab) {
  constexpr int64_t kLogitsPerChunk = int64_t{1} << 24;
  return std::max<int64_t>(8, kLogitsPerChunk / std::max<int64_t>(vocab, 1));
}

at::Tensor linear_cross_entropy_sum(const at::Tensor& x, const at::Tensor& weight,
                                    const at::Tensor& bias, const at::Tensor& labels,
                                    int64_t ignore_index, int64_t chunk_rows) {
  LOOM_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
             "linear_cross_entropy_sum: x ", x.sizes(), " does not match the head ",
             weight.sizes());
  LOOM_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)),
             "linear_cross_entropy_sum: bias ", bias.sizes(), " does not match the head ",
             weight.sizes());
  LOOM_CHECK(labels.numel() * x.size(-1) == x.numel(), "linear_cross_entropy_sum: labels ",
             labels.sizes(), " do not match x ", x.sizes());
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  const at::Tensor flat_labels = labels.reshape({-1});
  // Every CPU path names a bad label (a GPU's would need a host sync; ATen's kernel asserts).
  if (flat_labels.is_cpu() && flat_labels.scalar_type() == at::kLong) {
    const at::Tensor contiguous_labels = flat_labels.contiguous();
    const int64_t* label = contiguous_labels.data_ptr<int64_t>();
    const int64_t V = weight.size(0);
    for (int64_t r = 0; r < contiguous_labels.numel(); ++r)
      LOOM_CHECK(label[r] == ignore_index || (label[r] >= 0 && label[r] < V),
                 "cross-entropy label ", label[r], " is outside the vocabulary [0, ", V,
                 ") and is not the ignore index ", ignore_index,
                 "; check the data's token ids against the model's vocab_size");
  }
  const auto device_type = x.device().type();
  at::ScalarType compute = at::promote_types(x.scalar_type(), weight.scalar_type());
  if (at::autocast::is_autocast_available(device_type) &&
      at::autocast::is_autocast_enabled(device_type))
    compute = at::autocast::get_autocast_dtype(device_type);
  if (compute == at::kHalf) {
    // fp16: unfused (the Note says why).
    const at::Tensor logits = nn::linear(rows, weight, bias);
    return at::cross_entropy_loss(logits.to(at::kFloat), flat_labels, {}, at::Reduction::Sum,
                                  ignore_index);
  }
  if (chunk_rows <= 0) chunk_rows = default_chunk_rows(weight.size(0));
  const bool grad = at::GradMode::is_enabled() &&
                    (x.requires_grad() || weight.requires_grad() ||
                     (bias.defined() && bias.requires_grad()));
  if (grad)
    return LinearCrossEntropy::apply(
        rows, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
        flat_labels, ignore_index, chunk_rows, compute);
  return cast_and_pass(rows, weight, bias, flat_labels, ignore_index, chunk_rows, compute, false,
                       false, false, nullptr);
}

Output causal_lm_output(const at::Tensor& x, Linear* head, const at::Tensor& tied_weight,
                        const Batch& batch, bool fused, int64_t chunk_rows) {
  Output out;
  if (batch.labels.defined()) {
    out.num_targets = batch.num_loss_targets();
    // An adapted head (LoRA on lm_head) is more than a matmul: it takes the unfused path.
    if (fused && !(head && head->adapter())) {
      out.loss_sum = linear_cross_entropy_sum(x, head ? head->weight : tied_weight,
                                              head ? head->bias : at::Tensor(), batch.labels,
                                              kIgnoreIndex, chunk_rows);
      return out;  // no logits: Note [Fused linear cross-entropy]
    }
  }
  out.logits = head ? head->forward(x) : nn::linear(x, tied_weight);
  if (batch.labels.defined())
    out.loss_sum = at::cross_entropy_loss(out.logits.view({-1, out.logits.size(-1)}).to(at::kFloat),
                                          batch.labels.reshape({-1}), {}, at::Reduction::Sum,
                                          kIgnoreIndex);
  return out;
}

}  // namespace loom::nn
