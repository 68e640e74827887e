// Host-tier tensors: CPU memory outside the counting allocator, counted as
// the host tier instead.
#pragma once

#include <ATen/ATen.h>

namespace meshtrain::offload {

// NVMe reads and writes with O_DIRECT need buffers, offsets and sizes in
// multiples of this.
constexpr int64_t kIoAlignment = 4096;
int64_t round_up(int64_t bytes, int64_t to = kIoAlignment);

// A zeroed CPU tensor of `numel` elements whose storage is aligned to
// kIoAlignment and padded to a multiple of it (so a whole NVMe region can be
// read into it), counted as the host tier rather than by the counting
// allocator. `pinned`: page-locked through the CUDA host allocator, for
// asynchronous copies to a GPU (needs CUDA).
at::Tensor host_tensor(int64_t numel, at::ScalarType dtype, bool pinned = false);

// Bytes a host_tensor of these elements occupies (aligned and padded).
int64_t host_bytes(int64_t numel, at::ScalarType dtype);

}  // namespace meshtrain::offload
