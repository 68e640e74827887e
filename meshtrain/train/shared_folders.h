// The folders every rank of a run reads and writes must be one file system
// for all of them (Note [Shared folders]).
#pragma once

#include "meshtrain/comm/communicator.h"

#include <string>
#include <vector>

namespace meshtrain::train {

struct SharedFolder {
  std::string key;   // the config key that names it, e.g. "run.out"
  std::string path;  // a folder (rank 0 creates it)
};

// Collective: rank 0 writes a probe file with a random token into each
// folder; every rank must read it back. Throws AgreedError naming, for each
// folder that is not shared, the ranks and hosts that do not see the probe,
// and what to do. Removes the probes.
void check_shared_folders(comm::Communicator& world, const std::vector<SharedFolder>& folders);

// Collective, for checkpoint.local (Note [Local checkpoints]): a folder each
// host must have for itself. Throws AgreedError when ranks on another host
// than rank 0's see the probe rank 0 wrote there.
void check_local_folder(comm::Communicator& world, const SharedFolder& folder);

}  // namespace meshtrain::train
