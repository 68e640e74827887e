#include "meshtrain/model/fused/kernels.h"

#include "meshtrain/util/cpu_features.h"

#include <cstdlib>
#include <string_view>

namespace meshtrain::model::fused::kernel {

const Table& table() {
  switch (util::cpu_kernels()) {
#if defined(__x86_64__)
    case util::CpuKernels::kAvx512: return avx512_table;
    case util::CpuKernels::kAvx2: return avx2_table;
#endif
    default: return default_table;
  }
}

const Table* gpu_table() {
#if defined(MESHTRAIN_WITH_CUDA_KERNELS)
  // MESHTRAIN_CUDA_KERNELS=off: ATen's operators on the GPU, to compare (as MESHTRAIN_CPU_KERNELS picks a CPU copy).
  static const bool on = [] {
    const char* v = std::getenv("MESHTRAIN_CUDA_KERNELS");
    return v == nullptr || std::string_view(v) != "off";
  }();
  return on ? &cuda_table : nullptr;
#else
  return nullptr;
#endif
}

}  // namespace meshtrain::model::fused::kernel
