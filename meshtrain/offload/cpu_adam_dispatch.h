// The CPU AdamW kernel's per-instruction-set entry points (cpu_adam_kernel.h
// is compiled into each); cpu_adam.cpp picks one for the CPU it runs on.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace meshtrain::offload::kernel {

// The step's scalars in fp32 (Note [CPU AdamW]).
struct Scalars {
  float decay, beta1, one_minus_beta1, beta2, one_minus_beta2, sqrt_bias2, eps, step_size;
};

void adamw_avx512(float* p, const float* g, float* m, float* v, int64_t n, const Scalars& s, c10::BFloat16* out);
void adamw_avx2(float* p, const float* g, float* m, float* v, int64_t n, const Scalars& s, c10::BFloat16* out);
void adamw_default(float* p, const float* g, float* m, float* v, int64_t n, const Scalars& s, c10::BFloat16* out);

}  // namespace meshtrain::offload::kernel
