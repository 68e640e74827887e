// Memory of one training step, per rank and per term, for any layout. See
// Note [Memory model].
#pragma once

#include "meshtrain/plan/layout.h"
#include "meshtrain/model/gpt_config.h"

#include <string>
#include <vector>

namespace meshtrain::plan {

// Note [Memory model]
// A rank's memory at the peak of a step is its model states plus whatever the
// step holds at its fullest moment:
//   model states  parameters P·Ψ, gradients G·Ψ, optimizer states K·Ψ, with Ψ
//                 the parameters this rank holds (its pipeline stages' blocks,
//                 tensor-parallel matrices divided by tp) and ZeRO dividing
//                 optimizer states (stage 1), + gradients (2), + parameters (3)
//                 over the fsdp shards (Rajbhandari et al. 2020, Fig. 1:
//                 (2 + 2 + K)Ψ with K = 12 for mixed-precision Adam).
//                 Expert parallel divides a MoE block's experts by ep.
//   activations   what each transformer layer saves for backward, per
//                 micro-batch (Korthikanti et al. 2022, Eq. 1-6: sbh(34 +
//                 5as/h) in 16-bit with dropout and unfused attention; tensor
//                 parallel divides the head- and MLP-sized parts, sequence
//                 parallel the rest; selective recompute drops the attention
//                 core, full recompute keeps only each layer's input), times
//                 the layers of a stage, for every stage whose forward has run
//                 and whose backward has not: one without a pipeline, with
//                 one as many as the schedule leaves (GPipe m, 1F1B p - r;
//                 Narayanan et al. 2021, Sec. 2.2). A MoE layer saves, in
//                 place of the MLP's hidden tensors, the router's fp32
//                 logits and probabilities, and for each of its A = tokens ·
//                 top_k (· cf when cf < 1) assignments the expert's input,
//                 hidden tensors and output, and the index and gate vectors
//                 of dispatch and combine; a balanced router is assumed (cf
//                 bounds what one rank receives to tokens · top_k · cf).
//                 Context parallel divides every token count by cp (a rank
//                 holds s/cp rows of each sequence), and its attention core
//                 saves what the cp implementation keeps: the ring its fp32
//                 output and log-sum-exp (scores are recomputed in backward);
//                 all-to-all the gathered fp32 q, k, v in position order and
//                 the flash kernel's output and log-sum-exp (no softmax is
//                 kept; a sliding window's s x s mask, as floats, is);
//                 hybrid the gathered q, k, v and the ring's.
//   moments       the rank's schedule (a pipeline's, or one micro-batch
//                 after another) is walked action by action, and the peak is
//                 the fullest of: the end of a forward on the last stage
//                 (logits and the fp32 log-softmax), the loss's backward
//                 (three vocabulary-sized fp32 tensors, two with the
//                 vocabulary-parallel loss), a stage's backward (the gradient
//                 work space of a layer, the recomputed layer under full
//                 recompute, and under ZeRO-3 the gathered unit and its full
//                 gradient), the embedding's backward (its dense gradient,
//                 beside a tied head's gradient, which waits in autograd's
//                 buffer from the loss's backward), and the optimizer step
//                 (AdamW's per-tensor temporaries, or two gathered units
//                 under ZeRO).
//   precision     bytes per element of each state and activation. Under
//                 bfloat16 autocast (bf16-autocast, train's
//                 training.dtype = "bfloat16") the states stay fp32, the
//                 products' outputs and saved inputs are 16-bit, the residual
//                 stream (a norm's input, a block's input, a stage's send) is
//                 fp32, and each block keeps a 16-bit copy of its matrices
//                 until its backward (under full recompute, autocast's cache
//                 holds them to the forward's end).
//   buffers       pipeline sends are kept until the step ends (one boundary
//                 activation or gradient each); ZeRO-3 gathered units.
// Every term follows what meshtrain's own modules save, so the prediction is
// checked against the counting allocator on runs here (tests/plan).

// Options of one layer's activation memory.
struct ActivationOptions {
  int64_t micro_batch = 1;
  int64_t tp = 1;
  bool sp = false;
  int64_t cp = 1;
  mesh::ContextParallelImpl cp_impl = mesh::ContextParallelImpl::kRing;
  parallel::CheckpointMode recompute = parallel::CheckpointMode::kNone;
  std::string attention = "flash";
  double dropout = 0;
  Precision precision = Precision::parse("bf16-mixed");
  double moe_load = 0;  // Workload::moe_load
  SelectivePolicy selective = SelectivePolicy::kCore;  // with recompute = kSelective
  bool norm_kernels = true;                            // Workload::norm_kernels
  bool lora = false;                                   // LoRA: the base products frozen (ATen's, not the fused linear)
  bool bf16_attention = false;                         // Workload::bf16_attention
  bool fused_ops = false;                              // Workload::fused_ops: the CPU's fused operators run
  // The share of blocks whose SDPA keeps k and v repeated per query head
  // (model::sdpa_takes_groups false: fp32 or a window on a GPU).
  double repeated_kv = 0;
};

// Note [Op-level recompute]
// torchtitan's op-level selective checkpointing (its "op" option) wraps each
// transformer block in a checkpoint whose policy, per op of the forward,
// keeps the outputs of the attention kernel (output and log-sum-exp), of
// reduce-scatters, and of every other matrix product (aten.mm: the 1st, 3rd,
// ... of the block, counted afresh in each block), and recomputes everything
// else: norms, RoPE, activations, the even products. A Llama block runs q, k,
// v, o, then gate, up, down, so it keeps q, v, gate and down and recomputes k,
// o and up. A product with a bias runs as addmm, which the policy neither
// counts nor keeps; a MoE block's router and grouped expert products are
// recomputed too (only a shared expert's products count). Under tensor
// parallel a column-parallel product's output is split; a row-parallel one's
// (o, down) is the whole partial sum, and with sequence parallel its
// reduce-scattered result is kept as well. The block's input is kept by the
// checkpoint. In a block's backward the recompute makes what the block would
// have saved without recompute, less what was kept.

// One matrix product of a block in forward order, as op-level recompute sees
// it: `in` x `out` per token and assignment (`times` assignments per token:
// top_k for routed experts), whether tensor parallel splits its output
// (column) or sums it (row), and whether the policy keeps its output. A MoE
// block's router and routed experts say so (the operator time splits the
// experts' products over the rank's experts, and leaves the router whole).
struct BlockProduct {
  double in = 0, out = 0, times = 1;
  bool row_parallel = false, kept = false;
  bool router = false, expert = false;
};
std::vector<BlockProduct> op_level_products(const model::GptConfig& model, bool moe);

// Whether `l` recomputes op-level: selective recompute with `w`'s kOps policy.
inline bool op_level_recompute(const Layout& l, const Workload& w) {
  return l.activation_checkpoint == parallel::CheckpointMode::kSelective && w.selective == SelectivePolicy::kOps;
}

// Of cp's ranks, how many exchange heads by all-to-all: cp (all_to_all), the
// hybrid group (its ring over cp / that), or 1 (the ring alone, or no cp).
inline int64_t all_to_all_group(const model::GptConfig& model, const Layout& l) {
  if (l.dims.cp == 1) return 1;
  switch (l.dims.cp_impl) {
    case mesh::ContextParallelImpl::kAllToAll: return l.dims.cp;
    case mesh::ContextParallelImpl::kHybrid: return l.dims.a2a_group(parallel::model_dims(model));
    case mesh::ContextParallelImpl::kRing: break;
  }
  return 1;
}

// (token, expert) assignments one MoE layer computes for `tokens` tokens:
// tokens x top_k x `load`, or with load 0 (a balanced router) x min(1, cf).
double assignments(const model::GptConfig& model, double tokens, double load = 0);

// The load a rank computes at expert parallel degree `ep`: training's measure
// at that degree (`w.moe_load_by_ep`) where it has one; else `w.moe_load`
// where ep > 1; at ep = 1 a rank computes only what capacity keeps of its own
// tokens' assignments: `w.moe_kept` where known, else the load but at most
// the balanced count (min(1, cf)). 0 stays 0 (a balanced router).
double rank_moe_load(const model::GptConfig& model, const Workload& w, int64_t ep);

// Bytes one transformer layer keeps for its backward, per micro-batch
// (`moe`: a mixture-of-experts block, with its expert parallel degree `ep`).
double layer_activation_bytes(const model::GptConfig& model, const ActivationOptions& options, bool moe = false,
                              int64_t ep = 1);

// One rank's memory at its peak, by term (bytes).
struct MemoryBreakdown {
  double parameters = 0;
  double gradients = 0;
  double optimizer = 0;    // Adam moments (+ fp32 master weights with mixed precision)
  double activations = 0;  // saved for backward, over the micro-batches in flight
  double outputs = 0;      // logits, loss and their gradients at the peak
  double buffers = 0;      // communication: gathered ZeRO-3 units, pipeline sends
  double workspace = 0;    // transient: gradients inside a layer's backward, a recomputed layer, optimizer temporaries
  double host = 0;         // offloaded states, in host memory
  std::string moment;      // when the peak happens: "forward end", "loss backward", "layer backward", "embedding backward", "optimizer step"

  double model_states() const { return parameters + gradients + optimizer; }
  double total() const { return model_states() + activations + outputs + buffers + workspace; }
};

// One pipeline rank (all data and tensor ranks of it look alike).
struct RankMemory {
  int pipeline_rank = 0;
  int64_t layers = 0;       // transformer blocks held
  int64_t moe_layers = 0;   // of those, mixture-of-experts blocks
  int64_t in_flight = 0;    // most micro-batch stages stashed at once
  bool loss_in_backward = false;  // the chunked loss makes the logits again (Note [Chunked loss])
  double parameter_count = 0;  // Ψ held (before ZeRO sharding)
  double expert_parameter_count = 0;  // of Ψ, expert tensors (reduced over dp x fsdp, not ep)
  MemoryBreakdown memory;
};

// Throws std::invalid_argument naming what the layout cannot do with this
// model (heads, vocabulary, ffn or sequence not divisible by tp, more stages
// than layers, interleaving needing m % pp == 0, ZeRO-3 with pp, offload
// without ZeRO, ...). `microbatches` per data rank per step.
void check_layout(const model::GptConfig& model, const Layout& layout, int64_t microbatches);

// Blocks per pipeline stage as the trainer splits them by parameter count.
std::vector<int64_t> stage_blocks(const model::GptConfig& model, int64_t stages);

// Peak memory of every pipeline rank (one entry without a pipeline).
std::vector<RankMemory> estimate_memory(const model::GptConfig& model, const Workload& workload, const Layout& layout,
                                        int64_t microbatches);

}  // namespace meshtrain::plan
