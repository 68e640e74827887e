// Compiled with AVX-512 flags and CPU_CAPABILITY=AVX512 (CMakeLists.txt); used
// only where the CPU has AVX-512.
#include "meshtrain/model/fused/kernels_impl.h"

namespace meshtrain::model::fused::kernel {
const Table avx512_table = make_table();
}  // namespace meshtrain::model::fused::kernel
