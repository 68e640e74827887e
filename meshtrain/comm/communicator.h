// Communicator: the collective and point-to-point operations every parallelism
// is built from, behind one interface with an MPI (CPU) and an NCCL (GPU) backend.
#pragma once

#include "meshtrain/comm/op.h"
#include "meshtrain/comm/work.h"

#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace meshtrain::comm {

// Every error a communicator raises; the message starts with "rank R: ".
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Ranks issued different collectives (found by the desync check).
class DesyncError : public CommError {
 public:
  using CommError::CommError;
};

struct CommOptions {
  // An op not finished after this long ends the job (see Note [Watchdog]).
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // Before each collective, all ranks exchange and compare OpSignatures.
  bool desync_check = false;
  // One-rank collectives are done in place without the backend (see Note
  // [One-rank communicators]); true sends them through it (to test a backend).
  bool one_rank_through_backend = false;

  // Defaults overridden by MESHTRAIN_COMM_TIMEOUT (seconds, may be fractional)
  // and MESHTRAIN_DESYNC_CHECK (1/true/on). Throws on malformed values.
  static CommOptions from_env();
};

// Totals per op kind of what this communicator was asked to do.
struct CommStats {
  struct PerOp {
    int64_t calls = 0;
    int64_t payload_bytes = 0;  // bytes of the op's input tensor(s)
    int64_t wire_bytes = 0;     // Op::wire_bytes: bytes this rank sends under ring algorithms
  };
  std::array<PerOp, static_cast<size_t>(OpKind::kSplit) + 1> per_op{};

  const PerOp& operator[](OpKind kind) const { return per_op[static_cast<size_t>(kind)]; }
};

// Note [Communicator contract]
// - All ops are asynchronous: they validate their arguments, enqueue, and return
//   a Work. Ops of one communicator run in the order they were issued (per
//   communicator; ops of different communicators are independent and may be
//   issued in different orders on different ranks). Issuing is thread-safe, but
//   every rank must issue the collectives of a communicator in the same order.
// - Tensors must be contiguous and on a device accepts() takes; they are read and written in
//   place, and must not be touched by the caller until the Work is waited on.
// - Splits and counts are rows along dim 0 (elements for 1-D tensors), one entry
//   per rank. Uneven sizes are supported directly (no padding is visible to the
//   caller): reduce_scatter and all_gather take per-rank counts; all_to_all
//   takes per-rank input and output splits.
// - ReduceOp::kAvg divides the sum by size(); integer tensors are divided with
//   truncation. bfloat16 and float16 reduce pairwise in their own type (as NCCL
//   does), so a sum of n values carries up to ~log2(n) roundings.
class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  const CommOptions& options() const { return options_; }
  virtual const char* backend_name() const = 0;
  // Where this communicator's tensors must live.
  virtual at::Device device() const = 0;
  // Whether tensors on `d` may be passed to this communicator's ops.
  virtual bool accepts(const at::Device& d) const { return d == device(); }

  // In place: every rank ends with the reduction of all ranks' `tensor`.
  Work all_reduce(const at::Tensor& tensor, ReduceOp reduce = ReduceOp::kSum);
  // Reduces `input` (same shape on every rank) and leaves rank r with its rows:
  // evenly, input.size(0) == size() * output.size(0); or `counts[r]` rows.
  Work reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                      ReduceOp reduce = ReduceOp::kSum, std::vector<int64_t> counts = {});
  // Concatenates every rank's `input` along dim 0 into `output` (rank order);
  // evenly, or with `counts[r]` rows from rank r. `input` may be this rank's own
  // block of `output` (an in-place gather: nothing is copied for it).
  Work all_gather(const at::Tensor& output, const at::Tensor& input, std::vector<int64_t> counts = {});
  // In place: every rank ends with rank `root`'s `tensor`.
  Work broadcast(const at::Tensor& tensor, int root);
  // Rank r sends rows input_splits[d] (in rank order) to rank d and receives
  // output_splits[s] rows from rank s; empty splits mean even ones.
  Work all_to_all(const at::Tensor& output, const at::Tensor& input,
                  std::vector<int64_t> output_splits = {}, std::vector<int64_t> input_splits = {});
  Work send(const at::Tensor& tensor, int dst, int tag = 0);
  Work recv(const at::Tensor& tensor, int src, int tag = 0);
  Work barrier();

  // Blocking and collective over this communicator: ranks with the same `color`
  // form a new communicator, ordered by (key, rank). A negative color takes no
  // part and gets nullptr. The child inherits options() and the backend.
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name);
  // The same, with the child's own options (e.g. a shorter timeout or the desync check).
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name, CommOptions child_options);

  CommStats stats() const;

 protected:
  Communicator(int rank, int size, std::string name, CommOptions options);
  static void run_locally(const Op& op);  // a collective of one rank (Note [One-rank communicators])

  // Runs a validated op asynchronously, in issue order.
  virtual Work submit(Op op) = 0;
  // Implements split(); `op` is the numbered kSplit op to run in issue order.
  virtual std::shared_ptr<Communicator> do_split(Op op, int color, int key, const std::string& name,
                                                 CommOptions child_options) = 0;

  // "rank R: communicator 'name': " + message
  std::string error_prefix() const;
  [[noreturn]] void fail(const std::string& message) const;

 private:
  Op prepare(Op op);  // numbers the op and counts it in stats
  Work issue(Op op);
  void check_tensor(const at::Tensor& t, const char* what, bool reduce, const Op& op) const;
  void check_counts(const std::vector<int64_t>& counts, int64_t rows, const char* what, const Op& op) const;
  void check_peer(int peer, const char* what, const Op& op) const;
  // For reduce_scatter / all_gather: even counts when `counts` is empty, else
  // checked ones, over the rows of `full`; checks `shard` holds this rank's rows.
  std::vector<int64_t> shard_counts(std::vector<int64_t> counts, const at::Tensor& full, const at::Tensor& shard,
                                    const char* full_name, const char* shard_name, const Op& op) const;

  const int rank_;
  const int size_;
  const std::string name_;
  const CommOptions options_;

  mutable std::mutex stats_mutex_;
  CommStats stats_;                    // protected by stats_mutex_
  int64_t next_collective_sequence_ = 0;  // protected by stats_mutex_
  int64_t next_p2p_sequence_ = 0;         // protected by stats_mutex_
};

}  // namespace meshtrain::comm
