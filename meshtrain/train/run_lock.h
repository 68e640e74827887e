// The run folder's lock: one run at a time writes a run folder's metrics,
// data and checkpoints (Note [Run lock]).
#pragma once

#include "meshtrain/comm/communicator.h"

#include <memory>
#include <string>
#include <vector>

namespace meshtrain::train {

class RunLock {
 public:
  // Takes an exclusive lock on <folder>/LOCK (creating the folder), or throws
  // ConfigError naming the process that holds it. Held until destruction or
  // the process's end, however it ends.
  explicit RunLock(const std::string& folder);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  int fd_ = -1;
};

struct TrainConfig;

// Collective over `world` (a run's ranks): rank 0 locks run.out, and
// checkpoint.dir when it is outside it; or every rank throws. Hold the
// result for the run.
std::vector<std::unique_ptr<RunLock>> lock_run_folders(comm::Communicator& world, const TrainConfig& config);

}  // namespace meshtrain::train
