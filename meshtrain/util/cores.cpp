#include "meshtrain/util/cores.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

namespace meshtrain::util {

namespace {

// The CPUs of a list such as "0-3,8,10-11"; 0 for none or no file.
int listed_cpus(const char* path) {
  std::ifstream file(path);
  std::string list, range;
  if (!std::getline(file, list)) return 0;
  std::stringstream ranges(list);
  int count = 0;
  while (std::getline(ranges, range, ',')) {
    const size_t dash = range.find('-');
    try {
      count += dash == std::string::npos ? 1 : std::stoi(range.substr(dash + 1)) - std::stoi(range.substr(0, dash)) + 1;
    } catch (const std::exception&) {  // an unreadable list limits nothing
      return 0;
    }
  }
  return count;
}

// The CPUs a cgroup's quota allows (quota / period, rounded up); 0: no limit or no file.
int quota_cpus() {
  std::ifstream v2("/sys/fs/cgroup/cpu.max");
  std::string quota;
  double period = 0;
  if (v2 >> quota >> period) {
    if (quota == "max" || period <= 0) return 0;
    try {
      return static_cast<int>(std::ceil(std::stod(quota) / period));
    } catch (const std::exception&) {
      return 0;
    }
  }
  std::ifstream q1("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), p1("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
  double q = 0;
  if (q1 >> q && p1 >> period && q > 0 && period > 0) return static_cast<int>(std::ceil(q / period));
  return 0;
}

int affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
}

}  // namespace

int node_cores() {
  static const int cores = [] {
    int n = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    for (const int limit : {listed_cpus("/sys/fs/cgroup/cpuset.cpus.effective"),
                            listed_cpus("/sys/fs/cgroup/cpuset/cpuset.effective_cpus"), quota_cpus()}) {
      if (limit > 0) n = std::min(n, limit);
    }
    return n;
  }();
  return cores;
}

int process_cores() {
  static const int cores = [] {
    const int mask = affinity_cpus();
    return std::max(1, mask > 0 ? std::min(mask, node_cores()) : node_cores());
  }();
  return cores;
}

int threads_per_rank(int local_ranks) {
  return std::max(1, std::min(process_cores(), node_cores() / std::max(1, local_ranks)));
}

}  // namespace meshtrain::util
