// ParallelSpec: typed keys read once, every rule in check(), the one-line
// form the planner shares; and the random streams seeded the same way for
// any device.
#include "meshtrain/parallel/parallel_spec.h"
#include "meshtrain/parallel/random_streams.h"
#include "meshtrain/train/config.h"

#include "tests/harness/error_of.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

namespace meshtrain::parallel {
namespace {

using testing::error_of;

model::GptConfig tiny() { return model::GptConfig::preset("tiny"); }

// A spec from [parallel] / [offload] overrides, as a config file gives it.
ParallelSpec spec_of(const std::vector<std::string>& overrides) {
  return train::TrainConfig::load("", overrides).parallel;
}

std::string checked(std::vector<std::string> overrides, int64_t world, Compute compute = {}) {
  return error_of([&] { spec_of(overrides).check(world, tiny(), compute); });
}

TEST(ParallelSpec, KeysAreReadTyped) {
  const ParallelSpec s = spec_of({"parallel.activation_checkpoint=selective", "parallel.unit_policy=model",
                                  "parallel.param_dtype=bfloat16", "parallel.zero1_reduce=reduce_scatter",
                                  "parallel.tp_impl=annotations", "offload.optimizer=nvme", "offload.params=cpu",
                                  "parallel.pp_schedule=gpipe", "parallel.pp_split=3,1"});
  EXPECT_EQ(s.activation_checkpoint, CheckpointMode::kSelective);
  EXPECT_EQ(s.unit_policy, ShardUnits::kModel);
  EXPECT_EQ(s.param_dtype, at::kBFloat16);
  EXPECT_EQ(s.reduce_dtype, at::kFloat);
  EXPECT_EQ(s.zero1_reduce, Zero1Reduce::kReduceScatter);
  EXPECT_TRUE(s.annotated());
  EXPECT_EQ(s.offload_optimizer, offload::Tier::kNvme);
  EXPECT_EQ(s.offload_params, offload::Tier::kHost);
  EXPECT_EQ(s.dims.schedule, mesh::PipelineSchedule::kGpipe);
  EXPECT_EQ(s.pp_split.kind, StageSplit::Kind::kBlocks);
  EXPECT_EQ(s.pp_split.blocks, (std::vector<int64_t>{3, 1}));
  // A wrong name is refused as it is read, naming the key, the value and the names.
  EXPECT_EQ(error_of([] { spec_of({"offload.params=disk"}); }), "offload.params = \"disk\": use \"none\", \"cpu\" or \"nvme\"");
  EXPECT_EQ(error_of([] { spec_of({"parallel.pp_split=3,x"}); }),
            "parallel.pp_split = \"3,x\": '3,x' is not a list of block counts per stage (each >= 1), like \"3,3,2\"");
}

TEST(ParallelSpec, CheckHoldsTheRulesOfEveryKnob) {
  EXPECT_EQ(checked({"parallel.zero_stage=3", "offload.optimizer=cpu", "offload.params=cpu"}, 2), "no error");
  EXPECT_EQ(checked({"offload.optimizer=cpu"}, 2),
            "offload.optimizer = \"cpu\": needs parallel.zero_stage >= 1 (the sharded optimizer)");
  EXPECT_EQ(checked({"parallel.zero_stage=2", "offload.optimizer=cpu", "offload.params=nvme"}, 2),
            "offload.params = \"nvme\": needs parallel.zero_stage = 3 (sharded parameters)");
  EXPECT_EQ(checked({"parallel.zero_stage=3", "offload.params=cpu"}, 2),
            "offload.params = \"cpu\": needs offload.optimizer = \"cpu\" or \"nvme\" as well");
  EXPECT_EQ(checked({"parallel.tp=2", "parallel.tp_impl=annotations"}, 2, {true, true}),
            "parallel.tp_impl = \"annotations\": does not combine with bfloat16 autocast yet; use tp_impl = \"plan\"");
  EXPECT_EQ(checked({"parallel.tp=2", "parallel.tp_impl=annotations"}, 2, {false, false}),
            "parallel.tp_impl = \"annotations\": does not combine with a GPU device yet; use tp_impl = \"plan\"");
  EXPECT_EQ(checked({"parallel.pp=2", "parallel.pp_split=3,2"}, 2),
            "parallel.pp_split = \"3,2\": '3,2' places 5 blocks, the model has 4");
  EXPECT_EQ(checked({"parallel.activation_checkpoint_every=0"}, 1), "parallel.activation_checkpoint_every = 0: must be >= 1");
  EXPECT_EQ(checked({"parallel.bucket_mb=0"}, 1), "parallel.bucket_mb = 0: must be >= 1");
  EXPECT_EQ(checked({"parallel.first_bucket_mb=0"}, 1), "parallel.first_bucket_mb = 0: must be >= 1");
  // Degrees left at 0 are resolved; the value a rule quotes is the one given.
  ParallelSpec s = spec_of({"parallel.zero_stage=3", "parallel.dp=2"});
  s.check(8, tiny());
  EXPECT_EQ(s.dims.fsdp, 4);
  EXPECT_EQ(checked({"parallel.dp=3"}, 4),
            "parallel.dp = 3: dp(3) * fsdp(1) = 3 != the 4 data ranks (world size 4 / (pp(1) * ep(1) * tp(1)))");
}

// Note [Inference layout]: generate and serve read the same keys, every rank on tp or cp.
TEST(ParallelSpec, InferenceLayoutPutsEveryRankOnTpOrCp) {
  auto inference = [](const std::vector<std::string>& overrides, int64_t world) {
    return error_of([&] { spec_of(overrides).check_inference(world, "generate"); });
  };
  EXPECT_EQ(inference({}, 1), "no error");
  EXPECT_EQ(inference({"parallel.tp=2"}, 2), "no error");
  EXPECT_EQ(inference({"parallel.cp=4"}, 4), "no error");
  EXPECT_EQ(inference({"parallel.tp=2"}, 4),
            "parallel.tp = 2: the job runs 4 rank(s) and generate puts every rank on tp; launch 2 "
            "(meshtrain run -n 2 generate --parallel.tp=2 ...)");
  EXPECT_EQ(inference({"parallel.tp=2", "parallel.cp=2"}, 4),
            "parallel.cp = 2: generate splits the model (parallel.tp) or the KV cache (parallel.cp) over all ranks "
            "of the job; use one of them");
  EXPECT_EQ(inference({"parallel.pp=2"}, 1), "parallel.pp = (set): generate splits only by parallel.tp or parallel.cp");
  ParallelSpec s = spec_of({"parallel.tp=2"});
  s.check_inference(2, "serve");
  EXPECT_EQ(s.dims.world(), 2);
}

TEST(ParallelSpec, BatchShapeFollowsTheDataRanks) {
  ParallelSpec s = spec_of({"parallel.pp=2", "parallel.microbatches=4"});
  s.check(4, tiny());
  const ParallelSpec::BatchShape shape = s.batch_shape(16, 99);
  EXPECT_EQ(shape.micro_batch, 2);  // 16 / (4 micro-batches x 2 data ranks)
  EXPECT_EQ(shape.microbatches, 4);
  EXPECT_EQ(error_of([&] { s.batch_shape(12, 1); }),
            "parallel.microbatches = 4: training.batch (12) must be divisible by microbatches x dp (2) x fsdp (1) = 8");
}

TEST(ParallelSpec, OneLineFormRoundTrips) {
  for (const std::string text : {"dp=1", "pp=2 1f1b tp=4 sp zero=1 fsdp=8", "pp=4 interleaved v=2 dp=2",
                                 "dp=2 ep=4 zero=2 fsdp=2 recompute=full", "zero=3 fsdp=8 recompute=selective offload=parameters",
                                 "tp=2 zero=1 fsdp=2 offload=optimizer"}) {
    EXPECT_EQ(ParallelSpec::parse(text).str(), text);
  }
  const ParallelSpec s = ParallelSpec::parse("zero=3 dp=8");  // shards, as ZeRO speaks of them
  EXPECT_EQ(s.dims.fsdp, 8);
  EXPECT_EQ(s.dims.dp, 1);
  EXPECT_EQ(s.str(4), "zero=3 fsdp=8 mb=4");
  EXPECT_NE(error_of([] { ParallelSpec::parse("mb=2"); }).find("layout key 'mb' unknown"), std::string::npos);
}

TEST(ParallelSpec, ModelDimsAreTheModelsOwn) {
  model::GptConfig c = model::GptConfig::preset("llama-tiny");
  c.kv_heads = 2;
  c.moe_experts = 4;
  const mesh::ModelDims d = model_dims(c);
  EXPECT_EQ(d.layers, c.layers);
  EXPECT_EQ(d.heads, c.heads);
  EXPECT_EQ(d.kv_heads, 2);
  EXPECT_EQ(d.ffn, c.mlp_hidden());
  EXPECT_EQ(d.vocab, c.vocab_size);
  EXPECT_EQ(d.context, c.context);
  EXPECT_EQ(d.experts, 4);
}

// The default CPU generator set as a fresh generator of that seed would be.
TEST(RandomStreams, ReseedGivesFreshStatesAndRestoreReturnsToThem) {
  at::Tensor own;  // a per-rank stream, as tensor parallel keeps it
  RandomStream stream{[&] { return own.clone(); }, [&](const at::Tensor& s) { own = s.clone(); }};
  RandomStreams streams(at::kCPU, {{"tensor_parallel", stream, 3}});
  streams.reseed(1337, 5);
  const uint64_t moved = 1337 + 0x9e3779b97f4a7c15ULL * 6;
  EXPECT_TRUE(at::equal(at::detail::getDefaultCPUGenerator().get_state(),
                        at::make_generator<at::CPUGeneratorImpl>(moved).get_state()));
  EXPECT_TRUE(at::equal(own, at::make_generator<at::CPUGeneratorImpl>(RandomStreams::per_rank_seed(moved, 3)).get_state()));
  // A checkpoint's copies, then draws; restore() sets the generators back.
  placement::TrainingState state;
  streams.add_state(state, mesh::MeshLayout::from_degrees({{"dp", 1}}, 1));
  ASSERT_EQ(state.size(), 2u);
  EXPECT_EQ(state[0].name, "rng/cpu");
  EXPECT_EQ(state[1].name, "rng/tensor_parallel");
  const at::Tensor first = at::rand({8});
  own = at::zeros_like(own);
  streams.restore();
  EXPECT_TRUE(at::equal(at::rand({8}), first));
  EXPECT_TRUE(at::equal(own, state[1].local));
}

}  // namespace
}  // namespace meshtrain::parallel
