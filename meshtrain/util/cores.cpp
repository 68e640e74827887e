#include "meshtrain/util/cores.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <thread>

namespace meshtrain::util {

namespace {

// The CPUs a cgroup's quota allows (quota / period, rounded up); 0: no limit or no file.
int quota_cores() {
  std::ifstream v2("/sys/fs/cgroup/cpu.max");
  std::string quota;
  double period = 0;
  if (v2 >> quota >> period) {
    if (quota == "max" || period <= 0) return 0;
    return static_cast<int>(std::ceil(std::stod(quota) / period));
  }
  std::ifstream q1("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), p1("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
  double q = 0;
  if (q1 >> q && p1 >> period && q > 0 && period > 0) return static_cast<int>(std::ceil(q / period));
  return 0;
}

}  // namespace

int usable_cores() {
  static const int cores = [] {
    int n = static_cast<int>(std::thread::hardware_concurrency());
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
    int quota = 0;
    try {
      quota = quota_cores();
    } catch (const std::exception&) {  // an unreadable quota limits nothing
      quota = 0;
    }
    if (quota > 0) n = std::min(n, quota);
    return std::max(1, n);
  }();
  return cores;
}

}  // namespace meshtrain::util
