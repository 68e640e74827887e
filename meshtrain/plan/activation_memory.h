// What a layer and the loss keep, per micro-batch on one rank (Note [Memory
// model]): the terms estimate_memory walks the schedule with.
#pragma once

#include "meshtrain/model/chunked_loss.h"
#include "meshtrain/plan/memory_model.h"

namespace meshtrain::plan {

// Sizes of one micro-batch on a rank, in elements (a cp-th of each sequence
// under context parallel), and the two ways tensor parallel divides them:
// head- and MLP-sized tensors always (split), the rest only with sequence
// parallel (region).
struct Sizes {
  double tokens, u, t;
  bool sp;
  double split(double x) const { return x / t; }
  double region(double x) const { return sp ? x / t : x; }
};

inline Sizes sizes(const model::GptConfig& model, int64_t micro_batch, int64_t tp, bool sp, int64_t cp) {
  const double tokens = static_cast<double>(model.context) * static_cast<double>(micro_batch) / static_cast<double>(cp);
  return {tokens, tokens * static_cast<double>(model.width), static_cast<double>(tp), sp && tp > 1};
}

// The loss's side of one micro-batch on the last stage: what stays saved
// from its forward to its backward (the final norm's and the head's inputs,
// and the fp32 log-softmax — or, with the vocabulary-parallel loss, the
// softmax of this rank's shard), what exists only at the end of the forward
// (the logits, and their fp32 copy when activations are 16-bit), and what
// the loss's backward adds (plain: the gradients of the loss and of the
// logits; vocabulary-parallel: one gradient; parallel/tensor_parallel_ops.cpp).
// The fused loss (Workload::fused_loss, one tensor-parallel rank; model/fused/ops.cpp)
// keeps the logits themselves and a log-sum-exp per row, reads 16-bit
// logits without an fp32 copy, and its backward makes one gradient.
struct OutputBytes {
  double kept, forward, backward;
};
// `when`: when the chunked loss makes its gradients (Note [Chunked loss],
// Note [Head's gradient into .grad]). `torch_loss_parallel`: the whole logits
// through PyTorch's loss_parallel where they are split over the vocabulary
// (Workload::torch_loss_parallel).
OutputBytes output_bytes(const model::GptConfig& model, const Sizes& z, const Precision& p, bool fused_loss,
                         bool chunked_loss, double chunk_bytes, bool norm_kernels, model::LossGradients when,
                         bool torch_loss_parallel = false);

// The model as the step runs it: `fused` says whether the fused CPU operators
// run (Workload::fused_ops), not whether the config asks for them.
model::GptConfig as_run(const model::GptConfig& model, const Workload& w);
// The options a layout's layers are planned with; `model` as run.
ActivationOptions activation_options(const model::GptConfig& model, const Workload& w, const Layout& l);

// Whether the down projection keeps the fused GLU's g and u instead of its
// output (Note [The GLU's output made again]): meshtrain's selective recompute
// (not the op-level policy, which the trainer does not run), the fused
// operators running, and the product the fused linear's (not under autocast,
// whose products are ATen's; not LoRA's frozen base).
bool glu_output_made_again(const model::GptConfig& model, const ActivationOptions& o);

// Gradients alive inside one layer's backward (a MoE layer's with expert parallel degree `ep` and `load`;
// `glu_made_again`: the down projection makes its input again, glu_output_made_again).
double layer_backward_workspace(const model::GptConfig& model, const Sizes& z, const Precision& p, bool moe, int64_t ep,
                                double load, bool glu_made_again = false);

}  // namespace meshtrain::plan
