#include "meshtrain/annotate/gpt_annotations.h"

#include <stdexcept>

namespace meshtrain::annotate {

std::vector<ShardingRule> gpt_megatron_annotations(const model::GptConfig& config, const mesh::DeviceMesh& mesh) {
  const int tp = mesh.layout().axis_index("tp");
  const int64_t t = mesh.layout().axes()[tp].size;
  if (config.moe()) throw std::invalid_argument("annotations: mixture-of-experts blocks have no annotation layout yet");
  auto need = [&](int64_t size, const std::string& what) {
    if (size % t != 0) {
      throw std::invalid_argument("annotations: tp = " + std::to_string(t) + " does not divide " + what + " (" +
                                  std::to_string(size) + ")");
    }
  };
  need(config.heads, "model.heads");  // (vocabulary and MLP may split unevenly; a head may not)
  need(config.key_value_heads(), "model.kv_heads");
  const int64_t qkv_blocks = config.grouped_query() ? 1 : 3;  // Note [Grouped-query layout]
  const Sharding rows = mesh_split_sharding(mesh, {tp, -1}), columns = mesh_split_sharding(mesh, {-1, tp});
  const Sharding heads = mesh_split_sharding(mesh, {tp, -1}, qkv_blocks);
  const Sharding head_bias = mesh_split_sharding(mesh, {tp}, qkv_blocks);
  const Sharding vector = mesh_split_sharding(mesh, {tp});
  return {
      {"wte.weight", rows},
      {"head.weight", rows},
      {"blocks.*.attn.qkv.weight", heads},
      {"blocks.*.attn.qkv.bias", head_bias},
      {"blocks.*.attn.proj.weight", columns},
      {"blocks.*.mlp.fc.weight", rows},
      {"blocks.*.mlp.fc.bias", vector},
      {"blocks.*.mlp.proj.weight", columns},
      {"blocks.*.mlp.gate.weight", rows},
      {"blocks.*.mlp.gate.bias", vector},
      {"blocks.*.mlp.up.weight", rows},
      {"blocks.*.mlp.up.bias", vector},
      {"blocks.*.mlp.down.weight", columns},
  };
}

}  // namespace meshtrain::annotate
