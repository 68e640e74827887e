// What the layouts see of a trainable adapter: a module under the linear it
// adapts whose low-rank update is added to that linear's output. See
// Note [Adapters].
#pragma once

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace meshtrain::model {

// Note [Adapters]
// ~~~~~~~~~~~~~~~
// An adapter is registered as a child of the linear it adapts, so pipeline
// stages, fully sharded units and activation checkpointing take it with its
// block, and it adds B·A·x to the linear's output from a forward hook on the
// linear's call site. A layout that splits the linear splits the adapter with
// it, and learns how from this interface rather than from names: a
// column-parallel linear splits the factor on its output side (B [out, rank])
// by rows, a row-parallel one the factor on its input side (A [rank, in]) by
// columns; the other factor is whole on every rank and its gradient a partial
// sum. Freezing (requires_grad false on everything else) is what the data
// layouts see: a frozen parameter has no gradient and no optimizer state.
// LoRA (model/lora.h) is the one implementation.
class LinearAdapter : public torch::nn::Module {
 public:
  // The names of its parameters on the linear's input side ([rank, in]) and output side ([out, rank]).
  virtual const char* input_factor() const = 0;
  virtual const char* output_factor() const = 0;
};

// The adapters directly under `linear`, with their child names.
inline std::vector<std::pair<std::string, LinearAdapter*>> adapters_of(torch::nn::Module& linear) {
  std::vector<std::pair<std::string, LinearAdapter*>> out;
  for (const auto& child : linear.named_children()) {
    if (auto* adapter = dynamic_cast<LinearAdapter*>(child.value().get())) out.emplace_back(child.key(), adapter);
  }
  return out;
}

}  // namespace meshtrain::model
