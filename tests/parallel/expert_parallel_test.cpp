// Expert parallel and mixture-of-experts models under mpirun: ep = k (alone,
// beside data parallel and beside a pipeline) against one process over the same micro-batches, top-1
// and top-2; ZeRO-1/2/3 of an MoE model, and beside expert parallel,
// against one process; a rank whose
// experts receive no tokens; checkpoints resumed with another ep; tensor
// parallel (and sequence parallel, and tp x ep) of an MoE model.
#include "meshtrain/parallel/expert_parallel.h"
#include "tests/parallel/training_fixture.h"

#include <ATen/CPUGeneratorImpl.h>

#include <map>

namespace meshtrain::train {
namespace {

// Experts every rank count here divides: 6 for 3 ranks, 8 otherwise.
int64_t experts_for(int ranks) { return ranks == 3 ? 6 : 8; }

class ExpertParallelTest : public TrainingTest {
 protected:
  Overrides moe(int64_t top_k, Overrides layout) const {
    layout.push_back("model.moe_experts=" + std::to_string(experts_for(world()->size())));
    layout.push_back("model.moe_top_k=" + std::to_string(top_k));
    layout.push_back("model.moe_every=1");
    layout.push_back("model.moe_hidden=96");
    layout.push_back("model.moe_second_expert=always");  // random draws differ between layouts by design
    return layout;
  }

  // `layout` on every rank against one process reading the same micro-batches
  // (`micro` sequences each, accumulated).
  void expect_equal_to_one_process(const Overrides& layout, int64_t micro) {
    const int n = world()->size();
    Trainer parallel(config(n, micro, "", layout), world());
    expect_same_training(parallel, one_process_of(micro, model_only(layout), 4), 4, describe(layout) + " on " + std::to_string(n) + " ranks");
  }

  // The model's settings of `layout` (what one process trains).
  static Overrides model_only(const Overrides& layout) {
    Overrides out;
    for (const std::string& o : layout) {
      if (o.rfind("model.", 0) == 0) out.push_back(o);
    }
    return out;
  }

  // `layouts` trained in turn on every rank, `steps` steps each, each resuming
  // the checkpoint the one before saved, against one process throughout
  // (kBatch / ranks sequences per micro-batch in every layout).
  void expect_resumes_through(const std::vector<Overrides>& layouts, int steps, const std::string& name) {
    const int n = world()->size();
    const int64_t micro = kBatch / n;
    const std::vector<double> want =
        one_process(config(1, micro, "", model_only(layouts.front())), steps * layouts.size()).losses();
    const std::string checkpoints = util::join_path(dir_, name);
    for (size_t i = 0; i < layouts.size(); ++i) {
      Trainer trainer(config(n, micro, checkpoints, layouts[i]), world());
      if (i > 0) {
        ASSERT_TRUE(trainer.resumed()) << describe(layouts[i]);
      }
      for (size_t s = i * steps; s < (i + 1) * steps; ++s) {
        EXPECT_NEAR(trainer.step().loss, want[s], 1e-5 * want[s]) << describe(layouts[i]) << ", step " << s + 1;
      }
      if (i + 1 < layouts.size()) {
        trainer.save_checkpoint();
        trainer.finish_checkpoints();
      }
    }
  }
};

TEST_F(ExpertParallelTest, EpEqualsOneProcessAloneAndBesideDataParallel) {
  const int n = world()->size();
  for (int64_t top_k : {1, 2}) {
    expect_equal_to_one_process(moe(top_k, {"parallel.ep=" + std::to_string(n)}), kBatch / n);
    if (n % 2 == 0 && n > 2) expect_equal_to_one_process(moe(top_k, {"parallel.ep=2"}), kBatch / n);
  }
  // Beside a pipeline: pp 2 x ep 2, two micro-batches per data rank.
  if (n == 4) {
    expect_equal_to_one_process(moe(2, {"parallel.pp=2", "parallel.ep=2", "parallel.microbatches=2"}), kBatch / 4);
  }
}

// Tensor parallel of an MoE model: every tp rank routes the micro-batch and
// computes its share of the assignments; with sequence parallel, and beside
// expert parallel (tp 2 x ep 2), where each token is sent to its expert once.
TEST_F(ExpertParallelTest, TensorParallelOfAnMoeModelEqualsOneProcess) {
  const int n = world()->size();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even world";
  std::vector<Overrides> layouts;
  for (int64_t top_k : {1, 2}) {
    layouts.push_back(moe(top_k, {"parallel.tp=2"}));
    layouts.push_back(moe(top_k, {"parallel.tp=2", "parallel.sequence_parallel=true"}));
  }
  // Capacity on: the same tokens dropped as in one process.
  layouts.push_back(moe(2, {"parallel.tp=2", "model.moe_capacity_factor=1.0"}));
  if (n == 4) {
    layouts.push_back(moe(2, {"parallel.tp=2", "parallel.ep=2"}));
    layouts.push_back(moe(1, {"parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"}));
  }
  for (const Overrides& layout : layouts) {
    const int64_t micro = kBatch / config(n, 1, "", layout).data_ranks();
    expect_equal_to_one_process(layout, micro);
  }
}

TEST_F(ExpertParallelTest, TensorParallelComputesEachAssignmentOnce) {
  const int n = world()->size();
  if (n != 4) GTEST_SKIP() << "compares dp 2 x ep 2 with tp 2 x ep 2 on 4 ranks";
  // Each rank's load is the assignments it computed over a balanced share of
  // the routed ones; summed over the ranks it is the rank count when every
  // assignment is computed (and so dispatched) exactly once, twice that if
  // both tp ranks of a pair sent their (identical) tokens.
  auto loads_summed = [&](const Overrides& layout) {
    Trainer trainer(config(n, kBatch / config(n, 1, "", layout).data_ranks(), "", layout), world());
    const std::vector<model::MoeLayerMetrics> layers = trainer.step().moe;
    std::vector<double> sums;
    for (const model::MoeLayerMetrics& m : layers) {
      at::Tensor total = at::tensor({m.this_rank_load}, at::kDouble);
      world()->all_reduce(total).wait();
      sums.push_back(total.item<double>());
    }
    return sums;
  };
  for (const Overrides& layout : {moe(2, {"parallel.ep=2", "parallel.dp=2", "model.moe_capacity_factor=0"}),
                                  moe(2, {"parallel.tp=2", "parallel.ep=2", "model.moe_capacity_factor=0"})}) {
    for (double sum : loads_summed(layout)) EXPECT_NEAR(sum, 4.0, 1e-9) << describe(layout);
  }
}

TEST_F(ExpertParallelTest, ShardedStagesOfAnMoeModelEqualOneProcessAndMoveTheExperts) {
  const int n = world()->size();
  std::vector<Overrides> layouts;
  for (int stage : {1, 2, 3}) layouts.push_back(moe(2, {"parallel.zero_stage=" + std::to_string(stage)}));
  // Beside expert parallel: experts sharded among their copies, reduced over dp x fsdp only
  // (ZeRO-3: gathered and freed with their block).
  for (int stage : {1, 2, 3}) {
    const std::string zero = "parallel.zero_stage=" + std::to_string(stage);
    if (n > 1) layouts.push_back(moe(2, {zero, "parallel.ep=" + std::to_string(n), "parallel.fsdp=1"}));
    if (n == 4) {
      layouts.push_back(moe(2, {zero, "parallel.ep=2"}));  // fsdp 2 x ep 2
      layouts.push_back(moe(1, {zero, "parallel.ep=2", "parallel.fsdp=1", "parallel.dp=2"}));  // hybrid: dp 2 x ep 2
    }
  }
  if (n == 4) {
    layouts.push_back(moe(2, {"parallel.zero_stage=1", "parallel.zero1_reduce=reduce_scatter", "parallel.ep=2"}));
    // Two micro-batches per step: ZeRO-2 reduces after each backward while the next forward's
    // all-to-alls run over the same ranks (once a deadlock).
    expect_equal_to_one_process(moe(2, {"parallel.zero_stage=2", "parallel.ep=2"}), kBatch / 2 / 2);
    expect_equal_to_one_process(moe(2, {"parallel.zero_stage=3", "parallel.ep=2"}), kBatch / 2 / 2);
    layouts.push_back(moe(2, {"parallel.zero_stage=3", "parallel.tp=2", "parallel.ep=2"}));
  }
  if (n == 8) layouts.push_back(moe(2, {"parallel.zero_stage=3", "parallel.ep=4"}));  // fsdp 2 x ep 4
  for (const Overrides& layout : layouts) {
    const int stage = config(n, 1, "", layout).parallel.dims.zero_stage;
    const int64_t micro = kBatch / config(n, 1, "", layout).data_ranks();
    expect_equal_to_one_process(layout, micro);
    Trainer trainer(config(n, micro, "", layout), world());
    const std::map<std::string, at::Tensor> before = trainer.full_parameters();
    trainer.step();
    const std::map<std::string, at::Tensor> after = trainer.full_parameters();
    for (const std::string name : {"blocks.0.moe.router", "blocks.0.moe.fc_weight", "blocks.1.moe.proj_weight"}) {
      EXPECT_GT((after.at(name) - before.at(name)).abs().max().item<double>(), 0.0)
          << describe(layout) << " (stage " << stage << "): " << name << " did not change in a step";
    }
  }
}

// Records what a FullySharded has gathered as each MoE layer starts its
// forward and its backward.
class GatheredAtMoeLayers : public model::ForwardHooks {
 public:
  explicit GatheredAtMoeLayers(const parallel::FullySharded& sharded) : sharded_(sharded) {}

  at::Tensor around(const std::string& module, const at::Tensor& input, const Forward& forward) override {
    if (module.size() < 4 || module.compare(module.size() - 4, 4, ".moe") != 0) return forward(input);
    forward_most = std::max(forward_most, sharded_.gathered_numel());
    at::Tensor output = forward(input);
    if (output.requires_grad()) {
      output.register_hook([this](const at::Tensor& grad) {
        backward_most = std::max(backward_most, sharded_.gathered_numel());
        return grad;
      });
    }
    return output;
  }

  int64_t forward_most = 0, backward_most = 0;

 private:
  const parallel::FullySharded& sharded_;
};

// ZeRO-3 beside ep gathers a block's experts with the block and frees them
// with it, in forward and in backward: at any MoE layer, at most the root
// unit, this block with its experts and the next one (prefetched) exist in
// full, where experts kept would add up over the layers.
TEST_F(ExpertParallelTest, ZeroThreeHoldsOnlyTheBlocksInUseWithTheirExperts) {
  const int n = world()->size();
  if (n == 1) GTEST_SKIP() << "needs ep > 1";
  TrainConfig c = config(n, kBatch / n, "", moe(2, {"parallel.zero_stage=3", "parallel.ep=" + std::to_string(n), "parallel.fsdp=1"}));
  c.model.layers = 6;
  c.model.moe_hidden = 384;  // the experts are most of each block
  c.validate(n);
  Trainer trainer(c, world());
  const parallel::FullySharded& sharded = *trainer.sharded();
  auto probe = std::make_shared<GatheredAtMoeLayers>(sharded);
  trainer.model()->add_forward_hooks(probe);
  trainer.step();
  trainer.model()->remove_forward_hooks(probe.get());
  const int64_t root = (c.model.vocab_size + c.model.context + 2) * c.model.width + n;  // embeddings, final norm
  const int64_t bound = root + 2 * sharded.largest_unit_numel();
  const int64_t experts = c.model.layers * (experts_for(n) / n) * 2 * c.model.width * c.model.moe_hidden;
  ASSERT_GT(experts, bound) << "the test needs experts that would not fit the bound if kept";
  EXPECT_GT(probe->forward_most, 0);
  EXPECT_LE(probe->forward_most, bound) << "rank " << world()->rank() << ": forward";
  EXPECT_GT(probe->backward_most, 0);
  EXPECT_LE(probe->backward_most, bound) << "rank " << world()->rank() << ": backward";
  EXPECT_EQ(sharded.gathered_numel(), 0) << "rank " << world()->rank() << ": units still gathered after the step";
}

TEST_F(ExpertParallelTest, RanksWhoseExpertsGetNoTokensStillStepAndMatch) {
  const int n = world()->size();
  if (n == 1) GTEST_SKIP() << "needs other ranks' experts";
  model::GptConfig c = model::GptConfig::preset("tiny");
  c.width = 32;
  c.heads = 4;
  c.layers = 1;
  c.moe_every = 1;
  c.moe_experts = experts_for(n);
  c.moe_capacity_factor = 0;  // dropless: every token to expert 0, on rank 0
  model::Gpt whole(c, 3), split(c, 3);
  for (model::Gpt* m : {&whole, &split}) {
    torch::NoGradGuard no_grad;
    model::Moe layer = (*m)->moe_layers().front();
    layer->router.zero_();
    layer->router[0][0] = 10.0;
  }
  parallel::ExpertParallel ep(split, world());
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(20 + world()->rank());
  at::Tensor x = at::randn({2, 8, c.width}, g);
  x.select(2, 0).fill_(1.0);
  model::Moe local = split->moe_layers().front(), reference = whole->moe_layers().front();
  const int64_t sent_before = world()->stats()[comm::OpKind::kAllToAll].wire_bytes;
  const at::Tensor got = local->forward(x), want = reference->forward(x);
  EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-6)) << "rank " << world()->rank();
  // Bytes sent to other ranks in the forward, by hand: every rank sends its counts for the
  // others' experts ((n - 1) x E/n int64); the 16 tokens [16, 32] of float32 of a rank other
  // than 0 go to rank 0, which sends the results of the others' tokens back.
  const int64_t counts = (n - 1) * (c.moe_experts / n) * 8, tokens = 16 * c.width * 4;
  const int64_t expected = counts + (world()->rank() == 0 ? (n - 1) * tokens : tokens);
  EXPECT_EQ(world()->stats()[comm::OpKind::kAllToAll].wire_bytes - sent_before, expected) << "rank " << world()->rank();
  got.pow(2).sum().backward();
  want.pow(2).sum().backward();
  for (const at::Tensor& w : local->expert_weights()) {
    ASSERT_TRUE(w.grad().defined()) << "rank " << world()->rank() << ": an idle expert has no gradient";
    const double size = w.grad().abs().sum().item<double>();
    if (world()->rank() == 0) EXPECT_GT(size, 0.0);
    else EXPECT_EQ(size, 0.0);
  }
}

TEST_F(ExpertParallelTest, ResumesWithAnotherEpAndWithTensorParallel) {
  const int n = world()->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "ep 2 -> 1 -> tp 2 on 2 ranks, ep 2 -> 4 -> tp 2 x ep 2 on 4";
  const Overrides a = moe(1, {"parallel.ep=2"}), b = moe(1, {"parallel.ep=" + std::to_string(n == 2 ? 1 : 4)});
  const Overrides c = moe(1, n == 2 ? Overrides{"parallel.tp=2"} : Overrides{"parallel.tp=2", "parallel.ep=2"});
  // The same micro-batches in every layout (accumulated where fewer data ranks).
  expect_resumes_through({a, b, c}, 3, "ep-reshard");
}

TEST_F(ExpertParallelTest, ShardedExpertParallelCheckpointsResumeInAnotherLayout) {
  const int n = world()->size();
  if (n != 2 && n != 4) {
    GTEST_SKIP() << "ZeRO-2 x ep 2 -> ep 1 -> ZeRO-3 x ep 2 on 2 ranks, "
                    "ZeRO-2 x fsdp 2 x ep 2 -> ZeRO-1 x ep 4 -> ZeRO-3 x fsdp 2 x ep 2 -> ep 1 on 4";
  }
  const Overrides zero2 = moe(2, {"parallel.zero_stage=2", "parallel.ep=2"});
  const Overrides zero3 = moe(2, {"parallel.zero_stage=3", "parallel.ep=2"});
  if (n == 2) expect_resumes_through({zero2, moe(2, {}), zero3}, 2, "zero-ep-reshard");
  else expect_resumes_through({zero2, moe(2, {"parallel.zero_stage=1", "parallel.ep=4"}), zero3, moe(2, {})}, 2, "zero-ep-reshard");
}

TEST_F(ExpertParallelTest, MetricsReportEveryMoeLayer) {
  const int n = world()->size();
  Trainer trainer(config(n, kBatch / n, "", moe(1, {"parallel.ep=" + std::to_string(n)})), world());
  const StepResult result = trainer.step();
  ASSERT_EQ(result.moe.size(), 2u);  // both blocks
  for (const model::MoeLayerMetrics& m : result.moe) {
    EXPECT_GT(m.aux_loss, 0.0);
    EXPECT_GT(m.z_loss, 0.0);
    EXPECT_GE(m.dropped, 0.0);
    EXPECT_LT(m.dropped, 1.0);
    EXPECT_GE(m.load_max_over_mean, 1.0);
  }
  // Dropless: every routed assignment is computed somewhere, so the ranks'
  // loads average to 1 and the busiest rank's is their maximum.
  Trainer dropless(config(n, kBatch / n, "", moe(2, {"parallel.ep=" + std::to_string(n), "model.moe_capacity_factor=0"})),
                   world());
  for (const model::MoeLayerMetrics& m : dropless.step().moe) {
    at::Tensor loads = at::tensor({m.this_rank_load}, at::kDouble);
    at::Tensor all = at::empty({n}, at::kDouble);
    world()->all_gather(all, loads).wait();
    EXPECT_NEAR(all.mean().item<double>(), 1.0, 1e-12) << "block " << m.block;
    EXPECT_DOUBLE_EQ(all.max().item<double>(), m.rank_load) << "block " << m.block;
    // The load at every degree from the kept assignments per expert: at the
    // run's own (ep = every rank) it is the busiest rank's measured one, and
    // one rank holding every expert keeps them all (dropless).
    std::map<int64_t, double> by_ep(m.rank_load_by_ep.begin(), m.rank_load_by_ep.end());
    ASSERT_TRUE(by_ep.count(n) && by_ep.count(1)) << "block " << m.block;
    EXPECT_NEAR(by_ep[n], m.rank_load, 1e-12) << "block " << m.block;
    EXPECT_NEAR(by_ep[1], 1.0, 1e-12) << "block " << m.block;
  }
}

}  // namespace
}  // namespace meshtrain::train
