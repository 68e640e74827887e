// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma and
// CPU_CAPABILITY=AVX512 (CMakeLists.txt); called only where the CPU has AVX-512.
#include "meshtrain/offload/cpu_adam_kernel.h"

namespace meshtrain::offload::kernel {
void adamw_avx512(float* p, const float* g, float* m, float* v, int64_t n, const Scalars& s, c10::BFloat16* out) {
  adamw(p, g, m, v, n, s, out);
}
}  // namespace meshtrain::offload::kernel
