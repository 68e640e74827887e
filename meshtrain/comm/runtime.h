// Runtime: brings MPI up and down around a program and hands out the world
// communicator, this process's local rank and its default device.
#pragma once

#include "meshtrain/comm/communicator.h"

#include <ATen/ATen.h>

#include <memory>
#include <string>

namespace meshtrain::comm {

// Create one Runtime near the top of main and keep it for the program's life.
// Launch under mpirun/srun, or run plainly for a single rank.
class Runtime {
 public:
  // Initialises MPI with MPI_THREAD_MULTIPLE (or adopts an MPI already
  // initialised that way) and creates the world communicator, a duplicate of
  // MPI_COMM_WORLD named "world". Installs a watchdog abort handler that ends
  // the whole job. Throws if MPI lacks thread support or a Runtime exists.
  Runtime(int* argc, char*** argv, CommOptions options = CommOptions::from_env());
  // Shuts down every MPI communicator, then finalises MPI if this Runtime
  // initialised it.
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  const std::shared_ptr<Communicator>& world() const { return world_; }
  int rank() const { return world_->rank(); }
  int size() const { return world_->size(); }
  // The rank among processes on this node: torchrun's LOCAL_RANK when set,
  // otherwise computed with MPI (shared-memory split of the world).
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  // cuda:(local_rank % device count) when CUDA devices are visible, else cpu.
  at::Device default_device() const;

  // Prints "meshtrain: rank R: <message>" to stderr and ends every rank of the
  // job with exit status `code`.
  [[noreturn]] void abort(int code, const std::string& message) const;

 private:
  bool owns_mpi_ = false;
  int local_rank_ = 0;
  int local_size_ = 1;
  std::shared_ptr<Communicator> world_;
};

// cuda:(local_rank % device count) when CUDA devices are visible, else cpu.
at::Device device_for_local_rank(int local_rank);

// The live Runtime's local_size() and local_rank(), or 1 and 0 when there is none.
int node_local_size();
int node_local_rank();

}  // namespace meshtrain::comm
