// A training fixture shared by the parallel-layout tests: a small token file
// pair on disk, a tiny model config, and the one-process oracle.
#pragma once

#include "meshtrain/train/one_process.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/files.h"
#include "tests/harness/mpi_env.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

namespace meshtrain::train {

using testing::world;

constexpr int64_t kBatch = 24;  // divisible by 1, 2, 3, 4 and 8 ranks

// A layout as config overrides ("parallel.zero_stage=3", ...), and it in one line.
using Overrides = std::vector<std::string>;
inline std::string describe(const Overrides& overrides) {
  std::string text;
  for (const std::string& o : overrides) text += (text.empty() ? "" : " ") + o;
  return text;
}

// The one-process oracle (Note [One-process oracle], train/one_process.h), computed by rank 0 for every
// rank. A test whose layouts share one single-process config asks for its run once: before its loop over
// layouts, or through TrainingTest::one_process_of().
inline OneProcessRun one_process(const TrainConfig& config, int steps, bool evaluate = false) {
  OneProcessOptions options;
  options.steps = steps;
  options.evaluate = evaluate;
  return one_process(world(), config, options);
}

class TrainingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::shared_temp_directory("meshtrain-train-");
    if (world()->rank() == 0) {
      // Text-like tokens: a repeating pattern with noise, so loss can fall.
      at::Generator g = at::make_generator<at::CPUGeneratorImpl>(11);
      const at::Tensor noise = at::randint(0, 4, {30000}, g, at::kLong);
      const at::Tensor tokens = (at::arange(30000, at::kLong) % 37 + noise + 60).clamp_max(255);
      std::vector<uint16_t> data(tokens.data_ptr<int64_t>(), tokens.data_ptr<int64_t>() + tokens.numel());
      write_token_file(util::join_path(dir_, "train.bin"), std::vector<uint16_t>(data.begin(), data.begin() + 27000), 256);
      write_token_file(util::join_path(dir_, "val.bin"), std::vector<uint16_t>(data.begin() + 27000, data.end()), 256);
    }
    world()->barrier().wait();
  }
  void TearDown() override {
    world()->barrier().wait();
    if (world()->rank() == 0) util::remove_tree(dir_);
  }

  // `overrides` ("section.key=value") apply over the test model, before validation.
  TrainConfig config(int ranks, int64_t micro_batch, const std::string& checkpoints = "",
                     const std::vector<std::string>& overrides = {}) const {
    std::vector<std::string> all = {"model.preset=tiny", "model.layers=" + std::to_string(layers_), "model.width=64",
                                    "model.heads=4", "model.context=16"};
    all.insert(all.end(), overrides.begin(), overrides.end());
    TrainConfig c = TrainConfig::load("", all);
    c.preset = "test";
    c.train_file = util::join_path(dir_, "train.bin");
    c.val_file = util::join_path(dir_, "val.bin");
    c.batch = kBatch;
    c.micro_batch = micro_batch;
    c.steps = 10;
    c.warmup = 2;
    c.eval_batches = 1;
    c.out = util::join_path(dir_, "run");
    c.checkpoint_dir = checkpoints.empty() ? util::join_path(dir_, "unused-checkpoints") : checkpoints;
    c.resume = !checkpoints.empty();
    c.validate(ranks);
    return c;
  }

  // one_process(config(1, micro, "", overrides), steps, evaluate), computed
  // once per test: the layouts a test compares with the same single-process
  // config share its run (the config depends on nothing else but layers_).
  const OneProcessRun& one_process_of(int64_t micro, const Overrides& overrides, int steps, bool evaluate = false) {
    const std::string key = std::to_string(layers_) + "/" + std::to_string(micro) + "/" + std::to_string(steps) + "/" +
                            (evaluate ? "evaluate/" : "") + describe(overrides);
    auto it = one_process_runs_.find(key);
    if (it == one_process_runs_.end()) {
      it = one_process_runs_.emplace(key, one_process(config(1, micro, "", overrides), steps, evaluate)).first;
    }
    return it->second;
  }

  // One process on this rank alone (the CUDA tests' oracle, each rank on its own device).
  std::shared_ptr<comm::Communicator> alone() const { return world()->split(world()->rank(), 0, "test:alone"); }

  std::string dir_;
  int64_t layers_ = 2;  // blocks of the test model
  std::map<std::string, OneProcessRun> one_process_runs_;
};

// Compared on the CPU (either side may live on a GPU).
inline double relative_error(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor a = got.cpu(), b = want.cpu();
  return (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-12);
}

// Whole-model relative error and the largest element difference.
inline std::pair<double, double> parameter_errors(const std::map<std::string, at::Tensor>& got,
                                           const std::map<std::string, at::Tensor>& want) {
  std::vector<at::Tensor> mine, theirs;
  double largest = 0;
  for (const auto& [name, value] : want) {
    const at::Tensor other = got.at(name).cpu(), expected = value.cpu();
    largest = std::max(largest, (other - expected).abs().max().item<double>());
    mine.push_back(other.flatten());
    theirs.push_back(expected.flatten());
  }
  return {relative_error(at::cat(mine), at::cat(theirs)), largest};
}

// Tolerances as for data parallel (data_parallel_test.cpp): loss 1e-5 relative
// every step, gradient norm 1e-4 relative every step, parameters after the
// steps 1e-4 relative over the model and 1e-4 absolute per element.
inline void expect_same_training(Trainer& parallel, const OneProcessRun& single, int steps, const std::string& what) {
  ASSERT_GE(static_cast<int>(single.steps.size()), steps) << what << ": the one-process run is shorter";
  for (int s = 0; s < steps; ++s) {
    const StepResult got = parallel.step(), &want = single.steps[s];
    EXPECT_LE(std::abs(got.loss - want.loss) / want.loss, 1e-5)
        << what << ", step " << s + 1 << ": loss " << got.loss << " vs " << want.loss;
    EXPECT_LE(std::abs(got.grad_norm - want.grad_norm) / want.grad_norm, 1e-4)
        << what << ", step " << s + 1 << ": grad norm " << got.grad_norm << " vs " << want.grad_norm;
    // Mixture of experts: the auxiliary losses and the share dropped, per layer.
    EXPECT_EQ(got.moe.size(), want.moe.size()) << what;
    for (size_t i = 0; i < std::min(got.moe.size(), want.moe.size()); ++i) {
      EXPECT_NEAR(got.moe[i].aux_loss, want.moe[i].aux_loss, 1e-5 * want.moe[i].aux_loss)
          << what << ", step " << s + 1 << ": aux loss of block " << want.moe[i].block;
      EXPECT_NEAR(got.moe[i].z_loss, want.moe[i].z_loss, 1e-5 * want.moe[i].z_loss)
          << what << ", step " << s + 1 << ": z loss of block " << want.moe[i].block;
      EXPECT_NEAR(got.moe[i].dropped, want.moe[i].dropped, 1e-9) << what << ", step " << s + 1 << ": dropped";
    }
  }
  const auto [relative, largest] = parameter_errors(parallel.full_parameters(), single.parameters);
  EXPECT_LE(relative, 1e-4) << what;
  EXPECT_LE(largest, 1e-4) << what;
}

}  // namespace meshtrain::train
