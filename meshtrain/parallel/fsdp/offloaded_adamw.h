// ZeRO-Offload and ZeRO-Infinity for the sharded optimizer: fp32 masters and
// AdamW moments (and at stage 3 the parameter shards) in the host or NVMe
// tier, the step run on the CPU. See Note [Offloaded optimizer].
#pragma once

#include "meshtrain/offload/cpu_adam.h"
#include "meshtrain/offload/tiered_store.h"
#include "meshtrain/parallel/adamw.h"

#include <ATen/ATen.h>

#include <memory>
#include <vector>

namespace meshtrain::parallel {

struct ShardedState;
struct Unit;

// Note [Offloaded optimizer]
// With [offload] optimizer = "cpu" or "nvme" each unit's fp32 master shard
// and its two AdamW moments live in that tier instead of on the device (12
// bytes per owned element: 12Ψ/N off each rank), and the shard gradient is
// kept in host memory: stages 2 and 3 fold each reduced unit into it as
// backward produces them, so gradients stream out while backward runs. The
// step is the fused CPU AdamW (offload/cpu_adam.h) over each unit's shard:
// in place on host memory, or for NVMe streamed through two host buffers in
// chunks, the next chunk's read overlapping this one's update and write.
// The updated parameters then stream back in the compute dtype: into the
// device's full buffer at stages 1 and 2 (then gathered as before), into the
// unit's parameter shard at stage 3, which stays on the device, or with
// [offload] params = "cpu" | "nvme" lives in that tier too and is read just
// before the unit's gather. Updates are never delayed: the step of step k
// uses step k's gradients, so losses equal the resident optimizer's.
class OffloadedAdamW {
 public:
  // Moves every unit's master (and the moments, zero) into `optimizer_tier`;
  // unit.master becomes a host tensor (cpu) or undefined (nvme), unit.shard_grad
  // a host tensor where it is not a view of the full gradient.
  OffloadedAdamW(ShardedState& state, offload::Tier optimizer_tier, offload::Tier params_tier,
                 const std::string& nvme_dir);
  ~OffloadedAdamW();

  // AdamW at `lr` over every unit, then the parameters written back.
  void step(double lr);
  void set_steps(int64_t steps) { steps_ = steps; }

  // What a stage-3 gather of unit u reads: its parameter shard on the device
  // (read from NVMe into a fresh tensor when it lives there).
  at::Tensor gather_input(size_t u);
  // Unit u's fp32 master shard on the device (a copy), and setting it (the
  // parameters follow).
  at::Tensor master_values(size_t u);
  void set_master_values(size_t u, const at::Tensor& values);

  // For checkpoints: unit u's master and moments as host tensors [shard], the
  // live ones in the host tier, copies read now from NVMe. after_load()
  // writes loaded copies back and re-derives the parameters.
  struct Views {
    at::Tensor master, exp_avg, exp_avg_sq;
  };
  Views views(size_t u);
  void after_load();

  offload::Tier optimizer_tier() const { return optimizer_tier_; }
  offload::Tier params_tier() const { return params_tier_; }

 private:
  struct Segment {
    int64_t offset, length;  // in the shard
    bool decay;
  };
  struct Entry {
    offload::TieredStore::Id master = 0, exp_avg = 0, exp_avg_sq = 0, param = 0;
    at::Tensor host_exp_avg, host_exp_avg_sq;  // host tier
    at::Tensor param_shard;                    // stage 3, params on the device or in host memory
    std::vector<Segment> segments;             // the parameters' elements (no padding), with their decay
    Views mirror;                              // NVMe: copies handed to a checkpoint
  };
  void step_host(size_t u, const at::Tensor& grad, const offload::AdamWStep& s);
  void step_nvme(size_t u, const at::Tensor& grad, const offload::AdamWStep& s);
  // The updated fp32 master `values` (host, [shard]) to the unit's parameters.
  void write_parameters(size_t u, const at::Tensor& values);
  // AdamW over elements [begin, end) of unit u's shard, the pointers at
  // element `begin`; `bf16` (at element 0, or null) gets the bf16 parameters.
  void update(size_t u, float* p, const float* g, float* m, float* v, int64_t begin, int64_t end,
              const offload::AdamWStep& s, at::BFloat16* bf16 = nullptr) const;
  // Where unit u's parameters in the compute dtype are, when that is bf16 in
  // CPU memory the step can write in its own pass (else null).
  at::BFloat16* bf16_parameters(size_t u);

  struct Buffers {
    at::Tensor p, m, v;  // a chunk of the master and the moments
  };

  ShardedState& s_;
  offload::Tier optimizer_tier_, params_tier_;
  std::shared_ptr<offload::TieredStore> store_;
  std::vector<Entry> entries_;
  int64_t steps_ = 0;
  int64_t chunk_ = int64_t{1} << 20;  // elements per NVMe chunk
  Buffers nvme_buffers_[2];           // NVMe: host memory the step streams through
  at::Tensor nvme_updated_;           // NVMe: the updated master of one unit (the largest shard)
};

}  // namespace meshtrain::parallel
