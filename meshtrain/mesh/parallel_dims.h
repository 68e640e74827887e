// ParallelDims: how many ranks each parallelism takes, and every rule a layout
// must follow, written once. Config validation, the device mesh, the pipeline
// schedules and the planner all ask it (see Note [Layout rules]).
#pragma once

#include "meshtrain/mesh/mesh_layout.h"
#include "meshtrain/util/config_keys.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::mesh {

// A broken layout rule. `key` is the [parallel] setting at fault ("tp"),
// `value` what it was, `reason` the rule with its formula
// ("pp(3) * tp(1) = 3 does not divide the world size 4").
class LayoutError : public std::invalid_argument {
 public:
  LayoutError(std::string key, std::string value, std::string reason);
  const std::string& key() const { return key_; }
  const std::string& value() const { return value_; }
  const std::string& reason() const { return reason_; }

 private:
  std::string key_, value_, reason_;
};

// How context parallel computes attention over a sequence split across cp
// ranks: the ring (parallel/ring_attention.h), the all-to-all of heads
// (parallel/ulysses_attention.h), or all-to-all inside groups of cp_a2a
// ranks and the ring across the groups.
enum class ContextParallelImpl { kRing, kAllToAll, kHybrid };
const config::Names<ContextParallelImpl>& context_parallel_names();  // ring, all_to_all, hybrid

// The pipeline schedules (parallel/pipeline/schedule.h).
enum class PipelineSchedule { kGpipe, kOneFOneB, kInterleaved };
const config::Names<PipelineSchedule>& pipeline_schedule_names();  // gpipe, 1f1b, interleaved
const std::string& schedule_name(PipelineSchedule schedule);

// The sizes of a model that the layout rules depend on.
struct ModelDims {
  int64_t layers = 1;
  int64_t heads = 1;
  int64_t kv_heads = 1;  // grouped-query attention; = heads without it
  int64_t ffn = 1;       // the MLP's hidden size
  int64_t vocab = 1;
  int64_t context = 1;
  int64_t experts = 0;   // per mixture-of-experts block; 0: dense
};

// Note [Layout rules]
// The mesh is pp x dp x fsdp x ep x cp x tp, pp outermost and tp innermost
// (tensor parallel peers are neighbouring ranks, usually one node). The rules:
// - every degree >= 1 (dp and fsdp may be 0 before resolve(): an axis left at
//   0 takes the ranks the other leaves: all shards when zero_stage >= 1, all
//   replicas for plain data parallel);
// - pp * dp * fsdp * ep * cp * tp = the world size;
// - fsdp > 1 needs zero_stage >= 1; zero_stage 3 does not run inside a
//   pipeline (every micro-batch would gather every stage again);
// - sequence parallel needs tp > 1; tp divides heads, key/value heads, the MLP
//   hidden size and the vocabulary, and with sequence parallel the context;
// - ep > 1 needs a mixture-of-experts model whose experts it divides; the ep
//   ranks of a group read different micro-batches (data ranks are dp * fsdp *
//   ep); it combines with every zero_stage, tp and pp;
// - cp > 1 splits every sequence: the context a multiple of 2 * cp (the
//   zigzag split's 2 * cp equal chunks), and with sequence parallel its
//   context / cp rows a multiple of tp; the cp ranks of a group read the same
//   micro-batch and are data ranks for the gradient reduction (it runs over
//   dp * fsdp * ep * cp); cp_impl "all_to_all" needs the heads and key/value
//   heads of a tp rank (heads / tp) to be multiples of cp, "hybrid" those
//   multiples of cp_a2a, which divides cp, 1 < cp_a2a < cp (0: the largest
//   such); cp_a2a is for hybrid only;
// - virtual_stages > 1 needs
//   interleaved and pp >= 2; interleaved with pp >= 2 needs virtual_stages >= 2
//   (with one it is 1f1b) and micro-batches divisible by pp; pp *
//   virtual_stages <= layers (every stage needs a block); micro-batches >= 1.
struct ParallelDims {
  int64_t pp = 1;
  int64_t dp = 0;    // replicas
  int64_t fsdp = 0;  // shards (ZeRO / FSDP) per replica
  int64_t ep = 1;    // expert parallel: experts split over ep ranks, which are data ranks for the rest
  int64_t cp = 1;    // context parallel: every sequence split over cp ranks
  int64_t tp = 1;
  bool sequence_parallel = false;
  ContextParallelImpl cp_impl = ContextParallelImpl::kRing;
  int64_t cp_a2a = 0;  // hybrid: the all-to-all group's size (0: derived by check_model)
  int zero_stage = 0;  // 0: plain data parallel; 1: optimizer states sharded; 2: + gradients; 3: + parameters
  PipelineSchedule schedule = PipelineSchedule::kOneFOneB;
  int64_t virtual_stages = 1;

  // Fills dp and fsdp left at 0 so that the product is `world_size`, then
  // check()s. Throws LayoutError.
  void resolve(int64_t world_size);
  // Every rule that needs neither the model nor the micro-batch count, for a
  // resolved layout (no degree 0).
  void check() const;
  void check_model(const ModelDims& model) const;
  // The all-to-all group size of hybrid context parallel for `model`: cp_a2a,
  // or the largest divisor of cp below cp that divides heads / tp and
  // key/value heads / tp (1 when there is none; check_model refuses that).
  int64_t a2a_group(const ModelDims& model) const;
  void check_context_parallel(const ModelDims& model) const;
  void check_microbatches(int64_t microbatches) const;  // per data rank per step

  int64_t world() const { return pp * dp * fsdp * ep * cp * tp; }
  int64_t data_ranks() const { return dp * fsdp * ep; }  // ranks that read different micro-batches
  int64_t gradient_ranks() const { return dp * fsdp * ep * cp; }  // ranks whose gradients are averaged
  int64_t shards() const { return zero_stage > 0 ? fsdp : 1; }
  int64_t stages() const { return pp * virtual_stages; }
  bool pipelined() const { return pp > 1; }
  bool tensor_parallel() const { return tp > 1; }
  bool sharded() const { return zero_stage > 0; }
  bool context_parallel() const { return cp > 1; }

  // The mesh pp x dp x fsdp x ep x cp x tp over world() ranks.
  MeshLayout mesh_layout() const;
  // "pp(2) * dp(1) * fsdp(2) * ep(1) * tp(2)" (cp(N) before tp when > 1) — the formula a product error prints.
  std::string formula() const;
  // "pp=2 1f1b dp=1 fsdp=2 tp=2 sp zero=1": everything, for checkpoints and logs.
  std::string str() const;
  bool operator==(const ParallelDims& o) const;
  bool operator!=(const ParallelDims& o) const { return !(*this == o); }
};

}  // namespace meshtrain::mesh
