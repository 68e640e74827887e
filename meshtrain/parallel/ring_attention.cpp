#include "meshtrain/parallel/ring_attention.h"

#include <torch/torch.h>

#include <limits>
#include <stdexcept>
#include <string>

namespace meshtrain::parallel {
namespace {

using CommPtr = std::shared_ptr<comm::Communicator>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CommCapsule : torch::CustomClassHolder {
  explicit CommCapsule(CommPtr c) : comm(std::move(c)) {}
  CommPtr comm;
};

// The rows of one key/value head's query group stacked: [B, H, T, D] ->
// [B, Hkv, G·T, D], and the positions repeated G times to match.
at::Tensor group_rows(const at::Tensor& q, int64_t kv_heads) {
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  return q.reshape({b, kv_heads, (h / kv_heads) * t, d});
}

// One block: this rank's queries against one travelling key/value block.
// Returns the block's unnormalised output and log-sum-exp (−inf for rows
// that may see none of its keys); `allowed` [rows, keys] or undefined (all).
struct Partial {
  at::Tensor out, lse;
};

at::Tensor mask_of(const at::Tensor& q_pos, const at::Tensor& k_pos, bool causal) {
  if (!causal) return {};
  return q_pos.unsqueeze(1) >= k_pos.unsqueeze(0);  // [rows, keys]
}

Partial block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed,
                      double scale) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)) * scale;  // [B, Hkv, rows, keys]
  if (allowed.defined()) s = s.masked_fill(allowed.logical_not(), -std::numeric_limits<float>::infinity());
  at::Tensor lse = at::logsumexp(s, -1, /*keepdim=*/true);
  at::Tensor p = at::exp(s - lse);
  p = at::where(at::isfinite(lse), p, at::zeros_like(p));  // rows that see nothing here: weight 0
  return {at::matmul(p, v), lse};
}

// Merges a block's result into the running one (Note [Ring attention]).
void merge(Partial& acc, const Partial& block) {
  if (!acc.out.defined()) {
    acc = block;
    return;
  }
  const at::Tensor lse = at::logaddexp(acc.lse, block.lse);
  const at::Tensor safe = at::where(at::isfinite(lse), lse, at::zeros_like(lse));
  auto weight = [&](const at::Tensor& l) {
    return at::where(at::isfinite(l), at::exp(l - safe), at::zeros_like(l));
  };
  acc.out = acc.out * weight(acc.lse) + block.out * weight(block.lse);
  acc.lse = lse;
}

// The next block in flight: sends `outgoing` to rank + 1, receives into fresh
// tensors from rank − 1.
struct Hop {
  std::vector<at::Tensor> incoming;
  std::vector<comm::Work> works;

  Hop(comm::Communicator& comm, const std::vector<at::Tensor>& outgoing, int tag) {
    const int n = comm.size(), r = comm.rank();
    for (size_t i = 0; i < outgoing.size(); ++i) {
      incoming.push_back(at::empty_like(outgoing[i]));
      works.push_back(comm.recv(incoming.back(), (r + n - 1) % n, tag + static_cast<int>(i)));
      works.push_back(comm.send(outgoing[i], (r + 1) % n, tag + static_cast<int>(i)));
    }
  }
  std::vector<at::Tensor> finish() {
    comm::wait_all(works);
    return incoming;
  }
};

struct RingAttention : torch::autograd::Function<RingAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& k_in,
                            const at::Tensor& v_in, const at::Tensor& positions, const CommPtr& comm, double scale,
                            bool causal) {
    const int64_t kv_heads = k_in.size(1), group = q_in.size(1) / kv_heads;
    const at::Tensor q = group_rows(q_in.to(at::kFloat), kv_heads);
    const at::Tensor q_pos = positions.repeat({group});
    std::vector<at::Tensor> block{k_in.to(at::kFloat).contiguous(), v_in.to(at::kFloat).contiguous(), positions.contiguous()};
    Partial acc;
    for (int step = 0; step < comm->size(); ++step) {
      std::unique_ptr<Hop> hop;
      if (step + 1 < comm->size()) hop = std::make_unique<Hop>(*comm, block, 0);
      merge(acc, block_forward(q, block[0], block[1], mask_of(q_pos, block[2], causal), scale));
      if (hop) block = hop->finish();
    }
    const at::Tensor out = acc.out.reshape(q_in.sizes());
    ctx->save_for_backward({q_in, k_in, v_in, positions, out, acc.lse});
    ctx->saved_data["comm"] = at::IValue::make_capsule(c10::make_intrusive<CommCapsule>(comm));
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["causal"] = causal;
    return out.to(q_in.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q_in = saved[0], &k_in = saved[1], &v_in = saved[2], &positions = saved[3];
    const CommPtr comm = c10::static_intrusive_pointer_cast<CommCapsule>(ctx->saved_data["comm"].toCapsule())->comm;
    const double scale = ctx->saved_data["scale"].toDouble();
    const bool causal = ctx->saved_data["causal"].toBool();
    const int64_t kv_heads = k_in.size(1), group = q_in.size(1) / kv_heads;
    const at::Tensor q = group_rows(q_in.to(at::kFloat), kv_heads);
    const at::Tensor q_pos = positions.repeat({group});
    const at::Tensor out = group_rows(saved[4], kv_heads), lse = saved[5];
    const at::Tensor d_out = group_rows(grads[0].to(at::kFloat), kv_heads);
    const at::Tensor delta = (d_out * out).sum(-1, /*keepdim=*/true);  // D = rowsum(dO ∘ O)
    at::Tensor d_q = at::zeros_like(q);
    // The block travels with its gradients; after cp hops they are home.
    std::vector<at::Tensor> block{k_in.to(at::kFloat).contiguous(), v_in.to(at::kFloat).contiguous(), positions.contiguous(),
                                  at::zeros_like(k_in, at::kFloat), at::zeros_like(v_in, at::kFloat)};
    for (int step = 0; step < comm->size(); ++step) {
      std::unique_ptr<Hop> hop;  // keys, values and positions go ahead of the gradients
      if (step + 1 < comm->size())
        hop = std::make_unique<Hop>(*comm, std::vector<at::Tensor>{block[0], block[1], block[2]}, 16);
      const at::Tensor &k = block[0], &v = block[1];
      at::Tensor s = at::matmul(q, k.transpose(-2, -1)) * scale;
      const at::Tensor allowed = mask_of(q_pos, block[2], causal);
      if (allowed.defined()) s = s.masked_fill(allowed.logical_not(), -std::numeric_limits<float>::infinity());
      at::Tensor p = at::where(at::isfinite(lse), at::exp(s - lse), at::zeros_like(s));
      const at::Tensor d_s = p * (at::matmul(d_out, v.transpose(-2, -1)) - delta);
      d_q += at::matmul(d_s, k) * scale;
      block[3] += at::matmul(d_s.transpose(-2, -1), q) * scale;
      block[4] += at::matmul(p.transpose(-2, -1), d_out);
      if (!hop) continue;
      std::vector<at::Tensor> next = hop->finish();
      const std::vector<at::Tensor> grads_home = Hop(*comm, {block[3], block[4]}, 32).finish();
      block = {next[0], next[1], next[2], grads_home[0], grads_home[1]};
    }
    // The last block's gradients belong to rank r + 1 (the block that started there): one more hop.
    const std::vector<at::Tensor> mine = comm->size() > 1 ? Hop(*comm, {block[3], block[4]}, 48).finish()
                                                           : std::vector<at::Tensor>{block[3], block[4]};
    return {d_q.reshape(q_in.sizes()).to(q_in.scalar_type()), mine[0].to(k_in.scalar_type()),
            mine[1].to(v_in.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                          const std::shared_ptr<comm::Communicator>& comm, double scale, bool causal) {
  if (q.dim() != 4 || k.dim() != 4 || v.sizes() != k.sizes() || q.size(0) != k.size(0) || q.size(2) != k.size(2) ||
      q.size(3) != k.size(3) || k.size(1) == 0 || q.size(1) % k.size(1) != 0) {
    throw std::invalid_argument("ring_attention: q [B, H, T, D] and k, v [B, Hkv, T, D] with H a multiple of Hkv");
  }
  if (positions.dim() != 1 || positions.size(0) != q.size(2) || positions.scalar_type() != at::kLong)
    throw std::invalid_argument("ring_attention: positions must be int64 [T], one per local row");
  return RingAttention::apply(q, k, v, positions, comm, scale, causal);
}

at::Tensor zigzag_positions(int64_t length, int64_t cp, int64_t rank) {
  if (cp < 1 || rank < 0 || rank >= cp || length % (2 * cp) != 0) {
    throw std::invalid_argument("zigzag split: the sequence length " + std::to_string(length) +
                                " must be a multiple of 2 x cp = " + std::to_string(2 * cp));
  }
  const int64_t chunk = length / (2 * cp);
  return at::cat({at::arange(rank * chunk, (rank + 1) * chunk, at::kLong),
                  at::arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, at::kLong)});
}

at::Tensor contiguous_positions(int64_t length, int64_t cp, int64_t rank) {
  if (cp < 1 || rank < 0 || rank >= cp || length % cp != 0) {
    throw std::invalid_argument("contiguous split: the sequence length " + std::to_string(length) +
                                " must be a multiple of cp = " + std::to_string(cp));
  }
  const int64_t chunk = length / cp;
  return at::arange(rank * chunk, (rank + 1) * chunk, at::kLong);
}

int64_t attention_pairs(const at::Tensor& positions, int64_t length, bool causal) {
  if (!causal) return positions.numel() * length;
  return (positions + 1).sum().item<int64_t>();  // query at position p sees keys 0..p
}

}  // namespace meshtrain::parallel
