// Data parallel and ZeRO-1/2/3 on a torch::nn::Module meshtrain did not
// write (no named call sites: stage 3 gathers through the operator observer),
// against the same module trained in one process.
#include "meshtrain/parallel/data_parallel.h"
#include "meshtrain/parallel/fully_sharded.h"
#include "tests/harness/mpi_env.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>

namespace meshtrain::parallel {
namespace {

using testing::world;

// A user's model: an embedding, a residual MLP built from a Sequential, a
// norm and a head.
struct TinyNetImpl : torch::nn::Module {
  TinyNetImpl() {
    torch::manual_seed(3);
    embed = register_module("embed", torch::nn::Embedding(64, 32));
    body = register_module("body", torch::nn::Sequential(torch::nn::Linear(32, 96), torch::nn::GELU(),
                                                         torch::nn::Linear(96, 32)));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})));
    head = register_module("head", torch::nn::Linear(32, 64));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = embed(tokens);
    x = x + body->forward(x);
    return head(norm(x));
  }
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets) {
    return at::cross_entropy_loss(forward(tokens).flatten(0, 1), targets.flatten());
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Sequential body{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TinyNet);

constexpr int64_t kBatch = 24, kSeq = 8;
constexpr int kSteps = 4;

std::pair<at::Tensor, at::Tensor> batch(int step) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  const at::Tensor tokens = at::randint(64, {kBatch, kSeq + 1}, g, at::kLong);
  return {tokens.narrow(1, 0, kSeq), tokens.narrow(1, 1, kSeq)};
}

// This rank's rows of the global batch.
at::Tensor rows(const at::Tensor& x, int rank, int ranks) {
  const int64_t per = kBatch / ranks;
  return x.narrow(0, rank * per, per);
}

// Steps `strategy` on this rank's rows; returns the losses averaged over ranks.
std::vector<double> train(TinyNet& net, DataParallelism& strategy, int rank, int ranks) {
  std::vector<double> losses;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    strategy.zero_grad();
    strategy.set_sync(true);
    at::Tensor loss = net->loss(rows(x, rank, ranks), rows(y, rank, ranks));
    loss.backward();
    strategy.after_backward();
    strategy.clip_grad_norm(1.0);
    strategy.step(1e-2);
    at::Tensor mean = loss.detach().reshape({1}).to(at::kDouble);
    world()->all_reduce(mean, comm::ReduceOp::kAvg).wait();
    losses.push_back(mean.item<double>());
  }
  return losses;
}

class AnyModule : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto alone = world()->split(world()->rank(), 0, "test:alone");
    TinyNet net;
    DataParallel one(*net, alone, DataParallelOptions{});
    reference_losses_ = train(net, one, 0, 1);
    for (const auto& item : net->named_parameters()) reference_[item.key()] = item.value().detach().clone();
  }

  void expect_reference(const std::vector<double>& losses, const std::map<std::string, at::Tensor>& parameters,
                        const std::string& what) {
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_NEAR(losses[s], reference_losses_[s], 1e-5 * reference_losses_[s]) << what << ", step " << s + 1;
    }
    for (const auto& [name, value] : reference_) {
      EXPECT_LE((parameters.at(name) - value).abs().max().item<double>(), 1e-5) << what << ": " << name;
    }
  }

  std::vector<double> reference_losses_;
  std::map<std::string, at::Tensor> reference_;
};

TEST_F(AnyModule, DataParallelEqualsOneProcess) {
  TinyNet net;
  DataParallel ddp(*net, world());
  const std::vector<double> losses = train(net, ddp, world()->rank(), world()->size());
  expect_reference(losses, ddp.full_parameters(0), "data parallel");
}

TEST_F(AnyModule, EveryZeroStageAndUnitChoiceEqualsOneProcess) {
  const int n = world()->size();
  const auto self = world()->split(world()->rank(), 0, "test:self");
  const ShardingGroups groups{world(), self, world(), nullptr, nullptr};
  for (int stage : {1, 2, 3}) {
    for (const std::string units : {"whole model", "body and head", "every linear"}) {
      TinyNet net;
      FullyShardedOptions options;
      options.stage = stage;
      options.units = units == "whole model"     ? UnitPolicy::whole_model()
                      : units == "body and head" ? UnitPolicy::submodules({"body", "head"})
                                                 : UnitPolicy{[](const std::string&, const torch::nn::Module& m) {
                                                     return dynamic_cast<const torch::nn::LinearImpl*>(&m) != nullptr;
                                                   }};
      FullySharded fsdp(net.ptr(), groups, options);
      const std::string what = "ZeRO-" + std::to_string(stage) + ", units: " + units;
      EXPECT_EQ(fsdp.unit_count(), units == "whole model" ? 1 : units == "body and head" ? 3 : 4) << what;
      const std::vector<double> losses = train(net, fsdp, world()->rank(), n);
      expect_reference(losses, fsdp.full_parameters(-1), what);
      if (stage == 3 && n > 1) {
        // Between steps a unit's parameters hold no memory.
        EXPECT_EQ(net->head->weight.storage().nbytes(), 0u) << what;
        EXPECT_EQ(net->body->ptr<torch::nn::LinearImpl>(0)->weight.storage().nbytes(), 0u) << what;
      }
      // Evaluation without gradients gathers what it needs too.
      torch::NoGradGuard no_grad;
      auto [x, y] = batch(0);
      const double loss = net->loss(x, y).item<double>();
      EXPECT_TRUE(std::isfinite(loss)) << what;
      // Loading full parameters while a unit is gathered writes them in place.
      fsdp.load_full_state_dict(reference_, 0);
      EXPECT_TRUE(at::equal(fsdp.full_parameters(-1).at("head.weight"), reference_.at("head.weight"))) << what;
    }
  }
}

}  // namespace
}  // namespace meshtrain::parallel
