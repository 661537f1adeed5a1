// The Comm backend registry and the `local` backend (one rank: every collective is a copy).
#include "loom/comm.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <map>
#include <mutex>

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
  std::string backend() const override { return "local"; }
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  int local_rank() const override { return 0; }
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
  void barrier() override {}

 private:
  static std::shared_ptr<Work> done() { return std::make_shared<DoneWork>(); }
  static void check_same(const at::Tensor& output, const at::Tensor& input, const char* op) {
    LOOM_CHECK(output.numel() == input.numel(), op, ": output has ", output.numel(),
               " elements, input ", input.numel(), "; with one rank they must be equal");
  }
};

std::mutex registry_mutex;
std::map<std::string, CommFactory>& registry() {
  static std::map<std::string, CommFactory> factories{
      {"local", [](const CommOptions&) { return std::make_unique<LocalComm>(); }}};
  return factories;
}

}  // namespace

void register_comm_backend(const std::string& name, CommFactory factory) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry()[name] = std::move(factory);
}

std::unique_ptr<Comm> make_comm(const CommOptions& options) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  std::string name = options.backend;
  if (name == "auto") {
    // Launched as several processes (mpirun, srun, torchrun, loom-launch) but no multi-process
    // backend is built in: say so instead of training N unrelated copies.
    for (const char* var : {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}) {
      const char* value = std::getenv(var);
      if (value && std::atoi(value) > 1 && registry().size() == 1)
        throw ConfigError(detail::cat(var, "=", value, " says this is one of several ranks, but "
                                      "this loom has only the 'local' backend; build it with a "
                                      "multi-process backend (mpi, gloo, nccl) or run one process"));
    }
    name = registry().count("mpi") && std::getenv("OMPI_COMM_WORLD_SIZE") ? "mpi" : "local";
    if (registry().count("gloo") && std::getenv("WORLD_SIZE")) name = "gloo";
  }
  auto it = registry().find(name);
  if (it == registry().end()) {
    std::string known;
    for (const auto& [key, factory] : registry()) known += (known.empty() ? "" : ", ") + key;
    throw ConfigError(detail::cat("[distributed] backend '", name,
                                  "' is not built into this loom; available: ", known));
  }
  return it->second(options);
}

}  // namespace loom
