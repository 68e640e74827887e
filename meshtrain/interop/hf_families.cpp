#include "meshtrain/interop/hf_families.h"

#include "meshtrain/interop/safetensors.h"
#include "meshtrain/model/config_json.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

namespace meshtrain::interop {

using nlohmann::json;

// Note [Hugging Face families]
// Every family here is a Llama-style decoder (RMSNorm, RoPE, gated MLP, no
// position table) with variations that map onto [model] keys:
//   llama      attention_bias, mlp_bias, head_dim, rope scaling (Llama 3.1+)
//   mistral    sliding_window in every layer
//   qwen2      biases on q, k, v
//   qwen3      QK-norm per head, head_dim
//   mixtral    softmax-top-k experts, renormalised, every block
//   qwen3_moe  QK-norm, experts of moe_intermediate_size, norm_topk_prob
//   gemma2     (1 + w) norms before and after each sublayer, GeGLU,
//              embeddings times sqrt(width), soft-caps, query_pre_attn_scalar,
//              a window in every other block
//   phi3       q, k, v and gate, up stored fused (split on import)
//   olmo2      norms after each sublayer, QK-norm over all heads
// Reading is strict: every key of config.json is either read, or listed
// once below as not changing what the model computes (token ids, the saving
// library, training-only dropout), or it is an error naming it. So a
// setting meshtrain does not implement can never be dropped silently.
// Writing goes the other way and then reads its own config.json back: a
// model is written as a family only if that reads back as the same model.

namespace {

const std::set<std::string>& harmless_keys() {
  static const std::set<std::string> keys = {
      "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
      "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
      "_name_or_path", "auto_map", "tokenizer_class", "id2label", "label2id", "return_dict", "output_attentions",
      "output_hidden_states", "torchscript", "use_return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
      "is_decoder", "add_cross_attention", "tie_encoder_decoder", "pruned_heads", "problem_type",
      "task_specific_params", "finetuning_task", "prefix", "tf_legacy_loss", "use_bfloat16", "cache_implementation",
      // Dropout is for training, which takes meshtrain's model.dropout; inference has none.
      "attention_dropout", "embd_pdrop", "resid_pdrop", "hidden_dropout",
      // Router losses in training: read below where meshtrain has one.
      "output_router_logits",
      // How transformers runs, not what it computes: its attention kernel, its
      // activation recompute, the old generation defaults configs carried, and
      // Llama 2's pretraining_tp (its matmuls in slices: the same sums).
      "attn_implementation", "_attn_implementation", "_attn_implementation_autoset", "use_flash_attention_2",
      "_flash_attn_2_enabled", "experts_implementation", "_experts_implementation", "use_kernels",
      "gradient_checkpointing", "pretraining_tp", "max_length", "min_length", "do_sample", "early_stopping",
      "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
      "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
      "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
      "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
      "begin_suppress_tokens", "max_new_tokens"};
  return keys;
}

// A config.json being read: what was looked at is remembered, so what was not
// can be named at the end.
class Reader {
 public:
  Reader(const json& config, std::string where) : c_(config), where_(std::move(where)) {}
  bool has(const std::string& key) {
    used_.insert(key);
    return c_.contains(key) && !c_[key].is_null();
  }
  template <typename T>
  T get(const std::string& key) {
    if (!has(key)) throw FormatError(where_ + ": \"" + key + "\" is missing");
    return convert<T>(c_[key], key);
  }
  template <typename T>
  T get_or(const std::string& key, T fallback) {
    return has(key) ? convert<T>(c_[key], key) : fallback;
  }
  // A key the model only matches at this value (absent or null also match).
  template <typename T>
  void expect(const std::string& key, T value) {
    if (has(key) && convert<T>(c_[key], key) != value) refuse_import(where_, "\"" + key + "\": " + c_[key].dump());
  }
  // A key of the model's table by its Hugging Face name: required, or absent keeping what `m` holds.
  void read(const model::ModelKey& k, model::GptConfig& m) {
    if (!has(k.hf)) {
      if (k.hf_required) throw FormatError(where_ + ": \"" + k.hf + "\" is missing");
      return;
    }
    json value = c_[k.hf];
    // A whole number written as a float ("hidden_size": 4096.0) is read as before, as the integer.
    if (k.key.kind == config::Kind::kInt && value.is_number_float() && value.get<double>() == std::floor(value.get<double>())) {
      value = static_cast<int64_t>(value.get<double>());
    }
    try {
      model::read_json(k, value, m, "\"" + k.hf + "\"");
    } catch (const std::invalid_argument& e) {
      throw FormatError(where_ + ": " + e.what());
    }
  }
  const json& raw(const std::string& key) {
    used_.insert(key);
    return c_[key];
  }
  void finish() const {
    for (auto it = c_.begin(); it != c_.end(); ++it) {
      if (!used_.count(it.key()) && !harmless_keys().count(it.key())) {
        refuse_import(where_, "\"" + it.key() + "\": " + it.value().dump());
      }
    }
  }
  const std::string& where() const { return where_; }

 private:
  template <typename T>
  T convert(const json& value, const std::string& key) const {
    try {
      return value.get<T>();
    } catch (const json::exception&) {
      throw FormatError(where_ + ": \"" + key + "\" has the wrong type (" + value.dump() + ")");
    }
  }

  const json& c_;
  std::string where_;
  std::set<std::string> used_;
};

// rope_parameters (transformers 5), else rope_scaling and rope_theta (4).
void read_rope(Reader& r, model::GptConfig& m, bool partial_rotary) {
  json rope = json::object();
  const bool scaling = r.has("rope_scaling");  // transformers 4's, and written beside rope_parameters for it
  if (r.has("rope_parameters")) {
    rope = r.raw("rope_parameters");
    if (scaling && rope.is_object()) {
      const json& old = r.raw("rope_scaling");
      auto type = [](const json& j) { return j.value("rope_type", j.value("type", std::string("default"))); };
      if (!old.is_object() || type(old) != type(rope)) {
        refuse_import(r.where(), "rope_scaling " + old.dump() + " beside rope_parameters " + rope.dump());
      }
    }
  } else if (scaling) {
    rope = r.raw("rope_scaling");
  }
  if (!rope.is_object()) refuse_import(r.where(), "rope parameters " + rope.dump());
  m.rope_theta = r.get_or<double>("rope_theta", 10000.0);
  Reader p(rope, r.where() + " rope parameters");
  m.rope_theta = p.get_or<double>("rope_theta", m.rope_theta);
  const std::string type = p.get_or<std::string>("rope_type", p.get_or<std::string>("type", "default"));
  const double fraction = p.get_or<double>("partial_rotary_factor", r.get_or<double>("partial_rotary_factor", 1.0));
  if (fraction != 1.0 && !partial_rotary) refuse_import(r.where(), "partial_rotary_factor " + std::to_string(fraction));
  m.rotary_fraction = fraction;
  if (type == "linear") {
    m.rope_scaling = model::RopeScaling::kLinear;
    m.rope_factor = p.get<double>("factor");
  } else if (type == "llama3") {
    m.rope_scaling = model::RopeScaling::kLlama3;
    m.rope_factor = p.get<double>("factor");
    m.rope_low_freq_factor = p.get<double>("low_freq_factor");
    m.rope_high_freq_factor = p.get<double>("high_freq_factor");
    m.rope_original_context = p.get_or<int64_t>("original_max_position_embeddings", m.context);
  } else if (type == "yarn") {
    m.rope_scaling = model::RopeScaling::kYarn;
    m.rope_original_context = p.get_or<int64_t>("original_max_position_embeddings", m.context);
    m.rope_factor = p.get_or<double>("factor", static_cast<double>(m.context) / static_cast<double>(m.rope_original_context));
    const double fast = p.get_or<double>("beta_fast", 0), slow = p.get_or<double>("beta_slow", 0);
    m.rope_beta_fast = fast != 0 ? fast : 32.0;
    m.rope_beta_slow = slow != 0 ? slow : 1.0;
    p.expect<bool>("truncate", true);
    auto mscale = [&](double m_) { return m.rope_factor <= 1 ? 1.0 : 0.1 * m_ * std::log(m.rope_factor) + 1.0; };
    const double ms = p.get_or<double>("mscale", 0), ms_all = p.get_or<double>("mscale_all_dim", 0);
    m.rope_attention_factor = p.get_or<double>("attention_factor", ms != 0 && ms_all != 0 ? mscale(ms) / mscale(ms_all)
                                                                                          : mscale(1.0));
  } else if (type != "default") {
    refuse_import(r.where(), "rope_type \"" + type + "\"");
  }
  p.finish();
}

// The sliding window: Mistral and Phi-3 slide in every layer; Qwen's only
// with use_sliding_window; Gemma 2 in the layers layer_types names.
void read_window(Reader& r, model::GptConfig& m, const std::string& type) {
  const bool qwen = type == "qwen2" || type == "qwen3" || type == "qwen3_moe";
  if (qwen) {
    const bool sliding = r.get_or<bool>("use_sliding_window", false);
    r.has("sliding_window"), r.has("max_window_layers");
    if (sliding) refuse_import(r.where(), "use_sliding_window = true (Qwen's windows from layer max_window_layers on)");
  } else if (type == "llama" || type == "olmo2") {
    r.has("sliding_window");  // transformers' llama and olmo2 ignore one
  } else if (r.has("sliding_window")) {
    m.sliding_window = r.get<int64_t>("sliding_window");
    if (m.sliding_window >= m.context) m.sliding_window = 0;  // the context fits in the window: none
  }
  if (type == "gemma2") {
    m.sliding_every = 2;
    // Older Gemma 2 configs repeat the window under another name.
    if (r.has("sliding_window_size") && r.get<int64_t>("sliding_window_size") != r.get_or<int64_t>("sliding_window", 0)) {
      refuse_import(r.where(), "sliding_window_size " + std::to_string(r.get<int64_t>("sliding_window_size")));
    }
  }
  if (r.has("layer_types")) {
    const json types = r.raw("layer_types");
    if (!types.is_array() || static_cast<int64_t>(types.size()) != m.layers) refuse_import(r.where(), "layer_types " + types.dump());
    for (int64_t i = 0; i < m.layers; ++i) {
      const bool sliding = types[i] == "sliding_attention";
      if (!sliding && types[i] != "full_attention") refuse_import(r.where(), "layer_types " + types.dump());
      // A window the context fits in is no window; otherwise it must fall on meshtrain's blocks.
      if (m.sliding_window > 0 && sliding != (m.window_of(i) > 0)) refuse_import(r.where(), "layer_types " + types.dump());
      if (m.sliding_window == 0 && sliding && qwen) refuse_import(r.where(), "layer_types " + types.dump());
    }
  }
}

void read_moe(Reader& r, model::GptConfig& m, const std::string& type) {
  m.moe_experts = r.has("num_local_experts") ? r.get<int64_t>("num_local_experts") : r.get<int64_t>("num_experts");
  r.has("num_experts");
  m.moe_top_k = r.get<int64_t>("num_experts_per_tok");
  m.moe_capacity_factor = 0;  // dropless
  m.moe_second_expert = model::SecondExpert::kAlways;
  m.moe_z_loss = 0;
  m.moe_aux_loss = r.get_or<double>("router_aux_loss_coef", 0.001);
  if (type == "mixtral") {
    m.moe_every = 1;
    m.moe_hidden = m.ffn_hidden;
    m.moe_norm_topk = true;
    r.expect<double>("router_jitter_noise", 0.0);
  } else {
    m.moe_every = r.get_or<int64_t>("decoder_sparse_step", 1);
    m.moe_hidden = r.get<int64_t>("moe_intermediate_size");
    m.moe_norm_topk = r.get_or<bool>("norm_topk_prob", false);
    if (r.has("mlp_only_layers") && !r.raw("mlp_only_layers").empty()) {
      refuse_import(r.where(), "mlp_only_layers " + r.raw("mlp_only_layers").dump());
    }
  }
  // Top-1 keeps the probability as the gate in meshtrain (Switch); renormalised it would be 1.
  if (m.moe_top_k == 1 && m.moe_norm_topk) refuse_import(r.where(), "num_experts_per_tok = 1 with renormalised gates");
}

}  // namespace

void refuse_import(const std::string& where, const std::string& what) {
  throw FormatError(where + ": " + what + " has no equivalent in meshtrain's model; it cannot be imported");
}

const std::vector<std::string>& family_types() {
  static const std::vector<std::string> types = {"llama",     "mistral", "qwen2", "qwen3", "mixtral",
                                                 "qwen3_moe", "gemma2",  "phi3",  "olmo2"};
  return types;
}

model::GptConfig config_from_family(const json& c, const std::string& type, const std::string& where) {
  Reader r(c, where);
  r.has("model_type");
  model::GptConfig m = model::GptConfig::preset("llama-tiny");
  // The families' defaults for the keys a config.json may leave out.
  m.norm_eps = 1e-6;
  m.tie_embeddings = type == "gemma2";
  for (const model::ModelKey& k : model::model_keys()) {
    if (!k.hf.empty()) r.read(k, m);  // the keys spelled one to one (Note [Model keys])
  }
  m.kv_heads = r.get_or<int64_t>("num_key_value_heads", m.heads);
  if (m.kv_heads == m.heads) m.kv_heads = 0;
  m.ffn_hidden = r.get<int64_t>("intermediate_size");
  m.dropout = 0;
  const int64_t head_dim = r.get_or<int64_t>("head_dim", type == "qwen3" ? 128 : m.width / m.heads);
  if (head_dim * m.heads != m.width) m.head_size = head_dim;
  if (type == "gemma2") {
    const std::string act = r.get_or<std::string>("hidden_activation", "gelu_pytorch_tanh");
    if (act != "gelu_pytorch_tanh") refuse_import(where, "hidden_activation \"" + act + "\"");
    r.expect<std::string>("hidden_act", "gelu_pytorch_tanh");
    m.mlp = model::MlpStyle::kGeglu;
    m.norm_placement = model::NormPlacement::kSandwich;
    m.norm_plus_one = true;
    m.embed_scale = true;
    m.query_scale = r.get<double>("query_pre_attn_scalar");
    if (m.query_scale == static_cast<double>(m.head_dim())) m.query_scale = 0;
    m.attn_softcap = r.get_or<double>("attn_logit_softcapping", 0.0);
    m.logit_softcap = r.get_or<double>("final_logit_softcapping", 0.0);
    r.expect<bool>("use_bidirectional_attention", false);
  } else {
    const std::string act = r.get_or<std::string>("hidden_act", "silu");
    if (act != "silu") refuse_import(where, "hidden_act \"" + act + "\"");
  }
  read_rope(r, m, type == "phi3");
  if (type == "phi3") r.has("original_max_position_embeddings");  // longrope's; refused above if used
  read_window(r, m, type);
  if (type == "qwen2") {
    m.qkv_bias = true;
    r.expect<bool>("use_mrope", false);  // Qwen2-VL's multimodal rotary
  }
  if (type == "phi3" || type == "mistral" || type == "mixtral" || type == "qwen2") r.expect<bool>("attention_bias", false);
  if (type == "llama" || type == "qwen3" || type == "qwen3_moe" || type == "gemma2" || type == "olmo2") {
    m.attention_bias = r.get_or<bool>("attention_bias", false);
  }
  if (type == "llama") {
    m.mlp_bias = r.get_or<bool>("mlp_bias", false);
    r.expect<int64_t>("pretraining_tp", 1);
  }
  if (type == "qwen3" || type == "qwen3_moe") m.qk_norm = model::QkNorm::kHead;
  if (type == "olmo2") {
    m.qk_norm = model::QkNorm::kWidth;
    m.norm_placement = model::NormPlacement::kPost;
  }
  if (type == "mixtral" || type == "qwen3_moe") read_moe(r, m, type);
  r.finish();
  try {
    m.validate();
  } catch (const std::invalid_argument& e) {
    throw FormatError(where + ": " + e.what());
  }
  return m;
}

namespace {

// The model as it computes: every "0: the default" resolved, and what its
// setting leaves unused (the scaling's parameters without scaling, the
// experts' keys without experts, windows the context fits in) reset.
model::GptConfig as_computed(model::GptConfig c) {
  const model::GptConfig d;
  c.kv_heads = c.key_value_heads();
  c.head_size = c.head_dim();
  c.qkv_bias = c.qkv_has_bias();
  if (c.query_scale <= 0) c.query_scale = static_cast<double>(c.head_dim());
  c.ffn_hidden = c.moe_blocks() < c.layers ? c.mlp_hidden() : 0;
  if (c.sliding_window >= c.context) c.sliding_window = 0;
  c.sliding_every = c.sliding_window == 0 ? d.sliding_every : std::min(c.sliding_every, c.layers);
  if (c.rope_scaling == model::RopeScaling::kNone) {
    c.rope_factor = d.rope_factor, c.rope_original_context = d.rope_original_context;
    c.rope_low_freq_factor = d.rope_low_freq_factor, c.rope_high_freq_factor = d.rope_high_freq_factor;
    c.rope_beta_fast = d.rope_beta_fast, c.rope_beta_slow = d.rope_beta_slow;
    c.rope_attention_factor = d.rope_attention_factor;
  }
  if (c.moe()) {
    c.moe_hidden = c.expert_hidden();
    if (c.moe_top_k != 2) c.moe_second_expert = model::SecondExpert::kAlways;  // only top-2 has a second
  } else {
    c.moe_every = d.moe_every, c.moe_top_k = d.moe_top_k, c.moe_capacity_factor = d.moe_capacity_factor;
    c.moe_second_expert = d.moe_second_expert, c.moe_hidden = d.moe_hidden, c.moe_norm_topk = d.moe_norm_topk;
    c.moe_shared_hidden = d.moe_shared_hidden;
  }
  return c;
}

// The first key of the table (Note [Model keys]) whose computing value differs, as "model.key = value"; "".
std::string first_difference(const model::GptConfig& a, const model::GptConfig& b) {
  const model::GptConfig x = as_computed(a), y = as_computed(b);
  for (const model::ModelKey& k : model::model_keys()) {
    if (k.computes && k.stored != model::ModelKey::Stored::kNotStored && model::differs(k, x, y)) {
      return "model." + k.key.name + " = " + k.key.show(x);
    }
  }
  return "";
}

json rope_json(const model::GptConfig& c) {
  json rope = {{"rope_type", c.rope_scaling == model::RopeScaling::kNone ? std::string("default") : model::name(c.rope_scaling)},
               {"rope_theta", c.rope_theta}};
  if (c.rope_scaling != model::RopeScaling::kNone) rope["factor"] = c.rope_factor;
  if (c.rope_scaling == model::RopeScaling::kLlama3 || c.rope_scaling == model::RopeScaling::kYarn) {
    rope["original_max_position_embeddings"] = c.rope_original_context;
  }
  if (c.rope_scaling == model::RopeScaling::kLlama3) {
    rope["low_freq_factor"] = c.rope_low_freq_factor;
    rope["high_freq_factor"] = c.rope_high_freq_factor;
  }
  if (c.rope_scaling == model::RopeScaling::kYarn) {
    rope["beta_fast"] = c.rope_beta_fast;
    rope["beta_slow"] = c.rope_beta_slow;
    if (c.rope_attention_factor > 0) rope["attention_factor"] = c.rope_attention_factor;
  }
  if (c.rotary_fraction != 1.0) rope["partial_rotary_factor"] = c.rotary_fraction;
  return rope;
}

// rope_parameters as transformers 4 wrote it: rope_scaling without the theta, or null.
json scaling_json(const model::GptConfig& c) {
  if (c.rope_scaling == model::RopeScaling::kNone) return nullptr;
  json scaling = rope_json(c);
  scaling.erase("rope_theta");
  scaling.erase("partial_rotary_factor");
  return scaling;
}

}  // namespace

std::string family_of(const model::GptConfig& c) {
  if (c.norm != model::NormStyle::kRmsNorm || c.position != model::PositionStyle::kRope || c.bias) {
    throw FormatError("model " + model::name(c.norm) + "/" + model::name(c.position) + (c.bias ? "/bias" : "") +
                      " is none of the Llama-style families (rmsnorm/rope, no norm biases)");
  }
  return c.family();
}

json family_config(const model::GptConfig& c, const std::string& type, const std::string& torch_dtype) {
  static const std::map<std::string, std::string> classes = {
      {"llama", "LlamaForCausalLM"},     {"mistral", "MistralForCausalLM"}, {"qwen2", "Qwen2ForCausalLM"},
      {"qwen3", "Qwen3ForCausalLM"},     {"mixtral", "MixtralForCausalLM"}, {"qwen3_moe", "Qwen3MoeForCausalLM"},
      {"gemma2", "Gemma2ForCausalLM"},   {"phi3", "Phi3ForCausalLM"},       {"olmo2", "Olmo2ForCausalLM"}};
  const int64_t intermediate = type == "mixtral" ? c.expert_hidden() : c.mlp_hidden();  // Mixtral: experts only
  json j = {{"architectures", {classes.at(type)}}, {"model_type", type}, {"intermediate_size", intermediate},
            {"num_key_value_heads", c.key_value_heads()}, {"head_dim", c.head_dim()},
            {"rope_parameters", rope_json(c)},
            // transformers 4 reads these instead of rope_parameters.
            {"rope_theta", c.rope_theta}, {"rope_scaling", scaling_json(c)},
            {"torch_dtype", torch_dtype}, {"attention_dropout", 0.0},
            // Token ids are the tokenizer's business; a family's default one may lie outside a small vocabulary.
            {"pad_token_id", nullptr}};
  for (const model::ModelKey& k : model::model_keys()) {
    if (!k.hf.empty()) j[k.hf] = model::json_of(k, c);  // the keys spelled one to one (Note [Model keys])
  }
  if (c.rotary_fraction != 1.0) j["partial_rotary_factor"] = c.rotary_fraction;  // transformers 4
  if (type == "gemma2") {
    j["hidden_activation"] = "gelu_pytorch_tanh";
    const double scalar = c.query_scale > 0 ? c.query_scale : static_cast<double>(c.head_dim());
    // An integer in transformers' config class.
    j["query_pre_attn_scalar"] = scalar == std::floor(scalar) ? json(static_cast<int64_t>(scalar)) : json(scalar);
    j["attn_logit_softcapping"] = c.attn_softcap > 0 ? json(c.attn_softcap) : json(nullptr);
    j["final_logit_softcapping"] = c.logit_softcap > 0 ? json(c.logit_softcap) : json(nullptr);
  } else {
    j["hidden_act"] = "silu";
  }
  if (type != "qwen2" && type != "mistral" && type != "mixtral" && type != "phi3") j["attention_bias"] = c.attention_bias;
  if (type == "llama") j["mlp_bias"] = c.mlp_bias;
  const bool qwen = type == "qwen2" || type == "qwen3" || type == "qwen3_moe";
  if (qwen) j["use_sliding_window"] = false;
  if (!qwen && type != "llama" && type != "olmo2") {
    j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
    if (type == "gemma2") {
      json types = json::array();
      for (int64_t i = 0; i < c.layers; ++i) types.push_back(c.window_of(i) > 0 ? "sliding_attention" : "full_attention");
      j["layer_types"] = types;
      if (c.sliding_window == 0) j["sliding_window"] = c.context;  // Gemma 2 always has one: the whole context
    }
  }
  if (c.moe()) {
    j["num_local_experts"] = c.moe_experts;
    j["num_experts_per_tok"] = c.moe_top_k;
    j["router_aux_loss_coef"] = c.moe_aux_loss;
    j["output_router_logits"] = false;
    if (type == "qwen3_moe") {
      j["moe_intermediate_size"] = c.expert_hidden();
      j["norm_topk_prob"] = c.moe_norm_topk && c.moe_top_k > 1;  // top-1 keeps its probability
      j["decoder_sparse_step"] = c.moe_every;
      j["mlp_only_layers"] = json::array();
    }
  }
  // Only what reads back as the same model is written.
  const std::string difference = first_difference(c, config_from_family(j, type, "config.json"));
  if (!difference.empty()) throw FormatError(difference + " has no equivalent in Hugging Face's " + type);
  return j;
}

}  // namespace meshtrain::interop
