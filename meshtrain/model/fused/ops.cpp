#include "meshtrain/model/fused/ops.h"

#include "meshtrain/model/fused/kernels.h"
#include "meshtrain/model/fused/tensor_args.h"
#include "meshtrain/util/cpu_features.h"

#include <ATen/DeviceGuard.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>

#include <initializer_list>
#include <optional>

namespace meshtrain::model::fused {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using namespace detail;

// Every operand on `first`'s device (a GPU kernel reads them all through one
// device's pointers), and that device current while the kernels launch.
c10::OptionalDeviceGuard on_device_of(const at::Tensor& first, std::initializer_list<at::Tensor> others) {
  for (const at::Tensor& t : others) {
    TORCH_CHECK(!t.defined() || t.device() == first.device(), "fused operator: an operand on ", t.device(),
                " beside one on ", first.device());
  }
  return c10::OptionalDeviceGuard(at::device_of(first));
}

struct AddNorm : torch::autograd::Function<AddNorm> {
  // Optional tensors are std::optional: autograd's apply() takes no undefined tensors.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const std::optional<at::Tensor>& residual_or,
                               const at::Tensor& weight, const std::optional<at::Tensor>& bias_or, bool rms, double eps) {
    const at::Tensor residual = residual_or.value_or(at::Tensor()), bias = bias_or.value_or(at::Tensor());
    RECORD_FUNCTION("meshtrain::fused_add_norm", std::vector<c10::IValue>());
    const c10::OptionalDeviceGuard on = on_device_of(x, {residual, weight, bias});
    ctx->set_materialize_grads(false);
    const at::Tensor xc = x.contiguous(), rc = residual.defined() ? residual.contiguous() : residual;
    const at::Tensor w = as_float(weight), b = as_float(bias);
    kernel::Norm n;
    n.width = x.size(-1);
    n.rows = x.numel() / n.width;
    n.rms = rms;
    n.eps = static_cast<float>(eps);
    n.weight = fptr(w);
    n.bias = fptr(b);
    const at::ScalarType h_type = rc.defined() ? at::promote_types(x.scalar_type(), rc.scalar_type()) : x.scalar_type();
    const at::Tensor h = rc.defined() ? at::empty(x.sizes(), x.options().dtype(h_type)) : xc;
    const at::Tensor y = at::empty(x.sizes(), x.options().dtype(compute_dtype(h_type, x.device().type())));
    const at::Tensor mean = at::empty({n.rows}, x.options().dtype(at::kFloat)), rstd = at::empty_like(mean);
    table_for(xc).add_norm_forward(n, ptr(xc), dt(xc), ptr(rc), rc.defined() ? dt(rc) : dt(xc), mut(rc.defined() ? h : at::Tensor()),
                                     dt(h), mut(y), dt(y), mean.mutable_data_ptr<float>(), rstd.mutable_data_ptr<float>());
    ctx->save_for_backward({h, w, b, mean, rstd});
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["x_type"] = x.scalar_type();
    ctx->saved_data["r_type"] = rc.defined() ? rc.scalar_type() : x.scalar_type();
    ctx->saved_data["w_type"] = weight.scalar_type();
    ctx->saved_data["has_residual"] = rc.defined();
    if (rc.defined()) return {h, y};
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("meshtrain::fused_add_norm_backward", std::vector<c10::IValue>());
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &h = saved[0], &w = saved[1], &b = saved[2], &mean = saved[3], &rstd = saved[4];
    const bool has_residual = ctx->saved_data["has_residual"].toBool();
    const at::ScalarType x_type = ctx->saved_data["x_type"].toScalarType();
    const at::ScalarType r_type = ctx->saved_data["r_type"].toScalarType();
    const at::ScalarType w_type = ctx->saved_data["w_type"].toScalarType();
    const at::Tensor dh = has_residual && grads[0].defined() ? grads[0].contiguous() : at::Tensor();
    const at::Tensor dy = grads[has_residual ? 1 : 0];
    if (!dy.defined()) {  // only h was used
      return {dh.defined() ? dh.to(x_type) : dh, dh.defined() ? dh.to(r_type) : dh, {}, {}, {}, {}};
    }
    const at::Tensor dyc = dy.contiguous();
    kernel::Norm n;
    n.width = h.size(-1);
    n.rows = h.numel() / n.width;
    n.rms = ctx->saved_data["rms"].toBool();
    n.weight = fptr(w);
    n.bias = fptr(b);
    const at::Tensor dx = at::empty(h.sizes(), h.options().dtype(x_type));
    const at::Tensor dr = has_residual ? at::empty(h.sizes(), h.options().dtype(r_type)) : at::Tensor();
    const at::Tensor dw = at::zeros_like(w), db = b.defined() ? at::zeros_like(b) : at::Tensor();
    table_for(h).add_norm_backward(n, ptr(h), dt(h), ptr(dyc), dt(dyc), ptr(dh), dh.defined() ? dt(dh) : dt(h),
                                      fptr(mean), fptr(rstd), mut(dx), dt(dx), mut(dr), dr.defined() ? dt(dr) : dt(dx),
                                      dw.mutable_data_ptr<float>(), db.defined() ? db.mutable_data_ptr<float>() : nullptr);
    return {dx, dr, dw.to(w_type), db.defined() ? db.to(w_type) : db, {}, {}};
  }
};

struct BiasGelu : torch::autograd::Function<BiasGelu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const std::optional<at::Tensor>& bias_or) {
    const at::Tensor bias = bias_or.value_or(at::Tensor());
    RECORD_FUNCTION("meshtrain::fused_bias_gelu", std::vector<c10::IValue>());
    const c10::OptionalDeviceGuard on = on_device_of(a, {bias});
    const at::Tensor ac = a.contiguous(), b = as_float(bias);
    const at::Tensor y = at::empty_like(ac);
    const int64_t width = a.size(-1);
    table_for(ac).bias_gelu_forward(a.numel() / width, width, ptr(ac), dt(ac), fptr(b), mut(y), dt(y));
    ctx->save_for_backward({ac, b});
    ctx->saved_data["bias_type"] = bias.defined() ? bias.scalar_type() : at::kFloat;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("meshtrain::fused_bias_gelu_backward", std::vector<c10::IValue>());
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &a = saved[0], &b = saved[1];
    const at::Tensor dy = grads[0].contiguous();
    const at::Tensor da = at::empty_like(a), db = b.defined() ? at::zeros_like(b) : at::Tensor();
    const int64_t width = a.size(-1);
    table_for(a).bias_gelu_backward(a.numel() / width, width, ptr(a), dt(a), fptr(b), ptr(dy), dt(dy), mut(da),
                                       dt(da), db.defined() ? db.mutable_data_ptr<float>() : nullptr);
    return {da, db.defined() ? db.to(ctx->saved_data["bias_type"].toScalarType()) : db};
  }
};

// Note [GLU gradients in the saved tensors]
// The gated MLP's backward held five hidden-sized tensors at once: the saved
// g and u, the incoming dy, and the new dg and du (at Llama 3.2 1B's hidden
// width 8,192 and 4,096 tokens, 128 MiB each in fp32). g and u are read only
// by this backward, and the kernel reads each element of g, u and dy before it
// writes that element of dg and du, so dg and du may be written over g and u.
// That is done only where nothing else can see them: the graph is not kept
// for another backward (retain_graph), and the saved tensor's only holders are
// its saved slot and the unpacked copy (no caller, hook or other node keeps
// it; no view shares its storage). Anywhere else they are new tensors.
bool reusable_saved(const at::Tensor& t) {
  return t.use_count() == 2 && !t.is_view() && t.storage().use_count() == 1 && t.is_contiguous();
}

// act(g) · u: SwiGLU, or GeGLU with `gelu`.
struct Glu : torch::autograd::Function<Glu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u, bool gelu) {
    RECORD_FUNCTION(gelu ? "meshtrain::fused_geglu" : "meshtrain::fused_swiglu", std::vector<c10::IValue>());
    const c10::OptionalDeviceGuard on = on_device_of(g, {u});
    const at::Tensor gc = g.contiguous(), uc = u.to(g.scalar_type()).contiguous();
    const at::Tensor y = at::empty_like(gc);
    table_for(gc).glu_forward(gc.numel(), ptr(gc), ptr(uc), mut(y), dt(gc), gelu);
    ctx->save_for_backward({gc, uc});
    ctx->saved_data["u_type"] = u.scalar_type();
    ctx->saved_data["gelu"] = gelu;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool gelu = ctx->saved_data["gelu"].toBool();
    RECORD_FUNCTION(gelu ? "meshtrain::fused_geglu_backward" : "meshtrain::fused_swiglu_backward",
                    std::vector<c10::IValue>());
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &g = saved[0], &u = saved[1];
    const at::Tensor dy = grads[0].to(g.scalar_type()).contiguous();
    // Note [GLU gradients in the saved tensors]
    const bool over = !torch::autograd::get_current_graph_task_keep_graph() && reusable_saved(g) && reusable_saved(u);
    if (over) {
      RECORD_FUNCTION("meshtrain::glu_gradients_over_saved", std::vector<c10::IValue>());
    }
    const at::Tensor dg = over ? g.detach() : at::empty_like(g), du = over ? u.detach() : at::empty_like(u);
    table_for(g).glu_backward(g.numel(), ptr(g), ptr(u), ptr(dy), mut(dg), mut(du), dt(g), gelu);
    return {dg, du.to(ctx->saved_data["u_type"].toScalarType()), at::Tensor()};
  }
};

struct CrossEntropy : torch::autograd::Function<CrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets, int64_t ignore) {
    RECORD_FUNCTION("meshtrain::fused_cross_entropy", std::vector<c10::IValue>());
    const c10::OptionalDeviceGuard on = on_device_of(logits, {targets});
    const at::Tensor lc = logits.contiguous(), tc = targets.to(at::kLong).contiguous();
    const int64_t rows = lc.size(0), vocab = lc.size(1);
    const at::Tensor used = tc != ignore;
    TORCH_CHECK((((tc >= 0) & (tc < vocab)) | used.logical_not()).all().item<bool>(), "cross_entropy: a target is outside ",
                "the vocabulary of ", vocab);
    const at::Tensor lse = at::empty({rows}, lc.options().dtype(at::kFloat)), loss = at::empty_like(lse);
    table_for(lc).cross_entropy_forward(rows, vocab, ptr(lc), dt(lc), tc.const_data_ptr<int64_t>(), ignore,
                                          lse.mutable_data_ptr<float>(), loss.mutable_data_ptr<float>());
    const int64_t count = used.sum().item<int64_t>();
    ctx->save_for_backward({lc, tc, lse});
    ctx->saved_data["count"] = count;
    ctx->saved_data["ignore"] = ignore;
    // No target counting (a fully masked row block) is a loss of 0, not 0 / 0.
    return loss.sum(at::kDouble).div(static_cast<double>(std::max<int64_t>(count, 1))).to(at::kFloat);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("meshtrain::fused_cross_entropy_backward", std::vector<c10::IValue>());
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &logits = saved[0], &targets = saved[1], &lse = saved[2];
    const double count = static_cast<double>(std::max<int64_t>(ctx->saved_data["count"].toInt(), 1));
    const float scale = static_cast<float>(grads[0].item<double>() / count);
    const at::Tensor dlogits = at::empty_like(logits);
    table_for(logits).cross_entropy_backward(logits.size(0), logits.size(1), ptr(logits), dt(logits),
                                           targets.const_data_ptr<int64_t>(), ctx->saved_data["ignore"].toInt(),
                                           fptr(lse), scale, mut(dlogits));
    return {dlogits, {}, {}};
  }
};

// The rotation of x (any strides with the last dim contiguous) into a contiguous result.

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t offset, float sign) {
  const at::Tensor xs = x.stride(-1) == 1 ? x : x.contiguous();
  const at::Tensor y = at::empty(xs.sizes(), xs.options());
  const int64_t sizes[4] = {xs.size(0), xs.size(1), xs.size(2), xs.size(3)};
  kernel::table().rope(sizes, ptr(xs), heads_view(xs), mut(y), heads_view(y), fptr(cos), fptr(sin), offset, sign, dt(xs));
  return y;
}

struct Rope : torch::autograd::Function<Rope> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                            int64_t offset) {
    RECORD_FUNCTION("meshtrain::fused_rope", std::vector<c10::IValue>());
    const at::Tensor c = as_float(cos), s = as_float(sin);
    TORCH_CHECK(x.dim() == 4 && x.size(-1) % 2 == 0 && c.size(-1) * 2 == x.size(-1) && offset + x.size(2) <= c.size(0),
                "rope: x must be [B, H, T, d] with tables [context >= offset + T, d/2]");
    ctx->save_for_backward({c, s});
    ctx->saved_data["offset"] = offset;
    return rotate(x, c, s, offset, 1.0f);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    RECORD_FUNCTION("meshtrain::fused_rope_backward", std::vector<c10::IValue>());
    const variable_list saved = ctx->get_saved_variables();
    return {rotate(grads[0], saved[0], saved[1], ctx->saved_data["offset"].toInt(), -1.0f), {}, {}, {}};
  }
};

}  // namespace

std::optional<GluInputs> glu_inputs(const at::Tensor& y) {
  if (!y.defined() || y.output_nr() != 0) return std::nullopt;
  const auto node = std::dynamic_pointer_cast<torch::autograd::CppNode<Glu>>(y.grad_fn());
  if (!node) return std::nullopt;
  const variable_list saved = node->ctx_.get_saved_variables();
  return GluInputs{saved[0], saved[1], node->ctx_.saved_data.at("gelu").toBool()};
}

bool plain(const at::Tensor& t) { return !t.defined() || !t.key_set().has(c10::DispatchKey::PrivateUse1); }

bool eligible(const at::Tensor& t) {
  const auto kernels_have = [](at::ScalarType type) { return type == at::kFloat || type == at::kBFloat16; };
  // Under autocast the kernels also write its dtype (their outputs, the
  // attention's products): fp16 would get fp32 values in 2-byte elements.
  return t.defined() && plain(t) && t.device().is_cpu() && t.layout() == at::kStrided &&
         kernels_have(t.scalar_type()) && kernels_have(detail::compute_dtype(t.scalar_type()));
}

bool eligible_anywhere(const at::Tensor& t) {
  if (eligible(t)) return true;
  const auto kernels_have = [](at::ScalarType type) { return type == at::kFloat || type == at::kBFloat16; };
  return t.defined() && plain(t) && t.is_cuda() && kernel::gpu_table() != nullptr && t.layout() == at::kStrided &&
         kernels_have(t.scalar_type()) && kernels_have(detail::compute_dtype(t.scalar_type(), at::kCUDA));
}

std::pair<at::Tensor, at::Tensor> add_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                           const at::Tensor& bias, bool rms, double eps) {
  auto optional = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
  const variable_list out = AddNorm::apply(x, optional(residual), weight, optional(bias), rms, eps);
  if (residual.defined()) return {out[0], out[1]};
  return {x, out[0]};
}

at::Tensor bias_gelu(const at::Tensor& a, const at::Tensor& bias) {
  return BiasGelu::apply(a, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
}

at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u) { return Glu::apply(g, u, false); }

at::Tensor geglu(const at::Tensor& g, const at::Tensor& u) { return Glu::apply(g, u, true); }

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
  return CrossEntropy::apply(logits, targets, ignore_index);
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t offset) {
  return Rope::apply(x, cos, sin, offset);
}

const char* kernel_set() { return util::cpu_kernels_name(); }

}  // namespace meshtrain::model::fused
