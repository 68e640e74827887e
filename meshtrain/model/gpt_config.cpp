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
  if (!(dropout >= 0.0 && dropout < 1.0)) reject("dropout", std::to_string(dropout), "must be in [0, 1)");
  if (norm != "layernorm" && norm != "rmsnorm") reject("norm", "\"" + norm + "\"", "use \"layernorm\" or \"rmsnorm\"");
  if (position != "learned" && position != "rope") {
    reject("position", "\"" + position + "\"", "use \"learned\" or \"rope\"");
  }
  if (mlp != "gelu" && mlp != "swiglu") reject("mlp", "\"" + mlp + "\"", "use \"gelu\" or \"swiglu\"");
}

int64_t GptConfig::mlp_hidden() const {
  if (mlp == "gelu") return 4 * width;
  const int64_t hidden = (8 * width + 2) / 3;
  return (hidden + 63) / 64 * 64;
}

int64_t GptConfig::parameter_count() const {
  const int64_t d = width, h = mlp_hidden(), b = bias ? 1 : 0;
  const int64_t norm_params = (norm == "layernorm" && bias) ? 2 * d : d;
  const int64_t attention = d * 3 * d + b * 3 * d + d * d + b * d;
  const int64_t feed_forward = mlp == "gelu" ? d * h + b * h + h * d + b * d : 2 * d * h + 2 * b * h + h * d + b * d;
  const int64_t block = 2 * norm_params + attention + feed_forward;
  const int64_t embeddings = vocab_size * d + (position == "learned" ? context * d : 0);
  const int64_t head = tie_embeddings ? 0 : vocab_size * d;
  return embeddings + layers * block + norm_params + head;
}

double GptConfig::flops_per_token() const {
  const double d = width, h = mlp_hidden();
  const double attention_weights = 4 * d * d;
  const double mlp_weights = (mlp == "gelu" ? 2 : 3) * d * h;
  const double matmul_params = layers * (attention_weights + mlp_weights) + vocab_size * d;
  return 6 * matmul_params + 12.0 * layers * context * d;
}

}  // namespace meshtrain::model
