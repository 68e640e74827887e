// LoRA in every layout under mpirun (Note [LoRA]): adapters on a frozen
// model train as in one process (loss and gradient norm every step, every
// parameter after) under data parallel, ZeRO-1/2/3, tensor parallel (B or A
// split with the base layer), sequence parallel, the pipeline and activation
// checkpointing; the base stays bit-identical; only the adapters carry
// optimizer state; checkpoints hold the adapters alone and resume.
#include "meshtrain/parallel/parallel_state.h"
#include "tests/parallel/training_fixture.h"

namespace meshtrain::train {
namespace {

class LoraTest : public TrainingTest {};

std::vector<Overrides> lora_layouts(int ranks) {
  std::vector<Overrides> out = {{},
                                {"parallel.zero_stage=1"},
                                {"parallel.zero_stage=2"},
                                {"parallel.zero_stage=3"},
                                {"parallel.zero_stage=3", "parallel.activation_checkpoint=full"}};
  if (ranks % 2 == 0) {
    out.push_back({"parallel.tp=2"});
    out.push_back({"parallel.tp=2", "parallel.sequence_parallel=true"});
    out.push_back({"parallel.pp=2", "parallel.microbatches=4"});
  }
  if (ranks == 4) out.push_back({"parallel.tp=2", "parallel.zero_stage=3"});
  return out;
}

// The model's own parameters, as the seed makes them (what the base must still be).
std::map<std::string, at::Tensor> initial_base(const TrainConfig& c) {
  std::map<std::string, at::Tensor> out;
  model::Gpt gpt(c.model, c.seed);
  for (const auto& item : gpt->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

TEST_F(LoraTest, AdaptersTrainInEveryLayoutAsInOneProcessAndTheBaseStaysBitIdentical) {
  const int n = world()->size();
  if (n < 2 || n > 4) GTEST_SKIP() << "run at 2, 3 and 4 ranks";
  // Llama style with grouped-query attention (q, k, v laid out by group in
  // the fused qkv), and GPT-2 style (thirds, a GELU MLP, a tied embedding).
  const Overrides llama = {"model.norm=rmsnorm", "model.position=rope", "model.mlp=swiglu", "model.bias=false",
                           "model.tie_embeddings=false", "model.kv_heads=2", "lora.rank=4", "lora.alpha=8"};
  const Overrides gpt2 = {"lora.rank=2", "lora.alpha=4", "lora.targets=[\"q\",\"v\",\"o\",\"up\",\"down\"]"};
  for (const Overrides& style : {llama, gpt2}) {
    for (Overrides layout : lora_layouts(n)) {
      const bool pipelined = !layout.empty() && layout.front().rfind("parallel.pp", 0) == 0;
      layout.insert(layout.end(), style.begin(), style.end());
      const TrainConfig split = config(n, pipelined ? 1 : 2, "", layout);
      Trainer parallel(split, world());
      const std::string what = describe(layout) + " on " + std::to_string(n) + " ranks";
      expect_same_training(parallel, one_process_of(split.micro_batch * split.data_ranks(), style, 3), 3, what);
      const std::map<std::string, at::Tensor> after = parallel.full_parameters();
      int64_t adapters = 0;
      for (const auto& [name, value] : initial_base(split)) {
        ASSERT_TRUE(after.count(name)) << what << ": " << name;
        EXPECT_TRUE(at::equal(after.at(name).cpu(), value)) << what << ": base parameter " << name << " changed";
      }
      for (const auto& [name, value] : after) {
        if (!model::is_lora_parameter(name)) continue;
        ++adapters;
        if (name.back() == 'B') EXPECT_GT(value.abs().max().item<double>(), 0) << what << ": " << name << " did not train";
      }
      EXPECT_EQ(adapters, split.model.layers * 2 * static_cast<int64_t>(split.lora.targets.size())) << what;
      // What a checkpoint holds: the adapters and their AdamW moments only.
      for (const placement::StateTensor& t : parallel::training_state(parallel.parts())) {
        if (t.name.rfind("rng/", 0) == 0) continue;
        EXPECT_TRUE(model::is_lora_parameter(t.name)) << what << ": the training state holds " << t.name;
      }
    }
  }
}

// lora.base_dtype = "bfloat16" under bf16 autocast: the frozen matrices kept
// in bf16 train exactly as fp32 ones cast by autocast, in half the memory.
TEST_F(LoraTest, BfloatBaseTrainsAsTheAutocastFloatBase) {
  const int n = world()->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "run at 2 and 4 ranks";
  const Overrides llama = {"model.norm=rmsnorm", "model.position=rope", "model.mlp=swiglu", "model.bias=false",
                           "model.tie_embeddings=false", "model.kv_heads=2", "lora.rank=4", "training.dtype=bfloat16"};
  for (const Overrides& layout : std::vector<Overrides>{{}, {"parallel.zero_stage=3"}, {"parallel.tp=2"},
                                                         {"parallel.pp=2", "parallel.microbatches=4"}}) {
    Overrides bf16 = llama, fp32 = llama;
    bf16.insert(bf16.end(), layout.begin(), layout.end());
    fp32.insert(fp32.end(), layout.begin(), layout.end());
    bf16.push_back("lora.base_dtype=bfloat16");
    const bool pipelined = !layout.empty() && layout.front().rfind("parallel.pp", 0) == 0;
    Trainer low(config(n, pipelined ? 1 : 2, "", bf16), world()), full(config(n, pipelined ? 1 : 2, "", fp32), world());
    StepResult a, b;
    for (int s = 0; s < 3; ++s) {
      a = low.step(), b = full.step();
      EXPECT_NEAR(a.loss, b.loss, 1e-6 * b.loss) << describe(layout) << " step " << s + 1;
      EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-5 * b.grad_norm) << describe(layout) << " step " << s + 1;
    }
    // The blocks' frozen matrices are bf16 (views of a bf16 unit under ZeRO-3); nothing that trains is.
    auto bytes = [](Trainer& t, bool blocks_only) {
      int64_t total = 0;
      for (const auto& item : t.model()->named_parameters()) {
        if (blocks_only && item.key().rfind("blocks.", 0) != 0) continue;
        total += item.value().numel() * static_cast<int64_t>(item.value().element_size());
      }
      return total;
    };
    for (const auto& item : low.model()->named_parameters()) {
      const bool matrix = item.key().rfind("blocks.", 0) == 0 && item.value().dim() == 2 && !model::is_lora_parameter(item.key());
      EXPECT_EQ(item.value().scalar_type(), matrix ? at::kBFloat16 : at::kFloat) << describe(layout) << ": " << item.key();
    }
    EXPECT_LT(bytes(low, true), 0.6 * bytes(full, true)) << describe(layout);
  }
}

TEST_F(LoraTest, AdapterCheckpointsResumeIntoAnotherLayout) {
  const int n = world()->size();
  if (n != 2 && n != 4) GTEST_SKIP() << "run at 2 and 4 ranks";
  const Overrides llama = {"model.norm=rmsnorm", "model.position=rope", "model.mlp=swiglu", "model.bias=false",
                           "model.tie_embeddings=false", "lora.rank=4", "checkpoint.every=2", "checkpoint.async=false"};
  const std::string checkpoints = util::join_path(dir_, "lora-checkpoints");
  Overrides sharded = llama;
  sharded.push_back("parallel.zero_stage=3");
  TrainConfig first = config(n, 2, checkpoints, sharded);
  Trainer a(first, world());
  for (int s = 0; s < 2; ++s) a.step();
  a.save_checkpoint();
  a.finish_checkpoints();
  const std::map<std::string, at::Tensor> saved = a.full_parameters();
  Overrides tensor = llama;
  tensor.push_back("parallel.tp=2");
  Trainer b(config(n, 2, checkpoints, tensor), world());
  ASSERT_TRUE(b.resumed());
  EXPECT_EQ(b.completed_steps(), 2);
  const auto [relative, largest] = parameter_errors(b.full_parameters(), saved);
  EXPECT_EQ(largest, 0.0) << "adapters resumed under tp 2 differ from those saved under ZeRO-3";
  // Every file of the checkpoint together is about the adapters' size, not the model's.
  int64_t bytes = 0;
  const std::string folder = checkpoint::CheckpointStore::resolve(checkpoints);
  for (const std::string& f : util::list_directory(folder)) bytes += util::file_size(util::join_path(folder, f));
  const int64_t adapters = first.lora.parameter_count(first.model);
  EXPECT_LT(bytes, 3 * 4 * adapters + (64 << 10)) << "an adapter checkpoint of " << bytes << " bytes";
  EXPECT_GT(first.model.parameter_count(), 3 * adapters);  // so the bound above says something
}

}  // namespace
}  // namespace meshtrain::train
