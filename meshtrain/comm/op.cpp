#include "meshtrain/comm/op.h"

#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>

namespace meshtrain::comm {

const char* op_name(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce: return "all_reduce";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllToAll: return "all_to_all";
    case OpKind::kSend: return "send";
    case OpKind::kRecv: return "recv";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kSplit: return "split";
  }
  return "unknown_op";
}

const char* reduce_name(ReduceOp reduce) {
  switch (reduce) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "unknown_reduce";
}

std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(dtype);
  }
}

bool is_collective(OpKind kind) { return kind != OpKind::kSend && kind != OpKind::kRecv; }

namespace {

bool has_reduce(OpKind kind) {
  return kind == OpKind::kAllReduce || kind == OpKind::kReduceScatter;
}

// The tensor whose shape all ranks must agree on, and whether its dim 0 may differ.
const at::Tensor& agreed_tensor(const Op& op, bool& dim0_free) {
  dim0_free = false;
  switch (op.kind) {
    case OpKind::kAllGather: return op.output;
    case OpKind::kAllToAll: dim0_free = true; return op.input;
    default: return op.input;
  }
}

void append_shape(std::ostringstream& out, at::IntArrayRef shape, bool dim0_free) {
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out << ", ";
    if (i == 0 && dim0_free) out << "*";
    else out << shape[i];
  }
  out << "]";
}

int64_t hash_counts(const std::vector<int64_t>& counts) {
  size_t h = counts.size();
  for (int64_t c : counts) h = h * 1000003u ^ std::hash<int64_t>{}(c);
  return static_cast<int64_t>(h & 0x7fffffffffffffffULL);
}

}  // namespace

std::string Op::describe() const {
  std::ostringstream out;
  out << op_name(kind);
  if (kind == OpKind::kBarrier || kind == OpKind::kSplit) {
    out << "()";
    return out.str();
  }
  bool dim0_free = false;
  const at::Tensor& t = agreed_tensor(*this, dim0_free);
  out << "(";
  if (t.defined()) {
    out << dtype_name(t.scalar_type());
    append_shape(out, t.sizes(), dim0_free);
  }
  if (has_reduce(kind)) out << ", " << reduce_name(reduce);
  if (kind == OpKind::kBroadcast) out << ", root=" << peer;
  if (kind == OpKind::kSend) out << ", dst=" << peer << ", tag=" << tag;
  if (kind == OpKind::kRecv) out << ", src=" << peer << ", tag=" << tag;
  out << ")";
  return out.str();
}

int64_t Op::wire_bytes(int size, int rank) const {
  if (size <= 1) return 0;
  const int64_t n = size;
  auto bytes = [](const at::Tensor& t) { return t.defined() ? t.numel() * int64_t(t.element_size()) : 0; };
  switch (kind) {
    case OpKind::kAllReduce: return 2 * (n - 1) * bytes(input) / n;
    case OpKind::kReduceScatter: return (n - 1) * bytes(input) / n;
    case OpKind::kAllGather: return (n - 1) * bytes(output) / n;
    case OpKind::kBroadcast: return rank == peer ? bytes(input) : 0;
    case OpKind::kAllToAll: {
      const int64_t row_bytes = input.dim() == 0 || input.size(0) == 0 ? 0 : bytes(input) / input.size(0);
      const int64_t self_rows = input_splits.empty() ? (input.dim() ? input.size(0) / n : 0)
                                                     : input_splits[rank];
      return bytes(input) - self_rows * row_bytes;
    }
    case OpKind::kSend: return bytes(input);
    default: return 0;
  }
}

OpSignature OpSignature::of(const Op& op) {
  OpSignature sig;
  auto& w = sig.words;
  w[0] = static_cast<int64_t>(op.kind);
  w[1] = has_reduce(op.kind) ? static_cast<int64_t>(op.reduce) : -1;
  w[2] = op.kind == OpKind::kBroadcast ? op.peer : -1;
  w[3] = op.sequence;
  w[4] = -1;  // dtype
  w[5] = -1;  // ndim
  w[6] = 0;   // hash of counts that must agree
  if (op.kind == OpKind::kReduceScatter) w[6] = hash_counts(op.input_splits);
  if (op.kind == OpKind::kAllGather) w[6] = hash_counts(op.output_splits);
  bool dim0_free = false;
  const at::Tensor& t = agreed_tensor(op, dim0_free);
  if (op.kind != OpKind::kBarrier && op.kind != OpKind::kSplit && t.defined()) {
    w[4] = static_cast<int64_t>(t.scalar_type());
    w[5] = t.dim();
    w[7] = dim0_free ? 1 : 0;
    int64_t folded = 0;  // dims beyond kMaxDims are folded into the last word
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t v = (d == 0 && dim0_free) ? -1 : t.size(d);
      if (d < kMaxDims - 1) w[8 + d] = v;
      else folded = folded * 1000003 + v;
    }
    if (t.dim() >= kMaxDims) w[8 + kMaxDims - 1] = folded;
  }
  return sig;
}

std::string OpSignature::describe() const {
  const auto kind = static_cast<OpKind>(words[0]);
  std::ostringstream out;
  out << op_name(kind) << "(";
  if (words[4] >= 0) {
    out << dtype_name(static_cast<at::ScalarType>(words[4])) << "[";
    const int64_t ndim = words[5];
    for (int64_t d = 0; d < ndim && d < kMaxDims; ++d) {
      if (d) out << ", ";
      if (d == kMaxDims - 1 && ndim > kMaxDims - 1) { out << "..."; break; }
      if (d == 0 && words[7]) out << "*";
      else out << words[8 + d];
    }
    out << "]";
  }
  if (words[1] >= 0) out << ", " << reduce_name(static_cast<ReduceOp>(words[1]));
  if (words[2] >= 0) out << ", root=" << words[2];
  if (words[6] != 0) out << ", counts#" << (words[6] % 100000);
  out << ") #" << words[3];
  return out.str();
}

std::string compare_signatures(const std::vector<OpSignature>& by_rank) {
  std::map<std::string, std::vector<size_t>> ranks_by_text;
  std::vector<std::string> order;
  for (size_t r = 0; r < by_rank.size(); ++r) {
    const std::string text = by_rank[r].describe();
    if (!ranks_by_text.count(text)) order.push_back(text);
    ranks_by_text[text].push_back(r);
  }
  if (order.size() <= 1) return "";
  std::ostringstream out;
  for (size_t i = 0; i < order.size(); ++i) {
    const auto& ranks = ranks_by_text[order[i]];
    out << (i ? "; " : "") << (ranks.size() == 1 ? "rank " : "ranks ");
    for (size_t j = 0; j < ranks.size(); ++j) out << (j ? "," : "") << ranks[j];
    out << ": " << order[i];
  }
  return out.str();
}

std::vector<int64_t> even_counts(int64_t rows, int parts) {
  if (parts <= 0) throw std::invalid_argument("even_counts: parts must be positive, got " + std::to_string(parts));
  if (rows < 0) throw std::invalid_argument("even_counts: rows must be >= 0, got " + std::to_string(rows));
  std::vector<int64_t> counts(parts, rows / parts);
  for (int64_t i = 0; i < rows % parts; ++i) ++counts[i];
  return counts;
}

}  // namespace meshtrain::comm
