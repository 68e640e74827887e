// What tells stage 3 to gather a unit: hooks around a model's named call
// sites (model::Gpt), or, for any other module, an observer of every
// operator's inputs. See Note [Fully sharded].
#include "meshtrain/parallel/fsdp/sharded_state.h"
#include "meshtrain/model/gpt.h"

#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>

#include <unordered_map>

namespace meshtrain::parallel {

namespace {

// Gathers a unit before its forward and frees it after; the gradient of its
// output gathers it again before its backward.
class UnitHooks : public model::ForwardHooks {
 public:
  explicit UnitHooks(std::weak_ptr<ShardedState> state) : state_(std::move(state)) {}
  bool wraps_head() const override { return false; }  // units are "" and blocks

  at::Tensor around(const std::string& module, const at::Tensor& input, const Forward& forward) override {
    auto state = state_.lock();
    if (!state) return forward(input);
    auto it = state->unit_of_module.find(module);
    if (it == state->unit_of_module.end()) return forward(input);
    const size_t u = it->second;
    state->before_forward(u);
    const at::Tensor output = forward(input);
    const bool backward_follows = torch::GradMode::is_enabled() && output.requires_grad();
    state->after_forward(u, backward_follows);
    if (backward_follows && !state->units[u].module.empty()) {
      std::weak_ptr<ShardedState> weak = state;
      output.register_hook([weak, u](const at::Tensor& grad) {
        if (auto s = weak.lock()) s->before_backward(u);
        return grad;
      });
    }
    return output;
  }

 private:
  std::weak_ptr<ShardedState> state_;
};

// One RecordFunction callback for every observed FullySharded: a map from
// the storages of their units' full buffers to (state, unit).
class OperatorObserver {
 public:
  static OperatorObserver& instance() {
    static OperatorObserver observer;
    return observer;
  }

  void add(const std::shared_ptr<ShardedState>& state) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t u = 0; u < state->units.size(); ++u) {
      units_[state->units[u].full.storage().unsafeGetStorageImpl()] = {state, u};
    }
    if (users_++ == 0) {
      handle_ = at::addGlobalCallback(
          at::RecordFunctionCallback(&OperatorObserver::on_start).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
    }
  }

  void remove(const ShardedState& state) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const Unit& unit : state.units) units_.erase(unit.full.storage().unsafeGetStorageImpl());
    if (--users_ == 0) at::removeCallback(handle_);
  }

 private:
  struct Entry {
    std::weak_ptr<ShardedState> state;
    size_t unit;
  };

  // Runs before every operator: gathers the unit of any input that is a view
  // of a unit's flat buffer. Operators the gather itself runs are not observed.
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    if (observer_paused()) return nullptr;
    ObserverPause pause;
    for (const c10::IValue& input : fn.inputs()) {
      if (input.isTensor()) {
        instance().use(input.toTensor());
      } else if (input.isTensorList()) {
        for (const at::Tensor& t : input.toTensorList().vec()) instance().use(t);
      }
    }
    return nullptr;
  }

  void use(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    std::shared_ptr<ShardedState> state;
    size_t unit = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = units_.find(t.storage().unsafeGetStorageImpl());
      if (it == units_.end()) return;
      state = it->second.state.lock();
      unit = it->second.unit;
    }
    if (state) state->on_use(unit);
  }

  std::mutex mutex_;
  std::unordered_map<const c10::StorageImpl*, Entry> units_;
  int users_ = 0;
  at::CallbackHandle handle_ = 0;
};

}  // namespace

bool& observer_paused() {
  thread_local bool paused = false;
  return paused;
}

ObserverPause::ObserverPause() : was_(observer_paused()) { observer_paused() = true; }
ObserverPause::~ObserverPause() { observer_paused() = was_; }

void install_triggers(const std::shared_ptr<ShardedState>& state, const std::shared_ptr<torch::nn::Module>& module) {
  if (!state->stage3()) return;
  if (auto gpt = std::dynamic_pointer_cast<model::GptImpl>(module)) {
    state->hooks = std::make_shared<UnitHooks>(state);
    gpt->add_forward_hooks(state->hooks);
    return;
  }
  OperatorObserver::instance().add(state);
  state->observed = true;
}

void remove_triggers(ShardedState& state, const std::shared_ptr<torch::nn::Module>& module) {
  if (state.hooks) {
    std::dynamic_pointer_cast<model::GptImpl>(module)->remove_forward_hooks(state.hooks.get());
    state.hooks.reset();
  }
  if (state.observed) {
    OperatorObserver::instance().remove(state);
    state.observed = false;
  }
}

}  // namespace meshtrain::parallel
