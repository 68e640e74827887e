// Causal or full scaled-dot-product attention on the CPU (Note [CPU attention]).
#include "meshtrain/model/fused/kernels.h"
#include "meshtrain/model/fused/ops.h"
#include "meshtrain/model/fused/tensor_args.h"
#include "meshtrain/util/cpu_features.h"

#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <cmath>

namespace meshtrain::model::fused {

// Note [CPU attention]
// ATen's CPU attention is a flash kernel: it walks blocks of keys with an
// online softmax and keeps only the row statistics. Without AMX its bf16
// variant is slower than its fp32 one, and far slower than the same arithmetic
// as batched matrix multiplies, which oneDNN runs near the bf16 matmul peak
// with AVX512-BF16 dot products: for fwd + bwd of [8, 6, 256, 64] on 2 cores,
// the six products take 8 ms against ATen's 37 (in fp32, 20 against 27, and
// in the `small` step no faster than ATen's: fp32 keeps ATen's kernel). So
// under bf16 on a CPU without AMX:
//   forward   s = q·kᵀ (bmm)  p = softmax(scale·s, causal) (one fused pass, in
//             place)  y = p·v (bmm)
//   backward  dp = dy·vᵀ, dv = pᵀ·dy (bmm)  ds = scale·p·(dp − rowsum(p·dp))
//             (one fused pass, in place)  dq = ds·k, dk = dsᵀ·q (bmm)
// p is kept for backward: [B·H, T, T] in bf16, no more than q, k, v and y
// together while T ≤ 4·d, the longest key range taken here (longer ones take
// ATen's kernel: p would grow as T²). Entries past a causal query's position
// are written as zeros and skipped by the softmax passes; the matrix
// multiplies compute them (splitting off the masked blocks measured no faster
// at T = 256). Scores are rounded to bf16 before the softmax (fp32
// accumulation inside the product): the precision of PyTorch's math attention,
// not its flash kernel's; the softmax itself is fp32. Everything else (fp32,
// dropout, GPUs, CPUs with AMX, whose bf16 flash kernel uses it) takes ATen's
// kernel; bf16 without AMX then computes it in fp32. The planner counts the
// copies of q, k, v and p (attention = "batched", plan/from_config.cpp).
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using namespace detail;

// The softmax's scale for heads of size d.
float scale_for(int64_t head_dim) { return 1.0f / std::sqrt(static_cast<float>(head_dim)); }

// [B, H, T, d] as [B·H, T, d] in `type` (a copy where the view cannot be).
at::Tensor batched(const at::Tensor& x, at::ScalarType type) {
  return x.to(type).reshape({x.size(0) * x.size(1), x.size(2), x.size(3)});
}

struct BatchedAttention : torch::autograd::Function<BatchedAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool causal) {
    RECORD_FUNCTION("meshtrain::fused_attention", std::vector<c10::IValue>());
    const at::ScalarType type = compute_dtype(q.scalar_type());
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
    const at::Tensor qb = batched(q, type), kb = batched(k, type), vb = batched(v, type);
    const int64_t q_len = q.size(2), k_len = k.size(2);
    const at::Tensor p = at::bmm(qb, kb.transpose(1, 2));
    kernel::table().attention_softmax_forward(p.numel() / k_len, q_len, k_len, p.const_data_ptr(), dt(p),
                                              scale_for(q.size(3)), causal, p.mutable_data_ptr(), dt(p));
    const at::Tensor y = at::bmm(p, vb);
    ctx->save_for_backward({qb, kb, vb, p});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["types"] = std::vector<int64_t>{int64_t(q.scalar_type()), int64_t(k.scalar_type()),
                                                    int64_t(v.scalar_type())};
    return y.view({q.size(0), q.size(1), q_len, v.size(3)});
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("meshtrain::fused_attention_backward", std::vector<c10::IValue>());
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &qb = saved[0], &kb = saved[1], &vb = saved[2], &p = saved[3];
    const std::vector<int64_t> types = ctx->saved_data["types"].toIntVector();
    const at::Tensor& dy4 = grads[0];
    const at::Tensor dy = batched(dy4, p.scalar_type());
    const int64_t q_len = qb.size(1), k_len = kb.size(1);
    const at::Tensor dv = at::bmm(p.transpose(1, 2), dy);
    const at::Tensor ds = at::bmm(dy, vb.transpose(1, 2));  // dp, then ds in place
    kernel::table().attention_softmax_backward(ds.numel() / k_len, q_len, k_len, p.const_data_ptr(), dt(p),
                                               ds.const_data_ptr(), dt(ds), scale_for(qb.size(2)),
                                               ctx->saved_data["causal"].toBool(), ds.mutable_data_ptr(), dt(ds));
    const at::Tensor dq = at::bmm(ds, kb), dk = at::bmm(ds.transpose(1, 2), qb);
    auto shaped = [&](const at::Tensor& g, int64_t type) {
      return g.view({dy4.size(0), dy4.size(1), g.size(1), g.size(2)}).to(static_cast<at::ScalarType>(type));
    };
    return {shaped(dq, types[0]), shaped(dk, types[1]), shaped(dv, types[2]), {}};
  }
};

}  // namespace

bool batched_attention_applies(bool cpu, bool bf16, int64_t keys, int64_t head_dim, double dropout) {
  return cpu && bf16 && dropout == 0.0 && keys <= 4 * head_dim && !util::cpu_has_amx();
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout, bool causal) {
  const bool bf16 = compute_dtype(q.scalar_type()) == at::kBFloat16;
  if (eligible(q) && eligible(k) && eligible(v) &&
      batched_attention_applies(q.device().is_cpu(), bf16, k.size(2), q.size(3), dropout)) {
    return BatchedAttention::apply(q, k, v, causal);
  }
  if (!q.device().is_cpu() || !bf16 || util::cpu_has_amx()) {
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, dropout, causal);
  }
  // Without AMX, ATen's bf16 kernel is slower than its fp32 one: compute in fp32, out of autocast's reach.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  const at::Tensor y = at::scaled_dot_product_attention(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat),
                                                        /*attn_mask=*/{}, dropout, causal);
  return y.to(compute_dtype(q.scalar_type()));
}

}  // namespace meshtrain::model::fused
