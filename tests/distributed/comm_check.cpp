// Runs every collective of one backend on the ranks of a real multi-process job and checks
// each result against what a single process computes from all ranks' (deterministic) inputs.
// usage (under mpirun or loom-launch): loom_comm_check BACKEND
#include <ATen/ATen.h>

#include <iostream>

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

}  // namespace

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

    at::Tensor gathered = at::empty({chunk * world});
    comm->all_gather(gathered, input_of(rank, chunk))->wait();
    for (int r = 0; r < world; ++r)
      expect(at::equal(gathered.narrow(0, r * chunk, chunk), input_of(r, chunk)),
             "all_gather chunk " + std::to_string(r), rank);

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
