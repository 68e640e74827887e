#include "meshtrain/train/trainer.h"

#include "meshtrain/comm/agree.h"
#include "meshtrain/comm/watchdog.h"
#include "meshtrain/model/generate.h"
#include "meshtrain/parallel/grad_norm.h"
#include "meshtrain/parallel/pipeline/trace.h"
#include "meshtrain/util/files.h"

#include <ATen/autocast_mode.h>
#include <nlohmann/json.hpp>

#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <cstdio>

namespace meshtrain::train {

namespace {

using Clock = std::chrono::steady_clock;

double peak_rss_mib() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

std::string human_duration(double seconds) {
  char text[32];
  const auto s = static_cast<long long>(seconds + 0.5);
  if (s >= 3600) std::snprintf(text, sizeof text, "%lldh%02lldm", s / 3600, s % 3600 / 60);
  else if (s >= 60) std::snprintf(text, sizeof text, "%lldm%02llds", s / 60, s % 60);
  else std::snprintf(text, sizeof text, "%llds", s);
  return text;
}

// With pipelines the first and the last stage each hold a tied embedding.
constexpr const char* kTiedEmbedding = "wte.weight";
bool is_tied_embedding(const std::string& name) { return name == kTiedEmbedding; }

// Autocast of matmuls to bfloat16 on the CPU for the lifetime of the object.
class Autocast {
 public:
  explicit Autocast(bool enabled) : enabled_(enabled) {
    if (!enabled_) return;
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
  }
  ~Autocast() {
    if (!enabled_) return;
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
  }

 private:
  bool enabled_;
};

}  // namespace

double measure_matmul_peak() {
  const int64_t n = 1024;
  at::Tensor a = at::randn({n, n}), b = at::randn({n, n}), c = at::empty({n, n});
  at::mm_out(c, a, b);
  double best = 1e30;
  for (int i = 0; i < 3; ++i) {
    const auto start = Clock::now();
    at::mm_out(c, a, b);
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  return 2.0 * n * n * n / best;
}

double learning_rate(const TrainConfig& config, int64_t step) {
  if (config.warmup > 0 && step < config.warmup) return config.lr * (step + 1) / config.warmup;
  const int64_t decay_steps = std::max<int64_t>(1, config.steps - config.warmup);
  const double progress = std::min(1.0, double(step - config.warmup) / decay_steps);
  return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1.0 + std::cos(M_PI * progress));
}

Trainer::Trainer(TrainConfig config, std::shared_ptr<comm::Communicator> world)
    : config_(std::move(config)), world_(std::move(world)), checkpoints_(config_.checkpoint_path(), config_.checkpoint_keep) {
  // Data: token files as given, or the configured text prepared once by rank 0.
  if (config_.train_file.empty()) {
    const std::string data_dir = config_.out + "/data";
    comm::on_root_or_all_fail(*world_, 0, [&] {
      const PrepareResult prepared = prepare(config_.text, data_dir, config_.val_fraction);
      std::printf("meshtrain: prepared %zu text file(s) into %s: %lld training and %lld validation tokens\n",
                  prepared.sources.size(), data_dir.c_str(), static_cast<long long>(prepared.train_tokens),
                  static_cast<long long>(prepared.val_tokens));
    });
    config_.train_file = data_dir + "/train.bin";
    config_.val_file = data_dir + "/val.bin";
  }
  train_file_ = std::make_unique<TokenFile>(config_.train_file);
  val_file_ = std::make_unique<TokenFile>(config_.val_file);
  for (const TokenFile* file : {train_file_.get(), val_file_.get()}) {
    if (file->vocab_size() > config_.model.vocab_size) {
      throw DataError("data file " + file->path() + ": its vocabulary of " + std::to_string(file->vocab_size()) +
                      " tokens is larger than model.vocab_size = " + std::to_string(config_.model.vocab_size));
    }
  }
  train_sampler_ = std::make_unique<Sampler>(*train_file_, config_.model.context, config_.seed, /*shuffle=*/true);
  val_sampler_ = std::make_unique<Sampler>(*val_file_, config_.model.context, config_.seed, /*shuffle=*/false);

  memory::install();
  memory::set_rank(world_->rank());
  previous_limit_ = memory::limit();
  if (config_.memory_limit_mb > 0) memory::set_limit(config_.memory_limit_mb << 20);

  // Mesh pp x dp x fsdp x tp (pp outermost, tp innermost): micro-batches are
  // read per (dp, fsdp) coordinate; the ranks of a tp group and of a pipeline
  // read the same ones.
  mesh_ = std::make_unique<mesh::DeviceMesh>(
      world_, mesh::MeshLayout::from_degrees({{"pp", static_cast<int>(config_.parallel.pp)},
                                              {"dp", static_cast<int>(config_.parallel.dp)},
                                              {"fsdp", static_cast<int>(config_.parallel.fsdp)},
                                              {"tp", static_cast<int>(config_.parallel.tp)}},
                                             world_->size()));
  data_ = mesh_->comm(std::vector<std::string>{"dp", "fsdp"});

  // Apply order: tensor parallel, pipeline stages, activation checkpointing,
  // then data parallel or sharding over the rest.
  model_ = model::Gpt(config_.model, config_.seed);
  for (const auto& item : model_->named_parameters()) homes_.push_back({item.key(), item.value().sizes().vec(), 0});
  if (config_.parallel.tp > 1) {
    tensor_parallel_ = std::make_unique<parallel::TensorParallel>(
        model_, mesh_->comm("tp"), parallel::gpt_tensor_parallel_plan(config_.model, config_.parallel.sequence_parallel),
        parallel::TensorParallelOptions{config_.parallel.sequence_parallel, config_.seed});
  }
  if (config_.parallel.pp > 1) apply_pipeline();
  // How this rank's parameters add up to the model's (gradient norms).
  if (const parallel::TensorParallel* tp = tensor_parallel_.get()) {
    model_parallel_.tensor = tp->comm();
    model_parallel_.split_over_tensor = [tp](const std::string& name) { return tp->is_split(name); };
  }
  model_parallel_.pipeline = pipeline_;
  if (embedding_ && pipeline_->rank() != 0) model_parallel_.counted_elsewhere = is_tied_embedding;
  const parallel::CheckpointMode checkpoint_mode = parallel::parse_checkpoint_mode(config_.activation_checkpoint);
  if (checkpoint_mode != parallel::CheckpointMode::kNone) {
    std::vector<parallel::RandomStream> streams;
    if (parallel::TensorParallel* tp = tensor_parallel_.get()) {
      streams.push_back({[tp] { return tp->local_random_state(); }, [tp](const at::Tensor& s) { tp->set_local_random_state(s); }});
    }
    checkpointing_ = parallel::apply_activation_checkpoint(model_, checkpoint_mode, config_.activation_checkpoint_every,
                                                           std::move(streams));
  }
  if (config_.parallel.zero_stage == 0) {
    data_parallel_ = std::make_unique<parallel::DataParallel>(*model_, data_, [&] {
      parallel::DataParallelOptions options;
      options.bucket_bytes = config_.bucket_mb << 20;
      return options;
    }());
    // Weight decay on matrices and embeddings, not on biases and norm weights.
    std::vector<at::Tensor> decayed, undecayed;
    for (const at::Tensor& p : model_->parameters()) (p.dim() >= 2 ? decayed : undecayed).push_back(p);
    auto options = [&](double decay) {
      auto o = std::make_unique<torch::optim::AdamWOptions>(config_.lr);
      o->betas({config_.beta1, config_.beta2}).weight_decay(decay).eps(1e-8);
      return o;
    };
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decayed, options(config_.weight_decay));
    groups.emplace_back(undecayed, options(0.0));
    optimizer_ = std::make_unique<torch::optim::AdamW>(std::move(groups), *options(config_.weight_decay));
  } else {
    parallel::FullyShardedOptions options;
    options.stage = static_cast<int>(config_.parallel.zero_stage);
    options.unit_policy = config_.unit_policy;
    options.prefetch = config_.prefetch;
    options.reshard_after_forward = config_.reshard_after_forward;
    options.param_dtype = parallel::parse_dtype(config_.param_dtype);
    options.reduce_dtype = parallel::parse_dtype(config_.reduce_dtype);
    options.stage1_reduce_scatter = config_.zero1_reduce == "reduce_scatter";
    options.adamw = {config_.lr, config_.beta1, config_.beta2, 1e-8, config_.weight_decay};
    parallel::ShardingGroups groups{mesh_->comm("fsdp"), mesh_->comm("dp"), data_, model_parallel_.tensor,
                                    model_parallel_.pipeline};
    options.split_over_tensor = model_parallel_.split_over_tensor;
    options.counted_elsewhere = model_parallel_.counted_elsewhere;
    // Both copies of a tied embedding shard alike in a unit of their own.
    if (embedding_) options.own_unit = is_tied_embedding;
    sharded_ = std::make_unique<parallel::FullySharded>(model_, groups, options);
  }

  if (config_.resume) {
    const std::string latest = checkpoints_.latest();
    if (!latest.empty()) load_checkpoint(latest);
  }

  at::Tensor peak = at::full({1}, measure_matmul_peak(), at::kDouble);
  world_->all_reduce(peak, comm::ReduceOp::kAvg).wait();
  peak_flops_ = peak.item<double>();
}

Trainer::~Trainer() { memory::set_limit(previous_limit_); }

std::string Trainer::layout() const {
  std::string layout = sharded_ ? sharded_->layout() : "";
  auto add = [&](const std::string& part) {
    layout += (layout.empty() ? "zero_stage=0 dp=" + std::to_string(config_.parallel.dp) + " " : " ") + part;
  };
  if (tensor_parallel_) add(tensor_parallel_->layout());
  if (pipeline_) {
    std::string split;
    for (const auto& stage : stages_) split += (split.empty() ? "" : ",") + std::to_string(stage.end_block - stage.first_block);
    add("pp=" + std::to_string(config_.parallel.pp) + " v=" + std::to_string(config_.parallel.virtual_stages) + " blocks=" + split);
  }
  return layout;
}

void Trainer::apply_pipeline() {
  namespace pipe = parallel::pipeline;
  pipeline_ = mesh_->comm("pp");
  const int p = pipeline_->size(), v = static_cast<int>(config_.parallel.virtual_stages), me = pipeline_->rank();
  std::vector<int64_t> blocks;
  if (config_.pp_split == "params" || config_.pp_split == "time") {
    std::vector<double> costs = config_.pp_split == "params" ? pipe::parameter_costs(config_.model)
                                                             : pipe::measured_costs(config_.model, config_.micro_batch);
    // Every rank must cut alike: the mean of the ranks' measurements.
    at::Tensor mean = at::tensor(costs, at::kDouble);
    world_->all_reduce(mean, comm::ReduceOp::kAvg).wait();
    costs.assign(mean.data_ptr<double>(), mean.data_ptr<double>() + mean.numel());
    blocks = pipe::balance(costs, p * v);
  } else {
    blocks = pipe::parse_split(config_.pp_split, config_.model.layers, p * v);
  }
  stages_ = pipe::stage_specs(blocks);
  std::vector<pipe::StageSpec> mine;
  for (int s = me; s < p * v; s += p) {
    local_stages_.push_back(s);
    mine.push_back(stages_[s]);
  }
  // Which pipeline rank holds each parameter (the tied embedding: the first).
  for (ParameterHome& home : homes_) {
    int stage = 0;
    if (home.name.rfind("norm_f.", 0) == 0 || home.name.rfind("head.", 0) == 0) stage = p * v - 1;
    if (home.name.rfind("blocks.", 0) == 0) {
      const int64_t block = std::stoll(home.name.substr(7));
      while (stages_[stage].end_block <= block) ++stage;
    }
    home.pipeline_rank = stage % p;
  }
  pipe::keep_stages(model_, mine);
  const bool tied = config_.model.tie_embeddings;
  embedding_ = pipeline_->split(tied && (me == 0 || me == p - 1) ? 0 : -1, me, "pp:embedding");
  schedule_ = pipe::make_schedule(config_.parallel.schedule, p, v, static_cast<int>(config_.grad_accum));
  pipe::validate(schedule_);
  executor_ = std::make_unique<pipe::PipelineExecutor>(pipeline_);
}

double Trainer::run_pipeline(const parallel::pipeline::Schedule& schedule, const std::vector<at::Tensor>& inputs,
                             const std::vector<at::Tensor>& targets, double scale) {
  std::optional<memory::PhaseScope> backward_phase;
  parallel::pipeline::StageCallbacks callbacks;
  callbacks.forward = [&](int stage, int mb, const at::Tensor& input) {
    memory::PhaseScope phase(schedule.backward ? memory::Phase::kForward : memory::Phase::kEval);
    Autocast autocast(config_.dtype == "bfloat16");
    const parallel::pipeline::StageSpec& spec = stages_[stage];
    const at::Tensor out = parallel::pipeline::run_stage(model_, spec, spec.embed ? inputs[mb] : input);
    return spec.head ? model_->cross_entropy(out, targets[mb]) * scale : out;
  };
  callbacks.before_backward = [&](bool last) {
    backward_phase.emplace(memory::Phase::kBackward);
    if (sharded_) sharded_->set_sync(last);
    else data_parallel_->set_sync(last);
  };
  callbacks.after_backward = [&] {
    if (sharded_) sharded_->after_backward();
    backward_phase.reset();
  };
  const int64_t context = config_.model.context;
  const int64_t rows = config_.parallel.sequence_parallel ? context / config_.parallel.tp : context;
  const at::ScalarType dtype = sharded_ ? parallel::parse_dtype(config_.param_dtype) : at::kFloat;
  return executor_->run(schedule, callbacks, {inputs.front().size(0), rows, config_.model.width}, dtype);
}

void Trainer::write_trace() {
  const auto ranks = parallel::pipeline::gather_spans(*world_, executor_->spans(), 0);
  if (world_->rank() != 0) return;
  util::make_directories(config_.out);
  const std::string trace = config_.out + "/trace.json", picture = config_.out + "/timeline.svg";
  util::write_text_file(trace, parallel::pipeline::chrome_trace(ranks));
  char title[256];
  std::snprintf(title, sizeof title, "step %lld: %s, pp=%lld, v=%lld, %lld micro-batches, %d ranks",
                (long long)config_.trace_step, config_.parallel.schedule.c_str(), (long long)config_.parallel.pp,
                (long long)config_.parallel.virtual_stages, (long long)config_.grad_accum, world_->size());
  util::write_text_file(picture, parallel::pipeline::timeline_svg(ranks, title));
  std::printf("meshtrain: pipeline trace of step %lld in %s (open in ui.perfetto.dev), picture in %s\n",
              (long long)config_.trace_step, trace.c_str(), picture.c_str());
  std::fflush(stdout);
}

void Trainer::sum_tied_embedding_gradient() {
  if (!embedding_) return;
  at::Tensor grad = sharded_ ? sharded_->own_unit_shard_gradient(kTiedEmbedding) : model_->wte->weight.mutable_grad();
  embedding_->all_reduce(grad).wait();
}

std::string Trainer::shard_file() const { return "shard-rank-" + std::to_string(world_->rank()) + ".pt"; }

void Trainer::load_checkpoint(const std::string& folder) {
  CheckpointMeta meta;
  if (layout().empty()) {
    meta = checkpoints_.load(folder, *model_, optimizer_.get(), model_fingerprint());
  } else {
    comm::on_all_or_all_fail(*world_, [&] {
      meta = CheckpointStore::read_meta(folder);
      if (meta.model != model_fingerprint()) {
        throw CheckpointError("checkpoint " + folder + " holds a different model (" + meta.model + ") than configured (" +
                              model_fingerprint() + "); use another checkpoint.dir or set checkpoint.resume = false");
      }
      if (meta.layout != layout()) {
        throw CheckpointError("checkpoint " + folder + " was saved with layout '" +
                              (meta.layout.empty() ? std::string("zero_stage=0") : meta.layout) + "', this run is '" +
                              layout() + "'; resume with the same parallel settings and rank count, or set "
                              "checkpoint.resume = false (its model.pt holds the full parameters)");
      }
    });
    const std::string path = util::join_path(folder, shard_file());
    if (sharded_) {
      sharded_->load_shard(path);
    } else {
      // Tensor parallel over plain data parallel: this rank's parameter shards and optimizer.
      torch::NoGradGuard no_grad;
      torch::serialize::InputArchive archive, optimizer;
      archive.load_from(path);
      for (auto& item : model_->named_parameters()) {
        at::Tensor value;
        archive.read("param." + item.key(), value);
        item.value().copy_(value);
      }
      archive.read("optimizer", optimizer);
      optimizer_->load(optimizer);
    }
  }
  step_ = meta.step;
  cursor_ = meta.cursor;
  resumed_ = true;
}

std::map<std::string, at::Tensor> Trainer::full_parameters(int root) {
  std::map<std::string, at::Tensor> out;
  if (sharded_) {
    // Tensor parallel and pipeline gather next: every rank of them needs its part.
    out = sharded_->full_state_dict(tensor_parallel_ || pipeline_ ? -1 : root);
  } else {
    for (const auto& item : model_->named_parameters()) out[item.key()] = item.value().detach().clone();
  }
  if (tensor_parallel_) out = tensor_parallel_->gather_all(out);
  if (!pipeline_) return out;
  // Each parameter from the pipeline rank holding it, in the same order everywhere.
  std::map<std::string, at::Tensor> all;
  for (const ParameterHome& home : homes_) {
    at::Tensor t = pipeline_->rank() == home.pipeline_rank ? out.at(home.name).contiguous()
                                                            : at::empty(home.shape, at::kFloat);
    pipeline_->broadcast(t, home.pipeline_rank).wait();
    all[home.name] = t;
  }
  return all;
}

double Trainer::mfu(double tokens_per_second) const {
  return config_.model.flops_per_token() * tokens_per_second / (peak_flops_ * world_->size());
}

std::string Trainer::model_fingerprint() const {
  const auto& m = config_.model;
  return "gpt layers=" + std::to_string(m.layers) + " heads=" + std::to_string(m.heads) + " width=" +
         std::to_string(m.width) + " context=" + std::to_string(m.context) + " vocab=" + std::to_string(m.vocab_size) +
         " " + m.norm + "/" + m.position + "/" + m.mlp + (m.tie_embeddings ? "/tied" : "/untied") +
         (m.bias ? "/bias" : "/nobias");
}

StepResult Trainer::step() {
  const auto start = Clock::now();
  comm::WatchdogContext context("step " + std::to_string(step_ + 1));
  memory::reset_peaks();
  StepResult result;
  result.lr = learning_rate(config_, step_);

  if (sharded_) sharded_->zero_grad();
  else data_parallel_->zero_grad();
  double loss_sum = 0;
  const int64_t micro = config_.micro_batch, ranks = data_->size();
  auto rows = [&](int64_t a) { return train_sampler_->rows(cursor_ + (a * ranks + data_->rank()) * micro, micro); };
  if (executor_) {
    std::vector<at::Tensor> inputs, targets;
    for (int64_t a = 0; a < config_.grad_accum; ++a) {
      auto [x, y] = rows(a);
      inputs.push_back(x);
      targets.push_back(y);
    }
    loss_sum = run_pipeline(schedule_, inputs, targets, 1.0 / config_.grad_accum);
    if (config_.trace_step == step_ + 1) write_trace();
  }
  for (int64_t a = 0; a < config_.grad_accum && !executor_; ++a) {
    const bool last = a == config_.grad_accum - 1;
    if (sharded_) sharded_->set_sync(last);
    else data_parallel_->set_sync(last);
    auto [inputs, targets] = rows(a);
    at::Tensor loss;
    {
      memory::PhaseScope phase(memory::Phase::kForward);
      Autocast autocast(config_.dtype == "bfloat16");
      loss = model_->loss(inputs, targets) / static_cast<double>(config_.grad_accum);
    }
    {
      memory::PhaseScope phase(memory::Phase::kBackward);
      loss.backward();
      if (sharded_) sharded_->after_backward();
    }
    loss_sum += loss.item<double>();
  }
  cursor_ += config_.batch;

  {
    memory::PhaseScope phase(memory::Phase::kOptimizer);
    if (sharded_) {
      sum_tied_embedding_gradient();
      result.grad_norm = sharded_->clip_grad_norm(config_.grad_clip);
      sharded_->step(result.lr);
    } else {
      data_parallel_->finish();
      sum_tied_embedding_gradient();
      result.grad_norm = parallel::clip_grad_norm(*model_, config_.grad_clip, model_parallel_);
      for (auto& group : optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(result.lr);
      optimizer_->step();
    }
  }

  at::Tensor loss = at::full({1}, loss_sum, at::kDouble);
  if (pipeline_) pipeline_->all_reduce(loss).wait();  // the last stage has it
  data_->all_reduce(loss, comm::ReduceOp::kAvg).wait();  // tp ranks hold the same loss
  result.loss = loss.item<double>();
  result.step = ++step_;
  result.memory.model_states = memory::current_bytes();
  for (int p = 0; p < memory::kPhaseCount; ++p) result.memory.phase_peak[p] = memory::phase_peak_bytes(memory::Phase(p));
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

double Trainer::evaluate() {
  memory::PhaseScope phase(memory::Phase::kEval);
  torch::NoGradGuard no_grad;
  model_->eval();
  double total = 0;
  const int64_t micro = config_.micro_batch, ranks = data_->size();
  std::vector<at::Tensor> inputs, targets;
  for (int64_t i = 0; i < config_.eval_batches; ++i) {
    auto [x, y] = val_sampler_->rows((i * ranks + data_->rank()) * micro, micro);
    inputs.push_back(x);
    targets.push_back(y);
  }
  if (executor_) {
    const auto schedule = parallel::pipeline::forward_only(static_cast<int>(config_.parallel.pp),
                                                           static_cast<int>(config_.parallel.virtual_stages),
                                                           static_cast<int>(config_.eval_batches));
    total = run_pipeline(schedule, inputs, targets, 1.0);
  } else {
    for (int64_t i = 0; i < config_.eval_batches; ++i) {
      Autocast autocast(config_.dtype == "bfloat16");
      total += model_->loss(inputs[i], targets[i]).item<double>();
    }
  }
  model_->train();
  at::Tensor loss = at::full({1}, total / config_.eval_batches, at::kDouble);
  if (pipeline_) pipeline_->all_reduce(loss).wait();
  data_->all_reduce(loss, comm::ReduceOp::kAvg).wait();  // tp ranks hold the same loss
  return loss.item<double>();
}

void Trainer::save_checkpoint() {
  memory::PhaseScope phase(memory::Phase::kCheckpoint);
  CheckpointMeta meta{step_, cursor_, model_fingerprint(), model_config_to_json(config_.model), layout()};
  if (meta.layout.empty()) {
    comm::on_root_or_all_fail(*world_, 0, [&] { checkpoints_.save(meta, *model_, *optimizer_); });
    return;
  }
  // Every rank its shard file; rank 0 also the full parameters (model.pt, what
  // `meshtrain generate` and exports read).
  const std::map<std::string, at::Tensor> full = full_parameters(0);
  checkpoints_.save_collective(meta, *world_, [&](const std::string& staging) {
    std::vector<std::string> files = {shard_file()};
    const std::string path = util::join_path(staging, shard_file());
    if (sharded_) {
      sharded_->save_shard(path);
    } else {
      torch::serialize::OutputArchive archive, optimizer;
      for (const auto& item : model_->named_parameters()) archive.write("param." + item.key(), item.value().detach());
      optimizer_->save(optimizer);
      archive.write("optimizer", optimizer);
      archive.save_to(path);
    }
    if (world_->rank() == 0) {
      // From a whole model: a pipeline stage holds only its blocks' buffers.
      std::map<std::string, at::Tensor> buffers;
      const model::Gpt whole = pipeline_ ? model::Gpt(config_.model, config_.seed) : model_;
      for (const auto& item : whole->named_buffers()) buffers[item.key()] = item.value();
      write_model_archive(util::join_path(staging, "model.pt"), full, buffers);
      files.push_back("model.pt");
    }
    return files;
  });
}

void Trainer::log_metrics(const StepResult& result, std::optional<double> val_loss, double tokens_per_second) {
  // Per rank, in MiB: peak RSS, then the counted tensor memory of the step.
  constexpr double kMiB = 1048576.0;
  const memory::DeviceStats device = memory::device_stats(world_->device());
  const std::vector<double> mine = {peak_rss_mib(),
                                    result.memory.model_states / kMiB,
                                    result.memory.phase_peak[int(memory::Phase::kForward)] / kMiB,
                                    result.memory.phase_peak[int(memory::Phase::kBackward)] / kMiB,
                                    result.memory.phase_peak[int(memory::Phase::kOptimizer)] / kMiB,
                                    device.peak / kMiB};
  const int64_t fields = static_cast<int64_t>(mine.size());
  at::Tensor all = at::empty({world_->size() * fields}, at::kDouble);
  world_->all_gather(all, at::tensor(mine, at::kDouble)).wait();
  if (world_->rank() != 0) return;
  auto column = [&](int64_t field) {
    std::vector<double> values;
    for (int r = 0; r < world_->size(); ++r) values.push_back(std::round(all[r * fields + field].item<double>() * 100) / 100);
    return values;
  };
  nlohmann::json line = {{"step", result.step},
                         {"loss", result.loss},
                         {"lr", result.lr},
                         {"grad_norm", result.grad_norm},
                         {"tokens_per_s", tokens_per_second},
                         {"mfu", mfu(tokens_per_second)},
                         {"step_seconds", result.seconds},
                         {"peak_rss_mib", column(0)},
                         {"memory_mib", {{"model_states", column(1)},
                                         {"forward_peak", column(2)},
                                         {"backward_peak", column(3)},
                                         {"optimizer_peak", column(4)}}}};
  if (device.peak > 0) line["memory_mib"]["device_peak"] = column(5);
  if (val_loss) line["val_loss"] = *val_loss;
  metrics_ << line.dump() << "\n";
  metrics_.flush();
}

void Trainer::run() {
  const bool leader = world_->rank() == 0;
  if (leader) {
    util::make_directories(config_.out);
    metrics_.open(config_.out + "/metrics.jsonl", resumed_ ? std::ios::app : std::ios::trunc);
    const int64_t tokens_per_step = config_.batch * config_.model.context;
    std::string layout = "data parallel";
    if (sharded_) {
      layout = "ZeRO stage " + std::to_string(config_.parallel.zero_stage) + ", dp(" + std::to_string(config_.parallel.dp) + ") x fsdp(" +
               std::to_string(config_.parallel.fsdp) + "), " + std::to_string(sharded_->unit_count()) + " units, " +
               config_.param_dtype + " compute, " + config_.reduce_dtype + " reductions";
    }
    if (tensor_parallel_) {
      layout += " over " + std::to_string(config_.parallel.dp * config_.parallel.fsdp) + " x tensor parallel tp(" +
                std::to_string(config_.parallel.tp) + ")" + (config_.parallel.sequence_parallel ? " with sequence parallel" : "");
    }
    if (pipeline_) {
      std::string split;
      for (const auto& stage : stages_) split += (split.empty() ? "" : " | ") + stage.str();
      layout += ", pipeline pp(" + std::to_string(config_.parallel.pp) + ") " + config_.parallel.schedule + " with " +
                std::to_string(config_.grad_accum) + " micro-batches of " + std::to_string(config_.micro_batch) +
                (config_.parallel.virtual_stages > 1 ? ", " + std::to_string(config_.parallel.virtual_stages) + " virtual stages per rank" : "") +
                ", bubble " + std::to_string(int(100 * parallel::pipeline::theoretical_bubble(
                                  int(config_.parallel.pp), int(config_.parallel.virtual_stages), int(config_.grad_accum)) + 0.5)) +
                "%; stages: " + split;
    }
    if (checkpointing_) {
      layout += ", activation checkpointing " + config_.activation_checkpoint +
                (config_.activation_checkpoint_every > 1 ? " every " + std::to_string(config_.activation_checkpoint_every) + " blocks" : "");
    }
    std::printf("meshtrain: training %s (%s, %.2fM parameters) on %d rank(s), %s\n", config_.preset.c_str(),
                model_fingerprint().c_str(), config_.model.parameter_count() / 1e6, world_->size(), layout.c_str());
    if (config_.memory_limit_mb > 0) {
      std::printf("meshtrain: per-rank memory limit %lld MiB (counted CPU tensors)\n", (long long)config_.memory_limit_mb);
    }
    std::printf("meshtrain: %lld steps x %lld sequences x %lld tokens = %lld tokens per step (micro-batch %lld, "
                "accumulation %lld); data %s (%lld tokens)\n",
                (long long)config_.steps, (long long)config_.batch, (long long)config_.model.context,
                (long long)tokens_per_step, (long long)config_.micro_batch, (long long)config_.grad_accum,
                config_.train_file.c_str(), (long long)train_file_->size());
    std::printf("meshtrain: metrics to %s/metrics.jsonl, checkpoints to %s\n", config_.out.c_str(),
                checkpoints_.dir().c_str());
    if (resumed_) std::printf("meshtrain: resumed from %s at step %lld\n", checkpoints_.latest().c_str(), (long long)step_);
    std::fflush(stdout);
  }
  const auto run_start = Clock::now();
  const int64_t first_step = step_;
  while (step_ < config_.steps) {
    const StepResult result = step();
    const double tokens_per_second = config_.batch * config_.model.context / result.seconds;
    std::optional<double> val_loss;
    const bool last = step_ == config_.steps;
    if (last || (config_.eval_every > 0 && step_ % config_.eval_every == 0)) val_loss = evaluate();
    if (last || step_ % config_.log_every == 0) {
      log_metrics(result, val_loss, tokens_per_second);
      if (leader) {
        const double elapsed = std::chrono::duration<double>(Clock::now() - run_start).count();
        const double eta = elapsed / (step_ - first_step) * (config_.steps - step_);
        char val[32] = "";
        if (val_loss) std::snprintf(val, sizeof val, " | val %.4f", *val_loss);
        std::printf("step %5lld/%lld | loss %.4f%s | lr %.2e | grad norm %.3f | %.0f tok/s | MFU %.1f%% | mem %s | ETA %s\n",
                    (long long)step_, (long long)config_.steps, result.loss, val, result.lr, result.grad_norm,
                    tokens_per_second, 100 * mfu(tokens_per_second), memory::format_mib(result.memory.peak()).c_str(),
                    human_duration(eta).c_str());
        std::fflush(stdout);
      }
    }
    if (!last && config_.checkpoint_every > 0 && step_ % config_.checkpoint_every == 0) save_checkpoint();
  }
  save_checkpoint();
  if (config_.sample_tokens <= 0) return;
  // Split parameters are gathered into a plain fp32 model on rank 0 first.
  model::Gpt sampler = model_;
  if (!layout().empty()) {
    const std::map<std::string, at::Tensor> full = full_parameters(0);
    if (!leader) return;
    sampler = model::Gpt(config_.model, config_.seed);
    torch::NoGradGuard no_grad;
    for (auto& item : sampler->named_parameters()) item.value().copy_(full.at(item.key()));
  }
  if (leader) {
    const std::string prompt = "The ";
    model::SampleOptions options;
    options.tokens = config_.sample_tokens;
    options.seed = config_.seed;
    const at::Tensor prompt_tokens = at::tensor(std::vector<int64_t>(prompt.begin(), prompt.end()), at::kLong);
    const std::string text = ByteTokenizer::decode(model::generate(sampler, prompt_tokens, options));
    std::printf("\nmeshtrain: sample after %lld steps (temperature %.1f, top-k %lld):\n%s%s\n", (long long)step_,
                options.temperature, (long long)options.top_k, prompt.c_str(), text.c_str());
    std::fflush(stdout);
  }
}

}  // namespace meshtrain::train
