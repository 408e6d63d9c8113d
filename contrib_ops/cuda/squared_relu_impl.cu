// SquaredRelu on CUDA (docs/squared_relu.md):
//
//   y = round_T(r * r),  r = max(x, 0) with NaN kept
//
// A streaming elementwise kernel: each thread loads 16 bytes of x (4 floats, 8 float16 or bfloat16 values), squares
// them in float32 and stores 16 bytes of y; one pass over the data at the copy rate (a Relu and a Mul are two). The
// square of a 16-bit value is exact in float32 and __fmul_rn's float32 product is IEEE's, so the store's rounding
// (or, for float32, the product's) is the only one. The build has no --use_fast_math, so float32 subnormals are
// kept (a bfloat16 or float32 square may be one).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "elem_convert.cuh"
#include "squared_relu_launcher.h"

namespace mambafuse {
namespace {

constexpr int kThreads = 256;
constexpr int kVectorBytes = 16;

__device__ __forceinline__ float SquareOfRelu(float v) {
  const float r = (v > 0.f || v != v) ? v : 0.f;  // NaN compares false with 0 and stays NaN
  return __fmul_rn(r, r);                          // never contracted into an FMA
}

template <typename T>
__global__ void __launch_bounds__(kThreads) SquaredReluVectorKernel(const T* __restrict__ x, T* __restrict__ y,
                                                                     int64_t vectors, int64_t count) {
  constexpr int kPer = kVectorBytes / sizeof(T);
  const int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (v < vectors) {
    uint4 raw = __ldcs(reinterpret_cast<const uint4*>(x) + v);  // read once: stream past L1/L2 residency
    T* values = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int j = 0; j < kPer; ++j) values[j] = Narrow<T>(SquareOfRelu(Widen(values[j])));
    reinterpret_cast<uint4*>(y)[v] = raw;  // a plain store: the next node (a GEMV at decode) reads it from L2
  }
  // the last count % kPer elements, one thread each, in the grid's first threads
  const int64_t tail = vectors * kPer + v;
  if (v < kPer && tail < count) y[tail] = Narrow<T>(SquareOfRelu(Widen(x[tail])));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) SquaredReluScalarKernel(const T* x, T* y, int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < count) y[i] = Narrow<T>(SquareOfRelu(Widen(x[i])));
}

template <typename T>
cudaError_t LaunchTyped(const SquaredReluCpuArgs& a, bool vectorized, cudaStream_t stream) {
  const auto* x = static_cast<const T*>(a.x);
  auto* y = static_cast<T*>(a.y);
  if (vectorized) {
    constexpr int64_t kPer = kVectorBytes / sizeof(T);
    const int64_t vectors = a.count / kPer;
    const int64_t threads = vectors > kPer ? vectors : kPer;  // at least kPer threads for the tail
    const auto blocks = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
    SquaredReluVectorKernel<T><<<blocks, kThreads, 0, stream>>>(x, y, vectors, a.count);
  } else {
    const auto blocks = static_cast<unsigned>((a.count + kThreads - 1) / kThreads);
    SquaredReluScalarKernel<T><<<blocks, kThreads, 0, stream>>>(x, y, a.count);
  }
  return cudaGetLastError();
}

// Whether the launch takes the vector path: x and y 16-byte aligned.
bool Vectorized(const SquaredReluCpuArgs& a) {
  const auto misaligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) % kVectorBytes) != 0; };
  return !misaligned(a.x) && !misaligned(a.y);
}

}  // namespace

const char* CheckSquaredReluArgs(const SquaredReluCpuArgs& a) {
  if (a.type != ElemType::kFloat && a.type != ElemType::kFloat16 && a.type != ElemType::kBFloat16) {
    return "unsupported element type";
  }
  if (a.count < 0) return "negative element count";
  if (a.count > 0 && (a.x == nullptr || a.y == nullptr)) return "null data pointer";
  // the grid is one thread per 16 bytes (or per element on the scalar path): 2^31 - 1 blocks at most
  if (a.count / kThreads >= (int64_t{1} << 31) - 1) return "too many elements for one launch";
  return nullptr;
}

cudaError_t LaunchSquaredRelu(const SquaredReluCpuArgs& a, cudaStream_t stream) {
  if (CheckSquaredReluArgs(a) != nullptr) return cudaErrorInvalidValue;
  if (a.count == 0) return cudaSuccess;
  const bool vectorized = Vectorized(a);
  switch (a.type) {
    case ElemType::kFloat16: return LaunchTyped<__half>(a, vectorized, stream);
    case ElemType::kBFloat16: return LaunchTyped<__nv_bfloat16>(a, vectorized, stream);
    default: return LaunchTyped<float>(a, vectorized, stream);
  }
}

}  // namespace mambafuse
