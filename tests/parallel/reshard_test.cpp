// Checkpoints across layouts under mpirun: train in one layout, save, resume
// in another (other rank counts, ZeRO stages, tensor and pipeline splits) and
// continue exactly as one process does; bit-exact resume in the same layout
// with dropout and tensor parallel; an asynchronous save that fails; a
// corrupt latest checkpoint passed over for the previous one.
#include "meshtrain/checkpoint/store.h"
#include "meshtrain/comm/agree.h"
#include "tests/parallel/training_fixture.h"

#include <cstdlib>
#include <fstream>

namespace meshtrain::train {
namespace {

std::string describe_on(int ranks, const Overrides& layout) {
  return std::to_string(ranks) + " rank(s)" + (layout.empty() ? "" : " " + describe(layout));
}

class ReshardTest : public TrainingTest {
 protected:
  // Ranks [0, k) of the world; null on the others. Collective over the world.
  std::shared_ptr<comm::Communicator> first(int k) const {
    return world()->split(world()->rank() < k ? 0 : -1, world()->rank(), "test:first" + std::to_string(k));
  }

  // One process training `steps` steps straight: the oracle's losses.
  std::vector<double> reference(int steps) const { return one_process(config(1, kBatch), steps).losses(); }

  // Layout A trains `a_steps` on `a_ranks` and saves; layout B resumes on
  // `b_ranks` and trains `b_steps` more. Every loss equals the reference's
  // (1e-5 relative).
  void expect_reshard(int a_ranks, int64_t a_micro, const Overrides& a, int b_ranks, int64_t b_micro, const Overrides& b,
                      int a_steps = 3, int b_steps = 3) {
    const std::vector<double> want = reference(a_steps + b_steps);
    const std::string checkpoints = util::join_path(dir_, "reshard-" + std::to_string(++case_));
    const std::string what = describe_on(a_ranks, a) + " -> " + describe_on(b_ranks, b);
    if (auto comm = first(a_ranks)) {
      Trainer trainer(config(a_ranks, a_micro, checkpoints, a), comm);
      ASSERT_FALSE(trainer.resumed());
      for (int s = 0; s < a_steps; ++s) {
        EXPECT_NEAR(trainer.step().loss, want[s], 1e-5 * want[s]) << what << ": before the save, step " << s + 1;
      }
      trainer.save_checkpoint();
      trainer.finish_checkpoints();
    }
    world()->barrier().wait();
    if (auto comm = first(b_ranks)) {
      Trainer trainer(config(b_ranks, b_micro, checkpoints, b), comm);
      ASSERT_TRUE(trainer.resumed()) << what;
      EXPECT_EQ(trainer.completed_steps(), a_steps);
      for (int s = a_steps; s < a_steps + b_steps; ++s) {
        EXPECT_NEAR(trainer.step().loss, want[s], 1e-5 * want[s]) << what << ": after the resume, step " << s + 1;
      }
    }
    world()->barrier().wait();
  }

  int case_ = 0;
};

TEST_F(ReshardTest, DataParallelOnTwoToZero3OnThree) {
  if (world()->size() != 3) GTEST_SKIP() << "runs at 3 ranks";
  expect_reshard(2, 12, {}, 3, 8, {"parallel.zero_stage=3"});
  // And back, with the uneven shards saved.
  expect_reshard(3, 4, {"parallel.zero_stage=2"}, 1, 24, {});
}

TEST_F(ReshardTest, FourRankLayoutsToOthers) {
  if (world()->size() != 4) GTEST_SKIP() << "runs at 4 ranks";
  layers_ = 8;
  expect_reshard(4, 6, {"parallel.zero_stage=3"}, 2, 12, {});
  expect_reshard(4, 12, {"parallel.zero_stage=3", "parallel.tp=2", "parallel.sequence_parallel=true"}, 4, 24,
                 {"parallel.tp=4"});
  expect_reshard(2, 1, {"parallel.pp=2", "parallel.microbatches=4", "parallel.pp_schedule=1f1b"}, 4, 1,
                 {"parallel.pp=4", "parallel.pp_schedule=interleaved", "parallel.virtual_stages=2",
                  "parallel.microbatches=4"});
  expect_reshard(4, 1, {"parallel.pp=2", "parallel.tp=2", "parallel.microbatches=4"}, 1, 24, {});
}

TEST_F(ReshardTest, EightRanksPipelineDataTensorToTwo) {
  if (world()->size() != 8) GTEST_SKIP() << "runs at 8 ranks";
  expect_reshard(8, 1, {"parallel.pp=2", "parallel.dp=2", "parallel.tp=2", "parallel.microbatches=6"}, 2, 12, {},
                 2, 2);
}

// Dropout on, tensor parallel with its per-rank random streams, ZeRO shards:
// the resumed run draws the same masks and computes the same bits.
TEST_F(ReshardTest, SameLayoutResumeIsBitExactWithDropoutAndTensorParallel) {
  const int n = world()->size();
  if (n % 2 != 0) GTEST_SKIP() << "tp = 2 needs an even world";
  const Overrides layout = {"parallel.tp=2", "model.dropout=0.1", "parallel.zero_stage=1"};
  const int64_t micro = kBatch / (n / 2);
  std::vector<double> straight;
  {
    Trainer trainer(config(n, micro, "", layout), world());
    for (int s = 0; s < 6; ++s) straight.push_back(trainer.step().loss);
  }
  const std::string checkpoints = util::join_path(dir_, "tp-dropout");
  {
    Trainer trainer(config(n, micro, checkpoints, layout), world());
    for (int s = 0; s < 3; ++s) EXPECT_EQ(trainer.step().loss, straight[s]);
    trainer.save_checkpoint();
    // The next step runs while the save is written: it must not change what is saved.
    EXPECT_EQ(trainer.step().loss, straight[3]);
    trainer.finish_checkpoints();
  }
  Trainer resumed(config(n, micro, checkpoints, layout), world());
  ASSERT_TRUE(resumed.resumed());
  ASSERT_EQ(resumed.completed_steps(), 3);
  for (int s = 3; s < 6; ++s) EXPECT_EQ(resumed.step().loss, straight[s]) << "step " << s + 1;
}

TEST_F(ReshardTest, FailedAsynchronousSaveKeepsThePreviousCheckpoint) {
  const int n = world()->size();
  const std::string checkpoints = util::join_path(dir_, "failing");
  Trainer trainer(config(n, kBatch / n, checkpoints, {"parallel.zero_stage=2"}), world());
  trainer.step();
  trainer.save_checkpoint();
  trainer.finish_checkpoints();
  const std::string before = checkpoint::CheckpointStore(checkpoints, 2).latest();
  trainer.step();
  // The last rank fails right after writing its file; every rank learns it.
  setenv("MESHTRAIN_TEST_CHECKPOINT_FAIL_AFTER", checkpoint::rank_file_name(n - 1).c_str(), 1);
  trainer.save_checkpoint();  // returns at once: the write runs in the background
  trainer.step();
  std::string error;
  try {
    trainer.finish_checkpoints();
  } catch (const comm::AgreedError& e) {
    error = e.what();
  }
  unsetenv("MESHTRAIN_TEST_CHECKPOINT_FAIL_AFTER");
  EXPECT_NE(error.find("injected failure after writing " + checkpoint::rank_file_name(n - 1)), std::string::npos) << error;
  EXPECT_EQ(checkpoint::CheckpointStore(checkpoints, 2).latest(), before);
  // The next save works and cleans up.
  trainer.save_checkpoint();
  trainer.finish_checkpoints();
  EXPECT_EQ(util::base_name(checkpoint::CheckpointStore(checkpoints, 2).latest()), "step-00000003");
  EXPECT_FALSE(util::path_exists(util::join_path(checkpoints, ".incomplete-step-00000002")));
}

TEST_F(ReshardTest, CorruptLatestIsPassedOverForThePreviousWithAWarning) {
  const int n = world()->size();
  const std::string checkpoints = util::join_path(dir_, "corrupt");
  std::vector<double> straight;
  {
    Trainer trainer(config(n, kBatch / n, "", {"parallel.zero_stage=3"}), world());
    for (int s = 0; s < 4; ++s) straight.push_back(trainer.step().loss);
  }
  {
    Trainer trainer(config(n, kBatch / n, checkpoints, {"parallel.zero_stage=3"}), world());
    for (int s = 0; s < 4; ++s) {
      trainer.step();
      if (s % 2 == 1) trainer.save_checkpoint();
    }
    trainer.finish_checkpoints();
  }
  const std::string damaged = util::join_path(util::join_path(checkpoints, "step-00000004"), checkpoint::rank_file_name(0));
  if (world()->rank() == 0) {
    std::fstream f(damaged, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4096);
    f.put('\x5a');
  }
  world()->barrier().wait();
  Trainer resumed(config(n, kBatch / n, checkpoints, {"parallel.zero_stage=3"}), world());
  ASSERT_TRUE(resumed.resumed());
  EXPECT_EQ(util::base_name(resumed.resumed_from()), "step-00000002");
  ASSERT_EQ(resumed.skipped_checkpoints().size(), 1u);
  EXPECT_NE(resumed.skipped_checkpoints()[0].reason.find("checkpoint file " + damaged + " is corrupt"), std::string::npos)
      << resumed.skipped_checkpoints()[0].reason;
  for (int s = 2; s < 4; ++s) EXPECT_NEAR(resumed.step().loss, straight[s], 1e-5 * straight[s]) << "step " << s + 1;
  if (world()->rank() == 0) {
    const std::string metrics = util::read_text_file(resumed.config().out + "/metrics.jsonl");
    EXPECT_NE(metrics.find("\"event\":\"checkpoint_skipped\""), std::string::npos) << metrics;
  }
  EXPECT_TRUE(util::is_regular_file(damaged));  // nothing saved was deleted
}

}  // namespace
}  // namespace meshtrain::train
