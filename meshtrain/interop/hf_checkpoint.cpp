#include "meshtrain/interop/hf_checkpoint.h"

#include "meshtrain/interop/safetensors.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

namespace meshtrain::interop {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw FormatError(path + ": cannot open (is this a Hugging Face model folder?)");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw FormatError(path + ": not valid JSON (" + std::string(e.what()) + ")");
  }
}

template <typename T>
T get(const json& config, const char* key, const std::string& where) {
  if (!config.contains(key) || config[key].is_null()) throw FormatError(where + ": \"" + key + "\" is missing");
  try {
    return config[key].get<T>();
  } catch (const json::exception&) {
    throw FormatError(where + ": \"" + key + "\" has the wrong type (" + config[key].dump() + ")");
  }
}

template <typename T>
T get_or(const json& config, const char* key, T fallback) {
  return config.contains(key) && !config[key].is_null() ? config[key].get<T>() : fallback;
}

void refuse(const std::string& where, const std::string& what) {
  throw FormatError(where + ": " + what + " has no equivalent in meshtrain's model; it cannot be imported");
}

model::GptConfig gpt2_config(const json& c, const std::string& where) {
  model::GptConfig m = model::GptConfig::preset("tiny");
  m.vocab_size = get<int64_t>(c, "vocab_size", where);
  m.context = get<int64_t>(c, "n_positions", where);
  m.width = get<int64_t>(c, "n_embd", where);
  m.layers = get<int64_t>(c, "n_layer", where);
  m.heads = get<int64_t>(c, "n_head", where);
  m.ffn_hidden = get_or<int64_t>(c, "n_inner", 0);
  m.norm_eps = get_or<double>(c, "layer_norm_epsilon", 1e-5);
  m.tie_embeddings = get_or<bool>(c, "tie_word_embeddings", true);
  m.dropout = 0;
  const std::string act = get_or<std::string>(c, "activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh") refuse(where, "activation_function \"" + act + "\"");
  if (get_or<bool>(c, "scale_attn_by_inverse_layer_idx", false)) refuse(where, "scale_attn_by_inverse_layer_idx");
  if (!get_or<bool>(c, "scale_attn_weights", true)) refuse(where, "scale_attn_weights = false");
  return m;
}

model::GptConfig llama_config(const json& c, const std::string& where) {
  model::GptConfig m = model::GptConfig::preset("llama-tiny");
  m.vocab_size = get<int64_t>(c, "vocab_size", where);
  m.context = get<int64_t>(c, "max_position_embeddings", where);
  m.width = get<int64_t>(c, "hidden_size", where);
  m.layers = get<int64_t>(c, "num_hidden_layers", where);
  m.heads = get<int64_t>(c, "num_attention_heads", where);
  m.kv_heads = get_or<int64_t>(c, "num_key_value_heads", m.heads);
  if (m.kv_heads == m.heads) m.kv_heads = 0;
  m.ffn_hidden = get<int64_t>(c, "intermediate_size", where);
  m.norm_eps = get_or<double>(c, "rms_norm_eps", 1e-6);
  // transformers 4 writes rope_theta and rope_scaling; 5 writes rope_parameters {rope_type, rope_theta, ...}.
  m.rope_theta = get_or<double>(c, "rope_theta", 10000.0);
  if (c.contains("rope_parameters") && c["rope_parameters"].is_object()) {
    const json& rope = c["rope_parameters"];
    m.rope_theta = get_or<double>(rope, "rope_theta", m.rope_theta);
    const std::string type = get_or<std::string>(rope, "rope_type", "default");
    if (type != "default") refuse(where, "rope_parameters " + rope.dump() + " (rope scaling)");
  }
  m.tie_embeddings = get_or<bool>(c, "tie_word_embeddings", false);
  m.dropout = 0;
  if (c.contains("rope_scaling") && !c["rope_scaling"].is_null()) refuse(where, "rope_scaling " + c["rope_scaling"].dump());
  if (get_or<bool>(c, "attention_bias", false)) refuse(where, "attention_bias = true");
  if (get_or<bool>(c, "mlp_bias", false)) refuse(where, "mlp_bias = true");
  const std::string act = get_or<std::string>(c, "hidden_act", "silu");
  if (act != "silu") refuse(where, "hidden_act \"" + act + "\"");
  if (c.contains("head_dim") && !c["head_dim"].is_null() && c["head_dim"].get<int64_t>() * m.heads != m.width) {
    refuse(where, "head_dim " + c["head_dim"].dump() + " (not hidden_size / num_attention_heads)");
  }
  return m;
}

// The checkpoint's tensors by name, over one file or the shards of an index.
class Tensors {
 public:
  explicit Tensors(const std::string& dir) {
    const std::string index = (fs::path(dir) / "model.safetensors.index.json").string();
    const std::string single = (fs::path(dir) / "model.safetensors").string();
    if (fs::exists(index)) {
      const json j = read_json(index);
      if (!j.contains("weight_map") || !j["weight_map"].is_object()) throw FormatError(index + ": no \"weight_map\"");
      for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
        const std::string file = it->get<std::string>();
        if (!files_.count(file)) files_[file] = std::make_unique<SafetensorsFile>((fs::path(dir) / file).string());
        where_[it.key()] = file;
      }
    } else if (fs::exists(single)) {
      files_["model.safetensors"] = std::make_unique<SafetensorsFile>(single);
      for (const std::string& name : files_.begin()->second->names()) where_[name] = "model.safetensors";
    } else {
      const bool pickled = fs::exists(fs::path(dir) / "pytorch_model.bin");
      throw FormatError(dir + ": no model.safetensors or model.safetensors.index.json" +
                        (pickled ? std::string(" (pytorch_model.bin is not read: save the model with "
                                               "safe_serialization=True)")
                                 : std::string()));
    }
  }
  bool has(const std::string& name) const { return where_.count(name) > 0; }
  at::Tensor read(const std::string& name, const std::vector<int64_t>& shape) const {
    auto it = where_.find(name);
    if (it == where_.end()) throw FormatError("the checkpoint has no tensor \"" + name + "\"");
    at::Tensor t = files_.at(it->second)->read(name);
    if (t.sizes().vec() != shape) {
      std::ostringstream s;
      s << "tensor \"" << name << "\" has shape " << t.sizes() << ", the config implies " << at::IntArrayRef(shape);
      throw FormatError(s.str());
    }
    return t.to(at::kFloat);
  }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, file] : where_) out.push_back(name);
    return out;
  }

 private:
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::string> where_;
};

// Grouped-query q, k, v [H*hd, C], [G*hd, C], [G*hd, C] -> the fused qkv rows
// (Note [Grouped-query layout]), and back.
at::Tensor fuse_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const model::GptConfig& c) {
  if (!c.grouped_query()) return at::cat({q, k, v});
  const int64_t g = c.key_value_heads(), hd = c.head_dim(), rep = c.heads / g, in = q.size(1);
  return at::cat({q.view({g, rep, hd, in}), k.view({g, 1, hd, in}), v.view({g, 1, hd, in})}, 1).reshape({-1, in});
}

std::vector<at::Tensor> unfuse_qkv(const at::Tensor& qkv, const model::GptConfig& c) {
  const int64_t in = qkv.size(1);
  if (!c.grouped_query()) return qkv.split(c.width);
  const int64_t g = c.key_value_heads(), hd = c.head_dim(), rep = c.heads / g;
  const at::Tensor grouped = qkv.view({g, rep + 2, hd, in});
  return {grouped.narrow(1, 0, rep).reshape({-1, in}).contiguous(), grouped.select(1, rep).reshape({-1, in}).contiguous(),
          grouped.select(1, rep + 1).reshape({-1, in}).contiguous()};
}

std::map<std::string, at::Tensor> gpt2_weights(const Tensors& t, const model::GptConfig& c) {
  const std::string prefix = t.has("transformer.wte.weight") ? "transformer." : "";
  auto read = [&](const std::string& name, std::vector<int64_t> shape) { return t.read(prefix + name, shape); };
  const int64_t d = c.width, f = c.mlp_hidden();
  std::map<std::string, at::Tensor> w;
  w["wte.weight"] = read("wte.weight", {c.vocab_size, d});
  w["wpe.weight"] = read("wpe.weight", {c.context, d});
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string h = "h." + std::to_string(i) + ".", b = "blocks." + std::to_string(i) + ".";
    w[b + "norm1.weight"] = read(h + "ln_1.weight", {d});
    w[b + "norm1.bias"] = read(h + "ln_1.bias", {d});
    w[b + "attn.qkv.weight"] = read(h + "attn.c_attn.weight", {d, 3 * d}).t().contiguous();  // Conv1D: [in, out]
    w[b + "attn.qkv.bias"] = read(h + "attn.c_attn.bias", {3 * d});
    w[b + "attn.proj.weight"] = read(h + "attn.c_proj.weight", {d, d}).t().contiguous();
    w[b + "attn.proj.bias"] = read(h + "attn.c_proj.bias", {d});
    w[b + "norm2.weight"] = read(h + "ln_2.weight", {d});
    w[b + "norm2.bias"] = read(h + "ln_2.bias", {d});
    w[b + "mlp.fc.weight"] = read(h + "mlp.c_fc.weight", {d, f}).t().contiguous();
    w[b + "mlp.fc.bias"] = read(h + "mlp.c_fc.bias", {f});
    w[b + "mlp.proj.weight"] = read(h + "mlp.c_proj.weight", {f, d}).t().contiguous();
    w[b + "mlp.proj.bias"] = read(h + "mlp.c_proj.bias", {d});
  }
  w["norm_f.weight"] = read("ln_f.weight", {d});
  w["norm_f.bias"] = read("ln_f.bias", {d});
  if (!c.tie_embeddings) w["head.weight"] = t.read("lm_head.weight", {c.vocab_size, d});
  return w;
}

std::map<std::string, at::Tensor> llama_weights(const Tensors& t, const model::GptConfig& c) {
  const int64_t d = c.width, f = c.mlp_hidden(), kv = c.key_value_heads() * c.head_dim();
  std::map<std::string, at::Tensor> w;
  w["wte.weight"] = t.read("model.embed_tokens.weight", {c.vocab_size, d});
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string h = "model.layers." + std::to_string(i) + ".", b = "blocks." + std::to_string(i) + ".";
    w[b + "norm1.weight"] = t.read(h + "input_layernorm.weight", {d});
    w[b + "attn.qkv.weight"] = fuse_qkv(t.read(h + "self_attn.q_proj.weight", {d, d}),
                                        t.read(h + "self_attn.k_proj.weight", {kv, d}),
                                        t.read(h + "self_attn.v_proj.weight", {kv, d}), c);
    if (c.qkv_bias) {  // Qwen2: fused in the weights' row order
      w[b + "attn.qkv.bias"] = fuse_qkv(t.read(h + "self_attn.q_proj.bias", {d}).view({-1, 1}),
                                        t.read(h + "self_attn.k_proj.bias", {kv}).view({-1, 1}),
                                        t.read(h + "self_attn.v_proj.bias", {kv}).view({-1, 1}), c)
                                   .view({-1});
    }
    w[b + "attn.proj.weight"] = t.read(h + "self_attn.o_proj.weight", {d, d});
    w[b + "norm2.weight"] = t.read(h + "post_attention_layernorm.weight", {d});
    w[b + "mlp.gate.weight"] = t.read(h + "mlp.gate_proj.weight", {f, d});
    w[b + "mlp.up.weight"] = t.read(h + "mlp.up_proj.weight", {f, d});
    w[b + "mlp.down.weight"] = t.read(h + "mlp.down_proj.weight", {d, f});
  }
  w["norm_f.weight"] = t.read("model.norm.weight", {d});
  if (!c.tie_embeddings) w["head.weight"] = t.read("lm_head.weight", {c.vocab_size, d});
  return w;
}

}  // namespace

HfModel read_hf_model(const std::string& dir) {
  const std::string config_path = (fs::path(dir) / "config.json").string();
  const json c = read_json(config_path);
  HfModel out;
  out.model_type = get<std::string>(c, "model_type", config_path);
  if (out.model_type == "gpt2") {
    out.config = gpt2_config(c, config_path);
  } else if (out.model_type == "llama" || out.model_type == "mistral" || out.model_type == "qwen2") {
    out.config = llama_config(c, config_path);
    // Qwen2 is Llama with biases on q, k and v (and an optional sliding window, off in its releases).
    if (out.model_type == "qwen2") {
      out.config.qkv_bias = true;
      if (get_or<bool>(c, "use_sliding_window", false)) refuse(config_path, "use_sliding_window = true");
    }
    // Mistral is Llama with a sliding attention window; without one (v0.2 on), or one the context fits in, it is Llama.
    if (out.model_type == "mistral" && c.contains("sliding_window") && !c["sliding_window"].is_null() &&
        c["sliding_window"].get<int64_t>() < out.config.context) {
      refuse(config_path, "sliding_window " + c["sliding_window"].dump() + " (shorter than the context)");
    }
  } else {
    throw FormatError(config_path + ": model_type \"" + out.model_type +
                      "\" is not supported (gpt2, llama, qwen2, and mistral without a sliding window are)");
  }
  try {
    out.config.validate();
  } catch (const std::invalid_argument& e) {
    throw FormatError(config_path + ": " + e.what());
  }
  const Tensors tensors(dir);
  out.weights = out.model_type == "gpt2" ? gpt2_weights(tensors, out.config) : llama_weights(tensors, out.config);
  return out;
}

namespace {

// The architecture a meshtrain model can be written as, or a FormatError naming what stops it.
std::string architecture_of(const model::GptConfig& c) {
  if (c.moe()) throw FormatError("a mixture-of-experts model has no GPT-2 or Llama equivalent");
  if (c.norm == "layernorm" && c.position == "learned" && c.mlp == "gelu" && c.bias && !c.grouped_query()) return "gpt2";
  if (c.norm == "rmsnorm" && c.position == "rope" && c.mlp == "swiglu" && !c.bias) return c.qkv_bias ? "qwen2" : "llama";
  throw FormatError("model " + c.norm + "/" + c.position + "/" + c.mlp + (c.bias ? "/bias" : "/no bias") +
                    " is neither GPT-2 style (layernorm/learned/gelu/bias) nor Llama style (rmsnorm/rope/swiglu/no "
                    "bias)");
}

json hf_config(const model::GptConfig& c, const std::string& arch, at::ScalarType dtype) {
  const std::string torch_dtype = dtype == at::kBFloat16 ? "bfloat16" : dtype == at::kHalf ? "float16" : "float32";
  if (arch == "gpt2") {
    return {{"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"}, {"vocab_size", c.vocab_size},
            {"n_positions", c.context}, {"n_embd", c.width}, {"n_layer", c.layers}, {"n_head", c.heads},
            {"n_inner", c.mlp_hidden()}, {"activation_function", "gelu_new"}, {"layer_norm_epsilon", c.norm_eps},
            {"resid_pdrop", 0.0}, {"embd_pdrop", 0.0}, {"attn_pdrop", 0.0}, {"initializer_range", 0.02},
            {"tie_word_embeddings", c.tie_embeddings}, {"torch_dtype", torch_dtype}};
  }
  json llama = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"vocab_size", c.vocab_size},
          {"max_position_embeddings", c.context}, {"hidden_size", c.width}, {"intermediate_size", c.mlp_hidden()},
          {"num_hidden_layers", c.layers}, {"num_attention_heads", c.heads},
          {"num_key_value_heads", c.key_value_heads()}, {"head_dim", c.head_dim()}, {"hidden_act", "silu"},
          {"rms_norm_eps", c.norm_eps}, {"rope_theta", c.rope_theta}, {"rope_scaling", nullptr},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", c.rope_theta}}},
          {"attention_bias", false}, {"mlp_bias", false}, {"attention_dropout", 0.0},
          {"tie_word_embeddings", c.tie_embeddings}, {"initializer_range", 0.02}, {"torch_dtype", torch_dtype}};
  if (arch == "qwen2") {
    llama["architectures"] = {"Qwen2ForCausalLM"};
    llama["model_type"] = "qwen2";
    llama["use_sliding_window"] = false;
    llama.erase("attention_bias");
    llama.erase("mlp_bias");
  }
  return llama;
}

std::vector<std::pair<std::string, at::Tensor>> hf_weights(const model::GptConfig& c, const std::string& arch,
                                                           const std::map<std::string, at::Tensor>& w) {
  auto at_name = [&](const std::string& name) {
    auto it = w.find(name);
    if (it == w.end()) throw FormatError("the model has no parameter \"" + name + "\"");
    return it->second;
  };
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (arch == "gpt2") {
    out.emplace_back("transformer.wte.weight", at_name("wte.weight"));
    out.emplace_back("transformer.wpe.weight", at_name("wpe.weight"));
    for (int64_t i = 0; i < c.layers; ++i) {
      const std::string h = "transformer.h." + std::to_string(i) + ".", b = "blocks." + std::to_string(i) + ".";
      out.emplace_back(h + "ln_1.weight", at_name(b + "norm1.weight"));
      out.emplace_back(h + "ln_1.bias", at_name(b + "norm1.bias"));
      out.emplace_back(h + "attn.c_attn.weight", at_name(b + "attn.qkv.weight").t());
      out.emplace_back(h + "attn.c_attn.bias", at_name(b + "attn.qkv.bias"));
      out.emplace_back(h + "attn.c_proj.weight", at_name(b + "attn.proj.weight").t());
      out.emplace_back(h + "attn.c_proj.bias", at_name(b + "attn.proj.bias"));
      out.emplace_back(h + "ln_2.weight", at_name(b + "norm2.weight"));
      out.emplace_back(h + "ln_2.bias", at_name(b + "norm2.bias"));
      out.emplace_back(h + "mlp.c_fc.weight", at_name(b + "mlp.fc.weight").t());
      out.emplace_back(h + "mlp.c_fc.bias", at_name(b + "mlp.fc.bias"));
      out.emplace_back(h + "mlp.c_proj.weight", at_name(b + "mlp.proj.weight").t());
      out.emplace_back(h + "mlp.c_proj.bias", at_name(b + "mlp.proj.bias"));
    }
    out.emplace_back("transformer.ln_f.weight", at_name("norm_f.weight"));
    out.emplace_back("transformer.ln_f.bias", at_name("norm_f.bias"));
  } else {
    out.emplace_back("model.embed_tokens.weight", at_name("wte.weight"));
    for (int64_t i = 0; i < c.layers; ++i) {
      const std::string h = "model.layers." + std::to_string(i) + ".", b = "blocks." + std::to_string(i) + ".";
      const std::vector<at::Tensor> qkv = unfuse_qkv(at_name(b + "attn.qkv.weight"), c);
      out.emplace_back(h + "input_layernorm.weight", at_name(b + "norm1.weight"));
      out.emplace_back(h + "self_attn.q_proj.weight", qkv[0]);
      out.emplace_back(h + "self_attn.k_proj.weight", qkv[1]);
      out.emplace_back(h + "self_attn.v_proj.weight", qkv[2]);
      if (c.qkv_bias) {
        const std::vector<at::Tensor> biases = unfuse_qkv(at_name(b + "attn.qkv.bias").view({-1, 1}), c);
        out.emplace_back(h + "self_attn.q_proj.bias", biases[0].view({-1}));
        out.emplace_back(h + "self_attn.k_proj.bias", biases[1].view({-1}));
        out.emplace_back(h + "self_attn.v_proj.bias", biases[2].view({-1}));
      }
      out.emplace_back(h + "self_attn.o_proj.weight", at_name(b + "attn.proj.weight"));
      out.emplace_back(h + "post_attention_layernorm.weight", at_name(b + "norm2.weight"));
      out.emplace_back(h + "mlp.gate_proj.weight", at_name(b + "mlp.gate.weight"));
      out.emplace_back(h + "mlp.up_proj.weight", at_name(b + "mlp.up.weight"));
      out.emplace_back(h + "mlp.down_proj.weight", at_name(b + "mlp.down.weight"));
    }
    out.emplace_back("model.norm.weight", at_name("norm_f.weight"));
  }
  if (!c.tie_embeddings) out.emplace_back("lm_head.weight", at_name("head.weight"));
  return out;
}

void write_json(const std::string& path, const json& j) {
  std::ofstream out(path, std::ios::trunc);
  out << j.dump(2) << "\n";
  if (!out) throw FormatError(path + ": cannot write");
}

}  // namespace

void write_hf_model(const std::string& dir, const model::GptConfig& config,
                    const std::map<std::string, at::Tensor>& weights, at::ScalarType dtype, int64_t max_shard_bytes) {
  const std::string arch = architecture_of(config);
  std::vector<std::pair<std::string, at::Tensor>> tensors = hf_weights(config, arch, weights);
  for (auto& [name, t] : tensors) t = t.to(dtype).contiguous();
  fs::create_directories(dir);
  // Shards in order, each up to max_shard_bytes (a larger tensor alone).
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> shards(1);
  int64_t bytes = 0, total = 0;
  for (auto& item : tensors) {
    const int64_t size = item.second.numel() * static_cast<int64_t>(item.second.element_size());
    if (bytes > 0 && bytes + size > max_shard_bytes) shards.emplace_back(), bytes = 0;
    shards.back().push_back(item);
    bytes += size, total += size;
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  write_json((fs::path(dir) / "config.json").string(), hf_config(config, arch, dtype));
  if (shards.size() == 1) {
    write_safetensors((fs::path(dir) / "model.safetensors").string(), shards[0], metadata);
    return;
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", json::object()}};
  for (size_t i = 0; i < shards.size(); ++i) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    write_safetensors((fs::path(dir) / name).string(), shards[i], metadata);
    for (const auto& [tensor, t] : shards[i]) index["weight_map"][tensor] = name;
  }
  write_json((fs::path(dir) / "model.safetensors.index.json").string(), index);
}

}  // namespace meshtrain::interop
