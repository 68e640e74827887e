#include "meshtrain/parallel/expert_parallel.h"

#include <algorithm>
#include <numeric>

namespace meshtrain::parallel {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Autograd saves IValues only: the communicator and the splits travel in a capsule.
struct Exchange : torch::CustomClassHolder {
  std::shared_ptr<comm::Communicator> comm;
  std::vector<int64_t> send_rows, receive_rows;  // per rank of comm
};

// All-to-all of rows: rank r sends send_rows[d] rows to rank d; backward sends
// the gradients back the same way reversed.
struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, c10::intrusive_ptr<Exchange> exchange) {
    const int64_t rows = std::accumulate(exchange->receive_rows.begin(), exchange->receive_rows.end(), int64_t{0});
    at::Tensor output = at::empty({rows, input.size(1)}, input.options());
    exchange->comm->all_to_all(output, input.contiguous(), exchange->receive_rows, exchange->send_rows).wait();
    ctx->saved_data["exchange"] = at::IValue::make_capsule(exchange);
    return output;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto exchange = c10::static_intrusive_pointer_cast<Exchange>(ctx->saved_data["exchange"].toCapsule());
    auto reverse = c10::make_intrusive<Exchange>();
    reverse->comm = exchange->comm;
    reverse->send_rows = exchange->receive_rows;
    reverse->receive_rows = exchange->send_rows;
    const int64_t rows = std::accumulate(reverse->receive_rows.begin(), reverse->receive_rows.end(), int64_t{0});
    at::Tensor grad_input = at::empty({rows, grads[0].size(1)}, grads[0].options());
    reverse->comm->all_to_all(grad_input, grads[0].contiguous(), reverse->receive_rows, reverse->send_rows).wait();
    return {grad_input, at::Tensor()};
  }
};

at::Tensor all_to_all_rows(const at::Tensor& input, const std::shared_ptr<comm::Communicator>& comm,
                           std::vector<int64_t> send_rows, std::vector<int64_t> receive_rows) {
  auto exchange = c10::make_intrusive<Exchange>();
  exchange->comm = comm;
  exchange->send_rows = std::move(send_rows);
  exchange->receive_rows = std::move(receive_rows);
  return AllToAllRows::apply(input, exchange);
}

// Note [Expert parallel], steps (1)-(4).
class AllToAllExchange final : public model::ExpertExchange {
 public:
  explicit AllToAllExchange(std::shared_ptr<comm::Communicator> comm) : comm_(std::move(comm)) {}

  at::Tensor run(const at::Tensor& tokens, const std::vector<int64_t>& counts,
                 const model::ExpertCompute& compute) override {
    const int ep = comm_->size();
    const int64_t local = static_cast<int64_t>(counts.size()) / ep;
    // (1) How many tokens each rank sends to each of this rank's experts.
    const at::Device where = comm_->accepts(at::kCPU) ? at::Device(at::kCPU) : comm_->device();
    const at::Tensor sent_counts = at::tensor(counts, at::kLong).view({ep, local}).to(where);
    at::Tensor got = at::empty({ep, local}, sent_counts.options());
    comm_->all_to_all(got, sent_counts).wait();
    got = got.cpu();
    const int64_t* received = got.data_ptr<int64_t>();
    std::vector<int64_t> send_rows(ep), receive_rows(ep), per_expert(local, 0);
    for (int r = 0; r < ep; ++r) {
      send_rows[r] = std::accumulate(counts.begin() + r * local, counts.begin() + (r + 1) * local, int64_t{0});
      for (int64_t e = 0; e < local; ++e) {
        receive_rows[r] += received[r * local + e];
        per_expert[e] += received[r * local + e];
      }
    }
    // (2) The tokens, grouped by source rank then expert.
    const at::Tensor arrived = all_to_all_rows(tokens, comm_, send_rows, receive_rows);
    // (3) Regrouped by expert (then source rank), computed, put back.
    std::vector<int64_t> order, source_start(ep, 0);
    for (int r = 1; r < ep; ++r) source_start[r] = source_start[r - 1] + receive_rows[r - 1];
    for (int64_t e = 0; e < local; ++e) {
      for (int r = 0; r < ep; ++r) {
        int64_t start = source_start[r];
        for (int64_t f = 0; f < e; ++f) start += received[r * local + f];
        for (int64_t i = 0; i < received[r * local + e]; ++i) order.push_back(start + i);
      }
    }
    std::vector<int64_t> inverse(order.size());
    for (size_t j = 0; j < order.size(); ++j) inverse[order[j]] = static_cast<int64_t>(j);
    const at::Tensor by_expert = arrived.index_select(0, at::tensor(order, at::kLong).to(arrived.device()));
    const at::Tensor computed = compute(by_expert, per_expert, comm_->rank() * local);
    const at::Tensor by_source = computed.index_select(0, at::tensor(inverse, at::kLong).to(computed.device()));
    // (4) Back to the ranks the tokens came from.
    return all_to_all_rows(by_source, comm_, receive_rows, send_rows);
  }

 private:
  std::shared_ptr<comm::Communicator> comm_;
};

}  // namespace

double busiest_rank_load(const std::vector<double>& kept, double routed, int64_t ep) {
  const int64_t experts = static_cast<int64_t>(kept.size());
  if (ep < 1 || experts % ep != 0 || routed <= 0) return 0;
  double most = 0;
  for (int64_t rank = 0; rank < ep; ++rank) {
    const int64_t first = first_expert(rank, experts, ep);
    double share = 0;
    for (int64_t e = first; e < first + experts / ep; ++e) share += kept[e];
    most = std::max(most, share / routed);
  }
  return static_cast<double>(ep) * most;
}

namespace {

// busiest_rank_load of the sources `group` together.
double group_load(const std::vector<std::vector<double>>& kept, const std::vector<double>& routed,
                  const std::vector<size_t>& group, size_t experts, int64_t ep) {
  std::vector<double> summed(experts, 0.0);
  double assignments = 0;
  for (size_t s : group) {
    for (size_t e = 0; e < experts && e < kept[s].size(); ++e) summed[e] += kept[s][e];
    assignments += routed[s];
  }
  return busiest_rank_load(summed, assignments, ep);
}

}  // namespace

double grouped_rank_load(const std::vector<std::vector<double>>& kept, const std::vector<double>& routed, int64_t ep,
                         int64_t streams) {
  if (ep < 1 || streams < 1 || kept.size() < routed.size()) return 0;
  std::vector<std::vector<size_t>> by_forward;  // the sources that routed something, per forward
  std::vector<size_t> all;
  for (size_t s = 0; s < routed.size(); ++s) {
    if (s % static_cast<size_t>(streams) == 0) by_forward.emplace_back();
    if (routed[s] <= 0) continue;
    by_forward.back().push_back(s);
    all.push_back(s);
  }
  if (all.empty()) return 0;
  const size_t experts = kept[all.front()].size(), e = static_cast<size_t>(ep);
  if (experts == 0 || experts % e != 0) return 0;
  by_forward.erase(std::remove_if(by_forward.begin(), by_forward.end(), [](const auto& f) { return f.empty(); }),
                   by_forward.end());
  const size_t width = by_forward.front().size();
  const bool aligned = width >= e && width % e == 0 &&
                       std::all_of(by_forward.begin(), by_forward.end(), [&](const auto& f) { return f.size() == width; });
  if (aligned) {  // the same ep streams exchange in every forward: the slowest group's mean
    double slowest = 0;
    for (size_t g = 0; g < width / e; ++g) {
      double sum = 0;
      for (const std::vector<size_t>& forward : by_forward) {
        sum += group_load(kept, routed, {forward.begin() + g * e, forward.begin() + (g + 1) * e}, experts, ep);
      }
      slowest = std::max(slowest, sum / static_cast<double>(by_forward.size()));
    }
    return slowest;
  }
  const size_t group = std::min(all.size(), e);
  double total = 0;
  int64_t groups = 0;
  for (size_t first = 0; first + group <= all.size(); first += group, ++groups) {
    total += group_load(kept, routed, {all.begin() + first, all.begin() + first + group}, experts, ep);
  }
  return total / static_cast<double>(groups);
}

ExpertParallel::ExpertParallel(model::Gpt& model, std::shared_ptr<comm::Communicator> ep) : comm_(std::move(ep)) {
  const int64_t experts = model->config().moe_experts, ranks = comm_->size();
  if (experts == 0 || experts % ranks != 0) {
    throw std::invalid_argument("expert parallel: ep(" + std::to_string(ranks) + ") must divide model.moe_experts (" +
                                std::to_string(experts) + ")");
  }
  experts_per_rank_ = experts / ranks;
  auto exchange = std::make_shared<AllToAllExchange>(comm_);
  for (model::Moe& layer : model->moe_layers()) {
    layer->keep_experts(first_expert(comm_->rank(), experts, ranks), experts_per_rank_);
    layer->set_exchange(exchange);
  }
}

std::map<std::string, at::Tensor> ExpertParallel::gather_all(std::map<std::string, at::Tensor> local) const {
  for (auto& [name, tensor] : local) {
    if (!model::is_expert_tensor(name)) continue;
    std::vector<int64_t> shape = tensor.sizes().vec();
    shape[0] *= comm_->size();
    at::Tensor whole = at::empty(shape, tensor.options());
    comm_->all_gather(whole, tensor.contiguous()).wait();
    tensor = whole;
  }
  return local;
}

placement::Placement ExpertParallel::placement_of(const std::string& name) const {
  return model::is_expert_tensor(name) ? placement::Placement::shard(0) : placement::Placement::replicate();
}

}  // namespace meshtrain::parallel
