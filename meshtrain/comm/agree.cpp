#include "meshtrain/comm/agree.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace meshtrain::comm {

void on_root_or_all_fail(Communicator& comm, int root, const std::function<void()>& work) {
  std::string error;
  if (comm.rank() == root) {
    try {
      work();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  at::Tensor length = at::full({1}, static_cast<int64_t>(error.size()), at::kLong);
  comm.broadcast(length, root).wait();
  if (length.item<int64_t>() == 0) return;
  at::Tensor text = at::empty({length.item<int64_t>()}, at::kByte);
  if (comm.rank() == root) std::memcpy(text.data_ptr(), error.data(), error.size());
  comm.broadcast(text, root).wait();
  throw AgreedError(std::string(static_cast<const char*>(text.data_ptr()), text.numel()));
}

void on_all_or_all_fail(Communicator& comm, const std::function<void()>& work) {
  std::string error;
  try {
    work();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const std::vector<std::string> errors = all_gather_strings(comm, error);
  const bool alike = std::all_of(errors.begin(), errors.end(), [&](const std::string& e) { return e == errors.front(); });
  if (alike) {
    if (!errors.front().empty()) throw AgreedError(errors.front());
    return;
  }
  std::string message;
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty()) continue;
    if (!message.empty()) message += "; ";
    message += "rank " + std::to_string(r) + ": " + errors[r];
  }
  throw AgreedError(message);
}

std::vector<double> agree_values(Communicator& comm, const std::vector<double>& values, ReduceOp op) {
  at::Tensor agreed = at::tensor(values, at::kDouble).to(comm.device());
  comm.all_reduce(agreed, op).wait();
  agreed = agreed.cpu();
  return std::vector<double>(agreed.data_ptr<double>(), agreed.data_ptr<double>() + agreed.numel());
}

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& text) {
  at::Tensor lengths = at::empty({comm.size()}, at::kLong);
  comm.all_gather(lengths, at::full({1}, static_cast<int64_t>(text.size()), at::kLong)).wait();
  std::vector<int64_t> counts(lengths.data_ptr<int64_t>(), lengths.data_ptr<int64_t>() + comm.size());
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  at::Tensor mine = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  if (!text.empty()) std::memcpy(mine.data_ptr(), text.data(), text.size());
  at::Tensor all = at::empty({total}, at::kByte);
  comm.all_gather(all, mine, counts).wait();
  std::vector<std::string> out;
  const char* data = static_cast<const char*>(all.data_ptr());
  for (int64_t c : counts) {
    out.emplace_back(data, c);
    data += c;
  }
  return out;
}

}  // namespace meshtrain::comm
