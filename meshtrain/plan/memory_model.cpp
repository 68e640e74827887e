#include "meshtrain/plan/memory_model.h"

#include "meshtrain/model/attention.h"
#include "meshtrain/parallel/pipeline/schedule.h"
#include "meshtrain/parallel/pipeline/stages.h"
#include "meshtrain/plan/activation_memory.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <tuple>

namespace meshtrain::plan {

namespace {

namespace pipeline = parallel::pipeline;

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

}  // namespace

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
  // Of a block, the column-parallel matrices sequence parallel's gathered
  // products multiply in place, casting them without keeping a copy (qkv,
  // and a dense block's up and gate): no autocast copy of these.
  double uncopied_block = 0, uncopied_moe_block = 0;
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
  if (l.dims.sequence_parallel && l.dims.tp > 1) {
    r.uncopied_moe_block = h * static_cast<double>(model.qkv_width()) / t;
    r.uncopied_block = r.uncopied_moe_block + h * static_cast<double>(model.mlp_hidden()) * (model.gated_mlp() ? 2 : 1) / t;
  }
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
  bool loss_into_grad = false;  // the chunked loss adds dW into .grad in its forward (Note [Head's gradient into .grad])
  bool embedding_into_grad = false;  // the lookups' rows add into .grad (Note [Embedding gradients in place])
  bool glu_made_again = false;       // the down projections make their input again (Note [The GLU's output made again])
};

// The share of blocks whose ATen attention keeps grouped k and v repeated (Note [Grouped queries in SDPA]).
double repeated_kv_share(const model::GptConfig& model, const Workload& w) {
  if (model.layers == 0) return 0;
  const at::DeviceType device = w.gpu ? at::kCUDA : at::kCPU;
  const at::ScalarType dtype = w.precision.bf16() || w.bf16_attention ? at::kBFloat16 : at::kFloat;
  int64_t repeated = 0;
  for (int64_t b = 0; b < model.layers; ++b) repeated += !model::sdpa_takes_groups(device, dtype, model.window_of(b) > 0);
  return static_cast<double>(repeated) / static_cast<double>(model.layers);
}

}  // namespace

model::GptConfig as_run(const model::GptConfig& model, const Workload& w) {
  model::GptConfig ran = model;
  ran.fused = w.fused_ops;
  return ran;
}

ActivationOptions activation_options(const model::GptConfig& model, const Workload& w, const Layout& l) {
  ActivationOptions options{l.micro_batch, l.dims.tp, l.dims.sequence_parallel, l.dims.cp, l.dims.cp_impl,
                            l.activation_checkpoint, w.attention, w.dropout, w.precision, rank_moe_load(model, w, l.dims.ep)};
  options.selective = w.selective;
  options.norm_kernels = w.norm_kernels;
  options.lora = w.lora.enabled();
  options.bf16_attention = w.bf16_attention;
  options.fused_ops = w.fused_ops;
  options.repeated_kv = repeated_kv_share(model, w);
  return options;
}

namespace {

StepActivations step_activations(const model::GptConfig& model_config, const Workload& w, const Layout& l, const Sizes& z,
                                 bool loss_in_backward) {
  const model::GptConfig model = as_run(model_config, w);
  const Precision& p = w.precision;
  ActivationOptions options = activation_options(model, w, l);
  StepActivations a;
  const double dense_kept = layer_activation_bytes(model, options), moe_kept = layer_activation_bytes(model, options, true, l.dims.ep);
  a.glu_made_again = glu_output_made_again(model, options);
  a.per_layer = dense_kept + lora_activation_bytes(model, w.lora, options, false);
  a.per_moe_layer = moe_kept + lora_activation_bytes(model, w.lora, options, true);
  options.recompute = parallel::CheckpointMode::kNone;
  const double dense_full = layer_activation_bytes(model, options);
  const double moe_full = model.moe() ? layer_activation_bytes(model, options, true, l.dims.ep) : 0.0;
  a.full_layer = std::max(dense_full, moe_full);
  if (op_level_recompute(l, w)) {
    a.op_level_recomputed = std::max({0.0, dense_full - dense_kept, model.moe() ? moe_full - moe_kept : 0.0});
  }
  // A step's loss adds dW into .grad in its forward (Note [Head's gradient into .grad]) on the
  // CPU where .grad persists in fp32 (ZeRO-0/1, fp32 parameters: ZeRO-1's bf16 ones have bf16
  // gradients; offload moves gradients only from ZeRO-2 on).
  const bool into_grad = !w.gpu && l.dims.zero_stage <= 1 && p.grad == 4 && l.param_dtype == at::kFloat;
  const model::LossGradients when = loss_in_backward ? model::LossGradients::kInBackward
                                    : into_grad      ? model::LossGradients::kIntoWeightGrad
                                                     : model::LossGradients::kInForward;
  a.out = output_bytes(model, z, p, w.fused_loss, w.chunked_loss, w.loss_chunk_bytes, w.norm_kernels, when,
                       w.torch_loss_parallel);
  a.loss_into_grad = w.chunked_loss && when == model::LossGradients::kIntoWeightGrad;
  // The fused lookups add their rows into .grad where it persists, in the parameters' dtype.
  a.embedding_into_grad = !w.gpu && l.dims.zero_stage <= 1 && w.fused_ops;
  a.boundary = p.residual * z.region(z.u);  // one activation (or its gradient) sent between stages
  return a;
}

// Whether ZeRO-2's gradients under a pipeline are FSDP2's under torch's
// pipelining (Workload::torch_pipeline_fsdp): unsharded fp32 ones, which the
// pipeline's walk counts as they appear (peak_of_rank), no shard persisting.
bool torch_pipeline_gradients(const Workload& w, const Layout& l) {
  return w.torch_pipeline_fsdp && l.dims.pp > 1 && l.dims.zero_stage >= 2;
}

// Parameters, gradients and optimizer states of `psi` parameters on a rank,
// sharded as the ZeRO stage shards them, and what offload moves to the host.
// `trained`: of those, the ones that take gradients and optimizer states (all but LoRA's frozen base).
// `walked_gradients`: torch_pipeline_gradients, none here.
MemoryBreakdown model_states(const Precision& p, const Layout& l, double psi, double trained, bool walked_gradients) {
  const double shards = static_cast<double>(l.shards());
  MemoryBreakdown states;
  states.parameters = p.param * psi / (l.dims.zero_stage >= 3 ? shards : 1);
  states.gradients = p.grad * trained / (l.dims.zero_stage >= 2 ? shards : 1);
  if (walked_gradients) states.gradients = 0;
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
  const model::GptConfig& model;
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
  // FSDP2 under torch's pipelining (Workload::torch_pipeline_fsdp): gradient
  // sync is off for every micro-batch and the reduction runs after the last
  // backward, so a chunk's unsharded gradients, fp32 (the reduce dtype), exist
  // from its first backward (counted from that backward's start) until the
  // reduction; each block's backward also holds its 16-bit gradient until
  // FSDP2 adds it in; and the last stage keeps every micro-batch's output,
  // the 16-bit logits, to the step's end (the schedule returns them).
  const bool torch_pipeline = torch_pipeline_gradients(w, l);
  double grads = 0;
  std::vector<bool> has_gradients(c.blocks.size(), false);
  auto chunk_trained = [&](int stage) {
    return static_cast<double>(c.blocks[stage] - c.moe_blocks[stage]) * r.trained_block +
           static_cast<double>(c.moe_blocks[stage]) * r.trained_moe_block + (stage == 0 ? r.trained(r.embedding) : 0) +
           (stage == chunks - 1 ? r.trained(r.head) : 0);
  };
  const double block_gradient = torch_pipeline ? p.grad * largest_trained : 0;
  const double returned_output =
      torch_pipeline ? p.activation * z.tokens * static_cast<double>(t.model.vocab_size) / z.t : 0;
  MemoryBreakdown peak = states;
  double peak_bytes = -1;
  auto consider = [&](const char* moment, double activations, double outputs, double buffers, double work) {
    const double bytes = activations + outputs + buffers + work + grads;
    if (bytes <= peak_bytes) return;
    peak_bytes = bytes;
    peak.moment = moment;
    peak.gradients = states.gradients + grads;
    peak.activations = activations, peak.outputs = outputs, peak.buffers = buffers, peak.workspace = work;
  };
  // Autocast's 16-bit copies of a stage's matrices (Precision::weight_copy;
  // none of a 16-bit LoRA base): saved for the stage's backward, or under
  // full recompute held in autocast's cache until the stage's forward ends
  // and made again, a block at a time, by the recompute.
  const double copy = r.lora && w.lora.base_dtype != at::kFloat ? 0 : p.weight_copy;
  const bool full = l.activation_checkpoint == parallel::CheckpointMode::kFull;
  auto stage_copies = [&](int stage) {
    return copy * (static_cast<double>(c.blocks[stage] - c.moe_blocks[stage]) * (r.block - r.uncopied_block) +
                   static_cast<double>(c.moe_blocks[stage]) * (r.moe_block - r.uncopied_moe_block));
  };
  const double largest_copied = rank.moe_layers > 0 ? std::max(r.block - r.uncopied_block, r.moe_block - r.uncopied_moe_block)
                                                     : r.block - r.uncopied_block;
  auto stage_bytes = [&](int stage) {
    double bytes = static_cast<double>(c.blocks[stage] - c.moe_blocks[stage]) * a.per_layer +
                   static_cast<double>(c.moe_blocks[stage]) * a.per_moe_layer + (full ? 0 : stage_copies(stage));
    if (stage == 0 && w.dropout > 0) bytes += p.mask * z.region(z.u);  // the embedding's dropout mask
    return bytes;
  };
  // A head tied to the embedding (one stage holds both, so each backward
  // action runs the loss's and the embedding's): the head's gradient waits in
  // autograd's buffer from the loss's backward to the embedding's, whose
  // dense gradient then joins it. None waits where the loss's forward added
  // it into .grad (Note [Head's gradient into .grad]).
  const double vocab_weight = z.split(static_cast<double>(t.model.vocab_size)) * static_cast<double>(t.model.width);
  const double tied_wait =
      t.model.tie_embeddings && l.dims.pp == 1 && !a.loss_into_grad ? p.grad * r.trained(vocab_weight) : 0;
  double stash = 0, kept_outputs = 0, sends = 0;
  int stashed = 0;
  for (const pipeline::Action& act : actions) {
    const bool loss_stage = act.stage == chunks - 1;
    if (act.kind == pipeline::ActionKind::kForward) {
      stash += stage_bytes(act.stage);
      rank.in_flight = std::max<int64_t>(rank.in_flight, ++stashed);
      // Under full recompute autocast's cache holds the stage's copies to its forward's end.
      const double cached = full ? stage_copies(act.stage) : 0;
      if (loss_stage) {
        kept_outputs += a.out.kept + returned_output;
        consider("forward end", stash + cached, kept_outputs + a.out.forward, sends + (gathers ? p.param * root_unit : 0), 0);
      } else {
        if (cached > 0) consider("forward end", stash + cached, kept_outputs, sends, 0);
        sends += a.boundary;
      }
    } else if (act.kind == pipeline::ActionKind::kBackward) {
      if (torch_pipeline && !has_gradients[act.stage]) {
        has_gradients[act.stage] = true;
        grads += 4 * chunk_trained(act.stage);
      }
      if (loss_stage) {
        consider("loss backward", stash, kept_outputs + a.out.backward,
                 sends + (gathers ? p.param * root_unit + p.grad * r.trained(root_unit) : 0), 0);
        kept_outputs += tied_wait - a.out.kept;
      }
      // ZeRO-3: the gathered unit, and the gradients of a dense block's
      // size beside the layer's saved tensors. A MoE block's backward
      // starts with its experts, whose workspace is freed before any of
      // the block's gradients exist; its expert gradients complete (then
      // are reduced) once its saved tensors are freed.
      const double recomputed =
          full ? a.full_layer + copy * largest_copied : a.op_level_recomputed;
      if (gathers && rank.moe_layers > 0) {
        const double gathered = sends + p.param * (root_unit + r.moe_block);
        consider("layer backward", stash, kept_outputs, gathered, moe_workspace + recomputed);
        const double dense = sends + p.param * (root_unit + r.block) + p.grad * r.trained_block;
        if (rank.layers > rank.moe_layers) consider("layer backward", stash, kept_outputs, dense, dense_workspace + recomputed);
      } else {
        const double gathered = sends + (gathers ? p.param * (root_unit + r.block) + p.grad * r.trained_block : 0);
        consider("layer backward", stash, kept_outputs, gathered,
                 std::max(dense_workspace, moe_workspace) + recomputed + block_gradient);
      }
      const double gathered = sends + (gathers ? p.param * (root_unit + largest_block) : 0);
      if (gathers && rank.moe_layers > 0) {
        consider("unit gradients", std::max(0.0, stash - a.per_moe_layer), kept_outputs,
                 gathered + p.grad * largest_trained, 0);
      }
      stash -= stage_bytes(act.stage);
      --stashed;
      if (act.stage > 0) {
        sends += a.boundary;
      } else {  // the embedding's dense gradient (none in place), then the tied head's joins it
        consider("embedding backward", stash, kept_outputs, sends + (gathers ? p.param * root_unit : 0),
                 a.embedding_into_grad ? 0 : p.grad * r.trained(r.embedding));
        kept_outputs -= tied_wait;
      }
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
  // Under torch's pipelining the unsharded gradients are reduced into fp32 shards before it.
  const double reduced = grads / static_cast<double>(l.shards());
  grads = 0;
  consider("optimizer step", 0, 0, 0, optimizer_work + reduced);
  return peak;
}

}  // namespace

std::vector<RankMemory> estimate_memory(const model::GptConfig& model, const Workload& w, const Layout& l,
                                        int64_t microbatches) {
  check_layout(model, l, microbatches);
  const Sizes z = sizes(model, l.micro_batch, l.dims.tp, l.dims.sequence_parallel, l.dims.cp);
  const pipeline::Schedule& schedule = schedule_of(l, microbatches);
  const bool loss_in_backward = l.dims.pp > 1 && pipeline::losses_in_flight(schedule) > 1;
  const StepActivations activations = step_activations(model, w, l, z, loss_in_backward);
  const StepTerms terms{model,
                        l,
                        w,
                        z,
                        rank_parameters(model, l, w.lora),
                        activations,
                        chunks_of(model, l),
                        layer_backward_workspace(as_run(model, w), z, w.precision, false, 1, 0, activations.glu_made_again),
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
    rank.memory = peak_of_rank(rank, model_states(w.precision, l, psi, trained, torch_pipeline_gradients(w, l)),
                               schedule.actions[pr], terms);
    ranks.push_back(rank);
  }
  return ranks;
}

}  // namespace meshtrain::plan
