// A communicator for CUDA tensors over a CPU (MPI) one: each op's tensors are
// copied to host memory, the op runs there, and its results are copied back.
#pragma once

#include "meshtrain/comm/communicator.h"

#include <memory>

namespace meshtrain::comm {

// Note [Host-staged communicator]
// NCCL refuses two ranks on one GPU, and a machine may have fewer GPUs than
// ranks, so CUDA tensors can also travel through the host: an op copies its
// CUDA inputs to the host (a synchronous copy, so the kernels that wrote them
// have finished), runs on `host` (an MPI communicator) and copies its outputs
// back to the GPU in Work::wait(). CPU tensors pass straight through, so the
// few host-side scalars the parallelisms exchange need no copies. device() is
// the CUDA device; accepts() takes it and the CPU. Splits split `host` and
// wrap the child. The watchdog and desync check are `host`'s.
std::shared_ptr<Communicator> make_host_staged_communicator(std::shared_ptr<Communicator> host, at::Device device);

// The communicator for tensors on `device` over the ranks of `world` (a CPU
// communicator): `world` itself for the CPU; for CUDA, NCCL when it is compiled,
// there are several ranks and each rank on this node has its own GPU (the
// Runtime's local_size() <= the device count), else host-staged MPI. The environment
// variable MESHTRAIN_COMM_BACKEND = mpi | nccl overrides the choice (nccl
// fails clearly where it cannot work).
std::shared_ptr<Communicator> device_communicator(std::shared_ptr<Communicator> world, at::Device device);

}  // namespace meshtrain::comm
