#include "meshtrain/parallel/parallelize.h"

namespace meshtrain::parallel {

mesh::ModelDims model_dims(const model::GptConfig& config) {
  mesh::ModelDims dims;
  dims.layers = config.layers;
  dims.heads = config.heads;
  dims.kv_heads = config.heads;
  dims.ffn = config.mlp_hidden();
  dims.vocab = config.vocab_size;
  dims.context = config.context;
  return dims;
}

}  // namespace meshtrain::parallel
