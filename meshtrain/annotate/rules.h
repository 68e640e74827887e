// Sharding rules: for one aten operator call on distributed tensors, where
// each input must be and where each output will be (Note [Distributed tensors]).
#pragma once

#include "meshtrain/placement/placement.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <string>
#include <vector>

namespace meshtrain::annotate {

// One tensor argument of a call: its global spec as passed, and the
// placements the rule wants it in.
struct Operand {
  size_t arg = 0;
  int64_t item = -1;  // its index in a Tensor[] argument, else -1
  at::Tensor tensor;  // as passed: distributed, or plain (Replicate)
  placement::TensorSpec spec;
  std::vector<placement::Placement> want;
};

struct Call {
  std::string name;  // "addmm", "add_.Tensor"
  std::string base;  // "addmm", "add_"
  std::vector<c10::IValue> args;
  std::vector<Operand> inputs;
  std::vector<int64_t> axis_sizes;
  std::vector<std::vector<int64_t>> out_shapes;  // every Tensor output (a Tensor[] output: each item)
  std::vector<std::vector<placement::Placement>> out_placements;
  // A mean over a split dim: each rank's mean of its chunk, times its share
  // of the reduced elements, is its part of the partial sum.
  bool rescale_mean = false;
  std::vector<bool> reduced;  // the dims it reduces
  bool pointwise = false;
  bool inplace = false;  // the first argument is written and returned
};

// Bytes moved to take a tensor of `spec` from `from` to `to` along one axis of `n` ranks.
double redistribute_bytes(const placement::TensorSpec& spec, const placement::Placement& from,
                          const placement::Placement& to, int64_t n);

// Fills inputs[].want, out_placements (and rescale_mean); throws naming the
// operator when it has no rule.
void decide(Call& call);

// The handler every eligible aten operator is registered with for
// PrivateUse1 (dist_tensor.cpp: install()).
void run_operator(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace meshtrain::annotate
