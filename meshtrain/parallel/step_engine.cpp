#include "meshtrain/parallel/step_engine.h"

#include "meshtrain/annotate/dist_tensor.h"
#include "meshtrain/parallel/expert_parallel.h"
#include "meshtrain/parallel/pipeline/stages.h"
#include "meshtrain/util/memory.h"

#include <ATen/autocast_mode.h>

#include <optional>

namespace meshtrain::parallel {

namespace {

// Autocast of matmuls to bfloat16 on `device` for the lifetime of the object.
class Autocast {
 public:
  Autocast(bool enabled, at::Device device) : enabled_(enabled), type_(device.type()) {
    if (!enabled_) return;
    at::autocast::set_autocast_dtype(type_, at::kBFloat16);
    at::autocast::set_autocast_enabled(type_, true);
  }
  ~Autocast() {
    if (!enabled_) return;
    at::autocast::set_autocast_enabled(type_, false);
    at::autocast::clear_cache();
  }

 private:
  bool enabled_;
  at::DeviceType type_;
};

// A loss computed on distributed tensors (annotations) made a plain value.
at::Tensor plain(const at::Tensor& loss) { return annotate::is_dist(loss) ? annotate::full_tensor(loss) : loss; }

}  // namespace

StepEngine::StepEngine(Parallelized parts) : parts_(std::move(parts)) {}

void StepEngine::set_aux_loss_scale(double scale) {
  for (model::Moe& layer : parts_.model->moe_layers()) layer->set_aux_loss_scale(scale);
}

std::vector<model::Batch> StepEngine::local(const std::vector<model::Batch>& batches) const {
  if (!parts_.context) return batches;
  std::vector<model::Batch> out;
  for (const model::Batch& b : batches) out.push_back(parts_.context->shard(b));
  return out;
}

double StepEngine::forward_backward(const std::vector<model::Batch>& all) {
  const int64_t count = static_cast<int64_t>(all.size());
  set_aux_loss_scale(1.0 / static_cast<double>(count));
  const std::vector<model::Batch> batches = local(all);
  if (parts_.pipeline) return run_pipeline(parts_.pipeline->schedule(), batches);
  const ParallelizeOptions& o = parts_.options;
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions(at::kDouble).device(o.device));
  for (int64_t a = 0; a < count; ++a) {
    parts_.data_parallelism->set_sync(a == count - 1);
    at::Tensor loss;
    {
      memory::PhaseScope phase(memory::Phase::kForward);
      Autocast autocast(o.bfloat16_autocast, o.device);
      // Note [Head's gradient into .grad]: times the weight it is told, backward at once.
      loss = parts_.model->loss(batches[a], model::LossGradients::kIntoWeightGrad) * batches[a].weight;
    }
    {
      memory::PhaseScope phase(memory::Phase::kBackward);
      loss.backward();
      if (parts_.tensor) parts_.tensor->after_backward();
      parts_.data_parallelism->after_backward();
    }
    loss_sum += plain(loss.detach());
  }
  return loss_sum.item<double>();  // once per step: on a GPU each item() waits for the queue
}

double StepEngine::evaluate(const std::vector<model::Batch>& all) {
  const std::vector<model::Batch> batches = local(all);
  memory::PhaseScope phase(memory::Phase::kEval);
  torch::NoGradGuard no_grad;
  const ParallelizeOptions& o = parts_.options;
  parts_.model->eval();
  at::Tensor total = at::zeros({}, at::TensorOptions(at::kDouble).device(o.device));
  if (parts_.pipeline) {
    total += run_pipeline(parts_.pipeline->forward_schedule(static_cast<int>(batches.size())), batches);
  } else {
    for (const model::Batch& b : batches) {
      Autocast autocast(o.bfloat16_autocast, o.device);
      total += plain(parts_.model->loss(b).detach()) * b.weight;
    }
  }
  parts_.model->train();
  return total.item<double>();
}

double StepEngine::run_pipeline(const pipeline::Schedule& schedule, const std::vector<model::Batch>& batches) {
  const ParallelizeOptions& o = parts_.options;
  model::Gpt& model = parts_.model;
  pipeline::StagedModel& staged = *parts_.pipeline;
  std::optional<memory::PhaseScope> backward_phase;
  // One loss in flight: each loss's backward follows its forward, as Note [Head's gradient into .grad] needs.
  const model::LossGradients when = pipeline::losses_in_flight(schedule) > 1 ? model::LossGradients::kInBackward
                                                                             : model::LossGradients::kIntoWeightGrad;
  pipeline::StageCallbacks callbacks;
  callbacks.forward = [&](int stage, int mb, const at::Tensor& input) {
    memory::PhaseScope phase(schedule.backward ? memory::Phase::kForward : memory::Phase::kEval);
    Autocast autocast(o.bfloat16_autocast, o.device);
    const pipeline::StageSpec& spec = staged.stages()[stage];
    const model::Batch& batch = batches[mb];
    const at::Tensor out = pipeline::run_stage(model, spec, input, batch, when);
    return spec.head ? out * batch.weight : out;
  };
  callbacks.before_backward = [&](bool last) {
    backward_phase.emplace(memory::Phase::kBackward);
    parts_.data_parallelism->set_sync(last);
  };
  callbacks.after_backward = [&] {
    parts_.data_parallelism->after_backward();
    backward_phase.reset();
  };
  const mesh::ParallelDims& dims = parts_.spec().dims;
  const int64_t context = model->config().context;
  const int64_t rows = context / dims.cp / (dims.sequence_parallel ? dims.tp : 1);
  const at::ScalarType dtype = parts_.sharded() ? parts_.spec().param_dtype : at::kFloat;
  return staged.executor().run(schedule, callbacks, {batches.front().rows(), rows, model->config().width}, dtype);
}

double StepEngine::mean_loss(double local) {
  at::Tensor loss = at::full({1}, local, at::TensorOptions(at::kDouble).device(parts_.reduce->device()));
  if (parts_.pipeline) parts_.pipeline->comm()->all_reduce(loss).wait();  // the last stage has it
  parts_.reduce->all_reduce(loss, comm::ReduceOp::kAvg).wait();          // tensor-parallel ranks hold the same
  return loss.item<double>();
}

void StepEngine::zero_grad() { parts_.data_parallelism->zero_grad(); }

double StepEngine::clip_grad_norm(double max_norm) {
  const pipeline::StagedModel* staged = parts_.pipeline.get();
  if (staged && staged->tied_embedding_group() && !parts_.model->wte.is_empty() &&
      parts_.model->wte->weight.requires_grad()) {
    // The tied embedding's gradient (a frozen one has none): the sum of its first- and last-stage copies.
    at::Tensor grad = parts_.data_parallelism->reduced_gradient(pipeline::StagedModel::tied_embedding_name());
    staged->tied_embedding_group()->all_reduce(grad).wait();
  }
  return parts_.data_parallelism->clip_grad_norm(max_norm);
}

void StepEngine::step(double lr) { parts_.data_parallelism->step(lr); }

namespace {

// At most this many token streams of a pipeline stage go into rank_load_by_ep:
// a sample, so that the statistic's collective does not grow with the world.
constexpr int64_t kStreamsSampled = 32;

// The kept assignments per expert and routed count of every MoE layer's first
// forwards (MoeStats::kForwardsKept) in each token stream of its stage (a
// rank's tokens with its tensor and context parallel peers', which hold parts
// of the same micro-batch): [layers, forwards, streams, experts + 1], the last
// column the routed count; zeros where a stream ran fewer forwards or not the layer.
at::Tensor kept_by_stream(const std::vector<model::MoeStats>& stats, int64_t forwards, int64_t experts,
                          int64_t streams, int64_t stream, comm::Communicator& world) {
  at::Tensor all = at::zeros({static_cast<int64_t>(stats.size()), forwards, streams, experts + 1}, at::kFloat);
  if (stream < streams) {
    auto cell = all.accessor<float, 4>();
    for (size_t layer = 0; layer < stats.size(); ++layer) {
      const model::MoeStats& s = stats[layer];
      for (size_t f = 0; f < s.kept.size() && static_cast<int64_t>(f) < forwards; ++f) {
        for (size_t e = 0; e < s.kept[f].size() && static_cast<int64_t>(e) < experts; ++e) {
          cell[layer][f][stream][e] = static_cast<float>(s.kept[f][e]);
        }
        cell[layer][f][stream][experts] = static_cast<float>(s.routed_by_forward[f]);
      }
    }
  }
  at::Tensor summed = all.to(world.device());
  world.all_reduce(summed).wait();
  return summed.cpu().to(at::kDouble).contiguous();
}

}  // namespace

std::vector<model::MoeLayerMetrics> StepEngine::moe_metrics() {
  std::vector<model::Moe> layers = parts_.model->moe_layers();
  if (layers.empty()) return {};
  const model::GptConfig& config = parts_.model->config();
  const int64_t experts = config.moe_experts, width = 6;
  // Per layer: forwards, then the sums of aux, z, dropped, load and routed,
  // summed over every rank; the most any rank computed, its maximum (and the
  // most forwards any rank ran).
  std::vector<double> rows, computed;
  std::vector<model::MoeStats> stats;
  double forwards_here = 0;
  for (model::Moe& layer : layers) {
    stats.push_back(layer->stats());
    const model::MoeStats& s = stats.back();
    rows.insert(rows.end(), {double(s.forwards), s.aux_loss, s.z_loss, s.dropped, s.load_max_over_mean, s.routed});
    computed.push_back(s.computed);
    forwards_here = std::max(forwards_here, static_cast<double>(s.kept.size()));
    layer->reset_stats();
  }
  computed.push_back(forwards_here);
  const std::shared_ptr<comm::Communicator>& world = parts_.world;
  at::Tensor sums = at::tensor(rows, at::kDouble).to(world->device());
  at::Tensor most = at::tensor(computed, at::kDouble).to(world->device());
  world->all_reduce(sums).wait();
  world->all_reduce(most, comm::ReduceOp::kMax).wait();
  sums = sums.cpu();
  most = most.cpu();
  // Token streams: the ranks of a stage over its tensor and context parallel peers (Note [Layout rules]).
  const mesh::ParallelDims& dims = parts_.spec().dims;
  const int64_t peers = dims.tp * dims.cp, per_stage = world->size() / dims.pp;
  const int64_t streams = std::min(kStreamsSampled, per_stage / peers);
  const int64_t forwards_max = static_cast<int64_t>(most.data_ptr<double>()[layers.size()]);
  const at::Tensor sources = forwards_max > 0 ? kept_by_stream(stats, forwards_max, experts, streams,
                                                               (world->rank() % per_stage) / peers, *world)
                                              : at::Tensor();
  const double* sum = sums.data_ptr<double>();
  // Ranks that run this layer: those of its pipeline stage.
  const double ranks = static_cast<double>(world->size()) / static_cast<double>(dims.pp);
  std::vector<model::MoeLayerMetrics> out;
  for (int64_t block = 0, i = 0; block < config.layers; ++block) {
    if (!config.is_moe_block(block)) continue;
    const double forwards = std::max(1.0, sum[0]), balanced = std::max(1.0, sum[5] / ranks);
    model::MoeLayerMetrics m{block, sum[1] / forwards, sum[2] / forwards, sum[3] / forwards, sum[4] / forwards,
                             most.data_ptr<double>()[i] / balanced, computed[i] / balanced, dims.ep, {}};
    // The token sources forward by forward, stream by stream (parallel::grouped_rank_load).
    std::vector<std::vector<double>> kept;
    std::vector<double> routed;
    if (sources.defined()) {
      const int64_t count = forwards_max * streams;
      const double* row = sources.data_ptr<double>() + i * count * (experts + 1);
      for (int64_t s = 0; s < count; ++s, row += experts + 1) {
        kept.emplace_back(row, row + experts);
        routed.push_back(row[experts]);
      }
    }
    for (int64_t ep = 1; sum[5] > 0 && ep <= experts; ++ep) {
      if (experts % ep == 0) m.rank_load_by_ep.emplace_back(ep, grouped_rank_load(kept, routed, ep, streams));
    }
    out.push_back(std::move(m));
    ++i;
    sum += width;
  }
  return out;
}

}  // namespace meshtrain::parallel
