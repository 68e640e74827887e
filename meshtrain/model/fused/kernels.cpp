#include "meshtrain/model/fused/kernels.h"

namespace meshtrain::model::fused::kernel {

const Table& table() {
#if defined(__x86_64__)
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512) return avx512_table;
#endif
  return default_table;
}

}  // namespace meshtrain::model::fused::kernel
