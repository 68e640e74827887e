// The rules of transformer operators, with the local kernels that some of
// them need: embedding (also vocabulary-split), layer norm, scaled
// dot-product attention, cat, softmax over a split dim, the negative
// log-likelihood over a split vocabulary, random operators.
// See Note [Distributed tensors] and Note [Kernels with collectives].
#include "meshtrain/annotate/dist_tensor.h"
#include "meshtrain/annotate/report.h"
#include "meshtrain/annotate/rules.h"
#include "meshtrain/placement/redistribute.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <stdexcept>

namespace meshtrain::annotate {

// Note [Kernels with collectives]
// Most operators run as themselves on the local pieces. A few keep a dim
// split where the operator reads all of it, and do the rest with a small
// collective of their own (listed in the sharding report):
// - embedding with the vocabulary split: ids outside this rank's rows look
//   up zeros, the output is Partial (Megatron's vocab-parallel embedding);
// - softmax / log_softmax over a split dim: the max and the sum of
//   exponentials are all-reduced (one number per row each);
// - nll_loss over a split vocabulary: each rank picks the targets in its
//   rows, the loss is Partial; with rows split, the count of targets is
//   all-reduced for the mean. Together with log_softmax this is
//   cross-entropy over a split vocabulary without gathering the logits;
// - random operators (dropout's mask) draw the global value from the
//   generator, which is in the same state on every rank as in one process,
//   and keep this rank's piece: the result equals one process's.

using placement::Placement;
using Placements = std::vector<Placement>;

using namespace rule_names;

namespace {

// The axes along which `want` splits `dim`.
std::vector<std::string> axes_splitting(const Call& call, const Placements& want, int64_t dim) {
  std::vector<std::string> axes;
  for (size_t k = 0; k < want.size(); ++k) {
    if (want[k].is_shard(dim)) axes.push_back(call.mesh->layout().axes()[k].name);
  }
  return axes;
}

void all_reduce(const Call& call, const at::Tensor& t, const std::vector<std::string>& axes, comm::ReduceOp op) {
  if (axes.empty()) return;
  const auto& group = call.mesh->comm(axes);
  const int64_t n = group->size();  // ring all-reduce: 2(n-1)/n of the tensor sent
  note_collective(call.name, "all_reduce", axes, 2 * (n - 1) * t.numel() * t.element_size() / n);
  group->all_reduce(t, op).wait();
}

// This rank's first index along `dim` of a tensor of `shape` in `want`.
int64_t first_index(const Call& call, const std::vector<int64_t>& shape, const Placements& want, int64_t dim) {
  const placement::TensorSpec spec = spec_on(*call.mesh, shape, want);
  return placement::local_boxes(spec, call.mesh->layout(), call.mesh->rank()).front().offsets[dim];
}

// --- Embedding ----------------------------------------------------------------

void embedding(Call& call) {
  const int64_t last = static_cast<int64_t>(call.out_shapes.front().size()) - 1;
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    const Placement& w = call.inputs[0].spec.placements[axis];
    const Placement& x = call.inputs[1].spec.placements[axis];
    std::vector<Option> options = {{{S(0), R}, P}, {{S(1), R}, S(last)}};
    if (x.is_shard()) options.push_back({{R, x}, x});
    if (w.is_partial()) options.push_back({{P, R}, P});
    options.push_back({{R, R}, R});
    apply(call, axis, cheapest(call, axis, options));
  }
  call.kernel = [](const Call& c, std::vector<c10::IValue> args) -> std::vector<c10::IValue> {
    const at::Tensor weight = args[0].toTensor(), ids = args[1].toTensor();
    const int64_t lo = first_index(c, c.inputs[0].spec.shape, c.inputs[0].want, 0), rows = weight.size(0);
    if (rows == c.inputs[0].spec.shape[0]) return {at::embedding(weight, ids)};
    const at::Tensor mine = (ids >= lo).logical_and(ids < lo + rows);
    const at::Tensor out = at::embedding(weight, at::where(mine, ids - lo, 0));
    return {out * mine.unsqueeze(-1).to(out.scalar_type())};
  };
}

// --- Layer norm ---------------------------------------------------------------

// Options that split a batch dim (one the operator keeps apart) of operand `lead`.
std::vector<int64_t> batch_splits(const Call& call, size_t axis, const std::vector<size_t>& leads, int64_t batch_dims) {
  std::vector<int64_t> dims;
  for (size_t i : leads) {
    const Placement& p = call.inputs[i].spec.placements[axis];
    if (p.is_shard() && p.blocks == 1 && p.dim < batch_dims && std::find(dims.begin(), dims.end(), p.dim) == dims.end()) {
      dims.push_back(p.dim);
    }
  }
  return dims;
}

void layer_norm(Call& call) {
  const int64_t rank = static_cast<int64_t>(call.inputs[0].spec.shape.size());
  const int64_t batch_dims = rank - static_cast<int64_t>(call.args[1].toIntList().size());
  const size_t n = call.inputs.size();
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    std::vector<Option> options;
    for (int64_t d : batch_splits(call, axis, {0}, batch_dims)) {
      Option o{Placements(n, R), S(d)};
      o.inputs[0] = S(d);
      options.push_back(o);
    }
    options.push_back({Placements(n, R), R});
    apply(call, axis, cheapest(call, axis, options));
  }
}

// grad_out, input, mean, rstd, [weight], [bias] -> grad_input, grad_weight, grad_bias.
void layer_norm_backward(Call& call) {
  const int64_t rank = static_cast<int64_t>(call.inputs[1].spec.shape.size());
  const int64_t batch_dims = rank - static_cast<int64_t>(call.args[2].toIntList().size());
  const size_t n = call.inputs.size();
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    std::vector<Option> options;
    for (int64_t d : batch_splits(call, axis, {0, 1}, batch_dims)) {
      Option o{Placements(n, R), S(d)};
      for (size_t i = 0; i < 4 && i < n; ++i) o.inputs[i] = S(d);
      options.push_back(o);
    }
    // (A partial gradient is summed here, though the operator is linear in
    // it: carried on, it would reach the matmuls before, which then gather
    // weights or sum it twice. Megatron sums it at the same place.)
    options.push_back({Placements(n, R), R});
    const Option chosen = cheapest(call, axis, options);
    apply(call, axis, chosen);
    // The parameters' gradients sum over whatever the input was split by.
    for (size_t out = 1; out < call.out_placements.size(); ++out) {
      call.out_placements[out][axis] = chosen.out.is_shard() ? P : chosen.out;
    }
  }
}

// --- Attention: batch and heads apart -------------------------------------------

// q, k, v, [mask] (forward) or grad_out, q, k, v, out, logsumexp, [mask] (backward).
void attention(Call& call, bool backward) {  // (a partial gradient is summed first, as for layer norm)
  const size_t tensors = backward ? 6 : 3;
  const at::Tensor& q = call.inputs[backward ? 1 : 0].tensor;
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    std::vector<Option> options;
    for (int64_t d : {0, 1}) {
      Option o{{}, S(d)};
      for (size_t i = 0; i < call.inputs.size(); ++i) {
        const Operand& in = call.inputs[i];
        const bool splits = i < tensors || (in.spec.shape.size() == 4 && in.spec.shape[d] == q.size(d));
        o.inputs.push_back(splits ? S(d) : R);
      }
      options.push_back(o);
    }
    options.push_back({Placements(call.inputs.size(), R), R});
    apply(call, axis, cheapest(call, axis, options));
  }
}

// --- Concatenation --------------------------------------------------------------

void cat(Call& call) {
  const int64_t rank = static_cast<int64_t>(call.out_shapes.front().size());
  const int64_t dim = wrap_dim(call.args.size() > 1 ? call.args[1].toInt() : 0, rank);
  const size_t n = call.inputs.size();
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    std::vector<Option> options;
    bool partial = false;
    for (const Operand& in : call.inputs) {
      const Placement& p = in.spec.placements[axis];
      partial = partial || p.is_partial();
      if (p.is_shard() && p.dim != dim && p.blocks == 1 && static_cast<int64_t>(in.spec.shape.size()) == rank) {
        options.push_back({Placements(n, p), p});
      }
    }
    // Pieces each split along the cat dim alike: the result is split in as many blocks (q, k, v's gradients).
    bool pieces = n > 1;
    for (const Operand& in : call.inputs) {
      pieces = pieces && in.spec.placements[axis] == S(dim) && in.spec.shape == call.inputs.front().spec.shape;
    }
    if (pieces) options.push_back({Placements(n, S(dim)), Placement::shard(dim, static_cast<int64_t>(n))});
    if (partial) options.push_back({Placements(n, P), P});
    options.push_back({Placements(n, R), R});
    apply(call, axis, cheapest(call, axis, options));
  }
}

// --- Backward of slicing views: the gradient placed back in a zero tensor ------

// slice_backward(grad, input_sizes, dim, ...) / select_backward(grad, input_sizes, dim, index).
void view_backward(Call& call) {
  const int64_t rank = static_cast<int64_t>(call.out_shapes.front().size());
  const int64_t dim = wrap_dim(call.args[2].toInt(), rank);
  const bool select = call.base == "select_backward";
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    const Placement& g = call.inputs[0].spec.placements[axis];
    const int64_t out_dim = g.is_shard() && select && g.dim >= dim ? g.dim + 1 : g.dim;
    if (g.is_shard() && (out_dim == dim || g.blocks > 1)) {
      apply(call, axis, {{R}, R});
    } else {
      apply(call, axis, {{g}, g.is_shard() ? S(out_dim) : g});  // Partial stays: zeros around a partial sum
    }
  }
}

// --- Softmax over a split dim ---------------------------------------------------

at::Tensor split_softmax(const Call& c, const at::Tensor& x, int64_t dim, bool log) {
  const std::vector<std::string> axes = axes_splitting(c, c.inputs[0].want, dim);
  at::Tensor max = std::get<0>(x.max(dim, /*keepdim=*/true)).contiguous();
  all_reduce(c, max, axes, comm::ReduceOp::kMax);
  const at::Tensor e = (x - max).exp();
  at::Tensor sum = e.sum(dim, /*keepdim=*/true).contiguous();
  all_reduce(c, sum, axes, comm::ReduceOp::kSum);
  return log ? x - max - sum.log() : e / sum;
}

void softmax_split(Call& call, int64_t dim) {
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    for (Operand& o : call.inputs) o.want.push_back(call.inputs.front().spec.placements[axis]);
    for (auto& out : call.out_placements) out[axis] = call.inputs.front().spec.placements[axis];
  }
  const std::string base = call.base;
  call.kernel = [base, dim](const Call& c, std::vector<c10::IValue> args) -> std::vector<c10::IValue> {
    const at::Tensor a = args[0].toTensor();
    if (base == "_softmax" || base == "_log_softmax") {
      const at::Tensor x = args[2].toBool() ? a.to(at::kFloat) : a;
      return {split_softmax(c, x, dim, base == "_log_softmax")};
    }
    const at::Tensor b = args[1].toTensor();
    // Backward: a = grad_output, b = output; the sum along dim is all-reduced.
    const std::vector<std::string> axes = axes_splitting(c, c.inputs[0].want, dim);
    const bool log = base == "_log_softmax_backward_data";
    at::Tensor sum = (log ? a : a * b).sum(dim, /*keepdim=*/true).contiguous();
    all_reduce(c, sum, axes, comm::ReduceOp::kSum);
    const at::Tensor grad = log ? a - b.exp() * sum : b * (a - sum);
    return {grad.to(args[3].toScalarType())};
  };
}

// --- Negative log-likelihood (cross-entropy's second half) ---------------------

// Targets relative to this rank's classes; others (and ignored ones) ignored.
// `self` is the operand index of the [N, C] input.
at::Tensor local_targets(const Call& c, size_t self, const at::Tensor& target, int64_t classes, int64_t ignore) {
  if (classes == c.inputs[self].spec.shape[1]) return target;
  const int64_t lo = first_index(c, c.inputs[self].spec.shape, c.inputs[self].want, 1);
  const at::Tensor mine = (target >= lo).logical_and(target < lo + classes);
  return at::where(mine, target - lo, ignore);
}

// nll_loss_forward(self [N, C], target [N], weight, reduction, ignore_index) -> (output, total_weight).
void nll_loss(Call& call) {
  if (call.inputs.size() != 2 || call.inputs[0].spec.shape.size() != 2) {
    throw std::runtime_error("sharding annotations: aten::nll_loss_forward is ruled for [N, C] inputs without class "
                             "weights; redistribute its inputs to Replicate before it");
  }
  const int64_t reduction = call.args[3].toInt();
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    const Placement out = reduction == 0 ? S(0) : P;  // rows: per-row losses, or a partial sum
    std::vector<Option> options = {{{S(1), R}, P}, {{S(0), S(0)}, out}};
    if (call.inputs[0].spec.placements[axis].is_partial()) options.push_back({{P, R}, P});
    options.push_back({{R, R}, R});
    apply(call, axis, cheapest(call, axis, options));
    call.out_placements[1][axis] = R;  // total_weight: the global count
  }
  call.kernel = [reduction](const Call& c, std::vector<c10::IValue> args) -> std::vector<c10::IValue> {
    const at::Tensor self = args[0].toTensor(), target = args[1].toTensor();
    const int64_t ignore = args[4].toInt();
    const at::Tensor local = local_targets(c, 0, target, self.size(1), ignore);
    at::Tensor out = std::get<0>(at::nll_loss_forward(self, local, {}, reduction == 1 ? 2 : reduction, ignore));
    if (reduction == 0) return {out, at::zeros({}, self.options())};
    at::Tensor count = (target != ignore).sum().to(self.scalar_type()).reshape({1});
    all_reduce(c, count, axes_splitting(c, c.inputs[1].want, 0), comm::ReduceOp::kSum);
    const at::Tensor total = count.reshape({});
    return {reduction == 1 ? out / total : out, total};
  };
}

// nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight) -> grad_self.
void nll_loss_backward(Call& call) {
  const int64_t reduction = call.args[4].toInt();
  call.inputs[1].shape_only = true;  // self: only its shape is read
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    const Placement& self = call.inputs[1].spec.placements[axis];
    const Placement& target = call.inputs[2].spec.placements[axis];
    const Placement& grad = call.inputs[0].spec.placements[axis];
    std::vector<Option> options;
    // grad_output, self, target, [weight], total_weight
    Placements rows = {reduction == 0 ? S(0) : R, S(0), S(0)}, classes = {R, S(1), R}, whole = {R, R, R};
    Placements partial = {P, self.is_shard() ? R : self, R};
    for (size_t i = 3; i < call.inputs.size(); ++i) {
      rows.push_back(R), classes.push_back(R), whole.push_back(R), partial.push_back(R);
    }
    if (self.is_shard(1)) options.push_back({classes, S(1)});
    if (self.is_shard(0) || target.is_shard(0)) options.push_back({rows, S(0)});
    if (grad.is_partial()) options.push_back({partial, P});
    options.push_back({whole, R});
    apply(call, axis, cheapest(call, axis, options));
  }
  call.kernel = [reduction](const Call& c, std::vector<c10::IValue> args) -> std::vector<c10::IValue> {
    const at::Tensor grad = args[0].toTensor(), self = args[1].toTensor(), target = args[2].toTensor();
    const int64_t ignore = args[5].toInt();
    const at::Tensor local = local_targets(c, 1, target, self.size(1), ignore);
    return {at::nll_loss_backward(grad, self, local, {}, reduction, ignore, args[6].toTensor())};
  };
}

// --- Random operators -----------------------------------------------------------

void random(Call& call, const c10::OperatorHandle& op) {
  const Placements self = call.inputs.front().spec.placements;
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    const Placement out = self[axis].is_partial() ? R : self[axis];
    for (Operand& o : call.inputs) o.want.push_back(&o == &call.inputs.front() && call.inplace ? out : R);
    if (!call.inplace) call.inputs.front().want.back() = R;
    for (auto& p : call.out_placements) p[axis] = call.inplace ? out : R;
  }
  if (call.inplace) call.inputs.front().shape_only = true;  // overwritten
  call.kernel = [op](const Call& c, std::vector<c10::IValue> args) -> std::vector<c10::IValue> {
    if (!c.inplace) {
      torch::jit::Stack stack(args.begin(), args.end());
      op.callBoxed(&stack);
      return stack;
    }
    at::Tensor local = args[0].toTensor();
    const placement::TensorSpec spec = spec_on(*c.mesh, c.inputs[0].spec.shape, c.inputs[0].want);
    args[0] = at::empty(spec.shape, local.options());
    torch::jit::Stack stack(args.begin(), args.end());
    op.callBoxed(&stack);
    local.copy_(placement::local_of(stack.front().toTensor(), spec, c.mesh->layout(), c.mesh->rank()));
    return {local};
  };
}

// --- Embedding's backward, in the weight's placements ---------------------------

// The gradient of embedding's weight, computed where the weight lives: the
// rows of a vocabulary-split weight from the whole output gradient, a
// replicated weight's from the batch pieces (Partial, summed where the
// optimizer needs it).
at::Tensor embedding_weight_grad(const at::Tensor& grad, const at::Tensor& ids, const at::Tensor& weight) {
  const DistState& w = dist_state(weight);
  const mesh::DeviceMesh& mesh = *w.mesh;
  const placement::TensorSpec grad_spec = is_dist(grad) ? spec_of(grad) : spec_on(mesh, grad.sizes().vec());
  const placement::TensorSpec ids_spec = is_dist(ids) ? spec_of(ids) : spec_on(mesh, ids.sizes().vec());
  const int64_t last = grad.dim() - 1;
  Placements grad_want, ids_want, out;
  for (size_t k = 0; k < w.placements.size(); ++k) {
    const Placement& p = w.placements[k];
    const Placement& x = ids_spec.placements[k];
    const Placement& g = grad_spec.placements[k];
    if (p.is_shard(0)) {
      grad_want.push_back(R), ids_want.push_back(R), out.push_back(p);
    } else if (p.is_shard(1)) {
      grad_want.push_back(S(last)), ids_want.push_back(R), out.push_back(p);
    } else if (x.is_shard() || (g.is_shard() && g.dim < last && grad_spec.shape[g.dim] % mesh.layout().axes()[k].size == 0)) {
      const Placement d = x.is_shard() ? x : g;
      grad_want.push_back(d), ids_want.push_back(d), out.push_back(P);
    } else {
      grad_want.push_back(g.is_partial() ? P : R), ids_want.push_back(R), out.push_back(g.is_partial() ? P : R);
    }
  }
  const at::Tensor g = local_as(grad, grad_want, mesh, "embedding_dense_backward");
  const at::Tensor x = local_as(ids, ids_want, mesh, "embedding_dense_backward");
  const placement::TensorSpec out_spec = spec_on(mesh, weight.sizes().vec(), out);
  const placement::Box box = placement::local_boxes(out_spec, mesh.layout(), mesh.rank()).front();
  const int64_t lo = box.offsets[0], rows = box.sizes[0];
  // Ids outside this rank's rows go to one extra row, dropped after.
  const at::Tensor mine = (x >= lo).logical_and(x < lo + rows);
  at::Tensor local = at::embedding_dense_backward(g, at::where(mine, x - lo, rows), rows + 1, -1, false).narrow(0, 0, rows);
  if (reporting()) {
    note_operator({"embedding_dense_backward (weight " + spec_of(weight).str() + ")",
                   {spec_on(mesh, grad_spec.shape, grad_want).str(), spec_on(mesh, ids_spec.shape, ids_want).str()},
                   {out_spec.str()}});
  }
  if (box.sizes[1] != local.size(1)) local = local.narrow(1, 0, box.sizes[1]);
  return from_local(local.contiguous(), w.mesh, out, weight.sizes().vec());
}

class Embedding : public torch::autograd::Function<Embedding> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& weight, const at::Tensor& ids) {
    ctx->save_for_backward({weight, ids});
    at::AutoDispatchBelowADInplaceOrView guard;
    return at::embedding(weight, ids);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {embedding_weight_grad(grads[0], saved[1], saved[0]), at::Tensor()};
  }
};

void embedding_autograd(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  std::vector<c10::IValue> args(stack->end() - 5, stack->end());
  torch::jit::drop(*stack, 5);
  const at::Tensor weight = args[0].toTensor(), ids = args[1].toTensor();
  if (args[2].toSymInt().guard_int(__FILE__, __LINE__) != -1 || args[3].toBool() || args[4].toBool()) {
    throw std::runtime_error("sharding annotations: embedding with padding_idx, scale_grad_by_freq or sparse has no "
                             "sharding rule; use a plain embedding");
  }
  if (!is_dist(weight)) {  // distributed ids, a plain table: the table is Replicate
    throw std::runtime_error("sharding annotations: embedding of distributed ids needs its table annotated too");
  }
  torch::jit::push(*stack, Embedding::apply(weight, ids));
}

// linear on a 3-d input with a bias, as one addmm on the flattened rows
// (what at::linear does for contiguous plain tensors; its decomposition
// would otherwise take the matmul path and add the bias in a second pass).
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (bias && bias->defined() && input.dim() == 3 && input.is_contiguous()) {
    std::vector<int64_t> out = input.sizes().vec();
    out.back() = weight.size(0);
    return at::addmm(*bias, input.reshape({-1, input.size(2)}), weight.t()).view(out);
  }
  const at::Tensor y = at::matmul(input, weight.t());
  return bias && bias->defined() ? y + *bias : y;
}

}  // namespace

void install_autograd_kernels() {
  static torch::Library library(torch::Library::IMPL, "aten", c10::DispatchKey::AutogradPrivateUse1, __FILE__, __LINE__);
  library.impl("embedding", torch::CppFunction::makeFromBoxedFunction<&embedding_autograd>());
  library.impl("linear", TORCH_FN(linear));
}

bool decide_with_kernel(Call& call) {
  const std::string& b = call.base;
  if (b == "embedding") return embedding(call), true;
  if (b == "native_layer_norm") return layer_norm(call), true;
  if (b == "native_layer_norm_backward") return layer_norm_backward(call), true;
  if (b == "_scaled_dot_product_flash_attention_for_cpu") return attention(call, false), true;
  if (b == "_scaled_dot_product_flash_attention_for_cpu_backward") return attention(call, true), true;
  if (b == "cat") return cat(call), true;
  if (b == "slice_backward" || b == "select_backward") return view_backward(call), true;
  if (b == "nll_loss_forward") return nll_loss(call), true;
  if (b == "nll_loss_backward") return nll_loss_backward(call), true;
  if (b == "_softmax" || b == "_log_softmax" || b == "_softmax_backward_data" || b == "_log_softmax_backward_data") {
    const int64_t rank = static_cast<int64_t>(call.inputs.front().spec.shape.size());
    const int64_t dim = wrap_dim(call.args[b == "_softmax" || b == "_log_softmax" ? 1 : 2].toInt(), rank);
    bool split = false, other = false;
    for (const Placement& p : call.inputs.front().spec.placements) {
      split = split || (p.is_shard(dim) && p.blocks == 1);
      other = other || p.is_partial() || (p.is_shard(dim) && p.blocks != 1);
    }
    for (const Operand& o : call.inputs) other = other || o.spec.placements != call.inputs.front().spec.placements;
    if (!split || other) return false;  // softmax() in rules.cpp: the dim whole
    return softmax_split(call, dim), true;
  }
  // (empty and its kin carry the tag too: their contents are arbitrary, not drawn)
  if (call.random && b.find("empty") == std::string::npos) return random(call, *call.op), true;
  return false;
}

}  // namespace meshtrain::annotate
