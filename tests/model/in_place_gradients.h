// Test helpers for the operators that add their gradients into a held .grad
// (Note [Weight gradients in place], Note [Embedding gradients in place]):
// a backward that counts the operators' profiler events, and a whole model's
// micro-batches into held gradients against the reference model.
#pragma once

#include "meshtrain/model/gpt.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <map>
#include <string>
#include <string_view>

namespace meshtrain::model::in_place_test {

inline at::Tensor seeded_normal(at::IntArrayRef sizes, uint64_t seed) {
  return at::randn(sizes, at::make_generator<at::CPUGeneratorImpl>(seed), at::kFloat);
}

inline std::atomic<int> counted{0};
inline std::string_view counted_event;

inline std::unique_ptr<at::ObserverContext> count_event(const at::RecordFunction& fn) {
  if (std::string_view(fn.name()) == counted_event) ++counted;
  return nullptr;
}

// Runs backward of a weighted sum of y; how many times the profiler event
// `event` (an operator's in-place path) ran in it.
inline int backward_counting(const at::Tensor& y, std::string_view event) {
  counted = 0;
  counted_event = event;
  const at::CallbackHandle counting = at::addGlobalCallback(at::RecordFunctionCallback(count_event));
  (y * seeded_normal(y.sizes(), 6)).sum().backward();
  at::removeCallback(counting);
  return counted;
}

// The model of `config` over two micro-batches into held zeroed gradients, as
// data parallel's buckets hold them, beside the same model with model.fused
// off (ATen's operators and AccumulateGrad): every gradient is the
// reference's and still the held tensor. Returns how many times `event` ran.
inline int micro_batches_into_held_gradients(const GptConfig& config, std::string_view event) {
  GptConfig reference_config = config;
  reference_config.fused = false;
  Gpt fused_model(config, 3), reference(reference_config, 3);
  std::map<std::string, const void*> held;
  for (Gpt* model : {&fused_model, &reference}) {
    for (auto& item : (*model)->named_parameters()) {
      item.value().mutable_grad() = at::zeros_like(item.value());
      if (model == &fused_model) held[item.key()] = item.value().grad().const_data_ptr();
    }
  }
  const int64_t t = config.context;
  const at::Tensor tokens =
      at::randint(config.vocab_size, {2, 3, t + 1}, at::make_generator<at::CPUGeneratorImpl>(4), at::kLong);
  int taken = 0;
  for (int64_t micro = 0; micro < 2; ++micro) {
    const at::Tensor input = tokens[micro].narrow(1, 0, t), targets = tokens[micro].narrow(1, 1, t);
    taken += backward_counting(fused_model->loss(input, targets), event);
    backward_counting(reference->loss(input, targets), event);
  }
  const auto fused_parameters = fused_model->named_parameters();
  for (const auto& item : reference->named_parameters()) {
    const at::Tensor& grad = fused_parameters[item.key()].grad();
    EXPECT_EQ(grad.const_data_ptr(), held[item.key()]) << item.key();
    EXPECT_TRUE(torch::allclose(grad, item.value().grad(), 1e-4, 1e-6)) << item.key();
  }
  return taken;
}

}  // namespace meshtrain::model::in_place_test
