// Runs every collective of one backend (uneven all_to_all_rows and split included) on the ranks of a real multi-process job and checks
// each result against what a single process computes from all ranks' (deterministic) inputs.
// usage (under mpirun or loom-launch): loom_comm_check BACKEND
// With LOOM_TEST_MPI_MAX_COUNT=5 the mpi backend splits every collective into pieces of at most
// 5 elements (Note [MPI counts]); on gloo the traffic of reduce_scatter is also measured.
#include <ATen/ATen.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <sstream>

#include "loom/comm.h"
#include "loom/cpu.h"
#include "loom/error.h"

namespace {

// Rank r's input of n elements: distinct per rank and element.
at::Tensor input_of(int rank, int64_t n) {
  return at::arange(n, at::kFloat) * 0.5 + 100.0 * rank;
}

int failures = 0;
void expect(bool ok, const std::string& what, int rank) {
  if (!ok) {
    std::cerr << "rank " << rank << ": MISMATCH in " << what << "\n";
    ++failures;
  }
}

// Bytes received on the loopback interface so far (every rank of a one-host gloo job talks over
// it); -1 where /proc/net/dev cannot be read.
int64_t loopback_bytes() {
  std::ifstream in("/proc/net/dev");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string name;
    int64_t bytes = -1;
    if (fields >> name >> bytes && name == "lo:") return bytes;
  }
  return -1;
}

// reduce_scatter of every op and dtype against the reference reduced in fp64.
void check_reduce_scatter(loom::Comm& comm, int64_t n) {
  const int rank = comm.rank(), world = comm.world_size();
  const int64_t chunk = n / world;
  const std::pair<loom::ReduceOp, const char*> ops[] = {{loom::ReduceOp::sum, "sum"},
                                                        {loom::ReduceOp::avg, "avg"},
                                                        {loom::ReduceOp::max, "max"},
                                                        {loom::ReduceOp::min, "min"}};
  for (const auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    for (const auto& [op, name] : ops) {
      std::vector<at::Tensor> all;
      for (int r = 0; r < world; ++r) all.push_back(input_of(r, n).to(dtype).to(at::kDouble));
      const at::Tensor stacked = at::stack(all);
      at::Tensor expected = op == loom::ReduceOp::max   ? stacked.amax(0)
                            : op == loom::ReduceOp::min ? stacked.amin(0)
                                                        : stacked.sum(0);
      if (op == loom::ReduceOp::avg) expected /= world;
      expected = expected.narrow(0, rank * chunk, chunk);
      at::Tensor output = at::full({chunk}, -7.0, at::TensorOptions().dtype(dtype));
      comm.reduce_scatter(output, input_of(rank, n).to(dtype), op)->wait();
      const bool half = dtype == at::kBFloat16 || dtype == at::kHalf;
      expect(output.scalar_type() == dtype &&
                 at::allclose(output.to(at::kDouble), expected, half ? 0.01 : 1e-6,
                              half ? 0.5 : 1e-6),
             std::string("reduce_scatter ") + name + " " + c10::toString(dtype), rank);
    }
  }
}

// Gloo's reduce-scatter must move about half of what an all-reduce of the same buffer moves
// (Note [Gloo reduce-scatter]); an all-reduce-based one moves as much.
void check_gloo_traffic(loom::Comm& comm) {
  const int64_t n = int64_t{1} << 22;  // 16 MiB of fp32: large against stray loopback traffic
  at::Tensor input = input_of(comm.rank(), n), output = at::empty({n / comm.world_size()});
  comm.barrier();
  const int64_t start = loopback_bytes();
  comm.reduce_scatter(output, input, loom::ReduceOp::sum)->wait();
  comm.barrier();
  const int64_t middle = loopback_bytes();
  comm.all_reduce(input, loom::ReduceOp::sum)->wait();
  comm.barrier();
  const int64_t end = loopback_bytes();
  if (start < 0) return;
  const double ratio = double(middle - start) / double(end - middle);
  if (comm.rank() == 0)
    std::cout << "gloo reduce_scatter moved " << ratio << " x the bytes of all_reduce\n";
  expect(ratio < 0.75, "gloo reduce_scatter traffic (" + std::to_string(ratio) +
                           " x all_reduce's; an all-reduce-based one is 1)", comm.rank());
}

}  // namespace

// Rows rank `from` sends rank `to`: a count that differs by pair (zero for some), 3 values a
// row naming the pair and the row.
int64_t rows_between(int from, int to) { return (from + 2 * to) % 3; }
at::Tensor rows_of(int from, int to) {
  const int64_t rows = rows_between(from, to);
  return (at::arange(rows * 3, at::kFloat).view({rows, 3}) + 100 * from + 10000 * to);
}

// all_to_all_rows (the backend's own, and the base class's padded one), then split.
void check_rows_and_split(loom::Comm& comm) {
  const int rank = comm.rank(), world = comm.world_size();
  std::vector<int64_t> send(world), recv(world);
  std::vector<at::Tensor> pieces, expected;
  for (int j = 0; j < world; ++j) {
    send[j] = rows_between(rank, j);
    recv[j] = rows_between(j, rank);
    pieces.push_back(rows_of(rank, j));
    expected.push_back(rows_of(j, rank));
  }
  const at::Tensor input = at::cat(pieces), want = at::cat(expected);
  at::Tensor output = at::full_like(want, -1);
  comm.all_to_all_rows(output, input, send, recv)->wait();
  expect(at::equal(output, want), "all_to_all_rows (" + comm.backend() + ")", rank);
  at::Tensor padded = at::full_like(want, -1);
  comm.loom::Comm::all_to_all_rows(padded, input, send, recv)->wait();
  expect(at::equal(padded, want), "all_to_all_rows (any backend: padded all_to_all)", rank);

  // Odd and even ranks, each group ranked in reverse by its key.
  auto part = comm.split(rank % 2, -rank);
  std::vector<int> members;
  for (int r = world - 1; r >= 0; --r)
    if (r % 2 == rank % 2) members.push_back(r);
  const int me = static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
  expect(part->world_size() == static_cast<int>(members.size()) && part->rank() == me,
         "split: " + std::to_string(part->world_size()) + " ranks, rank " +
             std::to_string(part->rank()),
         rank);
  at::Tensor total = at::full({1}, static_cast<float>(rank));
  part->all_reduce(total, loom::ReduceOp::sum)->wait();
  float want_total = 0;
  for (int r : members) want_total += static_cast<float>(r);
  expect(total.item<float>() == want_total, "all_reduce within a split group", rank);
  at::Tensor ids = at::full({2}, static_cast<float>(rank));
  part->broadcast(ids, 0)->wait();
  expect(ids[0].item<float>() == static_cast<float>(members.front()), "broadcast within a split group", rank);
}

int main(int argc, char** argv) {
  try {
    loom::cpu::ensure_cpu_kernels_work();  // before any kernel or thread: loom/cpu.h
    loom::CommOptions options;
    options.backend = argc > 1 ? argv[1] : "auto";
    options.timeout = std::chrono::seconds(60);
    auto comm = loom::make_comm(options);
    const int rank = comm->rank(), world = comm->world_size();
    const int64_t n = 6 * world;

    at::Tensor sum = input_of(rank, n), expected_sum = at::zeros({n});
    at::Tensor mx = input_of(rank, n);
    for (int r = 0; r < world; ++r) expected_sum += input_of(r, n);
    comm->all_reduce(sum, loom::ReduceOp::sum)->wait();
    expect(at::allclose(sum, expected_sum), "all_reduce sum", rank);
    at::Tensor avg = input_of(rank, n);
    comm->all_reduce(avg, loom::ReduceOp::avg)->wait();
    expect(at::allclose(avg, expected_sum / world), "all_reduce avg", rank);
    comm->all_reduce(mx, loom::ReduceOp::max)->wait();
    expect(at::equal(mx, input_of(world - 1, n)), "all_reduce max", rank);
    at::Tensor half = input_of(rank, n).to(at::kBFloat16);
    comm->all_reduce(half, loom::ReduceOp::sum)->wait();
    expect(half.scalar_type() == at::kBFloat16 &&
               at::allclose(half.to(at::kFloat), expected_sum, 0.02, 1.0),
           "all_reduce bf16", rank);

    const int64_t chunk = n / world;
    at::Tensor scattered = at::empty({chunk});
    comm->reduce_scatter(scattered, input_of(rank, n), loom::ReduceOp::sum)->wait();
    expect(at::allclose(scattered, expected_sum.narrow(0, rank * chunk, chunk)),
           "reduce_scatter", rank);

    check_reduce_scatter(*comm, n);
    if (comm->backend() == "gloo") check_gloo_traffic(*comm);

    at::Tensor gathered = at::empty({chunk * world});
    comm->all_gather(gathered, input_of(rank, chunk))->wait();
    for (int r = 0; r < world; ++r)
      expect(at::equal(gathered.narrow(0, r * chunk, chunk), input_of(r, chunk)),
             "all_gather chunk " + std::to_string(r), rank);

    at::Tensor gathered16 = at::empty({chunk * world}, at::kBFloat16);
    comm->all_gather(gathered16, input_of(rank, chunk).to(at::kBFloat16))->wait();
    for (int r = 0; r < world; ++r)
      expect(at::equal(gathered16.narrow(0, r * chunk, chunk), input_of(r, chunk).to(at::kBFloat16)),
             "all_gather bf16 chunk " + std::to_string(r), rank);

    at::Tensor ids = at::arange(n, at::kLong) + 1000 * rank;
    comm->broadcast(ids, world - 1)->wait();
    expect(at::equal(ids, at::arange(n, at::kLong) + 1000 * (world - 1)), "broadcast", rank);

    // all_to_all: chunk j of rank r goes to rank j; rank j's chunk r comes from rank r.
    at::Tensor exchanged = at::empty({n});
    comm->all_to_all(exchanged, input_of(rank, n))->wait();
    for (int r = 0; r < world; ++r)
      expect(at::equal(exchanged.narrow(0, r * chunk, chunk),
                       input_of(r, n).narrow(0, rank * chunk, chunk)),
             "all_to_all chunk " + std::to_string(r), rank);

    check_rows_and_split(*comm);

    comm->barrier();
    if (failures == 0)
      std::cout << "rank " << rank << " of " << world << " (" << comm->backend()
                << "): every collective matches the reference\n";
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& error) {
    std::cerr << "loom_comm_check: " << error.what() << "\n";
    return 1;
  }
}
