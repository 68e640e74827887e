#include "meshtrain/comm/backend/mpi/mpi_communicator.h"

#include "meshtrain/comm/backend/mpi/mpi_types.h"
#include "meshtrain/comm/watchdog.h"

#include <algorithm>
#include <climits>
#include <set>

namespace meshtrain::comm {

namespace {

constexpr int kYieldPolls = 64;
constexpr auto kMinBackoff = std::chrono::microseconds(20);
constexpr auto kMaxBackoff = std::chrono::microseconds(500);

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::set<MpiCommunicator*>& registry() {
  static std::set<MpiCommunicator*> live;
  return live;
}

bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

int64_t row_numel(const at::Tensor& t) { return (t.dim() == 0 || t.size(0) == 0) ? 0 : t.numel() / t.size(0); }

// Element counts and displacements for per-rank row counts.
template <typename What>
void counts_and_displacements(const std::vector<int64_t>& rows, int64_t per_row, const What& what,
                              std::vector<int>& counts, std::vector<int>& displs) {
  counts.resize(rows.size());
  displs.resize(rows.size());
  int64_t offset = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    const int64_t count = rows[r] * per_row;
    if (count > INT_MAX || offset > INT_MAX) mpi::to_int_count(std::max(count, offset), what());
    counts[r] = static_cast<int>(count);
    displs[r] = static_cast<int>(offset);
    offset += rows[r] * per_row;
  }
}

bool all_equal(const std::vector<int64_t>& v) {
  return std::all_of(v.begin(), v.end(), [&](int64_t x) { return x == v.front(); });
}

void divide_for_average(const at::Tensor& t, int size) {
  if (at::isFloatingType(t.scalar_type())) t.div_(size);
  else t.div_(size, "trunc");
}

}  // namespace

std::shared_ptr<MpiCommunicator> MpiCommunicator::adopt(MPI_Comm comm, const std::string& name, CommOptions options) {
  if (comm == MPI_COMM_NULL) throw CommError("MpiCommunicator::adopt: MPI_COMM_NULL for '" + name + "'");
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  MPI_Comm_set_name(comm, name.c_str());
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  auto result = std::shared_ptr<MpiCommunicator>(new MpiCommunicator(comm, rank, size, name, options));
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().insert(result.get());
  return result;
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, int rank, int size, const std::string& name, CommOptions options)
    : Communicator(rank, size, name, options), comm_(comm) {
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  if (MPI_Comm_group(comm_, &group) == MPI_SUCCESS && MPI_Comm_group(MPI_COMM_WORLD, &world) == MPI_SUCCESS) {
    std::vector<int> ranks(size), translated(size);
    for (int r = 0; r < size; ++r) ranks[r] = r;
    if (MPI_Group_translate_ranks(group, size, ranks.data(), world, translated.data()) == MPI_SUCCESS) {
      world_ranks_ = std::make_shared<const std::vector<int>>(std::move(translated));
    }
  }
  if (group != MPI_GROUP_NULL) MPI_Group_free(&group);
  if (world != MPI_GROUP_NULL) MPI_Group_free(&world);
}

MpiCommunicator::~MpiCommunicator() {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().erase(this);
  }
  shutdown();
}

void shutdown_all_mpi_communicators() {
  std::vector<MpiCommunicator*> live;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    live.assign(registry().begin(), registry().end());
  }
  for (MpiCommunicator* c : live) c->shutdown();
}

void MpiCommunicator::shutdown() {
  std::thread thread;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) return;
    stopping_ = true;
    stopped_ = true;
    thread.swap(thread_);
  }
  wake_.notify_all();
  if (thread.joinable()) thread.join();
  if (comm_ != MPI_COMM_NULL && !mpi_finalized()) MPI_Comm_free(&comm_);
  comm_ = MPI_COMM_NULL;
}

Work MpiCommunicator::submit(Op op) {
  auto work = std::make_shared<HostWork>(std::vector<at::Tensor>{op.input, op.output});
  return enqueue(Task{std::move(op), std::move(work), {}});
}

Work MpiCommunicator::enqueue(Task task) {
  auto work = task.work;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) fail(task.op.describe() + ": the communicator was shut down");
    queue_.push_back(std::move(task));
    if (!thread_.joinable()) thread_ = std::thread([this] { progress_loop(); });
  }
  wake_.notify_one();
  return Work(work);
}

void MpiCommunicator::progress_loop() {
  int idle_polls = 0;
  auto backoff = kMinBackoff;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    if (!queue_.empty()) {
      Task task = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      run(task);
      poll_p2p();
      idle_polls = 0;
      backoff = kMinBackoff;
      lock.lock();
      continue;
    }
    if (!pending_.empty()) {
      lock.unlock();
      const bool progressed = poll_p2p();
      lock.lock();
      if (progressed || !queue_.empty()) {
        idle_polls = 0;
        backoff = kMinBackoff;
      } else if (++idle_polls < kYieldPolls) {
        lock.unlock();
        std::this_thread::yield();
        lock.lock();
      } else {
        wake_.wait_for(lock, backoff);
        backoff = std::min(backoff * 2, std::chrono::duration_cast<std::chrono::microseconds>(kMaxBackoff));
      }
      continue;
    }
    if (stopping_) break;
    wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
  }
}

void MpiCommunicator::run(Task& task) {
  if (task.op.kind == OpKind::kSend || task.op.kind == OpKind::kRecv) {
    post_p2p(task);
    return;
  }
  const uint64_t token = Watchdog::instance().start(WatchedOp{rank(), name(), task.op, world_ranks_}, options().timeout);
  std::exception_ptr error;
  try {
    if (options().desync_check) check_desync(task.op);
    if (task.body) task.body();
    else execute(task.op);
  } catch (...) {
    error = std::current_exception();
  }
  Watchdog::instance().finish(token);
  // Drop this thread's references before waking the waiter: once wait()
  // returns, the op's tensors are the caller's alone (freed when it lets go,
  // which memory accounting relies on).
  task.op.input = at::Tensor();
  task.op.output = at::Tensor();
  task.body = nullptr;
  task.work->finish(error);
}

void MpiCommunicator::execute(const Op& op) {
  const auto what = [&] { return error_prefix() + op.describe(); };
  const auto prefix = [&] { return what() + ": "; };
  switch (op.kind) {
    case OpKind::kAllReduce: {
      const MPI_Datatype type = mpi::datatype_of(op.input.scalar_type());
      const MPI_Op mop = mpi::op_of(op.reduce, op.input.scalar_type());
      // Large flat buffers are reduced in chunks below MPI's int count limit.
      char* data = static_cast<char*>(op.input.data_ptr());
      const int64_t element = op.input.element_size();
      int64_t remaining = op.input.numel();
      do {
        const int64_t chunk = std::min<int64_t>(remaining, int64_t{1} << 30);
        mpi::check(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(chunk), type, mop, comm_),
                   "MPI_Allreduce", prefix);
        data += chunk * element;
        remaining -= chunk;
      } while (remaining > 0);
      if (op.reduce == ReduceOp::kAvg) divide_for_average(op.input, size());
      return;
    }
    case OpKind::kReduceScatter: {
      const MPI_Datatype type = mpi::datatype_of(op.input.scalar_type());
      const MPI_Op mop = mpi::op_of(op.reduce, op.input.scalar_type());
      std::vector<int> counts, displs;
      counts_and_displacements(op.input_splits, row_numel(op.input), what, counts, displs);
      if (all_equal(op.input_splits)) {
        mpi::check(MPI_Reduce_scatter_block(op.input.data_ptr(), op.output.data_ptr(), counts[0], type, mop, comm_),
                   "MPI_Reduce_scatter_block", prefix);
      } else {
        mpi::check(MPI_Reduce_scatter(op.input.data_ptr(), op.output.data_ptr(), counts.data(), type, mop, comm_),
                   "MPI_Reduce_scatter", prefix);
      }
      if (op.reduce == ReduceOp::kAvg) divide_for_average(op.output, size());
      return;
    }
    case OpKind::kAllGather: {
      const MPI_Datatype type = mpi::datatype_of(op.input.scalar_type());
      std::vector<int> counts, displs;
      counts_and_displacements(op.output_splits, row_numel(op.output), what, counts, displs);
      // In place when the input is this rank's own block of the output.
      const void* own_block = static_cast<const char*>(op.output.data_ptr()) + displs[rank()] * op.output.element_size();
      const void* send = op.input.data_ptr() == own_block ? MPI_IN_PLACE : op.input.data_ptr();
      if (all_equal(op.output_splits)) {
        mpi::check(MPI_Allgather(send, counts[0], type, op.output.data_ptr(), counts[0], type, comm_),
                   "MPI_Allgather", prefix);
      } else {
        mpi::check(MPI_Allgatherv(send, counts[rank()], type, op.output.data_ptr(), counts.data(),
                                  displs.data(), type, comm_),
                   "MPI_Allgatherv", prefix);
      }
      return;
    }
    case OpKind::kBroadcast: {
      const MPI_Datatype type = mpi::datatype_of(op.input.scalar_type());
      char* data = static_cast<char*>(op.input.data_ptr());
      const int64_t element = op.input.element_size();
      int64_t remaining = op.input.numel();
      do {
        const int64_t chunk = std::min<int64_t>(remaining, int64_t{1} << 30);
        mpi::check(MPI_Bcast(data, static_cast<int>(chunk), type, op.peer, comm_), "MPI_Bcast", prefix);
        data += chunk * element;
        remaining -= chunk;
      } while (remaining > 0);
      return;
    }
    case OpKind::kAllToAll: {
      const MPI_Datatype type = mpi::datatype_of(op.input.scalar_type());
      const int64_t per_row = row_numel(op.input.size(0) ? op.input : op.output);
      std::vector<int> send_counts, send_displs, recv_counts, recv_displs;
      counts_and_displacements(op.input_splits, per_row, what, send_counts, send_displs);
      counts_and_displacements(op.output_splits, per_row, what, recv_counts, recv_displs);
      // Always the v-variant: splits are per rank, so a choice made from them
      // (e.g. MPI_Alltoall where they look even) could differ between ranks
      // and pair one rank's MPI_Alltoall with another's MPI_Alltoallv.
      mpi::check(MPI_Alltoallv(op.input.data_ptr(), send_counts.data(), send_displs.data(), type,
                               op.output.data_ptr(), recv_counts.data(), recv_displs.data(), type, comm_),
                 "MPI_Alltoallv", prefix);
      return;
    }
    case OpKind::kBarrier:
      mpi::check(MPI_Barrier(comm_), "MPI_Barrier", prefix);
      return;
    case OpKind::kSend:
    case OpKind::kRecv:
    case OpKind::kSplit:
      break;
  }
  throw CommError(prefix() + "internal error: execute() got an op it does not run");
}

void MpiCommunicator::check_desync(const Op& op) {
  const OpSignature mine = OpSignature::of(op);
  constexpr int kWords = OpSignature::kWords;
  std::vector<int64_t> all(static_cast<size_t>(size()) * kWords);
  mpi::check(MPI_Allgather(mine.words.data(), kWords, MPI_INT64_T, all.data(), kWords, MPI_INT64_T, comm_),
             "MPI_Allgather (desync check)", error_prefix());
  std::vector<OpSignature> by_rank(size());
  for (int r = 0; r < size(); ++r) {
    std::copy_n(all.begin() + static_cast<ptrdiff_t>(r) * kWords, kWords, by_rank[r].words.begin());
  }
  const std::string difference = compare_signatures(by_rank);
  if (difference.empty()) return;
  throw DesyncError(error_prefix() + "desync at collective #" + std::to_string(op.sequence) +
                    ": ranks issued different collectives: " + difference);
}

void MpiCommunicator::post_p2p(Task& task) {
  const Op& op = task.op;
  const auto what = [&] { return error_prefix() + op.describe(); };
  MPI_Request request = MPI_REQUEST_NULL;
  try {
    const MPI_Datatype type = mpi::datatype_of(op.input.scalar_type());
    const int count = op.input.numel() > INT_MAX ? mpi::to_int_count(op.input.numel(), what())
                                                 : static_cast<int>(op.input.numel());
    if (op.kind == OpKind::kSend) {
      mpi::check(MPI_Isend(op.input.data_ptr(), count, type, op.peer, op.tag, comm_, &request), "MPI_Isend",
                 [&] { return what() + ": "; });
    } else {
      mpi::check(MPI_Irecv(op.input.data_ptr(), count, type, op.peer, op.tag, comm_, &request), "MPI_Irecv",
                 [&] { return what() + ": "; });
    }
  } catch (...) {
    task.work->finish(std::current_exception());
    return;
  }
  const uint64_t token = Watchdog::instance().start(WatchedOp{rank(), name(), op, world_ranks_}, options().timeout);
  pending_.push_back(PendingP2p{request, task.work, token, op});
}

bool MpiCommunicator::poll_p2p() {
  if (pending_.empty()) return false;
  std::vector<MPI_Request> requests;
  requests.reserve(pending_.size());
  for (const auto& p : pending_) requests.push_back(p.request);
  std::vector<int> indices(pending_.size());
  std::vector<MPI_Status> statuses(pending_.size());
  int completed = 0;
  const int rc = MPI_Testsome(static_cast<int>(requests.size()), requests.data(), &completed, indices.data(),
                              statuses.data());
  if (completed == MPI_UNDEFINED || completed == 0) {
    if (rc == MPI_SUCCESS) return false;
  }
  std::vector<bool> done(pending_.size(), false);
  for (int i = 0; i < std::max(completed, 0); ++i) {
    const int index = indices[i];
    PendingP2p& p = pending_[index];
    done[index] = true;
    std::exception_ptr error;
    try {
      const std::string what = error_prefix() + p.op.describe() + ": ";
      if (rc == MPI_ERR_IN_STATUS) mpi::check(statuses[i].MPI_ERROR, "MPI_Testsome", what);
      if (p.op.kind == OpKind::kRecv) {
        int received = 0;
        MPI_Get_count(&statuses[i], mpi::datatype_of(p.op.input.scalar_type()), &received);
        if (received != p.op.input.numel()) {
          throw CommError(what + "received " + std::to_string(received) + " elements from rank " +
                          std::to_string(p.op.peer) + " but expected " + std::to_string(p.op.input.numel()));
        }
      }
    } catch (...) {
      error = std::current_exception();
    }
    Watchdog::instance().finish(p.watch_token);
    p.work->finish(error);
  }
  if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) {
    // The call itself failed: fail every pending op rather than spin on it.
    std::exception_ptr error;
    try {
      mpi::check(rc, "MPI_Testsome", error_prefix());
    } catch (...) {
      error = std::current_exception();
    }
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (done[i]) continue;
      Watchdog::instance().finish(pending_[i].watch_token);
      pending_[i].work->finish(error);
      done[i] = true;
    }
  }
  size_t kept = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (done[i]) continue;
    if (kept != i) pending_[kept] = std::move(pending_[i]);
    ++kept;
  }
  pending_.resize(kept);
  return completed > 0;
}

std::shared_ptr<Communicator> MpiCommunicator::do_split(Op op, int color, int key, const std::string& name,
                                                        CommOptions child_options) {
  MPI_Comm child = MPI_COMM_NULL;
  auto work = std::make_shared<HostWork>(std::vector<at::Tensor>{});
  const std::string prefix = error_prefix() + "split into '" + name + "': ";
  Task task{std::move(op), work, [&, this] {
              mpi::check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &child), "MPI_Comm_split",
                         prefix);
            }};
  enqueue(std::move(task)).wait();
  if (color < 0 || child == MPI_COMM_NULL) return nullptr;
  return adopt(child, name, child_options);
}

}  // namespace meshtrain::comm
