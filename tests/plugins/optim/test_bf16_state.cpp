// Tests of adamw's bf16 state ([optimizer] state_dtype = "bf16", Note [Stochastic rounding of
// the state] in core/src/adamw.cpp): bitwise parity with a numpy/torch reference that draws the
// same random bits, the rounding's expectation, the AVX-512, AVX2, scalar and tensor-op paths
// bit for bit, bf16 tensors in the checkpoint, the bytes per parameter the memory tracker sees,
// and the refusals. Split, thread-count and resume conformance: the "adamw bf16" case of
// test_optim.cpp's all_rules().
#include <ATen/ATen.h>

#include <cmath>
#include <cstdlib>
#include <map>

#include "loom/kernel_isa.h"
#include "loom/memory.h"
#include "loom/safetensors.h"
#include "loom/trainer.h"
#include "test_util.h"
#include "update_rules.h"

namespace loom {
namespace {

using test::TempDir;
using test::make_rule;
using test::tiny_gpt_job;

// One segment of a tensor under test: its name, its offset in the whole tensor, its values.
struct Piece {
  std::string name;
  int64_t offset;
  at::Tensor param, exp_avg, exp_avg_sq;  // fp32, bf16, bf16
  std::vector<at::Tensor> grads;          // one per step
};

// Pieces with state already away from zero (so every step rounds values of every size), among
// them a segment that straddles element 2^32 of its tensor (the key changes there) and one past
// it; the offsets only feed the random bits, so the tensors stay small.
std::vector<Piece> make_pieces(int steps) {
  at::manual_seed(21);
  std::vector<Piece> out;
  const std::vector<std::pair<std::string, int64_t>> where = {{"h.0.attn.c_attn.weight", 0},
                                                              {"h.0.attn.c_attn.weight", 1000},
                                                              {"wte.weight", (1ll << 32) - 777},
                                                              {"lm_head.bias", (3ll << 32) + 5}};
  const std::vector<int64_t> sizes = {1000, 2051, 1500, 37};
  for (size_t k = 0; k < where.size(); ++k) {
    Piece p;
    p.name = where[k].first;
    p.offset = where[k].second;
    p.param = at::randn({sizes[k]});
    p.exp_avg = (at::randn({sizes[k]}) * 0.01).to(at::kBFloat16);
    p.exp_avg_sq = (at::rand({sizes[k]}) * 1e-4).to(at::kBFloat16);
    for (int s = 0; s < steps; ++s) p.grads.push_back(at::randn({sizes[k]}) * 0.05);
    out.push_back(std::move(p));
  }
  return out;
}

struct Result {
  std::vector<at::Tensor> param, exp_avg, exp_avg_sq;
};

constexpr double kLr = 3e-3, kWeightDecay = 0.1;

// The rule over the pieces for every step; `strided` gives it parameters that are every other
// element of a larger tensor, which the CPU kernel does not take (the tensor-op path, what runs
// on GPUs).
Result run_pieces(const UpdateRule& rule, const std::vector<Piece>& pieces, bool strided = false,
                  int64_t first_step = 1) {
  std::vector<Segment> segments;
  std::vector<at::Tensor> storage;
  for (const Piece& p : pieces) {
    Segment s;
    s.name = p.name;
    s.shape = {p.offset + p.param.numel()};
    s.offset = p.offset;
    if (strided) {
      storage.push_back(at::zeros({p.param.numel() * 2}));
      s.param = storage.back().slice(0, 0, p.param.numel() * 2, 2);
      s.param.copy_(p.param);
    } else {
      s.param = p.param.clone();
    }
    s.state = {{"exp_avg", p.exp_avg.clone()}, {"exp_avg_sq", p.exp_avg_sq.clone()}};
    segments.push_back(std::move(s));
  }
  for (size_t step = 0; step < pieces.front().grads.size(); ++step)
    for (size_t k = 0; k < pieces.size(); ++k) {
      segments[k].grad = pieces[k].grads[step];
      UpdateContext ctx;
      ctx.step = static_cast<int64_t>(step) + first_step;
      ctx.lr = kLr;
      ctx.weight_decay = kWeightDecay;
      rule.update(segments[k], ctx);
    }
  Result out;
  for (Segment& s : segments) {
    out.param.push_back(s.param.contiguous());
    out.exp_avg.push_back(s.state_at("exp_avg"));
    out.exp_avg_sq.push_back(s.state_at("exp_avg_sq"));
  }
  return out;
}

// run_pieces with the kernel capped at `isa` (Note [Kernel ISA cap]), the cap lifted after.
Result run_on(const char* isa, const UpdateRule& rule, const std::vector<Piece>& pieces,
              bool strided = false, int64_t first_step = 1) {
  setenv("LOOM_KERNEL_ISA", isa, 1);
  Result out;
  try {
    out = run_pieces(rule, pieces, strided, first_step);
  } catch (...) {
    unsetenv("LOOM_KERNEL_ISA");
    throw;
  }
  unsetenv("LOOM_KERNEL_ISA");
  return out;
}
// Whether this CPU runs the kernel path `isa` ("avx2" or "avx512").
bool cpu_has(const std::string& isa) {
  return cpu::cpu_kernel_isa() >= (isa == "avx2" ? cpu::KernelIsa::avx2 : cpu::KernelIsa::avx512);
}

std::unique_ptr<UpdateRule> bf16_rule(uint64_t seed) {
  auto rule = make_rule("adamw", {{"beta1", 0.9},
                                  {"beta2", 0.999},
                                  {"eps", 1e-8},
                                  {"state_dtype", std::string("bf16")}});
  rule->set_seed(seed);
  return rule;
}

void expect_equal(const Result& got, const Result& want, const std::string& what) {
  ASSERT_EQ(got.param.size(), want.param.size());
  for (size_t k = 0; k < got.param.size(); ++k) {
    EXPECT_TRUE(at::equal(got.param[k], want.param[k])) << what << ": param of piece " << k;
    EXPECT_TRUE(at::equal(got.exp_avg[k], want.exp_avg[k])) << what << ": exp_avg of piece " << k;
    EXPECT_TRUE(at::equal(got.exp_avg_sq[k], want.exp_avg_sq[k]))
        << what << ": exp_avg_sq of piece " << k;
  }
}

// Three updates against bf16_state_reference.py, which draws the random bits from the Note's
// formula in numpy and does the arithmetic as torch ops: parameters and both bf16 moments equal
// bit for bit.
TEST(OptimBf16State, UpdatesMatchTheTorchReferenceBitwise) {
  constexpr int kSteps = 3;
  constexpr uint64_t kSeed = 1234;
  const auto pieces = make_pieces(kSteps);
  const Result got = run_pieces(*bf16_rule(kSeed), pieces);

  TempDir dir;
  NamedTensors input;
  std::string segments;
  for (size_t k = 0; k < pieces.size(); ++k) {
    const std::string i = std::to_string(k);
    input.emplace_back("param." + i, pieces[k].param);
    input.emplace_back("exp_avg." + i, pieces[k].exp_avg);
    input.emplace_back("exp_avg_sq." + i, pieces[k].exp_avg_sq);
    for (int s = 0; s < kSteps; ++s)
      input.emplace_back("grad." + std::to_string(s + 1) + "." + i, pieces[k].grads[s]);
    segments += detail::cat(k ? ", " : "", "{\"name\": \"", pieces[k].name,
                            "\", \"offset\": ", pieces[k].offset, "}");
  }
  safetensors::save(dir / "in.safetensors", input);
  const std::string config = detail::cat(
      "{\"seed\": ", kSeed, ", \"lr\": ", kLr, ", \"beta1\": 0.9, \"beta2\": 0.999, \"eps\": 1e-8",
      ", \"weight_decay\": ", kWeightDecay, ", \"steps\": ", kSteps, ", \"segments\": [",
      segments, "]}");
  const std::string command = std::string(LOOM_TEST_PYTHON) + " " + LOOM_BF16_STATE_REFERENCE +
                              " '" + config + "' " + (dir / "in.safetensors").string() + " " +
                              (dir / "out.safetensors").string();
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  auto loaded = safetensors::load(dir / "out.safetensors").tensors;
  std::map<std::string, at::Tensor> by_name(loaded.begin(), loaded.end());
  Result want;
  for (size_t k = 0; k < pieces.size(); ++k) {
    const std::string i = std::to_string(k);
    want.param.push_back(by_name.at("param." + i));
    want.exp_avg.push_back(by_name.at("exp_avg." + i));
    want.exp_avg_sq.push_back(by_name.at("exp_avg_sq." + i));
    ASSERT_EQ(want.exp_avg.back().scalar_type(), at::kBFloat16);
  }
  expect_equal(got, want, "reference");
  // The moments moved, and another seed rounds them otherwise: a comparison of untouched or
  // seed-blind state could not fail.
  EXPECT_FALSE(at::equal(got.exp_avg[0], pieces[0].exp_avg));
  const Result other = run_pieces(*bf16_rule(kSeed + 1), pieces);
  EXPECT_FALSE(at::equal(other.exp_avg[0], got.exp_avg[0]));
  EXPECT_FALSE(at::equal(other.exp_avg_sq[1], got.exp_avg_sq[1]));
}

// E[round(x)] = x: 2^16 elements of one value after one update round up with the frequency of
// their distance from the bf16 below, so their mean is the fp32 moment to within the sampling
// error, where round-to-nearest would be off by the whole distance to the nearer neighbour.
TEST(OptimBf16State, RoundingIsUnbiased) {
  constexpr int64_t n = 1 << 16;
  auto rule = bf16_rule(99);
  Segment s;
  s.name = "w";
  s.shape = {n};
  s.param = at::zeros({n});
  s.state = rule->init_state(s);
  ASSERT_EQ(s.state_at("exp_avg").scalar_type(), at::kBFloat16);
  // exp_avg = (1 - beta1) g and exp_avg_sq = (1 - beta2) g² after the first step, in fp32 as
  // the kernel computes them; g puts them a third and five eighths of the way between two bf16.
  const float g = 0.6014f;
  const float w1 = static_cast<float>(1.0 - 0.9), w2 = static_cast<float>(1.0 - 0.999);
  s.grad = at::full({n}, g);
  UpdateContext ctx;
  ctx.lr = 0.0;
  rule->update(s, ctx);
  auto check = [&](const at::Tensor& stored, float exact, const char* what) {
    const at::Tensor values = stored.to(at::kDouble);
    const double low = values.min().item<double>(), high = values.max().item<double>();
    ASSERT_LT(low, exact) << what;
    ASSERT_GT(high, exact) << what << ": only the two neighbours are drawn";
    const double ulp = high - low;
    const double up_share = (values == high).to(at::kDouble).mean().item<double>();
    const double want_share = (exact - low) / ulp;
    // Binomial sampling error of the share: sqrt(p(1-p)/n) < 0.002; six of them.
    EXPECT_NEAR(up_share, want_share, 0.012) << what;
    EXPECT_NEAR(values.mean().item<double>(), exact, 0.012 * ulp) << what;
    // The test means something: round-to-nearest would miss by far more than the bound.
    EXPECT_GT(std::min(exact - low, high - exact), 0.3 * ulp) << what;
  };
  check(s.state_at("exp_avg"), w1 * g, "exp_avg");
  check(s.state_at("exp_avg_sq"), w2 * g * g, "exp_avg_sq");
}

// Note [Kernel ISA cap]: the scalar, AVX2 and AVX-512 copies of the kernel, and the tensor ops
// (strided parameters), give the same bits over five steps; pieces of odd lengths leave tails
// shorter than either vector.
TEST(OptimBf16State, IsaPathsAndTensorOpsGiveIdenticalBits) {
  const auto pieces = make_pieces(5);
  auto rule = bf16_rule(5);
  const Result scalar = run_on("scalar", *rule, pieces);
  expect_equal(run_on("scalar", *rule, pieces, /*strided=*/true), scalar, "tensor ops");
  for (const char* isa : {"avx2", "avx512"}) {
    if (!cpu_has(isa)) {
      std::cout << "[ SKIPPED  ] " << isa << ": this CPU lacks it\n";
      continue;
    }
    expect_equal(run_on(isa, *rule, pieces), scalar, isa);
  }
  EXPECT_FALSE(at::equal(scalar.exp_avg_sq[2], pieces[2].exp_avg_sq));
}

// Late in a run sqrt(1 - beta2^t) rounds to 1.0f and the AVX2 kernel leaves out the division by
// it (Note [bf16 moments in AVX2 by hand] in core/src/adamw.cpp): steps there give the scalar
// kernel's bits, as do the steps just before, where the division is still made.
TEST(OptimBf16State, LateStepsKeepTheBitsWithoutTheBiasDivision) {
  const int64_t late = 20000;  // beta2 = 0.999: 0.999^20000 ~ 2e-9 < 2^-24
  ASSERT_EQ(static_cast<float>(std::sqrt(1.0 - std::pow(0.999, double(late)))), 1.0f);
  ASSERT_NE(static_cast<float>(std::sqrt(1.0 - std::pow(0.999, 100.0))), 1.0f);
  const auto pieces = make_pieces(3);
  auto rule = bf16_rule(8);
  for (int64_t first : {int64_t{100}, late}) {
    SCOPED_TRACE("from step " + std::to_string(first));
    const Result scalar = run_on("scalar", *rule, pieces, false, first);
    for (const char* isa : {"avx2", "avx512"})
      if (cpu_has(isa)) expect_equal(run_on(isa, *rule, pieces, false, first), scalar, isa);
  }
}

// The optimizer file holds the moments as bf16 (half the bytes), the memory tracker sees 4 B
// per parameter less after setup, and the model-state report says 4 B/param of state.
TEST(OptimBf16State, CheckpointHoldsBf16AndTrackerSeesFourBytesPerParameter) {
  memory::install_cpu_tracker();
  auto setup_bytes = [](const std::string& dtype, int64_t* trainable, double* state_per_param) {
    TempDir dir;
    const int64_t before = memory::cpu_stats().current_bytes;
    auto trainer = Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(),
                                      {"optimizer.state_dtype=\"" + dtype + "\"",
                                       "train.max_steps=1"});
    trainer->setup();
    const int64_t grown = memory::cpu_stats().current_bytes - before;
    const auto state = trainer->engine().model_state();
    *trainable = state.trainable_count;
    *state_per_param = static_cast<double>(state.optimizer_bytes) / state.trainable_count;
    trainer->run();
    if (dtype == "bf16") {
      const auto saved =
          safetensors::load(dir / "checkpoint-1" / "optimizer-00000-of-00001.safetensors").tensors;
      int moments = 0;
      for (const auto& [name, tensor] : saved)
        if (name.rfind("state/", 0) == 0) {
          ++moments;
          EXPECT_EQ(tensor.scalar_type(), at::kBFloat16) << name;
        }
      EXPECT_GT(moments, 0);
    }
    return grown;
  };
  int64_t trainable = 0;
  double per_param = 0;
  setup_bytes("fp32", &trainable, &per_param);  // one-time allocations out of the way
  const int64_t fp32 = setup_bytes("fp32", &trainable, &per_param);
  EXPECT_DOUBLE_EQ(per_param, 8.0);
  const int64_t bf16 = setup_bytes("bf16", &trainable, &per_param);
  EXPECT_DOUBLE_EQ(per_param, 4.0);
  std::printf("setup allocated %lld B with fp32 state, %lld B with bf16 state, %lld trainable\n",
              static_cast<long long>(fp32), static_cast<long long>(bf16),
              static_cast<long long>(trainable));
  EXPECT_EQ(fp32 - bf16, 4 * trainable);
}

// Bad values are refused by name before anything is built; rules that keep fp32 state only
// refuse bf16 rather than ignore it.
TEST(OptimBf16State, RefusesBadValuesByName) {
  TempDir dir;
  auto build = [&](const std::vector<std::string>& set) {
    return Trainer::from_text(tiny_gpt_job(dir.str()), dir.path(), set)->run();
  };
  EXPECT_THROW_WITH(build({"optimizer.state_dtype=\"fp16\""}), ConfigError,
                    "[optimizer] state_dtype 'fp16' is unknown", "\"fp32\"", "\"bf16\"");
  EXPECT_THROW_WITH(build({"optimizer.name=lion", "optimizer.state_dtype=\"bf16\""}), ConfigError,
                    "state_dtype = \"bf16\" is not offered by the update rule 'lion'",
                    "keeps its state as \"fp32\" only");
  EXPECT_THROW_WITH(build({"optimizer.name=adam8bit", "optimizer.state_dtype=\"bf16\""}),
                    ConfigError, "does not apply to adam8bit", "8 bits");
  EXPECT_THROW_WITH(make_rule("adamw", {{"state_dtype", std::string("bfloat16")}}), ConfigError,
                    "state_dtype 'bfloat16' is unknown for adamw");
}

}  // namespace
}  // namespace loom
