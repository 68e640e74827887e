#include "meshtrain/model/fused/embedding.h"

#include "meshtrain/model/fused/linear.h"
#include "meshtrain/model/fused/ops.h"

#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <vector>

namespace meshtrain::model::fused {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Embedding : torch::autograd::Function<Embedding> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& weight, const at::Tensor& ids) {
    ctx->save_for_backward({weight, ids});
    return at::embedding(weight, ids);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &w = saved[0], &ids = saved[1];
    if (!ctx->needs_input_grad(0)) return {at::Tensor(), at::Tensor()};
    if (backward_adds_into_grad(w, grads[0])) {
      RECORD_FUNCTION("meshtrain::embedding_grad_in_place", std::vector<c10::IValue>());
      w.mutable_grad().index_add_(0, ids.reshape(-1), grads[0].reshape({-1, w.size(1)}));
      return {at::Tensor(), at::Tensor()};
    }
    return {at::embedding_backward(grads[0], ids, w.size(0), /*padding_idx=*/-1, /*scale_grad_by_freq=*/false,
                                   /*sparse=*/false),
            at::Tensor()};
  }
};

}  // namespace

at::Tensor embedding(const at::Tensor& weight, const at::Tensor& ids) {
  if (!weight.device().is_cpu() || !at::GradMode::is_enabled() || !weight.requires_grad() || !plain(weight)) {
    return at::embedding(weight, ids);
  }
  return Embedding::apply(weight, ids);
}

}  // namespace meshtrain::model::fused
