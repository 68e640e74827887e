// How many CPUs a node offers this job, and this process.
#pragma once

namespace meshtrain::util {

// The node's CPUs as this job's container sees them: the online CPUs, fewer
// where the cgroup's cpuset (cpuset.cpus.effective) lists fewer or its CPU
// quota (cpu.max; v1 cpu.cfs_quota_us) allows less: a container limited to 2
// CPUs on a 64-CPU host is 2. Hyperthreads count as CPUs, as the kernel
// lists them. At least 1.
int node_cores();

// Those of node_cores() this process may run on: its affinity mask (taskset,
// or a launcher's binding of one rank).
int process_cores();

// Intra-op threads for one of `local_ranks` ranks sharing a node: a rank bound
// to its own CPUs runs as many threads as it has, ranks that share the node's
// CPUs split them.
int threads_per_rank(int local_ranks);

}  // namespace meshtrain::util
