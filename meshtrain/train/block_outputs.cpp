#include "meshtrain/train/block_outputs.h"

#include "meshtrain/model/call_sites.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>

namespace meshtrain::train {

at::Tensor BlockOutputs::around(const std::string& module, const at::Tensor& input, const Forward& forward) {
  at::Tensor y = forward(input);
  const int64_t i = model::block_call_site(module);
  if (i < 0 || i >= static_cast<int64_t>(step_.size()) || !at::GradMode::is_enabled()) return y;
  const at::Tensor values = y.detach();
  BlockOutput& b = step_[static_cast<size_t>(i)];
  b.count += static_cast<double>(values.numel());
  b.sum += values.sum(at::kDouble).item<double>();
  const double norm = at::linalg_vector_norm(values, 2, c10::nullopt, false, at::kDouble).item<double>();
  b.sum_squares += norm * norm;
  return y;
}

void BlockOutputs::clear() { std::fill(step_.begin(), step_.end(), BlockOutput{}); }

std::vector<BlockOutput> BlockOutputs::totals(const std::shared_ptr<comm::Communicator>& world) const {
  if (!world || world->size() == 1) return step_;
  at::Tensor sums = at::empty({static_cast<int64_t>(step_.size()), 3}, at::kDouble);
  auto a = sums.accessor<double, 2>();
  for (size_t i = 0; i < step_.size(); ++i) a[i][0] = step_[i].count, a[i][1] = step_[i].sum, a[i][2] = step_[i].sum_squares;
  world->all_reduce(sums, comm::ReduceOp::kSum).wait();
  std::vector<BlockOutput> all(step_.size());
  for (size_t i = 0; i < step_.size(); ++i) all[i] = {a[i][0], a[i][1], a[i][2]};
  return all;
}

std::shared_ptr<BlockOutputs> record_block_outputs(model::Gpt& model) {
  auto hooks = std::make_shared<BlockOutputs>(model->config().layers);
  model->add_forward_hooks(hooks);
  return hooks;
}

double block_output_difference(const BlockOutput& got, const BlockOutput& want) {
  if (want.count <= 0 || got.count <= 0) return got.count == want.count ? 0.0 : 1.0;
  const double rms_want = std::sqrt(want.sum_squares / want.count), rms_got = std::sqrt(got.sum_squares / got.count);
  const double scale = std::max(rms_want, 1e-30);
  const double mean_gap = std::abs(got.sum / got.count - want.sum / want.count) / scale;
  return std::max(std::abs(rms_got - rms_want) / scale, mean_gap);
}

}  // namespace meshtrain::train
