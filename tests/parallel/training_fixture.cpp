// The one-process oracle, computed once: Note [One-process oracle].
#include "tests/parallel/training_fixture.h"

#include <torch/serialize.h>

#include <cstring>
#include <stdexcept>

namespace meshtrain::train {

namespace {

// A run as one pickled value: (per-step numbers, MoE numbers, parameters, validation loss).
std::vector<char> pack(const OneProcessRun& run) {
  c10::List<double> steps, moe;
  for (const StepResult& s : run.steps) {
    for (double value : {static_cast<double>(s.step), s.loss, s.grad_norm, s.skipped ? 1.0 : 0.0, s.lr,
                         static_cast<double>(s.moe.size())}) {
      steps.push_back(value);
    }
    for (const model::MoeLayerMetrics& m : s.moe) {
      for (double value : {static_cast<double>(m.block), m.aux_loss, m.z_loss, m.dropped, m.load_max_over_mean,
                           m.rank_load, m.this_rank_load}) {
        moe.push_back(value);
      }
    }
  }
  c10::Dict<std::string, at::Tensor> parameters;
  for (const auto& [name, value] : run.parameters) parameters.insert(name, value.cpu());
  return torch::pickle_save(c10::ivalue::Tuple::create({steps, moe, parameters, run.val_loss}));
}

OneProcessRun unpack(const std::vector<char>& bytes) {
  const auto tuple = torch::pickle_load(bytes).toTuple();
  const std::vector<double> steps = tuple->elements()[0].toDoubleVector();
  const std::vector<double> moe = tuple->elements()[1].toDoubleVector();
  OneProcessRun run;
  size_t m = 0;
  for (size_t i = 0; i + 6 <= steps.size(); i += 6) {
    StepResult s;
    s.step = static_cast<int64_t>(steps[i]);
    s.loss = steps[i + 1];
    s.grad_norm = steps[i + 2];
    s.skipped = steps[i + 3] != 0;
    s.lr = steps[i + 4];
    for (int64_t layer = 0; layer < static_cast<int64_t>(steps[i + 5]); ++layer, m += 7) {
      s.moe.push_back({static_cast<int64_t>(moe.at(m)), moe.at(m + 1), moe.at(m + 2), moe.at(m + 3), moe.at(m + 4),
                       moe.at(m + 5), moe.at(m + 6)});
    }
    run.steps.push_back(std::move(s));
  }
  for (const auto& item : tuple->elements()[2].toGenericDict()) {
    run.parameters.emplace(item.key().toStringRef(), item.value().toTensor());
  }
  run.val_loss = tuple->elements()[3].toDouble();
  return run;
}

}  // namespace

std::vector<double> OneProcessRun::losses() const {
  std::vector<double> out;
  for (const StepResult& s : steps) out.push_back(s.loss);
  return out;
}

OneProcessRun one_process(const TrainConfig& config, int steps, bool evaluate) {
  const auto& everyone = world();
  const std::shared_ptr<comm::Communicator> self = everyone->split(everyone->rank(), 0, "test:one-process");
  const int kTag = 7301;
  at::Tensor size = at::full({1}, -1, at::kLong);
  if (everyone->rank() != 0) {
    everyone->recv(size, 0, kTag).wait();
    if (size.item<int64_t>() < 0) throw std::runtime_error("the one-process run failed on rank 0 (its error is there)");
    at::Tensor bytes = at::empty({size.item<int64_t>()}, at::kByte);
    everyone->recv(bytes, 0, kTag).wait();
    const auto* data = static_cast<const char*>(bytes.data_ptr());
    return unpack(std::vector<char>(data, data + bytes.numel()));
  }
  OneProcessRun run;
  std::vector<char> packed;
  try {
    Trainer single(config, self);
    for (int s = 0; s < steps; ++s) run.steps.push_back(single.step());
    run.parameters = single.full_parameters();
    for (auto& [name, value] : run.parameters) value = value.cpu();
    if (evaluate) run.val_loss = single.evaluate();
    packed = pack(run);
  } catch (...) {
    for (int r = 1; r < everyone->size(); ++r) everyone->send(size, r, kTag).wait();
    throw;
  }
  size.fill_(static_cast<int64_t>(packed.size()));
  at::Tensor bytes = at::empty({static_cast<int64_t>(packed.size())}, at::kByte);
  std::memcpy(bytes.data_ptr(), packed.data(), packed.size());
  for (int r = 1; r < everyone->size(); ++r) {
    everyone->send(size, r, kTag).wait();
    everyone->send(bytes, r, kTag).wait();
  }
  return run;
}

}  // namespace meshtrain::train
