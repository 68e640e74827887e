#include "meshtrain/comm/runtime.h"

#include "meshtrain/comm/backend/mpi/mpi_communicator.h"
#include "meshtrain/comm/backend/mpi/mpi_types.h"
#include "meshtrain/comm/watchdog.h"
#include "meshtrain/util/fatal_signal.h"

#include <torch/cuda.h>

#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>

namespace meshtrain::comm {

namespace {

std::atomic<bool> runtime_alive{false};
std::atomic<int> live_local_size{1};
std::atomic<int> live_local_rank{0};

// Ends the job after the watchdog printed its line; if MPI_Abort itself hangs,
// a timer ends this process anyway.
void abort_job(int code) {
  std::thread([code] {
    std::this_thread::sleep_for(std::chrono::seconds(10));
    std::_Exit(code);
  }).detach();
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long parsed = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || parsed < 0) {
    throw CommError(std::string(name) + "='" + v + "' is not a non-negative integer");
  }
  return static_cast<int>(parsed);
}

}  // namespace

Runtime::Runtime(int* argc, char*** argv, CommOptions options) {
  if (runtime_alive.exchange(true)) throw CommError("a meshtrain Runtime already exists in this process");
  try {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = MPI_THREAD_SINGLE;
    if (initialized) {
      MPI_Query_thread(&provided);
    } else {
      // The compute threads fill every core, so a rank waiting inside MPI must
      // yield its core rather than spin on it, or it slows the backward pass
      // its all-reduce is meant to overlap (measured: docs/BENCHMARKS.md). Set
      // here, before Open MPI reads it, so that ranks srun or mpirun start
      // directly yield too; a value set outside wins.
      setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
      // What a crash inside it names until Open MPI's own handlers go in (Note [Fatal signals]).
      WatchdogContext starting("MPI_Init_thread");
      mpi::check(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread", "");
      owns_mpi_ = true;
    }
    if (provided < MPI_THREAD_MULTIPLE) {
      throw CommError("MPI provides thread level " + std::to_string(provided) +
                      " but meshtrain needs MPI_THREAD_MULTIPLE (use an MPI built with thread support, "
                      "e.g. Debian's Open MPI)");
    }
    Watchdog::instance().set_abort_handler([](const std::string&) { abort_job(kWatchdogExitCode); });

    MPI_Comm world = MPI_COMM_NULL;
    mpi::check(MPI_Comm_dup(MPI_COMM_WORLD, &world), "MPI_Comm_dup", "");
    world_ = MpiCommunicator::adopt(world, "world", options);
    // Taken back from MPI_Init's handlers, with the world rank (Note [Fatal signals]).
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    util::install_fatal_signal_report("rank " + std::to_string(world_->rank()) + " on " + host);

    MPI_Comm node = MPI_COMM_NULL;
    mpi::check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_->rank(), MPI_INFO_NULL, &node),
               "MPI_Comm_split_type", "");
    int node_rank = 0;
    MPI_Comm_rank(node, &node_rank);
    MPI_Comm_size(node, &local_size_);
    MPI_Comm_free(&node);
    local_rank_ = env_int("LOCAL_RANK", node_rank);
    live_local_size = local_size_;
    live_local_rank = local_rank_;
  } catch (...) {
    runtime_alive = false;
    throw;
  }
}

Runtime::~Runtime() {
  world_.reset();
  shutdown_all_mpi_communicators();
  if (owns_mpi_) {
    mpi::free_custom_ops();
    MPI_Finalize();
  }
  Watchdog::instance().set_abort_handler({});
  live_local_size = 1;
  live_local_rank = 0;
  runtime_alive = false;
}

at::Device device_for_local_rank(int local_rank) {
  const size_t devices = torch::cuda::device_count();
  if (devices == 0) return at::Device(at::kCPU);
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(local_rank % static_cast<int>(devices)));
}

at::Device Runtime::default_device() const { return device_for_local_rank(local_rank_); }

int node_local_size() { return live_local_size; }
int node_local_rank() { return live_local_rank; }

void Runtime::abort(int code, const std::string& message) const {
  // Errors from communicators already name the rank; say it once.
  std::string text = message;
  const std::string own = "rank " + std::to_string(rank()) + ": ";
  const size_t at = text.find(own);
  if (at != std::string::npos && at < 16) text.erase(at, own.size());  // after an "error: " prefix at most
  std::fprintf(stderr, "meshtrain: rank %d: %s\n", rank(), text.c_str());
  std::fflush(stderr);
  abort_job(code);
  std::_Exit(code);
}

}  // namespace meshtrain::comm
