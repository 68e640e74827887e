#include "meshtrain/plan/activation_memory.h"

#include "meshtrain/model/chunked_loss.h"
#include "meshtrain/model/fused/ops.h"

#include <algorithm>

namespace meshtrain::plan {

namespace {

// What a norm saves beyond its input: a norm kernel (LayerNorm, the fused add
// + norm, ATen's rms_norm on a GPU: Workload::norm_kernels) its fp32
// statistics per token; the CPU's reference RMSNorm, composed of elementwise
// operations, the reciprocal RMS and the normalised input (which the scale's
// multiply keeps).
double norm_saved(const model::GptConfig& model, const Sizes& z, double activation_bytes, bool kernels) {
  return model.rms_norm() && !kernels ? 4 * z.tokens + activation_bytes * z.u : 2 * 4 * z.tokens;
}

// What QK-norm (Qwen3's per head, OLMo 2's over the width) saves of q and k.
// Through the fused norm (model.fused) its input, made contiguous (a copy of q
// and of k), and two floats per normalised row. As an RMSNorm of composed
// operators: the normalised q and k the scale multiplies, and its input: per
// head a view of the qkv projection's output, which keeps all of it (unless
// counted already: `qkv_kept`); over the width a copy of q and of k in
// position order.
double qk_norm_saved(const model::GptConfig& model, const Sizes& z, double e, bool qkv_kept) {
  const double h = static_cast<double>(model.width), qk = static_cast<double>(model.q_width() + model.kv_width());
  if (model.fused && model.qk_norm != model::QkNorm::kNone) {
    const double rows = model.qk_norm == model::QkNorm::kHead
                            ? static_cast<double>(model.heads + model.key_value_heads()) : 2.0;
    return e * z.split(z.u * qk / h) + 2 * 4 * z.split(z.tokens * rows);
  }
  switch (model.qk_norm) {
    case model::QkNorm::kNone: return 0;
    case model::QkNorm::kHead: return e * z.split(z.u * qk / h) + (qkv_kept ? 0 : e * z.split(z.u * model.qkv_width() / h));
    case model::QkNorm::kWidth: return 2 * e * z.split(z.u * qk / h);
  }
  return 0;
}

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
// row instead, and its backward holds dh, dW and a chunk. Added into .grad
// in the forward (Note [Head's gradient into .grad]), dW is not kept.
OutputBytes chunked_output_bytes(const model::GptConfig& model, const Sizes& z, const Precision& p, double chunk_bytes,
                                 bool norm_kernels, model::LossGradients when) {
  const double e = p.activation, share = z.split(static_cast<double>(model.vocab_size));
  const double width = static_cast<double>(model.width), weight = 4 * share * width;
  const double rows = std::min(z.tokens, std::max(1.0, chunk_bytes / (4 * share)));
  const double low_precision = e < 4 ? 1 : 0;
  // 16-bit: the chunk's 16-bit dz, and a slice of dW's product (as many
  // elements as the chunk's logits) with the fp32 copy its add into dW makes.
  const double chunk = rows * share * (4 * (model.logit_softcap > 0 ? 2 : 1) + low_precision * (2 * e + 4)) +
                       4 * rows * width + low_precision * e * share * width;
  const double gathered = z.sp ? e * z.u : 0;
  const double norm = p.residual * z.region(z.u) + z.region(norm_saved(model, z, p.residual, norm_kernels));
  if (when == model::LossGradients::kInBackward) {
    return {norm + e * z.u + 4 * z.tokens, chunk + gathered, e * z.u + weight + chunk + 4 * z.u};
  }
  return {norm + e * z.u + (when == model::LossGradients::kIntoWeightGrad ? 0 : weight), chunk + gathered, 4 * z.u};
}

// Note [PyTorch's loss_parallel]
// torchtitan trains with tensor parallel under PyTorch's loss_parallel
// (torch/distributed/tensor/parallel/loss.py): the head's bf16 logits, split
// over the vocabulary, are cast to fp32 by the loss (`pred.float()`), and the
// log-softmax is the decomposition with all-reduces inserted: x − max, then
// exp of it summed, then x − max − log-sum-exp. With L logits on the rank,
// at the exp the caller's bf16 logits, their fp32 copy, the shifted copy and
// the exp are alive (eL + 12L), and the log-probabilities (4L) stay to the
// backward. Its backward fuses nll_loss's and log_softmax's: a zeroed 4L
// scattered with −1 at the targets, plus exp of the log-probabilities (4L),
// their sum (4L), times the loss's gradient (4L): three such tensors beside
// the kept log-probabilities at its peak (12L), where meshtrain's own
// vocabulary-parallel loss holds one (parallel/tensor_parallel_ops.cpp).
// Under sequence parallel the head's column-parallel linear all-gathers the
// final norm's output and saves it whole, where meshtrain keeps its shard.
OutputBytes torch_loss_parallel_bytes(double head_inputs, double e, double logits) {
  const double fp32_copy = e < 4 ? 4 * logits : 0;
  return {head_inputs + 4 * logits, e * logits + fp32_copy + 4 * logits, 12 * logits};
}

}  // namespace

OutputBytes output_bytes(const model::GptConfig& model, const Sizes& z, const Precision& p, bool fused_loss,
                         bool chunked_loss, double chunk_bytes, bool norm_kernels, model::LossGradients when,
                         bool torch_loss_parallel) {
  if (chunked_loss) return chunked_output_bytes(model, z, p, chunk_bytes, norm_kernels, when);
  const double e = p.activation;
  // The final norm's input, the head's input, and autocast's copy of the head the product keeps.
  const double head_inputs = (p.residual + e) * z.region(z.u) + z.region(norm_saved(model, z, p.residual, norm_kernels)) +
                             p.weight_copy * z.split(static_cast<double>(model.vocab_size)) * static_cast<double>(model.width);
  const double logits = z.tokens * static_cast<double>(model.vocab_size) / z.t;  // elements on this rank
  const double low_precision = e < 4 ? 1 : 0;
  if (model.z_loss > 0 && z.t == 1) {
    // model::whole_logits_cross_entropy: the logits and a log-sum-exp per row kept; forward, an fp32 copy
    // of 16-bit logits and logsumexp's exp; backward, dz in fp32 and its cast.
    return {head_inputs + e * logits + 4 * z.tokens, 4 * logits * (1 + low_precision),
            4 * logits + low_precision * e * logits};
  }
  if (fused_loss && z.t == 1) return {head_inputs + e * logits + 4 * z.tokens, 0, e * logits};
  if (torch_loss_parallel && z.t > 1) {
    const double gathered = z.sp ? e * (z.u - z.region(z.u)) : 0;  // the head's input, whole
    return torch_loss_parallel_bytes(head_inputs + gathered, e, logits);
  }
  return {head_inputs + 4 * logits, logits * (e + 4 * low_precision),
          (z.t > 1 ? 4 : 8) * logits + low_precision * e * logits};
}

bool glu_output_made_again(const model::GptConfig& model, const ActivationOptions& o) {
  // Under autocast only the CPU's fused linear does (Note [Weight gradients under autocast]).
  return o.recompute == parallel::CheckpointMode::kSelective && o.selective == SelectivePolicy::kCore &&
         model.gated_mlp() && model.fused && (o.precision.weight_copy == 0 || o.fused_ops) && !o.lora;
}

// Gradients alive inside one layer's backward: the gradient arriving at its
// output and the MLP's hidden-sized ones, dh and beside it dg and du, which
// the fused GLU writes over g and u instead (Note [GLU gradients in the saved
// tensors]; `model.fused`: the fused operators run); where the down
// projection makes its input again, that input beside dh (Note [The GLU's
// output made again]). A MoE layer: its
// experts' hidden gradients and those of their inputs and outputs. With
// sequence parallel: the re-gathered input of a column-parallel linear and
// its gradient.
double layer_backward_workspace(const model::GptConfig& model, const Sizes& z, const Precision& p, bool moe, int64_t ep,
                                double load, bool glu_made_again) {
  const double e = p.activation, matrices = model.gated_mlp() ? 3 : 2;
  if (moe) {  // gradients of the experts' hidden tensors, inputs and outputs (sent back: source side)
    const double a = assignments(model, z.tokens, load) / z.t, sent = ep > 1 ? assignments(model, z.tokens) / z.t : a;
    return p.residual * z.u + matrices * e * a * static_cast<double>(model.expert_hidden()) +
           e * (a + sent) * static_cast<double>(model.width);
  }
  const double hidden = z.u * static_cast<double>(model.mlp_hidden()) / static_cast<double>(model.width);
  const double gradients = glu_made_again ? 2 : model.gated_mlp() && model.fused ? 1 : matrices;
  return p.residual * z.region(z.u) + gradients * e * z.split(hidden) + (z.sp ? 2 * e * z.u : 0);
}

namespace {

// What a MoE layer saves in place of the MLP's hidden tensors (model/moe.cpp,
// parallel/expert_parallel.cpp): the router's fp32 logits and probabilities
// (and its fp32 input when the residual stream is 16-bit), the top-k indices and
// gates, and per assignment the expert's input, hidden tensors and output,
// its combine gate and the dispatch/combine indices (int64).
double moe_saved(const model::GptConfig& model, const Sizes& z, double e, double residual, int64_t ep, double load) {
  // With expert parallel the experts' side follows the load this rank
  // receives, the routing side the balanced one it sends.
  // Tensor parallel: every rank routes all tokens and computes 1/t of the
  // assignments; with sequence parallel it keeps the gathered input.
  const double n = z.tokens, a = assignments(model, n, load) / z.t, sent = ep > 1 ? assignments(model, n) / z.t : a;
  const double d = static_cast<double>(model.width);
  const double k = static_cast<double>(model.moe_top_k), experts = static_cast<double>(model.moe_experts);
  double bytes = 2 * 4 * n * experts + (residual < 4 ? 4 * n * d : 0) + (z.sp ? e * n * d : 0);
  bytes += n * k * (8 + 4) + 4 * n;
  // Per assignment: the expert's input and its hidden tensors, as the dense MLP's below.
  const double hidden = model.gated_mlp() ? (model.fused ? 3 : 4) : 2;
  bytes += a * (d * e + hidden * static_cast<double>(model.expert_hidden()) * e);
  bytes += sent * (d * e + 4 + 3 * 8);  // expert output back here, its gate, the dispatch/combine indices
  if (ep > 1) bytes += a * 2 * 8;       // the regrouping indices
  return bytes;
}

// What a layer saves from its attention output on: dropout masks, the MLP's
// input and its activations (or the experts').
double mlp_saved(const model::GptConfig& model, const Sizes& z, double e, const ActivationOptions& o, bool moe, int64_t ep) {
  double bytes = 0;
  if (o.dropout > 0) bytes += 2 * o.precision.mask * z.region(z.u);  // dropout after attention and after the MLP
  bytes += e * z.region(z.u);                                        // MLP input
  if (moe) return bytes + moe_saved(model, z, e, o.precision.residual, ep, o.moe_load);
  // GELU: its input and output; SwiGLU: gate, up, silu(gate), product (fused: gate, up, product;
  // gate and up where the down projection makes the product again).
  const double hidden = z.u * static_cast<double>(model.mlp_hidden()) / static_cast<double>(model.width);
  const double kept = glu_output_made_again(model, o) ? 2 : model.fused ? 3 : 4;
  return bytes + (model.gated_mlp() ? kept : 2) * e * z.split(hidden);
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
      const double repeated = o.repeated_kv * 4 * z.split(z.u * 2 * (qw - kv) / h);  // SDPA's repeated k and v
      return 4 * z.split(z.u * (qw + 2 * kv) / h) + out_and_lse + window_mask + repeated;
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
  double bytes = o.precision.residual * z.region(z.u);  // the block's input
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
  const double e = o.precision.activation, mask = o.precision.mask, r = o.precision.residual;
  if (o.recompute == parallel::CheckpointMode::kFull) return r * z.region(z.u);  // the layer's input only (Korthikanti et al., Sec. 4.3)
  if (o.recompute == parallel::CheckpointMode::kSelective && o.selective == SelectivePolicy::kOps) {
    return op_level_saved(model, z, o, moe);
  }
  const double h = static_cast<double>(model.width), kv = static_cast<double>(model.kv_width());
  const double qw = static_cast<double>(model.q_width());  // width, unless the head size is set apart
  const double s = static_cast<double>(model.context), heads = static_cast<double>(model.heads);
  double bytes = 2 * (r * z.region(z.u) + z.region(norm_saved(model, z, r, o.norm_kernels)));  // both norms, on the residual stream
  bytes += e * z.region(z.u);                                // qkv projection's input
  bytes += e * z.split(z.u * qw / h);                        // attention output = output projection's input
  const double scores = heads * s * z.tokens;                // a·s²·b
  if (o.attention == "batched" && o.recompute != parallel::CheckpointMode::kSelective && o.cp == 1) {
    // Contiguous q, k, v (k and v over their own heads: Note [Grouped
    // queries]), and the causal softmax's blocks; the qkv projection's output
    // is not kept (Note [CPU attention]).
    const bool bf16 = o.precision.bf16() || o.bf16_attention;  // the blocks' size follows the attention's dtype
    const double kept =
        static_cast<double>(model::fused::batched_attention_scores(model.context, model.context, true, bf16)) / (s * s);
    return bytes + e * z.split(z.u * (qw + 2 * kv) / h) + e * z.split(kept * scores) + qk_norm_saved(model, z, e, false) +
           mlp_saved(model, z, e, o, moe, ep);
  }
  bytes += e * z.split(z.u * (qw + 2 * kv) / h);             // q, k, v
  // Rotated q and k beside them, except where one node makes all three from the
  // projection's output and ATen's flash kernel keeps them as they are (Note
  // [Heads from the fused projection]); the math path's scaled copies are
  // counted as before (with dropout, Llama style: +0.8% against -2.1% without).
  const bool one_node = o.fused_ops && o.attention == "flash" && o.recompute != parallel::CheckpointMode::kSelective &&
                        o.cp == 1 &&
                        model.rotary_dims() == model.head_dim() && model.qk_norm == model::QkNorm::kNone;
  if (!model.learned_positions() && !one_node) bytes += e * z.split(z.u * (qw + kv) / h);
  if (o.recompute != parallel::CheckpointMode::kSelective) {  // the attention core, QK-norm in it
    bytes += qk_norm_saved(model, z, e, true);
    if (o.cp > 1) {
      bytes += context_parallel_core(model, z, o);
    } else if (o.attention == "flash") {
      bytes += z.split(4 * heads * z.tokens);                // fp32 log-sum-exp per head and token
      bytes += o.repeated_kv * e * z.split(z.u * 2 * (qw - kv) / h);  // k and v repeated per query head
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

}  // namespace meshtrain::plan
