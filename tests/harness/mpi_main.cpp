// gtest main for multi-rank tests, run as `mpirun -np N meshtrain_mpi_tests`.
// Every rank runs every test; rank 0 prints the usual gtest output, other ranks
// print only their failures (prefixed with the rank). After each test the ranks
// agree on its outcome, so a failure on any rank fails the test on all of them
// and every rank exits with the same status.
//
// Built with MESHTRAIN_TEST_NEEDS_CUDA (the CUDA tests), the binary first looks
// for a GPU: with none it prints why and exits 77, which CTest reports as
// skipped; `--probe` only does that check (exit 0 when a GPU is there), so a
// launcher can ask before starting ranks.
#include "tests/harness/mpi_env.h"

#include "meshtrain/util/files.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#ifdef MESHTRAIN_TEST_NEEDS_CUDA
#include <torch/cuda.h>
#endif

#include <cstdio>
#include <cstring>
#include <optional>
#include <sstream>

namespace meshtrain::testing {

namespace {
std::optional<comm::Runtime> the_runtime;
}

comm::Runtime& runtime() { return *the_runtime; }

std::string shared_temp_directory(const std::string& prefix) {
  std::string path;
  if (world()->rank() == 0) path = util::make_temp_directory(prefix);
  at::Tensor length = at::full({1}, static_cast<int64_t>(path.size()), at::kLong);
  world()->broadcast(length, 0).wait();
  at::Tensor bytes = at::zeros({length.item<int64_t>()}, at::kByte);
  if (world()->rank() == 0) std::memcpy(bytes.data_ptr(), path.data(), path.size());
  world()->broadcast(bytes, 0).wait();
  return std::string(static_cast<const char*>(bytes.data_ptr()), bytes.numel());
}

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                 result.line_number(), result.summary());
  }

 private:
  int rank_;
};

// Collective at the end of each test: every rank learns which ranks failed it.
class OutcomeAgreement : public ::testing::EmptyTestEventListener {
 public:
  void OnTestEnd(const ::testing::TestInfo& info) override {
    const auto& world = runtime().world();
    at::Tensor failed = at::zeros({world->size()}, at::kInt);
    failed[world->rank()] = info.result()->Failed() ? 1 : 0;
    world->all_reduce(failed).wait();
    std::ostringstream ranks;
    int count = 0;
    for (int r = 0; r < world->size(); ++r) {
      if (failed[r].item<int>()) ranks << (count++ ? "," : "") << r;
    }
    if (count && !info.result()->Failed()) {
      ADD_FAILURE() << "failed on rank(s) " << ranks.str();
    }
    if (count && world->rank() == 0) {
      std::fprintf(stderr, "[  FAILED  ] %s.%s on rank(s) %s of %d\n", info.test_suite_name(), info.name(),
                   ranks.str().c_str(), world->size());
    }
  }
};

}  // namespace
}  // namespace meshtrain::testing

int main(int argc, char** argv) {
#ifdef MESHTRAIN_TEST_NEEDS_CUDA
  if (!torch::cuda::is_available()) {
    std::printf("SKIPPED: no CUDA device is visible (torch::cuda::is_available() is false); the CUDA tests need a GPU\n");
    return 77;
  }
  if (argc > 1 && std::strcmp(argv[1], "--probe") == 0) return 0;
#endif
  ::testing::InitGoogleTest(&argc, argv);
  using meshtrain::testing::the_runtime;
  try {
    the_runtime.emplace(&argc, &argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshtrain_mpi_tests: cannot start the MPI runtime: %s\n", e.what());
    return 2;
  }
  at::set_num_threads(1);
  const int rank = the_runtime->rank();
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new meshtrain::testing::RankFailurePrinter(rank));
  }
  listeners.Append(new meshtrain::testing::OutcomeAgreement());
  int local = RUN_ALL_TESTS();
  if (::testing::UnitTest::GetInstance()->test_to_run_count() == 0) {
    if (rank == 0) std::fprintf(stderr, "meshtrain_mpi_tests: no test matches the filter; nothing was checked\n");
    local = 1;
  }
  at::Tensor failed = at::full({1}, local == 0 ? 0 : 1, at::kInt);
  the_runtime->world()->all_reduce(failed).wait();
  const int failing_ranks = failed.item<int>();
  if (rank == 0 && failing_ranks) {
    std::fprintf(stderr, "meshtrain_mpi_tests: %d of %d ranks had failures\n", failing_ranks, the_runtime->size());
  }
  the_runtime.reset();
  return failing_ranks ? 1 : 0;
}
