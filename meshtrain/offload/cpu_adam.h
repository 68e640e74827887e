// A fast AdamW for states in CPU memory: one fused pass over flat fp32
// buffers, vectorised (AVX-512 where the CPU has it, else ATen's portable
// vectors) and split over the intra-op threads, with the bf16 copy of the
// updated parameters written in the same pass. See Note [CPU AdamW].
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace meshtrain::offload {

// Note [CPU AdamW]
// torch.optim.AdamW's update (and libtorch's torch::optim::AdamW), element by
// element in fp32:
//   p <- p·(1 - lr·wd);  m <- β1·m + (1-β1)·g;  v <- β2·v + (1-β2)·g²
//   p <- p - lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps)
// The reference does this as about eight passes over memory (each an
// operator); here each element is loaded once and stored once, so the step
// is bound by reading g, p, m, v and writing p, m, v: 28 bytes per element.
struct AdamWStep {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;  // t, counted from 1
};

// In place over n elements; `bf16_out` (may be null) receives the updated
// parameters rounded to bfloat16.
void cpu_adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamWStep& step,
               at::BFloat16* bf16_out = nullptr);
// Tensor form: contiguous fp32 CPU tensors of one size (bf16_out: undefined
// or a contiguous bf16 CPU tensor of that size).
void cpu_adamw(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
               const AdamWStep& step, const at::Tensor& bf16_out = {});

// "avx512" or "default": which kernel this CPU runs.
const char* cpu_adamw_kernel();

}  // namespace meshtrain::offload
