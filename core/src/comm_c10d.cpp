// The `gloo` (and, in CUDA builds, `nccl`) Comm backends: LibTorch's own c10d process groups
// with a TCPStore rendezvous at MASTER_ADDR:MASTER_PORT. Rank 0 binds the store's socket
// itself, to MASTER_ADDR only (loopback unless told otherwise).
//
// Note [Gloo headers]: the torch wheel ships ProcessGroupGloo.hpp but not the gloo headers it
// includes; Debian's libgloo-dev provides them. Only declarations are used from them: every
// gloo object is made and used inside libtorch (Options::create, createDeviceForHostname, the
// ProcessGroupGloo constructor and its virtual collectives), and libgloo itself is not linked,
// so no second copy of gloo's code enters the process.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "comm_backends.h"
#include "comm_trace.h"
#include "cuda_runtime.h"
#include "loom/error.h"
#include "loom/log.h"

namespace loom {

[[noreturn]] void comm_failure(int rank, const char* op, const std::string& why) {
  throw Error(detail::cat("rank ", rank, ": ", op, " failed: ", why,
                          " — a peer process died, or is unreachable; see that rank's log"));
}

int listen_on_master(const DistEnv& env) {
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  const std::string port = std::to_string(env.master_port);
  LOOM_CHECK_AS(ConfigError, getaddrinfo(env.master_addr.c_str(), port.c_str(), &hints, &found) == 0 && found,
                "MASTER_ADDR='", env.master_addr, "' does not resolve to an IPv4 address");
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  const int bound = ::bind(fd, found->ai_addr, found->ai_addrlen);
  const int error = errno;
  freeaddrinfo(found);
  if (bound != 0) {
    ::close(fd);
    throw ConfigError(detail::cat("rank 0 cannot listen on MASTER_ADDR:MASTER_PORT = ",
                                  env.master_addr, ":", env.master_port, ": ",
                                  std::strerror(error),
                                  error == EADDRINUSE ? "; the port is in use: choose another "
                                                        "(loom-launch --master-port, or MASTER_PORT)"
                                                      : "; is MASTER_ADDR an address of this host?"));
  }
  LOOM_CHECK_AS(ConfigError, ::listen(fd, 128) == 0, "cannot listen on ", env.master_addr, ":",
                env.master_port, ": ", std::strerror(errno));
  return fd;
}

namespace {

std::string without_backtrace(const std::exception& error) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&error)) return c10->what_without_backtrace();
  return error.what();
}

// Collective `seq` failed on this rank: the backend's words, then where the other ranks are
// (Note [Hang reports]).
[[noreturn]] void collective_failure(int rank, CollectiveTrace& trace, int64_t seq,
                                     const std::string& why) {
  const std::string where = trace.diagnose(seq);
  throw Error(detail::cat("rank ", rank, ": ", trace.describe(seq), " of group ", trace.group(),
                          " failed: ", why,
                          where.empty() ? " — a peer process died, or is unreachable; see that "
                                          "rank's log"
                                        : where));
}

// The rendezvous store as a TraceBoard: one key per rank under the group's prefix. Its own
// client connection, with a short timeout, so the poster thread never shares gloo's or NCCL's
// and a stopped store host costs a report seconds, not the collective timeout.
class StoreBoard final : public TraceBoard {
 public:
  StoreBoard(c10::intrusive_ptr<c10d::Store> store, std::string where)
      : store_(std::move(store)), where_(std::move(where)) {}
  void post(int rank, const std::string& line) override {
    try {
      store_->set(std::to_string(rank), std::vector<uint8_t>(line.begin(), line.end()));
    } catch (const std::exception& error) {
      throw Error(without_backtrace(error));
    }
  }
  std::optional<std::string> read(int rank) override {
    try {
      const std::string key = std::to_string(rank);
      if (!store_->check({key})) return std::nullopt;
      const std::vector<uint8_t> value = store_->get(key);
      return std::string(value.begin(), value.end());
    } catch (const std::exception& error) {
      throw Error(without_backtrace(error));
    }
  }
  std::string where() const override { return where_; }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::string where_;
};

class C10dWork final : public Work {
 public:
  C10dWork(c10::intrusive_ptr<c10d::Work> work, const char* op, int rank,
           std::chrono::milliseconds timeout, std::function<void()> finish,
           std::shared_ptr<CollectiveTrace> trace, int64_t seq)
      : work_(std::move(work)), op_(op), rank_(rank), timeout_(timeout),
        finish_(std::move(finish)), trace_(std::move(trace)), seq_(seq) {}
  ~C10dWork() override {
    // As MpiWork: a handle dropped unwaited still completes, and its finish step (avg's
    // divide, reduce-scatter's reduction) still lands in the output (Work's contract).
    if (!done_) {
      try {
        wait();
      } catch (...) {
      }
    }
  }
  void wait() override {
    if (done_) return;
    try {
      work_->wait(timeout_);
    } catch (const std::exception& error) {
      done_ = true;  // a failed collective is not waited for again (by the destructor)
      collective_failure(rank_, *trace_, seq_, without_backtrace(error));
    }
    done_ = true;
    trace_->finish(seq_);
    if (finish_) finish_();
  }
  bool completed() override {
    if (!done_ && work_->isCompleted()) wait();
    return done_;
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  const char* op_;
  int rank_;
  std::chrono::milliseconds timeout_;
  std::function<void()> finish_;
  std::shared_ptr<CollectiveTrace> trace_;
  int64_t seq_;
  bool done_ = false;
};

c10::intrusive_ptr<c10d::Store> rendezvous(const DistEnv& env, std::chrono::milliseconds timeout) {
  check_rendezvous_address(env);
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(env.master_port);
  options.isServer = env.rank == 0 && !env.agent_store;
  options.numWorkers = env.world_size;
  options.waitWorkers = !env.agent_store;
  options.timeout = timeout;
  options.useLibUV = false;
  if (options.isServer) options.masterListenFd = listen_on_master(env);
  try {
    return c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
  } catch (const std::exception& error) {
    std::string why = error.what();
    if (const auto* c10 = dynamic_cast<const c10::Error*>(&error)) why = c10->what_without_backtrace();
    throw Error(detail::cat(
        "rank ", env.rank, ": rendezvous at ", env.master_addr, ":", env.master_port,
        " failed within ", timeout.count() / 1000.0, " s: ", why,
        env.rank == 0 ? "; did all WORLD_SIZE=" + std::to_string(env.world_size) +
                            " ranks start? check WORLD_SIZE"
                      : "; is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?"));
  }
}

// Makes a process group of `size` ranks over `store` (the world's, or a split's prefix).
using BackendFactory = std::function<c10::intrusive_ptr<c10d::Backend>(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size)>;

// What a group needs for its collective trace (Note [Hang reports]): the trace store client
// (null when it could not connect: the trace then keeps its ring but asks no peer) and
// whether to compare fingerprints before every collective.
struct TraceSetup {
  c10::intrusive_ptr<c10d::Store> store;
  std::string where;  // "the store at HOST:PORT"
  bool check_collectives = false;
};

std::shared_ptr<CollectiveTrace> make_trace(const TraceSetup& setup, const std::string& group,
                                            const DistEnv& env, std::chrono::milliseconds timeout) {
  std::unique_ptr<TraceBoard> board;
  if (setup.store) {
    // Keys of a restarted attempt (loom-launch --max-restarts keeps the agent's store) are
    // apart from the last attempt's.
    const std::string prefix = detail::cat("loom/trace/", env.restart_count, "/", group);
    board = std::make_unique<StoreBoard>(c10::make_intrusive<c10d::PrefixStore>(prefix, setup.store),
                                         setup.where);
  }
  return std::make_shared<CollectiveTrace>(group, env.rank, env.world_size, timeout,
                                           std::move(board));
}

class C10dComm final : public Comm {
 public:
  C10dComm(std::string name, c10::intrusive_ptr<c10d::Backend> backend, const DistEnv& env,
           std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Store> store,
           BackendFactory factory, TraceSetup trace_setup, const std::string& group)
      : name_(std::move(name)), backend_(std::move(backend)), env_(env), timeout_(timeout),
        store_(std::move(store)), factory_(std::move(factory)),
        trace_setup_(std::move(trace_setup)), trace_(make_trace(trace_setup_, group, env_, timeout_)) {}
  std::string backend() const override { return name_; }
  int rank() const override { return env_.rank; }
  int world_size() const override { return env_.world_size; }
  int local_rank() const override { return env_.local_rank; }
  int local_world_size() const override { return env_.local_world_size; }
  c10::Device device() const override {
    if (name_ != "nccl") return c10::Device(c10::kCPU);
    // The engine made this rank's GPU current before the first collective (activate_device).
    return c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice();
  }

  std::shared_ptr<Work> all_reduce(at::Tensor& tensor, ReduceOp op) override {
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = to_c10d(op);
    const int world = env_.world_size;
    return run({"all_reduce", static_cast<int64_t>(op), tensor.numel(), tensor.scalar_type()},
               [&] { return backend_->allreduce(tensors, options); },
               [tensor, op, world]() mutable {
                 if (op == ReduceOp::avg) tensor.div_(world);
               });
  }
  std::shared_ptr<Work> reduce_scatter(at::Tensor& output, const at::Tensor& input,
                                       ReduceOp op) override {
    LOOM_CHECK(input.numel() == output.numel() * env_.world_size, "reduce_scatter: input has ",
               input.numel(), " elements, needs world_size x output = ",
               output.numel() * env_.world_size);
    LOOM_CHECK(output.is_contiguous() && input.scalar_type() == output.scalar_type(),
               "reduce_scatter: output must be contiguous and of the input's dtype (",
               input.scalar_type(), "), got ", output.scalar_type());
    at::Tensor in = input.contiguous().view(-1), out = output.view(-1);
    const int world = env_.world_size;
    const CollectiveCall call{"reduce_scatter", static_cast<int64_t>(op), input.numel(),
                              input.scalar_type()};
    if (name_ == "nccl") {
      c10d::ReduceScatterOptions options;
      options.reduceOp = to_c10d(op);
      return run(call, [&] { return backend_->_reduce_scatter_base(out, in, options); },
                 [output, op, world]() mutable {
                   if (op == ReduceOp::avg) output.div_(world);
                 });
    }
    // Note [Gloo reduce-scatter]: LibTorch 2.11's gloo reduce-scatters (reduce_scatter,
    // _reduce_scatter_base, reduce_scatter_tensor_coalesced) all all-reduce the whole buffer
    // (measured: the same loopback bytes as all_reduce). An all-to-all sends chunk j of every
    // rank straight to rank j — (world-1)/world of the input per rank, half an all-reduce's
    // traffic — and the world received chunks are reduced here on wait(), in fp32 for
    // bf16/fp16 (one rounding, and no half-type reduction needed from gloo).
    at::Tensor received = at::empty_like(in);
    std::vector<int64_t> splits;  // empty: equal chunks
    return run(call, [&] { return backend_->alltoall_base(received, in, splits, splits); },
               [output, received, op, world]() mutable {
                 output.copy_(reduce_chunks(received.view({world, -1}), op).view(output.sizes()));
               });
  }
  std::shared_ptr<Work> all_gather(at::Tensor& output, const at::Tensor& input) override {
    LOOM_CHECK(output.numel() == input.numel() * env_.world_size, "all_gather: output has ",
               output.numel(), " elements, needs world_size x input");
    at::Tensor in = input;
    return run({"all_gather", -1, input.numel(), input.scalar_type()},
               [&] { return backend_->_allgather_base(output, in); }, {});
  }
  std::shared_ptr<Work> broadcast(at::Tensor& tensor, int root) override {
    LOOM_CHECK(root >= 0 && root < env_.world_size, "broadcast root ", root, " is not a rank");
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    return run({"broadcast", root, tensor.numel(), tensor.scalar_type()},
               [&] { return backend_->broadcast(tensors, options); }, {});
  }
  std::shared_ptr<Work> all_to_all(at::Tensor& output, const at::Tensor& input) override {
    LOOM_CHECK(input.numel() == output.numel() && input.numel() % env_.world_size == 0,
               "all_to_all: input and output need the same numel, divisible by the world size");
    at::Tensor in = input;
    std::vector<int64_t> splits;
    return run({"all_to_all", -1, input.numel(), input.scalar_type()},
               [&] { return backend_->alltoall_base(output, in, splits, splits); }, {});
  }
  std::shared_ptr<Work> all_to_all_rows(at::Tensor& output, const at::Tensor& input,
                                        const std::vector<int64_t>& send_rows,
                                        const std::vector<int64_t>& recv_rows) override {
    check_rows(output, input, send_rows, recv_rows, env_.world_size, "all_to_all_rows");
    at::Tensor in = input.contiguous();
    std::vector<int64_t> out_splits = recv_rows, in_splits = send_rows;
    return run({"all_to_all_rows", -1, -1, input.scalar_type()},
               [&] { return backend_->alltoall_base(output, in, out_splits, in_splits); },
               [in] {});
  }
  void barrier() override {
    run({"barrier", -1, 0, c10::ScalarType::Undefined}, [&] { return backend_->barrier(); },
        {})->wait();
  }
  std::unique_ptr<Comm> split(int color, int key) override {
    // Every rank learns every (color, key), so each knows its group's members and its rank
    // there; the group's store keys live under a prefix of their own.
    at::Tensor mine = at::tensor({static_cast<int64_t>(color), static_cast<int64_t>(key)},
                                 at::kLong).to(device());
    at::Tensor all = at::empty({2 * env_.world_size}, mine.options());
    all_gather(all, mine)->wait();
    const at::Tensor host = all.cpu();
    const int64_t* values = host.data_ptr<int64_t>();
    std::vector<std::pair<int64_t, int>> members;  // (key, rank) of my color
    for (int r = 0; r < env_.world_size; ++r)
      if (values[2 * r] == color) members.push_back({values[2 * r + 1], r});
    std::sort(members.begin(), members.end());
    int sub_rank = 0;
    for (size_t i = 0; i < members.size(); ++i)
      if (members[i].second == env_.rank) sub_rank = static_cast<int>(i);
    DistEnv sub = env_;
    sub.rank = sub_rank;
    sub.world_size = static_cast<int>(members.size());
    sub.local_rank = sub_rank;
    sub.local_world_size = std::min(env_.local_world_size, sub.world_size);
    const int split = splits_++;
    const std::string prefix = detail::cat("loom/split/", split, "/", color);
    auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, store_);
    try {
      auto group = factory_(store, sub.rank, sub.world_size);
      return std::make_unique<C10dComm>(name_, group, sub, timeout_, store, factory_,
                                        trace_setup_,
                                        detail::cat("split-", split, "-color-", color));
    } catch (const c10::Error& error) {
      comm_failure(env_.rank, "split", error.what_without_backtrace());
    }
  }

 private:
  static c10d::ReduceOp to_c10d(ReduceOp op) {
    switch (op) {
      case ReduceOp::max: return c10d::ReduceOp::MAX;
      case ReduceOp::min: return c10d::ReduceOp::MIN;
      default: return c10d::ReduceOp::SUM;  // avg: sum, then divide (gloo has no AVG)
    }
  }
  // chunks (world x n) -> n: the reduction of the rows; avg is the sum divided by the rows.
  static at::Tensor reduce_chunks(const at::Tensor& chunks, ReduceOp op) {
    switch (op) {
      case ReduceOp::max: return chunks.amax(0);
      case ReduceOp::min: return chunks.amin(0);
      default: break;
    }
    const bool half = chunks.scalar_type() == at::kBFloat16 || chunks.scalar_type() == at::kHalf;
    at::Tensor sum = half ? chunks.sum(0, false, at::kFloat) : chunks.sum(0);
    if (op == ReduceOp::avg) sum.div_(chunks.size(0));
    return sum;
  }
  std::shared_ptr<Work> run(const CollectiveCall& call,
                            const std::function<c10::intrusive_ptr<c10d::Work>()>& start,
                            std::function<void()> finish) {
    const int64_t seq = trace_->begin(call);
    if (trace_setup_.check_collectives) check_call(seq);
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = start();
    } catch (const std::exception& error) {
      collective_failure(env_.rank, *trace_, seq, without_backtrace(error));
    }
    return std::make_shared<C10dWork>(std::move(work), call.op, env_.rank, timeout_,
                                      std::move(finish), trace_, seq);
  }
  // [distributed] check_collectives: every rank's fingerprint of collective `seq`, gathered
  // before it starts; a difference is an error naming both calls (Note [Hang reports]).
  void check_call(int64_t seq) {
    const auto mine = trace_->fingerprint(seq);
    at::Tensor local = at::tensor(std::vector<int64_t>(mine.begin(), mine.end()), at::kLong)
                           .to(device());
    at::Tensor all = at::empty({CollectiveTrace::kFingerprint * env_.world_size}, local.options());
    try {
      backend_->_allgather_base(all, local)->wait(timeout_);
    } catch (const std::exception& error) {
      collective_failure(env_.rank, *trace_, seq,
                         "its check_collectives fingerprint exchange failed: " +
                             without_backtrace(error));
    }
    const at::Tensor host = all.cpu();
    trace_->check_fingerprints(seq, host.data_ptr<int64_t>());
  }

  std::string name_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  DistEnv env_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Store> store_;
  BackendFactory factory_;
  TraceSetup trace_setup_;
  std::shared_ptr<CollectiveTrace> trace_;
  int splits_ = 0;  // splits made so far: every rank counts the same (collective order)
};

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0;
}

// The local address this host reaches `host` from (the interface its route to rank 0 leaves
// by), or "" when that cannot be found: a UDP socket "connected" to it sends nothing but picks
// the route, and getsockname names the source address.
std::string local_address_towards(const std::string& host) {
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  if (getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || !found) return "";
  std::string address;
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t length = sizeof local;
    char text[INET_ADDRSTRLEN] = {};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0 &&
        ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof text))
      address = text;
  }
  if (fd >= 0) ::close(fd);
  freeaddrinfo(found);
  return address;
}

// The trace's own client of the rendezvous store, once the store is up (Note [Hang reports]).
TraceSetup trace_setup(const DistEnv& env, const CommChecks& checks) {
  TraceSetup setup;
  setup.check_collectives = checks.check_collectives;
  setup.where = detail::cat("the rendezvous store at ", env.master_addr, ":", env.master_port);
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(env.master_port);
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = std::chrono::seconds(3);
  options.useLibUV = false;
  try {
    setup.store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
  } catch (const std::exception& error) {
    log::warn("rank ", env.rank, ": the collective trace cannot reach ", setup.where, " (",
              without_backtrace(error), "); a hang report will not name the other ranks");
  }
  return setup;
}

}  // namespace

std::unique_ptr<Comm> make_gloo_comm(const CommOptions& options, const DistEnv& env,
                                     const CommChecks& checks) {
  auto store = rendezvous(env, options.timeout);
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
  // Each rank's gloo device: loopback when the job is on one host; else GLOO_SOCKET_IFNAME's
  // interface when the user names one; else the address this host reaches rank 0 from (a
  // hostname may resolve to an address the other hosts cannot reach, e.g. 127.0.1.1).
  const std::string towards_master =
      is_loopback(env.master_addr) || std::getenv("GLOO_SOCKET_IFNAME")
          ? std::string()
          : local_address_towards(env.master_addr);
  gloo_options->devices = {is_loopback(env.master_addr)
                               ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                           : !towards_master.empty()
                               ? c10d::ProcessGroupGloo::createDeviceForHostname(towards_master)
                               : c10d::ProcessGroupGloo::createDefaultDevice()};
  BackendFactory factory = [gloo_options](const c10::intrusive_ptr<c10d::Store>& on, int rank,
                                          int size) -> c10::intrusive_ptr<c10d::Backend> {
    return c10::make_intrusive<c10d::ProcessGroupGloo>(on, rank, size, gloo_options);
  };
  try {
    auto group = factory(store, env.rank, env.world_size);
    return std::make_unique<C10dComm>("gloo", group, env, options.timeout, store, factory,
                                      trace_setup(env, checks), "world");
  } catch (const c10::Error& error) {
    comm_failure(env.rank, "gloo set-up", error.what_without_backtrace());
  }
}

#ifdef LOOM_WITH_CUDA
bool nccl_built() { return true; }
std::unique_ptr<Comm> make_nccl_comm(const CommOptions& options, const DistEnv& env,
                                     const CommChecks& checks) {
  // ProcessGroupNCCL lives in LibTorch's CUDA half: Note [CUDA loaded on demand].
  const CudaRuntime* cuda = cuda_runtime();
  LOOM_CHECK_AS(ConfigError, cuda && at::hasCUDA(),
                "[distributed] backend = \"nccl\" needs CUDA devices, and none is visible (",
                "LibTorch's CUDA half is ", cuda_runtime_status(), "); use gloo or mpi on CPUs");
  auto store = rendezvous(env, options.timeout);
  const std::chrono::milliseconds timeout = options.timeout;
  BackendFactory factory = [cuda, timeout](const c10::intrusive_ptr<c10d::Store>& on, int rank,
                                           int size) -> c10::intrusive_ptr<c10d::Backend> {
    return cuda->make_nccl_backend(on, rank, size, timeout);
  };
  try {
    auto group = factory(store, env.rank, env.world_size);
    return std::make_unique<C10dComm>("nccl", group, env, options.timeout, store, factory,
                                      trace_setup(env, checks), "world");
  } catch (const c10::Error& error) {
    comm_failure(env.rank, "nccl set-up", error.what_without_backtrace());
  }
}
#else
bool nccl_built() { return false; }
std::unique_ptr<Comm> make_nccl_comm(const CommOptions&, const DistEnv&, const CommChecks&) {
  throw ConfigError("[distributed] backend = \"nccl\" is not built into this loom (a CPU "
                    "build); use gloo or mpi, or build against the CUDA LibTorch");
}
#endif

}  // namespace loom
