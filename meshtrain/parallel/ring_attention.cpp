#include "meshtrain/parallel/ring_attention.h"

#include "meshtrain/parallel/attention_tiles.h"
#include "meshtrain/parallel/saved_comm.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <stdexcept>
#include <string>

namespace meshtrain::parallel {
namespace {

using CommPtr = std::shared_ptr<comm::Communicator>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using tiles::Segment;

thread_local RingProfile* current_profile = nullptr;
using ProfileClock = std::chrono::steady_clock;

double since(ProfileClock::time_point start) {
  return std::chrono::duration<double>(ProfileClock::now() - start).count();
}

// Times a block product into the current profile (if any) and counts its scores.
template <typename F>
void profiled(const at::Tensor& scores_like_q, int64_t keys, F product) {
  if (!current_profile) return product();
  const auto start = ProfileClock::now();
  product();
  current_profile->compute_s += since(start);
  current_profile->scores += scores_like_q.numel() / scores_like_q.size(-1) * keys;
}

// The next block in flight: sends `outgoing` to rank + 1, receives into fresh
// tensors from rank − 1.
struct Hop {
  std::vector<at::Tensor> incoming;
  std::vector<comm::Work> works;

  Hop(comm::Communicator& comm, const std::vector<at::Tensor>& outgoing, int tag) {
    const int n = comm.size(), r = comm.rank();
    for (size_t i = 0; i < outgoing.size(); ++i) {
      incoming.push_back(at::empty(outgoing[i].sizes(), outgoing[i].options()));  // contiguous, whatever came in
      works.push_back(comm.recv(incoming.back(), (r + n - 1) % n, tag + static_cast<int>(i)));
      works.push_back(comm.send(outgoing[i], (r + 1) % n, tag + static_cast<int>(i)));
    }
  }
  std::vector<at::Tensor> finish() {
    comm::wait_all(works);
    return incoming;
  }
};

// Waits for the hop in flight, timing the wait into the current profile.
std::vector<at::Tensor> finish_overlapped(Hop& hop) {
  if (!current_profile) return hop.finish();
  const auto start = ProfileClock::now();
  std::vector<at::Tensor> out = hop.finish();
  current_profile->wait_s += since(start);
  ++current_profile->overlapped_hops;
  return out;
}

// The document starts, or undefined where there are none (an empty tensor).
at::Tensor present(const at::Tensor& documents) { return documents.numel() > 0 ? documents : at::Tensor(); }

struct RingAttention : torch::autograd::Function<RingAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& k_in,
                            const at::Tensor& v_in, const at::Tensor& positions, const at::Tensor& documents_in,
                            const CommPtr& comm, const model::AttentionSpec& rule) {
    // float32 under autocast too: backward recomputes the scores in fp32 from this forward's lse.
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor documents = present(documents_in);
    const int64_t groups = q_in.size(1) / k_in.size(1);
    const std::vector<Segment> mine = tiles::segments_of(positions);
    const at::Tensor q = tiles::stack_groups(q_in, k_in.size(1), mine);
    const bool use_fused = tiles::fused(q, rule);
    const tiles::Documents my_documents(documents);
    // keys, values, positions and (packed rows) document starts travel together
    std::vector<at::Tensor> block{k_in.to(at::kFloat).contiguous(), v_in.to(at::kFloat).contiguous(),
                                  positions.to(comm->device()).contiguous()};
    if (documents.defined()) block.push_back(documents.to(comm->device()).contiguous());
    std::vector<tiles::Partial> acc(mine.size());
    for (int step = 0; step < comm->size(); ++step) {
      std::unique_ptr<Hop> hop;
      if (step + 1 < comm->size()) hop = std::make_unique<Hop>(*comm, block, 0);
      const tiles::Documents their_documents(documents.defined() ? block[3] : at::Tensor());
      for (const Segment& ks : tiles::segments_of(block[2])) {
        for (size_t i = 0; i < mine.size(); ++i) {
          const tiles::Tile t = tiles::tile_of(mine[i], ks, rule, my_documents, their_documents, groups, q.device());
          if (t.skip) continue;
          const at::Tensor qq = tiles::rows_of(q, mine[i], groups);
          profiled(qq, ks.length, [&] {
            tiles::merge(acc[i], tiles::forward(qq, block[0].narrow(2, ks.begin, ks.length),
                                                block[1].narrow(2, ks.begin, ks.length), t, rule, use_fused));
          });
        }
      }
      if (hop) block = finish_overlapped(*hop);
    }
    std::vector<at::Tensor> outs, lses;
    for (const tiles::Partial& p : acc) {  // every segment sees at least its own positions
      outs.push_back(p.out);
      lses.push_back(p.lse);
    }
    const at::Tensor out = at::cat(outs, 2), lse = at::cat(lses, 2);  // stacked rows (Note [Attention tiles])
    ctx->save_for_backward({q_in, k_in, v_in, positions, out, lse, documents_in});
    save_comm(ctx, comm);
    ctx->saved_data["scale"] = rule.scale;
    ctx->saved_data["causal"] = rule.causal;
    ctx->saved_data["window"] = rule.window;
    ctx->saved_data["softcap"] = rule.softcap;
    return tiles::unstack_groups(out, q_in.size(1), mine).to(q_in.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q_in = saved[0], &k_in = saved[1], &v_in = saved[2], &positions = saved[3];
    const at::Tensor &out = saved[4], &lse = saved[5], documents = present(saved[6]);
    const CommPtr comm = saved_comm(ctx);
    const model::AttentionSpec rule{ctx->saved_data["scale"].toDouble(), ctx->saved_data["causal"].toBool(),
                                    ctx->saved_data["window"].toInt(), ctx->saved_data["softcap"].toDouble()};
    const int64_t kv_heads = k_in.size(1), groups = q_in.size(1) / kv_heads;
    const std::vector<Segment> mine = tiles::segments_of(positions);
    const at::Tensor q = tiles::stack_groups(q_in, kv_heads, mine);
    const at::Tensor d_out = tiles::stack_groups(grads[0], kv_heads, mine).contiguous();
    const bool use_fused = tiles::fused(q, rule);
    const at::Tensor delta = use_fused ? at::Tensor() : (d_out * out).sum(-1, /*keepdim=*/true);  // D = rowsum(dO ∘ O)
    const tiles::Documents my_documents(documents);
    at::Tensor d_q = at::zeros_like(q);
    // The block travels with its gradients; after cp hops they are home.
    const at::TensorOptions fp32 = k_in.options().dtype(at::kFloat);
    std::vector<at::Tensor> block{k_in.to(at::kFloat).contiguous(), v_in.to(at::kFloat).contiguous(),
                                  positions.to(comm->device()).contiguous()};
    if (documents.defined()) block.push_back(documents.to(comm->device()).contiguous());
    at::Tensor d_k = at::zeros(k_in.sizes(), fp32), d_v = at::zeros(v_in.sizes(), fp32);
    for (int step = 0; step < comm->size(); ++step) {
      std::unique_ptr<Hop> hop;  // keys, values, positions (and document starts) go ahead of the gradients
      if (step + 1 < comm->size()) hop = std::make_unique<Hop>(*comm, block, 16);
      const tiles::Documents their_documents(documents.defined() ? block[3] : at::Tensor());
      for (const Segment& ks : tiles::segments_of(block[2])) {
        for (const Segment& qs : mine) {
          const tiles::Tile t = tiles::tile_of(qs, ks, rule, my_documents, their_documents, groups, q.device());
          if (t.skip) continue;
          const at::Tensor qq = tiles::rows_of(q, qs, groups);
          profiled(qq, ks.length, [&] {
            tiles::backward(qq, block[0].narrow(2, ks.begin, ks.length), block[1].narrow(2, ks.begin, ks.length),
                            tiles::rows_of(out, qs, groups), tiles::rows_of(lse, qs, groups),
                            tiles::rows_of(d_out, qs, groups),
                            delta.defined() ? tiles::rows_of(delta, qs, groups) : at::Tensor(), t, rule, use_fused,
                            {tiles::rows_of(d_q, qs, groups), d_k.narrow(2, ks.begin, ks.length),
                             d_v.narrow(2, ks.begin, ks.length)});
          });
        }
      }
      if (!hop) continue;
      block = finish_overlapped(*hop);
      const std::vector<at::Tensor> grads_home = Hop(*comm, {d_k, d_v}, 32).finish();
      d_k = grads_home[0];
      d_v = grads_home[1];
    }
    // The last block's gradients belong to rank r + 1 (the block that started there): one more hop.
    const std::vector<at::Tensor> home = comm->size() > 1 ? Hop(*comm, {d_k, d_v}, 48).finish()
                                                           : std::vector<at::Tensor>{d_k, d_v};
    return {tiles::unstack_groups(d_q, q_in.size(1), mine).to(q_in.scalar_type()), home[0].to(k_in.scalar_type()),
            home[1].to(v_in.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                          const std::shared_ptr<comm::Communicator>& comm, const model::AttentionSpec& rule,
                          const at::Tensor& documents) {
  if (q.dim() != 4 || k.dim() != 4 || v.sizes() != k.sizes() || q.size(0) != k.size(0) || q.size(2) != k.size(2) ||
      q.size(3) != k.size(3) || k.size(1) == 0 || q.size(1) % k.size(1) != 0) {
    throw std::invalid_argument("ring_attention: q [B, H, T, D] and k, v [B, Hkv, T, D] with H a multiple of Hkv");
  }
  if (positions.dim() != 1 || positions.size(0) != q.size(2) || positions.scalar_type() != at::kLong)
    throw std::invalid_argument("ring_attention: positions must be int64 [T], one per local row");
  if (rule.window < 0 || (rule.window > 0 && !rule.causal) || rule.softcap < 0 || !(rule.scale > 0)) {
    throw std::invalid_argument(
        "ring_attention: a window >= 0 (with causal attention only), a soft-cap >= 0 and a resolved scale > 0");
  }
  if (documents.defined() && (documents.dim() != 2 || documents.size(0) != q.size(0) ||
                              documents.size(1) != q.size(2) || documents.scalar_type() != at::kLong)) {
    throw std::invalid_argument("ring_attention: documents must be int64 [B, T], each row's document start");
  }
  // An autograd function's tensor arguments must be defined: no documents travel as an empty tensor.
  const at::Tensor none = at::empty({0}, positions.options());
  return RingAttention::apply(q, k, v, positions, documents.defined() ? documents : none, comm, rule);
}

RingProfileScope::RingProfileScope(RingProfile& profile) : previous_(current_profile) { current_profile = &profile; }
RingProfileScope::~RingProfileScope() { current_profile = previous_; }

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
