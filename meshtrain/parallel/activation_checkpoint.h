// Activation checkpointing (re-materialization): keep a block's input, drop
// what its forward saved, and compute it again in backward.
#pragma once

#include "meshtrain/model/gpt.h"
#include "meshtrain/parallel/parallel_spec.h"
#include "meshtrain/parallel/random_streams.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain::parallel {

// CheckpointMode (parallel_spec.h) by name: "none" | "full" | "selective";
// throws config::ConfigError (a std::invalid_argument) otherwise.
CheckpointMode parse_checkpoint_mode(const std::string& name);

// Note [Activation checkpointing]
// An around-hook on "blocks.N" (full) or "blocks.N.attn.core" (selective)
// runs the call under no-grad inside an autograd function that saves only the
// call's input. Its backward runs the same call again with grad enabled, from
// the random states (default generator and `streams`) and the autocast state
// the first forward started from, then backpropagates through that graph:
// dropout draws the same masks and the gradients are those of the plain
// forward. Parameter gradients arrive during that inner backward, so the
// gradient-ready hooks of data parallel and sharding fire as usual. Hooks
// installed earlier (tensor parallel's collectives) run again in the
// recompute; install this after them and before data parallel/sharding.
class ActivationCheckpoint : public model::ForwardHooks {
 public:
  // `mode(block)` says what to do for each of the model's blocks.
  ActivationCheckpoint(int64_t blocks, const std::function<CheckpointMode(int64_t)>& mode,
                       std::vector<RandomStream> streams = {});
  at::Tensor around(const std::string& module, const at::Tensor& input, const Forward& forward) override;
  bool wraps_head() const override { return false; }  // blocks only

 private:
  std::vector<std::string> names_;  // call sites to checkpoint, sorted
  std::vector<RandomStream> streams_;
};

// Runs forward(input) keeping only `input`; the output's backward recomputes.
at::Tensor checkpoint(const model::ForwardHooks::Forward& forward, const at::Tensor& input,
                      const std::vector<RandomStream>& streams = {});

// Installs the hook on `model` with one mode for every `every`-th block
// (blocks 0, every, 2·every, ...); returns it (remove_forward_hooks undoes it).
std::shared_ptr<ActivationCheckpoint> apply_activation_checkpoint(model::Gpt& model, CheckpointMode mode, int64_t every = 1,
                                                                  std::vector<RandomStream> streams = {});

}  // namespace meshtrain::parallel
