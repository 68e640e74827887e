#include "meshtrain/comm/backend/nccl/nccl_communicator.h"

namespace meshtrain::comm {

bool nccl_compiled() { return false; }

std::shared_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap, at::Device device) {
  throw CommError("rank " + std::to_string(bootstrap ? bootstrap->rank() : -1) +
                  ": this meshtrain was built without the NCCL backend (libtorch without CUDA, or nccl.h not "
                  "found at configure time); use the MPI backend or rebuild with -DMESHTRAIN_WITH_NCCL=ON");
}

}  // namespace meshtrain::comm
