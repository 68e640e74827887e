#include "meshtrain/parallel/parallelize.h"

#include "meshtrain/annotate/dist_tensor.h"
#include "meshtrain/parallel/annotated_tensor_parallel.h"

#include "meshtrain/comm/backend/staged/host_staged_communicator.h"
#include "meshtrain/util/memory.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>

#include <filesystem>
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

// One row per world rank: rank r holds row r (Shard(0) nested over every axis).
placement::TensorSpec per_rank_rows(const mesh::MeshLayout& layout, int64_t row_numel) {
  placement::TensorSpec spec;
  spec.shape = {layout.world_size(), row_numel};
  for (const mesh::MeshAxis& axis : layout.axes()) {
    spec.axes.push_back(axis.name);
    spec.placements.push_back(placement::Placement::shard(0));
  }
  return spec;
}

// The state of a generator seeded from (seed, step).
at::Tensor seeded_state(uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return g.get_state();
}

}  // namespace

mesh::ModelDims model_dims(const model::GptConfig& config) {
  mesh::ModelDims dims;
  dims.layers = config.layers;
  dims.heads = config.heads;
  dims.kv_heads = config.key_value_heads();
  dims.ffn = config.mlp_hidden();
  dims.vocab = config.vocab_size;
  dims.context = config.context;
  dims.experts = config.moe_experts;
  return dims;
}

ParallelModel::ParallelModel(model::Gpt model, std::shared_ptr<comm::Communicator> world,
                             const ParallelizeOptions& options)
    : options_(options), world_(comm::device_communicator(std::move(world), options.device)), model_(std::move(model)) {
  model_->to(options_.device);
  options_.dims.check();
  options_.dims.check_model(model_dims(model_->config()));
  options_.dims.check_microbatches(options_.microbatches);
  mesh_ = std::make_shared<mesh::DeviceMesh>(world_, options_.dims.mesh_layout());
  data_ = mesh_->comm(std::vector<std::string>{"dp", "fsdp", "ep"});
  apply_tensor_parallel();
  apply_expert_parallel();
  apply_pipeline();
  apply_activation_checkpointing();
  apply_data_parallelism();
}

ParallelModel::~ParallelModel() = default;

void ParallelModel::apply_tensor_parallel() {
  if (options_.tp_impl == "annotations") {
    check_annotated_layout(options_.dims, options_.activation_checkpoint, options_.bfloat16_autocast, options_.device.is_cpu());
    // A mesh of the tp group alone: each rank's micro-batch is its own, not
    // a Replicate value over dp that a rule could cut and gather.
    const int tp_size = static_cast<int>(options_.dims.tp);
    auto tp_mesh =
        std::make_shared<mesh::DeviceMesh>(mesh_->comm("tp"), mesh::MeshLayout::from_degrees({{"tp", tp_size}}, tp_size));
    annotated_ = std::make_unique<AnnotatedTensorParallel>(model_, std::move(tp_mesh));
    const AnnotatedTensorParallel* tp = annotated_.get();
    norm_groups_.tensor = tp->comm();
    norm_groups_.split_over_tensor = [tp](const std::string& name) { return tp->is_split(name); };
    return;
  }
  if (!options_.dims.tensor_parallel()) return;
  const bool sp = options_.dims.sequence_parallel;
  tensor_parallel_ = std::make_unique<TensorParallel>(model_, mesh_->comm("tp"),
                                                      gpt_tensor_parallel_plan(model_->config(), sp),
                                                      TensorParallelOptions{sp, options_.seed});
  const TensorParallel* tp = tensor_parallel_.get();
  norm_groups_.tensor = tp->comm();
  norm_groups_.split_over_tensor = [tp](const std::string& name) { return tp->is_split(name); };
}

void ParallelModel::apply_expert_parallel() {
  if (options_.dims.ep == 1) return;
  expert_parallel_ = std::make_unique<ExpertParallel>(model_, mesh_->comm("ep"));
  norm_groups_.expert = expert_parallel_->comm();
  norm_groups_.split_over_experts = &model::is_expert_tensor;
}

void ParallelModel::set_aux_loss_scale(double scale) {
  for (model::Moe& layer : model_->moe_layers()) layer->set_aux_loss_scale(scale);
}

std::vector<model::MoeLayerMetrics> ParallelModel::moe_metrics() {
  std::vector<model::Moe> layers = model_->moe_layers();
  if (layers.empty()) return {};
  // Per layer: forwards, then the sums of aux, z, dropped, load and routed,
  // summed over every rank; the most any rank computed, its maximum.
  std::vector<double> rows, computed;
  for (model::Moe& layer : layers) {
    const model::MoeStats s = layer->stats();
    rows.insert(rows.end(), {double(s.forwards), s.aux_loss, s.z_loss, s.dropped, s.load_max_over_mean, s.routed});
    computed.push_back(s.computed);
    layer->reset_stats();
  }
  at::Tensor sums = at::tensor(rows, at::kDouble).to(world_->device());
  at::Tensor most = at::tensor(computed, at::kDouble).to(world_->device());
  world_->all_reduce(sums).wait();
  world_->all_reduce(most, comm::ReduceOp::kMax).wait();
  sums = sums.cpu();
  most = most.cpu();
  const double* sum = sums.data_ptr<double>();
  // Ranks that run this layer: those of its pipeline stage.
  const double ranks = static_cast<double>(world_->size()) / static_cast<double>(options_.dims.pp);
  std::vector<model::MoeLayerMetrics> out;
  for (int64_t block = 0, i = 0; block < model_->config().layers; ++block) {
    if (!model_->config().is_moe_block(block)) continue;
    const double forwards = std::max(1.0, sum[0]), balanced = std::max(1.0, sum[5] / ranks);
    out.push_back({block, sum[1] / forwards, sum[2] / forwards, sum[3] / forwards, sum[4] / forwards,
                   most.data_ptr<double>()[i] / balanced, computed[i] / balanced});
    ++i;
    sum += 6;
  }
  return out;
}

void ParallelModel::apply_pipeline() {
  if (!options_.dims.pipelined()) return;
  pipeline::StagedModelOptions o;
  o.schedule = options_.dims.schedule;
  o.virtual_stages = static_cast<int>(options_.dims.virtual_stages);
  o.microbatches = static_cast<int>(options_.microbatches);
  o.split = options_.pp_split;
  o.micro_batch = options_.micro_batch;
  staged_ = std::make_unique<pipeline::StagedModel>(model_, world_, mesh_->comm("pp"), o);
  norm_groups_.pipeline = staged_->comm();
  const pipeline::StagedModel* staged = staged_.get();
  if (staged->tied_embedding_group() && staged->comm()->rank() != 0) {
    norm_groups_.counted_elsewhere = [staged](const std::string& name) { return staged->is_tied_copy(name); };
  }
}

void ParallelModel::apply_activation_checkpointing() {
  const CheckpointMode mode = parse_checkpoint_mode(options_.activation_checkpoint);
  if (mode == CheckpointMode::kNone) return;
  std::vector<RandomStream> streams;
  if (TensorParallel* tp = tensor_parallel_.get()) {
    streams.push_back({[tp] { return tp->local_random_state(); }, [tp](const at::Tensor& s) { tp->set_local_random_state(s); }});
  }
  checkpointing_ = apply_activation_checkpoint(model_, mode, options_.activation_checkpoint_every, std::move(streams));
}

void ParallelModel::apply_data_parallelism() {
  if (options_.dims.zero_stage == 0) {
    DataParallelOptions o;
    o.bucket_bytes = options_.bucket_mb << 20;
    o.adamw = options_.adamw;
    o.norm = norm_groups_;
    if (expert_parallel_) {
      o.expert = &model::is_expert_tensor;
      o.expert_comm = mesh_->comm(std::vector<std::string>{"dp", "fsdp"});
      o.expert_scale = 1.0 / static_cast<double>(options_.dims.ep);
    }
    auto dp = std::make_unique<DataParallel>(annotated_ ? *annotated_->local_module() : *model_, data_, o);
    data_parallel_ = dp.get();
    data_parallelism_ = std::move(dp);
    return;
  }
  FullyShardedOptions o;
  o.stage = options_.dims.zero_stage;
  o.units = options_.unit_policy == "model" ? UnitPolicy::whole_model() : UnitPolicy::blocks();
  o.prefetch = options_.prefetch;
  o.reshard_after_forward = options_.reshard_after_forward;
  o.param_dtype = parse_dtype(options_.param_dtype);
  o.reduce_dtype = parse_dtype(options_.reduce_dtype);
  o.stage1_reduce_scatter = options_.zero1_reduce == "reduce_scatter";
  o.offload_optimizer = offload::parse_tier(options_.offload_optimizer, "offload.optimizer");
  o.offload_params = offload::parse_tier(options_.offload_params, "offload.params");
  if (o.offload_optimizer == offload::Tier::kNvme || o.offload_params == offload::Tier::kNvme) {
    std::filesystem::create_directories(options_.nvme_dir);
  }
  o.nvme_dir = options_.nvme_dir;
  o.adamw = options_.adamw;
  o.split_over_tensor = norm_groups_.split_over_tensor;
  o.counted_elsewhere = norm_groups_.counted_elsewhere;
  // Both copies of a tied embedding shard alike in a unit of their own.
  if (staged_ && staged_->tied_embedding_group()) {
    o.own_unit = [](const std::string& name) { return name == pipeline::StagedModel::tied_embedding_name(); };
  }
  ShardingGroups groups{mesh_->comm("fsdp"), mesh_->comm("dp"), data_, norm_groups_.tensor, norm_groups_.pipeline};
  if (expert_parallel_) {
    // Non-expert parameters are copies over dp x ep; an expert's over dp only.
    groups.replicate = mesh_->comm(std::vector<std::string>{"dp", "ep"});
    groups.expert_replicate = mesh_->comm("dp");
    groups.expert_all = mesh_->comm(std::vector<std::string>{"dp", "fsdp"});
    groups.expert = expert_parallel_->comm();
    o.expert = &model::is_expert_tensor;
    o.expert_scale = 1.0 / static_cast<double>(options_.dims.ep);
  }
  auto sharded = std::make_unique<FullySharded>(annotated_ ? annotated_->local_module() : model_.ptr(), groups, o);
  sharded_ = sharded.get();
  data_parallelism_ = std::move(sharded);
}

double ParallelModel::forward_backward(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets) {
  const int64_t count = static_cast<int64_t>(inputs.size());
  if (staged_) return run_pipeline(staged_->schedule(), inputs, targets, 1.0 / count);
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions(at::kDouble).device(options_.device));
  set_aux_loss_scale(1.0 / static_cast<double>(count));
  for (int64_t a = 0; a < count; ++a) {
    data_parallelism_->set_sync(a == count - 1);
    at::Tensor loss;
    {
      memory::PhaseScope phase(memory::Phase::kForward);
      Autocast autocast(options_.bfloat16_autocast, options_.device);
      loss = model_->loss(inputs[a], targets[a]) / static_cast<double>(count);
    }
    {
      memory::PhaseScope phase(memory::Phase::kBackward);
      loss.backward();
      if (annotated_) annotated_->after_backward();
      data_parallelism_->after_backward();
    }
    loss_sum += annotate::is_dist(loss) ? annotate::full_tensor(loss.detach()) : loss.detach();
  }
  return loss_sum.item<double>();  // once per step: on a GPU each item() waits for the queue
}

double ParallelModel::evaluate(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets) {
  memory::PhaseScope phase(memory::Phase::kEval);
  torch::NoGradGuard no_grad;
  model_->eval();
  at::Tensor total = at::zeros({}, at::TensorOptions(at::kDouble).device(options_.device));
  if (staged_) {
    total += run_pipeline(staged_->forward_schedule(static_cast<int>(inputs.size())), inputs, targets, 1.0);
  } else {
    for (size_t i = 0; i < inputs.size(); ++i) {
      Autocast autocast(options_.bfloat16_autocast, options_.device);
      const at::Tensor loss = model_->loss(inputs[i], targets[i]).detach();
      total += annotate::is_dist(loss) ? annotate::full_tensor(loss) : loss;
    }
  }
  model_->train();
  return total.item<double>();
}

double ParallelModel::run_pipeline(const pipeline::Schedule& schedule, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& targets, double scale) {
  std::optional<memory::PhaseScope> backward_phase;
  set_aux_loss_scale(scale);
  pipeline::StageCallbacks callbacks;
  callbacks.forward = [&](int stage, int mb, const at::Tensor& input) {
    memory::PhaseScope phase(schedule.backward ? memory::Phase::kForward : memory::Phase::kEval);
    Autocast autocast(options_.bfloat16_autocast, options_.device);
    const pipeline::StageSpec& spec = staged_->stages()[stage];
    const at::Tensor out = pipeline::run_stage(model_, spec, spec.embed ? inputs[mb] : input);
    return spec.head ? model_->cross_entropy(out, targets[mb]) * scale : out;
  };
  callbacks.before_backward = [&](bool last) {
    backward_phase.emplace(memory::Phase::kBackward);
    data_parallelism_->set_sync(last);
  };
  callbacks.after_backward = [&] {
    data_parallelism_->after_backward();
    backward_phase.reset();
  };
  const int64_t context = model_->config().context;
  const int64_t rows = options_.dims.sequence_parallel ? context / options_.dims.tp : context;
  const at::ScalarType dtype = sharded_ ? parse_dtype(options_.param_dtype) : at::kFloat;
  return staged_->executor().run(schedule, callbacks, {inputs.front().size(0), rows, model_->config().width}, dtype);
}

double ParallelModel::mean_loss(double local) {
  at::Tensor loss = at::full({1}, local, at::TensorOptions(at::kDouble).device(data_->device()));
  if (staged_) staged_->comm()->all_reduce(loss).wait();  // the last stage has it
  data_->all_reduce(loss, comm::ReduceOp::kAvg).wait();     // tensor-parallel ranks hold the same
  return loss.item<double>();
}

void ParallelModel::zero_grad() { data_parallelism_->zero_grad(); }

double ParallelModel::clip_grad_norm(double max_norm) {
  if (staged_ && staged_->tied_embedding_group()) {
    // The tied embedding's gradient: the sum of its first- and last-stage copies.
    at::Tensor grad = data_parallelism_->reduced_gradient(pipeline::StagedModel::tied_embedding_name());
    staged_->tied_embedding_group()->all_reduce(grad).wait();
  }
  return data_parallelism_->clip_grad_norm(max_norm);
}

void ParallelModel::step(double lr) { data_parallelism_->step(lr); }

ParameterLayout ParallelModel::parameter_layout(const std::string& name, const at::Tensor& local) const {
  ParameterLayout layout;
  layout.spec.shape = local.sizes().vec();
  layout.write = !(staged_ && staged_->is_tied_copy(name));
  if (expert_parallel_ && model::is_expert_tensor(name)) {
    // Experts split over ep, whole on every tp rank (written by the first).
    layout.spec.axes = {"ep"};
    layout.spec.placements = {expert_parallel_->placement_of(name)};
    layout.spec.shape[0] *= options_.dims.ep;
    layout.write = layout.write && (!tensor_parallel_ || mesh_->coordinate("tp") == 0);
    return layout;
  }
  layout.spec.axes = {"tp"};
  placement::Placement p = placement::Placement::replicate();
  if (tensor_parallel_) p = tensor_parallel_->placement_of(name);
  if (annotated_) p = annotated_->placement_of(name);
  if (p.is_shard()) layout.spec.shape[p.dim] *= options_.dims.tp;
  layout.spec.placements = {p};
  layout.write = layout.write && (p.is_shard() || mesh_->coordinate("tp") == 0);
  return layout;
}

placement::TrainingState ParallelModel::state() {
  placement::TrainingState state =
      data_parallelism_->state([this](const std::string& name, const at::Tensor& local) { return parameter_layout(name, local); });
  const mesh::MeshLayout& layout = mesh_->layout();
  cpu_random_state_ = at::detail::getDefaultCPUGenerator().get_state();
  state.push_back({"rng/cpu", per_rank_rows(layout, cpu_random_state_.numel()), cpu_random_state_, true});
  if (options_.device.is_cuda()) {
    cuda_random_state_ = at::globalContext().defaultGenerator(options_.device).get_state();
    state.push_back({"rng/cuda", per_rank_rows(layout, cuda_random_state_.numel()), cuda_random_state_, true});
  }
  if (tensor_parallel_) {
    tp_random_state_ = tensor_parallel_->local_random_state();
    state.push_back({"rng/tensor_parallel", per_rank_rows(layout, tp_random_state_.numel()), tp_random_state_, true});
  }
  return state;
}

void ParallelModel::after_load(int64_t optimizer_steps, bool random_streams) {
  data_parallelism_->after_load(optimizer_steps);
  if (!random_streams) return;
  at::Generator generator = at::detail::getDefaultCPUGenerator();  // shares the default state
  generator.set_state(cpu_random_state_);
  if (options_.device.is_cuda()) {
    at::Generator cuda = at::globalContext().defaultGenerator(options_.device);
    cuda.set_state(cuda_random_state_);
  }
  if (tensor_parallel_) tensor_parallel_->set_local_random_state(tp_random_state_);
}

void ParallelModel::reseed_random_streams(uint64_t seed, int64_t step) {
  // The same default stream on every rank (replicated regions draw alike),
  // a stream of its own per tensor-parallel rank, both moved on by the step.
  const uint64_t moved = seed + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(step + 1);
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  generator.set_state(seeded_state(moved));
  if (options_.device.is_cuda()) {
    at::Generator cuda = at::globalContext().defaultGenerator(options_.device);
    cuda.set_current_seed(moved);
  }
  if (tensor_parallel_) {
    tensor_parallel_->set_local_random_state(seeded_state(moved + 2718 + tensor_parallel_->comm()->rank()));
  }
}

std::map<std::string, at::Tensor> ParallelModel::full_parameters(int root) {
  // Tensor parallel and the pipeline gather next: every rank of them needs its part.
  std::map<std::string, at::Tensor> out =
      data_parallelism_->full_parameters(tensor_parallel_ || annotated_ || expert_parallel_ || staged_ ? -1 : root);
  if (tensor_parallel_) out = tensor_parallel_->gather_all(out);
  if (annotated_) out = annotated_->gather_all(out);
  if (expert_parallel_) out = expert_parallel_->gather_all(out);
  if (staged_) out = staged_->gather_parameters(out);
  return out;
}

std::string ParallelModel::describe() const {
  std::string text = data_parallelism_->describe();
  if (tensor_parallel_) {
    text += " x tensor parallel tp(" + std::to_string(options_.dims.tp) + ")" +
            (options_.dims.sequence_parallel ? " with sequence parallel" : "");
  }
  if (annotated_) text += " x tensor parallel tp(" + std::to_string(options_.dims.tp) + ") from sharding annotations";
  if (expert_parallel_) {
    text += " x expert parallel ep(" + std::to_string(options_.dims.ep) + "), " +
            std::to_string(expert_parallel_->experts_per_rank()) + " experts per rank";
  }
  if (staged_) text += ", " + staged_->describe(options_.micro_batch);
  if (checkpointing_) {
    text += ", activation checkpointing " + options_.activation_checkpoint +
            (options_.activation_checkpoint_every > 1
                 ? " every " + std::to_string(options_.activation_checkpoint_every) + " blocks"
                 : "");
  }
  return text;
}

std::unique_ptr<ParallelModel> parallelize(model::Gpt model, std::shared_ptr<comm::Communicator> world,
                                           const ParallelizeOptions& options) {
  return std::make_unique<ParallelModel>(std::move(model), std::move(world), options);
}

}  // namespace meshtrain::parallel
