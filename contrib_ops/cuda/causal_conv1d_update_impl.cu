// CausalConv1dUpdate on CUDA (the math is in causal_conv1d_update_launcher.h and the op's doc).
//
// One thread per (batch, channel): it reads the channel's S state columns and L new columns once (the
// window), writes the S columns of present_state from the window (conv_state is never shifted in place),
// and computes the L outputs from the last K window columns each. At decode (L = 1, K = 4, S = 3 or 4) a
// thread moves ~20 bytes; Nemotron-H-8B's 10240 channels are 80 blocks at batch 1 and the kernel is one
// dependent load-compute-store chain, so the K = 4 kernel has its taps unrolled and, at L = 1, loads each
// window column once, all before the first store (present_state's columns are among the taps' columns).
// The taps are summed in k order as float32 multiplies and adds (no FMA), the bias last, then one rounding
// to T, as the exported Conv; SiLU is Sigmoid then Mul, each rounded to T.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "causal_conv1d_update_launcher.h"
#include "elem_convert.cuh"

namespace mambafuse {
namespace {

constexpr int kBlock = 128;

struct Params {
  const void* x;
  const void* state;
  const void* weight;
  const void* bias;
  void* y;
  void* present;
  int64_t channels;
  int length;
  int state_len;
  int kernel_size;
  int silu;
};

// The activation of one conv output v (already rounded to T): SiLU as the exported Sigmoid and Mul.
template <typename T>
__device__ __forceinline__ T Activate(float v, int silu) {
  if (!silu) return Narrow<T>(v);
  const float e = expf(-fabsf(v));  // never overflows: both halves keep their relative accuracy
  const float sigmoid = RoundTo<T>(v >= 0.f ? 1.f / (1.f + e) : e / (1.f + e));
  return Narrow<T>(__fmul_rn(v, sigmoid));
}

// kK > 0: the kernel size, taps unrolled; kK == 0: any kernel size (p.kernel_size).
template <typename T, int kK>
__global__ void __launch_bounds__(kBlock) ConvUpdateKernel(const Params p) {
  const int64_t channel = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x;
  if (channel >= p.channels) return;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * p.channels + channel;
  const int s_len = p.state_len, length = p.length;
  const int k_size = kK > 0 ? kK : p.kernel_size;
  const T* state = static_cast<const T*>(p.state) + row * s_len;
  const T* x = static_cast<const T*>(p.x) + row * length;
  const T* w = static_cast<const T*>(p.weight) + channel * k_size;
  // Window column i: the state for i < S, the new input after it.
  const auto window = [&](int i) -> T { return i < s_len ? state[i] : x[i - s_len]; };

  T* present = static_cast<T*>(p.present) + row * s_len;
  const float bias = p.bias != nullptr ? Widen(static_cast<const T*>(p.bias)[channel]) : 0.f;
  T* y = static_cast<T*>(p.y) + row * length;
  if constexpr (kK > 0) {
    if (length == 1 && s_len <= kK) {
      // Decode: the K taps' window columns S - K + 1 .. S hold every column of present_state (window[1 .. S],
      // since S >= K - 1), so each column is loaded once, all before the first store or multiply.
      T raw[kK];
      float taps[kK];
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        raw[k] = window(s_len - kK + 1 + k);
        taps[k] = Widen(w[k]);
      }
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        const int j = k - (kK - s_len);  // present column j is window column 1 + j, tap k
        if (j >= 0) present[j] = raw[k];
      }
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < kK; ++k) acc = __fadd_rn(acc, __fmul_rn(taps[k], Widen(raw[k])));
      if (p.bias != nullptr) acc = __fadd_rn(acc, bias);
      y[0] = Activate<T>(RoundTo<T>(acc), p.silu);
      return;
    }
  }
  for (int j = 0; j < s_len; ++j) present[j] = window(length + j);
  for (int t = 0; t < length; ++t) {
    const int first = s_len - k_size + 1 + t;
    float acc = 0.f;
    if constexpr (kK > 0) {
      float taps[kK], values[kK];
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        taps[k] = Widen(w[k]);
        values[k] = Widen(window(first + k));
      }
#pragma unroll
      for (int k = 0; k < kK; ++k) acc = __fadd_rn(acc, __fmul_rn(taps[k], values[k]));
    } else {
      for (int k = 0; k < k_size; ++k) acc = __fadd_rn(acc, __fmul_rn(Widen(w[k]), Widen(window(first + k))));
    }
    if (p.bias != nullptr) acc = __fadd_rn(acc, bias);
    y[t] = Activate<T>(RoundTo<T>(acc), p.silu);
  }
}

template <typename T>
void LaunchTyped(const Params& params, dim3 grid, cudaStream_t stream) {
  if (params.kernel_size == 4) {
    ConvUpdateKernel<T, 4><<<grid, kBlock, 0, stream>>>(params);
  } else {
    ConvUpdateKernel<T, 0><<<grid, kBlock, 0, stream>>>(params);
  }
}

}  // namespace

const char* CheckCausalConv1dUpdateArgs(const CausalConv1dUpdateArgs& a) {
  if (a.type != ElemType::kFloat && a.type != ElemType::kFloat16 && a.type != ElemType::kBFloat16) {
    return "the type is not float, float16 or bfloat16";
  }
  if (a.batch < 0 || a.channels < 0 || a.length < 0 || a.state_len < 0 || a.kernel_size < 1) {
    return "negative sizes or a kernel size below 1";
  }
  if (a.state_len < a.kernel_size - 1) return "the state is shorter than kernel_size - 1";
  if (a.batch > 65535 || a.channels / kBlock >= INT_MAX || a.length > INT_MAX / 4 || a.state_len > INT_MAX / 4 ||
      a.kernel_size > INT_MAX / 4) {
    return "a dimension is beyond the kernel's grid (batch <= 65535)";
  }
  return nullptr;
}

cudaError_t LaunchCausalConv1dUpdate(const CausalConv1dUpdateArgs& a, cudaStream_t stream) {
  if (CheckCausalConv1dUpdateArgs(a) != nullptr) return cudaErrorInvalidValue;
  if (a.batch == 0 || a.channels == 0 || (a.length == 0 && a.state_len == 0)) return cudaSuccess;
  Params params{};
  params.x = a.x;
  params.state = a.conv_state;
  params.weight = a.weight;
  params.bias = a.bias;
  params.y = a.y;
  params.present = a.present_state;
  params.channels = a.channels;
  params.length = static_cast<int>(a.length);
  params.state_len = static_cast<int>(a.state_len);
  params.kernel_size = static_cast<int>(a.kernel_size);
  params.silu = a.silu;
  const dim3 grid(static_cast<unsigned>((a.channels + kBlock - 1) / kBlock), static_cast<unsigned>(a.batch));
  switch (a.type) {
    case ElemType::kFloat: LaunchTyped<float>(params, grid, stream); break;
    case ElemType::kFloat16: LaunchTyped<__half>(params, grid, stream); break;
    default: LaunchTyped<__nv_bfloat16>(params, grid, stream); break;
  }
  // The launch's own error (bad configuration, no device, no kernel image for this GPU); never a sync.
  return cudaGetLastError();
}

}  // namespace mambafuse
