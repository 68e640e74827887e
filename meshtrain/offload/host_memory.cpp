#include "meshtrain/offload/host_memory.h"

#include "meshtrain/offload/tier.h"

#include <c10/core/CPUAllocator.h>

#include <cstdlib>
#include <cstring>
#include <new>

namespace meshtrain::offload {

int64_t round_up(int64_t bytes, int64_t to) { return (bytes + to - 1) / to * to; }

int64_t host_bytes(int64_t numel, at::ScalarType dtype) {
  return round_up(std::max<int64_t>(numel, 1) * static_cast<int64_t>(c10::elementSize(dtype)));
}

at::Tensor host_tensor(int64_t numel, at::ScalarType dtype, bool pinned) {
  const int64_t bytes = host_bytes(numel, dtype);
  if (pinned) {
    // The CUDA host allocator's blocks are page aligned; the tensor keeps its block alive.
    at::Tensor block = at::empty({bytes}, at::TensorOptions(at::kByte).pinned_memory(true));
    count_resident(Tier::kHost, bytes);
    return at::from_blob(
        block.data_ptr(), {numel},
        [block, bytes](void*) mutable {
          block = at::Tensor();
          count_resident(Tier::kHost, -bytes);
        },
        at::TensorOptions(dtype));
  }
  void* data = std::aligned_alloc(kIoAlignment, static_cast<size_t>(bytes));
  if (data == nullptr) throw std::bad_alloc();
  std::memset(data, 0, static_cast<size_t>(bytes));
  count_resident(Tier::kHost, bytes);
  return at::from_blob(
      data, {numel},
      [bytes](void* p) {
        std::free(p);
        count_resident(Tier::kHost, -bytes);
      },
      at::TensorOptions(dtype));
}

}  // namespace meshtrain::offload
