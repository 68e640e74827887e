// Attention proper as an object each block holds: what it computes (an
// AttentionSpec), the interface every way of computing it implements, and
// the local one (Note [Attention object]). The mask, the soft-cap and the
// document rule are written here once.
#pragma once

#include "meshtrain/model/batch.h"
#include "meshtrain/model/gpt_config.h"

#include <ATen/ATen.h>

#include <memory>

namespace meshtrain::model {

// What one block's attention computes beside softmax(q·kᵀ/sqrt(d))·v over every key.
struct AttentionSpec {
  double scale = 0;     // the scores' scale; 0: 1/sqrt(head size)
  bool causal = true;   // a query sees keys at its own column and before
  int64_t window = 0;   // with causal: its own column and the window − 1 before it; 0: all before it
  double softcap = 0;   // scores c·tanh(s/c) before the mask; 0: none
  double dropout = 0;   // on the attention weights, in training
  // Only the causal mask: the fused and flash kernels' case.
  bool plain() const { return causal && window == 0 && scale == 0 && softcap == 0; }
  // The scale with 0 resolved for heads of `head_dim`.
  double scale_for(int64_t head_dim) const;
};
// Block `block`'s spec under `config` (its window, Gemma 2's scale and soft-cap, dropout).
AttentionSpec attention_spec(const GptConfig& config, int64_t block);

// q, k and v of the fused qkv projection's outputs, as heads.
struct QkvHeads {
  at::Tensor q, k, v;  // q [B, Hq, T, hd]; k, v [B, Hkv, T, hd] (this rank's heads)
};

// Note [Attention object]
// Each block's CausalSelfAttention makes its queries, keys and values (the
// qkv projection, QK-norm, RoPE at the Batch's positions) and hands them to
// its Attention object with its AttentionSpec and the Batch; the object
// returns the heads' outputs. LocalAttention (below) is every block's object
// at construction. The other ways of computing attention are objects a
// parallelism or a decoder installs in its place, block by block
// (GptImpl::set_attention), and removes when done: context parallel's ring,
// all-to-all and hybrid attention over its group (parallel/context_parallel.h),
// the KV cache, whole or rolling (model/kv_cache.h), and the cache split over
// a context-parallel group (parallel/context_parallel_generate.h). None of
// them finds a block by name or reaches into the model: what a block is
// (spec, heads) comes with the call, where its tokens sit with the Batch
// (Note [Batch]). Grouped-query heads are told by the shapes: q has a
// multiple of k's heads.
class Attention {
 public:
  virtual ~Attention() = default;
  // q [B, H, T, d], k and v [B, Hkv, T, d] -> [B, H, T, d].
  virtual at::Tensor forward(const QkvHeads& heads, const AttentionSpec& spec, const Batch& batch, bool training) = 0;
};

// Attention on this rank's rows alone: the fused CPU kernel (model.fused,
// Note [Fused operators]) or ATen's flash kernel for the causal mask and
// windows, ATen's masked attention for packed documents, explicit scores
// for a soft-cap (variant_attention).
class LocalAttention final : public Attention {
 public:
  explicit LocalAttention(bool fused) : fused_(fused) {}
  at::Tensor forward(const QkvHeads& heads, const AttentionSpec& spec, const Batch& batch, bool training) override;

 private:
  bool fused_;
};

// Which keys at `keys` [S] (columns, int64) queries at `queries` [t] may
// see under `spec`: [t, S] bool. The one definition of the causal mask and
// the window; the fused kernel's own mask (fused::causal_window_mask) is this
// for queries at the last t of S columns.
at::Tensor allowed_pairs(const at::Tensor& queries, const at::Tensor& keys, const AttentionSpec& spec);
// Whether each query may see each key by documents: starts [B, t] and [B, S]
// (Note [Batch]) -> [B, 1, t, S] bool, true where equal.
at::Tensor same_document(const at::Tensor& query_starts, const at::Tensor& key_starts);
// Scores c·tanh(s/c) (cap > 0; else s as it is): for autograd, and in place
// (s.div_, tanh_, mul_) where no gradient flows through s.
at::Tensor soft_cap(const at::Tensor& scores, double cap);
void soft_cap_(at::Tensor& scores, double cap);

// Attention of q [B, H, t, d] over k, v [B, H or H/g, S, d], query i at
// column S − t + i, key j at column j: by `spec`, and where `allowed` (bool,
// broadcastable to [B, 1, t, S]) is true if it is defined. Every query must
// be allowed at least one key (causal attention always allows itself).
// Note [Attention variants] (attention.cpp).
at::Tensor variant_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionSpec& spec,
                             bool training, const at::Tensor& allowed = {});

// k and v as ATen's scaled_dot_product_attention takes them beside q, with a
// mask where `masked` (Note [Grouped queries in SDPA]): as they are with
// `enable_gqa` where the kernel SDPA picks takes grouped heads, else repeated
// per query head.
struct SdpaKeys {
  at::Tensor k, v;
  bool enable_gqa = false;
};
SdpaKeys sdpa_keys(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool masked);
// Whether SDPA takes grouped heads unrepeated for queries of `dtype` (autocast's
// where it is on) on `device`, with a mask or without: the planner's and
// sdpa_keys' one rule.
bool sdpa_takes_groups(at::DeviceType device, at::ScalarType dtype, bool masked);

}  // namespace meshtrain::model
