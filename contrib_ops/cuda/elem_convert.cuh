// The element conversions every CUDA kernel of the library shares: exact widening of T to float, round-to-
// nearest-even narrowing of a float32 value to T, and the float32 value of that rounding (round_T in the ops'
// docs). T is float, __half or __nv_bfloat16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace mambafuse {

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

// round_T(f) as a float: f itself for T = float.
template <typename T>
__device__ __forceinline__ float RoundTo(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    return Widen(Narrow<T>(f));
  }
}

}  // namespace mambafuse
