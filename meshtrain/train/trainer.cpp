#include "meshtrain/train/trainer.h"

#include "meshtrain/annotate/report.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>

#include "meshtrain/comm/agree.h"
#include "meshtrain/comm/job_environment.h"
#include "meshtrain/train/shared_folders.h"
#include "meshtrain/model/config_json.h"
#include "meshtrain/comm/runtime.h"
#include "meshtrain/comm/watchdog.h"
#include "meshtrain/model/generate.h"
#include "meshtrain/model/text_stream.h"
#include "meshtrain/parallel/parallel_state.h"
#include "meshtrain/parallel/pipeline/trace.h"
#include "meshtrain/train/matmul_peak.h"
#include "meshtrain/util/files.h"

#include <chrono>
#include <map>
#include <mutex>
#include <tuple>

namespace meshtrain::train {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

double learning_rate(const TrainConfig& config, int64_t step) {
  if (config.warmup > 0 && step < config.warmup) return config.lr * (step + 1) / config.warmup;
  const int64_t decay_steps = std::max<int64_t>(1, config.steps - config.warmup);
  const double progress = std::min(1.0, double(step - config.warmup) / decay_steps);
  return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1.0 + std::cos(M_PI * progress));
}

parallel::ParallelizeOptions parallelize_options(const TrainConfig& c, at::Device device) {
  parallel::ParallelizeOptions o;
  o.spec = c.parallel;
  o.spec.offload_nvme_dir = c.nvme_dir();
  o.device = device;
  o.seed = c.seed;
  o.micro_batch = c.micro_batch;
  o.microbatches = c.grad_accum;
  o.bfloat16_autocast = c.bfloat16();
  o.adamw = {c.lr, c.beta1, c.beta2, 1e-8, c.weight_decay};
  o.lora = c.lora;
  return o;
}

Trainer::Trainer(TrainConfig config, std::shared_ptr<comm::Communicator> world, Relaunch relaunch)
    : config_(std::move(config)), world_(std::move(world)), device_(config_.torch_device(comm::node_local_rank())) {
  std::vector<SharedFolder> shared{{"run.out", config_.out}};
  if (!config_.checkpoint_local) shared.push_back({"checkpoint.dir", config_.checkpoint_path()});
  check_shared_folders(*world_, shared);
  if (config_.checkpoint_local) check_local_folder(*world_, {"checkpoint.dir", config_.checkpoint_path()});
  open_data();
  memory::install();
  memory::set_rank(world_->rank());
  previous_limit_ = memory::limit();
  if (config_.memory_limit_mb > 0) memory::set_limit(config_.memory_limit_mb << 20);

  engine_ = std::make_unique<parallel::StepEngine>(
      parallel::parallelize(model::Gpt(config_.model, config_.seed), world_, parallelize_options(config_, device_)));
  writer_ = std::make_unique<checkpoint::CheckpointWriter>(
      checkpoint::CheckpointStore(config_.checkpoint_path(), config_.checkpoint_keep), world_, config_.checkpoint_async,
      checkpoint::kBlockBytes, config_.checkpoint_local);
  // The random streams (dropout, the random second expert) start from the seed, whatever
  // ran before in this process; a resume in the same layout then restores them.
  parts().random.reseed(config_.seed, 0);
  // LoRA trains adapters on the base init_from holds: loaded first, then the adapters resume.
  if (config_.lora.enabled() && !config_.init_from.empty()) init_from_checkpoint();
  if (config_.resume) resume();
  if (!resumed_ && !config_.init_from.empty() && !config_.lora.enabled()) init_from_checkpoint();
  progress_ = std::make_unique<Progress>(world_, config_.out, resumed_, device_);
  log_resume_events();
  // A finished run trains nothing (run() says so): its metrics gain no "resumed" line.
  const int64_t redone = resumed_ && step_ < config_.steps ? progress_->resumed(step_, resumed_from_) : 0;
  progress_->restarted(step_, redone, world_->size(), relaunch);

  const bool bf16 = config_.bfloat16() || config_.parallel.param_dtype == at::kBFloat16;
  // MFU is against the peak of the dtype the matmuls run in.
  peak_flops_ =
      comm::agree_values(*world_, {measure_matmul_peak(device_, bf16 ? at::kBFloat16 : at::kFloat)}, comm::ReduceOp::kAvg)[0];
}

Trainer::~Trainer() {
  try {
    if (writer_) writer_->wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshtrain: rank %d: the last checkpoint was not saved: %s\n", world_->rank(), e.what());
  }
  memory::set_limit(previous_limit_);
}

double Trainer::mfu(double tokens_per_second) const {
  return config_.model.flops_per_token() * tokens_per_second / (peak_flops_ * world_->size());
}

std::map<std::string, at::Tensor> Trainer::full_parameters(int root) { return parallel::full_parameters(parts(), root); }

std::string Trainer::model_fingerprint() const { return model::fingerprint(config_.model); }

StepResult Trainer::step() {
  const auto start = Clock::now();
  comm::WatchdogContext context("step " + std::to_string(step_ + 1));
  memory::reset_peaks();
  memory::reset_device_peak(device_);
  StepResult result;
  result.lr = learning_rate(config_, step_);

  engine_->zero_grad();
  const std::vector<model::Batch> batches = micro_batches(*train_sampler_, cursor_, config_.grad_accum);
  std::optional<annotate::ReportScope> report;
  if (!config_.sharding_report.empty() && !reported_) report.emplace();
  const double loss_sum = engine_->forward_backward(batches);
  if (parts().pipeline && config_.trace_step == step_ + 1) write_trace();
  cursor_ += config_.batch;
  result.loss = engine_->mean_loss(loss_sum);
  {
    memory::PhaseScope phase(memory::Phase::kOptimizer);
    result.grad_norm = engine_->clip_grad_norm(config_.grad_clip);
    result.skipped = !std::isfinite(result.loss) || !std::isfinite(result.grad_norm);
    if (result.skipped) {
      stop_or_skip_nonfinite(result);
    } else {
      engine_->step(result.lr);
      nonfinite_in_a_row_ = 0;
    }
  }
  if (report) write_sharding_report(report->report());
  result.moe = engine_->moe_metrics();
  result.step = ++step_;
  result.memory.model_states = memory::current_bytes();
  for (int p = 0; p < memory::kPhaseCount; ++p) result.memory.phase_peak[p] = memory::phase_peak_bytes(memory::Phase(p));
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return result;
}

// Note [Non-finite steps]
// The loss and the gradient norm are agreed by every rank (all-reduced), so
// every rank sees the same non-finite step. It is never applied: the
// optimizer does not step, so the parameters, the optimizer states and every
// checkpoint written later hold the last finite state (save_checkpoint also
// refuses non-finite parameters, whatever made them). With on_nonfinite =
// "stop" the run ends there, checkpoints in flight written first; with
// "skip" the step's data is consumed, its gradients dropped, and the run
// goes on, stopping after max_nonfinite_skips such steps in a row.
void Trainer::stop_or_skip_nonfinite(const StepResult& result) {
  ++nonfinite_in_a_row_;
  char what[160];
  std::snprintf(what, sizeof what, "step %lld: the loss is %g and the gradient norm %g", (long long)(step_ + 1),
                result.loss, result.grad_norm);
  const bool skip = config_.on_nonfinite == OnNonfinite::kSkip && nonfinite_in_a_row_ <= config_.max_nonfinite_skips;
  if (skip) {
    progress_->warn(std::string(what) + "; not applied, the step is passed over (training.on_nonfinite = \"skip\", " +
                    std::to_string(nonfinite_in_a_row_) + " of at most " + std::to_string(config_.max_nonfinite_skips) +
                    " in a row)");
    return;
  }
  finish_checkpoints();
  const std::string last = step_ > 0 ? "the parameters of step " + std::to_string(step_) : "the initial parameters";
  throw comm::AgreedError(
      std::string(what) + (nonfinite_in_a_row_ > 1 ? " (" + std::to_string(nonfinite_in_a_row_) + " such steps in a row)" : "") +
      "; it was not applied, so " + last + " and the checkpoints in " + writer_->store().dir() +
      " are finite. Lower training.lr, raise training.warmup or training.grad_clip" +
      (config_.on_nonfinite == OnNonfinite::kSkip
           ? ", or raise training.max_nonfinite_skips (" + std::to_string(config_.max_nonfinite_skips) + ")"
           : ", or set training.on_nonfinite = \"skip\" to pass over such steps (training.max_nonfinite_skips in a row)"));
}

double Trainer::evaluate() {
  return engine_->mean_loss(engine_->evaluate(micro_batches(*val_sampler_, 0, config_.eval_batches)));
}

void Trainer::write_sharding_report(const annotate::ShardingReport& report) {
  reported_ = true;
  if (world_->rank() != 0) return;
  util::write_text_file(config_.sharding_report, report.jsonl());
  progress_->say("sharding report of step " + std::to_string(step_ + 1) + " (rank 0) in " + config_.sharding_report +
                 ":\n" + report.summary());
}

void Trainer::write_trace() {
  const auto ranks = parallel::pipeline::gather_spans(*world_, parts().pipeline->executor().spans(), 0);
  if (world_->rank() != 0) return;
  util::make_directories(config_.out);
  const std::string trace = config_.out + "/trace.json", picture = config_.out + "/timeline.svg";
  util::write_text_file(trace, parallel::pipeline::chrome_trace(ranks));
  char title[256];
  std::snprintf(title, sizeof title, "step %lld: %s, pp=%lld, v=%lld, %lld micro-batches, %d ranks",
                (long long)config_.trace_step, mesh::schedule_name(config_.parallel.dims.schedule).c_str(), (long long)config_.parallel.dims.pp,
                (long long)config_.parallel.dims.virtual_stages, (long long)config_.grad_accum, world_->size());
  util::write_text_file(picture, parallel::pipeline::timeline_svg(ranks, title));
  std::printf("meshtrain: pipeline trace of step %lld in %s (open in ui.perfetto.dev), picture in %s\n",
              (long long)config_.trace_step, trace.c_str(), picture.c_str());
  std::fflush(stdout);
}

// Note [Preemption]
// Schedulers preempt a job by signalling it (Slurm: SIGTERM, or the signal
// --signal names, some seconds before SIGKILL). The train command turns
// SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 into a stop request (apps/
// train_commands.cpp; `meshtrain run` passes Ctrl-C and SIGTERM on to the
// ranks as SIGUSR2, Note [Stopping ranks under mpirun]). The ranks agree on
// it after every step (one small all-reduce): a signal that reached any
// rank stops them all at the same step boundary. The step in progress
// finishes, a checkpoint of it is written synchronously (any background save
// finished first), a "preempted" line goes to metrics.jsonl, and the run
// returns normally, so the process exits 0. Resuming with the same command
// continues bit-exactly in the same layout (Note [Resume]).
// The scheduler's SIGKILL follows after checkpoint.preempt_grace_s. A save
// it would cut off is work lost and, worse, the time the job had to exit
// cleanly: so when the last save's time (the slowest rank's) exceeds what is
// left of the grace, counting the whole step just run as spent, and an
// earlier checkpoint exists, none is begun and the run resumes from that one.
// The same all-reduce tells whether a background save has ended on every
// rank: its error (a full disk, say) is then raised at this step, not at the
// next save (Note [Failed saves] in checkpoint/writer.cpp).
std::string launcher_stop_signal() {
  const char* file = std::getenv("MESHTRAIN_STOP_SIGNAL_FILE");
  if (!file) return {};
  std::ifstream in(file);
  std::string name;
  return in >> name && name.rfind("SIG", 0) == 0 ? name : std::string();
}

namespace {

// The signal that was sent: SIGUSR2 from `meshtrain run` stands for the one the
// launcher received, which it wrote down (Note [Naming the stop signal]).
std::string stop_signal_name(int signal) {
  if (signal == SIGUSR2) {
    if (std::string name = launcher_stop_signal(); !name.empty()) return name;
  }
  return signal == SIGTERM   ? "SIGTERM"
         : signal == SIGINT  ? "SIGINT"
         : signal == SIGUSR1 ? "SIGUSR1"
         : signal == SIGUSR2 ? "SIGUSR2"
                             : "signal " + std::to_string(signal);
}

}  // namespace

int Trainer::agreed_stop(const std::atomic<int>* stop) {
  const double running = writer_->in_flight() && !writer_->finished() ? 1.0 : 0.0;
  const std::vector<double> agreed = comm::agree_values(
      *world_, {stop ? double(stop->load()) : 0.0, running, writer_->in_flight() ? 1.0 : 0.0}, comm::ReduceOp::kMax);
  if (agreed[1] == 0 && agreed[2] > 0) finish_checkpoints();  // every rank: ended
  return static_cast<int>(agreed[0]);
}

void Trainer::preempt(int signal, double step_seconds) {
  const auto start = Clock::now();
  finish_checkpoints();  // a background save in flight is a checkpoint too
  // What a synchronous save takes here (the last one's time), and what is left
  // of the grace, counting the step just run as spent (the signal came during
  // it, at worst at its start): the slowest rank's and the least, agreed, so
  // that every rank takes the same decision.
  const double own_left = config_.checkpoint_preempt_grace_s - step_seconds -
                          std::chrono::duration<double>(Clock::now() - start).count();
  const std::vector<double> agreed =
      comm::agree_values(*world_, {writer_->last_save_seconds(), -own_left}, comm::ReduceOp::kMax);
  const double save_seconds = agreed[0], left = -agreed[1];
  const bool saved_already = saved_step_ == step_;
  const bool save = !saved_already && !(saved_step_ >= 0 && save_seconds > left);
  if (save) {
    save_checkpoint();
    finish_checkpoints();
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const std::string what = stop_signal_name(signal);
  progress_->event(nlohmann::json{{"event", "preempted"}, {"signal", what}, {"step", step_}, {"saved", save},
                                  {"resume_step", saved_step_}, {"save_seconds", seconds}}.dump());
  char line[512];
  const char* dir = writer_->store().dir().c_str();
  if (save || saved_already) {
    std::snprintf(line, sizeof line, "%s: stopped after step %lld of %lld, checkpoint written in %.1f s to %s; the same "
                  "command resumes from it", what.c_str(), (long long)step_, (long long)config_.steps, seconds, dir);
  } else {
    std::snprintf(line, sizeof line, "%s: stopped after step %lld of %lld; a checkpoint takes about %.1f s here and %.1f s "
                  "were left of checkpoint.preempt_grace_s = %g, so none was begun: the same command resumes from step "
                  "%lld in %s", what.c_str(), (long long)step_, (long long)config_.steps, save_seconds, std::max(0.0, left),
                  config_.checkpoint_preempt_grace_s, (long long)saved_step_, dir);
  }
  progress_->say(line);
  if (save && seconds > left) {
    std::snprintf(line, sizeof line, "the checkpoint took %.1f s, more than the %.1f s left of "
                  "checkpoint.preempt_grace_s = %g: a scheduler may have cut it off", seconds, std::max(0.0, left),
                  config_.checkpoint_preempt_grace_s);
    progress_->warn(line);
  }
}

bool Trainer::run(const std::atomic<int>* stop) {
  const int64_t tokens_per_step = config_.batch * config_.model.context;
  char line[1024];
  const comm::Placement& placement = comm::job_placement();
  const std::string ranks = static_cast<int>(placement.host_of_rank.size()) == world_->size()
                                ? placement.summary()
                                : std::to_string(world_->size()) + " rank(s)";
  // Threads per rank, and the Slurm job when srun started the ranks (docs/clusters.md#slurm).
  const int threads = at::get_num_threads();
  const char* slurm_job = std::getenv("SLURM_JOB_ID");
  const char* slurm_step = std::getenv("SLURM_STEP_ID");
  const std::string started = std::to_string(threads) + (threads == 1 ? " thread" : " threads") + " each" +
                              (slurm_job && slurm_step ? std::string(", Slurm job ") + slurm_job + " step " + slurm_step
                                                       : std::string());
  // "training tiny (gpt2: layers=2 ...)", "training runs/a/checkpoints (llama: ...)": what is trained and its family.
  const std::string what = config_.init_from.empty() ? config_.preset : config_.init_from;
  const std::string family = config_.model.family().empty() ? "a mix of GPT-2 and Llama" : config_.model.family();
  std::string shape = model_fingerprint();
  if (shape.rfind("gpt ", 0) == 0) shape.erase(0, 4);
  std::snprintf(line, sizeof line, "training %s (%s: %s, %.2fM parameters) on %s, %s, ", what.c_str(), family.c_str(),
                shape.c_str(), config_.model.parameter_count() / 1e6, ranks.c_str(), started.c_str());
  progress_->say(line + parts().describe());
  if (config_.lora.enabled()) {
    const int64_t adapters = config_.lora.parameter_count(config_.model);
    std::string targets;
    for (const std::string& t : config_.lora.targets) targets += (targets.empty() ? "" : ",") + t;
    std::snprintf(line, sizeof line, "LoRA: %.3fM trainable parameters (%.2f%% of the model, which is frozen), rank %lld, "
                  "alpha %g, on %s", adapters / 1e6, 100.0 * adapters / config_.model.parameter_count(),
                  (long long)config_.lora.rank, config_.lora.alpha, targets.c_str());
    progress_->say(line);
  }
  if (config_.memory_limit_mb > 0) {
    progress_->say("per-rank memory limit " + std::to_string(config_.memory_limit_mb) + " MiB (counted CPU tensors)");
  }
  std::snprintf(line, sizeof line,
                "%lld steps x %lld sequences x %lld tokens = %lld tokens per step (micro-batch %lld, accumulation "
                "%lld); data %s",
                (long long)config_.steps, (long long)config_.batch, (long long)config_.model.context,
                (long long)tokens_per_step, (long long)config_.micro_batch, (long long)config_.grad_accum,
                data_summary_.c_str());
  progress_->say(line);
  progress_->say("metrics to " + config_.out + "/metrics.jsonl, checkpoints to " + writer_->store().dir() +
                 (config_.checkpoint_every > 0 ? " every " + std::to_string(config_.checkpoint_every) + " steps" : "") +
                 (config_.checkpoint_async ? " (written in the background)" : ""));
  if (resumed_ && step_ >= config_.steps) {
    // A finished run says so and leaves its checkpoint and metrics as they are.
    progress_->say("the run is already complete: " + resumed_from_ + " is at step " + std::to_string(step_) + " of " +
                   std::to_string(config_.steps) + "; nothing to train (raise training.steps to continue, or "
                   "--checkpoint.resume=false to start afresh in another run.out)");
    finish_checkpoints();
    return false;
  }
  if (resumed_) progress_->say("resumed from " + resumed_from_ + " at step " + std::to_string(step_));
  if (!initialized_from_.empty()) progress_->say("fine-tuning from the weights of " + initialized_from_);

  const auto run_start = Clock::now();
  const int64_t first_step = step_;
  while (step_ < config_.steps) {
    const StepResult result = step();
    const double tokens_per_second = tokens_per_step / result.seconds;
    std::optional<double> val_loss;
    const bool last = step_ == config_.steps;
    if (last || (config_.eval_every > 0 && step_ % config_.eval_every == 0)) val_loss = evaluate();
    if (last || step_ % config_.log_every == 0) {
      const double elapsed = std::chrono::duration<double>(Clock::now() - run_start).count();
      const double eta = elapsed / (step_ - first_step) * (config_.steps - step_);
      progress_->step(result, val_loss, tokens_per_second, mfu(tokens_per_second), config_.steps, eta, true);
    }
    if (!last && config_.checkpoint_every > 0 && step_ % config_.checkpoint_every == 0) save_checkpoint();
    if (const int signal = agreed_stop(stop); signal != 0 && !last) {
      preempt(signal, result.seconds);
      return true;
    }
  }
  save_checkpoint();
  finish_checkpoints();
  if (config_.sample_tokens <= 0) return false;
  // The parameters gathered into a plain fp32 model on rank 0.
  const std::map<std::string, at::Tensor> full = full_parameters(0);
  if (world_->rank() != 0) return false;
  model::Gpt sampler(config_.model, config_.seed);
  {
    torch::NoGradGuard no_grad;
    for (auto& item : sampler->named_parameters()) item.value().copy_(full.at(item.key()));
  }
  if (config_.lora.enabled()) model::merge_lora(sampler, config_.lora, full);  // the adapters merged in (Note [LoRA])
  const std::string prompt = "The ";
  model::SampleOptions options;
  options.tokens = config_.sample_tokens;
  options.seed = config_.seed;
  options.sampleable = at::zeros({config_.model.vocab_size}, at::kBool);  // never an id the tokenizer cannot decode
  for (int64_t id = 0; id < config_.model.vocab_size; ++id) options.sampleable.data_ptr<bool>()[id] = tokenizer_->can_decode(id);
  const at::Tensor prompt_tokens = at::tensor(tokenizer_->encode(prompt), at::kLong);
  const at::Tensor made = model::generate(sampler, prompt_tokens, options);
  std::string text = tokenizer_->decode(std::vector<int64_t>(made.data_ptr<int64_t>(), made.data_ptr<int64_t>() + made.numel()));
  text.resize(text.size() - model::incomplete_utf8_tail(text));  // the sample ended inside a character
  std::printf("\nmeshtrain: sample after %lld steps (temperature %.1f, top-k %lld):\n%s%s\n", (long long)step_,
              options.temperature, (long long)options.top_k, prompt.c_str(), text.c_str());
  std::fflush(stdout);
  return false;
}

}  // namespace meshtrain::train
