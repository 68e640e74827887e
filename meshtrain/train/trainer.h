// Trainer: the training loop of one run — data, the model made parallel by
// parallelize(), AdamW with warmup and cosine decay, accumulation, clipping,
// validation, metrics and progress (progress.h), checkpoints
// (trainer_checkpoint.cpp). Nothing here applies a parallelism.
#pragma once

#include <atomic>

#include "meshtrain/checkpoint/writer.h"
#include "meshtrain/comm/communicator.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/parallel/step_engine.h"
#include "meshtrain/text/tokenizer.h"
#include "meshtrain/train/matmul_peak.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/data.h"
#include "meshtrain/train/progress.h"
#include "meshtrain/util/memory.h"

#include <map>
#include <memory>
#include <optional>
#include <string>

namespace meshtrain::annotate {
struct ShardingReport;
}

namespace meshtrain::train {

using checkpoint::CheckpointError;

// Linear warmup to `lr` over `warmup` steps, then cosine decay to `min_lr` at `steps`.
double learning_rate(const TrainConfig& config, int64_t step);

// The parallelize() options a config asks for, on `device` (its torch_device for this rank).
parallel::ParallelizeOptions parallelize_options(const TrainConfig& config, at::Device device);

// The stop `meshtrain run` received and wrote down for its ranks ("SIGTERM",
// "SIGINT"), or "" when there was none (Note [Naming the stop signal]).
std::string launcher_stop_signal();

class Trainer {
 public:
  // `config` must be validated for world->size() ranks. Collective over
  // `world`: prepares data (rank 0), builds the model from the seed,
  // parallelize()s it, and resumes from the latest usable checkpoint when
  // config.resume and one exists (Note [Resume]). Installs the counting
  // allocator and, with memory.limit_mb, the per-rank limit (until destruction).
  // `relaunch`: this is a relaunch by `meshtrain run --max-restarts` (Note [Restarts]).
  Trainer(TrainConfig config, std::shared_ptr<comm::Communicator> world, Relaunch relaunch = {});
  ~Trainer();

  // One optimizer step; a step whose loss or gradient norm is not finite is
  // not applied (StepResult::skipped), or stops the run with an AgreedError
  // (Note [Non-finite steps]). Collective.
  StepResult step();
  double evaluate();  // validation loss, averaged over ranks
  // Collective: saves checkpoint `completed_steps()` (in the background with
  // checkpoint.async; a failure surfaces at the next save or finish_checkpoints()).
  // Non-finite parameters or optimizer states are never saved: an AgreedError instead.
  void save_checkpoint();
  // Waits for a save in flight; throws its error. Collective.
  void finish_checkpoints();
  // Runs to config.steps with progress lines, metrics, validation and
  // periodic checkpoints; prints a generated sample at the end. Output only on rank 0.
  // `stop` (set from a signal handler, say) asks for a preemption: see
  // Note [Preemption]. Returns whether the run was preempted.
  bool run(const std::atomic<int>* stop = nullptr);

  int64_t completed_steps() const { return step_; }
  bool resumed() const { return resumed_; }
  // The checkpoint resumed from ("" when none), and what was skipped before it.
  const std::string& resumed_from() const { return resumed_from_; }
  struct Skipped {
    std::string folder, reason;
  };
  const std::vector<Skipped>& skipped_checkpoints() const { return skipped_; }
  // What parallelize() made of the model: the techniques applied and their pieces.
  parallel::Parallelized& parts() { return engine_->parts(); }
  const parallel::Parallelized& parts() const { return engine_->parts(); }
  // The model as the parallel layer left it: with zero_stage 3 its parameters
  // have no storage between steps; use full_parameters().
  model::Gpt& model() { return parts().model; }
  parallel::FullySharded* sharded() { return parts().sharded(); }
  const mesh::DeviceMesh& mesh() const { return *parts().mesh; }
  // Every parameter, unsharded, fp32, by name, on every rank (root -1) or at
  // least on world rank `root`. Collective.
  std::map<std::string, at::Tensor> full_parameters(int root = -1);
  const TrainConfig& config() const { return config_; }
  std::string model_fingerprint() const;
  // One rank's fp32 matmul rate (FLOP/s), measured at construction.
  double peak_flops_per_rank() const { return peak_flops_; }
  at::Device device() const { return device_; }
  // Model FLOPs utilisation at `tokens_per_second` over all ranks.
  double mfu(double tokens_per_second) const;
  const checkpoint::CheckpointWriter& checkpoint_writer() const { return *writer_; }

 private:
  void open_data();
  // This data rank's `count` micro-batches of `sampler`'s stream from
  // `start`, on this rank's device, each with its loss weight: 1 / count
  // when every target counts, else its counted targets' share of the global
  // batch's (Note [Packing]).
  std::vector<model::Batch> micro_batches(Sampler& sampler, int64_t start, int64_t count) const;
  // The prepared data of [data] (text or sources): the token files of each source.
  std::vector<std::string> prepare_sources();
  void resume();
  // checkpoint.init_from's parameters, when there was nothing to resume (Note [Fine-tuning start]).
  void init_from_checkpoint();
  // Loads `folder` into this layout; throws CheckpointError when it is unusable.
  void load_checkpoint(const std::string& folder);
  void log_resume_events();  // metrics lines for the checkpoints resume passed over
  void write_trace();
  void stop_or_skip_nonfinite(const StepResult& result);  // throws unless the step may be passed over
  // Collective: the stop asked on any rank (the largest signal number), or 0;
  // raises the error of a background save that has ended on every rank.
  int agreed_stop(const std::atomic<int>* stop);
  // Saves synchronously, unless that would outlast checkpoint.preempt_grace_s, and says so. Collective.
  void preempt(int signal, double step_seconds);
  // Collective: whether every rank's share of the training state is finite.
  bool state_is_finite();
  void write_sharding_report(const annotate::ShardingReport& report);

  TrainConfig config_;
  std::shared_ptr<comm::Communicator> world_;
  at::Device device_ = at::kCPU;  // config_.device for this rank
  std::unique_ptr<text::Tokenizer> tokenizer_;  // [data] tokenizer: prepares text, decodes samples, saved in checkpoints
  std::vector<std::unique_ptr<TokenDataset>> train_data_, val_data_;  // a source each
  std::string data_summary_;  // for the start-up lines: files, tokens, documents, what counts
  std::unique_ptr<Sampler> train_sampler_, val_sampler_;
  std::unique_ptr<parallel::StepEngine> engine_;
  std::unique_ptr<checkpoint::CheckpointWriter> writer_;
  std::unique_ptr<Progress> progress_;
  int64_t previous_limit_ = 0;
  int64_t step_ = 0;
  int64_t saved_step_ = -1;  // the step of the last checkpoint saved or resumed from (-1: none)
  int64_t nonfinite_in_a_row_ = 0;  // steps not applied in a row (Note [Non-finite steps])
  int64_t cursor_ = 0;
  bool resumed_ = false;
  bool reported_ = false;  // the sharding report is written (once, of the first step run)
  std::string resumed_from_;
  std::string initialized_from_;  // the checkpoint init_from loaded, or ""
  std::vector<Skipped> skipped_;  // unusable checkpoints passed over on resume, newest first
  double peak_flops_ = 0;
};

}  // namespace meshtrain::train
