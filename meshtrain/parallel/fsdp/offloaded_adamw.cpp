#include "meshtrain/parallel/fsdp/offloaded_adamw.h"

#include "meshtrain/offload/host_memory.h"
#include "meshtrain/parallel/fsdp/sharded_state.h"

#include <future>

namespace meshtrain::parallel {

using offload::Tier;

OffloadedAdamW::OffloadedAdamW(ShardedState& state, Tier optimizer_tier, Tier params_tier, const std::string& nvme_dir)
    : s_(state), optimizer_tier_(optimizer_tier), params_tier_(params_tier) {
  // The rules of which tiers combine with which stage are ParallelSpec::check's.
  TORCH_INTERNAL_ASSERT(optimizer_tier != Tier::kDevice, "offloaded AdamW: the optimizer tier is the host or NVMe");
  TORCH_INTERNAL_ASSERT(params_tier == Tier::kDevice || s_.stage3(), "offloaded AdamW: parameter shards offload at stage 3 only");
  offload::StoreOptions options;
  options.nvme_dir = nvme_dir;
  const bool cuda = s_.units.front().full.is_cuda();
  options.pinned = cuda;
  store_ = std::make_shared<offload::TieredStore>(options);
  torch::NoGradGuard no_grad;
  for (Unit& unit : s_.units) {
    Entry e;
    const int64_t shard = unit.shard;
    // The parameters' elements in this rank's shard, and whether they decay.
    const int64_t begin = s_.shard_rank * shard;
    for (size_t i = 0; i < unit.params.size(); ++i) {
      const int64_t lo = std::max(begin, unit.offsets[i]);
      const int64_t hi = std::min(begin + shard, unit.offsets[i] + unit.params[i].numel());
      if (lo < hi) e.segments.push_back({lo - begin, hi - lo, decay_dims(unit.names[i], unit.params[i]) >= 2});
    }
    const at::Tensor master = unit.master.to(at::kCPU, at::kFloat).contiguous();
    e.master = store_->put(master, optimizer_tier);
    e.exp_avg = store_->allocate(shard, at::kFloat, optimizer_tier);
    e.exp_avg_sq = store_->allocate(shard, at::kFloat, optimizer_tier);
    if (optimizer_tier == Tier::kHost) {
      unit.master = store_->host(e.master);
      e.host_exp_avg = store_->host(e.exp_avg);
      e.host_exp_avg_sq = store_->host(e.exp_avg_sq);
    } else {
      unit.master = at::Tensor();
    }
    if (s_.stage3()) {
      const at::Tensor shard_values = master.to(s_.options.param_dtype);
      if (params_tier == Tier::kDevice) {
        e.param_shard = shard_values.to(unit.full.device());
      } else if (params_tier == Tier::kHost) {
        e.param_shard = offload::host_tensor(shard, s_.options.param_dtype, cuda);
        e.param_shard.copy_(shard_values);
      } else {
        e.param = store_->put(shard_values, Tier::kNvme);
      }
    }
    const bool grad_is_view = unit.grad.defined() && unit.shard_grad.is_alias_of(unit.grad);
    if (!grad_is_view) unit.shard_grad = offload::host_tensor(shard, at::kFloat, cuda);
    entries_.push_back(std::move(e));
  }
  if (optimizer_tier == Tier::kNvme) {
    // The step's double buffer of chunks and the updated master of a unit, for every step.
    int64_t largest = 0;
    for (const Unit& unit : s_.units) largest = std::max(largest, unit.shard);
    const int64_t chunk = std::min(chunk_, offload::round_up(largest, 1024));
    for (Buffers& b : nvme_buffers_) {
      b = {offload::host_tensor(chunk, at::kFloat), offload::host_tensor(chunk, at::kFloat),
           offload::host_tensor(chunk, at::kFloat)};
    }
    nvme_updated_ = offload::host_tensor(largest, at::kFloat);
  }
}

OffloadedAdamW::~OffloadedAdamW() = default;

void OffloadedAdamW::update(size_t u, float* p, const float* g, float* m, float* v, int64_t begin, int64_t end,
                            const offload::AdamWStep& s, at::BFloat16* bf16) const {
  for (const Segment& seg : entries_[u].segments) {
    const int64_t lo = std::max(begin, seg.offset), hi = std::min(end, seg.offset + seg.length);
    if (lo >= hi) continue;
    offload::AdamWStep step = s;
    if (!seg.decay) step.weight_decay = 0;
    offload::cpu_adamw(p + (lo - begin), g + (lo - begin), m + (lo - begin), v + (lo - begin), hi - lo, step,
                       bf16 != nullptr ? bf16 + lo : nullptr);
  }
}

at::BFloat16* OffloadedAdamW::bf16_parameters(size_t u) {
  Unit& unit = s_.units[u];
  at::Tensor target;
  if (!s_.stage3()) {
    target = unit.full.narrow(0, s_.shard_rank * unit.shard, unit.shard);
  } else if (params_tier_ != Tier::kNvme) {
    target = entries_[u].param_shard;
  }
  if (!target.defined() || target.scalar_type() != at::kBFloat16 || !target.device().is_cpu() || !target.is_contiguous()) {
    return nullptr;
  }
  return target.data_ptr<at::BFloat16>();
}

void OffloadedAdamW::step(double lr) {
  torch::NoGradGuard no_grad;
  ++steps_;
  for (Entry& e : entries_) e.mirror = Views();  // a checkpoint's copies are stale now
  const AdamWSettings& a = s_.options.adamw;
  const offload::AdamWStep scalars{lr, a.beta1, a.beta2, a.eps, a.weight_decay, steps_};
  for (size_t u = 0; u < s_.units.size(); ++u) {
    const at::Tensor& shard_grad = s_.units[u].shard_grad;
    const at::Tensor grad = shard_grad.device().is_cpu() ? shard_grad.contiguous() : shard_grad.to(at::kCPU);
    if (optimizer_tier_ == Tier::kHost) {
      step_host(u, grad, scalars);
    } else {
      step_nvme(u, grad, scalars);
    }
  }
}

void OffloadedAdamW::step_host(size_t u, const at::Tensor& grad, const offload::AdamWStep& s) {
  Entry& e = entries_[u];
  const at::Tensor& master = s_.units[u].master;
  // bf16 parameters on the CPU are written in the same pass (Note [CPU AdamW]).
  at::BFloat16* bf16 = bf16_parameters(u);
  update(u, master.data_ptr<float>(), grad.data_ptr<float>(), e.host_exp_avg.data_ptr<float>(),
         e.host_exp_avg_sq.data_ptr<float>(), 0, master.numel(), s, bf16);
  if (bf16 == nullptr) write_parameters(u, master);
}

// Chunk by chunk through two sets of host buffers: chunk i + 1's reads run on
// another thread while chunk i is updated and written back.
void OffloadedAdamW::step_nvme(size_t u, const at::Tensor& grad, const offload::AdamWStep& s) {
  Entry& e = entries_[u];
  const int64_t shard = s_.units[u].shard;
  const int64_t chunk = std::min(chunk_, offload::round_up(shard, 1024));
  const at::Tensor updated = nvme_updated_.narrow(0, 0, shard);
  auto read = [&](int64_t begin, Buffers& b) {
    const int64_t n = std::min(chunk, shard - begin);
    store_->read_range(e.master, begin, n, b.p);
    store_->read_range(e.exp_avg, begin, n, b.m);
    store_->read_range(e.exp_avg_sq, begin, n, b.v);
  };
  std::future<void> next = std::async(std::launch::async, read, 0, std::ref(nvme_buffers_[0]));
  for (int64_t begin = 0, i = 0; begin < shard; begin += chunk, ++i) {
    next.get();
    Buffers& b = nvme_buffers_[i % 2];
    if (begin + chunk < shard) next = std::async(std::launch::async, read, begin + chunk, std::ref(nvme_buffers_[(i + 1) % 2]));
    const int64_t n = std::min(chunk, shard - begin);
    update(u, b.p.data_ptr<float>(), grad.data_ptr<float>() + begin, b.m.data_ptr<float>(), b.v.data_ptr<float>(),
           begin, begin + n, s);
    store_->write_range(e.master, begin, n, b.p);
    store_->write_range(e.exp_avg, begin, n, b.m);
    store_->write_range(e.exp_avg_sq, begin, n, b.v);
    updated.narrow(0, begin, n).copy_(b.p.narrow(0, 0, n));
  }
  write_parameters(u, updated);
}

void OffloadedAdamW::write_parameters(size_t u, const at::Tensor& values) {
  Unit& unit = s_.units[u];
  Entry& e = entries_[u];
  if (!s_.stage3()) {
    unit.full.narrow(0, s_.shard_rank * unit.shard, unit.shard).copy_(values);
  } else if (params_tier_ == Tier::kNvme) {
    store_->write(e.param, values.to(s_.options.param_dtype));
  } else {
    e.param_shard.copy_(values);
  }
}

at::Tensor OffloadedAdamW::gather_input(size_t u) {
  Unit& unit = s_.units[u];
  Entry& e = entries_[u];
  if (params_tier_ == Tier::kNvme) {
    at::Tensor out = at::empty({unit.shard}, unit.full.options());
    store_->read(e.param, out);
    return out;
  }
  return e.param_shard.device() == unit.full.device() ? e.param_shard : e.param_shard.to(unit.full.device());
}

at::Tensor OffloadedAdamW::master_values(size_t u) {
  Unit& unit = s_.units[u];
  at::Tensor out = at::empty({unit.shard}, unit.full.options().dtype(at::kFloat));
  if (optimizer_tier_ == Tier::kHost) {
    out.copy_(unit.master);
  } else {
    store_->read(entries_[u].master, out);
  }
  return out;
}

void OffloadedAdamW::set_master_values(size_t u, const at::Tensor& values) {
  torch::NoGradGuard no_grad;
  const at::Tensor host = values.to(at::kCPU, at::kFloat).contiguous();
  if (optimizer_tier_ == Tier::kHost) {
    s_.units[u].master.copy_(host);
  } else {
    store_->write(entries_[u].master, host);
  }
  write_parameters(u, host);
}

OffloadedAdamW::Views OffloadedAdamW::views(size_t u) {
  Entry& e = entries_[u];
  if (optimizer_tier_ == Tier::kHost) return {s_.units[u].master, e.host_exp_avg, e.host_exp_avg_sq};
  const int64_t shard = s_.units[u].shard;
  e.mirror = {offload::host_tensor(shard, at::kFloat), offload::host_tensor(shard, at::kFloat),
              offload::host_tensor(shard, at::kFloat)};
  store_->read(e.master, e.mirror.master);
  store_->read(e.exp_avg, e.mirror.exp_avg);
  store_->read(e.exp_avg_sq, e.mirror.exp_avg_sq);
  return e.mirror;
}

void OffloadedAdamW::after_load() {
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < entries_.size(); ++u) {
    Entry& e = entries_[u];
    if (optimizer_tier_ == Tier::kNvme) {
      if (!e.mirror.master.defined()) views(u);  // nothing was loaded into this unit: keep what it holds
      store_->write(e.master, e.mirror.master);
      store_->write(e.exp_avg, e.mirror.exp_avg);
      store_->write(e.exp_avg_sq, e.mirror.exp_avg_sq);
      write_parameters(u, e.mirror.master);
      e.mirror = Views();
    } else {
      write_parameters(u, s_.units[u].master);
    }
  }
}

}  // namespace meshtrain::parallel
