#include "meshtrain/model/generate.h"

#include <ATen/CPUGeneratorImpl.h>

#include <stdexcept>

namespace meshtrain::model {

at::Tensor generate(Gpt& model, const at::Tensor& prompt, const SampleOptions& options) {
  if (!(options.temperature > 0)) throw std::invalid_argument("temperature must be > 0");
  if (options.top_k < 0) throw std::invalid_argument("top_k must be >= 0");
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(options.seed);
  const int64_t context = model->config().context;
  at::Tensor sequence = prompt.numel() ? prompt.to(at::kLong).view({1, -1}) : at::zeros({1, 1}, at::kLong);
  const int64_t start = prompt.numel() ? sequence.size(1) : 1;
  for (int64_t i = 0; i < options.tokens; ++i) {
    const int64_t t = std::min(context, sequence.size(1));
    at::Tensor logits = model->forward(sequence.narrow(1, sequence.size(1) - t, t)).select(1, t - 1) / options.temperature;
    if (options.top_k > 0 && options.top_k < logits.size(-1)) {
      const at::Tensor kth = std::get<0>(logits.topk(options.top_k, -1)).narrow(-1, options.top_k - 1, 1);
      logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
    }
    const at::Tensor next = at::multinomial(at::softmax(logits.to(at::kFloat), -1), 1, false, generator);
    sequence = at::cat({sequence, next}, 1);
  }
  model->train(was_training);
  return sequence.narrow(1, start, sequence.size(1) - start).view({-1});
}

}  // namespace meshtrain::model
