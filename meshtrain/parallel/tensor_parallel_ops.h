// Collectives of tensor and sequence parallelism as autograd functions:
// Megatron's conjugate pairs, whose forward and backward are each other's
// transpose. See Note [Tensor parallel collectives].
#pragma once

#include "meshtrain/comm/communicator.h"
#include "meshtrain/model/chunked_loss.h"

#include <ATen/ATen.h>

#include <memory>

namespace meshtrain::parallel {

using CommPtr = std::shared_ptr<comm::Communicator>;

// Note [Tensor parallel collectives]
// With t ranks in `comm` (the tp group):
//   copy_to_tensor_parallel      f  forward identity        backward all-reduce
//   reduce_from_tensor_parallel  g  forward all-reduce      backward identity
//   scatter_to_sequence             forward keep own chunk  backward all-gather
//   gather_from_sequence            forward all-gather      backward reduce-scatter
//   reduce_scatter_to_sequence      forward reduce-scatter  backward all-gather
// f enters a region where every rank computes a different part of the same
// output (column-parallel linears), g leaves one (row-parallel). With sequence
// parallelism the all-reduces become their halves: gather before the column
// linear, reduce-scatter after the row linear, so activations outside the
// linears are 1/t per rank. "Chunk" is along `dim`, whose size must divide by
// t; rank r holds chunk r.
at::Tensor copy_to_tensor_parallel(const at::Tensor& x, const CommPtr& comm);
at::Tensor reduce_from_tensor_parallel(const at::Tensor& x, const CommPtr& comm);
at::Tensor scatter_to_sequence(const at::Tensor& x, const CommPtr& comm, int64_t dim);
at::Tensor gather_from_sequence(const at::Tensor& x, const CommPtr& comm, int64_t dim);
at::Tensor reduce_scatter_to_sequence(const at::Tensor& x, const CommPtr& comm, int64_t dim);

// linear(gather_from_sequence(x), weight, bias) that saves only the local
// chunk x for backward and gathers it again there (Korthikanti et al. 2022,
// section 4.2.2): the full-sequence input is never kept. Backward overlaps
// the re-gather with the input-gradient matmul, and the reduce-scatter of the
// input gradient with the weight-gradient matmul. Under autocast it computes
// in the autocast dtype, as at::linear would.
at::Tensor sequence_gathered_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                    const CommPtr& comm, int64_t dim);

// Mean cross-entropy of fp32 logits [N, V/t] holding vocabulary entries
// [vocab_start, vocab_start + V/t) against targets [N] (full vocabulary ids),
// without gathering the logits: max, sum of exponentials and target logit are
// reduced over `comm` ([N] values each). Backward is local. `z_loss` > 0
// adds the z-loss, β·lse² per counted row (Note [Chunked loss]).
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_start,
                                        const CommPtr& comm, double z_loss = 0);

// A head split by the vocabulary for the chunked loss (Note [Chunked loss]):
// rows from `start` on this rank, the others' over `comm`.
model::VocabShard vocab_shard(int64_t start, const CommPtr& comm);

// Plain helpers (no autograd): chunks of every rank concatenated along `dim`,
// and the sum over ranks of `x` with this rank's chunk along `dim` kept.
at::Tensor all_gather_along(const at::Tensor& x, comm::Communicator& comm, int64_t dim);
at::Tensor reduce_scatter_along(const at::Tensor& x, comm::Communicator& comm, int64_t dim);

}  // namespace meshtrain::parallel
