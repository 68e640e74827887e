#include "meshtrain/train/run_lock.h"

#include "meshtrain/comm/agree.h"
#include "meshtrain/train/config.h"
#include "meshtrain/util/files.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>

namespace meshtrain::train {

// Note [Run lock]
// Two runs on one folder interleave their metrics lines and overwrite each
// other's checkpoints, and neither notices. (A run is what the train command
// starts; a program using Trainer directly locks with lock_run_folders.) That happens when a job is
// requeued while its earlier ranks still run (a launcher killed with
// SIGKILL leaves them: Note [Stopping ranks under mpirun]), or when the same
// command is started twice. So rank 0 holds flock(2) on <run.out>/LOCK, and
// on <checkpoint.dir>/LOCK when the checkpoints are elsewhere, for the whole
// run; the kernel drops it when the process ends, however it ends, so a
// stale lock cannot outlive its holder. The file says who holds it (pid,
// host, start time), and a run refused names them. flock is advisory and,
// on some network file systems, local to a host: it guards against the
// usual mistakes, not a hostile process.

namespace {

std::string holder_line() {
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  char when[64] = "";
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  return "pid " + std::to_string(getpid()) + " on host " + host + ", since " + when;
}

std::string read_holder(int fd) {
  char text[512] = "";
  const ssize_t n = pread(fd, text, sizeof text - 1, 0);
  std::string line(text, n > 0 ? static_cast<size_t>(n) : 0);
  while (!line.empty() && (line.back() == '\n' || line.back() == '\0')) line.pop_back();
  return line.empty() ? "a process that has not yet written its name" : line;
}

}  // namespace

RunLock::RunLock(const std::string& folder) {
  const std::string path = util::join_path(folder, "LOCK");
  try {
    util::make_directories(folder);
  } catch (const std::runtime_error& e) {
    throw ConfigError(std::string("cannot create the run folder: ") + e.what());
  }
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw ConfigError("cannot open " + path + ": " + std::strerror(errno));
  if (flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    const std::string holder = read_holder(fd_);
    ::close(fd_);
    fd_ = -1;
    if (error != EWOULDBLOCK) throw ConfigError("cannot lock " + path + ": " + std::strerror(error));
    throw ConfigError(folder + " is in use by another run (" + holder + "; " + path + "). Two runs on one folder " +
                      "would overwrite each other's checkpoints and metrics: wait for it, stop it (SIGTERM saves a " +
                      "checkpoint first), or set run.out (and checkpoint.dir) to another folder");
  }
  const std::string line = holder_line() + "\n";
  if (ftruncate(fd_, 0) != 0 || pwrite(fd_, line.data(), line.size(), 0) != static_cast<ssize_t>(line.size())) {
    // The lock holds without the note; a refused run then cannot say who holds it.
  }
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);
}

std::vector<std::unique_ptr<RunLock>> lock_run_folders(comm::Communicator& world, const TrainConfig& config) {
  std::vector<std::unique_ptr<RunLock>> locks;
  comm::on_root_or_all_fail(world, 0, [&] {
    locks.push_back(std::make_unique<RunLock>(config.out));
    const std::string out = util::canonical_path(config.out) + "/";
    const std::string checkpoints = config.checkpoint_path();
    util::make_directories(checkpoints);
    if ((util::canonical_path(checkpoints) + "/").rfind(out, 0) != 0) {
      locks.push_back(std::make_unique<RunLock>(checkpoints));
    }
  });
  return locks;
}

}  // namespace meshtrain::train
