// The Hugging Face config.json of the Llama-style families from the model's
// key table (Note [Model keys]): the plain keys are read and written by their
// table names, and an export refuses, naming it, the first key that would not
// read back as the same model. The logits through transformers are
// tests/interop/families_test.py's.
#include "meshtrain/interop/hf_families.h"
#include "meshtrain/interop/safetensors.h"
#include "tests/harness/error_of.h"

#include <gtest/gtest.h>

#include <string>

namespace meshtrain::interop {
namespace {

model::GptConfig mixtral_tiny() {
  model::GptConfig c = model::GptConfig::preset("llama-tiny");
  c.moe_experts = 4;
  c.moe_every = 1;
  c.moe_top_k = 2;
  c.moe_capacity_factor = 0;
  c.moe_second_expert = model::SecondExpert::kAlways;
  c.moe_norm_topk = true;
  c.moe_hidden = c.mlp_hidden();
  return c;
}

using testing::error_of;

// What family_config throws, or "no error" when it writes the config.
std::string refusal(const model::GptConfig& c, const std::string& type) {
  return error_of<FormatError>([&] { family_config(c, type, "float32"); });
}

TEST(HfFamilyConfig, PlainKeysAreTheTablesBothWays) {
  model::GptConfig c = model::GptConfig::preset("llama-tiny");
  c.norm_eps = 1e-5;
  c.tie_embeddings = true;
  c.init_std = 0.01;  // a model knob added with its Hugging Face name and nothing here
  const nlohmann::json j = family_config(c, "llama", "float32");
  EXPECT_EQ(j.at("initializer_range"), 0.01);
  EXPECT_EQ(config_from_family(j, "llama", "config.json").init_std, 0.01);
  EXPECT_EQ(j.at("hidden_size"), c.width);
  EXPECT_EQ(j.at("num_hidden_layers"), c.layers);
  EXPECT_EQ(j.at("num_attention_heads"), c.heads);
  EXPECT_EQ(j.at("max_position_embeddings"), c.context);
  EXPECT_EQ(j.at("vocab_size"), c.vocab_size);
  EXPECT_EQ(j.at("rms_norm_eps"), 1e-5);
  EXPECT_EQ(j.at("tie_word_embeddings"), true);
  const model::GptConfig back = config_from_family(j, "llama", "config.json");
  EXPECT_EQ(back.width, c.width);
  EXPECT_EQ(back.norm_eps, 1e-5);
  EXPECT_TRUE(back.tie_embeddings);

  // Absent optional keys take the family's defaults; absent required ones and wrong types are named.
  nlohmann::json partial = j;
  partial.erase("rms_norm_eps");
  partial.erase("tie_word_embeddings");
  EXPECT_EQ(config_from_family(partial, "llama", "config.json").norm_eps, 1e-6);
  EXPECT_FALSE(config_from_family(partial, "llama", "config.json").tie_embeddings);
  partial.erase("hidden_size");
  EXPECT_EQ(error_of<FormatError>([&] { config_from_family(partial, "llama", "config.json"); }),
            "config.json: \"hidden_size\" is missing");
  nlohmann::json wrong = j;
  wrong["rms_norm_eps"] = "small";
  const std::string wrong_type = error_of<FormatError>([&] { config_from_family(wrong, "llama", "config.json"); });
  EXPECT_NE(wrong_type.find("\"rms_norm_eps\" = \"small\" must be"), std::string::npos) << wrong_type;
}

TEST(HfFamilyConfig, ExportRefusesTheFirstKeyThatWouldNotReadBack) {
  model::GptConfig c = model::GptConfig::preset("llama-tiny");
  EXPECT_EQ(refusal(c, "llama"), "no error");
  c.dropout = 0.1;  // training only: the exported model computes the same
  EXPECT_EQ(refusal(c, "llama"), "no error");
  c.query_scale = 3;  // Gemma 2 has query_pre_attn_scalar; Llama has none
  EXPECT_EQ(refusal(c, "llama"), "model.query_scale = 3 has no equivalent in Hugging Face's llama");
  EXPECT_EQ(refusal(c, "gemma2").find("model.query_scale"), std::string::npos) << refusal(c, "gemma2");

  model::GptConfig m = mixtral_tiny();
  EXPECT_EQ(refusal(m, "mixtral"), "no error");
  m.moe_aux_loss = 0.5;  // the router's training loss: exported as router_aux_loss_coef, never refused
  EXPECT_EQ(refusal(m, "mixtral"), "no error");
  m.moe_capacity_factor = 1.25;  // Mixtral is dropless
  EXPECT_EQ(refusal(m, "mixtral"), "model.moe_capacity_factor = 1.25 has no equivalent in Hugging Face's mixtral");
  m.moe_capacity_factor = 0;
  m.moe_second_expert = model::SecondExpert::kRandom;
  EXPECT_EQ(refusal(m, "mixtral"), "model.moe_second_expert = \"random\" has no equivalent in Hugging Face's mixtral");
  m.moe_top_k = 1;  // only top-2 has a second expert to keep or drop
  m.moe_norm_topk = false;
  m.qk_norm = model::QkNorm::kHead;
  EXPECT_EQ(refusal(m, "qwen3_moe"), "no error");
}

}  // namespace
}  // namespace meshtrain::interop
