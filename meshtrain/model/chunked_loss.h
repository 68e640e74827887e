// The language-model loss without the [tokens, vocabulary] logits: the
// output projection and cross-entropy over chunks of rows (Note [Chunked loss]).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>

namespace meshtrain::model {

// Note [Chunked loss]
// The loss of a step is mean over the counted targets of lse(z) − z[target]
// with z = h·Wᵀ (c·tanh(z/c) under Gemma 2's logit soft-cap). Materialised,
// z is tokens × vocabulary, in fp32 for the log-softmax: at Llama 3's 128,256
// entries and 8K tokens 4 GB, and its gradient as much again — the largest
// tensors of a small model's step. Here the rows go through in chunks of at
// most loss_chunk_bytes of fp32 logits: each chunk's logits are made (in the
// autocast dtype where autocast is on, as the head's linear would), reduced
// to a log-sum-exp and the target's logit, and, when a gradient will be
// asked, turned at once into the chunk's gradient dz = softmax − onehot
// (times 1 − tanh² under the cap), which gives dh for its rows and adds into
// dW, so nothing of the chunk outlives it. The log-sum-exp is taken in the
// chunk's own buffer (its row maximum subtracted, exponentiated in place), so
// the softmax needs no second one. The loss is the last operation of a
// forward, so its backward follows directly: it scales the dh and dW the
// forward made by the loss's gradient, in place. Work: the same three
// products as the head's forward and backward, none done twice. Memory: one
// chunk's logits, plus dh (the size of the head's input) and dW (the size of
// the weight; none with LossGradients::kIntoWeightGrad, Note [Head's gradient
// into .grad]) from the loss's forward to its backward; at one chunk that is
// about what the whole logits cost. Rows whose target is kIgnoredTarget count
// toward nothing; with none counting the loss is 0. With model.fused on the
// CPU, the whole vocabulary on the rank, no soft-cap, every counted target
// inside the vocabulary and the chunk's logits contiguous (W unpadded), a
// chunk's log-sum-exp, losses and dz come from the fused cross-entropy kernel
// (Note [Fused operators]): two passes over the chunk where ATen's operators take seven
// (amax, subtract, exp, sum, gather, divide, scatter); in Llama 3.1's family
// config (chunks of 1,024 x 256) the loss's forward took 5.1 to 4.1 ms of a
// 185 ms step, 2.7 of them its three products.
//
// The output z-loss (model.z_loss = β > 0, PaLM's auxiliary term) adds
// β·lse² per counted row to the loss, which keeps the softmax's normaliser
// near 1 (lse near 0) and the bf16 logits in range. It takes no product and
// no logits-sized tensor more: the log-sum-exp is made for the loss anyway,
// and its gradient only scales each row's softmax, dz = (1 + 2β·lse)·softmax
// − onehot. The fused kernel's reductions do not take it (ATen's operators
// then). It is a training term: without grad mode (evaluation, perplexity)
// the loss is the cross-entropy.
//
// A pipeline's last stage may hold several micro-batches' losses before
// their backwards (GPipe all of them), and a dW each would be the weight's
// size times as many: there the gradients are made in the backward
// (LossGradients::kInBackward). The forward keeps only its input and each
// row's log-sum-exp; the backward makes each chunk's logits again, a fourth
// product over the head.
//
// A weight split over the vocabulary (tensor parallel's head: rows
// [start, start + V/t) on each rank) gives each rank a chunk's logits for its
// entries only: the row maxima are reduced by their maximum over the ranks,
// the sums of exponentials and the targets' logits (0 where the target is
// another rank's) by their sum: two collectives per chunk, of one and two
// values per row;
// dW is then the rank's own, and dh a partial sum the caller's collective
// completes in the backward. Every rank holds the same rows, so all make the
// same number of chunks. The planner counts this (Workload::chunked_loss).
//
// On a GPU two things change (measured on an H200, docs/BENCHMARKS.md). A
// chunk holds up to kGpuChunkBytes: a 16-bit dW product is added into the
// fp32 dW once per chunk, and at Llama 3's vocabulary those adds took a tenth
// of the step at 256 MiB chunks. And a vocabulary that is not a multiple of
// 64 (GPT-2's 50,257) is padded with zero rows of W: cuBLAS multiplies
// matrices whose rows are not 16-byte aligned with kernels several times
// slower. The padded columns' logits are exactly 0 and no reduction reads
// them; the chunk's product buffer, zero there, holds the padded dz, and the
// padded rows of dW are dropped.
constexpr int64_t kChunkBytes = int64_t{256} << 20;
constexpr int64_t kGpuChunkBytes = int64_t{1} << 30;
constexpr int64_t kGpuPadRows = 64;
inline int64_t loss_chunk_bytes(bool gpu) { return gpu ? kGpuChunkBytes : kChunkBytes; }

// The weight's share of the vocabulary: its rows are entries [start,
// start + rows), and `max` / `sum` reduce a tensor in place over the ranks
// holding the other shares. Default: the whole vocabulary on this rank.
struct VocabShard {
  int64_t start = 0;
  std::function<void(at::Tensor&)> max, sum;
  bool split() const { return static_cast<bool>(sum); }
};

// Note [Head's gradient into .grad]
// Made in the forward, dW waits for the backward at the weight's size: at
// Llama 3's vocabulary and width 2,048 that is 1,002 MiB in fp32, alive
// through the peak at the forward's end. A training step knows the gradient
// its backward will bring to the loss before the forward runs: the loss is
// multiplied by the micro-batch's weight and its backward called at once
// (parallel::StepEngine, and a pipeline's last stage where one loss is in
// flight: 1F1B and its interleaved form). There the loss's forward adds
// dW · weight / count straight into the weight's persistent .grad (data
// parallel's bucket view, ZeRO-1's buffer) and holds no dW; its backward
// hands AccumulateGrad no gradient, whose post-hooks (the bucket counts)
// still run, and checks that the gradient which came is the weight it was
// told, failing loudly where it is not. Taken on the CPU, under
// fused::grad_accumulates_in_place's conditions on the weight (.grad fp32,
// dense and contiguous; no hook that would see or change the gradient first,
// so post-hooks such as the bucket's still run; tensor parallel's vocabulary
// share has none) and with the
// weight unpadded; elsewhere it is kInForward. The caller promises one
// backward at once over the whole graph, with .grad left as it was between
// the forward and it. The profile marks the path
// (meshtrain::head_gradient_into_grad).
//
// When the gradients are made: in the forward, held to the backward (three
// products); in the backward from the logits made again (four); or in the
// forward with dW added into the weight's .grad (Note [Head's gradient into .grad]).
enum class LossGradients { kInForward, kInBackward, kIntoWeightGrad };

// The mean loss over `targets` [N] of hidden [N, d] against weight [V, d],
// soft-capped by `softcap` > 0; `chunk_rows` > 0 sets the rows per chunk
// (0: as many as loss_chunk_bytes of this rank's logits hold). Differentiable in
// hidden and weight. `shard`: the weight's share of the vocabulary.
// `pad_rows_to` > 0 pads W's rows to a multiple of it wherever the loss runs
// (0: as the device asks, kGpuPadRows on a GPU, none on the CPU; the CPU's
// tests take the GPU's padded path with it). `fused`: model.fused, the fused
// CPU kernel's reductions where they apply. `loss_weight`: what the caller
// multiplies the loss by before its backward (kIntoWeightGrad's scale).
// `z_loss`: the z-loss weight β (under grad mode only).
at::Tensor chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                 double softcap = 0, int64_t chunk_rows = 0, const VocabShard& shard = {},
                                 LossGradients when = LossGradients::kInForward, int64_t pad_rows_to = 0,
                                 bool fused = false, double loss_weight = 1.0, double z_loss = 0);

// The mean cross-entropy of whole logits [N, V] against targets [N] plus the
// z-loss of weight `z_loss`, as one node: it keeps the logits and each row's
// log-sum-exp, and its backward makes dz in one logits-sized fp32 tensor
// (a log-softmax and a separate z-term kept the log-probabilities and made
// two more). In fp32 whatever the logits' dtype.
at::Tensor whole_logits_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, double z_loss);

// Note [Tied head's gradient]
// The whole logits z = y·Wᵀ of a head tied to the embedding. Through ATen's
// linear, W's gradient is a view (the transpose of the product's result), and
// autograd sums a weight's two gradients (the head's, waiting from the loss's
// backward, and the embedding's) in place only when the first is not a view:
// outside autocast the sum was a third tensor of the weight's size at the end
// of the backward (1,002 MiB at Llama 3.2 1B's vocabulary in fp32). This
// product's backward makes dW = dzᵀ·y as a tensor of its own. Under autocast
// the head's cast of W already hands back a tensor of its own, and ATen's
// linear is used.
at::Tensor tied_head_logits(const at::Tensor& hidden, const at::Tensor& weight);

}  // namespace meshtrain::model
