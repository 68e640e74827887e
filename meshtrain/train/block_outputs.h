// What each transformer block computed in a training step, summed over ranks
// so that any layout compares with one process (Note [Block outputs]).
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/model/gpt.h"

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

namespace meshtrain::train {

// Note [Block outputs]
// `verify` names the first block whose output differs from one process's. A
// hook around every block ("blocks.N", installed last, so outside any
// activation checkpoint: a recompute is not counted twice) adds up, over
// the step's forwards with gradients on, the count, the sum and the sum of
// squares of the block's output elements. The rank sums are all-reduced.
// Splitting rows over ranks (data, sequence and context parallel, pipeline
// stages, experts) leaves the totals as one process's. Replicating them
// (tensor parallel without sequence parallel) multiplies all three by the
// replicas, which block_output_difference() divides out by comparing per element.
// These are summaries: two outputs whose rows differ only in order look
// alike (the loss does not).
struct BlockOutput {
  double count = 0, sum = 0, sum_squares = 0;
};

class BlockOutputs : public model::ForwardHooks {
 public:
  explicit BlockOutputs(int64_t blocks) : step_(static_cast<size_t>(blocks)) {}
  at::Tensor around(const std::string& module, const at::Tensor& input, const Forward& forward) override;
  bool wraps_head() const override { return false; }
  // Starts a step's sums afresh.
  void clear();
  // The step's sums on this rank, or with `world` over every rank (collective).
  std::vector<BlockOutput> totals(const std::shared_ptr<comm::Communicator>& world = nullptr) const;

 private:
  std::vector<BlockOutput> step_;
};

// Installs BlockOutputs on `model` (last: outermost) and returns it.
std::shared_ptr<BlockOutputs> record_block_outputs(model::Gpt& model);

// How far `got`'s block `i` is from `want`'s: the larger of the relative
// difference of the root mean squares and of the means (scaled by the root
// mean square), each per element after the replicas are divided out.
double block_output_difference(const BlockOutput& got, const BlockOutput& want);

}  // namespace meshtrain::train
