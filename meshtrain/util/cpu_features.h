// What this CPU can run: the kernels compiled once per instruction set
// (offload/cpu_adam*, model/fused/kernels*) pick their copy by these
// (Note [Kernel copies]).
#pragma once

#include <cstdlib>
#include <fstream>
#include <string>

namespace meshtrain::util {

// Note [Kernel copies]
// The fused model kernels and the CPU AdamW are compiled once per instruction
// set with ATen's CPU_CAPABILITY (so at::vec::Vectorized is that set's):
// AVX-512 (F, BW, VL, DQ), AVX2 (+ FMA, F16C: ATen's own AVX2 level) and the
// portable default. The best copy the CPU runs is taken once, at the first
// call, as ATen picks its own kernels; ATEN_CPU_CAPABILITY ("default",
// "avx2", "avx512": libtorch's variable) caps both, so one variable runs an
// AVX-512 machine as one with AVX2 only, or with neither (docs/testing.md).
// MESHTRAIN_CPU_KERNELS (the same names) caps meshtrain's copies alone, so
// that a benchmark can set one copy against the same ATen.
enum class CpuKernels { kDefault, kAvx2, kAvx512 };

inline CpuKernels cpu_kernels() {
#if defined(__x86_64__)
  static const CpuKernels best = [] {
    const char* ours = std::getenv("MESHTRAIN_CPU_KERNELS");
    const char* cap = ours != nullptr && *ours != '\0' ? ours : std::getenv("ATEN_CPU_CAPABILITY");
    const std::string capped = cap != nullptr ? cap : "";
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    if (capped == "default") return CpuKernels::kDefault;
    if (avx512 && (capped.empty() || capped.rfind("avx512", 0) == 0)) return CpuKernels::kAvx512;
    if (avx2) return CpuKernels::kAvx2;
    return CpuKernels::kDefault;
  }();
  return best;
#else
  return CpuKernels::kDefault;
#endif
}

// "avx512", "avx2" or "default": the copy cpu_kernels() takes, for logs and benchmarks.
inline const char* cpu_kernels_name() {
  switch (cpu_kernels()) {
    case CpuKernels::kAvx512: return "avx512";
    case CpuKernels::kAvx2: return "avx2";
    case CpuKernels::kDefault: break;
  }
  return "default";
}

// The processor's "model name" from a /proc/cpuinfo; "cpu" where it has none.
inline std::string cpu_model_name(const std::string& cpuinfo_path = "/proc/cpuinfo") {
  std::ifstream cpuinfo(cpuinfo_path);
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) break;
    const size_t start = line.find_first_not_of(" \t", colon + 1), end = line.find_last_not_of(" \t\r");
    return start == std::string::npos ? "cpu" : line.substr(start, end + 1 - start);
  }
  return "cpu";
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
