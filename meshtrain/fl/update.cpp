#include "meshtrain/fl/update.h"

#include "meshtrain/comm/backend/self/self_communicator.h"
#include "meshtrain/offload/cpu_adam.h"

#include <cstring>
#include <functional>
#include <stdexcept>

namespace meshtrain::fl {
namespace {

constexpr uint64_t kStructureSeeds = 0x5354, kSketchSeeds = 0x534b;

uint64_t client_hash(const std::string& id) { return fnv1a(id); }

}  // namespace

std::vector<Structure> round_structures(const CompressionSpec& spec, const std::vector<std::vector<int64_t>>& shapes,
                                        uint64_t round_seed) {
  std::vector<Structure> out;
  for (size_t i = 0; i < shapes.size(); ++i)
    out.emplace_back(spec, shapes[i], mix_seed(mix_seed(round_seed, kStructureSeeds), i));
  return out;
}

uint64_t sketch_seed(uint64_t round_seed, uint32_t index, const std::string& client_id, bool shared) {
  const uint64_t base = mix_seed(mix_seed(round_seed, kSketchSeeds), index);
  return shared ? base : mix_seed(base, client_hash(client_id));
}

std::unique_ptr<parallel::StepEngine> client_engine(model::Gpt model) {
  return std::make_unique<parallel::StepEngine>(
      parallel::parallelize(std::move(model), comm::SelfCommunicator::create("client"), parallel::ParallelizeOptions{}));
}

LocalFit fit_locally(parallel::StepEngine& engine, train::Sampler& sampler, const wire::FitConfig& fit,
                     const std::vector<Structure>& structures) {
  model::GptImpl& model = *engine.parts().model;
  std::vector<at::Tensor> params = parameters_of(model);
  std::vector<at::Tensor> start, payloads, m, v;
  for (size_t i = 0; i < params.size(); ++i) {
    start.push_back(params[i].detach().clone());
    payloads.push_back(at::zeros({structures[i].payload_size()}, at::kFloat));
    if (fit.optimizer() == "adamw") {
      m.push_back(at::zeros_like(payloads.back()));
      v.push_back(at::zeros_like(payloads.back()));
    }
  }
  const double lr = fit.lr(), mu = fit.prox_mu();
  // The project's one AdamW (Note [CPU AdamW]) over the payload's coordinates, fresh each round, without weight
  // decay, with the clients' betas (0.9, 0.999: torch.optim.AdamW's defaults, which federated clients start from).
  offload::AdamWStep adamw;
  adamw.lr = lr;
  adamw.beta1 = 0.9;
  adamw.beta2 = 0.999;
  adamw.eps = 1e-8;
  double loss_sum = 0;
  model.train();
  for (uint32_t k = 0; k < fit.local_steps(); ++k) {
    auto [inputs, targets] = sampler.rows(static_cast<int64_t>(fit.data_offset()) + int64_t{k} * fit.batch(), fit.batch());
    engine.zero_grad();
    loss_sum += engine.forward_backward({model::Batch(inputs, targets)});
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor grad = params[i].grad().defined() ? params[i].grad() : at::zeros_like(params[i]);
      if (mu > 0) grad = grad + (params[i] - start[i]) * mu;  // FedProx
      at::Tensor g = structures[i].project(grad);
      if (fit.optimizer() == "adamw") {
        adamw.step = k + 1;
        offload::cpu_adamw(payloads[i], g.to(at::kFloat).contiguous(), m[i], v[i], adamw);
      } else {
        payloads[i].add_(g, -lr);
      }
      params[i].copy_(start[i] + structures[i].expand(payloads[i]));
    }
  }
  return LocalFit{payloads, fit.local_steps() > 0 ? loss_sum / fit.local_steps() : 0.0};
}

std::vector<wire::EncodedTensor> encode_update(const std::vector<at::Tensor>& payloads, const CompressionSpec& spec,
                                               uint64_t round_seed, const std::string& client_id, bool shared_seeds,
                                               at::Generator& rng) {
  std::vector<wire::EncodedTensor> out;
  for (size_t i = 0; i < payloads.size(); ++i) {
    const auto index = static_cast<uint32_t>(i);
    out.push_back(encode(payloads[i], spec, sketch_seed(round_seed, index, client_id, shared_seeds), index, rng));
  }
  return out;
}

std::vector<at::Tensor> decode_update(const std::vector<wire::EncodedTensor>& update, const CompressionSpec& spec,
                                      const std::vector<Structure>& structures, uint64_t round_seed,
                                      const std::string& client_id, bool shared_seeds) {
  if (update.size() != structures.size())
    throw std::runtime_error("update of " + std::to_string(update.size()) + " tensors, the model has " +
                             std::to_string(structures.size()));
  std::vector<at::Tensor> deltas(structures.size());
  for (const auto& e : update) {
    const uint32_t i = e.index();
    if (i >= structures.size() || deltas[i].defined())
      throw std::runtime_error("update tensor index " + std::to_string(i) + " out of range or repeated");
    if (e.seed() != sketch_seed(round_seed, i, client_id, shared_seeds))
      throw std::runtime_error("update tensor " + std::to_string(i) + ": sketch seed is not the round's");
    deltas[i] = structures[i].expand(decode(e, spec, structures[i].payload_size()));
  }
  return deltas;
}

std::vector<float> concat_sketched(const std::vector<at::Tensor>& payloads, const CompressionSpec& spec,
                                   uint64_t round_seed) {
  std::vector<float> out;
  for (size_t i = 0; i < payloads.size(); ++i) {
    const at::Tensor v = sketch_values(payloads[i], spec, sketch_seed(round_seed, static_cast<uint32_t>(i), "", true));
    out.insert(out.end(), v.data_ptr<float>(), v.data_ptr<float>() + v.numel());
  }
  return out;
}

std::vector<at::Tensor> split_sketched(const std::vector<float>& values, const CompressionSpec& spec,
                                       const std::vector<Structure>& structures, uint64_t round_seed) {
  std::vector<at::Tensor> out;
  size_t at_value = 0;
  for (size_t i = 0; i < structures.size(); ++i) {
    const uint64_t seed = sketch_seed(round_seed, static_cast<uint32_t>(i), "", true);
    const int64_t n = kept_entries(spec, seed, structures[i].payload_size());
    if (at_value + static_cast<size_t>(n) > values.size()) throw std::runtime_error("aggregated vector too short");
    at::Tensor v = at::from_blob(const_cast<float*>(values.data() + at_value), {n}, at::kFloat).clone();
    at_value += static_cast<size_t>(n);
    out.push_back(structures[i].expand(unsketch_values(v, spec, seed, structures[i].payload_size())));
  }
  if (at_value != values.size()) throw std::runtime_error("aggregated vector too long");
  return out;
}

std::vector<at::Tensor> parameters_of(model::GptImpl& model) {
  std::vector<at::Tensor> out;
  for (auto& p : model.parameters()) out.push_back(p);
  return out;
}

std::vector<std::string> parameter_names(model::GptImpl& model) {
  std::vector<std::string> out;
  for (auto& item : model.named_parameters()) out.push_back(item.key());
  return out;
}

wire::Tensor to_wire(const std::string& name, const at::Tensor& t) {
  wire::Tensor w;
  w.set_name(name);
  for (int64_t s : t.sizes()) w.add_shape(s);
  const at::Tensor c = t.detach().to(at::kFloat).contiguous();
  w.set_data(c.data_ptr(), static_cast<size_t>(c.numel()) * sizeof(float));
  return w;
}

at::Tensor from_wire(const wire::Tensor& w) {
  std::vector<int64_t> shape(w.shape().begin(), w.shape().end());
  int64_t numel = 1;
  for (int64_t s : shape) {
    if (s < 0) throw std::runtime_error("tensor '" + w.name() + "': negative dimension");
    numel *= s;
  }
  if (static_cast<int64_t>(w.data().size()) != numel * 4)
    throw std::runtime_error("tensor '" + w.name() + "': " + std::to_string(w.data().size()) + " bytes for " +
                             std::to_string(numel) + " float32 values");
  at::Tensor t = at::empty(shape, at::kFloat);
  std::memcpy(t.data_ptr(), w.data().data(), w.data().size());
  return t;
}

}  // namespace meshtrain::fl
