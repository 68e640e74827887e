#include "meshtrain/model/attention.h"

#include "meshtrain/model/fused/ops.h"
#include "meshtrain/model/fused/tensor_args.h"

#include <cmath>
#include <limits>

namespace meshtrain::model {

double AttentionSpec::scale_for(int64_t head_dim) const {
  return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

AttentionSpec attention_spec(const GptConfig& c, int64_t block) {
  AttentionSpec s;
  s.window = c.window_of(block);
  s.scale = c.query_scale > 0 ? 1.0 / std::sqrt(c.query_scale) : 0.0;
  s.softcap = c.attn_softcap;
  s.dropout = c.dropout;
  return s;
}

at::Tensor allowed_pairs(const at::Tensor& queries, const at::Tensor& keys, const AttentionSpec& spec) {
  if (!spec.causal) return at::ones({queries.size(0), keys.size(0)}, queries.options().dtype(at::kBool));
  const at::Tensor distance = queries.unsqueeze(1) - keys.unsqueeze(0);  // query column − key column
  const at::Tensor seen = distance >= 0;
  return spec.window > 0 ? seen.logical_and(distance < spec.window) : seen;
}

at::Tensor same_document(const at::Tensor& query_starts, const at::Tensor& key_starts) {
  return (query_starts.unsqueeze(2) == key_starts.unsqueeze(1)).unsqueeze(1);
}

// Note [Grouped queries in SDPA]
// ATen's scaled_dot_product_attention takes k and v over fewer heads than q
// (enable_gqa, each key/value head serving q's heads in repeat_interleave's
// order) in its CPU flash kernel, in every dtype and with a mask, and on CUDA
// in its flash kernel alone, which runs 16-bit inputs without a mask. fp32 or
// a mask (a window, documents, a KV cache's padding) on CUDA goes to the
// memory-efficient kernel, which does not take them: with enable_gqa SDPA
// would fall back to its math kernel and keep the [B, H, T, T] scores, so
// there k and v are repeated per query head, and SDPA keeps the repeated
// copies for its backward (the planner counts them for the windowed blocks and
// fp32: ActivationOptions::repeated_kv). Unrepeated, the flash kernel keeps k
// and v as they are.
bool sdpa_takes_groups(at::DeviceType device, at::ScalarType dtype, bool masked) {
  return device == at::kCPU || (!masked && (dtype == at::kBFloat16 || dtype == at::kHalf));
}

SdpaKeys sdpa_keys(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool masked) {
  const int64_t times = q.size(1) / k.size(1);
  const at::DeviceType device = q.device().type();
  const at::ScalarType dtype =
      at::autocast::is_autocast_enabled(device) ? at::autocast::get_autocast_dtype(device) : q.scalar_type();
  if (times == 1) return {k, v, false};
  if (sdpa_takes_groups(device, dtype, masked)) return {k, v, true};
  return {k.repeat_interleave(times, 1), v.repeat_interleave(times, 1), false};
}

at::Tensor soft_cap(const at::Tensor& scores, double cap) { return cap > 0 ? at::tanh(scores / cap) * cap : scores; }

void soft_cap_(at::Tensor& scores, double cap) {
  if (cap > 0) scores.div_(cap).tanh_().mul_(cap);
}

// Note [Attention variants]
// Sliding windows (Mistral, Gemma 2's local blocks): query i sees keys
// i − W + 1 .. i. Gemma 2 scales the scores by 1/sqrt(query_pre_attn_scalar)
// instead of 1/sqrt(head size) and soft-caps them, c·tanh(s/c), before the
// mask and the softmax (in fp32). In training, windows, scales and
// soft-caps go through the fused CPU attention where its batched path
// applies (its softmax skips the keys before the window or the document's
// start and caps the scores; Note [CPU attention]), windows elsewhere through
// ATen's with a mask; the KV cache, packed documents past the fused path and
// the other soft-capped cases come here: without a soft-cap ATen's
// scaled-dot-product attention with a boolean mask, with one, scores formed
// explicitly (the cap sits between the product and the softmax). Either way the softmax sees -inf
// where a key is hidden, so these paths equal the plain causal one where the
// window covers the sequence. Memory: the explicit path keeps the
// [B, H, t, S] scores for backward, as ATen's math attention does.
at::Tensor variant_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionSpec& spec,
                             bool training, const at::Tensor& allowed) {
  const int64_t t = q.size(2), keys = k.size(2);
  const int64_t times = q.size(1) / k.size(1);
  const double p = training ? spec.dropout : 0.0;
  const double scale = spec.scale_for(q.size(-1));
  if (spec.causal && spec.softcap == 0 && spec.window == 0 && !allowed.defined() && t == keys) {
    // Only the scale differs: the causal kernel, with its flash path (and no [t, S] mask).
    const SdpaKeys g = sdpa_keys(q, k, v, /*masked=*/false);
    return at::scaled_dot_product_attention(q, g.k, g.v, {}, p, /*is_causal=*/true, scale, g.enable_gqa);
  }
  const at::TensorOptions columns = at::TensorOptions(at::kLong).device(q.device());
  at::Tensor mask = allowed_pairs(at::arange(keys - t, keys, columns), at::arange(keys, columns), spec);
  if (allowed.defined()) mask = mask.logical_and(allowed);
  if (spec.softcap == 0) {
    const SdpaKeys g = sdpa_keys(q, k, v, /*masked=*/true);
    return at::scaled_dot_product_attention(q, g.k, g.v, mask, p, /*is_causal=*/false, scale, g.enable_gqa);
  }
  const at::Tensor keys_all = times > 1 ? k.repeat_interleave(times, 1) : k;
  const at::Tensor values_all = times > 1 ? v.repeat_interleave(times, 1) : v;
  at::Tensor scores = soft_cap(at::matmul(q, keys_all.transpose(-2, -1)).to(at::kFloat) * scale, spec.softcap);
  scores = scores.masked_fill(mask.logical_not(), -std::numeric_limits<float>::infinity());
  at::Tensor weights = at::softmax(scores, -1).to(q.scalar_type());
  if (p > 0) weights = at::dropout(weights, p, true);
  return at::matmul(weights, values_all);
}

at::Tensor LocalAttention::forward(const QkvHeads& heads, const AttentionSpec& spec, const Batch& batch,
                                   bool training) {
  const at::Tensor& q = heads.q;
  const bool fused = fused_ && fused::eligible(q);
  const double p = training ? spec.dropout : 0.0;
  // A soft-cap and documents sit inside the softmax: the fused kernel's batched
  // path has them, ATen's kernels take them as a mask or explicit scores.
  const bool batched = fused && fused::batched_attention_applies(q.device().is_cpu(), heads.k.size(2), q.size(3), p);
  if (batch.documents.defined() && !(batched && q.size(2) == heads.k.size(2))) {
    // Documents side by side: a block-diagonal mask, ATen's kernels.
    const at::Tensor starts = batch.documents.to(q.device());
    return variant_attention(q, heads.k, heads.v, spec, training, same_document(starts, starts));
  }
  if ((spec.softcap > 0 && !batched) || (!fused && !spec.plain())) {
    return variant_attention(q, heads.k, heads.v, spec, training);
  }
  // Grouped queries: the fused kernel takes k and v as they are (Note [Grouped queries]).
  if (fused) {
    return fused::attention(q, heads.k, heads.v, p, /*causal=*/true, spec.window, spec.scale, spec.softcap,
                            batch.documents);
  }
  const SdpaKeys g = sdpa_keys(q, heads.k, heads.v, /*masked=*/false);  // Note [Grouped queries in SDPA]
  return at::scaled_dot_product_attention(q, g.k, g.v, /*attn_mask=*/{}, p, /*is_causal=*/true, std::nullopt, g.enable_gqa);
}

}  // namespace meshtrain::model
