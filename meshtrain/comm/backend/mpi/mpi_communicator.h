// MpiCommunicator: the CPU backend. See Note [MPI progress thread].
#pragma once

#include "meshtrain/comm/communicator.h"

#include <mpi.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace meshtrain::comm {

// Note [MPI progress thread]
// Each MpiCommunicator owns one progress thread, started by its first op, that
// takes ops from a FIFO queue in issue order. Collectives run as the blocking
// MPI calls (so they use the same algorithms as a plain MPI program), which
// requires MPI_THREAD_MULTIPLE since communicators progress concurrently.
// Point-to-point ops are posted non-blocking (MPI_Isend/MPI_Irecv) and then
// tested between queued ops, so a send and a receive issued on one communicator
// can never block each other; while only p2p ops are pending, the thread polls
// with a short exponential back-off so it does not steal a core from compute.
// Every op is registered with the watchdog while it runs (Note [Watchdog]).
class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm`, which must be a valid communicator on this rank.
  static std::shared_ptr<MpiCommunicator> adopt(MPI_Comm comm, const std::string& name, CommOptions options);
  ~MpiCommunicator() override;

  const char* backend_name() const override { return "mpi"; }
  at::Device device() const override { return at::Device(at::kCPU); }
  MPI_Comm handle() const { return comm_; }

  // Lets queued ops finish, stops the progress thread and frees the MPI
  // communicator; later ops fail. Idempotent. The runtime calls it on every live
  // MPI communicator before MPI_Finalize.
  void shutdown();

 protected:
  Work submit(Op op) override;
  std::shared_ptr<Communicator> do_split(Op op, int color, int key, const std::string& name,
                                         CommOptions child_options) override;

 private:
  MpiCommunicator(MPI_Comm comm, int rank, int size, const std::string& name, CommOptions options);

  struct Task {
    Op op;
    std::shared_ptr<HostWork> work;
    std::function<void()> body;  // replaces execute(op) when set (split)
  };
  struct PendingP2p {
    MPI_Request request;
    std::shared_ptr<HostWork> work;
    uint64_t watch_token;
    Op op;
  };

  Work enqueue(Task task);
  void progress_loop();
  void run(Task& task);
  void execute(const Op& op);
  void check_desync(const Op& op);
  void post_p2p(Task& task);
  bool poll_p2p();  // true when some pending p2p op completed

  MPI_Comm comm_;
  std::shared_ptr<const std::vector<int>> world_ranks_;  // of each rank of comm_ (Note [Naming the stuck peer])

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Task> queue_;  // State below is protected by mutex_.
  bool stopping_ = false;
  bool stopped_ = false;
  std::thread thread_;

  std::vector<PendingP2p> pending_;  // touched only by the progress thread
};

// Shuts down every live MpiCommunicator (Runtime calls this before MPI_Finalize).
void shutdown_all_mpi_communicators();

}  // namespace meshtrain::comm
