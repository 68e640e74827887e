#include "meshtrain/parallel/annotated_tensor_parallel.h"

#include "meshtrain/annotate/gpt_annotations.h"
#include "meshtrain/placement/redistribute.h"

#include <torch/csrc/autograd/autograd.h>

namespace meshtrain::parallel {

namespace {

// The module holding `name` ("blocks.0.attn.qkv.weight") in a tree of empty
// modules under `root`, made as needed; returns it and the last segment.
std::pair<torch::nn::Module*, std::string> holder(torch::nn::Module& root, const std::string& name) {
  torch::nn::Module* at = &root;
  size_t begin = 0;
  for (size_t dot = name.find('.'); dot != std::string::npos; begin = dot + 1, dot = name.find('.', begin)) {
    const std::string part = name.substr(begin, dot - begin);
    auto children = at->named_children();
    auto* found = children.find(part);
    at = found ? found->get() : at->register_module(part, std::make_shared<torch::nn::Module>()).get();
  }
  return {at, name.substr(begin)};
}

}  // namespace

AnnotatedTensorParallel::AnnotatedTensorParallel(model::Gpt model, std::shared_ptr<const mesh::DeviceMesh> mesh)
    : model_(std::move(model)), mesh_(std::move(mesh)), local_(std::make_shared<torch::nn::Module>()) {
  annotate::annotate_module(*model_, mesh_, annotate::gpt_megatron_annotations(model_->config(), *mesh_));
  for (auto& item : model_->named_parameters()) {
    parameters_[item.key()] = item.value();
    at::Tensor piece = annotate::to_local(item.value());
    piece.requires_grad_(true);
    auto [module, leaf] = holder(*local_, item.key());
    module->register_parameter(leaf, piece);
  }
}

void AnnotatedTensorParallel::after_backward() {
  annotate::settle_gradients(*model_);
  std::vector<at::Tensor> pieces, grads;
  for (auto& item : model_->named_parameters()) {
    at::Tensor& grad = item.value().mutable_grad();
    if (!grad.defined()) continue;
    pieces.push_back(annotate::to_local(item.value()));
    grads.push_back(annotate::to_local(grad).contiguous());
    grad = at::Tensor();
  }
  if (!pieces.empty()) torch::autograd::backward(pieces, grads);
}

placement::Placement AnnotatedTensorParallel::placement_of(const std::string& name) const {
  const annotate::DistState& s = annotate::dist_state(parameters_.at(name));
  return s.placements[mesh_->layout().axis_index("tp")];
}

bool AnnotatedTensorParallel::is_split(const std::string& name) const {
  return placement_of(name).is_shard() && mesh_->layout().axis_size("tp") > 1;
}

std::map<std::string, at::Tensor> AnnotatedTensorParallel::gather_all(const std::map<std::string, at::Tensor>& local) const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, piece] : local) {
    const at::Tensor& p = parameters_.at(name);
    const placement::TensorSpec spec = annotate::spec_of(p);
    out[name] = placement::redistribute_data(piece.to(annotate::to_local(p).device()), *mesh_, spec,
                                             annotate::replicated(*mesh_));
  }
  return out;
}

std::string AnnotatedTensorParallel::describe() const {
  return "tensor parallel tp(" + std::to_string(comm()->size()) + ") from sharding annotations";
}

}  // namespace meshtrain::parallel
