// The language-model loss without the [tokens, vocabulary] logits: the
// output projection and cross-entropy over chunks of rows (Note [Chunked loss]).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace meshtrain::model {

// Note [Chunked loss]
// The loss of a step is mean over the counted targets of lse(z) − z[target]
// with z = h·Wᵀ (c·tanh(z/c) under Gemma 2's logit soft-cap). Materialised,
// z is tokens × vocabulary, in fp32 for the log-softmax: at Llama 3's 128,256
// entries and 8K tokens 4 GB, and its gradient as much again — the largest
// tensors of a small model's step. Here the rows go through in chunks of at
// most kChunkBytes of fp32 logits: each chunk's logits are made (in the
// autocast dtype where autocast is on, as the head's linear would), reduced
// to a log-sum-exp and the target's logit, and, when a gradient will be
// asked, turned at once into the chunk's gradient dz = softmax − onehot
// (times 1 − tanh² under the cap), which gives dh for its rows and adds into
// dW, so nothing of the chunk outlives it. The loss is the last operation of
// a forward, so its backward follows directly: it scales the dh and dW the
// forward made by the loss's gradient. Work: the same three products as the
// head's forward and backward, none done twice. Memory: one chunk's logits
// twice (the log-sum-exp's work space), plus dh (the size of the head's
// input) and dW (the size of the weight) from the loss's forward to its
// backward; at one chunk that is about what the whole logits cost. Rows whose
// target is kIgnoredTarget count toward nothing; with none counting the loss
// is 0. The planner counts this (Workload::chunked_loss).
constexpr int64_t kChunkBytes = int64_t{256} << 20;

// The mean loss over `targets` [N] of hidden [N, d] against weight [V, d],
// soft-capped by `softcap` > 0; `chunk_rows` > 0 sets the rows per chunk
// (0: as many as kChunkBytes of logits hold). Differentiable in hidden and weight.
at::Tensor chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                 double softcap = 0, int64_t chunk_rows = 0);

}  // namespace meshtrain::model
