// The PTX instructions of the int4 GEMV kernels (decode_matmul_nbits_impl.cu), one inline function each: the
// tensor-core product (mma.sync m16n8k16), one LOP3, an L2 prefetch, and on SM 90 the mbarriers, bulk copies and
// fences of the bulk-copy kernel and its lanes' named barriers. tools/host_gemv_ptx.h gives the same functions on the
// host, where tools/emulate_gemv.sh builds the kernels without a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

// 1 where the bulk-copy kernel's instructions exist (device code for SM 90 and newer); its body is a trap elsewhere.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MAMBAFUSE_BULK_COPY_ARCH 1
#else
#define MAMBAFUSE_BULK_COPY_ARCH 0
#endif

namespace mambafuse {

// mma.sync m16n8k16, float16 or bfloat16 operands, float32 accumulation: d += a·b, with the fragments of
// warp_mma.cuh's MmaHalf.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// (a & mask) | bits, one LOP3.
__device__ __forceinline__ uint32_t MaskOr(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(mask), "r"(bits));
  return r;
}

__device__ __forceinline__ void PrefetchL2(const void* address) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(address));
}

// The shared-state-space address of a pointer into shared memory, as the instructions below take it.
__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// An mbarrier at `bar` expecting `count` arrivals a phase.
__device__ __forceinline__ void MbarrierInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

// The mbarriers' initialization made visible to the copy engine (the async proxy) and the other threads.
__device__ __forceinline__ void FenceMbarrierInit() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// This thread's generic-proxy accesses of shared memory ordered before the async proxy's (a bulk copy's writes).
__device__ __forceinline__ void FenceProxyAsync() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// One arrival on the mbarrier at `bar` that also raises the bytes its phase waits for by `bytes`.
__device__ __forceinline__ void MbarrierArriveExpectTx(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// One arrival on the mbarrier at `bar`.
__device__ __forceinline__ void MbarrierArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Waits for the phase `parity` of the mbarrier at shared address `bar` to complete.
__device__ __forceinline__ void WaitParity(uint32_t bar, uint32_t parity) {
  uint32_t ready = 0;
  do {
    asm volatile(
        "{ .reg .pred done; mbarrier.try_wait.parity.shared::cta.b64 done, [%1], %2; selp.u32 %0, 1, 0, done; }"
        : "=r"(ready)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!ready);
}

// The copy engine copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` to shared
// `dst` and counts them in on the mbarrier at `bar`.
__device__ __forceinline__ void BulkCopyToShared(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// bar.sync id, threads: a barrier of `threads` threads (whole warps, each reaching it from the same instruction).
__device__ __forceinline__ void BarSyncAligned(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace mambafuse
