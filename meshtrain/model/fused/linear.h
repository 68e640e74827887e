// x·Wᵀ + b whose weight gradient is added into W's persistent .grad by the
// product itself (Note [Weight gradients in place]).
#pragma once

#include <ATen/ATen.h>

namespace meshtrain::model::fused {

// Note [Weight gradients in place]
// Where a parameter's .grad persists across backwards (data parallel's flat
// buckets, ZeRO-1's unit buffers), autograd's AccumulateGrad adds each new
// gradient into it: `grad += dW`, a pass that reads two weight-sized tensors
// and writes one, after the product wrote dW into a tensor of its own. This
// linear's backward instead lets the product add into .grad (addmm_ with
// beta = 1, as Megatron's gradient-accumulation fusion does) and hands
// AccumulateGrad no gradient; its post-hooks (data parallel's bucket counts,
// FSDP's reducer) still run. It does so only where AccumulateGrad would have
// taken exactly that in-place branch:
// - grad mode off in backward (no create_graph), anomaly mode off (whose check
//   reads the returned gradients), and the engine running a whole backward,
//   not autograd::grad() over chosen inputs;
// - W a leaf that requires grad, whose .grad is defined, dense, contiguous
//   and of the parameter's dtype (fp32, or bf16 parameters' bf16 gradients;
//   under autocast Note [Weight gradients under autocast]);
// - no hooks on W's accumulator that would see or change the gradient first
//   (register_hook, as tensor parallel's reductions are; post-accumulate hooks);
// - on the CPU: on a GPU the product would run on the node's stream, and an
//   AccumulateGrad handed no gradient orders nothing after it, so a bucket's
//   all-reduce on another stream could read .grad too early.
// The sum is rounded once where the product and the add rounded twice.
// Anywhere else (ZeRO-2 and -3 reset .grad after each reduction) it returns
// dW as at::linear's backward would. Plain tensors only (the model keeps a
// distributed tensor's own operators). Like the in-place add it replaces, it
// assumes one backward at a time per weight.
//
// Note [Weight gradients under autocast]
// Under CPU bf16 autocast, at::linear casts the fp32 weight and bias to bf16,
// and in the backward the bf16 dW goes through the cast's backward into a new
// fp32 tensor that AccumulateGrad adds into .grad: a weight-sized fp32 tensor
// written and read twice beyond the product, per micro-batch. This linear
// casts the weight itself, out of autograd's sight, keeps the bf16 copy for
// the backward as autocast's graph kept it, and adds the bf16 dW into the fp32
// .grad in one pass (kernel add_into) where the conditions above hold;
// elsewhere it returns dW in fp32, as the cast's backward did. Like
// autocast's, whose cache is emptied after each forward, the cast is made at
// each call.
//
// Note [The GLU's output made again]
// A gated MLP's down projection keeps its input, y = act(g) · u, for its
// weight's gradient, while the GLU keeps g and u for its own: three
// hidden-sized tensors per block (at Llama 3.2 1B's width and 4,096 tokens,
// 128 MiB each in fp32). With `glu_made_again` (selective recompute), where x
// is a fused GLU's output (fused::glu_inputs), this linear keeps g and u
// instead, which the GLU keeps anyway, and makes x again from them in its
// backward: a block keeps two of the three for one more elementwise pass (2%
// of a tiny Llama's CPU step, which is why it is not the default). Its
// backward runs before the GLU's, which then may write its gradients over g
// and u (Note [GLU gradients in the saved tensors]);
// while this node keeps them the GLU does not, and autograd lets them go as
// soon as this backward has run.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, bool glu_made_again = false);

// Whether a gradient of `dtype` on `device` may be added into w.grad in place
// of AccumulateGrad, as far as w tells: a leaf that requires grad, whose .grad
// is defined, dense, contiguous and of that dtype and device, with no hooks on
// its accumulator that would see or change the gradient first. The backward's
// own conditions (grad mode, anomaly mode, a whole backward) are the caller's.
bool grad_accumulates_in_place(const at::Tensor& w, at::ScalarType dtype, const at::Device& device);

// Called in a backward: whether it may add a gradient like `like` into w.grad
// in place of AccumulateGrad. Grad mode and anomaly mode are off (no
// create_graph; anomaly mode reads the returned gradients), the engine runs a
// whole backward, not autograd::grad() over chosen inputs, and
// grad_accumulates_in_place holds on the CPU (linear() and embedding() call
// it on the CPU only).
bool backward_adds_into_grad(const at::Tensor& w, const at::Tensor& like);

}  // namespace meshtrain::model::fused
