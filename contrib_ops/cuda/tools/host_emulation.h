// Host emulation of the CUDA features the decode-step and prefill kernels use, so that their indexing, lane
// mapping, shuffles, tensor-core fragments and launch logic can be checked on a machine without a GPU
// (tools/emulate_decode.sh, tools/emulate_prefill.sh). Included before a copy of the kernel sources whose launches
// `K<<<grid, block, shared_bytes, stream>>>(params)` were rewritten to `EmuLaunch(K, grid, block, shared_bytes,
// params)` (the decode scripts' `EmuLaunch(K, grid, params)`: 128 threads, no dynamic shared memory) and whose
// `extern __shared__` arrays to EmuDynamicShared: one std::thread per CUDA thread of a block runs every block of a
// launch in turn (thread t is threadIdx.x = t in each), the shuffles and tools/host_warp_mma.h's warp-wide
// instructions meet their warp's 32 threads at a barrier, __syncthreads all of the block's, a __shared__ variable is
// a static one and the dynamic shared memory one buffer (one block runs at a time: the threads meet after each
// block), refilled with 0xff bytes (NaN in every float type) before each block so that a read of what the block did
// not write shows. The CUDA runtime calls of the launchers and the self-check are redirected to host memory.
// Arithmetic is the host's (no FMA contraction: build with -ffp-contract=off); expf/log1pf are glibc's, not CUDA's.
// Not a substitute for running on a GPU: it checks logic, not timing, the memory model or CUDA's math library.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
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
#define __launch_bounds__(...)

struct EmuWarp {
  alignas(16) unsigned char slots[32][64];  // each lane's operands of a warp-wide instruction
  std::barrier<> bar{32};
};
struct EmuBlock {
  explicit EmuBlock(unsigned threads, size_t shared_bytes) : bar(threads), shared((shared_bytes + 127) / 128) {}
  EmuWarp warps[32];
  std::barrier<> bar;
  struct alignas(128) Line {
    unsigned char bytes[128];
  };
  std::vector<Line> shared;  // the dynamic shared memory
  // The named barriers (bar.sync id, count), made by their first user with its count; 0 is `bar`.
  std::unique_ptr<std::barrier<>> named[16];
  std::mutex named_mutex;
};
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 gridDim;
inline thread_local EmuBlock* emu_block = nullptr;

inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __uint_as_float(unsigned int bits) { float f; std::memcpy(&f, &bits, sizeof f); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int bits; std::memcpy(&bits, &f, sizeof bits); return bits; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline void __syncthreads() { emu_block->bar.arrive_and_wait(); }
[[noreturn]] inline void __trap() { std::abort(); }
template <typename T>
T __ldg(const T* p) {
  return *p;
}
// Byte i of the result is byte (s >> 4 i) & 7 of the eight bytes y:x (x's the low four).
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const uint64_t bytes = static_cast<uint64_t>(y) << 32 | x;
  unsigned int r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<unsigned int>(bytes >> (8 * ((s >> (4 * i)) & 7)) & 0xffu) << (8 * i);
  return r;
}

template <typename T>
T* EmuDynamicShared() {
  return reinterpret_cast<T*>(emu_block->shared.data());
}

// This thread's warp and lane; its slot of the warp as a T.
inline EmuWarp& EmuThisWarp() { return emu_block->warps[threadIdx.x / 32]; }
inline unsigned EmuLane() { return threadIdx.x % 32; }
// __syncwarp: the warp's 32 threads meet (every kernel emulated here calls it with the full mask).
inline void __syncwarp(unsigned = 0xffffffffu) { EmuThisWarp().bar.arrive_and_wait(); }
template <typename T>
T& EmuSlot(EmuWarp& warp, unsigned lane) {
  static_assert(sizeof(T) <= sizeof warp.slots[0], "a lane's operands fit its slot");
  return *reinterpret_cast<T*>(warp.slots[lane]);
}

// A warp-wide instruction: this lane puts `operands` in its slot, the 32 lanes meet, each computes its result by
// `result(warp, lane)` from every lane's slot, and they meet again before any slot is reused.
template <typename Operands, typename Result>
auto EmuWarpWide(const Operands& operands, Result result) {
  EmuWarp& w = EmuThisWarp();
  const unsigned lane = EmuLane();
  EmuSlot<Operands>(w, lane) = operands;
  w.bar.arrive_and_wait();
  const auto r = result(w, lane);
  w.bar.arrive_and_wait();
  return r;
}

// v of lane `source(lane)` (the lane's own v where that is outside the warp), after all 32 lanes gave theirs.
template <typename T, typename Source>
T EmuShuffle(T v, Source source) {
  return EmuWarpWide(v, [&](EmuWarp& w, unsigned lane) {
    const int from = source(static_cast<int>(lane));
    return from >= 0 && from < 32 ? EmuSlot<T>(w, static_cast<unsigned>(from)) : v;
  });
}
template <typename T>
T __shfl_xor_sync(unsigned, T v, int mask) {
  return EmuShuffle(v, [mask](int lane) { return lane ^ mask; });
}
template <typename T>
T __shfl_up_sync(unsigned, T v, unsigned delta) {
  return EmuShuffle(v, [delta](int lane) { return lane - static_cast<int>(delta); });
}
template <typename T>
T __shfl_sync(unsigned, T v, int source) {
  return EmuShuffle(v, [source](int) { return source % 32; });
}

// The block size of the newest launch (a test's check of which kernel a launcher chose).
inline std::atomic<unsigned> emu_last_block_threads{0};

template <typename... P>
void EmuLaunch(void (*kernel)(P...), dim3 grid, unsigned threads, size_t shared_bytes,
               const std::type_identity_t<P>&... params) {
  emu_last_block_threads = threads;
  EmuBlock block(threads, shared_bytes);
  std::vector<std::thread> workers;
  for (unsigned t = 0; t < threads; ++t) {
    // The same 32 threads form warp t / 32 in every block, so a warp's barrier never mixes blocks.
    workers.emplace_back([&, t] {
      threadIdx = {t, 0, 0};
      gridDim = grid;
      emu_block = &block;
      for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
          for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = {x, y, z};
            if (t == 0) std::memset(block.shared.data(), 0xff, block.shared.size() * sizeof(EmuBlock::Line));
            block.bar.arrive_and_wait();  // the refill before any thread of this block reads
            kernel(params...);
            block.bar.arrive_and_wait();  // the next block's shared writes wait for this block's reads
          }
    });
  }
  for (auto& worker : workers) worker.join();
}
template <typename P>
void EmuLaunch(void (*kernel)(P), dim3 grid, const P& params) {
  EmuLaunch(kernel, grid, 128, 0, params);  // the decode kernels' block size
}

// The runtime calls, on host memory. The device: 132 multiprocessors (an H100's or H200's; MAMBAFUSE_EMU_SMS=N
// makes it N, so that a test's few blocks share out many groups) with 227 KB of shared memory a block, compute
// capability 9.0, and 4 blocks a multiprocessor for any kernel.
inline cudaError_t emu_cudaMalloc(void** p, size_t n) { *p = std::aligned_alloc(256, (n + 255) / 256 * 256); return cudaSuccess; }
inline cudaError_t emu_cudaFree(void* p) { std::free(p); return cudaSuccess; }
inline cudaError_t emu_cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t) { std::memcpy(d, s, n); return cudaSuccess; }
inline cudaError_t emu_cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t) { std::memset(d, v, n); return cudaSuccess; }
inline cudaError_t emu_cudaStreamCreate(cudaStream_t* s) { *s = nullptr; return cudaSuccess; }
inline cudaError_t emu_cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
inline cudaError_t emu_cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t emu_cudaGetDeviceCount(int* c) { *c = 1; return cudaSuccess; }
inline cudaError_t emu_cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
inline cudaError_t emu_cudaDeviceGetAttribute(int* v, cudaDeviceAttr attribute, int) {
  const char* sms = std::getenv("MAMBAFUSE_EMU_SMS");
  switch (attribute) {
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = 227 * 1024; break;
    case cudaDevAttrComputeCapabilityMajor: *v = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *v = 0; break;
    default: *v = sms != nullptr && std::atoi(sms) > 0 ? std::atoi(sms) : 132;
  }
  return cudaSuccess;
}
template <typename Kernel>
cudaError_t emu_cudaFuncSetAttribute(Kernel, cudaFuncAttribute, int) { return cudaSuccess; }
template <typename Kernel>
cudaError_t emu_cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int, size_t) { *blocks = 4; return cudaSuccess; }
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
#define cudaFuncSetAttribute emu_cudaFuncSetAttribute
#define cudaOccupancyMaxActiveBlocksPerMultiprocessor emu_cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define cudaGetLastError emu_cudaGetLastError
#define cudaGetErrorString emu_cudaGetErrorString
