// ParallelSpec: every knob of a run's parallelism — the degrees and their
// layout rules (mesh/parallel_dims.h) plus how each technique is run — typed,
// read from the [parallel] and [offload] sections once, and checked in one
// place. The trainer, parallelize() and the planner all take it. See Note
// [Parallel spec].
#pragma once

#include "meshtrain/mesh/parallel_dims.h"
#include "meshtrain/model/gpt_config.h"
#include "meshtrain/offload/tier.h"
#include "meshtrain/util/config_keys.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace meshtrain::parallel {

// Activation checkpointing (activation_checkpoint.h).
enum class CheckpointMode {
  kNone,
  kFull,       // the whole block: only its input is kept
  kSelective,  // attention proper (attn.core): its input, qkv's output, is kept
};
// ZeRO's units (fully_sharded.h): one per transformer block (+ the root), or the whole model.
enum class ShardUnits { kBlock, kModel };
// ZeRO-1's gradient reduction: full all-reduce then read the shard, or reduce-scatter into a shard buffer.
enum class Zero1Reduce { kAllReduce, kReduceScatter };
// Tensor parallel: the hand-written Megatron layers (tensor_parallel.h), or
// weights annotated and the rest placed by the sharding rules (annotated_tensor_parallel.h).
enum class TensorParallelImpl { kPlan, kAnnotations };

const config::Names<CheckpointMode>& checkpoint_mode_names();      // none, full, selective
const config::Names<ShardUnits>& shard_unit_names();               // block, model
const config::Names<Zero1Reduce>& zero1_reduce_names();            // all_reduce, reduce_scatter
const config::Names<TensorParallelImpl>& tensor_parallel_names();  // plan, annotations
const config::Names<offload::Tier>& offload_tier_names();          // none, cpu, nvme
const config::Names<at::ScalarType>& state_dtype_names();          // float32, bfloat16

// How the blocks are cut into pipeline stages: balancing parameter counts,
// balancing times measured at start, or given counts per stage ("3,3,2").
struct StageSplit {
  enum class Kind { kParams, kTime, kBlocks };
  Kind kind = Kind::kParams;
  std::vector<int64_t> blocks;  // kBlocks: per stage

  // "params", "time" or counts like "3,3,2"; throws config::ConfigError naming `key`.
  static StageSplit parse(const std::string& text, const std::string& key);
  std::string str() const;
};

// What the computation runs in and on, for the rules that depend on it.
struct Compute {
  bool bfloat16 = false;  // training.dtype = "bfloat16" (autocast of matmuls)
  bool cpu = true;        // run.device
};

// A number of the one-line form (ParallelSpec::parse): a whole number >= 1,
// or std::invalid_argument("layout KEY=VALUE: needs a whole number >= 1").
int64_t layout_number(const std::string& key, const std::string& value);

// The sizes of `config` the layout rules check (mesh/parallel_dims.h).
mesh::ModelDims model_dims(const model::GptConfig& config);

// Note [Parallel spec]
// One value describes how a run is split: ParallelDims (the degrees pp, dp,
// fsdp, ep, tp, sequence parallel, ZeRO stage, schedule, virtual stages) and
// the options of each technique, typed. It is read from TOML through keys()
// (enumerations by name, Note [Config keys]), checked once by check() — the
// layout rules of Note [Layout rules], then every rule between the knobs:
// pipeline split, checkpointing, ZeRO dtypes, offload, annotations — and then
// handed as it is to parallelize() (parallelize.h), which reads each
// technique's options from it, and to the planner (plan/layout.h: a spec plus
// a micro-batch), which checks candidate layouts with the same check(). str()
// and parse() are the one-line form `meshtrain plan --layout` reads.
struct ParallelSpec {
  mesh::ParallelDims dims;
  // Micro-batches per data rank per step (0: training.batch / (micro_batch x data ranks)).
  int64_t microbatches = 0;
  StageSplit pp_split;
  CheckpointMode activation_checkpoint = CheckpointMode::kNone;
  int64_t activation_checkpoint_every = 1;  // every k-th block
  // Data parallel (zero_stage 0): gradient all-reduce buckets.
  int64_t bucket_mb = 25;
  int64_t first_bucket_mb = 1;  // the last layers' gradients: small, so communication starts early in backward
  // ZeRO / FSDP (zero_stage >= 1).
  ShardUnits unit_policy = ShardUnits::kBlock;
  bool prefetch = true;               // zero_stage 3: gather the next unit during this one
  bool reshard_after_forward = true;  // zero_stage 3: free a unit's parameters after its forward
  at::ScalarType param_dtype = at::kFloat;   // what forward/backward compute in (fp32 master shards)
  at::ScalarType reduce_dtype = at::kFloat;  // what gradients are reduced in
  Zero1Reduce zero1_reduce = Zero1Reduce::kAllReduce;
  TensorParallelImpl tp_impl = TensorParallelImpl::kPlan;
  // ZeRO-Offload / ZeRO-Infinity (parallel/fsdp/offloaded_adamw.h): kDevice is "none".
  offload::Tier offload_optimizer = offload::Tier::kDevice;
  offload::Tier offload_params = offload::Tier::kDevice;
  std::string offload_nvme_dir;  // the nvme tier's folder; empty: <run.out>/nvme in training, /tmp otherwise

  // Every [parallel] and [offload] key, with its help line.
  static const std::vector<config::Key<ParallelSpec>>& keys();

  // Resolves dp and fsdp left at 0 for `world` ranks, then checks every rule
  // against each other, the model and `compute`. Throws config::ConfigError
  // naming the key, its value and the rule with its formula.
  void check(int64_t world, const model::GptConfig& model, const Compute& compute = {});
  // The same for a model known by the sizes the rules read.
  void check(int64_t world, const mesh::ModelDims& model, const Compute& compute = {});
  // The micro-batch and the micro-batches per data rank for a global batch of
  // `batch` sequences: `micro_batch` as given, or batch / (microbatches x
  // data ranks) when microbatches is set. Needs a resolved spec; throws
  // config::ConfigError with the formula when they do not divide.
  struct BatchShape {
    int64_t micro_batch = 1;
    int64_t microbatches = 1;
  };
  BatchShape batch_shape(int64_t batch, int64_t micro_batch) const;
  // The rules on the micro-batches per data rank per step (the pipeline's m).
  void check_microbatches(int64_t microbatches) const;
  // Note [Inference layout]
  // generate and serve read the same parallel.* keys as train, and this
  // checks them for `command` on `world` ranks: every rank of the job splits
  // the model (tp: tensor parallel, the Megatron layers of training) or,
  // generating, the KV cache (cp: Note [Context-parallel generation]), not
  // both, and no other degree is set; dp and fsdp resolve to 1. The model's
  // rules (tp divides heads, key/value heads, MLP and vocabulary) are
  // training's, checked when the checkpoint is loaded
  // (check_tensor_parallel). Throws config::ConfigError naming the key and
  // the command to type.
  void check_inference(int64_t world, const std::string& command);

  bool offloaded() const { return offload_optimizer != offload::Tier::kDevice; }
  bool annotated() const { return tp_impl == TensorParallelImpl::kAnnotations; }
  // The nvme tier's folder for a run writing to `out`.
  std::string nvme_dir(const std::string& out) const { return offload_nvme_dir.empty() ? out + "/nvme" : offload_nvme_dir; }

  // "pp=2 1f1b tp=4 sp zero=1 fsdp=8 recompute=selective offload=optimizer": the
  // degrees and options that differ from one rank of plain data parallel, in
  // the keys parse() reads; with micro_batch > 0, "mb=N" before recompute.
  std::string str(int64_t micro_batch = 0) const;
  // Keys a caller of parse() reads beside the spec's own (the planner's mb).
  struct OtherKeys {
    std::vector<std::string> names;
    std::function<void(const std::string& key, const std::string& value)> set;
  };
  // The one-line form: items key=value separated by spaces or commas; keys dp
  // fsdp ep tp sp pp schedule (or gpipe, 1f1b, interleaved alone) v zero
  // recompute offload (optimizer | parameters: on the host). Degrees not given
  // are 1; "zero=3 dp=8" means eight shards, as ZeRO speaks of them. Throws
  // std::invalid_argument naming the item.
  static ParallelSpec parse(const std::string& text, const OtherKeys& other = {});
};

}  // namespace meshtrain::parallel
