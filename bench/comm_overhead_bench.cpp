// Google Benchmark micro-benchmarks of the bookkeeping meshtrain adds around each
// op, on one rank (no launcher): validation, numbering, stats and the Work of a
// collective on a 1-rank communicator (completed on the caller's thread, see
// Note [One-rank communicators]) against the raw MPI_Allreduce on the same
// buffer; 16 async all_reduces on a 1-rank communicator; the desync signature;
// mesh group arithmetic. The multi-rank hand-off cost is in `meshtrain bench comm`.
#include "meshtrain/comm/backend/mpi/mpi_communicator.h"
#include "meshtrain/comm/runtime.h"
#include "meshtrain/mesh/mesh_layout.h"

#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <mpi.h>

#include <memory>

namespace {

std::unique_ptr<meshtrain::comm::Runtime> runtime;

void BM_AllReduceThroughCommunicator(benchmark::State& state) {
  at::Tensor x = at::ones({state.range(0)});
  auto& world = *runtime->world();
  for (auto _ : state) world.all_reduce(x).wait();
  state.SetBytesProcessed(state.iterations() * x.nbytes());
}
BENCHMARK(BM_AllReduceThroughCommunicator)->Arg(1)->Arg(1 << 10)->Arg(1 << 20)->UseRealTime();

void BM_AllReduceRawMpi(benchmark::State& state) {
  at::Tensor x = at::ones({state.range(0)});
  const int count = static_cast<int>(x.numel());
  for (auto _ : state) MPI_Allreduce(MPI_IN_PLACE, x.data_ptr(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  state.SetBytesProcessed(state.iterations() * x.nbytes());
}
BENCHMARK(BM_AllReduceRawMpi)->Arg(1)->Arg(1 << 10)->Arg(1 << 20)->UseRealTime();

void BM_SixteenAsyncOpsThenWait(benchmark::State& state) {
  std::vector<at::Tensor> xs;
  for (int i = 0; i < 16; ++i) xs.push_back(at::ones({256}));
  auto& world = *runtime->world();
  for (auto _ : state) {
    std::vector<meshtrain::comm::Work> works;
    for (auto& x : xs) works.push_back(world.all_reduce(x));
    meshtrain::comm::wait_all(works);
  }
  state.SetItemsProcessed(state.iterations() * 16);
}
BENCHMARK(BM_SixteenAsyncOpsThenWait)->UseRealTime();

void BM_OpSignature(benchmark::State& state) {
  meshtrain::comm::Op op;
  op.kind = meshtrain::comm::OpKind::kAllReduce;
  op.input = op.output = at::ones({64, 64});
  for (auto _ : state) benchmark::DoNotOptimize(meshtrain::comm::OpSignature::of(op));
}
BENCHMARK(BM_OpSignature);

void BM_MeshGroupRanks(benchmark::State& state) {
  const auto layout = meshtrain::mesh::MeshLayout::from_degrees({{"pp", 4}, {"dp", 8}, {"tp", 8}}, 256);
  int rank = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(layout.group_ranks(rank, {"dp", "tp"}));
    rank = (rank + 1) % 256;
  }
}
BENCHMARK(BM_MeshGroupRanks);

}  // namespace

int main(int argc, char** argv) {
  runtime = std::make_unique<meshtrain::comm::Runtime>(&argc, &argv);
  at::set_num_threads(1);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  runtime.reset();
  return 0;
}
