// The open families' model features (Note [Model families]) in every layout
// under mpirun: tensor parallel (and sequence parallel), ZeRO-3, pipeline,
// expert parallel and activation checkpointing against one process over the
// same micro-batches, loss and gradient norm every step and the parameters
// after. Each feature set is one family's, shrunk to the test model (Llama's
// with the output z-loss, which the loss of every layout adds).
#include "tests/parallel/training_fixture.h"

namespace meshtrain::train {
namespace {

const Overrides kLlamaStyle = {"model.norm=rmsnorm", "model.position=rope", "model.mlp=swiglu", "model.bias=false",
                               "model.tie_embeddings=false"};

Overrides with(Overrides base, const Overrides& more) {
  base.insert(base.end(), more.begin(), more.end());
  return base;
}

struct Family {
  std::string name;
  Overrides model;
  bool tensor_parallel = true;  // OLMo 2's norm over every head is refused under tp
};

std::vector<Family> families(int ranks) {
  const std::string experts = ranks == 3 ? "6" : "8";
  return {
      {"llama 3.1 (rope scaling, all biases, GQA; and PaLM's output z-loss)",
       with(kLlamaStyle, {"model.kv_heads=2", "model.rope_scaling=llama3", "model.rope_factor=4",
                          "model.rope_original_context=8", "model.rope_theta=500000", "model.attention_bias=true",
                          "model.mlp_bias=true", "model.z_loss=0.01"})},
      {"qwen3 (QK-norm, head size 24, q/k/v biases)",
       with(kLlamaStyle, {"model.kv_heads=2", "model.head_size=24", "model.qk_norm=head", "model.qkv_bias=true"})},
      {"gemma 2 (sandwich (1 + w) norms, GeGLU, soft-caps, every other block windowed)",
       with(kLlamaStyle, {"model.mlp=geglu", "model.norm_placement=sandwich", "model.norm_plus_one=true",
                          "model.embed_scale=true", "model.attn_softcap=20", "model.logit_softcap=15",
                          "model.query_scale=24", "model.sliding_window=5", "model.sliding_every=2",
                          "model.tie_embeddings=true"})},
      {"mistral (window 5, yarn, half the dims rotated)",
       with(kLlamaStyle, {"model.kv_heads=2", "model.sliding_window=5", "model.rope_scaling=yarn",
                          "model.rope_factor=2", "model.rope_original_context=8", "model.rotary_fraction=0.5"})},
      {"olmo 2 (norms after the sublayers, QK-norm over all heads)",
       with(kLlamaStyle, {"model.norm_placement=post", "model.qk_norm=width"}), /*tensor_parallel=*/false},
      {"qwen-moe (top-4 of many, not renormalised, a shared expert, QK-norm)",
       with(kLlamaStyle, {"model.moe_experts=" + experts, "model.moe_top_k=4", "model.moe_every=1",
                          "model.moe_hidden=32", "model.moe_capacity_factor=0", "model.moe_norm_topk=false",
                          "model.moe_shared_hidden=48", "model.qk_norm=head", "model.kv_heads=2",
                          "model.moe_second_expert=always"})},
  };
}

// The layouts `ranks` ranks allow, for a dense or a mixture-of-experts model.
std::vector<Overrides> layouts(int ranks, bool moe, bool tensor_parallel) {
  std::vector<Overrides> out = {{"parallel.zero_stage=3"}};
  if (ranks % 2 == 0) {
    if (tensor_parallel) {
      out.push_back({"parallel.tp=2"});
      out.push_back({"parallel.tp=2", "parallel.sequence_parallel=true", "parallel.activation_checkpoint=selective"});
    }
    out.push_back({"parallel.pp=2", "parallel.microbatches=4", "parallel.activation_checkpoint=full"});
    if (moe) out.push_back({"parallel.ep=2"});
  }
  if (ranks == 3 && moe) out.push_back({"parallel.ep=3"});
  return out;
}

class FamiliesParallelTest : public TrainingTest {};

TEST_F(FamiliesParallelTest, EveryFeatureInEveryLayoutEqualsOneProcess) {
  const int n = world()->size();
  if (n < 2 || n > 4) GTEST_SKIP() << "run at 2, 3 and 4 ranks";
  for (const Family& family : families(n)) {
    const bool moe = family.name.rfind("qwen-moe", 0) == 0;
    for (const Overrides& layout : layouts(n, moe, family.tensor_parallel)) {
      // Pipeline layouts derive the micro-batch from parallel.microbatches.
      const int64_t micro = layout.front().rfind("parallel.pp", 0) == 0 ? 1 : 2;
      const TrainConfig split = config(n, micro, "", with(family.model, layout));
      Trainer parallel(split, world());
      expect_same_training(parallel, one_process_of(split.micro_batch, family.model, 3), 3, family.name + " with " + describe(layout) + " on " + std::to_string(n) +
                                                    " ranks");
    }
  }
}

// A checkpoint of each family's new parameters (QK-norm, post-norms, shared
// expert) saved in one layout and resumed in another continues one process's
// losses.
TEST_F(FamiliesParallelTest, CheckpointsReshardBetweenLayouts) {
  const int n = world()->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "run at 2 and 4 ranks";
  const std::vector<Family> all = families(n);
  for (size_t f = 0; f < all.size(); ++f) {
    const Family& family = all[f];
    if (!family.tensor_parallel) continue;
    const bool moe = family.name.rfind("qwen-moe", 0) == 0;
    const std::vector<Overrides> layouts = {{"parallel.tp=2"}, {moe ? "parallel.ep=2" : "parallel.zero_stage=3"}};
    const int64_t micro = 2, steps = 2;
    const std::vector<double> want = one_process(config(1, micro, "", family.model), steps * 2).losses();
    const std::string checkpoints = util::join_path(dir_, "reshard-" + std::to_string(f));
    for (size_t i = 0; i < layouts.size(); ++i) {
      Trainer trainer(config(n, micro, checkpoints, with(family.model, layouts[i])), world());
      if (i > 0) ASSERT_TRUE(trainer.resumed()) << family.name;
      for (int64_t s = i * steps; s < static_cast<int64_t>(i + 1) * steps; ++s) {
        EXPECT_NEAR(trainer.step().loss, want[s], 1e-5 * want[s])
            << family.name << ", " << describe(layouts[i]) << ", step " << s + 1;
      }
      if (i == 0) {
        trainer.save_checkpoint();
        trainer.finish_checkpoints();
      }
    }
  }
}

TEST_F(FamiliesParallelTest, OlmoTwoNormOverEveryHeadIsRefusedUnderTensorParallel) {
  if (world()->size() != 2) GTEST_SKIP() << "run at 2 ranks";
  const Overrides olmo = with(kLlamaStyle, {"model.norm_placement=post", "model.qk_norm=width", "parallel.tp=2"});
  try {
    Trainer trainer(config(2, 4, "", olmo), world());
    FAIL() << "tp = 2 with qk_norm = width was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("qk_norm"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshtrain::train
