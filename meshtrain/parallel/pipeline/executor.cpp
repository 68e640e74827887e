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

// One step of one rank (Note [Pipeline executor]): what is received,
// stashed and sent, action by action.
class StepRun {
 public:
  StepRun(const Schedule& schedule, const StageCallbacks& callbacks, std::vector<int64_t> activation_shape,
          at::ScalarType dtype, comm::Communicator& comm, std::vector<Span>& spans, int& peak_stashed)
      : schedule_(schedule),
        callbacks_(callbacks),
        shape_(std::move(activation_shape)),
        dtype_(dtype),
        comm_(comm),
        spans_(spans),
        peak_stashed_(peak_stashed),
        last_(schedule.stages() - 1) {}

  double run(const std::vector<Action>& actions) {
    for (const Action& a : actions) backwards_left_ += a.kind == ActionKind::kBackward;
    for (const Action& a : actions) {
      switch (a.kind) {
        case ActionKind::kRecvActivation:
        case ActionKind::kRecvGradient: receive(a); break;
        case ActionKind::kForward: forward(a); break;
        case ActionKind::kSendActivation: send_activation(a); break;
        case ActionKind::kBackward: backward(a); break;
        case ActionKind::kSendGradient: send_gradient(a); break;
      }
    }
    // Sends still in flight: the step is not over until they are delivered.
    const double start = now();
    for (Received& s : sends_) s.work.wait();
    spans_.push_back({SpanKind::kIdle, -1, -1, start, now()});
    return loss_;
  }

 private:
  using Key = std::pair<int, int>;  // (stage, micro-batch)

  void check(const at::Tensor& t, int stage, int mb, const char* what) const {
    if (t.sizes() != at::IntArrayRef(shape_) || t.scalar_type() != dtype_) {
      throw std::runtime_error("pipeline stage " + std::to_string(stage) + ", micro-batch " + std::to_string(mb) + ": " +
                               what + " has shape " + c10::str(t.sizes()) + " and dtype " +
                               std::string(c10::toString(t.scalar_type())) + ", the pipeline carries " +
                               c10::str(at::IntArrayRef(shape_)) + " " + c10::toString(dtype_));
    }
  }

  at::Tensor wait(Received& r, const Action& a) {
    const double start = now();
    r.work.wait();
    spans_.push_back({SpanKind::kRecv, a.stage, a.microbatch, start, now()});
    return r.tensor;
  }

  void send(const at::Tensor& t, int peer, int tag, const Action& a) {
    const double start = now();
    at::Tensor data = t.contiguous();
    sends_.push_back({data, comm_.send(data, peer, tag)});
    spans_.push_back({SpanKind::kSend, a.stage, a.microbatch, start, now()});
  }

  void receive(const Action& a) {
    const bool grad = a.kind == ActionKind::kRecvGradient;
    at::Tensor buffer = at::empty(shape_, at::TensorOptions().dtype(dtype_).device(comm_.device()));
    const int peer = schedule_.rank_of(grad ? a.stage + 1 : a.stage - 1);
    (grad ? output_grads_ : inputs_)[{a.stage, a.microbatch}] = {buffer, comm_.recv(buffer, peer, grad ? kGradientTag : kActivationTag)};
  }

  void forward(const Action& a) {
    const Key key{a.stage, a.microbatch};
    at::Tensor input;
    if (a.stage > 0) {
      auto it = inputs_.find(key);
      if (it == inputs_.end()) throw std::logic_error("pipeline executor: " + a.str() + " without its receive");
      input = wait(it->second, a);
      inputs_.erase(it);
      if (schedule_.backward) input.requires_grad_(true);
    }
    const double start = now();
    at::Tensor output = callbacks_.forward(a.stage, a.microbatch, input);
    spans_.push_back({SpanKind::kForward, a.stage, a.microbatch, start, now()});
    if (a.stage == last_) {
      loss_ += output.detach().item<double>();
    } else {
      check(output, a.stage, a.microbatch, "the output");
    }
    if (schedule_.backward) {
      stash_[key] = {input, output};
      peak_stashed_ = std::max(peak_stashed_, static_cast<int>(stash_.size()));
    } else if (a.stage < last_) {
      forward_only_outputs_[key] = output;
    }
  }

  void send_activation(const Action& a) {
    const Key key{a.stage, a.microbatch};
    at::Tensor output;
    if (schedule_.backward) {
      output = stash_.at(key).output.detach();
    } else {
      output = forward_only_outputs_.at(key);
      forward_only_outputs_.erase(key);
    }
    send(output, schedule_.rank_of(a.stage + 1), kActivationTag, a);
  }

  void backward(const Action& a) {
    auto it = stash_.find({a.stage, a.microbatch});
    if (it == stash_.end()) throw std::logic_error("pipeline executor: " + a.str() + " before its forward");
    at::Tensor grad;
    if (a.stage < last_) {
      auto g = output_grads_.find({a.stage, a.microbatch});
      if (g == output_grads_.end()) throw std::logic_error("pipeline executor: " + a.str() + " without its receive");
      grad = wait(g->second, a);
      output_grads_.erase(g);
    }
    if (callbacks_.before_backward) callbacks_.before_backward(--backwards_left_ == 0);
    const double start = now();
    if (grad.defined()) it->second.output.backward(grad);
    else it->second.output.backward();
    if (callbacks_.after_backward) callbacks_.after_backward();
    spans_.push_back({SpanKind::kBackward, a.stage, a.microbatch, start, now()});
    // The input's gradient waits in the stash for its send; the graph is gone.
    it->second.output = at::Tensor();
    if (a.stage == 0) stash_.erase(it);
  }

  void send_gradient(const Action& a) {
    auto it = stash_.find({a.stage, a.microbatch});
    const at::Tensor grad = it->second.input.grad();
    if (!grad.defined()) {
      throw std::runtime_error("pipeline stage " + std::to_string(a.stage) + ", micro-batch " +
                               std::to_string(a.microbatch) + ": backward left no gradient for the stage's input");
    }
    check(grad, a.stage, a.microbatch, "the input gradient");
    send(grad, schedule_.rank_of(a.stage - 1), kGradientTag, a);
    stash_.erase(it);
  }

  const Schedule& schedule_;
  const StageCallbacks& callbacks_;
  const std::vector<int64_t> shape_;
  const at::ScalarType dtype_;
  comm::Communicator& comm_;
  std::vector<Span>& spans_;
  int& peak_stashed_;
  const int last_;
  std::map<Key, Received> inputs_, output_grads_;
  std::map<Key, Stashed> stash_;
  std::map<Key, at::Tensor> forward_only_outputs_;  // waiting to be sent
  std::vector<Received> sends_;
  int backwards_left_ = 0;
  double loss_ = 0;
};

}  // namespace

PipelineExecutor::PipelineExecutor(std::shared_ptr<comm::Communicator> comm) : comm_(std::move(comm)) {}

double PipelineExecutor::run(const Schedule& schedule, const StageCallbacks& callbacks,
                             std::vector<int64_t> activation_shape, at::ScalarType dtype) {
  if (schedule.ranks != comm_->size()) {
    throw std::invalid_argument("pipeline executor: schedule '" + schedule.name + "' is for " +
                                std::to_string(schedule.ranks) + " ranks, the pipeline group has " +
                                std::to_string(comm_->size()));
  }
  spans_.clear();
  peak_stashed_ = 0;
  StepRun step(schedule, callbacks, std::move(activation_shape), dtype, *comm_, spans_, peak_stashed_);
  return step.run(schedule.actions.at(comm_->rank()));
}

}  // namespace meshtrain::parallel::pipeline
