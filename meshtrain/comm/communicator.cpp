#include "meshtrain/comm/communicator.h"

#include <cstdlib>
#include <numeric>
#include <sstream>

namespace meshtrain::comm {

namespace {

bool is_supported_dtype(at::ScalarType dtype, bool reduce) {
  switch (dtype) {
    case at::kFloat: case at::kDouble: case at::kBFloat16: case at::kHalf:
    case at::kInt: case at::kLong: case at::kChar: case at::kByte:
      return true;
    case at::kBool:
      return !reduce;
    default:
      return false;
  }
}

Op make_op(OpKind kind, const at::Tensor& input = {}, const at::Tensor& output = {},
           ReduceOp reduce = ReduceOp::kSum) {
  Op op;
  op.kind = kind;
  op.input = input;
  op.output = output;
  op.reduce = reduce;
  return op;
}

int64_t rows_of(const at::Tensor& t) { return t.dim() == 0 ? 1 : t.size(0); }

std::string join(const std::vector<int64_t>& v) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < v.size(); ++i) out << (i ? ", " : "") << v[i];
  out << "]";
  return out.str();
}

bool truthy(const std::string& v) {
  return v == "1" || v == "true" || v == "on" || v == "yes" || v == "TRUE" || v == "ON";
}

}  // namespace

CommOptions CommOptions::from_env() {
  CommOptions options;
  if (const char* v = std::getenv("MESHTRAIN_COMM_TIMEOUT"); v && *v) {
    char* end = nullptr;
    const double seconds = std::strtod(v, &end);
    if (end == v || *end != '\0' || !(seconds > 0)) {
      throw CommError(std::string("MESHTRAIN_COMM_TIMEOUT='") + v +
                      "' is not a positive number of seconds (e.g. 300 or 2.5)");
    }
    options.timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
  }
  if (const char* v = std::getenv("MESHTRAIN_DESYNC_CHECK"); v && *v) {
    options.desync_check = truthy(v);
  }
  return options;
}

Communicator::Communicator(int rank, int size, std::string name, CommOptions options)
    : rank_(rank), size_(size), name_(std::move(name)), options_(options) {}

std::string Communicator::error_prefix() const {
  return "rank " + std::to_string(rank_) + ": communicator '" + name_ + "': ";
}

void Communicator::fail(const std::string& message) const { throw CommError(error_prefix() + message); }

CommStats Communicator::stats() const {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  return stats_;
}

void Communicator::check_tensor(const at::Tensor& t, const char* what, bool reduce, const Op& op) const {
  if (!t.defined()) fail(op.describe() + ": " + what + " tensor is undefined");
  if (!t.is_contiguous()) fail(op.describe() + ": " + what + " tensor must be contiguous (call .contiguous())");
  if (!accepts(t.device())) {
    fail(op.describe() + ": " + what + " tensor is on " + t.device().str() + " but the " +
         backend_name() + " backend works on " + device().str());
  }
  if (!is_supported_dtype(t.scalar_type(), reduce)) {
    fail(op.describe() + ": dtype " + dtype_name(t.scalar_type()) + " is not supported" +
         (reduce ? " for reductions" : "") +
         " (supported: float32, float64, bfloat16, float16, int32, int64, int8, uint8" +
         (reduce ? ")" : ", bool)"));
  }
}

void Communicator::check_counts(const std::vector<int64_t>& counts, int64_t rows, const char* what,
                                const Op& op) const {
  if (static_cast<int>(counts.size()) != size_) {
    fail(op.describe() + ": " + what + " has " + std::to_string(counts.size()) +
         " entries but the communicator has " + std::to_string(size_) + " ranks");
  }
  for (int64_t c : counts) {
    if (c < 0) fail(op.describe() + ": " + what + " " + join(counts) + " has a negative entry");
  }
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  if (total != rows) {
    fail(op.describe() + ": " + what + " " + join(counts) + " sum to " + std::to_string(total) +
         " rows but the tensor has " + std::to_string(rows));
  }
}

std::vector<int64_t> Communicator::shard_counts(std::vector<int64_t> counts, const at::Tensor& full,
                                                const at::Tensor& shard, const char* full_name,
                                                const char* shard_name, const Op& op) const {
  if (full.scalar_type() != shard.scalar_type()) fail(op.describe() + ": input and output dtypes differ");
  if (full.dim() == 0) fail(op.describe() + ": " + full_name + " must have at least one dimension");
  if (counts.empty()) {
    if (full.size(0) % size_ != 0) {
      fail(op.describe() + ": " + full_name + " has " + std::to_string(full.size(0)) + " rows, not divisible by " +
           std::to_string(size_) + " ranks; pass per-rank counts (e.g. even_counts(rows, size)) for an uneven split");
    }
    counts.assign(size_, full.size(0) / size_);
  } else {
    check_counts(counts, full.size(0), "counts", op);
  }
  const int64_t row_numel = full.size(0) == 0 ? 0 : full.numel() / full.size(0);
  if (shard.numel() != counts[rank_] * row_numel) {
    fail(op.describe() + ": " + shard_name + " has " + std::to_string(shard.numel()) + " elements but this rank's " +
         std::to_string(counts[rank_]) + " rows of " + full_name + " hold " + std::to_string(counts[rank_] * row_numel));
  }
  return counts;
}

void Communicator::check_peer(int peer, const char* what, const Op& op) const {
  if (peer < 0 || peer >= size_) {
    fail(op.describe() + ": " + what + " " + std::to_string(peer) + " is outside [0, " +
         std::to_string(size_) + ")");
  }
}

Op Communicator::prepare(Op op) {
  {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    op.sequence = is_collective(op.kind) ? next_collective_sequence_++ : next_p2p_sequence_++;
    auto& s = stats_.per_op[static_cast<size_t>(op.kind)];
    s.calls += 1;
    if (op.input.defined()) s.payload_bytes += op.input.numel() * op.input.element_size();
    s.wire_bytes += op.wire_bytes(size_, rank_);
  }
  return op;
}

// Note [One-rank communicators]
// With no peers, every collective is a local copy (or nothing), so it completes
// on the caller's thread instead of paying two thread hand-offs: single-process
// runs and the size-1 groups of a mesh then cost what the tensor copy costs.
// send/recv to oneself still go through the backend, which matches them.
void Communicator::run_locally(const Op& op) {
  switch (op.kind) {
    case OpKind::kReduceScatter:
    case OpKind::kAllGather:
    case OpKind::kAllToAll:
      if (!op.output.is_same(op.input)) op.output.view(op.input.sizes()).copy_(op.input);
      return;
    default:  // all_reduce (avg of one is itself), broadcast, barrier
      return;
  }
}

Work Communicator::issue(Op op) {
  if (size_ == 1 && is_collective(op.kind) && !options_.one_rank_through_backend) {
    run_locally(prepare(std::move(op)));
    return Work();
  }
  return submit(prepare(std::move(op)));
}

Work Communicator::all_reduce(const at::Tensor& tensor, ReduceOp reduce) {
  Op op = make_op(OpKind::kAllReduce, tensor, tensor, reduce);
  check_tensor(tensor, "the", true, op);
  return issue(std::move(op));
}

Work Communicator::reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp reduce,
                                  std::vector<int64_t> counts) {
  Op op = make_op(OpKind::kReduceScatter, input, output, reduce);
  check_tensor(input, "input", true, op);
  check_tensor(output, "output", true, op);
  op.input_splits = shard_counts(std::move(counts), input, output, "input", "output", op);
  return issue(std::move(op));
}

Work Communicator::all_gather(const at::Tensor& output, const at::Tensor& input, std::vector<int64_t> counts) {
  Op op = make_op(OpKind::kAllGather, input, output);
  check_tensor(input, "input", false, op);
  check_tensor(output, "output", false, op);
  op.output_splits = shard_counts(std::move(counts), output, input, "output", "input", op);
  return issue(std::move(op));
}

Work Communicator::broadcast(const at::Tensor& tensor, int root) {
  Op op = make_op(OpKind::kBroadcast, tensor, tensor);
  op.peer = root;
  check_tensor(tensor, "the", false, op);
  check_peer(root, "root", op);
  return issue(std::move(op));
}

Work Communicator::all_to_all(const at::Tensor& output, const at::Tensor& input,
                              std::vector<int64_t> output_splits, std::vector<int64_t> input_splits) {
  Op op = make_op(OpKind::kAllToAll, input, output);
  check_tensor(input, "input", false, op);
  check_tensor(output, "output", false, op);
  if (input.scalar_type() != output.scalar_type()) fail(op.describe() + ": input and output dtypes differ");
  if (input.dim() == 0 || output.dim() == 0) fail(op.describe() + ": tensors must have at least one dimension");
  if (input.sizes().slice(1) != output.sizes().slice(1)) {
    fail(op.describe() + ": input and output must agree on every dimension but the first");
  }
  auto fill_even = [&](std::vector<int64_t>& splits, const at::Tensor& t, const char* what) {
    if (!splits.empty()) return check_counts(splits, rows_of(t), what, op);
    if (rows_of(t) % size_ != 0) {
      fail(op.describe() + ": " + std::to_string(rows_of(t)) + " rows are not divisible by " +
           std::to_string(size_) + " ranks; pass " + what);
    }
    splits.assign(size_, rows_of(t) / size_);
  };
  fill_even(input_splits, input, "input_splits");
  fill_even(output_splits, output, "output_splits");
  op.input_splits = std::move(input_splits);
  op.output_splits = std::move(output_splits);
  return issue(std::move(op));
}

Work Communicator::send(const at::Tensor& tensor, int dst, int tag) {
  Op op = make_op(OpKind::kSend, tensor, tensor);
  op.peer = dst;
  op.tag = tag;
  check_tensor(tensor, "the", false, op);
  check_peer(dst, "destination", op);
  if (tag < 0) fail(op.describe() + ": tag must be >= 0");
  return issue(std::move(op));
}

Work Communicator::recv(const at::Tensor& tensor, int src, int tag) {
  Op op = make_op(OpKind::kRecv, tensor, tensor);
  op.peer = src;
  op.tag = tag;
  check_tensor(tensor, "the", false, op);
  check_peer(src, "source", op);
  if (tag < 0) fail(op.describe() + ": tag must be >= 0");
  return issue(std::move(op));
}

Work Communicator::barrier() { return issue(make_op(OpKind::kBarrier)); }

std::shared_ptr<Communicator> Communicator::split(int color, int key, const std::string& name) {
  return split(color, key, name, options_);
}

std::shared_ptr<Communicator> Communicator::split(int color, int key, const std::string& name,
                                                  CommOptions child_options) {
  if (name.empty()) fail("split: the new communicator needs a name");
  return do_split(prepare(make_op(OpKind::kSplit)), color, key, name, child_options);
}

}  // namespace meshtrain::comm
