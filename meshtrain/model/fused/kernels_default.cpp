// Compiled with CPU_CAPABILITY=DEFAULT: ATen's portable vectors, for any CPU.
#include "meshtrain/model/fused/kernels_impl.h"

namespace meshtrain::model::fused::kernel {
const Table default_table = make_table();
}  // namespace meshtrain::model::fused::kernel
