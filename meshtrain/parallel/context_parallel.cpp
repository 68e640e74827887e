#include "meshtrain/parallel/context_parallel.h"

#include "meshtrain/parallel/ulysses_attention.h"

#include <cmath>
#include <stdexcept>

namespace meshtrain::parallel {

// Every block's attention across the cp group, on the batch's columns.
class ContextParallel::SplitAttention final : public model::Attention {
 public:
  explicit SplitAttention(const ContextParallel* owner) : owner_(owner) {}

  at::Tensor forward(const model::QkvHeads& h, const model::AttentionSpec& spec, const model::Batch& batch,
                     bool training) override {
    (void)training;  // no dropout: refused with cp
    model::AttentionSpec rule = spec;
    rule.scale = spec.scale_for(h.q.size(-1));
    TORCH_CHECK(batch.columns.defined(), "context parallel attention needs a batch cut by ContextParallel::shard");
    const at::Tensor& columns = batch.columns;
    const at::Tensor& starts = batch.documents;  // packed rows: each token's document start
    switch (owner_->impl_) {
      case mesh::ContextParallelImpl::kRing: return ring_attention(h.q, h.k, h.v, columns, owner_->cp_, rule, starts);
      case mesh::ContextParallelImpl::kAllToAll:
        return all_to_all_attention(h.q, h.k, h.v, columns, owner_->cp_, rule, starts);
      case mesh::ContextParallelImpl::kHybrid:
        return hybrid_attention(h.q, h.k, h.v, columns, owner_->a2a_comm_, owner_->ring_comm_, rule, starts);
    }
    throw std::logic_error("context parallel: unknown attention");
  }

 private:
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
  auto attention = std::make_shared<SplitAttention>(this);
  swap_ = std::make_unique<model::AttentionSwap>(*model_, [&](int64_t) { return attention; });
}

ContextParallel::~ContextParallel() = default;

at::Tensor ContextParallel::positions(int64_t length) const { return zigzag_positions(length, size(), cp_->rank()); }

model::Batch ContextParallel::shard(const model::Batch& batch) const {
  const at::Tensor columns = positions(batch.length());
  model::Batch out = batch.select(columns);
  // cp × this rank's share of the counted targets: the losses' average over cp is the whole rows' mean.
  // Both counts in one read from the device.
  const at::Tensor counts =
      at::stack({(batch.targets != model::kIgnoredTarget).sum(), (out.targets != model::kIgnoredTarget).sum()}).cpu();
  const double all = static_cast<double>(counts[0].item<int64_t>());
  const double mine = static_cast<double>(counts[1].item<int64_t>());
  if (all > 0) out.weight = batch.weight * static_cast<double>(size()) * mine / all;
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
