#include "meshtrain/parallel/pipeline/staged_model.h"

namespace meshtrain::parallel::pipeline {

StagedModel::StagedModel(model::Gpt& model, const std::shared_ptr<comm::Communicator>& world,
                         std::shared_ptr<comm::Communicator> pipeline, const StagedModelOptions& options)
    : model_(model), pipeline_(std::move(pipeline)), options_(options) {
  const int p = pipeline_->size(), v = options.virtual_stages, me = pipeline_->rank();
  const model::GptConfig& config = model->config();
  std::vector<int64_t> blocks;
  if (options.split.kind != StageSplit::Kind::kBlocks) {
    std::vector<double> costs = options.split.kind == StageSplit::Kind::kParams
                                    ? parameter_costs(config)
                                    : measured_costs(config, options.micro_batch);
    // Every rank must cut alike: the mean of the ranks' measurements.
    at::Tensor mean = at::tensor(costs, at::kDouble).to(world->device());
    world->all_reduce(mean, comm::ReduceOp::kAvg).wait();
    mean = mean.cpu();
    costs.assign(mean.data_ptr<double>(), mean.data_ptr<double>() + mean.numel());
    blocks = balance(costs, p * v);
  } else {
    blocks = options.split.blocks;
    check_block_counts(blocks, config.layers, p * v);
  }
  stages_ = stage_specs(blocks);
  std::vector<StageSpec> mine;
  for (int s = me; s < p * v; s += p) mine.push_back(stages_[s]);
  // Which pipeline rank holds each parameter (a tied embedding: the first).
  for (const auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    int stage = 0;
    if (name.rfind("norm_f.", 0) == 0 || name.rfind("head.", 0) == 0) stage = p * v - 1;
    if (name.rfind("blocks.", 0) == 0) {
      const int64_t block = std::stoll(name.substr(7));
      while (stages_[stage].end_block <= block) ++stage;
    }
    homes_.push_back({name, item.value().dim(), stage % p});
  }
  keep_stages(model, mine);
  const bool tied = config.tie_embeddings;
  embedding_ = pipeline_->split(tied && (me == 0 || me == p - 1) ? 0 : -1, me, "pp:embedding");
  if (embedding_ && embedding_->size() < 2) embedding_.reset();
  schedule_ = make_schedule(options.schedule, p, v, options.microbatches);
  validate(schedule_);
  executor_ = std::make_unique<PipelineExecutor>(pipeline_);
}

Schedule StagedModel::forward_schedule(int microbatches) const {
  return forward_only(pipeline_->size(), options_.virtual_stages, microbatches);
}

bool StagedModel::is_tied_copy(const std::string& name) const {
  return embedding_ && pipeline_->rank() != 0 && name == tied_embedding_name();
}

std::map<std::string, at::Tensor> StagedModel::gather_parameters(const std::map<std::string, at::Tensor>& mine) const {
  // The holder sends the shape first: the values may have been gathered over
  // other axes since the stages were cut (tensor parallel makes them whole).
  std::map<std::string, at::Tensor> all;
  for (const Home& home : homes_) {
    const bool holder = pipeline_->rank() == home.pipeline_rank;
    const at::TensorOptions on_device = at::TensorOptions().device(pipeline_->device());
    at::Tensor shape = holder ? at::tensor(mine.at(home.name).sizes().vec(), at::kLong).to(pipeline_->device())
                              : at::empty({home.dims}, on_device.dtype(at::kLong));
    pipeline_->broadcast(shape, home.pipeline_rank).wait();
    shape = shape.cpu();
    const std::vector<int64_t> sizes(shape.data_ptr<int64_t>(), shape.data_ptr<int64_t>() + shape.numel());
    at::Tensor t = holder ? mine.at(home.name).contiguous() : at::empty(sizes, on_device.dtype(at::kFloat));
    pipeline_->broadcast(t, home.pipeline_rank).wait();
    all[home.name] = t;
  }
  return all;
}

std::string StagedModel::describe(int64_t micro_batch) const {
  std::string split;
  for (const auto& stage : stages_) split += (split.empty() ? "" : " | ") + stage.str();
  const int p = pipeline_->size(), v = options_.virtual_stages, m = options_.microbatches;
  return "pipeline pp(" + std::to_string(p) + ") " + mesh::schedule_name(options_.schedule) + " with " + std::to_string(m) +
         " micro-batches of " + std::to_string(micro_batch) +
         (v > 1 ? ", " + std::to_string(v) + " virtual stages per rank" : "") + ", bubble " +
         std::to_string(int(100 * theoretical_bubble(p, v, m) + 0.5)) + "%; stages: " + split;
}

}  // namespace meshtrain::parallel::pipeline
