#include "meshtrain/model/chunked_loss.h"

#include "meshtrain/model/batch.h"

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <algorithm>

namespace meshtrain::model {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What a matmul on `t`'s device computes in now: autocast's dtype when it is on.
at::ScalarType compute_dtype(const at::Tensor& t) {
  const at::DeviceType type = t.is_cuda() ? at::kCUDA : at::kCPU;
  return at::autocast::is_autocast_enabled(type) ? at::autocast::get_autocast_dtype(type) : t.scalar_type();
}

struct ChunkedCrossEntropy : torch::autograd::Function<ChunkedCrossEntropy> {
  // hidden [N, d], weight [V', d] (entries shard.start.. of the vocabulary),
  // targets [N]; make dh (`hidden_grad`) and dW (`weight_grad`, not for a
  // frozen head) for the backward (Note [Chunked loss]).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& targets, double softcap, int64_t chunk_rows, const VocabShard& shard,
                            bool hidden_grad, bool weight_grad) {
    const bool gradients = hidden_grad || weight_grad;
    RECORD_FUNCTION("meshtrain::chunked_cross_entropy", std::vector<c10::IValue>());
    const at::ScalarType compute = compute_dtype(hidden);
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor h = hidden.to(compute).contiguous(), w = weight.to(compute).contiguous();
    const int64_t n = h.size(0), v = w.size(0);
    const int64_t rows = chunk_rows > 0 ? chunk_rows : std::max<int64_t>(1, kChunkBytes / (4 * v));
    const at::TensorOptions fp32 = h.options().dtype(at::kFloat);
    // Each target's column in this rank's share, and whether it is counted here.
    const at::Tensor counted = targets != kIgnoredTarget, local = targets - shard.start;
    const at::Tensor here = (counted & (local >= 0) & (local < v)).unsqueeze(1).to(at::kFloat);
    const at::Tensor index = local.clamp(0, v - 1).unsqueeze(1);
    at::Tensor loss_sum = at::zeros({}, fp32);
    at::Tensor dh, dw;
    if (hidden_grad) dh = at::empty_like(h);
    if (weight_grad) dw = at::zeros({v, w.size(1)}, fp32);
    for (int64_t r = 0; r < n; r += rows) {
      const int64_t m = std::min(rows, n - r);
      const at::Tensor hc = h.narrow(0, r, m), ic = index.narrow(0, r, m), hr = here.narrow(0, r, m);
      const at::Tensor cc = counted.narrow(0, r, m).unsqueeze(1).to(at::kFloat);
      at::Tensor z = at::mm(hc, w.t()).to(at::kFloat);
      at::Tensor t;  // tanh(z / c) under the soft-cap
      if (softcap > 0) {
        t = z.div_(softcap).tanh_();
        z = t * softcap;
      }
      at::Tensor top = at::amax(z, 1, /*keepdim=*/true);
      if (shard.split()) shard.max(top);
      const at::Tensor target = z.gather(1, ic).mul_(hr);  // 0 where another share holds it
      const at::Tensor e = z.sub_(top).exp_();              // z's buffer, exp(z − top)
      // [Σ exp(z − top), the target's logit] per row, summed over the shares.
      at::Tensor sums = at::cat({e.sum(1, /*keepdim=*/true), target}, 1);
      if (shard.split()) shard.sum(sums);
      const at::Tensor total = sums.narrow(1, 0, 1);
      loss_sum += ((total.log() + top - sums.narrow(1, 1, 1)) * cc).sum();
      if (!gradients) continue;
      at::Tensor dz = e.div_(total);  // the softmax
      dz.scatter_add_(1, ic, hr.neg()).mul_(cc);
      if (softcap > 0) dz.mul_(t.mul_(t).neg_().add_(1.0f));  // times 1 − tanh²
      const at::Tensor d = dz.to(compute);
      if (hidden_grad) dh.narrow(0, r, m).copy_(at::mm(d, w));
      if (weight_grad && compute == at::kFloat) dw.addmm_(d.t(), hc);
      if (weight_grad && compute != at::kFloat) dw.add_(at::mm(d.t(), hc));
    }
    const at::Tensor count = counted.sum().clamp_min(1).to(at::kFloat);
    ctx->saved_data["count"] = count;
    ctx->saved_data["gradients"] = gradients;
    if (hidden_grad) ctx->saved_data["dh"] = dh;
    if (weight_grad) ctx->saved_data["dw"] = dw;
    ctx->saved_data["hidden_type"] = hidden.scalar_type();
    ctx->saved_data["weight_type"] = weight.scalar_type();
    return loss_sum / count;
  }

  // Scales the forward's dh and dW by the loss's gradient in place: they are
  // handed on, not copied, so a second backward through one loss finds none.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(ctx->saved_data["gradients"].toBool(), "chunked_cross_entropy: a gradient asked of a loss made without one");
    TORCH_CHECK(!ctx->saved_data.count("handed_on"),
                "chunked_cross_entropy: a second backward through one loss (retain_graph); compute the loss again");
    ctx->saved_data["handed_on"] = true;
    const at::Tensor g = grads[0].to(at::kFloat) / ctx->saved_data["count"].toTensor();
    auto scaled = [&](const char* name, const char* type) {
      auto it = ctx->saved_data.find(name);
      if (it == ctx->saved_data.end()) return at::Tensor();
      at::Tensor d = it->second.toTensor();
      ctx->saved_data.erase(it);
      return d.mul_(g).to(ctx->saved_data[type].toScalarType());
    };
    return {scaled("dh", "hidden_type"), scaled("dw", "weight_type"), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                 double softcap, int64_t chunk_rows, const VocabShard& shard) {
  const bool grad_mode = torch::GradMode::is_enabled();
  const at::Tensor flat = hidden.reshape({-1, hidden.size(-1)});
  return ChunkedCrossEntropy::apply(flat, weight, targets.reshape({-1}).to(at::kLong), softcap, chunk_rows, shard,
                                    grad_mode && hidden.requires_grad(), grad_mode && weight.requires_grad());
}

}  // namespace meshtrain::model
