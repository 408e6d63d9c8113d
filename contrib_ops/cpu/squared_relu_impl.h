// Math core of SquaredRelu on the CPU (docs/squared_relu.md): no ONNX Runtime types.
#pragma once

#include <cstdint>

#include "gated_group_rms_norm_impl.h"  // ElemType, IsSupportedElemType, ElemTypeName, SelectedIsa

namespace mambafuse {

// One call computes a contiguous range of elements (X read as a flat array of `count` elements).
struct SquaredReluCpuArgs {
  const void* x = nullptr;  // any shape, dense
  void* y = nullptr;        // X's shape
  ElemType type = ElemType::kFloat;
  int64_t count = 0;
};

// Returns nullptr when the arguments are consistent, else a static description of the problem.
const char* ValidateArgs(const SquaredReluCpuArgs& args);

// Computes elements [first, last) on the instruction-set level SelectedIsa() names.
void SquaredReluCpu(const SquaredReluCpuArgs& args, int64_t first, int64_t last);

}  // namespace mambafuse
