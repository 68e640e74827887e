#include "meshtrain/model/fused/linear.h"

#include "meshtrain/model/fused/kernels.h"
#include "meshtrain/model/fused/ops.h"
#include "meshtrain/model/fused/tensor_args.h"

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <optional>
#include <vector>

namespace meshtrain::model::fused {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Linear : torch::autograd::Function<Linear> {
  // bf16: x is bf16, and the fp32 weight and bias are cast to it here as
  // autocast would cast them, out of autograd's sight (Note [Weight gradients
  // under autocast]).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, bool glu_made_again, bool bf16) {
    const at::Tensor w = bf16 ? weight.to(at::kBFloat16) : weight;
    // Note [The GLU's output made again]: keep g and u, not x.
    const std::optional<GluInputs> glu = glu_made_again ? glu_inputs(x) : std::nullopt;
    std::vector<at::Tensor> saved = glu ? std::vector<at::Tensor>{glu->g, glu->u} : std::vector<at::Tensor>{x};
    saved.push_back(w);
    if (bf16) saved.push_back(weight);  // the parameter, whose .grad the backward may add into
    ctx->save_for_backward(saved);
    ctx->saved_data["glu"] = !glu ? 0 : glu->gelu ? 2 : 1;
    ctx->saved_data["bias"] = bias.has_value();
    ctx->saved_data["bf16"] = bf16;
    // As at::linear folds [.., in] into one product, but the result is no view
    // (a custom function's view output would refuse later in-place changes).
    const at::Tensor x2 = x.reshape({-1, w.size(1)});
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = w.size(0);
    return at::_unsafe_view(bias ? at::addmm(bf16 ? bias->to(at::kBFloat16) : *bias, x2, w.t()) : at::mm(x2, w.t()),
                            sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const int64_t glu = ctx->saved_data["glu"].toInt();
    const bool bf16 = ctx->saved_data["bf16"].toBool();
    const at::Tensor& w = saved[glu == 0 ? 1 : 2];  // in the product's dtype
    const at::Tensor& parameter = bf16 ? saved.back() : w;
    const at::Tensor dy = grads[0].reshape({-1, w.size(0)});
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) dx = dy.mm(w).view(saved[0].sizes());
    if (ctx->needs_input_grad(1)) {
      // The input kept, or made again from the GLU's g and u (Note [The GLU's output made again]).
      const at::Tensor x = glu == 0 ? saved[0] : glu == 2 ? geglu(saved[0], saved[1]) : swiglu(saved[0], saved[1]);
      const at::Tensor x2 = x.reshape({-1, w.size(1)});
      if (backward_adds_into_grad(parameter, parameter)) {
        RECORD_FUNCTION("meshtrain::weight_grad_in_place", std::vector<c10::IValue>());
        if (bf16) {
          const at::Tensor product = dy.t().mm(x2);  // 16-bit, added into fp32 in one pass
          kernel::table().add_into(product.numel(), product.const_data_ptr(), detail::dt(product),
                                   parameter.mutable_grad().data_ptr<float>());
        } else {
          parameter.mutable_grad().addmm_(dy.t(), x2);
        }
      } else {
        dw = dy.t().mm(x2).to(parameter.scalar_type());
      }
    }
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) {
      db = bf16 ? dy.sum(0).to(at::kFloat) : dy.sum(0);  // as autocast's graph: sum(dtype=) would copy dy
    }
    return {dx, dw, db, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool backward_adds_into_grad(const at::Tensor& w, const at::Tensor& like) {
  if (at::GradMode::is_enabled() || torch::autograd::AnomalyMode::is_enabled()) return false;
  const auto* chosen = torch::autograd::get_current_graph_task_exec_info();
  if (chosen == nullptr || !chosen->empty()) return false;  // autograd::grad(), or backward(inputs=...)
  return grad_accumulates_in_place(w, like.scalar_type(), like.device());
}

bool grad_accumulates_in_place(const at::Tensor& w, at::ScalarType dtype, const at::Device& device) {
  if (!w.is_leaf() || !w.requires_grad()) return false;
  const at::Tensor& grad = w.grad();
  if (!grad.defined() || grad.layout() != at::kStrided || !grad.is_contiguous() || grad.scalar_type() != dtype ||
      grad.device() != device || grad.sizes() != w.sizes()) {
    return false;
  }
  const std::shared_ptr<torch::autograd::Node> accumulator = torch::autograd::impl::try_get_grad_accumulator(w);
  return accumulator && accumulator->tensor_pre_hooks().empty() && accumulator->pre_hooks().empty() &&
         accumulator->retains_grad_hooks().empty() && !accumulator->tensor_post_acc_grad_hooks();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, bool glu_made_again) {
  if (!x.device().is_cpu() || !at::GradMode::is_enabled() || !weight.requires_grad()) return at::linear(x, weight, bias);
  const std::optional<at::Tensor> b = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  if (at::autocast::is_autocast_enabled(at::kCPU)) {
    // Note [Weight gradients under autocast]: bf16 products of an fp32 weight.
    const bool casts = at::autocast::get_autocast_dtype(at::kCPU) == at::kBFloat16 &&
                       weight.scalar_type() == at::kFloat && (!bias.defined() || bias.scalar_type() == at::kFloat) &&
                       (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
    if (!casts) return at::linear(x, weight, bias);
    return Linear::apply(x.to(at::kBFloat16), weight, b, glu_made_again, true);
  }
  if (x.scalar_type() != weight.scalar_type()) return at::linear(x, weight, bias);
  return Linear::apply(x, weight, b, glu_made_again, false);
}

}  // namespace meshtrain::model::fused
