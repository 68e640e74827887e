#include "meshtrain/parallel/context_parallel.h"

#include "meshtrain/parallel/ulysses_attention.h"

#include <cmath>
#include <stdexcept>

namespace meshtrain::parallel {

namespace {

constexpr int64_t kIgnored = -100;  // a target that counts toward no loss (train/data.h)

const std::string kCore = ".attn.core";

bool is_core(const std::string& module) {
  return module.size() > kCore.size() && module.compare(module.size() - kCore.size(), kCore.size(), kCore) == 0;
}

}  // namespace

std::optional<CoreCall> attention_core(model::GptImpl& model, const std::string& module, const at::Tensor& input) {
  if (!is_core(module)) return std::nullopt;
  const int64_t block = std::stoll(module.substr(module.find('.') + 1));  // "blocks.N.attn.core"
  const model::CausalSelfAttentionImpl& attn = *model.blocks->ptr(block)->as<model::BlockImpl>()->attn;
  model::QkvHeads h = attn.heads(input);
  const model::AttentionVariant variant = attn.variant();
  const AttentionRule rule{variant.scale > 0 ? variant.scale : 1.0 / std::sqrt(static_cast<double>(h.q.size(-1))),
                           /*causal=*/true, variant.window, variant.softcap};
  return CoreCall{block, std::move(h), rule};
}

// Replaces every block's attention core with attention across the cp group.
class ContextParallel::Hooks : public model::ForwardHooks {
 public:
  Hooks(model::GptImpl* model, const ContextParallel* owner) : model_(model), owner_(owner) {}

  at::Tensor around(const std::string& module, const at::Tensor& input, const Forward& forward) override {
    const std::optional<CoreCall> call = attention_core(*model_, module, input);
    if (!call) return forward(input);
    const model::QkvHeads& h = call->heads;
    const AttentionRule& rule = call->rule;
    const int64_t b = input.size(0), t = input.size(1);
    const at::Tensor rows = owner_->positions(t * owner_->size());
    // Packed rows: each row's document start, its global position less its position in its document.
    const at::Tensor& in_document = model::document_positions();
    const at::Tensor starts = owner_->packed_ && in_document.defined()
                                  ? rows.to(in_document.device()).unsqueeze(0) - in_document
                                  : at::Tensor();
    at::Tensor y;
    switch (owner_->impl_) {
      case mesh::ContextParallelImpl::kRing:
        y = ring_attention(h.q, h.k, h.v, rows, owner_->cp_, rule, starts);
        break;
      case mesh::ContextParallelImpl::kAllToAll:
        y = all_to_all_attention(h.q, h.k, h.v, rows, owner_->cp_, rule, starts);
        break;
      case mesh::ContextParallelImpl::kHybrid:
        y = hybrid_attention(h.q, h.k, h.v, rows, owner_->a2a_comm_, owner_->ring_comm_, rule, starts);
        break;
    }
    return y.transpose(1, 2).reshape({b, t, -1});
  }

 private:
  model::GptImpl* model_;
  const ContextParallel* owner_;
};

ContextParallel::ContextParallel(model::Gpt model, std::shared_ptr<comm::Communicator> cp,
                                 mesh::ContextParallelImpl impl, int64_t a2a)
    : model_(std::move(model)), cp_(std::move(cp)), impl_(impl), a2a_(a2a) {
  if (model_->config().dropout > 0) {
    throw std::invalid_argument("context parallel computes attention without dropout; model.dropout must be 0");
  }
  if (impl_ == mesh::ContextParallelImpl::kHybrid) {
    const int r = cp_->rank(), a = static_cast<int>(a2a_);
    a2a_comm_ = cp_->split(r / a, r, cp_->name() + ":a2a");
    ring_comm_ = cp_->split(r % a, r, cp_->name() + ":ring");
  }
  hooks_ = std::make_shared<Hooks>(model_.get(), this);
  model_->add_forward_hooks(hooks_);
}

ContextParallel::~ContextParallel() { model_->remove_forward_hooks(hooks_.get()); }

at::Tensor ContextParallel::positions(int64_t length) const { return zigzag_positions(length, size(), cp_->rank()); }

ContextParallel::Rows ContextParallel::rows(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                                            const std::vector<double>& weights,
                                            const std::vector<at::Tensor>& documents) {
  packed_ = !documents.empty();
  Rows out;
  const double cp = static_cast<double>(size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t b = inputs[i].size(0), t = inputs[i].size(1);
    const at::Tensor rows = positions(t).to(inputs[i].device());
    const at::Tensor y = targets[i].index_select(1, rows);
    // cp × this rank's share of the counted targets: the losses' average over cp is the whole rows' mean.
    // Both counts in one read from the device.
    const at::Tensor counts = at::stack({(targets[i] != kIgnored).sum(), (y != kIgnored).sum()}).cpu();
    const double all = static_cast<double>(counts[0].item<int64_t>()), mine = static_cast<double>(counts[1].item<int64_t>());
    out.inputs.push_back(inputs[i].index_select(1, rows));
    out.targets.push_back(y);
    out.weights.push_back(all > 0 ? weights[i] * cp * mine / all : weights[i]);
    // Packed rows: positions inside each document (RoPE rotates by them; attention finds the documents' starts).
    out.positions.push_back(documents.empty() ? rows.unsqueeze(0).expand({b, rows.size(0)}).contiguous()
                                              : documents[i].index_select(1, rows));
  }
  return out;
}

std::string ContextParallel::describe() const {
  std::string text = "context parallel cp(" + std::to_string(size()) + "), ";
  switch (impl_) {
    case mesh::ContextParallelImpl::kRing: return text + "ring attention, zigzag split";
    case mesh::ContextParallelImpl::kAllToAll: return text + "all-to-all attention, zigzag split";
    case mesh::ContextParallelImpl::kHybrid:
      return text + "all-to-all in groups of " + std::to_string(a2a_) + ", ring across " +
             std::to_string(size() / a2a_) + ", zigzag split";
  }
  return text;
}

}  // namespace meshtrain::parallel
