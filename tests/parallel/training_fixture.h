// A training fixture shared by the parallel-layout tests: a small token file
// pair on disk, a tiny model config, and the one-process oracle.
#pragma once

#include "meshtrain/train/trainer.h"
#include "meshtrain/util/files.h"
#include "tests/harness/mpi_env.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

namespace meshtrain::train {

using testing::world;

constexpr int64_t kBatch = 24;  // divisible by 1, 2, 3, 4 and 8 ranks

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

  // `overrides` ("section.key=value") apply before validation.
  TrainConfig config(int ranks, int64_t micro_batch, const std::string& checkpoints = "",
                     const std::vector<std::string>& overrides = {}) const {
    TrainConfig c = TrainConfig::load("", overrides);
    c.preset = "test";
    c.model = model::GptConfig::preset("tiny");
    c.model.layers = 2;
    c.model.width = 64;
    c.model.heads = 4;
    c.model.context = 16;
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

  // One process on this rank alone: the oracle.
  std::shared_ptr<comm::Communicator> alone() const { return world()->split(world()->rank(), 0, "test:alone"); }

  std::string dir_;
};

inline double relative_error(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).norm().item<double>() / std::max(want.norm().item<double>(), 1e-12);
}

}  // namespace meshtrain::train
