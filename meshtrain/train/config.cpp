#include "meshtrain/train/config.h"

#include "meshtrain/parallel/annotated_tensor_parallel.h"

#include "meshtrain/comm/runtime.h"
#include "meshtrain/parallel/activation_checkpoint.h"
#include "meshtrain/parallel/parallelize.h"
#include "meshtrain/parallel/pipeline/stages.h"

#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <toml++/toml.h>

#include <algorithm>
#include <functional>
#include <map>
#include <sstream>
#include <type_traits>
#include <utility>

namespace meshtrain::train {

namespace {

enum class Kind { kInt, kFloat, kBool, kString, kStringList };

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kInt: return "an integer";
    case Kind::kFloat: return "a number";
    case Kind::kBool: return "true or false";
    case Kind::kString: return "a string";
    case Kind::kStringList: return "a list of strings";
  }
  return "?";
}

struct Value {
  int64_t i = 0;
  double f = 0;
  bool b = false;
  std::string s;
  std::vector<std::string> list;
};

struct Field {
  std::string section, key;
  Kind kind;
  std::string help;
  std::function<void(TrainConfig&, const Value&)> set;
  std::function<std::string(const TrainConfig&)> show;
};

// How each C++ type of a config field is read from TOML and shown in --help.
template <typename T>
struct FieldType;
template <>
struct FieldType<int64_t> {
  static constexpr Kind kind = Kind::kInt;
  static void assign(int64_t& target, const Value& v) { target = v.i; }
  static std::string show(int64_t v) { return std::to_string(v); }
};
template <>
struct FieldType<int> {
  static constexpr Kind kind = Kind::kInt;
  static void assign(int& target, const Value& v) { target = static_cast<int>(v.i); }
  static std::string show(int v) { return std::to_string(v); }
};
template <>
struct FieldType<uint64_t> {
  static constexpr Kind kind = Kind::kInt;
  static void assign(uint64_t& target, const Value& v) { target = static_cast<uint64_t>(v.i); }
  static std::string show(uint64_t v) { return std::to_string(v); }
};
template <>
struct FieldType<double> {
  static constexpr Kind kind = Kind::kFloat;
  static void assign(double& target, const Value& v) { target = v.f; }
  static std::string show(double v) {
    std::ostringstream out;
    out << v;
    return out.str();
  }
};
template <>
struct FieldType<bool> {
  static constexpr Kind kind = Kind::kBool;
  static void assign(bool& target, const Value& v) { target = v.b; }
  static std::string show(bool v) { return v ? "true" : "false"; }
};
template <>
struct FieldType<std::string> {
  static constexpr Kind kind = Kind::kString;
  static void assign(std::string& target, const Value& v) { target = v.s; }
  static std::string show(const std::string& v) { return "\"" + v + "\""; }
};
template <>
struct FieldType<std::vector<std::string>> {
  static constexpr Kind kind = Kind::kStringList;
  static void assign(std::vector<std::string>& target, const Value& v) { target = v.list; }
  static std::string show(const std::vector<std::string>& v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", \"" : "\"") + v[i] + "\"";
    return s + "]";
  }
};

// A field whose value lives at `member(config)`.
template <typename Member>
Field field(std::string section, std::string key, std::string help, Member member) {
  using T = std::decay_t<decltype(member(std::declval<TrainConfig&>()))>;
  return {std::move(section), std::move(key), FieldType<T>::kind, std::move(help),
          [member](TrainConfig& c, const Value& v) { FieldType<T>::assign(member(c), v); },
          [member](const TrainConfig& c) { return FieldType<T>::show(member(const_cast<TrainConfig&>(c))); }};
}

#define MESHTRAIN_CONFIG_MEMBER(expression) [](TrainConfig& c) -> auto& { return c.expression; }

// The schema: every key a config may hold. Model keys apply on top of the preset.
const std::vector<Field>& fields() {
  static const std::vector<Field> table = [] {
    std::vector<Field> f;
    f.push_back({"model", "preset", Kind::kString,
                 "named shape: tiny, small, llama-tiny, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b",
                 [](TrainConfig& c, const Value& v) {
                   c.preset = v.s;
                   c.model = model::GptConfig::preset(v.s);
                 },
                 [](const TrainConfig& c) { return "\"" + c.preset + "\""; }});
    f.push_back(field("model", "layers", "transformer blocks", MESHTRAIN_CONFIG_MEMBER(model.layers)));
    f.push_back(field("model", "heads", "attention heads (must divide width)", MESHTRAIN_CONFIG_MEMBER(model.heads)));
    f.push_back(field("model", "width", "model dimension", MESHTRAIN_CONFIG_MEMBER(model.width)));
    f.push_back(field("model", "kv_heads", "key/value heads for grouped-query attention (0: as many as heads)",
                      MESHTRAIN_CONFIG_MEMBER(model.kv_heads)));
    f.push_back(field("model", "ffn_hidden", "the MLP's hidden size (0: 4 x width for gelu, 8/3 x width for swiglu)",
                      MESHTRAIN_CONFIG_MEMBER(model.ffn_hidden)));
    f.push_back(field("model", "rope_theta", "rotary position base", MESHTRAIN_CONFIG_MEMBER(model.rope_theta)));
    f.push_back(field("model", "norm_eps", "epsilon of the norms", MESHTRAIN_CONFIG_MEMBER(model.norm_eps)));
    f.push_back(field("model", "fused", "fused CPU kernels for norms, GELU/SwiGLU, RoPE, cross-entropy (false: "
                      "reference ATen operators)", MESHTRAIN_CONFIG_MEMBER(model.fused)));
    f.push_back(field("model", "context", "sequence length in tokens", MESHTRAIN_CONFIG_MEMBER(model.context)));
    f.push_back(field("model", "vocab_size", "vocabulary (the byte tokenizer needs 256)",
                      MESHTRAIN_CONFIG_MEMBER(model.vocab_size)));
    f.push_back(field("model", "dropout", "dropout probability", MESHTRAIN_CONFIG_MEMBER(model.dropout)));
    f.push_back(field("model", "norm", "\"layernorm\" or \"rmsnorm\"", MESHTRAIN_CONFIG_MEMBER(model.norm)));
    f.push_back(field("model", "position", "\"learned\" or \"rope\"", MESHTRAIN_CONFIG_MEMBER(model.position)));
    f.push_back(field("model", "mlp", "\"gelu\" or \"swiglu\"", MESHTRAIN_CONFIG_MEMBER(model.mlp)));
    f.push_back(field("model", "tie_embeddings", "LM head shares the token embedding",
                      MESHTRAIN_CONFIG_MEMBER(model.tie_embeddings)));
    f.push_back(field("model", "bias", "biases in linear layers and norms", MESHTRAIN_CONFIG_MEMBER(model.bias)));
    f.push_back(field("model", "moe_experts", "experts per mixture-of-experts block (0: dense)",
                      MESHTRAIN_CONFIG_MEMBER(model.moe_experts)));
    f.push_back(field("model", "moe_every", "every k-th block is a mixture of experts (blocks k-1, 2k-1, ...)",
                      MESHTRAIN_CONFIG_MEMBER(model.moe_every)));
    f.push_back(field("model", "moe_top_k", "experts per token: 1 (Switch) or 2 (GShard)",
                      MESHTRAIN_CONFIG_MEMBER(model.moe_top_k)));
    f.push_back(field("model", "moe_capacity_factor", "capacity = ceil(tokens x top_k x factor / experts); 0: dropless",
                      MESHTRAIN_CONFIG_MEMBER(model.moe_capacity_factor)));
    f.push_back(field("model", "moe_second_expert", "top_k 2: \"random\" (kept with probability min(1, 2 x gate), "
                      "GShard) or \"always\"", MESHTRAIN_CONFIG_MEMBER(model.moe_second_expert)));
    f.push_back(field("model", "moe_aux_loss", "load-balancing loss weight (Switch's alpha)",
                      MESHTRAIN_CONFIG_MEMBER(model.moe_aux_loss)));
    f.push_back(field("model", "moe_z_loss", "router z-loss weight", MESHTRAIN_CONFIG_MEMBER(model.moe_z_loss)));
    f.push_back(field("model", "moe_hidden", "an expert's hidden size (0: the dense MLP's)",
                      MESHTRAIN_CONFIG_MEMBER(model.moe_hidden)));
    f.push_back(field("data", "tokenizer", "\"bytes\", a SentencePiece .model, a tokenizer.json, or a folder with "
                      "vocab.json + merges.txt (GPT-2 BPE); model.vocab_size must hold its vocabulary",
                      MESHTRAIN_CONFIG_MEMBER(tokenizer)));
    f.push_back(field("data", "text", "text files or directories prepared when no token files are given",
                      MESHTRAIN_CONFIG_MEMBER(text)));
    f.push_back(field("data", "train_file", "training token file from `meshtrain prepare` (overrides text)",
                      MESHTRAIN_CONFIG_MEMBER(train_file)));
    f.push_back(field("data", "val_file", "validation token file", MESHTRAIN_CONFIG_MEMBER(val_file)));
    f.push_back(field("data", "val_fraction", "share of prepared text held out for validation",
                      MESHTRAIN_CONFIG_MEMBER(val_fraction)));
    f.push_back(field("training", "steps", "optimizer steps", MESHTRAIN_CONFIG_MEMBER(steps)));
    f.push_back(field("training", "batch", "global batch in sequences per step (= micro_batch x dp x accumulation)",
                      MESHTRAIN_CONFIG_MEMBER(batch)));
    f.push_back(field("training", "micro_batch", "sequences per forward/backward on one rank",
                      MESHTRAIN_CONFIG_MEMBER(micro_batch)));
    f.push_back(field("training", "lr", "peak learning rate (AdamW)", MESHTRAIN_CONFIG_MEMBER(lr)));
    f.push_back(field("training", "min_lr", "learning rate at the end of the cosine decay", MESHTRAIN_CONFIG_MEMBER(min_lr)));
    f.push_back(field("training", "warmup", "steps of linear warmup", MESHTRAIN_CONFIG_MEMBER(warmup)));
    f.push_back(field("training", "weight_decay", "AdamW weight decay (matrices and embeddings only)",
                      MESHTRAIN_CONFIG_MEMBER(weight_decay)));
    f.push_back(field("training", "beta1", "AdamW beta1", MESHTRAIN_CONFIG_MEMBER(beta1)));
    f.push_back(field("training", "beta2", "AdamW beta2", MESHTRAIN_CONFIG_MEMBER(beta2)));
    f.push_back(field("training", "grad_clip", "clip gradients to this global norm (0: off)",
                      MESHTRAIN_CONFIG_MEMBER(grad_clip)));
    f.push_back(field("training", "seed", "seed of the model init and the data order", MESHTRAIN_CONFIG_MEMBER(seed)));
    f.push_back(field("training", "dtype", "\"float32\" or \"bfloat16\" (autocast of matmuls)",
                      MESHTRAIN_CONFIG_MEMBER(dtype)));
    f.push_back(field("training", "eval_every", "steps between validation losses (0: at the end only)",
                      MESHTRAIN_CONFIG_MEMBER(eval_every)));
    f.push_back(field("training", "eval_batches", "validation micro-batches per rank", MESHTRAIN_CONFIG_MEMBER(eval_batches)));
    f.push_back(field("training", "log_every", "steps between progress lines", MESHTRAIN_CONFIG_MEMBER(log_every)));
    f.push_back(field("training", "sample_tokens", "tokens generated from the model at the end (0: none)",
                      MESHTRAIN_CONFIG_MEMBER(sample_tokens)));
    f.push_back(field("parallel", "dp", "replicas: data-parallel ranks holding the same shards (0: derived)",
                      MESHTRAIN_CONFIG_MEMBER(parallel.dp)));
    f.push_back(field("parallel", "fsdp", "shards per replica when zero_stage >= 1; dp x fsdp = ranks (0: derived)",
                      MESHTRAIN_CONFIG_MEMBER(parallel.fsdp)));
    f.push_back(field("parallel", "tp", "tensor-parallel ranks: attention split by heads, MLP and vocabulary split "
                      "(Megatron); dp x fsdp x tp = ranks", MESHTRAIN_CONFIG_MEMBER(parallel.tp)));
    f.push_back(field("parallel", "ep", "expert-parallel ranks: each holds model.moe_experts / ep experts of every "
                      "mixture-of-experts block; they read different micro-batches (data ranks are dp x fsdp x ep)",
                      MESHTRAIN_CONFIG_MEMBER(parallel.ep)));
    f.push_back(field("parallel", "sequence_parallel", "with tp > 1: norms, dropout and residual stream split along the "
                      "sequence (activations 1/tp per rank, same communication)", MESHTRAIN_CONFIG_MEMBER(parallel.sequence_parallel)));
    f.push_back(field("parallel", "tp_impl", "how tensor parallel is applied: \"plan\" (hand-written Megatron layers) or "
                      "\"annotations\" (the weights annotated with mesh_split, every other tensor placed by the sharding rules)",
                      MESHTRAIN_CONFIG_MEMBER(tp_impl)));
    f.push_back(field("parallel", "pp", "pipeline stages: the blocks split into pp consecutive groups, micro-batches "
                      "flowing through them; pp x dp x fsdp x tp = ranks", MESHTRAIN_CONFIG_MEMBER(parallel.pp)));
    f.push_back(field("parallel", "pp_schedule", "\"gpipe\" (all forwards, then all backwards), \"1f1b\" (at most pp "
                      "micro-batches in flight) or \"interleaved\" (1f1b over virtual_stages per rank: bubble / v)",
                      MESHTRAIN_CONFIG_MEMBER(parallel.schedule)));
    f.push_back(field("parallel", "microbatches", "micro-batches per step per data rank (sets training.micro_batch; "
                      "0: batch / (micro_batch x dp x fsdp)); the bubble is (pp-1)/(microbatches+pp-1)",
                      MESHTRAIN_CONFIG_MEMBER(microbatches)));
    f.push_back(field("parallel", "virtual_stages", "stages per pipeline rank, non-adjacent (pp_schedule = \"interleaved\")",
                      MESHTRAIN_CONFIG_MEMBER(parallel.virtual_stages)));
    f.push_back(field("parallel", "pp_split", "blocks per stage: \"params\" (balance parameter counts), \"time\" "
                      "(balance times measured at start) or a list like \"3,3,2\"", MESHTRAIN_CONFIG_MEMBER(pp_split)));
    f.push_back(field("parallel", "activation_checkpoint", "\"none\", \"full\" (keep block inputs only, recompute in "
                      "backward) or \"selective\" (recompute attention proper)", MESHTRAIN_CONFIG_MEMBER(activation_checkpoint)));
    f.push_back(field("parallel", "activation_checkpoint_every", "checkpoint every k-th block (1: all)",
                      MESHTRAIN_CONFIG_MEMBER(activation_checkpoint_every)));
    f.push_back(field("parallel", "zero_stage",
                      "0: data parallel; 1: shard optimizer states; 2: + gradients; 3: + parameters (FSDP)",
                      MESHTRAIN_CONFIG_MEMBER(parallel.zero_stage)));
    f.push_back(field("parallel", "bucket_mb", "gradient all-reduce bucket size in MiB (zero_stage 0)",
                      MESHTRAIN_CONFIG_MEMBER(bucket_mb)));
    f.push_back(field("parallel", "unit_policy", "sharded units: \"block\" (one per transformer block + root) or \"model\"",
                      MESHTRAIN_CONFIG_MEMBER(unit_policy)));
    f.push_back(field("parallel", "prefetch", "zero_stage 3: gather the next unit while this one computes",
                      MESHTRAIN_CONFIG_MEMBER(prefetch)));
    f.push_back(field("parallel", "reshard_after_forward", "zero_stage 3: free a block's parameters after its forward",
                      MESHTRAIN_CONFIG_MEMBER(reshard_after_forward)));
    f.push_back(field("parallel", "param_dtype", "zero_stage >= 1: \"float32\" or \"bfloat16\" parameters for compute "
                      "(fp32 master shards)", MESHTRAIN_CONFIG_MEMBER(param_dtype)));
    f.push_back(field("parallel", "reduce_dtype", "zero_stage >= 1: \"float32\" or \"bfloat16\" gradient reductions",
                      MESHTRAIN_CONFIG_MEMBER(reduce_dtype)));
    f.push_back(field("parallel", "zero1_reduce", "zero_stage 1: \"all_reduce\" full gradients then read the shard, or "
                      "\"reduce_scatter\" into a shard buffer (+4 bytes per owned element)", MESHTRAIN_CONFIG_MEMBER(zero1_reduce)));
    f.push_back(field("offload", "optimizer", "\"none\", \"cpu\" or \"nvme\": keep the fp32 master weights and AdamW "
                      "moments in host memory or a file on a local disk and step them on the CPU (ZeRO-Offload / "
                      "ZeRO-Infinity; parallel.zero_stage >= 1)", MESHTRAIN_CONFIG_MEMBER(offload_optimizer)));
    f.push_back(field("offload", "params", "\"none\", \"cpu\" or \"nvme\": zero_stage 3's parameter shards there too, "
                      "read before each gather (needs offload.optimizer)", MESHTRAIN_CONFIG_MEMBER(offload_params)));
    f.push_back(field("offload", "nvme_dir", "folder on a local disk for the nvme tier (default: <run.out>/nvme)",
                      MESHTRAIN_CONFIG_MEMBER(offload_nvme_dir)));
    f.push_back(field("memory", "limit_mb", "per-rank limit on CPU tensor memory; beyond it a clear out-of-memory "
                      "error (0: none)", MESHTRAIN_CONFIG_MEMBER(memory_limit_mb)));
    f.push_back(field("checkpoint", "dir", "where checkpoints go (default: <run.out>/checkpoints)",
                      MESHTRAIN_CONFIG_MEMBER(checkpoint_dir)));
    f.push_back(field("checkpoint", "every", "steps between checkpoints (0: at the end only)",
                      MESHTRAIN_CONFIG_MEMBER(checkpoint_every)));
    f.push_back(field("checkpoint", "async", "write checkpoints in the background from a host copy (the next step "
                      "runs meanwhile; memory for one copy of this rank's state)", MESHTRAIN_CONFIG_MEMBER(checkpoint_async)));
    f.push_back(field("checkpoint", "keep", "checkpoints kept (the newest; at least 1)",
                      MESHTRAIN_CONFIG_MEMBER(checkpoint_keep)));
    f.push_back(field("checkpoint", "resume", "continue from the latest checkpoint if there is one",
                      MESHTRAIN_CONFIG_MEMBER(resume)));
    f.push_back(field("run", "device", "\"cpu\", \"cuda\" (cuda:local_rank % GPUs), \"cuda:N\" or \"auto\" (cuda when a GPU "
                      "is visible); ranks sharing a GPU communicate through host memory", MESHTRAIN_CONFIG_MEMBER(device)));
    f.push_back(field("run", "out", "run directory: metrics.jsonl, prepared data, checkpoints", MESHTRAIN_CONFIG_MEMBER(out)));
    f.push_back(field("run", "sharding_report", "with parallel.tp_impl = \"annotations\": write the first step's operators "
                      "(input and output placements) and the collectives completion inserted (bytes) to this file, as JSON lines",
                      MESHTRAIN_CONFIG_MEMBER(sharding_report)));
    f.push_back(field("run", "trace_step", "pp > 1: record this step's pipeline spans to <out>/trace.json (Perfetto) and "
                      "draw <out>/timeline.svg (0: none)", MESHTRAIN_CONFIG_MEMBER(trace_step)));
    return f;
  }();
  return table;
}

#undef MESHTRAIN_CONFIG_MEMBER

const Field* find_field(const std::string& section, const std::string& key) {
  for (const Field& f : fields()) {
    if (f.section == section && f.key == key) return &f;
  }
  return nullptr;
}

[[noreturn]] void unknown_key(const std::string& section, const std::string& key, const std::string& where) {
  std::string known;
  for (const Field& f : fields()) {
    if (f.section == section) known += (known.empty() ? "" : ", ") + f.key;
  }
  if (known.empty()) {
    std::string sections;
    for (const Field& f : fields()) {
      if (sections.find("[" + f.section + "]") == std::string::npos) sections += (sections.empty() ? "" : ", ") + ("[" + f.section + "]");
    }
    throw ConfigError(where + ": unknown section [" + section + "]; sections are " + sections);
  }
  throw ConfigError(where + ": unknown key " + section + "." + key + "; keys of [" + section + "] are " + known);
}

std::string node_text(const toml::node& node) {
  std::ostringstream out;
  node.visit([&](auto&& v) { out << v; });
  return out.str();
}

Value convert(const Field& field, const toml::node& node, const std::string& where) {
  Value value;
  const std::string name = field.section + "." + field.key;
  auto wrong = [&]() -> ConfigError {
    return ConfigError(where + ": " + name + " = " + node_text(node) + " must be " + kind_name(field.kind));
  };
  switch (field.kind) {
    case Kind::kInt:
      if (!node.is_integer()) throw wrong();
      value.i = node.value<int64_t>().value();
      break;
    case Kind::kFloat:
      if (!node.is_number()) throw wrong();
      value.f = node.value<double>().value();
      break;
    case Kind::kBool:
      if (!node.is_boolean()) throw wrong();
      value.b = node.value<bool>().value();
      break;
    case Kind::kString:
      if (!node.is_string()) throw wrong();
      value.s = node.value<std::string>().value();
      break;
    case Kind::kStringList:
      if (node.is_string()) {
        value.list = {node.value<std::string>().value()};
        break;
      }
      if (!node.is_array()) throw wrong();
      for (const auto& item : *node.as_array()) {
        if (!item.is_string()) throw wrong();
        value.list.push_back(item.value<std::string>().value());
      }
      break;
  }
  return value;
}

void apply(TrainConfig& config, const Field& field, const toml::node& node, const std::string& where) {
  const Value value = convert(field, node, where);
  try {
    field.set(config, value);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(where + ": " + field.section + "." + field.key + ": " + e.what());
  }
}

[[noreturn]] void bad(const std::string& key, const std::string& value, const std::string& allowed) {
  throw ConfigError(key + " = " + value + ": " + allowed);
}

}  // namespace

TrainConfig TrainConfig::load(const std::string& path, const std::vector<std::string>& overrides) {
  TrainConfig config;
  if (!path.empty()) {
    toml::table table;
    try {
      table = toml::parse_file(path);
    } catch (const toml::parse_error& e) {
      std::ostringstream where;
      where << path << ":" << e.source().begin.line << ":" << e.source().begin.column;
      throw ConfigError("config " + where.str() + ": " + std::string(e.description()));
    }
    // The preset first, so that model keys in the same file override it.
    if (auto* model = table["model"].as_table()) {
      if (auto* preset = model->get("preset")) apply(config, *find_field("model", "preset"), *preset, "config " + path);
    }
    for (const auto& [section, node] : table) {
      const std::string section_name(section.str());
      const toml::table* keys = node.as_table();
      if (!keys) throw ConfigError("config " + path + ": '" + section_name + "' must be a [section] table");
      for (const auto& [key, value] : *keys) {
        const std::string key_name(key.str());
        if (section_name == "model" && key_name == "preset") continue;
        const Field* field = find_field(section_name, key_name);
        if (!field) unknown_key(section_name, key_name, "config " + path);
        apply(config, *field, value, "config " + path);
      }
    }
  }
  // Overrides: presets first, for the same reason.
  std::vector<std::string> ordered;
  for (const auto& o : overrides) if (o.rfind("model.preset=", 0) == 0) ordered.push_back(o);
  for (const auto& o : overrides) if (o.rfind("model.preset=", 0) != 0) ordered.push_back(o);
  for (const std::string& override_text : ordered) {
    const std::string where = "override --" + override_text;
    const size_t eq = override_text.find('=');
    const size_t dot = override_text.find('.');
    if (eq == std::string::npos || dot == std::string::npos || dot > eq) {
      throw ConfigError(where + ": write overrides as --section.key=value, e.g. --training.steps=20");
    }
    const std::string section = override_text.substr(0, dot);
    const std::string key = override_text.substr(dot + 1, eq - dot - 1);
    const std::string raw = override_text.substr(eq + 1);
    const Field* field = find_field(section, key);
    if (!field) unknown_key(section, key, where);
    toml::table parsed;
    if (field->kind == Kind::kString) {
      parsed.insert("v", raw);  // strings need no quotes on the command line
    } else {
      try {
        parsed = toml::parse("v = " + raw);
      } catch (const toml::parse_error&) {
        if (field->kind == Kind::kStringList) parsed.insert("v", raw);
        else throw ConfigError(where + ": " + section + "." + key + " = " + raw + " must be " + kind_name(field->kind));
      }
    }
    apply(config, *field, *parsed.get("v"), where);
  }
  return config;
}

void TrainConfig::validate(int world_size) {
  try {
    model.validate();
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  if (model.vocab_size != 256 && train_file.empty() && (tokenizer.empty() || tokenizer == "bytes")) {
    bad("model.vocab_size", std::to_string(model.vocab_size),
        "text is prepared with the byte tokenizer, which has 256 tokens; use 256, name a larger tokenizer "
        "(data.tokenizer), or give token files (data.train_file, data.val_file) of a larger vocabulary");
  }
  if (steps < 1) bad("training.steps", std::to_string(steps), "must be >= 1");
  if (micro_batch < 1) bad("training.micro_batch", std::to_string(micro_batch), "must be >= 1");
  if (batch < 1) bad("training.batch", std::to_string(batch), "must be >= 1");
  // The layout rules (mesh/parallel_dims.h): degrees against the world size, then against the model.
  const mesh::ParallelDims given = parallel;
  try {
    parallel.resolve(world_size);
    parallel.check_model(meshtrain::parallel::model_dims(model));
  } catch (const mesh::LayoutError& e) {
    std::string value = e.value();
    if (e.key() == "dp" || e.key() == "fsdp") value = std::to_string(e.key() == "dp" ? given.dp : given.fsdp);
    bad("parallel." + e.key(), value, e.reason());
  }
  if (pp_split != "params" && pp_split != "time") {
    try {
      meshtrain::parallel::pipeline::parse_split(pp_split, model.layers, static_cast<int>(parallel.stages()));
    } catch (const std::invalid_argument& e) {
      bad("parallel.pp_split", "\"" + pp_split + "\"", e.what());
    }
  }
  try {
    meshtrain::parallel::parse_checkpoint_mode(activation_checkpoint);
  } catch (const std::invalid_argument&) {
    bad("parallel.activation_checkpoint", "\"" + activation_checkpoint + "\"", "use \"none\", \"full\" or \"selective\"");
  }
  if (activation_checkpoint_every < 1) {
    bad("parallel.activation_checkpoint_every", std::to_string(activation_checkpoint_every), "must be >= 1");
  }
  if (tp_impl != "plan" && tp_impl != "annotations") bad("parallel.tp_impl", "\"" + tp_impl + "\"", "use \"plan\" or \"annotations\"");
  if (tp_impl == "annotations") {
    try {
      meshtrain::parallel::check_annotated_layout(parallel, activation_checkpoint, dtype == "bfloat16", device == "cpu");
    } catch (const mesh::LayoutError& e) {
      bad("parallel.tp_impl", e.value(), e.reason());
    }
  }
  if (!sharding_report.empty() && tp_impl != "annotations") {
    bad("run.sharding_report", "\"" + sharding_report + "\"", "reports what annotations decided: set parallel.tp_impl = \"annotations\"");
  }
  if (microbatches < 0) bad("parallel.microbatches", std::to_string(microbatches), "must be >= 0 (0: derived)");
  if (device != "cpu" && device != "cuda" && device != "auto" && device.rfind("cuda:", 0) != 0) {
    bad("run.device", "\"" + device + "\"", "use \"cpu\", \"cuda\", \"cuda:N\" or \"auto\"");
  }
  if ((device == "cuda" || device.rfind("cuda:", 0) == 0) && !torch::cuda::is_available()) {
    bad("run.device", "\"" + device + "\"", "no CUDA device is visible to this process; use \"cpu\" or \"auto\"");
  }
  if (trace_step < 0) bad("run.trace_step", std::to_string(trace_step), "must be >= 0 (0: none)");
  const std::string ep_factor = parallel.ep > 1 ? " x ep (" + std::to_string(parallel.ep) + ")" : "";
  if (microbatches > 0) {
    if (batch % (microbatches * data_ranks()) != 0) {
      bad("parallel.microbatches", std::to_string(microbatches),
          "training.batch (" + std::to_string(batch) + ") must be divisible by microbatches x dp (" +
              std::to_string(parallel.dp) + ") x fsdp (" + std::to_string(parallel.fsdp) + ")" + ep_factor + " = " +
              std::to_string(microbatches * data_ranks()));
    }
    micro_batch = batch / (microbatches * data_ranks());
  }
  if (batch % (micro_batch * data_ranks()) != 0) {
    bad("training.batch", std::to_string(batch),
        "must be divisible by training.micro_batch (" + std::to_string(micro_batch) + ") x dp (" +
            std::to_string(parallel.dp) + ") x fsdp (" + std::to_string(parallel.fsdp) + ")" + ep_factor + " = " +
            std::to_string(micro_batch * data_ranks()));
  }
  if (unit_policy != "block" && unit_policy != "model") {
    bad("parallel.unit_policy", "\"" + unit_policy + "\"", "use \"block\" or \"model\"");
  }
  for (const auto& [key, value] : {std::pair<const char*, const std::string&>{"parallel.param_dtype", param_dtype},
                                   {"parallel.reduce_dtype", reduce_dtype}}) {
    if (value != "float32" && value != "bfloat16") bad(key, "\"" + value + "\"", "use \"float32\" or \"bfloat16\"");
    if (value != "float32" && parallel.zero_stage == 0) {
      bad(key, "\"" + value + "\"", "applies to parallel.zero_stage >= 1; for data parallel use training.dtype");
    }
  }
  if (zero1_reduce != "all_reduce" && zero1_reduce != "reduce_scatter") {
    bad("parallel.zero1_reduce", "\"" + zero1_reduce + "\"", "use \"all_reduce\" or \"reduce_scatter\"");
  }
  for (const auto& [key, value] : {std::pair<std::string, std::string>{"offload.optimizer", offload_optimizer},
                                   {"offload.params", offload_params}}) {
    if (value != "none" && value != "cpu" && value != "nvme") bad(key, "\"" + value + "\"", "use \"none\", \"cpu\" or \"nvme\"");
  }
  if (offload_optimizer != "none" && parallel.zero_stage == 0) {
    bad("offload.optimizer", "\"" + offload_optimizer + "\"", "needs parallel.zero_stage >= 1 (the sharded optimizer)");
  }
  if (offload_params != "none" && parallel.zero_stage != 3) {
    bad("offload.params", "\"" + offload_params + "\"", "needs parallel.zero_stage = 3 (sharded parameters)");
  }
  if (offload_params != "none" && offload_optimizer == "none") {
    bad("offload.params", "\"" + offload_params + "\"", "needs offload.optimizer = \"cpu\" or \"nvme\" as well");
  }
  if (memory_limit_mb < 0) bad("memory.limit_mb", std::to_string(memory_limit_mb), "must be >= 0 (0: no limit)");
  grad_accum = batch / (micro_batch * data_ranks());
  try {
    parallel.check_microbatches(grad_accum);
  } catch (const mesh::LayoutError& e) {
    bad("parallel." + e.key(), e.value(), e.reason());
  }
  if (!(lr > 0)) bad("training.lr", std::to_string(lr), "must be > 0");
  if (min_lr < 0 || min_lr > lr) bad("training.min_lr", std::to_string(min_lr), "must be in [0, training.lr]");
  if (warmup < 0) bad("training.warmup", std::to_string(warmup), "must be >= 0");
  if (weight_decay < 0) bad("training.weight_decay", std::to_string(weight_decay), "must be >= 0");
  if (!(beta1 >= 0 && beta1 < 1)) bad("training.beta1", std::to_string(beta1), "must be in [0, 1)");
  if (!(beta2 >= 0 && beta2 < 1)) bad("training.beta2", std::to_string(beta2), "must be in [0, 1)");
  if (grad_clip < 0) bad("training.grad_clip", std::to_string(grad_clip), "must be >= 0 (0: off)");
  if (dtype != "float32" && dtype != "bfloat16") bad("training.dtype", "\"" + dtype + "\"", "use \"float32\" or \"bfloat16\"");
  if (eval_every < 0) bad("training.eval_every", std::to_string(eval_every), "must be >= 0");
  if (eval_batches < 1) bad("training.eval_batches", std::to_string(eval_batches), "must be >= 1");
  if (log_every < 1) bad("training.log_every", std::to_string(log_every), "must be >= 1");
  if (sample_tokens < 0) bad("training.sample_tokens", std::to_string(sample_tokens), "must be >= 0");
  if (bucket_mb < 1) bad("parallel.bucket_mb", std::to_string(bucket_mb), "must be >= 1");
  if (checkpoint_every < 0) bad("checkpoint.every", std::to_string(checkpoint_every), "must be >= 0");
  if (checkpoint_keep < 1) bad("checkpoint.keep", std::to_string(checkpoint_keep), "must be >= 1");
  if (!(val_fraction > 0 && val_fraction < 1)) bad("data.val_fraction", std::to_string(val_fraction), "must be in (0, 1)");
  if (train_file.empty() != val_file.empty()) {
    bad(train_file.empty() ? "data.val_file" : "data.train_file", "\"" + (train_file.empty() ? val_file : train_file) + "\"",
        "give both data.train_file and data.val_file, or neither (then data.text is prepared)");
  }
  if (train_file.empty() && text.empty()) bad("data.text", "[]", "name text to train on, or data.train_file");
  if (out.empty()) bad("run.out", "\"\"", "must name a directory");
}

at::Device TrainConfig::torch_device(int local_rank) const {
  if (device == "cpu") return at::Device(at::kCPU);
  if (device == "cuda" || device == "auto") return comm::device_for_local_rank(local_rank);  // auto: cpu without GPUs
  return at::Device(device);
}

std::string TrainConfig::checkpoint_path() const { return checkpoint_dir.empty() ? out + "/checkpoints" : checkpoint_dir; }

std::string TrainConfig::describe_keys() {
  const TrainConfig defaults;
  std::ostringstream out;
  std::string section;
  for (const Field& f : fields()) {
    if (f.section != section) {
      section = f.section;
      out << "\n[" << section << "]\n";
    }
    std::string line = "  " + f.key + " = " + f.show(defaults);
    if (line.size() < 36) line.resize(36, ' ');
    out << line << "  " << f.help << "\n";
  }
  return out.str();
}

std::string model_config_to_json(const model::GptConfig& c) {
  nlohmann::json j{{"vocab_size", c.vocab_size}, {"context", c.context}, {"layers", c.layers},
                   {"heads", c.heads},           {"width", c.width},     {"dropout", c.dropout},
                   {"norm", c.norm},             {"position", c.position}, {"mlp", c.mlp},
                   {"tie_embeddings", c.tie_embeddings}, {"bias", c.bias},
                   {"kv_heads", c.kv_heads},     {"ffn_hidden", c.ffn_hidden}, {"rope_theta", c.rope_theta},
                   {"norm_eps", c.norm_eps}};
  if (c.moe()) {
    j["moe"] = {{"experts", c.moe_experts},         {"every", c.moe_every},   {"top_k", c.moe_top_k},
                {"capacity_factor", c.moe_capacity_factor}, {"second_expert", c.moe_second_expert},
                {"aux_loss", c.moe_aux_loss},       {"z_loss", c.moe_z_loss}, {"hidden", c.moe_hidden}};
  }
  return j.dump();
}

std::string model_fingerprint(const model::GptConfig& m) {
  return "gpt layers=" + std::to_string(m.layers) + " heads=" + std::to_string(m.heads) + " width=" +
         std::to_string(m.width) + " context=" + std::to_string(m.context) + " vocab=" + std::to_string(m.vocab_size) +
         " " + m.norm + "/" + m.position + "/" + m.mlp + (m.tie_embeddings ? "/tied" : "/untied") +
         (m.bias ? "/bias" : "/nobias") + (m.grouped_query() ? " kv_heads=" + std::to_string(m.kv_heads) : "") +
         (m.ffn_hidden > 0 ? " ffn=" + std::to_string(m.ffn_hidden) : "");
}

model::GptConfig model_config_from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text);
  model::GptConfig c;
  c.vocab_size = j.at("vocab_size");
  c.context = j.at("context");
  c.layers = j.at("layers");
  c.heads = j.at("heads");
  c.width = j.at("width");
  c.dropout = j.at("dropout");
  c.norm = j.at("norm");
  c.position = j.at("position");
  c.mlp = j.at("mlp");
  c.tie_embeddings = j.at("tie_embeddings");
  c.bias = j.at("bias");
  // Added later: absent in older checkpoints, which had the defaults.
  c.kv_heads = j.value("kv_heads", int64_t{0});
  c.ffn_hidden = j.value("ffn_hidden", int64_t{0});
  c.rope_theta = j.value("rope_theta", 10000.0);
  c.norm_eps = j.value("norm_eps", 1e-5);
  if (j.contains("moe")) {
    const nlohmann::json& m = j.at("moe");
    c.moe_experts = m.at("experts");
    c.moe_every = m.at("every");
    c.moe_top_k = m.at("top_k");
    c.moe_capacity_factor = m.at("capacity_factor");
    c.moe_second_expert = m.at("second_expert");
    c.moe_aux_loss = m.at("aux_loss");
    c.moe_z_loss = m.at("z_loss");
    c.moe_hidden = m.at("hidden");
  }
  c.validate();
  return c;
}

}  // namespace meshtrain::train
