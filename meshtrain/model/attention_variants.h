// What the open families change in attention, beside plain causal
// multi-head attention: RoPE tables with scaling (Note [RoPE scaling]),
// sliding windows, a query scale other than 1/sqrt(head size) and soft-capped
// scores (Note [Attention variants]). Used by the model's attention core and
// by the KV cache, which replaces that core during generation.
#pragma once

#include "meshtrain/model/gpt_config.h"

#include <ATen/ATen.h>

namespace meshtrain::model {

// The rotary tables of a model: cos and sin [context, rotary_dims / 2] in
// fp32, the attention factor of yarn scaling folded in.
struct RopeTables {
  at::Tensor cos, sin;
};
RopeTables rope_tables(const GptConfig& config);
// The rotary frequencies (radians per position) of pairs 0 .. rotary_dims/2 - 1, in double.
at::Tensor rope_frequencies(const GptConfig& config);

// How block `block`'s attention differs from causal softmax(q·kᵀ/sqrt(d))·v.
struct AttentionVariant {
  int64_t window = 0;   // a query sees itself and the window - 1 keys before it; 0: all before it
  double scale = 0;     // the scores' scale; 0: 1/sqrt(head size)
  double softcap = 0;   // scores c·tanh(s/c) before the mask; 0: none
  bool plain() const { return window == 0 && scale == 0 && softcap == 0; }
};
AttentionVariant attention_variant(const GptConfig& config, int64_t block);

// Attention of q [B, H, t, d] over k, v [B, H or H/g, S, d] (g query heads
// per key/value head), query i at position S - t + i, key j at position j:
// causal, within the variant's window, and where `allowed` (bool,
// broadcastable to [B, 1, t, S]) is true if it is defined. Every query must
// be allowed at least one key (causal attention always allows itself).
at::Tensor variant_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const AttentionVariant& variant, double dropout, bool training,
                             const at::Tensor& allowed = {});

// Note [Packed documents]
// Rows that hold several documents (data.packing = "packed") come with each
// token's position inside its document, [B, T] int64, 0 where one starts.
// Training sets them for the forward of a micro-batch with a DocumentScope
// (one per thread; activation checkpointing keeps the scope of the forward
// for its recompute); attention then lets a query see only the keys of its
// own document, and RoPE rotates by those positions, so each document is
// computed as if it were alone in its row. Outside a scope, rows are one
// sequence from position 0.
class DocumentScope {
 public:
  explicit DocumentScope(at::Tensor positions);  // undefined: no documents (a no-op scope)
  ~DocumentScope();
  DocumentScope(const DocumentScope&) = delete;
  DocumentScope& operator=(const DocumentScope&) = delete;

 private:
  at::Tensor previous_;
};
// The positions of the innermost scope on this thread, or an undefined tensor.
const at::Tensor& document_positions();
// Which keys each query may see: [B, 1, T, T] bool, true within a document.
at::Tensor document_mask(const at::Tensor& positions);

}  // namespace meshtrain::model
