// Note [Operator time], by hand: the fit, a block's operators on a tiny GPT
// under tensor and context parallel, the step they make, and the profile file.
#include "meshtrain/plan/operator_time.h"

#include "meshtrain/plan/search.h"
#include "tests/harness/error_of.h"

#include <gtest/gtest.h>

namespace meshtrain::plan {
namespace {

using testing::error_of;

// h 64, 4 heads of 16, ffn 256 (GELU), context 32, vocabulary 128, fp32.
model::GptConfig tiny() {
  model::GptConfig m;
  m.vocab_size = 128;
  m.context = 32;
  m.layers = 2;
  m.heads = 4;
  m.width = 64;
  return m;
}

Workload fp32() {
  Workload w;
  w.precision = Precision::parse("fp32");
  w.global_batch = 8;
  return w;
}

OperatorRates rates() {
  OperatorRates r;
  r.matmul_flops = 1e9, r.matmul_call = 1e-5;
  r.attention_flops = 5e8, r.attention_call = 2e-5;
  r.elementwise_bytes = 1e9, r.elementwise_call = 1e-6;
  return r;
}

TEST(PlanOperatorTime, FitRecoversCallAndRate) {
  const std::vector<double> work{1e6, 1e7, 1e8, 1e9};
  std::vector<double> seconds;
  for (double w : work) seconds.push_back(3e-5 + w / 2e9);
  const Fit fit = fit_rate(work, seconds);
  EXPECT_NEAR(fit.rate, 2e9, 1e-6 * 2e9);
  EXPECT_NEAR(fit.call, 3e-5, 1e-9);
  // Times that would need a negative cost per call: none, and the rate alone fitted.
  const Fit no_call = fit_rate({1e6, 1e8}, {0.5e-3, 0.1});
  EXPECT_EQ(no_call.call, 0);
  EXPECT_GT(no_call.rate, 1e9);
  EXPECT_LT(no_call.rate, 2e9);
}

// tp = 2, micro-batch 2: 64 rows. q, k, v and out: 64 x 64 x 32 each; the
// MLP's two: 64 x 64 x 128. Attention: 2 heads of the rank, one causal call
// over 32 keys. Elementwise: two add-norms of 4 words x 64 wide x 64 rows and
// GELU's 2 words x 128 x 64, three calls.
TEST(PlanOperatorTime, ABlockUnderTensorParallelByHand) {
  const Layout l = Layout::parse("tp=2 mb=2");
  const OperatorRates r = rates();
  const double products = 4 * 2.0 * 64 * 64 * 32 + 2 * 2.0 * 64 * 64 * 128;
  const double half_tile = 4.0 * 2 * 2 * 32 * 32 * 16 / 2;
  const double bytes = 4.0 * (2 * 4 * 64 * 64 + 2 * 128 * 64);
  const Work w = block_work(tiny(), false, l, fp32(), r);
  EXPECT_NEAR(w.forward, 6 * 1e-5 + products / 1e9 + 2e-5 + half_tile / 5e8 + 3 * 1e-6 + bytes / 1e9, 1e-12);
  EXPECT_NEAR(w.backward, 12 * 1e-5 + 2 * products / 1e9 + 2e-5 + 2 * half_tile / 5e8 + 6 * 1e-6 + 1.5 * bytes / 1e9,
              1e-12);
  EXPECT_EQ(w.recompute, 0);
  // Sequence parallel splits the add-norms' rows; full recompute repeats the forward.
  Layout sp = Layout::parse("tp=2 sp mb=2 recompute=full");
  const Work s = block_work(tiny(), false, sp, fp32(), r);
  EXPECT_NEAR(w.forward - s.forward, 4.0 * 2 * 4 * 64 * 32 / 1e9, 1e-12);
  EXPECT_NEAR(s.recompute, s.forward, 1e-15);
  EXPECT_NEAR(s.backward - s.recompute, w.backward - 1.5 * 4.0 * 2 * 4 * 64 * 32 / 1e9, 1e-12);
}

// Selective recompute repeats the attention core; where the down projection
// makes the GLU's output again (Note [The GLU's output made again]: SwiGLU,
// the fused operators, no LoRA) also one elementwise pass of 3 words per
// hidden unit: 64 rows x 256 / 2 hidden, fp32.
TEST(PlanOperatorTime, SelectiveMakesTheGlusOutputAgainByHand) {
  model::GptConfig swiglu = tiny();
  swiglu.mlp = model::MlpStyle::kSwiglu;
  swiglu.ffn_hidden = 256;
  const Layout l = Layout::parse("tp=2 mb=2 recompute=selective");
  const OperatorRates r = rates();
  const Work core = block_work(tiny(), false, l, fp32(), r);  // GELU: the core alone
  const double half_tile = 4.0 * 2 * 2 * 32 * 32 * 16 / 2;
  EXPECT_NEAR(core.recompute, 2e-5 + half_tile / 5e8, 1e-15);
  const Work glu = block_work(swiglu, false, l, fp32(), r);
  EXPECT_NEAR(glu.recompute, 2e-5 + half_tile / 5e8 + 1e-6 + 4.0 * 3 * 128 * 64 / 1e9, 1e-15);
  Workload unfused = fp32();
  unfused.fused_ops = false;
  EXPECT_NEAR(block_work(swiglu, false, l, unfused, r).recompute, core.recompute, 1e-15);
}

// cp = 2 (a ring, zigzag): 32 rows, 4 heads; the rank's two chunks of 8
// meet 5 key chunks, the two diagonal ones with a mask at a full tile's cost:
// 5 full 8 x 8 tiles in 5 calls, 3 merges of 17 calls over 7 passes of a
// chunk's fp32 output, and in the backward 3 sums of 3 chunk-sized gradients
// per tile. At 4096 rows a chunk is 1024, two segments of 512 (the ring's
// tile limit): 3 pairs off the diagonal of 4 tiles and 2 on it of 3, 18
// tiles, 14 merges.
TEST(PlanOperatorTime, ARingsTilesAndMergesByHand) {
  OperatorRates r = rates();
  r.matmul_flops = 1e30, r.matmul_call = 0;  // products free: the attention and the passes alone
  const Layout l = Layout::parse("cp=2 mb=2");
  const double tile = 4.0 * 2 * 4 * 8 * 8 * 16, out = 4.0 * 2 * 4 * 8 * 16;
  const double passes = 4.0 * (2 * 4 * 64 * 32 + 2 * 256 * 32);
  const Work w = block_work(tiny(), false, l, fp32(), r);
  EXPECT_NEAR(w.forward, 5 * 2e-5 + 5 * tile / 5e8 + 51 * 1e-6 + 3 * 7 * out / 1e9 + 3 * 1e-6 + passes / 1e9, 1e-12);
  EXPECT_NEAR(w.backward,
              5 * 2e-5 + 10 * tile / 5e8 + 15 * 1e-6 + 5 * 9 * out / 1e9 + 6 * 1e-6 + 1.5 * passes / 1e9, 1e-12);
  // The long sequence, elementwise free: the kernel's calls and work alone.
  r.elementwise_bytes = 1e30, r.elementwise_call = 0;
  model::GptConfig long_context = tiny();
  long_context.context = 4096;
  const Work big = block_work(long_context, false, Layout::parse("cp=2 mb=1"), fp32(), r);
  const double segment_tile = 4.0 * 1 * 4 * 512 * 512 * 16;
  EXPECT_NEAR(big.forward, 18 * 2e-5 + 18 * segment_tile / 5e8, 1e-9);
  EXPECT_NEAR(big.backward, 18 * 2e-5 + 36 * segment_tile / 5e8, 1e-9);
}

// The step: every rank's micro-batches through its blocks and the head, and
// AdamW over its parameters (a quarter under ZeRO over 4), times the overhead.
TEST(PlanOperatorTime, AStepIsItsOperatorsTimesTheOverhead) {
  Machine machine;
  machine.operators = rates();
  machine.operators.overhead = 1.5;
  machine.operators.precision = "fp32";
  const model::GptConfig m = tiny();
  const Workload w = fp32();
  for (const char* layout : {"dp=4 mb=1", "zero=1 fsdp=4 mb=1"}) {
    const Layout l = Layout::parse(layout);
    const Candidate c = evaluate(m, w, l, machine);
    ASSERT_EQ(c.microbatches, 2);
    const Work block = block_work(m, false, l, w, machine.operators), head = head_work(m, l, w, c.ranks[0].loss_in_backward, machine.operators);
    const double shards = l.dims.zero_stage > 0 ? 4 : 1;
    const double update = optimizer_seconds(c.ranks[0].parameter_count / shards, w, machine.operators);
    EXPECT_NEAR(update, c.ranks[0].parameter_count / shards * 32 / 1e9, 1e-15) << "28 bytes of AdamW, 4 of the norm's read";
    const double expected = 1.5 * 2 * (2 * (block.forward + block.backward) + head.forward + head.backward);
    EXPECT_NEAR(c.time.compute, expected, 1e-12 * expected) << layout;
    EXPECT_NEAR(c.time.optimizer, 1.5 * update, 1e-15) << layout;
  }
  // Measured in another precision: the FLOPs at peak x MFU, as without a measurement.
  machine.operators.precision = "bf16-mixed";
  const Candidate flops = evaluate(m, w, Layout::parse("dp=4 mb=1"), machine);
  const double head = m.head_training_flops() * (flops.ranks[0].loss_in_backward ? 4.0 / 3 : 1.0);
  const double per_sequence = 2 * m.block_training_flops() + head;
  EXPECT_NEAR(flops.time.compute, 2 * per_sequence / (machine.peak_flops * machine.mfu), 1e-9 * flops.time.compute);
}

TEST(PlanOperatorTime, ProfileKeepsTheRatesAndRejectsBadOnes) {
  Machine m;
  m.operators = rates();
  m.operators.overhead = 1.25;
  m.operators.precision = "bf16-mixed";
  const Machine back = Machine::from_json(m.to_json());
  EXPECT_EQ(back.operators.matmul_flops, 1e9);
  EXPECT_EQ(back.operators.matmul_call, 1e-5);
  EXPECT_EQ(back.operators.attention_flops, 5e8);
  EXPECT_EQ(back.operators.attention_call, 2e-5);
  EXPECT_EQ(back.operators.elementwise_bytes, 1e9);
  EXPECT_EQ(back.operators.elementwise_call, 1e-6);
  EXPECT_EQ(back.operators.overhead, 1.25);
  EXPECT_EQ(back.operators.precision, "bf16-mixed");
  EXPECT_FALSE(Machine::from_json(Machine().to_json()).operators.measured());
  const std::string missing = R"({"operators": {"matmul_flops": 1e9, "attention_flops": 1e9, "overhead": 1}})";
  EXPECT_NE(error_of([&] { Machine::from_json(missing); }).find("'operators.elementwise_bytes' is missing"), std::string::npos);
  const std::string negative =
      R"({"operators": {"matmul_flops": 1e9, "attention_flops": 1e9, "elementwise_bytes": 1e9, "overhead": 1, "matmul_call": -1}})";
  EXPECT_NE(error_of([&] { Machine::from_json(negative); }).find("'operators.matmul_call' must be a non-negative number"),
            std::string::npos);
  EXPECT_NE(error_of([] { Machine::from_json(R"({"operators": 3})"); }).find("'operators' must be an object"), std::string::npos);
}

}  // namespace
}  // namespace meshtrain::plan
