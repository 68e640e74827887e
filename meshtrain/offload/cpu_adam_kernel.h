// The body of the CPU AdamW kernel, compiled once per instruction set
// (cpu_adam_avx512.cpp, cpu_adam_default.cpp) with ATen's CPU_CAPABILITY
// set, so each copy of at::vec::Vectorized is that set's. Included only there.
#pragma once

#include "meshtrain/offload/cpu_adam_dispatch.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

namespace meshtrain::offload::kernel {

inline void adamw_range(float* p, const float* g, float* m, float* v, int64_t begin, int64_t end, const Scalars& s,
                        c10::BFloat16* out) {
  using Vec = at::vec::Vectorized<float>;
  const Vec decay(s.decay), b1(s.beta1), c1(s.one_minus_beta1), b2(s.beta2), c2(s.one_minus_beta2),
      sqrt_bias2(s.sqrt_bias2), eps(s.eps), step_size(s.step_size);
  int64_t i = begin;
  constexpr int64_t width = Vec::size();
  for (; i + width <= end; i += width) {
    const Vec grad = Vec::loadu(g + i);
    const Vec param = Vec::loadu(p + i) * decay;
    const Vec average = at::vec::fmadd(grad, c1, Vec::loadu(m + i) * b1);
    const Vec square = at::vec::fmadd(grad * grad, c2, Vec::loadu(v + i) * b2);
    const Vec denominator = square.sqrt() / sqrt_bias2 + eps;
    const Vec updated = param - step_size * (average / denominator);
    updated.store(p + i);
    average.store(m + i);
    square.store(v + i);
    if (out != nullptr) {
      for (int64_t k = 0; k < width; ++k) out[i + k] = c10::BFloat16(p[i + k]);
    }
  }
  for (; i < end; ++i) {
    const float grad = g[i];
    const float param = p[i] * s.decay;
    const float average = grad * s.one_minus_beta1 + m[i] * s.beta1;
    const float square = grad * grad * s.one_minus_beta2 + v[i] * s.beta2;
    const float denominator = std::sqrt(square) / s.sqrt_bias2 + s.eps;
    p[i] = param - s.step_size * (average / denominator);
    m[i] = average;
    v[i] = square;
    if (out != nullptr) out[i] = c10::BFloat16(p[i]);
  }
}

inline void adamw(float* p, const float* g, float* m, float* v, int64_t n, const Scalars& s, c10::BFloat16* out) {
  // Chunks of 16K elements (448 KiB of traffic) per task.
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) { adamw_range(p, g, m, v, begin, end, s, out); });
}

}  // namespace meshtrain::offload::kernel
