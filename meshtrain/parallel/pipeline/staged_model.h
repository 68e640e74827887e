// StagedModel: a model cut into pipeline stages, this rank's kept, and run
// by a schedule: where each stage begins and ends, which rank holds which
// parameter, the tied embedding held by the first and last stage.
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/parallel/parallel_spec.h"
#include "meshtrain/parallel/pipeline/executor.h"
#include "meshtrain/parallel/pipeline/stages.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain::parallel::pipeline {

struct StagedModelOptions {
  mesh::PipelineSchedule schedule = mesh::PipelineSchedule::kOneFOneB;
  int virtual_stages = 1;
  int microbatches = 1;     // per step, per data rank
  StageSplit split;         // by parameters, by measured time, or counts per stage
  int64_t micro_batch = 1;  // sequences per micro-batch (for a split by time)
};

class StagedModel {
 public:
  // Collective over `world` (a "time" split measures on every rank and uses
  // the mean) and `pipeline` (the pp axis). Cuts `model` down to this rank's
  // stages; a tied embedding stays on the first and the last stage.
  StagedModel(model::Gpt& model, const std::shared_ptr<comm::Communicator>& world,
              std::shared_ptr<comm::Communicator> pipeline, const StagedModelOptions& options);

  const Schedule& schedule() const { return schedule_; }
  Schedule forward_schedule(int microbatches) const;  // evaluation
  const std::vector<StageSpec>& stages() const { return stages_; }
  // Runs schedules; its callbacks run a stage with run_stage(model, stages()[s], x).
  PipelineExecutor& executor() { return *executor_; }
  const PipelineExecutor& executor() const { return *executor_; }
  const std::shared_ptr<comm::Communicator>& comm() const { return pipeline_; }
  // The group of the first and last pipeline rank when they both hold a tied
  // embedding (null otherwise, and on the ranks between).
  const std::shared_ptr<comm::Communicator>& tied_embedding_group() const { return embedding_; }
  // Whether `name` is this rank's copy of a tied embedding that the first
  // stage also holds (it is then saved and counted there).
  bool is_tied_copy(const std::string& name) const;
  static const char* tied_embedding_name() { return "wte.weight"; }
  // Every parameter of the whole model from the pipeline rank holding it,
  // in the same order on every rank: `mine` are this rank's. Collective.
  std::map<std::string, at::Tensor> gather_parameters(const std::map<std::string, at::Tensor>& mine) const;
  // "pp(2) 1f1b with 4 micro-batches of 8, bubble 20%; stages: embed+blocks 0-2 | blocks 3-5+head"
  std::string describe(int64_t micro_batch) const;

 private:
  model::Gpt& model_;
  std::shared_ptr<comm::Communicator> pipeline_, embedding_;
  StagedModelOptions options_;
  std::vector<StageSpec> stages_;
  Schedule schedule_;
  std::unique_ptr<PipelineExecutor> executor_;
  // Every parameter of the whole model: name, number of dims (the holder
  // sends the sizes), the pipeline rank holding it.
  struct Home {
    std::string name;
    int64_t dims;
    int pipeline_rank;
  };
  std::vector<Home> homes_;
};

}  // namespace meshtrain::parallel::pipeline
