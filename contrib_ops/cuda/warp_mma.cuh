// The PTX instructions of the chunked MambaChunkScan kernels, one inline function each: the tensor-core products
// (mma.sync m16n8k8 TF32, m16n8k16 float16 / bfloat16), the shared-memory matrix loads (ldmatrix x4, plain and
// .trans), the named barriers (barrier.sync) and the asynchronous copies (cp.async). tools/host_warp_mma.h gives the
// same functions on the host, where tools/emulate_prefill.sh builds the kernels without a GPU; the fragment layouts
// here are the ones it follows.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace mambafuse {

// mma.sync m16n8k8 TF32 (sm_80 and later), d += a·b. The fragments of lane (g = lane / 4, t = lane % 4), from the
// PTX ISA: A (16 × 8, row) a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]; B (8 × 8, column)
// b0 = B[t][g], b1 = B[t+4][g]; D (16 × 8) d0, d1 = D[g][2t, 2t+1], d2, d3 = D[g+8][2t, 2t+1]. The tensor core reads
// a .tf32 operand's top 19 bits (the low 13 are ignored).
__device__ __forceinline__ void MmaTf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// mma.sync m16n8k16 with float16 or bfloat16 operands (T's values as they are: exact products) and float32
// accumulation. Fragments of lane (g, t): A a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 and a3 the same at k + 8;
// B b0 = B[2t, 2t+1][g], b1 the same at k + 8 (the lower k in the low half); D as in MmaTf32.
template <typename T>
__device__ __forceinline__ void MmaHalf(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Four 8 × 8 blocks of 16-bit values (8 × 4 of 32 bits) from shared memory with one ldmatrix: lane i gives the
// 16-byte-aligned address of row i % 8 of block i / 8, and receives word lane % 4 of row lane / 4 of block j in r[j]
// (the elements [lane / 4][2·(lane % 4), +1] of 16-bit block j, the lower column in the low half).
__device__ __forceinline__ void LoadMatrixX4(uint32_t (&r)[4], const void* row_address) {
  const auto address = static_cast<unsigned>(__cvta_generic_to_shared(row_address));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// The same with .trans: lane i gives the address of row i % 8 of block i / 8, and receives in r[j] the 16-bit elements
// [2·(lane % 4)][lane / 4] and [2·(lane % 4) + 1][lane / 4] of block j (the lower row in the low half): two rows of
// one column, a B fragment of m16n8k16 from a row-major K × N block, or a TF32 pair whose k order is 2t, 2t + 1.
__device__ __forceinline__ void LoadMatrixX4Trans(uint32_t (&r)[4], const void* row_address) {
  const auto address = static_cast<unsigned>(__cvta_generic_to_shared(row_address));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// A barrier of `threads` threads (whole warps) under the id `id` (0 to 15), with the memory ordering of
// __syncthreads among them. barrier.sync without .aligned: its threads may reach it from different instructions, as
// the roles of a warp-specialized kernel do (__syncthreads and bar.sync are .aligned: one instruction for the whole
// block, which compute-sanitizer's synccheck holds them to).
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// cp.async of 16 bytes from global to shared memory (sm_80 and later), and the waits on them.
__device__ __forceinline__ void CopyAsync16(void* shared, const void* global) {
  const auto address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global));
}
__device__ __forceinline__ void CopyAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void CopyAsyncWaitAll() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// Waits until at most kPending of this thread's newest committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CopyAsyncWaitGroup() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace mambafuse
