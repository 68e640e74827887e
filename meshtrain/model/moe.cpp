#include "meshtrain/model/moe.h"

#include "meshtrain/model/fused/ops.h"

#include <ATen/autocast_mode.h>

#include <cmath>
#include <optional>

namespace meshtrain::model {

namespace {

// Autocast off on a device for the lifetime of the object (the router stays fp32).
class AutocastOff {
 public:
  explicit AutocastOff(at::DeviceType type) : type_(type), was_(at::autocast::is_autocast_enabled(type)) {
    if (was_) at::autocast::set_autocast_enabled(type_, false);
  }
  ~AutocastOff() {
    if (was_) at::autocast::set_autocast_enabled(type_, true);
  }

 private:
  at::DeviceType type_;
  bool was_;
};

// Identity on the layer's output whose backward also hands `aux` the gradient
// `scale`: the auxiliary losses join the loss wherever the layer runs (a
// pipeline's middle stage too) without changing the value it reports.
struct AuxLoss : torch::autograd::Function<AuxLoss> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& out, const at::Tensor& aux,
                            double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->save_for_backward({aux});
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor aux = ctx->get_saved_variables()[0];
    return {grads[0], at::full_like(aux, ctx->saved_data["scale"].toDouble()), at::Tensor()};
  }
};

at::Tensor expert_parameter(torch::nn::Module& m, const std::string& name, std::vector<int64_t> shape) {
  return m.register_parameter(name, torch::zeros(shape));
}

// Note [Grouped experts]
// The experts' products over tokens grouped by expert (rows counts[0], then
// counts[1], ...) as one autograd node per weight tensor [experts, out, in]:
// each group's product is written into its rows of one output, and backward
// writes each expert's weight gradient into its slice of one [experts, out,
// in] tensor and each group's input gradient into its rows of one tensor.
// Per expert through at::linear, an unbind's backward stacked the experts'
// gradients (a copy of every expert's weights per micro-batch), the outputs
// and the input gradients were concatenated, and every product was an
// autograd node of its own (Mixtral's tiny config: 216 MmBackward nodes a
// step). Taken without autocast and where x and the weights share a dtype;
// otherwise per expert as before. Its backward is not itself differentiable
// (no double backward through the experts; nothing here takes one).
struct GroupedLinear : torch::autograd::Function<GroupedLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& b, std::vector<int64_t> counts, int64_t offset) {
    int64_t rows_counted = 0;
    for (const int64_t n : counts) rows_counted += n;
    TORCH_CHECK(rows_counted == x.size(0) && offset >= 0 && offset + static_cast<int64_t>(counts.size()) <= w.size(0),
                "grouped experts: counts of ", counts.size(), " experts from ", offset, " sum to ", rows_counted,
                " rows for ", x.size(0), " tokens and ", w.size(0), " local experts");
    const at::Tensor y = at::empty({x.size(0), w.size(1)}, x.options());
    int64_t row = 0;
    for (size_t c = 0; c < counts.size(); ++c) {
      const int64_t n = counts[c], i = offset + static_cast<int64_t>(c);
      if (n == 0) continue;
      at::Tensor rows = y.narrow(0, row, n);
      at::mm_out(rows, x.narrow(0, row, n), w.select(0, i).t());
      if (b) rows.add_(b->select(0, i));
      row += n;
    }
    ctx->save_for_backward({x, w});
    ctx->saved_data["counts"] = counts;
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["bias"] = b.has_value();
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const at::Tensor dy = grads[0].contiguous();
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    const int64_t offset = ctx->saved_data["offset"].toInt();
    const bool want_x = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    const bool want_b = ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2);
    at::Tensor dx = want_x ? at::empty_like(x) : at::Tensor();
    at::Tensor dw = want_w ? at::empty_like(w) : at::Tensor();
    at::Tensor db = want_b ? at::zeros({w.size(0), w.size(1)}, w.options()) : at::Tensor();
    std::vector<bool> written(static_cast<size_t>(w.size(0)), false);
    int64_t row = 0;
    for (size_t c = 0; c < counts.size(); ++c) {
      const int64_t n = counts[c], i = offset + static_cast<int64_t>(c);
      if (n == 0) continue;
      written[static_cast<size_t>(i)] = true;
      const at::Tensor dyc = dy.narrow(0, row, n), xc = x.narrow(0, row, n);
      if (want_x) {
        at::Tensor rows = dx.narrow(0, row, n);
        at::mm_out(rows, dyc, w.select(0, i));
      }
      if (want_w) {
        at::Tensor slice = dw.select(0, i);
        at::mm_out(slice, dyc.t(), xc);
      }
      if (want_b) db.select(0, i).copy_(dyc.sum(0));
      row += n;
    }
    for (int64_t i = 0; want_w && i < w.size(0); ++i) {
      if (!written[static_cast<size_t>(i)]) dw.select(0, i).zero_();  // an expert without tokens
    }
    return {dx, dw, db, {}, {}};
  }
};

// Whether the experts' products take GroupedLinear (Note [Grouped experts]).
bool grouped_applies(const at::Tensor& x, const std::vector<at::Tensor>& weights) {
  if (at::autocast::is_autocast_enabled(x.device().type()) || !x.is_contiguous()) return false;
  for (const at::Tensor& t : weights) {
    if (t.scalar_type() != x.scalar_type() || t.device() != x.device()) return false;
  }
  return true;
}

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                          const std::vector<int64_t>& counts, int64_t offset) {
  return GroupedLinear::apply(x, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt, counts, offset);
}

// act(g) · u, through the fused operator where the tensors allow.
at::Tensor glu(const at::Tensor& g, const at::Tensor& u, bool geglu, bool fused) {
  if (fused && fused::eligible_anywhere(g) && fused::eligible_anywhere(u)) return geglu ? fused::geglu(g, u) : fused::swiglu(g, u);
  return (geglu ? at::gelu(g, "tanh") : at::silu(g)) * u;
}

}  // namespace

bool is_expert_tensor(const std::string& name) {
  const size_t at = name.find(".moe.");
  // The router and the shared expert are replicated like the dense layers.
  return at != std::string::npos && name.compare(at + 5, std::string::npos, "router") != 0 &&
         name.compare(at + 5, 6, "shared") != 0;
}

at::Tensor ExpertExchange::run(const at::Tensor& tokens, const std::vector<int64_t>& counts,
                               const ExpertCompute& compute) {
  return compute(tokens, counts, 0);
}

MoeImpl::MoeImpl(const GptConfig& config) : config_(config) {
  const int64_t e = config.moe_experts, d = config.width, h = config.expert_hidden();
  router = register_parameter("router", torch::zeros({e, d}));
  const bool bias = config.mlp_has_bias();
  if (config.mlp == MlpStyle::kGelu) {
    fc_weight = expert_parameter(*this, "fc_weight", {e, h, d});
    if (bias) fc_bias = expert_parameter(*this, "fc_bias", {e, h});
    proj_weight = expert_parameter(*this, "proj_weight", {e, d, h});
    if (bias) proj_bias = expert_parameter(*this, "proj_bias", {e, d});
  } else {
    gate_weight = expert_parameter(*this, "gate_weight", {e, h, d});
    if (bias) gate_bias = expert_parameter(*this, "gate_bias", {e, h});
    up_weight = expert_parameter(*this, "up_weight", {e, h, d});
    if (bias) up_bias = expert_parameter(*this, "up_bias", {e, h});
    down_weight = expert_parameter(*this, "down_weight", {e, d, h});
    if (bias) down_bias = expert_parameter(*this, "down_bias", {e, d});
  }
  if (const int64_t s = config.moe_shared_hidden; s > 0) {  // Qwen2-MoE: SwiGLU, no biases
    shared_gate = register_parameter("shared_gate", torch::zeros({s, d}));
    shared_up = register_parameter("shared_up", torch::zeros({s, d}));
    shared_down = register_parameter("shared_down", torch::zeros({d, s}));
    shared_expert_gate = register_parameter("shared_expert_gate", torch::zeros({1, d}));
  }
}

at::Tensor MoeImpl::shared_expert(const at::Tensor& flat) {
  const at::Tensor hidden = glu(at::linear(flat, shared_gate), at::linear(flat, shared_up), false, config_.fused);
  return at::sigmoid(at::linear(flat, shared_expert_gate)) * at::linear(hidden, shared_down);
}

std::vector<at::Tensor> MoeImpl::expert_weights() const {
  std::vector<at::Tensor> out;
  for (const at::Tensor* t : {&fc_weight, &fc_bias, &proj_weight, &proj_bias, &gate_weight, &gate_bias, &up_weight,
                              &up_bias, &down_weight, &down_bias}) {
    if (t->defined()) out.push_back(*t);
  }
  return out;
}

void MoeImpl::keep_experts(int64_t first, int64_t count) {
  torch::NoGradGuard no_grad;
  for (at::Tensor t : expert_weights()) t.set_data(t.narrow(0, first - first_expert_, count).clone());
  first_expert_ = first;
}

at::Tensor MoeImpl::experts(const at::Tensor& tokens, const std::vector<int64_t>& counts, int64_t first) {
  if (is_training()) computed_ += tokens.size(0);
  const bool gelu = fc_weight.defined();
  const bool geglu = config_.mlp == MlpStyle::kGeglu;
  if (grouped_applies(tokens, expert_weights())) {
    const int64_t offset = first - first_expert_;  // this rank's index of the first counted expert
    if (counts.empty()) return tokens.new_zeros({0, tokens.size(1)});
    const at::Tensor g = grouped_linear(tokens, gelu ? fc_weight : gate_weight, gelu ? fc_bias : gate_bias, counts, offset);
    const at::Tensor hidden = gelu ? at::gelu(g, "tanh")
                                   : glu(g, grouped_linear(tokens, up_weight, up_bias, counts, offset), geglu, config_.fused);
    return grouped_linear(hidden, gelu ? proj_weight : down_weight, gelu ? proj_bias : down_bias, counts, offset);
  }
  // One unbind per tensor: its backward stacks the experts' gradients once,
  // where indexing each expert would add a full-size zero gradient per expert.
  auto split = [](const at::Tensor& t) { return t.defined() ? t.unbind(0) : std::vector<at::Tensor>(); };
  auto bias = [](const std::vector<at::Tensor>& b, int64_t i) { return b.empty() ? at::Tensor() : b[i]; };
  const std::vector<at::Tensor> in = split(gelu ? fc_weight : gate_weight), in_bias = split(gelu ? fc_bias : gate_bias);
  const std::vector<at::Tensor> up = split(up_weight), up_b = split(up_bias);
  const std::vector<at::Tensor> out = split(gelu ? proj_weight : down_weight), out_bias = split(gelu ? proj_bias : down_bias);
  // One split: its backward concatenates the experts' input gradients once,
  // where a narrow per expert would add a zero gradient of all the tokens each.
  const std::vector<at::Tensor> xs = tokens.split_with_sizes(counts);
  std::vector<at::Tensor> outputs;
  for (size_t c = 0; c < counts.size(); ++c) {
    const int64_t i = first + static_cast<int64_t>(c) - first_expert_;  // this rank's index of the expert
    const at::Tensor& x = xs[c];
    const at::Tensor g = at::linear(x, in[i], bias(in_bias, i));
    const at::Tensor hidden =
        gelu ? at::gelu(g, "tanh") : glu(g, at::linear(x, up[i], bias(up_b, i)), geglu, config_.fused);
    outputs.push_back(at::linear(hidden, out[i], bias(out_bias, i)));
  }
  return outputs.empty() ? tokens.new_zeros({0, tokens.size(1)}) : at::cat(outputs);
}

MoeStats MoeImpl::stats() const {
  MoeStats s;
  s.forwards = forwards_;
  s.routed = static_cast<double>(routed_);
  s.computed = static_cast<double>(computed_);
  if (!sums_.defined()) return s;
  const at::Tensor sums = sums_.cpu();
  s.aux_loss = sums[0].item<double>();
  s.z_loss = sums[1].item<double>();
  s.dropped = sums[2].item<double>();
  s.load_max_over_mean = sums[3].item<double>();
  s.kept = kept_;
  s.routed_by_forward = routed_by_forward_;
  return s;
}

void MoeImpl::reset_stats() {
  forwards_ = routed_ = computed_ = 0;
  sums_ = at::Tensor();
  kept_.clear();
  routed_by_forward_.clear();
}

at::Tensor MoeImpl::forward(const at::Tensor& x) {
  const int64_t d = x.size(-1), e = config_.moe_experts, k = config_.moe_top_k;
  const at::Tensor flat = x.reshape({-1, d});
  const int64_t n = flat.size(0);
  at::Tensor logits;
  {
    AutocastOff fp32(x.device().type());
    logits = at::linear(flat.to(at::kFloat), router);  // [n, e]
  }
  const at::Tensor probs = at::softmax(logits, -1);
  auto [top, choice] = probs.topk(k, -1);  // [n, k]
  at::Tensor gates = top;
  at::Tensor wanted = at::ones({n, k}, choice.options().dtype(at::kBool));
  if (k >= 2 && config_.moe_norm_topk) gates = top / top.sum(-1, true);
  if (k == 2) {
    if (config_.moe_second_expert == SecondExpert::kRandom && is_training()) {
      const at::Tensor draw = at::rand({n}, probs.options());
      wanted.select(1, 1).copy_(draw < (2 * gates.select(1, 1)).clamp_max(1.0).detach());
    }
  }
  // Assignments in priority order: every token's first choice, then the second choices.
  const at::Tensor expert_of = choice.t().reshape(-1), wanted_flat = wanted.t().reshape(-1);
  const at::Tensor token_of = at::arange(n, choice.options()).repeat({k});
  const at::Tensor gate_of = gates.t().reshape(-1);
  const at::Tensor one_hot = at::one_hot(expert_of, e) * wanted_flat.unsqueeze(1).to(at::kLong);
  const at::Tensor position = (one_hot.cumsum(0) - 1).gather(1, expert_of.unsqueeze(1)).squeeze(1);
  const double cf = config_.moe_capacity_factor;
  const int64_t capacity = cf > 0 ? static_cast<int64_t>(std::ceil(static_cast<double>(n * k) * cf / e)) : n * k;
  const at::Tensor accepted = wanted_flat & (position < capacity);
  const at::Tensor computed_here =
      replicas_ > 1 ? accepted & (token_of.remainder(replicas_) == replica_) : accepted;

  // Grouped by expert, priority order kept inside each expert.
  const at::Tensor selected = computed_here.nonzero().squeeze(1);
  const at::Tensor experts_selected = expert_of.index_select(0, selected);
  const at::Tensor order = std::get<1>(experts_selected.sort(/*stable=*/true, 0, false));
  const at::Tensor tokens = token_of.index_select(0, selected).index_select(0, order);
  const at::Tensor token_gates = gate_of.index_select(0, selected).index_select(0, order);
  const at::Tensor per_expert = at::bincount(experts_selected, {}, e).cpu();
  const std::vector<int64_t> counts(per_expert.data_ptr<int64_t>(), per_expert.data_ptr<int64_t>() + e);

  const at::Tensor grouped = flat.index_select(0, tokens);
  const at::Tensor computed = exchange_->run(grouped, counts, [this](const at::Tensor& t, const std::vector<int64_t>& c,
                                                                     int64_t first) { return experts(t, c, first); });
  const at::Tensor weighted = computed * token_gates.unsqueeze(1).to(computed.scalar_type());
  at::Tensor out = at::zeros({n, d}, weighted.options()).index_add(0, tokens, weighted);
  if (shared_gate.defined()) {
    // Every token through the shared expert; under tensor parallel each
    // replica takes its share of the tokens, as it does of the routed ones.
    if (replicas_ > 1) {
      const at::Tensor mine = at::arange(replica_, n, replicas_, choice.options());
      out = out.index_add(0, mine, shared_expert(flat.index_select(0, mine)).to(out.scalar_type()));
    } else {
      out = out + shared_expert(flat).to(out.scalar_type());
    }
  }

  const at::Tensor first_share = at::one_hot(choice.select(1, 0), e).to(at::kFloat).mean(0);  // fᵢ
  const at::Tensor aux = config_.moe_aux_loss * e * (first_share * probs.mean(0)).sum();
  const at::Tensor z = config_.moe_z_loss * at::logsumexp(logits, -1).pow(2).mean();
  if (is_training()) {
    torch::NoGradGuard no_grad;
    const at::Tensor load = one_hot.sum(0).to(at::kDouble);
    const at::Tensor assignments = load.sum();
    const at::Tensor now = at::stack({aux.to(at::kDouble), z.to(at::kDouble),
                                      (assignments - accepted.sum().to(at::kDouble)) / assignments.clamp_min(1.0),
                                      load.max() / load.mean().clamp_min(1e-12)});
    sums_ = sums_.defined() ? sums_ + now : now;
    // Tensor parallel: this rank's share of the routing, the tokens t with t % replicas == replica.
    const int64_t routed = (n - replica_ + replicas_ - 1) / replicas_ * k;
    forwards_ += 1;
    routed_ += routed;
    if (kept_.size() < MoeStats::kForwardsKept) {
      kept_.emplace_back(counts.begin(), counts.end());
      routed_by_forward_.push_back(static_cast<double>(routed));
    }
  }
  if (is_training() && torch::GradMode::is_enabled()) {
    out = AuxLoss::apply(out, aux + z, aux_loss_scale_ / static_cast<double>(replicas_));
  }
  out = at::dropout(out, config_.dropout, is_training());
  return out.view(x.sizes());
}

}  // namespace meshtrain::model
