#include "meshtrain/plan/memory_model.h"

#include "meshtrain/model/chunked_loss.h"
#include "meshtrain/model/fused/ops.h"
#include "meshtrain/parallel/pipeline/schedule.h"
#include "meshtrain/parallel/pipeline/stages.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <tuple>

namespace meshtrain::plan {

namespace {

namespace pipeline = parallel::pipeline;

// Sizes of one micro-batch on a rank, in elements (a cp-th of each sequence
// under context parallel), and the two ways tensor parallel divides them:
// head- and MLP-sized tensors always (split), the rest only with sequence
// parallel (region).
struct Sizes {
  double tokens, u, t;
  bool sp;
  double split(double x) const { return x / t; }
  double region(double x) const { return sp ? x / t : x; }
};

Sizes sizes(const model::GptConfig& model, int64_t micro_batch, int64_t tp, bool sp, int64_t cp) {
  const double tokens = static_cast<double>(model.context) * static_cast<double>(micro_batch) / static_cast<double>(cp);
  return {tokens, tokens * static_cast<double>(model.width), static_cast<double>(tp), sp && tp > 1};
}

// What a norm saves beyond its input: LayerNorm (ATen's, or the fused add +
// norm) and the fused RMSNorm their fp32 mean and reciprocal deviation per
// token; the reference RMSNorm, composed of elementwise operations, the
// reciprocal RMS and the normalised input (which the scale's multiply keeps).
double norm_saved(const model::GptConfig& model, const Sizes& z, double activation_bytes) {
  return model.rms_norm() && !model.fused ? 4 * z.tokens + activation_bytes * z.u : 2 * 4 * z.tokens;
}

// The loss's side of one micro-batch on the last stage: what stays saved
// from its forward to its backward (the final norm's and the head's inputs,
// and the fp32 log-softmax — or, with the vocabulary-parallel loss, the
// softmax of this rank's shard), what exists only at the end of the forward
// (the logits, and their fp32 copy when activations are 16-bit), and what
// the loss's backward adds (plain: the gradients of the loss and of the
// logits; vocabulary-parallel: one gradient; parallel/tensor_parallel_ops.cpp).
// The fused loss (Workload::fused_loss, one tensor-parallel rank; model/fused/ops.cpp)
// keeps the logits themselves and a log-sum-exp per row, reads 16-bit
// logits without an fp32 copy, and its backward makes one gradient.
struct OutputBytes {
  double kept, forward, backward;
};
// The chunked loss (Note [Chunked loss]) keeps the final norm's input and
// what it saves. With its gradients made in the forward it keeps dh (rows of
// the head's whole input: gathered under sequence parallel) and this rank's
// dW to its backward; its forward holds one chunk's fp32 logits over this
// rank's share of the vocabulary (with a soft-cap one more; a 16-bit copy
// under autocast, and dW's product before it is added), the chunk's dh
// product and, under sequence parallel, the gathered input; its backward
// scales dh and dW in place and hands them on, and dh's cast to the input's
// dtype or its collective makes one fp32 copy. Made in the backward (a
// pipeline's last stage), it keeps the head's input and a log-sum-exp per
// row instead, and its backward holds dh, dW and a chunk.
OutputBytes chunked_output_bytes(const model::GptConfig& model, const Sizes& z, const Precision& p, bool in_backward) {
  const double e = p.activation, share = z.split(static_cast<double>(model.vocab_size));
  const double width = static_cast<double>(model.width), weight = 4 * share * width;
  const double rows = std::min(z.tokens, std::max(1.0, static_cast<double>(model::kChunkBytes) / (4 * share)));
  const double low_precision = e < 4 ? 1 : 0;
  const double chunk = rows * share * (4 * (model.logit_softcap > 0 ? 2 : 1) + low_precision * e) + 4 * rows * width +
                       low_precision * e * share * width;
  const double gathered = z.sp ? e * z.u : 0;
  const double norm = e * z.region(z.u) + z.region(norm_saved(model, z, e));
  if (in_backward) return {norm + e * z.u + 4 * z.tokens, chunk + gathered, e * z.u + weight + chunk + 4 * z.u};
  return {norm + e * z.u + weight, chunk + gathered, 4 * z.u};
}

OutputBytes output_bytes(const model::GptConfig& model, const Sizes& z, const Precision& p, bool fused_loss,
                         bool chunked_loss, bool in_backward) {
  if (chunked_loss) return chunked_output_bytes(model, z, p, in_backward);
  const double e = p.activation;
  const double head_inputs = 2 * e * z.region(z.u) + z.region(norm_saved(model, z, e));
  const double logits = z.tokens * static_cast<double>(model.vocab_size) / z.t;  // elements on this rank
  if (fused_loss && z.t == 1) return {head_inputs + e * logits + 4 * z.tokens, 0, e * logits};
  const double low_precision = e < 4 ? 1 : 0;
  return {head_inputs + 4 * logits, logits * (e + 4 * low_precision),
          (z.t > 1 ? 4 : 8) * logits + low_precision * e * logits};
}

// Gradients alive inside one layer's backward: the gradient arriving at its
// output and the MLP's hidden-sized pair (a MoE layer: its experts' hidden
// gradients and those of their inputs and outputs); with sequence parallel
// the re-gathered input of a column-parallel linear and its gradient.
double layer_backward_workspace(const model::GptConfig& model, const Sizes& z, const Precision& p, bool moe, int64_t ep,
                                double load) {
  const double e = p.activation, matrices = model.gated_mlp() ? 3 : 2;
  if (moe) {  // gradients of the experts' hidden tensors, inputs and outputs (sent back: source side)
    const double a = assignments(model, z.tokens, load) / z.t, sent = ep > 1 ? assignments(model, z.tokens) / z.t : a;
    return e * z.u + matrices * e * a * static_cast<double>(model.expert_hidden()) +
           e * (a + sent) * static_cast<double>(model.width);
  }
  const double hidden = z.u * static_cast<double>(model.mlp_hidden()) / static_cast<double>(model.width);
  return e * z.region(z.u) + matrices * e * z.split(hidden) + (z.sp ? 2 * e * z.u : 0);
}

// What a MoE layer saves in place of the MLP's hidden tensors (model/moe.cpp,
// parallel/expert_parallel.cpp): the router's fp32 logits and probabilities
// (and its fp32 input when activations are 16-bit), the top-k indices and
// gates, and per assignment the expert's input, hidden tensors and output,
// its combine gate and the dispatch/combine indices (int64).
double moe_saved(const model::GptConfig& model, const Sizes& z, double e, int64_t ep, double load) {
  // With expert parallel the experts' side follows the load this rank
  // receives, the routing side the balanced one it sends.
  // Tensor parallel: every rank routes all tokens and computes 1/t of the
  // assignments; with sequence parallel it keeps the gathered input.
  const double n = z.tokens, a = assignments(model, n, load) / z.t, sent = ep > 1 ? assignments(model, n) / z.t : a;
  const double d = static_cast<double>(model.width);
  const double k = static_cast<double>(model.moe_top_k), experts = static_cast<double>(model.moe_experts);
  double bytes = 2 * 4 * n * experts + (e < 4 ? 4 * n * d : 0) + (z.sp ? e * n * d : 0);
  bytes += n * k * (8 + 4) + 4 * n;
  // Per assignment: the expert's input and its hidden tensors, as the dense MLP's below.
  const double hidden = model.gated_mlp() ? (model.fused ? 3 : 4) : 2;
  bytes += a * (d * e + hidden * static_cast<double>(model.expert_hidden()) * e);
  bytes += sent * (d * e + 4 + 3 * 8);  // expert output back here, its gate, the dispatch/combine indices
  if (ep > 1) bytes += a * 2 * 8;       // the regrouping indices
  return bytes;
}

// The schedule each rank runs (one rank: micro-batches one after another),
// cached: the search asks for the same ones often.
const pipeline::Schedule& schedule_of(const Layout& layout, int64_t microbatches) {
  static std::map<std::tuple<mesh::PipelineSchedule, int64_t, int64_t, int64_t>, pipeline::Schedule> cache;
  const mesh::ParallelDims& d = layout.dims;
  const mesh::PipelineSchedule name = d.pp > 1 ? d.schedule : mesh::PipelineSchedule::kOneFOneB;
  const auto key = std::make_tuple(name, d.pp, d.virtual_stages, microbatches);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  return cache[key] = pipeline::make_schedule(name, static_cast<int>(d.pp), static_cast<int>(d.virtual_stages),
                                              static_cast<int>(microbatches));
}

// What a layer saves from its attention output on: dropout masks, the MLP's
// input and its activations (or the experts').
double mlp_saved(const model::GptConfig& model, const Sizes& z, double e, const ActivationOptions& o, bool moe, int64_t ep) {
  double bytes = 0;
  if (o.dropout > 0) bytes += 2 * o.precision.mask * z.region(z.u);  // dropout after attention and after the MLP
  bytes += e * z.region(z.u);                                        // MLP input
  if (moe) return bytes + moe_saved(model, z, e, ep, o.moe_load);
  // GELU: its input and output; SwiGLU: gate, up, silu(gate), product (fused: gate, up, product).
  const double hidden = z.u * static_cast<double>(model.mlp_hidden()) / static_cast<double>(model.width);
  return bytes + (model.gated_mlp() ? (model.fused ? 3 : 4) : 2) * e * z.split(hidden);
}

}  // namespace

// What context parallel's attention core saves (parallel/context_parallel.h).
double context_parallel_core(const model::GptConfig& model, const Sizes& z, const ActivationOptions& o) {
  const double h = static_cast<double>(model.width), qw = static_cast<double>(model.q_width());
  const double kv = static_cast<double>(model.kv_width()), heads = static_cast<double>(model.heads);
  const double out_and_lse = 4 * z.split(z.u * qw / h) + 4 * z.split(heads * z.tokens);
  switch (o.cp_impl) {
    case mesh::ContextParallelImpl::kRing: return out_and_lse;
    case mesh::ContextParallelImpl::kAllToAll: {
      // A sliding window's mask over the whole sequence, kept as floats (counted for every block).
      const double s = static_cast<double>(model.context), window_mask = model.sliding_window > 0 ? 4 * s * s : 0;
      return 4 * z.split(z.u * (qw + 2 * kv) / h) + out_and_lse + window_mask;
    }
    case mesh::ContextParallelImpl::kHybrid: return 4 * z.split(z.u * (qw + 2 * kv) / h) + out_and_lse;
  }
  return out_and_lse;
}

std::vector<BlockProduct> op_level_products(const model::GptConfig& model, bool moe) {
  const double h = static_cast<double>(model.width), qw = static_cast<double>(model.q_width());
  const double kv = static_cast<double>(model.kv_width()), f = static_cast<double>(model.mlp_hidden());
  std::vector<BlockProduct> all;
  std::vector<bool> uncounted;  // a bias (addmm), a router or grouped experts: the policy neither counts nor keeps them
  auto add = [&](double in, double out, bool row, bool bias, double times = 1, bool expert = false) {
    all.push_back({in, out, times, row, false, false, expert});
    uncounted.push_back(bias);
  };
  for (double out : {qw, kv, kv}) add(h, out, false, model.qkv_has_bias());
  add(qw, h, true, model.proj_has_bias());
  auto mlp = [&](double hidden, bool bias, double times, bool counted, bool experts = false) {
    const bool skip = bias || !counted;
    if (model.gated_mlp()) add(h, hidden, false, skip, times, experts);
    add(h, hidden, false, skip, times, experts);
    add(hidden, h, true, skip, times, experts);
  };
  if (!moe) {
    mlp(f, model.mlp_has_bias(), 1, true);
  } else {
    add(h, static_cast<double>(model.moe_experts), false, true);  // the router
    all.back().router = true;
    mlp(static_cast<double>(model.expert_hidden()), false, static_cast<double>(model.moe_top_k), false, true);
    if (model.moe_shared_hidden > 0) mlp(static_cast<double>(model.moe_shared_hidden), false, 1, true);
  }
  int count = 0;
  for (size_t i = 0; i < all.size(); ++i) all[i].kept = !uncounted[i] && ++count % 2 == 1;
  return all;
}

namespace {

// What a block keeps under op-level recompute (Note [Op-level recompute]).
double op_level_saved(const model::GptConfig& model, const Sizes& z, const ActivationOptions& o, bool moe) {
  const double e = o.precision.activation, h = static_cast<double>(model.width);
  double bytes = e * z.region(z.u);  // the block's input
  for (const BlockProduct& p : op_level_products(model, moe)) {
    if (p.kept) bytes += e * z.tokens * p.times * (p.row_parallel ? p.out : z.split(p.out));
  }
  if (z.sp) bytes += 2 * e * z.u / z.t;  // the reduce-scatters after attention and after the MLP
  const double heads = static_cast<double>(model.heads), qw = static_cast<double>(model.q_width());
  if (o.cp > 1) return bytes + context_parallel_core(model, z, o);
  return bytes + e * z.split(z.u * qw / h) + 4 * z.split(heads * z.tokens);  // the attention kernel's output and log-sum-exp
}

}  // namespace

double layer_activation_bytes(const model::GptConfig& model, const ActivationOptions& o, bool moe, int64_t ep) {
  const Sizes z = sizes(model, o.micro_batch, o.tp, o.sp, o.cp);
  const double e = o.precision.activation, mask = o.precision.mask;
  if (o.recompute == parallel::CheckpointMode::kFull) return e * z.region(z.u);  // the layer's input only (Korthikanti et al., Sec. 4.3)
  if (o.recompute == parallel::CheckpointMode::kSelective && o.selective == SelectivePolicy::kOps) {
    return op_level_saved(model, z, o, moe);
  }
  const double h = static_cast<double>(model.width), kv = static_cast<double>(model.kv_width());
  const double qw = static_cast<double>(model.q_width());  // width, unless the head size is set apart
  const double s = static_cast<double>(model.context), heads = static_cast<double>(model.heads);
  double bytes = 2 * (e * z.region(z.u) + z.region(norm_saved(model, z, e)));  // both norms
  bytes += e * z.region(z.u);                                // qkv projection's input
  bytes += e * z.split(z.u * qw / h);                        // attention output = output projection's input
  const double scores = heads * s * z.tokens;                // a·s²·b
  if (o.attention == "batched" && o.recompute != parallel::CheckpointMode::kSelective && o.cp == 1) {
    // Contiguous q, k, v (k and v over their own heads: Note [Grouped
    // queries]), and the causal softmax's blocks; the qkv projection's output
    // is not kept (Note [CPU attention]).
    const double kept = static_cast<double>(model::fused::batched_attention_scores(model.context, model.context, true)) / (s * s);
    return bytes + e * z.split(z.u * (qw + 2 * kv) / h) + e * z.split(kept * scores) + mlp_saved(model, z, e, o, moe, ep);
  }
  bytes += e * z.split(z.u * (qw + 2 * kv) / h);             // q, k, v
  if (!model.learned_positions()) bytes += e * z.split(z.u * (qw + kv) / h);  // rotated q and k
  if (o.recompute != parallel::CheckpointMode::kSelective) {  // the attention core
    if (o.cp > 1) {
      bytes += context_parallel_core(model, z, o);
    } else if (o.attention == "flash") {
      bytes += z.split(4 * heads * z.tokens);                // fp32 log-sum-exp per head and token
    } else {
      bytes += z.split(scores) * (e + (o.dropout > 0 ? mask + e : 0));  // softmax (+ dropout mask and output)
    }
  }
  return bytes + mlp_saved(model, z, e, o, moe, ep);
}

double assignments(const model::GptConfig& model, double tokens, double load) {
  const double k = static_cast<double>(model.moe_top_k);
  if (load > 0) return tokens * k * load;
  const double cf = model.moe_capacity_factor;
  return tokens * k * (cf > 0 ? std::min(1.0, cf) : 1.0);
}

double rank_moe_load(const model::GptConfig& model, const Workload& w, int64_t ep) {
  for (const auto& [degree, load] : w.moe_load_by_ep) {
    if (degree == ep) return load;
  }
  if (ep > 1) return w.moe_load;
  if (w.moe_kept > 0) return w.moe_kept;
  if (w.moe_load <= 0) return 0;
  const double cf = model.moe_capacity_factor;
  return std::min(w.moe_load, cf > 0 ? std::min(1.0, cf) : 1.0);
}

void check_layout(const model::GptConfig& model, const Layout& l, int64_t microbatches) {
  // The trainer's rules (Note [Parallel spec]), on a copy: the degrees are explicit already.
  Layout checked = l;
  try {
    checked.check(l.world(), model, {});
    checked.check_microbatches(microbatches);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("layout " + l.str() + ": " + e.what());
  }
}

std::vector<int64_t> stage_blocks(const model::GptConfig& model, int64_t stages) {
  std::vector<double> costs;
  costs.push_back(static_cast<double>(model.embedding_parameters()));
  for (int64_t i = 0; i < model.layers; ++i) costs.push_back(static_cast<double>(model.block_parameters()));
  // The last stage holds the head even when it is tied (a copy of the embedding).
  costs.push_back(static_cast<double>(model.head_parameters() + (model.tie_embeddings ? model.vocab_size * model.width : 0)));
  return pipeline::balance(costs, static_cast<int>(stages));
}

namespace {

// Parameters on one tensor-parallel rank, by part (a MoE block: its ep-th of the experts).
struct RankParameters {
  double block = 0, moe_block = 0, local_experts = 0, embedding = 0, head = 0;  // with LoRA, adapters included
  double largest_tensor = 0;  // the gradient norm's slice is at most its size
  // What trains: every parameter, or with LoRA a block's adapters only.
  bool lora = false;
  double trained_block = 0, trained_moe_block = 0;
  double trained(double parameters) const { return lora ? 0 : parameters; }  // of the embedding and head
};

// One block's LoRA adapters on a tensor-parallel rank: a column-parallel
// base splits B (out x rank), a row-parallel one A (rank x in).
double adapter_parameters(const model::GptConfig& m, const model::LoraConfig& lora, double t, bool moe) {
  const double r = static_cast<double>(lora.rank), w = static_cast<double>(m.width), h = static_cast<double>(m.mlp_hidden());
  double total = 0;
  for (const std::string& target : lora.targets) {
    if (target == "q") total += r * (w + static_cast<double>(m.q_width()) / t);
    if (target == "k" || target == "v") total += r * (w + static_cast<double>(m.kv_width()) / t);
    if (target == "o") total += r * (static_cast<double>(m.q_width()) / t + w);
    if (moe) continue;  // experts take no adapters
    if ((target == "gate" && m.gated_mlp()) || target == "up") total += r * (w + h / t);
    if (target == "down") total += r * (h / t + w);
  }
  return total;
}

RankParameters rank_parameters(const model::GptConfig& model, const Layout& l, const model::LoraConfig& lora) {
  const double t = static_cast<double>(l.dims.tp), h = static_cast<double>(model.width);
  const double vocab = static_cast<double>(model.vocab_size);
  RankParameters r;
  r.block = static_cast<double>(model.block_split_parameters()) / t +
            static_cast<double>(model.block_parameters() - model.block_split_parameters());
  r.local_experts = static_cast<double>(model.expert_parameters()) / static_cast<double>(l.dims.ep);
  // A MoE block: the dense block less its MLP (split by tp, its output bias whole), plus the router and experts (whole on every tp rank).
  const double mlp_bias = static_cast<double>(model.mlp_has_bias() ? model.width : 0);
  const double mlp_split = static_cast<double>(model.mlp_parameters(model.mlp_hidden())) - mlp_bias;
  const double shared = model.moe_shared_hidden > 0 ? 3.0 * h * static_cast<double>(model.moe_shared_hidden) + h : 0.0;
  r.moe_block = r.block - mlp_split / t - mlp_bias + static_cast<double>(model.moe_experts * model.width) + r.local_experts +
                shared;  // a shared expert: replicated like the router
  r.embedding = vocab * h / t + (model.learned_positions() ? static_cast<double>(model.context) * h : 0);
  const double head_norm = static_cast<double>(model.head_parameters()) - (model.tie_embeddings ? 0 : vocab * h);
  r.head = head_norm + ((!model.tie_embeddings || l.dims.pp > 1) ? vocab * h / t : 0);
  r.largest_tensor = std::max({vocab * h / t, static_cast<double>(model.mlp_hidden()) * h / t,
                               h * static_cast<double>(model.qkv_width()) / t,
                               static_cast<double>(model.expert_hidden() * model.moe_experts / l.dims.ep) * h});
  r.trained_block = r.block;
  r.trained_moe_block = r.moe_block;
  if (lora.enabled()) {
    r.lora = true;
    r.trained_block = adapter_parameters(model, lora, t, false);
    r.trained_moe_block = adapter_parameters(model, lora, t, true);
    r.block += r.trained_block;
    r.moe_block += r.trained_moe_block;
    r.largest_tensor = static_cast<double>(lora.rank) * std::max(h, static_cast<double>(model.mlp_hidden()));
  }
  return r;
}

// What a block's LoRA adapters save beyond the layer (Note [LoRA]): each
// adapter's x·Aᵀ (tokens x rank, whole on every tensor-parallel rank); with
// sequence parallel each adapted column-parallel call site gathers its input
// itself and keeps it. Under full recompute, nothing (the layer's input only).
double lora_activation_bytes(const model::GptConfig& model, const model::LoraConfig& lora, const ActivationOptions& o,
                             bool moe) {
  if (!lora.enabled() || o.recompute == parallel::CheckpointMode::kFull) return 0;
  const Sizes z = sizes(model, o.micro_batch, o.tp, o.sp, o.cp);
  const double e = o.precision.activation;
  double bytes = 0;
  bool qkv = false;
  for (const std::string& t : lora.targets) {
    const bool mlp = t == "gate" || t == "up" || t == "down";
    if ((moe && mlp) || (t == "gate" && !model.gated_mlp())) continue;
    bytes += e * z.tokens * static_cast<double>(lora.rank);
    const bool column = t == "gate" || t == "up" || ((t == "q" || t == "k" || t == "v") && !qkv);
    if (t == "q" || t == "k" || t == "v") qkv = true;
    if (z.sp && column) bytes += e * z.u;
  }
  return bytes;
}

// What one micro-batch leaves behind: per layer (dense, MoE), a whole layer's
// forward when recompute repeats it, the loss's side, one send between stages.
struct StepActivations {
  double per_layer = 0, per_moe_layer = 0, full_layer = 0, boundary = 0;
  double op_level_recomputed = 0;  // what op-level recompute makes again in a block's backward (Note [Op-level recompute])
  OutputBytes out{};
};

StepActivations step_activations(const model::GptConfig& model, const Workload& w, const Layout& l, const Sizes& z,
                                 bool loss_in_backward) {
  const Precision& p = w.precision;
  ActivationOptions options{l.micro_batch, l.dims.tp, l.dims.sequence_parallel, l.dims.cp, l.dims.cp_impl,
                            l.activation_checkpoint, w.attention, w.dropout, p, rank_moe_load(model, w, l.dims.ep)};
  StepActivations a;
  options.selective = w.selective;
  const double dense_kept = layer_activation_bytes(model, options), moe_kept = layer_activation_bytes(model, options, true, l.dims.ep);
  a.per_layer = dense_kept + lora_activation_bytes(model, w.lora, options, false);
  a.per_moe_layer = moe_kept + lora_activation_bytes(model, w.lora, options, true);
  options.recompute = parallel::CheckpointMode::kNone;
  const double dense_full = layer_activation_bytes(model, options);
  const double moe_full = model.moe() ? layer_activation_bytes(model, options, true, l.dims.ep) : 0.0;
  a.full_layer = std::max(dense_full, moe_full);
  if (op_level_recompute(l, w)) {
    a.op_level_recomputed = std::max({0.0, dense_full - dense_kept, model.moe() ? moe_full - moe_kept : 0.0});
  }
  a.out = output_bytes(model, z, p, w.fused_loss, w.chunked_loss, loss_in_backward);
  a.boundary = p.activation * z.region(z.u);  // one activation (or its gradient) sent between stages
  return a;
}

// Parameters, gradients and optimizer states of `psi` parameters on a rank,
// sharded as the ZeRO stage shards them, and what offload moves to the host.
// `trained`: of those, the ones that take gradients and optimizer states (all but LoRA's frozen base).
MemoryBreakdown model_states(const Precision& p, const Layout& l, double psi, double trained) {
  const double shards = static_cast<double>(l.shards());
  MemoryBreakdown states;
  states.parameters = p.param * psi / (l.dims.zero_stage >= 3 ? shards : 1);
  states.gradients = p.grad * trained / (l.dims.zero_stage >= 2 ? shards : 1);
  states.optimizer = p.optimizer * trained / (l.dims.zero_stage >= 1 ? shards : 1);
  // Offload (Note [Offloaded optimizer]): the moments and fp32 masters go to
  // the host (in fp32 training the masters were the parameters, so the host
  // holds a copy of this rank's shard); sharded gradients accumulate there;
  // with "parameters" the stage-3 parameter shards too.
  if (l.offloaded()) {
    states.host += states.optimizer + (p.param == 4 && p.optimizer == 8 ? 4 * trained / shards : 0);
    states.optimizer = 0;
    if (l.dims.zero_stage >= 2) states.host += states.gradients, states.gradients = 0;
  }
  if (l.offload_params != offload::Tier::kDevice) states.host += states.parameters, states.parameters = 0;
  return states;
}

// The blocks of each pipeline chunk (stage), and of those the MoE ones.
struct Chunks {
  std::vector<int64_t> blocks, moe_blocks;
};

Chunks chunks_of(const model::GptConfig& model, const Layout& l) {
  const int64_t chunks = l.dims.pp * l.dims.virtual_stages;
  Chunks c;
  c.blocks = l.dims.pp > 1 ? stage_blocks(model, chunks) : std::vector<int64_t>{model.layers};
  c.moe_blocks.assign(c.blocks.size(), 0);
  for (int64_t k = 0, i = 0; k < chunks; ++k) {
    for (int64_t end = i + c.blocks[k]; i < end; ++i) c.moe_blocks[k] += model.is_moe_block(i) ? 1 : 0;
  }
  return c;
}

// Everything of a layout that is the same on every pipeline rank.
struct StepTerms {
  const Layout& l;
  const Workload& w;
  Sizes z;
  RankParameters r;
  StepActivations a;
  Chunks c;
  double dense_workspace = 0, moe_workspace = 0;  // gradients alive inside a layer's backward
};

// Walks pipeline rank `rank`'s actions in order, keeping what each leaves
// behind (a stage's activations until its backward, the loss's saved tensors
// on the last stage, every send until the step ends), and returns `states`
// with the fullest moment's terms filled in; counts the stages in flight.
MemoryBreakdown peak_of_rank(RankMemory& rank, MemoryBreakdown states, const std::vector<pipeline::Action>& actions,
                             const StepTerms& t) {
  const Layout& l = t.l;
  const Workload& w = t.w;
  const Sizes& z = t.z;
  const RankParameters& r = t.r;
  const StepActivations& a = t.a;
  const Chunks& c = t.c;
  const Precision& p = w.precision;
  const int64_t chunks = static_cast<int64_t>(c.blocks.size());
  const double root_unit = r.embedding + r.head;  // ZeRO-3's root unit: embedding and head
  const bool gathers = l.dims.zero_stage == 3;    // units gathered in full while they compute
  const double largest_block = rank.moe_layers > 0 ? std::max(r.block, r.moe_block) : r.block;
  const double largest_trained = rank.moe_layers > 0 ? std::max(r.trained_block, r.trained_moe_block) : r.trained_block;
  const double dense_workspace = t.dense_workspace, moe_workspace = rank.moe_layers > 0 ? t.moe_workspace : 0.0;
  MemoryBreakdown peak = states;
  double peak_bytes = -1;
  auto consider = [&](const char* moment, double activations, double outputs, double buffers, double work) {
    const double bytes = activations + outputs + buffers + work;
    if (bytes <= peak_bytes) return;
    peak_bytes = bytes;
    peak.moment = moment;
    peak.activations = activations, peak.outputs = outputs, peak.buffers = buffers, peak.workspace = work;
  };
  auto stage_bytes = [&](int stage) {
    double bytes = static_cast<double>(c.blocks[stage] - c.moe_blocks[stage]) * a.per_layer +
                   static_cast<double>(c.moe_blocks[stage]) * a.per_moe_layer;
    if (stage == 0 && w.dropout > 0) bytes += p.mask * z.region(z.u);  // the embedding's dropout mask
    return bytes;
  };
  double stash = 0, kept_outputs = 0, sends = 0;
  int stashed = 0;
  for (const pipeline::Action& act : actions) {
    const bool loss_stage = act.stage == chunks - 1;
    if (act.kind == pipeline::ActionKind::kForward) {
      stash += stage_bytes(act.stage);
      rank.in_flight = std::max<int64_t>(rank.in_flight, ++stashed);
      if (loss_stage) {
        kept_outputs += a.out.kept;
        consider("forward end", stash, kept_outputs + a.out.forward, sends + (gathers ? p.param * root_unit : 0), 0);
      } else {
        sends += a.boundary;
      }
    } else if (act.kind == pipeline::ActionKind::kBackward) {
      if (loss_stage) {
        consider("loss backward", stash, kept_outputs + a.out.backward,
                 sends + (gathers ? p.param * root_unit + p.grad * r.trained(root_unit) : 0), 0);
        kept_outputs -= a.out.kept;
      }
      // ZeRO-3: the gathered unit, and the gradients of a dense block's
      // size beside the layer's saved tensors. A MoE block's backward
      // starts with its experts, whose workspace is freed before any of
      // the block's gradients exist; its expert gradients complete (then
      // are reduced) once its saved tensors are freed.
      const double recomputed =
          l.activation_checkpoint == parallel::CheckpointMode::kFull ? a.full_layer : a.op_level_recomputed;
      if (gathers && rank.moe_layers > 0) {
        const double gathered = sends + p.param * (root_unit + r.moe_block);
        consider("layer backward", stash, kept_outputs, gathered, moe_workspace + recomputed);
        const double dense = sends + p.param * (root_unit + r.block) + p.grad * r.trained_block;
        if (rank.layers > rank.moe_layers) consider("layer backward", stash, kept_outputs, dense, dense_workspace + recomputed);
      } else {
        const double gathered = sends + (gathers ? p.param * (root_unit + r.block) + p.grad * r.trained_block : 0);
        consider("layer backward", stash, kept_outputs, gathered, std::max(dense_workspace, moe_workspace) + recomputed);
      }
      const double gathered = sends + (gathers ? p.param * (root_unit + largest_block) : 0);
      if (gathers && rank.moe_layers > 0) {
        consider("unit gradients", std::max(0.0, stash - a.per_moe_layer), kept_outputs,
                 gathered + p.grad * largest_trained, 0);
      }
      stash -= stage_bytes(act.stage);
      --stashed;
      if (act.stage > 0) sends += a.boundary;
    }
  }
  // Data parallel's AdamW kernels (CPU and CUDA) update in place; the
  // gradient norm squares a CPU gradient in double slices of at most 2^20
  // elements (parallel/grad_norm.cpp). ZeRO gathers a unit's updated shards
  // into a full buffer (two units' worth in flight; with LoRA only the
  // adapters' units change and are gathered again).
  const double optimizer_work = l.dims.zero_stage == 0 ? 8 * std::min(r.largest_tensor, 1048576.0)
                                : r.lora              ? 2 * 4 * largest_trained
                                                      : 2 * 4 * std::max(largest_block, root_unit);
  consider("optimizer step", 0, 0, 0, optimizer_work);
  return peak;
}

}  // namespace

std::vector<RankMemory> estimate_memory(const model::GptConfig& model, const Workload& w, const Layout& l,
                                        int64_t microbatches) {
  check_layout(model, l, microbatches);
  const Sizes z = sizes(model, l.micro_batch, l.dims.tp, l.dims.sequence_parallel, l.dims.cp);
  const pipeline::Schedule& schedule = schedule_of(l, microbatches);
  const bool loss_in_backward = l.dims.pp > 1 && pipeline::losses_in_flight(schedule) > 1;
  const StepTerms terms{l,
                        w,
                        z,
                        rank_parameters(model, l, w.lora),
                        step_activations(model, w, l, z, loss_in_backward),
                        chunks_of(model, l),
                        layer_backward_workspace(model, z, w.precision, false, 1, 0),
                        model.moe() ? layer_backward_workspace(model, z, w.precision, true, l.dims.ep, rank_moe_load(model, w, l.dims.ep)) : 0.0};
  const RankParameters& r = terms.r;
  const Chunks& c = terms.c;
  const int64_t chunks = static_cast<int64_t>(c.blocks.size());
  std::vector<RankMemory> ranks;
  for (int64_t pr = 0; pr < l.dims.pp; ++pr) {
    RankMemory rank;
    rank.pipeline_rank = static_cast<int>(pr);
    rank.loss_in_backward = loss_in_backward && w.chunked_loss && pr == l.dims.pp - 1;
    for (int64_t k = pr; k < chunks; k += l.dims.pp) rank.layers += c.blocks[k], rank.moe_layers += c.moe_blocks[k];
    const bool first = pr == 0, last = pr == l.dims.pp - 1;
    const double dense_layers = static_cast<double>(rank.layers - rank.moe_layers);
    const double psi = dense_layers * r.block + static_cast<double>(rank.moe_layers) * r.moe_block +
                       (first ? r.embedding : 0) + (last ? r.head : 0);
    rank.parameter_count = psi;
    rank.expert_parameter_count = static_cast<double>(rank.moe_layers) * r.local_experts;
    const double trained = r.lora ? dense_layers * r.trained_block + static_cast<double>(rank.moe_layers) * r.trained_moe_block
                                  : psi;
    rank.memory = peak_of_rank(rank, model_states(w.precision, l, psi, trained), schedule.actions[pr], terms);
    ranks.push_back(rank);
  }
  return ranks;
}

}  // namespace meshtrain::plan
