// What a checkpoint holds of a parallelized model on this rank, and the
// whole model gathered back from the pieces: the placement of every
// parameter as the techniques of parallelize() left it.
#pragma once

#include "meshtrain/parallel/parallelize.h"
#include "meshtrain/placement/state_tensor.h"

#include <ATen/ATen.h>

#include <map>
#include <string>

namespace meshtrain::parallel {

// Parameters and AdamW moments (placed over the mesh: tensor parallel's
// splits, the experts over ep, data parallelism's shards), and the random
// streams (Note [Random streams]). Views of the live tensors (the streams:
// copies taken now), so a checkpoint load writes into them. Collective-free.
placement::TrainingState training_state(Parallelized& parts);
// The frozen parameters (LoRA's base) as this rank holds them, placed as
// training_state()'s, which leaves them out: what a base model loads into.
placement::TrainingState frozen_state(Parallelized& parts);
// After a load into training_state(): AdamW's step count, and the random
// streams set from what was loaded into their entries (`random_streams`);
// without them the caller reseeds (parts.random.reseed).
void after_load(Parallelized& parts, int64_t optimizer_steps, bool random_streams);
// Every parameter of the whole model, unsharded, fp32, by name, on world
// rank `root` (-1: every rank). Collective.
std::map<std::string, at::Tensor> full_parameters(Parallelized& parts, int root = -1);

}  // namespace meshtrain::parallel
