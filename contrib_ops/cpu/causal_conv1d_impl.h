// Math core of CausalConv1d on the CPU (docs/causal_conv1d.md): the prompt's depthwise causal conv, no ONNX Runtime
// types.
#pragma once

#include <cstdint>

#include "gated_group_rms_norm_impl.h"  // ElemType, IsSupportedElemType, ElemTypeName, SelectedIsa

namespace mambafuse {

// The work is split into items. channels_last: item i -> batch row i / blocks, tokens [64 (i % blocks), ...);
// channels-first: item i -> batch row i / channels, channel i % channels (the whole prompt).
struct CausalConv1dCpuArgs {
  const void* x = nullptr;              // [B, L, C] (channels_last) or [B, C, L]
  const void* weight = nullptr;         // [C, K] (or [C, 1, K]: the same memory)
  const void* bias = nullptr;           // [C]; optional (nullptr)
  const void* initial_state = nullptr;  // [B, C, S]; optional (nullptr: zeros)
  void* y = nullptr;                    // x's shape
  void* final_state = nullptr;          // [B, C, S]
  // channels_last only: the weight as float [K, C] and the bias as float [C] (zeros when absent), made by
  // PrepareChannelsLast once per kernel (constant initializers) or once per call
  const float* weight_kc = nullptr;
  const float* bias_c = nullptr;
  ElemType type = ElemType::kFloat;  // T, of every input and output
  int64_t batch = 0, channels = 0, length = 0, state_len = 0, width = 0;
  bool silu = true;
  bool channels_last = true;
  bool round_once = false;  // v and the sigmoid in float32, y the one rounding to T (else each rounds to T)
};

// The widest kernel the CPU core takes (real models: K = 4).
constexpr int64_t kCausalConv1dMaxWidth = 16;

// Tokens per channels_last item.
constexpr int64_t kCausalConv1dTokenBlock = 64;

// Returns nullptr when the arguments are consistent, else a static description of the problem.
const char* ValidateArgs(const CausalConv1dCpuArgs& args);

// How many items the call has.
int64_t CausalConv1dItems(const CausalConv1dCpuArgs& args);

// Fills weight_kc ([K, C] floats) and bias_c ([C] floats) for a channels_last call.
void PrepareChannelsLast(const CausalConv1dCpuArgs& args, float* weight_kc, float* bias_c);

// Computes items [first_item, last_item) on the instruction-set level SelectedIsa() names.
void CausalConv1dCpu(const CausalConv1dCpuArgs& args, int64_t first_item, int64_t last_item);

}  // namespace mambafuse
