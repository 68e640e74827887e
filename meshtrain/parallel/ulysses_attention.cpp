#include "meshtrain/parallel/ulysses_attention.h"

#include "meshtrain/model/attention.h"
#include "meshtrain/parallel/saved_comm.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

#include <limits>
#include <stdexcept>
#include <string>

namespace meshtrain::parallel {
namespace {

using CommPtr = std::shared_ptr<comm::Communicator>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// [B, H, Tl, D] split by sequence -> [B, H/cp, cp·Tl, D] split by heads.
at::Tensor sequence_to_heads(const at::Tensor& x, comm::Communicator& comm) {
  const int64_t cp = comm.size(), b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  const at::Tensor send = x.reshape({b, cp, h / cp, t, d}).permute({1, 0, 2, 3, 4}).contiguous();
  const at::Tensor received = at::empty_like(send);
  comm.all_to_all(received, send).wait();  // [source rank, B, H/cp, Tl, D]
  return received.permute({1, 2, 0, 3, 4}).reshape({b, h / cp, cp * t, d});
}

// The inverse: [B, H/cp, cp·Tl, D] -> [B, H, Tl, D].
at::Tensor heads_to_sequence(const at::Tensor& x, comm::Communicator& comm) {
  const int64_t cp = comm.size(), b = x.size(0), hl = x.size(1), t = x.size(2) / cp, d = x.size(3);
  const at::Tensor send = x.reshape({b, hl, cp, t, d}).permute({2, 0, 1, 3, 4}).contiguous();
  const at::Tensor received = at::empty_like(send);
  comm.all_to_all(received, send).wait();  // [source head group, B, H/cp, Tl, D]
  return received.permute({1, 0, 2, 3, 4}).reshape({b, cp * hl, t, d});
}

// One all-to-all of the pair; its backward is the other.
struct Regroup : torch::autograd::Function<Regroup> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const CommPtr& comm, bool to_heads) {
    save_comm(ctx, comm);
    ctx->saved_data["to_heads"] = to_heads;
    return to_heads ? sequence_to_heads(x, *comm) : heads_to_sequence(x, *comm);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const CommPtr comm = saved_comm(ctx);
    const at::Tensor g = grads[0].contiguous();
    return {ctx->saved_data["to_heads"].toBool() ? heads_to_sequence(g, *comm) : sequence_to_heads(g, *comm),
            at::Tensor(), at::Tensor()};
  }
};

// The checks both entry points share; `a2a` is the all-to-all group.
void check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t a2a) {
  if (q.dim() != 4 || k.dim() != 4 || v.sizes() != k.sizes() || q.size(2) != k.size(2) || k.size(1) == 0 ||
      q.size(1) % k.size(1) != 0) {
    throw std::invalid_argument("all_to_all_attention: q [B, H, T, D] and k, v [B, Hkv, T, D] with H a multiple of Hkv");
  }
  if (q.size(1) % a2a != 0 || k.size(1) % a2a != 0) {
    throw std::invalid_argument("all-to-all attention splits heads over its group: heads (" + std::to_string(q.size(1)) +
                                ") and key/value heads (" + std::to_string(k.size(1)) + ") must be multiples of cp = " +
                                std::to_string(a2a) + " (cp_a2a under hybrid); use cp_impl = \"ring\" or a group "
                                "size that divides both");
  }
}

// Heads scattered over `comm`, the sequence gathered: q, k, v in float32 and
// every rank's positions (and document starts, [B, T]), in rank order.
struct Gathered {
  at::Tensor q, k, v, positions, documents;
};
Gathered gather_sequence(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                         const at::Tensor& documents, const CommPtr& comm) {
  Gathered g;
  // On the communicator's device (a GPU's for NCCL); the mask is made from them there.
  const at::Tensor mine = positions.to(comm->device()).contiguous();
  g.positions = at::empty({comm->size() * positions.size(0)}, mine.options());
  comm->all_gather(g.positions, mine).wait();
  if (documents.defined()) {
    const at::Tensor starts = documents.to(comm->device()).contiguous();
    const at::Tensor all = at::empty({comm->size(), starts.size(0), starts.size(1)}, starts.options());
    comm->all_gather(all.view(-1), starts.view(-1)).wait();
    g.documents = all.permute({1, 0, 2}).reshape({starts.size(0), -1});  // [B, cp·T] in rank order
  }
  g.q = Regroup::apply(q.to(at::kFloat).contiguous(), comm, true);
  g.k = Regroup::apply(k.to(at::kFloat).contiguous(), comm, true);
  g.v = Regroup::apply(v.to(at::kFloat).contiguous(), comm, true);
  return g;
}

// [B, 1, T, T]: whether two rows share a document (equal starts), or undefined for one document per row.
at::Tensor same_document(const at::Tensor& starts) {
  if (!starts.defined() || !starts.ne(0).any().item<bool>()) return at::Tensor();
  return model::same_document(starts, starts);
}

// Attention over the gathered rows in rank order, by scores formed explicitly under a
// mask from their positions (and documents): any positions. Grouped queries
// as [B, kv heads, group x T, D], each key/value head's group of query heads
// one matrix against it: no copies of k and v (Note [Grouped queries]).
at::Tensor explicit_attention(const Gathered& g, const model::AttentionSpec& rule, int64_t group) {
  const int64_t b = g.q.size(0), kv = g.k.size(1), t = g.q.size(2), d = g.q.size(3);
  const at::Tensor q = g.q.view({b, kv, group * t, d});
  at::Tensor s = model::soft_cap(at::matmul(q, g.k.transpose(-2, -1)) * rule.scale, rule.softcap).view({b, kv, group, t, t});
  at::Tensor allowed;
  if (rule.causal) allowed = model::allowed_pairs(g.positions.to(s.device()), g.positions.to(s.device()), rule);
  if (const at::Tensor same = same_document(g.documents); same.defined()) {
    allowed = allowed.defined() ? same.logical_and(allowed) : same;
  }
  // The mask is [T, T] or [B, 1, T, T]: one more axis for the group.
  if (allowed.defined()) {
    s = s.masked_fill(allowed.dim() == 4 ? allowed.unsqueeze(2).logical_not() : allowed.logical_not(),
                      -std::numeric_limits<float>::infinity());
  }
  return at::matmul(at::softmax(s, -1).view({b, kv, group * t, t}), g.v).view({b, kv * group, t, d});
}

// The same over the rows put in position order, where they are the positions
// p..p + T − 1 (every rank's rows of a sequence): the model's attention
// (model::variant_attention: ATen's causal flash kernel, or a mask for a window
// or documents), which keeps no T x T softmax (a window's or the documents' mask is T x T,
// kept by the kernel as floats for backward); then back in rank order.
at::Tensor ordered_attention(const Gathered& g, const at::Tensor& order, const model::AttentionSpec& rule) {
  const at::Tensor back = at::argsort(order);
  const at::Tensor q = g.q.index_select(2, order), k = g.k.index_select(2, order), v = g.v.index_select(2, order);
  const at::Tensor same = same_document(g.documents.defined() ? g.documents.index_select(1, order) : at::Tensor());
  at::Tensor out;
  if (rule.causal) {
    out = model::variant_attention(q, k, v, rule, /*training=*/false, same);
  } else {
    const model::SdpaKeys kv = model::sdpa_keys(q, k, v, same.defined());
    out = at::scaled_dot_product_attention(q, kv.k, kv.v, same.defined() ? std::optional<at::Tensor>(same) : std::nullopt,
                                           0.0, false, rule.scale, kv.enable_gqa);
  }
  return out.index_select(2, back);
}

}  // namespace

at::Tensor all_to_all_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& positions, const std::shared_ptr<comm::Communicator>& comm,
                                const model::AttentionSpec& rule, const at::Tensor& documents) {
  check_shapes(q, k, v, comm->size());
  const Gathered g = gather_sequence(q, k, v, positions, documents, comm);
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // float32 arithmetic
  const int64_t group = q.size(1) / k.size(1);
  const at::Tensor order = at::argsort(g.positions);
  const at::Tensor sorted = g.positions.index_select(0, order);
  const bool run = sorted.size(0) < 2 || sorted.diff().eq(1).all().item<bool>();  // p..p + T − 1, once each
  const at::Tensor out = run ? ordered_attention(g, order, rule) : explicit_attention(g, rule, group);
  return Regroup::apply(out.contiguous(), comm, false).to(q.scalar_type());
}

at::Tensor hybrid_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                            const std::shared_ptr<comm::Communicator>& a2a,
                            const std::shared_ptr<comm::Communicator>& ring, const model::AttentionSpec& rule,
                            const at::Tensor& documents) {
  check_shapes(q, k, v, a2a->size());
  const Gathered g = gather_sequence(q, k, v, positions, documents, a2a);
  const at::Tensor out = ring_attention(g.q, g.k, g.v, g.positions, ring, rule, g.documents);
  return Regroup::apply(out.contiguous(), a2a, false).to(q.scalar_type());
}

}  // namespace meshtrain::parallel
