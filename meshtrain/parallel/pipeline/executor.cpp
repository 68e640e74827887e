#include "meshtrain/parallel/pipeline/executor.h"

#include <chrono>
#include <map>
#include <stdexcept>

namespace meshtrain::parallel::pipeline {

namespace {

constexpr int kActivationTag = 0, kGradientTag = 1;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Received {
  at::Tensor tensor;
  comm::Work work;
};

struct Stashed {
  at::Tensor input;   // a leaf (undefined on stage 0)
  at::Tensor output;  // the loss on the last stage
};

}  // namespace

PipelineExecutor::PipelineExecutor(std::shared_ptr<comm::Communicator> comm) : comm_(std::move(comm)) {}

double PipelineExecutor::run(const Schedule& schedule, const StageCallbacks& callbacks,
                             std::vector<int64_t> activation_shape, at::ScalarType dtype) {
  const int rank = comm_->rank(), last = schedule.stages() - 1;
  if (schedule.ranks != comm_->size()) {
    throw std::invalid_argument("pipeline executor: schedule '" + schedule.name + "' is for " +
                                std::to_string(schedule.ranks) + " ranks, the pipeline group has " +
                                std::to_string(comm_->size()));
  }
  spans_.clear();
  peak_stashed_ = 0;
  using Key = std::pair<int, int>;  // (stage, micro-batch)
  std::map<Key, Received> inputs, output_grads;
  std::map<Key, Stashed> stash;
  std::map<Key, at::Tensor> forward_only_outputs;  // waiting to be sent
  std::vector<Received> sends;
  double loss = 0;
  const at::TensorOptions options = at::TensorOptions().dtype(dtype).device(comm_->device());

  auto check = [&](const at::Tensor& t, int stage, int mb, const char* what) {
    if (t.sizes() != at::IntArrayRef(activation_shape) || t.scalar_type() != dtype) {
      throw std::runtime_error("pipeline stage " + std::to_string(stage) + ", micro-batch " + std::to_string(mb) + ": " +
                               what + " has shape " + c10::str(t.sizes()) + " and dtype " +
                               std::string(c10::toString(t.scalar_type())) + ", the pipeline carries " +
                               c10::str(at::IntArrayRef(activation_shape)) + " " + c10::toString(dtype));
    }
  };
  auto wait = [&](Received& r, const Action& a) {
    const double start = now();
    r.work.wait();
    spans_.push_back({SpanKind::kRecv, a.stage, a.microbatch, start, now()});
    return r.tensor;
  };
  auto send = [&](const at::Tensor& t, int peer, int tag, const Action& a) {
    const double start = now();
    at::Tensor data = t.contiguous();
    sends.push_back({data, comm_->send(data, peer, tag)});
    spans_.push_back({SpanKind::kSend, a.stage, a.microbatch, start, now()});
  };

  const std::vector<Action>& actions = schedule.actions.at(rank);
  int backwards_left = 0;
  for (const Action& a : actions) backwards_left += a.kind == ActionKind::kBackward;
  for (const Action& a : actions) {
    const Key key{a.stage, a.microbatch};
    switch (a.kind) {
      case ActionKind::kRecvActivation:
      case ActionKind::kRecvGradient: {
        const bool grad = a.kind == ActionKind::kRecvGradient;
        at::Tensor buffer = at::empty(activation_shape, options);
        const int peer = schedule.rank_of(grad ? a.stage + 1 : a.stage - 1);
        (grad ? output_grads : inputs)[key] = {buffer, comm_->recv(buffer, peer, grad ? kGradientTag : kActivationTag)};
        break;
      }
      case ActionKind::kForward: {
        at::Tensor input;
        if (a.stage > 0) {
          auto it = inputs.find(key);
          if (it == inputs.end()) throw std::logic_error("pipeline executor: " + a.str() + " without its receive");
          input = wait(it->second, a);
          inputs.erase(it);
          if (schedule.backward) input.requires_grad_(true);
        }
        const double start = now();
        at::Tensor output = callbacks.forward(a.stage, a.microbatch, input);
        spans_.push_back({SpanKind::kForward, a.stage, a.microbatch, start, now()});
        if (a.stage == last) {
          loss += output.detach().item<double>();
        } else {
          check(output, a.stage, a.microbatch, "the output");
        }
        if (schedule.backward) {
          stash[key] = {input, output};
          peak_stashed_ = std::max(peak_stashed_, static_cast<int>(stash.size()));
        } else if (a.stage < last) {
          forward_only_outputs[key] = output;
        }
        break;
      }
      case ActionKind::kSendActivation: {
        at::Tensor output;
        if (schedule.backward) {
          output = stash.at(key).output.detach();
        } else {
          output = forward_only_outputs.at(key);
          forward_only_outputs.erase(key);
        }
        send(output, schedule.rank_of(a.stage + 1), kActivationTag, a);
        break;
      }
      case ActionKind::kBackward: {
        auto it = stash.find(key);
        if (it == stash.end()) throw std::logic_error("pipeline executor: " + a.str() + " before its forward");
        at::Tensor grad;
        if (a.stage < last) {
          auto g = output_grads.find(key);
          if (g == output_grads.end()) throw std::logic_error("pipeline executor: " + a.str() + " without its receive");
          grad = wait(g->second, a);
          output_grads.erase(g);
        }
        if (callbacks.before_backward) callbacks.before_backward(--backwards_left == 0);
        const double start = now();
        if (grad.defined()) it->second.output.backward(grad);
        else it->second.output.backward();
        if (callbacks.after_backward) callbacks.after_backward();
        spans_.push_back({SpanKind::kBackward, a.stage, a.microbatch, start, now()});
        // The input's gradient waits in the stash for its send; the graph is gone.
        it->second.output = at::Tensor();
        if (a.stage == 0) stash.erase(it);
        break;
      }
      case ActionKind::kSendGradient: {
        auto it = stash.find(key);
        const at::Tensor grad = it->second.input.grad();
        if (!grad.defined()) {
          throw std::runtime_error("pipeline stage " + std::to_string(a.stage) + ", micro-batch " +
                                   std::to_string(a.microbatch) + ": backward left no gradient for the stage's input");
        }
        check(grad, a.stage, a.microbatch, "the input gradient");
        send(grad, schedule.rank_of(a.stage - 1), kGradientTag, a);
        stash.erase(it);
        break;
      }
    }
  }
  // Sends still in flight: the step is not over until they are delivered.
  const double start = now();
  for (Received& s : sends) s.work.wait();
  spans_.push_back({SpanKind::kIdle, -1, -1, start, now()});
  return loss;
}

}  // namespace meshtrain::parallel::pipeline
