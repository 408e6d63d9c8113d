// GatedGroupRMSNorm CUDA kernels (docs/op.md, §3). For every row and every group of group_size columns:
//
//   h[j]  = round(gated_type, f32(Y[j]) * (f32(Z[j]) * sigmoid(f32(Z[j]))))   (gated_type float: no rounding)
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
//               float). Three instantiations: 1, 2 or 4 chunks (8, 16, 32 elements) per thread, W loaded
//               with Y and Z at one chunk, after the gate pass otherwise (registers: 40 / 64 / 128 for fp16).
//               One to kMaxWarpsPerGroup warps share a group; with more than one, the warps'
//               partial sums meet in shared memory. ChooseCudaLaunch (gated_group_rms_norm_impl.cu) picks
//               the kernel and the warps from measurements (benchmarks/RESULTS.md). Item indices are 32-bit
//               and split into (row, group) by a multiply and a shift (FastDivisor), not a division: at
//               decode the whole kernel is one dependent chain, and the integer divisions it had before
//               the first load cost ~150 instructions of it.
//
// Templates cover the three load types (Y, Z, W: 27 instantiations per kernel). The rounding types (norm, out,
// and the output storage) are a block-uniform switch around the epilogue, so each kernel carries the 15
// epilogues once instead of 405 kernels being compiled (see ForEachEpilogue); the gated_dtype rounding is a
// block-uniform switch of three cases in the gate pass (RoundGated). The exporters' forms (uniform types, and
// the half prefill form B) also get kernels with their one epilogue and no gated switch (kFixedEpilogue): 15
// more, 123 in all.
//
// Numerics follow the CPU kernel (contrib_ops/cpu/gated_group_rms_norm_math.cc): expf is CUDA's accurate
// one (2 ulp, no fast-math; __expf's error grows with |z| and breaks the relative budget for z << 0), the
// sigmoid's reciprocal is the hardware one (1 ulp), the group's 1/sqrt is IEEE on the warp path and the
// hardware rsqrt with one Newton step on the vector path (FastInvRms, ~1 ulp), conversions round to
// nearest even and keep subnormals (no -ftz). Only the order of the sum of squares differs (FMA and a
// tree over lanes), which moves nf by a few float32 ulp at most. Where the weight, the norm type and the
// output are one half type, the weight multiply is a packed half multiply (HMUL2): the float32 product of
// two half values is exact (11 + 11 or 8 + 8 significant bits), so its one rounding to the half type is
// the correctly rounded half product, bit for bit.
//
// Reference: Modular MAX's gated group RMSNorm kernel has the same two paths.
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
  const float t = expf(-fabsf(z));  // 8 instructions, one MUFU.EX2: the saturating reduction needs no checks
  // The hardware reciprocal (1 ulp; rcp.approx) of 1 + t in [1, 2]: no range checks needed there, where
  // __fdividef adds three. 1 ulp of the sigmoid is ~6e-8 relative, far inside the float32 budget of 2e-6.
  float inv;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(inv) : "f"(1.f + t));
  return (z >= 0.f ? z : z * t) * inv;
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

// The vector path's 1/sqrt(sum_sq / group_size + epsilon): a multiply by 1/group_size (host-computed), the
// hardware reciprocal square root and one Newton step (within ~1 float32 ulp of the IEEE sequence, which
// is a division, a square root and a reciprocal with their range checks: ~100 cycles on the decode path).
// Inf (a group holding Inf) keeps rsqrt's 0 and NaN stays NaN, as with the IEEE sequence; 0 (epsilon 0 and
// a zero group) keeps +Inf.
__device__ __forceinline__ float FastInvRms(float sum_sq, float inv_group_size, float epsilon) {
  const float x = fmaf(sum_sq, inv_group_size, epsilon);
  const float r = rsqrtf(x);
  const float refined = r * fmaf(-0.5f * x * r, r, 1.5f);
  return x > 0.f && x < INFINITY ? refined : r;
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
template <int kIndex>
struct EpilogueOf {
  using N = std::conditional_t<kIndex / 5 == 0, float, std::conditional_t<kIndex / 5 == 1, __half, __nv_bfloat16>>;
  static constexpr int kOut = kIndex % 5;
  using O = std::conditional_t<kOut == 0, float, std::conditional_t<kOut <= 2, __half, __nv_bfloat16>>;
  using S = std::conditional_t<kOut == 0 || kOut == 2 || kOut == 4, float, O>;
  using type = Epilogue<N, O, S>;
};

// Calls fn(Epilogue<...>{}) for the block-uniform runtime index; kFixed >= 0 compiles that one epilogue alone
// (the specialized kernels of the exporters' forms: a short kernel, see VectorPathKernel and LaunchTyped).
template <int kFixed = -1, typename Fn>
__device__ __forceinline__ void ForEachEpilogue(int index, Fn&& fn) {
  if constexpr (kFixed >= 0) {
    fn(typename EpilogueOf<kFixed>::type{});
  } else {
    switch (index) {
      case 0: fn(typename EpilogueOf<0>::type{}); break;
      case 1: fn(typename EpilogueOf<1>::type{}); break;
      case 2: fn(typename EpilogueOf<2>::type{}); break;
      case 3: fn(typename EpilogueOf<3>::type{}); break;
      case 4: fn(typename EpilogueOf<4>::type{}); break;
      case 5: fn(typename EpilogueOf<5>::type{}); break;
      case 6: fn(typename EpilogueOf<6>::type{}); break;
      case 7: fn(typename EpilogueOf<7>::type{}); break;
      case 8: fn(typename EpilogueOf<8>::type{}); break;
      case 9: fn(typename EpilogueOf<9>::type{}); break;
      case 10: fn(typename EpilogueOf<10>::type{}); break;
      case 11: fn(typename EpilogueOf<11>::type{}); break;
      case 12: fn(typename EpilogueOf<12>::type{}); break;
      case 13: fn(typename EpilogueOf<13>::type{}); break;
      default: fn(typename EpilogueOf<14>::type{}); break;
    }
  }
}

// The epilogue index of the uniform-type form (Y, Z, W, norm, output and storage all T): what the specialized
// kernels compile alone.
template <typename T>
constexpr int kUniformEpilogue = std::is_same_v<T, float> ? 0 : std::is_same_v<T, __half> ? 6 : 13;

// Rounding point of the gated product (gated_dtype): 0 none, 1 float16, 2 bfloat16; `gated` is uniform.
__device__ __forceinline__ float RoundGated(float h, int gated) {
  if (gated == 1) return RoundThrough<__half>(h);
  if (gated == 2) return RoundThrough<__nv_bfloat16>(h);
  return h;
}

// x = quotient * groups_per_row + remainder for 0 <= x < 2^31 (KernelParams::row_multiplier, FastDivisor).
struct FastQuotient {
  uint32_t quotient, remainder;
  __device__ __forceinline__ FastQuotient(uint32_t x, const KernelParams& p)
      : quotient(static_cast<uint32_t>((static_cast<uint64_t>(x) * p.row_multiplier) >> p.row_shift)),
        remainder(x - quotient * static_cast<uint32_t>(p.groups_per_row)) {}
};

// --- warp path -------------------------------------------------------------------------------------
template <typename TY, typename TZ, typename TW>
__global__ void __launch_bounds__(kWarpBlock) WarpPathKernel(const KernelParams p) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int gs = p.group_size;
  // The item loop steps by the grid's warp count (one wave: < 2^31). Row and group advance by the step's
  // quotient and remainder, so that the loop divides nothing, whatever the item count (int64).
  const uint32_t first = (blockIdx.x * kWarpBlock + threadIdx.x) / kWarpSize;
  const uint32_t step = gridDim.x * (kWarpBlock / kWarpSize);
  const FastQuotient first_split(first, p), step_split(step, p);
  int64_t row = first_split.quotient, group = first_split.remainder;
  for (int64_t item = first; item < p.items;
       item += step, row += step_split.quotient, group += step_split.remainder) {
    if (group >= p.groups_per_row) {
      group -= p.groups_per_row;
      ++row;
    }
    const int64_t col = group * gs;
    const int64_t offset = row * p.channels + col;
    const TY* __restrict__ y = static_cast<const TY*>(p.y) + offset;
    const TZ* __restrict__ z = static_cast<const TZ*>(p.z) + offset;
    float kept[kWarpKept];
    float sum_sq = 0.f;
#pragma unroll
    for (int k = 0; k < kWarpKept; ++k) {
      const int j = lane + k * kWarpSize;
      kept[k] = j < gs ? RoundGated(Gated(Widen(y[j]), Widen(z[j])), p.gated) : 0.f;
      sum_sq += kept[k] * kept[k];
    }
    for (int j = lane + kWarpKept * kWarpSize; j < gs; j += kWarpSize) {
      const float h = RoundGated(Gated(Widen(y[j]), Widen(z[j])), p.gated);
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
        const float h = RoundGated(Gated(Widen(y[j]), Widen(z[j])), p.gated);
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

// The half epilogue: weight, norm type and output are one half type (the exporters' decode form C). Two
// elements at a time: one packed rounding of h * nf to the half type, one packed half multiply by the weight
// (exact, see the top of the file), no widening of the weight.
template <typename E, typename TW>
constexpr bool kPackedHalfEpilogue = !std::is_same_v<TW, float> && std::is_same_v<typename E::TNorm, TW> &&
                                     std::is_same_v<typename E::TOut, TW> && std::is_same_v<typename E::TStore, TW>;

template <typename T>
__device__ __forceinline__ uint32_t PackedProduct(uint32_t w_pair, float n0, float n1);
template <>
__device__ __forceinline__ uint32_t PackedProduct<__half>(uint32_t w_pair, float n0, float n1) {
  __half2 w2;
  __builtin_memcpy(&w2, &w_pair, 4);
  const __half2 product = __hmul2(w2, __floats2half2_rn(n0, n1));
  uint32_t bits;
  __builtin_memcpy(&bits, &product, 4);
  return bits;
}
template <>
__device__ __forceinline__ uint32_t PackedProduct<__nv_bfloat16>(uint32_t w_pair, float n0, float n1) {
  __nv_bfloat162 w2;
  __builtin_memcpy(&w2, &w_pair, 4);
  const __nv_bfloat162 product = __hmul2(w2, __floats2bfloat162_rn(n0, n1));
  uint32_t bits;
  __builtin_memcpy(&bits, &product, 4);
  return bits;
}

// Rounds the eight gated values of a chunk to gated_dtype (two at a time: one packed conversion per pair).
__device__ __forceinline__ void RoundGatedChunk(float (&h)[kVec], int gated) {
  if (gated == 1) {
#pragma unroll
    for (int e = 0; e < kVec; e += 2) {
      const float2 r = __half22float2(__floats2half2_rn(h[e], h[e + 1]));
      h[e] = r.x;
      h[e + 1] = r.y;
    }
  } else if (gated == 2) {
#pragma unroll
    for (int e = 0; e < kVec; e += 2) {
      const float2 r = __bfloat1622float2(__floats2bfloat162_rn(h[e], h[e + 1]));
      h[e] = r.x;
      h[e + 1] = r.y;
    }
  }
}

// One group per warps_per_group warps. With one warp per group a block holds groups_per_block groups and needs
// no barrier; with several, a block is exactly one group, so every thread of the block takes the same trips
// through the item loop and the barriers are uniform.
// kChunks: chunks per thread held in registers (1, 2 or kMaxChunks; fewer chunks, fewer registers, more
// resident warps to overlap one group's arithmetic with another's loads).
// Order inside an item: Y and Z loads, the gate pass (Y and Z registers die), then the W loads, issued before
// the reduction so that they are in flight during the shuffles; W is 16-60 KB, read by every row, an L1/L2 hit.
// kFixedEpilogue >= 0: an exporter's form (uniform types, or the half prefill form B) with no gated rounding, one
// epilogue compiled: a kernel a fraction of the size (at decode its code is fetched cold by whichever
// multiprocessors run it, every launch) and without the gated switch (8192 rows: 93 us vs 97 generic).
template <typename TY, typename TZ, typename TW, int kChunks, int kFixedEpilogue = -1>
__global__ void __launch_bounds__(kVectorBlockMax) VectorPathKernel(const KernelParams p) {
  __shared__ float warp_sums[kMaxWarpsPerGroup];
  const int threads_per_group = p.warps_per_group * kWarpSize;
  const int thread = static_cast<int>(threadIdx.x) & (threads_per_group - 1);
  const int chunks = p.group_size / kVec;
  const uint32_t items = static_cast<uint32_t>(p.items);
  const uint32_t stride = gridDim.x * static_cast<uint32_t>(p.groups_per_block);
  for (uint32_t item = blockIdx.x * static_cast<uint32_t>(p.groups_per_block) + (threadIdx.x >> p.group_shift);
       item < items; item += stride) {
    // offset = row * channels + group * group_size = item * group_size: rows are contiguous.
    const int col = static_cast<int>(FastQuotient(item, p).remainder) * p.group_size;
    const int64_t offset = static_cast<int64_t>(item) * p.group_size;
    const TY* __restrict__ y = static_cast<const TY*>(p.y) + offset;
    const TZ* __restrict__ z = static_cast<const TZ*>(p.z) + offset;
    const TW* __restrict__ w = static_cast<const TW*>(p.w) + col;
    // Chunk c of this thread is chunk (thread + c * threads_per_group) of the group: neighbouring threads
    // read neighbouring 16 bytes.
    // One chunk per thread (decode): W is loaded with Y and Z, its L2 latency hidden behind theirs; with more
    // chunks it waits until Y and Z have become h (registers, i.e. occupancy, at prefill sizes).
    constexpr bool kEarlyW = kChunks == 1;
    Chunk<TY> y_chunk[kChunks];
    Chunk<TZ> z_chunk[kChunks];
    Chunk<TW> w_chunk[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int chunk = thread + c * threads_per_group;
      if (chunk < chunks) {
        y_chunk[c] = LoadChunk(y + chunk * kVec);
        z_chunk[c] = LoadChunk(z + chunk * kVec);
        if constexpr (kEarlyW) w_chunk[c] = LoadChunk(w + chunk * kVec);
      }
    }
    float h[kChunks][kVec];
    float sum_sq = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (thread + c * threads_per_group < chunks) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) h[c][e] = Gated(Element(y_chunk[c], e), Element(z_chunk[c], e));
        if constexpr (kFixedEpilogue < 0) RoundGatedChunk(h[c], p.gated);
#pragma unroll
        for (int e = 0; e < kVec; ++e) sum_sq = fmaf(h[c][e], h[c][e], sum_sq);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) h[c][e] = 0.f;
      }
    }
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int chunk = thread + c * threads_per_group;
      if (!kEarlyW && chunk < chunks) w_chunk[c] = LoadChunk(w + chunk * kVec);
    }
    sum_sq = WarpSum(sum_sq);
    if (p.warps_per_group > 1) {
      if (thread % kWarpSize == 0) warp_sums[thread / kWarpSize] = sum_sq;
      __syncthreads();
      sum_sq = 0.f;
#pragma unroll
      for (int i = 0; i < kMaxWarpsPerGroup; ++i) {  // same order in every thread
        if (i < p.warps_per_group) sum_sq += warp_sums[i];
      }
      if (item + stride < items) __syncthreads();  // warp_sums is rewritten by the next item (block-uniform)
    }
    const float inv_rms = FastInvRms(sum_sq, p.inv_group_size, p.epsilon);
    ForEachEpilogue<kFixedEpilogue>(p.epilogue, [&](auto epilogue) {
      using E = decltype(epilogue);
      using TStore = typename E::TStore;
      TStore* __restrict__ out = static_cast<TStore*>(p.out) + offset;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int chunk = thread + c * threads_per_group;
        if (chunk < chunks) {
          if constexpr (kPackedHalfEpilogue<E, TW>) {
            using Half = std::conditional_t<std::is_same_v<TW, float>, __half, TW>;  // TW, never float here
            uint4 packed;
            packed.x = PackedProduct<Half>(w_chunk[c].v[0].x, h[c][0] * inv_rms, h[c][1] * inv_rms);
            packed.y = PackedProduct<Half>(w_chunk[c].v[0].y, h[c][2] * inv_rms, h[c][3] * inv_rms);
            packed.z = PackedProduct<Half>(w_chunk[c].v[0].z, h[c][4] * inv_rms, h[c][5] * inv_rms);
            packed.w = PackedProduct<Half>(w_chunk[c].v[0].w, h[c][6] * inv_rms, h[c][7] * inv_rms);
            *reinterpret_cast<uint4*>(out + chunk * kVec) = packed;
          } else {
            float result[kVec];
#pragma unroll
            for (int e = 0; e < kVec; ++e) result[e] = Finish<E>(h[c][e], inv_rms, Element(w_chunk[c], e));
            StoreChunk(out + chunk * kVec, result);
          }
        }
      }
    });
  }
}

// --- launch of one (Y, Z, W) instantiation ------------------------------------------------------
template <typename TY, typename TZ, typename TW>
void LaunchTyped(const KernelParams& params, const CudaLaunch& launch, int multiprocessors, cudaStream_t stream) {
  if (launch.path == CudaPath::kVector) {
    const int block = params.groups_per_block * params.warps_per_group * kWarpSize;
    const int64_t wanted = (params.items + params.groups_per_block - 1) / params.groups_per_block;
    // One wave at full occupancy in thread slots; the item loop takes the rest. launch.full_grid: one block per
    // groups_per_block items, no second trip through the loop.
    const int64_t resident = static_cast<int64_t>(multiprocessors) * (2048 / block);
    const unsigned grid = static_cast<unsigned>(launch.full_grid || wanted < resident ? wanted : resident);
    // The specialized kernels: the uniform-type forms (decode, form C, and float32) and the exporters' half
    // prefill form B (Y and W float32, a half gate, norm float32, output the gate's type).
    constexpr bool kUniform = std::is_same_v<TY, TZ> && std::is_same_v<TZ, TW>;
    constexpr bool kFormB = std::is_same_v<TY, float> && std::is_same_v<TW, float> && !std::is_same_v<TZ, float>;
    if constexpr (kUniform || kFormB) {
      constexpr int kFixed = kUniform ? kUniformEpilogue<TY> : std::is_same_v<TZ, __half> ? 1 : 3;
      if (launch.specialized && params.gated == 0 && params.epilogue == kFixed) {
        if (launch.chunks_per_thread == 1) {
          VectorPathKernel<TY, TZ, TW, 1, kFixed><<<grid, block, 0, stream>>>(params);
        } else if (launch.chunks_per_thread == 2) {
          VectorPathKernel<TY, TZ, TW, 2, kFixed><<<grid, block, 0, stream>>>(params);
        } else {
          VectorPathKernel<TY, TZ, TW, kMaxChunks, kFixed><<<grid, block, 0, stream>>>(params);
        }
        return;
      }
    }
    if (launch.chunks_per_thread == 1) {
      VectorPathKernel<TY, TZ, TW, 1><<<grid, block, 0, stream>>>(params);
    } else if (launch.chunks_per_thread == 2) {
      VectorPathKernel<TY, TZ, TW, 2><<<grid, block, 0, stream>>>(params);
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
