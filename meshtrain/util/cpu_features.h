// What this CPU can run: the kernels compiled once per instruction set
// (offload/cpu_adam*, model/fused/kernels*) pick their copy by these.
#pragma once

#include <cstdlib>
#include <fstream>
#include <string>

namespace meshtrain::util {

// AVX-512 F, BW, VL and DQ: what the copies built with CPU_CAPABILITY=AVX512 use.
// ATEN_CPU_CAPABILITY (libtorch's own cap: "default", "avx2", "avx512") caps
// meshtrain's copies too, so that one variable runs an AVX-512 machine as one
// without it (docs/testing.md).
inline bool cpu_has_avx512() {
#if defined(__x86_64__)
  static const bool yes = [] {
    const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
    if (cap != nullptr && *cap != '\0' && std::string(cap).rfind("avx512", 0) != 0) return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return yes;
#else
  return false;
#endif
}

// AMX tiles (the matrix units ATen's bf16 kernels use where present), from /proc/cpuinfo.
inline bool cpu_has_amx() {
  static const bool yes = [] {
    std::ifstream cpuinfo("/proc/cpuinfo");
    std::string line;
    while (std::getline(cpuinfo, line)) {
      if (line.rfind("flags", 0) == 0) return line.find(" amx_tile") != std::string::npos;
    }
    return false;
  }();
  return yes;
}

}  // namespace meshtrain::util
