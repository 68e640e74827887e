// The model alone: shapes, exact parameter counts, deterministic init, causality.
#include "meshtrain/model/gpt.h"
#include "meshtrain/model/config_json.h"
#include "meshtrain/model/gpt_config_keys.h"
#include "tests/model/parameter_count.h"

#include <gtest/gtest.h>

namespace meshtrain::model {
namespace {

TEST(GptConfig, ParameterCountMatchesTheModulesForEveryStyle) {
  for (const std::string name : {"tiny", "small", "llama-tiny"}) {
    GptConfig config = GptConfig::preset(name);
    Gpt model(config, 1);
    EXPECT_EQ(counted(*model), config.parameter_count()) << name;
  }
  GptConfig odd = GptConfig::preset("tiny");
  odd.tie_embeddings = false;
  odd.bias = false;
  odd.mlp = MlpStyle::kSwiglu;
  Gpt model(odd, 1);
  EXPECT_EQ(counted(*model), odd.parameter_count());
  GptConfig grouped = GptConfig::preset("llama-tiny");
  grouped.kv_heads = 2, grouped.ffn_hidden = 100;
  Gpt gqa(grouped, 1);
  EXPECT_EQ(counted(*gqa), grouped.parameter_count());
  EXPECT_EQ(gqa->blocks[0]->as<Block>()->attn->qkv->weight.size(0), grouped.width + 2 * 2 * grouped.head_dim());
}

// Note [Model counts]: each part of the count equals the parameters of the
// modules it describes, for every style and for mixture-of-experts blocks.
TEST(GptConfig, CountsByPartEqualTheModulesTheyDescribe) {
  std::vector<GptConfig> configs = {GptConfig::preset("tiny"), GptConfig::preset("llama-tiny")};
  GptConfig moe = GptConfig::preset("tiny");
  moe.moe_experts = 4, moe.moe_every = 2, moe.moe_hidden = 96, moe.mlp = MlpStyle::kSwiglu, moe.kv_heads = 2;
  configs.push_back(moe);
  GptConfig qwen = GptConfig::preset("llama-tiny");  // Qwen2: biases on q, k and v alone
  qwen.qkv_bias = true, qwen.kv_heads = 2;
  configs.push_back(qwen);
  for (const GptConfig& c : configs) {
    SCOPED_TRACE(fingerprint(c));
    Gpt model(c, 1);
    const int64_t wpe = model->wpe ? counted(*model->wpe) : 0;
    EXPECT_EQ(c.embedding_parameters(), counted(*model->wte) + wpe);
    EXPECT_EQ(c.block_parameters(), counted(*model->blocks[0]));
    if (c.moe()) {
      auto* block = model->blocks[1]->as<Block>();
      EXPECT_EQ(c.moe_block_parameters(), counted(*model->blocks[1]));
      EXPECT_EQ(c.moe_block_parameters() - c.expert_parameters() - c.moe_experts * c.width,
                counted(*model->blocks[1]) - counted(*block->moe));
    }
    const int64_t head = model->head ? counted(*model->head) : 0;
    EXPECT_EQ(c.head_parameters(), counted(*model->norm_f) + head);
    EXPECT_EQ(c.parameter_count(), counted(*model));
    EXPECT_NEAR(c.training_flops_per_sequence(), c.context * c.flops_per_token(), 1e-9 * c.training_flops_per_sequence());
  }
}

// Grouped-query attention is multi-head attention whose heads in a group
// share keys and values: with the shared k and v copied to every head of
// their group, the MHA model computes the same logits.
TEST(Gpt, GroupedQueryAttentionEqualsMultiHeadWithSharedKeysAndValues) {
  GptConfig grouped = GptConfig::preset("llama-tiny");
  grouped.layers = 2, grouped.heads = 4, grouped.kv_heads = 2, grouped.context = 16;
  GptConfig multi = grouped;
  multi.kv_heads = 0;
  Gpt gqa(grouped, 3), mha(multi, 4);
  torch::NoGradGuard no_grad;
  auto theirs = gqa->named_parameters();
  const int64_t hd = grouped.head_dim(), rep = 2;
  for (auto& item : mha->named_parameters()) {
    const at::Tensor& src = theirs[item.key()];
    if (item.key().find("attn.qkv.weight") == std::string::npos) {
      item.value().copy_(src);
      continue;
    }
    // Note [Grouped-query layout]: per group [q (rep heads), k, v].
    const at::Tensor groups = src.view({2, rep + 2, hd, grouped.width});
    const at::Tensor q = groups.narrow(1, 0, rep).reshape({-1, grouped.width});
    const at::Tensor k = groups.select(1, rep).unsqueeze(1).expand({2, rep, hd, grouped.width}).reshape({-1, grouped.width});
    const at::Tensor v = groups.select(1, rep + 1).unsqueeze(1).expand({2, rep, hd, grouped.width}).reshape({-1, grouped.width});
    item.value().copy_(at::cat({q, k, v}));
  }
  const at::Tensor tokens = at::randint(0, grouped.vocab_size, {2, 16}, at::kLong);
  EXPECT_TRUE(at::allclose(gqa->forward(tokens), mha->forward(tokens), 1e-5, 1e-5));
}

TEST(GptConfig, KnownSizesAndFlops) {
  // GPT-2 small: 124,439,808 parameters with tied embeddings (the published count).
  EXPECT_EQ(GptConfig::preset("gpt2-124m").parameter_count(), 124439808);
  EXPECT_EQ(GptConfig::preset("gpt2-350m").parameter_count(), 354823168);
  EXPECT_EQ(GptConfig::preset("gpt2-1.5b").parameter_count(), 1557611200);
  const GptConfig small = GptConfig::preset("small");
  const double d = 384, matmul = 6 * (4 * d * d + 8 * d * d) + 256 * d;
  EXPECT_DOUBLE_EQ(small.flops_per_token(), 6 * matmul + 12.0 * 6 * 256 * d);
}

TEST(GptConfig, RejectsImpossibleShapesWithTheField) {
  GptConfig c = GptConfig::preset("tiny");
  c.width = 250;
  try {
    c.validate();
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "model.width = 250 is not allowed: must be a positive multiple of model.heads (4)");
  }
  EXPECT_THROW(GptConfig::preset("huge"), std::invalid_argument);
}

TEST(Gpt, SameSeedSameModelDifferentSeedDifferent) {
  Gpt a(GptConfig::preset("tiny"), 7), b(GptConfig::preset("tiny"), 7), c(GptConfig::preset("tiny"), 8);
  auto pa = a->named_parameters(), pb = b->named_parameters(), pc = c->named_parameters();
  bool any_different = false;
  for (const auto& item : pa) {
    EXPECT_TRUE(at::equal(item.value(), pb[item.key()])) << item.key();
    any_different = any_different || !at::equal(item.value(), pc[item.key()]);
  }
  EXPECT_TRUE(any_different);
  EXPECT_NEAR(pa["blocks.0.attn.qkv.weight"].std().item<double>(), 0.02, 0.002);
  EXPECT_NEAR(pa["blocks.0.mlp.proj.weight"].std().item<double>(), 0.02 / std::sqrt(8.0), 0.001);
  // model.init_std scales both.
  GptConfig wider = GptConfig::preset("tiny");
  wider.init_std = 0.05;
  auto pw = Gpt(wider, 7)->named_parameters();
  EXPECT_NEAR(pw["blocks.0.attn.qkv.weight"].std().item<double>(), 0.05, 0.005);
  EXPECT_NEAR(pw["blocks.0.mlp.proj.weight"].std().item<double>(), 0.05 / std::sqrt(8.0), 0.0025);
  wider.init_std = 0;
  EXPECT_THROW(wider.validate(), std::invalid_argument);
}

TEST(Gpt, LogitsAreCausalAndLossStartsNearUniform) {
  for (const std::string name : {"tiny", "llama-tiny"}) {
    Gpt model(GptConfig::preset(name), 3);
    model->eval();
    at::Tensor tokens = at::randint(256, {2, 16}, at::kLong);
    at::Tensor logits = model->forward(tokens);
    ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{2, 16, 256}));
    at::Tensor changed = tokens.clone();
    changed.index_put_({at::indexing::Slice(), 10}, (tokens.select(1, 10) + 1) % 256);
    at::Tensor after = model->forward(changed);
    EXPECT_TRUE(at::allclose(logits.narrow(1, 0, 10), after.narrow(1, 0, 10), 1e-5, 1e-6)) << name;
    EXPECT_FALSE(at::allclose(logits.narrow(1, 10, 6), after.narrow(1, 10, 6))) << name;
    const double loss = model->loss(tokens, at::randint(256, {2, 16}, at::kLong)).item<double>();
    EXPECT_NEAR(loss, std::log(256.0), 0.3) << name;
  }
}

}  // namespace
}  // namespace meshtrain::model

namespace meshtrain::model {
namespace {

// Note [Model keys]: the checkpoint's JSON and the fingerprint, derived from the key table, are what the
// versions before it wrote (these strings are theirs), so their checkpoints load and resume.
TEST(ModelKeys, JsonAndFingerprintAreTheFormatsCheckpointsHold) {
  EXPECT_EQ(fingerprint(GptConfig::preset("tiny")),
            "gpt layers=4 heads=4 width=256 context=128 vocab=256 layernorm/learned/gelu/tied/bias");
  EXPECT_EQ(to_json(GptConfig::preset("tiny")),
            "{\"bias\":true,\"context\":128,\"dropout\":0.0,\"ffn_hidden\":0,\"heads\":4,\"kv_heads\":0,\"layers\":4,"
            "\"mlp\":\"gelu\",\"norm\":\"layernorm\",\"norm_eps\":1e-05,\"position\":\"learned\",\"qkv_bias\":false,"
            "\"rope_theta\":10000.0,\"tie_embeddings\":true,\"vocab_size\":256,\"width\":256}");
  EXPECT_EQ(fingerprint(GptConfig::preset("gemma2-2b")),
            "gpt layers=26 heads=8 width=2304 context=8192 vocab=256000 rmsnorm/rope/geglu/tied/nobias kv_heads=4 "
            "ffn=9216 {\"attn_softcap\":50.0,\"embed_scale\":true,\"head_size\":256,\"logit_softcap\":30.0,"
            "\"norm_placement\":\"sandwich\",\"norm_plus_one\":true,\"query_scale\":256.0,\"sliding_every\":2,"
            "\"sliding_window\":4096}");
  EXPECT_NE(to_json(GptConfig::preset("mixtral-8x7b"))
                .find("\"moe\":{\"aux_loss\":0.01,\"capacity_factor\":0.0,\"every\":1,\"experts\":8,\"hidden\":0,"
                      "\"norm_topk\":true,\"second_expert\":\"always\",\"shared_hidden\":0,\"top_k\":2,\"z_loss\":0.001}"),
            std::string::npos);
}

TEST(ModelKeys, EveryStoredKeyRoundTripsAndARequiredOneIsNamedWhenMissing) {
  GptConfig set = GptConfig::preset("tiny");
  set.init_std = 0.01;  // a key written where it differs from the default
  EXPECT_NE(to_json(set).find("\"init_std\":0.01"), std::string::npos) << to_json(set);
  EXPECT_EQ(config_from_json(to_json(set)).init_std, 0.01);
  for (const std::string& name : GptConfig::preset_names()) {
    const GptConfig c = GptConfig::preset(name);
    const GptConfig back = config_from_json(to_json(c));
    for (const ModelKey& k : model_keys()) {
      if (k.stored != ModelKey::Stored::kNotStored) EXPECT_FALSE(differs(k, c, back)) << name << " " << k.key.name;
    }
  }
  std::string json = to_json(GptConfig::preset("tiny"));
  json.replace(json.find("\"layers\":4,"), 11, "");
  try {
    config_from_json(json);
    ADD_FAILURE() << "a model config without layers was read";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "model config: layers is missing");
  }
  // Keys added later are optional: absent, they keep their defaults.
  json = to_json(GptConfig::preset("tiny"));
  json.replace(json.find("\"kv_heads\":0,"), 13, "");
  EXPECT_EQ(config_from_json(json).kv_heads, 0);
}

}  // namespace
}  // namespace meshtrain::model
