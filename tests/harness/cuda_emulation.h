// CUDA's blocks and threads on the CPU, for testing kernels written for both
// (meshtrain/model/fused/kernels_cuda.cuh) on machines without a GPU: each
// block's threads are OS threads that meet at a real barrier, blocks run one
// after another, shared arrays are statics (one block at a time uses them)
// and an atomic add takes a lock. What it cannot show is the GPU's own: the
// memory model between blocks, warps, occupancy, speed.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace meshtrain::test::cuda_emulation {

struct Index {
  int64_t x = 0, y = 0;
};
inline thread_local Index thread_index, block_index;
inline Index grid;

// Every thread of the block waits here until all have arrived.
class Barrier {
 public:
  explicit Barrier(int64_t count) : count_(count) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t generation = generation_;
    if (++arrived_ == count_) {
      arrived_ = 0, ++generation_;
      all_.notify_all();
    } else {
      all_.wait(lock, [&] { return generation_ != generation; });
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable all_;
  int64_t count_, arrived_ = 0, generation_ = 0;
};
inline Barrier* block_barrier = nullptr;
inline std::mutex atomic_mutex;

inline void sync() { block_barrier->wait(); }
inline void atomic_add(float* p, float v) {
  const std::lock_guard<std::mutex> lock(atomic_mutex);
  *p += v;
}

// Runs `body` as a grid of grid_x × grid_y blocks of `threads` threads.
template <typename F>
void launch(int64_t grid_x, int64_t grid_y, int threads, const F& body) {
  grid = {grid_x, grid_y};
  for (int64_t by = 0; by < grid_y; ++by) {
    for (int64_t bx = 0; bx < grid_x; ++bx) {
      Barrier barrier(threads);
      block_barrier = &barrier;
      std::vector<std::thread> block;
      for (int t = 0; t < threads; ++t) {
        block.emplace_back([&, t] {
          thread_index = {t, 0};
          block_index = {bx, by};
          body();
        });
      }
      for (std::thread& thread : block) thread.join();
    }
  }
}

}  // namespace meshtrain::test::cuda_emulation

#define MT_VARIANT emulated
// Blocks of 32 threads (the GPU's are 256): every thread is an OS thread here.
#define MT_THREADS 32
#define MT_GLOBAL inline void
#define MT_DEVICE inline
#define MT_SHARED static
#define MT_SYNC() ::meshtrain::test::cuda_emulation::sync()
#define MT_TID static_cast<int>(::meshtrain::test::cuda_emulation::thread_index.x)
#define MT_BID_X ::meshtrain::test::cuda_emulation::block_index.x
#define MT_BID_Y ::meshtrain::test::cuda_emulation::block_index.y
#define MT_GRID_X ::meshtrain::test::cuda_emulation::grid.x
#define MT_ATOMIC_ADD(p, v) ::meshtrain::test::cuda_emulation::atomic_add((p), (v))
#define MT_LAUNCH(kernel, grid_x, grid_y, ...) \
  ::meshtrain::test::cuda_emulation::launch((grid_x), (grid_y), kThreads, [&] { kernel(__VA_ARGS__); })
