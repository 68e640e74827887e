#include "meshtrain/model/attention_variants.h"

#include "meshtrain/model/fused/ops.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace meshtrain::model {

// Note [RoPE scaling]
// Pair i of the r rotated dims of a head turns by position·f_i with
// f_i = theta^(-2i/r). Scaling stretches the context a model was trained
// for by changing the f_i (as Hugging Face's rope_type does):
//   linear   f_i / factor: positions interpolated.
//   llama3   Llama 3.1: with wavelength λ_i = 2π/f_i and the original
//            context L, pairs of λ_i < L/high_freq_factor keep f_i (they
//            turn many times within L), those of λ_i > L/low_freq_factor
//            take f_i/factor, and those between blend the two with
//            s = (L/λ_i − low)/(high − low): (1 − s)·f_i/factor + s·f_i.
//   yarn     the same blend with a linear ramp over the pair index between
//            the pairs that turn beta_fast and beta_slow times within L
//            (the correction range, floored and ceiled); cos and sin are
//            also multiplied by an attention factor, 0.1·ln(factor) + 1
//            unless given, which scales every score by its square.
// Only the tables change: the rotation, the KV cache and the fused kernel
// read them as they are.
at::Tensor rope_frequencies(const GptConfig& c) {
  const int64_t r = c.rotary_dims(), half = r / 2;
  const at::Tensor base = at::pow(c.rope_theta, -at::arange(0, r, 2, at::kDouble) / static_cast<double>(r));
  const double factor = c.rope_factor;
  if (c.rope_scaling == RopeScaling::kLinear) return base / factor;
  if (c.rope_scaling == RopeScaling::kLlama3) {
    const double original = static_cast<double>(c.rope_original_context);
    const double low = c.rope_low_freq_factor, high = c.rope_high_freq_factor;
    const at::Tensor wavelength = 2 * M_PI / base;
    const at::Tensor stretched = at::where(wavelength > original / low, base / factor, base);
    const at::Tensor s = (original / wavelength - low) / (high - low);
    const at::Tensor smoothed = (1 - s) * stretched / factor + s * stretched;
    const at::Tensor medium = (wavelength >= original / high).logical_and(wavelength <= original / low);
    return at::where(medium, smoothed, stretched);
  }
  if (c.rope_scaling == RopeScaling::kYarn) {
    const double original = static_cast<double>(c.rope_original_context), theta = c.rope_theta;
    auto correction = [&](double rotations) {
      return static_cast<double>(r) * std::log(original / (rotations * 2 * M_PI)) / (2 * std::log(theta));
    };
    const double lo = std::max(std::floor(correction(c.rope_beta_fast)), 0.0);
    double hi = std::min(std::ceil(correction(c.rope_beta_slow)), static_cast<double>(r - 1));
    if (lo == hi) hi += 0.001;
    const at::Tensor ramp = ((at::arange(half, at::kDouble) - lo) / (hi - lo)).clamp(0, 1);
    const at::Tensor extrapolate = 1 - ramp;  // the share of the original frequency
    return base / factor * (1 - extrapolate) + base * extrapolate;
  }
  return base;
}

RopeTables rope_tables(const GptConfig& c) {
  const at::Tensor angles = at::outer(at::arange(c.context, at::kDouble), rope_frequencies(c));
  double attention_factor = 1.0;
  if (c.rope_scaling == RopeScaling::kYarn) {
    attention_factor = c.rope_attention_factor > 0 ? c.rope_attention_factor
                       : c.rope_factor <= 1    ? 1.0
                                               : 0.1 * std::log(c.rope_factor) + 1.0;
  }
  return {(angles.cos() * attention_factor).to(at::kFloat), (angles.sin() * attention_factor).to(at::kFloat)};
}

AttentionVariant attention_variant(const GptConfig& c, int64_t block) {
  AttentionVariant v;
  v.window = c.window_of(block);
  v.scale = c.query_scale > 0 ? 1.0 / std::sqrt(c.query_scale) : 0.0;
  v.softcap = c.attn_softcap;
  return v;
}

// Note [Attention variants]
// Sliding windows (Mistral, Gemma 2's local blocks): query i sees keys
// i − W + 1 .. i. Gemma 2 scales the scores by 1/sqrt(query_pre_attn_scalar)
// instead of 1/sqrt(head size) and soft-caps them, c·tanh(s/c), before the
// mask and the softmax (in fp32). In training, windows and scales go
// through the fused CPU attention (its softmax skips the keys before the
// window) or ATen's with a mask; the KV cache and a soft-cap come here:
// without a soft-cap ATen's scaled-dot-product attention with a boolean
// mask, with one, scores formed explicitly (the cap sits between the
// product and the softmax). Either way the softmax sees -inf where a key is hidden, so
// these paths equal the plain causal one where the window covers the
// sequence. Memory: the explicit path keeps the [B, H, t, S] scores for
// backward, as ATen's math attention does.
at::Tensor variant_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const AttentionVariant& variant, double dropout, bool training, const at::Tensor& allowed) {
  const int64_t t = q.size(2), keys = k.size(2);
  const int64_t times = q.size(1) / k.size(1);
  const double p = training ? dropout : 0.0;
  const double scale = variant.scale > 0 ? variant.scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  if (variant.softcap == 0 && variant.window == 0 && !allowed.defined() && t == keys) {
    // Only the scale differs: the causal kernel, with its flash path (and no [t, S] mask).
    return at::scaled_dot_product_attention(q, k, v, {}, p, /*is_causal=*/true, scale, /*enable_gqa=*/times > 1);
  }
  at::Tensor mask = fused::causal_window_mask(t, keys, variant.window, q.device());
  if (allowed.defined()) mask = mask.logical_and(allowed);
  if (variant.softcap == 0) {
    return at::scaled_dot_product_attention(q, k, v, mask, p, /*is_causal=*/false, scale, /*enable_gqa=*/times > 1);
  }
  const at::Tensor keys_all = times > 1 ? k.repeat_interleave(times, 1) : k;
  const at::Tensor values_all = times > 1 ? v.repeat_interleave(times, 1) : v;
  at::Tensor scores = at::matmul(q, keys_all.transpose(-2, -1)).to(at::kFloat) * scale;
  scores = at::tanh(scores / variant.softcap) * variant.softcap;
  scores = scores.masked_fill(mask.logical_not(), -std::numeric_limits<float>::infinity());
  at::Tensor weights = at::softmax(scores, -1).to(q.scalar_type());
  if (p > 0) weights = at::dropout(weights, p, true);
  return at::matmul(weights, values_all);
}

namespace {
thread_local at::Tensor t_positions;
}

DocumentScope::DocumentScope(at::Tensor positions) : previous_(std::move(t_positions)) {
  t_positions = std::move(positions);
}

DocumentScope::~DocumentScope() { t_positions = std::move(previous_); }

const at::Tensor& document_positions() { return t_positions; }

at::Tensor document_mask(const at::Tensor& positions) {
  const at::Tensor document = (positions == 0).cumsum(1);  // which document of its row each token is in
  return (document.unsqueeze(2) == document.unsqueeze(1)).unsqueeze(1);
}

}  // namespace meshtrain::model
