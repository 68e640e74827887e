// A table lookup whose backward adds the rows' gradients into the table's
// persistent .grad (Note [Embedding gradients in place]).
#pragma once

#include <ATen/ATen.h>

namespace meshtrain::model::fused {

// Note [Embedding gradients in place]
// ATen's embedding backward makes a dense gradient of the whole table, zeroes
// it, adds each looked-up row's gradient into it, and AccumulateGrad then
// adds it into .grad: at Llama 3's vocabulary and width 2,048 that is a
// 1,002 MiB fp32 tensor made and written twice, for the few thousand rows a
// micro-batch touches. It is the largest tensor alive at the end of a
// recomputed step's backward. Where .grad persists (data parallel's bucket
// views, ZeRO-1's unit buffers) this lookup's backward instead adds the rows'
// gradients into it with index_add_ and hands AccumulateGrad no gradient; its
// post-hooks still run. The conditions are Note [Weight gradients in place]'s
// (fused::backward_adds_into_grad): a whole backward with grad mode and
// anomaly mode off, a leaf table with a dense contiguous .grad of the
// gradient's dtype, no hooks on its accumulator, and the CPU. A table tied to
// the head gets both: the loss's rows of dW (or its dW in the forward, Note
// [Head's gradient into .grad]) and the lookup's rows add into one .grad.
// Anywhere else the backward is ATen's.
at::Tensor embedding(const at::Tensor& weight, const at::Tensor& ids);

}  // namespace meshtrain::model::fused
