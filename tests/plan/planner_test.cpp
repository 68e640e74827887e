// The planner's formulas against the papers they come from, each computed
// here independently: parameter counts (Narayanan et al. 2021, Eq. 2, and the
// published Llama counts), model states (Rajbhandari et al. 2020), activations
// (Korthikanti et al. 2022, Eq. 1-6), training FLOPs (Narayanan et al., Eq. 3),
// pipeline stashes; layouts, the search and the machine profile.
#include "meshtrain/model/chunked_loss.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/parallel/expert_parallel.h"
#include "meshtrain/parallel/pipeline/schedule.h"
#include "meshtrain/plan/activation_memory.h"
#include "meshtrain/plan/from_config.h"
#include "meshtrain/plan/machines.h"
#include "meshtrain/plan/search.h"
#include "meshtrain/plan/shared_cores.h"
#include "tests/harness/error_of.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace meshtrain::plan {
namespace {

using testing::error_of;

// GPT-style shapes of several sizes (GELU MLP of 4h, learned positions, tied head).
std::vector<model::GptConfig> gpt_shapes() {
  std::vector<model::GptConfig> shapes = {model::GptConfig::preset("gpt2-350m"), model::GptConfig::preset("gpt2-1.5b"),
                                    model::GptConfig::preset("gpt3-175b"), model::GptConfig::preset("gpt-1t")};
  model::GptConfig odd = model::GptConfig::preset("gpt2-124m");
  odd.width = 1536, odd.ffn_hidden = 4 * 1536, odd.heads = 24, odd.layers = 7, odd.context = 3000;
  shapes.push_back(odd);
  return shapes;
}

TEST(PlanModel, ParameterCountsEqualTheBuiltModels) {
  for (const std::string name : {"tiny", "small", "llama-tiny", "gpt2-124m"}) {
    const model::GptConfig config = model::GptConfig::preset(name);
    model::Gpt gpt(config, 1);
    int64_t numel = 0;
    for (const auto& p : gpt->parameters()) numel += p.numel();
    EXPECT_EQ(model::GptConfig::preset(name).parameter_count(), numel) << name;
  }
}

TEST(PlanModel, ParameterCountsFollowNarayananEquationTwo) {
  for (const model::GptConfig& m : gpt_shapes()) {
    const double l = m.layers, h = m.width, V = m.vocab_size, s = m.context;
    const double eq2 = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h));
    // Eq. 2 leaves out the final LayerNorm (2h).
    EXPECT_NEAR(static_cast<double>(m.parameter_count()), eq2 + 2 * h, 1e-6 * eq2) << m.describe("model");
  }
  // Published counts of the Llama models.
  EXPECT_EQ(model::GptConfig::preset("llama2-7b").parameter_count(), 6738415616);
  EXPECT_EQ(model::GptConfig::preset("llama2-13b").parameter_count(), 13015864320);
  EXPECT_EQ(model::GptConfig::preset("llama2-70b").parameter_count(), 68976648192);
  EXPECT_EQ(model::GptConfig::preset("llama3-8b").parameter_count(), 8030261248);
  EXPECT_EQ(model::GptConfig::preset("llama3-70b").parameter_count(), 70553706496);
  EXPECT_NEAR(model::GptConfig::preset("gpt-1t").parameter_count() / 1e9, 1008, 1);  // Narayanan et al., Table 1
  EXPECT_NE(error_of([] { preset_model("gpt5"); }).find("unknown model 'gpt5'"), std::string::npos);
}

TEST(PlanModel, TrainingFlopsFollowNarayananEquationThree) {
  for (const model::GptConfig& m : gpt_shapes()) {
    const double B = 8, s = m.context, l = m.layers, h = m.width, V = m.vocab_size;
    // With full recompute (their setting): 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)).
    const double eq3 = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
    const double ours = B * (m.training_flops_per_sequence() + l * m.block_training_flops() / 3);
    EXPECT_NEAR(ours / eq3, 1.0, 1e-12) << m.describe("model");
    // Without recompute, three quarters of the blocks' share.
    EXPECT_NEAR(B * m.training_flops_per_sequence() / (eq3 - 24 * B * s * l * h * h * (1 + s / (6 * h))), 1.0, 1e-12);
  }
}

// Model states per rank: (2 + 2 + K)Ψ with K = 12 (mixed-precision Adam),
// divided over N shards as each ZeRO stage divides it (their Fig. 1).
TEST(PlanMemoryFormula, ModelStatesFollowTheZeroPaper) {
  Workload w;
  w.precision = Precision::parse("bf16-mixed");
  for (const std::string name : {"gpt2-124m", "llama2-7b", "llama3-70b"}) {
    const model::GptConfig m = model::GptConfig::preset(name);
    const double psi = static_cast<double>(m.parameter_count());
    for (int64_t n : {1, 2, 8, 64}) {
      for (int stage = 0; stage <= 3; ++stage) {
        Layout l;
        l.dims.zero_stage = stage;
        if (stage > 0) l.dims.fsdp = n;
        else l.dims.dp = n;
        const double states = estimate_memory(m, w, l, 1).front().memory.model_states();
        const double want = stage == 0   ? 16 * psi
                            : stage == 1 ? 4 * psi + 12 * psi / n
                            : stage == 2 ? 2 * psi + 14 * psi / n
                                         : 16 * psi / n;
        EXPECT_NEAR(states / want, 1.0, 1e-12) << name << " stage " << stage << " N " << n;
      }
    }
    // fp32 (how meshtrain trains here): 4 + 4 + 8 bytes.
    Workload fp32;
    fp32.precision = Precision::parse("fp32");
    EXPECT_NEAR(estimate_memory(m, fp32, Layout{}, 1).front().memory.model_states() / (16 * psi), 1.0, 1e-12);
  }
}

// LoRA: the frozen model keeps only its parameters (sharded at stage 3);
// gradients and optimizer states exist for the adapters alone.
TEST(PlanMemoryFormula, LoraKeepsGradientsAndOptimizerStatesForTheAdaptersOnly) {
  Workload w;
  w.precision = Precision::parse("fp32");
  w.lora.rank = 16;
  const model::GptConfig m = model::GptConfig::preset("llama2-7b");
  const double psi = static_cast<double>(m.parameter_count()), adapters = static_cast<double>(w.lora.parameter_count(m));
  EXPECT_NEAR(adapters, 16.0 * 32 * (4 * (4096 + 4096) + 3 * (4096 + 11008)), 1e-6);  // 7 targets, 32 blocks
  for (int stage = 0; stage <= 3; ++stage) {
    Layout l;
    l.dims.zero_stage = stage;
    const int64_t n = stage > 0 ? 8 : 1;
    l.dims.fsdp = n;
    const MemoryBreakdown got = estimate_memory(m, w, l, 1).front().memory;
    EXPECT_NEAR(got.parameters / (4 * (psi + adapters) / (stage == 3 ? n : 1)), 1.0, 1e-12) << "stage " << stage;
    EXPECT_NEAR(got.gradients / (4 * adapters / (stage >= 2 ? n : 1)), 1.0, 1e-12) << "stage " << stage;
    EXPECT_NEAR(got.optimizer / (8 * adapters / (stage >= 1 ? n : 1)), 1.0, 1e-12) << "stage " << stage;
  }
}

// Korthikanti et al. 2022 in 16-bit with dropout and unfused attention:
// sbh(34 + 5as/h) per layer (Eq. 1); tp: sbh(10 + 24/t + 5as/(ht)) (Eq. 2);
// tp + sp: sbh/t (34 + 5as/h) (Eq. 4); + selective recompute: 34 sbh/t
// (Eq. 6); full recompute: 2sbh (Sec. 4.3). Norm statistics (16 bytes per
// token) are ours on top: under 0.1% at these widths.
TEST(PlanMemoryFormula, ActivationsFollowKorthikanti) {
  for (const model::GptConfig& m : gpt_shapes()) {
    for (int64_t b : {1, 4}) {
      for (int64_t t : {1, 2, 8}) {
        const double s = m.context, h = m.width, a = m.heads, sbh = s * b * h;
        ActivationOptions o;
        o.micro_batch = b;
        o.tp = t;
        o.attention = "math";
        o.dropout = 0.1;
        o.precision = Precision::parse("bf16-mixed");
        auto check = [&](const std::string& what, double want) {
          EXPECT_NEAR(layer_activation_bytes(m, o) / want, 1.0, 1e-3) << what << " " << m.describe("model") << " b " << b << " t " << t;
        };
        check("tp", sbh * (10 + 24.0 / t + 5 * a * s / (h * t)));
        o.sp = t > 1;
        check("tp+sp", sbh / t * (34 + 5 * a * s / h));
        o.recompute = parallel::CheckpointMode::kSelective;
        check("tp+sp+selective", 34 * sbh / t);
        o.recompute = parallel::CheckpointMode::kFull;
        check("tp+sp+full", 2 * sbh / t);
        o.sp = false;
        check("full", 2 * sbh);
      }
    }
  }
}

// Op-level recompute (Note [Op-level recompute]), counted here by hand: a
// Llama block keeps its input, q, v, gate and down (the odd products), the
// attention output and an fp32 log-sum-exp per head and token; recomputing
// k, o and up repeats 2·(h·kv + qw·h + h·f) FLOPs per token. Biased products
// (addmm) are neither kept nor counted.
TEST(PlanMemoryFormula, OpLevelRecomputeKeepsEveryOtherProduct) {
  const model::GptConfig m = model::GptConfig::preset("llama3.1-8b");
  const double h = m.width, kv = m.kv_width(), f = m.mlp_hidden(), a = m.heads, e = 2;
  for (int64_t t : {1, 2, 8}) {
    ActivationOptions o;
    o.micro_batch = 2;
    o.tp = t;
    o.sp = t > 1;
    o.recompute = parallel::CheckpointMode::kSelective;
    o.selective = SelectivePolicy::kOps;
    const double n = 2.0 * m.context;
    // Column-parallel outputs split, row-parallel (down) whole, with sp the input and two reduce-scatters split.
    const double want = e * n * (h / t + h / t + kv / t + f / t + h + h / t) + 4 * n * a / t + (t > 1 ? 2 * e * n * h / t : 0);
    EXPECT_NEAR(layer_activation_bytes(m, o) / want, 1.0, 1e-12) << "tp " << t;
  }
  std::vector<bool> kept;
  for (const BlockProduct& p : op_level_products(m, false)) kept.push_back(p.kept);
  EXPECT_EQ(kept, (std::vector<bool>{true, false, true, false, true, false, true}));  // q k v o gate up down
  model::GptConfig biased = m;
  biased.qkv_bias = true;  // q, k, v run as addmm: o is the first product counted
  kept.clear();
  for (const BlockProduct& p : op_level_products(biased, false)) kept.push_back(p.kept);
  EXPECT_EQ(kept, (std::vector<bool>{false, false, false, true, false, true, false}));

  Workload w;
  w.global_batch = 16;
  w.selective = SelectivePolicy::kOps;
  const Layout l = Layout::parse("zero=3 fsdp=8 mb=2 recompute=selective");
  const Candidate c = evaluate(m, w, l, Machine());
  const double per_sequence = m.layers * m.context * 2 * (h * kv + m.q_width() * h + h * f);
  EXPECT_NEAR(c.time.recompute, 2 * per_sequence / (Machine().peak_flops * Machine().mfu), 1e-9 * c.time.recompute);
}

// torchtitan's published Llama 3.1 8B runs on H100s without Float8 or compile
// (benchmarks/llama3_h100_202412_torchtitan.md: FSDP, local batch 2, sequence
// 8192, op-level selective recompute, the loss over the whole logits):
// 82.4 GiB on 8 devices, 67.0 GiB on 128, the allocator's reserved peak. The
// plan (allocated bytes) is within 10% below them.
TEST(PlanPublished, TorchtitanLlama31EightBWithinTenPercent) {
  model::GptConfig m = model::GptConfig::preset("llama3.1-8b");
  m.context = 8192;
  Workload w;
  w.selective = SelectivePolicy::kOps;
  w.chunked_loss = false;
  for (const auto& [devices, published] : {std::pair<int64_t, double>{8, 82.4}, {128, 67.0}}) {
    w.global_batch = 2 * devices;
    const Layout l = Layout::parse("zero=3 fsdp=" + std::to_string(devices) + " mb=2 recompute=selective");
    const double planned = evaluate(m, w, l, Machine()).worst.memory.total() / (1 << 30);
    EXPECT_LT(planned, published) << devices;
    EXPECT_GT(planned, 0.9 * published) << devices;
  }
}

// FSDP2 under torch.distributed.pipelining (Workload::torch_pipeline_fsdp):
// at a pipeline rank's peak (in a backward) its gradients are whole and in
// fp32 (4 bytes a parameter) where ZeRO-2 shards them (2 bytes over N; ZeRO-3
// takes no pipeline); without a pipeline, and at ZeRO-1, nothing changes.
TEST(PlanMemoryFormula, TorchPipelineFsdpKeepsWholeFp32Gradients) {
  const model::GptConfig m = model::GptConfig::preset("llama2-7b");
  Workload ours, torch_pipeline;
  torch_pipeline.torch_pipeline_fsdp = true;
  for (const std::string layout : {"pp=2 zero=2 fsdp=4", "pp=4 zero=2 fsdp=2", "pp=2 zero=1 fsdp=4", "zero=3 fsdp=8"}) {
    const Layout l = Layout::parse(layout);
    const std::vector<RankMemory> a = estimate_memory(m, ours, l, 1), b = estimate_memory(m, torch_pipeline, l, 1);
    ASSERT_EQ(a.size(), b.size());
    for (size_t r = 0; r < a.size(); ++r) {
      const double psi = a[r].parameter_count, n = static_cast<double>(l.shards());
      const bool whole = l.dims.pp > 1 && l.dims.zero_stage >= 2;
      EXPECT_DOUBLE_EQ(a[r].memory.gradients, l.dims.zero_stage >= 2 ? 2 * psi / n : 2 * psi) << layout;
      EXPECT_DOUBLE_EQ(b[r].memory.gradients, whole ? 4 * psi : a[r].memory.gradients) << layout;
      EXPECT_DOUBLE_EQ(b[r].memory.parameters, a[r].memory.parameters) << layout;
    }
  }
}

// Note [Head's gradient into .grad]: a chunked loss whose forward adds dW
// into .grad keeps no dW (4·V·d bytes in fp32) to its backward, and a tied
// head's gradient no longer waits in autograd's buffer through the backward.
// A CPU plan at ZeRO-0 counts neither; at ZeRO-2, whose .grad is reset after
// each reduction, the loss holds dW as before, and the peak is dW higher.
TEST(PlanMemoryFormula, HeadsGradientIntoGradKeepsNoWeightSizedTensor) {
  model::GptConfig m = model::GptConfig::preset("llama3.2-1b");
  m.context = 4096, m.layers = 2;  // the peak in the backward, not at the optimizer step
  const Precision p = Precision::parse("fp32");
  const Sizes z = sizes(m, 1, 1, false, 1);
  const double dw = 4.0 * static_cast<double>(m.vocab_size) * static_cast<double>(m.width);
  const double chunk = 256 << 20;
  const OutputBytes held = output_bytes(m, z, p, false, true, chunk, true, model::LossGradients::kInForward);
  const OutputBytes into = output_bytes(m, z, p, false, true, chunk, true, model::LossGradients::kIntoWeightGrad);
  EXPECT_DOUBLE_EQ(held.kept - into.kept, dw);
  EXPECT_DOUBLE_EQ(held.forward, into.forward);
  Workload w;
  w.precision = p;
  auto peak = [&](int stage) {
    Layout l;
    l.dims.zero_stage = stage;
    return estimate_memory(m, w, l, 1).front().memory;
  };
  const MemoryBreakdown one = peak(0), two = peak(2);
  ASSERT_TRUE(m.tie_embeddings);
  EXPECT_DOUBLE_EQ(one.model_states(), two.model_states());
  EXPECT_NEAR(two.total() - one.total(), dw, 1e-6 * dw) << one.moment << " against " << two.moment;
  // Tensor parallel: the rank's vocabulary share of dW.
  auto tensor_parallel = [&](const std::string& zero) {
    return estimate_memory(m, w, Layout::parse("tp=2 zero=" + zero), 1).front().memory;
  };
  EXPECT_NEAR(tensor_parallel("2").total() - tensor_parallel("0").total(), dw / 2, 1e-6 * dw);
}

// Note [Embedding gradients in place]: the fused lookups add their rows into
// .grad where it persists, so a CPU plan at ZeRO-0 counts no dense gradient of
// the table at the end of the backward. Under full recompute at 1,024 tokens
// that gradient (4·V·d bytes in fp32) is the step's peak without the fused
// operators, and with them the peak is elsewhere and lower by most of it.
TEST(PlanMemoryFormula, EmbeddingGradientInPlaceMakesNoDenseTable) {
  model::GptConfig m = model::GptConfig::preset("llama3.2-1b");
  m.context = 1024, m.layers = 2;
  const double table = 4.0 * static_cast<double>(m.vocab_size) * static_cast<double>(m.width);
  Workload w;
  w.precision = Precision::parse("fp32");
  w.chunked_loss = true;
  auto peak = [&](bool fused) {
    w.fused_ops = fused;
    return estimate_memory(m, w, Layout::parse("recompute=full"), 1).front().memory;
  };
  const MemoryBreakdown fused = peak(true), unfused = peak(false);
  EXPECT_EQ(unfused.moment, "embedding backward");
  EXPECT_DOUBLE_EQ(unfused.workspace, table);
  EXPECT_NE(fused.moment, "embedding backward");
  EXPECT_LT(fused.total(), unfused.total() - table / 2) << fused.moment;
}

// PyTorch's loss_parallel (Note [PyTorch's loss_parallel]) over L bf16 logits
// per rank: the log-probabilities kept (4L), at the forward's exp the bf16
// logits, their fp32 copy and the shifted copy beside it (2L + 4L + 4L), at
// its backward three fp32 tensors (12L); under sequence parallel the head's
// input whole. Meshtrain's own vocabulary-parallel loss is unchanged by it,
// and one tensor-parallel rank is plain cross-entropy either way.
TEST(PlanMemoryFormula, TorchLossParallelKeepsItsDecompositionsTensors) {
  model::GptConfig m = model::GptConfig::preset("llama3.2-1b");
  m.context = 1024;
  const Precision p = Precision::parse("bf16-mixed");
  const Sizes z = sizes(m, 2, 8, true, 1);
  const double logits = z.tokens * static_cast<double>(m.vocab_size) / 8;
  const OutputBytes ours = output_bytes(m, z, p, false, false, 0, true, model::LossGradients::kInForward);
  const OutputBytes torch_parallel = output_bytes(m, z, p, false, false, 0, true, model::LossGradients::kInForward, true);
  EXPECT_DOUBLE_EQ(torch_parallel.kept - ours.kept, p.activation * (z.u - z.u / 8));
  EXPECT_DOUBLE_EQ(torch_parallel.forward, (2 + 4 + 4) * logits);
  EXPECT_DOUBLE_EQ(torch_parallel.backward, 12 * logits);
  const Sizes one = sizes(m, 2, 1, false, 1);
  const OutputBytes a = output_bytes(m, one, p, false, false, 0, true, model::LossGradients::kInForward),
                    b = output_bytes(m, one, p, false, false, 0, true, model::LossGradients::kInForward, true);
  EXPECT_DOUBLE_EQ(a.kept, b.kept);
  EXPECT_DOUBLE_EQ(a.backward, b.backward);
}

// torchtitan's published Llama 3.1 405B run with the interleaved schedule
// (512 H100s: PP 8 x FSDP 8 x TP 8 with sequence parallel, 8 micro-batches of
// 4, full recompute; 72.7 GiB): planned as FSDP2 under torch's pipelining
// runs it (--pipeline-fsdp torch) within 10% below it; with meshtrain's
// ZeRO-2, a third below. The 70B run (FSDP 32 x TP 8, 16 sequences per rank;
// 71.9 GiB, 67.6 with async TP) with PyTorch's loss_parallel within 20% below.
TEST(PlanPublished, TorchtitanLlama31ThreeDimensionalRuns) {
  Workload w;
  w.chunked_loss = false;
  model::GptConfig big = model::GptConfig::preset("llama3.1-405b");
  big.context = 8192;
  w.global_batch = 256;
  const Layout interleaved = Layout::parse("pp=8 interleaved v=2 tp=8 sp zero=2 fsdp=8 mb=4 recompute=full");
  const double ours = evaluate(big, w, interleaved, Machine()).worst.memory.total() / (1 << 30);
  w.torch_pipeline_fsdp = true;
  const double torch_pipeline = evaluate(big, w, interleaved, Machine()).worst.memory.total() / (1 << 30);
  EXPECT_LT(torch_pipeline, 72.7);
  EXPECT_GT(torch_pipeline, 0.9 * 72.7);
  EXPECT_LT(ours, 0.7 * 72.7);
  // The gradients exist from a chunk's first backward: on a middle rank the
  // schedule runs all 16 chunk forwards (16 GiB of block inputs) before any,
  // and the peak comes once the second chunk's backwards have left 8 GiB.
  const std::vector<RankMemory> ranks = estimate_memory(big, w, interleaved, 8);
  EXPECT_NEAR(ranks[1].memory.activations / (1 << 30), 8.0, 0.5);
  EXPECT_NEAR(ranks[1].memory.gradients / (1 << 30), 4 * ranks[1].parameter_count / (1 << 30), 1e-6);
  model::GptConfig seventy = model::GptConfig::preset("llama3.1-70b");
  seventy.context = 8192;
  Workload t;
  t.chunked_loss = false;
  t.torch_loss_parallel = true;
  t.global_batch = 512;
  const double planned =
      evaluate(seventy, t, Layout::parse("tp=8 sp zero=3 fsdp=32 mb=16 recompute=full"), Machine()).worst.memory.total() /
      (1 << 30);
  EXPECT_LT(planned, 67.6);
  EXPECT_GT(planned, 0.8 * 71.9);
  // docs/planner.md's figure: one logits-sized fp32 tensor more or less in the loss moves it by 7.8 GiB.
  EXPECT_NEAR(planned, 58.65, 0.5);
}

// The fused CPU operators run only on the CPU: a config for a GPU is planned
// with ATen's (SwiGLU's fourth hidden tensor), norms through kernels, and the
// GPU's loss chunk; model.fused off on the CPU plans the composed RMSNorm too.
TEST(PlanFromConfig, CountsTheOperatorsTheDeviceRuns) {
  train::TrainConfig c;
  c.model = model::GptConfig::preset("llama3.2-1b");
  c.model.context = 2048;
  c.batch = c.micro_batch = 8;
  c.device = "cuda";
  const Workload gpu = planned_model(c).workload;
  EXPECT_FALSE(gpu.fused_ops);
  EXPECT_TRUE(gpu.norm_kernels);
  EXPECT_EQ(gpu.loss_chunk_bytes, static_cast<double>(model::kGpuChunkBytes));
  c.device = "cpu";
  const Workload cpu = planned_model(c).workload;
  EXPECT_TRUE(cpu.fused_ops);
  EXPECT_TRUE(cpu.norm_kernels);
  EXPECT_EQ(cpu.loss_chunk_bytes, static_cast<double>(model::kChunkBytes));
  c.model.fused = false;
  const Workload composed = planned_model(c).workload;
  EXPECT_FALSE(composed.fused_ops);
  EXPECT_FALSE(composed.norm_kernels);
  // ATen's SwiGLU keeps one hidden-sized tensor more than the fused one.
  model::GptConfig fused = c.model, aten = c.model;
  fused.fused = true;
  ActivationOptions o;
  o.micro_batch = 8;
  const double tokens = 8.0 * 2048, e = o.precision.activation;
  const double hidden = e * tokens * static_cast<double>(c.model.mlp_hidden());
  EXPECT_NEAR(layer_activation_bytes(aten, o) - layer_activation_bytes(fused, o), hidden, 1.0);
  // Under selective recompute the fused down projection makes the GLU's output again (Note [The
  // GLU's output made again]): one more fewer; not with LoRA's frozen base, whose product is ATen's.
  ActivationOptions selective = o, lora = o;
  selective.recompute = lora.recompute = parallel::CheckpointMode::kSelective;
  lora.lora = true;
  EXPECT_NEAR(layer_activation_bytes(aten, selective) - layer_activation_bytes(fused, selective), 2 * hidden, 1.0);
  EXPECT_NEAR(layer_activation_bytes(aten, lora) - layer_activation_bytes(fused, lora), hidden, 1.0);
  // The composed RMSNorm keeps the normalised input of both norms besides.
  const double with_kernels = layer_activation_bytes(aten, o);
  o.norm_kernels = false;
  const double composed_norms = layer_activation_bytes(aten, o) - with_kernels;
  EXPECT_NEAR(composed_norms, 2 * (o.precision.residual * tokens * c.model.width - 4 * tokens), 1.0);
  // fp32 or a window on a GPU: SDPA keeps k and v repeated per query head (Note [Grouped
  // queries in SDPA]); 16-bit products without a window and the CPU take them as they are.
  EXPECT_TRUE(gpu.gpu);
  EXPECT_FALSE(cpu.gpu);
  o.norm_kernels = true;
  o.repeated_kv = 1;
  const double repeated = layer_activation_bytes(aten, o) - with_kernels;
  EXPECT_NEAR(repeated, e * tokens * 2 * static_cast<double>(c.model.q_width() - c.model.kv_width()), 1.0);
  Layout l;
  l.micro_batch = 8;
  Workload fp32 = gpu;
  fp32.precision = Precision::parse("fp32");
  auto activations = [&](const Workload& w) { return estimate_memory(c.model, w, l, 1)[0].memory.activations; };
  Workload bf16 = fp32, on_cpu = fp32;
  bf16.precision = Precision::parse("bf16-autocast");
  on_cpu.gpu = false;
  const double blocks = static_cast<double>(c.model.layers);
  EXPECT_NEAR(activations(fp32) - activations(on_cpu), blocks * 4 * tokens * 2 * (2048 - 512), 1.0);
  Workload bf16_on_cpu = bf16;
  bf16_on_cpu.gpu = false;
  EXPECT_NEAR(activations(bf16), activations(bf16_on_cpu), 1.0);
  // bfloat16 parameters make bf16 attention under an fp32 precision (the config's bf16_attention).
  Workload bf16_params = fp32;
  bf16_params.bf16_attention = true;
  EXPECT_NEAR(activations(bf16_params), activations(on_cpu), 1.0);
  // A window on every other block (Gemma 2's pattern) masks them: their k and v repeated under bf16 too.
  model::GptConfig windowed = c.model;
  windowed.sliding_window = 512;
  windowed.sliding_every = 2;
  auto windowed_activations = [&](const Workload& w) { return estimate_memory(windowed, w, l, 1)[0].memory.activations; };
  EXPECT_NEAR(windowed_activations(bf16) - windowed_activations(bf16_on_cpu),
              blocks / 2 * 2 * tokens * 2 * (2048 - 512), 1.0);
  l.activation_checkpoint = parallel::CheckpointMode::kFull;  // nothing of attention kept
  EXPECT_NEAR(activations(fp32), activations(on_cpu), 1.0);
}

// The CPU's batched attention keeps its causal blocks' softmax: 5/8 of T² at
// T = 256 in blocks of 64 queries, 3/4 in bf16's blocks of 128, also where
// bf16 parameters make the attention's inputs bf16 under an fp32 precision
// (Note [CPU attention]).
TEST(PlanMemoryFormula, BatchedAttentionBlocksFollowTheAttentionsDtype) {
  const model::GptConfig m = model::GptConfig::preset("small");  // T = 256, 6 heads of 64
  ActivationOptions o;
  o.attention = "batched";
  o.micro_batch = 2;
  o.precision = Precision::parse("fp32");
  const double fp32 = layer_activation_bytes(m, o);
  o.bf16_attention = true;
  const double scores = 6.0 * 256 * (2 * 256);  // heads · T · tokens
  EXPECT_NEAR(layer_activation_bytes(m, o) - fp32, 4 * scores * (3.0 / 4 - 5.0 / 8), 1.0);
}

TEST(PlanMemoryFormula, PipelineStashFollowsTheSchedule) {
  model::GptConfig m = model::GptConfig::preset("gpt2-350m");
  m.vocab_size = 256;  // a small embedding: the parameter split is six blocks per stage
  Workload w;
  Layout l;
  l.dims.pp = 4;
  for (const std::string schedule : {"gpipe", "1f1b"}) {
    l.dims.schedule = config::parse_name(mesh::pipeline_schedule_names(), "schedule", schedule);
    const auto ranks = estimate_memory(m, w, l, 8);
    ASSERT_EQ(ranks.size(), 4u);
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(ranks[r].in_flight, schedule == "gpipe" ? 8 : 4 - r) << schedule << " rank " << r;
      EXPECT_EQ(ranks[r].layers, 6);
    }
  }
  // The first 1F1B stage holds p micro-batches of L/p layers: one whole model's activations.
  l.dims.schedule = mesh::PipelineSchedule::kOneFOneB;
  ActivationOptions o;
  EXPECT_NEAR(estimate_memory(m, w, l, 8).front().memory.activations / (24 * layer_activation_bytes(m, o)), 1.0, 1e-12);
}

TEST(PlanTime, BubbleAndComputeFollowTheirFormulas) {
  const model::GptConfig m = model::GptConfig::preset("llama2-7b");
  Workload w;
  w.global_batch = 64;
  Machine machine;
  Layout l = Layout::parse("pp=4 1f1b dp=2 mb=2");
  const Candidate c = evaluate(m, w, l, machine);
  EXPECT_EQ(c.microbatches, 16);
  const double b = parallel::pipeline::theoretical_bubble(4, 1, 16);
  EXPECT_NEAR(c.time.bubble / c.time.compute, b / (1 - b), 1e-12);
  // The slowest stage (blocks + the head on the last) at peak x MFU.
  const double last = 8 * m.block_training_flops() + m.head_training_flops();
  EXPECT_NEAR(c.time.compute, 32 * last / (machine.peak_flops * machine.mfu), 1e-9 * c.time.compute);
}

// Sequence parallel turns each tensor-parallel all-reduce into an all-gather
// and a reduce-scatter, the same bytes in two blocking collectives: twice the
// machine's sync. 16 micro-batches x (32 layers x 4 + the embedding's and head's 2).
TEST(PlanTime, SequenceParallelSyncsTwicePerCollective) {
  const model::GptConfig m = model::GptConfig::preset("llama2-7b");
  Workload w;
  w.global_batch = 64;
  Machine machine;
  machine.sync = 1e-3;
  const Candidate plain = evaluate(m, w, Layout::parse("tp=2 dp=4 mb=1"), machine);
  const Candidate sp = evaluate(m, w, Layout::parse("tp=2 sp dp=4 mb=1"), machine);
  ASSERT_EQ(plain.microbatches, 16);
  EXPECT_NEAR(sp.time.tensor_parallel - plain.time.tensor_parallel, 16 * (32 * 4 + 2) * 1e-3, 1e-9);
}

// Note [Shared cores], by hand. On devices of their own a pipeline takes
// (m + p - 1)(F + B), as the schedule's own walk says. Two pipelines of two
// stages (4 ranks) on 2 cores, one micro-batch: a lone busy stage stands for
// 2 busy ranks, which have a core each, twice their share of 4 ranks on 2
// cores: F 1 -> 0.5 on each stage, B 2 -> 1, 3 in all, the busy time of
// either rank, so no bubble.
TEST(PlanTime, PipelinesOnSharedCoresWalkTheSchedule) {
  namespace pipeline = parallel::pipeline;
  const pipeline::Schedule s = pipeline::one_f_one_b(4, 8);
  EXPECT_DOUBLE_EQ(pipeline_makespan(s, {1, 1, 1, 1}, {2, 2, 2, 2}, {}), 11 * 3.0);
  EXPECT_DOUBLE_EQ(pipeline_makespan(s, {1, 1, 1, 1}, {2, 2, 2, 2}, {}), pipeline::validate(s).step_time);
  const SharedCores two{4, 2, 2};
  EXPECT_DOUBLE_EQ(two.speed(1), 2.0);
  EXPECT_DOUBLE_EQ(two.speed(2), 1.0);
  EXPECT_DOUBLE_EQ(pipeline_makespan(pipeline::gpipe(2, 1), {1, 1}, {2, 2}, two), 3.0);
  // In the planner: pp=4 on 4 ranks sharing 2 cores loses less to its bubble than on 4 devices.
  const model::GptConfig m = model::GptConfig::preset("gpt2-124m");
  Workload w;
  w.global_batch = 8;
  Machine devices;
  devices.devices_per_node = 4;
  Machine cpu = devices;
  cpu.cores_per_node = 2;
  const Layout l = Layout::parse("pp=4 1f1b mb=1");
  const Candidate own = evaluate(m, w, l, devices), shared = evaluate(m, w, l, cpu);
  EXPECT_GT(own.time.bubble, 0);
  EXPECT_LT(shared.time.bubble, 0.5 * own.time.bubble);
  // The slowest stage (the head's) speeds up while the others wait: its work takes less than its share's time.
  EXPECT_LE(shared.time.compute, own.time.compute);
  EXPECT_LT(shared.time.compute + shared.time.bubble, own.time.compute + own.time.bubble);
}

TEST(PlanLayout, ParsesPrintsAndRefuses) {
  const Layout l = Layout::parse("pp=2,interleaved,v=2 tp=4 sp zero=1 dp=8 mb=2 recompute=selective");
  EXPECT_EQ(l.dims.pp, 2);
  EXPECT_EQ(l.dims.fsdp, 8);  // zero with dp: ZeRO's shards
  EXPECT_EQ(l.world(), 64);
  EXPECT_EQ(l.str(), "pp=2 interleaved v=2 tp=4 sp zero=1 fsdp=8 mb=2 recompute=selective");
  EXPECT_EQ(Layout::parse(l.str()).str(), l.str());
  EXPECT_NE(error_of([] { Layout::parse("tp=two"); }).find("layout tp=two: needs a whole number"), std::string::npos);
  EXPECT_NE(error_of([] { Layout::parse("zero=4"); }).find("layout zero=4: use one of 0, 1, 2, 3"), std::string::npos);
  EXPECT_NE(error_of([] { Layout::parse("xp=2"); }).find("layout key 'xp' unknown"), std::string::npos);
  const model::GptConfig m = model::GptConfig::preset("llama2-70b");
  EXPECT_NE(error_of([&] { check_layout(m, Layout::parse("tp=16"), 1); }).find("tp(16) does not divide the key/value heads (8)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { check_layout(m, Layout::parse("pp=2 zero=3 fsdp=2"), 4); }).find("zero_stage = 3: does not combine with pp(2) > 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { check_layout(m, Layout::parse("pp=4 interleaved v=2"), 6); }).find("divisible by pp(4)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { check_layout(m, Layout::parse("offload=optimizer"), 1); }).find("offload.optimizer = \"cpu\": needs parallel.zero_stage >= 1"),
            std::string::npos);
  EXPECT_EQ(parse_bytes("80GiB"), 80.0 * (1 << 30));
  EXPECT_EQ(parse_bytes("64K"), 65536);
  EXPECT_EQ(parse_bytes("1.5GB"), 1.5e9);
  EXPECT_NE(error_of([] { parse_bytes("80 apples"); }).find("unknown unit"), std::string::npos);
}

TEST(PlanSearch, RanksWhatFitsAndSaysWhyTheRestDoNot) {
  const model::GptConfig m = model::GptConfig::preset("llama2-7b");
  Workload w;
  w.global_batch = default_global_batch(m, 8);
  Machine machine;
  const SearchResult big = search(m, w, machine, 8);
  ASSERT_FALSE(big.fitting.empty());
  ASSERT_FALSE(big.rejected.empty());
  for (size_t i = 0; i < big.fitting.size(); ++i) {
    EXPECT_LE(big.fitting[i].worst.memory.total(), machine.device_memory);
    if (i > 0) {
      EXPECT_LE(big.fitting[i - 1].time.step(), big.fitting[i].time.step());
    }
  }
  for (const Candidate& c : big.rejected) {
    EXPECT_GT(c.worst.memory.total(), machine.device_memory);
    EXPECT_NE(c.why_not.find("needs "), std::string::npos) << c.why_not;
  }
  // Plain data parallel cannot hold 16 bytes per parameter of 6.7B in 80 GiB.
  for (const Candidate& c : big.fitting) EXPECT_FALSE(c.layout.dims.zero_stage == 0 && c.layout.dims.pp == 1 && c.layout.dims.tp == 1);
  machine.device_memory = 24.0 * (1 << 30);
  const SearchResult small = search(m, w, machine, 8);
  EXPECT_LT(small.fitting.size(), big.fitting.size());
  EXPECT_EQ(small.examined, big.examined);
}

TEST(PlanMachine, ProfileRoundTripsAndRejectsBadFields) {
  Machine m;
  m.peak_flops = 1.5e11;
  m.mfu = 0.6;
  m.devices_per_node = 2;
  m.cores_per_node = 16;
  const Machine back = Machine::from_json(m.to_json());
  EXPECT_EQ(back.peak_flops, m.peak_flops);
  EXPECT_EQ(back.mfu, m.mfu);
  EXPECT_EQ(back.devices_per_node, 2);
  EXPECT_EQ(back.cores_per_node, 16);
  EXPECT_EQ(Machine::from_json(Machine().to_json()).cores_per_node, 0);
  EXPECT_NE(error_of([] { Machine::from_json("{\"mfu\": -1}"); }).find("'mfu' must be a positive number"), std::string::npos);
  EXPECT_NE(error_of([] { Machine::from_json("not json"); }).find("machine profile is not JSON"), std::string::npos);
}

// Note [This machine]: the GPUs the driver lists, by model; the CPU's memory and peak shared by its ranks.
TEST(PlanMachine, ThisMachineIsTheDriversGpusOrTheCpuSharedByItsRanks) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "meshtrain-plan-gpus";
  std::filesystem::remove_all(dir);
  EXPECT_FALSE(detect_gpus(dir.string()).has_value());
  for (const char* bus : {"0000:18:00.0", "0000:2a:00.0"}) {
    std::filesystem::create_directories(dir / bus);
    std::ofstream(dir / bus / "information") << "Model: \t\t NVIDIA H200\nIRQ:   18\nBus Type:  PCIe\n";
  }
  auto gpus = detect_gpus(dir.string());
  ASSERT_TRUE(gpus.has_value());
  EXPECT_EQ(gpus->model, "NVIDIA H200");
  EXPECT_EQ(gpus->machine.devices_per_node, 2);
  EXPECT_EQ(gpus->machine.device_memory, machine_preset("h200").device_memory);
  EXPECT_EQ(gpus->machine.peak_flops, 989e12);
  EXPECT_TRUE(gpus->assumed.empty());
  std::ofstream(dir / "0000:18:00.0" / "information") << "Model: Tesla T4\n";
  std::ofstream(dir / "0000:2a:00.0" / "information") << "Model: Tesla T4\n";
  gpus = detect_gpus(dir.string());
  ASSERT_TRUE(gpus.has_value());
  EXPECT_NE(gpus->assumed.find("'Tesla T4' has no profile here"), std::string::npos);
  std::filesystem::remove_all(dir);

  const Machine cpu = cpu_machine(24.0 * (1 << 30), 200e9, 4, "AMD EPYC (2 cores)");
  EXPECT_EQ(cpu.device_memory, 6.0 * (1 << 30));
  EXPECT_EQ(cpu.peak_flops, 50e9);
  EXPECT_EQ(cpu.devices_per_node, 4);
  EXPECT_EQ(machine_preset("a100").peak_flops, 312e12);
  EXPECT_NE(error_of([] { machine_preset("h300"); }).find("use this, h100, h200, a100"), std::string::npos);
}

}  // namespace
}  // namespace meshtrain::plan

namespace meshtrain::plan {
namespace {

// A GPT-style config with 8 experts in every second block, top-2.
model::GptConfig moe_config() {
  model::GptConfig c = model::GptConfig::preset("small");
  c.moe_experts = 8;
  c.moe_every = 2;
  c.moe_top_k = 2;
  return c;
}

TEST(PlanMoe, ParameterCountsEqualTheBuiltModelAndMixtral) {
  for (const model::MlpStyle mlp : {model::MlpStyle::kGelu, model::MlpStyle::kSwiglu}) {
    model::GptConfig c = moe_config();
    c.mlp = mlp;
    c.moe_hidden = 96;
    model::Gpt gpt(c, 1);
    int64_t numel = 0;
    for (const auto& p : gpt->parameters()) numel += p.numel();
    const model::GptConfig m = c;
    EXPECT_EQ(m.parameter_count(), numel) << model::name(mlp);
    EXPECT_EQ(m.parameter_count(), c.parameter_count());
    EXPECT_EQ(m.active_parameter_count(), c.active_parameter_count());
  }
  // Jiang et al. 2024: 46.7B parameters, 12.9B active per token.
  const model::GptConfig mixtral = model::GptConfig::preset("mixtral-8x7b");
  EXPECT_NEAR(mixtral.parameter_count() / 1e9, 46.7, 0.05);
  EXPECT_NEAR(mixtral.active_parameter_count() / 1e9, 12.9, 0.05);
}

TEST(PlanMoe, FlopsCountTheRouterAndTopKExperts) {
  const model::GptConfig c = moe_config();
  const model::GptConfig m = c;
  const double s = m.context, h = m.width, f = m.mlp_hidden();
  // A MoE block: the dense block with its MLP (2·h·f) replaced by the router (E·h) and k experts.
  EXPECT_DOUBLE_EQ(m.block_training_flops(true) - m.block_training_flops(false), 6 * s * (8 * h + 2 * 2 * h * f - 2 * h * f));
  EXPECT_NEAR(m.training_flops_per_sequence() / s, c.flops_per_token(), 1e-9 * c.flops_per_token());
}

TEST(PlanMoe, ExpertParallelDividesExpertStatesAndAddsAllToAll) {
  model::GptConfig m = model::GptConfig::preset("mixtral-8x7b");
  Workload w;
  w.global_batch = 64;
  Machine machine;
  Layout dense = Layout::parse("pp=8 dp=8");
  Layout ep = Layout::parse("pp=8 ep=8");
  EXPECT_EQ(ep.str(), "pp=8 1f1b ep=8 mb=1");
  EXPECT_EQ(ep.world(), 64);
  EXPECT_EQ(ep.data_ranks(), 8);
  const Candidate replicated = evaluate(m, w, dense, machine), split = evaluate(m, w, ep, machine);
  // Per rank: the experts (3·h·f each, 8 per block) divided by 8, the rest whole.
  const double experts = 8.0 * 3 * 4096 * 14336 * replicated.ranks[1].layers;
  EXPECT_NEAR(replicated.ranks[1].parameter_count - split.ranks[1].parameter_count, experts * 7 / 8, 1);
  EXPECT_NEAR(split.ranks[1].expert_parameter_count, experts / 8, 1);
  // All-to-all: 4 per layer and micro-batch, each tokens·k·h·2 bytes, 7/8 of it leaving the rank.
  double all_to_all = 0;
  for (const Traffic& t : split.time.traffic) {
    if (t.group == "ep") all_to_all = t.bytes;
  }
  const double layers = split.ranks[0].moe_layers, microbatches = split.microbatches;
  EXPECT_NEAR(all_to_all, microbatches * layers * 4 * (4096.0 * 2 * 4096 * 2) * 7 / 8, 1);
  EXPECT_GT(split.time.expert_parallel, 0);
  EXPECT_EQ(replicated.time.expert_parallel, 0);
  // A heavier load on the busiest rank costs activation memory under expert
  // parallel. Without it a rank computes its own tokens' assignments only: the
  // load cannot raise them, and the share capacity keeps lowers them.
  w.moe_load = 1.5;
  EXPECT_GT(evaluate(m, w, ep, machine).worst.memory.activations, split.worst.memory.activations);
  EXPECT_EQ(evaluate(m, w, dense, machine).worst.memory.activations, replicated.worst.memory.activations);
  // So does compute on a profile without measured operators: the experts' FLOPs x 1.5.
  const double expert_flops = 3.0 * m.context * 2 * 2 * 3 * 4096 * 14336;  // fwd + bwd per sequence: top-2 of 3 h x f
  EXPECT_NEAR(evaluate(m, w, ep, machine).time.compute - split.time.compute,
              0.5 * expert_flops * split.ranks[1].moe_layers * (64.0 / 8) /  // sequences per data rank
                  (machine.peak_flops * machine.mfu),
              1e-6 * split.time.compute);
  EXPECT_EQ(evaluate(m, w, dense, machine).time.compute, replicated.time.compute);
  EXPECT_EQ(rank_moe_load(m, w, 8), 1.5);
  EXPECT_EQ(rank_moe_load(m, w, 1), 1.0);  // min(load, min(1, cf = 1.25))
  w.moe_kept = 0.75;
  EXPECT_EQ(rank_moe_load(m, w, 1), 0.75);
  EXPECT_EQ(rank_moe_load(m, w, 8), 1.5);
  EXPECT_LT(evaluate(m, w, dense, machine).worst.memory.activations, replicated.worst.memory.activations);
  w.moe_load = 0.5, w.moe_kept = 0;
  EXPECT_EQ(rank_moe_load(m, w, 1), 0.5);  // a measured load below balance stands
  // Training's load at each degree holds where it names the degree.
  w.moe_load_by_ep = {{1, 0.9}, {2, 1.1}, {4, 1.3}, {8, 1.7}};
  EXPECT_EQ(rank_moe_load(m, w, 1), 0.9);
  EXPECT_EQ(rank_moe_load(m, w, 4), 1.3);
  EXPECT_EQ(rank_moe_load(m, w, 8), 1.7);
  const double at_four = evaluate(m, w, Layout::parse("ep=4"), machine).worst.memory.activations;
  w.moe_load_by_ep = {{4, 1.0}};
  EXPECT_GT(at_four, evaluate(m, w, Layout::parse("ep=4"), machine).worst.memory.activations);
  w.moe_load_by_ep.clear();
  // The rules: ep divides the experts; ep with ZeRO or tp is refused.
  EXPECT_NE(error_of([&] { check_layout(m, Layout::parse("ep=3"), 1); }).find("does not divide model.moe_experts (8)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { check_layout(model::GptConfig::preset("llama2-7b"), Layout::parse("ep=2"), 1); })
                .find("needs a mixture-of-experts model"),
            std::string::npos);
}

// The busiest rank's load at each expert parallel degree (training's
// rank_load_by_ep, the planner's input), by hand: 8 assignments routed, kept
// 4, 2, 1, 1 on four experts.
TEST(PlanMoe, BusiestRankLoadAtEachDegreeFromTheKeptAssignments) {
  const std::vector<double> kept = {4, 2, 1, 1};
  EXPECT_DOUBLE_EQ(parallel::busiest_rank_load(kept, 8, 1), 1.0);        // one rank keeps all
  EXPECT_DOUBLE_EQ(parallel::busiest_rank_load(kept, 8, 2), 2 * 6 / 8.0);  // experts 0 and 1 on one rank
  EXPECT_DOUBLE_EQ(parallel::busiest_rank_load(kept, 8, 4), 4 * 4 / 8.0);  // expert 0 alone
  EXPECT_DOUBLE_EQ(parallel::busiest_rank_load(kept, 16, 4), 4 * 4 / 16.0);  // half the assignments dropped
  EXPECT_EQ(parallel::busiest_rank_load(kept, 8, 3), 0.0);               // 3 does not divide 4 experts
  EXPECT_EQ(parallel::busiest_rank_load(kept, 0, 2), 0.0);
}

// The load the all-to-alls wait for, from token streams grouped as ep ranks
// exchange one micro-batch's: four streams of 4 assignments on two experts,
// the first two all to expert 0, the last two all to expert 1. Pooled, the
// two experts are balanced (1.0); grouped at ep = 2, each group's tokens all
// go to one rank (2.0). Over several forwards the step waits for its slowest
// group.
TEST(PlanMoe, GroupedRankLoadKeepsEachGroupsBusiestRank) {
  const std::vector<std::vector<double>> kept = {{4, 0}, {4, 0}, {0, 4}, {0, 4}};
  const std::vector<double> routed = {4, 4, 4, 4};
  EXPECT_DOUBLE_EQ(parallel::busiest_rank_load({8, 8}, 16, 2), 1.0);      // pooled
  EXPECT_DOUBLE_EQ(parallel::grouped_rank_load(kept, routed, 2, 4), 2.0);  // (0, 1) and (2, 3)
  EXPECT_DOUBLE_EQ(parallel::grouped_rank_load(kept, routed, 1, 4), 1.0);  // each stream alone keeps all
  // Two forwards of four streams: group 0 busy in both, group 1 balanced in both: the slowest, not the mean 1.5.
  const std::vector<std::vector<double>> steady = {{4, 0}, {4, 0}, {4, 0}, {0, 4}, {4, 0}, {4, 0}, {4, 0}, {0, 4}};
  const std::vector<double> eight(8, 4.0);
  EXPECT_DOUBLE_EQ(parallel::grouped_rank_load(steady, eight, 2, 4), 2.0);
  // Each group busy in one forward of two: 1.5 for both.
  const std::vector<std::vector<double>> turns = {{4, 0}, {4, 0}, {4, 0}, {0, 4}, {4, 0}, {0, 4}, {4, 0}, {4, 0}};
  EXPECT_DOUBLE_EQ(parallel::grouped_rank_load(turns, eight, 2, 4), 1.5);
  // Streams that routed nothing (another pipeline stage's) are skipped: (0, 2) and (3, 4).
  EXPECT_DOUBLE_EQ(parallel::grouped_rank_load({{4, 0}, {9, 9}, {0, 4}, {0, 4}, {4, 0}}, {4, 0, 4, 4, 4}, 2, 5), 1.0);
  // Fewer streams than ep, or a count ep does not divide: consecutive sources across forwards, a partial
  // last group left out.
  EXPECT_DOUBLE_EQ(parallel::grouped_rank_load({{4, 0}}, {4}, 2, 1), 2.0);
  EXPECT_DOUBLE_EQ(parallel::grouped_rank_load({{4, 0}, {0, 4}}, {4, 4}, 2, 1), 1.0);  // one stream, two forwards
  EXPECT_DOUBLE_EQ(parallel::grouped_rank_load({{4, 0}, {4, 0}, {0, 4}}, {4, 4, 4}, 2, 3), 2.0);
  EXPECT_EQ(parallel::grouped_rank_load(kept, routed, 3, 4), 0.0);  // 3 does not divide 2 experts
  EXPECT_EQ(parallel::grouped_rank_load({}, {}, 2, 4), 0.0);
}

TEST(PlanMoe, SearchConsidersExpertParallel) {
  const model::GptConfig m = model::GptConfig::preset("mixtral-8x7b");
  Workload w;
  w.global_batch = default_global_batch(m, 64);
  const SearchResult result = search(m, w, Machine(), 64);
  ASSERT_FALSE(result.fitting.empty());
  bool any_ep = false;
  for (const Candidate& c : result.fitting) any_ep = any_ep || c.layout.dims.ep > 1;
  EXPECT_TRUE(any_ep);
  for (const Candidate& c : result.fitting) EXPECT_EQ(m.moe_experts % c.layout.dims.ep, 0);
}

}  // namespace
}  // namespace meshtrain::plan
