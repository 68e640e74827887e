// LoRA: trainable low-rank adapters beside a frozen model (Hu et al., 2021),
// and the adapters in and out of PEFT's format. See Note [LoRA].
#pragma once

#include "meshtrain/model/adapter.h"
#include "meshtrain/model/gpt.h"

#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain::model {

struct LoraConfig {
  int64_t rank = 0;     // r; 0: no adapters
  double alpha = 16;    // the update is (alpha / r)·B·A
  double dropout = 0;   // on each adapter's input, in training
  // Which linears get an adapter: q, k, v (the fused qkv's three parts), o
  // (attention's output), gate, up, down (a GELU MLP's fc is up, its proj
  // down, and it has no gate: passed over).
  std::vector<std::string> targets{"q", "k", "v", "o", "gate", "up", "down"};
  // What the frozen blocks' matrices are kept in: float32, or bfloat16 (half
  // their memory; for bf16 autocast, whose matmuls round them so anyway).
  at::ScalarType base_dtype = at::kFloat;

  bool enabled() const { return rank > 0; }
  double scale() const { return alpha / static_cast<double>(rank); }
  // Throws std::invalid_argument naming what is wrong: a rank below 0, an
  // unknown target, or one the model has no linear for (gate in a GELU MLP).
  void check(const GptConfig& model) const;
  // The adapters' parameters in `model` (what trains).
  int64_t parameter_count(const GptConfig& model) const;
  std::string to_json() const;
  static LoraConfig from_json(const std::string& text);
};

// The targets LoRA knows, in the order adapters are made.
const std::vector<std::string>& lora_targets();

// One adapter: x -> scale·B·A·x, A [rank, in], B [out, rank] (Note [Adapters]).
class LoraAdapterImpl : public LinearAdapter {
 public:
  LoraAdapterImpl(int64_t in, int64_t out, int64_t rank);
  const char* input_factor() const override { return "A"; }
  const char* output_factor() const override { return "B"; }
  at::Tensor A, B;
};
TORCH_MODULE(LoraAdapter);

// Whether parameter `name` is an adapter's ("blocks.0.attn.qkv.lora_q.A").
bool is_lora_parameter(const std::string& name);

// Note [LoRA]
// apply_lora registers an adapter (Note [Adapters]) under each targeted
// linear, named lora_<target> ("blocks.N.attn.qkv.lora_q",
// "blocks.N.mlp.down.lora_down": the names PEFT's files map to), and freezes
// every other parameter. A is drawn as PEFT draws it (uniform, ±1/sqrt(in),
// from the seed), B is zero, so training starts from the base model exactly.
// A forward hook on the linear's call site (Note [Forward hooks]) adds
// scale·B·A·dropout(x) to its output; installed before any parallelism, it is
// the innermost hook, so tensor parallel sees the adapted linear as one
// linear and splits A or B with it (Note [Adapters]). q, k and v share
// the fused qkv: their three updates are laid out as its outputs are (Note
// [Grouped-query layout]), so their B's split with the heads. Mixture-of-
// experts blocks take adapters on attention only. With base_dtype bfloat16
// the blocks' frozen matrices are stored in bf16 (under bf16 autocast, which
// casts them to bf16 for every matmul anyway, the numbers are the same).
std::shared_ptr<ForwardHooks> apply_lora(Gpt& model, const LoraConfig& config, uint64_t seed);

// Every parameter but the adapters' set to requires_grad false.
void freeze_base(torch::nn::Module& model);
// The frozen matrices of the blocks (2-D weights: the linears, a router)
// stored in `dtype`; norms, biases, embeddings and the head stay as they are.
void cast_frozen_matrices(torch::nn::Module& model, at::ScalarType dtype);

// The base weights with scale·B·A added for each adapter in `adapters`
// (named as apply_lora names their parameters; every targeted linear must
// have one). For serving and the merged export: no hook, no extra compute.
void merge_lora(Gpt& model, const LoraConfig& config, const std::map<std::string, at::Tensor>& adapters);

// PEFT's adapter format (adapter_config.json + adapter_model.safetensors),
// with the names of transformers' Llama-family models
// (base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight). Models
// whose transformers class fuses q, k and v (GPT-2) have no such names: a
// std::invalid_argument says so.
void write_peft_adapter(const std::string& dir, const GptConfig& model, const LoraConfig& config,
                        const std::map<std::string, at::Tensor>& adapters, const std::string& base_model);
struct PeftAdapter {
  LoraConfig config;
  std::map<std::string, at::Tensor> adapters;  // by apply_lora's names
};
// Throws std::invalid_argument naming the file and what it cannot take
// (another PEFT type, a target or layer the model lacks, a shape that differs).
PeftAdapter read_peft_adapter(const std::string& dir, const GptConfig& model);

}  // namespace meshtrain::model
