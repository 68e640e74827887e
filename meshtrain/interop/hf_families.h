// The open families' config.json files (Llama 2/3.x, Mistral, Qwen2, Qwen3,
// Mixtral, Qwen3-MoE, Gemma 2, Phi-3, OLMo 2) to meshtrain's GptConfig and
// back (Note [Hugging Face families]). The tensors are hf_checkpoint.cpp's.
#pragma once

#include "meshtrain/model/gpt_config.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace meshtrain::interop {

// Throws FormatError: `what`, read at `where`, has no equivalent in meshtrain's model.
[[noreturn]] void refuse_import(const std::string& where, const std::string& what);

// The model_type values config_from_family reads.
const std::vector<std::string>& family_types();

// The model of a config.json whose model_type is one of family_types();
// throws FormatError naming `where` and the first key that changes the
// computation in a way meshtrain does not implement.
model::GptConfig config_from_family(const nlohmann::json& config, const std::string& model_type,
                                    const std::string& where);

// The model_type a meshtrain model is written as, and its config.json; throws
// FormatError naming the setting no family expresses.
std::string family_of(const model::GptConfig& config);
nlohmann::json family_config(const model::GptConfig& config, const std::string& model_type, const std::string& torch_dtype);

// A checkpoint's tensors: whether it holds one, and one read (float32) with
// the shape the config implies, or a FormatError.
struct TensorSource {
  std::function<bool(const std::string& name)> has;
  std::function<at::Tensor(const std::string& name, const std::vector<int64_t>& shape)> read;
};
// A family checkpoint's tensors by meshtrain parameter name.
std::map<std::string, at::Tensor> read_family_weights(const TensorSource& source, const model::GptConfig& config,
                                                      const std::string& model_type);
// meshtrain's parameters under the family's names, in the order they are written.
std::vector<std::pair<std::string, at::Tensor>> family_weights(const model::GptConfig& config,
                                                               const std::string& model_type,
                                                               const std::map<std::string, at::Tensor>& weights);
// weights[name], or a FormatError naming the parameter the model lacks.
at::Tensor parameter_named(const std::map<std::string, at::Tensor>& weights, const std::string& name);
// Grouped-query q, k, v -> the fused qkv rows (Note [Grouped-query layout]), and back.
at::Tensor fuse_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const model::GptConfig& c);
std::vector<at::Tensor> unfuse_qkv(const at::Tensor& qkv, const model::GptConfig& c);

}  // namespace meshtrain::interop
