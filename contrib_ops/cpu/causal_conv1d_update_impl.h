// Math core of CausalConv1dUpdate on the CPU (docs/causal_conv1d_update.md): no ONNX Runtime types.
#pragma once

#include <cstdint>

#include "gated_group_rms_norm_impl.h"  // ElemType, IsSupportedElemType, ElemTypeName, SelectedIsa

namespace mambafuse {

// One call computes a contiguous range of items: item i -> batch row i / channels, channel i % channels.
struct CausalConv1dUpdateCpuArgs {
  const void* x = nullptr;           // [B, C, L]
  const void* conv_state = nullptr;  // [B, C, S]
  const void* weight = nullptr;      // [C, K] (or [C, 1, K]: the same memory)
  const void* bias = nullptr;        // [C]; optional (nullptr)
  void* y = nullptr;                 // [B, C, L]
  void* present_state = nullptr;     // [B, C, S]
  ElemType type = ElemType::kFloat;  // T, of every input and output
  int64_t batch = 0, channels = 0, new_columns = 0, state_len = 0, width = 0;
  bool silu = true;
};

// Returns nullptr when the arguments are consistent, else a static description of the problem.
const char* ValidateArgs(const CausalConv1dUpdateCpuArgs& args);

// Computes items [first_item, last_item) on the instruction-set level SelectedIsa() names.
void CausalConv1dUpdateCpu(const CausalConv1dUpdateCpuArgs& args, int64_t first_item, int64_t last_item);

}  // namespace mambafuse
