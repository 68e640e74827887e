#include "meshtrain/parallel/activation_checkpoint.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <stdexcept>

namespace meshtrain::parallel {

namespace {

// Autograd keeps IValues only: the call to repeat travels in a capsule. The
// call owns its inputs beside the tensor, the micro-batch's Batch (Note [Batch]) included.
struct Recompute : torch::CustomClassHolder {
  model::ForwardHooks::Forward forward;
  std::vector<RandomStream> streams;
  std::vector<at::Tensor> random_states;  // default generator first, then `streams`
  bool autocast = false;
  at::ScalarType autocast_dtype = at::kBFloat16;
};

std::vector<at::Tensor> random_states(at::Device device, const std::vector<RandomStream>& streams) {
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::vector<at::Tensor> states;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    states.push_back(generator.get_state());
  }
  for (const RandomStream& s : streams) states.push_back(s.get());
  return states;
}

void set_random_states(at::Device device, const std::vector<RandomStream>& streams, const std::vector<at::Tensor>& states) {
  at::Generator generator = at::globalContext().defaultGenerator(device);
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(states[0]);
  }
  for (size_t i = 0; i < streams.size(); ++i) streams[i].set(states[i + 1]);
}

at::DeviceType autocast_device(const at::Tensor& t) { return t.is_cuda() ? at::kCUDA : at::kCPU; }

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            c10::intrusive_ptr<Recompute> recompute) {
    recompute->random_states = random_states(input.device(), recompute->streams);
    recompute->autocast = at::autocast::is_autocast_enabled(autocast_device(input));
    recompute->autocast_dtype = at::autocast::get_autocast_dtype(autocast_device(input));
    at::Tensor output = recompute->forward(input);  // grad mode is off here
    ctx->save_for_backward({input});
    ctx->saved_data["recompute"] = at::IValue::make_capsule(std::move(recompute));
    return output;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto recompute = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    const at::Tensor input = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    const at::Device device = input.device();
    const std::vector<at::Tensor> now = random_states(device, recompute->streams);
    set_random_states(device, recompute->streams, recompute->random_states);
    const at::DeviceType type = autocast_device(input);
    const bool was_autocast = at::autocast::is_autocast_enabled(type);
    const at::ScalarType was_dtype = at::autocast::get_autocast_dtype(type);
    at::Tensor output;
    {
      torch::AutoGradMode grad(true);
      at::autocast::set_autocast_enabled(type, recompute->autocast);
      at::autocast::set_autocast_dtype(type, recompute->autocast_dtype);
      output = recompute->forward(input);
      at::autocast::set_autocast_enabled(type, was_autocast);
      at::autocast::set_autocast_dtype(type, was_dtype);
      // Autocast caches its cast of each parameter, keyed by the parameter
      // alone: left in the cache, the copy made here would outlive the
      // optimizer's update and stand in for the new weights in the next
      // forward. Leaving the outermost autocast region empties the cache.
      if (recompute->autocast && !was_autocast) at::autocast::clear_cache();
    }
    set_random_states(device, recompute->streams, now);
    torch::autograd::backward({output}, {grads[0]});
    return {input.grad(), at::Tensor()};
  }
};

}  // namespace

CheckpointMode parse_checkpoint_mode(const std::string& name) {
  return config::parse_name(checkpoint_mode_names(), "parallel.activation_checkpoint", name);
}

at::Tensor checkpoint(const model::ForwardHooks::Forward& forward, const at::Tensor& input,
                      const std::vector<RandomStream>& streams) {
  // Nothing to recompute for: no gradient flows through this call.
  if (!torch::GradMode::is_enabled() || !input.requires_grad()) return forward(input);
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->forward = forward;
  recompute->streams = streams;
  return CheckpointFunction::apply(input, recompute);
}

ActivationCheckpoint::ActivationCheckpoint(int64_t blocks, const std::function<CheckpointMode(int64_t)>& mode,
                                           std::vector<RandomStream> streams)
    : streams_(std::move(streams)) {
  for (int64_t i = 0; i < blocks; ++i) {
    const std::string block = "blocks." + std::to_string(i);
    switch (mode(i)) {
      case CheckpointMode::kNone: break;
      case CheckpointMode::kFull: names_.push_back(block); break;
      case CheckpointMode::kSelective: names_.push_back(block + ".attn.core"); break;
    }
  }
  std::sort(names_.begin(), names_.end());
}

at::Tensor ActivationCheckpoint::around(const std::string& module, const at::Tensor& input, const Forward& forward) {
  if (!std::binary_search(names_.begin(), names_.end(), module)) return forward(input);
  return checkpoint(forward, input, streams_);
}

std::shared_ptr<ActivationCheckpoint> apply_activation_checkpoint(model::Gpt& model, CheckpointMode mode, int64_t every,
                                                                  std::vector<RandomStream> streams) {
  if (every < 1) throw std::invalid_argument("activation checkpoint: every must be >= 1, not " + std::to_string(every));
  auto hooks = std::make_shared<ActivationCheckpoint>(
      model->config().layers, [&](int64_t block) { return block % every == 0 ? mode : CheckpointMode::kNone; },
      std::move(streams));
  model->add_forward_hooks(hooks);
  // Selective recompute also makes the GLU's output again (Note [The GLU's output made again]).
  if (mode == CheckpointMode::kSelective) {
    for (int64_t block = 0; block < model->config().layers; block += every) model->make_glu_output_again(block, true);
  }
  return hooks;
}

}  // namespace meshtrain::parallel
