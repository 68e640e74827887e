// The NCCL (GPU) backend. Compiled when libtorch has CUDA and NCCL is found;
// otherwise make_nccl_communicator throws (see nccl_stub.cpp).
#pragma once

#include "meshtrain/comm/communicator.h"

#include <memory>

namespace meshtrain::comm {

// True when this build contains the NCCL backend.
bool nccl_compiled();

// Note [NCCL backend]
// An NCCL communicator spans the ranks of `bootstrap`, a CPU (MPI) communicator
// used to broadcast the ncclUniqueId, to run desync checks and to split. Ops are
// enqueued on one side stream per communicator, ordered after the work already
// queued on the caller's current stream (an event), and their tensors are
// recorded on the side stream so the caching allocator does not reuse them
// early. Work::wait() orders the caller's current stream after the op (it does
// not block the host); completed() queries the op's event. The watchdog polls
// that event. Uneven reduce_scatter / all_gather go through padded buffers;
// all_to_all is a group of ncclSend/ncclRecv; tags are ignored (NCCL orders
// p2p per peer pair). Collective over `bootstrap`.
std::shared_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap, at::Device device);

}  // namespace meshtrain::comm
