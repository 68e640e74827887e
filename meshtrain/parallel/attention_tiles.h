// The tiles ring attention computes: which (query, key) pairs of two runs of
// rows a rule and the rows' documents keep, and the products of one tile,
// forward and backward (Note [Attention tiles]).
#pragma once

#include "meshtrain/parallel/ring_attention.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace meshtrain::parallel::tiles {

// Note [Attention tiles]
// Rows are grouped-query stacked: [B, Hkv, G·T, D], the queries of a
// key/value head's group of G heads stacked as rows, segment by segment
// (stack_groups), so one segment's queries of every group are one range of
// rows and a tile is a plain batched product against keys [B, Hkv, lk, D],
// with no copy of k or v per query head.
// A tile's products run one of two ways, the same arithmetic:
// - fused (the CPU without a soft-cap): ATen's CPU flash kernel, which keeps
//   only row statistics and returns each row's log-sum-exp, the ring's merge
//   needs; its backward takes the merged output and log-sum-exp, so P and
//   D = rowsum(dO ∘ O) are the whole sequence's. For a [1, 8, 512, 64]
//   fp32 tile on 2 cores it takes 3.8 ms forward and 11 backward, against 13
//   and 18 for the matmuls and passes below. Its mask is additive; a row that
//   sees no key of the tile gets log-sum-exp −inf (the kernel says 0).
// - matmuls: scores, soft-cap, mask, log-sum-exp and exp as ATen passes over
//   a tile-sized tensor in place (GPUs, and soft-capped scores).

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
std::vector<Segment> segments_of(const at::Tensor& positions);

// Packed rows: each row's document start (the global position where its
// document begins), [B, T] int64 on the device, and a copy on the host for
// the decisions per tile. Undefined: one document per row.
struct Documents {
  at::Tensor device, host;
  explicit Documents(const at::Tensor& starts);
};

// A tile to compute, and its mask (undefined: every pair kept; else bool
// [b, 1, G·lq, lk] over stacked query rows, b 1 or B).
struct Tile {
  bool skip = true;
  at::Tensor allowed;
};
// Two rows share a document when their starts are equal; starts rise along a
// segment, so a tile whose query and key starts do not overlap in any row is
// skipped, and one whose rows all share one start needs no document mask.
Tile tile_of(const Segment& q, const Segment& k, const model::AttentionSpec& rule, const Documents& dq,
             const Documents& dk, int64_t groups, at::Device device);

// [B, H, T, D] -> [B, Hkv, G·T, D] in float32 (Note [Attention tiles]), and back.
at::Tensor stack_groups(const at::Tensor& x, int64_t kv_heads, const std::vector<Segment>& segments);
at::Tensor unstack_groups(const at::Tensor& stacked, int64_t heads, const std::vector<Segment>& segments);
// Segment i's rows in the stacked layout.
at::Tensor rows_of(const at::Tensor& stacked, const Segment& s, int64_t groups);

// Whether tiles run through the fused kernel for queries on this device under this rule.
bool fused(const at::Tensor& q, const model::AttentionSpec& rule);

// A tile's normalised output [B, Hkv, G·lq, D] and its rows' log-sum-exp [.., 1].
struct Partial {
  at::Tensor out, lse;
};
Partial forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Tile& tile,
                const model::AttentionSpec& rule, bool use_fused);
// Merges a tile's result into the running one: L = log(e^L₁ + e^L₂),
// O = O₁·e^(L₁−L) + O₂·e^(L₂−L).
void merge(Partial& acc, const Partial& tile);

// A tile's gradients, added into dq [B, Hkv, G·lq, D], dk and dv [B, Hkv, lk, D];
// out and lse are the merged forward's rows, d_out their gradient, delta = rowsum(dO ∘ O).
struct Grads {
  at::Tensor dq, dk, dv;
};
void backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const at::Tensor& lse, const at::Tensor& d_out, const at::Tensor& delta, const Tile& tile,
              const model::AttentionSpec& rule, bool use_fused, Grads into);

}  // namespace meshtrain::parallel::tiles
