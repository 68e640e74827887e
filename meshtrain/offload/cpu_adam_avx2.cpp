// Compiled with -mavx2 -mfma -mf16c and CPU_CAPABILITY=AVX2 (CMakeLists.txt);
// called only where the CPU has AVX2 and FMA and no AVX-512 copy is taken.
#include "meshtrain/offload/cpu_adam_kernel.h"

namespace meshtrain::offload::kernel {
void adamw_avx2(float* p, const float* g, float* m, float* v, int64_t n, const Scalars& s, c10::BFloat16* out) {
  adamw(p, g, m, v, n, s, out);
}
}  // namespace meshtrain::offload::kernel
