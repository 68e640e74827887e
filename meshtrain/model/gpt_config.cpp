#include "meshtrain/model/gpt_config.h"

#include <map>
#include <stdexcept>

namespace meshtrain::model {

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

const std::map<std::string, GptConfig>& presets() {
  static const std::map<std::string, GptConfig> table = [] {
    std::map<std::string, GptConfig> t;
    t["tiny"] = shape(256, 128, 4, 4, 256);
    t["small"] = shape(256, 256, 6, 6, 384);
    GptConfig llama = shape(256, 128, 4, 4, 256);
    llama.norm = "rmsnorm";
    llama.position = "rope";
    llama.mlp = "swiglu";
    llama.tie_embeddings = false;
    llama.bias = false;
    t["llama-tiny"] = llama;
    t["gpt2-124m"] = shape(50257, 1024, 12, 12, 768);
    t["gpt2-350m"] = shape(50257, 1024, 24, 16, 1024);
    t["gpt2-774m"] = shape(50257, 1024, 36, 20, 1280);
    t["gpt2-1.5b"] = shape(50257, 1024, 48, 25, 1600);
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
  return {"tiny", "small", "llama-tiny", "gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b"};
}

void GptConfig::validate() const {
  if (vocab_size < 2) reject("vocab_size", std::to_string(vocab_size), "needs at least 2 tokens");
  if (context < 1) reject("context", std::to_string(context), "must be >= 1");
  if (layers < 1) reject("layers", std::to_string(layers), "must be >= 1");
  if (heads < 1) reject("heads", std::to_string(heads), "must be >= 1");
  if (width < 1 || width % heads != 0) {
    reject("width", std::to_string(width), "must be a positive multiple of model.heads (" + std::to_string(heads) + ")");
  }
  if (position == "rope" && head_dim() % 2 != 0) {
    reject("width", std::to_string(width), "rope needs an even head size (width / heads)");
  }
  if (kv_heads < 0 || (kv_heads > 0 && heads % kv_heads != 0)) {
    reject("kv_heads", std::to_string(kv_heads),
           "must divide model.heads (" + std::to_string(heads) + "); 0: as many as heads");
  }
  if (ffn_hidden < 0) reject("ffn_hidden", std::to_string(ffn_hidden), "must be >= 0 (0: the default for model.mlp)");
  if (!(rope_theta > 0)) reject("rope_theta", std::to_string(rope_theta), "must be > 0");
  if (!(norm_eps > 0 && norm_eps < 1)) reject("norm_eps", std::to_string(norm_eps), "must be in (0, 1)");
  if (!(dropout >= 0.0 && dropout < 1.0)) reject("dropout", std::to_string(dropout), "must be in [0, 1)");
  if (norm != "layernorm" && norm != "rmsnorm") reject("norm", "\"" + norm + "\"", "use \"layernorm\" or \"rmsnorm\"");
  if (position != "learned" && position != "rope") {
    reject("position", "\"" + position + "\"", "use \"learned\" or \"rope\"");
  }
  if (mlp != "gelu" && mlp != "swiglu") reject("mlp", "\"" + mlp + "\"", "use \"gelu\" or \"swiglu\"");
  if (moe_experts < 0) reject("moe_experts", std::to_string(moe_experts), "must be >= 0 (0: dense)");
  if (!moe()) return;
  if (moe_every < 1 || moe_every > layers) {
    reject("moe_every", std::to_string(moe_every), "must be in [1, model.layers (" + std::to_string(layers) + ")]");
  }
  if (moe_top_k < 1 || moe_top_k > 2 || moe_top_k > moe_experts) {
    reject("moe_top_k", std::to_string(moe_top_k),
           "must be 1 (Switch) or 2 (GShard) and at most model.moe_experts (" + std::to_string(moe_experts) + ")");
  }
  if (!(moe_capacity_factor >= 0)) {
    reject("moe_capacity_factor", std::to_string(moe_capacity_factor), "must be >= 0 (0: dropless)");
  }
  if (moe_second_expert != "random" && moe_second_expert != "always") {
    reject("moe_second_expert", "\"" + moe_second_expert + "\"", "use \"random\" or \"always\"");
  }
  if (!(moe_aux_loss >= 0)) reject("moe_aux_loss", std::to_string(moe_aux_loss), "must be >= 0");
  if (!(moe_z_loss >= 0)) reject("moe_z_loss", std::to_string(moe_z_loss), "must be >= 0");
  if (moe_hidden < 0) reject("moe_hidden", std::to_string(moe_hidden), "must be >= 0 (0: the dense MLP's)");
}

int64_t GptConfig::mlp_hidden() const {
  if (ffn_hidden > 0) return ffn_hidden;
  if (mlp == "gelu") return 4 * width;
  const int64_t hidden = (8 * width + 2) / 3;
  return (hidden + 63) / 64 * 64;
}

namespace {

// Parameters of one feed-forward of hidden size h (GELU: fc, proj; SwiGLU: gate, up, down).
int64_t feed_forward_parameters(const GptConfig& c, int64_t h) {
  const int64_t d = c.width, b = c.bias ? 1 : 0;
  return c.mlp == "gelu" ? d * h + b * h + h * d + b * d : 2 * d * h + 2 * b * h + h * d + b * d;
}

// Every parameter, with `experts_counted` experts per MoE block.
int64_t count_parameters(const GptConfig& c, int64_t experts_counted) {
  const int64_t d = c.width, b = c.bias ? 1 : 0;
  const int64_t norm_params = (c.norm == "layernorm" && c.bias) ? 2 * d : d;
  const int64_t attention = d * c.qkv_width() + b * c.qkv_width() + d * d + b * d;
  const int64_t dense = feed_forward_parameters(c, c.mlp_hidden());
  const int64_t moe = c.moe_experts * d + experts_counted * feed_forward_parameters(c, c.expert_hidden());
  const int64_t blocks = c.layers * (2 * norm_params + attention) + (c.layers - c.moe_blocks()) * dense +
                         c.moe_blocks() * moe;
  const int64_t embeddings = c.vocab_size * d + (c.position == "learned" ? c.context * d : 0);
  const int64_t head = c.tie_embeddings ? 0 : c.vocab_size * d;
  return embeddings + blocks + norm_params + head;
}

}  // namespace

int64_t GptConfig::parameter_count() const { return count_parameters(*this, moe_experts); }

int64_t GptConfig::active_parameter_count() const { return count_parameters(*this, moe() ? moe_top_k : 0); }

double GptConfig::flops_per_token() const {
  const double d = width, h = mlp_hidden(), e = expert_hidden();
  const double attention_weights = d * qkv_width() + d * d;  // qkv and the output projection
  const double mlp_weights = (mlp == "gelu" ? 2 : 3) * d * h;
  const double moe_weights = moe_experts * d + moe_top_k * (mlp == "gelu" ? 2 : 3) * d * e;
  const double dense_blocks = static_cast<double>(layers - moe_blocks()), moe_blocks_ = static_cast<double>(moe_blocks());
  const double matmul_params =
      layers * attention_weights + dense_blocks * mlp_weights + moe_blocks_ * moe_weights + vocab_size * d;
  return 6 * matmul_params + 12.0 * layers * context * d;
}

}  // namespace meshtrain::model
