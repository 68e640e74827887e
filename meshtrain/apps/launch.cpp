// meshtrain run -n N <subcommand ...>: start N ranks of this executable through mpirun, or srun in a Slurm
// allocation, and supervise them.
#include "meshtrain/apps/command.h"
#include "meshtrain/apps/commands.h"
#include "meshtrain/apps/launch_hosts.h"
#include "meshtrain/apps/launch_output.h"
#include "meshtrain/apps/launch_slurm.h"
#include "meshtrain/util/files.h"

#include <mpi.h>

#include <fcntl.h>
#include <poll.h>
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

}  // namespace

std::string self_executable() {
  std::vector<char> path(4096);
  const ssize_t n = readlink("/proc/self/exe", path.data(), path.size() - 1);
  if (n <= 0) throw std::runtime_error("cannot find this executable's path (/proc/self/exe)");
  return util::executable_now_at(std::string(path.data(), n));
}

std::string mpirun_path() {
  const char* mpirun = std::getenv("MESHTRAIN_MPIRUN");
  return mpirun && *mpirun ? mpirun : MESHTRAIN_MPIEXEC;
}

std::vector<std::string> launch_command(int ranks, const Hosts& hosts, const std::vector<std::string>& args,
                                        bool open_mpi, bool root, const std::vector<std::string>& variables) {
  std::vector<std::string> command{mpirun_path(), "-np", std::to_string(ranks)};
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

pid_t child_pid = 0;

// Note [Ending a stuck mpirun]
// The watchdog's line comes first, then MPI_Abort; but an mpirun that cannot
// reach a host (a network partition) never finishes aborting and waits in
// "abort is already in progress" forever. So the launcher watches mpirun's
// stderr for the first watchdog line; if mpirun has not ended
// MESHTRAIN_LAUNCHER_ABORT_S seconds (default 30) later, it sends SIGTERM,
// then SIGKILL 5 s on, and the job ends with the watchdog's status (70), the
// line repeated as the cause. The launcher polls mpirun's stderr and its exit
// together, so a pipe some process still holds cannot keep it waiting.
// Remote daemons end when they lose mpirun.
double abort_bound_seconds() {
  const char* text = std::getenv("MESHTRAIN_LAUNCHER_ABORT_S");
  return text && *text ? std::max(0.0, std::atof(text)) : 30.0;
}


// Note [Naming the stop signal]
// The ranks see a stop the launcher passes on as SIGUSR2; so that they can say
// which signal was sent, the launcher first writes its name to a file whose
// path every rank gets in MESHTRAIN_STOP_SIGNAL_FILE (Note [Job environment]).
// A rank on another host, which cannot read it, names SIGUSR2. A stop that
// comes before the ranks have set their handlers ends them (SIGUSR2's default
// action), which is before their first step: the launcher then exits 0 with
// "nothing to save". One that comes while mpirun is being started, before the
// launcher knows its process, is not passed on: each rank finds it in the file
// when it sets its handlers and stops after its first step, as if it had been.
// A launcher killed with SIGKILL leaves the file in TMPDIR.
int stop_name_fd = -1;

void write_stop_name(int signal) {
  // A line: a second signal inside this handler may write over the first, and the ranks read one word.
  const char* name = signal == SIGINT ? "SIGINT\n" : signal == SIGTERM ? "SIGTERM\n" : "SIGUSR2\n";
  if (stop_name_fd >= 0) (void)!pwrite(stop_name_fd, name, std::strlen(name), 0);
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
// mpirun runs in a process group of its own, reading no terminal: a Ctrl-C
// typed at the terminal goes to the launcher's group alone, which passes it
// on as above, instead of reaching mpirun too, which would end the job.
volatile sig_atomic_t stops_forwarded = 0;

void forward_as_preempt(int signal) {
  if (stops_forwarded == 0) write_stop_name(signal);
  if (child_pid <= 0) {  // before the first launch or between two (a restart): none is begun
    ++stops_forwarded;
    return;
  }
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

void remove_stop_name_file() {
  if (const char* path = std::getenv("MESHTRAIN_STOP_SIGNAL_FILE")) unlink(path);
}

// Note [Naming the stop signal]: the file, empty until a stop comes.
void open_stop_name_file() {
  const char* tmp = std::getenv("TMPDIR");
  std::string path = std::string(tmp && *tmp ? tmp : "/tmp") + "/meshtrain-stop-XXXXXX";
  stop_name_fd = mkostemp(path.data(), O_CLOEXEC);
  if (stop_name_fd < 0) return;  // the ranks then name SIGUSR2
  setenv("MESHTRAIN_STOP_SIGNAL_FILE", path.c_str(), 1);
  std::atexit(remove_stop_name_file);
}

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

namespace {

struct Launch {
  int status = 0;     // mpirun's exit status, 128 + signal, or 70 when ended stuck
  std::string cause;  // what ended it, when it failed: a watchdog line, a rank's death, the status
  bool hang = false;  // a watchdog timeout
  bool rank_died = false;
};

pid_t start_mpirun(const std::vector<std::string>& command, int stderr_fd, bool server, bool trainer) {
  std::vector<char*> argv;
  for (const auto& word : command) argv.push_back(const_cast<char*>(word.c_str()));
  argv.push_back(nullptr);
  const pid_t launcher = getpid();
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error(std::string("cannot fork: ") + std::strerror(errno));
  if (pid == 0) {
    // Note [Orphaned ranks]: the launcher's death stops mpirun as a first Ctrl-C would.
    prctl(PR_SET_PDEATHSIG, server || trainer ? SIGUSR2 : SIGTERM);
    if (getppid() != launcher) _exit(128 + SIGTERM);  // it died before the line above
    // Note [Stopping ranks under mpirun]: a terminal's Ctrl-C reaches the launcher only.
    setpgid(0, 0);
    const int null = open("/dev/null", O_RDONLY);
    if (null >= 0) dup2(null, STDIN_FILENO);  // a background group must not read the terminal
    std::signal(SIGPIPE, SIG_IGN);  // with the launcher gone, a write to its pipe fails instead of killing mpirun
    dup2(stderr_fd, STDERR_FILENO);
    execvp(argv[0], argv.data());
    std::fprintf(stderr, "meshtrain: cannot start %s: %s (install Open MPI: scripts/setup.sh)\n", argv[0],
                 std::strerror(errno));
    _exit(127);
  }
  setpgid(pid, 0);  // also here, so that no Ctrl-C comes between fork and the child's own call
  return pid;
}

// Runs mpirun once, passing its stderr on, until it exits (Note [Ending a stuck mpirun]).
Launch launch_once(const std::vector<std::string>& command, bool server, bool trainer) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) throw std::runtime_error(std::string("cannot create a pipe: ") + std::strerror(errno));
  child_pid = start_mpirun(command, pipe_fds[1], server, trainer);
  close(pipe_fds[1]);
  const std::string program = command.front().substr(command.front().rfind('/') + 1);  // mpirun or srun
  using Clock = std::chrono::steady_clock;
  const double bound = abort_bound_seconds();
  StderrFilter filter;
  Clock::time_point watchdog_seen{}, term_sent{};
  bool eof = false, exited = false, ended_stuck = false;
  int status = 0;
  char buffer[65536];
  while (!exited || !eof) {
    pollfd pfd{eof ? -1 : pipe_fds[0], POLLIN, 0};
    const int ready = poll(&pfd, 1, exited ? 0 : 200);  // once mpirun is gone, only what is already there
    if (ready > 0) {
      const ssize_t n = read(pipe_fds[0], buffer, sizeof buffer);
      if (n > 0) filter.feed(buffer, static_cast<size_t>(n));
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) eof = true;
    } else if (ready == 0 && exited) {
      break;  // drained: a descendant may hold the pipe open, but mpirun has ended
    }
    if (!exited && waitpid(child_pid, &status, WNOHANG) == child_pid) exited = true;
    if (exited || filter.watchdog_line().empty()) continue;
    const auto now = Clock::now();
    if (watchdog_seen == Clock::time_point{}) watchdog_seen = now;
    if (!ended_stuck && now - watchdog_seen > std::chrono::duration<double>(bound)) {
      std::fprintf(stderr, "meshtrain: %s has not ended the job %.0f s after the watchdog's report (a host it "
                   "cannot reach?); ending it\n", program.c_str(), bound);
      std::fflush(stderr);
      kill(child_pid, SIGTERM);
      ended_stuck = true;
      term_sent = now;
    } else if (ended_stuck && now - term_sent > std::chrono::seconds(5)) {
      kill(child_pid, SIGKILL);
    }
  }
  filter.finish();
  close(pipe_fds[0]);
  child_pid = 0;
  Launch result;
  result.status = ended_stuck ? 70 : WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 1);
  result.hang = !filter.watchdog_line().empty() || result.status == 70;
  result.rank_died = !result.hang && (!filter.rank_death().empty() || result.status >= 128);
  result.cause = !filter.watchdog_line().empty() ? filter.watchdog_line()
                 : !filter.rank_death().empty()  ? filter.rank_death()
                                                 : program + " exited with status " + std::to_string(result.status);
  if (!filter.lost_daemon().empty() && result.cause.find("remote daemon") != std::string::npos) {
    result.cause += " (" + filter.lost_daemon() + ")";
  }
  if (ended_stuck) std::fprintf(stderr, "meshtrain: the job ended on a watchdog timeout: %s\n", result.cause.c_str());
  return result;
}

// Note [Restarts]
// `meshtrain run --max-restarts K train ...` supervises the job: when a rank
// dies (mpirun reports a process that exited on a signal, or exits on one
// itself), or, with --restart-on-hang, when the watchdog ended the job, the
// same command is launched again, up to K times; train resumes from the
// newest intact checkpoint (Note [Resume]) and writes a "restart" line to
// metrics.jsonl with the attempt, the cause, the step it resumed at and the
// logged steps it will redo, which the relaunched command line tells it
// (--relaunch-attempt, --relaunch-cause, --relaunch-ranks-before). An error every rank agreed on (a bad config, a
// refused save) exits 1 and would only repeat, so it is not restarted, nor
// is a run stopped on purpose (Ctrl-C, SIGTERM). A daemon mpirun lost (its
// host down or cut off) counts as a rank's death.
bool worth_restarting(const Launch& launch, const Supervision& supervision) {
  if (launch.status == 0 || stops_forwarded > 0) return false;
  return launch.hang ? supervision.restart_on_hang : launch.rank_died;
}

// Note [Elastic restarts]
// With hosts named (--hosts, --hostfile), a restart first asks every host of
// the job to start a process (`mpirun -np 1 --host H:1 true`, all at once,
// for at most MESHTRAIN_HOST_PROBE_S seconds, default 30): relaunching on a
// host that is down would leave mpirun waiting for a daemon that never calls
// back. The launcher's own host is not asked: it cannot be lost while the
// launcher runs, and on a loaded machine its probe could fail only for being
// slow. Hosts that do not answer are dropped, each with why (no answer in
// time, or the probe's exit status and what it printed). With --min-ranks M the job goes
// on with as many ranks as the answering hosts' slots hold (at most -n), if
// that is M or more; without it a lost host ends the supervision, saying so.
// train derives its layout from the world size where the config leaves dp
// and fsdp at 0, keeps training.batch (the accumulation grows), and its
// checkpoints reshard on load (Note [Resume]), so the run goes on from its
// last checkpoint on fewer ranks along the same loss curve; its "restart"
// row in metrics.jsonl gives the ranks before and after. A host that comes
// back is not taken in again. Inside a Slurm allocation the hosts are the
// allocation's nodes and the probe a one-task srun step on each
// (Note [Launching under Slurm]).
struct Job {
  int ranks = 0;
  Hosts hosts;
  std::vector<HostSlots> named;  // the hosts of `hosts`, with their slots
};

double probe_seconds() {
  const char* text = std::getenv("MESHTRAIN_HOST_PROBE_S");
  return text && *text ? std::max(1.0, std::atof(text)) : 30.0;
}

// Drops the hosts that no longer start a process; false (said why) when the job cannot go on.
bool drop_lost_hosts(Job& job, const Supervision& supervision, int requested_ranks, bool srun) {
  if (job.named.empty()) return true;
  const double seconds = probe_seconds();
  const std::vector<ProbeAnswer> answers =
      probe_hosts(job.named, srun ? "srun" : mpirun_path(), is_open_mpi() && geteuid() == 0, seconds);
  std::vector<HostSlots> kept;
  std::string lost, why;
  int slots = 0;
  for (size_t i = 0; i < job.named.size(); ++i) {
    if (answers[i].answered) {
      kept.push_back(job.named[i]);
      slots += job.named[i].slots;
    } else {
      lost += (lost.empty() ? "" : ", ") + job.named[i].name;
      why += "meshtrain:   " + job.named[i].name + ": " + answers[i].why + "\n";
    }
  }
  if (lost.empty()) return true;
  std::fprintf(stderr, "meshtrain: lost host(s) %s: no process started there within %.0f s (%s)\n%s", lost.c_str(),
               seconds, srun ? "srun --nodes=1 --nodelist=HOST true" : "mpirun -np 1 --host HOST:1 true", why.c_str());
  const int ranks = std::min(requested_ranks, slots);
  if (supervision.min_ranks == 0) {
    std::fprintf(stderr, "meshtrain: not restarting: a host is lost (--min-ranks M relaunches on the hosts that answer)\n");
    return false;
  }
  if (ranks < supervision.min_ranks) {
    std::fprintf(stderr, "meshtrain: not restarting: the hosts that answer (%s) hold %d rank(s), fewer than --min-ranks %d\n",
                 kept.empty() ? "none" : host_list(kept).c_str(), ranks, supervision.min_ranks);
    return false;
  }
  std::fprintf(stderr, "meshtrain: relaunching on %d rank(s) (%d before) on %s; train derives its layout for them and "
               "keeps training.batch\n", ranks, job.ranks, host_list(kept).c_str());
  job = Job{ranks, Hosts{"", host_list(kept)}, kept};
  return true;
}

Job plan_job(int ranks, const Hosts& hosts, const Supervision& supervision, bool srun) {
  Job job{ranks, hosts, hosts.empty() ? std::vector<HostSlots>{} : parse_hosts(hosts.hostfile, hosts.list)};
  if (supervision.min_ranks == 0) return job;
  if (srun) job.named = slurm_allocation(ranks);  // Note [Launching under Slurm]
  if (job.named.empty()) {
    throw std::invalid_argument("run --min-ranks needs --hosts, --hostfile or a Slurm allocation: it relaunches on "
                                "the hosts that still answer, and this host alone cannot be lost while the launcher "
                                "runs");
  }
  if (supervision.max_restarts == 0) throw std::invalid_argument("run --min-ranks needs --max-restarts K (K >= 1)");
  if (supervision.min_ranks > ranks) {
    throw std::invalid_argument("run --min-ranks " + std::to_string(supervision.min_ranks) + " is more than -n " +
                                std::to_string(ranks));
  }
  for (const HostSlots& host : job.named) {
    if (host.slots == 0) {
      throw std::invalid_argument("run --min-ranks: " + hosts.hostfile + " gives host " + host.name +
                                  " no slots=N; the ranks a relaunch can place are counted by slots");
    }
  }
  return job;
}

}  // namespace

[[noreturn]] int run_launcher(int ranks, const Hosts& hosts, const Supervision& supervision,
                              const std::vector<std::string>& args, const std::string& launcher) {
  if (ranks < 1) throw std::invalid_argument("run -n needs at least 1 rank, got " + std::to_string(ranks));
  if (args.empty()) throw std::invalid_argument("run -n N needs a subcommand to run, e.g. `meshtrain run -n 2 selfcheck`");
  // What the command declared (Note [Commands]): what a stop means to it, and whether it may be relaunched.
  const LaunchNeeds needs = launch_needs_of(args.front());
  const bool server = needs.on_stop == LaunchNeeds::OnStop::kDrain, trainer = needs.on_stop == LaunchNeeds::OnStop::kSave;
  if ((supervision.max_restarts > 0 || supervision.restart_on_hang) && !needs.restartable) {
    throw std::invalid_argument("run --max-restarts and --restart-on-hang supervise a command that resumes where it "
                                "stopped (train), not `" + args.front() + "`");
  }
  check_hosts(hosts);
  const bool srun = use_srun(launcher, hosts, ranks);  // Note [Launching under Slurm]
  // Open MPI's daemons set mpi_yield_when_idle=0 for ranks that do not
  // oversubscribe unless it is set here; the ranks set it too (comm/runtime.cpp).
  setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
  // Ctrl-C and termination reach mpirun, which ends the ranks (a server drains, a trainer saves, first).
  void (*on_stop)(int) = server ? forward_as_drain : trainer ? forward_as_preempt : forward_signal;
  if (trainer) open_stop_name_file();
  std::signal(SIGINT, on_stop);
  std::signal(SIGTERM, on_stop);
  Job job = plan_job(ranks, hosts, supervision, srun);
  std::vector<std::string> launched = args;  // a relaunch is told so on its command line (Note [Restarts])
  for (int attempt = 0;; ++attempt) {
    if (attempt == 0 && stops_forwarded > 0) {
      std::fprintf(stderr, "meshtrain: stopped before the ranks were launched; nothing to save\n");
      std::exit(0);
    }
    const std::vector<std::string> command =
        srun ? srun_command(job.ranks, job.named, launched, self_executable())
             : launch_command(job.ranks, job.hosts, launched, is_open_mpi(), geteuid() == 0, passed_variables());
    // Each rank sets its threads to its host's cores / that host's ranks (apps/command.cpp).
    const char* threads = std::getenv("OMP_NUM_THREADS");
    std::fprintf(stderr, "meshtrain: launching %d ranks%s, %s:", job.ranks,
                 job.hosts.empty() ? ""
                                   : (" on " + (job.hosts.list.empty() ? "the hosts of " + job.hosts.hostfile : job.hosts.list)).c_str(),
                 threads ? ("OMP_NUM_THREADS=" + std::string(threads) + " threads each").c_str()
                         : "threads per rank = its host's cores / its host's ranks");
    for (size_t i = 0; i < command.size(); ++i) {  // an API key is never printed (Note [API key])
      const std::string& word = command[i];
      const bool key = i > 0 && command[i - 1] == "--api-key";
      std::fprintf(stderr, " %s", key ? "***" : word.rfind("--api-key=", 0) == 0 ? "--api-key=***" : word.c_str());
    }
    std::fprintf(stderr, "\n");
    std::fflush(stderr);
    const Launch launch = launch_once(command, server, trainer);
    std::fflush(stdout);
    // Preempted (the ranks saved, or died of SIGTERM before their handlers): queued again, to resume.
    if (srun && trainer && requeue_if_preempted()) std::exit(0);
    if (trainer && stops_forwarded > 0 && launch.status == 128 + SIGUSR2) {
      // Note [Naming the stop signal]: a rank ends on the stop only before it has set its handlers, which is
      // before its first step.
      std::fprintf(stderr, "meshtrain: stopped before the ranks began training; nothing to save\n");
      std::exit(0);
    }
    const bool again = worth_restarting(launch, supervision);
    if (!again || attempt >= supervision.max_restarts) {
      if (again) {
        std::fprintf(stderr, "meshtrain: not restarting: all %d restart(s) of --max-restarts are used\n",
                     supervision.max_restarts);
      } else if (launch.status != 0 && supervision.max_restarts > 0 && stops_forwarded == 0) {
        std::fprintf(stderr, "meshtrain: not restarting: %s\n",
                     launch.hang ? "a watchdog timeout (--restart-on-hang restarts those)"
                                 : "the job failed with an error, not a lost rank, and would fail again");
      }
      std::exit(launch.status);
    }
    std::fprintf(stderr, "meshtrain: restart %d of %d after: %s\n", attempt + 1, supervision.max_restarts,
                 launch.cause.c_str());
    std::fflush(stderr);
    const int ranks_before = job.ranks;
    if (!drop_lost_hosts(job, supervision, ranks, srun)) std::exit(launch.status);
    launched = args;
    launched.insert(launched.begin() + 1, {std::string("--") + kRelaunchAttempt, std::to_string(attempt + 1),
                                           std::string("--") + kRelaunchCause, launch.cause,
                                           std::string("--") + kRelaunchRanksBefore, std::to_string(ranks_before)});
    std::this_thread::sleep_for(std::chrono::seconds(1));  // the dead job's ports and locks go
    if (stops_forwarded > 0) {  // Ctrl-C or SIGTERM while the job was down
      std::fprintf(stderr, "meshtrain: stopped before restart %d; the same command resumes from the latest checkpoint\n",
                   attempt + 1);
      std::exit(launch.status);
    }
  }
}

CommandPtr add_run(CLI::App& app) {
  auto ranks = std::make_shared<int>(0);
  auto hosts = std::make_shared<Hosts>();
  auto supervision = std::make_shared<Supervision>();
  CLI::App* run = app.add_subcommand(
      "run", "Launch N ranks of meshtrain through mpirun, on this host or on others (--hostfile, --hosts), or through "
             "srun inside a Slurm allocation. Passes every MESHTRAIN_* variable set here on to the ranks; each rank "
             "uses its host's cores / its host's ranks as threads. Plain mpirun and srun --mpi=pmix work too.");
  run->add_option("-n,--ranks", *ranks, "Number of ranks")->required()->check(CLI::PositiveNumber);
  run->add_option("--hostfile", hosts->hostfile, "Open MPI hostfile: a line per host, e.g. `hostA slots=2`");
  run->add_option("--hosts", hosts->list, "Hosts and their slots, e.g. hostA:2,hostB:2");
  run->add_option("--max-restarts", supervision->max_restarts,
                  "train: relaunch up to K times when a rank dies; it resumes from the latest checkpoint")
      ->check(CLI::NonNegativeNumber);
  run->add_flag("--restart-on-hang", supervision->restart_on_hang,
                "train: restart after a watchdog timeout too (counts against --max-restarts)");
  run->add_option("--min-ranks", supervision->min_ranks,
                  "train with --hosts/--hostfile or in a Slurm allocation: when a host is lost, relaunch on the hosts "
                  "that still answer if their slots hold at least M ranks (the layout is derived again, training.batch "
                  "kept)")
      ->check(CLI::PositiveNumber);
  auto launcher = std::make_shared<std::string>("auto");
  run->add_option("--launcher", *launcher,
                  "auto: srun inside a Slurm allocation (SLURM_JOB_ID set), else mpirun; or mpirun, srun")
      ->check(CLI::IsMember({"auto", "mpirun", "srun"}))
      ->capture_default_str();
  run->prefix_command();  // everything after the options is the command every rank runs
  run->footer("Examples:\n  meshtrain run -n 4 bench comm --max-size 64M\n"
              "  meshtrain run -n 4 --hosts hostA:2,hostB:2 train --run.out=/shared/runs/a\n"
              "  meshtrain run -n 4 --hostfile hosts --max-restarts 3 --min-ranks 2 train --run.out=/shared/runs/a");
  return plain_command(run, [ranks, hosts, supervision, launcher, run] {
    return run_launcher(*ranks, *hosts, *supervision, run->remaining(), *launcher);
  });
}

}  // namespace meshtrain::apps
