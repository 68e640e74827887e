#include "meshtrain/offload/cpu_adam.h"

#include "meshtrain/offload/cpu_adam_dispatch.h"
#include "meshtrain/util/cpu_features.h"

#include <ATen/record_function.h>

#include <cmath>

namespace meshtrain::offload {

const char* cpu_adamw_kernel() { return util::cpu_kernels_name(); }

void cpu_adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamWStep& step,
               at::BFloat16* bf16_out) {
  RECORD_FUNCTION("meshtrain::cpu_adamw", std::vector<c10::IValue>());  // seen by the profiler
  // The scalars as torch::optim::AdamW forms them (in double, then used in fp32).
  const double bias1 = 1.0 - std::pow(step.beta1, static_cast<double>(step.step));
  const double bias2 = 1.0 - std::pow(step.beta2, static_cast<double>(step.step));
  const kernel::Scalars s{static_cast<float>(1.0 - step.lr * step.weight_decay),
                          static_cast<float>(step.beta1),
                          static_cast<float>(1.0 - step.beta1),
                          static_cast<float>(step.beta2),
                          static_cast<float>(1.0 - step.beta2),
                          static_cast<float>(std::sqrt(bias2)),
                          static_cast<float>(step.eps),
                          static_cast<float>(step.lr / bias1)};
#if defined(__x86_64__)
  switch (util::cpu_kernels()) {
    case util::CpuKernels::kAvx512: return kernel::adamw_avx512(param, grad, exp_avg, exp_avg_sq, n, s, bf16_out);
    case util::CpuKernels::kAvx2: return kernel::adamw_avx2(param, grad, exp_avg, exp_avg_sq, n, s, bf16_out);
    case util::CpuKernels::kDefault: break;
  }
#endif
  kernel::adamw_default(param, grad, exp_avg, exp_avg_sq, n, s, bf16_out);
}

void cpu_adamw(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
               const AdamWStep& step, const at::Tensor& bf16_out) {
  auto check = [&](const at::Tensor& t, const char* what, at::ScalarType dtype) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.numel() == param.numel(),
                "cpu_adamw: ", what, " must be a contiguous CPU tensor of ", param.numel(), " ", c10::toString(dtype),
                " elements");
  };
  check(param, "the parameter", at::kFloat);
  check(grad, "the gradient", at::kFloat);
  check(exp_avg, "exp_avg", at::kFloat);
  check(exp_avg_sq, "exp_avg_sq", at::kFloat);
  if (bf16_out.defined()) check(bf16_out, "the bf16 copy", at::kBFloat16);
  cpu_adamw(param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
            param.numel(), step, bf16_out.defined() ? bf16_out.data_ptr<at::BFloat16>() : nullptr);
}

}  // namespace meshtrain::offload
