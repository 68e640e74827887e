// meshtrain run -n N <subcommand ...>: start N local ranks of this executable through mpirun.
#include "meshtrain/apps/commands.h"

#include <mpi.h>

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifndef MESHTRAIN_MPIEXEC
#define MESHTRAIN_MPIEXEC "mpirun"
#endif

namespace meshtrain::apps {

namespace {

bool is_open_mpi() {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  MPI_Get_library_version(version, &length);  // allowed before MPI_Init
  return std::string(version, length).find("Open MPI") != std::string::npos;
}

std::string self_executable() {
  std::vector<char> path(4096);
  const ssize_t n = readlink("/proc/self/exe", path.data(), path.size() - 1);
  if (n <= 0) throw std::runtime_error("cannot find this executable's path (/proc/self/exe)");
  return std::string(path.data(), n);
}

}  // namespace

std::vector<std::string> launch_command(int ranks, const std::vector<std::string>& args, bool open_mpi, bool root) {
  std::vector<std::string> command{MESHTRAIN_MPIEXEC, "-np", std::to_string(ranks)};
  if (open_mpi) {
    // More ranks than cores is fine for development runs; binding each rank to
    // one core would serialise a rank's progress thread with its compute.
    command.insert(command.end(), {"--oversubscribe", "--bind-to", "none", "-x", "OMP_NUM_THREADS"});
    // Quiet: meshtrain says what went wrong itself (once, or naming the rank);
    // mpirun's banners about exit codes and MPI_Abort would only repeat it.
    command.push_back("--quiet");
    if (root) command.push_back("--allow-run-as-root");
  }
  command.push_back(self_executable());
  command.insert(command.end(), args.begin(), args.end());
  return command;
}

[[noreturn]] int run_launcher(int ranks, const std::vector<std::string>& args) {
  if (ranks < 1) throw std::invalid_argument("run -n needs at least 1 rank, got " + std::to_string(ranks));
  if (args.empty()) throw std::invalid_argument("run -n N needs a subcommand to run, e.g. `meshtrain run -n 2 selfcheck`");
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = std::max(1, cores / ranks);
  setenv("OMP_NUM_THREADS", std::to_string(threads).c_str(), /*overwrite=*/0);
  // The compute threads fill every core, so a rank waiting inside MPI must yield
  // its core rather than spin on it, or it slows the backward pass that its
  // all-reduce is meant to overlap (measured: docs/BENCHMARKS.md). Open MPI
  // forwards OMPI_MCA_* variables to every rank.
  setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
  const std::vector<std::string> command = launch_command(ranks, args, is_open_mpi(), geteuid() == 0);
  std::fprintf(stderr, "meshtrain: launching %d ranks, %s threads each:", ranks, std::getenv("OMP_NUM_THREADS"));
  for (const auto& word : command) std::fprintf(stderr, " %s", word.c_str());
  std::fprintf(stderr, "\n");
  std::vector<char*> argv;
  for (const auto& word : command) argv.push_back(const_cast<char*>(word.c_str()));
  argv.push_back(nullptr);
  execvp(argv[0], argv.data());
  throw std::runtime_error(std::string("cannot start ") + argv[0] + ": " + std::strerror(errno) +
                           " (install Open MPI: scripts/setup.sh)");
}

}  // namespace meshtrain::apps
