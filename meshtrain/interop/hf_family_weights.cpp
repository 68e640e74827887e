// The tensors of the Llama-style families (Note [Hugging Face families]):
// their names and layouts against meshtrain's parameters, both ways.
#include "meshtrain/interop/hf_families.h"
#include "meshtrain/model/qkv_layout.h"

#include "meshtrain/interop/safetensors.h"

namespace meshtrain::interop {

namespace {

// meshtrain's block norms and the family's names for them (Note [Norm placement]).
std::vector<std::pair<std::string, std::string>> norm_names(const model::GptConfig& c) {
  if (c.norm_placement == model::NormPlacement::kPost) return {{"norm1", "post_attention_layernorm"}, {"norm2", "post_feedforward_layernorm"}};
  if (c.norm_placement == model::NormPlacement::kSandwich) {
    return {{"norm1", "input_layernorm"},
            {"post1", "post_attention_layernorm"},
            {"norm2", "pre_feedforward_layernorm"},
            {"post2", "post_feedforward_layernorm"}};
  }
  return {{"norm1", "input_layernorm"}, {"norm2", "post_attention_layernorm"}};
}

// Where a MoE block's router and experts are: Mixtral's block_sparse_moe
// with w1 (gate), w3 (up), w2 (down); Qwen-MoE's mlp with gate/up/down_proj.
struct ExpertNames {
  std::string router, gate, up, down;  // expert e's: prefix + "experts." + e + "." + name + ".weight"
  std::string prefix;
};
ExpertNames expert_names(const std::string& type, const std::string& layer) {
  if (type == "mixtral") return {"gate.weight", "w1", "w3", "w2", layer + "block_sparse_moe."};
  return {"gate.weight", "gate_proj", "up_proj", "down_proj", layer + "mlp."};
}

void read_experts(const TensorSource& t, const model::GptConfig& c, const std::string& type, const std::string& h,
                  const std::string& b, std::map<std::string, at::Tensor>& w) {
  const int64_t d = c.width, e = c.moe_experts, f = c.expert_hidden();
  ExpertNames n = expert_names(type, h);
  // transformers keeps experts fused in memory ([E, 2f, d] gate then up,
  // [E, d, f]); a checkpoint saved that way is read as well.
  if (!t.has(n.prefix + n.router) && t.has(h + "mlp.experts.gate_up_proj")) n.prefix = h + "mlp.";
  w[b + "moe.router"] = t.read(n.prefix + n.router, {e, d});
  if (t.has(n.prefix + "experts.gate_up_proj")) {
    const at::Tensor gate_up = t.read(n.prefix + "experts.gate_up_proj", {e, 2 * f, d});
    w[b + "moe.gate_weight"] = gate_up.narrow(1, 0, f).contiguous();
    w[b + "moe.up_weight"] = gate_up.narrow(1, f, f).contiguous();
    w[b + "moe.down_weight"] = t.read(n.prefix + "experts.down_proj", {e, d, f});
    return;
  }
  std::vector<at::Tensor> gate, up, down;
  for (int64_t x = 0; x < e; ++x) {
    const std::string expert = n.prefix + "experts." + std::to_string(x) + ".";
    gate.push_back(t.read(expert + n.gate + ".weight", {f, d}));
    up.push_back(t.read(expert + n.up + ".weight", {f, d}));
    down.push_back(t.read(expert + n.down + ".weight", {d, f}));
  }
  w[b + "moe.gate_weight"] = at::stack(gate);
  w[b + "moe.up_weight"] = at::stack(up);
  w[b + "moe.down_weight"] = at::stack(down);
}

void read_attention(const TensorSource& t, const model::GptConfig& c, const std::string& type, const std::string& h,
                    const std::string& b, std::map<std::string, at::Tensor>& w) {
  const int64_t d = c.width, qw = c.q_width(), kv = c.kv_width();
  const std::string a = h + "self_attn.";
  if (type == "phi3") {  // q, k and v stored as one matrix, in that order
    const at::Tensor qkv = t.read(a + "qkv_proj.weight", {qw + 2 * kv, d});
    w[b + "attn.qkv.weight"] = fuse_qkv(qkv.narrow(0, 0, qw), qkv.narrow(0, qw, kv), qkv.narrow(0, qw + kv, kv), c);
  } else {
    w[b + "attn.qkv.weight"] = fuse_qkv(t.read(a + "q_proj.weight", {qw, d}), t.read(a + "k_proj.weight", {kv, d}),
                                        t.read(a + "v_proj.weight", {kv, d}), c);
  }
  if (c.qkv_has_bias()) {  // fused in the weights' row order
    w[b + "attn.qkv.bias"] = fuse_qkv(t.read(a + "q_proj.bias", {qw}).view({-1, 1}),
                                      t.read(a + "k_proj.bias", {kv}).view({-1, 1}),
                                      t.read(a + "v_proj.bias", {kv}).view({-1, 1}), c)
                                 .view({-1});
  }
  w[b + "attn.proj.weight"] = t.read(a + "o_proj.weight", {d, qw});
  if (c.proj_has_bias()) w[b + "attn.proj.bias"] = t.read(a + "o_proj.bias", {d});
  if (c.qk_norm != model::QkNorm::kNone) {
    const bool per_head = c.qk_norm == model::QkNorm::kHead;
    w[b + "attn.q_norm.weight"] = t.read(a + "q_norm.weight", {per_head ? c.head_dim() : qw});
    w[b + "attn.k_norm.weight"] = t.read(a + "k_norm.weight", {per_head ? c.head_dim() : kv});
  }
}

void read_mlp(const TensorSource& t, const model::GptConfig& c, const std::string& type, const std::string& h,
              const std::string& b, std::map<std::string, at::Tensor>& w) {
  const int64_t d = c.width, f = c.mlp_hidden();
  if (type == "phi3") {  // gate and up stored as one matrix, gate first
    const at::Tensor gate_up = t.read(h + "mlp.gate_up_proj.weight", {2 * f, d});
    w[b + "mlp.gate.weight"] = gate_up.narrow(0, 0, f).contiguous();
    w[b + "mlp.up.weight"] = gate_up.narrow(0, f, f).contiguous();
  } else {
    w[b + "mlp.gate.weight"] = t.read(h + "mlp.gate_proj.weight", {f, d});
    w[b + "mlp.up.weight"] = t.read(h + "mlp.up_proj.weight", {f, d});
  }
  w[b + "mlp.down.weight"] = t.read(h + "mlp.down_proj.weight", {d, f});
  if (c.mlp_has_bias()) {
    w[b + "mlp.gate.bias"] = t.read(h + "mlp.gate_proj.bias", {f});
    w[b + "mlp.up.bias"] = t.read(h + "mlp.up_proj.bias", {f});
    w[b + "mlp.down.bias"] = t.read(h + "mlp.down_proj.bias", {d});
  }
}

}  // namespace

at::Tensor parameter_named(const std::map<std::string, at::Tensor>& weights, const std::string& name) {
  auto it = weights.find(name);
  if (it == weights.end()) throw FormatError("the model has no parameter \"" + name + "\"");
  return it->second;
}

at::Tensor fuse_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const model::GptConfig& c) {
  const std::vector<int64_t> sizes = {q.size(0) + k.size(0) + v.size(0), q.size(1)};
  return model::fuse_qkv(q, k, v, 0, sizes, q.options(), c);
}

std::vector<at::Tensor> unfuse_qkv(const at::Tensor& qkv, const model::GptConfig& c) {
  const int64_t in = qkv.size(1);
  const auto [q, k, v] = model::split_qkv_heads(qkv, 0, c);  // [heads, hd, in]
  return {q.reshape({-1, in}).contiguous(), k.reshape({-1, in}).contiguous(), v.reshape({-1, in}).contiguous()};
}

std::map<std::string, at::Tensor> read_family_weights(const TensorSource& t, const model::GptConfig& c,
                                                      const std::string& type) {
  const int64_t d = c.width;
  std::map<std::string, at::Tensor> w;
  w["wte.weight"] = t.read("model.embed_tokens.weight", {c.vocab_size, d});
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string h = "model.layers." + std::to_string(i) + ".", b = "blocks." + std::to_string(i) + ".";
    for (const auto& [ours, theirs] : norm_names(c)) w[b + ours + ".weight"] = t.read(h + theirs + ".weight", {d});
    read_attention(t, c, type, h, b, w);
    if (c.is_moe_block(i)) {
      read_experts(t, c, type, h, b, w);
    } else {
      read_mlp(t, c, type, h, b, w);
    }
  }
  w["norm_f.weight"] = t.read("model.norm.weight", {d});
  if (!c.tie_embeddings) w["head.weight"] = t.read("lm_head.weight", {c.vocab_size, d});
  return w;
}

std::vector<std::pair<std::string, at::Tensor>> family_weights(const model::GptConfig& c, const std::string& type,
                                                               const std::map<std::string, at::Tensor>& w) {
  auto at_name = [&](const std::string& name) { return parameter_named(w, name); };
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.emplace_back("model.embed_tokens.weight", at_name("wte.weight"));
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string h = "model.layers." + std::to_string(i) + ".", b = "blocks." + std::to_string(i) + ".";
    const std::string a = h + "self_attn.";
    for (const auto& [ours, theirs] : norm_names(c)) out.emplace_back(h + theirs + ".weight", at_name(b + ours + ".weight"));
    const std::vector<at::Tensor> qkv = unfuse_qkv(at_name(b + "attn.qkv.weight"), c);
    if (type == "phi3") {
      out.emplace_back(a + "qkv_proj.weight", at::cat(qkv));
    } else {
      out.emplace_back(a + "q_proj.weight", qkv[0]);
      out.emplace_back(a + "k_proj.weight", qkv[1]);
      out.emplace_back(a + "v_proj.weight", qkv[2]);
    }
    if (c.qkv_has_bias()) {
      const std::vector<at::Tensor> biases = unfuse_qkv(at_name(b + "attn.qkv.bias").view({-1, 1}), c);
      out.emplace_back(a + "q_proj.bias", biases[0].view({-1}));
      out.emplace_back(a + "k_proj.bias", biases[1].view({-1}));
      out.emplace_back(a + "v_proj.bias", biases[2].view({-1}));
    }
    out.emplace_back(a + "o_proj.weight", at_name(b + "attn.proj.weight"));
    if (c.proj_has_bias()) out.emplace_back(a + "o_proj.bias", at_name(b + "attn.proj.bias"));
    if (c.qk_norm != model::QkNorm::kNone) {
      out.emplace_back(a + "q_norm.weight", at_name(b + "attn.q_norm.weight"));
      out.emplace_back(a + "k_norm.weight", at_name(b + "attn.k_norm.weight"));
    }
    if (c.is_moe_block(i)) {
      const ExpertNames n = expert_names(type, h);
      out.emplace_back(n.prefix + n.router, at_name(b + "moe.router"));
      const at::Tensor gate = at_name(b + "moe.gate_weight"), up = at_name(b + "moe.up_weight");
      const at::Tensor down = at_name(b + "moe.down_weight");
      for (int64_t x = 0; x < c.moe_experts; ++x) {
        const std::string expert = n.prefix + "experts." + std::to_string(x) + ".";
        out.emplace_back(expert + n.gate + ".weight", gate[x]);
        out.emplace_back(expert + n.up + ".weight", up[x]);
        out.emplace_back(expert + n.down + ".weight", down[x]);
      }
      continue;
    }
    if (type == "phi3") {
      out.emplace_back(h + "mlp.gate_up_proj.weight", at::cat({at_name(b + "mlp.gate.weight"), at_name(b + "mlp.up.weight")}));
    } else {
      out.emplace_back(h + "mlp.gate_proj.weight", at_name(b + "mlp.gate.weight"));
      out.emplace_back(h + "mlp.up_proj.weight", at_name(b + "mlp.up.weight"));
    }
    out.emplace_back(h + "mlp.down_proj.weight", at_name(b + "mlp.down.weight"));
    if (c.mlp_has_bias()) {
      out.emplace_back(h + "mlp.gate_proj.bias", at_name(b + "mlp.gate.bias"));
      out.emplace_back(h + "mlp.up_proj.bias", at_name(b + "mlp.up.bias"));
      out.emplace_back(h + "mlp.down_proj.bias", at_name(b + "mlp.down.bias"));
    }
  }
  out.emplace_back("model.norm.weight", at_name("norm_f.weight"));
  if (!c.tie_embeddings) out.emplace_back("lm_head.weight", at_name("head.weight"));
  return out;
}

}  // namespace meshtrain::interop
