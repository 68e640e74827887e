// DistTensor: a tensor whose global value is spread over a device mesh, as
// an ordinary at::Tensor that any libtorch code (a model, autograd, an
// optimizer) can use. See Note [Distributed tensors].
#pragma once

#include "meshtrain/mesh/device_mesh.h"
#include "meshtrain/placement/placement.h"

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain::annotate {

// Note [Distributed tensors]
// A distributed tensor is a TensorImpl without storage whose sizes are the
// global shape; it carries the PrivateUse1 dispatch key and, as its backend
// metadata, this rank's local tensor, the mesh and one placement per mesh
// axis (Replicate, Shard(dim), Partial: placement/placement.h). Its device is
// the local tensor's, so autograd and optimizers treat it as any tensor.
// Autograd runs above it on global values: a backward formula sees
// distributed tensors and its operators are distributed too, so gradients
// come out right whatever placements they end up in (the gradient of a
// Replicate parameter used on a batch split over dp is Partial over dp, and
// becomes Replicate, by an all-reduce, where the optimizer adds it).
// Every aten operator that has no CompositeImplicitAutograd decomposition
// is routed to one handler (rules.cpp): it takes each input's placements,
// asks the operator's sharding rule where the inputs must be and where the
// outputs will be, redistributes the inputs (the cheapest choice by bytes,
// the same on every rank), runs the operator on the local tensors and wraps
// the results. Output shapes come from running the operator on meta
// tensors of the global shapes. Plain tensors mixed in are Replicate. An
// operator with no rule is an error naming it. Splits need not divide
// evenly (balanced chunks, Note [Placements]); a view that would merge or cut
// uneven chunks gathers first. Global strides come from the operator on meta
// tensors (or, for a tensor made from a local piece, are row-major): never
// from a rank's piece, whose size-1 dims would make ranks disagree on
// contiguity and so on which operators a composite one calls.
struct DistState : c10::BackendMeta {
  at::Tensor local;
  std::shared_ptr<const mesh::DeviceMesh> mesh;
  std::vector<placement::Placement> placements;  // one per mesh axis, in mesh order
  // Outside autograd recording (a backward, an optimizer step) the local
  // pieces it was redistributed to are kept while its version stays, so a
  // second use of a partial gradient does not reduce it again.
  std::vector<std::pair<std::vector<placement::Placement>, at::Tensor>> redistributed;
  int64_t redistributed_version = -1;
};

bool is_dist(const at::Tensor& t);
DistState& dist_state(const at::Tensor& t);  // throws unless is_dist(t)

// A distributed tensor of global shape `shape` from this rank's local piece.
// Its strides are `strides`, or row-major: the same on every rank (a rank's
// local piece may have dims of size 1 or 0 whose strides say nothing, and
// code such as at::linear branches on contiguity).
at::Tensor from_local(at::Tensor local, std::shared_ptr<const mesh::DeviceMesh> mesh,
                      std::vector<placement::Placement> placements, std::vector<int64_t> shape,
                      std::vector<int64_t> strides = {});
// `global` (the same value on every rank) cut to `placements`.
at::Tensor distribute(const at::Tensor& global, std::shared_ptr<const mesh::DeviceMesh> mesh,
                      std::vector<placement::Placement> placements);
// The same global value in other placements; collective. With autograd:
// the gradient is put in the same placements, Partial read as Replicate.
at::Tensor redistribute(const at::Tensor& t, std::vector<placement::Placement> placements);
// This rank's piece of `t` (distributed, or plain: Replicate) in `want`:
// the redistribution an operator `op` needs, recorded in the sharding report.
at::Tensor local_as(const at::Tensor& t, const std::vector<placement::Placement>& want, const mesh::DeviceMesh& mesh,
                    const std::string& op);
// Whether local_as(t, ...) to a placement with `p` along `axis` is kept already.
bool has_redistributed(const at::Tensor& t, size_t axis, const placement::Placement& p);

// The global value on every rank (a plain tensor); collective.
at::Tensor full_tensor(const at::Tensor& t);
at::Tensor to_local(const at::Tensor& t);
placement::TensorSpec spec_of(const at::Tensor& t);  // global shape, every mesh axis, placements
// The spec of a tensor of global `shape` over every axis of `mesh` (Replicate where `placements` is empty).
placement::TensorSpec spec_on(const mesh::DeviceMesh& mesh, std::vector<int64_t> shape,
                              std::vector<placement::Placement> placements = {});

// One placement per axis of `mesh`: those named in `by_axis`, Replicate elsewhere.
std::vector<placement::Placement> placements_on(const mesh::DeviceMesh& mesh,
                                                const std::map<std::string, placement::Placement>& by_axis);

// Registers the handler for every eligible aten operator (done once, also by
// from_local); safe to call again.
void install();

}  // namespace meshtrain::annotate
