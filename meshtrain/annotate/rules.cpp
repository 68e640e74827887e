// The sharding rules, and the handler that applies them to an operator call.
#include "meshtrain/annotate/rules.h"

#include "meshtrain/annotate/dist_tensor.h"
#include "meshtrain/placement/redistribute.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <set>
#include <stdexcept>

namespace meshtrain::annotate {

using placement::Placement;
using Placements = std::vector<Placement>;

using namespace rule_names;

namespace {

int64_t numel(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

double cost(const Operand& o, size_t axis, const Placement& to, const std::vector<int64_t>& sizes) {
  if (to.is_shard() && to != o.spec.placements[axis]) {
    // A dim split into blocks is split by one axis only (Note [Placements]):
    // against the axes decided (earlier) and as they are (later ones).
    for (size_t j = 0; j < sizes.size(); ++j) {
      const Placement& other = j < o.want.size() ? o.want[j] : o.spec.placements[j];
      if (j != axis && other.is_shard(to.dim) && (other.blocks > 1 || to.blocks > 1)) {
        return std::numeric_limits<double>::infinity();
      }
    }
  }
  if (o.shape_only || has_redistributed(o.tensor, axis, to)) return 0;
  return redistribute_bytes(o.spec, o.spec.placements[axis], to, sizes[axis]);
}

void set_all_outputs(Call& call, size_t axis, const Placement& p) {
  for (Placements& out : call.out_placements) out[axis] = p;
}

// --- Pointwise, with broadcasting -----------------------------------------

// add / sub of a number (not a tensor): every rank's share would get it.
bool adds_constant(const Call& call) {
  static const std::set<std::string> ops = {"add", "add_", "sub", "sub_", "rsub"};
  return ops.count(call.base) > 0 && call.args.size() > 1 && !call.args[1].isTensor();
}

bool linear_in_all(const std::string& base) {
  static const std::set<std::string> ops = {"add", "add_", "sub", "sub_", "neg", "neg_", "clone", "_to_copy",
                                            "alias", "detach", "copy_", "zero_"};
  return ops.count(base) > 0;
}
bool linear_in_one(const std::string& base) {
  static const std::set<std::string> ops = {"mul", "mul_", "div", "div_"};
  return ops.count(base) > 0;
}
bool overwrites(const std::string& base) {
  static const std::set<std::string> ops = {"fill_", "zero_", "copy_", "empty_like", "zeros_like", "ones_like",
                                            "full_like"};
  return ops.count(base) > 0;
}

// The input dim that output dim `d` reads (right-aligned), or -1 where it is broadcast.
int64_t input_dim(const Operand& o, const std::vector<int64_t>& out_shape, int64_t d) {
  const int64_t i = d - static_cast<int64_t>(out_shape.size() - o.spec.shape.size());
  if (i < 0 || o.spec.shape[i] != out_shape[d]) return -1;
  return i;
}

// Note [Partial gradients]
// In a backward (autograd not recording), a partial sum multiplied by a
// tensor is summed there rather than carried on: a partial gradient reaching
// a norm's backward is summed at its first product, where Megatron's f sums
// it; carried through a composite norm (RMSNorm from pointwise operators) it
// would reach the matmuls before, which then gather weights or sum it twice.
// A product with a scalar keeps it partial.
bool scaled_only(const Call& call) {
  for (const Operand& o : call.inputs) {
    if (!o.spec.placements.empty() && o.spec.shape.empty()) continue;  // 0-dim
    bool partial = false;
    for (const Placement& p : o.spec.placements) partial = partial || p.is_partial();
    if (!partial) return false;
  }
  return true;
}

Placement required(const Operand& o, const std::vector<int64_t>& out_shape, const Placement& target) {
  if (target.is_shard()) {
    const int64_t i = input_dim(o, out_shape, target.dim);
    return i < 0 ? R : Placement::shard(i, target.blocks);
  }
  return target;
}

void pointwise(Call& call) {
  const std::vector<int64_t>& shape = call.out_shapes.front();
  const std::string base = adds_constant(call) ? "(adds a constant)" : call.base;  // not linear then
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    if (call.inplace) {
      // The output is the first input: it stays where it is (a partial sum
      // is summed first unless the operator is linear or overwrites it).
      Operand& self = call.inputs.front();
      Placement target = self.spec.placements[axis];
      if (target.is_partial() && overwrites(base)) self.spec.placements[axis] = target = R;  // values replaced
      if (target.is_partial() && !linear_in_all(base) && !linear_in_one(base)) target = R;
      if (target.is_partial() && linear_in_one(base)) {
        for (size_t i = 1; i < call.inputs.size(); ++i) {
          if (!call.inputs[i].spec.placements[axis].is_replicate() && call.inputs[i].spec.shape.size() > 0) target = R;
        }
      }
      for (Operand& o : call.inputs) {
        o.want.push_back(&o == &self ? target : (target.is_partial() && linear_in_one(base) ? R : required(o, shape, target)));
      }
      set_all_outputs(call, axis, target);
      continue;
    }
    std::vector<Placement> targets;
    int partial_inputs = 0;
    for (const Operand& o : call.inputs) partial_inputs += o.spec.placements[axis].is_partial() ? 1 : 0;
    if (partial_inputs > 0 && linear_in_all(base)) targets.push_back(P);
    if (partial_inputs == 1 && linear_in_one(base) && (base.rfind("div", 0) != 0 || call.inputs.front().spec.placements[axis].is_partial()) &&
        (at::GradMode::is_enabled() || scaled_only(call))) {
      targets.push_back(P);
    }
    std::set<std::pair<int64_t, int64_t>> dims;  // (output dim, blocks)
    for (const Operand& o : call.inputs) {
      const Placement& p = o.spec.placements[axis];
      if (!p.is_shard()) continue;
      const int64_t d = p.dim + static_cast<int64_t>(shape.size() - o.spec.shape.size());
      if (input_dim(o, shape, d) == p.dim) dims.insert({d, p.blocks});
    }
    for (const auto& [d, blocks] : dims) targets.push_back(Placement::shard(d, blocks));
    targets.push_back(R);
    std::vector<Option> options;
    for (const Placement& t : targets) {
      Option option{{}, t};
      for (const Operand& o : call.inputs) {
        if (t.is_partial() && linear_in_one(base)) option.inputs.push_back(o.spec.placements[axis].is_partial() ? P : R);
        else option.inputs.push_back(required(o, shape, t));
      }
      options.push_back(option);
    }
    if (overwrites(base)) {  // *_like: the output follows the input, a fresh value is never partial
      const Placement p = call.inputs.front().spec.placements[axis];
      options = {{{p}, p.is_partial() ? R : p}};
    }
    const Option chosen = cheapest(call, axis, options);
    for (size_t i = 0; i < call.inputs.size(); ++i) call.inputs[i].want.push_back(chosen.inputs[i]);
    set_all_outputs(call, axis, chosen.out);
  }
}

// --- Matrix products -----------------------------------------------------

void matmul(Call& call) {
  const bool batched = call.base == "bmm";
  const bool bias = call.base == "addmm";
  const int64_t b = batched ? 1 : 0;  // the matrix dims follow a batch dim
  const std::vector<int64_t>& shape = call.out_shapes.front();
  const size_t a_index = bias ? 1 : 0;
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    // A dim split in blocks (a fused qkv) stays so: its blocks come along.
    auto blocks = [&](size_t i, int64_t d) {
      const Placement& p = call.inputs[a_index + i].spec.placements[axis];
      return p.is_shard(d) ? p.blocks : 1;
    };
    const int64_t rows = blocks(0, b), cols = blocks(1, b + 1), inner = blocks(0, b + 1);
    const Placement inner_b = Placement::shard(b, inner);
    std::vector<Option> options = {{{Placement::shard(b, rows), R}, Placement::shard(b, rows)},
                                   {{R, Placement::shard(b + 1, cols)}, Placement::shard(b + 1, cols)},
                                   {{Placement::shard(b + 1, inner), inner_b}, P},
                                   {{P, R}, P},
                                   {{R, P}, P},
                                   {{R, R}, R}};
    if (batched) options.insert(options.begin(), Option{{S(0), S(0)}, S(0)});
    if (bias) {
      for (Option& o : options) o.inputs.insert(o.inputs.begin(), required(call.inputs.front(), shape, o.out));
    }
    const Option chosen = cheapest(call, axis, options);
    for (size_t i = 0; i < call.inputs.size(); ++i) call.inputs[i].want.push_back(chosen.inputs[i]);
    set_all_outputs(call, axis, chosen.out);
  }
}

// --- Reductions -----------------------------------------------------------

void reduction(Call& call) {
  const Operand& self = call.inputs.front();
  const int64_t rank = static_cast<int64_t>(self.spec.shape.size());
  std::vector<bool> reduced(rank, true);
  bool keepdim = false;
  if (call.name != "sum" && call.name != "mean") {
    const c10::IValue& dims = call.args[1];
    if (!dims.isNone() && !dims.toIntList().empty()) {
      reduced.assign(rank, false);
      for (int64_t d : dims.toIntList().vec()) reduced[d < 0 ? d + rank : d] = true;
    }
    keepdim = call.args[2].toBool();
  }
  const bool mean = call.base == "mean";
  call.reduced = reduced;
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    const Placement& p = self.spec.placements[axis];
    Placement out = p;
    if (p.is_shard() && reduced[p.dim]) {
      out = P;
      call.rescale_mean = mean;
    } else if (p.is_shard() && !keepdim) {
      int64_t before = 0;
      for (int64_t d = 0; d < p.dim; ++d) before += reduced[d] ? 1 : 0;
      out = Placement::shard(p.dim - before, p.blocks);
    }
    call.inputs.front().want.push_back(p);
    set_all_outputs(call, axis, out);
  }
}

// --- Views -----------------------------------------------------------------

// Where a reshape from `in` to `out` puts input dim d, if a shard of it over
// n ranks stays a shard of one output dim; -1 if not.
int64_t reshaped_dim(const std::vector<int64_t>& in, const std::vector<int64_t>& out, int64_t d, int64_t n) {
  int64_t i = 0, o = 0;
  while (i < static_cast<int64_t>(in.size()) || o < static_cast<int64_t>(out.size())) {
    // One group: the fewest leading dims of each with equal products.
    const int64_t i0 = i, o0 = o;
    int64_t pi = i < static_cast<int64_t>(in.size()) ? in[i++] : 1, po = o < static_cast<int64_t>(out.size()) ? out[o++] : 1;
    while (pi != po) {
      if (pi < po) pi *= in[i++];
      else po *= out[o++];
    }
    if (d < i0 || d >= i) continue;
    int64_t lead_in = i0, lead_out = o0;
    while (lead_in < i && in[lead_in] == 1) ++lead_in;
    while (lead_out < o && out[lead_out] == 1) ++lead_out;
    if (d != lead_in || lead_out >= o) return -1;
    if (in[d] == out[lead_out] && i - i0 == 1 && o - o0 == 1) return lead_out;
    return in[d] % n == 0 && out[lead_out] % n == 0 ? lead_out : -1;
  }
  return -1;
}

// Where each input dim goes (-1: it must not be split).
std::vector<int64_t> view_map(const Call& call, int64_t n) {
  const std::vector<int64_t>& in = call.inputs.front().spec.shape;
  const std::vector<int64_t>& out = call.out_shapes.front();
  const int64_t rank = static_cast<int64_t>(in.size());
  std::vector<int64_t> map(rank);
  std::iota(map.begin(), map.end(), 0);
  const std::string& b = call.base;
  if (b == "t" && rank == 2) {
    map = {1, 0};
  } else if (b == "transpose") {
    const int64_t d0 = wrap_dim(call.args[1].toInt(), rank), d1 = wrap_dim(call.args[2].toInt(), rank);
    std::swap(map[d0], map[d1]);
  } else if (b == "permute") {
    const std::vector<int64_t> dims = call.args[1].toIntList().vec();
    for (int64_t j = 0; j < rank; ++j) map[wrap_dim(dims[j], rank)] = j;
  } else if (b == "unsqueeze") {
    const int64_t at = wrap_dim(call.args[1].toInt(), rank + 1);
    for (int64_t d = 0; d < rank; ++d) map[d] = d < at ? d : d + 1;
  } else if (b == "squeeze" || b == "select" || b == "unbind") {
    std::vector<bool> gone(rank, false);
    if (b == "squeeze" && call.args.size() == 1) {
      for (int64_t d = 0; d < rank; ++d) gone[d] = in[d] == 1;
    } else if (b == "squeeze" && call.args[1].isIntList()) {
      for (int64_t d : call.args[1].toIntList().vec()) gone[wrap_dim(d, rank)] = in[wrap_dim(d, rank)] == 1;
    } else {
      const int64_t d = wrap_dim(call.args[1].toInt(), rank);
      gone[d] = b != "squeeze" || in[d] == 1;
    }
    for (int64_t d = 0, j = 0; d < rank; ++d) map[d] = gone[d] ? -1 : j++;
  } else if (b == "slice" || b == "split" || b == "split_with_sizes") {
    const int64_t d = wrap_dim(call.args[b == "slice" ? 1 : 2].toInt(), rank);
    if (b != "slice" || in[d] != out[d]) map[d] = -1;
  } else if (b == "expand") {
    const int64_t offset = static_cast<int64_t>(out.size()) - rank;
    for (int64_t d = 0; d < rank; ++d) map[d] = in[d] == out[d + offset] ? d + offset : -1;
  } else if (b == "view" || b == "_unsafe_view") {
    for (int64_t d = 0; d < rank; ++d) map[d] = reshaped_dim(in, out, d, n);
  }
  return map;
}

bool is_view_op(const std::string& b) {
  static const std::set<std::string> ops = {"t", "transpose", "permute", "unsqueeze", "squeeze", "select", "unbind",
                                            "slice", "split", "split_with_sizes", "expand", "view", "_unsafe_view",
                                            "alias", "detach"};
  return ops.count(b) > 0;
}

void view(Call& call) {
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    const std::vector<int64_t> map = view_map(call, call.axis_sizes[axis]);
    const Placement& p = call.inputs.front().spec.placements[axis];
    const std::vector<int64_t>& in = call.inputs.front().spec.shape;
    const std::vector<int64_t>& out = call.out_shapes.front();
    // A dim split in blocks survives a view that keeps it whole, and a split
    // into its blocks leaves each piece split plainly.
    const bool whole = p.is_shard() && map[p.dim] >= 0 && in[p.dim] == out[map[p.dim]];
    const bool into_blocks = p.is_shard() && p.blocks > 1 && (call.base == "split" || call.base == "split_with_sizes") &&
                             wrap_dim(call.args[2].toInt(), static_cast<int64_t>(in.size())) == p.dim &&
                             call.out_shapes.size() == static_cast<size_t>(p.blocks) && out[p.dim] * p.blocks == in[p.dim];
    if (into_blocks) {
      call.inputs.front().want.push_back(p);
      set_all_outputs(call, axis, S(p.dim));
      const int64_t dim = p.dim, blocks = p.blocks;
      call.kernel = [dim, blocks](const Call&, std::vector<c10::IValue> args) -> std::vector<c10::IValue> {
        const at::Tensor local = args[0].toTensor();  // this rank's chunk of every block, in block order
        return {c10::List<at::Tensor>(local.split(local.size(dim) / blocks, dim))};
      };
      continue;
    }
    const bool keeps = !p.is_shard() || (map[p.dim] >= 0 && (p.blocks == 1 || whole));
    call.inputs.front().want.push_back(keeps ? p : R);
    set_all_outputs(call, axis, !keeps ? R : p.is_shard() ? Placement::shard(map[p.dim], p.blocks) : p);
  }
}

// --- Softmax: the normalised dim whole ------------------------------------

void softmax(Call& call) {
  const int64_t rank = static_cast<int64_t>(call.inputs.front().spec.shape.size());
  const int64_t dim = wrap_dim(call.args[call.base == "_softmax" || call.base == "_log_softmax" ? 1 : 2].toInt(), rank);
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    Placement p = call.inputs.front().spec.placements[axis];
    if (p.is_partial() || p.is_shard(dim)) p = R;
    for (Operand& o : call.inputs) o.want.push_back(p);
    set_all_outputs(call, axis, p);
  }
}

}  // namespace

double redistribute_bytes(const placement::TensorSpec& spec, const Placement& from, const Placement& to, int64_t n) {
  if (from == to || n == 1) return 0;
  const double bytes = static_cast<double>(numel(spec.shape)) * 4.0, f = static_cast<double>(n - 1) / n;
  if (from.is_shard() && to.is_replicate()) return bytes * f;            // all-gather
  if (from.is_shard() && to.is_shard()) return bytes * f / n;            // all-to-all
  if (from.is_partial() && to.is_replicate()) return 2 * bytes * f;      // all-reduce
  if (from.is_partial() && to.is_shard()) return bytes * f;              // reduce-scatter
  if (from.is_shard() && to.is_partial()) return bytes * 1e-9;           // local, but a full-size buffer
  return 0;                                                              // a local slice, or zeros
}

Option cheapest(const Call& call, size_t axis, const std::vector<Option>& options) {
  double best = std::numeric_limits<double>::infinity();
  const Option* chosen = &options.back();  // the last option replicates: always possible
  for (const Option& option : options) {
    double bytes = 0;
    for (size_t i = 0; i < call.inputs.size(); ++i) bytes += cost(call.inputs[i], axis, option.inputs[i], call.axis_sizes);
    if (bytes < best) best = bytes, chosen = &option;
  }
  return *chosen;
}

void apply(Call& call, size_t axis, const Option& chosen) {
  for (size_t i = 0; i < call.inputs.size(); ++i) call.inputs[i].want.push_back(chosen.inputs[i]);
  for (auto& out : call.out_placements) out[axis] = chosen.out;
}

namespace {

void decide_rule(Call& call) {
  const std::string& b = call.base;
  if (decide_with_kernel(call)) return;
  if (b == "mm" || b == "addmm" || b == "bmm") return matmul(call);
  if (b == "sum" || b == "mean") return reduction(call);
  if (b == "_softmax" || b == "_log_softmax" || b == "_softmax_backward_data" || b == "_log_softmax_backward_data") {
    return softmax(call);
  }
  if (is_view_op(b)) return view(call);
  if (b == "new_empty" || b == "new_empty_strided" || b == "new_zeros" || b == "new_ones" || b == "new_full") {
    // A fresh tensor of a global size: whole on every rank.
    for (Operand& o : call.inputs) o.want = o.spec.placements;
    for (auto& out : call.out_placements) out.assign(call.axis_sizes.size(), R);
    return;
  }
  if (call.pointwise || overwrites(b) || linear_in_all(b)) return pointwise(call);
  std::string inputs;
  for (const Operand& o : call.inputs) inputs += (inputs.empty() ? "" : ", ") + o.spec.str();
  throw std::runtime_error("sharding annotations: aten::" + call.name + " has no sharding rule (inputs " + inputs +
                           "); redistribute its inputs to Replicate before it, or add a rule in annotate/rules.cpp");
}

}  // namespace

void decide(Call& call) {
  decide_rule(call);
  // An axis of one rank holds every tensor whole (from_local), whatever a rule chose there.
  for (size_t axis = 0; axis < call.axis_sizes.size(); ++axis) {
    if (call.axis_sizes[axis] != 1) continue;
    for (Operand& o : call.inputs) o.want[axis] = R;
    for (auto& out : call.out_placements) out[axis] = R;
  }
}

}  // namespace meshtrain::annotate
