// q, k and v from the fused qkv projection's output in one node, RoPE
// included (Note [Heads from the fused projection]).
#include "meshtrain/model/fused/kernels.h"
#include "meshtrain/model/fused/ops.h"
#include "meshtrain/model/fused/tensor_args.h"

#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <vector>

namespace meshtrain::model::fused {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using namespace detail;

// [B, heads, T, hd] among the outputs of a contiguous [B, T, N], each head
// where `offsets` puts it.
kernel::HeadsView among_outputs(const at::Tensor& fused, const std::vector<int64_t>& offsets) {
  kernel::HeadsView v;
  v.batch = fused.size(1) * fused.size(2);
  v.step = fused.size(2);
  v.head_offsets = offsets.data();
  return v;
}

// The heads at `offsets` (evenly spaced, as k's and v's are) as a strided view of `fused`.
at::Tensor spaced_heads(const at::Tensor& fused, const std::vector<int64_t>& offsets, int64_t hd) {
  const int64_t heads = static_cast<int64_t>(offsets.size()), t = fused.size(1), n = fused.size(2);
  const int64_t spacing = heads > 1 ? offsets[1] - offsets[0] : hd;
  for (int64_t h = 1; h < heads; ++h) {
    TORCH_CHECK(offsets[h] - offsets[h - 1] == spacing, "rotated_heads: v's heads are not evenly spaced");
  }
  return fused.as_strided({fused.size(0), heads, t, hd}, {t * n, spacing, n, 1},
                          fused.storage_offset() + offsets[0]);
}

struct RotatedHeads : torch::autograd::Function<RotatedHeads> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& fused, const std::vector<int64_t>& q_offsets,
                               const std::vector<int64_t>& k_offsets, const std::vector<int64_t>& v_offsets,
                               int64_t hd, const at::Tensor& cos, const at::Tensor& sin) {
    RECORD_FUNCTION("meshtrain::fused_rotated_heads", std::vector<c10::IValue>());
    const at::Tensor c = as_float(cos), s = as_float(sin);
    const int64_t b = fused.size(0), t = fused.size(1);
    TORCH_CHECK(fused.dim() == 3 && fused.is_contiguous() && hd % 2 == 0 && c.size(-1) * 2 == hd && t <= c.size(0),
                "rotated_heads: the projection's output must be a contiguous [B, T, N] with tables [context >= T, hd/2]");
    TORCH_CHECK(static_cast<int64_t>(q_offsets.size() + k_offsets.size() + v_offsets.size()) * hd == fused.size(2),
                "rotated_heads: q, k and v's heads must cover the projection's outputs");
    auto rotated = [&](const std::vector<int64_t>& offsets) {
      const at::Tensor y = at::empty({b, static_cast<int64_t>(offsets.size()), t, hd}, fused.options());
      const int64_t sizes[4] = {y.size(0), y.size(1), y.size(2), y.size(3)};
      kernel::table().rope(sizes, ptr(fused), among_outputs(fused, offsets), mut(y), heads_view(y), fptr(c),
                           fptr(s), 0, 1.0f, dt(fused));
      return y;
    };
    ctx->save_for_backward({c, s});
    ctx->saved_data["q"] = q_offsets;
    ctx->saved_data["k"] = k_offsets;
    ctx->saved_data["v"] = v_offsets;
    ctx->saved_data["sizes"] = fused.sizes().vec();
    const at::Tensor v = at::empty({b, static_cast<int64_t>(v_offsets.size()), t, hd}, fused.options());
    v.copy_(spaced_heads(fused, v_offsets, hd));  // a tensor of its own even where the view is contiguous
    return {rotated(q_offsets), rotated(k_offsets), v};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("meshtrain::fused_rotated_heads_backward", std::vector<c10::IValue>());
    const variable_list saved = ctx->get_saved_variables();
    const std::vector<int64_t> sizes = ctx->saved_data["sizes"].toIntVector();
    const std::vector<int64_t> q = ctx->saved_data["q"].toIntVector(), k = ctx->saved_data["k"].toIntVector(),
                               v = ctx->saved_data["v"].toIntVector();
    const int64_t hd = saved[0].size(-1) * 2;
    // Autograd hands zeros for an output no one used (the function's grads are materialized).
    const at::Tensor d = at::empty(sizes, grads[0].options());
    auto rotate_back = [&](const at::Tensor& g, const std::vector<int64_t>& offsets) {
      const at::Tensor gs = g.stride(-1) == 1 ? g : g.contiguous();
      const int64_t shape[4] = {gs.size(0), gs.size(1), gs.size(2), gs.size(3)};
      kernel::table().rope(shape, ptr(gs), heads_view(gs), mut(d), among_outputs(d, offsets), fptr(saved[0]),
                           fptr(saved[1]), 0, -1.0f, dt(gs));
    };
    rotate_back(grads[0], q);
    rotate_back(grads[1], k);
    spaced_heads(d, v, hd).copy_(grads[2]);
    return {d, {}, {}, {}, {}, {}, {}};
  }
};

}  // namespace

std::array<at::Tensor, 3> rotated_heads(const at::Tensor& fused, const std::array<std::vector<int64_t>, 3>& offsets,
                                        int64_t head_dim, const at::Tensor& cos, const at::Tensor& sin) {
  const variable_list out = RotatedHeads::apply(fused, offsets[0], offsets[1], offsets[2], head_dim, cos, sin);
  return {out[0], out[1], out[2]};
}

}  // namespace meshtrain::model::fused
