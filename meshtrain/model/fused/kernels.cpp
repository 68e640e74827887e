#include "meshtrain/model/fused/kernels.h"

#include "meshtrain/util/cpu_features.h"

namespace meshtrain::model::fused::kernel {

const Table& table() {
#if defined(__x86_64__)
  if (util::cpu_has_avx512()) return avx512_table;
#endif
  return default_table;
}

}  // namespace meshtrain::model::fused::kernel
