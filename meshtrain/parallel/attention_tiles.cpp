#include "meshtrain/parallel/attention_tiles.h"

#include <algorithm>
#include <limits>
#include <optional>

namespace meshtrain::parallel::tiles {
namespace {

constexpr float kHidden = -std::numeric_limits<float>::infinity();

// Which (query, key) pairs of two segments the rule keeps: none (every key
// after every query, or every key out of every query's window: the product
// is skipped), all, or some.
enum class Cover { kNone, kAll, kSome };
Cover cover(const Segment& q, const Segment& k, const model::AttentionSpec& rule) {
  if (!rule.causal) return Cover::kAll;
  if (q.last < k.first || (rule.window > 0 && q.first - k.last >= rule.window)) return Cover::kNone;
  const bool all = q.first >= k.last && (rule.window == 0 || q.last - k.first < rule.window);
  return all ? Cover::kAll : Cover::kSome;
}

// [lq, lk], made on `device` (no host-to-device copy per tile).
at::Tensor allowed_of(const Segment& q, const Segment& k, const model::AttentionSpec& rule, at::Device device) {
  const at::TensorOptions o = at::TensorOptions(at::kLong).device(device);
  return model::allowed_pairs(at::arange(q.first, q.last + 1, o), at::arange(k.first, k.last + 1, o), rule);
}

// The scores of a tile, soft-capped where the rule says, and masked where
// `allowed` (if defined) is false: one tile-sized tensor, computed in place.
at::Tensor scores(const at::Tensor& q, const at::Tensor& k, const model::AttentionSpec& rule,
                  const at::Tensor& allowed) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)).mul_(rule.scale);
  model::soft_cap_(s, rule.softcap);
  if (allowed.defined()) s.masked_fill_(allowed.logical_not(), kHidden);
  return s;
}

// softmax's numerator exp(s − lse) in place of s; rows whose lse is −inf
// (they see no key here) get 0.
void exp_in_place(at::Tensor& s, const at::Tensor& lse) {
  s.sub_(lse).exp_();
  s.masked_fill_(at::isfinite(lse).logical_not(), 0);
}

// The fused kernel's additive mask: 0 where kept, −inf where hidden.
std::optional<at::Tensor> additive(const Tile& tile) {
  if (!tile.allowed.defined()) return std::nullopt;
  return at::zeros(tile.allowed.sizes(), tile.allowed.options().dtype(at::kFloat))
      .masked_fill_(tile.allowed.logical_not(), kHidden);
}

}  // namespace

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

Documents::Documents(const at::Tensor& starts) : device(starts) {
  if (starts.defined()) host = starts.cpu();
}

Tile tile_of(const Segment& q, const Segment& k, const model::AttentionSpec& rule, const Documents& dq,
             const Documents& dk, int64_t groups, at::Device device) {
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
  at::Tensor allowed;  // [lq, lk] or [B, 1, 1, lq, lk]
  if (c == Cover::kSome) allowed = allowed_of(q, k, rule, device);
  if (!one) {
    const int64_t b = dq.device.size(0);
    const at::Tensor same = dq.device.narrow(1, q.begin, q.length).to(device).unsqueeze(2) ==
                            dk.device.narrow(1, k.begin, k.length).to(device).unsqueeze(1);
    const at::Tensor docs = same.view({b, 1, 1, q.length, k.length});
    allowed = allowed.defined() ? docs.logical_and(allowed) : docs;
  }
  if (allowed.defined()) {  // the same pairs for each of the G stacked query heads
    t.allowed = allowed.reshape({-1, 1, 1, q.length, k.length})
                    .expand({-1, 1, groups, q.length, k.length})
                    .reshape({-1, 1, groups * q.length, k.length});
  }
  return t;
}

at::Tensor stack_groups(const at::Tensor& x, int64_t kv_heads, const std::vector<Segment>& segments) {
  const int64_t b = x.size(0), g = x.size(1) / kv_heads, d = x.size(3);
  if (g == 1) return x.to(at::kFloat);
  const at::Tensor grouped = x.to(at::kFloat).reshape({b, kv_heads, g, x.size(2), d});
  std::vector<at::Tensor> parts;
  for (const Segment& s : segments) parts.push_back(grouped.narrow(3, s.begin, s.length).reshape({b, kv_heads, -1, d}));
  return at::cat(parts, 2);
}

at::Tensor unstack_groups(const at::Tensor& stacked, int64_t heads, const std::vector<Segment>& segments) {
  const int64_t b = stacked.size(0), kv_heads = stacked.size(1), g = heads / kv_heads, d = stacked.size(3);
  if (g == 1) return stacked;
  std::vector<at::Tensor> parts;
  for (const Segment& s : segments) parts.push_back(rows_of(stacked, s, g).reshape({b, kv_heads, g, s.length, d}));
  return at::cat(parts, 3).reshape({b, heads, -1, d});
}

at::Tensor rows_of(const at::Tensor& stacked, const Segment& s, int64_t groups) {
  return stacked.narrow(2, groups * s.begin, groups * s.length);
}

bool fused(const at::Tensor& q, const model::AttentionSpec& rule) { return q.device().is_cpu() && rule.softcap == 0; }

Partial forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Tile& tile,
                const model::AttentionSpec& rule, bool use_fused) {
  if (use_fused) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, false, additive(tile), rule.scale);
    lse = lse.unsqueeze(-1);
    if (tile.allowed.defined()) lse.masked_fill_(tile.allowed.logical_not().all(-1, /*keepdim=*/true), kHidden);
    return {out, lse};
  }
  at::Tensor s = scores(q, k, rule, tile.allowed);  // [B, Hkv, G·lq, lk]
  at::Tensor lse = at::logsumexp(s, -1, /*keepdim=*/true);
  exp_in_place(s, lse);
  return {at::matmul(s, v), lse};
}

void merge(Partial& acc, const Partial& tile) {
  if (!acc.out.defined()) {
    acc = tile;
    return;
  }
  const at::Tensor lse = at::logaddexp(acc.lse, tile.lse);
  const at::Tensor safe = at::where(at::isfinite(lse), lse, at::zeros_like(lse));
  auto weight = [&](const at::Tensor& l) {
    return at::where(at::isfinite(l), at::exp(l - safe), at::zeros_like(l));
  };
  acc.out = acc.out * weight(acc.lse) + tile.out * weight(tile.lse);
  acc.lse = lse;
}

void backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const at::Tensor& lse, const at::Tensor& d_out, const at::Tensor& delta, const Tile& tile,
              const model::AttentionSpec& rule, bool use_fused, Grads into) {
  if (use_fused) {  // P from the merged lse, D from the merged output: the whole sequence's
    const auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        d_out, q, k, v, out, lse.squeeze(-1), 0.0, false, additive(tile), rule.scale);
    into.dq.add_(dq);
    into.dk.add_(dk);
    into.dv.add_(dv);
    return;
  }
  // Two tile-sized tensors at most (p and dS, in place), three with a soft-cap.
  at::Tensor p = scores(q, k, rule, tile.allowed);
  at::Tensor tanh_sq;  // soft-cap: (capped score / c)², 0 where masked
  if (rule.softcap > 0) tanh_sq = p.div(rule.softcap).nan_to_num_(0, 0, 0).square_();
  exp_in_place(p, lse);
  at::Tensor d_s = at::matmul(d_out, v.transpose(-2, -1)).sub_(delta).mul_(p);
  if (rule.softcap > 0) d_s.mul_(tanh_sq.neg_().add_(1));  // d(c·tanh(x/c))/dx = 1 − tanh²(x/c)
  into.dq.add_(at::matmul(d_s, k).mul_(rule.scale));
  into.dk.add_(at::matmul(d_s.transpose(-2, -1), q).mul_(rule.scale));
  into.dv.add_(at::matmul(p.transpose(-2, -1), d_out));
}

}  // namespace meshtrain::parallel::tiles
