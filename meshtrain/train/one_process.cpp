#include "meshtrain/train/one_process.h"

#include <torch/serialize.h>

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

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
                       moe.at(m + 5), moe.at(m + 6), 1, {}});
    }
    run.steps.push_back(std::move(s));
  }
  for (const auto& item : tuple->elements()[2].toGenericDict()) {
    run.parameters.emplace(item.key().toStringRef(), item.value().toTensor());
  }
  run.val_loss = tuple->elements()[3].toDouble();
  return run;
}

// fp32 CPU copies.
std::map<std::string, at::Tensor> cpu(std::map<std::string, at::Tensor> parameters) {
  for (auto& [name, value] : parameters) value = value.to(at::kFloat).cpu();
  return parameters;
}

}  // namespace

void wait_polling(const comm::Work& work) {
  while (!work.completed()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  work.wait();
}

std::vector<double> OneProcessRun::losses() const {
  std::vector<double> out;
  for (const StepResult& s : steps) out.push_back(s.loss);
  return out;
}

OneProcessRun one_process(const std::shared_ptr<comm::Communicator>& everyone, const TrainConfig& config,
                          const OneProcessOptions& options) {
  const std::shared_ptr<comm::Communicator> self = everyone->split(everyone->rank(), 0, "one-process");
  const int kTag = 7301;
  at::Tensor size = at::full({1}, -1, at::kLong);
  if (everyone->rank() != 0) {
    wait_polling(everyone->recv(size, 0, kTag));
    if (size.item<int64_t>() < 0) throw std::runtime_error("the one-process run failed on rank 0 (its error is there)");
    if (!options.send_to_every_rank) return OneProcessRun{};
    at::Tensor bytes = at::empty({size.item<int64_t>()}, at::kByte);
    everyone->recv(bytes, 0, kTag).wait();
    const auto* data = static_cast<const char*>(bytes.data_ptr());
    return unpack(std::vector<char>(data, data + bytes.numel()));
  }
  OneProcessRun run;
  std::vector<char> packed;
  try {
    Trainer single(config, self);
    const std::shared_ptr<BlockOutputs> outputs = options.block_outputs ? record_block_outputs(single.model()) : nullptr;
    for (int s = 0; s < options.steps; ++s) {
      if (outputs) outputs->clear();
      run.steps.push_back(single.step());
      if (options.each_step) run.each_step.push_back(cpu(single.full_parameters()));
      if (outputs) run.block_outputs.push_back(outputs->totals());
    }
    run.parameters = options.each_step && !run.each_step.empty() ? run.each_step.back() : cpu(single.full_parameters());
    if (options.evaluate) run.val_loss = single.evaluate();
    if (options.send_to_every_rank) packed = pack(run);
  } catch (...) {
    for (int r = 1; r < everyone->size(); ++r) everyone->send(size, r, kTag).wait();
    throw;
  }
  size.fill_(static_cast<int64_t>(packed.size()));
  at::Tensor bytes = at::empty({static_cast<int64_t>(packed.size())}, at::kByte);
  if (!packed.empty()) std::memcpy(bytes.data_ptr(), packed.data(), packed.size());
  for (int r = 1; r < everyone->size(); ++r) {
    everyone->send(size, r, kTag).wait();
    if (options.send_to_every_rank) everyone->send(bytes, r, kTag).wait();
  }
  return run;
}

}  // namespace meshtrain::train
