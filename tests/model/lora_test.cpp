// LoRA adapters on one process (Note [LoRA]): B = 0 leaves the model as it
// was; a hooked model equals its merge (q, k and v laid out in the fused qkv
// by thirds and by groups), and so do its adapters' gradients and the
// merged weights'; only adapters train; PEFT files round-trip; bad
// configs and adapters are refused by name.
#include "meshtrain/model/lora.h"
#include "meshtrain/model/qkv_layout.h"

#include "meshtrain/util/files.h"

#include <gtest/gtest.h>

namespace meshtrain::model {
namespace {

GptConfig llama_config() {
  GptConfig c = GptConfig::preset("tiny");
  c.layers = 2;
  c.width = 64;
  c.heads = 4;
  c.kv_heads = 2;
  c.context = 16;
  c.vocab_size = 96;
  c.norm = NormStyle::kRmsNorm;
  c.position = PositionStyle::kRope;
  c.mlp = MlpStyle::kSwiglu;
  c.bias = false;
  c.tie_embeddings = false;
  c.dropout = 0;
  return c;
}

GptConfig gpt2_config() {
  GptConfig c = GptConfig::preset("tiny");
  c.layers = 2;
  c.width = 64;
  c.heads = 4;
  c.context = 16;
  c.vocab_size = 96;
  c.dropout = 0;
  return c;
}

LoraConfig lora(std::vector<std::string> targets) {
  LoraConfig l;
  l.rank = 4;
  l.alpha = 8;
  l.targets = std::move(targets);
  return l;
}

// Every adapter's B drawn at random (training would have moved it); the adapters by name.
std::map<std::string, at::Tensor> randomise_b(Gpt& gpt) {
  torch::NoGradGuard no_grad;
  at::manual_seed(3);
  std::map<std::string, at::Tensor> out;
  for (auto& item : gpt->named_parameters()) {
    if (!is_lora_parameter(item.key())) continue;
    if (item.key().back() == 'B') item.value().normal_(0, 0.05);
    out[item.key()] = item.value().detach().clone();
  }
  return out;
}

at::Tensor tokens() { return at::arange(24, at::kLong).remainder(96).view({2, 12}); }

TEST(Lora, ZeroBLeavesTheModelAndOnlyAdaptersTrain) {
  Gpt base(llama_config(), 7), adapted(llama_config(), 7);
  apply_lora(adapted, lora({"q", "k", "v", "o", "gate", "up", "down"}), 7);
  EXPECT_TRUE(at::equal(base->forward(tokens()), adapted->forward(tokens())));
  int64_t trainable = 0;
  for (const auto& item : adapted->named_parameters()) {
    EXPECT_EQ(item.value().requires_grad(), is_lora_parameter(item.key())) << item.key();
    trainable += item.value().requires_grad() ? item.value().numel() : 0;
  }
  EXPECT_EQ(trainable, lora({"q", "k", "v", "o", "gate", "up", "down"}).parameter_count(llama_config()));
  adapted->loss(tokens(), tokens()).backward();
  for (const auto& item : adapted->named_parameters()) {
    EXPECT_EQ(item.value().grad().defined(), is_lora_parameter(item.key())) << item.key();
  }
}

// The hooked model and the base with the adapters merged give the same logits.
void expect_merge_equals_hooks(const GptConfig& config, const LoraConfig& l) {
  Gpt adapted(config, 7), merged(config, 7);
  apply_lora(adapted, l, 7);
  const std::map<std::string, at::Tensor> adapters = randomise_b(adapted);
  merge_lora(merged, l, adapters);
  torch::NoGradGuard no_grad;
  const at::Tensor want = adapted->forward(tokens()), got = merged->forward(tokens());
  Gpt base(config, 7);
  EXPECT_GT((base->forward(tokens()) - want).abs().max().item<double>(), 1e-3) << "the adapters change nothing";
  EXPECT_LT((got - want).abs().max().item<double>(), 1e-5);
}

TEST(Lora, MergedWeightsEqualTheHookedModel) {
  expect_merge_equals_hooks(llama_config(), lora({"q", "k", "v", "o", "gate", "up", "down"}));  // by groups
  expect_merge_equals_hooks(llama_config(), lora({"k"}));                                     // one part of qkv
  expect_merge_equals_hooks(gpt2_config(), lora({"q", "k", "v", "o", "up", "down"}));         // thirds, fc and proj
}

// The adapters' gradients follow from the merged weight's, G = dL/dW' of
// W' = W + s·B·A: dB = s·G·Aᵀ and dA = s·Bᵀ·G, q, k and v's from their
// rows of the fused qkv's G (Note [LoRA's slots]).
void expect_gradients_follow_merge(const GptConfig& config, const LoraConfig& l) {
  Gpt adapted(config, 7), merged(config, 7);
  apply_lora(adapted, l, 7);
  const std::map<std::string, at::Tensor> adapters = randomise_b(adapted);
  merge_lora(merged, l, adapters);
  adapted->loss(tokens(), tokens()).backward();
  merged->loss(tokens(), tokens()).backward();
  const auto weights = merged->named_parameters();
  int64_t checked = 0;
  for (const auto& item : adapted->named_parameters()) {
    const std::string& name = item.key();  // blocks.N.attn.qkv.lora_q.A
    if (!is_lora_parameter(name) || name.back() != 'A') continue;
    const size_t at = name.find(".lora_");
    const std::string linear = name.substr(0, at), target = name.substr(at + 6, name.size() - at - 8);
    at::Tensor g = weights[linear + ".weight"].grad();
    const int part = target == "q" ? 0 : target == "k" ? 1 : target == "v" ? 2 : -1;
    if (part >= 0) g = split_qkv_heads(g, 0, config)[part].reshape({-1, g.size(1)});
    const at::Tensor a = adapters.at(linear + ".lora_" + target + ".A"), b = adapters.at(linear + ".lora_" + target + ".B");
    const at::Tensor da = l.scale() * b.t().mm(g), db = l.scale() * g.mm(a.t());
    const at::Tensor& got_b = adapted->named_parameters()[linear + ".lora_" + target + ".B"].grad();
    EXPECT_TRUE(at::allclose(item.value().grad(), da, 1e-4, 1e-6)) << name << ": " << (item.value().grad() - da).abs().max();
    EXPECT_TRUE(at::allclose(got_b, db, 1e-4, 1e-6)) << name << " (B): " << (got_b - db).abs().max();
    EXPECT_GT(da.abs().max().item<double>(), 1e-6) << name << ": nothing to compare";
    ++checked;
  }
  EXPECT_EQ(checked, config.layers * static_cast<int64_t>(l.targets.size()));
}

TEST(Lora, AdapterGradientsFollowTheMergedWeightsGradient) {
  expect_gradients_follow_merge(llama_config(), lora({"q", "k", "v", "o", "gate", "up", "down"}));  // by groups
  expect_gradients_follow_merge(llama_config(), lora({"q", "v"}));                               // two parts of qkv
  expect_gradients_follow_merge(gpt2_config(), lora({"q", "k", "v", "o", "up", "down"}));         // thirds, fc and proj
}

TEST(Lora, PeftAdapterRoundTripsAndBadOnesAreRefused) {
  const GptConfig config = llama_config();
  const LoraConfig l = lora({"q", "v", "down"});
  Gpt adapted(config, 7);
  apply_lora(adapted, l, 7);
  const std::map<std::string, at::Tensor> adapters = randomise_b(adapted);
  const std::string dir = util::make_temp_directory("meshtrain-peft-");
  write_peft_adapter(dir, config, l, adapters, "base");
  const PeftAdapter read = read_peft_adapter(dir, config);
  EXPECT_EQ(read.config.rank, 4);
  EXPECT_EQ(read.config.alpha, 8);
  ASSERT_EQ(read.adapters.size(), adapters.size());
  for (const auto& [name, value] : adapters) EXPECT_TRUE(at::equal(read.adapters.at(name), value)) << name;
  // Another model's adapter (its width) is refused naming the tensor.
  GptConfig wider = config;
  wider.width = 128;
  try {
    read_peft_adapter(dir, wider);
    ADD_FAILURE() << "an adapter of another width was read";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("lora_A.weight"), std::string::npos) << e.what();
  }
  EXPECT_THROW(write_peft_adapter(dir, gpt2_config(), l, adapters, "base"), std::invalid_argument);  // fused c_attn
  util::remove_tree(dir);
}

TEST(Lora, ConfigsAreCheckedByName) {
  auto message = [](const LoraConfig& l, const GptConfig& c) {
    try {
      l.check(c);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(lora({"gate"}), gpt2_config()).find("no gate"), std::string::npos);
  EXPECT_EQ(message(lora({"gate", "up"}), gpt2_config()), "");  // gate passed over
  EXPECT_EQ(lora({"gate", "up"}).parameter_count(gpt2_config()), lora({"up"}).parameter_count(gpt2_config()));
  EXPECT_NE(message(lora({"qkv"}), llama_config()).find("\"qkv\""), std::string::npos);
  EXPECT_EQ(message(lora({"up", "down"}), gpt2_config()), "");
  LoraConfig l = lora({"q", "down"});
  l.base_dtype = at::kBFloat16;
  l.dropout = 0.05;
  const LoraConfig back = LoraConfig::from_json(l.to_json());
  EXPECT_EQ(back.to_json(), l.to_json());
  EXPECT_EQ(back.base_dtype, at::kBFloat16);
}

}  // namespace
}  // namespace meshtrain::model
