// What the planner is asked about: a layout (how the ranks split the work), the
// workload (batch, precision, attention kernel) and the machine it runs on.
#pragma once

#include "meshtrain/mesh/parallel_dims.h"

#include <cstdint>
#include <string>

namespace meshtrain::plan {

// One way to lay a training run out on pp x dp x fsdp x ep x tp ranks (the
// trainer's mesh, tp innermost), with the memory options that go with it.
struct Layout {
  int64_t pp = 1;
  int64_t dp = 1;            // replicas
  int64_t fsdp = 1;          // shards of the ZeRO/FSDP axis (zero_stage >= 1)
  int64_t ep = 1;            // expert parallel: experts split over ep data ranks
  int64_t tp = 1;
  bool sp = false;           // sequence parallel (tp > 1)
  int zero_stage = 0;        // 0: plain data parallel; 1, 2, 3 as in the ZeRO paper
  std::string schedule = "1f1b";  // pp > 1: "gpipe" | "1f1b" | "interleaved"
  int64_t virtual_stages = 1;
  int64_t micro_batch = 1;   // sequences per forward/backward
  std::string recompute = "none";  // "none" | "selective" | "full"
  std::string offload = "none";    // "none" | "optimizer" (states on the host) | "parameters" (ZeRO-3: all on the host)

  // The degrees, sequence parallel, ZeRO stage and schedule as the layout
  // rules see them (mesh/parallel_dims.h), and back.
  mesh::ParallelDims dims() const;
  static Layout from_dims(const mesh::ParallelDims& dims, int64_t micro_batch = 1);

  int64_t world() const { return pp * dp * fsdp * ep * tp; }
  int64_t data_ranks() const { return dp * fsdp * ep; }
  int64_t expert_data_ranks() const { return dp * fsdp; }  // those that hold the same experts
  int64_t shards() const { return zero_stage > 0 ? fsdp : 1; }  // ZeRO shards over fsdp, replicates over dp (hybrid)

  // "pp=2 1f1b tp=4 sp dp=1 zero=1 fsdp=8 mb=1 recompute=selective"; parse() reads it back and
  // also accepts commas; keys: dp fsdp ep tp sp pp schedule v zero mb recompute offload.
  std::string str() const;
  // Throws std::invalid_argument naming the key or value and what is allowed.
  static Layout parse(const std::string& text);
};

// Bytes per element of each kind of state.
struct Precision {
  std::string name;
  double param = 4, grad = 4;
  double optimizer = 8;   // K of the ZeRO paper: Adam's two moments (+ fp32 master weights when mixed)
  double activation = 4;
  double mask = 4;        // dropout masks: libtorch's CPU dropout keeps a float mask; CUDA a byte
  // "fp32" (4, 4, K = 8, activations 4: how meshtrain trains on the CPU) or
  // "bf16-mixed" (2, 2, K = 12 with fp32 master weights, activations 2, masks 1: the ZeRO paper's setting).
  static Precision parse(const std::string& name);
};

struct Workload {
  int64_t global_batch = 0;  // sequences per optimizer step (0: the planner picks 8 per data rank)
  Precision precision = Precision::parse("bf16-mixed");
  // "flash": fused attention saving its output and log-sum-exp (libtorch's SDPA without dropout);
  // "math": softmax probabilities (and dropout mask and output) saved, as Korthikanti et al. assume;
  // "batched": the fused CPU attention (Note [CPU attention]): contiguous q, k, v and the softmax.
  std::string attention = "flash";
  double dropout = 0;
  bool prefetch = true;      // ZeRO-3 gathers the next unit during the current one
  // Mixture of experts: assignments the busiest rank computes per MoE layer,
  // as a multiple of tokens x top_k (training reports it as rank_load). 0: a
  // balanced router, capacity cutting it to cf when cf < 1.
  double moe_load = 0;
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
