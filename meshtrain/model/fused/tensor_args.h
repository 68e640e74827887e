// Helpers shared by the fused operators' autograd functions (ops.cpp,
// attention.cpp, qkv_heads.cpp): tensors to kernel arguments, and the dtype matmuls compute in.
#pragma once

#include "meshtrain/model/fused/kernels.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

namespace meshtrain::model::fused::detail {

inline kernel::Dt dt(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? kernel::Dt::kBFloat16 : kernel::Dt::kFloat;
}

inline const void* ptr(const at::Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }
inline void* mut(const at::Tensor& t) { return t.defined() ? t.mutable_data_ptr() : nullptr; }
inline const float* fptr(const at::Tensor& t) { return t.defined() ? t.const_data_ptr<float>() : nullptr; }

// A [B, H, T, d] tensor (the last dimension contiguous) as the rope kernel reads or writes it.
inline kernel::HeadsView heads_view(const at::Tensor& t) {
  kernel::HeadsView v;
  v.batch = t.stride(0), v.heads = t.stride(1), v.step = t.stride(2);
  return v;
}

inline at::Tensor as_float(const at::Tensor& t) { return t.defined() ? t.to(at::kFloat).contiguous() : t; }

// The dtype a matmul on `device` (the CPU unless said) would compute in now: autocast's when it is on.
inline at::ScalarType compute_dtype(at::ScalarType fallback, at::DeviceType device = at::kCPU) {
  return at::autocast::is_autocast_enabled(device) ? at::autocast::get_autocast_dtype(device) : fallback;
}

// The kernels for `t`'s device: this CPU's, or the GPU's (kernel::gpu_table(), which
// eligible_anywhere() has made sure of).
inline const kernel::Table& table_for(const at::Tensor& t) {
  return t.is_cuda() ? *kernel::gpu_table() : kernel::table();
}

}  // namespace meshtrain::model::fused::detail
