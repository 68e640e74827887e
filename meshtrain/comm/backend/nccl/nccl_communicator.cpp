#include "meshtrain/comm/backend/nccl/nccl_communicator.h"

#include "meshtrain/comm/watchdog.h"

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <nccl.h>

#include <algorithm>
#include <cstring>

namespace meshtrain::comm {

bool nccl_compiled() { return true; }

namespace {

ncclDataType_t nccl_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kChar: return ncclInt8;
    case at::kByte: return ncclUint8;
    case at::kBool: return ncclUint8;
    default: throw CommError("NCCL backend: no NCCL datatype for " + dtype_name(dtype));
  }
}

ncclRedOp_t nccl_op(ReduceOp reduce) {
  switch (reduce) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

class CudaWork final : public WorkImpl {
 public:
  CudaWork(std::shared_ptr<at::cuda::CUDAEvent> done, at::Device device) : done_(std::move(done)), device_(device) {}
  void wait() override { done_->block(c10::cuda::getCurrentCUDAStream(device_.index())); }
  bool completed() const override { return done_->query(); }

 private:
  std::shared_ptr<at::cuda::CUDAEvent> done_;
  at::Device device_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Communicator> bootstrap, at::Device device, const std::string& name)
      : Communicator(bootstrap->rank(), bootstrap->size(), name, bootstrap->options()),
        bootstrap_(std::move(bootstrap)),
        device_(device),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index())) {
    if (!device_.is_cuda()) fail("the NCCL backend needs a CUDA device, got " + device_.str());
    ncclUniqueId id;
    if (rank() == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    at::Tensor id_bytes = at::empty({static_cast<int64_t>(sizeof(id))}, at::kByte);
    if (rank() == 0) std::memcpy(id_bytes.data_ptr(), &id, sizeof(id));
    bootstrap_->broadcast(id_bytes, 0).wait();
    std::memcpy(&id, id_bytes.data_ptr(), sizeof(id));
    c10::cuda::CUDAGuard guard(device_);
    check(ncclCommInitRank(&comm_, size(), id, rank()), "ncclCommInitRank");
  }

  ~NcclCommunicator() override {
    if (comm_) {
      c10::cuda::CUDAGuard guard(device_);
      stream_.synchronize();
      ncclCommDestroy(comm_);
    }
  }

  const char* backend_name() const override { return "nccl"; }
  at::Device device() const override { return device_; }

 protected:
  Work submit(Op op) override {
    c10::cuda::CUDAGuard guard(device_);
    if (options().desync_check && is_collective(op.kind)) check_desync(op);
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device_.index());
    at::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(stream_);
    for (const at::Tensor* t : {&op.input, &op.output}) {
      if (t->defined() && t->numel() > 0) {
        c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), stream_);
      }
    }
    {
      c10::cuda::CUDAStreamGuard on_side_stream(stream_);
      launch(op);
    }
    auto done = std::make_shared<at::cuda::CUDAEvent>();
    done->record(stream_);
    Watchdog::instance().start(WatchedOp{rank(), name(), op}, options().timeout,
                               [done] { return done->query(); });
    return Work(std::make_shared<CudaWork>(done, device_));
  }

  std::shared_ptr<Communicator> do_split(Op op, int color, int key, const std::string& name,
                                         CommOptions child_options) override {
    std::shared_ptr<Communicator> child = bootstrap_->split(color, key, name, child_options);
    if (!child) return nullptr;
    return std::make_shared<NcclCommunicator>(std::move(child), device_, name);
  }

 private:
  template <typename Result>
  void check(Result result, const char* call) const {
    if (result == ncclSuccess) return;
    std::string detail = ncclGetErrorString(result);
    if (comm_) {
      const char* last = ncclGetLastError(comm_);
      if (last && *last) detail += std::string(" (") + last + ")";
    }
    fail(std::string(call) + " failed: " + detail);
  }

  void check_desync(const Op& op) {
    const OpSignature mine = OpSignature::of(op);
    at::Tensor all = at::empty({size(), OpSignature::kWords}, at::kLong);
    at::Tensor own = at::from_blob(const_cast<int64_t*>(mine.words.data()), {OpSignature::kWords}, at::kLong);
    bootstrap_->all_gather(all, own.clone()).wait();
    std::vector<OpSignature> by_rank(size());
    for (int r = 0; r < size(); ++r) {
      std::memcpy(by_rank[r].words.data(), all[r].data_ptr(), sizeof(int64_t) * OpSignature::kWords);
    }
    const std::string difference = compare_signatures(by_rank);
    if (!difference.empty()) {
      throw DesyncError(error_prefix() + "desync at collective #" + std::to_string(op.sequence) +
                        ": ranks issued different collectives: " + difference);
    }
  }

  static int64_t row_numel(const at::Tensor& t) {
    return (t.dim() == 0 || t.size(0) == 0) ? 0 : t.numel() / t.size(0);
  }

  void launch(const Op& op) {
    const cudaStream_t s = stream_.stream();
    switch (op.kind) {
      case OpKind::kAllReduce:
        return check(ncclAllReduce(op.input.data_ptr(), op.input.data_ptr(), op.input.numel(),
                                   nccl_type(op.input.scalar_type()), nccl_op(op.reduce), comm_, s),
                     "ncclAllReduce");
      case OpKind::kBroadcast:
        return check(ncclBroadcast(op.input.data_ptr(), op.input.data_ptr(), op.input.numel(),
                                   nccl_type(op.input.scalar_type()), op.peer, comm_, s),
                     "ncclBroadcast");
      case OpKind::kBarrier: {
        at::Tensor one = at::ones({1}, at::TensorOptions().device(device_).dtype(at::kFloat));
        return check(ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclFloat32, ncclSum, comm_, s),
                     "ncclAllReduce (barrier)");
      }
      case OpKind::kReduceScatter: return reduce_scatter_padded(op, s);
      case OpKind::kAllGather: return all_gather_padded(op, s);
      case OpKind::kAllToAll: return all_to_all_grouped(op, s);
      case OpKind::kSend:
        return check(ncclSend(op.input.data_ptr(), op.input.numel(), nccl_type(op.input.scalar_type()), op.peer,
                              comm_, s),
                     "ncclSend");
      case OpKind::kRecv:
        return check(ncclRecv(op.input.data_ptr(), op.input.numel(), nccl_type(op.input.scalar_type()), op.peer,
                              comm_, s),
                     "ncclRecv");
      case OpKind::kSplit: break;
    }
    fail("internal error: launch() got a split");
  }

  void reduce_scatter_padded(const Op& op, cudaStream_t s) {
    const auto& counts = op.input_splits;
    const int64_t per_row = row_numel(op.input);
    const int64_t max_rows = *std::max_element(counts.begin(), counts.end());
    const ncclDataType_t type = nccl_type(op.input.scalar_type());
    if (std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == max_rows; })) {
      return check(ncclReduceScatter(op.input.data_ptr(), op.output.data_ptr(), max_rows * per_row, type,
                                     nccl_op(op.reduce), comm_, s),
                   "ncclReduceScatter");
    }
    at::Tensor padded_in = at::zeros({size() * max_rows * per_row}, op.input.options());
    at::Tensor flat_in = op.input.reshape({-1});
    int64_t offset = 0;
    for (int r = 0; r < size(); ++r) {
      padded_in.narrow(0, r * max_rows * per_row, counts[r] * per_row)
          .copy_(flat_in.narrow(0, offset, counts[r] * per_row));
      offset += counts[r] * per_row;
    }
    at::Tensor padded_out = at::empty({max_rows * per_row}, op.input.options());
    check(ncclReduceScatter(padded_in.data_ptr(), padded_out.data_ptr(), max_rows * per_row, type,
                            nccl_op(op.reduce), comm_, s),
          "ncclReduceScatter");
    op.output.reshape({-1}).copy_(padded_out.narrow(0, 0, counts[rank()] * per_row));
  }

  void all_gather_padded(const Op& op, cudaStream_t s) {
    const auto& counts = op.output_splits;
    const int64_t per_row = row_numel(op.output);
    const int64_t max_rows = *std::max_element(counts.begin(), counts.end());
    const ncclDataType_t type = nccl_type(op.input.scalar_type());
    if (std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == max_rows; })) {
      return check(ncclAllGather(op.input.data_ptr(), op.output.data_ptr(), max_rows * per_row, type, comm_, s),
                   "ncclAllGather");
    }
    at::Tensor padded_in = at::zeros({max_rows * per_row}, op.input.options());
    padded_in.narrow(0, 0, op.input.numel()).copy_(op.input.reshape({-1}));
    at::Tensor padded_out = at::empty({size() * max_rows * per_row}, op.input.options());
    check(ncclAllGather(padded_in.data_ptr(), padded_out.data_ptr(), max_rows * per_row, type, comm_, s),
          "ncclAllGather");
    at::Tensor flat_out = op.output.reshape({-1});
    int64_t offset = 0;
    for (int r = 0; r < size(); ++r) {
      flat_out.narrow(0, offset, counts[r] * per_row).copy_(padded_out.narrow(0, r * max_rows * per_row,
                                                                              counts[r] * per_row));
      offset += counts[r] * per_row;
    }
  }

  void all_to_all_grouped(const Op& op, cudaStream_t s) {
    const int64_t per_row = row_numel(op.input.size(0) ? op.input : op.output);
    const ncclDataType_t type = nccl_type(op.input.scalar_type());
    const int64_t element = op.input.element_size();
    char* in = static_cast<char*>(op.input.data_ptr());
    char* out = static_cast<char*>(op.output.data_ptr());
    check(ncclGroupStart(), "ncclGroupStart");
    int64_t send_offset = 0, recv_offset = 0;
    for (int r = 0; r < size(); ++r) {
      const int64_t send_count = op.input_splits[r] * per_row;
      const int64_t recv_count = op.output_splits[r] * per_row;
      if (send_count) check(ncclSend(in + send_offset * element, send_count, type, r, comm_, s), "ncclSend");
      if (recv_count) check(ncclRecv(out + recv_offset * element, recv_count, type, r, comm_, s), "ncclRecv");
      send_offset += send_count;
      recv_offset += recv_count;
    }
    check(ncclGroupEnd(), "ncclGroupEnd");
  }

  std::shared_ptr<Communicator> bootstrap_;
  at::Device device_;
  c10::cuda::CUDAStream stream_;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

std::shared_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap, at::Device device) {
  if (!bootstrap) throw CommError("make_nccl_communicator: no bootstrap communicator");
  if (bootstrap->device().type() != at::kCPU) {
    throw CommError("rank " + std::to_string(bootstrap->rank()) +
                    ": the NCCL backend bootstraps over a CPU (MPI) communicator, got " + bootstrap->backend_name());
  }
  const std::string name = bootstrap->name();
  return std::make_shared<NcclCommunicator>(std::move(bootstrap), device, name);
}

}  // namespace meshtrain::comm
