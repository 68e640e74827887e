// How many CPUs this process may run on.
#pragma once

namespace meshtrain::util {

// The CPUs of this process's affinity mask (a cpuset, taskset or the batch
// system's binding), fewer where a cgroup's CPU quota (cgroup v2 cpu.max,
// v1 cpu.cfs_quota_us) allows less than that: a container limited to 2 CPUs
// on a 64-CPU host is 2. Hyperthreads count as CPUs, as the kernel lists
// them. At least 1.
int usable_cores();

}  // namespace meshtrain::util
