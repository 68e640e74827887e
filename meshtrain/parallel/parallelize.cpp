#include "meshtrain/parallel/parallelize.h"

#include "meshtrain/comm/backend/staged/host_staged_communicator.h"
#include "meshtrain/parallel/annotated_tensor_parallel.h"
#include "meshtrain/parallel/tensor_parallel.h"
#include "meshtrain/util/files.h"

namespace meshtrain::parallel {

namespace {

void apply_lora(Parallelized& p) {
  const model::LoraConfig& lora = p.options.lora;
  if (!lora.enabled()) return;
  if (p.spec().annotated()) {
    throw config::ConfigError("lora with tp_impl = \"annotations\" is not supported; use tp_impl = \"plan\"");
  }
  if (lora.base_dtype != at::kFloat && !p.options.bfloat16_autocast) {
    throw config::ConfigError("lora.base_dtype = \"bfloat16\" needs bf16 autocast (training.dtype = \"bfloat16\")");
  }
  p.lora = model::apply_lora(p.model, lora, p.options.seed);
}

void apply_tensor_parallel(Parallelized& p) {
  const ParallelSpec& spec = p.spec();
  if (spec.annotated()) {
    // A mesh of the tp group alone: each rank's micro-batch is its own, not
    // a Replicate value over dp that a rule could cut and gather.
    const int tp_size = static_cast<int>(spec.dims.tp);
    auto tp_mesh =
        std::make_shared<mesh::DeviceMesh>(p.mesh->comm("tp"), mesh::MeshLayout::from_degrees({{"tp", tp_size}}, tp_size));
    auto annotated = std::make_unique<AnnotatedTensorParallel>(p.model, std::move(tp_mesh));
    p.trained = annotated->local_module();
    p.tensor = std::move(annotated);
  } else if (spec.dims.tensor_parallel()) {
    const bool sp = spec.dims.sequence_parallel;
    p.tensor = std::make_unique<TensorParallel>(p.model, p.mesh->comm("tp"), gpt_tensor_parallel_plan(p.model->config(), sp),
                                                TensorParallelOptions{sp, p.options.seed});
  }
  if (!p.tensor) return;
  const TensorParallelism* tp = p.tensor.get();
  p.norm_groups.tensor = tp->comm();
  p.norm_groups.split_over_tensor = [tp](const std::string& name) { return tp->is_split(name); };
}

void apply_expert_parallel(Parallelized& p) {
  if (p.spec().dims.ep == 1) return;
  p.experts = std::make_unique<ExpertParallel>(p.model, p.mesh->comm("ep"));
  p.norm_groups.expert = p.experts->comm();
  p.norm_groups.split_over_experts = &model::is_expert_tensor;
}

void apply_pipeline(Parallelized& p) {
  const mesh::ParallelDims& dims = p.spec().dims;
  if (!dims.pipelined()) return;
  pipeline::StagedModelOptions o;
  o.schedule = dims.schedule;
  o.virtual_stages = static_cast<int>(dims.virtual_stages);
  o.microbatches = static_cast<int>(p.options.microbatches);
  o.split = p.spec().pp_split;
  o.micro_batch = p.options.micro_batch;
  p.pipeline = std::make_unique<pipeline::StagedModel>(p.model, p.world, p.mesh->comm("pp"), o);
  p.norm_groups.pipeline = p.pipeline->comm();
  const pipeline::StagedModel* staged = p.pipeline.get();
  if (staged->tied_embedding_group() && staged->comm()->rank() != 0) {
    p.norm_groups.counted_elsewhere = [staged](const std::string& name) { return staged->is_tied_copy(name); };
  }
}

void apply_context_parallel(Parallelized& p) {
  const mesh::ParallelDims& dims = p.spec().dims;
  if (!dims.context_parallel()) return;
  p.context = std::make_unique<ContextParallel>(p.model, p.mesh->comm("cp"), dims.cp_impl,
                                                dims.a2a_group(model_dims(p.model->config())));
}

void apply_activation_checkpointing(Parallelized& p) {
  const ParallelSpec& spec = p.spec();
  if (spec.activation_checkpoint == CheckpointMode::kNone) return;
  std::vector<RandomStream> streams;
  if (p.tensor) {
    for (const RandomStreams::PerRank& s : p.tensor->random_streams()) streams.push_back(s.stream);
  }
  p.checkpointing =
      apply_activation_checkpoint(p.model, spec.activation_checkpoint, spec.activation_checkpoint_every, std::move(streams));
}

void apply_data_parallel(Parallelized& p) {
  DataParallelOptions o;
  o.bucket_bytes = p.spec().bucket_mb << 20;
  o.first_bucket_bytes = p.spec().first_bucket_mb << 20;
  o.adamw = p.options.adamw;
  o.norm = p.norm_groups;
  o.data_degree = p.spec().dims.dp * p.spec().dims.fsdp * p.spec().dims.ep;
  if (p.experts) {
    o.expert = &model::is_expert_tensor;
    o.expert_comm = p.mesh->comm(std::vector<std::string>{"dp", "fsdp", "cp"});
    o.expert_scale = 1.0 / static_cast<double>(p.spec().dims.ep);
  }
  p.data_parallelism = std::make_unique<DataParallel>(*p.trained, p.reduce, o);
}

void apply_fully_sharded(Parallelized& p) {
  const ParallelSpec& spec = p.spec();
  FullyShardedOptions o;
  o.stage = spec.dims.zero_stage;
  o.units = spec.unit_policy == ShardUnits::kModel ? UnitPolicy::whole_model() : UnitPolicy::blocks();
  o.prefetch = spec.prefetch;
  o.reshard_after_forward = spec.reshard_after_forward;
  o.param_dtype = spec.param_dtype;
  o.reduce_dtype = spec.reduce_dtype;
  o.stage1_reduce_scatter = spec.zero1_reduce == Zero1Reduce::kReduceScatter;
  o.offload_optimizer = spec.offload_optimizer;
  o.offload_params = spec.offload_params;
  o.nvme_dir = spec.offload_nvme_dir.empty() ? "/tmp" : spec.offload_nvme_dir;
  if (o.offload_optimizer == offload::Tier::kNvme || o.offload_params == offload::Tier::kNvme) {
    util::make_directories(o.nvme_dir);
  }
  o.adamw = p.options.adamw;
  o.split_over_tensor = p.norm_groups.split_over_tensor;
  o.counted_elsewhere = p.norm_groups.counted_elsewhere;
  // Both copies of a tied embedding shard alike in a unit of their own.
  if (p.pipeline && p.pipeline->tied_embedding_group()) {
    o.own_unit = [](const std::string& name) { return name == pipeline::StagedModel::tied_embedding_name(); };
  }
  // Context-parallel peers hold copies of the same shards, like replicas.
  ShardingGroups groups{p.mesh->comm("fsdp"), p.mesh->comm(std::vector<std::string>{"dp", "cp"}), p.reduce,
                        p.norm_groups.tensor, p.norm_groups.pipeline};
  if (p.experts) {
    // Non-expert parameters are copies over dp x ep (x cp); an expert's over dp (x cp) only.
    groups.replicate = p.mesh->comm(std::vector<std::string>{"dp", "ep", "cp"});
    groups.expert_replicate = p.mesh->comm(std::vector<std::string>{"dp", "cp"});
    groups.expert_all = p.mesh->comm(std::vector<std::string>{"dp", "fsdp", "cp"});
    groups.expert = p.experts->comm();
    o.expert = &model::is_expert_tensor;
    o.expert_scale = 1.0 / static_cast<double>(spec.dims.ep);
  }
  p.data_parallelism = std::make_unique<FullySharded>(p.trained, groups, o);
}

}  // namespace

Parallelized parallelize(model::Gpt model, std::shared_ptr<comm::Communicator> world, const ParallelizeOptions& options) {
  Parallelized p;
  p.options = options;
  p.options.spec.check(world->size(), model->config(), {options.bfloat16_autocast, options.device.is_cpu()});
  p.options.spec.check_microbatches(options.microbatches);
  p.world = comm::device_communicator(std::move(world), options.device);
  p.model = std::move(model);
  p.model->to(options.device);
  p.trained = p.model.ptr();
  p.mesh = std::make_shared<mesh::DeviceMesh>(p.world, p.spec().dims.mesh_layout());
  p.data = p.mesh->comm(std::vector<std::string>{"dp", "fsdp", "ep"});
  p.reduce = p.mesh->comm(std::vector<std::string>{"dp", "fsdp", "ep", "cp"});
  apply_lora(p);
  apply_tensor_parallel(p);
  apply_expert_parallel(p);
  apply_pipeline(p);
  if (p.lora) model::freeze_base(*p.model);  // the pipeline's copy of a tied embedding too
  apply_context_parallel(p);
  apply_activation_checkpointing(p);
  if (p.spec().dims.zero_stage == 0) {
    apply_data_parallel(p);
  } else {
    apply_fully_sharded(p);
  }
  p.random = RandomStreams(options.device, p.tensor ? p.tensor->random_streams() : std::vector<RandomStreams::PerRank>{});
  return p;
}

std::string Parallelized::describe() const {
  std::string text = data_parallelism->describe();
  if (tensor) text += " x " + tensor->describe();
  if (experts) {
    text += " x expert parallel ep(" + std::to_string(spec().dims.ep) + "), " +
            std::to_string(experts->experts_per_rank()) + " experts per rank";
  }
  if (context) text += " x " + context->describe();
  if (pipeline) text += ", " + pipeline->describe(options.micro_batch);
  if (lora) {
    text += ", LoRA r " + std::to_string(options.lora.rank) + " on " + std::to_string(options.lora.targets.size()) +
            " targets";
  }
  if (checkpointing) {
    text += ", activation checkpointing " + config::name_of(checkpoint_mode_names(), spec().activation_checkpoint) +
            (spec().activation_checkpoint_every > 1
                 ? " every " + std::to_string(spec().activation_checkpoint_every) + " blocks"
                 : "");
  }
  return text;
}

}  // namespace meshtrain::parallel
