#include "meshtrain/parallel/parallel_spec.h"

#include "meshtrain/parallel/pipeline/stages.h"

#include <algorithm>
#include <cctype>
#include <stdexcept>

namespace meshtrain::parallel {

namespace {

using config::refuse;

std::string n(int64_t v) { return std::to_string(v); }

// "KEY = VALUE: REASON" for a broken layout rule of ParallelDims, with the
// value the user gave (dp and fsdp are filled in by resolve()).
[[noreturn]] void refuse_layout(const mesh::LayoutError& e, const mesh::ParallelDims& given) {
  std::string value = e.value();
  if (e.key() == "dp" || e.key() == "fsdp") value = n(e.key() == "dp" ? given.dp : given.fsdp);
  refuse("parallel." + e.key(), value, e.reason());
}

}  // namespace

int64_t layout_number(const std::string& key, const std::string& value) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || v < 1) {
    throw std::invalid_argument("layout " + key + "=" + value + ": needs a whole number >= 1");
  }
  return v;
}

namespace {

std::string one_of(const std::string& key, const std::string& value, const std::vector<std::string>& allowed) {
  std::string list;
  for (const auto& a : allowed) {
    if (a == value) return value;
    list += (list.empty() ? "" : ", ") + a;
  }
  throw std::invalid_argument("layout " + key + "=" + value + ": use one of " + list);
}

// The space- or comma-separated items of a one-line layout.
std::vector<std::string> items_of(const std::string& text) {
  std::vector<std::string> items;
  std::string item;
  for (const char c : text + " ") {
    if (c == ',' || std::isspace(static_cast<unsigned char>(c))) {
      if (!item.empty()) items.push_back(item);
      item.clear();
    } else {
      item += c;
    }
  }
  return items;
}

#define MESHTRAIN_SPEC_MEMBER(expression) [](ParallelSpec& s) -> auto& { return s.expression; }

}  // namespace

const config::Names<CheckpointMode>& checkpoint_mode_names() {
  static const config::Names<CheckpointMode> names = {
      {CheckpointMode::kNone, "none"}, {CheckpointMode::kFull, "full"}, {CheckpointMode::kSelective, "selective"}};
  return names;
}

const config::Names<ShardUnits>& shard_unit_names() {
  static const config::Names<ShardUnits> names = {{ShardUnits::kBlock, "block"}, {ShardUnits::kModel, "model"}};
  return names;
}

const config::Names<Zero1Reduce>& zero1_reduce_names() {
  static const config::Names<Zero1Reduce> names = {{Zero1Reduce::kAllReduce, "all_reduce"},
                                                   {Zero1Reduce::kReduceScatter, "reduce_scatter"}};
  return names;
}

const config::Names<TensorParallelImpl>& tensor_parallel_names() {
  static const config::Names<TensorParallelImpl> names = {{TensorParallelImpl::kPlan, "plan"},
                                                          {TensorParallelImpl::kAnnotations, "annotations"}};
  return names;
}

const config::Names<offload::Tier>& offload_tier_names() {
  static const config::Names<offload::Tier> names = {
      {offload::Tier::kDevice, "none"}, {offload::Tier::kHost, "cpu"}, {offload::Tier::kNvme, "nvme"}};
  return names;
}

const config::Names<at::ScalarType>& state_dtype_names() {
  static const config::Names<at::ScalarType> names = {{at::kFloat, "float32"}, {at::kBFloat16, "bfloat16"}};
  return names;
}

StageSplit StageSplit::parse(const std::string& text, const std::string& key) {
  StageSplit split;
  if (text == "params") return split;
  if (text == "time") {
    split.kind = Kind::kTime;
    return split;
  }
  try {
    split.blocks = pipeline::parse_block_counts(text);
  } catch (const std::invalid_argument& e) {
    refuse(key, config::quoted(text), e.what());
  }
  split.kind = Kind::kBlocks;
  return split;
}

std::string StageSplit::str() const {
  if (kind == Kind::kParams) return "params";
  if (kind == Kind::kTime) return "time";
  std::string text;
  for (const int64_t b : blocks) text += (text.empty() ? "" : ",") + std::to_string(b);
  return text;
}

mesh::ModelDims model_dims(const model::GptConfig& config) {
  mesh::ModelDims dims;
  dims.layers = config.layers;
  dims.heads = config.heads;
  dims.kv_heads = config.key_value_heads();
  dims.ffn = config.mlp_hidden();
  dims.vocab = config.vocab_size;
  dims.context = config.context;
  dims.experts = config.moe_experts;
  return dims;
}

const std::vector<config::Key<ParallelSpec>>& ParallelSpec::keys() {
  using config::enum_key;
  using config::key;
  static const std::vector<config::Key<ParallelSpec>> table = [] {
    std::vector<config::Key<ParallelSpec>> k;
    const std::string p = "parallel";
    k.push_back(key<ParallelSpec>(p, "dp", "replicas: data-parallel ranks holding the same shards (0: derived)",
                                  MESHTRAIN_SPEC_MEMBER(dims.dp)));
    k.push_back(key<ParallelSpec>(p, "fsdp", "shards per replica when zero_stage >= 1; dp x fsdp = ranks (0: derived)",
                                  MESHTRAIN_SPEC_MEMBER(dims.fsdp)));
    k.push_back(key<ParallelSpec>(p, "tp", "tensor-parallel ranks: attention split by heads, MLP and vocabulary split "
                                  "(Megatron); pp x dp x fsdp x ep x cp x tp = ranks", MESHTRAIN_SPEC_MEMBER(dims.tp)));
    k.push_back(key<ParallelSpec>(p, "ep", "expert-parallel ranks: each holds model.moe_experts / ep experts of every "
                                  "mixture-of-experts block; they read different micro-batches (data ranks are dp x "
                                  "fsdp x ep)", MESHTRAIN_SPEC_MEMBER(dims.ep)));
    k.push_back(key<ParallelSpec>(p, "cp", "context-parallel ranks: every sequence split over cp ranks (the zigzag "
                                  "split: rank i holds chunks i and 2cp-1-i of 2cp, so causal work is equal), attention "
                                  "by cp_impl; they read the same micro-batch and are data ranks for the gradient "
                                  "reduction", MESHTRAIN_SPEC_MEMBER(dims.cp)));
    k.push_back(enum_key<ParallelSpec>(p, "cp_impl", "context parallel attention: \"ring\" (key/value blocks go around "
                                       "the cp ranks, overlapped with the products), \"all_to_all\" (Ulysses: heads "
                                       "scattered, the sequence gathered; heads / tp a multiple of cp) or \"hybrid\" "
                                       "(all-to-all inside groups of cp_a2a ranks, the ring across them)",
                                       mesh::context_parallel_names(), MESHTRAIN_SPEC_MEMBER(dims.cp_impl)));
    k.push_back(key<ParallelSpec>(p, "cp_a2a", "cp_impl = \"hybrid\": ranks per all-to-all group (divides cp; 0: the "
                                  "largest divisor below cp that divides the heads per tp rank)",
                                  MESHTRAIN_SPEC_MEMBER(dims.cp_a2a)));
    k.push_back(key<ParallelSpec>(p, "sequence_parallel", "with tp > 1: norms, dropout and residual stream split along "
                                  "the sequence (activations 1/tp per rank, same communication)",
                                  MESHTRAIN_SPEC_MEMBER(dims.sequence_parallel)));
    k.push_back(enum_key<ParallelSpec>(p, "tp_impl", "how tensor parallel is applied: \"plan\" (hand-written Megatron "
                                       "layers) or \"annotations\" (the weights annotated with mesh_split, every other "
                                       "tensor placed by the sharding rules)", tensor_parallel_names(),
                                       MESHTRAIN_SPEC_MEMBER(tp_impl)));
    k.push_back(key<ParallelSpec>(p, "pp", "pipeline stages: the blocks split into pp consecutive groups, micro-batches "
                                  "flowing through them; pp x dp x fsdp x ep x cp x tp = ranks", MESHTRAIN_SPEC_MEMBER(dims.pp)));
    k.push_back(enum_key<ParallelSpec>(p, "pp_schedule", "\"gpipe\" (all forwards, then all backwards), \"1f1b\" (at "
                                       "most pp micro-batches in flight) or \"interleaved\" (1f1b over virtual_stages "
                                       "per rank: bubble / v)", mesh::pipeline_schedule_names(),
                                       MESHTRAIN_SPEC_MEMBER(dims.schedule)));
    k.push_back(key<ParallelSpec>(p, "microbatches", "micro-batches per step per data rank (sets training.micro_batch; "
                                  "0: batch / (micro_batch x dp x fsdp)); the bubble is (pp-1)/(microbatches+pp-1)",
                                  MESHTRAIN_SPEC_MEMBER(microbatches)));
    k.push_back(key<ParallelSpec>(p, "virtual_stages", "stages per pipeline rank, non-adjacent (pp_schedule = "
                                  "\"interleaved\")", MESHTRAIN_SPEC_MEMBER(dims.virtual_stages)));
    k.push_back({p, "pp_split", config::Kind::kString,
                 "blocks per stage: \"params\" (balance parameter counts), \"time\" (balance times measured at start) "
                 "or a list like \"3,3,2\"",
                 [](ParallelSpec& s, const config::Value& v) { s.pp_split = StageSplit::parse(v.s, "parallel.pp_split"); },
                 [](const ParallelSpec& s) { return config::quoted(s.pp_split.str()); }});
    k.push_back(enum_key<ParallelSpec>(p, "activation_checkpoint", "\"none\", \"full\" (keep block inputs only, "
                                       "recompute in backward) or \"selective\" (recompute attention proper)",
                                       checkpoint_mode_names(), MESHTRAIN_SPEC_MEMBER(activation_checkpoint)));
    k.push_back(key<ParallelSpec>(p, "activation_checkpoint_every", "checkpoint every k-th block (1: all)",
                                  MESHTRAIN_SPEC_MEMBER(activation_checkpoint_every)));
    k.push_back(key<ParallelSpec>(p, "zero_stage", "0: data parallel; 1: shard optimizer states; 2: + gradients; 3: + "
                                  "parameters (FSDP)", MESHTRAIN_SPEC_MEMBER(dims.zero_stage)));
    k.push_back(key<ParallelSpec>(p, "bucket_mb", "gradient all-reduce bucket size in MiB (zero_stage 0)",
                                  MESHTRAIN_SPEC_MEMBER(bucket_mb)));
    k.push_back(key<ParallelSpec>(p, "first_bucket_mb", "the first bucket (zero_stage 0; the last layers' gradients): "
                                  "small, so the first all-reduce starts early in backward", MESHTRAIN_SPEC_MEMBER(first_bucket_mb)));
    k.push_back(enum_key<ParallelSpec>(p, "unit_policy", "sharded units: \"block\" (one per transformer block + root) "
                                       "or \"model\"", shard_unit_names(), MESHTRAIN_SPEC_MEMBER(unit_policy)));
    k.push_back(key<ParallelSpec>(p, "prefetch", "zero_stage 3: gather the next unit while this one computes",
                                  MESHTRAIN_SPEC_MEMBER(prefetch)));
    k.push_back(key<ParallelSpec>(p, "reshard_after_forward", "zero_stage 3: free a block's parameters after its forward",
                                  MESHTRAIN_SPEC_MEMBER(reshard_after_forward)));
    k.push_back(enum_key<ParallelSpec>(p, "param_dtype", "zero_stage >= 1: \"float32\" or \"bfloat16\" parameters for "
                                       "compute (fp32 master shards)", state_dtype_names(),
                                       MESHTRAIN_SPEC_MEMBER(param_dtype)));
    k.push_back(enum_key<ParallelSpec>(p, "reduce_dtype", "zero_stage >= 1: \"float32\" or \"bfloat16\" gradient "
                                       "reductions", state_dtype_names(), MESHTRAIN_SPEC_MEMBER(reduce_dtype)));
    k.push_back(enum_key<ParallelSpec>(p, "zero1_reduce", "zero_stage 1: \"all_reduce\" full gradients then read the "
                                       "shard, or \"reduce_scatter\" into a shard buffer (+4 bytes per owned element)",
                                       zero1_reduce_names(), MESHTRAIN_SPEC_MEMBER(zero1_reduce)));
    k.push_back(enum_key<ParallelSpec>("offload", "optimizer", "\"none\", \"cpu\" or \"nvme\": keep the fp32 master "
                                       "weights and AdamW moments in host memory or a file on a local disk and step "
                                       "them on the CPU (ZeRO-Offload / ZeRO-Infinity; parallel.zero_stage >= 1)",
                                       offload_tier_names(), MESHTRAIN_SPEC_MEMBER(offload_optimizer)));
    k.push_back(enum_key<ParallelSpec>("offload", "params", "\"none\", \"cpu\" or \"nvme\": zero_stage 3's parameter "
                                       "shards there too, read before each gather (needs offload.optimizer)",
                                       offload_tier_names(), MESHTRAIN_SPEC_MEMBER(offload_params)));
    k.push_back(key<ParallelSpec>("offload", "nvme_dir", "folder on a local disk for the nvme tier (default: "
                                  "<run.out>/nvme)", MESHTRAIN_SPEC_MEMBER(offload_nvme_dir)));
    return k;
  }();
  return table;
}

#undef MESHTRAIN_SPEC_MEMBER

void ParallelSpec::check(int64_t world, const model::GptConfig& model, const Compute& compute) {
  check(world, model_dims(model), compute);
}

void ParallelSpec::check(int64_t world, const mesh::ModelDims& model, const Compute& compute) {
  // The degrees (Note [Layout rules]): against the world size, then the model.
  const mesh::ParallelDims given = dims;
  try {
    dims.resolve(world);
    dims.check_model(model);
  } catch (const mesh::LayoutError& e) {
    refuse_layout(e, given);
  }
  if (pp_split.kind == StageSplit::Kind::kBlocks) {
    try {
      pipeline::check_block_counts(pp_split.blocks, model.layers, static_cast<int>(dims.stages()));
    } catch (const std::invalid_argument& e) {
      refuse("parallel.pp_split", config::quoted(pp_split.str()), "'" + pp_split.str() + "' " + e.what());
    }
  }
  if (activation_checkpoint_every < 1) {
    refuse("parallel.activation_checkpoint_every", n(activation_checkpoint_every), "must be >= 1");
  }
  if (annotated()) {
    // Note [Annotated tensor parallel]: what annotations do not combine with yet.
    auto not_with = [](const std::string& what) {
      refuse("parallel.tp_impl", "\"annotations\"", "does not combine with " + what + " yet; use tp_impl = \"plan\"");
    };
    if (dims.pp > 1) not_with("pipeline parallel (pp > 1)");
    if (dims.ep > 1) not_with("expert parallel (ep > 1)");
    if (dims.cp > 1) not_with("context parallel (cp > 1)");
    if (dims.zero_stage > 2) not_with("ZeRO-3 (zero_stage = 3)");
    if (dims.sequence_parallel) not_with("sequence parallel");
    if (activation_checkpoint != CheckpointMode::kNone) not_with("activation checkpointing");
    if (compute.bfloat16) not_with("bfloat16 autocast");
    if (!compute.cpu) not_with("a GPU device");
  }
  if (microbatches < 0) refuse("parallel.microbatches", n(microbatches), "must be >= 0 (0: derived)");
  for (const auto& [name, dtype] : {std::pair<const char*, at::ScalarType>{"parallel.param_dtype", param_dtype},
                                    {"parallel.reduce_dtype", reduce_dtype}}) {
    if (dtype != at::kFloat && dims.zero_stage == 0) {
      refuse(name, config::quoted(config::name_of(state_dtype_names(), dtype)),
             "applies to parallel.zero_stage >= 1; for data parallel use training.dtype");
    }
  }
  // Offload (Note [Offloaded AdamW]): the host or disk holds the shards of the sharded optimizer.
  const std::string optimizer_tier = config::quoted(config::name_of(offload_tier_names(), offload_optimizer));
  const std::string params_tier = config::quoted(config::name_of(offload_tier_names(), offload_params));
  if (offloaded() && dims.zero_stage == 0) {
    refuse("offload.optimizer", optimizer_tier, "needs parallel.zero_stage >= 1 (the sharded optimizer)");
  }
  if (offload_params != offload::Tier::kDevice && dims.zero_stage != 3) {
    refuse("offload.params", params_tier, "needs parallel.zero_stage = 3 (sharded parameters)");
  }
  if (offload_params != offload::Tier::kDevice && !offloaded()) {
    refuse("offload.params", params_tier, "needs offload.optimizer = \"cpu\" or \"nvme\" as well");
  }
  if (bucket_mb < 1) refuse("parallel.bucket_mb", n(bucket_mb), "must be >= 1");
  if (first_bucket_mb < 1) refuse("parallel.first_bucket_mb", n(first_bucket_mb), "must be >= 1");
}

void ParallelSpec::check_inference(int64_t world, const std::string& command) {
  if (dims.tp > 1 && dims.cp > 1) {
    refuse("parallel.cp", n(dims.cp),
           command + " splits the model (parallel.tp) or the KV cache (parallel.cp) over all ranks of the job; "
           "use one of them");
  }
  const std::string degree = dims.cp > 1 ? "cp" : "tp";
  const int64_t asked = std::max(dims.tp, dims.cp);
  if (asked != world) {
    refuse("parallel." + degree, n(asked),
           "the job runs " + n(world) + " rank(s) and " + command + " puts every rank on " + degree +
               "; launch " + n(asked) + " (meshtrain run -n " + n(asked) + " " + command + " --parallel." + degree +
               "=" + n(asked) + " ...)");
  }
  for (const auto& [key, value] : {std::pair<const char*, int64_t>{"parallel.pp", dims.pp}, {"parallel.ep", dims.ep},
                                   {"parallel.zero_stage", dims.zero_stage + 1},
                                   {"parallel.sequence_parallel", dims.sequence_parallel ? 2 : 1}}) {
    if (value != 1) refuse(key, "(set)", command + " splits only by parallel.tp or parallel.cp");
  }
  dims.dp = dims.fsdp = 1;
}

ParallelSpec::BatchShape ParallelSpec::batch_shape(int64_t batch, int64_t micro_batch) const {
  const int64_t ranks = dims.data_ranks();
  const std::string ep_factor = dims.ep > 1 ? " x ep (" + n(dims.ep) + ")" : "";
  const std::string data = "dp (" + n(dims.dp) + ") x fsdp (" + n(dims.fsdp) + ")" + ep_factor;
  BatchShape shape;
  shape.micro_batch = micro_batch;
  if (microbatches > 0) {
    if (batch % (microbatches * ranks) != 0) {
      refuse("parallel.microbatches", n(microbatches),
             "training.batch (" + n(batch) + ") must be divisible by microbatches x " + data + " = " +
                 n(microbatches * ranks));
    }
    shape.micro_batch = batch / (microbatches * ranks);
  }
  if (batch % (shape.micro_batch * ranks) != 0) {
    // Settings that work: the next batch that divides, and a smaller micro-batch for this one.
    const int64_t unit = shape.micro_batch * ranks;
    std::string fix = "use training.batch = " + n((batch + unit - 1) / unit * unit);
    if (microbatches == 0 && batch % ranks == 0) {
      int64_t micro = std::min(shape.micro_batch, batch / ranks);
      while (micro > 1 && (batch / ranks) % micro != 0) --micro;
      fix += ", or training.micro_batch = " + n(micro);
    }
    refuse("training.batch", n(batch),
           "must be divisible by training.micro_batch (" + n(shape.micro_batch) + ") x " + data + " = " +
               n(unit) + "; " + fix);
  }
  shape.microbatches = batch / (shape.micro_batch * ranks);
  check_microbatches(shape.microbatches);
  return shape;
}

void ParallelSpec::check_microbatches(int64_t m) const {
  try {
    dims.check_microbatches(m);
  } catch (const mesh::LayoutError& e) {
    refuse("parallel." + e.key(), e.value(), e.reason());
  }
}

std::string ParallelSpec::str(int64_t micro_batch) const {
  std::string text;
  auto add = [&](const std::string& part) { text += (text.empty() ? "" : " ") + part; };
  const mesh::ParallelDims& d = dims;
  if (d.pp > 1) {
    add("pp=" + n(d.pp) + " " + mesh::schedule_name(d.schedule));
    if (d.virtual_stages > 1) add("v=" + n(d.virtual_stages));
  }
  if (d.tp > 1) add("tp=" + n(d.tp) + (d.sequence_parallel ? " sp" : ""));
  if (d.cp > 1) {
    add("cp=" + n(d.cp));
    if (d.cp_impl != mesh::ContextParallelImpl::kRing) add("cp_impl=" + config::name_of(mesh::context_parallel_names(), d.cp_impl));
    if (d.cp_a2a > 0) add("cp_a2a=" + n(d.cp_a2a));
  }
  if (d.dp > 1 || (d.fsdp == 1 && d.pp == 1 && d.tp == 1 && d.ep == 1 && d.cp == 1)) add("dp=" + n(d.dp));
  if (d.ep > 1) add("ep=" + n(d.ep));
  if (d.zero_stage > 0) add("zero=" + n(d.zero_stage));
  if (d.fsdp > 1) add("fsdp=" + n(d.fsdp));
  if (micro_batch > 0) add("mb=" + n(micro_batch));
  if (activation_checkpoint != CheckpointMode::kNone) {
    add("recompute=" + config::name_of(checkpoint_mode_names(), activation_checkpoint));
  }
  if (offloaded()) add(offload_params != offload::Tier::kDevice ? "offload=parameters" : "offload=optimizer");
  return text;
}

ParallelSpec ParallelSpec::parse(const std::string& text, const OtherKeys& other) {
  ParallelSpec spec;
  mesh::ParallelDims& d = spec.dims;
  d.dp = d.fsdp = 1;
  bool fsdp_given = false;
  for (const std::string& item : items_of(text)) {
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    const std::string value = eq == std::string::npos ? "" : item.substr(eq + 1);
    if (key == "sp" && eq == std::string::npos) d.sequence_parallel = true;
    else if (key == "gpipe" || key == "1f1b" || key == "interleaved") {
      d.schedule = config::parse_name(mesh::pipeline_schedule_names(), "schedule", key);
    } else if (eq == std::string::npos) {
      throw std::invalid_argument("layout item '" + item + "': expected key=value (e.g. tp=2)");
    } else if (key == "dp") d.dp = layout_number(key, value);
    else if (key == "fsdp") d.fsdp = layout_number(key, value), fsdp_given = true;
    else if (key == "tp") d.tp = layout_number(key, value);
    else if (key == "ep") d.ep = layout_number(key, value);
    else if (key == "cp") d.cp = layout_number(key, value);
    else if (key == "cp_a2a") d.cp_a2a = layout_number(key, value);
    else if (key == "cp_impl") {
      d.cp_impl = config::parse_name(mesh::context_parallel_names(), "cp_impl",
                                     one_of(key, value, {"ring", "all_to_all", "hybrid"}));
    }
    else if (key == "pp") d.pp = layout_number(key, value);
    else if (key == "v") d.virtual_stages = layout_number(key, value);
    else if (key == "sp") d.sequence_parallel = one_of(key, value, {"true", "false"}) == "true";
    else if (key == "schedule") {
      d.schedule = config::parse_name(mesh::pipeline_schedule_names(), "schedule",
                                      one_of(key, value, {"gpipe", "1f1b", "interleaved"}));
    } else if (key == "zero") d.zero_stage = static_cast<int>(std::stoll(one_of(key, value, {"0", "1", "2", "3"})));
    else if (key == "recompute") {
      spec.activation_checkpoint =
          config::parse_name(checkpoint_mode_names(), "recompute", one_of(key, value, {"none", "selective", "full"}));
    } else if (key == "offload") {
      const std::string what = one_of(key, value, {"none", "optimizer", "parameters"});
      spec.offload_optimizer = what == "none" ? offload::Tier::kDevice : offload::Tier::kHost;
      spec.offload_params = what == "parameters" ? offload::Tier::kHost : offload::Tier::kDevice;
    } else if (std::find(other.names.begin(), other.names.end(), key) != other.names.end()) {
      other.set(key, value);
    } else {
      std::string keys = "dp fsdp ep cp cp_impl cp_a2a tp sp pp schedule v zero";
      for (const std::string& name : other.names) keys += " " + name;
      throw std::invalid_argument("layout key '" + key + "' unknown; keys: " + keys + " recompute offload");
    }
  }
  // "zero=3 dp=8" means eight shards, as ZeRO speaks of them.
  if (d.zero_stage > 0 && !fsdp_given) std::swap(d.dp, d.fsdp);
  return spec;
}

}  // namespace meshtrain::parallel
