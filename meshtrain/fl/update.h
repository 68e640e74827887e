// A client's whole update: local training over the round's structure, the
// encoding of every parameter tensor (codec.h), and the server's decoding
// back to one ΔW per parameter.
#pragma once

#include "meshtrain/fl/codec.h"
#include "meshtrain/fl/federation.pb.h"
#include "meshtrain/model/gpt.h"
#include "meshtrain/parallel/step_engine.h"
#include "meshtrain/train/data.h"

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

namespace meshtrain::fl {

// The round's structures, one per parameter (shapes in model order), all
// drawn from the round's seed: every client and the server build the same.
std::vector<Structure> round_structures(const CompressionSpec& spec, const std::vector<std::vector<int64_t>>& shapes,
                                        uint64_t round_seed);
// The sketch seed of parameter `index`: per client (independent sketches
// average out), or shared by all (secure aggregation sums sketched values).
uint64_t sketch_seed(uint64_t round_seed, uint32_t index, const std::string& client_id, bool shared);

struct LocalFit {
  std::vector<at::Tensor> payloads;  // per parameter, the trained vector (Note [Update encoding])
  double mean_loss = 0;
};
// Trains the engine's model from its current weights (the round's global
// model) for fit.local_steps() steps of fit.batch() sequences, sequence
// positions fit.data_offset() + k·batch of `sampler`: each step's forward and
// backward through the step engine (a client's is one rank, Note [Self
// communicator]), then each parameter's payload optimised (SGD or the one
// AdamW without decay, fresh each round) with FedProx's μ/2·‖w - w_global‖²
// when prox_mu > 0. Leaves the trained weights in the model.
LocalFit fit_locally(parallel::StepEngine& engine, train::Sampler& sampler, const wire::FitConfig& fit,
                     const std::vector<Structure>& structures);
// The step engine a client trains with: `model` on a one-rank world, no parallelism.
std::unique_ptr<parallel::StepEngine> client_engine(model::Gpt model);

std::vector<wire::EncodedTensor> encode_update(const std::vector<at::Tensor>& payloads, const CompressionSpec& spec,
                                               uint64_t round_seed, const std::string& client_id, bool shared_seeds,
                                               at::Generator& rng);
// ΔW per parameter. Throws std::runtime_error naming the problem when the
// message does not match the round (count, indices, lengths, seeds, bytes).
std::vector<at::Tensor> decode_update(const std::vector<wire::EncodedTensor>& update, const CompressionSpec& spec,
                                      const std::vector<Structure>& structures, uint64_t round_seed,
                                      const std::string& client_id, bool shared_seeds);

// Secure aggregation works on one vector: the sketched values (before any
// quantisation) of every parameter, concatenated, and back.
std::vector<float> concat_sketched(const std::vector<at::Tensor>& payloads, const CompressionSpec& spec,
                                   uint64_t round_seed);
std::vector<at::Tensor> split_sketched(const std::vector<float>& values, const CompressionSpec& spec,
                                       const std::vector<Structure>& structures, uint64_t round_seed);

// Parameters in model order, names, and dense tensors on the wire.
std::vector<at::Tensor> parameters_of(model::GptImpl& model);
std::vector<std::string> parameter_names(model::GptImpl& model);
wire::Tensor to_wire(const std::string& name, const at::Tensor& t);
at::Tensor from_wire(const wire::Tensor& t);  // throws on a size mismatch

}  // namespace meshtrain::fl
