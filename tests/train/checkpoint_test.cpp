// Checkpoints: round trip, a crash mid-save keeps the previous one, and damaged
// files are refused by name.
#include "meshtrain/train/checkpoint.h"

#include "meshtrain/model/gpt.h"

#include "tests/harness/error_of.h"

#include <gtest/gtest.h>

#include "meshtrain/util/files.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>

namespace meshtrain::train {
namespace {

const auto error_of = testing::error_of<CheckpointError>;

model::GptConfig small_shape() {
  model::GptConfig c = model::GptConfig::preset("tiny");
  c.layers = 1;
  c.width = 32;
  c.heads = 2;
  c.context = 16;
  return c;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = util::make_temp_directory("meshtrain-ckpt-");
    model_ = model::Gpt(small_shape(), 1);
    optimizer_ = std::make_unique<torch::optim::AdamW>(model_->parameters(), torch::optim::AdamWOptions(1e-3));
  }
  void TearDown() override {
    unsetenv("MESHTRAIN_TEST_CHECKPOINT_FAIL_AFTER");
    util::remove_tree(dir_);
  }
  // One optimizer step so the optimizer has state.
  void train_once() {
    optimizer_->zero_grad();
    model_->loss(at::randint(256, {2, 16}), at::randint(256, {2, 16})).backward();
    optimizer_->step();
  }

  std::string dir_;
  model::Gpt model_{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer_;
};

TEST_F(CheckpointTest, RoundTripRestoresModelOptimizerAndRng) {
  train_once();
  CheckpointStore store(dir_, 2);
  store.save({1, 16, "shape", "", ""}, *model_, *optimizer_);
  const at::Tensor next_random = at::rand({3});  // drawn after the save
  model::Gpt other(small_shape(), 99);
  torch::optim::AdamW other_optimizer(other->parameters(), torch::optim::AdamWOptions(1e-3));
  const CheckpointMeta meta = store.load(store.latest(), *other, &other_optimizer, "shape");
  EXPECT_EQ(meta.step, 1);
  EXPECT_EQ(meta.cursor, 16);
  EXPECT_TRUE(at::equal(at::rand({3}), next_random));  // the generator state came back
  auto mine = model_->named_parameters();
  for (const auto& item : other->named_parameters()) EXPECT_TRUE(at::equal(item.value(), mine[item.key()])) << item.key();
  // The optimizer state came back too: one more identical step on both gives identical parameters.
  at::manual_seed(5);
  train_once();
  at::manual_seed(5);
  other_optimizer.zero_grad();
  other->loss(at::randint(256, {2, 16}), at::randint(256, {2, 16})).backward();
  other_optimizer.step();
  for (const auto& item : other->named_parameters()) EXPECT_TRUE(at::equal(item.value(), mine[item.key()])) << item.key();
  EXPECT_NE(error_of([&] { store.load(store.latest(), *other, nullptr, "another shape"); }).find("holds a different model"),
            std::string::npos);
}

TEST_F(CheckpointTest, FailureMidSaveKeepsThePreviousCheckpoint) {
  CheckpointStore store(dir_, 2);
  store.save({1, 0, "shape", "", ""}, *model_, *optimizer_);
  train_once();
  setenv("MESHTRAIN_TEST_CHECKPOINT_FAIL_AFTER", "model.pt", 1);
  EXPECT_NE(error_of([&] { store.save({2, 0, "shape", "", ""}, *model_, *optimizer_); }).find("injected failure"), std::string::npos);
  unsetenv("MESHTRAIN_TEST_CHECKPOINT_FAIL_AFTER");
  EXPECT_EQ(util::base_name(store.latest()), "step-00000001");
  model::Gpt other(small_shape(), 99);
  EXPECT_EQ(store.load(store.latest(), *other, nullptr, "shape").step, 1);
  // The next save cleans the half-written folder up.
  EXPECT_TRUE(util::path_exists(util::join_path(dir_, ".incomplete-step-00000002")));
  store.save({3, 0, "shape", "", ""}, *model_, *optimizer_);
  EXPECT_FALSE(util::path_exists(util::join_path(dir_, ".incomplete-step-00000002")));
  EXPECT_EQ(util::base_name(store.latest()), "step-00000003");
}

TEST_F(CheckpointTest, KeepsOnlyTheNewest) {
  CheckpointStore store(dir_, 2);
  for (int64_t step = 1; step <= 4; ++step) store.save({step, 0, "shape", "", ""}, *model_, *optimizer_);
  EXPECT_FALSE(util::path_exists(util::join_path(dir_, "step-00000002")));
  EXPECT_TRUE(util::path_exists(util::join_path(dir_, "step-00000003")));
  EXPECT_TRUE(util::path_exists(util::join_path(dir_, "step-00000004")));
}

TEST_F(CheckpointTest, TruncatedOrAlteredFilesAreRefusedByName) {
  CheckpointStore store(dir_, 2);
  train_once();
  store.save({1, 0, "shape", "", ""}, *model_, *optimizer_);
  const std::string folder = store.latest();
  const std::string optimizer_file = util::join_path(folder, "optimizer.pt");
  const int64_t size = util::file_size(optimizer_file);
  ASSERT_EQ(truncate(optimizer_file.c_str(), size / 2), 0);
  EXPECT_NE(error_of([&] { store.load(folder, *model_, optimizer_.get(), "shape"); })
                .find("checkpoint file " + optimizer_file + " is truncated or corrupt: " +
                      std::to_string(size / 2) + " bytes, the manifest says " + std::to_string(size)),
            std::string::npos);
  store.save({2, 0, "shape", "", ""}, *model_, *optimizer_);
  const std::string model_file = util::join_path(store.latest(), "model.pt");
  {
    std::fstream f(model_file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x42');
  }
  EXPECT_NE(error_of([&] { store.load(store.latest(), *model_, nullptr, "shape"); })
                .find("checkpoint file " + model_file + " is corrupt: its checksum does not match"),
            std::string::npos);
  std::remove(util::join_path(store.latest(), "MANIFEST.json").c_str());
  EXPECT_NE(error_of([&] { store.load(store.latest(), *model_, nullptr, "shape"); }).find("is incomplete"),
            std::string::npos);
}

}  // namespace
}  // namespace meshtrain::train
