// meshtrain verify: a config's parallel layout trained for a few steps beside
// the one-process computation on the same data and seed, compared step by
// step (Note [Verify]).
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/train/config.h"

#include <memory>
#include <string>
#include <vector>

namespace meshtrain::train {

// Note [Verify]
// `verify` is the tests' oracle (Note [One-process oracle]) as a command: the
// config's layout on every rank, and rank 0 alone training the same config
// with the layout reset to one process of plain data parallel (the same
// global batch, micro-batch, precision, LoRA and seed), both for `steps`
// steps on the same data. Each step compares the loss and the gradient norm,
// and, where the model is small enough to keep a copy per step (or scaled
// down), the parameters after it: their relative difference over the model,
// the largest element difference, and the first block (in model order:
// embeddings, blocks, head) holding a parameter beyond the tolerance, which
// is where a wrong layout reaches the weights. Each block's output in the
// step's forwards is compared too (Note [Block outputs]), naming the first
// block whose output differs: where a wrong forward starts, or none when the
// forward agrees and the difference arises in the backward or the update.
// The tolerances are the tests': fp32
// loss 1e-5 and gradient norm and parameters 1e-4 (relative; parameters also
// absolute per element); with bfloat16 anywhere (training.dtype, the fully
// sharded param or reduce dtype, a LoRA base) 2e-2 for all, since the
// roundings fall in other places; --tolerance sets all four.
// --scale-down keeps the layout and shrinks the rest: 16 dims per head (the
// heads and key/value heads as they are, for tensor parallel's splits), the
// fewest blocks, the shortest context and the smallest batch the layout
// accepts, one sequence per micro-batch where the layout lets it choose.
// Runs go under the config's run folder, in verify/, removed afterwards.
struct VerifyOptions {
  int steps = 3;
  bool scale_down = false;
  double tolerance = 0;  // 0: by precision (above)
};

struct VerifyStep {
  int64_t step = 0;
  double loss = 0, one_loss = 0, grad_norm = 0, one_grad_norm = 0;
  double loss_difference = 0, grad_difference = 0;  // relative to one process
  bool parameters_compared = false;
  double parameter_relative = 0, parameter_largest = 0;
  std::string first_block;      // "" when every parameter is within the tolerance
  std::string first_parameter;  // the block's parameter with the largest difference
  double first_parameter_difference = 0;
  // What each block computed in the step's forwards (Note [Block outputs]):
  // the largest difference and its block, and the first block (model order)
  // beyond the parameter tolerance ("" when none is).
  double output_largest = 0;
  std::string output_largest_block;
  std::string first_output_block;
  double first_output_difference = 0;
};

struct VerifyReport {
  std::string layout;  // ParallelSpec::str(): "tp=2 zero=3 ..."
  std::string model;   // the fingerprint of the model both trained
  std::string scaled;  // what --scale-down changed ("" when not asked)
  double loss_tolerance = 0, grad_tolerance = 0, parameter_tolerance = 0;
  std::vector<VerifyStep> steps;  // on rank 0
  int first_different = 0;        // the first step beyond a tolerance; 0: none
  std::string difference;         // what differed there, in words
};

// The config shrunk as --scale-down says for `world_size` ranks (Note
// [Verify]), and what changed in words. Throws ConfigError when no smaller
// shape fits the layout.
std::string scale_down(TrainConfig& config, int world_size);
// The one-process equivalent of a validated config: its layout reset, the rest kept.
TrainConfig one_process_config(const TrainConfig& layout);
// Collective over `world`: trains both and compares (the report's steps on rank 0).
VerifyReport verify(const std::shared_ptr<comm::Communicator>& world, TrainConfig config, const VerifyOptions& options);

}  // namespace meshtrain::train
