// parallelize: the one place that applies the parallelisms to a model, in the
// order of Note [Apply order].
#pragma once

#include "meshtrain/mesh/parallel_dims.h"
#include "meshtrain/model/gpt_config.h"

namespace meshtrain::parallel {

// The sizes of `config` the layout rules check (mesh/parallel_dims.h).
mesh::ModelDims model_dims(const model::GptConfig& config);

}  // namespace meshtrain::parallel
