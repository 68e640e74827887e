#include "meshtrain/model/chunked_loss.h"

#include "meshtrain/model/batch.h"
#include "meshtrain/model/fused/kernels.h"
#include "meshtrain/model/fused/linear.h"
#include "meshtrain/model/fused/ops.h"
#include "meshtrain/model/fused/tensor_args.h"

#include <ATen/DeviceGuard.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>

namespace meshtrain::model {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What a matmul on `t`'s device computes in now: autocast's dtype when it is on.
at::ScalarType compute_dtype(const at::Tensor& t) {
  const at::DeviceType type = t.is_cuda() ? at::kCUDA : at::kCPU;
  return at::autocast::is_autocast_enabled(type) ? at::autocast::get_autocast_dtype(type) : t.scalar_type();
}

// Where each row's target is in this rank's share of V entries, [N, 1] each:
// `index` its column (clamped into the share), `here` 1 where it is counted
// and in the share, `counted` 1 where it is not kIgnoredTarget.
struct TargetColumns {
  at::Tensor index, here, counted;
  TargetColumns rows(int64_t start, int64_t length) const {
    return {index.narrow(0, start, length), here.narrow(0, start, length), counted.narrow(0, start, length)};
  }
};

TargetColumns target_columns(const at::Tensor& targets, int64_t start, int64_t v) {
  const at::Tensor counted = targets != kIgnoredTarget, local = targets - start;
  return {local.clamp(0, v - 1).unsqueeze(1), (counted & (local >= 0) & (local < v)).unsqueeze(1).to(at::kFloat),
          counted.unsqueeze(1).to(at::kFloat)};
}

// The head's weight in the dtype products take, with zero rows up to a
// multiple of `pad` (0: kGpuPadRows on a GPU, none on the CPU; Note [Chunked loss]).
at::Tensor head_weight(const at::Tensor& weight, at::ScalarType compute, int64_t pad) {
  const int64_t multiple = pad > 0 ? pad : weight.is_cuda() ? kGpuPadRows : 1;
  const int64_t v = weight.size(0), padded = (v + multiple - 1) / multiple * multiple;
  if (padded == v) return weight.to(compute).contiguous();
  return at::constant_pad_nd(weight.to(compute), {0, 0, 0, padded - v});
}

// One chunk's logits of rows h against the first v rows of w, in fp32
// (soft-capped); tanh(z / c) under the cap; and the product's own buffer
// [rows, w's rows] in the compute dtype, 0 past column v.
struct ChunkLogits {
  at::Tensor z, t, product;
};

ChunkLogits chunk_logits(const at::Tensor& h, const at::Tensor& w, int64_t v, double softcap) {
  ChunkLogits c;
  c.product = at::mm(h, w.t());
  c.z = c.product.narrow(1, 0, v).to(at::kFloat);
  if (softcap > 0) {
    c.t = c.z.div_(softcap).tanh_();
    c.z = c.t * softcap;
  }
  return c;
}

// The targets as the fused cross-entropy kernel reads them (int64,
// kIgnoredTarget where none counts), where it computes a chunk's reductions
// and dz (Note [Chunked loss]): model.fused on the CPU (or a GPU where the build
// has its kernels, Note [Fused CUDA kernels]), the whole vocabulary on this
// rank from entry 0, no soft-cap or z-loss. A counted target outside the
// vocabulary is then one no share holds, which the kernel counts as the
// composition does (the row's log-sum-exp); no check of them here, which on a
// GPU would wait for the device every step. Else undefined.
at::Tensor kernel_targets(const at::Tensor& targets, const at::Tensor& hidden, bool fused, bool whole, int64_t start,
                          double softcap, double z_loss) {
  const bool kernels = hidden.is_cpu() || (hidden.is_cuda() && fused::kernel::gpu_table() != nullptr);
  if (!fused || !whole || start != 0 || softcap > 0 || z_loss > 0 || !kernels || targets.device() != hidden.device()) {
    return {};
  }
  return targets.to(at::kLong).contiguous();
}

// Whether the kernel reads z: contiguous fp32 or bf16 (not fp16, which a GPU's autocast may make).
bool kernel_takes(const at::Tensor& z) {
  return z.is_contiguous() && (z.scalar_type() == at::kFloat || z.scalar_type() == at::kBFloat16);
}

// The chunk's reductions through the kernel: each row's log-sum-exp into
// `lse` [m, 1] (contiguous), the sum of the rows' losses returned.
at::Tensor kernel_loss(const at::Tensor& z, const at::Tensor& targets, at::Tensor& lse) {
  RECORD_FUNCTION("meshtrain::cross_entropy_rows", std::vector<c10::IValue>());
  const c10::OptionalDeviceGuard on(at::device_of(z));  // a GPU's launch goes to z's device's stream
  const at::Tensor rows = at::empty({z.size(0)}, z.options());
  fused::detail::table_for(z).cross_entropy_forward(z.size(0), z.size(1), z.const_data_ptr(), fused::detail::dt(z),
                                               targets.const_data_ptr<int64_t>(), kIgnoredTarget,
                                               lse.mutable_data_ptr<float>(), rows.mutable_data_ptr<float>());
  return rows.sum();
}

// z [m, V] turned in place into dz = softmax − onehot (0 in uncounted rows) from each row's log-sum-exp.
void kernel_dz(at::Tensor& z, const at::Tensor& targets, const at::Tensor& lse) {
  RECORD_FUNCTION("meshtrain::cross_entropy_rows_backward", std::vector<c10::IValue>());
  const c10::OptionalDeviceGuard on(at::device_of(z));
  fused::detail::table_for(z).cross_entropy_backward(z.size(0), z.size(1), z.const_data_ptr(), fused::detail::dt(z),
                                                targets.const_data_ptr<int64_t>(), kIgnoredTarget,
                                                lse.const_data_ptr<float>(), 1.0f, z.mutable_data_ptr());
}

// The chunk's gradients from dz: dh's rows (`dh`, undefined for none) and dW
// added into `dw` (undefined for none; as many rows as w) times `dw_alpha`,
// both times `scale` where it is defined. dz in the compute dtype goes into
// `product`, the chunk's product buffer, whose padded columns are 0.
void product_gradients(at::Tensor dz, const at::Tensor& h, const at::Tensor& w, at::Tensor product,
                       const at::Tensor& scale, at::Tensor dh, at::Tensor& dw, double dw_alpha = 1.0) {
  if (scale.defined()) dz.mul_(scale);
  const at::ScalarType compute = h.scalar_type();
  product.narrow(1, 0, dz.size(1)).copy_(dz);  // a no-op where dz is that buffer (fp32, no cap)
  const at::Tensor& d = product;
  if (dh.defined()) at::mm_out(dh, d, w);
  if (dw.defined() && compute == at::kFloat) dw.addmm_(d.t(), h, 1.0, dw_alpha);
  if (!dw.defined() || compute == at::kFloat) return;
  // A 16-bit product's result is 16-bit: made a slice of the vocabulary at a
  // time, each no larger than the chunk's logits, not the weight's size at once.
  const int64_t v = dw.size(0), slice = std::max<int64_t>(1, d.size(0) * v / std::max<int64_t>(1, dw.size(1)));
  for (int64_t first = 0; first < v; first += slice) {
    const int64_t n = std::min(slice, v - first);
    dw.narrow(0, first, n).add_(at::mm(d.narrow(1, first, n).t(), h), dw_alpha);
  }
}

// The same from the chunk's softmax (turned into dz in place).
void add_gradients(at::Tensor softmax, const at::Tensor& t, double softcap, const TargetColumns& c, const at::Tensor& h,
                   const at::Tensor& w, at::Tensor product, const at::Tensor& scale, at::Tensor dh, at::Tensor& dw,
                   double dw_alpha = 1.0) {
  at::Tensor dz = softmax.scatter_add_(1, c.index, c.here.neg()).mul_(c.counted);
  if (softcap > 0) dz.mul_(t.mul_(t).neg_().add_(1.0f));  // times 1 − tanh²
  product_gradients(dz, h, w, product, scale, dh, dw, dw_alpha);
}

struct ChunkedCrossEntropy : torch::autograd::Function<ChunkedCrossEntropy> {
  // hidden [N, d], weight [V', d] (entries shard.start.. of the vocabulary),
  // targets [N]; dh (`hidden_grad`) and dW (`weight_grad`, not for a frozen
  // head) made `when` asked (Note [Chunked loss]).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& targets, double softcap, int64_t chunk_rows, const VocabShard& shard,
                            LossGradients when, int64_t pad, bool hidden_grad, bool weight_grad, bool fused,
                            double loss_weight, double z_loss) {
    const bool gradients = hidden_grad || weight_grad, now = gradients && when != LossGradients::kInBackward;
    RECORD_FUNCTION("meshtrain::chunked_cross_entropy", std::vector<c10::IValue>());
    const at::ScalarType compute = compute_dtype(hidden);
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor h = hidden.to(compute).contiguous(), w = head_weight(weight, compute, pad);
    const int64_t n = h.size(0), v = weight.size(0);
    const int64_t rows = chunk_rows > 0 ? chunk_rows : std::max<int64_t>(1, loss_chunk_bytes(h.is_cuda()) / (4 * v));
    const at::TensorOptions fp32 = h.options().dtype(at::kFloat);
    const TargetColumns columns = target_columns(targets, shard.start, v);
    const at::Tensor by_kernel = kernel_targets(targets, h, fused, !shard.split(), shard.start, softcap, z_loss);
    at::Tensor loss_sum = at::zeros({}, fp32);
    const at::Tensor count = columns.counted.sum().clamp_min(1);
    at::Tensor dh, dw, lse;
    double dw_alpha = 1.0;  // Note [Head's gradient into .grad]: weight / count
    const bool into_grad = now && weight_grad && when == LossGradients::kIntoWeightGrad && h.is_cpu() &&
                           w.size(0) == v && fused::grad_accumulates_in_place(weight, at::kFloat, weight.device());
    if (now && hidden_grad) dh = at::empty_like(h);
    if (into_grad) {
      RECORD_FUNCTION("meshtrain::head_gradient_into_grad", std::vector<c10::IValue>());  // marks the path in profiles
      dw = weight.mutable_grad();
      dw_alpha = loss_weight / count.item<double>();
    } else if (now && weight_grad) {
      dw = at::zeros({w.size(0), w.size(1)}, fp32);
    }
    if (gradients && !now) lse = at::empty({n, 1}, fp32);
    for (int64_t r = 0; r < n; r += rows) {
      const int64_t m = std::min(rows, n - r);
      const at::Tensor hc = h.narrow(0, r, m);
      const TargetColumns c = columns.rows(r, m);
      auto [z, t, product] = chunk_logits(hc, w, v, softcap);
      if (by_kernel.defined() && kernel_takes(z)) {
        const at::Tensor rows_targets = by_kernel.narrow(0, r, m);
        at::Tensor row_lse = lse.defined() ? lse.narrow(0, r, m) : at::empty({m, 1}, fp32);
        loss_sum += kernel_loss(z, rows_targets, row_lse);
        if (now) {
          kernel_dz(z, rows_targets, row_lse);
          product_gradients(z, hc, w, product, {}, dh.defined() ? dh.narrow(0, r, m) : dh, dw, dw_alpha);
        }
        continue;
      }
      at::Tensor top = at::amax(z, 1, /*keepdim=*/true);
      if (shard.split()) shard.max(top);
      const at::Tensor target = z.gather(1, c.index).mul_(c.here);  // 0 where another share holds it
      const at::Tensor e = z.sub_(top).exp_();                       // z's buffer, exp(z − top)
      // [Σ exp(z − top), the target's logit] per row, summed over the shares.
      at::Tensor sums = at::cat({e.sum(1, /*keepdim=*/true), target}, 1);
      if (shard.split()) shard.sum(sums);
      const at::Tensor total = sums.narrow(1, 0, 1), row_lse = total.log() + top;
      loss_sum += ((row_lse - sums.narrow(1, 1, 1)) * c.counted).sum();
      if (z_loss > 0) loss_sum += (row_lse.square() * c.counted).sum() * z_loss;
      if (lse.defined()) lse.narrow(0, r, m).copy_(row_lse);
      if (now) {
        const at::Tensor softmax = e.div_(total);
        if (z_loss > 0) softmax.mul_(row_lse * (2 * z_loss) + 1);  // the z-loss's share of dz
        add_gradients(softmax, t, softcap, c, hc, w, product, {}, dh.defined() ? dh.narrow(0, r, m) : dh, dw, dw_alpha);
      }
    }
    auto& saved = ctx->saved_data;
    saved["count"] = count;
    saved["gradients"] = gradients;
    if (dh.defined()) saved["dh"] = dh;
    if (into_grad) {
      saved["into_grad"] = loss_weight;
    } else if (dw.defined()) {
      saved["dw"] = dw.narrow(0, 0, v);  // without the padded rows
    }
    if (lse.defined()) {  // what the backward makes the gradients from
      ctx->save_for_backward({h, weight, targets, lse});
      saved["softcap"] = softcap;
      saved["z_loss"] = z_loss;
      saved["rows"] = rows;
      saved["pad"] = pad;
      saved["start"] = shard.start;
      saved["hidden_grad"] = hidden_grad;
      saved["weight_grad"] = weight_grad;
      saved["kernel"] = by_kernel.defined();  // the fused kernel's reductions (kernel_targets)
    }
    saved["hidden_type"] = hidden.scalar_type();
    saved["weight_type"] = weight.scalar_type();
    return loss_sum / count;
  }

  // kInBackward: each chunk's logits again, their softmax from the saved
  // log-sum-exp (already over every share: no collective), scaled by `g`.
  static void make_gradients(AutogradContext* ctx, const at::Tensor& g) {
    auto& saved = ctx->saved_data;
    const variable_list in = ctx->get_saved_variables();
    const at::Tensor& h = in[0];
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor w = head_weight(in[1], h.scalar_type(), saved["pad"].toInt());
    const double softcap = saved["softcap"].toDouble(), z_loss = saved["z_loss"].toDouble();
    const int64_t n = h.size(0), v = in[1].size(0), rows = saved["rows"].toInt();
    const TargetColumns columns = target_columns(in[2], saved["start"].toInt(), v);
    const at::Tensor by_kernel = saved["kernel"].toBool() ? in[2].to(at::kLong).contiguous() : at::Tensor();
    at::Tensor dh, dw;
    if (saved["hidden_grad"].toBool()) dh = at::empty_like(h);
    if (saved["weight_grad"].toBool()) dw = at::zeros({w.size(0), w.size(1)}, h.options().dtype(at::kFloat));
    for (int64_t r = 0; r < n; r += rows) {
      const int64_t m = std::min(rows, n - r);
      const at::Tensor hc = h.narrow(0, r, m);
      const TargetColumns c = columns.rows(r, m);
      auto [z, t, product] = chunk_logits(hc, w, v, softcap);
      if (by_kernel.defined() && kernel_takes(z)) {
        kernel_dz(z, by_kernel.narrow(0, r, m), in[3].narrow(0, r, m));
        product_gradients(z, hc, w, product, g, dh.defined() ? dh.narrow(0, r, m) : dh, dw);
        continue;
      }
      const at::Tensor row_lse = in[3].narrow(0, r, m), softmax = z.sub_(row_lse).exp_();
      if (z_loss > 0) softmax.mul_(row_lse * (2 * z_loss) + 1);
      add_gradients(softmax, t, softcap, c, hc, w, product, g, dh.defined() ? dh.narrow(0, r, m) : dh, dw);
    }
    if (dh.defined()) saved["dh"] = dh;
    if (dw.defined()) saved["dw"] = dw.narrow(0, 0, v);
  }

  // Scales the forward's dh and dW by the loss's gradient in place (or makes
  // them scaled): they are handed on, not copied, so a second backward
  // through one loss finds none.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& saved = ctx->saved_data;
    TORCH_CHECK(saved["gradients"].toBool(), "chunked_cross_entropy: a gradient asked of a loss made without one");
    TORCH_CHECK(!saved.count("handed_on"),
                "chunked_cross_entropy: a second backward through one loss (retain_graph); compute the loss again");
    saved["handed_on"] = true;
    if (saved.count("into_grad")) {  // Note [Head's gradient into .grad]
      const double told = saved["into_grad"].toDouble(), came = grads[0].item<double>();
      TORCH_CHECK(std::abs(came - told) <= 1e-6 * std::abs(told),  // fp32's rounding of the weight: 6e-8
                  "chunked_cross_entropy: the loss's gradient is ", came, " where its forward added the head's "
                  "gradient into .grad for ", told, " (LossGradients::kIntoWeightGrad: multiply the loss by the "
                  "weight it was given, and call backward on it at once)");
    }
    const at::Tensor g = grads[0].to(at::kFloat) / saved["count"].toTensor();
    const bool in_backward = saved.count("rows") > 0;
    if (in_backward) make_gradients(ctx, g);
    auto handed_on = [&](const char* name, const char* type) {
      auto it = saved.find(name);
      if (it == saved.end()) return at::Tensor();
      at::Tensor d = it->second.toTensor().to(saved[type].toScalarType());
      saved.erase(it);
      return in_backward ? d : d.mul_(g);
    };
    return {handed_on("dh", "hidden_type"), handed_on("dw", "weight_type"), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// whole_logits_cross_entropy: the mean cross-entropy and z-loss of logits
// given whole, as chunked_cross_entropy makes them over one chunk (without its
// soft-cap; a target outside the vocabulary counts 0 for its logit, as there).
struct WholeLogitsCrossEntropy : torch::autograd::Function<WholeLogitsCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets, double z_loss) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor z = logits.to(at::kFloat), lse = at::logsumexp(z, 1, /*keepdim=*/true);
    const TargetColumns c = target_columns(targets, 0, z.size(1));
    const at::Tensor count = c.counted.sum().clamp_min(1);
    at::Tensor rows = lse - z.gather(1, c.index) * c.here;
    if (z_loss > 0) rows = rows + lse.square() * z_loss;
    ctx->save_for_backward({logits, targets, lse, count});
    ctx->saved_data["z_loss"] = z_loss;
    return (rows * c.counted).sum() / count;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list in = ctx->get_saved_variables();
    const at::Tensor &logits = in[0], &lse = in[2];
    const double z_loss = ctx->saved_data["z_loss"].toDouble();
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const TargetColumns c = target_columns(in[1], 0, logits.size(1));
    // The softmax in fp32, a tensor of its own: 16-bit logits copied once (ATen's
    // mixed-type sub would copy them and then write a second tensor).
    at::Tensor dz = logits.scalar_type() == at::kFloat ? at::sub(logits, lse) : logits.to(at::kFloat).sub_(lse);
    dz.exp_();
    if (z_loss > 0) dz.mul_(lse * (2 * z_loss) + 1);
    dz.scatter_add_(1, c.index, c.here.neg()).mul_(c.counted * (grads[0].to(at::kFloat) / in[3]));
    return {dz.to(logits.scalar_type()), at::Tensor(), at::Tensor()};
  }
};

// The whole logits y·Wᵀ of a head tied to the embedding, with W's gradient
// made as a tensor of its own (Note [Tied head's gradient]).
struct TiedHeadProduct : torch::autograd::Function<TiedHeadProduct> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight) {
    ctx->save_for_backward({hidden, weight});
    return at::linear(hidden, weight);
  }

  static torch::autograd::variable_list backward(AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& hidden = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor dz = grads[0].reshape({-1, grads[0].size(-1)});
    at::Tensor dh, dw;
    if (ctx->needs_input_grad(0)) dh = at::mm(dz, weight).view(hidden.sizes());
    if (ctx->needs_input_grad(1)) dw = at::mm(dz.t(), hidden.reshape({-1, hidden.size(-1)}));
    return {dh, dw};
  }
};

}  // namespace

at::Tensor tied_head_logits(const at::Tensor& hidden, const at::Tensor& weight) {
  const bool own_gradient = fused::plain(hidden) && fused::plain(weight) && hidden.layout() == at::kStrided &&
                            at::isFloatingType(weight.scalar_type()) && hidden.scalar_type() == weight.scalar_type() &&
                            !at::autocast::is_autocast_enabled(hidden.device().type()) &&
                            torch::GradMode::is_enabled() && weight.requires_grad();
  return own_gradient ? TiedHeadProduct::apply(hidden, weight) : at::linear(hidden, weight);
}

at::Tensor chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                 double softcap, int64_t chunk_rows, const VocabShard& shard, LossGradients when,
                                 int64_t pad_rows_to, bool fused, double loss_weight, double z_loss) {
  const bool grad_mode = torch::GradMode::is_enabled();
  const at::Tensor flat = hidden.reshape({-1, hidden.size(-1)});
  TORCH_CHECK(targets.numel() == flat.size(0), "chunked_cross_entropy: ", targets.numel(), " targets for ", flat.size(0),
              " rows of the head's input");
  return ChunkedCrossEntropy::apply(flat, weight, targets.reshape({-1}).to(at::kLong), softcap, chunk_rows, shard, when,
                                    pad_rows_to, grad_mode && hidden.requires_grad(), grad_mode && weight.requires_grad(),
                                    fused, loss_weight, grad_mode ? z_loss : 0.0);
}

at::Tensor whole_logits_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, double z_loss) {
  return WholeLogitsCrossEntropy::apply(logits, targets.reshape({-1}).to(at::kLong), z_loss);
}

}  // namespace meshtrain::model
