// Pipeline schedules, their validator, stage splitting, and activation
// checkpointing: single-process logic.
#include "meshtrain/model/gpt.h"
#include "meshtrain/parallel/activation_checkpoint.h"
#include "meshtrain/parallel/pipeline/schedule.h"
#include "meshtrain/parallel/pipeline/stages.h"
#include "meshtrain/parallel/pipeline/trace.h"
#include "meshtrain/util/memory.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

namespace meshtrain::parallel {
namespace {

using namespace pipeline;

TEST(PipelineSchedule, EveryScheduleIsValidWithItsBubbleAndStash) {
  for (int p = 1; p <= 4; ++p) {
    for (int m = 1; m <= 9; ++m) {
      const double theory = theoretical_bubble(p, 1, m);
      for (const Schedule& s : {gpipe(p, m), one_f_one_b(p, m)}) {
        const ScheduleReport r = validate(s, 1.0, 2.0);
        for (int rank = 0; rank < p; ++rank) {
          EXPECT_NEAR(r.bubble[rank], theory, 1e-9) << s.name << " p=" << p << " m=" << m << " rank " << rank;
        }
        if (s.name == "gpipe") EXPECT_EQ(r.peak_stashed[0], m);
        else EXPECT_EQ(r.peak_stashed[0], std::min(p, m)) << "p=" << p << " m=" << m;
        for (int rank = 0; rank < p && s.name == "1f1b"; ++rank) EXPECT_LE(r.peak_stashed[rank], p - rank);
        // Losses waiting for their backward at once (Note [Chunked loss]).
        EXPECT_EQ(losses_in_flight(s), s.name == "gpipe" ? m : 1) << s.name << " p=" << p << " m=" << m;
      }
      for (int v = 2; v <= 3 && p >= 2; ++v) {
        if (m % p != 0) {
          EXPECT_THROW(interleaved_1f1b(p, v, m), ScheduleError);
          continue;
        }
        const ScheduleReport r = validate(interleaved_1f1b(p, v, m), 1.0, 2.0);
        for (int rank = 0; rank < p; ++rank) EXPECT_LE(r.peak_stashed[rank], 2 * (p - rank - 1) + (v - 1) * p + 1);
        // Interleaving divides the bubble by about v.
        EXPECT_LT(r.mean_bubble(), theory) << "p=" << p << " v=" << v << " m=" << m;
        EXPECT_NEAR(r.mean_bubble(), theoretical_bubble(p, v, m), 0.35 * theoretical_bubble(p, v, m))
            << "p=" << p << " v=" << v << " m=" << m;
      }
      validate(forward_only(p, 1, m));
    }
  }
}

TEST(PipelineSchedule, BrokenSchedulesAreRejected) {
  auto expect_error = [](const Schedule& s, const std::string& words) {
    try {
      validate(s);
      ADD_FAILURE() << "accepted: " << words;
    } catch (const ScheduleError& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  // A missing receive: rank 1 computes micro-batch 0 without receiving its input.
  Schedule missing = one_f_one_b(2, 4);
  auto& r1 = missing.actions[1];
  r1.erase(std::find(r1.begin(), r1.end(), Action{ActionKind::kRecvActivation, 1, 0}));
  expect_error(missing, "never received");
  // A cycle: rank 0 waits for the gradient of micro-batch 0 before sending its activation.
  Schedule cycle = gpipe(2, 1);
  auto& r0 = cycle.actions[0];
  std::swap(r0[1], r0[2]);  // F0, recvG0, sendA0, B0
  expect_error(cycle, "deadlock");
  // Receives in another order than the sends.
  Schedule order = gpipe(2, 2);
  auto& recv = order.actions[1];
  std::swap(recv[0], recv[2]);  // recvA1, F0 ... recvA0: out of order
  std::swap(recv[1], recv[3]);
  expect_error(order, "send order");
  // A micro-batch the step does not have.
  Schedule orphan = gpipe(2, 2);
  orphan.actions[0].push_back({ActionKind::kSendActivation, 0, 5});
  expect_error(orphan, "out of range");
  Schedule twice = gpipe(2, 2);
  twice.actions[0].push_back(twice.actions[0].front());
  expect_error(twice, "appears twice");
  Schedule wrong_rank = gpipe(2, 2);
  wrong_rank.actions[0].push_back({ActionKind::kForward, 1, 0});
  expect_error(wrong_rank, "runs on rank 1");
  EXPECT_THROW(make_schedule("zigzag", 2, 1, 4), ScheduleError);
  EXPECT_THROW(make_schedule("1f1b", 2, 2, 4), ScheduleError);
}

TEST(PipelineStages, BalanceAndUserSplits) {
  // Eight equal blocks, a heavy head: the last stage takes fewer blocks.
  std::vector<double> costs = {1, 1, 1, 1, 1, 1, 1, 1, 1, 5};
  EXPECT_EQ(balance(costs, 2), (std::vector<int64_t>{6, 2}));
  EXPECT_EQ(balance({0, 1, 1, 1, 1, 0}, 4), (std::vector<int64_t>{1, 1, 1, 1}));
  EXPECT_THROW(balance({0, 1, 1, 0}, 3), std::invalid_argument);
  EXPECT_EQ(parse_split("3,1", 4, 2), (std::vector<int64_t>{3, 1}));
  EXPECT_THROW(parse_split("3,2", 4, 2), std::invalid_argument);
  EXPECT_THROW(parse_split("4", 4, 2), std::invalid_argument);
  EXPECT_THROW(parse_split("2,x", 4, 2), std::invalid_argument);
  EXPECT_THROW(parse_split("4,0", 4, 2), std::invalid_argument);
  const std::vector<StageSpec> specs = stage_specs({2, 1, 1});
  EXPECT_EQ(specs[0].str(), "embed+blocks 0-1");
  EXPECT_EQ(specs[2].str(), "blocks 3+head");

  // Kept stages run as the whole model does, piece by piece, to the loss.
  model::GptConfig config = model::GptConfig::preset("tiny");
  config.layers = 4;
  model::Gpt whole(config, 3), last(config, 3);
  keep_stages(last, {specs[2]});
  std::vector<std::string> names;
  for (const auto& item : last->named_parameters()) names.push_back(item.key());
  for (const std::string& name : names) {
    EXPECT_TRUE(name.rfind("blocks.3.", 0) == 0 || name.rfind("norm_f.", 0) == 0 || name == "wte.weight") << name;
  }
  const at::Tensor tokens = at::randint(0, config.vocab_size, {2, 8}, at::kLong);
  const model::Batch batch(tokens, tokens.roll(-1, 1));
  at::Tensor x = whole->embed(batch);
  for (int i = 0; i < 3; ++i) x = whole->block(i, x, batch);
  for (model::LossGradients when : {model::LossGradients::kInForward, model::LossGradients::kInBackward}) {
    EXPECT_TRUE(at::allclose(run_stage(last, specs[2], x, batch, when), whole->loss(batch), 1e-6, 1e-6));
  }
}

TEST(PipelineTrace, ChromeTraceRoundTripsAndDraws) {
  std::vector<std::vector<Span>> ranks = {{{SpanKind::kForward, 0, 0, 10.0, 10.5}, {SpanKind::kBackward, 0, 0, 11.0, 12.0}},
                                          {{SpanKind::kRecv, 1, 0, 10.0, 10.5}, {SpanKind::kForward, 1, 0, 10.5, 11.0}}};
  const auto back = read_chrome_trace(chrome_trace(ranks));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[1][0].kind, SpanKind::kRecv);
  EXPECT_NEAR(back[0][1].end - back[0][0].start, 2.0, 1e-9);
  EXPECT_NEAR(measured_bubble(back)[0], 0.25, 1e-9);
  const std::string svg = timeline_svg(back, "t");
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_NE(svg.find("rank 1"), std::string::npos);
  EXPECT_THROW(read_chrome_trace("{}"), std::runtime_error);
}

// Gradients of every parameter, and the counted peak of forward + backward.
std::pair<std::map<std::string, at::Tensor>, int64_t> run(const model::GptConfig& config, CheckpointMode mode) {
  model::Gpt gpt(config, 5);
  if (mode != CheckpointMode::kNone) apply_activation_checkpoint(gpt, mode);
  at::manual_seed(9);  // dropout masks
  const at::Tensor tokens = at::randint(0, config.vocab_size, {4, config.context}, at::kLong);
  memory::reset_peaks();
  const int64_t before = memory::current_bytes();
  gpt->loss(tokens, tokens.roll(1, 1)).backward();
  const int64_t peak = memory::peak_bytes() - before;
  std::map<std::string, at::Tensor> grads;
  for (const auto& item : gpt->named_parameters()) grads[item.key()] = item.value().grad().clone();
  return {grads, peak};
}

TEST(ActivationCheckpoint, SameGradientsLessMemory) {
  memory::install();
  for (const std::string preset : {"tiny", "llama-tiny"}) {
    model::GptConfig config = model::GptConfig::preset(preset);
    config.layers = 4;
    config.context = 64;
    config.dropout = 0.1;  // the recompute must draw the same masks
    const auto [plain, plain_peak] = run(config, CheckpointMode::kNone);
    for (CheckpointMode mode : {CheckpointMode::kFull, CheckpointMode::kSelective}) {
      const auto [grads, peak] = run(config, mode);
      for (const auto& [name, g] : plain) {
        EXPECT_TRUE(at::allclose(grads.at(name), g, 1e-5, 1e-6)) << preset << " " << name;
      }
      EXPECT_LT(peak, plain_peak) << preset << " mode " << int(mode);
      std::printf("[ activation checkpoint ] %s %s: counted peak %.2f MiB vs %.2f MiB without\n", preset.c_str(),
                  mode == CheckpointMode::kFull ? "full" : "selective", peak / 1048576.0, plain_peak / 1048576.0);
    }
  }
  EXPECT_THROW(parse_checkpoint_mode("most"), std::invalid_argument);
}

// Selective recompute also makes each gated MLP's GLU output again in its
// down projection's backward (Note [The GLU's output made again]): after the
// forward the model keeps one hidden-sized tensor per block fewer than with
// attention's recompute alone, and the gradients are the same.
TEST(ActivationCheckpoint, SelectiveMakesTheGluOutputAgain) {
  memory::install();
  model::GptConfig config = model::GptConfig::preset("llama-tiny");
  config.layers = 3;
  config.context = 64;
  auto kept_and_grads = [&](bool glu_again) {
    model::Gpt gpt(config, 5);
    apply_activation_checkpoint(gpt, CheckpointMode::kSelective);
    if (!glu_again) {
      for (int64_t b = 0; b < config.layers; ++b) gpt->make_glu_output_again(b, false);
    }
    const at::Tensor tokens = at::randint(0, config.vocab_size, {4, config.context},
                                          at::make_generator<at::CPUGeneratorImpl>(9), at::kLong);
    const int64_t before = memory::current_bytes();
    const at::Tensor loss = gpt->loss(tokens, tokens.roll(1, 1));
    const int64_t kept = memory::current_bytes() - before;
    loss.backward();
    std::map<std::string, at::Tensor> grads;
    for (const auto& item : gpt->named_parameters()) grads[item.key()] = item.value().grad().clone();
    return std::make_pair(kept, grads);
  };
  const auto [again, grads] = kept_and_grads(true);
  const auto [kept, reference] = kept_and_grads(false);
  EXPECT_EQ(kept - again, config.layers * 4 * config.context * config.mlp_hidden() * 4);
  for (const auto& [name, g] : reference) EXPECT_TRUE(at::allclose(grads.at(name), g, 1e-5, 1e-6)) << name;
}

// Losses of three steps under bfloat16 autocast, with a plain gradient step
// between them, as the trainer runs them: the forward inside autocast, the
// backward outside it.
std::vector<double> autocast_losses(const model::GptConfig& config, CheckpointMode mode) {
  model::Gpt gpt(config, 5);
  if (mode != CheckpointMode::kNone) apply_activation_checkpoint(gpt, mode);
  at::manual_seed(9);
  const at::Tensor tokens = at::randint(0, config.vocab_size, {4, config.context}, at::kLong);
  std::vector<double> losses;
  for (int step = 0; step < 3; ++step) {
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::Tensor loss = gpt->loss(tokens, tokens.roll(1, 1));
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    loss.backward();
    losses.push_back(loss.item<double>());
    torch::NoGradGuard no_grad;
    for (at::Tensor p : gpt->parameters()) {
      p.sub_(p.grad() * 0.5);
      p.grad().zero_();
    }
  }
  return losses;
}

// The recompute's casts of the weights must not outlive the backward: a
// cached bfloat16 copy would stand in for the updated weights in the next
// step's forward.
TEST(ActivationCheckpoint, AutocastRecomputeUsesEachStepsWeights) {
  for (const std::string preset : {"tiny", "llama-tiny"}) {
    model::GptConfig config = model::GptConfig::preset(preset);
    config.layers = 2;
    config.context = 32;
    const std::vector<double> plain = autocast_losses(config, CheckpointMode::kNone);
    const std::vector<double> full = autocast_losses(config, CheckpointMode::kFull);
    EXPECT_GT(std::abs(plain[2] - plain[0]), 0.1) << preset << ": the steps must move the loss";
    for (size_t i = 0; i < plain.size(); ++i) EXPECT_NEAR(full[i], plain[i], 1e-3 * std::abs(plain[i])) << preset << " step " << i;
  }
}

}  // namespace
}  // namespace meshtrain::parallel
