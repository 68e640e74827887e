#include "meshtrain/parallel/data_parallel.h"

#include "meshtrain/parallel/gradient_ready_hook.h"

#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <mutex>

namespace meshtrain::parallel {

struct DataParallel::State {
  struct Bucket {
    at::Tensor flat;
    std::vector<at::Tensor> params;
    bool expert = false;  // reduced over expert_comm, scaled by expert_scale first
    int64_t ready = 0;
    comm::Work work;
  };

  std::shared_ptr<comm::Communicator> comm, expert_comm;
  double expert_scale = 1.0;
  std::vector<Bucket> buckets;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // keeps the hooks alive
  std::mutex mutex;  // autograd may run hooks on another thread (GPU); State below is protected by it
  bool sync = true;
  size_t next_to_issue = 0;
  double exposed_wait_seconds = 0;
  double finish_entered = 0, finish_returned = 0;

  void issue_ready_buckets_locked() {
    while (next_to_issue < buckets.size() &&
           buckets[next_to_issue].ready == static_cast<int64_t>(buckets[next_to_issue].params.size())) {
      issue_locked(next_to_issue++);
    }
  }

  void issue_locked(size_t index) {
    Bucket& bucket = buckets[index];
    if (bucket.expert && expert_scale != 1.0) bucket.flat.mul_(expert_scale);
    bucket.work = (bucket.expert ? expert_comm : comm)->all_reduce(bucket.flat, comm::ReduceOp::kAvg);
  }

  void mark_ready(size_t index) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!sync) return;
    ++buckets[index].ready;
    issue_ready_buckets_locked();
  }
};

DataParallel::DataParallel(torch::nn::Module& module, std::shared_ptr<comm::Communicator> comm,
                           DataParallelOptions options)
    : module_(module), comm_(std::move(comm)), options_(std::move(options)), state_(std::make_shared<State>()) {
  if (options_.bucket_bytes < 1) throw std::invalid_argument("data parallel: bucket size must be positive");
  if (options_.expert && !options_.expert_comm) throw std::invalid_argument("data parallel: expert parameters need expert_comm");
  state_->comm = comm_;
  state_->expert_comm = options_.expert_comm;
  state_->expert_scale = options_.expert_scale;
  torch::NoGradGuard no_grad;
  std::vector<std::pair<at::Tensor, bool>> params;  // (parameter, expert), reverse registration order
  for (const auto& item : module.named_parameters()) {
    const bool expert = options_.expert && options_.expert(item.key());
    if (expert) expert_names_.insert(item.key());
    if (item.value().requires_grad()) params.emplace_back(item.value(), expert);
  }
  std::reverse(params.begin(), params.end());

  // Same starting point everywhere: rank 0's parameters and buffers (an expert's: its replicas' rank 0).
  std::vector<comm::Work> broadcasts;
  for (const auto& item : module.named_parameters()) {
    const bool expert = expert_names_.count(item.key()) > 0;
    broadcasts.push_back((expert ? options_.expert_comm : comm_)->broadcast(item.value().data(), 0));
  }
  for (const at::Tensor& b : module.buffers()) broadcasts.push_back(comm_->broadcast(b, 0));
  comm::wait_all(broadcasts);

  // Buckets in reverse registration order, one dtype, device and group (experts or not) each.
  std::vector<std::vector<at::Tensor>> groups;
  std::vector<bool> group_is_expert;
  int64_t group_bytes = 0;
  for (const auto& [p, expert] : params) {
    const int64_t bytes = p.numel() * p.element_size();
    const int64_t limit = groups.size() <= 1 ? std::min(options_.first_bucket_bytes, options_.bucket_bytes)
                                             : options_.bucket_bytes;
    const bool fits = !groups.empty() && group_bytes + bytes <= limit &&
                      groups.back().front().scalar_type() == p.scalar_type() &&
                      groups.back().front().device() == p.device() && group_is_expert.back() == expert;
    if (!fits) {
      groups.emplace_back();
      group_is_expert.push_back(expert);
      group_bytes = 0;
    }
    groups.back().push_back(p);
    group_bytes += bytes;
  }
  for (size_t b = 0; b < groups.size(); ++b) {
    State::Bucket bucket;
    int64_t numel = 0;
    for (const at::Tensor& p : groups[b]) numel += p.numel();
    bucket.flat = at::zeros({numel}, groups[b].front().options());
    int64_t offset = 0;
    for (const at::Tensor& p : groups[b]) {
      if (p.grad().defined()) bucket.flat.narrow(0, offset, p.numel()).copy_(p.grad().view({-1}));
      p.mutable_grad() = bucket.flat.narrow(0, offset, p.numel()).view(p.sizes());
      offset += p.numel();
      auto accumulator = torch::autograd::impl::grad_accumulator(p);
      accumulator->add_post_hook(std::make_unique<GradientReadyHook<State>>(state_, b));
      state_->accumulators.push_back(std::move(accumulator));
    }
    bucket.params = groups[b];
    bucket.expert = group_is_expert[b];
    state_->buckets.push_back(std::move(bucket));
  }
  std::vector<AdamWParameter> adamw;
  for (const auto& item : module.named_parameters()) {
    if (item.value().requires_grad()) adamw.push_back({item.value(), decay_dims(item.key(), item.value())});
  }
  optimizer_ = make_adamw(adamw, options_.adamw);
}

DataParallel::~DataParallel() {
  // Hooks hold the state weakly and go quiet once it is gone; in-flight
  // all-reduces write into buckets the state owns, so wait for them first.
  try {
    for (auto& bucket : state_->buckets) bucket.work.wait();
  } catch (...) {
  }
}

void DataParallel::set_sync(bool sync) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->sync = sync;
}

void DataParallel::finish() {
  const auto start = std::chrono::steady_clock::now();
  std::vector<comm::Work> works;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    // Buckets whose parameters got no gradient this step are reduced as they are.
    while (state_->next_to_issue < state_->buckets.size()) state_->issue_locked(state_->next_to_issue++);
    for (auto& bucket : state_->buckets) works.push_back(bucket.work);
  }
  comm::wait_all(works);
  std::lock_guard<std::mutex> lock(state_->mutex);
  for (auto& bucket : state_->buckets) {
    bucket.ready = 0;
    bucket.work = comm::Work();
  }
  state_->next_to_issue = 0;
  const auto end = std::chrono::steady_clock::now();
  state_->exposed_wait_seconds += std::chrono::duration<double>(end - start).count();
  state_->finish_entered = std::chrono::duration<double>(start.time_since_epoch()).count();
  state_->finish_returned = std::chrono::duration<double>(end.time_since_epoch()).count();
}

std::pair<double, double> DataParallel::last_finish_times() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return {state_->finish_entered, state_->finish_returned};
}

void DataParallel::zero_grad() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  for (auto& bucket : state_->buckets) bucket.flat.zero_();
}

double DataParallel::standalone_reduce_seconds(int repeats) const {
  std::vector<at::Tensor> copies;
  for (const auto& bucket : state_->buckets) copies.push_back(bucket.flat.clone());
  std::vector<double> seconds;
  for (int r = 0; r < repeats; ++r) {
    comm_->barrier().wait();
    const auto start = std::chrono::steady_clock::now();
    std::vector<comm::Work> works;
    for (const at::Tensor& copy : copies) works.push_back(comm_->all_reduce(copy, comm::ReduceOp::kAvg));
    comm::wait_all(works);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

void DataParallel::after_backward() {
  bool sync;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    sync = state_->sync;
  }
  if (sync) finish();
}

at::Tensor DataParallel::reduced_gradient(const std::string& name) {
  const auto parameters = module_.named_parameters();  // find() points into it
  const at::Tensor* p = parameters.find(name);
  if (!p) throw std::invalid_argument("data parallel: the module has no parameter " + name);
  return p->grad();
}

double DataParallel::clip_grad_norm(double max_norm) {
  return parallel::clip_grad_norm(module_, max_norm, options_.norm);
}

void DataParallel::step(double lr) {
  set_learning_rate(*optimizer_, lr);
  adamw_step(*optimizer_);
}

placement::TrainingState DataParallel::state(const ParameterLayouts& layouts) {
  placement::TrainingState out;
  std::vector<std::pair<std::string, at::Tensor>> parameters;
  std::vector<int64_t> sizes;
  for (const auto& item : module_.named_parameters()) {
    if (!item.value().requires_grad()) continue;
    parameters.emplace_back(item.key(), item.value());
    sizes.push_back(item.value().numel());
  }
  // The replicas hold the same: each parameter is saved by one of them, the bytes spread evenly
  // (an expert's replicas are its expert_comm).
  const std::vector<int> owners = placement::balanced_owners(sizes, comm_->size());
  const std::vector<int> expert_owners =
      options_.expert_comm ? placement::balanced_owners(sizes, options_.expert_comm->size()) : owners;
  for (size_t i = 0; i < parameters.size(); ++i) {
    const auto& [name, parameter] = parameters[i];
    const at::Tensor p = parameter.detach();
    const ParameterLayout layout = layouts(name, p);
    const bool expert = expert_names_.count(name) > 0;
    const bool write =
        layout.write && (expert ? expert_owners[i] == options_.expert_comm->rank() : owners[i] == comm_->rank());
    out.push_back({"model/" + name, layout.spec, p.reshape({-1}), write});
    torch::optim::AdamWParamState& s = adamw_state(*optimizer_, parameter);
    out.push_back({"optim/" + name + "/exp_avg", layout.spec, s.exp_avg().view({-1}), write});
    out.push_back({"optim/" + name + "/exp_avg_sq", layout.spec, s.exp_avg_sq().view({-1}), write});
  }
  return out;
}

placement::TrainingState DataParallel::frozen_state(const ParameterLayouts& layouts) {
  placement::TrainingState out;
  for (const auto& item : module_.named_parameters()) {
    if (item.value().requires_grad()) continue;
    const at::Tensor p = item.value().detach();
    const ParameterLayout layout = layouts(item.key(), p);
    out.push_back({"model/" + item.key(), layout.spec, p.reshape({-1}), layout.write});
  }
  return out;
}

void DataParallel::after_load(int64_t optimizer_steps) { set_adamw_steps(*optimizer_, optimizer_steps); }

std::map<std::string, at::Tensor> DataParallel::full_parameters(int /*root*/) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : module_.named_parameters()) out[item.key()] = item.value().detach().to(at::kFloat, false, true);
  return out;
}

std::string DataParallel::describe() const {
  const std::string buckets = std::to_string(bucket_count()) + " gradient bucket(s)";
  const int64_t degree = options_.data_degree > 0 ? options_.data_degree : comm_->size();
  if (degree == comm_->size()) return "data parallel over " + std::to_string(degree) + " rank(s), " + buckets;
  return "data parallel dp(" + std::to_string(degree) + "), gradients averaged over " + std::to_string(comm_->size()) +
         " ranks, " + buckets;
}

int64_t DataParallel::bucket_count() const { return static_cast<int64_t>(state_->buckets.size()); }

double DataParallel::exposed_wait_seconds() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->exposed_wait_seconds;
}

}  // namespace meshtrain::parallel
