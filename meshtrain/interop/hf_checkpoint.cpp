#include "meshtrain/interop/hf_checkpoint.h"

#include "meshtrain/interop/hf_families.h"
#include "meshtrain/interop/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
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
  if (act != "gelu_new" && act != "gelu_pytorch_tanh") refuse_import(where, "activation_function \"" + act + "\"");
  if (get_or<bool>(c, "scale_attn_by_inverse_layer_idx", false)) refuse_import(where, "scale_attn_by_inverse_layer_idx");
  if (!get_or<bool>(c, "scale_attn_weights", true)) refuse_import(where, "scale_attn_weights = false");
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

}  // namespace

HfModel read_hf_config(const std::string& dir) {
  const std::string config_path = (fs::path(dir) / "config.json").string();
  const json c = read_json(config_path);
  HfModel out;
  out.model_type = get<std::string>(c, "model_type", config_path);
  const std::vector<std::string>& families = family_types();
  const bool family = std::find(families.begin(), families.end(), out.model_type) != families.end();
  if (out.model_type == "gpt2") {
    out.config = gpt2_config(c, config_path);
  } else if (family) {
    out.config = config_from_family(c, out.model_type, config_path);
  } else {
    std::string names = "gpt2";
    for (const std::string& f : families) names += ", " + f;
    throw FormatError(config_path + ": model_type \"" + out.model_type + "\" is not supported (" + names + " are)");
  }
  try {
    out.config.validate();
  } catch (const std::invalid_argument& e) {
    throw FormatError(config_path + ": " + e.what());
  }
  return out;
}

HfModel read_hf_model(const std::string& dir) {
  HfModel out = read_hf_config(dir);
  const Tensors tensors(dir);
  if (out.model_type == "gpt2") {
    out.weights = gpt2_weights(tensors, out.config);
  } else {
    const TensorSource source{[&](const std::string& name) { return tensors.has(name); },
                              [&](const std::string& name, const std::vector<int64_t>& shape) {
                                return tensors.read(name, shape);
                              }};
    out.weights = read_family_weights(source, out.config, out.model_type);
  }
  return out;
}

namespace {

// The architecture a meshtrain model can be written as, or a FormatError naming what stops it.
std::string architecture_of(const model::GptConfig& c) {
  if (c.norm == model::NormStyle::kLayerNorm && c.position == model::PositionStyle::kLearned && c.mlp == model::MlpStyle::kGelu && c.bias && !c.grouped_query() &&
      !c.moe() && c.head_size == 0 && c.qk_norm == model::QkNorm::kNone && c.norm_placement == model::NormPlacement::kPre && c.sliding_window == 0 &&
      c.attn_softcap == 0 && c.logit_softcap == 0 && c.query_scale == 0 && !c.embed_scale) {
    return "gpt2";
  }
  return family_of(c);
}

json hf_config(const model::GptConfig& c, const std::string& arch, at::ScalarType dtype) {
  const std::string torch_dtype = dtype == at::kBFloat16 ? "bfloat16" : dtype == at::kHalf ? "float16" : "float32";
  if (arch == "gpt2") {
    return {{"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"}, {"vocab_size", c.vocab_size},
            {"n_positions", c.context}, {"n_embd", c.width}, {"n_layer", c.layers}, {"n_head", c.heads},
            {"n_inner", c.mlp_hidden()}, {"activation_function", "gelu_new"}, {"layer_norm_epsilon", c.norm_eps},
            {"resid_pdrop", 0.0}, {"embd_pdrop", 0.0}, {"attn_pdrop", 0.0}, {"initializer_range", c.init_std},
            {"tie_word_embeddings", c.tie_embeddings}, {"torch_dtype", torch_dtype}};
  }
  return family_config(c, arch, torch_dtype);
}

std::vector<std::pair<std::string, at::Tensor>> hf_weights(const model::GptConfig& c, const std::string& arch,
                                                           const std::map<std::string, at::Tensor>& w) {
  auto at_name = [&](const std::string& name) { return parameter_named(w, name); };
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
    if (!c.tie_embeddings) out.emplace_back("lm_head.weight", at_name("head.weight"));
    return out;
  }
  return family_weights(c, arch, w);
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
