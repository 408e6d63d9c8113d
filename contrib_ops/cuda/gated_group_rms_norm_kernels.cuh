// GatedGroupRMSNorm CUDA kernels (DESIGN.md §1, §3). For every row and every group of group_size columns:
//
//   h[j]  = f32(Y[j]) * (f32(Z[j]) * sigmoid(f32(Z[j])))
//   nf    = 1 / sqrt(sum_j h[j]^2 / group_size + epsilon)
//   O[j]  = round(out_type, f32(W[col]) * f32(round(norm_type, h[j] * nf)))
//
// Two kernels, chosen per launch on the host:
//   warp path   one warp per (row, group), lanes striding the group; any group_size, any alignment. The
//               first kWarpKept strided elements of each lane stay in registers across the reduction;
//               longer groups recompute h in the second pass (the re-read hits L1/L2).
//   vector path 16-byte loads of Y, Z and W, every h of the group kept in registers across the reduction
//               (one pass over memory). Needs all four pointers 16-byte aligned and group_size % 8 == 0,
//               so that every 8-element chunk starts on a 16-byte boundary for 2-byte types (32 for
//               float). Two instantiations: 4 chunks (32 elements) per thread, or 1 chunk (a quarter of
//               the registers). One to kMaxWarpsPerGroup warps share a group; with more than one, the warps'
//               partial sums meet in shared memory. ChooseCudaLaunch (gated_group_rms_norm_impl.cu) picks
//               the kernel and the warps from measurements (benchmarks/RESULTS.md).
//
// Templates cover the three load types (Y, Z, W: 27 instantiations per kernel). The rounding types (norm, out,
// and the output storage) are a block-uniform switch around the epilogue, so each kernel carries the 15
// epilogues once instead of 405 kernels being compiled (see ForEachEpilogue).
//
// Numerics follow the CPU kernel (contrib_ops/cpu/gated_group_rms_norm_math.cc): expf is CUDA's accurate
// one (2 ulp, no fast-math; __expf's error grows with |z| and breaks the relative budget for z << 0), the
// sigmoid's reciprocal is the hardware one (2 ulp), the group's 1/sqrt is IEEE, conversions round to
// nearest even and keep subnormals (no -ftz). Only the order of the sum of squares differs (FMA and a
// tree over lanes), which moves nf by a few float32 ulp at most.
//
// Reference: Modular MAX's gated group RMSNorm kernel has the same two paths (DESIGN.md §3).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gated_group_rms_norm_kernels.h"

namespace mambafuse {
namespace cuda_kernels {


// --- conversions (exact widening, round-to-nearest-even narrowing) ---------------------------------
__device__ __forceinline__ float Widen(float v) { return v; }
__device__ __forceinline__ float Widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float Widen(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T Narrow(float f);
template <>
__device__ __forceinline__ float Narrow<float>(float f) {
  return f;
}
template <>
__device__ __forceinline__ __half Narrow<__half>(float f) {
  return __float2half_rn(f);
}
template <>
__device__ __forceinline__ __nv_bfloat16 Narrow<__nv_bfloat16>(float f) {
  return __float2bfloat16_rn(f);
}

template <typename T>
__device__ __forceinline__ float RoundThrough(float f) {
  return Widen(Narrow<T>(f));
}

// --- the math --------------------------------------------------------------------------------------
// z * sigmoid(z), with sigmoid(z) = 1/(1+e^-z) for z >= 0 and e^z/(1+e^z) for z < 0: exp of a non-positive
// argument never overflows, so both halves keep full relative accuracy (a fast __expf would not: its error
// grows with |z| and the budget is relative). silu(+Inf) = +Inf, silu(-Inf) = -Inf * 0 = NaN, as the formula.
__device__ __forceinline__ float Silu(float z) {
  const float t = expf(-fabsf(z));
  // The hardware reciprocal (<= 2 ulp on [1, 2]) instead of the correctly rounded one: the IEEE sequence
  // is several times the instructions, and at prefill sizes the kernel is bound by its arithmetic, not its
  // bytes. 2 ulp of the sigmoid is ~1e-7 relative, far inside the float32 budget of 2e-6.
  const float inv = __fdividef(1.f, 1.f + t);
  const float sig = z >= 0.f ? inv : t * inv;
  return z * sig;
}

__device__ __forceinline__ float Gated(float y, float z) { return y * Silu(z); }

// Butterfly sum: every lane ends with the same bits (a + b == b + a at each step).
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}

__device__ __forceinline__ float InvRms(float sum_sq, float group_size, float epsilon) {
  return 1.f / sqrtf(sum_sq / group_size + epsilon);
}

// The epilogue for one element: round to the norm type, multiply by the weight; the caller's Narrow<TStore>
// then rounds to the output type. When ORT widened the output to float (TStore != TOut), the rounding to TOut
// happens here and the store is exact.
template <typename E>
__device__ __forceinline__ float Finish(float h, float inv_rms, float w) {
  const float product = w * RoundThrough<typename E::TNorm>(h * inv_rms);
  if constexpr (std::is_same_v<typename E::TStore, typename E::TOut>) {
    return product;
  } else {
    return RoundThrough<typename E::TOut>(product);
  }
}

template <typename TNorm_, typename TOut_, typename TStore_>
struct Epilogue {
  using TNorm = TNorm_;
  using TOut = TOut_;
  using TStore = TStore_;  // TOut, or float holding the TOut-rounded value (ORT widened the output)
};

// Epilogue index (computed on the host by EpilogueIndex): norm * 5 + {f32, f16, f16 in f32, bf16, bf16 in f32}.
template <typename Fn>
__device__ __forceinline__ void ForEachEpilogue(int index, Fn&& fn) {
  using F = float;
  using H = __half;
  using B = __nv_bfloat16;
  switch (index) {
    case 0: fn(Epilogue<F, F, F>{}); break;
    case 1: fn(Epilogue<F, H, H>{}); break;
    case 2: fn(Epilogue<F, H, F>{}); break;
    case 3: fn(Epilogue<F, B, B>{}); break;
    case 4: fn(Epilogue<F, B, F>{}); break;
    case 5: fn(Epilogue<H, F, F>{}); break;
    case 6: fn(Epilogue<H, H, H>{}); break;
    case 7: fn(Epilogue<H, H, F>{}); break;
    case 8: fn(Epilogue<H, B, B>{}); break;
    case 9: fn(Epilogue<H, B, F>{}); break;
    case 10: fn(Epilogue<B, F, F>{}); break;
    case 11: fn(Epilogue<B, H, H>{}); break;
    case 12: fn(Epilogue<B, H, F>{}); break;
    case 13: fn(Epilogue<B, B, B>{}); break;
    default: fn(Epilogue<B, B, F>{}); break;
  }
}


__device__ __forceinline__ void ItemOffsets(const KernelParams& p, int64_t item, int64_t& offset, int64_t& col) {
  const int64_t row = item / p.groups_per_row;
  col = (item - row * p.groups_per_row) * p.group_size;
  offset = row * p.channels + col;
}

// --- warp path -------------------------------------------------------------------------------------
template <typename TY, typename TZ, typename TW>
__global__ void __launch_bounds__(kWarpBlock) WarpPathKernel(const KernelParams p) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kWarpBlock / kWarpSize);
  const int gs = p.group_size;
  for (int64_t item = (static_cast<int64_t>(blockIdx.x) * kWarpBlock + threadIdx.x) / kWarpSize; item < p.items;
       item += warps) {
    int64_t offset, col;
    ItemOffsets(p, item, offset, col);
    const TY* __restrict__ y = static_cast<const TY*>(p.y) + offset;
    const TZ* __restrict__ z = static_cast<const TZ*>(p.z) + offset;
    float kept[kWarpKept];
    float sum_sq = 0.f;
#pragma unroll
    for (int k = 0; k < kWarpKept; ++k) {
      const int j = lane + k * kWarpSize;
      kept[k] = j < gs ? Gated(Widen(y[j]), Widen(z[j])) : 0.f;
      sum_sq += kept[k] * kept[k];
    }
    for (int j = lane + kWarpKept * kWarpSize; j < gs; j += kWarpSize) {
      const float h = Gated(Widen(y[j]), Widen(z[j]));
      sum_sq += h * h;
    }
    const float inv_rms = InvRms(WarpSum(sum_sq), p.group_size_f, p.epsilon);
    const TW* __restrict__ w = static_cast<const TW*>(p.w) + col;
    ForEachEpilogue(p.epilogue, [&](auto epilogue) {
      using E = decltype(epilogue);
      using TStore = typename E::TStore;
      TStore* __restrict__ out = static_cast<TStore*>(p.out) + offset;
#pragma unroll
      for (int k = 0; k < kWarpKept; ++k) {
        const int j = lane + k * kWarpSize;
        if (j < gs) out[j] = Narrow<TStore>(Finish<E>(kept[k], inv_rms, Widen(w[j])));
      }
      for (int j = lane + kWarpKept * kWarpSize; j < gs; j += kWarpSize) {
        const float h = Gated(Widen(y[j]), Widen(z[j]));
        out[j] = Narrow<TStore>(Finish<E>(h, inv_rms, Widen(w[j])));
      }
    });
  }
}

// --- vector path -----------------------------------------------------------------------------------
// Eight elements of T as loaded: one uint4 for 2-byte types, two for float.
template <typename T>
struct Chunk {
  static constexpr int kWords = static_cast<int>(sizeof(T)) / 2;
  uint4 v[kWords];
};

template <typename T>
__device__ __forceinline__ Chunk<T> LoadChunk(const T* __restrict__ p) {
  Chunk<T> c;
  const uint4* src = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < Chunk<T>::kWords; ++i) c.v[i] = __ldg(src + i);
  return c;
}

__device__ __forceinline__ uint32_t Word(const uint4& v, int k) {
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// Element e (a compile-time constant after unrolling) of a chunk, widened to float.
__device__ __forceinline__ float Element(const Chunk<float>& c, int e) {
  return __uint_as_float(Word(c.v[e / 4], e % 4));
}
__device__ __forceinline__ float Element(const Chunk<__half>& c, int e) {
  const uint32_t word = Word(c.v[0], e / 2);
  return __half2float(__ushort_as_half(static_cast<unsigned short>(e % 2 ? word >> 16 : word & 0xFFFFu)));
}
__device__ __forceinline__ float Element(const Chunk<__nv_bfloat16>& c, int e) {
  const uint32_t word = Word(c.v[0], e / 2);
  return __uint_as_float(e % 2 ? word & 0xFFFF0000u : word << 16);  // bf16 -> f32 is a shift, exact
}

__device__ __forceinline__ uint32_t Bits16(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ uint32_t Bits16(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

// Stores 8 values (already rounded to the output type) as T with 16-byte stores.
template <typename T>
__device__ __forceinline__ void StoreChunk(T* __restrict__ p, const float (&v)[kVec]) {
  uint4 packed;
  packed.x = Bits16(Narrow<T>(v[0])) | (Bits16(Narrow<T>(v[1])) << 16);
  packed.y = Bits16(Narrow<T>(v[2])) | (Bits16(Narrow<T>(v[3])) << 16);
  packed.z = Bits16(Narrow<T>(v[4])) | (Bits16(Narrow<T>(v[5])) << 16);
  packed.w = Bits16(Narrow<T>(v[6])) | (Bits16(Narrow<T>(v[7])) << 16);
  *reinterpret_cast<uint4*>(p) = packed;
}
template <>
__device__ __forceinline__ void StoreChunk<float>(float* __restrict__ p, const float (&v)[kVec]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// One group per warps_per_group warps. With one warp per group a block holds 4 groups and needs no barrier;
// with several, a block is exactly one group, so every thread of the block takes the same trips through the
// item loop and the barriers are uniform.
// kChunks: chunks per thread held in registers (kMaxChunks, or 1: a quarter of the registers, so four times
// the resident warps to overlap one group's arithmetic with another's loads).
template <typename TY, typename TZ, typename TW, int kChunks>
__global__ void __launch_bounds__(kVectorBlockMax) VectorPathKernel(const KernelParams p) {
  __shared__ float warp_sums[kMaxWarpsPerGroup];
  const int threads_per_group = p.warps_per_group * kWarpSize;
  const int groups_per_block = static_cast<int>(blockDim.x) / threads_per_group;
  const int thread = static_cast<int>(threadIdx.x) % threads_per_group;
  const int chunks = p.group_size / kVec;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * groups_per_block + threadIdx.x / threads_per_group;
       item < p.items; item += static_cast<int64_t>(gridDim.x) * groups_per_block) {
    int64_t offset, col;
    ItemOffsets(p, item, offset, col);
    const TY* __restrict__ y = static_cast<const TY*>(p.y) + offset;
    const TZ* __restrict__ z = static_cast<const TZ*>(p.z) + offset;
    const TW* __restrict__ w = static_cast<const TW*>(p.w) + col;
    // Chunk c of this thread is chunk (thread + c * threads_per_group) of the group: neighbouring threads
    // read neighbouring 16 bytes. All loads (W too) are issued before the first use.
    Chunk<TY> y_chunk[kChunks];
    Chunk<TZ> z_chunk[kChunks];
    Chunk<TW> w_chunk[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int chunk = thread + c * threads_per_group;
      if (chunk < chunks) {
        y_chunk[c] = LoadChunk(y + chunk * kVec);
        z_chunk[c] = LoadChunk(z + chunk * kVec);
        w_chunk[c] = LoadChunk(w + chunk * kVec);
      }
    }
    float h[kChunks][kVec];
    float sum_sq = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const bool valid = thread + c * threads_per_group < chunks;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        h[c][e] = valid ? Gated(Element(y_chunk[c], e), Element(z_chunk[c], e)) : 0.f;
        sum_sq += h[c][e] * h[c][e];
      }
    }
    sum_sq = WarpSum(sum_sq);
    if (p.warps_per_group > 1) {
      if (thread % kWarpSize == 0) warp_sums[thread / kWarpSize] = sum_sq;
      __syncthreads();
      sum_sq = 0.f;
      for (int i = 0; i < p.warps_per_group; ++i) sum_sq += warp_sums[i];  // same order in every thread
      __syncthreads();  // warp_sums is rewritten by the next item
    }
    const float inv_rms = InvRms(sum_sq, p.group_size_f, p.epsilon);
    ForEachEpilogue(p.epilogue, [&](auto epilogue) {
      using E = decltype(epilogue);
      using TStore = typename E::TStore;
      TStore* __restrict__ out = static_cast<TStore*>(p.out) + offset;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int chunk = thread + c * threads_per_group;
        if (chunk < chunks) {
          float result[kVec];
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            result[e] = Finish<E>(h[c][e], inv_rms, Element(w_chunk[c], e));
          }
          StoreChunk(out + chunk * kVec, result);
        }
      }
    });
  }
}

// --- launch of one (Y, Z, W) instantiation ------------------------------------------------------
template <typename TY, typename TZ, typename TW>
void LaunchTyped(const KernelParams& params, const CudaLaunch& launch, int multiprocessors, cudaStream_t stream) {
  if (launch.path == CudaPath::kVector) {
    const int block = launch.warps_per_group == 1 ? kVectorBlockOneWarp : launch.warps_per_group * kWarpSize;
    const int64_t groups_per_block = block / (launch.warps_per_group * kWarpSize);
    const int64_t wanted = (params.items + groups_per_block - 1) / groups_per_block;
    const int64_t resident = static_cast<int64_t>(multiprocessors) * (2048 / block);  // one wave at full occupancy
    const unsigned grid = static_cast<unsigned>(wanted < resident ? wanted : resident);
    if (launch.chunks_per_thread == 1) {
      VectorPathKernel<TY, TZ, TW, 1><<<grid, block, 0, stream>>>(params);
    } else {
      VectorPathKernel<TY, TZ, TW, kMaxChunks><<<grid, block, 0, stream>>>(params);
    }
  } else {
    const int64_t per_block = kWarpBlock / kWarpSize;
    const int64_t wanted = (params.items + per_block - 1) / per_block;
    const int64_t resident = static_cast<int64_t>(multiprocessors) * (2048 / kWarpBlock);
    const unsigned grid = static_cast<unsigned>(wanted < resident ? wanted : resident);
    WarpPathKernel<TY, TZ, TW><<<grid, kWarpBlock, 0, stream>>>(params);
  }
}

}  // namespace cuda_kernels
}  // namespace mambafuse

// Explicit instantiations for one Y type (the including .cu defines MAMBAFUSE_Y_TYPE): 9 per file, so that
// the three files compile in parallel.
#if defined(MAMBAFUSE_Y_TYPE)
#define MAMBAFUSE_INSTANTIATE(TZ, TW)                                                                    \
  template void mambafuse::cuda_kernels::LaunchTyped<MAMBAFUSE_Y_TYPE, TZ, TW>(const KernelParams&, \
                                                                               const CudaLaunch&, int, cudaStream_t);
MAMBAFUSE_INSTANTIATE(float, float)
MAMBAFUSE_INSTANTIATE(float, __half)
MAMBAFUSE_INSTANTIATE(float, __nv_bfloat16)
MAMBAFUSE_INSTANTIATE(__half, float)
MAMBAFUSE_INSTANTIATE(__half, __half)
MAMBAFUSE_INSTANTIATE(__half, __nv_bfloat16)
MAMBAFUSE_INSTANTIATE(__nv_bfloat16, float)
MAMBAFUSE_INSTANTIATE(__nv_bfloat16, __half)
MAMBAFUSE_INSTANTIATE(__nv_bfloat16, __nv_bfloat16)
#undef MAMBAFUSE_INSTANTIATE
#endif
