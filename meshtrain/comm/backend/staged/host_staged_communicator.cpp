#include "meshtrain/comm/backend/staged/host_staged_communicator.h"

#include "meshtrain/comm/backend/nccl/nccl_communicator.h"
#include "meshtrain/comm/runtime.h"

#include <torch/cuda.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>

namespace meshtrain::comm {

namespace {

// The inner op's Work; wait() copies the host results back to the GPU once.
class StagedWork final : public WorkImpl {
 public:
  StagedWork(Work host, std::vector<std::pair<at::Tensor, at::Tensor>> copy_back)
      : host_(std::move(host)), copy_back_(std::move(copy_back)) {}

  void wait() override {
    host_.wait();
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [device, host] : copy_back_) device.copy_(host);
    copy_back_.clear();
  }
  bool completed() const override { return host_.completed(); }

 private:
  Work host_;
  std::mutex mutex_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back_;  // (device tensor, its host copy); protected by mutex_
};

class HostStagedCommunicator final : public Communicator {
 public:
  HostStagedCommunicator(std::shared_ptr<Communicator> host, at::Device device)
      : Communicator(host->rank(), host->size(), host->name(), host->options()), host_(std::move(host)), device_(device) {
    if (!device_.is_cuda()) fail("a host-staged communicator is for CUDA tensors, got device " + device_.str());
  }

  const char* backend_name() const override { return "mpi (host-staged)"; }
  at::Device device() const override { return device_; }
  bool accepts(const at::Device& d) const override { return d == device_ || d.is_cpu(); }

 protected:
  Work submit(Op op) override {
    std::vector<std::pair<at::Tensor, at::Tensor>> back;
    // The host copy of an input; of an output written in place, with its copy back.
    auto staged = [&](const at::Tensor& t, bool read, bool written) {
      if (!t.defined() || !t.is_cuda()) return t;
      at::Tensor host = read ? t.to(at::kCPU) : at::empty(t.sizes(), t.options().device(at::kCPU));
      if (written) back.emplace_back(t, host);
      return host;
    };
    Work work;
    switch (op.kind) {
      case OpKind::kAllReduce:
        work = host_->all_reduce(staged(op.input, true, true), op.reduce);
        break;
      case OpKind::kBroadcast:
        work = host_->broadcast(staged(op.input, rank() == op.peer, rank() != op.peer), op.peer);
        break;
      case OpKind::kReduceScatter: {
        const at::Tensor in = staged(op.input, true, false);
        work = host_->reduce_scatter(staged(op.output, false, true), in, op.reduce, op.input_splits);
        break;
      }
      case OpKind::kAllGather: {
        const at::Tensor in = staged(op.input, true, false);
        work = host_->all_gather(staged(op.output, false, true), in, op.output_splits);
        break;
      }
      case OpKind::kAllToAll: {
        const at::Tensor in = staged(op.input, true, false);
        work = host_->all_to_all(staged(op.output, false, true), in, op.output_splits, op.input_splits);
        break;
      }
      case OpKind::kSend: work = host_->send(staged(op.input, true, false), op.peer, op.tag); break;
      case OpKind::kRecv: work = host_->recv(staged(op.input, false, true), op.peer, op.tag); break;
      case OpKind::kBarrier: work = host_->barrier(); break;
      case OpKind::kSplit: fail("internal error: submit() got a split");
    }
    if (back.empty()) return work;
    return Work(std::make_shared<StagedWork>(std::move(work), std::move(back)));
  }

  std::shared_ptr<Communicator> do_split(Op, int color, int key, const std::string& name,
                                         CommOptions child_options) override {
    std::shared_ptr<Communicator> child = host_->split(color, key, name, child_options);
    if (!child) return nullptr;
    return std::make_shared<HostStagedCommunicator>(std::move(child), device_);
  }

 private:
  std::shared_ptr<Communicator> host_;
  at::Device device_;
};

}  // namespace

std::shared_ptr<Communicator> make_host_staged_communicator(std::shared_ptr<Communicator> host, at::Device device) {
  if (!host) throw CommError("make_host_staged_communicator: no host communicator");
  if (!host->device().is_cpu()) {
    throw CommError("rank " + std::to_string(host->rank()) + ": a host-staged communicator needs a CPU communicator, got " +
                    host->backend_name());
  }
  return std::make_shared<HostStagedCommunicator>(std::move(host), device);
}

std::shared_ptr<Communicator> device_communicator(std::shared_ptr<Communicator> world, at::Device device) {
  if (!world) throw CommError("device_communicator: no communicator");
  if (world->device() == device) return world;
  if (device.is_cpu()) {
    throw CommError("rank " + std::to_string(world->rank()) + ": communicator '" + world->name() + "' works on " +
                    world->device().str() + ", not the CPU");
  }
  const char* forced = std::getenv("MESHTRAIN_COMM_BACKEND");
  const std::string choice = forced && *forced ? forced : "auto";
  if (choice != "auto" && choice != "mpi" && choice != "nccl") {
    throw CommError("MESHTRAIN_COMM_BACKEND='" + choice + "': use mpi, nccl or leave it unset");
  }
  const bool gpu_each = node_local_size() <= static_cast<int>(torch::cuda::device_count());
  const bool nccl = choice == "nccl" || (choice == "auto" && nccl_compiled() && world->size() > 1 && gpu_each);
  if (nccl) return make_nccl_communicator(std::move(world), device);
  return make_host_staged_communicator(std::move(world), device);
}

}  // namespace meshtrain::comm
