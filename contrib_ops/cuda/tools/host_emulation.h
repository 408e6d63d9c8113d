// Host emulation of the few CUDA features the decode-step kernels use, so that their indexing, lane mapping,
// shuffles and launch logic can be checked on a machine without a GPU (tools/emulate_decode.sh). Included before
// a copy of the kernel sources whose launches `K<<<grid, kBlock, 0, stream>>>(params)` were rewritten to
// `EmuLaunch(K, grid, params)`: 128 std::threads run every block of a launch in turn (thread t is threadIdx.x
// = t in each), __shfl_xor_sync meets its warp's 32 threads at a barrier, __syncthreads all 128, and a
// __shared__ variable is a static one (one block runs at a time: the threads meet after each block). The CUDA
// runtime calls of the launchers and the self-check are redirected to host memory. Arithmetic is the host's
// (no FMA contraction: build with -ffp-contract=off); expf/log1pf are glibc's, not CUDA's. Not a substitute
// for running on a GPU: it checks logic, not timing, memory model or CUDA's math library.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <barrier>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#undef __global__
#undef __device__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__
#define __shared__ static
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)

struct EmuWarp {
  float vals[32];
  std::barrier<> bar{32};
};
struct EmuBlock {
  EmuWarp warps[32];
  std::barrier<> bar{128};  // the kernels' block size
};
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local EmuBlock* emu_block = nullptr;

inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __uint_as_float(unsigned int bits) { float f; std::memcpy(&f, &bits, sizeof f); return f; }
inline void __syncthreads() { emu_block->bar.arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int offset) {
  EmuWarp& w = emu_block->warps[threadIdx.x / 32];
  const unsigned lane = threadIdx.x % 32;
  w.vals[lane] = v;
  w.bar.arrive_and_wait();
  const float r = w.vals[lane ^ static_cast<unsigned>(offset)];
  w.bar.arrive_and_wait();
  return r;
}

template <typename P>
void EmuLaunch(void (*kernel)(P), dim3 grid, const P& params) {
  constexpr unsigned kThreads = 128;  // the kernels' block size
  EmuBlock block;
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < kThreads; ++t) {
    // The same 32 threads form warp t / 32 in every block, so a warp's barrier never mixes blocks.
    threads.emplace_back([&, t] {
      threadIdx = {t, 0, 0};
      emu_block = &block;
      for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
          for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = {x, y, z};
            kernel(params);
            block.bar.arrive_and_wait();  // the next block's __shared__ writes wait for this block's reads
          }
    });
  }
  for (auto& th : threads) th.join();
}

// The runtime calls, on host memory.
inline cudaError_t emu_cudaMalloc(void** p, size_t n) { *p = std::aligned_alloc(256, (n + 255) / 256 * 256); return cudaSuccess; }
inline cudaError_t emu_cudaFree(void* p) { std::free(p); return cudaSuccess; }
inline cudaError_t emu_cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t) { std::memcpy(d, s, n); return cudaSuccess; }
inline cudaError_t emu_cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t) { std::memset(d, v, n); return cudaSuccess; }
inline cudaError_t emu_cudaStreamCreate(cudaStream_t* s) { *s = nullptr; return cudaSuccess; }
inline cudaError_t emu_cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
inline cudaError_t emu_cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t emu_cudaGetDeviceCount(int* c) { *c = 1; return cudaSuccess; }
inline cudaError_t emu_cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
inline cudaError_t emu_cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) { *v = 132; return cudaSuccess; }
inline cudaError_t emu_cudaGetLastError() { return cudaSuccess; }
inline const char* emu_cudaGetErrorString(cudaError_t) { return "emu error"; }
#define cudaMalloc emu_cudaMalloc
#define cudaFree emu_cudaFree
#define cudaMemcpyAsync emu_cudaMemcpyAsync
#define cudaMemsetAsync emu_cudaMemsetAsync
#define cudaStreamCreate emu_cudaStreamCreate
#define cudaStreamDestroy emu_cudaStreamDestroy
#define cudaStreamSynchronize emu_cudaStreamSynchronize
#define cudaGetDeviceCount emu_cudaGetDeviceCount
#define cudaGetDevice emu_cudaGetDevice
#define cudaDeviceGetAttribute emu_cudaDeviceGetAttribute
#define cudaGetLastError emu_cudaGetLastError
#define cudaGetErrorString emu_cudaGetErrorString
