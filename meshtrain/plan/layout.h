// What the planner is asked about: a layout (how the ranks split the work), the
// workload (batch, precision, attention kernel) and the machine it runs on.
#pragma once

#include "meshtrain/model/lora.h"
#include "meshtrain/plan/operator_time.h"
#include "meshtrain/parallel/parallel_spec.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace meshtrain::plan {

// One way to lay a training run out: a ParallelSpec (the degrees of the
// trainer's mesh pp x dp x fsdp x ep x cp x tp, tp innermost, and the techniques'
// options: recompute, offload) plus the micro-batch. Degrees are explicit
// (dp and fsdp 1 unless given).
struct Layout : parallel::ParallelSpec {
  int64_t micro_batch = 1;  // sequences per forward/backward

  Layout() { dims.dp = dims.fsdp = 1; }
  Layout(const parallel::ParallelSpec& spec, int64_t micro_batch) : parallel::ParallelSpec(spec), micro_batch(micro_batch) {}

  int64_t world() const { return dims.world(); }
  int64_t data_ranks() const { return dims.data_ranks(); }
  int64_t expert_data_ranks() const { return dims.dp * dims.fsdp; }  // those that hold the same experts
  int64_t shards() const { return dims.shards(); }  // ZeRO shards over fsdp, replicates over dp (hybrid)

  // "pp=2 1f1b tp=4 sp dp=1 zero=1 fsdp=8 mb=1 recompute=selective": ParallelSpec::str() with the
  // micro-batch; parse() reads it back (ParallelSpec::parse's keys and mb).
  std::string str() const { return parallel::ParallelSpec::str(micro_batch); }
  // Throws std::invalid_argument naming the key or value and what is allowed.
  static Layout parse(const std::string& text);
};

// Bytes per element of each kind of state.
struct Precision {
  std::string name;
  double param = 4, grad = 4;
  double optimizer = 8;   // K of the ZeRO paper: Adam's two moments (+ fp32 master weights when mixed)
  double activation = 4;
  double residual = 4;    // the residual stream: a norm's input, a block's input, what a pipeline stage sends
  double weight_copy = 0; // a 16-bit copy of each matrix autocast casts, kept from forward to backward
  double mask = 4;        // dropout masks: libtorch's CPU dropout keeps a float mask; CUDA a byte
  // "fp32" (4, 4, K = 8, activations 4: how meshtrain trains on the CPU),
  // "bf16-mixed" (2, 2, K = 12 with fp32 master weights, activations 2, masks 1: the ZeRO paper's setting) or
  // "bf16-autocast" (4, 4, K = 8, the products' activations 2, the residual stream 4, weight copies 2:
  // what `train` does with training.dtype = "bfloat16").
  static Precision parse(const std::string& name);
  bool bf16() const { return activation < 4; }  // the products run in bfloat16 (bf16-mixed, bf16-autocast)
};

// What selective recompute keeps (recompute=selective). kCore: meshtrain's
// trainer, which recomputes each block's attention core from the qkv
// projection's output (Note [Activation checkpointing]). kOps: op-level
// selective checkpointing as torchtitan applies it (Note [Op-level recompute]);
// a planner option for comparing with runs that use it, which meshtrain's
// trainer does not.
enum class SelectivePolicy { kCore, kOps };

struct Workload {
  int64_t global_batch = 0;  // sequences per optimizer step (0: the planner picks 8 per data rank)
  Precision precision = Precision::parse("bf16-mixed");
  // "flash": fused attention saving its output and log-sum-exp (libtorch's SDPA without dropout);
  // "math": softmax probabilities (and dropout mask and output) saved, as Korthikanti et al. assume;
  // "batched": the fused CPU attention (Note [CPU attention]): contiguous q, k, v and the softmax.
  std::string attention = "flash";
  // The loss through the fused CPU kernel (model.fused on the CPU): it keeps
  // the logits and a log-sum-exp per row, no fp32 log-softmax.
  bool fused_loss = false;
  // The chunked loss (Note [Chunked loss]; model.chunked_loss, on by
  // default): no logits beyond one chunk; dh and dW made in the forward and
  // kept to the backward, or made in the backward where a pipeline schedule
  // holds several losses at once.
  bool chunked_loss = true;
  // With the whole logits split over the vocabulary (tensor parallel): PyTorch's
  // loss_parallel, as torchtitan trains (Note [PyTorch's loss_parallel] in
  // activation_memory.cpp), in place of meshtrain's own vocabulary-parallel
  // loss. For comparing with such runs; train does not run it.
  bool torch_loss_parallel = false;
  // ZeRO-2 under a pipeline as FSDP2 under torch.distributed.pipelining runs
  // it (torchtitan): gradient sync is off for every micro-batch and the
  // reduction runs after the last backward, so each parameter's unsharded
  // gradient accumulates in the reduce dtype (fp32) from its chunk's first
  // backward, beside the parameters kept gathered; and the last stage keeps
  // every micro-batch's output (peak_of_rank in memory_model.cpp). For
  // comparing with such runs; train does not run it.
  bool torch_pipeline_fsdp = false;
  // Its chunks' fp32 logits at most (model::loss_chunk_bytes: 256 MiB, 1 GiB on a GPU).
  double loss_chunk_bytes = 256.0 * (1 << 20);
  // The fused CPU operators run (model.fused, on the CPU, on plain tensors).
  // Elsewhere (a GPU, sharding annotations, model.fused off) the model takes
  // ATen's operators: SwiGLU keeps four hidden-sized tensors, not three, and
  // QK-norm is the plain norm. The planner reads its model's `fused` as this.
  bool fused_ops = true;
  // Norms through kernels that keep fp32 statistics beside their input (the
  // fused CPU ones, ATen's layer_norm, ATen's rms_norm on a GPU); false: the
  // CPU's RMSNorm of composed operators, which keeps the normalised input too.
  bool norm_kernels = true;
  // The devices are GPUs (set_device_operators): with fp32 products or a
  // window ATen's attention there takes grouped keys and values repeated per
  // query head and keeps the copies (Note [Grouped queries in SDPA]).
  bool gpu = false;
  // Attention's inputs are bfloat16 under any precision (bfloat16 parameters).
  bool bf16_attention = false;
  double dropout = 0;
  SelectivePolicy selective = SelectivePolicy::kCore;
  bool prefetch = true;      // ZeRO-3 gathers the next unit during the current one
  // Mixture of experts: assignments the busiest rank computes per MoE layer
  // under expert parallel, as a multiple of tokens x top_k (training reports
  // it as rank_load). 0: a balanced router, capacity cutting it to cf when
  // cf < 1. `moe_kept`: the share of assignments capacity keeps (training's
  // 1 - dropped), what a rank without expert parallel computes of its own; 0:
  // as the load says (rank_moe_load). `moe_load_by_ep`: training's
  // rank_load_by_ep, the load at each degree; where it names one, it holds.
  double moe_load = 0, moe_kept = 0;
  std::vector<std::pair<int64_t, double>> moe_load_by_ep;
  // LoRA (rank > 0): the model frozen, adapters beside it; only they take
  // gradients and optimizer states.
  model::LoraConfig lora;
};

// A device and its links; `meshtrain plan --calibrate` measures one for this machine.
struct Machine {
  std::string name = "h100";
  double peak_flops = 989e12;       // per device, dense, in the precision trained
  double mfu = 0.45;                // share of the peak a step achieves on its FLOPs
  double intra_bandwidth = 360e9;   // bus bandwidth of a collective inside a node, bytes/s
  double inter_bandwidth = 45e9;    // ... across nodes, per device
  double latency = 10e-6;           // per collective step, seconds
  double host_bandwidth = 25e9;     // device <-> host (offload), bytes/s
  int64_t devices_per_node = 8;
  // A CPU's cores its ranks share (Note [Shared cores]); 0: devices of their own.
  int64_t cores_per_node = 0;
  // What a blocking collective costs beyond its transfer while the ranks
  // compute between collectives (measured under load by --calibrate: where
  // ranks share cores, a peer that is not running is waited for); seconds.
  double sync = 0;
  // Each operator class's measured rate (Note [Operator time]); unmeasured:
  // a step is its FLOPs at peak_flops x mfu.
  OperatorRates operators;
  double device_memory = 80.0 * (int64_t{1} << 30);

  std::string to_json() const;
  // Throws std::invalid_argument naming the missing or bad field.
  static Machine from_json(const std::string& text);
};

// "80GiB", "80GB", "512MiB", "64K" (K, M, G are binary), "1.5TiB", plain bytes.
// Throws std::invalid_argument.
double parse_bytes(const std::string& text);
std::string format_bytes(double bytes);  // "12.3 GiB", "512.0 MiB"

}  // namespace meshtrain::plan
