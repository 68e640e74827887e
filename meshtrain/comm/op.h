// What a communicator is asked to do: op kinds, reduce ops, one request (Op) and
// the part of it every rank of a collective must agree on (OpSignature).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::comm {

enum class ReduceOp { kSum, kAvg, kMax, kMin };

enum class OpKind {
  kAllReduce,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kAllToAll,
  kSend,
  kRecv,
  kBarrier,
  kSplit,
};

const char* op_name(OpKind kind);          // "all_reduce", ...
const char* reduce_name(ReduceOp reduce);  // "sum", ...
std::string dtype_name(at::ScalarType dtype);  // "float32", "bfloat16", ...
bool is_collective(OpKind kind);           // everything but send and recv

// One request to a communicator. Splits and counts are numbers of rows along
// dim 0, one entry per rank of the communicator; empty means an even split.
struct Op {
  OpKind kind = OpKind::kBarrier;
  at::Tensor input;   // in-place ops (all_reduce, broadcast, send, recv) set input == output
  at::Tensor output;
  ReduceOp reduce = ReduceOp::kSum;
  int peer = -1;      // broadcast root, send destination or recv source
  int tag = 0;        // send/recv only
  std::vector<int64_t> input_splits;   // all_to_all: rows sent to each rank; reduce_scatter: counts
  std::vector<int64_t> output_splits;  // all_to_all: rows received from each rank; all_gather: counts
  int64_t sequence = 0;  // per communicator, counted separately for collectives and p2p

  // "all_reduce(float32[4, 8], sum)"
  std::string describe() const;
  // Bytes this rank sends for the op under bandwidth-optimal (ring) algorithms on
  // a communicator of `size` ranks: all_reduce 2(n-1)/n B, reduce_scatter (n-1)/n B_in,
  // all_gather (n-1)/n B_out, broadcast B on the root, all_to_all the bytes addressed
  // to other ranks, send B.
  int64_t wire_bytes(int size, int rank) const;
};

// The fields of an Op that all ranks of a collective must issue identically,
// packed into fixed-size words so ranks can exchange and compare them.
struct OpSignature {
  static constexpr int kMaxDims = 8;
  static constexpr int kWords = 8 + kMaxDims;
  std::array<int64_t, kWords> words{};

  static OpSignature of(const Op& op);
  std::string describe() const;  // "all_reduce(float32[4, 8], sum) #3"
  bool operator==(const OpSignature& other) const { return words == other.words; }
  bool operator!=(const OpSignature& other) const { return words != other.words; }
};

// Empty when every rank's signature is the same; otherwise one line grouping the
// ranks by what they issued: "ranks 0,2: all_reduce(float32[8], sum) #3; rank 1: ...".
std::string compare_signatures(const std::vector<OpSignature>& by_rank);

// Splits `rows` into `parts` counts differing by at most one, larger ones first:
// even_counts(10, 4) == {3, 3, 2, 2}.
std::vector<int64_t> even_counts(int64_t rows, int parts);

}  // namespace meshtrain::comm
