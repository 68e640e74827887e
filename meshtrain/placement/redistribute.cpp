#include "meshtrain/placement/redistribute.h"

#include <torch/torch.h>

#include <stdexcept>

namespace meshtrain::placement {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One tensor on its way from one placement to another: the local value and
// the placements it has now.
class Transition {
 public:
  Transition(at::Tensor local, const mesh::DeviceMesh& mesh, TensorSpec spec)
      : x_(std::move(local)), mesh_(mesh), spec_(std::move(spec)) {}

  void run(const std::vector<Placement>& to) {
    const int n = static_cast<int>(to.size());
    std::vector<Placement>& cur = spec_.placements;
    // 1. Undo shards, innermost first.
    for (int k = n - 1; k >= 0; --k) {
      if (!cur[k].is_shard()) continue;
      const int64_t d = cur[k].dim;
      bool changes = cur[k] != to[k];
      for (int i = 0; i < k && !changes; ++i) changes = cur[i] != to[i] && (cur[i].is_shard(d) || to[i].is_shard(d));
      if (!changes) continue;
      if (to[k].is_partial()) {
        pad(k);
      } else if (to[k].is_shard() && to[k].dim != d && cur[k].blocks == 1 && to[k].blocks == 1 &&
                 alone_on(k, d, to) && alone_on(k, to[k].dim, to)) {
        all_to_all(k, to[k].dim);
      } else {
        gather(k);
      }
    }
    // 2. Reduce partial sums, outermost first.
    for (int k = 0; k < n; ++k) {
      if (!cur[k].is_partial() || to[k].is_partial()) continue;
      if (to[k].is_shard() && to[k].blocks == 1 && nests_here(k, to[k].dim, to)) {
        reduce_scatter(k, to[k].dim);
      } else {
        all_reduce(k);
      }
    }
    // 3. Cut new shards and partial sums, outermost first.
    for (int k = 0; k < n; ++k) {
      if (cur[k] == to[k]) continue;
      if (!cur[k].is_replicate()) {
        throw std::logic_error("redistribute: axis " + spec_.axes[k] + " is " + cur[k].str() + " after the gathers");
      }
      if (to[k].is_shard()) slice(k, to[k]);
      else partialize(k);
    }
  }

  at::Tensor result() const { return x_; }

 private:
  comm::Communicator& comm(int k) const { return *mesh_.comm(spec_.axes[k]); }
  int coordinate(int k) const { return mesh_.coordinate(spec_.axes[k]); }

  // No axis but k shards dim d, now or (with `to`) after.
  bool alone_on(int k, int64_t d, const std::vector<Placement>& to) const {
    for (size_t j = 0; j < spec_.placements.size(); ++j) {
      if (static_cast<int>(j) == k) continue;
      if (spec_.placements[j].is_shard(d) || to[j].is_shard(d)) return false;
    }
    return true;
  }

  // A reduce-scatter on axis k along d nests right: the outer axes that end
  // sharding d already do, and no inner axis shards d now.
  bool nests_here(int k, int64_t d, const std::vector<Placement>& to) const {
    for (int j = 0; j < static_cast<int>(to.size()); ++j) {
      if (j < k && to[j].is_shard(d) && spec_.placements[j] != to[j]) return false;
      if (j > k && spec_.placements[j].is_shard(d)) return false;
    }
    return true;
  }

  // The local extent of dim d if axis k were Replicate.
  int64_t parent_extent(int k, int64_t d) const {
    TensorSpec parent = spec_;
    parent.placements[k] = Placement::replicate();
    return local_shape(parent, mesh_.layout(), mesh_.rank())[d];
  }

  std::vector<int64_t> with(std::vector<int64_t> shape, int64_t dim, int64_t size) const {
    shape[dim] = size;
    return shape;
  }

  void gather(int k) {
    const Placement p = spec_.placements[k];
    const int64_t d = p.dim, parent = parent_extent(k, d), n = comm(k).size();
    if (p.blocks == 1) {
      const at::Tensor input = x_.movedim(d, 0).contiguous();
      at::Tensor output = at::empty(with(input.sizes().vec(), 0, parent), input.options());
      comm(k).all_gather(output, input, chunk_sizes(parent, n)).wait();
      x_ = output.movedim(0, d).contiguous();
    } else {  // with the blocked dim moved first
      const at::Tensor x = x_.movedim(d, 0);
      const int64_t b = p.blocks, block = parent / b;
      std::vector<int64_t> blocked = x.sizes().vec();
      blocked[0] /= b;
      blocked.insert(blocked.begin(), b);  // [b, chunk, ...]
      const at::Tensor input = x.reshape(blocked).movedim(1, 0).contiguous();  // [chunk, b, ...]
      at::Tensor output = at::empty(with(input.sizes().vec(), 0, block), input.options());
      comm(k).all_gather(output, input, chunk_sizes(block, n)).wait();
      x_ = output.movedim(0, 1).reshape(with(x.sizes().vec(), 0, parent)).movedim(0, d).contiguous();
    }
    spec_.placements[k] = Placement::replicate();
  }

  void pad(int k) {
    const Placement p = spec_.placements[k];
    const int64_t d = p.dim, parent = parent_extent(k, d), n = comm(k).size(), c = coordinate(k);
    at::Tensor out = at::zeros(with(x_.sizes().vec(), d, parent), x_.options());
    if (p.blocks == 1) {
      out.narrow(d, chunk_offset(parent, n, c), x_.size(d)).copy_(x_);
    } else {  // with the blocked dim moved first
      const at::Tensor x = x_.movedim(d, 0), o = out.movedim(d, 0);
      const int64_t b = p.blocks, block = parent / b, mine = x.size(0) / b;
      std::vector<int64_t> rest = x.sizes().slice(1).vec();
      std::vector<int64_t> whole = {b, block}, part = {b, mine};
      whole.insert(whole.end(), rest.begin(), rest.end());
      part.insert(part.end(), rest.begin(), rest.end());
      o.reshape(whole).narrow(1, chunk_offset(block, n, c), mine).copy_(x.reshape(part));
      if (d != 0) out = o.movedim(0, d).contiguous();
    }
    x_ = out;
    spec_.placements[k] = Placement::partial();
  }

  void all_to_all(int k, int64_t to_dim) {
    const int64_t from_dim = spec_.placements[k].dim;
    const int64_t n = comm(k).size(), c = coordinate(k);
    const int64_t from_parent = parent_extent(k, from_dim), to_extent = x_.size(to_dim);
    std::vector<at::Tensor> sends;
    std::vector<int64_t> input_splits, output_splits;
    std::vector<std::vector<int64_t>> piece_shapes;
    for (int64_t r = 0; r < n; ++r) {
      const at::Tensor piece = x_.narrow(to_dim, chunk_offset(to_extent, n, r), chunk_sizes(to_extent, n)[r]);
      sends.push_back(piece.reshape({-1}));
      input_splits.push_back(piece.numel());
      std::vector<int64_t> shape = with(x_.sizes().vec(), from_dim, chunk_sizes(from_parent, n)[r]);
      shape[to_dim] = chunk_sizes(to_extent, n)[c];
      int64_t numel = 1;
      for (int64_t s : shape) numel *= s;
      output_splits.push_back(numel);
      piece_shapes.push_back(shape);
    }
    const at::Tensor input = at::cat(sends);
    int64_t total = 0;
    for (int64_t s : output_splits) total += s;
    at::Tensor output = at::empty({total}, x_.options());
    comm(k).all_to_all(output, input, output_splits, input_splits).wait();
    std::vector<at::Tensor> pieces;
    int64_t offset = 0;
    for (int64_t r = 0; r < n; ++r) {
      pieces.push_back(output.narrow(0, offset, output_splits[r]).view(piece_shapes[r]));
      offset += output_splits[r];
    }
    x_ = at::cat(pieces, from_dim);
    spec_.placements[k] = Placement::shard(to_dim);
  }

  void all_reduce(int k) {
    x_ = x_.contiguous().clone();
    comm(k).all_reduce(x_).wait();
    spec_.placements[k] = Placement::replicate();
  }

  void reduce_scatter(int k, int64_t d) {
    const int64_t extent = x_.size(d), n = comm(k).size(), c = coordinate(k);
    const at::Tensor input = x_.movedim(d, 0).contiguous();
    at::Tensor output = at::empty(with(input.sizes().vec(), 0, chunk_sizes(extent, n)[c]), input.options());
    comm(k).reduce_scatter(output, input, comm::ReduceOp::kSum, chunk_sizes(extent, n)).wait();
    x_ = output.movedim(0, d).contiguous();
    spec_.placements[k] = Placement::shard(d);
  }

  void slice(int k, const Placement& p) {
    const int64_t d = p.dim, extent = x_.size(d), n = comm(k).size(), c = coordinate(k);
    if (p.blocks == 1) {
      x_ = x_.narrow(d, chunk_offset(extent, n, c), chunk_sizes(extent, n)[c]).contiguous();
    } else {  // with the blocked dim moved first
      const at::Tensor x = x_.movedim(d, 0);
      const int64_t b = p.blocks, block = extent / b, mine = chunk_sizes(block, n)[c];
      std::vector<int64_t> rest = x.sizes().slice(1).vec(), whole = {b, block};
      whole.insert(whole.end(), rest.begin(), rest.end());
      x_ = x.reshape(whole).narrow(1, chunk_offset(block, n, c), mine).reshape(with(x.sizes().vec(), 0, b * mine)).movedim(0, d).contiguous();
    }
    spec_.placements[k] = p;
  }

  void partialize(int k) {
    if (coordinate(k) != 0) x_ = at::zeros_like(x_);
    spec_.placements[k] = Placement::partial();
  }

  at::Tensor x_;
  const mesh::DeviceMesh& mesh_;
  TensorSpec spec_;
};

struct RedistributePlan : torch::CustomClassHolder {
  RedistributePlan(const mesh::DeviceMesh& m, TensorSpec f, std::vector<Placement> t)
      : mesh(&m), from(std::move(f)), to(std::move(t)) {}
  const mesh::DeviceMesh* mesh;
  TensorSpec from;
  std::vector<Placement> to;
};

class RedistributeFunction : public torch::autograd::Function<RedistributeFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local, c10::intrusive_ptr<RedistributePlan> plan) {
    at::Tensor out = redistribute_data(local, *plan->mesh, plan->from, plan->to);
    ctx->saved_data["plan"] = at::IValue::make_capsule(std::move(plan));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto plan = c10::static_intrusive_pointer_cast<RedistributePlan>(ctx->saved_data["plan"].toCapsule());
    TensorSpec from = plan->from;
    from.placements = dual(plan->to);
    return {redistribute(grads[0], *plan->mesh, from, dual(plan->from.placements)), at::Tensor()};
  }
};

}  // namespace

std::vector<Placement> dual(const std::vector<Placement>& placements) {
  std::vector<Placement> out = placements;
  for (Placement& p : out) {
    if (p.is_replicate()) p = Placement::partial();
    else if (p.is_partial()) p = Placement::replicate();
  }
  return out;
}

at::Tensor redistribute_data(const at::Tensor& local, const mesh::DeviceMesh& mesh, const TensorSpec& from,
                             const std::vector<Placement>& to) {
  from.check(mesh.layout());
  TensorSpec target = from;
  target.placements = to;
  target.check(mesh.layout());
  if (from.flat_begin != 0 || from.flat_end >= 0) {
    throw std::invalid_argument("redistribute: " + from.str() + " has a flat range; redistribute whole local tensors");
  }
  const std::vector<int64_t> expected = local_shape(from, mesh.layout(), mesh.rank());
  if (local.sizes().vec() != expected) {
    throw std::invalid_argument("redistribute: rank " + std::to_string(mesh.rank()) + " holds a local tensor of shape " +
                                c10::str(local.sizes()) + ", " + from.str() + " gives it " + c10::str(expected));
  }
  torch::NoGradGuard no_grad;
  Transition transition(local.detach(), mesh, from);
  transition.run(to);
  return transition.result();
}

at::Tensor redistribute(const at::Tensor& local, const mesh::DeviceMesh& mesh, const TensorSpec& from,
                        const std::vector<Placement>& to) {
  return RedistributeFunction::apply(local, c10::make_intrusive<RedistributePlan>(mesh, from, to));
}

}  // namespace meshtrain::placement
