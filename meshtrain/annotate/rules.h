// Sharding rules: for one aten operator call on distributed tensors, where
// each input must be and where each output will be (Note [Distributed tensors]).
#pragma once

#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/placement/placement.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <functional>
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
  bool shape_only = false;  // the operator reads its shape only: no data moved
};

// The short names the rules are written with.
namespace rule_names {
inline const placement::Placement R = placement::Placement::replicate();
inline const placement::Placement P = placement::Placement::partial();
inline placement::Placement S(int64_t d) { return placement::Placement::shard(d); }
inline int64_t wrap_dim(int64_t d, int64_t rank) { return d < 0 ? d + rank : d; }  // a negative dim counted from the end
}  // namespace rule_names

struct Call;
// Runs an operator whose local computation is not the operator itself on
// the local pieces (a vocabulary-split embedding, a softmax over a split
// dim): the arguments with operands replaced by local tensors in; outputs out.
using LocalKernel = std::function<std::vector<c10::IValue>(const Call&, std::vector<c10::IValue>)>;

struct Call {
  std::string name;  // "addmm", "add_.Tensor"
  std::string base;  // "addmm", "add_"
  std::vector<c10::IValue> args;
  std::vector<Operand> inputs;
  std::vector<int64_t> axis_sizes;
  std::vector<std::vector<int64_t>> out_shapes;  // every Tensor output (a Tensor[] output: each item)
  std::vector<std::vector<int64_t>> out_strides;  // their global strides (empty: row-major)
  std::vector<std::vector<placement::Placement>> out_placements;
  // A mean over a split dim: each rank's mean of its chunk, times its share
  // of the reduced elements, is its part of the partial sum.
  bool rescale_mean = false;
  std::vector<bool> reduced;  // the dims it reduces
  bool pointwise = false;
  bool inplace = false;  // the first argument is written and returned
  bool random = false;   // draws from a generator (tag nondeterministic_seeded)
  const c10::OperatorHandle* op = nullptr;
  const mesh::DeviceMesh* mesh = nullptr;
  LocalKernel kernel;  // empty: the operator on the local pieces
};

// One way to run an operator along one mesh axis: every input's placement and the outputs'.
struct Option {
  std::vector<placement::Placement> inputs;
  placement::Placement out;
};
// The first of `options` that moves the fewest bytes along `axis`.
Option cheapest(const Call& call, size_t axis, const std::vector<Option>& options);
// Records `chosen` for `axis`: inputs' wants, every output's placement.
void apply(Call& call, size_t axis, const Option& chosen);

// Bytes moved to take a tensor of `spec` from `from` to `to` along one axis of `n` ranks.
double redistribute_bytes(const placement::TensorSpec& spec, const placement::Placement& from,
                          const placement::Placement& to, int64_t n);

// The rules that bring their own kernel (kernels.cpp): true when `call` is one of theirs.
bool decide_with_kernel(Call& call);

// Autograd formulas of our own, for operators whose gradient must know its
// input's placements (embedding's weight); registered by install().
void install_autograd_kernels();

// Fills inputs[].want, out_placements (and rescale_mean); throws naming the
// operator when it has no rule.
void decide(Call& call);

// The handler every eligible aten operator is registered with for
// PrivateUse1 (dist_tensor.cpp: install()).
void run_operator(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace meshtrain::annotate
