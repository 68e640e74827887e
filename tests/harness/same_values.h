// Random tensors that every rank draws alike from a seed: any rank can compute
// any other rank's inputs, so an oracle needs no communication.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>

namespace meshtrain::testing {

// Standard normal values of `shape`, the same on every rank for one seed.
inline at::Tensor same(at::IntArrayRef shape, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, g);
}

}  // namespace meshtrain::testing
