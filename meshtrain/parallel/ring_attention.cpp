#include "meshtrain/parallel/ring_attention.h"

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

// A run of consecutive global positions among the local rows: rows
// [begin, begin + length) hold positions first..last. Runs are cut at half
// the local rows, so that the zigzag split's two chunks stay two segments
// even where they meet (the middle rank's), and the contiguous split's one
// run is two; and at kTileRows, so that a product's scores, its softmax and
// their gradients are tiles of at most kTileRows² per head, whatever the
// sequence (the work space stays flat as sequences grow, and the causal
// skip is finer: only diagonal tiles are masked).
constexpr int64_t kTileRows = 512;

struct Segment {
  int64_t begin, length, first, last;
};

std::vector<Segment> segments_of(const at::Tensor& positions_anywhere) {
  const at::Tensor positions = positions_anywhere.cpu();  // a block's travel on the communicator's device
  const auto p = positions.accessor<int64_t, 1>();
  const int64_t most = std::min(kTileRows, std::max<int64_t>(1, p.size(0) / 2));
  std::vector<Segment> out;
  for (int64_t i = 0; i < p.size(0); ++i) {
    if (!out.empty() && p[i] == out.back().last + 1 && out.back().length < most) {
      ++out.back().length;
      ++out.back().last;
    } else {
      out.push_back({i, 1, p[i], p[i]});
    }
  }
  return out;
}

// Which (query, key) pairs of two segments the rule keeps: none (every key
// after every query, or every key out of every query's window: the product
// is skipped), all, or some.
enum class Cover { kNone, kAll, kSome };
Cover cover(const Segment& q, const Segment& k, const AttentionRule& rule) {
  if (!rule.causal) return Cover::kAll;
  if (q.last < k.first || (rule.window > 0 && q.first - k.last >= rule.window)) return Cover::kNone;
  const bool all = q.first >= k.last && (rule.window == 0 || q.last - k.first < rule.window);
  return all ? Cover::kAll : Cover::kSome;
}

// [lq, lk], made on `device` (no host-to-device copy per tile).
at::Tensor allowed_of(const Segment& q, const Segment& k, const AttentionRule& rule, at::Device device) {
  const at::TensorOptions o = at::TensorOptions(at::kLong).device(device);
  return allowed_pairs(at::arange(q.first, q.last + 1, o), at::arange(k.first, k.last + 1, o), rule);
}

// Packed rows: each row's document start (the global position where its
// document begins), [B, T] int64 beside the block on the device, and a copy
// on the host for the decisions per tile. Undefined: one document per row.
struct Documents {
  at::Tensor device, host;
  explicit Documents(const at::Tensor& starts) : device(starts) {
    if (starts.defined()) host = starts.cpu();
  }
};

// A tile to compute, and its mask (undefined: every pair kept).
struct Tile {
  bool skip = true;
  at::Tensor allowed;
};

// Which pairs of a tile the rule and the documents keep. Two rows share a
// document when their starts are equal; starts rise along a segment, so a
// tile whose query and key starts do not overlap in any row is skipped (the
// documents before a query's are never computed), and one whose rows all
// share one start needs no document mask.
Tile tile_of(const Segment& q, const Segment& k, const AttentionRule& rule, const Documents& dq, const Documents& dk,
             at::Device device) {
  Tile t;
  const Cover c = cover(q, k, rule);
  if (c == Cover::kNone) return t;
  bool shared = !dq.host.defined(), one = true;
  if (dq.host.defined()) {
    const auto sq = dq.host.accessor<int64_t, 2>(), sk = dk.host.accessor<int64_t, 2>();
    for (int64_t b = 0; b < sq.size(0); ++b) {
      const int64_t q0 = sq[b][q.begin], q1 = sq[b][q.begin + q.length - 1];
      const int64_t k0 = sk[b][k.begin], k1 = sk[b][k.begin + k.length - 1];
      shared = shared || (k1 >= q0 && q1 >= k0);
      one = one && q0 == q1 && k0 == k1 && q0 == k0;
    }
  }
  if (!shared) return t;
  t.skip = false;
  if (c == Cover::kSome) t.allowed = allowed_of(q, k, rule, device);
  if (!one) {
    const int64_t b = dq.device.size(0);
    const at::Tensor same = dq.device.narrow(1, q.begin, q.length).to(device).unsqueeze(2) ==
                            dk.device.narrow(1, k.begin, k.length).to(device).unsqueeze(1);
    const at::Tensor docs = same.view({b, 1, 1, q.length, k.length});
    t.allowed = t.allowed.defined() ? docs.logical_and(t.allowed) : docs;
  }
  return t;
}

// The scores of a tile, soft-capped where the rule says, and masked where
// `allowed` (if defined) is false: one tile-sized tensor, computed in place.
at::Tensor scores(const at::Tensor& q, const at::Tensor& k, const AttentionRule& rule, const at::Tensor& allowed) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)).mul_(rule.scale);
  if (rule.softcap > 0) s.div_(rule.softcap).tanh_().mul_(rule.softcap);
  if (allowed.defined()) s.masked_fill_(allowed.logical_not(), -std::numeric_limits<float>::infinity());
  return s;
}

// softmax's numerator exp(s − lse) in place of s; rows whose lse is −inf
// (they see no key here) get 0.
void exp_in_place(at::Tensor& s, const at::Tensor& lse) {
  s.sub_(lse).exp_();
  s.masked_fill_(at::isfinite(lse).logical_not(), 0);
}

// One segment pair: queries q [B, Hkv, G, lq, D] (a key/value head's query
// group in dim 2) against keys and values [B, Hkv, 1, lk, D]. Returns the
// unnormalised output and the log-sum-exp of each query row.
struct Partial {
  at::Tensor out, lse;
};

Partial block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed,
                      const AttentionRule& rule) {
  at::Tensor s = scores(q, k, rule, allowed);  // [B, Hkv, G, lq, lk]
  at::Tensor lse = at::logsumexp(s, -1, /*keepdim=*/true);
  exp_in_place(s, lse);
  return {at::matmul(s, v), lse};
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
  // [B, H, T, D] -> [B, Hkv, G, T, D] in float32: a key/value head's query group in dim 2.
  static at::Tensor grouped(const at::Tensor& q, int64_t kv_heads) {
    return q.to(at::kFloat).reshape({q.size(0), kv_heads, q.size(1) / kv_heads, q.size(2), q.size(3)});
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& k_in,
                            const at::Tensor& v_in, const at::Tensor& positions, const at::Tensor& documents_in,
                            const CommPtr& comm, const AttentionRule& rule) {
    const at::Tensor documents = present(documents_in);
    // float32 under autocast too: backward recomputes the scores in fp32 from this forward's lse.
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::Tensor q = grouped(q_in, k_in.size(1));
    const std::vector<Segment> mine = segments_of(positions);
    const Documents my_documents(documents);
    // keys, values, positions and (packed rows) document starts travel together
    std::vector<at::Tensor> block{k_in.to(at::kFloat).contiguous(), v_in.to(at::kFloat).contiguous(),
                                  positions.to(comm->device()).contiguous()};
    if (documents.defined()) block.push_back(documents.to(comm->device()).contiguous());
    std::vector<Partial> acc(mine.size());
    for (int step = 0; step < comm->size(); ++step) {
      std::unique_ptr<Hop> hop;
      if (step + 1 < comm->size()) hop = std::make_unique<Hop>(*comm, block, 0);
      const at::Tensor k = block[0].unsqueeze(2), v = block[1].unsqueeze(2);
      const Documents their_documents(documents.defined() ? block[3] : at::Tensor());
      for (const Segment& ks : segments_of(block[2])) {
        for (size_t i = 0; i < mine.size(); ++i) {
          const Tile t = tile_of(mine[i], ks, rule, my_documents, their_documents, q.device());
          if (t.skip) continue;
          const at::Tensor qq = q.narrow(3, mine[i].begin, mine[i].length);
          profiled(qq, ks.length, [&] {
            merge(acc[i], block_forward(qq, k.narrow(3, ks.begin, ks.length), v.narrow(3, ks.begin, ks.length),
                                        t.allowed, rule));
          });
        }
      }
      if (hop) block = finish_overlapped(*hop);
    }
    std::vector<at::Tensor> outs, lses;
    for (const Partial& p : acc) {  // every segment sees at least its own positions
      outs.push_back(p.out);
      lses.push_back(p.lse);
    }
    const at::Tensor out = at::cat(outs, 3), lse = at::cat(lses, 3);
    ctx->save_for_backward({q_in, k_in, v_in, positions, out, lse, documents});
    save_comm(ctx, comm);
    ctx->saved_data["scale"] = rule.scale;
    ctx->saved_data["causal"] = rule.causal;
    ctx->saved_data["window"] = rule.window;
    ctx->saved_data["softcap"] = rule.softcap;
    return out.reshape(q_in.sizes()).to(q_in.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q_in = saved[0], &k_in = saved[1], &v_in = saved[2], &positions = saved[3];
    const at::Tensor &out = saved[4], &lse = saved[5], documents = present(saved[6]);
    const CommPtr comm = saved_comm(ctx);
    const AttentionRule rule{ctx->saved_data["scale"].toDouble(), ctx->saved_data["causal"].toBool(),
                             ctx->saved_data["window"].toInt(), ctx->saved_data["softcap"].toDouble()};
    const double scale = rule.scale;
    const int64_t kv_heads = k_in.size(1);
    const at::Tensor q = grouped(q_in, kv_heads), d_out = grouped(grads[0], kv_heads);
    const at::Tensor delta = (d_out * out).sum(-1, /*keepdim=*/true);  // D = rowsum(dO ∘ O)
    const std::vector<Segment> mine = segments_of(positions);
    const Documents my_documents(documents);
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
      const at::Tensor k = block[0].unsqueeze(2), v = block[1].unsqueeze(2);
      const Documents their_documents(documents.defined() ? block[3] : at::Tensor());
      for (const Segment& ks : segments_of(block[2])) {
        for (const Segment& qs : mine) {
          const Tile t = tile_of(qs, ks, rule, my_documents, their_documents, q.device());
          if (t.skip) continue;
          const at::Tensor qq = q.narrow(3, qs.begin, qs.length), kk = k.narrow(3, ks.begin, ks.length),
                           vv = v.narrow(3, ks.begin, ks.length), l = lse.narrow(3, qs.begin, qs.length),
                           d_o = d_out.narrow(3, qs.begin, qs.length);
          profiled(qq, ks.length, [&] {
            // Two tile-sized tensors at most (p and dS, in place), three with a soft-cap.
            at::Tensor p = scores(qq, kk, rule, t.allowed);
            at::Tensor tanh_sq;  // soft-cap: (capped score / c)², 0 where masked
            if (rule.softcap > 0) tanh_sq = p.div(rule.softcap).nan_to_num_(0, 0, 0).square_();
            exp_in_place(p, l);
            at::Tensor d_s = at::matmul(d_o, vv.transpose(-2, -1)).sub_(delta.narrow(3, qs.begin, qs.length)).mul_(p);
            if (rule.softcap > 0) d_s.mul_(tanh_sq.neg_().add_(1));  // d(c·tanh(x/c))/dx = 1 − tanh²(x/c)
            d_q.narrow(3, qs.begin, qs.length).add_(at::matmul(d_s, kk) * scale);
            d_k.narrow(2, ks.begin, ks.length).add_(at::matmul(d_s.transpose(-2, -1), qq).sum(2) * scale);
            d_v.narrow(2, ks.begin, ks.length).add_(at::matmul(p.transpose(-2, -1), d_o).sum(2));
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
    return {d_q.reshape(q_in.sizes()).to(q_in.scalar_type()), home[0].to(k_in.scalar_type()),
            home[1].to(v_in.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                          const std::shared_ptr<comm::Communicator>& comm, const AttentionRule& rule,
                          const at::Tensor& documents) {
  if (q.dim() != 4 || k.dim() != 4 || v.sizes() != k.sizes() || q.size(0) != k.size(0) || q.size(2) != k.size(2) ||
      q.size(3) != k.size(3) || k.size(1) == 0 || q.size(1) % k.size(1) != 0) {
    throw std::invalid_argument("ring_attention: q [B, H, T, D] and k, v [B, Hkv, T, D] with H a multiple of Hkv");
  }
  if (positions.dim() != 1 || positions.size(0) != q.size(2) || positions.scalar_type() != at::kLong)
    throw std::invalid_argument("ring_attention: positions must be int64 [T], one per local row");
  if (rule.window < 0 || (rule.window > 0 && !rule.causal) || rule.softcap < 0) {
    throw std::invalid_argument("ring_attention: a window >= 0 (with causal attention only) and a soft-cap >= 0");
  }
  if (documents.defined() && (documents.dim() != 2 || documents.size(0) != q.size(0) ||
                              documents.size(1) != q.size(2) || documents.scalar_type() != at::kLong)) {
    throw std::invalid_argument("ring_attention: documents must be int64 [B, T], each row's document start");
  }
  // An autograd function's tensor arguments must be defined: no documents travel as an empty tensor.
  const at::Tensor none = at::empty({0}, positions.options());
  return RingAttention::apply(q, k, v, positions, documents.defined() ? documents : none, comm, rule);
}

at::Tensor allowed_pairs(const at::Tensor& queries, const at::Tensor& keys, const AttentionRule& rule) {
  if (!rule.causal) return at::ones({queries.size(0), keys.size(0)}, queries.options().dtype(at::kBool));
  const at::Tensor distance = queries.unsqueeze(1) - keys.unsqueeze(0);  // query position − key position
  const at::Tensor seen = distance >= 0;
  return rule.window > 0 ? seen.logical_and(distance < rule.window) : seen;
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
