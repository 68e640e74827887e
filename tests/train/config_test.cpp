// Config: TOML + overrides, and every rejection names the key, the value and what is allowed.
#include "meshtrain/train/config.h"

#include "tests/harness/error_of.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

namespace meshtrain::train {
namespace {

std::string write_config(const std::string& text) {
  char path[] = "/tmp/meshtrain-config-XXXXXX.toml";
  const int fd = mkstemps(path, 5);
  std::ofstream(path) << text;
  close(fd);
  return path;
}

TEST(TrainConfig, DefaultsValidateAndDeriveAccumulation) {
  TrainConfig c = TrainConfig::load("", {});
  c.validate(2);
  EXPECT_EQ(c.preset, "small");
  EXPECT_EQ(c.parallel.dims.dp, 2);
  EXPECT_EQ(c.grad_accum, 1);  // 16 / (8 x 2)
  c = TrainConfig::load("", {"training.micro_batch=2"});
  c.validate(2);
  EXPECT_EQ(c.grad_accum, 4);
}

TEST(TrainConfig, ShardedAxesFillTheWorld) {
  auto axes = [](std::vector<std::string> overrides, int world) {
    TrainConfig c = TrainConfig::load("", overrides);
    c.validate(world);
    return std::vector<int64_t>{c.parallel.dims.dp, c.parallel.dims.fsdp, c.grad_accum};
  };
  EXPECT_EQ(axes({"parallel.zero_stage=3", "training.batch=32", "training.micro_batch=2"}, 4),
            (std::vector<int64_t>{1, 4, 4}));
  EXPECT_EQ(axes({"parallel.zero_stage=3", "parallel.dp=2", "training.batch=32", "training.micro_batch=2"}, 4),
            (std::vector<int64_t>{2, 2, 4}));
  EXPECT_EQ(axes({"parallel.zero_stage=1", "parallel.fsdp=2", "training.batch=32", "training.micro_batch=2"}, 4),
            (std::vector<int64_t>{2, 2, 4}));
  EXPECT_EQ(axes({"training.batch=32", "training.micro_batch=2"}, 4), (std::vector<int64_t>{4, 1, 4}));
  // tp takes its ranks first; the others share the rest.
  EXPECT_EQ(axes({"parallel.tp=2", "training.batch=32", "training.micro_batch=2"}, 4), (std::vector<int64_t>{2, 1, 8}));
  EXPECT_EQ(axes({"parallel.tp=4", "model.heads=8", "parallel.zero_stage=3", "training.batch=32", "training.micro_batch=2"}, 8),
            (std::vector<int64_t>{1, 2, 8}));
}

TEST(TrainConfig, FileThenOverridesPresetFirst) {
  const std::string path = write_config(
      "[model]\nlayers = 3\npreset = \"tiny\"\n[training]\nsteps = 7\nlr = 3e-4\n[data]\ntext = \"/tmp\"\n");
  TrainConfig c = TrainConfig::load(path, {"training.steps=9", "model.width=128"});
  EXPECT_EQ(c.model.layers, 3);     // the file's key applies on top of its preset
  EXPECT_EQ(c.model.heads, 4);      // from tiny
  EXPECT_EQ(c.model.width, 128);    // override
  EXPECT_EQ(c.steps, 9);
  EXPECT_DOUBLE_EQ(c.lr, 3e-4);
  EXPECT_EQ(c.text, std::vector<std::string>{"/tmp"});
  // A preset override resets the shape before the other model overrides apply.
  c = TrainConfig::load(path, {"model.layers=5", "model.preset=small"});
  EXPECT_EQ(c.model.layers, 5);
  EXPECT_EQ(c.model.width, 384);
  std::remove(path.c_str());
}

TEST(TrainConfig, ToTomlReadsBackAsTheSameConfig) {
  const std::vector<std::vector<std::string>> configs = {
      {},
      {"model.preset=tiny", "model.layers=3", "training.batch=12", "training.micro_batch=2", "parallel.tp=2",
       "parallel.zero_stage=3", "parallel.sequence_parallel=true", "data.text=[\"/tmp/a\", \"/tmp/b\"]"},
      {"model.preset=llama3.2-1b", "model.init_std=0.01", "lora.rank=4", "lora.targets=[\"q\", \"v\"]",
       "training.dtype=bfloat16", "offload.optimizer=cpu", "parallel.zero_stage=2"},
      {"model.layers=2", "model.width=64", "model.heads=2", "run.out=runs/x"},  // the default preset's shape, edited
  };
  for (const auto& overrides : configs) {
    const TrainConfig c = TrainConfig::load("", overrides);
    const std::string toml = c.to_toml();
    const std::string path = write_config(toml);
    const TrainConfig back = TrainConfig::load(path, {});
    std::remove(path.c_str());
    EXPECT_EQ(back.to_toml(), toml);
    EXPECT_EQ(back.to_toml(/*every_key=*/true), c.to_toml(true)) << toml;
  }
  // Only what differs is written: a preset's own shape is its name.
  EXPECT_EQ(TrainConfig::load("", {"model.preset=tiny"}).to_toml(), "[model]\npreset = \"tiny\"\n");
}

TEST(TrainConfig, UnknownKeysAndWrongTypesAreRejectedWithTheKey) {
  const std::string path = write_config("[training]\nstepz = 3\n");
  EXPECT_NE(testing::error_of<ConfigError>([&] { TrainConfig::load(path, {}); }).find(": unknown key training.stepz (did you mean training.steps?); keys of [training] are steps, batch"),
            std::string::npos);
  std::remove(path.c_str());
  const std::string section = write_config("[trainig]\nsteps = 3\n");
  EXPECT_NE(testing::error_of<ConfigError>([&] { TrainConfig::load(section, {}); }).find("unknown section [trainig] (did you mean training.steps?); sections are [model], [data]"),
            std::string::npos);
  std::remove(section.c_str());
  // A key of another section, and a stranger: named, and nothing made up.
  EXPECT_NE(testing::error_of<ConfigError>([] { TrainConfig::load("", {"training.zero_stage=1"}); })
                .find("unknown key training.zero_stage (did you mean parallel.zero_stage?)"),
            std::string::npos);
  EXPECT_EQ(testing::error_of<ConfigError>([] { TrainConfig::load("", {"training.colour=1"}); }).find("did you mean"),
            std::string::npos);
  EXPECT_EQ(testing::error_of<ConfigError>([] { TrainConfig::load("", {"training.steps=ten"}); }),
            "override --training.steps=ten: training.steps = ten must be an integer");
  EXPECT_EQ(testing::error_of<ConfigError>([] { TrainConfig::load("", {"training.steps=2.5"}); }),
            "override --training.steps=2.5: training.steps = 2.5 must be an integer");
  EXPECT_NE(testing::error_of<ConfigError>([] { TrainConfig::load("", {"training.steps"}); }).find("write overrides as --section.key=value"),
            std::string::npos);
  EXPECT_NE(testing::error_of<ConfigError>([] { TrainConfig::load("", {"model.preset=huge"}); }).find("unknown model preset 'huge'"),
            std::string::npos);
  const std::string broken = write_config("[training\nsteps = 3\n");
  EXPECT_NE(testing::error_of<ConfigError>([&] { TrainConfig::load(broken, {}); }).find("config " + broken + ":1:"), std::string::npos);
  std::remove(broken.c_str());
}

TEST(TrainConfig, ImpossibleValuesAreRejectedBeforeTraining) {
  auto validated = [](std::vector<std::string> overrides, int world) {
    return testing::error_of<ConfigError>([&] { TrainConfig::load("", overrides).validate(world); });
  };
  EXPECT_EQ(validated({"training.batch=10"}, 2),
            "training.batch = 10: must be divisible by training.micro_batch (8) x dp (2) x fsdp (1) = 16; use training.batch = 16, "
            "or training.micro_batch = 5");
  EXPECT_EQ(validated({"parallel.dp=3"}, 2),
            "parallel.dp = 3: dp(3) * fsdp(1) = 3 != the 2 data ranks (world size 2 / (pp(1) * ep(1) * tp(1)))");
  EXPECT_EQ(validated({"parallel.zero_stage=3", "parallel.fsdp=3"}, 4),
            "parallel.fsdp = 3: fsdp(3) does not divide the 4 data ranks (world size 4 / (pp(1) * ep(1) * tp(1)))");
  EXPECT_EQ(validated({"parallel.fsdp=2"}, 2),
            "parallel.fsdp = 2: shards need zero_stage >= 1 (zero_stage 0 is plain data parallel)");
  EXPECT_EQ(validated({"parallel.zero_stage=4"}, 2), "parallel.zero_stage = 4: must be 0, 1, 2 or 3");
  // Tensor parallel: what must divide, said before any rank starts.
  EXPECT_EQ(validated({"parallel.tp=3"}, 3),
            "parallel.tp = 3: tp(3) does not divide the vocabulary (256); the embedding and head are split by vocabulary "
            "rows (not padded: padding would change the model)");
  EXPECT_EQ(validated({"parallel.tp=8"}, 8),
            "parallel.tp = 8: tp(8) does not divide the attention heads (6); attention is split by heads");
  EXPECT_EQ(validated({"parallel.tp=4"}, 2),
            "parallel.tp = 4: pp(1) * ep(1) * tp(4) = 4 does not divide the world size 2");
  EXPECT_EQ(validated({"parallel.sequence_parallel=true"}, 2), "parallel.sequence_parallel = true: needs tp > 1");
  // Mixture of experts and expert parallel.
  EXPECT_EQ(validated({"parallel.ep=2"}, 2),
            "parallel.ep = 2: expert parallel needs a mixture-of-experts model (model.moe_experts > 0)");
  EXPECT_EQ(validated({"model.moe_experts=8", "parallel.ep=3"}, 3),
            "parallel.ep = 3: ep(3) does not divide model.moe_experts (8); every rank holds moe_experts / ep experts");
  EXPECT_EQ(validated({"model.moe_experts=8", "parallel.ep=2"}, 3),
            "parallel.ep = 2: pp(1) * ep(2) * tp(1) = 2 does not divide the world size 3");
  EXPECT_EQ(validated({"model.moe_experts=1", "model.moe_top_k=2"}, 1),
            "model.moe_top_k = 2 is not allowed: must be in [1, model.moe_experts (1)]");
  EXPECT_EQ(validated({"model.moe_experts=8", "parallel.ep=2", "parallel.zero_stage=3"}, 2), "no error");
  EXPECT_EQ(validated({"model.moe_experts=8", "parallel.ep=2", "parallel.zero_stage=2"}, 2), "no error");
  EXPECT_EQ(validated({"model.moe_experts=8", "parallel.ep=2", "training.batch=24"}, 4),
            "training.batch = 24: must be divisible by training.micro_batch (8) x dp (2) x fsdp (1) x ep (2) = 32; "
            "use training.batch = 32, or training.micro_batch = 6");
  EXPECT_EQ(validated({"model.moe_experts=4", "parallel.tp=2"}, 2), "no error");  // tensor parallel of MoE models
  EXPECT_EQ(validated({"parallel.tp=2", "parallel.sequence_parallel=true", "model.context=101"}, 2),
            "parallel.tp = 2: tp(2) does not divide the context (101); sequence parallel splits every sequence into tp "
            "chunks");
  EXPECT_EQ(validated({"parallel.tp=2", "parallel.dp=2"}, 2),
            "parallel.dp = 2: dp(2) * fsdp(1) = 2 != the 1 data ranks (world size 2 / (pp(1) * ep(1) * tp(2)))");
  EXPECT_EQ(validated({"parallel.pp=2", "parallel.dp=2"}, 2),
            "parallel.dp = 2: dp(2) * fsdp(1) = 2 != the 1 data ranks (world size 2 / (pp(2) * ep(1) * tp(1)))");
  EXPECT_EQ(validated({"parallel.pp=3"}, 4), "parallel.pp = 3: pp(3) * ep(1) * tp(1) = 3 does not divide the world size 4");
  EXPECT_EQ(validated({"parallel.pp=2", "parallel.zero_stage=3"}, 2),
            "parallel.zero_stage = 3: does not combine with pp(2) > 1 (every micro-batch would gather every stage's "
            "parameters again); use zero_stage 1 or 2 with pipelines");
  EXPECT_EQ(validated({"parallel.pp=2", "parallel.pp_schedule=zigzag"}, 2),
            "parallel.pp_schedule = \"zigzag\": use \"gpipe\", \"1f1b\" or \"interleaved\"");
  EXPECT_EQ(validated({"parallel.pp=2", "parallel.virtual_stages=2"}, 2),
            "parallel.virtual_stages = 2: needs pp_schedule = \"interleaved\"");
  EXPECT_EQ(validated({"parallel.pp=2", "parallel.pp_schedule=interleaved"}, 2),
            "parallel.virtual_stages = 1: pp_schedule = \"interleaved\" needs virtual_stages >= 2 (with one stage per "
            "rank it is 1f1b)");
  EXPECT_EQ(validated({"parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.virtual_stages=2",
                       "parallel.microbatches=3", "training.batch=6"}, 2),
            "parallel.microbatches = 3: the interleaved schedule needs micro-batches per step divisible by pp(2)");
  EXPECT_EQ(validated({"parallel.activation_checkpoint=most"}, 1),
            "parallel.activation_checkpoint = \"most\": use \"none\", \"full\" or \"selective\"");
  EXPECT_EQ(validated({"parallel.param_dtype=bfloat16"}, 2),
            "parallel.param_dtype = \"bfloat16\": applies to parallel.zero_stage >= 1; for data parallel use training.dtype");
  EXPECT_EQ(validated({"parallel.zero_stage=2", "parallel.reduce_dtype=float16"}, 2),
            "parallel.reduce_dtype = \"float16\": use \"float32\" or \"bfloat16\"");
  EXPECT_EQ(validated({"parallel.zero_stage=3", "parallel.unit_policy=layer"}, 2),
            "parallel.unit_policy = \"layer\": use \"block\" or \"model\"");
  EXPECT_EQ(validated({"memory.limit_mb=-1"}, 2), "memory.limit_mb = -1: must be >= 0 (0: no limit)");
  EXPECT_EQ(validated({"model.heads=5"}, 1), "model.width = 384 is not allowed: must be a positive multiple of model.heads (5)");
  EXPECT_EQ(validated({"training.dtype=float8"}, 1), "training.dtype = \"float8\": use \"float32\" or \"bfloat16\"");
  EXPECT_EQ(validated({"training.min_lr=1"}, 1), "training.min_lr = 1.000000: must be in [0, training.lr]");
  // An lr below the default min_lr (fine-tuning) needs no min_lr: unset, it is a tenth of lr.
  EXPECT_EQ(validated({"training.lr=2e-5"}, 1), "no error");
  EXPECT_DOUBLE_EQ(TrainConfig::load("", {"training.lr=2e-5"}).min_lr, 2e-6);
  EXPECT_DOUBLE_EQ(TrainConfig::load("", {}).min_lr, 1e-4);
  // to_toml writes min_lr where it is not lr's tenth, so that the file reads back as the same schedule.
  for (const auto& overrides : std::vector<std::vector<std::string>>{{"training.lr=3e-4", "training.min_lr=1e-4"},
                                                                      {"training.lr=3e-4"}}) {
    const TrainConfig c = TrainConfig::load("", overrides);
    const std::string path = ::testing::TempDir() + "/min_lr.toml";
    std::ofstream(path) << c.to_toml();
    EXPECT_DOUBLE_EQ(TrainConfig::load(path, {}).min_lr, c.min_lr) << c.to_toml();
  }
  EXPECT_EQ(validated({"data.train_file=/x.bin"}, 1),
            "data.train_file = \"/x.bin\": give both data.train_file and data.val_file, or neither (then data.text is prepared)");
  EXPECT_EQ(validated({"model.vocab_size=300"}, 1),
            "model.vocab_size = 300: text is prepared with the byte tokenizer, which has 256 tokens; use 256, name a "
            "larger tokenizer (data.tokenizer), or give token files (data.train_file, data.val_file) of a larger "
            "vocabulary");
  EXPECT_EQ(validated({"model.vocab_size=300", "data.tokenizer=sp.model"}, 1), "no error");
}

TEST(TrainConfig, HelpListsEveryKeyWithItsDefault) {
  const std::string keys = TrainConfig::describe_keys();
  for (const char* line : {"[model]", "preset = \"small\"", "[training]", "steps = 100", "[parallel]", "bucket_mb = 25",
                           "[checkpoint]", "resume = true", "[run]"}) {
    EXPECT_NE(keys.find(line), std::string::npos) << line;
  }
}

}  // namespace
}  // namespace meshtrain::train
