// GptConfig: the shape of a GPT-family decoder, its named presets, and the
// parameter count and training FLOPs that follow from the shape alone.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::model {

struct GptConfig {
  int64_t vocab_size = 256;
  int64_t context = 128;  // maximum sequence length
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t width = 256;    // model dimension
  double dropout = 0.0;
  // GPT-2 style by default; Llama style is rmsnorm + rope + swiglu + untied head.
  std::string norm = "layernorm";      // "layernorm" | "rmsnorm"
  std::string position = "learned";    // "learned" | "rope"
  std::string mlp = "gelu";            // "gelu" (4·width hidden) | "swiglu" (hidden below)
  bool tie_embeddings = true;          // the LM head shares the token embedding
  bool bias = true;                    // biases in linear layers and norms (GPT-2 has them)

  // Named shapes: tiny, small, llama-tiny, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b.
  static GptConfig preset(const std::string& name);
  static std::vector<std::string> preset_names();

  // Throws std::invalid_argument naming the field, the value and what is allowed.
  void validate() const;

  int64_t head_dim() const { return width / heads; }
  int64_t mlp_hidden() const;  // gelu: 4·width; swiglu: 8/3·width rounded up to a multiple of 64
  // Exact number of trainable parameters (tied embeddings counted once).
  int64_t parameter_count() const;
  // Training FLOPs per token at full context: 6·N_matmul + 12·layers·context·width for
  // attention scores and values (forward 2, backward 4 per multiply-add), where
  // N_matmul counts the weights used in matrix multiplies (the embedding lookups are
  // not multiplies; the LM head is).
  double flops_per_token() const;
};

}  // namespace meshtrain::model
