// The handler of every aten operator on distributed tensors: placements in,
// rule, redistribution, the operator on local tensors, placements out.
#include "meshtrain/annotate/dist_tensor.h"
#include "meshtrain/annotate/report.h"
#include "meshtrain/annotate/rules.h"
#include "meshtrain/placement/redistribute.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <optional>
#include <stdexcept>

namespace meshtrain::annotate {

using placement::Placement;

namespace {

// `args` with every operand replaced by `value(operand)`.
template <typename Value>
std::vector<c10::IValue> local_args(std::vector<c10::IValue> args, const std::vector<Operand>& inputs, Value value) {
  for (const Operand& o : inputs) {
    if (o.item < 0) {
      args[o.arg] = value(o);
    } else {
      c10::List<at::Tensor> list = args[o.arg].toTensorList().copy();
      list.set(o.item, value(o));
      args[o.arg] = list;
    }
  }
  return args;
}

// Calls `op` on `args` with every operand replaced by `value(operand)`; returns the outputs.
template <typename Value>
std::vector<c10::IValue> call_with(const c10::OperatorHandle& op, std::vector<c10::IValue> args,
                                   const std::vector<Operand>& inputs, Value value) {
  args = local_args(std::move(args), inputs, value);
  torch::jit::Stack stack(args.begin(), args.end());
  op.callBoxed(&stack);
  return stack;
}

// The output shapes of operators with no meta kernel on CPU builds.
std::optional<std::vector<std::vector<int64_t>>> known_shapes(const Call& call) {
  const std::string& b = call.base;
  auto shape = [&](size_t i) { return call.inputs.at(i).spec.shape; };
  if (b == "embedding") {  // ids' shape and the table's width
    std::vector<int64_t> out = shape(1);
    out.push_back(shape(0).back());
    return std::vector<std::vector<int64_t>>{out};
  }
  if (b == "native_layer_norm") {  // out, and mean / rstd with the normalised dims 1
    std::vector<int64_t> stats = shape(0);
    const size_t normalised = call.args[1].toIntList().size();
    for (size_t d = stats.size() - normalised; d < stats.size(); ++d) stats[d] = 1;
    return std::vector<std::vector<int64_t>>{shape(0), stats, stats};
  }
  if (b == "native_layer_norm_backward") {  // the input's, weight's and bias's
    const std::vector<int64_t> normalised = call.args[2].toIntList().vec();
    return std::vector<std::vector<int64_t>>{shape(1), normalised, normalised};
  }
  if (b == "_scaled_dot_product_flash_attention_for_cpu") {  // [B, H, L, Ev] and logsumexp [B, H, L]
    std::vector<int64_t> out = shape(0);
    out.back() = shape(2).back();
    return std::vector<std::vector<int64_t>>{out, {out[0], out[1], out[2]}};
  }
  if (b == "_scaled_dot_product_flash_attention_for_cpu_backward") return std::vector<std::vector<int64_t>>{shape(1), shape(2), shape(3)};
  return std::nullopt;
}

// Their strides, as the CPU kernels lay the outputs out (empty: row-major).
std::vector<int64_t> strides_in_order(const std::vector<int64_t>& shape, const std::vector<int64_t>& order) {
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t i = order.size(); i-- > 0;) {
    strides[order[i]] = stride;
    stride *= std::max<int64_t>(shape[order[i]], 1);
  }
  return strides;
}

std::vector<std::vector<int64_t>> known_strides(const Call& call) {
  std::vector<std::vector<int64_t>> strides(call.out_shapes.size());
  if (call.base == "_scaled_dot_product_flash_attention_for_cpu") {  // logsumexp in [B, L, H] order
    strides[1] = strides_in_order(call.out_shapes[1], {0, 2, 1});
  }
  if (call.base == "_scaled_dot_product_flash_attention_for_cpu_backward") {  // gradients in [B, L, H, E] order
    for (size_t i = 0; i < 3; ++i) strides[i] = strides_in_order(call.out_shapes[i], {0, 2, 1, 3});
  }
  return strides;
}

// Fills call.out_shapes and out_strides: the operator run on meta tensors
// with the inputs' global sizes and strides (the same on every rank).
void shape_outputs(const c10::OperatorHandle& op, Call& call) {
  if (auto shapes = known_shapes(call)) {
    call.out_shapes = *shapes;
    call.out_strides = known_strides(call);
    return;
  }
  std::vector<c10::IValue> outs;
  try {
    outs = call_with(op, call.args, call.inputs, [](const Operand& o) {
      return at::empty_strided(o.spec.shape, o.tensor.strides(), o.tensor.options().device(at::kMeta));
    });
  } catch (const std::exception& e) {
    throw std::runtime_error("sharding annotations: aten::" + call.name + " cannot be shaped on the global sizes: " +
                             e.what());
  }
  for (const c10::IValue& v : outs) {
    std::vector<at::Tensor> tensors;
    if (v.isTensor()) tensors.push_back(v.toTensor());
    if (v.isTensorList()) tensors = v.toTensorList().vec();
    for (const at::Tensor& t : tensors) {
      call.out_shapes.push_back(t.sizes().vec());
      call.out_strides.push_back(t.defined() ? t.strides().vec() : std::vector<int64_t>{});
    }
  }
}

at::Tensor local_in(const Operand& o, const Call& call) {
  const mesh::DeviceMesh& mesh = *call.mesh;
  if (o.shape_only && o.want != o.spec.placements) {
    const placement::TensorSpec spec = spec_on(mesh, o.spec.shape, o.want);
    return at::empty(placement::local_shape(spec, mesh.layout(), mesh.rank()), o.tensor.options());
  }
  return local_as(o.tensor, o.want, mesh, call.name);
}

void report(const Call& call) {
  ReportedOperator op;
  op.op = call.name;
  for (const Operand& o : call.inputs) {
    placement::TensorSpec spec = o.spec;
    spec.placements = o.want;
    op.inputs.push_back(o.spec.placements == o.want ? spec.str() : o.spec.str() + " -> " + spec.str());
  }
  for (size_t i = 0; i < call.out_shapes.size(); ++i) {
    op.outputs.push_back(spec_on(*call.mesh, call.out_shapes[i], call.out_placements[i]).str());
  }
  note_operator(std::move(op));
}

}  // namespace

static bool is_out_variant(const c10::FunctionSchema& schema) {
  for (const c10::Argument& a : schema.arguments()) {
    if (a.kwarg_only() && a.alias_info() && a.alias_info()->isWrite()) return true;
  }
  return false;
}

namespace {

// The tensor arguments (plain ones are Replicate) and the mesh they share.
std::shared_ptr<const mesh::DeviceMesh> collect_operands(Call& call) {
  std::shared_ptr<const mesh::DeviceMesh> mesh;
  for (size_t i = 0; i < call.args.size(); ++i) {
    const c10::IValue& v = call.args[i];
    std::vector<std::pair<at::Tensor, int64_t>> tensors;
    if (v.isTensor()) tensors.push_back({v.toTensor(), -1});
    if (v.isTensorList()) {
      const std::vector<at::Tensor> list = v.toTensorList().vec();
      for (size_t k = 0; k < list.size(); ++k) tensors.push_back({list[k], static_cast<int64_t>(k)});
    }
    for (const auto& [t, item] : tensors) {
      if (!t.defined()) continue;
      Operand o;
      o.arg = i, o.item = item, o.tensor = t;
      if (is_dist(t)) {
        const DistState& s = dist_state(t);
        if (mesh && s.mesh != mesh) throw std::runtime_error("sharding annotations: aten::" + call.name + " mixes tensors of two meshes");
        mesh = s.mesh;
      }
      call.inputs.push_back(o);
    }
  }
  if (!mesh) throw std::logic_error("sharding annotations: aten::" + call.name + " reached without a distributed tensor");
  for (Operand& o : call.inputs) o.spec = is_dist(o.tensor) ? spec_of(o.tensor) : spec_on(*mesh, o.tensor.sizes().vec());
  for (const mesh::MeshAxis& axis : mesh->layout().axes()) call.axis_sizes.push_back(axis.size);
  call.mesh = mesh.get();
  return mesh;
}

// In place: the first input keeps its identity; a partial sum it held is summed (or dropped) first.
void prepare_in_place(Call& call) {
  Operand& self = call.inputs.front();
  DistState& s = dist_state(self.tensor);
  if (self.want == s.placements) return;
  for (size_t k = 0; k < self.want.size(); ++k) {
    if (self.want[k] != s.placements[k] && !(s.placements[k].is_partial() && self.want[k].is_replicate())) {
      throw std::runtime_error("sharding annotations: aten::" + call.name + " would change its output's placement " +
                               self.spec.str() + " in place");
    }
  }
  const bool summed = self.spec.placements == self.want;  // the rule dropped the partial sum (overwritten)
  if (!summed) s.local.copy_(placement::redistribute_data(s.local, *call.mesh, spec_of(self.tensor), self.want));
  s.placements = self.want;
  self.spec.placements = self.want;
}

// Size arguments are global: the local operator gets the local output's.
void localize_sizes(Call& call) {
  const std::string& b = call.base;
  if (b != "view" && b != "_unsafe_view" && b != "expand" && b != "slice_backward" && b != "select_backward") return;
  const placement::TensorSpec out = spec_on(*call.mesh, call.out_shapes.front(), call.out_placements.front());
  call.args[1] = c10::IValue(placement::local_shape(out, call.mesh->layout(), call.mesh->rank()));
  if (b == "view" || b == "_unsafe_view") {  // a local piece laid out unlike the global one is copied, not refused
    call.kernel = [](const Call&, std::vector<c10::IValue> args) -> std::vector<c10::IValue> {
      return {args[0].toTensor().reshape(args[1].toIntVector())};
    };
  }
}

// The local outputs wrapped as distributed tensors, pushed.
void push_outputs(const Call& call, const std::shared_ptr<const mesh::DeviceMesh>& mesh,
                  const std::vector<c10::IValue>& outs, torch::jit::Stack* stack) {
  size_t k = 0;
  auto wrap = [&](const at::Tensor& local) {
    at::Tensor t = local;
    if (call.rescale_mean) {
      int64_t mine = 1, all = 1;
      const at::Tensor& in = dist_state(call.inputs.front().tensor).local;
      for (size_t d = 0; d < call.reduced.size(); ++d) {
        if (call.reduced[d]) mine *= in.size(d), all *= call.inputs.front().spec.shape[d];
      }
      t = t * (static_cast<double>(mine) / static_cast<double>(all));
    }
    const size_t i = k++;
    return from_local(t, mesh, call.out_placements[i], call.out_shapes[i], call.out_strides[i]);
  };
  for (size_t r = 0; r < outs.size(); ++r) {
    const c10::IValue& v = outs[r];
    if (v.isTensor() && r == 0 && call.inplace) {
      torch::jit::push(*stack, call.args[0]);
      ++k;
    } else if (v.isTensor()) {
      torch::jit::push(*stack, v.toTensor().defined() ? wrap(v.toTensor()) : v.toTensor());
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList().vec()) list.push_back(wrap(t));
      torch::jit::push(*stack, list);
    } else {
      torch::jit::push(*stack, v);
    }
  }
}

}  // namespace

void run_operator(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const bool out_variant = is_out_variant(schema);
  const size_t n = schema.arguments().size();
  Call call;
  call.name = schema.name().substr(6) + (schema.overload_name().empty() ? "" : "." + schema.overload_name());
  call.base = schema.name().substr(6);
  call.args.assign(stack->end() - n, stack->end());
  torch::jit::drop(*stack, n);
  call.pointwise = op.hasTag(at::Tag::pointwise);
  call.random = op.hasTag(at::Tag::nondeterministic_seeded);
  call.op = &op;
  call.inplace = !schema.returns().empty() && schema.returns()[0].alias_info() &&
                 schema.returns()[0].alias_info()->isWrite() && !out_variant;
  const std::shared_ptr<const mesh::DeviceMesh> mesh = collect_operands(call);

  if (call.base == "_local_scalar_dense") {  // .item(): the whole value
    torch::jit::push(*stack, full_tensor(call.inputs.front().tensor).item());
    return;
  }
  if (out_variant) {
    throw std::runtime_error("sharding annotations: aten::" + call.name +
                             " (an out= variant) has no sharding rule; call the functional operator");
  }
  static const bool trace = std::getenv("MESHTRAIN_ANNOTATE_TRACE") != nullptr;
  if (trace) std::fprintf(stderr, "[annotate rank %d] aten::%s\n", mesh->rank(), call.name.c_str());
  shape_outputs(op, call);
  call.out_placements.assign(call.out_shapes.size(), std::vector<Placement>(call.axis_sizes.size()));
  decide(call);
  if (reporting()) report(call);
  if (call.inplace && is_dist(call.inputs.front().tensor)) prepare_in_place(call);
  localize_sizes(call);
  auto local = [&](const Operand& o) { return local_in(o, call); };
  const std::vector<c10::IValue> outs =
      call.kernel ? call.kernel(call, local_args(call.args, call.inputs, local)) : call_with(op, call.args, call.inputs, local);
  push_outputs(call, mesh, outs, stack);
}

}  // namespace meshtrain::annotate
