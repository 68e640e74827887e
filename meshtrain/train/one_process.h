// The one-process oracle: a config trained by one process for a few steps, the
// run every parallel layout must equal (DESIGN.md), computed by one rank for
// all. The tests compare with it (Note [One-process oracle]) and so does
// `meshtrain verify` (train/verify.h).
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/train/block_outputs.h"
#include "meshtrain/train/trainer.h"

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain::train {

// Note [One-process oracle]
// Every layout is compared with one process reading the same micro-batches.
// That run is the same on every rank, so rank 0 computes it alone, on a
// one-rank communicator, while the other ranks wait on a receive (polled
// with sleeps in between: Note [MPI progress thread]), and sends them its
// record. Every rank used to compute it: at 8 ranks on 2 cores that was 8/9
// of such a test's work.
struct OneProcessRun {
  std::vector<StepResult> steps;                 // loss, gradient norm, MoE statistics of each step
  std::map<std::string, at::Tensor> parameters;  // after the last step: fp32, by name
  double val_loss = 0;                           // after the last step, when asked for
  // After each step (when asked for; not sent to the other ranks): fp32, by name.
  std::vector<std::map<std::string, at::Tensor>> each_step;
  // What each block computed in each step (when asked for; not sent): Note [Block outputs].
  std::vector<std::vector<BlockOutput>> block_outputs;

  std::vector<double> losses() const;
};

// Waits for `work` with sleeps between polls, so a rank waiting on rank 0 leaves it the cores.
void wait_polling(const comm::Work& work);

struct OneProcessOptions {
  int steps = 1;
  bool evaluate = false;          // the validation loss after the last step
  bool each_step = false;         // the parameters after every step (OneProcessRun::each_step)
  bool block_outputs = false;     // what each block computed in every step (OneProcessRun::block_outputs)
  bool send_to_every_rank = true; // false: only rank 0 gets the run (the others an empty one)
};

// Collective over `world`: `config` (validated for one rank) trained by rank
// 0 alone. An error on rank 0 is thrown on every rank.
OneProcessRun one_process(const std::shared_ptr<comm::Communicator>& world, const TrainConfig& config,
                          const OneProcessOptions& options);

}  // namespace meshtrain::train
