// Context parallel training under mpirun against one process over the same
// micro-batches: loss and gradient norm every step, parameters after (the
// tolerances of expect_same_training). Ring, all-to-all and hybrid at every
// cp the rank count allows (2, 3 with a context it divides, 4, 8), GPT-2 and
// Llama styles with GQA, the open families' attention rules (window,
// soft-cap, query scale, QK-norm), and cp 2 combined with tp, ZeRO-3, pp and
// ep; a checkpoint saved at one cp resumed at another; the refusals.
#include "tests/parallel/training_fixture.h"

#include <chrono>
#include <thread>

namespace meshtrain::train {
namespace {

const Overrides kGpt2Style = {};
const Overrides kLlamaStyle = {"model.norm=rmsnorm", "model.position=rope", "model.mlp=swiglu", "model.bias=false",
                               "model.tie_embeddings=false", "model.kv_heads=2"};

Overrides with(Overrides base, const Overrides& more) {
  base.insert(base.end(), more.begin(), more.end());
  return base;
}

class ContextParallelTest : public TrainingTest {
 protected:
  // `layout` on every rank against one process, `steps` steps.
  void expect_same(const Overrides& model, const Overrides& layout, const std::string& what, int64_t micro = 2,
                   int steps = 3) {
    const int n = world()->size();
    const TrainConfig split = config(n, micro, "", with(model, layout));
    Trainer parallel(split, world());
    const auto& dims = parallel.parts().spec().dims;
    if (dims.zero_stage == 0 && dims.cp > 1) {  // the summary names the data-parallel degree and the averaging group
      const std::string averaged = std::to_string(dims.dp * dims.fsdp * dims.ep * dims.cp);
      EXPECT_EQ(parallel.parts().describe().rfind(
                    "data parallel dp(" + std::to_string(dims.dp * dims.ep) + "), gradients averaged over " + averaged + " ranks", 0),
                0u)
          << parallel.parts().describe();
    }
    expect_same_training(parallel, one_process_of(split.micro_batch, model, steps), steps,
                         what + " with " + describe(layout) + " on " + std::to_string(n) + " ranks");
  }
};

// cp_impl values a model with `heads` heads and `kv` key/value heads allows at `cp`.
std::vector<std::string> impls(int cp, int heads, int kv) {
  std::vector<std::string> out = {"ring"};
  if (heads % cp == 0 && kv % cp == 0) out.push_back("all_to_all");
  if (cp >= 4 && kv % 2 == 0) out.push_back("hybrid");
  return out;
}

TEST_F(ContextParallelTest, EveryImplementationEqualsOneProcess) {
  const int n = world()->size();
  if (n < 2) GTEST_SKIP() << "run at 2 or more ranks";
  for (int cp : {2, 4, 8}) {
    // At 8 ranks only cp 8: cp 2 and 4 beside data parallel are the 4-rank runs again, slower.
    if (n % cp != 0 || (n == 8 && cp != 8)) continue;
    // cp 8 splits the context of 16 into 16 chunks of one row; 8 heads let all-to-all split them.
    const Overrides heads = cp == 8 ? Overrides{"model.heads=8"} : Overrides{};
    for (const auto& [name, style] : {std::pair<std::string, Overrides>{"gpt-2", kGpt2Style}, {"llama", kLlamaStyle}}) {
      const Overrides model = with(style, heads);
      const int h = cp == 8 ? 8 : 4, kv = name == "llama" ? 2 : h;
      for (const std::string& impl : impls(cp, h, kv)) {
        expect_same(model, {"parallel.cp=" + std::to_string(cp), "parallel.cp_impl=" + impl}, name);
      }
    }
  }
}

// 3 ranks: a context of 18 splits into 6 chunks of 3 rows; 16 is refused with the formula.
TEST_F(ContextParallelTest, ThreeRanksSplitAContextOfSixChunks) {
  if (world()->size() != 3) GTEST_SKIP() << "run at 3 ranks";
  for (const Overrides& style : {kGpt2Style, kLlamaStyle}) {
    expect_same(with(style, {"model.context=18"}), {"parallel.cp=3"}, "context 18");
  }
  try {
    config(3, 2, "", {"parallel.cp=3"});
    FAIL() << "cp 3 over a context of 16 was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("must be a multiple of 2 x cp = 6"), std::string::npos) << e.what();
  }
}

// Sliding windows, soft-caps, a query scale and QK-norm: the attention rule of each block crosses the ranks.
TEST_F(ContextParallelTest, OpenFamiliesAttentionRules) {
  const int n = world()->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "run at 2 and 4 ranks";
  const Overrides gemma = with(kLlamaStyle, {"model.mlp=geglu", "model.norm_placement=sandwich", "model.norm_plus_one=true",
                                             "model.attn_softcap=20", "model.logit_softcap=15", "model.query_scale=24",
                                             "model.sliding_window=5", "model.sliding_every=2", "model.embed_scale=true",
                                             "model.tie_embeddings=true"});
  const Overrides qwen3 = with(kLlamaStyle, {"model.head_size=24", "model.qk_norm=head", "model.qkv_bias=true"});
  const Overrides mistral = with(kLlamaStyle, {"model.sliding_window=3", "model.rope_scaling=yarn", "model.rope_factor=2",
                                               "model.rope_original_context=8", "model.rotary_fraction=0.5"});
  const Overrides olmo2 = with(kLlamaStyle, {"model.norm_placement=post", "model.qk_norm=width"});
  const Overrides llama31 = with(kLlamaStyle, {"model.rope_scaling=llama3", "model.rope_factor=4",
                                               "model.rope_original_context=8", "model.rope_theta=500000"});
  for (const auto& [name, model] : {std::pair<std::string, Overrides>{"gemma 2", gemma}, {"qwen3", qwen3}, {"mistral", mistral},
                                    {"olmo 2", olmo2}, {"llama 3.1", llama31}}) {
    expect_same(model, {"parallel.cp=2"}, name);
    if (n == 4) expect_same(model, {"parallel.cp=4", "parallel.cp_impl=hybrid"}, name);
  }
}

TEST_F(ContextParallelTest, CombinesWithEveryOtherParallelism) {
  if (world()->size() != 4) GTEST_SKIP() << "run at 4 ranks";
  const Overrides moe = with(kLlamaStyle, {"model.moe_experts=4", "model.moe_top_k=2", "model.moe_every=1",
                                           "model.moe_hidden=32", "model.moe_capacity_factor=0",
                                           "model.moe_second_expert=always",
                                           "model.moe_aux_loss=0", "model.moe_z_loss=0"});
  for (const auto& [name, style] : {std::pair<std::string, Overrides>{"gpt-2", kGpt2Style}, {"llama", kLlamaStyle}}) {
    expect_same(style, {"parallel.cp=2", "parallel.tp=2"}, name);
    expect_same(style, {"parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                        "parallel.activation_checkpoint=full"}, name);
    expect_same(style, {"parallel.cp=2", "parallel.cp_impl=all_to_all", "parallel.zero_stage=3"}, name);
    expect_same(style, {"parallel.cp=2", "parallel.zero_stage=2", "parallel.activation_checkpoint=selective"}, name);
    expect_same(style, {"parallel.cp=2", "parallel.pp=2", "parallel.microbatches=4"}, name, 1);
  }
  expect_same(moe, {"parallel.cp=2", "parallel.ep=2"}, "llama-moe");
  expect_same(moe, {"parallel.cp=2", "parallel.ep=2", "parallel.zero_stage=1"}, "llama-moe");
}

// ZeRO-2 over fsdp 2 x cp 2 while rank 2 lags in its last block's gradient hook: its fsdp peer
// (rank 0) then finds that block's reduce-scatter unfinished and goes on into the next blocks'
// attention exchange over cp, while rank 0's cp peer (rank 1, whose reduce-scatter partner did
// not lag) has it finished. A fold that all-reduced over cp as soon as it found the reduction
// done would meet rank 0's attention exchange, and the job would hang; folds over replicas
// come at the same count on every rank, and the step equals one process.
TEST_F(ContextParallelTest, ZeroFoldsMeetWhenOneRankLags) {
  if (world()->size() != 4) GTEST_SKIP() << "run at 4 ranks";
  layers_ = 3;
  for (const std::string& impl : {"all_to_all", "ring"}) {
    const Overrides layout = {"parallel.cp=2", "parallel.cp_impl=" + impl, "parallel.zero_stage=2"};
    const TrainConfig split = config(4, 2, "", with(kGpt2Style, layout));
    Trainer parallel(split, world());
    const OneProcessRun& single = one_process_of(split.micro_batch, kGpt2Style, 2);
    if (world()->rank() == 2) {
      for (const auto& item : parallel.model()->named_parameters()) {
        if (item.key().rfind("blocks.2.", 0) != 0) continue;
        item.value().register_hook([](const at::Tensor&) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); });
        break;
      }
    }
    expect_same_training(parallel, single, 2, "rank 2 lagging, " + impl);
  }
}

// bfloat16 autocast: the attention across ranks stays in float32 (its backward recomputes the
// scores from the forward's log-sum-exp), so the losses follow one process's bf16 run within
// bf16's rounding of the rest of the model.
TEST_F(ContextParallelTest, BfloatSixteenFollowsOneProcess) {
  const int n = world()->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "run at 2 and 4 ranks";
  for (const std::string& impl : {"ring", "all_to_all"}) {
    const Overrides bf16 = with(kLlamaStyle, {"training.dtype=bfloat16"});
    const TrainConfig split = config(n, 2, "", with(bf16, {"parallel.cp=2", "parallel.cp_impl=" + impl}));
    Trainer parallel(split, world());
    const OneProcessRun& single = one_process_of(2, bf16, 3);
    for (int s = 0; s < 3; ++s) {
      const StepResult got = parallel.step(), &want = single.steps[s];
      EXPECT_NEAR(got.loss, want.loss, 1e-2 * want.loss) << impl << ", step " << s + 1;
      EXPECT_NEAR(got.grad_norm, want.grad_norm, 5e-2 * want.grad_norm) << impl << ", step " << s + 1;
    }
  }
}

// A checkpoint saved at cp 2 resumes at cp 1 (and the other way) and continues one process's losses.
TEST_F(ContextParallelTest, CheckpointsReshardAcrossContextParallelSizes) {
  const int n = world()->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "run at 2 and 4 ranks";
  const std::vector<Overrides> layouts = {{"parallel.cp=2"}, {"parallel.cp=1"}, {"parallel.cp=" + std::to_string(n)}};
  const int64_t micro = 2, steps = 2;
  const std::vector<double> want = one_process(config(1, micro, "", kLlamaStyle), steps * 3).losses();
  const std::string checkpoints = util::join_path(dir_, "reshard-cp");
  for (size_t i = 0; i < layouts.size(); ++i) {
    Trainer trainer(config(n, micro, checkpoints, with(kLlamaStyle, layouts[i])), world());
    if (i > 0) ASSERT_TRUE(trainer.resumed());
    for (int64_t s = i * steps; s < static_cast<int64_t>(i + 1) * steps; ++s) {
      EXPECT_NEAR(trainer.step().loss, want[s], 1e-5 * want[s]) << describe(layouts[i]) << ", step " << s + 1;
    }
    trainer.save_checkpoint();
    trainer.finish_checkpoints();
  }
}

TEST_F(ContextParallelTest, RefusesWhatItCannotSplit) {
  if (world()->size() != 2) GTEST_SKIP() << "run at 2 ranks";
  auto refused = [&](const Overrides& overrides, const std::string& expected) {
    try {
      config(2, 2, "", overrides);
      ADD_FAILURE() << describe(overrides) << " was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  refused({"parallel.cp=2", "parallel.cp_impl=all_to_all", "model.heads=4", "model.kv_heads=1"},
          "both head counts (heads / tp = 4, key/value heads / tp = 1) must be multiples of cp");
  refused({"parallel.cp=2", "parallel.cp_impl=hybrid"}, "needs cp >= 4");
  refused({"parallel.cp=2", "parallel.cp_a2a=2"}, "cp_impl = \"hybrid\" only");
  refused({"parallel.cp=2", "model.dropout=0.1"}, "context parallel attention has no dropout");
  refused({"parallel.cp=4"}, "does not divide the world size 2");
}

}  // namespace
}  // namespace meshtrain::train
