// `meshtrain run` inside a Slurm allocation (Note [Launching under Slurm] in
// launch_slurm.cpp): whether it starts its ranks with srun, the srun command
// line, the allocation's nodes, and the requeue after a preemption.
#pragma once

#include "meshtrain/apps/commands.h"
#include "meshtrain/apps/launch_hosts.h"

#include <string>
#include <vector>

namespace meshtrain::apps {

// launcher: "auto", "mpirun" or "srun"; throws when srun is asked for and cannot be used.
bool use_srun(const std::string& launcher, const Hosts& hosts, int ranks);

// srun starting `ranks` of `self args...`; on `nodes` when given (a relaunch on the nodes left).
std::vector<std::string> srun_command(int ranks, const std::vector<HostSlots>& nodes, const std::vector<std::string>& args,
                                      const std::string& self);

// The allocation's nodes with their tasks (SLURM_TASKS_PER_NODE).
std::vector<HostSlots> slurm_allocation(int ranks);

// scontrol requeue when Slurm recorded a preemption of this job; whether it did.
bool requeue_if_preempted();

}  // namespace meshtrain::apps
