// Test helper: the parameters a built module actually holds.
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace meshtrain::model {

inline int64_t counted(torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

}  // namespace meshtrain::model
