// Pipeline stages: which pieces of the model (embedding, blocks, head) each
// stage runs, chosen by the user or balanced by cost, and the model cut down
// to the stages of one rank.
#pragma once

#include "meshtrain/model/gpt.h"

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::parallel::pipeline {

// One stage: blocks [first_block, end_block), plus the embedding on stage 0
// and the final norm, head and loss on the last stage.
struct StageSpec {
  int64_t first_block = 0;
  int64_t end_block = 0;
  bool embed = false;
  bool head = false;
  std::string str() const;  // "embed+blocks 0-2", "blocks 3-5+head"
};

// The cost of every piece in model order: [embedding, block 0, ..., block L-1, head].
// By parameter count (the head counted even when tied to the embedding: the
// last stage holds a copy).
std::vector<double> parameter_costs(const model::GptConfig& config);
// By time: forward + backward of each piece on a micro-batch of `micro_batch`
// sequences, median of `repeats`, measured here on a copy of the model.
std::vector<double> measured_costs(const model::GptConfig& config, int64_t micro_batch, int repeats = 3);

// Blocks per stage (each >= 1) minimising the most expensive stage; `costs` as above.
std::vector<int64_t> balance(const std::vector<double>& costs, int stages);
// "3,3,2": blocks per stage (each >= 1), or std::invalid_argument.
std::vector<int64_t> parse_block_counts(const std::string& text);
// Throws std::invalid_argument ("gives 2 stages, the pipeline has 4 ...")
// unless there is one count per stage and they add up to `layers`.
void check_block_counts(const std::vector<int64_t>& blocks, int64_t layers, int stages);
// Both: "3,3,2" read and checked against the layer and stage counts.
std::vector<int64_t> parse_split(const std::string& text, int64_t layers, int stages);
std::vector<StageSpec> stage_specs(const std::vector<int64_t>& blocks_per_stage);

// Removes from `model` every module no stage in `kept` uses, and frees its
// parameters and buffers: named_parameters() then lists this rank's alone,
// under their names in the whole model. A tied embedding stays with the head.
void keep_stages(model::Gpt& model, const std::vector<StageSpec>& kept);

// Runs `stage` of the model on micro-batch `batch`: its tokens -> hidden on
// the first (`hidden` unused), hidden -> hidden, hidden -> the micro-batch's
// mean loss on the last (head_loss, through the model's hooks: chunked where
// model.chunked_loss holds, its gradients made `when` asked: in the backward
// where the schedule holds several losses at once, Note [Chunked loss]).
at::Tensor run_stage(model::Gpt& model, const StageSpec& stage, const at::Tensor& hidden, const model::Batch& batch,
                     model::LossGradients when);

}  // namespace meshtrain::parallel::pipeline
