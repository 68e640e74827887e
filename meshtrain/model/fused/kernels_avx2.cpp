// Compiled with AVX2, FMA and F16C flags and CPU_CAPABILITY=AVX2 (CMakeLists.txt);
// used only where the CPU has them and no AVX-512 copy is taken. The table is
// constant-initialized: no code of this file runs at start-up.
#include "meshtrain/model/fused/kernels_impl.h"

namespace meshtrain::model::fused::kernel {
const Table avx2_table = make_table();
}  // namespace meshtrain::model::fused::kernel
