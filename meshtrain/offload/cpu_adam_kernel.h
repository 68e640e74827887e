// The body of the CPU AdamW kernel, compiled once per instruction set
// (cpu_adam_avx512.cpp, cpu_adam_default.cpp) with ATen's CPU_CAPABILITY
// set, so each copy of at::vec::Vectorized is that set's. Included only there.
#pragma once

#include "meshtrain/offload/cpu_adam_dispatch.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace meshtrain::offload::kernel {

inline void adamw_range(float* p, const float* g, float* m, float* v, int64_t begin, int64_t end, const Scalars& s,
                        c10::BFloat16* out) {
  using Vec = at::vec::Vectorized<float>;
  const Vec decay(s.decay), b1(s.beta1), c1(s.one_minus_beta1), b2(s.beta2), c2(s.one_minus_beta2),
      inv_sqrt_bias2(1.0f / s.sqrt_bias2), eps(s.eps), step_size(s.step_size);
  int64_t i = begin;
  constexpr int64_t width = Vec::size();
  for (; i + width <= end; i += width) {
    const Vec grad = Vec::loadu(g + i);
    const Vec param = Vec::loadu(p + i) * decay;
    const Vec average = at::vec::fmadd(grad, c1, Vec::loadu(m + i) * b1);
    const Vec square = at::vec::fmadd(grad * grad, c2, Vec::loadu(v + i) * b2);
    const Vec denominator = at::vec::fmadd(square.sqrt(), inv_sqrt_bias2, eps);
    const Vec updated = param - step_size * (average / denominator);
    updated.store(p + i);
    average.store(m + i);
    square.store(v + i);
  }
  // The bf16 copy of what this range just wrote (still in cache), vectorised.
  if (out != nullptr) at::vec::convert(p + begin, out + begin, i - begin);
  for (; i < end; ++i) {
    const float grad = g[i];
    const float param = p[i] * s.decay;
    const float average = grad * s.one_minus_beta1 + m[i] * s.beta1;
    const float square = grad * grad * s.one_minus_beta2 + v[i] * s.beta2;
    const float denominator = std::sqrt(square) * (1.0f / s.sqrt_bias2) + s.eps;
    p[i] = param - s.step_size * (average / denominator);
    m[i] = average;
    v[i] = square;
    if (out != nullptr) out[i] = c10::BFloat16(p[i]);
  }
}

inline void adamw(float* p, const float* g, float* m, float* v, int64_t n, const Scalars& s, c10::BFloat16* out) {
  // Each thread takes a contiguous range and walks it in blocks of 4K
  // elements (112 KiB of traffic), so a block's bf16 copy is made while the
  // block is still in cache.
  constexpr int64_t kBlock = 4096;
  at::parallel_for(0, n, kBlock, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += kBlock) adamw_range(p, g, m, v, b, std::min(end, b + kBlock), s, out);
  });
}

}  // namespace meshtrain::offload::kernel
