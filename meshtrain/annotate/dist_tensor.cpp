#include "meshtrain/annotate/dist_tensor.h"

#include "meshtrain/annotate/report.h"
#include "meshtrain/annotate/rules.h"
#include "meshtrain/placement/redistribute.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <deque>
#include <numeric>
#include <mutex>
#include <stdexcept>

namespace meshtrain::annotate {

using placement::Placement;

bool is_dist(const at::Tensor& t) {
  return t.defined() && t.key_set().has(c10::DispatchKey::PrivateUse1) &&
         dynamic_cast<DistState*>(t.unsafeGetTensorImpl()->get_backend_meta()) != nullptr;
}

DistState& dist_state(const at::Tensor& t) {
  auto* state = t.defined() ? dynamic_cast<DistState*>(t.unsafeGetTensorImpl()->get_backend_meta()) : nullptr;
  if (!state) throw std::invalid_argument("not a distributed tensor");
  return *state;
}

namespace {

// Row-major strides of `shape`.
std::vector<int64_t> row_major(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

}  // namespace

at::Tensor from_local(at::Tensor local, std::shared_ptr<const mesh::DeviceMesh> mesh, std::vector<Placement> placements,
                      std::vector<int64_t> shape, std::vector<int64_t> strides) {
  install();
  if (!mesh) throw std::invalid_argument("from_local: no mesh");
  if (static_cast<int>(placements.size()) != mesh->layout().ndim()) {
    throw std::invalid_argument("from_local: " + std::to_string(placements.size()) + " placements for a mesh of " +
                                std::to_string(mesh->layout().ndim()) + " axes (" + mesh->layout().describe() + ")");
  }
  if (is_dist(local)) throw std::invalid_argument("from_local: the local tensor is distributed already");
  for (size_t k = 0; k < placements.size(); ++k) {
    if (mesh->layout().axes()[k].size == 1) placements[k] = Placement::replicate();  // one rank: all alike
  }
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                          local.dtype(), local.device());
  if (strides.size() != shape.size()) strides = row_major(shape);
  t.unsafeGetTensorImpl()->set_sizes_and_strides(shape, strides);
  auto state = c10::make_intrusive<DistState>();
  state->local = std::move(local);
  state->mesh = std::move(mesh);
  state->placements = std::move(placements);
  t.unsafeGetTensorImpl()->set_backend_meta(state);
  return t;
}

placement::TensorSpec spec_on(const mesh::DeviceMesh& mesh, std::vector<int64_t> shape, std::vector<Placement> placements) {
  placement::TensorSpec spec;
  spec.shape = std::move(shape);
  for (const mesh::MeshAxis& axis : mesh.layout().axes()) spec.axes.push_back(axis.name);
  spec.placements = placements.empty() ? std::vector<Placement>(spec.axes.size(), Placement::replicate()) : std::move(placements);
  return spec;
}

placement::TensorSpec spec_of(const at::Tensor& t) {
  const DistState& s = dist_state(t);
  return spec_on(*s.mesh, t.sizes().vec(), s.placements);
}

std::vector<Placement> placements_on(const mesh::DeviceMesh& mesh, const std::map<std::string, Placement>& by_axis) {
  std::vector<Placement> out(mesh.layout().ndim(), Placement::replicate());
  for (const auto& [axis, p] : by_axis) out[mesh.layout().axis_index(axis)] = p;
  return out;
}

at::Tensor to_local(const at::Tensor& t) { return dist_state(t).local; }

at::Tensor distribute(const at::Tensor& global, std::shared_ptr<const mesh::DeviceMesh> mesh,
                      std::vector<Placement> placements) {
  if (is_dist(global)) return redistribute(global, std::move(placements));
  const placement::TensorSpec spec = spec_on(*mesh, global.sizes().vec(), placements);
  spec.check(mesh->layout());
  at::Tensor local;
  {
    torch::NoGradGuard no_grad;
    local = placement::local_of(global.detach(), spec, mesh->layout(), mesh->rank()).contiguous();
  }
  at::Tensor out = from_local(local, std::move(mesh), std::move(placements), spec.shape);
  if (global.requires_grad()) out.requires_grad_(true);
  return out;
}

namespace {

// The same global value in other placements. Its gradient is put where the
// value was put, a Partial axis read as Replicate (every rank's share of a
// partial sum has the whole gradient): a constraint to Replicate sums a
// partial gradient there, as Megatron's f does at a column-parallel input.
class Redistribute : public torch::autograd::Function<Redistribute> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& t, std::vector<Placement> to) {
    const DistState& s = dist_state(t);
    std::vector<int64_t> encoded;  // the gradient's placements: kind, dim, blocks per axis
    for (const Placement& p : to) {
      const Placement g = p.is_partial() ? Placement::replicate() : p;
      encoded.insert(encoded.end(), {static_cast<int64_t>(g.kind), g.dim, g.blocks});
    }
    ctx->saved_data["grad_placements"] = encoded;
    const at::Tensor local = local_as(t, to, *s.mesh, "redistribute");
    return from_local(local, s.mesh, std::move(to), t.sizes().vec());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!is_dist(grads[0])) return {grads[0], at::Tensor()};
    const std::vector<int64_t> encoded = ctx->saved_data["grad_placements"].toIntVector();
    std::vector<Placement> want;
    for (size_t i = 0; i + 2 < encoded.size(); i += 3) {
      want.push_back({static_cast<Placement::Kind>(encoded[i]), encoded[i + 1], encoded[i + 2]});
    }
    const DistState& g = dist_state(grads[0]);
    const at::Tensor local = local_as(grads[0], want, *g.mesh, "redistribute (backward)");
    return {from_local(local, g.mesh, want, grads[0].sizes().vec()), at::Tensor()};
  }
};

}  // namespace

at::Tensor redistribute(const at::Tensor& t, std::vector<Placement> placements) {
  if (!is_dist(t)) throw std::invalid_argument("redistribute: not a distributed tensor");
  if (placements == dist_state(t).placements) return t;
  return Redistribute::apply(t, std::move(placements));
}

at::Tensor full_tensor(const at::Tensor& t) {
  const DistState& s = dist_state(t);
  return placement::redistribute_data(s.local, *s.mesh, spec_of(t),
                                      std::vector<Placement>(s.placements.size(), Placement::replicate()));
}

namespace {

// The collectives taking `spec` to `want`, one per axis that changes, into the report.
void report_redistribution(const placement::TensorSpec& spec, const std::vector<Placement>& want,
                           const mesh::DeviceMesh& mesh, int64_t element_size, const std::string& op) {
  const auto& axes = mesh.layout().axes();
  double global = static_cast<double>(element_size);
  for (int64_t s : spec.shape) global *= static_cast<double>(s);
  for (size_t k = 0; k < want.size(); ++k) {
    const Placement& from = spec.placements[k];
    const Placement& to = want[k];
    if (from == to || axes[k].size == 1) continue;
    std::string kind;
    if (from.is_shard() && to.is_replicate()) kind = "all_gather";
    if (from.is_shard() && to.is_shard()) kind = "all_to_all";
    if (from.is_partial() && to.is_replicate()) kind = "all_reduce";
    if (from.is_partial() && to.is_shard()) kind = "reduce_scatter";
    if (kind.empty()) continue;  // a local slice or zeros
    double bytes = global;  // the tensor as the group along axis k sees it
    for (size_t j = 0; j < want.size(); ++j) {
      if (j != k && spec.placements[j].is_shard()) bytes /= axes[j].size;
    }
    const double n = axes[k].size, share = (n - 1) / n;
    bytes *= kind == "all_reduce" ? 2 * share : kind == "all_to_all" ? share / n : share;
    note_collective(op, kind, {axes[k].name}, static_cast<int64_t>(bytes), spec.str());
  }
}

}  // namespace

at::Tensor local_as(const at::Tensor& t, const std::vector<Placement>& want, const mesh::DeviceMesh& mesh,
                    const std::string& op) {
  if (!is_dist(t)) {
    placement::TensorSpec spec = spec_on(mesh, t.sizes().vec(), want);
    return placement::local_of(t, spec, mesh.layout(), mesh.rank());
  }
  DistState& s = dist_state(t);
  if (want == s.placements) return s.local;
  const bool keep = !at::GradMode::is_enabled();
  if (keep && s.redistributed_version == static_cast<int64_t>(t._version())) {
    for (const auto& [placements, local] : s.redistributed) {
      if (placements == want) return local;
    }
  }
  if (reporting()) report_redistribution(spec_of(t), want, mesh, t.element_size(), op);
  at::Tensor local = placement::redistribute_data(s.local, mesh, spec_of(t), want);
  // Partial sums summed: the tensor keeps the sum (the same global value, the
  // same bytes), so no later use sums it again.
  bool only_sums = true;
  for (size_t k = 0; k < want.size(); ++k) {
    only_sums = only_sums && (want[k] == s.placements[k] || (s.placements[k].is_partial() && want[k].is_replicate()));
  }
  if (only_sums) {
    s.local = local;
    s.placements = want;
    return local;
  }
  if (keep) {
    if (s.redistributed_version != static_cast<int64_t>(t._version())) s.redistributed.clear();
    s.redistributed_version = static_cast<int64_t>(t._version());
    s.redistributed.emplace_back(want, local);
  }
  return local;
}

bool has_redistributed(const at::Tensor& t, size_t axis, const Placement& p) {
  if (!is_dist(t) || at::GradMode::is_enabled()) return false;
  const DistState& s = dist_state(t);
  if (s.redistributed_version != static_cast<int64_t>(t._version())) return false;
  for (const auto& entry : s.redistributed) {
    if (entry.first[axis] == p) return true;
  }
  return false;
}

void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    static torch::Library library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) continue;
      auto op = c10::Dispatcher::singleton().findOp(name);
      if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) continue;  // decomposes
      static std::deque<std::string> names;  // the library keeps pointers to them
      names.push_back(name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name));
      library.impl(names.back().c_str(), torch::CppFunction::makeFromBoxedFunction<&run_operator>());
    }
    install_autograd_kernels();
  });
}

}  // namespace meshtrain::annotate
