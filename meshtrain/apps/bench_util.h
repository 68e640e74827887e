// Small helpers the benchmarks share: wall time since a point and the median of samples.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace meshtrain::apps {

using BenchClock = std::chrono::steady_clock;

inline double seconds_since(BenchClock::time_point start) {
  return std::chrono::duration<double>(BenchClock::now() - start).count();
}

// The upper median (the middle sample, or the higher of the two middle ones); 0 for none.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// The median as statistics defines it: the middle sample, or the mean of the two middle ones; 0 for none.
inline double median_of_middle(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.empty() ? 0.0 : v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

}  // namespace meshtrain::apps
