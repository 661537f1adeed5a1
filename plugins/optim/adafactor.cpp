// adafactor: Shazeer & Stern 2018 with the arithmetic and defaults of Transformers' Adafactor
// (relative step, parameter scaling, update clipping, decay 1 - t^-0.8; or the Trainer's
// optim="adafactor": the job's lr, no scaling). Factored second moment for rank >= 2, full for
// vectors. Two implementations of the same arithmetic: raw loops over CPU fp32 tensors, and
// tensor ops for any device (CUDA: no host round trip, no sync); `kernel` picks, and the tests
// hold the tensor ops to the loops on the CPU.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "rules.h"

namespace loom::optim {
namespace {

// Where a segment sits in its tensor. Rank >= 2 is viewed as M matrices (R, C) (leading dims
// folded into M); the segment holds whole rows of C (the `row` granularity: cuts between rows
// of dim 0, which for rank >= 3 are whole matrices). Vectors: one "row" per element.
struct Geometry {
  bool factored = false;
  int64_t numel = 1, R = 1, C = 1, M = 1;
  int64_t first_row = 0, rows = 0;  // global row index of the segment's first row, its row count

  explicit Geometry(const Segment& s) {
    for (int64_t d : s.shape) numel *= d;
    factored = s.shape.size() >= 2;
    if (factored) {
      C = s.shape.back();
      R = s.shape[s.shape.size() - 2];
      M = numel / (R * C);
    }
    first_row = s.offset / C;
    rows = s.param.numel() / C;
  }
  int64_t matrix(int64_t k) const { return (first_row + k) / R; }  // of local row k
};

class Adafactor final : public UpdateRule {
 public:
  explicit Adafactor(const ConfigSection& c)
      : eps1_(c.get_float("eps1")),
        eps2_(c.get_float("eps2")),
        clip_(c.get_float("clip_threshold")),
        decay_rate_(c.get_float("decay_rate")),
        beta1_(beta_in_range(c, "beta1")),
        scale_parameter_(c.get_bool("scale_parameter")),
        relative_step_(c.get_bool("relative_step")),
        warmup_init_(c.get_bool("warmup_init")),
        kernel_(c.get_string("kernel")) {
    LOOM_CHECK_AS(ConfigError,
                  kernel_ == "auto" || kernel_ == "cpu_loops" || kernel_ == "tensor_ops",
                  c.where("kernel"), ": [optimizer] kernel '", kernel_,
                  "' is unknown; use auto, cpu_loops or tensor_ops");
    LOOM_CHECK_AS(ConfigError, eps1_ >= 0 && eps2_ >= 0, c.where("eps1"),
                  ": [optimizer] eps1 and eps2 must be >= 0");
    LOOM_CHECK_AS(ConfigError, clip_ > 0, c.where("clip_threshold"),
                  ": [optimizer] clip_threshold must be > 0, got ", clip_);
    LOOM_CHECK_AS(ConfigError, decay_rate_ < 0, c.where("decay_rate"),
                  ": [optimizer] decay_rate must be negative (1 - t^decay_rate), got ", decay_rate_,
                  "; the default is -0.8");
    LOOM_CHECK_AS(ConfigError, !warmup_init_ || relative_step_, c.where("warmup_init"),
                  ": [optimizer] warmup_init = true needs relative_step = true");
  }
  std::string name() const override { return "adafactor"; }
  Partitioning partitioning() const override { return {Granularity::row, 1}; }

  NamedTensors init_state(const Segment& s) const override {
    const Geometry geo(s);
    auto f32 = s.param.options();
    NamedTensors state;
    if (geo.factored) {
      state.emplace_back("exp_avg_sq_row", at::zeros({geo.rows}, f32));
      state.emplace_back("exp_avg_sq_col", at::zeros({geo.M * geo.C}, f32));  // whole tensor
    } else {
      state.emplace_back("exp_avg_sq", at::zeros_like(s.param));
    }
    if (beta1_ > 0) state.emplace_back("exp_avg", at::zeros_like(s.param));
    return state;
  }

  // Round 0: [column sums of g²+eps1 (M*C) | sums of the new row factor (M) | sum p²] for
  // factored tensors, [sum p²] for vectors. Round 1: [sum of the unclipped update²].
  int reduction_rounds() const override { return 2; }
  at::Tensor make_accumulator(const Segment& s, int round) const override {
    const Geometry geo(s);
    const int64_t size = round == 1 ? 1 : geo.factored ? geo.M * geo.C + geo.M + 1 : 1;
    // The tensor-op path folds into it on the parameter's device, without a host sync.
    return at::zeros({size}, at::TensorOptions().dtype(at::kDouble).device(
                                 use_loops(s) ? c10::Device(c10::kCPU) : s.param.device()));
  }

  void accumulate(const Segment& segment, const UpdateContext& ctx, int round,
                  at::Tensor& acc) const override {
    if (!use_loops(segment)) return tensor_ops_accumulate(segment, ctx, round, acc);
    const Cpu s(segment);
    const Geometry geo(segment);
    const Beta2 b2t = beta2t(ctx.step);
    double* a = acc.data_ptr<double>();
    std::vector<float> new_row(geo.rows);
    std::vector<double> partial(geo.rows);  // one sum per row, then folded in row order
    if (round == 0) {
      if (geo.factored) {
        row_factors(s, geo, b2t, new_row.data());
        // Column sums: threads split the columns; each walks the rows in order.
        at::parallel_for(0, geo.C, 256, [&](int64_t j0, int64_t j1) {
          for (int64_t k = 0; k < geo.rows; ++k) {
            const float* g = s.g + k * geo.C;
            double* col = a + geo.matrix(k) * geo.C;
            for (int64_t j = j0; j < j1; ++j) col[j] += static_cast<double>(g[j] * g[j] + eps1f());
          }
        });
        for (int64_t k = 0; k < geo.rows; ++k) a[geo.M * geo.C + geo.matrix(k)] += new_row[k];
      }
      row_sums(s, geo, partial.data(), [](const float* p, const float*, int64_t j) {
        return static_cast<double>(p[j]) * p[j];
      });
      double& total = a[acc.numel() - 1];
      for (double x : partial) total += x;
      return;
    }
    // Round 1: the unclipped update u = g / sqrt(v_hat), squared.
    const Factors f = factors(s, geo, ctx, b2t, new_row);
    at::parallel_for(0, geo.rows, 16, [&](int64_t k0, int64_t k1) {
      std::vector<float> u(geo.C);
      for (int64_t k = k0; k < k1; ++k) {
        unclipped(s, geo, f, k, u.data());
        double sum = 0;
        for (int64_t j = 0; j < geo.C; ++j) sum += static_cast<double>(u[j]) * u[j];
        partial[k] = sum;
      }
    });
    for (double x : partial) a[0] += x;
  }

  void update(Segment& segment, const UpdateContext& ctx) const override {
    LOOM_INTERNAL_ASSERT(ctx.totals.size() == 2, "adafactor runs through update_tensor");
    if (!use_loops(segment)) return tensor_ops_update(segment, ctx);
    Cpu s(segment);
    const Geometry geo(segment);
    const Beta2 b2t = beta2t(ctx.step);
    std::vector<float> new_row(geo.rows);
    const Factors f = factors(s, geo, ctx, b2t, new_row);
    const double* t0 = ctx.totals[0].data_ptr<double>();
    const double param_rms =
        std::sqrt(t0[ctx.totals[0].numel() - 1] / static_cast<double>(geo.numel));
    const double lr = step_size(ctx, param_rms);
    const double update_rms =
        std::sqrt(ctx.totals[1].data_ptr<double>()[0] / static_cast<double>(geo.numel));
    const float clip_div = static_cast<float>(std::max(update_rms / clip_, 1.0));
    const float lrf = static_cast<float>(lr), b1 = static_cast<float>(beta1_),
                w1 = static_cast<float>(1.0 - beta1_),
                wd = static_cast<float>(-ctx.weight_decay * lr);
    float* m = beta1_ > 0 ? s.state("exp_avg") : nullptr;
    at::parallel_for(0, geo.rows, 16, [&](int64_t k0, int64_t k1) {
      std::vector<float> u(geo.C);
      for (int64_t k = k0; k < k1; ++k) {
        unclipped(s, geo, f, k, u.data());
        float* p = s.p + k * geo.C;
        for (int64_t j = 0; j < geo.C; ++j) {
          float x = u[j] / clip_div * lrf;
          if (m) {
            float& mj = m[k * geo.C + j];
            mj = mj * b1 + w1 * x;
            x = mj;
          }
          if (wd != 0) p[j] = p[j] + wd * p[j];
          p[j] = p[j] - x;
        }
      }
    });
    // Store the new second moments (the column factor is whole-tensor, the same everywhere).
    if (geo.factored) {
      std::copy(new_row.begin(), new_row.end(), s.state("exp_avg_sq_row"));
      std::copy(f.col.begin(), f.col.end(), s.state("exp_avg_sq_col"));
    } else {
      std::copy(f.v.begin(), f.v.end(), s.state("exp_avg_sq"));
    }
    s.write_back(segment);
  }

 private:
  bool use_loops(const Segment& s) const {
    return kernel_ == "cpu_loops" || (kernel_ == "auto" && cpu_fp32(s));
  }

  // ---- CPU loops ----
  // The segment's tensors as CPU fp32 pointers; with kernel = "cpu_loops" on another device,
  // CPU copies that write_back() returns.
  struct Cpu {
    explicit Cpu(const Segment& s) {
      const bool direct = cpu_fp32(s);
      param = direct ? s.param : s.param.to(at::kCPU, at::kFloat).contiguous();
      grad = direct ? s.grad : s.grad.to(at::kCPU, at::kFloat).contiguous();
      for (const auto& [key, t] : s.state)
        state_.emplace_back(key, direct ? t : t.to(at::kCPU, at::kFloat).contiguous());
      p = param.data_ptr<float>();
      g = grad.data_ptr<float>();
    }
    float* state(const std::string& key) {
      for (auto& [name, t] : state_)
        if (name == key) return t.data_ptr<float>();
      throw InternalError("adafactor state '" + key + "' missing");
    }
    const float* state(const std::string& key) const { return const_cast<Cpu*>(this)->state(key); }
    void write_back(Segment& s) {
      if (s.param.data_ptr() == param.data_ptr()) return;
      s.param.copy_(param);
      for (size_t i = 0; i < state_.size(); ++i) s.state[i].second.copy_(state_[i].second);
    }
    at::Tensor param, grad;
    NamedTensors state_;
    float* p;
    const float* g;
  };

  struct Factors {
    std::vector<float> col;       // new column factor (M*C), factored
    std::vector<float> row_mean;  // mean of the new row factor per matrix (M), factored
    std::vector<float> v;         // new second moment (n), vectors
    const float* row = nullptr;   // new row factor of the segment's rows
  };

  float eps1f() const { return static_cast<float>(eps1_); }
  // 1 - t^decay_rate; the weights b2t and 1 - b2t are rounded to fp32 from double, as torch
  // does with Python-float scalars.
  struct Beta2 {
    float keep, add;
  };
  Beta2 beta2t(int64_t step) const {
    const double b = 1.0 - std::pow(static_cast<double>(step), decay_rate_);
    return {static_cast<float>(b), static_cast<float>(1.0 - b)};
  }
  // The step before parameter scaling: the job's lr, or the relative step of t.
  double relative_lr(const UpdateContext& ctx) const {
    if (!relative_step_) return ctx.lr;
    const double t = static_cast<double>(ctx.step);
    return std::min(warmup_init_ ? 1e-6 * t : 1e-2, 1.0 / std::sqrt(t));
  }
  double step_size(const UpdateContext& ctx, double param_rms) const {
    // Transformers computes the RMS in fp32; match its rounding.
    const double scale = scale_parameter_ ? std::max(eps2_, double(float(param_rms))) : 1.0;
    return scale * relative_lr(ctx);
  }

  // new_row[k] = b2t row[k] + (1-b2t) mean_j(g²+eps1): each row on its own, in column order.
  void row_factors(const Cpu& s, const Geometry& geo, Beta2 b2t, float* new_row) const {
    const float* row = s.state("exp_avg_sq_row");
    at::parallel_for(0, geo.rows, 16, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        const float* g = s.g + k * geo.C;
        double sum = 0;
        for (int64_t j = 0; j < geo.C; ++j) sum += static_cast<double>(g[j] * g[j] + eps1f());
        const float mean = static_cast<float>(sum / static_cast<double>(geo.C));
        new_row[k] = row[k] * b2t.keep + b2t.add * mean;
      }
    });
  }

  template <typename F>
  void row_sums(const Cpu& s, const Geometry& geo, double* out, F term) const {
    at::parallel_for(0, geo.rows, 16, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        double sum = 0;
        for (int64_t j = 0; j < geo.C; ++j) sum += term(s.p + k * geo.C, s.g + k * geo.C, j);
        out[k] = sum;
      }
    });
  }

  // The new second-moment factors from round 0's totals.
  Factors factors(const Cpu& s, const Geometry& geo, const UpdateContext& ctx, Beta2 b2t,
                  std::vector<float>& new_row) const {
    Factors f;
    if (geo.factored) {
      row_factors(s, geo, b2t, new_row.data());
      f.row = new_row.data();
      const double* t0 = ctx.totals[0].data_ptr<double>();
      const float* col = s.state("exp_avg_sq_col");
      f.col.resize(geo.M * geo.C);
      for (int64_t i = 0; i < geo.M * geo.C; ++i)
        f.col[i] =
            col[i] * b2t.keep + b2t.add * static_cast<float>(t0[i] / static_cast<double>(geo.R));
      f.row_mean.resize(geo.M);
      for (int64_t m = 0; m < geo.M; ++m)
        f.row_mean[m] = static_cast<float>(t0[geo.M * geo.C + m] / static_cast<double>(geo.R));
    } else {
      const float* v = s.state("exp_avg_sq");
      const int64_t n = geo.rows;
      f.v.resize(n);
      for (int64_t i = 0; i < n; ++i)
        f.v[i] = v[i] * b2t.keep + b2t.add * (s.g[i] * s.g[i] + eps1f());
    }
    return f;
  }

  // Local row k of the unclipped update: (rsqrt(r/mean r) rsqrt(c)) g, or g rsqrt(v).
  void unclipped(const Cpu& s, const Geometry& geo, const Factors& f, int64_t k, float* u) const {
    const float* g = s.g + k * geo.C;
    if (geo.factored) {
      const float rf = 1.0f / std::sqrt(f.row[k] / f.row_mean[geo.matrix(k)]);
      const float* col = f.col.data() + geo.matrix(k) * geo.C;
      for (int64_t j = 0; j < geo.C; ++j) u[j] = rf * (1.0f / std::sqrt(col[j])) * g[j];
    } else {
      u[0] = (1.0f / std::sqrt(f.v[k])) * g[0];
    }
  }

  // ---- tensor ops: the loops' arithmetic, step for step, as ATen ops on any device ----
  // g is (rows, C) for factored tensors; `matrix` maps each local row to its matrix (M).
  struct Rows {
    at::Tensor g, matrix;
  };
  static Rows rows_of(const Segment& s, const Geometry& geo) {
    Rows r;
    r.g = s.grad.view({geo.rows, geo.C});
    r.matrix = at::arange(geo.first_row, geo.first_row + geo.rows,
                          s.param.options().dtype(at::kLong))
                   .div_(geo.R, "floor");
    return r;
  }
  at::Tensor new_row_factor(const Segment& s, const Geometry& geo, const Rows& r,
                            Beta2 b2t) const {
    // The row mean of g²+eps1, summed in fp64 and rounded once, as the loops do.
    at::Tensor mean = (r.g * r.g + eps1f()).to(at::kDouble).sum(1).div_(
        static_cast<double>(geo.C)).to(at::kFloat);
    return s.state_at("exp_avg_sq_row") * b2t.keep + mean * b2t.add;
  }
  // The unclipped update u = g / sqrt(v_hat) and the new factors (or second moment).
  struct TensorFactors {
    at::Tensor u, new_row, new_col, new_v;
  };
  TensorFactors tensor_factors(const Segment& s, const Geometry& geo, const UpdateContext& ctx,
                               Beta2 b2t) const {
    TensorFactors f;
    const at::Tensor& t0 = ctx.totals[0];
    if (geo.factored) {
      const Rows r = rows_of(s, geo);
      f.new_row = new_row_factor(s, geo, r, b2t);
      const double R = static_cast<double>(geo.R);
      f.new_col = s.state_at("exp_avg_sq_col") * b2t.keep +
                  t0.narrow(0, 0, geo.M * geo.C).div(R).to(at::kFloat) * b2t.add;
      at::Tensor row_mean = t0.narrow(0, geo.M * geo.C, geo.M).div(R).to(at::kFloat);
      at::Tensor rf = at::reciprocal(at::sqrt(f.new_row / row_mean.index_select(0, r.matrix)));
      at::Tensor cf = at::reciprocal(at::sqrt(f.new_col.view({geo.M, geo.C})))
                          .index_select(0, r.matrix);
      f.u = (rf.unsqueeze(1) * cf * r.g).view(-1);
    } else {
      f.new_v = s.state_at("exp_avg_sq") * b2t.keep + (s.grad * s.grad + eps1f()) * b2t.add;
      f.u = at::reciprocal(at::sqrt(f.new_v)) * s.grad;
    }
    return f;
  }

  void tensor_ops_accumulate(const Segment& s, const UpdateContext& ctx, int round,
                             at::Tensor& acc) const {
    const Geometry geo(s);
    const Beta2 b2t = beta2t(ctx.step);
    if (round == 0) {
      if (geo.factored) {
        const Rows r = rows_of(s, geo);
        acc.narrow(0, 0, geo.M * geo.C)
            .view({geo.M, geo.C})
            .index_add_(0, r.matrix, (r.g * r.g + eps1f()).to(at::kDouble));
        acc.narrow(0, geo.M * geo.C, geo.M)
            .index_add_(0, r.matrix, new_row_factor(s, geo, r, b2t).to(at::kDouble));
      }
      at::Tensor p = s.param.to(at::kDouble);
      acc.narrow(0, acc.numel() - 1, 1).add_((p * p).sum());
      return;
    }
    at::Tensor u = tensor_factors(s, geo, ctx, b2t).u.to(at::kDouble);
    acc.add_((u * u).sum());
  }

  void tensor_ops_update(Segment& s, const UpdateContext& ctx) const {
    const Geometry geo(s);
    const Beta2 b2t = beta2t(ctx.step);
    TensorFactors f = tensor_factors(s, geo, ctx, b2t);
    const double n = static_cast<double>(geo.numel);
    // step_size() on device scalars: no host sync.
    at::Tensor param_rms = ctx.totals[0].narrow(0, ctx.totals[0].numel() - 1, 1).div(n).sqrt();
    const double rel = relative_lr(ctx);
    at::Tensor lr = scale_parameter_
                        ? param_rms.to(at::kFloat).to(at::kDouble).clamp_min(eps2_).mul(rel)
                        : at::full({1}, rel, param_rms.options());
    at::Tensor update_rms = ctx.totals[1].div(n).sqrt();
    at::Tensor clip_div = update_rms.div(clip_).clamp_min(1.0).to(at::kFloat);
    at::Tensor x = f.u / clip_div * lr.to(at::kFloat);
    if (beta1_ > 0) {
      at::Tensor& m = s.state_at("exp_avg");
      m.copy_(m * static_cast<float>(beta1_) + x * static_cast<float>(1.0 - beta1_));
      x = m;
    }
    if (ctx.weight_decay != 0)
      s.param.copy_(s.param + (lr * -ctx.weight_decay).to(at::kFloat) * s.param);
    s.param.sub_(x);
    if (geo.factored) {
      s.state_at("exp_avg_sq_row").copy_(f.new_row);
      s.state_at("exp_avg_sq_col").copy_(f.new_col);
    } else {
      s.state_at("exp_avg_sq").copy_(f.new_v);
    }
  }

  double eps1_, eps2_, clip_, decay_rate_, beta1_;
  bool scale_parameter_, relative_step_, warmup_init_;
  std::string kernel_;
};

}  // namespace

std::unique_ptr<UpdateRule> make_adafactor(const ConfigSection& c) {
  return std::make_unique<Adafactor>(c);
}

}  // namespace loom::optim
