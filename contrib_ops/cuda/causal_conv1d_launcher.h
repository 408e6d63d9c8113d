// Launcher of the CausalConv1d CUDA kernels (docs/causal_conv1d.md, CUDA kernel): plain C++ and the CUDA runtime
// types only, because ONNX Runtime's C++ headers do not compile under nvcc 13.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cpu/causal_conv1d_impl.h"  // CausalConv1dCpuArgs: the op's dims, type and pointers, no ORT types

namespace mambafuse {

// For every batch row b and channel c, with window = concat(initial_state[b, c, :] or S zeros, x[b, c, :]):
//   final_state[b, c, j] = window[L + j]                                   j < S, a copy of T's bits
//   v = round_T(sum_k w[c, k] * window[S - K + 1 + t + k] (+ bias[c]))     t < L, float32 in k order, no FMA
//   y[t] = silu ? round_T(v * round_T(sigmoid(v))) : v
// The kernels read CausalConv1dCpuArgs' x, weight, bias, initial_state, y, final_state (device pointers, dense and
// row-major: x and y [B, L, C] with channels_last, else [B, C, L]), its dims, type, silu and channels_last; not its
// CPU-only weight_kc and bias_c. The outputs must not overlap the inputs.

// The kernel the launcher runs for a call (the doc names them):
//   kTiledChannelsLast   x [B, L, C], K = 4: a thread owns a few channels and walks a tile of tokens
//   kVectorChannelsFirst x [B, C, L], K = 4: a thread owns a few consecutive tokens of one channel
//   kStep                L <= 4 (a decode step), K = 4, either layout: a thread per (batch row, channel)
//   kAnyWidth            any K, either layout: a thread per output, its K taps read from memory
enum class CausalConv1dCudaPath { kTiledChannelsLast, kVectorChannelsFirst, kStep, kAnyWidth };

// Which kernel LaunchCausalConv1d runs for these arguments.
CausalConv1dCudaPath ChooseCausalConv1dCudaPath(const CausalConv1dCpuArgs& args);

// Null when the arguments can be launched, else what is wrong.
const char* CheckCausalConv1dCudaArgs(const CausalConv1dCpuArgs& args);

// Enqueues the op on `stream`: no host synchronization, no allocation, safe under CUDA-graph capture (it reads the
// current device's multiprocessor count and the kernel's occupancy, host-side queries). Returns the launch error,
// cudaErrorInvalidValue for arguments CheckCausalConv1dCudaArgs rejects, and cudaSuccess with nothing launched for
// an empty batch or no channels.
cudaError_t LaunchCausalConv1d(const CausalConv1dCpuArgs& args, cudaStream_t stream);

}  // namespace mambafuse
