// A tensor of the training state (a parameter, an optimizer moment) as one
// rank holds it: its name, where it lives, and this rank's elements.
#pragma once

#include "meshtrain/placement/placement.h"

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace meshtrain::placement {

struct StateTensor {
  std::string name;  // "model/blocks.0.attn.qkv.weight", "optim/blocks.0.attn.qkv.weight/exp_avg"
  TensorSpec spec;   // global shape, placements, flat range
  // This rank's elements, in the order of local_chunks(spec): a view of the
  // live tensor, so a load writes into the model and optimizer in place.
  at::Tensor local;
  // Whether this rank saves it: one rank per distinct piece (writes_once),
  // and not a copy another rank also holds (a pipeline's tied embedding).
  bool write = true;
};

using TrainingState = std::vector<StateTensor>;

}  // namespace meshtrain::placement
