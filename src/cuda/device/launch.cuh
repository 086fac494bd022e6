// cuda/device/launch.cuh: host launch with dynamic shared memory, and the item grids of the kernels (one-
// dimensional, kv head fastest; persistent grids take items from a counter).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pathattn::cuda {

// Host side: opts the kernel in to `smem` bytes of dynamic shared memory, launches it, and returns the first
// error (the attribute call's or the launch's).
template <class... P, class... A>
inline cudaError_t launch_with_smem(void (*kern)(P...), dim3 grid, int threads, size_t smem, cudaStream_t s,
                                    A... args) {
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e != cudaSuccess) return e;
  kern<<<grid, threads, smem, s>>>(args...);
  return cudaGetLastError();
}

// Grids of (chunk or superblock, kv head) items are one-dimensional with the kv head fastest: the CTAs that run
// side by side then read and write the same tokens' [token][head][...] rows, contiguous in memory, instead of
// one head's rows a whole head row apart. Returns {item, kv head}.
__device__ __forceinline__ int2 item_and_head(int H) { return make_int2(int(blockIdx.x / H), int(blockIdx.x % H)); }

// The next item of a persistent grid whose items are taken in order from a counter (zeroed before the launch):
// offset + the counter's next value. Every thread of the CTA calls it; `slot` is a __shared__ int.
__device__ __forceinline__ int take_item(int* counter, int* slot, int offset) {
  __syncthreads();  // every thread has read the previous item from the slot
  if (threadIdx.x == 0) *slot = offset + atomicAdd(counter, 1);
  __syncthreads();
  return *slot;
}
inline dim3 item_head_grid(int items, int H) { return dim3(unsigned(int64_t(items) * H)); }

}  // namespace pathattn::cuda
