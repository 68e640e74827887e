// Ring attention: attention over a sequence whose rows are split across the
// ranks of a context-parallel group (Note [Ring attention]).
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/model/attention.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace meshtrain::parallel {

// Note [Ring attention]
// Each of the cp ranks holds some rows of the sequence: its queries, keys and
// values, and the global position of each row. The key/value blocks travel
// around the ring (rank r sends to r + 1, receives from r − 1); at step s a
// rank attends its queries to the block that started on rank r − s, while
// the next block is already in flight (send/recv posted before the block's
// product, waited after it). The partial results merge by their log-sum-exp:
//   L = log(e^L₁ + e^L₂),  O = O₁·e^(L₁−L) + O₂·e^(L₂−L),
// so after cp steps every query has seen every key it may (causal: key
// position ≤ query position) and O is exactly softmax(QKᵀ·scale)·V.
// Backward replays the ring: with D = rowsum(dO ∘ O) and P recomputed from
// the saved L, each block gives dQ += dS·K·scale locally and dK += dSᵀ·Q·scale,
// dV += Pᵀ·dO, which travel on with their block and reach its owner after cp
// steps (dS = P ∘ (dO·Vᵀ − D)).
// Products are computed per pair of position runs (a rank's rows are one
// run under the contiguous split, two under the zigzag one, each cut into
// tiles of at most 512 rows): a pair whose every key follows every query is
// skipped, one whose every key precedes every query needs no mask, so
// causal attention costs about half of full, and a product's work space is
// a few 512 x 512 score tiles per head however long the sequence. On the
// CPU a tile runs through ATen's fused flash kernel, whose backward takes
// the merged output and log-sum-exp (Note [Attention tiles]).
// Causal load balance (the zigzag split): with the sequence cut into 2·cp
// equal chunks, rank i holds chunks i and 2·cp − 1 − i, so every rank has
// the same number of (query, key) pairs to compute; a contiguous split gives
// the last rank 2·cp − 1 times the first one's (attention_pairs counts both).
// Grouped-query attention: the queries of one key/value head's group are
// stacked as rows, so blocks travel with the key/value heads only, and no
// tile copies k or v per query head.
// A sliding window and soft-capped scores (model::AttentionSpec) change which pairs
// are kept and the scores' function, not the ring: the window hides more
// pairs (whole ones skipped the same way), the cap's derivative 1 − tanh²
// joins dS in backward.
// Packed rows (documents side by side, Note [Batch]): each row
// carries its document's start, the global position where the document
// begins, and travels with it; a query sees only the keys of its own
// document (equal starts), and a tile whose rows share no document is
// skipped like one the causal mask hides.
// Arithmetic is in float32 whatever the inputs' dtype; the result has q's.

// q: [B, H, T, D]; k, v: [B, Hkv, T, D] (H a multiple of Hkv); positions: [T]
// int64, the global position of each local row (the same for q and k, v);
// documents (optional): [B, T] int64, each row's document start. Differentiable
// in q, k and v. Every rank of `comm` must call it with the same B, H, Hkv,
// D, T and rule, and all with documents or none.
// The spec's scale must be resolved (AttentionSpec::scale_for); dropout is not applied.
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                          const std::shared_ptr<comm::Communicator>& comm, const model::AttentionSpec& rule,
                          const at::Tensor& documents = {});

// The global positions rank `rank` of `cp` holds under the zigzag split of a
// sequence of `length`: chunks rank and 2·cp − 1 − rank of 2·cp. Throws
// std::invalid_argument unless length is a multiple of 2·cp.
at::Tensor zigzag_positions(int64_t length, int64_t cp, int64_t rank);
// The contiguous split: rows [rank·length/cp, (rank + 1)·length/cp).
at::Tensor contiguous_positions(int64_t length, int64_t cp, int64_t rank);

// What the ring attention calls on one thread did, for benchmarks: the
// (query, key) scores computed over all heads and batch rows, the seconds in
// block products (forward and backward), the seconds waiting for a key/value
// hop that was in flight during a product, and those hops' count.
struct RingProfile {
  int64_t scores = 0;
  double compute_s = 0, wait_s = 0;
  int64_t overlapped_hops = 0;
};
// While alive, ring_attention on this thread (forward and backward) adds to `profile`.
class RingProfileScope {
 public:
  explicit RingProfileScope(RingProfile& profile);
  ~RingProfileScope();
  RingProfileScope(const RingProfileScope&) = delete;
  RingProfileScope& operator=(const RingProfileScope&) = delete;

 private:
  RingProfile* previous_;
};

// The (query, key) pairs a rank computes for its rows `positions` in a
// sequence of `length` (causal: key ≤ query): its share of the attention FLOPs.
int64_t attention_pairs(const at::Tensor& positions, int64_t length, bool causal);

}  // namespace meshtrain::parallel
