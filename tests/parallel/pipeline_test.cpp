// Pipeline parallel under mpirun: every schedule equals one process, 3-D
// meshes, the executor's stash against the schedule, checkpointing inside
// pipelines and with tensor parallel, traces, resume.
#include "meshtrain/parallel/pipeline/trace.h"
#include "tests/parallel/training_fixture.h"

#include <ATen/record_function.h>

#include <atomic>
#include <memory>
#include <string_view>

namespace meshtrain::train {
namespace {

class PipelineTraining : public TrainingTest {
 protected:
  void SetUp() override {
    TrainingTest::SetUp();
    layers_ = 8;
  }

  // Trains `layout` on all ranks and the same model in one process; compares.
  void expect_equal(const Overrides& layout) {
    const int n = world()->size();
    const TrainConfig split = config(n, 1, "", layout);
    // The oracle runs the same micro-batches one after another.
    Trainer parallel(split, world());
    expect_same_training(parallel, one_process_of(split.micro_batch, {}, 5), 5, describe(layout));
  }
};

// Each schedule for pp = 2 and 4 (interleaved with 2 virtual stages), alone
// and beside data parallel / ZeRO and tensor parallel where the ranks allow.
TEST_F(PipelineTraining, EverySchedulesEqualsOneProcess) {
  const int n = world()->size();
  std::vector<Overrides> layouts;
  for (int p : {2, 4}) {
    if (n % p != 0 || (n == 8 && p == 2)) continue;
    const std::string pp = "parallel.pp=" + std::to_string(p);
    layouts.push_back({pp, "parallel.pp_schedule=gpipe", "parallel.microbatches=4"});
    layouts.push_back({pp, "parallel.pp_schedule=1f1b", "parallel.microbatches=4"});
    layouts.push_back({pp, "parallel.pp_schedule=interleaved", "parallel.virtual_stages=2", "parallel.microbatches=4"});
  }
  if (n == 2) layouts.push_back({"parallel.pp=2", "parallel.pp_split=6,2", "parallel.activation_checkpoint=full",
                                 "parallel.microbatches=3"});
  if (n == 3) {
    layouts.push_back({"parallel.pp=3", "parallel.pp_schedule=1f1b", "parallel.microbatches=6"});
    layouts.push_back({"parallel.pp=3", "parallel.pp_schedule=interleaved", "parallel.virtual_stages=2",
                       "parallel.microbatches=6", "parallel.activation_checkpoint=selective"});
  }
  if (n == 4) {
    layouts.push_back({"parallel.pp=2", "parallel.microbatches=3"});  // x dp 2 (plain data parallel)
    layouts.push_back({"parallel.pp=2", "parallel.zero_stage=1", "parallel.microbatches=4"});
    layouts.push_back({"parallel.pp=2", "parallel.zero_stage=2", "parallel.pp_schedule=interleaved",
                       "parallel.virtual_stages=2", "parallel.microbatches=4"});
    layouts.push_back({"parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.microbatches=4"});
  }
  for (const Overrides& layout : layouts) expect_equal(layout);
}

// Calls of the loss's into-.grad path (meshtrain::head_gradient_into_grad) while counted.
std::atomic<int> into_grad_calls{0};

std::unique_ptr<at::ObserverContext> count_into_grad(const at::RecordFunction& fn) {
  if (std::string_view(fn.name()) == "meshtrain::head_gradient_into_grad") ++into_grad_calls;
  return nullptr;
}

// Note [Head's gradient into .grad]: the last stage of 1F1B, which holds one
// loss at a time, adds the head's gradient into .grad in each loss's forward;
// GPipe's, holding four, makes it in the backward. The first stage has no loss.
TEST_F(PipelineTraining, OneLossInFlightAddsTheHeadsGradientInItsForward) {
  if (world()->size() != 2) GTEST_SKIP() << "needs 2 ranks";
  for (const std::string schedule : {"1f1b", "gpipe"}) {
    Trainer trainer(config(2, 1, "", {"parallel.pp=2", "parallel.pp_schedule=" + schedule, "parallel.microbatches=4"}),
                    world());
    into_grad_calls = 0;
    const at::CallbackHandle counting = at::addGlobalCallback(at::RecordFunctionCallback(count_into_grad));
    trainer.step();
    at::removeCallback(counting);
    const int want = schedule == "1f1b" && world()->rank() == 1 ? 4 : 0;
    EXPECT_EQ(into_grad_calls.load(), want) << schedule << ", rank " << world()->rank();
  }
}

// 3-D: pp 2 x dp 2 x tp 2, and pp 2 x ZeRO-1 over 2 x tp 2 with sequence parallel.
TEST_F(PipelineTraining, ThreeDimensionalMeshEqualsOneProcess) {
  if (world()->size() != 8) GTEST_SKIP() << "needs 8 ranks";
  expect_equal({"parallel.pp=2", "parallel.dp=2", "parallel.tp=2", "parallel.microbatches=3"});
  expect_equal({"parallel.pp=2", "parallel.zero_stage=1", "parallel.tp=2", "parallel.sequence_parallel=true",
                "parallel.pp_schedule=interleaved", "parallel.virtual_stages=2", "parallel.microbatches=6",
                "parallel.activation_checkpoint=full"});
}

// GPipe keeps every micro-batch's activations until the backwards start; 1F1B
// at most p (rank r: p - r). Checked on the executor's stash and on the
// counted memory of the same steps.
TEST_F(PipelineTraining, StashedMicrobatchesFollowTheSchedule) {
  const int n = world()->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "pp = world: 2 or 4 ranks";
  const int m = 8;
  std::map<std::string, std::pair<int, double>> seen;  // schedule -> (stash, activation bytes above model states)
  for (const std::string schedule : {"gpipe", "1f1b"}) {
    Trainer trainer(config(n, 1, "", {"parallel.pp=" + std::to_string(n), "parallel.pp_schedule=" + schedule,
                                      "parallel.microbatches=" + std::to_string(m), "model.dropout=0"}),
                    world());
    trainer.step();
    const StepResult r = trainer.step();
    const int stash = trainer.parts().pipeline->executor().peak_stashed();
    const int rank = world()->rank();
    if (schedule == "gpipe") EXPECT_EQ(stash, m) << "rank " << rank;
    else EXPECT_EQ(stash, n - rank) << "rank " << rank;
    const double activations = double(std::max(r.memory.phase_peak[int(memory::Phase::kForward)],
                                                r.memory.phase_peak[int(memory::Phase::kBackward)]) -
                                      r.memory.model_states);
    seen[schedule] = {stash, activations};
  }
  // Memory follows the stash: gpipe / 1f1b ~ m / (n - rank), within 35% (one
  // micro-batch's transient gradients and buffers ride on both).
  const double want = double(seen["gpipe"].first) / seen["1f1b"].first;
  const double got = seen["gpipe"].second / seen["1f1b"].second;
  EXPECT_NEAR(got, want, 0.35 * want) << "rank " << world()->rank() << ": gpipe " << seen["gpipe"].second
                                      << " bytes, 1f1b " << seen["1f1b"].second;
  if (world()->rank() == 0) {
    std::printf("[ pipeline memory ] rank 0: gpipe %.2f MiB (%d stashed), 1f1b %.2f MiB (%d stashed)\n",
                seen["gpipe"].second / 1048576.0, seen["gpipe"].first, seen["1f1b"].second / 1048576.0,
                seen["1f1b"].first);
  }
}

// Recomputation replays the random streams, tensor parallel's included: with
// dropout on, checkpointed training is the same training.
TEST_F(PipelineTraining, CheckpointingWithDropoutAndTensorParallelChangesNothing) {
  const int n = world()->size();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even world";
  layers_ = 2;
  const Overrides base = {"parallel.tp=2", "parallel.sequence_parallel=true", "model.dropout=0.1"};
  for (const std::string mode : {"full", "selective"}) {
    Overrides with = base;
    with.push_back("parallel.activation_checkpoint=" + mode);
    Trainer plain(config(n, kBatch / (n / 2), "", base), world());
    Trainer checkpointed(config(n, kBatch / (n / 2), "", with), world());
    for (int s = 0; s < 3; ++s) {
      const StepResult a = plain.step(), b = checkpointed.step();
      EXPECT_NEAR(a.loss, b.loss, 1e-6 * a.loss) << mode << " step " << s + 1;
      EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-5 * a.grad_norm) << mode << " step " << s + 1;
    }
  }
}

TEST_F(PipelineTraining, TraceHasEverySpanAndResumeIsBitExact) {
  const int n = world()->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "pp 2 (x dp 2): 2 or 4 ranks";
  const Overrides layout = {"parallel.pp=2", "parallel.microbatches=4", "run.trace_step=2"};
  const std::string checkpoints = util::join_path(dir_, "pp-checkpoints");
  std::vector<double> straight;
  {
    Trainer trainer(config(n, 1, "", layout), world());
    for (int s = 0; s < 4; ++s) straight.push_back(trainer.step().loss);
  }
  if (world()->rank() == 0) {
    const std::string out = config(n, 1, "", layout).out;
    const auto ranks = parallel::pipeline::read_chrome_trace(util::read_text_file(out + "/trace.json"));
    ASSERT_EQ(static_cast<int>(ranks.size()), n);
    for (const auto& spans : ranks) {
      int forwards = 0, backwards = 0;
      for (const auto& s : spans) {
        forwards += s.kind == parallel::pipeline::SpanKind::kForward;
        backwards += s.kind == parallel::pipeline::SpanKind::kBackward;
      }
      EXPECT_EQ(forwards, 4);
      EXPECT_EQ(backwards, 4);
    }
    EXPECT_TRUE(util::is_regular_file(out + "/timeline.svg"));
  }
  {
    Trainer first(config(n, 1, checkpoints, layout), world());
    for (int s = 0; s < 2; ++s) EXPECT_EQ(first.step().loss, straight[s]);
    first.save_checkpoint();
  }
  Trainer second(config(n, 1, checkpoints, layout), world());
  ASSERT_TRUE(second.resumed());
  for (int s = 2; s < 4; ++s) EXPECT_EQ(second.step().loss, straight[s]) << "step " << s + 1;
  // Another pipeline split resumes from it too and continues the same training.
  Trainer other(config(n, 1, checkpoints, {"parallel.pp=2", "parallel.pp_split=3,5", "parallel.microbatches=4"}), world());
  ASSERT_TRUE(other.resumed());
  for (int s = 2; s < 4; ++s) EXPECT_NEAR(other.step().loss, straight[s], 1e-5 * straight[s]) << "step " << s + 1;
}

}  // namespace
}  // namespace meshtrain::train
