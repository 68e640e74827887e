// Rotary position tables with the open families' scaling (Note [RoPE
// scaling]): what every block's attention rotates its queries and keys by.
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

}  // namespace meshtrain::model
