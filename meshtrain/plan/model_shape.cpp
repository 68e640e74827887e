#include "meshtrain/plan/model_shape.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <stdexcept>

namespace meshtrain::plan {

namespace {

// A Llama-style shape: RMSNorm, RoPE, SwiGLU, untied head, no biases.
ModelShape llama(int64_t vocab, int64_t seq, int64_t layers, int64_t heads, int64_t kv_heads, int64_t width,
                 int64_t ffn) {
  ModelShape m;
  m.vocab = vocab;
  m.seq = seq;
  m.layers = layers;
  m.heads = heads;
  m.kv_heads = kv_heads;
  m.width = width;
  m.ffn = ffn;
  m.gated_mlp = m.rms_norm = true;
  m.bias = m.tied_head = m.learned_positions = false;
  return m;
}

// A GPT-2/3-style shape: LayerNorm with biases, learned positions, GELU MLP of 4h, tied head.
ModelShape gpt(int64_t vocab, int64_t seq, int64_t layers, int64_t heads, int64_t width) {
  ModelShape m;
  m.vocab = vocab;
  m.seq = seq;
  m.layers = layers;
  m.heads = m.kv_heads = heads;
  m.width = width;
  m.ffn = 4 * width;
  return m;
}

// `shape` with `experts` experts of its MLP in every `every`-th block, top_k per token, dropless.
ModelShape mixture(ModelShape shape, int64_t experts, int64_t top_k, int64_t every) {
  shape.experts = experts;
  shape.top_k = top_k;
  shape.moe_every = every;
  shape.expert_ffn = shape.ffn;
  return shape;
}

// Published shapes (model cards and papers); the MLP sizes are the released ones.
const std::map<std::string, ModelShape>& planning_presets() {
  static const std::map<std::string, ModelShape> table = {
      {"llama2-7b", llama(32000, 4096, 32, 32, 32, 4096, 11008)},
      {"llama2-13b", llama(32000, 4096, 40, 40, 40, 5120, 13824)},
      {"llama2-70b", llama(32000, 4096, 80, 64, 8, 8192, 28672)},
      {"llama3-8b", llama(128256, 8192, 32, 32, 8, 4096, 14336)},
      {"llama3-70b", llama(128256, 8192, 80, 64, 8, 8192, 28672)},
      // GPT-3's 50257 tokens padded to 50304 (a multiple of 128, as Megatron-LM pads) so tensor parallel splits it.
      {"gpt3-175b", gpt(50304, 2048, 96, 96, 12288)},
      {"gpt-1t", gpt(51200, 2048, 128, 160, 25600)},  // Narayanan et al. 2021, Table 1
      // Jiang et al. 2024: Mistral-7B's shape with 8 SwiGLU experts in every block, top 2 (46.7B, 12.9B active).
      {"mixtral-8x7b", mixture(llama(32000, 4096, 32, 32, 8, 4096, 14336), 8, 2, 1)},
  };
  return table;
}

std::string count_text(double n) {
  char text[32];
  if (n >= 1e12) std::snprintf(text, sizeof text, "%.2fT", n / 1e12);
  else if (n >= 1e9) std::snprintf(text, sizeof text, "%.2fB", n / 1e9);
  else if (n >= 1e6) std::snprintf(text, sizeof text, "%.1fM", n / 1e6);
  else std::snprintf(text, sizeof text, "%.0fK", n / 1e3);
  return text;
}

}  // namespace

ModelShape ModelShape::from_config(const model::GptConfig& config, const std::string& name) {
  config.validate();
  ModelShape m;
  m.name = name;
  m.vocab = config.vocab_size;
  m.seq = config.context;
  m.layers = config.layers;
  m.heads = config.heads;
  m.kv_heads = config.key_value_heads();
  m.width = config.width;
  m.ffn = config.mlp_hidden();
  m.gated_mlp = config.mlp == "swiglu";
  m.rms_norm = config.norm == "rmsnorm";
  m.bias = config.bias;
  m.tied_head = config.tie_embeddings;
  m.learned_positions = config.position == "learned";
  m.fused = config.fused;
  if (config.moe()) {
    m.experts = config.moe_experts;
    m.moe_every = config.moe_every;
    m.top_k = config.moe_top_k;
    m.expert_ffn = config.expert_hidden();
    m.capacity_factor = config.moe_capacity_factor;
  }
  return m;
}

ModelShape ModelShape::preset(const std::string& name) {
  auto it = planning_presets().find(name);
  if (it != planning_presets().end()) {
    ModelShape m = it->second;
    m.name = name;
    return m;
  }
  for (const auto& buildable : model::GptConfig::preset_names()) {
    if (buildable == name) return from_config(model::GptConfig::preset(name), name);
  }
  std::string names;
  for (const auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown model '" + name + "': give a meshtrain config file (.toml) or a preset: " + names);
}

std::vector<std::string> ModelShape::preset_names() {
  std::vector<std::string> names = model::GptConfig::preset_names();
  for (const char* n : {"llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "gpt3-175b", "gpt-1t",
                        "mixtral-8x7b"}) {
    names.push_back(n);
  }
  return names;
}

int64_t ModelShape::block_split_parameters() const {
  const int64_t h = width, b = bias ? 1 : 0, qkv = width + 2 * kv_width();
  const int64_t attention = h * qkv + b * qkv + h * h;           // qkv (column) + projection weight (row)
  const int64_t mlp = (gated_mlp ? 3 : 2) * h * ffn + b * (gated_mlp ? 2 : 1) * ffn;  // column biases split too
  return attention + mlp;
}

int64_t ModelShape::block_parameters() const {
  const int64_t norm = (!rms_norm && bias) ? 2 * width : width;
  const int64_t row_biases = bias ? 2 * width : 0;  // attention and MLP output biases: replicated
  return block_split_parameters() + row_biases + 2 * norm;
}

int64_t ModelShape::mlp_parameters(int64_t hidden) const {
  const int64_t b = bias ? 1 : 0, matrices = gated_mlp ? 3 : 2;
  return matrices * width * hidden + b * ((matrices - 1) * hidden + width);
}

int64_t ModelShape::moe_block_parameters() const {
  return block_parameters() - mlp_parameters(ffn) + experts * width + expert_parameters();
}

double ModelShape::assignments(double tokens, double load) const {
  const double k = static_cast<double>(top_k);
  if (load > 0) return tokens * k * load;
  return tokens * k * (capacity_factor > 0 ? std::min(1.0, capacity_factor) : 1.0);
}

int64_t ModelShape::embedding_parameters() const { return vocab * width + (learned_positions ? seq * width : 0); }

int64_t ModelShape::head_parameters() const {
  const int64_t norm = (!rms_norm && bias) ? 2 * width : width;
  return norm + (tied_head ? 0 : vocab * width);
}

int64_t ModelShape::parameter_count() const {
  return embedding_parameters() + (layers - moe_blocks()) * block_parameters() + moe_blocks() * moe_block_parameters() +
         head_parameters();
}

int64_t ModelShape::active_parameter_count() const {
  return parameter_count() - moe_blocks() * (experts - top_k) * mlp_parameters(expert_ffn);
}

double ModelShape::block_training_flops() const {
  const double s = static_cast<double>(seq), h = static_cast<double>(width);
  const double weights = h * (h + 2.0 * static_cast<double>(kv_width())) + h * h +
                         (gated_mlp ? 3.0 : 2.0) * h * static_cast<double>(ffn);
  return s * (6 * weights + 12 * s * h);
}

double ModelShape::block_training_flops(int64_t i) const {
  if (!is_moe_block(i)) return block_training_flops();
  const double s = static_cast<double>(seq), h = static_cast<double>(width);
  const double mlp = (gated_mlp ? 3.0 : 2.0) * h * static_cast<double>(ffn);
  const double experts_used = (gated_mlp ? 3.0 : 2.0) * h * static_cast<double>(expert_ffn) * static_cast<double>(top_k);
  return block_training_flops() + 6 * s * (static_cast<double>(experts) * h + experts_used - mlp);
}

double ModelShape::training_flops_per_sequence() const {
  double flops = head_training_flops();
  for (int64_t i = 0; i < layers; ++i) flops += block_training_flops(i);
  return flops;
}

double ModelShape::head_training_flops() const {
  return 6.0 * static_cast<double>(seq) * static_cast<double>(vocab) * static_cast<double>(width);
}

double ModelShape::block_recompute_flops(parallel::CheckpointMode recompute) const {
  const double s = static_cast<double>(seq), h = static_cast<double>(width);
  switch (recompute) {
    case parallel::CheckpointMode::kNone: return 0;
    case parallel::CheckpointMode::kSelective: return s * 4 * s * h;
    case parallel::CheckpointMode::kFull: break;
  }
  return block_training_flops() / 3;  // a forward is a third of forward + backward
}

std::string ModelShape::describe() const {
  std::string text = name + ": " + count_text(static_cast<double>(parameter_count())) + " parameters, " +
                     std::to_string(layers) + " layers, h " + std::to_string(width) + ", " + std::to_string(heads) +
                     " heads";
  if (kv_heads != heads) text += " (" + std::to_string(kv_heads) + " kv)";
  text += ", ffn " + std::to_string(ffn) + (gated_mlp ? " swiglu" : " gelu") + ", vocab " + std::to_string(vocab) +
          ", seq " + std::to_string(seq);
  if (moe()) {
    text += ", " + std::to_string(experts) + " experts top-" + std::to_string(top_k) +
            (moe_every == 1 ? " in every block" : " in 1 of every " + std::to_string(moe_every) + " blocks") + ", " +
            count_text(static_cast<double>(active_parameter_count())) + " active";
  }
  return text;
}

}  // namespace meshtrain::plan
