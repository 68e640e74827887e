// meshtrain run -n N <subcommand ...>: start N local ranks of this executable through mpirun.
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"

#include <mpi.h>

#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <csignal>
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

std::vector<std::string> launch_command(int ranks, const Hosts& hosts, const std::vector<std::string>& args,
                                        bool open_mpi, bool root, const std::vector<std::string>& variables) {
  const char* mpirun = std::getenv("MESHTRAIN_MPIRUN");
  std::vector<std::string> command{mpirun && *mpirun ? mpirun : MESHTRAIN_MPIEXEC, "-np", std::to_string(ranks)};
  if (!hosts.hostfile.empty()) command.insert(command.end(), {"--hostfile", hosts.hostfile});
  if (!hosts.list.empty()) command.insert(command.end(), {"--host", hosts.list});
  if (open_mpi) {
    // On this host alone, more ranks than cores is fine for development runs.
    // On named hosts the slots are the user's: too few of them must fail.
    if (hosts.empty()) command.push_back("--oversubscribe");
    // Binding each rank to one core would serialise a rank's progress thread with its compute.
    command.insert(command.end(), {"--bind-to", "none"});
    for (const std::string& name : variables) command.insert(command.end(), {"-x", name});
    if (root) command.push_back("--allow-run-as-root");
  }
  command.push_back(self_executable());
  command.insert(command.end(), args.begin(), args.end());
  return command;
}

namespace {

// Note [Launcher output]
// meshtrain says what went wrong itself: an error every rank agreed on once
// (exit status 1 on every rank), an error of one rank naming it (then
// MPI_Abort). Open MPI adds banners about non-zero exit codes and MPI_Abort
// that only repeat it, so the launcher drops those dash-framed blocks (and
// their "more processes have sent help message" echoes) from mpirun's
// stderr and passes everything else — "mpirun noticed that process rank 1
// ... exited on signal 9 (Killed)" included — and mpirun's exit status.
bool repeats_meshtrain(const std::string& block) {
  for (const char* marker : {"non-zero exit code", "non-zero status", "MPI_ABORT was invoked"}) {
    if (block.find(marker) != std::string::npos) return true;
  }
  return false;
}

bool is_frame(const std::string& line) { return line.size() > 20 && line.find_first_not_of('-') == std::string::npos; }

pid_t child_pid = 0;

// Note [Ending a stuck mpirun]
// The watchdog's line comes first, then MPI_Abort; but an mpirun that cannot
// reach a host (a network partition) never finishes aborting and waits in
// "abort is already in progress" forever. So the launcher watches mpirun's
// stderr for the first watchdog line; if mpirun has not ended
// MESHTRAIN_LAUNCHER_ABORT_S seconds (default 30) later, it sends SIGTERM,
// then SIGKILL 5 s on, and exits with the watchdog's status (70), repeating
// the line as the cause. Remote daemons end when they lose mpirun.
std::atomic<bool> child_reaped{false};

void end_stuck_mpirun(std::string line) {
  const char* text = std::getenv("MESHTRAIN_LAUNCHER_ABORT_S");
  const double bound = text && *text ? std::max(0.0, std::atof(text)) : 30.0;
  std::this_thread::sleep_for(std::chrono::duration<double>(bound));
  if (child_reaped) return;
  std::fprintf(stderr, "meshtrain: mpirun has not ended the job %.0f s after the watchdog's report (a host it cannot "
               "reach?); ending it\n", bound);
  std::fflush(stderr);
  kill(child_pid, SIGTERM);
  for (int i = 0; i < 50 && !child_reaped; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  if (child_reaped) return;
  kill(child_pid, SIGKILL);
  if (line.rfind("meshtrain: ", 0) == 0) line.erase(0, 11);
  std::fprintf(stderr, "meshtrain: the job ended on a watchdog timeout: %s\n", line.c_str());
  std::fflush(stderr);
  std::_Exit(70);  // comm::kWatchdogExitCode
}

// Copies `fd` to stderr line by line without the repeating banners, and arms
// Note [Ending a stuck mpirun] at the first watchdog line.
void filter_stderr(int fd) {
  FILE* in = fdopen(fd, "r");
  if (!in) return;
  char* raw = nullptr;
  size_t capacity = 0;
  std::string block;
  bool framed = false, armed = false;
  while (getline(&raw, &capacity, in) > 0) {
    std::string line(raw);
    while (!line.empty() && line.back() == '\n') line.pop_back();
    if (!armed && line.rfind("meshtrain: rank ", 0) == 0 && line.find(": watchdog: ") != std::string::npos) {
      armed = true;
      std::thread(end_stuck_mpirun, line).detach();
    }
    if (is_frame(line)) {
      if (framed && !repeats_meshtrain(block)) std::fprintf(stderr, "%s\n%s%s\n", line.c_str(), block.c_str(), line.c_str());
      framed = !framed;
      block.clear();
      continue;
    }
    if (framed) {
      block += line + "\n";
      continue;
    }
    if (line.find("sent help message") != std::string::npos ||
        line.find("orte_base_help_aggregate") != std::string::npos) {
      continue;
    }
    std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  }
  if (framed) std::fprintf(stderr, "%s", block.c_str());
  free(raw);
  fclose(in);
}

void forward_signal(int signal) {
  if (child_pid > 0) kill(child_pid, signal);
}

// Note [Stopping a server under mpirun]
// mpirun meets SIGTERM by ending every rank, which would cut off the
// requests a server has in flight. So for `serve` the launcher passes Ctrl-C
// and SIGTERM on as SIGUSR2, which mpirun forwards to the ranks as it is;
// serve takes it as its signal to drain (rank 0), then tells the group to stop.
void forward_as_drain(int) {
  if (child_pid > 0) kill(child_pid, SIGUSR2);
}

// Note [Stopping ranks under mpirun]
// For `train` likewise: the first Ctrl-C or SIGTERM reaches the ranks as
// SIGUSR2, their request to finish the step and save (Note [Preemption]);
// a second one is passed on as it is, and mpirun ends the ranks at once.
volatile sig_atomic_t stops_forwarded = 0;

void forward_as_preempt(int signal) {
  if (child_pid <= 0) return;
  if (stops_forwarded++ == 0) {
    static const char said[] = "meshtrain: stopping: the ranks finish their step and save a checkpoint "
                               "(Ctrl-C or SIGTERM again to stop at once)\n";
    (void)!write(STDERR_FILENO, said, sizeof said - 1);
    kill(child_pid, SIGUSR2);
  } else {
    kill(child_pid, signal);
  }
}

// Note [Orphaned ranks]
// A launcher killed with SIGKILL (a job scheduler's last word, an OOM kill)
// cannot pass anything on, and mpirun and its ranks used to train on with no
// parent, writing the run folder a requeued job then also wrote. So mpirun
// starts with a parent-death signal: when the launcher dies, however, the
// kernel sends mpirun what a first Ctrl-C would have (SIGUSR2 for train and
// serve: the ranks save or drain and exit; SIGTERM otherwise). Ranks that
// still run (mpirun itself killed with SIGKILL) hold the run folder's lock,
// so a second run on it is refused by name (Note [Run lock]).

}  // namespace

namespace {

// The variables every rank must share (Note [Job environment]) and the thread
// count, when set here; Open MPI passes OMPI_MCA_* on by itself.
std::vector<std::string> passed_variables() {
  std::vector<std::string> names;
  for (char** entry = environ; entry && *entry; ++entry) {
    const std::string text(*entry);
    const std::string name = text.substr(0, text.find('='));
    if (name.rfind("MESHTRAIN_", 0) == 0 || name == "OMP_NUM_THREADS") names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

void check_hosts(const Hosts& hosts) {
  if (!hosts.hostfile.empty() && !hosts.list.empty()) {
    throw std::invalid_argument("run: give --hostfile or --hosts, not both");
  }
  if (!hosts.hostfile.empty() && access(hosts.hostfile.c_str(), R_OK) != 0) {
    throw std::invalid_argument("run --hostfile " + hosts.hostfile + ": " + std::strerror(errno) +
                                " (one host per line, e.g. `hostA slots=2`)");
  }
}

}  // namespace

[[noreturn]] int run_launcher(int ranks, const Hosts& hosts, const std::vector<std::string>& args) {
  if (ranks < 1) throw std::invalid_argument("run -n needs at least 1 rank, got " + std::to_string(ranks));
  if (args.empty()) throw std::invalid_argument("run -n N needs a subcommand to run, e.g. `meshtrain run -n 2 selfcheck`");
  check_hosts(hosts);
  // The compute threads fill every core, so a rank waiting inside MPI must yield
  // its core rather than spin on it, or it slows the backward pass that its
  // all-reduce is meant to overlap (measured: docs/BENCHMARKS.md). Open MPI
  // forwards OMPI_MCA_* variables to every rank.
  setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
  const std::vector<std::string> command =
      launch_command(ranks, hosts, args, is_open_mpi(), geteuid() == 0, passed_variables());
  // Each rank sets its threads to its host's cores / that host's ranks (apps/command.cpp).
  const char* threads = std::getenv("OMP_NUM_THREADS");
  std::fprintf(stderr, "meshtrain: launching %d ranks%s, %s:", ranks,
               hosts.empty() ? "" : (" on " + (hosts.list.empty() ? "the hosts of " + hosts.hostfile : hosts.list)).c_str(),
               threads ? ("OMP_NUM_THREADS=" + std::string(threads) + " threads each").c_str()
                       : "threads per rank = its host's cores / its host's ranks");
  for (const auto& word : command) std::fprintf(stderr, " %s", word.c_str());
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  std::vector<char*> argv;
  for (const auto& word : command) argv.push_back(const_cast<char*>(word.c_str()));
  argv.push_back(nullptr);
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) throw std::runtime_error(std::string("cannot create a pipe: ") + std::strerror(errno));
  const bool server = args.front() == "serve", trainer = args.front() == "train";
  const pid_t launcher = getpid();
  child_pid = fork();
  if (child_pid < 0) throw std::runtime_error(std::string("cannot fork: ") + std::strerror(errno));
  if (child_pid == 0) {
    // Note [Orphaned ranks]: the launcher's death stops mpirun as a first Ctrl-C would.
    prctl(PR_SET_PDEATHSIG, server || trainer ? SIGUSR2 : SIGTERM);
    if (getppid() != launcher) _exit(128 + SIGTERM);  // it died before the line above
    dup2(pipe_fds[1], STDERR_FILENO);
    close(pipe_fds[0]);
    close(pipe_fds[1]);
    execvp(argv[0], argv.data());
    std::fprintf(stderr, "meshtrain: cannot start %s: %s (install Open MPI: scripts/setup.sh)\n", argv[0],
                 std::strerror(errno));
    _exit(127);
  }
  close(pipe_fds[1]);
  // Ctrl-C and termination reach mpirun, which ends the ranks (a server drains, a trainer saves, first).
  void (*on_stop)(int) = server ? forward_as_drain : trainer ? forward_as_preempt : forward_signal;
  std::signal(SIGINT, on_stop);
  std::signal(SIGTERM, on_stop);
  filter_stderr(pipe_fds[0]);
  int status = 0;
  while (waitpid(child_pid, &status, 0) < 0 && errno == EINTR) {
  }
  child_reaped = true;
  std::fflush(stdout);
  if (WIFEXITED(status)) std::exit(WEXITSTATUS(status));
  std::exit(128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 1));
}

CommandPtr add_run(CLI::App& app) {
  auto ranks = std::make_shared<int>(0);
  auto hosts = std::make_shared<Hosts>();
  CLI::App* run = app.add_subcommand(
      "run", "Launch N ranks of meshtrain through mpirun, on this host or on others (--hostfile, --hosts). Passes every "
             "MESHTRAIN_* variable set here on to the ranks; each rank uses its host's cores / its host's ranks as "
             "threads. Plain mpirun and srun --mpi=pmix work too.");
  run->add_option("-n,--ranks", *ranks, "Number of ranks")->required()->check(CLI::PositiveNumber);
  run->add_option("--hostfile", hosts->hostfile, "Open MPI hostfile: a line per host, e.g. `hostA slots=2`");
  run->add_option("--hosts", hosts->list, "Hosts and their slots, e.g. hostA:2,hostB:2");
  run->prefix_command();  // everything after the options is the command every rank runs
  run->footer("Examples:\n  meshtrain run -n 4 bench comm --max-size 64M\n"
              "  meshtrain run -n 4 --hosts hostA:2,hostB:2 train --run.out=/shared/runs/a");
  return plain_command(run, [ranks, hosts, run] { return run_launcher(*ranks, *hosts, run->remaining()); });
}

}  // namespace meshtrain::apps
