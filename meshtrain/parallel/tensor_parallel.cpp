#include "meshtrain/parallel/tensor_parallel.h"

#include "meshtrain/model/adapter.h"
#include "meshtrain/parallel/parallel_spec.h"

#include <cmath>
#include <mutex>
#include <set>
#include <stdexcept>
#include <unordered_map>

namespace meshtrain::parallel {

namespace {

using Style = TensorParallelStyle;

constexpr int64_t kSequenceDim = 1;  // activations are [B, T, width]

std::vector<std::string> segments(const std::string& name) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t dot = name.find('.', start);
    out.push_back(name.substr(start, dot - start));
    if (dot == std::string::npos) return out;
    start = dot + 1;
  }
}

bool matches(const std::string& pattern, const std::string& name) {
  const std::vector<std::string> p = segments(pattern), n = segments(name);
  if (p.size() != n.size()) return false;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] != "*" && p[i] != n[i]) return false;
  }
  return true;
}

// Styles that shard a module's parameters (the others act on call sites only).
bool binds_module(Style style) {
  return style == Style::kColwise || style == Style::kRowwise || style == Style::kVocabEmbedding ||
         style == Style::kSequenceParallel || style == Style::kSequencePositions || style == Style::kMixtureOfExperts;
}

}  // namespace

TensorParallelPlan gpt_tensor_parallel_plan(const model::GptConfig& config, bool sequence_parallel) {
  TensorParallelPlan plan = {
      {"wte", Style::kVocabEmbedding},
      // Whole heads with their keys and values in each share (Note [Grouped-query layout]).
      {"blocks.*.attn.qkv", Style::kColwise, config.grouped_query() ? 1 : 3},
      {"blocks.*.attn.core", Style::kLocalRandom},
      {"blocks.*.attn.proj", Style::kRowwise},
      {"head", Style::kVocabHead},
  };
  const bool dense_blocks = config.moe_blocks() < config.layers;
  if (config.moe()) plan.push_back({"blocks.*.moe", Style::kMixtureOfExperts});
  if (dense_blocks && config.mlp == model::MlpStyle::kGelu) {
    plan.push_back({"blocks.*.mlp.fc", Style::kColwise, 1, /*bias_in_model=*/config.fused});
    plan.push_back({"blocks.*.mlp.proj", Style::kRowwise});
  } else if (dense_blocks) {
    plan.push_back({"blocks.*.mlp.gate", Style::kColwise});
    plan.push_back({"blocks.*.mlp.up", Style::kColwise});
    plan.push_back({"blocks.*.mlp.down", Style::kRowwise});
  }
  if (config.qk_norm == model::QkNorm::kHead) {
    // Each rank normalises its own heads with the shared weights: their
    // gradients are partial sums, all-reduced like sequence-parallel norms'.
    plan.push_back({"blocks.*.attn.q_norm", Style::kSequenceParallel});
    plan.push_back({"blocks.*.attn.k_norm", Style::kSequenceParallel});
  }
  if (!sequence_parallel) {
    plan.push_back({"blocks.*.attn", Style::kPrepareInput});
    if (dense_blocks) plan.push_back({"blocks.*.mlp", Style::kPrepareInput});
    return plan;
  }
  for (const char* norm : {"blocks.*.norm1", "blocks.*.norm2", "norm_f"}) plan.push_back({norm, Style::kSequenceParallel});
  if (config.norm_placement == model::NormPlacement::kSandwich) {  // Gemma 2's norms after each sublayer see a chunk too
    for (const char* norm : {"blocks.*.post1", "blocks.*.post2"}) plan.push_back({norm, Style::kSequenceParallel});
  }
  if (config.position == model::PositionStyle::kLearned) plan.push_back({"wpe", Style::kSequencePositions});
  plan.push_back({"drop", Style::kLocalRandom});
  plan.push_back({"blocks.*.attn.drop", Style::kLocalRandom});
  if (dense_blocks) plan.push_back({"blocks.*.mlp.drop", Style::kLocalRandom});
  return plan;
}

void check_tensor_parallel(const model::GptConfig& config, int t, bool sequence_parallel) {
  mesh::ParallelDims dims;
  dims.dp = dims.fsdp = 1;
  dims.tp = t;
  dims.sequence_parallel = sequence_parallel && t > 1;
  dims.check();
  dims.check_model(model_dims(config));
  if (t > 1 && config.qk_norm == model::QkNorm::kWidth) {
    throw std::invalid_argument("tensor parallel: model.qk_norm = \"width\" (OLMo 2) normalises q and k over every "
                                "head, which tp = " + std::to_string(t) + " splits across ranks; use tp = 1 "
                                "(data, fully sharded, pipeline parallel take it)");
  }
}

struct TensorParallel::Hooks : model::ForwardHooks {
  struct Site {
    const TensorParallelRule* rule = nullptr;  // nullptr: not in the plan
    at::Tensor weight, bias;                   // kColwise, kRowwise (bias only), kVocabHead
  };

  TensorParallel* owner = nullptr;
  std::vector<TensorParallelRule> plan;
  std::unordered_map<std::string, at::Tensor> weights, biases;  // by module name
  std::unordered_map<std::string, Site> sites;                  // by call-site name, filled on first use
  std::set<std::string> adapted;  // linears carrying adapters (Note [Adapters])
  int64_t vocab_start = 0;
  bool split_head = false;

  const Site& site(const std::string& name) {
    auto it = sites.find(name);
    if (it != sites.end()) return it->second;
    Site s;
    for (const TensorParallelRule& rule : plan) {
      if (matches(rule.pattern, name)) s.rule = &rule;
    }
    if (s.rule) {
      if (weights.count(name)) s.weight = weights.at(name);
      if (biases.count(name)) s.bias = biases.at(name);
    }
    return sites.emplace(name, s).first->second;
  }

  at::Tensor around(const std::string& module, const at::Tensor& input, const Forward& forward) override {
    const Site& s = site(module);
    if (!s.rule) return forward(input);
    const CommPtr& comm = owner->comm_;
    const bool sp = owner->options_.sequence_parallel;
    switch (s.rule->style) {
      case Style::kColwise:
        if (!sp) return forward(input);
        // An adapted linear is more than its weight: its own forward (with the adapters) on the gathered input.
        if (adapted.count(module)) return forward(gather_from_sequence(input, comm, kSequenceDim));
        return sequence_gathered_linear(input, s.weight, s.bias, comm, kSequenceDim);
      case Style::kRowwise: {
        // The module's own bias was taken out: it is added once, after the sum.
        at::Tensor y = forward(input);
        y = sp ? reduce_scatter_to_sequence(y, comm, kSequenceDim) : reduce_from_tensor_parallel(y, comm);
        return s.bias.defined() ? y + s.bias : y;
      }
      case Style::kVocabEmbedding: {
        const int64_t rows = s.weight.size(0);
        const at::Tensor mine = (input >= vocab_start) & (input < vocab_start + rows);
        const at::Tensor y = forward((input - vocab_start).masked_fill(mine.logical_not(), 0))
                                 .masked_fill(mine.logical_not().unsqueeze(-1), 0.0);
        return sp ? reduce_scatter_to_sequence(y, comm, kSequenceDim) : reduce_from_tensor_parallel(y, comm);
      }
      case Style::kVocabHead:
        if (sp) return sequence_gathered_linear(input, s.weight, at::Tensor(), comm, kSequenceDim);
        return forward(copy_to_tensor_parallel(input, comm));
      case Style::kPrepareInput:
        return forward(copy_to_tensor_parallel(input, comm));
      case Style::kSequenceParallel:
        return forward(input);
      case Style::kSequencePositions: {
        const at::Tensor y = forward(input);  // [T, width], or [B, T, width] for packed rows' own positions
        const int64_t dim = y.dim() - 2, chunk = y.size(dim) / comm->size();
        return y.narrow(dim, comm->rank() * chunk, chunk);
      }
      case Style::kMixtureOfExperts: {
        // Every rank routes the whole micro-batch; the partial outputs add up.
        if (sp) return reduce_scatter_to_sequence(forward(gather_from_sequence(input, comm, kSequenceDim)), comm, kSequenceDim);
        return reduce_from_tensor_parallel(forward(copy_to_tensor_parallel(input, comm)), comm);
      }
      case Style::kLocalRandom: {
        if (owner->model_->config().dropout == 0) return forward(input);  // draws nothing
        at::Tensor y;
        owner->with_local_random([&] { y = forward(input); });
        return y;
      }
    }
    return forward(input);
  }

  // The chunked loss over this rank's share of the vocabulary (Note [Chunked
  // loss]): the head's input is whole on every rank (gathered from the
  // sequence chunks under sequence parallel), so the collectives' backward
  // completes dh, the partial sum each rank's share gives.
  bool chunks_head() const override { return true; }
  at::Tensor head_loss(const at::Tensor& y, const at::Tensor& weight, const at::Tensor& targets, double softcap,
                       model::LossGradients when, double loss_weight, double z_loss) override {
    if (!split_head) return {};
    const CommPtr& comm = owner->comm_;
    const at::Tensor h = owner->options_.sequence_parallel ? gather_from_sequence(y, comm, kSequenceDim)
                                                           : copy_to_tensor_parallel(y, comm);
    // dW is the rank's own share (no hook reduces it), so it may go into .grad in the forward.
    return model::chunked_cross_entropy(h, weight, targets, softcap, 0, vocab_shard(vocab_start, comm), when, 0, false,
                                        loss_weight, z_loss);
  }

  // Logits are split over the vocabulary only when the plan splits the head.
  at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets, double z_loss) override {
    if (!split_head) return {};
    return vocab_parallel_cross_entropy(logits.to(at::kFloat), targets, vocab_start, owner->comm_, z_loss);
  }
};

TensorParallel::TensorParallel(model::Gpt model, CommPtr comm, const TensorParallelPlan& plan,
                               TensorParallelOptions options)
    : model_(std::move(model)), comm_(std::move(comm)), options_(options), hooks_(std::make_shared<Hooks>()) {
  const int t = comm_->size(), rank = comm_->rank();
  check_tensor_parallel(model_->config(), t, options_.sequence_parallel);
  hooks_->owner = this;
  hooks_->plan = plan;
  for (const TensorParallelRule& rule : plan) hooks_->split_head |= rule.style == Style::kVocabHead;
  torch::NoGradGuard no_grad;

  std::vector<bool> used(plan.size(), false);
  auto set_split = [&](const std::string& name, at::Tensor& p, int64_t dim, int64_t parts) {
    TORCH_CHECK(p.size(dim) % (parts * t) == 0, "tensor parallel: ", name, " of shape ", p.sizes(),
                " does not split into ", parts, " x ", t, " along dim ", dim);
    split_[name] = {dim, parts};
    p.set_data(shard(name, p));
  };
  auto reduce_gradient = [&](at::Tensor& p) {
    // A partial sum on each rank (computed from its sequence chunk). A frozen parameter has none.
    if (!p.requires_grad()) return;
    CommPtr group = comm_;
    p.register_hook([group](const at::Tensor& grad) {
      at::Tensor sum = grad.contiguous().clone();
      group->all_reduce(sum).wait();
      return sum;
    });
  };
  for (const auto& item : model_->named_modules("", /*include_self=*/false)) {
    const std::string& name = item.key();
    const TensorParallelRule* rule = nullptr;
    for (size_t i = 0; i < plan.size(); ++i) {
      if (matches(plan[i].pattern, name)) {
        rule = &plan[i];
        used[i] = true;
      }
    }
    if (!rule) continue;
    torch::nn::Module& module = *item.value();
    auto own = module.named_parameters(/*recurse=*/false);
    at::Tensor* weight = own.find("weight");
    at::Tensor* bias = own.find("bias");
    const std::string prefix = name + ".";
    switch (rule->style) {
      case Style::kColwise:
      case Style::kVocabHead:
      case Style::kVocabEmbedding:
        TORCH_CHECK(weight, "tensor parallel: module ", name, " has no weight to split");
        set_split(prefix + "weight", *weight, 0, rule->style == Style::kColwise ? rule->parts : 1);
        if (bias) set_split(prefix + "bias", *bias, 0, rule->parts);
        hooks_->weights[name] = *weight;
        if (bias && !rule->bias_in_model) hooks_->biases[name] = *bias;
        if (rule->style == Style::kVocabEmbedding) hooks_->vocab_start = rank * weight->size(0);
        break;
      case Style::kRowwise: {
        auto* linear = dynamic_cast<torch::nn::LinearImpl*>(&module);
        TORCH_CHECK(linear, "tensor parallel: row-parallel module ", name, " is not a Linear");
        set_split(prefix + "weight", *weight, 1, 1);
        if (bias) {
          hooks_->biases[name] = *bias;
          linear->bias = at::Tensor();  // added by the hook after the reduction
          if (options_.sequence_parallel) reduce_gradient(*bias);
        }
        break;
      }
      case Style::kSequenceParallel:
      case Style::kSequencePositions:
        for (auto& p : module.named_parameters(false)) reduce_gradient(p.value());
        break;
      case Style::kMixtureOfExperts: {
        auto* moe = dynamic_cast<model::MoeImpl*>(&module);
        TORCH_CHECK(moe, "tensor parallel: mixture-of-experts module ", name, " is not a model::Moe");
        moe->set_replica_share(rank, t);
        for (auto& p : module.named_parameters(false)) reduce_gradient(p.value());
        break;
      }
      case Style::kPrepareInput:
      case Style::kLocalRandom:
        break;
    }
    if (rule->style == Style::kColwise || rule->style == Style::kRowwise) {
      // Adapters split with their linear (Note [Adapters]): the output factor
      // as a column-parallel weight's rows, the input factor as a row-parallel
      // weight's columns; the other factor is whole, its gradient a partial sum.
      for (const auto& [child, adapter] : model::adapters_of(module)) {
        auto factors = adapter->named_parameters(/*recurse=*/false);
        at::Tensor& in = *factors.find(adapter->input_factor());
        at::Tensor& out = *factors.find(adapter->output_factor());
        const std::string named = prefix + child + ".";
        if (rule->style == Style::kColwise) {
          set_split(named + adapter->output_factor(), out, 0, 1);
          reduce_gradient(in);
        } else {
          set_split(named + adapter->input_factor(), in, 1, 1);
          reduce_gradient(out);
        }
        hooks_->adapted.insert(name);
      }
    }
  }
  for (size_t i = 0; i < plan.size(); ++i) {
    if (!used[i] && binds_module(plan[i].style)) {
      throw std::invalid_argument("tensor parallel plan: '" + plan[i].pattern + "' matches no module of the model");
    }
  }
  // The tied LM head multiplies by the (vocab-split) token embedding.
  if (!model_->head && hooks_->weights.count("wte")) hooks_->weights["head"] = hooks_->weights.at("wte");

  local_random_state_ = seeded_state(comm_->device(), RandomStreams::per_rank_seed(options_.seed, rank));
  model_->add_forward_hooks(hooks_);
}

TensorParallel::~TensorParallel() { model_->remove_forward_hooks(hooks_.get()); }

bool TensorParallel::is_split(const std::string& name) const { return split_.count(name) > 0; }

placement::Placement TensorParallel::placement_of(const std::string& name) const {
  auto it = split_.find(name);
  if (it == split_.end()) return placement::Placement::replicate();
  return placement::Placement::shard(it->second.dim, it->second.parts);
}

// A split dimension of size parts * t * c as [..., parts, t * c, ...]: rank r
// holds the r-th chunk of c in every part.
std::vector<int64_t> TensorParallel::blocks(const std::string& name, at::IntArrayRef shape, int64_t per_part) const {
  const Split& s = split_.at(name);
  std::vector<int64_t> out = shape.vec();
  out[s.dim] = s.parts;
  out.insert(out.begin() + s.dim + 1, per_part);
  return out;
}

at::Tensor TensorParallel::shard(const std::string& name, const at::Tensor& full) const {
  const Split& s = split_.at(name);
  std::vector<int64_t> shape = full.sizes().vec();
  shape[s.dim] /= comm_->size();
  const at::Tensor parts = full.reshape(blocks(name, full.sizes(), full.size(s.dim) / s.parts));
  return parts.chunk(comm_->size(), s.dim + 1)[comm_->rank()].reshape(shape).clone();
}

at::Tensor TensorParallel::gather(const std::string& name, const at::Tensor& local) const {
  auto it = split_.find(name);
  if (it == split_.end()) return local;
  const Split& s = it->second;
  std::vector<int64_t> shape = local.sizes().vec();
  shape[s.dim] *= comm_->size();
  const at::Tensor parts = local.reshape(blocks(name, local.sizes(), local.size(s.dim) / s.parts));
  return all_gather_along(parts, *comm_, s.dim + 1).reshape(shape);
}

std::map<std::string, at::Tensor> TensorParallel::gather_all(const std::map<std::string, at::Tensor>& local) const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, tensor] : local) out[name] = gather(name, tensor);  // same order on every rank
  return out;
}

std::vector<RandomStreams::PerRank> TensorParallel::random_streams() {
  RandomStream stream{[this] { return local_random_state(); }, [this](const at::Tensor& s) { set_local_random_state(s); }};
  return {{"tensor_parallel", stream, comm_->rank()}};
}

std::string TensorParallel::describe() const {
  return "tensor parallel tp(" + std::to_string(comm_->size()) + ")" +
         (options_.sequence_parallel ? " with sequence parallel" : "");
}

void TensorParallel::with_local_random(const std::function<void()>& fn) {
  at::Generator generator = at::globalContext().defaultGenerator(comm_->device());
  at::Tensor saved;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    saved = generator.get_state();
    generator.set_state(local_random_state_);
  }
  auto restore = [&] {
    std::lock_guard<std::mutex> lock(generator.mutex());
    local_random_state_ = generator.get_state();
    generator.set_state(saved);
  };
  try {
    fn();
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

}  // namespace meshtrain::parallel
