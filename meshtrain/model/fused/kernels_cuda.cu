// The fused kernels for a GPU (kernels_cuda.cuh, Note [Fused CUDA kernels]),
// compiled by the CUDA compiler where the build asks for them
// (-DMESHTRAIN_CUDA_KERNELS=ON). Each launches on ATen's current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#define MT_VARIANT cuda
#define MT_THREADS 256
#define MT_GLOBAL __global__ void __launch_bounds__(MT_THREADS)
#define MT_DEVICE __device__ __forceinline__
#define MT_SHARED __shared__
#define MT_SYNC() __syncthreads()
#define MT_TID static_cast<int>(threadIdx.x)
#define MT_BID_X static_cast<int64_t>(blockIdx.x)
#define MT_BID_Y static_cast<int64_t>(blockIdx.y)
#define MT_GRID_X static_cast<int64_t>(gridDim.x)
#define MT_ATOMIC_ADD(p, v) atomicAdd((p), (v))
#define MT_LAUNCH(kernel, grid_x, grid_y, ...)                                                       \
  do {                                                                                               \
    kernel<<<dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y)), kThreads, 0,        \
             at::cuda::getCurrentCUDAStream()>>>(__VA_ARGS__);                                       \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                                  \
  } while (0)

#include "meshtrain/model/fused/kernels_cuda.cuh"

namespace meshtrain::model::fused::kernel {
const Table cuda_table = gpu::cuda::make_gpu_table();
}  // namespace meshtrain::model::fused::kernel
