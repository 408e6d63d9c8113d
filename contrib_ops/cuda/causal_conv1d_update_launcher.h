// Launcher of the CausalConv1dUpdate CUDA kernel (docs/causal_conv1d_update.md): plain C++ and the CUDA
// runtime types only, because ONNX Runtime's C++ headers do not compile under nvcc 13.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cpu/gated_group_rms_norm_impl.h"  // ElemType (ONNX element type numbers): no ORT types

namespace mambafuse {

// For every (batch b, channel c), with window = concat(conv_state[b, c, :], x[b, c, :]) (S + L columns):
//   present_state[b, c, j] = window[L + j]                              j < S (the last S columns)
//   v = round_T(sum_k w[c, k] * window[S - K + 1 + t + k] (+ bias[c]))  t < L, float32 in k order
//   y[b, c, t] = silu ? round_T(v * round_T(sigmoid(v))) : v
// All tensors of type T, dense and row-major: x and y (B, C, L), conv_state and present_state (B, C, S),
// weight (C, K) (or (C, 1, K), the same bytes), bias (C). S >= K - 1; present_state must not overlap conv_state.
struct CausalConv1dUpdateArgs {
  const void* x = nullptr;
  const void* conv_state = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;  // optional
  void* y = nullptr;
  void* present_state = nullptr;
  ElemType type = ElemType::kFloat;
  int64_t batch = 0;
  int64_t channels = 0;
  int64_t length = 0;       // L
  int64_t state_len = 0;    // S
  int64_t kernel_size = 0;  // K
  bool silu = true;
};

// Null when the arguments can be launched, else what is wrong.
const char* CheckCausalConv1dUpdateArgs(const CausalConv1dUpdateArgs& args);

// Enqueues the op on `stream`: no host synchronization, no allocation, safe under CUDA-graph capture.
// Returns the launch error, cudaErrorInvalidValue for arguments CheckCausalConv1dUpdateArgs rejects, and
// cudaSuccess with nothing launched for an empty tensor.
cudaError_t LaunchCausalConv1dUpdate(const CausalConv1dUpdateArgs& args, cudaStream_t stream);

}  // namespace mambafuse
