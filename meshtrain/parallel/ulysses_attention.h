// All-to-all ("Ulysses") attention: a sequence split across the ranks of a
// context-parallel group is regathered by heads (Note [All-to-all attention]).
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/parallel/ring_attention.h"

#include <ATen/ATen.h>

#include <memory>

namespace meshtrain::parallel {

// Note [All-to-all attention]
// DeepSpeed-Ulysses (Jacobs et al. 2023): before attention one all-to-all
// trades the sequence split for a head split — each of the cp ranks sends
// rank d its rows of heads [d·H/cp, (d+1)·H/cp) and receives every rank's
// rows of its own heads — so each rank holds the whole sequence for H/cp
// heads and attends as one process would; a second all-to-all trades back.
// Backward is the same two all-to-alls reversed. The rows arrive in rank
// order; the causal mask comes from their global positions (gathered once),
// so any split (zigzag or contiguous) works. Bytes per rank and layer: 4
// all-to-alls of (cp − 1)/cp of a [B, H, T/cp, D] activation (q, k, v out,
// o back; grouped-query k, v are smaller), against the ring's cp − 1 hops of
// k and v. Needs heads and key/value heads divisible by cp. Packed rows:
// the rows' document starts are gathered with the positions, and a query
// sees only the keys of its own document (Note [Ring attention]).

// q: [B, H, T, D]; k, v: [B, Hkv, T, D]; positions: [T] int64, the global
// position of each local row; documents (optional): [B, T] int64, each
// row's document start. Differentiable in q, k and v. Throws
// std::invalid_argument naming the formula when H or Hkv is not a multiple
// of cp.
at::Tensor all_to_all_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& positions, const std::shared_ptr<comm::Communicator>& comm,
                                const model::AttentionSpec& rule, const at::Tensor& documents = {});

// Hybrid context parallel: the all-to-all over `a2a` (a group of cp_a2a
// ranks) gathers that group's rows for heads / cp_a2a heads, then ring
// attention over `ring` (the cp / cp_a2a groups, one rank of each) runs on
// the gathered rows, and a second all-to-all trades back. Bytes per rank:
// the all-to-all's on 1/cp_a2a of the heads, the ring's (cp / cp_a2a − 1)
// hops of cp_a2a times the rows for heads / cp_a2a: the ring carries the
// same bytes per hop and makes cp_a2a times fewer hops.
at::Tensor hybrid_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                            const std::shared_ptr<comm::Communicator>& a2a,
                            const std::shared_ptr<comm::Communicator>& ring, const model::AttentionSpec& rule,
                            const at::Tensor& documents = {});

}  // namespace meshtrain::parallel
