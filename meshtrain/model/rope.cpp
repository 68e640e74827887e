#include "meshtrain/model/rope.h"

#include <algorithm>
#include <cmath>

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

}  // namespace meshtrain::model
