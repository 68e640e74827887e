// Compiled with CPU_CAPABILITY=DEFAULT: ATen's portable vectors, for any CPU.
#include "meshtrain/offload/cpu_adam_kernel.h"

namespace meshtrain::offload::kernel {
void adamw_default(float* p, const float* g, float* m, float* v, int64_t n, const Scalars& s, c10::BFloat16* out) {
  adamw(p, g, m, v, n, s, out);
}
}  // namespace meshtrain::offload::kernel
