// Compiled with AVX-512 flags and CPU_CAPABILITY=AVX512 (CMakeLists.txt); used
// only where the CPU has AVX-512. The table is constant-initialized: no code
// of this file runs at start-up, where an AVX-512 instruction would stop a
// CPU without it.
#include "meshtrain/model/fused/kernels_impl.h"

namespace meshtrain::model::fused::kernel {
const Table avx512_table = make_table();
}  // namespace meshtrain::model::fused::kernel
