#include "meshtrain/model/fused/kernels.h"

#include "meshtrain/util/cpu_features.h"

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

}  // namespace meshtrain::model::fused::kernel
