#include "meshtrain/model/gpt_config.h"

#include <cmath>
#include <cstdio>
#include <map>
#include <stdexcept>

namespace meshtrain::model {

const config::Names<NormStyle>& names(NormStyle) {
  static const config::Names<NormStyle> n = {{NormStyle::kLayerNorm, "layernorm"}, {NormStyle::kRmsNorm, "rmsnorm"}};
  return n;
}
const config::Names<PositionStyle>& names(PositionStyle) {
  static const config::Names<PositionStyle> n = {{PositionStyle::kLearned, "learned"}, {PositionStyle::kRope, "rope"}};
  return n;
}
const config::Names<MlpStyle>& names(MlpStyle) {
  static const config::Names<MlpStyle> n = {
      {MlpStyle::kGelu, "gelu"}, {MlpStyle::kSwiglu, "swiglu"}, {MlpStyle::kGeglu, "geglu"}};
  return n;
}
const config::Names<QkNorm>& names(QkNorm) {
  static const config::Names<QkNorm> n = {{QkNorm::kNone, "none"}, {QkNorm::kHead, "head"}, {QkNorm::kWidth, "width"}};
  return n;
}
const config::Names<NormPlacement>& names(NormPlacement) {
  static const config::Names<NormPlacement> n = {
      {NormPlacement::kPre, "pre"}, {NormPlacement::kPost, "post"}, {NormPlacement::kSandwich, "sandwich"}};
  return n;
}
const config::Names<RopeScaling>& names(RopeScaling) {
  static const config::Names<RopeScaling> n = {{RopeScaling::kNone, "none"},
                                               {RopeScaling::kLinear, "linear"},
                                               {RopeScaling::kLlama3, "llama3"},
                                               {RopeScaling::kYarn, "yarn"}};
  return n;
}
const config::Names<SecondExpert>& names(SecondExpert) {
  static const config::Names<SecondExpert> n = {{SecondExpert::kRandom, "random"}, {SecondExpert::kAlways, "always"}};
  return n;
}

namespace {

GptConfig shape(int64_t vocab, int64_t context, int64_t layers, int64_t heads, int64_t width) {
  GptConfig c;
  c.vocab_size = vocab;
  c.context = context;
  c.layers = layers;
  c.heads = heads;
  c.width = width;
  return c;
}

// A Llama-style shape: RMSNorm, RoPE, SwiGLU, untied head, no biases.
GptConfig llama(int64_t vocab, int64_t context, int64_t layers, int64_t heads, int64_t kv_heads, int64_t width,
                int64_t ffn, double rope_theta) {
  GptConfig c = shape(vocab, context, layers, heads, width);
  c.norm = NormStyle::kRmsNorm;
  c.position = PositionStyle::kRope;
  c.mlp = MlpStyle::kSwiglu;
  c.tie_embeddings = false;
  c.bias = false;
  c.kv_heads = kv_heads == heads ? 0 : kv_heads;
  c.ffn_hidden = ffn;
  c.rope_theta = rope_theta;
  return c;
}

// Llama 3.1's RoPE scaling: `factor` over an original context of 8192.
GptConfig llama31(int64_t layers, int64_t heads, int64_t width, int64_t ffn, double factor, bool tied) {
  GptConfig c = llama(128256, 131072, layers, heads, 8, width, ffn, 500000);
  c.tie_embeddings = tied;
  c.rope_scaling = RopeScaling::kLlama3;
  c.rope_factor = factor;
  c.rope_original_context = 8192;
  c.rope_low_freq_factor = 1;
  c.rope_high_freq_factor = 4;
  return c;
}

// Qwen3: QK-norm, head size 128 whatever the width, theta 1e6.
GptConfig qwen3(int64_t layers, int64_t heads, int64_t kv_heads, int64_t width, int64_t ffn, bool tied) {
  GptConfig c = llama(151936, 40960, layers, heads, kv_heads, width, ffn, 1e6);
  c.head_size = 128;
  c.qk_norm = QkNorm::kHead;
  c.norm_eps = 1e-6;
  c.tie_embeddings = tied;
  return c;
}

// Gemma 2: (1 + w) RMSNorm before and after each sublayer, GeGLU, embeddings
// times sqrt(width), soft-capped scores and logits, a 4096 window in every other block.
GptConfig gemma2(int64_t layers, int64_t heads, int64_t kv_heads, int64_t width, int64_t ffn) {
  GptConfig c = llama(256000, 8192, layers, heads, kv_heads, width, ffn, 10000);
  c.mlp = MlpStyle::kGeglu;
  c.head_size = 256;
  c.tie_embeddings = true;
  c.norm_eps = 1e-6;
  c.norm_placement = NormPlacement::kSandwich;
  c.norm_plus_one = true;
  c.embed_scale = true;
  c.attn_softcap = 50;
  c.logit_softcap = 30;
  c.query_scale = 256;
  c.sliding_window = 4096;
  c.sliding_every = 2;
  return c;
}

// A GPT-2/3-style shape with the MLP of 4·width: LayerNorm with biases, learned positions, tied head.
GptConfig gpt(int64_t vocab, int64_t context, int64_t layers, int64_t heads, int64_t width) {
  return shape(vocab, context, layers, heads, width);
}

const std::map<std::string, GptConfig>& presets() {
  static const std::map<std::string, GptConfig> table = [] {
    std::map<std::string, GptConfig> t;
    t["tiny"] = shape(256, 128, 4, 4, 256);
    t["small"] = shape(256, 256, 6, 6, 384);
    t["llama-tiny"] = llama(256, 128, 4, 4, 4, 256, 0, 10000);  // the MLP's default hidden size
    t["gpt2-124m"] = shape(50257, 1024, 12, 12, 768);
    t["gpt2-350m"] = shape(50257, 1024, 24, 16, 1024);
    t["gpt2-774m"] = shape(50257, 1024, 36, 20, 1280);
    t["gpt2-1.5b"] = shape(50257, 1024, 48, 25, 1600);
    // Published shapes (model cards and papers); the MLP sizes are the released ones.
    t["llama2-7b"] = llama(32000, 4096, 32, 32, 32, 4096, 11008, 10000);
    t["llama2-13b"] = llama(32000, 4096, 40, 40, 40, 5120, 13824, 10000);
    t["llama2-70b"] = llama(32000, 4096, 80, 64, 8, 8192, 28672, 10000);
    t["llama3-8b"] = llama(128256, 8192, 32, 32, 8, 4096, 14336, 500000);
    t["llama3-70b"] = llama(128256, 8192, 80, 64, 8, 8192, 28672, 500000);
    // GPT-3's 50257 tokens padded to 50304 (a multiple of 128, as Megatron-LM pads) so tensor parallel splits it.
    t["gpt3-175b"] = gpt(50304, 2048, 96, 96, 12288);
    t["gpt-1t"] = gpt(51200, 2048, 128, 160, 25600);  // Narayanan et al. 2021, Table 1
    // Jiang et al. 2024: Mistral-7B's shape with 8 SwiGLU experts in every block, top 2, dropless.
    GptConfig mixtral = llama(32000, 4096, 32, 32, 8, 4096, 14336, 1e6);
    mixtral.moe_experts = 8;
    mixtral.moe_every = 1;
    mixtral.moe_top_k = 2;
    mixtral.moe_capacity_factor = 0;
    mixtral.moe_second_expert = SecondExpert::kAlways;
    t["mixtral-8x7b"] = mixtral;
    // The open families as their config.json files on the Hugging Face Hub give them.
    t["llama3.2-1b"] = llama31(16, 32, 2048, 8192, 32, true);
    t["llama3.2-3b"] = llama31(28, 24, 3072, 8192, 32, true);
    t["llama3.1-8b"] = llama31(32, 32, 4096, 14336, 8, false);
    t["llama3.1-70b"] = llama31(80, 64, 8192, 28672, 8, false);
    t["llama3.1-405b"] = llama31(126, 128, 16384, 53248, 8, false);
    GptConfig mistral = llama(32000, 32768, 32, 32, 8, 4096, 14336, 10000);  // Mistral-7B-v0.1
    mistral.sliding_window = 4096;
    t["mistral-7b"] = mistral;
    GptConfig qwen25 = llama(152064, 32768, 28, 28, 4, 3584, 18944, 1e6);  // Qwen2.5-7B
    qwen25.qkv_bias = true;
    qwen25.norm_eps = 1e-6;
    t["qwen2.5-7b"] = qwen25;
    t["qwen3-0.6b"] = qwen3(28, 16, 8, 1024, 3072, true);
    t["qwen3-8b"] = qwen3(36, 32, 8, 4096, 12288, false);
    GptConfig qwen3_moe = qwen3(48, 32, 4, 2048, 6144, false);  // Qwen3-30B-A3B: 128 experts of 768, top 8
    qwen3_moe.moe_experts = 128;
    qwen3_moe.moe_every = 1;
    qwen3_moe.moe_top_k = 8;
    qwen3_moe.moe_hidden = 768;
    qwen3_moe.moe_capacity_factor = 0;
    qwen3_moe.moe_second_expert = SecondExpert::kAlways;
    qwen3_moe.moe_aux_loss = 0.001;
    t["qwen3-30b-a3b"] = qwen3_moe;
    t["gemma2-2b"] = gemma2(26, 8, 4, 2304, 9216);
    t["gemma2-9b"] = gemma2(42, 16, 8, 3584, 14336);
    t["phi3-mini"] = llama(32064, 4096, 32, 32, 32, 3072, 8192, 10000);  // Phi-3-mini-4k-instruct
    GptConfig olmo2 = llama(100352, 4096, 32, 32, 32, 4096, 11008, 500000);  // OLMo-2-1124-7B
    olmo2.norm_placement = NormPlacement::kPost;
    olmo2.qk_norm = QkNorm::kWidth;
    olmo2.norm_eps = 1e-6;
    t["olmo2-7b"] = olmo2;
    return t;
  }();
  return table;
}

[[noreturn]] void reject(const std::string& field, const std::string& value, const std::string& allowed) {
  throw std::invalid_argument("model." + field + " = " + value + " is not allowed: " + allowed);
}

}  // namespace

GptConfig GptConfig::preset(const std::string& name) {
  auto it = presets().find(name);
  if (it == presets().end()) {
    std::string names;
    for (const auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    throw std::invalid_argument("unknown model preset '" + name + "'; presets are " + names);
  }
  return it->second;
}

std::vector<std::string> GptConfig::preset_names() {
  return {"tiny",         "small",        "llama-tiny",  "gpt2-124m",     "gpt2-350m",  "gpt2-774m",
          "gpt2-1.5b",    "llama2-7b",    "llama2-13b",  "llama2-70b",    "llama3-8b",  "llama3-70b",
          "llama3.2-1b",  "llama3.2-3b",  "llama3.1-8b", "llama3.1-70b",  "llama3.1-405b",
          "mistral-7b",   "mixtral-8x7b", "qwen2.5-7b",  "qwen3-0.6b",    "qwen3-8b",   "qwen3-30b-a3b",
          "gemma2-2b",    "gemma2-9b",    "phi3-mini",   "olmo2-7b",      "gpt3-175b",  "gpt-1t"};
}

void GptConfig::validate() const {
  if (vocab_size < 2) reject("vocab_size", std::to_string(vocab_size), "needs at least 2 tokens");
  if (context < 1) reject("context", std::to_string(context), "must be >= 1");
  if (layers < 1) reject("layers", std::to_string(layers), "must be >= 1");
  if (heads < 1) reject("heads", std::to_string(heads), "must be >= 1");
  if (width < 1 || width % heads != 0) {
    reject("width", std::to_string(width), "must be a positive multiple of model.heads (" + std::to_string(heads) + ")");
  }
  if (head_size < 0) reject("head_size", std::to_string(head_size), "must be >= 0 (0: width / heads)");
  if (!(rotary_fraction > 0 && rotary_fraction <= 1)) {
    reject("rotary_fraction", std::to_string(rotary_fraction), "must be in (0, 1]");
  }
  if (position == PositionStyle::kRope && (head_dim() % 2 != 0 || rotary_dims() < 2)) {
    reject(head_size > 0 ? "head_size" : "width", std::to_string(head_size > 0 ? head_size : width),
           "rope needs an even head size and at least 2 rotated dims per head");
  }
  if (kv_heads < 0 || (kv_heads > 0 && heads % kv_heads != 0)) {
    reject("kv_heads", std::to_string(kv_heads),
           "must divide model.heads (" + std::to_string(heads) + "); 0: as many as heads");
  }
  if (ffn_hidden < 0) reject("ffn_hidden", std::to_string(ffn_hidden), "must be >= 0 (0: the default for model.mlp)");
  if (!(rope_theta > 0)) reject("rope_theta", std::to_string(rope_theta), "must be > 0");
  if (!(norm_eps > 0 && norm_eps < 1)) reject("norm_eps", std::to_string(norm_eps), "must be in (0, 1)");
  if (!(dropout >= 0.0 && dropout < 1.0)) reject("dropout", std::to_string(dropout), "must be in [0, 1)");
  if (!(init_std > 0.0 && std::isfinite(init_std))) reject("init_std", std::to_string(init_std), "must be a number > 0");
  validate_families();
  if (moe_experts < 0) reject("moe_experts", std::to_string(moe_experts), "must be >= 0 (0: dense)");
  if (!moe()) return;
  if (moe_every < 1 || moe_every > layers) {
    reject("moe_every", std::to_string(moe_every), "must be in [1, model.layers (" + std::to_string(layers) + ")]");
  }
  if (moe_top_k < 1 || moe_top_k > moe_experts) {
    reject("moe_top_k", std::to_string(moe_top_k), "must be in [1, model.moe_experts (" + std::to_string(moe_experts) + ")]");
  }
  if (moe_shared_hidden < 0) reject("moe_shared_hidden", std::to_string(moe_shared_hidden), "must be >= 0 (0: none)");
  if (!(moe_capacity_factor >= 0)) {
    reject("moe_capacity_factor", std::to_string(moe_capacity_factor), "must be >= 0 (0: dropless)");
  }
  if (!(moe_aux_loss >= 0)) reject("moe_aux_loss", std::to_string(moe_aux_loss), "must be >= 0");
  if (!(moe_z_loss >= 0)) reject("moe_z_loss", std::to_string(moe_z_loss), "must be >= 0");
  if (moe_hidden < 0) reject("moe_hidden", std::to_string(moe_hidden), "must be >= 0 (0: the dense MLP's)");
}

// Note [Model families]
// The open families differ from Llama in a few places, each a key whose
// default leaves GPT-2 and Llama as they were (docs/models.md lists which
// family uses which):
//   attention   head_size apart from width / heads; biases on q, k, v (and
//               o); QK-norm per head or over every head; a sliding window in
//               some blocks; scores scaled by 1/sqrt(query_scale) and
//               soft-capped (model/attention_variants.h).
//   positions   RoPE scaled (linear, llama3, yarn) or over a fraction of
//               each head (Note [RoPE scaling]).
//   norms       before the sublayer, after it, or both (Note [Norm
//               placement]); RMSNorm by (1 + w).
//   MLP         GeGLU; biases.
//   MoE         top-k of many experts with or without renormalised gates;
//               a shared expert with a sigmoid gate.
//   ends        embeddings times sqrt(width); final logits soft-capped.
// None of these is parallel code: tensor parallel learns of QK-norm weights
// and post-norms from its plan (parallel/tensor_parallel.cpp); everything
// else is inside modules it already splits. Counts (Note [Model counts])
// follow each key, and the tests compare them with the built model.
void GptConfig::validate_families() const {
  if (norm_plus_one && !rms_norm()) reject("norm_plus_one", "true", "needs model.norm = \"rmsnorm\"");
  if (!(attn_softcap >= 0)) reject("attn_softcap", std::to_string(attn_softcap), "must be >= 0 (0: none)");
  if (!(logit_softcap >= 0)) reject("logit_softcap", std::to_string(logit_softcap), "must be >= 0 (0: none)");
  if (!(z_loss >= 0)) reject("z_loss", std::to_string(z_loss), "must be >= 0 (0: none; PaLM used 1e-4)");
  if (!(query_scale >= 0)) reject("query_scale", std::to_string(query_scale), "must be >= 0 (0: the head size)");
  if (sliding_window < 0) reject("sliding_window", std::to_string(sliding_window), "must be >= 0 (0: none)");
  if (sliding_every < 1) reject("sliding_every", std::to_string(sliding_every), "must be >= 1");
  const RopeScaling s = rope_scaling;
  const std::string shown = "\"" + name(s) + "\"";
  if (s != RopeScaling::kNone && position != PositionStyle::kRope) reject("rope_scaling", shown, "needs model.position = \"rope\"");
  if (s != RopeScaling::kNone && !(rope_factor > 0)) reject("rope_factor", std::to_string(rope_factor), "must be > 0");
  if ((s == RopeScaling::kLlama3 || s == RopeScaling::kYarn) && rope_original_context < 1) {
    reject("rope_original_context", std::to_string(rope_original_context), "rope_scaling " + shown + " needs it (> 0)");
  }
  if (s == RopeScaling::kLlama3 && !(rope_low_freq_factor > 0 && rope_high_freq_factor > rope_low_freq_factor)) {
    reject("rope_high_freq_factor", std::to_string(rope_high_freq_factor), "must be above rope_low_freq_factor (> 0)");
  }
  if (s == RopeScaling::kYarn && !(rope_beta_fast > rope_beta_slow && rope_beta_slow > 0)) {
    reject("rope_beta_fast", std::to_string(rope_beta_fast), "must be above rope_beta_slow (> 0)");
  }
  if (!(rope_attention_factor >= 0)) {
    reject("rope_attention_factor", std::to_string(rope_attention_factor), "must be >= 0 (0: yarn's default)");
  }
}

int64_t GptConfig::mlp_hidden() const {
  if (ffn_hidden > 0) return ffn_hidden;
  if (mlp == MlpStyle::kGelu) return 4 * width;
  const int64_t hidden = (8 * width + 2) / 3;
  return (hidden + 63) / 64 * 64;
}

// Note [Model counts]
// Every count follows from the shape, part by part, as model::Gpt builds it:
// a block is the qkv projection (width x qkv_width, + bias), the output
// projection (width x width, + bias), two norms (scale, + shift for
// LayerNorm with biases) and the MLP (GELU: two matrices; SwiGLU: three, the
// biases of all but the last sized hidden); a MoE block replaces the MLP by
// a router (width x experts) and its experts. Tensor parallel splits the qkv
// and MLP input matrices by rows, their biases with them, and the output
// matrices by columns; the output biases and the norms stay whole. The
// planner's memory and time models and the parallel layer use these; tests
// compare them with the parameters a built model holds.

int64_t GptConfig::mlp_parameters(int64_t hidden) const {
  const int64_t b = mlp_has_bias() ? 1 : 0, matrices = gated_mlp() ? 3 : 2;
  return matrices * width * hidden + b * ((matrices - 1) * hidden + width);
}

int64_t GptConfig::qk_norm_parameters() const {
  if (qk_norm == QkNorm::kHead) return 2 * head_dim();
  if (qk_norm == QkNorm::kWidth) return q_width() + kv_width();
  return 0;
}

int64_t GptConfig::block_split_parameters() const {
  const int64_t h = width, qkv = qkv_width(), hidden = mlp_hidden();
  const int64_t attention = h * qkv + (qkv_has_bias() ? qkv : 0) + q_width() * h;  // qkv (column) + projection weight (row)
  const int64_t mlp = (gated_mlp() ? 3 : 2) * h * hidden + (mlp_has_bias() ? (gated_mlp() ? 2 : 1) * hidden : 0);
  return attention + mlp;  // column biases split too
}

int64_t GptConfig::block_parameters() const {
  const int64_t norm_params = (!rms_norm() && bias) ? 2 * width : width;
  const int64_t row_biases = (proj_has_bias() ? width : 0) + (mlp_has_bias() ? width : 0);  // output biases: replicated
  return block_split_parameters() + row_biases + norms_per_block() * norm_params + qk_norm_parameters();
}

int64_t GptConfig::expert_parameters() const { return moe_experts * mlp_parameters(expert_hidden()); }

int64_t GptConfig::moe_block_parameters() const {
  const int64_t shared = moe_shared_hidden > 0 ? 3 * width * moe_shared_hidden + width : 0;
  return block_parameters() - mlp_parameters(mlp_hidden()) + moe_experts * width + expert_parameters() + shared;
}

int64_t GptConfig::embedding_parameters() const {
  return vocab_size * width + (learned_positions() ? context * width : 0);
}

int64_t GptConfig::head_parameters() const {
  const int64_t norm_params = (!rms_norm() && bias) ? 2 * width : width;
  return norm_params + (tie_embeddings ? 0 : vocab_size * width);
}

std::string GptConfig::family() const {
  if (!rms_norm() && learned_positions()) return "gpt2";
  if (!rms_norm() || position != PositionStyle::kRope || bias) return "";
  if (norm_placement == NormPlacement::kSandwich || norm_plus_one) return "gemma2";
  if (norm_placement == NormPlacement::kPost || qk_norm == QkNorm::kWidth) return "olmo2";
  if (moe()) return qk_norm == QkNorm::kHead ? "qwen3_moe" : "mixtral";
  if (qk_norm == QkNorm::kHead) return "qwen3";
  if (qkv_bias && !attention_bias) return "qwen2";
  if (rotary_fraction != 1.0) return "phi3";
  if (sliding_window > 0) return "mistral";
  return "llama";
}

int64_t GptConfig::parameter_count() const {
  return embedding_parameters() + (layers - moe_blocks()) * block_parameters() + moe_blocks() * moe_block_parameters() +
         head_parameters();
}

int64_t GptConfig::active_parameter_count() const {
  return parameter_count() - moe_blocks() * (moe_experts - moe_top_k) * mlp_parameters(expert_hidden());
}

double GptConfig::block_training_flops(bool moe) const {
  const double s = static_cast<double>(context), h = static_cast<double>(width);
  const double mlp_matrices = gated_mlp() ? 3.0 : 2.0;
  const double attention = h * static_cast<double>(qkv_width()) + h * static_cast<double>(q_width());
  double weights = attention + mlp_matrices * h * static_cast<double>(mlp_hidden());
  if (moe) {
    weights = attention + static_cast<double>(moe_experts) * h +
              mlp_matrices * h * static_cast<double>(expert_hidden()) * static_cast<double>(moe_top_k) +
              (moe_shared_hidden > 0 ? 3.0 * h * static_cast<double>(moe_shared_hidden) + h : 0.0);
  }
  return s * (6 * weights + 12 * s * static_cast<double>(q_width()));
}

double GptConfig::head_training_flops() const {
  return 6.0 * static_cast<double>(context) * static_cast<double>(vocab_size) * static_cast<double>(width);
}

double GptConfig::training_flops_per_sequence() const {
  double flops = head_training_flops();
  for (int64_t i = 0; i < layers; ++i) flops += block_training_flops(is_moe_block(i));
  return flops;
}

namespace {

std::string count_text(double n) {
  char text[32];
  if (n >= 1e12) std::snprintf(text, sizeof text, "%.2fT", n / 1e12);
  else if (n >= 1e9) std::snprintf(text, sizeof text, "%.2fB", n / 1e9);
  else if (n >= 1e6) std::snprintf(text, sizeof text, "%.1fM", n / 1e6);
  else std::snprintf(text, sizeof text, "%.0fK", n / 1e3);
  return text;
}

}  // namespace

std::string GptConfig::describe(const std::string& name) const {
  std::string text = name + ": " + count_text(static_cast<double>(parameter_count())) + " parameters, " +
                     std::to_string(layers) + " layers, h " + std::to_string(width) + ", " + std::to_string(heads) +
                     " heads";
  if (grouped_query()) text += " (" + std::to_string(key_value_heads()) + " kv)";
  text += ", ffn " + std::to_string(mlp_hidden()) + " " + model::name(mlp) + ", vocab " +
          std::to_string(vocab_size) + ", seq " + std::to_string(context);
  if (moe()) {
    text += ", " + std::to_string(moe_experts) + " experts top-" + std::to_string(moe_top_k) +
            (moe_every == 1 ? " in every block" : " in 1 of every " + std::to_string(moe_every) + " blocks") + ", " +
            count_text(static_cast<double>(active_parameter_count())) + " active";
  }
  return text;
}

}  // namespace meshtrain::model
