#include "meshtrain/parallel/parallel_state.h"

namespace meshtrain::parallel {

namespace {

// A parameter's placement over tp (or, for an expert, ep), and whether this rank saves it.
ParameterLayout parameter_layout(const Parallelized& p, const std::string& name, const at::Tensor& local) {
  ParameterLayout layout;
  layout.spec.shape = local.sizes().vec();
  layout.write = !(p.pipeline && p.pipeline->is_tied_copy(name));
  const bool first_of_tp = p.mesh->coordinate("tp") == 0;
  if (p.experts && model::is_expert_tensor(name)) {
    // Experts split over ep, whole on every tp rank (written by the first).
    layout.spec.axes = {"ep"};
    layout.spec.placements = {p.experts->placement_of(name)};
    layout.spec.shape[0] *= p.spec().dims.ep;
    layout.write = layout.write && (!p.tensor || first_of_tp);
    return layout;
  }
  layout.spec.axes = {"tp"};
  const placement::Placement placement = p.tensor ? p.tensor->placement_of(name) : placement::Placement::replicate();
  if (placement.is_shard()) layout.spec.shape[placement.dim] *= p.spec().dims.tp;
  layout.spec.placements = {placement};
  layout.write = layout.write && (placement.is_shard() || first_of_tp);
  return layout;
}

}  // namespace

placement::TrainingState training_state(Parallelized& parts) {
  placement::TrainingState state = parts.data_parallelism->state(
      [&parts](const std::string& name, const at::Tensor& local) { return parameter_layout(parts, name, local); });
  parts.random.add_state(state, parts.mesh->layout());
  return state;
}

placement::TrainingState frozen_state(Parallelized& parts) {
  return parts.data_parallelism->frozen_state(
      [&parts](const std::string& name, const at::Tensor& local) { return parameter_layout(parts, name, local); });
}

void after_load(Parallelized& parts, int64_t optimizer_steps, bool random_streams) {
  parts.data_parallelism->after_load(optimizer_steps);
  if (random_streams) parts.random.restore();
}

std::map<std::string, at::Tensor> full_parameters(Parallelized& parts, int root) {
  // Tensor parallel, experts and the pipeline gather next: every rank of them needs its part.
  const bool model_parallel = parts.tensor || parts.experts || parts.pipeline;
  std::map<std::string, at::Tensor> out = parts.data_parallelism->full_parameters(model_parallel ? -1 : root);
  if (parts.tensor) out = parts.tensor->gather_all(out);
  if (parts.experts) out = parts.experts->gather_all(out);
  if (parts.pipeline) out = parts.pipeline->gather_parameters(out);
  return out;
}

}  // namespace meshtrain::parallel
