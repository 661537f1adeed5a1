// The Comm backend registry and the `local` backend (one rank: every collective is a copy).
#include "loom/comm.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <mutex>

#include "comm_backends.h"
#include "dist_env.h"
#include "loom/error.h"

namespace loom {
namespace {

class DoneWork final : public Work {
 public:
  void wait() override {}
  bool completed() override { return true; }
};

class LocalComm final : public Comm {
 public:
  // A solo probe's process keeps its launcher's local rank: its GPU (Note [Solo probes]).
  explicit LocalComm(int local_rank = 0) : local_rank_(local_rank) {}
  std::string backend() const override { return "local"; }
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  int local_rank() const override { return local_rank_; }
  int local_world_size() const override { return 1; }

  std::shared_ptr<Work> all_reduce(at::Tensor&, ReduceOp) override { return done(); }
  std::shared_ptr<Work> reduce_scatter(at::Tensor& output, const at::Tensor& input,
                                       ReduceOp) override {
    check_same(output, input, "reduce_scatter");
    output.copy_(input);
    return done();
  }
  std::shared_ptr<Work> all_gather(at::Tensor& output, const at::Tensor& input) override {
    check_same(output, input, "all_gather");
    output.copy_(input);
    return done();
  }
  std::shared_ptr<Work> broadcast(at::Tensor&, int root) override {
    LOOM_CHECK(root == 0, "broadcast root ", root, " does not exist in a world of 1 rank");
    return done();
  }
  std::shared_ptr<Work> all_to_all(at::Tensor& output, const at::Tensor& input) override {
    check_same(output, input, "all_to_all");
    output.copy_(input);
    return done();
  }
  std::shared_ptr<Work> all_to_all_rows(at::Tensor& output, const at::Tensor& input,
                                        const std::vector<int64_t>& send_rows,
                                        const std::vector<int64_t>& recv_rows) override {
    check_rows(output, input, send_rows, recv_rows, 1, "all_to_all_rows");
    output.copy_(input);
    return done();
  }
  void barrier() override {}
  std::unique_ptr<Comm> split(int, int) override {
    return std::make_unique<LocalComm>(local_rank_);
  }

 private:
  int local_rank_;
  static std::shared_ptr<Work> done() { return std::make_shared<DoneWork>(); }
  static void check_same(const at::Tensor& output, const at::Tensor& input, const char* op) {
    LOOM_CHECK(output.numel() == input.numel(), op, ": output has ", output.numel(),
               " elements, input ", input.numel(), "; with one rank they must be equal");
  }
};

std::mutex registry_mutex;
// Backends added by plugins or embedding programs (the built-in ones are below).
std::map<std::string, CommFactory>& registry() {
  static std::map<std::string, CommFactory> factories;
  return factories;
}

}  // namespace

void check_rows(const at::Tensor& output, const at::Tensor& input,
                const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                int world, const char* op) {
  LOOM_CHECK(static_cast<int>(send_rows.size()) == world &&
                 static_cast<int>(recv_rows.size()) == world,
             op, ": ", send_rows.size(), " send and ", recv_rows.size(),
             " receive counts for a world of ", world, " ranks");
  int64_t sent = 0, received = 0;
  for (int j = 0; j < world; ++j) {
    LOOM_CHECK(send_rows[j] >= 0 && recv_rows[j] >= 0, op, ": negative row count");
    sent += send_rows[j];
    received += recv_rows[j];
  }
  LOOM_CHECK(input.dim() >= 1 && output.dim() >= 1 && input.size(0) == sent &&
                 output.size(0) == received && input.scalar_type() == output.scalar_type() &&
                 input.numel() / std::max<int64_t>(1, sent) * received == output.numel() &&
                 output.is_contiguous(),
             op, ": input has ", input.dim() ? input.size(0) : 0, " rows (counts say ", sent,
             "), output ", output.dim() ? output.size(0) : 0, " rows (counts say ", received,
             "); both need equal rows of one dtype, the output contiguous");
}

// Any backend: pad every rank's piece for every other to the largest piece anywhere, one even
// all_to_all, then keep the real rows. Backends with a native uneven exchange override it.
std::shared_ptr<Work> Comm::all_to_all_rows(at::Tensor& output, const at::Tensor& input,
                                            const std::vector<int64_t>& send_rows,
                                            const std::vector<int64_t>& recv_rows) {
  const int world = world_size();
  check_rows(output, input, send_rows, recv_rows, world, "all_to_all_rows");
  int64_t largest = 0;
  for (int j = 0; j < world; ++j) largest = std::max({largest, send_rows[j], recv_rows[j]});
  at::Tensor most = at::full({1}, static_cast<double>(largest),
                             at::TensorOptions().dtype(at::kDouble).device(device()));
  all_reduce(most, ReduceOp::max)->wait();
  const int64_t rows = static_cast<int64_t>(most.item<double>());
  std::vector<int64_t> row_shape = input.sizes().vec();
  row_shape[0] = rows * world;
  at::Tensor padded = at::zeros(row_shape, input.options());
  int64_t at_row = 0;
  for (int j = 0; j < world; ++j) {
    padded.narrow(0, j * rows, send_rows[j]).copy_(input.narrow(0, at_row, send_rows[j]));
    at_row += send_rows[j];
  }
  at::Tensor received = at::empty_like(padded);
  all_to_all(received, padded)->wait();
  at_row = 0;
  for (int j = 0; j < world; ++j) {
    output.narrow(0, at_row, recv_rows[j]).copy_(received.narrow(0, j * rows, recv_rows[j]));
    at_row += recv_rows[j];
  }
  return std::make_shared<DoneWork>();
}

std::unique_ptr<Comm> Comm::split(int, int) {
  throw Error(detail::cat("the '", backend(), "' Comm backend cannot split into sub-groups; "
                          "expert parallelism needs mpi, gloo or nccl"));
}

void register_comm_backend(const std::string& name, CommFactory factory) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry()[name] = std::move(factory);
}

std::unique_ptr<Comm> make_comm(const CommOptions& options) { return make_comm(options, {}); }

std::unique_ptr<Comm> make_comm(const CommOptions& options, const CommChecks& checks) {
  const DistEnv env = detect_dist_env();
  std::string name = options.backend;
  if (name == "auto") {
    if (env.world_size == 1) name = "local";
    else if (options.cuda && nccl_built()) name = "nccl";
    else if (env.launcher == "openmpi" || env.launcher == "pmix") name = "mpi";
    else name = "gloo";
  }
  std::unique_ptr<Comm> comm;
  if (name == "local") {
    LOOM_CHECK_AS(ConfigError, env.world_size == 1, "[distributed] backend = \"local\" is one "
                  "process, but the launcher (", env.launcher, ") started ", env.world_size,
                  " ranks; use backend = \"auto\", \"mpi\" or \"gloo\"");
    comm = std::make_unique<LocalComm>(env.local_rank);
  } else if (name == "mpi") {
    comm = make_mpi_comm(options, checks);
    LOOM_CHECK_AS(ConfigError, comm->world_size() == env.world_size, "[distributed] backend = "
                  "\"mpi\" sees ", comm->world_size(), " rank(s) but the launcher (",
                  env.launcher, ") started ", env.world_size,
                  "; launch with mpirun (or srun with PMI) to use mpi, or use gloo");
  } else if (name == "gloo") {
    comm = make_gloo_comm(options, env, checks);
  } else if (name == "nccl") {
    comm = make_nccl_comm(options, env, checks);
  } else {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry().find(name);
    if (it == registry().end()) {
      std::string known = "local, mpi, gloo, nccl";
      for (const auto& [key, factory] : registry()) known += ", " + key;
      throw ConfigError(detail::cat("[distributed] backend '", name,
                                    "' is not built into this loom; available: ", known));
    }
    comm = it->second(options);
  }
  return comm;
}

}  // namespace loom
