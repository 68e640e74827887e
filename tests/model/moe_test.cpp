// The mixture-of-experts layer alone: parameter counts, capacity and dropped
// tokens against hand-computed numbers, pass-through of dropped tokens, the
// router's gradient from the main loss, experts that get no tokens, dropless
// routing under extreme imbalance, GShard's random second expert, and the
// layer against a direct computation and, through the fused SwiGLU / GeGLU,
// against the composed operators with gradients.
#include "meshtrain/model/gpt.h"
#include "tests/model/parameter_count.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>

namespace meshtrain::model {
namespace {

GptConfig moe_config(int64_t experts, int64_t top_k, double capacity_factor) {
  GptConfig c = GptConfig::preset("tiny");
  c.width = 32;
  c.heads = 4;
  c.layers = 2;
  c.moe_experts = experts;
  c.moe_top_k = top_k;
  c.moe_capacity_factor = capacity_factor;
  c.moe_hidden = 48;
  return c;
}

// A layer built alone has zero weights (the model initialises them): random ones.
Moe random_moe(const GptConfig& c, uint64_t seed) {
  Moe moe(c);
  torch::NoGradGuard no_grad;
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  moe->router.normal_(0, 0.5, g);
  for (at::Tensor w : moe->expert_weights()) w.normal_(0, 0.1, g);
  return moe;
}

// Every token's router logits favour expert 0 by `margin` (the inputs all
// have a positive first coordinate, router row 0 reads it).
void skew_to_expert_zero(Moe& moe, double margin = 10.0) {
  torch::NoGradGuard no_grad;
  moe->router.zero_();
  moe->router[0][0] = margin;
}

at::Tensor positive_tokens(int64_t n, int64_t width, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor x = at::randn({1, n, width}, g);
  x.select(2, 0).fill_(1.0);
  return x;
}

// Records the tokens per expert each forward hands over.
struct RecordingExchange : ExpertExchange {
  at::Tensor run(const at::Tensor& tokens, const std::vector<int64_t>& counts, const ExpertCompute& compute) override {
    last_counts = counts;
    return compute(tokens, counts, 0);
  }
  std::vector<int64_t> last_counts;
};

TEST(Moe, ParameterCountsMatchTheBuiltModel) {
  for (const MlpStyle mlp : {MlpStyle::kGelu, MlpStyle::kSwiglu}) {
    for (bool bias : {true, false}) {
      GptConfig c = moe_config(4, 2, 1.0);
      c.mlp = mlp;
      c.bias = bias;
      c.layers = 4;
      Gpt model(c, 1);
      EXPECT_EQ(counted(*model), c.parameter_count()) << name(mlp) << (bias ? " bias" : "");
      EXPECT_EQ(model->moe_layers().size(), 2u);  // blocks 1 and 3
      GptConfig dense_with_two = c;
      dense_with_two.moe_experts = 2;  // two experts, both used: every expert parameter active
      EXPECT_EQ(dense_with_two.active_parameter_count(), dense_with_two.parameter_count());
      EXPECT_LT(c.active_parameter_count(), c.parameter_count());
    }
  }
}

TEST(Moe, CapacityDropsTheHandComputedShareAndDroppedTokensPassThrough) {
  GptConfig c = moe_config(4, 1, 1.0);
  Moe moe = random_moe(c, 1);
  skew_to_expert_zero(moe);
  const int64_t n = 40;  // capacity ceil(40 * 1 * 1.0 / 4) = 10
  const at::Tensor x = positive_tokens(n, c.width, 3);
  const at::Tensor out = moe->forward(x);
  EXPECT_NEAR(moe->stats().dropped, 0.75, 1e-12);         // 30 of 40 assignments over capacity
  EXPECT_NEAR(moe->stats().load_max_over_mean, 4.0, 1e-12);  // all 40 on one of 4 experts
  // Kept per expert in the one forward: the 10 within capacity, all on expert 0, of 40 routed.
  EXPECT_EQ(moe->stats().kept, (std::vector<std::vector<double>>{{10, 0, 0, 0}}));
  EXPECT_EQ(moe->stats().routed_by_forward, std::vector<double>{40.0});
  EXPECT_EQ(moe->stats().routed, 40.0);
  const at::Tensor rows = out.view({n, c.width});
  for (int64_t t = 0; t < n; ++t) {
    const double size = rows[t].abs().sum().item<double>();
    if (t < 10) EXPECT_GT(size, 0.0) << "token " << t << " is within capacity";
    else EXPECT_EQ(size, 0.0) << "token " << t << " was dropped: the block's residual must pass it unchanged";
  }
}

TEST(Moe, DroplessKeepsEveryTokenUnderExtremeImbalance) {
  GptConfig c = moe_config(4, 1, 0.0);
  Moe moe = random_moe(c, 2);
  skew_to_expert_zero(moe);
  auto recording = std::make_shared<RecordingExchange>();
  moe->set_exchange(recording);
  const at::Tensor out = moe->forward(positive_tokens(40, c.width, 4));
  EXPECT_EQ(moe->stats().dropped, 0.0);
  EXPECT_EQ(recording->last_counts, (std::vector<int64_t>{40, 0, 0, 0}));
  EXPECT_GT(out.view({40, c.width}).abs().sum(1).min().item<double>(), 0.0);
}

TEST(Moe, EqualsTheGatedExpertComputedDirectly) {
  for (const MlpStyle mlp : {MlpStyle::kGelu, MlpStyle::kSwiglu}) {
    GptConfig c = moe_config(4, 1, 0.0);
    c.mlp = mlp;
    Gpt model(c, 5);  // initialised weights
    Moe moe = model->moe_layers().front();
    const at::Tensor x = positive_tokens(12, c.width, 6);
    const at::Tensor out = moe->forward(x).view({12, c.width});
    const at::Tensor probs = at::softmax(at::linear(x.view({12, c.width}), moe->router), -1);
    for (int64_t t = 0; t < 12; ++t) {
      const int64_t e = probs[t].argmax().item<int64_t>();
      const at::Tensor xt = x.view({12, c.width})[t];
      at::Tensor y;
      if (mlp == MlpStyle::kGelu) {
        y = at::linear(at::gelu(at::linear(xt, moe->fc_weight[e], moe->fc_bias[e]), "tanh"), moe->proj_weight[e],
                       moe->proj_bias[e]);
      } else {
        y = at::linear(at::silu(at::linear(xt, moe->gate_weight[e], moe->gate_bias[e])) *
                           at::linear(xt, moe->up_weight[e], moe->up_bias[e]),
                       moe->down_weight[e], moe->down_bias[e]);
      }
      EXPECT_TRUE(at::allclose(out[t], probs[t][e] * y, 1e-5, 1e-6)) << name(mlp) << " token " << t;
    }
  }
}

// Note [Grouped experts]: the grouped products' gradients (input, router,
// every expert tensor with its bias, an idle expert's zero) against the same
// top-1 layer written token by token with ATen operators on copies of its weights.
TEST(Moe, GroupedExpertsGradientsEqualTheTokenByTokenComposition) {
  for (const MlpStyle mlp : {MlpStyle::kGelu, MlpStyle::kSwiglu}) {
    GptConfig c = moe_config(4, 1, 0.0);
    c.mlp = mlp;
    c.moe_aux_loss = 0;
    c.moe_z_loss = 0;
    Moe moe = random_moe(c, 21);
    {
      torch::NoGradGuard no_grad;  // no token picks expert 3
      moe->router[3].zero_();
      moe->router[3][0] = -100.0;
    }
    const int64_t n = 16;
    const at::Tensor x = positive_tokens(n, c.width, 22).requires_grad_();
    const at::Tensor weights = at::randn({n, c.width}, at::make_generator<at::CPUGeneratorImpl>(23));
    (moe->forward(x).view({n, c.width}) * weights).sum().backward();

    const std::vector<at::Tensor> layer = moe->expert_weights();
    std::vector<at::Tensor> copies;
    for (const at::Tensor& t : layer) copies.push_back(t.detach().clone().requires_grad_());
    const at::Tensor router = moe->router.detach().clone().requires_grad_();
    const at::Tensor xr = x.detach().clone().view({n, c.width}).requires_grad_();
    auto tensor = [&](const at::Tensor& in_layer) {  // the copy of one of the layer's expert tensors
      for (size_t i = 0; i < layer.size(); ++i) {
        if (layer[i].is_same(in_layer)) return copies[i];
      }
      return at::Tensor();
    };
    const at::Tensor probs = at::softmax(at::linear(xr, router), -1);
    at::Tensor total = at::zeros({});
    for (int64_t t = 0; t < n; ++t) {
      const int64_t e = probs[t].argmax().item<int64_t>();
      const at::Tensor xt = xr[t];
      at::Tensor y;
      if (mlp == MlpStyle::kGelu) {
        y = at::linear(at::gelu(at::linear(xt, tensor(moe->fc_weight)[e], tensor(moe->fc_bias)[e]), "tanh"),
                       tensor(moe->proj_weight)[e], tensor(moe->proj_bias)[e]);
      } else {
        y = at::linear(at::silu(at::linear(xt, tensor(moe->gate_weight)[e], tensor(moe->gate_bias)[e])) *
                           at::linear(xt, tensor(moe->up_weight)[e], tensor(moe->up_bias)[e]),
                       tensor(moe->down_weight)[e], tensor(moe->down_bias)[e]);
      }
      total = total + (probs[t][e] * y * weights[t]).sum();
    }
    total.backward();
    const std::string style = name(mlp);
    EXPECT_TRUE(at::allclose(x.grad().view({n, c.width}), xr.grad(), 1e-4, 1e-6)) << style << " input gradient";
    EXPECT_TRUE(at::allclose(moe->router.grad(), router.grad(), 1e-4, 1e-6)) << style << " router";
    for (size_t i = 0; i < layer.size(); ++i) {
      EXPECT_TRUE(at::allclose(layer[i].grad(), copies[i].grad(), 1e-4, 1e-6)) << style << " expert tensor " << i;
      EXPECT_EQ(layer[i].grad()[3].abs().sum().item<double>(), 0.0) << style << " the idle expert";
    }
  }
}

// The experts through the fused SwiGLU / GeGLU, against the composition of
// ATen operators: output and every gradient, with one expert left idle and
// a shared expert.
TEST(Moe, FusedExpertsEqualTheComposedOnesWithGradients) {
  for (const MlpStyle mlp : {MlpStyle::kSwiglu, MlpStyle::kGeglu}) {
    GptConfig c = moe_config(6, 2, 0.0);
    c.mlp = mlp;
    c.dropout = 0.0;
    c.moe_second_expert = SecondExpert::kAlways;
    c.moe_shared_hidden = 16;
    c.fused = true;
    Moe fused = random_moe(c, 11);
    c.fused = false;
    Moe composed = random_moe(c, 11);
    for (Moe* moe : {&fused, &composed}) {  // no token picks expert 5 (every token's first coordinate is 1)
      torch::NoGradGuard no_grad;
      at::Generator g = at::make_generator<at::CPUGeneratorImpl>(13);
      for (at::Tensor w : {(*moe)->shared_gate, (*moe)->shared_up, (*moe)->shared_down}) w.normal_(0, 0.1, g);
      (*moe)->router[5].zero_();
      (*moe)->router[5][0] = -100.0;
    }
    const at::Tensor x = positive_tokens(20, c.width, 12);
    const at::Tensor weights = at::randn_like(x);
    std::vector<at::Tensor> inputs;
    std::vector<at::Tensor> outputs;
    for (Moe* moe : {&fused, &composed}) {
      inputs.push_back(x.clone().requires_grad_());
      outputs.push_back((*moe)->forward(inputs.back()));
      (outputs.back() * weights).sum().backward();
    }
    const std::string style = name(mlp);
    EXPECT_TRUE(at::allclose(outputs[0], outputs[1], 1e-5, 1e-6)) << style;
    EXPECT_TRUE(at::allclose(inputs[0].grad(), inputs[1].grad(), 1e-5, 1e-6)) << style << " input gradient";
    EXPECT_TRUE(at::allclose(fused->router.grad(), composed->router.grad(), 1e-5, 1e-6)) << style << " router";
    EXPECT_TRUE(at::allclose(fused->shared_gate.grad(), composed->shared_gate.grad(), 1e-5, 1e-6)) << style;
    const std::vector<at::Tensor> a = fused->expert_weights(), b = composed->expert_weights();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(at::allclose(a[i].grad(), b[i].grad(), 1e-5, 1e-6)) << style << " expert tensor " << i;
      EXPECT_EQ(a[i].grad()[5].abs().sum().item<double>(), 0.0) << style << " the idle expert";
    }
  }
}

TEST(Moe, RouterLearnsFromTheMainLossAndIdleExpertsGetZeroGradients) {
  GptConfig c = moe_config(4, 1, 0.0);
  c.moe_aux_loss = 0;
  c.moe_z_loss = 0;
  Moe moe = random_moe(c, 3);
  skew_to_expert_zero(moe, 2.0);
  moe->forward(positive_tokens(16, c.width, 7)).pow(2).sum().backward();
  EXPECT_GT(moe->router.grad().abs().sum().item<double>(), 0.0) << "the router gets no gradient from the main loss";
  for (const at::Tensor& w : moe->expert_weights()) {
    ASSERT_TRUE(w.grad().defined());
    EXPECT_GT(w.grad()[0].abs().sum().item<double>(), 0.0);
    EXPECT_EQ(w.grad().narrow(0, 1, 3).abs().sum().item<double>(), 0.0);  // no tokens, zero gradient
  }
}

TEST(Moe, AuxiliaryLossesReachTheRouterWithTheirScale) {
  GptConfig c = moe_config(4, 1, 0.0);
  Moe moe = random_moe(c, 4);
  const at::Tensor x = positive_tokens(16, c.width, 8);
  moe->set_aux_loss_scale(0.5);
  // The output's value is the same with or without the auxiliary losses; only backward differs.
  (moe->forward(x) * 0).sum().backward();
  const at::Tensor from_aux = moe->router.grad().clone();
  EXPECT_GT(from_aux.abs().sum().item<double>(), 0.0);
  const double aux = moe->stats().aux_loss, z = moe->stats().z_loss;
  EXPECT_GT(aux, 0.0);
  EXPECT_GT(z, 0.0);
  // Against autograd of 0.5 * (aux + z) computed directly.
  at::Tensor router = moe->router.detach().clone().requires_grad_(true);
  const at::Tensor logits = at::linear(x.view({16, c.width}), router);
  const at::Tensor probs = at::softmax(logits, -1);
  const at::Tensor share = at::one_hot(probs.argmax(-1), 4).to(at::kFloat).mean(0);
  const at::Tensor direct = c.moe_aux_loss * 4 * (share * probs.mean(0)).sum() +
                            c.moe_z_loss * at::logsumexp(logits, -1).pow(2).mean();
  EXPECT_NEAR(direct.item<double>(), aux + z, 1e-6);
  (0.5 * direct).backward();
  EXPECT_TRUE(at::allclose(from_aux, router.grad(), 1e-5, 1e-8));
}

TEST(Moe, GShardSecondExpertIsKeptAtTheRatedProbability) {
  GptConfig c = moe_config(8, 2, 0.0);
  c.moe_second_expert = SecondExpert::kRandom;
  Gpt model(c, 9);
  Moe moe = model->moe_layers().front();
  {
    torch::NoGradGuard no_grad;
    moe->router.mul_(50);  // gates far from even, so the rate is far from 1
  }
  auto recording = std::make_shared<RecordingExchange>();
  moe->set_exchange(recording);
  const int64_t n = 4000;
  const at::Tensor x = positive_tokens(n, c.width, 10) * 4;  // spread the gates
  at::manual_seed(11);
  moe->forward(x);
  int64_t assignments = 0;
  for (int64_t k : recording->last_counts) assignments += k;
  // Expected second assignments: the sum over tokens of min(1, 2·g₂), g₂ normalised over the top two.
  const at::Tensor probs = at::softmax(at::linear(x.view({n, c.width}), moe->router), -1);
  const at::Tensor top = std::get<0>(probs.topk(2, -1));
  const at::Tensor rate = (2 * top.select(1, 1) / top.sum(-1)).clamp_max(1.0);
  const double expected = rate.sum().item<double>();
  const double spread = std::sqrt((rate * (1 - rate)).sum().item<double>());  // std of the count
  EXPECT_NEAR(static_cast<double>(assignments - n), expected, 5 * spread + 1)
      << "mean rate " << expected / n << ", spread " << spread;
  EXPECT_LT(expected, n - 10 * spread);  // the rule is not "always" here
  // "always" keeps every second choice.
  c.moe_second_expert = SecondExpert::kAlways;
  Gpt always(c, 9);
  Moe moe2 = always->moe_layers().front();
  {
    torch::NoGradGuard no_grad;
    moe2->router.mul_(50);
  }
  moe2->set_exchange(recording);
  moe2->forward(x);
  assignments = 0;
  for (int64_t k : recording->last_counts) assignments += k;
  EXPECT_EQ(assignments, 2 * n);
}

}  // namespace
}  // namespace meshtrain::model
