#include "meshtrain/model/lora.h"

#include "meshtrain/model/qkv_layout.h"

#include "meshtrain/interop/safetensors.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <tuple>
#include <unordered_map>

namespace meshtrain::model {

namespace {

bool is_qkv_target(const std::string& t) { return t == "q" || t == "k" || t == "v"; }

// Where target `t` sits in block `i`: the linear, its module name, and the adapter's in/out sizes.
struct TargetSite {
  torch::nn::Linear linear{nullptr};
  std::string module;  // "blocks.N.attn.qkv"
  int64_t in = 0, out = 0;
};

// Target t's linear: (in, out) features.
std::pair<int64_t, int64_t> target_sizes(const GptConfig& c, const std::string& t) {
  if (t == "q") return {c.width, c.q_width()};
  if (t == "k" || t == "v") return {c.width, c.kv_width()};
  if (t == "o") return {c.q_width(), c.width};
  if (t == "down") return {c.mlp_hidden(), c.width};
  return {c.width, c.mlp_hidden()};  // gate, up
}

// Target t's linear in a block, after "blocks.N.": a GELU MLP's fc is up, its proj down.
std::string target_module(const std::string& t, bool gelu) {
  if (is_qkv_target(t)) return "attn.qkv";
  if (t == "o") return "attn.proj";
  if (gelu && t == "up") return "mlp.fc";
  if (gelu && t == "down") return "mlp.proj";
  return "mlp." + t;
}

bool has_target(const LoraConfig& config, const std::string& t) {
  return std::find(config.targets.begin(), config.targets.end(), t) != config.targets.end();
}

// The site of target `t` in block `i`, or none (a mixture-of-experts block has no MLP).
bool target_site(Gpt& model, int64_t i, const std::string& t, TargetSite& site) {
  auto block = model->blocks[i]->as<BlockImpl>();
  MlpImpl* mlp = block->mlp ? block->mlp.get() : nullptr;
  const bool gelu = mlp && mlp->fc;
  if (is_qkv_target(t)) site.linear = block->attn->qkv;
  else if (t == "o") site.linear = block->attn->proj;
  else if (!mlp) return false;
  else if (t == "gate") site.linear = mlp->gate;
  else if (t == "up") site.linear = gelu ? mlp->fc : mlp->up;
  else if (t == "down") site.linear = gelu ? mlp->proj : mlp->down;
  site.module = "blocks." + std::to_string(i) + "." + target_module(t, gelu);
  std::tie(site.in, site.out) = target_sizes(model->config(), t);
  return static_cast<bool>(site.linear);
}

// The fused qkv's outputs (along the last dim of `like`) from q, k and v's
// parts, an undefined part standing for zeros (Note [Grouped-query layout]).
// The sizes are the local ones: tensor parallel's share of the heads.
at::Tensor fuse_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& like,
                    const GptConfig& c) {
  return model::fuse_qkv(q, k, v, -1, like.sizes(), like.options(), c);
}

// Note [LoRA's update in place]
// y + s·(x·Aᵀ)·Bᵀ as one autograd node, where y is the base linear's output.
// The update is added into y in place (addmm_, beta 1): at::addmm wrote a
// copy of y. Backward hands dy on to the base linear unchanged, and returns
// x's gradient as a tensor of its own, not a view, so that autograd adds the
// base's gradient for x into it in place instead of allocating their sum
// (InputBuffer accumulates in place into a gradient it holds the only
// reference to). In bench/lora_vs_full.py's model on an Intel Xeon the copy
// took 25 ms and the sum 17 ms of a 1,058 ms step. A base output that is a
// view or not contiguous (a layout's own output) takes at::addmm as before.
// The products run in y's dtype (bf16 under autocast), the factors'
// gradients are returned in theirs.
struct LoraUpdate : torch::autograd::Function<LoraUpdate> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y, const at::Tensor& x,
                            const at::Tensor& a, const at::Tensor& bt, double scale) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::ScalarType type = y.scalar_type();
    const at::Tensor x2 = x.reshape({-1, x.size(-1)}).to(type);
    const at::Tensor xa = at::mm(x2, a.to(type).t());  // [tokens, rank]
    y.view({-1, y.size(-1)}).addmm_(xa, bt.to(type), 1.0, scale);
    ctx->mark_dirty({y});
    ctx->save_for_backward({x2, a, bt, xa});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["x_type"] = static_cast<int64_t>(x.scalar_type());
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x2 = saved[0], &a = saved[1], &bt = saved[2], &xa = saved[3];
    const double scale = ctx->saved_data["scale"].toDouble();
    const at::Tensor& dy = grads[0];
    const at::ScalarType type = xa.scalar_type();
    const at::Tensor dy2 = dy.reshape({-1, dy.size(-1)}).to(type);
    const at::Tensor dxa = at::mm(dy2, bt.to(type).t()).mul_(scale);  // [tokens, rank]
    const at::Tensor dbt = ctx->needs_input_grad(3) ? at::mm(xa.t(), dy2).mul_(scale).to(bt.scalar_type()) : at::Tensor();
    const at::Tensor da = ctx->needs_input_grad(2) ? at::mm(dxa.t(), x2).to(a.scalar_type()) : at::Tensor();
    at::Tensor dx;
    if (ctx->needs_input_grad(1)) {
      const auto type_x = static_cast<at::ScalarType>(ctx->saved_data["x_type"].toInt());
      dx = at::_unsafe_view(at::mm(dxa, a.to(type)).to(type_x), ctx->saved_data["x_sizes"].toIntVector());
    }
    return {dy, dx, da, dbt, {}};
  }
};

// y + scale·(x·Aᵀ)·Bᵀ, y [.., out], x [.., in], A [rank, in], Bᵀ [rank, out].
at::Tensor add_update(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                      double scale) {
  if (!y.is_view() && y.is_contiguous() && y.dim() >= 2) return LoraUpdate::apply(y, x, a, bt, scale);
  const at::Tensor x2 = x.reshape({-1, x.size(-1)}), y2 = y.reshape({-1, y.size(-1)});
  return at::addmm(y2, at::linear(x2, a), bt, 1.0, scale).view(y.sizes());
}

class LoraHooks : public ForwardHooks {
 public:
  struct Site {
    bool qkv = false;
    std::vector<std::pair<std::string, LoraAdapter>> adapters;  // (target, adapter)
  };

  LoraHooks(GptConfig model, const LoraConfig& config) : model_(std::move(model)), scale_(config.scale()), dropout_(config.dropout) {}
  bool wraps_head() const override { return false; }  // adapters sit in the blocks' linears

  at::Tensor around(const std::string& module, const at::Tensor& input, const Forward& forward) override {
    auto it = sites.find(module);
    if (it == sites.end()) return forward(input);
    const Site& site = it->second;
    const at::Tensor y = forward(input);
    const bool training = site.adapters.front().second->is_training();
    const at::Tensor x = dropout_ > 0 && training ? at::dropout(input, dropout_, true) : input;
    // y + scale·(x·Aᵀ)·Bᵀ: the scale and the sum inside the second matmul.
    if (!site.qkv) {
      const LoraAdapter& a = site.adapters.front().second;
      return add_update(y, x, a->A, a->B.t(), scale_);
    }
    // q, k and v's adapters as one: A stacked [n·rank, in]; Bᵀ [n·rank, qkv outputs]
    // with each target's Bᵀ in its own rows and its part's columns of the fused layout.
    const int64_t n = static_cast<int64_t>(site.adapters.size()), r = site.adapters.front().second->A.size(0);
    std::vector<at::Tensor> a;
    at::Tensor q, k, v;  // [n·rank, outputs of the part]: B transposed, in its slot
    for (int64_t i = 0; i < n; ++i) {
      const auto& [target, adapter] = site.adapters[i];
      a.push_back(adapter->A);
      const at::Tensor slot = at::constant_pad_nd(adapter->B.t(), {0, 0, i * r, (n - 1 - i) * r});
      (target == "q" ? q : target == "k" ? k : v) = slot;
    }
    const at::Tensor bt = fuse_qkv(q, k, v, at::empty({n * r, y.size(-1)}, y.options()), model_);
    return add_update(y, x, at::cat(a, 0), bt, scale_);
  }

  std::unordered_map<std::string, Site> sites;  // by call site

 private:
  GptConfig model_;
  double scale_, dropout_;
};

}  // namespace

const std::vector<std::string>& lora_targets() {
  static const std::vector<std::string> names{"q", "k", "v", "o", "gate", "up", "down"};
  return names;
}

void LoraConfig::check(const GptConfig& model) const {
  if (rank < 0) throw std::invalid_argument("lora.rank = " + std::to_string(rank) + ": must be >= 0 (0: no adapters)");
  if (!enabled()) return;
  if (!(alpha > 0)) throw std::invalid_argument("lora.alpha must be > 0");
  if (!(dropout >= 0 && dropout < 1)) throw std::invalid_argument("lora.dropout must be in [0, 1)");
  if (targets.empty()) throw std::invalid_argument("lora.targets is empty: name at least one of q, k, v, o, gate, up, down");
  for (const std::string& t : targets) {
    const auto& known = lora_targets();
    if (std::find(known.begin(), known.end(), t) == known.end()) {
      throw std::invalid_argument("lora.targets: \"" + t + "\" is not a target; use q, k, v, o, gate, up, down");
    }
  }
  if (targets.size() == 1 && targets.front() == "gate" && !model.gated_mlp()) {
    throw std::invalid_argument("lora.targets = [\"gate\"]: this model's MLP (" + name(model.mlp) +
                                ") has no gate, so nothing would be adapted; its linears are up (fc) and down (proj)");
  }
}

int64_t LoraConfig::parameter_count(const GptConfig& m) const {
  if (!enabled()) return 0;
  int64_t total = 0;
  for (const std::string& t : targets) {
    if (t == "gate" && !m.gated_mlp()) continue;
    const bool mlp = t == "gate" || t == "up" || t == "down";
    const auto [in, out] = target_sizes(m, t);
    total += (mlp ? m.layers - m.moe_blocks() : m.layers) * (in + out);  // a MoE block's experts take none
  }
  return rank * total;
}

std::string LoraConfig::to_json() const {
  return nlohmann::json{{"rank", rank},
                        {"alpha", alpha},
                        {"dropout", dropout},
                        {"targets", targets},
                        {"base_dtype", base_dtype == at::kBFloat16 ? "bfloat16" : "float32"}}
      .dump();
}

LoraConfig LoraConfig::from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text);
  LoraConfig c;
  c.rank = j.at("rank");
  c.alpha = j.at("alpha");
  c.dropout = j.value("dropout", 0.0);
  c.targets = j.at("targets").get<std::vector<std::string>>();
  c.base_dtype = j.value("base_dtype", "float32") == "bfloat16" ? at::kBFloat16 : at::kFloat;
  return c;
}

LoraAdapterImpl::LoraAdapterImpl(int64_t in, int64_t out, int64_t rank) {
  A = register_parameter("A", torch::zeros({rank, in}));
  B = register_parameter("B", torch::zeros({out, rank}));
}

bool is_lora_parameter(const std::string& name) { return name.find(".lora_") != std::string::npos; }

void freeze_base(torch::nn::Module& model) {
  for (auto& item : model.named_parameters()) {
    if (!is_lora_parameter(item.key())) item.value().set_requires_grad(false);
  }
}

void cast_frozen_matrices(torch::nn::Module& model, at::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  for (auto& item : model.named_parameters()) {
    at::Tensor& p = item.value();
    if (item.key().rfind("blocks.", 0) == 0 && p.dim() == 2 && !p.requires_grad()) p.set_data(p.to(dtype));
  }
}

std::shared_ptr<ForwardHooks> apply_lora(Gpt& model, const LoraConfig& config, uint64_t seed) {
  config.check(model->config());
  auto hooks = std::make_shared<LoraHooks>(model->config(), config);
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed ^ 0x4c6f5241ULL);  // "LoRA"
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < model->config().layers; ++i) {
    for (const std::string& t : lora_targets()) {
      TargetSite site;
      if (!has_target(config, t) || !target_site(model, i, t, site)) continue;
      auto adapter = site.linear->register_module("lora_" + t, LoraAdapter(site.in, site.out, config.rank));
      const double bound = 1.0 / std::sqrt(static_cast<double>(site.in));  // kaiming_uniform_(a = sqrt(5))
      adapter->A.copy_(at::empty(adapter->A.sizes()).uniform_(-bound, bound, generator));
      adapter->A.set_data(adapter->A.to(site.linear->weight.device()));
      adapter->B.set_data(adapter->B.to(site.linear->weight.device()));
      LoraHooks::Site& s = hooks->sites[site.module];
      s.qkv = is_qkv_target(t);
      s.adapters.emplace_back(t, LoraAdapter(adapter));
    }
  }
  freeze_base(*model);
  if (config.base_dtype != at::kFloat) cast_frozen_matrices(*model, config.base_dtype);
  model->add_forward_hooks(hooks);
  return hooks;
}

void merge_lora(Gpt& model, const LoraConfig& config, const std::map<std::string, at::Tensor>& adapters) {
  config.check(model->config());
  torch::NoGradGuard no_grad;
  const GptConfig& c = model->config();
  for (int64_t i = 0; i < c.layers; ++i) {
    std::map<std::string, at::Tensor> qkv;  // target -> scale·B·A, transposed [in, out]
    torch::nn::Linear qkv_linear{nullptr};
    for (const std::string& t : lora_targets()) {
      TargetSite site;
      if (!has_target(config, t) || !target_site(model, i, t, site)) continue;
      const std::string name = site.module + ".lora_" + t;
      auto a = adapters.find(name + ".A"), b = adapters.find(name + ".B");
      if (a == adapters.end() || b == adapters.end()) throw std::invalid_argument("LoRA adapters: no " + name + " (A and B)");
      const at::Tensor delta = at::matmul(b->second.to(at::kFloat), a->second.to(at::kFloat)) * config.scale();
      if (delta.size(0) != site.out || delta.size(1) != site.in) {
        throw std::invalid_argument("LoRA adapter " + name + ": B·A is [" + std::to_string(delta.size(0)) + ", " +
                                    std::to_string(delta.size(1)) + "], the linear [" + std::to_string(site.out) + ", " +
                                    std::to_string(site.in) + "]");
      }
      if (is_qkv_target(t)) {
        qkv[t] = delta.t();
        qkv_linear = site.linear;
        continue;
      }
      at::Tensor& w = site.linear->weight;
      w.add_(delta.to(w.dtype()));
    }
    if (!qkv_linear) continue;
    at::Tensor& w = qkv_linear->weight;  // [qkv_width, width]
    const at::Tensor like = w.t();
    auto get = [&](const char* t) { return qkv.count(t) ? qkv.at(t) : at::Tensor(); };
    w.add_(fuse_qkv(get("q"), get("k"), get("v"), at::zeros(like.sizes(), like.options().dtype(at::kFloat)), c).t().to(w.dtype()));
  }
}

namespace {

// transformers' Llama module of each target ("q_proj": q, ...).
const std::map<std::string, std::string>& peft_modules() {
  static const std::map<std::string, std::string> m{{"q_proj", "q"},       {"k_proj", "k"},   {"v_proj", "v"},
                                                    {"o_proj", "o"},       {"gate_proj", "gate"},
                                                    {"up_proj", "up"},     {"down_proj", "down"}};
  return m;
}

// PEFT's key of our adapter parameter, under transformers' Llama names.
std::string peft_key(const std::string& name) {
  // blocks.N.<attn.qkv|attn.proj|mlp.X>.lora_T.<A|B>
  const size_t lora = name.find(".lora_");
  const std::string block = name.substr(0, name.find('.', 7));  // "blocks.N"
  const std::string rest = name.substr(lora + 6);                // "q.A"
  const std::string target = rest.substr(0, rest.find('.')), matrix = rest.substr(rest.find('.') + 1);
  std::string module;
  for (const auto& [peft, ours] : peft_modules()) {
    if (ours == target) module = (is_qkv_target(target) || target == "o" ? "self_attn." : "mlp.") + peft;
  }
  return "base_model.model.model.layers." + block.substr(7) + "." + module + ".lora_" + matrix + ".weight";
}

void check_peft_family(const GptConfig& model) {
  if (!model.rms_norm() || model.learned_positions() || !model.gated_mlp()) {
    throw std::invalid_argument("PEFT adapters: this model's transformers class (GPT-2 style: fused c_attn, c_fc) has "
                                "no separate q/k/v/gate/up/down projections to name; export the merged model instead");
  }
}

}  // namespace

void write_peft_adapter(const std::string& dir, const GptConfig& model, const LoraConfig& config,
                        const std::map<std::string, at::Tensor>& adapters, const std::string& base_model) {
  check_peft_family(model);
  std::filesystem::create_directories(dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, tensor] : adapters) tensors.emplace_back(peft_key(name), tensor.to(at::kFloat).contiguous());
  interop::write_safetensors((std::filesystem::path(dir) / "adapter_model.safetensors").string(), tensors,
                             {{"format", "pt"}});
  std::vector<std::string> modules;
  for (const auto& [peft, ours] : peft_modules()) {
    if (has_target(config, ours)) modules.push_back(peft);
  }
  const nlohmann::json j{{"peft_type", "LORA"},
                         {"task_type", "CAUSAL_LM"},
                         {"base_model_name_or_path", base_model},
                         {"r", config.rank},
                         {"lora_alpha", config.alpha},
                         {"lora_dropout", config.dropout},
                         {"target_modules", modules},
                         {"bias", "none"},
                         {"fan_in_fan_out", false},
                         {"inference_mode", true},
                         {"use_rslora", false},
                         {"use_dora", false},
                         {"modules_to_save", nullptr}};
  std::ofstream out(std::filesystem::path(dir) / "adapter_config.json", std::ios::trunc);
  out << j.dump(2) << "\n";
  if (!out) throw std::runtime_error("cannot write " + dir + "/adapter_config.json");
}

PeftAdapter read_peft_adapter(const std::string& dir, const GptConfig& model) {
  check_peft_family(model);
  const std::string config_path = (std::filesystem::path(dir) / "adapter_config.json").string();
  std::ifstream in(config_path);
  if (!in) throw std::invalid_argument(config_path + ": cannot be read (a PEFT adapter folder holds adapter_config.json)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw std::invalid_argument(config_path + ": not JSON: " + e.what());
  }
  auto fail = [&](const std::string& what) { throw std::invalid_argument(config_path + ": " + what); };
  const std::string tensors_path = (std::filesystem::path(dir) / "adapter_model.safetensors").string();
  auto fail_tensor = [&](const std::string& what) { throw std::invalid_argument(tensors_path + ": " + what); };
  if (j.value("peft_type", "") != "LORA") fail("peft_type is \"" + j.value("peft_type", "") + "\", not \"LORA\"");
  if (j.value("use_dora", false) || j.value("use_rslora", false)) fail("DoRA and rsLoRA adapters are not supported");
  if (j.value("fan_in_fan_out", false)) fail("fan_in_fan_out adapters (GPT-2's Conv1D) are not supported");
  for (const char* key : {"r", "lora_alpha", "target_modules"}) {
    if (!j.contains(key)) fail(std::string("no \"") + key + "\" (a LoRA adapter config has r, lora_alpha and target_modules)");
  }
  if (!j.at("r").is_number_integer() || j.at("r").get<int64_t>() < 1) fail("r must be a positive integer");
  if (!j.at("lora_alpha").is_number()) fail("lora_alpha must be a number");
  PeftAdapter out;
  out.config.rank = j.at("r");
  out.config.alpha = j.at("lora_alpha");
  out.config.targets.clear();
  nlohmann::json modules = j.at("target_modules");
  if (modules.is_string()) fail("target_modules as a pattern is not supported; list the module names");
  for (const auto& m : modules) {
    auto it = peft_modules().find(m.get<std::string>());
    if (it == peft_modules().end()) fail("target module \"" + m.get<std::string>() + "\" is none of q_proj ... down_proj");
    out.config.targets.push_back(it->second);
  }
  const interop::SafetensorsFile file(tensors_path);
  std::map<std::string, std::string> ours_of;  // PEFT key -> our name
  std::map<std::string, std::vector<int64_t>> shape_of;  // PEFT key -> [rank, in] or [out, rank]
  for (int64_t i = 0; i < model.layers; ++i) {
    for (const std::string& t : out.config.targets) {
      for (const char* m : {"A", "B"}) {
        const std::string ours = "blocks." + std::to_string(i) + "." + target_module(t, false) + ".lora_" + t + "." + m;
        ours_of[peft_key(ours)] = ours;
        const auto [in_features, out_features] = target_sizes(model, t);
        shape_of[peft_key(ours)] = std::string(m) == "A" ? std::vector<int64_t>{out.config.rank, in_features}
                                                          : std::vector<int64_t>{out_features, out.config.rank};
      }
    }
  }
  for (const std::string& key : file.names()) {
    std::string plain = key;
    const size_t dot_default = plain.find(".default.");  // some PEFT versions keep the adapter's name
    if (dot_default != std::string::npos) plain.erase(dot_default, 8);
    auto it = ours_of.find(plain);
    if (it == ours_of.end()) fail_tensor("tensor " + key + " names no layer of this model");
    const at::Tensor t = file.read(key);
    if (t.sizes().vec() != shape_of.at(plain)) {
      std::ostringstream text;
      text << key << " is " << t.sizes() << ", not " << at::IntArrayRef(shape_of.at(plain))
           << " (r = " << out.config.rank << " and this model's sizes)";
      fail_tensor(text.str());
    }
    out.adapters[it->second] = t.to(at::kFloat);
  }
  for (const auto& [peft, ours] : ours_of) {
    if (!out.adapters.count(ours)) fail_tensor("no tensor " + peft);
  }
  out.config.check(model);
  return out;
}

}  // namespace meshtrain::model
